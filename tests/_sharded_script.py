"""Multi-device checks, run by ``tests/test_sharding.py`` in a subprocess.

The parent sets ``XLA_FLAGS=--xla_force_host_platform_device_count=4`` before jax
starts, which a running pytest process can no longer do. ``python -m
tests._sharded_script`` prints one JSON object: check name -> ``[passed, detail]``.
Nothing runs on import (``pytest --doctest-modules`` imports this module).
"""

import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import samplers
from tests.helpers import normal_head_outputs, normal_inputs

DEVICES = 4
B = 8
ROWS = B // DEVICES
T = 5
A = 3
ENTROPY_WEIGHT = 0.01
EPS32 = float(np.finfo(np.float32).eps)
_inputs = functools.partial(normal_inputs, (B,), 2 * A, scale=4.0, seed=5)


def _count(sampler):
    return int(sampler.rng.default.count[...])


_score = jax.jit(lambda p, x: samplers.normal_tanh(p).forward_and_log_prob(x))


def _rescored(inputs, pre_image):
    """Action and log-likelihood of ``pre_image``, computed unsharded on one device."""
    return _score(np.asarray(inputs), np.asarray(pre_image))


def _differences(inputs, expected: dict, actual: dict) -> list[str]:
    """How a sharded run departs from the unsharded one, beyond what XLA may round.

    ``mu`` and ``sigma`` must be identical. The pre-image ``mu + sigma * eps`` may
    differ by one rounding (XLA contracts it into a fused multiply-add for some
    block shapes and not others), at most one ulp of ``|mu| + |sigma * eps|``. The
    action and log-likelihood must then be exactly those of the sharded run's own
    pre-image, scored unsharded; the entropy cost may move by that rounding too.
    """
    problems = [
        f"{name} differs"
        for name in ("mu", "sigma")
        if not np.array_equal(np.asarray(expected[name]), np.asarray(actual[name]))
    ]
    mu = np.asarray(expected["mu"], np.float64)
    pre_image = np.asarray(expected["rollout_extras"], np.float64)
    allowed = EPS32 * (np.abs(mu) + np.abs(pre_image - mu))
    if np.any(np.abs(np.asarray(actual["rollout_extras"], np.float64) - pre_image) > allowed):
        problems.append("pre-image differs by more than one rounding")
    action, log_likelihood = _rescored(inputs, actual["rollout_extras"])
    if not np.array_equal(action, np.asarray(actual["action"])):
        problems.append("action is not f(pre-image) as computed unsharded")
    if not np.array_equal(log_likelihood, np.asarray(actual["log_likelihood"])):
        problems.append("log-likelihood is not the unsharded score of its pre-image")
    if not np.allclose(
        actual["regularization_loss"], expected["regularization_loss"], rtol=1e-6, atol=1e-7
    ):
        problems.append("regularization_loss differs by more than 1e-6")
    return problems


