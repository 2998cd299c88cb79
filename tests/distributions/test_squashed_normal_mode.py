"""``SquashedNormal.mode``: the maximum of the action density, against a float64 grid search.

Where a squashed-Normal test goes: ``tests/README.md``.
"""

import distrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import samplers
from samplers.distributions import _squashed
from samplers.distributions.bijectors import squashing
from tests._tiers import slow


def mode_pre_image(dist):
    """The pre-image that ``dist.mode()`` maps and remembers."""
    return _squashed.mode_pre_image(dist.loc, dist.scale, squashing(dist.bijector).pre_image_scale)


# (loc, scale): unimodal (scale < 1/sqrt(2)), near the bifurcation, bimodal with
# modes inside float32 range, and bimodal with the mode rounding onto a bound.
UNIMODAL = [(0.5, 0.3), (-1.2, 0.5), (2.0, 0.2), (0.0, 0.5), (4.0, 1.0)]
BIMODAL = [(0.3, 1.0), (-0.7, 1.5), (0.3, 3.0), (-0.3, 3.0), (0.05, 0.9)]
CASES = UNIMODAL + BIMODAL


def _log_density_of_action_float64(distance_to_high, distance_to_low, loc, scale):
    """``log p(y)`` of ``y = tanh(x)``, from the distances of ``y`` to +-1, in float64.

    ``x = atanh(y) = (log(1 + y) - log(1 - y)) / 2`` and ``log(1 - y**2)`` are
    written from the distances, so actions within 1e-300 of a bound are resolved.
    """
    x = 0.5 * (np.log(distance_to_low) - np.log(distance_to_high))
    log_normal = -0.5 * ((x - loc) / scale) ** 2
    return log_normal - np.log(distance_to_low) - np.log(distance_to_high)


def _grid_mode_in_action_space(loc, scale):
    """The argmax of the action density over a dense grid of actions in (-1, 1).

    Uniform in the interior and log-spaced in the distance to each bound (down to
    1e-30), then refined on a finer uniform grid around the best point.
    """
    interior = np.linspace(-1, 1, 400_001)[1:-1]
    near = np.logspace(-30, -0.5, 200_001)
    high_side = np.stack([near, 2 - near])  # distance to high, distance to low
    low_side = np.stack([2 - near, near])
    grid = np.concatenate([np.stack([1 - interior, 1 + interior]), high_side, low_side], axis=1)
    values = _log_density_of_action_float64(grid[0], grid[1], loc, scale)
    best = grid[:, np.argmax(values)]
    # Refine in the pre-image, where the peak is smooth at any distance from the bound.
    x_best = 0.5 * (np.log(best[1]) - np.log(best[0]))
    x = x_best + np.linspace(-0.01, 0.01, 200_001) * max(1.0, abs(x_best))
    to_high, to_low = 2 / (1 + np.exp(2 * x)), 2 / (1 + np.exp(-2 * x))
    values = _log_density_of_action_float64(to_high, to_low, loc, scale)
    return x[np.argmax(values)], np.max(values)


def _dist(cases, bijector=None):
    loc, scale = np.array(cases, np.float32).T
    return samplers.SquashedNormal(
        jnp.asarray(loc)[:, None], jnp.asarray(scale)[:, None], bijector or samplers.Tanh()
    )


def test_mode_matches_a_dense_float64_grid_search_in_action_space(maybe_jit):
    ours = np.asarray(maybe_jit(mode_pre_image)(_dist(CASES))[:, 0], np.float64)
    for (loc, scale), x in zip(CASES, ours, strict=True):
        x_grid, best = _grid_mode_in_action_space(loc, scale)
        to_high, to_low = 2 / (1 + np.exp(2 * x)), 2 / (1 + np.exp(-2 * x))
        at_ours = _log_density_of_action_float64(to_high, to_low, loc, scale)
        # The density at our mode is the grid's maximum, to float32 rounding of x ...
        assert at_ours >= best - 1e-6 * (1 + abs(best)), (loc, scale)
        # ... and the mode is where the grid puts it.
        assert x == pytest.approx(x_grid, rel=2e-4, abs=2e-4), (loc, scale)


