"""The other ``distrax.Distribution`` methods of ``SquashedNormal``, against independent oracles.

``sample`` and ``sample_and_log_prob``, ``mean``/``variance``, ``cdf`` and its
relatives, ``quantile``, ``median``, ``kl_divergence``, indexing; what a bijector without
a squashing keeps or refuses. Where a squashed-Normal test goes: ``tests/README.md``.
"""

import distrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import special, stats
from tensorflow_probability.substrates import jax as tfp

import samplers
from tests._tiers import SLOW, each_value_once, slow
from tests.helpers import (
    SATURATING_LOC,
    SATURATING_LOG_STD,
    SQUASHINGS_AND_K,
    squashing_and_k_cases,
    squashing_bounds_float64,
)

tfb = tfp.bijectors
EPS32 = 2.0**-23

# The squashings share one code path (bounds and k): the default tier runs each of Tanh,
# vector asymmetric bounds and Sigmoid in some of the tests, each test those it names.
# distrax's Tanh and Sigmoid (the same squashings) and scalar bounds are slow, except
# where a distrax bijector is the point.
SLOW_SQUASHINGS = {"BoundedTanh[-0.1,0.3]", "distrax.Sigmoid", "distrax.Tanh"}


@pytest.mark.parametrize(
    *each_value_once(
        {
            "bijector, k": SQUASHINGS_AND_K,
            "sample_shape": {"one": (), "(3,)": (3,)},
        },
        slow_ids=SLOW_SQUASHINGS,
    )
)
def test_sample_and_log_prob_scores_the_pre_image_without_inverting(bijector, k, sample_shape):
    loc = jnp.broadcast_to(jnp.array([0.0, 12.0 * k]), (64, 2))
    scale = jnp.broadcast_to(jnp.array([3.0 * k, 0.5]), (64, 2))
    dist = samplers.SquashedNormal(loc, scale, bijector)
    key = jax.random.key(3)
    action, log_prob = dist.sample_and_log_prob(seed=key, sample_shape=sample_shape)
    pre_image = dist.distribution.sample(seed=key, sample_shape=sample_shape)
    assert action.shape == (*sample_shape, 64, 2) and log_prob.shape == (*sample_shape, 64)
    # Sigmoid actions are the logistic map's (distrax.Sigmoid's forward switches to a
    # less accurate exp(x) below x ~ -9).
    forward = jax.nn.sigmoid if k == 2.0 else bijector.forward
    np.testing.assert_array_equal(action, forward(pre_image))
    score = dist.log_prob_from_pre_image
    expected = jax.vmap(score)(pre_image) if sample_shape else score(pre_image)
    np.testing.assert_allclose(log_prob, expected, rtol=1e-6, atol=1e-5)
    assert np.all(np.isfinite(log_prob)) and np.any(np.abs(pre_image[..., 1]) > 9 * k)


# (loc, scale) of t = x / k: narrow and wide of the switch at 1/2, saturated, tiny.
MOMENT_CASES = [
    (0.0, 0.05),
    (0.3, 0.2),
    (-1.0, 0.49),
    (2.0, 0.5),
    (0.5, 0.51),
    (-0.5, 1.0),
    (2.0, 3.0),
    (0.0, 10.0),
    (10.0, 0.1),
    (-12.0, 0.3),
    (4.0, 0.05),
    (30.0, 5.0),
    (20.0, 1.0),
    (-18.0, 0.8),
    (0.0, 1e-4),
]


