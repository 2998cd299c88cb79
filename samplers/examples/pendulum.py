"""PPO on gymnax's ``Pendulum-v1`` with a ``samplers`` policy head.

Run ``python -m samplers.examples.pendulum`` (``--help`` lists the flags). A small
actor-critic (two MLPs, one for ``[mean | raw_std]`` and one for the value) is
trained with PPO on vectorised environments. The policy head is a
:class:`samplers.SquashedNormalSampler`: the rollout stores the raw pre-squash
action it emits in ``rollout_extras``, and the PPO loss replays that stored array,
so the ratio is computed from the exact pre-image even where the squashing
saturates. One jitted function does a whole iteration: the rollout of all
environments and several epochs of minibatch updates.

At the end it evaluates the deterministic policy (``model.eval()``, action
``f(mean)``) against a uniformly random policy on the same episodes, prints a
summary, and writes ``pendulum.png`` (learning curve and the learned action
distribution in a few states) and ``summary.json`` to ``--out``.

``--bijector`` picks how the Normal sample becomes a torque in ``[-2, 2]``:

- ``tanh-bounds``: ``samplers.BoundedTanh(-2, 2)``; the action is the torque.
- ``tanh``: ``samplers.NormalTanhSampler``; the action in ``[-1, 1]`` is
  multiplied by 2. The constant factor cancels in the PPO ratio.
- ``identity``: ``distrax.Lambda(lambda x: x)``, an unsquashed Normal; the action
  is clipped to ``[-2, 2]`` before the environment sees it, and the ratio is
  computed for the unclipped action.
"""

import argparse
import dataclasses
import json
import math
import pathlib
import time
from collections.abc import Sequence

import distrax
import gymnax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import samplers

BIJECTORS = ("tanh-bounds", "tanh", "identity")
_MAX_TORQUE = 2.0
# Pendulum observations are (cos, sin, angular velocity in [-8, 8]): bring the
# velocity to the unit range of the other two so that no input dominates at init.
_OBS_SCALE = (1.0, 1.0, 1.0 / 8.0)
# States (angle from upright, angular velocity) whose action distributions are drawn:
# hanging down at rest, hanging down and swinging, upright at rest.
_PROBE_STATES = ((math.pi, 0.0), (math.pi, -2.0), (0.0, 0.0))


@dataclasses.dataclass(frozen=True)
class Config:
    """Hyperparameters; the command-line flags override the first few.

    The budget is ``total_steps`` environment steps, done in iterations of
    ``num_envs * rollout_length`` steps, each followed by ``epochs`` passes of
    ``minibatches`` updates over that batch.
    """

    total_steps: int = 1_000_000
    seed: int = 0
    num_envs: int = 64
    rollout_length: int = 128
    bijector: str = "tanh-bounds"
    eval_episodes: int = 64
    epochs: int = 10
    minibatches: int = 8
    gamma: float = 0.95
    gae_lambda: float = 0.95
    learning_rate: float = 1e-3
    clip_epsilon: float = 0.2
    value_weight: float = 0.5
    entropy_weight: float = 0.0
    max_grad_norm: float = 0.5
    # Pendulum rewards lie in [-16.3, 0]; a tenth keeps value targets near unit scale.
    reward_scale: float = 0.1
    hidden: int = 64


