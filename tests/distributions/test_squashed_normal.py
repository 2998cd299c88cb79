"""Building a ``SquashedNormal``, its pre-image path and its entropy.

The constructors (``normal_tanh``, ``squashed_normal``, ``squashed_normal_from_std`` and
``_from_log_std``, ``SquashedNormal``), the std maps and their floors, refused
arguments, dtypes and the NaN policy of invalid parameters; then what a head calls: the
pre-image path (``sample_with_pre_image``, ``sample_pre_image``,
``log_prob_from_pre_image``, ``deterministic_action``) and the entropy (``entropy``,
``entropy_estimate``, ``entropy_quadrature``), at the end over the whole parameter range.
Where a squashed-Normal test goes: ``tests/README.md``.
"""

import functools

import distrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from tensorflow_probability.substrates import jax as tfp

import samplers
from tests import reference
from tests._tiers import SLOW, each_value_once, slow
from tests.helpers import (
    LIMIT,
    SQUASHING_KINDS,
    normal_inputs,
    softplus_inverse,
    squashed_normal_parameters,
    squashing,
)

tfd, tfb = tfp.distributions, tfp.bijectors
A = 3
_inputs = functools.partial(normal_inputs, width=2 * A)


def test_normal_tanh_is_a_distrax_transformed_with_event_rank_one(batch_shape):
    dist = samplers.normal_tanh(_inputs(batch_shape))
    assert isinstance(dist, distrax.Transformed)
    assert isinstance(dist.distribution, distrax.Independent)
    assert dist.batch_shape == batch_shape and dist.event_shape == (A,)
    x = _inputs(batch_shape)
    assert dist.bijector.forward(x[..., :A]) == pytest.approx(jnp.tanh(x[..., :A]))


@pytest.mark.parametrize("min_std, std_scale", [(1e-3, 1.0), (0.0, 1.0), (0.1, 2.5)])
def test_std_is_softplus_plus_min_std_times_scale(min_std, std_scale):
    mean_and_std = _inputs((4,), scale=3.0)
    dist = samplers.normal_tanh(mean_and_std, min_std=min_std, std_scale=std_scale)
    mean, std = reference.params_float64(mean_and_std, min_std=min_std, std_scale=std_scale)
    np.testing.assert_allclose(dist.loc, mean, rtol=1e-6)
    np.testing.assert_allclose(dist.scale, std, rtol=1e-6)


def test_log_prob_from_pre_image_matches_float64_closed_form(batch_shape, maybe_jit):
    mean_and_std = _inputs(batch_shape, scale=2.0)
    pre_image = 4.0 * jax.random.normal(jax.random.key(1), (*batch_shape, A))
    log_prob = maybe_jit(lambda p, x: samplers.normal_tanh(p).log_prob_from_pre_image(x))(
        mean_and_std, pre_image
    )
    mean, std = reference.params_float64(mean_and_std)
    expected = reference.tanh_normal_log_prob_float64(pre_image, mean, std)
    assert log_prob.shape == batch_shape
    np.testing.assert_allclose(log_prob, expected, rtol=1e-5, atol=1e-4)


