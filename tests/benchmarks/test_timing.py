"""The timing the suites share: in the loop, the floor, the bytes; nothing here times anything.

The benchmarks are not the library: every test here is in the slow tier.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import __main__ as cli
from benchmarks import flow, timing

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _per_call_afterwards():
    yield
    timing.set_timing(in_loop=False)


def _step(x, mask, action, key):
    """A step of every kind of input: floats, booleans, integers and a key."""
    noise = jax.random.normal(key, x.shape)
    value = jnp.sum(jnp.where(mask, jnp.tanh(x) * noise, 0.0), axis=-1) + action
    return value, jax.random.split(key)[0]


def _step_args():
    x = jax.random.normal(jax.random.key(0), (16, 4))
    mask = jax.random.bernoulli(jax.random.key(1), 0.5, (16, 4))
    return x, mask, jnp.arange(16, dtype=jnp.int32), jax.random.key(2)


@pytest.mark.parametrize("steps", [0, 1, 5])
def test_each_step_in_the_loop_computes_what_one_call_computes_with_its_step_folded_in(steps):
    # The loop's last step is step steps - 1 (the first call, before the loop,
    # takes the key as given): one call with that step folded into the key.
    x, mask, action, key = _step_args()
    value, next_key = timing._looped(jax.jit(_step))(steps, x, mask, action, key)
    step_key = key if steps == 0 else jax.random.fold_in(key, steps - 1)
    expected, expected_key = jax.jit(_step)(x, mask, action, step_key)
    np.testing.assert_array_equal(value, expected)
    np.testing.assert_array_equal(jax.random.key_data(next_key), jax.random.key_data(expected_key))
    if steps:  # a fresh draw: not the first call's
        first, _ = jax.jit(_step)(x, mask, action, key)
        assert not np.array_equal(value, first)


def test_a_key_array_has_the_step_folded_into_each_key():
    keys = jax.random.split(jax.random.key(3), 6).reshape(2, 3)
    folded = timing._fold_in(keys, jnp.int32(4))
    assert folded.shape == (2, 3)
    for i in range(2):
        for j in range(3):
            np.testing.assert_array_equal(
                jax.random.key_data(folded[i, j]),
                jax.random.key_data(jax.random.fold_in(keys[i, j], 4)),
            )


def test_the_floor_reads_every_input_and_writes_outputs_of_the_steps_sizes():
    args = _step_args()
    floor, floor_args = timing.floor_step(_step, args)
    outputs = floor(*floor_args)
    assert [o.shape for o in outputs] == [(16,)]  # the step's value; its key left out
    # Every input counts towards what it writes: change one element of any input.
    x, mask, action, key = args
    for changed in [(x.at[0].add(1.0), mask, action), (x, ~mask, action), (x, mask, action + 1)]:
        assert not np.array_equal(floor(*changed, key)[0], outputs[0])


def test_moved_bytes_are_the_input_and_output_arrays_without_keys():
    # x 16*4*4, mask 16*4*1, action 16*4 in; value 16*4 out.
    assert timing.moved_bytes(_step, _step_args()) == 256 + 64 + 64 + 64


def test_in_the_loop_every_implementation_and_the_floor_are_timed_with_their_memory():
    timing.set_timing(in_loop=True, bandwidth_tbs=1.0)
    args = _step_args()
    fns = {"reference": (jax.jit(_step), args), "other": (jax.jit(_step), args)}
    samples = timing.interleaved(fns, rounds=2, round_seconds=0.01)
    assert list(samples) == ["reference", "other", timing.FLOOR]
    assert all(len(s) == 2 and all(t > 0 for t, _ in s) for s in samples.values())
    assert set(samples.memory) == set(samples)
    assert samples.moved_bytes == 448
    assert samples.bandwidth_seconds == pytest.approx(448 / 1e12)
    records = timing.records(samples, batch=16)
    assert {r["implementation"] for r in records if "floor_share" in r} == set(samples)


def test_the_timing_flag_puts_a_suite_in_the_loop_and_reports_the_floor(monkeypatch, tmp_path):
    chosen = {}

    def fake_run(batches, out_dir, **options):
        chosen["in_loop"] = timing.in_loop()
        return ""

    monkeypatch.setattr("benchmarks.discrete.run", fake_run)
    cli.main(["--discrete", "--timing", "loop", "--device", "cpu", "--out", str(tmp_path)])
    assert chosen["in_loop"]
    cli.main(["--discrete", "--device", "cpu", "--out", str(tmp_path)])
    assert not chosen["in_loop"]  # per call by default on the CPU


def test_a_suite_in_the_loop_writes_the_floor_and_compiled_memory(monkeypatch, tmp_path):
    from benchmarks import beta

    cases = beta.beta_cases()[:1]
    monkeypatch.setattr(beta, "beta_cases", lambda: cases)
    timing.set_timing(in_loop=True)
    text = beta.run((8,), tmp_path, device=timing.select_device("cpu"), rounds=1)
    assert "Timed in the loop" in text and "floor, us per step" in text
    assert "## Compiled memory of the looped steps (MiB, B = 8)" in text
    records = json.loads((tmp_path / "beta.json").read_text())["timings"]
    floors = [r for r in records if r["implementation"] == timing.FLOOR]
    assert floors and all(r["moved_bytes"] > 0 for r in floors)
    assert not (tmp_path / "beta.partial.json").exists()  # the whole report replaces it


def test_a_suite_stopped_midway_keeps_the_cells_it_timed(monkeypatch, tmp_path):
    from benchmarks import beta

    time_case = beta.time_case

    def stopped_at_16(case, batch, rounds):
        if batch == 16:
            raise KeyboardInterrupt  # as `timeout -s INT` stops a run
        return time_case(case, batch, rounds)

    monkeypatch.setattr(beta, "time_case", stopped_at_16)
    with pytest.raises(KeyboardInterrupt):
        beta.run((8, 16), tmp_path, device=timing.select_device("cpu"), rounds=1)
    assert not (tmp_path / "beta.json").exists()
    partial = json.loads((tmp_path / "beta.partial.json").read_text())
    assert partial["command"] == "python -m benchmarks --beta" and partial["stopped"]
    assert partial["device_kind"] == jax.devices("cpu")[0].device_kind and partial["samplers"]
    records = partial["timings"]
    assert {r["batch"] for r in records} == {8}
    assert {r["workload"] for r in records} == {"rollout", "loss"}


def test_only_times_the_named_implementations_beside_the_reference():
    timing.set_timing(in_loop=False, only=("b",))
    args = _step_args()
    fns = {name: (jax.jit(_step), args) for name in ("a", "b", "c")}
    assert list(timing.interleaved(fns, rounds=1, round_seconds=0.001)) == ["a", "b"]
    # A table that times none of the named implementations is timed whole.
    others = {name: (jax.jit(_step), args) for name in ("x", "y")}
    assert list(timing.interleaved(others, rounds=1, round_seconds=0.001)) == ["x", "y"]


def test_cases_time_only_the_named_cases_and_refuse_a_name_that_matches_none(tmp_path, capsys):
    from benchmarks import beta

    cases = beta.beta_cases()
    timing.set_timing(in_loop=False, cases=("Box(6)", "nothing"))
    assert timing.chosen(cases) == cases[1:]
    timing.set_timing(in_loop=False, cases=("Box(3)",))
    with pytest.raises(timing.UnknownCases, match=r"'Box\(1\) in \[0, 1\]', 'Box\(6\)"):
        timing.chosen(cases)
    timing.set_timing(in_loop=False)
    assert timing.chosen(cases) == cases
    # A case name holding a comma is taken whole; parts that no name holds whole, one by one.
    flows = flow.flow_cases()
    timing.set_timing(in_loop=False, cases=("affine", " K = 1"))
    assert [case.name for case in timing.chosen(flows)] == ["affine, K = 1"]
    timing.set_timing(in_loop=False, cases=("K = 4", "spline"))
    assert [case.name for case in timing.chosen(flows)] == ["affine, K = 4", "spline(8), K = 2"]
    timing.set_timing(in_loop=False)

    common = ["--device", "cpu", "--batches", "8", "--rounds", "1", "--out", str(tmp_path)]
    cli.main(["--beta", "--cases", "Box(6)", *common])
    records = json.loads((tmp_path / "beta.json").read_text())["timings"]
    assert {r["case"] for r in records} == {"Box(6) in [-2, 2]"}
    with pytest.raises(SystemExit):
        cli.main(["--beta", "--cases", "Box(3)", *common])
    assert "--cases 'Box(3)' names none of this suite's cases" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["--cases", "Box(6)", *common])  # the default suite has one case
    assert "--cases is an option of --discrete, --composite" in capsys.readouterr().err


def _cell(batch, implementation, ratio, workload="loss"):
    """A timed cell as a suite's JSON holds it: the floor takes 5 us, the reference 10 us."""
    return {
        "workload": workload,
        "case": "Box(1)",
        "batch": batch,
        "implementation": implementation,
        "seconds": 1e-5 * ratio,
        "ratio": ratio,
        "low": ratio,
        "high": ratio,
        "floor_share": 0.5 / ratio,
        "bandwidth_seconds": 2e-6,
    }


