"""``MaskedCategorical`` against float64 NumPy formulas, on masks and logits that break the
usual fills: masked logits of NaN, +-inf and 1e30, rows with one allowed action or none,
and allowed logits far apart."""

import warnings

import distrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import special
from tensorflow_probability.substrates import jax as tfp

import samplers
from tests._tiers import slow
from tests.reference import categorical_entropy_float64, masked_log_softmax_float64

tfd = tfp.distributions

# Rows of logits and masks; masked entries hold values that must reach no output.
LOGITS = np.array(
    [
        [0.3, -1.2, 2.0, 0.7],
        [0.3, np.nan, 2.0, np.inf],
        [1e30, -1.2, 2.0, -np.inf],
        [80.0, -80.0, 0.0, 40.0],
        [5.0, 5.0, 5.0, 5.0],
        [0.3, -1.2, 2.0, 0.7],
        [0.3, -np.inf, 2.0, -1e4],
        [0.3, -1.2, 2.0, 0.7],
    ]
)
MASK = np.array(
    [
        [True, True, True, True],
        [True, False, True, False],
        [False, True, True, False],
        [True, True, True, True],
        [False, True, False, True],
        [False, False, True, False],
        [True, True, True, True],
        [False, False, False, False],
    ]
)
NO_ACTION = 7  # the row that allows nothing


def _oracle(logits, mask):
    """float64 log-probabilities (``-inf`` masked, NaN for a row without an allowed
    action), probabilities and entropies, written from the definition."""
    log_probs = masked_log_softmax_float64(logits, mask)
    return log_probs, np.exp(log_probs), categorical_entropy_float64(log_probs)


def _dist(dtype=jnp.float32, logits=LOGITS, mask=MASK):
    return samplers.MaskedCategorical(jnp.asarray(logits, dtype), jnp.asarray(mask))


# float64 (its own 1e-14) in the slow tier, as for the CDF below.
@pytest.mark.parametrize("dtype, rtol", [(jnp.float32, 1e-6), slow(jnp.float64, 1e-14)])
def test_log_probs_probs_and_entropy_match_float64_formulas(dtype, rtol):
    with jax.enable_x64(dtype == jnp.float64):
        dist = _dist(dtype)
        log_probs, probs, entropy = _oracle(LOGITS, MASK)
        # Every action of every row, [action, row].
        actions = np.broadcast_to(np.arange(LOGITS.shape[1])[:, None], LOGITS.shape[::-1])
        got = np.asarray(dist.log_prob(jnp.asarray(actions)), np.float64).T
        np.testing.assert_allclose(got, log_probs, rtol=rtol, atol=rtol)
        np.testing.assert_allclose(
            np.asarray(dist.logits, np.float64), log_probs, rtol=rtol, atol=rtol
        )
        np.testing.assert_allclose(np.asarray(dist.probs, np.float64), probs, rtol=rtol, atol=1e-30)
        np.testing.assert_allclose(
            np.asarray(dist.prob(jnp.asarray(actions)), np.float64).T, probs, rtol=rtol, atol=1e-30
        )
        np.testing.assert_allclose(
            np.asarray(dist.entropy(), np.float64), entropy, rtol=rtol, atol=rtol
        )
        # Masked actions: exactly zero probability, exactly -inf log-probability.
        assert np.all(np.asarray(dist.probs)[MASK == 0][: -LOGITS.shape[1]] == 0)
        assert np.all(got[:NO_ACTION][~MASK[:NO_ACTION]] == -np.inf)


