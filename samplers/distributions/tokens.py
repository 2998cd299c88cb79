"""A Categorical over a vocabulary, from hidden states, computed in blocks.

A language model's policy over its next token is ``softmax((h W + b) / T)`` over a
vocabulary of ``V`` tokens, often truncated (top-k, top-p, min-p) before sampling.
:class:`TokenCategorical` never builds the ``[N, V]`` logits: every quantity over the
whole vocabulary streams it in blocks of ``block[1]`` tokens (a running log-sum-exp,
with a custom VJP that recomputes each block, so memory is ``O(rows x block)``), and
quantities over a truncated support gather the unembedding's columns of its ids.

Every per-token value is computed in tiles of ``block[0]`` tokens by one program, the
same whatever the number of tokens computed together, so a token's values do not
depend on the batch it is computed in (1, 8 or all tokens give the same bits).
"""

import functools
from collections.abc import Sequence
from typing import Any, cast

import distrax
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int, PRNGKeyArray

from samplers import _checks
from samplers.distributions import _keys
from samplers.distributions.replay import Replayable

PAD = -1  # the id that pads a stored support


class TokenCategorical(distrax.Distribution, Replayable):
    """``softmax((hidden @ unembedding + bias) / temperature)``, truncated, over a vocabulary.

    Truncation follows vLLM's order: the temperature divides the logits, then min-p
    keeps the tokens of probability at least ``min_p`` times the largest, then top-k
    the ``top_k`` most probable of those, then top-p the most probable of those whose
    mass, renormalised over them (over the whole vocabulary when neither min-p nor
    top-k applies), first reaches ``top_p``: a token is kept while the mass of the
    tokens before it is below ``top_p``. Tokens of equal logits are ranked by id. A
    support never holds more than ``max_kept`` tokens: where the truncation would keep
    more, the support is the ``max_kept`` most probable (and min-p's survivors are
    renormalised over those), so ``max_kept`` also acts as a top-k; raise it if
    supports reach it where your top-p should stop later. Without truncation (no
    ``top_k``, ``top_p`` or ``min_p``) the support is the whole vocabulary.

    The replay data of a sample is the token, and with truncation also the support it
    was drawn from, ``{"token": [*batch], "support": [*batch, max_kept]}`` (the kept
    ids, most probable first, padded with -1): :meth:`replay` scores the stored token
    on the stored support under the current parameters, so the first PPO ratio is
    exactly 1 and a trainer's ratio carries no kept mass. :func:`support_from_kept_ids`
    imports a sampling engine's kept ids.

    ``log_prob``, ``entropy``, ``sample`` and ``mode`` are the truncated
    distribution's, its support recomputed from the current logits;
    :meth:`full_log_prob` and :meth:`full_entropy` are the untruncated distribution's
    (temperature and mask applied). A forbidden token (``mask`` False) has probability
    exactly 0; a row with no allowed token has NaN log-probabilities and entropy and
    acts 0.

    Args:
        hidden: Hidden states ``[*batch, D]``.
        unembedding: ``[D, V]`` (for tied embeddings, the embedding table transposed),
            float32, bfloat16 (accumulated in float32) or float64.
        bias: ``[V]`` or None.
        temperature: Positive; 1 leaves the logits as they are.
        top_k: Keep at most this many tokens (at most ``max_kept``), or None.
        top_p: In ``(0, 1]``, or None.
        min_p: In ``[0, 1]``, or None.
        mask: Booleans broadcastable to ``[*batch, V]``, True where a token is allowed,
            or None.
        max_kept: The largest support a sample keeps, and the width of the stored
            support.
        block: ``(rows, tokens)``: tokens computed together in one tile, and the
            vocabulary block streamed at a time.

    Raises:
        TypeError: ``hidden`` or ``unembedding`` is not floating, ``mask`` not boolean.
        ValueError: a shape does not match, or an option is out of its range.

    Example:
        >>> import jax, jax.numpy as jnp, samplers
        >>> hidden = jax.random.normal(jax.random.key(0), (4, 8))
        >>> unembedding = jax.random.normal(jax.random.key(1), (8, 50))
        >>> dist = samplers.TokenCategorical(hidden, unembedding, top_p=0.8, max_kept=16)
        >>> token, data, log_prob = dist.sample_with_replay(seed=jax.random.key(2))
        >>> data["support"].shape, bool(jnp.all(dist.replay(data)[1] == log_prob))
        ((4, 16), True)
    """

    def __init__(
        self,
        hidden: Float[ArrayLike, "*batch D"],
        unembedding: Float[ArrayLike, "D V"],
        bias: Float[ArrayLike, " V"] | None = None,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        mask: Bool[ArrayLike, "*batch V"] | None = None,
        max_kept: int = 256,
        block: tuple[int, int] = (128, 4096),
    ):
        hidden = _checks.float_array("hidden", hidden)
        unembedding = _checks.float_array("unembedding", unembedding)
        if hidden.ndim < 1 or unembedding.ndim != 2 or unembedding.shape[0] != hidden.shape[-1]:
            raise ValueError(
                f"hidden must be [*batch, D] and unembedding [D, V] with the same D, got "
                f"{hidden.shape} and {unembedding.shape}; pass the unembedding as [D, V] "
                f"(an nnx.Embed's embedding transposed)."
            )
        vocab = unembedding.shape[1]
        if bias is not None:
            bias = _checks.float_array("bias", bias)
            if bias.shape != (vocab,):
                raise ValueError(f"bias must have shape ({vocab},), got {bias.shape}.")
        if mask is not None:
            mask = jnp.asarray(mask)
            shape = (*hidden.shape[:-1], vocab)
            try:
                fits = jnp.broadcast_shapes(mask.shape, shape) == shape
            except ValueError:
                fits = False
            if mask.dtype != jnp.bool_ or not fits:
                raise TypeError(
                    f"mask must be booleans broadcastable to [*batch, V] = {shape}, got "
                    f"{mask.dtype} {mask.shape}; pass True where a token is allowed."
                )
        self._temperature = _checks.real_number("temperature", temperature, above=0.0)
        self._max_kept = _checks.positive_int("max_kept", max_kept)
        self._top_k = None if top_k is None else _checks.positive_int("top_k", top_k)
        if self._top_k is not None and self._top_k > self._max_kept:
            raise ValueError(
                f"top_k must be at most max_kept = {max_kept}, got {top_k}; raise max_kept."
            )
        self._top_p = None if top_p is None else _checks.real_number("top_p", top_p, above=0.0)
        if self._top_p is not None and self._top_p > 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}.")
        self._min_p = None if min_p is None else _checks.real_number("min_p", min_p, minimum=0.0)
        if self._min_p is not None and self._min_p > 1:
            raise ValueError(f"min_p must be in [0, 1], got {min_p}.")
        rows, tokens = (_checks.positive_int("block", b) for b in block)
        self._block = (rows, min(tokens, vocab))
        self._hidden, self._unembedding, self._bias, self._mask = hidden, unembedding, bias, mask
        super().__init__()

    # distrax's interface.

    @property
    def batch_shape(self) -> tuple[int, ...]:
        return tuple(self._hidden.shape[:-1])

    @property
    def event_shape(self) -> tuple[()]:
        return ()

    @property
    def vocab_size(self) -> int:
        """``V``."""
        return self._unembedding.shape[1]

    @property
    def truncated(self) -> bool:
        """Whether a top-k, top-p or min-p applies: then a sample stores its support."""
        return (self._top_k, self._top_p, self._min_p) != (None, None, None)

    @property
    def max_kept(self) -> int:
        """The width of a stored support."""
        return self._max_kept

    def _sample_n(self, key: PRNGKeyArray, n: int) -> Array:
        keys = jax.random.split(_keys.integer_seed(key), n)
        draw = jax.vmap(lambda k: _token(self.sample_replay_data(seed=k)))
        return draw(keys)

    def log_prob(self, value: Int[ArrayLike, "*batch"]) -> Float[Array, "*batch"]:
        """Log-probability of tokens under the truncated distribution of the current
        logits; ``-inf`` outside its support. ``value`` has the batch shape."""
        value = self._tokens(value)
        if not self.truncated:
            return self.full_log_prob(value)
        return self.log_prob_on_support(value, self.support())

    def entropy(self) -> Float[Array, "*batch"]:
        """The exact entropy of the truncated distribution of the current logits."""
        if not self.truncated:
            return self.full_entropy()
        return self.entropy_on_support(self.support())

    def mode(self) -> Int[Array, "*batch"]:
        """The most probable allowed token (the lowest id among equals); 0 for a row
        without one."""
        if self.truncated:
            return _first(self.support())
        return self._unflatten(self._map_rows(self._argmax_tile, self._keys(None)))

    # The replay protocol.

    def sample_replay_data(self, *, seed: PRNGKeyArray | int) -> Any:
        """The token of a fresh sample, with its support when truncated.

        ``seed`` is one key, token ``n`` (in row-major order of the batch) then drawing
        with ``jax.random.fold_in(seed, n)``, or one typed key per token: a token's
        sample depends on its key alone, not on the tokens sampled with it.
        """
        keys = self._keys(seed)
        if not self.truncated:
            token = self._map_rows(self._sample_full_tile, keys)
            return jax.lax.stop_gradient(self._unflatten(token))
        token, support = self._map_rows(self._sample_truncated_tile, keys)
        data = {"token": self._unflatten(token), "support": self._unflatten(support)}
        return jax.lax.stop_gradient(data)

    def deterministic_replay_data(self) -> Any:
        """The greedy token, with the support of the current logits when truncated."""
        if not self.truncated:
            return self.mode()
        support = self.support()
        return {"token": _first(support), "support": support}

    def replay(self, replay_data: Any) -> tuple[Array, Array]:
        """``(token, log_prob)``: the stored token scored on the stored support."""
        token, log_prob, _ = self.replay_and_entropy(replay_data)
        return token, log_prob

    def replay_and_entropy(self, replay_data: Any) -> tuple[Array, Array, Array]:
        """``(token, log_prob, entropy)``: :meth:`replay`, and the exact entropy of the
        distribution the token was drawn from (on the stored support when truncated),
        from one pass over the logits: one streamed pass over the vocabulary, or one
        gather of the support's."""
        if not self.truncated:
            token = self._tokens(replay_data)
            log_normaliser, mean, logit = self._moments(token)
            return token, logit - log_normaliser, log_normaliser - mean
        token = self._tokens(replay_data["token"])
        support = self._support(replay_data["support"])
        log_probs = self.support_log_probs(support)
        return token, _on_support(log_probs, token, support), _entropy(log_probs)

    def check_replay_data(self, replay_data: Any, name: str = "replay data") -> Any:
        """A stored token (and support, when truncated) of this batch shape, integers."""
        if not self.truncated:
            return self._tokens(replay_data, name)
        if not isinstance(replay_data, dict) or set(replay_data) != {"token", "support"}:
            raise TypeError(
                f"a truncated TokenCategorical replays {{'token', 'support'}}, got "
                f"{type(replay_data).__name__} as {name}; pass the replay data of a sample."
            )
        return {
            "token": self._tokens(replay_data["token"], "the stored token"),
            "support": self._support(replay_data["support"]),
        }

    # On a stored support.

    def support(self) -> Int[Array, "*batch max_kept"]:
        """The truncated support of the current logits, ``[*batch, max_kept]`` ids,
        most probable first, padded with -1 (without gradient)."""
        support = self._map_rows(self._support_tile, self._keys(None))
        return jax.lax.stop_gradient(self._unflatten(support))

    def support_log_probs(self, support: Int[ArrayLike, "*batch K"]) -> Float[Array, "*batch K"]:
        """The log-probabilities of a stored support's tokens, renormalised over it
        (``-inf`` for padding and for tokens the mask forbids)."""
        return _log_softmax(self._support_logits(self._support(support)))

    def log_prob_on_support(
        self, value: Int[ArrayLike, "*batch"], support: Int[ArrayLike, "*batch K"]
    ) -> Float[Array, "*batch"]:
        """Log-probability of tokens on a stored support; ``-inf`` outside it."""
        value, support = self._tokens(value), self._support(support)
        return _on_support(self.support_log_probs(support), value, support)

    def entropy_on_support(self, support: Int[ArrayLike, "*batch K"]) -> Float[Array, "*batch"]:
        """The exact entropy of the distribution renormalised over a stored support."""
        return _entropy(self.support_log_probs(support))

    def kl_on_support(
        self, other: "TokenCategorical", support: Int[ArrayLike, "*batch K"]
    ) -> Float[Array, "*batch"]:
        """``KL(self || other)``, both renormalised over a stored support: old against
        new on the support a token was drawn from."""
        p, q = self.support_log_probs(support), other.support_log_probs(support)
        positive = p > -jnp.inf
        terms = jnp.where(positive, jnp.exp(p) * (p - jnp.where(positive, q, 0.0)), 0.0)
        return terms.sum(-1) + _nan_rows(p) + _nan_rows(q)

    def support_mass(self, support: Int[ArrayLike, "*batch K"]) -> Float[Array, "*batch"]:
        """The probability that the untruncated distribution (temperature and mask
        applied) puts on a stored support: what a ratio scored on the whole vocabulary
        carries, ``exp(full_log_prob(t) - log_prob_on_support(t, support))`` for any
        ``t`` of the support."""
        logits = self._support_logits(self._support(support))
        return jnp.exp(jax.nn.logsumexp(logits, axis=-1) - self._moments()[0])

    # The whole vocabulary.

    def full_log_prob(self, value: Int[ArrayLike, "*batch"]) -> Float[Array, "*batch"]:
        """Log-probability of tokens over the whole vocabulary (untruncated)."""
        log_normaliser, _, logit = self._moments(self._tokens(value))
        return logit - log_normaliser

    def full_entropy(self) -> Float[Array, "*batch"]:
        """The exact entropy of the untruncated distribution."""
        log_normaliser, mean, _ = self._moments()
        return log_normaliser - mean

    # Internals: rows, tiles and blocks.

    @property
    def _dtype(self):
        return jnp.promote_types(jnp.result_type(self._hidden, self._unembedding), jnp.float32)

    def _tokens(self, value, name: str = "value") -> Array:
        value = jnp.asarray(value)
        if not jnp.issubdtype(value.dtype, jnp.integer) or value.shape != self.batch_shape:
            raise TypeError(
                f"{name} must be integer token ids of the batch shape {self.batch_shape}, "
                f"got {value.dtype} {value.shape}."
            )
        return value.astype(jnp.int32)

    def _support(self, support) -> Array:
        support = jnp.asarray(support)
        if (
            not jnp.issubdtype(support.dtype, jnp.integer)
            or support.shape[:-1] != self.batch_shape
            or support.ndim != len(self.batch_shape) + 1
        ):
            raise TypeError(
                f"a support must be integer ids [*batch, K] = [{self.batch_shape}, K], got "
                f"{support.dtype} {support.shape}; store the support a sample returned, or "
                f"import kept ids with samplers.support_from_kept_ids."
            )
        return support.astype(jnp.int32)

    def _rows(self) -> tuple[Array, Array | None]:
        """The hidden states ``[N, D]`` and the per-row mask ``[N, V]`` (or None)."""
        hidden = self._hidden.reshape(-1, self._hidden.shape[-1])
        mask = self._mask
        if mask is not None and mask.ndim > 1 and mask.shape[:-1] != (1,) * (mask.ndim - 1):
            shape = (*self.batch_shape, self.vocab_size)
            mask = jnp.broadcast_to(mask, shape).reshape(-1, self.vocab_size)
        else:
            mask = None
        return hidden, mask

    def _shared_mask(self) -> Array | None:
        """A mask the same for every row, ``[V]``, or None."""
        mask = self._mask
        if mask is None or (mask.ndim > 1 and mask.shape[:-1] != (1,) * (mask.ndim - 1)):
            return None
        return mask.reshape(-1)

    def _keys(self, seed) -> Array:
        """One typed key per row, ``[N]`` (unused ones where ``seed`` is None)."""
        n = int(np.prod(self.batch_shape))
        if seed is None:
            return jax.random.split(jax.random.key(0), n)
        seed = _keys.integer_seed(seed)
        if jnp.ndim(seed) == 0:
            return jax.vmap(lambda i: jax.random.fold_in(seed, i))(jnp.arange(n))
        _keys.check_keys(seed, self.batch_shape)
        return seed.reshape(-1)

    def _unflatten(self, value):
        return value.reshape(*self.batch_shape, *value.shape[1:])

    def _map_rows(self, tile_fn, keys: Array):
        """``tile_fn(tile, keys)`` over fixed tiles of ``block[0]`` rows, the last padded."""
        hidden, row_mask = self._rows()
        impl = jax.random.key_impl(keys)
        args = _tiled(self._block[0], hidden, jax.random.key_data(keys), row_mask)

        def one(tile):
            h, k, m = tile
            return tile_fn(_Tile(self, h, m), jax.random.wrap_key_data(k, impl=impl))

        out = jax.lax.map(one, args)
        return jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:])[: hidden.shape[0]], out)

    def _support_logits(self, ids: Array) -> Array:
        """The tempered logits of ids ``[*batch, K]`` (-1: padding), ``-inf`` for padding
        and forbidden tokens: the unembedding's columns gathered, tile by tile."""
        flat = ids.reshape(-1, ids.shape[-1])
        hidden, row_mask = self._rows()
        if row_mask is not None:
            row_mask = jnp.take_along_axis(row_mask, jnp.maximum(flat, 0), -1)
        tiles = _tiled(self._block[0], hidden, flat, row_mask)
        logits = jax.lax.map(lambda t: _gathered_logits(self, *t), tiles)
        return logits.reshape(-1, ids.shape[-1])[: flat.shape[0]].reshape(ids.shape)

    def _moments(self, tokens=None) -> tuple[Array, Array, Array]:
        """``(log-normaliser, mean logit, logit of tokens)`` over the whole vocabulary,
        ``[*batch]`` each (``tokens`` None: token 0's)."""
        hidden, row_mask = self._rows()
        tokens = jnp.zeros(hidden.shape[0], jnp.int32) if tokens is None else tokens.reshape(-1)
        config = (self._block, self._temperature, self._dtype)
        out = _streamed_moments(
            config, hidden, self._unembedding, self._bias, self._shared_mask(), row_mask, tokens
        )
        log_normaliser, mean, logit = cast(tuple[Array, Array, Array], out)
        return self._unflatten(log_normaliser), self._unflatten(mean), self._unflatten(logit)

    # Tile programs.

    def _support_tile(self, tile: "_Tile", keys) -> Array:
        values, ids, log_normaliser = tile.candidates()
        return jnp.where(self._keep(values, log_normaliser), ids, PAD)

    def _sample_truncated_tile(self, tile: "_Tile", keys) -> tuple[Array, Array]:
        values, ids, log_normaliser = tile.candidates()
        keep = self._keep(values, log_normaliser)
        noise = jax.vmap(lambda k: jax.random.gumbel(k, (values.shape[-1],), values.dtype))(keys)
        pick = jnp.argmax(jnp.where(keep, values + noise, -jnp.inf), axis=-1)
        token = jnp.take_along_axis(ids, pick[:, None], -1)[:, 0]
        support = jnp.where(keep, ids, PAD)
        return jnp.where(keep[:, 0], token, 0), support

    def _sample_full_tile(self, tile: "_Tile", keys) -> Array:
        def fold(carry, logits, start, index):
            noise = jax.vmap(
                lambda k: jax.random.gumbel(
                    jax.random.fold_in(k, index), (logits.shape[-1],), logits.dtype
                )
            )(keys)
            score = logits + noise
            local = jnp.argmax(score, axis=-1)
            return _better(carry, jnp.max(score, axis=-1), start + local.astype(jnp.int32))

        init = (jnp.full(tile.rows, -jnp.inf, self._dtype), jnp.zeros(tile.rows, jnp.int32))
        return tile.fold(fold, init)[1]

    def _argmax_tile(self, tile: "_Tile", keys) -> Array:
        def fold(carry, logits, start, index):
            local = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            return _better(carry, jnp.max(logits, axis=-1), start + local)

        init = (jnp.full(tile.rows, -jnp.inf, self._dtype), jnp.zeros(tile.rows, jnp.int32))
        return tile.fold(fold, init)[1]

    def _keep(self, values: Array, log_normaliser: Array) -> Array:
        """Which of the sorted candidates ``[R, max_kept]`` the truncation keeps.

        Top-p's mass is over the survivors of min-p and top-k, all among the
        candidates unless ``max_kept`` binds; without either, over the whole
        vocabulary (``log_normaliser``).
        """
        keep = values > -jnp.inf
        if self._min_p is not None:
            keep &= values >= values[:, :1] + jnp.log(jnp.asarray(self._min_p, values.dtype))
        if self._top_k is not None:
            keep &= jnp.arange(values.shape[-1])[None] < self._top_k
        if self._top_p is not None:
            if self._min_p is None and self._top_k is None:
                probs = jnp.exp(values - log_normaliser[:, None])
            else:
                probs = jax.nn.softmax(jnp.where(keep, values, -jnp.inf), axis=-1)
            before = jnp.cumsum(probs, axis=-1)
            before = jnp.concatenate([jnp.zeros_like(before[:, :1]), before[:, :-1]], -1)
            keep &= before < self._top_p
        return keep