def test_combine_joins_runs_and_a_later_runs_cell_replaces_an_earlier_ones(tmp_path):
    from benchmarks import combine

    first = {"timings": [_cell(8, "handwritten", 1.0), _cell(8, "samplers", 0.9)]}
    stopped = {
        "command": "python -m benchmarks --beta --batches 4,8",
        "device_kind": "TPU v5 lite",
        "samplers": "commit abc1234",
        "stopped": True,
        "timings": [_cell(4, "handwritten", 1.0)],
    }
    second = {
        "command": "python -m benchmarks --beta --batches 8,16",
        "timings": [
            _cell(8, "samplers", 0.7),
            _cell(16, "handwritten", 1.0),
            _cell(16, "samplers", 1.2),
        ],
    }
    paths = []
    for number, record in enumerate((first, stopped, second)):
        paths.append(tmp_path / f"run{number}.json")
        paths[-1].write_text(json.dumps(record))
    combine.main([str(tmp_path / "joined"), *map(str, paths), "--title", "Joined"])
    record = json.loads((tmp_path / "joined.json").read_text())
    ratios = {(c["batch"], c["implementation"]): c["ratio"] for c in record["timings"]}
    assert ratios == {
        (4, "handwritten"): 1.0,
        (8, "handwritten"): 1.0,
        (8, "samplers"): 0.7,
        (16, "handwritten"): 1.0,
        (16, "samplers"): 1.2,
    }
    assert [run["batches"] for run in record["runs"]] == [[8], [4], [8, 16]]
    text = (tmp_path / "joined.md").read_text()
    assert "| Box(1) | 8 | 10.0 (50%) | 0.70 (0.70-0.70); 71% | - | - |" in text
    assert "| Box(1) | 16 | 10.0 (50%) | 1.20 (1.20-1.20); 42% | - | - |" in text
    assert "- B = 8: a run stopped at its time limit, the cells it had timed\n" in text
    assert (
        "- B = 4: `python -m benchmarks --beta --batches 4,8`, a run stopped at its time "
        "limit, TPU v5 lite, commit abc1234\n" in text
    )
    assert "- B = 8, 16: `python -m benchmarks --beta --batches 8,16`\n" in text


