"""The one head shell: sample or replay, ``deterministic``, the entropy cost, the metrics.

Every head is a distribution of the pure layer (:mod:`samplers.distributions`) that
samples its action with its replay data and scores stored replay data
(:mod:`samplers.distributions.replay`), inside this shell. :meth:`ActionSampler.__call__`
is written once; a head writes how the network output becomes its distribution
(``_distribution``) and its ``num_params``, and where it differs, how it scores
(``_replay``, returning a :class:`Scored`), its entropy cost and its metrics, which
read what the scoring computed. Which calls draw keys: :mod:`samplers.heads.streams`.
"""

import abc
import dataclasses
from typing import Any

import distrax
import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from samplers import _checks
from samplers._deprecated import renamed_inputs, renamed_rng
from samplers._numerics import k3
from samplers.distributions import replay
from samplers.heads.module import StatefulModule, StatefulModuleOutput
from samplers.heads.streams import RandomStreams, stream


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Scored:
    """A head's scoring of replay data, and what it computed on the way.

    Attributes:
        data: The replay data scored (what a rollout stores).
        action: The action it stands for.
        log_likelihood: Its log-likelihood, ``[*batch]``.
        log_likelihoods: The parts' or sub-actions' log-likelihoods, for a head of
            several (added to the output), else None.
        entropy: What the scoring computed of the entropy cost: the entropy, or its
            terms (each sub-action's), or None where the cost has its own computation.
        extras: Anything else the head's metrics or entropy cost read (a composite's
            parts' :class:`Scored`), or None.
        old_log_likelihood: In a replay of data stored with the log-likelihood
            (``log_ratio_metrics=True``), the rollout's; else None.
    """

    data: Any
    action: Any
    log_likelihood: Array
    log_likelihoods: Any = None
    entropy: Any = None
    extras: Any = None
    old_log_likelihood: Any = None

    @property
    def output(self) -> dict:
        """``{"action", "log_likelihood"}``, and ``"log_likelihoods"`` where there are parts."""
        output = {"action": self.action, "log_likelihood": self.log_likelihood}
        if self.log_likelihoods is not None:
            output["log_likelihoods"] = self.log_likelihoods
        return output


