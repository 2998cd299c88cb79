"""The flow distribution against outside references: a float64 formula written here,
distrax's ``Transformed`` and TFP's ``RealNVP`` built from the same layers, finite
differences; the replay's gradient, that of the log-density of the action taken; the
replay on saturated samples, where the inverse path is NaN."""

import distrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tensorflow_probability.substrates import jax as tfp

import samplers
from tests._tiers import slow

tfb, tfd = tfp.bijectors, tfp.distributions

B, A, F = 16, 3, 2
# Layer k keeps the first KEPT[k] dimensions (TFP's RealNVP keeps a prefix) and moves
# the others by an affine map whose shift and log-scale are linear in what it keeps
# and in the features.
KEPT = (2, 1)


def _weights(seed, on_action=0.2):
    """Per layer, the weights on the kept dimensions, on the features, and the bias."""
    rng = np.random.default_rng(seed)
    return [
        (
            rng.normal(size=(A, A, 2)) * on_action,
            rng.normal(size=(F, A, 2)) * 0.3,
            rng.normal(size=(A, 2)) * 0.2,
        )
        for _ in KEPT
    ]


def _keep(kept):
    return np.arange(A) < kept


def _affine_layers(weights, features):
    """The layers as distrax ``MaskedCoupling``s."""
    layers = []
    for kept, (w, v, b) in zip(KEPT, weights, strict=True):

        def conditioner(x, w=w, v=v, b=b):
            seen = jnp.broadcast_to(features, (*x.shape[:-1], F))
            p = jnp.einsum("...i,ijk->...jk", x, w) + jnp.einsum("...i,ijk->...jk", seen, v)
            return p + jnp.broadcast_to(b, p.shape)

        layers.append(
            distrax.MaskedCoupling(
                jnp.asarray(_keep(kept)),
                conditioner,
                lambda p: distrax.ScalarAffine(shift=p[..., 0], log_scale=p[..., 1]),
            )
        )
    return layers


def _float64_log_prob(x0, loc, scale, weights, features):
    """``(log N(x0) - sum log-scales - sum log(1 - tanh(x_K)^2), tanh(x_K), x_K)`` for
    the base draw ``x0``, forward through the layers, in numpy float64."""
    log_prob = np.sum(
        -0.5 * ((x0 - loc) / scale) ** 2 - np.log(scale) - 0.5 * np.log(2 * np.pi), -1
    )
    x = x0
    for kept, (w, v, b) in zip(KEPT, weights, strict=True):
        keep = _keep(kept)
        p = (
            np.einsum("...i,ijk->...jk", np.where(keep, x, 0.0), w)
            + np.einsum("...i,ijk->...jk", features, v)
            + b
        )
        moved = x * np.exp(p[..., 1]) + p[..., 0]
        x = np.where(keep, x, moved)
        log_prob -= np.sum(np.where(keep, 0.0, p[..., 1]), -1)
    log_det_tanh = np.log(4.0) - 2.0 * np.logaddexp(x, -x)
    return log_prob - np.sum(log_det_tanh, -1), np.tanh(x), x


def _float64_base_draw(x_k, weights, features):
    """``x0`` for the squashing's pre-image ``x_K``: the layers inverted, last first."""
    x = x_k
    for kept, (w, v, b) in reversed(list(zip(KEPT, weights, strict=True))):
        keep = _keep(kept)
        p = (
            np.einsum("...i,ijk->...jk", np.where(keep, x, 0.0), w)
            + np.einsum("...i,ijk->...jk", features, v)
            + b
        )
        x = np.where(keep, x, (x - p[..., 0]) * np.exp(-p[..., 1]))
    return x


def _base_and_features(seed, spread=1.0):
    rng = np.random.default_rng(seed)
    loc = rng.normal(size=(B, A)) * spread
    scale = np.exp(rng.normal(size=(B, A)) * 0.5)
    features = rng.normal(size=(B, F))
    x0 = loc + scale * rng.normal(size=(B, A))
    return loc, scale, features, x0


def _flow(loc, scale, weights, features, dtype=jnp.float32):
    cast = [tuple(jnp.asarray(a, dtype) for a in layer) for layer in weights]
    return samplers.SquashedFlow(
        jnp.asarray(loc, dtype),
        jnp.asarray(scale, dtype),
        _affine_layers(cast, jnp.asarray(features, dtype)),
    )


