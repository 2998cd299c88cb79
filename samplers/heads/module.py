"""The stateful-module interface that samplers plug into.

A policy network is a stack of :class:`StatefulModule` s. Each layer takes a
carry ``state`` and ``inputs`` and returns a :class:`StatefulModuleOutput`,
which carries the layer's output together with what a PPO-style training loop
collects on the side: a regularisation loss, metrics for logging, and
``rollout_extras`` that the rollout pass stores and the loss pass hands back.
"""

import abc
from typing import Any

import flax.struct
from flax import nnx


@flax.struct.dataclass
class StatefulModuleOutput:
    """What one call of a :class:`StatefulModule` returns (a JAX pytree).

    Attributes:
        next_state: The carry state for the next step (``()`` when stateless).
        output: The layer's output, e.g. ``{"action", "log_likelihood"}``.
        regularization_loss: A term added to the training loss, per batch element.
        metrics: Arrays for logging.
        rollout_extras: What the rollout pass emits for the loss pass to replay,
            or ``None``.

    Example:
        >>> import jax, jax.numpy as jnp, samplers
        >>> out = samplers.StatefulModuleOutput((), jnp.ones(2), jnp.zeros(()), {})
        >>> jax.tree.map(lambda x: x * 2, out).output
        Array([2., 2.], dtype=float32)
    """

    next_state: Any
    output: Any
    regularization_loss: Any
    metrics: dict[str, Any]
    rollout_extras: Any = None


class StatefulModule(nnx.Module, abc.ABC):
    """An ``nnx.Module`` called as ``module(state, inputs, rollout_extras=None)``.

    ``rollout_extras is None`` means a fresh pass (rollout or inference); a
    non-``None`` value is what an earlier rollout emitted, handed back in the
    loss-replay pass.
    """

    @abc.abstractmethod
    def __call__(self, state: Any, inputs: Any, rollout_extras: Any = None) -> StatefulModuleOutput:
        """Applies the module to ``inputs`` with carry ``state``."""

    @abc.abstractmethod
    def initialize_state(self, batch_size: int) -> Any:
        """Returns the carry state for a fresh batch of ``batch_size`` episodes."""

    @abc.abstractmethod
    def reset_state(self, prev_state: Any) -> Any:
        """Returns the carry state after an episode boundary, given the last one."""
