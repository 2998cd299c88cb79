"""The squashed Normal against a 50-digit oracle (``tests/oracle.py``), on adversarial grids.

Part one checks the oracle itself against independent float64 formulas (scipy and
numpy) where float64 is comfortably accurate. Part two sweeps the library: stds from
about 1e-8 to 1e4, means from 0 to +-60, actions at the centre of the range, near the
bounds (1e-3 and 1e-6 of the half range), on the float next to them and on them;
symmetric, asymmetric and per-dimension bounds and the sigmoid; float32 and float64;
every method and its gradients with respect to the value, ``loc``, ``scale`` and the
bounds. The library runs under ``jax.jit`` and ``jax.vmap`` over the grid's rows, each
row one distribution built inside the differentiated function, as a user's loss does.

Each check uses the bound its method documents, as worded, at every grid point. Where
a method documents none, the bound is what rounding can explain: float32 within
``ROUNDING * eps * M`` and float64 within ``1e-7 |reference| + 1e-9 M``, ``M`` the sum
of the magnitudes of the terms the quantity is made of, including how far the rounding
of an intermediate pre-image moves it (the ``*_magnitudes`` functions). Such a bound
scales with the terms, never with a blanket constant, so a gradient that points the
wrong way or a finite wrong value fails.

The grid's means and stds are exact in float32 (stds are powers of two or integers),
so the two dtypes share the oracle's integrals. The default run sweeps a
representative grid (the costlier methods in float64 and in float32 for one of the
float32 squashings, each squashing in some methods); ``-m slow`` the rest and the dense
one.

Where a squashed-Normal test goes: ``tests/README.md``.
"""

import dataclasses
import functools
import itertools
from collections.abc import Callable

import distrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpmath import mp
from scipy import integrate, optimize, special, stats

import samplers
from tests import oracle

# A float32 quantity without a documented bound is a few roundings of its terms, each
# of relative size eps; 16 leaves a factor of about 4 over the count of operations.
ROUNDING = 16
# float64 quantities without a documented bound: relative to the reference, and to
# the magnitude of the terms.
RTOL64, ATOL64 = 1e-7, 1e-9
ACTION_SIZE = 3

# ---------------------------------------------------------------------------------
# The squashings and the grid.


@dataclasses.dataclass(frozen=True)
class Squashing:
    """A bijector of the tanh family with its bounds (one per action dimension) and ``k``.

    ``make(low, high)`` builds it; the library stores bounds given as Python floats in
    the input's dtype, arrays in their own.
    """

    make: Callable
    low: tuple[float, ...]
    high: tuple[float, ...]
    k: int
    bounded: bool  # whether gradients reach the bounds
    scalar_bounds: bool = True
    # Pre-images beyond which gradients are not guaranteed: the guarantees page lists
    # distrax.Sigmoid's past |x| = 88.7 (NaN, from distrax).
    gradient_limit: float = np.inf


def _bounded_tanh(low, high):
    return samplers.BoundedTanh(low, high)


def _fixed(bijector):
    return lambda low, high: bijector


UNIT, SIGMOID_RANGE = ((-1.0,) * 3, (1.0,) * 3), ((0.0,) * 3, (1.0,) * 3)
SQUASHINGS = {
    "Tanh": Squashing(_fixed(samplers.Tanh()), *UNIT, 1, False),
    "distrax.Tanh": Squashing(_fixed(distrax.Tanh()), *UNIT, 1, False),
    "BoundedTanh(-0.1,0.3)": Squashing(_bounded_tanh, (-0.1,) * 3, (0.3,) * 3, 1, True),
    "BoundedTanh(-2,0.5)": Squashing(_bounded_tanh, (-2.0,) * 3, (0.5,) * 3, 1, True),
    "BoundedTanh[vector]": Squashing(
        _bounded_tanh, (-0.1, -2.0, 1.0), (0.3, 0.5, 1e3), 1, True, scalar_bounds=False
    ),
    "Sigmoid": Squashing(_fixed(samplers.Sigmoid()), *SIGMOID_RANGE, 2, False),
    "distrax.Sigmoid": Squashing(
        _fixed(distrax.Sigmoid()), *SIGMOID_RANGE, 2, False, gradient_limit=88.7
    ),
}


@dataclasses.dataclass(frozen=True)
class Case:
    """One squashing in one dtype."""

    name: str
    dtype: str

    @property
    def squashing(self) -> Squashing:
        return SQUASHINGS[self.name]

    @property
    def k(self) -> int:
        return self.squashing.k

    @property
    def eps(self) -> float:
        return oracle.eps(self.dtype)

    def precision(self):
        """float64 needs ``jax_enable_x64``; the context does not leak into other tests."""
        return jax.enable_x64(self.dtype == "float64")

    def bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """``low`` and ``high`` per dimension, as the library stores them (in the dtype)."""
        low, high = self.squashing.low, self.squashing.high
        return np.asarray(low, self.dtype), np.asarray(high, self.dtype)

    def bijector(self):
        """The bijector as a user builds it: Python floats, or arrays in the dtype."""
        squashing = self.squashing
        if squashing.scalar_bounds:
            return squashing.make(squashing.low[0], squashing.high[0])
        return squashing.make(*(jnp.asarray(b) for b in self.bounds()))

    def __str__(self):
        return f"{self.name}-{'f32' if self.dtype == 'float32' else 'f64'}"


FAST_CASES = [
    Case("Tanh", "float32"),
    Case("BoundedTanh(-0.1,0.3)", "float32"),
    Case("Sigmoid", "float32"),
    Case("BoundedTanh[vector]", "float64"),
]
DENSE_CASES = [Case(name, dtype) for name in SQUASHINGS for dtype in ("float32", "float64")]
FAST_LOCS = (0.0, 0.75, -4.0, 60.0)
FAST_SCALES = (2.0**-27, 2.0**-7, 1.0, 1e4)
DENSE_LOCS = (0.0, 0.375, -0.75, 2.0, -4.0, 9.0, -20.0, 35.0, 60.0, -60.0)
DENSE_SCALES = (2.0**-27, 2.0**-20, 2.0**-13, 2.0**-7, 0.25, 1.0, 3.0, 30.0, 1e3, 1e4)
# The moments and the entropy cost a quadrature each: their default grid is smaller,
# inside and outside the documented ranges (moments: scale / k in [1e-4, 10], |loc| up
# to 30 k; entropy: std in [1e-6, 1e3], |loc| up to 1e3). In units of k: a sigmoid
# at (2 m, 2 s) shares the quadrature of tanh at (m, s).
FAST_INTEGRAL_PAIRS = ((0.75, 2.0**-7), (20.0, 3.0), (1e3, 2.0**-19), (-60.0, 1e3))
DENSE_INTEGRAL_SCALES = (2.0**-27, 2.0**-19, 2.0**-13, 2.0**-7, 0.25, 1.0, 3.0, 30.0, 1e3, 1e4)
DENSE_INTEGRAL_PAIRS = (
    *itertools.product(DENSE_LOCS, DENSE_INTEGRAL_SCALES),
    (-1e3, 1e3),
    (-1e3, 2.0**-7),
)


@dataclasses.dataclass(frozen=True)
class Sweep:
    """A case and the means and stds to sweep it over."""

    case: Case
    dense: bool

    @property
    def pairs(self):
        """``(loc, scale)`` pairs for the closed-form methods."""
        locs, scales = (DENSE_LOCS, DENSE_SCALES) if self.dense else (FAST_LOCS, FAST_SCALES)
        return tuple(itertools.product(locs, scales))

    @property
    def integral_pairs(self):
        """``(loc, scale)`` pairs for the moments and the entropy."""
        pairs = DENSE_INTEGRAL_PAIRS if self.dense else FAST_INTEGRAL_PAIRS
        return tuple((self.case.k * loc, self.case.k * scale) for loc, scale in pairs)

    def __str__(self):
        return f"{'dense-' if self.dense else ''}{self.case}"


def _sweeps(float32=None):
    """The representative grid of every fast case and the dense grid of every case, as
    ``parametrize`` arguments. With ``float32`` (a squashing's name) the default tier runs
    that squashing in float32 and the float64 case; the other float32 squashings, whose
    code it shares (the tanh family), are slow. Each squashing runs by default in some
    of the methods that name one."""

    def param(case, dense):
        sweep = Sweep(case, dense)
        fast = not dense and (float32 is None or case.dtype == "float64" or case.name == float32)
        return pytest.param(sweep, id=str(sweep), marks=[] if fast else [pytest.mark.slow])

    return [param(c, False) for c in FAST_CASES] + [param(c, True) for c in DENSE_CASES]


SWEEPS = _sweeps()


def _value(kind: str, low: float, high: float, dtype) -> float:
    """An action of ``dtype`` in one dimension, named by where it lies."""
    float_type = np.dtype(dtype).type
    low_f, high_f = float_type(low), float_type(high)
    tiny = np.finfo(float_type).tiny
    half_range = (float(high_f) - float(low_f)) / 2
    if kind == "centre":
        return float(float_type((float(low_f) + float(high_f)) / 2))
    if kind in ("high", "low"):
        return float(high_f if kind == "high" else low_f)
    if kind == "high-next":
        return float(np.nextafter(high_f, low_f))
    if kind == "low+next":
        # XLA flushes subnormal floats to zero, which the library documents as on the
        # bound; next to 0 (the sigmoid's low) the first float inside is the smallest
        # normal one.
        return float(max(np.nextafter(low_f, high_f), low_f + tiny))
    if kind == "above-high":
        return float(np.nextafter(high_f, float_type(np.inf)))
    if kind == "below-low":
        return float(min(np.nextafter(low_f, float_type(-np.inf)), low_f - tiny))
    side, fraction = kind.split("-", 1) if kind.startswith("high") else kind.split("+", 1)
    if side == "high":
        return float(float_type(float(high_f) - float(fraction) * half_range))
    return float(float_type(float(low_f) + float(fraction) * half_range))


