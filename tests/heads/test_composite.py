"""``CompositeSampler`` and ``ParameterizedSampler``: each part against the part alone
with the documented stream, replay bit for bit, streams named by the parts, eval and
per-environment streams, a PPO loss and its gradients through a network, the
parameterised log-likelihood and joint entropy against float64 formulas, and the
refusals.

Most structural checks run eagerly: once the first call has compiled the parts' few
operations for these shapes, the variants reuse them, where each traced variant would
compile a program of its own."""

import dataclasses
import zlib

import distrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import integrate, special, stats

from samplers.distributions.bijectors import BoundedTanh, Tanh
from samplers.heads.composite import CompositeSampler, ParameterizedSampler
from samplers.heads.discrete import CategoricalSampler, MultiBinarySampler
from samplers.heads.distribution_sampler import DistributionSampler
from samplers.heads.functional import functional
from samplers.heads.squashed_normal import SquashedNormalSampler
from tests._tiers import SLOW, slow
from tests.helpers import eager_call, jitted_call
from tests.reference import (
    categorical_entropy_float64,
    masked_log_softmax_float64,
    softplus_std_float64,
    tanh_normal_log_prob_float64,
)

B = 8
WEIGHT = 0.1
LOW, HIGH = -2.0, 3.0
# One bijector object each: a head holds its bijector as static configuration compared
# by identity, so heads of the same structure share their traced programs.
BOUNDED, TANH, IDENTITY = BoundedTanh(LOW, HIGH), Tanh(), distrax.Lambda(lambda x: x)
# The parts' sizes: a Categorical of 4 (4), a squashed Normal of 2 (4), 3 bits (3).
SIZES = {"fire": 4, "aim": 4, "buttons": 3}
# Eager by default, as most checks here; traced in the slow tier.
EAGER_OR_JIT = [slow(False, id="eager"), pytest.param(True, id="nnx.jit")]


def _fire(rngs, **options):
    return CategoricalSampler(rngs, WEIGHT, num_actions=4, **options)


def _aim(rngs, **options):
    options.setdefault("bijector", BOUNDED)
    return SquashedNormalSampler(rngs, WEIGHT, action_dim=2, **options)


def _buttons(rngs, **options):
    return MultiBinarySampler(rngs, WEIGHT, num_bits=3, **options)


def _extra(rngs, **options):
    return CategoricalSampler(rngs, WEIGHT, num_actions=2, **options)


MAKERS = {"fire": _fire, "aim": _aim, "buttons": _buttons, "extra": _extra}


def _parts(rngs, names=("fire", "aim", "buttons"), **options):
    """The parts by name, in the given (unsorted) order."""
    return {name: MAKERS[name](rngs, **options) for name in names}


def _first_keys(seed):
    """The sample and entropy keys that the first call of a composite built with
    ``nnx.Rngs(seed)`` draws."""
    stream = nnx.Rngs(seed).default
    return stream(), stream()


def _part_key(key, *path):
    """The key the documented rule gives the part at ``path``: its names folded in."""
    for name in path:
        key = jax.random.fold_in(key, zlib.crc32(name.encode()))
    return key


def _alone(part, part_params, mask, keys, *path):
    """A part's rollout, written from the pure layer: its distribution sampled with the
    key of its path, replayed by the part alone, and its entropy cost from the entropy
    key of its path (a one-sample estimate for a squashed part, else exact)."""
    options = {} if mask is None else {"mask": mask}
    dist = part.distribution(part_params, **options)
    data = dist.sample_replay_data(seed=_part_key(keys[0], *path))
    out = part((), part_params, data, **options)
    if isinstance(part, SquashedNormalSampler):
        cost = -WEIGHT * dist.entropy_estimate(seed=_part_key(keys[1], *path))
    else:
        cost = -WEIGHT * dist.entropy()
    return out, cost


def _params(width, seed=0, batch=(B,)):
    return (2.0 * np.random.default_rng(seed).normal(size=(*batch, width))).astype(np.float32)


def _masks(seed=0, batch=(B,)):
    """A mask per discrete part; ``fire`` never allows action 3, ``buttons`` forces bit 1."""
    rng = np.random.default_rng(seed)
    fire = rng.random((*batch, 4)) < 0.7
    fire[..., 0] = True
    fire[..., 3] = False
    buttons = np.ones((*batch, 3, 2), bool)
    buttons[..., 1, 0] = False
    return {"fire": fire, "buttons": buttons}


def _slices(params, sizes):
    """``params`` sliced along the last axis by ``sizes``, a dict in its order."""
    ends = np.cumsum(list(sizes.values()))
    return dict(zip(sizes, np.split(params, ends[:-1], axis=-1), strict=True))


def _close(a, b):
    """The two pytrees have the same structure and leaves within an ulp or so."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-6)


def _equal(a, b):
    """The two pytrees have the same structure and bitwise equal leaves."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        if jnp.issubdtype(jnp.asarray(x).dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("jitted", EAGER_OR_JIT)
