"""The GRPO example: its reward and advantages, the ratios of a tiny run, and a learning
run (slow tier)."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from samplers.examples import grpo

TINY = grpo.Config(
    iterations=2, digits=2, prompts=4, group_size=4, epochs=1, dim=16, layers=1, heads=2
)


def test_the_reward_is_the_fraction_of_digits_reversed_and_advantages_are_per_group():
    prompts = jnp.array([[3, 1, 4, 1], [0, 0, 0, 0]])
    completions = jnp.array([[1, 4, 1, 3], [0, 12, 0, 5]])
    np.testing.assert_array_equal(grpo.reward(prompts, completions), [1.0, 0.5])
    rewards = jnp.array([0.0, 1.0, 0.5, 0.5, 0.25, 0.75])
    np.testing.assert_allclose(
        grpo.advantages(rewards, 2), [-1.0, 1.0, 0.0, 0.0, -1.0, 1.0], atol=1e-5
    )


@pytest.mark.slow
def test_a_tiny_run_replays_the_rollout_exactly_and_scores_the_kept_mass_on_the_vocabulary():
    result = grpo.train(TINY)
    # Before the first step the weights are the rollout's: the replay gives its bits.
    assert result["replay_ratio_error"] == 0.0
    # So are the loss's own first ratios, computed with their gradient.
    assert result["loss_ratio_error"] == 0.0
    # On the whole vocabulary the ratio of a sampled token is the mass top-p kept.
    assert 0.5 < result["first_full_vocabulary_ratio"] < 1.0
    assert np.isfinite(result["final_loss"])
    assert all(0.0 <= r <= 1.0 for r in result["rewards"])


@pytest.mark.slow
def test_grpo_learns_to_reverse_the_digits():
    # Measured on seeds 0-2: the first ten iterations average 0.16 to 0.20 and every
    # ten from iteration 61 on above 0.99.
    result = grpo.train(grpo.Config(iterations=100, seed=0))
    assert result["start_reward"] < 0.3
    assert result["end_reward"] > result["start_reward"] + 0.5
    assert result["replay_ratio_error"] == 0.0


@pytest.mark.slow
def test_the_plain_jax_variant_and_a_larger_vocabulary_run():
    # A vocabulary of 512 with supports of up to 64 ids, as --large has proportions.
    config = grpo.Config(
        iterations=2,
        digits=3,
        prompts=2,
        group_size=4,
        epochs=1,
        dim=16,
        layers=1,
        heads=2,
        vocab=512,
        max_kept=64,
    )
    ours = grpo.train(config)
    assert ours["replay_ratio_error"] == 0.0 and ours["loss_ratio_error"] == 0.0
    plain = grpo.train(dataclasses.replace(config, sampler="plain"))
    # Plain JAX stores the whole vocabulary's log-probability: its first ratio is about 1.
    assert plain["replay_ratio_error"] < 1e-5 and plain["full_vocabulary_ratio"] > 0.99
    for result in (ours, plain):
        assert result["rollout_ms"] > 0 and result["update_ms"] > 0
        assert np.isfinite(result["final_loss"])
