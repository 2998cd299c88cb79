"""``MultiDiscrete`` and ``MultiBinary`` against float64 NumPy/scipy formulas written from
the definitions: uneven sub-action sizes, flat and per-part masks, masked logits of NaN,
+-inf and 1e30, sub-actions and bits with one allowed choice or none, logits far apart."""

import functools
import itertools

import distrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import special

import samplers
from tests._tiers import slow
from tests.reference import categorical_entropy_float64, masked_log_softmax_float64

NVEC = (3, 1, 5, 2)
INF, NAN = np.inf, np.nan

# Rows of flat logits [rows, sum(NVEC)] (sub-actions separated by |) and their masks.
# Masked entries hold values that must reach no output.
LOGITS = np.array(
    [
        [0.3, -1.2, 2.0, 0.7, 1.5, -0.4, 0.0, 2.2, -3.0, 0.9, -0.9],
        [0.3, NAN, 2.0, 0.7, INF, 0.5, 1e30, -1.0, 0.2, 0.4, -INF],
        [80.0, -80.0, 0.0, -5.0, 1e30, NAN, -INF, 0.3, INF, 40.0, -40.0],
        [0.3, -1.2, 2.0, 0.7, 1.5, -0.4, 0.0, 2.2, -3.0, 0.9, -0.9],
        [0.3, -INF, 2.0, 0.7, -1e4, 0.5, 3.0, 3.0, 3.0, 0.4, 0.4],
    ]
)
T, F = True, False
MASK = np.array(
    [
        [T, T, T, T, T, T, T, T, T, T, T],
        [T, F, T, T, F, T, F, T, T, T, F],  # one allowed choice in sub-action 3
        [T, T, T, T, F, F, F, T, F, T, T],  # one allowed choice in sub-action 2
        [T, T, T, T, F, F, F, F, F, T, T],  # no allowed choice in sub-action 2
        [T, T, T, T, T, T, T, T, T, T, T],  # an allowed logit of -inf: probability 0
    ]
)
NO_CHOICE_ROW, NO_CHOICE_PART = 3, 2
ROWS_WITH_A_DISTRIBUTION = [0, 1, 2, 4]
# Every joint action of NVEC, [30, 4].
JOINT = np.array(list(itertools.product(*(range(n) for n in NVEC))))


def _split(values, nvec=NVEC):
    return np.split(values, np.cumsum(nvec)[:-1], axis=-1)


def _md_oracle(logits, mask, nvec=NVEC):
    """float64 per sub-action log-probabilities [rows, n_i] (``-inf`` masked, NaN for a
    sub-action without an allowed choice) and entropies [rows, len(nvec)]."""
    logits = np.asarray(logits, np.float64)
    parts, entropies = [], []
    for x, m in zip(_split(logits, nvec), _split(mask, nvec), strict=True):
        log_probs = masked_log_softmax_float64(x, m)
        parts.append(log_probs)
        entropies.append(categorical_entropy_float64(log_probs))
    return parts, np.stack(entropies, axis=-1)


def _md_log_prob(parts, actions):
    """The joint log-probability of ``actions`` [..., rows, len(nvec)]."""
    rows = np.arange(parts[0].shape[0])
    return sum(part[rows, actions[..., i]] for i, part in enumerate(parts))


def _md(dtype=jnp.float32, logits=LOGITS, mask=MASK, nvec=NVEC):
    return samplers.MultiDiscrete(jnp.asarray(logits, dtype), nvec, jnp.asarray(mask))


def _rounded(values, dtype):
    """``values`` as the library receives them in ``dtype``, in float64."""
    return np.asarray(np.asarray(values).astype(dtype), np.float64)


N = 40_000  # samples per row for the frequency checks
ACTION = np.array([[2, 0, 4, 1], [0, 0, 1, 0], [1, 0, 3, 1], [0, 0, 0, 0], [0, 0, 2, 1]])
# A sub-action outside its range in each row: above nvec[i], inside the padding, negative.
OUTSIDE = np.array([[3, 0, 0, 0], [0, 1, 0, 0], [0, 0, 5, 0], [0, 0, 0, 2], [-1, 0, 0, 0]])


@functools.partial(jax.jit, static_argnames=("sample",))
def _md_program(logits, mask, parts, key, sample):
    """What the MultiDiscrete tests compare, traced once per dtype (and ``sample``).

    ``parts`` is ``mask`` split per sub-action, for a second distribution built from it.
    The losses sum over the rows with a distribution, as a loss that drops the others.
    """
    rows = jnp.asarray(ROWS_WITH_A_DISTRIBUTION)
    make = lambda x, m=mask: samplers.MultiDiscrete(x, NVEC, m)  # noqa: E731

    def outputs(dist):
        return {
            "log_prob": dist.log_prob(jnp.asarray(JOINT[:, None, :])),  # [30, rows]
            "entropy": dist.entropy(),
            "part_entropy": dist.distribution.entropy(),  # [rows, len(NVEC)]
            "mode": dist.mode(),
            "outside": dist.log_prob(jnp.asarray(OUTSIDE)),
            # The padded choices that sample() draws from: equal, so are the samples.
            "choice_logits": dist.distribution.logits,
            "choice_mask": dist.distribution.mask,
        }

    dist = make(logits)
    got = {
        **outputs(dist),
        "per_part": outputs(make(logits, parts)),
        "grad_log_prob": jax.grad(lambda x: make(x).log_prob(jnp.asarray(ACTION))[rows].sum())(
            logits
        ),
        "grad_entropy": jax.grad(lambda x: make(x).entropy()[rows].sum())(logits),
    }
    if sample:
        # The user's idiom: a = dist.sample(seed, n); dist.log_prob(a), and its gradient.
        samples = dist.sample(seed=key, sample_shape=N)
        got["sample"] = samples
        got["sample_log_prob"] = dist.log_prob(samples)
        got["sample_grad"] = jax.grad(lambda x: make(x).log_prob(samples)[:, rows].sum())(logits)
    return got


