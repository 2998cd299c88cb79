"""``python -m benchmarks --tokens``: the token head's three steps against what users run.

A language model's head, from hidden states ``[N, D]`` and its tied embedding table
``[V, D]`` (the unembedding's transpose), top-p 0.9:

- **training step**: the clipped GRPO loss of stored tokens, and its gradient with
  respect to the hidden states and the table. ``samplers`` scores each token on its
  stored support (``TokenCategorical(...).replay(data)``, ``max_kept`` wide); plain JAX
  as TRL, verl and Tunix write it takes the token's entry of the whole vocabulary's
  ``jax.nn.log_softmax`` of float32 logits.
- **decode step**: one step's top-p draw with its support, ``R`` rows.
  ``samplers``: ``sample_replay_data`` (the token and its support, exact); a
  ``lax.top_k`` sampler (top-p renormalised over the top ``max_kept``, as samplers
  built on ``lax.top_k`` do); vLLM on TPU's exact binary-search top-p mask
  (``tpu_inference/layers/common/binary_search.py``, loaded from an installed
  ``tpu-inference`` when there is one: ``pip install --no-deps tpu-inference==0.32.0``);
  a ``lax.approx_max_k`` sampler.
- **untruncated step**: the value and gradient of the mean log-probability of tokens
  over the whole vocabulary plus 0.01 times the mean entropy; ``samplers``:
  ``replay_and_entropy`` (one stream over the vocabulary); plain JAX: the whole
  log-softmax.

Every array is an argument of the timed program (a closed-over array is folded at
compile time). Before timing, :func:`checks` compares each ``samplers`` step with an
independent computation at a small size. Writes ``results/tokens.md`` and
``results/tokens.json`` (or ``--name``).
"""

import importlib.util
import json
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import samplers
from benchmarks import timing

ROUNDS = 7
TOP_P = 0.9
PLAIN = "plain JAX"
TOP_K = "lax.top_k sampler"
BINARY = "binary-search top-p (vLLM on TPU)"
APPROX = "lax.approx_max_k sampler"
SAMPLERS = "samplers"
# The largest differences :func:`checks` accepts, relative to the reference's largest
# magnitude (float32 at the check's size).
TOLERANCE = 1e-4


class Step(NamedTuple):
    """A step the suite times, chosen by ``--cases`` (:func:`timing.chosen`)."""

    name: str


STEPS = (Step("training"), Step("decode"), Step("untruncated"))


class Grid(NamedTuple):
    """The sizes timed: width ``D``, vocabulary ``V``, tokens ``N`` of the training and
    untruncated steps, rows ``R`` of the decode step, ``max_kept`` values, dtype."""

    hidden: int
    vocab: int
    tokens: tuple[int, ...]
    rows: tuple[int, ...]
    kept: tuple[int, ...]
    dtype: str


QUICK = Grid(128, 32768, (1024,), (32, 256), (256, 32), "float32")
LARGE = Grid(2048, 151936, (8192,), (256, 1024), (256, 32), "bfloat16")
CHECK = Grid(32, 3000, (48,), (12,), (64,), "float32")


def binary_search():
    """The module ``tpu_inference/layers/common/binary_search.py`` of an installed
    ``tpu-inference``, loaded from its file alone (not the package, which needs a
    TPU runtime), or None where it is not installed."""
    try:
        spec = importlib.util.find_spec("tpu_inference")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "layers/common/binary_search.py"
    if not path.exists():
        return None
    module_spec = importlib.util.spec_from_file_location("tpu_inference_binary_search", path)
    if module_spec is None or module_spec.loader is None:
        return None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


# The steps, each a pure function of its arguments.


def _logits(hidden, embedding):
    return jax.lax.dot_general(
        hidden, embedding, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
    )


def _grpo(log_prob, old, advantage):
    ratio = jnp.exp(log_prob - old)
    clipped = jnp.clip(ratio, 0.8, 1.2)
    return -jnp.mean(jnp.minimum(ratio * advantage, clipped * advantage))


