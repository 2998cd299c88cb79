import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.scipy import stats

from samplers.testing import CrossCheckReport, cross_check

LOW = np.array([-2.0, 0.0, -0.1])
HIGH = np.array([2.0, 1.0, 0.3])
HALF_RANGE = jnp.asarray((HIGH - LOW) / 2, jnp.float32)
N = 18 * 3 * 3  # pre-images x means x stds


def _log_half_range(x):
    return jnp.log(jnp.broadcast_to(HALF_RANGE, x.shape))


def _stable_log_sech2(x):
    return 2 * (jnp.log(2.0) - x - jax.nn.softplus(-2 * x))


def correct(x, mean, std):
    return jnp.sum(stats.norm.logpdf(x, mean, std) - _stable_log_sech2(x) - _log_half_range(x), -1)


def forgets_half_range(x, mean, std):
    return jnp.sum(stats.norm.logpdf(x, mean, std) - _stable_log_sech2(x), -1)


def log_one_minus_tanh_squared(x, mean, std):
    log_det = jnp.log(1 - jnp.tanh(x) ** 2) + _log_half_range(x)
    return jnp.sum(stats.norm.logpdf(x, mean, std) - log_det, -1)


def _float64(x, mean, std, *, low=LOW, high=HIGH, half_range=True):
    """The change of variables in NumPy float64, at the float32 inputs and bounds given."""
    x, mean, std = (np.asarray(a, np.float64) for a in (x, mean, std))
    low, high = (np.asarray(b, np.float32).astype(np.float64) for b in (low, high))
    log_normal = -0.5 * ((x - mean) / std) ** 2 - np.log(std) - 0.5 * np.log(2 * np.pi)
    log_det = 2 * np.log(2.0) - 2 * np.logaddexp(x, -x)
    if half_range:
        log_det = log_det + np.log(np.broadcast_to((high - low) / 2, x.shape))
    return np.sum(log_normal - log_det, -1)


@pytest.fixture(scope="module")
def reports():
    return {
        fn.__name__: cross_check(fn, low=LOW, high=HIGH)
        for fn in (correct, forgets_half_range, log_one_minus_tanh_squared)
    }


def test_a_correct_implementation_passes(reports):
    report = reports["correct"]
    assert report.passed
    assert report["float64"].skipped == 0 and report["samplers"].skipped == 0
    # Only float32 rounding, of log-likelihoods down to -1.5e8 (std 0.1 at x = -1e3).
    assert cross_check(correct, low=LOW, high=HIGH, atol=1e-4, rtol=1e-6).passed


@pytest.mark.parametrize("bounds", ["vector", "scalar", "none"])
def test_a_float64_exact_implementation_passes_at_one_float32_rounding(bounds):
    """Evaluated in float64 at the float32 inputs it receives and rounded once to
    float32, a log-likelihood is within 2**-24 relative of the reference."""
    low, high = {"vector": (LOW, HIGH), "scalar": (-0.1, 0.3), "none": (-1.0, 1.0)}[bounds]

    def exact(x, mean, std):
        return jnp.asarray(_float64(x, mean, std, low=low, high=high).astype(np.float32))

    given = {} if bounds == "none" else {"low": low, "high": high}
    assert cross_check(exact, **given, atol=0.0, rtol=1e-7).passed


def test_a_missing_log_half_range_is_caught(reports):
    assert not reports["forgets_half_range"].passed
    # In float64 the error is the constant sum(log half_range) = log 2 + log 0.5 + log 0.2.
    offset = float(np.sum(np.log((np.float32(HIGH) - np.float32(LOW)) / 2)))

    def forgets_half_range_float64(x, mean, std):
        return _float64(x, mean, std, half_range=False)

    report = cross_check(forgets_half_range_float64, low=LOW, high=HIGH)
    assert not report.passed
    assert report["float64"].max_abs_error == pytest.approx(abs(offset), abs=1e-6)


def test_log_one_minus_tanh_squared_is_caught_where_tanh_saturates(reports):
    report = reports["log_one_minus_tanh_squared"]
    assert not report.passed
    worst = report["float64"]
    assert worst.max_abs_error == np.inf and abs(worst.pre_image) >= 8.0


def test_a_missing_half_range_goes_unnoticed_on_minus_one_one():
    # The reason to pass the environment's bounds: log(1) = 0.
    def tanh_only(x, mean, std):
        return jnp.sum(stats.norm.logpdf(x, mean, std) - _stable_log_sech2(x), -1)

    assert cross_check(tanh_only).passed


