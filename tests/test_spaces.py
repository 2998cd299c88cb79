"""``head_for`` on gymnasium and gymnax spaces: the head, its ``num_params``, actions the
space contains, log-likelihoods against float64 formulas, and refusals."""

import gymnasium.spaces as gym
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from gymnax.environments import spaces as gymnax
from scipy import special, stats

import samplers
from tests._tiers import SLOW, slow

BATCH = 256


def _f32(*values):
    return np.array(values, np.float32)


def _head(space, **options):
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
        pytest.param(gym.MultiDiscrete([3, 1, 4]), samplers.MultiDiscreteSampler, 8, id="md"),
        slow(gym.MultiBinary(6), samplers.MultiBinarySampler, 6, id="multi-binary"),
    ],
)
def test_each_gymnasium_space_gets_a_head_whose_actions_the_space_contains(
    space, head_class, num_params
):
    head = _head(space)
    assert type(head) is head_class
    assert head.num_params == num_params
    out = head((), _params(head))
    actions = np.asarray(out.output["action"])
    assert all(space.contains(a.astype(space.dtype)) for a in actions)
    assert np.all(np.isfinite(out.output["log_likelihood"]))
    again = head((), _params(head), out.rollout_extras)
    np.testing.assert_array_equal(again.output["log_likelihood"], out.output["log_likelihood"])


def test_gymnax_spaces_get_the_same_heads():
    box = _head(gymnax.Box(-2.0, 2.0, (1,)))
    assert box.num_params == 2
    actions = box((), _params(box)).output["action"]
    assert np.all(np.abs(actions) <= 2.0)
    discrete = _head(gymnax.Discrete(2))
    assert type(discrete) is samplers.CategoricalSampler and discrete.num_params == 2


def test_the_unit_box_is_tanh_and_other_bounds_are_bounded_tanh_with_the_spaces_bounds():
    assert type(_head(gym.Box(-1.0, 1.0, (2,))).bijector) is samplers.Tanh
    low, high = np.array([-2.0, 0.0, 5.0], np.float32), np.array([0.5, 1e-3, 5.5], np.float32)
    bijector = _head(gym.Box(low, high)).bijector
    assert type(bijector) is samplers.BoundedTanh
    np.testing.assert_array_equal(bijector.forward(jnp.full(3, -30.0)), low)
    np.testing.assert_array_equal(bijector.forward(jnp.full(3, 30.0)), high)


def test_a_bounded_box_scores_the_stored_pre_image_by_the_float64_change_of_variables():
    with jax.enable_x64():
        low, high = np.array([-2.0, 0.0]), np.array([0.5, 1e-3])
        head = _head(gym.Box(low, high, dtype=np.float64), min_std=0.0)
        params = _params(head).astype(jnp.float64)
        out = head((), params)
        x = np.asarray(out.rollout_extras)
        mean, raw = np.asarray(params[:, :2]), np.asarray(params[:, 2:])
        std = np.logaddexp(0.0, raw)
        half = (high - low) / 2
        # log N(x) - log |d/dx (center + half * tanh x)|, with 1 - tanh^2 = 4 / (e^x + e^-x)^2.
        log_det = np.log(half) + np.log(4.0) - 2 * np.logaddexp(x, -x)
        expected = np.sum(stats.norm.logpdf(x, mean, std) - log_det, axis=-1)
        np.testing.assert_allclose(out.output["log_likelihood"], expected, rtol=1e-12)
        # low + (high - low) * sigmoid(2x) is center + half * tanh(x) without the cancellation
        # next to a bound; the library's affine step rounds to a few ulps of the bounds.
        action = low + (high - low) * special.expit(2 * x)
        np.testing.assert_allclose(out.output["action"], action, rtol=1e-12, atol=4e-19)


def test_an_unbounded_box_is_an_unsquashed_normal_with_its_exact_entropy():
    with jax.enable_x64():
        head = _head(gym.Box(-np.inf, np.inf, (2,), dtype=np.float64), min_std=0.0)
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
    head = _head(gym.Box(-np.inf, np.inf, (2,)), entropy="sample", per_env_streams=True)
    assert head.entropy == ("sample", 1) and head.per_env_streams
    assert _head(gym.Discrete(3), per_env_streams=True, rng_collection="policy").per_env_streams


@SLOW
def test_a_discrete_head_from_a_space_takes_per_environment_streams():
    head = _head(gym.Discrete(3), per_env_streams=True)
    assert head((head.initialize_state(4)), jnp.zeros((4, 3))).output["action"].shape == (4,)


@SLOW
def test_a_masked_discrete_head_from_a_space_scores_the_float64_masked_softmax():
    with jax.enable_x64():
        head = _head(gym.Discrete(4))
        logits = jnp.array([[0.3, -1.2, 2.0, 0.7], [80.0, -80.0, 0.0, 40.0]])
        mask = jnp.array([[True, False, True, True], [False, True, True, False]])
        out = head((), logits, jnp.array([3, 1]), mask=mask)
        expected = [0.7 - special.logsumexp([0.3, 2.0, 0.7]), -80.0 - special.logsumexp([-80, 0])]
        np.testing.assert_allclose(out.output["log_likelihood"], expected, rtol=1e-14)


@pytest.mark.parametrize(
    "space, message",
    [
        (gym.Box(_f32(-1.0, 0.0), _f32(1.0, np.inf)), r"dimensions \[1\] are half"),
        (gym.Box(-np.inf, 1.0, (1,)), r"dimensions \[0\] are half-bounded"),
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
        _head(space)


@pytest.mark.parametrize(
    "space",
    [
        gym.Dict({"a": gym.Discrete(2)}),
        gym.Tuple((gym.Discrete(2),)),
        gym.Text(4),
        gymnax.Dict({"a": gymnax.Discrete(2)}),
        "Discrete(4)",
    ],
    ids=["gymnasium-dict", "gymnasium-tuple", "text", "gymnax-dict", "a-string"],
)
def test_other_spaces_are_refused_naming_what_was_received(space):
    with pytest.raises(TypeError, match=f"got .*{type(space).__name__}"):
        _head(space)


def test_a_squashed_head_knows_num_params_only_when_given_action_dim():
    assert samplers.SquashedNormalSampler(nnx.Rngs(0), 0.1, action_dim=3).num_params == 6
    assert samplers.StateIndependentSampler(nnx.Rngs(0), 3, 0.1).num_params == 3
    with pytest.raises(AttributeError, match="built without action_dim"):
        _ = samplers.SquashedNormalSampler(nnx.Rngs(0), 0.1).num_params
    head = samplers.SquashedNormalSampler(nnx.Rngs(0), 0.1, action_dim=3)
    with pytest.raises(ValueError, match=r"shape \[\*batch, 6\] \(2 \* action_dim\), got \(4, 4\)"):
        head((), jnp.zeros((4, 4)))
