"""``BetaSampler``: its outputs against the distribution, replay bit for bit (also on a
bound), ``eval()`` acting with the mean, the stream advancing alike in rollout and
replay, the pathwise gradient with ``reparameterized``, ``nnx.jit`` without retracing,
per-environment streams, and the refusals."""

import functools

import jax
import jax.numpy as jnp
import mpmath
import numpy as np
import pytest
from beartype import beartype
from flax import nnx
from jaxtyping import jaxtyped
from scipy import special

from samplers.distributions.beta import SquashedBeta
from samplers.distributions.constructors import squashed_beta
from samplers.heads.beta import BetaSampler
from tests._tiers import each_value_once, slow
from tests.helpers import (
    TRACES,
    clones_of,
    jitted_call,
    keys_drawn,
    normal_inputs,
    stateless_call,
)

A = 3
LOW = np.array([-2.0, 0.0, 1.0], np.float32)
HIGH = np.array([2.0, 1.0, 1000.0], np.float32)
OPTIONS = {"entropy_weight": 0.01, "low": LOW, "high": HIGH}
_inputs = functools.partial(normal_inputs, width=2 * A, scale=2.0)
# New heads as ``BetaSampler(nnx.Rngs(0), **OPTIONS)`` builds them, sharing its programs.
_beta_head = clones_of(lambda: BetaSampler(nnx.Rngs(0), **OPTIONS))


@pytest.mark.parametrize(
    "batch_shape", [slow((), id="(A,)"), pytest.param((4,), id="(B,A)"), slow((3, 4), id="(T,B,A)")]
)
def test_outputs_are_the_distributions(batch_shape):
    head = _beta_head()
    params = _inputs(batch_shape)
    out = jitted_call(head, (), params)
    dist = squashed_beta(params, LOW, HIGH)
    pre_image = out.rollout_extras
    assert pre_image.shape == out.output["action"].shape == (*batch_shape, A)
    np.testing.assert_array_equal(out.output["action"], dist.forward_and_log_prob(pre_image)[0])
    np.testing.assert_array_equal(
        out.output["log_likelihood"], dist.log_prob_from_pre_image(pre_image)
    )
    np.testing.assert_allclose(out.regularization_loss, -0.01 * dist.entropy(), rtol=1e-6)
    np.testing.assert_array_equal(out.metrics["alpha"], dist.concentration1)
    np.testing.assert_array_equal(out.metrics["beta"], dist.concentration0)
    action = np.asarray(out.output["action"])
    distances = np.minimum(action - LOW, HIGH - action)
    np.testing.assert_allclose(out.metrics["bound_distance"], distances.min(-1), rtol=1e-6)
    np.testing.assert_array_equal(out.metrics["saturation"], (distances <= 0).mean(-1))


# Large raw parameters: concentrations from 1 to 1e10, so that float32 actions round onto
# the bounds (a = 1, b = 1e10 on [-2, 2]: the draws lie within 1e-8 of low, where the
# float32 spacing is 2.4e-7; a = 1e10, b = 1 on [1, 1000], within 1e-7 of high).
SATURATING = jnp.array([[-30.0, 0.3, 1e10, 1e10, 0.0, -30.0]] * 4)


# Train mode under nnx.jit (a training loop's) and eval mode eagerly by default; the
# other two slow.
@pytest.mark.parametrize(
    *each_value_once(
        {
            "jitted": {"nnx.jit": True, "eager": False},
            "deterministic": {"train": False, "eval": True},
        }
    )
)
def test_replay_reproduces_the_rollout_log_likelihood_bit_for_bit(jitted, deterministic):
    head = _beta_head()
    head.set_attributes(deterministic=deterministic)
    call = stateless_call(jitted)
    params = jnp.concatenate([_inputs((4,), scale=3.0)[:2], SATURATING[:2]])
    rollout = call(head, params)
    replay = call(head, params, rollout.rollout_extras)
    np.testing.assert_array_equal(replay.output["log_likelihood"], rollout.output["log_likelihood"])
    np.testing.assert_array_equal(replay.output["action"], rollout.output["action"])
    assert np.all(np.isfinite(rollout.output["log_likelihood"]))


