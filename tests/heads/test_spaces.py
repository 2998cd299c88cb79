"""``head_for`` on gymnasium and gymnax spaces: the head, its ``num_params``, actions the
space contains, log-likelihoods against float64 formulas, and refusals."""

import collections

import distrax
import gymnasium.spaces as gym
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from gymnax.environments import spaces as gymnax
from scipy import special, stats

import samplers
from samplers.heads.composite import CompositeSampler
from tests._tiers import SLOW, slow
from tests.helpers import jitted_call
from tests.reference import softplus_std_float64, tanh_normal_log_prob_float64

BATCH = 256


def _f32(*values):
    return np.array(values, np.float32)


def _head_for(space, **options):
    return samplers.head_for(space, rngs=nnx.Rngs(0), entropy_weight=0.1, **options)


def _params(head, seed=0, scale=3.0):
    return scale * jax.random.normal(jax.random.key(seed), (BATCH, head.num_params))


@pytest.mark.parametrize(
    "space, head_class, num_params",
    [
        slow(gym.Box(-1.0, 1.0, (3,)), samplers.SquashedNormalSampler, 6, id="box"),
        pytest.param(
            gym.Box(_f32(-2.0, 0.0), _f32(0.5, 1e-3)),
            samplers.SquashedNormalSampler,
            4,
            id="asymmetric-box",
        ),
        slow(gym.Box(-np.inf, np.inf, (2,)), samplers.SquashedNormalSampler, 4, id="unbounded-box"),
        slow(gym.Discrete(5), samplers.CategoricalSampler, 5, id="discrete"),
        slow(gym.MultiDiscrete([3, 1, 4]), samplers.MultiDiscreteSampler, 8, id="md"),
        slow(gym.MultiBinary(6), samplers.MultiBinarySampler, 6, id="multi-binary"),
    ],
)
def test_each_gymnasium_space_gets_a_head_whose_actions_the_space_contains(
    space, head_class, num_params
):
    head = _head_for(space)
    assert type(head) is head_class
    assert head.num_params == num_params
    out = head((), _params(head))
    actions = np.asarray(out.output["action"])
    assert all(space.contains(a.astype(space.dtype)) for a in actions)
    assert np.all(np.isfinite(out.output["log_likelihood"]))
    again = head((), _params(head), out.rollout_extras)
    np.testing.assert_array_equal(again.output["log_likelihood"], out.output["log_likelihood"])


def test_gymnax_spaces_get_the_same_heads():
    box = _head_for(gymnax.Box(-2.0, 2.0, (1,)))
    assert box.num_params == 2
    actions = box((), _params(box)).output["action"]
    assert np.all(np.abs(actions) <= 2.0)
    discrete = _head_for(gymnax.Discrete(2))
    assert type(discrete) is samplers.CategoricalSampler and discrete.num_params == 2


def test_the_unit_box_is_tanh_and_other_bounds_are_bounded_tanh_with_the_spaces_bounds():
    assert type(_head_for(gym.Box(-1.0, 1.0, (2,))).bijector) is samplers.Tanh
    low, high = np.array([-2.0, 0.0, 5.0], np.float32), np.array([0.5, 1e-3, 5.5], np.float32)
    bijector = _head_for(gym.Box(low, high)).bijector
    assert type(bijector) is samplers.BoundedTanh
    np.testing.assert_array_equal(bijector.forward(jnp.full(3, -30.0)), low)
    np.testing.assert_array_equal(bijector.forward(jnp.full(3, 30.0)), high)


def test_a_bounded_box_scores_the_stored_pre_image_by_the_float64_change_of_variables():
    with jax.enable_x64():
        low, high = np.array([-2.0, 0.0]), np.array([0.5, 1e-3])
        head = _head_for(gym.Box(low, high, dtype=np.float64), min_std=0.0)
        params = _params(head).astype(jnp.float64)
        out = head((), params)
        x = np.asarray(out.rollout_extras)
        mean, raw = np.asarray(params[:, :2]), np.asarray(params[:, 2:])
        std = softplus_std_float64(raw, min_std=0.0)
        # log N(x) - log |d/dx (center + half * tanh x)|, with 1 - tanh^2 = 4 / (e^x + e^-x)^2.
        expected = tanh_normal_log_prob_float64(x, mean, std, low, high)
        np.testing.assert_allclose(out.output["log_likelihood"], expected, rtol=1e-12)
        # low + (high - low) * sigmoid(2x) is center + half * tanh(x) without the cancellation
        # next to a bound; the library's affine step rounds to a few ulps of the bounds.
        action = low + (high - low) * special.expit(2 * x)
        np.testing.assert_allclose(out.output["action"], action, rtol=1e-12, atol=4e-19)