def test_each_part_is_the_part_alone_with_its_stream_and_the_sum_is_exact(jitted):
    call = jitted_call if jitted else eager_call
    # The parts are built with another stream, which the composite does not use.
    head = CompositeSampler(_parts(nnx.Rngs(7)), rngs=nnx.Rngs(0))
    assert head.num_params == sum(SIZES.values()) == 11
    params, masks = _params(11), _masks()
    out = call(head, (), params, mask=masks)
    total, regularization = 0.0, 0.0
    # The oracle runs eagerly: XLA may round a traced program's floats by an ulp.
    same = _close if jitted else _equal
    for name, part_params in _slices(params, SIZES).items():
        part, cost = _alone(
            MAKERS[name](nnx.Rngs(7)), part_params, masks.get(name), _first_keys(0), name
        )
        same(out.output["action"][name], part.output["action"])
        same(out.output["log_likelihoods"][name], part.output["log_likelihood"])
        same(out.rollout_extras[name], part.rollout_extras)
        same(
            {f"{name}/{k}": v for k, v in part.metrics.items()},
            {k: v for k, v in out.metrics.items() if k.startswith(f"{name}/")},
        )
        total = total + np.asarray(part.output["log_likelihood"])
        regularization = regularization + np.asarray(cost)
    assert sorted(out.metrics) == sorted(
        f"{name}/{metric}"
        for name, metrics in [
            ("fire", ("allowed_actions", "masked_probability")),
            ("aim", ("mu", "sigma", "saturation", "bound_distance")),
            ("buttons", ("allowed_actions", "masked_probability")),
        ]
        for metric in metrics
    )
    # The sum in the parts' order, exactly: float32 additions round alike in numpy and XLA.
    assert total.dtype == np.float32 and np.all(np.isfinite(total))
    parts = out.output["log_likelihoods"]
    np.testing.assert_array_equal(
        out.output["log_likelihood"], (parts["fire"] + parts["aim"]) + parts["buttons"]
    )
    same(out.output["log_likelihood"], total)
    if jitted:  # XLA may fuse a part's entropy differently in the two programs: an ulp
        np.testing.assert_allclose(out.regularization_loss, regularization, rtol=1e-6)
    else:
        np.testing.assert_array_equal(out.regularization_loss, regularization)
    assert np.all(np.asarray(out.output["action"]["fire"]) != 3)
    assert np.all(np.asarray(out.output["action"]["buttons"])[:, 1] == 1)


@pytest.mark.parametrize("jitted", EAGER_OR_JIT)
def test_replay_is_bit_for_bit_and_new_params_for_one_part_change_its_ratio_alone(jitted):
    call = jitted_call if jitted else eager_call
    head = CompositeSampler(_parts(nnx.Rngs(0)), rngs=nnx.Rngs(0))
    params, masks = _params(11), _masks()
    out = call(head, (), params, mask=masks)
    again = call(head, (), params, out.rollout_extras, mask=masks)
    _equal(again.output, out.output)
    new, old = np.asarray(again.output["log_likelihood"]), np.asarray(out.output["log_likelihood"])
    assert np.all(np.exp(new - old) == 1.0)  # the PPO ratio
    # A mix of per-part ratios: new params for "aim" alone change its ratio only.
    moved = params.copy()
    moved[:, 4:8] += 0.3
    mixed = call(head, (), moved, out.rollout_extras, mask=masks)
    parts = jax.tree.map(np.asarray, mixed.output["log_likelihoods"])
    log_ratios = {
        name: parts[name] - np.asarray(out.output["log_likelihoods"][name]) for name in SIZES
    }
    assert np.all(log_ratios["fire"] == 0) and np.all(log_ratios["buttons"] == 0)
    assert np.all(np.abs(log_ratios["aim"]) > 1e-4)
    joint = np.asarray(mixed.output["log_likelihood"]) - old
    np.testing.assert_allclose(joint, log_ratios["aim"], rtol=1e-5, atol=1e-5)
    # The joint log-likelihood is the sum of the parts' values output, in order, exactly.
    np.testing.assert_array_equal(
        mixed.output["log_likelihood"], (parts["fire"] + parts["aim"]) + parts["buttons"]
    )


def test_parts_are_sliced_in_the_given_order_not_the_sorted_one():
    head = CompositeSampler({"z": _fire(nnx.Rngs(0)), "a": _buttons(nnx.Rngs(0))}, rngs=nnx.Rngs(0))
    params = np.zeros((B, 7), np.float32)
    params[:, 2] = 50.0  # "z" (first) chooses 2; "a"'s bits are 1
    params[:, 4:] = 50.0
    out = eager_call(head, (), params)
    np.testing.assert_array_equal(out.output["action"]["z"], 2)
    np.testing.assert_array_equal(out.output["action"]["a"], 1)
    # A replay looks the parts up by name, whatever order the stored dict has.
    extras = dict(sorted(out.rollout_extras.items()))
    _equal(
        eager_call(head, (), params, extras).output["log_likelihoods"],
        out.output["log_likelihoods"],
    )
    # A list of parts is a tuple.
    assert isinstance(CompositeSampler([_fire(nnx.Rngs(0))], rngs=nnx.Rngs(0)).parts, tuple)