def test_an_action_on_a_bound_is_scored_from_its_pre_image_and_replayed_in_the_loss():
    head = _beta_head()
    rollout = head((), SATURATING)
    action, pre_image = rollout.output["action"], rollout.rollout_extras
    # a = 1, b = 1e10 on the lower bound; a = 1e10, b = 1 on the upper one.
    assert np.all(np.asarray(action[:, 0]) == LOW[0]) and np.all(
        np.asarray(action[:, 2]) == HIGH[2]
    )
    np.testing.assert_array_equal(rollout.metrics["saturation"], np.float32(2 / 3))
    # The log-likelihood is the density at the pre-image (mpmath, 50 digits), not the
    # atom of the bound.
    a, b = (np.asarray(v, np.float64) for v in (rollout.metrics["alpha"], rollout.metrics["beta"]))
    with mpmath.workdps(50):
        expected = [
            sum(
                float(
                    (mpmath.mpf(float(a[i, j])) - 1)
                    * -mpmath.log1p(mpmath.exp(-mpmath.mpf(float(z))))
                    + (mpmath.mpf(float(b[i, j])) - 1)
                    * -mpmath.log1p(mpmath.exp(mpmath.mpf(float(z))))
                    - mpmath.log(mpmath.beta(float(a[i, j]), float(b[i, j])))
                    - mpmath.log(float(HIGH[j]) - float(LOW[j]))
                )
                for j, z in enumerate(np.asarray(pre_image[i]))
            )
            for i in range(4)
        ]
    np.testing.assert_allclose(rollout.output["log_likelihood"], expected, rtol=2e-6)

    @nnx.jit
    def loss_and_grad(head, params, stored):
        def loss(head, params, pre_image):
            out = head((), params, pre_image)
            ratio = jnp.exp(out.output["log_likelihood"] - stored.output["log_likelihood"])
            return jnp.mean(-ratio + out.regularization_loss), ratio

        value_and_grad = nnx.value_and_grad(loss, argnums=(1, 2), has_aux=True)
        return value_and_grad(head, params, stored.rollout_extras)

    # The loss runs another program (jitted, with gradients) than the eager rollout: XLA
    # may round the log-likelihood (about 20 nats here) differently in its last bits.
    (_, ratio), (grad, grad_stored) = loss_and_grad(head, SATURATING, rollout)
    np.testing.assert_allclose(ratio, 1.0, atol=1e-5)
    # The gradient reaches the parameters, never the stored pre-image.
    assert jnp.all(jnp.isfinite(grad)) and jnp.any(grad != 0)
    np.testing.assert_array_equal(grad_stored, 0.0)


@pytest.mark.parametrize("deterministic", [False, True], ids=["train", "eval"])
def test_only_a_fresh_sample_draws_keys(deterministic):
    head = _beta_head()
    head.set_attributes(deterministic=deterministic)
    params = _inputs((4,))
    rollout = head((), params)
    after_rollout = keys_drawn(head)
    head((), params, rollout.rollout_extras)
    # A sample draws its key and one more, as every head does; the exact entropy
    # needs none, so an eval call and a replay draw nothing.
    assert after_rollout == (0 if deterministic else 2)
    assert keys_drawn(head) == after_rollout


def test_eval_acts_with_the_mean_and_train_samples_again():
    head = _beta_head()
    params = _inputs((4,))
    dist = squashed_beta(params, LOW, HIGH)
    head.eval()
    assert head.deterministic
    out = head((), params)
    np.testing.assert_array_equal(out.output["action"], dist.mean())
    np.testing.assert_array_equal(
        out.rollout_extras, jnp.log(dist.concentration1) - jnp.log(dist.concentration0)
    )
    a, b = (np.asarray(v, np.float64) for v in (dist.concentration1, dist.concentration0))
    np.testing.assert_allclose(out.output["action"], LOW + (HIGH - LOW) * a / (a + b), rtol=1e-6)
    head.train()
    assert not jnp.allclose(head((), params).output["action"], out.output["action"])