def test_log_prob_matches_a_float64_formula_distrax_and_tfp():
    loc, scale, features, x0 = _base_and_features(0, spread=0.5)
    x0 = x0 / 2
    weights = _weights(1, on_action=0.1)
    expected, action64, x_k = _float64_log_prob(x0, loc, scale, weights, features)
    assert np.all(np.abs(x_k) < 4)  # away from saturation: every inverse finite
    np.testing.assert_allclose(_float64_base_draw(x_k, weights, features), x0, rtol=1e-12)
    dist = _flow(loc, scale, weights, features)
    action, log_prob = dist.forward_and_log_prob(jnp.asarray(x_k, jnp.float32))
    np.testing.assert_allclose(log_prob, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(action, action64, atol=2e-6)
    # distrax's Transformed of the same layers, built here, scores the action
    # through the inverses.
    f32 = [tuple(jnp.asarray(a, jnp.float32) for a in w) for w in weights]
    layers = _affine_layers(f32, jnp.asarray(features, jnp.float32))
    base = distrax.Independent(
        distrax.Normal(jnp.asarray(loc, jnp.float32), jnp.asarray(scale, jnp.float32)), 1
    )
    theirs = distrax.Transformed(
        base, distrax.Chain([distrax.Block(distrax.Tanh(), 1), *reversed(layers)])
    )
    np.testing.assert_allclose(theirs.log_prob(action), expected, rtol=1e-5, atol=1e-5)
    # TFP's RealNVP keeps the first num_masked dimensions, as the layers here do.
    feats = jnp.asarray(features, jnp.float32)

    def real_nvp(kept, w, v, b):
        def shift_and_log_scale(x, units):
            p = jnp.einsum("...i,ijk->...jk", x, w[:kept]) + jnp.einsum("...i,ijk->...jk", feats, v)
            p = p + jnp.broadcast_to(b, p.shape)
            return p[..., kept:, 0], p[..., kept:, 1]

        return tfb.RealNVP(num_masked=kept, shift_and_log_scale_fn=shift_and_log_scale)

    chain = tfb.Chain(
        [tfb.Tanh(), *(real_nvp(k, *w) for k, w in reversed(list(zip(KEPT, f32, strict=True))))]
    )
    tfp_dist = tfd.TransformedDistribution(
        tfd.Independent(tfd.Normal(base.distribution.loc, base.distribution.scale), 1), chain
    )
    with jax.numpy_rank_promotion("allow"):  # TFP's RealNVP broadcasts implicitly
        tfp_log_prob = tfp_dist.log_prob(action)
    np.testing.assert_allclose(tfp_log_prob, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_spline_layers_score_as_distrax_transformed_scores_through_the_inverses():
    loc, scale, features, x0 = _base_and_features(15, spread=0.5)
    x0 = x0 / 2
    rng = np.random.default_rng(16)
    bins = 8
    weights = [
        jnp.asarray(rng.normal(size=(A + F, A, 3 * bins + 1)) * 0.2, jnp.float32) for _ in KEPT
    ]
    feats = jnp.asarray(features, jnp.float32)

    def layers():
        made = []
        for kept, w in zip(KEPT, weights, strict=True):

            def conditioner(x, w=w):
                seen = jnp.concatenate([x, jnp.broadcast_to(feats, (*x.shape[:-1], F))], -1)
                return jnp.einsum("...i,ijk->...jk", seen, w)

            made.append(
                distrax.MaskedCoupling(
                    jnp.asarray(_keep(kept)),
                    conditioner,
                    lambda p: distrax.RationalQuadraticSpline(
                        p, -5.0, 5.0, boundary_slopes="identity"
                    ),
                )
            )
        return made

    loc32, scale32 = jnp.asarray(loc, jnp.float32), jnp.asarray(scale, jnp.float32)
    dist = samplers.SquashedFlow(loc32, scale32, layers())
    action, log_prob = dist.forward_and_log_prob(jnp.asarray(x0, jnp.float32))
    assert np.all(np.abs(np.asarray(action)) < 0.995)
    base = distrax.Independent(distrax.Normal(loc32, scale32), 1)
    theirs = distrax.Transformed(
        base, distrax.Chain([distrax.Block(distrax.Tanh(), 1), *reversed(layers())])
    )
    np.testing.assert_allclose(theirs.log_prob(np.array(action)), log_prob, rtol=1e-5, atol=1e-5)
    # The splines moved the sample: this is not the squashed Normal.
    plain = samplers.squashed_normal_from_std(loc32, scale32).log_prob_from_pre_image(
        jnp.asarray(x0, jnp.float32)
    )
    assert np.max(np.abs(plain - log_prob)) > 0.1


def test_a_saturated_sample_replays_exactly_where_the_inverse_path_is_not_finite():
    loc, scale, features, _ = _base_and_features(2)
    loc = loc + 60.0  # tanh rounds to 1 in float32, after the layers too
    # The layers see the features alone, so they keep the sample saturated.
    dist = _flow(loc, scale, _weights(3, on_action=0.0), features)
    action, pre_image, log_prob = dist.sample_with_replay(seed=jax.random.key(0))
    assert np.all(np.abs(np.asarray(action)) == 1.0)
    assert np.all(np.isfinite(log_prob))
    stored = np.array(pre_image)
    replayed = dist.replay(dist.check_replay_data(stored))[1]
    np.testing.assert_array_equal(np.exp(replayed - log_prob), 1.0)  # the first PPO ratio
    np.testing.assert_array_equal(dist.log_prob(action), log_prob)  # the distrax idiom
    # An equal copy of the action is scored through the inverses: not finite, never
    # a plausible number.
    assert not np.any(np.isfinite(dist.log_prob(np.array(action))))
    weights = _weights(3, on_action=0.0)
    x0 = _float64_base_draw(np.asarray(stored, np.float64), weights, features)
    expected, _, _ = _float64_log_prob(x0, loc, scale, weights, features)
    np.testing.assert_allclose(log_prob, expected, rtol=1e-5)


@pytest.mark.parametrize("num_layers", [1, slow(2, id="2")])
def test_the_rollout_runs_the_last_conditioner_once_and_replays_bit_for_bit(num_layers):
    """The last coupling's conditioner sees the dimensions that coupling keeps: the
    same bits on the way out and back, so a rollout evaluates it once. The layers
    below it are inverted as a replay inverts them: the replay, in the rollout's
    program or in its own, is the rollout's score bit for bit."""
    loc, scale, features, _ = _base_and_features(4)
    weights = _weights(5)
    calls = [0] * num_layers

    def flow(loc, scale, features):
        layers = []
        for index, layer in enumerate(_affine_layers(weights, features)[:num_layers]):

            def counted(x, index=index, conditioner=layer.conditioner):
                calls[index] += 1
                return conditioner(x)

            layers.append(distrax.MaskedCoupling(layer.mask, counted, layer.bijector))
        return samplers.SquashedFlow(loc, scale, layers)

    args = [jnp.asarray(a, jnp.float32) for a in (loc, scale, features)]
    dist = flow(*args)
    action, pre_image, log_prob = dist.sample_with_replay(seed=jax.random.key(0))
    assert calls == [2] * (num_layers - 1) + [1]
    np.testing.assert_array_equal(pre_image, dist.sample_pre_image(seed=jax.random.key(0)))
    np.testing.assert_array_equal(action, jnp.tanh(pre_image))
    stored = np.array(pre_image)
    np.testing.assert_array_equal(dist.replay(stored)[1], log_prob)

    def rollout(loc, scale, features, key):
        return flow(loc, scale, features).sample_with_replay(seed=key)

    def replay(loc, scale, features, stored):
        return flow(loc, scale, features).replay(stored)[1]

    def both(loc, scale, features, key):
        _, pre_image, log_prob = rollout(loc, scale, features, key)
        return log_prob, replay(loc, scale, features, pre_image)

    key = jax.random.key(1)
    _, stored, log_prob = jax.jit(rollout)(*args, key)
    np.testing.assert_array_equal(jax.jit(replay)(*args, np.array(stored)), log_prob)
    np.testing.assert_array_equal(*jax.jit(both)(*args, key))

    # A rollout's draw is a constant (reparameterized=False): the gradient is the
    # replay's of the stored x_K, not the pathwise one through the draw.
    def score(loc, features, reparameterized):
        dist = flow(loc, args[1], features)
        return dist.sample_with_replay(seed=key, reparameterized=reparameterized)[2].sum()

    def replayed(loc, features):
        return replay(loc, args[1], features, stored).sum()

    wrt = (args[0], args[2])  # loc, and the features the conditioners see
    expected = jax.grad(replayed, argnums=(0, 1))(*wrt)
    for reparameterized in (False, True):
        got = jax.grad(score, argnums=(0, 1))(*wrt, reparameterized)
        for g, e in zip(got, expected, strict=True):
            if reparameterized:
                assert np.max(np.abs(g - e)) > 1e-2
            else:
                np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)
    # And the score is the density: the float64 layers, inverted from the stored x_K.
    cut = [w if k < num_layers else (0 * w[0], 0 * w[1], 0 * w[2]) for k, w in enumerate(weights)]
    x0 = _float64_base_draw(np.asarray(stored, np.float64), cut, features)
    expected, _, _ = _float64_log_prob(x0, loc, scale, cut, features)
    np.testing.assert_allclose(log_prob, expected, rtol=1e-5, atol=1e-5)  # float32 terms


def test_the_replay_gradient_is_that_of_the_log_density_of_the_action_taken():
    """For a stored pre-image, with respect to the base, the conditioners' weights and
    the features: distrax's inverse-path score of the fixed action, in float64."""
    loc, scale, features, x0 = _base_and_features(17, spread=0.5)
    weights = _weights(18)
    _, _, x_k = _float64_log_prob(x0 / 2, loc, scale, weights, features)
    assert np.all(np.abs(x_k) < 4)
    with jax.enable_x64(True):
        action = jnp.tanh(jnp.asarray(x_k))

        def ours(loc, scale, w0, feats):
            layers = [(w0, *weights[0][1:]), *weights[1:]]
            return _flow(loc, scale, layers, feats, jnp.float64).log_prob_from_pre_image(x_k).sum()

        def theirs(loc, scale, w0, feats):
            cast = [(w0, *weights[0][1:]), *weights[1:]]
            cast = [tuple(jnp.asarray(a) for a in layer) for layer in cast]
            base = distrax.Independent(distrax.Normal(loc, scale), 1)
            chain = [distrax.Block(distrax.Tanh(), 1), *reversed(_affine_layers(cast, feats))]
            return distrax.Transformed(base, distrax.Chain(chain)).log_prob(action).sum()

        args = [jnp.asarray(a) for a in (loc, scale, weights[0][0], features)]
        # Each score and its gradients compiled as one program, as a loss pass is.
        value, got = jax.jit(jax.value_and_grad(ours, argnums=(0, 1, 2, 3)))(*args)
        expected, want = jax.jit(jax.value_and_grad(theirs, argnums=(0, 1, 2, 3)))(*args)
        np.testing.assert_allclose(value, expected, rtol=1e-9)
        for name, g, w in zip(("loc", "scale", "weights", "features"), got, want, strict=True):
            assert np.max(np.abs(w)) > 1e-3, name  # each moves the score
            np.testing.assert_allclose(g, w, rtol=1e-8, atol=1e-10, err_msg=name)


@pytest.mark.parametrize("shift", [0.0, 60.0], ids=["inside", "saturated"])
def test_a_fresh_draw_scored_forward_is_the_float64_density(shift):
    """``sample_and_log_prob`` scores a draw forward: its value is the float64 formula
    at the same base draw, in float32 (``1e-5`` relative plus ``1e-5``) and in float64
    (``1e-12``), finite where the action rounded onto a bound."""
    loc, scale, features, _ = _base_and_features(19, spread=0.5)
    loc = loc + shift
    weights = _weights(20, on_action=0.0 if shift else 0.2)
    key = jax.random.key(21)
    for dtype, rtol, atol in ((jnp.float32, 1e-5, 1e-5), (jnp.float64, 1e-12, 1e-12)):
        with jax.enable_x64(dtype == jnp.float64):
            dist = _flow(loc, scale, weights, features, dtype)
            action, log_prob = dist.sample_and_log_prob(seed=key)
            eps = np.asarray(jax.random.normal(key, loc.shape, dtype), np.float64)
        x0 = loc + scale * eps
        expected, action64, _ = _float64_log_prob(x0, loc, scale, weights, features)
        assert np.all(np.isfinite(np.asarray(log_prob)))
        np.testing.assert_allclose(log_prob, expected, rtol=rtol, atol=atol)
        np.testing.assert_allclose(action, action64, rtol=rtol, atol=atol)
    if shift:
        assert np.all(np.abs(np.asarray(action, np.float64)) == 1.0)  # float64 saturates


@pytest.mark.slow
def test_a_fresh_draw_scored_forward_is_distrax_s_and_the_inverse_path_s_with_gradients():
    """In float64, ``sample_and_log_prob``'s value and the gradients of a SAC actor loss
    on it (loc, scale, a conditioner's weights, the features) are those of distrax's
    own ``Transformed.sample_and_log_prob`` of the same layers, and of the inverse-path
    score of the same ``x_K``."""
    loc, scale, features, _ = _base_and_features(19, spread=0.5)
    weights = _weights(20)
    key = jax.random.key(21)
    with jax.enable_x64(True):

        def ours(loc, scale, w0, feats):
            layers = [(w0, *weights[0][1:]), *weights[1:]]
            return _flow(loc, scale, layers, feats, jnp.float64).sample_and_log_prob(seed=key)

        def through_the_inverse(loc, scale, w0, feats):
            dist = _flow(loc, scale, [(w0, *weights[0][1:]), *weights[1:]], feats, jnp.float64)
            x_k = dist.sample_pre_image(seed=key)
            return dist.forward_and_log_prob(x_k)

        def theirs(loc, scale, w0, feats):
            cast = [(w0, *weights[0][1:]), *weights[1:]]
            cast = [tuple(jnp.asarray(a) for a in layer) for layer in cast]
            base = distrax.Independent(distrax.Normal(loc, scale), 1)
            chain = [distrax.Block(distrax.Tanh(), 1), *reversed(_affine_layers(cast, feats))]
            theirs = distrax.Transformed(base, distrax.Chain(chain))
            with jax.numpy_rank_promotion("allow"):  # distrax broadcasts implicitly
                return theirs.sample_and_log_prob(seed=key)

        def objective(step):  # a SAC actor loss: alpha log pi(a) - Q(a)
            def loss(*args):
                action, log_prob = step(*args)
                return jnp.sum(0.2 * log_prob - jnp.sum((action - 0.3) ** 2, -1))

            return loss

        args = [jnp.asarray(a) for a in (loc, scale, weights[0][0], features)]
        got = ours(*args)
        for other in (theirs, through_the_inverse):
            for g, w in zip(got, other(*args), strict=True):
                np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)
            grads = jax.grad(objective(ours), argnums=(0, 1, 2, 3))(*args)
            want = jax.grad(objective(other), argnums=(0, 1, 2, 3))(*args)
            names = ("loc", "scale", "weights", "features")
            for name, g, w in zip(names, grads, want, strict=True):
                assert np.max(np.abs(w)) > 1e-3, name
                np.testing.assert_allclose(g, w, rtol=1e-8, atol=1e-10, err_msg=name)


