"""Elementwise bijectors: tanh, tanh onto per-dimension bounds, and sigmoid."""

import distrax
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float


@jax.custom_jvp
def _tanh_log_det(x: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
    """``log|d tanh(x) / dx|`` in a form that stays finite for any finite ``x``.

    ``log(1 - tanh(x)**2)`` is ``log(0) = -inf`` once ``tanh(x)`` rounds to 1
    (from ``|x| ~ 8`` with XLA's float32 ``tanh``);
    ``2 * (log 2 - |x| - log1p(exp(-2|x|)))`` is the same quantity without the
    cancellation. Its derivative, ``-2 tanh(x)``, reuses the same ``exp``.

    Example:
        >>> import jax.numpy as jnp
        >>> round(float(_tanh_log_det(jnp.float32(20.0))), 4)
        -38.6137
    """
    return _tanh_log_det_and_derivative(x)[0]


def _tanh_log_det_and_derivative(x):
    magnitude = jnp.abs(x)
    e = jnp.exp(-2.0 * magnitude)
    log_det = 2.0 * (jnp.log(2.0) - magnitude - jnp.log1p(e))
    return log_det, -2.0 * jnp.sign(x) * (1.0 - e) / (1.0 + e)


@_tanh_log_det.defjvp
def _tanh_log_det_jvp(primals, tangents):
    log_det, derivative = _tanh_log_det_and_derivative(primals[0])
    return log_det, derivative * tangents[0]


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
        return _tanh_log_det(x)

    def forward_and_log_det(self, x):
        return jnp.tanh(x), _tanh_log_det(x)

    def inverse_and_log_det(self, y):
        x = jnp.arctanh(y)
        return x, -_tanh_log_det(x)


@jax.custom_jvp
def _softplus(x):
    """``log(1 + exp(x))``, stably; XLA's CPU backend runs it faster than ``jax.nn.softplus``."""
    return jnp.maximum(x, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(x)))


@_softplus.defjvp
def _softplus_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    e = jnp.exp(-jnp.abs(x))
    sigmoid = jnp.where(x >= 0, 1.0, e) / (1.0 + e)
    return jnp.maximum(x, 0.0) + jnp.log1p(e), sigmoid * dx


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
        return -_softplus(x) - _softplus(-x)

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
        return y, jnp.log(half_range) + _tanh_log_det(x)

    def inverse_and_log_det(self, y):
        _, _, center, half_range = self._bounds(jnp.shape(y))
        x = jnp.arctanh((y - center) / half_range)
        return x, -(jnp.log(half_range) + _tanh_log_det(x))
