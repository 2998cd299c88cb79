import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.scipy import stats

from samplers.testing import CrossCheckReport, cross_check

LOW = np.array([-2.0, 0.0, -0.1])
HIGH = np.array([2.0, 1.0, 0.3])
HALF_RANGE = jnp.asarray((HIGH - LOW) / 2, jnp.float32)


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


@pytest.fixture(scope="module")
def reports():
    return {
        fn.__name__: cross_check(fn, low=LOW, high=HIGH)
        for fn in (correct, forgets_half_range, log_one_minus_tanh_squared)
    }


def test_a_correct_implementation_passes(reports):
    report = reports["correct"]
    assert report.passed
    # float32 rounding of log-likelihoods down to -2e4 (std 0.1 at x = -20).
    assert report["float64"].max_abs_error < 0.02
    assert report["samplers"].max_abs_error < 0.02
    assert report["float64"].skipped == 0 and report["samplers"].skipped == 0


def test_a_missing_log_half_range_is_caught(reports):
    report = reports["forgets_half_range"]
    assert not report.passed
    # The constant offset sum(log half_range) = log 2 + log 0.5 + log 0.2, everywhere.
    offset = float(np.sum(np.log((HIGH - LOW) / 2)))
    assert report["float64"].max_abs_error == pytest.approx(abs(offset), abs=0.02)
    assert report["samplers"].max_abs_error == pytest.approx(abs(offset), abs=0.02)


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


def test_action_based_references_skip_saturated_points_and_are_not_judged(reports):
    report = reports["correct"]
    for name in ("distrax", "tfp"):
        row = report[name]
        assert row.scores == "action" and row.skipped > 0 and row.compared > 0
        assert row.compared + row.skipped == report["float64"].compared
    assert report["float64"].compared == 14 * 3 * 3


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
        ValueError, match=r"one log-likelihood per row, shape \(126,\).*got \(126, 1\)"
    ):
        cross_check(lambda x, mean, std: x[:, :1])
    with pytest.raises(ValueError, match=r"low must be < high in every dimension"):
        cross_check(correct, low=HIGH, high=LOW)