@pytest.mark.slow
def test_gradients_match_float64_central_differences():
    loc, scale, features, x0 = _base_and_features(4)
    weights = _weights(5)
    with jax.enable_x64(True):

        def total(loc, scale, x_k, w0):
            layers = [(w0, *weights[0][1:]), *weights[1:]]
            dist = _flow(loc, scale, layers, features, jnp.float64)
            return dist.log_prob_from_pre_image(x_k).sum()

        args = [jnp.asarray(a) for a in (loc, scale, x0, weights[0][0])]
        grads = jax.grad(total, argnums=(0, 1, 2, 3))(*args)
        for index, grad in enumerate(grads):
            value = np.asarray(args[index])
            step = 1e-6
            numeric = np.zeros_like(value)
            for i in np.ndindex(value.shape):
                up, down = value.copy(), value.copy()
                up[i] += step
                down[i] -= step
                moved = [*args]
                moved[index] = jnp.asarray(up)
                high = total(*moved)
                moved[index] = jnp.asarray(down)
                numeric[i] = (high - total(*moved)) / (2 * step)
            np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-6)


def test_without_layers_it_is_the_squashed_normal():
    loc, scale, _, x0 = _base_and_features(6, spread=4.0)
    loc32, scale32, x32 = (jnp.asarray(a, jnp.float32) for a in (loc, scale, x0))
    flow = samplers.SquashedFlow(loc32, scale32)
    normal = samplers.squashed_normal_from_std(loc32, scale32)
    np.testing.assert_allclose(
        flow.log_prob_from_pre_image(x32), normal.log_prob_from_pre_image(x32), rtol=1e-6
    )
    key = jax.random.key(7)
    np.testing.assert_array_equal(
        flow.sample_pre_image(seed=key), normal.sample_pre_image(seed=key)
    )
    np.testing.assert_allclose(
        flow.entropy_estimate(seed=key, num_samples=3),
        normal.entropy_estimate(seed=key, num_samples=3),
        rtol=1e-6,
    )


