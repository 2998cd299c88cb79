"""The replay protocol, the same on every distribution a head uses.

For each class: a sample's log-probability is the replay of its data, bit for bit and
equal to ``log_prob`` of the sampled action; a stored copy of the data replays it; the
deterministic data is the documented action; per-element keys draw each row from its
own key; stored data of the wrong shape or kind is refused; and the value and gradient
of the replayed log-probability match a float64 formula written here.
"""

import distrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import special, stats

import samplers
from samplers.distributions import replay
from tests._tiers import slow
from tests.reference import (
    masked_log_softmax_float64,
    softplus_std_float64,
    tanh_normal_log_prob_float64,
)

B, A = 6, 3


def _params(seed, width, batch=(B,)):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(*batch, width)), jnp.float32)


def _tanh(batch=(B,)):
    return samplers.normal_tanh(_params(0, 2 * A, batch))


def _bounded(batch=(B,)):
    return samplers.squashed_normal(
        _params(1, 2 * A, batch),
        samplers.BoundedTanh(jnp.array([-2.0, 0.0, 1.0]), jnp.array([3.0, 0.5, 4.0])),
    )


def _beta(batch=(B,)):
    return samplers.squashed_beta(_params(2, 2 * A, batch), -1.0, 2.0)


def _categorical(batch=(B,)):
    mask = np.ones((*batch, 4), bool)
    mask[..., 1] = False
    return samplers.MaskedCategorical(_params(3, 4, batch), mask)


def _multi_discrete(batch=(B,)):
    return samplers.MultiDiscrete(_params(4, 5, batch), (3, 2))


def _multi_binary(batch=(B,)):
    return samplers.MultiBinary(_params(5, A, batch))


def _composite(batch=(B,)):
    return samplers.Composite(
        {"move": _bounded(batch), "fire": _categorical(batch), "bits": (_multi_binary(batch),)}
    )


def _parameterized(batch=(B,)):
    return samplers.Parameterized(
        samplers.MaskedCategorical(_params(6, 2, batch)), (_tanh(batch), _beta(batch))
    )


def _flow(batch=(B,)):
    """A squashed flow of one coupling layer that also sees features of the batch."""
    features = _params(9, 2, batch)
    weights = jnp.asarray(np.random.default_rng(10).normal(size=(A + 2, A, 2)) * 0.3, jnp.float32)

    def conditioner(x):
        seen = jnp.concatenate([x, jnp.broadcast_to(features, (*x.shape[:-1], 2))], -1)
        return jnp.einsum("...i,ijk->...jk", seen, weights)

    layer = distrax.MaskedCoupling(
        jnp.arange(A) < 1,
        conditioner,
        lambda p: distrax.ScalarAffine(shift=p[..., 0], log_scale=p[..., 1]),
    )
    base = _tanh(batch)
    return samplers.SquashedFlow(base.loc, base.scale, [layer])


MAKERS = {
    "tanh": _tanh,
    "bounded": _bounded,
    "beta": _beta,
    "categorical": _categorical,
    "multi_discrete": _multi_discrete,
    "multi_binary": _multi_binary,
    "composite": _composite,
    "parameterized": _parameterized,
    "flow": _flow,
}
# The default tier runs a squashed Normal and a composite (whose parts are a bounded
# squashing, a categorical and bits); the other classes, the Beta's pre-image replay
# (the squashed Normal's, shared) included, are slow.
SLOW_CASES = (
    "bounded",
    "beta",
    "categorical",
    "multi_discrete",
    "multi_binary",
    "parameterized",
    "flow",
)
CASES = [
    slow(make, id=name) if name in SLOW_CASES else pytest.param(make, id=name)
    for name, make in MAKERS.items()
]