def test_log_prob_matches_distrax_and_tfp_where_unsaturated(batch_shape):
    mean_and_std = _inputs(batch_shape)
    dist = samplers.normal_tanh(mean_and_std)
    pre_image = 2.0 * jax.random.normal(jax.random.key(2), (*batch_shape, A))
    ours = dist.log_prob_from_pre_image(pre_image)
    plain_distrax = distrax.Transformed(
        distrax.MultivariateNormalDiag(dist.loc, dist.scale), distrax.Block(distrax.Tanh(), 1)
    )
    independent_tfp = tfd.Independent(
        tfd.TransformedDistribution(tfd.Normal(dist.loc, dist.scale), tfb.Tanh()), 1
    )
    action = jnp.tanh(pre_image)
    np.testing.assert_allclose(ours, dist.log_prob(action), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(ours, plain_distrax.log_prob(action), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(ours, independent_tfp.log_prob(action), rtol=1e-4, atol=1e-4)


def test_log_det_matches_autodiff_of_the_forward_map():
    # Beyond |x| ~ 4 autodiff of float32 tanh loses digits to 1 - tanh^2 cancellation.
    pre_image = jnp.linspace(-4.0, 4.0, 33)
    dist = samplers.normal_tanh(jnp.zeros((33, 2)))
    autodiff = jnp.log(
        jnp.abs(jax.vmap(jax.grad(lambda x: dist.bijector.forward(x[None])[0]))(pre_image))
    )
    np.testing.assert_allclose(
        dist.bijector.forward_log_det_jacobian(pre_image[:, None]), autodiff, rtol=1e-4, atol=1e-5
    )


# log_prob_from_pre_image and its gradient, one program for the cases below.
_score_value_and_grad = jax.jit(
    jax.value_and_grad(lambda p, x: samplers.normal_tanh(p).log_prob_from_pre_image(x))
)


@pytest.mark.parametrize("z", [10.0, -10.0, 20.0, -20.0, 50.0, -50.0])
def test_saturated_pre_image_is_finite_where_the_atanh_path_is_nan(z):
    mean_and_std = jnp.array([z - 0.5, 0.3])
    dist = samplers.normal_tanh(mean_and_std)
    pre_image = jnp.array([z])
    action = jnp.tanh(pre_image)
    assert jnp.abs(action[0]) == 1.0  # float32 tanh has saturated
    plain = distrax.Transformed(
        distrax.MultivariateNormalDiag(dist.loc, dist.scale), distrax.Block(distrax.Tanh(), 1)
    )
    assert jnp.isnan(plain.log_prob(action))  # distrax inverts: atanh(1) = inf

    value, grad = _score_value_and_grad(mean_and_std, pre_image)
    mean, std = reference.params_float64(mean_and_std)
    expected = reference.tanh_normal_log_prob_float64(pre_image, mean, std)
    assert jnp.isfinite(value) and jnp.all(jnp.isfinite(grad))
    np.testing.assert_allclose(value, expected, rtol=1e-5)


def test_sample_with_pre_image_is_consistent_and_needs_no_inverse(batch_shape, maybe_jit):
    dist_params = _inputs(batch_shape, scale=4.0)

    def sample(p, key):
        return samplers.normal_tanh(p).sample_with_pre_image(seed=key)

    action, pre_image, log_prob = maybe_jit(sample)(dist_params, jax.random.key(3))
    dist = samplers.normal_tanh(dist_params)
    eps = jax.random.normal(jax.random.key(3), dist.loc.shape)
    np.testing.assert_allclose(pre_image, dist.loc + dist.scale * eps, rtol=1e-6)
    np.testing.assert_array_equal(action, jnp.tanh(pre_image))
    np.testing.assert_allclose(log_prob, dist.log_prob_from_pre_image(pre_image), rtol=1e-6)
    assert jnp.all(jnp.isfinite(log_prob))


def test_deterministic_action_is_the_bijector_of_the_mean(batch_shape):
    dist = samplers.normal_tanh(_inputs(batch_shape))
    np.testing.assert_array_equal(dist.deterministic_action(), jnp.tanh(dist.loc))


def test_entropy_estimate_is_the_reparameterised_one_sample_formula(batch_shape):
    dist = samplers.normal_tanh(_inputs(batch_shape))
    key = jax.random.key(4)
    eps = jax.random.normal(key, dist.loc.shape)
    mean, std = np.asarray(dist.loc, np.float64), np.asarray(dist.scale, np.float64)
    z = mean + std * eps
    expected = reference.tanh_normal_entropy_estimate_float64(z, std)
    np.testing.assert_allclose(dist.entropy_estimate(seed=key), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    *each_value_once(
        {
            "mean, std": {"0.7-1.3": (0.7, 1.3), "-2.0-0.3": (-2.0, 0.3), "0.0-4.0": (0.0, 4.0)},
            "num_samples": {"1": 1, "4": 4},
        }
    )
)
def test_sample_estimates_are_unbiased_for_the_squashed_entropy(mean, std, num_samples):
    exact = reference.squashed_normal_entropy_float64(mean, std)
    dist = samplers.normal_tanh(
        jnp.tile(jnp.array([mean, softplus_inverse(std - 1e-3)]), (20_000, 1))
    )
    estimates = np.asarray(
        dist.entropy_estimate(seed=jax.random.key(5), num_samples=num_samples), np.float64
    )
    standard_error = estimates.std() / np.sqrt(estimates.size)
    assert abs(estimates.mean() - exact) < 3 * standard_error


def test_more_samples_lower_the_variance():
    dist = samplers.normal_tanh(
        jnp.tile(jnp.array([0.7, softplus_inverse(1.3 - 1e-3)]), (4_000, 1))
    )
    spread = [
        float(jnp.std(dist.entropy_estimate(seed=jax.random.key(6), num_samples=k)))
        for k in (1, 16)
    ]
    assert spread[1] < spread[0] / 3  # 1/sqrt(16) = 1/4 in expectation


def test_quadrature_is_biased_for_wide_stds_as_documented():
    # Against the exact entropy (itself checked against mpmath), in float64.
    with jax.enable_x64(True):
        mean, std = np.meshgrid(np.linspace(-10, 10, 201), np.linspace(1e-3, 1.3, 100))
        dist = samplers.SquashedNormal(
            jnp.asarray(mean.reshape(-1, 1)), jnp.asarray(std.reshape(-1, 1)), samplers.Tanh()
        )
        assert np.max(np.abs(dist.entropy_quadrature(8) - dist.entropy())) < 4e-3
        wide = samplers.SquashedNormal(
            jnp.linspace(-10, 10, 201)[:, None], jnp.full((201, 1), 4.0), samplers.Tanh()
        )
        error_8, error_64 = (wide.entropy_quadrature(n) - wide.entropy() for n in (8, 64))
        assert np.max(np.abs(error_8)) < 0.21 and error_8[100] < -0.2  # mean 0
        assert np.max(np.abs(error_64)) < 1.3e-3


def test_quadrature_is_differentiable_and_deterministic():
    mean_and_std = _inputs((4,))
    grad = jax.jit(jax.grad(lambda p: samplers.normal_tanh(p).entropy_quadrature().sum()))(
        mean_and_std
    )
    assert jnp.all(jnp.isfinite(grad)) and jnp.all(grad != 0)
    dist = samplers.normal_tanh(mean_and_std)
    np.testing.assert_array_equal(dist.entropy_quadrature(), dist.entropy_quadrature())


def test_base_entropy_ignores_the_squashing_and_overstates_it():
    mean, std = 0.7, 1.3
    dist = samplers.normal_tanh(jnp.array([mean, softplus_inverse(std - 1e-3)]))
    base = float(dist.distribution.entropy())
    assert base == pytest.approx(reference.normal_entropy_float64(std), rel=1e-5)
    assert base > reference.squashed_normal_entropy_float64(mean, std)


# The one-sample path for Tanh and the several-sample one for bounds by default; the
# rest, distrax's Sigmoid included (a squashing of the same family), slow.
@pytest.mark.parametrize(
    "bijector, num_samples",
    [
        pytest.param(samplers.Tanh(), 1, id="tanh-1"),
        slow(samplers.Tanh(), 3, id="tanh-3"),
        slow(samplers.BoundedTanh(-2.0, 3.0), 1, id="bounded-tanh-1"),
        pytest.param(samplers.BoundedTanh(-2.0, 3.0), 3, id="bounded-tanh-3"),
        slow(distrax.Sigmoid(), 1, id="sigmoid-1"),
        slow(distrax.Sigmoid(), 3, id="sigmoid-3"),
    ],
)
def test_saved_derivatives_equal_autodiff_of_the_plain_formula(bijector, num_samples):
    mean_and_std = _inputs((5,))
    pre_image = 3.0 * jax.random.normal(jax.random.key(7), (5, A))
    key = jax.random.key(8)
    weights = jnp.arange(1.0, 6.0)

    def ours(params, x):
        dist = samplers.squashed_normal(params, bijector)
        entropy = dist.entropy_estimate(seed=key, num_samples=num_samples)
        return jnp.sum(weights * (dist.log_prob_from_pre_image(x) + entropy))

    def plain(params, x):
        dist = samplers.squashed_normal(params, bijector)
        log_det = dist.bijector.forward_log_det_jacobian
        shape = (num_samples, *dist.loc.shape)
        eps = (
            jax.random.normal(key, dist.loc.shape)[None]
            if num_samples == 1
            else (jax.random.normal(key, shape))
        )
        z = dist.loc[None] + dist.scale[None] * jax.lax.stop_gradient(eps)
        entropy = dist.distribution.entropy() + jnp.mean(jax.vmap(log_det)(z), axis=0)
        log_prob = dist.distribution.log_prob(x) - log_det(x)
        return jnp.sum(weights * (log_prob + entropy))

    for ours_grad, plain_grad in zip(
        jax.jit(jax.grad(ours, argnums=(0, 1)))(mean_and_std, pre_image),
        jax.jit(jax.grad(plain, argnums=(0, 1)))(mean_and_std, pre_image),
        strict=True,
    ):
        np.testing.assert_allclose(ours_grad, plain_grad, rtol=1e-4, atol=1e-5)


def test_gradients_reach_the_bounds():
    pre_image = jax.random.normal(jax.random.key(9), (4, 2))

    def log_prob(low, high):
        dist = samplers.squashed_normal(
            _inputs((4,), seed=1)[:, :4], samplers.BoundedTanh(low, high)
        )
        return jnp.sum(dist.log_prob_from_pre_image(pre_image))

    low, high = jnp.array([-2.0, 0.0]), jnp.array([2.0, 1.0])
    d_low, d_high = jax.grad(log_prob, argnums=(0, 1))(low, high)
    # log p has -log((high - low) / 2) per sample: 4 samples, 1 / half_range each.
    np.testing.assert_allclose(d_low, 4 / (high - low), rtol=1e-5)
    np.testing.assert_allclose(d_high, -4 / (high - low), rtol=1e-5)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (
            lambda d: d.entropy_estimate(seed=jax.random.key(0), num_samples=0),
            ValueError,
            r"num_samples must be a positive integer, got 0",
        ),
        (
            lambda d: d.entropy_estimate(seed=jax.random.key(0), num_samples=2.0),
            TypeError,
            r"num_samples must be a positive integer, got 2.0",
        ),
        (
            lambda d: d.entropy_quadrature(-1),
            ValueError,
            r"num_points must be a positive integer, got -1",
        ),
    ],
)
def test_bad_estimator_sizes_are_refused(call, error, message):
    with pytest.raises(error, match=message):
        call(samplers.normal_tanh(jnp.zeros(4)))


def test_entropy_gradient_reaches_mean_and_std():
    mean_and_std = _inputs((4,))
    grad = jax.jit(
        jax.grad(lambda p: samplers.normal_tanh(p).entropy_estimate(seed=jax.random.key(0)).sum())
    )(mean_and_std)
    assert jnp.all(grad != 0) and jnp.all(jnp.isfinite(grad))


# A squashing (bounds) and a bijector without one by default; distrax's Sigmoid, a
# squashing of the same family, slow.
@pytest.mark.parametrize(
    "bijector",
    [
        slow(distrax.Sigmoid(), id="sigmoid"),
        pytest.param(distrax.Lambda(lambda x: x), id="identity"),
        pytest.param(samplers.BoundedTanh(-2.0, 3.0), id="bounded-tanh"),
    ],
)
def test_other_bijectors_match_distrax_log_prob(bijector):
    mean_and_std = _inputs((4,))
    dist = samplers.squashed_normal(mean_and_std, bijector)
    action, _, log_prob = dist.sample_with_pre_image(seed=jax.random.key(6))
    reference_dist = distrax.Transformed(
        distrax.MultivariateNormalDiag(dist.loc, dist.scale), distrax.Block(bijector, 1)
    )
    np.testing.assert_allclose(log_prob, reference_dist.log_prob(action), rtol=1e-4, atol=1e-4)


