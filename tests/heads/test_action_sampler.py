"""The one head shell, ``ActionSampler``: what every head does the same way.

Checked on one instance of every public head: the call's signature and that no head
writes a call of its own; ``distribution(inputs, mask=None)``; a mask refused by a
head that takes none; the old keyword names of the network output, deprecated; and
the rule that a call that needs no noise draws no key, so that plain ``jax.grad`` of a
loss that replays through such a head works, and gives the gradient of the pure
layer's replay.

Then, on the squashed-Normal heads (and ``DistributionSampler``): which calls draw
keys; the RNG stream (``rngs``, a named stream and its fallback to ``default``, a
call-time ``deterministic``); the carry state; per-environment streams
(``per_env_streams``); and the errors for a missing stream or a bad state. A head's own
tests check what its draws are; this file, that every head takes its keys alike.
"""

import functools
import inspect

import distrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import samplers
from tests import reference
from tests._tiers import JIT_MODES, slow
from tests.helpers import keys_drawn, normal_inputs

# The squashed-Normal heads of the stream and state tests below: their options, action
# size and network outputs.
A = 3
OPTIONS = {"entropy_weight": 0.01, "min_std": 1e-3, "std_scale": 1.0}
_inputs = functools.partial(normal_inputs, width=2 * A, scale=2.0)


def _heads(rngs, entropy="exact"):
    """One head of each public kind, each with an exact entropy where it has a choice
    (the flow's base entropy, which it has in closed form)."""
    box = {"entropy": entropy, "action_dim": 2}
    return {
        "NormalTanhSampler": samplers.NormalTanhSampler(rngs, 0.1, **box),
        "SquashedNormalSampler": samplers.SquashedNormalSampler(
            rngs, 0.1, bijector=samplers.BoundedTanh(-2.0, 3.0), **box
        ),
        "StateIndependentSampler": samplers.StateIndependentSampler(rngs, 2, 0.1, entropy=entropy),
        "BetaSampler": samplers.BetaSampler(rngs, 0.1, action_dim=2, low=-1.0, high=1.0),
        "CategoricalSampler": samplers.CategoricalSampler(rngs, 0.1, 3),
        "MultiDiscreteSampler": samplers.MultiDiscreteSampler(rngs, 0.1, (3, 2)),
        "MultiBinarySampler": samplers.MultiBinarySampler(rngs, 0.1, 3),
        "DistributionSampler": samplers.DistributionSampler(
            rngs, 0.1, lambda p: distrax.Categorical(logits=p)
        ),
        "CompositeSampler": samplers.CompositeSampler(
            {
                "move": samplers.SquashedNormalSampler(rngs, 0.1, **box),
                "fire": samplers.CategoricalSampler(rngs, 0.1, 2),
            },
            rngs=rngs,
        ),
        "AutoregressiveSampler": samplers.AutoregressiveSampler(
            {
                "fire": samplers.CategoricalSampler(rngs, 0.1, 2),
                "move": samplers.SquashedNormalSampler(rngs, 0.1, **box),
            },
            features=5,
            entropy_weight=0.1,
            rngs=rngs,
        ),
        "FlowSampler": samplers.FlowSampler(
            rngs,
            0.1,
            action_dim=2,
            feature_dim=3,
            entropy="base" if entropy == "exact" else entropy,
            hidden_sizes=(8,),
        ),
        "ParameterizedSampler": samplers.ParameterizedSampler(
            samplers.CategoricalSampler(rngs, 0.1, 2),
            (
                samplers.SquashedNormalSampler(rngs, 0.1, **box),
                samplers.BetaSampler(rngs, 0.1, action_dim=1),
            ),
            rngs=rngs,
        ),
        "TokenSampler": samplers.TokenSampler(rngs, 0.1, vocab_size=50, top_p=0.8, max_kept=16),
    }


def _width(head):
    return head.num_params if not isinstance(head, samplers.DistributionSampler) else 3


def _inputs_for(head, seed=0):
    if isinstance(head, samplers.TokenSampler):  # hidden states and an unembedding
        hidden_key, unembedding_key = jax.random.split(jax.random.key(seed))
        return (
            jax.random.normal(hidden_key, (4, 8)),
            jax.random.normal(unembedding_key, (8, head.vocab_size)),
        )
    return jax.random.normal(jax.random.key(seed), (4, _width(head)))


