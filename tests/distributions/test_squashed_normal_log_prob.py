"""``SquashedNormal.log_prob`` of an action given without its pre-image, as SAC scores one.

Against float64 at every distance from the bounds and on them (the mass that rounds
onto a bound), a fresh sample scored at its remembered pre-image, broadcasting as
distrax does, gradients, ``min_distance`` and the refusals. Where a squashed-Normal
test goes: ``tests/README.md``.
"""

import distrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.scipy import stats
from scipy import special as scipy_special
from scipy import stats as scipy_stats
from tensorflow_probability.substrates import jax as tfp

import samplers
from tests._tiers import SLOW
from tests.helpers import (
    SATURATING_LOC,
    SATURATING_LOG_STD,
    SQUASHINGS_AND_K,
    squashing_and_k_cases,
    squashing_bounds_float64,
)
from tests.reference import (
    normal_log_prob_float64,
    sigmoid_log_derivative_float64,
    tanh_log_derivative_float64,
)

tfb = tfp.bijectors
EPS32 = 2.0**-23
# Distances to the bound as a fraction of the half range, 1e-1 down to 1e-7.
DISTANCES = 10.0 ** -np.arange(1, 8)
LOCS_AND_SCALES = [(0.0, 1.0), (2.0, 0.5), (-1.0, 3.0), (5.0, 0.1), (-4.0, 0.05), (9.0, 1e-3)]
BOUNDS = {
    "Tanh": (-1.0, 1.0),
    "BoundedTanh[-2,2]": (-2.0, 2.0),
    "BoundedTanh[0,1]": (0.0, 1.0),
    "BoundedTanh[-0.1,0.3]": (-0.1, 0.3),
    "BoundedTanh[-3,0.7]": (-3.0, 0.7),
    "BoundedTanh[-100,100]": (-100.0, 100.0),
}


def _bijector(low, high):
    return samplers.Tanh() if (low, high) == (-1.0, 1.0) else samplers.BoundedTanh(low, high)


def _reference_float64(action, loc, scale, low, high):
    """Change of variables in float64 at the given (float32) action, through ``arctanh``."""
    action, loc, scale = (np.asarray(a, np.float64) for a in (action, loc, scale))
    low, high = np.float64(np.float32(low)), np.float64(np.float32(high))
    center, half_range = (high + low) / 2, (high - low) / 2
    x = np.arctanh((action - center) / half_range)
    return normal_log_prob_float64(x, loc, scale) - tanh_log_derivative_float64(x, low, high), x


def _documented_bound(x, loc, scale, log_prob):
    return 4 * EPS32 * (1 + np.abs(x) * np.abs(x - loc) / scale**2 + np.abs(log_prob))


def _grid(low, high):
    """Float32 actions at each distance from both bounds, for every (loc, scale)."""
    low32, high32 = np.float32(low), np.float32(high)
    center, half_range = (np.float64(high32) + low32) / 2, (np.float64(high32) - low32) / 2
    sides = np.array([1.0, -1.0])
    action = (center + sides[:, None] * half_range * (1 - DISTANCES)).astype(np.float32).ravel()
    assert np.all((action > low32) & (action < high32)), "a grid action rounded onto a bound"
    loc, scale = np.array(LOCS_AND_SCALES, np.float32).T
    action, loc = np.meshgrid(action, loc, indexing="ij")
    scale = np.broadcast_to(scale, loc.shape)
    return action.reshape(-1, 1), loc.reshape(-1, 1), scale.reshape(-1, 1)


# The method, and the deprecated free function that is its alias.
SCORES = {
    "SquashedNormal.log_prob": lambda dist, action: dist.log_prob(action),
}


@pytest.mark.parametrize("score", SCORES.values(), ids=SCORES.keys())
@pytest.mark.parametrize("low, high", BOUNDS.values(), ids=BOUNDS.keys())
def test_error_against_float64_is_within_the_documented_bound_at_every_distance(
    low, high, score, maybe_jit
):
    action, loc, scale = _grid(low, high)
    dist = samplers.SquashedNormal(jnp.asarray(loc), jnp.asarray(scale), _bijector(low, high))
    ours = maybe_jit(score)(dist, jnp.asarray(action))
    expected, x = _reference_float64(action[:, 0], loc[:, 0], scale[:, 0], low, high)
    error = np.abs(np.asarray(ours, np.float64) - expected)
    bound = _documented_bound(x, loc[:, 0], scale[:, 0], expected)
    assert np.all(error <= bound), np.max(error / bound)


