"""An arbitrary-precision reference for the squashed Normal, written from the formulas.

A squashed Normal is a diagonal Normal ``X ~ N(loc, scale)`` pushed through
``y = f(x) = c + h * tanh(x / k)`` in each dimension, with ``c = (low + high) / 2``,
``h = (high - low) / 2``, and ``k = 1`` for tanh onto ``[low, high]`` or ``k = 2`` for
the sigmoid onto ``[0, 1]`` (``sigmoid(x) = (1 + tanh(x / 2)) / 2``); so
``log f'(x) = log(h / k) + log sech(x / k)**2``.

Every function takes its inputs exactly as a float32 or float64 computation received
them (``mpmath.mpf(float(v))`` is exact for both) and computes with at least 50
significant digits, so the reference's own rounding is far below any float64 error.
Nothing here imports the library under test.

The functions work on one action dimension (a ``*_term`` is that dimension's part of a
quantity summed or multiplied over the action axis) and are cached, so a value needed
by several tests is computed once per run; :func:`elementwise` applies one to numpy
arrays. Derivatives (``*_gradient``, per element, with respect to the value, ``loc``,
``scale``, ``low`` or ``high``): by ``mpmath.diff`` for the log-densities and the KL,
in closed form for the log-CDF, the quantile and the mode (checked against
``mpmath.diff`` by :func:`derivative`), and as integrals for the moments and the
entropy, which return them with their values.

The action on a bound follows one contract, kept in :func:`bound_offset` and
:func:`_log_prob_on_bound` so that it is easy to change: an action exactly on a bound
is scored as the log-probability of the float rounding atom there.
"""

import functools
import itertools
import math

import mpmath
import numpy as np
from mpmath import mp

DIGITS = 50

# Where an action lies with respect to its dimension's bounds.
INSIDE, UPPER, LOWER, OUTSIDE = "inside", "upper", "lower", "outside"
PARAMETERS = ("value", "loc", "scale", "low", "high")


def _at_full_precision(function):
    """Runs ``function`` with at least ``DIGITS`` digits.

    More if the caller already works with more: ``mpmath.diff`` raises the
    precision to take its differences, and the functions it differentiates must
    keep it.
    """

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        with mp.workdps(max(mp.dps, DIGITS)):
            return function(*args, **kwargs)

    return wrapper


def exact(value) -> mpmath.mpf:
    """A float32 or float64 value (or a Python float) as an mpmath number, exactly."""
    if isinstance(value, mpmath.mpf):
        return value
    with mp.workdps(DIGITS):
        return mp.mpf(float(value))


def elementwise(function, *arrays, **constants) -> np.ndarray:
    """``function`` applied to each element of the broadcast ``arrays``, as float64.

    The elements are passed as Python floats (exactly the stored float32 or float64
    values), so that the cached functions recognise repeated inputs.
    """
    arrays = np.broadcast_arrays(*(np.asarray(a) for a in arrays))
    out = np.empty(arrays[0].shape, np.float64)
    for index in np.ndindex(out.shape):
        out[index] = float(function(*(float(a[index]) for a in arrays), **constants))
    return out


# ---------------------------------------------------------------------------------
# The squashing and the Normal, in closed form.


def _centre_and_half_range(low, high):
    return (low + high) / 2, (high - low) / 2


@_at_full_precision
def forward(x, low, high, k):
    """``f(x) = c + h tanh(x / k)``, as ``low + 2 h / (1 + exp(-2 x / k))`` (or from
    ``high`` for ``x > 0``): the same number, without the cancellation that would
    round an action within ``10**-50`` of a bound onto it."""
    x, low, high = (exact(v) for v in (x, low, high))
    _, half_range = _centre_and_half_range(low, high)
    if x < 0:
        return low + 2 * half_range / (1 + mp.exp(-2 * x / k))
    return high - 2 * half_range / (1 + mp.exp(2 * x / k))


@_at_full_precision
def pre_image(y, low, high, k):
    """``f^-1(y) = k atanh((y - c) / h)`` for ``y`` strictly inside ``(low, high)``, as
    ``k (log(y - low) - log(high - y)) / 2``: the same number, with every digit
    however close ``y`` is to a bound."""
    y, low, high = (exact(v) for v in (y, low, high))
    return k * (mp.log(y - low) - mp.log(high - y)) / 2