class ActorCritic(nnx.Module):
    """Two tanh MLPs on the observation, and the sampler as the policy's last layer.

    Args:
        head: The policy head; it owns the sampling stream.
        hidden: Width of the hidden layers.
        rngs: Initialisation stream for the weights.
    """

    def __init__(self, head: samplers.SquashedNormalSampler, hidden: int, rngs: nnx.Rngs):
        def mlp(out: int, last_scale: float) -> nnx.Sequential:
            init = nnx.initializers.orthogonal
            return nnx.Sequential(
                nnx.Linear(3, hidden, kernel_init=init(math.sqrt(2)), rngs=rngs),
                nnx.tanh,
                nnx.Linear(hidden, hidden, kernel_init=init(math.sqrt(2)), rngs=rngs),
                nnx.tanh,
                nnx.Linear(hidden, out, kernel_init=init(last_scale), rngs=rngs),
            )

        # A small last layer starts the policy at mean 0 and std softplus(0) ~ 0.69
        # in every state, whatever the observation.
        self.actor = mlp(2, 0.01)
        self.critic = mlp(1, 1.0)
        self.head = head

    def policy(self, obs: jax.Array, pre_image: jax.Array | None = None):
        """The head's output for ``obs``: a fresh sample, or a replay of ``pre_image``."""
        return self.head((), self.actor(_scaled(obs)), pre_image)

    def value(self, obs: jax.Array) -> jax.Array:
        """State values, shape ``obs.shape[:-1]``."""
        return self.critic(_scaled(obs))[..., 0]


def _scaled(obs: jax.Array) -> jax.Array:
    return obs * jnp.broadcast_to(jnp.asarray(_OBS_SCALE, obs.dtype), obs.shape)


def make_head(bijector: str, entropy_weight: float, rngs: nnx.Rngs):
    """The policy head for a ``--bijector`` choice and the factor from action to torque.

    Args:
        bijector: One of ``BIJECTORS``.
        entropy_weight: Weight of the head's entropy bonus.
        rngs: The sampling stream the head keeps.

    Returns:
        ``(head, torque_scale)``: the environment gets
        ``clip(torque_scale * action, -2, 2)``.

    Raises:
        ValueError: ``bijector`` is not one of ``BIJECTORS``.

    Example:
        >>> from flax import nnx
        >>> head, torque_scale = make_head("tanh", 0.0, nnx.Rngs(0))
        >>> type(head).__name__, torque_scale
        ('NormalTanhSampler', 2.0)
    """
    if bijector == "tanh-bounds":
        bounds = samplers.BoundedTanh(-_MAX_TORQUE, _MAX_TORQUE)
        return samplers.SquashedNormalSampler(rngs, entropy_weight, bijector=bounds), 1.0
    if bijector == "tanh":
        return samplers.NormalTanhSampler(rngs, entropy_weight), _MAX_TORQUE
    if bijector == "identity":
        identity = distrax.Lambda(lambda x: x)
        return samplers.SquashedNormalSampler(rngs, entropy_weight, bijector=identity), 1.0
    raise ValueError(f"bijector must be one of {BIJECTORS}, got {bijector!r}; pick one of those.")


def _to_torque(action: jax.Array, torque_scale: float) -> jax.Array:
    return jnp.clip(torque_scale * action, -_MAX_TORQUE, _MAX_TORQUE)


def _gae(reward, value, next_value, done, terminated, config: Config):
    """Generalised advantage estimates over a ``[T, N]`` rollout.

    ``next_value`` is the value of the observation each step led to, before any
    automatic reset, so an episode cut by the time limit still bootstraps from
    where it stopped; only a true termination zeroes it (Pendulum has none).
    """
    not_terminated = 1.0 - terminated.astype(value.dtype)
    not_done = 1.0 - done.astype(value.dtype)
    delta = reward + config.gamma * not_terminated * next_value - value

    def backward(advantage, step):
        delta_t, not_done_t = step
        advantage = delta_t + config.gamma * config.gae_lambda * not_done_t * advantage
        return advantage, advantage

    _, advantages = jax.lax.scan(
        backward, jnp.zeros_like(value[0]), (delta, not_done), reverse=True
    )
    return advantages


