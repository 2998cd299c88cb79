"""The Beta's numerics: log-density, entropy, KL, the logit's sampler and its CDF.

The log-density, entropy and KL of a Beta are differences of terms that
grow like a * log(a) (a log x, log B(a, b), a digamma(a)) and nearly cancel for large
concentrations: in float32, log B(1e4, 1e4) alone is 2e-3 off. They are
written here in Loader's saddle-point form instead: with n = a + b,
  log B(a, b) = a log(a / n) + b log(b / n) + log(2 pi n / (a b)) / 2
                + delta(a) + delta(b) - delta(n),
delta(t) = lgamma(t) - (t - 1/2) log t + t - log(2 pi) / 2 (Stirling's remainder,
~ 1 / (12 t)), and the parts that cancel become bd0(k, m) = k log(k / m) + m - k,
computed by a series where k and m are close. Their error is then that of rounding
the inputs (tests/distributions/test_beta.py checks it against mpmath).
"""

import functools
from collections.abc import Callable
from fractions import Fraction
from typing import cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy import special
from jaxtyping import Array

from samplers._numerics import HALF_LOG_2PI, softplus

# B_2, B_4, ..., B_20: Stirling's series for delta and its derivative.
_BERNOULLI = (
    Fraction(1, 6),
    Fraction(-1, 30),
    Fraction(1, 42),
    Fraction(-1, 30),
    Fraction(5, 66),
    Fraction(-691, 2730),
    Fraction(7, 6),
    Fraction(-3617, 510),
    Fraction(43867, 798),
    Fraction(-174611, 330),
)
# delta(t) = sum B_2k / (2k (2k - 1) t**(2k - 1)); delta'(t) = -sum B_2k / (2k t**2k).
_DELTA = tuple(float(b / (2 * k * (2 * k - 1))) for k, b in enumerate(_BERNOULLI, 1))
_DELTA_PRIME = tuple(float(-b / (2 * k)) for k, b in enumerate(_BERNOULLI, 1))
# delta''(t) = sum B_2k / t**(2k + 1).
_DELTA_SECOND = tuple(float(b) for b in _BERNOULLI)
# Where the series is summed: below it, delta and its derivatives are carried up to
# t + m at or above it by their recurrence. Its first omitted term is below 1e-17 at
# t = 8 and 3e-11 at t = 4, under the rounding of the dtype.
_SERIES_FROM = {64: 8.0, 32: 4.0}
# bd0's series in v = (k - m) / (k + m) for |v| < 0.1: 8 terms leave under 0.1**18.
_BD0_CLOSE = 0.1
_BD0_TERMS = 8


def _shifts(t):
    """``(s, terms)``: ``s = t + m``, with ``m`` the least whole number that puts it at or
    above the series' threshold (0 for ``t`` at or above it, where ``s`` is ``t``), and
    ``(k < m, t + k)`` for each ``k`` that may be below ``m``."""
    threshold = _SERIES_FROM.get(jnp.finfo(t.dtype).bits, 4.0)
    m = jnp.maximum(jnp.ceil(threshold - t), 0.0)
    return t + m, [(k < m, t + k) for k in range(int(threshold))]


def _horner(coefficients, x):
    value = jnp.zeros_like(x)
    for c in reversed(coefficients):
        value = value * x + c
    return value


def _delta(t):
    """Stirling's remainder ``lgamma(t) - (t - 1/2) log t + t - log(2 pi) / 2``.

    The series at ``s``, plus ``delta(u) - delta(u + 1) = (u + 1/2) log(1 + 1/u) - 1``
    for ``u = t, ..., s - 1`` (from ``lgamma(u + 1) = lgamma(u) + log u``), each a term
    of size at most 1 that nothing larger cancels.
    """
    s, terms = _shifts(t)
    inverse = 1.0 / s
    steps = [jnp.where(on, (u + 0.5) * jnp.log1p(1.0 / u) - 1.0, 0.0) for on, u in terms]
    return inverse * _horner(_DELTA, inverse * inverse) + sum(steps)