def test_a_tfp_bijector_is_accepted():
    dist = samplers.squashed_normal(_inputs((4,)), tfb.Tanh())
    action, _, log_prob = dist.sample_with_pre_image(seed=jax.random.key(0))
    np.testing.assert_allclose(log_prob, dist.log_prob(action), rtol=1e-4, atol=1e-4)


def test_bounds_can_be_built_inside_a_jitted_function():
    def log_prob(mean_and_std, low):
        dist = samplers.squashed_normal(mean_and_std, samplers.BoundedTanh(low, low + 4.0))
        return dist.sample_with_pre_image(seed=jax.random.key(0))

    action, _, log_prob_value = jax.jit(log_prob)(_inputs((4,)), jnp.full(A, -2.0))
    assert jnp.all(jnp.abs(action) <= 2.0) and jnp.all(jnp.isfinite(log_prob_value))


def test_distribution_passes_through_jit():
    dist = jax.jit(samplers.normal_tanh)(_inputs((4,)))
    assert isinstance(dist, samplers.SquashedNormal) and dist.loc.shape == (4, A)


@pytest.mark.parametrize("shape", [(5,), (4, 7), ()], ids=["odd", "odd-batched", "scalar"])
def test_odd_or_missing_last_axis_is_refused(shape):
    with pytest.raises(ValueError, match=r"last axis of even length .* got shape"):
        samplers.normal_tanh(jnp.zeros(shape))


def test_integer_parameters_are_refused():
    with pytest.raises(TypeError, match=r"mean_and_std must have a floating dtype, got int32"):
        samplers.normal_tanh(jnp.zeros(4, jnp.int32))


@pytest.mark.parametrize(
    "call, name, received",
    [
        (lambda: samplers.normal_tanh("0.1 0.2"), "mean_and_std", "'0.1 0.2' of type str"),
        (
            lambda: samplers.squashed_normal(b"\x00", samplers.Tanh()),
            "mean_and_std",
            r"b'\\x00' of type bytes",
        ),
        (
            lambda: samplers.squashed_normal(np.array(["1", "2"]), samplers.Tanh()),
            "mean_and_std",
            r"array\(\['1', '2'\], dtype='<U1'\) of type ndarray",
        ),
        (
            lambda: samplers.squashed_normal_from_std("0", jnp.ones(2)),
            "mean",
            "'0' of type str",
        ),
        (
            lambda: samplers.squashed_normal_from_std(jnp.zeros(2), ["1", 1.0]),
            "std",
            r"\['1', 1.0\] of type list",
        ),
        (
            lambda: samplers.squashed_normal_from_log_std(jnp.zeros(2), "log_std"),
            "log_std",
            "'log_std' of type str",
        ),
    ],
    ids=["normal_tanh", "bytes", "str-array", "from_std-mean", "from_std-std", "from_log_std"],
)
def test_text_parameters_are_refused_at_call_time_naming_the_argument(call, name, received):
    message = (
        rf"^{name} must be an array of numbers, got {received}; pass a floating array, e\.g\. "
        r"jnp\.asarray\(\.\.\., jnp\.float32\)\.$"
    )
    with pytest.raises(TypeError, match=message):
        call()


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"min_std": -0.1}, ValueError, r"min_std must be >= 0.0, got -0.1"),
        ({"std_scale": 0.0}, ValueError, r"std_scale must be > 0.0, got 0.0"),
        ({"std_scale": float("nan")}, ValueError, r"std_scale must be finite, got nan"),
        ({"min_std": "0.1"}, TypeError, r"min_std must be a real number, got '0.1'"),
        ({"min_std": True}, TypeError, r"min_std must be a real number, got True"),
    ],
)
def test_bad_options_are_refused(kwargs, error, message):
    with pytest.raises(error, match=message):
        samplers.normal_tanh(jnp.zeros(4), **kwargs)


def test_traced_options_are_refused_with_a_fix():
    with pytest.raises(TypeError, match=r"min_std must be a concrete number.*Python float"):
        jax.jit(lambda s: samplers.normal_tanh(jnp.zeros(4), min_std=s))(0.1)


def test_a_block_bijector_is_refused():
    with pytest.raises(ValueError, match=r"bijector must be elementwise .* got Block"):
        samplers.squashed_normal(jnp.zeros(4), distrax.Block(distrax.Tanh(), 1))


def test_bounds_of_the_wrong_length_are_refused():
    bijector = samplers.BoundedTanh(jnp.zeros(2), jnp.ones(2))
    with pytest.raises(ValueError, match=r"maps actions of shape \(5, 3\) to .*\(3,\)"):
        samplers.squashed_normal(jnp.zeros((5, 6)), bijector)


def test_a_distrax_chain_replays_from_the_pre_image():
    # tanh, then y -> 0.5 + 2 y: distrax's own log_prob where it is finite, float64 where not.
    chain = distrax.Chain([distrax.ScalarAffine(shift=0.5, scale=2.0), distrax.Tanh()])
    mean_and_std = jnp.concatenate([jnp.array([0.3, 12.0, -30.0]), jnp.zeros(3)])
    dist = samplers.squashed_normal(mean_and_std, chain)
    action, pre_image, log_prob = dist.sample_with_pre_image(seed=jax.random.key(10))
    reference_log_prob = distrax.Transformed(dist.distribution, distrax.Block(chain, 1))
    unsaturated = jnp.array([0.4, -0.2, 1.1])
    np.testing.assert_allclose(
        dist.log_prob_from_pre_image(unsaturated),
        reference_log_prob.log_prob(chain.forward(unsaturated)),
        rtol=1e-5,
    )
    assert jnp.isnan(reference_log_prob.log_prob(action))  # saturated dimensions
    mean, std = reference.params_float64(mean_and_std)
    expected = reference.tanh_normal_log_prob_float64(pre_image, mean, std) - 3 * np.log(2.0)
    np.testing.assert_allclose(log_prob, expected, rtol=1e-5)
    grad = jax.grad(lambda p: samplers.squashed_normal(p, chain).log_prob_from_pre_image(pre_image))
    assert jnp.all(jnp.isfinite(grad(mean_and_std)))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["float16", "bfloat16"])
def test_low_precision_parameters_compute_in_float32(dtype):
    params = _inputs((4,)).astype(dtype)
    dist = samplers.normal_tanh(params)
    action, pre_image, log_prob = dist.sample_with_pre_image(seed=jax.random.key(11))
    assert dist.loc.dtype == action.dtype == log_prob.dtype == jnp.float32
    upcast = samplers.normal_tanh(params.astype(jnp.float32))
    np.testing.assert_array_equal(log_prob, upcast.log_prob_from_pre_image(pre_image))


def test_float64_matches_the_float64_closed_form_to_1e_12():
    with jax.enable_x64(True):
        params = 3.0 * jax.random.normal(jax.random.key(12), (6, 2 * A), jnp.float64)
        pre_image = jnp.array([[10.0, -20.0, 50.0], [-10.0, 20.0, -50.0]] * 3, jnp.float64)
        dist = samplers.normal_tanh(params)
        log_prob = dist.log_prob_from_pre_image(pre_image)
        entropy = dist.entropy_estimate(seed=jax.random.key(13))
        assert log_prob.dtype == entropy.dtype == jnp.float64
        mean, std = reference.params_float64(params)
        expected = reference.tanh_normal_log_prob_float64(pre_image, mean, std)
        np.testing.assert_allclose(log_prob, expected, rtol=1e-12)


def test_non_finite_parameters_propagate_to_that_row_only():
    params = _inputs((4,))
    poisoned = params.at[2, 1].set(jnp.nan).at[3, A].set(jnp.inf)
    pre_image = jax.random.normal(jax.random.key(14), (4, A))
    clean = samplers.normal_tanh(params).log_prob_from_pre_image(pre_image)
    log_prob = samplers.normal_tanh(poisoned).log_prob_from_pre_image(pre_image)
    np.testing.assert_array_equal(log_prob[:2], clean[:2])
    assert not jnp.any(jnp.isfinite(log_prob[2:]))