def test_a_part_s_noise_depends_on_its_name_alone():
    """Adding, removing and reordering parts by name; a nested tuple's names."""
    rngs = nnx.Rngs(0)
    head = CompositeSampler(_parts(nnx.Rngs(1)), rngs=rngs)
    # The composite draws from rngs' default stream when called, not when built.
    assert int(rngs.default.count[...]) == 0
    # "aim" removed, a nested tuple added, the order changed: "fire" and "buttons" draw the
    # same, and the nested part draws from the stream of its path "extra/0".
    other = CompositeSampler(
        {
            "buttons": _buttons(nnx.Rngs(2)),
            "extra": CompositeSampler((_extra(nnx.Rngs(3)),), rngs=nnx.Rngs(9)),
            "fire": _fire(nnx.Rngs(2)),
        },
        rngs=nnx.Rngs(0),
    )
    params = _slices(_params(11), SIZES)
    a = eager_call(head, (), np.concatenate(list(params.values()), -1))
    extra = _params(2, 3)
    b = eager_call(other, (), np.concatenate([params["buttons"], extra, params["fire"]], -1))
    for name in ("fire", "buttons"):
        _equal(a.output["action"][name], b.output["action"][name])
        _equal(a.output["log_likelihoods"][name], b.output["log_likelihoods"][name])
    assert int(rngs.default.count[...]) == 2  # the first call's sample and entropy keys
    keys = _first_keys(0)
    alone, _ = _alone(_extra(nnx.Rngs(5)), extra, None, keys, "extra", "0")
    _equal(b.output["action"]["extra"][0], alone.output["action"])
    assert b.metrics.keys() >= {"extra/0/allowed_actions", "fire/allowed_actions"}
    # Another name draws other noise: "0" alone at the top, not under "extra" (64 uniform
    # choices, so that equal draws by chance are out of the question).
    uniform = np.zeros((64, 2), np.float32)
    draws = [
        _extra(nnx.Rngs(5)).distribution(uniform).sample(seed=_part_key(keys[0], *path))
        for path in (("0",), ("extra", "0"))
    ]
    assert not np.array_equal(*draws)
    # One nnx.RngStream serves as rngs too: its first key.
    from_stream = CompositeSampler(_parts(nnx.Rngs(1)), rngs=nnx.Rngs(0).default)
    c = eager_call(from_stream, (), np.concatenate(list(params.values()), -1))
    _equal(c.output["action"], a.output["action"])


def test_eval_and_train_reach_every_part_and_a_call_s_deterministic_reaches_all():
    inner = CompositeSampler({"fire": _fire(nnx.Rngs(0))}, rngs=nnx.Rngs(0))
    head = CompositeSampler({"inner": inner, "aim": _aim(nnx.Rngs(0))}, rngs=nnx.Rngs(0))
    params = _params(8, 4)
    fire_mode = np.argmax(params[:, :4], -1)
    aim_mode = LOW + (HIGH - LOW) * special.expit(2 * params[:, 4:6].astype(np.float64))

    def by_mode(deterministic=None):
        out = eager_call(head, (), params, deterministic=deterministic)
        fire = np.array_equal(out.output["action"]["inner"]["fire"], fire_mode)
        aim = np.allclose(out.output["action"]["aim"], aim_mode, rtol=1e-6, atol=1e-6)
        return fire, aim

    head.eval()
    assert [module.deterministic for _, module in nnx.iter_modules(head)] == [True] * 4
    assert by_mode() == (True, True)
    assert by_mode(deterministic=False) == (False, False)
    head.train()
    assert not any(module.deterministic for _, module in nnx.iter_modules(head))
    assert by_mode() == (False, False)
    assert by_mode(deterministic=True) == (True, True)
    # A part's own flag, with the composite's False: that part alone acts by its mode.
    head.parts["aim"].eval()
    assert by_mode() == (False, True)
    # The composite's own flag, set directly, makes every part deterministic.
    head.parts["aim"].train()
    head.deterministic = True
    assert by_mode() == (True, True)


def test_per_env_streams_an_environment_s_samples_do_not_depend_on_its_place_in_the_batch():
    names = ("fire", "buttons")
    head = CompositeSampler(_parts(nnx.Rngs(0), names, per_env_streams=True), rngs=nnx.Rngs(0))
    assert head.per_env_streams
    state = head.initialize_state(B)
    assert state.shape == (B,)  # one key per environment, as for any head
    params, masks, order = _params(7, 5), _masks(5), np.arange(B)[::-1]

    def permuted(tree):
        return jax.tree.map(lambda x: x[order], tree)

    whole = eager_call(head, state, params, mask=masks)
    shuffled = eager_call(head, permuted(state), params[order], mask=permuted(masks))
    _equal(shuffled.output["action"], permuted(whole.output["action"]))
    _equal(shuffled.next_state, permuted(whole.next_state))
    _equal(head.reset_state(whole.next_state), whole.next_state)
    later = eager_call(head, whole.next_state, params, mask=masks)
    assert not np.array_equal(later.output["action"]["fire"], whole.output["action"]["fire"])
    with pytest.raises(TypeError, match="per_env_streams=True the state must be one key"):
        head((), params, mask=masks)
    # Without per_env_streams the state is (), as for any head.
    shared = CompositeSampler(_parts(nnx.Rngs(0)), rngs=nnx.Rngs(0))
    assert not shared.per_env_streams
    assert shared.initialize_state(B) == () and shared.reset_state(()) == ()


