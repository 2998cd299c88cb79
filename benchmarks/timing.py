"""What every suite shares: the device, interleaved timing, its summary, and the report's pieces.

An implementation's sample in a round is ``(seconds, ratio to the first
implementation's seconds in the same round)``; the rounds run the implementations
in a fresh random order each, so that drift in the machine's load reaches them
alike.

Two ways to time a step (:func:`set_timing`):

- **per call** (the default on the CPU): seconds per jitted call, each waited for.
  On an accelerator a call also pays its dispatch (about 0.56 ms on a TPU v5e,
  whatever it computes), which hides the kernel at small and medium batches.
- **in the loop** (the default on an accelerator): seconds per step of ``n`` steps
  run inside one compiled ``lax.fori_loop``, as a training loop runs them. Each
  step's inputs take in a scalar of the previous step's outputs (``x + 1e-30 s``,
  a data dependency that leaves the values as they are), so nothing is hoisted out
  of the loop or cached, and the previous outputs are the loop's carry, so each is
  computed in full. Its PRNG keys have the step's index folded in, so each step
  draws afresh, as a training loop's advancing key does, and a round runs at
  least 16 steps: a sampler whose cost depends on its draws (the Gamma's
  rejection loop under a Beta, which runs until the batch's slowest element is
  done) is timed over many draws, not one. The time of the same program with no
  steps (one call's dispatch and first step) is taken off. Beside the
  implementations, the same rounds time the **floor**: a step that only reads the
  reference's inputs and writes outputs of its outputs' sizes, in the same loop,
  next to the bytes it moves over the device's memory bandwidth. The looped
  programs' compiled memory (XLA's temporaries plus outputs) is reported too.
"""

import concurrent.futures
import contextlib
import datetime
import json
import math
import os
import platform
import random
import statistics
import subprocess
import time
from importlib import metadata
from pathlib import Path
from typing import NamedTuple

import jax
import jax.extend.backend
import jax.numpy as jnp

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


FLOOR = "floor (reads the inputs, writes the outputs)"
# The memory bandwidth of the device kinds measured here, terabytes per second.
BANDWIDTH_TBS = {"TPU v5 lite": 0.819}
_MAX_STEPS = 1 << 20
_MIN_STEPS = 16  # in the loop: a step's draws vary its cost (a rejection loop's)


class _Timing(NamedTuple):
    in_loop: bool = False
    bandwidth_tbs: float | None = None  # None: the device's from BANDWIDTH_TBS, if known
    only: tuple[str, ...] | None = None  # the implementations timed beside the reference
    cases: tuple[str, ...] | None = None  # parts of the names of the cases timed


_timing = _Timing()


def set_timing(*, in_loop, bandwidth_tbs=None, only=None, cases=None):
    """Chooses how :func:`interleaved` times a step: per call, or in the loop.

    Args:
        in_loop: Time steps inside one compiled loop (see the module docstring).
        bandwidth_tbs: The device's memory bandwidth in TB/s, for the bytes the
            floor moves; by default :data:`BANDWIDTH_TBS`'s figure for the device.
        only: If given, the names of the implementations to time beside each
            table's reference (the first), which is always timed; None times all. A
            table that times none of these names (the estimators, say) is timed whole.
        cases: If given, a suite times only the cases whose names contain one of
            these strings (:func:`chosen`); None times all.
    """
    global _timing
    only, cases = (None if names is None else tuple(names) for names in (only, cases))
    _timing = _Timing(in_loop, bandwidth_tbs, only, cases)


class UnknownCases(ValueError):
    """:func:`set_timing`'s ``cases`` name none of a suite's cases."""


def chosen(cases):
    """The cases (objects with a ``name``) that :func:`set_timing`'s ``cases`` name.

    Raises:
        UnknownCases: they name none of ``cases``.
    """
    if _timing.cases is None:
        return list(cases)
    # A name with a comma ("affine, K = 1") is taken whole where a case's name holds it.
    whole = ",".join(_timing.cases)
    parts = (whole,) if any(whole in case.name for case in cases) else _timing.cases
    picked = [case for case in cases if any(part in case.name for part in parts)]
    if not picked:
        names = ", ".join(repr(case.name) for case in cases)
        raise UnknownCases(
            f"--cases {','.join(_timing.cases)!r} names none of this suite's cases: {names}; "
            "give part of one of these names"
        )
    return picked


