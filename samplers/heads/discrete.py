"""Discrete heads with action masks: one choice, several choices, bits.

Each head is a masked distribution of the pure layer in the shell of
:class:`samplers.ActionSampler`: the network output is the logits, the mask a
keyword of the call, and the replay data the action itself.
"""

import abc
from collections.abc import Sequence
from typing import Any, cast

import distrax
import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from samplers import _checks
from samplers.distributions.categorical import MaskedCategorical
from samplers.distributions.discrete import MultiBinary, MultiDiscrete
from samplers.heads.action_sampler import ActionSampler

Mask = Any  # booleans, or for MultiDiscrete one array per sub-action, or None


class _MaskedSampler(ActionSampler):
    """What the discrete heads share: everything but the distribution.

    The call is :class:`samplers.ActionSampler`'s, with ``mask``: booleans, True
    where allowed (see each class for the shape); ``None`` allows everything. Pass
    the same mask to the replay as to the rollout: then the same logits, in the
    same batch shape, give the rollout's log-likelihood bit for bit (XLA may round
    a row differently by an ulp in a batch of another shape). A stored action that
    the replay's mask forbids scores ``-inf`` (the PPO ratio is 0, with zero
    gradient), never NaN. ``deterministic`` takes the most probable allowed action.

    ``regularization_loss`` is ``-entropy_weight * entropy`` over the allowed
    actions; ``metrics`` are ``allowed_actions``, the number of allowed actions
    (for several sub-actions, of allowed combinations), and
    ``masked_probability``, the probability that the logits before masking put on
    forbidden actions (0 without a mask; NaN where a logit is NaN or ``+inf``,
    masked or not, as the probabilities before masking are then undefined), both
    without gradient. The entropy is exact, so a replay and an ``eval()`` call draw
    no key.
    """

    takes_mask = True
    _stored_name = "action"

    def _distribution(self, inputs: Float[Array, "*batch params"], mask) -> distrax.Distribution:
        logits = _checks.logits_array("logits", inputs)
        self._check_width(logits, "logits")
        return self._make(logits, mask)

    def _metrics(self, inputs, dist, scored) -> dict:
        logits = _checks.logits_array("logits", inputs)  # in the dtype the head computes in
        return jax.lax.stop_gradient(self._masks_metrics(logits, dist))

    @property
    @abc.abstractmethod
    def num_params(self) -> int:
        """The size of the network output's last axis that this head expects."""

    @abc.abstractmethod
    def _make(self, logits: Array, mask: Mask) -> distrax.Distribution:
        """The distribution of ``logits`` with ``mask`` (checked by the class)."""

    @abc.abstractmethod
    def _choices(self, logits: Array, dist: Any) -> tuple[Any, Any]:
        """``(mask, unmasked log-probabilities)`` of each choice, ``[*batch, ..., choices]``."""

    def _masks_metrics(self, logits, dist) -> dict[str, Array]:
        """``allowed_actions`` and ``masked_probability`` per batch element.

        Each sub-action's forbidden mass is summed from the forbidden choices
        themselves, so that it is exactly 0 without a forbidden choice and a tiny
        mass is not rounded away; for several sub-actions the probability that
        any is forbidden is ``1 - prod(1 - m_i)``, as ``-expm1(sum(log1p(-m_i)))``.
        """
        mask, log_probs = self._choices(logits, dist)
        allowed = jnp.sum(mask, axis=-1).astype(log_probs.dtype)
        forbidden = jnp.exp(jax.nn.logsumexp(jnp.where(mask, -jnp.inf, log_probs), axis=-1))
        if isinstance(dist, distrax.Independent):
            allowed = jnp.prod(allowed, axis=-1)
            forbidden = -jnp.expm1(jnp.sum(jnp.log1p(-forbidden), axis=-1))
        return {"allowed_actions": allowed, "masked_probability": forbidden}


