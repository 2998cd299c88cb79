"""``python -m benchmarks --discrete``: the discrete heads against distrax as users write it.

Each head (``CategoricalSampler`` without and with a mask, ``MultiDiscreteSampler``,
``MultiBinarySampler``) runs beside the distrax code a JAX RL user writes inline
(``benchmarks/implementations.py``), both under ``jax.jit`` on the same inputs, in
interleaved rounds with a fresh random order each round; a cell is the median
over rounds of the ratio of the head's time to the hand-written time in the same
round, with min and max. At the largest batch size, the pieces of each workload
(draw, log-probability, entropy, gradient) are timed the same way, and the head's
rollout with its metrics returned. Writes ``results/discrete.md`` and
``results/discrete.json``.
"""

from pathlib import Path

import jax
import jax.numpy as jnp

from benchmarks import implementations, timing

ROUNDS = 21
_WORKLOADS = ("rollout", "loss")
_TITLES = {
    "rollout": "Rollout: sample, log-likelihood",
    "loss": "Loss: value and gradient (w.r.t. the logits) of the PPO surrogate of the "
    "stored action's log-likelihood, plus the entropy cost",
}


def inputs(case, batch, key):
    """``(logits, mask, action, old_log_likelihood, advantage)`` for ``case`` at ``batch``.

    The mask (for a masked case, else None) is random booleans with one allowed
    action per row at least; the stored action and its log-likelihood are the
    hand-written rollout's.
    """

    @jax.jit
    def make(key):
        k_logits, k_mask, k_allowed, k_action, k_advantage = jax.random.split(key, 5)
        logits = 2.0 * jax.random.normal(k_logits, (batch, case.num_params))
        mask = None
        if case.masked:
            mask = jax.random.bernoulli(k_mask, 0.5, logits.shape)
            allowed = jax.random.randint(k_allowed, (batch,), 0, case.num_params)
            mask = mask.at[jnp.arange(batch), allowed].set(True)
        rollout = implementations.discrete_distribution_rollout(case.distribution)
        action, old_log_likelihood = rollout(logits, mask, k_action)
        return logits, mask, action, old_log_likelihood, jax.random.normal(k_advantage, (batch,))

    return make(key)


def time_case(case, batch, rounds):
    """``{workload: interleaved samples}`` of the implementations of ``case`` at ``batch``."""
    # The loss's inputs; the rollout takes the first two, the logits and the mask.
    loss_inputs = inputs(case, batch, jax.random.key(0))
    impls = implementations.discrete_implementations(case)
    steps = {impl.name: timing.jitted_steps(impl, loss_inputs[:2], loss_inputs) for impl in impls}
    return timing.time_steps(steps, rounds)


def _parts(distribution):
    """The pieces of the two workloads, each a function of ``(logits, mask, action, key)``."""

    def objective(logits, mask, action):
        dist = distribution(logits, mask)
        return jnp.sum(dist.log_prob(action) + dist.entropy())

    return {
        "draw": lambda logits, mask, action, key: distribution(logits, mask).sample(seed=key),
        "log_prob": lambda logits, mask, action, key: distribution(logits, mask).log_prob(action),
        "entropy": lambda logits, mask, action, key: distribution(logits, mask).entropy(),
        "gradient of sum(log_prob + entropy)": lambda logits, mask, action, key: jax.grad(
            objective
        )(logits, mask, action),
    }


def time_parts(case, batch, rounds):
    """``{part: interleaved samples}``: the distributions' pieces, and the head's metrics.

    Each piece of the hand-written distribution beside the same piece of the
    samplers distribution (the pure layer); then the head's rollout returning its
    ``metrics`` too, beside the hand-written rollout and the head's plain rollout.
    """
    logits, mask, action, _, _ = inputs(case, batch, jax.random.key(0))
    key = jax.random.key(1)
    pieces = {
        name: _parts(distribution)
        for name, distribution in (
            ("handwritten", case.distribution),
            ("samplers (pure layer)", case.samplers_distribution),
        )
    }
    results = {}
    for part in pieces["handwritten"]:
        fns = {name: (jax.jit(p[part]), (logits, mask, action, key)) for name, p in pieces.items()}
        results[part] = timing.interleaved(fns, rounds)
    impls = implementations.discrete_implementations(case)
    head = impls[1]
    with_metrics = implementations.discrete_head_rollout_with_metrics(case)
    state = head.random_input(key)
    fns = {
        impls[0].name: (jax.jit(impls[0].rollout), (logits, mask, key)),
        head.name: (jax.jit(head.rollout), (logits, mask, state)),
        "samplers, metrics returned": (jax.jit(with_metrics), (logits, mask, state)),
    }
    results["head rollout"] = timing.interleaved(fns, rounds)
    return results