def _md_results(dtype_name, clean=False, sample=None):
    """``_md_program`` on LOGITS (or with the masked logits replaced by 0), as NumPy;
    with samples by default in float32 only."""
    return _md_run(dtype_name, clean, dtype_name == "float32" if sample is None else sample)


@functools.cache
def _md_run(dtype_name, clean, sample):
    dtype = jnp.dtype(dtype_name)
    logits = np.where(MASK, LOGITS, 0.0) if clean else LOGITS
    with jax.enable_x64(dtype == jnp.float64):
        parts = tuple(jnp.asarray(m) for m in _split(MASK))
        out = _md_program(
            jnp.asarray(logits, dtype), jnp.asarray(MASK), parts, jax.random.key(0), sample
        )
        return jax.tree.map(np.asarray, out)


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), slow("float64", 1e-13)])
def test_multi_discrete_log_prob_of_every_joint_action_and_entropy_match_float64(dtype, tol):
    got = _md_results(dtype)
    parts, entropies = _md_oracle(_rounded(LOGITS, dtype), MASK)
    log_prob = got["log_prob"].astype(np.float64)
    expected = _md_log_prob(parts, np.broadcast_to(JOINT[:, None, :], (*log_prob.shape, 4)))
    np.testing.assert_allclose(log_prob, expected, rtol=tol, atol=tol)
    np.testing.assert_allclose(got["entropy"], entropies.sum(-1), rtol=tol, atol=tol)
    np.testing.assert_allclose(got["part_entropy"], entropies, rtol=tol, atol=tol)
    # The joint probabilities of every row with a distribution sum to 1.
    totals = special.logsumexp(log_prob, axis=0)
    np.testing.assert_allclose(totals[ROWS_WITH_A_DISTRIBUTION], 0.0, atol=10 * tol)
    # A sub-action without an allowed choice makes its row NaN, whatever the action.
    assert np.all(np.isnan(log_prob[:, NO_CHOICE_ROW])) and np.isnan(got["entropy"][NO_CHOICE_ROW])
    assert np.isnan(got["part_entropy"][NO_CHOICE_ROW, NO_CHOICE_PART])
    assert np.all(np.isfinite(np.delete(got["part_entropy"][NO_CHOICE_ROW], NO_CHOICE_PART)))
    # A masked choice scores exactly -inf.
    masked = np.zeros(log_prob.shape, bool)
    for i, m in enumerate(_split(MASK)):
        masked |= ~m[:, JOINT[:, i]].T
    masked[:, NO_CHOICE_ROW] = False
    assert masked.sum() > 40 and np.all(log_prob[masked] == -INF)
    # So does a sub-action outside its range (NaN in the row without a distribution).
    assert np.all(np.delete(got["outside"], NO_CHOICE_ROW) == -INF)
    assert np.isnan(got["outside"][NO_CHOICE_ROW])


def test_multi_discrete_a_sub_action_with_one_allowed_choice_is_certain():
    got = _md_results("float32")
    # Row 1: sub-action 3 allows only choice 0; row 2: sub-action 2 only choice 3.
    assert got["part_entropy"][1, 3] == 0 and got["part_entropy"][2, 2] == 0
    assert np.all(got["mode"][[1, 2], [3, 2]] == [0, 3])
    assert np.all(got["sample"][:, 1, 3] == 0) and np.all(got["sample"][:, 2, 2] == 3)
    parts, _ = _md_oracle(LOGITS, MASK)
    assert parts[3][1, 0] == 0 and parts[2][2, 3] == 0


def test_multi_discrete_a_sub_action_without_an_allowed_choice_acts_zero():
    got = _md_results("float32")
    assert got["mode"][NO_CHOICE_ROW, NO_CHOICE_PART] == 0
    assert np.all(got["sample"][:, NO_CHOICE_ROW, NO_CHOICE_PART] == 0)
    # The row's other sub-actions still sample from their own choices.
    assert len(np.unique(got["sample"][:, NO_CHOICE_ROW, 0])) == 3


def test_multi_discrete_flat_and_per_part_masks_give_identical_results():
    got = _md_results("float32")
    for name, per_part in got["per_part"].items():
        np.testing.assert_array_equal(got[name], per_part, err_msg=name)
    # A list of NumPy parts, eagerly, as well.
    listed = samplers.MultiDiscrete(
        jnp.asarray(LOGITS, jnp.float32), list(NVEC), [np.asarray(m) for m in _split(MASK)]
    )
    np.testing.assert_allclose(listed.entropy(), got["entropy"], rtol=1e-6)