def make_train_step(config: Config, graphdef, torque_scale: float):
    """Builds the jitted function ``(state, runner) -> (state, runner, metrics)``.

    ``state`` is ``nnx.split((model, optimizer))[1]``; ``runner`` carries the
    environments, their key and the running episode returns. One call collects
    ``rollout_length`` steps from every environment and runs the PPO epochs.
    """
    env, env_params = gymnax.make("Pendulum-v1")
    step_envs = jax.vmap(env.step, in_axes=(0, 0, 0, None))
    batch_size = config.num_envs * config.rollout_length
    minibatch_size = batch_size // config.minibatches

    def rollout(model, runner):
        model_def, model_state = nnx.split(model)

        def env_step(carry, _):
            model_state, env_state, obs, key, episode_return = carry
            model = nnx.merge(model_def, model_state)
            out = model.policy(obs)
            torque = _to_torque(out.output["action"], torque_scale)
            key, step_key = jax.random.split(key)
            step_keys = jax.random.split(step_key, config.num_envs)
            next_obs, env_state, reward, terminated, truncated, info = step_envs(
                step_keys, env_state, torque, env_params
            )
            done = jnp.logical_or(terminated, truncated)
            episode_return = episode_return + reward
            transition = {
                "obs": obs,
                "pre_image": out.rollout_extras,
                "log_prob": out.output["log_likelihood"],
                "reward": reward,
                "done": done,
                "terminated": terminated,
                "final_obs": info["final_observation"],
                "finished_return": jnp.where(done, episode_return, 0.0),
                "sigma": out.metrics["sigma"][..., 0],
            }
            episode_return = jnp.where(done, 0.0, episode_return)
            carry = (nnx.state(model), env_state, next_obs, key, episode_return)
            return carry, transition

        carry = (model_state, *runner)
        (model_state, *runner), trajectory = jax.lax.scan(
            env_step, carry, length=config.rollout_length
        )
        # The module again, with the sampling stream advanced by the scan.
        return nnx.merge(model_def, model_state), tuple(runner), trajectory

    def loss_fn(model, batch):
        # Replay: the head scores the stored pre-image under the current weights.
        out = model.policy(batch["obs"], batch["pre_image"])
        log_ratio = out.output["log_likelihood"] - batch["log_prob"]
        ratio = jnp.exp(log_ratio)
        advantage = batch["advantage"]
        advantage = (advantage - advantage.mean()) / (advantage.std() + 1e-8)
        clipped = jnp.clip(ratio, 1.0 - config.clip_epsilon, 1.0 + config.clip_epsilon)
        policy_loss = -jnp.minimum(ratio * advantage, clipped * advantage).mean()
        value_loss = 0.5 * jnp.square(model.value(batch["obs"]) - batch["target"]).mean()
        entropy_loss = out.regularization_loss.mean()
        loss = policy_loss + config.value_weight * value_loss + entropy_loss
        metrics = {
            "policy_loss": policy_loss,
            "value_loss": value_loss,
            "approx_kl": ((ratio - 1.0) - log_ratio).mean(),
            "clip_fraction": (jnp.abs(ratio - 1.0) > config.clip_epsilon).mean(),
        }
        return loss, metrics

    def update_minibatch(state, minibatch):
        model, optimizer = nnx.merge(graphdef, state)
        grads, metrics = nnx.grad(loss_fn, has_aux=True)(model, minibatch)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), metrics

    def update_epoch(carry, _):
        state, batch, key = carry
        key, shuffle_key = jax.random.split(key)
        order = jax.random.permutation(shuffle_key, batch_size)
        minibatches = jax.tree.map(
            lambda x: x[order].reshape(config.minibatches, minibatch_size, *x.shape[1:]), batch
        )
        state, metrics = jax.lax.scan(update_minibatch, state, minibatches)
        return (state, batch, key), jax.tree.map(jnp.mean, metrics)

    @jax.jit
    def train_step(state, runner):
        model, optimizer = nnx.merge(graphdef, state)
        env_state, obs, key, episode_return = runner
        key, epoch_key = jax.random.split(key)
        model, (env_state, obs, key, episode_return), trajectory = rollout(
            model, (env_state, obs, key, episode_return)
        )
        value = model.value(trajectory["obs"])
        next_value = model.value(trajectory["final_obs"])
        reward = config.reward_scale * trajectory["reward"]
        advantage = _gae(
            reward, value, next_value, trajectory["done"], trajectory["terminated"], config
        )
        batch = {
            "obs": trajectory["obs"],
            "pre_image": trajectory["pre_image"],
            "log_prob": trajectory["log_prob"],
            "advantage": advantage,
            "target": advantage + value,
        }
        batch = jax.tree.map(lambda x: x.reshape(batch_size, *x.shape[2:]), batch)
        # Before any update the weights are those of the rollout, so replaying the
        # stored pre-images must give a ratio of exactly 1 up to float rounding.
        replay = model.policy(batch["obs"], batch["pre_image"])
        ratio_error = jnp.abs(
            jnp.exp(replay.output["log_likelihood"] - batch["log_prob"]) - 1.0
        ).max()
        (state, _, _), metrics = jax.lax.scan(
            update_epoch, (nnx.state((model, optimizer)), batch, epoch_key), length=config.epochs
        )
        metrics = jax.tree.map(lambda x: x[-1], metrics)
        metrics |= {
            "replay_ratio_error": ratio_error,
            "episodes": trajectory["done"].sum(),
            "return_sum": trajectory["finished_return"].sum(),
            "sigma": trajectory["sigma"].mean(),
        }
        runner = (env_state, obs, key, episode_return)
        return state, runner, metrics

    return train_step