class _Tile:
    """One tile of rows: its tempered, masked logits block by block."""

    def __init__(self, dist: TokenCategorical, hidden, row_mask):
        self.dist, self.hidden, self.row_mask = dist, hidden, row_mask
        self.rows = hidden.shape[0]

    def logits(self, start, size: int) -> Array:
        dist = self.dist
        return _block_logits(
            (dist._temperature, dist._dtype),
            self.hidden,
            dist._unembedding,
            dist._bias,
            dist._shared_mask(),
            self.row_mask,
            start,
            size,
        )

    def fold(self, fold, init):
        """``fold(carry, logits, start, index)`` over the vocabulary blocks."""
        return _fold_blocks(self.dist.vocab_size, self.dist._block[1], self.logits, fold, init)

    def candidates(self) -> tuple[Array, Array, Array]:
        """The ``max_kept`` largest tempered logits and their ids, sorted, ids of equal
        logits in increasing order (``-inf`` and -1 past the allowed tokens), and the
        log-normaliser over the whole vocabulary, ``[R]``."""
        kept = self.dist.max_kept

        def fold(carry, logits, start, index):
            values, ids, streamed = carry
            block_ids = start + jnp.arange(logits.shape[-1], dtype=jnp.int32)
            joined = jnp.concatenate([values, logits], -1)
            joined_ids = jnp.concatenate([ids, jnp.broadcast_to(block_ids, logits.shape)], -1)
            top, where = jax.lax.top_k(joined, kept)
            ids = jnp.take_along_axis(joined_ids, where, -1).astype(jnp.int32)
            return top, ids, _stream(streamed, logits)

        dtype = self.dist._dtype
        init = (
            jnp.full((self.rows, kept), -jnp.inf, dtype),
            jnp.full((self.rows, kept), PAD),
            _stream_init(self.rows, dtype),
        )
        values, ids, streamed = self.fold(fold, init)
        log_normaliser = _log_normaliser(streamed)
        return values, jnp.where(values > -jnp.inf, ids, PAD), log_normaliser


