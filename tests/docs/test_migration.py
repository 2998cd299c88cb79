"""The migration guide's mappings, checked against the peers themselves.

Each test builds a peer's tanh-squashed Gaussian (Brax's ``NormalTanhDistribution``,
``distrax.Transformed``, TFP's ``TransformedDistribution``, rlax's
``squashed_gaussian``) and the ``samplers`` call that the migration guide (docs/guides/migrating.md)
maps it to, from the same parameters, and compares their values. Values are compared
on unsaturated inputs (every pre-image inside ``(-4, 4)``, where float32 ``tanh`` is
strictly inside ``(-1, 1)``); the traps are shown where ``tanh`` saturates. The
references for what neither side computes exactly (the entropy, the density at the
mode) are written here in float64 NumPy.

Tolerances: sampling draws the same noise and applies the same float32 operations,
so samples agree to 1e-6 relative; log-densities, whose terms are computed in a
different order, to 1e-5 relative plus 1e-5 absolute. rlax maps onto the bounds with
two affine maps where ``BoundedTanh`` uses one: 1e-5 for samples, 1e-4 for
log-densities.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import samplers
from tests._tiers import SLOW

A = 3
MEAN = np.array(
    [[0.3, -0.5, 1.0], [0.0, 1.5, -1.2], [-0.8, 0.2, 0.6], [1.1, -1.4, 0.05]], np.float32
)
RAW_STD = np.array(
    [[0.2, -1.0, 0.5], [-0.5, 0.0, -1.5], [0.3, -0.2, -0.7], [-1.0, 0.4, 0.1]], np.float32
)
PARAMS = np.concatenate([MEAN, RAW_STD], -1)  # [mean | raw_std], as Brax's networks emit
STD = np.array([[0.5, 0.3, 1.2], [0.8, 0.05, 0.4], [1.0, 0.6, 0.2], [0.3, 0.9, 0.7]], np.float32)
KEYS = [jax.random.key(seed) for seed in (0, 1, 2)]
# The first key by default; the others repeat the check with other noise, slow.
SEEDS = [pytest.param(key, id=f"key{i}") for i, key in enumerate(KEYS)]
# Checks of the peers' own behaviour, which the library's code does not change.
pytestmark = SLOW
# Pre-images far past float32 saturation: tanh rounds them to exactly +-1.
SATURATED_MEAN = np.array([[10.0, -12.0, 0.0], [20.0, 0.5, -9.5]], np.float32)
SATURATED_STD = np.array([[0.1, 0.1, 1.0], [0.5, 0.2, 0.05]], np.float32)

SAMPLE = {"rtol": 1e-6, "atol": 1e-7}
LOG_PROB = {"rtol": 1e-5, "atol": 1e-5}


def _assert_unsaturated(pre_image):
    pre_image = np.asarray(pre_image)
    assert np.all(np.abs(pre_image) < 4.0), "a pre-image the test meant to keep inside (-4, 4)"
    assert np.all(np.abs(np.tanh(pre_image)) < 1.0)


def _assert_saturated_somewhere(action):
    assert np.any(np.abs(np.asarray(action)) == 1.0), "no action rounded onto a bound"


def _log_density_float64(action, loc, scale):
    """``log p(y)`` of ``tanh(N(loc, scale))`` per dimension, in float64."""
    action, loc, scale = (np.asarray(a, np.float64) for a in (action, loc, scale))
    x = np.arctanh(action)
    log_normal = -0.5 * ((x - loc) / scale) ** 2 - np.log(scale) - 0.5 * np.log(2 * np.pi)
    return log_normal - np.log1p(-(action**2))


def _squashed_entropy_float64(loc, scale, num_points=200):
    """``H[tanh(x)] = H[x] + E[log(1 - tanh(x)**2)]``, by Gauss-Hermite quadrature."""
    loc, scale = np.asarray(loc, np.float64), np.asarray(scale, np.float64)
    nodes, weights = np.polynomial.hermite.hermgauss(num_points)
    x = loc[..., None] + np.sqrt(2.0) * scale[..., None] * nodes
    log_det = 2 * np.log(2.0) - 2 * np.logaddexp(x, -x)
    expected_log_det = np.sum(weights * log_det, -1) / np.sqrt(np.pi)
    return np.sum(0.5 + 0.5 * np.log(2 * np.pi) + np.log(scale) + expected_log_det, -1)


def _peer_rank_promotion():
    """distrax's and TFP's batched sampling broadcasts by rank promotion, which this test
    session refuses (conftest); peers' calls run inside this context."""
    return jax.numpy_rank_promotion("allow")


