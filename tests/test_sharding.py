"""The samplers with the batch split over devices, and over populations and time.

Multi-device checks run once, in a subprocess with four host CPU devices (see
``tests/_sharded_script.py``), because the device count is fixed when jax starts.
What they establish:

- Under ``nnx.jit`` / ``jax.jit`` with a ``NamedSharding`` on the batch axis, a
  sharded run is the unsharded run up to one rounding of the pre-image
  ``mean + std * eps`` (XLA fuses it into a multiply-add for some block shapes and
  not others, so the two can differ by one ulp of ``|mean| + |std * eps|``). Mean
  and std are bit-identical, the action and log-likelihood are exactly the
  unsharded score of the run's own pre-image, replaying an unsharded rollout on the
  sharded layout reproduces its log-likelihood bit for bit, the outputs stay split
  one block per device, and the stream advances by the same count.
- Inside ``jax.shard_map`` every shard sees only its block. Scoring a stored
  pre-image is exact. A key passed replicated gives every shard the same noise,
  the draw an unsharded call on that block alone would make, which is not the
  global draw; folding in ``jax.lax.axis_index`` gives each shard its own. With
  ``per_env_streams`` the keys are split with the batch, and every shard draws
  what the unsharded call draws for its environments.
- The exact entropy of a batch under ``jax.jit`` with the batch sharded along ``B``
  of ``[B, A]`` (also ``B = 4100``) or ``[T, B, A]``, explicit and automatic sharding:
  its value and gradient are the unsharded run's up to rounding, stay sharded, and
  the program moves no rows between devices (no all-gather, no all-to-all).
"""

import functools
import json
import subprocess
import sys

import numpy as np
import pytest
from flax import nnx

import samplers
from tests._devices import REPO_ROOT, cpu_devices_environment
from tests.helpers import normal_inputs

ENTROPY_WEIGHT = 0.01
A = 3
_inputs = functools.partial(normal_inputs, width=2 * A, scale=2.0)


@pytest.fixture(scope="module")
def sharded():
    """Runs every multi-device check in one subprocess; check name -> (passed, detail)."""
    return _sharded_checks()


@pytest.fixture(scope="module")
def sharded_entropy():
    """The exact entropy's multi-device checks (slow), in a subprocess of their own."""
    return _sharded_checks("--entropy")


def _sharded_checks(*args):
    env = cpu_devices_environment(4)
    result = subprocess.run(
        [sys.executable, "-m", "tests._sharded_script", *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if result.returncode != 0:
        pytest.fail(f"the sharded checks crashed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _assert_passed(sharded, name):
    passed, detail = sharded[name]
    assert passed, f"{name}: {detail}"


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        "nnx.jit Explicit [B,2A]",
        "nnx.jit Explicit [T,B,2A]",
        "nnx.jit Auto [B,2A]",
        "nnx.jit Auto [T,B,2A]",
    ],
)
def test_named_sharding_under_nnx_jit_is_the_unsharded_run_and_stays_sharded(sharded, name):
    _assert_passed(sharded, name)


@pytest.mark.slow
def test_pure_layer_under_jax_jit_with_a_sharded_batch(sharded):
    _assert_passed(sharded, "jax.jit pure layer")


@pytest.mark.slow
def test_nnx_scan_over_time_with_a_sharded_batch(sharded):
    _assert_passed(sharded, "nnx.scan over time")


@pytest.mark.slow
def test_shard_map_scores_stored_pre_images_exactly(sharded):
    _assert_passed(sharded, "shard_map log_prob_from_pre_image")


@pytest.mark.slow
def test_shard_map_with_one_key_draws_the_same_noise_on_every_shard(sharded):
    _assert_passed(sharded, "shard_map sampling with one key")


@pytest.mark.slow
def test_shard_map_with_the_shard_index_folded_in_draws_per_shard_noise(sharded):
    _assert_passed(sharded, "shard_map sampling with folded keys")


@pytest.mark.slow
def test_shard_map_entropy_estimate_with_a_replicated_key(sharded):
    _assert_passed(sharded, "shard_map entropy with one key")


@pytest.mark.slow
def test_shard_map_sampler_with_a_replicated_stream_draws_the_same_noise_per_shard(sharded):
    _assert_passed(sharded, "shard_map module")


@pytest.mark.slow
def test_shard_map_sampler_without_the_varying_axes_check_draws_the_same_noise_per_shard(
    sharded,
):
    """With ``check_vma=False`` a replicated stream runs: every shard draws the same noise."""
    _assert_passed(sharded, "shard_map module without the varying-axes check")


@pytest.mark.slow
def test_shard_map_sampler_with_per_env_streams_draws_the_unsharded_noise(sharded):
    _assert_passed(sharded, "shard_map module with per-env streams")


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        "exact entropy sharded Explicit [B,A]",
        "exact entropy sharded Auto [T,B,A]",
        "exact entropy sharded Explicit [B,A] B=4100",
    ],
)
def test_exact_entropy_of_a_sharded_batch_is_computed_in_place(sharded_entropy, name):
    _assert_passed(sharded_entropy, name)