def test_a_row_without_an_allowed_action_is_nan_and_gives_action_zero():
    dist = _dist()
    actions = np.broadcast_to(np.arange(LOGITS.shape[1])[:, None], LOGITS.shape[::-1])
    assert np.all(np.isnan(np.asarray(dist.log_prob(jnp.asarray(actions)))[:, NO_ACTION]))
    assert np.isnan(dist.entropy()[NO_ACTION])
    assert dist.mode()[NO_ACTION] == 0
    samples = dist.sample(seed=jax.random.key(0), sample_shape=100)
    assert np.all(np.asarray(samples)[:, NO_ACTION] == 0)
    # For contrast: TFP with a finite fill scores every action of that row 0.0 in float32
    # (log 4 is below the float spacing at 1e9), and distrax.Categorical with -inf
    # samples -1, the last action to jnp indexing.
    with jax.numpy_rank_promotion("allow"):  # TFP's log_prob broadcasts implicitly
        finite_fill = tfd.Categorical(logits=jnp.full(4, -1e9, jnp.float32))
        assert [float(finite_fill.log_prob(a)) for a in range(4)] == [0.0] * 4
    masked = jnp.where(jnp.asarray(MASK), jnp.asarray(LOGITS, jnp.float32), -jnp.inf)
    assert int(distrax.Categorical(masked[NO_ACTION]).sample(seed=jax.random.key(0))) == -1


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, slow(jnp.float64)])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "jit"])
def test_an_allowed_nan_or_plus_infinite_logit_makes_its_row_nan(dtype, compiled):
    # Wherever the allowed NaN or +inf is (the first entry, the last, beside -inf),
    # or where no action is allowed, the whole row is NaN: the sample and the mode
    # give 0, every score and the entropy are NaN. A masked NaN does not count: the
    # last row keeps its distribution over actions 1 and 3.
    inf, nan = jnp.inf, jnp.nan
    logits = [
        [0.0, nan, 1.0, 2.0],
        [0.0, inf, 1.0, 2.0],
        [inf, 0.0, 1.0, 2.0],
        [-inf, 0.0, 1.0, inf],
        [-inf, -inf, inf, inf],
        [0.0, 1.0, 2.0, nan],
        [0.0, 0.0, 0.0, 0.0],
        [nan, 5.0, -inf, 4.0],
    ]
    mask = np.ones((8, 4), bool)
    mask[6] = False  # no allowed action
    mask[7, 0] = False  # the NaN masked

    def outputs(logits, mask):
        dist = samplers.MaskedCategorical(logits, mask)
        scores = dist.log_prob(jnp.arange(4)[:, None])  # [action, row]
        samples = dist.sample(seed=jax.random.key(0), sample_shape=64)
        return dist.logits, scores, dist.entropy(), dist.mode(), samples

    with jax.enable_x64(dtype == jnp.float64):
        run = jax.jit(outputs) if compiled else outputs
        got = run(jnp.array(logits, dtype), jnp.asarray(mask))
        normalised, scores, entropy, mode, samples = (np.asarray(x, np.float64) for x in got)
    assert np.all(np.isnan(normalised[:7])) and not np.any(np.isnan(normalised[7]))
    assert np.all(np.isnan(scores[:, :7])) and np.all(np.isnan(entropy[:7]))
    assert np.all(mode[:7] == 0) and np.all(samples[:, :7] == 0)
    p = np.exp([5.0, 4.0]) / np.sum(np.exp([5.0, 4.0]))
    np.testing.assert_allclose(
        scores[:, 7], [-np.inf, np.log(p[0]), -np.inf, np.log(p[1])], rtol=1e-6
    )
    np.testing.assert_allclose(entropy[7], -np.sum(p * np.log(p)), rtol=1e-6)
    assert mode[7] == 1 and set(samples[:, 7]) == {1.0, 3.0}


def test_a_value_that_is_no_action_index_scores_nan_and_one_outside_the_range_minus_inf():
    dist = samplers.MaskedCategorical(jnp.zeros(3))
    scores = np.asarray(dist.log_prob(jnp.array([jnp.nan, 1.5, 1.0, 3.0, -1.0, jnp.inf])))
    expected = [np.nan, np.nan, -np.log(3.0), -np.inf, -np.inf, -np.inf]
    np.testing.assert_allclose(scores, expected, rtol=1e-6)


