"""``head_for``: the head for a gymnasium or gymnax action space.

Spaces are recognised by their class name and attributes (duck typing), so that
neither gymnasium nor gymnax is a dependency: ``Box`` (``low``, ``high``,
``shape``, ``dtype``), ``Discrete`` (``n``), ``MultiDiscrete`` (``nvec``),
``MultiBinary`` (``n``), and ``Dict`` and ``Tuple`` (``spaces``).
"""

from typing import Any

import distrax
import numpy as np
from flax import nnx

from samplers.distributions.bijectors import BoundedTanh, Tanh
from samplers.heads.action_sampler import ActionSampler
from samplers.heads.beta import BetaSampler
from samplers.heads.composite import CompositeSampler
from samplers.heads.discrete import CategoricalSampler, MultiBinarySampler, MultiDiscreteSampler
from samplers.heads.squashed_normal import SquashedNormalSampler

# The options every head takes; the others are the squashed-Normal heads', for Box parts.
_EVERY_HEAD = frozenset({"per_env_streams", "rng_collection"})


def head_for(
    space: Any,
    *,
    rngs: nnx.Rngs | nnx.RngStream,
    entropy_weight: float,
    **options,
) -> ActionSampler:
    """The policy head for an action space; ``head.num_params`` sizes the network.

    ========================  ==================================================
    Space                     Head
    ========================  ==================================================
    ``Box``, finite bounds    :class:`SquashedNormalSampler` onto the box:
                              ``Tanh()`` for ``[-1, 1]``, else
                              ``BoundedTanh(low, high)``; ``num_params`` is
                              ``2 * dim`` (``[mean | raw_std]``)
    ``Box``, no bounds        :class:`SquashedNormalSampler` with the identity
                              (an unsquashed Normal, as SB3's ``DiagGaussian``)
                              and ``entropy="base"``, its exact entropy
    ``Discrete(n)``           :class:`CategoricalSampler`, ``num_params = n``
    ``MultiDiscrete(nvec)``   :class:`MultiDiscreteSampler`, ``sum(nvec)``
    ``MultiBinary(n)``        :class:`MultiBinarySampler`, ``n``
    ``Dict``, ``Tuple``       :class:`CompositeSampler` of the parts' heads, built
                              the same way (nested spaces too), in the space's
                              own order (``space.spaces`` as it iterates); the
                              action is a dict with the space's keys, or a tuple;
                              ``num_params`` is the sum of the parts'
    ========================  ==================================================

    ``head="beta"`` asks for a :class:`BetaSampler` on a bounded ``Box``'s bounds
    instead of the squashed Normal (``num_params`` is ``2 * dim`` too); inside a
    ``Dict`` or ``Tuple`` it applies to every ``Box`` part.

    A ``Box`` must be one-dimensional and floating, with every dimension bounded
    on both sides or every dimension unbounded: tanh cannot map onto a half-line,
    so a box bounded on one side only is refused rather than given a head whose
    actions miss part of it, and a box mixing bounded and unbounded dimensions is
    refused with the advice to split it into a ``Tuple`` (the error names each
    dimension and what it is). ``Discrete`` and ``MultiDiscrete`` must start at 0.
    Anything else (``Text``, ``Graph``, ``Sequence``, ...) is refused, also as a
    part of a ``Dict`` or ``Tuple``, naming the part.

    Inside a ``Dict`` or ``Tuple``, a bounded ``Box`` part gets ``entropy="exact"``
    (its exact entropy; see :class:`SquashedNormalSampler` for its cost) and an
    unbounded one ``"base"`` (also exact), so that the composite's entropy bonus is
    exact throughout unless ``entropy=`` is passed. Options reach every part that takes
    them: ``per_env_streams`` and ``rng_collection`` every part, the squashed-Normal
    options (``min_std``, ``entropy``, ...) every ``Box`` part; an option that no
    part takes, and ``bijector`` (each box's bounds choose its squashing), are
    refused. For settings that differ between parts (an ``entropy_weight`` per part,
    say), build the parts and a :class:`CompositeSampler` directly. A choice whose
    parameters count only when chosen is a :class:`ParameterizedSampler`, built
    directly: a ``Tuple(Discrete(n), Tuple(...))`` space gets independent parts.

    Args:
        space: A gymnasium or gymnax action space.
        rngs: The ``nnx.Rngs`` (or ``nnx.RngStream``) the head draws from; a
            composite draws one key from it (from ``rng_collection`` when given) for
            its parts' streams.
        entropy_weight: Weight of the entropy bonus, finite (every part's).
        **options: The head's own keyword options (``per_env_streams``,
            ``min_std``, ``entropy``, ...), passed on.

    Returns:
        The head, with ``num_params``, the network output size it expects.

    Raises:
        TypeError: ``space`` is not one of the spaces above.
        ValueError: the space is one of them but has a shape, dtype, bounds or
            start the heads do not support; the message says which and how.

    Example:
        >>> import jax.numpy as jnp, samplers
        >>> from flax import nnx
        >>> from gymnasium import spaces
        >>> head = samplers.head_for(spaces.Discrete(4), rngs=nnx.Rngs(0), entropy_weight=0.01)
        >>> type(head).__name__, head.num_params
        ('CategoricalSampler', 4)
        >>> box = spaces.Box(low=-2.0, high=2.0, shape=(3,))
        >>> samplers.head_for(box, rngs=nnx.Rngs(0), entropy_weight=0.01).num_params
        6
        >>> both = spaces.Dict({"fire": spaces.Discrete(4), "aim": box})
        >>> samplers.head_for(both, rngs=nnx.Rngs(0), entropy_weight=0.01).num_params
        10
    """
    kind = type(space).__name__
    if _is_composite(space):
        _check_composite_options(space, options)
        parts = _parts(space, (), rngs, entropy_weight, options)
        return CompositeSampler(
            parts, rngs=rngs, rng_collection=options.get("rng_collection", "action")
        )
    if kind == "Box":
        dim, bijector = _box_squashing(space)
        head = options.pop("head", "squashed_normal")
        if head == "beta":
            return _beta(space, dim, bijector, rngs, entropy_weight, options)
        if head != "squashed_normal":
            raise ValueError(
                f"head_for builds a Box's head as head='squashed_normal' (the default) or "
                f"head='beta', got head={head!r}; pick one of those."
            )
        if bijector is None:
            options.setdefault("entropy", "base")
            bijector = distrax.Lambda(lambda x: x)
        return SquashedNormalSampler(
            rngs, entropy_weight, action_dim=dim, bijector=bijector, **options
        )
    if kind == "Discrete":
        _refuse_start(space, kind)
        return CategoricalSampler(rngs, entropy_weight, int(space.n), **options)
    if kind == "MultiDiscrete":
        _refuse_start(space, kind)
        nvec = np.asarray(space.nvec)
        if nvec.ndim != 1:
            raise ValueError(
                f"head_for supports a one-dimensional MultiDiscrete, got nvec of shape "
                f"{nvec.shape}; flatten it, e.g. MultiDiscrete(space.nvec.ravel()), and "
                f"reshape the action."
            )
        return MultiDiscreteSampler(rngs, entropy_weight, tuple(nvec.tolist()), **options)
    if kind == "MultiBinary":
        shape = np.shape(space.n)
        if shape not in ((), (1,)):
            raise ValueError(
                f"head_for supports a MultiBinary of one axis, got shape {space.n}; flatten "
                f"it, e.g. MultiBinary({int(np.prod(space.n))}), and reshape the action."
            )
        return MultiBinarySampler(rngs, entropy_weight, int(np.ravel(space.n)[0]), **options)
    raise TypeError(
        f"head_for builds heads for Box, Discrete, MultiDiscrete, MultiBinary, Dict and "
        f"Tuple spaces, got {type(space).__module__}.{kind}: {space!r}; build the head "
        f"directly, e.g. samplers.DistributionSampler with your own distribution."
    )