def test_multi_discrete_masked_logits_reach_no_output():
    """Masked slots holding NaN, +-inf and 1e30, or 0: bit-identical values and gradients."""
    got, clean = _md_results("float32"), _md_results("float32", clean=True)
    for name in got:
        jax.tree.map(
            lambda a, b, name=name: np.testing.assert_array_equal(a, b, err_msg=name),
            got[name],
            clean[name],
        )
    for name in ("grad_log_prob", "grad_entropy", "sample_grad"):
        assert np.all(np.isfinite(got[name])) and np.all(got[name][~MASK] == 0), name


def test_multi_discrete_mode_is_each_sub_action_s_most_probable_allowed_choice():
    parts, _ = _md_oracle(LOGITS, MASK)
    expected = np.stack(
        [
            np.where(np.isnan(p).any(-1), 0, np.argmax(np.nan_to_num(p, nan=-INF), -1))
            for p in parts
        ],
        axis=-1,
    )
    np.testing.assert_array_equal(_md_results("float32")["mode"], expected)


def _finite_differences(f, x, varied, step=1e-6):
    """Central differences of the per-row ``f``, each entry against its own row's value."""
    grad = np.zeros_like(x)
    for row, column in zip(*np.nonzero(varied), strict=True):
        up, down = x.copy(), x.copy()
        up[row, column] += step
        down[row, column] -= step
        grad[row, column] = (f(up)[row] - f(down)[row]) / (2 * step)
    return grad


@pytest.mark.parametrize("quantity", ["log_prob", "entropy"])
def test_multi_discrete_gradients_match_float64_differences_and_are_zero_when_masked(quantity):
    rows = ROWS_WITH_A_DISTRIBUTION
    logits, mask, action = LOGITS[rows], MASK[rows], ACTION[rows]

    def oracle(values):
        parts, entropies = _md_oracle(values, mask)
        return entropies.sum(-1) if quantity == "entropy" else _md_log_prob(parts, action)

    grad = _md_results("float64")[f"grad_{quantity}"]
    varied = mask & np.isfinite(logits)
    expected = _finite_differences(oracle, logits.astype(np.float64), varied)
    np.testing.assert_allclose(grad[rows], expected, rtol=1e-6, atol=1e-8)
    assert np.all(grad[~MASK] == 0)
    # A sub-action with one allowed choice, and an allowed -inf, get gradient 0.
    assert grad[1, 9] == 0 and grad[2, 7] == 0 and grad[4, 1] == 0
    # The row left out of the loss (its sub-action 2 allows nothing) gets exactly 0.
    assert np.all(grad[NO_CHOICE_ROW] == 0)


def test_multi_discrete_gradients_are_finite_in_float32():
    got = _md_results("float32")
    for name in ("grad_log_prob", "grad_entropy", "sample_grad"):
        assert np.all(np.isfinite(got[name])) and np.all(got[name][~MASK] == 0), name
        assert np.any(got[name] != 0), name


def test_multi_discrete_samples_follow_each_sub_action_s_probabilities():
    samples = _md_results("float32")["sample"]
    assert samples.shape == (N, len(LOGITS), len(NVEC))
    parts, _ = _md_oracle(LOGITS, MASK)
    for i, (part, m) in enumerate(zip(parts, _split(MASK), strict=True)):
        for row in range(len(LOGITS)):
            counts = np.bincount(samples[:, row, i], minlength=NVEC[i])
            assert len(counts) == NVEC[i]
            if np.isnan(part[row]).any():
                assert counts[0] == N
                continue
            assert np.all(counts[~m[row]] == 0)
            probs = np.exp(part[row])
            sigma = np.sqrt(N * probs * (1 - probs))
            assert np.all(np.abs(counts - N * probs) <= 5 * sigma + 1e-9)


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), slow("float64", 1e-12)])
def test_multi_discrete_sample_then_log_prob_under_jit_and_its_gradient(dtype, tol):
    """``a = dist.sample(seed, n); dist.log_prob(a)``, jitted, against the oracle, and its
    gradient against the closed form ``sum_n (1[a_n = j] - p_j)`` per sub-action."""
    got = _md_results(dtype, sample=True)
    rows = ROWS_WITH_A_DISTRIBUTION
    samples, scores = got["sample"], got["sample_log_prob"]
    assert scores.shape == (N, len(LOGITS))
    parts, _ = _md_oracle(_rounded(LOGITS, dtype), MASK)
    expected = _md_log_prob(parts, samples)
    np.testing.assert_allclose(scores[:, rows], expected[:, rows], rtol=tol, atol=tol)
    assert np.all(np.isfinite(scores[:, rows])) and np.all(np.isnan(scores[:, NO_CHOICE_ROW]))
    closed_form = np.concatenate(
        [
            np.stack([np.sum(samples[:, :, i] == j, axis=0) for j in range(n)], axis=-1)
            - N * np.exp(part)
            for i, (n, part) in enumerate(zip(NVEC, parts, strict=True))
        ],
        axis=-1,
    )
    closed_form = np.where(MASK, closed_form, 0.0)[rows]
    np.testing.assert_allclose(got["sample_grad"][rows], closed_form, rtol=tol, atol=1e4 * tol)