def _sigmoid_reference_float64(action, loc, scale):
    """Change of variables in float64 through the logit, ``x = log y - log(1 - y)``."""
    action, loc, scale = (np.asarray(a, np.float64) for a in (action, loc, scale))
    x = np.log(action) - np.log1p(-action)
    return normal_log_prob_float64(x, loc, scale) - sigmoid_log_derivative_float64(x), x


# Near 0, float32 resolves distances down to the smallest normal float (1.2e-38).
TINY_DISTANCES = np.array([1e-10, 1e-20, 1e-30, 1e-37])


@pytest.mark.parametrize("score", SCORES.values(), ids=SCORES.keys())
@pytest.mark.parametrize(
    "bijector", [samplers.Sigmoid(), distrax.Sigmoid()], ids=["samplers", "distrax"]
)
def test_sigmoid_error_is_within_the_documented_bound_down_to_the_smallest_float(
    bijector, score, maybe_jit
):
    distances = np.concatenate([DISTANCES, TINY_DISTANCES])
    action = np.concatenate([distances, 1 - DISTANCES]).astype(np.float32)
    assert np.all((action > 0) & (action < 1))
    loc, scale = np.array(LOCS_AND_SCALES, np.float32).T
    action, loc = np.meshgrid(action, 2 * loc, indexing="ij")  # k = 2: pre-images twice tanh's
    scale = np.broadcast_to(2 * scale, loc.shape)
    action, loc, scale = (a.reshape(-1, 1) for a in (action, loc, scale))
    dist = samplers.SquashedNormal(jnp.asarray(loc), jnp.asarray(scale), bijector)
    ours = maybe_jit(score)(dist, jnp.asarray(action))
    expected, x = _sigmoid_reference_float64(action[:, 0], loc[:, 0], scale[:, 0])
    error = np.abs(np.asarray(ours, np.float64) - expected)
    bound = _documented_bound(x, loc[:, 0], scale[:, 0], expected)
    assert np.all(error <= bound), np.max(error / bound)


def test_bounded_tanh_at_zero_is_within_the_documented_bound_down_to_the_smallest_float():
    # BoundedTanh(0, 1) = (1 + tanh(x)) / 2: x = (log y - log(1 - y)) / 2 in float64.
    action = TINY_DISTANCES.astype(np.float32)[:, None]
    loc, scale = np.full_like(action, -20.0), np.full_like(action, 5.0)
    dist = samplers.SquashedNormal(
        jnp.asarray(loc), jnp.asarray(scale), samplers.BoundedTanh(0.0, 1.0)
    )
    ours = dist.log_prob(jnp.asarray(action))
    x = 0.5 * (np.log(action[:, 0].astype(np.float64)) - np.log1p(-action[:, 0].astype(np.float64)))
    expected = normal_log_prob_float64(x, -20.0, 5.0) - tanh_log_derivative_float64(x, 0.0, 1.0)
    error = np.abs(np.asarray(ours, np.float64) - expected)
    assert np.all(error <= _documented_bound(x, -20.0, 5.0, expected)), error


def _acme_style(action, loc, scale, threshold=0.999):
    """The tail-mass clipping Acme's tanh distribution applies past ``|y| = threshold``."""
    pre_threshold = np.arctanh(threshold)
    log_width = np.log(1 - threshold)
    right = stats.norm.logsf(pre_threshold, loc, scale) - log_width
    left = stats.norm.logcdf(-pre_threshold, loc, scale) - log_width
    clipped = jnp.clip(action, -threshold, threshold)
    inside = distrax.Transformed(distrax.Normal(loc, scale), distrax.Tanh()).log_prob(clipped)
    return jnp.where(clipped >= threshold, right, jnp.where(clipped <= -threshold, left, inside))


def _sb3_style(action, loc, scale):
    """Stable-Baselines3's clamp at ``1 - eps`` and ``log(1 - y**2 + 1e-6)`` Jacobian."""
    clamped = jnp.clip(action, -1 + EPS32, 1 - EPS32)
    x = 0.5 * (jnp.log1p(clamped) - jnp.log1p(-clamped))
    return stats.norm.logpdf(x, loc, scale) - jnp.log(1 - action**2 + 1e-6)


@pytest.mark.parametrize("distance, acme_error, sb3_error", [(1e-4, 1.0, 4e-3), (1e-7, 10.0, 1.0)])
def test_clipping_used_elsewhere_errs_near_the_bound_where_this_does_not(
    distance, acme_error, sb3_error
):
    action = jnp.float32(1 - distance)
    loc, scale = jnp.float32(0.0), jnp.float32(1.0)
    expected, x = _reference_float64(action, loc, scale, -1.0, 1.0)
    dist = samplers.SquashedNormal(jnp.array([loc]), jnp.array([scale]), samplers.Tanh())
    ours = dist.log_prob(jnp.array([action]))
    assert abs(float(ours) - expected) <= _documented_bound(x, 0.0, 1.0, expected)
    assert abs(float(_acme_style(action, loc, scale)) - expected) > acme_error
    assert abs(float(_sb3_style(action, loc, scale)) - expected) > sb3_error


