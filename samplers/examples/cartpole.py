"""PPO on gymnax's ``CartPole-v1`` with :class:`samplers.CategoricalSampler`.

Run ``python -m samplers.examples.cartpole`` (``--help`` lists the flags). A small
actor-critic (two MLPs, one for the two actions' logits and one for the value) is
trained with PPO on vectorised environments. The policy head is a
:class:`samplers.CategoricalSampler`: the rollout keeps the head's
``log_likelihood`` as the old log-probability and its ``rollout_extras`` (the
action taken), and the PPO loss replays that stored action under the current
weights; the entropy bonus is the head's ``regularization_loss``. One jitted
function does a whole iteration: the rollout of all environments and several
epochs of minibatch updates.

At the end it evaluates the deterministic policy (``model.eval()``, the most
probable action) against a uniformly random policy on the same episodes, prints a
summary, and writes ``cartpole.png`` (learning curve and the learned action
probabilities in a few states) and ``summary.json`` to ``--out``. An episode ends
when the pole falls or the cart leaves the track, and after 500 steps at most: the
maximum return is 500.
"""

import argparse
import dataclasses
import math
import time
from collections.abc import Sequence

import gymnax
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import samplers
from samplers.examples import _common, _ppo

ENV_ID = "CartPole-v1"
MAX_RETURN = 500.0
# States (cart position, cart velocity, pole angle, pole angular velocity) whose
# action probabilities are drawn, the cart at rest in the middle: the pole upright
# and still, tilted 2 degrees right and still, upright and falling right.
PROBE_STATES = (
    (0.0, 0.0, 0.0, 0.0),
    (0.0, 0.0, math.radians(2.0), 0.0),
    (0.0, 0.0, 0.0, 0.1),
)
ACTIONS = ("push left", "push right")


@dataclasses.dataclass(frozen=True)
class Config:
    """Hyperparameters; the command-line flags override the first few.

    The budget is ``total_steps`` environment steps, done in iterations of
    ``num_envs * rollout_length`` steps, each followed by ``epochs`` passes of
    ``minibatches`` updates over that batch.
    """

    total_steps: int = 150_000
    seed: int = 0
    num_envs: int = 8
    rollout_length: int = 128
    entropy_weight: float = 0.01
    eval_episodes: int = 64
    epochs: int = 4
    minibatches: int = 4
    gamma: float = 0.99
    gae_lambda: float = 0.95
    learning_rate: float = 1e-3
    clip_epsilon: float = 0.2
    value_weight: float = 0.5
    max_grad_norm: float = 0.5
    # A reward of 1 per step makes values near 1 / (1 - gamma) = 100; a tenth keeps
    # the value loss from taking the whole gradient-norm budget.
    reward_scale: float = 0.1
    hidden: int = 64


class ActorCritic(nnx.Module):
    """Two tanh MLPs on the observation, and the sampler as the policy's last layer.

    Args:
        head: The policy head; it owns the sampling stream.
        hidden: Width of the hidden layers.
        rngs: Initialisation stream for the weights.
    """

    def __init__(self, head: samplers.CategoricalSampler, hidden: int, rngs: nnx.Rngs):
        # A small last layer starts the policy near uniform in every state.
        self.actor = _ppo.tanh_mlp(4, head.num_params, hidden=hidden, last_scale=0.01, rngs=rngs)
        self.critic = _ppo.tanh_mlp(4, 1, hidden=hidden, last_scale=1.0, rngs=rngs)
        self.head = head

    def policy(self, obs: jax.Array, action: jax.Array | None = None):
        """The head's output for ``obs``: a fresh action, or a replay of ``action``."""
        return self.head((), self.actor(obs), action)

    def entropy(self, obs: jax.Array) -> jax.Array:
        """The policy's entropy in nats, shape ``obs.shape[:-1]``."""
        return jnp.asarray(self.head.distribution(self.actor(obs)).entropy())

    def value(self, obs: jax.Array) -> jax.Array:
        """State values, shape ``obs.shape[:-1]``."""
        return self.critic(obs)[..., 0]


