"""``python -m benchmarks``: the squashed-Normal head side by side with its peers.

Every implementation (``benchmarks/implementations.py``) runs in this one process,
in interleaved rounds (a fresh random order each round), and each is reported as
the median of its per-round ratio to the hand-written reference, with min and max.
Runs on JAX's default device unless ``--device`` names another. Writes
``results/results.md``, ``results/scaling.png`` and the raw medians in
``results/results.json``.
"""

import datetime
import math
import os
import platform
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
from benchmarks import bandwidth, implementations, timing

# The grids of ``python -m benchmarks``, ``--full`` and ``--large``: batch and action
# sizes, rounds, and the sizes of the extra sections.
QUICK = {
    "batches": (1, 4096, 65536),
    "actions": (8,),
    "rounds": 9,
    "compile_batch": 4096,
    "memory_batch": 65536,
    "repeats": 3,
}
FULL = {**QUICK, "batches": (1, 256, 4096, 16384, 65536), "actions": (1, 8, 64), "rounds": 15}
# Up to B = 2**20, for accelerators; the memory analysis at the largest size.
LARGE = {**QUICK, "batches": (1, 2**12, 2**16, 2**18, 2**20), "memory_batch": 2**20}
_WORKLOADS = ("rollout", "loss", "actor")
_SATURATION_SHIFT = 12.0  # added to the means: |pre-tanh| >= 10, tanh rounds to 1
# The settings the entropy estimators are compared at: (mean, std) of a 1-D policy.
_ENTROPY_CASES = ((0.7, 1.3), (0.0, 4.0))
_ESTIMATORS = {
    "sample, 1 (default)": {"entropy": "sample"},
    "sample, 8": {"entropy": ("sample", 8)},
    "quadrature, 8": {"entropy": "quadrature"},
    "quadrature, 32": {"entropy": ("quadrature", 32)},
    "exact": {"entropy": "exact"},
    "base Normal only": {"entropy": "base"},
}
_ROUND_SECONDS = 0.04  # per implementation per round, so a quick run takes a few minutes


def _inputs(batch, actions, key):
    k1, k2, k3 = jax.random.split(key, 3)
    mean_and_std = jax.random.normal(k1, (batch, 2 * actions))
    _, old, raw = implementations.handwritten_rollout(mean_and_std, k2)
    return mean_and_std, raw, old, jax.random.normal(k3, (batch,))


def _actor_step(step):
    """The jitted actor step: its value and gradient, or the floor's draw alone."""
    if not step.differentiable:
        return jax.jit(step.step)
    return timing.jitted_gradient(step.step)


def _workloads(impls, actor_steps, batch, actions, rounds):
    inputs = _inputs(batch, actions, jax.random.key(0))
    mean_and_std = inputs[0]
    steps = {impl.name: timing.jitted_steps(impl, (mean_and_std,), inputs) for impl in impls}
    actor = {
        step.name: (_actor_step(step), (mean_and_std, step.random_input(jax.random.key(1))))
        for step in actor_steps
    }
    return {
        **timing.time_steps(steps, rounds, _ROUND_SECONDS),
        "actor": timing.interleaved(actor, rounds, _ROUND_SECONDS),
    }


def _actor_saturation(actor_steps, batch, actions):
    """Names of the actor steps whose value or gradient is not finite at saturated means."""
    mean_and_std, *_ = _inputs(batch, actions, jax.random.key(0))
    mean_and_std = mean_and_std.at[..., :actions].add(_SATURATION_SHIFT)
    failing = []
    for step in actor_steps:
        if not step.differentiable:
            continue
        (value, _), grad = _actor_step(step)(mean_and_std, step.random_input(jax.random.key(1)))
        if not (jnp.isfinite(value) and jnp.all(jnp.isfinite(grad))):
            failing.append(step.name)
    return failing


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
            loss = timing.jitted_gradient(lambda *a, f=impl.loss: f(*a))
            start = time.perf_counter()
            rollout.lower(mean_and_std, key).compile()
            loss.lower(mean_and_std, raw, old, advantage, key).compile()
            seconds.append(time.perf_counter() - start)
        results[impl.name] = statistics.median(seconds)
    return results


