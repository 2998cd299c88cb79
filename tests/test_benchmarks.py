"""The benchmark suite at toy sizes, so that it never rots; nothing here times anything."""

import jax

from benchmarks import __main__ as suite

_TINY = {
    "batches": (8,),
    "actions": (2,),
    "rounds": 1,
    "compile_batch": 8,
    "memory_batch": 8,
    "repeats": 1,
}


def test_suite_runs_and_writes_its_report(tmp_path):
    with jax.numpy_rank_promotion("allow"):  # TFP broadcasts ranks implicitly
        text = suite.run(_TINY, tmp_path)
    assert (tmp_path / "results.md").read_text() == text
    for heading in (
        "## Rollout step",
        "## Loss step",
        "## Trace plus compile",
        "## Compiled memory",
        "## B = 1 rollout latency",
        "## Entropy estimators",
    ):
        assert heading in text
    for name in ("samplers", "distrax", "tfp", "floor (draw alone)"):
        assert f"| {name} |" in text or f" {name} |" in text
    assert (tmp_path / "scaling.png").stat().st_size > 0