def in_loop():
    """Whether :func:`interleaved` times steps in the loop."""
    return _timing.in_loop


@contextlib.contextmanager
def per_call():
    """Within the block, :func:`interleaved` times per call (a latency table)."""
    global _timing
    saved, _timing = _timing, _timing._replace(in_loop=False)
    try:
        yield
    finally:
        _timing = saved


class Samples(dict):
    """``{implementation: [(seconds, ratio), ...]}`` of :func:`interleaved`'s rounds.

    In the loop it also holds ``memory`` (``{implementation: compiled bytes}``) and
    ``moved_bytes`` (the bytes of the reference step's inputs and outputs).
    """

    memory: dict
    moved_bytes: int | None = None
    bandwidth_seconds: float | None = None  # moved_bytes over the bandwidth, if known

    def __init__(self, samples, memory=None, moved_bytes=None, bandwidth_seconds=None):
        super().__init__(samples)
        self.memory, self.moved_bytes = memory or {}, moved_bytes
        self.bandwidth_seconds = bandwidth_seconds


def interleaved(fns, rounds, round_seconds=0.05):
    """Per implementation, ``(seconds, ratio to the first)`` for each round.

    Per call or per step in the loop, as :func:`set_timing` chose; in the loop the
    :data:`FLOOR` is timed beside the implementations.

    Args:
        fns: ``{name: (fn, args)}``; the first is the reference.
        rounds: How many rounds.
        round_seconds: About how long each implementation runs per round: the
            number of calls (or of steps in the loop) is set from the reference's time.
    """
    reference, *others = fns
    if _timing.only is not None and set(others) & set(_timing.only):
        fns = {n: f for n, f in fns.items() if n == reference or n in _timing.only}
    if _timing.in_loop:
        return _interleaved_in_loop(fns, rounds, round_seconds)
    for fn, args in fns.values():
        jax.block_until_ready(fn(*args))  # compile and warm up
    calls = max(1, int(round_seconds / max(call_seconds(*fns[reference], 3), 1e-7)))
    return Samples(
        _rounds(
            {n: lambda f=f, a=a: call_seconds(f, a, calls) for n, (f, a) in fns.items()}, rounds
        )
    )


def _rounds(timers, rounds):
    """``{name: [(seconds, ratio to the first), ...]}``, each round in a fresh order."""
    reference = next(iter(timers))
    samples = {name: [] for name in timers}
    for _ in range(rounds):
        order = list(timers)
        random.shuffle(order)
        seconds = {name: timers[name]() for name in order}
        for name in timers:
            samples[name].append((seconds[name], seconds[name] / seconds[reference]))
    return samples


def _is_key(x):
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _arrays(tree):
    """The non-key array leaves of ``tree``."""
    return [x for x in jax.tree.leaves(tree) if not _is_key(x)]


def _fold_in(keys, step):
    """Every key of the key array ``keys``, any shape, with ``step`` folded in."""
    flat = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys.reshape(-1), step)
    return flat.reshape(keys.shape)


def _depending(args, out, step):
    """``args`` taking in a scalar of ``out`` without changing their values, and
    their PRNG keys with the loop's ``step`` folded in (fresh draws each step)."""
    s = sum(jnp.ravel(x)[0].astype(jnp.float32) for x in _arrays(out) if x.size)
    never = s > 3e38  # false for every output a step gives, which XLA cannot know

    def depend(x):
        x = jnp.asarray(x)
        if _is_key(x):
            return _fold_in(x, step)
        if jnp.issubdtype(x.dtype, jnp.inexact):
            return x + (1e-30 * s).astype(x.dtype)
        if x.dtype == jnp.bool_:
            return x | never
        return x | never.astype(x.dtype)

    return jax.tree.map(depend, args)


def _looped(fn):
    """``run(steps, *args)``: ``fn`` applied ``steps + 1`` times in one program, each
    step's inputs depending on the previous step's outputs and its random draws fresh."""

    def run(steps, *args):
        return jax.lax.fori_loop(0, steps, lambda i, out: fn(*_depending(args, out, i)), fn(*args))

    return jax.jit(run)


