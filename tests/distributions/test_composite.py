"""``Composite`` and ``Parameterized`` against float64 formulas written here.

The parts are a categorical (closed forms in NumPy) and squashed Normals, whose
log-densities come from their pre-images in float64 and whose KL is the base Normals'
(the squashing changes none of it). Checked: the per-part and summed log-probabilities
of samples and of stored data, the entropy, the registered KL, their gradients, the
keys of the parts, the structure of nested parts, and the refusals.
"""

import zlib

import distrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import samplers
from tests.reference import (
    categorical_entropy_float64,
    masked_log_softmax_float64,
    tanh_normal_log_prob_float64,
)

B = 5


def _logits(seed, n=3):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(B, n)), jnp.float32)


def _normal(seed, action=2):
    return samplers.normal_tanh(_logits(seed, 2 * action))


def _normal_kl(p, q):
    """float64 KL of the base diagonal Normals, summed over the action."""
    m1, s1, m2, s2 = (np.asarray(v, np.float64) for v in (p.loc, p.scale, q.loc, q.scale))
    return np.sum(np.log(s2 / s1) + (s1**2 + (m1 - m2) ** 2) / (2 * s2**2) - 0.5, -1)


def test_a_composite_scores_each_part_and_sums_them_in_the_given_order():
    fire = samplers.MaskedCategorical(_logits(0))
    move = _normal(1)
    dist = samplers.Composite({"move": move, "fire": fire})
    assert list(dist.parts) == ["move", "fire"] and dist.batch_shape == (B,)
    action, data, log_prob = dist.sample_with_replay(seed=jax.random.key(0))
    parts = dist.log_prob_parts(action)
    expected_fire = masked_log_softmax_float64(_logits(0))[np.arange(B), np.asarray(action["fire"])]
    np.testing.assert_allclose(parts["fire"], expected_fire, rtol=1e-6)
    np.testing.assert_allclose(
        parts["move"], tanh_normal_log_prob_float64(data["move"], move.loc, move.scale), rtol=1e-5
    )
    np.testing.assert_array_equal(log_prob, parts["move"] + parts["fire"])
    np.testing.assert_array_equal(dist.log_prob(action), log_prob)
    _, replay_parts = dist.replay_parts(data)
    np.testing.assert_array_equal(replay_parts["move"], parts["move"])
    # Each part drew from the key of its name; another part's presence changes nothing.
    key = jax.random.key(0)
    move_key = jax.random.fold_in(key, zlib.crc32(b"move"))
    np.testing.assert_array_equal(data["move"], move.sample_pre_image(seed=move_key))
    alone = samplers.Composite({"move": move}).sample_replay_data(seed=key)
    np.testing.assert_array_equal(alone["move"], data["move"])
    # distrax's sample is the same draw, for a typed key, a raw PRNGKey and an integer
    # seed alike (distrax takes all three).
    for seed in (key, jax.random.PRNGKey(0), 0):
        np.testing.assert_array_equal(dist.sample(seed=seed)["fire"], action["fire"])
        np.testing.assert_array_equal(dist.sample_replay_data(seed=seed)["move"], data["move"])


def test_the_entropy_and_the_registered_kl_are_the_sums_of_the_parts():
    p = samplers.Composite((samplers.MaskedCategorical(_logits(0)), (_normal(1),)))
    q = samplers.Composite((samplers.MaskedCategorical(_logits(2)), (_normal(3),)))
    log_p, log_q = masked_log_softmax_float64(_logits(0)), masked_log_softmax_float64(_logits(2))
    categorical_kl = np.sum(np.exp(log_p) * (log_p - log_q), -1)
    p_normal, q_normal = p.parts[1][0], q.parts[1][0]
    np.testing.assert_allclose(
        distrax.Distribution.kl_divergence(p, q),
        categorical_kl + _normal_kl(p_normal, q_normal),
        rtol=1e-5,
    )
    np.testing.assert_array_equal(p.kl_divergence(p), np.zeros(B))
    np.testing.assert_allclose(
        p.entropy(), categorical_entropy_float64(log_p) + np.asarray(p_normal.entropy()), rtol=1e-6
    )
    other = samplers.Composite({"a": samplers.MaskedCategorical(_logits(0)), "b": _normal(1)})
    with pytest.raises(ValueError, match="the same parts in the same structure"):
        p.kl_divergence(other)


def _parameterized(seed, mask=None):
    return samplers.Parameterized(
        samplers.MaskedCategorical(_logits(seed, 2), mask),
        (_normal(seed + 1, 1), _normal(seed + 2, 2)),
    )


