"""``python -m benchmarks --composite``: the composite heads against distrax as users write it.

Each case is a composite head (``CompositeSampler`` over a ``CategoricalSampler``
and a tanh-squashed ``SquashedNormalSampler``, or a ``ParameterizedSampler``)
beside the distrax code a JAX RL user writes inline for the same action, both
under ``jax.jit`` on the same network output, in interleaved rounds with a fresh
random order each round; a cell is the median over rounds of the ratio of the
head's time to the hand-written time in the same round, with min and max. A third
column calls the composite's own part heads and combines them by hand, which
separates what the composite adds from what its parts cost. Writes
``results/composite.md`` and ``results/composite.json``.
"""

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import distrax
import jax
import jax.numpy as jnp
from flax import nnx

import samplers
from benchmarks import implementations, timing
from benchmarks.implementations import surrogate

ROUNDS = 21
ACTION_DIM = 6  # the Box part of the Dict cases
PARAMETER_DIMS = (1, 2)  # the parameters of the ParameterizedSampler's two actions
_W, _MIN_STD = implementations.ENTROPY_WEIGHT, implementations.MIN_STD
_WORKLOADS = ("rollout", "loss")
_TITLES = {
    "rollout": "Rollout: sample, log-likelihood, the extras to store for the replay",
    "loss": "Loss: value and gradient (w.r.t. the network output) of the PPO surrogate "
    "of the stored action's log-likelihood, plus the entropy cost",
}
# The hand-written entropy of a tanh-squashed Normal, and the head's option that
# computes the same thing.
_ENTROPIES = {
    "base": "the Normal's closed form, `dist.distribution.entropy()`",
    "sample": "the Normal's closed form plus the tanh log-determinant at one "
    "reparameterised sample (as Brax's `NormalTanhDistribution.entropy`)",
}


class CompositeCase(NamedTuple):
    name: str
    num_params: int  # the network output's last axis
    entropy: str  # "base" or "sample", the same on both sides
    head: Callable  # nnx.Rngs -> the samplers head
    # (params, key) -> (action, log_likelihood, rollout_extras): the hand-written rollout.
    rollout: Callable
    # (params, rollout_extras, key) -> (log_likelihood, entropy): the hand-written replay.
    replay: Callable
    # (head, params, rollout_extras) -> (action, log_likelihood, regularization_loss,
    # rollout_extras): the composite's part heads called one by one, combined by hand.
    by_hand: Callable


# --- hand-written: distrax as users write it inline ---------------------------------


def _tanh_normal(mean_and_std):
    mean, raw_std = jnp.split(mean_and_std, 2, axis=-1)
    normal = distrax.MultivariateNormalDiag(mean, jax.nn.softplus(raw_std) + _MIN_STD)
    return distrax.Transformed(normal, distrax.Block(distrax.Tanh(), 1))


def _box_sample(dist, key):
    """The action, its log-likelihood and the pre-image to store."""
    pre_image = dist.distribution.sample(seed=key)
    return dist.bijector.forward(pre_image), _box_log_prob(dist, pre_image), pre_image


def _box_log_prob(dist, pre_image):
    """The stored pre-image scored: the Normal's log-density minus tanh's log-determinant."""
    return dist.distribution.log_prob(pre_image) - dist.bijector.forward_log_det_jacobian(pre_image)


def _box_entropy(dist, entropy, key):
    base = dist.distribution
    if entropy == "base":
        return base.entropy()
    eps = jax.lax.stop_gradient(jax.random.normal(key, base.batch_shape + base.event_shape))
    return base.entropy() + dist.bijector.forward_log_det_jacobian(
        base.mean() + base.stddev() * eps
    )