def floor_step(fn, args):
    """A step that reads every input array of ``fn(*args)`` once and writes arrays of
    the sizes of its outputs, computing nothing else (PRNG keys left out)."""
    outputs = [(x.shape, x.dtype) for x in _arrays(jax.eval_shape(fn, *args))]

    def floor(*args):
        total = sum(jnp.sum(x, dtype=jnp.float32) for x in _arrays(args))
        return tuple(jnp.full(shape, total, dtype) for shape, dtype in outputs)

    return jax.jit(floor), args


def moved_bytes(fn, args):
    """The bytes of the input and output arrays of ``fn(*args)`` (PRNG keys left out)."""
    arrays = _arrays(args) + _arrays(jax.eval_shape(fn, *args))
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in arrays)


def bandwidth_tbs(device):
    """The memory bandwidth of ``device`` in TB/s: :func:`set_timing`'s, else
    :data:`BANDWIDTH_TBS`'s, else None."""
    return _timing.bandwidth_tbs or BANDWIDTH_TBS.get(device.device_kind)


def _interleaved_in_loop(fns, rounds, round_seconds):
    reference = next(iter(fns))
    fns = {**fns, FLOOR: floor_step(*fns[reference])}
    lowered = {name: _looped(fn).lower(jnp.int32(0), *args) for name, (fn, args) in fns.items()}
    # XLA compiles outside the GIL: the host's cores compile the programs side by side.
    with concurrent.futures.ThreadPoolExecutor(min(len(lowered), os.cpu_count() or 1)) as pool:
        compiled = dict(
            zip(lowered, pool.map(lambda low: low.compile(), lowered.values()), strict=True)
        )
    programs, memory = {}, {}
    for name, (_, args) in fns.items():
        analysis = compiled[name].memory_analysis()
        if analysis is not None:
            memory[name] = analysis.temp_size_in_bytes + analysis.output_size_in_bytes
        programs[name] = (compiled[name], args, [])

    def seconds(name, steps):
        compiled, args, _ = programs[name]
        start = time.perf_counter()
        jax.block_until_ready(compiled(jnp.int32(steps), *args))
        return time.perf_counter() - start

    for name, (_, _, base) in programs.items():  # warm up, then the cost of no steps
        seconds(name, 1)
        base.append(statistics.median(seconds(name, 0) for _ in range(5)))
    steps = 1
    while steps < _MAX_STEPS and seconds(reference, steps) < round_seconds / 4:
        steps *= 4
    per_step = max(seconds(reference, steps) - programs[reference][2][0], 1e-9) / steps
    steps = int(min(max(steps, round_seconds / per_step, _MIN_STEPS), _MAX_STEPS))

    def timer(name):
        return lambda: max(seconds(name, steps) - programs[name][2][0], 0.0) / steps

    samples = _rounds({name: timer(name) for name in programs}, rounds)
    moved = moved_bytes(*fns[reference])
    tbs = bandwidth_tbs(jax.config.jax_default_device or jax.devices()[0])
    return Samples(samples, memory, moved, None if tbs is None else moved / (tbs * 1e12))


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
    """One JSON record per implementation of ``cells`` (``{name: samples}``); in the
    loop with its compiled bytes and share of the floor, and the floor's bytes moved."""
    found = []
    for name, samples in cells.items():
        record = {**fields, "implementation": name}
        record.update(zip(FIELDS, summary(samples), strict=True))
        if isinstance(cells, Samples) and FLOOR in cells:
            record["floor_share"] = summary(cells[FLOOR])[0] / summary(samples)[0]
            record["compiled_bytes"] = cells.memory.get(name)
            if name == FLOOR:
                record["moved_bytes"] = cells.moved_bytes
                record["bandwidth_seconds"] = cells.bandwidth_seconds
        found.append(record)
    return found


def time_header():
    """The header of the reference's time column: per step in the loop, else per call."""
    return "us per step (share of the floor)" if _timing.in_loop else "ms per call"