def _check(config: Config) -> None:
    for name in ("total_steps", "num_envs", "rollout_length", "eval_episodes"):
        if getattr(config, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(config, name)}.")
    batch_size = config.num_envs * config.rollout_length
    if batch_size % config.minibatches:
        raise ValueError(
            f"num_envs * rollout_length must be divisible by minibatches={config.minibatches}, "
            f"got {config.num_envs} * {config.rollout_length} = {batch_size}; "
            f"pick a multiple of {config.minibatches} for num_envs."
        )


def _episode_returns(act, carry, key, num_episodes: int):
    """Returns of ``num_episodes`` full episodes of ``act(carry, obs, key) -> (carry, torque)``."""
    env, env_params = gymnax.make("Pendulum-v1")
    reset_key, key = jax.random.split(key)
    reset_keys = jax.random.split(reset_key, num_episodes)
    obs, env_state = jax.vmap(env.reset, in_axes=(0, None))(reset_keys, env_params)

    def step(state, step_key):
        carry, env_state, obs, total = state
        act_key, env_key = jax.random.split(step_key)
        carry, torque = act(carry, obs, act_key)
        env_keys = jax.random.split(env_key, num_episodes)
        obs, env_state, reward, *_ = jax.vmap(env.step, in_axes=(0, 0, 0, None))(
            env_keys, env_state, torque, env_params
        )
        return (carry, env_state, obs, total + reward), None

    steps = jax.random.split(key, env_params.max_steps_in_episode)
    state = (carry, env_state, obs, jnp.zeros(num_episodes))
    (_, _, _, total), _ = jax.lax.scan(step, state, steps)
    return total


def evaluate(model: ActorCritic, torque_scale: float, num_episodes: int, key: jax.Array):
    """Episode returns of the deterministic policy and of a uniformly random one.

    Both run ``num_episodes`` full episodes from the same initial states. The
    policy acts in ``eval()`` mode, with the torque ``f(mean)``; the random policy
    draws each torque uniformly from ``[-2, 2]``.

    Returns:
        ``(deterministic, random)`` returns, two NumPy arrays of shape ``[num_episodes]``.
    """
    model.eval()
    graphdef, state = nnx.split(model)
    model.train()

    def act_deterministic(state, obs, _):
        model = nnx.merge(graphdef, state)
        torque = _to_torque(model.policy(obs).output["action"], torque_scale)
        return nnx.state(model), torque

    def act_random(carry, obs, key):
        shape = (*obs.shape[:-1], 1)
        return carry, jax.random.uniform(key, shape, minval=-_MAX_TORQUE, maxval=_MAX_TORQUE)

    @jax.jit
    def run(state, key):
        deterministic = _episode_returns(act_deterministic, state, key, num_episodes)
        uniform = _episode_returns(act_random, (), key, num_episodes)
        return deterministic, uniform

    return jax.device_get(run(state, key))