def _ours_from_std(mean, std):
    return samplers.squashed_normal_from_std(jnp.asarray(mean), jnp.asarray(std))


# Brax -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def brax_distribution():
    return pytest.importorskip("brax.training.distribution")


@pytest.mark.parametrize("min_std, var_scale", [(0.001, 1.0), (0.01, 0.5)])
def test_brax_create_dist_is_normal_tanh(brax_distribution, min_std, var_scale):
    brax = brax_distribution.NormalTanhDistribution(A, min_std=min_std, var_scale=var_scale)
    theirs = brax.create_dist(jnp.asarray(PARAMS))
    ours = samplers.normal_tanh(PARAMS, min_std=min_std, std_scale=var_scale)
    np.testing.assert_array_equal(ours.loc, theirs.loc)
    # var_scale multiplies the std, not the variance: it is samplers' std_scale.
    np.testing.assert_allclose(ours.scale, theirs.scale, **SAMPLE)


@pytest.mark.parametrize("key", SEEDS)
def test_brax_sampling_is_the_same_transformation_of_the_same_noise(brax_distribution, key):
    brax = brax_distribution.NormalTanhDistribution(A)
    ours = samplers.normal_tanh(PARAMS)
    raw_action = brax.sample_no_postprocessing(jnp.asarray(PARAMS), key)
    action, pre_image, _ = ours.sample_with_pre_image(seed=key)
    _assert_unsaturated(pre_image)
    np.testing.assert_allclose(pre_image, raw_action, **SAMPLE)
    np.testing.assert_allclose(ours.sample_pre_image(seed=key), raw_action, **SAMPLE)
    np.testing.assert_allclose(action, brax.postprocess(raw_action), **SAMPLE)
    np.testing.assert_allclose(
        ours.bijector.forward(raw_action), brax.postprocess(raw_action), **SAMPLE
    )
    np.testing.assert_allclose(action, brax.sample(jnp.asarray(PARAMS), key), **SAMPLE)
    np.testing.assert_allclose(
        ours.sample(seed=key), brax.sample(jnp.asarray(PARAMS), key), **SAMPLE
    )


@pytest.mark.parametrize("where", ["unsaturated", "saturated"])
def test_brax_log_prob_of_the_raw_action_is_log_prob_from_pre_image(brax_distribution, where):
    brax = brax_distribution.NormalTanhDistribution(A)
    ours = samplers.normal_tanh(PARAMS)
    if where == "unsaturated":
        raw_action = brax.sample_no_postprocessing(jnp.asarray(PARAMS), KEYS[0])
        _assert_unsaturated(raw_action)
    else:
        raw_action = jnp.broadcast_to(jnp.array([10.0, -20.0, 50.0]), MEAN.shape)
        _assert_saturated_somewhere(jnp.tanh(raw_action))
    theirs = brax.log_prob(jnp.asarray(PARAMS), raw_action)
    mine = ours.log_prob_from_pre_image(raw_action)
    assert np.all(np.isfinite(mine))
    np.testing.assert_allclose(mine, theirs, **LOG_PROB)


def test_brax_scoring_a_stored_saturated_action_goes_through_an_infinite_inverse(
    brax_distribution,
):
    brax = brax_distribution.NormalTanhDistribution(A)
    params = jnp.concatenate([jnp.asarray(SATURATED_MEAN), jnp.zeros_like(SATURATED_MEAN)], -1)
    raw_action = brax.sample_no_postprocessing(params, KEYS[0])
    action = brax.postprocess(raw_action)
    _assert_saturated_somewhere(action)
    assert not np.all(np.isfinite(brax.inverse_postprocess(action)))
    assert np.any(np.isnan(brax.log_prob(params, brax.inverse_postprocess(action))))
    ours = samplers.normal_tanh(params)
    assert np.all(np.isfinite(ours.log_prob(action)))
    assert np.all(np.isfinite(ours.log_prob(action)))


