"""``python -m benchmarks --autoregressive``: the autoregressive head against distrax.

``AutoregressiveSampler`` over two categorical steps, a unit and then a target
whose legal values depend on the unit, beside the same policy written inline in
distrax as a JAX RL user writes it: the same conditioner weights (read from the
head's ``Linear -> tanh -> Linear`` conditioners and passed to both sides as
arguments), ``distrax.Categorical`` for the unit, its one-hot embedding
concatenated with the features, the target's masked logits, and the exact entropy
``H(unit) + sum_u p(u) H(target | u)`` with the units enumerated. Both run under
``jax.jit`` on the same features and weights, in interleaved rounds with a fresh
random order each round; a cell is the median over rounds of the ratio of the
head's time to the hand-written time in the same round, with min and max. Before
timing, :func:`differences` checks that the two sides compute the same
log-likelihood, entropy, loss and gradients. Writes ``results/autoregressive.md``
and ``results/autoregressive.json``.
"""

import zlib
from pathlib import Path

import distrax
import jax
import jax.numpy as jnp
from flax import nnx

import samplers
from benchmarks import implementations, timing
from benchmarks.implementations import surrogate

ROUNDS = 21
FEATURES, HIDDEN = 32, 64
NUM_UNITS, NUM_TARGETS = 4, 8
CASE = f"unit Discrete({NUM_UNITS}), target Discrete({NUM_TARGETS}) masked by unit"
TOLERANCE = 1e-4  # the largest difference accepted, relative to the larger magnitude
_W = implementations.ENTROPY_WEIGHT
_WORKLOADS = ("rollout", "loss")
_TITLES = {
    "rollout": "Rollout: sample both sub-actions, log-likelihood, the data to store",
    "loss": "Loss: value and gradient (w.r.t. the features and the conditioner weights) of "
    "the PPO surrogate of the stored action's log-likelihood, plus the exact entropy cost",
}


def build_head(rngs):
    """The head timed: a unit, then a target, default conditioners, exact entropy."""
    steps = {
        "unit": samplers.CategoricalSampler(rngs, 0.0, num_actions=NUM_UNITS),
        "target": samplers.CategoricalSampler(rngs, 0.0, num_actions=NUM_TARGETS),
    }
    return samplers.AutoregressiveSampler(
        steps, features=FEATURES, entropy_weight=_W, rngs=rngs, hidden=HIDDEN
    )


def legal_targets(legal, unit):
    """The targets the unit may take, ``[B, NUM_TARGETS]``, from the table ``legal``
    ``[B, NUM_UNITS, NUM_TARGETS]``: each row's entry for its unit."""
    return jnp.take_along_axis(legal, unit[:, None, None], axis=1)[:, 0]


# --- hand-written: distrax as users write it inline ---------------------------------


def _mlp(layers, x):
    hidden = jnp.tanh(x @ layers["hidden"]["kernel"] + layers["hidden"]["bias"])
    return hidden @ layers["out"]["kernel"] + layers["out"]["bias"]


def _unit(features, weights):
    return distrax.Categorical(logits=_mlp(weights["conditioners"]["unit"], features))


def _target(features, weights, legal, unit):
    x = jnp.concatenate([features, jax.nn.one_hot(unit, NUM_UNITS)], axis=-1)
    logits = _mlp(weights["conditioners"]["target"], x)
    # Mava's and JaxMARL's masking: forbidden logits set to the lowest finite float.
    masked = jnp.where(legal_targets(legal, unit), logits, jnp.finfo(logits.dtype).min)
    return distrax.Categorical(logits=masked)


