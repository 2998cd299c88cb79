"""``python -m benchmarks``: time ``samplers`` side by side with its peers.

Every implementation runs in this one process, in interleaved rounds (a fresh
random order each round), and each is reported as the median of its per-round
ratio to the hand-written reference, with min and max. Writes
``results/results.md`` and ``results/scaling.png``.
"""

import argparse
import datetime
import math
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import samplers
from benchmarks import implementations

_QUICK = {
    "batches": (1, 4096, 65536),
    "actions": (8,),
    "rounds": 9,
    "compile_batch": 4096,
    "memory_batch": 65536,
    "repeats": 3,
}
_FULL = {**_QUICK, "batches": (1, 256, 4096, 16384, 65536), "actions": (1, 8, 64), "rounds": 15}
# The settings the entropy estimators are compared at: (mean, std) of a 1-D policy.
_ENTROPY_CASES = ((0.7, 1.3), (0.0, 4.0))
_ESTIMATORS = {
    "sample, 1 (default)": {"entropy": "sample"},
    "sample, 8": {"entropy": "sample", "entropy_points": 8},
    "quadrature, 8": {"entropy": "quadrature"},
    "quadrature, 32": {"entropy": "quadrature", "entropy_points": 32},
    "base Normal only": {"entropy": "base"},
}
_ROUND_SECONDS = 0.04  # per implementation per round, so a quick run takes a few minutes


def _inputs(batch, actions, key):
    k1, k2, k3 = jax.random.split(key, 3)
    mean_and_std = jax.random.normal(k1, (batch, 2 * actions))
    _, old, raw = implementations.handwritten_rollout(mean_and_std, k2)
    return mean_and_std, raw, old, jax.random.normal(k3, (batch,))


def _call_seconds(fn, args, calls):
    start = time.perf_counter()
    for _ in range(calls):
        jax.block_until_ready(fn(*args))
    return (time.perf_counter() - start) / calls


def _interleaved(fns, rounds):
    """Per-implementation ``(seconds per call, ratio to the first)``, one entry per round."""
    for fn, args in fns.values():
        jax.block_until_ready(fn(*args))  # compile and warm up
    reference = next(iter(fns))
    fn, args = fns[reference]
    calls = max(1, int(_ROUND_SECONDS / max(_call_seconds(fn, args, 3), 1e-7)))
    samples = {name: [] for name in fns}
    for _ in range(rounds):
        order = list(fns)
        random.shuffle(order)
        seconds = {name: _call_seconds(*fns[name], calls) for name in order}
        for name in fns:
            samples[name].append((seconds[name], seconds[name] / seconds[reference]))
    return samples


def _summary(samples):
    times = [s for s, _ in samples]
    ratios = [r for _, r in samples]
    return statistics.median(times), statistics.median(ratios), min(ratios), max(ratios)


def _workloads(impls, batch, actions, rounds):
    mean_and_std, raw, old, advantage = _inputs(batch, actions, jax.random.key(0))
    rollout, loss = {}, {}
    for impl in impls:
        random_input = impl.random_input(jax.random.key(1))
        rollout[impl.name] = (jax.jit(impl.rollout), (mean_and_std, random_input))
        if impl.loss is None:  # the floor: one draw of the noise
            loss[impl.name] = rollout[impl.name]
        else:
            loss[impl.name] = (
                jax.jit(jax.value_and_grad(impl.loss, has_aux=True)),
                (mean_and_std, raw, old, advantage, random_input),
            )
    return {"rollout": _interleaved(rollout, rounds), "loss": _interleaved(loss, rounds)}


def _compile_seconds(impls, batch, repeats):
    """Trace plus compile of the rollout and loss steps at A = 8."""
    mean_and_std, raw, old, advantage = _inputs(batch, 8, jax.random.key(0))
    results = {}
    for impl in impls:
        if impl.loss is None:
            continue
        key = impl.random_input(jax.random.key(1))
        seconds = []
        for _ in range(repeats):
            # Fresh closures so nothing is served from the compilation cache.
            rollout = jax.jit(lambda *a, f=impl.rollout: f(*a))
            loss = jax.jit(jax.value_and_grad(lambda *a, f=impl.loss: f(*a), has_aux=True))
            start = time.perf_counter()
            rollout.lower(mean_and_std, key).compile()
            loss.lower(mean_and_std, raw, old, advantage, key).compile()
            seconds.append(time.perf_counter() - start)
        results[impl.name] = statistics.median(seconds)
    return results


