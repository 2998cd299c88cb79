"""SAC on gymnax's ``Pendulum-v1`` with a reparameterised ``samplers`` policy head.

Run ``python -m samplers.examples.pendulum_sac`` (``--help`` lists the flags). Soft
actor-critic (Haarnoja et al., 2018) with the usual parts: an actor MLP for
``[mean | raw_std]`` ending in a :class:`samplers.SquashedNormalSampler` with
``samplers.BoundedTanh(-2, 2)``, so the action is the torque (``--head flow``: a
:class:`samplers.FlowSampler` of two spline layers that also see the observation,
before the same squashing); twin Q-critics and
Polyak-averaged copies of them as targets; and a learned temperature
``alpha = exp(log_alpha)`` that drives the policy's entropy towards ``-|A| = -1``
(the entropy of the torque, whose log-likelihood includes the ``log 2`` of the
bounds' scale). For a batch of replayed transitions ``(s, a, r, s')``:

- critic: ``(Q_i(s, a) - y)^2`` with ``y = r + gamma * (1 - terminated) *
  (min_i Q'_i(s', a') - alpha * log pi(a' | s'))``, ``a'`` a fresh sample of the
  current actor in ``s'`` and ``Q'`` the targets. ``s'`` is the observation the
  step led to, before the environment's automatic reset. A time limit is not a
  terminal state: a truncated episode still bootstraps. Pendulum episodes end
  only by the time limit, so there every target bootstraps;
- actor: ``alpha * log pi(a | s) - min_i Q_i(s, a)`` for a fresh sample ``a``;
- temperature: ``-log_alpha * (log pi(a | s) + target_entropy)``.

The actor loss differentiates through the sample: its gradient flows from the
critics' input ``a`` and from ``log pi(a | s)`` back to the network's output
through ``a = f(mean + std * eps)``. The head is built with
``reparameterized=True`` for that; in the default (PPO) mode it stops the
gradient at a fresh sample, which would leave only the score-function part
``d log pi(a | s) / d params`` at a fixed ``a`` and drop ``dQ/da`` entirely: a wrong
SAC actor gradient that no longer climbs the critic.

The replay buffer is a set of fixed-size arrays, written circularly, that the
training step carries like any other state. It needs no replay library, and the
environment steps, the buffer writes, the minibatch draws and the updates all
run in one jitted function: each call does ``--steps-per-call`` steps of all
``--num-envs`` environments (random actions during the warm-up) and, after the
warm-up, ``--updates-per-step`` gradient updates per step, under ``lax.scan``.

At the end it evaluates the deterministic policy (``actor.eval()``, torque
``f(mean)``) against a uniformly random policy on the same episodes, prints a
summary, and writes ``pendulum_sac.png`` (learning curve and the learned action
distribution in a few states) and ``summary.json`` to ``--out``.
"""

import argparse
import dataclasses
import math
import time
from collections.abc import Sequence

import gymnax
import jax
import jax.numpy as jnp
import optax
from flax import nnx

import samplers
from samplers.examples import _common


@dataclasses.dataclass(frozen=True)
class Config:
    """Hyperparameters; the command-line flags override those they are named after.

    The budget is ``total_steps`` environment steps, in jitted calls of
    ``steps_per_call`` steps of ``num_envs`` environments. The first
    ``warmup_steps`` take uniformly random actions and update nothing; each
    later step of all environments is followed by ``updates_per_step`` updates
    on minibatches of ``batch_size`` transitions from the last ``buffer_size``.
    """

    total_steps: int = 48_000
    seed: int = 0
    num_envs: int = 8
    steps_per_call: int = 25
    updates_per_step: int = 1
    warmup_steps: int = 4_000
    eval_episodes: int = 64
    buffer_size: int = 100_000
    batch_size: int = 256
    hidden: int = 128
    gamma: float = 0.99
    tau: float = 0.005
    learning_rate: float = 1e-3
    initial_alpha: float = 1.0
    target_entropy: float = -1.0
    # Pendulum rewards lie in [-16.3, 0]; a tenth keeps the Q-values near the
    # scale of the log-likelihoods they are traded against.
    reward_scale: float = 0.1
    # "normal": a SquashedNormalSampler; "flow": a FlowSampler (two spline layers
    # conditioned on the observation) before the same squashing.
    head: str = "normal"


