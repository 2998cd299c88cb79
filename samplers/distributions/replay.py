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
- ``check_replay_data(data)``: ``data`` as an array (or structure), refused with an
  error naming the fix when its shape or dtype cannot be this distribution's;

and ``sample_with_replay(seed=key)``, ``(action, data, log_prob)`` in one call. The
functions of this module answer them for any ``distrax`` distribution too: one that
is not :class:`Replayable` replays its action (``dist.sample``, ``dist.mode``,
``dist.log_prob``). A seed may be one key, or one typed key per batch element, each
element then drawing from its own key.
"""

import abc
from collections.abc import Sequence
from typing import Any, cast

import distrax
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray

from samplers import _checks
from samplers.distributions import _pre_images, _squashed
from samplers.distributions.bijectors import Squashing, squashing

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
    def check_replay_data(self, replay_data: ReplayData) -> ReplayData:
        """``replay_data`` as this distribution replays it; refuses the wrong shape or dtype."""

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
        return sample_per_key(cast(distrax.Distribution, self), seed)

    def deterministic_replay_data(self) -> Array:
        """``mode()``."""
        return cast(distrax.Distribution, self).mode()

    def replay(self, replay_data) -> tuple[Array, Array]:
        """The stored action and its ``log_prob``."""
        return _replay_action(cast(distrax.Distribution, self), replay_data)

    def check_replay_data(self, replay_data) -> Array:
        """A stored action of the action shape and of the kind sampled (integer or float)."""
        return _check_action(cast(distrax.Distribution, self), replay_data)


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
    if _pre_images.is_key_array(seed) and jnp.ndim(seed) > 0:
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


def check_replay_data(dist: distrax.Distribution, replay_data: ReplayData) -> ReplayData:
    """``dist.check_replay_data(replay_data)``, for any ``distrax`` distribution."""
    if isinstance(dist, Replayable):
        return dist.check_replay_data(replay_data)
    return _check_action(dist, replay_data)


def _replay_action(dist: distrax.Distribution, action) -> tuple[Array, Array]:
    return action, jnp.asarray(dist.log_prob(action))


def _check_action(dist: distrax.Distribution, action) -> Array:
    """Refuses a stored action that ``log_prob`` would take for another action."""
    action = jnp.asarray(action)
    _checks.stored_action_dtype(action, dist.dtype)
    expected = dist.batch_shape + dist.event_shape
    if action.shape != expected:
        raise ValueError(
            f"rollout_extras must have the action shape {expected}, got {action.shape}; "
            f"pass the rollout_extras of the rollout call."
        )
    return action


def sample_per_key(dist: distrax.Distribution, seed) -> Array:
    """``dist.sample(seed=seed)``, or with one key per batch element each row from its key.

    For the discrete distributions of this package, pytrees whose arrays lead with
    the batch axes, a row's sample is the distribution mapped over them
    (``jax.vmap``, one axis at a time).
    """
    if not _pre_images.is_key_array(seed) or jnp.ndim(seed) == 0:
        return dist.sample(seed=seed)
    batch_shape = tuple(dist.batch_shape)
    _pre_images.check_keys(seed, batch_shape)

    def draw(row, key):
        return row.sample(seed=key)

    for _ in batch_shape:
        draw = jax.vmap(draw)
    return draw(dist, seed)


class PreImageReplay(distrax.Transformed, Replayable):
    """A ``distrax.Transformed`` that ends in an elementwise squashing, replayed by its
    pre-image.

    What :class:`samplers.SquashedNormal`, :class:`samplers.SquashedBeta` and
    :class:`samplers.SquashedFlow` share: the replay data is the pre-image ``x`` of
    the action ``f(x)``, scored by
    ``log_prob_from_pre_image``, so that an action that rounded onto a bound
    replays exactly; a sample remembers its pre-image, as TFP's bijector cache
    does, so ``log_prob`` of the very array returned scores its pre-image. A
    subclass supplies :meth:`sample_pre_image`, :meth:`log_prob_from_pre_image`,
    ``deterministic_replay_data``, ``_parameters`` (its ``[*batch, action]``
    parameter arrays) and ``_log_prob_of_action`` (the score of any other action);
    one with layers before the squashing overrides ``_elementwise`` and
    ``_pre_image_of``.
    """

    _replay_hint = " (the stored pre-image)"

    @property
    @abc.abstractmethod
    def _parameters(self) -> tuple[Array, ...]:
        """The parameter arrays, each ``[*batch, action]``."""

    @abc.abstractmethod
    def sample_pre_image(self, *, seed: PRNGKeyArray | int) -> Array:
        """Draws pre-images ``[*batch, action]`` (one key, or one per batch element)."""

    @abc.abstractmethod
    def log_prob_from_pre_image(self, pre_image) -> Array:
        """The log-density of the action of ``pre_image``, from ``pre_image`` alone."""

    @abc.abstractmethod
    def _log_prob_of_action(self, value) -> Array:
        """The log-density of an action that no sample of this object returned."""

    @property
    def _elementwise(self) -> distrax.Bijector:
        """The elementwise bijector ``f`` inside the ``Block``."""
        # Taken from the (possibly rebuilt) Block each time rather than stored, so
        # that a distribution that crossed a jit boundary holds no stale reference.
        return cast(distrax.Block, self.bijector).bijector

    @property
    def _bounds(self) -> Squashing | None:
        return squashing(self._elementwise)

    def _pre_image_of(self, draw) -> Array:
        """The pre-image of a draw of ``self.distribution``: the draw itself, unless
        layers lie between the base distribution and the squashing."""
        return draw

    def _forward(self, pre_image) -> Array:
        """``f(pre_image)``; for the squashings, differentiated with ``f'(x) > 0`` also
        where ``f(x)`` rounds onto a bound (autodiff of float32 ``tanh`` gives 0)."""
        if self._bounds is None:
            return jnp.asarray(self._elementwise.forward(pre_image))
        return _squashed.squashing_forward(self._elementwise, pre_image)

    def _remember(self, pre_image) -> Array:
        """``f(pre_image)``, remembered with its pre-image for :meth:`log_prob`."""
        action = self._forward(pre_image)
        _pre_images.PRE_IMAGES.remember(action, pre_image, self._elementwise)
        return action

    def _broadcast(self, name: str, value) -> tuple[Array, ...]:
        """``value`` and the parameters broadcast together, in their common dtype.

        Raises ``TypeError`` for a value that is not floating and ``ValueError`` for
        one that does not broadcast with ``[*batch, action]``; ``name`` names it.
        """
        value = _checks.float_array(name, value)
        parameters = self._parameters
        try:
            shape = jnp.broadcast_shapes(value.shape, parameters[0].shape)
        except ValueError:
            raise ValueError(
                f"{name} must broadcast with the distribution's shape [*batch, action] = "
                f"{parameters[0].shape}, got {value.shape}; give it shape "
                f"[*sample, *batch, action]."
            ) from None
        dtype = jnp.result_type(value, *parameters)
        return tuple(jnp.broadcast_to(a, shape).astype(dtype) for a in (value, *parameters))

    def log_prob(
        self, value: Float[ArrayLike, "*value_batch action"]
    ) -> Float[Array, "*broadcast_batch"]:
        """The log-density of an action: a sample's from its pre-image, any other's
        from its distances to the bounds (see the subclass)."""
        pre_image = _pre_images.PRE_IMAGES.recall(value, self._elementwise)
        if pre_image is not None:
            return self.log_prob_from_pre_image(pre_image)
        return self._log_prob_of_action(value)

    def sample(
        self, *, seed: Seed, sample_shape: SampleShape = ()
    ) -> Float[Array, "*sample_and_batch action"]:
        """Samples actions, ``distrax.Transformed.sample``'s draws, remembering their
        pre-images: ``log_prob`` of the returned array scores its pre-image.

        Shape ``[*sample_shape, *batch, action]``; reparameterised, with the derivative
        ``f'(x)`` with respect to the pre-image also where ``f(x)`` rounds onto a bound.

        Example:
            >>> import jax, jax.numpy as jnp, samplers
            >>> dist = samplers.normal_tanh(jnp.zeros((5, 4)))
            >>> dist.sample(seed=jax.random.key(0), sample_shape=3).shape
            (3, 5, 2)
        """
        draw = self.distribution.sample(seed=seed, sample_shape=sample_shape)
        return self._remember(self._pre_image_of(draw))

    def sample_and_log_prob(
        self, *, seed: Seed, sample_shape: SampleShape = ()
    ) -> tuple[Float[Array, "*sample_and_batch action"], Float[Array, "*sample_and_batch"]]:
        """The draws of :meth:`sample` and their :meth:`log_prob_from_pre_image`, with no
        inverse: finite also where an action rounded onto a bound.

        Example:
            >>> import jax, jax.numpy as jnp, samplers
            >>> dist = samplers.normal_tanh(jnp.zeros((5, 4)))
            >>> action, log_prob = dist.sample_and_log_prob(seed=jax.random.key(0), sample_shape=3)
            >>> action.shape, log_prob.shape, bool(jnp.all(dist.log_prob(action) == log_prob))
            ((3, 5, 2), (3, 5), True)
        """
        # Not distrax's version: it broadcasts the base distribution's parameters
        # against the sample axis implicitly, which rank promotion "raise" refuses.
        draw = self.distribution.sample(seed=seed, sample_shape=sample_shape)
        pre_image = self._pre_image_of(draw)
        return self._remember(pre_image), self.log_prob_from_pre_image(pre_image)

    def forward_and_log_prob(
        self, pre_image: Float[ArrayLike, "*sample_and_batch action"]
    ) -> tuple[Float[Array, "*sample_and_batch action"], Float[Array, "*sample_and_batch"]]:
        """The action of ``pre_image`` and its :meth:`log_prob_from_pre_image`.

        The action's derivative with respect to ``pre_image`` is ``f'(x)``, positive
        also where ``f(x)`` rounds onto a bound (autodiff of ``tanh`` gives 0 there),
        so ``Q(s, f(x))`` keeps its pathwise gradient. ``pre_image`` broadcasts with
        ``[*batch, action]``.

        Example:
            >>> import jax, jax.numpy as jnp, samplers
            >>> dist = samplers.squashed_normal_from_std(jnp.array([10.0]), jnp.array([1.0]))
            >>> dist.forward_and_log_prob(jnp.array([20.0]))
            (Array([1.], dtype=float32), Array(-12.305, dtype=float32))
            >>> slope = jax.grad(lambda x: dist.forward_and_log_prob(x)[0].sum())(jnp.array([20.0]))
            >>> bool(slope[0] > 0)
            True
        """
        log_prob = self.log_prob_from_pre_image(pre_image)
        return self._forward(pre_image), log_prob

    def sample_with_pre_image(
        self, *, seed: PRNGKeyArray | int
    ) -> tuple[
        Float[Array, "*batch action"], Float[Array, "*batch action"], Float[Array, "*batch"]
    ]:
        """``(action, pre_image, log_prob)`` in one pass, with no inverse:
        :meth:`sample_with_replay` (a :class:`samplers.SquashedFlow`, whose replay
        inverts its layers, scores the draw forward instead). Store ``pre_image`` to
        replay the action later.

        ``seed`` is one key (or an integer), or one typed key per batch element.

        Example:
            >>> import jax, jax.numpy as jnp, samplers
            >>> dist = samplers.normal_tanh(jnp.zeros(4))
            >>> action, pre_image, log_prob = dist.sample_with_pre_image(seed=jax.random.key(0))
            >>> action.shape, bool(log_prob == dist.log_prob_from_pre_image(pre_image))
            ((2,), True)
        """
        return self.sample_with_replay(seed=seed)

    def sample_replay_data(self, *, seed) -> Array:
        """:meth:`sample_pre_image`: the pre-image is the replay data."""
        return self.sample_pre_image(seed=seed)

    def replay(
        self, replay_data: Float[ArrayLike, "*batch action"]
    ) -> tuple[Float[Array, "*batch action"], Float[Array, "*batch"]]:
        """The action of the pre-image (remembered, as a sample's) and its log-density."""
        log_prob = self.log_prob_from_pre_image(replay_data)
        return self._remember(replay_data), log_prob

    def check_replay_data(self, replay_data) -> Array:
        """A stored pre-image of the action shape, floating and at the parameters' precision."""
        loc = self._parameters[0]
        return _checks.replayed_pre_image(replay_data, loc.shape, loc.dtype, hint=self._replay_hint)


def integer_seed(seed):
    """A typed key for an integer seed or one raw ``jax.random.PRNGKey`` (distrax takes
    both; ``jax.random.key`` of the same seed draws the same numbers), else ``seed``
    as it is."""
    if isinstance(seed, (int, np.integer)):
        return jax.random.key(int(seed))
    raw = not _pre_images.is_key_array(seed) and jnp.shape(seed) == (2,)
    if raw and jnp.asarray(seed).dtype == jnp.uint32:
        return jax.random.wrap_key_data(seed)
    return seed