def _stream_init(rows: int, dtype):
    """A running ``(max, sum of exp(logit - max), sum of exp(logit - max) * logit)``."""
    zeros = jnp.zeros(rows, dtype)
    return jnp.full(rows, -jnp.inf, dtype), zeros, zeros


def _stream(carry, logits):
    """The running sums of :func:`_stream_init` with one more block of logits."""
    top, total, weighted = carry
    new_top = jnp.maximum(top, logits.max(-1))
    shift = jnp.where(jnp.isfinite(new_top), new_top, 0.0)
    scale = jnp.exp(top - shift)
    weights = jnp.exp(logits - shift[:, None])
    finite = jnp.where(weights > 0, logits, 0.0)
    return (
        new_top,
        total * scale + weights.sum(-1),
        weighted * scale + (weights * finite).sum(-1),
    )


def _log_normaliser(carry) -> Array:
    top, total, _ = carry
    return jnp.where(jnp.isfinite(top), top, 0.0) + jnp.log(total)


def _fold_blocks(vocab: int, size: int, logits_of, fold, init):
    """``fold(carry, logits_of(start, size), start, index)`` over the full blocks of
    ``size`` tokens (a scan), then over the remainder (``logits_of`` None: ``fold(carry,
    None, start, size)``, for a fold that computes its own)."""
    full = vocab // size

    def step(carry, start, width, index):
        logits = None if logits_of is None else logits_of(start, width)
        return fold(carry, logits, start, index if logits_of is not None else width)

    def body(carry, index):
        return step(carry, index * size, size, index), None

    carry, _ = jax.lax.scan(body, init, jnp.arange(full, dtype=jnp.int32))
    if vocab % size:
        carry = step(carry, full * size, vocab - full * size, jnp.int32(full))
    return carry


