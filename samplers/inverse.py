"""Scoring a squashed action when its pre-image was not stored.

The replay path (:meth:`SquashedNormal.log_prob_from_pre_image`) needs the
pre-tanh value that produced an action. Off-policy replay buffers and offline
datasets usually hold only the action, so the pre-image has to be recovered by
inverting ``tanh`` and that inverse is infinite at the bounds.
:func:`log_prob_from_action` inverts from the distances to the bounds, which
float32 represents exactly near a bound, and clamps only actions that lie on a
bound.
"""

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float

from samplers import _checks, _squashed
from samplers.bijectors import bijector_name, squashing
from samplers.distributions import SquashedNormal


def log_prob_from_action(
    dist: SquashedNormal,
    action: Float[ArrayLike, "*sample_and_batch action"],
    *,
    min_distance: float | None = None,
) -> Float[Array, "*sample_and_batch"]:
    """Log-density of a stored squashed action, finite up to and on the bounds.

    Inverts the squashing ``y = center + half_range * tanh(x / k)`` (``k = 1`` for
    tanh, 2 for sigmoid) from the distances to the bounds instead of from the
    action: with ``d_hi = high - y``, ``d_lo = y - low`` and
    ``half_range = (high - low) / 2``,

    ``x = k * (log d_lo - log d_hi) / 2`` and
    ``log|f'(x)| = log d_lo + log d_hi - log(k * half_range)``,

    so ``log p(y) = log N(x; loc, scale) - log|f'(x)|``. Near a bound ``d_hi`` is
    exact in floating point (Sterbenz's lemma). The usual route,
    ``atanh((y - center) / half_range)``, is as accurate for ``Tanh`` strictly
    inside ``(-1, 1)`` but NaN on a bound, and for most other bounds the division
    rounds ``1 - u``: with ``BoundedTanh(-0.1, 0.3)`` it is 0.7 nats off at
    ``1e-7`` of the half range from a bound. ``dist.log_prob(action)`` computes
    the same value; this function adds ``min_distance`` and refuses actions
    whose shape does not end in the distribution's.

    Error bound: against the float64 change of variables at the same float32
    action, the result is within
    ``4 * eps * (1 + |x| * |x - loc| / scale**2 + |log p|)`` per dimension
    (``eps = 2**-23``) at any distance from the bound, strictly inside it. The
    middle term is the cost of rounding ``x`` itself, which no float32 method
    avoids; nothing grows as the action approaches the bound.

    Only actions on a bound are clamped: their distance is raised to half a
    float step (the coarser of the action's spacing at the bound and tanh's
    step; ``2**-25`` for ``Tanh``, i.e. ``x ~ 9.0``; the smallest normal float at
    sigmoid's 0), or, with ``min_distance``, every distance below it to it.
    Gradients with respect to ``loc``, ``scale`` and the action are finite
    everywhere in ``[low, high]``. Actions outside it give NaN (an action past a
    bound is not a sample of this distribution; clip it first if it is a
    rounding artefact).

    Other libraries clip the action instead. Acme clips at ``|y| = 0.999`` and
    from there on uses the average density of the tail, so ``log p`` jumps at the
    threshold (0.7 nats for ``loc=0, scale=1``) and is up to 20 nats off near the
    bound.
    Stable-Baselines3 clamps at ``1 - 2**-23`` and uses ``log(1 - y**2 + 1e-6)``
    as the Jacobian, 0.4 nats off at ``1e-6`` from a bound and 1.6 at ``1e-7``.

    Args:
        dist: A :class:`SquashedNormal` whose bijector is ``samplers.Tanh``,
            ``distrax.Tanh``, ``samplers.BoundedTanh``, ``samplers.Sigmoid`` or
            ``distrax.Sigmoid``.
        action: Actions in ``[low, high]``, shape ``[*sample, *batch, action]``
            (ending in the distribution's shape), floating.
        min_distance: The smallest distance to a bound, as a fraction of the
            half range; ``None`` for half a float step at the bound. Larger
            values clamp like other libraries do (e.g. ``1e-3`` for Acme's 0.999).

    Returns:
        ``log p(action)``, shape ``[*sample, *batch]``; NaN where an action is
        outside ``[low, high]``.

    Raises:
        TypeError: ``dist`` is not a ``SquashedNormal``, its bijector is not in
            the tanh family (sigmoid included), or ``action`` is not floating.
        ValueError: ``action``'s shape does not end in the distribution's, or
            ``min_distance`` is not in ``(0, 1)``.

    Example:
        >>> import jax.numpy as jnp, samplers
        >>> from samplers.inverse import log_prob_from_action
        >>> dist = samplers.normal_tanh(jnp.array([0.0, 0.0]))
        >>> log_prob_from_action(dist, jnp.array([1.0]))  # exactly on the bound: finite
        Array(-68.175, dtype=float32)
    """
    if not isinstance(dist, SquashedNormal):
        raise TypeError(
            f"dist must be a samplers.SquashedNormal, got {type(dist).__name__}; build it "
            f"with samplers.normal_tanh or samplers.squashed_normal."
        )
    bounds = squashing(dist.bijector)
    if bounds is None:
        raise TypeError(
            f"log_prob_from_action supports samplers.Tanh, distrax.Tanh, samplers.BoundedTanh "
            f"and sigmoid, got {bijector_name(dist.bijector)}; for other bijectors "
            f"use dist.log_prob(action), or store the pre-image when sampling and score it "
            f"with dist.log_prob_from_pre_image."
        )
    action = _checks.float_array("action", action)
    if action.shape[action.ndim - dist.loc.ndim :] != dist.loc.shape:
        raise ValueError(
            f"action must have shape [*sample, *batch, action] ending in the distribution's "
            f"shape {dist.loc.shape}, got {action.shape}."
        )
    if min_distance is not None:
        min_distance = _checks.real_number("min_distance", min_distance, above=0.0)
        if min_distance >= 1.0:
            raise ValueError(
                f"min_distance must be in (0, 1) (a fraction of the half range), "
                f"got {min_distance}."
            )
    dtype = jnp.result_type(action, dist.loc)
    action = action.astype(dtype)
    loc, scale = (jnp.broadcast_to(a, action.shape).astype(dtype) for a in (dist.loc, dist.scale))
    return _squashed.log_prob_from_action(bounds, action, loc, scale, min_distance)