def samplers_training(kept):
    """The GRPO loss of tokens on their stored supports, value and gradient."""

    def loss(hidden, embedding, token, support, old, advantage):
        dist = samplers.TokenCategorical(hidden, embedding=embedding, top_p=TOP_P, max_kept=kept)
        log_prob = dist.replay({"token": token, "support": support})[1]
        return _grpo(log_prob, old, advantage)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def plain_training():
    """The GRPO loss of tokens over the whole vocabulary, value and gradient."""

    def loss(hidden, embedding, token, support, old, advantage):
        log_probs = jax.nn.log_softmax(_logits(hidden, embedding))
        log_prob = jnp.take_along_axis(log_probs, token[:, None], -1)[:, 0]
        return _grpo(log_prob, old, advantage)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def samplers_decode(kept):
    """One step's top-p draw with its support: ``{"token", "support"}``."""

    def draw(hidden, embedding, key):
        dist = samplers.TokenCategorical(hidden, embedding=embedding, top_p=TOP_P, max_kept=kept)
        return dist.sample_replay_data(seed=key)

    return jax.jit(draw)


def _renormalised_top_p(values, ids, key):
    """A draw from the top ``k`` ``values``, top-p renormalised over them."""
    probs = jax.nn.softmax(values, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    kept = jnp.where(before < TOP_P, values, -jnp.inf)
    choice = jax.random.categorical(key, kept)
    token = jnp.take_along_axis(ids, choice[:, None], -1)[:, 0]
    return token, jnp.where(kept > -jnp.inf, ids, -1)


def top_k_decode(kept):
    """``lax.top_k`` of the logits, then top-p among them."""

    def draw(hidden, embedding, key):
        values, ids = jax.lax.top_k(_logits(hidden, embedding), kept)
        return _renormalised_top_p(values, ids, key)

    return jax.jit(draw)


def approx_decode(kept):
    """``lax.approx_max_k`` of the logits (recall 0.95), then top-p among them."""

    def draw(hidden, embedding, key):
        values, ids = jax.lax.approx_max_k(_logits(hidden, embedding), kept)
        return _renormalised_top_p(values, ids, key)

    return jax.jit(draw)


def binary_search_decode(module):
    """The exact top-p mask by binary search over float32 (vLLM on TPU's), then a draw."""

    def draw(hidden, embedding, key):
        logits = _logits(hidden, embedding)
        masked = module.topp_mask(logits, TOP_P, -jnp.inf)
        return jax.random.categorical(key, masked), masked > -jnp.inf

    return jax.jit(draw)


def samplers_untruncated():
    """Mean log-probability plus 0.01 mean entropy over the whole vocabulary, streamed."""

    def loss(hidden, embedding, token):
        dist = samplers.TokenCategorical(hidden, embedding=embedding)
        _, log_prob, entropy = dist.replay_and_entropy(token)
        return jnp.mean(log_prob) + 0.01 * jnp.mean(entropy)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def plain_untruncated():
    """The same with the whole ``[N, V]`` float32 log-softmax."""

    def loss(hidden, embedding, token):
        log_probs = jax.nn.log_softmax(_logits(hidden, embedding))
        log_prob = jnp.take_along_axis(log_probs, token[:, None], -1)[:, 0]
        entropy = -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)
        return jnp.mean(log_prob) + 0.01 * jnp.mean(entropy)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


# Inputs.


def model(grid: Grid, rows: int, key=0):
    """``(hidden [rows, D], embedding [V, D])``: standard normal hidden states, a table
    of standard deviation ``3 / sqrt(D)`` (logits of standard deviation about 3)."""

    @jax.jit
    def make(key):
        k_hidden, k_table = jax.random.split(key)
        dtype = jnp.dtype(grid.dtype)
        hidden = jax.random.normal(k_hidden, (rows, grid.hidden), dtype)
        scale = jnp.asarray(3.0 / grid.hidden**0.5, dtype)
        return hidden, scale * jax.random.normal(k_table, (grid.vocab, grid.hidden), dtype)

    return make(jax.random.key(key))