def test_mode_is_not_the_median_and_is_more_likely():
    dist = _dist(CASES)
    x_mode, x_median = mode_pre_image(dist), dist.loc
    log_density = jax.jit(lambda d, x: d.log_prob_from_pre_image(x))
    assert np.all(np.asarray(log_density(dist, x_mode)) >= np.asarray(log_density(dist, x_median)))
    # Unimodal with a narrow std: close to tanh(loc), but further out.
    close = _dist([(0.5, 0.3)])
    assert float(close.mode()[0, 0]) == pytest.approx(0.5343, abs=1e-4)
    assert float(close.deterministic_action()[0, 0]) == pytest.approx(0.4621, abs=1e-4)


def test_bimodal_modes_sit_near_the_bound_on_the_side_of_the_mean():
    actions = np.asarray((_dist(BIMODAL)).mode()[:, 0])
    np.testing.assert_allclose(actions[:2], [0.97831, -0.99994], atol=1e-5)
    # loc=+-0.3, scale=3: the mode is at x ~ 18.3, tanh = 1 - 2.6e-16, which is 1.0 in float32.
    np.testing.assert_array_equal(actions[2:4], [1.0, -1.0])
    np.testing.assert_allclose(np.asarray(mode_pre_image(_dist(BIMODAL)))[2:4, 0], [18.3, -18.3])


# distrax's Tanh is the map the tests above check: slow.
@pytest.mark.parametrize(
    "bijector, forward",
    [
        slow(distrax.Tanh(), np.tanh, id="distrax.Tanh"),
        pytest.param(
            samplers.BoundedTanh(-2.0, 0.5), lambda x: -0.75 + 1.25 * np.tanh(x), id="BoundedTanh"
        ),
        pytest.param(distrax.Sigmoid(), lambda x: 1 / (1 + np.exp(-x)), id="Sigmoid"),
    ],
)
def test_other_squashings_match_the_grid(bijector, forward):
    x = np.asarray(mode_pre_image(_dist(CASES, bijector))[:, 0], np.float64)
    # Sigmoid(x) is tanh(x / 2) moved onto [0, 1]: the same problem for loc / 2, scale / 2.
    k = 2.0 if isinstance(bijector, distrax.Sigmoid) else 1.0
    for (loc, scale), x_ours in zip(CASES, x, strict=True):
        x_grid, _ = _grid_mode_in_action_space(loc / k, scale / k)
        assert x_ours == pytest.approx(k * x_grid, rel=2e-4, abs=2e-4), (loc, scale)
    np.testing.assert_allclose((_dist(CASES[:5], bijector)).mode()[:, 0], forward(x[:5]), rtol=1e-5)


def test_shapes_follow_the_distribution(batch_shape):
    loc = jax.random.normal(jax.random.key(0), (*batch_shape, 3))
    dist = samplers.SquashedNormal(loc, jnp.full_like(loc, 2.0), samplers.Tanh())
    assert dist.mode().shape == loc.shape
    assert np.all(np.sign(mode_pre_image(dist)) == np.sign(loc))


def test_gradients_are_stopped():
    def action(loc):
        dist = samplers.SquashedNormal(loc, jnp.ones_like(loc), samplers.Tanh())
        return jnp.sum(dist.mode())

    np.testing.assert_array_equal(jax.grad(action)(jnp.array([0.3, -2.0])), [0.0, 0.0])


def test_the_mode_is_scored_at_its_remembered_pre_image():
    dist = _dist(BIMODAL)
    action = dist.mode()
    np.testing.assert_array_equal(
        dist.log_prob(action), dist.log_prob_from_pre_image(mode_pre_image(dist))
    )


def test_mode_is_samplers_mode_and_maximises_the_float64_density():
    loc, scale = jnp.array([[0.5, 0.3, -0.2]]), jnp.array([[0.3, 1.0, 3.0]])
    dist = samplers.SquashedNormal(loc, scale, samplers.Tanh())
    np.testing.assert_array_equal(dist.mode(), dist.mode())
    y = np.linspace(-1 + 1e-9, 1 - 1e-9, 2_000_001)
    for i in range(2):  # the third mode rounds onto the bound in float32
        x = np.arctanh(y)
        density = stats.norm.logpdf(x, float(loc[0, i]), float(scale[0, i])) - np.log1p(-(y**2))
        assert float(dist.mode()[0, i]) == pytest.approx(y[np.argmax(density)], abs=1e-5)