def test_brax_mode_is_tanh_of_the_mean_which_is_the_median_not_the_mode(brax_distribution):
    brax = brax_distribution.NormalTanhDistribution(A)
    # std = softplus(raw_std) + min_std: raw_std chosen so that the std is 1.0 and 0.3.
    std = np.array([1.0, 0.3, 1.0])
    raw_std = np.log(np.expm1(std - 0.001))
    params = jnp.asarray(np.concatenate([[0.3, 0.5, -0.3], raw_std]), jnp.float32)
    ours = samplers.normal_tanh(params)
    median = brax.mode(params)
    np.testing.assert_allclose(median, ours.deterministic_action(), **SAMPLE)
    np.testing.assert_allclose(median, ours.median(), **SAMPLE)
    np.testing.assert_allclose(median, np.tanh([0.3, 0.5, -0.3]), rtol=1e-6)
    mode = ours.mode()
    # loc=0.3, std=1: bimodal, the mode sits near the bound; loc=0.5, std=0.3: 0.534.
    np.testing.assert_allclose(mode, [0.978, 0.534, -0.978], atol=1e-3)
    density_at_mode = _log_density_float64(mode, ours.loc, ours.scale)
    density_at_median = _log_density_float64(median, ours.loc, ours.scale)
    assert np.all(density_at_mode > density_at_median + 0.01)


def test_brax_entropy_is_a_one_sample_estimate_that_entropy_estimate_reproduces(
    brax_distribution,
):
    brax = brax_distribution.NormalTanhDistribution(A)
    params = jnp.asarray(PARAMS[0])
    ours = samplers.normal_tanh(params)
    keys = jax.random.split(jax.random.key(7), 4000)
    theirs = np.asarray(jax.vmap(lambda key: brax.entropy(params, key))(keys))
    mine = np.asarray(jax.vmap(lambda key: ours.entropy_estimate(seed=key))(keys))
    np.testing.assert_allclose(mine, theirs, **LOG_PROB)
    assert np.std(theirs) > 0.05  # it changes with the key: an estimate, not the entropy
    exact = _squashed_entropy_float64(ours.loc, ours.scale)
    standard_error = np.std(theirs) / np.sqrt(len(theirs))
    assert abs(np.mean(theirs) - exact) < 3 * standard_error
    # dist.entropy() is the value Brax's estimate averages to.
    assert float(ours.entropy()) == pytest.approx(exact, abs=1e-5)


def test_mode_median_and_entropy_methods_are_the_mode_the_median_and_the_entropy(
    brax_distribution,
):
    brax = brax_distribution.NormalTanhDistribution(A)
    ours = samplers.normal_tanh(PARAMS)
    np.testing.assert_allclose(ours.median(), brax.mode(jnp.asarray(PARAMS)), **SAMPLE)
    np.testing.assert_array_equal(ours.mode(), ours.mode())
    np.testing.assert_allclose(
        ours.entropy(), _squashed_entropy_float64(ours.loc, ours.scale), rtol=1e-5, atol=1e-5
    )


# distrax ----------------------------------------------------------------------------


def _distrax_tanh_normal(mean, std):
    import distrax

    return distrax.Transformed(
        distrax.MultivariateNormalDiag(jnp.asarray(mean), jnp.asarray(std)),
        distrax.Block(distrax.Tanh(), 1),
    )


@pytest.mark.parametrize("key", SEEDS)
def test_distrax_sample_and_sample_and_log_prob_match_for_the_same_key(key):
    theirs = _distrax_tanh_normal(MEAN, STD)
    ours = _ours_from_std(MEAN, STD)
    with _peer_rank_promotion():
        their_action, their_log_prob = theirs.sample_and_log_prob(seed=key)
        their_sample = theirs.sample(seed=key)
    action, pre_image, log_prob = ours.sample_with_pre_image(seed=key)
    _assert_unsaturated(pre_image)
    np.testing.assert_allclose(action, their_action, **SAMPLE)
    np.testing.assert_allclose(ours.sample(seed=key), their_sample, **SAMPLE)
    np.testing.assert_allclose(log_prob, their_log_prob, **LOG_PROB)


def test_distrax_log_prob_of_a_stored_action_matches_inside_the_range():
    theirs = _distrax_tanh_normal(MEAN, STD)
    ours = _ours_from_std(MEAN, STD)
    action, pre_image, _ = ours.sample_with_pre_image(seed=KEYS[1])
    _assert_unsaturated(pre_image)
    with _peer_rank_promotion():
        theirs_scored = theirs.log_prob(action)
    np.testing.assert_allclose(ours.log_prob_from_pre_image(pre_image), theirs_scored, **LOG_PROB)
    np.testing.assert_allclose(ours.log_prob(action), theirs_scored, **LOG_PROB)
    np.testing.assert_allclose(ours.log_prob(action), theirs_scored, **LOG_PROB)


