"""Rows of the guarantees table (docs/guides/guarantees.md) no other test checks as worded.

For every squashing the table names (``NormalTanhSampler``, ``BoundedTanh``,
``samplers.Sigmoid`` and the identity): replay needs no inverse; NaN and inf
parameters reach that batch element only; ``checked=True`` names the first bad
element; low-precision parameters compute in float32; under ``jax_enable_x64`` the
values and gradients match float64 formulas written out here and differentiated by
``jax.grad``. The squashings of the tanh family share one code path: where a check
costs a compilation per squashing, the default tier runs it for some of them and the
slow tier for all.
"""

import functools

import distrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental import checkify

import samplers
from tests._tiers import JIT_MODES, SLOW, each_value_once
from tests.helpers import head_outputs, normal_inputs

A = 3
_inputs = functools.partial(normal_inputs, width=2 * A, scale=3.0)
ENTROPY_WEIGHT = 0.01
MIN_STD = 1e-3
STD_SCALE = 1.0
LOW = np.array([-2.0, 0.0, -0.5])
HIGH = np.array([2.0, 1.0, 3.0])
KINDS = ["tanh", "bounded", "sigmoid", "identity"]


def _kinds(*default):
    """The squashings as ``parametrize`` cases, those not named in ``default`` slow."""
    return [pytest.param(k, id=k, marks=[] if k in default else [SLOW]) for k in KINDS]


# One instance: nnx.jit treats the Lambda's function as static, a new one retraces.
IDENTITY = distrax.Lambda(lambda x: x)


def _bijector(kind):
    if kind == "bounded":
        return samplers.BoundedTanh(jnp.asarray(LOW), jnp.asarray(HIGH))
    if kind == "sigmoid":
        return samplers.Sigmoid()
    return IDENTITY


def _sampler(kind, seed=0, entropy_weight=ENTROPY_WEIGHT, **options):
    if kind == "tanh":
        return samplers.NormalTanhSampler(nnx.Rngs(seed), entropy_weight, **options)
    return samplers.SquashedNormalSampler(
        nnx.Rngs(seed), entropy_weight, bijector=_bijector(kind), **options
    )


def _outputs_and_all_metrics(out):
    return {**head_outputs(out), **{f"metrics/{k}": v for k, v in out.metrics.items()}}


def _rollout_and_replay(sampler, mean_and_std, deterministic=False):
    sampler.set_attributes(deterministic=deterministic)
    rollout = sampler((), mean_and_std)
    return rollout, sampler((), mean_and_std, rollout.rollout_extras)


# Guarantees, "Replaying the stored pre-image ... with no inverse": the
# bijector's inverse raises, and rollout and replay run and agree bit for bit.
@pytest.mark.parametrize("jitted", JIT_MODES)
@pytest.mark.parametrize("kind", _kinds("bounded", "identity"))
def test_rollout_and_replay_never_invert_the_squashing(kind, jitted, monkeypatch):
    sampler = _sampler(kind)
    inner = type(sampler.bijector)

    def refuse(*args, **kwargs):
        raise AssertionError(f"{inner.__name__}'s inverse was called")

    for method in ("inverse", "inverse_and_log_det", "inverse_log_det_jacobian"):
        monkeypatch.setattr(inner, method, refuse)
    call = nnx.jit(lambda s, *args: s((), *args)) if jitted else (lambda s, *args: s((), *args))
    mean_and_std = _inputs((4,), seed=1) * 5.0  # saturated pre-images too
    for deterministic in (False, True):
        sampler.set_attributes(deterministic=deterministic)
        rollout = call(sampler, mean_and_std)
        replay = call(sampler, mean_and_std, rollout.rollout_extras)
        np.testing.assert_array_equal(
            replay.output["log_likelihood"], rollout.output["log_likelihood"]
        )
        assert np.all(np.isfinite(replay.output["log_likelihood"]))
    with pytest.raises(AssertionError, match="inverse was called"):
        sampler.bijector.inverse(jnp.zeros(A))


# Guarantees, "Bad configuration and input are refused ... (integer or bool
# dtypes, NaN or inf options ...)", for the cases no module test lists.
@pytest.mark.parametrize(
    "options, error, message",
    [
        ({"min_std": np.inf}, ValueError, r"min_std must be finite, got inf"),
        ({"min_std": np.nan}, ValueError, r"min_std must be finite, got nan"),
        ({"std_scale": np.inf}, ValueError, r"std_scale must be finite, got inf"),
        ({"entropy_weight": -np.inf}, ValueError, r"entropy_weight must be finite, got -inf"),
    ],
)
@pytest.mark.parametrize("kind", KINDS)
def test_non_finite_options_are_refused_at_construction(kind, options, error, message):
    with pytest.raises(error, match=message):
        _sampler(kind, **options)