def test_acme_style_clipping_jumps_at_its_threshold_and_this_is_continuous():
    below, above = np.nextafter(np.float32(0.999), np.float32(0)), np.float32(0.999)
    loc, scale = jnp.float32(0.0), jnp.float32(1.0)
    acme_jump = float(_acme_style(above, loc, scale) - _acme_style(below, loc, scale))
    dist = samplers.SquashedNormal(jnp.array([loc]), jnp.array([scale]), samplers.Tanh())
    ours = dist.log_prob(jnp.array([[below], [above]]))
    assert abs(acme_jump) > 0.5
    assert abs(float(ours[1] - ours[0])) < 1e-3


def test_matches_the_pre_image_path_on_round_trips(batch_shape, maybe_jit):
    keys = jax.random.split(jax.random.key(0), 3)
    loc = 2.0 * jax.random.normal(keys[0], (*batch_shape, 3))
    scale = jnp.exp(0.5 * jax.random.normal(keys[1], (*batch_shape, 3)))
    bijector = samplers.BoundedTanh(jnp.array([-2.0, 0.0, -0.1]), jnp.array([2.0, 1.0, 0.3]))
    dist = samplers.SquashedNormal(loc, scale, bijector)
    pre_image = 2.0 * jax.random.normal(keys[2], (*batch_shape, 3))
    ours = maybe_jit(lambda d, a: d.log_prob(a))(dist, bijector.forward(pre_image))
    # The reference runs jitted either way: its eager path retraces for every shape.
    expected = jax.jit(lambda d, x: d.log_prob_from_pre_image(x))(dist, pre_image)
    assert ours.shape == batch_shape
    np.testing.assert_allclose(ours, expected, rtol=1e-4, atol=1e-3)


def test_matches_distrax_inside_the_range():
    action = jnp.linspace(-0.99, 0.99, 41)[:, None]
    loc, scale = jnp.full_like(action, 0.3), jnp.full_like(action, 0.7)
    plain = distrax.Independent(distrax.Transformed(distrax.Normal(loc, scale), distrax.Tanh()), 1)
    dist = samplers.SquashedNormal(loc, scale, distrax.Tanh())
    np.testing.assert_allclose(dist.log_prob(action), plain.log_prob(action), atol=1e-5)


def _atom_float64(threshold_pre_image, loc, scale, upper):
    """``log P[X >= x_r]`` (upper bound) or ``log P[X <= x_r]`` and its derivatives
    with respect to ``loc`` and ``scale``, in float64 with SciPy."""
    z = np.where(upper, loc - threshold_pre_image, threshold_pre_image - loc) / scale
    log_mass = scipy_special.log_ndtr(z)
    # d/dz log Phi(z) = phi(z) / Phi(z), the inverse Mills ratio.
    mills = np.exp(scipy_stats.norm.logpdf(z) - log_mass)
    d_loc = np.where(upper, 1.0, -1.0) * mills / scale
    d_scale = -z * mills / scale
    return log_mass, d_loc, d_scale


@pytest.mark.parametrize("low, high", BOUNDS.values(), ids=BOUNDS.keys())
def test_an_action_on_a_bound_is_scored_as_the_mass_that_rounds_onto_it(low, high):
    # The cell that rounds onto a bound is the coarser of tanh's step (2**-24 of the
    # half range) and the action's own float32 step at the bound; the atom is the
    # probability beyond the pre-image of its middle.
    low32, high32 = np.float32(low), np.float32(high)
    half_range = (np.float64(high32) - low32) / 2
    tanh_step = half_range * 2.0**-24
    low_step = max(tanh_step, np.float64(np.nextafter(low32, high32)) - low32)
    high_step = max(tanh_step, high32 - np.float64(np.nextafter(high32, low32)))
    threshold = np.array([low32 + low_step / 2, high32 - high_step / 2])
    _, x = _reference_float64(threshold, 0.5, 2.0, low, high)
    upper = np.array([False, True])
    expected, d_loc, d_scale = _atom_float64(x, 0.5, 2.0, upper)

    def score(loc, scale):
        dist = samplers.SquashedNormal(loc, scale, _bijector(low, high))
        return dist.log_prob(jnp.array([[low32], [high32]]))

    loc, scale = jnp.full((2, 1), 0.5), jnp.full((2, 1), 2.0)
    np.testing.assert_allclose(score(loc, scale), expected, rtol=1e-5)
    grad_loc, grad_scale = jax.grad(lambda m, s: jnp.sum(score(m, s)), argnums=(0, 1))(loc, scale)
    # The gradient moves mass onto the bound: loc up at high, down at low.
    np.testing.assert_allclose(grad_loc[:, 0], d_loc, rtol=1e-4)
    np.testing.assert_allclose(grad_scale[:, 0], d_scale, rtol=1e-4)
    assert grad_loc[0, 0] < 0 < grad_loc[1, 0]