# Populations and time, in this process.


@nnx.vmap(in_axes=0, out_axes=0)
def _create_population(rngs):
    return samplers.NormalTanhSampler(rngs, ENTROPY_WEIGHT)


def _population(size, seed):
    """``size`` samplers, each holding one stream of ``nnx.split_rngs``."""
    return _create_population(nnx.split_rngs(nnx.Rngs(seed), splits=size, graph_updates=False))


@nnx.vmap(in_axes=(0, None), out_axes=0)
def _act(sampler, mean_and_std):
    return sampler((), mean_and_std)


@nnx.vmap(in_axes=(0, None, 0), out_axes=0)
def _replay(sampler, mean_and_std, stored):
    return sampler((), mean_and_std, stored)


def _members_differ_everywhere(pre_images):
    pre_images = np.asarray(pre_images)
    return all(
        not np.any(pre_images[i] == pre_images[j]) for i in range(len(pre_images)) for j in range(i)
    )


def test_nnx_vmap_population_draws_a_different_sample_per_member_and_replays_it():
    # Three members, as the tests below: eager vmap compiles each operation per shape.
    population = _population(3, seed=0)
    mean_and_std = _inputs((5,))
    rollout = _act(population, mean_and_std)
    assert rollout.rollout_extras.shape == (3, 5, A)
    assert _members_differ_everywhere(rollout.rollout_extras)
    replay = _replay(population, mean_and_std, rollout.rollout_extras)
    np.testing.assert_array_equal(replay.output["log_likelihood"], rollout.output["log_likelihood"])
    np.testing.assert_array_equal(population.rng.default.count[...], [4, 4, 4])


def test_each_population_member_is_the_sampler_seeded_with_its_split_key():
    population = _population(3, seed=1)
    keys = population.rng.default.key[...]
    mean_and_std = _inputs((5,))
    pre_images = _act(population, mean_and_std).rollout_extras
    for member, key in enumerate(keys):
        alone = samplers.NormalTanhSampler(nnx.Rngs(key), ENTROPY_WEIGHT)
        # vmap and a single call may round mean + std * eps differently (one ulp).
        np.testing.assert_allclose(
            pre_images[member], alone((), mean_and_std).rollout_extras, rtol=1e-6, atol=1e-6
        )


def test_split_rngs_on_call_gives_each_member_its_own_key_and_restores_the_stream():
    sampler = samplers.NormalTanhSampler(nnx.Rngs(2), ENTROPY_WEIGHT)

    @nnx.split_rngs(splits=4)
    @nnx.vmap(in_axes=(0, None), out_axes=0)
    def act(sampler, mean_and_std):
        return sampler((), mean_and_std)

    mean_and_std = _inputs((5,))
    first = act(sampler, mean_and_std).rollout_extras
    second = act(sampler, mean_and_std).rollout_extras
    assert _members_differ_everywhere(first) and _members_differ_everywhere(second)
    assert not np.any(np.asarray(first) == np.asarray(second))
    assert sampler.rng.default.key.shape == ()


def test_population_scanned_over_time_matches_a_python_loop():
    steps = 6
    sequence = _inputs((steps, 5), seed=3)

    @nnx.vmap(in_axes=(0, None), out_axes=0)
    def rollout(sampler, sequence):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
        def step(sampler, mean_and_std):
            out = sampler((), mean_and_std)
            return sampler, (out.rollout_extras, out.output["log_likelihood"])

        return step(sampler, sequence)[1]

    scanned = _population(3, seed=4)
    pre_images, log_likelihoods = rollout(scanned, sequence)
    looped = _population(3, seed=4)
    expected = [_act(looped, mean_and_std) for mean_and_std in sequence]
    assert pre_images.shape == (3, steps, 5, A)
    np.testing.assert_allclose(
        pre_images, np.stack([o.rollout_extras for o in expected], axis=1), rtol=1e-6, atol=1e-6
    )
    np.testing.assert_allclose(
        log_likelihoods,
        np.stack([o.output["log_likelihood"] for o in expected], axis=1),
        rtol=1e-5,
    )
    np.testing.assert_array_equal(scanned.rng.default.count[...], [2 * steps] * 3)
    np.testing.assert_array_equal(looped.rng.default.count[...], [2 * steps] * 3)