INSIDE_ROWS = (
    ("centre", "high-1e-3", "low+1e-6"),
    ("high-next", "low+next", "low+1e-3"),
    ("high-1e-6", "centre", "high-next"),
)
BOUND_ROWS = (("high", "low", "centre"), ("low+next", "high", "low"), ("high", "centre", "high"))
OUTSIDE_ROWS = (("above-high", "centre", "centre"), ("centre", "centre", "below-low"))
CENTRE_ROW = (("centre",) * ACTION_SIZE,)


@dataclasses.dataclass
class Grid:
    """Rows of the sweep, each ``[N, A]`` in the case's dtype (``value`` may differ)."""

    case: Case
    loc: np.ndarray
    scale: np.ndarray
    value: np.ndarray

    @property
    def low(self) -> np.ndarray:
        return np.broadcast_to(self.case.bounds()[0], self.loc.shape)

    @property
    def high(self) -> np.ndarray:
        return np.broadcast_to(self.case.bounds()[1], self.loc.shape)

    def oracle(self, function, *arrays, **constants) -> np.ndarray:
        """``function(*elements, low, high, k, **constants)`` per element, float64."""
        return oracle.elementwise(
            function, *arrays, self.low, self.high, k=self.case.k, **constants
        )

    def inputs(self, **extra) -> dict:
        return {"loc": self.loc, "scale": self.scale, "value": self.value, **extra}


def _grid(case: Case, pairs, value_rows=CENTRE_ROW) -> Grid:
    """Each ``(loc, scale)`` pair in every dimension of a row, times each row of value
    kinds (the actions; the centre where a method takes none)."""
    low, high = case.bounds()
    rows = [
        (loc, scale, [_value(kind, low[d], high[d], case.dtype) for d, kind in enumerate(kinds)])
        for (loc, scale), kinds in itertools.product(pairs, value_rows)
    ]
    loc, scale, value = _columns(rows, case.dtype)
    return Grid(case, loc, scale, value)


def _columns(rows, dtype):
    loc = np.asarray([[r[0]] * ACTION_SIZE for r in rows], np.float64).astype(dtype)
    scale = np.asarray([[r[1]] * ACTION_SIZE for r in rows], np.float64).astype(dtype)
    value = np.asarray([r[2] for r in rows], np.float64).astype(dtype)
    return loc, scale, value


# ---------------------------------------------------------------------------------
# Helpers: the library under jit and vmap, the comparison.

PARAMETERS = ("value", "loc", "scale", "low", "high")


def _library(case: Case, method, value, loc, scale, low, high, wrt=PARAMETERS, aux=False):
    """``method(dist, value_row)`` for each row, with its Jacobians, under jit and vmap.

    Each row builds its own ``SquashedNormal(loc_row, scale_row, bijector(low_row,
    high_row))`` inside the differentiated function, so the Jacobian with respect to a
    row's parameters is that row's alone. ``wrt`` names the arguments to differentiate
    (the bounds only for a bijector that has them). With ``aux``, ``method`` returns
    ``(output, other outputs)`` and only ``output`` is differentiated. Returns the
    outputs and ``{name: d output / d name}``, float64 arrays; a Jacobian has the
    output's shape followed by the argument's (per row).
    """
    wrt = tuple(n for n in wrt if case.squashing.bounded or n not in ("low", "high"))
    with case.precision():
        args = [value if isinstance(value, jax.Array) else jnp.asarray(value)]
        args += [jnp.asarray(a) for a in (loc, scale, low, high)]
        out, jacobians = _compiled(case, method, wrt, aux)(*args)
    as_float = lambda a: np.asarray(a, np.float64)  # noqa: E731
    return jax.tree.map(as_float, out), dict(zip(wrt, map(as_float, jacobians), strict=True))


@functools.cache
def _compiled(case: Case, method, wrt, aux):
    """The jitted, vmapped ``method`` with its Jacobians; kept, so that tests calling the
    same method on grids of the same shape compile it once."""
    argnums = tuple(PARAMETERS.index(n) for n in wrt)

    def per_row(value_row, loc_row, scale_row, low_row, high_row):
        bijector = case.squashing.make(low_row, high_row)
        return method(samplers.SquashedNormal(loc_row, scale_row, bijector), value_row)

    def with_jacobians(*args):
        if aux:
            jacobians, outputs = jax.jacrev(per_row, argnums, has_aux=True)(*args)
            return outputs, jacobians
        return per_row(*args), jax.jacrev(per_row, argnums)(*args) if argnums else ()

    return jax.jit(jax.vmap(with_jacobians))


def _batched(case: Case, method, value, loc, scale):
    """``method(dist, value)`` on one batched distribution ``[N, A]`` whose bijector is
    built as a user builds it (constant bounds: Python floats or arrays), under jit."""
    with case.precision():
        args = [jnp.asarray(a) for a in (value, loc, scale)]
        return np.asarray(_compiled_batched(case, method)(*args), np.float64)


@functools.cache
def _compiled_batched(case: Case, method):
    def batched(value, loc, scale):
        return method(samplers.SquashedNormal(loc, scale, case.bijector()), value)

    return jax.jit(batched)


def _diagonal(jacobian):
    """``d out_i / d param_i`` from a per-row Jacobian ``[N, A, A]``."""
    return np.diagonal(jacobian, axis1=-2, axis2=-1)


class Checks:
    """Collects every failed comparison of a test, so one run reports them all."""

    def __init__(self, case: Case):
        self.failures = []
        self.overflow = float(np.finfo(case.dtype).max)

    def close(self, what, got, expected, bound, where=None, **inputs):
        """Every element of ``got`` within ``bound`` of ``expected`` (equal values, also
        infinite, agree), of those ``where`` selects; a failure lists the worst
        elements with their inputs. Where ``|expected|`` exceeds the dtype's largest
        float, the infinity of its sign agrees: the true value rounds to it."""
        got = np.asarray(got, np.float64)
        expected = np.asarray(expected, np.float64)
        if expected.ndim == 0:  # one documented value for every element
            expected = np.broadcast_to(expected, got.shape)
        expected, bound = np.broadcast_arrays(expected, bound)
        if where is not None:
            got, expected, bound = (np.asarray(a)[where] for a in (got, expected, bound))
            inputs = {name: np.asarray(a)[where] for name, a in inputs.items()}
        if got.shape != expected.shape:
            self.failures.append(f"{what}: shape {got.shape}, expected {expected.shape}")
            return
        with np.errstate(invalid="ignore"):
            error = np.abs(got - expected)
            ok = (error <= bound) | (got == expected)
            beyond = (np.abs(expected) > self.overflow) & (got == np.sign(expected) * np.inf)
            ok |= beyond
            excess = np.where(np.isfinite(error), error / np.maximum(bound, 1e-300), np.inf)
        if np.all(ok):
            return
        bad = sorted(map(tuple, np.argwhere(~ok)), key=lambda i: -excess[i])
        lines = [f"{what}: {len(bad)} of {ok.size} elements outside the bound"]
        for index in bad[:5]:
            described = ", ".join(
                f"{name}={np.asarray(a)[index[: np.ndim(a)]]!r}" for name, a in inputs.items()
            )
            lines.append(
                f"  at {index}: library {got[index]!r}, oracle {expected[index]!r}, "
                f"bound {bound[index]:.3g}; {described}"
            )
        self.failures.append("\n".join(lines))

    def that(self, condition, message):
        if not np.all(condition):
            self.failures.append(message)

    def done(self):
        if self.failures:
            pytest.fail("\n\n".join(self.failures), pytrace=False)


def _gradient_bound(case: Case, expected, magnitude):
    """The bound for a gradient without a documented one (see the module docstring),
    plus the smallest normal float: XLA flushes any result below it to zero."""
    tiny = np.finfo(case.dtype).tiny
    if case.dtype == "float32":
        return ROUNDING * case.eps * magnitude + tiny
    return RTOL64 * np.abs(expected) + ATOL64 * magnitude + tiny


# ---------------------------------------------------------------------------------
# Part one: the oracle against independent float64 formulas.

COMFORTABLE = [  # (loc, scale, low, high, k), where float64 keeps ~14 digits
    (0.3, 0.8, -1.0, 1.0, 1),
    (-1.2, 0.5, -0.1, 0.3, 1),
    (0.7, 1.5, 0.0, 1.0, 2),
    (2.0, 2.0, -2.0, 0.5, 1),
]
COMFORTABLE_IDS = ["tanh", "bounded", "sigmoid", "bounded-wide"]


def _float64_log_prob_pre_image(x, loc, scale, low, high, k):
    half_range = (high - low) / 2
    t = x / k
    log_sech2 = 2 * (np.log(2) - abs(t) - np.log1p(np.exp(-2 * abs(t))))
    return stats.norm.logpdf(x, loc, scale) - np.log(half_range / k) - log_sech2


def _float64_density(loc, scale, low, high, k):
    """The density of the action and the squashing, as float64 functions of ``x``."""

    def forward(x):
        return (low + high) / 2 + (high - low) / 2 * np.tanh(x / k)

    def log_density(x):
        return _float64_log_prob_pre_image(x, loc, scale, low, high, k)

    return forward, log_density


@pytest.mark.parametrize("params", COMFORTABLE, ids=COMFORTABLE_IDS)
def test_oracle_log_densities_match_float64_formulas(params):
    loc, scale, low, high, k = params
    for x in (-3.0, -0.4, 0.0, 0.9, 5.0):
        expected = _float64_log_prob_pre_image(x, loc, scale, low, high, k)
        got = float(oracle.log_prob_pre_image_term(x, *params))
        assert got == pytest.approx(expected, rel=1e-13, abs=1e-13)
        y = (low + high) / 2 + (high - low) / 2 * np.tanh(x / k)
        assert float(oracle.forward(x, low, high, k)) == pytest.approx(y, rel=1e-14, abs=1e-15)
        x_back = k * np.arctanh((y - (low + high) / 2) / ((high - low) / 2))
        assert float(oracle.pre_image(y, low, high, k)) == pytest.approx(x_back, rel=1e-9)
        # The action's log-probability strictly inside is the density at its pre-image.
        got_action = float(oracle.log_prob_action_term(y, *params, "float64"))
        expected_action = _float64_log_prob_pre_image(x_back, loc, scale, low, high, k)
        assert got_action == pytest.approx(expected_action, rel=1e-9, abs=1e-9)
        assert oracle.position(y, low, high) == oracle.INSIDE


