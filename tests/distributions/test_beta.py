"""``LogitBeta``, ``SquashedBeta`` and ``squashed_beta`` against oracles written here from
the definitions: mpmath at 50 digits at the exact float inputs, scipy in float64
(``scipy.stats.beta``, ``betaln``, ``betainc``, ``digamma``, numerical integration),
float64 finite differences of ``scipy.special.gammainc`` for the pathwise derivative
of a Gamma sample, and distrax's own ``Beta`` where it is finite.

The error bounds the library states are checked exactly as worded: the log-density of
a pre-image is within ``8 eps (1 + |log p| + |a d_a log p| + |b d_b log p| + |z d_z
log p|)`` of the exact value (the error of rounding each input by an ulp), and each
derivative within ``8 eps`` times the sum of the magnitudes of its terms.
"""

import functools
import itertools
import math

import distrax
import jax
import jax.numpy as jnp
import mpmath
import numpy as np
import pytest
from beartype import beartype
from jaxtyping import jaxtyped
from scipy import integrate, special, stats
from tensorflow_probability.substrates import jax as tfp

import samplers
from samplers.distributions.beta import LogitBeta, SquashedBeta
from samplers.distributions.constructors import squashed_beta
from tests import oracle
from tests._tiers import BATCH_SHAPES, slow

DIGITS = 50
DTYPES = [pytest.param(np.float32, id="float32"), slow(np.float64, id="float64")]


def _x64(dtype):
    return jax.enable_x64(np.dtype(dtype) == np.float64)


def _mp(value):
    return mpmath.mpf(float(value))


# ---------------------------------------------------------------------------------
# mpmath oracles, per element, from the definitions; arguments are Python floats (the
# exact stored float32 or float64 values), results float64.


@functools.cache
def _logit_density(a, b, z):
    """``log p(z)`` of ``z = logit X``, ``X ~ Beta(a, b)``, and its derivatives in a, b, z,
    with the magnitudes of the derivatives' terms."""
    with mpmath.workdps(DIGITS):
        a, b, z = _mp(a), _mp(b), _mp(z)
        log_x, log_y = -mpmath.log1p(mpmath.exp(-z)), -mpmath.log1p(mpmath.exp(z))
        value = a * log_x + b * log_y - mpmath.log(mpmath.beta(a, b))
        psi_a, psi_b, psi_n = mpmath.digamma(a), mpmath.digamma(b), mpmath.digamma(a + b)
        x, y = mpmath.exp(log_x), mpmath.exp(log_y)
        terms = {
            "a": (log_x - psi_a + psi_n, abs(log_x) + abs(psi_a) + abs(psi_n)),
            "b": (log_y - psi_b + psi_n, abs(log_y) + abs(psi_b) + abs(psi_n)),
            "z": (a * y - b * x, a * y + b * x),
        }
        return float(value), {k: (float(v), float(s)) for k, (v, s) in terms.items()}


@functools.cache
def _action_density(a, b, y, low, high):
    """``log p(y)`` of ``low + (high - low) U``, ``U ~ Beta(a, b)``, its derivatives in y, a
    and b, and the pre-image ``z = log(y - low) - log(high - y)`` (all from exact inputs)."""
    with mpmath.workdps(DIGITS):
        a, b, y, low, high = (_mp(v) for v in (a, b, y, low, high))
        width = high - low
        u, v = (y - low) / width, (high - y) / width
        n = a + b
        value = (a - 1) * mpmath.log(u) + (b - 1) * mpmath.log(v)
        value -= mpmath.log(mpmath.beta(a, b)) + mpmath.log(width)
        d_y = ((a - 1) / u - (b - 1) / v) / width
        d_a = mpmath.log(u) - mpmath.digamma(a) + mpmath.digamma(n)
        d_b = mpmath.log(v) - mpmath.digamma(b) + mpmath.digamma(n)
        z = mpmath.log(y - low) - mpmath.log(high - y)
        return tuple(float(t) for t in (value, d_y, d_a, d_b, z))


@functools.cache
def _log_incomplete(a, b, u):
    """``log I_u(a, b)`` and its derivatives in a and b (``u`` an mpmath number or float)."""
    with mpmath.workdps(DIGITS):
        a, b, u = _mp(a), _mp(b), mpmath.mpf(u)

        def log_i(a, b):
            return mpmath.log(mpmath.betainc(a, b, 0, u, regularized=True))

        value = log_i(a, b)
        d_a = mpmath.diff(lambda t: log_i(t, b), a)
        d_b = mpmath.diff(lambda t: log_i(a, t), b)
        return float(value), float(d_a), float(d_b)


@functools.cache
def _entropy(a, b):
    """``H[Beta(a, b)]`` and ``H[logit X]`` with their derivatives in a and b."""
    with mpmath.workdps(DIGITS):
        a, b = _mp(a), _mp(b)
        n = a + b
        log_beta = mpmath.log(mpmath.beta(a, b))
        psi = [mpmath.digamma(t) for t in (a, b, n)]
        tri = [mpmath.polygamma(1, t) for t in (a, b, n)]
        beta = log_beta - (a - 1) * psi[0] - (b - 1) * psi[1] + (n - 2) * psi[2]
        beta_da = -(a - 1) * tri[0] + (n - 2) * tri[2]
        beta_db = -(b - 1) * tri[1] + (n - 2) * tri[2]
        logit = log_beta - a * psi[0] - b * psi[1] + n * psi[2]
        logit_da = -a * tri[0] + n * tri[2]
        logit_db = -b * tri[1] + n * tri[2]
        return tuple(float(t) for t in (beta, beta_da, beta_db, logit, logit_da, logit_db))


@functools.cache
def _kl(a1, b1, a2, b2):
    """``KL(Beta(a1, b1) || Beta(a2, b2))`` and its derivatives in the four parameters."""
    with mpmath.workdps(DIGITS):

        def kl(a1, b1, a2, b2):
            n1 = a1 + b1
            return (
                mpmath.log(mpmath.beta(a2, b2))
                - mpmath.log(mpmath.beta(a1, b1))
                + (a1 - a2) * mpmath.digamma(a1)
                + (b1 - b2) * mpmath.digamma(b1)
                + (a2 - a1 + b2 - b1) * mpmath.digamma(n1)
            )

        args = [_mp(v) for v in (a1, b1, a2, b2)]
        value = kl(*args)
        grads = [
            mpmath.diff(lambda t, i=i: kl(*args[:i], t, *args[i + 1 :]), args[i]) for i in range(4)
        ]
        return float(value), [float(g) for g in grads]


def _elementwise(function, *arrays):
    arrays = np.broadcast_arrays(*(np.asarray(a, np.float64) for a in arrays))
    return [function(*(float(a[i]) for a in arrays)) for i in np.ndindex(arrays[0].shape)]


# ---------------------------------------------------------------------------------
# The log-density of a pre-image.

CONCENTRATIONS = (0.01, 1.0, 1e4)
DENSE_CONCENTRATIONS = (0.01, 0.3, 1.0, 2.5, 30.0, 1e3, 1e4)


def _pre_image_grid(concentrations, dtype):
    """Pairs ``(a, b)`` with pre-images at and around the mode, far out and at 0."""
    rows = []
    for a, b in itertools.product(concentrations, repeat=2):
        a, b = dtype(a), dtype(b)
        mode, spread = float(np.log(a) - np.log(b)), math.sqrt(1 / a + 1 / b)
        for z in (mode, mode + 0.01 * spread, mode - 0.3 * spread, mode + 3 * spread, -80, 80, 0):
            rows.append((a, b, dtype(z)))
    return (np.array(column, dtype) for column in zip(*rows, strict=True))


@pytest.mark.parametrize(
    "dtype, concentrations",
    [
        pytest.param(np.float32, CONCENTRATIONS, id="float32"),
        slow(np.float64, CONCENTRATIONS, id="float64"),
        slow(np.float32, DENSE_CONCENTRATIONS, id="float32-dense"),
        slow(np.float64, DENSE_CONCENTRATIONS, id="float64-dense"),
    ],
)
def test_logit_density_and_its_gradients_are_within_the_stated_bound_of_mpmath(
    dtype, concentrations
):
    with _x64(dtype):
        a, b, z = _pre_image_grid(concentrations, dtype)
        value_and_grad = jax.vmap(
            jax.value_and_grad(lambda a, b, z: LogitBeta(a, b).log_prob(z), (0, 1, 2))
        )
        value, grads = jax.jit(value_and_grad)(a, b, z)
    eps = np.finfo(dtype).eps
    exact = _elementwise(_logit_density, a, b, z)
    expected = np.array([e[0] for e in exact])
    slopes = {k: np.array([e[1][k][0] for e in exact]) for k in "abz"}
    sizes = {k: np.array([e[1][k][1] for e in exact]) for k in "abz"}
    inputs = {"a": a, "b": b, "z": z}
    scale = 1 + np.abs(expected) + sum(np.abs(inputs[k] * slopes[k]) for k in "abz")
    assert np.all(np.abs(np.asarray(value, np.float64) - expected) <= 8 * eps * scale)
    for name, grad in zip("abz", grads, strict=True):
        error = np.abs(np.asarray(grad, np.float64) - slopes[name])
        assert np.all(error <= 8 * eps * (1 + sizes[name])), name