def _kl(log_p, log_q):
    """float64 ``sum p (log p - log q)`` over the last axis, over the values ``p`` gives
    positive probability."""
    probs = np.exp(log_p)
    positive = probs > 0
    terms = np.zeros(log_p.shape)
    terms[positive] = probs[positive] * (log_p[positive] - log_q[positive])
    return terms.sum(-1)


Q_LOGITS = np.tile([1.0, 0.0, -1.0, 0.3, 0.5, 0.1, -0.2, 2.0, 0.0, -1.0, 1.0], (len(LOGITS), 1))
Q_MASK = np.ones_like(MASK)
Q_MASK[0, 2] = False  # q forbids a choice p allows: +inf
Q_MASK[4, 1] = False  # q forbids the choice that p gives probability 0: finite


def _md_kl_oracle(p_logits, q_logits, rows=slice(None)):
    log_p, _ = _md_oracle(p_logits, MASK[rows])
    log_q, _ = _md_oracle(q_logits, Q_MASK[rows])
    return sum(_kl(lp, lq) for lp, lq in zip(log_p, log_q, strict=True))


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), slow(jnp.float64, 1e-12)])
def test_multi_discrete_kl_divergence_matches_float64_formula(dtype, tol):
    with jax.enable_x64(dtype == jnp.float64):
        p, q = _md(dtype), _md(dtype, Q_LOGITS, Q_MASK)
        got = np.asarray(p.kl_divergence(q), np.float64)
    expected = _md_kl_oracle(_rounded(LOGITS, dtype), _rounded(Q_LOGITS, dtype))
    expected[NO_CHOICE_ROW] = NAN
    assert expected[0] == INF and np.all(np.isfinite(expected[[1, 2, 4]]))
    np.testing.assert_allclose(got, expected, rtol=tol, atol=tol)


def test_multi_discrete_kl_divergence_gradients_match_float64_differences():
    rows = [1, 2, 4]  # a finite KL

    def kl(p_logits, q_logits):
        p = samplers.MultiDiscrete(p_logits, NVEC, jnp.asarray(MASK[rows]))
        return p.kl_divergence(samplers.MultiDiscrete(q_logits, NVEC, Q_MASK[rows])).sum()

    with jax.enable_x64(True):
        p_grad, q_grad = map(
            np.asarray,
            jax.jit(jax.grad(kl, argnums=(0, 1)))(
                jnp.asarray(LOGITS[rows]), jnp.asarray(Q_LOGITS[rows])
            ),
        )
    p_logits, q_logits = LOGITS[rows], Q_LOGITS[rows]
    varied = MASK[rows] & np.isfinite(p_logits)
    expected = _finite_differences(lambda x: _md_kl_oracle(x, q_logits, rows), p_logits, varied)
    np.testing.assert_allclose(p_grad, expected, rtol=1e-6, atol=1e-8)
    expected = _finite_differences(
        lambda x: _md_kl_oracle(p_logits, x, rows), q_logits, Q_MASK[rows]
    )
    np.testing.assert_allclose(q_grad, expected, rtol=1e-6, atol=1e-8)
    assert np.all(p_grad[~MASK[rows]] == 0) and np.all(q_grad[~Q_MASK[rows]] == 0)


