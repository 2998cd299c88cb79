"""``python -m benchmarks --flow``: the flow head against the same flow written in distrax.

Each case is ``samplers.FlowSampler`` beside the same flow as a distrax user writes it:
a base ``distrax.Independent(distrax.Normal(mean, std), 1)`` and a ``distrax.Chain`` of
``distrax.MaskedCoupling`` layers whose conditioners are the head's own MLPs, with the
head's parameters, as pure functions of them, then tanh. Both store the squashing's
pre-image ``x_K`` and score it in the loss through the layers' inverses
(``inverse_and_log_det``), and both estimate the entropy as the Normal's plus the
log-determinant at one draw. The hand-written rollout and actor score a fresh draw
forward (``forward_and_log_det``); the head's rollout scores it as its replay will,
through the inverses after the forward pass (the last layer's conditioner evaluated
once), and its actor step (``reparameterized``) forward. Both run under ``jax.jit`` on
the same network output ``[mean | raw_std | features]``, in interleaved rounds with a
fresh random order each round; a cell is the median over rounds of the ratio of the
head's time to the hand-written time in the same round, with min and max. A third
column runs the
hand-written steps on ``samplers.squashed_flow`` of the same layers (the pure layer),
which separates what the module adds from what the distribution costs; its actor step
takes ``sample_and_log_prob``, which scores the draw forward. The gradients are
with respect to the network output (as in the other suites), which reaches every layer
of the conditioners through the features. Writes ``results/flow.md`` and
``results/flow.json``.
"""

import itertools
from pathlib import Path
from typing import NamedTuple

import distrax
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import samplers
from benchmarks import implementations, timing
from benchmarks.implementations import ALPHA, ENTROPY_WEIGHT, MIN_STD, STD_SCALE, surrogate

ROUNDS = 11
A, F, HIDDEN = 8, 16, (64, 64)
_WORKLOADS = ("rollout", "loss", "actor")
_TITLES = {
    "rollout": "Rollout: sample, log-likelihood, the pre-squash action to store",
    "loss": "Loss: value and gradient of the PPO surrogate of the stored pre-image's "
    "log-likelihood, plus the one-draw entropy cost",
    "actor": "SAC actor: value and gradient of mean(alpha log pi(a) - Q(a)) for a fresh "
    "reparameterised sample",
}


class FlowCase(NamedTuple):
    name: str
    num_layers: int
    transform: str | tuple[str, int]


def flow_cases() -> list[FlowCase]:
    """Affine coupling layers, K = 1, 2 and 4 (the cost of a layer), and two spline
    layers of 8 bins."""
    return [
        *(FlowCase(f"affine, K = {k}", k, "affine") for k in (1, 2, 4)),
        FlowCase("spline(8), K = 2", 2, ("spline", 8)),
    ]


def _build(case, reparameterized=False):
    def build(rngs):
        return samplers.FlowSampler(
            rngs,
            ENTROPY_WEIGHT,
            action_dim=A,
            feature_dim=F,
            num_layers=case.num_layers,
            transform=case.transform,
            hidden_sizes=HIDDEN,
            min_std=MIN_STD,
            std_scale=STD_SCALE,
            reparameterized=reparameterized,
        )

    return build


def _learned(params, seed=0):
    """The conditioners' parameters moved off their zero start, as training leaves them."""
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    moved = [
        leaf + 0.1 * jax.random.normal(k, leaf.shape) for leaf, k in zip(leaves, keys, strict=True)
    ]
    return jax.tree.unflatten(tree, moved)


def conditioner_params(case):
    """The head's conditioner parameters (a pure dict), moved off their start."""
    head = _build(case)(nnx.Rngs(0))
    return _learned(nnx.to_pure_dict(nnx.state(head, nnx.Param)))


# --- hand-written: the same flow in distrax ------------------------------------------


def _mlp(params, x):
    hidden = params["hidden"]
    for index in range(len(hidden)):
        x = jax.nn.relu(x @ hidden[index]["kernel"] + hidden[index]["bias"])
    return x @ params["out"]["kernel"] + params["out"]["bias"]


def _inner(transform):
    if transform == "affine":

        def affine(p):
            return distrax.ScalarAffine(shift=p[..., 0], log_scale=3.0 * jnp.tanh(p[..., 1] / 3.0))

        return affine
    return lambda p: distrax.RationalQuadraticSpline(p, -5.0, 5.0, boundary_slopes="identity")