def _delta_prime(t):
    """``delta'(t) = digamma(t) - log t + 1 / (2 t)``: the series at ``s``, plus
    ``delta'(u) - delta'(u + 1) = log(1 + 1/u) - 1 / (2 u) - 1 / (2 (u + 1))``."""
    s, terms = _shifts(t)
    inverse_square = 1.0 / (s * s)
    steps = [jnp.where(on, jnp.log1p(1.0 / u) - 0.5 / u - 0.5 / (u + 1.0), 0.0) for on, u in terms]
    return inverse_square * _horner(_DELTA_PRIME, inverse_square) + sum(steps)


def _delta_second(t):
    """``delta''(t) = trigamma(t) - 1 / t - 1 / (2 t**2)``: the series at ``s``, plus
    ``delta''(u) - delta''(u + 1) = 1 / (2 u**2) + 1 / (2 (u + 1)**2) - 1 / (u (u + 1))``."""
    s, terms = _shifts(t)
    inverse = 1.0 / s
    inverse_square = inverse * inverse
    steps = [
        jnp.where(on, 0.5 / (u * u) + 0.5 / ((u + 1.0) * (u + 1.0)) - 1.0 / (u * (u + 1.0)), 0.0)
        for on, u in terms
    ]
    return inverse * inverse_square * _horner(_DELTA_SECOND, inverse_square) + sum(steps)


def _bd0(k, k_plus_m, difference, log_ratio):
    """``k log(k / m) + m - k`` and ``log(k / m)``, from ``k``, ``k + m``, ``k - m`` and
    ``log(k / m)`` (the last used where ``k`` and ``m`` are far apart).

    Where ``|k - m| < 0.1 (k + m)``, Loader's series in ``v = (k - m) / (k + m)``,
    ``(k - m) v + 2 k (v**3 / 3 + v**5 / 5 + ...)``, and ``log(k / m) = 2 atanh(v)``,
    which keep the relative accuracy of ``k - m``; elsewhere the definitions, where
    nothing cancels badly.
    """
    v = difference / k_plus_m
    close = jnp.abs(v) < _BD0_CLOSE
    v = jnp.where(close, v, 0.0)
    square = v * v
    series = difference * v + 2.0 * k * v * square * _horner(
        tuple(1.0 / (2 * j + 3) for j in range(_BD0_TERMS)), square
    )
    bd0 = jnp.where(close, series, k * log_ratio - difference)
    return bd0, jnp.where(close, 2.0 * jnp.arctanh(v), log_ratio)


def _log_density_terms(a, b, z):
    """``log p(z)`` and the pieces its derivatives are made of.

    ``a log x + b log y - log B(a, b)`` with ``x = sigmoid(z)``, ``y = sigmoid(-z)``,
    in Loader's form: ``-bd0(a, n x) - bd0(b, n y) + log(a b / (2 pi n)) / 2 +
    delta(n) - delta(a) - delta(b)``, with ``a - n x = n (a / n - x)`` taken from
    whichever of ``x`` and ``y`` is small.

    Returns:
        ``(log p, log(a / (n x)), log(b / (n y)), a - n x)``.
    """
    n = a + b
    p, q = a / n, b / n
    x, y = jax.nn.sigmoid(z), jax.nn.sigmoid(-z)
    difference = n * jnp.where(p <= q, p - x, y - q)  # a - n x = -(b - n y)
    log_p, log_q = jnp.log(p), jnp.log(q)
    bd0_a, ratio_a = _bd0(a, a + n * x, difference, log_p + softplus(-z))
    bd0_b, ratio_b = _bd0(b, b + n * y, -difference, log_q + softplus(z))
    log_scale = 0.5 * (log_p + log_q + jnp.log(n)) - HALF_LOG_2PI
    value = log_scale - bd0_a - bd0_b + _delta(n) - _delta(a) - _delta(b)
    return value, ratio_a, ratio_b, difference