def _tanh_moments_float64(m, s):
    """Mean and variance of tanh(t), t ~ N(m, s), by float64 Gauss-Legendre quadrature:
    64 nodes on each of 40 equal intervals over ``m +- 40 s`` (within 1e-13 relative of
    scipy's adaptive ``quad`` at ``epsrel=1e-13``, and of twice the nodes and intervals).

    Integrates ``v = tanh(t) - sign(m)``, written through the logistic function, so
    that a saturated variance keeps its digits.
    """
    sign = 1.0 if m >= 0 else -1.0
    nodes, weights = np.polynomial.legendre.leggauss(64)
    edges = np.linspace(m - 40 * s, m + 40 * s, 41)
    start, end = edges[:-1, None], edges[1:, None]
    t = (end - start) / 2 * nodes + (end + start) / 2
    weights = (end - start) / 2 * weights * stats.norm.pdf(t, m, s)
    v = -sign * 2 * special.expit(-2 * sign * t)
    mean_v = np.sum(weights * v)
    return mean_v + sign, np.sum(weights * (v - mean_v) ** 2)


@pytest.fixture(scope="module")
def tanh_moments():
    return np.array([_tanh_moments_float64(m, s) for m, s in MOMENT_CASES])


MOMENT_BIJECTORS = {
    "Tanh": (samplers.Tanh(), -1.0, 1.0, 1.0),
    "BoundedTanh[-0.1,0.3]": (samplers.BoundedTanh(-0.1, 0.3), -0.1, 0.3, 1.0),
    "Sigmoid": (distrax.Sigmoid(), 0.0, 1.0, 2.0),
}


# Tanh in float32 and float64 by default; the other squashings in the slow tier.
MOMENT_CASES_BY_DTYPE = [
    pytest.param(
        squash, dtype, *tolerances, id=f"{name}-{dtype}", marks=[] if name == "Tanh" else [SLOW]
    )
    for name, squash in MOMENT_BIJECTORS.items()
    for dtype, tolerances in [("float32", (1e-6, 1e-5)), ("float64", (1e-12, 1e-10))]
]


@pytest.mark.parametrize("squash, dtype, mean_tolerance, variance_tolerance", MOMENT_CASES_BY_DTYPE)
def test_mean_and_variance_match_float64_integrals(
    squash, dtype, mean_tolerance, variance_tolerance, tanh_moments
):
    bijector, low, high, k = squash
    low, high = np.float64(np.float32(low)), np.float64(np.float32(high))  # the bounds it holds
    center, half_range = (low + high) / 2, (high - low) / 2
    with jax.enable_x64(dtype == "float64"):
        loc, scale = (
            jnp.asarray(k * np.array(c)[:, None], dtype) for c in zip(*MOMENT_CASES, strict=True)
        )
        dist = samplers.SquashedNormal(loc, scale, bijector)
        mean, variance, stddev = dist.mean(), dist.variance(), dist.stddev()
    expected_mean = center + half_range * tanh_moments[:, 0]
    expected_variance = half_range**2 * tanh_moments[:, 1]
    assert mean.shape == variance.shape == (len(MOMENT_CASES), 1)
    mean_error = np.abs(np.asarray(mean[:, 0], np.float64) - expected_mean) / half_range
    variance_error = np.abs(np.asarray(variance[:, 0], np.float64) / expected_variance - 1)
    assert np.all(mean_error <= mean_tolerance), mean_error
    assert np.all(variance_error <= variance_tolerance), variance_error
    np.testing.assert_array_equal(stddev, jnp.sqrt(variance))


def test_moments_are_nan_for_invalid_parameters(maybe_jit):
    loc = jnp.array([[0.0], [jnp.nan], [0.0], [0.0]])
    scale = jnp.array([[1.0], [1.0], [jnp.inf], [-1.0]])
    dist = samplers.SquashedNormal(loc, scale, samplers.Tanh())
    mean, variance = maybe_jit(lambda d: (d.mean(), d.variance()))(dist)
    assert np.isfinite(mean[0, 0]) and np.all(np.isnan(mean[1:]))
    assert np.isfinite(variance[0, 0]) and np.all(np.isnan(variance[1:]))


def _tanh_dist_and_reference(loc, scale):
    dist = samplers.SquashedNormal(jnp.asarray(loc), jnp.asarray(scale), samplers.Tanh())
    return dist, np.asarray(loc, np.float64), np.asarray(scale, np.float64)


