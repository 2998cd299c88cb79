"""``samplers.functional``: a head split once into a jitted pure function and its state."""

import functools

import jax.numpy as jnp
import numpy as np
from flax import nnx

import samplers
from tests.helpers import NORMAL_HEAD_FIELDS, keys_drawn, normal_head_outputs, normal_inputs

A = 3
OPTIONS = {"entropy_weight": 0.01, "min_std": 1e-3, "std_scale": 1.0}
_inputs = functools.partial(normal_inputs, width=2 * A, scale=2.0)


def test_functional_matches_the_module_call_after_call():
    module = samplers.NormalTanhSampler(nnx.Rngs(5), **OPTIONS)
    apply, state = samplers.functional(samplers.NormalTanhSampler(nnx.Rngs(5), **OPTIONS))
    for seed in range(3):
        mean_and_std = _inputs((4,), seed=seed)
        expected = module((), mean_and_std)
        out, state = apply(state, mean_and_std)
        replayed, state = apply(state, mean_and_std, out.rollout_extras)
        module((), mean_and_std, expected.rollout_extras)
        for field in NORMAL_HEAD_FIELDS:
            np.testing.assert_allclose(
                normal_head_outputs(out)[field], normal_head_outputs(expected)[field], rtol=1e-6
            )
        np.testing.assert_allclose(
            replayed.output["log_likelihood"], out.output["log_likelihood"], rtol=1e-6
        )
    assert int(state["rng"]["default"]["count"]) == keys_drawn(module) == 12


def test_functional_state_writes_back_and_reads_deterministic_when_made():
    head = samplers.NormalTanhSampler(nnx.Rngs(0), **OPTIONS)
    apply, state = samplers.functional(head)
    _, state = apply(state, _inputs((4,)))
    nnx.update(head, state)
    assert keys_drawn(head) == 2
    head.eval()
    apply_eval, state = samplers.functional(head)
    out, _ = apply_eval(state, _inputs((4,)))
    np.testing.assert_array_equal(out.output["action"], jnp.tanh(_inputs((4,))[..., :A]))