@pytest.mark.parametrize("low, high", [(-1.0, 1.0), (-0.1, 0.3)])
def test_gradients_are_finite_everywhere_including_on_the_bounds(low, high):
    half_range = (high - low) / 2
    u = np.array([-1.0, -1 + 2.0**-24, -0.5, 0.0, 0.7, 1 - 1e-6, 1 - 2.0**-24, 1.0])
    action = jnp.asarray(((high + low) / 2 + half_range * u).clip(low, high), jnp.float32)[:, None]

    def total(loc, scale, action):
        dist = samplers.SquashedNormal(loc, scale, _bijector(low, high))
        return jnp.sum(dist.log_prob(action))

    loc, scale = jnp.full_like(action, 0.3), jnp.full_like(action, 0.2)
    grads = jax.grad(total, argnums=(0, 1, 2))(loc, scale, action)
    for grad in grads:
        assert np.all(np.isfinite(grad))
    assert np.all(np.isfinite(total(loc, scale, action)))


def test_min_distance_clamps_like_a_threshold():
    dist = samplers.SquashedNormal(jnp.zeros((2, 1)), jnp.ones((2, 1)), samplers.Tanh())
    clamped = dist.log_prob(jnp.array([[0.9999], [0.999]]), min_distance=1e-3)
    np.testing.assert_allclose(clamped[0], clamped[1], rtol=1e-5)


@pytest.mark.parametrize(
    "bijector",
    [distrax.Lambda(lambda x: x), distrax.ScalarAffine(0.0, 2.0)],
    ids=["Lambda", "affine"],
)
def test_min_distance_refuses_bijectors_without_a_squashing(bijector):
    dist = samplers.SquashedNormal(jnp.zeros(2), jnp.ones(2), bijector)
    name = type(bijector).__name__
    with pytest.raises(TypeError, match=rf"min_distance needs a squashing .* got {name}; drop"):
        dist.log_prob(jnp.zeros(2), min_distance=1e-3)


def test_refuses_bad_arguments():
    dist = samplers.normal_tanh(jnp.zeros((4, 6)))
    with pytest.raises(ValueError, match=r"shape \[\*batch, action\] = \(4, 3\), got \(4, 2\)"):
        dist.log_prob(jnp.zeros((4, 2)))
    with pytest.raises(TypeError, match=r"value must have a floating dtype, got int32"):
        dist.log_prob(jnp.zeros((4, 3), jnp.int32))
    with pytest.raises(ValueError, match=r"min_distance must be in \(0, 1\).*got 1.0"):
        dist.log_prob(jnp.zeros((4, 3)), min_distance=1.0)


def test_leading_sample_axes_score_each_action_under_the_same_distribution():
    dist = samplers.SquashedNormal(jnp.array([0.2, -0.4]), jnp.array([0.5, 1.5]), samplers.Tanh())
    actions = jnp.array([[0.1, 0.9], [-0.99, 1.0], [0.0, -1.0]])
    ours = dist.log_prob(actions)
    assert ours.shape == (3,)
    for row, value in zip(actions, ours, strict=True):
        assert float(value) == pytest.approx(float(dist.log_prob(row)), rel=1e-6)


@pytest.mark.parametrize(
    "bijector, actions",
    [
        (samplers.Tanh(), [1.5, -7.0, float(np.nextafter(np.float32(1), np.float32(2)))]),
        (samplers.BoundedTanh(-0.1, 0.3), [0.31, -0.2, 1.0]),
        (distrax.Sigmoid(), [-1e-3, 1.5, -1.0]),
    ],
    ids=["Tanh", "BoundedTanh[-0.1,0.3]", "Sigmoid"],
)
def test_actions_outside_the_range_are_nan_not_scored_on_the_bound(bijector, actions):
    dist = samplers.SquashedNormal(jnp.zeros((4, 1)), jnp.ones((4, 1)), bijector)
    action = jnp.array([[0.2], *([a] for a in actions)])
    for scores in (dist.log_prob(action), dist.log_prob(action)):
        assert np.isfinite(scores[0])
        assert np.all(np.isnan(scores[1:])), scores


