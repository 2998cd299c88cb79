"""One PPO trainer for the examples, after flax's ``examples/ppo``.

``pendulum``, ``cartpole``, ``tictactoe`` and ``hybrid`` keep only their
environment (an :class:`Env`), their head, their config's defaults and their
report; :func:`train` does the rest. Each iteration it runs the head's sampling
pass in ``num_envs`` environments for ``rollout_length`` steps, storing each
step's ``rollout_extras`` (and the head's mask, where the environment has one),
computes the advantages, and runs epochs of minibatch updates of the clipped
loss, which replays the stored extras through the head under the current weights.
"""

import dataclasses
import math
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import gymnax
import jax
import jax.numpy as jnp
import optax
from flax import nnx

import samplers
from samplers.examples import _common


@dataclasses.dataclass(frozen=True)
class Config:
    """PPO's hyperparameters; each example overrides some defaults and may add fields.

    The budget is ``total_steps`` environment steps, done in iterations of
    ``num_envs * rollout_length`` steps, each followed by ``epochs`` passes of
    ``minibatches`` updates over that batch. Rewards are multiplied by
    ``reward_scale`` before the advantages.
    """

    total_steps: int = 200_000
    seed: int = 0
    num_envs: int = 16
    rollout_length: int = 64
    eval_episodes: int = 64
    epochs: int = 4
    minibatches: int = 4
    gamma: float = 0.99
    gae_lambda: float = 0.95
    learning_rate: float = 1e-3
    clip_epsilon: float = 0.2
    value_weight: float = 0.5
    entropy_weight: float = 0.01
    max_grad_norm: float = 0.5
    reward_scale: float = 1.0
    hidden: int = 64


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


class ActorCritic(nnx.Module):
    """Two tanh MLPs on the observation, and the policy head as the actor's last layer.

    The actor maps an observation to the head's ``head.num_params`` inputs, the
    critic to its value. The actor's last layer is small (scale 0.01), so the
    policy starts near the head's distribution for inputs 0 in every state.

    Args:
        obs_size: Size of the observation.
        head: The policy head, any ``samplers`` head; it owns the sampling stream.
        hidden: Width of the hidden layers.
        rngs: Initialisation stream for the weights.
        preprocess: Applied to the observation before both networks (a scaling,
            say), or None.

    Example:
        >>> import jax.numpy as jnp, samplers
        >>> from flax import nnx
        >>> head = samplers.CategoricalSampler(nnx.Rngs(0), 0.01, num_actions=3)
        >>> model = ActorCritic(4, head, hidden=8, rngs=nnx.Rngs(1))
        >>> out = model.policy(jnp.zeros((5, 4)))
        >>> out.output["action"].shape, model.value(jnp.zeros((5, 4))).shape
        ((5,), (5,))
    """

    def __init__(
        self,
        obs_size: int,
        head: Any,
        *,
        hidden: int,
        rngs: nnx.Rngs,
        preprocess: Callable[[jax.Array], jax.Array] | None = None,
    ):
        self.actor = tanh_mlp(obs_size, head.num_params, hidden=hidden, last_scale=0.01, rngs=rngs)
        self.critic = tanh_mlp(obs_size, 1, hidden=hidden, last_scale=1.0, rngs=rngs)
        self.head = head
        self.preprocess = preprocess

    def _inputs(self, obs: jax.Array) -> jax.Array:
        return obs if self.preprocess is None else self.preprocess(obs)

    def policy(
        self,
        obs: jax.Array,
        rollout_extras: Any = None,
        *,
        mask: Any = None,
        deterministic: bool | None = None,
    ) -> samplers.StatefulModuleOutput:
        """The head's output for ``obs``: a fresh action, or the replay of ``rollout_extras``.

        ``mask`` (the allowed actions) reaches the head only where there is one:
        the heads of continuous actions take none.
        """
        options = {} if mask is None else {"mask": mask}
        inputs = self.actor(self._inputs(obs))
        return self.head((), inputs, rollout_extras, deterministic=deterministic, **options)

    def value(self, obs: jax.Array) -> jax.Array:
        """State values, shape ``obs.shape[:-1]``."""
        return self.critic(self._inputs(obs))[..., 0]


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