def _sharding_problems(arrays: dict, mesh, batch_axis: int) -> list[str]:
    """Arrays not split along ``batch_axis`` into one block per device."""
    problems = []
    for name, array in arrays.items():
        spec = [None] * array.ndim
        spec[batch_axis] = "batch"
        expected = NamedSharding(mesh, P(*spec))
        shard_rows = {shard.data.shape[batch_axis] for shard in array.addressable_shards}
        if (
            not array.sharding.is_equivalent_to(expected, array.ndim)
            or len(array.sharding.device_set) != DEVICES
            or shard_rows != {array.shape[batch_axis] // DEVICES}
        ):
            problems.append(f"{name}: {array.sharding} with shard rows {shard_rows}")
    return problems


def _run(results, name, check):
    """Records ``check()``'s problems under ``name``; an exception is one more problem."""
    try:
        problems = check()
    except Exception as error:  # reported to the parent test, which fails on it
        first_line = (str(error).splitlines() or [""])[0]
        problems = [f"raised {type(error).__name__}: {first_line}"]
    results[name] = [not problems, "; ".join(problems)]


_rollout = nnx.jit(lambda sampler, x: sampler((), x))
_replay = nnx.jit(lambda sampler, x, stored: sampler((), x, stored))


def _nnx_jit_with_named_sharding(axis_type, shape, batch_axis):
    """Sharded and unsharded calls under nnx.jit: one run up to rounding, same stream."""
    mesh = jax.make_mesh((DEVICES,), ("batch",), axis_types=(axis_type,))
    spec = [None] * (len(shape) + 1)
    spec[batch_axis] = "batch"
    inputs = 4.0 * jax.random.normal(jax.random.key(1), (*shape, 2 * A))
    sharded_inputs = jax.device_put(inputs, NamedSharding(mesh, P(*spec)))
    plain = samplers.NormalTanhSampler(nnx.Rngs(3), ENTROPY_WEIGHT)
    sharded = samplers.NormalTanhSampler(nnx.Rngs(3), ENTROPY_WEIGHT)
    expected = normal_head_outputs(_rollout(plain, inputs))
    actual = normal_head_outputs(_rollout(sharded, sharded_inputs))
    problems = [f"rollout {p}" for p in _differences(inputs, expected, actual)]
    problems += _sharding_problems(actual, mesh, batch_axis)

    # The loss pass replays the unsharded rollout's pre-image on the sharded layout.
    expected_replay = normal_head_outputs(_replay(plain, inputs, expected["rollout_extras"]))
    actual_replay = normal_head_outputs(
        _replay(sharded, sharded_inputs, expected["rollout_extras"])
    )
    problems += _sharding_problems(actual_replay, mesh, batch_axis)
    for name in ("action", "log_likelihood"):
        if not np.array_equal(expected_replay[name], actual_replay[name]):
            problems.append(f"replay {name} differs")
        if not np.array_equal(expected[name], actual_replay[name]):
            problems.append(f"sharded replay {name} differs from the rollout's (ratio != 1)")
    if _count(plain) != _count(sharded) or _count(sharded) != 4:
        problems.append(f"stream counts {_count(plain)} and {_count(sharded)}, not 4 and 4")
    return problems


def _jax_jit_of_the_pure_layer():
    """The pure layer under jax.jit: one run up to rounding, outputs still sharded."""
    mesh = jax.make_mesh((DEVICES,), ("batch",))

    def sample(p, key):
        dist = samplers.normal_tanh(p)
        action, pre_image, log_prob = dist.sample_with_pre_image(seed=key)
        return {
            "action": action,
            "rollout_extras": pre_image,
            "log_likelihood": log_prob,
            "regularization_loss": -ENTROPY_WEIGHT * dist.entropy_estimate(seed=key),
            "mu": dist.loc,
            "sigma": dist.scale,
        }

    inputs = 4.0 * jax.random.normal(jax.random.key(2), (B, 2 * A))
    sharded_inputs = jax.device_put(inputs, NamedSharding(mesh, P("batch")))
    expected = jax.jit(sample)(inputs, jax.random.key(4))
    actual = jax.jit(sample)(sharded_inputs, jax.random.key(4))
    return _differences(inputs, expected, actual) + _sharding_problems(actual, mesh, 0)


def _in_shard_map(function, in_specs, out_specs):
    mesh = jax.make_mesh((DEVICES,), ("batch",))
    return jax.jit(jax.shard_map(function, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


def _batch_sharded(array):
    return jax.device_put(array, NamedSharding(jax.make_mesh((DEVICES,), ("batch",)), P("batch")))


def _same_blocks():
    """The same parameters in every block, so that only the noise can tell shards apart."""
    return jnp.tile(_inputs()[:ROWS], (DEVICES, 1))


def _key():
    return jax.random.key(7)


def _blocks(array):
    return np.asarray(array).reshape(DEVICES, ROWS, *np.shape(array)[1:])


def _shard_map_log_prob():
    """Scoring a stored pre-image inside shard_map is the unsharded computation, bit for bit."""

    def log_prob(p, x):
        return samplers.normal_tanh(p).log_prob_from_pre_image(x)

    pre_images = 20.0 * jax.random.normal(jax.random.key(6), (B, A))
    scored = _in_shard_map(log_prob, (P("batch"), P("batch")), P("batch"))(
        _batch_sharded(_inputs()), _batch_sharded(pre_images)
    )
    if np.array_equal(scored, jax.jit(log_prob)(_inputs(), pre_images)):
        return []
    return ["sharded log_prob_from_pre_image differs from unsharded"]


def _draw(p, key):
    return samplers.normal_tanh(p).sample_pre_image(seed=key)


def _shard_map_sampling_with_one_key():
    """Every shard draws as an unsharded call on its own block would: the same noise."""
    shared = _in_shard_map(_draw, (P("batch"), P()), P("batch"))(
        _batch_sharded(_same_blocks()), _key()
    )
    local_draw = np.asarray(jax.jit(_draw)(_same_blocks()[:ROWS], _key()))
    problems = []
    if not all(np.array_equal(block, local_draw) for block in _blocks(shared)):
        problems.append("a shard did not draw as an unsharded call on its own block")
    if np.array_equal(shared, jax.jit(_draw)(_same_blocks(), _key())):
        problems.append("shard_map with one key reproduced the global draw")
    return problems


def _shard_map_sampling_with_folded_keys():
    """Folding the shard index into the key gives every shard its own noise."""

    def draw_per_shard(p, key):
        return _draw(p, jax.random.fold_in(key, jax.lax.axis_index("batch")))

    folded = _blocks(
        _in_shard_map(draw_per_shard, (P("batch"), P()), P("batch"))(
            _batch_sharded(_same_blocks()), _key()
        )
    )
    if any(np.array_equal(folded[i], folded[j]) for i in range(DEVICES) for j in range(i)):
        return ["folding in axis_index left two shards with the same noise"]
    return []


def _shard_map_entropy_with_one_key():
    """The entropy estimate inside shard_map, with a replicated key, per block."""

    def entropy(p, key):
        return samplers.normal_tanh(p).entropy_estimate(seed=key)

    sharded = _in_shard_map(entropy, (P("batch"), P()), P("batch"))(
        _batch_sharded(_same_blocks()), _key()
    )
    local = np.asarray(jax.jit(entropy)(_same_blocks()[:ROWS], _key()))
    if all(np.array_equal(block, local) for block in _blocks(sharded)):
        return []
    return ["a shard's entropy estimate differs from an unsharded call on its block"]


def _shard_map_module_with_a_replicated_stream(check_vma=True):
    """A sampler merged inside shard_map from a replicated state: one noise for all shards."""
    graphdef, state = nnx.split(samplers.NormalTanhSampler(nnx.Rngs(8), ENTROPY_WEIGHT))

    def module_call(state, p):
        sampler = nnx.merge(graphdef, state)
        return sampler((), p).rollout_extras, nnx.state(sampler)

    mesh = jax.make_mesh((DEVICES,), ("batch",))
    call = jax.shard_map(
        module_call,
        mesh=mesh,
        in_specs=(P(), P("batch")),
        out_specs=(P("batch"), P()),
        check_vma=check_vma,
    )
    pre_image, next_state = jax.jit(call)(state, _batch_sharded(_same_blocks()))
    blocks = _blocks(pre_image)
    problems = []
    if not all(np.array_equal(block, blocks[0]) for block in blocks):
        problems.append("a replicated stream drew different noise on different shards")
    if int(next_state["rng"]["default"]["count"][...]) != 2:
        problems.append("the replicated stream did not advance by 2")
    return problems


def _shard_map_module_with_per_env_streams():
    """Per-environment keys split with the batch: each shard draws the unsharded run's noise."""
    sampler = samplers.NormalTanhSampler(nnx.Rngs(8), ENTROPY_WEIGHT, per_env_streams=True)
    keys = sampler.initialize_state(B)
    graphdef, state = nnx.split(sampler)

    def module_call(keys, p):
        out = nnx.merge(graphdef, state)(keys, p)
        return out.rollout_extras, out.regularization_loss, jax.random.key_data(out.next_state)

    expected = jax.jit(module_call)(keys, _same_blocks())
    actual = _in_shard_map(module_call, (P("batch"), P("batch")), (P("batch"),) * 3)(
        _batch_sharded(keys), _batch_sharded(_same_blocks())
    )
    problems = []
    if not np.allclose(actual[0], expected[0], rtol=1e-6, atol=1e-6):
        problems.append("a shard's per-environment samples differ from the unsharded run")
    if not np.allclose(actual[1], expected[1], rtol=1e-6, atol=1e-7):
        problems.append("a shard's entropy estimates differ from the unsharded run")
    if not np.array_equal(actual[2], expected[2]):
        problems.append("the next keys differ from the unsharded run")
    blocks = _blocks(actual[0])
    if any(np.array_equal(blocks[i], blocks[j]) for i in range(DEVICES) for j in range(i)):
        problems.append("two shards drew the same noise")
    return problems


def _nnx_scan_over_time():
    """nnx.scan over T with the batch sharded: the unsharded run up to rounding, still sharded."""
    mesh = jax.make_mesh((DEVICES,), ("batch",))

    @nnx.jit
    def rollout(sampler, sequence):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
        def step(sampler, x):
            return sampler, normal_head_outputs(sampler((), x))

        return step(sampler, sequence)[1]

    sequence = 4.0 * jax.random.normal(jax.random.key(9), (T, B, 2 * A))
    plain = samplers.NormalTanhSampler(nnx.Rngs(10), ENTROPY_WEIGHT)
    sharded = samplers.NormalTanhSampler(nnx.Rngs(10), ENTROPY_WEIGHT)
    expected = rollout(plain, sequence)
    actual = rollout(sharded, jax.device_put(sequence, NamedSharding(mesh, P(None, "batch"))))
    problems = _differences(sequence, expected, actual)
    problems += _sharding_problems(actual, mesh, 1)
    if _count(plain) != _count(sharded) or _count(sharded) != 2 * T:
        problems.append(f"stream counts {_count(plain)} and {_count(sharded)}, not {2 * T}")
    return problems


def _exact_entropy_sharded(axis_type, shape, batch_axis):
    """The exact entropy's value and gradient of a batch under jax.jit with the batch
    sharded: the unsharded run up to rounding, still sharded, and computed where it
    lies (no all-gather, no all-to-all)."""
    mesh = jax.make_mesh((DEVICES,), ("batch",), axis_types=(axis_type,))
    spec = [None] * len(shape)
    spec[batch_axis] = "batch"
    keys = jax.random.split(jax.random.key(12))
    loc = 3.0 * jax.random.normal(keys[0], shape)
    scale = jnp.exp(2.0 * jax.random.normal(keys[1], shape))

    def entropy(loc, scale):
        return samplers.SquashedNormal(loc, scale, samplers.Tanh()).entropy()

    @jax.jit
    def value_and_grad(loc, scale):
        grads = jax.grad(lambda *a: jnp.sum(entropy(*a)), argnums=(0, 1))(loc, scale)
        return {"entropy": entropy(loc, scale), "d loc": grads[0], "d scale": grads[1]}

    expected = value_and_grad(loc, scale)
    sharded = [jax.device_put(a, NamedSharding(mesh, P(*spec))) for a in (loc, scale)]
    actual = value_and_grad(*sharded)
    problems = [
        f"{name} differs from the unsharded run"
        for name in expected
        if not np.allclose(actual[name], expected[name], rtol=4 * EPS32, atol=4 * EPS32)
    ]
    problems += _sharding_problems(actual, mesh, batch_axis)
    program = value_and_grad.lower(*sharded).compile().as_text()
    problems += [f"the program has an {op}" for op in ("all-gather", "all-to-all") if op in program]
    return problems


def _check_devices():
    if jax.device_count() != DEVICES:
        raise RuntimeError(
            f"expected {DEVICES} devices, got {jax.device_count()}; run with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={DEVICES}."
        )


def main():
    _check_devices()
    results = {}
    for axis_type in (AxisType.Explicit, AxisType.Auto):
        for layout, shape, batch_axis in (("[B,2A]", (B,), 0), ("[T,B,2A]", (T, B), 1)):
            _run(
                results,
                f"nnx.jit {axis_type.name} {layout}",
                functools.partial(_nnx_jit_with_named_sharding, axis_type, shape, batch_axis),
            )
    _run(results, "jax.jit pure layer", _jax_jit_of_the_pure_layer)
    _run(results, "shard_map log_prob_from_pre_image", _shard_map_log_prob)
    _run(results, "shard_map sampling with one key", _shard_map_sampling_with_one_key)
    _run(results, "shard_map sampling with folded keys", _shard_map_sampling_with_folded_keys)
    _run(results, "shard_map entropy with one key", _shard_map_entropy_with_one_key)
    _run(results, "shard_map module", _shard_map_module_with_a_replicated_stream)
    _run(
        results,
        "shard_map module without the varying-axes check",
        functools.partial(_shard_map_module_with_a_replicated_stream, check_vma=False),
    )
    _run(results, "shard_map module with per-env streams", _shard_map_module_with_per_env_streams)
    _run(results, "nnx.scan over time", _nnx_scan_over_time)
    print(json.dumps(results))


def entropy_main():
    """The exact entropy's checks alone (``--entropy``): the slow tier's."""
    _check_devices()
    results = {}
    for axis_type, layout, shape, batch_axis in (
        (AxisType.Explicit, "[B,A]", (2048, 8), 0),
        (AxisType.Auto, "[T,B,A]", (3, 1024, 8), 1),
        (AxisType.Explicit, "[B,A] B=4100", (4100, 8), 0),
    ):
        _run(
            results,
            f"exact entropy sharded {axis_type.name} {layout}",
            functools.partial(_exact_entropy_sharded, axis_type, shape, batch_axis),
        )
    print(json.dumps(results))


if __name__ == "__main__":
    entropy_main() if "--entropy" in sys.argv[1:] else main()