@pytest.mark.parametrize(
    "bijector", [samplers.Sigmoid(), distrax.Sigmoid()], ids=["samplers", "distrax"]
)
def test_a_sigmoid_action_on_a_bound_is_scored_as_the_mass_that_rounds_onto_it(bijector):
    # At 0 the cell is the smallest normal float (x ~ -87.3); at 1, half of 2**-24.
    tiny, half_step = np.float64(np.finfo(np.float32).tiny), 2.0**-25
    threshold = np.array([tiny, 1 - half_step])
    _, x = _sigmoid_reference_float64(threshold, 0.5, 30.0)
    assert x[0] == pytest.approx(-87.34, abs=0.01)
    expected, _, _ = _atom_float64(x, 0.5, 30.0, np.array([False, True]))
    dist = samplers.SquashedNormal(jnp.full((2, 1), 0.5), jnp.full((2, 1), 30.0), bijector)
    action = jnp.array([[0.0], [1.0]])
    np.testing.assert_allclose(dist.log_prob(action), expected, rtol=1e-6)
    np.testing.assert_allclose(dist.log_prob(action), expected, rtol=1e-6)


def test_min_distance_clamps_a_fresh_sample_too_and_pulls_loc_to_the_clamped_point():
    min_distance = 1e-3
    clamped_pre_image = np.arctanh(1.0 - min_distance)  # ~3.8, for actions near +1

    def clamped_log_prob(loc, action):
        dist = samplers.SquashedNormal(loc, jnp.full_like(loc, 0.5), samplers.Tanh())
        return jnp.sum(dist.log_prob(action, min_distance=min_distance))

    dist = samplers.SquashedNormal(jnp.full(3, 10.0), jnp.full(3, 0.5), samplers.Tanh())
    sample = dist.sample(seed=jax.random.key(0))
    assert np.all(np.asarray(sample) > 1.0 - min_distance)
    copy = jnp.array(np.asarray(sample))  # a copy: not the array the sample remembers
    clamped = dist.log_prob(sample, min_distance=min_distance)
    assert float(clamped) == float(dist.log_prob(copy, min_distance=min_distance))
    assert float(clamped) != float(dist.log_prob(sample))  # the clamp, not the pre-image
    # d/d loc of log N(x_c; loc, s) is (x_c - loc) / s**2: towards the clamped pre-image.
    for loc in (10.0, 0.0):
        grad = jax.grad(clamped_log_prob)(jnp.full(3, loc), copy)
        expected = (clamped_pre_image - loc) / 0.25
        np.testing.assert_allclose(grad, np.full(3, expected), rtol=1e-3)


VALUE_SHAPES = {"(B,A)": (5, 2), "(S,B,A)": (7, 5, 2), "(S,1,A)": (7, 1, 2), "(A,)": (2,)}


# Each value shape twice, each squashing at least once, eager and jit alternating; the
# default tier runs each shape once.
BROADCAST_CASES = [
    (name, shape, squashing, bool((i + j) % 2), j == 1)
    for i, (name, shape) in enumerate(VALUE_SHAPES.items())
    for j, squashing in enumerate(
        [list(SQUASHINGS_AND_K)[(2 * i) % 6], list(SQUASHINGS_AND_K)[(2 * i + 1) % 6]]
    )
]


@pytest.mark.parametrize(
    "value_shape, squashing, jitted",
    [
        pytest.param(
            shape, q, j, id=f"{n}-{q}-{'jit' if j else 'eager'}", marks=[SLOW] if s else []
        )
        for n, shape, q, j, s in BROADCAST_CASES
    ],
)
def test_log_prob_broadcasts_as_distrax_and_matches_it_inside_the_range(
    value_shape, squashing, jitted
):
    bijector, k = SQUASHINGS_AND_K[squashing]
    maybe_jit = jax.jit if jitted else (lambda f: f)
    keys = jax.random.split(jax.random.key(0), 3)
    loc = k * jax.random.normal(keys[0], (5, 2))
    scale = k * jnp.exp(0.3 * jax.random.normal(keys[1], (5, 2)))
    dist = samplers.SquashedNormal(loc, scale, bijector)
    value = bijector.forward(k * jax.random.normal(keys[2], value_shape))
    ours = maybe_jit(lambda d, v: d.log_prob(v))(dist, value)
    shape = jnp.broadcast_shapes(value_shape, (5, 2))
    # distrax broadcasts too; the test session forbids implicit rank promotion.
    loc, scale, value = (jnp.broadcast_to(a, shape) for a in (loc, scale, value))
    expected = _plain_distrax(loc, scale, bijector).log_prob(value)
    assert ours.shape == shape[:-1]
    np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(dist.prob(value), jnp.exp(ours), rtol=1e-6)


