"""The two test tiers: ``python -m pytest`` runs the default one, ``-m slow`` the rest.

A parametrized test keeps at least one case of every comparison in the default tier;
the cases that repeat it (other batch shapes, eager beside traced) are slow.
"""

import itertools

import pytest

SLOW = pytest.mark.slow


def slow(*values, id=None):
    """A parameter case that runs in the slow tier only (``python -m pytest -m slow``)."""
    return pytest.param(*values, id=id, marks=SLOW)


# The leading shapes the library supports: (), (B,), (T, B). The default tier runs the
# most general one; the slow tier adds the others.
BATCH_SHAPES = [slow((), id="(A,)"), slow((5,), id="(B,A)"), pytest.param((3, 4), id="(T,B,A)")]

# Eager and traced execution of one test. Where tracing is not the point, the default
# tier runs the traced case only, as a training loop does.
JIT_MODES = [slow(False, id="eager"), pytest.param(True, id="nnx.jit")]


def each_value_once(axes, slow_ids=()):
    """The product of ``axes`` as ``parametrize`` arguments, most of it slow.

    ``axes`` maps argument names to ``{id: value}``; a name like ``"ours, theirs"``
    takes a tuple of values. The default tier runs a diagonal of the product in which
    every value of every axis appears at least once, except the values named in
    ``slow_ids``; the slow tier runs the rest.

    >>> names, cases = each_value_once({"n": {"1": 1, "2": 2}, "s": {"a": "a", "b": "b"}})
    >>> names, [case.id for case in cases if not case.marks]
    ('n, s', ['1-a', '2-b'])
    """
    options = [list(values.items()) for values in axes.values()]
    fast = [[i for i, (id_, _) in enumerate(o) if id_ not in slow_ids] for o in options]
    diagonal = {tuple(f[i % len(f)] for f in fast) for i in range(max(map(len, fast)))}
    cases = []
    for index in itertools.product(*(range(len(o)) for o in options)):
        chosen = [o[i] for o, i in zip(options, index, strict=True)]
        values = []
        for name, (_, value) in zip(axes, chosen, strict=True):
            values.extend(value if "," in name else [value])
        marks = [] if index in diagonal else [SLOW]
        cases.append(pytest.param(*values, id="-".join(i for i, _ in chosen), marks=marks))
    return ", ".join(axes), cases