def test_distrax_log_prob_of_its_own_saturated_sample_is_nan():
    theirs = _distrax_tanh_normal(SATURATED_MEAN, SATURATED_STD)
    ours = _ours_from_std(SATURATED_MEAN, SATURATED_STD)
    with _peer_rank_promotion():
        action = theirs.sample(seed=KEYS[0])
        scored = theirs.log_prob(action)
        scored_under_jit = jax.jit(lambda k: theirs.log_prob(theirs.sample(seed=k)))(KEYS[0])
        _, their_log_prob = theirs.sample_and_log_prob(seed=KEYS[0])
    _assert_saturated_somewhere(action)
    assert np.any(np.isnan(scored))
    assert np.any(np.isnan(scored_under_jit))
    # Sampling and scoring in one pass never inverts: finite, here and in samplers.
    our_action, _, our_log_prob = ours.sample_with_pre_image(seed=KEYS[0])
    np.testing.assert_array_equal(our_action, action)
    assert np.all(np.isfinite(their_log_prob))
    np.testing.assert_allclose(our_log_prob, their_log_prob, **LOG_PROB)
    # Scoring the action afterwards is finite too, on the bounds included.
    assert np.all(np.isfinite(ours.log_prob(action)))
    assert np.all(np.isfinite(jax.jit(lambda k: ours.log_prob(ours.sample(seed=k)))(KEYS[0])))
    assert np.all(np.isfinite(ours.log_prob(action)))


@pytest.mark.parametrize("method", ["mode", "entropy", "mean"])
def test_distrax_has_no_mode_entropy_or_mean_for_tanh(method):
    with pytest.raises(NotImplementedError, match="not known to be constant"):
        getattr(_distrax_tanh_normal(MEAN, STD), method)()


# TensorFlow Probability -------------------------------------------------------------


def _tfp():
    from tensorflow_probability.substrates import jax as tfp

    return tfp


def _tfp_tanh_normal(mean, std, base="MultivariateNormalDiag"):
    """The SB3-style JAX pattern: ``TransformedDistribution(base, tfb.Tanh())``."""
    tfd, tfb = _tfp().distributions, _tfp().bijectors
    mean, std = jnp.asarray(mean), jnp.asarray(std)
    if base == "MultivariateNormalDiag":
        base = tfd.MultivariateNormalDiag(mean, std)
    else:
        base = tfd.Independent(tfd.Normal(mean, std), 1)
    return tfd.TransformedDistribution(base, tfb.Tanh())


# Which TFP bases draw the same noise as samplers for the same key, and in which shapes.
SAME_NOISE = {
    "MultivariateNormalDiag,(A,)": ("MultivariateNormalDiag", 0),
    "Independent(Normal),(B,A)": ("Independent(Normal)", slice(None)),
}


@pytest.mark.parametrize("base, rows", SAME_NOISE.values(), ids=SAME_NOISE.keys())
@pytest.mark.parametrize("key", SEEDS)
def test_tfp_sample_and_log_prob_match_for_the_same_key(key, base, rows):
    theirs = _tfp_tanh_normal(MEAN[rows], STD[rows], base)
    ours = _ours_from_std(MEAN[rows], STD[rows])
    action, pre_image, log_prob = ours.sample_with_pre_image(seed=key)
    _assert_unsaturated(pre_image)
    with _peer_rank_promotion():
        their_sample = theirs.sample(seed=key)
        their_action, their_log_prob = theirs.experimental_sample_and_log_prob(seed=key)
        their_score = theirs.log_prob(np.asarray(action))
    np.testing.assert_allclose(action, their_sample, **SAMPLE)
    np.testing.assert_allclose(action, their_action, **SAMPLE)
    np.testing.assert_allclose(log_prob, their_log_prob, **LOG_PROB)
    np.testing.assert_allclose(log_prob, their_score, **LOG_PROB)


def test_tfp_batched_multivariate_normal_diag_orders_the_same_noise_differently():
    theirs = _tfp_tanh_normal(MEAN, STD)
    ours = _ours_from_std(MEAN, STD)
    with _peer_rank_promotion():
        their_pre_image = theirs.distribution.sample(seed=KEYS[0])
        their_score = theirs.log_prob(jnp.tanh(their_pre_image))
    their_noise = (np.asarray(their_pre_image) - MEAN) / STD
    our_noise = (np.asarray(ours.sample_pre_image(seed=KEYS[0])) - MEAN) / STD
    assert np.max(np.abs(their_noise - our_noise)) > 0.1
    np.testing.assert_allclose(np.sort(their_noise, None), np.sort(our_noise, None), atol=1e-5)
    # The same pre-image, wherever it came from, scores the same.
    _assert_unsaturated(their_pre_image)
    np.testing.assert_allclose(
        ours.log_prob_from_pre_image(their_pre_image), their_score, **LOG_PROB
    )