@_at_full_precision
def log_abs_derivative(x, low, high, k):
    """``log f'(x) = log(h / k) - 2 log cosh(x / k)``."""
    x, low, high = (exact(v) for v in (x, low, high))
    _, half_range = _centre_and_half_range(low, high)
    return mp.log(half_range / k) - 2 * mp.log(mp.cosh(x / k))


@_at_full_precision
def log_normal(x, loc, scale):
    """``log N(x; loc, scale)``."""
    x, loc, scale = (exact(v) for v in (x, loc, scale))
    return -(((x - loc) / scale) ** 2) / 2 - mp.log(scale) - mp.log(2 * mp.pi) / 2


@_at_full_precision
def log_ndtr(v):
    """``log Phi(v)``, keeping its digits for large positive ``v`` (``-Phi(-v)``), where
    ``Phi(v)`` itself rounds to 1."""
    v = exact(v)
    if v > 0:
        return mp.log1p(-mp.ncdf(-v))
    return mp.log(mp.ncdf(v))


@_at_full_precision
def _log_prob_pre_image(x, loc, scale, low, high, k):
    return log_normal(x, loc, scale) - log_abs_derivative(x, low, high, k)


@functools.cache
def log_prob_pre_image_term(x, loc, scale, low, high, k):
    """``log N(x; loc, scale) - log f'(x)``: one dimension's log-density of ``f(x)``."""
    return _log_prob_pre_image(x, loc, scale, low, high, k)


# ---------------------------------------------------------------------------------
# The log-probability of an action, on the bounds included.


def position(y, low, high) -> str:
    """Where the action ``y`` lies: strictly inside, on a bound, or outside."""
    if y > high or y < low:
        return OUTSIDE
    if y == high:
        return UPPER
    if y == low:
        return LOWER
    return INSIDE


@_at_full_precision
def bound_offset(side, low, high, k, dtype):
    """How far inside a bound an action on it is scored: ``delta``, in action units.

    ``delta = max(spacing, t) / 2``, at least the smallest normal float: ``spacing``
    is the distance from the bound to the adjacent float inside the range (in the
    action's dtype) and ``t = h * epsneg`` for tanh (``k = 1``: the resolution of
    ``tanh`` below 1, ``epsneg = 2**-24`` in float32, ``2**-53`` in float64) or 0 for
    the sigmoid, whose logistic form resolves actions down to the smallest normal
    float. The bounds are the floats of ``dtype`` the library stores.
    """
    float_type = np.dtype(dtype).type
    info = np.finfo(float_type)
    bound, towards = (high, low) if side == UPPER else (low, high)
    bound, towards = float_type(bound), float_type(towards)
    spacing = abs(exact(np.nextafter(bound, towards)) - exact(bound))
    _, half_range = _centre_and_half_range(exact(low), exact(high))
    tanh_step = half_range * exact(info.epsneg) if k == 1 else mp.mpf(0)
    return max(exact(info.tiny), max(spacing, tanh_step) / 2)


@_at_full_precision
def _log_prob_on_bound(side, loc, scale, low, high, k, offset):
    """The log-probability of the float rounding atom at a bound.

    An action on a bound that was not drawn by the distribution stands for every
    action that rounds onto it: the threshold is ``y_r = high - delta`` (or
    ``low + delta``) with pre-image ``x_r``, and the term is
    ``log P(X >= x_r)`` at the upper bound, ``log P(X <= x_r)`` at the lower.
    ``offset`` (``delta``) is held fixed when the bounds are differentiated.
    """
    loc, scale, low, high = (exact(v) for v in (loc, scale, low, high))
    threshold = _threshold(side, low, high, k, offset)
    if side == UPPER:
        return log_ndtr((loc - threshold) / scale)
    return log_ndtr((threshold - loc) / scale)


def _threshold(side, low, high, k, offset):
    """``x_r`` from the threshold's distances to the bounds, ``delta`` and ``2 h -
    delta``, so that a ``delta`` below ``10**-50`` of the bound keeps its digits."""
    other = (high - low) - offset
    if side == UPPER:
        return k * (mp.log(other) - mp.log(offset)) / 2
    return k * (mp.log(offset) - mp.log(other)) / 2


@_at_full_precision
def _log_prob_action(y, loc, scale, low, high, k, where, offset):
    if where == OUTSIDE:
        return mp.nan
    if where in (UPPER, LOWER):
        return _log_prob_on_bound(where, loc, scale, low, high, k, offset)
    return _log_prob_pre_image(pre_image(y, low, high, k), loc, scale, low, high, k)


