"""The games of ``samplers.examples.correlated``: their rewards, the independent heads'
ceiling against the game itself, and a short training run of each head (slow tier)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from samplers.examples import correlated

pytestmark = pytest.mark.slow


def _play(game: str, policy, steps: int, envs: int = 2048, seed: int = 0) -> np.ndarray:
    """Rewards of a policy ``(key, obs) -> {"first", "second"}`` in ``envs`` games."""
    env = correlated.make_env(game)
    keys = jax.random.split(jax.random.key(seed), 3)
    obs, state = jax.vmap(env.reset)(jax.random.split(keys[0], envs))

    def one(carry, key):
        obs, state = carry
        act_key, step_key = jax.random.split(key)
        action = policy(act_key, obs)
        step = jax.vmap(env.step)(jax.random.split(step_key, envs), state, action)
        return (step.obs, step.state), step.reward

    _, rewards = jax.lax.scan(one, (obs, state), jax.random.split(keys[1], steps))
    return np.asarray(rewards)


def _independent(p: float, q: float):
    def policy(key, obs):
        a, b = jax.random.split(key)
        n = obs.shape[0]
        return {
            "first": jax.random.bernoulli(a, p, (n,)).astype(jnp.int32),
            "second": jax.random.bernoulli(b, q, (n,)).astype(jnp.int32),
        }

    return policy


def test_the_games_reward_as_documented():
    env = correlated.make_env("guess")
    state = correlated.Game(jnp.array([1, 1, 1, 0, 0]), jnp.int32(0), jnp.int32(0))
    # The opponent guesses 1 (three of five): first = 0 beats it, second = 0 agrees.
    step = env.step(jax.random.key(0), state, {"first": 0, "second": 0})
    assert float(step.reward) == 2.0
    assert np.array_equal(step.state.history, [1, 1, 0, 0, 0])
    step = env.step(jax.random.key(0), state, {"first": 1, "second": 0})
    assert float(step.reward) == 0.0
    env = correlated.make_env("correlated")
    state = correlated.Game(jnp.zeros(5, jnp.int32), jnp.int32(1), jnp.int32(0))
    assert float(env.step(jax.random.key(0), state, {"first": 1, "second": 1}).reward) == 10.0
    assert float(env.step(jax.random.key(0), state, {"first": 0, "second": 1}).reward) == 0.0


def test_independent_bits_score_as_the_formula_and_the_best_policy_reaches_one_and_a_half():
    steps = 256
    for p in (0.5, 0.6, 0.7, 0.8, 0.9, 1.0):
        rewards = _play("guess", _independent(p, float(p >= 0.5)), steps)[32:]
        per_game = rewards.mean(0)
        error = per_game.std() / np.sqrt(per_game.size)
        assert abs(per_game.mean() - correlated.independent_value(p)) < 4 * error + 1e-3, p
        assert per_game.mean() <= correlated.independent_ceiling() + 4 * error + 1e-3

    def best_policy(key, obs):
        first = jax.random.bernoulli(key, 0.5, (obs.shape[0],)).astype(jnp.int32)
        return {"first": first, "second": first}

    assert abs(_play("guess", best_policy, steps).mean() - 1.5) < 0.01


@pytest.mark.parametrize("head", ["autoregressive", "independent"])
def test_ppo_separates_the_heads_on_the_guessing_game(head, tmp_path):
    summary = correlated.main(
        ["--total-steps", "60000", "--head", head, "--no-progress", "--out", str(tmp_path)]
    )
    ceiling = correlated.independent_ceiling()
    if head == "autoregressive":
        assert summary["reward_per_step"] > ceiling + 0.25
    else:
        assert summary["reward_per_step"] < ceiling + 0.02