def test_the_parameterized_log_prob_counts_the_chosen_parameters_alone():
    mask = np.ones((B, 2), bool)
    mask[0, 1] = False
    dist = _parameterized(0, mask)
    action, data, log_prob = dist.sample_with_replay(seed=jax.random.key(1))
    choice = np.asarray(action["choice"])
    assert choice[0] == 0 and 0 < choice.sum() < B
    log_choice = masked_log_softmax_float64(_logits(0, 2), mask)[np.arange(B), choice]
    pairs = zip(dist.parameters, data["parameters"], strict=True)
    densities = np.stack([tanh_normal_log_prob_float64(x, d.loc, d.scale) for d, x in pairs], -1)
    chosen = densities[np.arange(B), choice]
    np.testing.assert_allclose(log_prob, log_choice + chosen, rtol=1e-5)
    parts = dist.log_prob_parts(action)
    np.testing.assert_allclose(parts["parameters"], chosen, rtol=1e-5)
    np.testing.assert_array_equal(log_prob, parts["choice"] + parts["parameters"])

    # The unchosen parameters get exactly zero gradient, even where their density is -inf.
    def total(logits):
        d = samplers.Parameterized(
            dist.choice,
            tuple(samplers.normal_tanh(x) for x in (logits[:, :2], logits[:, 2:])),
        )
        return jnp.sum(d.replay(data)[1])

    logits = jnp.concatenate([_logits(1, 2), _logits(2, 4)], -1)
    grad = np.asarray(jax.jit(jax.grad(total))(logits))
    assert np.all(grad[choice == 1, :2] == 0) and np.all(grad[choice == 0, 2:] == 0)
    assert np.all(np.any(grad[choice == 0, :2] != 0, -1))


def test_the_parameterized_entropy_and_kl_are_the_joint_ones():
    mask = np.ones((B, 2), bool)
    mask[:, 1] = False  # the second action is forbidden: its parts add nothing
    p, q = _parameterized(0, mask), _parameterized(3)
    log_p = masked_log_softmax_float64(_logits(0, 2), mask)
    entropies = np.stack([np.asarray(d.entropy()) for d in p.parameters], -1)
    np.testing.assert_allclose(
        p.entropy(),
        categorical_entropy_float64(log_p)
        + np.sum(np.where(mask, np.exp(log_p) * entropies, 0), -1),
        rtol=1e-6,
    )
    log_q = masked_log_softmax_float64(_logits(3, 2))
    difference = np.where(mask, log_p, 0.0) - log_q
    categorical_kl = np.sum(np.where(mask, np.exp(log_p) * difference, 0.0), -1)
    part_kls = np.stack(
        [_normal_kl(a, b) for a, b in zip(p.parameters, q.parameters, strict=True)], -1
    )
    expected = categorical_kl + np.sum(np.where(mask, np.exp(log_p) * part_kls, 0.0), -1)
    np.testing.assert_allclose(p.kl_divergence(q), expected, rtol=1e-5)
    # Its gradient with respect to the choice's logits: finite differences in float64.
    with jax.enable_x64():
        logits = np.asarray(_logits(0, 2), np.float64)
        others = [np.asarray(_logits(s, 2 * a), np.float64) for s, a in ((1, 1), (2, 2))]

        def kl(logits):
            d = samplers.Parameterized(
                samplers.MaskedCategorical(logits),
                tuple(samplers.normal_tanh(jnp.asarray(x)) for x in others),
            )
            return jnp.sum(d.kl_divergence(q_64()))

        def q_64():
            return samplers.Parameterized(
                samplers.MaskedCategorical(jnp.asarray(_logits(3, 2), jnp.float64)),
                tuple(
                    samplers.normal_tanh(jnp.asarray(_logits(s, 2 * a), jnp.float64))
                    for s, a in ((4, 1), (5, 2))
                ),
            )

        # One program for the gradient and one for the differences' evaluations.
        grad = np.asarray(jax.jit(jax.grad(kl))(jnp.asarray(logits)))
        step, jitted_kl = 1e-6, jax.jit(kl)
        for index in [(0, 0), (2, 1), (4, 0)]:
            bump = np.zeros_like(logits)
            bump[index] = step
            up, down = jitted_kl(jnp.asarray(logits + bump)), jitted_kl(jnp.asarray(logits - bump))
            numeric = (up - down) / (2 * step)
            np.testing.assert_allclose(grad[index], numeric, rtol=1e-6, atol=1e-9)


def test_what_cannot_be_a_composite_is_refused_naming_the_fix():
    with pytest.raises(TypeError, match="must be a dict or a tuple, got MaskedCategorical"):
        samplers.Composite(samplers.MaskedCategorical(_logits(0)))
    with pytest.raises(TypeError, match=r"needs str keys .* got \[1\]"):
        samplers.Composite({1: _normal(0)})
    with pytest.raises(TypeError, match="needs at least one part"):
        samplers.Composite({})
    with pytest.raises(TypeError, match=r"part 'a' must be a distrax distribution, got ndarray"):
        samplers.Composite({"a": np.zeros(3)})
    with pytest.raises(ValueError, match="same batch shape"):
        samplers.Composite((_normal(0), samplers.MaskedCategorical(jnp.zeros((2, 3)))))
    with pytest.raises(
        ValueError,
        match=r"one of its parameter distributions per discrete action: the choice has 3",
    ):
        samplers.Parameterized(samplers.MaskedCategorical(_logits(0)), (_normal(1),))
    dist = samplers.Composite({"a": _normal(0), "b": samplers.MaskedCategorical(_logits(1))})
    with pytest.raises(ValueError, match=r"replay data must be a dict with the keys \['a', 'b'\]"):
        dist.check_replay_data({"a": jnp.zeros((B, 2))})
