"""``reparameterized=True``: the pathwise gradient of an SAC/TD3-style actor loss.

The oracles are written here from the maths in float64 NumPy: the action
``tanh(mean + std * eps)`` for the noise ``eps`` that the sampler's first key
draws, the log-likelihood by the change of variables, and the actor loss's
gradient both by hand (the chain rule written out) and by central finite
differences.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import samplers
from tests._tiers import JIT_MODES, SLOW, each_value_once
from tests.reference import softplus_std_float64

A = 3
ALPHA = 0.2
MIN_STD, STD_SCALE = 1e-3, 1.5
# The made-up critic: Q(a) = -sum(W * (a - T)**2), per batch element.
W = np.array([1.0, 0.5, 2.0])
T = np.array([0.3, -0.8, 0.9])


def _critic(action):
    weight, target = (jnp.broadcast_to(jnp.asarray(a, action.dtype), action.shape) for a in (W, T))
    return -jnp.sum(weight * jnp.square(action - target), -1)


def _actor_loss(head, mean_and_std):
    out = head((), mean_and_std)
    return jnp.sum(ALPHA * out.output["log_likelihood"] - _critic(out.output["action"]))


def _noise(seed, shape):
    """The sampler's noise: it draws its first key from the stream for the sample."""
    return np.asarray(jax.random.normal(nnx.Rngs(seed)(), shape), np.float64)


def _loss_float64(mean_and_std, eps):
    mean, raw_std = np.split(np.asarray(mean_and_std, np.float64), 2, axis=-1)
    std = softplus_std_float64(raw_std, MIN_STD, STD_SCALE)
    x = mean + std * eps
    log_normal = -0.5 * eps**2 - np.log(std) - 0.5 * np.log(2 * np.pi)
    log_sech2 = 2 * np.log(2.0) - 2 * np.logaddexp(x, -x)
    log_likelihood = np.sum(log_normal - log_sech2, -1)
    critic = -np.sum(W * (np.tanh(x) - T) ** 2, -1)
    return np.sum(ALPHA * log_likelihood - critic)


def _pathwise_gradient_float64(mean_and_std, eps):
    """The chain rule written out through ``x = mean + std * eps``."""
    mean, raw_std = np.split(np.asarray(mean_and_std, np.float64), 2, axis=-1)
    std = softplus_std_float64(raw_std, MIN_STD, STD_SCALE)
    x = mean + std * eps
    tanh = np.tanh(x)
    # d log_likelihood / dx at fixed eps: -d log sech(x)**2 / dx = 2 tanh(x).
    d_x = ALPHA * 2 * tanh + 2 * W * (tanh - T) * (1 - tanh**2)
    d_mean = d_x
    d_std = d_x * eps - ALPHA / std
    d_raw_std = d_std * STD_SCALE / (1 + np.exp(-raw_std))
    return np.concatenate([d_mean, d_raw_std], -1)


def _finite_difference_float64(mean_and_std, eps, step=1e-6):
    mean_and_std = np.asarray(mean_and_std, np.float64)
    gradient = np.zeros_like(mean_and_std)
    for index in np.ndindex(mean_and_std.shape):
        up, down = mean_and_std.copy(), mean_and_std.copy()
        up[index] += step
        down[index] -= step
        gradient[index] = (_loss_float64(up, eps) - _loss_float64(down, eps)) / (2 * step)
    return gradient


def _reparameterized_head(seed=0, **options):
    return samplers.NormalTanhSampler(
        nnx.Rngs(seed), 0.0, MIN_STD, STD_SCALE, reparameterized=True, **options
    )


MEANS = {
    "centre": np.array([[0.3, -0.5, 1.2], [-1.0, 0.0, 0.4]]),
    "saturated": np.array([[10.0, -12.0, 20.0], [-15.0, 11.0, -30.0]]),
}


@pytest.mark.parametrize("jitted", JIT_MODES)
@pytest.mark.parametrize("where", list(MEANS))
def test_actor_loss_gradient_is_the_pathwise_gradient(where, jitted):
    raw_std = np.array([[-1.0, 0.0, 0.5], [0.2, -0.3, 1.0]])
    mean_and_std = np.concatenate([MEANS[where], raw_std], -1).astype(np.float32)
    eps = _noise(0, (2, A))
    grad = nnx.grad(_actor_loss, argnums=1)
    if jitted:
        grad = nnx.jit(grad)
    head = _reparameterized_head()
    ours = np.asarray(grad(head, jnp.asarray(mean_and_std)))

    pre_image = np.split(mean_and_std.astype(np.float64), 2, -1)[0] + eps * (
        softplus_std_float64(raw_std, MIN_STD, STD_SCALE)
    )
    if where == "saturated":
        assert np.all(np.abs(pre_image) >= 8.5)
        assert np.all(np.abs(np.tanh(pre_image.astype(np.float32))) == 1.0)
    assert np.all(np.isfinite(ours))
    np.testing.assert_allclose(
        ours, _pathwise_gradient_float64(mean_and_std, eps), rtol=1e-4, atol=1e-5
    )
    np.testing.assert_allclose(
        ours, _finite_difference_float64(mean_and_std, eps), rtol=1e-4, atol=1e-4
    )