def test_the_textbook_formula_errs_by_over_a_millinat_in_float32_where_this_does_not():
    a = b = np.float32(1e4)
    z = np.array([0.0, 0.01, 0.03], np.float32)
    textbook = -a * jax.nn.softplus(-z) - b * jax.nn.softplus(z) - jax.scipy.special.betaln(a, b)
    exact = np.array([_logit_density(1e4, 1e4, float(v))[0] for v in z])
    assert np.all(np.abs(np.asarray(textbook, np.float64) - exact) > 1e-3)
    ours = np.asarray(LogitBeta(a, b).log_prob(z), np.float64)
    assert np.all(np.abs(ours - exact) < 2e-5)


def test_logit_density_is_the_textbook_formula_where_that_is_accurate():
    # float64, moderate concentrations: a log sigmoid(z) + b log sigmoid(-z) - betaln.
    with jax.enable_x64(True):
        a, b = np.array([0.5, 2.0, 7.0]), np.array([3.0, 2.0, 0.25])
        z = np.array([-3.0, 0.4, 12.0])
        ours = LogitBeta(a, b).log_prob(z)
    textbook = -a * np.logaddexp(0, -z) - b * np.logaddexp(0, z) - special.betaln(a, b)
    np.testing.assert_allclose(ours, textbook, rtol=1e-14)


# ---------------------------------------------------------------------------------
# The density of an action: from the remembered pre-image, or from the distances.

LOW = np.array([-2.0, 0.0, 1.0])
HIGH = np.array([2.0, 1.0, 1000.0])


def _near_bound_actions(dtype):
    """Actions per dimension of (LOW, HIGH): a float step inside each bound (the smallest
    normal float above 0: XLA flushes smaller ones to 0, onto the bound), a few steps,
    and far inside."""
    low, high = LOW.astype(dtype), HIGH.astype(dtype)
    tiny = np.finfo(dtype).tiny
    step = np.where(low == 0, tiny, np.nextafter(low, high))
    rows = [
        step,
        np.where(low == 0, 4 * tiny, np.nextafter(np.nextafter(step, high), high)),
        low + (high - low) * dtype(1e-4),
        (low + high) / 2,
        low + (high - low) * dtype(0.7),
        np.nextafter(high, low),
    ]
    return np.stack(rows).astype(dtype)


def _logit_scale(a, b, z):
    """``1 + |log p| + |a d_a log p| + |b d_b log p| + |z d_z log p|`` at the exact inputs."""
    value, slopes = _logit_density(a, b, z)
    return (
        1 + abs(value) + sum(abs(v * slopes[k][0]) for k, v in zip("abz", (a, b, z), strict=True))
    )


def test_a_sample_that_rounded_onto_a_bound_is_scored_exactly_from_its_pre_image():
    # Concentrations of 0.05 put most float32 draws on the bounds. The shape is that of the
    # shape test below, which then reuses the compiled sampler.
    concentration = np.float32(0.05)
    dist = SquashedBeta(
        jnp.full((3, 4, 3), concentration), jnp.full((3, 4, 3), concentration), LOW, HIGH
    )
    action, pre_image, log_prob = dist.sample_with_pre_image(seed=jax.random.key(0))
    on_low = np.asarray(action) == LOW.astype(np.float32)
    on_high = np.asarray(action) == HIGH.astype(np.float32)
    assert on_low.any() and on_high.any()
    ours = dist.log_prob(action)  # the very array that was sampled: its pre-image
    np.testing.assert_array_equal(ours, log_prob)
    np.testing.assert_array_equal(ours, dist.log_prob_from_pre_image(pre_image))
    z = np.asarray(pre_image, np.float64)
    c = float(concentration)
    per_dimension = np.vectorize(lambda z: _logit_density(c, c, z)[0])(z)
    per_dimension += np.logaddexp(0, z) + np.logaddexp(0, -z) - np.log(HIGH - LOW)
    np.testing.assert_allclose(ours, per_dimension.sum(-1), rtol=1e-5)
    # A copy is scored as the atom of rounding there instead: another finite number.
    copy = dist.log_prob(jnp.array(action))
    rows = (on_low | on_high).any(-1)
    assert np.all(np.isfinite(copy)) and np.all(np.asarray(copy)[rows] != np.asarray(ours)[rows])


# The action tests below share one compiled function per dtype and grid: the
# log-density of rows of actions (one row per call) and its gradients with respect to
# the action and both concentrations, on the bounds LOW and HIGH.
STORED_A = np.array([0.3, 2.5, 40.0])
STORED_B = np.array([5.0, 0.7, 1e3])
CLOSED_RANGE_CONCENTRATIONS = [0.01, 0.3, 1.0, 2.5, 1e4]
ATOM_CONCENTRATIONS = [(0.3, 2.5), (2.5, 30.0)]
DENSE_ATOM_CONCENTRATIONS = [(0.01, 1e4), (1e4, 0.01), (1.0, 1.0), (1e4, 1e4), (30.0, 0.3)]


def _row_log_prob(action, a, b, low, high):
    return SquashedBeta(a, b, low, high).log_prob(action)


_ROW_SCORES = jax.jit(jax.vmap(jax.value_and_grad(_row_log_prob, (0, 1, 2)), (0, 0, 0, None, None)))


@functools.cache
def _scores(dtype, atom_concentrations):
    """``{part: (actions, a, b, log_prob, d_action, d_a, d_b)}``, numpy, for the parts
    ``"stored"`` (STORED_A, STORED_B at the near-bound actions), ``"closed"`` (every
    pair of CLOSED_RANGE_CONCENTRATIONS on the closed range, bounds included),
    ``"outside"`` and ``"atoms"`` (each pair of ``atom_concentrations`` with every
    dimension on LOW, then on HIGH)."""
    low, high = LOW.astype(dtype), HIGH.astype(dtype)
    near = _near_bound_actions(dtype)
    grid = np.concatenate([low[None], near, high[None]])
    pairs = list(itertools.product(CLOSED_RANGE_CONCENTRATIONS, repeat=2))
    outside = np.stack([np.nextafter(low, -np.inf), np.nextafter(high, np.inf)])
    parts = {
        "stored": (near, [STORED_A] * len(near), [STORED_B] * len(near)),
        "closed": (
            np.concatenate([grid] * len(pairs)),
            [np.full(3, a) for a, _ in pairs for _ in grid],
            [np.full(3, b) for _, b in pairs for _ in grid],
        ),
        "outside": (outside, [STORED_A] * 2, [STORED_B] * 2),
        "atoms": (
            np.concatenate([np.stack([low, high])] * len(atom_concentrations)),
            [np.full(3, a) for a, _ in atom_concentrations for _ in range(2)],
            [np.full(3, b) for _, b in atom_concentrations for _ in range(2)],
        ),
    }
    sizes = [len(part[0]) for part in parts.values()]
    actions, a, b = (
        np.concatenate([np.asarray(p[i], dtype) for p in parts.values()]) for i in range(3)
    )
    with _x64(dtype):
        value, grads = _ROW_SCORES(actions, a, b, low, high)
        outputs = [np.asarray(v) for v in (value, *grads)]
    edges = np.cumsum([0, *sizes])
    return {
        name: tuple(x[i:j] for x in (actions, a, b, *outputs))
        for name, i, j in zip(parts, edges[:-1], edges[1:], strict=True)
    }


@pytest.mark.parametrize("dtype", DTYPES)
def test_density_of_a_stored_action_against_mpmath_next_to_and_inside_the_bounds(dtype):
    actions, a, b, value, grad_y, grad_a, grad_b = _scores(dtype, tuple(ATOM_CONCENTRATIONS))[
        "stored"
    ]
    a, b = a[0].astype(np.float64), b[0].astype(np.float64)
    eps = np.finfo(dtype).eps
    rows = [
        [_action_density(a[j], b[j], float(y), LOW[j], HIGH[j]) for j, y in enumerate(row)]
        for row in actions
    ]
    expected, d_y, d_a, d_b, z = np.moveaxis(np.array(rows), -1, 0)
    # The pre-image's bound at the exact z, plus the log-distances that build z and
    # log|dy/dz| (each exact to its rounding).
    u, v = (actions - LOW) / (HIGH - LOW), (HIGH - actions) / (HIGH - LOW)
    logit = np.array([[_logit_scale(a[j], b[j], z[i, j]) for j in range(3)] for i in range(len(z))])
    scale = (
        logit + np.abs(np.log(actions - LOW)) + np.abs(np.log(HIGH - actions)) + np.log(HIGH - LOW)
    )
    error = np.abs(value.astype(np.float64) - expected.sum(-1))
    np.testing.assert_array_less(error, 8 * eps * scale.sum(-1))
    # Each derivative within 32 eps of the sum of the magnitudes of its terms. d_y =
    # ((a - 1) / u - (b - 1) / v) / (high - low); relative to it, its terms are
    # (a + |a - 1|) v + (b + |b - 1|) u over |(a - 1) v - (b - 1) u| (no overflow at u ~ tiny).
    y_terms = (a + np.abs(a - 1)) * v + (b + np.abs(b - 1)) * u
    np.testing.assert_array_less(
        np.abs(grad_y / d_y - 1), 32 * eps * y_terms / np.abs((a - 1) * v - (b - 1) * u)
    )
    psi_n = np.abs(special.digamma(a + b))
    a_terms = 1 + np.abs(np.log(u)) + np.abs(np.log(v)) + np.abs(special.digamma(a)) + psi_n
    b_terms = 1 + np.abs(np.log(u)) + np.abs(np.log(v)) + np.abs(special.digamma(b)) + psi_n
    np.testing.assert_array_less(np.abs(grad_a - d_a), 32 * eps * a_terms)
    np.testing.assert_array_less(np.abs(grad_b - d_b), 32 * eps * b_terms)