def rollout(hidden, embedding, kept):
    """``(token, support, old log-probability, advantage)`` of a top-p sample, as a
    rollout stores them (``support`` ``max_kept`` wide)."""

    @jax.jit
    def sample(hidden, embedding, key):
        dist = samplers.TokenCategorical(hidden, embedding=embedding, top_p=TOP_P, max_kept=kept)
        token, data, log_prob = dist.sample_with_replay(seed=key)
        advantage = jax.random.normal(jax.random.fold_in(key, 1), token.shape)
        return token, data["support"], log_prob, advantage

    return sample(hidden, embedding, jax.random.key(7))


# Cells: {name: (fn, args)}, the reference first.


def training_cell(grid: Grid, tokens: int, kept: int) -> dict:
    hidden, embedding = model(grid, tokens)
    args = (hidden, embedding, *rollout(hidden, embedding, kept))
    return {PLAIN: (plain_training(), args), SAMPLERS: (samplers_training(kept), args)}


def decode_cell(grid: Grid, rows: int, kept: int) -> dict:
    hidden, embedding = model(grid, rows)
    args = (hidden, embedding, jax.random.key(3))
    cell = {TOP_K: (top_k_decode(kept), args), SAMPLERS: (samplers_decode(kept), args)}
    module = binary_search()
    if module is not None:
        cell[BINARY] = (binary_search_decode(module), args)
    cell[APPROX] = (approx_decode(kept), args)
    return cell


def untruncated_cell(grid: Grid, tokens: int) -> dict:
    hidden, embedding = model(grid, tokens)
    token = jax.random.randint(jax.random.key(5), (tokens,), 0, grid.vocab)
    args = (hidden, embedding, token)
    return {PLAIN: (plain_untruncated(), args), SAMPLERS: (samplers_untruncated(), args)}


def checks(grid: Grid = CHECK) -> dict:
    """As :func:`_checks`, with matrix products at float32 precision: an accelerator's
    default rounds their operands to bfloat16, which ``samplers``' exact arithmetic on
    a support does not."""
    with jax.default_matmul_precision("highest"):
        return _checks(grid)


def _checks(grid: Grid) -> dict:
    """``samplers``' steps against independent computations, float32, at ``grid``:
    ``{check: [largest difference over the reference's largest magnitude, what]}``.

    - the training step against ``jax.nn.log_softmax`` of the logits restricted to
      each stored support, in float64 on the host (value and both gradients);
    - the decode step's support against the definition on the whole logits
      (``lax.top_k``, then the mass over the whole vocabulary), the set of ids;
      and, with ``tpu-inference`` installed and ``max_kept`` the vocabulary, the
      binary-search mask;
    - the untruncated step against plain JAX (value and both gradients).
    """
    found = {}
    (tokens,), (rows,), (kept,) = grid.tokens, grid.rows, grid.kept
    hidden, embedding = model(grid, tokens, key=1)
    token, support, old, advantage = rollout(hidden, embedding, kept)

    got = samplers_training(kept)(hidden, embedding, token, support, old, advantage)
    want = _training_float64(hidden, embedding, token, support, old, advantage)
    found["training step"] = [_relative(got, want), "loss and gradients"]
    got = samplers_untruncated()(hidden, embedding, token)
    want = plain_untruncated()(hidden, embedding, token)
    found["untruncated step"] = [_relative(got, want), "value and gradients"]

    h, e = model(grid, rows, key=2)
    drawn = samplers_decode(kept)(h, e, jax.random.key(0))
    logits = np.asarray(_logits(h, e), np.float64)
    order = np.argsort(-logits, axis=-1, kind="stable")[:, :kept]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    sorted_probs = np.take_along_axis(probs, order, -1)
    before = np.cumsum(sorted_probs, -1) - sorted_probs
    expected = np.where(before < TOP_P, order, -1)
    same = np.array_equal(np.sort(np.asarray(drawn["support"]), -1), np.sort(expected, -1))
    found["decode step's support"] = [0.0 if same else 1.0, "sets of ids against the definition"]
    module = binary_search()
    if module is not None:
        whole = samplers_decode(grid.vocab)(h, e, jax.random.key(0))["support"]
        mask = np.asarray(module.topp_mask(_logits(h, e), TOP_P, -jnp.inf) > -jnp.inf)
        ours = np.zeros_like(mask)
        np.put_along_axis(ours, np.maximum(np.asarray(whole), 0), np.asarray(whole) >= 0, -1)
        found["decode step's support, binary search"] = [
            float(np.mean(ours != mask)),
            "fraction of (row, token) pairs where the masks differ",
        ]
    return found