@pytest.mark.parametrize("dtype", [jnp.bool_, jnp.int32, jnp.uint8])
@pytest.mark.parametrize("kind", KINDS)
def test_bool_and_integer_parameters_are_refused_at_trace_time(kind, dtype):
    message = rf"mean_and_std must have a floating dtype, got {jnp.dtype(dtype).name}; cast it"
    with pytest.raises(TypeError, match=message):
        nnx.jit(lambda s, x: s((), x))(_sampler(kind), jnp.zeros((2, 2 * A), dtype))


# Guarantees, "NaN or inf inside parameters at run time ...".
POISONS = [
    ("nan", "mean", np.nan),
    ("nan", "raw_std", np.nan),
    ("+inf", "mean", np.inf),
    ("-inf", "mean", -np.inf),
    ("+inf", "raw_std", np.inf),
    ("-inf", "raw_std", -np.inf),
]


@pytest.mark.parametrize(
    *each_value_once(
        {"kind": {k: k for k in KINDS}, "deterministic": {"train": False, "eval": True}}
    )
)
def test_non_finite_parameters_reach_that_batch_element_only(kind, deterministic):
    """A poisoned element's log-likelihood is NaN or inf in rollout and replay; every
    output of the other elements is bit-identical to the run without the bad values.
    One poison a batch row, so one call checks them all and that rows do not mix."""
    clean = _inputs((len(POISONS) + 2,))
    poisoned = clean
    for row, (_, where, value) in enumerate(POISONS):
        poisoned = poisoned.at[row, 1 if where == "mean" else A + 1].set(value)
    expected = _rollout_and_replay(_sampler(kind), clean, deterministic)
    actual = _rollout_and_replay(_sampler(kind), poisoned, deterministic)
    bad, others = np.arange(len(POISONS)), np.arange(len(POISONS), len(POISONS) + 2)
    for expected_out, actual_out in zip(expected, actual, strict=True):
        assert not np.any(np.isfinite(actual_out.output["log_likelihood"][bad]))
        expected_flat, actual_flat = (
            _outputs_and_all_metrics(expected_out),
            _outputs_and_all_metrics(actual_out),
        )
        assert set(expected_flat) == set(actual_flat)
        for name, array in expected_flat.items():
            np.testing.assert_array_equal(actual_flat[name][others], array[others], err_msg=name)


# Guarantees, "`checked=True` raises ... with the first offending batch index".
# Each kind and each non-finite value at least once.
@pytest.mark.parametrize(
    "kind, value",
    [("tanh", np.nan), ("bounded", np.inf), ("sigmoid", -np.inf), ("identity", np.nan)],
    ids=["tanh-nan", "bounded-+inf", "sigmoid--inf", "identity-nan"],
)
def test_checked_mode_names_the_first_non_finite_batch_element(kind, value):
    apply, state = samplers.functional(_sampler(kind, checked=True))
    poisoned = _inputs((3, 4)).at[2, 1, A].set(value).at[2, 3, 0].set(value)
    error, _ = checkify.checkify(apply)(state, poisoned)
    assert "non-finite value at flat batch index 9 of batch shape (3, 4)" in error.get()
    error, (out, _) = checkify.checkify(apply)(state, _inputs((3, 4)))
    assert error.get() is None and np.all(np.isfinite(out.output["log_likelihood"]))


def _all_samplers(seed=0):
    """Every squashed-Normal sampler: the four squashings and the learned-std one."""
    return {
        **{kind: _sampler(kind, seed) for kind in KINDS},
        "state-independent": samplers.StateIndependentSampler(nnx.Rngs(seed), A, ENTROPY_WEIGHT),
    }


def _sampler_inputs(name, mean_and_std):
    return mean_and_std[..., :A] if name == "state-independent" else mean_and_std


# Guarantees, "float16 and bfloat16 parameters are computed in float32 and
# return float32".
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["float16", "bfloat16"])
def test_low_precision_parameters_compute_in_float32_in_every_sampler(dtype):
    """Every output is float32 and equals, bit for bit, the call on the float32 upcast."""
    low = _inputs((4,)).astype(dtype)
    for name, sampler in _all_samplers().items():
        upcast_sampler = _all_samplers()[name]
        for deterministic in (False, True):
            ours = _rollout_and_replay(sampler, _sampler_inputs(name, low), deterministic)
            upcast = _rollout_and_replay(
                upcast_sampler, _sampler_inputs(name, low.astype(jnp.float32)), deterministic
            )
            for ours_out, upcast_out in zip(ours, upcast, strict=True):
                for field, array in _outputs_and_all_metrics(upcast_out).items():
                    assert _outputs_and_all_metrics(ours_out)[field].dtype == jnp.float32, (
                        name,
                        field,
                    )
                    np.testing.assert_array_equal(
                        _outputs_and_all_metrics(ours_out)[field], array, err_msg=f"{name} {field}"
                    )