@pytest.mark.parametrize("dtype", DTYPES)
def test_log_prob_is_finite_on_the_closed_range_and_nan_outside(dtype):
    scores = _scores(dtype, tuple(ATOM_CONCENTRATIONS))
    actions, _, _, value, d_y, d_a, d_b = scores["closed"]
    assert np.any(actions == LOW.astype(dtype)) and np.any(actions == HIGH.astype(dtype))
    assert np.all(np.isfinite(value))
    assert np.all(np.isfinite(d_a)) and np.all(np.isfinite(d_b))
    # d/dy = ((a - 1) / u - (b - 1) / v) / (high - low) overflows float32 a float step from
    # a bound for large concentrations; it is never NaN, and 0 on the bounds (the atom
    # does not move with the action).
    assert not np.any(np.isnan(d_y))
    on_bound = (actions == LOW.astype(dtype)) | (actions == HIGH.astype(dtype))
    np.testing.assert_array_equal(d_y[on_bound], 0.0)
    assert np.all(np.isnan(scores["outside"][3]))


# Where the atom's threshold is: the pre-image of the point half a float step inside
# the bound (at least the smallest normal float), as tests/oracle.py defines it.
@pytest.mark.parametrize(
    "dtype, concentrations",
    [
        pytest.param(np.float32, ATOM_CONCENTRATIONS, id="float32"),
        slow(np.float64, ATOM_CONCENTRATIONS, id="float64"),
        slow(np.float32, DENSE_ATOM_CONCENTRATIONS, id="float32-dense"),
        slow(np.float64, DENSE_ATOM_CONCENTRATIONS, id="float64-dense"),
    ],
)
def test_an_action_on_a_bound_scores_the_atom_of_rounding_there(dtype, concentrations):
    _, a, b, value, _, d_a, d_b = _scores(dtype, tuple(concentrations))["atoms"]
    eps = np.finfo(dtype).eps
    for row, bound in itertools.product(range(len(value)), range(3)):
        side = oracle.LOWER if row % 2 == 0 else oracle.UPPER
        ca, cb = float(a[row, bound]), float(b[row, bound])
        low, high = (float(v.astype(dtype)) for v in (LOW[bound], HIGH[bound]))
        offset = oracle.bound_offset(side, low, high, 2, dtype)
        with mpmath.workdps(DIGITS):
            u = offset / (_mp(high) - _mp(low))
        # P[U <= u] = I_u(a, b) at low; P[U >= 1 - u] = I_u(b, a) at high.
        if side == oracle.LOWER:
            expected, slope_a, slope_b = _log_incomplete(ca, cb, u)
        else:
            expected, slope_b, slope_a = _log_incomplete(cb, ca, u)
        # The threshold is held to its rounding: log I moves by about a eps.
        size = 1 + abs(expected) + ca + cb + abs(ca * slope_a) + abs(cb * slope_b)
        psi = abs(special.digamma(ca)) + abs(special.digamma(cb)) + special.digamma(ca + cb)
        slope_size = 1 + abs(float(mpmath.log(u))) + psi + 1 / ca + 1 / cb
        where = (side, bound, ca, cb)
        # The row's log_prob sums its three atoms; each concentration's slope is its own.
        assert abs(d_a[row, bound] - slope_a) <= 16 * eps * slope_size, where
        assert abs(d_b[row, bound] - slope_b) <= 16 * eps * slope_size, where
        if bound == 0:
            expected_row = 0.0
            for j in range(3):
                lo, hi = (float(v.astype(dtype)) for v in (LOW[j], HIGH[j]))
                with mpmath.workdps(DIGITS):
                    u_j = oracle.bound_offset(side, lo, hi, 2, dtype) / (_mp(hi) - _mp(lo))
                args = (ca, cb, u_j) if side == oracle.LOWER else (cb, ca, u_j)
                expected_row += _log_incomplete(*args)[0]
            assert abs(value[row] - expected_row) <= 3 * 16 * eps * size, where


# ---------------------------------------------------------------------------------
# Sampling, and its pathwise derivative.


@pytest.mark.slow
def test_samples_are_jax_random_beta_drawn_through_the_logit():
    a = jnp.array([[0.01, 0.3, 2.0, 1e4]] * 8)
    b = jnp.array([[0.3, 0.3, 5.0, 0.01]] * 8)
    key = jax.random.key(4)
    z = SquashedBeta(a, b).sample_pre_image(seed=key)
    # sigmoid of the pre-image is jax.random.beta's draw from the same key, to rounding.
    np.testing.assert_allclose(
        jax.nn.sigmoid(z), jax.random.beta(key, a, b, a.shape), rtol=1e-6, atol=1e-30
    )
    assert np.all(np.isfinite(z))


@pytest.mark.slow
def test_float32_beta_draws_round_onto_one_as_the_module_says():
    # About 3,800 in 10**6 draws of Beta(0.3, 0.3) are exactly 1 in float32 (0.4%).
    draws = jax.random.beta(jax.random.key(0), 0.3, 0.3, (10**6,))
    assert 3000 < int(jnp.sum(draws == 1.0)) < 4600


@pytest.mark.parametrize("a, b", [slow(0.3, 0.3), slow(2.0, 5.0), slow(1e4, 1e4), slow(0.01, 2.0)])
def test_sampled_pre_images_follow_scipys_beta_through_the_logit(a, b):
    # The pre-images, not the actions: with a = 0.01 most float32 actions round onto low.
    dist = SquashedBeta(jnp.full((1,), a), jnp.full((1,), b), -3.0, 1.0)
    z = dist.distribution.sample(seed=jax.random.key(5), sample_shape=20000)[:, 0]
    z = np.asarray(z, np.float64)
    assert stats.kstest(z, lambda z: stats.beta(a, b).cdf(special.expit(z))).pvalue > 1e-3


PATHWISE_A = np.array([0.01, 0.3, 2.5, 1e3, 1e4])
PATHWISE_B = np.array([2.0, 0.05, 30.0, 1.0, 3e3])
# float32: above G = 1 the derivative is jax.lax.random_gamma_grad's, whose error grows
# with the concentration (SquashedBeta.sample_pre_image states these bounds).
FLOAT32_SLOPE_RTOL = np.array([2e-5, 2e-5, 2e-5, 1e-4, 1e-3])


@functools.cache
def _pathwise(dtype, num_samples):
    """One program per dtype: pre-images ``[num_samples, 5]`` of PATHWISE_A and PATHWISE_B
    on [0, 1], the ``log G_a`` and ``log G_b`` they are made of, ``d z / d a`` and
    ``d z / d b`` per sample by reverse mode, and the user's idiom ``a = dist.sample(seed=k);
    dist.log_prob(a)`` inside ``jax.grad`` beside the pre-image scored explicitly."""
    key = jax.random.key(6)
    a = np.broadcast_to(PATHWISE_A, (num_samples, 5)).astype(dtype)
    b = np.broadcast_to(PATHWISE_B, (num_samples, 5)).astype(dtype)

    def total(a, b):
        z = SquashedBeta(a, b).sample_pre_image(seed=key)
        return jnp.sum(z), z

    def idiom(a, b):
        dist = SquashedBeta(a, b)
        action = dist.sample(seed=key)
        return jnp.sum(dist.log_prob(action)), action

    def explicit(a, b):
        dist = SquashedBeta(a, b)
        return jnp.sum(dist.log_prob_from_pre_image(dist.distribution.sample(seed=key)))

    @jax.jit
    def run(a, b):
        (d_a, d_b), z = jax.grad(total, (0, 1), has_aux=True)(a, b)
        (idiom_value, action), idiom_grads = jax.value_and_grad(idiom, (0, 1), has_aux=True)(a, b)
        explicit_value, explicit_grads = jax.value_and_grad(explicit, (0, 1))(a, b)
        key_a, key_b = jax.random.split(key)
        log_a = jax.random.loggamma(key_a, a, a.shape, dtype)
        log_b = jax.random.loggamma(key_b, b, b.shape, dtype)
        return (a, b, z, log_a, log_b, d_a, d_b), (
            action,
            idiom_value,
            idiom_grads,
            explicit_value,
            explicit_grads,
        )

    with _x64(dtype):
        return jax.tree.map(lambda v: np.asarray(v, np.float64), run(a, b))


