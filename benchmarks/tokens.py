"""``python -m benchmarks --tokens``: token log-probabilities over a vocabulary.

The score of a language model's tokens, the value and gradient (w.r.t. the hidden
states and the unembedding) of ``mean(log p(token))`` over the whole vocabulary,
from hidden states ``[N, D]`` and an unembedding ``[D, V]``, both bfloat16 with
float32 accumulation. Plain JAX as users write it builds the ``[N, V]`` float32
logits (``jnp.dot(..., preferred_element_type=jnp.float32)``, ``jax.nn.log_softmax``,
the token's entry by ``jnp.take_along_axis``); ``samplers.TokenCategorical(hidden,
unembedding).full_log_prob(token)`` streams the vocabulary in blocks and recomputes
each block in its backward pass, never holding the logits. Both run under
``jax.jit`` in interleaved rounds with a fresh random order each round; a cell is
the median over rounds of the ratio of the time to plain JAX's in the same round,
with min and max, beside each program's compiled memory and the share of the
device's matrix peak that the useful FLOPs (``6 N D V``: the forward matmul and the
two of its gradient) reach. Before timing, :func:`differences` checks that the two
compute the same value and gradients. Writes ``results/tokens.md`` and
``results/tokens.json``.
"""

from pathlib import Path

import jax
import jax.numpy as jnp

import samplers
from benchmarks import timing

ROUNDS = 7
BLOCK = (128, 4096)  # TokenCategorical's default (rows, tokens)
# The sizes timed: the width D, the vocabulary V, the numbers of tokens N, the blocks.
QUICK = {"hidden": 256, "vocab": 32768, "batches": (256, 2048), "blocks": (BLOCK,)}
LARGE = {
    "hidden": 2048,
    "vocab": 151936,
    "batches": (1024, 8192),
    "blocks": ((1024, 4096), (2048, 8192)),
}
# The bfloat16 matrix peak of the device kinds measured here, TFLOP/s.
PEAK_TFLOPS = {"TPU v5 lite": 197.0}
PLAIN = "plain JAX"
CHECK_SIZE = (64, 64, 5000)  # N, D, V of the agreement check; V is not a multiple of the block
# The largest difference accepted, relative to plain JAX's largest magnitude: bfloat16
# gradients differ by their rounding (about 4e-3 on the CPU), an error by far more.
TOLERANCE = 3e-2
_WORKLOADS = ("score",)
_TITLE = (
    "Score: value and gradient (w.r.t. the hidden states and the unembedding) of "
    "mean(log p(token)) over the whole vocabulary"
)


def plain_score(hidden, unembedding, token):
    """``mean(log p(token))`` as users write it: the ``[N, V]`` float32 logits whole."""
    logits = jnp.dot(hidden, unembedding, preferred_element_type=jnp.float32)
    log_probs = jax.nn.log_softmax(logits)
    return jnp.mean(jnp.take_along_axis(log_probs, token[:, None], axis=-1))


def samplers_score(hidden, unembedding, token, block=BLOCK):
    """``mean(log p(token))`` with ``samplers.TokenCategorical``, streamed in blocks."""
    dist = samplers.TokenCategorical(hidden, unembedding, block=block)
    return jnp.mean(dist.full_log_prob(token))


def implementation_name(block):
    """``samplers`` for the default block, else ``samplers, block (rows, tokens)``."""
    return "samplers" if tuple(block) == BLOCK else f"samplers, block {tuple(block)}"


def steps(blocks):
    """``{name: jitted value and gradient}``, plain JAX first, then one per block."""
    found = {PLAIN: plain_score}
    for block in blocks:
        found[implementation_name(block)] = lambda h, w, t, block=tuple(block): samplers_score(
            h, w, t, block
        )
    return {name: jax.jit(jax.value_and_grad(fn, argnums=(0, 1))) for name, fn in found.items()}


def inputs(tokens, hidden, vocab, key, dtype=jnp.bfloat16):
    """``(hidden states [N, D], unembedding [D, V], token [N])``: standard normal hidden
    states, an unembedding of standard deviation ``3 / sqrt(D)`` (logits of standard
    deviation about 3), tokens uniform over the vocabulary."""

    @jax.jit
    def make(key):
        k_hidden, k_unembedding, k_token = jax.random.split(key, 3)
        states = jax.random.normal(k_hidden, (tokens, hidden), dtype)
        scale = jnp.asarray(3.0 / hidden**0.5, dtype)
        unembedding = scale * jax.random.normal(k_unembedding, (hidden, vocab), dtype)
        return states, unembedding, jax.random.randint(k_token, (tokens,), 0, vocab)

    return make(key)


