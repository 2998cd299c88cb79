"""``FlowSampler``: a new head is the squashed-Normal head; a replay reproduces the
rollout once the layers have learned (saturated actions included); gradients reach the
conditioners, the features and the base, and a fresh action without
``reparameterized`` has none; ``eval()``; the pathwise gradient; per-environment
streams; non-finite inputs; the refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import errors, nnx

import samplers
from tests._tiers import slow

A, F = 2, 3


def _small_flow_head(**options):
    """A flow head with small conditioners (one hidden layer of 16): the tests check
    what a flow does, not what a wide MLP does."""
    options = {"hidden_sizes": (16,), **options}
    return samplers.FlowSampler(
        nnx.Rngs(params=0, action=1), 0.01, action_dim=A, feature_dim=F, **options
    )


def _learned(head, seed=0, size=0.3):
    """``head`` with every conditioner weight moved off its initial value, as training does."""
    params = nnx.state(head, nnx.Param)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    moved = [
        leaf + size * jax.random.normal(k, leaf.shape) for leaf, k in zip(leaves, keys, strict=True)
    ]
    nnx.update(head, jax.tree.unflatten(tree, moved))
    return head


def _params_and_features(batch=8, seed=0, saturated=False):
    x = jax.random.normal(jax.random.key(seed), (batch, 2 * A + F))
    return x.at[:, :A].add(30.0) if saturated else x


@nnx.jit
def _step(head, *args):
    return head((), *args)


def test_a_new_head_is_the_squashed_normal_head():
    flow = _small_flow_head()
    normal = samplers.NormalTanhSampler(nnx.Rngs(params=0, action=1), 0.01)
    x = _params_and_features()
    ours, theirs = flow((), x), normal((), x[:, : 2 * A])
    np.testing.assert_array_equal(ours.rollout_extras, theirs.rollout_extras)
    np.testing.assert_allclose(ours.output["action"], theirs.output["action"], rtol=1e-6)
    np.testing.assert_allclose(
        ours.output["log_likelihood"], theirs.output["log_likelihood"], rtol=1e-6, atol=1e-6
    )
    np.testing.assert_allclose(ours.regularization_loss, theirs.regularization_loss, rtol=1e-5)


@pytest.mark.parametrize(
    "transform, saturated",
    [
        pytest.param("affine", True, id="affine-saturated"),
        slow("spline", False, id="spline"),
        slow(("spline", 4), True, id="spline4-saturated"),
    ],
)
def test_a_replay_is_bit_for_bit_once_the_layers_have_learned(transform, saturated):
    head = _learned(_small_flow_head(transform=transform))
    x = _params_and_features(saturated=saturated)
    out = _step(head, x)
    if saturated:
        assert np.all(np.abs(np.asarray(out.output["action"])) == 1.0)
    assert np.all(np.isfinite(out.output["log_likelihood"]))
    stored = np.array(out.rollout_extras)
    again = _step(head, x, stored)
    # Another XLA program: its matrix products may round differently.
    np.testing.assert_allclose(
        again.output["log_likelihood"], out.output["log_likelihood"], rtol=1e-6, atol=1e-6
    )
    np.testing.assert_array_equal(again.output["action"], out.output["action"])
    eager = head((), x, stored)  # scored alike by the distribution's own replay
    np.testing.assert_array_equal(
        eager.output["log_likelihood"], head.distribution(x).replay(stored)[1]
    )
    # The layers have moved the sample: the flow is not the squashed Normal any more
    # (a spline is the identity outside [-5, 5], where saturated pre-images lie).
    normal = samplers.normal_tanh(x[:, : 2 * A]).log_prob_from_pre_image(stored)
    if transform == "affine" or not saturated:
        assert np.max(np.abs(normal - out.output["log_likelihood"])) > 1e-2
    else:  # outside [-5, 5] the spline is the identity: the squashed Normal's score
        np.testing.assert_allclose(out.output["log_likelihood"], normal, rtol=1e-6)


@pytest.mark.slow
def test_gradients_reach_the_conditioners_the_features_and_the_base():
    head = _learned(_small_flow_head(), size=0.1)
    x = _params_and_features(seed=1)
    stored = head((), x).rollout_extras

    def loss(head, x):
        return jnp.mean(head((), x, stored).output["log_likelihood"])

    grads = nnx.grad(loss)(head, x)
    for path, grad in jax.tree.leaves_with_path(nnx.to_pure_dict(grads)):
        assert np.any(np.asarray(grad) != 0), path
    by_input = nnx.grad(loss, argnums=1)(head, x)
    # Against central differences, in float32; a small step, for the ReLU kinks.
    step = 1e-3
    for column in range(2 * A + F):
        up, down = x.at[:, column].add(step), x.at[:, column].add(-step)
        numeric = (loss(head, up) - loss(head, down)) / (2 * step)
        np.testing.assert_allclose(by_input[:, column].sum(), numeric, rtol=1e-2, atol=2e-3)
    assert np.all(np.abs(np.asarray(by_input[:, 2 * A :]).sum(0)) > 0)


@pytest.mark.slow
def test_eval_acts_with_the_flow_of_the_mean_and_draws_no_key():
    head = _learned(_small_flow_head(entropy="base"))
    head.eval()
    x = _params_and_features(seed=2)
    before = int(head.rng.action.count[...])
    out = head((), x)
    assert int(head.rng.action.count[...]) == before
    dist = head.distribution(x)
    np.testing.assert_array_equal(out.rollout_extras, dist.deterministic_replay_data())
    np.testing.assert_array_equal(out.output["action"], dist.deterministic_action())


def test_the_pathwise_gradient_matches_a_central_difference():
    head = _learned(_small_flow_head(reparameterized=True), seed=3)
    x = _params_and_features(seed=4)

    def q(head, x):
        action = head((), x).output["action"]
        return -jnp.sum(jnp.square(action - 0.3))

    # A clone at every call: the same key, the head's stream as it was.
    grad = nnx.jit(nnx.grad(q, argnums=1))(nnx.clone(head), x)
    assert np.any(np.asarray(grad[:, :A]) != 0)
    step, jitted = 1e-2, nnx.jit(q)
    for column in (0, A, 2 * A):  # a mean, a raw std, a feature
        up, down = x.at[:, column].add(step), x.at[:, column].add(-step)
        numeric = (jitted(nnx.clone(head), up) - jitted(nnx.clone(head), down)) / (2 * step)
        np.testing.assert_allclose(grad[:, column].sum(), numeric, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("transform", ["affine", slow("spline", id="spline")])
def test_a_reparameterized_sample_is_scored_forward_with_the_inverse_path_s_gradients(
    transform,
):
    """A SAC actor's fresh sample is ``dist.sample_with_pre_image``'s, scored forward
    with no inverse: the same arrays from the head's key, the replay's value to float32
    rounding, and in float64 the value and the gradients of ``alpha log pi(a) - Q(a)``
    with respect to the inputs and every conditioner weight of the inverse path's
    (``sample_with_replay``), saturated rows and rows of the smallest std included."""
    head = _learned(_small_flow_head(reparameterized=True, transform=transform), seed=7)
    tiny_std = _params_and_features(4, seed=12).at[:, A : 2 * A].set(-30.0)  # std at the floor
    x = jnp.concatenate(
        [
            _params_and_features(4, seed=10),
            _params_and_features(4, seed=11, saturated=True),
            tiny_std,
        ]
    )
    fresh = nnx.clone(head)  # the head before the call, its stream as it was
    key = nnx.clone(head).rng.action()  # the key the call draws first
    out = head((), x)
    action, pre_image, log_prob = head.distribution(x).sample_with_pre_image(seed=key)
    np.testing.assert_array_equal(out.output["log_likelihood"], log_prob)
    np.testing.assert_array_equal(out.output["action"], action)
    np.testing.assert_array_equal(out.rollout_extras, pre_image)
    assert np.any(np.abs(np.asarray(action[4:8])) == 1.0)  # actions on a bound
    dist = head.distribution(x)
    replayed = np.asarray(dist.replay(pre_image)[1], np.float64)
    np.testing.assert_allclose(replayed[:8], log_prob[:8], rtol=1e-5, atol=1e-5)
    # At the smallest std the density is steep in x_K, and the inverse's rounding moves
    # the score by more: within the pre-image rounding bound of the spline replay.
    bound = 1e-6 * (1 + np.abs(replayed)) + 32 * _pre_image_sensitivity(dist, pre_image)
    assert np.all(np.abs(replayed - np.asarray(log_prob, np.float64)) <= bound)

    def actor_loss(sample):
        def loss(head, x):
            action, log_prob = sample(head, x)
            return jnp.sum(0.2 * log_prob - jnp.sum(jnp.square(action - 0.3), -1))

        return loss

    def by_the_head(head, x):
        out = head((), x)
        return out.output["action"], out.output["log_likelihood"]

    def through_the_inverse(head, x):
        action, _, log_prob = head.distribution(x).sample_with_replay(seed=key)
        return action, log_prob

    with jax.enable_x64(True):
        x64 = jnp.asarray(x, jnp.float64)
        weights = nnx.state(fresh, nnx.Param)
        nnx.update(fresh, jax.tree.map(lambda w: jnp.asarray(w, jnp.float64), weights))
        # Each loss and its gradients compiled as one program, as a training step is.
        value, got = nnx.jit(nnx.value_and_grad(actor_loss(by_the_head), argnums=(0, 1)))(
            nnx.clone(fresh), x64
        )
        expected, want = nnx.jit(
            nnx.value_and_grad(actor_loss(through_the_inverse), argnums=(0, 1))
        )(fresh, x64)
    np.testing.assert_allclose(value, expected, rtol=1e-8)
    assert np.max(np.abs(np.asarray(want[1]))) > 1e-2
    np.testing.assert_allclose(got[1], want[1], rtol=1e-8, atol=1e-10)
    weights = jax.tree.leaves_with_path(nnx.to_pure_dict(got[0]))
    for (path, g), w in zip(weights, jax.tree.leaves(nnx.to_pure_dict(want[0])), strict=True):
        assert np.max(np.abs(np.asarray(w))) > 1e-4, path
        np.testing.assert_allclose(g, w, rtol=1e-8, atol=1e-10, err_msg=str(path))


@pytest.mark.slow
def test_a_reparameterized_flow_part_of_a_composite_is_scored_forward():
    """In a ``CompositeSampler`` the flow part samples as the head alone does: with
    ``reparameterized=True`` its log-likelihood is ``sample_with_pre_image``'s from the
    part's key, the other part's and the sum as before."""
    rngs = nnx.Rngs(params=0, action=1)
    flow = _learned(_small_flow_head(reparameterized=True), seed=8)
    composite = samplers.CompositeSampler(
        {"choice": samplers.CategoricalSampler(rngs, 0.0, 3), "flow": flow}, rngs=rngs
    )
    x = jax.random.normal(jax.random.key(12), (8, composite.num_params))
    key = nnx.clone(composite).rng.action()  # the key the call draws first
    out = composite((), x)
    dist = composite.distribution(x)
    part_key = samplers.distributions._keys.part_key
    _, pre_image, log_prob = dist.parts["flow"].sample_with_pre_image(seed=part_key(key, ("flow",)))
    np.testing.assert_array_equal(out.rollout_extras["flow"], pre_image)
    np.testing.assert_array_equal(out.output["log_likelihoods"]["flow"], log_prob)
    choice = out.rollout_extras["choice"]
    np.testing.assert_array_equal(
        out.output["log_likelihoods"]["choice"], dist.parts["choice"].log_prob(choice)
    )
    np.testing.assert_array_equal(
        out.output["log_likelihood"], out.output["log_likelihoods"]["choice"] + log_prob
    )


@pytest.mark.slow
@pytest.mark.parametrize("reparameterized", [False, True])
def test_per_environment_streams_draw_each_row_from_its_own_key(reparameterized):
    head = _learned(_small_flow_head(per_env_streams=True, reparameterized=reparameterized))
    keys = head.initialize_state(6)
    x = _params_and_features(6, seed=5)
    whole = head(keys, x)
    half = head(keys[3:], x[3:])
    # The same draws; the conditioners' matrix products round by batch size.
    np.testing.assert_allclose(whole.output["action"][3:], half.output["action"], rtol=1e-6)
    np.testing.assert_allclose(whole.rollout_extras[3:], half.rollout_extras, rtol=1e-6)


@pytest.mark.slow
def test_a_fresh_action_without_reparameterized_is_a_constant():
    """PPO's rollout: no gradient reaches the conditioners or the inputs through the
    action, only through the log-likelihood of it."""
    head = _learned(_small_flow_head())
    x = _params_and_features(seed=6)

    def action_sum(head, x):
        return jnp.sum(nnx.clone(head)((), x).output["action"])

    by_params, by_input = nnx.grad(action_sum, argnums=(0, 1))(head, x)
    assert all(np.all(np.asarray(g) == 0) for g in jax.tree.leaves(nnx.to_pure_dict(by_params)))
    assert np.all(np.asarray(by_input) == 0)


@pytest.mark.parametrize(
    "transform, num_layers",
    [("spline", 2), ("affine", 1), ("affine", 2), slow("spline", 1, id="spline-1")],
)
def test_a_non_finite_feature_or_conditioner_output_gives_nan(transform, num_layers):
    # One layer passes half of the dimensions through untouched: they are NaN too.
    x = _params_and_features(4, seed=7).at[:, :A].add(8.0)  # pre-images outside the spline's range
    for reparameterized, deterministic in [(False, False), (False, True), (True, False)]:
        head = _small_flow_head(
            transform=transform, num_layers=num_layers, reparameterized=reparameterized
        )
        if deterministic:
            head.eval()
        out = _step(head, x.at[1:, -1].set(jnp.array([jnp.nan, jnp.inf, -jnp.inf])))
        for name in ("log_likelihood", "action"):
            assert np.all(np.isnan(out.output[name][1:]))
            assert np.all(np.isfinite(out.output[name][0]))
        assert np.all(np.isnan(out.rollout_extras[1:]))
    head = _small_flow_head(transform=transform, num_layers=num_layers)
    # A conditioner whose weights went NaN: a spline would pass such a value unchanged.
    broken = nnx.clone(head)
    bias = broken.conditioners[0].out.bias
    bias[...] = jnp.full_like(bias[...], jnp.nan)
    out = _step(broken, x)
    assert np.all(np.isnan(out.output["log_likelihood"]))
    # Conditioners of positive weights take an infinite feature to infinite parameters,
    # which would move the action onto a bound: the feature is NaN to them.
    positive = nnx.clone(head)
    nnx.update(positive, jax.tree.map(lambda p: jnp.abs(p) + 0.1, nnx.state(positive, nnx.Param)))
    out = _step(positive, x.at[1, -1].set(jnp.inf))
    assert np.all(np.isnan(out.output["action"][1])) and np.all(np.isnan(out.rollout_extras[1]))


def test_options_and_inputs_are_refused_with_the_fix():
    with pytest.raises(TypeError, match=r"needs an nnx\.Rngs"):
        samplers.FlowSampler(nnx.Rngs(0).default, 0.01, action_dim=A)
    with pytest.raises(ValueError, match="needs action_dim="):
        samplers.FlowSampler(nnx.Rngs(0), 0.01)
    with pytest.raises(ValueError, match="no closed-form or quadrature entropy"):
        samplers.FlowSampler(nnx.Rngs(0), 0.01, action_dim=A, entropy="exact")
    with pytest.raises(ValueError, match="transform must be"):
        samplers.FlowSampler(nnx.Rngs(0), 0.01, action_dim=A, transform="rqs")
    with pytest.raises(ValueError, match="feature_dim must be an integer >= 0"):
        samplers.FlowSampler(nnx.Rngs(0), 0.01, action_dim=A, feature_dim=-1)
    with pytest.raises(ValueError, match="num_layers must be a positive integer"):
        samplers.FlowSampler(nnx.Rngs(0), 0.01, action_dim=A, num_layers=0)
    head = _small_flow_head()
    with pytest.raises(ValueError, match=r"2 \* action_dim \+ feature_dim"):
        head((), jnp.zeros((4, 2 * A)))


def _pre_image_sensitivity(dist, pre_image):
    """``eps * sum_i (1 + |x_K,i|) |d log p / d x_K,i|``: how far a float32 rounding of the
    stored pre-image moves its log-likelihood."""
    score = jax.grad(lambda x: dist.log_prob_from_pre_image(x).sum())(jnp.asarray(pre_image))
    eps = np.finfo(np.float32).eps
    return eps * np.sum((1 + np.abs(pre_image)) * np.abs(np.asarray(score)), axis=-1)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_a_spline_replay_in_another_program_is_within_the_pre_image_rounding_bound(seed):
    """An eager rollout replayed under nnx.jit, and a jitted rollout of 64 replayed as a
    minibatch of 32, with every conditioner weight moved off its initial value:
    ``|replay - rollout| <= 1e-6 (1 + |log p|) + 32 eps sum_i (1 + |x_K,i|) |d log p/d x_K,i|``."""
    head = _learned(_small_flow_head(transform="spline"), seed=seed)
    x = jax.random.normal(jax.random.key(100 + seed), (64, 2 * A + F))
    dist = head.distribution(x)
    eager = head((), x)
    jitted = _step(head, x)
    stored_eager, stored_jitted = np.array(eager.rollout_extras), np.array(jitted.rollout_extras)
    cases = [
        (_step(head, x, stored_eager), eager, stored_eager, 64),
        (_step(head, x[:32], stored_jitted[:32]), jitted, stored_jitted, 32),
    ]
    for again, out, stored, rows in cases:
        rollout = np.asarray(out.output["log_likelihood"], np.float64)[:rows]
        replayed = np.asarray(again.output["log_likelihood"], np.float64)
        bound = 1e-6 * (1 + np.abs(rollout)) + 32 * _pre_image_sensitivity(dist, stored)[:rows]
        assert np.all(np.abs(replayed - rollout) <= bound), rows
        np.testing.assert_array_equal(
            again.output["action"], np.asarray(out.output["action"])[:rows]
        )


@pytest.mark.slow
def test_plain_jax_grad_of_a_replay_that_needs_a_key_names_the_key_free_option():
    head = _small_flow_head()
    x = _params_and_features()
    stored = _step(head, x).rollout_extras

    def loss(head, x):
        return jnp.sum(head((), x, stored).output["log_likelihood"])

    with pytest.raises(errors.TraceContextError, match="entropy='base'"):
        jax.grad(lambda x: loss(head, x))(x)
    # With entropy="base" the replay draws no key, and jax.grad is nnx.grad's.
    keyless = _small_flow_head(entropy="base")
    by_jax = jax.grad(lambda x: loss(keyless, x))(x)
    np.testing.assert_array_equal(by_jax, nnx.grad(loss, argnums=1)(keyless, x))
    assert np.any(np.asarray(by_jax) != 0)


def test_the_spline_range_is_where_the_splines_act():
    head = _learned(_small_flow_head(transform="spline", spline_range=2.0), seed=4)
    x = _params_and_features(seed=8)

    @nnx.jit
    def layers(head, pre_image):
        return head.distribution(x)._forward_layers(pre_image)[0]

    inside, outside = jnp.full((8, A), 1.5), jnp.full((8, A), 2.5)
    assert np.max(np.abs(np.asarray(layers(head, inside)) - 1.5)) > 1e-2
    np.testing.assert_array_equal(layers(head, outside), outside)
    with pytest.raises(ValueError, match="spline_range"):
        _small_flow_head(transform="spline", spline_range=0.0)


@pytest.mark.slow
def test_the_kl_of_old_and_new_distributions_is_a_sample_estimate():
    """A PPO metric: ``old.kl_divergence(new)`` between two ``head.distribution``."""
    head = _learned(_small_flow_head(), seed=5)
    x = _params_and_features(seed=9)
    moved = _learned(nnx.clone(head), seed=6, size=0.05)

    @nnx.jit
    def kl(old, new):
        return old.distribution(x).kl_divergence(new.distribution(x), seed=0, num_samples=64)

    assert np.all(np.asarray(kl(head, moved)) > 0)
    np.testing.assert_array_equal(kl(head, head), 0.0)
    with pytest.raises(NotImplementedError, match="seed=key"):
        head.distribution(x).kl_divergence(moved.distribution(x))
