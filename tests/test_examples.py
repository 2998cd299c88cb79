import json
import math

import gymnax
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


def test_pendulum_sac_stores_the_observation_before_the_reset_and_not_the_time_limit():
    env, params = gymnax.make("Pendulum-v1")
    obs, state = env.reset(jax.random.key(0), params)
    state = state.replace(time=params.max_steps_in_episode - 1)
    torque = jnp.array([0.5])
    next_obs, _, reward, _, _, info = env.step(jax.random.key(1), state, torque, params)
    stored = pendulum_sac.transitions(obs, torque, reward, info)

    # The step hit the time limit, so gymnax returned the next episode's first observation.
    assert bool(info["truncated"]) and not jnp.allclose(next_obs, info["final_observation"])
    assert jnp.array_equal(stored["next_obs"], info["final_observation"])
    assert stored["terminated"] == 0.0


def test_pendulum_sac_critic_loss_is_the_soft_bellman_error_cut_only_at_terminal_states():
    config = pendulum_sac.Config()
    actor = pendulum_sac.Actor(16, nnx.Rngs(0), nnx.Rngs(1))
    critic = pendulum_sac.TwinCritic(16, nnx.Rngs(2))
    target = pendulum_sac.TwinCritic(16, nnx.Rngs(3))
    keys = jax.random.split(jax.random.key(4), 4)
    batch = {
        "obs": jax.random.normal(keys[0], (8, 3)),
        "torque": jax.random.uniform(keys[1], (8, 1), minval=-2.0, maxval=2.0),
        "reward": jax.random.uniform(keys[2], (8,), minval=-16.0, maxval=0.0),
        "next_obs": jax.random.normal(keys[3], (8, 3)),
        "terminated": jnp.array([1.0, 0.0] * 4),
    }
    alpha = 0.3
    # A copy of the actor continues the same stream: it draws the loss's next torques.
    next_action = nnx.clone(actor)(batch["next_obs"]).output
    next_q = jnp.minimum(*target(batch["next_obs"], next_action["action"]))
    soft_value = next_q - alpha * next_action["log_likelihood"]
    reward = config.reward_scale * batch["reward"]
    y = reward + config.gamma * jnp.array([0.0, 1.0] * 4) * soft_value
    q1, q2 = critic(batch["obs"], batch["torque"])
    expected = 0.5 * (jnp.square(q1 - y) + jnp.square(q2 - y)).mean()

    loss, _ = pendulum_sac.critic_loss(critic, target, actor, alpha, batch, config)
    assert jnp.allclose(loss, expected, rtol=1e-6, atol=0.0)
    # Bootstrapping matters on the non-terminal rows: the loss without it differs.
    no_bootstrap = 0.5 * (jnp.square(q1 - reward) + jnp.square(q2 - reward)).mean()
    assert not jnp.allclose(loss, no_bootstrap, rtol=1e-3)
