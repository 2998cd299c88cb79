"""The dtype rule, for every head of the library.

float16 and bfloat16 network outputs are computed in float32 and return float32:
every output (the action if floating, the log-likelihood, the regularization loss,
the rollout extras if floating) equals, bit for bit, the same call on the network
output converted to float32 (same ``nnx.Rngs`` seed, fresh heads), in the rollout
and in the replay of its extras. Under ``jax_enable_x64`` float64 network outputs
stay float64. ``DistributionSampler`` follows the rule of the distribution it is
given; here, one of this library's.

The default tier runs bfloat16 for every head; float16, which takes the same path,
and float64 run in the slow tier.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import samplers
from tests._tiers import slow

A = 3  # action dimensions of a Box head; every input is [4, width]
BATCH = 4


def _composite():
    rngs = nnx.Rngs(0)
    move = samplers.SquashedNormalSampler(rngs, 0.01, action_dim=A)
    return samplers.CompositeSampler(
        {"move": move, "fire": samplers.CategoricalSampler(rngs, 0.01, 2 * A)}, rngs=rngs
    )


def _parameterized():
    rngs = nnx.Rngs(0)
    parameters = (
        samplers.SquashedNormalSampler(rngs, 0.01, action_dim=A),
        samplers.BetaSampler(rngs, 0.01, action_dim=A, low=-2.0, high=3.0),
    )
    return samplers.ParameterizedSampler(
        samplers.CategoricalSampler(rngs, 0.01, 2), parameters, rngs=rngs
    )


def _autoregressive():
    rngs = nnx.Rngs(0)
    steps = {
        "fire": samplers.CategoricalSampler(rngs, 0.01, 2),
        "move": samplers.SquashedNormalSampler(rngs, 0.01, action_dim=A),
    }
    return samplers.AutoregressiveSampler(steps, features=2 * A, entropy_weight=0.01, rngs=rngs)


# Each head and the width of its network output; the widths are shared where they can
# be, so that the heads reuse each other's compiled operations.
HEADS = {
    "NormalTanhSampler": (lambda: samplers.NormalTanhSampler(nnx.Rngs(0), 0.01), 2 * A),
    "SquashedNormalSampler-BoundedTanh": (
        lambda: samplers.SquashedNormalSampler(
            nnx.Rngs(0), 0.01, bijector=samplers.BoundedTanh(-2.0, 3.0)
        ),
        2 * A,
    ),
    "StateIndependentSampler": (lambda: samplers.StateIndependentSampler(nnx.Rngs(0), A, 0.01), A),
    "BetaSampler": (lambda: samplers.BetaSampler(nnx.Rngs(0), 0.01, low=-2.0, high=3.0), 2 * A),
    "CategoricalSampler": (lambda: samplers.CategoricalSampler(nnx.Rngs(0), 0.01, 2 * A), 2 * A),
    "MultiDiscreteSampler": (
        lambda: samplers.MultiDiscreteSampler(nnx.Rngs(0), 0.01, (A, A)),
        2 * A,
    ),
    "MultiBinarySampler": (lambda: samplers.MultiBinarySampler(nnx.Rngs(0), 0.01, 2 * A), 2 * A),
    "CompositeSampler": (_composite, 4 * A),
    "AutoregressiveSampler": (_autoregressive, 2 * A),
    "ParameterizedSampler": (_parameterized, 2 + 4 * A),
    "DistributionSampler": (
        lambda: samplers.DistributionSampler(
            nnx.Rngs(0), 0.01, lambda params: samplers.squashed_beta(params, -2.0, 3.0)
        ),
        2 * A,
    ),
}


def _saturating_inputs(width, dtype):
    """A network output with saturating entries, exact in every dtype tested."""
    inputs = 3.0 * jax.random.normal(jax.random.key(1), (BATCH, width))
    inputs = inputs.at[0, 0].set(30.0).at[1, -1].set(-30.0)
    return inputs.astype(jnp.bfloat16).astype(dtype)


def _checked_outputs(out):
    """The outputs the rule covers, by path: those that are floating or integer."""
    outputs = {
        "action": out.output["action"],
        "log_likelihood": out.output["log_likelihood"],
        "regularization_loss": out.regularization_loss,
        "rollout_extras": out.rollout_extras,
    }
    leaves = jax.tree_util.tree_leaves_with_path(outputs)
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}


def _rollout_and_replay(head, inputs):
    rollout = head((), inputs)
    return rollout, head((), inputs, rollout.rollout_extras)


def _as_bits(value):
    """The bytes of ``value``, so that -0.0 and 0.0 (or two NaNs) are compared exactly."""
    return value.view(np.dtype(f"u{value.dtype.itemsize}"))


# The default tier runs bfloat16 on one head of each layout (a squashed Normal, the Beta,
# a discrete head, a composite); float16 and the other heads run in the slow tier.
DEFAULT_TIER = ("NormalTanhSampler", "BetaSampler", "CategoricalSampler", "CompositeSampler")


@pytest.mark.parametrize(
    "name, dtype",
    [
        pytest.param(name, dtype, id=f"{name}-{dtype_id}")
        if name in DEFAULT_TIER and dtype_id == "bfloat16"
        else slow(name, dtype, id=f"{name}-{dtype_id}")
        for dtype_id, dtype in (("bfloat16", jnp.bfloat16), ("float16", jnp.float16))
        for name in HEADS
    ],
)
def test_half_precision_network_outputs_give_the_float32_outputs_bit_for_bit(name, dtype):
    make, width = HEADS[name]
    inputs = _saturating_inputs(width, dtype)
    expected = _rollout_and_replay(make(), inputs.astype(jnp.float32))
    got = _rollout_and_replay(make(), inputs)
    for call, want, have in zip(("rollout", "replay"), expected, got, strict=True):
        want, have = _checked_outputs(want), _checked_outputs(have)
        assert want.keys() == have.keys()
        for path, value in have.items():
            where = f"{name} {call} {path}"
            if np.issubdtype(want[path].dtype, np.floating):
                assert value.dtype == want[path].dtype == np.float32, where
                np.testing.assert_array_equal(_as_bits(value), _as_bits(want[path]), err_msg=where)
            else:
                assert value.dtype == want[path].dtype, where
                np.testing.assert_array_equal(value, want[path], err_msg=where)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(HEADS))
def test_float64_network_outputs_stay_float64_under_x64(name):
    make, width = HEADS[name]
    with jax.enable_x64(True):
        inputs = _saturating_inputs(width, jnp.float64)
        outputs = _rollout_and_replay(make(), inputs)
        for call, out in zip(("rollout", "replay"), outputs, strict=True):
            for path, value in _checked_outputs(out).items():
                if not np.issubdtype(value.dtype, np.integer):
                    assert value.dtype == np.float64, f"{name} {call} {path}"