def _block_logits(config, hidden, unembedding, bias, shared_mask, row_mask, start, size):
    """The tempered logits of tokens ``[start, start + size)``, ``-inf`` where forbidden."""
    temperature, dtype = config
    weights = jax.lax.dynamic_slice_in_dim(unembedding, start, size, axis=1)
    logits = jnp.dot(hidden, weights, preferred_element_type=dtype).astype(dtype)
    if bias is not None:
        logits = logits + jax.lax.dynamic_slice_in_dim(bias, start, size).astype(dtype)[None]
    logits = logits / jnp.asarray(temperature, dtype)
    if shared_mask is not None:
        allowed = jax.lax.dynamic_slice_in_dim(shared_mask, start, size)[None]
        logits = jnp.where(allowed, logits, -jnp.inf)
    if row_mask is not None:
        logits = jnp.where(
            jax.lax.dynamic_slice_in_dim(row_mask, start, size, axis=1), logits, -jnp.inf
        )
    return logits


def _gathered_logits(dist: TokenCategorical, hidden, ids, row_allowed):
    """The tempered logits of ``ids`` ``[R, K]`` for one tile of rows."""
    dtype = dist._dtype
    safe = jnp.maximum(ids, 0)
    columns = jnp.take(dist._unembedding, safe, axis=1)  # [D, R, K]
    logits = jnp.einsum("rd,drk->rk", hidden, columns, preferred_element_type=dtype).astype(dtype)
    if dist._bias is not None:
        logits = logits + dist._bias[safe].astype(dtype)
    logits = logits / jnp.asarray(dist._temperature, dtype)
    allowed = ids != PAD
    shared_mask = dist._shared_mask()
    if shared_mask is not None:
        allowed &= shared_mask[safe]
    if row_allowed is not None:
        allowed &= row_allowed
    return jnp.where(allowed, logits, -jnp.inf)


