"""``TokenCategorical`` against float64 NumPy: the softmax over the whole vocabulary,
vLLM's truncation order written on sorted probabilities, gradients against a dense
log-softmax, and the layouts that break a streamed computation (a vocabulary that is no
multiple of the block, one-token blocks, a last tile of rows part padding), ties, top-p
reached exactly, extreme temperatures, forbidden tokens, bfloat16 weights, batch
invariance, a vocabulary sharded over devices, replay and sampling frequencies."""

import functools
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import special

import samplers
from samplers import TokenCategorical, support_from_kept_ids
from samplers.distributions import _token_math as token_math
from samplers.distributions.tokens import FULL
from tests._devices import REPO_ROOT, cpu_devices_environment
from tests._tiers import slow
from tests.reference import categorical_entropy_float64, masked_log_softmax_float64

N, D, V = 10, 6, 37
BLOCK = (4, 8)  # 10 rows: the last tile half padding; 37 tokens: a remainder block of 5


@pytest.mark.parametrize("option", ["bias", "mask"])
def test_a_bias_and_a_shared_mask_work_where_rank_promotion_raises(option):
    hidden, unembedding = jnp.zeros((2, 3)), jnp.zeros((3, 5))
    extra = {"bias": jnp.zeros(5)} if option == "bias" else {"mask": jnp.ones(5, bool)}
    with jax.numpy_rank_promotion("raise"):
        entropy = TokenCategorical(hidden, unembedding, **extra).full_entropy()
    np.testing.assert_allclose(entropy, np.full(2, np.log(5)), rtol=1e-6)


# Truncations, each with a max_kept; the ids name what they reach.
TRUNCATIONS = {
    "top_k": dict(top_k=5, max_kept=8),
    "top_p": dict(top_p=0.8, max_kept=37),
    "min_p": dict(min_p=0.1, max_kept=37),
    "all": dict(min_p=0.05, top_k=8, top_p=0.9, max_kept=16),
    "max_kept_binds": dict(top_p=0.99, max_kept=6),
    "min_p_max_kept_binds": dict(min_p=1e-4, top_p=0.9, max_kept=4),
}


def _problem(n=N, v=V, d=D, seed=0, scale=1.0):
    """float64 hidden states, unembedding and bias."""
    rng = np.random.default_rng(seed)
    hidden = rng.normal(size=(n, d))
    unembedding = rng.normal(size=(d, v)) * scale
    bias = rng.normal(size=v)
    return hidden, unembedding, bias


def _dist(hidden, unembedding, bias, dtype=jnp.float32, **options):
    options.setdefault("block", BLOCK)
    return TokenCategorical(
        jnp.asarray(hidden, dtype),
        jnp.asarray(unembedding, dtype),
        None if bias is None else jnp.asarray(bias, dtype),
        **options,
    )


# The float64 oracle.


def _logits(hidden, unembedding, bias, temperature=1.0, mask=None):
    logits = np.asarray(hidden, np.float64) @ np.asarray(unembedding, np.float64)
    if bias is not None:
        logits = logits + np.asarray(bias, np.float64)
    logits = logits / temperature
    if mask is not None:
        logits = np.where(np.broadcast_to(mask, logits.shape), logits, -np.inf)
    return logits


def _kept(values, top_k=None, top_p=None, min_p=None, max_kept=256):
    """The ids vLLM keeps for one row of tempered logits, most probable first, with the
    distance of every decision from its threshold (to check the data avoids near ties).

    Sorted by probability, equal ones by id; min-p against the largest probability,
    then top-k, then top-p on the survivors renormalised (the whole vocabulary when
    neither min-p nor top-k applies; the ``max_kept`` most probable survivors when
    min-p's exceed it): a token stays while the mass before it is below ``top_p``.
    At most ``max_kept`` ids.
    """
    allowed = np.flatnonzero(np.isfinite(values))
    order = allowed[np.lexsort((allowed, -values[allowed]))]
    probs = np.exp(values - special.logsumexp(values[allowed]))
    kept, margins = order, [np.inf]
    if min_p is not None:
        ratio = probs[kept] / probs[order[0]]
        margins.append(np.min(np.abs(ratio / min_p - 1)) if min_p > 0 else np.inf)
        kept = kept[ratio >= min_p]
    if top_k is not None:
        kept = kept[:top_k]
    if top_p is not None:
        if min_p is None and top_k is None:
            mass = probs[kept]
        else:
            kept = kept[:max_kept]
            mass = probs[kept] / probs[kept].sum()
        before = np.concatenate([[0.0], np.cumsum(mass)[:-1]])
        margins.append(np.min(np.abs(before - top_p)))
        kept = kept[before < top_p]
    return kept[:max_kept], min(margins)


def _oracle_supports(logits, max_kept, **truncation):
    """``[N, max_kept]`` ids padded with -1, and the smallest margin over the rows."""
    out = np.full((len(logits), max_kept), -1)
    margin = np.inf
    for row, values in enumerate(logits):
        kept, m = _kept(values, max_kept=max_kept, **truncation)
        out[row, : len(kept)] = kept
        margin = min(margin, m)
    return out, margin


def _on_support(logits, support):
    """float64 log-probabilities ``[N, V]`` renormalised over each row's support."""
    member = np.zeros(logits.shape, bool)
    for row, ids in enumerate(support):
        member[row, ids[ids >= 0]] = True
    return masked_log_softmax_float64(np.where(member, logits, -np.inf))


def _every_token(hidden):
    """Each row repeated once per token, and the token ids: every (row, token) pair."""
    v = V
    return np.repeat(hidden, v, axis=0), np.tile(np.arange(v), len(hidden))


def _close(got, expected, rtol):
    """``|got - expected| <= rtol (1 + |expected|)``, infinities equal, NaN where NaN."""
    got, expected = np.asarray(got, np.float64), np.asarray(expected, np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(expected))
    finite = np.isfinite(expected)
    infinite = np.isinf(expected)
    np.testing.assert_array_equal(got[infinite], expected[infinite])
    error = np.abs(got[finite] - expected[finite]) / (1 + np.abs(expected[finite]))
    assert error.size == 0 or error.max() <= rtol, f"relative error {error.max():.3g} > {rtol}"


# float64: the library's own rounding only, 1e-12 of 1 + |value|; float32 inputs are
# compared with the float64 values of the same (float32-rounded) inputs, to 1e-5.
DTYPES = [
    pytest.param(jnp.float64, 1e-12, id="float64"),
    slow(jnp.float32, 1e-5, id="float32"),
]


def _rounded(dtype, *arrays):
    return [None if a is None else np.asarray(jnp.asarray(a, dtype), np.float64) for a in arrays]


@pytest.mark.parametrize("dtype, rtol", DTYPES)
def test_full_log_prob_entropy_and_mode_match_the_float64_softmax(dtype, rtol):
    with jax.enable_x64(dtype == jnp.float64):
        hidden, unembedding, bias = _rounded(dtype, *_problem())
        logits = _logits(hidden, unembedding, bias, temperature=0.7)
        log_probs = masked_log_softmax_float64(logits)
        dist = _dist(hidden, unembedding, bias, dtype, temperature=0.7)
        _close(dist.full_entropy(), categorical_entropy_float64(log_probs), rtol)
        assert dist.full_entropy().dtype == dtype
        rows, tokens = _every_token(hidden)
        every = _dist(rows, unembedding, bias, dtype, temperature=0.7)
        got = every.full_log_prob(jnp.asarray(tokens)).reshape(N, V)
        _close(got, log_probs, rtol)
        np.testing.assert_array_equal(dist.mode(), np.argmax(logits, -1))
        # Untruncated, log_prob, entropy and replay are the full distribution's.
        np.testing.assert_array_equal(every.log_prob(jnp.asarray(tokens)).reshape(N, V), got)
        np.testing.assert_array_equal(dist.entropy(), dist.full_entropy())
        assert dist.support().shape == (N, 256) and not dist.truncated


