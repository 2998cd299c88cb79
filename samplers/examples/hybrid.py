"""PPO on a hybrid-action task with the composite head that ``samplers.head_for`` builds.

Run ``python -m samplers.examples.hybrid`` (``--help`` lists the flags). The task,
``Reach``, is a small JAX environment defined here: a point on ``[-1, 1]`` must
reach a target. Each step the agent picks a direction and a distance, the gymnasium
action space ``Dict(direction=Discrete(3), distance=Box(0, 1, (1,)))``: the point
moves by ``(direction - 1) * 0.5 * distance`` (left, stay, right; at most half a
unit a step), clipped to the line, and the reward is minus the distance to the
target after the move. An episode is 16 steps from a uniformly random point and
target. Both parts matter: the direction decides where to go, the distance how far,
and an overshoot costs as much as a shortfall.

``samplers.head_for(space, ...)`` builds the head, a :class:`samplers.CompositeSampler`
over a :class:`samplers.CategoricalSampler` and a squashed Normal onto ``[0, 1]``,
and ``head.num_params`` sizes the actor's last layer. The examples' PPO trainer,
``_ppo.train``, keeps the head's summed ``log_likelihood`` and its
``rollout_extras`` (a dict, one entry a part) in the rollout, and the PPO loss
replays that dict under the current weights; the entropy bonus is the head's
``regularization_loss``, the sum of the parts'.

At the end it evaluates the deterministic policy (``model.eval()``: the most
probable direction, and the distance ``f(mean)``), a uniformly random policy and a
hand-written one that moves straight to the target, on the same episodes, prints a
summary, and writes ``hybrid.png`` (learning curve and the learned policy) and
``summary.json`` to ``--out``.
"""

import argparse
import dataclasses
import time
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from gymnasium import spaces

import samplers
from samplers.examples import _common, _ppo

ACTION_SPACE = spaces.Dict(
    {
        "direction": spaces.Discrete(3),
        "distance": spaces.Box(low=0.0, high=1.0, shape=(1,), dtype=np.float32),
    }
)
MAX_MOVE = 0.5
EPISODE_LENGTH = 16
DIRECTIONS = ("left", "stay", "right")


class Reach(NamedTuple):
    """The state of one ``Reach`` environment."""

    position: jax.Array
    target: jax.Array
    time: jax.Array


def reset(key: jax.Array) -> tuple[jax.Array, Reach]:
    """``(obs, state)`` of a fresh environment: a uniform point and target on ``[-1, 1]``."""
    position, target = jax.random.uniform(key, (2,), minval=-1.0, maxval=1.0)
    state = Reach(position, target, jnp.zeros((), jnp.int32))
    return observe(state), state


def observe(state: Reach) -> jax.Array:
    """``[position, target, target - position, time left]``, each within ``[-2, 2]``."""
    left = 1.0 - state.time / EPISODE_LENGTH
    return jnp.stack([state.position, state.target, state.target - state.position, left])


def step(state: Reach, action: dict) -> tuple[jax.Array, Reach, jax.Array, jax.Array]:
    """``(obs, state, reward, done)`` after one action ``{"direction", "distance"}``.

    ``done`` is True after ``EPISODE_LENGTH`` steps; ``obs`` and ``state`` are then
    those of the finished episode (the caller resets).

    Example:
        >>> import jax.numpy as jnp
        >>> state = Reach(jnp.float32(0.0), jnp.float32(0.3), jnp.int32(0))
        >>> _, state, reward, done = step(state, {"direction": 2, "distance": jnp.array([0.6])})
        >>> float(state.position), round(float(reward), 6), bool(done)
        (0.3, -0.0, False)
    """
    move = (jnp.asarray(action["direction"]) - 1) * MAX_MOVE * action["distance"][..., 0]
    position = jnp.clip(state.position + move, -1.0, 1.0)
    state = Reach(position, state.target, state.time + 1)
    reward = -jnp.abs(state.target - position)
    return observe(state), state, reward, state.time >= EPISODE_LENGTH


