"""A language model's next-token policy: a :class:`samplers.TokenCategorical` head.

The network output is the model's last hidden states and its unembedding (owned by
the model, often tied to its embedding), or the logits of a model that returns them:
the pure layer streams the vocabulary in tiles, and the head adds the stream,
``eval()``, the stored token (and support) and its exact entropy cost.
"""

from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from samplers import _checks
from samplers.distributions.tokens import FULL, TokenCategorical
from samplers.heads.action_sampler import ActionSampler, Scored

# (hidden [*batch, D], unembedding [D, V][, bias [V]]), logits [*batch, V], or a dict of
# those names (or "embedding" [V, D]) with per-row options.
TokenInputs = Any
_OPTIONS = ("temperature", "top_k", "top_p", "min_p")
_ARRAYS = ("hidden", "unembedding", "embedding", "bias", "logits")


class TokenSampler(ActionSampler):
    """One token of a vocabulary of ``vocab_size``, sampled, truncated and replayed.

    ``inputs`` is ``(hidden, unembedding)`` or ``(hidden, unembedding, bias)``:
    ``hidden [*batch, D]``, ``unembedding [D, V]``, ``bias [V]``; the policy is
    ``softmax((hidden @ unembedding + bias) / temperature)``, truncated by top-k,
    top-p and min-p as :class:`samplers.TokenCategorical` says. A model that returns
    its logits passes them, ``[*batch, V]``, as ``inputs``. ``inputs`` may also be a
    dict of those arrays by name (``"hidden"`` with ``"unembedding"`` or a tied
    ``"embedding"`` table ``[V, D]``, and ``"bias"``; or ``"logits"``) with per-row
    options, ``"temperature"``, ``"top_k"``, ``"top_p"`` or ``"min_p"`` arrays of the
    batch shape, that replace the head's for that call (vLLM's per-request
    parameters, compiled once): give the loss call the rollout's. ``mask`` (a
    keyword of the call) is booleans broadcastable to ``[*batch, V]``, True where a
    token is allowed: a forbidden token is never sampled and scores ``-inf``.

    A rollout draws one key from the stream (token ``n`` then draws with
    ``fold_in(key, n)``), or with ``per_env_streams`` each token its own key, and
    stores the token, or with truncation ``{"token", "support"}``; the replay scores
    the stored token on the stored support, so the first PPO ratio is exactly 1.
    ``eval()`` takes the greedy token. ``regularization_loss`` is ``-entropy_weight``
    times the exact entropy of the distribution the token was drawn from (on its
    stored support when truncated), so a replay and an ``eval()`` call draw no key.

    ``metrics``, without gradient: ``support_size``, the number of kept ids per
    token (``V`` without truncation), and with ``kept_mass_metric=True``
    ``kept_mass``, the probability that the untruncated distribution (temperature
    and mask applied) puts on the support (1 without truncation; 0 where the support
    holds no allowed token). ``kept_mass`` costs one more streamed pass over the
    whole vocabulary in every call, which a loss scored on the support alone does
    not otherwise make, so it is off unless asked for.

    Args:
        rngs: The ``nnx.Rngs`` to draw from (positional or ``rngs=``), or one
            ``nnx.RngStream`` of it.
        entropy_weight: Weight of the entropy bonus, finite (required).
        vocab_size: ``V``, positive: the unembedding's width.
        temperature, top_k, top_p, min_p, max_kept, block: As in
            :class:`samplers.TokenCategorical` (``temperature=0`` is refused: greedy
            decoding is ``eval()``).
        per_env_streams: If True, one random stream per token in the carry state
            (see :meth:`initialize_state`).
        log_ratio_metrics: If True, the rollout emits ``{"replay_data",
            "log_likelihood"}`` and a replay reports ``log_ratio`` and ``approx_kl``
            (see :class:`samplers.ActionSampler`).
        kept_mass_metric: If True, ``metrics`` has ``kept_mass`` (see above).
        rng_collection: The stream keys are drawn from, falling back to ``default``.

    Raises:
        ValueError: ``vocab_size`` is not a positive integer, or an option is out of
            its range (at construction); the weights or logits are not ``vocab_size``
            wide.
        TypeError: ``inputs`` is not such a tuple (or list), array or dict.

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
        block: tuple[int, int] | None = None,
        per_env_streams: bool = False,
        log_ratio_metrics: bool = False,
        kept_mass_metric: bool = False,
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
        self.max_kept = max_kept
        self.kept_mass_metric = bool(kept_mass_metric)
        self.block = None if block is None else cast(tuple[int, int], tuple(block))
        # The distribution checks its options: a bad one raises here, not at the first call.
        self._make({"logits": np.zeros((1, 1), np.float32)}, None)

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
        return self._make(_named_inputs(inputs, self.vocab_size), mask)

    def _make(self, named: dict, mask) -> TokenCategorical:
        options = {name: named.get(name, getattr(self, name)) for name in _OPTIONS}
        common: dict[str, Any] = dict(
            mask=mask, max_kept=self.max_kept, block=self.block, **options
        )
        if "logits" in named:
            return TokenCategorical.from_logits(named["logits"], **common)
        return TokenCategorical(
            named.get("hidden"),  # type: ignore[arg-type]  (checked by the distribution)
            named.get("unembedding"),
            named.get("bias"),
            embedding=named.get("embedding"),
            **common,
        )

    def _replay(self, dist: TokenCategorical, data) -> Scored:
        token, log_likelihood, entropy = dist.replay_and_entropy(data)
        return Scored(data, token, log_likelihood, entropy=entropy)

    def _metrics(self, inputs, dist: TokenCategorical, scored: Scored) -> dict:
        dtype = scored.log_likelihood.dtype
        if not dist.truncated:
            metrics = {"support_size": jnp.full(dist.batch_shape, self.vocab_size, dtype)}
            if self.kept_mass_metric:
                metrics["kept_mass"] = jnp.ones(dist.batch_shape, dtype)
            return metrics
        support = scored.data["support"]
        size = jnp.sum(support >= 0, axis=-1).astype(dtype)
        metrics = {"support_size": jnp.where(support[..., 0] == FULL, self.vocab_size, size)}
        if self.kept_mass_metric:
            metrics["kept_mass"] = dist.support_mass(support)
        return jax.lax.stop_gradient(metrics)


def _named_inputs(inputs: TokenInputs, vocab_size: int) -> dict:
    """A :class:`TokenSampler`'s ``inputs`` as a dict of arrays and options by name,
    checked against its ``vocab_size``."""
    if isinstance(inputs, dict):
        unknown = set(inputs) - set(_ARRAYS) - set(_OPTIONS)
        if unknown:
            raise TypeError(
                f"TokenSampler's inputs dict takes {_ARRAYS + _OPTIONS}, got "
                f"{sorted(unknown)}; pass the arrays and per-row options by these names."
            )
        named = dict(inputs)
    elif isinstance(inputs, (tuple, list)) and len(inputs) in (2, 3):
        named: dict[str, Any] = dict(zip(("hidden", "unembedding", "bias"), inputs, strict=False))
    elif not isinstance(inputs, (tuple, list)) and np.ndim(inputs) >= 1:
        named = {"logits": inputs}
    else:
        sequence = isinstance(inputs, (tuple, list))
        got = type(inputs).__name__ + (f" of length {len(inputs)}" if sequence else "")
        raise TypeError(
            f"TokenSampler takes inputs=(hidden [*batch, D], unembedding [D, V]) or "
            f"(hidden, unembedding, bias [V]), logits [*batch, V], or a dict of them by "
            f"name, got {got}; pass the language model's hidden states with its "
            f"unembedding (for tied embeddings, embedding= its table), or its logits."
        )
    if ("logits" in named) == ("hidden" in named):
        raise TypeError(
            f"TokenSampler's inputs hold the hidden states (with their weights) or the "
            f"logits, one of them, got {sorted(named)}; pass one."
        )
    layouts = {
        "unembedding": (1, "[D, V]"),
        "embedding": (0, "[V, D]"),
        "logits": (-1, "[*batch, V]"),
    }
    for name, (axis, layout) in layouts.items():
        if name not in named:
            continue
        shape = tuple(np.shape(named[name]))
        if len(shape) < 2 - (axis == -1) or shape[axis] != vocab_size:
            raise ValueError(
                f"TokenSampler was built with vocab_size={vocab_size}, so the {name} "
                f"must be {layout} with V = {vocab_size}, got {shape}; pass the "
                f"model's weights, or build the head with its vocab_size."
            )
    return named
