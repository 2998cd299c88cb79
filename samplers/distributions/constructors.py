"""Network outputs in, distributions out: a :class:`SquashedNormal` (the std
parameterisations), a :class:`SquashedFlow` and a :class:`SquashedBeta`."""

import functools
from collections.abc import Callable, Sequence

import distrax
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float

from samplers import _checks
from samplers._numerics import softplus
from samplers.distributions.beta import SquashedBeta
from samplers.distributions.bijectors import Tanh
from samplers.distributions.flow import SquashedFlow
from samplers.distributions.squashed_normal import SquashedNormal


def squashed_normal(
    mean_and_std: Float[ArrayLike, "*batch params"],
    bijector: distrax.Bijector | Callable,
    *,
    min_std: float = 1e-3,
    std_scale: float = 1.0,
) -> SquashedNormal:
    """Builds a :class:`SquashedNormal` from a network output ``[mean | raw_std]``.

    The last axis (of even length ``2 * action``) splits into ``mean`` and
    ``raw_std``; ``std = (softplus(raw_std) + min_std) * std_scale``, floored at the
    smallest normal float (``1.2e-38`` in float32) so that it never rounds to zero.

    Args:
        mean_and_std: Network output, shape ``[*batch, 2 * action]``, floating.
        bijector: Elementwise squashing, e.g. ``distrax.Tanh()``,
            ``samplers.BoundedTanh(low, high)``, ``distrax.Sigmoid()``.
        min_std: Floor added to the softplus, ``>= 0``.
        std_scale: Factor applied to the std, ``> 0``.

    Returns:
        A ``SquashedNormal`` (a ``distrax.Transformed``) with batch shape
        ``[*batch]`` and event shape ``[action]``. It computes in the input's
        dtype, but float16 and bfloat16 inputs are computed (and returned) in
        float32. A NaN or infinite mean or raw std makes that dimension's mean
        NaN, so its pre-image and action and the batch element's log-density are
        NaN, never a finite wrong number (``tanh(inf)`` would be the action 1).

    Raises:
        TypeError: ``mean_and_std`` is not a floating array (a string, integers), or
            an option is not a number.
        ValueError: the last axis is missing or odd, or an option is out of range.

    Example:
        >>> import distrax, jax.numpy as jnp, samplers
        >>> dist = samplers.squashed_normal(jnp.zeros((4, 6)), distrax.Sigmoid())
        >>> dist.batch_shape, dist.event_shape
        ((4,), (3,))
    """
    mean, std = _mean_and_std(mean_and_std, min_std, std_scale)
    return SquashedNormal(mean, std, bijector)


def squashed_flow(
    mean_and_std: Float[ArrayLike, "*batch params"],
    layers: Sequence[distrax.Bijector] = (),
    bijector: distrax.Bijector | None = None,
    *,
    min_std: float = 1e-3,
    std_scale: float = 1.0,
) -> SquashedFlow:
    """Builds a :class:`SquashedFlow` from a network output ``[mean | raw_std]``.

    The base Normal's ``mean`` and ``std`` are :func:`squashed_normal`'s (the same
    dtype rules, floor and NaN policy); ``layers`` and ``bijector`` (``samplers.Tanh()``
    by default) are :class:`SquashedFlow`'s.

    Raises:
        TypeError: as :func:`squashed_normal`, or a layer is not a distrax bijector on
            vectors.
        ValueError: as :func:`squashed_normal`.

    Example:
        >>> import jax.numpy as jnp, samplers
        >>> dist = samplers.squashed_flow(jnp.zeros((4, 6)))  # no layers: a squashed Normal
        >>> dist.batch_shape, dist.event_shape
        ((4,), (3,))
    """
    mean, std = _mean_and_std(mean_and_std, min_std, std_scale)
    return SquashedFlow(mean, std, layers, Tanh() if bijector is None else bijector)


