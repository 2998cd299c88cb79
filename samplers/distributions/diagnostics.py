"""Numbers to log while training a squashed-Normal policy, and the exact KL.

Saturation and distance to the bounds show when a policy pushes its actions into
the corners where float32 ``tanh`` loses information; the PPO ratio statistics
show how far an update moved the policy (the exact KL of two policies is
``SquashedNormal.kl_divergence``).
"""

import distrax
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float

from samplers import _checks
from samplers._numerics import k3
from samplers.distributions.bijectors import Squashing, bijector_name, squashing
from samplers.distributions.squashed_normal import SquashedNormal


def saturation_fraction(
    pre_image: Float[ArrayLike, "*shape"],
    *,
    threshold: float | None = None,
    axis: int | tuple[int, ...] | None = None,
) -> Float[Array, "*reduced"]:
    """The fraction of pre-tanh values whose ``tanh`` is exactly ``+-1``.

    There the action no longer says which pre-image produced it: ``atanh`` of it
    is infinite and only the stored pre-image can be scored. By default the test
    is ``|tanh(x)| == 1`` in the input's dtype on the current backend, so it
    follows the backend's ``tanh`` (XLA's float32 ``tanh`` on CPU reaches 1 at
    ``|x| ~ 7.9988``; a correctly rounded one would at ``13 log 2 ~ 9.01``).

    Args:
        pre_image: Pre-tanh values (e.g. a sampler's ``rollout_extras``), floating.
        threshold: Count ``|x| >= threshold`` instead, e.g. to warn earlier.
        axis: Axes to average over, as in ``jnp.mean``; ``None`` for all.

    Returns:
        The fraction in ``[0, 1]``, a scalar unless ``axis`` keeps some axes; NaN
        where a NaN pre-image is averaged over.

    Raises:
        TypeError: ``pre_image`` is not floating or ``threshold`` not a number.
        ValueError: ``threshold`` is not positive, or the axes averaged over are empty.

    Example:
        >>> import jax.numpy as jnp
        >>> from samplers import saturation_fraction
        >>> saturation_fraction(jnp.array([0.5, -3.0, 8.5, -20.0]))
        Array(0.5, dtype=float32)
    """
    pre_image = _checks.float_array("pre_image", pre_image)
    _checks.nonempty("pre_image", pre_image, axis)
    if threshold is None:
        saturated = jnp.abs(jnp.tanh(pre_image)) == 1
    else:
        threshold = _checks.real_number("threshold", threshold, above=0.0)
        saturated = jnp.abs(pre_image) >= threshold
    # A NaN pre-image is neither saturated nor not: it makes its fraction NaN.
    saturated = jnp.where(jnp.isnan(pre_image), jnp.nan, saturated)
    return jnp.mean(saturated, axis=axis, dtype=pre_image.dtype)


def bound_distance(
    dist_or_bijector: SquashedNormal | distrax.Bijector,
    action: Float[ArrayLike, "*batch action"],
    *,
    normalized: bool = False,
) -> Float[Array, "*batch"]:
    """The smallest distance of each action to a bound, over its dimensions.

    ``min over the last axis of min(action - low, high - action)``, in action
    units, or as a fraction of each dimension's half range with
    ``normalized=True`` (``1 - |u|`` for ``u`` in ``[-1, 1]``, comparable across
    dimensions of different ranges). Zero means some dimension is on a bound.

    Args:
        dist_or_bijector: A :class:`SquashedNormal`, or its bijector:
            ``samplers.Tanh``, ``distrax.Tanh``, ``samplers.BoundedTanh`` or
            ``distrax.Sigmoid``, bare or in a ``distrax.Block``.
        action: Actions, shape ``[*batch, action]``, floating.
        normalized: Divide by the half range before taking the minimum.

    Returns:
        The distance, shape ``[*batch]``; negative for an action out of bounds.

    Raises:
        TypeError: the squashing is not one of the above, or ``action`` is not
            floating.
        ValueError: ``action`` has no last axis or an empty one, or the bounds do
            not broadcast to its shape.

    Example:
        >>> import jax.numpy as jnp, samplers
        >>> from samplers import bound_distance
        >>> bound_distance(samplers.BoundedTanh(0.0, 2.0), jnp.array([[0.5, 1.9], [1.0, 1.0]]))
        Array([0.1, 1. ], dtype=float32)
    """
    bijector = (
        dist_or_bijector.bijector
        if isinstance(dist_or_bijector, SquashedNormal)
        else dist_or_bijector
    )
    bounds = squashing(bijector)
    if bounds is None:
        raise TypeError(
            f"bound_distance needs a bounded squashing (samplers.Tanh, distrax.Tanh, "
            f"samplers.BoundedTanh or distrax.Sigmoid), got {bijector_name(bijector)}."
        )
    action = _checks.float_array("action", action)
    if action.ndim < 1:
        raise ValueError(
            "action must have shape [*batch, action], got a scalar; add the action axis "
            "with action[None]."
        )
    _checks.nonempty("action", action, axis=-1)
    shape = jnp.broadcast_shapes(jnp.shape(bounds.low), jnp.shape(bounds.high))
    if not _broadcasts_to(shape, action.shape):
        raise ValueError(
            f"action of shape {action.shape} does not fit the bounds of "
            f"{bijector_name(bijector)}, of shape {shape}: the bounds must broadcast to "
            f"the action, [*batch, action]; pass actions whose last axes are {shape}."
        )
    return jnp.min(bounds.distances(action, normalized=normalized), axis=-1)