@pytest.mark.slow
def test_the_entropy_estimate_is_unbiased():
    """With layers that see the features alone, the flow is an elementwise affine map of
    the Normal: a squashed Normal, whose exact entropy is the oracle."""
    loc, scale, features, _ = _base_and_features(8)
    rng = np.random.default_rng(9)
    weights = [
        (np.zeros((A, A, 2)), rng.normal(size=(F, A, 2)) * 0.4, rng.normal(size=(A, 2)) * 0.3)
        for _ in KEPT
    ]
    dist = _flow(loc, scale, weights, features)
    n = 20000
    estimates = jax.vmap(lambda k: dist.entropy_estimate(seed=k))(
        jax.random.split(jax.random.key(10), n)
    )
    # The same map in closed form: x -> x * exp(ls) + sh on the dimensions each layer moves.
    mean, std = loc.copy(), scale.copy()
    for kept, (_, v, b) in zip(KEPT, weights, strict=True):
        p = np.einsum("...i,ijk->...jk", features, v) + b
        moved = ~_keep(kept)
        mean = np.where(moved, mean * np.exp(p[..., 1]) + p[..., 0], mean)
        std = np.where(moved, std * np.exp(p[..., 1]), std)
    with jax.enable_x64(True):
        exact = np.asarray(
            samplers.squashed_normal_from_std(jnp.asarray(mean), jnp.asarray(std)).entropy()
        )
    error = np.asarray(estimates, np.float64).mean(0) - exact
    standard_error = np.asarray(estimates, np.float64).std(0) / np.sqrt(n)
    assert np.all(np.abs(error) < 4.5 * standard_error + 1e-5), (error, standard_error)
    # The single-draw estimate's spread is real: it is an estimate, not the entropy.
    assert np.all(standard_error > 0)