def _action_case(y, low, high, k, dtype):
    where = position(y, low, high)
    offset = bound_offset(where, low, high, k, dtype) if where in (UPPER, LOWER) else None
    return where, offset


@functools.cache
def log_prob_action_term(y, loc, scale, low, high, k, dtype):
    """One dimension's log-probability of the action ``y`` (of ``dtype``).

    Strictly inside: the density at ``f^-1(y)``; on a bound: the rounding atom
    (:func:`_log_prob_on_bound`); outside: NaN.
    """
    where, offset = _action_case(y, low, high, k, dtype)
    return _log_prob_action(y, loc, scale, low, high, k, where, offset)


@_at_full_precision
def on_bound_threshold(side, low, high, k, dtype):
    """``x_r``, the pre-image at which an action on the bound ``side`` is scored."""
    offset = bound_offset(side, low, high, k, dtype)
    return _threshold(side, exact(low), exact(high), k, offset)


# ---------------------------------------------------------------------------------
# CDF and quantile.


@_at_full_precision
def _log_cdf(y, loc, scale, low, high, k):
    y, loc, scale, low, high = (exact(v) for v in (y, loc, scale, low, high))
    if y <= low:
        return mp.ninf
    if y >= high:
        return mp.mpf(0)
    return log_ndtr((pre_image(y, low, high, k) - loc) / scale)


@functools.cache
def log_cdf_term(y, loc, scale, low, high, k):
    """``log P(Y <= y)`` in one dimension: ``log Phi((f^-1(y) - loc) / scale)``."""
    return _log_cdf(y, loc, scale, low, high, k)


@_at_full_precision
def standard_normal_quantile(p):
    """``Phi^-1(p)``, with the extra digits that ``2 p - 1`` needs near 0 and 1."""
    p = exact(p)
    extra = int(max(0, -mp.log10(min(p, 1 - p)))) + 10
    with mp.workdps(mp.dps + extra):
        return mp.sqrt(2) * mp.erfinv(2 * p - 1)


@_at_full_precision
def _quantile(p, loc, scale, low, high, k):
    p, loc, scale, low, high = (exact(v) for v in (p, loc, scale, low, high))
    if p == 0:
        return low
    if p == 1:
        return high
    return forward(loc + scale * standard_normal_quantile(p), low, high, k)


@functools.cache
def quantile_term(p, loc, scale, low, high, k):
    """The action below which lies the mass ``p``: ``f(loc + scale Phi^-1(p))``."""
    return _quantile(p, loc, scale, low, high, k)


# ---------------------------------------------------------------------------------
# Mode and KL.


@functools.cache
@_at_full_precision
def mode_pre_image_term(loc, scale, k):
    """The ``x`` that maximises ``log N(x; loc, scale) - log f'(x)``.

    With ``t = x / k``, ``m = loc / k``, ``s = scale / k``, the stationary points
    solve ``t = m + 2 s**2 tanh(t)``; the maximum is the largest root of
    ``t = |m| + 2 s**2 tanh(t)`` with the sign of ``m`` (the positive one for
    ``m = 0``), found from the bracket ``[|m|, |m| + 2 s**2]``.
    """
    m, s = exact(loc) / k, exact(scale) / k
    pull = 2 * s**2

    def excess(t):
        return t - abs(m) - pull * mp.tanh(t)

    if m == 0 and pull <= 1:
        return mp.mpf(0)
    lower = abs(m)
    if m == 0:
        # t = 0 is a root too; move the bracket's lower end to where excess < 0.
        lower = pull
        while excess(lower) >= 0:
            lower /= 2
    # Illinois (a bracketing secant) converges on every grid point; Anderson and
    # Ridder's methods divide by zero or stall where the bracket is very wide.
    root = mp.findroot(excess, (lower, abs(m) + pull), solver="illinois")
    if abs(excess(root)) > mp.mpf(10) ** -(DIGITS - 10) * (root + abs(m) + pull):
        raise ArithmeticError(f"no root found for loc={loc}, scale={scale}, k={k}")
    return k * (-root if m < 0 else root)


