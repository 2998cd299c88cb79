"""``samplers.Autoregressive`` against float64 enumeration written here, Monte Carlo
and finite differences.

The discrete case is a unit (3), then a kind of move given the unit (2), then a target
given both (4), with masks that depend on the earlier choices: in row 0 unit 2 is
forbidden and every target of unit 2 too (a prefix of probability 0 whose last choice
has no allowed value), kind 1 is forbidden for unit 0, and two targets for unit 1's
kind 0.
"""

import itertools

import distrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import samplers
from tests._tiers import slow

B = 3
UNIT_MASK = np.ones((B, 3), bool)
UNIT_MASK[0, 2] = False
KIND_MASK = np.ones((B, 3, 2), bool)
KIND_MASK[:, 0, 1] = False
TARGET_MASK = np.ones((B, 3, 2, 4), bool)
TARGET_MASK[:, 1, 0, :2] = False
TARGET_MASK[0, 2] = False


def _params(seed, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(seed), 3)
    shapes = [(B, 3), (B, 3, 2), (B, 3, 2, 4)]
    return tuple(2.0 * jax.random.normal(k, s, dtype) for k, s in zip(keys, shapes, strict=True))


def _pick(table, index, trailing):
    """``table[..., b, index[..., b], ...]``: the row of each batch element's choice, for
    an index with any leading axes; ``trailing`` axes follow the choice's."""
    count = table.shape[-1 - trailing]
    one_hot = jax.nn.one_hot(index, count, dtype=table.dtype)
    one_hot = one_hot.reshape(one_hot.shape + (1,) * trailing)
    shape = jnp.broadcast_shapes(one_hot.shape, table.shape)
    product = jnp.broadcast_to(one_hot, shape) * jnp.broadcast_to(table, shape)
    return jnp.sum(product, axis=-1 - trailing)


def _distribution(params, **options):
    units, kinds, targets = params

    def unit(prefix):
        return samplers.MaskedCategorical(units, jnp.asarray(UNIT_MASK))

    def kind(prefix):
        logits = _pick(kinds, prefix["unit"], 1)
        mask = _pick(jnp.asarray(KIND_MASK, logits.dtype), prefix["unit"], 1) > 0.5
        return samplers.MaskedCategorical(logits, mask)

    def target(prefix):
        logits = _pick(_pick(targets, prefix["unit"], 2), prefix["kind"], 1)
        mask = _pick(
            _pick(jnp.asarray(TARGET_MASK, logits.dtype), prefix["unit"], 2), prefix["kind"], 1
        )
        return samplers.MaskedCategorical(logits, mask > 0.5)

    return samplers.Autoregressive({"unit": unit, "kind": kind, "target": target}, **options)


def _masked_log_softmax_jnp(logits, mask):
    """The masked log-softmax in jnp, so that ``jax.grad`` differentiates the oracle."""
    logits = jnp.where(mask, logits, -jnp.inf)
    return logits - jax.scipy.special.logsumexp(logits, axis=-1, keepdims=True)


def _joint_log_probs(params):
    """``log p(u, k, t)`` of every triple, ``[B, 3, 2, 4]``, in plain jnp (-inf where
    forbidden): the oracle, written without the library."""
    units, kinds, targets = params
    log_u = _masked_log_softmax_jnp(units, UNIT_MASK)
    log_k = _masked_log_softmax_jnp(kinds, KIND_MASK)
    # A forbidden unit's row of targets may be all forbidden: its NaN is not used.
    safe = np.where(TARGET_MASK.any(-1, keepdims=True), TARGET_MASK, True)
    log_t = _masked_log_softmax_jnp(targets, safe)
    shape = log_t.shape
    return (
        jnp.broadcast_to(log_u[:, :, None, None], shape)
        + jnp.broadcast_to(log_k[:, :, :, None], shape)
        + log_t
    )


def _oracle_entropy(params):
    log_p = _joint_log_probs(params)
    p = jnp.exp(log_p)
    log_p = jnp.where(p > 0, log_p, 0.0)  # 0 log 0 = 0, with a zero gradient
    return -jnp.sum(p * log_p, axis=(1, 2, 3))


def _oracle_kl(p_params, q_params):
    log_p, log_q = _joint_log_probs(p_params), _joint_log_probs(q_params)
    p = jnp.exp(log_p)
    log_ratio = jnp.where(p > 0, log_p - jnp.where(p > 0, log_q, 0.0), 0.0)
    return jnp.sum(p * log_ratio, axis=(1, 2, 3))