def test_what_a_flow_does_not_have_is_refused_with_the_fix():
    loc, scale, features, _ = _base_and_features(11)
    dist = _flow(loc, scale, _weights(12), features)
    with pytest.raises(NotImplementedError, match="entropy_estimate"):
        dist.entropy()
    with pytest.raises(NotImplementedError, match="cannot be indexed"):
        dist[0]
    with pytest.raises(
        TypeError, match=r"layers\[0\] must be a distrax bijector on the action vector"
    ):
        samplers.SquashedFlow(jnp.zeros(2), jnp.ones(2), [distrax.Tanh()])
    with pytest.raises(ValueError, match="same shape"):
        samplers.SquashedFlow(jnp.zeros(2), jnp.ones(3))
    with pytest.raises(ValueError, match="elementwise"):
        samplers.SquashedFlow(jnp.zeros(2), jnp.ones(2), (), distrax.Block(distrax.Tanh(), 1))
    with pytest.raises(ValueError, match="replay data"):
        dist.check_replay_data(np.zeros((B, A + 1), np.float32))


@pytest.mark.parametrize("spread", [0.5, slow(3.0, id="3.0")])
def test_a_stored_action_away_from_the_bounds_scores_through_the_inverses(spread):
    loc, scale, features, x0 = _base_and_features(13, spread)
    dist = _flow(loc, scale, _weights(14), features)
    action, log_prob = dist.forward_and_log_prob(jnp.asarray(x0, jnp.float32))
    inner = np.abs(np.asarray(action)) < 0.99
    copy = np.array(action)
    np.testing.assert_allclose(
        np.asarray(dist.log_prob(copy))[inner.all(-1)],
        np.asarray(log_prob)[inner.all(-1)],
        rtol=1e-4,
        atol=1e-4,
    )