def _box_squashing(space) -> tuple[int, distrax.Bijector | None]:
    """The action dimension and the squashing onto the box (``None``: unbounded)."""
    if len(space.shape) != 1:
        raise ValueError(
            f"head_for supports a one-dimensional Box, got shape {tuple(space.shape)}; "
            f"flatten it, e.g. Box(low.ravel(), high.ravel()), and reshape the action."
        )
    if not np.issubdtype(np.dtype(space.dtype), np.floating):
        raise ValueError(
            f"head_for supports a floating Box, got dtype {np.dtype(space.dtype)}; use a "
            f"Discrete or MultiDiscrete space for integer actions."
        )
    dim = int(space.shape[0])
    low = np.broadcast_to(np.asarray(space.low, np.float64), (dim,))
    high = np.broadcast_to(np.asarray(space.high, np.float64), (dim,))
    finite = np.isfinite(low) & np.isfinite(high)
    unbounded = (low == -np.inf) & (high == np.inf)
    if np.all(unbounded):
        return dim, None
    if not np.all(finite):
        raise ValueError(_mixed_bounds_message(low, high, finite, unbounded))
    if np.all(low == -1.0) and np.all(high == 1.0):
        return dim, Tanh()
    dtype = np.dtype(space.dtype)
    return dim, BoundedTanh(low.astype(dtype), high.astype(dtype))


def _mixed_bounds_message(low, high, bounded, unbounded) -> str:
    """Names each dimension of a Box that is not bounded throughout (nor unbounded
    throughout) as bounded, unbounded, half-bounded or with a NaN bound, and the fix."""
    nan = np.isnan(low) | np.isnan(high)
    half = ~bounded & ~unbounded & ~nan
    kinds = {"bounded": bounded, "unbounded": unbounded, "half-bounded": half, "NaN": nan}
    found = ", ".join(
        f"{np.flatnonzero(where).tolist()} {kind}" for kind, where in kinds.items() if np.any(where)
    )
    if np.any(half | nan):
        reason = "tanh cannot map onto a half-line" if np.any(half) else "NaN bounds nothing"
        fix = (
            f"{reason}, so give dimensions {np.flatnonzero(half | nan).tolist()} finite bounds "
            f"on both sides (or none), or build a SquashedNormalSampler with a bijector of "
            f"your own"
        )
    else:
        fix = (
            f"one head squashes every dimension of a Box or none, so split it into a Tuple of "
            f"a bounded Box (dimensions {np.flatnonzero(bounded).tolist()}) and an unbounded "
            f"one (dimensions {np.flatnonzero(unbounded).tolist()}), which head_for gives a "
            f"head each"
        )
    return (
        f"head_for needs each Box dimension bounded on both sides, or each unbounded, got "
        f"low={low.tolist()}, high={high.tolist()}: dimensions {found}; {fix}."
    )