# The log-normaliser and the mean logit over the whole vocabulary, streamed, with a VJP
# that recomputes each block instead of storing it.


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _streamed_moments(config, hidden, unembedding, bias, shared_mask, row_mask, tokens):
    return _moments_forward(config, hidden, unembedding, bias, shared_mask, row_mask, tokens)[0]


def _moments_forward(config, hidden, unembedding, bias, shared_mask, row_mask, tokens):
    """``(log-normaliser, mean logit, the token's logit)`` per row, ``[N]`` each: the
    token's logit is picked from its block by comparison, with no gather."""
    block, temperature, dtype = config
    tiles = _tiled(block[0], hidden, row_mask, tokens)

    def one(tile):
        h, m, token = tile
        logits_of = functools.partial(
            _block_logits, (temperature, dtype), h, unembedding, bias, shared_mask, m
        )

        def fold(carry, logits, start, index):
            streamed, picked = carry
            hit = _hits(token, start, logits.shape[-1])
            picked = jnp.where(hit.any(-1), jnp.where(hit, logits, 0.0).sum(-1), picked)
            return _stream(streamed, logits), picked

        init = (_stream_init(h.shape[0], dtype), jnp.full(h.shape[0], -jnp.inf, dtype))
        streamed, picked = _fold_blocks(unembedding.shape[1], block[1], logits_of, fold, init)
        return _log_normaliser(streamed), streamed[2] / streamed[1], picked

    n = hidden.shape[0]
    out = tuple(a.reshape(-1)[:n] for a in jax.lax.map(one, tiles))
    return out, (hidden, unembedding, bias, shared_mask, row_mask, tokens, out)


