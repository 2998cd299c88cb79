import math
import warnings

import distrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import samplers
from tests._tiers import JIT_MODES, slow
from tests.helpers import keys_drawn


def _categorical(logits):
    return distrax.Categorical(logits=logits)


def _beta(params):
    concentrations = jax.nn.softplus(params) + 1.0
    alpha, beta = jnp.split(concentrations, 2, axis=-1)
    return distrax.Independent(distrax.Beta(alpha, beta), 1)


def test_categorical_replays_the_stored_index_under_the_current_logits():
    head = samplers.DistributionSampler(nnx.Rngs(0), 0.1, _categorical)
    logits = jax.random.normal(jax.random.key(1), (6, 4))
    rollout = head((), logits)
    index = rollout.rollout_extras
    assert index.shape == (6,) and jnp.issubdtype(index.dtype, jnp.integer)
    new_logits = logits + 0.3 * jax.random.normal(jax.random.key(2), (6, 4))
    replay = head((), new_logits, index)
    expected = jnp.take_along_axis(jax.nn.log_softmax(new_logits), index[:, None], -1)[:, 0]
    np.testing.assert_allclose(replay.output["log_likelihood"], expected, rtol=1e-6)
    same = head((), logits, index)
    np.testing.assert_allclose(
        same.output["log_likelihood"], rollout.output["log_likelihood"], rtol=1e-6
    )
    probabilities = jax.nn.softmax(logits)
    entropy = -jnp.sum(probabilities * jnp.log(probabilities), axis=-1)
    np.testing.assert_allclose(rollout.regularization_loss, -0.1 * entropy, rtol=1e-5)
    assert keys_drawn(head) == 2  # two keys for the sample; the replays need none


def test_categorical_eval_acts_with_the_most_likely_index_and_draws_no_key():
    head = samplers.DistributionSampler(nnx.Rngs(0), 0.1, _categorical)
    logits = jax.random.normal(jax.random.key(3), (5, 4))
    head.eval()
    out = head((), logits)
    np.testing.assert_array_equal(out.output["action"], jnp.argmax(logits, axis=-1))
    assert keys_drawn(head) == 0


def test_categorical_gradient_reaches_the_logits():
    head = samplers.DistributionSampler(nnx.Rngs(0), 0.1, _categorical)
    logits = jax.random.normal(jax.random.key(4), (5, 4))
    index = head((), logits).rollout_extras

    def loss(head, logits):
        out = head((), logits, index)
        return jnp.sum(out.output["log_likelihood"] + out.regularization_loss)

    grad = nnx.jit(nnx.grad(loss, argnums=1))(head, logits)
    assert jnp.all(jnp.isfinite(grad)) and jnp.any(grad != 0)


@pytest.mark.slow  # BetaSampler's tests score a Beta head in the default tier
def test_beta_actions_are_in_the_unit_interval_and_score_as_the_beta_density():
    head = samplers.DistributionSampler(nnx.Rngs(0), 0.01, _beta)
    params = jax.random.normal(jax.random.key(5), (64, 4))
    rollout = nnx.jit(lambda head, p: head((), p))(head, params)
    action = rollout.output["action"]
    assert action.shape == (64, 2) and jnp.all((action >= 0) & (action <= 1))
    concentrations = jax.nn.softplus(params) + 1.0
    alpha, beta = concentrations[:, :2], concentrations[:, 2:]
    expected = jnp.sum(jax.scipy.stats.beta.logpdf(action, alpha, beta), axis=-1)
    np.testing.assert_allclose(rollout.output["log_likelihood"], expected, rtol=1e-4, atol=1e-4)
    replay = head((), params, rollout.rollout_extras)
    ratio = jnp.exp(replay.output["log_likelihood"] - rollout.output["log_likelihood"])
    np.testing.assert_allclose(ratio, 1.0, atol=1e-6)


def test_beta_entropy_is_the_expected_negative_log_density():
    head = samplers.DistributionSampler(nnx.Rngs(0), 1.0, _beta)
    params = jnp.tile(jnp.array([0.5, -1.0, 2.0, 0.0]), (20_000, 1))
    out = head((), params)
    samples = -np.asarray(out.output["log_likelihood"], np.float64)
    standard_error = samples.std() / np.sqrt(samples.size)
    entropy = -float(out.regularization_loss[0])
    assert abs(samples.mean() - entropy) < 3 * standard_error


@pytest.mark.parametrize(
    "make, error, message",
    [
        (None, TypeError, r"make_distribution must be a function params -> distrax"),
        (lambda p: p, TypeError, r"make_distribution must return a distrax.Distribution, got"),
    ],
)
def test_bad_distribution_factories_are_refused(make, error, message):
    with pytest.raises(error, match=message):
        samplers.DistributionSampler(nnx.Rngs(0), 0.1, make)((), jnp.zeros((2, 3)))


def test_a_stored_action_of_the_wrong_shape_is_refused():
    head = samplers.DistributionSampler(nnx.Rngs(0), 0.1, _categorical)
    with pytest.raises(ValueError, match=r"must have the action shape \(2,\), got \(3,\)"):
        head((), jnp.zeros((2, 3)), jnp.zeros(3, jnp.int32))


# One traced call for the file: a sampler's make_distribution (a module-level function
# here) is its static configuration, so equal samplers share the compiled programs.
_jitted_call = nnx.jit(lambda head, *args: head((), *args))


