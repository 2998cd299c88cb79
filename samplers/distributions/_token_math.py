"""The numerics of :class:`samplers.TokenCategorical`: exact arithmetic, tiles, streams, VJPs.

A token's log-probability on a stored support must come out with the same bits in the
rollout's program and in the trainer's, whatever the number of rows computed together.
XLA's own reductions, matrix products and ``exp`` do not promise that on the CPU: the
order of a ``jnp.sum`` over the last axis, the blocking of a ``jnp.dot`` and the code of
an ``exp`` all depend on the shape of the array (and of the fused kernel) they run in.
So the support's scores are written in IEEE operations whose result is fixed by their
operands alone: a logit is a sum of products in a fixed binary tree
(:func:`tree_sum`), the log-softmax's ``exp`` and ``log`` are polynomials of additions
and multiplications (:func:`exp`, :func:`log`), and the maximum is exact in any order.
The program is one ``jax.jit`` (:func:`support_log_probs`), so eager and traced callers
compile the same fused arithmetic (the CPU contracts a multiply and an add into one FMA
only inside a fused kernel).

Quantities over the whole vocabulary (:func:`full_pass`) stream it in tiles of a fixed
shape per backend, whose matrix products give each row the same bits whatever the other
rows (:func:`dense_tiles`), and fold the log-sum-exp in the same exact arithmetic.
Their gradients recompute each block (a custom VJP), so memory is ``O(rows x block)``.
On a support, the gradient gathers the table's rows again, and adds to the table's
gradient in float32 (:func:`_sorted_row_sums` for a bfloat16 table). The candidates a
truncated sample chooses among (:func:`candidates`) are the exact top ``k``
(:func:`top_k`); their values decide the support only, which is stored, so they need
no fixed rounding.

On a TPU a support's logits from a table's rows are products on the MXU (``einsum`` of
the hidden states with their gathered rows, :func:`_on_mxu`), whose sums gave a row
the same bits in tiles of other rows and sizes in every pattern of the accelerator
tier, and the table's gradient is summed by vocabulary block on the MXU
(:func:`_block_row_sums`), as a TPU's scatters of rows are slow; the log-softmax keeps
the exact ``exp`` and ``log``.
"""

import functools
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array

PAD = -1  # pads a stored support
FULL = -2  # a support's first id when the token was drawn from the whole vocabulary
NOISE_CHUNK = 4096  # a sample's noise is drawn per chunk of this many tokens

# Tiles of the matrix products over the whole vocabulary, per backend: (rows, tokens).
# Their shape is fixed (a call's rows are padded to it), so a row's logits are the
# same bits in any batch; see dense_tiles.
DENSE_TILES = {"cpu": (64, 4096), "tpu": (1024, 4096)}
DEFAULT_DENSE_TILE = (256, 8192)
# Bytes a tile of gathered support rows, or of candidates' logits, may take.
SUPPORT_BYTES = {"cpu": 8 << 20}
DEFAULT_SUPPORT_BYTES = 128 << 20
CANDIDATE_BYTES = {"cpu": 64 << 20}
DEFAULT_CANDIDATE_BYTES = 1 << 30
# A TPU's table gradient on a support (_block_row_sums): ids per block, terms per product.
SUM_BLOCK = SUM_CHUNK = 512

# ---------------------------------------------------------------------------------
# Exact arithmetic: results fixed by the operands, whatever the shape or the kernel.

_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)  # 9 significant bits: n * _LN2_HI is exact
_LN2_LO = np.float32(-2.12194440e-4)
# Cephes' expf and logf polynomials.
_EXP = tuple(
    np.float32(c)
    for c in (
        1.9875691500e-4,
        1.3981999507e-3,
        8.3334519073e-3,
        4.1665795894e-2,
        1.6666665459e-1,
        5.0000001201e-1,
    )
)
_LOG = tuple(
    np.float32(c)
    for c in (
        7.0376836292e-2,
        -1.1514610310e-1,
        1.1676998740e-1,
        -1.2420140846e-1,
        1.4249322787e-1,
        -1.6668057665e-1,
        2.0000714765e-1,
        -2.4999993993e-1,
        3.3333331174e-1,
    )
)


def exp(x: Array) -> Array:
    """``exp(x)`` within 1.01 ulp for float32 (0 below the smallest normal); other
    dtypes use ``jnp.exp``."""
    if x.dtype != jnp.float32:
        return jnp.exp(x)
    clipped = jnp.clip(x, -88.0, 89.0)
    n = jnp.round(clipped * _LOG2E)
    r = clipped - n * _LN2_HI
    r = r - n * _LN2_LO
    p = _EXP[0]
    for c in _EXP[1:]:
        p = p * r + c
    p = p * (r * r) + r + 1.0
    k = n.astype(jnp.int32)
    half = k >> 1  # two exact scalings, so that 2**k never leaves the normal range
    y = p * _power_of_two(half) * _power_of_two(k - half)
    y = jnp.where(x < -87.33654, 0.0, y)
    y = jnp.where(x > 88.72283, jnp.inf, y)
    return jnp.where(jnp.isnan(x), x, y)


def _power_of_two(k: Array) -> Array:
    return lax.bitcast_convert_type((k + 127) << 23, jnp.float32)