@functools.cache
def mode_term(loc, scale, low, high, k):
    """The most likely action in one dimension: ``f`` of :func:`mode_pre_image_term`."""
    return forward(mode_pre_image_term(loc, scale, k), low, high, k)


@_at_full_precision
def _kl(loc_p, scale_p, loc_q, scale_q):
    loc_p, scale_p, loc_q, scale_q = (exact(v) for v in (loc_p, scale_p, loc_q, scale_q))
    return (
        mp.log(scale_q / scale_p)
        + (scale_p**2 + (loc_p - loc_q) ** 2) / (2 * scale_q**2)
        - mp.mpf(1) / 2
    )


@functools.cache
def kl_term(loc_p, scale_p, loc_q, scale_q):
    """One dimension's ``KL(N(loc_p, scale_p) || N(loc_q, scale_q))``.

    The KL of two squashed Normals with the same bijection is that of their bases.
    """
    return _kl(loc_p, scale_p, loc_q, scale_q)


@functools.cache
def kl_gradient(loc_p, scale_p, loc_q, scale_q, parameter):
    """The derivative of :func:`kl_term` with respect to one of its four arguments."""
    names = ("loc_p", "scale_p", "loc_q", "scale_q")
    return _differentiate(_kl, (loc_p, scale_p, loc_q, scale_q), names.index(parameter))


# ---------------------------------------------------------------------------------
# Derivatives of the closed forms.


@_at_full_precision
def _differentiate(function, args, index, step=None):
    """``d function / d args[index]`` by ``mpmath.diff``: central differences at twice
    the working precision, with a step of about ``10**-53`` unless ``step`` is given
    (an action near a bound needs one far below its distance to it)."""
    args = [exact(a) if isinstance(a, float) else a for a in args]

    def along(v):
        return function(*args[:index], v, *args[index + 1 :])

    if step is None:
        return mp.diff(along, args[index])
    return mp.diff(along, args[index], h=step)


@functools.cache
def log_prob_pre_image_gradient(x, loc, scale, low, high, k, parameter):
    """The derivative of :func:`log_prob_pre_image_term` with respect to ``parameter``
    (one of :data:`PARAMETERS`; the value is ``x``)."""
    args = (x, loc, scale, low, high, k)
    return _differentiate(_log_prob_pre_image, args, PARAMETERS.index(parameter))


@functools.cache
def log_prob_action_gradient(y, loc, scale, low, high, k, dtype, parameter):
    """The derivative of :func:`log_prob_action_term` with respect to ``parameter``.

    On a bound, the threshold's offset ``delta`` is held fixed (it is a float spacing,
    constant between floats); the derivative with respect to the action itself does
    not exist there (the term is the atom's log-probability) and is NaN.
    """
    where, offset = _action_case(y, low, high, k, dtype)
    if where == OUTSIDE or (where != INSIDE and parameter == "value"):
        return mp.nan
    args = (y, loc, scale, low, high, k, where, offset)
    step = None
    if where == INSIDE and parameter in ("value", "low", "high"):
        # Moving the action or a bound changes the distance between them: the step
        # must be far below it (the smallest normal float, next to the sigmoid's 0).
        with mp.workdps(DIGITS):
            distance = min(exact(y) - exact(low), exact(high) - exact(y))
            step = distance * mp.mpf(10) ** -25
    return _differentiate(_log_prob_action, args, PARAMETERS.index(parameter), step)


def _half_one_plus_tanh(u, sign):
    """``(1 + sign tanh(u)) / 2 = 1 / (1 + exp(-2 sign u))``, with every digit where
    ``tanh(u)`` is within ``10**-DIGITS`` of ``-sign``."""
    return 1 / (1 + mp.exp(-2 * sign * u))


@functools.cache
@_at_full_precision
def log_cdf_gradient(y, loc, scale, low, high, k, parameter):
    """The derivative of :func:`log_cdf_term`, for ``y`` strictly inside, in closed form.

    With ``v = (x - loc) / scale``, ``x = k (log(y - low) - log(high - y)) / 2`` and
    ``R = phi(v) / Phi(v)``: ``-R / scale`` (loc), ``-R v / scale`` (scale), and
    ``R / scale`` times ``dx/dy = k (1 / (y - low) + 1 / (high - y)) / 2``,
    ``dx / d high = -k / (2 (high - y))`` or ``dx / d low = -k / (2 (y - low))``.
    """
    if position(y, low, high) != INSIDE:
        return mp.nan
    y, loc, scale, low, high = (exact(a) for a in (y, loc, scale, low, high))
    v = (pre_image(y, low, high, k) - loc) / scale
    mills = mp.exp(-(v**2) / 2 - mp.log(2 * mp.pi) / 2 - log_ndtr(v))
    to_low, to_high = y - low, high - y
    # d v / d parameter, times scale.
    pre_image_derivative = {
        "value": k * (1 / to_low + 1 / to_high) / 2,
        "high": -k / (2 * to_high),
        "low": -k / (2 * to_low),
        "loc": -1,
        "scale": -v,
    }
    return mills / scale * pre_image_derivative[parameter]