def _mean_and_std(mean_and_std, min_std, std_scale) -> tuple[Array, Array]:
    """The checked network output's ``mean`` and ``std``."""
    mean_and_std = _checks.float_parameters("mean_and_std", mean_and_std)
    min_std = _checks.real_number("min_std", min_std, minimum=0.0)
    std_scale = _checks.real_number("std_scale", std_scale, above=0.0)
    if mean_and_std.ndim < 1 or mean_and_std.shape[-1] % 2 or mean_and_std.shape[-1] == 0:
        raise ValueError(
            f"mean_and_std must have a last axis of even length 2 * action_dim "
            f"([mean | raw_std]), got shape {mean_and_std.shape}."
        )
    return _mean_and_softplus_std(mean_and_std, min_std, std_scale)


@jax.custom_jvp
def _nan_unless_finite(mean, raw_std):
    """``mean``, NaN where it or ``raw_std`` is not finite: f(+-inf) would be a finite
    action (``raw_std = -inf`` a valid std)."""
    return jnp.where(jnp.isfinite(mean) & jnp.isfinite(raw_std), mean, jnp.nan)


@_nan_unless_finite.defjvp
def _nan_unless_finite_jvp(primals, tangents):
    # The derivative is 1 where the value is the mean. Elsewhere the distribution's loc
    # and scale are NaN, and its own mask (nan_where_invalid) keeps those dimensions out
    # of the gradient: a second mask here would only be a batch-shaped array that the
    # backward pass keeps (on a TPU, written and read back).
    return _nan_unless_finite(*primals), tangents[0]


# One program, not one per operation, when called eagerly; one per min_std and std_scale.
@functools.partial(jax.jit, static_argnums=(1, 2))
def _mean_and_softplus_std(mean_and_std, min_std, std_scale):
    mean, raw_std = jnp.split(mean_and_std, 2, axis=-1)
    mean = _nan_unless_finite(mean, raw_std)
    std = (softplus(raw_std) + min_std) * std_scale
    # Floored at the smallest normal float: below it XLA flushes the std to zero. Since
    # softplus >= 0, the std is at least min_std * std_scale rounded: where that is normal,
    # the floor is left out (its gradient would keep a mask of the batch's shape, which on
    # a TPU the step writes and reads back).
    dtype = np.dtype(raw_std.dtype)
    with np.errstate(over="ignore"):
        least = dtype.type(min_std) * dtype.type(std_scale)
    if least < np.finfo(dtype).tiny:
        std = jnp.maximum(std, np.finfo(dtype).tiny)
    return mean, std


def normal_tanh(
    mean_and_std: Float[ArrayLike, "*batch params"],
    *,
    min_std: float = 1e-3,
    std_scale: float = 1.0,
) -> SquashedNormal:
    """Builds ``Transformed(Normal(mean, std), Tanh)`` from ``[mean | raw_std]``.

    :func:`squashed_normal` with :class:`samplers.Tanh` (``distrax.Tanh`` with a
    cheaper derivative); see there for the arguments.

    Example:
        >>> import jax.numpy as jnp, samplers
        >>> dist = samplers.normal_tanh(jnp.array([0.0, 0.0, 0.5413, 0.5413]))
        >>> dist.scale.round(3), dist.deterministic_action()
        (Array([1.001, 1.001], dtype=float32), Array([0., 0.], dtype=float32))
    """
    return squashed_normal(mean_and_std, Tanh(), min_std=min_std, std_scale=std_scale)


# A module-level instance, so that the default is not a call in the signature.
_TANH = Tanh()