def test_cdf_is_the_joint_cdf_of_the_event_as_in_distrax_independent(maybe_jit):
    loc, scale = (
        np.array([[0.3, -1.0], [5.0, 0.5]], np.float32),
        np.array([[0.7, 2.0], [0.1, 3.0]], np.float32),
    )
    dist, loc64, scale64 = _tanh_dist_and_reference(loc, scale)
    u = np.float32(1 - 2.0**-24)
    value = np.array(
        [
            [[0.2, -0.5], [0.0, 0.9]],
            [[u, -u], [-1.0, 1.0]],
            [[1.0, 1.0], [1.5, 0.3]],
            [[-7.0, 0.0], [1.0, -1.0]],
        ],
        np.float32,
    )
    log_cdf = maybe_jit(lambda d, v: d.log_cdf(v))(dist, value)
    # Per dimension Phi((atanh(y) - loc) / scale) in float64, 0 below -1 and 1 above 1.
    y = value.astype(np.float64)
    with np.errstate(divide="ignore"):
        z = (np.arctanh(np.clip(y, -1, 1)) - loc64) / scale64
    expected = np.sum(stats.norm.logcdf(z), axis=-1)
    assert log_cdf.shape == (4, 2)
    finite = np.isfinite(expected)
    np.testing.assert_allclose(log_cdf[finite], expected[finite], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(log_cdf[~finite], expected[~finite])
    np.testing.assert_allclose(dist.cdf(value), np.exp(expected), rtol=1e-5, atol=1e-7)
    # TFP's Independent(TransformedDistribution) inside the range.
    tfd = tfp.distributions
    plain = tfd.Independent(tfd.TransformedDistribution(tfd.Normal(loc, scale), tfb.Tanh()), 1)
    np.testing.assert_allclose(log_cdf[0], plain.log_cdf(value[0]), rtol=1e-5)


def test_log_cdf_and_survival_keep_their_far_tails():
    # loc = 5, scale = 0.1 in pre-image units: y = 0 is 50 standard deviations below.
    dist, _, _ = _tanh_dist_and_reference(
        np.full((2, 1), 5.0, np.float32), np.full((2, 1), 0.1, np.float32)
    )
    value = np.array([[0.0], [np.tanh(5.0) - 0.0]], np.float32)
    z = (np.arctanh(value[:, 0].astype(np.float64)) - 5.0) / 0.1
    np.testing.assert_allclose(dist.log_cdf(value), stats.norm.logcdf(z), rtol=1e-5)
    np.testing.assert_allclose(dist.log_survival_function(value), stats.norm.logsf(z), rtol=1e-5)
    np.testing.assert_allclose(dist.survival_function(value), stats.norm.sf(z), rtol=1e-5)
    # Above the mass: the survival function is tiny but not 1 - cdf = 0.
    up = np.array([[np.float32(1 - 2.0**-24)], [0.9999]], np.float32)
    z_up = (np.arctanh(up[:, 0].astype(np.float64)) - 5.0) / 0.1
    np.testing.assert_allclose(dist.log_survival_function(up), stats.norm.logsf(z_up), rtol=1e-5)


def test_survival_function_at_and_beyond_the_bounds():
    dist = samplers.SquashedNormal(
        jnp.zeros((4, 1)), jnp.ones((4, 1)), samplers.BoundedTanh(-2.0, 3.0)
    )
    value = jnp.array([[-2.5], [-2.0], [3.0], [4.0]])
    np.testing.assert_array_equal(dist.survival_function(value), [1.0, 1.0, 0.0, 0.0])
    np.testing.assert_array_equal(dist.cdf(value), [0.0, 0.0, 1.0, 1.0])


# Asymmetric bounds by default; Tanh and Sigmoid, of the same family, slow.
@pytest.mark.parametrize(
    "squash",
    [
        pytest.param(v, id=n, marks=[] if n == "BoundedTanh[-0.1,0.3]" else [SLOW])
        for n, v in MOMENT_BIJECTORS.items()
    ],
)
def test_quantile_inverts_the_cdf_and_matches_scipy(squash, maybe_jit):
    bijector, low, high, k = squash
    center, half_range = (low + high) / 2, (high - low) / 2
    loc, scale = jnp.array([[0.4 * k], [-2.0 * k]]), jnp.array([[0.3 * k], [2.0 * k]])
    dist = samplers.SquashedNormal(loc, scale, bijector)
    p = np.array([[0.01, 0.01], [0.3, 0.3], [0.5, 0.5], [0.9, 0.9]], np.float32)
    quantile = maybe_jit(lambda d, p: d.quantile(p))(dist, p)
    assert quantile.shape == (4, 2, 1)
    x = stats.norm.ppf(
        p.astype(np.float64), np.asarray(loc[:, 0], np.float64), np.asarray(scale[:, 0], np.float64)
    )
    expected = center + half_range * np.tanh(x / k)
    np.testing.assert_allclose(quantile[..., 0], expected, rtol=1e-5, atol=1e-6)
    # The round trip, where the float32 action resolves its pre-image (the first row).
    np.testing.assert_allclose(dist.cdf(quantile)[:, 0], p[:, 0], rtol=1e-4)
    np.testing.assert_allclose(dist.quantile(np.float32(0.5))[:, 0], dist.median()[:, 0])
    ends = dist.quantile(jnp.array([[0.0, 0.0], [1.0, 1.0], [-0.1, 0.2], [1.1, 0.2]]))
    np.testing.assert_array_equal(ends[:2, :, 0], np.float32([[low, low], [high, high]]))
    assert np.isnan(ends[2, 0, 0]) and np.isnan(ends[3, 0, 0]) and np.isfinite(ends[2, 1, 0])


def test_median_is_the_bijector_of_the_mean_and_halves_the_mass():
    dist = samplers.SquashedNormal(
        jnp.array([[0.3], [-1.0]]), jnp.array([[2.0], [0.5]]), samplers.Tanh()
    )
    np.testing.assert_array_equal(dist.median(), jnp.tanh(dist.loc))
    np.testing.assert_allclose(dist.cdf(dist.median()), [0.5, 0.5], rtol=1e-6)


def test_an_identity_bijector_keeps_distrax_closed_forms():
    loc, scale = jnp.array([[0.3, -1.0]]), jnp.array([[0.5, 2.0]])
    dist = samplers.SquashedNormal(
        loc, scale, distrax.Lambda(lambda x: x, is_constant_jacobian=True)
    )
    normal = distrax.MultivariateNormalDiag(loc, scale)
    np.testing.assert_allclose(dist.entropy(), normal.entropy(), rtol=1e-6)
    np.testing.assert_array_equal(dist.mean(), loc)
    np.testing.assert_array_equal(dist.mode(), loc)


@pytest.mark.parametrize(
    "method, args",
    [
        ("variance", ()),
        ("stddev", ()),
        ("cdf", (jnp.zeros(1),)),
        ("log_cdf", (jnp.zeros(1),)),
        ("survival_function", (jnp.zeros(1),)),
        ("quantile", (0.5,)),
    ],
)
def test_other_bijectors_refuse_what_needs_an_increasing_squashing(method, args):
    chain = distrax.Chain([distrax.ScalarAffine(0.0, -1.0), distrax.Tanh()])  # decreasing
    dist = samplers.SquashedNormal(jnp.zeros((2, 1)), jnp.ones((2, 1)), chain)
    with pytest.raises(
        NotImplementedError,
        match=rf"{method.replace('stddev', 'variance')} needs an increasing squashing .* got Chain",
    ):
        getattr(dist, method)(*args)


@pytest.mark.parametrize(
    "method, args, instead",
    [
        ("quantile", (0.5,), r"dist.median\(\)"),
        ("survival_function", (jnp.zeros(2),), r"1 - dist.cdf\(value\)"),
        ("log_survival_function", (jnp.zeros(2),), r"1 - dist.cdf\(value\)"),
    ],
)
def test_a_multivariate_event_refuses_what_is_one_dimensional(method, args, instead):
    dist = samplers.normal_tanh(jnp.zeros((3, 4)))
    with pytest.raises(
        NotImplementedError,
        match=rf"{method} is defined for a one-dimensional action, got 2 dimensions; use {instead}",
    ):
        getattr(dist, method)(*args)


@pytest.mark.parametrize(
    "index",
    [
        slow(0, id="0"),
        slow((slice(1, None),), id="1:"),
        pytest.param((Ellipsis, 0), id="...,0"),
        slow((1, 2), id="1,2"),
    ],
)
def test_indexing_slices_the_batch_and_keeps_the_bijector(index):
    keys = jax.random.split(jax.random.key(4), 2)
    bijector = samplers.BoundedTanh(jnp.array([-1.0, 0.0, 2.0]), jnp.array([1.0, 1.0, 3.0]))
    dist = samplers.squashed_normal(jax.random.normal(keys[0], (3, 4, 6)), bijector)
    action = dist.sample(seed=keys[1])
    sliced = dist[index]
    assert isinstance(sliced, samplers.SquashedNormal) and sliced.bijector.bijector is bijector
    batch_index = (index,) if not isinstance(index, tuple) else index
    # A copy: the sampled array itself would be scored at its pre-image.
    expected = np.asarray(dist.log_prob(np.asarray(action)))[batch_index]
    full_index = (*batch_index, slice(None))  # the action axis stays whole
    np.testing.assert_array_equal(sliced.loc, np.asarray(dist.loc)[full_index])
    np.testing.assert_allclose(sliced.log_prob(np.asarray(action)[full_index]), expected, rtol=1e-6)


def test_quantile_is_nan_for_invalid_parameters_even_at_p_zero_and_one():
    loc = jnp.array([[0.0], [jnp.nan], [0.0], [0.0]])
    scale = jnp.array([[1.0], [1.0], [jnp.nan], [-1.0]])
    dist = samplers.SquashedNormal(loc, scale, samplers.Tanh())
    for p in (0.0, 0.5, 1.0):
        quantile = np.asarray(dist.quantile(p))[:, 0]
        assert np.isfinite(quantile[0]) and np.all(np.isnan(quantile[1:])), (p, quantile)


@pytest.mark.parametrize("bijector, k", squashing_and_k_cases("BoundedTanh[-2,3]"))
def test_quantile_gradients_at_zero_and_one(bijector, k):
    # The bounds do not move with loc or scale; the slope in p is infinite there,
    # since the density vanishes at the bounds.
    marginal = bijector
    if isinstance(bijector, samplers.BoundedTanh):
        marginal = samplers.BoundedTanh(
            jnp.broadcast_to(bijector.low, (2,))[:1], jnp.broadcast_to(bijector.high, (2,))[:1]
        )

    def quantile(p, loc, scale):
        return samplers.SquashedNormal(loc, scale, marginal).quantile(p)[0]

    # One program for the three probabilities (eagerly each operation compiles).
    gradient = jax.jit(jax.grad(quantile, argnums=(0, 1, 2)))
    loc, scale = jnp.array([0.3 * k]), jnp.array([0.8 * k])
    for p in (0.0, 1.0):
        d_p, d_loc, d_scale = gradient(p, loc, scale)
        assert d_p == np.inf and d_loc[0] == 0 and d_scale[0] == 0
    # Inside, the slope in p is 1 / density(quantile), in float64.
    d_p, d_loc, _ = gradient(0.3, loc, scale)
    y = float(jax.jit(quantile)(0.3, loc, scale))
    low, high = (float(b[0]) for b in squashing_bounds_float64(bijector))
    x = k * np.arctanh((2 * y - low - high) / (high - low))
    density = stats.norm.pdf(x, float(loc[0]), float(scale[0])) / (
        (high - low) / (2 * k) / np.cosh(x / k) ** 2
    )
    assert float(d_p) == pytest.approx(1 / density, rel=1e-4)
    assert float(d_loc[0]) > 0


def test_kl_divergence_method_is_the_registered_exact_one():
    p = samplers.SquashedNormal(jnp.zeros(2), jnp.ones(2), samplers.BoundedTanh(-1.0, 1.0))
    q = samplers.SquashedNormal(jnp.ones(2), jnp.ones(2), samplers.BoundedTanh(-1.0, 1.0))
    wider = samplers.SquashedNormal(jnp.zeros(2), jnp.ones(2), samplers.BoundedTanh(-2.0, 2.0))
    # Base KL of N(0, 1) to N(1, 1): 1/2 per dimension.
    assert float(p.kl_divergence(q)) == pytest.approx(1.0, rel=1e-6)
    assert float(p.kl_divergence(q)) == float(p.kl_divergence(q))
    with pytest.raises(ValueError, match=r"must share their bijector, got BoundedTanh onto \[-1"):
        p.kl_divergence(wider)
    plain = distrax.Transformed(
        distrax.MultivariateNormalDiag(jnp.zeros(2), jnp.ones(2)),
        distrax.Block(samplers.BoundedTanh(-2.0, 2.0), 1),
    )
    for first, second in ((p, plain), (plain, p)):
        with pytest.raises(NotImplementedError, match=r"build both as samplers.SquashedNormal"):
            first.kl_divergence(second)


@pytest.mark.parametrize("bijector, k", squashing_and_k_cases("samplers.Tanh"))
def test_the_action_of_a_sample_keeps_its_pathwise_gradient_where_it_saturates(bijector, k):
    # SAC's -Q(s, a) term through a = dist.sample(seed=key): d a / d loc = f'(x), tiny
    # but positive where float32 f(x) rounds onto a bound (autodiff of tanh gives 0).
    loc = jnp.asarray(k * SATURATING_LOC)
    scale = jnp.asarray(k * np.exp(SATURATING_LOG_STD))
    key = jax.random.key(3)

    def critic_term(loc, method):
        dist = samplers.SquashedNormal(loc, scale, bijector)
        if method == "sample":
            action = dist.sample(seed=key)
        elif method == "sample_and_log_prob":
            action = dist.sample_and_log_prob(seed=key)[0]
        else:
            action = dist.sample_with_pre_image(seed=key)[0]
        return jnp.sum(action)  # dQ/da = 1

    low, high = squashing_bounds_float64(bijector)
    dist = samplers.SquashedNormal(loc, scale, bijector)
    for method, pre_image in (
        ("sample", dist.distribution.sample(seed=key)),
        ("sample_and_log_prob", dist.distribution.sample(seed=key)),
        ("sample_with_pre_image", dist.sample_pre_image(seed=key)),
    ):
        x = np.asarray(pre_image, np.float64)
        slope = (high - low) / (2 * k) / np.cosh(x / k) ** 2  # f'(x)
        assert np.any(slope < 1e-6), "no saturated sample"
        np.testing.assert_allclose(jax.grad(critic_term)(loc, method), slope, rtol=1e-5)


@pytest.mark.parametrize("bijector", [samplers.Tanh(), samplers.BoundedTanh(-2.0, 3.0)])
def test_eager_methods_compile_a_few_programs_not_one_per_operation(bijector):
    """Outside jit, building, sampling and scoring a new shape compiles at most 16 programs.

    JAX compiles each operation it runs eagerly; run one at a time, this path's
    maths was over 50 operations. The shape is one no other test uses, and a
    program another test compiled first only lowers the count.
    """
    compiled = []

    def listen(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(duration)

    params, key = jnp.zeros((29, 6)), jax.random.key(0)
    jax.block_until_ready(jax.random.normal(key, (3,)))  # the key's own programs
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        dist = samplers.squashed_normal(params, bijector)
        action = dist.sample(seed=key)
        jax.block_until_ready((dist.log_prob(action), dist.log_prob(action + 0.0)))
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert 0 < len(compiled) <= 16