@pytest.mark.parametrize(
    "name, dtype, rtol",
    [
        pytest.param(name, dtype, rtol, id=f"{name}-{np.dtype(dtype).name}")
        if (name, dtype) == ("all", jnp.float64)
        else slow(name, dtype, rtol, id=f"{name}-{np.dtype(dtype).name}")
        for name in TRUNCATIONS
        for dtype, rtol in [(jnp.float64, 1e-12), (jnp.float32, 1e-5)]
    ],
)
def test_truncated_support_and_scores_match_vllm_order_in_float64(name, dtype, rtol):
    truncation = TRUNCATIONS[name]
    with jax.enable_x64(dtype == jnp.float64):
        hidden, unembedding, bias = _rounded(dtype, *_problem(seed=1))
        logits = _logits(hidden, unembedding, bias, temperature=0.9)
        expected, margin = _oracle_supports(logits, **truncation)
        # No decision of the data is within float32 rounding of its threshold.
        assert margin > 1e-4, margin
        dist = _dist(hidden, unembedding, bias, dtype, temperature=0.9, **truncation)
        support = np.asarray(dist.support())
        np.testing.assert_array_equal(support, expected)  # most probable first
        assert (support[:, 0] >= 0).all() and (support >= 0).sum(-1).min() >= 1
        on_support = _on_support(logits, expected)
        # Every token of every row, -inf off the support.
        rows, tokens = _every_token(hidden)
        every = _dist(rows, unembedding, bias, dtype, temperature=0.9, **truncation)
        _close(every.log_prob(jnp.asarray(tokens)).reshape(N, V), on_support, rtol)
        _close(dist.entropy(), categorical_entropy_float64(on_support), rtol)
        scored = np.asarray(dist.support_log_probs(jnp.asarray(expected)), np.float64)
        want = np.take_along_axis(on_support, np.maximum(expected, 0), -1)
        _close(
            np.where(expected >= 0, scored, -np.inf), np.where(expected >= 0, want, -np.inf), rtol
        )
        assert np.all(scored[expected < 0] == -np.inf)
        np.testing.assert_array_equal(dist.mode(), expected[:, 0])
        # KL to another temperature, both renormalised over this support.
        other_logits = _logits(hidden, unembedding, bias, temperature=1.6)
        other = _dist(hidden, unembedding, bias, dtype, temperature=1.6, **truncation)
        log_q = _on_support(other_logits, expected)
        p = np.exp(on_support)
        positive = p > 0
        kl = np.zeros(N)
        for row in range(N):
            kept = positive[row]
            kl[row] = np.sum(p[row, kept] * (on_support[row, kept] - log_q[row, kept]))
        _close(dist.kl_on_support(other, jnp.asarray(expected)), kl, rtol)
        assert kl.max() > 1e-3  # zero on one-token supports only
        assert np.all(kl[(expected >= 0).sum(-1) > 1] > 0)


def _dense_log_probs(hidden, unembedding, bias, temperature, allowed):
    logits = (hidden @ unembedding + bias[None]) / temperature
    return jax.nn.log_softmax(jnp.where(allowed, logits, -jnp.inf), axis=-1)


def _dense_entropy(log_probs):
    positive = log_probs > -jnp.inf
    safe = jnp.where(positive, log_probs, 0.0)
    return -jnp.where(positive, jnp.exp(safe) * safe, 0.0).sum(-1)


MASKED = np.ones(V, bool)
MASKED[[0, 9, 20, 36]] = False  # a first, middle and last token forbidden


@pytest.fixture
def simulated_tpu(monkeypatch):
    """The TPU's code paths (the support's scores and table gradient on the MXU) run on
    the CPU; returns a list that grows by one at each TPU table gradient traced. A
    test that uses it takes shapes of its own, so that no program traced for the CPU
    serves it and none traced here serves another test."""
    traced = []
    block_row_sums = token_math._block_row_sums

    def counted(*args):
        traced.append(None)
        return block_row_sums(*args)

    monkeypatch.setattr(token_math, "_backend", lambda: "tpu")
    monkeypatch.setattr(token_math, "_block_row_sums", counted)
    return traced


@pytest.mark.parametrize(
    "kind", [pytest.param("full", id="full"), slow("support", id="support"), "support-tpu"]
)
def test_gradients_match_the_dense_float64_log_softmax(kind, request):
    # On the simulated TPU the weights come as an embedding table, whose support
    # logits are products on the MXU there.
    tpu = kind == "support-tpu"
    traced = request.getfixturevalue("simulated_tpu") if tpu else None
    kind = "support" if tpu else kind
    n = 11 if tpu else N
    hidden, unembedding, bias = _problem(n=n, d=5 if tpu else D, seed=2)
    tokens = jnp.asarray(np.array([1, 2, 3, 4, 5, 6, 7, 8, 10, 35]))
    temperature = 0.8
    with jax.enable_x64(True):
        args = tuple(jnp.asarray(a) for a in (hidden, unembedding, bias))
        mask = jnp.asarray(MASKED)
        truncation = dict(top_k=12, top_p=0.95, max_kept=16)
        support = _dist(*args, jnp.float64, temperature=temperature, mask=mask, **truncation)
        support = support.support()
        member = (
            jnp.zeros((n, V), bool)
            .at[jnp.arange(n)[:, None], jnp.maximum(support, 0)]
            .set(support >= 0)
        )
        # The scored tokens lie on the support: the most probable one of each row.
        if kind == "support":
            tokens = support[:, 0]

        def library(h, w, b):
            weights = dict(embedding=w.T) if tpu else dict(unembedding=w)
            options = dict(temperature=temperature, mask=mask, block=BLOCK)
            dist = TokenCategorical(h, bias=b, **weights, **options)
            if kind == "full":
                return (dist.full_log_prob(tokens) + 0.5 * dist.full_entropy()).sum()
            return (
                dist.log_prob_on_support(tokens, support) + 0.5 * dist.entropy_on_support(support)
            ).sum()

        def dense(h, w, b):
            allowed = mask[None] if kind == "full" else mask[None] & member
            log_probs = _dense_log_probs(h, w, b, temperature, allowed)
            picked = jnp.take_along_axis(log_probs, tokens[:, None], -1)[:, 0]
            return (picked + 0.5 * _dense_entropy(log_probs)).sum()

        got = jax.jit(jax.grad(library, argnums=(0, 1, 2)))(*args)
        want = jax.grad(dense, argnums=(0, 1, 2))(*args)
        for name, g, w in zip(("hidden", "unembedding", "bias"), got, want, strict=True):
            assert g.dtype == jnp.float64, name
            np.testing.assert_allclose(g, w, rtol=1e-11, atol=1e-12, err_msg=name)
        # Forbidden tokens: their columns get exactly zero.
        assert np.all(np.asarray(got[1])[:, ~MASKED] == 0)
        assert np.all(np.asarray(got[2])[~MASKED] == 0)
        assert np.abs(np.asarray(got[1])).max() > 1e-3  # not a vacuous zero
        assert not tpu or traced  # the TPU's paths, not the CPU's programs


