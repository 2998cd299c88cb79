"""Elementwise bijectors: tanh, tanh onto per-dimension bounds, and sigmoid."""

from collections.abc import Callable
from typing import NamedTuple

import distrax
import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jaxtyping import Array, ArrayLike, Bool, Float

from samplers._numerics import softplus, tanh_log_det


class Squashing(NamedTuple):
    """What a bounded elementwise squashing is: ``y = center + half_range * tanh(x / k)``.

    A bijector declares it as its ``squashing`` attribute (as distrax keeps
    ``is_constant_jacobian`` on the bijector): :class:`SquashedNormal` then scores
    actions from their distances to the bounds, and has an exact entropy, mode,
    moments, CDF and quantile. A subclass that changes the map declares its own or
    loses its base's (see :func:`squashing`).

    Attributes:
        low: Lower bounds, a scalar or one per action dimension.
        high: Upper bounds, the same shape.
        pre_image_scale: ``k``: 1 for tanh and ``BoundedTanh``, 2 for sigmoid
            (``sigmoid(x) = (1 + tanh(x / 2)) / 2``).
    """

    low: Float[ArrayLike, "*action"]
    high: Float[ArrayLike, "*action"]
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


class Tanh(distrax.Tanh):
    """``distrax.Tanh`` with a log-determinant that is cheaper to differentiate.

    The same maps and the same values to float32 rounding, but the
    log-determinant and its derivative share one ``exp(-2|x|)``, which XLA
    does not find by itself. :func:`samplers.normal_tanh` uses it. Shapes and
    dtypes are ``distrax.Tanh``'s: those of the input, integers becoming floats.

    Example:
        >>> import jax.numpy as jnp, samplers
        >>> samplers.Tanh().forward_and_log_det(jnp.array([0.0, 20.0]))
        (Array([0., 1.], dtype=float32), Array([  0.      , -38.613705], dtype=float32))
    """

    squashing = Squashing(-1.0, 1.0, 1.0)

    def forward_log_det_jacobian(self, x):
        return tanh_log_det(x)

    def forward_and_log_det(self, x):
        return jnp.tanh(x), tanh_log_det(x)

    def inverse_and_log_det(self, y):
        x = jnp.arctanh(y)
        return x, -tanh_log_det(x)

    def same_as(self, other: distrax.Bijector) -> bool:
        """Whether ``other`` is guaranteed to be the same map: a ``samplers.Tanh`` or a
        ``distrax.Tanh``.

        ``distrax.Tanh().same_as(samplers.Tanh())`` is False all the same: that is
        distrax's code, which accepts only its own class. A False from ``same_as``
        means "not guaranteed", so the asymmetry is conservative, and
        :func:`same_map` answers both orders alike.

        Example:
            >>> import distrax, samplers
            >>> samplers.Tanh().same_as(distrax.Tanh()), distrax.Tanh().same_as(samplers.Tanh())
            (True, False)
        """
        return same_map(self, other) is True


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

    squashing = Squashing(0.0, 1.0, 2.0)

    def forward_log_det_jacobian(self, x):
        x = jnp.asarray(x)
        return -softplus(x) - softplus(-x)

    def forward_and_log_det(self, x):
        return jax.nn.sigmoid(x), self.forward_log_det_jacobian(x)

    def same_as(self, other: distrax.Bijector) -> bool:
        """Whether ``other`` is guaranteed to be the same map: a ``samplers.Sigmoid`` or
        a ``distrax.Sigmoid`` (distrax's ``same_as`` accepts only its own class).

        Example:
            >>> import distrax, samplers
            >>> sigmoid = samplers.Sigmoid()
            >>> sigmoid.same_as(distrax.Sigmoid()), sigmoid.same_as(samplers.Tanh())
            (True, False)
        """
        return same_map(self, other) is True


def _broadcast_bounds(x, low, high):
    """``x``, ``low``, ``high``, ``center`` and ``half_range``, all of one shape."""
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        x = x.astype(jnp.result_type(float))  # as distrax.Tanh: integers become floats
    # Explicit, as distrax.ScalarAffine does: the bounds are batched parameters.
    shape = jax.lax.broadcast_shapes(jnp.shape(low), x.shape)
    x, low, high = (jnp.broadcast_to(a, shape) for a in (x, low, high))
    return x, low, high, (high + low) / 2, (high - low) / 2


# Jitted, so that an eager call runs one program rather than one per operation.
@jax.jit
def _bounded_tanh_forward(x, low, high):
    x, low, high, center, half_range = _broadcast_bounds(x, low, high)
    y = jnp.clip(center + half_range * jnp.tanh(x), low, high)
    return y, jnp.log(half_range) + tanh_log_det(x)


