"""The maths of a squashed Normal on arrays, behind ``SquashedNormal``'s methods.

Everything here takes arrays and a :class:`samplers.Squashing` (the bounds of
``y = center + half_range * tanh(x / k)``), never a distribution object: the
log-density and the CDF of an action computed from its distances to the bounds,
the pre-image of the mode, the mean, variance and entropy by quadrature, and the
custom-derivative kernels of the pre-image paths.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy import special

from samplers._numerics import HALF_LOG_2PI, log_ndtr, tanh
from samplers.distributions.bijectors import Squashing, squashing


def _compiled(function):
    """``function(bounds, *args, **options)`` as one XLA program per pre-image scale,
    shapes and dtypes.

    Called eagerly, a method then runs one compiled program instead of dispatching
    (and, on a new shape, compiling) each of its operations; under an outer ``jit``
    it is inlined. ``pre_image_scale`` is static; the bounds and the other
    arguments are traced (``None`` stays ``None``).
    """

    @functools.partial(jax.jit, static_argnums=0)
    def run(k, low, high, *args, **options):
        return function(Squashing(low, high, k), *args, **options)

    @functools.wraps(function)
    def call(bounds: Squashing, *args, **options):
        return run(bounds.pre_image_scale, bounds.low, bounds.high, *args, **options)

    return call


@jax.jit
def valid_parameters(loc, scale):
    """Where ``loc`` is finite and ``scale`` finite and positive: elsewhere the outputs
    that would otherwise stay finite (a CDF, a quantile, a moment) are made NaN."""
    return jnp.isfinite(loc) & (scale > 0) & (scale < jnp.inf)


@jax.jit
def nan_where_invalid(loc, scale):
    """``loc`` and ``scale``, NaN in the dimensions whose parameters are not valid."""
    valid = valid_parameters(loc, scale)
    return jnp.where(valid, loc, jnp.nan), jnp.where(valid, scale, jnp.nan)


def log_normal(x, loc, scale):
    """``log N(x; loc, scale)`` elementwise; all three of one shape."""
    standardized = (x - loc) / scale
    return -0.5 * jnp.square(standardized) - (HALF_LOG_2PI + jnp.log(scale))


def _bounds_like(bounds: Squashing, action):
    low = jnp.broadcast_to(jnp.asarray(bounds.low, action.dtype), action.shape)
    high = jnp.broadcast_to(jnp.asarray(bounds.high, action.dtype), action.shape)
    return low, high, (high - low) / 2


def _difference(a, b):
    """``a - b`` as ``(d, e)`` with ``d + e == a - b`` exactly (Knuth's TwoSum).

    The rounding error ``e`` carries no gradient (its derivative is zero).
    """
    d = a - b
    b_virtual = a - d
    error = (a - (d + b_virtual)) + (b_virtual - b)
    return d, jax.lax.stop_gradient(error)


@_compiled
def forward(bounds: Squashing, pre_image, action):
    """``action``, the bijector's ``f(pre_image)``, with the derivative of ``f`` kept.

    The value is ``action`` itself; its derivatives are those of
    ``center + half_range * tanh(pre_image / k)`` with :func:`samplers._numerics.tanh`,
    positive where float32 ``f(x)`` rounds onto a bound (autodiff of the bijector
    gives 0 there, and ``BoundedTanh``'s clip halves a gradient on the bound). For
    ``k = 2`` the value is ``low + (high - low) * jax.nn.sigmoid(pre_image)``.
    """
    low, high, half_range = _bounds_like(bounds, action)
    k = bounds.pre_image_scale
    if k == 2.0:
        # The logistic map itself (low + (high - low) * sigmoid, exactly sigmoid on
        # [0, 1]): distrax.Sigmoid's forward loses relative accuracy below x ~ -9,
        # where it switches to exp(x).
        action = jnp.clip(low + (high - low) * jax.nn.sigmoid(pre_image), low, high)
    smooth = (low + high) / 2 + half_range * tanh(pre_image / k)
    return jax.lax.stop_gradient(action) + (smooth - jax.lax.stop_gradient(smooth))


def pre_image_from_distances(bounds: Squashing, action, min_distance: float | None = None):
    """``x = f^-1(y)``, ``log|f'(x)|`` and where ``y`` is on a bound, from the distances.

    With ``d_lo = y - low`` and ``d_hi = high - y`` (each held exactly as a rounded
    value plus its rounding error) and ``h = (high - low) / 2``,
    ``x = k (log d_lo - log d_hi) / 2`` and ``log|f'(x)| = log d_lo + log d_hi - log(k h)``.
    Near a bound the distance to it is exact (Sterbenz's lemma); near the centre,
    where the two logarithms cancel, ``x = k log1p((d_lo - d_hi) / d_hi) / 2`` keeps
    the relative accuracy of a small ``x``. An action on a bound (a distance below
    the smallest normal float, which XLA flushes to zero) is given the distances of
    the threshold half a float step inside it (see :func:`_distance_floors`), so
    that ``x`` there is the pre-image of the rounding threshold; with
    ``min_distance``, every distance below ``min_distance * h`` is raised to it.
    Actions outside ``[low, high]`` give NaN.

    Returns:
        ``(x, log_det, on_low, on_high)``, all of ``action``'s shape.
    """
    low, high, half_range = _bounds_like(bounds, action)
    k = bounds.pre_image_scale
    floor_low, floor_high = _distance_floors(low, high, half_range, k, min_distance)
    to_low, error_low = _difference(action, low)
    to_high, error_high = _difference(high, action)
    outside = jnp.where((to_low < 0) | (to_high < 0), jnp.nan, 0.0)
    if min_distance is None:
        tiny = jnp.finfo(action.dtype).tiny
        on_low, on_high = to_low < tiny, to_high < tiny
    else:
        on_low, on_high = to_low < floor_low, to_high < floor_high
    # Moving the action off one bound moves its distance to the other bound too.
    on_bound = on_low | on_high
    to_low = jnp.where(on_high, 2 * half_range - floor_high, jnp.where(on_low, floor_low, to_low))
    to_high = jnp.where(on_low, 2 * half_range - floor_low, jnp.where(on_high, floor_high, to_high))
    error_low, error_high = (jnp.where(on_bound, 0.0, e) for e in (error_low, error_high))
    # log(d + e) = log d + e / d to first order; the correction carries no gradient, so
    # that a distance of the smallest normal float does not square to 0 in it.
    log_to_low = jnp.log(to_low) + jax.lax.stop_gradient(error_low / to_low)
    log_to_high = jnp.log(to_high) + jax.lax.stop_gradient(error_high / to_high)
    # Within a factor of 2 of each other the two distances subtract exactly. Both
    # operands are selected, so that the branch not taken keeps gradients finite.
    central = (to_low <= 2 * to_high) & (to_high <= 2 * to_low)
    difference = jnp.where(central, (to_low - to_high) + (error_low - error_high), 0.0)
    central_log_ratio = jnp.log1p(difference / jnp.where(central, to_high, 1.0))
    log_ratio = jnp.where(central, central_log_ratio, log_to_low - log_to_high)
    # Added rather than selected, so that gradients inside the range stay finite.
    pre_image = 0.5 * k * log_ratio + outside
    log_det = log_to_low + log_to_high - jnp.log(k * half_range) + outside
    return pre_image, log_det, on_low, on_high


@_compiled
def log_prob_from_action(bounds: Squashing, action, loc, scale, min_distance=None):
    """``log p(y)`` summed over the last axis; ``loc`` and ``scale`` of ``action``'s shape.

    Strictly inside the range, the log-density at ``y``. On a bound (without
    ``min_distance``), the log-probability of the atom that rounding puts there:
    ``log P[X >= x_r]`` at ``high`` and ``log P[X <= x_r]`` at ``low``, ``x_r`` the
    pre-image of the rounding threshold half a float step inside. With
    ``min_distance``, the density at the clamped distance instead.
    """
    pre_image, log_det, on_low, on_high = pre_image_from_distances(bounds, action, min_distance)
    per_dimension = log_normal(pre_image, loc, scale) - log_det
    if min_distance is None:
        standardized = jnp.where(on_high, loc - pre_image, pre_image - loc) / scale
        per_dimension = jnp.where(on_low | on_high, log_ndtr(standardized), per_dimension)
    return jnp.sum(per_dimension, axis=-1)


def _distance_floors(low, high, half_range, k, min_distance):
    """Where an action on a bound is scored: half a float step inside, in action units.

    The step is the coarser of the action's own float spacing at the bound and,
    for a map computed through ``tanh`` (``k = 1``), ``tanh``'s spacing below 1
    (``epsneg``, i.e. ``half_range * epsneg`` in action units); the sigmoid's
    forward map, the logistic function, resolves actions down to the smallest
    normal float at 0. The result is at least the smallest normal float, below
    which XLA flushes to zero. With ``min_distance``: ``min_distance * half_range``.
    """
    if min_distance is not None:
        floor = min_distance * half_range
        return floor, floor
    low, high, half_range = (jax.lax.stop_gradient(a) for a in (low, high, half_range))
    finfo = jnp.finfo(half_range.dtype)
    tanh_step = half_range * finfo.epsneg if k == 1.0 else jnp.zeros_like(half_range)
    floor_low = 0.5 * jnp.maximum(tanh_step, jnp.nextafter(low, high) - low)
    floor_high = 0.5 * jnp.maximum(tanh_step, high - jnp.nextafter(high, low))
    return jnp.maximum(floor_low, finfo.tiny), jnp.maximum(floor_high, finfo.tiny)


@_compiled
def standardized_pre_image(bounds: Squashing, action, loc, scale):
    """``(f^-1(y) - loc) / scale``: exactly ``-inf`` on and below ``low``, ``+inf`` on and
    above ``high``, NaN for invalid parameters; gradients finite everywhere inside."""
    low, high, _ = _bounds_like(bounds, action)
    # Outside the range the pre-image is NaN; the CDF is exact there (0 or 1).
    inside = jnp.clip(action, low, high)
    pre_image, _, on_low, on_high = pre_image_from_distances(bounds, inside)
    on_low, on_high = on_low | (action < low), on_high | (action > high)
    standardized = jnp.where(
        on_high, jnp.inf, jnp.where(on_low, -jnp.inf, (pre_image - loc) / scale)
    )
    return jnp.where(valid_parameters(loc, scale), standardized, jnp.nan)


# 64 halvings shrink the bracket [|m|, |m| + 2 s**2] by 2**-64, past float32 resolution
# of the root unless it lies within ~1e-19 * s**2 of zero, where the gap is negligible.
_BISECTION_STEPS = 64


@functools.partial(jax.jit, static_argnames="k")
def mode_pre_image(loc, scale, k: float):
    """The ``x`` that maximises ``log p(f(x))``, per dimension, gradients stopped.

    The method (derived on the guarantees page): the largest root of
    ``t = |m| + 2 s**2 tanh(t)`` (``t = x / k``, ``m = loc / k``, ``s = scale / k``)
    by bisection, with the sign of ``loc``.
    """
    loc = jax.lax.stop_gradient(loc) / k
    scale = jax.lax.stop_gradient(scale) / k
    return k * _signed_largest_root(loc, 2.0 * jnp.square(scale))


@jax.jit
def _signed_largest_root(loc, pull):
    """``sign(loc) * t`` for the largest root ``t`` of ``t = |loc| + pull * tanh(t)``."""
    magnitude = jnp.abs(loc)

    def excess(t):
        # Convex for t >= 0 and <= 0 at t = |loc|, so positive exactly past the root.
        return t - magnitude - pull * jnp.tanh(t)

    def bisect(_, bracket):
        lo, hi = bracket
        mid = 0.5 * (lo + hi)
        past = excess(mid) > 0
        return jnp.where(past, lo, mid), jnp.where(past, mid, hi)

    lo, hi = jax.lax.fori_loop(0, _BISECTION_STEPS, bisect, (magnitude, magnitude + pull))
    root = 0.5 * (lo + hi)
    return jnp.where(loc < 0, -root, root)


# The moments of tanh(m + s z), z ~ N(0, 1). For s <= 1/2, Gauss-Hermite in z: the
# integrand's poles lie pi / (2 s) >= pi from the real axis, and 32 nodes give a
# relative error under 1e-10 in float64. Wider, the integrand turns into a step and
# Gauss-Hermite fails (0.4 off at s = 2); integrating by parts instead,
# E[u(X)] = integral of -u'(t) P[X <= t] dt with u = 1 - tanh. For m >= 0 (mirrored
# otherwise) the integrand sech(t)**2 P[X <= t] is log-concave with its peak near
# t = m - 2 s**2 (or 0, whichever is larger), and negligible 20 away from it. The
# trapezoidal rule on that window converges geometrically (step 1/4: under 1e-12 in
# float64 for s >= 1/2), also when X saturates and the moments are tiny.
_NARROW_SCALE = 0.5
_HERMITE_NODES, _HERMITE_WEIGHTS = np.polynomial.hermite.hermgauss(32)
_TRAPEZOID_STEP = 0.25
_TRAPEZOID_NODES = np.arange(-80, 81) * _TRAPEZOID_STEP


@_compiled
def moments(bounds: Squashing, loc, scale):
    """The mean and variance of ``y = f(x)``, ``x ~ N(loc, scale)``, per dimension."""
    k = bounds.pre_image_scale
    m, s = loc / k, scale / k
    narrow = s <= _NARROW_SCALE
    # Each rule gets a scale in its own range, so the branch not taken stays finite.
    # (Selected with where, not minimum/maximum, which halve the gradient at a tie.)
    mean_narrow, variance_narrow = _moments_narrow(m, jnp.where(narrow, s, _NARROW_SCALE))
    mean_wide, variance_wide = _moments_wide(m, jnp.where(narrow, _NARROW_SCALE, s))
    unit_mean = jnp.where(narrow, mean_narrow, mean_wide)
    unit_variance = jnp.where(narrow, variance_narrow, variance_wide)
    low, high, half_range = _bounds_like(bounds, loc)
    valid = valid_parameters(loc, scale)
    mean = jnp.where(valid, (low + high) / 2 + half_range * unit_mean, jnp.nan)
    return mean, jnp.where(valid, jnp.square(half_range) * unit_variance, jnp.nan)


def _nodes(values, like):
    """Constants with a leading node axis, of ``like``'s dtype and rank plus one."""
    return jnp.asarray(values, like.dtype).reshape((-1,) + (1,) * like.ndim)


def _moments_narrow(m, s):
    z = _nodes(np.sqrt(2.0) * _HERMITE_NODES, m)
    weights = jnp.asarray(_HERMITE_WEIGHTS / np.sqrt(np.pi), m.dtype)
    # tanh(m + s z) - tanh(m) without cancellation, so that a narrow variance keeps
    # its relative accuracy: sinh(s z) / (cosh(m + s z) cosh(m)), with each 1 / cosh
    # as 2 exp(-|a|) / (1 + exp(-2|a|)), which underflows where cosh would overflow.
    shifted = m[None] + s[None] * z
    difference = jnp.sinh(s[None] * z) * _sech(shifted) * _sech(m)[None]
    mean_difference = jnp.tensordot(weights, difference, axes=1)
    second = jnp.tensordot(weights, jnp.square(difference), axes=1)
    return tanh(m) + mean_difference, jnp.maximum(second - jnp.square(mean_difference), 0.0)


def _sech(a):
    decay = jnp.exp(-jnp.abs(a))
    return 2.0 * decay / (1.0 + jnp.square(decay))


def _moments_wide(m, s):
    # For m >= 0 (mirrored otherwise), u = 1 - tanh(X) in (0, 2):
    # E[u] = int sech^2(t) P(t) dt and E[u^2] = int 2 u(t) sech^2(t) P(t) dt, with
    # P(t) = Phi((t - m) / s); Var[tanh X] = Var[u] keeps its relative accuracy
    # when X saturates.
    magnitude = jnp.abs(m)
    # The window's position does not change the integral: it carries no gradient.
    centre = jax.lax.stop_gradient(jnp.maximum(magnitude - 2.0 * jnp.square(s), 0.0))
    t = centre[None] + _nodes(_TRAPEZOID_NODES, m)
    # sech^2 and 1 - tanh through exp(-2|t|), which underflows gracefully far out.
    decay = jnp.exp(-2.0 * jnp.abs(t))
    sech_squared = 4.0 * decay / jnp.square(1.0 + decay)
    u = jnp.where(t >= 0, 2.0 * decay / (1.0 + decay), 2.0 / (1.0 + decay))
    weighted = _TRAPEZOID_STEP * sech_squared * special.ndtr((t - magnitude[None]) / s[None])
    mean_u = jnp.sum(weighted, axis=0)
    second_u = jnp.sum(2.0 * u * weighted, axis=0)
    sign = jnp.where(m < 0, -1.0, 1.0)
    return sign * (1.0 - mean_u), jnp.maximum(second_u - jnp.square(mean_u), 0.0)


# The entropy H[f(X)] = H[X] + E[log f'(X)], with log f'(x) = log(h / k) + log sech(t)**2
# and t = x / k ~ N(m, s). For L of density sech(l)**2 / 2 (the logistic law of scale
# 1/2), log cosh(t) = E|t - L| - log 2, so E[log sech(T)**2] = 2 log 2 - 2 E|T - L|.
# That L is a Normal scale mixture, N(0, K**2) with K of Kolmogorov's law (Andrews and
# Mallows, 1974), so E|T - L| = E[g(m, sqrt(s**2 + K**2))] with
# g(m, v) = E|N(m, v**2)| = m erf(m / (v sqrt 2)) + v sqrt(2 / pi) exp(-m**2 / (2 v**2)),
# dg/dm = erf(m / (v sqrt 2)) and dg/dv = sqrt(2 / pi) exp(-m**2 / (2 v**2)). The law of K
# is replaced by stds sigma_j with weights w_j (summing to 1), fitted once to minimise the
# largest |e(x)| and |e'(x)| over x (minimax), e(x) = sum_j w_j g(x, sigma_j) - log(2 cosh x).
# The error of E|T - L| is then E[e(T)], and that of its derivatives E[e'(T)] (m) and
# E[Z e'(m + s Z)] (s), so for every m and s E[log sech(T)**2] and its derivatives are
# within 2 max|e|, 2 max|e'| and 2 sqrt(2 / pi) max|e'|, the maxima over x given with
# each rule below and checked in tests/distributions/test_squashed_normal.py. Each term
# costs an rsqrt, an exp and an erf, shared by the value and both derivatives.
# float32: 6 terms, max|e| and max|e'| under 2e-7 (1.93e-7 both).
_MIXTURE_32 = (
    (0.41486486636904657, 0.01963905871613166),
    (0.5611483079850194, 0.17969230083013343),
    (0.7550789259757623, 0.3793412005347883),
    (1.020309973232361, 0.3114799258152174),
    (1.3800837832853008, 0.10198075271253537),
    (1.8773780027372473, 0.007866761391193597),
)
# float64: 9 terms, under 1e-9 (8.3e-10 and 9.3e-10).
_MIXTURE_64 = (
    (0.34989568473939076, 0.0014668742373802914),
    (0.44391572922826594, 0.028439121472832098),
    (0.556634009372103, 0.13175816669270557),
    (0.6977513598849068, 0.2632822509470026),
    (0.8767988704399847, 0.2914607525151397),
    (1.1037355373017474, 0.1958142858642375),
    (1.3891265469967702, 0.07476166535967314),
    (1.749735652695083, 0.012521531538915559),
    (2.2292862552165302, 0.0004953513721135613),
)


# Off the CPU, float32: one Normal term and Gaussian bumps. There
# log(2 cosh x) = E|x + sigma_0 Z| + b(x), where b is smooth and even and decays
# like exp(-2|x|); b is replaced by sum_i c_i exp(-x**2 / (2 tau_i**2)), fitted the same
# way, whose expectation over t ~ N(m, s) is c_i tau_i rho_i exp(-m**2 rho_i**2 / 2), with
# rho_i = 1 / sqrt(tau_i**2 + s**2): an rsqrt and an exp a bump, no erf. On a TPU v5e
# the entropy's value and gradient at B = 2**20, A = 8 took 0.87 of the one-sample
# estimate's time (benchmarks/results/tpu-default-65536-1048576.md), where the 6 Normal
# terms above took 1.49 in the run that report replaced. On 2 CPU cores at B = 65536 the
# bumps took 1.85 of it and the Normal terms 1.72 in a loop, 2.7 and 1.8 called once a
# program (XLA's CPU backend writes each bump's terms to memory): the CPU keeps the
# Normal terms. 5 bumps: max|e| and max|e'| under 2.5e-6 (1.67e-6 and 2.48e-6).
_BUMPS_32 = (
    0.8582247296092261,
    (
        (0.49916451680251145, -0.005031141921702893),
        (0.6937942348865123, -0.04714500556881249),
        (1.0810926869029416, 0.05043882375744798),
        (1.4251537821753857, 0.008077897596092221),
        (1.6897841523304573, 0.002042030330588013),
    ),
)


def mixture_rule(dtype, platform: str = "cpu"):
    """The entropy's rule for ``dtype`` on ``platform``: ``(normals, bumps)``, the
    ``(sigma_j, w_j)`` of its Normal terms and the ``(tau_i, c_i)`` of its Gaussian
    bumps. float64 takes the float64 mixture everywhere; narrower floats the float32
    mixture on the CPU and, elsewhere, one Normal term and bumps."""
    if jnp.dtype(dtype) == jnp.float64:
        return _MIXTURE_64, ()
    if platform == "cpu":
        return _MIXTURE_32, ()
    return ((_BUMPS_32[0], 1.0),), _BUMPS_32[1]


@_compiled
def entropy(bounds: Squashing, loc, scale):
    """The exact entropy of ``y = f(x)``, ``x ~ N(loc, scale)``, summed over the last axis."""
    k = bounds.pre_image_scale
    _, _, half_range = _bounds_like(bounds, loc)
    expected = _expected_log_sech_squared(loc / k, scale / k)
    per_dimension = 0.5 + HALF_LOG_2PI + jnp.log(scale) + jnp.log(half_range / k) + expected
    return jnp.sum(per_dimension, axis=-1)


@jax.custom_jvp
def _expected_log_sech_squared(m, s):
    """``E[log sech(t)**2]``, ``t ~ N(m, s)``, elementwise."""
    return _expected_log_sech_squared_and_derivatives(m, s)[0]


@_expected_log_sech_squared.defjvp
def _expected_log_sech_squared_jvp(primals, tangents):
    # The derivatives come from the value's terms, computed beside it; forward mode
    # and second derivatives differentiate these formulas.
    value, d_m, d_s = _expected_log_sech_squared_and_derivatives(*primals)
    return value, d_m * tangents[0] + d_s * tangents[1]


def _expected_log_sech_squared_and_derivatives(m, s):
    """The value and its derivatives with respect to ``m`` and ``s``, elementwise, by the
    rule of the platform the program is compiled for."""
    return jax.lax.platform_dependent(
        m,
        s,
        cpu=functools.partial(expected_log_sech_squared_by_rule, rule=mixture_rule(m.dtype)),
        default=functools.partial(
            expected_log_sech_squared_by_rule, rule=mixture_rule(m.dtype, "accelerator")
        ),
    )


def expected_log_sech_squared_by_rule(m, s, rule):
    """``E[log sech(t)**2]``, ``t ~ N(m, s)``, and its derivatives with respect to ``m``
    and ``s``, elementwise, by ``rule`` (:func:`mixture_rule`'s ``(normals, bumps)``).

    The terms are summed one by one: with a term axis, summed by ``jnp.sum`` or by a
    matrix product, the value and gradient took 2.3 and 1.4 times as long at
    B = 65536, A = 8 on the CPU (one run).
    """
    normals, bumps = rule
    # In units of c = s clipped to [1, 2 sqrt(largest float)], so that no square
    # overflows: with q = 1 / c, 1 / v_j = q rsqrt((s q)**2 + (sigma_j q)**2). The
    # value does not depend on c, so q carries no gradient.
    largest = 2.0 * math.sqrt(float(jnp.finfo(s.dtype).max))
    q = jax.lax.stop_gradient(1.0 / jnp.clip(s, 1.0, largest))
    s_q, q_squared = s * q, jnp.square(q)
    s_q_squared, m_q = jnp.square(s_q), m * q * math.sqrt(0.5)
    # sum_j w_j erf(u_j), sum_j w_j c / v_j exp(-u_j**2) and the same with sigma_j**2,
    # u_j = m / (v_j sqrt 2).
    erfs = densities = spreads = 0.0
    for sigma, w in normals:
        ratio = jax.lax.rsqrt(s_q_squared + sigma**2 * q_squared)
        u = m_q * ratio
        density = ratio * jnp.exp(-jnp.square(u))
        erfs = erfs + w * special.erf(u)
        densities = densities + w * density
        spreads = spreads + w * sigma**2 * density
    # E[log(2 cosh t)] = sum_j w_j g(m, v_j), v_j = sqrt(s**2 + sigma_j**2), and its
    # derivatives.
    expected = m * erfs + math.sqrt(2.0 / math.pi) * (s * (s_q * densities) + q * spreads)
    d_m, d_s = erfs, math.sqrt(2.0 / math.pi) * s_q * densities
    if bumps:
        # sum_i c_i tau_i rho_i exp(-a_i), a_i = m**2 rho_i**2 / 2, rho_i = q r_i with
        # r_i = rsqrt((s q)**2 + (tau_i q)**2); its derivatives are
        # -m rho_i**2 and s rho_i**2 (2 a_i - 1) times each term. a_i is capped at 100,
        # past which exp(-a_i) is 0 in float32 (and a_i may be infinite).
        values = by_rho = by_a = 0.0
        for tau, c in bumps:
            r = jax.lax.rsqrt(s_q_squared + tau**2 * q_squared)
            r_squared = jnp.square(r)
            a = jnp.minimum(jnp.square(m_q * r), 100.0)
            bump = (c * tau) * r * jnp.exp(-a)
            values = values + bump
            by_rho = by_rho + bump * r_squared
            by_a = by_a + bump * r_squared * a
        q_cubed = q * q_squared
        expected = expected + q * values
        d_m = d_m - q_cubed * m * by_rho
        d_s = d_s + q_cubed * s * (2.0 * by_a - by_rho)
    return 2.0 * math.log(2.0) - 2.0 * expected, -2.0 * d_m, -2.0 * d_s


# The two kernels below save their derivatives in the forward pass. Left to autodiff,
# XLA's CPU backend recomputes the noise draw (threefry and erfinv) inside the
# backward pass, which costs about a quarter of a PPO loss step. Parameters that
# the log-determinant closes over (e.g. bounds) are hoisted into arguments so
# that gradients still reach them.


def log_prob_from_pre_image(log_det, x, loc, scale):
    """``sum(log N(x; loc, scale) - log_det(x), -1)``, all of one shape."""
    log_det, params = jax.closure_convert(log_det, x)
    return _log_prob_kernel(log_det, x, loc, scale, *params)


# The squashing bijectors (a distrax pytree each) pass through jit as arguments: a
# program per kind of bijector and shape, which a fresh bijector of that kind reuses.


@jax.jit
def squashing_forward(bijector, pre_image):
    """:func:`forward` of ``bijector.forward(pre_image)``, for a bijector with a squashing."""
    bounds = squashing(bijector)
    if bounds is None:
        raise TypeError(f"{type(bijector).__name__} declares no squashing.")
    return forward(bounds, pre_image, bijector.forward(pre_image))


@jax.jit
def squashing_log_prob_from_pre_image(bijector, x, loc, scale):
    """:func:`log_prob_from_pre_image` with ``bijector.forward_log_det_jacobian``."""
    return log_prob_from_pre_image(bijector.forward_log_det_jacobian, x, loc, scale)


@jax.jit
def squashing_entropy_estimate(bijector, loc, scale, eps):
    """:func:`entropy_estimate` with ``bijector.forward_log_det_jacobian``."""
    return entropy_estimate(bijector.forward_log_det_jacobian, loc, scale, eps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _log_prob_kernel(log_det, x, loc, scale, *params):
    return _log_prob_forward(log_det, x, loc, scale, *params)[0]


def _log_prob_forward(log_det, x, loc, scale, *params):
    log_dets, log_det_vjp = jax.vjp(log_det, x, *params)
    log_prob, d_loc, d_scale = _normal_log_prob_and_derivatives(x, loc, scale, log_dets)
    d_x = -d_loc - log_det_vjp(jnp.ones_like(log_dets))[0]
    return log_prob, (d_x, d_loc, d_scale, log_det_vjp)


@jax.jit
def _normal_log_prob_and_derivatives(x, loc, scale, log_dets):
    """``sum(log N(x; loc, scale) - log_dets, -1)`` and the derivatives of ``log N``
    with respect to ``loc`` and ``scale`` (that with respect to ``x`` is ``-d_loc``)."""
    inverse_scale = 1.0 / scale
    standardized = (x - loc) * inverse_scale
    # (-0.5 * z) * z, not -0.5 * (z * z): sharing z * z with d_scale below makes
    # XLA's CPU backend fuse a PPO loss step into loops about 1.2x slower.
    log_prob = jnp.sum(
        -0.5 * standardized * standardized - (HALF_LOG_2PI + jnp.log(scale)) - log_dets, axis=-1
    )
    d_loc = standardized * inverse_scale
    d_scale = (jnp.square(standardized) - 1.0) * inverse_scale
    return log_prob, d_loc, d_scale


def _log_prob_backward(log_det, residuals, cotangent):
    *derivatives, log_det_vjp = residuals
    cotangent = jnp.broadcast_to(cotangent[..., None], derivatives[0].shape)
    d_params = log_det_vjp(-cotangent)[1:]
    return (*(cotangent * d for d in derivatives), *d_params)


_log_prob_kernel.defvjp(_log_prob_forward, _log_prob_backward)


def entropy_estimate(log_det, loc, scale, eps):
    """``H[x] + mean over eps's leading axis of log_det(loc + scale * eps)``, summed."""
    # Inside shard_map, a key shared by all shards gives replicated noise, and a
    # custom_vjp body does not cast it to per-shard as ordinary operations do;
    # this addition, outside the body, does (XLA removes it).
    eps = eps + jnp.zeros_like(loc)[None]
    log_det, params = jax.closure_convert(log_det, eps)  # eps has the shape log_det sees
    return _entropy_estimate_kernel(log_det, eps.shape[0], loc, scale, eps, *params)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _entropy_estimate_kernel(log_det, num_samples, loc, scale, eps, *params):
    return _entropy_estimate_forward(log_det, num_samples, loc, scale, eps, *params)[0]


def _entropy_estimate_forward(log_det, num_samples, loc, scale, eps, *params):
    # eps has a leading sample axis; the estimate averages over it.
    log_dets, log_det_vjp = jax.vjp(log_det, loc[None] + scale[None] * eps, *params)
    derivative = log_det_vjp(jnp.ones_like(log_dets))[0]
    entropy, d_loc, d_scale = _entropy_estimate_and_derivatives(scale, eps, log_dets, derivative)
    return entropy, (d_loc, d_scale, log_det_vjp)


@jax.jit
def _entropy_estimate_and_derivatives(scale, eps, log_dets, derivative):
    """The estimate from the log-determinants at ``loc + scale * eps``, and its
    derivatives with respect to ``loc`` and ``scale`` from theirs."""
    mean_log_det = jnp.mean(log_dets, axis=0)
    entropy = jnp.sum(0.5 + HALF_LOG_2PI + jnp.log(scale) + mean_log_det, axis=-1)
    d_loc = jnp.mean(derivative, axis=0)
    d_scale = 1.0 / scale + jnp.mean(derivative * eps, axis=0)
    return entropy, d_loc, d_scale


def _entropy_estimate_backward(log_det, num_samples, residuals, cotangent):
    d_loc, d_scale, log_det_vjp = residuals
    cotangent = jnp.broadcast_to(cotangent[..., None], d_loc.shape)
    d_params = log_det_vjp(jnp.broadcast_to(cotangent / num_samples, (num_samples, *d_loc.shape)))
    return (cotangent * d_loc, cotangent * d_scale, None, *d_params[1:])


_entropy_estimate_kernel.defvjp(_entropy_estimate_forward, _entropy_estimate_backward)