def _moments_backward(config, residuals, cotangents):
    """The gradients, block by block of the vocabulary (outermost) and tile by tile of
    rows: each block's unembedding gradient is summed over the tiles and written once,
    so nothing of the unembedding's size is held in float32. A row's hidden-state
    gradient sums its blocks in the same order whatever the batch."""
    block, temperature, dtype = config
    hidden, unembedding, bias, shared_mask, row_mask, tokens, out = residuals
    n, vocab = hidden.shape[0], unembedding.shape[1]
    # bfloat16 weights: the products take bfloat16 operands and accumulate in float32,
    # as the forward's do.
    operands = jnp.result_type(hidden, unembedding)
    # Padding rows get a log-normaliser of +inf, so probabilities of 0 (not exp of
    # whatever their logits are, which overflows at small temperatures).
    log_normaliser = jnp.pad(out[0], (0, -n % block[0]), constant_values=jnp.inf)
    tiles = _tiled(block[0], hidden, row_mask, tokens, log_normaliser, out[1], *cotangents)
    count = -(-n // block[0])  # tiles

    def block_gradients(carry, _, start, size):
        d_hidden, d_w, d_b = carry
        weights = jax.lax.dynamic_slice_in_dim(unembedding, start, size, axis=1)

        def tile_step(block_carry, tile_and_index):
            d_w_block, d_b_block, d_hidden = block_carry
            (h, m, token, log_normaliser, mean, g_z, g_m, g_t), index = tile_and_index
            logits = _block_logits(
                (temperature, dtype), h, unembedding, bias, shared_mask, m, start, size
            )
            probs = jnp.exp(logits - log_normaliser[:, None])
            finite = jnp.where(probs > 0, logits, 0.0)
            d_logits = probs * (g_z[:, None] + g_m[:, None] * (1.0 + finite - mean[:, None]))
            d_logits = jnp.where(probs > 0, d_logits, 0.0)
            hit = _hits(token, start, size) & (logits > -jnp.inf)
            d_logits = (d_logits + jnp.where(hit, g_t[:, None], 0.0)) / temperature
            low = d_logits.astype(operands)
            rows = jax.lax.dynamic_index_in_dim(d_hidden, index, keepdims=False)
            rows = rows + jnp.dot(low, weights.T.astype(operands), preferred_element_type=dtype)
            d_hidden = jax.lax.dynamic_update_index_in_dim(d_hidden, rows, index, 0)
            d_w_block = d_w_block + jnp.dot(h.T.astype(operands), low, preferred_element_type=dtype)
            return (d_w_block, d_b_block + d_logits.sum(0), d_hidden), None

        init = (jnp.zeros((hidden.shape[1], size), dtype), jnp.zeros(size, dtype), d_hidden)
        indices = jnp.arange(count)
        (d_w_block, d_b_block, d_hidden), _ = jax.lax.scan(tile_step, init, (tiles, indices))
        d_w = jax.lax.dynamic_update_slice_in_dim(d_w, d_w_block.astype(d_w.dtype), start, 1)
        d_b = jax.lax.dynamic_update_slice_in_dim(d_b, d_b_block, start, 0)
        return d_hidden, d_w, d_b

    d_hidden = jnp.zeros((count, block[0], hidden.shape[1]), dtype)
    init = (d_hidden, jnp.zeros(unembedding.shape, unembedding.dtype), jnp.zeros(vocab, dtype))
    carry = _fold_blocks(vocab, block[1], None, block_gradients, init)
    d_hidden, d_w, d_b = carry
    d_hidden = d_hidden.reshape(-1, hidden.shape[-1])[:n].astype(hidden.dtype)
    d_bias = None if bias is None else d_b.astype(bias.dtype)
    return d_hidden, d_w, d_bias, None, None, None


_streamed_moments.defvjp(_moments_forward, _moments_backward)


def _hits(token, start, size: int) -> Array:
    """``[R, size]``: where each row's token falls in the block ``[start, start + size)``."""
    return token[:, None] == start + jnp.arange(size, dtype=jnp.int32)[None]


def _tiled(rows: int, *arrays):
    """Each array ``[N, ...]`` padded to a multiple of ``rows`` and split in tiles
    ``[N / rows, rows, ...]`` (None stays None; masks pad with True, others with 0)."""

    def one(a):
        if a is None:
            return None
        pad = -a.shape[0] % rows
        fill = True if a.dtype == jnp.bool_ else (PAD if a.dtype == jnp.int32 else 0)
        a = jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1), constant_values=fill)
        return a.reshape(-1, rows, *a.shape[1:])

    return tuple(one(a) for a in arrays)


