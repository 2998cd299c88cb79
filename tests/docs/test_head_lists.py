"""Every list of heads names every head, and the package's overviews every pure-layer name.

The names are read from ``__all__`` at run time: a head added to ``samplers.__all__``
(a public name ending in ``Sampler``, or ``head_for``) fails here until the README, the
package docstring, the documentation's index and the examples' docstring mention it,
and a name added to ``samplers.distributions.__all__`` until the package docstring and
the index do.
"""

import ast
import pathlib
import re

import pytest

import samplers
import samplers.distributions

ROOT = pathlib.Path(__file__).parents[2]


def _docstring(path: str) -> str:
    # Read from the source, not __doc__: python -O drops docstrings.
    return ast.get_docstring(ast.parse((ROOT / path).read_text())) or ""


TEXTS = {
    "README.md": lambda: (ROOT / "README.md").read_text(),
    "the package docstring (samplers/__init__.py)": lambda: _docstring("samplers/__init__.py"),
    "docs/index.md": lambda: (ROOT / "docs" / "index.md").read_text(),
    "the examples' docstring (samplers/examples/__init__.py)": lambda: _docstring(
        "samplers/examples/__init__.py"
    ),
}
OVERVIEWS = [
    "the package docstring (samplers/__init__.py)",
    "docs/index.md",
]


def _heads() -> list[str]:
    return [n for n in samplers.__all__ if n.endswith("Sampler") or n == "head_for"]


def _missing(names: list[str], text: str) -> list[str]:
    """The names that ``text`` never mentions as a whole identifier."""
    return [n for n in names if not re.search(rf"(?<!\w){re.escape(n)}(?!\w)", text)]


def test_a_name_counts_only_as_a_whole_identifier():
    text = "``NormalTanhSampler``, :class:`samplers.MultiDiscreteSampler`, `head_for(space)`"
    assert _missing(["NormalTanhSampler", "MultiDiscreteSampler", "head_for"], text) == []
    assert _missing(["Tanh", "MultiDiscrete", "Sampler", "head"], text) == [
        "Tanh",
        "MultiDiscrete",
        "Sampler",
        "head",
    ]


def test_the_heads_are_read_from_all():
    heads = _heads()
    assert "head_for" in heads and "NormalTanhSampler" in heads and "BetaSampler" in heads
    assert all(n in samplers.__all__ for n in heads)


@pytest.mark.parametrize("label", list(TEXTS))
def test_every_head_is_listed(label):
    missing = _missing(_heads(), TEXTS[label]())
    assert not missing, f"{label} does not mention the heads {missing}; add each to its list."


@pytest.mark.parametrize("label", OVERVIEWS)
def test_every_name_of_the_pure_layer_is_listed(label):
    missing = _missing(list(samplers.distributions.__all__), TEXTS[label]())
    assert not missing, (
        f"{label} does not mention {missing} of samplers.distributions.__all__; "
        f"add each to its description of the pure layer."
    )


def test_every_head_derives_from_action_sampler():
    # The lists call ActionSampler the base class of every head.
    heads = [getattr(samplers, n) for n in _heads() if n.endswith("Sampler")]
    assert all(issubclass(h, samplers.ActionSampler) for h in heads)
