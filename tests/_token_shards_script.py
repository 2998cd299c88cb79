"""Multi-device checks of ``TokenCategorical``, run by ``tests/distributions/test_tokens.py``
in a subprocess with four host CPU devices.

The unembedding ``[D, V]`` is split over the vocabulary axis (``PartitionSpec(None,
"v")``), the hidden states replicated; under ``jax.jit`` the full log-probability and
entropy, their gradients, the support, a sample and its replay are compared with the
same program on unsharded arrays. ``python -m tests._token_shards_script`` prints one
JSON object: check name -> ``[passed, detail]``. Nothing runs on import.
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
    return checks


if __name__ == "__main__":
    print(json.dumps(main()))
    sys.exit(0)