@pytest.mark.parametrize("params", COMFORTABLE, ids=COMFORTABLE_IDS)
def test_oracle_cdf_and_quantile_match_scipy(params):
    loc, scale, low, high, k = params
    for p in (1e-6, 0.03, 0.5, 0.9, 1 - 1e-6):
        z = stats.norm.ppf(p)
        y = (low + high) / 2 + (high - low) / 2 * np.tanh((loc + scale * z) / k)
        assert float(oracle.quantile_term(p, *params)) == pytest.approx(y, rel=1e-12, abs=1e-14)
    for fraction in (0.01, 0.5, 0.97):
        y = low + fraction * (high - low)
        x = k * np.arctanh((y - (low + high) / 2) / ((high - low) / 2))
        expected = stats.norm.logcdf(x, loc, scale)
        assert float(oracle.log_cdf_term(y, *params)) == pytest.approx(expected, rel=1e-12)
    assert oracle.log_cdf_term(low, *params) == mp.ninf
    assert oracle.log_cdf_term(high, *params) == 0
    assert oracle.quantile_term(0.0, *params) == low
    assert oracle.quantile_term(1.0, *params) == high


def test_oracle_log_ndtr_keeps_its_digits_in_both_tails():
    """Against scipy's ``log_ndtr``, accurate in float64 there; where ``Phi(v)`` rounds to
    1 the logarithm is ``-Phi(-v)``, not 0."""
    for v in (-1e4, -40.0, -3.0, 0.0, 2.0, 9.0, 18.7, 37.0):
        assert float(oracle.log_ndtr(v)) == pytest.approx(special.log_ndtr(v), rel=1e-13)
    assert oracle.log_ndtr(40.0) < 0


def test_oracle_squashing_keeps_its_digits_next_to_the_bounds():
    """Actions within ``10**-50`` of a bound and their pre-images: against float64
    formulas that need no cancellation there (``y = exp(x)`` for the sigmoid far
    below 0, ``x = log(y)`` back)."""
    for x in (-100.0, -700.0):
        assert float(oracle.forward(x, 0.0, 1.0, 2)) == pytest.approx(np.exp(x), rel=1e-13)
        assert float(oracle.forward(-x, -1.0, 1.0, 1)) == pytest.approx(1.0, rel=1e-15)
    for y in (1e-60, 1e-300, float(np.finfo(np.float64).tiny)):
        assert float(oracle.pre_image(y, 0.0, 1.0, 2)) == pytest.approx(np.log(y), rel=1e-14)
    # The float64 next to tanh's upper bound, 1 - 2**-53: atanh of it, from the distances.
    x = float(oracle.pre_image(1 - 2.0**-53, -1.0, 1.0, 1))
    assert x == pytest.approx(0.5 * np.log((2 - 2.0**-53) / 2.0**-53), rel=1e-15)


def test_oracle_normal_quantile_keeps_its_digits_in_the_far_tails():
    """``Phi(Phi^-1(p)) = p`` to 40 digits, where ``2 p - 1`` alone would lose them."""
    for p in (1e-30, 2.0**-126, 1e-6, 0.5, 1 - 2.0**-24, 1 - 2.0**-53):
        z = oracle.standard_normal_quantile(p)
        with mp.workdps(60):
            assert abs(mp.ncdf(z) / mp.mpf(p) - 1) < mp.mpf(10) ** -40


@pytest.mark.parametrize(
    "side, low, high, k, dtype, expected",
    [
        # The contract's half float step, worked out by hand: tanh's step 2**-24 (h = 1)
        # is coarser than float32's 2**-24 below 1 only in ties, so 2**-25.
        (oracle.UPPER, -1.0, 1.0, 1, "float32", 2.0**-25),
        (oracle.LOWER, -1.0, 1.0, 1, "float32", 2.0**-25),
        (oracle.UPPER, -1.0, 1.0, 1, "float64", 2.0**-54),
        # float32(0.3) lies in [0.25, 0.5): spacing 2**-25 > h * 2**-24 = 0.2 * 2**-24.
        (oracle.UPPER, float(np.float32(-0.1)), float(np.float32(0.3)), 1, "float32", 2.0**-26),
        # Sigmoid: the float spacing below 1, and the smallest normal float at 0.
        (oracle.UPPER, 0.0, 1.0, 2, "float32", 2.0**-25),
        (oracle.LOWER, 0.0, 1.0, 2, "float32", float(np.finfo(np.float32).tiny)),
        (oracle.LOWER, 0.0, 1.0, 2, "float64", float(np.finfo(np.float64).tiny)),
    ],
    ids=[
        "tanh-hi-f32",
        "tanh-lo-f32",
        "tanh-hi-f64",
        "bounded-hi-f32",
        "sig-hi",
        "sig-lo",
        "sig-lo64",
    ],
)
def test_oracle_bound_offset_follows_the_contract(side, low, high, k, dtype, expected):
    assert float(oracle.bound_offset(side, low, high, k, dtype)) == expected


def test_oracle_scores_an_action_on_a_bound_as_its_rounding_atom():
    """``log P(X >= x_r)`` at the upper bound, ``log P(X <= x_r)`` at the lower."""
    loc, scale = 7.0, 2.0
    for side, sign in ((oracle.UPPER, 1.0), (oracle.LOWER, -1.0)):
        bound = 1.0 if side == oracle.UPPER else -1.0
        x_r = sign * np.arctanh(1 - 2.0**-25)
        expected = (
            stats.norm.logsf(x_r, loc, scale) if sign > 0 else stats.norm.logcdf(x_r, loc, scale)
        )
        got = float(oracle.log_prob_action_term(bound, loc, scale, -1.0, 1.0, 1, "float32"))
        assert got == pytest.approx(expected, rel=1e-9)
        threshold = float(oracle.on_bound_threshold(side, -1.0, 1.0, 1, "float32"))
        assert threshold == pytest.approx(x_r, rel=1e-12)
        # d/d loc of log Phi(w), w = +-(loc - x_r) / scale: +-phi(w) / Phi(w) / scale.
        w = sign * (loc - x_r) / scale
        mills = np.exp(stats.norm.logpdf(w) - special.log_ndtr(w))
        args = (bound, loc, scale, -1.0, 1.0, 1, "float32", "loc")
        got = float(oracle.log_prob_action_gradient(*args))
        assert got == pytest.approx(sign * mills / scale, rel=1e-9)
    assert mp.isnan(oracle.log_prob_action_term(1.5, loc, scale, -1.0, 1.0, 1, "float32"))


@pytest.mark.parametrize("params", COMFORTABLE, ids=COMFORTABLE_IDS)
def test_oracle_closed_form_derivatives_match_float64_formulas(params):
    loc, scale, low, high, k = params
    half_range = (high - low) / 2
    x = 0.4
    z = (x - loc) / scale
    analytic = {
        "value": -z / scale + 2 / k * np.tanh(x / k),
        "loc": z / scale,
        "scale": (z**2 - 1) / scale,
        "low": 1 / (2 * half_range),
        "high": -1 / (2 * half_range),
    }
    for name, expected in analytic.items():
        got = float(oracle.log_prob_pre_image_gradient(x, *params, name))
        assert got == pytest.approx(expected, rel=1e-12, abs=1e-14), name
    # Of the action's log-probability: by the chain rule through x = f^-1(y).
    y = (low + high) / 2 + half_range * np.tanh(x / k)
    derivative = half_range / k / np.cosh(x / k) ** 2
    got = float(oracle.log_prob_action_gradient(y, *params, "float64", "value"))
    assert got == pytest.approx(analytic["value"] / derivative, rel=1e-9)
    # Of the quantile: dq/dp = f'(x) scale / phi(z).
    p = 0.2
    x_p = loc + scale * stats.norm.ppf(p)
    slope = half_range / k / np.cosh(x_p / k) ** 2
    got = float(oracle.quantile_gradient(p, *params, "value"))
    assert got == pytest.approx(slope * scale / stats.norm.pdf(stats.norm.ppf(p)), rel=1e-10)
    got = float(oracle.quantile_gradient(p, *params, "high"))
    assert got == pytest.approx((1 + np.tanh(x_p / k)) / 2, rel=1e-12)
    # Of the KL of the bases.
    kl = float(oracle.kl_term(loc, scale, 0.1, 1.3))
    expected_kl = np.log(1.3 / scale) + (scale**2 + (loc - 0.1) ** 2) / (2 * 1.3**2) - 0.5
    assert kl == pytest.approx(expected_kl, rel=1e-13)
    got = float(oracle.kl_gradient(loc, scale, 0.1, 1.3, "scale_p"))
    assert got == pytest.approx(-1 / scale + scale / 1.3**2, rel=1e-12)


def _float64_integrals(loc, scale, low, high, k):
    """Mean, variance and entropy of the action by scipy's adaptive float64 quadrature."""
    forward, log_density = _float64_density(loc, scale, low, high, k)
    limits = (loc - 30 * scale, loc + 30 * scale)
    weight = lambda x: stats.norm.pdf(x, loc, scale)  # noqa: E731
    options = {"limit": 200, "epsabs": 1e-14, "epsrel": 1e-12}
    mean = integrate.quad(lambda x: forward(x) * weight(x), *limits, **options)[0]
    variance = integrate.quad(lambda x: (forward(x) - mean) ** 2 * weight(x), *limits, **options)[0]
    entropy = integrate.quad(lambda x: -log_density(x) * weight(x), *limits, **options)[0]
    return {"mean": mean, "variance": variance, "entropy": entropy}


# Two of the four by default: each runs scipy's quadrature at 8 shifted parameters.
SOME_COMFORTABLE = [
    pytest.param(params, id=name, marks=[] if name in ("tanh", "sigmoid") else [pytest.mark.slow])
    for params, name in zip(COMFORTABLE, COMFORTABLE_IDS, strict=True)
]