@jax.jit
def _bounded_tanh_inverse(y, low, high):
    y, _, _, center, half_range = _broadcast_bounds(y, low, high)
    x = jnp.arctanh((y - center) / half_range)
    return x, -(jnp.log(half_range) + tanh_log_det(x))


class _Bounded(distrax.Bijector):
    """A squashing onto checked bounds ``low`` and ``high``, one map a subclass: its
    pre-image scale and its ``forward_and_log_det`` and ``inverse_and_log_det`` as
    functions of ``(value, low, high)``."""

    _pre_image_scale: float
    _forward: Callable
    _inverse: Callable

    def __init__(self, low: Float[ArrayLike, "*action"], high: Float[ArrayLike, "*action"]):
        super().__init__(event_ndims_in=0)
        if np.shape(low) != np.shape(high) or np.ndim(low) > 1:
            raise ValueError(
                f"low and high must have the same shape, () or (action_dim,), got "
                f"{np.shape(low)} and {np.shape(high)}; give one bound per action dimension."
            )
        # Traced bounds (built inside jax.jit or jax.vmap) can only be checked for shape.
        traced = any(isinstance(bound, Tracer) for bound in (low, high))
        if not traced:
            for name, bound in (("low", low), ("high", high)):
                if not np.issubdtype(np.asarray(bound).dtype, np.number):
                    raise ValueError(f"{name} must be finite real numbers, got {bound}.")
            # Checked in the dtype they are stored in, so that a bound that overflows it
            # is caught too; on NumPy copies, since inside jax.jit even constant bounds
            # are stored as tracers.
            with np.errstate(over="ignore"):
                low_np, high_np = (np.asarray(b, _bound_dtype(b)) for b in (low, high))
            for name, bound, given in (("low", low_np, low), ("high", high_np, high)):
                if not np.all(np.isfinite(bound)):
                    raise ValueError(
                        f"{name} must be finite real numbers in {bound.dtype}, got {given}."
                    )
                tiny = np.finfo(bound.dtype).tiny
                if np.any((bound != 0) & (np.abs(bound) < tiny)):
                    raise ValueError(
                        f"{name} must be 0 or at least {tiny:.3g} in magnitude, got {bound}: "
                        f"XLA flushes smaller (subnormal) floats to zero."
                    )
            if np.any(low_np >= high_np):
                raise ValueError(
                    f"low must be < high in every dimension, got low={low_np} and high={high_np}."
                )
            # The map is computed from (high - low) / 2 and (high + low) / 2 in this dtype.
            with np.errstate(over="ignore"):
                sums = (("high - low", high_np - low_np), ("high + low", high_np + low_np))
            for name, value in sums:
                if not np.all(np.isfinite(value)):
                    raise ValueError(
                        f"{name} must be finite in {value.dtype}, got low={low} and "
                        f"high={high}, where {name} is {value}; rescale the "
                        f"action space (e.g. to [-1, 1]) and scale the action back outside "
                        f"the policy."
                    )
            tiny = np.finfo(low_np.dtype).tiny
            if np.any((high_np - low_np) / 2 < tiny):
                raise ValueError(
                    f"(high - low) / 2 must be at least {tiny:.3g} in {low_np.dtype} (XLA "
                    f"flushes smaller floats to zero), got low={low} and high={high}; rescale "
                    f"the action space and scale the action back outside the policy."
                )
        self.low = _as_bound(low)
        self.high = _as_bound(high)

    @property
    def squashing(self) -> Squashing:
        """Its bounds, with the subclass's pre-image scale."""
        return Squashing(self.low, self.high, self._pre_image_scale)

    def forward_and_log_det(self, x):
        return self._forward(x, self.low, self.high)

    def inverse_and_log_det(self, y):
        return self._inverse(y, self.low, self.high)

    def same_as(self, other: distrax.Bijector) -> bool:
        """Whether ``other`` is guaranteed to be the same map: a squashing with this
        one's pre-image scale and equal bounds.

        Bounds compare by value after broadcasting, so scalar bounds equal a vector
        of the same value. Traced bounds (inside ``jax.jit`` or ``jax.vmap``) have
        no values at trace time, when ``same_as`` must answer: unless they are the
        same arrays, the answer is False, which means "not guaranteed", never
        that the bounds differ. ``SquashedNormal.kl_divergence`` compares them at run
        time instead (see :func:`same_map`).

        Example:
            >>> import samplers
            >>> samplers.BoundedTanh(-2.0, 2.0).same_as(samplers.BoundedTanh(-2.0, 2.0))
            True
        """
        return same_map(self, other) is True


