"""The SAC drop-in benchmark: its actor-loss gradient check, and a tiny run of each ``--dist``.

The benchmarks are not the library: every test here is in the slow tier.
"""

import json
import math

import pytest

from benchmarks import sac_drop_in as sac

pytestmark = pytest.mark.slow

# mean(log pi) and its gradients are means of 256 float32 terms; against the float64
# pathwise values they measured at most 4e-7 relative (about 3 float32 ulps) and
# 9e-7 absolute (d/dlog_std at "wide", whose terms reach 30). 2e-6 relative, 16
# ulps, keeps a margin of 5 for another summation order; 1e-7 absolute covers the
# value near zero at "moderate" (-0.027). Scoring the rounded action instead of its
# pre-image misses by 0.13 relative at "wide", and gives -399 for 2 at "saturated".
RTOL, ATOL = 2e-6, 1e-7
QUANTITIES = ("d_mean", "d_log_std", "value")
# The fraction of float32 actions that are exactly +-1 at each setting.
SATURATED = {"saturated": (1.0, 1.0), "wide": (0.01, 0.2), "moderate": (0.0, 0.0)}


@pytest.mark.parametrize("setting", list(sac.GRADIENT_SETTINGS))
@pytest.mark.parametrize("dist", ["samplers-pre-image", "hand-written"])
def test_log_prob_gradient_is_the_float64_pathwise_gradient(dist, setting):
    result = sac.log_prob_gradients(dist, *sac.GRADIENT_SETTINGS[setting])

    low, high = SATURATED[setting]
    assert low <= result["saturated"] <= high
    for name in QUANTITIES:
        assert result[name] == pytest.approx(result[f"reference_{name}"], rel=RTOL, abs=ATOL), name


@pytest.mark.parametrize("setting", list(sac.GRADIENT_SETTINGS))
def test_sample_then_log_prob_gives_the_gradient_of_sample_with_pre_image(setting):
    # A user's `a = dist.sample(seed=k); dist.log_prob(a)` must score the sample
    # it drew as `sample_with_pre_image` does, saturated or not.
    idiom = sac.log_prob_gradients("samplers", *sac.GRADIENT_SETTINGS[setting])
    pre_image = sac.log_prob_gradients("samplers-pre-image", *sac.GRADIENT_SETTINGS[setting])

    for name in QUANTITIES:
        assert idiom[name] == pytest.approx(pre_image[name], rel=RTOL, abs=ATOL), name


@pytest.mark.parametrize("log_std", [sac.LOG_STD_MAX, 3.0, sac.LOG_STD_MIN])
def test_log_prob_gradients_refuses_a_log_std_on_or_beyond_the_clip(log_std):
    with pytest.raises(ValueError, match=r"log_std must lie strictly inside \(-20.0, 2.0\)"):
        sac.log_prob_gradients("hand-written", 0.0, log_std)


@pytest.mark.parametrize("dist", sac.DISTS)
def test_tiny_training_writes_finite_results(tmp_path, dist):
    out = tmp_path / "results.json"
    out.write_text(json.dumps({"other": 1}))
    steps = ["--total-steps", "400", "--warmup-steps", "200", "--eval-episodes", "4"]
    entry = sac.main(["--dist", dist, "--seeds", "0", "1", *steps, "--out", str(out)])

    written = json.loads(out.read_text())
    assert written == {"other": 1, dist: entry}
    assert entry["config"]["total_steps"] == 400 and [r["seed"] for r in entry["runs"]] == [0, 1]
    for run in entry["runs"]:
        assert run["wall_s"] > 0 and len(run["curve_steps"]) == len(run["curve_returns"])
        if dist == "distrax" and run["first_nonfinite_step"] is not None:
            # distrax's log_prob of a saturated sample is NaN, and so is all that follows.
            assert run["return"] is None
            continue
        assert run["first_nonfinite_step"] is None
        # An episode lasts 200 steps: every return lies in [-16.3 * 200, 0].
        assert -3300 < run["return"] <= 0
        assert math.isfinite(run["alpha"]) and 0 <= run["saturated_fraction_max"] <= 1


def test_gradients_flag_prints_and_writes_the_table(tmp_path, capsys):
    out = tmp_path / "results.json"
    table = sac.main(["--gradients", "--out", str(out)])

    assert len(table) == len(sac.DISTS) * len(sac.GRADIENT_SETTINGS)
    assert json.loads(out.read_text()) == {"gradients": table}
    assert capsys.readouterr().out.count("\n") == len(table) + 1
