"""The squashed-Normal heads: ``NormalTanhSampler``, ``SquashedNormalSampler`` and
``StateIndependentSampler``.

The specified sampler's call, step by step (``tests/reference.py``); replay bit for bit;
``eval()`` acting with the squashed mean; gradients; ``nnx.jit`` and ``nnx.scan``; the
options (bounds, entropy estimators, ``log_ratio_metrics``, ``checked``, the
state-independent std) and the refusals of bad replay data and configuration. What
every head does alike (the stream, per-environment streams, the state) is in
``test_action_sampler.py``; the distribution's maths in
``tests/distributions/test_squashed_normal*.py``.
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
from tests import reference
from tests._tiers import JIT_MODES, each_value_once, slow
from tests.helpers import (
    NORMAL_HEAD_FIELDS,
    TRACES,
    clones_of,
    jitted_call,
    keys_drawn,
    normal_head_outputs,
    normal_inputs,
    stateless_call,
)

A = 3
OPTIONS = {"entropy_weight": 0.01, "min_std": 1e-3, "std_scale": 1.0}
_inputs = functools.partial(normal_inputs, width=2 * A, scale=2.0)
# New heads as ``NormalTanhSampler(nnx.Rngs(0), **OPTIONS)`` builds them, sharing its programs
# (a program per head configuration and shapes).
_tanh_head = clones_of(lambda: samplers.NormalTanhSampler(nnx.Rngs(0), **OPTIONS))


CUSTOM = {"entropy_weight": 0.3, "min_std": 0.05, "std_scale": 2.0}


# Each batch shape, eager and nnx.jit, default and custom options, each at least once;
# the default tier runs the first case (the specified call: default options, eager).
@pytest.mark.parametrize(
    "batch_shape, jitted, options",
    [
        pytest.param((), False, OPTIONS, id="(A,)-eager-default"),
        slow((5,), True, CUSTOM, id="(B,A)-nnx.jit-custom"),
        slow((3, 4), False, CUSTOM, id="(T,B,A)-eager-custom"),
        slow((3, 4), True, OPTIONS, id="(T,B,A)-nnx.jit"),
    ],
)
def test_interchangeable_with_the_specified_sampler_call_after_call(batch_shape, jitted, options):
    head = samplers.NormalTanhSampler(nnx.Rngs(42), **options)
    spec_rngs = nnx.Rngs(42)
    call = stateless_call(jitted)
    stored = None
    # Rollout, replay, a second rollout, then eval rollout and eval replay, then train again.
    for step, (mode, replay) in enumerate(
        [
            ("train", False),
            ("train", True),
            ("train", False),
            ("eval", False),
            ("eval", True),
            ("train", False),
        ]
    ):
        head.eval() if mode == "eval" else head.train()
        mean_and_std = _inputs(batch_shape, seed=step)
        extras = stored if replay else None
        ours = normal_head_outputs(
            call(head, mean_and_std, extras) if replay else call(head, mean_and_std)
        )
        spec = reference.spec_sampler_call(
            spec_rngs, mean_and_std, extras, deterministic=mode == "eval", **options
        )
        for field in NORMAL_HEAD_FIELDS:
            np.testing.assert_allclose(
                ours[field], spec[field], rtol=1e-5, atol=1e-5, err_msg=f"step {step}: {field}"
            )
        assert keys_drawn(head) == keys_drawn(spec_rngs)
        if not replay:
            stored = (
                _inputs(batch_shape, scale=3.0, seed=100 + step)[..., :A] + ours["rollout_extras"]
            )


# Guarantees, "Replaying the stored pre-image ... reproduces the log-likelihood
# bit for bit": eagerly and under nnx.jit, train and eval.
@pytest.mark.parametrize("deterministic", [False, True], ids=["train", "eval"])
@pytest.mark.parametrize("jitted", JIT_MODES)
def test_replay_reproduces_the_rollout_log_likelihood(batch_shape, jitted, deterministic):
    head = _tanh_head()
    head.set_attributes(deterministic=deterministic)
    call = stateless_call(jitted)
    mean_and_std = _inputs(batch_shape, scale=8.0)  # many saturated actions
    rollout = call(head, mean_and_std)
    replay = call(head, mean_and_std, rollout.rollout_extras)
    np.testing.assert_array_equal(replay.output["log_likelihood"], rollout.output["log_likelihood"])
    np.testing.assert_array_equal(replay.output["action"], rollout.output["action"])


def test_eval_acts_with_the_squashed_mean_and_train_samples_again():
    head = samplers.NormalTanhSampler(nnx.Rngs(0), **OPTIONS)
    mean_and_std = _inputs((4,))
    head.eval()
    assert head.deterministic
    out = head((), mean_and_std)
    np.testing.assert_array_equal(out.output["action"], jnp.tanh(mean_and_std[..., :A]))
    head.train()
    assert not head.deterministic
    assert not jnp.allclose(head((), mean_and_std).output["action"], out.output["action"])


def test_gradients_reach_mean_and_std_but_never_the_stored_action():
    head = samplers.NormalTanhSampler(nnx.Rngs(0), **OPTIONS)
    mean_and_std = _inputs((4,))
    stored = head((), mean_and_std).rollout_extras

    def loss(head, params, pre_image):
        out = head((), params, pre_image)
        return jnp.sum(out.output["log_likelihood"] + out.regularization_loss)

    grad_params, grad_stored = nnx.jit(nnx.grad(loss, argnums=(1, 2)))(head, mean_and_std, stored)
    assert jnp.all(grad_params != 0) and jnp.all(jnp.isfinite(grad_params))
    np.testing.assert_array_equal(grad_stored, 0.0)


def _replayed_log_likelihood(head, params, stored):
    return head((), params, stored).output["log_likelihood"]


# One program for the cases below (the same head configuration and shapes).
_replay_value_and_grad = nnx.jit(nnx.value_and_grad(_replayed_log_likelihood, argnums=1))


@pytest.mark.parametrize("z", [10.0, -20.0, 50.0])
def test_saturated_replay_is_finite_with_finite_gradients(z):
    head = samplers.NormalTanhSampler(nnx.Rngs(0), **OPTIONS)
    mean_and_std = jnp.array([z, z, -1.0, -1.0])
    stored = head((), mean_and_std).rollout_extras
    assert jnp.all(jnp.abs(jnp.tanh(stored)) == 1.0)
    value, grad = _replay_value_and_grad(head, mean_and_std, stored)
    assert jnp.isfinite(value) and jnp.all(jnp.isfinite(grad))


@pytest.mark.slow
def test_value_and_grad_through_a_policy_network():
    class Policy(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(5, 2 * A, rngs=rngs)
            self.head = samplers.NormalTanhSampler(rngs, **OPTIONS)

        def __call__(self, obs, extras=None):
            return self.head((), self.linear(obs), extras)

    policy = Policy(nnx.Rngs(0))
    obs = jax.random.normal(jax.random.key(1), (8, 5))
    stored = policy(obs)

    @nnx.jit
    def loss_and_grad(policy, obs, stored):
        def loss(policy):
            out = policy(obs, stored.rollout_extras)
            ratio = jnp.exp(out.output["log_likelihood"] - stored.output["log_likelihood"])
            return jnp.mean(-ratio + out.regularization_loss), ratio

        return nnx.value_and_grad(loss, has_aux=True)(policy)

    (_, ratio), grads = loss_and_grad(policy, obs, stored)
    np.testing.assert_allclose(ratio, 1.0, atol=1e-6)
    assert jnp.all(grads["linear"]["kernel"][...] != 0)


def test_nnx_jit_does_not_retrace_on_repeated_calls():
    # The shapes of the replay test above, which then shares the programs.
    head = _tanh_head()
    rollout = jitted_call(head, (), _inputs((3, 4)))
    jitted_call(head, (), _inputs((3, 4)), rollout.rollout_extras)
    traces = len(TRACES)
    for seed in range(4):
        jitted_call(head, (), _inputs((3, 4), seed=seed), rollout.rollout_extras)
        jitted_call(head, (), _inputs((3, 4), seed=seed))
    assert len(TRACES) == traces


def test_nnx_scan_over_time_matches_a_python_loop():
    sequence = _inputs((6, 4))  # [T, B, 2A]
    looped = samplers.NormalTanhSampler(nnx.Rngs(7), **OPTIONS)
    expected = [looped((), x) for x in sequence]

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
    def rollout(head, x):
        out = head((), x)
        return head, (out.output["action"], out.output["log_likelihood"])

    scanned = samplers.NormalTanhSampler(nnx.Rngs(7), **OPTIONS)
    _, (actions, log_likelihoods) = rollout(scanned, sequence)
    np.testing.assert_allclose(
        actions, jnp.stack([o.output["action"] for o in expected]), atol=1e-6
    )
    np.testing.assert_allclose(
        log_likelihoods, jnp.stack([o.output["log_likelihood"] for o in expected]), rtol=1e-5
    )
    assert keys_drawn(scanned) == keys_drawn(looped)


def test_generic_sampler_with_bounds_keeps_actions_inside_and_replays():
    low, high = jnp.array([-2.0, 0.0, -0.5]), jnp.array([2.0, 1.0, 3.0])
    head = samplers.SquashedNormalSampler(
        nnx.Rngs(0), 0.01, bijector=samplers.BoundedTanh(low, high)
    )
    mean_and_std = _inputs((64,), scale=20.0)
    rollout = nnx.jit(lambda head, x: head((), x))(head, mean_and_std)
    action = rollout.output["action"]
    assert jnp.all(action >= low[None]) and jnp.all(action <= high[None])
    replay = head((), mean_and_std, rollout.rollout_extras)
    np.testing.assert_allclose(
        replay.output["log_likelihood"], rollout.output["log_likelihood"], rtol=1e-6
    )
    assert jnp.all(jnp.isfinite(rollout.regularization_loss))


# distrax's Sigmoid is a squashing, scored as the oracle tests check: slow.
@pytest.mark.parametrize(
    "bijector",
    [
        slow(distrax.Sigmoid(), id="sigmoid"),
        pytest.param(distrax.Lambda(lambda x: x), id="identity"),
    ],
)
def test_generic_sampler_scores_with_its_distribution(bijector):
    head = samplers.SquashedNormalSampler(nnx.Rngs(0), 0.01, bijector=bijector)
    mean_and_std = _inputs((4,))
    out = head((), mean_and_std)
    dist = head.distribution(mean_and_std)
    np.testing.assert_allclose(
        out.output["log_likelihood"], dist.log_prob(out.output["action"]), rtol=1e-4, atol=1e-4
    )


@pytest.mark.parametrize(
    "extras, error, message",
    [
        (jnp.zeros((4, 2)), ValueError, r"must have the action shape \(4, 3\).*got \(4, 2\)"),
        (jnp.zeros((3,)), ValueError, r"must have the action shape \(4, 3\).*got \(3,\)"),
        (jnp.zeros((1, 4, 3)), ValueError, r"must have the action shape \(4, 3\).*got \(1, 4, 3\)"),
        (jnp.zeros((4, 3), jnp.int32), TypeError, r"rollout_extras must have a floating dtype"),
    ],
)
@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "nnx.jit"])
def test_a_replayed_action_of_the_wrong_shape_or_dtype_is_refused(extras, error, message, jitted):
    head = samplers.NormalTanhSampler(nnx.Rngs(0), **OPTIONS)
    with pytest.raises(error, match=message):
        stateless_call(jitted)(head, _inputs((4,)), extras)


def _squashed_heads(**options):
    return {
        "NormalTanhSampler": samplers.NormalTanhSampler(nnx.Rngs(0), **OPTIONS, **options),
        "SquashedNormalSampler": samplers.SquashedNormalSampler(
            nnx.Rngs(0), 0.01, bijector=samplers.BoundedTanh(-2.0, 2.0), **options
        ),
        "StateIndependentSampler": samplers.StateIndependentSampler(
            nnx.Rngs(0), A, 0.01, **options
        ),
    }


def _head_inputs(name, inputs):
    return inputs[..., :A] if name == "StateIndependentSampler" else inputs


# The three heads share SquashedNormalSampler's code: each runs by default in one of the
# tests below, the others in the slow tier.
HEAD_NAMES = {
    n: n for n in ("NormalTanhSampler", "SquashedNormalSampler", "StateIndependentSampler")
}


@pytest.mark.parametrize(
    *each_value_once(
        {
            "dtype, jitted": {
                "bfloat16-eager": (jnp.bfloat16, False),
                "float16-nnx.jit": (jnp.float16, True),
            },
            "name": HEAD_NAMES,
        },
        slow_ids={"SquashedNormalSampler"},
    )
)
def test_a_replayed_pre_image_stored_in_lower_precision_is_refused(dtype, jitted, name):
    inputs = _inputs((64,))
    rollout = samplers.NormalTanhSampler(nnx.Rngs(0), **OPTIONS)((), inputs)
    rounded = rollout.rollout_extras.astype(dtype)
    # Why: the float64 log-likelihood of the rounded pre-image is not the rollout's, so
    # the replayed PPO ratio would not be 1.
    mean, std = reference.params_float64(inputs)
    moved = reference.tanh_normal_log_prob_float64(np.asarray(rounded, np.float64), mean, std)
    assert np.max(np.abs(moved - np.asarray(rollout.output["log_likelihood"]))) > 1e-2
    message = (
        rf"rollout_extras must be stored in float32 \(or wider\), the dtype this sampler "
        rf"computes in, got {jnp.dtype(dtype).name}: .* store rollout_extras in float32, as "
        rf"the rollout call emitted them"
    )
    head = _squashed_heads()[name]
    with pytest.raises(TypeError, match=message):
        stateless_call(jitted)(head, _head_inputs(name, inputs), rounded)
    # Stored as emitted, the replay reproduces the rollout.
    out = stateless_call(jitted)(_squashed_heads()[name], _head_inputs(name, inputs))
    again = stateless_call(jitted)(head, _head_inputs(name, inputs), out.rollout_extras)
    np.testing.assert_array_equal(again.output["log_likelihood"], out.output["log_likelihood"])


@pytest.mark.parametrize("field", ["pre_image", "log_likelihood"])
def test_a_lower_precision_value_stored_with_log_ratio_metrics_is_refused(field):
    for name, head in _squashed_heads(log_ratio_metrics=True).items():
        inputs = _head_inputs(name, _inputs((4,)))
        extras = dict(head((), inputs).rollout_extras)
        extras[field] = extras[field].astype(jnp.bfloat16)
        expected = (
            "rollout_extras" if field == "pre_image" else r"rollout_extras\['log_likelihood'\]"
        )
        with pytest.raises(
            TypeError,
            match=rf"{expected} must be stored in float32 \(or wider\).*got bfloat16",
        ):
            head((), inputs, extras)


# The other two heads repeat NormalTanhSampler's check with their class's code: slow
# (tests/docs/test_guarantees.py checks the state-independent head's float64 outputs).
@pytest.mark.parametrize(
    "name", ["NormalTanhSampler", slow("SquashedNormalSampler"), slow("StateIndependentSampler")]
)
def test_under_x64_a_float32_pre_image_for_a_float64_sampler_is_refused(name):
    with jax.enable_x64(True):
        inputs = _inputs((8,)).astype(jnp.float64)
        head = _squashed_heads(log_ratio_metrics=True)[name]
        extras = head((), _head_inputs(name, inputs)).rollout_extras
        assert extras["pre_image"].dtype == jnp.float64
        for field in ("pre_image", "log_likelihood"):
            rounded = {**extras, field: extras[field].astype(jnp.float32)}
            with pytest.raises(TypeError, match=r"stored in float64 \(or wider\).*got float32"):
                head((), _head_inputs(name, inputs), rounded)
        # float32 parameters compute in float32: a float32 pre-image replays.
        inputs32 = _head_inputs(name, inputs.astype(jnp.float32))
        stored = head((), inputs32).rollout_extras
        assert stored["pre_image"].dtype == jnp.float32
        head((), inputs32, stored)


def test_odd_input_is_refused_by_the_module():
    head = samplers.NormalTanhSampler(nnx.Rngs(0), **OPTIONS)
    with pytest.raises(ValueError, match=r"last axis of even length .* got shape \(4, 5\)"):
        head((), jnp.zeros((4, 5)))


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"entropy_weight": float("inf")}, ValueError, r"entropy_weight must be finite, got inf"),
        ({"entropy_weight": float("nan")}, ValueError, r"entropy_weight must be finite, got nan"),
        ({"entropy_weight": None}, TypeError, r"entropy_weight is required; pass a real number"),
        ({"min_std": -1e-3}, ValueError, r"min_std must be >= 0.0, got -0.001"),
        ({"std_scale": -1.0}, ValueError, r"std_scale must be > 0.0, got -1.0"),
        ({"rngs": 0}, TypeError, r"rngs must be an nnx.Rngs or an nnx.RngStream, got int; pass"),
    ],
)
def test_bad_configuration_is_refused_at_construction(kwargs, error, message):
    arguments = {"rngs": nnx.Rngs(0), **OPTIONS, **kwargs}
    with pytest.raises(error, match=message):
        samplers.NormalTanhSampler(**arguments)


@pytest.mark.parametrize(
    "entropy, points",
    [("sample", None), ("sample", 4), ("quadrature", None), ("exact", None), ("base", None)],
)
def test_every_entropy_estimator_keeps_the_stream_and_replay(entropy, points):
    choice = entropy if points is None else (entropy, points)
    head = samplers.NormalTanhSampler(nnx.Rngs(3), 0.1, entropy=choice)
    default = samplers.NormalTanhSampler(nnx.Rngs(3), 0.1)
    mean_and_std = _inputs((4,))
    rollout = head((), mean_and_std)
    reference_rollout = default((), mean_and_std)
    np.testing.assert_array_equal(rollout.rollout_extras, reference_rollout.rollout_extras)
    replay = head((), mean_and_std, rollout.rollout_extras)
    default((), mean_and_std, rollout.rollout_extras)
    # The rollouts draw alike; a replay draws keys only for an entropy estimated from
    # a sample, and then as the specified sampler does (the unused sample key too).
    assert keys_drawn(default) == 4
    assert keys_drawn(head) == (4 if entropy == "sample" else 2)
    np.testing.assert_allclose(
        replay.output["log_likelihood"], rollout.output["log_likelihood"], rtol=1e-6
    )
    assert jnp.all(jnp.isfinite(replay.regularization_loss))


def test_deterministic_estimators_do_not_depend_on_the_key():
    mean_and_std = _inputs((4,))
    losses = [
        samplers.NormalTanhSampler(nnx.Rngs(seed), 0.1, entropy="quadrature")(
            (), mean_and_std
        ).regularization_loss
        for seed in (0, 1)
    ]
    np.testing.assert_array_equal(losses[0], losses[1])


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"entropy": "closed"}, ValueError, r"entropy must be 'sample', 'quadrature', 'exact' "),
        ({"entropy": ("exact", 4)}, ValueError, r"or \('quadrature', n\) with n >= 1, got \('ex"),
        ({"entropy": ("sample", 0)}, ValueError, r"entropy=\('sample', 0\) must be a positive int"),
        ({"entropy": ("sample", 1.5)}, TypeError, r"entropy=\('sample', 1.5\) must be a positive"),
        ({"entropy_weight": 0.1}, TypeError, r"multiple values for argument 'entropy_weight'"),
        ({"temperature": 0.1}, TypeError, r"unexpected keyword argument 'temperature'"),
    ],
)
def test_bad_entropy_options_are_refused(kwargs, error, message):
    with pytest.raises(error, match=message):
        samplers.NormalTanhSampler(nnx.Rngs(0), 0.1, **kwargs)


def test_bounds_are_configuration_not_state():
    head = samplers.SquashedNormalSampler(
        nnx.Rngs(0), 0.01, bijector=samplers.BoundedTanh(jnp.array([-2.0, 0.0]), 1.0 + jnp.ones(2))
    )
    assert set(nnx.to_pure_dict(nnx.state(head))) == {"rng"}
    state = nnx.to_pure_dict(nnx.state(head))  # a snapshot: arrays, not the live variables
    head((), _inputs((4,))[..., :4])
    nnx.update(head, state)  # writes the stream back; nothing else to write
    assert keys_drawn(head) == 0
    assert isinstance(nnx.clone(head).bijector, samplers.BoundedTanh)


def test_state_independent_std_is_a_learned_parameter():
    head = samplers.StateIndependentSampler(nnx.Rngs(0), A, 0.01, initial_std=0.7)
    mean = _inputs((4,))[..., :A]
    rollout = head((), mean)
    np.testing.assert_allclose(rollout.metrics["sigma"], jnp.full((4, A), 0.7), rtol=1e-6)
    expected = reference.tanh_normal_log_prob_float64(rollout.rollout_extras, mean, 0.7)
    np.testing.assert_allclose(rollout.output["log_likelihood"], expected, rtol=1e-5)
    replay = head((), mean, rollout.rollout_extras)
    np.testing.assert_allclose(
        replay.output["log_likelihood"], rollout.output["log_likelihood"], rtol=1e-6
    )
    assert keys_drawn(head) == 4

    def loss(head):
        out = head((), mean, rollout.rollout_extras)
        return jnp.sum(out.output["log_likelihood"] + out.regularization_loss)

    grads = nnx.jit(nnx.grad(loss))(head)
    assert jnp.all(jnp.isfinite(grads["log_std"][...])) and jnp.all(grads["log_std"][...] != 0)
    assert set(nnx.state(head, nnx.Param)) == {"log_std"}


def test_state_independent_sampler_takes_any_bijector():
    low, high = jnp.array([-2.0, 0.0, -1.0]), jnp.array([2.0, 1.0, 5.0])
    head = samplers.StateIndependentSampler(
        nnx.Rngs(0), A, 0.0, bijector=samplers.BoundedTanh(low, high), initial_std=5.0
    )
    action = nnx.jit(lambda head, x: head((), x))(head, _inputs((64,))[..., :A]).output["action"]
    assert jnp.all(action >= low[None]) and jnp.all(action <= high[None])


@pytest.mark.parametrize(
    "kwargs, call_shape, error, message",
    [
        ({"initial_std": 0.0}, None, ValueError, r"initial_std must be > 0.0, got 0.0"),
        ({"action_dim": 0}, None, ValueError, r"action_dim must be a positive integer, got 0"),
        ({}, (4, 2 * A), ValueError, r"the input must be the mean, shape \[\*batch, 3\], got"),
    ],
)
def test_state_independent_sampler_refuses_bad_input(kwargs, call_shape, error, message):
    arguments = {"action_dim": A, "entropy_weight": 0.01, **kwargs}
    with pytest.raises(error, match=message):
        head = samplers.StateIndependentSampler(nnx.Rngs(0), **arguments)
        head((), jnp.zeros(call_shape))


def test_checked_mode_names_the_first_non_finite_batch_element():
    head = samplers.NormalTanhSampler(nnx.Rngs(0), **OPTIONS, checked=True)
    apply, state = samplers.functional(head)
    poisoned = _inputs((3, 4)).at[2, 1, 0].set(jnp.nan)  # flat index 2 * 4 + 1 = 9
    error, _ = checkify.checkify(apply)(state, poisoned)
    assert "non-finite value at flat batch index 9 of batch shape (3, 4)" in error.get()
    error, (out, _) = checkify.checkify(apply)(state, _inputs((3, 4)))
    assert error.get() is None and jnp.all(jnp.isfinite(out.output["log_likelihood"]))


def test_unchecked_non_finite_inputs_give_non_finite_outputs():
    head = samplers.NormalTanhSampler(nnx.Rngs(0), **OPTIONS)
    out = head((), _inputs((4,)).at[1, 0].set(jnp.nan))
    assert jnp.isnan(out.output["log_likelihood"][1]) and jnp.isnan(out.output["action"][1, 0])
    assert jnp.all(jnp.isfinite(out.output["log_likelihood"][jnp.array([0, 2])]))


def test_an_empty_batch_runs_through_the_sampler():
    head = samplers.NormalTanhSampler(nnx.Rngs(0), **OPTIONS, checked=True)
    apply, state = samplers.functional(head)
    error, (out, _) = checkify.checkify(apply)(state, jnp.zeros((0, 2 * A)))
    assert error.get() is None
    assert out.output["action"].shape == (0, A) and out.regularization_loss.shape == (0,)


def test_bounded_squashings_report_saturation_and_distance_to_the_bounds():
    mean = jnp.array([[20.0, 0.0, -20.0], [0.5, 0.0, -0.25], [0.0, 8.5, 0.0]])
    inputs = jnp.concatenate([mean, jnp.full_like(mean, -30.0)], axis=-1)  # std ~ min_std
    head = samplers.NormalTanhSampler(nnx.Rngs(0), **OPTIONS)
    out = head((), inputs)
    np.testing.assert_allclose(out.metrics["saturation"], [2 / 3, 0, 1 / 3], rtol=1e-7)
    # Written out: the share of action dimensions exactly on -1 or 1.
    action = np.asarray(out.output["action"])
    np.testing.assert_array_equal(
        out.metrics["saturation"], np.mean(np.abs(action) == 1.0, axis=-1, dtype=np.float32)
    )
    np.testing.assert_array_equal(out.metrics["bound_distance"][jnp.array([0, 2])], 0.0)
    # The dimension at 0.5 (std 1e-3) is the closest to a bound in the unsaturated row.
    np.testing.assert_allclose(out.metrics["bound_distance"][1], 1 - jnp.tanh(0.5), rtol=1e-2)
    bounds = samplers.BoundedTanh(jnp.full(3, -2.0), jnp.array([2.0, 3.0, 4.0]))
    bounded = samplers.SquashedNormalSampler(nnx.Rngs(0), 0.01, bijector=bounds)
    out = bounded((), _inputs((7,), scale=6.0))
    # Written out: the smallest distance of any action dimension to its low or high bound.
    action = np.asarray(out.output["action"])
    low, high = np.full(3, -2.0, np.float32), np.array([2.0, 3.0, 4.0], np.float32)
    np.testing.assert_array_equal(
        out.metrics["bound_distance"], np.min(np.minimum(action - low, high - action), axis=-1)
    )
    np.testing.assert_array_equal(
        samplers.bound_distance(bounded.bijector, action), out.metrics["bound_distance"]
    )
    assert np.any(out.metrics["bound_distance"] == 0) and np.any(out.metrics["saturation"] > 0)
    assert jnp.all((out.metrics["saturation"] >= 0) & (out.metrics["saturation"] <= 1))
    unbounded = samplers.SquashedNormalSampler(
        nnx.Rngs(0), 0.01, bijector=distrax.Lambda(lambda x: x)
    )
    assert set(unbounded((), _inputs((4,))).metrics) == {"mu", "sigma"}


def test_log_ratio_metrics_compare_the_replay_with_the_rollout_log_likelihood():
    head = samplers.NormalTanhSampler(nnx.Rngs(0), **OPTIONS, log_ratio_metrics=True)
    inputs = _inputs((64,))
    rollout = head((), inputs)
    assert set(rollout.rollout_extras) == {"pre_image", "log_likelihood"}
    assert "log_ratio" not in rollout.metrics
    same = head((), inputs, rollout.rollout_extras)
    np.testing.assert_array_equal(same.metrics["log_ratio"], 0.0)
    np.testing.assert_array_equal(same.metrics["approx_kl"], 0.0)

    moved = inputs + 0.1
    replay = head((), moved, rollout.rollout_extras)
    mean, std = reference.params_float64(moved)
    new = reference.tanh_normal_log_prob_float64(rollout.rollout_extras["pre_image"], mean, std)
    log_ratio = new - np.asarray(rollout.output["log_likelihood"], np.float64)
    np.testing.assert_allclose(replay.metrics["log_ratio"], log_ratio, atol=2e-5)
    np.testing.assert_allclose(
        replay.metrics["approx_kl"], np.expm1(log_ratio) - log_ratio, rtol=1e-3, atol=1e-7
    )
    assert jnp.all(replay.metrics["approx_kl"] >= 0)
    stats = samplers.ppo_log_ratio_stats(
        replay.output["log_likelihood"], rollout.rollout_extras["log_likelihood"]
    )
    np.testing.assert_allclose(stats["approx_kl"], jnp.mean(replay.metrics["approx_kl"]), rtol=1e-6)


@pytest.mark.parametrize(
    *each_value_once(
        {"jitted": {"eager": False, "nnx.jit": True}, "name": HEAD_NAMES},
        slow_ids={"eager", "NormalTanhSampler", "StateIndependentSampler"},
    )
)
def test_replay_metrics_are_nan_in_the_batch_element_whose_stored_value_is_nan(jitted, name):
    """A NaN pre-image makes its element's action, log-likelihood and every metric NaN; a
    NaN stored log-likelihood its log-ratio metrics; other elements are untouched."""
    head = _squashed_heads(log_ratio_metrics=True)[name]
    inputs = _head_inputs(name, _inputs((4,)))
    extras = head((), inputs).rollout_extras
    clean = stateless_call(jitted)(head, inputs + 0.1, extras)
    broken = {
        "pre_image": extras["pre_image"].at[1, 0].set(jnp.nan),
        "log_likelihood": extras["log_likelihood"].at[2].set(jnp.nan),
    }
    out = stateless_call(jitted)(head, inputs + 0.1, broken)
    nan_in = {
        "log_ratio": [1, 2],
        "approx_kl": [1, 2],
        "saturation": [1],
        "bound_distance": [1],
    }
    for metric, rows in nan_in.items():
        values = np.asarray(out.metrics[metric])
        for row in range(4):
            if row in rows:
                assert np.isnan(values[row]), (name, metric, row)
            else:
                assert values[row] == clean.metrics[metric][row], (name, metric, row)
    # The float64 oracle on the clean rows: log-ratio from the stored values.
    assert np.isnan(out.output["log_likelihood"][1])
    log_ratio = np.asarray(out.output["log_likelihood"], np.float64) - np.asarray(
        broken["log_likelihood"], np.float64
    )
    np.testing.assert_allclose(out.metrics["log_ratio"], log_ratio, rtol=1e-6, atol=1e-6)


def test_log_ratio_metrics_refuse_the_other_kind_of_rollout_extras():
    plain = samplers.NormalTanhSampler(nnx.Rngs(0), **OPTIONS)
    with_ratio = samplers.NormalTanhSampler(nnx.Rngs(0), **OPTIONS, log_ratio_metrics=True)
    inputs = _inputs((4,))
    with pytest.raises(TypeError, match=r"pass log_ratio_metrics=True to the sampler"):
        plain((), inputs, with_ratio((), inputs).rollout_extras)
    with pytest.raises(TypeError, match=r"must be the dict \{'pre_image', 'log_likelihood'\}"):
        with_ratio((), inputs, plain((), inputs).rollout_extras)
    extras = with_ratio((), inputs).rollout_extras
    extras["log_likelihood"] = extras["log_likelihood"][:2]
    with pytest.raises(ValueError, match=r"must have the batch shape \(4,\), got \(2,\)"):
        with_ratio((), inputs, extras)


def test_state_independent_std_is_floored_and_low_precision_computes_in_float32():
    head = samplers.StateIndependentSampler(nnx.Rngs(0), A, 0.01)
    head.log_std[...] = jnp.full((A,), -200.0)  # exp(-200) is 0 in float32
    out = head((), jnp.zeros((4, A)))
    np.testing.assert_array_equal(out.metrics["sigma"], np.finfo(np.float32).tiny)
    assert np.all(np.isfinite(out.output["log_likelihood"]))
    for dtype in (jnp.float16, jnp.bfloat16):
        out = samplers.StateIndependentSampler(nnx.Rngs(0), A, 0.01)((), jnp.zeros((4, A), dtype))
        for leaf in jax.tree.leaves(out):
            assert leaf.dtype == jnp.float32, dtype


def test_state_independent_sampler_has_no_std_options_it_would_ignore():
    head = samplers.StateIndependentSampler(nnx.Rngs(0), A, 0.01)
    assert not hasattr(head, "min_std") and not hasattr(head, "std_scale")
    with pytest.raises(TypeError, match="min_std"):
        samplers.StateIndependentSampler(nnx.Rngs(0), A, 0.01, min_std=0.1)


def test_entropy_points_is_deprecated_for_the_one_value_entropy():
    with pytest.deprecated_call(match=r"pass entropy=\('quadrature', 4\) as one value"):
        old = samplers.NormalTanhSampler(nnx.Rngs(0), 0.01, entropy="quadrature", entropy_points=4)
    new = samplers.NormalTanhSampler(nnx.Rngs(0), 0.01, entropy=("quadrature", 4))
    mean_and_std = _inputs((4,))
    np.testing.assert_array_equal(
        old((), mean_and_std).regularization_loss, new((), mean_and_std).regularization_loss
    )
    with (
        pytest.deprecated_call(),
        pytest.raises(ValueError, match=r"entropy='exact' takes no entropy_points, got 4"),
    ):
        samplers.NormalTanhSampler(nnx.Rngs(0), 0.01, entropy="exact", entropy_points=4)


# The bijector is not the point here (the entropy's own tests cover each): one by default.
@pytest.mark.parametrize(
    "bijector",
    [
        pytest.param(samplers.Tanh(), id="Tanh"),
        slow(samplers.BoundedTanh(-2.0, 2.0), id="BoundedTanh"),
        slow(samplers.Sigmoid(), id="Sigmoid"),
    ],
)
def test_exact_entropy_cost_is_the_distributions_entropy_and_trains_it(bijector):
    head = samplers.SquashedNormalSampler(nnx.Rngs(0), 0.1, bijector=bijector, entropy="exact")
    mean_and_std = _inputs((4,))
    out = head((), mean_and_std)
    expected = samplers.squashed_normal(mean_and_std, bijector).entropy()
    np.testing.assert_array_equal(out.regularization_loss, -0.1 * expected)

    def cost(head, mean_and_std):
        return jnp.sum(head((), mean_and_std).regularization_loss)

    def distribution_cost(mean_and_std):
        return -0.1 * jnp.sum(samplers.squashed_normal(mean_and_std, bijector).entropy())

    np.testing.assert_array_equal(
        nnx.grad(cost, argnums=1)(head, mean_and_std), jax.grad(distribution_cost)(mean_and_std)
    )