def test_the_grid_reaches_1e3_in_every_dimension_in_another_order_and_in_float32():
    seen = {}

    def spy(x, mean, std):
        seen.update(x=np.asarray(x), mean=np.asarray(mean), std=np.asarray(std))
        return correct(x, mean, std)

    cross_check(spy, low=LOW, high=HIGH)
    x, mean, std = seen["x"], seen["mean"], seen["std"]
    assert x.shape == mean.shape == std.shape == (N, 3)
    assert x.dtype == mean.dtype == std.dtype == np.float32
    for d in range(3):
        assert {-1e3, -50.0, 50.0, 1e3} <= set(x[:, d].tolist())
        points = np.stack([x[:, d], mean[:, d], std[:, d]], -1)
        assert len(np.unique(points, axis=0)) == N  # the whole grid
    for d in range(2):  # neighbouring dimensions differ in all three, in every row
        for a in (x, mean, std):
            assert np.all(a[:, d] != a[:, d + 1])


def test_a_log_det_clipped_at_30_is_caught():
    """Right up to |x| = 30 and wrong beyond, where the grid reaches 50 and 1e3."""

    def clipped(x, mean, std):
        log_det = _stable_log_sech2(jnp.clip(x, -30.0, 30.0)) + _log_half_range(x)
        return jnp.sum(stats.norm.logpdf(x, mean, std) - log_det, -1)

    report = cross_check(clipped, low=LOW, high=HIGH)
    assert not report.passed and abs(report["float64"].pre_image) >= 50.0


@pytest.mark.parametrize("bounds", ["vector", "none"])
def test_a_function_that_mixes_dimensions_or_averages_them_is_caught(bounds):
    given = {"low": LOW, "high": HIGH} if bounds == "vector" else {}
    half_range = _log_half_range if bounds == "vector" else jnp.zeros_like

    def right(x, mean, std):
        return stats.norm.logpdf(x, mean, std) - _stable_log_sech2(x) - half_range(x)

    assert cross_check(lambda x, m, s: jnp.sum(right(x, m, s), -1), **given).passed
    assert not cross_check(lambda x, m, s: jnp.sum(right(x, m[:, ::-1], s), -1), **given).passed
    assert not cross_check(lambda x, m, s: jnp.mean(right(x, m, s), -1), **given).passed


class _Seen(Exception):
    """Raised by a spy once it has seen its input, before the references are computed."""


def test_action_dim_defaults_to_three_or_the_length_of_the_bounds():
    shapes = []

    def spy(x, mean, std):
        shapes.append(x.shape)
        raise _Seen

    for options in (
        {},
        {"low": -2.0, "high": 2.0},
        {"low": LOW[:2], "high": HIGH[:2]},
        {"action_dim": 1},
        {"low": -2.0, "high": 2.0, "action_dim": 5},
    ):
        with pytest.raises(_Seen):
            cross_check(spy, **options)
    assert shapes == [(N, 3), (N, 3), (N, 2), (N, 1), (N, 5)]


def test_action_based_references_skip_saturated_points_and_are_not_judged(reports):
    report = reports["correct"]
    for name in ("distrax", "tfp"):
        row = report[name]
        assert row.scores == "action" and row.skipped > 0 and row.compared > 0
        assert row.compared + row.skipped == report["float64"].compared
    assert report["float64"].compared == N


def test_the_table_names_each_reference_and_the_verdict(reports):
    text = str(reports["forgets_half_range"])
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["reference", "scores", "max"]
    assert [line.split()[0] for line in lines[2:6]] == ["float64", "samplers", "distrax", "tfp"]
    assert lines[-1].startswith("FAILED against float64")
    assert str(reports["correct"]).splitlines()[-1].startswith("PASSED")
    assert isinstance(reports["correct"], CrossCheckReport)
    with pytest.raises(KeyError, match=r"no reference 'torch'"):
        reports["correct"]["torch"]


def test_refuses_bad_arguments():
    with pytest.raises(ValueError, match=r"pass both low and high or neither"):
        cross_check(correct, low=LOW)
    with pytest.raises(
        ValueError,
        match=r"one log-likelihood per row, shape \(162,\) for inputs of shape \(162, 3\), "
        r"got \(162, 1\)",
    ):
        cross_check(lambda x, mean, std: x[:, :1])
    with pytest.raises(ValueError, match=r"low must be < high in every dimension"):
        cross_check(correct, low=HIGH, high=LOW)
    with pytest.raises(
        ValueError, match=r"action_dim must be the length of the bounds, 3, got 2; drop it"
    ):
        cross_check(correct, low=LOW, high=HIGH, action_dim=2)
    with pytest.raises(TypeError, match=r"action_dim must be a positive integer, got 1.5"):
        cross_check(correct, action_dim=1.5)