@pytest.mark.parametrize("dtype, rtol", [(jnp.float32, 1e-6), slow(jnp.float64, 1e-14)])
def test_cdf_is_the_float64_cumulative_sum_and_nan_without_a_distribution(dtype, rtol):
    with jax.enable_x64(dtype == jnp.float64):
        dist = _dist(dtype)
        _, probs, _ = _oracle(LOGITS, MASK)
        cumulative = np.cumsum(np.nan_to_num(probs), axis=-1)
        # Every value from below the range to past it, floats counted as their floor.
        values = np.array([-2, -1, 0, 1, 2, 3, 4, 9, -0.5, 0.5, 2.999])
        expected = np.stack(
            [
                np.full(len(LOGITS), 0.0 if v < 0 else 1.0)
                if v < 0 or v >= 3
                else cumulative[:, int(np.floor(v))]
                for v in values
            ]
        )
        expected[:, NO_ACTION] = np.nan
        got = dist.cdf(jnp.asarray(np.broadcast_to(values[:, None], expected.shape)))
        np.testing.assert_allclose(np.asarray(got, np.float64), expected, rtol=rtol, atol=rtol)
        with np.errstate(divide="ignore"):
            log_expected = np.log(expected)
        np.testing.assert_allclose(
            np.asarray(dist.log_cdf(jnp.asarray(values[:, None])), np.float64),
            log_expected,
            rtol=rtol,
            atol=rtol,
        )
        assert bool(jnp.all(jnp.isnan(dist.cdf(jnp.full(LOGITS.shape[0], jnp.nan)))))


def test_mode_is_the_most_probable_allowed_action():
    mode = np.asarray(_dist().mode())
    expected = np.argmax(np.where(MASK, np.nan_to_num(LOGITS, posinf=1e300), -np.inf), axis=-1)
    np.testing.assert_array_equal(mode[:NO_ACTION], expected[:NO_ACTION])
    assert np.all(MASK[np.arange(NO_ACTION), mode[:NO_ACTION]])


def test_samples_are_allowed_and_follow_the_probabilities():
    n = 40_000
    dist = _dist()
    samples = np.asarray(dist.sample(seed=jax.random.key(1), sample_shape=n))
    _, probs, _ = _oracle(LOGITS, MASK)
    for row in range(NO_ACTION):
        counts = np.bincount(samples[:, row], minlength=LOGITS.shape[1])
        assert np.all(counts[~MASK[row]] == 0)
        # Each count within 5 binomial standard deviations of n p.
        sigma = np.sqrt(n * probs[row] * (1 - probs[row]))
        assert np.all(np.abs(counts - n * probs[row]) <= 5 * sigma + 1e-9)


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
def test_gradients_match_float64_differences_and_are_zero_for_masked_logits(quantity):
    action = np.array([0, 2, 1, 1, 3, 2, 0, 0])
    rows = slice(0, NO_ACTION)
    logits, mask = LOGITS[rows], MASK[rows]

    def oracle(values):
        log_probs, _, entropy = _oracle(values, mask)
        if quantity == "entropy":
            return entropy
        return log_probs[np.arange(len(values)), action[rows]]

    def library(values):
        dist = samplers.MaskedCategorical(values, jnp.asarray(mask))
        if quantity == "entropy":
            return dist.entropy().sum()
        return dist.log_prob(jnp.asarray(action[rows])).sum()

    with jax.enable_x64(True):
        grad = np.asarray(jax.jit(jax.grad(library))(jnp.asarray(logits, jnp.float64)))
    # The finite allowed logits of rows 0-1, 3, 4 and 6: row 2 holds 1e30 in a masked
    # slot, where differences would not resolve, and row 5 has one allowed action
    # (gradient 0). Row 6's logit of -inf has probability 0 and gradient 0.
    finite_rows = np.array([0, 1, 3, 4, 6])
    varied = mask & np.isfinite(logits)
    expected = _finite_differences(oracle, logits.astype(np.float64), varied)
    np.testing.assert_allclose(grad[finite_rows], expected[finite_rows], rtol=1e-6, atol=1e-8)
    assert np.all(np.isfinite(grad))
    assert np.all(grad[~mask] == 0)
    assert np.all(grad[5] == 0) and grad[6, 1] == 0


def test_gradients_are_finite_in_float32_with_the_masked_logits_at_zero():
    def loss(values):
        dist = samplers.MaskedCategorical(values, jnp.asarray(MASK[:NO_ACTION]))
        return (dist.entropy() + dist.log_prob(dist.mode())).sum()

    grad = np.asarray(jax.grad(loss)(jnp.asarray(LOGITS[:NO_ACTION], jnp.float32)))
    assert np.all(np.isfinite(grad)) and np.all(grad[~MASK[:NO_ACTION]] == 0)