def _mlp(inputs: int, outputs: int, hidden: int, rngs: nnx.Rngs) -> nnx.Sequential:
    return nnx.Sequential(
        nnx.Linear(inputs, hidden, rngs=rngs),
        nnx.relu,
        nnx.Linear(hidden, hidden, rngs=rngs),
        nnx.relu,
        nnx.Linear(hidden, outputs, rngs=rngs),
    )


class Actor(nnx.Module):
    """An MLP for ``[mean | raw_std]`` and the reparameterised sampler as its last layer.

    Args:
        hidden: Width of the two hidden layers.
        rngs: Initialisation stream for the weights.
        head_rngs: The sampling stream the head keeps (and, for the flow head, the
            initialisation stream of its conditioners).
        head: ``"normal"`` (a ``SquashedNormalSampler``) or ``"flow"`` (a
            ``FlowSampler`` of two spline layers that also see the scaled
            observation).

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> actor = Actor(32, nnx.Rngs(0), nnx.Rngs(1))
        >>> out = actor(jnp.zeros((5, 3))).output
        >>> out["action"].shape, out["log_likelihood"].shape
        ((5, 1), (5,))
    """

    def __init__(self, hidden: int, rngs: nnx.Rngs, head_rngs: nnx.Rngs, head: str = "normal"):
        self.torso = _mlp(3, 2, hidden, rngs)
        bijector = samplers.BoundedTanh(-_common.MAX_TORQUE, _common.MAX_TORQUE)
        self.flow = head == "flow"
        self.head: samplers.SquashedNormalSampler | samplers.FlowSampler
        if self.flow:
            self.head = samplers.FlowSampler(
                head_rngs,
                entropy_weight=0.0,
                action_dim=1,
                feature_dim=3,
                transform="spline",
                bijector=bijector,
                reparameterized=True,
            )
        else:
            self.head = samplers.SquashedNormalSampler(
                head_rngs, entropy_weight=0.0, bijector=bijector, reparameterized=True
            )

    def head_inputs(self, scaled_obs: jax.Array) -> jax.Array:
        """The head's input for the scaled observation: ``[mean | raw_std]``, and for
        the flow head the scaled observation after it, as its features."""
        params = self.torso(scaled_obs)
        return jnp.concatenate([params, scaled_obs], axis=-1) if self.flow else params

    def __call__(self, obs: jax.Array) -> samplers.StatefulModuleOutput:
        """The head's output for ``obs``: a fresh torque, or ``f(mean)`` after ``eval()``."""
        return self.head((), self.head_inputs(_common.scaled(obs)))