def _normal_equivalent(loc, scale, weights, features):
    """The mean and std of the Normal that layers seeing the features alone make of
    ``N(loc, scale)``: each moved dimension goes through ``x * exp(ls) + sh``."""
    mean, std = jnp.asarray(loc), jnp.asarray(scale)
    for kept, (_, v, b) in zip(KEPT, weights, strict=True):
        p = jnp.einsum("...i,ijk->...jk", features, v)
        p = p + jnp.broadcast_to(b, p.shape)
        moved = ~_keep(kept)
        mean = jnp.where(moved, mean * jnp.exp(p[..., 1]) + p[..., 0], mean)
        std = jnp.where(moved, std * jnp.exp(p[..., 1]), std)
    return mean, std


@pytest.mark.slow
def test_the_kl_estimate_is_unbiased_for_the_kl_of_two_flows():
    """With layers that see the features alone each flow is a squashed Normal, and the KL
    of two with one squashing is that of the Normals, in closed form: the oracle for the
    estimate's mean and for the mean of its gradient with respect to the second flow."""
    loc, scale, features, _ = _base_and_features(19)
    rng = np.random.default_rng(20)
    p_weights = [
        (np.zeros((A, A, 2)), rng.normal(size=(F, A, 2)) * 0.3, rng.normal(size=(A, 2)) * 0.3)
        for _ in KEPT
    ]
    q_weights = [(w, v + rng.normal(size=v.shape) * 0.05, b) for w, v, b in p_weights]
    q_loc = loc + rng.normal(size=loc.shape) * 0.15
    p = _flow(loc, scale, p_weights, features)
    n = 2000

    def estimate(q_loc, key):
        return p.kl_divergence(_flow(q_loc, scale, q_weights, features), seed=key).sum()

    keys = jax.random.split(jax.random.key(21), n)
    values, grads = jax.vmap(jax.value_and_grad(estimate), in_axes=(None, 0))(
        jnp.asarray(q_loc, jnp.float32), keys
    )
    with jax.enable_x64(True):
        mean_p, std_p = _normal_equivalent(loc, scale, p_weights, features)

        def exact(q_loc):
            mean_q, std_q = _normal_equivalent(q_loc, scale, q_weights, features)
            normal_p = samplers.squashed_normal_from_std(mean_p, std_p)
            return normal_p.kl_divergence(samplers.squashed_normal_from_std(mean_q, std_q)).sum()

        kl, grad = jax.value_and_grad(exact)(jnp.asarray(q_loc))
        kl, grad = float(kl), np.asarray(grad)
    values, grads = np.asarray(values, np.float64), np.asarray(grads, np.float64)
    assert kl > 0.5  # the flows differ (summed over the batch)
    assert abs(values.mean() - kl) < 4.5 * values.std() / np.sqrt(n)
    error = np.abs(grads.mean(0) - grad)
    z = error / (grads.std(0) / np.sqrt(n))
    assert np.all(z < 4.5), (z.max(), np.unravel_index(z.argmax(), z.shape), grad)
    # The same flow: exactly 0, and num_samples averages the draws.
    np.testing.assert_array_equal(p.kl_divergence(p, seed=0, num_samples=3), 0.0)


def test_the_kl_without_a_key_or_between_other_maps_is_refused_with_the_fix():
    loc, scale, features, _ = _base_and_features(22)
    p = _flow(loc, scale, _weights(23), features)
    q = _flow(loc, scale, _weights(24), features)
    with pytest.raises(NotImplementedError, match=r"p\.kl_divergence\(q, seed=key"):
        p.kl_divergence(q)
    with pytest.raises(NotImplementedError, match="no closed form"):
        tfd.kl_divergence(p, q)
    with pytest.raises(TypeError, match="needs another SquashedFlow"):
        p.kl_divergence(samplers.normal_tanh(jnp.zeros((B, 2 * A))), seed=0)
    other = samplers.SquashedFlow(p.loc, p.scale, bijector=samplers.Sigmoid())
    with pytest.raises(ValueError, match="must share their squashing"):
        p.kl_divergence(other, seed=0)
    with pytest.raises(ValueError, match="same shape"):
        p.kl_divergence(samplers.SquashedFlow(p.loc[:2], p.scale[:2]), seed=0)