def test_an_unbounded_box_is_an_unsquashed_normal_with_its_exact_entropy():
    with jax.enable_x64():
        head = _head_for(gym.Box(-np.inf, np.inf, (2,), dtype=np.float64), min_std=0.0)
        params = _params(head).astype(jnp.float64)
        out = head((), params)
        mean, std = np.asarray(params[:, :2]), np.logaddexp(0.0, np.asarray(params[:, 2:]))
        action = np.asarray(out.output["action"])
        np.testing.assert_array_equal(action, out.rollout_extras)
        expected = np.sum(stats.norm.logpdf(action, mean, std), axis=-1)
        np.testing.assert_allclose(out.output["log_likelihood"], expected, rtol=1e-12)
        entropy = np.sum(stats.norm.entropy(mean, std), axis=-1)
        np.testing.assert_allclose(out.regularization_loss, -0.1 * entropy, rtol=1e-12)


def test_options_reach_the_head_and_an_explicit_entropy_is_kept():
    head = _head_for(gym.Box(-np.inf, np.inf, (2,)), entropy="sample", per_env_streams=True)
    assert head.entropy == ("sample", 1) and head.per_env_streams
    assert _head_for(gym.Discrete(3), per_env_streams=True, rng_collection="policy").per_env_streams


@SLOW
def test_a_discrete_head_from_a_space_takes_per_environment_streams():
    head = _head_for(gym.Discrete(3), per_env_streams=True)
    assert head((head.initialize_state(4)), jnp.zeros((4, 3))).output["action"].shape == (4,)


@SLOW
def test_a_masked_discrete_head_from_a_space_scores_the_float64_masked_softmax():
    with jax.enable_x64():
        head = _head_for(gym.Discrete(4))
        logits = jnp.array([[0.3, -1.2, 2.0, 0.7], [80.0, -80.0, 0.0, 40.0]])
        mask = jnp.array([[True, False, True, True], [False, True, True, False]])
        out = head((), logits, jnp.array([3, 1]), mask=mask)
        expected = [0.7 - special.logsumexp([0.3, 2.0, 0.7]), -80.0 - special.logsumexp([-80, 0])]
        np.testing.assert_allclose(out.output["log_likelihood"], expected, rtol=1e-14)


@pytest.mark.parametrize(
    "space, message",
    [
        (gym.Box(_f32(-1.0, 0.0), _f32(1.0, np.inf)), r"dimensions \[0\] bounded, \[1\] half"),
        (gym.Box(-np.inf, 1.0, (1,)), r"dimensions \[0\] half-bounded; tanh cannot map"),
        (gym.Box(-1.0, 1.0, (2, 3)), r"one-dimensional Box, got shape \(2, 3\)"),
        (gym.Box(0, 10, (2,), dtype=np.int64), "floating Box, got dtype int64"),
        (gym.Discrete(4, start=1), r"starting at 0, got start=1"),
        (gym.MultiDiscrete([3, 2], start=[0, 1]), r"got start=\[0, 1\]"),
        (gym.MultiDiscrete([[3, 2], [2, 2]]), r"nvec of shape \(2, 2\)"),
        (gym.MultiBinary([2, 3]), r"got shape \(2, 3\); flatten it, e.g. MultiBinary\(6\)"),
    ],
    ids=["half-bounded", "one-sided", "2-d-box", "integer-box", "start", "md-start", "2-d", "mb"],
)
def test_spaces_the_heads_cannot_serve_as_given_are_refused_with_the_fix(space, message):
    with pytest.raises(ValueError, match=message):
        _head_for(space)


_BoxLike = collections.namedtuple("Box", "low high shape dtype")  # a duck-typed Box


