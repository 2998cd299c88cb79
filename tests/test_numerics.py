"""The custom derivatives of ``samplers._numerics`` against autodiff of plain formulas.

The oracles are written from the definitions and differentiated by ``jax.grad`` in
float64: ``log(1 - tanh(x)**2)`` up to ``|x| = 10`` (beyond it float64 loses the
difference too), ``2 log 2 - 2 logaddexp(x, -x)`` (``log sech(x)**2`` from cosh)
everywhere, and ``logaddexp(0, x)`` for softplus; the slope of ``tanh`` against
``sech(x)**2`` from ``mpmath`` and from float64 ``cosh``. None of them calls the
library's kernels.
"""

import functools

import jax
import jax.numpy as jnp
import mpmath
import numpy as np
import pytest

from samplers._numerics import softplus, tanh, tanh_log_det

EPS32 = float(np.finfo(np.float32).eps)
# Pre-images from 0 to deep saturation in float32 (|x| >= 10) and float64 (|x| >= 19).
POINTS = np.array([0.0, 1e-30, 1e-8, 0.3, 1.0, 2.5, 7.99, 8.5, 10.0, 15.0, 20.0, 50.0, 88.0, 1e3])
X = np.concatenate([-POINTS[::-1], POINTS])
PLAIN_RANGE = np.abs(X) <= 10.0
EPS64 = float(np.finfo(np.float64).eps)


def _plain_tanh_log_det(x):
    return jnp.log(1.0 - jnp.tanh(x) ** 2)


def _cosh_tanh_log_det(x):
    return 2.0 * jnp.log(2.0) - 2.0 * jnp.logaddexp(x, -x)


def _plain_softplus(x):
    return jnp.logaddexp(0.0, x)


def _derivatives(function, x):
    """Value, ``jax.grad``, ``jax.jvp`` tangent and ``jax.vjp`` cotangent of ``function``."""
    return [np.asarray(a, np.float64) for a in _derivatives_jit(function, jnp.asarray(x))]


@functools.partial(jax.jit, static_argnums=0)
def _derivatives_jit(function, x):
    value = function(x)
    grad = jax.vmap(jax.grad(function))(x)
    _, tangent = jax.jvp(function, (x,), (jnp.ones_like(x),))
    _, pullback = jax.vjp(function, x)
    (cotangent,) = pullback(jnp.ones_like(x))
    return value, grad, tangent, cotangent


def _second_derivative(function, x):
    second = jax.jit(jax.vmap(jax.grad(jax.grad(function))))
    return np.asarray(second(jnp.asarray(x)), np.float64)


def _second_derivative_float64(function, x):
    """Written out: ``-2 sech(x)**2`` for ``tanh_log_det``, ``sigmoid'(x)`` for softplus.

    Autodiff of the plain formulas loses these to cancellation once ``|x|`` is large.
    """
    x = np.asarray(x, np.float64)
    e = np.exp(-np.abs(x))
    if function is tanh_log_det:
        return -8.0 * e**2 / (1.0 + e**2) ** 2
    return e / (1.0 + e) ** 2


def _oracle(function, x):
    with jax.enable_x64(True):
        return _derivatives(function, jnp.asarray(x, jnp.float64))


@pytest.mark.parametrize(
    "ours, plain, where",
    [
        (tanh_log_det, _plain_tanh_log_det, PLAIN_RANGE),
        (tanh_log_det, _cosh_tanh_log_det, np.ones_like(X, bool)),
        (softplus, _plain_softplus, np.ones_like(X, bool)),
    ],
    ids=["tanh_log_det-vs-log(1-tanh^2)", "tanh_log_det-vs-cosh", "softplus-vs-logaddexp"],
)
def test_custom_derivatives_in_float64_equal_autodiff_of_the_plain_formula(ours, plain, where):
    """In float64 the value, gradient, JVP and VJP agree to 1e-12, and so does the
    second derivative with its written-out float64 form.

    Relative to the magnitude plus 1e-12 absolute. ``1 - tanh(x)**2`` loses
    ``eps * exp(2|x|) / 4`` to cancellation, which is allowed for on top.
    """
    x = X[where]
    expected = _oracle(plain, x)
    with jax.enable_x64(True):
        actual = _derivatives(ours, jnp.asarray(x, jnp.float64))
        actual.append(_second_derivative(ours, jnp.asarray(x, jnp.float64)))
    expected.append(_second_derivative_float64(ours, x))
    cancellation = EPS64 * np.exp(2 * np.abs(x)) if plain is _plain_tanh_log_det else 0.0
    for name, a, e in zip(["value", "grad", "jvp", "vjp", "second"], actual, expected, strict=True):
        tolerance = 1e-12 * (np.abs(e) + 1.0) + cancellation
        assert np.all(np.abs(a - e) <= tolerance), (name, x, a, e)


