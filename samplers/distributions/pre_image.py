"""Pre-image replay: a squashed distribution stored and scored by its pre-image.

:class:`PreImageReplay` is what :class:`samplers.SquashedNormal`,
:class:`samplers.SquashedBeta` and :class:`samplers.SquashedFlow` share. A sample
remembers its pre-image, as TFP's bijector cache does, outside the distrax pytree,
keyed by the identity of the returned array (:class:`PreImageCache`), so that
``dist.log_prob(dist.sample(seed=key))`` scores the pre-image and not the inverse of
an action that may have rounded onto a bound.
"""

import abc
import weakref
from typing import cast

import distrax
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray

from samplers import _checks
from samplers.distributions import _squashed
from samplers.distributions.bijectors import Squashing, same_map, squashing
from samplers.distributions.replay import Replayable, SampleShape, Seed


class PreImageCache:
    """Which pre-image produced an action array, as TFP's bijector cache keeps it.

    Keyed by the array's identity (a ``jax.Array``, or a tracer of the current
    trace), which is what ``dist.log_prob(dist.sample(seed=key))`` passes back;
    an entry is dropped when its array is garbage-collected.
    """

    def __init__(self):
        """An empty cache: ``id(action) -> (weak reference, pre-image, bijector)``."""
        self._entries: dict[int, tuple[weakref.ref, Array, distrax.Bijector]] = {}

    def remember(self, action, pre_image, bijector: distrax.Bijector) -> None:
        """Records that ``bijector`` mapped ``pre_image`` to ``action`` (same shape)."""
        key = id(action)

        def forget(ref):
            if self._entries.get(key, (None,))[0] is ref:
                del self._entries[key]

        self._entries[key] = (weakref.ref(action, forget), pre_image, bijector)

    def recall(self, action, bijector: distrax.Bijector) -> Array | None:
        """The pre-image of ``action`` if it was remembered for the same map, else ``None``.

        ``None`` also for an equal copy of a remembered array, or for the same array
        under a bijector that is not :func:`same_map` as the one that produced it.
        """
        entry = self._entries.get(id(action))
        if entry is None or entry[0]() is not action or same_map(entry[2], bijector) is not True:
            return None
        return entry[1]


PRE_IMAGES = PreImageCache()


class PreImageReplay(distrax.Transformed, Replayable):
    """A ``distrax.Transformed`` that ends in an elementwise squashing, replayed by its
    pre-image.

    What :class:`samplers.SquashedNormal`, :class:`samplers.SquashedBeta` and
    :class:`samplers.SquashedFlow` share: the replay data is the pre-image ``x`` of
    the action ``f(x)``, scored by ``log_prob_from_pre_image``, so that an action that
    rounded onto a bound replays exactly; a sample remembers its pre-image, so
    ``log_prob`` of the very array returned scores its pre-image. Two ways to sample
    and score: :meth:`sample_with_replay`, bit for bit the replay of its data (PPO),
    and :meth:`sample_with_pre_image`, the draw scored forward (SAC). A
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
    def bounds(self) -> Squashing | None:
        """The bounds the elementwise squashing declares, or None for an unbounded map."""
        return squashing(self._elementwise)

    def _pre_image_of(self, draw) -> Array:
        """The pre-image of a draw of ``self.distribution``: the draw itself, unless
        layers lie between the base distribution and the squashing."""
        return draw

    def _forward(self, pre_image) -> Array:
        """``f(pre_image)``; for the squashings, differentiated with ``f'(x) > 0`` also
        where ``f(x)`` rounds onto a bound (autodiff of float32 ``tanh`` gives 0)."""
        if self.bounds is None:
            return jnp.asarray(self._elementwise.forward(pre_image))
        return _squashed.squashing_forward(self._elementwise, pre_image)

    def _remember(self, pre_image) -> Array:
        """``f(pre_image)``, remembered with its pre-image for :meth:`log_prob`."""
        action = self._forward(pre_image)
        PRE_IMAGES.remember(action, pre_image, self._elementwise)
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
        pre_image = PRE_IMAGES.recall(value, self._elementwise)
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
        """``(action, pre_image, log_prob)`` of one draw scored forward, as
        :meth:`sample_and_log_prob` scores it, with no inverse: what an actor that
        differentiates a fresh sample (SAC) takes. Store ``pre_image`` to replay the
        action later. Where the replay is also forward (no layers before the squashing)
        this is :meth:`sample_with_replay` bit for bit; a
        :class:`samplers.SquashedFlow`'s replay inverts its layers, and agrees with
        this forward score to float rounding.

        ``seed`` is one key (or an integer), or one typed key per batch element.

        Example:
            >>> import jax, jax.numpy as jnp, samplers
            >>> dist = samplers.normal_tanh(jnp.zeros(4))
            >>> action, pre_image, log_prob = dist.sample_with_pre_image(seed=jax.random.key(0))
            >>> action.shape, bool(log_prob == dist.log_prob_from_pre_image(pre_image))
            ((2,), True)
        """
        return self.sample_with_replay(seed=seed)

    def sample_with_replay(
        self, *, seed: PRNGKeyArray | int, reparameterized: bool = True
    ) -> tuple[
        Float[Array, "*batch action"], Float[Array, "*batch action"], Float[Array, "*batch"]
    ]:
        """``(action, pre_image, log_prob)`` of one draw, ``log_prob`` the replay of the
        pre-image bit for bit.

        With ``reparameterized=False`` the pre-image is a constant, as a stored one is:
        ``log_prob``'s gradient is then its replay's, not the draw's pathwise one.

        Example:
            >>> import jax, jax.numpy as jnp, samplers
            >>> def dist(loc):
            ...     return samplers.squashed_normal_from_std(loc, jnp.ones(2))
            >>> def rollout(loc):
            ...     return dist(loc).sample_with_replay(seed=0, reparameterized=False)
            >>> stored = rollout(jnp.zeros(2))[1]
            >>> new = jax.grad(lambda loc: rollout(loc)[2].sum())(jnp.zeros(2))
            >>> old = jax.grad(lambda loc: dist(loc).replay(stored)[1].sum())(jnp.zeros(2))
            >>> bool(jnp.all(new == old))  # the replay's gradient, for the same pre-image
            True
        """
        pre_image = self.sample_pre_image(seed=seed)
        if not reparameterized:
            pre_image = jax.lax.stop_gradient(pre_image)
        action, log_prob = self.replay(pre_image)
        return action, pre_image, log_prob

    def sample_replay_data(self, *, seed) -> Array:
        """:meth:`sample_pre_image`: the pre-image is the replay data."""
        return self.sample_pre_image(seed=seed)

    def replay(
        self, replay_data: Float[ArrayLike, "*batch action"]
    ) -> tuple[Float[Array, "*batch action"], Float[Array, "*batch"]]:
        """The action of the pre-image (remembered, as a sample's) and its log-density."""
        log_prob = self.log_prob_from_pre_image(replay_data)
        return self._remember(replay_data), log_prob

    def check_replay_data(self, replay_data, name: str = "replay data") -> Array:
        """A stored pre-image of the action shape, floating and at the parameters' precision."""
        loc = self._parameters[0]
        return _checks.replayed_pre_image(
            name, replay_data, loc.shape, loc.dtype, hint=self._replay_hint
        )

    def recall_pre_image(self, action) -> Array | None:
        """The pre-image that a sample (or ``mode()``) of this squashing remembers for the
        very array ``action``, or None."""
        return PRE_IMAGES.recall(action, self._elementwise)