def test_log_prob_refuses_a_value_that_does_not_broadcast():
    dist = samplers.normal_tanh(jnp.zeros((5, 4)))
    with pytest.raises(ValueError, match=r"value must broadcast with .* \(5, 2\), got \(3, 2\)"):
        dist.log_prob(jnp.zeros((3, 2)))


@pytest.mark.parametrize("bijector, k", squashing_and_k_cases("samplers.Sigmoid"))
def test_sample_then_score_is_finite_where_distrax_is_not(bijector, k, maybe_jit):
    # SAC's two lines, at stds and means where many samples round onto a bound.
    keys = jax.random.split(jax.random.key(1), 3)
    loc = 3 * k * jax.random.normal(keys[0], (2048, 2))
    scale = k * jnp.exp(jax.random.uniform(keys[1], (2048, 2), maxval=1.6))
    dist = samplers.SquashedNormal(loc, scale, bijector)
    action = dist.sample(seed=keys[2])
    log_prob = maybe_jit(lambda d, a: d.log_prob(a))(dist, action)
    low, high = squashing_bounds_float64(bijector)
    on_bound = np.any((np.asarray(action) == low) | (np.asarray(action) == high), axis=-1)
    assert on_bound.sum() > 50
    assert np.all(np.isfinite(log_prob))
    assert not np.any(np.isfinite(_plain_distrax(loc, scale, bijector).log_prob(action))[on_bound])


def _idiom(bijector, k, key, use_sample_and_log_prob):
    """``mean(log p)`` of a fresh sample, as SAC code writes it, of ``(loc, log_std)``."""

    def loss(loc, log_std):
        dist = samplers.SquashedNormal(k * loc, k * jnp.exp(log_std), bijector)
        if use_sample_and_log_prob:
            _, log_prob = dist.sample_and_log_prob(seed=key, sample_shape=3)
        else:
            log_prob = dist.log_prob(dist.sample(seed=key, sample_shape=3))
        return jnp.mean(log_prob)

    return loss


FRESH_SAMPLE_DEFAULTS = {("BoundedTanh[-2,3]", "vmap")}