def test_tfp_scores_its_own_saturated_sample_only_through_its_cache():
    theirs = _tfp_tanh_normal(SATURATED_MEAN, SATURATED_STD)
    ours = _ours_from_std(SATURATED_MEAN, SATURATED_STD)
    with _peer_rank_promotion():
        action = theirs.sample(seed=KEYS[0])
        pre_image = theirs.distribution.sample(seed=KEYS[0])
        # The bijector remembers the pre-image of the array it returned, so scoring that
        # same array (eagerly or within one jit trace) is finite...
        scored = theirs.log_prob(action)
        scored_under_jit = jax.jit(lambda k: theirs.log_prob(theirs.sample(seed=k)))(KEYS[0])
        # ...and a copy of it, e.g. read back from a replay buffer, is NaN.
        stored = jnp.array(np.asarray(action))
        scored_copy = theirs.log_prob(stored)
    _assert_saturated_somewhere(action)
    np.testing.assert_array_equal(jnp.tanh(pre_image), action)
    assert np.all(np.isfinite(scored))
    assert np.all(np.isfinite(scored_under_jit))
    assert np.any(np.isnan(scored_copy))
    np.testing.assert_allclose(ours.log_prob_from_pre_image(pre_image), scored, **LOG_PROB)
    assert np.all(np.isfinite(ours.log_prob(stored)))
    assert np.all(np.isfinite(ours.log_prob(stored)))
    # samplers keeps the same cache: its own sample is scored at its pre-image,
    # eagerly and within one jit trace, as TFP's is.
    our_action = ours.sample(seed=KEYS[0])
    our_pre_image = ours.distribution.sample(seed=KEYS[0])
    _assert_saturated_somewhere(our_action)
    expected = ours.log_prob_from_pre_image(our_pre_image)
    np.testing.assert_array_equal(ours.log_prob(our_action), expected)
    under_jit = jax.jit(lambda k: ours.log_prob(ours.sample(seed=k)))(KEYS[0])
    np.testing.assert_allclose(under_jit, expected, rtol=1e-6)


def test_tfp_tanh_of_the_base_mode_is_the_median():
    """What the ``TanhTransformedDistribution`` pattern's ``().mode()`` returns."""
    theirs = _tfp_tanh_normal(MEAN, STD)
    with pytest.raises(NotImplementedError, match="mode"):
        theirs.mode()
    with pytest.raises(NotImplementedError, match="entropy"):
        theirs.entropy()
    with _peer_rank_promotion():
        tanh_of_base_mode = theirs.bijector.forward(theirs.distribution.mode())
    ours = _ours_from_std(MEAN, STD)
    np.testing.assert_allclose(ours.deterministic_action(), tanh_of_base_mode, **SAMPLE)
    mode = ours.mode()
    assert np.all(
        _log_density_float64(mode, MEAN, STD)
        >= _log_density_float64(tanh_of_base_mode, MEAN, STD) - 1e-6
    )
    assert np.any(np.abs(np.asarray(mode) - np.asarray(tanh_of_base_mode)) > 0.1)


@pytest.mark.parametrize("base, rows", SAME_NOISE.values(), ids=SAME_NOISE.keys())
def test_tfp_clipped_log_std_pattern_is_squashed_normal_from_log_std(base, rows):
    # Some log-stds outside [-2, 0], which both sides clip. (A std of exp(0) = 1 keeps
    # the pre-images inside (-4, 4); one far below exp(-2) would make the float32
    # action too coarse to score against the other side's inverse.)
    log_std = np.log(STD) + np.array([0.0, 25.0, -30.0], np.float32)
    theirs = _tfp_tanh_normal(MEAN[rows], np.exp(np.clip(log_std[rows], -2.0, 0.0)), base)
    ours = samplers.squashed_normal_from_log_std(
        MEAN[rows], log_std[rows], log_std_min=-2.0, log_std_max=0.0
    )
    action, pre_image, log_prob = ours.sample_with_pre_image(seed=KEYS[2])
    _assert_unsaturated(pre_image)
    with _peer_rank_promotion():
        their_action, their_log_prob = theirs.experimental_sample_and_log_prob(seed=KEYS[2])
        their_score = theirs.log_prob(np.asarray(action))
    np.testing.assert_allclose(action, their_action, **SAMPLE)
    np.testing.assert_allclose(log_prob, their_log_prob, **LOG_PROB)
    np.testing.assert_allclose(ours.log_prob(action), their_score, **LOG_PROB)


