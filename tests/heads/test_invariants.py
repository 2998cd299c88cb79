"""Invariants of the squashed-Normal heads over the whole parameter range, with hypothesis.

Means and raw stds are drawn anywhere in ``[-1e3, 1e3]``, ``min_std`` in ``[0, 1]``
and ``std_scale`` in ``[1e-30, 10]``, for the four squashings the guarantees name:
``NormalTanhSampler``, ``BoundedTanh`` and ``samplers.Sigmoid()`` through
``SquashedNormalSampler``, and the identity ``distrax.Lambda(lambda x: x)``: a rollout
and its replay are finite with finite gradients, keep actions in range and replay the
log-likelihood bit for bit, eagerly and under ``nnx.jit``. The pure layer's properties
over the same ranges (``log_prob_from_pre_image`` against float64, the 1-D density,
the entropy estimate) are in ``tests/distributions/test_squashed_normal.py``.

The drawn parameters keep the float32 std at or above ``STD_FLOOR``. Below it the
true gradient of ``log N(x; mean, std)`` with respect to the std,
``(z**2 - 1) / std``, is larger than the float32 range, so an infinite gradient is
the correct rounding there and nothing is promised. The end of the file pins the
edge cases that once failed, with their exact inputs.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import samplers
from tests._tiers import SLOW, each_value_once, slow
from tests.helpers import LIMIT, SQUASHING_KINDS, squashed_normal_parameters, squashing
from tests.reference import softplus_std_float64

A = 2
ENTROPY_WEIGHT = 0.01
# jax.random.normal in float32 stays within +-5.42 (erfinv of the extreme uniforms).
MAX_ABS_EPS = 6.0


# Leading shapes of [2A], [B, 2A] and [T, B, 2A] inputs.
BATCH_SHAPES_DRAWN = st.sampled_from([(), (3,), (2, 3)])


@st.composite
def _bounds(draw):
    """Per-dimension ``(low, high)`` in float32, at least 2**-7 apart, not subnormal.

    XLA flushes subnormal floats to zero, so a subnormal bound cannot be honoured:
    see ``test_actions_stay_inside_subnormal_bounds``.
    """
    normal = st.floats(-LIMIT, LIMIT, width=32, allow_subnormal=False)
    low = draw(hnp.arrays(np.float32, (A,), elements=normal))
    width = draw(hnp.arrays(np.float32, (A,), elements=st.floats(2.0**-7, LIMIT, width=32)))
    return low, low + width


def _sampler(kind, min_std, std_scale, bounds=None, seed=0):
    if kind == "tanh":
        return samplers.NormalTanhSampler(
            nnx.Rngs(seed), ENTROPY_WEIGHT, min_std=min_std, std_scale=std_scale
        )
    return samplers.SquashedNormalSampler(
        nnx.Rngs(seed),
        ENTROPY_WEIGHT,
        bijector=squashing(kind, bounds),
        min_std=min_std,
        std_scale=std_scale,
    )


def _action_range(kind, bounds):
    if kind == "tanh":
        return -1.0, 1.0
    if kind == "bounded":
        return bounds
    if kind == "sigmoid":
        return 0.0, 1.0
    return -np.inf, np.inf


def _replay_with_gradient(sampler, mean_and_std, stored):
    """The loss pass: replay ``stored``, differentiate log-likelihood + entropy cost."""

    def loss(sampler, mean_and_std):
        out = sampler((), mean_and_std, stored)
        return jnp.sum(out.output["log_likelihood"] + out.regularization_loss), out

    (_, replay), grad = nnx.value_and_grad(loss, argnums=1, has_aux=True)(sampler, mean_and_std)
    return replay, grad


def _rollout(sampler, mean_and_std):
    return sampler((), mean_and_std)


# Rollout and loss pass are separate programs, as in a training loop.
_rollout_jit = nnx.jit(_rollout)
_replay_with_gradient_jit = nnx.jit(_replay_with_gradient)


def _check_rollout_and_replay(kind, bounds, mean_and_std, rollout, replay, grad):
    finite = {
        "rollout log_likelihood": rollout.output["log_likelihood"],
        "rollout action": rollout.output["action"],
        "rollout regularization_loss": rollout.regularization_loss,
        "rollout_extras": rollout.rollout_extras,
        "replay log_likelihood": replay.output["log_likelihood"],
        "replay regularization_loss": replay.regularization_loss,
        "gradient": grad,
    }
    for name, value in finite.items():
        assert np.all(np.isfinite(value)), f"{name} is not finite: {value}"

    low, high = _action_range(kind, bounds)
    for name, action in (
        ("rollout", rollout.output["action"]),
        ("replay", replay.output["action"]),
    ):
        action = np.asarray(action)
        assert np.all(action >= low) and np.all(action <= high), (
            f"{name} action {action} leaves [{low}, {high}]"
        )
    np.testing.assert_array_equal(replay.output["action"], rollout.output["action"])
    # Guarantees, "Replaying the stored pre-image ... bit for bit": the replayed
    # log-likelihood is the rollout's, every bit (the PPO ratio is exactly 1).
    np.testing.assert_array_equal(replay.output["log_likelihood"], rollout.output["log_likelihood"])
    assert mean_and_std.shape[:-1] == rollout.output["log_likelihood"].shape


@st.composite
def _examples(draw, kind, deterministic=None):
    """A sampler configuration and input anywhere in the guarantees' ranges.

    Shapes ``[2A]``, ``[B, 2A]`` and ``[T, B, 2A]``, ``min_std`` in ``[0, 1]``,
    ``std_scale`` in ``[1e-30, 10]``, means and raw stds in ``[-1e3, 1e3]``, bounds
    per dimension, train or eval mode (drawn, unless ``deterministic`` is given).
    """
    batch_shape = draw(BATCH_SHAPES_DRAWN, label="batch_shape")
    mean_and_std, min_std, std_scale = draw(squashed_normal_parameters(batch_shape, action_dim=A))
    bounds = draw(_bounds()) if kind == "bounded" else None
    if deterministic is None:
        deterministic = draw(st.booleans(), label="deterministic")
    return mean_and_std, min_std, std_scale, bounds, deterministic


def _check_example(kind, example, rollout, replay_with_gradient):
    mean_and_std, min_std, std_scale, bounds, deterministic = example
    sampler = _sampler(kind, min_std, std_scale, bounds)
    sampler.set_attributes(deterministic=deterministic)
    mean_and_std = jnp.asarray(mean_and_std)

    out = rollout(sampler, mean_and_std)
    replay, grad = replay_with_gradient(sampler, mean_and_std, out.rollout_extras)

    _check_rollout_and_replay(kind, bounds, mean_and_std, out, replay, grad)
    if deterministic:
        np.testing.assert_array_equal(out.rollout_extras, mean_and_std[..., :A])


# Guarantees, rows "... are finite, eagerly and under nnx.jit", "Actions never
# leave the range" and "Replaying ... bit for bit": eagerly, over the whole range.
# The default tier draws a tenth of the profile's examples for asymmetric vector
# bounds; the slow tier all of them, for every sampler.
@pytest.mark.parametrize(
    "kind, share",
    [
        pytest.param("bounded", 10, id="bounded-a-tenth"),
        *(slow(k, 1, id=k) for k in SQUASHING_KINDS),
    ],
)
def test_rollout_and_replay_are_finite_in_range_and_reproduce_the_log_likelihood(kind, share):
    """Eager rollout then replay: finite outputs and gradients, actions in range, ratio 1."""

    @settings(max_examples=max(2, settings.default.max_examples // share), deadline=None)
    @given(data=st.data())
    def check(data):
        _check_example(kind, data.draw(_examples(kind)), _rollout, _replay_with_gradient)

    check()


# The same three rows under nnx.jit, over the same ranges, shapes and samplers (the
# same strategy), in train and in eval mode. Options and bijector are static under
# nnx.jit, so every example compiles afresh: fewer examples keep the time modest.
# By default Tanh in train mode (the eager test above draws eval mode too); the other
# kinds and modes repeat it in the slow tier.
@pytest.mark.parametrize(
    "kind, deterministic",
    [
        pytest.param(
            kind,
            deterministic,
            id=f"{kind}-{mode}",
            marks=[] if f"{kind}-{mode}" == "tanh-train" else [SLOW],
        )
        for kind in SQUASHING_KINDS
        for deterministic, mode in [(False, "train"), (True, "eval")]
    ],
)
@settings(max_examples=max(2, settings.default.max_examples // 25), deadline=None)
@given(data=st.data())
def test_rollout_and_replay_invariants_hold_under_nnx_jit(kind, deterministic, data):
    """The same invariants with rollout and loss pass compiled as separate programs."""
    example = data.draw(_examples(kind, deterministic))
    _check_example(kind, example, _rollout_jit, _replay_with_gradient_jit)


# 1-D checks against float64 NumPy, written from the maths.


ONE_D_BOUNDS = (np.array([-2.0], np.float32), np.array([3.0], np.float32))


# Pinned edge cases, each with the exact input that used to fail.


def _all_finite_after_rollout_and_replay(kind, min_std, std_scale, mean, raw_std):
    sampler = _sampler(kind, min_std, std_scale, ONE_D_BOUNDS)
    mean_and_std = jnp.array([mean, raw_std], jnp.float32)
    rollout = _rollout(sampler, mean_and_std)
    replay, grad = _replay_with_gradient(sampler, mean_and_std, rollout.rollout_extras)
    bounds = ONE_D_BOUNDS if kind == "bounded" else None
    _check_rollout_and_replay(kind, bounds, mean_and_std, rollout, replay, grad)


# The std is floored at float32's smallest normal (1.18e-38); without the floor
# these inputs round it to 0 and give NaN. Each input and each sampler at least once by
# default.
@pytest.mark.parametrize(
    *each_value_once(
        {
            "min_std, std_scale, raw_std": {
                "min_std=0,raw=-1e3": (0.0, 1.0, -1e3),
                "min_std=0,raw=-88": (0.0, 1.0, -88.0),
                "std_scale=1e-38": (1.0, 1e-38, 0.0),
                "std_scale=1e-46": (1.0, 1e-46, 0.0),
            },
            "kind": {k: k for k in SQUASHING_KINDS},
        }
    )
)
def test_outputs_are_finite_when_the_std_underflows_to_zero(kind, min_std, std_scale, raw_std):
    """Guarantees, "The std never rounds to zero (floored at the smallest normal
    float)": where the float64 std is below it the std is the floor, else at least it."""
    _all_finite_after_rollout_and_replay(kind, min_std, std_scale, 0.0, raw_std)
    sampler = _sampler(kind, min_std, std_scale, ONE_D_BOUNDS)
    sigma = float(sampler((), jnp.array([0.0, raw_std], jnp.float32)).metrics["sigma"][0])
    tiny = float(np.finfo(np.float32).tiny)
    exact = float(softplus_std_float64(raw_std, min_std, std_scale))
    if exact < tiny:
        assert sigma == tiny
    else:
        assert sigma >= tiny and sigma == pytest.approx(exact, rel=1e-6)


@pytest.mark.parametrize("mean", [1e3, -1e3, 100.0, -100.0])
def test_sigmoid_entropy_gradient_is_finite_when_saturated(mean):
    _all_finite_after_rollout_and_replay("sigmoid", 1e-3, 1.0, mean, 0.0)