def _log_density_and_slopes(a, b, z):
    """``log p(z)`` and its derivatives in ``a``, ``b`` and ``z``, in the same form:
    ``d/dz = a - n x``, ``d/da = log x - digamma(a) + digamma(n) = -log(a / (n x)) +
    b / (2 a n) + delta'(n) - delta'(a)``, and likewise for ``b``."""
    value, ratio_a, ratio_b, difference = _log_density_terms(a, b, z)
    n = a + b
    delta_prime_n = _delta_prime(n)
    d_a = -ratio_a + 0.5 * (b / n) / a + delta_prime_n - _delta_prime(a)
    d_b = -ratio_b + 0.5 * (a / n) / b + delta_prime_n - _delta_prime(b)
    return value, d_a, d_b, difference


@jax.custom_jvp
def _log_density_kernel(a, b, z):
    return _log_density_terms(a, b, z)[0]


@_log_density_kernel.defjvp
def _log_density_jvp(primals, tangents):
    value, d_a, d_b, d_z = _log_density_and_slopes(*primals)
    a_dot, b_dot, z_dot = tangents
    return value, d_a * a_dot + d_b * b_dot + d_z * z_dot


@jax.jit
def log_density(a, b, z):
    """``log p(z)`` of ``z = logit(X)``, ``X ~ Beta(a, b)``, elementwise, all of one shape
    (see :func:`_log_density_terms`)."""
    return _log_density_kernel(a, b, z)


def _stirling_excess(t):
    """``delta(t) - t delta'(t)``: ``lgamma(t) - t digamma(t) + t`` less its large terms."""
    return _delta(t) - t * _delta_prime(t)


@jax.jit
def logit_entropy(a, b):
    """``H[logit X] = log B(a, b) - a digamma(a) - b digamma(b) + n digamma(n)``."""
    n = a + b
    log_ratio = jnp.log(n) - jnp.log(a) - jnp.log(b)
    excess = _stirling_excess(a) + _stirling_excess(b) - _stirling_excess(n)
    return 0.5 + HALF_LOG_2PI + 0.5 * log_ratio + excess


@jax.jit
def _mean_log_odds_terms(a, b):
    """``E[log X + log(1 - X)] = digamma(a) + digamma(b) - 2 digamma(n)``."""
    n = a + b
    inverse_terms = 0.5 / a + 0.5 / b - 1.0 / n
    deltas = _delta_prime(a) + _delta_prime(b) - 2.0 * _delta_prime(n)
    return jnp.log(a / n) + jnp.log(b / n) - inverse_terms + deltas


@jax.custom_jvp
def beta_entropy(a, b):
    """``H[Beta(a, b)] = H[logit X] + E[log X + log(1 - X)]``, elementwise."""
    return logit_entropy(a, b) + _mean_log_odds_terms(a, b)


@beta_entropy.defjvp
def _beta_entropy_jvp(primals, tangents):
    """``dH/da = (n - 2) trigamma(n) - (a - 1) trigamma(a)``, written with ``delta''`` so
    that no terms of size 1 cancel: ``(a + 1) / (2 a**2) - (3 n + 2) / (2 n**2) -
    (a - 1) delta''(a) + (n - 2) delta''(n)``; likewise for ``b``."""
    a, b = primals
    a_dot, b_dot = tangents
    n = a + b
    shared = (n - 2.0) * _delta_second(n) - (3.0 * n + 2.0) / (2.0 * n * n)
    d_a = (a + 1.0) / (2.0 * a * a) - (a - 1.0) * _delta_second(a) + shared
    d_b = (b + 1.0) / (2.0 * b * b) - (b - 1.0) * _delta_second(b) + shared
    return beta_entropy(a, b), d_a * a_dot + d_b * b_dot


def _close(x, y, h):
    """Where ``y = x + h`` is within half of the smaller of ``x`` and ``y`` of ``x``: there
    ``h`` is used, which the caller holds exactly (``y`` itself may be rounded)."""
    return jnp.abs(h) <= 0.5 * jnp.minimum(x, y)


def _log_ratio(x, y, h):
    """``log(y / x)`` for ``y = x + h``: ``log1p(h / x)`` where they are close, else the
    difference of the logarithms (``log1p(h / x)`` loses ``y`` where it is below the
    rounding of ``x``, as ``1e-3`` is beside ``1e5`` in float32)."""
    close = _close(x, y, h)
    return jnp.where(close, jnp.log1p(jnp.where(close, h, 0.0) / x), jnp.log(y) - jnp.log(x))


