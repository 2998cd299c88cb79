"""Invariants of the samplers over the whole parameter range, checked with hypothesis.

Means and raw stds are drawn anywhere in ``[-1e3, 1e3]``, ``min_std`` in ``[0, 1]``
and ``std_scale`` in ``[1e-30, 10]``, for the four squashings the guarantees name:
``NormalTanhSampler``, ``BoundedTanh`` and ``samplers.Sigmoid()`` through
``SquashedNormalSampler``, and the identity ``distrax.Lambda(lambda x: x)``.

The drawn parameters keep the float32 std at or above ``STD_FLOOR``. Below it the
true gradient of ``log N(x; mean, std)`` with respect to the std,
``(z**2 - 1) / std``, is larger than the float32 range, so an infinite gradient is
the correct rounding there and nothing is promised. The end of the file pins the
edge cases that once failed, with their exact inputs.
"""

import distrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import samplers
from tests._tiers import SLOW, each_value_once, slow

A = 2
LIMIT = 1e3
ENTROPY_WEIGHT = 0.01
HALF_LOG_2PI = 0.5 * np.log(2 * np.pi)
STD_FLOOR = 1e-36
# Smallest std_scale drawn; smaller ones are only reached by the pinned cases below.
STD_SCALE_FLOOR = 1e-30
# jax.random.normal in float32 stays within +-5.42 (erfinv of the extreme uniforms).
MAX_ABS_EPS = 6.0

KINDS = ["tanh", "bounded", "sigmoid", "identity"]


def _kinds(*default):
    """The samplers as ``parametrize`` cases, those not named in ``default`` slow: the
    squashings share one code path, so the 1-D properties run two of them by default."""
    return [pytest.param(k, id=k, marks=[] if k in default else [SLOW]) for k in KINDS]


# Leading shapes of [2A], [B, 2A] and [T, B, 2A] inputs.
BATCH_SHAPES_DRAWN = st.sampled_from([(), (3,), (2, 3)])

# One instance: nnx.jit treats the Lambda's function as static, a new one retraces.
IDENTITY = distrax.Lambda(lambda x: x)

# The number of examples comes from the hypothesis profile (tests/conftest.py).
PROPERTY = settings(deadline=None)


def _float32_at_least(value: float) -> float:
    """The smallest float32 that is >= ``value``, as a Python float."""
    rounded = np.float32(value)
    if rounded < value:
        rounded = np.nextafter(rounded, np.float32(np.inf))
    return float(rounded)


def _softplus_inverse(y: float) -> float:
    return float(y + np.log(-np.expm1(-y)))


def _std_float64(raw_std, min_std: float, std_scale: float) -> np.ndarray:
    return (np.logaddexp(np.asarray(raw_std, np.float64), 0.0) + min_std) * std_scale


MIN_STDS = st.floats(0.0, 1.0)


@st.composite
def _parameters(
    draw,
    batch_shape,
    *,
    mean_limit=LIMIT,
    raw_limit=LIMIT,
    min_stds=MIN_STDS,
    std_scales=None,
    std_floor=STD_FLOOR,
    action_dim=A,
):
    """``(mean_and_std, min_std, std_scale)`` whose float32 std is at least ``std_floor``.

    ``std_scale`` is drawn from ``[1e-30, 10]``, raised to where the floor is
    reachable at all; the lowest raw std is raised where ``min_std * std_scale``
    alone is below the floor (twice the floor, so that float32 rounding of the std
    cannot cross it).
    """
    min_std = draw(min_stds)
    if std_scales is None:
        reachable = 4 * std_floor / np.logaddexp(raw_limit, 0.0)
        std_scales = st.floats(max(STD_SCALE_FLOOR, reachable), 10.0)
    std_scale = draw(std_scales)
    shortfall = 2 * std_floor / std_scale - min_std
    raw_low = -LIMIT if shortfall <= 0 else max(-LIMIT, _softplus_inverse(shortfall))
    shape = (*batch_shape, action_dim)
    mean = draw(
        hnp.arrays(np.float32, shape, elements=st.floats(-mean_limit, mean_limit, width=32))
    )
    raw_std = draw(
        hnp.arrays(
            np.float32,
            shape,
            elements=st.floats(_float32_at_least(raw_low), raw_limit, width=32),
        )
    )
    return np.concatenate([mean, raw_std], axis=-1), min_std, std_scale


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