@functools.cache
@_at_full_precision
def quantile_gradient(p, loc, scale, low, high, k, parameter):
    """The derivative of :func:`quantile_term` (the value is ``p``), for ``0 < p < 1``, in
    closed form: with ``z = Phi^-1(p)``, ``x = loc + scale z`` and
    ``f'(x) = (h / k) sech(x / k)**2``, ``f'(x)`` times ``1`` (loc), ``z`` (scale) or
    ``scale / phi(z)`` (p); ``(1 +- tanh(x / k)) / 2`` for the bounds."""
    if not 0 < p < 1:
        return mp.nan
    p, loc, scale, low, high = (exact(a) for a in (p, loc, scale, low, high))
    z = standard_normal_quantile(p)
    u = (loc + scale * z) / k
    if parameter in ("low", "high"):
        return _half_one_plus_tanh(u, 1 if parameter == "high" else -1)
    _, half_range = _centre_and_half_range(low, high)
    slope = half_range / k / mp.cosh(u) ** 2
    return slope * {"loc": 1, "scale": z, "value": scale / mp.npdf(z)}[parameter]


def derivative(function, args, parameter):
    """``d function(*args) / d args[i]`` by ``mpmath.diff``, ``i`` the position of
    ``parameter`` in :data:`PARAMETERS`: a cross-check of the closed forms."""
    return _differentiate(function, args, PARAMETERS.index(parameter))


@functools.cache
def mode_gradient(loc, scale, low, high, k, parameter):
    """The derivative of :func:`mode_term` with respect to the bounds (the pre-image of
    the mode does not depend on them): ``(1 + tanh(x* / k)) / 2`` for ``high``,
    ``(1 - tanh(x* / k)) / 2`` for ``low``."""
    with mp.workdps(max(mp.dps, DIGITS)):
        u = mode_pre_image_term(loc, scale, k) / k
        return _half_one_plus_tanh(u, 1 if parameter == "high" else -1)


# ---------------------------------------------------------------------------------
# Expectations under the Normal: moments and entropy.

# Two ways of cutting the line into pieces on which Gauss-Legendre converges fast:
# at the Normal's centre and multiples of its std (where the weight bends), and at
# 0 and multiples of a unit (where tanh bends, and |t| has its kink at 0). Outside
# +-WIDTH stds the weight is below exp(-800), negligible at 50 digits for every
# quantity here.
_SPLITTINGS = (
    ((0, 1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 28), (0, 0.5, 1, 2, 4, 8, 16, 32, 64), 40),
    ((0, 0.75, 1.5, 2.5, 3.5, 5, 7, 9, 11, 14, 18, 24, 32), (0, 0.75, 3, 12, 48, 96), 44),
)
# Two splittings must agree to 30 digits (of the integral of the integrand's absolute
# value), far beyond the 16 of float64: the quadrature has converged. Gauss-Legendre
# resolves the far tails of the weight only to about 35 digits of the total, which
# is why it is not 50.
_AGREEMENT = mp.mpf(10) ** -30