def _horner_slope(coefficients, p, q):
    """``P(p)`` and ``(P(p) - P(q)) / (p - q)`` for the polynomial ``P`` of ``coefficients``
    (lowest first): Horner's scheme with its divided difference carried alongside."""
    value, slope = jnp.zeros_like(p), jnp.zeros_like(p)
    for c in reversed(coefficients):
        slope = slope * q + value
        value = value * p + c
    return value, slope


def _delta_differences(x, y, h):
    """``delta(y) - delta(x)`` and the same for ``delta'`` and ``delta''``, ``y = x + h``.

    Where ``x`` and ``y`` are close, from ``h`` itself: both are carried up by the same
    ``m`` steps to ``x + m`` and ``y + m``, and each step's difference and the series'
    are written as ``h`` times a quotient (the series are ``r`` or 1 times polynomials
    in ``r**2``, ``r = 1 / (t + m)``, differenced by :func:`_horner_slope`), so that
    the rounding of ``y`` costs nothing and a small difference keeps its relative
    accuracy. Elsewhere the differences of the values, which do not cancel badly there.
    """
    close = _close(x, y, h)
    h = jnp.where(close, h, 0.0)
    threshold = _SERIES_FROM.get(jnp.finfo(x.dtype).bits, 4.0)
    m = jnp.maximum(jnp.ceil(threshold - jnp.minimum(x, y)), 0.0)
    r_x, r_y = 1.0 / (x + m), 1.0 / (y + m)
    d_r = -h * r_x * r_y  # r_y - r_x
    d_square = d_r * (r_x + r_y)  # r_y**2 - r_x**2
    p, q = r_y * r_y, r_x * r_x
    # delta = r P(r**2), delta' = Q(r**2), delta'' = r R(r**2).
    series, series_slope = _horner_slope(_DELTA, p, q)
    _, prime_slope = _horner_slope((0.0, *_DELTA_PRIME), p, q)
    second, second_slope = _horner_slope((0.0, *_DELTA_SECOND), p, q)
    d_delta = d_r * series + r_x * d_square * series_slope
    d_prime = d_square * prime_slope
    d_second = d_r * second + r_x * d_square * second_slope
    for k in range(int(threshold)):
        on = k < m
        u_x, u_y = x + k, y + k
        # The steps of _delta, _delta_prime and _delta_second at u_y less those at u_x.
        log_step = jnp.log1p(-h / (u_y * (u_x + 1.0)))  # log1p(1/u_y) - log1p(1/u_x)
        step = h * jnp.log1p(1.0 / u_y) + (u_x + 0.5) * log_step
        step_prime = log_step + 0.5 * h / (u_x * u_y) + 0.5 * h / ((u_x + 1.0) * (u_y + 1.0))
        w_x, w_y = u_x * (u_x + 1.0), u_y * (u_y + 1.0)  # delta'' steps 1 / (2 w**2)
        step_second = -0.5 * h * (u_x + u_y + 1.0) * (w_x + w_y) / jnp.square(w_x * w_y)
        d_delta = d_delta + jnp.where(on, step, 0.0)
        d_prime = d_prime + jnp.where(on, step_prime, 0.0)
        d_second = d_second + jnp.where(on, step_second, 0.0)
    points = jnp.stack([y, x])
    far = [f[0] - f[1] for f in (_delta(points), _delta_prime(points), _delta_second(points))]
    return tuple(
        jnp.where(close, near, away)
        for near, away in zip((d_delta, d_prime, d_second), far, strict=True)
    )


def _polygamma_differences(x, y, h):
    """``digamma(y) - digamma(x)`` and ``trigamma(y) - trigamma(x)`` for ``y = x + h``:
    ``log(y / x) + h / (2 x y) + delta'(y) - delta'(x)`` and ``-h / (x y) - h (x + y) /
    (2 (x y)**2) + delta''(y) - delta''(x)``."""
    _, d_prime, d_second = _delta_differences(x, y, h)
    h = jnp.where(_close(x, y, h), h, y - x)
    inverse = 1.0 / x / y
    digamma = _log_ratio(x, y, h) + 0.5 * h * inverse + d_prime
    trigamma = -h * inverse - 0.5 * h * (x + y) * inverse * inverse + d_second
    return digamma, trigamma