def hand_written_replay(inputs, legal, stored):
    """``(log_likelihood, entropy)``: the stored actions scored (teacher forcing), and
    the exact entropy ``H(unit) + sum_u p(u) H(target | u)``, the units enumerated."""
    features, weights = inputs
    unit = _unit(features, weights)
    target = _target(features, weights, legal, stored["unit"])
    log_likelihood = unit.log_prob(stored["unit"]) + target.log_prob(stored["target"])
    units = jnp.broadcast_to(jnp.arange(NUM_UNITS)[:, None], (NUM_UNITS, features.shape[0]))
    target_entropies = jax.vmap(lambda u: _target(features, weights, legal, u).entropy())(units)
    entropy = unit.entropy() + jnp.sum(unit.probs * target_entropies.T, axis=-1)
    return log_likelihood, entropy


def _keys_by_name(key, count):
    """The head's keys: its stream's ``fold_in(key, count)``, then each sub-action's
    ``fold_in`` of the crc32 of its name, batched over the names."""
    names = jnp.asarray([zlib.crc32(n.encode()) for n in ("unit", "target")], jnp.uint32)
    drawn = jax.random.fold_in(key, count)
    return jax.vmap(lambda name: jax.random.fold_in(drawn, name))(names)


def _hand_written(keys_by_name=False):
    """``(rollout, loss)``; the rollout splits its key each step (with
    ``keys_by_name``, derives the head's keys from ``(key, count)`` instead), the loss
    draws nothing."""

    def rollout(inputs, legal, key):
        features, weights = inputs
        if keys_by_name:  # key is the stream's (key, count)
            k_unit, k_target = _keys_by_name(*key)
            key = (key[0], key[1] + 1)
        else:
            key, k_unit, k_target = jax.random.split(key, 3)
        unit_dist = _unit(features, weights)
        unit = unit_dist.sample(seed=k_unit)
        target_dist = _target(features, weights, legal, unit)
        target = target_dist.sample(seed=k_target)
        log_likelihood = unit_dist.log_prob(unit) + target_dist.log_prob(target)
        action = {"unit": unit, "target": target}
        return (action, log_likelihood, action), key

    def loss(inputs, legal, stored, old_log_likelihood, advantage, key):
        log_likelihood, entropy = hand_written_replay(inputs, legal, stored)
        return surrogate(log_likelihood, old_log_likelihood, advantage, entropy), key

    return rollout, loss


# --- samplers: the head, as samplers.functional runs one ----------------------------


def head_call():
    """``(call, random_input)``: the head split once, merged inside the step from the
    weights and its stream's state, the stream's state returned.

    ``call(inputs, legal, stored, state) -> (out, next_state)`` with ``inputs =
    (features, weights)``; the target's mask is the head's function form,
    ``lambda prefix: legal_targets(legal, prefix["unit"])``. ``random_input(key)`` is
    the stream's state of the head built with ``nnx.Rngs(key)``.
    """
    graphdef, _, _ = nnx.split(build_head(nnx.Rngs(0)), nnx.Param, ...)

    def call(inputs, legal, stored, state):
        features, weights = inputs
        head = nnx.merge(graphdef, weights, state)
        mask = {"target": lambda prefix: legal_targets(legal, prefix["unit"])}
        out = head((), features, stored, mask=mask)
        return out, nnx.to_pure_dict(nnx.state(head, nnx.Not(nnx.Param)))

    def random_input(key):
        return nnx.to_pure_dict(nnx.state(build_head(nnx.Rngs(key)), nnx.Not(nnx.Param)))

    return call, random_input


def _head():
    """``(rollout, loss, random_input)`` of the head; the steps do not return its
    ``metrics``, so XLA drops them."""
    call, random_input = head_call()

    def rollout(inputs, legal, state):
        out, state = call(inputs, legal, None, state)
        return (out.output["action"], out.output["log_likelihood"], out.rollout_extras), state

    def loss(inputs, legal, stored, old_log_likelihood, advantage, state):
        out, state = call(inputs, legal, stored, state)
        return implementations.head_surrogate(out, old_log_likelihood, advantage), state

    return rollout, loss, random_input