@pytest.mark.parametrize(
    "dtype", [slow(jnp.float32, id="float32"), pytest.param(jnp.float64, id="float64")]
)
def test_exact_entropy_and_kl_and_their_gradients_match_float64_enumeration(dtype):
    with jax.enable_x64(True):
        params, others = _params(0, dtype), _params(1, dtype)
        params64 = jax.tree.map(lambda x: x.astype(jnp.float64), params)
        others64 = jax.tree.map(lambda x: x.astype(jnp.float64), others)

        def values_and_gradients(entropy_of, kl_of):
            def both(p, q):
                return jnp.sum(entropy_of(p)), jnp.sum(kl_of(p, q))

            values = (entropy_of, kl_of)
            grads = (
                jax.grad(lambda p, q: both(p, q)[0]),
                jax.grad(lambda p, q: both(p, q)[1], argnums=(0, 1)),
            )
            return jax.jit(
                lambda p, q: (values[0](p), values[1](p, q), grads[0](p, q), grads[1](p, q))
            )

        ours = values_and_gradients(
            lambda p: _distribution(p).entropy(),
            lambda p, q: _distribution(p).kl_divergence(_distribution(q)),
        )
        entropy, kl, grad_entropy, grad_kl = ours(params, others)
        oracle = values_and_gradients(_oracle_entropy, _oracle_kl)
        expected, expected_kl, expected_grad_entropy, expected_grad_kl = oracle(params64, others64)
        rtol, atol = (1e-5, 1e-6) if dtype == jnp.float32 else (1e-12, 1e-13)
        assert entropy.dtype == dtype and kl.dtype == dtype
        np.testing.assert_allclose(entropy, expected, rtol=rtol, atol=atol)
        np.testing.assert_allclose(kl, expected_kl, rtol=rtol, atol=atol)
        for got, want in zip(
            jax.tree.leaves((grad_entropy, grad_kl)),
            jax.tree.leaves((expected_grad_entropy, expected_grad_kl)),
            strict=True,
        ):
            assert np.all(np.isfinite(got))
            np.testing.assert_allclose(got, want, rtol=10 * rtol, atol=10 * atol)
        _, to_itself, _, _ = ours(params, params)
        assert np.all(to_itself == 0)


def test_log_probs_match_enumeration_and_masked_choices_get_exactly_zero_gradient():
    params = _params(2)
    with jax.enable_x64(True):
        params64 = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
        expected = np.asarray(jax.jit(_joint_log_probs)(params64))  # one program
    allowed = np.argwhere(np.isfinite(expected[1]))  # row 1: every unit allowed
    log_prob = jax.jit(lambda p, a: _distribution(p).log_prob(a))
    for u, k, t in allowed:
        action = {
            n: jnp.full((B,), v) for n, v in zip(("unit", "kind", "target"), (u, k, t), strict=True)
        }
        np.testing.assert_allclose(log_prob(params, action)[1], expected[1, u, k, t], rtol=1e-5)

    def loss(params):
        dist = _distribution(params)
        data = dist.sample_replay_data(seed=jax.random.key(3))
        return jnp.sum(dist.replay(data)[1]) + jnp.sum(dist.entropy())

    units, kinds, targets = jax.jit(jax.grad(loss))(params)
    assert units[0, 2] == 0  # a forbidden unit
    assert np.all(kinds[:, 0, 1] == 0)  # kind 1 for unit 0
    assert np.all(targets[:, 1, 0, :2] == 0) and np.all(targets[0, 2] == 0)
    assert all(np.all(np.isfinite(g)) for g in (units, kinds, targets))