def test_an_empty_batch_gives_empty_outputs():
    dist = samplers.normal_tanh(jnp.zeros((0, 2 * A)))
    action, pre_image, log_prob = dist.sample_with_pre_image(seed=jax.random.key(0))
    assert action.shape == pre_image.shape == (0, A) and log_prob.shape == (0,)
    assert dist.entropy_estimate(seed=jax.random.key(1)).shape == (0,)


CONSTRUCTOR_BIJECTORS = {
    "default": None,
    "distrax.Tanh": distrax.Tanh(),
    "BoundedTanh": samplers.BoundedTanh(jnp.array([-2.0, 0.0, -0.1]), jnp.array([2.0, 1.0, 0.3])),
    "Sigmoid": samplers.Sigmoid(),
}


def _with_bijector(constructor, mean, spread, bijector, **kwargs):
    if bijector is None:
        return constructor(mean, spread, **kwargs)
    return constructor(mean, spread, bijector, **kwargs)


@pytest.mark.parametrize(
    "bijector", CONSTRUCTOR_BIJECTORS.values(), ids=CONSTRUCTOR_BIJECTORS.keys()
)
def test_from_std_and_from_log_std_build_the_same_distribution(bijector, batch_shape):
    keys = jax.random.split(jax.random.key(20), 2)
    mean = 2.0 * jax.random.normal(keys[0], (*batch_shape, A))
    log_std = jax.random.normal(keys[1], (*batch_shape, A))
    std64 = np.exp(np.asarray(log_std, np.float64))
    from_std = _with_bijector(samplers.squashed_normal_from_std, mean, jnp.exp(log_std), bijector)
    from_log = _with_bijector(samplers.squashed_normal_from_log_std, mean, log_std, bijector)
    for dist in (from_std, from_log):
        assert isinstance(dist, samplers.SquashedNormal)
        assert dist.batch_shape == batch_shape and dist.event_shape == (A,)
        np.testing.assert_array_equal(dist.loc, mean)
        np.testing.assert_allclose(dist.scale, std64, rtol=1e-6)
        expected = bijector if bijector is not None else samplers.Tanh()
        assert type(dist.bijector.bijector) is type(expected)


def test_from_std_default_squashing_is_tanh_and_scores_as_float64():
    mean, std = jnp.array([[0.3, -1.0, 4.0]]), jnp.array([[0.5, 2.0, 0.1]])
    dist = samplers.squashed_normal_from_std(mean, std)
    pre_image = jnp.array([[0.1, -9.0, 20.0]])
    expected = reference.tanh_normal_log_prob_float64(pre_image, mean, std)
    np.testing.assert_allclose(dist.log_prob_from_pre_image(pre_image), expected, rtol=1e-6)
    np.testing.assert_array_equal(dist.bijector.forward(pre_image), jnp.tanh(pre_image))


def test_min_std_is_added_to_the_std():
    dist = samplers.squashed_normal_from_std(jnp.zeros(3), jnp.array([0.5, 1.0, 2.0]), min_std=0.1)
    np.testing.assert_allclose(dist.scale, [0.6, 1.1, 2.1], rtol=1e-6)


def test_a_negative_or_nan_std_gives_nan_and_zero_is_floored(maybe_jit):
    std = jnp.array([[-1.0, 0.0, jnp.nan], [0.5, 1.0, 2.0]])
    dist = maybe_jit(samplers.squashed_normal_from_std)(jnp.zeros((2, 3)), std)
    assert np.isnan(dist.scale[0, 0]) and np.isnan(dist.scale[0, 2])
    assert dist.scale[0, 1] == np.finfo(np.float32).tiny
    np.testing.assert_array_equal(dist.scale[1], std[1])
    action, _, log_prob = dist.sample_with_pre_image(seed=jax.random.key(21))
    assert np.isnan(log_prob[0]) and np.isfinite(log_prob[1])
    assert np.isnan(dist.log_prob(jnp.zeros((2, 3)))[0])
    assert np.all(np.isnan(action[0, [0, 2]]))


@pytest.mark.parametrize(
    "log_std_min, log_std_max, expected_log_std",
    [
        (-20.0, 2.0, [-20.0, -20.0, 0.0, 2.0, 2.0]),
        (-5.0, 2.0, [-5.0, -5.0, 0.0, 2.0, 2.0]),
        (None, 2.0, [-30.0, -20.0, 0.0, 2.0, 2.0]),
        (-5.0, None, [-5.0, -5.0, 0.0, 2.0, 5.0]),
        (None, None, [-30.0, -20.0, 0.0, 2.0, 5.0]),
        (1.0, 1.0, [1.0, 1.0, 1.0, 1.0, 1.0]),
    ],
)
def test_log_std_is_clipped_to_the_given_bounds(log_std_min, log_std_max, expected_log_std):
    log_std = jnp.array([-30.0, -20.0, 0.0, 2.0, 5.0])

    def scale(log_std):
        return samplers.squashed_normal_from_log_std(
            jnp.zeros(5), log_std, log_std_min=log_std_min, log_std_max=log_std_max
        ).scale

    np.testing.assert_allclose(scale(log_std), np.exp(expected_log_std), rtol=1e-6)
    # Clipped entries get no gradient, as in SAC implementations.
    clipped = np.asarray(expected_log_std) != np.asarray(log_std)
    gradient = jax.grad(lambda s: scale(s).sum())(log_std)
    np.testing.assert_array_equal(gradient == 0, clipped)


def test_an_underflowing_log_std_is_floored_and_nan_stays_nan():
    tiny = np.finfo(np.float32).tiny  # exp(-87.34)
    log_std = jnp.array([-200.0, -87.4, -87.3, jnp.nan, 0.0])
    dist = samplers.squashed_normal_from_log_std(jnp.zeros(5), log_std)
    np.testing.assert_array_equal(dist.scale[:2], [tiny, tiny])
    assert dist.scale[2] > tiny
    assert np.isnan(dist.scale[3]) and dist.scale[4] == 1.0


@pytest.mark.parametrize(
    "min_std, std_scale",
    [(0.0, 1.0), (1e-3, 1e-37), (1e-3, 1.0)],
    ids=["no-min-std", "subnormal-least-std", "normal-least-std"],
)
def test_the_softplus_std_is_floored_at_the_smallest_normal_float(min_std, std_scale):
    # The floor binds where softplus underflows and min_std * std_scale is not a normal
    # float (the std is left unfloored only where that product is). Against float64: the
    # std, and its derivative sigmoid(raw_std) * std_scale where unfloored, 0 where floored.
    tiny = np.finfo(np.float32).tiny
    raw_std = jnp.array([-200.0, -100.0, 0.0, 30.0])
    mean_and_std = jnp.concatenate([jnp.zeros(4), raw_std])

    def scale(x):
        return samplers.squashed_normal(
            x, samplers.Tanh(), min_std=min_std, std_scale=std_scale
        ).scale

    raw = np.asarray(raw_std, np.float64)
    unfloored = reference.softplus_std_float64(raw, min_std, std_scale)
    np.testing.assert_allclose(jax.jit(scale)(mean_and_std), np.maximum(unfloored, tiny), rtol=1e-6)
    assert np.all(jax.jit(scale)(mean_and_std) >= tiny)
    slope = np.where(unfloored >= tiny, std_scale / (1.0 + np.exp(-raw)), 0.0)
    slope[slope < tiny] = 0.0  # in float32, flushed to zero as XLA does
    gradient = jax.grad(lambda x: scale(x).sum())(mean_and_std)
    np.testing.assert_allclose(gradient, np.concatenate([np.zeros(4), slope]), rtol=1e-6, atol=0)


