"""The patterns GRPO trainers run a ``TokenCategorical`` in, measured: a ``lax.scan``
decode loop of ``steps`` steps at ``rows`` rows a step, its completions replayed as the
whole ``[T, R]`` batch at once, as shuffled minibatches, and under ``jax.grad`` in the
program that differentiates the clipped GRPO loss; jitted or eagerly; with rollout and
replay ``block``s of their own. The hidden states depend on the tokens drawn before (an
embedding of the previous token), as a language model's do.

Used by ``tests/distributions/test_tokens_replay.py`` and the accelerator tier.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from samplers import TokenCategorical

OPTIONS = {
    "top_p": dict(top_p=0.9, max_kept=64),
    "top_k+min_p": dict(top_k=20, min_p=0.02, temperature=0.8, max_kept=32),
    "untruncated": dict(top_p=1.0, temperature=1.3),
    # The weights as an unembedding [D, V]: a decoding step gathers its columns, the
    # replay of a whole batch its transpose's rows.
    "top_p, unembedding": dict(top_p=0.9, max_kept=64, unembedding=True),
}


class Sizes(NamedTuple):
    """Decode steps, width ``D`` and vocabulary ``V``."""

    steps: int = 16
    hidden: int = 64
    vocab: int = 4500  # a full CPU tile of 4096 tokens and a remainder


class _Options(dict):
    """Options as a static argument of ``jax.jit``."""

    def __hash__(self):
        return hash(tuple(sorted(self.items())))


@functools.cache
def _table(sizes: Sizes, dtype) -> jax.Array:
    """An embedding table ``[V, D]``, tied: the unembedding is its transpose."""
    rng = np.random.default_rng(0)
    return jnp.asarray(
        rng.normal(size=(sizes.vocab, sizes.hidden)) * 3 / np.sqrt(sizes.hidden), dtype
    )


def _hidden(table, context, previous):
    """The context plus twice the previous token's embedding: arithmetic whose bits do
    not depend on the program (the product is exact), so that the rollout's hidden
    states are the replay's, whatever the model's code does in each."""
    return context + table[previous].astype(jnp.float32) * 2.0


def _dist(table, hidden, block, options):
    options = dict(options)
    weights = (
        dict(unembedding=table.T) if options.pop("unembedding", False) else {"embedding": table}
    )
    return TokenCategorical(hidden, **weights, block=block, **options)


def _rollout(table, context, key, steps, block, options):
    def step(previous, step_key):
        dist = _dist(table, _hidden(table, context, previous), block, options)
        token, data, log_prob = dist.sample_with_replay(seed=step_key)
        return token, (data, previous, log_prob)

    start = jnp.zeros(context.shape[0], jnp.int32)
    _, (data, previous, log_prob) = jax.lax.scan(step, start, jax.random.split(key, steps))
    return data, previous, log_prob


def _replay(table, context, previous, data, block, options):
    hidden = _hidden(table, context, previous)
    return _dist(table, hidden, block, options).replay(data)[1]


def _ratio_loss(table, context, previous, data, stored, advantage, block, options):
    ratio = jnp.exp(_replay(table, context, previous, data, block, options) - stored)
    clipped = jnp.clip(ratio, 0.8, 1.2)
    return -jnp.mean(jnp.minimum(ratio * advantage, clipped * advantage)), ratio


_GRAD = jax.value_and_grad(_ratio_loss, argnums=(0, 1), has_aux=True)
_JITTED = {
    "rollout": jax.jit(_rollout, static_argnums=(3, 4, 5)),
    "replay": jax.jit(_replay, static_argnums=(4, 5)),
    "grad": jax.jit(_GRAD, static_argnums=(6, 7)),
}
_EAGER = {"rollout": _rollout, "replay": _replay, "grad": _GRAD}


def measure(
    rows, name, *, jit=True, rollout_block=None, replay_block=None, dtype=jnp.float32, sizes=None
):
    """The largest ``|replayed - sampled|`` log-probability of each pattern, in nats
    (under ``jax.grad``: the largest ``|ratio - 1|``); raises if a gradient is not
    finite."""
    sizes = Sizes() if sizes is None else sizes
    options = _Options(OPTIONS[name])
    fns = _JITTED if jit else _EAGER
    table = _table(sizes, dtype)
    context = jax.random.normal(jax.random.key(rows), (rows, sizes.hidden))
    key = jax.random.key(100 + rows)
    data, previous, stored = fns["rollout"](
        table, context, key, sizes.steps, rollout_block, options
    )
    stored = np.asarray(stored)
    if not np.all(np.isfinite(stored)):
        raise AssertionError("a sampled log-probability is not finite")
    found = {}
    contexts = jnp.broadcast_to(context, (sizes.steps, rows, sizes.hidden))
    whole = fns["replay"](table, contexts, previous, data, replay_block, options)
    found["[T, R] at once"] = float(np.abs(np.asarray(whole) - stored).max())
    # Shuffled minibatches of 37 tokens (the last one shorter).
    count = sizes.steps * rows
    order = np.random.default_rng(rows).permutation(count)
    flat = jax.tree.map(lambda a: np.asarray(a).reshape(count, *a.shape[2:]), data)
    flat_previous = np.asarray(previous).reshape(-1)
    flat_context = np.asarray(contexts).reshape(count, sizes.hidden)
    worst = 0.0
    for start in range(0, count, 37):
        part = order[start : start + 37]
        got = fns["replay"](
            table,
            jnp.asarray(flat_context[part]),
            jnp.asarray(flat_previous[part]),
            jax.tree.map(lambda a, part=part: jnp.asarray(a[part]), flat),
            replay_block,
            options,
        )
        worst = max(worst, float(np.abs(np.asarray(got) - stored.reshape(-1)[part]).max()))
    found["shuffled minibatches"] = worst
    advantage = jnp.asarray(np.random.default_rng(1).normal(size=(sizes.steps, rows)), jnp.float32)
    (_, ratio), grads = fns["grad"](
        table, contexts, previous, data, stored, advantage, replay_block, options
    )
    found["under jax.grad (ratio - 1)"] = float(np.abs(np.asarray(ratio) - 1.0).max())
    if not all(np.all(np.isfinite(np.asarray(g, np.float32))) for g in grads):
        raise AssertionError("a gradient is not finite")
    return found