def test_kl_divergence_matches_float64_formulas_and_is_inf_where_q_forbids_an_action_p_allows():
    q_logits = np.array([[1.0, 0.0, -1.0, 0.5]] * len(LOGITS))
    q_mask = np.array([[True, True, True, False]] * len(LOGITS))
    p, q = _dist(), samplers.MaskedCategorical(jnp.asarray(q_logits, jnp.float32), q_mask)
    log_p, probs, _ = _oracle(LOGITS, MASK)
    log_q, _, _ = _oracle(q_logits, q_mask)
    expected = []
    for row in range(len(LOGITS)):
        positive = probs[row] > 0
        if row == NO_ACTION:
            expected.append(np.nan)
        elif np.any(positive & ~q_mask[row]):
            expected.append(np.inf)
        else:
            expected.append(
                np.sum(probs[row, positive] * (log_p[row, positive] - log_q[row, positive]))
            )
    for kl in (p.kl_divergence(q), tfd.kl_divergence(p, q)):
        np.testing.assert_allclose(np.asarray(kl, np.float64), expected, rtol=1e-5, atol=1e-6)
    # Against a plain distrax Categorical (every action allowed), both ways round.
    plain = distrax.Categorical(jnp.asarray(q_logits, jnp.float32))
    log_plain, probs_plain, _ = _oracle(q_logits, np.ones_like(q_mask))
    forward = [
        np.nan
        if row == NO_ACTION
        else np.sum(probs[row, probs[row] > 0] * (log_p[row] - log_plain[row])[probs[row] > 0])
        for row in range(len(LOGITS))
    ]
    np.testing.assert_allclose(np.asarray(p.kl_divergence(plain)), forward, rtol=1e-5, atol=1e-6)
    backward = [
        np.nan if row == NO_ACTION else np.sum(probs_plain[row] * (log_plain[row] - log_p[row]))
        for row in range(len(LOGITS))
    ]  # +inf where p forbids an action that the plain Categorical allows
    np.testing.assert_allclose(np.asarray(plain.kl_divergence(p)), backward, rtol=1e-5, atol=1e-6)


def test_indexing_keeps_the_mask_and_works_under_jit_and_vmap():
    dist = _dist()
    assert dist.batch_shape == (len(LOGITS),)
    part = dist[1:3]
    np.testing.assert_array_equal(np.asarray(part.mask), MASK[1:3])
    np.testing.assert_array_equal(np.asarray(part.entropy()), np.asarray(dist.entropy())[1:3])

    @jax.jit
    def entropy(logits, mask):
        return samplers.MaskedCategorical(logits, mask).entropy()

    logits = jnp.asarray(LOGITS, jnp.float32)
    np.testing.assert_allclose(
        np.asarray(entropy(logits, MASK)), np.asarray(dist.entropy()), rtol=1e-6
    )
    per_row = jax.vmap(lambda row, allowed: samplers.MaskedCategorical(row, allowed).entropy())(
        logits, MASK
    )
    np.testing.assert_allclose(np.asarray(per_row), np.asarray(dist.entropy()), rtol=1e-6)


def test_bad_inputs_are_refused_by_name():
    with pytest.raises(TypeError, match="mask must be boolean"):
        samplers.MaskedCategorical(jnp.zeros(3), jnp.ones(3))
    with pytest.raises(ValueError, match=r"mask must have shape \(3,\), logits' shape, got \(2,\)"):
        samplers.MaskedCategorical(jnp.zeros(3), jnp.ones(2, bool))
    with pytest.raises(ValueError, match="action axis"):
        samplers.MaskedCategorical(jnp.float32(0.0))
    with pytest.raises(
        TypeError,
        match=r"logits must be numbers, got booleans of shape \(3,\): booleans are a mask of "
        r"allowed actions; pass them as mask= with float logits",
    ):
        samplers.MaskedCategorical(jnp.array([True, False, True]))
    with pytest.raises(
        TypeError, match="logits must be an array of numbers, got 'abc' of type str"
    ):
        samplers.MaskedCategorical("abc")