def _dict_hand_written(num_actions, entropy):
    def parts(params):
        logits, mean_and_std = params[..., :num_actions], params[..., num_actions:]
        return distrax.Categorical(logits=logits), _tanh_normal(mean_and_std)

    def rollout(params, key):
        choose, box = parts(params)
        k_discrete, k_box = jax.random.split(key)
        discrete_action = choose.sample(seed=k_discrete)
        box_action, box_log_prob, pre_image = _box_sample(box, k_box)
        log_likelihood = choose.log_prob(discrete_action) + box_log_prob
        action = {"discrete": discrete_action, "box": box_action}
        return action, log_likelihood, {"discrete": discrete_action, "box": pre_image}

    def replay(params, stored, key):
        choose, box = parts(params)
        log_likelihood = choose.log_prob(stored["discrete"]) + _box_log_prob(box, stored["box"])
        return log_likelihood, choose.entropy() + _box_entropy(box, entropy, key)

    return rollout, replay


def _parameterized_hand_written(entropy):
    num = len(PARAMETER_DIMS)
    edges = list(itertools.accumulate((2 * dim for dim in PARAMETER_DIMS), initial=num))

    def parts(params):
        choose = distrax.Categorical(logits=params[..., :num])
        boxes = [_tanh_normal(params[..., a:b]) for a, b in itertools.pairwise(edges)]
        return choose, boxes

    def pick(choice, values):
        """The chosen action's value: a one-hot-selected sum."""
        return jnp.sum(jax.nn.one_hot(choice, num) * jnp.stack(values, -1), axis=-1)

    def rollout(params, key):
        choose, boxes = parts(params)
        k_choice, *k_boxes = jax.random.split(key, 1 + num)
        choice = choose.sample(seed=k_choice)
        sampled = [_box_sample(box, k) for box, k in zip(boxes, k_boxes, strict=True)]
        log_likelihood = choose.log_prob(choice) + pick(choice, [s[1] for s in sampled])
        action = {"choice": choice, "parameters": tuple(s[0] for s in sampled)}
        return (
            action,
            log_likelihood,
            {"choice": choice, "parameters": tuple(s[2] for s in sampled)},
        )

    def replay(params, stored, key):
        choose, boxes = parts(params)
        choice = stored["choice"]
        scored = [_box_log_prob(b, z) for b, z in zip(boxes, stored["parameters"], strict=True)]
        keys = jax.random.split(key, num)
        entropies = [_box_entropy(b, entropy, k) for b, k in zip(boxes, keys, strict=True)]
        conditional = jnp.sum(choose.probs * jnp.stack(entropies, -1), axis=-1)
        return choose.log_prob(choice) + pick(choice, scored), choose.entropy() + conditional

    return rollout, replay


# --- samplers: the heads, and their parts combined by hand -------------------------


def _dict_head(num_actions, entropy):
    def build(rngs):
        parts = {
            "discrete": samplers.CategoricalSampler(rngs, _W, num_actions=num_actions),
            "box": samplers.SquashedNormalSampler(rngs, _W, action_dim=ACTION_DIM, entropy=entropy),
        }
        return samplers.CompositeSampler(parts, rngs=rngs)

    return build


def _dict_by_hand(head, params, stored):
    outputs, start = {}, 0
    for name in ("discrete", "box"):
        part = head.parts[name]
        extras = None if stored is None else stored[name]
        outputs[name] = part((), params[..., start : start + part.num_params], extras)
        start += part.num_params
    d, b = outputs["discrete"], outputs["box"]
    return (
        {name: out.output["action"] for name, out in outputs.items()},
        d.output["log_likelihood"] + b.output["log_likelihood"],
        d.regularization_loss + b.regularization_loss,
        {name: out.rollout_extras for name, out in outputs.items()},
    )


def _parameterized_head(entropy):
    def build(rngs):
        choice = samplers.CategoricalSampler(rngs, _W, num_actions=len(PARAMETER_DIMS))
        parameters = tuple(
            samplers.SquashedNormalSampler(rngs, _W, action_dim=dim, entropy=entropy)
            for dim in PARAMETER_DIMS
        )
        return samplers.ParameterizedSampler(choice, parameters, rngs=rngs)

    return build


