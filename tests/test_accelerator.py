"""The numeric guarantees on whatever backend JAX runs on: the accelerator tier.

Run alone, in one process, on a CPU, a GPU or a TPU::

    python -m pytest tests/test_accelerator.py -m accelerator -n 0

It checks, for the squashed-Normal heads (tanh and ``BoundedTanh`` with asymmetric
per-dimension bounds), the Categorical, Beta, composite, autoregressive and flow heads
(and for the token head, (a) to (c) and (e)):

(a) a rollout and the replay of its stored data inside one compiled program give the
    same log-likelihood, bit for bit;
(b) the first PPO ratio: a rollout compiled as one program and the replay of its data
    as another give the same log-likelihood, bit for bit (the flow head: within the
    bound it documents, ``1e-6`` relative plus ``1e-6``);
(c) the gradients of the replayed log-likelihood and of a reparameterised actor loss
    ``0.2 * log_likelihood - Q(action)`` with respect to the network output and the
    head's own parameters are finite at saturated means (``|pre-image| >= 10``);
(d) log-densities, entropies and their gradients against float64 oracles: the 50-digit
    ``tests/oracle.py`` for the squashed Normal, ``mpmath`` for the Beta, float64 NumPy
    formulas written here for the rest;
(e) ``TokenCategorical`` in the patterns GRPO trainers run it in
    (``tests/_token_patterns.py``): a ``lax.scan`` decode loop of 16 steps at 1, 7, 32,
    48 and 256 rows a step, replayed as the whole ``[T, R]`` batch, as shuffled
    minibatches and under ``jax.grad``, truncated (rollout and replay blocks different)
    and not, with float32 and bfloat16 tables: the replayed log-probability is the
    sampled one, bit for bit.

Every check measures its figure (the largest error over its grid, in the unit it
states) and compares it with the tolerance of the backend it runs on, from
``TOLERANCES``; a backend without its own column uses the TPU's. Matrix products run at
the backend's default precision, as a user's do. With ``SAMPLERS_ACCELERATOR_REPORT``
naming a file, the tier writes every figure there as JSON and prints them as a table.

The tier compiles a handful of programs, each evaluating a whole grid of cases as one
array: an accelerator pays a round trip for every eager operation.
"""

import dataclasses
import functools
import itertools
import json
import math
import os
import platform

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from mpmath import mp

import samplers
from tests import _token_patterns, oracle

pytestmark = pytest.mark.accelerator

EPS = 2.0**-23  # float32
BACKEND = jax.default_backend()

# The largest error each check may measure, per backend, in the unit its test states.
# On the CPU the bounds are those the library documents (the guarantees guide) where it
# documents one; elsewhere a few roundings of the quantity's terms.
TOLERANCES = {
    "cpu": {
        "replay in one program": 0.0,
        "first PPO ratio": 0.0,
        "first PPO ratio, flow": 1e-6,
        "non-finite gradients": 0,
        "normal log_prob_from_pre_image": 16 * EPS,
        "normal log_prob_from_pre_image gradients": 16 * EPS,
        "normal log_prob of an action": 4 * EPS,
        "normal log_prob of an action, gradients": 64 * EPS,
        "normal entropy": 1e-5,
        "normal entropy gradients": 1e-5,
        "normal head, softplus std": 16 * EPS,
        "normal head, softplus std, gradients": 16 * EPS,
        "categorical log_prob and entropy": 16 * EPS,
        "categorical gradients": 16 * EPS,
        "beta log_prob_from_pre_image": 32 * EPS,
        "beta log_prob_from_pre_image gradients": 32 * EPS,
        "beta entropy": 32 * EPS,
        "beta entropy gradients": 32 * EPS,
        "composite log-likelihood": 16 * EPS,
        "autoregressive log-likelihood": 16 * EPS,
        "flow log-likelihood": 1e-5,
        "token replay patterns": 0.0,
    },
    # The TPU's float32 transcendental functions are less accurate (softplus about 1e-4
    # relative), and its default matrix products round their inputs to bfloat16: the
    # oracle comparisons hold there to about 1e-4 of their unit, not to a few eps.
    "tpu": {
        "replay in one program": 0.0,
        "first PPO ratio": 0.0,
        "first PPO ratio, flow": 1e-6,
        "non-finite gradients": 0,
        "normal log_prob_from_pre_image": 2e-4,
        "normal log_prob_from_pre_image gradients": 2e-4,
        "normal log_prob of an action": 2e-4,
        "normal log_prob of an action, gradients": 1e-3,
        "normal entropy": 1e-4,
        "normal entropy gradients": 1e-4,
        "normal head, softplus std": 1e-3,
        "normal head, softplus std, gradients": 1e-3,
        "categorical log_prob and entropy": 2e-4,
        "categorical gradients": 2e-4,
        "beta log_prob_from_pre_image": 5e-4,
        "beta log_prob_from_pre_image gradients": 5e-4,
        "beta entropy": 5e-4,
        "beta entropy gradients": 5e-4,
        "composite log-likelihood": 2e-4,
        "autoregressive log-likelihood": 1e-3,
        "flow log-likelihood": 2e-3,
        "token replay patterns": 0.0,
    },
}
TOLERANCE = TOLERANCES.get(BACKEND, TOLERANCES["tpu"])

# ---------------------------------------------------------------------------------
# The report: every check's measured figure, written at the end of the module.

_MEASURED: list[dict] = []
# The failures of a test that measures several figures, reported once all are measured.
_PENDING: list[str] | None = None


def _measure(check: str, case: str, error, unit: str) -> None:
    """Records the largest of ``error`` for ``check`` on ``case`` and asserts that it is
    within the backend's tolerance (NaN, where a value should be finite, fails)."""
    error = np.asarray(error, np.float64)
    worst = float(np.max(error)) if error.size else 0.0
    if error.size and np.any(np.isnan(error)):
        worst = math.nan
    tolerance = TOLERANCE[check]
    passed = bool(worst <= tolerance)
    _MEASURED.append(
        {
            "check": check,
            "case": case,
            "measured": worst,
            "tolerance": tolerance,
            "unit": unit,
            "passed": passed,
        }
    )
    message = f"{check} [{case}]: measured {worst:.3g} ({unit}), tolerance {tolerance:.3g}"
    if _PENDING is not None and not passed:
        _PENDING.append(message)
    else:
        assert passed, message


def _measures_all(test):
    """Runs ``test`` measuring every figure it measures before failing on any."""

    @functools.wraps(test)
    def run(*args, **kwargs):
        global _PENDING
        _PENDING = []
        try:
            test(*args, **kwargs)
        finally:
            failures, _PENDING = _PENDING, None
        assert not failures, "\n".join(failures)

    return run