class CategoricalSampler(_MaskedSampler):
    """One choice among ``num_actions``: a :class:`samplers.MaskedCategorical` head.

    The network output is the logits, ``[*batch, num_actions]``; ``mask`` (a
    keyword of the call) is booleans of the same shape, True where the action is
    allowed. A masked action is never sampled, scores ``-inf``, and its logit
    gets exactly zero gradient; the entropy is over the allowed actions. A row
    that allows nothing has NaN log-likelihood and entropy and acts 0.

    Args:
        rngs: The ``nnx.Rngs`` to draw from (positional or ``rngs=``), or one
            ``nnx.RngStream`` of it.
        entropy_weight: Weight of the entropy bonus, finite (required).
        num_actions: The number of actions, positive.
        per_env_streams: If True, one random stream per environment in the carry
            state (see :meth:`initialize_state`).
        log_ratio_metrics: If True, the rollout emits ``{"action",
            "log_likelihood"}`` and a replay reports ``log_ratio`` and ``approx_kl``
            (see :class:`samplers.ActionSampler`).
        rng_collection: The stream keys are drawn from, falling back to ``default``.

    Example:
        >>> import jax.numpy as jnp, samplers
        >>> from flax import nnx
        >>> head = samplers.CategoricalSampler(nnx.Rngs(0), 0.01, num_actions=3)
        >>> mask = jnp.array([[True, False, True]] * 4)
        >>> out = head((), jnp.zeros((4, 3)), mask=mask)
        >>> bool(jnp.all(out.output["action"] != 1)), out.metrics["allowed_actions"]
        (True, Array([2., 2., 2., 2.], dtype=float32))
        >>> again = head((), jnp.zeros((4, 3)), out.rollout_extras, mask=mask)
        >>> bool(jnp.array_equal(again.output["log_likelihood"], out.output["log_likelihood"]))
        True
    """

    def __init__(
        self,
        rngs: nnx.Rngs | nnx.RngStream,
        entropy_weight: float,
        num_actions: int,
        *,
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
        self.num_actions = _checks.positive_int("num_actions", num_actions)

    @property
    def num_params(self) -> int:
        """``num_actions``: one logit per action."""
        return self.num_actions

    def _make(self, logits, mask) -> MaskedCategorical:
        return MaskedCategorical(logits, mask)

    def _choices(self, logits, dist):
        return dist.mask, jax.nn.log_softmax(logits)


class MultiDiscreteSampler(_MaskedSampler):
    """Sub-actions of uneven sizes ``nvec``: a :class:`samplers.MultiDiscrete` head.

    The network output is ``[*batch, sum(nvec)]``, the sub-actions' logits one
    after the other; the action is ``[*batch, len(nvec)]``. ``mask`` is flat
    (logits' shape) or one boolean array ``[*batch, nvec[i]]`` per sub-action.
    The log-likelihood and entropy are sums over the sub-actions.

    Args:
        rngs: The ``nnx.Rngs`` to draw from, or one ``nnx.RngStream`` of it.
        entropy_weight: Weight of the entropy bonus, finite (required).
        nvec: The number of choices of each sub-action.
        per_env_streams, log_ratio_metrics, rng_collection: As in
            :class:`CategoricalSampler`.

    Example:
        >>> import jax.numpy as jnp, samplers
        >>> from flax import nnx
        >>> head = samplers.MultiDiscreteSampler(nnx.Rngs(0), 0.01, nvec=(3, 2))
        >>> head.num_params, head((), jnp.zeros((4, 5))).output["action"].shape
        (5, (4, 2))
    """

    def __init__(
        self,
        rngs: nnx.Rngs | nnx.RngStream,
        entropy_weight: float,
        nvec: Sequence[int],
        *,
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
        self.nvec = _checks.nvec(nvec)

    @property
    def num_params(self) -> int:
        """``sum(nvec)``: one logit per choice of each sub-action."""
        return sum(self.nvec)

    def _make(self, logits, mask) -> MultiDiscrete:
        return MultiDiscrete(logits, self.nvec, mask)

    def _choices(self, logits, dist):
        # The padded [*batch, len(nvec), max(nvec)] choices: padding is never allowed.
        unmasked = cast(MaskedCategorical, self._make(logits, None).distribution)
        return cast(MaskedCategorical, dist.distribution).mask, unmasked.logits


class MultiBinarySampler(_MaskedSampler):
    """``num_bits`` independent bits: a :class:`samplers.MultiBinary` head.

    The network output is the log-odds of each bit being 1, ``[*batch,
    num_bits]``; the action is ``[*batch, num_bits]`` integers 0 or 1. ``mask``
    is ``[*batch, num_bits, 2]``: ``mask[..., i, v]`` allows bit ``i`` to be
    ``v``, so allowing one value forces the bit.

    Args:
        rngs: The ``nnx.Rngs`` to draw from, or one ``nnx.RngStream`` of it.
        entropy_weight: Weight of the entropy bonus, finite (required).
        num_bits: The number of bits, positive.
        per_env_streams, log_ratio_metrics, rng_collection: As in
            :class:`CategoricalSampler`.

    Example:
        >>> import jax.numpy as jnp, samplers
        >>> from flax import nnx
        >>> head = samplers.MultiBinarySampler(nnx.Rngs(0), 0.01, num_bits=2)
        >>> force_first_to_one = jnp.array([[False, True], [True, True]])
        >>> out = head((), jnp.full((3, 2), -5.0), mask=jnp.stack([force_first_to_one] * 3))
        >>> out.output["action"][:, 0]
        Array([1, 1, 1], dtype=int32)
    """

    def __init__(
        self,
        rngs: nnx.Rngs | nnx.RngStream,
        entropy_weight: float,
        num_bits: int,
        *,
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
        self.num_bits = _checks.positive_int("num_bits", num_bits)

    @property
    def num_params(self) -> int:
        """``num_bits``: one log-odds per bit."""
        return self.num_bits

    def _make(self, logits, mask) -> MultiBinary:
        return MultiBinary(logits, mask)

    def _choices(self, logits, dist):
        log_probs = jnp.stack([jax.nn.log_sigmoid(-logits), jax.nn.log_sigmoid(logits)], -1)
        mask = jnp.ones(log_probs.shape, bool) if dist.mask is None else dist.mask
        return mask, log_probs