@pytest.mark.parametrize(
    "low, high, message",
    [
        (
            [-1.0, -np.inf],
            [1.0, np.inf],
            r"got low=\[-1.0, -inf\], high=\[1.0, inf\]: dimensions \[0\] bounded, \[1\] "
            r"unbounded; one head squashes every dimension of a Box or none, so split it into a "
            r"Tuple of a bounded Box \(dimensions \[0\]\) and an unbounded one \(dimensions "
            r"\[1\]\), which head_for gives a head each\.$",
        ),
        (
            [-np.inf, -1.0, 0.0, -np.inf],
            [np.inf, 1.0, np.inf, np.inf],
            r"dimensions \[1\] bounded, \[0, 3\] unbounded, \[2\] half-bounded; tanh cannot "
            r"map onto a half-line, so give dimensions \[2\] finite bounds on both sides \(or "
            r"none\), or build a SquashedNormalSampler with a bijector of your own\.$",
        ),
        (
            [np.nan, -1.0],
            [1.0, 1.0],
            r"dimensions \[1\] bounded, \[0\] NaN; NaN bounds nothing, so give dimensions "
            r"\[0\] finite bounds on both sides",
        ),
    ],
    ids=["bounded-and-unbounded", "all-three", "nan"],
)
def test_a_box_mixing_kinds_of_dimensions_is_refused_naming_each_and_the_fix(low, high, message):
    low, high = _f32(*low), _f32(*high)
    # gymnasium refuses a NaN bound itself; a duck-typed Box (gymnax checks nothing) does not.
    space = (
        _BoxLike(low, high, low.shape, np.float32) if np.isnan(low).any() else gym.Box(low, high)
    )
    with pytest.raises(
        ValueError, match=r"^head_for needs each Box dimension bounded on both sides"
    ):
        _head_for(space)
    with pytest.raises(ValueError, match=message):
        _head_for(space)


def test_a_narrow_float64_box_scores_its_beta_head_on_its_float64_bounds():
    # A float32 network output on a float64 box: the Beta head computes in float64, as
    # the squashed Normal's BoundedTanh does; its bounds rounded to float32 would be one
    # point, and the log-likelihood +inf.
    with jax.enable_x64():
        box = gym.Box(low=np.array([1.0, -1.0]), high=np.array([1.0 + 1e-9, 3.0]), dtype=np.float64)
        head = samplers.head_for(box, rngs=nnx.Rngs(0), entropy_weight=0.01, head="beta")
        params = jax.random.normal(jax.random.key(0), (8, 4), jnp.float32)
        out = head((), params)
        normal = samplers.head_for(box, rngs=nnx.Rngs(0), entropy_weight=0.01)
        normal_out = normal((), jax.random.normal(jax.random.key(0), (8, 4), jnp.float32))
    assert out.output["log_likelihood"].dtype == jnp.float64
    assert normal_out.output["log_likelihood"].dtype == jnp.float64
    # The float64 Beta density of the action of the stored pre-image z, written out here:
    # (a - 1) log u + (b - 1) log(1 - u) - log B(a, b) - log(high - low), u = sigmoid(z).
    # The concentrations are 1 + softplus(raw) of the float32 output, rounded to float32.
    z = np.asarray(out.rollout_extras, np.float64)
    a, b = (np.asarray(out.metrics[name], np.float64) for name in ("alpha", "beta"))
    raw = np.asarray(params, np.float64)
    np.testing.assert_allclose(a, 1.0 + np.logaddexp(0.0, raw[:, :2]), rtol=2e-7)
    np.testing.assert_allclose(b, 1.0 + np.logaddexp(0.0, raw[:, 2:]), rtol=2e-7)
    log_u, log_v = -np.logaddexp(0.0, -z), -np.logaddexp(0.0, z)
    width = box.high - box.low  # [1.0000000827e-9, 4]: 1 + 1e-9 is rounded in float64
    log_density = (a - 1) * log_u + (b - 1) * log_v - special.betaln(a, b) - np.log(width)
    expected = np.sum(log_density, axis=-1)
    assert np.all(np.isfinite(expected))
    np.testing.assert_allclose(out.output["log_likelihood"], expected, rtol=1e-12)


