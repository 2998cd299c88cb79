import re

import distrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import samplers
from samplers.distributions.diagnostics import (
    bound_distance,
    ppo_log_ratio_stats,
    saturation_fraction,
)

LOW = jnp.array([-2.0, 0.0, -0.1])
HIGH = jnp.array([2.0, 1.0, 0.3])


# saturation_fraction


def test_saturation_counts_pre_images_whose_tanh_is_one():
    # |x| >= 9.1 saturates with any float32 tanh (correctly rounded from 13 log 2 ~ 9.01).
    pre_image = jnp.array([0.5, 3.0, -5.0, 9.1, -9.1, 20.0, -50.0, 100.0])
    assert float(saturation_fraction(pre_image)) == 5 / 8


def test_saturation_agrees_with_float64_away_from_the_backend_band():
    # Backends differ on where float32 tanh reaches 1 (XLA's CPU tanh at ~7.9988, a
    # correctly rounded one at ~9.011); outside that band every one agrees with this.
    x = np.concatenate([np.linspace(-7.9, 7.9, 101), np.linspace(9.02, 30.0, 50)])
    rounds_to_one = np.abs(np.tanh(x).astype(np.float32)) == 1
    ours = saturation_fraction(jnp.asarray(x, jnp.float32))
    assert float(ours) == pytest.approx(rounds_to_one.mean()) and 0 < float(ours) < 1


def test_saturation_threshold_and_axis():
    pre_image = jnp.array([[0.0, 6.0], [-6.5, 1.0], [7.0, -10.0], [2.0, 30.0]])
    assert float(saturation_fraction(pre_image, threshold=6.0)) == 5 / 8  # |x| >= 6 counts
    per_dimension = saturation_fraction(pre_image, threshold=6.0, axis=0)
    np.testing.assert_array_equal(per_dimension, [0.5, 0.75])


def test_saturation_of_a_nan_pre_image_is_nan_not_zero():
    pre_image = jnp.array([[0.5, jnp.nan], [20.0, 0.0]])
    for threshold in (None, 5.0):
        fraction = saturation_fraction(pre_image, threshold=threshold, axis=-1)
        assert np.isnan(fraction[0]) and float(fraction[1]) == 0.5
        assert np.isnan(saturation_fraction(pre_image, threshold=threshold))


def test_saturation_refuses_bad_arguments():
    with pytest.raises(TypeError, match=r"pre_image must have a floating dtype, got int32"):
        saturation_fraction(jnp.zeros(3, jnp.int32))
    with pytest.raises(ValueError, match=r"threshold must be > 0.0, got -1.0"):
        saturation_fraction(jnp.zeros(3), threshold=-1.0)


# bound_distance


def test_bound_distance_is_the_smallest_over_dimensions():
    action = jnp.array([[0.0, 0.5, 0.1], [1.9, 0.2, 0.25], [-2.0, 0.5, 0.1]])
    expected = np.array([0.2, 0.05, 0.0])  # dims: (2, 0.5, 0.2); (0.1, 0.2, 0.05); (0, ...)
    np.testing.assert_allclose(
        bound_distance(samplers.BoundedTanh(LOW, HIGH), action), expected, atol=1e-6
    )
    # Normalised by the half ranges (2, 0.5, 0.2): (1, 1, 1); (0.05, 0.4, 0.25); (0, ...).
    normalized = bound_distance(samplers.BoundedTanh(LOW, HIGH), action, normalized=True)
    np.testing.assert_allclose(normalized, [1.0, 0.05, 0.0], atol=1e-5)


@pytest.mark.parametrize(
    "bijector, action, expected",
    [
        (samplers.Tanh(), [0.5, -0.99], 0.01),
        (distrax.Tanh(), [1.0, 0.0], 0.0),
        (distrax.Sigmoid(), [0.3, 0.9], 0.1),
        (distrax.Block(distrax.Tanh(), 1), [0.25, 0.5], 0.5),
    ],
    ids=["Tanh", "distrax.Tanh", "Sigmoid", "Block"],
)
def test_bound_distance_reads_the_bounds_of_each_squashing(bijector, action, expected):
    assert float(bound_distance(bijector, jnp.array(action))) == pytest.approx(expected, abs=1e-6)


def test_bound_distance_takes_a_distribution(batch_shape):
    dist = samplers.squashed_normal(jnp.zeros((*batch_shape, 6)), samplers.BoundedTanh(LOW, HIGH))
    action = jnp.broadcast_to(jnp.array([1.0, 0.9, 0.0]), (*batch_shape, 3))
    distance = bound_distance(dist, action)
    assert distance.shape == batch_shape
    np.testing.assert_allclose(distance, np.full(batch_shape, 0.1), atol=1e-6)