@pytest.mark.parametrize("params", SOME_COMFORTABLE)
def test_oracle_moments_and_entropy_match_float64_quadrature(params):
    """The values against scipy's quadrature of the definitions over the pre-image, and
    the derivative formulas against its central differences (step 1e-4 of the scale:
    about 1e-7 relative), which also catch a wrong sign or factor."""
    loc, scale, low, high, k = params
    expected = _float64_integrals(*params)
    got = {**oracle.moments_term(*params), **oracle.entropy_term(*params)}
    for quantity, value in expected.items():
        assert float(got[quantity]) == pytest.approx(value, rel=1e-9, abs=1e-12), quantity
    step = 1e-4 * scale
    shifted = {
        "loc": lambda d: (loc + d, scale, low, high, k),
        "scale": lambda d: (loc, scale + d, low, high, k),
        "low": lambda d: (loc, scale, low + d, high, k),
        "high": lambda d: (loc, scale, low, high + d, k),
    }
    for name, at in shifted.items():
        upper, lower = _float64_integrals(*at(step)), _float64_integrals(*at(-step))
        for quantity in expected:
            difference = (upper[quantity] - lower[quantity]) / (2 * step)
            formula = float(got[f"{quantity}/{name}"])
            assert formula == pytest.approx(difference, rel=1e-6, abs=1e-8), (name, quantity)


@pytest.mark.parametrize("params", COMFORTABLE, ids=COMFORTABLE_IDS)
def test_oracle_closed_form_derivatives_match_mpmath_differences(params):
    """The closed-form derivatives of the log-CDF, the quantile and the on-bound atom
    against ``mpmath.diff`` of the oracle's own values."""
    loc, scale, low, high, k = params
    y = low + 0.37 * (high - low)
    for name in oracle.PARAMETERS:
        args = (y, loc, scale, low, high, k)
        expected = oracle.derivative(oracle._log_cdf, args, name)
        got = oracle.log_cdf_gradient(*args, name)
        assert abs(got - expected) <= 1e-30 * (abs(expected) + 1), ("log_cdf", name)
        args = (0.23, loc, scale, low, high, k)
        expected = oracle.derivative(oracle._quantile, args, name)
        got = oracle.quantile_gradient(*args, name)
        assert abs(got - expected) <= 1e-30 * (abs(expected) + 1), ("quantile", name)


def test_oracle_quadrature_covers_the_whole_mass_and_keeps_steins_identity():
    """The truncated Normal mass is 1 to 40 digits, and ``E[tanh(T) Z] = s E[sech**2 T]``
    (which the entropy's derivative uses) holds when ``E[tanh(T) Z]`` is integrated
    directly."""
    for m, s in ((20.0, 3.0),):
        with mp.workdps(oracle.DIGITS):
            expect = oracle._Expectations(mp.mpf(m), mp.mpf(s))
            points = expect._points(oracle._SPLITTINGS[0])
            mass = mp.quad(mp.npdf, points)
            assert abs(mass - 1) < mp.mpf(10) ** -40
            direct = mp.quad(
                lambda z, m=m, s=s: mp.tanh(m + s * z) * z * mp.npdf(z),
                points,
                method="gauss-legendre",
            )
            stein = s * oracle.gaussian_expectations(m, s, 1)["sech2"]
            assert abs(direct - stein) <= mp.mpf(10) ** -25 * (abs(stein) + mp.mpf(10) ** -300)


@pytest.mark.parametrize(
    "params", [*COMFORTABLE, (0.3, 1.0, -1.0, 1.0, 1)], ids=[*COMFORTABLE_IDS, "bimodal"]
)
def test_oracle_mode_is_the_global_maximum_of_the_density(params):
    """Against a dense float64 grid over the pre-image, refined by a bounded search."""
    loc, scale, low, high, k = params
    _, log_density = _float64_density(loc, scale, low, high, k)
    log_action_density = lambda x: -log_density(x)  # noqa: E731
    x_star = float(oracle.mode_pre_image_term(loc, scale, k))
    grid = np.linspace(-abs(loc) - 2 * scale**2 * 4 - 10, abs(loc) + 2 * scale**2 * 4 + 10, 20001)
    best = grid[np.argmin(log_action_density(grid))]
    refined = optimize.minimize_scalar(
        log_action_density,
        bounds=(best - 0.01, best + 0.01),
        method="bounded",
        options={"xatol": 1e-12},
    ).x
    assert x_star == pytest.approx(refined, abs=1e-5)
    assert log_action_density(x_star) <= log_action_density(refined) + 1e-12
    y = float(oracle.mode_term(loc, scale, low, high, k))
    assert y == pytest.approx((low + high) / 2 + (high - low) / 2 * np.tanh(x_star / k), rel=1e-12)


# ---------------------------------------------------------------------------------
# Part two: the library against the oracle.


def _sech2(t):
    """``sech(t)**2`` without overflow."""
    decay = np.exp(-2 * np.abs(t))
    return 4 * decay / (1 + decay) ** 2