# Vector bounds under vmap by default; the rest of the product in the slow tier.
@pytest.mark.parametrize(
    "bijector, k, transform",
    [
        pytest.param(
            *value,
            transform,
            id=f"{name}-{transform}",
            marks=[] if (name, transform) in FRESH_SAMPLE_DEFAULTS else [SLOW],
        )
        for name, value in SQUASHINGS_AND_K.items()
        for transform in ["eager", "jit", "vmap"]
    ],
)
def test_log_prob_of_a_fresh_sample_is_exact_in_value_and_gradient(bijector, k, transform):
    # a = dist.sample(seed=key); dist.log_prob(a): the sample remembers its pre-image,
    # so the value and the gradient are sample_and_log_prob's, saturated or not.
    keys = jax.random.split(jax.random.key(7), 2)
    loc, log_std = jnp.asarray(SATURATING_LOC), jnp.asarray(SATURATING_LOG_STD)

    def value_and_grad(use_sample_and_log_prob):
        def one(key):
            loss = _idiom(bijector, k, key, use_sample_and_log_prob)
            return jax.value_and_grad(loss, argnums=(0, 1))(loc, log_std)

        if transform == "vmap":
            return jax.vmap(one)(keys)
        return (jax.jit(one) if transform == "jit" else one)(keys[0])

    idiom, reference = value_and_grad(False), value_and_grad(True)
    for ours, expected in zip(jax.tree.leaves(idiom), jax.tree.leaves(reference), strict=True):
        np.testing.assert_array_equal(ours, expected)
    # And both are the pathwise derivative, written out in float64: with x = loc + s eps
    # and log|f'(x)| = log(h / k) + log sech(x / k)**2, d/dloc = (2 / k) tanh(x / k) and
    # d/dlog_std = -1 + (2 / k) tanh(x / k) s eps, averaged over the samples.
    dist = samplers.SquashedNormal(k * loc, k * jnp.exp(log_std), bijector)
    pre_image = np.asarray(dist.distribution.sample(seed=keys[0], sample_shape=3), np.float64)
    slope = 2 / k * np.tanh(pre_image / k)
    shift = pre_image - k * np.asarray(loc, np.float64)  # s eps
    batch = loc.shape[0]  # the loss averages over 3 samples and this batch
    d_loc = k * np.mean(slope, axis=0) / batch
    d_log_std = np.mean(-1 + slope * shift, axis=0) / batch
    grad_loc, grad_log_std = (g[0] if transform == "vmap" else g for g in idiom[1])
    np.testing.assert_allclose(grad_loc, d_loc, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(grad_log_std, d_log_std, rtol=1e-4, atol=1e-6)


# Tanh and Sigmoid, whose rounding cells differ (_half_step).
@pytest.mark.parametrize("bijector, k", squashing_and_k_cases("samplers.Tanh", "samplers.Sigmoid"))
def test_a_sample_scored_without_its_pre_image_loses_only_what_its_rounding_lost(bijector, k):
    keys = jax.random.split(jax.random.key(2), 3)
    loc = 3 * k * jax.random.normal(keys[0], (4096, 2))
    scale = k * jnp.exp(jax.random.uniform(keys[1], (4096, 2), maxval=1.6))
    dist = samplers.SquashedNormal(loc, scale, bijector)
    action, pre_image, _ = dist.sample_with_pre_image(seed=keys[2])
    # One dimension at a time, so that each score has one distance to a bound.
    for axis in range(2):
        one = slice(axis, axis + 1)
        marginal_bijector = bijector
        if isinstance(bijector, samplers.BoundedTanh):
            low, high = (jnp.broadcast_to(b, (2,))[one] for b in (bijector.low, bijector.high))
            marginal_bijector = samplers.BoundedTanh(low, high)
        marginal = samplers.SquashedNormal(loc[:, one], scale[:, one], marginal_bijector)
        y = action[:, axis : axis + 1]
        x = pre_image[:, axis : axis + 1]
        ours = np.asarray(marginal.log_prob(y), np.float64)
        from_pre_image = np.asarray(marginal.log_prob_from_pre_image(x), np.float64)
        low, high = (b[axis] for b in squashing_bounds_float64(bijector))
        half_range = (high - low) / 2
        distance = np.minimum(np.asarray(y[:, 0]) - low, high - np.asarray(y[:, 0])) / half_range
        saturated = distance == 0
        assert saturated.sum() > 50
        # Inside: the documented bound plus |d log p / dx| times the pre-image's shift,
        # k eps (1 + max(|low|, |high|) / half_range) / distance.
        x64, l64, s64 = (np.asarray(a[:, axis], np.float64) for a in (pre_image, loc, scale))
        slope = np.abs(x64 - l64) / s64**2 + 2 / k
        shift = k * EPS32 * (1 + max(abs(low), abs(high)) / half_range) / distance[~saturated]
        bound = 4 * EPS32 * (1 + np.abs(x64) * np.abs(x64 - l64) / s64**2 + np.abs(from_pre_image))
        inside_error = np.abs(ours - from_pre_image)[~saturated]
        assert np.all(inside_error <= bound[~saturated] + slope[~saturated] * shift)
        # On a bound: the log-probability that X lies beyond the pre-image of the
        # middle of the cell that rounds onto it, whatever the pre-image was.
        upper = np.asarray(y[:, 0]) == high
        inner = np.where(
            upper,
            np.float64(high) - _half_step(high, low, half_range, k),
            np.float64(low) + _half_step(low, high, half_range, k),
        )
        inner_pre_image = 0.5 * k * (np.log(inner - low) - np.log(high - inner))
        z = np.where(upper, l64 - inner_pre_image, inner_pre_image - l64) / s64
        np.testing.assert_allclose(ours[saturated], scipy_special.log_ndtr(z)[saturated], rtol=1e-5)
        assert np.all(np.isfinite(ours))


def _half_step(bound, other, half_range, k):
    """Half the coarser of tanh's step (k = 1) and the float32 spacing at ``bound``."""
    spacing = abs(np.float64(np.nextafter(np.float32(bound), np.float32(other))) - bound)
    tanh_step = half_range * 2.0**-24 if k == 1.0 else 0.0
    return max(0.5 * max(spacing, tanh_step), np.finfo(np.float32).tiny)


@pytest.mark.parametrize("bijector, k", squashing_and_k_cases("BoundedTanh[-2,3]"))
def test_log_prob_gradients_are_finite_on_the_closed_range(bijector, k, maybe_jit):
    low, high = squashing_bounds_float64(bijector)
    u = np.array([0.0, 2.0**-24, 1e-3, 0.3, 0.5, 0.9, 1 - 1e-6, 1 - 2.0**-24, 1.0])
    action = jnp.asarray((low + (high - low) * u[:, None]).clip(low, high), jnp.float32)
    loc, scale = jnp.full_like(action, 0.3 * k), jnp.full_like(action, 0.2 * k)

    def total(loc, scale, action):
        return jnp.sum(samplers.SquashedNormal(loc, scale, bijector).log_prob(action))

    value, grads = maybe_jit(jax.value_and_grad(total, argnums=(0, 1, 2)))(loc, scale, action)
    assert np.isfinite(value)
    for grad in grads:
        assert np.all(np.isfinite(grad))


def test_log_prob_gradients_reach_the_bounds():
    def total(low):
        bijector = samplers.BoundedTanh(low, low + 2.0)
        dist = samplers.SquashedNormal(jnp.zeros((2, 1)), jnp.ones((2, 1)), bijector)
        return dist.log_prob(jnp.array([[0.2], [1.0]]))

    grads = jax.jacobian(total)(jnp.float32(-1.0))

    def reference(low):  # float64 log p of y = 0.2 under bounds [low, low + 2]
        x = np.arctanh(0.2 - (low + 1.0))
        return -0.5 * x**2 - np.log(1 - np.tanh(x) ** 2)

    h = 1e-6
    expected = (reference(-1.0 + h) - reference(-1.0 - h)) / (2 * h)
    assert float(grads[0]) == pytest.approx(expected, rel=1e-3)
    assert np.isfinite(grads[1])


@pytest.mark.parametrize(
    "bijector",
    [
        distrax.Lambda(lambda x: x),
        tfb.Tanh(),
        distrax.Chain([distrax.Tanh(), distrax.ScalarAffine(0.0, 2.0)]),
    ],
    ids=["identity", "tfp.Tanh", "chain"],
)
def test_other_bijectors_score_as_distrax_does(bijector):
    loc, scale = jnp.array([[0.1, -0.3], [0.0, 9.0]]), jnp.array([[0.5, 1.0], [1.0, 0.1]])
    dist = samplers.SquashedNormal(loc, scale, bijector)
    action = distrax.as_bijector(bijector).forward(jnp.array([[0.2, 0.4], [0.0, 20.0]]))
    expected = _plain_distrax(loc, scale, bijector).log_prob(action)
    np.testing.assert_allclose(dist.log_prob(action), expected, rtol=1e-6)


@given(
    action=st.floats(-1.0, 1.0, width=32, allow_subnormal=False),
    loc=st.floats(-20.0, 20.0, width=32, allow_subnormal=False),
    scale=st.floats(2.0**-10, 10.0, width=32, allow_subnormal=False),
)
def test_log_prob_and_its_gradients_are_finite_for_any_action_in_the_closed_range(
    action, loc, scale
):
    def log_prob(action, loc, scale):
        dist = samplers.SquashedNormal(loc[None], scale[None], samplers.Tanh())
        return dist.log_prob(action[None])

    args = (jnp.float32(action), jnp.float32(loc), jnp.float32(scale))
    value, grads = jax.value_and_grad(log_prob, argnums=(0, 1, 2))(*args)
    assert np.isfinite(value) and all(np.isfinite(g) for g in grads)


def test_log_prob_near_the_centre_keeps_the_relative_accuracy_of_a_small_pre_image():
    # x = atanh(2e-5) in float64 is 2e-5 to 1e-14: the distances 1 +- y round, their
    # logarithms cancel, and x must come from their exact difference instead.
    for bijector, low, high in (
        (samplers.Tanh(), -1.0, 1.0),
        (samplers.BoundedTanh(-0.1, 0.3), -0.1, 0.3),
        (samplers.Sigmoid(), 0.0, 1.0),
    ):
        low32, high32 = np.float64(np.float32(low)), np.float64(np.float32(high))
        centre = np.float32((low32 + high32) / 2)
        action = np.float32(centre + 2e-5 * (high32 - low32) / 2)
        k = 2.0 if isinstance(bijector, samplers.Sigmoid) else 1.0
        dist = samplers.squashed_normal_from_std(jnp.array([0.0]), jnp.array([1e-5]), bijector)
        u = (2 * np.float64(action) - low32 - high32) / (high32 - low32)
        x = k * np.arctanh(u)
        log_det = np.log((high32 - low32) / (2 * k)) - 2 * np.log(np.cosh(x / k))
        expected = stats.norm.logpdf(x, 0.0, np.float64(np.float32(1e-5))) - log_det
        ours = float(dist.log_prob(jnp.array([action])))
        # The documented bound: 4 eps (1 + |x| |x - loc| / scale**2 + |log p|).
        bound = 4 * EPS32 * (1 + abs(x) * abs(x) / np.float32(1e-5) ** 2 + abs(expected))
        assert abs(ours - expected) <= bound, (bijector, ours, expected)


def _plain_distrax(loc, scale, bijector):
    return distrax.Transformed(
        distrax.MultivariateNormalDiag(loc, scale), distrax.Block(bijector, 1)
    )
