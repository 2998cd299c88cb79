"""``python -m benchmarks --beta``: the Beta head against distrax as users write it.

Each case is ``samplers.BetaSampler`` beside the distrax code a JAX RL user writes
inline for a Beta policy over a box (concentrations ``1 + softplus(raw)``,
``distrax.Beta`` sampled in ``[0, 1]``, clipped away from the bounds before it is
scored, as Stoix's Beta head does, and mapped onto the box), both under ``jax.jit``
on the same network output, in interleaved rounds with a fresh random order each
round; a cell is the median over rounds of the ratio of the head's time to the
hand-written time in the same round, with min and max. A third column runs the
hand-written steps on ``samplers.squashed_beta`` (the pure layer), which separates
what the module adds from what the distribution costs. Writes ``results/beta.md``
and ``results/beta.json``.
"""

from pathlib import Path
from typing import NamedTuple

import distrax
import jax
import jax.numpy as jnp

import samplers
from benchmarks import implementations, timing
from benchmarks.implementations import surrogate

ROUNDS = 21
CLIP = 1e-6  # the hand-written code scores clip(x, CLIP, 1 - CLIP), as Stoix's head
_W = implementations.ENTROPY_WEIGHT
_WORKLOADS = ("rollout", "loss")
_TITLES = {
    "rollout": "Rollout: sample, log-likelihood, the value to store for the replay",
    "loss": "Loss: value and gradient (w.r.t. the network output) of the PPO surrogate "
    "of the stored value's log-likelihood, plus the entropy cost",
}


class BetaCase(NamedTuple):
    name: str
    action_dim: int
    low: float
    high: float


def beta_cases() -> list[BetaCase]:
    """The cases timed: one action in ``[0, 1]``, and six in Pendulum's ``[-2, 2]``."""
    return [BetaCase("Box(1) in [0, 1]", 1, 0.0, 1.0), BetaCase("Box(6) in [-2, 2]", 6, -2.0, 2.0)]


# --- hand-written: distrax as users write it inline ---------------------------------


def _beta(params):
    raw_alpha, raw_beta = jnp.split(params, 2, axis=-1)
    alpha, beta = 1.0 + jax.nn.softplus(raw_alpha), 1.0 + jax.nn.softplus(raw_beta)
    return distrax.Independent(distrax.Beta(alpha, beta), 1)


def hand_written_log_likelihood(case, params, x):
    """The hand-written log-likelihood of the action ``low + (high - low) x``."""
    log_width = case.action_dim * jnp.log(jnp.float32(case.high - case.low))
    return _beta(params).log_prob(x) - log_width


def _hand_written(case):
    """``(rollout, loss)``: the rollout stores ``x`` in ``[0, 1]``, the loss scores it."""
    log_width = case.action_dim * jnp.log(jnp.float32(case.high - case.low))

    def rollout(params, key):
        key, subkey = jax.random.split(key)
        x = jnp.clip(_beta(params).sample(seed=subkey), CLIP, 1 - CLIP)
        action = case.low + (case.high - case.low) * x
        return (action, hand_written_log_likelihood(case, params, x), x), key

    def loss(params, x, old_log_likelihood, advantage, key):
        log_likelihood = hand_written_log_likelihood(case, params, x)
        entropy = _beta(params).entropy() + log_width
        return surrogate(log_likelihood, old_log_likelihood, advantage, entropy), key

    return rollout, loss


def _pure_layer(case):
    """``(rollout, loss)`` of the hand-written shape on ``samplers.squashed_beta``."""

    def rollout(params, key):
        key, subkey = jax.random.split(key)
        dist = samplers.squashed_beta(params, case.low, case.high)
        pre_image = dist.sample_pre_image(seed=subkey)
        action, log_likelihood = dist.forward_and_log_prob(pre_image)
        return (action, log_likelihood, pre_image), key

    def loss(params, pre_image, old_log_likelihood, advantage, key):
        dist = samplers.squashed_beta(params, case.low, case.high)
        log_likelihood = dist.log_prob_from_pre_image(pre_image)
        return (
            surrogate(log_likelihood, old_log_likelihood, advantage, dist.entropy()),
            key,
        )

    return rollout, loss