def row_cells(samples, names):
    """The cells of one row: the reference's time, then each other of ``names``'s ratio
    to it; in the loop each with its share of the floor, then the floor's time and the
    bytes it moves over the bandwidth, in microseconds."""
    seconds = summary(samples[names[0]])[0]
    if FLOOR not in samples:
        return [f"{seconds * 1e3:.4f}", *(ratio_cell(samples[n]) for n in names[1:])]
    floor = summary(samples[FLOOR])[0]

    def share(name):
        return f"{floor / summary(samples[name])[0]:.0%}"

    bandwidth = samples.bandwidth_seconds
    return [
        f"{seconds * 1e6:.1f} ({share(names[0])})",
        *(f"{ratio_cell(samples[n])}; {share(n)}" for n in names[1:] if n != FLOOR),
        f"{floor * 1e6:.1f}",
        "-" if bandwidth is None else f"{bandwidth * 1e6:.1f}",
    ]


def row_header(names):
    """The header of :func:`row_cells`'s cells for ``names``."""
    header = [f"{names[0]}, {time_header()}", *(n for n in names[1:] if n != FLOOR)]
    if _timing.in_loop:
        header += ["floor, us per step", "bytes / bandwidth, us"]
    return header


def loop_note():
    """The report's sentence on how the steps were timed."""
    if not _timing.in_loop:
        return (
            "Timed per call: each jitted call waited for, its dispatch included "
            "(`benchmarks/timing.py`)."
        )
    return (
        "Timed in the loop: each step inside one compiled `lax.fori_loop`, its inputs "
        "depending on the previous step's outputs, the cost of the same program with no "
        "steps taken off (`benchmarks/timing.py`). A ratio cell is followed by the share "
        "of the floor: the floor's time over this implementation's. The floor reads the "
        "reference step's inputs and writes outputs of its outputs' sizes in the same "
        "loop; bytes / bandwidth is those bytes over the device's memory bandwidth."
    )


def workload_tables(results, titles, label="case"):
    """One Markdown section per workload of ``results``, ``{(label, batch): {workload:
    {implementation: samples}}}``: the first implementation's time, then each other's
    ratio to it (:func:`row_cells`); in the loop, then the compiled memory at the
    largest batch."""
    names = list(next(iter(results.values()))[next(iter(titles))])
    sections = ["", loop_note()]
    for workload, title in titles.items():
        rows = [
            [case, batch, *row_cells(cell[workload], names)]
            for (case, batch), cell in results.items()
        ]
        sections += ["", f"## {title}", "", table(rows, [label, "B", *row_header(names)])]
    if _timing.in_loop:
        largest = max(batch for _, batch in results)
        rows = [
            [case, workload, *(_mebibytes(cell[workload].memory.get(n)) for n in names)]
            for (case, batch), cell in results.items()
            if batch == largest
            for workload in titles
        ]
        sections += [
            "",
            f"## Compiled memory of the looped steps (MiB, B = {largest})",
            "",
            "XLA's temporaries plus outputs of each looped program.",
            "",
            table(rows, [label, "workload", *names]),
        ]
    return sections


def workload_records(results, workloads, label="case"):
    """The JSON records of ``results`` (as :func:`workload_tables` takes them)."""
    return [
        record
        for (case, batch), cell in results.items()
        for workload in workloads
        for record in records(cell[workload], workload=workload, **{label: case}, batch=batch)
    ]


def save_partial(out_dir, name, results, workloads, conditions, label="case"):
    """Writes the cells timed so far to ``{name}.partial.json``, as
    :func:`workload_records` gives them, with the run's command, device and commit
    (``conditions``, a :class:`Conditions`): a run stopped at a time limit keeps them.
    :func:`write_report` removes the file once the whole report is written."""
    record = {
        **conditions.identity(),
        "stopped": True,  # until the whole report replaces the file
        "timings": workload_records(results, workloads, label),
    }
    (Path(out_dir) / f"{name}.partial.json").write_text(json.dumps(record, indent=1) + "\n")


def _mebibytes(size):
    return "-" if size is None else f"{size / 2**20:.2f}"


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
    (out_dir / f"{name}.partial.json").unlink(missing_ok=True)
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

    def identity(self):
        """The run's command, device and commit: the fields a stopped run's partial
        report records too."""
        return {
            "command": self.command,
            "device_kind": self.device.device_kind,
            "samplers": self.commit,
        }

    def record(self, rounds):
        """The JSON record's fields of the conditions."""
        return {
            **self.identity(),
            "platform": self.device.platform,
            "jax": jax.__version__,
            "load_average": {"before": self.load_before, "after": self.load_after},
            "rounds": rounds,
        }