def test_multi_discrete_batch_shapes(batch_shape, maybe_jit):
    rows = ROWS_WITH_A_DISTRIBUTION
    size = int(np.prod(batch_shape, dtype=int))
    pick = np.arange(size) % len(rows)
    logits = np.asarray(LOGITS[rows])[pick].reshape(*batch_shape, -1)
    mask = MASK[rows][pick].reshape(*batch_shape, -1)

    def run(x, m, key):
        dist = samplers.MultiDiscrete(x, NVEC, m)
        actions = dist.sample(seed=key, sample_shape=3)
        return actions, dist.log_prob(actions), dist.entropy(), dist.mode()

    run = maybe_jit(run)
    actions, scores, entropy, mode = map(
        np.asarray, run(jnp.asarray(logits, jnp.float32), jnp.asarray(mask), jax.random.key(6))
    )
    assert actions.shape == (3, *batch_shape, len(NVEC)) and scores.shape == (3, *batch_shape)
    assert entropy.shape == batch_shape and mode.shape == (*batch_shape, len(NVEC))
    parts, entropies = _md_oracle(logits.reshape(size, -1), mask.reshape(size, -1))
    flat_actions = actions.reshape(3, size, len(NVEC))
    np.testing.assert_allclose(
        scores.reshape(3, size), _md_log_prob(parts, flat_actions), rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(entropy.reshape(size), entropies.sum(-1), rtol=1e-5, atol=1e-6)


def test_multi_discrete_refuses_bad_inputs_by_name():
    logits = jnp.zeros((2, 11))
    with pytest.raises(ValueError, match="nvec must be a non-empty sequence of integers"):
        samplers.MultiDiscrete(logits, ())
    with pytest.raises(ValueError, match="nvec must be a non-empty sequence of integers"):
        samplers.MultiDiscrete(logits, (3.0, 8.0))
    with pytest.raises(ValueError, match=r"nvec must be positive .* got \(3, 0, 8\)"):
        samplers.MultiDiscrete(logits, (3, 0, 8))
    with pytest.raises(
        ValueError, match=r"logits must have shape \[\*batch, 11\] .* got \(2, 10\)"
    ):
        samplers.MultiDiscrete(jnp.zeros((2, 10)), NVEC)
    with pytest.raises(ValueError, match=r"logits must have shape \[\*batch, 11\]"):
        samplers.MultiDiscrete(jnp.float32(0.0), NVEC)
    with pytest.raises(TypeError, match="logits must be numbers, got booleans"):
        samplers.MultiDiscrete(jnp.zeros((2, 11), bool), NVEC)
    with pytest.raises(TypeError, match=r"mask must be boolean .* got dtype float32"):
        samplers.MultiDiscrete(logits, NVEC, jnp.ones((2, 11)))
    with pytest.raises(ValueError, match=r"mask must have shape \(2, 11\), got \(11,\)"):
        samplers.MultiDiscrete(logits, NVEC, jnp.ones(11, bool))
    parts = [jnp.ones((2, n), bool) for n in NVEC]
    with pytest.raises(
        ValueError, match=r"one array per sub-action \(4 for nvec=\(3, 1, 5, 2\)\), got 3"
    ):
        samplers.MultiDiscrete(logits, NVEC, parts[:3])
    with pytest.raises(ValueError, match=r"shape \(2, 5\) for sub-action 2, got \(2, 4\)"):
        samplers.MultiDiscrete(logits, NVEC, [*parts[:2], jnp.ones((2, 4), bool), parts[3]])
    with pytest.raises(TypeError, match="mask must be boolean"):
        samplers.MultiDiscrete(logits, NVEC, [*parts[:3], jnp.ones((2, 2))])


# MultiBinary: rows of log-odds [rows, bits] and masks [rows, bits, 2] of allowed values.
BITS = np.array(
    [
        [0.3, -1.2, 2.0, 80.0, -80.0, 0.0],
        [NAN, INF, 1e30, -1e30, INF, -0.5],
        [0.3, -1.2, 1e30, 80.0, -80.0, 0.0],
        [-80.0, 80.0, INF, -INF, 3.0, -3.0],
    ]
)
BOTH, ZERO, ONE, NEITHER = (T, T), (T, F), (F, T), (F, F)
BIT_MASK = np.array(
    [
        [BOTH, BOTH, BOTH, BOTH, BOTH, BOTH],
        [ZERO, ZERO, ZERO, ONE, ONE, BOTH],  # forced bits; masked log-odds NaN, inf, 1e30
        [BOTH, BOTH, NEITHER, BOTH, BOTH, BOTH],  # bit 2 can be neither: NaN
        [ONE, ZERO, BOTH, BOTH, ONE, ZERO],  # forced against the log-odds; free +-inf: certain
    ]
)
NO_VALUE_ROW = 2


def _mb_oracle(logits, mask):
    """float64 log-probabilities of each bit's values [rows, bits, 2], entropies [rows,
    bits] and probabilities of a one [rows, bits], from the Bernoulli formula."""
    x = np.asarray(logits, np.float64)
    both = mask[..., 0] & mask[..., 1]
    safe = np.where(both, x, 0.0)
    log_one, log_zero = special.log_expit(safe), special.log_expit(-safe)
    p, q = special.expit(safe), special.expit(-safe)
    entropy = -(special.xlogy(p, p) + special.xlogy(q, q))
    log_probs = np.stack(
        [
            np.where(both, log_zero, np.where(mask[..., 0], 0.0, -INF)),
            np.where(both, log_one, np.where(mask[..., 1], 0.0, -INF)),
        ],
        axis=-1,
    )
    entropy = np.where(both, entropy, 0.0)
    probs = np.where(both, p, np.where(mask[..., 1], 1.0, 0.0))
    neither = ~mask.any(-1)
    log_probs[neither] = NAN
    entropy[neither] = NAN
    probs[neither] = NAN
    return log_probs, entropy, probs


def _mb_log_prob(log_probs, actions):
    """The joint log-probability of bits ``actions`` [..., rows, bits]."""
    shape = np.broadcast_shapes(actions.shape, log_probs.shape[:-1])
    picked = np.take_along_axis(
        np.broadcast_to(log_probs, (*shape, 2)), np.broadcast_to(actions, shape)[..., None], axis=-1
    )
    return picked[..., 0].sum(-1)


# Every joint action of 6 bits, [64, 1, 6].
BIT_JOINT = np.array(list(itertools.product((0, 1), repeat=BITS.shape[1])))[:, None, :]


BIT_ACTION = np.array(
    [[1, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 1], [0, 1, 0, 1, 0, 1], [1, 0, 1, 0, 1, 0]]
)
BIT_ROWS = [0, 1, 3]  # the rows with a distribution
BIT_OUTSIDE = np.array(
    [[2, 0, 0, 1, 0, 1], [0, 0, 0, 1, -1, 1], [0, 0, 0, 0, 0, 0], [1, 3, 1, 0, 1, 0]]
)
FORCED = BIT_MASK.sum(-1) == 1
FORCED_VALUE = BIT_MASK[..., 1].astype(int)  # the allowed value of a forced bit


@functools.partial(jax.jit, static_argnames=("sample",))
def _mb_program(logits, mask, key, sample):
    """What the MultiBinary tests compare, traced once per dtype (see ``_md_program``)."""
    rows = jnp.asarray(BIT_ROWS)
    make = lambda x: samplers.MultiBinary(x, mask)  # noqa: E731
    dist = make(logits)
    bits = dist.distribution  # one Bernoulli per bit, the mask applied to its log-odds
    got = {
        "log_prob": dist.log_prob(jnp.asarray(BIT_JOINT)),  # [64, rows]
        "entropy": dist.entropy(),
        "probs": dist.probs,
        "mode": dist.mode(),
        "outside": dist.log_prob(jnp.asarray(BIT_OUTSIDE)),
        "forced_log_prob": bits.log_prob(jnp.asarray(FORCED_VALUE)),
        "other_log_prob": bits.log_prob(jnp.asarray(1 - FORCED_VALUE)),
        "bit_entropy": bits.entropy(),
        "grad_log_prob": jax.grad(lambda x: make(x).log_prob(jnp.asarray(BIT_ACTION))[rows].sum())(
            logits
        ),
        "grad_entropy": jax.grad(lambda x: make(x).entropy()[rows].sum())(logits),
    }
    if sample:
        got["sample"] = dist.sample(seed=key, sample_shape=N)
    return got


@functools.cache
def _mb_results(dtype_name, clean=False):
    """``_mb_program`` on BITS (or with the unused log-odds replaced by 0), as NumPy;
    with samples in float32 only."""
    dtype = jnp.dtype(dtype_name)
    logits = np.where(BIT_MASK[..., 1], BITS, 0.0) if clean else BITS
    with jax.enable_x64(dtype == jnp.float64):
        out = _mb_program(
            jnp.asarray(logits, dtype), jnp.asarray(BIT_MASK), jax.random.key(1), dtype == "float32"
        )
        return jax.tree.map(np.asarray, out)


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), slow("float64", 1e-13)])
def test_multi_binary_log_prob_entropy_and_probs_match_the_bernoulli_formula(dtype, tol):
    got = _mb_results(dtype)
    log_probs, entropy, probs = _mb_oracle(_rounded(BITS, dtype), BIT_MASK)
    log_prob = got["log_prob"].astype(np.float64)
    np.testing.assert_allclose(log_prob, _mb_log_prob(log_probs, BIT_JOINT), rtol=tol, atol=tol)
    np.testing.assert_allclose(got["entropy"], entropy.sum(-1), rtol=tol, atol=tol)
    np.testing.assert_allclose(got["bit_entropy"], entropy, rtol=tol, atol=tol)
    np.testing.assert_allclose(got["probs"], probs, rtol=tol, atol=1e-30)
    totals = special.logsumexp(log_prob, axis=0)
    np.testing.assert_allclose(totals[BIT_ROWS], 0.0, atol=10 * tol)
    # A bit that can be neither value: its row is NaN.
    assert np.all(np.isnan(log_prob[:, NO_VALUE_ROW])) and np.isnan(got["entropy"][NO_VALUE_ROW])
    assert np.isnan(got["probs"][NO_VALUE_ROW, 2]) and np.isnan(got["bit_entropy"][NO_VALUE_ROW, 2])
    # A value other than 0 or 1 scores -inf.
    assert np.all(got["outside"][BIT_ROWS] == -INF) and np.isnan(got["outside"][NO_VALUE_ROW])
    # Forced bits (row 3's +-80 bits against their log-odds): log-probability 0 for the
    # allowed value, -inf for the other, entropy 0, probability of a one 0 or 1.
    assert np.all(got["forced_log_prob"][FORCED] == 0)
    assert np.all(got["other_log_prob"][FORCED] == -INF)
    assert np.all(got["bit_entropy"][FORCED] == 0)
    np.testing.assert_array_equal(got["probs"][FORCED], FORCED_VALUE[FORCED])