def _trigamma(t):
    """``trigamma(t) = 1 / t + 1 / (2 t**2) + delta''(t)``, every term positive for ``t > 0``."""
    return 1.0 / t + 0.5 / (t * t) + _delta_second(t)


def _kl_value(a1, b1, a2, b2):
    """``KL(Beta(a1, b1) || Beta(a2, b2))`` in Loader's form (see :func:`kl`)."""
    n1, n2 = a1 + b1, a2 + b2
    difference = (a2 * b1 - a1 * b2) / n1  # a2 - n2 a1 / n1 = -(b2 - n2 b1 / n1)
    # log(a2 / m) from the quotient, not from four logarithms of size log(a).
    m_a, m_b = n2 * (a1 / n1), n2 * (b1 / n1)
    bd0_a = _bd0(a2, a2 + m_a, difference, jnp.log(a2 / m_a))[0]
    bd0_b = _bd0(b2, b2 + m_b, -difference, jnp.log(b2 / m_b))[0]
    da, db = a1 - a2, b1 - b2
    log_scales = 0.5 * (
        _log_ratio(a2, a1, da) + _log_ratio(b2, b1, db) - _log_ratio(n2, n1, da + db)
    )
    inverse_terms = -da * b1 / (2.0 * a1 * n1) - db * a1 / (2.0 * b1 * n1)
    # Each difference from its exact step (n1 is rounded: n1 - a1 is b1), in one call.
    deltas, slopes, _ = _delta_differences(
        jnp.stack([a1, b1, n1, a1, b1]),
        jnp.stack([a2, b2, n2, n1, n1]),
        jnp.stack([-da, -db, -(da + db), b1, a1]),
    )
    value = (
        bd0_a
        + bd0_b
        + log_scales
        + inverse_terms
        - (da * slopes[3] + db * slopes[4])  # da (delta'(a1) - delta'(n1)) + ...
        + (deltas[0] + deltas[1] - deltas[2])
    )
    return jnp.where((a1 == a2) & (b1 == b2), 0.0, value)


@jax.custom_jvp
@jax.jit
def kl(a1, b1, a2, b2):
    """``KL(Beta(a1, b1) || Beta(a2, b2))`` elementwise, all of one shape, in Loader's form.

    ``(a1 - a2)(digamma(a1) - digamma(n1)) + (b1 - b2)(digamma(b1) - digamma(n1)) +
    log B(a2, b2) - log B(a1, b1)``, rewritten so that nothing of size ``a log a``
    cancels; exactly 0 where the parameters are equal. The derivatives are the
    closed forms ``dKL/da1 = (a1 - a2) trigamma(a1) - (n1 - n2) trigamma(n1)`` and
    ``dKL/da2 = digamma(a2) - digamma(a1) - digamma(n2) + digamma(n1)`` (likewise
    for ``b``), with each difference of polygammas at nearby points computed from
    the difference of the points: exactly 0 with respect to ``a1`` and ``b1`` at equal
    parameters, and differentiable again (the Hessian there is the Fisher
    information).
    """
    return _kl_value(a1, b1, a2, b2)


@kl.defjvp
def _kl_jvp(primals, tangents):
    a1, b1, a2, b2 = primals
    n1, n2 = a1 + b1, a2 + b2
    da, db = a1 - a2, b1 - b2
    # Each difference from its exact step (n1 - a1 is b1, n2 - n1 is -(da + db)), in
    # one call: digamma(y) - digamma(x) and trigamma(y) - trigamma(x) for
    # (x, y) = (a1, n1), (b1, n1), (a2, n2), (b2, n2), (n1, n2), (a1, a2), (b1, b2).
    digamma, trigamma = _polygamma_differences(
        jnp.stack([a1, b1, a2, b2, n1, a1, b1]),
        jnp.stack([n1, n1, n2, n2, n2, a2, b2]),
        jnp.stack([b1, a1, b2, a2, -(da + db), -da, -db]),
    )
    trigamma_n = _trigamma(n1)
    slopes = (
        # (a1 - a2) trigamma(a1) - (n1 - n2) trigamma(n1), with n1 - n2 = da + db.
        -da * trigamma[0] - db * trigamma_n,
        -db * trigamma[1] - da * trigamma_n,
        _digamma_slope(digamma[5], digamma[4], digamma[0], digamma[2]),
        _digamma_slope(digamma[6], digamma[4], digamma[1], digamma[3]),
    )
    return kl(*primals), sum(s * t for s, t in zip(slopes, tangents, strict=True))