def _memory(impls, batch, actions=8):
    """Temporary plus output bytes of the compiled steps (XLA's memory analysis)."""
    inputs = _inputs(batch, actions, jax.random.key(0))
    results = {}
    for impl in impls:
        if impl.loss is None:
            continue
        steps = timing.jitted_steps(impl, inputs[:1], inputs)
        analyses = [fn.lower(*args).compile().memory_analysis() for fn, args in steps]
        results[impl.name] = [a.temp_size_in_bytes + a.output_size_in_bytes for a in analyses]
    return results


def _actor_memory(actor_steps, batch, actions=8):
    """Temporary plus output bytes of the compiled actor steps."""
    mean_and_std, *_ = _inputs(batch, actions, jax.random.key(0))
    results = {}
    for step in actor_steps:
        if step.differentiable:
            compiled = _actor_step(step).lower(mean_and_std, step.random_input(jax.random.key(1)))
            analysis = compiled.compile().memory_analysis()
            results[step.name] = analysis.temp_size_in_bytes + analysis.output_size_in_bytes
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
    cached_head = samplers.NormalTanhSampler(nnx.Rngs(0), implementations.ENTROPY_WEIGHT)
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
        # The module's graph traversed once, not at every call (flax's performance guide).
        "module via nnx.cached_partial(nnx.jit(...), head)": (
            nnx.cached_partial(nnx.jit(lambda m, x: m((), x)), cached_head),
            (mean_and_std,),
        ),
    }
    with timing.per_call():  # the latency of one call is what this table is for
        return timing.interleaved(fns, rounds, _ROUND_SECONDS)


def _entropy_estimators(batch, rounds):
    """Loss-step cost at A = 8, and bias and spread per call for a 1-D policy."""
    mean_and_std, raw, old, advantage = _inputs(batch, 8, jax.random.key(0))
    reference = implementations.all_implementations()[0]
    fns = {"hand-written": (reference.loss, jax.random.key(1))}
    for name, options in _ESTIMATORS.items():
        _, loss, random_input = implementations.samplers_functions(**options)
        fns[name] = (loss, random_input(jax.random.key(1)))
    timed = {
        name: (timing.jitted_gradient(loss), (mean_and_std, raw, old, advantage, rng))
        for name, (loss, rng) in fns.items()
    }
    costs = timing.interleaved(timed, rounds, _ROUND_SECONDS)
    rows = []
    for name, options in _ESTIMATORS.items():
        row = [name, timing.ratio_cell(costs[name])]
        for mean, std in _ENTROPY_CASES:
            raw_std = math.log(math.expm1(std - implementations.MIN_STD))
            params = jnp.tile(jnp.array([mean, raw_std]), (4096, 1))
            head = samplers.NormalTanhSampler(nnx.Rngs(0), 1.0, **options)
            entropy = -np.asarray(head((), params).regularization_loss, np.float64)
            row.append(f"{entropy.mean() - _float64_entropy(mean, std):+.4f} / {entropy.std():.3f}")
        rows.append(row)
    return rows


def _entropy_alone(batches, rounds):
    """Value and gradient of the summed entropy alone, A = 8: the exact entropy against
    the one-sample estimate the specified sampler computes (its draw included)."""
    rows = []
    for batch in batches:
        keys = jax.random.split(jax.random.key(3), 3)
        loc = jax.random.normal(keys[0], (batch, 8))
        scale = jnp.exp(jax.random.normal(keys[1], (batch, 8)))

        def one_sample(loc, scale, key):
            dist = samplers.SquashedNormal(loc, scale, samplers.Tanh())
            return jnp.sum(dist.entropy_estimate(seed=key, num_samples=1))

        def exact(loc, scale, key):
            return jnp.sum(samplers.SquashedNormal(loc, scale, samplers.Tanh()).entropy())

        fns = {
            name: (jax.jit(jax.value_and_grad(f, argnums=(0, 1))), (loc, scale, keys[2]))
            for name, f in {"one sample": one_sample, "exact": exact}.items()
        }
        samples = timing.interleaved(fns, rounds, _ROUND_SECONDS)
        rows.append(
            [
                batch,
                f"{timing.summary(samples['one sample'])[0] * 1e3:.3f}",
                f"{timing.summary(samples['exact'])[0] * 1e3:.3f}",
                timing.ratio_cell(samples["exact"]),
            ]
        )
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