def _bijector(kind, bounds):
    if kind == "bounded":
        return samplers.BoundedTanh(*bounds)
    if kind == "sigmoid":
        return samplers.Sigmoid()
    return IDENTITY


def _sampler(kind, min_std, std_scale, bounds=None, seed=0):
    if kind == "tanh":
        return samplers.NormalTanhSampler(
            nnx.Rngs(seed), ENTROPY_WEIGHT, min_std=min_std, std_scale=std_scale
        )
    return samplers.SquashedNormalSampler(
        nnx.Rngs(seed),
        ENTROPY_WEIGHT,
        bijector=_bijector(kind, bounds),
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
    mean_and_std, min_std, std_scale = draw(_parameters(batch_shape))
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
# The default tier draws a third of the profile's examples for asymmetric vector
# bounds; the slow tier all of them, for every sampler.
@pytest.mark.parametrize(
    "kind, share",
    [pytest.param("bounded", 3, id="bounded-a-third"), *(slow(k, 1, id=k) for k in KINDS)],
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
# By default Tanh in train mode and the bounded sampler in eval mode.
@pytest.mark.parametrize(
    "kind, deterministic",
    [
        pytest.param(
            kind,
            deterministic,
            id=f"{kind}-{mode}",
            marks=[] if f"{kind}-{mode}" in {"tanh-train", "bounded-eval"} else [SLOW],
        )
        for kind in KINDS
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


def _log_normal_float64(x, mean, std):
    return -0.5 * ((x - mean) / std) ** 2 - np.log(std) - 0.5 * np.log(2 * np.pi)


def _log_abs_derivative_float64(kind, x, bounds):
    """``log|f'(x)|`` in float64, from cosh and logistic identities, not the library's forms.

    Returns at least one dimension; ``bounds`` broadcast against ``x``.
    """
    x = np.atleast_1d(np.asarray(x, np.float64))
    log_sech2 = 2 * np.log(2.0) - 2 * np.logaddexp(x, -x)
    if kind == "tanh":
        return log_sech2
    if kind == "bounded":
        low, high = (np.asarray(b, np.float64) for b in bounds)
        return np.log((high - low) / 2) + log_sech2
    if kind == "sigmoid":
        return -np.logaddexp(0.0, x) - np.logaddexp(0.0, -x)
    return np.zeros_like(x)


def _float32_tolerance(x, mean, std, log_abs_derivative):
    """16 float32 ulps of the largest term of ``log N(x) - log|f'(x)|``, as the guarantees say.

    The terms are ``z**2 / 2``, ``log(std)``, ``log(2 pi) / 2`` and ``log|f'(x)|``;
    the ulp is ``np.spacing`` of the largest magnitude in float32. Rounding of the
    std, the standardisation and the sum each cost a few ulps of the terms, not of
    the (possibly cancelling) result.
    """
    z = (x - mean) / std
    terms = np.broadcast_arrays(0.5 * z**2, np.log(std), HALF_LOG_2PI, log_abs_derivative)
    largest = np.max(np.abs(np.stack(terms)), axis=0)
    return 16 * np.spacing(largest.astype(np.float32)).astype(np.float64)


ONE_D_BOUNDS = (np.array([-2.0], np.float32), np.array([3.0], np.float32))


def _one_d_distribution(kind, mean, raw_std, n, min_std, std_scale):
    """``n`` copies of a 1-D distribution, from the pure layer's public constructors."""
    params = jnp.broadcast_to(jnp.array([mean, raw_std], jnp.float32), (n, 2))
    if kind == "tanh":
        return samplers.normal_tanh(params, min_std=min_std, std_scale=std_scale)
    return samplers.squashed_normal(
        params, _bijector(kind, ONE_D_BOUNDS), min_std=min_std, std_scale=std_scale
    )


# Guarantees, "In 1-D the density integrates to 1 over the range".
@pytest.mark.parametrize("kind", _kinds("bounded", "sigmoid"))
@PROPERTY
@given(data=st.data())
def test_squashed_density_integrates_to_one(kind, data):
    """``int p(y) dy = int p(f(x)) |f'(x)| dx = 1`` over the range, by float64 quadrature.

    ``p(f(x))`` is the library's ``log_prob_from_pre_image``; ``|f'(x)|`` is float64.
    The std floor of 2**-10 lets float32 pre-images resolve the density (nodes at
    most std / 2 apart, where the trapezoid rule is exact to ~1e-17 for a Gaussian).
    """
    mean_and_std, min_std, std_scale = data.draw(_parameters((), std_floor=2.0**-10, action_dim=1))
    (mean,), (raw_std,) = np.split(mean_and_std.astype(np.float64), 2)
    std = float(_std_float64(raw_std, min_std, std_scale))
    # A fixed count of float32 nodes (one compilation); rounding may repeat some.
    nodes = (mean + std * np.linspace(-12.0, 12.0, 2001)).astype(np.float32)
    dist = _one_d_distribution(kind, mean, raw_std, nodes.size, min_std, std_scale)
    log_prob = np.asarray(dist.log_prob_from_pre_image(jnp.asarray(nodes)[:, None]), np.float64)
    nodes, first = np.unique(nodes, return_index=True)
    log_prob = log_prob[first]
    x = nodes.astype(np.float64)
    assert np.all(np.diff(x) <= std / 2)
    log_abs_derivative = _log_abs_derivative_float64(kind, x, ONE_D_BOUNDS)
    density = np.exp(log_prob + log_abs_derivative)
    tolerance = 1e-6 + np.trapezoid(
        density * _float32_tolerance(x, mean, std, log_abs_derivative), x
    )
    assert abs(np.trapezoid(density, x) - 1.0) <= tolerance


SATURATED_PRE_IMAGES = [10.0, -10.0, 20.0, -20.0, 50.0, -50.0, 1e3, -1e3]


# Guarantees, "log_prob_from_pre_image ... within 16 float32 ulps of its largest
# term ... at +-10, +-20, +-50, +-1e3".
# (offset of the mean from the pre-image, raw std): at the mean, near it, 3 off.
SATURATED_OFFSETS = [(0.0, 0.0), (-0.5, 0.3), (3.0, -2.0)]


@pytest.mark.parametrize("kind", KINDS)
def test_log_prob_of_saturated_pre_images_matches_float64(kind):
    # Every (pre-image, offset) pair is one batch element of one distribution.
    cases = [(x, *o) for x in SATURATED_PRE_IMAGES for o in SATURATED_OFFSETS]
    pre_image, offset, raw_std = np.array(cases, np.float32).T
    mean = pre_image + offset
    params = jnp.stack([mean, raw_std], axis=-1)
    if kind == "tanh":
        dist = samplers.normal_tanh(params, min_std=1e-3, std_scale=1.0)
    else:
        dist = samplers.squashed_normal(params, _bijector(kind, ONE_D_BOUNDS), min_std=1e-3)
    log_prob = np.asarray(dist.log_prob_from_pre_image(jnp.asarray(pre_image)[:, None]))
    std = _std_float64(raw_std, 1e-3, 1.0)
    x = pre_image.astype(np.float64)
    log_abs_derivative = _log_abs_derivative_float64(kind, x, ONE_D_BOUNDS)
    expected = _log_normal_float64(x, mean.astype(np.float64), std) - log_abs_derivative
    tolerance = _float32_tolerance(x, mean.astype(np.float64), std, log_abs_derivative)
    assert np.all(np.isfinite(log_prob))
    bad = np.abs(log_prob - expected) > tolerance
    assert not np.any(bad), list(
        zip(np.array(cases)[bad], log_prob[bad], expected[bad], strict=True)
    )


# Guarantees, "log_prob_from_pre_image ... within 16 float32 ulps of its largest
# term, for pre-images anywhere in [-1e3, 1e3]".
@pytest.mark.parametrize("kind", _kinds("tanh", "identity"))
@PROPERTY
@given(data=st.data())
def test_log_prob_from_pre_image_matches_float64_change_of_variables(kind, data):
    """Arbitrary pre-images in [-1e3, 1e3] under arbitrary parameters.

    The std floor of 2**-40 keeps ``z**2`` of the farthest pre-image inside the
    float32 range; below it the true log-density is below -FLT_MAX.
    """
    mean_and_std, min_std, std_scale = data.draw(_parameters((), std_floor=2.0**-40, action_dim=1))
    pre_images = data.draw(
        hnp.arrays(np.float32, (16,), elements=st.floats(-LIMIT, LIMIT, width=32))
    )
    (mean,), (raw_std,) = np.split(mean_and_std.astype(np.float64), 2)
    dist = _one_d_distribution(kind, mean, raw_std, pre_images.size, min_std, std_scale)
    log_prob = np.asarray(
        dist.log_prob_from_pre_image(jnp.asarray(pre_images)[:, None]), np.float64
    )
    x = pre_images.astype(np.float64)
    std = _std_float64(raw_std, min_std, std_scale)
    log_abs_derivative = _log_abs_derivative_float64(kind, x, ONE_D_BOUNDS)
    expected = _log_normal_float64(x, mean, std) - log_abs_derivative
    tolerance = _float32_tolerance(x, mean, std, log_abs_derivative)
    assert np.all(np.isfinite(log_prob))
    assert np.all(np.abs(log_prob - expected) <= tolerance), (log_prob, expected, tolerance)


ENTROPY_CASES = [
    ("tanh", 0.7, 1.3),
    ("tanh", 5.0, 3.0),
    ("tanh", -20.0, 0.01),
    ("tanh", 0.0, 100.0),
    ("bounded", 0.3, 0.8),
    ("bounded", 8.0, 2.0),
    ("sigmoid", 0.5, 1.0),
    ("sigmoid", -30.0, 5.0),
    ("identity", 1.0, 2.0),
]


# Guarantees, "The sample entropy estimators' means are within three standard
# errors".
# The first case of the bounded and the identity samplers by default; the others slow.
@pytest.mark.parametrize(
    "kind, mean, std",
    [
        pytest.param(
            k,
            m,
            s,
            id=f"{k}-{m}-{s}",
            marks=[] if (k, m, s) in (("bounded", 0.3, 0.8), ("identity", 1.0, 2.0)) else [SLOW],
        )
        for k, m, s in ENTROPY_CASES
    ],
)
def test_entropy_estimate_is_unbiased_against_float64_quadrature(kind, mean, std):
    """The mean of 20 000 one-sample estimates (one key each) within 3 standard errors.

    The exact entropy is ``-int N(x) log p(f(x)) dx`` by float64 quadrature over the
    pre-image. The identity's estimate has no variance, so a float32 allowance of
    1e-6 relative is added to the three standard errors.
    """
    raw_std = _softplus_inverse(std - 1e-3)
    x = np.linspace(mean - 12 * std, mean + 12 * std, 200_001)
    log_p = _log_normal_float64(x, mean, std)
    log_abs_derivative = _log_abs_derivative_float64(kind, x, ONE_D_BOUNDS)
    exact = -np.trapezoid(np.exp(log_p) * (log_p - log_abs_derivative), x)

    dist = _one_d_distribution(kind, mean, raw_std, 1, 1e-3, 1.0)
    keys = jax.random.split(jax.random.key(0), 20_000)
    estimates = jax.vmap(lambda key: dist.entropy_estimate(seed=key)[0])(keys)
    estimates = np.asarray(estimates, np.float64)
    assert np.all(np.isfinite(estimates))
    standard_error = estimates.std() / np.sqrt(estimates.size)
    assert abs(estimates.mean() - exact) <= 3 * standard_error + 1e-6 * (1 + abs(exact))


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
            "kind": {k: k for k in KINDS},
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
    exact = float(_std_float64(raw_std, min_std, std_scale))
    if exact < tiny:
        assert sigma == tiny
    else:
        assert sigma >= tiny and sigma == pytest.approx(exact, rel=1e-6)


@pytest.mark.parametrize("mean", [1e3, -1e3, 100.0, -100.0])
def test_sigmoid_entropy_gradient_is_finite_when_saturated(mean):
    _all_finite_after_rollout_and_replay("sigmoid", 1e-3, 1.0, mean, 0.0)


@pytest.mark.parametrize("mean", [1e3, -1e3, 100.0, -100.0])
def test_distrax_sigmoid_gradient_is_nan_when_saturated(mean):
    """Why ``samplers.Sigmoid`` exists: distrax's log-det evaluates both branches of a
    ``jnp.where``, and for ``|x| > 88.72`` the untaken ``exp(x)`` overflows."""
    gradient = jax.grad(lambda x: distrax.Sigmoid().forward_log_det_jacobian(x))(mean)
    assert jnp.isnan(gradient)


@pytest.mark.parametrize("low, high", [(1e-45, 1.0), (-1.0, -1e-40)])
def test_subnormal_bounds_are_refused(low, high):
    """XLA flushes subnormal float32 to zero, so such a bound could not be honoured."""
    with pytest.raises(ValueError, match=r"must be 0 or at least 1.18e-38 in magnitude"):
        samplers.BoundedTanh(np.array([low], np.float32), np.array([high], np.float32))
