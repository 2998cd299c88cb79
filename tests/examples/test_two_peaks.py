"""The two-peak bandit: its reward and best soft value against float64 quadrature, and
short SAC runs of both heads."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from scipy import integrate

from samplers.examples import two_peaks

pytestmark = pytest.mark.slow


def _reward(s, a):
    """The two bumps, written here from the docstring."""
    centre = 0.3 * s
    return sum(
        np.exp(-0.5 * ((a - centre - side) / two_peaks.WIDTH) ** 2)
        for side in (-two_peaks.SEPARATION, two_peaks.SEPARATION)
    )


def test_the_best_soft_value_is_alpha_log_the_integral_of_exp_reward_over_alpha():
    states = np.array([-1.0, -0.3, 0.0, 0.8])
    got = np.asarray(two_peaks.optimal_value(jnp.asarray(states)))
    for s, value in zip(states, got, strict=True):
        peaks = [0.3 * s - two_peaks.SEPARATION, 0.3 * s + two_peaks.SEPARATION]
        integral, _ = integrate.quad(
            lambda a, s=s: np.exp(_reward(s, a) / two_peaks.ALPHA), -1.0, 1.0, points=peaks
        )
        np.testing.assert_allclose(value, two_peaks.ALPHA * np.log(integral), rtol=1e-5)
    a = jnp.linspace(-1.0, 1.0, 101)
    np.testing.assert_allclose(
        two_peaks.reward(jnp.full(101, 0.4), a), _reward(0.4, np.asarray(a)), rtol=1e-5, atol=1e-6
    )


def test_a_short_run_of_each_head_reports_what_it_measures(capsys):
    results = two_peaks.main(["--seeds", "1", "--steps", "200"])
    assert [r["head"] for r in results] == ["normal", "flow"]
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert printed == results
    for result in results:
        assert 0.0 <= result["reward"] <= 2.0
        assert 0.0 <= result["both_peaks"] <= 0.5
        # No policy beats the best one, up to the Monte Carlo error of the estimate.
        assert result["soft_value"] <= result["optimal_soft_value"] + 0.02


def test_an_unknown_head_is_refused(capsys):
    with pytest.raises(SystemExit):
        two_peaks.main(["--heads", "normal,gaussian"])
    assert "--heads takes normal and flow, got 'normal,gaussian'" in capsys.readouterr().err