@pytest.mark.parametrize("jitted", JIT_MODES)
def test_a_saturated_fresh_sample_keeps_its_small_action_gradient(jitted):
    """Where float32 tanh(x) is exactly +-1, d tanh(x) / dx = 1 / cosh(x)**2 (~1e-8),
    not 0: the critic term's gradient is the float64 chain rule to 1e-5 relative."""
    mean_and_std = np.concatenate([SATURATED, np.full((2, A), -3.0)], -1).astype(np.float32)
    eps = _noise(0, (2, A))
    mean, raw_std = np.split(mean_and_std.astype(np.float64), 2, -1)
    std = softplus_std_float64(raw_std, MIN_STD, STD_SCALE)
    x = mean + std * eps
    assert np.all(np.abs(jnp.tanh(jnp.asarray(x, jnp.float32))) == 1.0)  # the backend's tanh

    def critic_loss(head, mean_and_std):
        return -jnp.sum(_critic(head((), mean_and_std).output["action"]))

    grad = nnx.grad(critic_loss, argnums=1)
    if jitted:
        grad = nnx.jit(grad)
    ours = np.asarray(grad(_reparameterized_head(), jnp.asarray(mean_and_std)))
    d_x = 2 * W * (np.tanh(x) - T) / np.cosh(x) ** 2
    d_raw_std = d_x * eps * STD_SCALE / (1 + np.exp(-raw_std))
    np.testing.assert_allclose(ours, np.concatenate([d_x, d_raw_std], -1), rtol=1e-5, atol=0)


def test_the_log_likelihood_and_action_are_those_of_the_pathwise_sample():
    mean_and_std = jnp.array([[0.3, -0.5, 1.2, -1.0, 0.0, 0.5]])
    eps = _noise(0, (1, A))
    out = _reparameterized_head()((), mean_and_std)
    mean, raw_std = np.split(np.asarray(mean_and_std, np.float64), 2, -1)
    x = mean + eps * softplus_std_float64(raw_std, MIN_STD, STD_SCALE)
    np.testing.assert_allclose(out.rollout_extras, x, rtol=1e-6)
    np.testing.assert_allclose(out.output["action"], np.tanh(x), rtol=1e-6)


def test_default_has_no_gradient_through_the_fresh_sample():
    mean_and_std = jnp.array([[0.3, -0.5, 1.2, -1.0, 0.0, 0.5]])

    def total_action(head, params):
        return jnp.sum(head((), params).output["action"])

    default = samplers.NormalTanhSampler(nnx.Rngs(0), 0.0)
    np.testing.assert_array_equal(nnx.grad(total_action, argnums=1)(default, mean_and_std), 0.0)
    pathwise = nnx.grad(total_action, argnums=1)(_reparameterized_head(), mean_and_std)
    assert np.all(pathwise[..., :A] > 0)  # d tanh(x) / d mean = 1 - tanh(x)**2


def _sampler(kind, reparameterized):
    options = {"reparameterized": reparameterized}
    if kind == "tanh":
        return samplers.NormalTanhSampler(nnx.Rngs(3), 0.01, **options)
    if kind == "bounded":
        bijector = samplers.BoundedTanh(-2.0, 2.0)
        return samplers.SquashedNormalSampler(nnx.Rngs(3), 0.01, bijector=bijector, **options)
    return samplers.StateIndependentSampler(nnx.Rngs(3), A, 0.01, **options)


def _params(kind):
    width = A if kind == "state-independent" else 2 * A
    return 2.0 * jax.random.normal(jax.random.key(5), (4, width))


def _outputs(out):
    return [
        out.output["action"],
        out.output["log_likelihood"],
        out.rollout_extras,
        out.regularization_loss,
        *out.metrics.values(),
    ]


KINDS = ["tanh", "bounded", "state-independent"]


@pytest.mark.parametrize("kind", KINDS)
def test_outputs_and_stream_do_not_depend_on_the_flag(kind):
    params = _params(kind)
    default, pathwise = _sampler(kind, False), _sampler(kind, True)
    for mode in ("train", "eval"):
        for head in (default, pathwise):
            head.eval() if mode == "eval" else head.train()
        rollouts = [head((), params) for head in (default, pathwise)]
        replays = [
            head((), params + 0.1, rollouts[0].rollout_extras) for head in (default, pathwise)
        ]
        for ours, theirs in (rollouts, replays):
            for a, b in zip(_outputs(ours), _outputs(theirs), strict=True):
                np.testing.assert_array_equal(a, b)
    assert (
        int(default.rng.default.count[...]) == int(pathwise.rng.default.count[...]) == 2 + 2 + 1 + 1
    )