def _call(jitted):
    return _jitted_call if jitted else (lambda head, *args: head((), *args))


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "nnx.jit"])
def test_a_float_action_stored_for_a_categorical_is_refused(jitted):
    logits = jnp.log(jnp.array([[0.2, 0.3, 0.5], [0.6, 0.3, 0.1]]))
    # Why: 1.7 is no outcome (probability 0, log-likelihood -inf), and distrax says 0
    # (with a deprecation warning from jax.nn.one_hot at most).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert float(distrax.Categorical(logits=logits[0]).log_prob(jnp.float32(1.7))) == 0.0
    head = samplers.DistributionSampler(nnx.Rngs(0), 0.1, _categorical)
    with pytest.raises(
        TypeError,
        match=r"rollout_extras must have an integer dtype, as this distribution samples int32 "
        r"actions, got float32: .* cast with \.astype\(jnp\.int32\)",
    ):
        _call(jitted)(head, logits, jnp.array([1.7, 0.0]))
    # Any integer dtype is an index: scored as float64 log-softmax of the stored index.
    for dtype in (jnp.int8, jnp.int32, jnp.uint8):
        out = _call(jitted)(head, logits, jnp.array([2, 0], dtype))
        np.testing.assert_allclose(out.output["log_likelihood"], np.log([0.5, 0.6]), rtol=1e-6)


# float16 takes bfloat16's path: slow.
@pytest.mark.parametrize("dtype", [jnp.int32, slow(jnp.bfloat16), slow(jnp.float16)])
@pytest.mark.parametrize("jitted", JIT_MODES)
def test_an_integer_or_lower_precision_action_stored_for_a_beta_is_refused(dtype, jitted):
    head = samplers.DistributionSampler(nnx.Rngs(0), 0.1, _beta)
    params = jax.random.normal(jax.random.key(1), (4, 6))
    action = head((), params).rollout_extras
    assert action.dtype == jnp.float32
    name = jnp.dtype(dtype).name
    with pytest.raises(
        TypeError,
        match=rf"rollout_extras must have a floating dtype of at least 32 bits, as this "
        rf"distribution samples float32 actions, got {name}: .* store the actions as the "
        rf"rollout call emitted them, or cast with \.astype\(jnp\.float32\)",
    ):
        _call(jitted)(head, params, action.astype(dtype))
    # As emitted, the stored action is scored as the float64 Beta density of it.
    out = _call(jitted)(head, params, action)
    concentrations = np.logaddexp(np.asarray(params, np.float64), 0.0) + 1.0
    a, b = np.split(concentrations, 2, axis=-1)
    y = np.asarray(action, np.float64)
    log_beta = (
        np.vectorize(math.lgamma)(a)
        + np.vectorize(math.lgamma)(b)
        - np.vectorize(math.lgamma)(a + b)
    )
    expected = np.sum((a - 1) * np.log(y) + (b - 1) * np.log1p(-y) - log_beta, -1)
    np.testing.assert_allclose(out.output["log_likelihood"], expected, rtol=1e-4, atol=1e-4)


# The streams are the point, not the distribution, and the default tier checks them on
# the squashed-Normal and composite heads: both cases here are slow.
@pytest.mark.parametrize(
    "make, width", [slow(_categorical, 4, id="categorical"), slow(_beta, 6, id="beta")]
)
def test_per_env_streams_sample_each_environment_from_its_own_key(make, width):
    head = samplers.DistributionSampler(nnx.Rngs(0), 0.1, make, per_env_streams=True)
    keys = head.initialize_state(6)
    params = jax.random.normal(jax.random.key(1), (6, width))
    whole = head(keys, params)
    alone = jax.jit(lambda params, key: make(params).sample(seed=jax.random.split(key, 3)[1]))
    for env in range(6):
        np.testing.assert_array_equal(whole.output["action"][env], alone(params[env], keys[env]))
    tail = head(keys[2:], params[2:])
    np.testing.assert_array_equal(tail.output["action"], whole.output["action"][2:])
    np.testing.assert_array_equal(
        jax.random.key_data(tail.next_state), jax.random.key_data(whole.next_state[2:])
    )
    replay = head(keys, params, whole.rollout_extras)
    np.testing.assert_array_equal(replay.output["log_likelihood"], whole.output["log_likelihood"])
    assert keys_drawn(head) == 1  # initialize_state drew one key; calls draw none
    assert head.reset_state(keys) is keys


def test_a_distribution_scored_per_action_dimension_is_refused():
    def per_dimension(params):
        mean, log_std = jnp.split(params, 2, axis=-1)
        return distrax.Normal(mean, jnp.exp(log_std))  # batch shape [B, A], not [B]

    head = samplers.DistributionSampler(nnx.Rngs(0), 0.01, per_dimension)
    with pytest.raises(
        ValueError,
        match=r"make_distribution returned a distribution of batch shape \(4, 3\) for params of "
        r"batch shape \(4,\) .* wrap it as distrax.Independent\(dist, 1\)",
    ):
        head((), jnp.zeros((4, 6)))
    wrapped = samplers.DistributionSampler(
        nnx.Rngs(0), 0.01, lambda p: distrax.Independent(per_dimension(p), 1)
    )
    assert wrapped((), jnp.zeros((4, 6))).output["log_likelihood"].shape == (4,)
