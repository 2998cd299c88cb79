"""The stream, the carry state and ``deterministic``: what every policy head shares.

A head draws its keys from the ``nnx.Rngs`` (or ``nnx.RngStream``) it holds, or,
with ``per_env_streams=True``, from one key per environment in its carry state.
Each call draws one key for the sample (none when deterministic), drawn in replay
too so that the stream advances the same way in both passes, then one for the
entropy estimate.
"""

import abc
import warnings
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, PRNGKeyArray

from samplers import _checks
from samplers.distributions.bijectors import Squashing
from samplers.heads.module import StatefulModule, StatefulModuleOutput


class ActionSampler(StatefulModule, abc.ABC):
    """A policy head: distribution parameters in, an action out.

    A head holds the stream it draws from as ``rng``: an ``nnx.Rngs``, whose
    stream named ``rng_collection`` (``"action"`` by default) it uses, falling back
    to ``default`` as flax's own layers do (with ``nnx.Rngs(0)`` the keys come from
    ``default``; with ``nnx.Rngs(params=0, action=1)`` from ``action``), or one
    ``nnx.RngStream`` (``rngs.action``) used as it is.

    Attributes:
        deterministic: If True (``module.eval()``), act with the distribution's
            deterministic action instead of sampling; a call's ``deterministic=``
            overrides it for that call.
        per_env_streams: If True, the carry state holds one key per environment
            (see :meth:`initialize_state`); otherwise it is ``()``.
    """

    rng: nnx.Rngs | nnx.RngStream
    rng_collection: str = "action"
    deterministic: bool = False
    per_env_streams: bool = False

    def _init_stream(self, rngs, rng_collection: str, per_env_streams: bool, deprecated: dict):
        """Sets the stream, ``deterministic`` and ``per_env_streams``.

        ``deprecated`` holds the constructor's other keywords: the deprecated
        ``rng=`` is taken from it, and any other is refused.
        """
        if "rng" in deprecated:
            warnings.warn(
                "the rng= keyword is deprecated; pass the nnx.Rngs as rngs= (flax's name) "
                "or as the first positional argument.",
                DeprecationWarning,
                stacklevel=3,
            )
            rng = deprecated.pop("rng")
            if rngs is not None and rng is not None:
                raise TypeError("pass the random stream once, as rngs, not also as rng=.")
            rngs = rng if rngs is None else rngs
        if deprecated:
            raise TypeError(
                f"{type(self).__name__}() got unexpected keyword arguments {sorted(deprecated)}; "
                f"see help(samplers.{type(self).__name__}) for its options."
            )
        self.rng = stream(rngs, rng_collection)
        self.rng_collection = rng_collection
        self.per_env_streams = bool(per_env_streams)
        self.deterministic = False

    @abc.abstractmethod
    def __call__(
        self,
        state: tuple[()] | PRNGKeyArray,
        inputs: Float[Array, "*batch params"],
        rollout_extras: Any = None,
        *,
        deterministic: bool | None = None,
    ) -> StatefulModuleOutput:
        """Samples (``rollout_extras is None``) or replays an action."""

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

    def _keys(self, state, batch_shape: tuple[int, ...], deterministic: bool):
        """``(next_state, sample key, entropy key)`` for one call.

        From the per-environment keys in ``state``, or from the module's stream:
        one key for the sample (``None`` when deterministic), drawn in replay too
        so that the stream advances the same way in both passes, then one for the
        entropy estimate.
        """
        if self.per_env_streams:
            return _split_env_keys(state, batch_shape)
        sample_key = None if deterministic else self._draw()
        return (), sample_key, self._draw()

    def _deterministic(self, deterministic: bool | None) -> bool:
        """The call's ``deterministic=``, or the module's flag when it is ``None``."""
        return self.deterministic if deterministic is None else bool(deterministic)

    def _draw(self) -> PRNGKeyArray:
        return draw(self.rng, self.rng_collection)


def _split_env_keys(keys, batch_shape: tuple[int, ...]):
    """Splits one key per batch element into (next keys, sample keys, entropy keys)."""
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
    split = jax.vmap(lambda key: jax.random.split(key, 3))(keys.reshape(-1))
    return tuple(split[:, i].reshape(batch_shape) for i in range(3))


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
