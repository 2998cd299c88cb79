"""Discrete heads with action masks: one choice, several choices, bits.

Each head takes logits in, with an optional boolean ``mask`` as a keyword of the
call, and returns ``{"action", "log_likelihood"}``; the rollout emits the action
as ``rollout_extras`` and a replay scores that stored action under the current
logits and the replay's mask. The stream, ``eval()`` and per-environment streams
are those of :class:`samplers.ActionSampler`.
"""

import abc
from collections.abc import Sequence
from typing import Any, cast

import distrax
import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int, PRNGKeyArray

from samplers import _checks
from samplers.distributions.categorical import MaskedCategorical
from samplers.distributions.discrete import MultiBinary, MultiDiscrete
from samplers.heads.action_sampler import ActionSampler
from samplers.heads.module import StatefulModuleOutput

Mask = Any  # booleans, or for MultiDiscrete one array per sub-action, or None


class _MaskedSampler(ActionSampler):
    """What the discrete heads share: everything but the distribution."""

    def __init__(
        self,
        rngs: nnx.Rngs | nnx.RngStream | None,
        entropy_weight: float | None,
        *,
        per_env_streams: bool = False,
        rng_collection: str = "action",
        **deprecated,
    ):
        self._init_stream(rngs, rng_collection, per_env_streams, deprecated)
        self.entropy_weight = _checks.real_number("entropy_weight", entropy_weight)

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

    def distribution(
        self, logits: Float[Array, "*batch params"], mask: Mask = None
    ) -> distrax.Distribution:
        """The distribution this head draws from for the given logits and mask."""
        logits = _checks.float_array("logits", logits)
        if logits.ndim < 1 or logits.shape[-1] != self.num_params:
            raise ValueError(
                f"{type(self).__name__} expects logits of shape [*batch, {self.num_params}] "
                f"(head.num_params), got {logits.shape}; size the network's last layer "
                f"to head.num_params."
            )
        return self._make(logits, mask)

    def __call__(
        self,
        state: tuple[()] | PRNGKeyArray,
        logits: Float[Array, "*batch params"],
        rollout_extras: Int[Array, "*batch_and_action"] | None = None,
        *,
        mask: Mask = None,
        deterministic: bool | None = None,
    ) -> StatefulModuleOutput:
        """Samples an allowed action, or scores the stored one in ``rollout_extras``.

        Args:
            state: ``()``, or with ``per_env_streams`` one key per batch element.
            logits: The network output, ``[*batch, num_params]``.
            rollout_extras: ``None`` to sample; the ``rollout_extras`` of an
                earlier call (the action it took) to score it.
            mask: Booleans, True where allowed (see the class for the shape);
                ``None`` allows everything. Pass the same mask to the replay as to
                the rollout: then the same logits, in the same batch shape, give
                the rollout's log-likelihood bit for bit (XLA may round a row
                differently by an ulp in a batch of another shape).
                A stored action that the replay's mask forbids scores ``-inf``
                (the PPO ratio is 0, with zero gradient), never NaN.
            deterministic: Overrides ``self.deterministic`` for this call: the
                most probable allowed action instead of a sample.

        Returns:
            ``output``: ``{"action", "log_likelihood"}``; ``regularization_loss``:
            ``-entropy_weight * entropy``, over the allowed actions;
            ``metrics``: ``allowed_actions``, the number of allowed actions (for
            several sub-actions, of allowed combinations), and
            ``masked_probability``, the probability that the logits before
            masking put on forbidden actions (0 without a mask; NaN where a
            logit is NaN or ``+inf``, masked or not, as the probabilities before
            masking are then undefined), both without gradient;
            ``rollout_extras``: the action.

        Raises:
            ValueError: the logits' last axis is not ``num_params``, a mask's
                shape differs, or the stored action's shape is not the action's.
            TypeError: a mask is not boolean, or the stored action is not integer.
        """
        dist = self.distribution(logits, mask)
        deterministic = self._deterministic(deterministic)
        next_state, sample_key, _ = self._keys(state, dist.batch_shape, deterministic)
        if rollout_extras is None:
            if deterministic:
                action = dist.mode()
            else:
                action = self._sample(logits, mask, dist, sample_key)
        else:
            action = jnp.asarray(rollout_extras)
            _checks.stored_action_dtype(action, dist.dtype)
            expected = dist.batch_shape + dist.event_shape
            if action.shape != expected:
                raise ValueError(
                    f"rollout_extras must have the action shape {expected}, got "
                    f"{action.shape}; pass the rollout_extras of the rollout call."
                )
        action = jax.lax.stop_gradient(action)
        return StatefulModuleOutput(
            next_state=next_state,
            output={"action": action, "log_likelihood": dist.log_prob(action)},
            regularization_loss=-self.entropy_weight * dist.entropy(),
            metrics=jax.lax.stop_gradient(self._metrics(logits, dist)),
            rollout_extras=action,
        )

    def _sample(self, logits, mask, dist, keys):
        """A sample from one key, or with ``per_env_streams`` one per batch element."""
        if not self.per_env_streams:
            return dist.sample(seed=keys)
        batch_shape = keys.shape

        def rows(x):
            return x.reshape(-1, *x.shape[len(batch_shape) :])

        def sample_row(row_logits, row_mask, key):
            return self._make(row_logits, row_mask).sample(seed=key)

        samples = jax.vmap(sample_row)(rows(logits), jax.tree.map(rows, mask), keys.reshape(-1))
        return samples.reshape(*batch_shape, *samples.shape[1:])

    def _metrics(self, logits, dist) -> dict[str, Array]:
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
        rngs: nnx.Rngs | nnx.RngStream | None = None,
        entropy_weight: float | None = None,
        num_actions: int | None = None,
        **options,
    ):
        super().__init__(rngs, entropy_weight, **options)
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
        per_env_streams: As in :class:`CategoricalSampler`.
        rng_collection: As in :class:`CategoricalSampler`.

    Example:
        >>> import jax.numpy as jnp, samplers
        >>> from flax import nnx
        >>> head = samplers.MultiDiscreteSampler(nnx.Rngs(0), 0.01, nvec=(3, 2))
        >>> head.num_params, head((), jnp.zeros((4, 5))).output["action"].shape
        (5, (4, 2))
    """

    def __init__(
        self,
        rngs: nnx.Rngs | nnx.RngStream | None = None,
        entropy_weight: float | None = None,
        nvec: Sequence[int] | None = None,
        **options,
    ):
        super().__init__(rngs, entropy_weight, **options)
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
        per_env_streams: As in :class:`CategoricalSampler`.
        rng_collection: As in :class:`CategoricalSampler`.

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
        rngs: nnx.Rngs | nnx.RngStream | None = None,
        entropy_weight: float | None = None,
        num_bits: int | None = None,
        **options,
    ):
        super().__init__(rngs, entropy_weight, **options)
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
