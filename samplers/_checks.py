"""Argument checks shared by the public constructors (raise, never assert)."""

import math
import numbers
import reprlib

import jax
import jax.numpy as jnp
import numpy as np
from jax import core


def real_number(name: str, value, *, minimum=None, above=None) -> float:
    """Returns ``value`` as a float after checking it is a finite real number.

    Raises:
        TypeError: ``value`` is not a concrete real scalar.
        ValueError: ``value`` is not finite, or is below ``minimum`` or not above
            ``above``.
    """
    if value is None:
        raise TypeError(f"{name} is required; pass a real number.")
    if isinstance(value, core.Tracer):
        raise TypeError(
            f"{name} must be a concrete number, got a traced value {value}; "
            f"pass it as a Python float, not as an argument of a jitted function."
        )
    if isinstance(value, (bool, np.bool_)) or not (
        isinstance(value, numbers.Real) or (np.ndim(value) == 0 and _is_real_array(value))
    ):
        raise TypeError(
            f"{name} must be a real number, got {value!r} of type {type(value).__name__}."
        )
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}.")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}.")
    if above is not None and value <= above:
        raise ValueError(f"{name} must be > {above}, got {value}.")
    return value


def _is_real_array(value) -> bool:
    dtype = getattr(value, "dtype", None)
    return dtype is not None and (
        jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)
    )


def float_array(name: str, value, *, hint: str = "") -> jax.Array:
    """Returns ``value`` as a JAX array after checking its dtype is floating.

    Raises:
        TypeError: ``value`` has an integer, boolean or non-numeric dtype.
    """
    dtype = getattr(value, "dtype", None)
    if dtype is None:
        value = jnp.asarray(value)
        dtype = value.dtype
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"{name} must have a floating dtype, got {dtype}{hint}; "
            f"cast it with .astype(jnp.float32)."
        )
    return jnp.asarray(value)


def computing_dtype(dtype) -> np.dtype:
    """The dtype parameters of ``dtype`` are computed in: float16 and bfloat16 lose the
    tails of log-densities, so they compute (and return) in float32; others are kept."""
    return np.dtype(jnp.float32) if jnp.finfo(dtype).bits < 32 else np.dtype(dtype)


def numeric_array(name: str, value) -> jax.Array:
    """Returns ``value`` as a JAX array after checking that it holds numbers.

    Raises:
        TypeError: ``value`` is a string, or anything else JAX makes no array of.
    """
    text = isinstance(value, (str, bytes)) or (
        isinstance(value, np.ndarray) and value.dtype.kind in "OSU"
    )
    if not text:
        try:
            return jnp.asarray(value)
        except (TypeError, ValueError):
            pass
    raise TypeError(
        f"{name} must be an array of numbers, got {reprlib.repr(value)} of type "
        f"{type(value).__name__}; pass a floating array, e.g. jnp.asarray(..., jnp.float32)."
    )


def float_parameters(name: str, value) -> jax.Array:
    """Returns ``value`` as a floating JAX array in its computing dtype
    (:func:`computing_dtype`: float16 and bfloat16 become float32).

    Raises:
        TypeError: ``value`` is not an array of numbers, or its dtype is not floating.
    """
    array = float_array(name, numeric_array(name, value))
    dtype = computing_dtype(array.dtype)
    # Cast only to change the dtype: a cast drops the weak type of a Python number's array
    # (a weakly typed float64 under x64 must not promote float32 parameters).
    return array if array.dtype == dtype else array.astype(dtype)


def logits_array(name: str, value, axis: str | None = None) -> jax.Array:
    """Returns logits as ``distrax.Categorical`` takes them, in their computing dtype:
    integers as JAX's functions convert them (float32; float64 for 64-bit integers,
    which exist under ``jax_enable_x64``), float16 and bfloat16 as float32.

    Raises:
        TypeError: ``value`` is boolean, or not an array of numbers.
        ValueError: ``axis`` (what the last axis is, for the error) is given and
            ``value`` is a scalar.
    """
    array = numeric_array(name, value)
    if axis is not None and array.ndim < 1:
        raise ValueError(f"{name} must have {axis}, got a scalar.")
    if array.dtype == jnp.bool_:
        raise TypeError(
            f"{name} must be numbers, got booleans of shape {array.shape}: booleans are a "
            f"mask of allowed actions; pass them as mask= with float logits, or cast the "
            f"logits with .astype(jnp.float32)."
        )
    if jnp.issubdtype(array.dtype, jnp.integer):
        array = array.astype(jnp.float64 if jnp.iinfo(array.dtype).bits == 64 else jnp.float32)
    return float_parameters(name, array)