class ActionSampler(RandomStreams, StatefulModule):
    """A policy head: the network output in, an action out, sampled or replayed.

    Called as ``head(state, inputs, rollout_extras=None, *, mask=None,
    deterministic=None)``, every head the same way:

    - ``rollout_extras=None`` (rollout, inference): sample a fresh action, or take
      the deterministic one, and emit its replay data as ``rollout_extras``;
    - ``rollout_extras`` of an earlier call (the loss pass): score that stored data
      under the current ``inputs``, reproducing the rollout's log-likelihood bit for
      bit for the same inputs and batch shape (a :class:`samplers.FlowSampler`'s to
      float rounding: see it).

    The output is ``{"action", "log_likelihood"}`` (a composite adds
    ``"log_likelihoods"``); ``regularization_loss`` is ``-entropy_weight *
    entropy``; ``metrics`` are the head's own and, with ``log_ratio_metrics=True``,
    in a replay ``log_ratio`` (current minus rollout log-likelihood) and
    ``approx_kl``, the per-element k3 estimate ``expm1(log_ratio) - log_ratio`` of
    ``KL(rollout || current)``: the rollout then emits ``{<replay data's name>,
    "log_likelihood"}`` as ``rollout_extras``. ``head.distribution(inputs,
    mask=None)`` is the distribution it draws from, and ``head.num_params`` the
    width of ``inputs`` it expects. The keys: :class:`samplers.heads.streams.RandomStreams`.

    Attributes:
        deterministic: If True (``module.eval()``), act with the distribution's
            deterministic action instead of sampling; a call's ``deterministic=``
            overrides it for that call.
        per_env_streams: If True, the carry state holds one key per environment
            (see :meth:`initialize_state`); otherwise it is ``()``.
        reparameterized: If True, a fresh sample keeps its pathwise gradient;
            otherwise it is a constant (PPO's replay).
    """

    deterministic: bool = False
    reparameterized: bool = False
    log_ratio_metrics: bool = False
    entropy_weight: float = 0.0
    # Whether the head's call takes a mask.
    takes_mask: bool = False
    # The replay data's key in rollout_extras with log_ratio_metrics=True.
    _stored_name: str = "replay_data"

    def __init__(
        self,
        rngs: nnx.Rngs | nnx.RngStream | None,
        entropy_weight: float | None,
        *,
        reparameterized: bool = False,
        per_env_streams: bool = False,
        log_ratio_metrics: bool = False,
        rng_collection: str = "action",
        rng: nnx.Rngs | nnx.RngStream | None = None,
    ):
        """Sets the stream and the options every head takes, checked (``rng``: the
        deprecated name of ``rngs``)."""
        self.rng = stream(renamed_rng(rngs, rng), rng_collection)
        self.rng_collection = rng_collection
        self.entropy_weight = _checks.real_number("entropy_weight", entropy_weight)
        self.reparameterized = bool(reparameterized)
        self.per_env_streams = bool(per_env_streams)
        self.log_ratio_metrics = bool(log_ratio_metrics)
        self.deterministic = False

    @property
    @abc.abstractmethod
    def num_params(self) -> int:
        """The width of the network output's last axis that this head expects."""

    def _check_width(self, inputs, what: str, detail: str = "head.num_params") -> None:
        """Refuses ``inputs`` whose last axis is not :attr:`num_params`."""
        if jnp.ndim(inputs) < 1 or jnp.shape(inputs)[-1] != self.num_params:
            raise ValueError(
                f"{type(self).__name__} expects {what} of shape [*batch, {self.num_params}] "
                f"({detail}), got {jnp.shape(inputs)}; size the network's last layer to "
                f"head.num_params."
            )

    @abc.abstractmethod
    def _distribution(self, inputs: Array, mask: Any) -> distrax.Distribution:
        """The distribution of ``inputs`` (and ``mask``, for a head that takes one)."""

    @renamed_inputs
    def distribution(self, inputs: Float[Array, "*batch params"], mask: Any = None):
        """The distribution this head draws from for the network output ``inputs``.

        Raises:
            TypeError: a mask is given to a head that takes none.

        Example:
            >>> import jax.numpy as jnp, samplers
            >>> from flax import nnx
            >>> head = samplers.CategoricalSampler(nnx.Rngs(0), 0.01, 3)
            >>> legal = jnp.array([[True, False, True]] * 2)
            >>> dist = head.distribution(jnp.zeros((2, 3)), mask=legal)
            >>> dist.probs[0]
            Array([0.5, 0. , 0.5], dtype=float32)
        """
        if mask is not None and not self.takes_mask:
            raise TypeError(
                f"{type(self).__name__} takes no mask, got one of type {type(mask).__name__}; "
                f"its actions are not chosen among a set, so drop mask=."
            )
        return self._distribution(inputs, mask)

    @renamed_inputs
    def __call__(
        self,
        state: Any,
        inputs: Float[Array, "*batch params"],
        rollout_extras: Any = None,
        *,
        mask: Any = None,
        deterministic: bool | None = None,
    ) -> StatefulModuleOutput:
        """Samples a fresh action, or replays the data in ``rollout_extras``.

        Args:
            state: ``()``, or with ``per_env_streams`` one key per batch element
                (from :meth:`initialize_state` or the last call's ``next_state``).
            inputs: The network output, ``[*batch, num_params]``.
            rollout_extras: ``None`` to sample; the ``rollout_extras`` of an
                earlier call to replay it.
            mask: For the heads that take one (the discrete heads and the
                composites), the allowed actions; pass the rollout's mask to its
                replay.
            deterministic: Overrides ``self.deterministic`` for this call
                (``None``: the module's flag, as flax's ``Dropout``).

        Raises:
            ValueError: the stored data's shape is not the action's, or the
                per-environment keys do not match the batch shape.
            TypeError: the stored data's dtype cannot be the sampled one, a mask
                is given to a head that takes none, or ``state`` is not a key
                array with ``per_env_streams``.
        """
        dist = self.distribution(inputs, mask)
        modes = self._modes(deterministic)
        every_deterministic = all(jax.tree.leaves(modes))
        noisy = (rollout_extras is None and not every_deterministic) or self._entropy_needs_key()
        next_state, sample_key, entropy_key = self._keys(
            state, dist.batch_shape, noisy, every_deterministic
        )
        if rollout_extras is None:
            scored = self._sample(inputs, dist, modes, sample_key)
        else:
            data, old_log_likelihood = self._unpack(dist, rollout_extras)
            scored = self._replay(dist, jax.lax.stop_gradient(data))
            scored = dataclasses.replace(scored, old_log_likelihood=old_log_likelihood)
        return StatefulModuleOutput(
            next_state=next_state,
            output=scored.output,
            regularization_loss=self._regularization(dist, entropy_key, scored),
            metrics=self._all_metrics(inputs, dist, scored),
            rollout_extras=self._pack(scored),
        )

    # What a head may change; the defaults are those of a head with one distribution.

    def _modes(self, deterministic: bool | None) -> Any:
        """The call's ``deterministic=``, or the module's flag when it is ``None`` (a
        composite: its parts')."""
        return self.deterministic if deterministic is None else bool(deterministic)

    def _entropy_needs_key(self) -> bool:
        """Whether the entropy cost is estimated from a sample (and needs a key)."""
        return False

    def _sample(self, inputs, dist, modes: Any, key) -> Scored:
        """A fresh sample or the deterministic action, scored as a replay of its data is."""
        if modes:
            data = replay.deterministic_replay_data(dist)
        else:
            data = replay.sample_replay_data(dist, key)
        return self._replay(dist, data if self.reparameterized else jax.lax.stop_gradient(data))

    def _replay(self, dist, data) -> Scored:
        """Scores replay data (see :mod:`samplers.distributions.replay`)."""
        action, log_likelihood = replay.replay(dist, data)
        return Scored(data, action, log_likelihood)

    def _regularization(self, dist, key, scored: Scored) -> Array:
        """``-entropy_weight * entropy``: the scoring's, else ``dist.entropy()``."""
        entropy = dist.entropy() if scored.entropy is None else scored.entropy
        return -self.entropy_weight * jnp.asarray(entropy)

    def _metrics(self, inputs, dist, scored: Scored) -> dict:
        """The head's own metrics for logging."""
        return {}

    def _all_metrics(self, inputs, dist, scored: Scored) -> dict:
        """The head's metrics, with the log-ratio ones where a replay has the rollout's."""
        metrics = self._metrics(inputs, dist, scored)
        if self.log_ratio_metrics and scored.old_log_likelihood is not None:
            metrics |= _log_ratio_metrics(scored.log_likelihood, scored.old_log_likelihood)
        return metrics

    def _pack(self, scored: Scored) -> Any:
        """The ``rollout_extras`` that a later call replays."""
        return _pack(scored, self._stored_name, self.log_ratio_metrics)

    def _unpack(self, dist, rollout_extras) -> tuple[Any, Any]:
        """The stored replay data, checked, and the rollout's log-likelihood if stored."""
        return _unpack(dist, rollout_extras, self._stored_name, self.log_ratio_metrics)