def hand_written_flow(case, inputs, params):
    """``(base, layers)`` of the flow for the network output ``inputs``: the base Normal
    and the coupling layers as one ``distrax.Chain`` (``g_1`` applied first)."""
    mean, raw_std, features = jnp.split(inputs, [A, 2 * A], axis=-1)
    std = (jax.nn.softplus(raw_std) + MIN_STD) * STD_SCALE
    layers = []
    for index in range(case.num_layers):
        mlp = params["conditioners"][index]

        def conditioner(kept, mlp=mlp):
            seen = jnp.broadcast_to(features, (*kept.shape[:-1], F))
            return _mlp(mlp, jnp.concatenate([kept, seen], -1)).reshape(*kept.shape, -1)

        keep = jnp.asarray(np.arange(A) % 2 == index % 2)
        layers.append(distrax.MaskedCoupling(keep, conditioner, _inner(case.transform)))
    base = distrax.Independent(distrax.Normal(mean, std), 1)
    return base, distrax.Chain(layers[::-1])


def _tanh_log_det(x):
    return jnp.sum(distrax.Tanh().forward_log_det_jacobian(x), axis=-1)


def _hand_written(case):
    def sample(inputs, random_input):
        """A fresh draw: ``(action, log_likelihood, x_K, next_random_input)``, scored
        forward (the change of variables of the draw)."""
        key, params = random_input
        key, subkey = jax.random.split(key)
        base, layers = hand_written_flow(case, inputs, params)
        x0 = base.sample(seed=subkey)
        x_k, log_det = layers.forward_and_log_det(x0)
        log_likelihood = base.log_prob(x0) - log_det - _tanh_log_det(x_k)
        return jnp.tanh(x_k), log_likelihood, x_k, (key, params)

    def rollout(inputs, random_input):
        action, log_likelihood, x_k, random_input = sample(inputs, random_input)
        return (action, log_likelihood, x_k), random_input

    def loss(inputs, x_k, old_log_likelihood, advantage, random_input):
        key, params = random_input
        key, subkey = jax.random.split(key)
        base, layers = hand_written_flow(case, inputs, params)
        # The stored pre-squash action, scored through the layers' inverses.
        x0, inverse_log_det = layers.inverse_and_log_det(x_k)
        log_likelihood = base.log_prob(x0) + inverse_log_det - _tanh_log_det(x_k)
        # The entropy at one draw, its noise a constant: gradients reach mean and std.
        loc, scale = base.distribution.loc, base.distribution.scale
        eps = jax.random.normal(subkey, loc.shape)
        fresh, log_det = layers.forward_and_log_det(loc + scale * eps)
        entropy = base.entropy() + log_det + _tanh_log_det(fresh)
        return surrogate(log_likelihood, old_log_likelihood, advantage, entropy), (key, params)

    def actor(inputs, random_input):
        action, log_likelihood, _, random_input = sample(inputs, random_input)
        objective = jnp.mean(ALPHA * log_likelihood - implementations.critic(action))
        return objective, random_input

    return rollout, loss, actor


def _pure_layer(case):
    """The hand-written steps on ``samplers.squashed_flow`` with the same layers: what
    the distribution costs, without the module."""

    def flow_of(inputs, params):
        _, layers = hand_written_flow(case, inputs, params)
        return samplers.squashed_flow(
            inputs[..., : 2 * A],
            layers.bijectors[::-1],  # g_1 first
            samplers.Tanh(),
            min_std=MIN_STD,
            std_scale=STD_SCALE,
        )

    def rollout(inputs, random_input):
        key, params = random_input
        key, subkey = jax.random.split(key)
        dist = flow_of(inputs, params)
        action, x_k, log_likelihood = dist.sample_with_replay(seed=subkey)
        return (action, log_likelihood, x_k), (key, params)

    def loss(inputs, x_k, old_log_likelihood, advantage, random_input):
        key, params = random_input
        key, subkey = jax.random.split(key)
        dist = flow_of(inputs, params)
        entropy = dist.entropy_estimate(seed=subkey)
        log_likelihood = dist.log_prob_from_pre_image(x_k)
        return surrogate(log_likelihood, old_log_likelihood, advantage, entropy), (key, params)

    def actor(inputs, random_input):
        key, params = random_input
        key, subkey = jax.random.split(key)
        dist = flow_of(inputs, params)
        action, log_likelihood = dist.sample_and_log_prob(seed=subkey)  # scored forward
        objective = jnp.mean(ALPHA * log_likelihood - implementations.critic(action))
        return objective, (key, params)

    return rollout, loss, actor


def _head(case, params):
    """``(rollout, loss, actor, random_input)`` of the head, run as
    ``samplers.functional`` runs it, with the conditioner parameters ``params``."""
    call, random_input = implementations.head_call(_build(case))
    actor_call, actor_random_input = implementations.head_call(_build(case, True))

    def with_params(make):
        def state(key):
            return {**make(key), "conditioners": params["conditioners"]}

        return state

    def rollout(inputs, state):
        out, state = call(state, inputs, None)
        return (out.output["action"], out.output["log_likelihood"], out.rollout_extras), state

    def loss(inputs, x_k, old_log_likelihood, advantage, state):
        out, state = call(state, inputs, x_k)
        return implementations.head_surrogate(out, old_log_likelihood, advantage), state

    def actor(inputs, state):
        out, state = actor_call(state, inputs, None)
        action, log_likelihood = out.output["action"], out.output["log_likelihood"]
        return jnp.mean(ALPHA * log_likelihood - implementations.critic(action)), state

    return rollout, loss, actor, with_params(random_input), with_params(actor_random_input)