def test_multi_binary_matches_distrax_bernoulli_without_a_mask():
    @jax.jit
    def both(logits, actions):
        ours = samplers.MultiBinary(logits)
        theirs = distrax.Independent(distrax.Bernoulli(logits=logits), 1)
        with jax.numpy_rank_promotion("allow"):  # distrax.Bernoulli broadcasts implicitly
            their_log_prob = theirs.log_prob(actions)
        return (
            (ours.log_prob(actions), their_log_prob),
            (ours.entropy(), theirs.entropy()),
            (ours.probs, theirs.distribution.probs),
            (ours.mode(), theirs.mode()),
        )

    # Log-odds of 0, +-80 and +-inf (a certain bit, as in distrax).
    logits = jnp.asarray(BITS[[0, 3]], jnp.float32)
    for ours, theirs in both(logits, jnp.asarray(BIT_JOINT)):
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-30)


def test_multi_binary_masked_log_odds_reach_no_output_and_forced_bits_are_always_sampled():
    got, clean = _mb_results("float32"), _mb_results("float32", clean=True)
    for name in got:
        np.testing.assert_array_equal(got[name], clean[name], err_msg=name)
    samples = got["sample"]
    assert np.all(samples[:, FORCED] == FORCED_VALUE[FORCED])
    assert np.all(samples[:, NO_VALUE_ROW, 2] == 0) and got["mode"][NO_VALUE_ROW, 2] == 0
    np.testing.assert_array_equal(got["mode"][FORCED], FORCED_VALUE[FORCED])
    # The other bits follow the Bernoulli probabilities (row 3's bit of -inf is never 1).
    _, _, probs = _mb_oracle(BITS, BIT_MASK)
    free = BIT_MASK.all(-1)
    ones, p = samples[:, free].sum(0), probs[free]
    assert np.all(np.abs(ones - N * p) <= 5 * np.sqrt(N * p * (1 - p)) + 1e-9)
    assert np.all((samples == 0) | (samples == 1))