def _digamma_slope(across_a, across_n, within_1, within_2):
    """``dKL/da2 = digamma(a2) - digamma(a1) - digamma(n2) + digamma(n1)``, summed in the
    grouping whose two differences are the smaller (their rounding is the error):
    across the distributions, ``(digamma(a2) - digamma(a1)) - (digamma(n2) -
    digamma(n1))``, or within each, ``(digamma(n1) - digamma(a1)) - (digamma(n2) -
    digamma(a2))``."""
    across = jnp.abs(across_a) + jnp.abs(across_n)
    within = jnp.abs(within_1) + jnp.abs(within_2)
    return jnp.where(across <= within, across_a - across_n, within_1 - within_2)


# The pathwise derivative of a Gamma sample, d log G / d a = -(dP(a, x)/da) / (x p(x; a))
# (implicit reparameterisation). jax.random.loggamma's own derivative evaluates it at
# exp(log G), which underflows for small concentrations (log G ~ -188 at a = 0.01) and
# is then taken at the smallest normal float instead. Below x = 1 it is computed here
# from P(a, x) = x**a / Gamma(a) * sum_k (-x)**k / (k! (a + k)) in log space:
#   d log G / d a = -exp(x) ((log x - digamma(a + 1)) S + T / a),
#   S = sum_k (-x)**k / (k! (a + k)),  T = sum_{k >= 1} (-x)**k / ((k - 1)! (a + k)**2),
# (20 terms leave under 1 / 20! for x < 1); above, jax.lax.random_gamma_grad / x.
_GAMMA_SERIES_TERMS = 20


def _log_gamma_slope(a, log_x):
    """``d log G / d a`` of a ``Gamma(a)`` sample ``G = exp(log_x)``, elementwise."""
    small = log_x < 0
    x = jnp.exp(jnp.where(small, log_x, 0.0))
    term = jnp.ones_like(x)
    s, t = 1.0 / a, jnp.zeros_like(x)
    for k in range(1, _GAMMA_SERIES_TERMS):
        term = term * (-x) / k
        s = s + term / (a + k)
        t = t + term * k / jnp.square(a + k)
    small_slope = -jnp.exp(x) * ((log_x - special.digamma(a + 1.0)) * s + t / a)
    x_large = jnp.exp(jnp.where(small, 0.0, log_x))
    # Its dtype argument is filled in by a decorator that type checkers do not see.
    gamma_grad = cast(Callable[[Array, Array], Array], jax.lax.random_gamma_grad)
    large_slope = gamma_grad(a, x_large) / x_large
    return jnp.where(small, small_slope, large_slope)


@jax.custom_jvp
def _reparameterized(a, log_sample):
    """``log_sample``, differentiable in ``a`` as a ``Gamma(a)`` sample's log is."""
    return log_sample


@_reparameterized.defjvp
def _reparameterized_jvp(primals, tangents):
    a, log_sample = primals
    a_dot, log_sample_dot = tangents
    return log_sample, a_dot * _log_gamma_slope(a, log_sample) + log_sample_dot