@pytest.mark.slow
def test_gradient_matches_float64_finite_differences():
    hidden, unembedding, bias = _problem(n=3, seed=3)

    def oracle(h):
        log_probs = masked_log_softmax_float64(_logits(h, unembedding, bias, temperature=1.3))
        return (
            log_probs[np.arange(3), [4, 17, 36]].sum()
            + categorical_entropy_float64(log_probs).sum()
        )

    def library(h):
        dist = _dist(h, unembedding, bias, jnp.float64, temperature=1.3)
        return (dist.full_log_prob(jnp.array([4, 17, 36])) + dist.full_entropy()).sum()

    with jax.enable_x64(True):
        grad = np.asarray(jax.jit(jax.grad(library))(jnp.asarray(hidden)))
    step = 1e-6
    expected = np.zeros_like(hidden)
    for index in np.ndindex(hidden.shape):
        up, down = hidden.copy(), hidden.copy()
        up[index] += step
        down[index] -= step
        expected[index] = (oracle(up) - oracle(down)) / (2 * step)
    np.testing.assert_allclose(grad, expected, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize(
    "n, block",
    [
        slow(10, (4, 1), id="N10-tokens1"),
        slow(1, (4, 64), id="N1-tokens>=V"),
        slow(10, (3, 37), id="N10-tokensV"),
        slow(10, (16, 8), id="N10-rows>N"),
        slow(1, (1, 8), id="N1-rows1"),
        slow(10, (4, 36), id="N10-tokensV-1"),
    ],
)
def test_block_layouts_give_the_oracle(n, block):
    hidden, unembedding, bias = _problem(n=n, seed=4)
    logits = _logits(*_rounded(jnp.float32, hidden, unembedding, bias))
    log_probs = masked_log_softmax_float64(logits)
    truncation = dict(top_k=6, top_p=0.9, max_kept=8)
    expected, margin = _oracle_supports(logits, **truncation)
    assert margin > 1e-4
    dist = _dist(hidden, unembedding, bias, block=block)
    _close(dist.full_entropy(), categorical_entropy_float64(log_probs), 1e-5)
    tokens = np.arange(n) * 7 % V
    _close(dist.full_log_prob(jnp.asarray(tokens)), log_probs[np.arange(n), tokens], 1e-5)
    np.testing.assert_array_equal(dist.mode(), np.argmax(logits, -1))
    truncated = _dist(hidden, unembedding, bias, block=block, **truncation)
    np.testing.assert_array_equal(truncated.support(), expected)
    _close(truncated.entropy(), categorical_entropy_float64(_on_support(logits, expected)), 1e-5)
    grad = jax.grad(lambda b: _dist(hidden, unembedding, b, block=block).full_entropy().sum())(
        jnp.asarray(bias, jnp.float32)
    )
    probs = np.exp(log_probs)
    want = (probs * -(log_probs - (probs * log_probs).sum(-1, keepdims=True))).sum(0)
    np.testing.assert_allclose(grad, want, rtol=1e-4, atol=1e-5)


def test_equal_logits_rank_by_lower_id_at_the_top_k_boundary():
    # Tokens 3, 5 and 6 tie for the top; top-k 2 keeps 3 and 5.
    bias = np.zeros(8)
    bias[[3, 5, 6]] = 1.0
    bias[7] = 0.5
    dist = _dist(np.zeros((2, 2)), np.zeros((2, 8)), bias, top_k=2, max_kept=4)
    np.testing.assert_array_equal(dist.support(), [[3, 5, -1, -1]] * 2)
    np.testing.assert_array_equal(dist.mode(), [3, 3])
    full = _dist(np.zeros((2, 2)), np.zeros((2, 8)), bias, block=(4, 3))
    np.testing.assert_array_equal(full.mode(), [3, 3])  # across blocks [3..5], [6..7]
    keys = jax.random.split(jax.random.key(0), 400)
    many = _dist(np.zeros((400, 2)), np.zeros((2, 8)), bias, top_k=2, max_kept=4)
    drawn = np.asarray(many.sample_replay_data(seed=keys)["token"])
    assert set(np.unique(drawn)) == {3, 5}
    # All ties: top-k 3 keeps the three lowest ids.
    flat = _dist(np.zeros((1, 2)), np.zeros((2, 8)), None, top_k=3, max_kept=3)
    np.testing.assert_array_equal(flat.support(), [[0, 1, 2]])


@pytest.mark.parametrize(
    "truncation, expected",
    [
        # Probabilities 1/8, 1/4, 1/8, 1/2: exact in binary, so the mass before a token
        # reaches top_p exactly; it is then excluded (kept only while below top_p).
        slow(dict(top_p=0.75), [3, 1, -1, -1], id="top_p"),
        # 0 and 2 tie: the lower id is kept.
        pytest.param(dict(top_p=0.875), [3, 1, 0, -1], id="top_p-tie"),
        pytest.param(dict(top_k=4, top_p=0.75), [3, 1, -1, -1], id="top_k-top_p"),
        slow(dict(top_k=4, top_p=0.875), [3, 1, 0, -1], id="top_k-top_p-tie"),
        slow(dict(top_p=1.0), [3, 1, 0, 2], id="top_p1"),
        slow(dict(min_p=0.25), [3, 1, 0, 2], id="min_p"),  # 1/8 = 1/4 of 1/2: kept
        slow(dict(min_p=0.5), [3, 1, -1, -1], id="min_p-half"),
    ],
)
def test_top_p_reached_exactly_excludes_the_token(truncation, expected):
    probs = np.array([0.125, 0.25, 0.125, 0.5])
    bias = jnp.log(jnp.asarray(probs, jnp.float32))
    dist = TokenCategorical(jnp.zeros((1, 3)), jnp.zeros((3, 4)), bias, max_kept=4, **truncation)
    # The premise: these probabilities come out exact.
    np.testing.assert_array_equal(
        np.exp(np.asarray(dist.support_log_probs(jnp.array([[3, 1, 0, 2]])), np.float32)),
        [probs[[3, 1, 0, 2]]],
    )
    np.testing.assert_array_equal(dist.support(), [expected])


@pytest.mark.slow
def test_a_temperature_near_zero_collapses_the_support_without_nan():
    hidden, unembedding, bias = _problem(seed=5)
    logits = _logits(*_rounded(jnp.float32, hidden, unembedding, bias))
    argmax = np.argmax(logits, -1)
    for truncation in (dict(top_p=0.9), dict(min_p=0.1)):
        dist = _dist(hidden, unembedding, bias, temperature=1e-3, max_kept=8, **truncation)
        support = np.asarray(dist.support())
        np.testing.assert_array_equal(support[:, 0], argmax)
        assert np.all(support[:, 1:] == -1)
        np.testing.assert_array_equal(dist.log_prob(jnp.asarray(argmax)), np.zeros(N))
        assert np.all(dist.entropy() == 0)
    dist = _dist(hidden, unembedding, bias, temperature=1e-3)
    full = np.asarray(dist.full_log_prob(jnp.asarray((argmax + 1) % V)))
    assert np.all(np.isfinite(full)) and np.all(full < -10)
    np.testing.assert_allclose(
        full,
        masked_log_softmax_float64(logits / 1e-3)[np.arange(N), (argmax + 1) % V],
        rtol=1e-5,
    )
    assert np.isfinite(np.asarray(dist.full_entropy())).all()
    draws = dist.sample_replay_data(seed=jax.random.key(0))
    np.testing.assert_array_equal(draws, argmax)


def test_gradients_are_finite_where_tempered_logits_pass_exps_range_and_the_last_tile_is_padding():
    # Bias 100 on token 0: its logit is far above the others in every row. The rows
    # (3) do not fill a tile (4): the padded row's logits are the bias itself.
    bias = jnp.array([100.0, 0.0, 0.0, 0.0])

    def loss(b, w):
        dist = TokenCategorical(jnp.ones((3, 2)), w, b, block=(4, 4))
        return (dist.full_entropy() + dist.full_log_prob(jnp.zeros(3, jnp.int32))).sum()

    grads = jax.grad(loss, argnums=(0, 1))(bias, jnp.zeros((2, 4)))
    for grad in grads:
        assert np.all(np.isfinite(grad)), grad
        np.testing.assert_allclose(grad, np.zeros_like(grad), atol=1e-30)


@pytest.mark.slow
def test_a_large_temperature_gives_the_oracle():
    hidden, unembedding, bias = _problem(seed=6, scale=30.0)
    rounded = _rounded(jnp.float32, hidden, unembedding, bias)
    logits = _logits(*rounded, temperature=100.0)
    truncation = dict(top_p=0.5, max_kept=37)
    expected, margin = _oracle_supports(logits, **truncation)
    assert margin > 1e-4
    dist = _dist(hidden, unembedding, bias, temperature=100.0, **truncation)
    np.testing.assert_array_equal(dist.support(), expected)
    _close(
        dist.full_entropy(), categorical_entropy_float64(masked_log_softmax_float64(logits)), 1e-5
    )
    _close(dist.entropy(), categorical_entropy_float64(_on_support(logits, expected)), 1e-5)


@pytest.mark.parametrize("shared", [slow(True, id="shared"), slow(False, id="per-row")])
def test_forbidden_tokens_have_probability_zero_and_a_forbidden_row_is_nan(shared):
    hidden, unembedding, bias = _problem(seed=7)
    # The most probable token of every row forbidden, with token 0; the last row (per
    # row) forbids everything.
    logits = _logits(*_rounded(jnp.float32, hidden, unembedding, bias))
    if shared:
        mask = np.ones(V, bool)
        mask[[0, int(np.argmax(logits[0]))]] = False
    else:
        mask = np.ones((N, V), bool)
        mask[np.arange(N), np.argmax(logits, -1)] = False
        mask[:, 0] = False
        mask[-1] = False
    masked = np.where(mask, logits, -np.inf)
    log_probs = masked_log_softmax_float64(masked)
    rows, tokens = _every_token(hidden)
    every_mask = np.repeat(mask, V, 0) if not shared else mask
    every = _dist(rows, unembedding, bias, mask=jnp.asarray(every_mask))
    got = np.asarray(every.full_log_prob(jnp.asarray(tokens))).reshape(N, V)
    _close(got, log_probs, 1e-5)
    forbidden = ~np.broadcast_to(mask, (N, V))
    live = ~forbidden.all(-1)
    assert np.all(got[forbidden & live[:, None]] == -np.inf)
    dist = _dist(hidden, unembedding, bias, mask=jnp.asarray(mask))
    _close(dist.full_entropy(), categorical_entropy_float64(log_probs), 1e-5)
    np.testing.assert_array_equal(np.asarray(dist.mode())[live], np.argmax(masked, -1)[live])
    truncated = _dist(hidden, unembedding, bias, mask=jnp.asarray(mask), top_p=0.9, max_kept=16)
    support = np.asarray(truncated.support())
    assert not np.any(forbidden[np.arange(N)[:, None], np.maximum(support, 0)] & (support >= 0))
    keys = jax.random.split(jax.random.key(1), (64, N))
    for d in (dist, truncated):
        drawn = np.asarray(jax.vmap(lambda k, d=d: _tokens(d.sample_replay_data(seed=k)))(keys))
        assert not np.any(forbidden[np.arange(N), drawn][:, live])
        if not live.all():
            assert np.all(drawn[:, ~live] == 0)
    if not shared:
        # The row without an allowed token: NaN scores and entropy, mode 0.
        for d in (dist, truncated):
            assert np.isnan(np.asarray(d.entropy())[-1])
            assert np.asarray(d.mode())[-1] == 0
            assert np.all(np.isnan(got[-1]))
        assert np.isnan(np.asarray(truncated.log_prob(jnp.zeros(N, jnp.int32)))[-1])
        assert np.all(support[-1] == -1)
    # Gradient exactly zero on the columns forbidden in every row.
    everywhere = forbidden[live].all(0)
    assert everywhere.any()

    def loss(w, b):
        d = _dist(hidden[live], w, b, mask=jnp.asarray(mask if shared else mask[live]))
        return (d.full_entropy() + d.full_log_prob(jnp.asarray(np.argmax(masked[live], -1)))).sum()

    grads = jax.grad(loss, argnums=(0, 1))(
        jnp.asarray(unembedding, jnp.float32), jnp.asarray(bias, jnp.float32)
    )
    assert np.all(np.asarray(grads[0])[:, everywhere] == 0)
    assert np.all(np.asarray(grads[1])[everywhere] == 0)
    assert np.abs(np.asarray(grads[1])[~everywhere]).max() > 1e-3


def _tokens(data):
    return data["token"] if isinstance(data, dict) else data


@pytest.mark.slow
def test_bfloat16_unembedding_accumulates_in_float32():
    hidden, unembedding, bias = _problem(seed=8)
    weights = jnp.asarray(unembedding, jnp.bfloat16)
    rounded = np.asarray(weights.astype(jnp.float32), np.float64)
    hidden32, bias32 = _rounded(jnp.float32, hidden, bias)
    logits = _logits(hidden32, rounded, bias32)
    log_probs = masked_log_softmax_float64(logits)
    dist = TokenCategorical(
        jnp.asarray(hidden, jnp.float32), weights, jnp.asarray(bias, jnp.float32), block=BLOCK
    )
    assert dist.full_entropy().dtype == jnp.float32
    _close(dist.full_entropy(), categorical_entropy_float64(log_probs), 1e-5)
    tokens = np.arange(N) * 3
    _close(dist.full_log_prob(jnp.asarray(tokens)), log_probs[np.arange(N), tokens], 1e-5)
    truncation = dict(top_k=5, top_p=0.9, max_kept=8)
    expected, margin = _oracle_supports(logits, **truncation)
    assert margin > 1e-4
    truncated = TokenCategorical(
        jnp.asarray(hidden, jnp.float32), weights, jnp.asarray(bias, jnp.float32), **truncation
    )
    np.testing.assert_array_equal(truncated.support(), expected)
    _close(truncated.entropy(), categorical_entropy_float64(_on_support(logits, expected)), 1e-5)

    def loss(h, w):
        d = TokenCategorical(h, w, jnp.asarray(bias, jnp.float32), block=BLOCK)
        return (d.full_entropy() + d.full_log_prob(jnp.asarray(tokens))).sum()

    grads = jax.grad(loss, argnums=(0, 1))(jnp.asarray(hidden, jnp.float32), weights)
    assert grads[1].dtype == jnp.bfloat16
    with jax.enable_x64(True):
        want = jax.grad(
            lambda h, w: (
                jnp.take_along_axis(
                    _dense_log_probs(h, w, jnp.asarray(bias32), 1.0, True), tokens[:, None], -1
                ).sum()
                + _dense_entropy(_dense_log_probs(h, w, jnp.asarray(bias32), 1.0, True)).sum()
            ),
            argnums=(0, 1),
        )(jnp.asarray(hidden32), jnp.asarray(rounded))
    np.testing.assert_allclose(grads[0], want[0], rtol=1e-4, atol=1e-5)
    # The weights' gradient is rounded to bfloat16 (8 bits): 2^-7 of its size.
    np.testing.assert_allclose(
        np.asarray(grads[1], np.float64), want[1], rtol=2**-7, atol=1e-3 * np.abs(want[1]).max()
    )


# Batch invariance: a token's values are the same bits in any batch.


def _per_token_values(hidden, unembedding, bias, tokens, keys, every=True):
    """The per-token values, for the tokens of ``hidden`` ``[n, D]`` (``every``: also
    the untruncated sample, the mode and the gradient)."""
    options = dict(block=BLOCK, temperature=0.9)
    full = TokenCategorical(hidden, unembedding, bias, **options)
    truncated = TokenCategorical(hidden, unembedding, bias, top_p=0.9, max_kept=8, **options)
    data = truncated.sample_replay_data(seed=keys)
    values = {
        "full_log_prob": full.full_log_prob(tokens),
        "full_entropy": full.full_entropy(),
        "support": truncated.support(),
        "sample": data["token"],
        "sampled_support": data["support"],
        "replayed": truncated.replay(data)[1],
    }
    if every:
        values["full_sample"] = full.sample_replay_data(seed=keys)
        values["mode"] = full.mode()
        values["grad_hidden"] = jax.grad(
            lambda h: TokenCategorical(h, unembedding, bias, **options).full_log_prob(tokens).sum()
        )(hidden)
    return values


@pytest.mark.parametrize(
    "jit, every",
    [
        slow(False, True, id="eager"),
        slow(True, True, id="jit"),
        # The default tier's decode-loop pattern (test_tokens_replay.py) checks the same.
        slow(True, False, id="jit-values"),
    ],
)
def test_a_tokens_values_do_not_depend_on_its_batch(jit, every):
    n = 37
    hidden, unembedding, bias = (jnp.asarray(a, jnp.float32) for a in _problem(n=n, seed=9))
    tokens = jnp.asarray(np.arange(n) * 5 % V)
    keys = jax.random.split(jax.random.key(0), n)
    compute = functools.partial(_per_token_values, every=every)
    compute = jax.jit(compute) if jit else compute
    everything = compute(hidden, unembedding, bias, tokens, keys)
    assert len(everything) == (9 if every else 6)
    for count in (1, 8):
        part = compute(hidden[:count], unembedding, bias, tokens[:count], keys[:count])
        for name, value in part.items():
            np.testing.assert_array_equal(
                value, everything[name][:count], err_msg=f"{count} {name}"
            )


# A vocabulary sharded over four devices, in a subprocess (the device count is fixed
# when jax starts).


@pytest.mark.slow
def test_a_vocabulary_sharded_over_devices_gives_the_unsharded_values():
    result = subprocess.run(
        [sys.executable, "-m", "tests._token_shards_script"],
        cwd=REPO_ROOT,
        env=cpu_devices_environment(4),
        capture_output=True,
        text=True,
        timeout=600,
    )
    if result.returncode != 0:
        pytest.fail(f"the sharded checks crashed:\n{result.stderr[-4000:]}")
    checks = json.loads(result.stdout.strip().splitlines()[-1])
    assert checks, "no checks ran"
    for name, (passed, detail) in checks.items():
        assert passed, f"{name}: {detail}"


# Replay.


@jax.jit
def _replay_jitted(hidden, unembedding, bias, data):
    dist = TokenCategorical(hidden, unembedding, bias, top_p=0.8, max_kept=16, block=BLOCK)
    return dist.replay(data)[1]


@pytest.mark.slow
def test_a_jitted_sample_replays_bit_for_bit_eagerly_and_jitted():
    hidden, unembedding, bias = (jnp.asarray(a, jnp.float32) for a in _problem(seed=10))

    @jax.jit
    def sample(h, w, b, key):
        dist = TokenCategorical(h, w, b, top_p=0.8, max_kept=16, block=BLOCK)
        return dist.sample_with_replay(seed=key)

    _, data, log_prob = sample(hidden, unembedding, bias, jax.random.key(3))
    np.testing.assert_array_equal(_replay_jitted(hidden, unembedding, bias, data), log_prob)
    stored = jax.tree.map(np.asarray, data)
    eager = _dist(hidden, unembedding, bias, top_p=0.8, max_kept=16)
    np.testing.assert_array_equal(eager.replay(stored)[1], log_prob)


def test_replay_gives_the_sampled_log_prob_bit_for_bit():
    hidden, unembedding, bias = _problem(seed=10)
    dist = _dist(hidden, unembedding, bias, top_p=0.8, max_kept=16)
    token, data, log_prob = dist.sample_with_replay(seed=jax.random.key(3))
    np.testing.assert_array_equal(dist.replay(data)[1], log_prob)
    np.testing.assert_array_equal(dist.replay(data)[0], token)
    stored = jax.tree.map(np.asarray, data)  # through host memory
    np.testing.assert_array_equal(dist.replay(dist.check_replay_data(stored))[1], log_prob)
    # Under jax.jit, from the parameters, as a loss pass computes it.
    args = [jnp.asarray(a, jnp.float32) for a in (hidden, unembedding, bias)]
    np.testing.assert_array_equal(_replay_jitted(*args, stored), log_prob)
    # The first PPO ratio is exactly 1.
    assert np.all(np.exp(np.asarray(_replay_jitted(*args, stored)) - np.asarray(log_prob)) == 1.0)
    # Scored on the whole vocabulary instead, the ratio is the kept mass.
    logits = _logits(*_rounded(jnp.float32, hidden, unembedding, bias))
    full = np.exp(masked_log_softmax_float64(logits))
    support = np.asarray(data["support"])
    kept_mass = np.where(support >= 0, np.take_along_axis(full, np.maximum(support, 0), -1), 0)
    kept_mass = kept_mass.sum(-1)
    ratio = np.exp(np.asarray(dist.full_log_prob(token)) - np.asarray(log_prob))
    np.testing.assert_allclose(ratio, kept_mass, rtol=1e-5)
    np.testing.assert_allclose(dist.support_mass(data["support"]), kept_mass, rtol=1e-5)
    assert np.all(kept_mass < 1 - 1e-3) and np.all(kept_mass >= 0.8 - 1e-6)


@pytest.mark.slow
def test_deterministic_replay_data_is_the_mode_on_the_current_support():
    hidden, unembedding, bias = _problem(seed=11)
    dist = _dist(hidden, unembedding, bias, top_k=4, max_kept=4)
    data = dist.deterministic_replay_data()
    np.testing.assert_array_equal(data["token"], dist.mode())
    np.testing.assert_array_equal(data["support"], dist.support())
    np.testing.assert_array_equal(dist.replay(data)[1], dist.log_prob(dist.mode()))
    full = _dist(hidden, unembedding, bias)
    np.testing.assert_array_equal(full.deterministic_replay_data(), full.mode())
    np.testing.assert_array_equal(full.replay(full.mode())[1], full.full_log_prob(full.mode()))
    with pytest.raises(TypeError, match=r"replays \{'token', 'support'\}"):
        dist.check_replay_data(np.zeros(N, np.int32))
    with pytest.raises(TypeError, match="a support must be integer ids"):
        dist.check_replay_data({"token": np.zeros(N, np.int32), "support": np.zeros((N, 4))})
    with pytest.raises(TypeError, match=r"replay data\['token'\] must be integer token ids"):
        dist.check_replay_data({"token": np.zeros(N - 1, np.int32), "support": data["support"]})
    with pytest.raises(TypeError, match="replay data must be integer token ids"):
        full.check_replay_data(np.zeros(N, np.float32))
    with pytest.raises(TypeError, match="rollout_extras must be integer token ids"):
        full.check_replay_data(np.zeros(N, np.float32), "rollout_extras")


# Sampling frequencies.


def _frequencies(dist_of_rows, draws, seed):
    keys = jax.random.split(jax.random.key(seed), draws)
    data = dist_of_rows(draws).sample_replay_data(seed=keys)
    return np.asarray(_tokens(data)), data


@pytest.mark.parametrize(
    "draws, truncation",
    [
        slow(4000, dict(top_k=6, top_p=0.9, max_kept=8), id="truncated-4000"),
        slow(4000, {}, id="full-4000"),
        slow(20000, dict(top_k=6, top_p=0.9, max_kept=8), id="truncated-20000"),
        slow(20000, dict(min_p=0.05, max_kept=37), id="min_p-20000"),
        slow(20000, {}, id="full-20000"),
    ],
)
def test_samples_follow_the_truncated_probabilities(draws, truncation):
    hidden, unembedding, bias = _problem(n=1, seed=12)
    logits = _logits(*_rounded(jnp.float32, hidden, unembedding, bias), temperature=1.2)
    if truncation:
        support, _ = _oracle_supports(logits, **truncation)
        probs = np.exp(_on_support(logits, support))[0]
    else:
        probs = np.exp(masked_log_softmax_float64(logits))[0]
    drawn, data = _frequencies(
        lambda n: _dist(np.repeat(hidden, n, 0), unembedding, bias, temperature=1.2, **truncation),
        draws,
        seed=13,
    )
    counts = np.bincount(drawn, minlength=V)
    assert np.all(counts[probs == 0] == 0)
    if truncation:
        np.testing.assert_array_equal(np.asarray(data["support"]), np.repeat(support, draws, 0))
    # Every count within 5 binomial standard deviations of its expectation (a false
    # alarm has probability below 1e-5 for the ~10 tokens of probability >= 1e-3).
    sigma = np.sqrt(draws * probs * (1 - probs))
    assert np.all(np.abs(counts - draws * probs) <= 5 * sigma + 1), (counts, draws * probs)
    # And a chi-square over the tokens expected 5 times or more.
    expected = draws * probs
    big = expected >= 5
    chi2 = (((counts - expected) ** 2)[big] / expected[big]).sum()
    from scipy import stats

    assert stats.chi2.sf(chi2, big.sum() - 1) > 1e-4, chi2


@pytest.mark.slow
def test_distrax_sample_draws_from_the_support():
    hidden, unembedding, bias = _problem(n=2, seed=14)
    dist = _dist(hidden, unembedding, bias, top_k=3, max_kept=4)
    samples = np.asarray(dist.sample(seed=jax.random.key(0), sample_shape=50))
    assert samples.shape == (50, 2)
    support = np.asarray(dist.support())
    for row in range(2):
        assert set(np.unique(samples[:, row])) <= set(support[row][support[row] >= 0])
    assert np.all(np.isfinite(np.asarray(jax.vmap(dist.log_prob)(samples))))


# Imported supports.


def test_support_from_kept_ids_pads_and_refuses_what_no_sampler_keeps():
    np.testing.assert_array_equal(
        support_from_kept_ids([[5, 2], [7]], max_kept=3), [[5, 2, -1], [7, -1, -1]]
    )
    padded = np.array([[4, -1, 1], [-1, 3, -1]])
    np.testing.assert_array_equal(
        support_from_kept_ids(padded, max_kept=2, vocab_size=5), [[4, 1], [3, -1]]
    )
    assert support_from_kept_ids([[0]], max_kept=1).dtype == jnp.int32
    with pytest.raises(ValueError, match=r"token 1 keeps 2 ids \(1 distinct\)"):
        support_from_kept_ids([[1, 2], [3, 3]], max_kept=4)
    with pytest.raises(ValueError, match=r"token 0 keeps 0 ids"):
        support_from_kept_ids([[], [1]], max_kept=4)
    with pytest.raises(ValueError, match=r"token 0 keeps 0 ids"):
        support_from_kept_ids(np.full((1, 3), -1), max_kept=4)
    with pytest.raises(ValueError, match=r"token 0 keeps 3 ids .*max_kept = 2"):
        support_from_kept_ids([[1, 2, 3]], max_kept=2)
    with pytest.raises(ValueError, match=r"outside \[0, 5\): 1\.\.5"):
        support_from_kept_ids([[1, 5]], max_kept=2, vocab_size=5)
    with pytest.raises(ValueError, match=r"outside \[0, .*\): -2\.\.1"):
        support_from_kept_ids([[1, -2]], max_kept=2)
    with pytest.raises(ValueError, match="max_kept must be a positive integer"):
        support_from_kept_ids([[1]], max_kept=0)


@pytest.mark.slow
def test_an_imported_support_scores_as_the_sampled_one():
    hidden, unembedding, bias = _problem(seed=15)
    dist = _dist(hidden, unembedding, bias, top_p=0.8, max_kept=12)
    token, data, log_prob = dist.sample_with_replay(seed=jax.random.key(4))
    support = np.asarray(data["support"])
    # An engine reports the kept ids as sets, in any order.
    rng = np.random.default_rng(0)
    kept = [rng.permutation(row[row >= 0]).tolist() for row in support]
    imported = support_from_kept_ids(kept, max_kept=12, vocab_size=V)
    np.testing.assert_allclose(
        dist.replay({"token": token, "support": imported})[1], log_prob, rtol=1e-6, atol=1e-6
    )
    np.testing.assert_allclose(
        dist.entropy_on_support(imported), dist.entropy_on_support(support), rtol=1e-6
    )
    # Scored on a wider support (one more id), the same token is less probable.
    wider = support_from_kept_ids(
        [[*ids, next(i for i in range(V) if i not in ids)] for ids in kept], max_kept=13
    )
    assert np.all(dist.log_prob_on_support(token, wider) < log_prob)


# Refusals.


def test_bad_arguments_are_refused_with_the_fix():
    hidden, unembedding = jnp.zeros((2, 3)), jnp.zeros((3, 5))
    with pytest.raises(ValueError, match=r"hidden must be .* with the same D"):
        TokenCategorical(jnp.zeros((2, 4)), unembedding)
    with pytest.raises(ValueError, match="hidden must be"):
        TokenCategorical(jnp.zeros(()), unembedding)
    with pytest.raises(ValueError, match="hidden must be"):
        TokenCategorical(hidden, jnp.zeros(3))
    with pytest.raises(ValueError, match=r"bias must have shape \(5,\)"):
        TokenCategorical(hidden, unembedding, jnp.zeros(4))
    with pytest.raises(TypeError, match="hidden must have a floating dtype"):
        TokenCategorical(jnp.zeros((2, 3), jnp.int32), unembedding)
    with pytest.raises(TypeError, match="mask must be booleans broadcastable"):
        TokenCategorical(hidden, unembedding, mask=jnp.ones(5))
    with pytest.raises(TypeError, match="mask must be booleans broadcastable"):
        TokenCategorical(hidden, unembedding, mask=jnp.ones((3, 2, 5), bool))
    with pytest.raises(TypeError, match="mask must be booleans broadcastable"):
        TokenCategorical(hidden, unembedding, mask=jnp.ones((1, 5), jnp.int32))
    with pytest.raises(ValueError, match="top_k must be at most max_kept = 4"):
        TokenCategorical(hidden, unembedding, top_k=5, max_kept=4)
    with pytest.raises(ValueError, match="top_k must be a positive integer"):
        TokenCategorical(hidden, unembedding, top_k=0)
    for top_p in (0.0, -0.1):
        with pytest.raises(ValueError, match="top_p must be > 0"):
            TokenCategorical(hidden, unembedding, top_p=top_p)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        TokenCategorical(hidden, unembedding, top_p=1.01)
    with pytest.raises(ValueError, match="min_p must be >= 0"):
        TokenCategorical(hidden, unembedding, min_p=-0.01)
    with pytest.raises(ValueError, match=r"min_p must be in \[0, 1\]"):
        TokenCategorical(hidden, unembedding, min_p=1.5)
    for temperature in (0.0, -1.0):
        with pytest.raises(ValueError, match="temperature must be > 0"):
            TokenCategorical(hidden, unembedding, temperature=temperature)
    with pytest.raises(ValueError, match="max_kept must be a positive integer"):
        TokenCategorical(hidden, unembedding, max_kept=0)
    with pytest.raises(ValueError, match="block must be a positive integer"):
        TokenCategorical(hidden, unembedding, block=(0, 4))
    dist = TokenCategorical(hidden, unembedding, top_k=2, max_kept=3)
    with pytest.raises(TypeError, match=r"value must be integer token ids of the batch shape"):
        dist.log_prob(jnp.zeros(2))
    with pytest.raises(TypeError, match=r"value must be integer token ids of the batch shape"):
        dist.full_log_prob(jnp.zeros(3, jnp.int32))
    with pytest.raises(TypeError, match="a support must be integer ids"):
        dist.support_log_probs(jnp.zeros((3, 3), jnp.int32))
    with pytest.raises(ValueError, match="seed must be one key or one key per batch element"):
        dist.sample_replay_data(seed=jax.random.split(jax.random.key(0), 3))


def test_a_mask_of_the_wrong_vocabulary_size_is_refused_with_the_fix():
    with pytest.raises(TypeError, match="mask must be booleans broadcastable to"):
        TokenCategorical(jnp.zeros((2, 3)), jnp.zeros((3, 5)), mask=jnp.ones(6, bool))


@pytest.mark.slow
def test_ids_outside_the_vocabulary_score_minus_infinity():
    hidden, unembedding, bias = _problem(n=4, seed=16)
    values = jnp.array([-2, -1, V, V + 5])
    for dist in (
        _dist(hidden, unembedding, bias),
        _dist(hidden, unembedding, bias, top_k=V, max_kept=V),
    ):
        np.testing.assert_array_equal(dist.log_prob(values), np.full(4, -np.inf))
    np.testing.assert_array_equal(
        _dist(hidden, unembedding, bias).full_log_prob(values), np.full(4, -np.inf)
    )


def test_the_public_names():
    assert samplers.TokenCategorical is TokenCategorical
    assert samplers.support_from_kept_ids is support_from_kept_ids


def test_the_first_ratio_is_exactly_one_in_a_program_that_differentiates_it():
    # The rollout samples in one jitted program; the loss replays in another that also
    # takes the gradient, where XLA is free to fuse the log-softmax differently.
    rows = 256
    hidden = jax.random.normal(jax.random.key(0), (rows, 64))
    unembedding = jax.random.normal(jax.random.key(100), (64, 16)) / 4

    @jax.jit
    def rollout(hidden, unembedding, key):
        dist = samplers.TokenCategorical(hidden, unembedding, top_p=0.8, max_kept=16)
        return dist.sample_with_replay(seed=key)

    def loss(hidden, unembedding, data, stored):
        dist = samplers.TokenCategorical(hidden, unembedding, top_p=0.8, max_kept=16)
        ratio = jnp.exp(dist.replay(data)[1] - stored)
        return jnp.mean(ratio * jnp.linspace(-1.0, 1.0, rows)), ratio

    for seed in range(2):
        _, data, stored = rollout(hidden, unembedding, jax.random.key(seed))
        step = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))
        (_, ratio), grads = step(hidden, unembedding, data, stored)
        assert np.all(np.asarray(ratio) == 1.0), np.max(np.abs(np.asarray(ratio) - 1.0))
        assert all(np.all(np.isfinite(g)) for g in grads)