@pytest.mark.parametrize("kind", KINDS)
def test_replay_gradients_do_not_depend_on_the_flag(kind):
    params = _params(kind)

    def loss(head, params, extras):
        out = head((), params, extras)
        return jnp.sum(out.output["log_likelihood"] - _critic(out.output["action"]))

    stored = _sampler(kind, False)((), params).rollout_extras
    for deterministic in (False, True):
        grads = []
        for reparameterized in (False, True):
            head = _sampler(kind, reparameterized)
            head.set_attributes(deterministic=deterministic)
            grads.append(nnx.grad(loss, argnums=(0, 1))(head, params, stored))
        for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1]), strict=True):
            np.testing.assert_array_equal(a, b)


# TD3: the actor loss -Q(s, f(mean)) on the eval() head. Saturated means: float32
# f(mean) is exactly on a bound (|mean| >= 9.1 for any float32 tanh; sigmoid rounds to
# 1 from about 17, never to 0 here), and f'(mean) is below 1e-7.
EVAL_KINDS = ["tanh", "bounded", "sigmoid"]
CENTRE = np.array([[0.3, -0.5, 1.2], [-1.0, 0.0, 0.4]])
SATURATED = np.array([[9.5, -10.0, 10.5], [-9.2, 9.8, -10.2]])
SATURATED_SIGMOID = np.array([[19.0, 20.0, 21.0], [18.4, 19.6, 20.4]])
EVAL_LOW, EVAL_HIGH = np.array([-2.0, 0.0, -1.0]), np.array([2.0, 1.0, 3.0])


def _eval_head(kind, reparameterized):
    if kind == "tanh":
        head = samplers.NormalTanhSampler(nnx.Rngs(0), 0.0, reparameterized=reparameterized)
    else:
        bijector = (
            samplers.Sigmoid()
            if kind == "sigmoid"
            else samplers.BoundedTanh(jnp.asarray(EVAL_LOW), jnp.asarray(EVAL_HIGH))
        )
        head = samplers.SquashedNormalSampler(
            nnx.Rngs(0), 0.0, bijector=bijector, reparameterized=reparameterized
        )
    head.eval()
    return head


def _td3_actor_loss(head, mean_and_std):
    return -jnp.sum(_critic(head((), mean_and_std).output["action"]))


def _squash_float64(kind, mean):
    """``(f(mean), f'(mean), low, high)`` in float64, ``f'`` from ``1 / cosh**2``."""
    if kind == "tanh":
        return np.tanh(mean), 1 / np.cosh(mean) ** 2, -1.0, 1.0
    if kind == "sigmoid":
        return 1 / (1 + np.exp(-mean)), 1 / (4 * np.cosh(mean / 2) ** 2), 0.0, 1.0
    half_range = (EVAL_HIGH - EVAL_LOW) / 2
    action = (EVAL_HIGH + EVAL_LOW) / 2 + half_range * np.tanh(mean)
    return action, half_range / np.cosh(mean) ** 2, EVAL_LOW, EVAL_HIGH


def _td3_losses_float64(kind, mean):
    """``-Q(f(mean))`` per element, so that a difference cancels the untouched ones exactly."""
    return W * (_squash_float64(kind, mean)[0] - T) ** 2


# Each squashing and each mean at least once by default, under nnx.jit.
@pytest.mark.parametrize("jitted", JIT_MODES)
@pytest.mark.parametrize(
    *each_value_once(
        {"kind": {k: k for k in EVAL_KINDS}, "where": {w: w for w in ("saturated", "centre")}}
    )
)
def test_td3_actor_loss_on_eval_has_the_chain_rule_gradient(kind, where, jitted):
    mean = CENTRE if where == "centre" else SATURATED_SIGMOID if kind == "sigmoid" else SATURATED
    raw_std = np.array([[-1.0, 0.0, 0.5], [0.2, -0.3, 1.0]])
    mean_and_std = jnp.asarray(np.concatenate([mean, raw_std], -1), jnp.float32)
    grad = nnx.grad(_td3_actor_loss, argnums=1)
    if jitted:
        grad = nnx.jit(grad)
    ours = np.asarray(grad(_eval_head(kind, True), mean_and_std))

    action, derivative, low, high = _squash_float64(kind, mean)
    if where == "saturated":
        float32_action = np.asarray(_eval_head(kind, True)((), mean_and_std).output["action"])
        assert np.all((float32_action == low) | (float32_action == high))
        assert np.all(derivative < 1e-7)
    # d/dmean of -Q(f(mean)) = sum W (f(mean) - T)**2, by the chain rule.
    chain_rule = 2 * W * (action - T) * derivative
    np.testing.assert_allclose(ours[:, :A], chain_rule, rtol=1e-5, atol=0)
    np.testing.assert_array_equal(ours[:, A:], 0.0)  # the action does not depend on the std
    # Central differences; a wider step where sigmoid's f' is smaller still (~1e-9).
    step = 1e-2 if mean is SATURATED_SIGMOID else 1e-3
    finite_difference = np.zeros_like(mean)
    for index in np.ndindex(mean.shape):
        up, down = mean.copy(), mean.copy()
        up[index] += step
        down[index] -= step
        difference = _td3_losses_float64(kind, up) - _td3_losses_float64(kind, down)
        finite_difference[index] = np.sum(difference) / (2 * step)
    np.testing.assert_allclose(ours[:, :A], finite_difference, rtol=1e-4, atol=0)