def _memory(impls, batch, actions=8):
    """Temporary plus output bytes of the compiled steps (XLA's memory analysis)."""
    mean_and_std, raw, old, advantage = _inputs(batch, actions, jax.random.key(0))
    results = {}
    for impl in impls:
        if impl.loss is None:
            continue
        key = impl.random_input(jax.random.key(1))
        steps = [
            jax.jit(impl.rollout).lower(mean_and_std, key).compile(),
            jax.jit(jax.value_and_grad(impl.loss, has_aux=True))
            .lower(mean_and_std, raw, old, advantage, key)
            .compile(),
        ]
        analyses = [step.memory_analysis() for step in steps]
        results[impl.name] = [a.temp_size_in_bytes + a.output_size_in_bytes for a in analyses]
    return results


def _small_batch_latency(rounds):
    """B = 1: the sampler's call against closed forms, through each call path.

    The reference computes everything a sampler call returns (action,
    log-likelihood, pre-image, entropy cost, mean, std) and advances a key
    counter, as the sampler does. The second row is the least a rollout needs:
    action and log-likelihood from a fixed key.
    """
    mean_and_std = jax.random.normal(jax.random.key(0), (1, 2 * 8))
    key = jax.random.key(1)
    head = samplers.NormalTanhSampler(nnx.Rngs(0), implementations.ENTROPY_WEIGHT)
    apply, state = samplers.functional(head)
    fns = {
        "closed form, same outputs and stream (jax.jit)": (
            jax.jit(implementations.handwritten_sampler_call),
            (mean_and_std, key, jnp.uint32(0)),
        ),
        "closed form, rollout only, fixed key (jax.jit)": (
            jax.jit(implementations.handwritten_rollout),
            (mean_and_std, key),
        ),
        "samplers.functional": (apply, (state, mean_and_std)),
        "module via nnx.jit": (nnx.jit(lambda m, x: m((), x)), (head, mean_and_std)),
    }
    return _interleaved(fns, rounds)


def _entropy_estimators(batch, rounds):
    """Loss-step cost at A = 8, and bias and spread per call for a 1-D policy."""
    mean_and_std, raw, old, advantage = _inputs(batch, 8, jax.random.key(0))
    reference = implementations.all_implementations()[0]
    fns = {"hand-written": (reference.loss, jax.random.key(1))}
    for name, options in _ESTIMATORS.items():
        _, loss, random_input = implementations.samplers_functions(**options)
        fns[name] = (loss, random_input(jax.random.key(1)))
    timed = {
        name: (
            jax.jit(jax.value_and_grad(loss, has_aux=True)),
            (mean_and_std, raw, old, advantage, rng),
        )
        for name, (loss, rng) in fns.items()
    }
    costs = _interleaved(timed, rounds)
    rows = []
    for name, options in _ESTIMATORS.items():
        row = [name, _ratio_cell(_summary(costs[name]))]
        for mean, std in _ENTROPY_CASES:
            raw_std = math.log(math.expm1(std - implementations.MIN_STD))
            params = jnp.tile(jnp.array([mean, raw_std]), (4096, 1))
            head = samplers.NormalTanhSampler(nnx.Rngs(0), 1.0, **options)
            entropy = -np.asarray(head((), params).regularization_loss, np.float64)
            row.append(f"{entropy.mean() - _float64_entropy(mean, std):+.4f} / {entropy.std():.3f}")
        rows.append(row)
    return rows


def _float64_entropy(mean, std):
    """Entropy of tanh(x), x ~ N(mean, std), by a dense float64 quadrature."""
    x = np.linspace(mean - 14 * std, mean + 14 * std, 400_001)
    density = np.exp(-0.5 * ((x - mean) / std) ** 2) / (std * math.sqrt(2 * math.pi))
    log_normal = -0.5 * ((x - mean) / std) ** 2 - math.log(std) - 0.5 * math.log(2 * math.pi)
    log_det = 2 * math.log(2.0) - 2 * np.logaddexp(x, -x)
    return -np.trapezoid(density * (log_normal - log_det), x)


def _import_seconds(repeats):
    code = "import time; t = time.perf_counter(); import samplers; print(time.perf_counter() - t)"
    runs = [
        float(
            subprocess.run(
                [sys.executable, "-c", code], capture_output=True, text=True, check=True
            ).stdout
        )
        for _ in range(repeats)
    ]
    return statistics.median(runs)


def _table(rows, header):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def _ratio_cell(summary):
    _, ratio, low, high = summary
    return f"{ratio:.2f} ({low:.2f}-{high:.2f})"