class BoundedTanh(_Bounded):
    """``y = center + half_range * tanh(x)``: the real line onto ``[low, high]``.

    With ``center = (low + high) / 2`` and ``half_range = (high - low) / 2``, per
    dimension. The log-determinant is ``log(half_range) + log|d tanh(x)/dx|``,
    computed from ``x`` so it stays finite when ``tanh(x)`` rounds to +-1. The
    forward map is clipped to ``[low, high]`` because the affine step can round
    one ulp past a bound. Like ``distrax.Tanh``, the inverse of a saturated action
    is infinite: score stored pre-images instead (see ``SquashedNormal``).

    Shapes and dtypes are those of ``distrax.Chain([distrax.ScalarAffine(center,
    half_range), distrax.Tanh()])``: the bounds are batched parameters that
    broadcast against the input (bounds ``[A]`` and an input ``()`` give ``[A]``;
    an input ``[B, 1]`` gives ``[B, A]``), and the dtype is JAX's promotion of the
    input with the bounds. Bounds given as Python numbers are weakly typed and
    take the input's dtype, so with ``jax_enable_x64`` a float32 input still gives
    float32; bounds given as floating arrays keep their dtype (float64 arrays
    promote a float32 input to float64). Integer inputs become the default float dtype.

    Args:
        low: Lower bounds, a scalar or one per action dimension.
        high: Upper bounds, the same shape as ``low``.

    Raises:
        ValueError: the bounds are not finite (also once stored: ``1e300``
            overflows float32), subnormal (XLA flushes those to zero),
            ``low >= high`` anywhere, ``high - low`` or ``high + low`` overflows
            the dtype they are stored in (``BoundedTanh(-3e38, 3e38)`` in
            float32: the half range and the centre are computed from them), the
            half range is below the smallest normal float, the shapes differ, or
            they have more than one dimension. Traced bounds
            (built inside ``jax.jit`` or ``jax.vmap``) are checked for shape only.

    Example:
        >>> import jax.numpy as jnp, samplers
        >>> bijector = samplers.BoundedTanh(low=jnp.array([-2.0, 0.0]), high=jnp.array([2.0, 1.0]))
        >>> bijector.forward(jnp.array([0.0, 50.0]))
        Array([0., 1.], dtype=float32)
    """

    _pre_image_scale = 1.0
    _forward = staticmethod(_bounded_tanh_forward)
    _inverse = staticmethod(_bounded_tanh_inverse)


@jax.jit
def _bounded_sigmoid_forward(x, low, high):
    x, low, high = _broadcast_bounds(x, low, high)[:3]
    y = jnp.clip(low + (high - low) * jax.nn.sigmoid(x), low, high)
    return y, jnp.log(high - low) - softplus(x) - softplus(-x)


@jax.jit
def _bounded_sigmoid_inverse(y, low, high):
    y, low, high = _broadcast_bounds(y, low, high)[:3]
    log_to_low, log_to_high = jnp.log(y - low), jnp.log(high - y)
    return log_to_low - log_to_high, jnp.log(high - low) - log_to_low - log_to_high


class _BoundedSigmoid(_Bounded):
    """``y = low + (high - low) * sigmoid(x)``: the real line onto ``[low, high]``.

    The bounds are checked and stored as :class:`BoundedTanh` checks and
    stores them (scalars or one per action dimension, broadcast against the input),
    and declared with pre-image scale 2 (``sigmoid(x) = (1 + tanh(x / 2)) / 2``).
    """

    _pre_image_scale = 2.0
    _forward = staticmethod(_bounded_sigmoid_forward)
    _inverse = staticmethod(_bounded_sigmoid_inverse)


def sigmoid_onto(low, high) -> distrax.Bijector:
    """``samplers.Sigmoid()`` for the numbers 0 and 1, else the sigmoid onto the bounds,
    ``low + (high - low) * sigmoid(x)``, with bounds checked as :class:`BoundedTanh`'s.

    Example:
        >>> type(sigmoid_onto(0, 1)).__name__, sigmoid_onto(-2.0, 2.0).forward(jnp.zeros(2))
        ('Sigmoid', Array([0., 0.], dtype=float32))
    """
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (low, high))
    if numbers and low == 0 and high == 1:
        return Sigmoid()
    return _BoundedSigmoid(low, high)


def _bound_dtype(value) -> np.dtype:
    """The dtype :func:`_as_bound` stores ``value`` in (weak types aside)."""
    if isinstance(value, (int, float)) or not np.issubdtype(np.asarray(value).dtype, np.floating):
        return np.dtype(jnp.result_type(float))
    return np.asarray(value).dtype


def _as_bound(value) -> Array:
    # Python numbers stay weakly typed, as distrax.ScalarAffine's parameters, so they
    # take the input's dtype; arrays keep theirs; integers become the default float.
    if isinstance(value, (int, float)):
        return jnp.asarray(float(value))
    bound = jnp.asarray(value)
    if jnp.issubdtype(bound.dtype, jnp.floating):
        return bound
    return bound.astype(jnp.result_type(float))