def _plot(results, actions, path, bandwidth_tbs=None):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = list(dict.fromkeys(n for r in results.values() for w in _WORKLOADS for n in r[w]))
    colors = dict(zip(names, plt.get_cmap("tab10").colors, strict=False))  # same in each panel
    figure, axes = plt.subplots(1, len(_WORKLOADS), figsize=(16, 4.4))
    for axis, workload in zip(axes, _WORKLOADS, strict=True):
        cells = {b: r[workload] for (b, a), r in results.items() if a == actions}
        batches = sorted(cells)
        for name in cells[batches[0]]:
            times = [timing.summary(cells[b][name])[0] * 1e3 for b in batches]
            style = "--" if name.startswith("floor") else "-o"
            axis.loglog(batches, times, style, label=name, markersize=4, color=colors[name])
        if bandwidth_tbs is not None:
            floors = [
                bandwidth.floor_seconds(workload, b, actions, bandwidth_tbs) * 1e3 for b in batches
            ]
            axis.loglog(batches, floors, ":k", label=f"bandwidth floor, {bandwidth_tbs:g} TB/s")
            # At small batches the floor is picoseconds: keep the axis to the measured range.
            fastest = min(timing.summary(cells[b][n])[0] for b in batches for n in cells[b]) * 1e3
            axis.set_ylim(bottom=fastest / 3)
        axis.set(
            xlabel="batch size B",
            ylabel="ms per step in the loop (median)"
            if timing.in_loop()
            else "ms per call (median)",
            title=f"{workload} step, A = {actions}",
        )
        axis.grid(True, which="both", alpha=0.3)
    for axis in (axes[0], axes[-1]):  # the actor step has its own implementations
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def run(grid, out_dir, *, device=None, name="results", bandwidth_tbs=None, command=None):
    """Runs the grid on ``device`` and writes ``{name}.md``, ``.json`` and the plot.

    Args:
        grid: Batch sizes, action sizes, rounds and the sizes of the extra sections
            (as :data:`QUICK`).
        out_dir: Where the files go.
        device: A ``jax.Device``; JAX's default device if None.
        name: Stem of the report; the plot is ``scaling.png`` for ``results`` and
            ``{name}-scaling.png`` otherwise.
        bandwidth_tbs: If given, the device's memory bandwidth in TB/s, and the
            report adds the memory-bandwidth floor (``benchmarks/bandwidth.py``).
        command: The command line to record in the report.

    Returns:
        The report's text.
    """
    device = timing.select_device() if device is None else device
    with jax.default_device(device):
        return _run(grid, Path(out_dir), device, name, bandwidth_tbs, command)