class Step(NamedTuple):
    """One environment's step, what an :class:`Env`'s ``step`` returns."""

    state: Any
    """The environment after the step; a fresh episode's where this one ended."""
    obs: jax.Array
    """The observation of ``state``."""
    reward: jax.Array
    """The step's reward."""
    done: jax.Array
    """The episode ended, in a terminal state or at a time limit."""
    terminated: jax.Array
    """It ended in a terminal state, worth 0; an episode cut by a time limit is not."""
    final_obs: jax.Array
    """The observation the step led to, before any reset: the value bootstraps from it."""
    counts: dict[str, jax.Array]
    """Events that :func:`train` counts over each rollout (illegal moves, say), 0 or 1."""


class Env(NamedTuple):
    """One environment, written for a single episode; :func:`train` vectorises it."""

    reset: Callable[[jax.Array], tuple[jax.Array, Any]]
    """``key -> (obs, state)``, a fresh episode."""
    step: Callable[[jax.Array, Any, Any], Step]
    """``(key, state, action) -> Step``; where the episode ends, the next starts."""
    mask: Callable[[Any], Any] | None = None
    """``state -> mask``, the head's mask of the allowed actions (an array, or a pytree
    of arrays for a composite or autoregressive head), or None: no mask."""


def gymnax_env(env_id: str, to_action: Callable[[Any], jax.Array] | None = None) -> Env:
    """The gymnax environment ``env_id``, its automatic reset included.

    Args:
        env_id: The gymnax name, e.g. ``"CartPole-v1"``.
        to_action: Turns the head's action into the environment's (a torque, say);
            None passes it unchanged.

    Returns:
        The environment; gymnax's ``truncated`` (a time limit) ends an episode
        without terminating it.

    Example:
        >>> import jax
        >>> env = gymnax_env("CartPole-v1")
        >>> obs, state = env.reset(jax.random.key(0))
        >>> step = env.step(jax.random.key(1), state, 1)
        >>> obs.shape, bool(step.done)
        ((4,), False)
    """
    env, params = gymnax.make(env_id)

    def step(key: jax.Array, state: Any, action: Any) -> Step:
        action = action if to_action is None else to_action(action)
        obs, state, reward, terminated, truncated, info = env.step(key, state, action, params)
        done = jnp.logical_or(terminated, truncated)
        return Step(state, obs, reward, done, terminated, info["final_observation"], {})

    return Env(lambda key: env.reset(key, params), step)


def play(model: ActorCritic, env: Env, episodes: int, steps: int, key: jax.Array):
    """Runs the sampling policy (under the environment's mask, where it has one) in
    ``episodes`` fresh environments for ``steps`` steps; the model is left as it was.

    Returns:
        ``(rewards, counts)``, each ``[steps, episodes]``; ``counts`` a dict as the
        environment's :class:`Step` gives it.
    """
    graphdef, state = nnx.split(model)
    mask_of = (lambda env_state: None) if env.mask is None else jax.vmap(env.mask)

    @jax.jit
    def run(state, key):
        reset_key, run_key = jax.random.split(key)
        obs, env_state = jax.vmap(env.reset)(jax.random.split(reset_key, episodes))

        def one_step(carry, key):
            state, obs, env_state = carry
            model = nnx.merge(graphdef, state)
            action = model.policy(obs, mask=mask_of(env_state)).output["action"]
            step = jax.vmap(env.step)(jax.random.split(key, episodes), env_state, action)
            return (nnx.state(model), step.obs, step.state), (step.reward, step.counts)

        carry = (state, obs, env_state)
        return jax.lax.scan(one_step, carry, jax.random.split(run_key, steps))[1]

    return run(state, key)


def steps_to(log: dict[str, Any], threshold: float) -> int | None:
    """The environment steps after which an iteration's episodes first averaged
    ``threshold`` in :func:`train`'s ``log``, or None."""
    for steps, value in zip(log["curve_steps"], log["curve_returns"], strict=True):
        if value >= threshold:
            return int(steps)
    return None


RolloutMetrics = Callable[[ActorCritic, jax.Array, samplers.StatefulModuleOutput], dict]