def _broadcasts_to(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    try:
        return jnp.broadcast_shapes(shape, target) == target
    except ValueError:
        return False


def ppo_log_ratio_stats(
    log_prob: Float[ArrayLike, "*batch"],
    old_log_prob: Float[ArrayLike, "*batch"],
    *,
    clip_epsilon: float = 0.2,
) -> dict[str, Float[Array, ""]]:
    """Statistics of the PPO ratio ``r = exp(log_prob - old_log_prob)``.

    The actions are samples of the old policy, so both KL estimates below
    estimate ``KL(old || new)`` (Schulman, "Approximating KL divergence", 2020):

    - ``approx_kl``: ``mean((r - 1) - log r)`` (k3), unbiased and never negative;
      ``r - 1`` is computed as ``expm1`` so that small ratios keep their digits, and
      an infinite ratio makes it ``+inf``.
    - ``approx_kl_k1``: ``mean(-log r)`` (k1), unbiased but noisy and often
      negative on a minibatch.
    - ``clip_fraction``: the fraction outside PPO's clip range,
      ``|r - 1| > clip_epsilon``.
    - ``ratio_deviation_mean`` and ``ratio_deviation_max``: mean and max of
      ``|r - 1|``.

    Args:
        log_prob: Log-likelihoods under the current policy, any shape.
        old_log_prob: Those under the policy that collected the actions, the same
            shape.
        clip_epsilon: PPO's clip range, ``> 0``.

    Returns:
        A dict of scalars with the keys above. Each is NaN where either input
        holds a NaN, ``clip_fraction`` included: a NaN ratio is neither inside
        the clip range nor outside it.

    Raises:
        TypeError: an input is not floating or ``clip_epsilon`` is not a number.
        ValueError: the shapes differ, the batch is empty, or ``clip_epsilon <= 0``.

    Example:
        >>> import jax.numpy as jnp
        >>> from samplers import ppo_log_ratio_stats
        >>> stats = ppo_log_ratio_stats(jnp.log(jnp.array([1.0, 1.5])), jnp.zeros(2))
        >>> stats["clip_fraction"], stats["ratio_deviation_max"]
        (Array(0.5, dtype=float32), Array(0.5, dtype=float32))
    """
    log_prob = _checks.float_array("log_prob", log_prob)
    old_log_prob = _checks.float_array("old_log_prob", old_log_prob)
    clip_epsilon = _checks.real_number("clip_epsilon", clip_epsilon, above=0.0)
    if log_prob.shape != old_log_prob.shape:
        raise ValueError(
            f"log_prob and old_log_prob must have the same shape, got {log_prob.shape} "
            f"and {old_log_prob.shape}; pass the log-likelihoods of the same actions."
        )
    _checks.nonempty("log_prob", log_prob)
    log_ratio = log_prob - old_log_prob
    ratio_minus_one = jnp.expm1(log_ratio)
    deviation = jnp.abs(ratio_minus_one)
    # A NaN ratio is neither clipped nor not (NaN > eps is False): its fraction is NaN.
    clipped = jnp.where(jnp.isnan(deviation), jnp.nan, deviation > clip_epsilon)
    return {
        "approx_kl": jnp.mean(k3(log_ratio)),
        "approx_kl_k1": jnp.mean(-log_ratio),
        "clip_fraction": jnp.mean(clipped, dtype=log_ratio.dtype),
        "ratio_deviation_mean": jnp.mean(deviation),
        "ratio_deviation_max": jnp.max(deviation),
    }


@jax.jit
def bound_metrics(bounds: Squashing, action: Float[Array, "*batch action"]):
    """The fraction of each action's dimensions on a bound, and its smallest distance to
    a bound, ``[*batch]`` each: the heads' ``saturation`` and ``bound_distance``
    metrics. A NaN action is neither on a bound nor off it: its fraction is NaN.

    Example:
        >>> import jax.numpy as jnp, samplers
        >>> from samplers.distributions.diagnostics import bound_metrics
        >>> bound_metrics(samplers.BoundedTanh(0.0, 2.0).squashing, jnp.array([[0.0, 1.5]]))
        (Array([0.5], dtype=float32), Array([0.], dtype=float32))
    """
    distances = bounds.distances(action)
    on_bound = jnp.where(jnp.isnan(distances), jnp.nan, distances <= 0)
    return jnp.mean(on_bound, axis=-1, dtype=action.dtype), jnp.min(distances, axis=-1)
