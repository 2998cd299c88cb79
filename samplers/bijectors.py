"""Elementwise bijectors: tanh, tanh onto per-dimension bounds, and sigmoid."""

from typing import NamedTuple

import distrax
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float

from samplers._numerics import softplus, tanh_log_det


class Tanh(distrax.Tanh):
    """``distrax.Tanh`` with a log-determinant that is cheaper to differentiate.

    The same maps and the same values to float32 rounding, but the
    log-determinant and its derivative share one ``exp(-2|x|)``, which XLA
    does not find by itself. :func:`samplers.normal_tanh` uses it.

    Example:
        >>> import jax.numpy as jnp, samplers
        >>> samplers.Tanh().forward_and_log_det(jnp.array([0.0, 20.0]))
        (Array([0., 1.], dtype=float32), Array([  0.      , -38.613705], dtype=float32))
    """

    def forward_log_det_jacobian(self, x):
        return tanh_log_det(x)

    def forward_and_log_det(self, x):
        return jnp.tanh(x), tanh_log_det(x)

    def inverse_and_log_det(self, y):
        x = jnp.arctanh(y)
        return x, -tanh_log_det(x)


class Sigmoid(distrax.Sigmoid):
    """``distrax.Sigmoid`` with a log-determinant whose gradient is finite for any ``x``.

    ``log sigmoid'(x) = -softplus(x) - softplus(-x)``, each softplus in a form
    that never evaluates ``exp`` of a large positive number. distrax's version
    evaluates both branches of a ``jnp.where``, and once ``|x| > 88.7`` the
    untaken one overflows and makes the gradient NaN.

    Example:
        >>> import jax, jax.numpy as jnp, samplers
        >>> jax.grad(lambda x: samplers.Sigmoid().forward_log_det_jacobian(x))(100.0)
        Array(-1., dtype=float32, weak_type=True)
    """

    def forward_log_det_jacobian(self, x):
        return -softplus(x) - softplus(-x)

    def forward_and_log_det(self, x):
        return jax.nn.sigmoid(x), self.forward_log_det_jacobian(x)


class BoundedTanh(distrax.Bijector):
    """``y = center + half_range * tanh(x)``: the real line onto ``[low, high]``.

    With ``center = (low + high) / 2`` and ``half_range = (high - low) / 2``, per
    dimension. The log-determinant is ``log(half_range) + log|d tanh(x)/dx|``,
    computed from ``x`` so it stays finite when ``tanh(x)`` rounds to +-1. The
    forward map is clipped to ``[low, high]`` because the affine step can round
    one ulp past a bound. Like ``distrax.Tanh``, the inverse of a saturated action
    is infinite: score stored pre-images instead (see ``SquashedNormal``).

    Args:
        low: Lower bounds, a scalar or one per action dimension.
        high: Upper bounds, the same shape as ``low``.

    Raises:
        ValueError: the bounds are not finite, subnormal (XLA flushes those to
            zero), ``low >= high`` anywhere, the shapes differ, or they have more
            than one dimension.

    Example:
        >>> import jax.numpy as jnp, samplers
        >>> bijector = samplers.BoundedTanh(low=jnp.array([-2.0, 0.0]), high=jnp.array([2.0, 1.0]))
        >>> bijector.forward(jnp.array([0.0, 50.0]))
        Array([0., 1.], dtype=float32)
    """

    def __init__(self, low: Float[ArrayLike, "*action"], high: Float[ArrayLike, "*action"]):
        super().__init__(event_ndims_in=0)
        if np.shape(low) != np.shape(high) or np.ndim(low) > 1:
            raise ValueError(
                f"low and high must have the same shape, () or (action_dim,), got "
                f"{np.shape(low)} and {np.shape(high)}; give one bound per action dimension."
            )
        # Traced bounds (built inside a jitted function) can only be checked for shape.
        if not any(isinstance(bound, jax.core.Tracer) for bound in (low, high)):
            low_np, high_np = np.asarray(low), np.asarray(high)
            tiny = np.finfo(jnp.result_type(float)).tiny
            for name, bound in (("low", low_np), ("high", high_np)):
                if not np.issubdtype(bound.dtype, np.number) or not np.all(np.isfinite(bound)):
                    raise ValueError(f"{name} must be finite real numbers, got {bound}.")
                if np.any((bound != 0) & (np.abs(bound) < tiny)):
                    raise ValueError(
                        f"{name} must be 0 or at least {tiny:.3g} in magnitude, got {bound}: "
                        f"XLA flushes smaller (subnormal) floats to zero."
                    )
            if np.any(low_np >= high_np):
                raise ValueError(
                    f"low must be < high in every dimension, got low={low_np} and high={high_np}."
                )
        dtype = jnp.result_type(float)
        self.low = jnp.asarray(low, dtype)
        self.high = jnp.asarray(high, dtype)

    def _bounds(self, shape):
        # Broadcast explicitly: the bounds cover the last axis, the input may have more.
        low, high = jnp.broadcast_to(self.low, shape), jnp.broadcast_to(self.high, shape)
        return low, high, (high + low) / 2, (high - low) / 2

    def forward_and_log_det(self, x):
        low, high, center, half_range = self._bounds(jnp.shape(x))
        y = jnp.clip(center + half_range * jnp.tanh(x), low, high)
        return y, jnp.log(half_range) + tanh_log_det(x)

    def inverse_and_log_det(self, y):
        _, _, center, half_range = self._bounds(jnp.shape(y))
        x = jnp.arctanh((y - center) / half_range)
        return x, -(jnp.log(half_range) + tanh_log_det(x))