@jax.custom_vjp
def _log_softmax(logits: Array) -> Array:
    """``jax.nn.log_softmax`` over the last axis, differentiated from its output: the
    forward pass is the same arithmetic whether or not a gradient is taken, so a loss
    program rounds it as the rollout did."""
    return _log_softmax_forward(logits)[0]


def _log_softmax_forward(logits):
    top = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    shifted = logits - jnp.where(jnp.isfinite(top), top, 0.0)
    log_probs = shifted - jnp.log(jnp.sum(jnp.exp(shifted), axis=-1, keepdims=True))
    return log_probs, log_probs


def _log_softmax_backward(log_probs, cotangent):
    # Padding and forbidden tokens (-inf) pass no gradient; a token whose probability
    # underflows to 0 still does (d log p / d logit = 1 - p).
    safe = jnp.where(log_probs > -jnp.inf, cotangent, 0.0)
    return (safe - jnp.exp(log_probs) * jnp.sum(safe, axis=-1, keepdims=True),)


_log_softmax.defvjp(_log_softmax_forward, _log_softmax_backward)


def _better(carry, value, token):
    """The running ``(best value, its token)``, the earlier token kept on a tie."""
    best, kept = carry
    better = value > best
    return jnp.where(better, value, best), jnp.where(better, token, kept)