@SLOW
def test_per_env_streams_an_environment_s_samples_do_not_depend_on_the_batch_split():
    head = CompositeSampler(_parts(nnx.Rngs(0), per_env_streams=True), rngs=nnx.Rngs(0))
    state, params, masks = head.initialize_state(B), _params(11, 5), _masks(5)
    whole = jitted_call(head, state, params, mask=masks)
    halves = [
        jitted_call(
            head,
            state[s],
            params[s],
            mask=jax.tree.map(lambda x, s=s: x[s], masks),
        )
        for s in (slice(0, 4), slice(4, B))
    ]
    joined = jax.tree.map(lambda *x: np.concatenate(x), *(h.output["action"] for h in halves))
    _equal(joined, whole.output["action"])
    joined = jax.tree.map(lambda *x: np.concatenate(x), *(h.output for h in halves))
    for name in SIZES:
        np.testing.assert_allclose(
            joined["log_likelihoods"][name], whole.output["log_likelihoods"][name], rtol=1e-6
        )
    # The replay with the rollout's state replays the entropy noise too.
    again = jitted_call(head, state, params, whole.rollout_extras, mask=masks)
    _equal(again.output["log_likelihoods"], whole.output["log_likelihoods"])
    _equal(again.regularization_loss, whole.regularization_loss)


class _Policy(nnx.Module):
    """A linear layer feeding every part of a head."""

    def __init__(self, head, rngs):
        self.linear = nnx.Linear(5, head.num_params, rngs=rngs)
        self.head = head

    def __call__(self, obs, extras=None, mask=None):
        return self.head((), self.linear(obs), extras, mask=mask)


def _ppo_loss(model, obs, extras, old, advantage, mask):
    out = model(obs, extras, mask)
    ratio = jnp.exp(out.output["log_likelihood"] - old)
    clipped = jnp.clip(ratio, 0.8, 1.2)
    loss = -jnp.mean(jnp.minimum(ratio * advantage, clipped * advantage))
    return loss + jnp.mean(out.regularization_loss), ratio


# Every trace of ``_ppo_step``.
PPO_TRACES = []


@nnx.jit
def _ppo_step(model, obs, mask):
    """A rollout, then the gradient of the PPO loss replaying it at the same weights."""
    PPO_TRACES.append(None)
    out = model(obs, mask=mask)
    advantage = jnp.linspace(-1.0, 1.0, obs.shape[0])
    old = jax.lax.stop_gradient(out.output["log_likelihood"])
    grads, ratio = nnx.grad(_ppo_loss, has_aux=True)(
        model, obs, out.rollout_extras, old, advantage, mask
    )
    return grads, ratio, out


@pytest.mark.slow
def test_a_ppo_loss_through_a_network_reaches_every_part_and_spares_masked_columns():
    rngs = nnx.Rngs(0)
    # Three discrete actions: 0 with two bounded parameters, 1 with a choice of 2, 2 with
    # 3 bits; action 1 is never allowed.
    act = ParameterizedSampler(
        CategoricalSampler(rngs, WEIGHT, num_actions=3),
        (_aim(rngs), _extra(rngs), _buttons(rngs)),
        rngs=rngs,
    )
    head = CompositeSampler({"fire": _fire(rngs), "act": act}, rngs=rngs)
    assert head.num_params == 4 + 3 + 4 + 2 + 3 == 16
    model = _Policy(head, nnx.Rngs(1))
    choice_mask = np.ones((B, 3), bool)
    choice_mask[:, 1] = False
    masks = {"fire": _masks(6)["fire"], "act": choice_mask}
    traces = len(PPO_TRACES)
    for seed in (6, 7):
        obs = np.random.default_rng(seed).normal(size=(B, 5)).astype(np.float32)
        grads, ratio, out = _ppo_step(model, obs, masks)
        # The replay at the rollout's weights: the ratio is exactly 1.
        assert np.all(np.asarray(ratio) == 1.0)
        kernel = np.asarray(grads["linear"]["kernel"][...])
        bias = np.asarray(grads["linear"]["bias"][...])
        assert np.all(np.isfinite(kernel)) and np.all(np.isfinite(bias))
        # Exactly 0 for fire's action 3 and for act's action 1, its logit and its
        # parameters (never allowed), from the log-likelihood and the entropy alike; not 0
        # elsewhere: every part's logits, means and stds.
        spared = [3, 4 + 1, 4 + 3 + 4, 4 + 3 + 4 + 1]
        assert np.all(kernel[:, spared] == 0) and np.all(bias[spared] == 0)
        assert np.all(np.any(kernel[:, np.delete(np.arange(16), spared)] != 0, axis=0))
    assert len(PPO_TRACES) == traces + 1  # new observations reuse the program
    assert "act/parameters/0/mu" in out.metrics and "act/choice/allowed_actions" in out.metrics
    assert np.all(np.asarray(out.output["action"]["act"]["choice"]) != 1)