def _beta(space, dim: int, bijector, rngs, entropy_weight, options: dict) -> BetaSampler:
    """The :class:`BetaSampler` onto a bounded ``Box``."""
    if bijector is None:
        raise ValueError(
            f"head='beta' needs a Box with finite bounds, got low={space.low!r}, "
            f"high={space.high!r}; bound the box, or use the default squashed Normal."
        )
    dtype = np.dtype(space.dtype)
    low = np.broadcast_to(np.asarray(space.low, dtype), (dim,))
    high = np.broadcast_to(np.asarray(space.high, dtype), (dim,))
    return BetaSampler(rngs, entropy_weight, action_dim=dim, low=low, high=high, **options)


def _refuse_start(space, kind: str) -> None:
    start = np.asarray(getattr(space, "start", 0))
    if np.any(start != 0):
        raise ValueError(
            f"head_for supports a {kind} space starting at 0, got start={start.tolist()}; "
            f"the head's actions are 0-based, so build the space without start and add "
            f"{start.tolist()} to the action in the environment."
        )


def _is_composite(space) -> bool:
    return type(space).__name__ in ("Dict", "Tuple") and hasattr(space, "spaces")


def _items(space) -> list[tuple[Any, Any]]:
    """A ``Dict``'s ``(key, part)`` or a ``Tuple``'s ``(index, part)``, as they iterate."""
    if type(space).__name__ == "Dict":
        return list(space.spaces.items())
    return list(enumerate(space.spaces))


def _leaves(space, path: tuple[str, ...] = ()):
    """``(path, space)`` of every part that is not itself a ``Dict`` or ``Tuple``."""
    for name, part in _items(space):
        if _is_composite(part):
            yield from _leaves(part, (*path, str(name)))
        else:
            yield (*path, str(name)), part


def _check_composite_options(space, options: dict) -> None:
    """Refuses the options that no part of a ``Dict`` or ``Tuple`` space can take."""
    kind = type(space).__name__
    if "bijector" in options:
        raise TypeError(
            f"head_for takes no bijector for a {kind} space: each Box part's bounds choose "
            f"its squashing; build that part as SquashedNormalSampler(..., bijector=...) and "
            f"the composite with samplers.CompositeSampler."
        )
    box_options = sorted(set(options) - _EVERY_HEAD)
    leaves = list(_leaves(space))
    if box_options and not any(type(part).__name__ == "Box" for _, part in leaves):
        parts = {"/".join(path): type(part).__name__ for path, part in leaves}
        raise TypeError(
            f"head_for got {box_options}, options of the Box heads, for a {kind} space "
            f"without a Box part (its parts: {parts}); leave them out, or pass only "
            f"{sorted(_EVERY_HEAD)}."
        )


def _parts(space, path: tuple[str, ...], rngs, entropy_weight, options: dict):
    """The heads of a ``Dict`` (a dict) or ``Tuple`` (a tuple) space's parts."""
    kind = type(space).__name__
    items = _items(space)
    if not items:
        where = f"part {'/'.join(path)!r} of the action space" if path else "the action space"
        raise ValueError(
            f"head_for needs at least one part in a {kind} space, got {space!r} as {where}; "
            f"leave the empty space out."
        )
    heads = {}
    for name, part in items:
        where = (*path, str(name))
        if kind == "Dict" and not isinstance(name, str):
            raise TypeError(
                f"head_for needs str keys in a Dict space, got {name!r} in part "
                f"{'/'.join(path) or 'at the top'}; key the space by strings."
            )
        if _is_composite(part):
            # A placeholder stream: the outermost composite gives every part its own.
            heads[name] = CompositeSampler(
                _parts(part, where, rngs, entropy_weight, options), rngs=nnx.Rngs(0)
            )
        else:
            heads[name] = _leaf(part, where, rngs, entropy_weight, options)
    return heads if kind == "Dict" else tuple(heads.values())


def _leaf(space, path: tuple[str, ...], rngs, entropy_weight, options: dict) -> ActionSampler:
    """A part's head, with the options it takes; an error names the part."""
    try:
        if type(space).__name__ == "Box":
            options = dict(options)
            # The Beta head's entropy is always its exact one.
            if _box_squashing(space)[1] is not None and options.get("head") != "beta":
                options.setdefault("entropy", "exact")
        else:
            options = {name: options[name] for name in _EVERY_HEAD & set(options)}
        return head_for(space, rngs=rngs, entropy_weight=entropy_weight, **options)
    except (TypeError, ValueError) as error:
        raise type(error)(f"part {'/'.join(path)!r} of the action space: {error}") from error