def test_a_forbidden_prefix_whose_next_row_is_empty_scores_minus_inf_not_nan():
    """Row 0: unit 2 is forbidden and every target under it too, so the target's
    conditional has no distribution there; the joint is -inf, as in the oracle."""
    triples = np.array(list(itertools.product(range(3), range(2), range(4))))
    actions = {
        name: jnp.broadcast_to(jnp.asarray(triples[:, i, None]), (len(triples), B))
        for i, name in enumerate(("unit", "kind", "target"))
    }
    empty = (triples[:, 0] == 2)[:, None] & (np.arange(B) == 0)[None]  # [24, B]

    def finite_sum(log_probs):
        return jnp.sum(jnp.where(jnp.isfinite(log_probs), log_probs, 0.0))

    @jax.jit
    def ours(params):
        def replayed(params):
            return jax.vmap(_distribution(params).replay)(actions)[1]

        dist = _distribution(params)
        return (
            jax.vmap(dist.log_prob)(actions),
            replayed(params),
            jax.vmap(dist.conditional_entropies)(actions),
            jax.grad(lambda p: finite_sum(replayed(p)))(params),
            # The -inf scores themselves.
            jax.grad(lambda p: jnp.sum(jnp.where(empty, replayed(p), 0.0)))(params),
        )

    @jax.jit
    def oracle(params):
        def joint(params):
            return _joint_log_probs(params).reshape(B, -1).T  # [24, B]

        return joint(params), jax.grad(lambda p: finite_sum(joint(p)))(params)

    with jax.enable_x64(True):
        params = _params(13, jnp.float64)
        results = jax.tree.map(np.asarray, ours(params))
        expected, expected_grads = jax.tree.map(np.asarray, oracle(params))
    log_probs, replayed, entropies, grads, impossible = results
    assert np.all(expected[empty] == -np.inf)
    finite = np.isfinite(expected)
    for scores in (log_probs, replayed):
        assert not np.any(np.isnan(scores))
        np.testing.assert_array_equal(np.isneginf(scores), ~finite)
        np.testing.assert_allclose(scores[finite], expected[finite], rtol=1e-12)
    for got, wanted in zip(grads, expected_grads, strict=True):
        np.testing.assert_allclose(got, wanted, rtol=1e-10, atol=1e-12)
    assert all(np.all(np.isfinite(g)) for g in impossible)
    assert np.all(impossible[2][0, 2] == 0)  # the empty row's logits
    assert np.all(entropies["target"][empty] == 0)
    assert all(np.all(np.isfinite(h)) for h in entropies.values())


@pytest.mark.slow
def test_a_sample_replays_bit_for_bit_teacher_forced_in_another_program():
    params = _params(4)
    action, data, log_prob = jax.jit(lambda p, k: _distribution(p).sample_with_replay(seed=k))(
        params, jax.random.key(5)
    )
    stored = jax.tree.map(np.asarray, data)
    for seed in (jax.random.PRNGKey(5), 5):  # distrax's other seeds draw the same
        again = jax.jit(lambda p, k=seed: _distribution(p).sample_replay_data(seed=k))(params)
        jax.tree.map(np.testing.assert_array_equal, again, stored)
    replayed_action, replayed = jax.jit(lambda p, d: _distribution(p).replay(d))(params, stored)
    np.testing.assert_array_equal(replayed, log_prob)
    for name in ("unit", "kind", "target"):
        np.testing.assert_array_equal(replayed_action[name], action[name])
    assert not np.any(action["unit"][0] == 2)
    _, parts = _distribution(params).replay_parts(stored)
    np.testing.assert_array_equal(parts["unit"] + parts["kind"] + parts["target"], log_prob)


@pytest.mark.slow
def test_samples_follow_the_joint_distribution_and_estimate_its_entropy():
    params = _params(6)
    dist = _distribution(params)
    n = 20_000
    samples = dist.sample(seed=jax.random.key(7), sample_shape=n)
    codes = np.asarray(samples["unit"] * 8 + samples["kind"] * 4 + samples["target"])
    probs = np.exp(np.asarray(_joint_log_probs(params))).reshape(B, -1)
    for b in range(B):
        frequencies = np.bincount(codes[:, b], minlength=24) / n
        np.testing.assert_allclose(frequencies, probs[b], atol=0.015)
    surprise = -np.asarray(jax.vmap(dist.log_prob)(samples))
    standard_error = surprise.std(0) / np.sqrt(n)
    assert np.all(np.abs(surprise.mean(0) - dist.entropy()) < 4 * standard_error + 1e-6)
    # The estimate along one sampled prefix is unbiased too.
    data = jax.vmap(lambda k: dist.sample_replay_data(seed=k))(
        jax.random.split(jax.random.key(8), n)
    )
    along = np.asarray(jax.vmap(dist.entropy_along)(data))
    assert np.all(np.abs(along.mean(0) - dist.entropy()) < 4 * along.std(0) / np.sqrt(n) + 1e-6)


@pytest.mark.slow
def test_greedy_decoding_takes_the_most_probable_choice_at_each_step():
    params = _params(9)
    dist = _distribution(params)
    data = dist.deterministic_replay_data()
    steps = dist.step_distributions(data)
    for name in ("unit", "kind", "target"):
        np.testing.assert_array_equal(data[name], jnp.argmax(steps[name].probs, -1))


def _continuous_first(params):
    """A squashed Normal move, then a choice whose logits depend on where it went."""
    loc, logits = params

    def move(prefix):
        return samplers.normal_tanh(loc)

    def fire(prefix):
        where = jnp.tanh(prefix["move"])  # the action, from the stored pre-image
        return samplers.MaskedCategorical(logits + 3.0 * where)

    return samplers.Autoregressive({"move": move, "fire": fire})