def differences(size=CHECK_SIZE, block=BLOCK, key=0):
    """The largest differences between ``samplers`` and plain JAX, in bfloat16 and float32.

    ``{dtype: {quantity: {"difference": largest absolute difference, "magnitude":
    plain JAX's largest magnitude}}}``
    for the mean log-probability and its gradients w.r.t. the hidden states and the
    unembedding, at ``size`` ``(N, D, V)``.
    """
    found = {}
    fns = steps((block,))
    for dtype in (jnp.bfloat16, jnp.float32):
        args = inputs(*size, jax.random.key(key), dtype)
        (want, want_grad), (got, got_grad) = (fn(*args) for fn in fns.values())
        found[jnp.dtype(dtype).name] = {
            what: {
                "difference": float(jnp.max(jnp.abs(a.astype(jnp.float32) - b))),
                "magnitude": float(jnp.max(jnp.abs(b.astype(jnp.float32)))),
            }
            for what, a, b in (
                ("mean log-prob", got, want),
                ("gradient w.r.t. the hidden states", got_grad[0], want_grad[0]),
                ("gradient w.r.t. the unembedding", got_grad[1], want_grad[1]),
            )
        }
    return found


def worst_difference(found):
    """The largest of :func:`differences`'s differences over its magnitude."""
    return max(
        gap["difference"] / (gap["magnitude"] or 1.0)
        for gaps in found.values()
        for gap in gaps.values()
    )


def _out_of_memory(error):
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def _compiled(fns):
    """Per call: ``(fns with each step compiled, {name: compiled bytes})``. In the loop
    the looped programs are compiled by the timing, which measures their memory."""
    if timing.in_loop():
        return fns, {}
    compiled, memory = {}, {}
    for name, (fn, args) in fns.items():
        program = fn.lower(*args).compile()
        analysis = program.memory_analysis()
        if analysis is not None:
            memory[name] = analysis.temp_size_in_bytes + analysis.output_size_in_bytes
        compiled[name] = (program, args)
    return compiled, memory


def time_cell(tokens, grid, rounds):
    """``(samples, compiled bytes, names out of memory)`` at ``tokens`` tokens.

    When the programs do not fit in the device's memory together with plain JAX's
    (its ``[N, V]`` logits and their gradient), the others are timed without it.
    """
    args = inputs(tokens, grid["hidden"], grid["vocab"], jax.random.key(0))
    fns = {name: (fn, args) for name, fn in steps(grid["blocks"]).items()}
    try:
        programs, memory = _compiled(fns)
        samples = timing.interleaved(programs, rounds)
        return samples, {**memory, **samples.memory}, []
    except Exception as error:  # XLA's RESOURCE_EXHAUSTED, at compile or run time
        if not _out_of_memory(error):
            raise
        print(f"out of memory with {PLAIN} at N={tokens}: timing the others alone", flush=True)
    others, memory = _compiled({name: fn for name, fn in fns.items() if name != PLAIN})
    samples = timing.interleaved(others, rounds)
    return samples, {**memory, **samples.memory}, [PLAIN]


def _records(cell, tokens, grid, peak):
    """One JSON record per implementation of a timed cell."""
    samples, memory, missing = cell
    flops = 6 * tokens * grid["hidden"] * grid["vocab"]
    plain = None if PLAIN in missing else timing.summary(samples[PLAIN])[0]
    found = [{"tokens": tokens, "implementation": name, "out_of_memory": True} for name in missing]
    for name, runs in samples.items():
        seconds, ratio, low, high = timing.summary(runs)
        record = {"tokens": tokens, "implementation": name, "seconds": seconds}
        if plain is not None:
            record.update(ratio=ratio, low=low, high=high)
        record["compiled_bytes"] = memory.get(name)
        if memory.get(name) and memory.get(PLAIN):
            record["memory_ratio"] = memory[name] / memory[PLAIN]
        if name != timing.FLOOR:
            record["tflops"] = flops / seconds / 1e12
            if peak is not None:
                record["peak_share"] = record["tflops"] / peak
        found.append(record)
    return found


def _loop_note():
    if not timing.in_loop():
        return timing.loop_note()
    return (
        "Timed in the loop: each step inside one compiled `lax.fori_loop`, its inputs "
        "depending on the previous step's outputs, the cost of the same program with no "
        "steps taken off (`benchmarks/timing.py`). The floor, timed in the same rounds, "
        "reads the inputs and writes outputs of the gradients' sizes in the same loop."
    )


def _rows(records, names):
    rows = []
    for record in sorted(records, key=lambda r: (r["tokens"], names.index(r["implementation"]))):
        if record.get("out_of_memory"):
            rows.append([record["tokens"], record["implementation"], "out of memory", *"----"])
            continue
        ratio = (
            f"{record['ratio']:.2f} ({record['low']:.2f}-{record['high']:.2f})"
            if "ratio" in record
            else "-"
        )
        size = record["compiled_bytes"]
        share = f" ({record['peak_share']:.0%})" if "peak_share" in record else ""
        rows.append(
            [
                record["tokens"],
                record["implementation"],
                f"{record['seconds'] * 1e3:.3f}",
                ratio,
                "-" if size is None else f"{size / 2**20:.1f}",
                f"{record['memory_ratio']:.3f}" if "memory_ratio" in record else "-",
                f"{record['tflops']:.2f}{share}" if "tflops" in record else "-",
            ]
        )
    return rows