CONSTRUCTORS = {
    "from_std": samplers.squashed_normal_from_std,
    "from_log_std": samplers.squashed_normal_from_log_std,
}


@pytest.mark.parametrize("constructor", CONSTRUCTORS.values(), ids=CONSTRUCTORS.keys())
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["float16", "bfloat16"])
def test_constructors_compute_low_precision_in_float32(constructor, dtype):
    dist = constructor(jnp.zeros(3, dtype), jnp.ones(3, dtype))
    assert dist.loc.dtype == dist.scale.dtype == jnp.float32
    action, _, log_prob = dist.sample_with_pre_image(seed=jax.random.key(22))
    assert action.dtype == log_prob.dtype == jnp.float32


@pytest.mark.parametrize("constructor", CONSTRUCTORS.values(), ids=CONSTRUCTORS.keys())
def test_constructors_keep_float64(constructor):
    with jax.enable_x64(True):
        dist = constructor(jnp.zeros(3, jnp.float64), jnp.ones(3, jnp.float64))
        assert dist.loc.dtype == dist.scale.dtype == jnp.float64


@pytest.mark.parametrize("name", ["std", "log_std"])
def test_constructors_refuse_bad_arrays(name):
    constructor = CONSTRUCTORS[f"from_{name}"]
    with pytest.raises(TypeError, match=r"mean must have a floating dtype, got int32"):
        constructor(jnp.zeros(3, jnp.int32), jnp.ones(3))
    with pytest.raises(TypeError, match=rf"{name} must have a floating dtype, got int32"):
        constructor(jnp.zeros(3), jnp.ones(3, jnp.int32))
    with pytest.raises(
        ValueError, match=rf"mean and {name} must have the same shape .* got \(4, 3\) and \(3,\)"
    ):
        constructor(jnp.zeros((4, 3)), jnp.ones(3))
    with pytest.raises(ValueError, match=rf"mean and {name} need an action axis, .* got \(\);"):
        constructor(jnp.float32(0.0), jnp.float32(1.0))


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (
            {"log_std_min": 2.0, "log_std_max": -20.0},
            ValueError,
            r"log_std_min must be <= log_std_max, got 2.0 > -20.0",
        ),
        ({"log_std_min": float("nan")}, ValueError, r"log_std_min must be finite, got nan"),
        ({"log_std_max": "2"}, TypeError, r"log_std_max must be a real number, got '2'"),
    ],
)
def test_from_log_std_refuses_bad_bounds(kwargs, error, message):
    with pytest.raises(error, match=message):
        samplers.squashed_normal_from_log_std(jnp.zeros(3), jnp.zeros(3), **kwargs)


def test_from_std_refuses_a_negative_min_std():
    with pytest.raises(ValueError, match=r"min_std must be >= 0.0, got -0.1"):
        samplers.squashed_normal_from_std(jnp.zeros(3), jnp.ones(3), min_std=-0.1)


# entropy(): exact, deterministic and differentiable.

# The float32 bumps rule's max|e| and max|e'| (samplers/distributions/_squashed.py).
BUMPS_BOUND = 2.5e-6

ENTROPY_CASES = [
    (0.7, 1.3),
    (-2.0, 0.3),
    (5.0, 0.05),
    (0.0, 1.0),
    (0.0, 4.0),
    (3.0, 0.5),
    (0.3, 30),
]


# A narrow and the widest std by default; the others slow.
@pytest.mark.parametrize(
    "mean, std",
    [
        pytest.param(*case, marks=[] if case in ((5.0, 0.05), (0.3, 30)) else [SLOW])
        for case in ENTROPY_CASES
    ],
    ids=[f"{m}-{s}" for m, s in ENTROPY_CASES],
)
def test_entropy_is_the_float64_entropy_where_quadrature_is_biased(mean, std):
    # The float64 reference integrates -log p over a dense grid: about 1e-9 accurate.
    exact = reference.squashed_normal_entropy_float64(mean, std)
    with jax.enable_x64(True):
        dist = samplers.SquashedNormal(jnp.array([mean]), jnp.array([std]), samplers.Tanh())
        assert float(dist.entropy()) == pytest.approx(exact, abs=1e-8)
    dist = samplers.SquashedNormal(jnp.array([mean]), jnp.array([std]), samplers.Tanh())
    assert float(dist.entropy()) == pytest.approx(exact, abs=1e-5 * (1 + abs(exact)))


@pytest.mark.parametrize(
    "shape",
    [slow((5,)), slow((8192, 1)), slow((3, 1024, 8)), slow((4100, 8))],
    ids=["(A,)", "(B,A)", "(T,B,A)", "(B,A) B=4100"],
)
def test_entropy_of_a_large_batch_is_each_row_alone(shape):
    # Each row's entropy and gradient in a large batch are those of the row alone
    # (vmap traces one row), to within 4 float32 steps of 1 + |value|, and match the
    # float64 oracle.
    keys = jax.random.split(jax.random.key(11))
    loc = 3.0 * jax.random.normal(keys[0], shape)
    scale = jnp.exp(2.0 * jax.random.normal(keys[1], shape))
    # A narrow std and the widest, in the first two rows.
    cases = ((5.0, 0.05), (0.3, 30.0)) if len(shape) > 1 else ()
    for row, (mean, std) in enumerate(cases):
        index = (row,) * (len(shape) - 1)
        loc, scale = loc.at[index].set(mean), scale.at[index].set(std)

    def value_and_grad(loc, scale):
        def entropy(loc, scale):
            return samplers.SquashedNormal(loc, scale, samplers.Tanh()).entropy()

        grads = jax.grad(lambda *a: jnp.sum(entropy(*a)), argnums=(0, 1))(loc, scale)
        return entropy(loc, scale), *grads

    got = jax.jit(value_and_grad)(loc, scale)
    rows = (-1, shape[-1])
    alone = jax.jit(jax.vmap(value_and_grad))(loc.reshape(rows), scale.reshape(rows))
    eps = np.finfo(np.float32).eps
    for name, a, b in zip(("entropy", "d loc", "d scale"), got, alone, strict=True):
        b = np.reshape(b, a.shape)
        np.testing.assert_allclose(a, b, rtol=4 * eps, atol=4 * eps, err_msg=name)
    for row, (mean, std) in enumerate(cases):
        exact = shape[-1] * reference.squashed_normal_entropy_float64(mean, std)
        value = float(got[0][(row,) * (len(shape) - 1)])
        assert value == pytest.approx(exact, abs=1e-5 * (1 + abs(exact)))