def _plot(results, actions, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for axis, workload in zip(axes, ("rollout", "loss"), strict=True):
        cells = {b: r[workload] for (b, a), r in results.items() if a == actions}
        batches = sorted(cells)
        for name in cells[batches[0]]:
            times = [_summary(cells[b][name])[0] * 1e3 for b in batches]
            style = "--" if name.startswith("floor") else "-o"
            axis.loglog(batches, times, style, label=name, markersize=4)
        axis.set(
            xlabel="batch size B",
            ylabel="ms per call (median)",
            title=f"{workload} step, A = {actions}",
        )
        axis.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def run(grid, out_dir):
    """Runs the grid and writes ``results.md`` (and the plot) under ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    impls = implementations.all_implementations()
    results = {}
    for actions in grid["actions"]:
        for batch in grid["batches"]:
            print(f"timing B={batch} A={actions}", flush=True)
            results[batch, actions] = _workloads(impls, batch, actions, grid["rounds"])
    names = [impl.name for impl in impls]
    sections = [
        "# Benchmark results",
        "",
        f"Command: `python -m benchmarks{' --full' if grid is _FULL else ''}`, "
        f"{datetime.date.today()}, {platform.machine()} with {jax.device_count()} "
        f"{jax.devices()[0].platform.upper()} device(s), {_cpu_count()} cores; "
        f"Python {platform.python_version()}, jax {jax.__version__}, flax "
        f"{_version('flax')}, distrax {_version('distrax')}, "
        f"tfp {_version('tfp-nightly')}, brax {_version('brax')}; float32.",
        "",
        "Each cell: median over interleaved rounds of time / hand-written time in the "
        "same round (min-max); below 1 is faster than the hand-written formula.",
    ]
    for workload in ("rollout", "loss"):
        header = ["B", "A", "hand-written (ms)", *names[1:]]
        rows = [
            [batch, actions, f"{_summary(cell[workload][names[0]])[0] * 1e3:.3f}"]
            + [_ratio_cell(_summary(cell[workload][name])) for name in names[1:]]
            for (batch, actions), cell in results.items()
        ]
        sections += ["", f"## {workload.capitalize()} step", "", _table(rows, header)]
    compile_batch, memory_batch = grid["compile_batch"], grid["memory_batch"]
    compile_seconds = _compile_seconds(impls, compile_batch, grid["repeats"])
    reference = compile_seconds[names[0]]
    sections += [
        "",
        f"## Trace plus compile (rollout + loss, B = {compile_batch}, A = 8)",
        "",
        _table(
            [[n, f"{s * 1e3:.0f}", f"{s / reference:.2f}"] for n, s in compile_seconds.items()],
            ["implementation", "ms (median)", "ratio"],
        ),
        "",
        f"## Compiled memory (XLA temporaries + outputs, B = {memory_batch}, A = 8)",
        "",
        _table(
            [
                [n, f"{r / 2**20:.2f}", f"{lo / 2**20:.2f}"]
                for n, (r, lo) in _memory(impls, memory_batch).items()
            ],
            ["implementation", "rollout MiB", "loss MiB"],
        ),
        "",
        "## B = 1 rollout latency",
        "",
        _table(
            [
                [n, f"{_summary(s)[0] * 1e6:.1f}", _ratio_cell(_summary(s))]
                for n, s in _small_batch_latency(grid["rounds"]).items()
            ],
            ["call path", "us per call", "ratio to the first"],
        ),
        "",
        f"## Entropy estimators (loss step at B = {memory_batch}, A = 8)",
        "",
        "Cost: loss-step time / hand-written. Bias / std: mean minus the float64 entropy, "
        "and the spread per call, over 4096 draws for a 1-D policy with (mean, std).",
        "",
        _table(
            _entropy_estimators(memory_batch, grid["rounds"]),
            ["estimator", "cost", *(f"bias / std at {case}" for case in _ENTROPY_CASES)],
        ),
        "",
        f"`import samplers`: {_import_seconds(grid['repeats']) * 1e3:.0f} ms "
        f"(median of {grid['repeats']} fresh interpreters).",
    ]
    plotted = _plot(
        results, 8 if 8 in grid["actions"] else grid["actions"][0], out_dir / "scaling.png"
    )
    if plotted:
        sections += ["", "![time per call against batch size](scaling.png)"]
    text = "\n".join(sections) + "\n"
    (out_dir / "results.md").write_text(text)
    return text


def _cpu_count():
    import os

    return len(os.sched_getaffinity(0))


def _version(package):
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="the full grid (A in 1, 8, 64)")
    parser.add_argument("--out", default=Path(__file__).parent / "results", type=Path)
    args = parser.parse_args(argv)
    print(run(_FULL if args.full else _QUICK, args.out))


if __name__ == "__main__":
    main()