@pytest.mark.parametrize(
    "space",
    [gym.Text(4), gym.Sequence(gym.Discrete(2)), "Discrete(4)"],
    ids=["text", "sequence", "a-string"],
)
def test_other_spaces_are_refused_naming_what_was_received(space):
    with pytest.raises(
        TypeError, match=f"MultiBinary, Dict and Tuple spaces, got .*{type(space).__name__}"
    ):
        _head_for(space)


def test_a_squashed_head_knows_num_params_only_when_given_action_dim():
    assert samplers.SquashedNormalSampler(nnx.Rngs(0), 0.1, action_dim=3).num_params == 6
    assert samplers.StateIndependentSampler(nnx.Rngs(0), 3, 0.1).num_params == 3
    with pytest.raises(AttributeError, match="built without action_dim"):
        _ = samplers.SquashedNormalSampler(nnx.Rngs(0), 0.1).num_params
    head = samplers.SquashedNormalSampler(nnx.Rngs(0), 0.1, action_dim=3)
    with pytest.raises(ValueError, match=r"shape \[\*batch, 6\] \(2 \* action_dim\), got \(4, 4\)"):
        head((), jnp.zeros((4, 4)))


# A Dict and a Tuple space, nested, of every kind of part. A plain dict's keys are
# sorted by gymnasium; an OrderedDict keeps its order, which the head follows. The parts
# repeat the shapes of the tests above, so that eager calls reuse their compiled operations.
BOX = gym.Box(_f32(-2.0, 0.0), _f32(0.5, 1e-3))
DICT = gym.Dict(
    collections.OrderedDict(
        [("fire", gym.Discrete(4)), ("aim", BOX), ("buttons", gym.MultiBinary(3))]
    )
)
NESTED = gym.Tuple(
    (
        gym.Dict({"fire": gym.Discrete(4), "aim": BOX}),
        gym.MultiDiscrete([3, 1, 4]),
        gym.Tuple((gym.MultiBinary(3),)),
    )
)
# The Box parts' exact entropy costs a compilation of its own; the default tier checks the
# choice, calls with entropy="sample", and the slow tier calls the default.
SAMPLE = {"entropy": "sample"}


def _numpy_params(head, seed=0):
    """As ``_params``, drawn by numpy: an eager jax.random call compiles for each shape."""
    rng = np.random.default_rng(seed)
    return (3.0 * rng.normal(size=(BATCH, head.num_params))).astype(np.float32)


def _leaf_heads(head, path=()):
    """``(path, head)`` of every part of a composite, nested ones' parts included."""
    items = head.parts.items() if isinstance(head.parts, dict) else enumerate(head.parts)
    for name, part in items:
        if isinstance(part, CompositeSampler):
            yield from _leaf_heads(part, (*path, str(name)))
        else:
            yield "/".join((*path, str(name))), part


def _element(action, i):
    """Batch element ``i`` of a structured action, as numpy arrays."""
    return jax.tree.map(lambda a: np.asarray(a)[i], action)