def _action_sum(head, params, deterministic=None):
    return jnp.sum(head((), params, deterministic=deterministic).output["action"])


@nnx.jit(static_argnums=2)
def _action_grad(head, params, deterministic=None):
    return nnx.grad(_action_sum, argnums=1)(head, params, deterministic)


def test_reparameterized_keeps_the_pathwise_gradient_of_the_action():
    params = _inputs((4,))
    pathwise = BetaSampler(nnx.Rngs(0), **OPTIONS, reparameterized=True)
    grad = _action_grad(pathwise, params)
    assert jnp.all(grad != 0) and jnp.all(jnp.isfinite(grad))
    constant = _beta_head()
    np.testing.assert_array_equal(_action_grad(constant, params), 0.0)
    # eval, TD3-style: d/d raw of low + (high - low) a / (a + b), a = 1 + softplus(raw).
    mean_grad = np.asarray(_action_grad(pathwise, params, True))
    raw_a, raw_b = (np.asarray(params[..., i * A : (i + 1) * A], np.float64) for i in (0, 1))
    a, b = 1 + np.logaddexp(0, raw_a), 1 + np.logaddexp(0, raw_b)
    width = HIGH - LOW
    expected = np.concatenate(
        [
            width * b / (a + b) ** 2 * special.expit(raw_a),
            -width * a / (a + b) ** 2 * special.expit(raw_b),
        ],
        -1,
    )
    np.testing.assert_allclose(mean_grad, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_reparameterized_gradient_is_the_distributions_pathwise_gradient():
    params = _inputs((4,))
    pathwise = BetaSampler(nnx.Rngs(0), **OPTIONS, reparameterized=True)
    grad = _action_grad(pathwise, params)
    # The same draw through the distribution, from the first key of the head's stream.
    sample_key = nnx.Rngs(0).default()

    def through_dist(params):
        dist = squashed_beta(params, LOW, HIGH)
        return jnp.sum(dist.forward_and_log_prob(dist.sample_pre_image(seed=sample_key))[0])

    np.testing.assert_allclose(grad, jax.grad(through_dist)(params), rtol=1e-5, atol=1e-7)


def test_nnx_jit_does_not_retrace_on_repeated_calls():
    head = _beta_head()
    rollout = jitted_call(head, (), _inputs((4,)))
    jitted_call(head, (), _inputs((4,)), rollout.rollout_extras)
    traces = len(TRACES)
    for seed in range(4):
        jitted_call(head, (), _inputs((4,), seed=seed), rollout.rollout_extras)
        jitted_call(head, (), _inputs((4,), seed=seed))
    assert len(TRACES) == traces


def test_per_env_streams_split_each_environments_key_and_replay_alike():
    head = BetaSampler(nnx.Rngs(3), **OPTIONS, per_env_streams=True)
    keys = head.initialize_state(4)
    params = _inputs((4,))
    rollout = head(keys, params)
    for env in range(4):
        next_key = jax.random.split(keys[env], 3)[0]
        np.testing.assert_array_equal(
            jax.random.key_data(rollout.next_state[env]), jax.random.key_data(next_key)
        )
    replay = head(keys, params, rollout.rollout_extras)
    np.testing.assert_array_equal(replay.output["log_likelihood"], rollout.output["log_likelihood"])
    # A replay needs no noise: it hands the keys back as it got them.
    np.testing.assert_array_equal(jax.random.key_data(replay.next_state), jax.random.key_data(keys))
    assert keys_drawn(head) == 1  # initialize_state drew one key; calls draw none


@pytest.mark.slow
def test_per_env_streams_draw_each_environment_from_its_own_key():
    head = BetaSampler(nnx.Rngs(3), **OPTIONS, per_env_streams=True)
    keys = head.initialize_state(8)
    params = _inputs((8,))
    whole = head(keys, params)
    part = head(keys[3:], params[3:])
    np.testing.assert_array_equal(whole.rollout_extras[3:], part.rollout_extras)
    dist = squashed_beta(params, LOW, HIGH)
    for env in (0, 5):
        sample_key = jax.random.split(keys[env], 3)[1]
        np.testing.assert_allclose(
            whole.rollout_extras[env], dist[env].sample_pre_image(seed=sample_key), rtol=1e-6
        )


@pytest.mark.parametrize(
    "extras, error, message",
    [
        (jnp.zeros((4, A + 1)), ValueError, "must have the action shape"),
        (
            jnp.zeros((4, A), jnp.int32),
            TypeError,
            r"floating dtype, got int32 \(the stored pre-image z\)",
        ),
        (jnp.zeros((4, A), jnp.bfloat16), TypeError, "must be stored in float32"),
        (jnp.zeros((4, A), jnp.float16), TypeError, "must be stored in float32"),
    ],
)
def test_a_stored_pre_image_of_the_wrong_shape_or_fewer_bits_is_refused(extras, error, message):
    head = _beta_head()
    with pytest.raises(error, match=message):
        head((), _inputs((4,)), extras)


@pytest.mark.slow
def test_under_x64_a_float32_pre_image_for_a_float64_head_is_refused():
    with jax.enable_x64(True):
        head = BetaSampler(nnx.Rngs(0), **OPTIONS)
        params = jnp.zeros((4, 2 * A), jnp.float64)
        stored = head((), params).rollout_extras
        assert stored.dtype == jnp.float64
        with pytest.raises(TypeError, match="must be stored in float64"):
            head((), params, stored.astype(jnp.float32))


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"entropy_weight": None}, TypeError, "entropy_weight is required"),
        (
            {"entropy_weight": 0.1, "min_concentration": -1.0},
            ValueError,
            "min_concentration must be >= 0",
        ),
        ({"entropy_weight": 0.1, "low": 1.0, "high": 1.0}, ValueError, "low must be < high"),
        (
            {"entropy_weight": 0.1, "low": np.zeros(2), "high": np.ones(2), "action_dim": 3},
            ValueError,
            r"shape \(\) or \(action_dim,\)",
        ),
        (
            {"entropy_weight": 0.1, "action_dim": 0},
            ValueError,
            "action_dim must be a positive integer",
        ),
        ({"entropy_weight": 0.1, "bijector": None}, TypeError, "unexpected keyword argument"),
    ],
)
def test_bad_configuration_is_refused_at_construction(kwargs, error, message):
    with pytest.raises(error, match=message):
        BetaSampler(nnx.Rngs(0), **kwargs)


def test_num_params_needs_action_dim_and_then_checks_the_input_width():
    with pytest.raises(AttributeError, match="pass action_dim="):
        _ = BetaSampler(nnx.Rngs(0), 0.01).num_params
    head = BetaSampler(nnx.Rngs(0), 0.01, action_dim=A)
    assert head.num_params == 2 * A
    with pytest.raises(ValueError, match=r"size the network's last layer to head.num_params"):
        head((), jnp.zeros((4, 2 * A + 2)))


@pytest.mark.parametrize("batch_shape", [slow((), id="(A,)"), pytest.param((3, 4), id="(T,B,A)")])
def test_the_call_annotations_hold_at_run_time(batch_shape):
    head = BetaSampler(nnx.Rngs(0), 0.01)
    checked = jaxtyped(typechecker=beartype)(BetaSampler.__call__)
    out = checked(head, (), jnp.zeros((*batch_shape, 2 * A)))
    checked(head, (), jnp.zeros((*batch_shape, 2 * A)), out.rollout_extras)
    assert isinstance(head.distribution(jnp.zeros((*batch_shape, 2 * A))), SquashedBeta)
