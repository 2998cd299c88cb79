"""The one head shell: the stream, ``deterministic``, sample or replay, the entropy cost.

Every head is a distribution of the pure layer (:mod:`samplers.distributions`) that
samples its action with its replay data and scores stored replay data
(:mod:`samplers.distributions.replay`), inside this shell. :meth:`ActionSampler.__call__`
is written once; a head writes how the network output becomes its distribution
(``_distribution``), and where it differs, its entropy cost and its metrics.

Keys. A head draws its keys from the ``nnx.Rngs`` (or ``nnx.RngStream``) it holds,
or, with ``per_env_streams=True``, from one key per environment in its carry state.
A call that needs no noise draws no key and leaves the stream (or the state's keys)
as it was: a replay, or an ``eval()`` call, whose entropy cost is exact or absent,
is a pure function of its inputs, as flax's ``Dropout`` with ``deterministic=True``
is. A call that needs noise (a fresh sample, or an entropy cost estimated from a
sample) draws two keys, the sample's and then the entropy's, as the specified
sampler does: the sample's is not drawn when deterministic, and is drawn but unused
in a replay.
"""

import abc
import functools
import inspect
import warnings
from typing import Any

import distrax
import jax
import jax.numpy as jnp
from flax import errors, nnx
from jaxtyping import Array, Float, PRNGKeyArray

from samplers import _checks
from samplers.distributions import replay
from samplers.distributions.bijectors import Squashing
from samplers.heads.module import StatefulModule, StatefulModuleOutput

# The network output's keyword names before it was ``inputs`` everywhere.
_OLD_INPUT_NAMES = ("mean_and_std", "params", "logits", "mean")


def renamed_inputs(method):
    """Takes the network output under its old keyword names, with a deprecation warning."""

    # How many positional arguments come before ``inputs`` (``self`` not counted).
    position = list(inspect.signature(method).parameters).index("inputs") - 1

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        for old in _OLD_INPUT_NAMES:
            if old in kwargs:
                warnings.warn(
                    f"{type(self).__name__}.{method.__name__}({old}=...) is deprecated; pass "
                    f"the network output positionally or as inputs=.",
                    DeprecationWarning,
                    stacklevel=2,
                )
                if "inputs" in kwargs or len(args) > position:
                    raise TypeError(f"pass the network output once, not also as {old}=.")
                kwargs["inputs"] = kwargs.pop(old)
        return method(self, *args, **kwargs)

    return call