def _training_float64(hidden, embedding, token, support, old, advantage):
    """The training step's value and gradients in float64 on the host's CPU: the
    logits restricted to each stored support, ``jax.nn.log_softmax``, the GRPO loss
    (on a TPU the same in float32 is off by up to 4.2e-5 of the largest gradient)."""
    with jax.enable_x64(True):
        cpu = jax.devices("cpu")[0]
        hidden, embedding, old, advantage = (
            jax.device_put(np.asarray(a, np.float64), cpu)
            for a in (hidden, embedding, old, advantage)
        )
        token, support = (jax.device_put(np.asarray(a), cpu) for a in (token, support))

        def on_support(hidden, embedding):
            logits = hidden @ embedding.T
            rows = jnp.arange(logits.shape[0])[:, None]
            member = jnp.zeros(logits.shape, bool).at[rows, support].set(support >= 0)
            log_probs = jax.nn.log_softmax(jnp.where(member, logits, -jnp.inf))
            return _grpo(jnp.take_along_axis(log_probs, token[:, None], -1)[:, 0], old, advantage)

        return jax.value_and_grad(on_support, argnums=(0, 1))(hidden, embedding)


def _relative(got, want) -> float:
    pairs = zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    return max(
        float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
        / max(float(jnp.max(jnp.abs(b.astype(jnp.float32)))), 1e-30)
        for a, b in pairs
    )


# Timing and the report.


def _out_of_memory(error) -> bool:
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def _memory(cell) -> dict:
    """Compiled bytes (XLA's temporaries plus outputs) of each step, called alone."""
    found = {}
    for name, (fn, args) in cell.items():
        analysis = fn.lower(*args).compile().memory_analysis()
        if analysis is not None:
            found[name] = analysis.temp_size_in_bytes + analysis.output_size_in_bytes
    return found


def time_cell(cell, rounds) -> tuple[dict, dict, list]:
    """``(samples, compiled bytes, names out of memory)``; where the reference does not
    fit in the device's memory beside the others, they are timed without it."""
    reference = next(iter(cell))
    try:
        memory = {} if timing.in_loop() else _memory(cell)
        samples = timing.interleaved(cell, rounds)
        return samples, {**memory, **samples.memory}, []
    except Exception as error:  # XLA's RESOURCE_EXHAUSTED, at compile or run time
        if not _out_of_memory(error):
            raise
    others = {name: step for name, step in cell.items() if name != reference}
    memory = {} if timing.in_loop() else _memory(others)
    samples = timing.interleaved(others, rounds)
    return samples, {**memory, **samples.memory}, [reference]


def _records(label, value, cell_result, names):
    samples, memory, missing = cell_result
    reference = names[0]
    found = [{label: value, "implementation": n, "out_of_memory": True} for n in missing]
    for name, runs in samples.items():
        seconds, ratio, low, high = timing.summary(runs)
        record = {label: value, "implementation": name, "seconds": seconds}
        if reference not in missing:
            record.update(ratio=ratio, low=low, high=high)
        record["compiled_bytes"] = memory.get(name)
        if memory.get(name) and memory.get(reference):
            record["memory_ratio"] = memory[name] / memory[reference]
        found.append(record)
    return found