def straight_to_target(obs: jax.Array) -> dict:
    """The hand-written policy: towards the target, exactly as far as it is (capped)."""
    offset = obs[..., 2]
    direction = jnp.where(offset > 0, 2, jnp.where(offset < 0, 0, 1))
    distance = jnp.clip(jnp.abs(offset) / MAX_MOVE, 0.0, 1.0)
    return {"direction": direction, "distance": distance[..., None]}


def env_step(key: jax.Array, state: Reach, action: dict) -> _ppo.Step:
    """:func:`step`, then a fresh episode from ``key`` if this one ended.

    The time left is part of the observation, so an episode's end is terminal.
    """
    obs, state, reward, done = step(state, action)
    fresh_obs, fresh = reset(key)
    next_state = jax.tree.map(lambda f, s: jnp.where(done, f, s), fresh, state)
    return _ppo.Step(next_state, jnp.where(done, fresh_obs, obs), reward, done, done, obs, {})


@dataclasses.dataclass(frozen=True)
class Config(_ppo.Config):
    """Hyperparameters: ``_ppo.Config``'s with Reach's defaults.

    The command-line flags override ``total_steps``, ``seed``, ``num_envs`` and
    ``eval_episodes``.
    """

    eval_episodes: int = 256
    gamma: float = 0.95
    entropy_weight: float = 0.003


def train(config: Config, *, progress: bool = True) -> tuple[_ppo.ActorCritic, dict]:
    """Trains the actor-critic on ``Reach`` with ``_ppo.train``; returns ``(model, log)``.

    The progress bar shows the fraction of the last epoch's ratios that were clipped.
    """

    def make_model(sampling_rngs: nnx.Rngs, rngs: nnx.Rngs) -> _ppo.ActorCritic:
        # A Dict space gets a CompositeSampler.
        head = samplers.head_for(
            ACTION_SPACE, rngs=sampling_rngs, entropy_weight=config.entropy_weight
        )
        return _ppo.ActorCritic(4, head, hidden=config.hidden, rngs=rngs)

    return _ppo.train(
        config,
        make_model,
        _ppo.Env(reset, env_step),
        column=("clip", lambda metrics: f"{metrics['clip_fraction']:.3f}"),
        progress=progress,
    )


def evaluate(model: _ppo.ActorCritic, *, num_episodes: int, seed: int) -> dict:
    """Mean and std of the episode return of three policies on the same episodes.

    The deterministic policy (``model.eval()``), a uniformly random one (direction
    uniform, distance uniform on ``[0, 1]``) and :func:`straight_to_target` play
    ``num_episodes`` episodes from the same initial states.
    """
    keys = jax.random.split(jax.random.key(seed + 1), num_episodes)
    model.eval()
    graphdef, state = nnx.split(model)

    @jax.jit
    def play(model_state, policy_index: jax.Array, key: jax.Array) -> jax.Array:
        obs, env_state = jax.vmap(reset)(keys)

        def one_step(carry, step_key):
            model_state, obs, env_state = carry
            model = nnx.merge(graphdef, model_state)
            direction_key, distance_key = jax.random.split(step_key)
            random = {
                "direction": jax.random.randint(direction_key, (num_episodes,), 0, 3),
                "distance": jax.random.uniform(distance_key, (num_episodes, 1)),
            }
            actions = (model.policy(obs).output["action"], random, straight_to_target(obs))
            action = jax.tree.map(lambda *choices: jnp.stack(choices)[policy_index], *actions)
            obs, env_state, reward, _ = jax.vmap(step)(env_state, action)
            return (nnx.state(model), obs, env_state), reward

        carry = (model_state, obs, env_state)
        _, rewards = jax.lax.scan(one_step, carry, jax.random.split(key, EPISODE_LENGTH))
        return rewards.sum(axis=0)

    key = jax.random.key(seed + 2)
    returns = [np.asarray(play(state, jnp.int32(i), key)) for i in range(3)]
    model.train()
    summary = {}
    for name, values in zip(("deterministic", "random", "straight"), returns, strict=True):
        summary[f"{name}_return"] = float(values.mean())
        summary[f"{name}_return_std"] = float(values.std())
    return summary


