"""``TokenCategorical``'s replay in the patterns GRPO trainers run
(``tests/_token_patterns.py``): a ``lax.scan`` decode loop of 16 steps at 1, 7, 32, 48
and 256 rows a step, its completions replayed as the whole ``[T, R]`` batch at once
and as shuffled minibatches, jitted and eagerly, under ``jax.grad``, with a rollout
``block`` different from the replay's: every token's replayed log-probability is its
sampled one, bit for bit (the first ratio is exactly 1)."""

import jax.numpy as jnp
import pytest

from tests._tiers import slow
from tests._token_patterns import measure

CASES = [
    # rows, options, jit, rollout block, replay block
    pytest.param(7, "top_p", True, None, None, id="7-top_p-jit"),
    slow(48, "top_p", True, (8, 512), None, id="48-top_p-jit-blocks"),
    slow(32, "untruncated", True, None, None, id="32-untruncated-jit"),
    slow(1, "top_k+min_p", False, None, (16, 1024), id="1-top_k+min_p-eager-blocks"),
    slow(1, "top_p", True, None, None, id="1-top_p-jit"),
    slow(32, "top_p", True, None, None, id="32-top_p-jit"),
    slow(32, "top_p", False, None, None, id="32-top_p-eager"),
    slow(256, "top_p", True, None, (64, 2048), id="256-top_p-jit-blocks"),
    slow(7, "top_k+min_p", True, (4, 300), None, id="7-top_k+min_p-jit-blocks"),
    slow(48, "top_k+min_p", False, None, None, id="48-top_k+min_p-eager"),
    slow(1, "untruncated", True, None, None, id="1-untruncated-jit"),
    slow(7, "untruncated", False, None, None, id="7-untruncated-eager"),
    slow(48, "untruncated", True, None, None, id="48-untruncated-jit"),
    slow(256, "untruncated", True, None, None, id="256-untruncated-jit"),
    slow(32, "top_p, unembedding", True, None, None, id="32-top_p-unembedding-jit"),
    slow(7, "top_p, unembedding", False, None, None, id="7-top_p-unembedding-eager"),
]


@pytest.mark.parametrize("rows, name, jit, rollout_block, replay_block", CASES)
def test_a_decode_loop_replays_bit_for_bit_in_every_pattern(
    rows, name, jit, rollout_block, replay_block
):
    found = measure(rows, name, jit=jit, rollout_block=rollout_block, replay_block=replay_block)
    assert all(error == 0.0 for error in found.values()), found


@pytest.mark.parametrize("rows", [slow(32, id="32"), slow(7, id="7")])
def test_a_bfloat16_table_replays_bit_for_bit(rows):
    found = measure(rows, "top_p", rollout_block=(16, 1024), dtype=jnp.bfloat16)
    assert all(error == 0.0 for error in found.values()), found
