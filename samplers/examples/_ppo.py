"""The parts of PPO that do not depend on the task or the head.

``pendulum``, ``cartpole``, ``tictactoe`` and ``hybrid`` share them: the networks,
the optimizer, the config's checks, the advantages, the clipped loss and the epochs
of minibatch updates.
"""

import math
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import samplers


def gae(reward, value, next_value, done, terminated, gamma: float, gae_lambda: float):
    """Generalised advantage estimates over a ``[T, N]`` rollout.

    ``next_value`` is the value of the observation each step led to, before any
    automatic reset, so an episode cut by a time limit (``done`` but not
    ``terminated``) still bootstraps from where it stopped; a termination zeroes
    it, and ``done`` stops the sum from running into the next episode.
    """
    not_terminated = 1.0 - terminated.astype(value.dtype)
    not_done = 1.0 - done.astype(value.dtype)
    delta = reward + gamma * not_terminated * next_value - value

    def backward(advantage, step):
        delta_t, not_done_t = step
        advantage = delta_t + gamma * gae_lambda * not_done_t * advantage
        return advantage, advantage

    _, advantages = jax.lax.scan(
        backward, jnp.zeros_like(value[0]), (delta, not_done), reverse=True
    )
    return advantages


def tanh_mlp(
    inputs: int, outputs: int, *, hidden: int, last_scale: float, rngs: nnx.Rngs
) -> nnx.Sequential:
    """Two tanh layers of width ``hidden`` and a linear last layer, PPO's usual networks.

    The weights are orthogonal, scaled by ``sqrt(2)`` in the hidden layers and by
    ``last_scale`` in the last; the biases start at 0. Each output therefore starts
    within ``last_scale * sqrt(hidden)`` of 0 whatever the input, the tanh layers'
    outputs being within ``(-1, 1)``.

    Args:
        inputs: Size of the input.
        outputs: Size of the output.
        hidden: Width of the hidden layers.
        last_scale: Scale of the last layer's orthogonal weights.
        rngs: Initialisation stream for the weights.

    Returns:
        The network, ``[..., inputs] -> [..., outputs]``.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> critic = tanh_mlp(3, 1, hidden=8, last_scale=1.0, rngs=nnx.Rngs(0))
        >>> critic(jnp.zeros((5, 3))).shape
        (5, 1)
    """
    init = nnx.initializers.orthogonal
    return nnx.Sequential(
        nnx.Linear(inputs, hidden, kernel_init=init(math.sqrt(2)), rngs=rngs),
        nnx.tanh,
        nnx.Linear(hidden, hidden, kernel_init=init(math.sqrt(2)), rngs=rngs),
        nnx.tanh,
        nnx.Linear(hidden, outputs, kernel_init=init(last_scale), rngs=rngs),
    )


def check_ppo_config(config: Any) -> None:
    """Refuses a PPO config with a count below 1 or a batch that its minibatches do not divide.

    Args:
        config: Has ``total_steps``, ``num_envs``, ``rollout_length``,
            ``eval_episodes`` and ``minibatches``; a batch is ``num_envs *
            rollout_length`` steps.

    Raises:
        ValueError: One of those counts is below 1, or ``minibatches`` does not
            divide the batch.

    Example:
        >>> import types
        >>> config = types.SimpleNamespace(
        ...     total_steps=960, num_envs=3, rollout_length=10, eval_episodes=4, minibatches=4
        ... )
        >>> check_ppo_config(config)
        Traceback (most recent call last):
        ...
        ValueError: num_envs * rollout_length must be divisible by minibatches=4,
        got 3 * 10 = 30; pick a multiple of 4 for num_envs.
    """
    for name in ("total_steps", "num_envs", "rollout_length", "eval_episodes", "minibatches"):
        if getattr(config, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(config, name)}.")
    batch_size = config.num_envs * config.rollout_length
    if batch_size % config.minibatches:
        raise ValueError(
            f"num_envs * rollout_length must be divisible by minibatches={config.minibatches}, "
            f"got {config.num_envs} * {config.rollout_length} = {batch_size}; "
            f"pick a multiple of {config.minibatches} for num_envs."
        )


def ppo_optimizer(model: nnx.Module, config: Any, iterations: int) -> nnx.Optimizer:
    """Adam on ``model``'s parameters, its rate falling linearly to 0 over the whole run.

    Each gradient is first clipped to a global norm of ``config.max_grad_norm``. The
    rate starts at ``config.learning_rate`` and reaches 0 after ``iterations *
    config.epochs * config.minibatches`` updates, the number PPO makes in
    ``iterations`` iterations of ``epochs`` passes over ``minibatches`` minibatches.

    Args:
        model: The module whose ``nnx.Param`` the optimizer updates.
        config: Has ``learning_rate``, ``max_grad_norm``, ``epochs`` and ``minibatches``.
        iterations: Number of PPO iterations.

    Returns:
        The optimizer; ``optimizer.update(model, grads)`` makes one update.
    """
    schedule = optax.linear_schedule(
        config.learning_rate, 0.0, iterations * config.epochs * config.minibatches
    )
    tx = optax.chain(
        optax.clip_by_global_norm(config.max_grad_norm), optax.adam(schedule, eps=1e-5)
    )
    return nnx.Optimizer(model, tx, wrt=nnx.Param)