def time_case(case, batch, rounds):
    """``{workload: interleaved samples}`` of the hand-written flow, the pure layer and
    the head."""
    params = conditioner_params(case)
    inputs = jax.random.normal(jax.random.key(0), (batch, 2 * A + F))
    hand_rollout, hand_loss, hand_actor = _hand_written(case)
    head_rollout, head_loss, head_actor, head_input, actor_input = _head(case, params)
    hand_input = (jax.random.key(1), params)
    (_, old, x_k), _ = jax.jit(hand_rollout)(inputs, hand_input)
    advantage = jax.random.normal(jax.random.key(2), (batch,))
    steps = {
        "handwritten": (hand_rollout, hand_loss, hand_actor, hand_input, hand_input),
        "samplers (pure layer)": (*_pure_layer(case), hand_input, hand_input),
        "samplers": (
            head_rollout,
            head_loss,
            head_actor,
            head_input(jax.random.key(1)),
            actor_input(jax.random.key(1)),
        ),
    }

    def workload(index, args, gradient):
        return {
            name: (
                timing.jitted_gradient(functions[index]) if gradient else jax.jit(functions[index]),
                (*args, functions[3 if index < 2 else 4]),
            )
            for name, functions in steps.items()
        }

    return {
        "rollout": timing.interleaved(workload(0, (inputs,), False), rounds),
        "loss": timing.interleaved(workload(1, (inputs, x_k, old, advantage), True), rounds),
        "actor": timing.interleaved(workload(2, (inputs,), True), rounds),
    }


def run(batches, out_dir, *, device=None, name="flow", rounds=ROUNDS, command=None):
    """Times every flow case at each batch size; writes ``{name}.md`` and ``{name}.json``
    and returns the report's text. The arguments are :func:`benchmarks.discrete.run`'s."""
    device = jax.devices()[0] if device is None else device
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    conditions = timing.Conditions(command or "python -m benchmarks --flow", device)
    results = {}
    with jax.default_device(device):
        for case, batch in itertools.product(timing.chosen(flow_cases()), batches):
            print(f"timing {case.name} B={batch} on {device.device_kind}", flush=True)
            results[case.name, batch] = time_case(case, batch, rounds)
            timing.save_partial(out_dir, name, results, _WORKLOADS, conditions)
    conditions.stop()
    sections = [
        "# The flow head against the same flow written in distrax",
        "",
        conditions.line(),
        "",
        f"A = {A} action dimensions, F = {F} features, conditioners of hidden widths "
        f"{HIDDEN}. Hand-written: `Independent(Normal(mean, std), 1)`, a `distrax.Chain` "
        "of `MaskedCoupling` layers calling the head's MLPs as pure functions of the "
        "same parameters, then tanh; the rollout and the actor step score a fresh draw "
        "forward (`forward_and_log_det`), the rollout stores the pre-squash `x_K`, the "
        "loss scores it through the layers' inverses (`inverse_and_log_det`) and adds "
        "the entropy `base.entropy() + log_det(mean + std * eps)` (`eps` a fresh draw, a "
        "constant). `samplers`: `FlowSampler(rngs, 0.01, "
        f"action_dim={A}, feature_dim={F}, num_layers=K, transform=..., "
        f"hidden_sizes={HIDDEN})` through the path `samplers.functional` takes, "
        "`reparameterized=True` for the actor step. `samplers (pure layer)`: the "
        "hand-written steps on `samplers.squashed_flow` of the same layers "
        "(`sample_with_replay` in the rollout, "
        "`log_prob_from_pre_image` and `entropy_estimate` in the loss, "
        "`sample_and_log_prob` in the actor step), which separates what the module adds. "
        "The rollouts of the head and of the pure layer score a fresh draw as their "
        "replay will: the layers' inverses after their forward pass, the last layer's "
        "conditioner evaluated once (its input, the dimensions it keeps, is the same both "
        "ways); the actor steps of "
        "both score it forward, as the hand-written one does. Each "
        "cell: median over "
        f"{rounds} interleaved rounds of time / hand-written time in the same round "
        "(min-max); below 1 is faster than the hand-written code.",
    ]
    sections += timing.workload_tables(results, _TITLES)
    record = {
        **conditions.record(rounds),
        "timings": timing.workload_records(results, _WORKLOADS),
    }
    return timing.write_report(out_dir, name, sections, record)