def _parameterized_by_hand(head, params, stored):
    num = head.choice.num_params
    logits = params[..., :num]
    chosen = head.choice((), logits, None if stored is None else stored["choice"])
    outputs, start = [], num
    for i, part in enumerate(head.parameters):
        extras = None if stored is None else stored["parameters"][i]
        outputs.append(part((), params[..., start : start + part.num_params], extras))
        start += part.num_params
    choice = chosen.output["action"]
    one_hot = jax.nn.one_hot(choice, num)
    log_likelihoods = jnp.stack([out.output["log_likelihood"] for out in outputs], -1)
    losses = jnp.stack([out.regularization_loss for out in outputs], -1)
    probs = jax.nn.softmax(logits)
    return (
        {"choice": choice, "parameters": tuple(out.output["action"] for out in outputs)},
        chosen.output["log_likelihood"] + jnp.sum(one_hot * log_likelihoods, axis=-1),
        chosen.regularization_loss + jnp.sum(probs * losses, axis=-1),
        {"choice": choice, "parameters": tuple(out.rollout_extras for out in outputs)},
    )


def composite_cases() -> list[CompositeCase]:
    """The cases timed: Dicts of a Categorical and a 6-d tanh Normal, and a parameterised choice."""
    cases = []
    for num_actions, entropy in ((3, "base"), (3, "sample"), (18, "base"), (18, "sample")):
        cases.append(
            CompositeCase(
                f"Dict(Discrete({num_actions}), Box({ACTION_DIM})), {entropy} entropy",
                num_actions + 2 * ACTION_DIM,
                entropy,
                _dict_head(num_actions, entropy),
                *_dict_hand_written(num_actions, entropy),
                _dict_by_hand,
            )
        )
    dims = ", ".join(f"Box({dim})" for dim in PARAMETER_DIMS)
    cases.append(
        CompositeCase(
            f"Parameterized(Discrete({len(PARAMETER_DIMS)}); {dims}), base entropy",
            len(PARAMETER_DIMS) + 2 * sum(PARAMETER_DIMS),
            "base",
            _parameterized_head("base"),
            *_parameterized_hand_written("base"),
            _parameterized_by_hand,
        )
    )
    return cases


# --- the timed steps ----------------------------------------------------------------


def _hand_written_steps(case):
    """``(rollout, loss)``, each threading a key that it splits every step."""

    def rollout(params, key):
        key, subkey = jax.random.split(key)
        return case.rollout(params, subkey), key

    def loss(params, stored, old_log_likelihood, advantage, key):
        if case.entropy == "base":  # draws nothing, splits nothing
            log_likelihood, entropy = case.replay(params, stored, key)
        else:
            key, subkey = jax.random.split(key)
            log_likelihood, entropy = case.replay(params, stored, subkey)
        return surrogate(log_likelihood, old_log_likelihood, advantage, entropy), key

    return rollout, loss


def _head_steps(call):
    """``(rollout, loss)`` of ``call(state, params, stored) -> ((action, log_likelihood,
    regularization_loss, rollout_extras), next_state)``, the head's stream state
    threaded through."""

    def rollout(params, state):
        (action, log_likelihood, _, extras), state = call(state, params, None)
        return (action, log_likelihood, extras), state

    def loss(params, stored, old_log_likelihood, advantage, state):
        (_, log_likelihood, regularization_loss, _), state = call(state, params, stored)
        entropy = -regularization_loss / _W
        return surrogate(log_likelihood, old_log_likelihood, advantage, entropy), state

    return rollout, loss


def implementations_of(case: CompositeCase) -> list[implementations.Implementation]:
    """The hand-written code first, then the composite head and its parts by hand.

    The head runs as ``samplers.functional`` runs it: split once, merged inside the
    jitted step, its streams' state passed in and returned. The timed steps do not
    return the head's ``metrics``, so XLA drops them.
    """
    call, random_input = implementations.head_call(case.head)
    graphdef, _ = nnx.split(case.head(nnx.Rngs(0)))

    def composite(state, params, stored):
        out, state = call(state, params, stored)
        outputs = (out.output["action"], out.output["log_likelihood"], out.regularization_loss)
        return (*outputs, out.rollout_extras), state

    def parts(state, params, stored):
        head = nnx.merge(graphdef, state)
        return case.by_hand(head, params, stored), nnx.to_pure_dict(nnx.state(head))

    return [
        implementations.Implementation("handwritten", *_hand_written_steps(case)),
        implementations.Implementation("samplers", *_head_steps(composite), random_input),
        implementations.Implementation(
            "samplers parts, combined by hand", *_head_steps(parts), random_input
        ),
    ]