def test_bound_distance_is_nan_for_a_batch_element_with_a_nan_action():
    action = np.array([[0.0, 0.5, 0.1], [1.9, np.nan, 0.25], [-2.0, 0.5, 0.1]], np.float32)
    low, high = np.asarray(LOW, np.float64), np.asarray(HIGH, np.float64)
    for normalized in (False, True):
        ours = bound_distance(
            samplers.BoundedTanh(LOW, HIGH), jnp.asarray(action), normalized=normalized
        )
        # float64, with the NaN rule written out: a NaN dimension makes its row NaN.
        distance = np.minimum(action - low, high - action) / ((high - low) / 2 if normalized else 1)
        expected = np.where(np.isnan(action).any(-1), np.nan, np.nanmin(distance, -1))
        np.testing.assert_allclose(ours, expected, atol=1e-6)  # NaN where NaN, and only there


def test_bound_distance_refuses_unbounded_squashings_scalars_and_other_action_shapes():
    with pytest.raises(TypeError, match=r"needs a bounded squashing .* got Lambda"):
        bound_distance(distrax.Lambda(lambda x: x), jnp.zeros(2))
    with pytest.raises(ValueError, match=r"got a scalar; add the action axis"):
        bound_distance(samplers.Tanh(), jnp.float32(0.5))
    bijector = samplers.BoundedTanh(-jnp.ones(3), jnp.ones(3))
    for shape in ((4, 2), (4, 1), (2,)):
        with pytest.raises(
            ValueError,
            match=re.escape(f"action of shape {shape} does not fit the bounds of BoundedTanh, ")
            + r"of shape \(3,\): .* whose last axes are \(3,\)",
        ):
            bound_distance(bijector, jnp.zeros(shape))
    np.testing.assert_array_equal(bound_distance(bijector, jnp.zeros((4, 3))), np.ones(4))


# ppo_log_ratio_stats

KEYS = [
    "approx_kl",
    "approx_kl_k1",
    "clip_fraction",
    "ratio_deviation_mean",
    "ratio_deviation_max",
]


def test_ppo_stats_match_hand_computed_values(maybe_jit):
    ratio = np.array([1.0, 1.5, 0.5, 1.1])
    old_log_prob = np.array([-1.0, -2.0, 0.5, 3.0])
    stats = maybe_jit(ppo_log_ratio_stats)(
        jnp.asarray(old_log_prob + np.log(ratio), jnp.float32),
        jnp.asarray(old_log_prob, jnp.float32),
    )
    # (r - 1) - log r per element: 0, 0.5 - log 1.5, -0.5 + log 2, 0.1 - log 1.1.
    k3 = (0 + (0.5 - np.log(1.5)) + (-0.5 + np.log(2.0)) + (0.1 - np.log(1.1))) / 4
    k1 = -(0 + np.log(1.5) + np.log(0.5) + np.log(1.1)) / 4
    assert float(stats["approx_kl"]) == pytest.approx(k3, rel=1e-5)
    assert float(stats["approx_kl_k1"]) == pytest.approx(k1, rel=1e-5)
    assert float(stats["clip_fraction"]) == 0.5  # |r - 1| = 0, 0.5, 0.5, 0.1 against 0.2
    assert float(stats["ratio_deviation_mean"]) == pytest.approx(0.275, rel=1e-5)
    assert float(stats["ratio_deviation_max"]) == pytest.approx(0.5, rel=1e-5)
    tight = ppo_log_ratio_stats(
        jnp.asarray(np.log(ratio), jnp.float32), jnp.zeros(4), clip_epsilon=0.05
    )
    assert float(tight["clip_fraction"]) == 0.75


def test_ppo_k3_keeps_its_digits_for_ratios_close_to_one():
    log_ratio = np.array([1e-4, -2e-4, 3e-5, 5e-4])
    exact = np.mean(np.expm1(log_ratio) - log_ratio)  # float64
    stats = ppo_log_ratio_stats(jnp.asarray(log_ratio, jnp.float32), jnp.zeros(4))
    assert float(stats["approx_kl"]) == pytest.approx(exact, rel=1e-3)
    lr32 = jnp.asarray(log_ratio, jnp.float32)
    naive = float(jnp.mean((jnp.exp(lr32) - 1) - lr32))
    assert abs(naive - exact) > 0.05 * exact  # why expm1