def _equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("make", CASES)
def test_a_sample_replays_bit_for_bit_from_a_stored_copy_of_its_data(make):
    dist = make()
    assert isinstance(dist, samplers.Replayable)
    action, data, log_prob = dist.sample_with_replay(seed=jax.random.key(0))
    assert log_prob.shape == (B,) and np.all(np.isfinite(log_prob))
    _equal(data, dist.sample_replay_data(seed=jax.random.key(0)))
    stored = jax.tree.map(lambda x: np.array(x), data)  # a copy, as a buffer holds it
    again_action, again = dist.replay(dist.check_replay_data(stored))
    _equal(again, log_prob)
    _equal(again_action, action)
    # The distrax idiom scores the sampled action as the replay does.
    _equal(dist.log_prob(action), log_prob)
    # Under jit, the same bits as eagerly.
    jitted = jax.jit(lambda d, x: d.replay(x)[1])(dist, stored)
    np.testing.assert_allclose(jitted, log_prob, rtol=1e-6)


def _deterministic_action(dist):
    """The mean of a Beta, ``f(loc)`` of a squashed Normal, the mode of a discrete
    distribution, each part's of a composite."""
    if isinstance(dist, samplers.Composite):
        return jax.tree.map(_deterministic_action, dist.parts, is_leaf=_is_distribution)
    if isinstance(dist, samplers.SquashedBeta):
        return dist.mean()
    if isinstance(dist, (samplers.SquashedNormal, samplers.SquashedFlow)):
        return dist.deterministic_action()
    return dist.mode()


def _is_distribution(x):
    return isinstance(x, distrax.Distribution)


@pytest.mark.parametrize("make", CASES)
def test_the_deterministic_data_is_the_documented_action(make):
    dist = make()
    action, _ = dist.replay(dist.deterministic_replay_data())
    _equal(action, _deterministic_action(dist))


# One class per default run: the composite's parts sample each row from its key alike.
# (A flow, whose layers may close over the whole batch, cannot be indexed.)
@pytest.mark.parametrize(
    "make",
    [
        pytest.param(make, id=name) if name == "composite" else slow(make, id=name)
        for name, make in MAKERS.items()
        if name != "flow"
    ],
)
def test_one_key_per_batch_element_draws_each_row_from_its_own_key(make):
    keys = jax.random.split(jax.random.key(1), 6).reshape(2, 3)
    data = jax.jit(lambda keys: make(batch=(2, 3)).sample_replay_data(seed=keys))(keys)
    # The last row alone, drawn from its own key, is the same row of the whole.
    alone = jax.jit(lambda k: make(batch=(2, 3))[1, 2:].sample_replay_data(seed=k))(keys[1, 2:])
    _equal(jax.tree.map(lambda x: x[1, 2:], data), alone)
    with pytest.raises(ValueError, match="one key per batch element"):
        jax.jit(lambda keys: make(batch=(2, 3)).sample_replay_data(seed=keys))(keys[0])


@pytest.mark.parametrize("make", CASES)
def test_stored_data_of_another_shape_or_kind_is_refused(make):
    dist = make()
    data = dist.sample_replay_data(seed=jax.random.key(2))
    first = jax.tree.leaves(data)[0]
    with pytest.raises((ValueError, TypeError), match="replay data"):
        dist.check_replay_data(jax.tree.map(lambda x: x[:-1], data))
    wrong = jnp.float16 if jnp.issubdtype(first.dtype, jnp.floating) else jnp.float32
    with pytest.raises(TypeError, match="replay data"):
        dist.check_replay_data(jax.tree.map(lambda x: x.astype(wrong), data))