def ppo_loss(
    out: samplers.StatefulModuleOutput, value: jax.Array, batch: dict, config: Any
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PPO's clipped loss on a minibatch, and its terms.

    With ``ratio = exp(out.output["log_likelihood"] - batch["log_prob"])`` and the
    advantages ``A`` normalised over the minibatch, ``(A - mean(A)) / (std(A) + 1e-8)``,
    and ``eps = config.clip_epsilon``:

    - ``policy_loss = -mean(min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A))``;
    - ``value_loss = 0.5 * mean((value - batch["target"]) ** 2)``;
    - ``entropy_loss = mean(out.regularization_loss)``, the head's entropy bonus
      (``-entropy_weight * entropy``);
    - ``loss = policy_loss + config.value_weight * value_loss + entropy_loss``.

    Args:
        out: The head's output for the minibatch's stored actions, replayed under
            the current weights.
        value: The critic's values of the minibatch's observations.
        batch: The minibatch: ``log_prob`` (the stored actions' log-likelihood at
            the rollout), ``advantage`` and ``target`` (the value's target).
        config: Has ``clip_epsilon``, how far the ratio moves before the policy
            loss stops rewarding it, and ``value_weight``, the value loss's weight.

    Returns:
        ``(loss, metrics)``: ``metrics`` holds ``policy_loss``, ``value_loss``,
        ``entropy_loss``, ``approx_kl``, the mean of ``(ratio - 1) - log(ratio)``,
        and ``clip_fraction``, the fraction of ratios with ``|ratio - 1| > eps``.

    Example:
        >>> import types
        >>> import jax.numpy as jnp, samplers
        >>> out = samplers.StatefulModuleOutput(
        ...     (), {"log_likelihood": jnp.log(jnp.array([1.0, 2.0]))}, jnp.zeros(2), {}
        ... )
        >>> batch = {
        ...     "log_prob": jnp.zeros(2),
        ...     "advantage": jnp.array([1.0, -1.0]),
        ...     "target": jnp.ones(2),
        ... }
        >>> config = types.SimpleNamespace(clip_epsilon=0.2, value_weight=0.5)
        >>> _, metrics = ppo_loss(out, jnp.ones(2), batch, config)
        >>> float(metrics["policy_loss"]), float(metrics["clip_fraction"])
        (0.5, 0.5)
    """
    log_ratio = out.output["log_likelihood"] - batch["log_prob"]
    ratio = jnp.exp(log_ratio)
    advantage = batch["advantage"]
    advantage = (advantage - advantage.mean()) / (advantage.std() + 1e-8)
    clipped = jnp.clip(ratio, 1.0 - config.clip_epsilon, 1.0 + config.clip_epsilon)
    policy_loss = -jnp.minimum(ratio * advantage, clipped * advantage).mean()
    value_loss = 0.5 * jnp.square(value - batch["target"]).mean()
    entropy_loss = out.regularization_loss.mean()
    loss = policy_loss + config.value_weight * value_loss + entropy_loss
    metrics = {
        "policy_loss": policy_loss,
        "value_loss": value_loss,
        "entropy_loss": entropy_loss,
        "approx_kl": ((ratio - 1.0) - log_ratio).mean(),
        "clip_fraction": (jnp.abs(ratio - 1.0) > config.clip_epsilon).mean(),
    }
    return loss, metrics


def update_epochs(loss_fn, graphdef, state, batch, key: jax.Array, config: Any):
    """``config.epochs`` passes over ``batch`` in shuffled minibatches, a gradient step on each.

    Each pass draws a permutation of the batch's rows and cuts it into
    ``config.minibatches`` minibatches of equal size, so that every row is in one
    minibatch of every pass.

    Args:
        loss_fn: ``loss_fn(model, minibatch) -> (loss, metrics)``.
        graphdef: The graph of ``(model, optimizer)``, from ``nnx.split``.
        state: The state of ``(model, optimizer)``.
        batch: A pytree of arrays with the same number of rows (their first axis),
            which ``config.minibatches`` divides.
        key: The key the permutations are drawn from.
        config: Has ``epochs``, the number of passes, and ``minibatches``, the
            number of minibatches (and of gradient steps) in a pass.

    Returns:
        ``(state, metrics)``: the state after the last step, and the last pass's
        ``metrics``, each averaged over its minibatches.
    """
    batch_size = jax.tree.leaves(batch)[0].shape[0]
    minibatch_size = batch_size // config.minibatches

    def update_minibatch(state, minibatch):
        model, optimizer = nnx.merge(graphdef, state)
        grads, metrics = nnx.grad(loss_fn, has_aux=True)(model, minibatch)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), metrics

    def update_epoch(carry, _):
        state, batch, key = carry
        key, shuffle_key = jax.random.split(key)
        order = jax.random.permutation(shuffle_key, batch_size)
        minibatched = jax.tree.map(
            lambda x: x[order].reshape(config.minibatches, minibatch_size, *x.shape[1:]), batch
        )
        state, metrics = jax.lax.scan(update_minibatch, state, minibatched)
        return (state, batch, key), jax.tree.map(jnp.mean, metrics)

    (state, _, _), metrics = jax.lax.scan(update_epoch, (state, batch, key), length=config.epochs)
    return state, jax.tree.map(lambda x: x[-1], metrics)


def largest(values: Iterable[float]) -> float:
    """The largest of ``values`` and 0, or NaN if any of them is NaN.

    A NaN must not hide behind the maximum: ``max(0.0, nan)`` is 0.0.

    Example:
        >>> largest([1e-7, 3e-7]), largest([]), largest([1e-7, float("nan")])
        (3e-07, 0.0, nan)
    """
    values = list(values)
    return math.nan if any(math.isnan(value) for value in values) else max([0.0, *values])