INTEGER_LOGITS = np.array([[0, 3, 7, 1], [5, 5, 0, 2], [100, 0, 1, 9]])
ACTIONS = np.array([2, 0, 1])


@pytest.mark.parametrize(
    "dtype, x64, expected",
    [
        pytest.param(np.int32, False, jnp.float32, id="int32"),
        slow(np.int8, False, jnp.float32, id="int8"),
        slow(np.int16, True, jnp.float32, id="int16-x64"),
        slow(np.int64, True, jnp.float64, id="int64-x64"),
    ],
)
def test_integer_logits_are_taken_as_distrax_categorical_takes_them(dtype, x64, expected):
    with jax.enable_x64(x64):
        logits, actions = jnp.asarray(INTEGER_LOGITS.astype(dtype)), jnp.asarray(ACTIONS)
        ours = samplers.MaskedCategorical(logits)
        got = {"log_prob": ours.log_prob(actions), "probs": ours.probs, "entropy": ours.entropy()}
        with warnings.catch_warnings():
            # distrax's own normalisation of integers warns (jnp.max's -inf start cast to an
            # integer); ours converts them first.
            warnings.simplefilter("ignore", RuntimeWarning)
            theirs = distrax.Categorical(logits)
            want = {"log_prob": theirs.log_prob(actions), "probs": theirs.probs}
            want["entropy"] = theirs.entropy()
    rtol = 1e-6 if expected == jnp.float32 else 1e-14
    assert ours.logits.dtype == theirs.logits.dtype == expected
    for name, value in got.items():
        assert value.dtype == want[name].dtype == expected, name
        np.testing.assert_allclose(value, want[name], rtol=rtol, atol=1e-30, err_msg=name)
    _assert_integer_softmax(got["log_prob"], expected)


def test_unsigned_integer_logits_are_right_where_distrax_categorical_is_not():
    logits = jnp.asarray(INTEGER_LOGITS.astype(np.uint8))
    ours = samplers.MaskedCategorical(logits)
    assert ours.logits.dtype == jnp.float32
    _assert_integer_softmax(ours.log_prob(jnp.asarray(ACTIONS)), jnp.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        # distrax's normalised logits of uint8 logits are all -inf, and so is every score.
        assert np.all(np.isneginf(distrax.Categorical(logits).log_prob(jnp.asarray(ACTIONS))))


def _assert_integer_softmax(log_prob, dtype):
    """``log_prob`` against the float64 log-softmax of :data:`INTEGER_LOGITS` at ``ACTIONS``,
    to a few roundings of the largest logit (100) in ``dtype``."""
    log_probs = INTEGER_LOGITS - special.logsumexp(INTEGER_LOGITS, axis=-1, keepdims=True)
    atol = 4 * np.finfo(dtype).eps * 100
    np.testing.assert_allclose(log_prob, log_probs[np.arange(3), ACTIONS], rtol=0, atol=atol)


@pytest.mark.parametrize(
    "dtype", [pytest.param(jnp.bfloat16, id="bfloat16"), slow(jnp.float16, id="float16")]
)
def test_half_precision_logits_compute_in_float32_bit_for_bit(dtype):
    logits = jnp.asarray(np.where(np.isfinite(LOGITS) & (np.abs(LOGITS) < 1e4), LOGITS, 0.0))
    logits = logits.astype(dtype)
    mask = jnp.asarray(MASK)
    other = samplers.MaskedCategorical(jnp.zeros(LOGITS.shape))

    def everything(logits):
        dist = samplers.MaskedCategorical(logits, mask)
        return {
            "logits": dist.logits,
            "probs": dist.probs,
            "log_prob": dist.log_prob(jnp.arange(8) % 4),
            "entropy": dist.entropy(),
            "cdf": dist.cdf(jnp.full(8, 1)),
            "kl": dist.kl_divergence(other),
            "sample": dist.sample(seed=jax.random.key(0)),
            "mode": dist.mode(),
        }

    expected, got = everything(logits.astype(jnp.float32)), everything(logits)
    for name, value in got.items():
        floating = jnp.issubdtype(expected[name].dtype, jnp.floating)
        assert value.dtype == (jnp.float32 if floating else expected[name].dtype), name
        np.testing.assert_array_equal(value, expected[name], err_msg=name)