class _Expectations:
    """Expectations of functions of ``T ~ N(m, s)`` by ``mpmath.quad``.

    Integrated in ``z = (t - m) / s`` against the standard Normal density, so that
    ``t - m = s z`` keeps every digit however narrow the Normal. The integrands
    share their transcendental functions: they are computed once per node and kept,
    so the quantities below cost one set of evaluations.
    """

    def __init__(self, m, s):
        self.m, self.s = m, s
        self._cosh_m = mp.cosh(m)
        self._normalizer = 1 / mp.sqrt(2 * mp.pi)
        self._nodes = {}

    def _at(self, z):
        values = self._nodes.get(z)
        if values is None:
            t = self.m + self.s * z
            weight = mp.exp(-(z**2) / 2) * self._normalizer
            # cosh and sech**2 from q = exp(-2 |t|), which also gives the entropy's
            # log1p(q): one exponential instead of three.
            half_q = mp.exp(-abs(t))
            q = half_q * half_q
            inverse_cosh = 2 * half_q / (1 + q)
            sech2 = inverse_cosh * inverse_cosh
            # tanh(t) - tanh(m) = sinh(t - m) / (cosh t cosh m), without cancellation,
            # so that a narrow or saturated variance keeps its digits.
            d = mp.sinh(self.s * z) * inverse_cosh / self._cosh_m
            values = {
                "d": d * weight,
                "d2": d * d * weight,
                "sech2": sech2 * weight,
                "sech2_z": sech2 * z * weight,
                "d_sech2": d * sech2 * weight,
                "d_sech2_z": d * sech2 * z * weight,
                "log1p": mp.log1p(q) * weight,
            }
            self._nodes[z] = values
        return values

    def _points(self, splitting):
        """The pieces' ends in the standardized variable ``z = (t - m) / s``."""
        multiples, anchors, width = splitting
        m, s = self.m, self.s
        points = {mp.mpf(sign * j) for j in (*multiples, width) for sign in (1, -1)}
        points.update((sign * mp.mpf(a) - m) / s for a in anchors for sign in (1, -1))
        return sorted(p for p in points if -width <= p <= width)

    def _typical(self, name):
        """The largest ``|integrand|`` at the pieces' ends and middles.

        ``mpmath.quad`` stops on an absolute error of about ``10**-DIGITS``, so an
        integral far below 1 (a saturated or narrow variance) would keep few digits:
        each integrand is divided by this size first.
        """
        points = self._points(_SPLITTINGS[0])
        probes = points + [(a + b) / 2 for a, b in itertools.pairwise(points)]
        return max(abs(self._at(z)[name]) for z in probes) or mp.mpf(1)

    def __call__(self, name):
        """``E[g(T)]`` for the integrand ``name``, checked on both splittings."""
        size = self._typical(name)
        inverse_size = 1 / size
        first, second = (
            size
            * mp.quad(
                lambda z: self._at(z)[name] * inverse_size,
                self._points(splitting),
                method="gauss-legendre",
            )
            for splitting in _SPLITTINGS
        )
        # The integrand's size stands in for the integral of its absolute value, which
        # an integral that cancels (E[d] for m = 0) is much smaller than.
        if abs(first - second) > _AGREEMENT * (abs(first) + size):
            raise ArithmeticError(
                f"quadrature of {name} did not converge for m={self.m}, s={self.s}: "
                f"{first} against {second}"
            )
        return first


@functools.cache
@_at_full_precision
def gaussian_expectations(loc, scale, k):
    """The expectations under ``T = X / k ~ N(m, s)`` (``m = loc / k``, ``s = scale / k``)
    that the moments and the entropy need.

    With ``d = tanh(T) - tanh(m)`` and ``Z = (T - m) / s``: ``E[d]``, ``E[d**2]``,
    ``E[sech(T)**2]``, ``E[sech(T)**2 Z]``, ``E[d sech(T)**2]``, ``E[d sech(T)**2 Z]``
    and ``E[log1p(exp(-2 |T|))]``, keyed by the names of :class:`_Expectations`, and
    ``m`` and ``s``. They do not depend on the bounds, so tanh and ``BoundedTanh``
    share them, and a sigmoid shares those of a tanh at half its ``loc`` and ``scale``.
    """
    return _expectations_at(exact(loc) / k, exact(scale) / k)


@functools.cache
@_at_full_precision
def _expectations_at(m, s):
    # Keyed by m and s (exact: k is 1 or 2), so that a sigmoid at (2 m, 2 s) and a tanh
    # at (m, s) share one quadrature.
    expect = _Expectations(m, s)
    names = ("d", "d2", "sech2", "sech2_z", "d_sech2", "d_sech2_z", "log1p")
    return {"m": m, "s": s, **{name: expect(name) for name in names}}