def run(batches, out_dir, *, device=None, name="discrete", rounds=ROUNDS, command=None):
    """Times every discrete case at each batch size; writes ``{name}.md`` and ``{name}.json``.

    Args:
        batches: The batch sizes.
        out_dir: Where the files go.
        device: A ``jax.Device``; JAX's default device if None.
        name: Stem of the report's file names.
        rounds: Interleaved rounds per cell.
        command: The command line to record in the report.

    Returns:
        The report's text.
    """
    device = jax.devices()[0] if device is None else device
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    command = command or "python -m benchmarks --discrete"
    conditions = timing.Conditions(command, device)
    results, parts, largest = {}, {}, max(batches)
    with jax.default_device(device):
        cases = timing.chosen(implementations.discrete_cases())
        for case in cases:
            for batch in batches:
                print(f"timing {case.name} B={batch} on {device.device_kind}", flush=True)
                results[case.name, batch] = time_case(case, batch, rounds)
                timing.save_partial(out_dir, name, results, _WORKLOADS, conditions, label="head")
        for case in cases:
            print(f"timing the parts of {case.name} B={largest}", flush=True)
            parts[case.name] = time_parts(case, largest, rounds)
    conditions.stop()
    i = implementations
    sections = [
        "# Discrete heads against distrax as users write it",
        "",
        conditions.line(),
        "",
        f"Categorical: {i.NUM_ACTIONS} actions (masked: random booleans, at least one "
        f"allowed per row). MultiDiscrete: nvec = {i.NVEC}. MultiBinary: {i.NUM_BITS} bits. "
        f"Each cell: median over {rounds} interleaved rounds of time / hand-written time "
        "in the same round (min-max); below 1 is faster than the hand-written code.",
    ]
    sections += timing.workload_tables(results, _TITLES, label="head")
    rows = []
    for head, cell in parts.items():
        for part, samples in cell.items():
            names = list(samples)
            cells = [timing.ratio_cell(samples[n]) for n in names[1:]]
            seconds = timing.summary(samples[names[0]])[0]
            if part == "head rollout":
                rows.append([head, "rollout", f"{seconds * 1e3:.4f}", "-", *cells])
            else:
                rows.append([head, part, f"{seconds * 1e3:.4f}", *cells, "-", "-"])
    sections += [
        "",
        f"## Where the time goes (B = {largest})",
        "",
        "Each piece of the hand-written distribution beside the same piece of the samplers "
        "distribution (the pure layer, `samplers.MaskedCategorical`, `samplers.MultiDiscrete`, "
        "`samplers.MultiBinary`), each under `jax.jit`; then the rollout of the head beside "
        "the same rollout returning the head's `metrics` (`allowed_actions`, "
        "`masked_probability`), which the timed rollout above leaves out. Ratios to the "
        "hand-written column, as above.",
        "",
        timing.table(
            rows,
            [
                "head",
                "piece",
                "hand-written (ms)",
                "samplers (pure layer)",
                "samplers",
                "samplers, metrics returned",
            ],
        ),
    ]
    record = {
        **conditions.record(rounds),
        "timings": timing.workload_records(results, _WORKLOADS, label="head"),
        "parts": [
            record
            for head, cell in parts.items()
            for part, samples in cell.items()
            for record in timing.records(samples, head=head, batch=largest, piece=part)
        ],
    }
    return timing.write_report(out_dir, name, sections, record)
