"""What ``SquashedNormal``'s sampling methods share: their noise, and the pre-image cache.

A sample remembers its pre-image, as TFP's bijector cache does, outside the distrax
pytree, keyed by the identity of the returned array.
"""

import weakref
from typing import cast

import distrax
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from samplers.distributions.bijectors import same_map


class PreImageCache:
    """Which pre-image produced an action array, as TFP's bijector cache keeps it.

    Keyed by the array's identity (a ``jax.Array``, or a tracer of the current
    trace), which is what ``dist.log_prob(dist.sample(seed=key))`` passes back;
    an entry is dropped when its array is garbage-collected.
    """

    def __init__(self):
        """An empty cache: ``id(action) -> (weak reference, pre-image, bijector)``."""
        self._entries: dict[int, tuple[weakref.ref, Array, distrax.Bijector]] = {}

    def remember(self, action, pre_image, bijector: distrax.Bijector) -> None:
        """Records that ``bijector`` mapped ``pre_image`` to ``action`` (same shape)."""
        key = id(action)

        def forget(ref):
            if self._entries.get(key, (None,))[0] is ref:
                del self._entries[key]

        self._entries[key] = (weakref.ref(action, forget), pre_image, bijector)

    def recall(self, action, bijector: distrax.Bijector) -> Array | None:
        """The pre-image of ``action`` if it was remembered for the same map, else ``None``.

        ``None`` also for an equal copy of a remembered array, or for the same array
        under a bijector that is not :func:`same_map` as the one that produced it.
        """
        entry = self._entries.get(id(action))
        if entry is None or entry[0]() is not action or same_map(entry[2], bijector) is not True:
            return None
        return entry[1]


PRE_IMAGES = PreImageCache()


def standard_normal(seed, loc, num_samples: int | None = None):
    """Noise like ``loc``, with a leading axis of ``num_samples`` unless it is ``None``.

    From one key (or an integer seed, as distrax takes): ``normal(seed,
    [num_samples, *loc.shape])`` (without the leading axis for ``None``, and as
    ``normal(seed, loc.shape)[None]`` for one sample). From a key per batch
    element: each element draws ``[num_samples, action]`` from its own key.
    Raises ``ValueError`` for keys whose shape is neither ``()`` nor the batch shape.
    """
    if isinstance(seed, (int, np.integer)):
        seed = jax.random.PRNGKey(int(seed))  # as distrax takes integer seeds
    seed = cast(Array, seed)
    dtype, action_size = loc.dtype, loc.shape[-1]
    batch_shape = loc.shape[:-1]
    if not is_key_array(seed) or jnp.ndim(seed) == 0:
        if num_samples is None:
            return jax.random.normal(seed, loc.shape, dtype)
        if num_samples == 1:
            return jax.random.normal(seed, loc.shape, dtype)[None]
        return jax.random.normal(seed, (num_samples, *loc.shape), dtype)
    check_keys(seed, batch_shape)
    event_shape = (action_size,) if num_samples is None else (num_samples, action_size)
    draw = jax.vmap(lambda key: jax.random.normal(key, event_shape, dtype))
    noise = draw(seed.reshape(-1)).reshape(*batch_shape, *event_shape)
    return noise if num_samples is None else jnp.moveaxis(noise, -2, 0)


def is_key_array(seed) -> bool:
    """Whether ``seed`` is an array of typed keys (``jax.random.key``)."""
    dtype = getattr(seed, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)


def check_keys(seed, batch_shape: tuple[int, ...]) -> None:
    """Refuses (``ValueError``) keys that are not one per batch element."""
    if seed.shape != tuple(batch_shape):
        raise ValueError(
            f"seed must be one key or one key per batch element, shape {tuple(batch_shape)}, "
            f"got keys of shape {seed.shape}; make them with jax.random.split(key, n)."
        )
