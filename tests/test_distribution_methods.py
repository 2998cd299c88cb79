"""The ``distrax.Distribution`` methods of ``SquashedNormal``, against independent oracles."""

import distrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tensorflow_probability.substrates import jax as tfp

import samplers

tfb = tfp.bijectors
EPS32 = 2.0**-23

# The squashings log_prob scores from the distances to the bounds, with their k.
SQUASHINGS = {
    "samplers.Tanh": (samplers.Tanh(), 1.0),
    "distrax.Tanh": (distrax.Tanh(), 1.0),
    "BoundedTanh[-0.1,0.3]": (samplers.BoundedTanh(-0.1, 0.3), 1.0),
    "BoundedTanh[-2,3]": (samplers.BoundedTanh(jnp.array([-2.0, 0.0]), jnp.array([3.0, 1.0])), 1.0),
    "samplers.Sigmoid": (samplers.Sigmoid(), 2.0),
    "distrax.Sigmoid": (distrax.Sigmoid(), 2.0),
}


def _bounds(bijector):
    bounds = samplers.bijectors.squashing(bijector)
    low, high = (np.broadcast_to(np.asarray(b, np.float64), (2,)) for b in bounds[:2])
    return low, high


def _plain_distrax(loc, scale, bijector):
    return distrax.Transformed(
        distrax.MultivariateNormalDiag(loc, scale), distrax.Block(bijector, 1)
    )


@pytest.mark.parametrize(
    "value_shape", [(5, 2), (7, 5, 2), (7, 1, 2), (2,)], ids=["(B,A)", "(S,B,A)", "(S,1,A)", "(A,)"]
)
@pytest.mark.parametrize("bijector, k", SQUASHINGS.values(), ids=SQUASHINGS.keys())
def test_log_prob_broadcasts_as_distrax_and_matches_it_inside_the_range(
    bijector, k, value_shape, maybe_jit
):
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


@pytest.mark.parametrize("bijector, k", SQUASHINGS.values(), ids=SQUASHINGS.keys())
def test_sample_then_score_is_finite_where_distrax_is_not(bijector, k, maybe_jit):
    # SAC's two lines, at stds and means where many samples round onto a bound.
    keys = jax.random.split(jax.random.key(1), 3)
    loc = 3 * k * jax.random.normal(keys[0], (2048, 2))
    scale = k * jnp.exp(jax.random.uniform(keys[1], (2048, 2), maxval=1.6))
    dist = samplers.SquashedNormal(loc, scale, bijector)
    action = dist.sample(seed=keys[2])
    log_prob = maybe_jit(lambda d, a: d.log_prob(a))(dist, action)
    low, high = _bounds(bijector)
    on_bound = np.any((np.asarray(action) == low) | (np.asarray(action) == high), axis=-1)
    assert on_bound.sum() > 50
    assert np.all(np.isfinite(log_prob))
    assert not np.any(np.isfinite(_plain_distrax(loc, scale, bijector).log_prob(action))[on_bound])


@pytest.mark.parametrize("bijector, k", SQUASHINGS.values(), ids=SQUASHINGS.keys())
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
        low, high = (b[axis] for b in _bounds(bijector))
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
        # On a bound: the density half a float step inside it, whatever the pre-image was.
        step = np.where(np.asarray(y[:, 0]) == high, 1.0, -1.0)
        inner = np.where(
            step > 0,
            np.float64(high) - _half_step(high, low, half_range, k),
            np.float64(low) + _half_step(low, high, half_range, k),
        )
        inner_pre_image = 0.5 * k * (np.log(inner - low) - np.log(high - inner))
        at_inner = marginal.log_prob_from_pre_image(
            jnp.asarray(inner_pre_image[:, None], jnp.float32)
        )
        np.testing.assert_allclose(ours[saturated], np.asarray(at_inner)[saturated], atol=1e-4)
        assert np.all(np.isfinite(ours))


def _half_step(bound, other, half_range, k):
    """Half the coarser of tanh's step (k = 1) and the float32 spacing at ``bound``."""
    spacing = abs(np.float64(np.nextafter(np.float32(bound), np.float32(other))) - bound)
    tanh_step = half_range * 2.0**-24 if k == 1.0 else 0.0
    return max(0.5 * max(spacing, tanh_step), np.finfo(np.float32).tiny)


@pytest.mark.parametrize("bijector, k", SQUASHINGS.values(), ids=SQUASHINGS.keys())
def test_log_prob_gradients_are_finite_on_the_closed_range(bijector, k, maybe_jit):
    low, high = _bounds(bijector)
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


@pytest.mark.parametrize("sample_shape", [(), (3,)], ids=["one", "(3,)"])
@pytest.mark.parametrize("bijector, k", SQUASHINGS.values(), ids=SQUASHINGS.keys())
def test_sample_and_log_prob_scores_the_pre_image_without_inverting(bijector, k, sample_shape):
    loc = jnp.broadcast_to(jnp.array([0.0, 12.0 * k]), (64, 2))
    scale = jnp.broadcast_to(jnp.array([3.0 * k, 0.5]), (64, 2))
    dist = samplers.SquashedNormal(loc, scale, bijector)
    key = jax.random.key(3)
    action, log_prob = dist.sample_and_log_prob(seed=key, sample_shape=sample_shape)
    pre_image = dist.distribution.sample(seed=key, sample_shape=sample_shape)
    assert action.shape == (*sample_shape, 64, 2) and log_prob.shape == (*sample_shape, 64)
    np.testing.assert_array_equal(action, bijector.forward(pre_image))
    score = dist.log_prob_from_pre_image
    expected = jax.vmap(score)(pre_image) if sample_shape else score(pre_image)
    np.testing.assert_allclose(log_prob, expected, rtol=1e-6, atol=1e-5)
    assert np.all(np.isfinite(log_prob)) and np.any(np.abs(pre_image[..., 1]) > 9 * k)
