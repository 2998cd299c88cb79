import json
import math

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import samplers
from samplers.examples import pendulum, pendulum_sac

TINY = [
    "--total-steps",
    "1024",
    "--num-envs",
    "8",
    "--rollout-length",
    "32",
    "--seed",
    "3",
    "--eval-episodes",
    "4",
]


@pytest.mark.parametrize("bijector", pendulum.BIJECTORS)
def test_pendulum_runs_writes_its_figure_and_replays_with_ratio_one(tmp_path, bijector):
    summary = pendulum.main(
        [*TINY, "--bijector", bijector, "--out", str(tmp_path), "--no-progress"]
    )

    figure = tmp_path / "pendulum.png"
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 1024
    assert summary["iterations"] == 4
    # Before the first update of each iteration the weights are the rollout's, so
    # replaying the stored pre-images must reproduce the stored log-likelihoods.
    assert summary["replay_ratio_error"] < 1e-5
    # An episode lasts 200 steps: every return lies in [-16.3 * 200, 0].
    for name in ("deterministic_return", "random_return"):
        assert -3300 < summary[name] <= 0, name
    assert summary["final_sigma"] > 0 and summary["steps_per_second"] > 0


def test_pendulum_refuses_a_batch_that_minibatches_do_not_divide(tmp_path):
    with pytest.raises(ValueError, match=r"divisible by minibatches=8, got 3 \* 30 = 90"):
        pendulum.main(["--num-envs", "3", "--rollout-length", "30", "--out", str(tmp_path)])


SAC_TINY = [
    "--total-steps",
    "400",
    "--num-envs",
    "4",
    "--steps-per-call",
    "10",
    "--warmup-steps",
    "200",
    "--hidden",
    "16",
    "--seed",
    "3",
    "--eval-episodes",
    "4",
]


def test_pendulum_sac_runs_writes_its_figure_and_learns_the_temperature(tmp_path):
    summary = pendulum_sac.main([*SAC_TINY, "--out", str(tmp_path), "--no-progress"])

    figure = tmp_path / "pendulum_sac.png"
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["steps"] == 400 and written["figure"] == str(figure)
    for name in ("deterministic", "random"):
        assert math.isfinite(written[f"{name}_return"] + written[f"{name}_return_std"]), name
    assert written["config"]["warmup_steps"] == 200 and written["steps_per_second"] > 0
    # 10 calls of 10 steps of 4 environments; the first 200 environment steps
    # (50 steps of all environments) take random torques and update nothing.
    assert summary["calls"] == 10
    assert summary["updates"] == 50
    last = summary["last_update"]
    assert all(math.isfinite(value) for value in last.values()), last
    # The policy starts far above the target entropy of -1, so alpha falls from 1.
    assert 0 < last["alpha"] < 1.0
    # An episode lasts 200 steps: every return lies in [-16.3 * 200, 0].
    for name in ("deterministic_return", "random_return"):
        assert -16.3 * 200 <= summary[name] <= 0, name


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_envs": 0}, r"num_envs must be >= 1, got 0"),
        ({"batch_size": 0}, r"batch_size must be >= 1, got 0"),
        ({"warmup_steps": -1}, r"warmup_steps must be >= 0, got -1"),
        ({"buffer_size": 4}, r"got buffer_size=4 < num_envs=8; raise buffer_size"),
    ],
    ids=["num_envs", "batch_size", "warmup_steps", "buffer_size"],
)
def test_pendulum_sac_refuses_a_bad_config(overrides, message):
    with pytest.raises(ValueError, match=message):
        pendulum_sac.train(pendulum_sac.Config(**overrides), progress=False)


def test_pendulum_sac_actor_gradient_reaches_the_network_through_the_sampled_torque():
    actor = pendulum_sac.Actor(16, nnx.Rngs(0), nnx.Rngs(1))
    critic = pendulum_sac.TwinCritic(16, nnx.Rngs(2))
    theta = jnp.linspace(-3.0, 3.0, 32)
    obs = jnp.stack([jnp.cos(theta), jnp.sin(theta), jnp.zeros_like(theta)], axis=-1)

    def critic_term(actor):
        # The example's actor loss at alpha = 0, -min_i Q_i(s, a): only dQ/da can
        # carry a gradient to the actor.
        return pendulum_sac.actor_loss(actor, critic, 0.0, obs)[0]

    def largest(grads):
        return max(float(jnp.abs(leaf).max()) for leaf in jax.tree.leaves(grads))

    assert largest(nnx.grad(critic_term)(actor)) > 1e-4
    # The default (PPO) head stops the gradient at a fresh sample: the same loss
    # would give the actor nothing to climb the critic with.
    actor.head = samplers.SquashedNormalSampler(
        nnx.Rngs(1), 0.0, bijector=samplers.BoundedTanh(-2.0, 2.0)
    )
    assert largest(nnx.grad(critic_term)(actor)) == 0.0
