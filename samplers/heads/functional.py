"""A head split once into a jitted pure function and its state."""

from collections.abc import Callable

import jax
from flax import nnx

from samplers.heads.action_sampler import ActionSampler


def functional(sampler: ActionSampler) -> tuple[Callable, dict]:
    """Splits a sampler once into a jitted pure function and its state.

    Calling a module through ``nnx.jit`` re-walks its graph on every call, which
    dominates at small batch sizes. ``apply(state, inputs, rollout_extras=None,
    carry=())`` runs the sampler under ``jax.jit`` on the carry state ``carry``
    and returns ``(output, next_state)``: thread ``next_state`` into the next call
    as a training loop threads any other state (and ``output.next_state`` into
    ``carry``). The state is a plain nested dict of arrays (``nnx.to_pure_dict``);
    ``nnx.update(sampler, state)`` writes it back into the module.
    ``deterministic`` is read when ``functional`` is called: call it again after
    ``eval()`` or ``train()``.

    Args:
        sampler: Any :class:`ActionSampler`.

    Returns:
        ``(apply, state)``: the jitted function and the sampler's current state.

    Example:
        >>> import jax.numpy as jnp, samplers
        >>> from flax import nnx
        >>> head = samplers.NormalTanhSampler(nnx.Rngs(0), 0.01)
        >>> apply, state = samplers.functional(head)
        >>> out, state = apply(state, jnp.zeros((8, 4)))
        >>> replay, state = apply(state, jnp.zeros((8, 4)), out.rollout_extras)
        >>> nnx.update(head, state)
        >>> int(head.rng.default.count[...])
        4
    """
    graphdef, state = nnx.split(sampler)

    @jax.jit
    def apply(state, inputs, rollout_extras=None, carry=()):
        module = nnx.merge(graphdef, state)
        out = module(carry, inputs, rollout_extras)
        return out, nnx.to_pure_dict(nnx.state(module))

    return apply, nnx.to_pure_dict(state)