@pytest.mark.parametrize("quantity", ["log_prob", "entropy"])
def test_multi_binary_gradients_match_float64_differences_and_are_zero_when_forced(quantity):
    logits, mask, action = BITS[BIT_ROWS], BIT_MASK[BIT_ROWS], BIT_ACTION[BIT_ROWS]

    def oracle(values):
        log_probs, entropy, _ = _mb_oracle(values, mask)
        return entropy.sum(-1) if quantity == "entropy" else _mb_log_prob(log_probs, action)

    grad = _mb_results("float64")[f"grad_{quantity}"]
    free = mask.all(-1) & np.isfinite(logits)
    expected = _finite_differences(oracle, logits.astype(np.float64), free)
    np.testing.assert_allclose(grad[BIT_ROWS], expected, rtol=1e-6, atol=1e-8)
    assert np.all(grad[~BIT_MASK.all(-1)] == 0) and np.all(grad[NO_VALUE_ROW] == 0)
    grad32 = _mb_results("float32")[f"grad_{quantity}"]
    assert np.all(np.isfinite(grad32)) and np.all(grad32[~BIT_MASK.all(-1)] == 0)
    np.testing.assert_allclose(grad32[BIT_ROWS], expected, rtol=1e-4, atol=1e-6)


KL_BIT_ROWS = [0, 3]
Q_BITS = np.tile([1.0, 0.0, -1.0, 0.5, -0.5, 2.0], (len(KL_BIT_ROWS), 1))


def _mb_kl_oracle(p_logits, q_logits, p_mask, q_mask):
    log_p, _, _ = _mb_oracle(p_logits, p_mask)
    log_q, _, _ = _mb_oracle(q_logits, q_mask)
    return _kl(log_p, log_q).sum(-1)


def test_multi_binary_kl_divergence_matches_float64_formula():
    p_logits, p_mask = BITS[KL_BIT_ROWS], BIT_MASK[KL_BIT_ROWS]  # row 3 holds +-inf, +-80
    q_mask = np.ones((len(KL_BIT_ROWS), 6, 2), bool)
    q_mask[1, 0] = ONE  # p forces bit 0 of row 3 to 1, and q too: finite

    def kl(q_mask):
        p = samplers.MultiBinary(jnp.asarray(p_logits, jnp.float32), jnp.asarray(p_mask))
        q = samplers.MultiBinary(jnp.asarray(Q_BITS, jnp.float32), jnp.asarray(q_mask))
        return np.asarray(p.kl_divergence(q)), _mb_kl_oracle(p_logits, Q_BITS, p_mask, q_mask)

    got, expected = kl(q_mask)
    assert np.all(np.isfinite(expected))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    q_mask[0, 0] = ZERO  # q forces to 0 a bit that p may set: +inf
    got, expected = kl(q_mask)
    assert expected[0] == INF
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_multi_binary_kl_divergence_gradients_match_float64_differences():
    # Finite log-odds (the +-inf of row 3 made +-4); forced bits in both p and q.
    p_logits = np.nan_to_num(BITS[KL_BIT_ROWS], posinf=4.0, neginf=-4.0)
    p_mask = BIT_MASK[KL_BIT_ROWS].copy()
    p_mask[0, 1] = ZERO
    q_mask = p_mask.copy()  # q forces the bits that p forces, the same way: a finite KL

    def kl(p_logits, q_logits):
        p = samplers.MultiBinary(p_logits, jnp.asarray(p_mask))
        return p.kl_divergence(samplers.MultiBinary(q_logits, jnp.asarray(q_mask))).sum()

    with jax.enable_x64(True):
        p_grad, q_grad = map(
            np.asarray,
            jax.jit(jax.grad(kl, argnums=(0, 1)))(jnp.asarray(p_logits), jnp.asarray(Q_BITS)),
        )

    def oracle(p, q):
        return _mb_kl_oracle(p, q, p_mask, q_mask)

    assert np.all(np.isfinite(oracle(p_logits, Q_BITS)))
    p_free = p_mask.all(-1) & np.isfinite(p_logits)
    expected = _finite_differences(lambda x: oracle(x, Q_BITS), p_logits, p_free)
    np.testing.assert_allclose(p_grad[p_free], expected[p_free], rtol=1e-6, atol=1e-8)
    expected = _finite_differences(lambda x: oracle(p_logits, x), Q_BITS, q_mask.all(-1))
    np.testing.assert_allclose(q_grad, expected, rtol=1e-6, atol=1e-8)
    assert np.all(p_grad[~p_mask.all(-1)] == 0) and np.all(q_grad[~q_mask.all(-1)] == 0)
    assert np.all(np.isfinite(p_grad)) and np.all(np.isfinite(q_grad))


