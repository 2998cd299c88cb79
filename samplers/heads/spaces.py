"""``head_for``: the head for a gymnasium or gymnax action space.

Spaces are recognised by their class name and attributes (duck typing), so that
neither gymnasium nor gymnax is a dependency: ``Box`` (``low``, ``high``,
``shape``, ``dtype``), ``Discrete`` (``n``), ``MultiDiscrete`` (``nvec``) and
``MultiBinary`` (``n``).
"""

from typing import Any

import distrax
import numpy as np
from flax import nnx

from samplers.distributions.bijectors import BoundedTanh, Tanh
from samplers.heads.action_sampler import ActionSampler
from samplers.heads.discrete import CategoricalSampler, MultiBinarySampler, MultiDiscreteSampler
from samplers.heads.squashed_normal import SquashedNormalSampler


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
    ========================  ==================================================

    A ``Box`` must be one-dimensional and floating, with every dimension bounded
    on both sides or on neither: tanh cannot map onto a half-line, so a box
    bounded on one side only is refused rather than given a head whose actions
    miss part of it. ``Discrete`` and ``MultiDiscrete`` must start at 0.
    Anything else (``Dict``, ``Tuple``, ``Text``, ``Graph``, ...) is refused.

    Args:
        space: A gymnasium or gymnax action space.
        rngs: The ``nnx.Rngs`` (or ``nnx.RngStream``) the head draws from.
        entropy_weight: Weight of the entropy bonus, finite.
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
    """
    kind = type(space).__name__
    if kind == "Box":
        dim, bijector = _box_squashing(space)
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
        f"head_for builds heads for Box, Discrete, MultiDiscrete and MultiBinary spaces, "
        f"got {type(space).__module__}.{kind}: {space!r}; build the head directly, e.g. "
        f"samplers.DistributionSampler with your own distribution."
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
        raise ValueError(
            f"head_for needs each Box dimension bounded on both sides or on neither, got "
            f"low={low.tolist()}, high={high.tolist()} (dimensions "
            f"{np.flatnonzero(~finite & ~unbounded).tolist()} are half-bounded or NaN); "
            f"tanh cannot map onto a half-line. Bound them, or build a SquashedNormalSampler "
            f"with a bijector of your own."
        )
    if np.all(low == -1.0) and np.all(high == 1.0):
        return dim, Tanh()
    dtype = np.dtype(space.dtype)
    return dim, BoundedTanh(low.astype(dtype), high.astype(dtype))


def _refuse_start(space, kind: str) -> None:
    start = np.asarray(getattr(space, "start", 0))
    if np.any(start != 0):
        raise ValueError(
            f"head_for supports a {kind} space starting at 0, got start={start.tolist()}; "
            f"the head's actions are 0-based, so build the space without start and add "
            f"{start.tolist()} to the action in the environment."
        )