def test_replayed_log_probs_and_gradients_match_float64_formulas():
    """The squashed Normal and the Beta from their pre-images, the categorical from its
    action: value and gradient with respect to every parameter and the pre-image."""
    mean, raw_std = np.split(np.asarray(_params(0, 2 * A), np.float64), 2, -1)
    x = 0.5 + 3.0 * np.asarray(_params(7, A), np.float64)  # saturated ones included
    std = softplus_std_float64(raw_std)

    def normal_tanh(m, s, x):
        return samplers.normal_tanh(jnp.concatenate([m, s], -1)).replay(x)[1].sum()

    expected = tanh_normal_log_prob_float64(x, mean, std).sum()
    args = [jnp.asarray(v, jnp.float32) for v in (mean, raw_std, x)]
    # Each score and its gradients compiled as one program, as a loss pass is.
    value, grads = jax.jit(jax.value_and_grad(normal_tanh, argnums=(0, 1, 2)))(*args)
    np.testing.assert_allclose(value, expected, rtol=2e-6)
    dx = -(x - mean) / std**2 + 2 * np.tanh(x)
    dm = (x - mean) / std**2
    ds = ((x - mean) ** 2 / std**3 - 1 / std) * special.expit(raw_std)
    for got, want in zip(grads, (dm, ds, dx), strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)

    a, b = 1.0 + np.logaddexp(0.0, np.split(np.asarray(_params(2, 2 * A), np.float64), 2, -1))
    z = np.asarray(_params(8, A), np.float64) * 4.0

    def beta(params, z):
        return samplers.squashed_beta(params, -1.0, 2.0).replay(z)[1].sum()

    u = special.expit(z)  # the density of the action -1 + 3u, not of z
    expected = np.sum(stats.beta.logpdf(u, a, b) - np.log(3.0), -1).sum()
    params, z32 = _params(2, 2 * A), jnp.asarray(z, jnp.float32)
    value, (d_params, d_z) = jax.jit(jax.value_and_grad(beta, argnums=(0, 1)))(params, z32)
    np.testing.assert_allclose(value, expected, rtol=1e-5)
    dz = (a - 1) * (1 - u) - (b - 1) * u
    np.testing.assert_allclose(d_z, dz, rtol=1e-4, atol=1e-4)
    # d/d raw_a of log p = (log u - digamma(a) + digamma(a + b)) * sigmoid(raw_a).
    raw_a = np.split(np.asarray(params, np.float64), 2, -1)[0]
    da = (np.log(u) - special.digamma(a) + special.digamma(a + b)) * special.expit(raw_a)
    np.testing.assert_allclose(d_params[:, :A], da, rtol=1e-4, atol=1e-4)

    logits = np.asarray(_params(3, 4), np.float64)
    action = np.array([0, 2, 3, 0, 2, 3])
    mask = np.ones((B, 4), bool)
    mask[:, 1] = False

    def categorical(logits):
        return samplers.MaskedCategorical(logits, mask).replay(action)[1].sum()

    log_p = masked_log_softmax_float64(logits, mask)
    np.testing.assert_allclose(
        categorical(jnp.asarray(logits, jnp.float32)),
        log_p[np.arange(B), action].sum(),
        rtol=1e-6,
    )
    grad = np.where(mask, np.eye(4)[action] - np.exp(log_p), 0.0)
    np.testing.assert_allclose(
        jax.grad(categorical)(jnp.asarray(logits, jnp.float32)), grad, atol=1e-6
    )


def test_the_functions_replay_any_distrax_distribution_by_its_action():
    dist = distrax.Independent(distrax.Normal(jnp.zeros((B, A)), jnp.ones((B, A))), 1)
    data = replay.sample_replay_data(dist, jax.random.key(3))
    action, log_prob = replay.replay(dist, replay.check_replay_data(dist, data))
    _equal(action, data)
    _equal(log_prob, dist.log_prob(data))
    _equal(replay.deterministic_replay_data(dist), dist.mode())
    with pytest.raises(ValueError, match=r"needs a samplers\.Replayable distribution"):
        replay.sample_replay_data(dist, jax.random.split(jax.random.key(3), B))
    with pytest.raises(TypeError, match="replay data must have a floating dtype"):
        replay.check_replay_data(dist, jnp.zeros((B, A), jnp.int32))