def _run(grid, out_dir, device, name, bandwidth_tbs, command):
    out_dir.mkdir(parents=True, exist_ok=True)
    impls = implementations.all_implementations()
    actor_steps = implementations.actor_steps()
    results = {}
    for actions in grid["actions"]:
        for batch in grid["batches"]:
            print(f"timing B={batch} A={actions} on {device.device_kind}", flush=True)
            results[batch, actions] = _workloads(impls, actor_steps, batch, actions, grid["rounds"])
    timings = [
        record
        for (batch, actions), cell in results.items()
        for workload in _WORKLOADS
        for record in timing.records(
            cell[workload], workload=workload, batch=batch, actions=actions
        )
    ]
    command = command or "python -m benchmarks"
    sections = [
        "# Benchmark results",
        "",
        f"Command: `{command}`, {datetime.date.today()}. Device: {device.device_kind} "
        f"(platform {device.platform}, {len(jax.devices(device.platform))} device(s)); "
        f"host {platform.machine()} with {len(os.sched_getaffinity(0))} cores. Python "
        f"{platform.python_version()}, jax {jax.__version__}, "
        f"jaxlib {timing.version('jaxlib')}, "
        f"flax {timing.version('flax')}, distrax {timing.version('distrax')}, "
        f"tfp {timing.version('tfp-nightly')}, brax {timing.version('brax')}; float32.",
        "",
        "Each cell: median over interleaved rounds of time / hand-written time in the "
        "same round (min-max); below 1 is faster than the hand-written formula.",
        "",
        timing.loop_note(),
    ]
    titles = {
        "rollout": "Rollout step",
        "loss": "Loss step",
        "actor": "Actor step (SAC-style: reparameterised sample, value and gradient)",
    }
    for workload in _WORKLOADS:
        names = list(next(iter(results.values()))[workload])
        header = ["B", "A", *timing.row_header(names)]
        rows = [
            [batch, actions, *timing.row_cells(cell[workload], names)]
            for (batch, actions), cell in results.items()
        ]
        sections += ["", f"## {titles[workload]}", "", timing.table(rows, header)]
        if workload == "actor":
            failing = _actor_saturation(actor_steps, grid["compile_batch"], grid["actions"][0])
            sections += [
                "",
                f"`mean(alpha * log_prob - Q(a))`, alpha = {implementations.ALPHA}, for a fixed "
                "`Q(a) = -sum(w (a - c)^2)`, gradient with respect to `mean_and_std`. "
                f"With every mean shifted by {_SATURATION_SHIFT:g} (saturated tanh, "
                f"B = {grid['compile_batch']}), non-finite values or gradients: "
                + (", ".join(failing) if failing else "none")
                + ".",
            ]
    compile_batch, memory_batch = grid["compile_batch"], grid["memory_batch"]
    compile_seconds = _compile_seconds(impls, compile_batch, grid["repeats"])
    reference = compile_seconds[impls[0].name]
    sections += [
        "",
        f"## Trace plus compile (rollout + loss, B = {compile_batch}, A = 8)",
        "",
        timing.table(
            [[n, f"{s * 1e3:.0f}", f"{s / reference:.2f}"] for n, s in compile_seconds.items()],
            ["implementation", "ms (median)", "ratio"],
        ),
        "",
        f"## Compiled memory (XLA temporaries + outputs, B = {memory_batch}, A = 8)",
        "",
        timing.table(
            [
                [n, f"{r / 2**20:.2f}", f"{lo / 2**20:.2f}"]
                for n, (r, lo) in _memory(impls, memory_batch).items()
            ],
            ["implementation", "rollout MiB", "loss MiB"],
        ),
        "",
        timing.table(
            [[n, f"{b / 2**20:.2f}"] for n, b in _actor_memory(actor_steps, memory_batch).items()],
            ["implementation", "actor MiB"],
        ),
        "",
        "## B = 1 rollout latency",
        "",
        timing.table(
            [
                [n, f"{timing.summary(s)[0] * 1e6:.1f}", timing.ratio_cell(s)]
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
        timing.table(
            _entropy_estimators(memory_batch, grid["rounds"]),
            ["estimator", "cost", *(f"bias / std at {case}" for case in _ENTROPY_CASES)],
        ),
        "",
        "## Entropy alone (value and gradient, A = 8)",
        "",
        "The exact `entropy()` of `SquashedNormal(loc, scale, Tanh())` against the "
        "one-sample `entropy_estimate(seed, 1)` (its draw included), `jax.value_and_grad` "
        "of the sum with respect to `loc` and `scale`; `loc ~ N(0, 1)`, `log scale ~ N(0, 1)`.",
        "",
        timing.table(
            _entropy_alone([b for b in grid["batches"] if b > 1], grid["rounds"]),
            ["B", "one sample (ms)", "exact (ms)", "exact / one sample"],
        ),
        "",
        f"`import samplers`: {_import_seconds(grid['repeats']) * 1e3:.0f} ms "
        f"(median of {grid['repeats']} fresh interpreters).",
    ]
    if bandwidth_tbs is not None:
        sections += ["", bandwidth.report(timings, bandwidth_tbs).rstrip("\n")]
    plot = "scaling.png" if name == "results" else f"{name}-scaling.png"
    actions = 8 if 8 in grid["actions"] else grid["actions"][0]
    if _plot(results, actions, out_dir / plot, bandwidth_tbs):
        sections += ["", f"![time per call against batch size]({plot})"]
    record = {
        "command": command,
        "device_kind": device.device_kind,
        "platform": device.platform,
        "jax": jax.__version__,
        "timings": timings,
    }
    return timing.write_report(out_dir, name, sections, record)