@pytest.mark.parametrize(
    "ours, plain", [(tanh_log_det, _cosh_tanh_log_det), (softplus, _plain_softplus)]
)
def test_custom_derivatives_in_float32_are_within_a_few_ulps_of_float64(ours, plain):
    """In float32, saturated included: finite, and within 4 ulps of the float64 oracle.

    The derivatives (``-2 tanh(x)``, ``sigmoid(x)``, and their derivatives) are
    compared relative to their magnitude plus one float32 ulp of 1, since the second
    derivative of ``tanh_log_det`` at 0 and of softplus far out are near 0.
    """
    x32 = X.astype(np.float32)
    expected = [*_oracle(plain, x32), _second_derivative_float64(ours, x32)]
    actual = [*_derivatives(ours, jnp.asarray(x32)), _second_derivative(ours, x32)]
    for name, a, e in zip(["value", "grad", "jvp", "vjp", "second"], actual, expected, strict=True):
        assert np.all(np.isfinite(a)), name
        tolerance = 4 * EPS32 * (np.abs(e) + 1.0)
        assert np.all(np.abs(a - e) <= tolerance), (name, x32, a, e)


def test_tanh_is_jnp_tanh_with_a_slope_within_2_5_eps_of_sech_squared():
    """``tanh``'s value is ``jnp.tanh``'s, bit for bit; its slope (``jax.grad``, the JVP
    and the VJP alike) is within 2.5 float32 eps, relative, of float64's
    ``1 / cosh(x)**2`` for every ``|x| <= 43`` of a dense grid (beyond it
    ``exp(-2|x|)`` leaves float32's normal range), and in float64 within 4 float64 eps
    of ``mpmath``'s ``sech(x)**2`` for ``|x| <= 300``."""
    grid = np.concatenate([[0.0], np.logspace(-30, np.log10(43.0), 2000), np.linspace(0, 12, 2001)])
    x32 = np.unique(np.concatenate([-grid, grid]).astype(np.float32))
    value, *slopes = _derivatives(tanh, x32)
    np.testing.assert_array_equal(value, np.asarray(jnp.tanh(jnp.asarray(x32)), np.float64))
    expected = 1.0 / np.cosh(x32.astype(np.float64)) ** 2
    for name, slope in zip(["grad", "jvp", "vjp"], slopes, strict=True):
        assert np.all(np.abs(slope - expected) <= 2.5 * EPS32 * expected), name

    x64 = np.concatenate([-POINTS[POINTS <= 300], np.linspace(0.0, 300.0, 301)])
    with mpmath.workdps(40):
        expected64 = np.array([float(mpmath.sech(mpmath.mpf(v)) ** 2) for v in x64])
    with jax.enable_x64(True):
        slopes64 = _derivatives(tanh, jnp.asarray(x64, jnp.float64))[1:]
    for name, slope in zip(["grad", "jvp", "vjp"], slopes64, strict=True):
        assert np.all(np.abs(slope - expected64) <= 4 * EPS64 * expected64), name


def test_tanh_and_tanh_log_det_share_one_exponential_in_a_compiled_program():
    """Where both appear, value and gradient, XLA computes ``exp(-2|x|)`` once."""

    def both(x):
        return jnp.sum(tanh(x) + tanh_log_det(x))

    program = jax.jit(jax.value_and_grad(both)).lower(jnp.ones((64, 8))).compile().as_text()
    assert program.count(" exponential(") == 1, program