def make_train_step(config: Config, graphdef, env: Env, rollout_metrics: RolloutMetrics | None):
    """Builds the jitted PPO iteration ``(state, runner) -> (state, runner, metrics)``.

    ``state`` is ``nnx.split((model, optimizer))[1]``; ``runner`` is ``(env_state,
    obs, key, episode_return)`` of the ``num_envs`` environments. One call collects
    ``rollout_length`` steps from every environment and runs the PPO epochs; see
    :func:`train` for the metrics.
    """
    batch_size = config.num_envs * config.rollout_length
    step_envs = jax.vmap(env.step)
    mask_of = (lambda env_state: None) if env.mask is None else jax.vmap(env.mask)

    def rollout(model, runner):
        model_def, model_state = nnx.split(model)

        def env_step(carry, _):
            model_state, env_state, obs, key, episode_return = carry
            model = nnx.merge(model_def, model_state)
            mask = mask_of(env_state)
            out = model.policy(obs, mask=mask)
            key, step_key = jax.random.split(key)
            step_keys = jax.random.split(step_key, config.num_envs)
            step = step_envs(step_keys, env_state, out.output["action"])
            episode_return = episode_return + step.reward
            transition = {
                "obs": obs,
                "mask": mask,
                "rollout_extras": out.rollout_extras,
                "log_prob": out.output["log_likelihood"],
                "reward": step.reward,
                "done": step.done,
                "terminated": step.terminated,
                "final_obs": step.final_obs,
                "finished_return": jnp.where(step.done, episode_return, 0.0),
                "counts": step.counts,
                "metrics": {} if rollout_metrics is None else rollout_metrics(model, obs, out),
            }
            episode_return = jnp.where(step.done, 0.0, episode_return)
            carry = (nnx.state(model), step.state, step.obs, key, episode_return)
            return carry, transition

        carry = (model_state, *runner)
        (model_state, *runner), trajectory = jax.lax.scan(
            env_step, carry, length=config.rollout_length
        )
        # The module again, with the sampling stream advanced by the scan.
        return nnx.merge(model_def, model_state), tuple(runner), trajectory

    def replay(model, batch):
        # Replay: the head scores the stored extras under the current weights and the
        # mask stored with them.
        return model.policy(batch["obs"], batch["rollout_extras"], mask=batch["mask"])

    def loss_fn(model, batch):
        return ppo_loss(replay(model, batch), model.value(batch["obs"]), batch, config)

    def ratio_error(log_likelihood, log_prob):
        return jnp.abs(jnp.exp(log_likelihood - log_prob) - 1.0).max()

    @jax.jit
    def train_step(state, runner):
        model, optimizer = nnx.merge(graphdef, state)
        env_state, obs, key, episode_return = runner
        key, epoch_key = jax.random.split(key)
        model, runner, trajectory = rollout(model, (env_state, obs, key, episode_return))
        value = model.value(trajectory["obs"])
        next_value = model.value(trajectory["final_obs"])
        advantage = gae(
            config.reward_scale * trajectory["reward"],
            value,
            next_value,
            trajectory["done"],
            trajectory["terminated"],
            config.gamma,
            config.gae_lambda,
        )
        batch = {
            "obs": trajectory["obs"],
            "mask": trajectory["mask"],
            "rollout_extras": trajectory["rollout_extras"],
            "log_prob": trajectory["log_prob"],
            "advantage": advantage,
            "target": advantage + value,
        }

        # Before any update the weights are the rollout's: replayed one step of all
        # environments at a time, in the rollout's shapes, the stored extras must give
        # a ratio of exactly 1. A copy of the model replays (its stream carried through
        # the steps), so that the check leaves the model's sampling stream as it was.
        def replay_step(model_state, step):
            copy = nnx.merge(model_def, model_state)
            return nnx.state(copy), replay(copy, step).output["log_likelihood"]

        model_def, model_state = nnx.split(model)
        _, replayed = jax.lax.scan(replay_step, model_state, batch)
        batch = jax.tree.map(lambda x: x.reshape(batch_size, *x.shape[2:]), batch)
        # The whole batch at once, as the loss's minibatches see it (other shapes, where
        # the network may round differently), drawing from the stream as they do.
        flat = replay(model, batch).output["log_likelihood"]
        state, metrics = update_epochs(
            loss_fn, graphdef, nnx.state((model, optimizer)), batch, epoch_key, config
        )
        metrics |= {
            "replay_ratio_error": ratio_error(replayed, trajectory["log_prob"]),
            "minibatch_ratio_error": ratio_error(flat, batch["log_prob"]),
            "episodes": trajectory["done"].sum(),
            "return_sum": trajectory["finished_return"].sum(),
            **jax.tree.map(jnp.sum, trajectory["counts"]),
            **jax.tree.map(jnp.mean, trajectory["metrics"]),
        }
        return state, runner, metrics

    return train_step