def _implicit_slope(a, log_x):
    """``d log G / d a = -(dP(a, G) / d a) / (G p(G; a))``: float64 central differences of
    ``scipy.special.gammainc``, written from the definition."""
    x = np.exp(log_x)
    h = 1e-6 * a
    d_p = (special.gammainc(a + h, x) - special.gammainc(a - h, x)) / (2 * h)
    return -d_p / np.exp(a * log_x - x - special.gammaln(a))


@pytest.mark.parametrize(
    "dtype", [pytest.param(np.float32, id="float32"), slow(np.float64, id="float64")]
)
def test_pathwise_derivative_of_each_sample_is_the_implicit_one(dtype):
    a, b, z, log_a, log_b, d_a, d_b = _pathwise(dtype, 512)[0]
    np.testing.assert_allclose(z, log_a - log_b, rtol=4 * np.finfo(dtype).eps, atol=1e-30)
    rtol = FLOAT32_SLOPE_RTOL if dtype == np.float32 else 1e-7
    # The oracle needs G = exp(log G) in float64: skip the draws below 1e-300.
    for slopes, c, log_g, sign in ((d_a, a, log_a, 1.0), (d_b, b, log_b, -1.0)):
        usable = log_g > -690
        error = np.abs(slopes - sign * _implicit_slope(c, log_g))
        assert np.all((error <= rtol * np.abs(slopes))[usable])
    if dtype == np.float32:
        # Where float32 exp(log G) underflows (a = 0.01: log G down to about -300),
        # jax.random.loggamma's own derivative is taken at the smallest normal float.
        assert np.any((log_a > -690) & (log_a < -88))


@pytest.mark.parametrize(
    "dtype", [pytest.param(np.float32, id="float32"), slow(np.float64, id="float64")]
)
def test_pathwise_derivative_is_trigamma_in_expectation(dtype):
    # E[d log G_a / d a] = d E[log G_a] / d a = trigamma(a).
    _, _, _, _, _, d_a, d_b = _pathwise(dtype, 512)[0]
    for slopes, expected in (
        (d_a, special.polygamma(1, PATHWISE_A)),
        (-d_b, special.polygamma(1, PATHWISE_B)),
    ):
        error = np.abs(slopes.mean(0) - expected)
        assert np.all(error < 5 * slopes.std(0) / np.sqrt(len(slopes)))


def test_a_sample_in_the_users_idiom_differentiates_through_its_pre_image():
    # a = dist.sample(seed=k); dist.log_prob(a), inside jax.grad: the value and gradient of
    # scoring the pre-image itself, reparameterised, also for draws on the bounds.
    action, value, grads, explicit_value, explicit_grads = _pathwise(np.float32, 512)[1]
    assert np.any((action == 0.0) | (action == 1.0))  # a = 0.01, b = 0.05: on the bounds
    np.testing.assert_allclose(value, explicit_value, rtol=1e-6)
    for grad, expected in zip(grads, explicit_grads, strict=True):
        assert np.all(np.isfinite(grad))
        np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------
# Entropy, moments, mode, CDF and KL.

