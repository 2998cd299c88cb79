import json

import pytest

from samplers.examples import pendulum

TINY = [
    "--total-steps",
    "1024",
    "--num-envs",
    "8",
    "--rollout-length",
    "32",
    "--seed",
    "3",
    "--eval-episodes",
    "4",
]


@pytest.mark.parametrize("bijector", pendulum.BIJECTORS)
def test_pendulum_runs_writes_its_figure_and_replays_with_ratio_one(tmp_path, bijector):
    summary = pendulum.main(
        [*TINY, "--bijector", bijector, "--out", str(tmp_path), "--no-progress"]
    )

    figure = tmp_path / "pendulum.png"
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 1024
    assert summary["iterations"] == 4
    # Before the first update of each iteration the weights are the rollout's, so
    # replaying the stored pre-images must reproduce the stored log-likelihoods.
    assert summary["replay_ratio_error"] < 1e-5
    # An episode lasts 200 steps: every return lies in [-16.3 * 200, 0].
    for name in ("deterministic_return", "random_return"):
        assert -3300 < summary[name] <= 0, name
    assert summary["final_sigma"] > 0 and summary["steps_per_second"] > 0


def test_pendulum_refuses_a_batch_that_minibatches_do_not_divide(tmp_path):
    with pytest.raises(ValueError, match=r"divisible by minibatches=8, got 3 \* 30 = 90"):
        pendulum.main(["--num-envs", "3", "--rollout-length", "30", "--out", str(tmp_path)])