def squashed_normal_from_std(
    mean: Float[ArrayLike, "*batch action"],
    std: Float[ArrayLike, "*batch action"],
    bijector: distrax.Bijector | Callable = _TANH,
    *,
    min_std: float = 0.0,
) -> SquashedNormal:
    """Builds a :class:`SquashedNormal` from a mean and a standard deviation.

    ``std + min_std`` is floored at the smallest normal float (``1.2e-38`` in
    float32), as in :func:`squashed_normal`, so that a std that underflowed to 0
    stays positive. Values are not checked (they cannot be inside ``jax.jit``):
    as in :func:`squashed_normal`, a NaN or infinite ``mean`` or ``std``, or a
    negative ``std``, makes that dimension's mean NaN, so its samples, actions
    (also the deterministic one), log-densities and moments are NaN, never a
    finite number.

    Args:
        mean: Means of the base Normal, shape ``[*batch, action]``, floating.
        std: Standard deviations, the same shape, floating, ``> 0``.
        bijector: Elementwise squashing, ``samplers.Tanh()`` by default; e.g.
            ``samplers.BoundedTanh(low, high)``, ``samplers.Sigmoid()``.
        min_std: Added to ``std``, ``>= 0``.

    Returns:
        A ``SquashedNormal`` with batch shape ``[*batch]`` and event shape
        ``[action]``, in the inputs' common dtype; float16 and bfloat16 are
        computed (and returned) in float32.

    Raises:
        TypeError: ``mean`` or ``std`` is not a floating array (a string, integers),
            or ``min_std`` is not a number.
        ValueError: the shapes differ or have no action axis, or ``min_std < 0``.

    Example:
        >>> import jax.numpy as jnp, samplers
        >>> dist = samplers.squashed_normal_from_std(jnp.zeros(2), jnp.array([0.5, -1.0]))
        >>> dist.scale
        Array([0.5, nan], dtype=float32)
    """
    mean, std = _mean_and_spread("std", mean, std)
    min_std = _checks.real_number("min_std", min_std, minimum=0.0)
    valid = jnp.isfinite(mean) & jnp.isfinite(std) & (std >= 0)
    # f(+-inf) would be a finite action: an invalid parameter makes its dimension NaN.
    mean = jnp.where(valid, mean, jnp.nan)
    std = jnp.where(valid, jnp.maximum(std + min_std, jnp.finfo(std.dtype).tiny), jnp.nan)
    return SquashedNormal(mean, std, bijector)


def squashed_normal_from_log_std(
    mean: Float[ArrayLike, "*batch action"],
    log_std: Float[ArrayLike, "*batch action"],
    bijector: distrax.Bijector | Callable = _TANH,
    *,
    log_std_min: float | None = None,
    log_std_max: float | None = None,
) -> SquashedNormal:
    """Builds a :class:`SquashedNormal` from a mean and a log standard deviation.

    ``std = exp(clip(log_std, log_std_min, log_std_max))``, each bound optional
    (SAC implementations commonly clip to ``[-20, 2]`` or ``[-5, 2]``; the clip
    stops the gradient strictly outside the bounds and passes it whole on them,
    as PyTorch's ``clamp`` does), then floored at the
    smallest normal float as in :func:`squashed_normal` (``exp(log_std)`` falls
    below it from ``log_std ~ -87.3`` in float32). As in :func:`squashed_normal`, a
    NaN or infinite ``mean`` or ``log_std`` (checked before the clip) makes that
    dimension's mean NaN, so everything computed from it is NaN.

    Args:
        mean: Means of the base Normal, shape ``[*batch, action]``, floating.
        log_std: Natural logarithms of the standard deviations, the same shape,
            floating.
        bijector: Elementwise squashing, ``samplers.Tanh()`` by default.
        log_std_min: Lower clip of ``log_std``, or ``None`` for none.
        log_std_max: Upper clip of ``log_std``, or ``None`` for none.

    Returns:
        A ``SquashedNormal`` as :func:`squashed_normal_from_std` returns it.

    Raises:
        TypeError: ``mean`` or ``log_std`` is not a floating array (a string,
            integers), or a bound is not a number.
        ValueError: the shapes differ or have no action axis, a bound is not
            finite, or ``log_std_min > log_std_max``.

    Example:
        >>> import jax.numpy as jnp, samplers
        >>> log_std = jnp.array([-30.0, 0.0, 5.0])
        >>> dist = samplers.squashed_normal_from_log_std(
        ...     jnp.zeros(3), log_std, log_std_min=-20.0, log_std_max=2.0
        ... )
        >>> dist.scale
        Array([2.061e-09, 1.000e+00, 7.389e+00], dtype=float32)
    """
    mean, log_std = _mean_and_spread("log_std", mean, log_std)
    if log_std_min is not None:
        log_std_min = _checks.real_number("log_std_min", log_std_min)
    if log_std_max is not None:
        log_std_max = _checks.real_number("log_std_max", log_std_max)
    if log_std_min is not None and log_std_max is not None and log_std_min > log_std_max:
        raise ValueError(
            f"log_std_min must be <= log_std_max, got {log_std_min} > {log_std_max}; "
            f"swap them (e.g. log_std_min=-20.0, log_std_max=2.0)."
        )
    mean = _nan_unless_finite(mean, log_std)
    # Clipped with where: jnp.clip halves the gradient of a log_std on a bound.
    if log_std_min is not None:
        log_std = jnp.where(log_std < log_std_min, log_std_min, log_std)
    if log_std_max is not None:
        log_std = jnp.where(log_std > log_std_max, log_std_max, log_std)
    std = jnp.exp(log_std)
    std = jnp.maximum(std, jnp.finfo(std.dtype).tiny)
    return SquashedNormal(mean, std, bijector)