class Squashing(NamedTuple):
    """What a bounded elementwise squashing is: ``y = center + half_range * tanh(x / k)``.

    Attributes:
        low: Lower bounds, a scalar or one per action dimension.
        high: Upper bounds, the same shape.
        pre_image_scale: ``k``: 1 for tanh and ``BoundedTanh``, 2 for sigmoid
            (``sigmoid(x) = (1 + tanh(x / 2)) / 2``).
    """

    low: Float[Array, "*action"]
    high: Float[Array, "*action"]
    pre_image_scale: float

    def distances(
        self, action: Float[Array, "*batch action"], *, normalized: bool = False
    ) -> Float[Array, "*batch action"]:
        """``min(action - low, high - action)`` per dimension, over the half range if
        ``normalized``."""
        low = jnp.broadcast_to(jnp.asarray(self.low, action.dtype), action.shape)
        high = jnp.broadcast_to(jnp.asarray(self.high, action.dtype), action.shape)
        distance = jnp.minimum(action - low, high - action)
        return distance / ((high - low) / 2) if normalized else distance


def squashing(bijector) -> Squashing | None:
    """The bounds of a tanh-family elementwise bijector, or ``None`` if it is not one.

    Accepts the bijector itself or the ``distrax.Block`` that ``SquashedNormal``
    wraps it in: ``samplers.Tanh`` and ``distrax.Tanh`` onto ``[-1, 1]``,
    ``BoundedTanh`` onto its bounds, ``samplers.Sigmoid`` and ``distrax.Sigmoid``
    onto ``[0, 1]``.

    Example:
        >>> import distrax
        >>> squashing(distrax.Block(distrax.Sigmoid(), 1)).pre_image_scale
        2.0
    """
    if isinstance(bijector, distrax.Block):
        bijector = bijector.bijector
    if isinstance(bijector, distrax.Tanh):
        return Squashing(jnp.asarray(-1.0), jnp.asarray(1.0), 1.0)
    if isinstance(bijector, BoundedTanh):
        return Squashing(bijector.low, bijector.high, 1.0)
    if isinstance(bijector, distrax.Sigmoid):
        return Squashing(jnp.asarray(0.0), jnp.asarray(1.0), 2.0)
    return None


def bijector_name(bijector) -> str:
    """The class name of an elementwise bijector, unwrapping a ``distrax.Block``."""
    if isinstance(bijector, distrax.Block):
        bijector = bijector.bijector
    return type(bijector).__name__
