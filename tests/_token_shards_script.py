"""Multi-device checks of ``TokenCategorical``, run by ``tests/distributions/test_tokens.py``
in a subprocess with four host CPU devices.

The unembedding ``[D, V]`` is split over the vocabulary axis (``PartitionSpec(None,
"v")``), and so is a tied embedding table ``[V, D]`` (``PartitionSpec("v", None)``),
the hidden states replicated; under ``jax.jit`` the full log-probability and entropy,
their gradients, the support, a sample and its replay, and the gradient of a replay's
GRPO loss are compared with the same program on unsharded arrays; and a rollout on the
sharded table replays bit for bit there. ``python -m tests._token_shards_script``
prints one JSON object: check name -> ``[passed, detail]``. Nothing runs on import.
"""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from samplers import TokenCategorical

DEVICES = 4
N, D, V = 10, 6, 64
BLOCK = (4, 8)
# Measured on four host CPU devices: every value and every gradient bit-identical.


def _values(hidden, unembedding, bias, tokens, keys):
    full = TokenCategorical(hidden, unembedding, bias, block=BLOCK)
    truncated = TokenCategorical(hidden, unembedding, bias, top_p=0.9, max_kept=8, block=BLOCK)
    token, data, log_prob = truncated.sample_with_replay(seed=keys)
    return {
        "full_log_prob": full.full_log_prob(tokens),
        "full_entropy": full.full_entropy(),
        "support": truncated.support(),
        "token": token,
        "sampled_support": data["support"],
        "log_prob": log_prob,
        "replayed": truncated.replay(data)[1],
        "full_sample": full.sample_replay_data(seed=keys),
    }


def _loss(hidden, unembedding, bias, tokens):
    dist = TokenCategorical(hidden, unembedding, bias, block=BLOCK)
    return (dist.full_log_prob(tokens) + dist.full_entropy()).sum()


def _rollout(hidden, table, keys):
    """A top-p sample on the embedding table, with its log-probability."""
    dist = TokenCategorical(hidden, embedding=table, top_p=0.9, max_kept=8)
    return dist.sample_with_replay(seed=keys)


def _grpo(hidden, table, data, stored):
    """The clipped GRPO loss of replayed tokens, and its ratios."""
    dist = TokenCategorical(hidden, embedding=table, top_p=0.9, max_kept=8)
    ratio = jnp.exp(dist.replay(data)[1] - stored)
    return jnp.mean(jnp.minimum(ratio, jnp.clip(ratio, 0.8, 1.2))), ratio


def _compare(checks, prefix, got, want):
    """One check per leaf of ``want``: bit for bit, else the largest difference."""
    for name, g, w in zip(_names(want), jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        same = bool(np.array_equal(g, w, equal_nan=True))
        detail = "identical" if same else f"max difference {np.nanmax(np.abs(g - w)):.3g}"
        checks[f"{prefix} {name}"] = [same, detail]


def _names(tree):
    return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def main() -> dict:
    assert jax.device_count() == DEVICES, jax.devices()
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.normal(size=(N, D)), jnp.float32)
    unembedding = jnp.asarray(rng.normal(size=(D, V)), jnp.float32)
    bias = jnp.asarray(rng.normal(size=V), jnp.float32)
    tokens = jnp.asarray(np.arange(N) * 7 % V)
    keys = jax.random.split(jax.random.key(0), N)
    mesh = Mesh(np.array(jax.devices()), ("v",))
    sharded_w = jax.device_put(unembedding, NamedSharding(mesh, P(None, "v")))
    sharded_b = jax.device_put(bias, NamedSharding(mesh, P("v")))
    checks = {}
    if len(sharded_w.sharding.device_set) != DEVICES:
        checks["sharded layout"] = [False, str(sharded_w.sharding)]
    values = jax.jit(_values)
    expected = values(hidden, unembedding, bias, tokens, keys)
    got = values(hidden, sharded_w, sharded_b, tokens, keys)
    for name, value in expected.items():
        same = np.array_equal(np.asarray(got[name]), np.asarray(value))
        detail = "identical"
        if not same:
            diff = np.abs(np.asarray(got[name], np.float64) - np.asarray(value, np.float64))
            detail = f"max difference {np.nanmax(diff):.3g}"
        checks[f"jit {name}"] = [bool(same), detail]
    grad = jax.jit(jax.grad(_loss, argnums=(0, 1, 2)))
    want = grad(hidden, unembedding, bias, tokens)
    have = grad(hidden, sharded_w, sharded_b, tokens)
    for name, g, w in zip(("hidden", "unembedding", "bias"), have, want, strict=True):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        error = float(np.max(np.abs(g - w) / (1 + np.abs(w))))
        checks[f"grad {name}"] = [bool(np.array_equal(g, w)), f"relative difference {error:.3g}"]
    # A tied embedding table split over the vocabulary: rollout, replay, gradient.
    table = unembedding.T
    sharded_t = jax.device_put(table, NamedSharding(mesh, P("v", None)))
    rollout = jax.jit(_rollout)
    plain = rollout(hidden, table, keys)
    token, data, stored = rollout(hidden, sharded_t, keys)
    _compare(checks, "table rollout", (token, data, stored), plain)
    step = jax.jit(jax.value_and_grad(_grpo, argnums=(0, 1), has_aux=True))
    (_, ratio), grads = step(hidden, sharded_t, data, stored)
    checks["table replay's first ratio"] = [
        bool(np.all(np.asarray(ratio) == 1.0)),
        f"max |ratio - 1| {np.max(np.abs(np.asarray(ratio) - 1.0)):.3g}",
    ]
    (_, _), want_grads = step(hidden, table, data, stored)
    for name, g, w in zip(("hidden", "table"), grads, want_grads, strict=True):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        error = float(np.max(np.abs(g - w) / (1 + np.abs(w))))
        checks[f"table grad {name}"] = [error <= 1e-6, f"relative difference {error:.3g}"]
    return checks


if __name__ == "__main__":
    print(json.dumps(main()))
    sys.exit(0)