def action_distributions(
    model: ActorCritic, torque_scale: float, *, num_samples: int = 20_000, grid: int = 2_001
):
    """Samples and density of the torque the policy takes in each of ``_PROBE_STATES``.

    The samples come from the head in training mode. The density is computed
    from the head's distribution object on a grid of pre-images ``x`` spanning
    ``loc +- 6 scale``: the torque is ``torque_scale * f(x)`` and its density is
    ``exp(log_prob_from_pre_image(x)) / torque_scale``, which stays finite where
    ``f`` saturates and ``log_prob`` of the action would need ``atanh(+-1)``.

    Returns:
        A list of dicts with ``state``, ``samples``, ``torque`` (grid), ``density``
        and ``deterministic`` (the torque ``torque_scale * f(mean)``).
    """
    result = []
    for theta, theta_dot in _PROBE_STATES:
        obs = jnp.array([math.cos(theta), math.sin(theta), theta_dot])
        mean_and_std = model.actor(_scaled(obs))
        sampled = model.head((), jnp.broadcast_to(mean_and_std, (num_samples, 2)))
        dist = model.head.distribution(jnp.broadcast_to(mean_and_std, (grid, 2)))
        offsets = jnp.linspace(-6.0, 6.0, grid)[:, None]
        pre_image = dist.loc + dist.scale * offsets
        action = jnp.asarray(dist.bijector.forward(pre_image))[:, 0]
        density = jnp.exp(dist.log_prob_from_pre_image(pre_image)) / torque_scale
        deterministic = torque_scale * dist.deterministic_action()[0, 0]
        result.append(
            {
                "state": (theta, theta_dot),
                "samples": np.asarray(torque_scale * sampled.output["action"][:, 0]),
                "torque": np.asarray(torque_scale * action),
                "density": np.asarray(density),
                "deterministic": float(deterministic),
            }
        )
    return result