def log(x: Array) -> Array:
    """``log(x)`` within 0.83 ulp for positive normal float32 (``-inf`` at 0, NaN
    below); other dtypes use ``jnp.log``."""
    if x.dtype != jnp.float32:
        return jnp.log(x)
    bits = lax.bitcast_convert_type(x, jnp.int32)
    e = (bits >> 23) - 126
    m = lax.bitcast_convert_type((bits & 0x007FFFFF) | 0x3F000000, jnp.float32)  # [0.5, 1)
    small = m < np.float32(0.70710678)
    e = jnp.where(small, e - 1, e)
    m = jnp.where(small, m + m, m)
    f = m - 1.0
    z = f * f
    p = _LOG[0]
    for c in _LOG[1:]:
        p = p * f + c
    y = p * f * z
    scale = e.astype(jnp.float32)
    y = y + scale * _LN2_LO
    y = y - 0.5 * z
    out = (f + y) + scale * _LN2_HI
    out = jnp.where(x == 0, -jnp.inf, out)
    out = jnp.where(x == jnp.inf, jnp.inf, out)
    return jnp.where((x < 0) | jnp.isnan(x), jnp.nan, out)


def tree_sum(x: Array, axis: int = -1) -> Array:
    """The sum over ``axis`` in a fixed binary tree, ``x[i] + x[i + half]`` at each
    level (padded with zeros to a power of two): the same bits for an element whatever
    the array around it, and whichever axis holds the terms."""
    x = jnp.moveaxis(x, axis, 0)
    width = x.shape[0]
    size = 1 << max(width - 1, 0).bit_length()
    if size != width:
        x = jnp.concatenate([x, jnp.zeros((size - width, *x.shape[1:]), x.dtype)], 0)
    while x.shape[0] > 1:
        half = x.shape[0] // 2
        x = x[:half] + x[half:]
    return x[0]


def log_softmax(raw: Array, scale: Array) -> Array:
    """The log-softmax of ``raw * scale[:, None]`` over the last axis, in the exact
    arithmetic: ``(raw - max) * scale`` less the log of its exponentials' sum. NaN for
    a row with no finite logit."""
    top = jnp.max(raw, axis=-1, keepdims=True)
    shifted = (raw - jnp.where(jnp.isfinite(top), top, 0.0)) * scale[:, None]
    return shifted - log(tree_sum(exp(shifted)))[..., None]


# ---------------------------------------------------------------------------------
# Where the logits come from.


class Source(NamedTuple):
    """The logits of ``N`` rows over ``V`` tokens, never built whole.

    Either ``hidden [N, D]`` with ``table [V, D]`` (an embedding table) or
    ``unembedding [D, V]``, or ``logits [N, V]``; ``bias [V]`` or None; ``scale [N]``,
    one over the temperature; ``shared_mask [V]`` and ``row_mask [N, V]`` booleans or
    None. The per-row arrays
    are ``hidden``, ``logits``, ``scale`` and ``row_mask``.

    The raw logits (:meth:`block`, :meth:`gathered`) are ``hidden @ table.T + bias``
    (or ``logits``), ``-inf`` where forbidden; the tempered ones are ``raw * scale``.
    The temperature is applied after the row's maximum is taken off (a product last
    would be fused into its consumer's sum on the CPU in some programs and not others).
    """

    # Arrays or None (typed Any: a VJP puts None where a cotangent is zero).
    hidden: Any
    table: Any
    unembedding: Any
    logits: Any
    bias: Any
    scale: Any
    shared_mask: Any
    row_mask: Any

    @property
    def rows(self) -> int:
        return self.scale.shape[0]

    @property
    def vocab(self) -> int:
        if self.table is not None:
            return self.table.shape[0]
        return (self.unembedding if self.logits is None else self.logits).shape[-1]

    @property
    def dtype(self):
        arrays = [a for a in (self.hidden, self.weights, self.logits) if a is not None]
        return jnp.promote_types(jnp.result_type(*arrays), jnp.float32)

    @property
    def weights(self):
        """The table or the unembedding, whichever is given (None for logits)."""
        return self.unembedding if self.table is None else self.table

    def as_table(self) -> "Source":
        """With the unembedding transposed into a table, whose rows a gather reads
        contiguously (once for many gathers, rather than columns at a time)."""
        if self.unembedding is None:
            return self
        return self._replace(table=self.unembedding.T, unembedding=None)

    def tiles(self, rows: int) -> tuple:
        """The per-row arrays, padded to a multiple of ``rows`` and split in tiles
        ``[count, rows, ...]`` (padding rows: zeros, scale 1, masks True)."""
        return (
            _pad_rows(self.hidden, rows, 0),
            _pad_rows(self.logits, rows, 0),
            _pad_rows(self.scale, rows, 1),
            _pad_rows(self.row_mask, rows, True),
        )

    def with_rows(self, hidden, logits, scale, row_mask) -> "Source":
        """This source with other per-row arrays (one tile's)."""
        return self._replace(hidden=hidden, logits=logits, scale=scale, row_mask=row_mask)

    def block(self, start, size: int) -> Array:
        """The raw logits of tokens ``[start, start + size)``: one matrix product of the
        rows with the table's block (contiguous rows), ``-inf`` where forbidden."""
        dtype = self.dtype
        if self.logits is not None:
            raw = lax.dynamic_slice_in_dim(self.logits, start, size, axis=1).astype(dtype)
        elif self.table is not None:
            weights = lax.dynamic_slice_in_dim(self.table, start, size, axis=0)
            raw = lax.dot_general(
                self.hidden, weights, (((1,), (1,)), ((), ())), preferred_element_type=dtype
            ).astype(dtype)
        else:
            weights = lax.dynamic_slice_in_dim(self.unembedding, start, size, axis=1)
            raw = jnp.dot(self.hidden, weights, preferred_element_type=dtype).astype(dtype)
        if self.bias is not None:
            raw = raw + lax.dynamic_slice_in_dim(self.bias, start, size).astype(dtype)[None]
        if self.shared_mask is not None:
            allowed = lax.dynamic_slice_in_dim(self.shared_mask, start, size)[None]
            raw = jnp.where(allowed, raw, -jnp.inf)
        if self.row_mask is not None:
            allowed = lax.dynamic_slice_in_dim(self.row_mask, start, size, axis=1)
            raw = jnp.where(allowed, raw, -jnp.inf)
        return raw

    def gathered(self, ids: Array, allowed: Array, mxu: bool = False) -> Array:
        """The raw logits of ``ids [R, K]`` in the exact arithmetic, ``-inf`` where not
        ``allowed``: each the sum of ``hidden * row`` in a fixed tree, the table's rows
        gathered (contiguous, unlike the unembedding's columns); with ``mxu``, a product
        with the table's rows (see :func:`_on_mxu`)."""
        dtype = self.dtype
        safe = jnp.clip(ids, 0, self.vocab - 1)
        if self.logits is not None:
            raw = jnp.take_along_axis(self.logits, safe, -1).astype(dtype)
        elif mxu:
            rows = jnp.take(self.table, safe, axis=0)  # [R, K, D]
            raw = jnp.einsum(
                "rd,rkd->rk",
                self.hidden,
                rows,
                precision=lax.Precision.HIGHEST,
                preferred_element_type=dtype,
            ).astype(dtype)
        else:
            hidden = self.hidden.astype(dtype)
            if self.table is not None:
                rows = jnp.take(self.table, safe, axis=0).astype(dtype)  # [R, K, D]
                raw = tree_sum(hidden[:, None, :] * rows)
            else:  # few ids: their columns, [D, R, K], the same sums over the first axis
                columns = jnp.take(self.unembedding, safe, axis=1).astype(dtype)
                raw = tree_sum(hidden.T[:, :, None] * columns, axis=0)
        if self.bias is not None:
            raw = raw + jnp.take(self.bias, safe).astype(dtype)
        return jnp.where(allowed, raw, -jnp.inf)