def test_ppo_kl_estimates_converge_to_the_exact_kl():
    def policy(loc, scale):
        shape = (200_000, 2)
        loc, scale = (
            jnp.broadcast_to(jnp.array(loc), shape),
            jnp.broadcast_to(jnp.array(scale), shape),
        )
        return samplers.SquashedNormal(loc, scale, samplers.Tanh())

    old, new = policy([0.2, -1.0], [0.5, 1.2]), policy([0.3, -0.8], [0.45, 1.3])

    @jax.jit
    def stats(old, new, key):
        pre_image = old.sample_pre_image(seed=key)
        return ppo_log_ratio_stats(
            new.log_prob_from_pre_image(pre_image), old.log_prob_from_pre_image(pre_image)
        )

    result = stats(old, new, jax.random.key(0))
    exact = float(old.kl_divergence(new)[0])
    assert float(result["approx_kl"]) == pytest.approx(exact, rel=0.03)
    assert float(result["approx_kl_k1"]) == pytest.approx(exact, rel=0.05)


@pytest.mark.parametrize("which", ["log_prob", "old_log_prob"])
def test_ppo_stats_are_nan_where_an_input_is_nan(which, maybe_jit):
    """Each statistic averages over every element: one NaN log-likelihood makes it NaN,
    ``clip_fraction`` included (``NaN > clip_epsilon`` is False, not NaN)."""
    log_prob = np.array([-1.0, -2.0, 0.5, 3.0], np.float32)
    old_log_prob = log_prob - np.log(np.array([1.0, 1.5, 0.5, 1.1], np.float32))
    inputs = {"log_prob": log_prob, "old_log_prob": old_log_prob}
    inputs[which] = inputs[which].copy()
    inputs[which][2] = np.nan
    stats = maybe_jit(ppo_log_ratio_stats)(*(jnp.asarray(inputs[k]) for k in inputs))
    assert sorted(stats) == sorted(KEYS)
    for key in KEYS:
        assert np.isnan(stats[key]), key
    # Without the NaN every statistic is finite: it is the NaN, not the formula.
    finite = ppo_log_ratio_stats(jnp.asarray(log_prob), jnp.asarray(old_log_prob))
    for key in KEYS:
        assert np.isfinite(finite[key]), key


def test_ppo_stats_refuse_bad_arguments():
    with pytest.raises(ValueError, match=r"same shape, got \(3,\) and \(4,\)"):
        ppo_log_ratio_stats(jnp.zeros(3), jnp.zeros(4))
    with pytest.raises(ValueError, match=r"clip_epsilon must be > 0.0, got 0.0"):
        ppo_log_ratio_stats(jnp.zeros(3), jnp.zeros(3), clip_epsilon=0.0)
    with pytest.raises(TypeError, match=r"old_log_prob must have a floating dtype"):
        ppo_log_ratio_stats(jnp.zeros(3), jnp.zeros(3, jnp.int32))


# kl_divergence


