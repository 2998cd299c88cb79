"""Elementwise bijectors for bounded action spaces."""

import distrax
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float


def _tanh_log_det(x: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
    """``log|d tanh(x) / dx|`` in a form that stays finite for any finite ``x``.

    ``log(1 - tanh(x)**2)`` is ``log(0) = -inf`` once ``tanh(x)`` rounds to 1
    (from ``|x| ~ 8`` with XLA's float32 ``tanh``); ``2 * (log 2 - x - softplus(-2 x))``
    is the same quantity without the cancellation.

    Example:
        >>> import jax.numpy as jnp
        >>> round(float(_tanh_log_det(jnp.float32(20.0))), 4)
        -38.6137
    """
    return 2.0 * (jnp.log(2.0) - x - jax.nn.softplus(-2.0 * x))


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
        ValueError: the bounds are not finite, ``low >= high`` anywhere, the shapes
            differ, or they have more than one dimension.

    Example:
        >>> import jax.numpy as jnp, samplers
        >>> bijector = samplers.BoundedTanh(low=jnp.array([-2.0, 0.0]), high=jnp.array([2.0, 1.0]))
        >>> bijector.forward(jnp.array([0.0, 50.0]))
        Array([0., 1.], dtype=float32)
    """

    def __init__(self, low: Float[ArrayLike, "*action"], high: Float[ArrayLike, "*action"]):
        super().__init__(event_ndims_in=0)
        low_np, high_np = np.asarray(low), np.asarray(high)
        if low_np.shape != high_np.shape or low_np.ndim > 1:
            raise ValueError(
                f"low and high must have the same shape, () or (action_dim,), got "
                f"{low_np.shape} and {high_np.shape}; give one bound per action dimension."
            )
        for name, bound in (("low", low_np), ("high", high_np)):
            if not np.issubdtype(bound.dtype, np.number) or not np.all(np.isfinite(bound)):
                raise ValueError(f"{name} must be finite real numbers, got {bound}.")
        if np.any(low_np >= high_np):
            raise ValueError(
                f"low must be < high in every dimension, got low={low_np} and high={high_np}."
            )
        dtype = jnp.result_type(float)
        self.low = jnp.asarray(low_np, dtype)
        self.high = jnp.asarray(high_np, dtype)

    def _bounds(self, shape):
        # Broadcast explicitly: the bounds cover the last axis, the input may have more.
        low, high = jnp.broadcast_to(self.low, shape), jnp.broadcast_to(self.high, shape)
        return low, high, (high + low) / 2, (high - low) / 2

    def forward_and_log_det(self, x):
        low, high, center, half_range = self._bounds(jnp.shape(x))
        y = jnp.clip(center + half_range * jnp.tanh(x), low, high)
        return y, jnp.log(half_range) + _tanh_log_det(x)

    def inverse_and_log_det(self, y):
        _, _, center, half_range = self._bounds(jnp.shape(y))
        x = jnp.arctanh((y - center) / half_range)
        return x, -(jnp.log(half_range) + _tanh_log_det(x))
