"""``TokenCategorical``'s replay in the patterns GRPO trainers run: a ``lax.scan`` decode
loop of 16 steps at 1, 7, 32, 48 and 256 rows a step, its completions replayed as the
whole ``[T, R]`` batch at once and as shuffled minibatches, jitted and eagerly, under
``jax.grad``, with a rollout ``block`` different from the replay's: every token's
replayed log-probability is its sampled one, bit for bit (the first ratio is exactly
1). The hidden states depend on the tokens drawn before (an embedding of the previous
token), as a language model's do."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from samplers import TokenCategorical
from tests._tiers import slow

STEPS, D, V = 16, 64, 4500  # V: one full tile of 4096 tokens and a remainder (CPU tiles)
OPTIONS = {
    "top_p": dict(top_p=0.9, max_kept=64),
    "top_k+min_p": dict(top_k=20, min_p=0.02, temperature=0.8, max_kept=32),
    "untruncated": dict(top_p=1.0, temperature=1.3),
}


@functools.cache
def _model(dtype=jnp.float32):
    """An embedding table ``[V, D]`` (tied: the unembedding is its transpose), and the
    per-row context."""
    rng = np.random.default_rng(0)
    embedding = rng.normal(size=(V, D)) / np.sqrt(D) * 3
    return jnp.asarray(embedding, dtype)


def _hidden(embedding, context, previous):
    """The hidden state of each row: its context and the previous token's embedding."""
    return jnp.tanh(context + embedding[previous].astype(jnp.float32) * 2.0)


def _dist(embedding, hidden, block, options):
    return TokenCategorical(hidden, embedding.T, block=block, **options)


def _rollout(embedding, context, key, block, options):
    """``STEPS`` steps of ``R`` rows in a ``lax.scan``: the stored replay data, the
    tokens fed back and the sampled log-probabilities, ``[T, R]`` each."""

    def step(previous, step_key):
        dist = _dist(embedding, _hidden(embedding, context, previous), block, options)
        token, data, log_prob = dist.sample_with_replay(seed=step_key)
        return token, (data, previous, log_prob)

    start = jnp.zeros(context.shape[0], jnp.int32)
    _, (data, previous, log_prob) = jax.lax.scan(step, start, jax.random.split(key, STEPS))
    return data, previous, log_prob


def _replay(embedding, context, previous, data, block, options):
    """The replay of ``[T, R]`` (or ``[M]``) stored tokens at once."""
    hidden = _hidden(embedding, jnp.broadcast_to(context, (*previous.shape, D)), previous)
    return _dist(embedding, hidden, block, options).replay(data)[1]


def _ratio_loss(embedding, context, previous, data, stored, advantage, block, options):
    """The clipped GRPO loss of the replay, and its ratios."""
    log_prob = _replay(embedding, context, previous, data, block, options)
    ratio = jnp.exp(log_prob - stored)
    clipped = jnp.clip(ratio, 0.8, 1.2)
    return -jnp.mean(jnp.minimum(ratio * advantage, clipped * advantage)), ratio


_rollout_jit = jax.jit(_rollout, static_argnums=(3, 4))
_replay_jit = jax.jit(_replay, static_argnums=(4, 5))
_loss_grad_jit = jax.jit(
    jax.value_and_grad(_ratio_loss, argnums=(0, 1), has_aux=True), static_argnums=(6, 7)
)


def _frozen(options):
    return tuple(sorted(options.items()))


def _patterns(rows, name, jit, rollout_block, replay_block, dtype=jnp.float32):
    """The largest ``|replayed - sampled|`` of each replay pattern, and the check that
    gradients are finite."""
    options = OPTIONS[name]
    embedding = _model(dtype)
    context = jax.random.normal(jax.random.key(rows), (rows, D))
    key = jax.random.key(100 + rows)
    if jit:
        data, previous, stored = _rollout_jit(
            embedding, context, key, rollout_block, _Hashable(options)
        )
    else:
        data, previous, stored = _rollout(embedding, context, key, rollout_block, options)
    stored = np.asarray(stored)
    assert np.all(np.isfinite(stored))
    found = {}
    context_rows = jnp.broadcast_to(context, (STEPS, rows, D))
    replay = _replay_jit if jit else _replay
    opts = _Hashable(options) if jit else options
    whole = replay(embedding, context_rows, previous, data, replay_block, opts)
    found["[T, R] at once"] = np.abs(np.asarray(whole) - stored).max()
    # Shuffled minibatches of 37 tokens (the last one shorter).
    order = np.random.default_rng(rows).permutation(STEPS * rows)
    flat = jax.tree.map(lambda a: np.asarray(a).reshape(STEPS * rows, *a.shape[2:]), data)
    flat_previous = np.asarray(previous).reshape(-1)
    flat_context = np.asarray(context_rows).reshape(-1, D)
    worst = 0.0
    for start in range(0, len(order), 37):
        part = order[start : start + 37]
        got = replay(
            embedding,
            jnp.asarray(flat_context[part]),
            jnp.asarray(flat_previous[part]),
            jax.tree.map(lambda a, part=part: jnp.asarray(a[part]), flat),
            replay_block,
            opts,
        )
        worst = max(worst, np.abs(np.asarray(got) - stored.reshape(-1)[part]).max())
    found["shuffled minibatches"] = worst
    # Under jax.grad, in the program that differentiates the loss.
    advantage = jnp.asarray(np.random.default_rng(1).normal(size=(STEPS, rows)), jnp.float32)
    grad = _loss_grad_jit if jit else jax.value_and_grad(_ratio_loss, argnums=(0, 1), has_aux=True)
    (_, ratio), grads = grad(
        embedding, context_rows, previous, data, stored, advantage, replay_block, opts
    )
    found["under jax.grad (ratio - 1)"] = np.abs(np.asarray(ratio) - 1.0).max()
    assert all(np.all(np.isfinite(np.asarray(g, np.float32))) for g in grads)
    return found


class _Hashable(dict):
    """Options as a static argument of ``jax.jit``."""

    def __hash__(self):
        return hash(_frozen(self))


CASES = [
    # rows, options, jit, rollout block, replay block
    pytest.param(7, "top_p", True, None, None, id="7-top_p-jit"),
    pytest.param(48, "top_p", True, (8, 512), None, id="48-top_p-jit-blocks"),
    pytest.param(32, "untruncated", True, None, None, id="32-untruncated-jit"),
    pytest.param(1, "top_k+min_p", False, None, (16, 1024), id="1-top_k+min_p-eager-blocks"),
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
]


@pytest.mark.parametrize("rows, name, jit, rollout_block, replay_block", CASES)
def test_a_decode_loop_replays_bit_for_bit_in_every_pattern(
    rows, name, jit, rollout_block, replay_block
):
    found = _patterns(rows, name, jit, rollout_block, replay_block)
    assert all(error == 0.0 for error in found.values()), found


@pytest.mark.parametrize("rows", [pytest.param(32, id="32"), slow(7, id="7")])
def test_a_bfloat16_table_replays_bit_for_bit(rows):
    found = _patterns(rows, "top_p", True, (16, 1024), None, dtype=jnp.bfloat16)
    assert all(error == 0.0 for error in found.values()), found