class ActionSampler(StatefulModule, abc.ABC):
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
    entropy``; ``metrics`` are the head's own. ``head.distribution(inputs,
    mask=None)`` is the distribution it draws from, and ``head.num_params`` the
    width of ``inputs`` it expects.

    A head holds the stream it draws from as ``rng``: an ``nnx.Rngs``, whose
    stream named ``rng_collection`` (``"action"`` by default) it uses, falling back
    to ``default`` as flax's own layers do (with ``nnx.Rngs(0)`` the keys come from
    ``default``; with ``nnx.Rngs(params=0, action=1)`` from ``action``), or one
    ``nnx.RngStream`` (``rngs.action``) used as it is. See the module for which
    calls draw keys.

    Attributes:
        deterministic: If True (``module.eval()``), act with the distribution's
            deterministic action instead of sampling; a call's ``deterministic=``
            overrides it for that call.
        per_env_streams: If True, the carry state holds one key per environment
            (see :meth:`initialize_state`); otherwise it is ``()``.
        reparameterized: If True, a fresh sample keeps its pathwise gradient;
            otherwise it is a constant (PPO's replay).
    """

    rng: nnx.Rngs | nnx.RngStream
    rng_collection: str = "action"
    deterministic: bool = False
    per_env_streams: bool = False
    reparameterized: bool = False
    entropy_weight: float = 0.0
    # Whether the head's call takes a mask.
    takes_mask: bool = False
    # How to build the head so that a replay draws no key (the error of _draw says it).
    _key_free_entropy: str = "build the head with an entropy that draws none"

    def _init_stream(
        self, rngs, rng_collection: str, per_env_streams: bool, rng: Any = None
    ) -> None:
        """Sets the stream, ``deterministic`` and ``per_env_streams`` (``rng``: the
        deprecated name of ``rngs``, for the heads that took it)."""
        if rng is not None:
            warnings.warn(
                "the rng= keyword is deprecated; pass the nnx.Rngs as rngs= (flax's name) "
                "or as the first positional argument.",
                DeprecationWarning,
                stacklevel=3,
            )
            if rngs is not None:
                raise TypeError("pass the random stream once, as rngs, not also as rng=.")
            rngs = rng
        self.rng = stream(rngs, rng_collection)
        self.rng_collection = rng_collection
        self.per_env_streams = bool(per_env_streams)
        self.deterministic = False

    @property
    def num_params(self) -> int:
        """The width of the network output's last axis that this head expects: for a
        head of two parameters per action dimension, ``2 * action_dim``.

        Raises:
            AttributeError: the head was built without ``action_dim``, so it takes
                inputs of any even width.
        """
        action_dim = getattr(self, "action_dim", None)
        if action_dim is None:
            raise AttributeError(
                f"{type(self).__name__} was built without action_dim, so its input width "
                f"is 2 * the action dimension of each input; pass action_dim= (or build it "
                f"with samplers.head_for) to fix num_params."
            )
        return 2 * action_dim

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
        sampling = rollout_extras is None and not self._all_deterministic(modes)
        noisy = sampling or self._entropy_needs_key()
        next_state, sample_key, entropy_key = self._keys(
            state, dist.batch_shape, noisy, self._all_deterministic(modes)
        )
        old_log_likelihood = None
        if rollout_extras is None:
            data, output, own = self._sample(inputs, dist, modes, sample_key)
        else:
            data, old_log_likelihood = self._unpack(dist, rollout_extras)
            data = jax.lax.stop_gradient(data)
            output, own = self._replay(dist, data)
        return StatefulModuleOutput(
            next_state=next_state,
            output=output,
            regularization_loss=self._regularization(dist, entropy_key, data),
            metrics=self._metrics(inputs, dist, output, own, old_log_likelihood),
            rollout_extras=self._pack(jax.lax.stop_gradient(data), own),
        )

    # What a head may change; the defaults are those of a head with one distribution.

    def _modes(self, deterministic: bool | None) -> Any:
        """The call's ``deterministic=``, or the module's flag when it is ``None``."""
        return self.deterministic if deterministic is None else bool(deterministic)

    def _all_deterministic(self, modes: Any) -> bool:
        return bool(modes)

    def _entropy_needs_key(self) -> bool:
        """Whether the entropy cost is estimated from a sample (and needs a key)."""
        return False

    def _sample(self, inputs, dist, modes: Any, key) -> tuple[Any, dict, Any]:
        """``(data, output, own)`` of a fresh sample or the deterministic action: its
        replay data, scored as a replay of it is."""
        data = self._draw_data(inputs, dist, modes, key)
        return (data, *self._replay(dist, data))

    def _draw_data(self, inputs, dist, modes: Any, key) -> Any:
        """The replay data of the deterministic action or of a fresh sample."""
        if modes:
            data = replay.deterministic_replay_data(dist)
        else:
            data = replay.sample_replay_data(dist, key)
        return data if self.reparameterized else jax.lax.stop_gradient(data)

    def _unpack(self, dist, rollout_extras) -> tuple[Any, Any]:
        """The stored replay data, checked, and the stored log-likelihood if any."""
        return replay.check_replay_data(dist, rollout_extras), None

    def _replay(self, dist, data) -> tuple[dict, Any]:
        """``(output, own)``: the output, and what :meth:`_pack` and :meth:`_metrics` need."""
        action, log_likelihood = replay.replay(dist, data)
        return {"action": action, "log_likelihood": log_likelihood}, log_likelihood

    def _pack(self, data, own) -> Any:
        """The ``rollout_extras`` that a later call replays."""
        return data

    def _regularization(self, dist, key, data) -> Array:
        """``-entropy_weight * entropy`` (``data``: the call's replay data)."""
        return -self.entropy_weight * jnp.asarray(dist.entropy())

    def _metrics(self, inputs, dist, output: dict, own, old_log_likelihood) -> dict:
        """The head's metrics for logging."""
        return {}

    # The carry state and the keys.

    def initialize_state(self, batch_size: int) -> tuple[()] | PRNGKeyArray:
        """``()``, or with ``per_env_streams`` one new key per environment.

        The keys are split from one key drawn from the module's stream, so each
        call returns new ones.

        Example:
            >>> import jax.numpy as jnp, samplers
            >>> from flax import nnx
            >>> head = samplers.NormalTanhSampler(nnx.Rngs(0), 0.01, per_env_streams=True)
            >>> keys = head.initialize_state(8)
            >>> whole = head(keys, jnp.zeros((8, 4)))
            >>> half = head(keys[4:], jnp.zeros((4, 4)))
            >>> bool(jnp.array_equal(whole.output["action"][4:], half.output["action"]))
            True
        """
        if not self.per_env_streams:
            return ()
        batch_size = _checks.positive_int("batch_size", batch_size)
        return jax.random.split(self._draw(), batch_size)

    def reset_state(self, prev_state: tuple[()] | PRNGKeyArray) -> tuple[()] | PRNGKeyArray:
        """``()``, or with ``per_env_streams`` the same keys: a stream runs across episodes."""
        return prev_state if self.per_env_streams else ()

    def _keys(self, state, batch_shape: tuple[int, ...], noisy: bool, deterministic: bool):
        """``(next_state, sample key, entropy key)`` for one call (see the module)."""
        if self.per_env_streams:
            _check_env_keys(state, batch_shape)
            if not noisy:
                return state, None, None
            split = jax.vmap(lambda key: jax.random.split(key, 3))(state.reshape(-1))
            return tuple(split[:, i].reshape(batch_shape) for i in range(3))
        if not (isinstance(state, tuple) and not state):
            raise ValueError(
                f"{type(self).__name__} was built with per_env_streams=False, so its state is "
                f"(), got {type(state).__name__}; pass (), or build the head with "
                f"per_env_streams=True for one key per environment."
            )
        if not noisy:
            return (), None, None
        sample_key = None if deterministic else self._draw()
        return (), sample_key, self._draw()

    def _draw(self) -> PRNGKeyArray:
        try:
            return draw(self.rng, self.rng_collection)
        except errors.TraceContextError as error:
            raise errors.TraceContextError(
                f"{type(self).__name__} draws a key from its nnx.Rngs stream "
                f"{self.rng_collection!r} inside a jax transform (jax.grad, jax.jit, ...), "
                f"which flax refuses. Use nnx.grad / nnx.jit / nnx.value_and_grad, or make "
                f"the call key-free: a sample always draws a key, and a replay draws one "
                f"only for an entropy estimated from a sample, so {self._key_free_entropy} "
                f"(or give the head its keys as state with per_env_streams=True)."
            ) from error


def _check_env_keys(keys, batch_shape: tuple[int, ...]) -> None:
    """Refuses a state that is not one key per batch element."""
    if not isinstance(keys, jax.Array) or not jnp.issubdtype(keys.dtype, jax.dtypes.prng_key):
        raise TypeError(
            f"with per_env_streams=True the state must be one key per environment, got "
            f"{type(keys).__name__}; pass sampler.initialize_state(batch_size) to the first "
            f"call and each call's next_state to the next."
        )
    if keys.shape != batch_shape:
        raise ValueError(
            f"the state must hold one key per batch element, shape {batch_shape}, got "
            f"{keys.shape}; slice the keys with the inputs when splitting a batch."
        )


def stream(value, collection) -> nnx.Rngs | nnx.RngStream:
    """The ``nnx.Rngs`` or ``nnx.RngStream`` a head draws from (see :func:`draw`).

    Raises:
        TypeError: none is given, the value is neither, or ``collection`` is not
            a string.
        ValueError: the ``nnx.Rngs`` has neither a ``collection`` stream nor a
            ``default`` one to fall back to.
    """
    if value is None:
        raise TypeError("a sampler needs a random stream: pass rngs=nnx.Rngs(0).")
    if not isinstance(collection, str):
        raise TypeError(f"rng_collection must be a stream name, got {collection!r}.")
    if isinstance(value, nnx.RngStream):
        return value
    if not isinstance(value, nnx.Rngs):
        raise TypeError(
            f"rngs must be an nnx.Rngs or an nnx.RngStream, got {type(value).__name__}; "
            f"pass e.g. nnx.Rngs(0)."
        )
    try:
        value[collection]
    except KeyError:
        raise ValueError(
            f"the nnx.Rngs has no stream named {collection!r} and no 'default' stream to fall "
            f"back to (it has {sorted(value)}); pass nnx.Rngs({collection}=0) or "
            f"rng_collection='<one of those>'."
        ) from None
    return value


def draw(rngs: nnx.Rngs | nnx.RngStream, collection: str) -> PRNGKeyArray:
    """One key from what :func:`stream` returned: the stream itself, or the
    ``nnx.Rngs``' ``collection`` stream (``default`` where it has none)."""
    if isinstance(rngs, nnx.RngStream):
        return rngs()
    return rngs[collection]()


@jax.jit
def bound_metrics(bounds: Squashing, action: Float[Array, "*batch action"]):
    """The fraction of each action's dimensions on a bound, and its smallest distance."""
    distances = bounds.distances(action)
    # A NaN action is neither on a bound nor off it: its saturation is NaN.
    on_bound = jnp.where(jnp.isnan(distances), jnp.nan, distances <= 0)
    return jnp.mean(on_bound, axis=-1, dtype=action.dtype), jnp.min(distances, axis=-1)
