import distrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.scipy import stats
from scipy import special as scipy_special
from scipy import stats as scipy_stats

import samplers

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
    log_normal = -0.5 * ((x - loc) / scale) ** 2 - np.log(scale) - 0.5 * np.log(2 * np.pi)
    log_det = np.log(half_range) + 2 * np.log(2.0) - 2 * np.logaddexp(x, -x)
    return log_normal - log_det, x


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
    log_normal = -0.5 * ((x - loc) / scale) ** 2 - np.log(scale) - 0.5 * np.log(2 * np.pi)
    log_det = -np.logaddexp(0.0, x) - np.logaddexp(0.0, -x)  # log sigmoid'(x)
    return log_normal - log_det, x


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
    log_normal = -0.5 * ((x + 20.0) / 5.0) ** 2 - np.log(5.0) - 0.5 * np.log(2 * np.pi)
    expected = log_normal - (np.log(0.5) + 2 * np.log(2.0) - 2 * np.logaddexp(x, -x))
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