@pytest.mark.slow
def test_distrax_seeds_an_integer_a_raw_key_and_a_typed_key_draw_alike():
    dist = samplers.TokenCategorical(
        jax.random.normal(jax.random.key(0), (3, 4)), jnp.ones((4, 9)), top_k=2, max_kept=4
    )
    typed = dist.sample(seed=jax.random.key(5))
    np.testing.assert_array_equal(dist.sample(seed=5), typed)
    np.testing.assert_array_equal(dist.sample(seed=jax.random.PRNGKey(5)), typed)
    assert dist.sample(seed=5, sample_shape=(2,)).shape == (2, 3)
    raw = dist.sample_with_replay(seed=jax.random.PRNGKey(1))[0]
    np.testing.assert_array_equal(raw, dist.sample_with_replay(seed=jax.random.key(1))[0])


# What a GRPO user expects: no truncation at top_p=1 and min_p=0, logits, the tied
# embedding table, per-row options, refused data, padded completions.


@pytest.mark.parametrize(
    "options",
    [
        slow(dict(top_p=1.0), id="top_p=1"),
        pytest.param(dict(min_p=0.0), id="min_p=0"),
        slow(dict(top_p=1.0, min_p=0.0), id="both"),
    ],
)
def test_top_p_one_and_min_p_zero_truncate_nothing(options):
    hidden, unembedding, bias = _problem(seed=20)
    dist = _dist(hidden, unembedding, bias, temperature=0.9, max_kept=4, **options)
    plain = _dist(hidden, unembedding, bias, temperature=0.9, max_kept=4)
    assert not dist.truncated
    key = jax.random.key(0)
    np.testing.assert_array_equal(
        dist.sample_replay_data(seed=key), plain.sample_replay_data(seed=key)
    )
    tokens = jnp.asarray(np.arange(N) * 3 % V)
    np.testing.assert_array_equal(dist.log_prob(tokens), plain.full_log_prob(tokens))