# rlax -------------------------------------------------------------------------------

SIGMA_MIN, SIGMA_MAX = -4.0, 0.0  # rlax.squashed_gaussian's defaults


@pytest.fixture(scope="module")
def rlax():
    return pytest.importorskip("rlax")


def _rlax_spec():
    specs = pytest.importorskip("dm_env.specs")
    low = np.array([-2.0, -1.0, 0.0], np.float32)
    high = np.array([2.0, 1.0, 3.0], np.float32)
    return specs.BoundedArray((A,), np.float32, minimum=low, maximum=high)


def _rlax_as_samplers(mu, sigma, spec, sigma_max=SIGMA_MAX):
    """The guide's mapping: rlax squashes its mean and std parameters before sampling."""
    mean = jnp.tanh(mu)
    std = jnp.exp(SIGMA_MIN + 0.5 * (sigma_max - SIGMA_MIN) * (jnp.tanh(sigma) + 1.0))
    bijector = samplers.BoundedTanh(jnp.asarray(spec.minimum), jnp.asarray(spec.maximum))
    return samplers.SquashedNormal(mean, std, bijector)


# rlax announces that squashed_gaussian will be deprecated in favour of distrax.
@pytest.mark.filterwarnings("ignore:Rlax squashed_gaussian will be deprecated")
@pytest.mark.parametrize("key", SEEDS)
def test_rlax_squashed_gaussian_maps_onto_bounded_tanh(rlax, key):
    spec = _rlax_spec()
    theirs = rlax.squashed_gaussian(SIGMA_MIN, SIGMA_MAX)
    ours = _rlax_as_samplers(MEAN, RAW_STD, spec)
    action, pre_image, log_prob = ours.sample_with_pre_image(seed=key)
    _assert_unsaturated(pre_image)
    their_action = theirs.sample(key, MEAN, RAW_STD, spec)
    # rlax composes tanh with two affine maps, BoundedTanh with one: a few ulps apart.
    np.testing.assert_allclose(action, their_action, rtol=1e-5, atol=1e-6)
    their_log_prob = theirs.logprob(their_action, MEAN, RAW_STD, spec)
    np.testing.assert_allclose(log_prob, their_log_prob, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(ours.log_prob(their_action), their_log_prob, rtol=1e-4, atol=1e-4)


@pytest.mark.filterwarnings("ignore:Rlax squashed_gaussian will be deprecated")
def test_rlax_entropy_is_the_gaussian_entropy_without_the_squashing(rlax):
    theirs = rlax.squashed_gaussian(SIGMA_MIN, SIGMA_MAX).entropy(MEAN, RAW_STD)
    ours = _rlax_as_samplers(MEAN, RAW_STD, _rlax_spec())
    np.testing.assert_allclose(theirs, ours.distribution.entropy(), **LOG_PROB)
    squashed = _squashed_entropy_float64(ours.loc, ours.scale)
    # Of the squashing to [-1, 1]; the BoundedTanh's affine map adds sum(log half_range).
    assert np.all(theirs - squashed > 0.1)


@pytest.mark.filterwarnings("ignore:Rlax squashed_gaussian will be deprecated")
def test_rlax_log_prob_of_a_saturated_sample_is_nan(rlax):
    spec = _rlax_spec()
    # tanh(mu) keeps rlax's mean inside (-1, 1) and its default std is at most
    # exp(0) = 1, so its pre-images hardly ever saturate; a wider std, exp(3), does.
    sigma_max = 3.0
    theirs = rlax.squashed_gaussian(SIGMA_MIN, sigma_max)
    mu = np.full((64, A), 1.0, np.float32)
    sigma = np.full((64, A), 10.0, np.float32)
    their_action = theirs.sample(KEYS[0], mu, sigma, spec)
    bound = np.isclose(their_action, spec.minimum) | np.isclose(their_action, spec.maximum)
    assert np.any(bound)
    assert np.any(np.isnan(theirs.logprob(their_action, mu, sigma, spec)))
    ours = _rlax_as_samplers(mu, sigma, spec, sigma_max)
    action, _, log_prob = ours.sample_with_pre_image(seed=KEYS[0])
    np.testing.assert_allclose(action, their_action, rtol=1e-5, atol=1e-6)
    assert np.all(np.isfinite(log_prob))
    assert np.all(np.isfinite(ours.log_prob(action)))