def boolean_mask(mask, shape, hint: str = "") -> jax.Array:
    """Returns ``mask`` as a boolean array of ``shape``; ``hint`` follows the shape in the
    error.

    Raises:
        TypeError: ``mask`` is not boolean.
        ValueError: its shape is not ``shape``.
    """
    mask = jnp.asarray(mask)
    if mask.dtype != jnp.bool_:
        raise TypeError(
            f"mask must be boolean (True where allowed), got dtype {mask.dtype}; convert it, "
            f"e.g. mask = legal_actions > 0."
        )
    if mask.shape != tuple(shape):
        raise ValueError(
            f"mask must have shape {tuple(shape)}{hint}, got {mask.shape}; "
            f"jnp.broadcast_to(mask, {tuple(shape)}) if it is shared across the batch."
        )
    return mask


def positive_int(name: str, value) -> int:
    """Returns ``value`` after checking it is a positive Python integer.

    Raises:
        TypeError: ``value`` is not an integer (bools included).
        ValueError: ``value`` is below 1.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be a positive integer, got {value!r}.")
    if value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value}.")
    return int(value)


def nvec(value) -> tuple[int, ...]:
    """Returns ``value`` as a tuple of positive integers, a ``MultiDiscrete``'s sizes.

    Raises:
        ValueError: ``value`` is empty, not one-dimensional, not integers, or below 1.
    """
    values = np.asarray(value)
    if values.ndim != 1 or values.size == 0 or not np.issubdtype(values.dtype, np.integer):
        raise ValueError(
            f"nvec must be a non-empty sequence of integers (the choices per sub-action), "
            f"got {value!r}."
        )
    if np.any(values < 1):
        raise ValueError(f"nvec must be positive (each sub-action has a choice), got {value!r}.")
    return tuple(int(n) for n in values)


def stored_action_dtype(name: str, action: jax.Array, dtype) -> None:
    """Refuses a stored action (``name``) that ``log_prob`` would take for another action."""
    if not jnp.issubdtype(dtype, jnp.floating):
        if jnp.issubdtype(action.dtype, jnp.integer) or action.dtype == dtype:
            return
        raise TypeError(
            f"{name} must have an integer dtype, as this distribution samples "
            f"{dtype} actions, got {action.dtype}: distrax scores a non-integer action "
            f"such as 1.7 silently (a Categorical as log-likelihood 0); store the sampled "
            f"actions, or cast with .astype(jnp.{dtype})."
        )
    if jnp.issubdtype(action.dtype, jnp.floating) and (
        jnp.finfo(action.dtype).bits >= jnp.finfo(dtype).bits
    ):
        return
    raise TypeError(
        f"{name} must have a floating dtype of at least {jnp.finfo(dtype).bits} "
        f"bits, as this distribution samples {dtype} actions, got {action.dtype}: an "
        f"integer or rounded action is not the sampled one, so its log-likelihood and the "
        f"PPO ratio change; store the actions as the rollout call emitted them, or cast "
        f"with .astype(jnp.{dtype})."
    )


def replayed_pre_image(
    name: str,
    stored,
    action_shape: tuple[int, ...],
    dtype,
    *,
    hint: str = " (the stored pre-tanh action)",
) -> jax.Array:
    """Returns a stored pre-image (``name``) after checking it against the action shape
    and dtype.

    Raises:
        TypeError: it is not floating (``hint`` names what was expected), or is
            stored in fewer bits than ``dtype`` (see :func:`stored_precision`).
        ValueError: its shape is not ``action_shape``.
    """
    pre_image = float_array(name, stored, hint=hint)
    stored_precision(name, pre_image, dtype)
    if pre_image.shape != action_shape:
        raise ValueError(
            f"{name} must have the action shape {action_shape} (the stored raw "
            f"action of this batch), got {pre_image.shape}; pass it as the sample of these "
            f"inputs returned it."
        )
    return pre_image


def stored_precision(name: str, stored: jax.Array, dtype) -> None:
    """Refuses (``TypeError``) a stored value rounded to fewer bits than the distribution
    computes in."""
    if jnp.finfo(stored.dtype).bits < jnp.finfo(dtype).bits:
        raise TypeError(
            f"{name} must be stored in {dtype} (or wider), the dtype this sampler "
            f"computes in, got {stored.dtype}: the rounded value is not the one the rollout "
            f"emitted, so its log-likelihood and the PPO ratio change; store {name} "
            f"in {dtype}, as the rollout call emitted them."
        )


def nonempty(name: str, value: jax.Array, axis=None) -> None:
    """Refuses (``ValueError``) an array whose axes to reduce over (``axis``, as in
    ``jnp.mean``; ``None`` for all) hold no element: its mean is NaN and its maximum
    undefined."""
    axes = range(value.ndim) if axis is None else np.atleast_1d(axis)
    if any(value.shape[int(a)] == 0 for a in axes):
        raise ValueError(
            f"{name} is empty along the axes reduced over (shape {value.shape}); pass at "
            f"least one element, e.g. skip the statistics of an empty minibatch."
        )