class TwinCritic(nnx.Module):
    """Two independent Q-networks on ``(observation, torque)``.

    Args:
        hidden: Width of the two hidden layers.
        rngs: Initialisation stream for the weights.
    """

    def __init__(self, hidden: int, rngs: nnx.Rngs):
        self.q1 = _mlp(4, 1, hidden, rngs)
        self.q2 = _mlp(4, 1, hidden, rngs)

    def __call__(self, obs: jax.Array, torque: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Both Q-values, each of shape ``obs.shape[:-1]``."""
        # The torque, like the observation, comes to unit range before it enters a network.
        inputs = jnp.concatenate([_common.scaled(obs), torque / _common.MAX_TORQUE], axis=-1)
        return self.q1(inputs)[..., 0], self.q2(inputs)[..., 0]


class Temperature(nnx.Module):
    """The entropy temperature ``alpha = exp(log_alpha)``, learned through ``log_alpha``.

    Args:
        initial_alpha: ``alpha`` before training, ``> 0``.
    """

    def __init__(self, initial_alpha: float):
        self.log_alpha = nnx.Param(jnp.asarray(math.log(initial_alpha)))

    def __call__(self) -> jax.Array:
        """The current ``alpha``."""
        return jnp.exp(self.log_alpha[...])


# What the buffer keeps of each transition, and the shape of one entry.
_TRANSITION = {"obs": (3,), "torque": (1,), "reward": (), "next_obs": (3,), "terminated": ()}


def _buffer(size: int) -> dict:
    """An empty circular replay buffer of ``size`` transitions."""
    arrays = {name: jnp.zeros((size, *shape)) for name, shape in _TRANSITION.items()}
    return arrays | {"position": jnp.int32(0), "count": jnp.int32(0)}


def transitions(obs, torque, reward, info) -> dict:
    """What the buffer keeps of one step of every environment, from gymnax's ``step``.

    ``next_obs`` is the observation the step led to, before the environment's
    automatic reset, and ``terminated`` (``0.0`` or ``1.0``) marks a terminal
    state only, never the time limit, so that the critic's target still
    bootstraps at the end of a truncated episode.
    """
    return {
        "obs": obs,
        "torque": torque,
        "reward": reward,
        "next_obs": info["final_observation"],
        "terminated": info["terminated"].astype(reward.dtype),
    }


def _store(buffer: dict, step: dict) -> dict:
    """Writes a step of every environment at the buffer's position, wrapping around."""
    size = buffer["reward"].shape[0]
    rows = (buffer["position"] + jnp.arange(step["reward"].shape[0])) % size
    buffer = buffer | {name: buffer[name].at[rows].set(x) for name, x in step.items()}
    buffer["position"] = (rows[-1] + 1) % size
    buffer["count"] = jnp.minimum(buffer["count"] + rows.shape[0], size)
    return buffer


_METRICS = ("critic_loss", "actor_loss", "alpha_loss", "alpha", "q_mean", "entropy")


def critic_loss(critic, target, actor, alpha, batch, config: Config):
    """The twin critics' squared error to the soft Bellman target, and the mean ``Q_1``.

    Only ``critic`` is differentiated: the target networks, the actor's sample of
    the next action and ``alpha`` are constants here.
    """
    next_action = actor(batch["next_obs"]).output
    next_q = jnp.minimum(*target(batch["next_obs"], next_action["action"]))
    soft_value = next_q - alpha * next_action["log_likelihood"]
    discount = config.gamma * (1.0 - batch["terminated"])
    y = config.reward_scale * batch["reward"] + discount * soft_value
    q1, q2 = critic(batch["obs"], batch["torque"])
    return 0.5 * (jnp.square(q1 - y) + jnp.square(q2 - y)).mean(), q1.mean()


def actor_loss(actor, critic, alpha, obs):
    """``alpha * log pi(a | s) - min_i Q_i(s, a)`` for a fresh, reparameterised ``a``.

    Returns the loss and the log-likelihoods, which the temperature loss reuses.
    """
    out = actor(obs).output
    q = jnp.minimum(*critic(obs, out["action"]))
    return (alpha * out["log_likelihood"] - q).mean(), out["log_likelihood"]


def temperature_loss(temperature, log_likelihood, config: Config):
    """``-log_alpha * (log pi(a | s) + target_entropy)``, for constant log-likelihoods."""
    log_likelihood = jax.lax.stop_gradient(log_likelihood)
    return -(temperature.log_alpha[...] * (log_likelihood + config.target_entropy)).mean()


def make_train_step(config: Config, graphdef):
    """Builds the jitted function ``(state, runner) -> (state, runner, metrics)``.

    ``state`` is ``nnx.split((actor, critic, target, temperature, *optimizers))[1]``;
    ``runner`` carries the replay buffer, the environments, their key, the running
    episode returns and the number of environment steps taken so far. One call
    runs ``config.steps_per_call`` steps of every environment, each followed by
    its updates once the warm-up is over.
    """
    env, env_params = gymnax.make("Pendulum-v1")
    step_envs = jax.vmap(env.step, in_axes=(0, 0, 0, None))

    def update(state, buffer, key):
        models = nnx.merge(graphdef, state)
        actor, critic, target, temperature, actor_opt, critic_opt, temperature_opt = models
        rows = jax.random.randint(key, (config.batch_size,), 0, buffer["count"])
        batch = {name: buffer[name][rows] for name in _TRANSITION}
        alpha = temperature()
        (q_loss, q_mean), grads = nnx.value_and_grad(critic_loss, has_aux=True)(
            critic, target, actor, alpha, batch, config
        )
        critic_opt.update(critic, grads)
        (pi_loss, log_likelihood), grads = nnx.value_and_grad(actor_loss, has_aux=True)(
            actor, critic, alpha, batch["obs"]
        )
        actor_opt.update(actor, grads)
        alpha_loss, grads = nnx.value_and_grad(temperature_loss)(
            temperature, log_likelihood, config
        )
        temperature_opt.update(temperature, grads)
        polyak = jax.tree.map(
            lambda t, c: t + config.tau * (c - t),
            nnx.state(target, nnx.Param),
            nnx.state(critic, nnx.Param),
        )
        nnx.update(target, polyak)
        values = (q_loss, pi_loss, alpha_loss, alpha, q_mean, -log_likelihood.mean())
        return nnx.state(models), dict(zip(_METRICS, values, strict=True))

    def updates(state, buffer, key):
        keys = jax.random.split(key, config.updates_per_step)
        return jax.lax.scan(lambda state, key: update(state, buffer, key), state, keys)

    def warming_up(state, buffer, key):
        nan = jnp.full((config.updates_per_step,), jnp.nan)
        return state, dict.fromkeys(_METRICS, nan)

    def env_step(carry, _):
        state, (buffer, env_state, obs, key, episode_return, steps) = carry
        models = nnx.merge(graphdef, state)
        key, random_key, env_key, update_key = jax.random.split(key, 4)
        policy_torque = models[0](obs).output["action"]
        random_torque = jax.random.uniform(
            random_key, policy_torque.shape, minval=-_common.MAX_TORQUE, maxval=_common.MAX_TORQUE
        )
        torque = jnp.where(steps < config.warmup_steps, random_torque, policy_torque)
        next_obs, env_state, reward, _, _, info = step_envs(
            jax.random.split(env_key, config.num_envs), env_state, torque, env_params
        )
        buffer = _store(buffer, transitions(obs, torque, reward, info))
        steps = steps + config.num_envs
        state, metrics = jax.lax.cond(
            steps > config.warmup_steps, updates, warming_up, nnx.state(models), buffer, update_key
        )
        done = jnp.logical_or(info["terminated"], info["truncated"])
        episode_return = episode_return + reward
        episodes = {"episodes": done.sum(), "return_sum": jnp.where(done, episode_return, 0).sum()}
        episode_return = jnp.where(done, 0.0, episode_return)
        runner = (buffer, env_state, next_obs, key, episode_return, steps)
        return (state, runner), (jax.tree.map(lambda x: x[-1], metrics), episodes)

    @jax.jit
    def train_step(state, runner):
        (state, runner), (metrics, episodes) = jax.lax.scan(
            env_step, (state, runner), length=config.steps_per_call
        )
        metrics = jax.tree.map(lambda x: x[-1], metrics)
        return state, runner, metrics | jax.tree.map(jnp.sum, episodes)

    return train_step


def _check(config: Config) -> None:
    names = ("total_steps", "num_envs", "steps_per_call", "updates_per_step")
    for name in (*names, "eval_episodes", "batch_size"):
        if getattr(config, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(config, name)}.")
    if config.warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {config.warmup_steps}.")
    if config.head not in ("normal", "flow"):
        raise ValueError(f"head must be 'normal' or 'flow', got {config.head!r}.")
    if config.buffer_size < config.num_envs:
        raise ValueError(
            f"buffer_size must hold at least one step of every environment, got "
            f"buffer_size={config.buffer_size} < num_envs={config.num_envs}; raise buffer_size."
        )


def train(config: Config, *, progress: bool = True) -> tuple[Actor, dict]:
    """Trains SAC for ``config.total_steps`` environment steps.

    Args:
        config: Hyperparameters.
        progress: Show a live progress bar.

    Returns:
        ``(actor, log)``: ``log`` holds the learning curve (``curve_steps``,
        ``curve_returns``: mean return of the training episodes that ended in each
        call), the timings, and the last update's losses, ``alpha`` and entropy
        estimate in ``last_update``.
    """
    _check(config)
    key = jax.random.key(config.seed)
    head_key, actor_key, critic_key, env_key, runner_key = jax.random.split(key, 5)
    actor = Actor(config.hidden, nnx.Rngs(actor_key), nnx.Rngs(head_key), config.head)
    critic = TwinCritic(config.hidden, nnx.Rngs(critic_key))
    target = nnx.clone(critic)
    temperature = Temperature(config.initial_alpha)
    optimizers = [
        nnx.Optimizer(module, optax.adam(config.learning_rate), wrt=nnx.Param)
        for module in (actor, critic, temperature)
    ]
    graphdef, state = nnx.split((actor, critic, target, temperature, *optimizers))

    obs, env_state = _common.reset(env_key, config.num_envs)
    buffer = _buffer(config.buffer_size)
    runner = (buffer, env_state, obs, runner_key, jnp.zeros(config.num_envs), jnp.int32(0))

    def show_alpha(metrics: dict[str, float]) -> str:
        return "-" if math.isnan(metrics["alpha"]) else f"{metrics['alpha']:.3f}"

    steps_per_call = config.num_envs * config.steps_per_call
    calls = max(1, config.total_steps // steps_per_call)
    run = _common.run(
        make_train_step(config, graphdef),
        state,
        runner,
        calls=calls,
        steps_per_call=steps_per_call,
        label="SAC",
        column=("alpha", show_alpha),
        progress=progress,
    )
    actor = nnx.merge(graphdef, run.state)[0]
    log = {
        "steps": calls * steps_per_call,
        "calls": calls,
        "updates": max(0, calls * config.steps_per_call - config.warmup_steps // config.num_envs)
        * config.updates_per_step,
        "curve_steps": run.curve_steps,
        "curve_returns": run.curve_returns,
        "compile_s": run.compile_s,
        "train_s": run.train_s,
        "steps_per_second": calls * steps_per_call / run.train_s,
        "last_update": {name: run.history[-1][name] for name in _METRICS},
    }
    return actor, log


def parse_args(argv: Sequence[str] | None = None) -> tuple[Config, argparse.Namespace]:
    """The config a command line asks for, and its other arguments.

    Args:
        argv: Command-line arguments (``sys.argv[1:]`` when None).

    Returns:
        ``(config, args)``: ``args.out`` is the output folder and
        ``args.no_progress`` hides the progress bar.
    """
    defaults = Config()
    return _common.command_line(
        argv,
        defaults,
        prog="python -m samplers.examples.pendulum_sac",
        description="Train SAC on gymnax Pendulum-v1 with a reparameterised samplers "
        "policy head. The progress bar shows the mean return of the training episodes "
        "that ended in the last call and the temperature alpha.",
        flags={
            "--steps-per-call": dict(
                type=int,
                default=defaults.steps_per_call,
                help="steps of every environment per jitted call",
            ),
            "--updates-per-step": dict(
                type=int,
                default=defaults.updates_per_step,
                help="gradient updates after each step of all environments",
            ),
            "--warmup-steps": dict(
                type=int,
                default=defaults.warmup_steps,
                help="environment steps with uniformly random torques before the first update",
            ),
            "--hidden": dict(type=int, default=defaults.hidden, help="MLP width"),
            "--head": dict(
                choices=("normal", "flow"),
                default=defaults.head,
                help="the policy head: a squashed Normal, or a flow of two spline layers "
                "conditioned on the observation before the same squashing",
            ),
        },
        out="pendulum-sac-results",
        figure="pendulum_sac.png",
    )


def main(argv: Sequence[str] | None = None) -> dict:
    """Trains, evaluates, prints a summary and writes the figure and ``summary.json``.

    Args:
        argv: Command-line arguments (``sys.argv[1:]`` when None).

    Returns:
        The summary written to ``summary.json``.
    """
    config, args = parse_args(argv)
    start = time.perf_counter()
    actor, log = train(config, progress=not args.no_progress)

    def torque(actor: Actor, obs: jax.Array) -> jax.Array:
        return actor(obs).output["action"]

    summary = {
        "config": dataclasses.asdict(config),
        **_common.evaluate(actor, torque, num_episodes=config.eval_episodes, seed=config.seed),
        **log,
        "steps_to_minus_250": _common.first_step_at(log, -250.0),
        "steps_to_minus_200": _common.first_step_at(log, -200.0),
    }
    figure = args.out / "pendulum_sac.png"
    _common.plot(
        figure,
        summary,
        _common.action_distributions(actor.head_inputs, actor.head),
        title=f"(a) SAC on Pendulum-v1, BoundedTanh(-2, 2), {config.head} head",
        warmup_steps=config.warmup_steps,
    )

    def reached(threshold):
        steps = summary[f"steps_to_minus_{threshold}"]
        return "-" if steps is None else f"{steps:,}"

    last = log["last_update"]
    _common.finish(
        summary,
        figure,
        start,
        header=f"Pendulum-v1, SAC, {log['steps']:,} steps ({log['updates']:,} updates), "
        f"seed {config.seed}",
        details=[
            f"training episodes first averaged >= -250 after {reached(250)} steps, "
            f">= -200 after {reached(200)}",
            f"last update: alpha {last['alpha']:.3g}, entropy {last['entropy']:.2f}, "
            f"critic loss {last['critic_loss']:.3g}, actor loss {last['actor_loss']:.3g}",
        ],
    )
    return summary


if __name__ == "__main__":
    main()