def test_multi_binary_refuses_bad_inputs_by_name():
    with pytest.raises(ValueError, match="logits must have a bit axis"):
        samplers.MultiBinary(jnp.float32(0.0))
    with pytest.raises(TypeError, match="logits must be numbers, got booleans"):
        samplers.MultiBinary(jnp.ones(3, bool))
    with pytest.raises(
        ValueError,
        match=r"mask must have shape \(3, 2\) \(bit i may be 0, bit i may be 1\), got \(3,\)",
    ):
        samplers.MultiBinary(jnp.zeros(3), jnp.ones(3, bool))
    with pytest.raises(TypeError, match=r"mask must be boolean .* got dtype int32"):
        samplers.MultiBinary(jnp.zeros(3), jnp.ones((3, 2), jnp.int32))


@pytest.mark.parametrize(
    "dtype", [pytest.param(jnp.bfloat16, id="bfloat16"), slow(jnp.float16, id="float16")]
)
def test_half_precision_logits_compute_in_float32_bit_for_bit(dtype):
    # Finite logits that the half dtypes hold exactly, with the masks of the oracle tests.
    md_logits = jnp.asarray(np.clip(np.nan_to_num(LOGITS), -100, 100)).astype(dtype)
    mb_logits = jnp.asarray(np.clip(np.nan_to_num(BITS), -100, 100)).astype(dtype)
    md_mask, mb_mask = jnp.asarray(MASK), jnp.asarray(BIT_MASK)

    def everything(md_logits, mb_logits):
        outputs = {}
        for name, dist, other in (
            (
                "md",
                samplers.MultiDiscrete(md_logits, NVEC, md_mask),
                samplers.MultiDiscrete(jnp.zeros(md_logits.shape), NVEC),
            ),
            (
                "mb",
                samplers.MultiBinary(mb_logits, mb_mask),
                samplers.MultiBinary(jnp.zeros(mb_logits.shape)),
            ),
        ):
            sample = dist.sample(seed=jax.random.key(0))
            outputs |= {
                f"{name}/sample": sample,
                f"{name}/log_prob": dist.log_prob(sample),
                f"{name}/entropy": dist.entropy(),
                f"{name}/mode": dist.mode(),
                f"{name}/kl": dist.kl_divergence(other),
            }
        return outputs

    expected = everything(md_logits.astype(jnp.float32), mb_logits.astype(jnp.float32))
    got = everything(md_logits, mb_logits)
    for name, value in got.items():
        floating = jnp.issubdtype(expected[name].dtype, jnp.floating)
        assert value.dtype == (jnp.float32 if floating else expected[name].dtype), name
        np.testing.assert_array_equal(value, expected[name], err_msg=name)


def test_multi_binary_kl_gradient_is_finite_at_log_odds_of_plus_or_minus_inf():
    # A certain bit of p, given as +-inf log-odds rather than by the mask: KL(p || q) is
    # -log q(value), whose gradient with respect to p's infinite log-odds is 0.
    def kl(p_logits, q_logits):
        return samplers.MultiBinary(p_logits).kl_divergence(samplers.MultiBinary(q_logits)).sum()

    with jax.enable_x64(True):
        p, q = jnp.array([np.inf, -np.inf, 0.5]), jnp.array([-1.0, 2.0, 0.0])
        p_grad, q_grad = jax.grad(kl, argnums=(0, 1))(p, q)
        expected = -special.log_expit(-1.0) - special.log_expit(-2.0)
        expected += _mb_kl_oracle(
            np.array([[0.5]]), np.array([[0.0]]), *[np.ones((1, 1, 2), bool)] * 2
        )[0]
        np.testing.assert_allclose(kl(p, q), expected, rtol=1e-12)
    np.testing.assert_array_equal(p_grad[:2], 0.0)
    # d/dq of -log sigmoid(q) and -log sigmoid(-q): -sigmoid(-q) and sigmoid(q).
    np.testing.assert_allclose(q_grad[:2], [-special.expit(1.0), special.expit(2.0)], rtol=1e-12)
    assert np.all(np.isfinite(p_grad)) and np.all(np.isfinite(q_grad))


def test_integer_logits_are_taken_as_distrax_takes_them():
    # distrax.Bernoulli and distrax.Categorical take integer logits as floats; so do the
    # multi-part distributions, scoring as distrax's own distribution of the parts.
    logits = jnp.array([[-3, 0, 2], [1, 4, -1]], jnp.int32)
    bits = jnp.array([[0, 1, 1], [1, 1, 0]])
    expected = distrax.Bernoulli(logits=logits.astype(jnp.float32)).log_prob(bits).sum(-1)
    np.testing.assert_allclose(samplers.MultiBinary(logits).log_prob(bits), expected, rtol=1e-6)
    nvec, parts = (1, 2), jnp.array([[0, 1], [0, 0]])
    expected = sum(
        distrax.Categorical(logits=logits[:, start:stop].astype(jnp.float32)).log_prob(parts[:, i])
        for i, (start, stop) in enumerate(((0, 1), (1, 3)))
    )
    got = samplers.MultiDiscrete(logits, nvec).log_prob(parts)
    np.testing.assert_allclose(got, expected, rtol=1e-6)
