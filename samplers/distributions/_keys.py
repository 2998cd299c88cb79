"""Keys: the one rule for an integer seed, keys per batch element, and keys by name.

Every sampling method of the pure layer takes ``seed`` as distrax does: an integer,
a key (typed, or one raw ``jax.random.PRNGKey``), or one typed key per batch element,
each element then drawing from its own key.
"""

import zlib
from typing import cast

import distrax
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, PRNGKeyArray


def integer_seed(seed):
    """A typed key for an integer seed or one raw ``jax.random.PRNGKey`` (distrax takes
    both; ``jax.random.key`` of the same seed draws the same numbers), else ``seed``
    as it is."""
    if isinstance(seed, (int, np.integer)):
        return jax.random.key(int(seed))
    raw = not is_key_array(seed) and jnp.shape(seed) == (2,)
    if raw and jnp.asarray(seed).dtype == jnp.uint32:
        return jax.random.wrap_key_data(seed)
    return seed


def is_key_array(seed) -> bool:
    """Whether ``seed`` is an array of typed keys (``jax.random.key``)."""
    dtype = getattr(seed, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)


def per_element(seed) -> bool:
    """Whether ``seed`` is one typed key per batch element (not one key)."""
    return is_key_array(seed) and jnp.ndim(seed) > 0


def check_keys(seed, batch_shape: tuple[int, ...]) -> None:
    """Refuses (``ValueError``) keys that are not one per batch element."""
    if seed.shape != tuple(batch_shape):
        raise ValueError(
            f"seed must be one key or one key per batch element, shape {tuple(batch_shape)}, "
            f"got keys of shape {seed.shape}; make them with jax.random.split(key, n)."
        )


def standard_normal(seed, loc, num_samples: int | None = None):
    """Noise like ``loc``, with a leading axis of ``num_samples`` unless it is ``None``.

    From one key (or an integer seed): ``normal(seed, [num_samples, *loc.shape])``
    (without the leading axis for ``None``, and as ``normal(seed, loc.shape)[None]``
    for one sample). From a key per batch element: each element draws
    ``[num_samples, action]`` from its own key. Raises ``ValueError`` for keys whose
    shape is neither ``()`` nor the batch shape.
    """
    seed = cast(Array, integer_seed(seed))
    dtype, action_size = loc.dtype, loc.shape[-1]
    batch_shape = loc.shape[:-1]
    if not per_element(seed):
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


def sample_per_key(dist: distrax.Distribution, seed) -> Array:
    """``dist.sample(seed=seed)``, or with one key per batch element each row from its key.

    For the discrete distributions of this package, pytrees whose arrays lead with
    the batch axes, a row's sample is the distribution mapped over them
    (``jax.vmap``, one axis at a time).
    """
    if not per_element(seed):
        return dist.sample(seed=seed)
    batch_shape = tuple(dist.batch_shape)
    check_keys(seed, batch_shape)

    def draw(row, key):
        return row.sample(seed=key)

    for _ in batch_shape:
        draw = jax.vmap(draw)
    return draw(dist, seed)


def part_key(key: PRNGKeyArray, path: tuple[str, ...]) -> PRNGKeyArray:
    """``key`` with the crc32 of each name of ``path`` folded in; one key per batch element
    folds in per element."""

    def fold(key):
        for part in path:
            key = jax.random.fold_in(key, zlib.crc32(part.encode()))
        return key

    if jnp.ndim(key) == 0:
        return fold(key)
    return jax.vmap(fold)(key.reshape(-1)).reshape(key.shape)


def part_keys(key: PRNGKeyArray, paths: list[tuple[str, ...]]) -> list[PRNGKeyArray]:
    """:func:`part_key` of each path, the same keys bit for bit, derived together: one
    batched ``fold_in`` per level of the paths. Each ``fold_in`` of its own is a
    Threefry loop of its own on XLA's CPU backend, a cost that shows at batch size 1."""
    if jnp.ndim(key) != 0 or len(paths) < 2:
        return [part_key(key, path) for path in paths]
    keys = [key] * len(paths)
    for level in range(max(map(len, paths))):
        chosen = [i for i, path in enumerate(paths) if len(path) > level]
        names = [zlib.crc32(paths[i][level].encode()) for i in chosen]
        folded = jax.vmap(jax.random.fold_in)(
            jnp.stack([keys[i] for i in chosen]), jnp.asarray(names, jnp.uint32)
        )
        for row, i in enumerate(chosen):
            keys[i] = folded[row]
    return keys
