"""A head's keys: the ``nnx.Rngs`` stream it holds, or one key per environment.

A head draws its keys from the ``nnx.Rngs`` (or ``nnx.RngStream``) it holds, or, with
``per_env_streams=True``, from one key per environment in its carry state. A call that
needs no noise draws no key and leaves the stream (or the state's keys) as it was: a
replay, or an ``eval()`` call, whose entropy cost is exact or absent, is a pure
function of its inputs, as flax's ``Dropout`` with ``deterministic=True`` is. A call
that needs noise (a fresh sample, or an entropy cost estimated from a sample) draws
two keys, the sample's and then the entropy's, as the specified sampler does: the
sample's is not drawn when deterministic, and is drawn but unused in a replay.
"""

import jax
from flax import errors, nnx
from jaxtyping import PRNGKeyArray

from samplers import _checks
from samplers.distributions import _keys


class RandomStreams(nnx.Module):
    """The keys of a head: its stream ``rng`` and, with ``per_env_streams``, its state.

    A head holds the stream it draws from as ``rng``: an ``nnx.Rngs``, whose stream
    named ``rng_collection`` (``"action"`` by default) it uses, falling back to
    ``default`` as flax's own layers do (with ``nnx.Rngs(0)`` the keys come from
    ``default``; with ``nnx.Rngs(params=0, action=1)`` from ``action``), or one
    ``nnx.RngStream`` (``rngs.action``) used as it is. The module says which calls
    draw keys.
    """

    rng: nnx.Rngs | nnx.RngStream
    rng_collection: str = "action"
    per_env_streams: bool = False
    # How to build the head so that a replay draws no key (the error of _draw says it).
    _key_free_entropy: str = "build the head with an entropy that draws none"

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


def _check_env_keys(state, batch_shape: tuple[int, ...]) -> None:
    """Refuses a state that is not one key per batch element."""
    if not _keys.is_key_array(state):
        raise TypeError(
            f"with per_env_streams=True the state must be one key per environment, got "
            f"{type(state).__name__}; pass sampler.initialize_state(batch_size) to the first "
            f"call and each call's next_state to the next."
        )
    if state.shape != batch_shape:
        raise ValueError(
            f"the state must hold one key per batch element, shape {batch_shape}, got "
            f"{state.shape}; slice the keys with the inputs when splitting a batch."
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