def make_train_step(config: Config, graphdef):
    """Builds the jitted function ``(state, runner) -> (state, runner, metrics)``.

    ``state`` is ``nnx.split((model, optimizer))[1]``; ``runner`` carries the
    environments, their key and the running episode returns. One call collects
    ``rollout_length`` steps from every environment and runs the PPO epochs.
    """
    env, env_params = gymnax.make(ENV_ID)
    step_envs = jax.vmap(env.step, in_axes=(0, 0, 0, None))
    batch_size = config.num_envs * config.rollout_length

    def rollout(model, runner):
        model_def, model_state = nnx.split(model)

        def env_step(carry, _):
            model_state, env_state, obs, key, episode_return = carry
            model = nnx.merge(model_def, model_state)
            out = model.policy(obs)
            key, step_key = jax.random.split(key)
            step_keys = jax.random.split(step_key, config.num_envs)
            next_obs, env_state, reward, terminated, truncated, info = step_envs(
                step_keys, env_state, out.output["action"], env_params
            )
            done = jnp.logical_or(terminated, truncated)
            episode_return = episode_return + reward
            transition = {
                "obs": obs,
                "action": out.rollout_extras,
                "log_prob": out.output["log_likelihood"],
                "reward": reward,
                "done": done,
                "terminated": terminated,
                "final_obs": info["final_observation"],
                "finished_return": jnp.where(done, episode_return, 0.0),
                "entropy": model.entropy(obs),
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
        # Replay: the head scores the stored action under the current weights.
        out = model.policy(batch["obs"], batch["action"])
        # The entropy term is the head's regularization_loss, -entropy_weight times
        # the policy's entropy in each state.
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
        advantage = _ppo.gae(
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
            "action": trajectory["action"],
            "log_prob": trajectory["log_prob"],
            "advantage": advantage,
            "target": advantage + value,
        }
        batch = jax.tree.map(lambda x: x.reshape(batch_size, *x.shape[2:]), batch)
        # Before any update the weights are those of the rollout, so replaying the
        # stored actions must give a ratio of 1 up to the rounding of the network.
        replay = model.policy(batch["obs"], batch["action"])
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
            "entropy": trajectory["entropy"].mean(),
        }
        runner = (env_state, obs, key, episode_return)
        return state, runner, metrics

    return train_step