@functools.cache
@_at_full_precision
def moments_term(loc, scale, low, high, k):
    """``(mean, variance)`` of ``f(X)`` in one dimension, and their derivatives.

    ``mean = c + h E[tanh T]`` and ``variance = h**2 Var[tanh T]`` with
    ``T = X / k ~ N(m, s)``. Returns a dict: ``mean``, ``variance``, and
    ``mean/<parameter>``, ``variance/<parameter>`` for ``loc``, ``scale``, ``low``,
    ``high``:

    - ``d mean / d loc = (h / k) E[sech(T)**2]``,
      ``d mean / d scale = (h / k) E[sech(T)**2 Z]``;
    - ``d Var[tanh T] / d loc = (2 / k) Cov(tanh T, sech(T)**2)``, and with
      ``sech(T)**2 Z`` for the scale;
    - the bounds enter through ``c`` and ``h`` only.

    Also ``mean_abs_derivative`` (``(h / k) E[sech(T)**2]``, the size of both mean
    derivatives) for tolerances.
    """
    e = gaussian_expectations(loc, scale, k)
    m = e["m"]
    centre, half_range = _centre_and_half_range(exact(low), exact(high))
    mean_tanh = mp.tanh(m) + e["d"]
    variance_tanh = e["d2"] - e["d"] ** 2
    covariance_loc = e["d_sech2"] - e["d"] * e["sech2"]
    covariance_scale = e["d_sech2_z"] - e["d"] * e["sech2_z"]
    return {
        "mean": centre + half_range * mean_tanh,
        "variance": half_range**2 * variance_tanh,
        "mean/loc": half_range / k * e["sech2"],
        "mean/scale": half_range / k * e["sech2_z"],
        "mean/low": (1 - mean_tanh) / 2,
        "mean/high": (1 + mean_tanh) / 2,
        "variance/loc": half_range**2 * 2 / k * covariance_loc,
        "variance/scale": half_range**2 * 2 / k * covariance_scale,
        "variance/low": -half_range * variance_tanh,
        "variance/high": half_range * variance_tanh,
        "mean_abs_derivative": half_range / k * e["sech2"],
    }


@_at_full_precision
def expected_abs(m, s):
    """``E|T|`` for ``T ~ N(m, s)``, in closed form."""
    m, s = exact(m), exact(s)
    return m * mp.erf(m / (s * mp.sqrt(2))) + s * mp.sqrt(2 / mp.pi) * mp.exp(-(m**2) / (2 * s**2))


@functools.cache
@_at_full_precision
def entropy_term(loc, scale, low, high, k):
    """One dimension's entropy of ``f(X)`` and its derivatives, in nats.

    ``H[f(X)] = H[X] + E[log f'(X)]``, ``H[X] = 1/2 + log(2 pi)/2 + log(scale)``,
    ``E[log f'(X)] = log(h / k) + E[log sech(T)**2]`` and
    ``log sech(t)**2 = 2 log 2 - 2|t| - 2 log1p(exp(-2|t|))``: ``E|T|`` in closed
    form, the bounded remainder by quadrature. Derivatives:
    ``d/d loc = -(2 / k) E[tanh T]``, ``d/d scale = 1 / scale - (2 / k) E[tanh(T) Z]``
    with ``E[tanh(T) Z] = s E[sech(T)**2]`` (Stein's lemma), and
    ``d/d high = -d/d low = 1 / (2 h)``. Returns a dict
    with ``entropy`` and ``entropy/<parameter>``.
    """
    e = gaussian_expectations(loc, scale, k)
    m, s, scale = e["m"], e["s"], exact(scale)
    _, half_range = _centre_and_half_range(exact(low), exact(high))
    expected_log_sech2 = 2 * mp.log(2) - 2 * expected_abs(m, s) - 2 * e["log1p"]
    entropy = (
        mp.mpf(1) / 2
        + mp.log(2 * mp.pi) / 2
        + mp.log(scale)
        + mp.log(half_range / k)
        + expected_log_sech2
    )
    return {
        "entropy": entropy,
        "entropy/loc": -2 / k * (mp.tanh(m) + e["d"]),
        "entropy/scale": 1 / scale - 2 / k * s * e["sech2"],
        "entropy/low": -1 / (2 * half_range),
        "entropy/high": 1 / (2 * half_range),
    }


# ---------------------------------------------------------------------------------
# Float constants the tests' tolerances use.


def eps(dtype) -> float:
    """Machine epsilon of ``dtype`` (``2**-23`` for float32, ``2**-52`` for float64)."""
    return float(np.finfo(np.dtype(dtype)).eps)


HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)