def test_combine_takes_a_joined_report_and_some_workloads_of_a_run(tmp_path):
    from benchmarks import combine

    def cell(workload, batch, ratio):
        return _cell(batch, "samplers", ratio, workload)

    earlier = {"command": "first", "timings": [cell("rollout", 8, 1.1), cell("loss", 8, 0.9)]}
    later = {"command": "second", "timings": [cell("rollout", 8, 0.8), cell("loss", 8, 1.3)]}
    (tmp_path / "earlier.json").write_text(json.dumps(earlier))
    (tmp_path / "later.json").write_text(json.dumps(later))
    combine.main([str(tmp_path / "joined"), str(tmp_path / "earlier.json")])
    # The joined report, then the later run's rollout alone.
    combine.main(
        [
            str(tmp_path / "again"),
            str(tmp_path / "joined.json"),
            f"{tmp_path / 'later.json'}:rollout",
        ]
    )
    record = json.loads((tmp_path / "again.json").read_text())
    ratios = {c["workload"]: c["ratio"] for c in record["timings"]}
    assert ratios == {"rollout": 0.8, "loss": 0.9}
    assert [run["command"] for run in record["runs"]] == ["first", "second"]
    assert record["runs"][1]["workloads"] == ["rollout"]
    text = (tmp_path / "again.md").read_text()
    assert "- B = 8: `first`" in text and "- B = 8 (rollout only): `second`" in text