@pytest.mark.slow
def test_from_logits_is_the_distribution_of_the_logits():
    hidden, unembedding, bias = _problem(seed=22)
    logits = _logits(*_rounded(jnp.float32, hidden, unembedding, bias))
    truncation = dict(top_k=6, top_p=0.9, max_kept=8, temperature=0.8)
    dist = TokenCategorical.from_logits(jnp.asarray(logits, jnp.float32), block=BLOCK, **truncation)
    expected, margin = _oracle_supports(
        logits / 0.8, **{k: v for k, v in truncation.items() if k != "temperature"}
    )
    assert margin > 1e-4
    np.testing.assert_array_equal(dist.support(), expected)
    token, data, log_prob = dist.sample_with_replay(seed=jax.random.key(1))
    np.testing.assert_array_equal(dist.replay(data)[1], log_prob)
    on_support = _on_support(logits / 0.8, expected)
    _close(log_prob, on_support[np.arange(N), np.asarray(token)], 1e-5)
    full = TokenCategorical.from_logits(jnp.asarray(logits, jnp.float32), block=BLOCK)
    _close(
        full.full_entropy(), categorical_entropy_float64(masked_log_softmax_float64(logits)), 1e-5
    )

    # Gradients w.r.t. the logits against the dense float64 log-softmax, both paths.
    with jax.enable_x64(True):
        dense = jnp.asarray(logits)
        member = np.zeros((N, V), bool)
        np.put_along_axis(member, np.maximum(expected, 0), expected >= 0, -1)

        def library(x):
            truncated = TokenCategorical.from_logits(x, top_k=6, top_p=0.9, max_kept=8, block=BLOCK)
            untruncated = TokenCategorical.from_logits(x, block=BLOCK)
            data = {"token": jnp.asarray(np.asarray(token)), "support": jnp.asarray(expected)}
            _, lp, ent = truncated.replay_and_entropy(data)
            return (lp + 0.3 * ent + untruncated.full_log_prob(data["token"])).sum()

        def oracle(x):
            on = jax.nn.log_softmax(jnp.where(member, x, -jnp.inf))
            every = jax.nn.log_softmax(x)
            picked = jnp.take_along_axis(on, jnp.asarray(np.asarray(token))[:, None], -1)[:, 0]
            ent = -jnp.where(member, jnp.exp(on) * jnp.where(member, on, 0), 0).sum(-1)
            return (
                picked
                + 0.3 * ent
                + jnp.take_along_axis(every, jnp.asarray(np.asarray(token))[:, None], -1)[:, 0]
            ).sum()

        np.testing.assert_allclose(
            jax.grad(library)(dense), jax.grad(oracle)(dense), rtol=1e-10, atol=1e-12
        )