def implementations_of() -> list[implementations.Implementation]:
    """The hand-written code first, then the head, then the hand-written code with the
    head's keys (which separates what the keys cost from what the head adds)."""
    return [
        implementations.Implementation("handwritten", *_hand_written()),
        implementations.Implementation("samplers", *_head()),
        implementations.Implementation(
            "handwritten, the head's keys",
            *_hand_written(keys_by_name=True),
            lambda key: (key, jnp.uint32(0)),
        ),
    ]


def weights(key=0):
    """The conditioners' weights of the head built with ``nnx.Rngs(key)``, a pure dict."""
    return nnx.to_pure_dict(nnx.state(build_head(nnx.Rngs(key)), nnx.Param))


def inputs(batch, key, conditioner_weights=None):
    """``((features, weights), legal, stored, old_log_likelihood, advantage)``.

    The features are standard normal, the weights the head's at initialisation
    (:func:`weights`) unless given; ``legal`` is random booleans ``[B, NUM_UNITS,
    NUM_TARGETS]`` with at least one target allowed per unit; the stored action and
    its log-likelihood are the hand-written rollout's.
    """
    conditioner_weights = weights() if conditioner_weights is None else conditioner_weights
    rollout, _ = _hand_written()

    @jax.jit
    def make(key, conditioner_weights):
        k_features, k_legal, k_allowed, k_action, k_advantage = jax.random.split(key, 5)
        features = jax.random.normal(k_features, (batch, FEATURES))
        legal = jax.random.bernoulli(k_legal, 0.5, (batch, NUM_UNITS, NUM_TARGETS))
        allowed = jax.random.randint(k_allowed, (batch, NUM_UNITS), 0, NUM_TARGETS)
        legal = legal | jax.nn.one_hot(allowed, NUM_TARGETS, dtype=bool)
        params = (features, conditioner_weights)
        (_, log_likelihood, stored), _ = rollout(params, legal, k_action)
        return params, legal, stored, log_likelihood, jax.random.normal(k_advantage, (batch,))

    return make(key, conditioner_weights)


def _relative(got, want):
    """The largest difference of two pytrees over the largest magnitude of ``want``."""
    scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(want))
    gaps = jax.tree.map(lambda a, b: jnp.max(jnp.abs(a - b)), got, want)
    return max(float(g) for g in jax.tree.leaves(gaps)) / (scale or 1.0)


def differences(batch=64, key=0):
    """The largest relative differences between the head and the hand-written code.

    With the head's initial weights, and with its output layers' kernels times 100
    (their 0.01 scaling undone, so that the distributions are far from uniform):
    the log-likelihood of the head's own sample as the hand-written code scores it,
    the entropy (the head's ``-regularization_loss / 0.01``), and the loss's value
    and its gradients w.r.t. the features and the conditioner weights, each over
    the largest magnitude of the hand-written one.

    Raises:
        AssertionError: the head sampled a target that the mask forbids.
    """
    _, hand_written_loss = _hand_written()
    head_rollout, head_loss, _ = _head()
    call, random_input = head_call()
    rollout, replay = jax.jit(head_rollout), jax.jit(hand_written_replay)
    head_replay = jax.jit(call)
    gradient = jax.jit(jax.value_and_grad(head_loss, has_aux=True))
    want_gradient = jax.jit(jax.value_and_grad(hand_written_loss, has_aux=True))
    state, found = random_input(jax.random.key(key + 1)), {}
    initial = weights()
    scaled = jax.tree.map(lambda x: x, initial)  # a copy
    for layers in scaled["conditioners"].values():
        layers["out"]["kernel"] = 100.0 * layers["out"]["kernel"]
    for conditioner_weights in (initial, scaled):
        loss_inputs = inputs(batch, jax.random.key(key), conditioner_weights)
        params, legal, stored = loss_inputs[:3]
        (action, log_likelihood, extras), _ = rollout(params, legal, state)
        allowed = legal_targets(legal, action["unit"])
        if not jnp.all(jnp.take_along_axis(allowed, action["target"][:, None], axis=1)):
            raise AssertionError("the head sampled a target that the mask forbids")
        out, _ = head_replay(params, legal, stored, state)
        (value, _), grad = gradient(*loss_inputs, state)
        (want_value, _), want_grad = want_gradient(*loss_inputs, jax.random.key(key))
        for name, got, want in (
            ("rollout log-likelihood", log_likelihood, replay(params, legal, extras)[0]),
            ("entropy", -out.regularization_loss / _W, replay(params, legal, stored)[1]),
            ("loss", value, want_value),
            ("gradient w.r.t. the features", grad[0], want_grad[0]),
            ("gradient w.r.t. the weights", grad[1], want_grad[1]),
        ):
            found[name] = max(found.get(name, 0.0), _relative(got, want))
    return found