@functools.partial(jax.jit, static_argnums=3)
def logit_beta_sample(key, a, b, shape):
    """``log G_a - log G_b`` of ``shape``, from the two halves of ``key`` as
    ``jax.random.beta`` splits it; ``a`` and ``b`` broadcast to ``shape``."""
    key_a, key_b = jax.random.split(key)
    a, b = jnp.broadcast_to(a, shape), jnp.broadcast_to(b, shape)
    log_a = jax.random.loggamma(key_a, jax.lax.stop_gradient(a), shape, a.dtype)
    log_b = jax.random.loggamma(key_b, jax.lax.stop_gradient(b), shape, b.dtype)
    return _reparameterized(a, log_a) - _reparameterized(b, log_b)


# The regularised incomplete beta I_x(a, b) in log space, for the CDF and for the atoms
# on the bounds, where x is as small as the smallest normal float and I_x underflows.
# Below x = (a + 1) / (n + 2), log I_x = log p(logit x) - log a + log F, F the
# continued fraction of DLMF 8.17.22 evaluated by the modified Lentz method (Numerical
# Recipes' betacf), which converges there within O(sqrt(max(a, b))) steps; above it,
# log(1 - I_{1-x}(b, a)). The derivatives in a and b are carried through the same
# steps in forward mode, and the loop runs until they have converged too; that in z
# is p(z) / I in closed form. An element still unconverged after _MAX_STEPS is NaN.
_MAX_STEPS = 5000


def _guard(value):
    """``value``, moved away from 0 as the modified Lentz method does."""
    tiny = 16 * jnp.finfo(value.dtype).tiny
    return jnp.where(jnp.abs(value) < tiny, tiny, value)


def _lentz(numerator, slopes, c, d, tangents):
    """One Lentz step ``d = 1 / (1 + t d)``, ``c = 1 + t / c`` for the partial numerator
    ``t``, with the tangents ``(dc, dd)`` of each direction given ``t``'s slopes."""
    new_d = 1.0 / _guard(1.0 + numerator * d)
    new_c = _guard(1.0 + numerator / c)
    tangents = tuple(
        (slope / c - numerator * dc / (c * c), -new_d * new_d * (slope * d + numerator * dd))
        for slope, (dc, dd) in zip(slopes, tangents, strict=True)
    )
    return new_c, new_d, tangents


def _log_fraction(a, b, x, *, slopes: bool):
    """``log F(a, b, x)``, with (if ``slopes``) its derivatives in ``a`` and ``b``."""
    eps = jnp.finfo(x.dtype).eps
    n = a + b
    start = 1.0 - n * x / (a + 1.0)
    d = 1.0 / _guard(start)
    # d(start)/da = x (b - 1) / (a + 1)**2 and d(start)/db = -x / (a + 1).
    start_slopes = (x * (b - 1.0) / jnp.square(a + 1.0), -x / (a + 1.0))
    zeros = jnp.zeros_like(x)
    tangents = tuple((zeros, -d * d * t) for t in start_slopes) if slopes else ()
    log_slopes = tuple(dd / d for _, dd in tangents)

    def body(state):
        m, c, d, log_f, tangents, log_slopes, done = state
        m = m.astype(x.dtype)
        even_base = a - 1.0 + 2.0 * m
        even = m * (b - m) * x / (even_base * (a + 2.0 * m))
        even_slopes = (
            -even * (1.0 / even_base + 1.0 / (a + 2.0 * m)),
            m * x / (even_base * (a + 2.0 * m)),
        )
        odd = -(a + m) * (n + m) * x / ((a + 2.0 * m) * (a + 1.0 + 2.0 * m))
        odd_slopes = (
            odd * (1.0 / (a + m) + 1.0 / (n + m) - 1.0 / (a + 2.0 * m) - 1.0 / (a + 1.0 + 2.0 * m)),
            odd / (n + m),
        )
        c1, d1, tangents = _lentz(even, even_slopes[: len(tangents)], c, d, tangents)
        c2, d2, tangents2 = _lentz(odd, odd_slopes[: len(tangents)], c1, d1, tangents)
        log_factor = jnp.log(d1 * c1 * d2 * c2)
        factor_slopes = tuple(
            dd1 / d1 + dc1 / c1 + dd2 / d2 + dc2 / c2
            for (dc1, dd1), (dc2, dd2) in zip(tangents, tangents2, strict=True)
        )
        new_slopes = tuple(s + f for s, f in zip(log_slopes, factor_slopes, strict=True))
        # An element is done once a step changes neither log F nor its slopes (relative
        # to their size) by more than eps; it is then held, while the others go on.
        converged = jnp.abs(log_factor) <= eps
        for step, total in zip(factor_slopes, new_slopes, strict=True):
            converged &= jnp.abs(step) <= eps * (1.0 + jnp.abs(total))
        new = (c2, d2, log_f + log_factor, tangents2, new_slopes)
        old = (c, d, log_f, tangents, log_slopes)
        kept = jax.tree.map(lambda o, n: jnp.where(done, o, n), old, new)
        # A NaN element is done: it is NaN whatever it does, and must not hold the loop.
        done = done | converged | jnp.isnan(log_factor)
        return (m.astype(jnp.int32) + 1, *kept, done)

    def unfinished(state):
        return (state[0] <= _MAX_STEPS) & ~jnp.all(state[-1])

    done = jnp.zeros(x.shape, bool)
    state = (jnp.int32(1), jnp.ones_like(x), d, jnp.log(d), tangents, log_slopes, done)
    state = jax.lax.while_loop(unfinished, body, state)
    done = state[-1]
    return tuple(jnp.where(done, v, jnp.nan) for v in (state[3], *state[5]))