@pytest.mark.slow
def test_an_embedding_table_is_its_unembedding_transposed():
    hidden, unembedding, bias = _problem(seed=22)
    truncation = dict(top_p=0.9, max_kept=8)
    h, w, b = (jnp.asarray(a, jnp.float32) for a in (hidden, unembedding, bias))
    by_columns = TokenCategorical(h, w, b, block=BLOCK, **truncation)
    by_rows = TokenCategorical(h, None, b, embedding=w.T, block=BLOCK, **truncation)
    key = jax.random.key(2)
    token, data, log_prob = by_rows.sample_with_replay(seed=key)
    np.testing.assert_array_equal(
        by_columns.sample_replay_data(seed=key)["support"], data["support"]
    )
    # A support's logits sum the same products in the same order from rows or columns.
    np.testing.assert_array_equal(by_columns.replay(data)[1], log_prob)
    _close(by_rows.full_entropy(), by_columns.full_entropy(), 1e-6)

    def loss(weights, embedding):
        dist = TokenCategorical(
            h,
            None if embedding else weights,
            b,
            embedding=weights if embedding else None,
            block=BLOCK,
            **truncation,
        )
        _, lp, ent = dist.replay_and_entropy(data)
        full = TokenCategorical(
            h,
            None if embedding else weights,
            b,
            embedding=weights if embedding else None,
            block=BLOCK,
        )
        return (lp + ent + full.full_log_prob(token) + full.full_entropy()).sum()

    np.testing.assert_allclose(
        jax.grad(loss)(w.T, True), jax.grad(loss)(w, False).T, rtol=1e-5, atol=1e-6
    )
    with pytest.raises(
        TypeError, match=r"the unembedding \[D, V\] or the embedding table \[V, D\]"
    ):
        TokenCategorical(h, w, embedding=w.T)
    with pytest.raises(TypeError, match="one of them"):
        TokenCategorical(h)
    with pytest.raises(ValueError, match=r"embedding \[V, D\] with the same D"):
        TokenCategorical(h, embedding=w)