@pytest.mark.parametrize("where", ["centre", "saturated"])
def test_eval_log_likelihood_has_the_pathwise_gradient_at_zero_noise(where):
    """At ``x = mean``: ``log N(x; mean, std) - log sech(x)**2`` has the gradient
    ``2 tanh(mean)`` w.r.t. the mean and ``-1 / std`` w.r.t. the std; the default head,
    whose ``x`` is a constant, only the latter."""
    mean = CENTRE if where == "centre" else SATURATED
    raw_std = np.array([[-1.0, 0.0, 0.5], [0.2, -0.3, 1.0]])
    mean_and_std = jnp.asarray(np.concatenate([mean, raw_std], -1), jnp.float32)

    def total_log_likelihood(head, mean_and_std):
        return jnp.sum(head((), mean_and_std).output["log_likelihood"])

    std = np.logaddexp(raw_std, 0.0) + 1e-3
    d_raw_std = -1 / std / (1 + np.exp(-raw_std))
    for reparameterized, d_mean in ((True, 2 * np.tanh(mean)), (False, np.zeros_like(mean))):
        head = _eval_head("tanh", reparameterized)
        ours = nnx.grad(total_log_likelihood, argnums=1)(head, mean_and_std)
        np.testing.assert_allclose(ours, np.concatenate([d_mean, d_raw_std], -1), rtol=1e-5)


# The bounds by default; Tanh and Sigmoid, of the same family, slow.
@pytest.mark.parametrize(
    "kind", [pytest.param(k, marks=[] if k == "bounded" else [SLOW]) for k in EVAL_KINDS]
)
def test_by_default_the_deterministic_action_has_no_gradient(kind):
    mean_and_std = jnp.asarray(np.concatenate([CENTRE, np.zeros((2, A))], -1), jnp.float32)
    head = _eval_head(kind, False)
    np.testing.assert_array_equal(nnx.grad(_td3_actor_loss, argnums=1)(head, mean_and_std), 0.0)
    # The values are those of the pathwise head, bit for bit.
    ours, pathwise = (h((), mean_and_std) for h in (head, _eval_head(kind, True)))
    for a, b in zip(_outputs(ours), _outputs(pathwise), strict=True):
        np.testing.assert_array_equal(a, b)


def test_state_independent_log_std_gets_the_pathwise_gradient():
    head = samplers.StateIndependentSampler(
        nnx.Rngs(0), A, 0.0, initial_std=0.7, reparameterized=True
    )
    mean = jnp.array([[0.3, -0.5, 1.2], [-1.0, 0.0, 0.4]])
    eps = _noise(0, (2, A))

    def loss(head):
        return _actor_loss(head, mean)

    ours = np.asarray(nnx.grad(loss)(head)["log_std"][...])
    std = 0.7
    x = np.asarray(mean, np.float64) + std * eps
    tanh = np.tanh(x)
    d_x = ALPHA * 2 * tanh + 2 * W * (tanh - T) * (1 - tanh**2)
    expected = np.sum((d_x * eps - ALPHA / std) * std, axis=0)  # d std / d log_std = std
    np.testing.assert_allclose(ours, expected, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_nnx_scan_over_steps_gives_the_python_loop_gradient():
    sequence = 1.5 * jax.random.normal(jax.random.key(2), (5, 4, 2 * A))  # [T, B, 2A]

    def looped(head, sequence):
        return sum(_actor_loss(head, x) for x in sequence)

    def scanned(head, sequence):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
        def step(head, x):
            return head, _actor_loss(head, x)

        _, losses = step(head, sequence)
        return jnp.sum(losses)

    expected = nnx.grad(looped, argnums=1)(_reparameterized_head(7), sequence)
    ours = nnx.grad(scanned, argnums=1)(_reparameterized_head(7), sequence)
    assert np.all(np.asarray(expected) != 0)
    np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-6)