def test_every_public_head_is_covered_here():
    heads = {
        name
        for name in samplers.__all__
        if isinstance(getattr(samplers, name), type)
        and issubclass(getattr(samplers, name), samplers.ActionSampler)
        and getattr(samplers, name) is not samplers.ActionSampler
    }
    assert heads == set(_heads(nnx.Rngs(0)))


def test_every_head_has_the_one_call_and_distribution_and_visible_options():
    keyword = inspect.Parameter.KEYWORD_ONLY
    expected = [
        ("state", inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.empty),
        ("inputs", inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.empty),
        ("rollout_extras", inspect.Parameter.POSITIONAL_OR_KEYWORD, None),
        ("mask", keyword, None),
        ("deterministic", keyword, None),
    ]
    for name, head in _heads(nnx.Rngs(0)).items():
        # The shell's call, written once: no head writes its own.
        assert type(head).__call__ is samplers.ActionSampler.__call__, name
        parameters = inspect.signature(head.__call__).parameters.values()
        assert [(p.name, p.kind, p.default) for p in parameters] == expected, name
        parameters = inspect.signature(head.distribution).parameters
        assert list(parameters) == ["inputs", "mask"], name
        dist = head.distribution(_inputs_for(head))
        assert isinstance(dist, distrax.Distribution), name
        kinds = {p.kind for p in inspect.signature(type(head).__init__).parameters.values()}
        assert inspect.Parameter.VAR_KEYWORD not in kinds, name


def test_a_head_that_takes_no_mask_refuses_one_naming_itself():
    for name, head in _heads(nnx.Rngs(0)).items():
        if head.takes_mask:
            continue
        with pytest.raises(TypeError, match=f"{name} takes no mask, got one of type ndarray"):
            head((), _inputs_for(head), mask=np.ones((4, 3), bool))
        with pytest.raises(TypeError, match=f"{name} takes no mask"):
            head.distribution(_inputs_for(head), mask=np.ones((4, 3), bool))


@pytest.mark.parametrize(
    "make, old",
    [
        pytest.param(lambda r: samplers.NormalTanhSampler(r, 0.1), "mean_and_std", id="normal"),
        slow(lambda r: samplers.BetaSampler(r, 0.1), "params", id="beta"),
        slow(lambda r: samplers.CategoricalSampler(r, 0.1, 4), "logits", id="categorical"),
    ],
)
def test_the_old_names_of_the_network_output_still_work_with_a_deprecation(make, old):
    inputs = jax.random.normal(jax.random.key(0), (4, 4))
    new, legacy = make(nnx.Rngs(0)), make(nnx.Rngs(0))
    expected = new((), inputs)
    with pytest.warns(DeprecationWarning, match=rf"\({old}=\.\.\.\) is deprecated"):
        got = legacy((), **{old: inputs})
    np.testing.assert_array_equal(got.output["log_likelihood"], expected.output["log_likelihood"])
    with pytest.warns(DeprecationWarning), pytest.raises(TypeError, match="once"):
        legacy((), inputs, **{old: inputs})


# The default tier runs the specified head and a composite (whose parts are a squashed
# Normal, a Beta and a discrete head); the others repeat the same shell in the slow tier.
DEFAULT_TIER = ("NormalTanhSampler", "CompositeSampler")


@pytest.mark.parametrize(
    "name",
    [pytest.param(name) if name in DEFAULT_TIER else slow(name) for name in _heads(nnx.Rngs(0))],
)
def test_a_replay_or_an_eval_call_with_an_exact_entropy_draws_no_key_and_is_pure(name):
    for head in [_heads(nnx.Rngs(0))[name]]:  # a stream of its own
        inputs = _inputs_for(head)
        built = keys_drawn(head)  # an autoregressive head's conditioners drew their weights
        rollout = head((), inputs)
        drawn = keys_drawn(head)
        assert drawn - built == 2, name  # the sample's key and one more, as every head
        extras = rollout.rollout_extras

        def loss(x, head=head, extras=extras):
            out = head((), x, extras)
            return jnp.sum(out.output["log_likelihood"]) + jnp.sum(out.regularization_loss)

        # Plain jax.grad of a loss that closes over the head (jitted, as a training step
        # is): no module state changes, so no TraceContextError.
        grad = jax.jit(jax.grad(loss))(inputs)
        assert keys_drawn(head) == drawn, name

        def pure(x, head=head, extras=extras):
            dist = head.distribution(x)
            _, log_prob = (
                dist.replay(extras)
                if hasattr(dist, "replay")
                else (
                    None,
                    dist.log_prob(extras),
                )
            )
            # A flow has no closed-form entropy: its head's exact cost is the base's.
            flow = isinstance(dist, samplers.SquashedFlow)
            entropy = dist.distribution.entropy() if flow else dist.entropy()
            return jnp.sum(log_prob) - 0.1 * jnp.sum(entropy)

        if name not in ("CompositeSampler", "ParameterizedSampler"):  # their own costs
            expected = jax.jit(jax.grad(pure))(inputs)
            for got, want in zip(jax.tree.leaves(grad), jax.tree.leaves(expected), strict=True):
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grad)), name
        head.eval()
        head((), inputs)
        assert keys_drawn(head) == drawn, name