def run(
    batches,
    out_dir,
    *,
    device=None,
    name="tokens",
    rounds=ROUNDS,
    command=None,
    large=False,
    peak_tflops=None,
    grid=None,
):
    """Checks that both sides agree, times them at each number of tokens; writes
    ``{name}.md`` and ``{name}.json`` and returns the report's text.

    Args:
        batches: The numbers of tokens ``N``; None for the grid's.
        out_dir, device, name, rounds, command: As :func:`benchmarks.discrete.run`'s.
        large: The accelerator grid, :data:`LARGE` (``D = 2048``, ``V = 151936``); on
            the CPU :data:`QUICK`'s sizes are timed whatever this says.
        peak_tflops: The device's matrix peak in TFLOP/s; by default
            :data:`PEAK_TFLOPS`'s figure for the device, if known.
        grid: Sizes in :data:`QUICK`'s form, in place of both grids.

    Raises:
        AssertionError: the two sides differ by more than ``TOLERANCE``.
    """
    device = jax.devices()[0] if device is None else device
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    conditions = timing.Conditions(command or "python -m benchmarks --tokens", device)
    chosen = grid or (LARGE if large and device.platform != "cpu" else QUICK)
    batches = tuple(chosen["batches"] if batches is None else batches)
    peak = peak_tflops if peak_tflops is not None else PEAK_TFLOPS.get(device.device_kind)
    case = f"D={chosen['hidden']}, V={chosen['vocab']}"
    names = [PLAIN, *(implementation_name(b) for b in chosen["blocks"]), timing.FLOOR]
    cells, partial, records = {}, {}, []
    with jax.default_device(device):
        found = differences(block=chosen["blocks"][0])
        if worst_difference(found) > TOLERANCE:
            raise AssertionError(f"samplers and plain JAX differ: {found}")
        for tokens in batches:
            print(f"timing the token scores N={tokens}, {case} on {device.device_kind}", flush=True)
            cells[tokens] = time_cell(tokens, chosen, rounds)
            records += _records(cells[tokens], tokens, chosen, peak)
            partial[case, tokens] = {"score": cells[tokens][0]}
            timing.save_partial(out_dir, name, partial, _WORKLOADS, conditions)
    conditions.stop()
    checked = "; ".join(
        f"{dtype}: "
        + ", ".join(
            f"{what} {gap['difference']:.1e} (of {gap['magnitude']:.1e})"
            for what, gap in gaps.items()
        )
        for dtype, gaps in found.items()
    )
    if large and device.platform == "cpu" and grid is None:
        sizes_note = (
            f"`--large`'s D = {LARGE['hidden']}, V = {LARGE['vocab']} are for accelerators: "
            f"on the CPU the default D = {QUICK['hidden']}, V = {QUICK['vocab']} are timed. "
        )
    else:
        sizes_note = ""
    time_unit = "ms per step" if timing.in_loop() else "ms per call"
    peak_note = (
        f"the share of the matrix peak, {peak:g} TFLOP/s"
        if peak is not None
        else "no matrix peak known for this device (`--peak-tflops`)"
    )
    sections = [
        "# Token log-probabilities over a vocabulary",
        "",
        conditions.line().replace("; float32.", "; bfloat16, accumulated in float32."),
        "",
        f"{sizes_note}Hidden states `[N, {chosen['hidden']}]` and an unembedding "
        f"`[{chosen['hidden']}, {chosen['vocab']}]`, bfloat16, accumulated in float32; tokens "
        f"uniform over the vocabulary. {PLAIN}: `logits = jnp.dot(hidden, unembedding, "
        "preferred_element_type=jnp.float32)`, `jax.nn.log_softmax(logits)`, the token's "
        "entry by `jnp.take_along_axis`, the mean. `samplers`: `jnp.mean(samplers."
        "TokenCategorical(hidden, unembedding, block=(rows, tokens)).full_log_prob(token))`, "
        f"the default block {BLOCK}. Before timing, the largest absolute differences of the "
        f"two (over {PLAIN}'s largest magnitude), at N, D, V = {CHECK_SIZE}: {checked}.",
        "",
        _loop_note(),
        "",
        f"## {_TITLE}",
        "",
        f"Time: median over {rounds} interleaved rounds; time / {PLAIN}: median of the "
        f"ratios to {PLAIN}'s time in the same round (min-max), below 1 faster. Compiled "
        "memory: XLA's temporaries plus outputs of each program (in the loop, of the looped "
        f"program). TFLOP/s: the useful FLOPs, 6 N D V (the forward matmul and the two of "
        f"its gradient; `samplers` recomputes the logits in its backward pass, a fourth "
        f"matmul not counted), over the time, with {peak_note}.",
        "",
        timing.table(
            _rows(records, names),
            [
                "N",
                "implementation",
                time_unit,
                f"time / {PLAIN}",
                "compiled MiB",
                f"memory / {PLAIN}",
                "TFLOP/s",
            ],
        ),
    ]
    record = {
        **conditions.record(rounds),
        "hidden": chosen["hidden"],
        "vocab": chosen["vocab"],
        "blocks": [list(b) for b in chosen["blocks"]],
        "peak_tflops": peak,
        "differences": found,
        "timings": records,
    }
    return timing.write_report(out_dir, name, sections, record)