@pytest.mark.parametrize(
    "dtype, platform, bound, h",
    [
        ("float32", "cpu", 2e-7, 3e-5),
        ("float32", "accelerator", BUMPS_BOUND, 3e-5),
        pytest.param("float64", "cpu", 1e-9, 1e-5, marks=SLOW),
    ],
)
def test_entropy_mixture_is_within_its_bound_of_log_cosh_at_every_point(dtype, platform, bound, h):
    # The exact entropy takes E[log(2 cosh T)] as sum_j w_j E|N(m, s**2 + sigma_j**2)|
    # plus, off the CPU in float32, sum_i c_i E[exp(-T**2 / (2 tau_i**2))]
    # (samplers/distributions/_squashed.py): its error at every (mean, std) is within
    # 2 max|e| (value) and 2 max|e'| (derivatives) over x, with
    # e(x) = sum_j w_j E|x + sigma_j Z| + sum_i c_i exp(-x**2 / (2 tau_i**2)) - log(2 cosh x).
    # In float64 (scipy) on a grid of step h up to x = 20 (beyond, every term is under
    # 1e-17), with what lies between the grid's points bounded by the next derivative:
    # sup|e| <= max|e| + h/2 sup|e'|, sup|e'| <= max|e'| + h/2 sup|e''|,
    # sup|e''| <= max|e''| + h/2 sup|e'''|, and |e'''| <= 2 sum_j w_j 0.242 / sigma_j**2
    # + sum_i |c_i| 1.382 / tau_i**3 + 4 / (3 sqrt 3).
    from scipy import special as scipy_special

    from samplers.distributions import _squashed

    normals, bumps = _squashed.mixture_rule(dtype, platform)
    sigma, w = (np.array(column) for column in zip(*normals, strict=True))
    assert np.all(w > 0) and abs(w.sum() - 1) < 1e-15
    x = np.arange(0.0, 20.0 + h, h)
    decay = np.exp(-2 * x)
    # E|x + sigma Z| - x = sigma exp(-u**2 / 2) (sqrt(2 / pi) - u erfcx(u / sqrt 2)), u = x / sigma.
    e, slope, curvature = -np.log1p(decay), 2 * decay / (1 + decay), -1 / np.cosh(x) ** 2
    for s, weight in zip(sigma, w, strict=True):
        u = x / s
        gaussian = np.exp(-(u**2) / 2)
        e += weight * s * gaussian * (np.sqrt(2 / np.pi) - u * scipy_special.erfcx(u / np.sqrt(2)))
        slope -= weight * scipy_special.erfc(u / np.sqrt(2))
        curvature += weight * 2 * gaussian / (s * np.sqrt(2 * np.pi))
    third = 2 * np.sum(w * 0.242 / sigma**2) + 4 / (3 * np.sqrt(3))
    # A bump's third derivative in y = x / tau is (3 y - y**3) exp(-y**2 / 2), at most
    # 1.382 in size (at y = 0.742).
    y = np.linspace(0, 10, 100001)
    assert np.max(np.abs(y**3 - 3 * y) * np.exp(-(y**2) / 2)) < 1.382
    for tau, c in bumps:
        y = x / tau
        bump = c * np.exp(-(y**2) / 2)
        e += bump
        slope -= y / tau * bump
        curvature += (y**2 - 1) / tau**2 * bump
        third += abs(c) * 1.382 / tau**3
    sup_curvature = np.abs(curvature).max() + h / 2 * third
    sup_slope = np.abs(slope).max() + h / 2 * sup_curvature
    sup_e = np.abs(e).max() + h / 2 * sup_slope
    assert sup_e <= bound and sup_slope <= bound, (sup_e, sup_slope)


def test_an_accelerator_program_takes_the_bumps_rule_and_a_cpu_program_the_normal_terms():
    # The float32 entropy is compiled with six Normal terms (an exp and an erf each) for
    # the CPU and with one Normal term and Gaussian bumps (an exp each) elsewhere; the
    # float64 entropy with its mixture everywhere (whose erf has exps of its own).
    from jax import export

    from samplers.distributions import _squashed

    def exponentials(dtype, platform):
        x = np.ones((3, 2), dtype)
        entropy = jax.jit(lambda m, s: samplers.SquashedNormal(m, s, samplers.Tanh()).entropy())
        return (
            export.export(entropy, platforms=[platform])(x, x)
            .mlir_module()
            .count("stablehlo.exponential ")
        )

    bumps = _squashed.mixture_rule(np.float32, "accelerator")[1]
    assert len(bumps) > 0
    assert exponentials(np.float32, "cpu") == len(_squashed.mixture_rule(np.float32, "cpu")[0])
    assert exponentials(np.float32, "tpu") == 1 + len(bumps)
    assert exponentials(np.float32, "cuda") == 1 + len(bumps)
    with jax.enable_x64(True):
        assert exponentials(np.float64, "tpu") == exponentials(np.float64, "cpu")


@pytest.mark.parametrize("sign", [1.0, slow(-1.0, id="negative")])
def test_the_bumps_rule_in_float32_is_the_float64_entropy_within_its_bound(sign):
    # The accelerators' float32 rule, compiled here through the rule itself, against the
    # float64 rule (within 1e-9 of log(2 cosh x)) on means and stds from 2**-19 to 1e20:
    # the value of E[log sech(T)**2] within 2 BUMPS_BOUND, its derivatives with respect
    # to the mean and the std within 2 BUMPS_BOUND and 2 sqrt(2 / pi) BUMPS_BOUND, each
    # plus 8 float32 roundings of the terms' size.
    from samplers.distributions import _squashed

    values = np.array([0.0, 2.0**-19, 1e-3, 0.1, 0.5, 1.0, 2.5, 7.0, 30.0, 1e3, 1e7, 1e20])
    m, s = (a.ravel() for a in np.meshgrid(sign * values, values[1:]))
    rule = _squashed.mixture_rule(np.float32, "accelerator")
    by_rule = jax.jit(functools.partial(_squashed.expected_log_sech_squared_by_rule, rule=rule))
    got = [np.asarray(g, np.float64) for g in by_rule(m.astype(np.float32), s.astype(np.float32))]
    with jax.enable_x64(True):
        rule64 = _squashed.mixture_rule(np.float64)
        want = [np.asarray(g) for g in _squashed.expected_log_sech_squared_by_rule(m, s, rule64)]
    rounding = 8 * np.finfo(np.float32).eps
    bounds = [
        2 * BUMPS_BOUND + rounding * (1 + np.abs(m) + s),
        np.full(m.shape, 2 * BUMPS_BOUND + rounding),
        np.full(m.shape, 2 * np.sqrt(2 / np.pi) * BUMPS_BOUND + rounding),
    ]
    for name, g, w, bound in zip(("value", "d/dm", "d/ds"), got, want, bounds, strict=True):
        assert np.all(np.isfinite(g)), name
        worst = np.argmax(np.abs(g - w) / bound)
        assert np.abs(g - w)[worst] <= bound[worst], (name, m[worst], s[worst], g[worst], w[worst])


@pytest.mark.parametrize("k", [pytest.param(1.0, id="tanh"), slow(2.0, id="sigmoid")])
def test_gradients_at_the_switch_between_quadrature_rules_are_whole(k):
    # mean() and variance() switch rules at scale / k = 1/2; a tie in minimum/maximum
    # there would halve the gradient. At the switch and just past it, against float64
    # second-order one-sided differences on the narrow side; entropy() (one rule) too.
    bijector = samplers.Sigmoid() if k == 2.0 else samplers.Tanh()

    @jax.jit
    def methods(loc, scale):
        dist = samplers.SquashedNormal(loc, scale, bijector)
        return jnp.stack([dist.mean()[0], dist.variance()[0], dist.entropy()])

    # One program for both Jacobians, compiled once.
    jacobians = jax.jit(jax.jacobian(methods, argnums=(0, 1)))

    with jax.enable_x64(True):
        loc, switch = jnp.array([0.4 * k]), jnp.array([0.5 * k])
        h = 1e-4
        for argnum in (0, 1):
            step = jnp.array([h]) * (1.0 if argnum == 0 else -1.0)
            args = [loc, switch]

            def at(n, args=args, argnum=argnum, step=step):
                shifted = list(args)
                shifted[argnum] = shifted[argnum] + n * step
                return methods(*shifted)

            one_sided = (3 * at(0) - 4 * at(1) + at(2)) / (-2 * step[0])
            for scale in (switch, switch * (1 + 1e-12)):
                grad = jacobians(loc, scale)[argnum][:, 0]
                np.testing.assert_allclose(grad, one_sided, rtol=1e-6, atol=1e-9)