# The rollout's log-likelihood stored beside the replay data (log_ratio_metrics=True).


def _log_ratio_metrics(log_likelihood: Array, old: Array) -> dict:
    """``log_ratio`` (current minus rollout) and its k3 ``approx_kl``."""
    _checks.stored_precision("rollout_extras['log_likelihood']", old, log_likelihood.dtype)
    log_ratio = log_likelihood - old
    return {"log_ratio": log_ratio, "approx_kl": k3(log_ratio)}


def _pack(scored: Scored, name: str, with_log_likelihood: bool) -> Any:
    """The replay data, or ``{name: data, "log_likelihood": ...}``."""
    data = jax.lax.stop_gradient(scored.data)
    if not with_log_likelihood:
        return data
    return {name: data, "log_likelihood": jax.lax.stop_gradient(scored.log_likelihood)}


def _unpack(dist, rollout_extras, name: str, with_log_likelihood: bool) -> tuple[Any, Any]:
    """What :func:`_pack` stored: ``(replay data checked, log-likelihood or None)``."""
    fields = {name, "log_likelihood"}
    if not with_log_likelihood:
        if isinstance(rollout_extras, dict) and set(rollout_extras) == fields:
            raise TypeError(
                f"rollout_extras is a dict with keys {sorted(rollout_extras)}, but this "
                f"sampler replays the stored {name} alone; pass "
                f"log_ratio_metrics=True to the sampler that emitted it."
            )
        return replay.check_replay_data(dist, rollout_extras, "rollout_extras"), None
    if not isinstance(rollout_extras, dict) or set(rollout_extras) != fields:
        raise TypeError(
            f"with log_ratio_metrics=True, rollout_extras must be the dict "
            f"{{{name!r}, 'log_likelihood'}} that the rollout call emitted, "
            f"got {type(rollout_extras).__name__}."
        )
    data = replay.check_replay_data(dist, rollout_extras[name], "rollout_extras")
    old = _checks.float_array("rollout_extras['log_likelihood']", rollout_extras["log_likelihood"])
    if old.shape != dist.batch_shape:
        raise ValueError(
            f"rollout_extras['log_likelihood'] must have the batch shape "
            f"{dist.batch_shape}, got {old.shape}."
        )
    return data, old
