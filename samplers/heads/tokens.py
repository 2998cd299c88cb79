"""A language model's next-token policy: a :class:`samplers.TokenCategorical` head.

The network output is the model's last hidden states and its unembedding (owned by
the model, often tied to its embedding), never the ``[*batch, V]`` logits: the pure
layer streams the vocabulary in blocks, and the head adds the stream, ``eval()``, the
stored token (and support) and its exact entropy cost.
"""

from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from samplers import _checks
from samplers.distributions.tokens import PAD, TokenCategorical
from samplers.heads.action_sampler import ActionSampler, Scored

TokenInputs = Any  # (hidden [*batch, D], unembedding [D, V]) or (hidden, unembedding, bias)


class TokenSampler(ActionSampler):
    """One token of a vocabulary of ``vocab_size``, sampled, truncated and replayed.

    ``inputs`` is ``(hidden, unembedding)`` or ``(hidden, unembedding, bias)``:
    ``hidden [*batch, D]``, ``unembedding [D, V]``, ``bias [V]``; the policy is
    ``softmax((hidden @ unembedding + bias) / temperature)``, truncated by top-k,
    top-p and min-p as :class:`samplers.TokenCategorical` says. ``mask`` (a keyword
    of the call) is booleans broadcastable to ``[*batch, V]``, True where a token is
    allowed: a forbidden token is never sampled and scores ``-inf``.

    A rollout draws one key from the stream (token ``n`` then draws with
    ``fold_in(key, n)``), or with ``per_env_streams`` each token its own key, and
    stores the token, or with truncation ``{"token", "support"}``; the replay scores
    the stored token on the stored support, so the first PPO ratio is exactly 1.
    ``eval()`` takes the greedy token. ``regularization_loss`` is ``-entropy_weight``
    times the exact entropy of the distribution the token was drawn from (on its
    stored support when truncated), so a replay and an ``eval()`` call draw no key.

    ``metrics``, without gradient: ``support_size``, the number of kept ids per
    token (``V`` without truncation), and ``kept_mass``, the probability that the
    untruncated distribution (temperature and mask applied) puts on the support (1
    without truncation; 0 where the support holds no allowed token). ``kept_mass``
    costs one more streamed pass over the vocabulary, which ``jax.jit`` drops when
    the metric is unused.

    Args:
        rngs: The ``nnx.Rngs`` to draw from (positional or ``rngs=``), or one
            ``nnx.RngStream`` of it.
        entropy_weight: Weight of the entropy bonus, finite (required).
        vocab_size: ``V``, positive: the unembedding's width.
        temperature, top_k, top_p, min_p, max_kept, block: As in
            :class:`samplers.TokenCategorical`.
        per_env_streams: If True, one random stream per token in the carry state
            (see :meth:`initialize_state`).
        log_ratio_metrics: If True, the rollout emits ``{"replay_data",
            "log_likelihood"}`` and a replay reports ``log_ratio`` and ``approx_kl``
            (see :class:`samplers.ActionSampler`).
        rng_collection: The stream keys are drawn from, falling back to ``default``.

    Raises:
        ValueError: ``vocab_size`` is not a positive integer, or an option is out of
            its range (at construction); the unembedding is not ``vocab_size`` wide.
        TypeError: ``inputs`` is not such a tuple (or list).

    Example:
        >>> import jax, jax.numpy as jnp, samplers
        >>> from flax import nnx
        >>> head = samplers.TokenSampler(nnx.Rngs(0), 0.01, vocab_size=50, top_p=0.8)
        >>> inputs = (jnp.ones((4, 8)), jax.random.normal(jax.random.key(1), (8, 50)))
        >>> out = head((), inputs)
        >>> again = head((), inputs, out.rollout_extras)
        >>> bool(jnp.all(again.output["log_likelihood"] == out.output["log_likelihood"]))
        True
    """

    takes_mask = True

    def __init__(
        self,
        rngs: nnx.Rngs | nnx.RngStream,
        entropy_weight: float,
        *,
        vocab_size: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        max_kept: int = 256,
        block: tuple[int, int] = (128, 4096),
        per_env_streams: bool = False,
        log_ratio_metrics: bool = False,
        rng_collection: str = "action",
    ):
        super().__init__(
            rngs,
            entropy_weight,
            per_env_streams=per_env_streams,
            log_ratio_metrics=log_ratio_metrics,
            rng_collection=rng_collection,
        )
        self.vocab_size = _checks.positive_int("vocab_size", vocab_size)
        self.temperature, self.top_k, self.top_p, self.min_p = temperature, top_k, top_p, min_p
        self.max_kept, self.block = max_kept, cast(tuple[int, int], tuple(block))
        # The distribution checks its options: a bad one raises here, not at the first call.
        self._make(np.zeros((1, 1), np.float32), np.zeros((1, 1), np.float32), None, None)

    @property
    def num_params(self) -> int:
        """Not defined: the network output is a tuple of arrays, not one of a fixed width.

        Raises:
            AttributeError: always.
        """
        raise AttributeError(
            f"TokenSampler has no num_params: its network output is (hidden, unembedding"
            f"[, bias]), not one array of a fixed width (its vocabulary has {self.vocab_size} "
            f"tokens); use it as a head of its own, not as a part of a composite."
        )

    def _distribution(self, inputs: TokenInputs, mask: Any) -> TokenCategorical:
        sequence = isinstance(inputs, (tuple, list))
        if not sequence or len(inputs) not in (2, 3):
            got = type(inputs).__name__ + (f" of length {len(inputs)}" if sequence else "")
            raise TypeError(
                f"TokenSampler takes inputs=(hidden [*batch, D], unembedding [D, V]) or "
                f"(hidden, unembedding, bias [V]), got {got}; pass the language model's "
                f"hidden states with its unembedding (for tied embeddings, the embedding "
                f"table transposed), not the logits."
            )
        hidden, unembedding, *bias = inputs
        if jnp.ndim(unembedding) != 2 or jnp.shape(unembedding)[1] != self.vocab_size:
            raise ValueError(
                f"TokenSampler was built with vocab_size={self.vocab_size}, so the unembedding "
                f"must be [D, {self.vocab_size}], got {jnp.shape(unembedding)}; pass it as "
                f"[D, V] or build the head with the model's vocab_size."
            )
        return self._make(hidden, unembedding, bias[0] if bias else None, mask)

    def _make(self, hidden, unembedding, bias, mask) -> TokenCategorical:
        return TokenCategorical(
            hidden,
            unembedding,
            bias,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            mask=mask,
            max_kept=self.max_kept,
            block=self.block,
        )

    def _replay(self, dist: TokenCategorical, data) -> Scored:
        token, log_likelihood, entropy = dist.replay_and_entropy(data)
        return Scored(data, token, log_likelihood, entropy=entropy)

    def _metrics(self, inputs, dist: TokenCategorical, scored: Scored) -> dict:
        dtype = scored.log_likelihood.dtype
        if not dist.truncated:
            size = jnp.full(dist.batch_shape, self.vocab_size, dtype)
            return {"support_size": size, "kept_mass": jnp.ones(dist.batch_shape, dtype)}
        support = scored.data["support"]
        kept = dist.support_mass(support)
        size = jnp.sum(support != PAD, axis=-1).astype(kept.dtype)
        return jax.lax.stop_gradient({"support_size": size, "kept_mass": kept})