ENTROPY_CONCENTRATIONS = [(0.01, 0.01), (0.3, 2.5), (1.0, 1.0), (30.0, 1e4), (1e4, 1e4)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_entropy_is_exact_against_scipy_and_mpmath(dtype):
    pairs = np.array(ENTROPY_CONCENTRATIONS, dtype)
    low, high = np.array([-1.0, 0.5], dtype), np.array([3.0, 0.75], dtype)
    a, b = (np.repeat(pairs[:, i : i + 1], 2, axis=1) for i in (0, 1))
    with _x64(dtype):

        def entropies(a, b):
            return SquashedBeta(a, b, low, high).entropy(), LogitBeta(a, b).entropy()

        squashed, (d_a, d_b) = jax.jit(
            jax.vmap(jax.value_and_grad(lambda a, b: entropies(a, b)[0], (0, 1)))
        )(a, b)
        logit = jax.jit(lambda a, b: entropies(a, b)[1])(a, b)
        squashed, d_a, d_b, logit = (np.asarray(v, np.float64) for v in (squashed, d_a, d_b, logit))
    eps = np.finfo(dtype).eps
    width = np.log(high.astype(np.float64) - low)
    scipy_values = [stats.beta(float(ca), float(cb)).entropy() for ca, cb in pairs]
    for k, (ca, cb) in enumerate(pairs.tolist()):
        beta, beta_da, beta_db, logit_h, _, _ = _entropy(ca, cb)
        # Within 16 eps of the sizes of the terms of a digamma-free form: H is a sum of
        # terms of size |log B| + a digamma(a) ..., that cancel; the form used does not.
        size = 1 + abs(beta) + abs(logit_h) + abs(math.log(ca + cb))
        np.testing.assert_allclose(
            squashed[k], 2 * beta + width.sum(), rtol=0, atol=32 * eps * size
        )
        np.testing.assert_allclose(logit[k], logit_h, rtol=0, atol=16 * eps * size)
        if max(ca, cb) < 1e3:  # scipy's textbook formula cancels for large concentrations
            expected = 2 * scipy_values[k] + width.sum()
            np.testing.assert_allclose(squashed[k], expected, rtol=1e-5, atol=1e-5)
        # dH/da = -(a - 1) trigamma(a) + (a + b - 2) trigamma(a + b): the sizes of its terms.
        trigamma_n = float(special.polygamma(1, ca + cb))
        slope_size = (
            1
            + abs(ca - 1) * float(special.polygamma(1, ca))
            + abs(cb - 1) * float(special.polygamma(1, cb))
            + abs(ca + cb - 2) * trigamma_n
        )
        np.testing.assert_allclose(d_a[k], beta_da, rtol=0, atol=32 * eps * slope_size)
        np.testing.assert_allclose(d_b[k], beta_db, rtol=0, atol=32 * eps * slope_size)


@pytest.mark.parametrize("dtype, rtol", [(np.float32, 2e-6), slow(np.float64, 1e-14)])
def test_entropy_gradient_keeps_its_relative_accuracy_where_its_terms_cancel(dtype, rtol):
    # dH/da = (n - 2) trigamma(n) - (a - 1) trigamma(a): terms of size 1 whose
    # difference is of size 1 / a for large concentrations.
    pairs = [(0.01, 1e4), (30.0, 1e4), (1e4, 1e4), (1e6, 1e6), (1e6, 3.0), (3.0, 1e6)]
    a, b = (np.array([p[i] for p in pairs], dtype)[:, None] for i in (0, 1))
    with _x64(dtype):
        slopes = jax.jit(jax.vmap(jax.grad(lambda a, b: SquashedBeta(a, b).entropy(), (0, 1))))(
            a, b
        )
    for k, (ca, cb) in enumerate(pairs):
        _, want_a, want_b, _, _, _ = _entropy(float(dtype(ca)), float(dtype(cb)))
        np.testing.assert_allclose(float(slopes[0][k, 0]), want_a, rtol=rtol)
        np.testing.assert_allclose(float(slopes[1][k, 0]), want_b, rtol=rtol)


def test_logit_entropy_is_the_integral_of_minus_p_log_p():
    a, b = 0.7, 3.0

    def log_p(z):
        return a * -np.logaddexp(0, -z) + b * -np.logaddexp(0, z) - special.betaln(a, b)

    integral = integrate.quad(lambda z: -np.exp(log_p(z)) * log_p(z), -np.inf, np.inf, limit=200)[0]
    with jax.enable_x64(True):
        np.testing.assert_allclose(LogitBeta(a, b).entropy(), integral, rtol=1e-9)


def test_logit_moments_and_mode_against_scipy_and_integration():
    a, b = np.array([0.3, 2.0, 1e4]), np.array([5.0, 2.0, 0.5])
    with jax.enable_x64(True):
        dist = LogitBeta(a, b)
        mean, variance, mode = (np.asarray(f()) for f in (dist.mean, dist.variance, dist.mode))
        std = np.asarray(dist.stddev())
    np.testing.assert_allclose(mean, special.digamma(a) - special.digamma(b), rtol=1e-13)
    np.testing.assert_allclose(
        variance, special.polygamma(1, a) + special.polygamma(1, b), rtol=1e-13
    )
    np.testing.assert_allclose(std, np.sqrt(variance), rtol=1e-15)
    np.testing.assert_allclose(mode, np.log(a / b), rtol=1e-15)

    # The moments of z by integration, for the moderate case.
    def log_p(z):
        return 2.0 * -np.logaddexp(0, -z) + 2.0 * -np.logaddexp(0, z) - special.betaln(2.0, 2.0)

    first = integrate.quad(lambda z: z * np.exp(log_p(z)), -np.inf, np.inf)[0]
    second = integrate.quad(lambda z: z * z * np.exp(log_p(z)), -np.inf, np.inf)[0]
    np.testing.assert_allclose([mean[1], variance[1]], [first, second - first**2], atol=1e-9)


def test_squashed_moments_and_mode_against_scipy():
    a = np.array([[0.3, 2.0, 1e4, 1.0, 3.0]])
    b = np.array([[5.0, 2.0, 0.5, 3.0, 1.0]])
    low, high = np.array([-2.0, 0.0, 1.0, -1.0, 5.0]), np.array([2.0, 1.0, 1000.0, 0.0, 7.0])
    with jax.enable_x64(True):
        dist = SquashedBeta(a, b, low, high)
        mean, variance, stddev, mode = dist.mean(), dist.variance(), dist.stddev(), dist.mode()
        same_mean = dist.log_prob(mean) == dist.log_prob_from_pre_image(dist.mean_pre_image())
        a2, b2 = a[:, 1:] + 1.0, b[:, 1:] + 1.0  # above 1: each has a mode
        unimodal = SquashedBeta(a2, b2, low[1:], high[1:])
        mode_pre_image = jnp.log(a2 - 1.0) - jnp.log(b2 - 1.0)
        same_mode = unimodal.log_prob(unimodal.mode()) == unimodal.log_prob_from_pre_image(
            mode_pre_image
        )
        mean, variance, stddev, mode = (np.asarray(v) for v in (mean, variance, stddev, mode))
    width = high - low
    scipy_beta = stats.beta(a, b)
    np.testing.assert_allclose(mean, low + width * scipy_beta.mean(), rtol=1e-14)
    np.testing.assert_allclose(variance, width**2 * scipy_beta.var(), rtol=1e-13)
    np.testing.assert_allclose(stddev, np.sqrt(variance), rtol=1e-15)
    assert bool(same_mean)  # the mean remembers its pre-image log a - log b
    # The mode (a - 1) / (a + b - 2) only where a > 1 and b > 1; NaN, not a bound, elsewhere.
    defined = (a > 1) & (b > 1)
    np.testing.assert_allclose(
        mode[defined], (low + width * (a - 1) / (a + b - 2))[defined], rtol=1e-14
    )
    assert np.all(np.isnan(mode[~defined]))
    assert bool(same_mode)  # the mode remembers log(a - 1) - log(b - 1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_mean_is_the_sigmoid_of_log_a_minus_log_b_within_the_stated_bound(dtype):
    values = np.array([0.01, 0.3, 1.0, 7.0, 1e4], dtype)
    a, b = (np.array(v, dtype) for v in zip(*itertools.product(values, repeat=2), strict=True))
    with _x64(dtype):
        dist = SquashedBeta(a[:, None], b[:, None])
        unit = np.asarray(dist.mean()[:, 0], np.float64)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    bound = 8 * np.finfo(dtype).eps * (1 + np.abs(np.log(a64)) + np.abs(np.log(b64)))
    np.testing.assert_array_less(np.abs(unit / (a64 / (a64 + b64)) - 1), bound)


def test_median_is_refused_rather_than_inexact():
    with pytest.raises(NotImplementedError, match="median has no implementation exact to float"):
        SquashedBeta(jnp.ones(1), jnp.ones(1)).median()


CDF_CONCENTRATIONS = (0.01, 1.0, 30.0, 1e4)
CDF_QUANTILES = (1e-30, 1e-6, 0.3, 0.5, 0.99, 1 - 1e-6)
# The error LogitBeta.log_cdf states: of I below x = (a + 1) / (a + b + 2), of 1 - I
# above, relative, with concentrations up to 1e3 and up to 1e4.
CDF_RTOL = {np.float32: (1e-4, 1e-3), np.float64: (3e-13, 3e-12)}


def _cdf_grid(concentrations, dtype):
    rows = []
    for a, b in itertools.product(concentrations, repeat=2):
        a, b = dtype(a), dtype(b)
        for z in special.logit(special.betaincinv(float(a), float(b), CDF_QUANTILES)):
            if np.isfinite(dtype(z)):
                rows.append((a, b, dtype(z)))
    return (np.array(column, dtype) for column in zip(*rows, strict=True))


@pytest.mark.parametrize(
    "dtype, concentrations",
    [
        pytest.param(np.float32, CDF_CONCENTRATIONS, id="float32"),
        slow(np.float64, CDF_CONCENTRATIONS, id="float64"),
        slow(np.float32, DENSE_CONCENTRATIONS, id="float32-dense"),
        slow(np.float64, DENSE_CONCENTRATIONS, id="float64-dense"),
    ],
)
def test_log_cdf_against_scipy(dtype, concentrations):
    a, b, z = _cdf_grid(concentrations, dtype)
    with _x64(dtype):
        ours = np.asarray(jax.jit(lambda a, b, z: LogitBeta(a, b).log_cdf(z))(a, b, z), np.float64)
    a64, b64, z64 = (v.astype(np.float64) for v in (a, b, z))
    below = z64 < np.log((a64 + 1) / (b64 + 1))  # x < (a + 1) / (a + b + 2)
    # scipy's betainc of either tail, exact to float64 rounding.
    lower = special.betainc(a64, b64, special.expit(z64))
    upper = special.betainc(b64, a64, special.expit(-z64))
    error = np.where(
        below, np.abs(np.expm1(ours - np.log(lower))), np.abs(-np.expm1(ours) / upper - 1)
    )
    moderate = np.maximum(a64, b64) <= 1e3
    assert np.all(error[moderate] <= CDF_RTOL[dtype][0])
    assert np.all(error <= CDF_RTOL[dtype][1])


def test_log_cdf_at_the_ends_and_where_the_fraction_does_not_converge():
    logit = LogitBeta(2.0, 3.0)
    np.testing.assert_array_equal(logit.log_cdf(jnp.array([-jnp.inf, jnp.inf])), [-jnp.inf, 0.0])
    # Near the median the continued fraction needs about sqrt(a) steps: 1e6 converges
    # within 5000, 1e8 does not and is NaN rather than a partial sum.
    converged, unconverged = LogitBeta(jnp.array([1e6, 1e8]), jnp.array([1e6, 1e8])).log_cdf(0.0)
    np.testing.assert_allclose(converged, np.log(0.5), atol=1e-3)
    assert np.isnan(unconverged)


def test_log_prob_and_entropy_differentiate_in_the_bounds():
    def scores(low, high):
        dist = SquashedBeta(jnp.array([0.5, 3.0]), jnp.array([2.0, 0.7]), low, high)
        return dist.log_prob_from_pre_image(jnp.array([-40.0, 1.5])), dist.entropy()

    low, high = jnp.array([-2.0, 0.5]), jnp.array([1.0, 3.0])
    for output in range(2):
        d_low, d_high = jax.grad(lambda lo, hi, k=output: scores(lo, hi)[k], (0, 1))(low, high)
        # Both are the density's -log(high - low), per dimension.
        np.testing.assert_allclose(d_low, 1 / (high - low) * (1 if output == 0 else -1), rtol=1e-6)
        np.testing.assert_allclose(d_high, -d_low, rtol=1e-6)


def test_cdf_and_its_derivatives_against_mpmath_on_the_action():
    a, b = np.array([[0.3, 2.5, 30.0]]), np.array([[2.0, 2.5, 0.7]])
    low, high = np.array([-2.0, 0.0, 1.0]), np.array([2.0, 1.0, 1000.0])
    action = np.array([[-1.5, 0.5, 900.0]])
    with jax.enable_x64(True):

        def log_cdf(y, a, b):
            return SquashedBeta(a, b, low, high).log_cdf(y)[0]

        @jax.jit
        def run(y, a, b, edges):
            dist = SquashedBeta(a, b, low, high)
            return jax.value_and_grad(log_cdf, (0, 1, 2))(y, a, b), dist.log_cdf(edges), dist.cdf(y)

        (value, (d_y, d_a, d_b)), edges, cdf = run(
            action, a, b, np.stack([low, high, low - 1, high + 1])
        )
    u = (action - low) / (high - low)
    expected = [_log_incomplete(float(a[0, j]), float(b[0, j]), float(u[0, j])) for j in range(3)]
    np.testing.assert_allclose(value, sum(e[0] for e in expected), rtol=1e-12)
    np.testing.assert_allclose(cdf, np.exp(value), rtol=1e-15)
    np.testing.assert_allclose(d_a[0], [e[1] for e in expected], rtol=1e-10)
    np.testing.assert_allclose(d_b[0], [e[2] for e in expected], rtol=1e-10)
    density = np.exp(
        stats.beta(a, b).logpdf(u) - np.log(high - low) - np.array([e[0] for e in expected])
    )
    np.testing.assert_allclose(d_y, density, rtol=1e-10)
    np.testing.assert_array_equal(np.asarray(edges), [-np.inf, 0.0, -np.inf, 0.0])


KL_PAIRS = [
    ((2.0, 3.0), (1.0, 1.0)),
    ((0.3, 0.7), (2.5, 0.4)),
    ((50.0, 20.0), (55.0, 19.0)),
    ((1e4, 1e4), (1.01e4, 0.99e4)),
    ((0.01, 5.0), (0.02, 4.0)),
]


@pytest.mark.parametrize("dtype", DTYPES)
def test_kl_divergence_against_mpmath_scipy_and_integration(dtype):
    p, q = (np.array([[pair[i][j] for pair in KL_PAIRS] for j in (0, 1)], dtype) for i in (0, 1))
    with _x64(dtype):

        def kl(a1, b1, a2, b2):
            return SquashedBeta(a1, b1, -1.0, 2.0).kl_divergence(SquashedBeta(a2, b2, -1.0, 2.0))

        per_pair = jax.vmap(jax.value_and_grad(kl, (0, 1, 2, 3)))
        value, grads = jax.jit(per_pair)(p[0][:, None], p[1][:, None], q[0][:, None], q[1][:, None])
        value, grads = (
            np.asarray(value, np.float64),
            [np.asarray(g, np.float64)[:, 0] for g in grads],
        )
    eps = np.finfo(dtype).eps
    for k, ((a1, b1), (a2, b2)) in enumerate(KL_PAIRS):
        args = [float(dtype(v)) for v in (a1, b1, a2, b2)]
        expected, slopes = _kl(*args)
        # Within 16 eps of the size of a rounding of each parameter.
        size = 1 + abs(expected) + sum(abs(v * s) for v, s in zip(args, slopes, strict=True))
        assert abs(value[k] - expected) <= 16 * eps * size, k
        for g, s in zip(grads, slopes, strict=True):
            assert abs(g[k] - s) <= 64 * eps * (1 + sum(abs(t) for t in slopes)) * size, k
    # The float64 closed form, written separately, and the integral, where they are exact.
    a1, b1, a2, b2 = 0.3, 0.7, 2.5, 0.4
    closed = (
        special.betaln(a2, b2)
        - special.betaln(a1, b1)
        + (a1 - a2) * special.digamma(a1)
        + (b1 - b2) * special.digamma(b1)
        + (a2 - a1 + b2 - b1) * special.digamma(a1 + b1)
    )
    p_beta, q_beta = stats.beta(a1, b1), stats.beta(a2, b2)
    integral = integrate.quad(
        lambda u: p_beta.pdf(u) * (p_beta.logpdf(u) - q_beta.logpdf(u)), 0, 1, limit=200
    )[0]
    np.testing.assert_allclose(value[1], closed, rtol=1e-5 if dtype == np.float32 else 1e-13)
    np.testing.assert_allclose(closed, integral, rtol=1e-7)


def test_kl_of_equal_parameters_is_zero_and_dispatches_through_distrax_and_tfp():
    p = SquashedBeta(jnp.array([[0.3, 1e4]]), jnp.array([[2.0, 1e4]]), -1.0, 1.0)
    q = SquashedBeta(jnp.array([[0.4, 1e4]]), jnp.array([[2.0, 9e3]]), -1.0, 1.0)
    np.testing.assert_array_equal(p.kl_divergence(p), [0.0])
    expected = p.kl_divergence(q)
    np.testing.assert_array_equal(distrax.Distribution.kl_divergence(p, q), expected)
    np.testing.assert_array_equal(tfp.distributions.kl_divergence(p, q), expected)
    logit_p, logit_q = (
        LogitBeta(p.concentration1, p.concentration0),
        LogitBeta(q.concentration1, q.concentration0),
    )
    np.testing.assert_allclose(jnp.sum(logit_p.kl_divergence(logit_q), -1), expected, rtol=1e-6)


def test_kl_with_other_bounds_is_refused_or_nan_when_traced():
    p = SquashedBeta(jnp.ones((2, 1)), jnp.ones((2, 1)), -1.0, 1.0)
    q = SquashedBeta(jnp.ones((2, 1)), jnp.ones((2, 1)), -1.0, 2.0)
    with pytest.raises(ValueError, match="p and q must have the same bounds"):
        p.kl_divergence(q)
    with pytest.raises(ValueError, match="same action size"):
        p.kl_divergence(SquashedBeta(jnp.ones((2, 3)), jnp.ones((2, 3)), -1.0, 1.0))

    @jax.jit
    def traced(high):
        return SquashedBeta(jnp.ones(1), jnp.ones(1), -1.0, high).kl_divergence(
            SquashedBeta(jnp.full(1, 2.0), jnp.ones(1), -1.0, 1.0)
        )

    assert np.isnan(traced(2.0))
    np.testing.assert_allclose(traced(1.0), _kl(1.0, 1.0, 2.0, 1.0)[0], rtol=1e-6)


# An adversarial grid for the KL: concentrations from 1e-3 to 1e5, each next to a
# neighbour (1e-3 and 1.1e-3, 30 and 31, 1e5 and 1.1e5), every pair of pairs in both
# orders and both positions, equal parameters included.
KL_GRID = (1e-3, 1.1e-3, 1.0, 30.0, 31.0, 1e5, 1.1e5)


@functools.cache
def _polygammas(a, b=0.0):
    """``lgamma``, ``digamma``, ``trigamma`` and ``tetragamma`` at 50 digits of the exact sum
    of the floats ``a`` and ``b``."""
    with mpmath.workdps(DIGITS):
        t = _mp(a) + _mp(b)
        return mpmath.loggamma(t), *(mpmath.polygamma(k, t) for k in range(3))


def _kl_closed_forms(a1, b1, a2, b2):
    """The KL from its definition, its four derivatives in closed form and, for each,
    ``sum over s of |s d2KL/ds dt|`` (the error of rounding the parameters)."""
    with mpmath.workdps(DIGITS):
        args = [_mp(v) for v in (a1, b1, a2, b2)]
        n1, n2 = args[0] + args[1], args[2] + args[3]
        (g_a1, psi_a1, tri_a1, tet_a1), (g_b1, psi_b1, tri_b1, tet_b1) = (
            _polygammas(a1),
            _polygammas(b1),
        )
        (g_a2, psi_a2, tri_a2, _), (g_b2, psi_b2, tri_b2, _) = _polygammas(a2), _polygammas(b2)
        g_n1, psi_n1, tri_n1, tet_n1 = _polygammas(a1, b1)
        g_n2, psi_n2, tri_n2, _ = _polygammas(a2, b2)
        a1, b1, a2, b2 = args
        value = (
            g_a2 + g_b2 - g_n2 - g_a1 - g_b1 + g_n1
            + (a1 - a2) * psi_a1 + (b1 - b2) * psi_b1 + (n2 - n1) * psi_n1
        )  # fmt: skip
        gradient = [
            (a1 - a2) * tri_a1 - (n1 - n2) * tri_n1,
            (b1 - b2) * tri_b1 - (n1 - n2) * tri_n1,
            psi_a2 - psi_a1 - psi_n2 + psi_n1,
            psi_b2 - psi_b1 - psi_n2 + psi_n1,
        ]
        cross = -tri_n1 - (n1 - n2) * tet_n1
        hessian = [
            [tri_a1 + (a1 - a2) * tet_a1 + cross, cross, tri_n1 - tri_a1, tri_n1],
            [cross, tri_b1 + (b1 - b2) * tet_b1 + cross, tri_n1, tri_n1 - tri_b1],
            [tri_n1 - tri_a1, tri_n1, tri_a2 - tri_n2, -tri_n2],
            [tri_n1, tri_n1 - tri_b1, -tri_n2, tri_b2 - tri_n2],
        ]
        sizes = [sum(abs(s * h) for s, h in zip(args, row, strict=True)) for row in hessian]
        return float(value), [float(g) for g in gradient], [float(s) for s in sizes]


def test_kl_closed_form_derivatives_are_those_of_the_definition():
    # The oracle's closed forms against mpmath's numerical derivatives of the definition.
    for row in [(1e-3, 31.0, 1.1e-3, 1e5), (30.0, 1.0, 31.0, 1.1e5)]:
        value, gradient, _ = _kl_closed_forms(*row)
        expected_value, expected_gradient = _kl(*row)
        np.testing.assert_allclose(value, expected_value, rtol=1e-14)
        np.testing.assert_allclose(gradient, expected_gradient, rtol=1e-12)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kl_value_and_gradient_on_an_adversarial_grid_against_mpmath(dtype):
    rows = np.array(list(itertools.product(KL_GRID, repeat=4)), dtype)
    with _x64(dtype):

        def kl(a1, b1, a2, b2):
            return SquashedBeta(a1, b1, -1.0, 2.0).kl_divergence(SquashedBeta(a2, b2, -1.0, 2.0))

        def total(*p):
            values = kl(*p)
            return jnp.sum(values), values

        value_and_grad = jax.jit(jax.value_and_grad(total, (0, 1, 2, 3), has_aux=True))
        (_, values), gradients = value_and_grad(*(jnp.asarray(rows[:, i, None]) for i in range(4)))
        values = np.asarray(values, np.float64)
        gradients = np.concatenate(gradients, axis=1).astype(np.float64)
    eps = np.finfo(dtype).eps
    for k, row in enumerate(rows.astype(np.float64)):
        expected, slopes, sizes = _kl_closed_forms(*row)
        # The docstring's bounds: the value within 16 eps (1 + |KL| + sum |t dKL/dt|), each
        # derivative within 16 eps (1 + |dKL/dt| + sum over s of |s d2KL/ds dt|).
        size = 1 + abs(expected) + sum(abs(t * s) for t, s in zip(row, slopes, strict=True))
        assert abs(values[k] - expected) <= 16 * eps * size, (row, values[k], expected)
        for i in range(4):
            bound = 16 * eps * (1 + abs(slopes[i]) + sizes[i])
            assert abs(gradients[k, i] - slopes[i]) <= bound, (row, i, gradients[k, i], slopes[i])
        if row[0] == row[2] and row[1] == row[3]:
            assert values[k] == 0.0 and np.all(gradients[k] == 0.0), row


EQUAL_A = (1e-3, 0.3, 1.0, 2.5, 30.0, 1e3, 1e5)
EQUAL_B = (1e5, 7.0, 1.0, 0.01, 30.0, 1.5, 1e-3)


def _kl_of_pairs(p, q):
    """``KL(p || q)`` of one-dimensional SquashedBetas, ``p = (a, b)`` arrays ``[N]``."""
    dist = SquashedBeta(p[0][:, None], p[1][:, None], -1.0, 1.0)
    return dist.kl_divergence(SquashedBeta(q[0][:, None], q[1][:, None], -1.0, 1.0))


@pytest.mark.parametrize("dtype", DTYPES)
def test_kl_of_equal_parameters_is_exactly_zero_with_zero_gradient(dtype):
    with _x64(dtype):
        p = (jnp.asarray(EQUAL_A, dtype), jnp.asarray(EQUAL_B, dtype))
        total = jax.value_and_grad(lambda p, q: jnp.sum(_kl_of_pairs(p, q)), (0, 1))
        value, gradients = jax.jit(total)(p, p)
        eager = _kl_of_pairs(p, p)
    assert float(value) == 0.0
    np.testing.assert_array_equal(eager, 0.0)
    for g in jax.tree.leaves(gradients):
        np.testing.assert_array_equal(g, 0.0)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_kl_hessian_at_equal_parameters_is_the_fisher_information(dtype):
    # The custom derivative is differentiable again: TRPO's Fisher-vector products.
    with _x64(dtype):
        p = (jnp.asarray(EQUAL_A, dtype), jnp.asarray(EQUAL_B, dtype))
        hessian = jax.jit(jax.hessian(lambda p, q: jnp.sum(_kl_of_pairs(p, q))))(p, p)
    with mpmath.workdps(DIGITS):
        for k, (a, b) in enumerate(zip(p[0].tolist(), p[1].tolist(), strict=True)):
            tri = [_polygammas(a)[2], _polygammas(b)[2], _polygammas(a, b)[2]]
            fisher = [[tri[0] - tri[2], -tri[2]], [-tri[2], tri[1] - tri[2]]]
            for i, j in itertools.product(range(2), repeat=2):
                got = float(np.asarray(hessian[i][j])[k, k])
                np.testing.assert_allclose(got, float(fisher[i][j]), rtol=64 * np.finfo(dtype).eps)


# ---------------------------------------------------------------------------------
# Invalid parameters, shapes, the constructor, the bijector, errors.


INVALID = jnp.array([0.0, -1.0, jnp.nan, jnp.inf])


def _invalid_second_dimension():
    a = jnp.stack([jnp.full(4, 2.0), INVALID], -1)  # [4, 2]: the second dimension is invalid
    return a, jnp.full((4, 2), 3.0)


def _assert_second_dimension_nan(outputs):
    for name, value in outputs.items():
        value = np.asarray(value)
        invalid = value[:, 1] if value.ndim == 2 else value
        assert np.all(np.isnan(invalid)), name


def test_invalid_concentrations_make_everything_of_their_dimension_nan():
    # The actions are arguments: XLA's CPU backend folds exp(where(p, c, nan)) to exp(c)
    # for a constant c, which a constant action on the upper bound would make the CDF.
    @jax.jit
    def everything(a, b, inside, high):
        dist = SquashedBeta(a, b, -1.0, 1.0)
        logit = LogitBeta(a, b)
        return {
            "log_prob_from_pre_image": dist.log_prob_from_pre_image(inside),
            "log_prob": dist.log_prob(inside),
            "log_prob_bound": dist.log_prob(high),
            "entropy": dist.entropy(),
            "mean": dist.mean(),
            "variance": dist.variance(),
            "mode": dist.mode(),
            "log_cdf": dist.log_cdf(inside),
            "cdf_at_high": dist.cdf(high),
            "kl": dist.kl_divergence(SquashedBeta(jnp.ones((4, 2)), jnp.ones((4, 2)), -1.0, 1.0)),
            "logit_log_prob": logit.log_prob(inside),
            "logit_entropy": logit.entropy(),
            "logit_mean": logit.mean(),
            "logit_variance": logit.variance(),
            "logit_log_cdf": logit.log_cdf(inside),
        }

    outputs = everything(*_invalid_second_dimension(), jnp.zeros((4, 2)), jnp.ones((4, 2)))
    _assert_second_dimension_nan(outputs)
    assert np.all(np.isfinite(np.asarray(outputs["mean"])[:, 0]))


@pytest.mark.slow
def test_invalid_concentrations_make_the_samples_of_their_dimension_nan():
    a, b = _invalid_second_dimension()
    dist = SquashedBeta(a, b, -1.0, 1.0)
    action, pre_image, log_prob = dist.sample_with_pre_image(seed=jax.random.key(0))
    _assert_second_dimension_nan({"action": action, "pre_image": pre_image, "log_prob": log_prob})
    assert np.all(np.isfinite(np.asarray(pre_image)[:, 0]))


def _checked(function):
    return jaxtyped(typechecker=beartype)(function)


@pytest.mark.parametrize("batch_shape", BATCH_SHAPES)
def test_shapes_and_their_annotations(batch_shape):
    params = jnp.zeros((*batch_shape, 6))
    dist = _checked(squashed_beta)(params, -1.0, 1.0)
    assert isinstance(dist, distrax.Transformed)
    assert dist.batch_shape == batch_shape and dist.event_shape == (3,)
    key = jax.random.key(0)
    action, pre_image, log_prob = _checked(SquashedBeta.sample_with_pre_image)(dist, seed=key)
    assert action.shape == pre_image.shape == (*batch_shape, 3) and log_prob.shape == batch_shape
    assert _checked(SquashedBeta.log_prob)(dist, action).shape == batch_shape
    stacked = jnp.stack([pre_image, pre_image])  # [2, *batch, 3]: a sample axis in front
    assert _checked(SquashedBeta.log_prob_from_pre_image)(dist, stacked).shape == (2, *batch_shape)
    assert _checked(SquashedBeta.entropy)(dist).shape == batch_shape
    for method in (SquashedBeta.mean, SquashedBeta.variance, SquashedBeta.mode):
        assert _checked(method)(dist).shape == (*batch_shape, 3)
    assert dist[..., :1].batch_shape == (*batch_shape[:-1], 1) if batch_shape else True


@pytest.mark.slow
@pytest.mark.parametrize("batch_shape", [(5,), (3, 4)], ids=["(B,A)", "(T,B,A)"])
def test_sample_shapes_and_one_key_per_batch_element(batch_shape):
    dist = squashed_beta(jnp.zeros((*batch_shape, 6)))
    key = jax.random.key(0)
    samples = dist.sample(seed=key, sample_shape=(2,))
    assert samples.shape == (2, *batch_shape, 3)
    copies = jnp.array(samples)  # scored from the distances, not the pre-images
    assert _checked(SquashedBeta.log_prob)(dist, copies).shape == (2, *batch_shape)
    assert _checked(SquashedBeta.log_cdf)(dist, jnp.zeros(3)).shape == batch_shape
    # One key per batch element: each element's draw does not depend on the others.
    keys = jnp.broadcast_to(jax.random.split(key, batch_shape[-1]), batch_shape)
    z = dist.sample_pre_image(seed=keys)
    np.testing.assert_array_equal(z[..., 1:, :], dist[..., 1:].sample_pre_image(seed=keys[..., 1:]))
    with pytest.raises(ValueError, match="one key per batch element"):
        dist.sample_pre_image(seed=jax.random.split(key, 7))


@pytest.mark.parametrize(
    "dtype", [pytest.param(jnp.bfloat16, id="bfloat16"), slow(jnp.float16, id="float16")]
)
def test_half_precision_parameters_compute_in_float32_bit_for_bit(dtype):
    params = (3.0 * jax.random.normal(jax.random.key(0), (4, 6))).astype(dtype)

    def everything(params):
        dist = squashed_beta(params, -2.0, 3.0)
        z = dist.sample_pre_image(seed=jax.random.key(1))
        return {
            "concentration1": dist.concentration1,
            "pre_image": z,
            "log_prob_from_pre_image": dist.log_prob_from_pre_image(z),
            "entropy": dist.entropy(),
            "mean": dist.mean(),
        }

    expected, got = everything(params.astype(jnp.float32)), everything(params)
    for name, value in got.items():
        assert value.dtype == jnp.float32, name
        np.testing.assert_array_equal(value, expected[name], err_msg=name)
    logit = LogitBeta(params[:, :3], params[:, 3:] + 3.0)
    assert logit.concentration1.dtype == logit.entropy().dtype == jnp.float32


def test_float64_bounds_keep_float64_precision_with_float32_parameters():
    # A box of width 1e-9 next to 1: rounded to float32, its bounds would be one point and
    # the log-density +inf. The result dtype of float32 parameters and float64 bound arrays
    # is float64, and the Beta computes in it, as BoundedTanh does.
    with jax.enable_x64(True):
        low, high = np.array([1.0, -1.0]), np.array([1.0 + 1e-9, 3.0])
        params = jnp.array([[0.3, -0.5, 1.2, 0.1], [-2.0, 0.4, 0.0, 3.0]], jnp.float32)
        dist = squashed_beta(params, low, high)
        z = jnp.array([[0.7, -1.5], [3.0, 0.2]])
        log_prob, entropy = dist.log_prob_from_pre_image(z), dist.entropy()
        a, b = np.asarray(dist.concentration1), np.asarray(dist.concentration0)
        # Python numbers are weakly typed: the float32 parameters' dtype, the width taken
        # in the numbers' own float64.
        weak = squashed_beta(params[:, :2], 1.0, 1.0 + 1e-9)
        weak_log_prob = weak.log_prob_from_pre_image(z[:, :1].astype(jnp.float32))
        weak_variance = weak.variance()
    assert a.dtype == log_prob.dtype == entropy.dtype == np.float64
    raw = np.asarray(params, np.float64)
    np.testing.assert_allclose(a, 1.0 + np.logaddexp(0.0, raw[:, :2]), rtol=2e-7)
    width = high - low
    u = special.expit(np.asarray(z))
    expected = np.sum(stats.beta.logpdf(u, a, b) - np.log(width), axis=-1)
    np.testing.assert_allclose(log_prob, expected, rtol=1e-12)
    np.testing.assert_allclose(
        entropy, np.sum(stats.beta.entropy(a, b) + np.log(width), axis=-1), rtol=1e-12
    )
    assert weak_log_prob.dtype == jnp.float32
    a, b = (np.asarray(v, np.float64)[:, 0] for v in (weak.concentration1, weak.concentration0))
    u = special.expit(np.asarray(z[:, 0].astype(jnp.float32), np.float64))
    expected = stats.beta.logpdf(u, a, b) - np.log(width[0])
    np.testing.assert_allclose(weak_log_prob, expected, rtol=1e-6)
    # The variance too: rounded to float32 first, the width would be 0.
    np.testing.assert_allclose(weak_variance[:, 0], width[0] ** 2 * stats.beta.var(a, b), rtol=1e-6)


def test_squashed_beta_is_min_concentration_plus_softplus():
    params = np.array([[-30.0, 0.0, 4.0, 50.0], [1.0, -2.0, 0.5, -50.0]])
    dist = squashed_beta(params, 0.0, 2.0)
    np.testing.assert_allclose(dist.concentration1, 1.0 + np.logaddexp(0, params[:, :2]), rtol=1e-6)
    np.testing.assert_allclose(dist.concentration0, 1.0 + np.logaddexp(0, params[:, 2:]), rtol=1e-6)
    assert np.all(np.asarray(dist.concentration1) >= 1.0)
    free = squashed_beta(params, min_concentration=0.0)
    np.testing.assert_allclose(free.concentration1, np.logaddexp(0, params[:, :2]), rtol=1e-6)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: squashed_beta(jnp.zeros((2, 3))), ValueError, "even, positive last axis"),
        (
            lambda: squashed_beta(jnp.zeros(4), min_concentration=-1.0),
            ValueError,
            "min_concentration must be >= 0",
        ),
        (
            lambda: squashed_beta(jnp.zeros(4, jnp.int32)),
            TypeError,
            "params must have a floating dtype",
        ),
        (lambda: SquashedBeta(jnp.ones(2), jnp.ones(3)), ValueError, "the same shape"),
        (lambda: SquashedBeta(jnp.ones(()), jnp.ones(())), ValueError, r"\[\*batch, action\]"),
        (
            lambda: SquashedBeta(jnp.ones(2), jnp.ones(2), jnp.zeros(3), jnp.ones(3)),
            ValueError,
            r"shape \(\) or \(action,\)",
        ),
        (
            lambda: SquashedBeta(jnp.ones(2), jnp.ones(2), 1.0, 1.0),
            ValueError,
            "low must be < high",
        ),
        (
            lambda: SquashedBeta(jnp.ones(2), jnp.ones(2)).log_prob(jnp.zeros(3)),
            ValueError,
            "must broadcast",
        ),
        (
            lambda: SquashedBeta(jnp.ones(2), jnp.ones(2)).log_prob(jnp.zeros(2, jnp.int32)),
            TypeError,
            "floating dtype",
        ),
        (
            lambda: SquashedBeta(jnp.ones(2), jnp.ones(2)).log_prob_from_pre_image(jnp.zeros(3)),
            ValueError,
            "must broadcast",
        ),
        (lambda: LogitBeta(jnp.ones(2), jnp.ones(3)), ValueError, "must broadcast"),
        (lambda: LogitBeta(jnp.array([True]), 1.0), TypeError, "must be real numbers"),
    ],
)
def test_bad_arguments_are_refused_with_the_fix(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_the_sigmoid_onto_the_bounds_is_a_declared_squashing():
    unit = SquashedBeta(jnp.ones(2), jnp.ones(2))
    assert isinstance(unit.bijector.bijector, samplers.Sigmoid)
    low, high = np.array([-2.0, 0.5]), np.array([1.0, 3.0])
    with jax.enable_x64(True):
        bijector = SquashedBeta(jnp.ones(2), jnp.ones(2), low, high).bijector.bijector
        bounds = samplers.distributions.bijectors.squashing(bijector)
        assert bounds.pre_image_scale == 2.0
        x = jnp.array([[-3.0, 0.3], [2.0, 5.0], [-200.0, 200.0]])
        y, log_det = bijector.forward_and_log_det(x)
        inverse, inverse_log_det = bijector.inverse_and_log_det(y[:2])
        jacobians = jax.vmap(jax.jacfwd(bijector.forward))(x[:2])
    width = np.array([3.0, 2.5])
    np.testing.assert_allclose(y, np.array([-2.0, 0.5]) + width * special.expit(x), rtol=1e-15)
    expected = np.log(width) + special.log_expit(x) + special.log_expit(-x)
    np.testing.assert_allclose(log_det, expected, rtol=1e-15)  # finite at |x| = 200
    np.testing.assert_allclose(
        log_det[:2], np.log(np.diagonal(jacobians, axis1=1, axis2=2)), rtol=1e-9
    )
    np.testing.assert_allclose(inverse, x[:2], rtol=1e-9)
    np.testing.assert_allclose(inverse_log_det, -log_det[:2], rtol=1e-9)
    same = SquashedBeta(jnp.ones(2), jnp.ones(2), low, high).bijector.bijector
    assert bijector.same_as(same) and not bijector.same_as(samplers.BoundedTanh(low, high))


def test_a_squashed_normal_sample_onto_the_same_bounds_is_scored_from_its_pre_image():
    # The pre-image of a sigmoid onto [0, 1] is the logit for both distributions: a
    # sample remembered by one is scored at that pre-image by the other.
    normal = samplers.SquashedNormal(jnp.full(2, 30.0), jnp.ones(2), samplers.Sigmoid())
    action = normal.sample(seed=jax.random.key(0))  # rounds onto 1
    assert np.all(np.asarray(action) == 1.0)
    beta = SquashedBeta(jnp.full(2, 2.0), jnp.full(2, 0.5))
    pre_image = normal.distribution.sample(seed=jax.random.key(0))
    np.testing.assert_array_equal(beta.log_prob(action), beta.log_prob_from_pre_image(pre_image))


def test_distrax_beta_agrees_inside_the_range():
    with jax.enable_x64(True):
        a, b = jnp.array([0.3, 2.0, 7.5]), jnp.array([4.0, 2.0, 0.6])
        low, high = jnp.array([-1.0, 0.0, 2.0]), jnp.array([1.0, 1.0, 10.0])
        u = jnp.array([[0.01, 0.5, 0.9], [0.7, 0.2, 0.999]])
        ours = SquashedBeta(a, b, low, high)
        theirs = distrax.Independent(distrax.Beta(a, b), 1)
        action = low[None] + (high - low)[None] * u
        # distrax's Beta.log_prob broadcasts its parameters implicitly: one row at a time.
        expected = jnp.stack([theirs.log_prob(row) for row in u]) - jnp.sum(jnp.log(high - low))
        np.testing.assert_allclose(ours.log_prob(action), expected, rtol=1e-12)
        np.testing.assert_allclose(
            ours.entropy(), theirs.entropy() + jnp.sum(jnp.log(high - low)), rtol=1e-12
        )
        np.testing.assert_allclose(
            ours.mean(), low + (high - low) * distrax.Beta(a, b).mean(), rtol=1e-14
        )
        np.testing.assert_allclose(
            ours.variance(), (high - low) ** 2 * distrax.Beta(a, b).variance(), rtol=1e-14
        )