def test_the_specified_sampler_draws_as_specified():
    """Its one-sample entropy needs a key in every call: rollout and replay draw two,
    an eval call one (the entropy's)."""
    head = samplers.NormalTanhSampler(nnx.Rngs(0), 0.1)
    inputs = jax.random.normal(jax.random.key(0), (4, 4))
    rollout = head((), inputs)
    assert keys_drawn(head) == 2
    head((), inputs, rollout.rollout_extras)
    assert keys_drawn(head) == 4
    head.eval()
    head((), inputs)
    assert keys_drawn(head) == 5


@pytest.mark.parametrize("deterministic", [False, True], ids=["train", "eval"])
def test_rollout_and_replay_advance_the_stream_alike(deterministic):
    head = samplers.NormalTanhSampler(nnx.Rngs(0), **OPTIONS)
    head.set_attributes(deterministic=deterministic)
    mean_and_std = _inputs((4,))
    rollout = head((), mean_and_std)
    after_rollout = keys_drawn(head)
    head((), mean_and_std, rollout.rollout_extras)
    assert keys_drawn(head) - after_rollout == after_rollout == (1 if deterministic else 2)


def test_state_interface():
    head = samplers.NormalTanhSampler(nnx.Rngs(0), **OPTIONS)
    assert head.initialize_state(8) == () and head.reset_state(()) == ()
    assert head((), _inputs((4,))).next_state == ()


def _per_env(**options):
    return samplers.NormalTanhSampler(nnx.Rngs(3), **OPTIONS, per_env_streams=True, **options)


def _tree_equal(a, b, rtol=0.0):
    """Keys bit for bit; floats to ``rtol`` (XLA may round a jitted batch of another
    size differently in the last bit, as it vectorises loops by shape)."""
    leaves = [jax.tree.leaves(t) for t in (a, b)]
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(*leaves, strict=True):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            np.testing.assert_array_equal(jax.random.key_data(x), jax.random.key_data(y))
        else:
            np.testing.assert_allclose(x, y, rtol=rtol, atol=rtol * 1e-2)


@pytest.mark.slow  # the default tier draws and replays per-environment streams elsewhere
@pytest.mark.parametrize("jitted", JIT_MODES)
def test_per_env_streams_do_not_depend_on_how_the_batch_is_split(jitted):
    head = _per_env()
    call = nnx.jit(lambda head, *args: head(*args)) if jitted else (lambda head, *args: head(*args))
    keys = head.initialize_state(8)
    for step in range(3):
        inputs = _inputs((8,), seed=step)
        whole = call(head, keys, inputs)
        parts = [call(head, keys[s], inputs[s]) for s in (slice(0, 3), slice(3, 8))]
        rtol = 1e-6 if jitted else 0.0
        _tree_equal(whole, jax.tree.map(lambda *xs: jnp.concatenate(xs), *parts), rtol)
        single = call(head, keys[5], inputs[5])  # an unbatched call with that env's key
        _tree_equal(jax.tree.map(lambda x: x[5], whole), single, rtol)
        keys = whole.next_state
    assert keys_drawn(head) == 1  # initialize_state drew one key; calls draw none

    # The module's own stream is not minibatch-invariant: the same check fails there.
    shared = samplers.NormalTanhSampler(nnx.Rngs(3), **OPTIONS)
    whole = shared((), _inputs((8,))).output["action"]
    tail = shared((), _inputs((8,))[3:]).output["action"]
    assert not jnp.allclose(whole[3:], tail)


