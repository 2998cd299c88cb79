"""PPO on gymnax's ``CartPole-v1`` with :class:`samplers.CategoricalSampler`.

Run ``python -m samplers.examples.cartpole`` (``--help`` lists the flags). A small
actor-critic (two MLPs, one for the two actions' logits and one for the value) is
trained by the examples' PPO trainer, ``_ppo.train``, on vectorised environments.
The policy head is a :class:`samplers.CategoricalSampler`: the rollout keeps the
head's ``log_likelihood`` as the old log-probability and its ``rollout_extras``
(the action taken), and the PPO loss replays that stored action under the current
weights; the entropy bonus is the head's ``regularization_loss``.

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
class Config(_ppo.Config):
    """Hyperparameters: ``_ppo.Config``'s with CartPole's defaults.

    The command-line flags override ``total_steps``, ``seed``, ``num_envs``,
    ``rollout_length``, ``entropy_weight`` and ``eval_episodes``.
    """

    total_steps: int = 150_000
    num_envs: int = 8
    rollout_length: int = 128
    # A reward of 1 per step makes values near 1 / (1 - gamma) = 100; a tenth keeps
    # the value loss from taking the whole gradient-norm budget.
    reward_scale: float = 0.1


def _entropy(model: _ppo.ActorCritic, obs: jax.Array, out) -> dict[str, jax.Array]:
    """The policy's entropy in nats in each state of a rollout step."""
    return {"entropy": jnp.asarray(model.head.distribution(model.actor(obs)).entropy())}


def train(config: Config, *, progress: bool = True) -> tuple[_ppo.ActorCritic, dict]:
    """Trains the actor-critic on ``CartPole-v1`` with ``_ppo.train``.

    Args:
        config: Hyperparameters.
        progress: Show a live progress bar.

    Returns:
        ``(model, log)``: ``_ppo.train``'s log, whose ``per_iteration`` has
        ``entropy`` (the policy's mean entropy over the rollout), and
        ``final_entropy``, the last iteration's.
    """

    def make_model(sampling_rngs: nnx.Rngs, rngs: nnx.Rngs) -> _ppo.ActorCritic:
        head = samplers.CategoricalSampler(
            sampling_rngs, config.entropy_weight, num_actions=len(ACTIONS)
        )
        return _ppo.ActorCritic(4, head, hidden=config.hidden, rngs=rngs)

    model, log = _ppo.train(
        config,
        make_model,
        _ppo.gymnax_env(ENV_ID),
        column=("entropy", lambda metrics: f"{metrics['entropy']:.3f}"),
        rollout_metrics=_entropy,
        progress=progress,
    )
    log["final_entropy"] = log["last_iteration"]["entropy"]
    return model, log


def action_probabilities(model: _ppo.ActorCritic, *, num_samples: int = 20_000) -> list[dict]:
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
    def probe(model: _ppo.ActorCritic):
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

    def act(model: _ppo.ActorCritic, obs: jax.Array) -> jax.Array:
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
            _ppo.replay_line(log),
            f"policy entropy at the end {log['final_entropy']:.3f} nats (uniform: 0.693)",
        ],
    )
    return summary


if __name__ == "__main__":
    main()
