"""What every suite shares: the device, interleaved timing, its summary, and the report's pieces.

An implementation's sample in a round is ``(seconds per call, ratio to the first
implementation's seconds in the same round)``; the rounds run the implementations
in a fresh random order each, so that drift in the machine's load reaches them
alike.
"""

import datetime
import json
import os
import platform
import random
import statistics
import subprocess
import time
from importlib import metadata
from pathlib import Path

import jax
import jax.extend.backend

FIELDS = ("seconds", "ratio", "low", "high")  # the names of a summary's values


def select_device(name=None):
    """The device to run on: JAX's default, or the first of platform ``name``.

    ``name`` is ``cpu``, ``gpu``, ``tpu`` or a platform name such as ``cuda``.

    Raises:
        ValueError: no device of that platform is available here.
    """
    if name is None:
        return jax.devices()[0]
    try:
        return jax.devices(name)[0]
    except RuntimeError:
        available = sorted(jax.extend.backend.backends())
        raise ValueError(
            f"--device {name!r}: JAX has no {name} device here; the platforms available "
            f"are {available}. Pass one of them, or install JAX's plugin for {name} "
            f"(e.g. pip install 'jax[cuda12]' for gpu)."
        ) from None


def call_seconds(fn, args, calls):
    """Mean seconds per call of ``fn(*args)`` over ``calls`` calls, each waited for."""
    start = time.perf_counter()
    for _ in range(calls):
        jax.block_until_ready(fn(*args))
    return (time.perf_counter() - start) / calls


def interleaved(fns, rounds, round_seconds=0.05):
    """Per implementation, ``(seconds per call, ratio to the first)`` for each round.

    Args:
        fns: ``{name: (fn, args)}``; the first is the reference.
        rounds: How many rounds.
        round_seconds: About how long each implementation runs per round: the
            number of calls per round is set from the reference's time.
    """
    for fn, args in fns.values():
        jax.block_until_ready(fn(*args))  # compile and warm up
    reference = next(iter(fns))
    calls = max(1, int(round_seconds / max(call_seconds(*fns[reference], 3), 1e-7)))
    samples = {name: [] for name in fns}
    for _ in range(rounds):
        order = list(fns)
        random.shuffle(order)
        seconds = {name: call_seconds(*fns[name], calls) for name in order}
        for name in fns:
            samples[name].append((seconds[name], seconds[name] / seconds[reference]))
    return samples


def jitted_gradient(loss):
    """The jitted value and gradient of ``loss``, which returns ``(value, next_random_input)``."""
    return jax.jit(jax.value_and_grad(loss, has_aux=True))


def jitted_steps(impl, rollout_inputs, loss_inputs):
    """``(rollout, loss)`` of ``impl``, each ``(fn, args)`` as :func:`interleaved` takes them.

    The rollout is jitted, the loss's value and gradient too (:func:`jitted_gradient`);
    each takes its inputs followed by the implementation's random input, made from
    ``jax.random.key(1)``. An implementation without a loss (the floor) gives its
    rollout for both.
    """
    random_input = impl.random_input(jax.random.key(1))
    rollout = (jax.jit(impl.rollout), (*rollout_inputs, random_input))
    if impl.loss is None:
        return rollout, rollout
    return rollout, (jitted_gradient(impl.loss), (*loss_inputs, random_input))


def time_steps(steps, rounds, round_seconds=0.05):
    """The rollouts, then the losses, of ``steps``, each workload in :func:`interleaved` rounds.

    Args:
        steps: ``{name: (rollout, loss)}`` as :func:`jitted_steps` gives them; the
            first is the reference.
        rounds: How many rounds.
        round_seconds: About how long each implementation runs per round.

    Returns:
        ``{"rollout": {name: samples}, "loss": {name: samples}}``.
    """
    rollout = {name: step for name, (step, _) in steps.items()}
    loss = {name: step for name, (_, step) in steps.items()}
    return {
        "rollout": interleaved(rollout, rounds, round_seconds),
        "loss": interleaved(loss, rounds, round_seconds),
    }


def summary(samples):
    """``(median seconds, median ratio, least ratio, greatest ratio)`` of the samples."""
    ratios = [r for _, r in samples]
    return (
        statistics.median(s for s, _ in samples),
        statistics.median(ratios),
        min(ratios),
        max(ratios),
    )