def test_per_env_streams_draw_each_environment_from_its_own_key():
    head = _per_env()
    keys = head.initialize_state(4)
    inputs = _inputs((4,))
    out = head(keys, inputs)
    mean, std = reference.params_float64(inputs)
    for env in range(4):
        next_key, sample_key, entropy_key = jax.random.split(keys[env], 3)
        _tree_equal(out.next_state[env], next_key)
        pre_image = mean[env] + std[env] * jax.random.normal(sample_key, (A,))
        np.testing.assert_allclose(out.rollout_extras[env], pre_image, rtol=1e-5, atol=1e-6)
        noisy = mean[env] + std[env] * jax.random.normal(entropy_key, (A,))
        entropy = reference.tanh_normal_entropy_estimate_float64(noisy, std[env])
        np.testing.assert_allclose(out.regularization_loss[env], -0.01 * entropy, rtol=1e-5)


def test_per_env_streams_replay_and_eval_consume_the_keys_alike():
    head = _per_env()
    keys = head.initialize_state(5)
    inputs = _inputs((5,))
    rollout = head(keys, inputs)
    replay = head(keys, inputs, rollout.rollout_extras)
    head.eval()
    evaluation = head(keys, inputs)
    eval_replay = head(keys, inputs, rollout.rollout_extras)
    for out in (replay, evaluation, eval_replay):
        _tree_equal(out.next_state, rollout.next_state)
        _tree_equal(out.regularization_loss, rollout.regularization_loss)
    _tree_equal(replay.output, rollout.output)
    _tree_equal(eval_replay.output, rollout.output)
    np.testing.assert_array_equal(evaluation.output["action"], jnp.tanh(inputs[..., :A]))
    assert keys_drawn(head) == 1
    _tree_equal(head.reset_state(rollout.next_state), rollout.next_state)


def test_per_env_streams_replay_a_stacked_trajectory_in_one_call():
    head = _per_env()
    apply, state = samplers.functional(head)
    keys = head.initialize_state(4)
    inputs = _inputs((6, 4))
    carries, rollouts = [], []
    for t in range(6):
        carries.append(keys)
        out, state = apply(state, inputs[t], carry=keys)
        rollouts.append(out)
        keys = out.next_state
    rollout = jax.tree.map(lambda *xs: jnp.stack(xs), *rollouts)
    replay, _ = apply(state, inputs, rollout.rollout_extras, carry=jnp.stack(carries))
    _tree_equal(replay.output, rollout.output)
    _tree_equal(replay.regularization_loss, rollout.regularization_loss)
    _tree_equal(replay.next_state, rollout.next_state)


@pytest.mark.parametrize(
    "state, error, message",
    [
        ((), TypeError, r"the state must be one key per environment, got tuple; pass"),
        (jax.random.split(jax.random.key(0), 3), ValueError, r"shape \(5,\), got \(3,\)"),
        (jnp.zeros((5, 2), jnp.uint32), TypeError, r"one key per environment, got ArrayImpl"),
    ],
    ids=["empty", "wrong-shape", "raw-keys"],
)
def test_per_env_streams_refuse_a_state_that_is_not_one_key_per_environment(state, error, message):
    with pytest.raises(error, match=message):
        _per_env()(state, _inputs((5,)))


def _all_samplers(**stream):
    return [
        samplers.NormalTanhSampler(entropy_weight=0.01, **stream),
        samplers.SquashedNormalSampler(
            entropy_weight=0.01, bijector=samplers.BoundedTanh(-2.0, 2.0), **stream
        ),
        samplers.StateIndependentSampler(action_dim=A, entropy_weight=0.01, **stream),
        samplers.DistributionSampler(
            entropy_weight=0.01,
            make_distribution=lambda p: distrax.Independent(distrax.Normal(p, 1.0), 1),
            **stream,
        ),
    ]


def _sampler_inputs(head):
    width = (
        A
        if isinstance(head, samplers.StateIndependentSampler | samplers.DistributionSampler)
        else 2 * A
    )
    return _inputs((4,))[..., :width]


def _options(head):
    """The positional arguments after the stream that ``_all_samplers`` gave ``head``."""
    if isinstance(head, samplers.DistributionSampler):
        return {"entropy_weight": 0.01, "make_distribution": head._make_distribution.value}
    if isinstance(head, samplers.StateIndependentSampler):
        return {"action_dim": A, "entropy_weight": 0.01}
    return {"entropy_weight": 0.01, "bijector": head.bijector}