@pytest.mark.slow
def test_options_per_row_are_each_rows_and_compile_once():
    hidden, unembedding, bias = (jnp.asarray(a, jnp.float32) for a in _problem(seed=23))
    rows = {
        "temperature": jnp.linspace(0.5, 2.0, N),
        "top_k": jnp.asarray([3, 0, 5, -1, 8, 2, 0, 4, 6, 1]),
        "top_p": jnp.asarray([0.9, 1.0, 1.0, 0.8, 0.95, 1.0, 1.0, 0.99, 0.6, 1.0]),
        "min_p": jnp.asarray([0.0, 0.0, 0.0, 0.05, 0.0, 0.2, 0.0, 0.0, 0.3, 0.0]),
    }
    traces = []

    @jax.jit
    def support(h, w, b, options):
        traces.append(None)
        return TokenCategorical(h, w, b, max_kept=8, block=BLOCK, **options).support()

    got = np.asarray(support(hidden, unembedding, bias, rows))
    for row in range(N):
        options = {name: value[row].item() for name, value in rows.items()}
        if options["top_k"] <= 0:
            del options["top_k"]
        alone = _dist(np.asarray(hidden[row : row + 1]), unembedding, bias, max_kept=8, **options)
        if alone.truncated:
            np.testing.assert_array_equal(
                got[row], np.asarray(alone.support())[0], err_msg=str(row)
            )
        else:  # top_p 1, min_p 0, no top_k: drawn from the whole vocabulary
            np.testing.assert_array_equal(got[row], [FULL] + [-1] * 7)
    other = {name: value[::-1] for name, value in rows.items()}
    support(hidden, unembedding, bias, other)
    assert len(traces) == 1  # new values, no new program

    # A row drawn untruncated replays on the whole vocabulary, bit for bit.
    dist = TokenCategorical(hidden, unembedding, bias, max_kept=8, block=BLOCK, **rows)
    token, data, log_prob = dist.sample_with_replay(seed=jax.random.key(3))
    full_rows = np.asarray(data["support"])[:, 0] == FULL
    assert full_rows.sum() == 2
    np.testing.assert_array_equal(dist.replay(data)[1], log_prob)
    temperature = np.asarray(rows["temperature"])
    for row in np.flatnonzero(full_rows):
        plain = _dist(
            np.asarray(hidden[row : row + 1]),
            unembedding,
            bias,
            temperature=float(temperature[row]),
        )
        np.testing.assert_array_equal(log_prob[row], plain.full_log_prob(token[row : row + 1])[0])
        np.testing.assert_array_equal(
            dist.entropy_on_support(data["support"])[row], plain.full_entropy()[0]
        )
    np.testing.assert_array_equal(np.asarray(dist.support_mass(data["support"]))[full_rows], 1.0)