def inputs(case, batch, key):
    """``(params, stored, old_log_likelihood, advantage)``: the network output, and the
    hand-written rollout's stored action (in the head's ``rollout_extras`` structure)
    and its log-likelihood."""

    @jax.jit
    def make(key):
        k_params, k_action, k_advantage = jax.random.split(key, 3)
        params = jax.random.normal(k_params, (batch, case.num_params))
        _, log_likelihood, stored = case.rollout(params, k_action)
        return params, stored, log_likelihood, jax.random.normal(k_advantage, (batch,))

    return make(key)


def time_case(case, batch, rounds):
    """``{workload: interleaved samples}`` of the implementations of ``case`` at ``batch``."""
    loss_inputs = inputs(case, batch, jax.random.key(0))  # params first
    impls = implementations_of(case)
    steps = {impl.name: timing.jitted_steps(impl, loss_inputs[:1], loss_inputs) for impl in impls}
    return timing.time_steps(steps, rounds)


def calls_alone(case):
    """``(hand-written, head)`` steps that do only what a call of each must.

    The hand-written one splits its key twice, as its rollouts do; the head's merges
    the head, draws two keys (the sample's and the entropy's, as every part draws per
    call) from each part's stream and returns the state. Both return the keys drawn.
    """
    graphdef, _ = nnx.split(case.head(nnx.Rngs(0)))

    def hand_written(params, key):
        key, subkey = jax.random.split(key)
        return jax.random.key_data(jax.random.split(subkey)), key

    def head(params, state):
        module = nnx.merge(graphdef, state)
        streams = [s for _, s in nnx.iter_graph(module) if isinstance(s, nnx.RngStream)]
        keys = jnp.stack([jax.random.key_data(s()) for s in streams for _ in range(2)])
        return keys, nnx.to_pure_dict(nnx.state(module))

    return hand_written, head


def time_calls(case, batch, rounds):
    """Interleaved samples of the rollouts beside the calls alone (:func:`calls_alone`)."""
    params, _, _, _ = inputs(case, batch, jax.random.key(0))
    hand_written, head = implementations_of(case)[:2]
    key, state = jax.random.key(1), head.random_input(jax.random.key(1))
    hand_written_call, head_call = calls_alone(case)
    fns = {
        "hand-written rollout": (jax.jit(hand_written.rollout), (params, key)),
        "samplers rollout": (jax.jit(head.rollout), (params, state)),
        "hand-written key split alone": (jax.jit(hand_written_call), (params, key)),
        "samplers streams alone": (jax.jit(head_call), (params, state)),
    }
    return timing.interleaved(fns, rounds)


def time_entropies(batch, rounds, num_actions=18):
    """Interleaved samples of the Dict head's loss with each entropy option.

    Against the hand-written loss with the Normal's closed-form entropy; the
    hand-written loss with the one-sample estimate is timed too.
    """
    cases = {
        c.entropy: c
        for c in composite_cases()
        if c.name.startswith(f"Dict(Discrete({num_actions})")
    }
    params, stored, old_log_likelihood, advantage = inputs(cases["base"], batch, jax.random.key(0))
    fns = {}
    for entropy in ("base", "sample"):
        hand_written = implementations_of(cases[entropy])[0]
        fns[f"hand-written, {entropy}"] = (hand_written.loss, jax.random.key(1))
    for entropy in ("base", "sample", "exact", "quadrature"):
        case = cases["base"]._replace(entropy=entropy, head=_dict_head(num_actions, entropy))
        head = implementations_of(case)[1]
        fns[f"samplers, {entropy}"] = (head.loss, head.random_input(jax.random.key(1)))
    timed = {
        name: (timing.jitted_gradient(loss), (params, stored, old_log_likelihood, advantage, rng))
        for name, (loss, rng) in fns.items()
    }
    return timing.interleaved(timed, rounds)


# --- the report -------------------------------------------------------------------