@pytest.mark.parametrize(
    "space, num_params, leaves, options",
    [
        slow(DICT, 4 + 4 + 3, {"fire": 4, "aim": 4, "buttons": 3}, SAMPLE, id="dict"),
        pytest.param(
            NESTED,
            8 + 8 + 3,
            {"0/aim": 4, "0/fire": 4, "1": 8, "2/0": 3},
            SAMPLE,
            id="dict-in-tuple",
        ),
        slow(DICT, 11, {"fire": 4, "aim": 4, "buttons": 3}, {}, id="dict-exact-entropy"),
        slow(
            gym.Tuple((gym.Discrete(3), gym.Box(-np.inf, np.inf, (2,)), gym.Box(-1.0, 1.0, (1,)))),
            3 + 4 + 2,
            {"0": 3, "1": 4, "2": 2},
            {},
            id="tuple-exact-entropy",
        ),
    ],
)
def test_dict_and_tuple_spaces_get_composites_whose_actions_the_space_contains(
    space, num_params, leaves, options
):
    head = _head_for(space, **options)
    assert type(head) is CompositeSampler and head.num_params == num_params
    parts = dict(_leaf_heads(head))
    assert {path: part.num_params for path, part in parts.items()} == leaves
    # A Box part's entropy is exact: "exact" for bounds, "base" (the Normal's) without.
    for _, part in _leaf_heads(_head_for(space)):
        if type(part) is samplers.SquashedNormalSampler:
            bounded = type(part.bijector) is not distrax.Lambda
            assert part.entropy == (("exact", 0) if bounded else ("base", 0))
    # One program for the nested composite's call, shared by its replay.
    out = jitted_call(head, (), _numpy_params(head))
    action = out.output["action"]
    assert type(action) is dict if type(space).__name__ == "Dict" else type(action) is tuple
    assert all(space.contains(_element(action, i)) for i in range(BATCH))
    assert np.all(np.isfinite(out.output["log_likelihood"]))
    again = jitted_call(head, (), _numpy_params(head), out.rollout_extras)
    np.testing.assert_array_equal(again.output["log_likelihood"], out.output["log_likelihood"])
    if not options:  # the exact entropies, summed: finite, and the parts' sum
        costs = [
            np.asarray(part((), params).regularization_loss)
            for part, params in zip(
                parts.values(),
                np.split(_numpy_params(head), np.cumsum(list(leaves.values()))[:-1], -1),
                strict=True,
            )
        ]
        assert np.all(np.isfinite(out.regularization_loss))
        # Within float32 rounding of the terms summed (the sum may cancel).
        magnitude = sum(np.abs(cost) for cost in costs)
        np.testing.assert_array_less(
            np.abs(out.regularization_loss - sum(costs)), 1e-6 * magnitude + 1e-30
        )


def test_a_dict_space_s_parts_are_sliced_in_its_own_order():
    params = np.zeros((BATCH, 11), np.float32)
    params[:, 2] = 50.0  # "fire" comes first in DICT: action 2
    head = _head_for(DICT, **SAMPLE)
    action = head((), params).output["action"]
    assert list(action) == ["fire", "aim", "buttons"]
    np.testing.assert_array_equal(action["fire"], 2)
    # gymnasium sorts a plain dict's keys: "aim" first, so the params slice differently.
    sorted_space = gym.Dict(dict(DICT.spaces))
    assert list(sorted_space.spaces) == ["aim", "buttons", "fire"]
    assert list(_head_for(sorted_space, **SAMPLE)((), params).output["action"]) == [
        "aim",
        "buttons",
        "fire",
    ]


def test_a_part_s_actions_do_not_change_when_another_part_is_added_to_the_space():
    head = _head_for(DICT, **SAMPLE)
    bigger = gym.Dict(collections.OrderedDict([*DICT.spaces.items(), ("extra", gym.Discrete(4))]))
    other = _head_for(bigger, **SAMPLE)
    params = _numpy_params(head)
    out = head((), params)
    more = other((), jnp.concatenate([params, _numpy_params(head, seed=1)[:, :4]], -1))
    for name in DICT.spaces:
        np.testing.assert_array_equal(more.output["action"][name], out.output["action"][name])


@pytest.mark.slow
def test_options_reach_the_parts_that_take_them_and_an_explicit_entropy_is_kept():
    space = gym.Dict(
        {"a": gym.Discrete(3), "b": gym.Box(-1.0, 1.0, (2,)), "c": gym.Box(-np.inf, np.inf, (1,))}
    )
    head = _head_for(space, per_env_streams=True, min_std=0.1)
    parts = head.parts
    assert head.per_env_streams and all(part.per_env_streams for part in parts.values())
    assert parts["b"].min_std == parts["c"].min_std == 0.1
    assert parts["b"].entropy == ("exact", 0) and parts["c"].entropy == ("base", 0)
    sampled = _head_for(space, entropy="sample")
    assert sampled.parts["b"].entropy == sampled.parts["c"].entropy == ("sample", 1)
    state = head.initialize_state(4)
    assert state.shape == (4,)  # one key per environment, as for any head
    # rng_collection names the stream of every part and of the composite.
    rngs = nnx.Rngs(params=0, policy=1)
    named = samplers.head_for(space, rngs=rngs, entropy_weight=0.1, rng_collection="policy")
    assert named.rng_collection == "policy"
    assert all(part.rng_collection == "policy" for part in named.parts.values())
    named((), jnp.zeros((2, named.num_params)))
    assert int(rngs.policy.count[...]) == 2 and int(rngs.params.count[...]) == 0