def ratio_cell(samples):
    """``"median (least-greatest)"`` of the samples' ratios."""
    _, ratio, low, high = summary(samples)
    return f"{ratio:.2f} ({low:.2f}-{high:.2f})"


def records(cells, **fields):
    """One JSON record per implementation of ``cells`` (``{name: samples}``)."""
    return [
        {**fields, "implementation": name, **dict(zip(FIELDS, summary(samples), strict=True))}
        for name, samples in cells.items()
    ]


def workload_tables(results, titles, label="case"):
    """One Markdown section per workload of ``results``, ``{(label, batch): {workload:
    {implementation: samples}}}``: the first implementation's milliseconds, then each
    other's ratio to it."""
    names = list(next(iter(results.values()))[next(iter(titles))])
    sections = []
    for workload, title in titles.items():
        rows = [
            [
                case,
                batch,
                f"{summary(cell[workload][names[0]])[0] * 1e3:.4f}",
                *(ratio_cell(cell[workload][n]) for n in names[1:]),
            ]
            for (case, batch), cell in results.items()
        ]
        header = [label, "B", "hand-written (ms)", *names[1:]]
        sections += ["", f"## {title}", "", table(rows, header)]
    return sections


def workload_records(results, workloads, label="case"):
    """The JSON records of ``results`` (as :func:`workload_tables` takes them)."""
    return [
        record
        for (case, batch), cell in results.items()
        for workload in workloads
        for record in records(cell[workload], workload=workload, **{label: case}, batch=batch)
    ]


def table(rows, header):
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(map(str, row)) + " |" for row in rows])


def write_report(out_dir, name, sections, record):
    """Writes ``{name}.md``, the sections a line each, and ``{name}.json``, the record.

    Returns:
        The Markdown text.
    """
    text = "\n".join(sections) + "\n"
    (out_dir / f"{name}.md").write_text(text)
    (out_dir / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
    return text


def version(package):
    """The installed version of ``package``, or ``"not installed"``."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def load_average():
    """The host's load average over 1, 5 and 15 minutes, as text."""
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def commit():
    """The commit of the library timed, and whether ``samplers/`` (but its examples) differs."""
    root = Path(__file__).parent.parent

    def git(*args):
        return subprocess.run(
            ["git", *args], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        changed = git("status", "--porcelain", "--", "samplers", ":!samplers/examples")
    except (OSError, subprocess.CalledProcessError):
        return "samplers from an unknown commit"
    return f"samplers at commit {head}" + (" with local changes" if changed else "")


class Conditions:
    """What a report says of a run: the command, device, host, load and versions.

    Made before the timing, which :meth:`stop` ends; :meth:`line` and
    :meth:`record` then give the report's paragraph and the JSON's fields.
    """

    def __init__(self, command, device):
        self.command, self.device = command, device
        self.commit, self.load_before = commit(), load_average()
        self.started, self.load_after, self.minutes = time.perf_counter(), None, None

    def stop(self):
        """Marks the end of the timing: the load average after it, and its minutes."""
        self.load_after = load_average()
        self.minutes = (time.perf_counter() - self.started) / 60

    def line(self):
        """``Command: ..., date. Device: ...``: the report's paragraph of conditions."""
        device = self.device
        return (
            f"Command: `{self.command}`, {datetime.date.today()}. Device: {device.device_kind} "
            f"(platform {device.platform}); host {platform.machine()} with "
            f"{len(os.sched_getaffinity(0))} cores, load average (1, 5, 15 min) "
            f"{self.load_before} before and {self.load_after} after the {self.minutes:.1f} "
            f"minutes of timing. Python {platform.python_version()}, jax {jax.__version__}, "
            f"flax {version('flax')}, distrax {version('distrax')}, {self.commit}; float32."
        )

    def record(self, rounds):
        """The JSON record's fields of the conditions."""
        return {
            "command": self.command,
            "device_kind": self.device.device_kind,
            "platform": self.device.platform,
            "jax": jax.__version__,
            "samplers": self.commit,
            "load_average": {"before": self.load_before, "after": self.load_after},
            "rounds": rounds,
        }