def plot(path: pathlib.Path, summary: dict, distributions: list[dict]) -> None:
    """Writes the learning curve and the action distributions to a PNG at ``path``.

    Uses matplotlib's object API with the Agg canvas, so it needs no display and
    leaves pyplot's global state alone.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(16, 4), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 1 + len(distributions), width_ratios=[1.6] + [1] * len(distributions))
    curve = axes[0]
    curve.plot(summary["curve_steps"], summary["curve_returns"], color="C0", label="training")
    curve.axhline(
        summary["deterministic_return"], color="C2", linestyle="--", label="deterministic, final"
    )
    curve.axhline(summary["random_return"], color="C3", linestyle=":", label="uniform random")
    curve.set_xlabel("environment steps")
    curve.set_ylabel("return per episode (200 steps)")
    curve.set_title(f"(a) PPO on Pendulum-v1, {summary['bijector']}")
    curve.legend(loc="lower right")
    for ax, dist in zip(axes[1:], distributions, strict=True):
        samples = dist["samples"]
        low, high = np.quantile(samples, [0.0005, 0.9995])
        # Zoom onto the samples: a nearly deterministic policy is a spike at full width.
        pad = 0.15 * max(high - low, 0.2)
        ax.set_xlim(low - pad, high + pad)
        heights, _, _ = ax.hist(
            samples,
            bins=60,
            range=(low, high),
            density=True,
            color="C0",
            alpha=0.5,
            label="samples",
        )
        ax.plot(dist["torque"], dist["density"], color="C1", label="exp(log_prob)")
        ax.axvline(
            dist["deterministic"], color="C2", linestyle="--", label="deterministic: f(mean)"
        )
        for bound in (-_MAX_TORQUE, _MAX_TORQUE):
            ax.axvline(bound, color="k", linewidth=1.5)
        # A squashing that saturates piles density against a bound; keep the bulk readable.
        ax.set_ylim(0, 1.3 * max(heights.max(), 1e-3))
        theta, theta_dot = dist["state"]
        ax.set_title(f"angle {math.degrees(theta):.0f} deg, velocity {theta_dot:+.1f} rad/s")
        ax.set_xlabel("torque (black: bounds)")
        ax.xaxis.set_major_locator(MaxNLocator(5))
    axes[1].set_ylabel("(b) density of the learned action")
    axes[1].legend(loc="best", fontsize="small")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def _progress(enabled: bool):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("PPO"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("steps"),
        TimeElapsedColumn(),
        TextColumn("{task.fields[rate]} steps/s"),
        TextColumn("return {task.fields[ret]}"),
        TextColumn("std {task.fields[std]}"),
        disable=not enabled,
    )


def train(config: Config, *, progress: bool = True) -> tuple[ActorCritic, float, dict]:
    """Trains the actor-critic for ``config.total_steps`` environment steps.

    Args:
        config: Hyperparameters.
        progress: Show a live progress bar.

    Returns:
        ``(model, torque_scale, log)``: ``log`` holds the learning curve
        (``curve_steps``, ``curve_returns``: mean return of the episodes that ended
        in each iteration), ``replay_ratio_error`` (the largest
        ``|ratio - 1|`` of the replay before each iteration's first update, over
        all iterations), the timings and the last iteration's losses.
    """
    _check(config)
    key = jax.random.key(config.seed)
    head_key, param_key, env_key, runner_key = jax.random.split(key, 4)
    head, torque_scale = make_head(config.bijector, config.entropy_weight, nnx.Rngs(head_key))
    model = ActorCritic(head, config.hidden, nnx.Rngs(param_key))

    steps_per_iteration = config.num_envs * config.rollout_length
    iterations = max(1, config.total_steps // steps_per_iteration)
    schedule = optax.linear_schedule(
        config.learning_rate, 0.0, iterations * config.epochs * config.minibatches
    )
    tx = optax.chain(
        optax.clip_by_global_norm(config.max_grad_norm), optax.adam(schedule, eps=1e-5)
    )
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))

    env, env_params = gymnax.make("Pendulum-v1")
    obs, env_state = jax.vmap(env.reset, in_axes=(0, None))(
        jax.random.split(env_key, config.num_envs), env_params
    )
    runner = (env_state, obs, runner_key, jnp.zeros(config.num_envs))

    start = time.perf_counter()
    train_step = make_train_step(config, graphdef, torque_scale).lower(state, runner).compile()
    compile_s = time.perf_counter() - start

    curve_steps, curve_returns, ratio_error, metrics = [], [], 0.0, {}
    last_return, sigma = float("nan"), float("nan")
    start = time.perf_counter()
    with _progress(progress) as bar:
        task = bar.add_task("", total=iterations * steps_per_iteration, rate="-", ret="-", std="-")
        for iteration in range(iterations):
            state, runner, metrics = train_step(state, runner)
            metrics = {name: float(value) for name, value in jax.device_get(metrics).items()}
            steps = (iteration + 1) * steps_per_iteration
            ratio_error = max(ratio_error, metrics["replay_ratio_error"])
            sigma = metrics["sigma"]
            if metrics["episodes"]:
                last_return = metrics["return_sum"] / metrics["episodes"]
                curve_steps.append(steps)
                curve_returns.append(last_return)
            rate = steps / (time.perf_counter() - start)
            bar.update(
                task,
                completed=steps,
                rate=f"{rate:,.0f}",
                ret="-" if math.isnan(last_return) else f"{last_return:7.1f}",
                std=f"{sigma:.3f}",
            )
    train_s = time.perf_counter() - start
    model, _ = nnx.merge(graphdef, state)
    log = {
        "steps": iterations * steps_per_iteration,
        "iterations": iterations,
        "curve_steps": curve_steps,
        "curve_returns": curve_returns,
        "replay_ratio_error": ratio_error,
        "final_sigma": sigma,
        "compile_s": compile_s,
        "train_s": train_s,
        "steps_per_second": iterations * steps_per_iteration / train_s,
        "last_iteration": metrics,
    }
    return model, torque_scale, log


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    defaults = Config()
    parser = argparse.ArgumentParser(
        prog="python -m samplers.examples.pendulum",
        description="Train PPO on gymnax Pendulum-v1 with a samplers policy head. The "
        "progress bar shows the mean return of the episodes that ended in the last "
        "iteration and the mean std of the policy's Normal (before squashing).",
    )
    parser.add_argument(
        "--total-steps", type=int, default=defaults.total_steps, help="environment steps to train"
    )
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument(
        "--num-envs", type=int, default=defaults.num_envs, help="environments run in parallel"
    )
    parser.add_argument(
        "--rollout-length",
        type=int,
        default=defaults.rollout_length,
        help="steps per environment between updates",
    )
    parser.add_argument(
        "--bijector",
        choices=BIJECTORS,
        default=defaults.bijector,
        help="tanh-bounds: BoundedTanh(-2, 2); tanh: tanh, torque = 2 * action; "
        "identity: no squashing, torque = clip(action, -2, 2)",
    )
    parser.add_argument(
        "--eval-episodes",
        type=int,
        default=defaults.eval_episodes,
        help="episodes for the final deterministic-vs-random evaluation",
    )
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        default=pathlib.Path("pendulum-results"),
        help="folder for pendulum.png and summary.json",
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict:
    """Trains, evaluates, prints a summary and writes the figure and ``summary.json``.

    Args:
        argv: Command-line arguments (``sys.argv[1:]`` when None).

    Returns:
        The summary written to ``summary.json``.
    """
    args = _parse(argv)
    config = Config(
        total_steps=args.total_steps,
        seed=args.seed,
        num_envs=args.num_envs,
        rollout_length=args.rollout_length,
        bijector=args.bijector,
        eval_episodes=args.eval_episodes,
    )
    start = time.perf_counter()
    model, torque_scale, log = train(config, progress=not args.no_progress)
    eval_key = jax.random.fold_in(jax.random.key(config.seed), 1)
    deterministic, uniform = evaluate(model, torque_scale, config.eval_episodes, eval_key)
    summary = {
        "config": dataclasses.asdict(config),
        "bijector": config.bijector,
        "deterministic_return": float(deterministic.mean()),
        "deterministic_return_std": float(deterministic.std()),
        "random_return": float(uniform.mean()),
        "random_return_std": float(uniform.std()),
        **log,
    }
    figure = args.out / "pendulum.png"
    plot(figure, summary, action_distributions(model, torque_scale))
    reached = [
        s for s, r in zip(log["curve_steps"], log["curve_returns"], strict=True) if r >= -200
    ]
    summary["steps_to_minus_200"] = reached[0] if reached else None
    summary["wall_s"] = time.perf_counter() - start
    summary["figure"] = str(figure)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))

    episodes = config.eval_episodes
    print(
        f"Pendulum-v1, {config.bijector}, {log['steps']:,} steps, seed {config.seed}\n"
        f"  deterministic policy: {summary['deterministic_return']:8.1f} "
        f"+- {summary['deterministic_return_std']:.1f} per episode ({episodes} episodes)\n"
        f"  uniform random:       {summary['random_return']:8.1f} "
        f"+- {summary['random_return_std']:.1f} per episode (same initial states)\n"
        f"  wall time {summary['wall_s']:.1f} s (compile {log['compile_s']:.1f} s), "
        f"{log['steps_per_second']:,.0f} steps/s while training\n"
        f"  training episodes first averaged >= -200 after "
        f"{'-' if reached == [] else f'{reached[0]:,}'} steps\n"
        f"  replay ratio before the first update: max |ratio - 1| = "
        f"{log['replay_ratio_error']:.1e}\n"
        f"  wrote {figure} and {args.out / 'summary.json'}"
    )
    return summary


if __name__ == "__main__":
    main()