def _pad_rows(a, rows: int, fill):
    """``a [N, ...]`` padded with ``fill`` to a multiple of ``rows`` and split in tiles
    ``[N / rows, rows, ...]`` (None stays None)."""
    if a is None:
        return None
    pad = -a.shape[0] % rows
    a = jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1), constant_values=fill)
    return a.reshape(-1, rows, *a.shape[1:])


def _map_tiles(count: int, fn, tiles):
    """``fn(tile)`` over the leading axis of ``tiles``, the results' first two axes
    flattened and cut to ``count`` rows."""
    out = lax.map(fn, tiles)
    return jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:])[:count], out)


def _backend() -> str:
    return jax.default_backend()


def support_rows(count: int, width: int, depth: int) -> int:
    """Rows per tile of a support's scores (``width`` ids of ``depth`` values each),
    a power of two within the backend's byte budget, at most ``count``."""
    budget = SUPPORT_BYTES.get(_backend(), DEFAULT_SUPPORT_BYTES)
    rows = max(1, budget // max(1, 4 * width * depth))
    return max(1, min(count, 1 << (rows.bit_length() - 1)))


def dense_tiles(vocab: int, block: tuple[int, int] | None) -> tuple[int, int]:
    """``(rows, tokens)`` of the tiles over the whole vocabulary: ``block`` if given,
    else the backend's (:data:`DENSE_TILES`), tokens at most ``vocab``.

    The rows are not fitted to a call: XLA rounds a matrix product's entries
    according to the product's shape (on the CPU), so a fixed shape gives a row the
    same bits alone or in any batch, and a rollout's log-probability the trainer's.
    """
    rows, tokens = block if block is not None else DENSE_TILES.get(_backend(), DEFAULT_DENSE_TILE)
    return rows, min(tokens, vocab)


def candidate_tiles(count: int, vocab: int, block: tuple[int, int] | None) -> tuple[int, int]:
    """``(rows, tokens)`` of the tiles that choose candidates: ``block`` if given; else
    all rows and the whole vocabulary at once where their logits fit the backend's
    budget (a decoding step's), else tiles within it."""
    if block is not None:
        return min(block[0], count), min(block[1], vocab)
    budget = CANDIDATE_BYTES.get(_backend(), DEFAULT_CANDIDATE_BYTES) // 4
    rows = max(1, min(count, budget // vocab))
    return rows, min(vocab, max(NOISE_CHUNK, budget // rows))


def _fold_blocks(vocab: int, size: int, fold, init):
    """``fold(carry, start, width)`` over the blocks of ``size`` tokens (a scan over
    the full ones, then the remainder)."""
    full = vocab // size

    def body(carry, index):
        return fold(carry, index * size, size), None

    carry, _ = lax.scan(body, init, jnp.arange(full, dtype=jnp.int32))
    if vocab % size:
        carry = fold(carry, jnp.int32(full * size), vocab - full * size)
    return carry


# ---------------------------------------------------------------------------------
# Scores on stored supports: the exact arithmetic, and a VJP that gathers.


@jax.custom_vjp
def support_log_probs(source: Source, ids: Array, allowed: Array) -> Array:
    """``[N, K]`` log-probabilities of ``ids`` renormalised over the ``allowed`` ones
    (``-inf`` elsewhere; NaN for a row with none), in the exact arithmetic: the same
    bits for a row whatever the rows computed with it and the program it is in."""
    return _support_forward(source, ids, allowed)


def _gathering(source: Source, count: int) -> Source:
    """The source to gather ``count`` ids from: an unembedding's columns for a few ids
    (a decoding step's), else its transpose, whose rows are contiguous."""
    few = source.unembedding is not None and count <= source.vocab
    return source if few else source.as_table()


def _on_mxu(source: Source) -> bool:
    """Whether a support's logits are products on the MXU: on a TPU, given a table's
    rows. There a row's sums had the same bits in tiles of any rows and sizes in the
    accelerator tier's patterns; an unembedding's are summed in the exact tree, as a
    decoding step gathers its columns and a training batch its transpose's rows, and
    the MXU's bits are not measured to agree between those two layouts."""
    return _backend() == "tpu" and source.table is not None


def _support_map(source: Source, ids: Array, allowed: Array, fn) -> Array:
    """``fn(tile source, ids, allowed, mxu)`` over tiles of rows within the byte
    budget (``mxu``: :func:`_on_mxu`)."""
    depth = 1 if source.hidden is None else source.hidden.shape[-1]
    rows = support_rows(source.rows, ids.shape[-1], depth)
    mxu = _on_mxu(source)
    source = _gathering(source, ids.size)

    def one(tile):
        *parts, tile_ids, tile_allowed = tile
        return fn(source.with_rows(*parts), tile_ids, tile_allowed, mxu)

    tiles = (*source.tiles(rows), _pad_rows(ids, rows, PAD), _pad_rows(allowed, rows, False))
    return _map_tiles(source.rows, one, tiles)


@jax.jit
def _support_forward(source: Source, ids: Array, allowed: Array) -> Array:
    def one(tile, tile_ids, tile_allowed, mxu):
        return log_softmax(tile.gathered(tile_ids, tile_allowed, mxu), tile.scale)

    return _support_map(source, ids, allowed, one)


@jax.jit
def gathered_logits(source: Source, ids: Array, allowed: Array) -> Array:
    """``[N, K]`` tempered logits of ``ids`` (``-inf`` where not ``allowed``)."""

    def one(tile, tile_ids, tile_allowed, mxu):
        return tile.gathered(tile_ids, tile_allowed, mxu) * tile.scale[:, None]

    return _support_map(source, ids, allowed, one)


def _support_fwd(source, ids, allowed):
    log_probs = _support_forward(source, ids, allowed)
    return log_probs, (source, ids, log_probs)


def _support_bwd(residuals, cotangent):
    source, ids, log_probs = residuals
    dtype = source.dtype
    positive = log_probs > -jnp.inf  # False for padding, forbidden ids and NaN rows
    cotangent = jnp.where(positive, cotangent, 0.0)
    probs = jnp.exp(jnp.where(positive, log_probs, -jnp.inf))
    d_logits = cotangent - probs * cotangent.sum(-1, keepdims=True)
    d_raw = (d_logits * source.scale[:, None]).astype(dtype)
    safe = jnp.clip(ids, 0, source.vocab - 1)
    grads = dict.fromkeys(("hidden", "table", "unembedding", "logits", "bias"))
    if source.bias is not None:
        d_bias = jnp.zeros(source.vocab, dtype).at[safe.reshape(-1)].add(d_raw.reshape(-1))
        grads["bias"] = d_bias.astype(source.bias.dtype)
    if source.logits is not None:
        rows = jnp.arange(source.rows)[:, None]
        d_dense = jnp.zeros(source.logits.shape, dtype).at[rows, safe].add(d_raw)
        grads["logits"] = d_dense.astype(source.logits.dtype)
    else:
        d_hidden, d_table = _gathered_vjp(source, safe, d_raw)
        grads["hidden"] = d_hidden
        grads["table" if source.table is not None else "unembedding"] = (
            d_table if source.table is not None else d_table.T
        )
    return Source(**grads, scale=None, shared_mask=None, row_mask=None), None, None


def _gathered_vjp(source: Source, ids: Array, d_raw: Array) -> tuple[Array, Array]:
    """The gradients of gathered logits: ``d_hidden[r] = sum_k d[r, k] table[ids[r, k]]``
    tile by tile; table row ``ids[r, k]`` gets ``d[r, k] hidden[r]``, summed in the
    computing dtype (float32): in one buffer of the table's size for a float32 table,
    by :func:`_sorted_row_sums` for a narrower one, and by :func:`_block_row_sums` on
    a TPU. Returns the hidden states' and the table's ``[V, D]`` gradients."""
    dtype = source.dtype
    hidden, weights = source.hidden, source.weights
    depth = hidden.shape[-1]
    rows = support_rows(source.rows, ids.shape[-1], depth)
    tiles = (_pad_rows(hidden, rows, 0), _pad_rows(ids, rows, 0), _pad_rows(d_raw, rows, 0))
    gathering = _gathering(source, ids.size)
    tpu = _backend() == "tpu"
    wide = not tpu and jnp.dtype(weights.dtype).itemsize >= jnp.dtype(dtype).itemsize

    def step(d_table, tile):
        h, tile_ids, d = tile
        if gathering.table is not None:
            gathered = jnp.take(gathering.table, tile_ids, axis=0).astype(dtype)
        else:
            columns = jnp.take(gathering.unembedding, tile_ids, axis=1)
            gathered = jnp.moveaxis(columns, 0, -1).astype(dtype)
        d_hidden = (d[..., None] * gathered).sum(1)
        if not wide:
            return d_table, d_hidden
        updates = (d[..., None] * h.astype(dtype)[:, None, :]).reshape(-1, depth)
        return d_table.at[tile_ids.reshape(-1)].add(updates), d_hidden

    init = jnp.zeros((source.vocab, depth) if wide else (), dtype)
    d_table, d_hidden = lax.scan(step, init, tiles)
    d_hidden = d_hidden.reshape(-1, depth)[: source.rows]
    if not wide:
        row_sums = _block_row_sums if tpu else _sorted_row_sums
        d_table = row_sums(ids, d_raw, hidden, source.vocab, weights.dtype)
    return d_hidden.astype(hidden.dtype), d_table.astype(weights.dtype)


def _sorted_row_sums(ids: Array, coefficients: Array, hidden: Array, vocab: int, out_dtype):
    """``[V, D]``: row ``v`` the sum of ``coefficients[r, k] * hidden[r]`` over the
    ``(r, k)`` with ``ids[r, k] = v``, summed in float32 and rounded to ``out_dtype``
    once, without a float32 buffer of the table's size.

    The ``(r, k)`` are sorted by id and taken in windows: a window's terms of one id
    are summed in float32 (its ids are sorted, so each id is one segment), and its ids
    written to the output at once, without conflict (each row once); the last id of a
    window is carried in float32 to the next, where its terms may continue.
    """
    count, depth = ids.size, hidden.shape[-1]
    budget = SUPPORT_BYTES.get(_backend(), DEFAULT_SUPPORT_BYTES)
    width = int(min(count, max(256, budget // (16 * depth))))
    sorted_terms = _sorted_terms(ids, coefficients, vocab, -count % width)
    windows = tuple(x.reshape(-1, width) for x in sorted_terms)
    beyond = vocab + jnp.arange(width)  # distinct ids outside the table: dropped

    def step(carry, window):
        out, carried_id, carried = carry
        window_ids, window_rows, window_weights = window
        first = jnp.concatenate([jnp.ones(1, bool), window_ids[1:] != window_ids[:-1]])
        segment = jnp.cumsum(first) - 1
        rows = jnp.take(hidden, window_rows, axis=0).astype(jnp.float32)
        sums = (
            jnp.zeros((width, depth), jnp.float32)
            .at[segment]
            .add(window_weights[:, None] * rows, indices_are_sorted=True)
        )
        segment_ids = beyond.at[segment].set(window_ids, indices_are_sorted=True)
        # The carried id continues here, or is written alone.
        continues = carried_id == window_ids[0]
        sums = sums.at[0].add(jnp.where(continues, carried, 0.0))
        alone = jnp.where(continues, vocab + width, carried_id)
        out = out.at[alone].add(carried.astype(out_dtype), mode="drop")
        last = segment[-1]
        written = jnp.where(jnp.arange(width) == last, beyond, segment_ids)
        out = out.at[written].add(sums.astype(out_dtype), mode="drop", unique_indices=True)
        return (out, segment_ids[last], sums[last]), None

    init = (jnp.zeros((vocab, depth), out_dtype), jnp.int32(vocab), jnp.zeros(depth, jnp.float32))
    (out, carried_id, carried), _ = lax.scan(step, init, windows)
    return out.at[carried_id].add(carried.astype(out_dtype), mode="drop")


def _sorted_terms(ids: Array, coefficients: Array, vocab: int, pad: int):
    """The terms ``(r, k)`` sorted by id (stably), as ``(ids, rows r, coefficients)``
    ``[N K + pad]`` each, padded with id ``vocab``, row 0 and coefficient 0."""
    key = ids.reshape(-1)
    order = jnp.argsort(key, stable=True)
    return (
        jnp.pad(key[order], (0, pad), constant_values=vocab),
        jnp.pad(order // ids.shape[-1], (0, pad)),
        jnp.pad(coefficients.reshape(-1)[order], (0, pad)),
    )


def _block_row_sums(ids: Array, coefficients: Array, hidden: Array, vocab: int, out_dtype):
    """:func:`_sorted_row_sums`'s ``[V, D]`` on the MXU, without a scatter (a TPU's
    scatters of rows are slow).

    The ``(r, k)`` are sorted by id; each block of :data:`SUM_BLOCK` ids takes its terms
    (a range of the sorted ones) :data:`SUM_CHUNK` at a time, as one product of the
    ``[chunk, block]`` matrix that holds each term's coefficient in its id's column with
    the chunk's rows of ``hidden``, accumulated in float32, and is rounded to
    ``out_dtype`` once. A narrower ``hidden``'s coefficients are split in two parts of
    its dtype (two products); a float32 one's are multiplied at full precision. A row
    is within its rounding plus ``2^-20`` of its terms' absolute sum of the exact value.
    """
    depth = hidden.shape[-1]
    # Padded with a chunk of ids past the vocabulary, which match no block's columns.
    sorted_ids, row_of, weight = _sorted_terms(ids, coefficients, vocab, SUM_CHUNK)
    dtype = jnp.promote_types(hidden.dtype, jnp.float32)
    weight = weight.astype(dtype)
    split = jnp.dtype(hidden.dtype).itemsize < 4

    def block(out, start, width):
        columns = start + jnp.arange(width, dtype=sorted_ids.dtype)
        first = jnp.searchsorted(sorted_ids, start)
        end = jnp.searchsorted(sorted_ids, start + width)

        def chunk(state):
            at, total = state
            chunk_ids, rows, w = (
                lax.dynamic_slice_in_dim(a, at, SUM_CHUNK) for a in (sorted_ids, row_of, weight)
            )
            # Terms past the block have ids past its columns: they place nothing.
            placed = jnp.where(chunk_ids[:, None] == columns[None], w[:, None], 0.0)
            parts = [placed]
            if split:
                high = placed.astype(hidden.dtype)
                parts = [high, (placed - high.astype(dtype)).astype(hidden.dtype)]
            h = jnp.take(hidden, rows, axis=0)
            for part in parts:
                total = total + lax.dot_general(
                    part,
                    h,
                    (((0,), (0,)), ((), ())),
                    precision=lax.Precision.HIGHEST,
                    preferred_element_type=dtype,
                )
            return at + SUM_CHUNK, total

        init = (first, jnp.zeros((width, depth), dtype))
        _, total = lax.while_loop(lambda state: state[0] < end, chunk, init)
        return lax.dynamic_update_slice_in_dim(out, total.astype(out_dtype), start, 0)

    return _fold_blocks(vocab, min(SUM_BLOCK, vocab), block, jnp.zeros((vocab, depth), out_dtype))


support_log_probs.defvjp(_support_fwd, _support_bwd)


# ---------------------------------------------------------------------------------
# The whole vocabulary: the log-normaliser, the mean logit and a token's
# log-probability, in one streamed pass (that also samples, given keys), with a VJP
# that recomputes each block.


def _stream_init(rows: int, dtype):
    """A running ``(max raw logit, sum of exp((raw - max) scale), sum of exp(...) raw)``."""
    zeros = jnp.zeros(rows, dtype)
    return jnp.full(rows, -jnp.inf, dtype), zeros, zeros


def _stream(carry, raw, scale):
    """:func:`_stream_init`'s sums with one more block, in the exact arithmetic."""
    top, total, weighted = carry
    new_top = jnp.maximum(top, raw.max(-1))
    shift = jnp.where(jnp.isfinite(new_top), new_top, 0.0)
    factor = exp((top - shift) * scale)
    weights = exp((raw - shift[:, None]) * scale[:, None])
    finite = jnp.where(weights > 0, raw, 0.0)
    return (
        new_top,
        total * factor + tree_sum(weights),
        weighted * factor + tree_sum(weights * finite),
    )


def _noise(keys: Any, start, width: int, aligned: bool, dtype) -> Array:
    """Gumbel noise ``[R, width]`` for tokens ``[start, start + width)``: token ``t`` of
    row ``r`` takes entry ``t % NOISE_CHUNK`` of ``gumbel(fold_in(keys[r], t //
    NOISE_CHUNK), (NOISE_CHUNK,))``, whatever the blocks (``aligned``: ``start`` is a
    multiple of ``NOISE_CHUNK``)."""
    first = start // NOISE_CHUNK
    chunks = -(-width // NOISE_CHUNK) + (0 if aligned else 1)

    def row(key):
        draw = jax.vmap(
            lambda i: jax.random.gumbel(jax.random.fold_in(key, first + i), (NOISE_CHUNK,), dtype)
        )
        return draw(jnp.arange(chunks)).reshape(-1)

    noise = jax.vmap(row)(keys)
    return lax.dynamic_slice_in_dim(noise, start - first * NOISE_CHUNK, width, axis=1)


def _full_tile(source: Source, tokens, keys, impl, size: int):
    """One tile's ``(log-normaliser, entropy, token, token's log-probability)``: the
    token is ``tokens``, or drawn with ``keys`` (Gumbel-max) when they are given. Each
    output is computed here to its last operation, so that no consumer fuses a
    product of it into its own sum."""
    rows, dtype, scale = source.rows, source.dtype, source.scale
    sampling = keys is not None
    typed = jax.random.wrap_key_data(keys, impl=impl) if sampling else None

    def fold(carry, start, width):
        streamed, (best, token, token_raw) = carry
        raw = source.block(start, width)
        ids = start + jnp.arange(width, dtype=jnp.int32)
        if sampling:
            noise = _noise(typed, start, width, size % NOISE_CHUNK == 0, dtype)
            score = raw * scale[:, None] + noise
            local = jnp.argmax(score, axis=-1)
            value = jnp.take_along_axis(score, local[:, None], -1)[:, 0]
            better = value > best  # the earlier token kept on a tie
            best = jnp.where(better, value, best)
            token = jnp.where(better, ids[local], token)
            found = jnp.take_along_axis(raw, local[:, None], -1)[:, 0]
            token_raw = jnp.where(better, found, token_raw)
        else:
            hit = token[:, None] == ids[None]
            found = jnp.where(hit, raw, 0.0).sum(-1)  # one term: exact
            token_raw = jnp.where(hit.any(-1), found, token_raw)
        return _stream(streamed, raw, scale), (best, token, token_raw)

    start_best = (jnp.full(rows, -jnp.inf, dtype), tokens, jnp.full(rows, -jnp.inf, dtype))
    init = (_stream_init(rows, dtype), start_best)
    (top, total, weighted), (_, token, token_raw) = _fold_blocks(source.vocab, size, fold, init)
    shift = jnp.where(jnp.isfinite(top), top, 0.0)
    log_total = log(total)
    log_normaliser = shift * scale + log_total
    log_prob = (token_raw - shift) * scale - log_total
    entropy = log_normaliser - weighted * scale / total
    return log_normaliser, entropy, token, log_prob


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def full_pass(config, source: Source, tokens: Array, keys: Array | None):
    """``(log-normaliser, entropy, token, token's log-probability)`` per row over the
    whole vocabulary, ``[N]`` each. ``config`` is ``(block or None, key
    implementation)``; the token is ``tokens``, or drawn by Gumbel-max with ``keys``
    (raw key data, one per row) when they are not None. The log-normaliser and the
    log-probability have the same bits for a row in any batch (:func:`dense_tiles`)."""
    return _full_forward(config, source, tokens, keys)


@functools.partial(jax.jit, static_argnums=0)
def _full_forward(config, source: Source, tokens, keys):
    block, impl = config
    rows, size = dense_tiles(source.vocab, block)

    def one(tile):
        *parts, tile_tokens, tile_keys = tile
        return _full_tile(source.with_rows(*parts), tile_tokens, tile_keys, impl, size)

    tiles = (*source.tiles(rows), _pad_rows(tokens, rows, 0), _pad_rows(keys, rows, 0))
    return _map_tiles(source.rows, one, tiles)


def _full_fwd(config, source, tokens, keys):
    out = _full_forward(config, source, tokens, keys)
    return out, (source, out)


def _full_bwd(config, residuals, cotangents):
    """The gradients block by block of the vocabulary (outermost) and tile by tile of
    rows: a block's table gradient is summed over the tiles and written once, so
    nothing of the table's size is held in float32."""
    source, (log_normaliser, entropy, token, _) = residuals
    g_z, g_h, _, g_p = cotangents
    # entropy = log-normaliser - mean logit: d/d(logit) of the mean is p (1 + logit - mean).
    mean, g_m = log_normaliser - entropy, -g_h
    rows, size = dense_tiles(source.vocab, config[0])
    dtype, n, vocab = source.dtype, source.rows, source.vocab
    factorized = source.logits is None
    # bfloat16 weights: the products take bfloat16 operands and accumulate in float32.
    operands = jnp.result_type(source.hidden, source.weights) if factorized else dtype
    by_rows = source.table is not None
    # Padding rows get a log-normaliser of +inf, so probabilities of 0.
    per_row = (
        *source.tiles(rows),
        _pad_rows(log_normaliser, rows, jnp.inf),
        _pad_rows(mean, rows, 0),
        _pad_rows(token, rows, PAD),
        _pad_rows(g_z + g_h - g_p, rows, 0),
        _pad_rows(g_m, rows, 0),
        _pad_rows(g_p, rows, 0),
    )
    count = -(-n // rows)
    depth = source.hidden.shape[-1] if factorized else 0

    def block_gradients(carry, start, width):
        d_hidden, d_table, d_logits, d_bias = carry

        def tile_step(block_carry, tile_and_index):
            d_table_block, d_bias_block, out = block_carry
            (*parts, z, m, t, g_norm, g_mean, g_token), index = tile_and_index
            tile = source.with_rows(*parts)
            logits = tile.block(start, width) * tile.scale[:, None]
            probs = jnp.exp(logits - z[:, None])
            finite = jnp.where(probs > 0, logits, 0.0)
            d = probs * (g_norm[:, None] + g_mean[:, None] * (1.0 + finite - m[:, None]))
            d = jnp.where(probs > 0, d, 0.0)
            hit = (t[:, None] == start + jnp.arange(width)[None]) & (logits > -jnp.inf)
            d = (d + jnp.where(hit, g_token[:, None], 0.0)) * tile.scale[:, None]
            if factorized:
                low, h = d.astype(operands), tile.hidden.astype(operands)
                if by_rows:
                    weights = lax.dynamic_slice_in_dim(source.table, start, width, axis=0)
                    product = jnp.dot(low, weights.astype(operands), preferred_element_type=dtype)
                    block_grad = jnp.dot(low.T, h, preferred_element_type=dtype)
                else:
                    weights = lax.dynamic_slice_in_dim(source.unembedding, start, width, axis=1)
                    product = lax.dot_general(
                        low,
                        weights.astype(operands),
                        (((1,), (1,)), ((), ())),
                        preferred_element_type=dtype,
                    )
                    block_grad = jnp.dot(h.T, low, preferred_element_type=dtype)
                rows_grad = lax.dynamic_index_in_dim(out, index, keepdims=False) + product
                out = lax.dynamic_update_index_in_dim(out, rows_grad, index, 0)
                d_table_block = d_table_block + block_grad
            else:
                out = lax.dynamic_update_index_in_dim(out, d, index, 0)
            return (d_table_block, d_bias_block + d.sum(0), out), None

        if factorized:
            shape = (width, depth) if by_rows else (depth, width)
            init = (jnp.zeros(shape, dtype), jnp.zeros(width, dtype), d_hidden)
        else:
            logits_init = jnp.zeros((count, rows, width), dtype)
            init = (jnp.zeros((), dtype), jnp.zeros(width, dtype), logits_init)
        (d_table_block, d_bias_block, out), _ = lax.scan(
            tile_step, init, (per_row, jnp.arange(count))
        )
        d_bias = lax.dynamic_update_slice_in_dim(d_bias, d_bias_block, start, 0)
        if factorized:
            update = d_table_block.astype(d_table.dtype)
            d_table = lax.dynamic_update_slice_in_dim(d_table, update, start, 0 if by_rows else 1)
            return out, d_table, d_logits, d_bias
        update = out.reshape(-1, width).astype(d_logits.dtype)
        d_logits = lax.dynamic_update_slice_in_dim(d_logits, update, start, 1)
        return d_hidden, d_table, d_logits, d_bias

    if factorized:
        init = (
            jnp.zeros((count, rows, depth), dtype),
            jnp.zeros(source.weights.shape, source.weights.dtype),
            None,
            jnp.zeros(vocab, dtype),
        )
    else:
        padded = jnp.zeros((count * rows, vocab), source.logits.dtype)
        init = (None, None, padded, jnp.zeros(vocab, dtype))
    d_hidden, d_table, d_logits, d_bias = cast(
        tuple[Any, Any, Any, Any], _fold_blocks(vocab, size, block_gradients, init)
    )
    grads = dict.fromkeys(("hidden", "table", "unembedding", "logits", "bias"))
    if factorized:
        grads["hidden"] = d_hidden.reshape(-1, depth)[:n].astype(source.hidden.dtype)
        grads["table" if by_rows else "unembedding"] = d_table
    else:
        grads["logits"] = d_logits[:n]
    if source.bias is not None:
        grads["bias"] = d_bias.astype(source.bias.dtype)
    return Source(**grads, scale=None, shared_mask=None, row_mask=None), None, None


full_pass.defvjp(_full_fwd, _full_bwd)


# ---------------------------------------------------------------------------------
# Candidates: the top k tempered logits, exactly, and the log-normaliser.


def top_k(values: Array, k: int, chunk: int | None = None) -> tuple[Array, Array]:
    """The ``k`` largest of ``values [R, W]`` and their positions, sorted, the lower
    position first among equals: ``lax.top_k``'s answer, in two stages.

    The positions are split in chunks of ``chunk``; the chunks holding the top ``k``
    are among the ``k`` chunks whose maxima rank highest (each of those elements
    ranks below its chunk's maximum, itself then among the top ``k``), so the top
    ``k`` is taken from those chunks' ``k * chunk`` values, in order of position.
    ``chunk`` None: 16 or 8 where the width allows, 1 (``lax.top_k`` alone) on the
    CPU, whose ``lax.top_k`` costs about as much at any width.
    """
    rows, width = values.shape
    if width < k:
        filler = jnp.full((rows, k - width), -jnp.inf, values.dtype)
        values = jnp.concatenate([values, filler], -1)
        width = k
    if chunk is None:
        chunk = 16 if width >= 64 * k else 8 if width >= 16 * k else 1
        chunk = 1 if _backend() == "cpu" else chunk
    if chunk == 1 or -(-width // chunk) < k:
        return lax.top_k(values, k)
    pad = -width % chunk
    if pad:
        values = jnp.concatenate([values, jnp.full((rows, pad), -jnp.inf, values.dtype)], -1)
    chunks = values.reshape(rows, -1, chunk)
    _, best = lax.top_k(chunks.max(-1), k)
    best = jnp.sort(best, axis=-1)
    kept = jnp.take_along_axis(chunks, best[:, :, None], 1).reshape(rows, -1)
    top, where = lax.top_k(kept, k)
    positions = (best[:, :, None] * chunk + jnp.arange(chunk)[None, None]).reshape(rows, -1)
    return top, jnp.take_along_axis(positions, where, -1)


@functools.partial(jax.jit, static_argnums=(1, 2))
def candidates(source: Source, k: int, block: tuple[int, int] | None):
    """``(values [N, k], ids [N, k], log-normaliser [N])``: the ``k`` largest tempered
    logits and their ids, sorted, the lower id first among equals (``-inf`` and -1
    past the allowed tokens), and the log-normaliser over the whole vocabulary. The
    values decide a support only, so their rounding may depend on the tiles."""
    rows, size = candidate_tiles(source.rows, source.vocab, block)
    dtype = source.dtype

    def one(tile_parts):
        tile = source.with_rows(*tile_parts)
        count, scale = tile.rows, tile.scale[:, None]

        def fold(carry, start, width):
            values, ids, top, total = carry
            raw = tile.block(start, width)
            block_values, where = top_k(raw, k)
            joined = jnp.concatenate([values, block_values], -1)
            joined_ids = jnp.concatenate([ids, start + where.astype(jnp.int32)], -1)
            values, chosen = lax.top_k(joined, k)  # the earlier block first among equals
            ids = jnp.take_along_axis(joined_ids, chosen, -1)
            new_top = jnp.maximum(top, raw.max(-1))
            shift = jnp.where(jnp.isfinite(new_top), new_top, 0.0)[:, None]
            total = total * jnp.exp((top[:, None] - shift) * scale)[:, 0]
            total = total + jnp.exp((raw - shift) * scale).sum(-1)
            return values, ids, new_top, total

        init = (
            jnp.full((count, k), -jnp.inf, dtype),
            jnp.full((count, k), PAD, jnp.int32),
            jnp.full(count, -jnp.inf, dtype),
            jnp.zeros(count, dtype),
        )
        if size == source.vocab:  # one block: the candidates are its top k
            raw = tile.block(0, size)
            values, ids = top_k(raw, k)
            top = raw.max(-1)
            shift = jnp.where(jnp.isfinite(top), top, 0.0)
            total = jnp.exp((raw - shift[:, None]) * scale).sum(-1)
            ids = ids.astype(jnp.int32)
        else:
            values, ids, top, total = _fold_blocks(source.vocab, size, fold, init)
            shift = jnp.where(jnp.isfinite(top), top, 0.0)
        log_normaliser = shift * tile.scale + jnp.log(total)
        return values * scale, jnp.where(values > -jnp.inf, ids, PAD), log_normaliser

    return _map_tiles(source.rows, one, source.tiles(rows))