# Float64 formulas written from the maths, in jnp so that jax.grad can differentiate
# them; none calls the library.


def _log_abs_derivative(kind, x):
    log_sech2 = 2 * jnp.log(2.0) - 2 * jnp.logaddexp(x, -x)
    if kind == "tanh":
        return log_sech2
    if kind == "bounded":
        return jnp.broadcast_to(jnp.log((HIGH - LOW) / 2), x.shape) + log_sech2
    if kind == "sigmoid":
        return -jnp.logaddexp(0.0, x) - jnp.logaddexp(0.0, -x)
    return jnp.zeros_like(x)


def _loss_float64(kind, mean_and_std, pre_image, entropy_noise):
    """Summed log-likelihood of ``pre_image`` plus entropy cost, in float64."""
    mean, raw_std = jnp.split(mean_and_std, 2, axis=-1)
    std = (jnp.logaddexp(raw_std, 0.0) + MIN_STD) * STD_SCALE
    log_normal = -0.5 * ((pre_image - mean) / std) ** 2 - jnp.log(std) - 0.5 * jnp.log(2 * jnp.pi)
    log_likelihood = jnp.sum(log_normal - _log_abs_derivative(kind, pre_image), axis=-1)
    normal_entropy = 0.5 + 0.5 * jnp.log(2 * jnp.pi) + jnp.log(std)
    noisy = mean + std * entropy_noise
    entropy = jnp.sum(normal_entropy + _log_abs_derivative(kind, noisy), axis=-1)
    return jnp.sum(log_likelihood - ENTROPY_WEIGHT * entropy), (log_likelihood, entropy)


# The oracle and its gradient, one program per squashing and shapes.
_oracle_value_and_grad = jax.jit(
    jax.value_and_grad(_loss_float64, argnums=1, has_aux=True), static_argnums=0
)


# Guarantees, "under jax_enable_x64 everything is float64 and matches the
# float64 closed form to 1e-12": values, entropy cost and gradients, every sampler.
@pytest.mark.parametrize("kind", _kinds("tanh", "sigmoid"))
def test_float64_values_entropy_and_gradients_match_float64_formulas_to_1e_12(kind):
    with jax.enable_x64(True):
        mean_and_std = _inputs((4,)).astype(jnp.float64)
        # Stored pre-images, saturated ones included (|x| >= 10).
        stored = jnp.array(
            [[0.3, -1.2, 2.0], [10.0, -20.0, 50.0], [-10.0, 20.0, -50.0], [4.0, 0.0, -7.5]],
            jnp.float64,
        )
        sampler = _sampler(kind, seed=5)
        stream = nnx.Rngs(5)  # the sampler's keys: one for the sample, one for the entropy

        def loss(sampler, mean_and_std):
            out = sampler((), mean_and_std, stored)
            return jnp.sum(out.output["log_likelihood"] + out.regularization_loss), out

        (_, out), grad = nnx.value_and_grad(loss, argnums=1, has_aux=True)(sampler, mean_and_std)
        stream()
        noise = jax.random.normal(stream(), stored.shape, jnp.float64)
        (_, (log_likelihood, entropy)), expected_grad = _oracle_value_and_grad(
            kind, mean_and_std, stored, noise
        )

        for leaf in (*jax.tree.leaves(out), grad):
            assert leaf.dtype == jnp.float64, leaf.dtype
        np.testing.assert_allclose(out.output["log_likelihood"], log_likelihood, rtol=1e-12)
        np.testing.assert_allclose(out.regularization_loss, -ENTROPY_WEIGHT * entropy, rtol=1e-12)
        np.testing.assert_allclose(grad, expected_grad, rtol=1e-12, atol=1e-12)

        rollout = _sampler(kind, seed=6)((), mean_and_std)
        for leaf in jax.tree.leaves(rollout):
            assert leaf.dtype == jnp.float64, leaf.dtype
        (_, (log_likelihood, _)), _ = _oracle_value_and_grad(
            kind, mean_and_std, rollout.rollout_extras, noise
        )
        np.testing.assert_allclose(rollout.output["log_likelihood"], log_likelihood, rtol=1e-12)


def test_state_independent_sampler_is_float64_under_x64():
    with jax.enable_x64(True):
        sampler = samplers.StateIndependentSampler(nnx.Rngs(0), A, ENTROPY_WEIGHT)
        mean = _inputs((4,)).astype(jnp.float64)[..., :A]
        rollout = sampler((), mean)
        replay = sampler((), mean, rollout.rollout_extras)
        for leaf in (*jax.tree.leaves(rollout), *jax.tree.leaves(replay)):
            assert leaf.dtype == jnp.float64, leaf.dtype