def test_samplers_take_flax_rngs_keyword_and_give_the_positional_outputs():
    keyword = _all_samplers(rngs=nnx.Rngs(5))
    shared = nnx.Rngs(5)
    positional = [type(head)(shared, **_options(head)) for head in keyword]
    with pytest.deprecated_call(match=r"the rng= keyword is deprecated"):
        deprecated = _all_samplers(rng=nnx.Rngs(5))
    for ours, theirs, old in zip(keyword, positional, deprecated, strict=True):
        x = _sampler_inputs(ours)
        leaves = jax.tree.leaves(ours((), x))
        for a, b, c in zip(
            leaves, jax.tree.leaves(theirs((), x)), jax.tree.leaves(old((), x)), strict=True
        ):
            np.testing.assert_array_equal(a, b)
            np.testing.assert_array_equal(a, c)


def test_samplers_take_one_rng_stream_and_a_call_time_deterministic():
    for i in range(4):
        streams = nnx.Rngs(params=0, action=7)
        ours = _all_samplers(rngs=streams.action)[i]
        theirs = _all_samplers(rngs=nnx.Rngs(action=7))[i]
        x = _sampler_inputs(ours)
        first = ours((), x)
        np.testing.assert_array_equal(first.output["action"], theirs((), x).output["action"])
        # deterministic=True for one call acts as eval() does, and leaves the flag alone.
        once = ours((), x, deterministic=True)
        ours.eval()
        evaluated = ours((), x)
        ours.train()
        np.testing.assert_array_equal(once.output["action"], evaluated.output["action"])
        assert not ours.deterministic
        ours.eval()
        sampled = ours((), x, deterministic=False)
        assert not np.array_equal(sampled.output["action"], evaluated.output["action"])
        assert int(streams.params.count[...]) == 0


def test_samplers_draw_from_the_action_stream_and_fall_back_to_default():
    named = nnx.Rngs(params=0, action=1)
    for head in _all_samplers(rngs=named):
        before = int(named.action.count[...])
        head((), _sampler_inputs(head))
        assert int(named.action.count[...]) == before + 2
    assert int(named.params.count[...]) == 0
    # The action stream seeded with 1 gives what the specified sampler draws from nnx.Rngs(1).
    head = samplers.NormalTanhSampler(entropy_weight=0.01, rngs=nnx.Rngs(params=0, action=1))
    mean_and_std = _inputs((4,))
    spec = reference.spec_sampler_call(nnx.Rngs(1), mean_and_std, **OPTIONS)
    np.testing.assert_array_equal(head((), mean_and_std).output["action"], spec["action"])
    other = nnx.Rngs(params=0, noise=3)
    samplers.NormalTanhSampler(rngs=other, entropy_weight=0.01, rng_collection="noise")(
        (), mean_and_std
    )
    assert int(other.noise.count[...]) == 2


def test_a_flax_module_built_with_named_streams_holds_a_sampler():
    class Actor(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.linear = nnx.Linear(5, 2 * A, rngs=rngs)
            self.head = samplers.NormalTanhSampler(entropy_weight=0.0, rngs=rngs)

        def __call__(self, obs):
            return self.head((), self.linear(obs)).output["action"]

    actor = Actor(nnx.Rngs(params=0, action=1))
    act = nnx.jit(lambda actor, obs: actor(obs))
    first, second = act(actor, jnp.ones((2, 5))), act(actor, jnp.ones((2, 5)))
    assert first.shape == (2, A) and not np.array_equal(first, second)


@pytest.mark.parametrize(
    "stream, error, message",
    [
        ({}, TypeError, r"a sampler needs a random stream: pass rngs=nnx.Rngs\(0\)"),
        (
            {"rngs": nnx.Rngs(params=0)},
            ValueError,
            r"the nnx.Rngs has no stream named 'action' and no 'default' stream to fall back to "
            r"\(it has \['params'\]\); pass nnx.Rngs\(action=0\)",
        ),
        (
            {"rngs": nnx.Rngs(0), "rng_collection": 3},
            TypeError,
            r"rng_collection must be a stream name, got 3",
        ),
    ],
)
def test_a_missing_or_bad_stream_is_refused(stream, error, message):
    with pytest.raises(error, match=message):
        samplers.NormalTanhSampler(entropy_weight=0.01, **stream)
    with pytest.raises(error, match=message):
        samplers.DistributionSampler(
            entropy_weight=0.01, make_distribution=distrax.Normal, **stream
        )