@pytest.mark.slow
def test_entropy_has_forward_mode_and_second_derivatives_in_each_rule():
    # The entropy's derivatives are computed beside its value (a custom JVP): forward
    # and reverse mode agree, and its second derivatives, for stds narrow and wide,
    # match float64 central differences of its gradient.
    def entropy(loc, scale):
        return samplers.SquashedNormal(loc, scale, samplers.Tanh()).entropy()

    gradient = jax.grad(entropy, argnums=(0, 1))
    # (i, j): d/d(argument j) of the gradient with respect to argument i, a diagonal
    # (the dimensions are independent), as one JVP of the gradient.
    pairs = ((0, 0), (1, 1), (0, 1))

    @jax.jit
    def derivatives(loc, scale):
        forward = jax.jacfwd(entropy, argnums=(0, 1))(loc, scale)
        reverse = jax.jacrev(entropy, argnums=(0, 1))(loc, scale)
        second = []
        for i, j in pairs:
            tangent = [jnp.zeros_like(loc), jnp.zeros_like(scale)]
            tangent[j] = jnp.ones_like(tangent[j])
            second.append(jax.jvp(lambda *a, i=i: gradient(*a)[i], (loc, scale), tuple(tangent))[1])
        return forward, reverse, second

    with jax.enable_x64(True):
        args = (jnp.array([0.3, -2.0, 5.0]), jnp.array([0.2, 0.45, 3.0]))
        forward, reverse, second = derivatives(*args)
        for f, r in zip(forward, reverse, strict=True):
            np.testing.assert_allclose(f, r, rtol=1e-12, atol=1e-15)
        h, shifted = 1e-5, jax.jit(gradient)
        for got, (i, j) in zip(second, pairs, strict=True):
            up, down = list(args), list(args)
            up[j], down[j] = args[j] + h, args[j] - h
            central = (shifted(*up)[i] - shifted(*down)[i]) / (2 * h)
            np.testing.assert_allclose(got, central, rtol=1e-6, atol=1e-8)


@pytest.mark.slow
def test_entropy_in_a_ppo_loss_written_against_distrax():
    # A PPO loss calls dist.entropy() as it would on any distrax distribution.
    keys = jax.random.split(jax.random.key(11), 3)
    params = _inputs((64,), seed=3)
    advantages = jax.random.normal(keys[0], (64,))
    old = samplers.normal_tanh(params)
    actions = old.sample(seed=keys[1])
    old_log_prob = old.log_prob(actions)

    def ppo_loss(params, entropy_coefficient):
        dist = samplers.normal_tanh(params)
        ratio = jnp.exp(dist.log_prob(actions) - old_log_prob)
        clipped = jnp.clip(ratio, 0.8, 1.2)
        policy = -jnp.mean(jnp.minimum(ratio * advantages, clipped * advantages))
        return policy - entropy_coefficient * jnp.mean(dist.entropy())

    grad = jax.jit(jax.grad(ppo_loss))  # as a training step compiles it
    grad_without = grad(params, 0.0)
    grad_with = grad(params, 0.01)
    assert np.all(np.isfinite(grad_with))
    # The entropy bonus's gradient is the jitted gradient of the mean entropy.
    entropy_grad = jax.jit(jax.grad(lambda p: jnp.mean(samplers.normal_tanh(p).entropy())))(params)
    np.testing.assert_allclose(grad_with - grad_without, -0.01 * entropy_grad, atol=1e-7)
    assert np.any(entropy_grad != 0)


def test_entropy_is_refused_for_a_bijector_without_an_exact_form():
    dist = samplers.SquashedNormal(jnp.zeros((3, 2)), jnp.ones((3, 2)), distrax.Lambda(jnp.sinh))
    with pytest.raises(
        NotImplementedError,
        match=r"no exact form for Lambda; use dist.entropy_estimate\(seed=key.*entropy_quadrature",
    ):
        dist.entropy()


# Vector bounds by default; Tanh and Sigmoid, squashings of the same family, slow.
@pytest.mark.parametrize(
    "bijector",
    [
        slow(samplers.Tanh(), id="tanh"),
        pytest.param(
            samplers.BoundedTanh(jnp.array([-2.0, 0.0, 1.0]), jnp.full(3, 3.0)), id="bounded-tanh"
        ),
        slow(distrax.Sigmoid(), id="sigmoid"),
    ],
)
def test_sample_estimators_average_to_the_exact_entropy(bijector):
    dist = samplers.squashed_normal(jnp.tile(_inputs((), seed=8), (20_000, 1)), bijector)
    estimates = np.asarray(dist.entropy_estimate(seed=jax.random.key(9)), np.float64)
    standard_error = estimates.std() / np.sqrt(estimates.size)
    assert abs(estimates.mean() - float(dist.entropy()[0])) < 3 * standard_error


# The NaN policy of a SquashedNormal built directly.


@pytest.mark.parametrize(
    "loc, scale",
    [(jnp.inf, 1.0), (-jnp.inf, 1.0), (jnp.nan, 1.0), (0.5, -1.0), (0.5, 0.0), (0.5, jnp.inf)],
    ids=["+inf loc", "-inf loc", "nan loc", "negative scale", "zero scale", "inf scale"],
)
def test_a_directly_built_distribution_is_nan_for_invalid_parameters(loc, scale):
    dist = samplers.SquashedNormal(
        jnp.array([[0.1, loc]]), jnp.array([[1.0, scale]]), samplers.BoundedTanh(-2.0, 2.0)
    )
    action, pre_image, log_prob = dist.sample_with_pre_image(seed=jax.random.key(0))
    sample = dist.sample(seed=jax.random.key(0))
    assert np.isfinite(action[0, 0]) and np.isnan(action[0, 1]) and np.isnan(pre_image[0, 1])
    assert np.isnan(sample[0, 1]) and np.isnan(dist.deterministic_action()[0, 1])
    for value in (log_prob, dist.log_prob(jnp.array([[0.1, 1.0]])), dist.entropy()):
        assert np.all(np.isnan(value))
    for moment in (dist.mean(), dist.variance()):
        assert np.isnan(moment[0, 1]) and np.isfinite(moment[0, 0])


def test_a_std_that_overflows_float32_is_nan_not_a_bound():
    # exp(100) is inf in float32: the action would otherwise be +-1.
    dist = samplers.squashed_normal_from_log_std(jnp.array([0.3]), jnp.array([100.0]))
    assert np.isnan(dist.sample(seed=jax.random.key(0))[0])
    assert np.isnan(dist.entropy())


def test_an_integer_seed_works_as_in_distrax_and_an_integer_pre_image_is_refused():
    dist = samplers.normal_tanh(_inputs((4,)))
    _, pre_image, _ = dist.sample_with_pre_image(seed=0)
    expected = dist.sample_pre_image(seed=jax.random.PRNGKey(0))
    np.testing.assert_array_equal(pre_image, expected)
    with pytest.raises(TypeError, match=r"pre_image must have a floating dtype, got int32"):
        dist.log_prob_from_pre_image(jnp.zeros((4, A), jnp.int32))


def test_quadrature_beyond_its_node_limit_is_refused_with_the_exact_entropy_named():
    dist = samplers.normal_tanh(_inputs((4,)))
    assert np.all(np.isfinite(dist.entropy_quadrature(256)))
    with pytest.raises(ValueError, match=r"num_points must be at most 256, got 400.*entropy\(\)"):
        dist.entropy_quadrature(400)


def test_sample_pre_image_refuses_keys_that_are_not_one_per_batch_element():
    dist = samplers.normal_tanh(jnp.zeros((4, 6)))
    with pytest.raises(
        ValueError,
        match=r"seed must be one key or one key per batch element, shape \(4,\), got keys of "
        r"shape \(3,\)",
    ):
        dist.sample_pre_image(seed=jax.random.split(jax.random.key(0), 3))
    per_element = dist.sample_pre_image(seed=jax.random.split(jax.random.key(0), 4))
    assert per_element.shape == (4, 3)


# log_prob_from_pre_image and the entropy estimate over the whole parameter range, against
# float64, in 1-D, for the four squashings the guarantees name (tanh, BoundedTanh onto
# ONE_D_BOUNDS, samplers.Sigmoid() and the identity): parameters drawn by hypothesis
# (means and raw stds in [-1e3, 1e3], min_std in [0, 1], std_scale in [1e-30, 10]), then
# pinned saturated pre-images.

ONE_D_BOUNDS = (np.array([-2.0], np.float32), np.array([3.0], np.float32))

HALF_LOG_2PI = 0.5 * np.log(2 * np.pi)


def _property_cases(*default):
    """``(kind, share)`` cases of a property: each example compiles afresh (the options
    are static), so the default tier draws a fifth of the profile's examples
    (tests/conftest.py) for two squashings (they share one code path); the slow tier all
    of them, for every squashing."""
    fifth = [pytest.param(k, 5, id=f"{k}-a-fifth") for k in default]
    return [*fifth, *(slow(k, 1, id=k) for k in SQUASHING_KINDS)]