@pytest.mark.parametrize(
    "build, error, match",
    [
        (lambda: CompositeSampler({}, rngs=nnx.Rngs(0)), TypeError, "at least one part"),
        (
            lambda: CompositeSampler(_fire(nnx.Rngs(0)), rngs=nnx.Rngs(0)),
            TypeError,
            "takes a dict or a tuple of heads, got CategoricalSampler",
        ),
        (
            lambda: CompositeSampler({1: _fire(nnx.Rngs(0))}, rngs=nnx.Rngs(0)),
            TypeError,
            r"needs str keys .* got \[1\]",
        ),
        (
            lambda: CompositeSampler({"a": nnx.Dropout(0.5)}, rngs=nnx.Rngs(0)),
            TypeError,
            "part 'a' must be a policy head .* got Dropout",
        ),
        (
            lambda: CompositeSampler(
                {"a": SquashedNormalSampler(nnx.Rngs(0), WEIGHT)}, rngs=nnx.Rngs(0)
            ),
            ValueError,
            r"part 'a' \(SquashedNormalSampler\) has none \(.*built without action_dim.*\); "
            r"build the part with its size",
        ),
        (
            lambda: CompositeSampler(
                (DistributionSampler(nnx.Rngs(0), WEIGHT, lambda p: None),), rngs=nnx.Rngs(0)
            ),
            ValueError,
            r"part '0' \(DistributionSampler\) has none .*give a head of your own a num_params",
        ),
        (
            lambda: CompositeSampler(
                {
                    "a": (head := _fire(nnx.Rngs(0))),
                    "b": CompositeSampler((head,), rngs=nnx.Rngs(0)),
                },
                rngs=nnx.Rngs(0),
            ),
            TypeError,
            r"parts 'a' and 'b/0' are the same CategoricalSampler; build one head per part",
        ),
        (
            lambda: CompositeSampler(
                {"a": _fire(nnx.Rngs(0), per_env_streams=True), "b": _aim(nnx.Rngs(0))},
                rngs=nnx.Rngs(0),
            ),
            ValueError,
            r"same per_env_streams, got True for \['a'\] and False for \['b'\].*build every part "
            r"with per_env_streams=True",
        ),
        (
            lambda: CompositeSampler({"a": _fire(nnx.Rngs(0))}, rngs=0),
            TypeError,
            "rngs must be an nnx.Rngs or an nnx.RngStream, got int",
        ),
        (
            lambda: CompositeSampler({"a": _fire(nnx.Rngs(0))}, rngs=nnx.Rngs(params=0)),
            ValueError,
            r"no stream named 'action' and no 'default' stream to fall back to \(it has "
            r"\['params'\]\)",
        ),
    ],
    ids=[
        "empty",
        "not-a-structure",
        "int-key",
        "not-a-head",
        "no-action-dim",
        "no-num-params",
        "shared",
        "per-env-mix",
        "rngs-int",
        "no-stream",
    ],
)
def test_what_cannot_be_a_composite_is_refused_at_construction(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_inputs_without_the_parts_structure_are_refused_naming_the_fix():
    head = CompositeSampler(_parts(nnx.Rngs(0)), rngs=nnx.Rngs(0))
    params, masks = _params(11), _masks()
    with pytest.raises(
        ValueError, match=r"inputs of shape \[\*batch, 11\] .*\[4, 4, 3\].*\(8, 10\)"
    ):
        head((), params[:, :10])
    with pytest.raises(TypeError, match="inputs must have a floating dtype, got int32"):
        head((), params.astype(np.int32))
    with pytest.raises(TypeError, match="got a mask for part 'aim', a SquashedNormalSampler"):
        head((), params, mask={"aim": np.ones((B, 2), bool)})
    with pytest.raises(ValueError, match=r"mask has keys \['fir'\] that are no parts"):
        head((), params, mask={"fir": masks["fire"]})
    with pytest.raises(ValueError, match=r"rollout_extras must be a dict with the keys"):
        head((), params, {"fire": np.zeros(B, np.int32)})
    with pytest.raises(ValueError, match=r"per_env_streams=False, so its state is \(\), got list"):
        head([()], params)
    pair = CompositeSampler((_fire(nnx.Rngs(0)), _buttons(nnx.Rngs(0))), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="mask must be a tuple of 2 entries, one per part"):
        pair((), params[:, :7], mask=(masks["fire"],))
    with pytest.raises(ValueError, match=r"rollout_extras must be a tuple of 2 entries"):
        pair((), params[:, :7], {"0": 1, "1": 2})
    nested = _hybrid()
    with pytest.raises(ValueError, match=r"rollout_extras\['parameters'\] must be a tuple of 4"):
        nested((), _params(19), {"choice": np.zeros(B, np.int32), "parameters": (1, 2)})


class _PerChoice(CategoricalSampler):
    """A head that, wrongly, gives one log-likelihood per choice."""

    def _replay(self, dist, data):
        return dataclasses.replace(super()._replay(dist, data), log_likelihood=dist.logits)


def test_a_part_s_log_likelihood_that_is_not_one_value_per_batch_element_is_refused():
    # [8] + [8, 4] would broadcast into a plausible [8, 4] "sum" of the parts.
    head = CompositeSampler(
        {"fire": _fire(nnx.Rngs(0)), "odd": _PerChoice(nnx.Rngs(0), WEIGHT, num_actions=4)},
        rngs=nnx.Rngs(0),
    )
    with pytest.raises(
        ValueError,
        match=r"part 'odd' \(_PerChoice\) returned a log_likelihood of shape \(8, 4\) for inputs "
        r"of batch shape \(8,\); a head gives one value per batch element",
    ):
        head((), _params(8))


def _hybrid(rngs=None):
    """Four discrete actions whose parameters are the composite tests' parts (so that
    eager calls reuse their compiled operations): two bounded, 3 bits, a choice of 4, two
    bounded."""
    rngs = nnx.Rngs(0) if rngs is None else rngs
    return ParameterizedSampler(
        _fire(rngs), (_aim(rngs), _buttons(rngs), _fire(rngs), _aim(rngs)), rngs=rngs
    )


H_SIZES = {"choice": 4, "0": 4, "1": 3, "2": 4, "3": 4}


def test_the_parameterized_log_likelihood_is_the_choice_s_plus_the_chosen_density():
    head = _hybrid()
    assert head.num_params == sum(H_SIZES.values()) == 19
    params = _params(19, 7)
    mask = np.ones((B, 4), bool)
    mask[::2, 1] = False  # even rows may not choose action 1
    out = eager_call(head, (), params, mask=mask)
    choice = np.asarray(out.output["action"]["choice"])
    assert set(choice[::2]) <= {0, 2, 3} and len(set(choice)) >= 3
    pieces = _slices(params, H_SIZES)
    actions, extras = out.output["action"]["parameters"], out.rollout_extras["parameters"]
    bits = np.asarray(actions[1])
    densities = np.stack(
        [
            tanh_normal_log_prob_float64(
                extras[0], pieces["0"][:, :2], softplus_std_float64(pieces["0"][:, 2:]), LOW, HIGH
            ),
            np.sum(
                np.where(
                    bits == 1,
                    special.log_expit(pieces["1"]),
                    special.log_expit(-pieces["1"].astype(np.float64)),
                ),
                -1,
            ),
            np.take_along_axis(
                masked_log_softmax_float64(pieces["2"]), np.asarray(actions[2])[:, None], -1
            )[:, 0],
            tanh_normal_log_prob_float64(
                extras[3], pieces["3"][:, :2], softplus_std_float64(pieces["3"][:, 2:]), LOW, HIGH
            ),
        ],
        -1,
    )
    log_p = np.take_along_axis(
        masked_log_softmax_float64(pieces["choice"], mask), choice[:, None], -1
    )[:, 0]
    chosen = densities[np.arange(B), choice]
    np.testing.assert_allclose(out.output["log_likelihood"], log_p + chosen, rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(out.output["log_likelihoods"]["choice"], log_p, rtol=2e-6, atol=2e-7)
    np.testing.assert_allclose(
        out.output["log_likelihoods"]["parameters"], chosen, rtol=2e-6, atol=2e-6
    )
    assert [np.shape(a) for a in actions] == [(B, 2), (B, 3), (B,), (B, 2)]
    # Each head is its distribution sampled with the key of its path; the log-likelihood
    # is the choice's plus the chosen head's, exactly.
    keys = _first_keys(0)
    alone, _ = _alone(_fire(nnx.Rngs(5)), pieces["choice"], mask, keys, "choice")
    _equal(out.output["action"]["choice"], alone.output["action"])
    _equal(out.output["log_likelihoods"]["choice"], alone.output["log_likelihood"])
    chosen_alone = np.zeros(B, np.float32)
    for k, make in enumerate((_aim, _buttons, _fire, _aim)):
        part, _ = _alone(make(nnx.Rngs(5)), pieces[str(k)], None, keys, "parameters", str(k))
        _equal(actions[k], part.output["action"])
        _equal(extras[k], part.rollout_extras)
        chosen_alone[choice == k] = np.asarray(part.output["log_likelihood"])[choice == k]
    _equal(out.output["log_likelihoods"]["parameters"], chosen_alone)
    _equal(out.output["log_likelihood"], np.asarray(alone.output["log_likelihood"]) + chosen_alone)
    # Replay, bit for bit.
    again = eager_call(head, (), params, out.rollout_extras, mask=mask)
    _equal(again.output, out.output)
    # A stored choice that the replay's mask forbids scores -inf (a PPO ratio of 0).
    forbid_first = np.ones((B, 4), bool)
    forbid_first[:, 0] = False
    refused = np.asarray(
        eager_call(head, (), params, out.rollout_extras, mask=forbid_first).output["log_likelihood"]
    )
    assert 0 < np.sum(choice == 0) < B
    assert np.all(refused[choice == 0] == -np.inf) and np.all(np.isfinite(refused[choice != 0]))


def _closed_form_parameterized():
    """Parameter heads with closed-form entropies: a Normal (identity squashing,
    ``entropy="base"``), 2 bits and a Categorical of 3."""
    rngs = nnx.Rngs(0)
    return ParameterizedSampler(
        CategoricalSampler(rngs, WEIGHT, num_actions=3),
        (
            SquashedNormalSampler(rngs, WEIGHT, action_dim=1, bijector=IDENTITY, entropy="base"),
            MultiBinarySampler(rngs, WEIGHT, num_bits=2),
            CategoricalSampler(rngs, WEIGHT, num_actions=3),
        ),
        rngs=rngs,
    )


@nnx.jit
def _gradients(head, params, mask):
    """A rollout; the gradients w.r.t. ``params`` of its replay's summed log-likelihood
    and of its summed regularization loss; the regularization loss."""
    out = head((), params, mask=mask)
    graphdef, state = nnx.split(head)

    def losses(params):
        # A copy of the head, whose stream may advance inside this transform.
        again = nnx.merge(graphdef, state, copy=True)((), params, out.rollout_extras, mask=mask)
        sums = jnp.stack([again.output["log_likelihood"].sum(), again.regularization_loss.sum()])
        return sums, again.regularization_loss

    (log_likelihood_grad, regularization_grad), loss = jax.jacrev(losses, has_aux=True)(params)
    return out, log_likelihood_grad, regularization_grad, loss


C_SIZES = (3, 2, 2, 3)


def test_unchosen_parameters_get_exactly_zero_gradient_and_the_entropy_is_the_joint_one():
    head = _closed_form_parameterized()
    params, mask = jnp.asarray(_params(10, 9)), np.ones((B, 3), bool)
    mask[1] = [False, True, True]
    out, grad, regularization_grad, loss = _gradients(head, params, mask)
    grad, regularization_grad = np.asarray(grad), np.asarray(regularization_grad)
    assert np.all(np.isfinite(grad)) and np.all(np.isfinite(regularization_grad))
    # The log-likelihood: exactly 0 for the parameters of the actions not chosen.
    choice = np.asarray(out.output["action"]["choice"])
    assert len(set(choice)) >= 2
    ends = np.cumsum(C_SIZES)
    for k in range(3):
        columns = slice(ends[k], ends[k + 1])
        assert np.all(grad[choice != k, columns] == 0)
        assert np.all(np.any(grad[choice == k, columns] != 0, axis=-1))
    # The choice's logits: 1[a = k] - p_k over the allowed actions, 0 for the masked one.
    logits, normal, bits, third = (
        np.asarray(a, np.float64) for a in _slices(params, dict(enumerate(C_SIZES))).values()
    )
    log_p = masked_log_softmax_float64(logits, mask)
    p = np.exp(log_p)
    np.testing.assert_allclose(grad[:, :3], np.eye(3)[choice] - p, rtol=1e-5, atol=1e-6)
    # The entropy: -w H(K, theta_K) = -w (H(K) + sum_k p_k H(theta_k)), in float64.
    bit_log_p = np.stack([special.log_expit(-bits), special.log_expit(bits)], -1)
    entropies = np.stack(
        [
            stats.norm.entropy(normal[:, 0], np.logaddexp(0.0, normal[:, 1]) + 1e-3),
            categorical_entropy_float64(bit_log_p).sum(-1),
            categorical_entropy_float64(masked_log_softmax_float64(third)),
        ],
        -1,
    )
    choice_entropy = categorical_entropy_float64(log_p)
    joint = choice_entropy + np.sum(p * entropies, -1)
    np.testing.assert_allclose(loss, -WEIGHT * joint, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(out.regularization_loss, loss, rtol=1e-6)
    # d/dz_j of -w (H(p) + sum_k p_k H_k) = -w p_j (H_j - sum_k p_k H_k - log p_j - H(p)):
    # p keeps its gradient.
    mean_entropy = np.sum(p * entropies, -1, keepdims=True)
    log_p = np.where(mask, log_p, 0.0)
    expected = -WEIGHT * p * (entropies - mean_entropy - log_p - choice_entropy[:, None])
    np.testing.assert_allclose(regularization_grad[:, :3], expected, rtol=1e-4, atol=1e-7)
    # Row 1 forbids action 0: its logit and parameters get exactly 0 from the entropy.
    assert np.all(regularization_grad[1, [0, 3, 4]] == 0)
    assert np.all(regularization_grad[1, np.r_[1:3, 5:10]] != 0)


def _parameterized(rngs=None, entropy="sample", **options):
    """Three discrete actions: 0 with a tanh parameter, 1 with two bounded ones, 2 with
    a discrete parameter of 3 values."""
    rngs = nnx.Rngs(0) if rngs is None else rngs
    return ParameterizedSampler(
        CategoricalSampler(rngs, WEIGHT, num_actions=3, **options),
        (
            SquashedNormalSampler(
                rngs, WEIGHT, action_dim=1, bijector=TANH, entropy=entropy, **options
            ),
            _aim(rngs, entropy=entropy, **options),
            CategoricalSampler(rngs, WEIGHT, num_actions=3, **options),
        ),
        rngs=rngs,
    )


P_SIZES = (3, 2, 4, 3)


@SLOW
def test_the_joint_entropy_is_minus_the_mean_log_likelihood_of_the_head_s_own_samples():
    """Monte Carlo: -E[log p(K, theta_K)] over 40000 draws of one row, within 4 standard
    errors of -regularization_loss / w, with the squashed heads' exact entropies."""
    head = _parameterized(entropy="exact")
    n = 40000
    params = np.broadcast_to(_params(12, 10, batch=(1,)), (n, 12))
    out = jitted_call(head, (), params)
    log_likelihood = np.asarray(out.output["log_likelihood"], np.float64)
    estimate, error = -log_likelihood.mean(), log_likelihood.std() / np.sqrt(n)
    exact = -float(out.regularization_loss[0]) / WEIGHT
    assert abs(estimate - exact) < 4 * error, (estimate, exact, error)
    assert error < 0.02


@SLOW
def test_the_exact_entropy_of_tanh_parameters_against_quadrature():
    head = _parameterized(entropy="exact")
    params = _params(12, 9)
    out = jitted_call(head, (), params)
    logits, first, second, third = (
        np.asarray(a, np.float64) for a in _slices(params, dict(enumerate(P_SIZES))).values()
    )

    def tanh_entropy(mean, std, low=-1.0, high=1.0):
        def log_derivative(x):
            return np.log((high - low) / 2) + np.log(4.0) - 2 * np.logaddexp(x, -x)

        expectation = integrate.quad(
            lambda x: stats.norm.pdf(x, mean, std) * log_derivative(x),
            mean - 12 * std,
            mean + 12 * std,
            epsabs=1e-13,
            epsrel=1e-12,
            limit=200,
        )[0]
        return stats.norm.entropy(mean, std) + expectation

    std = [np.logaddexp(0.0, a[:, a.shape[1] // 2 :]) + 1e-3 for a in (first, second)]
    entropies = np.zeros((B, 3))
    for b in range(B):
        entropies[b, 0] = tanh_entropy(first[b, 0], std[0][b, 0])
        entropies[b, 1] = sum(tanh_entropy(second[b, i], std[1][b, i], LOW, HIGH) for i in range(2))
    entropies[:, 2] = categorical_entropy_float64(masked_log_softmax_float64(third))
    log_p = masked_log_softmax_float64(logits)
    joint = categorical_entropy_float64(log_p) + np.sum(np.exp(log_p) * entropies, -1)
    np.testing.assert_allclose(out.regularization_loss, -WEIGHT * joint, rtol=2e-5, atol=1e-6)


@SLOW
def test_parameterized_per_env_streams_and_eval():
    head = _parameterized(per_env_streams=True)
    state = head.initialize_state(B)
    assert state.shape == (B,)
    params = _params(12, 11)
    whole = jitted_call(head, state, params)
    half = jitted_call(head, state[4:], params[4:])
    _equal(jax.tree.map(lambda x: np.asarray(x)[4:], whole.output["action"]), half.output["action"])
    head.eval()
    modes = jitted_call(head, state, params).output["action"]
    np.testing.assert_array_equal(modes["choice"], np.argmax(params[:, :3], -1))
    np.testing.assert_array_equal(modes["parameters"][2], np.argmax(params[:, 9:], -1))


def test_a_parameterized_head_that_cannot_work_is_refused():
    rngs = nnx.Rngs(0)
    with pytest.raises(TypeError, match="choice must be a CategoricalSampler, got MultiBinary"):
        ParameterizedSampler(_buttons(rngs), (_aim(rngs),), rngs=rngs)
    with pytest.raises(ValueError, match=r"the choice has 4 actions, got 2; give the choice 2"):
        ParameterizedSampler(_fire(rngs), (_aim(rngs), _aim(rngs)), rngs=rngs)
    with pytest.raises(TypeError, match="parameters must be a tuple of heads"):
        ParameterizedSampler(_fire(rngs), _aim(rngs), rngs=rngs)
    with pytest.raises(ValueError, match=r"part 'parameters/0' .* has none"):
        ParameterizedSampler(
            CategoricalSampler(rngs, WEIGHT, num_actions=1),
            (SquashedNormalSampler(rngs, WEIGHT),),
            rngs=rngs,
        )
    with pytest.raises(TypeError, match=r"parts 'parameters/0' and 'parameters/1' are the same"):
        head = _aim(rngs)
        ParameterizedSampler(
            CategoricalSampler(rngs, WEIGHT, num_actions=2), (head, head), rngs=rngs
        )


@SLOW
def test_float64_parameters_give_the_float64_log_likelihood_and_joint_entropy():
    with jax.enable_x64():
        head = _closed_form_parameterized()
        params = _params(10, 12).astype(np.float64)
        out = jax.tree.map(np.asarray, eager_call(head, (), params))
    assert out.output["log_likelihood"].dtype == out.regularization_loss.dtype == np.float64
    logits, normal, bits, third = _slices(params, dict(enumerate(C_SIZES))).values()
    choice, actions = out.output["action"]["choice"], out.output["action"]["parameters"]
    std = np.logaddexp(0.0, normal[:, 1]) + 1e-3
    densities = np.stack(
        [
            stats.norm.logpdf(actions[0][:, 0], normal[:, 0], std),
            np.sum(
                np.where(actions[1] == 1, special.log_expit(bits), special.log_expit(-bits)), -1
            ),
            np.take_along_axis(masked_log_softmax_float64(third), actions[2][:, None], -1)[:, 0],
        ],
        -1,
    )
    log_p = masked_log_softmax_float64(logits)
    expected = (
        np.take_along_axis(log_p, choice[:, None], -1)[:, 0] + densities[np.arange(B), choice]
    )
    np.testing.assert_allclose(out.output["log_likelihood"], expected, rtol=1e-12, atol=1e-12)
    bit_log_p = np.stack([special.log_expit(-bits), special.log_expit(bits)], -1)
    entropies = np.stack(
        [
            stats.norm.entropy(normal[:, 0], std),
            categorical_entropy_float64(bit_log_p).sum(-1),
            categorical_entropy_float64(masked_log_softmax_float64(third)),
        ],
        -1,
    )
    joint = categorical_entropy_float64(log_p) + np.sum(np.exp(log_p) * entropies, -1)
    np.testing.assert_allclose(out.regularization_loss, -WEIGHT * joint, rtol=1e-12, atol=1e-14)


@SLOW
def test_a_composite_runs_through_functional_and_replays_bit_for_bit():
    head = CompositeSampler(_parts(nnx.Rngs(0)), rngs=nnx.Rngs(0))
    apply, state = functional(head)
    params = _params(11)
    out, state = apply(state, params)
    again, state = apply(state, params, out.rollout_extras)
    _equal(again.output["log_likelihoods"], out.output["log_likelihoods"])
    nnx.update(head, state)
    # The composite's stream advanced twice a call, a sample key and an entropy key, as
    # its "aim" part estimates its entropy from a sample; the parts' own are unused.
    assert int(head.rng.default.count[...]) == 4
    assert all(int(part.rng.default.count[...]) == 0 for part in head.parts.values())
