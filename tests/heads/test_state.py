"""A sampler's state is its RNG stream.

It saves and restores with Orbax, clones with ``nnx.clone``, and a restored or
cloned sampler continues the identical stream. A long ``nnx.scan`` soak checks
that the stream never repeats a key and the outputs never turn NaN.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import errors, nnx

import samplers
from tests._tiers import slow
from tests.helpers import keys_drawn, normal_inputs

A = 2
ENTROPY_WEIGHT = 0.01
BOUNDS = (jnp.array([-2.0, 0.0]), jnp.array([3.0, 0.5]))
_inputs = functools.partial(normal_inputs, (4,), 2 * A, scale=3.0)


def _orbax():
    """``orbax.checkpoint`` (a dependency of flax), imported by the slow tests that use it."""
    import orbax.checkpoint

    return orbax.checkpoint


def _sampler(kind, seed):
    if kind == "tanh":
        return samplers.NormalTanhSampler(nnx.Rngs(seed), ENTROPY_WEIGHT)
    return samplers.SquashedNormalSampler(
        nnx.Rngs(seed), ENTROPY_WEIGHT, bijector=samplers.BoundedTanh(*BOUNDS)
    )


def _next_outputs(sampler):
    """Rollout, replay, eval rollout and a train rollout again: what a stream decides."""
    outputs = []
    rollout = sampler((), _inputs(seed=0))
    outputs.append(rollout)
    outputs.append(sampler((), _inputs(seed=0), rollout.rollout_extras))
    sampler.eval()
    outputs.append(sampler((), _inputs(seed=1)))
    sampler.train()
    outputs.append(sampler((), _inputs(seed=2)))
    return jax.tree.map(np.asarray, outputs)


def _assert_identical(expected, actual):
    leaves, structure = jax.tree.flatten(expected)
    actual_leaves, actual_structure = jax.tree.flatten(actual)
    assert structure == actual_structure
    for expected_leaf, actual_leaf in zip(leaves, actual_leaves, strict=True):
        np.testing.assert_array_equal(actual_leaf, expected_leaf)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tanh", "bounded"])
def test_orbax_checkpoint_restores_a_sampler_that_continues_the_identical_stream(kind, tmp_path):
    original = _sampler(kind, seed=7)
    for seed in range(3):  # move the stream away from its start
        original((), _inputs(seed=seed))
    checkpointer = _orbax().StandardCheckpointer()
    checkpointer.save(tmp_path / "sampler", nnx.state(original))
    checkpointer.wait_until_finished()

    graphdef, abstract_state = nnx.split(nnx.eval_shape(lambda: _sampler(kind, seed=0)))
    restored = nnx.merge(graphdef, checkpointer.restore(tmp_path / "sampler", abstract_state))
    checkpointer.close()

    assert keys_drawn(restored) == keys_drawn(original) == 6
    np.testing.assert_array_equal(
        jax.random.key_data(restored.rng.default.key[...]),
        jax.random.key_data(original.rng.default.key[...]),
    )
    _assert_identical(_next_outputs(original), _next_outputs(restored))
    assert keys_drawn(restored) == keys_drawn(original)


@pytest.mark.slow
def test_orbax_restore_with_nnx_update_overwrites_a_differently_seeded_stream(tmp_path):
    original = _sampler("tanh", seed=3)
    original((), _inputs(seed=0))
    checkpointer = _orbax().StandardCheckpointer()
    checkpointer.save(tmp_path / "sampler", nnx.state(original))
    checkpointer.wait_until_finished()

    other = _sampler("tanh", seed=99)
    nnx.update(other, checkpointer.restore(tmp_path / "sampler", nnx.state(other)))
    checkpointer.close()
    _assert_identical(_next_outputs(original), _next_outputs(other))


# Bounds are configuration, not state: the bounded sampler repeats the check, slow.
@pytest.mark.parametrize("kind", ["tanh", slow("bounded")])
def test_clone_continues_the_identical_stream_independently(kind):
    original = _sampler(kind, seed=5)
    original((), _inputs(seed=0))
    clone = nnx.clone(original)
    _assert_identical(_next_outputs(original), _next_outputs(clone))

    before = keys_drawn(original)
    clone((), _inputs(seed=3))
    assert keys_drawn(original) == before and keys_drawn(clone) == before + 2


SOAK_STEPS = 100_000
SOAK_BATCH = 4


@pytest.mark.slow
def test_soak_of_100_000_scan_steps_never_yields_nan_nor_repeats_a_key():
    """10**5 rollout-and-replay steps of a [4, 2A] batch under one nnx.scan.

    Each step records the four keys the sampler is about to draw, read from a
    clone of its stream (the clone is checked against the sample it produced).
    Means reach |mean| ~ 50 and stds run from the 1e-3 floor to ~15, saturated and not.
    """
    sampler = samplers.NormalTanhSampler(nnx.Rngs(0), ENTROPY_WEIGHT)
    means = 10.0 * jax.random.normal(jax.random.key(1), (SOAK_STEPS, SOAK_BATCH, A))
    raw_stds = 3.0 * jax.random.normal(jax.random.key(2), (SOAK_STEPS, SOAK_BATCH, A))
    sequence = jnp.concatenate([means, raw_stds], axis=-1)

    @nnx.jit
    def soak(sampler, sequence):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
        def step(sampler, mean_and_std):
            spy = nnx.clone(sampler.rng)
            keys = jnp.stack([jax.random.key_data(spy()) for _ in range(4)])
            rollout = sampler((), mean_and_std)
            replay = sampler((), mean_and_std, rollout.rollout_extras)
            values = jnp.stack(
                [
                    rollout.output["log_likelihood"],
                    replay.output["log_likelihood"],
                    rollout.regularization_loss,
                    replay.regularization_loss,
                ]
            )
            return sampler, (keys, values, rollout.output["action"], rollout.rollout_extras)

        return step(sampler, sequence)[1]

    keys, values, actions, pre_images = soak(sampler, sequence)
    keys, values, actions = np.asarray(keys), np.asarray(values), np.asarray(actions)

    assert keys_drawn(sampler) == 4 * SOAK_STEPS
    assert np.all(np.isfinite(values)) and np.all(np.isfinite(actions))
    assert np.all(np.abs(actions) <= 1.0)
    np.testing.assert_array_equal(values[:, 1], values[:, 0])  # the PPO ratio is exactly 1
    flat_keys = keys.reshape(4 * SOAK_STEPS, -1)
    assert len(np.unique(flat_keys, axis=0)) == len(flat_keys)

    # The spy's first key of a step is the one that step sampled with.
    for step in (0, 1, SOAK_STEPS // 2, SOAK_STEPS - 1):
        dist = samplers.normal_tanh(sequence[step])
        eps = jax.random.normal(jax.random.wrap_key_data(keys[step, 0]), dist.loc.shape)
        # The scan may fuse mean + std * eps into one multiply-add: one rounding apart.
        np.testing.assert_allclose(
            pre_images[step], dist.loc + dist.scale * eps, rtol=1e-6, atol=1e-6
        )


@pytest.mark.parametrize(
    ("head", "fix"),
    [
        (lambda: samplers.NormalTanhSampler(nnx.Rngs(0), 0.01, action_dim=2), "entropy='exact'"),
        (
            lambda: samplers.CompositeSampler(
                {"a": samplers.NormalTanhSampler(nnx.Rngs(1), 0.01, action_dim=2)},
                rngs=nnx.Rngs(2),
            ),
            "an entropy that draws none",
        ),
    ],
    ids=["NormalTanhSampler", "CompositeSampler"],
)
def test_a_key_drawn_under_plain_jax_grad_names_the_fix(head, fix):
    """Flax refuses a key drawn under ``jax.grad`` (not ``nnx.grad``); the replay with
    the default one-sample entropy draws one, and the error names how to avoid it."""
    head = head()
    x = jnp.zeros((4, head.num_params))
    stored = head((), x).rollout_extras

    def loss(x):
        return jnp.sum(head((), x, stored).regularization_loss)

    with pytest.raises(errors.TraceContextError, match=r"nnx\.grad") as raised:
        jax.grad(loss)(x)
    assert fix in str(raised.value) and type(head).__name__ in str(raised.value)
    by_nnx = nnx.grad(lambda head, x: jnp.sum(head((), x, stored).regularization_loss), argnums=1)
    assert np.all(np.isfinite(by_nnx(head, x)))  # nnx.grad carries the stream