def _mean_and_spread(name: str, mean, spread) -> tuple[Array, Array]:
    """``mean`` and ``spread`` (std or log-std) checked, in one dtype of at least 32 bits."""
    mean = _checks.float_parameters("mean", mean)
    spread = _checks.float_parameters(name, spread)
    if mean.ndim < 1:
        raise ValueError(
            f"mean and {name} need an action axis, shape [*batch, action], got "
            f"{mean.shape}; for one action dimension use shape (1,)."
        )
    if mean.shape != spread.shape:
        raise ValueError(
            f"mean and {name} must have the same shape [*batch, action], got {mean.shape} "
            f"and {spread.shape}; broadcast them yourself (e.g. a state-independent {name} "
            f"with jnp.broadcast_to({name}, mean.shape))."
        )
    dtype = jnp.result_type(mean, spread)
    return mean.astype(dtype), spread.astype(dtype)


def squashed_beta(
    params: Float[ArrayLike, "*batch params"],
    low: Float[ArrayLike, "*action"] = 0.0,
    high: Float[ArrayLike, "*action"] = 1.0,
    *,
    min_concentration: float = 1.0,
) -> SquashedBeta:
    """A :class:`SquashedBeta` from a network output ``[raw_alpha | raw_beta]``.

    Each concentration is ``min_concentration + softplus(raw)``. The default floor
    of 1 keeps both at least 1, where the density is finite on the bounds and has no
    more than one mode (below 1 it is infinite on a bound, and float32 samples pile
    onto it); pass ``min_concentration=0.0`` for the whole family.

    The concentrations are computed in ``params``' dtype, float16 and bfloat16 in
    float32 (every output is then that of the float32 ``params``, bit for bit); the
    distribution computes in the result dtype of the concentrations and the bounds,
    so float64 bound arrays under ``jax_enable_x64`` keep float64 precision, and
    bounds given as Python numbers take the concentrations' dtype, their width
    ``high - low`` taken in the numbers' own precision (as
    :class:`samplers.BoundedTanh` does).

    Args:
        params: ``[*batch, 2 * action]``, the raw ``a`` then the raw ``b``.
        low: Lower bounds, a scalar or one per action dimension.
        high: Upper bounds, the same shape.
        min_concentration: The floor, ``>= 0``, keyword-only.

    Raises:
        TypeError: ``params`` is not a floating array (a string, integers), or
            ``min_concentration`` not a number.
        ValueError: the last axis of ``params`` is not even and positive, or
            ``min_concentration`` is negative; the bounds as :class:`SquashedBeta`.

    Example:
        >>> import jax.numpy as jnp
        >>> from samplers import squashed_beta
        >>> dist = squashed_beta(jnp.zeros((5, 4)), -2.0, 2.0)
        >>> dist.batch_shape, dist.event_shape, dist.concentration1[0]
        ((5,), (2,), Array([1.6931, 1.6931], dtype=float32))
    """
    params = _checks.float_parameters("params", params)
    min_concentration = _checks.real_number("min_concentration", min_concentration, minimum=0.0)
    width = params.shape[-1] if params.ndim else 0
    if width == 0 or width % 2:
        raise ValueError(
            f"params must have an even, positive last axis [*batch, 2 * action] (raw alpha "
            f"then raw beta), got shape {params.shape}; size the network's last layer to "
            f"2 * action_dim."
        )
    raw_a, raw_b = jnp.split(params, 2, axis=-1)
    return SquashedBeta(
        min_concentration + softplus(raw_a), min_concentration + softplus(raw_b), low, high
    )