def train(config: Config, *, progress: bool = True) -> tuple[ActorCritic, dict]:
    """Trains the actor-critic for ``config.total_steps`` environment steps.

    Args:
        config: Hyperparameters.
        progress: Show a live progress bar.

    Returns:
        ``(model, log)``: ``log`` holds the learning curve (``curve_steps``,
        ``curve_returns``: mean return of the episodes that ended in each
        iteration), ``replay_ratio_error`` (the largest ``|ratio - 1|`` of the
        replay before each iteration's first update, over all iterations), the
        timings and the last iteration's losses.
    """
    _ppo.check_ppo_config(config)
    key = jax.random.key(config.seed)
    head_key, param_key, env_key, runner_key = jax.random.split(key, 4)
    head = samplers.CategoricalSampler(
        nnx.Rngs(head_key), config.entropy_weight, num_actions=len(ACTIONS)
    )
    model = ActorCritic(head, config.hidden, nnx.Rngs(param_key))

    steps_per_iteration = config.num_envs * config.rollout_length
    iterations = max(1, config.total_steps // steps_per_iteration)
    optimizer = _ppo.ppo_optimizer(model, config, iterations)
    graphdef, state = nnx.split((model, optimizer))

    obs, env_state = _common.reset(env_key, config.num_envs, ENV_ID)
    runner = (env_state, obs, runner_key, jnp.zeros(config.num_envs))
    run = _common.run(
        make_train_step(config, graphdef),
        state,
        runner,
        calls=iterations,
        steps_per_call=steps_per_iteration,
        label="PPO",
        column=("entropy", lambda metrics: f"{metrics['entropy']:.3f}"),
        progress=progress,
    )
    model, _ = nnx.merge(graphdef, run.state)
    log = {
        "steps": iterations * steps_per_iteration,
        "iterations": iterations,
        "curve_steps": run.curve_steps,
        "curve_returns": run.curve_returns,
        "replay_ratio_error": _ppo.largest(m["replay_ratio_error"] for m in run.history),
        "final_entropy": run.history[-1]["entropy"],
        "compile_s": run.compile_s,
        "train_s": run.train_s,
        "steps_per_second": iterations * steps_per_iteration / run.train_s,
        "last_iteration": run.history[-1],
    }
    return model, log


def action_probabilities(model: ActorCritic, *, num_samples: int = 20_000) -> list[dict]:
    """Sampled actions and the head's probabilities in each of ``PROBE_STATES``.

    The samples come from the head in training mode; the probabilities are
    ``exp(log_prob)`` of each action under the head's distribution object, and the
    deterministic action is the head's output with ``deterministic=True``.

    Args:
        model: The trained actor-critic; one call draws the samples from its stream.
        num_samples: Samples per state.

    Returns:
        A list of dicts with ``state``, ``frequency`` (of each action among the
        samples), ``probability`` and ``deterministic`` (an action index).
    """

    @nnx.jit
    def probe(model: ActorCritic):
        logits = model.actor(jnp.asarray(PROBE_STATES))
        shape = (num_samples, *logits.shape)
        sampled = model.head((), jnp.broadcast_to(logits, shape)).output["action"]
        actions = jnp.arange(len(ACTIONS))[:, None]
        dist = model.head.distribution(jnp.broadcast_to(logits, (len(ACTIONS), *logits.shape)))
        log_prob = dist.log_prob(jnp.broadcast_to(actions, dist.batch_shape))
        mode = model.head((), logits, deterministic=True).output["action"]
        return sampled, jnp.exp(log_prob).T, mode

    sampled, probability, mode = jax.device_get(probe(model))
    return [
        {
            "state": state,
            "frequency": np.bincount(sampled[:, i], minlength=len(ACTIONS)) / num_samples,
            "probability": probability[i],
            "deterministic": int(mode[i]),
        }
        for i, state in enumerate(PROBE_STATES)
    ]


def _probability_panels(axes, probabilities: list[dict]) -> None:
    """Sampled frequencies against ``exp(log_prob)``, the deterministic action hatched."""
    where = np.arange(len(ACTIONS))
    for ax, probe in zip(axes, probabilities, strict=True):
        hatches = ["//" if a == probe["deterministic"] else "" for a in range(len(ACTIONS))]
        ax.bar(
            where,
            probe["frequency"],
            width=0.6,
            color="C0",
            alpha=0.5,
            hatch=hatches,
            edgecolor="C2",
            label="sampled frequency (hatched: deterministic)",
        )
        ax.scatter(where, probe["probability"], color="C1", marker="_", s=900, linewidths=2.5)
        ax.scatter([], [], color="C1", marker="_", s=200, label="exp(log_prob)")
        for a, p in zip(where, probe["probability"], strict=True):
            ax.annotate(f"{p:.3f}", (a, p), xytext=(0, 6), textcoords="offset points", ha="center")
        ax.set_xticks(where, ACTIONS)
        ax.set_xlabel("action (cart at rest mid-track)")
        ax.set_ylim(0, 1.25)
        _, _, angle, angular_velocity = probe["state"]
        ax.set_title(f"pole {math.degrees(angle):+.0f} deg, {angular_velocity:+.1f} rad/s")
    axes[0].set_ylabel("(b) probability of the learned action")
    axes[0].legend(loc="upper left", fontsize="small")


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
        prog="python -m samplers.examples.cartpole",
        description="Train PPO on gymnax CartPole-v1 with samplers.CategoricalSampler. "
        "The progress bar shows the mean return of the episodes that ended in the last "
        "iteration and the policy's mean entropy in nats (log 2 = 0.693 is uniform).",
        flags={
            "--rollout-length": dict(
                type=int,
                default=defaults.rollout_length,
                help="steps per environment between updates",
            ),
            "--entropy-weight": dict(
                type=float,
                default=defaults.entropy_weight,
                help="weight of the head's entropy bonus",
            ),
        },
        out="cartpole-results",
        figure="cartpole.png",
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
    model, log = train(config, progress=not args.no_progress)

    def act(model: ActorCritic, obs: jax.Array) -> jax.Array:
        return model.policy(obs).output["action"]

    summary = {
        "config": dataclasses.asdict(config),
        **_common.evaluate(
            model, act, num_episodes=config.eval_episodes, seed=config.seed, env_id=ENV_ID
        ),
        **log,
        "steps_to_500": _common.first_step_at(log, MAX_RETURN),
    }
    figure = args.out / "cartpole.png"
    _common.plot(
        figure,
        summary,
        action_probabilities(model),
        title="(a) PPO on CartPole-v1, CategoricalSampler",
        draw=_probability_panels,
        episode="at most 500 steps",
    )
    reached = summary["steps_to_500"]
    _common.finish(
        summary,
        figure,
        start,
        header=f"CartPole-v1, {log['steps']:,} steps, seed {config.seed}",
        details=[
            "training episodes first averaged 500 (the maximum) after "
            f"{'-' if reached is None else f'{reached:,}'} steps",
            "replay ratio before the first update: max |ratio - 1| = "
            f"{log['replay_ratio_error']:.1e}",
            f"policy entropy at the end {log['final_entropy']:.3f} nats (uniform: 0.693)",
        ],
    )
    return summary


if __name__ == "__main__":
    main()
