"""The replay protocol: sample an action with the data that scores it again exactly.

A policy head stores something in the rollout and scores it in the loss pass. For a
squashed distribution that is the pre-image (the action itself may have rounded onto
a bound, where it no longer says which pre-image produced it); for a discrete one the
action; for a composite the structure of its parts' data. Every distribution of this
package answers the same four calls:

- ``sample_replay_data(seed=key)``: draw the replay data of a fresh action;
- ``deterministic_replay_data()``: the replay data of the deterministic action;
- ``replay(data)``: ``(action, log_prob)``, the action that ``data`` stands for and
  its log-probability, computed from ``data`` alone: a sample's log-probability *is*
  the replay of its data, so a stored copy replays it bit for bit;
- ``check_replay_data(data, name="replay data")``: ``data`` as an array (or
  structure), refused with an error naming it ``name`` (a head says
  ``rollout_extras``) and the fix when its shape or dtype cannot be this
  distribution's;

and ``sample_with_replay(seed=key)``, ``(action, data, log_prob)`` in one call, the
log-probability bit for bit that of the replay (a distribution with a cheaper forward
score of its own draws, as ``sample_and_log_prob`` gives it, names that one
differently: :meth:`samplers.SquashedFlow.sample_with_pre_image`). The
functions of this module answer them for any ``distrax`` distribution too: one that
is not :class:`Replayable` replays its action (``dist.sample``, ``dist.mode``,
``dist.log_prob``). A seed may be one key, or one typed key per batch element, each
element then drawing from its own key.
"""

import abc
from collections.abc import Sequence
from typing import Any, cast

import distrax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, PRNGKeyArray

from samplers import _checks
from samplers.distributions import _keys

ReplayData = Any  # an array, or a structure of arrays for a composite
# distrax's own argument types for sample(): an integer seed or a key.
Int = int | np.int16 | np.int32 | np.int64
Seed = Int | PRNGKeyArray
SampleShape = Int | Sequence[Int]


class Replayable(abc.ABC):
    """A distribution that samples its action together with the data to replay it.

    Mixed into a ``distrax.Distribution``; see the module for the protocol. A
    subclass writes the four methods below; :meth:`sample_with_replay` is written
    once, here.

    Example:
        >>> import jax, jax.numpy as jnp, samplers
        >>> dist = samplers.normal_tanh(jnp.array([30.0, 0.0]))  # saturated mean
        >>> action, data, log_prob = dist.sample_with_replay(seed=jax.random.key(0))
        >>> action, bool(dist.replay(data)[1] == log_prob)  # finite on the bound
        (Array([1.], dtype=float32), True)
    """

    @abc.abstractmethod
    def sample_replay_data(self, *, seed: PRNGKeyArray | int) -> ReplayData:
        """The replay data of a fresh sample (one key, or one key per batch element)."""

    @abc.abstractmethod
    def deterministic_replay_data(self) -> ReplayData:
        """The replay data of the action a deterministic policy takes."""

    @abc.abstractmethod
    def replay(self, replay_data: ReplayData) -> tuple[Any, Array]:
        """``(action, log_prob)`` of stored replay data, computed from it alone."""

    @abc.abstractmethod
    def check_replay_data(self, replay_data: ReplayData, name: str = "replay data") -> ReplayData:
        """``replay_data`` as this distribution replays it; refuses the wrong shape or
        dtype, naming it ``name``."""

    def sample_with_replay(self, *, seed: PRNGKeyArray | int) -> tuple[Any, ReplayData, Array]:
        """``(action, replay_data, log_prob)`` of one fresh sample.

        ``log_prob`` is ``replay(replay_data)[1]``, so replaying a stored copy of
        ``replay_data`` under the same parameters gives it bit for bit.
        """
        replay_data = self.sample_replay_data(seed=seed)
        action, log_prob = self.replay(replay_data)
        return action, replay_data, log_prob


class ActionReplay(Replayable):
    """A distribution replayed by its action: the discrete ones, whose actions are exact.

    The replay data is the action; ``deterministic_replay_data`` is ``mode()``. The
    functions below replay any other ``distrax`` distribution the same way.
    """

    def sample_replay_data(self, *, seed) -> Array:
        """A sample (one key, or one key per batch element)."""
        return _keys.sample_per_key(cast(distrax.Distribution, self), seed)

    def deterministic_replay_data(self) -> Array:
        """``mode()``."""
        return cast(distrax.Distribution, self).mode()

    def replay(self, replay_data) -> tuple[Array, Array]:
        """The stored action and its ``log_prob``."""
        return _replay_action(cast(distrax.Distribution, self), replay_data)

    def check_replay_data(self, replay_data, name: str = "replay data") -> Array:
        """A stored action of the action shape and of the kind sampled (integer or float)."""
        return _check_action(cast(distrax.Distribution, self), replay_data, name)


def sample_replay_data(dist: distrax.Distribution, seed) -> ReplayData:
    """``dist.sample_replay_data(seed=seed)``, for any ``distrax`` distribution.

    Example:
        >>> import distrax, jax, jax.numpy as jnp, samplers
        >>> dist = distrax.Categorical(logits=jnp.zeros((2, 3)))
        >>> samplers.distributions.replay.sample_replay_data(dist, jax.random.key(0)).shape
        (2,)
    """
    if isinstance(dist, Replayable):
        return dist.sample_replay_data(seed=seed)
    if _keys.per_element(seed):
        raise ValueError(
            f"one key per batch element needs a samplers.Replayable distribution, got "
            f"{type(dist).__name__}, whose arrays need not lead with the batch axes; sample "
            f"each row of it with its own key (jax.vmap over the parameters)."
        )
    return dist.sample(seed=seed)


def deterministic_replay_data(dist: distrax.Distribution) -> ReplayData:
    """``dist.deterministic_replay_data()``, for any ``distrax`` distribution."""
    if isinstance(dist, Replayable):
        return dist.deterministic_replay_data()
    return dist.mode()


def replay(dist: distrax.Distribution, replay_data: ReplayData) -> tuple[Any, Array]:
    """``dist.replay(replay_data)``, for any ``distrax`` distribution."""
    if isinstance(dist, Replayable):
        return dist.replay(replay_data)
    return _replay_action(dist, replay_data)


def check_replay_data(
    dist: distrax.Distribution, replay_data: ReplayData, name: str = "replay data"
) -> ReplayData:
    """``dist.check_replay_data(replay_data, name)``, for any ``distrax`` distribution."""
    if isinstance(dist, Replayable):
        return dist.check_replay_data(replay_data, name)
    return _check_action(dist, replay_data, name)


def _replay_action(dist: distrax.Distribution, action) -> tuple[Array, Array]:
    return action, jnp.asarray(dist.log_prob(action))


def _check_action(dist: distrax.Distribution, action, name: str) -> Array:
    """Refuses a stored action that ``log_prob`` would take for another action."""
    action = jnp.asarray(action)
    _checks.stored_action_dtype(name, action, dist.dtype)
    expected = dist.batch_shape + dist.event_shape
    if action.shape != expected:
        raise ValueError(
            f"{name} must have the action shape {expected}, got {action.shape}; "
            f"pass it as the sample of these parameters returned it."
        )
    return action