# distrax's own squashings, which distrax cannot declare.
_DISTRAX_SQUASHINGS = {distrax.Tanh: Tanh.squashing, distrax.Sigmoid: Sigmoid.squashing}
# A class that defines one of these changes the map, and what its bases declared lapses.
_MAP_METHODS = frozenset(
    {"forward", "forward_and_log_det", "forward_log_det_jacobian", "inverse", "inverse_and_log_det"}
)


def squashing(bijector) -> Squashing | None:
    """What a bijector declares as its :class:`Squashing`, or ``None``.

    Accepts the bijector itself or the ``distrax.Block`` that ``SquashedNormal``
    wraps it in. A bijector declares it as its ``squashing`` attribute (this
    package's ``Tanh``, ``Sigmoid`` and ``BoundedTanh`` do, and so may a user's);
    ``distrax.Tanh`` and ``distrax.Sigmoid`` are known from this module's table.
    A subclass inherits the declaration unless it defines a map method
    (``forward``, ``forward_and_log_det``, ``forward_log_det_jacobian``,
    ``inverse``, ``inverse_and_log_det``) without declaring its own: a changed map
    is never scored with a closed form that is not its own.

    Example:
        >>> import distrax
        >>> squashing(distrax.Block(distrax.Sigmoid(), 1)).pre_image_scale
        2.0
    """
    if isinstance(bijector, distrax.Block):
        bijector = bijector.bijector
    for cls in type(bijector).__mro__:
        if "squashing" in vars(cls):
            declared = getattr(bijector, "squashing", None)
            return declared if isinstance(declared, Squashing) else None
        if cls in _DISTRAX_SQUASHINGS:
            return _DISTRAX_SQUASHINGS[cls]
        if _MAP_METHODS & set(vars(cls)):
            return None  # a subclass that changes the map without declaring its squashing
    return None


def same_map(f: distrax.Bijector, g: distrax.Bijector) -> bool | Bool[Array, "*action"]:
    """Whether two elementwise bijectors are the same map, in either order.

    Two squashings (see :func:`squashing`) are the same map when their pre-image
    scales are equal and their bounds are equal after broadcasting; a squashing
    and a bijector without one are not known to be. Other bijectors are the same
    map if ``f.same_as(g)`` or ``g.same_as(f)`` says so. The ``same_as`` of this
    module's bijectors and ``SquashedNormal.kl_divergence`` both answer from here.

    Args:
        f: A bijector.
        g: Another.

    Returns:
        A Python bool where the answer is known at trace time. For bounds traced
        inside ``jax.jit`` or ``jax.vmap`` whose shapes broadcast, a boolean array
        of the broadcast shape of the bounds, true where they are equal at run time.

    Example:
        >>> import distrax, samplers
        >>> unit, wider = samplers.BoundedTanh(-1.0, 1.0), samplers.BoundedTanh(-1.0, 2.0)
        >>> same_map(distrax.Tanh(), samplers.Tanh()), same_map(unit, wider)
        (True, False)
    """
    if f is g:
        return True
    f_squashing, g_squashing = squashing(f), squashing(g)
    if f_squashing is None and g_squashing is None:
        return bool(f.same_as(g) or g.same_as(f))
    if f_squashing is None or g_squashing is None:
        return False  # their same_as would come back here
    if f_squashing.pre_image_scale != g_squashing.pre_image_scale:
        return False
    return _same_bounds(f_squashing, g_squashing)


def _same_bounds(f: Squashing, g: Squashing) -> bool | Bool[Array, "*action"]:
    # Compared by value, in either dtype: a float32 0.1 is not a float64 0.1.
    try:
        shape = jnp.broadcast_shapes(jnp.shape(f.low), jnp.shape(g.low))
    except ValueError:
        return False
    if f.low is g.low and f.high is g.high:
        return True
    bounds = (f.low, f.high, g.low, g.high)
    if not any(isinstance(bound, Tracer) for bound in bounds):
        low_f, high_f, low_g, high_g = (np.broadcast_to(np.asarray(b), shape) for b in bounds)
        return bool(np.array_equal(low_f, low_g) and np.array_equal(high_f, high_g))
    low_f, high_f, low_g, high_g = (jnp.broadcast_to(b, shape) for b in bounds)
    return (low_f == low_g) & (high_f == high_g)


def bijector_name(bijector) -> str:
    """The class name of an elementwise bijector, unwrapping a ``distrax.Block``."""
    if isinstance(bijector, distrax.Block):
        bijector = bijector.bijector
    return type(bijector).__name__
