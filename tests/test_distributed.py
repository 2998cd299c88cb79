"""Scaling out: two ``jax.distributed`` processes give the one-process, four-device run.

``tests/_distributed_script.py`` runs a rollout, the replaying loss pass with its
gradient, and per-environment streams on a global batch sharded over four CPU
devices: once in one process with four devices, and once as two processes with two
devices each that join through ``jax.distributed`` on localhost (CPU collectives
through gloo). Each process starts with the same seeds and holds only its rows.
The device count is fixed when jax starts, so every run is a subprocess; the test
ends them all, also when it fails.
"""

import pathlib
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from tests._devices import REPO_ROOT, cpu_devices_environment

# Three multi-process runs: integration, in the slow tier.
pytestmark = pytest.mark.slow

DEVICES = 4
TIMEOUT_S = 300  # for all three runs together


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(out: pathlib.Path, devices: int, *arguments: str) -> subprocess.Popen:
    """Starts a run writing ``out``; its output goes to ``out`` with the suffix ``.log``."""
    with open(out.with_suffix(".log"), "w") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "tests._distributed_script", str(out), *arguments],
            cwd=REPO_ROOT,
            env=cpu_devices_environment(devices),
            stdout=log,
            stderr=subprocess.STDOUT,
        )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``{"one process": results, "process 0": ..., "process 1": ...}``, gathered arrays."""
    directory = tmp_path_factory.mktemp("distributed")
    port = str(_free_port())
    outputs = {
        "one process": directory / "single.npz",
        "process 0": directory / "process-0.npz",
        "process 1": directory / "process-1.npz",
    }
    processes = {}
    try:
        processes["one process"] = _start(outputs["one process"], DEVICES)
        for index in range(2):
            processes[f"process {index}"] = _start(
                outputs[f"process {index}"],
                DEVICES // 2,
                *("--process-id", str(index), "--num-processes", "2", "--port", port),
            )
        deadline = time.monotonic() + TIMEOUT_S
        for process in processes.values():
            process.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()
    for name, process in processes.items():
        if process.returncode != 0:
            log = outputs[name].with_suffix(".log").read_text()
            pytest.fail(f"{name} exited with {process.returncode}:\n{log[-4000:]}")
    return {name: dict(np.load(path)) for name, path in outputs.items()}


# Gradients of the parameters sum over the batch across devices; between processes
# the shards' parts are added in another order, which may move the last bits.
SUMMED_OVER_DEVICES = {"loss_pass/grad_kernel", "loss_pass/grad_bias"}


@pytest.mark.parametrize("process", ["process 0", "process 1"])
def test_two_processes_give_the_one_process_four_device_run(runs, process):
    """Rollout, replay, loss, per-environment streams bit for bit; the gradient to 1e-6."""
    expected, actual = runs["one process"], runs[process]
    assert set(actual) == set(expected)
    for name in sorted(expected):
        if name in SUMMED_OVER_DEVICES:
            scale = np.max(np.abs(expected[name]))
            np.testing.assert_allclose(
                actual[name], expected[name], rtol=1e-6, atol=1e-6 * scale, err_msg=name
            )
        else:
            np.testing.assert_array_equal(actual[name], expected[name], err_msg=name)


@pytest.mark.parametrize("run", ["one process", "process 0"])
@pytest.mark.parametrize(
    "name", ["rollout/pre_image", "per_env_first/pre_image", "per_env_second/pre_image"]
)
def test_shards_do_not_share_noise(runs, run, name):
    """Every shard holds the same inputs, yet no two draw the same pre-image anywhere."""
    blocks = runs[run][name].reshape(DEVICES, -1)
    for i in range(DEVICES):
        for j in range(i):
            assert not np.any(blocks[i] == blocks[j]), (name, i, j)


@pytest.mark.parametrize("run", ["one process", "process 0"])
def test_the_loss_pass_replays_the_rollout_and_per_env_replay_its_noise(runs, run):
    results = runs[run]
    np.testing.assert_array_equal(
        results["loss_pass/replay_log_likelihood"], results["rollout/log_likelihood"]
    )
    assert int(results["stream_count"]) == 4  # two keys for the rollout, two for the replay
    for field in ("pre_image", "log_likelihood", "regularization_loss", "next_key_data"):
        np.testing.assert_array_equal(
            results[f"per_env_replay/{field}"], results[f"per_env_first/{field}"], err_msg=field
        )
    assert np.all(np.isfinite(results["loss_pass/grad_kernel"]))
    assert np.any(results["loss_pass/grad_kernel"] != 0)