def _head(case):
    """``(rollout, loss, random_input)`` of the ``BetaSampler``, run as
    ``samplers.functional`` runs it (:func:`benchmarks.implementations.head_call`).
    The steps do not return its ``metrics``, so XLA drops them."""

    def build(rngs):
        return samplers.BetaSampler(
            rngs, _W, action_dim=case.action_dim, low=case.low, high=case.high
        )

    call, random_input = implementations.head_call(build)

    def rollout(params, state):
        out, state = call(state, params, None)
        return (out.output["action"], out.output["log_likelihood"], out.rollout_extras), state

    def loss(params, pre_image, old_log_likelihood, advantage, state):
        out, state = call(state, params, pre_image)
        return implementations.head_surrogate(out, old_log_likelihood, advantage), state

    return rollout, loss, random_input


def implementations_of(case: BetaCase) -> list[implementations.Implementation]:
    """The hand-written code first, then the head, then the pure layer."""
    return [
        implementations.Implementation("handwritten", *_hand_written(case)),
        implementations.Implementation("samplers", *_head(case)),
        implementations.Implementation("samplers (pure layer)", *_pure_layer(case)),
    ]


def inputs(case, batch, key):
    """``(params, x, z, old_log_likelihood, advantage)``: the network output, the
    hand-written rollout's stored ``x`` and its log-likelihood, and ``z = logit(x)``,
    the same draw as the samplers side stores it."""
    rollout, _ = _hand_written(case)

    @jax.jit
    def make(key):
        k_params, k_action, k_advantage = jax.random.split(key, 3)
        params = jax.random.normal(k_params, (batch, 2 * case.action_dim))
        (_, log_likelihood, x), _ = rollout(params, k_action)
        advantage = jax.random.normal(k_advantage, (batch,))
        return params, x, jnp.log(x) - jnp.log1p(-x), log_likelihood, advantage

    return make(key)


def time_case(case, batch, rounds):
    """``{workload: interleaved samples}`` of the implementations of ``case`` at ``batch``."""
    params, x, z, old_log_likelihood, advantage = inputs(case, batch, jax.random.key(0))
    steps = {
        impl.name: timing.jitted_steps(
            impl,
            (params,),
            # What each side stores: the hand-written code x, the samplers side z.
            (params, x if impl.name == "handwritten" else z, old_log_likelihood, advantage),
        )
        for impl in implementations_of(case)
    }
    return timing.time_steps(steps, rounds)


def run(batches, out_dir, *, device=None, name="beta", rounds=ROUNDS, command=None):
    """Times every Beta case at each batch size; writes ``{name}.md`` and ``{name}.json``
    and returns the report's text. The arguments are :func:`benchmarks.discrete.run`'s."""
    device = jax.devices()[0] if device is None else device
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    conditions = timing.Conditions(command or "python -m benchmarks --beta", device)
    results = {}
    with jax.default_device(device):
        for case in timing.chosen(beta_cases()):
            for batch in batches:
                print(f"timing {case.name} B={batch} on {device.device_kind}", flush=True)
                results[case.name, batch] = time_case(case, batch, rounds)
                timing.save_partial(out_dir, name, results, _WORKLOADS, conditions)
    conditions.stop()
    sections = [
        "# The Beta head against distrax as users write it",
        "",
        conditions.line(),
        "",
        "Hand-written: `distrax.Independent(distrax.Beta(1 + softplus(raw_alpha), "
        "1 + softplus(raw_beta)), 1)`, the draw `x` clipped to "
        f"`[{CLIP:g}, 1 - {CLIP:g}]` and stored, the action `low + (high - low) x`, the "
        "log-likelihood `log_prob(x) - A log(high - low)` and the entropy `entropy() + "
        "A log(high - low)`. `samplers`: `BetaSampler(rngs, 0.01, action_dim=A, low=low, "
        "high=high)`, which stores the logit `z` and scores it (its exact entropy is the "
        "same formula). `samplers (pure layer)`: the hand-written steps on "
        "`samplers.squashed_beta(params, low, high)` (`sample_pre_image`, "
        "`forward_and_log_prob`, `log_prob_from_pre_image`, `entropy`). Each cell: median "
        f"over {rounds} interleaved rounds of time / hand-written time in the same round "
        "(min-max); below 1 is faster than the hand-written code.",
    ]
    sections += timing.workload_tables(results, _TITLES)
    record = {
        **conditions.record(rounds),
        "timings": timing.workload_records(results, _WORKLOADS),
    }
    return timing.write_report(out_dir, name, sections, record)