def test_bad_options_per_row_are_refused_where_concrete_and_nan_where_traced():
    hidden, unembedding = jnp.zeros((3, 2)), jnp.zeros((2, 5))
    with pytest.raises(
        ValueError,
        match=r"temperature must be > 0.0, got 0; temperature 0 is greedy decoding: take "
        r"dist.mode\(\)",
    ):
        TokenCategorical(hidden, unembedding, temperature=0)
    with pytest.raises(
        ValueError,
        match=r"temperature must be > 0 and finite in every row, got 0.0 .*dist.mode\(\)",
    ):
        TokenCategorical(hidden, unembedding, temperature=jnp.asarray([1.0, 0.0, 2.0]))
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\] in every row, got 1.5"):
        TokenCategorical(hidden, unembedding, top_p=jnp.asarray([0.5, 1.5, 1.0]))
    with pytest.raises(ValueError, match=r"min_p must be in \[0, 1\] in every row, got -0.1"):
        TokenCategorical(hidden, unembedding, min_p=np.asarray([0.0, -0.1, 0.2]))
    with pytest.raises(ValueError, match=r"top_k must be at most max_kept = 4 .* got 5"):
        TokenCategorical(hidden, unembedding, top_k=jnp.asarray([1, 5, 2]), max_kept=4)
    with pytest.raises(
        TypeError,
        match=r"top_k must be a number or a integer array broadcastable to the batch shape \(3,\)",
    ):
        TokenCategorical(hidden, unembedding, top_k=jnp.asarray([1.0, 2.0, 3.0]))
    with pytest.raises(
        TypeError,
        match=r"top_p must be .* broadcastable to the batch shape \(3,\), got float32 \(4,\)",
    ):
        TokenCategorical(hidden, unembedding, top_p=jnp.ones(4))

    @jax.jit
    def entropy(temperature):
        return TokenCategorical(hidden, unembedding, temperature=temperature).full_entropy()

    got = np.asarray(entropy(jnp.asarray([1.0, 0.0, -1.0])))
    np.testing.assert_allclose(got[0], np.log(5), rtol=1e-6)
    assert np.all(np.isnan(got[1:]))


def test_replay_refuses_data_not_its_own_with_the_fix():
    hidden, unembedding, bias = _problem(seed=24)
    truncated = _dist(hidden, unembedding, bias, top_p=0.9, max_kept=8)
    full = _dist(hidden, unembedding, bias)
    data = truncated.sample_replay_data(seed=jax.random.key(0))
    token = data["token"]
    with pytest.raises(TypeError, match=r"replay data must be an array of numbers, got 'abc'"):
        full.replay("abc")
    with pytest.raises(TypeError, match=r"replays \{'token', 'support'\}, got tuple"):
        truncated.replay((token, data["support"]))
    with pytest.raises(
        TypeError, match=r"replays \{'token', 'support'\}, got a dict with \['token'\]"
    ):
        truncated.replay({"token": token})
    with pytest.raises(
        TypeError, match=r"an untruncated TokenCategorical replays the stored token ids alone"
    ):
        full.replay(data)
    support = np.asarray(data["support"]).copy()
    support[2, 1] = V
    with pytest.raises(
        ValueError, match=rf"holds id {V} \(row 2\), outside the vocabulary \[0, {V}\)"
    ):
        truncated.replay({"token": token, "support": support})
    support[2, 1] = -1
    support[4] = -1
    with pytest.raises(ValueError, match=r"the stored support of row 4 holds no id"):
        truncated.replay({"token": token, "support": support})
    # Traced, where its values cannot be checked: NaN for such rows.
    support[4, 0] = V + 3
    got = np.asarray(
        jax.jit(lambda d: truncated.replay(d)[1])({"token": token, "support": support})
    )
    others = np.delete(got, 4)
    assert np.isnan(got[4]) and not np.any(np.isnan(others))
    support[4] = -1
    got = np.asarray(
        jax.jit(lambda d: truncated.replay(d)[1])({"token": token, "support": support})
    )
    assert np.isnan(got[4])


def test_replay_and_entropy_scores_and_entropies_in_one_pass():
    hidden, unembedding, bias = _problem(seed=25)
    logits = _logits(*_rounded(jnp.float32, hidden, unembedding, bias))
    for options in (dict(top_p=0.9, max_kept=8), {}):
        dist = _dist(hidden, unembedding, bias, **options)
        token, data, log_prob = dist.sample_with_replay(seed=jax.random.key(4))
        got_token, got_log_prob, entropy = dist.replay_and_entropy(data)
        np.testing.assert_array_equal(got_token, token)
        np.testing.assert_array_equal(got_log_prob, log_prob)  # bit for bit
        if options:
            np.testing.assert_array_equal(entropy, dist.entropy_on_support(data["support"]))
            _close(
                entropy,
                categorical_entropy_float64(_on_support(logits, np.asarray(data["support"]))),
                1e-5,
            )
        else:
            np.testing.assert_array_equal(entropy, dist.full_entropy())
            _close(entropy, categorical_entropy_float64(masked_log_softmax_float64(logits)), 1e-5)

        # One pass: one gather of the support, or one stream over the vocabulary.
        def both(h, d=data, options=options):
            return _dist(h, unembedding, bias, **options).replay_and_entropy(d)[1:]

        jaxpr = str(jax.make_jaxpr(both)(jnp.asarray(hidden, jnp.float32)))
        assert jaxpr.count("custom_vjp_call") == 1, jaxpr.count("custom_vjp_call")


@pytest.mark.parametrize(
    "truncation", [slow(dict(top_p=0.9, max_kept=8), id="top_p"), slow({}, id="full")]
)
def test_completions_padded_after_their_end_are_masked_out_of_the_loss(truncation):
    # A rollout of 6 steps; completions end at steps 2..6, and the tokens after an end
    # are stored as -1 (padding), so they score -inf: the loss masks them with a double
    # where, on the new and the stored log-probabilities, as the guide shows.
    steps, rows = 6, N
    hidden = jnp.asarray(np.random.default_rng(26).normal(size=(steps, rows, D)), jnp.float32)
    unembedding = jnp.asarray(_problem(seed=26)[1], jnp.float32)
    dist = TokenCategorical(hidden, unembedding, block=BLOCK, **truncation)
    token, data, stored = dist.sample_with_replay(seed=jax.random.key(5))
    ends = jnp.asarray(np.arange(rows) % 5 + 2)
    valid = jnp.arange(steps)[:, None] < ends[None]
    padded_token = jnp.where(valid, token, -1)
    data = {**data, "token": padded_token} if isinstance(data, dict) else padded_token
    stored = jnp.where(valid, stored, -jnp.inf)  # what a rollout that stops writes
    advantage = jnp.asarray(np.random.default_rng(27).normal(size=rows), jnp.float32)

    def loss(h):
        log_prob = TokenCategorical(h, unembedding, block=BLOCK, **truncation).replay(data)[1]
        new = jnp.where(valid, log_prob, 0.0)
        old = jnp.where(valid, stored, 0.0)
        ratio = jnp.exp(new - old)
        weight = advantage[None]
        per_token = jnp.minimum(ratio * weight, jnp.clip(ratio, 0.8, 1.2) * weight)
        return -(per_token * valid).sum() / valid.sum(), ratio

    (value, ratio), grad = jax.jit(jax.value_and_grad(loss, has_aux=True))(hidden)
    assert np.isfinite(value) and np.all(np.isfinite(grad))
    assert np.all(np.asarray(ratio) == 1.0)
    assert np.all(np.asarray(grad)[~np.asarray(valid)] == 0) and np.any(np.asarray(grad) != 0)
    # Without the double where, a float mask (TRL's completion_mask) leaves NaN:
    # exp(-inf - -inf) * 0.
    naive = jnp.exp(dist.replay(data)[1] - stored) * valid.astype(jnp.float32)
    assert np.isnan(np.asarray(naive)[~np.asarray(valid)]).all()


def test_support_from_kept_ids_takes_leading_axes_and_jax_arrays():
    kept = np.full((2, 3, 4), -1)
    kept[..., 0] = np.arange(6).reshape(2, 3)
    kept[1, 2, 1:3] = [7, 9]
    got = support_from_kept_ids(jnp.asarray(kept), max_kept=5, vocab_size=10)
    assert got.shape == (2, 3, 5) and got.dtype == jnp.int32
    np.testing.assert_array_equal(got[..., :4], kept)
    np.testing.assert_array_equal(got[..., 4], -1)
    np.testing.assert_array_equal(support_from_kept_ids(kept, max_kept=5), got)
    with pytest.raises(ValueError, match=r"token 5 keeps ids outside \[0, 8\): 5..9"):
        support_from_kept_ids(kept, max_kept=5, vocab_size=8)
    with pytest.raises(TypeError, match="takes concrete ids"):
        jax.jit(lambda k: support_from_kept_ids(k, max_kept=5))(jnp.asarray(kept))
