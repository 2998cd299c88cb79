"""The game of ``samplers.examples.units``: its rules against a plain loop, each head's
mask, and a short training run of each head (slow tier)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from samplers.examples import units

pytestmark = pytest.mark.slow


def _legal_by_loop(cells) -> np.ndarray:
    legal = np.zeros((units.UNITS, 4), bool)
    for u, (dr, dc) in itertools.product(range(units.UNITS), units.MOVES.tolist()):
        row, col = divmod(int(cells[u]), units.SIZE)
        to = (row + dr) * units.SIZE + col + dc
        on_board = 0 <= row + dr < units.SIZE and 0 <= col + dc < units.SIZE
        legal[u, units.MOVES.tolist().index([dr, dc])] = on_board and to not in cells.tolist()
    return legal


def test_legal_moves_and_each_heads_mask_follow_the_rules():
    for seed in range(50):
        cells = np.asarray(jax.random.choice(jax.random.key(seed), 16, (units.UNITS,), False))
        legal = _legal_by_loop(cells)
        np.testing.assert_array_equal(units.legal_moves(jnp.asarray(cells)), legal)
        ar = units.mask_for("autoregressive", jnp.asarray(legal)[None])
        for unit in range(units.UNITS):
            row = ar["move"]({"unit": jnp.array([unit])})[0]
            np.testing.assert_array_equal(row, legal[unit])
        np.testing.assert_array_equal(ar["unit"][0], legal.any(-1))
        np.testing.assert_array_equal(units.mask_for("flat", jnp.asarray(legal)), legal.ravel())
        independent = units.mask_for("independent", jnp.asarray(legal))
        np.testing.assert_array_equal(independent["move"], legal.any(0))


def test_a_step_moves_collects_and_refuses_as_documented():
    env = units.make_env("independent")
    # Units at (0,0), (0,1), (1,0); the coin at (1,1).
    board = units.Board(jnp.array([0, 1, 4]), jnp.int32(5), jnp.int32(0))
    step = env.step(jax.random.key(0), board, {"unit": 1, "move": 1})  # (0,1) down
    assert float(step.reward) == 1.0 and not bool(step.counts["illegal"])
    np.testing.assert_array_equal(step.state.units, [0, 5, 4])
    assert int(step.state.coin) not in (0, 5, 4)
    step = env.step(jax.random.key(0), board, {"unit": 0, "move": 3})  # into unit 1
    assert float(step.reward) == 0.0 and bool(step.counts["illegal"])
    np.testing.assert_array_equal(step.state.units, board.units)
    flat = units.make_env("flat").step(jax.random.key(0), board, 1 * 4 + 1)
    np.testing.assert_array_equal(flat.state.units, [0, 5, 4])


def test_random_legal_pairs_collect_about_two_coins_and_greedy_about_twenty_one():
    env, n = units.make_env("flat"), 1024

    @jax.jit
    def play(key):
        reset_key, run_key = jax.random.split(key)
        _, board = jax.vmap(env.reset)(jax.random.split(reset_key, n))

        def one(board, key):
            act_key, step_key = jax.random.split(key)
            mask = jax.vmap(env.mask)(board)
            action = jax.random.categorical(act_key, jnp.where(mask, 0.0, -jnp.inf))
            step = jax.vmap(env.step)(jax.random.split(step_key, n), board, action)
            return step.state, step.reward

        _, rewards = jax.lax.scan(one, board, jax.random.split(run_key, units.LENGTH))
        return rewards.sum(0)

    returns = np.asarray(play(jax.random.key(0)))
    assert abs(returns.mean() - 1.9) < 0.1  # the guide's figure, within 3 standard errors
    assert abs(units.greedy_return() - 20.83) < 0.01  # 1024 episodes, seed 0, as quoted


@pytest.mark.parametrize("head", units.HEADS)
def test_a_short_training_run_learns_and_only_independent_heads_draw_illegal_pairs(head, tmp_path):
    summary = units.main(
        ["--total-steps", "100000", "--head", head, "--no-progress", "--out", str(tmp_path)]
    )
    assert summary["replay_ratio_error"] == 0.0
    if head == "independent":
        assert summary["illegal_in_training"] > 0.01
    else:
        assert summary["illegal_in_training"] == 0.0 and summary["illegal_in_evaluation"] == 0.0
    # Random legal pairs collect about 1.9 coins an episode; 100k steps reach well past that.
    assert summary["return"] > 6.0