def _magnitudes(function):
    """Tolerance sizes may exceed the float range where the quantity itself does (its
    true value then rounds to an infinity): they become infinite, without a warning."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        with np.errstate(over="ignore"):
            return function(*args, **kwargs)

    return wrapper


def _inverse_mills(w):
    """``phi(w) / Phi(w)``, the derivative of ``log Phi(w)``, without overflow."""
    return np.sqrt(2 / np.pi) / special.erfcx(-w / np.sqrt(2))


def _pre_image_and_distances(grid: Grid, inside):
    """The oracle's exact pre-image of each action strictly inside (float64; NaN
    elsewhere) and the distances to the bounds, for the tolerances."""
    value = np.where(inside, grid.value, np.nan)
    x = np.full(value.shape, np.nan)
    for index in zip(*np.nonzero(inside), strict=True):
        x[index] = float(
            oracle.pre_image(grid.value[index], grid.low[index], grid.high[index], grid.case.k)
        )
    value = value.astype(np.float64)
    return x, value - grid.low, grid.high - value


def _positions(grid: Grid) -> np.ndarray:
    return np.vectorize(oracle.position, otypes=[object])(grid.value, grid.low, grid.high)


@_magnitudes
def _log_prob_bound(case: Case, x, loc, scale, log_p):
    """log_prob's documented bound per dimension: ``4 eps (1 + |x| |x - loc| / scale**2
    + |log p|)``."""
    loc, scale = loc.astype(np.float64), scale.astype(np.float64)
    return 4 * case.eps * (1 + np.abs(x) * np.abs(x - loc) / scale**2 + np.abs(log_p))


@_magnitudes
def _log_prob_gradient_magnitudes(case: Case, x, loc, scale, to_low, to_high):
    """The size of each term of the log-probability's derivatives strictly inside.

    ``x = k (log d_lo - log d_hi) / 2``: ``d log p / d loc = (x - loc) / scale**2``,
    ``d / d scale = (z**2 - 1) / scale``, ``d / d y = -(x - loc) / scale**2 dx/dy -
    (1 / d_lo - 1 / d_hi)`` with ``dx/dy = k (1 / d_lo + 1 / d_hi) / 2``, and for the
    bounds ``dx / d high = -k / (2 d_hi)``, ``dx / d low = -k / (2 d_lo)`` with the
    Jacobian's ``1 / d`` and ``1 / (2 h)``. ``|x|`` joins ``|x - loc|`` wherever the
    computed ``x`` (rounded to about ``eps |x|``) enters the Normal term.
    """
    loc, scale = loc.astype(np.float64), scale.astype(np.float64)
    k, half_range = case.k, (to_low + to_high) / 2
    z = (x - loc) / scale
    normal = (np.abs(x) + np.abs(x - loc)) / scale**2
    return {
        "value": normal * k * (1 / to_low + 1 / to_high) / 2 + 1 / to_low + 1 / to_high,
        "loc": normal,
        "scale": (z**2 + 1 + 2 * np.abs(z) * np.abs(x) / scale) / scale,
        "high": normal * k / (2 * to_high) + 1 / to_high + 1 / (2 * half_range),
        "low": normal * k / (2 * to_low) + 1 / to_low + 1 / (2 * half_range),
    }


def _log_prob(dist, value):
    return dist.log_prob(value)


@pytest.mark.parametrize("sweep", _sweeps(float32="BoundedTanh(-0.1,0.3)"))
def test_log_prob_strictly_inside(sweep):
    """Copies of actions (arrays ``dist.sample`` did not return) strictly inside: within
    ``4 eps (1 + |x| |x - loc| / scale**2 + |log p|)`` per dimension, as
    ``docs/guides/scoring.md`` states, with finite gradients with respect to the
    action, ``loc``, ``scale`` and the bounds (``log_prob``'s docstring)."""
    case = sweep.case
    grid = _grid(case, sweep.pairs, INSIDE_ROWS)
    got, jacobians = _library(
        case, _log_prob, grid.value, grid.loc, grid.scale, grid.low, grid.high
    )
    terms = grid.oracle(
        oracle.log_prob_action_term, grid.value, grid.loc, grid.scale, dtype=case.dtype
    )
    x, to_low, to_high = _pre_image_and_distances(grid, np.ones(grid.value.shape, bool))
    bound = _log_prob_bound(case, x, grid.loc, grid.scale, terms).sum(-1)
    batched = _batched(case, _log_prob, grid.value, grid.loc, grid.scale)
    checks = Checks(case)
    checks.close("log_prob", got, terms.sum(-1), bound, **grid.inputs())
    checks.close("log_prob (batched)", batched, terms.sum(-1), bound, **grid.inputs())
    magnitudes = _log_prob_gradient_magnitudes(case, x, grid.loc, grid.scale, to_low, to_high)
    for name, jacobian in jacobians.items():
        expected = grid.oracle(
            oracle.log_prob_action_gradient,
            grid.value,
            grid.loc,
            grid.scale,
            dtype=case.dtype,
            parameter=name,
        )
        bound = _gradient_bound(case, expected, magnitudes[name])
        checks.close(f"d log_prob / d {name}", jacobian, expected, bound, **grid.inputs())
    checks.done()


@_magnitudes
def _on_bound_magnitudes(grid: Grid, on_bound, log_p):
    """The bound on the rounding atom's log-probability, and the sizes of its derivatives.

    On a bound the term is ``log Phi(w)``, ``w = +-(loc - x_r) / scale``, with the
    threshold ``x_r`` computed from the distances (rounded to about ``eps |x_r|``), so
    ``w`` is off by about ``eps u``, ``u = (|x_r| + |x_r - loc|) / scale``. With
    ``R = phi(w) / Phi(w)`` (``d log Phi / dw``) and ``|R'| = R |w + R|``, the value
    moves by ``R u`` roundings (the inside bound's ``|x| |x - loc| / scale**2``,
    carried to the atom) and each derivative by ``|R'| u`` besides its own size.
    Zero where the action is not on a bound.
    """
    case = grid.case
    loc, scale = grid.loc.astype(np.float64), grid.scale.astype(np.float64)
    x_r, sign, d_threshold = (np.zeros(grid.value.shape) for _ in range(3))
    for index in zip(*np.nonzero(on_bound), strict=True):
        low, high = float(grid.low[index]), float(grid.high[index])
        side = oracle.position(float(grid.value[index]), low, high)
        x_r[index] = float(oracle.on_bound_threshold(side, low, high, case.k, case.dtype))
        sign[index] = 1.0 if side == oracle.UPPER else -1.0
        offset = float(oracle.bound_offset(side, low, high, case.k, case.dtype))
        # x_r = +-k atanh(1 - delta / h): dx_r / dh = +-k / (2 h - delta), dh = d high / 2.
        d_threshold[index] = case.k / (2 * (high - low) - 2 * offset)
    w = sign * (loc - x_r) / scale
    mills = _inverse_mills(w)
    slope = mills * np.abs(w + mills)
    u = (np.abs(x_r) + np.abs(x_r - loc)) / scale
    value_bound = 4 * case.eps * (1 + mills * u + np.abs(log_p))
    d_loc = (mills + slope * u) / scale
    d_scale = (mills * np.abs(w) + (mills + slope * np.abs(w)) * u) / scale
    sizes = {"loc": d_loc, "scale": d_scale, "high": d_threshold * d_loc}
    sizes["low"] = sizes["high"]
    zero = lambda a: np.where(on_bound, a, 0.0)  # noqa: E731
    return zero(value_bound), {name: zero(size) for name, size in sizes.items()}


@pytest.mark.parametrize("sweep", SWEEPS)
def test_log_prob_on_a_bound_is_the_rounding_atom(sweep):
    """A copy of an action on a bound is scored as the log-probability of the float
    rounding atom there (``oracle._log_prob_on_bound``); its gradients with respect to
    ``loc``, ``scale`` and the bounds follow, and the one with respect to the action is
    finite."""
    case = sweep.case
    grid = _grid(case, sweep.pairs, BOUND_ROWS)
    got, jacobians = _library(
        case, _log_prob, grid.value, grid.loc, grid.scale, grid.low, grid.high
    )
    terms = grid.oracle(
        oracle.log_prob_action_term, grid.value, grid.loc, grid.scale, dtype=case.dtype
    )
    inside = _positions(grid) == oracle.INSIDE
    on_bound_bound, on_bound_sizes = _on_bound_magnitudes(grid, ~inside, terms)
    x, to_low, to_high = _pre_image_and_distances(grid, inside)
    inside_bound = np.where(inside, _log_prob_bound(case, x, grid.loc, grid.scale, terms), 0.0)
    bound = (inside_bound + on_bound_bound).sum(-1)
    batched = _batched(case, _log_prob, grid.value, grid.loc, grid.scale)
    checks = Checks(case)
    checks.close("log_prob on a bound", got, terms.sum(-1), bound, **grid.inputs())
    checks.close("log_prob on a bound (batched)", batched, terms.sum(-1), bound, **grid.inputs())
    on_bound_value_gradient = np.where(inside, 0.0, jacobians["value"])
    checks.that(
        np.isfinite(on_bound_value_gradient),
        f"d log_prob / d value is not finite on a bound at (row, dimension) "
        f"{np.argwhere(~np.isfinite(on_bound_value_gradient))[:5].tolist()}",
    )
    inside_sizes = _log_prob_gradient_magnitudes(case, x, grid.loc, grid.scale, to_low, to_high)
    # On a bound the action's derivative does not exist (only its finiteness is
    # checked above); the other dimensions of these rows are inside.
    on_bound_sizes["value"] = np.zeros(grid.value.shape)
    for name in jacobians:
        expected = grid.oracle(
            oracle.log_prob_action_gradient,
            grid.value,
            grid.loc,
            grid.scale,
            dtype=case.dtype,
            parameter=name,
        )
        magnitude = np.where(inside, inside_sizes[name], on_bound_sizes[name])
        bound = _gradient_bound(case, expected, magnitude)
        if name == "value":
            jacobians[name] = np.where(inside, jacobians[name], 0.0)
            expected = np.where(inside, expected, 0.0)
        checks.close(
            f"d log_prob / d {name} on a bound", jacobians[name], expected, bound, **grid.inputs()
        )
    checks.done()


@pytest.mark.parametrize("sweep", SWEEPS)
def test_log_prob_outside_the_range_is_nan(sweep):
    """One float past a bound (the first normal float past the sigmoid's 0)."""
    case = sweep.case
    grid = _grid(case, sweep.pairs, OUTSIDE_ROWS)
    got = _batched(case, _log_prob, grid.value, grid.loc, grid.scale)
    expected = grid.oracle(
        oracle.log_prob_action_term, grid.value, grid.loc, grid.scale, dtype=case.dtype
    )
    assert np.all(np.isnan(expected.sum(-1)))
    assert np.all(np.isnan(got)), grid.value[~np.isnan(got)]


# Pre-images: the centre, moderately and far saturated (float32 tanh rounds to 1 from
# about 9), the guarantee's +-1e3; and the row's mean, one std off it, three the other way.
PRE_IMAGE_ROWS = ((0.0, 3.8, -7.25), (10.0, -20.0, 50.0), (-1e3, 1e3, 9.0))


def _pre_image_grid(case: Case, pairs) -> Grid:
    base = _grid(case, pairs)
    loc, scale = base.loc.astype(np.float64), base.scale.astype(np.float64)
    blocks = [np.broadcast_to(np.asarray(row), loc.shape) for row in PRE_IMAGE_ROWS]
    blocks.append(np.stack([loc[:, 0], loc[:, 0] + scale[:, 0], loc[:, 0] - 3 * scale[:, 0]], -1))
    tile = lambda a: np.tile(a, (len(blocks), 1))  # noqa: E731
    x = np.concatenate(blocks).astype(case.dtype)
    return Grid(case, tile(base.loc), tile(base.scale), x)


def _pre_image_bound(grid: Grid, log_det):
    """The guarantee: 16 ulps (of the dtype) of the largest of ``z**2 / 2``, ``log std``,
    ``log(2 pi) / 2`` and ``log|f'(x)|``, per dimension, summed over the action axis."""
    loc, scale, x = (a.astype(np.float64) for a in (grid.loc, grid.scale, grid.value))
    z = (x - loc) / scale
    terms = np.broadcast_arrays(0.5 * z**2, np.log(scale), oracle.HALF_LOG_2PI, log_det)
    largest = np.max(np.abs(np.stack(terms)), axis=0)
    return (16 * np.spacing(largest.astype(grid.case.dtype)).astype(np.float64)).sum(-1)


@_magnitudes
def _pre_image_gradient_magnitudes(grid: Grid):
    """Sizes of the terms of ``d log p(f(x))``: ``-(x - loc) / scale**2 + (2 / k)
    tanh(x / k)`` for ``x``, ``(x - loc) / scale**2``, ``(z**2 - 1) / scale`` and
    ``-+1 / (2 h)`` for the bounds (``x`` is an input here: it is not rounded)."""
    loc, scale, x = (a.astype(np.float64) for a in (grid.loc, grid.scale, grid.value))
    z = (x - loc) / scale
    normal = np.abs(x - loc) / scale**2
    half = 1 / (grid.high.astype(np.float64) - grid.low)
    return {
        "value": normal + 2 / grid.case.k,
        "loc": normal,
        "scale": (z**2 + 1) / scale,
        "low": half,
        "high": half,
    }


def _log_prob_from_pre_image(dist, x):
    return dist.log_prob_from_pre_image(x)


@pytest.mark.parametrize("sweep", _sweeps(float32="Tanh"))
def test_log_prob_from_pre_image_is_within_16_ulps_of_its_largest_term(sweep):
    case = sweep.case
    grid = _pre_image_grid(case, sweep.pairs)
    got, jacobians = _library(
        case, _log_prob_from_pre_image, grid.value, grid.loc, grid.scale, grid.low, grid.high
    )
    expected = grid.oracle(oracle.log_prob_pre_image_term, grid.value, grid.loc, grid.scale)
    log_det = grid.oracle(oracle.log_abs_derivative, grid.value)
    checks = Checks(case)
    checks.close(
        "log_prob_from_pre_image",
        got,
        expected.sum(-1),
        _pre_image_bound(grid, log_det),
        **grid.inputs(),
    )
    magnitudes = _pre_image_gradient_magnitudes(grid)
    guaranteed = np.abs(grid.value) <= case.squashing.gradient_limit
    for name, jacobian in jacobians.items():
        expected = grid.oracle(
            oracle.log_prob_pre_image_gradient, grid.value, grid.loc, grid.scale, parameter=name
        )
        bound = _gradient_bound(case, expected, magnitudes[name])
        checks.close(
            f"d log_prob_from_pre_image / d {name}",
            jacobian,
            expected,
            bound,
            where=guaranteed,
            **grid.inputs(),
        )
    checks.done()


def _action_bound(grid: Grid, action):
    """``f(x)`` rounded: ``c + h tanh(x)`` (then clipped) cancels near the lower bound,
    so a few roundings of ``|c| + h``; the logistic sigmoid rounds relatively."""
    low, high = grid.low.astype(np.float64), grid.high.astype(np.float64)
    size = np.abs(action) if grid.case.k == 2 else np.abs(low + high) / 2 + (high - low) / 2
    # Below the smallest normal float the action flushes to zero.
    return ROUNDING * grid.case.eps * size + np.finfo(grid.case.dtype).tiny


def _samples(dist, key):
    """The sampled log-probability to differentiate, and the rest of the samples."""
    action, pre_image, log_prob = dist.sample_with_pre_image(seed=key)
    action_s, log_prob_s = dist.sample_and_log_prob(seed=key)
    eps = jax.random.normal(key, dist.loc.shape, dist.loc.dtype)
    return log_prob_s, (action, pre_image, log_prob, action_s, log_prob_s, eps)


@pytest.mark.parametrize("sweep", _sweeps(float32="Sigmoid"))
def test_samples_score_their_own_pre_image(sweep):
    """``sample_with_pre_image`` and ``sample_and_log_prob`` from the same key: the
    log-probability is that of the pre-image (16 ulps of its largest term), the action
    ``f`` of it; the gradient of the sampled log-probability with respect to ``loc`` and
    ``scale`` goes through the sample ``x = loc + scale eps`` (``dlogp/dx + dlogp/dloc``
    and ``eps dlogp/dx + dlogp/dscale``), ``eps`` being the standard normal draw
    ``jax.random.normal(key, shape)``, which the pre-image is checked to be built from.
    """
    case = sweep.case
    base = _grid(case, sweep.pairs)
    keys = jax.random.split(jax.random.key(7), base.loc.shape[0])
    args = (keys, base.loc, base.scale, base.low, base.high)
    outputs, jacobians = _library(case, _samples, *args, wrt=PARAMETERS[1:], aux=True)
    action, x, log_prob, action_s, log_prob_s, eps = outputs
    grid = Grid(case, base.loc, base.scale, x.astype(case.dtype))
    checks = Checks(case)
    loc64, scale64 = grid.loc.astype(np.float64), grid.scale.astype(np.float64)
    # Within the rounding of the product and the sum (XLA may fuse them).
    drawn = loc64 + scale64 * eps
    rounding = 2 * case.eps * (np.abs(loc64) + np.abs(scale64 * eps))
    checks.that(
        np.abs(drawn - x) <= rounding,
        "the pre-image is not loc + scale * jax.random.normal(key, shape)",
    )
    expected = grid.oracle(oracle.log_prob_pre_image_term, grid.value, grid.loc, grid.scale).sum(-1)
    bound = _pre_image_bound(grid, grid.oracle(oracle.log_abs_derivative, grid.value))
    expected_action = grid.oracle(oracle.forward, grid.value)
    action_bound = _action_bound(grid, expected_action)
    for what, got in (("sample_with_pre_image", log_prob), ("sample_and_log_prob", log_prob_s)):
        checks.close(f"{what} log_prob", got, expected, bound, **grid.inputs())
    for what, got in (("sample_with_pre_image", action), ("sample_and_log_prob", action_s)):
        checks.close(f"{what} action", got, expected_action, action_bound, **grid.inputs())
    partial = {
        name: grid.oracle(
            oracle.log_prob_pre_image_gradient, grid.value, grid.loc, grid.scale, parameter=name
        )
        for name in ("value", *jacobians)
    }
    expected = {
        "loc": partial["value"] + partial["loc"],
        "scale": eps * partial["value"] + partial["scale"],
        "low": partial.get("low"),
        "high": partial.get("high"),
    }
    sizes = _pre_image_gradient_magnitudes(grid)
    magnitudes = {
        "loc": sizes["value"] + sizes["loc"],
        "scale": np.abs(eps) * sizes["value"] + sizes["scale"],
        "low": sizes["low"],
        "high": sizes["high"],
    }
    guaranteed = np.abs(grid.value) <= case.squashing.gradient_limit
    for name, jacobian in jacobians.items():
        bound = _gradient_bound(case, expected[name], magnitudes[name])
        checks.close(
            f"d sample_and_log_prob / d {name}",
            jacobian,
            expected[name],
            bound,
            where=guaranteed,
            **grid.inputs(),
        )
    checks.done()


def _log_cdf_and_cdf(dist, value):
    return jnp.stack([dist.log_cdf(value), dist.cdf(value)])


@_magnitudes
def _log_cdf_magnitudes(grid: Grid, inside, log_phi):
    """The rounding bound on each dimension's ``log Phi(v)``, ``v = (x - loc) / scale``,
    the sizes of its derivatives, and ``dv / d parameter``, strictly inside.

    ``x`` is computed from the distances (about ``eps |x|``), so ``v`` is off by about
    ``eps u``, ``u = (|x| + |x - loc|) / scale``; with ``R = phi(v) / Phi(v)`` and
    ``|R'| = R |v + R|``, the value moves by ``R u`` roundings besides its own
    ``|log Phi|``, and the derivative with respect to ``loc`` (``-R / scale``) by
    ``|R'| u``. The others are it times ``v`` (scale), ``dx/dy`` (the action) and
    ``dx / d bound``.
    """
    case = grid.case
    x, to_low, to_high = _pre_image_and_distances(grid, inside)
    loc, scale = grid.loc.astype(np.float64), grid.scale.astype(np.float64)
    v = (x - loc) / scale
    mills = _inverse_mills(v)
    u = (np.abs(x) + np.abs(x - loc)) / scale
    size_loc = (mills + mills * np.abs(v + mills) * u) / scale
    sizes = {
        "loc": size_loc,
        "scale": size_loc * np.abs(v) + mills / scale * u,
        "value": size_loc * case.k * (1 / to_low + 1 / to_high) / 2,
        "high": size_loc * case.k / (2 * to_high),
        "low": size_loc * case.k / (2 * to_low),
    }
    # d v / d parameter: what multiplies log Phi's derivative in the chain rule.
    chain = {
        "loc": 1 / scale,
        "scale": np.abs(v) / scale,
        "value": case.k * (1 / to_low + 1 / to_high) / 2 / scale,
        "high": case.k / (2 * to_high) / scale,
        "low": case.k / (2 * to_low) / scale,
    }
    bound = ROUNDING * case.eps * (1 + np.abs(log_phi) + mills * u)
    zero = lambda a: np.where(inside, a, 0.0)  # noqa: E731
    return (
        zero(bound),
        {name: zero(size) for name, size in sizes.items()},
        {name: zero(factor) for name, factor in chain.items()},
    )


@pytest.mark.parametrize("sweep", _sweeps(float32="BoundedTanh(-0.1,0.3)"))
def test_cdf_and_log_cdf(sweep):
    """``log_cdf`` and ``cdf`` of actions inside, next to and on the bounds (exactly 0, 1
    or ``-inf`` there), with their gradients: those of ``log_cdf`` inside, those of
    ``cdf`` everywhere (0 where an action is on ``low``, the CDF being 0 around it)."""
    case = sweep.case
    grid = _grid(case, sweep.pairs, INSIDE_ROWS + BOUND_ROWS)
    got, jacobians = _library(
        case, _log_cdf_and_cdf, grid.value, grid.loc, grid.scale, grid.low, grid.high
    )
    positions = _positions(grid)
    inside = positions == oracle.INSIDE
    terms = grid.oracle(oracle.log_cdf_term, grid.value, grid.loc, grid.scale)
    log_cdf = terms.sum(-1)
    with np.errstate(under="ignore"):
        cdf = np.exp(log_cdf)
    term_bound, sizes, chain = _log_cdf_magnitudes(grid, inside, np.where(inside, terms, 0.0))
    row_bound = term_bound.sum(-1)
    tiny = np.finfo(case.dtype).tiny
    checks = Checks(case)
    checks.close("log_cdf", got[:, 0], log_cdf, row_bound, **grid.inputs())
    checks.close("cdf", got[:, 1], cdf, cdf * row_bound + tiny, **grid.inputs())
    on_low = np.any(positions == oracle.LOWER, axis=-1, keepdims=True)
    for name, jacobian in jacobians.items():
        expected = grid.oracle(
            oracle.log_cdf_gradient, grid.value, grid.loc, grid.scale, parameter=name
        )
        # On high the term is 0 whatever the parameters; a row with an action on low
        # has log_cdf = -inf, without a derivative: those rows are left out of it.
        expected = np.where(inside, expected, 0.0)
        bound = _gradient_bound(case, expected, sizes[name])
        # Far in the right tail the slope phi(z) / Phi(z) itself falls below the
        # smallest normal float and flushes to zero before the chain rule scales it
        # up: allowed as for the cdf below (infinite where the factor overflows).
        with np.errstate(over="ignore"):
            flushed = tiny * (1 + 8 * chain[name])
        checks.close(
            f"d log_cdf / d {name}",
            jacobian[:, 0],
            expected,
            bound + flushed,
            where=~on_low[:, 0],
            **grid.inputs(),
        )
        # A float holds the CDF, and each product on the way back through the chain
        # rule, only down to the smallest normal float (XLA flushes below it): the
        # derivative to that times the factors still to come, ``dv / d parameter`` and
        # constants of order one (such as the Normal density's sqrt(2 pi)), 8 at most.
        # A CDF of 0 (an action on low) makes the derivative 0 whatever the other
        # terms' slopes, infinite ones included: the products are selected away there.
        with np.errstate(invalid="ignore", over="ignore"):
            # (Where the CDF underflows, so does this product, up to the flush allowance.)
            expected_cdf = np.where(on_low | (cdf[:, None] == 0), 0.0, cdf[:, None] * expected)
            spread = np.abs(expected) * row_bound[:, None]
            bound_cdf = np.where(cdf[:, None] == 0, 0.0, cdf[:, None] * (bound + spread))
            bound_cdf += tiny * (1 + 8 * chain[name])
        checks.close(f"d cdf / d {name}", jacobian[:, 1], expected_cdf, bound_cdf, **grid.inputs())
    checks.done()


P_VALUES = (0.0, 1e-30, 1e-6, 0.1, 0.5, 0.9, 1 - 2.0**-24, 1.0)


def _quantile_grid(case: Case, pairs):
    """One-dimensional rows ``[N, 1]``, each dimension's bounds in turn, and ``p`` ``[N]``."""
    low, high = case.bounds()
    rows = [
        (loc, scale, p, low[i % ACTION_SIZE], high[i % ACTION_SIZE])
        for i, ((loc, scale), p) in enumerate(itertools.product(pairs, P_VALUES))
    ]
    column = lambda j: np.asarray([r[j] for r in rows], np.float64).astype(case.dtype)  # noqa: E731
    loc, scale, p, low, high = (column(j) for j in range(5))
    return loc[:, None], scale[:, None], p, low[:, None], high[:, None]


def _quantile(dist, p):
    return dist.quantile(p)


@pytest.mark.parametrize("sweep", _sweeps(float32="Tanh"))
def test_quantile(sweep):
    """``f(loc + scale Phi^-1(p))`` for a one-dimensional action; the bounds at 0 and 1,
    with the gradients documented there.

    Rounding: ``x = loc + scale z`` to ``eps X``, ``X = |loc| + scale (1 + 2 |z|)``
    (``Phi^-1`` itself a few roundings of ``z``), then ``f``: ``f'(x) eps X`` and
    the rounding of ``f``'s form (``|c| + h``; relative for the sigmoid).
    """
    case = sweep.case
    loc, scale, p, low, high = _quantile_grid(case, sweep.pairs)
    got, jacobians = _library(case, _quantile, p, loc, scale, low, high)
    k = case.k
    args = (p, loc[:, 0], scale[:, 0], low[:, 0], high[:, 0])
    expected = oracle.elementwise(oracle.quantile_term, *args, k=k)
    z = stats.norm.ppf(p.astype(np.float64))
    loc64, scale64, low64, high64 = (a[:, 0].astype(np.float64) for a in (loc, scale, low, high))
    interior = (p > 0) & (p < 1)
    x = np.where(interior, loc64 + scale64 * np.where(interior, z, 0.0), 0.0)
    half_range, centre = (high64 - low64) / 2, (high64 + low64) / 2
    slope = half_range / k * _sech2(x / k)
    spread = np.abs(loc64) + scale64 * (1 + 2 * np.abs(np.where(interior, z, 0.0)))
    form = np.abs(expected) if k == 2 else np.abs(centre) + half_range
    # Below the smallest normal float the action flushes to zero.
    tiny = np.finfo(case.dtype).tiny
    bound = np.where(interior, ROUNDING * case.eps * (form + slope * spread) + tiny, 0.0)
    inputs = {"loc": loc[:, 0], "scale": scale[:, 0], "p": p}
    checks = Checks(case)
    checks.close("quantile", got[:, 0], expected, bound, **inputs)
    # The derivatives: f'(x) (1, z, scale / phi(z)) and (1 +- tanh(x / k)) / 2, with
    # f'(x) moved by its log-derivative (2 / k) times the rounding of x.
    relative = 1 + 2 / k * spread
    density = stats.norm.pdf(np.where(interior, z, 0.0))
    sizes = {
        "loc": slope * relative,
        "scale": slope * (1 + np.abs(z) * relative),
        "value": slope * scale64 / density * (relative + np.abs(z) * (1 + np.abs(z))),
        "low": 1 + slope * spread / half_range,
        "high": 1 + slope * spread / half_range,
    }
    # A float holds f'(x), and its products on the way back through the chain rule,
    # only down to the smallest normal float: that much times the factors that may
    # still come, whichever order they are multiplied in (1 / phi(z) and scale for p,
    # z for scale), with constants of order one (8 at most), as for the CDF.
    chain = {
        "loc": 1,
        "scale": np.maximum(1, np.abs(z)),
        "value": np.maximum(1, scale64) / density,
        "low": 1,
        "high": 1,
    }
    for name, jacobian in jacobians.items():
        expected_gradient = oracle.elementwise(oracle.quantile_gradient, *args, k=k, parameter=name)
        got_gradient = jacobian[:, 0] if name == "value" else jacobian[:, 0, 0]
        bound = _gradient_bound(case, expected_gradient, sizes[name])
        bound = bound + 8 * np.finfo(case.dtype).tiny * np.where(interior, chain[name], 0.0)
        checks.close(
            f"d quantile / d {name}",
            got_gradient,
            expected_gradient,
            bound,
            where=interior,
            **inputs,
        )
        # At p = 0 and 1, as documented: 0 for loc and scale, 1 for that bound (0 for
        # the other), +inf for p.
        edges = {0.0: "low", 1.0: "high"}
        for edge, bound_name in edges.items():
            documented = {"loc": 0.0, "scale": 0.0, "value": np.inf, bound_name: 1.0}
            checks.close(
                f"d quantile / d {name} at p = {edge:g}",
                got_gradient,
                documented.get(name, 0.0),
                0.0,
                where=p == edge,
                **inputs,
            )
    checks.done()


def _moments(dist, value):
    return jnp.stack([dist.mean(), dist.variance()])


def _in_moment_range(case: Case, grid: Grid, variance):
    """Where the moments' documented bounds apply: ``scale / k`` in ``[1e-4, 10]``, means
    up to ``30 k``, and a variance of at least ``2e-31`` of the squared half range."""
    k = case.k
    half_range = (grid.high.astype(np.float64) - grid.low) / 2
    scale = grid.scale.astype(np.float64) / k
    return (
        (scale >= 1e-4)
        & (scale <= 10)
        & (np.abs(grid.loc.astype(np.float64)) <= 30 * k)
        & (variance >= 2e-31 * half_range**2)
    )


def _oracle_field(function, field):
    def pick(*args, **kwargs):
        return function(*args, **kwargs)[field]

    pick.__name__ = f"{function.__name__}[{field}]"
    return pick


@pytest.mark.parametrize("sweep", _sweeps(float32="Sigmoid"))
def test_mean_and_variance(sweep):
    """Within the bounds the moments document where they apply (the ``variance``
    docstring's, which the distribution guide repeats for float32): the mean within
    ``1e-6`` of the half range and the variance within ``1e-5`` relative in float32
    (``1e-12`` and ``1e-10`` in float64), for ``scale / k`` from 1e-4 to 10, means up to
    ``30 k``, and variances of at least ``2e-31`` of the squared half range. Elsewhere finite, the
    mean inside the range and the variance in ``[0, h**2]``. Each dimension's moments
    depend on its own parameters only (the Jacobians are diagonal)."""
    case = sweep.case
    grid = _grid(case, sweep.integral_pairs)
    got, jacobians = _library(
        case, _moments, grid.value, grid.loc, grid.scale, grid.low, grid.high, wrt=PARAMETERS[1:]
    )
    fields = ("mean", "variance", "mean_abs_derivative")
    expected = {
        f: grid.oracle(_oracle_field(oracle.moments_term, f), grid.loc, grid.scale) for f in fields
    }
    half_range = (grid.high.astype(np.float64) - grid.low) / 2
    centre = (grid.high.astype(np.float64) + grid.low) / 2
    in_range = _in_moment_range(case, grid, expected["variance"])
    mean_tolerance, variance_tolerance = (1e-6, 1e-5) if case.dtype == "float32" else (1e-12, 1e-10)
    inputs = grid.inputs()
    checks = Checks(case)
    mean, variance = got[:, 0], got[:, 1]
    checks.close(
        "mean (documented range)",
        mean,
        expected["mean"],
        mean_tolerance * half_range,
        where=in_range,
        **inputs,
    )
    checks.close(
        "variance (documented range)",
        variance,
        expected["variance"],
        variance_tolerance * expected["variance"],
        where=in_range,
        **inputs,
    )
    slack = 4 * case.eps * (np.abs(centre) + half_range)
    checks.that(np.isfinite(got), "mean or variance not finite")
    checks.that(
        (mean >= grid.low - slack) & (mean <= grid.high + slack),
        f"mean outside the range: {mean[(mean < grid.low - slack) | (mean > grid.high + slack)]}",
    )
    checks.that(
        (variance >= 0) & (variance <= half_range**2 * (1 + 4 * case.eps)),
        f"variance outside [0, h**2]: {variance[(variance < 0) | (variance > half_range**2)]}",
    )
    # Gradients, where the values are documented, against their natural sizes: for the
    # mean, (h / k) E[sech**2] (loc and scale) and 1 (the bounds); for the variance, by
    # Cauchy-Schwarz, 2 sd(Y) sd(dY / d parameter) <= 2 sqrt(Var) (h / k)
    # sqrt(E[sech**2]) (1 + |m| / s) (loc and scale) and 2 Var / h (the bounds).
    m, s = grid.loc.astype(np.float64) / case.k, grid.scale.astype(np.float64) / case.k
    mean_size = expected["mean_abs_derivative"]
    sech2 = mean_size / (half_range / case.k)
    spread_size = 2 * np.sqrt(expected["variance"] * sech2) * half_range / case.k
    sizes = {
        ("mean", "loc"): mean_size,
        ("mean", "scale"): mean_size,
        ("mean", "low"): 1.0,
        ("mean", "high"): 1.0,
        ("variance", "loc"): spread_size * (1 + np.abs(m) / s),
        ("variance", "scale"): spread_size * (1 + np.abs(m) / s),
        ("variance", "low"): 2 * expected["variance"] / half_range,
        ("variance", "high"): 2 * expected["variance"] / half_range,
    }
    for name, jacobian in jacobians.items():
        off_diagonal = jacobian * (1 - np.eye(ACTION_SIZE))
        checks.that(off_diagonal == 0, f"d moments / d {name} couples dimensions")
        for index, quantity in enumerate(("mean", "variance")):
            got_gradient = _diagonal(jacobian[:, index])
            expected_gradient = grid.oracle(
                _oracle_field(oracle.moments_term, f"{quantity}/{name}"), grid.loc, grid.scale
            )
            magnitude = np.abs(expected_gradient) + sizes[quantity, name]
            bound = _gradient_bound(case, expected_gradient, magnitude)
            checks.close(
                f"d {quantity} / d {name} (documented range)",
                got_gradient,
                expected_gradient,
                bound,
                where=in_range,
                **inputs,
            )
            checks.that(np.isfinite(got_gradient), f"d {quantity} / d {name} not finite")
    checks.done()


def _mode(dist, value):
    return dist.mode()


@pytest.mark.parametrize("sweep", SWEEPS)
def test_mode(sweep):
    """The most likely action per dimension; its gradients with respect to ``loc`` and
    ``scale`` are stopped (documented) and those with respect to the bounds are
    ``(1 +- tanh(x* / k)) / 2``.

    Rounding: the root ``t*`` of ``g(t) = t - |m| - 2 s**2 tanh(t)`` moves by ``eps
    (|t| + |m| + 2 s**2) / g'(t*)``; the action by ``h sech(t*)**2`` times that, plus the
    rounding of ``f``'s form.
    """
    case = sweep.case
    grid = _grid(case, sweep.pairs)
    got, jacobians = _library(
        case, _mode, grid.value, grid.loc, grid.scale, grid.low, grid.high, wrt=PARAMETERS[1:]
    )
    expected = grid.oracle(oracle.mode_term, grid.loc, grid.scale)
    x_star = oracle.elementwise(oracle.mode_pre_image_term, grid.loc, grid.scale, k=case.k)
    k = case.k
    t = x_star / k
    m, s = grid.loc.astype(np.float64) / k, grid.scale.astype(np.float64) / k
    pull = 2 * s**2
    steepness = 1 - pull * _sech2(t)
    movement = (np.abs(t) + np.abs(m) + pull) / steepness
    half_range = (grid.high.astype(np.float64) - grid.low) / 2
    centre = (grid.high.astype(np.float64) + grid.low) / 2
    form = np.abs(expected) if k == 2 else np.abs(centre) + half_range
    tiny = np.finfo(case.dtype).tiny  # below it the action flushes to zero
    bound = ROUNDING * case.eps * (form + half_range * _sech2(t) * movement) + tiny
    checks = Checks(case)
    checks.close("mode", got, expected, bound, **grid.inputs())
    for name, jacobian in jacobians.items():
        if name in ("loc", "scale"):
            checks.that(jacobian == 0, f"d mode / d {name} is not stopped")
            continue
        checks.that(
            jacobian * (1 - np.eye(ACTION_SIZE)) == 0, f"d mode / d {name} couples dimensions"
        )
        expected_gradient = grid.oracle(oracle.mode_gradient, grid.loc, grid.scale, parameter=name)
        magnitude = 1 + _sech2(t) * movement
        bound = _gradient_bound(case, expected_gradient, magnitude)
        checks.close(
            f"d mode / d {name}", _diagonal(jacobian), expected_gradient, bound, **grid.inputs()
        )
    checks.done()


def _entropy(dist, value):
    return dist.entropy()


@functools.cache
def _entropy_not_implemented() -> bool:
    dist = samplers.SquashedNormal(jnp.zeros(1), jnp.ones(1), samplers.Tanh())
    try:
        dist.entropy()
    except NotImplementedError:
        return True
    return False


# A string condition: pytest evaluates it when the test runs, not on import.
@pytest.mark.xfail(
    "_entropy_not_implemented()",
    raises=NotImplementedError,
    strict=False,
    reason="SquashedNormal.entropy() is not implemented for squashings",
)
@pytest.mark.parametrize("sweep", _sweeps(float32="Tanh"))
def test_entropy(sweep):
    """The exact entropy: in float64 within 1e-8 nats per dimension of the oracle for
    ``|loc| <= 1e3`` and std in ``[1e-6, 1e3]``, gradients within ``1e-6`` relative plus
    ``1e-8``; in float32 within ``1e-5 (1 + |H|)`` per dimension. Elsewhere finite."""
    case = sweep.case
    grid = _grid(case, sweep.integral_pairs)
    got, jacobians = _library(
        case, _entropy, grid.value, grid.loc, grid.scale, grid.low, grid.high, wrt=PARAMETERS[1:]
    )
    terms = grid.oracle(_oracle_field(oracle.entropy_term, "entropy"), grid.loc, grid.scale)
    loc, scale = grid.loc.astype(np.float64), grid.scale.astype(np.float64)
    in_range = np.all((np.abs(loc) <= 1e3) & (scale >= 1e-6) & (scale <= 1e3), axis=-1)
    if case.dtype == "float64":
        bound = np.full(got.shape, 1e-8 * ACTION_SIZE)
    else:
        bound = (1e-5 * (1 + np.abs(terms))).sum(-1)
    inputs = grid.inputs()
    checks = Checks(case)
    checks.close("entropy (documented range)", got, terms.sum(-1), bound, where=in_range, **inputs)
    checks.that(
        np.isfinite(got),
        f"entropy not finite at rows {np.argwhere(~np.isfinite(got))[:5].tolist()}",
    )
    # float32 gradients: the natural sizes 2 / k (loc), 1 / scale + (2 / k) s E[sech**2]
    # (scale) and 1 / (2 h) (bounds).
    moments = grid.oracle(
        _oracle_field(oracle.moments_term, "mean_abs_derivative"), grid.loc, grid.scale
    )
    half_range = (grid.high.astype(np.float64) - grid.low) / 2
    sech2 = moments / (half_range / case.k)
    sizes = {
        "loc": np.full(loc.shape, 2 / case.k),
        "scale": 1 / scale + 2 / case.k * scale / case.k * sech2,
        "low": 1 / (2 * half_range),
        "high": 1 / (2 * half_range),
    }
    for name, jacobian in jacobians.items():
        expected = grid.oracle(
            _oracle_field(oracle.entropy_term, f"entropy/{name}"), grid.loc, grid.scale
        )
        if case.dtype == "float64":
            bound = 1e-6 * np.abs(expected) + 1e-8
        else:
            bound = ROUNDING * case.eps * sizes[name]
        checks.close(
            f"d entropy / d {name} (documented range)",
            jacobian,
            expected,
            bound,
            where=in_range,
            **inputs,
        )
        checks.that(np.isfinite(jacobian), f"d entropy / d {name} not finite")
    checks.done()


# q's parameters from p's: equal, shifted, a std one float32 step off (the expm1
# form's case), and far apart.
Q_FROM_P = ((0.0, 1.0), (0.5, 1.0), (0.0, 1 + 2.0**-20), (-3.0, 0.5), (60.0, 4.0))


def _kl(dist, q_parameters):
    bijector = dist.bijector.bijector
    q = samplers.SquashedNormal(q_parameters[0], q_parameters[1], bijector)
    return dist.kl_divergence(q)


@pytest.mark.parametrize("sweep", SWEEPS)
def test_kl_divergence(sweep):
    """``dist.kl_divergence(q)`` for the same bijector: the base Normals' KL, with its
    gradients with respect to both distributions' parameters, and none (exactly 0) with
    respect to the shared bounds.

    Rounding: the terms ``|expm1(2 t)|``, ``2 |t|`` and ``z**2`` (``t = log(s_p / s_q)``,
    ``z = (m_p - m_q) / s_q``), with ``t`` off by ``eps (|log s_p| + |log s_q|)``.
    """
    case = sweep.case
    base = _grid(case, sweep.pairs)
    rows = len(Q_FROM_P)
    loc_p, scale_p = np.repeat(base.loc, rows, 0), np.repeat(base.scale, rows, 0)
    shift = np.tile(np.asarray([q[0] for q in Q_FROM_P]), base.loc.shape[0])[:, None]
    ratio = np.tile(np.asarray([q[1] for q in Q_FROM_P]), base.loc.shape[0])[:, None]
    loc_q = (loc_p.astype(np.float64) + shift).astype(case.dtype)
    scale_q = (scale_p.astype(np.float64) * ratio).astype(case.dtype)
    q_parameters = np.stack([loc_q, scale_q], axis=1)
    grid = Grid(case, loc_p, scale_p, loc_q)
    got, jacobians = _library(case, _kl, q_parameters, loc_p, scale_p, grid.low, grid.high)
    args = (loc_p, scale_p, loc_q, scale_q)
    expected = oracle.elementwise(oracle.kl_term, *args)
    lp, sp, lq, sq = (a.astype(np.float64) for a in args)
    t = np.log(sp / sq)
    z = (lp - lq) / sq
    logs = np.abs(np.log(sp)) + np.abs(np.log(sq))
    rho2 = (sp / sq) ** 2
    terms = np.abs(np.expm1(2 * t)) + 2 * np.abs(t) + z**2 + 4 * np.abs(t) * logs
    inputs = {"loc_p": loc_p, "scale_p": scale_p, "loc_q": loc_q, "scale_q": scale_q}
    checks = Checks(case)
    checks.close("kl", got, expected.sum(-1), (ROUNDING * case.eps * terms / 2).sum(-1), **inputs)
    # d/dm_p = -d/dm_q = (m_p - m_q) / s_q**2; d/ds_p = (rho**2 - 1) / s_p and
    # d/ds_q = (1 - rho**2 - z**2) / s_q, rho**2 = exp(2 t) moved by 2 rho**2 |dt|.
    sizes = {
        "loc_p": np.abs(z) / sq,
        "scale_p": (rho2 + 1 + 2 * rho2 * logs) / sp,
        "loc_q": np.abs(z) / sq,
        "scale_q": (1 + rho2 * (1 + 2 * logs) + z**2) / sq,
    }
    derivatives = {"loc": ("loc_p",), "scale": ("scale_p",), "value": ("loc_q", "scale_q")}
    for name, jacobian in jacobians.items():
        if name in ("low", "high"):
            checks.that(jacobian == 0, f"d kl / d {name} is not 0")
            continue
        for position, parameter in enumerate(derivatives[name]):
            got_gradient = jacobian[:, position] if name == "value" else jacobian
            expected_gradient = oracle.elementwise(oracle.kl_gradient, *args, parameter=parameter)
            bound = _gradient_bound(case, expected_gradient, sizes[parameter])
            checks.close(f"d kl / d {parameter}", got_gradient, expected_gradient, bound, **inputs)
    checks.done()
