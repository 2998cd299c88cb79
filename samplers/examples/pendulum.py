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

``--head beta`` replaces the squashed Normal by :class:`samplers.BetaSampler` on
``[-2, 2]``: the action is the torque, a Beta sample that the rollout stores as its
pre-image ``z`` (the Beta's logit), so that a torque that rounded onto a bound is
replayed from ``z``, never scored as the rounded value. ``--bijector`` then does not
apply.
"""

import argparse
import dataclasses
import time
from collections.abc import Sequence

import distrax
import gymnax
import jax
import jax.numpy as jnp
from flax import nnx

import samplers
from samplers.examples import _common, _ppo

BIJECTORS = ("tanh-bounds", "tanh", "identity")
HEADS = ("squashed-normal", "beta")


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
    head: str = "squashed-normal"
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


Head = samplers.SquashedNormalSampler | samplers.BetaSampler


class ActorCritic(nnx.Module):
    """Two tanh MLPs on the observation, and the sampler as the policy's last layer.

    Args:
        head: The policy head; it owns the sampling stream.
        hidden: Width of the hidden layers.
        rngs: Initialisation stream for the weights.
    """

    def __init__(self, head: Head, hidden: int, rngs: nnx.Rngs):
        # A small last layer starts the policy at mean 0 and std softplus(0) ~ 0.69
        # in every state, whatever the observation.
        self.actor = _ppo.tanh_mlp(3, 2, hidden=hidden, last_scale=0.01, rngs=rngs)
        self.critic = _ppo.tanh_mlp(3, 1, hidden=hidden, last_scale=1.0, rngs=rngs)
        self.head = head

    def policy(self, obs: jax.Array, pre_image: jax.Array | None = None):
        """The head's output for ``obs``: a fresh sample, or a replay of ``pre_image``."""
        return self.head((), self.actor(_common.scaled(obs)), pre_image)

    def value(self, obs: jax.Array) -> jax.Array:
        """State values, shape ``obs.shape[:-1]``."""
        return self.critic(_common.scaled(obs))[..., 0]


def make_head(
    bijector: str, entropy_weight: float, rngs: nnx.Rngs, head: str = "squashed-normal"
) -> tuple[Head, float]:
    """The policy head for a ``--head`` and ``--bijector`` choice, and the torque factor.

    Args:
        bijector: One of ``BIJECTORS``, for the squashed Normal.
        entropy_weight: Weight of the head's entropy bonus.
        rngs: The sampling stream the head keeps.
        head: One of ``HEADS``; ``"beta"`` takes no bijector (it must be the default).

    Returns:
        ``(head, torque_scale)``: the environment gets
        ``clip(torque_scale * action, -2, 2)``.

    Raises:
        ValueError: ``head`` or ``bijector`` is not one of the choices, or a
            bijector other than the default is asked of the Beta head.

    Example:
        >>> from flax import nnx
        >>> head, torque_scale = make_head("tanh", 0.0, nnx.Rngs(0))
        >>> type(head).__name__, torque_scale
        ('NormalTanhSampler', 2.0)
        >>> type(make_head("tanh-bounds", 0.0, nnx.Rngs(0), head="beta")[0]).__name__
        'BetaSampler'
    """
    if head == "beta":
        if bijector != Config.bijector:
            raise ValueError(
                f"the Beta head maps onto [-2, 2] itself and takes no bijector, got "
                f"bijector={bijector!r}; leave --bijector at its default."
            )
        torque = _common.MAX_TORQUE
        beta = samplers.BetaSampler(rngs, entropy_weight, action_dim=1, low=-torque, high=torque)
        return beta, 1.0
    if head != "squashed-normal":
        raise ValueError(f"head must be one of {HEADS}, got {head!r}; pick one of those.")
    if bijector == "tanh-bounds":
        bounds = samplers.BoundedTanh(-_common.MAX_TORQUE, _common.MAX_TORQUE)
        return samplers.SquashedNormalSampler(rngs, entropy_weight, bijector=bounds), 1.0
    if bijector == "tanh":
        return samplers.NormalTanhSampler(rngs, entropy_weight), _common.MAX_TORQUE
    if bijector == "identity":
        identity = distrax.Lambda(lambda x: x)
        return samplers.SquashedNormalSampler(rngs, entropy_weight, bijector=identity), 1.0
    raise ValueError(f"bijector must be one of {BIJECTORS}, got {bijector!r}; pick one of those.")


def _spread(out, torque_scale: float) -> jax.Array:
    """The std of the policy's Normal (before squashing), or of the Beta head's torque."""
    if "sigma" in out.metrics:
        return out.metrics["sigma"][..., 0]
    alpha, beta = out.metrics["alpha"][..., 0], out.metrics["beta"][..., 0]
    total = alpha + beta
    unit_std = jnp.sqrt(alpha * beta / (jnp.square(total) * (total + 1.0)))
    return 2 * _common.MAX_TORQUE * torque_scale * unit_std


def _to_torque(action: jax.Array, torque_scale: float) -> jax.Array:
    return jnp.clip(torque_scale * action, -_common.MAX_TORQUE, _common.MAX_TORQUE)


def make_train_step(config: Config, graphdef, torque_scale: float):
    """Builds the jitted function ``(state, runner) -> (state, runner, metrics)``.

    ``state`` is ``nnx.split((model, optimizer))[1]``; ``runner`` carries the
    environments, their key and the running episode returns. One call collects
    ``rollout_length`` steps from every environment and runs the PPO epochs.
    """
    env, env_params = gymnax.make("Pendulum-v1")
    step_envs = jax.vmap(env.step, in_axes=(0, 0, 0, None))
    batch_size = config.num_envs * config.rollout_length

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
                "sigma": _spread(out, torque_scale),
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
        return _ppo.ppo_loss(out, model.value(batch["obs"]), batch, config)

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
        advantage = _ppo.gae(
            reward,
            value,
            next_value,
            trajectory["done"],
            trajectory["terminated"],
            config.gamma,
            config.gae_lambda,
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
        state, metrics = _ppo.update_epochs(
            loss_fn, graphdef, nnx.state((model, optimizer)), batch, epoch_key, config
        )
        metrics |= {
            "replay_ratio_error": ratio_error,
            "episodes": trajectory["done"].sum(),
            "return_sum": trajectory["finished_return"].sum(),
            "sigma": trajectory["sigma"].mean(),
        }
        runner = (env_state, obs, key, episode_return)
        return state, runner, metrics

    return train_step


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
    _ppo.check_ppo_config(config)
    key = jax.random.key(config.seed)
    head_key, param_key, env_key, runner_key = jax.random.split(key, 4)
    head, torque_scale = make_head(
        config.bijector, config.entropy_weight, nnx.Rngs(head_key), config.head
    )
    model = ActorCritic(head, config.hidden, nnx.Rngs(param_key))

    steps_per_iteration = config.num_envs * config.rollout_length
    iterations = max(1, config.total_steps // steps_per_iteration)
    optimizer = _ppo.ppo_optimizer(model, config, iterations)
    graphdef, state = nnx.split((model, optimizer))

    obs, env_state = _common.reset(env_key, config.num_envs)
    runner = (env_state, obs, runner_key, jnp.zeros(config.num_envs))
    run = _common.run(
        make_train_step(config, graphdef, torque_scale),
        state,
        runner,
        calls=iterations,
        steps_per_call=steps_per_iteration,
        label="PPO",
        column=("std", lambda metrics: f"{metrics['sigma']:.3f}"),
        progress=progress,
    )
    model, _ = nnx.merge(graphdef, run.state)
    log = {
        "steps": iterations * steps_per_iteration,
        "iterations": iterations,
        "curve_steps": run.curve_steps,
        "curve_returns": run.curve_returns,
        "replay_ratio_error": _ppo.largest(m["replay_ratio_error"] for m in run.history),
        "final_sigma": run.history[-1]["sigma"],
        "compile_s": run.compile_s,
        "train_s": run.train_s,
        "steps_per_second": iterations * steps_per_iteration / run.train_s,
        "last_iteration": run.history[-1],
    }
    return model, torque_scale, log


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
        prog="python -m samplers.examples.pendulum",
        description="Train PPO on gymnax Pendulum-v1 with a samplers policy head. The "
        "progress bar shows the mean return of the episodes that ended in the last "
        "iteration and the mean std of the policy's Normal (before squashing).",
        flags={
            "--rollout-length": dict(
                type=int,
                default=defaults.rollout_length,
                help="steps per environment between updates",
            ),
            "--bijector": dict(
                choices=BIJECTORS,
                default=defaults.bijector,
                help="tanh-bounds: BoundedTanh(-2, 2); tanh: tanh, torque = 2 * action; "
                "identity: no squashing, torque = clip(action, -2, 2)",
            ),
            "--head": dict(
                choices=HEADS,
                default=defaults.head,
                help="squashed-normal: a Normal through --bijector; beta: samplers.BetaSampler "
                "on [-2, 2] (the progress bar's std is then the torque's)",
            ),
        },
        out="pendulum-results",
        figure="pendulum.png",
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
    model, torque_scale, log = train(config, progress=not args.no_progress)

    def torque(model: ActorCritic, obs: jax.Array) -> jax.Array:
        return _to_torque(model.policy(obs).output["action"], torque_scale)

    summary = {
        "config": dataclasses.asdict(config),
        "bijector": config.bijector,
        "head": config.head,
        **_common.evaluate(model, torque, num_episodes=config.eval_episodes, seed=config.seed),
        **log,
        "steps_to_minus_200": _common.first_step_at(log, -200.0),
    }
    figure = args.out / "pendulum.png"
    distributions = _common.action_distributions(model.actor, model.head, torque_scale)
    name = "beta" if config.head == "beta" else config.bijector
    _common.plot(figure, summary, distributions, title=f"(a) PPO on Pendulum-v1, {name}")
    reached = summary["steps_to_minus_200"]
    _common.finish(
        summary,
        figure,
        start,
        header=f"Pendulum-v1, {name}, {log['steps']:,} steps, seed {config.seed}",
        details=[
            "training episodes first averaged >= -200 after "
            f"{'-' if reached is None else f'{reached:,}'} steps",
            "replay ratio before the first update: max |ratio - 1| = "
            f"{log['replay_ratio_error']:.1e}",
        ],
    )
    return summary


if __name__ == "__main__":
    main()
