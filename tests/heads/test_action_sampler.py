"""The one head shell: every head has the same call, ``distribution`` and key rule.

Checked on one instance of every public head: the call's signature and that no head
writes a call of its own; ``distribution(inputs, mask=None)``; a mask refused by a
head that takes none; the old keyword names of the network output, deprecated; and
the rule that a call that needs no noise draws no key, so that plain ``jax.grad`` of a
loss that replays through such a head works, and gives the gradient of the pure
layer's replay.
"""

import inspect

import distrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import samplers
from tests._tiers import slow


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


def _inputs(head, seed=0):
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
        dist = head.distribution(_inputs(head))
        assert isinstance(dist, distrax.Distribution), name
        kinds = {p.kind for p in inspect.signature(type(head).__init__).parameters.values()}
        assert inspect.Parameter.VAR_KEYWORD not in kinds, name


def test_a_head_that_takes_no_mask_refuses_one_naming_itself():
    for name, head in _heads(nnx.Rngs(0)).items():
        if head.takes_mask:
            continue
        with pytest.raises(TypeError, match=f"{name} takes no mask, got one of type ndarray"):
            head((), _inputs(head), mask=np.ones((4, 3), bool))
        with pytest.raises(TypeError, match=f"{name} takes no mask"):
            head.distribution(_inputs(head), mask=np.ones((4, 3), bool))


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


def _count(head):
    return sum(int(count) for count in jax.tree.leaves(nnx.state(head, nnx.RngCount)))


# The default tier runs the specified head and a composite (whose parts are a squashed
# Normal, a Beta and a discrete head); the others repeat the same shell in the slow tier.
DEFAULT_TIER = ("NormalTanhSampler", "CompositeSampler")


@pytest.mark.parametrize(
    "name",
    [pytest.param(name) if name in DEFAULT_TIER else slow(name) for name in _heads(nnx.Rngs(0))],
)
def test_a_replay_or_an_eval_call_with_an_exact_entropy_draws_no_key_and_is_pure(name):
    for head in [_heads(nnx.Rngs(0))[name]]:  # a stream of its own
        inputs = _inputs(head)
        built = _count(head)  # an autoregressive head's conditioners drew their weights
        rollout = head((), inputs)
        drawn = _count(head)
        assert drawn - built == 2, name  # the sample's key and one more, as every head
        extras = rollout.rollout_extras

        def loss(x, head=head, extras=extras):
            out = head((), x, extras)
            return jnp.sum(out.output["log_likelihood"]) + jnp.sum(out.regularization_loss)

        # Plain jax.grad of a loss that closes over the head (jitted, as a training step
        # is): no module state changes, so no TraceContextError.
        grad = jax.jit(jax.grad(loss))(inputs)
        assert _count(head) == drawn, name

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
        assert _count(head) == drawn, name


def test_the_specified_sampler_draws_as_specified():
    """Its one-sample entropy needs a key in every call: rollout and replay draw two,
    an eval call one (the entropy's)."""
    head = samplers.NormalTanhSampler(nnx.Rngs(0), 0.1)
    inputs = jax.random.normal(jax.random.key(0), (4, 4))
    rollout = head((), inputs)
    assert _count(head) == 2
    head((), inputs, rollout.rollout_extras)
    assert _count(head) == 4
    head.eval()
    head((), inputs)
    assert _count(head) == 5