def _pair(batch_shape, bijector, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    shape = (*batch_shape, 3)
    p = samplers.SquashedNormal(
        jax.random.normal(keys[0], shape),
        jnp.exp(0.5 * jax.random.normal(keys[1], shape)),
        bijector,
    )
    q = samplers.SquashedNormal(
        jax.random.normal(keys[2], shape),
        jnp.exp(0.5 * jax.random.normal(keys[3], shape)),
        bijector,
    )
    return p, q


def test_kl_matches_distrax_normal_kl(batch_shape, maybe_jit):
    p, q = _pair(batch_shape, samplers.BoundedTanh(LOW, HIGH))
    ours = maybe_jit(lambda p, q: p.kl_divergence(q))(p, q)
    base = distrax.MultivariateNormalDiag(p.loc, p.scale).kl_divergence(
        distrax.MultivariateNormalDiag(q.loc, q.scale)
    )
    assert ours.shape == batch_shape
    np.testing.assert_allclose(ours, base, rtol=1e-5, atol=1e-6)


def test_kl_matches_a_float64_monte_carlo_estimate_in_action_space():
    # Both densities are evaluated at the action through the float64 inverse, so this
    # estimates the KL of the squashed distributions, not that of their bases.
    low, high = np.array([-2.0, 0.0]), np.array([0.5, 1.0])
    loc_p, scale_p, loc_q, scale_q = np.array([[0.3, -1.0], [0.6, 1.5], [-0.2, -0.5], [0.9, 1.1]])
    rng = np.random.default_rng(0)
    x = loc_p + scale_p * rng.standard_normal((1_000_000, 2))
    center, half_range = (high + low) / 2, (high - low) / 2
    y = center + half_range * np.tanh(x)

    def log_density(loc, scale):
        u = (y - center) / half_range
        pre_image = np.arctanh(u)
        log_normal = -0.5 * ((pre_image - loc) / scale) ** 2 - np.log(scale)
        return np.sum(log_normal - np.log(half_range) - np.log1p(-(u**2)), axis=-1)

    samples = log_density(loc_p, scale_p) - log_density(loc_q, scale_q)
    estimate, standard_error = samples.mean(), samples.std() / np.sqrt(samples.size)
    bijector = samplers.BoundedTanh(jnp.asarray(low, jnp.float32), jnp.asarray(high, jnp.float32))
    p = samplers.SquashedNormal(
        jnp.asarray(loc_p, jnp.float32), jnp.asarray(scale_p, jnp.float32), bijector
    )
    q = samplers.SquashedNormal(
        jnp.asarray(loc_q, jnp.float32), jnp.asarray(scale_q, jnp.float32), bijector
    )
    assert abs(float(p.kl_divergence(q)) - estimate) < 5 * standard_error


def test_kl_is_zero_for_equal_and_accurate_for_close_stds():
    p, _ = _pair((4,), samplers.Tanh())
    np.testing.assert_array_equal(p.kl_divergence(p), np.zeros(4))
    scale_q = p.scale * (1 + 1e-3)
    q = samplers.SquashedNormal(p.loc, scale_q, distrax.Tanh())
    t = np.log(np.asarray(p.scale, np.float64)) - np.log(np.asarray(scale_q, np.float64))
    exact = np.sum(0.5 * (np.expm1(2 * t) - 2 * t), axis=-1)
    np.testing.assert_allclose(p.kl_divergence(q), exact, rtol=1e-3)


def test_kl_broadcasts_batch_shapes():
    p, _ = _pair((), samplers.Tanh())
    _, q = _pair((5,), samplers.Tanh())
    ours = p.kl_divergence(q)
    expected = [
        float(p.kl_divergence(samplers.SquashedNormal(q.loc[i], q.scale[i], samplers.Tanh())))
        for i in range(5)
    ]
    assert ours.shape == (5,)
    np.testing.assert_allclose(ours, expected, rtol=1e-6)


def test_kl_refuses_different_bijectors_where_distrax_does_not():
    p, _ = _pair((), samplers.BoundedTanh(-1.0, 1.0))
    _, q = _pair((), samplers.BoundedTanh(-5.0, 3.0))
    # distrax's own Transformed KL compares traced programs, which do not show the
    # bounds' values, and returns the base KL; the method registered for
    # SquashedNormal and the free function refuse.
    plain_p, plain_q = (distrax.Transformed(dist.distribution, dist.bijector) for dist in (p, q))
    assert np.isfinite(plain_p.kl_divergence(plain_q))
    with pytest.raises(
        ValueError, match=r"share their bijector, got BoundedTanh onto \[-1.0, 1.0\] and Bounded"
    ):
        p.kl_divergence(q)
    _, sigmoid = _pair((), distrax.Sigmoid())
    with pytest.raises(ValueError, match=r"got Tanh onto .* and Sigmoid onto"):
        (_pair((), samplers.Tanh())[0]).kl_divergence(sigmoid)


def _kl_with_bounds(low_p, high_p, low_q, high_q, mean_and_std_p, mean_and_std_q):
    p = samplers.squashed_normal(mean_and_std_p, samplers.BoundedTanh(low_p, high_p))
    q = samplers.squashed_normal(mean_and_std_q, samplers.BoundedTanh(low_q, high_q))
    return p.kl_divergence(q), p.kl_divergence(q)


def test_kl_of_bounds_traced_in_jit_is_nan_where_they_differ_and_exact_where_equal():
    keys = jax.random.split(jax.random.key(5), 2)
    mean_and_std_p, mean_and_std_q = (jax.random.normal(k, (4, 6)) for k in keys)
    kl = jax.jit(_kl_with_bounds)
    equal, _ = kl(LOW, HIGH, LOW, HIGH, mean_and_std_p, mean_and_std_q)
    exact, _ = _kl_with_bounds(LOW, HIGH, LOW, HIGH, mean_and_std_p, mean_and_std_q)
    np.testing.assert_allclose(equal, exact, rtol=1e-6)
    assert np.all(np.isfinite(equal))
    other_high = HIGH.at[2].set(0.5)
    for bounds_q in ((LOW, other_high), (LOW.at[0].set(-1.0), HIGH)):
        ours, method = kl(LOW, HIGH, *bounds_q, mean_and_std_p, mean_and_std_q)
        # One answer: the function and the method are the same registered KL.
        assert np.all(np.isnan(ours)) and np.all(np.isnan(method))


def test_kl_of_stacked_bounds_under_vmap_is_nan_only_for_members_whose_bounds_differ():
    mean_and_std = jax.random.normal(jax.random.key(6), (3, 2, 6))
    low_p = jnp.stack([LOW, LOW, LOW])
    low_q = jnp.stack([LOW, LOW - 1.0, LOW])
    high = jnp.stack([HIGH, HIGH, HIGH])
    ours, _ = jax.vmap(_kl_with_bounds)(low_p, high, low_q, high, mean_and_std, mean_and_std + 0.5)
    for member in (0, 2):
        exact, _ = _kl_with_bounds(
            LOW, HIGH, LOW, HIGH, mean_and_std[member], mean_and_std[member] + 0.5
        )
        np.testing.assert_allclose(ours[member], exact, rtol=1e-6)
    assert np.all(np.isnan(ours[1]))


def test_kl_accepts_the_same_map_written_differently():
    p, _ = _pair((2,), samplers.Tanh())
    _, q = _pair((2,), distrax.Tanh())
    assert p.kl_divergence(q).shape == (2,)
    scalar_bounds, _ = _pair((2,), samplers.BoundedTanh(-2.0, 2.0))
    _, vector_bounds = _pair((2,), samplers.BoundedTanh(jnp.full(3, -2.0), jnp.full(3, 2.0)))
    assert scalar_bounds.kl_divergence(vector_bounds).shape == (2,)


def test_kl_refuses_other_distributions_and_shapes():
    p, _ = _pair((2,), samplers.Tanh())
    with pytest.raises(NotImplementedError, match=r"type SquashedNormal and .* type Normal"):
        p.kl_divergence(distrax.Normal(0.0, 1.0))
    other = samplers.SquashedNormal(jnp.zeros((2, 4)), jnp.ones((2, 4)), samplers.Tanh())
    with pytest.raises(
        ValueError, match=r"same action size .* got loc shapes \(2, 3\) and \(2, 4\)"
    ):
        p.kl_divergence(other)


def test_kl_of_a_subclass_follows_its_declared_squashing():
    class Inherits(samplers.BoundedTanh):
        pass

    class Changes(samplers.BoundedTanh):
        squashing = None  # a subclass that changes the map withdraws the declaration

    q = samplers.squashed_normal(jnp.ones((2, 2)), samplers.BoundedTanh(-2.0, 2.0))
    p = samplers.squashed_normal(jnp.zeros((2, 2)), Inherits(-2.0, 2.0))
    np.testing.assert_array_equal(p.kl_divergence(q), p.distribution.kl_divergence(q.distribution))
    p = samplers.squashed_normal(jnp.zeros((2, 2)), Changes(-2.0, 2.0))
    with pytest.raises(ValueError, match=r"got Changes and BoundedTanh that cannot be shown"):
        p.kl_divergence(q)


def test_an_infinite_ratio_gives_an_infinite_kl_not_nan():
    # (r - 1) - log r -> +inf as log r -> +inf; written naively it is inf - inf.
    stats = ppo_log_ratio_stats(jnp.array([jnp.inf, 0.0]), jnp.zeros(2))
    assert stats["approx_kl"] == jnp.inf and stats["clip_fraction"] == 0.5


def test_an_empty_batch_is_refused_naming_the_argument_where_a_statistic_needs_one():
    with pytest.raises(ValueError, match=r"log_prob is empty along the axes reduced over"):
        samplers.ppo_log_ratio_stats(jnp.zeros(0), jnp.zeros(0))
    with pytest.raises(ValueError, match=r"pre_image is empty .*\(0, 3\)"):
        samplers.saturation_fraction(jnp.zeros((0, 3)))
    with pytest.raises(ValueError, match=r"action is empty .*\(4, 0\)"):
        samplers.bound_distance(samplers.Tanh(), jnp.zeros((4, 0)))
    # Reduced over non-empty axes, an empty batch gives an empty result.
    assert samplers.saturation_fraction(jnp.zeros((0, 3)), axis=-1).shape == (0,)
    assert samplers.bound_distance(samplers.Tanh(), jnp.zeros((0, 2))).shape == (0,)