def test_gymnax_dict_and_tuple_spaces_get_composites_too():
    space = gymnax.Tuple(
        [
            gymnax.Dict({"a": gymnax.Discrete(4), "b": gymnax.Box(-2.0, 2.0, (2,))}),
            gymnax.Discrete(4),
        ]
    )
    head = _head_for(space, **SAMPLE)
    assert type(head) is CompositeSampler and head.num_params == 4 + 4 + 4
    action = head((), _numpy_params(head)).output["action"]
    assert type(action) is tuple and set(action[0]) == {"a", "b"}
    # gymnax's Dict.contains reads attributes, not keys: each part's space is checked.
    parts = space.spaces[0].spaces
    for i in range(0, BATCH, 32):
        (inner, last) = _element(action, i)
        assert parts["a"].contains(inner["a"]) and parts["b"].contains(inner["b"])
        assert space.spaces[1].contains(last)


@pytest.mark.parametrize(
    "space, options, error, message",
    [
        (DICT, {"bijector": samplers.Tanh()}, TypeError, "no bijector for a Dict space"),
        (
            gym.Tuple((gym.Discrete(2), gym.MultiBinary(2))),
            {"min_std": 0.1},
            TypeError,
            r"got \['min_std'\], options of the Box heads, for a Tuple space without a Box "
            r"part \(its parts: \{'0': 'Discrete', '1': 'MultiBinary'\}\)",
        ),
        (
            DICT,
            {"mni_std": 0.1},
            TypeError,
            r"part 'aim' of the action space: SquashedNormalSampler.__init__\(\) got an "
            r"unexpected keyword argument 'mni_std'",
        ),
        (
            gym.Dict({"a": gym.Tuple((gym.Text(4),))}),
            {},
            TypeError,
            r"part 'a/0' of the action space: head_for builds heads for .* got .*Text",
        ),
        (
            gym.Tuple((gym.Discrete(2), gym.Box(-np.inf, 1.0, (1,)))),
            {},
            ValueError,
            r"part '1' of the action space: head_for needs each Box dimension bounded",
        ),
        (gym.Dict({}), {}, ValueError, "at least one part in a Dict space"),
        (
            gymnax.Dict({1: gymnax.Discrete(2)}),
            {},
            TypeError,
            "needs str keys in a Dict space, got 1",
        ),
    ],
    ids=["bijector", "no-box", "unknown-option", "nested-text", "half-bounded", "empty", "int"],
)
def test_what_a_composite_space_cannot_take_is_refused_naming_the_part(
    space, options, error, message
):
    with pytest.raises(error, match=message):
        _head_for(space, **options)


def test_head_beta_builds_a_beta_head_on_the_boxs_bounds_and_refuses_an_unbounded_box():
    box = gym.Box(low=np.array([-2.0, 0.0], np.float32), high=np.array([2.0, 1.0], np.float32))
    head = samplers.head_for(box, rngs=nnx.Rngs(0), entropy_weight=0.01, head="beta")
    assert isinstance(head, samplers.BetaSampler) and head.num_params == 4
    action = np.asarray(head((), jnp.zeros((64, 4))).output["action"])
    assert all(box.contains(a) for a in action)
    both = gym.Dict({"fire": gym.Discrete(2), "aim": box})
    composite = samplers.head_for(both, rngs=nnx.Rngs(0), entropy_weight=0.01, head="beta")
    assert isinstance(composite.parts["aim"], samplers.BetaSampler)
    with pytest.raises(ValueError, match="head='beta' needs a Box with finite bounds"):
        samplers.head_for(
            gym.Box(-np.inf, np.inf, (1,)), rngs=nnx.Rngs(0), entropy_weight=0.0, head="beta"
        )
    with pytest.raises(ValueError, match=r"head='squashed_normal'.*got head='gamma'"):
        samplers.head_for(box, rngs=nnx.Rngs(0), entropy_weight=0.0, head="gamma")