@pytest.mark.slow
def test_a_continuous_prefix_refuses_the_exact_entropy_and_estimates_it_without_bias():
    keys = jax.random.split(jax.random.key(10), 2)
    params = (jax.random.normal(keys[0], (B, 4)), jax.random.normal(keys[1], (B, 2)))
    dist = _continuous_first(params)
    with pytest.raises(
        NotImplementedError, match=r"'move' .* is not discrete .*; use entropy_along"
    ):
        dist.entropy()
    n = 20_000
    data = jax.vmap(lambda k: dist.sample_replay_data(seed=k))(jax.random.split(keys[0], n))
    _, log_probs = jax.vmap(dist.replay)(data)
    along = np.asarray(jax.vmap(dist.entropy_along)(data))
    surprise = -np.asarray(log_probs)
    # Two unbiased estimates of one entropy agree within their standard errors.
    error = np.sqrt(along.var(0) / n + surprise.var(0) / n)
    assert np.all(np.abs(along.mean(0) - surprise.mean(0)) < 4 * error)
    # A sample remembers its pre-image: log_prob of the returned action is its replay.
    action, data, log_prob = dist.sample_with_replay(seed=keys[1])
    np.testing.assert_array_equal(dist.log_prob(action), log_prob)
    fresh = {"move": jnp.array(np.asarray(action["move"])), "fire": action["fire"]}
    np.testing.assert_allclose(dist.log_prob(fresh), log_prob, rtol=1e-4)


@pytest.mark.slow
def test_the_pathwise_gradient_through_a_continuous_sub_action_matches_finite_differences():
    loc = np.array([[0.3, -0.2, 0.5, 0.4]])
    logits = np.array([[0.1, -0.4]])

    def expected_fire(loc):
        dist = _continuous_first((loc, logits))
        data = dist.sample_replay_data(seed=jax.random.key(11))
        # E[fire = 1 | move] along the sampled move, a smooth function of loc
        return jnp.sum(dist.step_distributions(data)["fire"].probs[..., 1])

    with jax.enable_x64(True):
        loc, logits = jnp.asarray(loc), jnp.asarray(logits)
        grad = jax.grad(expected_fire)(loc)
        step = 1e-6
        for i in range(4):
            e = jnp.zeros_like(loc).at[0, i].set(step)
            fd = (expected_fire(loc + e) - expected_fire(loc - e)) / (2 * step)
            np.testing.assert_allclose(grad[0, i], fd, rtol=1e-6, atol=1e-9)
        assert np.any(np.abs(grad) > 1e-3)


def test_bad_steps_data_and_sizes_are_refused_by_name():
    with pytest.raises(TypeError, match="non-empty dict of steps"):
        samplers.Autoregressive([])
    with pytest.raises(TypeError, match="step 'a' must return a distrax distribution"):
        samplers.Autoregressive({"a": lambda prefix: jnp.zeros(3)})
    dist = _distribution(_params(0))
    with pytest.raises(ValueError, match=r"sub-actions \['unit', 'kind', 'target'\]"):
        dist.check_replay_data({"unit": jnp.zeros(B, int)})
    with pytest.raises(ValueError, match=r"replay data\['kind'\] must have the action shape"):
        dist.check_replay_data({"unit": jnp.zeros(B, int), "kind": jnp.zeros(2, int), "target": 0})
    with pytest.raises(NotImplementedError, match=r"max_prefixes=5 .* up to 'kind' number 6"):
        _distribution(_params(0), max_prefixes=5).entropy()
    with pytest.raises(ValueError, match="same sub-actions"):
        dist.kl_divergence(
            samplers.Autoregressive({"unit": lambda p: distrax.Categorical(jnp.zeros(3))})
        )


@pytest.mark.parametrize("size", [slow(2, id="two"), slow(3, id="three")])
def test_prefixes_stacked_in_front_of_the_batch_give_the_rows_of_each_prefix(size):
    """What the enumeration relies on: a step of prefixes ``[P, *batch]`` is the step of
    each prefix, stacked."""
    dist = _distribution(_params(12))
    prefixes = {"unit": jnp.stack([jnp.full((B,), u) for u in range(size)])}
    stacked = dist.step_distributions({**prefixes, "kind": jnp.zeros((size, B), int)})
    for u, k in itertools.product(range(size), range(1)):
        one = dist.step_distributions({"unit": prefixes["unit"][u], "kind": jnp.full((B,), k)})
        np.testing.assert_array_equal(stacked["kind"].logits[u], one["kind"].logits)