def _log_betainc_setup(a, b, z):
    """Which tail, its ``x``, and the continued fraction's two arguments."""
    lower = z < jnp.log((a + 1.0) / (b + 1.0))  # x < (a + 1) / (n + 2)
    x = jnp.where(lower, jax.nn.sigmoid(z), jax.nn.sigmoid(-z))
    return lower, x, jnp.where(lower, a, b), jnp.where(lower, b, a)


def _log_tail_complement(lower, tail):
    """``tail`` below, ``log(1 - exp(tail))`` above (by ``log1p`` where ``exp(tail)`` is
    small, so that an upper tail of 1e-6 keeps its digits in ``1 - I``)."""
    small = tail < -np.log(2.0)
    complement = jnp.where(
        small,
        jnp.log1p(-jnp.exp(jnp.where(small, tail, -1.0))),
        jnp.log(-jnp.expm1(jnp.where(small, -1.0, tail))),
    )
    return jnp.where(lower, tail, complement)


@jax.custom_jvp
def log_betainc(a, b, z):
    """``log I_x(a, b)`` for ``x = sigmoid(z)``, elementwise, all of one shape."""
    lower, x, first, second = _log_betainc_setup(a, b, z)
    (log_f,) = _log_fraction(first, second, x, slopes=False)
    return _log_tail_complement(lower, log_density(a, b, z) - jnp.log(first) + log_f)


@log_betainc.defjvp
def _log_betainc_jvp(primals, tangents):
    a, b, z = primals
    a_dot, b_dot, z_dot = tangents
    lower, x, first, second = _log_betainc_setup(a, b, z)
    log_f, d_first, d_second = _log_fraction(first, second, x, slopes=True)
    log_density, density_a, density_b, _ = _log_density_and_slopes(a, b, z)
    # The tail below x, log I_x(a, b), or above it, log I_{1-x}(b, a), and its slopes.
    tail = log_density - jnp.log(first) + log_f
    tail_a = density_a + jnp.where(lower, d_first - 1.0 / a, d_second)
    tail_b = density_b + jnp.where(lower, d_second, d_first - 1.0 / b)
    value = _log_tail_complement(lower, tail)
    scale = jnp.where(lower, 1.0, -jnp.exp(tail - value))
    d_z = jnp.exp(log_density - value)  # dI/dz = p(z)
    return value, scale * (tail_a * a_dot + tail_b * b_dot) + d_z * z_dot


log_betainc_jit = jax.jit(log_betainc)


def valid(a, b):
    return (a > 0) & (a < jnp.inf) & (b > 0) & (b < jnp.inf)


@jax.jit
def nan_where_invalid(a, b):
    """``a`` and ``b``, both NaN wherever either is not positive and finite."""
    ok = valid(a, b)
    return jnp.where(ok, a, jnp.nan), jnp.where(ok, b, jnp.nan)
