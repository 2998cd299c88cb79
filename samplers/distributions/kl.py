"""The KL divergence of two squashed Normals, registered with TFP as distrax does.

``SquashedNormal.kl_divergence`` (and ``distrax``'s and TFP's ``kl_divergence`` of two
``SquashedNormal`` objects) dispatch here: the KL of the base Normals when both share
their squashing, refused for a ``SquashedNormal`` against a plain ``distrax.Transformed``.
"""

import distrax
import jax.numpy as jnp
from jaxtyping import Array
from tensorflow_probability.substrates import jax as tfp

from samplers.distributions.bijectors import bijector_name, same_map, squashing
from samplers.distributions.squashed_normal import SquashedNormal

tfd = tfp.distributions


def _kl_divergence(p: SquashedNormal, q: SquashedNormal, *_, **__) -> Array:
    """``KL(p || q)`` of two squashed Normals that share their bijector (see the method).

    Registered with TFP; ``[*broadcast_batch]``. Raises ``ValueError`` for other
    bijectors, action sizes or batch shapes; NaN where traced bounds differ.
    """
    same = _same_bijector(p.bijector, q.bijector)
    try:
        shape = jnp.broadcast_shapes(p.loc.shape, q.loc.shape)
    except ValueError:
        shape = None
    if shape is None or p.loc.shape[-1] != q.loc.shape[-1]:
        raise ValueError(
            f"p and q must have the same action size and broadcastable batch shapes, got "
            f"loc shapes {p.loc.shape} and {q.loc.shape}."
        )
    loc_p, scale_p, loc_q, scale_q = (
        jnp.broadcast_to(a, shape) for a in (p.loc, p.scale, q.loc, q.scale)
    )
    log_ratio = jnp.log(scale_p) - jnp.log(scale_q)
    per_dimension = 0.5 * (
        jnp.expm1(2.0 * log_ratio) - 2.0 * log_ratio + jnp.square((loc_p - loc_q) / scale_q)
    )
    if same is not True:
        # Bounds traced inside jax.jit or jax.vmap are compared when the program runs.
        per_dimension = jnp.where(jnp.all(same), per_dimension, jnp.nan)
    return jnp.sum(per_dimension, axis=-1)


def _same_bijector(f: distrax.Bijector, g: distrax.Bijector) -> bool | Array:
    """``same_map(f, g)``: ``True``, or a boolean array for traced bounds.

    Raises ``ValueError`` where it is ``False`` at trace time, naming both maps.
    """
    same = same_map(f, g)
    if same is not False:
        return same
    f_squashing, g_squashing = squashing(f), squashing(g)
    if f_squashing is not None and g_squashing is not None:
        raise ValueError(
            f"p and q must share their bijector, got {bijector_name(f)} onto "
            f"[{f_squashing.low}, {f_squashing.high}] and {bijector_name(g)} onto "
            f"[{g_squashing.low}, {g_squashing.high}]; with different maps the supports or "
            f"Jacobians differ and the KL is not that of the base Normals."
        )
    raise ValueError(
        f"p and q must share their bijector, got {bijector_name(f)} and "
        f"{bijector_name(g)} that cannot be shown to be the same map; build both "
        f"with the same bijector instance."
    )


def _kl_refused(p, q, *_, **__):
    """Registered for a ``SquashedNormal`` and another ``distrax.Transformed``: refuses."""
    raise NotImplementedError(
        f"the KL divergence between a {type(p).__name__} and a {type(q).__name__} is not "
        f"known to be that of their base distributions; build both as "
        f"samplers.SquashedNormal with the same bijector."
    )


tfd.RegisterKL(SquashedNormal, SquashedNormal)(_kl_divergence)
tfd.RegisterKL(SquashedNormal, distrax.Transformed)(_kl_refused)
tfd.RegisterKL(distrax.Transformed, SquashedNormal)(_kl_refused)
