import distrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import samplers
from tests.reference import tanh_log_derivative_float64

LOW = jnp.array([-2.0, 0.0, -0.1])
HIGH = jnp.array([2.0, 1.0, 0.3])


def _chain(low, high):
    return distrax.Chain([distrax.ScalarAffine((high + low) / 2, (high - low) / 2), distrax.Tanh()])


def test_forward_and_log_det_match_distrax_chain():
    x = 3.0 * jax.random.normal(jax.random.key(0), (50, 3))
    bijector = samplers.BoundedTanh(LOW, HIGH)
    y, log_det = bijector.forward_and_log_det(x)
    expected_y, expected_log_det = _chain(LOW, HIGH).forward_and_log_det(x)
    np.testing.assert_allclose(y, expected_y, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(log_det, expected_log_det, rtol=1e-4, atol=1e-4)


def test_log_prob_matches_distrax_chain_under_the_squashed_normal():
    mean_and_std = jax.random.normal(jax.random.key(1), (20, 6))
    dist = samplers.squashed_normal(mean_and_std, samplers.BoundedTanh(LOW, HIGH))
    action, _, log_prob = dist.sample_with_pre_image(seed=jax.random.key(2))
    chained = distrax.Transformed(
        distrax.MultivariateNormalDiag(dist.loc, dist.scale), distrax.Block(_chain(LOW, HIGH), 1)
    )
    np.testing.assert_allclose(log_prob, chained.log_prob(action), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("x", [9.0, 9.1, 20.0, 1e3, -9.1, -20.0, -1e3])
def test_actions_stay_inside_the_bounds_when_saturated(x):
    y = samplers.BoundedTanh(LOW, HIGH).forward(jnp.full(3, x))
    assert jnp.all(y >= LOW) and jnp.all(y <= HIGH)


def test_without_the_clip_the_affine_map_rounds_past_a_bound():
    # Why the forward map clips: center + half_range * 1 lands above high here.
    low, high = jnp.float32(-1.0), jnp.float32(0.7)
    assert (high + low) / 2 + (high - low) / 2 * jnp.tanh(jnp.float32(20.0)) > high
    assert samplers.BoundedTanh(low, high).forward(jnp.float32(20.0)) == high


def test_log_det_is_finite_when_saturated():
    log_det = samplers.BoundedTanh(LOW, HIGH).forward_log_det_jacobian(jnp.full(3, 50.0))
    expected = np.log((np.asarray(HIGH) - np.asarray(LOW)) / 2) + 2 * np.log(2) - 2 * 50.0
    np.testing.assert_allclose(log_det, expected, rtol=1e-5)


def test_inverse_round_trips_inside_the_range():
    x = jnp.tile(jnp.linspace(-3.0, 3.0, 21)[:, None], (1, 3))
    bijector = samplers.BoundedTanh(LOW, HIGH)
    y, log_det = bijector.forward_and_log_det(x)
    x_back, inverse_log_det = bijector.inverse_and_log_det(y)
    np.testing.assert_allclose(x_back, x, atol=2e-3)
    np.testing.assert_allclose(inverse_log_det, -log_det, atol=2e-3)


def test_scalar_bounds_apply_to_every_dimension():
    y = samplers.BoundedTanh(-2.0, 2.0).forward(jnp.zeros((4, 3)) + 100.0)
    np.testing.assert_array_equal(y, jnp.full((4, 3), 2.0))


@pytest.mark.parametrize(
    "low, high, message",
    [
        ([0.0, 1.0], [1.0, 1.0], r"low must be < high in every dimension"),
        ([0.0, 2.0], [1.0, 1.0], r"low must be < high in every dimension"),
        ([0.0, 0.0], [1.0, 1.0, 1.0], r"same shape.*got \(2,\) and \(3,\)"),
        ([[0.0]], [[1.0]], r"same shape, \(\) or \(action_dim,\), got \(1, 1\)"),
        ([0.0, -np.inf], [1.0, 1.0], r"low must be finite real numbers"),
        (0.0, np.nan, r"high must be finite real numbers"),
        ("a", "b", r"low must be finite real numbers"),
        (-1e300, 1e300, r"low must be finite real numbers in float32, got -1e\+300"),
        (
            -3e38,
            3e38,
            r"high - low must be finite in float32, got low=-3e\+38 and high=3e\+38, where "
            r"high - low is inf; rescale the action space \(e.g. to \[-1, 1\]\) and scale the "
            r"action back outside the policy",
        ),
        (2e38, 3e38, r"high \+ low must be finite in float32, got low=2e\+38 and high=3e\+38"),
        (-3e38, -2e38, r"high \+ low must be finite in float32, .* high \+ low is -inf"),
        (
            np.array([-1.0, -3e38], np.float32),
            np.array([1.0, 3e38], np.float32),
            r"high - low must be finite in float32, .* where high - low is \[ 2. inf\]",
        ),
        (np.float16(-4e4), np.float16(4e4), r"high - low must be finite in float16"),
        (1.2e-38, 1.5e-38, r"\(high - low\) / 2 must be at least 1.18e-38 in float32"),
    ],
)
def test_bad_bounds_are_refused(low, high, message):
    with pytest.raises(ValueError, match=message):
        samplers.BoundedTanh(low, high)


@pytest.mark.parametrize(
    "low, high", [(-1.7e38, 1.7e38), (1e38, 2.4e38), (-2.4e38, -1e38)], ids=str
)
def test_bounds_near_the_largest_float32_give_the_float64_map(low, high):
    """Finite ``high - low`` and ``high + low``: the half range, the centre, the action,
    the log-determinant and the normalised distance to a bound are those of float64."""
    x = np.array([-50.0, -2.0, -0.3, 0.0, 0.7, 3.0, 50.0])
    bijector = samplers.BoundedTanh(low, high)
    y, log_det = bijector.forward_and_log_det(jnp.asarray(x, jnp.float32))
    low64, high64 = (float(np.float32(b)) for b in (low, high))
    half_range = (high64 - low64) / 2
    expected_y = (high64 + low64) / 2 + half_range * np.tanh(x)
    expected_log_det = tanh_log_derivative_float64(x, low64, high64)
    assert np.all(np.isfinite(y)) and np.all(np.isfinite(log_det))
    np.testing.assert_allclose(y, expected_y, rtol=1e-6, atol=1e-6 * half_range)
    np.testing.assert_allclose(log_det, expected_log_det, rtol=1e-6)
    distance = samplers.bound_distance(bijector, y[:, None], normalized=True)
    expected_distance = np.minimum(expected_y - low64, high64 - expected_y) / half_range
    np.testing.assert_allclose(distance, expected_distance, atol=1e-6)


def test_traced_bounds_are_checked_for_shape_only():
    def forward(low, high):
        return samplers.BoundedTanh(low, high).forward(jnp.zeros(2))

    # Crossing bounds have no values at trace time: not refused, and not meaningful.
    jax.jit(forward)(jnp.ones(2), jnp.zeros(2))
    with pytest.raises(ValueError, match=r"same shape.*got \(2,\) and \(3,\)"):
        jax.jit(forward)(jnp.zeros(2), jnp.ones(3))


def test_constant_bounds_build_inside_jit_and_are_still_checked():
    """Inside ``jax.jit`` even ``jnp.asarray(2.0)`` is a tracer; constant bounds given as
    Python numbers or NumPy arrays must still build, and bad ones still be refused."""
    x = jnp.array([-30.0, 0.3, 40.0])

    @jax.jit
    def forward(x):
        return samplers.BoundedTanh(np.array([-2.0, 0.0, -0.1]), np.array([2.0, 1.0, 0.3])).forward(
            x
        )

    np.testing.assert_array_equal(forward(x), samplers.BoundedTanh(LOW, HIGH).forward(x))
    scalar = jax.jit(lambda x: samplers.BoundedTanh(-2.0, 2.0).forward(x))(x)
    np.testing.assert_array_equal(scalar, samplers.BoundedTanh(-2.0, 2.0).forward(x))
    with pytest.raises(ValueError, match=r"low must be < high in every dimension, got low=2.0"):
        jax.jit(lambda x: samplers.BoundedTanh(2.0, 1.0).forward(x))(x)
    with pytest.raises(
        ValueError, match=r"low must be finite real numbers in float32, got 1e\+300"
    ):
        jax.jit(lambda x: samplers.BoundedTanh(1e300, 2e300).forward(x))(x)


def test_a_subclass_that_changes_the_map_loses_the_squashing_it_extends():
    """The closed forms built on the bounds do not apply to a changed map: its
    distribution falls back to distrax, as for any other bijector, unless it
    declares its own squashing."""

    class Doubled(samplers.Tanh):
        def forward_and_log_det(self, x):
            y, log_det = super().forward_and_log_det(x)
            return 0.5 * y, log_det - jnp.log(2.0)

    assert samplers.distributions.bijectors.squashing(Doubled()) is None
    assert samplers.distributions.bijectors.squashing(samplers.Tanh()) is not None
    dist = samplers.SquashedNormal(jnp.zeros(1), jnp.ones(1), Doubled())
    with pytest.raises(NotImplementedError, match="variance needs an increasing squashing"):
        dist.variance()

    class Declared(Doubled):
        squashing = samplers.Squashing(-0.5, 0.5, 1.0)

    declared = samplers.SquashedNormal(jnp.array([0.3]), jnp.array([0.7]), Declared())
    plain = samplers.SquashedNormal(jnp.array([0.3]), jnp.array([0.7]), samplers.Tanh())
    np.testing.assert_allclose(declared.mean(), 0.5 * plain.mean(), rtol=1e-6)
    action = jnp.array([0.2])
    np.testing.assert_allclose(
        declared.log_prob(action), plain.log_prob(2 * action) + jnp.log(2.0), rtol=1e-6
    )


def test_a_declared_sigmoid_squashing_onto_other_bounds_samples_its_own_map():
    class WideSigmoid(distrax.Bijector):
        squashing = samplers.Squashing(-3.0, 3.0, 2.0)

        def __init__(self):
            super().__init__(event_ndims_in=0)

        def forward_and_log_det(self, x):
            s = jax.nn.sigmoid(x)
            return -3.0 + 6.0 * s, jnp.log(6.0) + jax.nn.log_sigmoid(x) + jax.nn.log_sigmoid(-x)

        def inverse_and_log_det(self, y):
            x = jnp.log((y + 3.0) / (3.0 - y))
            return x, -self.forward_and_log_det(x)[1]

    dist = samplers.SquashedNormal(jnp.array([0.5, -8.0, 30.0]), jnp.ones(3), WideSigmoid())
    action, pre_image, log_prob = dist.sample_with_pre_image(seed=jax.random.key(0))
    np.testing.assert_allclose(action, -3.0 + 6.0 * jax.nn.sigmoid(pre_image), rtol=1e-6)
    assert np.all((np.asarray(action) >= -3.0) & (np.asarray(action) <= 3.0))
    np.testing.assert_allclose(dist.mode(), WideSigmoid().forward(_mode_pre_image(dist)), rtol=1e-6)
    x = np.asarray(pre_image, np.float64)
    expected = np.sum(
        -0.5 * (x - [0.5, -8.0, 30.0]) ** 2
        - 0.5 * np.log(2 * np.pi)
        - np.log(6.0)
        + np.logaddexp(0, x)
        + np.logaddexp(0, -x)
    )
    np.testing.assert_allclose(log_prob, expected, rtol=1e-5)


def _mode_pre_image(dist):
    from samplers.distributions import _squashed

    return _squashed.mode_pre_image(dist.loc, dist.scale, 2.0)


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