def run(batches, out_dir, *, device=None, name="composite", rounds=ROUNDS, command=None):
    """Times every composite case at each batch size; writes ``{name}.md`` and ``{name}.json``.

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
    command = command or "python -m benchmarks --composite"
    conditions = timing.Conditions(command, device)
    results, calls, smallest, largest = {}, {}, min(batches), max(batches)
    with jax.default_device(device):
        cases = timing.chosen(composite_cases())
        for case in cases:
            for batch in batches:
                print(f"timing {case.name} B={batch} on {device.device_kind}", flush=True)
                results[case.name, batch] = time_case(case, batch, rounds)
                timing.save_partial(out_dir, name, results, _WORKLOADS, conditions)
        for case in cases:
            print(f"timing the calls of {case.name} B={smallest}", flush=True)
            calls[case.name] = time_calls(case, smallest, rounds)
        print(f"timing the entropy options B={largest}", flush=True)
        entropies = time_entropies(largest, rounds)
    conditions.stop()
    described = "; ".join(f"`{option}`: {text}" for option, text in _ENTROPIES.items())
    sections = [
        "# Composite heads against distrax as users write it",
        "",
        conditions.line(),
        "",
        "Dict cases: `CompositeSampler({'discrete': CategoricalSampler, 'box': "
        f"SquashedNormalSampler(action_dim={ACTION_DIM})}})` against `distrax.Categorical` and "
        "`distrax.Transformed(MultivariateNormalDiag(mean, softplus(raw_std) + 1e-3), "
        "Block(Tanh(), 1))`, the stored pre-image scored as the Normal's log-density minus "
        "tanh's log-determinant, the log-likelihoods summed. Parameterized: "
        f"`ParameterizedSampler` choosing between parameters of sizes {PARAMETER_DIMS} against "
        "the hand-written one-hot-selected sum of the parameters' log-likelihoods, and the "
        "entropy `H(choice) + sum_k p(k) H(parameters k)`. The squashed Normal's entropy is "
        f"the same on both sides, the head's `entropy=` option: {described}. "
        f"Each cell: median over {rounds} interleaved rounds of time / hand-written time in "
        "the same round (min-max); below 1 is faster than the hand-written code. "
        "`samplers parts, combined by hand`: the composite's own part heads called one by "
        "one and combined as the hand-written code combines its distributions.",
    ]
    sections += timing.workload_tables(results, _TITLES)
    call_names = list(next(iter(calls.values())))
    reference_entropy, *other_entropies = entropies
    sections += [
        "",
        f"## The call alone (B = {smallest})",
        "",
        "Microseconds per call (median over the rounds) of the rollouts beside steps that "
        "do only what a call must: the hand-written code splits its key; the head is merged "
        "from its state, draws two keys from each part's stream (the sample's and the "
        "entropy's, as each part does per call) and returns its state.",
        "",
        timing.table(
            [
                [case, *(f"{timing.summary(cells[n])[0] * 1e6:.1f}" for n in call_names)]
                for case, cells in calls.items()
            ],
            ["case", *(f"{n} (us)" for n in call_names)],
        ),
        "",
        f"## Entropy options (loss, B = {largest})",
        "",
        f"The loss of the Dict(Discrete(18), Box({ACTION_DIM})) head with each `entropy=` "
        "option of its squashed Normal, beside the hand-written loss with the one-sample "
        "estimate, against the hand-written loss with the Normal's closed-form entropy "
        f"({timing.summary(entropies[reference_entropy])[0] * 1e3:.4f} ms). `exact` is what "
        "`samplers.head_for` gives a bounded Box inside a Dict or Tuple space unless "
        "`entropy=` is passed.",
        "",
        timing.table(
            [
                [n, f"{timing.summary(entropies[n])[0] * 1e3:.4f}", timing.ratio_cell(entropies[n])]
                for n in other_entropies
            ],
            ["implementation", "ms", f"time / {reference_entropy}"],
        ),
    ]
    record = {
        **conditions.record(rounds),
        "timings": timing.workload_records(results, _WORKLOADS),
        "calls": [
            record
            for case, cells in calls.items()
            for record in timing.records(cells, case=case, batch=smallest)
        ],
        "entropies": timing.records(entropies, batch=largest),
    }
    return timing.write_report(out_dir, name, sections, record)
