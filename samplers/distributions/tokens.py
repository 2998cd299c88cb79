"""A Categorical over a language model's vocabulary, truncated, replayed bit for bit.

A language model's policy over its next token is ``softmax((h W + b) / T)`` over a
vocabulary of ``V`` tokens, often truncated (top-k, top-p, min-p) before sampling.
:class:`TokenCategorical` never builds the ``[N, V]`` logits: quantities over the whole
vocabulary stream it in tiles, and a token drawn from a truncated distribution is scored
on the support it was drawn from, whose logits gather the table's rows. The numerics
(exact arithmetic, tiles, custom VJPs) live in :mod:`._token_math`.
"""

from collections.abc import Sequence
from typing import Any, cast

import distrax
import jax
import jax.numpy as jnp
import numpy as np
from jax import core
from jaxtyping import Array, ArrayLike, Bool, Float, Int, PRNGKeyArray

from samplers import _checks
from samplers.distributions import _keys
from samplers.distributions import _token_math as math
from samplers.distributions.replay import Replayable

PAD = math.PAD  # pads a stored support
FULL = math.FULL  # a stored support's first id when its token was drawn untruncated

Option = float | int | ArrayLike | None


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
    supports reach it where your top-p should stop later. ``top_p=1``, ``min_p=0`` and
    no ``top_k`` truncate nothing, as in vLLM: the support is the whole vocabulary.

    The options may be arrays of the batch shape, one value per row (vLLM's
    per-request parameters), compiled once for any values: a ``top_k`` of 0 or less
    turns it off for its row. A row whose options truncate nothing is drawn from the
    whole vocabulary and stores the support ``[FULL, PAD, ...]`` (``FULL`` = -2).

    The replay data of a sample is the token, and with truncation also the support it
    was drawn from, ``{"token": [*batch], "support": [*batch, max_kept]}`` (the kept
    ids, most probable first, padded with -1): :meth:`replay` scores the stored token
    on the stored support under the current parameters, so the first PPO ratio is
    exactly 1 and a trainer's ratio carries no kept mass. A token's score has the same
    bits whatever the rows computed with it (a rollout step's, a whole batch's, a
    shuffled minibatch's), jitted or not, under a gradient or not, and whatever
    ``block``: in float32 its arithmetic is fixed (see :mod:`._token_math`); in float64
    it is ``jnp.exp``'s and may differ by an ulp. Without truncation the same holds for
    the default ``block``, whose tiles have a fixed shape per backend.
    :func:`support_from_kept_ids` imports a sampling engine's kept ids.

    ``log_prob``, ``entropy``, ``sample`` and ``mode`` are the truncated
    distribution's, its support recomputed from the current logits;
    :meth:`full_log_prob` and :meth:`full_entropy` are the untruncated distribution's
    (temperature and mask applied). A forbidden token (``mask`` False) has probability
    exactly 0; a row with no allowed token has NaN log-probabilities and entropy and
    acts 0. No gradient flows to the options.

    Args:
        hidden: Hidden states ``[*batch, D]``.
        unembedding: ``[D, V]`` (a ``[D, V]`` kernel, such as an ``nnx.Linear``'s),
            float32, bfloat16 (accumulated in float32) or float64; or None with
            ``embedding``.
        bias: ``[V]`` or None.
        embedding: In place of ``unembedding``, the embedding table ``[V, D]`` of
            tied embeddings (``nnx.Embed.embedding``). Prefer it where you have it: a
            support's logits gather the table's rows, contiguous in ``[V, D]`` and
            strided columns of a ``[D, V]`` unembedding, which is transposed (a copy)
            when a step gathers many.
        temperature: Positive, a number or an array of the batch shape. 0 (greedy
            decoding) is refused: take :meth:`mode` (a head's ``eval()``).
        top_k: Keep at most this many tokens (at most ``max_kept``), or None; per
            row, 0 or less turns it off.
        top_p: In ``(0, 1]``, or None; 1 truncates nothing.
        min_p: In ``[0, 1]``, or None; 0 truncates nothing.
        mask: Booleans broadcastable to ``[*batch, V]``, True where a token is allowed,
            or None.
        max_kept: The largest support a sample keeps, and the width of the stored
            support.
        block: ``(rows, tokens)`` of the tiles that stream the whole vocabulary, or
            None (the default) for the backend's: a fixed tile for the untruncated
            values (``(64, 4096)`` on the CPU, ``(1024, 4096)`` on a TPU), and for
            the candidates of a sample every row and the whole vocabulary at once
            where their logits fit 64 MiB (CPU) or 1 GiB, else tiles within that. A
            ``block`` of your own may change the rounding of the untruncated values:
            give the rollout and the replay the same one.

    Raises:
        TypeError: ``hidden`` or the weights are not floating, neither or both of
            ``unembedding`` and ``embedding`` are given, ``mask`` is not boolean, an
            option not a number or an array of the batch shape.
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
        unembedding: Float[ArrayLike, "D V"] | None = None,
        bias: Float[ArrayLike, " V"] | None = None,
        *,
        embedding: Float[ArrayLike, "V D"] | None = None,
        temperature: Option = 1.0,
        top_k: Option = None,
        top_p: Option = None,
        min_p: Option = None,
        mask: Bool[ArrayLike, "*batch V"] | None = None,
        max_kept: int = 256,
        block: tuple[int, int] | None = None,
    ):
        hidden = _checks.float_array("hidden", hidden)
        if (unembedding is None) == (embedding is None):
            raise TypeError(
                "TokenCategorical takes the unembedding [D, V] or the embedding table [V, D] "
                "(embedding=), one of them; pass the tied embedding table as embedding=."
            )
        if embedding is not None:
            weights, name, axis, shape = embedding, "embedding", 1, "embedding [V, D]"
        else:
            weights, name, axis, shape = unembedding, "unembedding", 0, "unembedding [D, V]"
        weights = _checks.float_array(name, weights)
        if hidden.ndim < 1 or weights.ndim != 2 or weights.shape[axis] != hidden.shape[-1]:
            raise ValueError(
                f"hidden must be [*batch, D] and {shape} with the same D, got "
                f"{hidden.shape} and {weights.shape}; pass an nnx.Embed's table as "
                f"embedding=, or a [D, V] kernel as the unembedding."
            )
        self._hidden, self._logits = hidden, None
        self._unembedding = None if embedding is not None else weights
        self._embedding = weights if embedding is not None else None
        options = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        vocab = weights.shape[1 - axis]
        self._setup(hidden.shape[:-1], vocab, bias, mask, max_kept, block, options)

    def _setup(self, batch_shape, vocab: int, bias, mask, max_kept, block, options) -> None:
        """Checks and stores what both constructors share."""
        batch_shape = tuple(batch_shape)
        if bias is not None:
            bias = _checks.float_array("bias", bias)
            if bias.shape != (vocab,):
                raise ValueError(f"bias must have shape ({vocab},), got {bias.shape}.")
        if mask is not None:
            mask = jnp.asarray(mask)
            shape = (*batch_shape, vocab)
            try:
                fits = jnp.broadcast_shapes(mask.shape, shape) == shape
            except ValueError:
                fits = False
            if mask.dtype != jnp.bool_ or not fits:
                raise TypeError(
                    f"mask must be booleans broadcastable to [*batch, V] = {shape}, got "
                    f"{mask.dtype} {mask.shape}; pass True where a token is allowed."
                )
        self._batch_shape, self._vocab = batch_shape, vocab
        self._max_kept = _checks.positive_int("max_kept", max_kept)
        self._temperature = _temperature(options["temperature"], batch_shape)
        self._top_k = _option("top_k", options["top_k"], batch_shape, self._max_kept)
        self._top_p = _option("top_p", options["top_p"], batch_shape, self._max_kept)
        self._min_p = _option("min_p", options["min_p"], batch_shape, self._max_kept)
        if block is not None:
            rows, tokens = (_checks.positive_int("block", b) for b in block)
            block = (rows, tokens)
        self._block = block
        self._bias, self._mask = bias, mask
        super().__init__()

    @classmethod
    def from_logits(
        cls,
        logits: Float[ArrayLike, "*batch V"],
        *,
        temperature: Option = 1.0,
        top_k: Option = None,
        top_p: Option = None,
        min_p: Option = None,
        mask: Bool[ArrayLike, "*batch V"] | None = None,
        max_kept: int = 256,
        block: tuple[int, int] | None = None,
    ) -> "TokenCategorical":
        """The distribution of a model that returns its logits ``[*batch, V]`` (Tunix,
        MaxText and Hugging Face Flax models do): the same options and guarantees;
        a support gathers its logits, and gradients flow to ``logits``.

        Raises:
            TypeError: ``logits`` is not floating.
            ValueError: ``logits`` has no vocabulary axis.

        Example:
            >>> import jax, jax.numpy as jnp, samplers
            >>> logits = jax.random.normal(jax.random.key(0), (2, 3, 50))  # [B, T, V]
            >>> dist = samplers.TokenCategorical.from_logits(logits, top_p=0.9, max_kept=32)
            >>> token, data, log_prob = dist.sample_with_replay(seed=jax.random.key(1))
            >>> token.shape, bool(jnp.all(dist.replay(data)[1] == log_prob))
            ((2, 3), True)
        """
        logits = _checks.float_array("logits", logits)
        if logits.ndim < 1:
            raise ValueError(f"logits must be [*batch, V], got shape {logits.shape}.")
        dist = cls.__new__(cls)
        dist._hidden, dist._unembedding, dist._embedding, dist._logits = None, None, None, logits
        options = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        dist._setup(logits.shape[:-1], logits.shape[-1], None, mask, max_kept, block, options)
        return dist

    # distrax's interface.

    @property
    def batch_shape(self) -> tuple[int, ...]:
        return self._batch_shape

    @property
    def event_shape(self) -> tuple[()]:
        return ()

    @property
    def vocab_size(self) -> int:
        """``V``."""
        return self._vocab

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
        return jax.vmap(lambda k: _token(self.sample_replay_data(seed=k)))(keys)

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
        _, ids, _ = _candidates(self._source(), 1, self._block)
        return self._unflatten(jnp.maximum(ids[:, 0], 0))

    # The replay protocol.

    def sample_replay_data(self, *, seed: PRNGKeyArray | int) -> Any:
        """The token of a fresh sample, with its support when truncated.

        ``seed`` is one key, token ``n`` (in row-major order of the batch) then drawing
        with ``jax.random.fold_in(seed, n)``, or one typed key per token: a token's
        sample depends on its key alone, not on the tokens sampled with it.
        """
        return jax.lax.stop_gradient(self._draw(self._keys(seed)))

    def sample_with_replay(self, *, seed: PRNGKeyArray | int) -> tuple[Array, Any, Array]:
        """``(token, replay_data, log_prob)`` of one fresh sample; ``log_prob`` is
        ``replay(replay_data)[1]``. Without truncation one pass over the vocabulary
        draws the token and scores it."""
        if self.truncated:
            return super().sample_with_replay(seed=seed)
        keys = self._keys(seed)
        data = _full_pass(self._config(keys), self._source(), self._no_tokens(), _raw(keys))
        token = jax.lax.stop_gradient(data[2])
        log_prob = self._unflatten(data[3])
        return self._unflatten(token), self._unflatten(token), log_prob

    def deterministic_replay_data(self) -> Any:
        """The greedy token, with the support of the current logits when truncated."""
        if not self.truncated:
            return self.mode()
        values, ids, log_normaliser = _candidates(self._source(), self._max_kept, self._block)
        support = self._mark_full(jnp.where(self._keep(values, log_normaliser), ids, PAD))
        token = jnp.maximum(ids[:, 0], 0)
        data = {"token": self._unflatten(token), "support": self._unflatten(support)}
        return jax.lax.stop_gradient(data)

    def replay(self, replay_data: Any) -> tuple[Array, Array]:
        """``(token, log_prob)``: the stored token scored on the stored support (the
        first two of :meth:`replay_and_entropy`)."""
        token, log_prob, _ = self.replay_and_entropy(replay_data)
        return token, log_prob

    def replay_and_entropy(self, replay_data: Any) -> tuple[Array, Array, Array]:
        """``(token, log_prob, entropy)``: the stored token scored as :meth:`replay`
        does, and the exact entropy of the distribution it was drawn from (on the
        stored support when truncated, the whole vocabulary's otherwise), in one pass:
        one gather of the support's logits, or one stream over the vocabulary.

        Raises:
            TypeError: the data is not this distribution's (see :meth:`check_replay_data`).
            ValueError: a concrete support holds an id outside the vocabulary or none.
        """
        data = self.check_replay_data(replay_data)
        if not self.truncated:
            _, entropy, _, log_prob = self._full(data)
            return data, self._unflatten(log_prob), self._unflatten(entropy)
        log_prob, entropy = self._on_support(data["token"], data["support"])
        return data["token"], log_prob, entropy

    def check_replay_data(self, replay_data: Any, name: str = "replay data") -> Any:
        """A stored token (and support, when truncated) of this batch shape, integers;
        ``name`` names the data in the errors.

        Raises:
            TypeError: the data is not this distribution's: an array of token ids
                without truncation, ``{"token", "support"}`` with it.
            ValueError: a concrete support holds an id outside ``[0, V)`` (or -1
                padding), or none.
        """
        if not self.truncated:
            if isinstance(replay_data, dict):
                raise TypeError(
                    f"an untruncated TokenCategorical replays the stored token ids alone, got "
                    f"a dict with {sorted(replay_data)} as {name}; pass the token the sample "
                    f"returned (a support is stored only with top_k, top_p < 1 or min_p > 0)."
                )
            return self._tokens(replay_data, name)
        if not isinstance(replay_data, dict) or set(replay_data) != {"token", "support"}:
            got = (
                f"a dict with {sorted(replay_data)}"
                if isinstance(replay_data, dict)
                else type(replay_data).__name__
            )
            raise TypeError(
                f"a truncated TokenCategorical replays {{'token', 'support'}}, got {got} as "
                f"{name}; "
                f"pass the replay data its sample returned (the stored token and support)."
            )
        return {
            "token": self._tokens(replay_data["token"], f"{name}['token']"),
            "support": self._support(replay_data["support"], check=True),
        }

    # On a stored support.

    def support(self) -> Int[Array, "*batch max_kept"]:
        """The truncated support of the current logits, ``[*batch, max_kept]`` ids,
        most probable first, padded with -1 (without gradient); ``[FULL, -1, ...]``
        for a row whose options truncate nothing."""
        values, ids, log_normaliser = _candidates(self._source(), self._max_kept, self._block)
        support = jnp.where(self._keep(values, log_normaliser), ids, PAD)
        support = self._mark_full(support)
        return jax.lax.stop_gradient(self._unflatten(support))

    def support_log_probs(self, support: Int[ArrayLike, "*batch K"]) -> Float[Array, "*batch K"]:
        """The log-probabilities of a stored support's tokens, renormalised over it
        (``-inf`` for padding and for tokens the mask forbids; NaN for a row with
        none, or with an id outside the vocabulary)."""
        support = self._support(support)
        return self._unflatten(self._support_log_probs(support))

    def log_prob_on_support(
        self, value: Int[ArrayLike, "*batch"], support: Int[ArrayLike, "*batch K"]
    ) -> Float[Array, "*batch"]:
        """Log-probability of tokens on a stored support; ``-inf`` outside it."""
        return self._on_support(self._tokens(value), self._support(support))[0]

    def entropy_on_support(self, support: Int[ArrayLike, "*batch K"]) -> Float[Array, "*batch"]:
        """The exact entropy of the distribution renormalised over a stored support (the
        untruncated one for a support ``[FULL, ...]``)."""
        support = self._support(support)
        return self._on_support(jnp.zeros(self.batch_shape, jnp.int32), support)[1]

    def kl_on_support(
        self, other: "TokenCategorical", support: Int[ArrayLike, "*batch K"]
    ) -> Float[Array, "*batch"]:
        """``KL(self || other)``, both renormalised over a stored support: old against
        new on the support a token was drawn from."""
        support = self._support(support)
        p, q = self._support_log_probs(support), other._support_log_probs(support)
        positive = p > -jnp.inf
        terms = jnp.where(positive, jnp.exp(p) * (p - jnp.where(positive, q, 0.0)), 0.0)
        return self._unflatten(terms.sum(-1) + _nan_rows(p) + _nan_rows(q))

    def support_mass(self, support: Int[ArrayLike, "*batch K"]) -> Float[Array, "*batch"]:
        """The probability that the untruncated distribution (temperature and mask
        applied) puts on a stored support: what a ratio scored on the whole vocabulary
        carries, ``exp(full_log_prob(t) - log_prob_on_support(t, support))`` for any
        ``t`` of the support (1 for a support ``[FULL, ...]``)."""
        support = self._support(support)
        flat = support.reshape(-1, support.shape[-1])
        logits = math.gathered_logits(self._source(), flat, self._allowed(flat))
        log_normaliser = self._full(self._no_tokens().reshape(self.batch_shape))[0]
        mass = jnp.exp(jax.nn.logsumexp(logits, axis=-1) - log_normaliser.reshape(-1))
        return self._unflatten(jnp.where(flat[:, 0] == FULL, 1.0, mass))

    # The whole vocabulary.

    def full_log_prob(self, value: Int[ArrayLike, "*batch"]) -> Float[Array, "*batch"]:
        """Log-probability of tokens over the whole vocabulary (untruncated)."""
        return self._unflatten(self._full(self._tokens(value))[3])

    def full_entropy(self) -> Float[Array, "*batch"]:
        """The exact entropy of the untruncated distribution."""
        return self._unflatten(self._full(self._no_tokens().reshape(self.batch_shape))[1])

    # Internals.

    def _source(self) -> math.Source:
        """The rows flattened: ``[N, ...]`` arrays for the numerics."""
        n = int(np.prod(self._batch_shape))
        dtype = self._computing_dtype()
        temperature = jnp.broadcast_to(jnp.asarray(self._temperature, dtype), self._batch_shape)
        scale = (1 / temperature).reshape(n)
        shared, row_mask = None, None
        if self._mask is not None:
            mask = self._mask
            if mask.ndim > 1 and mask.shape[:-1] != (1,) * (mask.ndim - 1):
                row_mask = jnp.broadcast_to(mask, (*self._batch_shape, self._vocab)).reshape(n, -1)
            else:
                shared = mask.reshape(-1)
        hidden = self._hidden
        return math.Source(
            hidden=None if hidden is None else hidden.reshape(n, -1),
            table=self._embedding,
            unembedding=self._unembedding,
            logits=None if self._logits is None else self._logits.reshape(n, -1),
            bias=self._bias,
            scale=scale,
            shared_mask=shared,
            row_mask=row_mask,
        )

    def _computing_dtype(self):
        arrays = [self._hidden, self._unembedding, self._embedding, self._logits]
        arrays = [a for a in arrays if a is not None]
        return jnp.promote_types(jnp.result_type(*arrays), jnp.float32)

    def _config(self, keys: Array | None = None):
        impl = None if keys is None else jax.random.key_impl(keys)
        return (self._block, impl)

    def _full(self, tokens: Array) -> tuple[Array, Array, Array, Array]:
        """``full_pass`` of ``tokens`` of the batch shape: ``(log-normaliser, entropy,
        token, log-probability)``, ``[N]`` each."""
        return _full_pass(self._config(), self._source(), tokens.reshape(-1), None)

    def _no_tokens(self) -> Array:
        return jnp.zeros(int(np.prod(self._batch_shape)), jnp.int32)

    def _tokens(self, value, name: str = "value") -> Array:
        value = _checks.numeric_array(name, value) if not isinstance(value, Array) else value
        if not jnp.issubdtype(value.dtype, jnp.integer) or value.shape != self.batch_shape:
            raise TypeError(
                f"{name} must be integer token ids of the batch shape {self.batch_shape}, "
                f"got {value.dtype} {value.shape}."
            )
        return value.astype(jnp.int32)

    def _support(self, support, check: bool = False) -> Array:
        support = _checks.numeric_array("the stored support", support)
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
        if check and not isinstance(support, core.Tracer):
            _check_support(np.asarray(support), self._vocab)
        return support.astype(jnp.int32)

    def _on_support(self, token: Array, support: Array) -> tuple[Array, Array]:
        """``(log_prob, entropy)`` of stored tokens on stored supports, of the batch
        shape: one gather of the support's logits (a stream over the vocabulary for
        the rows drawn untruncated)."""
        log_probs = self._support_log_probs(support)
        flat_token, flat_support = token.reshape(-1), support.reshape(-1, support.shape[-1])
        hit = (flat_support == flat_token[:, None]) & (flat_support >= 0)
        found = jnp.where(hit, log_probs, 0.0).sum(-1)  # one term: exact
        log_prob = jnp.where(hit.any(-1), found, -jnp.inf) + _nan_rows(log_probs)
        entropy = _entropy(log_probs)
        if self._rows_may_be_full():
            full = flat_support[:, 0] == FULL

            def untruncated():
                out = self._full(jnp.where(full, flat_token, 0).reshape(token.shape))
                return out[3], out[1]

            full_log_prob, full_entropy = jax.lax.cond(
                jnp.any(full), untruncated, lambda: (log_prob, entropy)
            )
            log_prob = jnp.where(full, full_log_prob, log_prob)
            entropy = jnp.where(full, full_entropy, entropy)
        return self._unflatten(log_prob), self._unflatten(entropy)

    def _support_log_probs(self, support: Array) -> Array:
        """``[N, K]``: the exact log-softmax over the stored support (NaN for a row with
        an id outside the vocabulary)."""
        flat = support.reshape(-1, support.shape[-1])
        log_probs = math.support_log_probs(self._source(), flat, self._allowed(flat))
        invalid = jnp.any((flat >= self._vocab) | (flat < PAD), axis=-1) & (flat[:, 0] != FULL)
        return jnp.where(invalid[:, None], jnp.nan, log_probs)

    def _allowed(self, ids: Array) -> Array:
        """Where the ids ``[N, K]`` are tokens the mask allows (not padding)."""
        allowed = (ids >= 0) & (ids < self._vocab)
        source = self._source()
        safe = jnp.clip(ids, 0, self._vocab - 1)
        if source.shared_mask is not None:
            allowed &= source.shared_mask[safe]
        if source.row_mask is not None:
            allowed &= jnp.take_along_axis(source.row_mask, safe, -1)
        return allowed

    def _keys(self, seed) -> Array:
        """One typed key per row, ``[N]``."""
        n = int(np.prod(self.batch_shape))
        seed = _keys.integer_seed(seed)
        if jnp.ndim(seed) == 0:
            return jax.vmap(lambda i: jax.random.fold_in(seed, i))(jnp.arange(n))
        _keys.check_keys(seed, self.batch_shape)
        return seed.reshape(-1)

    def _unflatten(self, value):
        return value.reshape(*self.batch_shape, *value.shape[1:])

    def _draw(self, keys: Array) -> Any:
        """The replay data of one fresh sample per row, with keys ``[N]``."""
        source = self._source()
        if not self.truncated:
            out = _full_pass(self._config(keys), source, self._no_tokens(), _raw(keys))
            return self._unflatten(out[2])
        values, ids, log_normaliser = _candidates(source, self._max_kept, self._block)
        keep = self._keep(values, log_normaliser)
        noise = jax.vmap(lambda k: jax.random.gumbel(k, (values.shape[-1],), values.dtype))(keys)
        pick = jnp.argmax(jnp.where(keep, values + noise, -jnp.inf), axis=-1)
        token = jnp.where(keep[:, 0], jnp.take_along_axis(ids, pick[:, None], -1)[:, 0], 0)
        support = jnp.where(keep, ids, PAD)
        if self._rows_may_be_full():
            full = self._full_rows()

            def untruncated():
                out = _full_pass(self._config(keys), source, self._no_tokens(), _raw(keys))
                return out[2]

            drawn = jax.lax.cond(jnp.any(full), untruncated, lambda: token)
            token = jnp.where(full, drawn, token)
            support = self._mark_full(support)
        return {"token": self._unflatten(token), "support": self._unflatten(support)}

    def _row_option(self, value, dtype) -> Array:
        n = int(np.prod(self._batch_shape))
        return jnp.broadcast_to(jnp.asarray(value, dtype), self._batch_shape).reshape(n)

    def _rows_may_be_full(self) -> bool:
        """Whether some rows may truncate nothing: every option given is an array."""
        given = [o for o in (self._top_k, self._top_p, self._min_p) if o is not None]
        return bool(given) and all(not isinstance(o, (int, float)) for o in given)

    def _full_rows(self) -> Array:
        """``[N]``: the rows whose options truncate nothing."""
        dtype = self._computing_dtype()
        full = jnp.ones(int(np.prod(self._batch_shape)), bool)
        if self._top_k is not None:
            full &= self._row_option(self._top_k, jnp.int32) <= 0
        if self._top_p is not None:
            full &= self._row_option(self._top_p, dtype) >= 1
        if self._min_p is not None:
            full &= self._row_option(self._min_p, dtype) <= 0
        return full

    def _mark_full(self, support: Array) -> Array:
        if not self._rows_may_be_full():
            return support
        marked = jnp.full_like(support, PAD).at[:, 0].set(FULL)
        return jnp.where(self._full_rows()[:, None], marked, support)

    def _keep(self, values: Array, log_normaliser: Array) -> Array:
        """Which of the sorted candidates ``[N, max_kept]`` the truncation keeps.

        Top-p's mass is over the survivors of min-p and top-k, all among the
        candidates unless ``max_kept`` binds; where neither applies to a row, over
        the whole vocabulary (``log_normaliser``).
        """
        dtype = values.dtype
        keep = values > -jnp.inf
        applies = jnp.zeros(values.shape[0], bool)
        if self._min_p is not None:
            min_p = self._row_option(self._min_p, dtype)
            keep &= values >= values[:, :1] + jnp.log(min_p)[:, None]
            applies |= min_p > 0
        if self._top_k is not None:
            top_k = self._row_option(self._top_k, jnp.int32)
            width = values.shape[-1]
            keep &= jnp.arange(width)[None] < jnp.where(top_k > 0, top_k, width)[:, None]
            applies |= top_k > 0
        if self._top_p is not None:
            top_p = self._row_option(self._top_p, dtype)
            probs = jnp.exp(values - log_normaliser[:, None])
            if self._min_p is not None or self._top_k is not None:
                renormalised = jax.nn.softmax(jnp.where(keep, values, -jnp.inf), axis=-1)
                probs = jnp.where(applies[:, None], renormalised, probs)
            before = jnp.cumsum(probs, axis=-1)
            before = jnp.concatenate([jnp.zeros_like(before[:, :1]), before[:, :-1]], -1)
            keep &= (before < top_p[:, None]) | (top_p[:, None] >= 1)
        return keep


def _temperature(value, batch_shape) -> float | Array:
    """A positive number, or an array of the batch shape (NaN rows where not positive)."""
    if isinstance(value, (int, float, np.number)) and not isinstance(value, (bool, np.bool_)):
        if value == 0:
            raise ValueError(
                f"temperature must be > 0.0, got {value}; temperature 0 is greedy decoding: "
                f"take dist.mode() (a head's eval() takes the greedy token)."
            )
        return _checks.real_number("temperature", value, above=0.0)
    array = _option_array("temperature", value, batch_shape, floating=True)
    if not isinstance(array, core.Tracer):
        values = np.asarray(array)
        if not np.all(values > 0) or not np.all(np.isfinite(values)):
            raise ValueError(
                f"temperature must be > 0 and finite in every row, got {values.min()} at the "
                f"least; for greedy rows take dist.mode() (a head's eval())."
            )
    return jnp.where(array > 0, array, jnp.nan)


def _option(name: str, value, batch_shape, max_kept: int):
    """``top_k``, ``top_p`` or ``min_p``: None for one that truncates nothing, a number,
    or an array of the batch shape."""
    if value is None:
        return None
    if isinstance(value, (int, float, np.number)) and not isinstance(value, (bool, np.bool_)):
        if name == "top_k":
            top_k = _checks.positive_int("top_k", value)
            if top_k > max_kept:
                raise ValueError(
                    f"top_k must be at most max_kept = {max_kept}, got {top_k}; raise max_kept."
                )
            return top_k
        if name == "top_p":
            top_p = _checks.real_number("top_p", value, above=0.0)
            if top_p > 1:
                raise ValueError(f"top_p must be in (0, 1], got {value}.")
            return None if top_p == 1 else top_p
        min_p = _checks.real_number("min_p", value, minimum=0.0)
        if min_p > 1:
            raise ValueError(f"min_p must be in [0, 1], got {value}.")
        return None if min_p == 0 else min_p
    array = _option_array(name, value, batch_shape, floating=name != "top_k")
    if not isinstance(array, core.Tracer):
        values = np.asarray(array)
        low, high = {"top_k": (-np.inf, max_kept), "top_p": (0, 1), "min_p": (0, 1)}[name]
        bad = (values > high) | (values <= low if name == "top_p" else values < low)
        if np.any(bad):
            ranges = {
                "top_k": f"at most max_kept = {max_kept} (0 or less: off)",
                "top_p": "in (0, 1]",
                "min_p": "in [0, 1]",
            }
            raise ValueError(f"{name} must be {ranges[name]} in every row, got {values[bad][0]}.")
    return array


def _option_array(name: str, value, batch_shape, *, floating: bool) -> Array:
    array = _checks.numeric_array(name, value)
    kind_ok = jnp.issubdtype(array.dtype, jnp.floating if floating else jnp.integer)
    if floating and jnp.issubdtype(array.dtype, jnp.integer):
        kind_ok, array = True, array.astype(jnp.float32)
    try:
        fits = jnp.broadcast_shapes(array.shape, batch_shape) == batch_shape
    except ValueError:
        fits = False
    if not kind_ok or not fits:
        kind = "floating" if floating else "integer"
        raise TypeError(
            f"{name} must be a number or a {kind} array broadcastable to the batch shape "
            f"{batch_shape}, got {array.dtype} {array.shape}; pass one value per row."
        )
    return array


def _check_support(support: np.ndarray, vocab: int) -> None:
    """Refuses a concrete support with an id outside ``[0, V)`` or no id in a row."""
    flat = support.reshape(-1, support.shape[-1])
    full = flat[:, 0] == FULL
    valid = (flat >= 0) & (flat < vocab)
    bad = ~(valid | (flat == PAD))
    bad[:, 0] &= ~full
    if np.any(bad):
        row, column = np.argwhere(bad)[0]
        raise ValueError(
            f"the stored support holds id {flat[row, column]} (row {row}), outside the "
            f"vocabulary [0, {vocab}) and not the padding -1; store the support the sample "
            f"returned for this vocabulary."
        )
    empty = ~valid.any(-1) & ~full
    if np.any(empty):
        raise ValueError(
            f"the stored support of row {np.argmax(empty)} holds no id; a token is drawn "
            f"from at least one: store the support the sample returned."
        )


def _full_pass(config, source, tokens, keys) -> tuple[Array, Array, Array, Array]:
    return cast(tuple[Array, Array, Array, Array], math.full_pass(config, source, tokens, keys))


def _candidates(source, k: int, block) -> tuple[Array, Array, Array]:
    return cast(tuple[Array, Array, Array], math.candidates(source, k, block))


def _raw(keys: Array) -> Array:
    return jax.random.key_data(keys)


def _token(data) -> Array:
    return data["token"] if isinstance(data, dict) else data


def _entropy(log_probs: Array) -> Array:
    positive = log_probs > -jnp.inf
    safe = jnp.where(positive, log_probs, 0.0)
    return -jnp.sum(jnp.where(positive, jnp.exp(safe) * safe, 0.0), axis=-1) + _nan_rows(log_probs)


def _nan_rows(log_probs: Array) -> Array:
    """0, or NaN for a row with no token of positive probability."""
    return jnp.where(jnp.any(log_probs > -jnp.inf, axis=-1), 0.0, jnp.nan)


def support_from_kept_ids(
    kept_ids: Sequence[Sequence[int]] | ArrayLike, max_kept: int, vocab_size: int | None = None
) -> Array:
    """A sampling engine's kept ids per token as a stored support ``[..., max_kept]``.

    ``kept_ids`` is one sequence of ids per token (vLLM's kept token ids, a "keep
    sampling mask" turned into ids), or an array ``[..., width]`` padded with -1 (a
    NumPy or a concrete JAX array, of any leading shape: ``[B, T, width]`` gives
    ``[B, T, max_kept]``). The ids of a token must be distinct, at most ``max_kept``
    of them, and inside ``[0, vocab_size)``. Order does not matter: a support is
    scored as a set.

    Raises:
        ValueError: a token keeps more than ``max_kept`` ids, none, a duplicate, or
            one outside the vocabulary.
        TypeError: ``kept_ids`` is a traced array (the checks need its values).

    Example:
        >>> import samplers
        >>> samplers.support_from_kept_ids([[5, 2], [7]], max_kept=3)
        Array([[ 5,  2, -1],
               [ 7, -1, -1]], dtype=int32)
    """
    max_kept = _checks.positive_int("max_kept", max_kept)
    if isinstance(kept_ids, core.Tracer):
        raise TypeError(
            "support_from_kept_ids checks the ids' values, so it takes concrete ids (NumPy "
            "or a JAX array outside jax.jit), got a traced array; import the engine's ids "
            "before the jitted step."
        )
    rows: Any = kept_ids
    if isinstance(kept_ids, (np.ndarray, jax.Array)) and np.ndim(kept_ids) > 1:
        array = np.asarray(kept_ids)
        rows, leading = array.reshape(-1, array.shape[-1]), array.shape[:-1]
    else:
        leading = (len(rows),)
    out = np.full((len(rows), max_kept), PAD, np.int32)
    for row, ids in enumerate(rows):
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
    return jnp.asarray(out.reshape(*leading, max_kept))