@pytest.fixture(scope="module", autouse=True)
def _report(request):
    yield
    path = os.environ.get("SAMPLERS_ACCELERATOR_REPORT")
    if not path or not _MEASURED:
        return
    device = jax.devices()[0]
    report = {
        "backend": BACKEND,
        "device_kind": device.device_kind,
        "device_count": jax.device_count(),
        "jax": jax.__version__,
        "jaxlib": getattr(jax.lib, "__version__", None) or _version("jaxlib"),
        "numpy": np.__version__,
        "python": platform.python_version(),
        "matmul_precision": str(jax.config.jax_default_matmul_precision),
        "checks": sorted(_MEASURED, key=lambda row: (row["check"], row["case"])),
    }
    with open(path, "w") as file:
        json.dump(report, file, indent=1)
        file.write("\n")
    lines = [
        f"\nAccelerator tier on {BACKEND} ({device.device_kind}), jax {jax.__version__}:",
        "",
        "| check | case | measured | tolerance | unit |",
        "|---|---|---|---|---|",
    ]
    for row in report["checks"]:
        lines.append(
            f"| {row['check']} | {row['case']} | {row['measured']:.3g} | "
            f"{row['tolerance']:.3g} | {row['unit']} |"
        )
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print("\n".join(lines))


def _version(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _relative(got, expected, scale):
    """``|got - expected| / scale``, 0 where the two are equal (infinities included)."""
    got, expected, scale = (np.asarray(a, np.float64) for a in (got, expected, scale))
    with np.errstate(invalid="ignore", over="ignore"):
        error = np.abs(got - expected) / np.maximum(scale, 1e-300)
    return np.where(got == expected, 0.0, error)


# ---------------------------------------------------------------------------------
# The heads, with adversarial network outputs.

NORMAL_MEANS = (0.0, 0.5, -3.0, 8.5, 10.0, -20.0, 50.0, 1e3)
NORMAL_RAW_STDS = (-30.0, -5.0, 0.0, 3.0, 20.0)
BOUNDS_LOW = np.asarray([-0.1, -2.0, 1.0], np.float32)
BOUNDS_HIGH = np.asarray([0.3, 0.5, 1e3], np.float32)
BETA_RAWS = (-10.0, -3.0, 0.0, 4.0, 30.0)
BETA_LOW = np.asarray([-2.0, 0.0, 1.0], np.float32)
BETA_HIGH = np.asarray([2.0, 0.5, 1e3], np.float32)
REPEATS = 4  # each grid point this many times, with other noise
FEATURES, FLOW_FEATURES = 6, 3
TOKEN_DIM, VOCAB = 16, 45  # hidden states [rows, D] and an unembedding [D, V]
ALPHA = 0.2


def _pairs_as_rows(first, second, action_dim, repeats=REPEATS):
    """Every ``(first, second)`` pair, in ``[*first | *second]`` rows of ``action_dim``
    pairs each (cycled to fill the last row), the whole grid ``repeats`` times."""
    pairs = list(itertools.product(first, second)) * repeats
    pairs += pairs[: -len(pairs) % action_dim]
    grid = np.asarray(pairs, np.float32).reshape(-1, action_dim, 2)
    return np.concatenate([grid[..., 0], grid[..., 1]], axis=-1)


def _logits(rows, width, seed):
    """Logits: Normal draws, then huge, tied and nearly tied rows."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(rows, width)).astype(np.float32)
    logits[0] = 1e3
    logits[1, 0] = 1e3
    logits[2] = [-1e3] + [1e3] * (width - 1)
    logits[3] = 80.0 * np.arange(width)
    logits[4] = 1.0 + np.float32(2**-20) * np.arange(width)
    return logits


def _mask(rows, width, seed):
    """Half the rows allow every action; the others forbid some (never all)."""
    mask = np.random.default_rng(seed).random((rows, width)) < 0.6
    mask[::2] = True
    mask[:, 0] |= ~mask.any(axis=-1)
    return mask


def _moved(head, size, seed):
    """``head`` with every ``nnx.Param`` moved off its initial value, as training does
    (NumPy on the host: no program per leaf)."""
    params = nnx.state(head, nnx.Param)
    rng = np.random.default_rng(seed)

    def move(leaf):
        value = np.asarray(leaf)
        return jnp.asarray(value + size * rng.standard_normal(value.shape).astype(value.dtype))

    nnx.update(head, jax.tree.map(move, params))
    return head


@dataclasses.dataclass
class Head:
    """A head, its network output, its mask and the bound its actions saturate on."""

    head: samplers.ActionSampler
    inputs: np.ndarray | tuple[np.ndarray, ...]  # the token head's: (hidden, unembedding)
    mask: object = None
    bound: float | None = None
    actor: samplers.ActionSampler | None = None  # built with reparameterized=True


def _normal_heads(reparameterized):
    options = {"reparameterized": reparameterized}
    tanh = samplers.NormalTanhSampler(nnx.Rngs(action=1), 0.01, **options)
    bounded = samplers.SquashedNormalSampler(
        nnx.Rngs(action=2),
        0.01,
        min_std=0.0,
        bijector=samplers.BoundedTanh(BOUNDS_LOW, BOUNDS_HIGH),
        entropy="exact",
        **options,
    )
    return tanh, bounded


def _categorical(rngs):
    return samplers.CategoricalSampler(rngs, 0.01, num_actions=5)


def _beta(reparameterized):
    return samplers.BetaSampler(
        nnx.Rngs(action=4),
        0.01,
        action_dim=3,
        low=BETA_LOW,
        high=BETA_HIGH,
        min_concentration=0.0,
        reparameterized=reparameterized,
    )


def _composite(reparameterized):
    rngs = nnx.Rngs(action=5)
    return samplers.CompositeSampler(
        {
            "move": samplers.NormalTanhSampler(
                rngs, 0.01, action_dim=2, reparameterized=reparameterized
            ),
            "fire": samplers.CategoricalSampler(rngs, 0.01, num_actions=3),
        },
        rngs=rngs,
    )


def _autoregressive(reparameterized):
    rngs = nnx.Rngs(params=6, action=7)
    head = samplers.AutoregressiveSampler(
        {
            "unit": samplers.CategoricalSampler(rngs, 0.0, num_actions=3),
            "move": samplers.SquashedNormalSampler(rngs, 0.0, action_dim=2),
        },
        features=FEATURES,
        entropy_weight=0.01,
        rngs=rngs,
        hidden=16,
        reparameterized=reparameterized,
    )
    return _moved(head, 1.0, seed=6)


def _flow(reparameterized):
    head = samplers.FlowSampler(
        nnx.Rngs(params=8, action=9),
        0.01,
        action_dim=2,
        feature_dim=FLOW_FEATURES,
        hidden_sizes=(16,),
        reparameterized=reparameterized,
    )
    return _moved(head, 0.3, seed=8)


def _tokens():
    # Truncated (the replay scores the stored support) over blocks of 16 tokens, the
    # last one partly padding.
    return samplers.TokenSampler(
        nnx.Rngs(action=10), 0.01, vocab_size=VOCAB, top_k=8, top_p=0.9, block=(8, 16)
    )


def _token_inputs(rows):
    """Hidden states at scales from 1e-3 to 1e3 (logits up to about 1e4: one token takes
    all the mass), and an unembedding with tied columns."""
    generator = np.random.default_rng(10)
    scales = 10.0 ** np.linspace(-3.0, 3.0, rows)[:, None]
    hidden = (scales * generator.normal(size=(rows, TOKEN_DIM))).astype(np.float32)
    unembedding = generator.normal(size=(TOKEN_DIM, VOCAB)).astype(np.float32)
    unembedding[:, 1] = unembedding[:, 0]
    return hidden, unembedding


@functools.cache
def _heads() -> dict[str, Head]:
    tanh, bounded = _normal_heads(False)
    tanh_actor, bounded_actor = _normal_heads(True)
    normal2 = _pairs_as_rows(NORMAL_MEANS, NORMAL_RAW_STDS, 2)
    normal3 = _pairs_as_rows(NORMAL_MEANS, NORMAL_RAW_STDS, 3)
    rows = len(normal2)
    logits = _logits(rows, 5, seed=3)
    fire = _logits(rows, 3, seed=5)
    features = 3.0 * np.random.default_rng(6).normal(size=(rows, FEATURES)).astype(np.float32)
    flow_base = _pairs_as_rows((0.0, -2.0, 10.0, 30.0), (-5.0, 0.0, 2.0), 2, repeats=8)
    flow_features = np.random.default_rng(8).normal(size=(len(flow_base), FLOW_FEATURES))
    return {
        "NormalTanhSampler": Head(tanh, normal2, bound=1.0, actor=tanh_actor),
        "BoundedTanh": Head(bounded, normal3, bound=1e3, actor=bounded_actor),
        "CategoricalSampler": Head(
            _categorical(nnx.Rngs(action=3)), logits, _mask(rows, 5, seed=3)
        ),
        "BetaSampler": Head(
            _beta(False), _pairs_as_rows(BETA_RAWS, BETA_RAWS, 3), bound=1e3, actor=_beta(True)
        ),
        "CompositeSampler": Head(
            _composite(False),
            np.concatenate([normal2, fire], axis=-1),
            {"fire": _mask(rows, 3, seed=5)},
            bound=1.0,
            actor=_composite(True),
        ),
        "AutoregressiveSampler": Head(
            _autoregressive(False), features, bound=1.0, actor=_autoregressive(True)
        ),
        "FlowSampler": Head(
            _flow(False),
            np.concatenate([flow_base, flow_features.astype(np.float32)], axis=-1),
            bound=1.0,
            actor=_flow(True),
        ),
        "TokenSampler": Head(_tokens(), _token_inputs(rows), _mask(rows, VOCAB, seed=10)),
    }


HEADS = (
    "NormalTanhSampler",
    "BoundedTanh",
    "CategoricalSampler",
    "BetaSampler",
    "CompositeSampler",
    "AutoregressiveSampler",
    "FlowSampler",
    "TokenSampler",
)


def _split(modules):
    """``(graphdefs, params, rest)`` by name: the static part and two pytrees."""
    graphdefs, params, rest = {}, {}, {}
    for name, module in modules.items():
        graphdefs[name], own, other = nnx.split(module, nnx.Param, ...)
        # Plain dicts: merged inside a transform, they make variables of its trace.
        params[name], rest[name] = nnx.to_pure_dict(own), nnx.to_pure_dict(other)
    return graphdefs, params, rest


def _call(graphdef, params, rest, inputs, extras, mask):
    head = nnx.merge(graphdef, params, rest)
    return head((), inputs, extras, mask=mask)


def _float_leaves_sum(action):
    """``Q(action) = -sum((a - 0.5)**2)`` over the floating leaves: a stand-in critic."""
    leaves = [a for a in jax.tree.leaves(action) if jnp.issubdtype(a.dtype, jnp.floating)]
    return -sum(jnp.sum(jnp.square(a - 0.5)) for a in leaves)


@functools.cache
def _head_programs():
    """Four programs over every head at once: rollout and replay together, the rollout
    alone, the replay alone, and the gradients. Returns their outputs as NumPy."""
    heads = _heads()
    graphdefs, params, rest = _split({n: h.head for n, h in heads.items()})
    actors = {n: h.actor for n, h in heads.items() if h.actor is not None}
    actor_graphdefs, actor_params, actor_rest = _split(actors)
    inputs = {n: jax.tree.map(jnp.asarray, h.inputs) for n, h in heads.items()}
    masks = {n: h.mask for n, h in heads.items()}

    @jax.jit
    def one_program(params, rest, inputs, masks):
        result = {}
        for name in HEADS:
            args = (graphdefs[name], params[name], rest[name], inputs[name])
            out = _call(*args, None, masks[name])
            again = _call(*args, out.rollout_extras, masks[name])
            result[name] = (out.output["log_likelihood"], again.output["log_likelihood"])
        return result

    @jax.jit
    def rollout(params, rest, inputs, masks):
        result = {}
        for name in HEADS:
            out = _call(graphdefs[name], params[name], rest[name], inputs[name], None, masks[name])
            result[name] = (out.output["log_likelihood"], out.output["action"], out.rollout_extras)
        return result

    @jax.jit
    def replay(params, rest, inputs, extras, masks):
        return {
            name: _call(
                graphdefs[name], params[name], rest[name], inputs[name], extras[name], masks[name]
            ).output["log_likelihood"]
            for name in HEADS
        }

    @jax.jit
    def gradients(params, rest, inputs, extras, masks, actor_params, actor_rest):
        result = {}
        for name in HEADS:

            def score(p, x, name=name):
                out = _call(graphdefs[name], p, rest[name], x, extras[name], masks[name])
                return jnp.sum(out.output["log_likelihood"])

            result[name] = {"replay": jax.grad(score, (0, 1))(params[name], inputs[name])}
            if name in actor_graphdefs:

                def actor_loss(p, x, name=name):
                    graphdef, r = actor_graphdefs[name], actor_rest[name]
                    out = _call(graphdef, p, r, x, None, masks[name])
                    q = _float_leaves_sum(out.output["action"])
                    return jnp.sum(ALPHA * out.output["log_likelihood"]) - q

                grads = jax.grad(actor_loss, (0, 1))(actor_params[name], inputs[name])
                result[name]["actor"] = grads
        return result

    together = one_program(params, rest, inputs, masks)
    rolled = rollout(params, rest, inputs, masks)
    extras = {name: rolled[name][2] for name in HEADS}
    replayed = replay(params, rest, inputs, extras, masks)
    grads = gradients(params, rest, inputs, extras, masks, actor_params, actor_rest)
    to_numpy = functools.partial(jax.tree.map, np.asarray)
    return {
        "together": to_numpy(together),
        "rollout": to_numpy(rolled),
        "replay": to_numpy(replayed),
        "gradients": to_numpy(grads),
    }


# ---------------------------------------------------------------------------------
# (a), (b), (c): replay and gradients, every head.


@pytest.mark.parametrize("name", HEADS)
def test_replay_inside_one_program_is_bit_for_bit(name):
    rollout, replayed = _head_programs()["together"][name]
    assert np.all(np.isfinite(rollout))
    # The largest difference, and NaN where one side is and the other is not.
    _measure("replay in one program", name, _relative(replayed, rollout, 1.0), "nats")


@pytest.mark.parametrize("name", HEADS)
def test_first_ppo_ratio_across_programs_is_one(name):
    """Rollout and replay compiled as two programs, as a training loop compiles them."""
    programs = _head_programs()
    rollout, replayed = programs["rollout"][name][0], programs["replay"][name]
    assert np.all(np.isfinite(rollout))
    if name == "FlowSampler":
        error = _relative(replayed, rollout, 1.0 + np.abs(rollout))
        _measure("first PPO ratio, flow", name, error, "nats / (1 + |log-likelihood|)")
    else:
        _measure("first PPO ratio", name, _relative(replayed, rollout, 1.0), "nats")


def _is_on_bound(action, bound):
    leaves = [a for a in jax.tree.leaves(action) if np.issubdtype(a.dtype, np.floating)]
    return any(np.any(np.abs(a) == bound) for a in leaves)


@pytest.mark.parametrize("name", HEADS)
def test_gradients_are_finite_at_saturated_means(name):
    """The grids hold means of 10 to 1e3 and stds down to 1e-13, so that actions round
    onto their bounds: the gradients of the replay and of the actor loss with respect
    to the network output and the head's parameters are finite there."""
    head = _heads()[name]
    programs = _head_programs()
    if head.bound is not None:
        assert _is_on_bound(programs["rollout"][name][1], head.bound), "no saturated action"
    grads = programs["gradients"][name]
    leaves = jax.tree.leaves(grads)
    assert leaves, "no gradient"
    non_finite = sum(int(np.sum(~np.isfinite(leaf))) for leaf in leaves)
    _measure("non-finite gradients", name, non_finite, "count")
    if head.actor is not None:
        actor_input_gradient = grads["actor"][1]
        assert np.any(actor_input_gradient != 0), "the actor loss has no pathwise gradient"


# ---------------------------------------------------------------------------------
# (d) The squashed Normal against tests/oracle.py, one element per grid point.

SCALES = (2.0**-20, 2.0**-7, 1.0, 30.0)
LOCS = (0.0, 0.75, -4.0, 10.0, -20.0, 50.0)
ZS = (-3.0, 0.0, 1.5)
SATURATED = (10.0, -20.0, 50.0)
ACTION_KINDS = ("centre", "high-1e-3", "low+1e-6", "high-next", "low+next", "high", "low")
ENTROPY_PAIRS = (
    (0.0, 1.0),
    (0.75, 2.0**-7),
    (-4.0, 0.5),
    (20.0, 3.0),
    (-60.0, 1e3),
    (1e3, 2.0**-19),
)
SQUASHINGS = ("Tanh", "BoundedTanh")


def _bounds_per_element(squashing, count):
    """``(low, high)`` per element: tanh's ``[-1, 1]``, or the asymmetric bounds in turn."""
    if squashing == "Tanh":
        return np.full(count, -1.0, np.float32), np.full(count, 1.0, np.float32)
    index = np.arange(count) % len(BOUNDS_LOW)
    return BOUNDS_LOW[index], BOUNDS_HIGH[index]


def _action(kind, low, high):
    """A float32 action in one dimension, named by where it lies."""
    low, high = np.float32(low), np.float32(high)
    half = (float(high) - float(low)) / 2
    if kind == "centre":
        return np.float32((float(low) + float(high)) / 2)
    if kind in ("high", "low"):
        return high if kind == "high" else low
    if kind == "high-next":
        return np.nextafter(high, low)
    if kind == "low+next":
        return np.nextafter(low, high)
    side, fraction = kind.split("-", 1) if kind.startswith("high") else kind.split("+", 1)
    sign = -1.0 if side == "high" else 1.0
    return np.float32(float(high if side == "high" else low) + sign * float(fraction) * half)


@dataclasses.dataclass
class Elements:
    """One squashing's grid: float32 arrays of the same length, one element each."""

    squashing: str
    value: np.ndarray
    loc: np.ndarray
    scale: np.ndarray
    low: np.ndarray
    high: np.ndarray

    def oracle(self, function, **constants):
        """``function(value, loc, scale, low, high, k=1, **constants)`` per element."""
        arrays = (self.value, self.loc, self.scale, self.low, self.high)
        return oracle.elementwise(function, *arrays, k=1, **constants)

    def jax_arrays(self):
        return tuple(
            jnp.asarray(getattr(self, n)) for n in ("value", "loc", "scale", "low", "high")
        )


def _pre_image_elements(squashing):
    rows = []
    for loc, scale in itertools.product(LOCS, SCALES):
        for x in (*(np.float32(loc + scale * z) for z in ZS), *SATURATED):
            rows.append((x, loc, scale))
    value, loc, scale = np.asarray(rows, np.float32).T
    return Elements(squashing, value, loc, scale, *_bounds_per_element(squashing, len(rows)))


def _action_elements(squashing):
    low, high = _bounds_per_element(squashing, 3)
    rows = []
    for (loc, scale), kind, side in itertools.product(
        itertools.product(LOCS[:4], SCALES), ACTION_KINDS, range(len(low))
    ):
        if squashing == "Tanh" and side:
            continue
        rows.append((_action(kind, low[side], high[side]), loc, scale, low[side], high[side]))
    columns = np.asarray(rows, np.float32).T
    return Elements(squashing, *columns)


def _entropy_elements(squashing):
    low, high = _bounds_per_element(squashing, 3)
    sides = 1 if squashing == "Tanh" else len(low)
    rows = [
        (0.0, loc, scale, low[side], high[side])
        for (loc, scale), side in itertools.product(ENTROPY_PAIRS, range(sides))
    ]
    return Elements(squashing, *np.asarray(rows, np.float32).T)


def _per_element(method, squashing):
    """``method(dist, value)`` of a one-dimensional ``SquashedNormal`` per element, and
    its gradients with respect to value, loc, scale (and the bounds), under vmap."""
    argnums = (0, 1, 2, 3, 4) if squashing == "BoundedTanh" else (0, 1, 2)

    def one(value, loc, scale, low, high):
        bijector = samplers.BoundedTanh(low[None], high[None])
        if squashing == "Tanh":
            bijector = samplers.Tanh()
        dist = samplers.SquashedNormal(loc[None], scale[None], bijector)
        return method(dist, value[None])

    return jax.vmap(jax.value_and_grad(one, argnums))


@functools.cache
def _normal_oracle_program(squashing):
    """One program: the three methods on their grids, with their gradients."""
    grids = {
        "pre_image": _pre_image_elements(squashing),
        "action": _action_elements(squashing),
        "entropy": _entropy_elements(squashing),
    }
    methods = {
        "pre_image": lambda dist, x: dist.log_prob_from_pre_image(x),
        "action": lambda dist, y: dist.log_prob(y),
        "entropy": lambda dist, _: dist.entropy(),
    }

    @jax.jit
    def program(arrays):
        return {key: _per_element(methods[key], squashing)(*arrays[key]) for key in methods}

    out = program({key: grid.jax_arrays() for key, grid in grids.items()})
    return grids, jax.tree.map(np.asarray, out)


def _gradients_by_name(grads, squashing):
    names = ("value", "loc", "scale", "low", "high")
    return dict(zip(names if squashing == "BoundedTanh" else names[:3], grads, strict=True))


@pytest.mark.parametrize("squashing", SQUASHINGS)
@_measures_all
def test_squashed_normal_log_prob_from_pre_image_against_the_oracle(squashing):
    """Pre-images around each mean and at +-10, -20, 50 (stds 2**-20 to 30): the value
    within 16 ulps of its largest term, as documented; the gradients with respect to
    the pre-image, loc, scale and the bounds relative to the size of their terms."""
    grids, out = _normal_oracle_program(squashing)
    grid = grids["pre_image"]
    value, grads = out["pre_image"]
    x, loc, scale = (grid.value.astype(np.float64), grid.loc, grid.scale.astype(np.float64))
    half = (grid.high.astype(np.float64) - grid.low) / 2
    z = (x - loc) / scale
    log_derivative = _log_derivative64(x, half)
    largest = _largest_term64(z, scale, log_derivative)
    expected = grid.oracle(oracle.log_prob_pre_image_term)
    _measure(
        "normal log_prob_from_pre_image",
        squashing,
        _relative(value, expected, largest),
        "error / largest term",
    )
    sizes = {
        "value": np.abs(z) / scale + 2,
        "loc": np.abs(z) / scale,
        "scale": (z**2 + 1) / scale,
        "low": 1 / (2 * half),
        "high": 1 / (2 * half),
    }
    errors = []
    for parameter, got in _gradients_by_name(grads, squashing).items():
        wanted = grid.oracle(oracle.log_prob_pre_image_gradient, parameter=parameter)
        errors.append(_relative(got, wanted, np.abs(wanted) + sizes[parameter]))
    _measure(
        "normal log_prob_from_pre_image gradients",
        squashing,
        np.concatenate(errors),
        "error / (|gradient| + its terms)",
    )


@pytest.mark.parametrize("squashing", SQUASHINGS)
@_measures_all
def test_squashed_normal_log_prob_of_an_action_against_the_oracle(squashing):
    """Copies of actions (not samples): at the centre, 1e-3 and 1e-6 of the half range
    from a bound, on the float next to it and on it, for means 0 to 10 and stds 2**-20
    to 30. The value within ``4 eps (1 + |x| |x - loc| / scale**2 + |log p|)``, as
    documented; the gradients relative to the size of their terms, the pre-image's
    rounding included (on a bound, where the value is a probability, without the
    gradient with respect to the action)."""
    grids, out = _normal_oracle_program(squashing)
    grid = grids["action"]
    value, grads = out["action"]
    expected = grid.oracle(oracle.log_prob_action_term, dtype="float32")
    low, high, y = (a.astype(np.float64) for a in (grid.low, grid.high, grid.value))
    inside = (y > low) & (y < high)
    with np.errstate(divide="ignore", invalid="ignore"):
        x = np.where(inside, (np.log(y - low) - np.log(high - y)) / 2, 0.0)
        slope = np.where(inside, (1 / (y - low) + 1 / (high - y)) / 2, 0.0)
    scale = grid.scale.astype(np.float64)
    # On a bound, the pre-image of the rounding threshold the atom is scored at.
    for i in np.flatnonzero(~inside):
        side = oracle.UPPER if grid.value[i] == grid.high[i] else oracle.LOWER
        x[i] = float(oracle.on_bound_threshold(side, grid.low[i], grid.high[i], 1, "float32"))
    distance = np.abs(x - grid.loc)
    documented = 1 + np.abs(x) * distance / scale**2 + np.abs(expected)
    _measure(
        "normal log_prob of an action",
        squashing,
        _relative(value, expected, documented),
        "error / (1 + |x| |x - loc| / scale**2 + |log p|)",
    )
    # How far the rounding of x moves each gradient, and the gradient's own terms.
    pull = (distance + np.abs(x)) / scale**2 + 2
    with np.errstate(divide="ignore"):
        sizes = {
            "value": pull * slope,
            "loc": pull,
            "scale": (distance**2 / scale + np.abs(x) * distance / scale + 1) / scale,
            "low": pull * np.where(inside, 1 / np.abs(y - low), 0) + 1,
            "high": pull * np.where(inside, 1 / np.abs(high - y), 0) + 1,
        }
    errors = []
    for parameter, got in _gradients_by_name(grads, squashing).items():
        wanted = grid.oracle(oracle.log_prob_action_gradient, dtype="float32", parameter=parameter)
        keep = ~np.isnan(wanted)
        error = _relative(got, wanted, np.abs(wanted) + sizes[parameter])
        errors.append(error[keep])
        assert np.all(np.isfinite(got[keep]) | ~np.isfinite(wanted[keep]))
    _measure(
        "normal log_prob of an action, gradients",
        squashing,
        np.concatenate(errors),
        "error / (|gradient| + its terms)",
    )


@pytest.mark.parametrize("squashing", SQUASHINGS)
@_measures_all
def test_squashed_normal_entropy_against_the_oracle(squashing):
    """``entropy()`` for means 0 to 1e3 and stds 2**-19 to 1e3, on both sides of the
    switch between its quadrature rules (std 0.5): the value within ``1e-5 (1 + |H|)``
    as documented, the gradients within ``1e-5 (|gradient| + its terms)``."""
    grids, out = _normal_oracle_program(squashing)
    grid = grids["entropy"]
    value, grads = out["entropy"]
    terms = [
        oracle.entropy_term(*map(float, (loc, scale, low, high)), 1)
        for loc, scale, low, high in zip(grid.loc, grid.scale, grid.low, grid.high, strict=True)
    ]
    expected = np.asarray([float(t["entropy"]) for t in terms])
    _measure(
        "normal entropy",
        squashing,
        _relative(value, expected, 1 + np.abs(expected)),
        "nats / (1 + |H|)",
    )
    scale = grid.scale.astype(np.float64)
    half = (grid.high.astype(np.float64) - grid.low) / 2
    sizes = {"loc": 2.0, "scale": 1 / scale + 2, "low": 1 / (2 * half), "high": 1 / (2 * half)}
    errors = []
    for parameter, got in _gradients_by_name(grads, squashing).items():
        if parameter == "value":
            assert np.all(got == 0)
            continue
        wanted = np.asarray([float(t[f"entropy/{parameter}"]) for t in terms])
        errors.append(_relative(got, wanted, np.abs(wanted) + sizes[parameter]))
    _measure(
        "normal entropy gradients",
        squashing,
        np.concatenate(errors),
        "error / (|gradient| + its terms)",
    )


# ---------------------------------------------------------------------------------
# (d) The heads' own parameterisation: the softplus std, in float64.


def _log_derivative64(x, half):
    """``log |f'(x)|`` of ``BoundedTanh`` with half range ``half``, in float64."""
    return np.log(half) + 2 * (np.log(2) - np.abs(x) - np.log1p(np.exp(-2 * np.abs(x))))


def _largest_term64(z, scale, log_derivative):
    """The largest of the squashed-Normal log-density's terms, the scale of its error."""
    terms = [z**2 / 2, np.abs(np.log(scale)), np.full_like(z, oracle.HALF_LOG_2PI)]
    return np.max([*terms, np.abs(log_derivative)], axis=0)


def _softplus64(x):
    return np.logaddexp(0.0, np.asarray(x, np.float64))


def _normal_head64(inputs, pre_image, min_std, low=-1.0, high=1.0, input_sizes=None):
    """The log-likelihood of a stored pre-image under ``[mean | raw_std]`` and its
    gradients, written out in float64: ``(value, d/d mean, d/d raw_std, size, sizes
    of the gradients' terms)``. ``size`` is the largest term of each row, plus how far
    a rounding of the inputs of size ``input_sizes`` (computed by a network in float32)
    and of the pre-image moves the value (relative to a float32 rounding)."""
    inputs, x = np.asarray(inputs, np.float64), np.asarray(pre_image, np.float64)
    mean, raw = np.split(inputs, 2, axis=-1)
    std = _softplus64(raw) + min_std
    z = (x - mean) / std
    half = (np.asarray(high, np.float64) - np.asarray(low, np.float64)) / 2
    log_derivative = _log_derivative64(x, half)
    terms = -(z**2) / 2 - np.log(std) - oracle.HALF_LOG_2PI - log_derivative
    largest = _largest_term64(z, std, log_derivative)
    slope = np.exp(-_softplus64(-raw))  # sigmoid(raw), the softplus' derivative
    grad_mean = z / std
    grad_raw = (z**2 - 1) / std * slope
    size = largest.max(-1)
    if input_sizes is not None:
        mean_size, raw_size = np.split(input_sizes, 2, axis=-1)
        moved = np.abs(z) / std * (np.abs(x) + mean_size) + np.abs(grad_raw) * raw_size
        size = size + moved.sum(-1)
    return (
        terms.sum(-1),
        grad_mean,
        grad_raw,
        size,
        (np.abs(z) / std, (z**2 + 1) / std * slope),
    )


@pytest.mark.parametrize("name", ["NormalTanhSampler", "BoundedTanh"])
@_measures_all
def test_squashed_normal_heads_against_float64_with_the_softplus_std(name):
    """The replayed log-likelihood of the stored pre-images of the head grid (means to
    1e3, raw stds from -30 to 20), through ``std = softplus(raw_std) + min_std``, and its
    gradient with respect to the network output, against float64 formulas."""
    head = _heads()[name]
    programs = _head_programs()
    stored = programs["rollout"][name][2]
    low, high = (-1.0, 1.0) if name == "NormalTanhSampler" else (BOUNDS_LOW, BOUNDS_HIGH)
    value, grad_mean, grad_raw, largest, sizes = _normal_head64(
        head.inputs, stored, head.head.min_std, low, high
    )
    got = programs["replay"][name]
    _measure(
        "normal head, softplus std", name, _relative(got, value, largest), "error / largest term"
    )
    got_mean, got_raw = np.split(programs["gradients"][name]["replay"][1], 2, axis=-1)
    errors = [
        _relative(got_mean, grad_mean, np.abs(grad_mean) + sizes[0]),
        _relative(got_raw, grad_raw, np.abs(grad_raw) + sizes[1]),
    ]
    _measure(
        "normal head, softplus std, gradients",
        name,
        np.concatenate([e.ravel() for e in errors]),
        "error / (|gradient| + its terms)",
    )


# ---------------------------------------------------------------------------------
# (d) Categorical, composite, autoregressive and flow heads against float64 NumPy.


def _log_softmax64(logits, mask=None):
    logits = np.asarray(logits, np.float64)
    if mask is not None:
        logits = np.where(mask, logits, -np.inf)
    top = np.max(logits, axis=-1, keepdims=True)
    return logits - top - np.log(np.sum(np.exp(logits - top), axis=-1, keepdims=True))


def _categorical64(logits, mask, action):
    """``log p(action)``, the entropy and their gradients with respect to the logits."""
    log_p = _log_softmax64(logits, mask)
    p = np.exp(log_p)
    chosen = np.take_along_axis(log_p, action[..., None], -1)[..., 0]
    with np.errstate(invalid="ignore"):  # 0 * -inf where masked
        plogp = np.where(p > 0, p * log_p, 0.0)
    entropy = -plogp.sum(-1)
    one_hot = np.eye(logits.shape[-1])[action]
    grad_log_p = np.where(np.asarray(mask, bool), one_hot - p, 0.0)
    grad_entropy = -(plogp + p * entropy[..., None])
    return chosen, entropy, grad_log_p, grad_entropy


@functools.cache
def _categorical_program():
    head = _heads()["CategoricalSampler"]
    logits, mask = jnp.asarray(head.inputs), jnp.asarray(head.mask)
    action = np.random.default_rng(4).integers(0, 5, size=len(head.inputs))
    action = np.where(np.take_along_axis(head.mask, action[:, None], -1)[:, 0], action, 0)

    @jax.jit
    def program(logits, mask, action):
        def log_prob(x):
            return head.head.distribution(x, mask).log_prob(action)

        def entropy(x):
            return head.head.distribution(x, mask).entropy()

        return (
            log_prob(logits),
            entropy(logits),
            jax.grad(lambda x: jnp.sum(log_prob(x)))(logits),
            jax.grad(lambda x: jnp.sum(entropy(x)))(logits),
        )

    return action, jax.tree.map(np.asarray, program(logits, mask, jnp.asarray(action)))


@_measures_all
def test_categorical_against_float64():
    """Masked logits with huge, tied and nearly tied rows: ``log_prob`` and ``entropy``
    within a few roundings of ``1 + max |logit|``; their gradients with respect to every
    logit (exactly 0 for the masked ones) within a few roundings of 1."""
    head = _heads()["CategoricalSampler"]
    action, (log_prob, entropy, grad_log_prob, grad_entropy) = _categorical_program()
    wanted = _categorical64(head.inputs, head.mask, action)
    size = 1 + np.max(np.abs(head.inputs), axis=-1)
    errors = np.concatenate(
        [_relative(log_prob, wanted[0], size), _relative(entropy, wanted[1], size)]
    )
    _measure(
        "categorical log_prob and entropy",
        "CategoricalSampler",
        errors,
        "error / (1 + max |logit|)",
    )
    assert np.all(grad_log_prob[~head.mask] == 0) and np.all(grad_entropy[~head.mask] == 0)
    errors = np.concatenate(
        [
            _relative(grad_log_prob, wanted[2], 1.0).ravel(),
            _relative(grad_entropy, wanted[3], size[:, None]).ravel(),
        ]
    )
    _measure("categorical gradients", "CategoricalSampler", errors, "error / (1 + max |logit|)")


def test_composite_log_likelihood_is_the_float64_sum_of_its_parts():
    """The composite's replayed log-likelihood: the squashed Normal's (softplus std)
    plus the masked Categorical's, in float64."""
    head = _heads()["CompositeSampler"]
    programs = _head_programs()
    stored = programs["rollout"]["CompositeSampler"][2]
    move, fire = head.inputs[:, :4], head.inputs[:, 4:]
    normal, *_, largest, _ = _normal_head64(move, stored["move"], 1e-3)
    choice = np.asarray(stored["fire"])
    log_p = np.take_along_axis(_log_softmax64(fire, head.mask["fire"]), choice[:, None], -1)[:, 0]
    size = largest + 1 + np.max(np.abs(fire), axis=-1)
    got = programs["replay"]["CompositeSampler"]
    _measure(
        "composite log-likelihood",
        "CompositeSampler",
        _relative(got, normal + log_p, size),
        "error / (largest term + 1 + max |logit|)",
    )


def _linear64(layer, x, size=None):
    """``x @ kernel + bias`` in float64; with ``size`` (of ``x``'s rounding), also the
    size of the result's: ``size @ |kernel| + |x| @ |kernel| + |bias|``."""
    kernel, bias = (np.asarray(v[...], np.float64) for v in (layer.kernel, layer.bias))
    value = x @ kernel + bias
    if size is None:
        return value
    return value, (size + np.abs(x)) @ np.abs(kernel) + np.abs(bias)


def test_autoregressive_log_likelihood_against_float64_conditioners():
    """The replayed log-likelihood of a categorical then a squashed-Normal sub-action,
    each conditioner (``Linear -> tanh -> Linear``) evaluated in float64 on the
    features and the one-hot of the earlier choice. The matrix products run at the
    backend's default precision."""
    head = _heads()["AutoregressiveSampler"]
    programs = _head_programs()
    stored = programs["rollout"]["AutoregressiveSampler"][2]
    features = head.inputs.astype(np.float64)

    def conditioner(name, x):
        """The outputs and the size of their rounding (``tanh`` has slope <= 1)."""
        module = head.head.conditioners[name]
        hidden, size = _linear64(module.hidden, x, np.zeros_like(x))
        return _linear64(module.out, np.tanh(hidden), size)

    unit = np.asarray(stored["unit"])
    logits, logits_size = conditioner("unit", features)
    log_p = np.take_along_axis(_log_softmax64(logits), unit[:, None], -1)[:, 0]
    params, params_size = conditioner("move", np.concatenate([features, np.eye(3)[unit]], axis=-1))
    normal, *_, size, _ = _normal_head64(params, stored["move"], 1e-3, input_sizes=params_size)
    size = size + 1 + np.max(logits_size, axis=-1)
    got = programs["replay"]["AutoregressiveSampler"]
    _measure(
        "autoregressive log-likelihood",
        "AutoregressiveSampler",
        _relative(got, normal + log_p, size),
        "error / (1 + terms + their rounding's effect)",
    )


def test_flow_log_likelihood_against_float64_coupling_layers():
    """The replayed log-likelihood of the stored pre-squash actions (saturated rows and
    stds of 0.008 included), with the affine coupling layers inverted in float64.

    The unit is the size of the value's terms plus how far a float32 rounding of each
    intermediate moves it: the base draw ``x0`` comes out of the inverted layers with
    the rounding of every shift, scale and conditioner output on the way, and the
    Normal's term amplifies it by ``|z| / std``. Where that is small this is the
    ``1e-5`` relative plus ``1e-5`` the library documents."""
    head = _heads()["FlowSampler"]
    programs = _head_programs()
    stored = np.asarray(programs["rollout"]["FlowSampler"][2], np.float64)
    inputs = head.inputs.astype(np.float64)
    mean, raw, features = inputs[:, :2], inputs[:, 2:4], inputs[:, 4:]
    std = _softplus64(raw) + head.head.min_std
    x, log_det = stored, np.zeros(len(stored))
    x_size, log_det_size = np.abs(stored), np.zeros(len(stored))
    for index in reversed(range(len(head.head.conditioners))):
        keep = np.arange(2) % 2 == index % 2
        module = head.head.conditioners[index]
        hidden = np.concatenate([np.where(keep, x, 0.0), features], axis=-1)
        size = np.concatenate([np.where(keep, x_size, 0.0), np.zeros_like(features)], axis=-1)
        for layer in module.hidden:
            hidden, size = _linear64(layer, hidden, size)
            hidden = np.maximum(hidden, 0.0)
        params, size = _linear64(module.out, hidden, size)
        params, size = params.reshape(len(x), 2, 2), size.reshape(len(x), 2, 2)
        shift, log_scale = params[..., 0], 3.0 * np.tanh(params[..., 1] / 3.0)
        inverse = (x - shift) * np.exp(-log_scale)
        moved = (x_size + size[..., 0]) * np.exp(-log_scale) + np.abs(inverse) * size[..., 1]
        x, x_size = np.where(keep, x, inverse), np.where(keep, x_size, moved)
        log_det -= np.sum(np.where(keep, 0.0, log_scale), axis=-1)
        log_det_size += np.sum(np.where(keep, 0.0, size[..., 1]), axis=-1)
    z = (x - mean) / std
    log_normal = np.sum(-(z**2) / 2 - np.log(std) - oracle.HALF_LOG_2PI, axis=-1)
    a = np.abs(stored)
    log_derivative = 2 * (np.log(2) - a - np.log1p(np.exp(-2 * a)))
    expected = log_normal + log_det - np.sum(log_derivative, axis=-1)
    terms = np.sum(z**2 / 2 + np.abs(np.log(std)) + np.abs(log_derivative), axis=-1)
    moved = np.sum(np.abs(z) / std * (x_size + np.abs(mean)) + z**2 + 1, axis=-1)
    size = 1 + terms + log_det_size + moved
    got = programs["replay"]["FlowSampler"]
    _measure(
        "flow log-likelihood",
        "FlowSampler",
        _relative(got, expected, size),
        "error / (1 + terms + their rounding's effect)",
    )


# ---------------------------------------------------------------------------------
# (d) The Beta against mpmath.

BETA_CONCENTRATIONS = (0.01, 0.3, 1.0, 2.5, 40.0, 1e3)
BETA_PRE_IMAGES = (-60.0, -8.0, 0.0, 2.5, 30.0)
BETA_RANGE = (-2.0, 0.5)


@functools.cache
def _beta_oracle(a, b, z):
    """``log p`` of the action of ``z``, the entropy and their derivatives, with the
    sizes of their terms, at 50 digits."""
    with mp.workdps(oracle.DIGITS):
        a, b, z = (oracle.exact(v) for v in (a, b, z))
        low, high = (oracle.exact(np.float32(v)) for v in BETA_RANGE)
        log_range = mp.log(high - low)
        log_u, log_v = -mp.log1p(mp.exp(-z)), -mp.log1p(mp.exp(z))  # log sigmoid(+-z)
        log_beta = mp.loggamma(a) + mp.loggamma(b) - mp.loggamma(a + b)
        psi_a, psi_b, psi_ab = mp.digamma(a), mp.digamma(b), mp.digamma(a + b)
        tri_a, tri_b, tri_ab = mp.psi(1, a), mp.psi(1, b), mp.psi(1, a + b)
        log_p = (a - 1) * log_u + (b - 1) * log_v - log_beta - log_range
        entropy_beta = log_beta - (a - 1) * psi_a - (b - 1) * psi_b + (a + b - 2) * psi_ab
        entropy_logit = entropy_beta - (psi_a + psi_b - 2 * psi_ab)
        u, v = mp.exp(log_u), mp.exp(log_v)
        values = {
            "log_p": log_p,
            "log_p/z": (a - 1) * v - (b - 1) * u,
            "log_p/a": log_u - psi_a + psi_ab,
            "log_p/b": log_v - psi_b + psi_ab,
            "entropy": entropy_beta + log_range,
            "entropy/a": -(a - 1) * tri_a + (a + b - 2) * tri_ab,
            "entropy/b": -(b - 1) * tri_b + (a + b - 2) * tri_ab,
        }
        sizes = {
            "log_p": 1
            + abs((a - 1) * log_u)
            + abs((b - 1) * log_v)
            + abs(log_beta)
            + abs(log_range),
            # The logit's density and the sigmoid's Jacobian, each of size a or b.
            "log_p/z": (a + 1) * v + (b + 1) * u,
            "log_p/a": abs(log_u) + abs(psi_a) + abs(psi_ab),
            "log_p/b": abs(log_v) + abs(psi_b) + abs(psi_ab),
            # The library's documented bound: 32 eps (1 + |H[Beta]| + |H[logit]| + log(a + b)).
            "entropy": 1 + abs(entropy_beta) + abs(entropy_logit) + mp.log(a + b) + abs(log_range),
            "entropy/a": abs((a - 1) * tri_a) + abs((a + b - 2) * tri_ab),
            "entropy/b": abs((b - 1) * tri_b) + abs((a + b - 2) * tri_ab),
        }
        return {k: float(v) for k, v in values.items()}, {k: float(v) for k, v in sizes.items()}


@functools.cache
def _beta_program():
    grid = np.asarray(
        list(itertools.product(BETA_CONCENTRATIONS, BETA_CONCENTRATIONS, BETA_PRE_IMAGES)),
        np.float32,
    )

    def one(a, b, z):
        dist = samplers.SquashedBeta(a[None], b[None], *BETA_RANGE)
        return dist.log_prob_from_pre_image(z[None]), dist.entropy()

    @jax.jit
    def program(a, b, z):
        log_p = jax.vmap(jax.value_and_grad(lambda *x: one(*x)[0], (0, 1, 2)))(a, b, z)
        entropy = jax.vmap(jax.value_and_grad(lambda *x: one(*x)[1], (0, 1)))(a, b, z)
        return log_p, entropy

    out = program(*(jnp.asarray(c) for c in grid.T))
    return grid, jax.tree.map(np.asarray, out)


@_measures_all
def test_beta_against_mpmath():
    """``SquashedBeta`` with concentrations 0.01 to 1e3 and pre-images -60 to 30 (the
    action on a bound in float32): ``log_prob_from_pre_image``, ``entropy()`` and their
    gradients with respect to both concentrations and the pre-image, relative to the
    size of their terms (the entropy's as its documented bound states them)."""
    grid, ((log_p, log_p_grads), (entropy, entropy_grads)) = _beta_program()
    rows = [_beta_oracle(*map(float, row)) for row in grid]

    def column(key, which=0):
        return np.asarray([row[which][key] for row in rows])

    def gradient_errors(quantity, grads, parameters):
        """Each gradient's error over its size plus its terms', all parameters together."""
        return np.concatenate(
            [
                _relative(got, column(k := f"{quantity}/{p}"), np.abs(column(k)) + column(k, 1))
                for p, got in zip(parameters, grads, strict=True)
            ]
        )

    _measure(
        "beta log_prob_from_pre_image",
        "SquashedBeta",
        _relative(log_p, column("log_p"), column("log_p", 1)),
        "error / its terms",
    )
    _measure(
        "beta log_prob_from_pre_image gradients",
        "SquashedBeta",
        gradient_errors("log_p", log_p_grads, "abz"),
        "error / (|gradient| + its terms)",
    )
    _measure(
        "beta entropy",
        "SquashedBeta",
        _relative(entropy, column("entropy"), column("entropy", 1)),
        "nats / (1 + |H[Beta]| + |H[logit]| + log(a + b))",
    )
    _measure(
        "beta entropy gradients",
        "SquashedBeta",
        gradient_errors("entropy", entropy_grads, "ab"),
        "error / (|gradient| + its terms)",
    )


# ---------------------------------------------------------------------------------
# (e) The token head in the patterns GRPO trainers run it in.

# D = 256 and V = 10000: a TPU's untruncated tiles of 4096 tokens, two and a remainder.
TOKEN_PATTERN_SIZES = _token_patterns.Sizes(steps=16, hidden=256, vocab=10000)
TOKEN_PATTERNS = [
    # rows, options, jit, rollout block, table dtype
    *((rows, "top_p", True, None, "float32") for rows in (1, 7, 32, 48, 256)),
    *((rows, "untruncated", True, None, "float32") for rows in (1, 7, 32, 48, 256)),
    (48, "top_p", True, (8, 512), "float32"),
    (7, "top_k+min_p", False, None, "float32"),
    (32, "top_p", True, None, "bfloat16"),
    (32, "untruncated", True, None, "bfloat16"),
    (32, "top_p, unembedding", True, None, "float32"),
    (32, "top_p, unembedding", True, None, "bfloat16"),
]


@pytest.mark.parametrize(
    "rows, name, jit, block, dtype",
    TOKEN_PATTERNS,
    ids=[
        f"{r}-{n}{'' if j else '-eager'}{'-block' if b else ''}-{d}"
        for r, n, j, b, d in TOKEN_PATTERNS
    ],
)
@_measures_all
def test_token_replay_in_the_users_patterns(rows, name, jit, block, dtype):
    """The largest ``|replayed - sampled|`` log-probability (nats) of a decode loop's
    tokens replayed at once, in shuffled minibatches and under ``jax.grad``."""
    found = _token_patterns.measure(
        rows,
        name,
        jit=jit,
        rollout_block=block,
        dtype=jnp.dtype(dtype),
        sizes=TOKEN_PATTERN_SIZES,
    )
    modes = ("" if jit else ", eager") + (", rollout block" if block else "")
    case = f"{rows} rows, {name}{modes}, {dtype}"
    for pattern, error in found.items():
        _measure("token replay patterns", f"{case}: {pattern}", error, "nats")