def _token(data) -> Array:
    return data["token"] if isinstance(data, dict) else data


def _first(support: Array) -> Array:
    return jnp.maximum(support[..., 0], 0)


def _on_support(log_probs: Array, value: Array, support: Array) -> Array:
    """The log-probability of each token among its support's (``-inf`` outside it)."""
    hit = (support == value[..., None]) & (support != PAD)
    found = jnp.where(hit, log_probs, 0.0).sum(-1)
    return jnp.where(hit.any(-1), found, -jnp.inf) + _nan_rows(log_probs)


def _entropy(log_probs: Array) -> Array:
    positive = log_probs > -jnp.inf
    safe = jnp.where(positive, log_probs, 0.0)
    return -jnp.sum(jnp.where(positive, jnp.exp(safe) * safe, 0.0), axis=-1) + _nan_rows(log_probs)


def _nan_rows(log_probs: Array) -> Array:
    """0, or NaN for a row with no token of positive probability."""
    return jnp.where(jnp.any(log_probs > -jnp.inf, axis=-1), 0.0, jnp.nan)


def support_from_kept_ids(
    kept_ids: Sequence[Sequence[int]] | np.ndarray, max_kept: int, vocab_size: int | None = None
) -> Array:
    """A sampling engine's kept ids per token as a stored support ``[N, max_kept]``.

    ``kept_ids`` is one sequence of ids per token (vLLM's kept token ids, a "keep
    sampling mask" turned into ids), or an array padded with -1. The ids of a token
    must be distinct, at most ``max_kept`` of them, and inside ``[0, vocab_size)``.
    Order does not matter: a support is scored as a set.

    Raises:
        ValueError: a token keeps more than ``max_kept`` ids, none, a duplicate, or
            one outside the vocabulary.

    Example:
        >>> import samplers
        >>> samplers.support_from_kept_ids([[5, 2], [7]], max_kept=3)
        Array([[ 5,  2, -1],
               [ 7, -1, -1]], dtype=int32)
    """
    max_kept = _checks.positive_int("max_kept", max_kept)
    out = np.full((len(kept_ids), max_kept), PAD, np.int32)
    for row, ids in enumerate(kept_ids):
        ids = [int(i) for i in np.asarray(ids).reshape(-1) if i != PAD]
        if not ids or len(ids) > max_kept or len(set(ids)) != len(ids):
            raise ValueError(
                f"token {row} keeps {len(ids)} ids ({len(set(ids))} distinct); each token "
                f"needs 1 to max_kept = {max_kept} distinct ids; raise max_kept or check the "
                f"engine's output."
            )
        if min(ids) < 0 or (vocab_size is not None and max(ids) >= vocab_size):
            raise ValueError(
                f"token {row} keeps ids outside [0, {vocab_size}): {min(ids)}..{max(ids)}."
            )
        out[row, : len(ids)] = ids
    return jnp.asarray(out)
