"""Free functions that repeated a ``SquashedNormal`` method: aliases, deprecated.

Each one warns and calls the method, which is the one implementation.
"""

import warnings

from jaxtyping import Array, ArrayLike, Float

from samplers.distributions import _squashed
from samplers.distributions.bijectors import bijector_name, squashing
from samplers.distributions.squashed_normal import SquashedNormal


def _warn(old: str, new: str) -> None:
    warnings.warn(
        f"samplers.{old} is deprecated and will be removed in 0.5; use {new}.",
        DeprecationWarning,
        stacklevel=3,
    )


def _require(dist, name: str) -> None:
    if not isinstance(dist, SquashedNormal):
        raise TypeError(
            f"{name} must be a samplers.SquashedNormal, got {type(dist).__name__}; build it "
            f"with samplers.normal_tanh or samplers.squashed_normal."
        )


def log_prob_from_action(
    dist: SquashedNormal,
    action: Float[ArrayLike, "*sample_and_batch action"],
    *,
    min_distance: float | None = None,
) -> Float[Array, "*sample_and_batch"]:
    """Deprecated: ``dist.log_prob(action, min_distance=min_distance)``.

    Example:
        >>> import jax.numpy as jnp, pytest, samplers
        >>> dist = samplers.normal_tanh(jnp.zeros(2))
        >>> with pytest.deprecated_call():
        ...     samplers.log_prob_from_action(dist, jnp.array([0.999]))
        Array(-9.3246, dtype=float32)
    """
    _warn("log_prob_from_action(dist, action)", "dist.log_prob(action)")
    _require(dist, "dist")
    return dist.log_prob(action, min_distance=min_distance)


def mode(dist: SquashedNormal) -> Float[Array, "*batch action"]:
    """Deprecated: ``dist.mode()``.

    Example:
        >>> import jax.numpy as jnp, pytest, samplers
        >>> dist = samplers.squashed_normal_from_std(jnp.array([0.3]), jnp.array([1.0]))
        >>> with pytest.deprecated_call():
        ...     samplers.mode(dist)
        Array([0.978], dtype=float32)
    """
    _warn("mode(dist)", "dist.mode()")
    _require(dist, "dist")
    return dist.mode()


def mode_pre_image(dist: SquashedNormal) -> Float[Array, "*batch action"]:
    """Deprecated: the pre-image of ``dist.mode()``.

    ``dist.mode()`` remembers its pre-image, so ``dist.log_prob(dist.mode())``
    scores it exactly, also where the mode rounds onto a bound.

    Example:
        >>> import jax.numpy as jnp, pytest, samplers
        >>> dist = samplers.squashed_normal_from_std(jnp.array([0.5]), jnp.array([0.3]))
        >>> with pytest.deprecated_call():
        ...     samplers.mode_pre_image(dist)
        Array([0.596], dtype=float32)
    """
    _warn("mode_pre_image(dist)", "dist.mode(), whose log_prob scores its pre-image")
    _require(dist, "dist")
    bounds = squashing(dist.bijector)
    if bounds is None:
        raise TypeError(
            f"mode_pre_image supports the squashings onto bounds, got "
            f"{bijector_name(dist.bijector)}; for the identity the mode is dist.loc."
        )
    return _squashed.mode_pre_image(dist.loc, dist.scale, bounds.pre_image_scale)


def kl_divergence(p: SquashedNormal, q: SquashedNormal) -> Float[Array, "*batch"]:
    """Deprecated: ``p.kl_divergence(q)``.

    Example:
        >>> import jax.numpy as jnp, pytest, samplers
        >>> p = samplers.SquashedNormal(jnp.zeros(2), jnp.ones(2), samplers.Tanh())
        >>> q = samplers.SquashedNormal(jnp.ones(2), jnp.ones(2), samplers.Tanh())
        >>> with pytest.deprecated_call():
        ...     samplers.kl_divergence(p, q)
        Array(1., dtype=float32)
    """
    _warn("kl_divergence(p, q)", "p.kl_divergence(q)")
    _require(p, "p")
    _require(q, "q")
    return p.kl_divergence(q)