def time_batch(batch, rounds):
    """``{workload: interleaved samples}`` of the implementations at ``batch``."""
    loss_inputs = inputs(batch, jax.random.key(0))  # (features, weights), legal first
    steps = {
        impl.name: timing.jitted_steps(impl, loss_inputs[:2], loss_inputs)
        for impl in implementations_of()
    }
    return timing.time_steps(steps, rounds)


# --- the report -------------------------------------------------------------------


def run(batches, out_dir, *, device=None, name="autoregressive", rounds=ROUNDS, command=None):
    """Checks that both sides agree, times them at each batch size; writes ``{name}.md``
    and ``{name}.json`` and returns the report's text. The arguments are
    :func:`benchmarks.discrete.run`'s.

    Raises:
        AssertionError: the two sides differ by more than ``TOLERANCE``.
    """
    device = jax.devices()[0] if device is None else device
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    conditions = timing.Conditions(command or "python -m benchmarks --autoregressive", device)
    results = {}
    with jax.default_device(device):
        found = differences()
        if max(found.values()) > TOLERANCE:
            raise AssertionError(f"the head and the hand-written code differ: {found}")
        for batch in batches:
            print(f"timing the autoregressive head B={batch} on {device.device_kind}", flush=True)
            results[CASE, batch] = time_batch(batch, rounds)
            timing.save_partial(out_dir, name, results, _WORKLOADS, conditions)
    conditions.stop()
    checked = ", ".join(f"{what} {gap:.1e}" for what, gap in found.items())
    sections = [
        "# The autoregressive head against distrax as users write it",
        "",
        conditions.line(),
        "",
        "`samplers`: `AutoregressiveSampler({'unit': CategoricalSampler(num_actions="
        f"{NUM_UNITS}), 'target': CategoricalSampler(num_actions={NUM_TARGETS})}}, "
        f"features={FEATURES}, hidden={HIDDEN})`, exact entropy, the target's mask "
        "`{'target': lambda prefix: legal_targets(legal, prefix['unit'])}` from a table "
        f"`legal` `[B, {NUM_UNITS}, {NUM_TARGETS}]`, called as `samplers.functional` calls a "
        "head (split once, merged inside the jitted step). Hand-written: the same "
        "conditioner weights (`Linear -> tanh -> Linear`), `distrax.Categorical` for the "
        "unit, its one-hot embedding concatenated with the features, the target's logits "
        "masked with the lowest finite float, the log-likelihoods summed, and the entropy "
        "`H(unit) + sum_u p(u) H(target | u)` with the units enumerated under `jax.vmap`. "
        "Both take the features and the weights as arguments; the loss's gradient is taken "
        "w.r.t. both. Largest differences between the two sides, over the hand-written "
        f"value's largest magnitude (at batch 64): {checked}. Each cell: median over "
        f"{rounds} interleaved rounds of time / hand-written time in the same round "
        "(min-max); below 1 is faster than the hand-written code. The last column is the "
        "hand-written code with the head's keys (its stream's `fold_in(key, count)`, then "
        "`fold_in(key, crc32(name))` per sub-action) in place of one `split`.",
    ]
    sections += timing.workload_tables(results, _TITLES)
    record = {
        **conditions.record(rounds),
        "differences": found,
        "timings": timing.workload_records(results, _WORKLOADS),
    }
    return timing.write_report(out_dir, name, sections, record)