def learned_policy(model: _ppo.ActorCritic, *, num_samples: int = 4_000) -> dict:
    """The trained policy at the centre of the line, as a function of the target.

    For targets on a grid and the point at 0 (half the episode left): the head's
    probability of each direction and the mean distance of its samples, beside the
    deterministic distance and :func:`straight_to_target`'s.
    """
    targets = jnp.linspace(-1.0, 1.0, 41)
    obs = jax.vmap(lambda t: observe(Reach(jnp.float32(0.0), t, jnp.int32(EPISODE_LENGTH // 2))))(
        targets
    )
    out = model.policy(jnp.repeat(obs, num_samples, axis=0))
    action = jax.tree.map(lambda x: x.reshape(len(targets), num_samples, *x.shape[1:]), out.output)
    direction = action["action"]["direction"]
    model.eval()
    deterministic = model.policy(obs).output["action"]
    model.train()
    return {
        "target": np.asarray(targets),
        "direction_frequency": np.stack(
            [np.asarray((direction == d).mean(axis=1)) for d in range(3)], axis=1
        ),
        "mean_distance": np.asarray(action["action"]["distance"][..., 0].mean(axis=1)),
        "deterministic_distance": np.asarray(deterministic["distance"][:, 0]),
        "straight_distance": np.asarray(straight_to_target(obs)["distance"][:, 0]),
    }


def plot(path, summary: dict, policy: dict) -> None:
    """Writes the learning curve and the learned policy at the centre of the line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (curve, directions) = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    curve.plot(summary["curve_steps"], summary["curve_returns"], label="training episodes")
    for name, style in (("deterministic", "-"), ("straight", "--"), ("random", ":")):
        curve.axhline(summary[f"{name}_return"], color="k", linestyle=style, label=name)
    curve.xaxis.set_major_formatter(lambda x, _: f"{x / 1000:.0f}k")
    curve.set_xlabel("environment steps")
    curve.set_ylabel("return per episode")
    curve.set_title("(a) PPO on Reach, Dict(Discrete(3), Box(0, 1))")
    curve.legend(loc="lower right", fontsize="small")

    for index, name in enumerate(DIRECTIONS):
        directions.plot(policy["target"], policy["direction_frequency"][:, index], label=name)
    directions.plot(policy["target"], policy["mean_distance"], "k-", label="mean distance")
    directions.plot(
        policy["target"], policy["deterministic_distance"], "k.", label="eval() distance"
    )
    directions.plot(
        policy["target"], policy["straight_distance"], "k--", label="straight to target"
    )
    directions.set_xlabel("target (the point at 0, half the episode left)")
    directions.set_ylabel("direction frequency / distance")
    directions.set_title("(b) the learned policy")
    directions.legend(loc="center right", fontsize="small")
    figure.savefig(path, dpi=110)
    plt.close(figure)


def parse_args(argv: Sequence[str] | None = None) -> tuple[Config, argparse.Namespace]:
    """The config a command line asks for, and its other arguments."""
    return _common.command_line(
        argv,
        Config(),
        prog="python -m samplers.examples.hybrid",
        description="Train PPO on Reach, a hybrid-action task (a direction and a distance), "
        "with the composite head samplers.head_for builds for its Dict action space.",
        flags={},
        out="hybrid-results",
        figure="hybrid.png",
    )


def main(argv: Sequence[str] | None = None) -> dict:
    """Trains, evaluates, prints a summary and writes the figure and ``summary.json``."""
    config, args = parse_args(argv)
    start = time.perf_counter()
    model, log = train(config, progress=not args.no_progress)
    summary = {
        "config": dataclasses.asdict(config),
        **evaluate(model, num_episodes=config.eval_episodes, seed=config.seed),
        **log,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    figure = args.out / "hybrid.png"
    plot(figure, summary, learned_policy(model))
    _common.finish(
        summary,
        figure,
        start,
        header=f"Reach (hybrid actions), {log['steps']:,} steps, seed {config.seed}",
        details=[
            f"straight to target:   {summary['straight_return']:8.2f} "
            f"+- {summary['straight_return_std']:.2f} per episode",
            _ppo.replay_line(log),
        ],
    )
    return summary


if __name__ == "__main__":
    main()