def _examples(share):
    """The property's settings: ``1 / share`` of the profile's examples, at least 2."""
    return settings(max_examples=max(2, settings.default.max_examples // share), deadline=None)


def _log_abs_derivative_float64(kind, x):
    """``log |f'(x)|`` of the 1-D squashing ``kind`` (bounds ``ONE_D_BOUNDS``), with at
    least one dimension, from the float64 references."""
    x = np.atleast_1d(np.asarray(x, np.float64))
    if kind == "tanh":
        return reference.tanh_log_derivative_float64(x)
    if kind == "bounded":
        return reference.tanh_log_derivative_float64(x, *ONE_D_BOUNDS)
    if kind == "sigmoid":
        return reference.sigmoid_log_derivative_float64(x)
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


def _one_d_distribution(kind, mean, raw_std, n, min_std, std_scale):
    """``n`` copies of a 1-D distribution, from the pure layer's public constructors."""
    params = jnp.broadcast_to(jnp.array([mean, raw_std], jnp.float32), (n, 2))
    if kind == "tanh":
        return samplers.normal_tanh(params, min_std=min_std, std_scale=std_scale)
    return samplers.squashed_normal(
        params, squashing(kind, ONE_D_BOUNDS), min_std=min_std, std_scale=std_scale
    )


# Guarantees, "In 1-D the density integrates to 1 over the range".
@pytest.mark.parametrize("kind, share", _property_cases("bounded", "sigmoid"))
def test_squashed_density_integrates_to_one(kind, share):
    """``int p(y) dy = int p(f(x)) |f'(x)| dx = 1`` over the range, by float64 quadrature.

    ``p(f(x))`` is the library's ``log_prob_from_pre_image``; ``|f'(x)|`` is float64.
    The std floor of 2**-10 lets float32 pre-images resolve the density (nodes at
    most std / 2 apart, where the trapezoid rule is exact to ~1e-17 for a Gaussian).
    """

    @_examples(share)
    @given(data=st.data())
    def check(data):
        mean_and_std, min_std, std_scale = data.draw(
            squashed_normal_parameters((), std_floor=2.0**-10, action_dim=1)
        )
        (mean,), (raw_std,) = np.split(mean_and_std.astype(np.float64), 2)
        std = float(reference.softplus_std_float64(raw_std, min_std, std_scale))
        # A fixed count of float32 nodes (one compilation); rounding may repeat some.
        nodes = (mean + std * np.linspace(-12.0, 12.0, 2001)).astype(np.float32)
        dist = _one_d_distribution(kind, mean, raw_std, nodes.size, min_std, std_scale)
        log_prob = np.asarray(dist.log_prob_from_pre_image(jnp.asarray(nodes)[:, None]), np.float64)
        nodes, first = np.unique(nodes, return_index=True)
        log_prob = log_prob[first]
        x = nodes.astype(np.float64)
        assert np.all(np.diff(x) <= std / 2)
        log_abs_derivative = _log_abs_derivative_float64(kind, x)
        density = np.exp(log_prob + log_abs_derivative)
        tolerance = 1e-6 + np.trapezoid(
            density * _float32_tolerance(x, mean, std, log_abs_derivative), x
        )
        assert abs(np.trapezoid(density, x) - 1.0) <= tolerance

    check()


SATURATED_PRE_IMAGES = [10.0, -10.0, 20.0, -20.0, 50.0, -50.0, 1e3, -1e3]


# Guarantees, "log_prob_from_pre_image ... within 16 float32 ulps of its largest
# term ... at +-10, +-20, +-50, +-1e3".
# (offset of the mean from the pre-image, raw std): at the mean, near it, 3 off.
SATURATED_OFFSETS = [(0.0, 0.0), (-0.5, 0.3), (3.0, -2.0)]


@pytest.mark.parametrize("kind", SQUASHING_KINDS)
def test_log_prob_of_saturated_pre_images_matches_float64(kind):
    # Every (pre-image, offset) pair is one batch element of one distribution.
    cases = [(x, *o) for x in SATURATED_PRE_IMAGES for o in SATURATED_OFFSETS]
    pre_image, offset, raw_std = np.array(cases, np.float32).T
    mean = pre_image + offset
    params = jnp.stack([mean, raw_std], axis=-1)
    if kind == "tanh":
        dist = samplers.normal_tanh(params, min_std=1e-3, std_scale=1.0)
    else:
        dist = samplers.squashed_normal(params, squashing(kind, ONE_D_BOUNDS), min_std=1e-3)
    log_prob = np.asarray(dist.log_prob_from_pre_image(jnp.asarray(pre_image)[:, None]))
    std = reference.softplus_std_float64(raw_std, 1e-3, 1.0)
    x = pre_image.astype(np.float64)
    log_abs_derivative = _log_abs_derivative_float64(kind, x)
    expected = (
        reference.normal_log_prob_float64(x, mean.astype(np.float64), std) - log_abs_derivative
    )
    tolerance = _float32_tolerance(x, mean.astype(np.float64), std, log_abs_derivative)
    assert np.all(np.isfinite(log_prob))
    bad = np.abs(log_prob - expected) > tolerance
    assert not np.any(bad), list(
        zip(np.array(cases)[bad], log_prob[bad], expected[bad], strict=True)
    )


# Guarantees, "log_prob_from_pre_image ... within 16 float32 ulps of its largest
# term, for pre-images anywhere in [-1e3, 1e3]".
@pytest.mark.parametrize("kind, share", _property_cases("tanh", "identity"))
def test_log_prob_from_pre_image_matches_float64_change_of_variables(kind, share):
    """Arbitrary pre-images in [-1e3, 1e3] under arbitrary parameters.

    The std floor of 2**-40 keeps ``z**2`` of the farthest pre-image inside the
    float32 range; below it the true log-density is below -FLT_MAX.
    """

    @_examples(share)
    @given(data=st.data())
    def check(data):
        mean_and_std, min_std, std_scale = data.draw(
            squashed_normal_parameters((), std_floor=2.0**-40, action_dim=1)
        )
        pre_images = data.draw(
            hnp.arrays(np.float32, (16,), elements=st.floats(-LIMIT, LIMIT, width=32))
        )
        (mean,), (raw_std,) = np.split(mean_and_std.astype(np.float64), 2)
        dist = _one_d_distribution(kind, mean, raw_std, pre_images.size, min_std, std_scale)
        log_prob = np.asarray(
            dist.log_prob_from_pre_image(jnp.asarray(pre_images)[:, None]), np.float64
        )
        x = pre_images.astype(np.float64)
        std = reference.softplus_std_float64(raw_std, min_std, std_scale)
        log_abs_derivative = _log_abs_derivative_float64(kind, x)
        expected = reference.normal_log_prob_float64(x, mean, std) - log_abs_derivative
        tolerance = _float32_tolerance(x, mean, std, log_abs_derivative)
        assert np.all(np.isfinite(log_prob))
        assert np.all(np.abs(log_prob - expected) <= tolerance), (log_prob, expected, tolerance)

    check()


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
    raw_std = softplus_inverse(std - 1e-3)
    exact = reference.squashed_normal_entropy_float64(
        mean, std, lambda x: _log_abs_derivative_float64(kind, x)
    )

    dist = _one_d_distribution(kind, mean, raw_std, 1, 1e-3, 1.0)
    keys = jax.random.split(jax.random.key(0), 20_000)
    estimates = jax.vmap(lambda key: dist.entropy_estimate(seed=key)[0])(keys)
    estimates = np.asarray(estimates, np.float64)
    assert np.all(np.isfinite(estimates))
    standard_error = estimates.std() / np.sqrt(estimates.size)
    assert abs(estimates.mean() - exact) <= 3 * standard_error + 1e-6 * (1 + abs(exact))