def train(
    config: Config,
    make_model: Callable[[nnx.Rngs, nnx.Rngs], ActorCritic],
    env: Env,
    *,
    column: tuple[str, Callable[[dict[str, float]], str]],
    rollout_metrics: RolloutMetrics | None = None,
    label: str = "PPO",
    progress: bool = True,
) -> tuple[ActorCritic, dict[str, Any]]:
    """Trains an actor-critic with PPO for ``config.total_steps`` environment steps.

    The seed's key is split into four: the head's sampling stream, the weights'
    initialisation, the environments' first episodes and the rollouts' keys.

    Args:
        config: Hyperparameters.
        make_model: ``make_model(sampling_rngs, init_rngs)``, the actor-critic: the
            head draws from the first stream, the weights from the second.
        env: The environment, run ``config.num_envs`` times side by side.
        column: ``(title, show)``, the progress bar's last column: ``show`` of the
            latest iteration's metrics.
        rollout_metrics: ``rollout_metrics(model, obs, out) -> {name: [num_envs]}``
            at each rollout step (``out`` the head's output), averaged over the
            rollout; None for none.
        label: The progress bar's first column.
        progress: Show a live progress bar.

    Returns:
        ``(model, log)``. ``log`` holds the learning curve (``curve_steps``,
        ``curve_returns``: mean return of the episodes that ended in each
        iteration), ``per_iteration`` (each iteration's metrics: the last epoch's
        losses as :func:`ppo_loss` names them, the rollout metrics, the sums of
        ``env``'s counts, ``episodes``, ``return_sum`` and the two replay errors),
        ``iteration_steps``, the largest ``|ratio - 1|`` of the replay before each
        iteration's first update over all iterations, in the rollout's shapes
        (``replay_ratio_error``) and over the whole batch at once
        (``minibatch_ratio_error``), the timings and ``last_iteration``.

    Raises:
        ValueError: a count in ``config`` is below 1, or its minibatches do not
            divide its batch (see :func:`check_ppo_config`).
    """
    check_ppo_config(config)
    key = jax.random.key(config.seed)
    head_key, param_key, env_key, runner_key = jax.random.split(key, 4)
    model = make_model(nnx.Rngs(head_key), nnx.Rngs(param_key))

    steps_per_iteration = config.num_envs * config.rollout_length
    iterations = max(1, config.total_steps // steps_per_iteration)
    optimizer = ppo_optimizer(model, config, iterations)
    graphdef, state = nnx.split((model, optimizer))

    obs, env_state = jax.vmap(env.reset)(jax.random.split(env_key, config.num_envs))
    runner = (env_state, obs, runner_key, jnp.zeros(config.num_envs))
    run = _common.run(
        make_train_step(config, graphdef, env, rollout_metrics),
        state,
        runner,
        calls=iterations,
        steps_per_call=steps_per_iteration,
        label=label,
        column=column,
        progress=progress,
    )
    model, _ = nnx.merge(graphdef, run.state)
    per_iteration = {name: [metrics[name] for metrics in run.history] for name in run.history[0]}
    log = {
        "steps": iterations * steps_per_iteration,
        "iterations": iterations,
        "curve_steps": run.curve_steps,
        "curve_returns": run.curve_returns,
        "iteration_steps": [(i + 1) * steps_per_iteration for i in range(iterations)],
        "replay_ratio_error": largest(per_iteration["replay_ratio_error"]),
        "minibatch_ratio_error": largest(per_iteration["minibatch_ratio_error"]),
        "compile_s": run.compile_s,
        "train_s": run.train_s,
        "steps_per_second": iterations * steps_per_iteration / run.train_s,
        "per_iteration": per_iteration,
        "last_iteration": run.history[-1],
    }
    return model, log


def replay_line(log: dict[str, Any]) -> str:
    """The summary's line on the replay before the first update of each iteration."""
    return (
        f"replay ratio before the first update: max |ratio - 1| = "
        f"{log['replay_ratio_error']:.1e} in the rollout's shapes, "
        f"{log['minibatch_ratio_error']:.1e} over the whole batch"
    )