def _rows(records, label, names):
    rows = []
    order = {name: i for i, name in enumerate(names)}
    for r in sorted(records, key=lambda r: (r[label], order.get(r["implementation"], 99))):
        if r.get("out_of_memory"):
            rows.append([r[label], r["implementation"], "out of memory", "-", "-", "-"])
            continue
        ratio = f"{r['ratio']:.2f} ({r['low']:.2f}-{r['high']:.2f})" if "ratio" in r else "-"
        size = r.get("compiled_bytes")
        rows.append(
            [
                r[label],
                r["implementation"],
                f"{r['seconds'] * 1e3:.2f}",
                ratio,
                "-" if size is None else f"{size / 2**20:.1f}",
                f"{r['memory_ratio']:.3f}" if "memory_ratio" in r else "-",
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
    grid=None,
):
    """Checks the steps, times them, writes ``{name}.md`` and ``{name}.json`` and
    returns the report's text.

    Args:
        batches: The numbers of tokens ``N`` of the training and untruncated steps;
            None for the grid's.
        out_dir, device, name, rounds, command: As :func:`benchmarks.discrete.run`'s.
        large: The accelerator grid, :data:`LARGE` (D = 2048, V = 151936, bfloat16);
            on the CPU :data:`QUICK` is timed whatever this says.
        grid: A :class:`Grid` in place of both.

    ``--cases`` (:func:`timing.set_timing`) chooses the steps by name: ``training``,
    ``decode``, ``untruncated``.

    Raises:
        AssertionError: a check differs by more than :data:`TOLERANCE`.
    """
    device = jax.devices()[0] if device is None else device
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    conditions = timing.Conditions(command or "python -m benchmarks --tokens", device)
    chosen = grid or (LARGE if large and device.platform != "cpu" else QUICK)
    if batches is not None:
        chosen = chosen._replace(tokens=tuple(batches))
    results = {"training": [], "decode": [], "untruncated": []}
    steps = {step.name for step in timing.chosen(STEPS)}
    with jax.default_device(device):
        found = checks()
        # The binary search keeps ties at its threshold and sums float32 probabilities:
        # its masks are reported, not held to the tolerance.
        worst = max(value for check, (value, _) in found.items() if "binary" not in check)
        if worst > TOLERANCE:
            raise AssertionError(f"samplers' token steps differ from their checks: {found}")
        for tokens in chosen.tokens if "training" in steps else ():
            for kept in chosen.kept:
                label = f"N = {tokens}, max_kept = {kept}"
                print(f"timing the training step, {label}", flush=True)
                result = time_cell(training_cell(chosen, tokens, kept), rounds)
                results["training"] += _records("cell", label, result, [PLAIN, SAMPLERS])
                _save_partial(out_dir, name, conditions, results)
        for rows in chosen.rows if "decode" in steps else ():
            label = f"R = {rows}, max_kept = {chosen.kept[0]}"
            print(f"timing the decode step, {label}", flush=True)
            cell = decode_cell(chosen, rows, chosen.kept[0])
            result = time_cell(cell, rounds)
            results["decode"] += _records("cell", label, result, list(cell))
            _save_partial(out_dir, name, conditions, results)
        for tokens in chosen.tokens if "untruncated" in steps else ():
            label = f"N = {tokens}"
            print(f"timing the untruncated step, {label}", flush=True)
            result = time_cell(untruncated_cell(chosen, tokens), rounds)
            results["untruncated"] += _records("cell", label, result, [PLAIN, SAMPLERS])
    conditions.stop()
    return _report(out_dir, name, conditions, chosen, rounds, found, results)


def _save_partial(out_dir, name, conditions, results) -> None:
    """The cells timed so far, in ``{name}.partial.json``: a run stopped at a time limit
    keeps them (:func:`timing.write_report` removes the file with the whole report)."""
    record = {**conditions.identity(), "stopped": True, **results}
    (Path(out_dir) / f"{name}.partial.json").write_text(json.dumps(record, indent=1) + "\n")


def _report(out_dir, name, conditions, grid, rounds, found, results):
    unit = "ms per step" if timing.in_loop() else "ms per call"
    header = [
        "cell",
        "implementation",
        unit,
        "time / reference",
        "compiled MiB",
        "memory / reference",
    ]
    peer = "installed" if binary_search() is not None else "not installed, so not timed"
    checked = "; ".join(f"{check}: {value:.1e} ({what})" for check, (value, what) in found.items())
    decode_names = [TOP_K, SAMPLERS, BINARY, APPROX]
    sections = [
        "# The token head's steps",
        "",
        conditions.line().replace("; float32.", f"; {grid.dtype}, accumulated in float32."),
        "",
        f"Hidden states `[N, {grid.hidden}]` and a tied embedding table `[{grid.vocab}, "
        f"{grid.hidden}]` ({grid.dtype}), logits of standard deviation about 3, top-p {TOP_P}; "
        "every array an argument of the timed program. Before timing, each `samplers` step "
        f"against an independent computation (float32, D = {CHECK.hidden}, V = {CHECK.vocab}): "
        f"{checked}. tpu-inference: {peer}.",
        "",
        timing.loop_note()
        if not timing.in_loop()
        else (
            "Timed in the loop: each step inside one compiled `lax.fori_loop` "
            "(`benchmarks/timing.py`); compiled memory is the looped program's."
        ),
        "",
        f"Time: median over {rounds} interleaved rounds; time / reference: median of the "
        "ratios to the first row's time in the same round (min-max). Compiled memory: "
        "XLA's temporaries plus outputs.",
        "",
        "## Training step: the clipped GRPO loss of stored tokens, value and gradient "
        "w.r.t. the hidden states and the table",
        "",
        f"{PLAIN}: the token's entry of `jax.nn.log_softmax` of the float32 logits `[N, V]`. "
        f"{SAMPLERS}: `TokenCategorical(hidden, embedding=table, top_p={TOP_P}, "
        "max_kept=K).replay({'token', 'support'})`, each token scored on its stored support.",
        "",
        timing.table(_rows(results["training"], "cell", [PLAIN, SAMPLERS]), header),
        "",
        "## Decode step: one top-p draw with its support",
        "",
        f"{TOP_K}: `lax.top_k` of the logits, top-p renormalised over the top `max_kept`. "
        f"{SAMPLERS}: `sample_replay_data`, the token and its support (top-p over the whole "
        f"vocabulary's mass, exact). {BINARY}: `topp_mask` of tpu-inference 0.32.0 "
        "(`layers/common/binary_search.py`), then `jax.random.categorical`. "
        f"{APPROX}: `lax.approx_max_k` in place of `lax.top_k`.",
        "",
        timing.table(_rows(results["decode"], "cell", decode_names), header),
        "",
        "## Untruncated step: mean log-probability plus 0.01 mean entropy over the whole "
        "vocabulary, value and gradient",
        "",
        f"{PLAIN}: `jax.nn.log_softmax` of the float32 logits `[N, V]`. {SAMPLERS}: "
        "`TokenCategorical(hidden, embedding=table).replay_and_entropy(token)`, one stream "
        "over the vocabulary, whose gradient recomputes each block.",
        "",
        timing.table(_rows(results["untruncated"], "cell", [PLAIN, SAMPLERS]), header),
    ]
    record = {
        **conditions.record(rounds),
        "grid": grid._asdict(),
        "checks": found,
        **results,
    }
    return timing.write_report(out_dir, name, sections, record)
