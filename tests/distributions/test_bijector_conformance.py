"""distrax's contracts for scalar bijectors, checked on this package's bijectors.

In the style of distrax's own bijector tests (``tanh_test.py``,
``scalar_affine_test.py``, ``block_test.py``, ``chain_test.py``,
``inverse_test.py``): ``same_as`` is reflexive and value-based, also through
``Block``, ``Chain`` and ``Inverse``, and ``BoundedTanh`` broadcasts its bounds
and promotes dtypes exactly as ``Chain([ScalarAffine(center, half_range), Tanh()])``,
the oracle, over shapes, with and without ``jit``, and under ``vmap``.
"""

import distrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import samplers
from samplers.distributions.bijectors import same_map
from tests._tiers import each_value_once

LOW = np.array([-2.0, 0.0, -0.1], np.float32)
HIGH = np.array([2.0, 1.0, 0.3], np.float32)


def _chain(low, high):
    """The oracle: distrax's affine map after distrax's tanh, from the same bounds."""
    low, high = jnp.asarray(low), jnp.asarray(high)
    return distrax.Chain([distrax.ScalarAffine((high + low) / 2, (high - low) / 2), distrax.Tanh()])


def _weak(value):
    """A Python float, weakly typed as a bound given as a number is."""
    return float(value)


class _SubTanh(samplers.Tanh):
    pass


# --- same_as -----------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [samplers.Tanh, samplers.Sigmoid, lambda: samplers.BoundedTanh(LOW, HIGH)],
    ids=["Tanh", "Sigmoid", "BoundedTanh"],
)
def test_same_as_is_reflexive_and_holds_for_a_new_equal_instance(make):
    bijector = make()
    assert bijector.same_as(bijector)
    assert bijector.same_as(make())
    for wrap in (lambda b: distrax.Block(b, 1), lambda b: distrax.Chain([b]), distrax.Inverse):
        assert wrap(bijector).same_as(wrap(make()))


def test_same_as_accepts_distrax_s_class_and_refuses_other_maps():
    assert samplers.Tanh().same_as(distrax.Tanh())
    assert samplers.Sigmoid().same_as(distrax.Sigmoid())
    assert not samplers.Tanh().same_as(distrax.Sigmoid())
    assert not samplers.Sigmoid().same_as(samplers.Tanh())
    # Both declare the squashing onto [-1, 1] with pre-image scale 1: the same map.
    assert samplers.Tanh().same_as(samplers.BoundedTanh(-1.0, 1.0))
    assert samplers.BoundedTanh(-1.0, 1.0).same_as(samplers.Tanh())
    assert not samplers.Sigmoid().same_as(samplers.BoundedTanh(0.0, 1.0))
    # distrax's own same_as accepts only its own class: not ours to change.
    assert not distrax.Tanh().same_as(samplers.Tanh())


def test_same_as_of_a_subclass_follows_whether_it_changes_the_map():
    # A subclass that leaves the map alone inherits the declared squashing ...
    assert samplers.Tanh().same_as(_SubTanh())
    assert _SubTanh().same_as(samplers.Tanh())
    assert same_map(_SubTanh(), distrax.Tanh())

    # ... one that changes it without declaring its own squashing is not known.
    class Shifted(samplers.Tanh):
        def forward(self, x):
            return super().forward(x) + 1.0

    assert not samplers.Tanh().same_as(Shifted())
    assert not Shifted().same_as(samplers.Tanh())
    assert not same_map(Shifted(), distrax.Tanh())


def test_bounded_tanh_same_as_compares_bounds_by_value():
    bijector = samplers.BoundedTanh(LOW, HIGH)
    assert bijector.same_as(samplers.BoundedTanh(LOW.copy(), HIGH.copy()))
    assert bijector.same_as(samplers.BoundedTanh(list(LOW), list(HIGH)))
    assert samplers.BoundedTanh(-2.0, 2.0).same_as(
        samplers.BoundedTanh(jnp.full(3, -2.0), jnp.full(3, 2.0))
    )
    assert not bijector.same_as(samplers.BoundedTanh(LOW, HIGH + np.float32(0.5)))
    assert not bijector.same_as(samplers.BoundedTanh(LOW - np.float32(0.5), HIGH))
    assert not bijector.same_as(samplers.BoundedTanh(jnp.full(2, -2.0), jnp.full(2, 2.0)))
    equal, other = samplers.BoundedTanh(LOW, HIGH), samplers.BoundedTanh(LOW, HIGH + 1)
    assert distrax.Block(bijector, 1).same_as(distrax.Block(equal, 1))
    assert not distrax.Block(bijector, 1).same_as(distrax.Block(other, 1))
    assert not distrax.Chain([bijector, samplers.Tanh()]).same_as(
        distrax.Chain([other, samplers.Tanh()])
    )
    assert distrax.Chain([bijector, samplers.Tanh()]).same_as(
        distrax.Chain([equal, distrax.Tanh()])
    )
    assert not distrax.Inverse(bijector).same_as(distrax.Inverse(other))


@pytest.mark.parametrize(
    "f, g, expected",
    [
        (samplers.Tanh(), distrax.Tanh(), True),
        (samplers.Sigmoid(), distrax.Sigmoid(), True),
        (samplers.Tanh(), distrax.Sigmoid(), False),
        (
            samplers.BoundedTanh(-2.0, 2.0),
            samplers.BoundedTanh(jnp.full(3, -2.0), jnp.full(3, 2.0)),
            True,
        ),
        (samplers.BoundedTanh(-2.0, 2.0), samplers.BoundedTanh(-2.0, 3.0), False),
        (distrax.ScalarAffine(0.0, 1.0), samplers.Tanh(), False),
    ],
    ids=["Tanh", "Sigmoid", "Tanh-Sigmoid", "equal-bounds", "other-bounds", "affine-Tanh"],
)
def test_same_map_answers_both_orders_alike(f, g, expected):
    assert same_map(f, g) is same_map(g, f) is expected


def test_same_as_with_traced_bounds_is_false_and_same_map_compares_at_run_time():
    def compare(low_a, low_b):
        a, b = samplers.BoundedTanh(low_a, low_a + 2), samplers.BoundedTanh(low_b, low_a + 2)
        assert a.same_as(a)
        assert a.same_as(samplers.BoundedTanh(a.low, a.high))  # the same arrays
        assert not a.same_as(b)  # not guaranteed at trace time
        return same_map(a, b)

    assert bool(jax.jit(compare)(jnp.float32(-1.0), jnp.float32(-1.0)))
    assert not bool(jax.jit(compare)(jnp.float32(-1.0), jnp.float32(-1.5)))
    per_dimension = jax.jit(compare)(jnp.array([-1.0, 0.0]), jnp.array([-1.0, 1.0]))
    np.testing.assert_array_equal(per_dimension, [True, False])


# --- BoundedTanh against the distrax Chain -------------------------------------

# (bounds shape, input shape): distrax's batched-parameter cases, plus the action axis.
SHAPES = [
    ((), ()),
    ((), (3,)),
    ((), (4, 3)),
    ((3,), ()),
    ((3,), (1,)),
    ((3,), (3,)),
    ((3,), (2, 1)),
    ((3,), (4, 3)),
    ((3,), (2, 4, 3)),
]
SHAPE_IDS = [f"bounds{b}-input{x}" for b, x in SHAPES]


def _bounds(shape):
    return (LOW, HIGH) if shape else (np.float32(-0.5), np.float32(1.5))


@pytest.mark.parametrize("bounds_shape, input_shape", SHAPES, ids=SHAPE_IDS)
def test_forward_and_log_det_match_the_chain_in_value_shape_and_dtype(
    bounds_shape, input_shape, maybe_jit
):
    low, high = _bounds(bounds_shape)
    x = 2.0 * jax.random.normal(jax.random.key(0), input_shape)
    ours, oracle = samplers.BoundedTanh(low, high), _chain(low, high)
    expected_shape = jnp.broadcast_shapes(bounds_shape, input_shape)
    for method in ("forward", "forward_log_det_jacobian", "forward_and_log_det"):
        got = maybe_jit(getattr(ours, method))(x)
        want = getattr(oracle, method)(x)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert a.shape == b.shape == expected_shape
            assert a.dtype == b.dtype
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bounds_shape, input_shape", SHAPES, ids=SHAPE_IDS)
def test_inverse_and_log_det_match_the_chain_in_value_shape_and_dtype(
    bounds_shape, input_shape, maybe_jit
):
    low, high = _bounds(bounds_shape)
    oracle = _chain(low, high)
    # Actions strictly inside the bounds, of the broadcast shape.
    u = jax.random.uniform(jax.random.key(1), input_shape, minval=-0.95, maxval=0.95)
    y = oracle.forward(jnp.arctanh(u))
    ours = samplers.BoundedTanh(low, high)
    for method in ("inverse", "inverse_log_det_jacobian", "inverse_and_log_det"):
        got = maybe_jit(getattr(ours, method))(y)
        want = getattr(oracle, method)(y)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert a.shape == b.shape == y.shape
            assert a.dtype == b.dtype
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [np.int16, np.int32, np.int64], ids=["int16", "int32", "int64"])
def test_integer_inputs_become_float_as_in_the_chain(dtype, maybe_jit):
    x = np.array([0, 1, -2], dtype)
    y, log_det = maybe_jit(samplers.BoundedTanh(LOW, HIGH).forward_and_log_det)(x)
    want_y, want_log_det = _chain(LOW, HIGH).forward_and_log_det(x)
    assert y.dtype == want_y.dtype == jnp.float32
    assert log_det.dtype == want_log_det.dtype == jnp.float32
    np.testing.assert_allclose(y, want_y, rtol=1e-6)
    np.testing.assert_allclose(log_det, want_log_det, rtol=1e-5)


@pytest.mark.parametrize(
    *each_value_once(
        {
            "bounds": {b: b for b in ["number", "float32", "float16"]},
            "input_dtype": {
                "float16": jnp.float16,
                "bfloat16": jnp.bfloat16,
                "float32": jnp.float32,
            },
        }
    )
)
def test_dtypes_are_jax_promotion_of_input_and_bounds_as_in_the_chain(bounds, input_dtype):
    low, high = {
        "number": (_weak(-2.0), _weak(2.0)),
        "float32": (LOW, HIGH),
        "float16": (LOW.astype(np.float16), HIGH.astype(np.float16)),
    }[bounds]
    x = jnp.array([0.0, 0.5, -1.0], input_dtype)
    ours, oracle = samplers.BoundedTanh(low, high), _chain(low, high)
    y = oracle.forward(x)
    for got, want in (
        (ours.forward_and_log_det(x), oracle.forward_and_log_det(x)),
        (ours.inverse_and_log_det(y), oracle.inverse_and_log_det(y)),
    ):
        assert [a.dtype for a in got] == [b.dtype for b in want]
    assert ours.forward(x).dtype == jnp.result_type(x, jnp.asarray(low))


def test_under_x64_a_float32_input_stays_float32_unless_the_bounds_are_float64():
    with jax.enable_x64(True):
        x32 = jnp.array([0.0, 0.5, -1.0], jnp.float32)
        x64 = x32.astype(jnp.float64)
        cases = {
            "number": ((_weak(-2.0), _weak(2.0)), jnp.float32),
            "float32": ((jnp.asarray(LOW), jnp.asarray(HIGH)), jnp.float32),
            "float64": ((LOW.astype(np.float64), HIGH.astype(np.float64)), jnp.float64),
        }
        for (low, high), expected in cases.values():
            ours, oracle = samplers.BoundedTanh(low, high), _chain(low, high)
            for got, want in (
                (ours.forward_and_log_det(x32), oracle.forward_and_log_det(x32)),
                (ours.inverse_and_log_det(x32 / 4), oracle.inverse_and_log_det(x32 / 4)),
            ):
                assert [a.dtype for a in got] == [b.dtype for b in want] == [expected] * 2
            assert ours.forward(x64).dtype == jnp.float64
        for bijector in (samplers.Tanh(), samplers.Sigmoid(), distrax.Tanh()):
            assert bijector.forward(x32).dtype == jnp.float32
            assert bijector.forward_log_det_jacobian(x32).dtype == jnp.float32
    assert jnp.asarray(1.0).dtype == jnp.float32  # the context did not leak


# --- jit and vmap --------------------------------------------------------------


def test_jittable_as_an_argument():
    # distrax's test_jittable: the bijector is a pytree argument of a jitted function.
    @jax.jit
    def forward_and_log_det(x, bijector):
        return bijector.forward_and_log_det(x)

    x = 3.0 * jax.random.normal(jax.random.key(2), (5, 3))
    for bijector in (samplers.Tanh(), samplers.Sigmoid(), samplers.BoundedTanh(LOW, HIGH)):
        got, want = forward_and_log_det(x, bijector), bijector.forward_and_log_det(x)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def _stacked_bounds(n):
    keys = jax.random.split(jax.random.key(3), 3)
    low = jax.random.uniform(keys[0], (n, 3), minval=-3.0, maxval=0.0)
    high = low + jax.random.uniform(keys[1], (n, 3), minval=0.1, maxval=3.0)
    x = 2.0 * jax.random.normal(keys[2], (n, 4, 3))
    return low, high, x


def _member_by_member(low, high, x):
    results = [_chain(low[i], high[i]).forward_and_log_det(x[i]) for i in range(len(x))]
    return tuple(jnp.stack(r) for r in zip(*results, strict=True))


def test_vmap_of_a_bounded_tanh_built_inside_from_stacked_bounds():
    low, high, x = _stacked_bounds(5)

    def member(low, high, x):
        return samplers.BoundedTanh(low, high).forward_and_log_det(x)

    for transform in (jax.vmap, lambda f: jax.jit(jax.vmap(f))):
        got = transform(member)(low, high, x)
        for a, b in zip(got, _member_by_member(low, high, x), strict=True):
            assert a.shape == b.shape == (5, 4, 3)
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_vmap_over_a_stacked_bijector():
    low, high, x = _stacked_bounds(5)
    stacked = jax.vmap(samplers.BoundedTanh)(low, high)
    assert stacked.low.shape == (5, 3)
    got = jax.vmap(lambda bijector, x: bijector.forward_and_log_det(x))(stacked, x)
    for a, b in zip(got, _member_by_member(low, high, x), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_batched_parameters_act_elementwise():
    # distrax's scalar_affine test_batched_parameters: each output element is the
    # scalar bijector with that element's bounds applied to that element's input.
    x = 2.0 * jax.random.normal(jax.random.key(4), (2, 1))
    y, log_det = samplers.BoundedTanh(LOW, HIGH).forward_and_log_det(x)
    assert y.shape == log_det.shape == (2, 3)
    for i in range(2):
        for j in range(3):
            scalar = samplers.BoundedTanh(LOW[j], HIGH[j])
            this_y, this_log_det = scalar.forward_and_log_det(x[i, 0])
            np.testing.assert_allclose(this_y, y[i, j], rtol=1e-6)
            np.testing.assert_allclose(this_log_det, log_det[i, j], rtol=1e-6)


# --- Tanh and Sigmoid against distrax's -------------------------------------------


@pytest.mark.parametrize(
    *each_value_once(
        {
            "ours, theirs": {
                "Tanh": (samplers.Tanh(), distrax.Tanh()),
                "Sigmoid": (samplers.Sigmoid(), distrax.Sigmoid()),
            },
            "dtype": {"float16": jnp.float16, "float32": jnp.float32, "int32": jnp.int32},
            "shape": {str(shape): shape for shape in [(), (2,), (2, 3), (2, 3, 4)]},
        }
    )
)
def test_tanh_and_sigmoid_keep_the_input_s_shape_and_dtype_as_distrax(ours, theirs, shape, dtype):
    x = (2 * jax.random.normal(jax.random.key(7), shape)).astype(dtype)
    if isinstance(theirs, distrax.Sigmoid) and dtype == jnp.int32:
        # jax.nn.sigmoid takes no integers, in distrax's Sigmoid as in ours.
        for bijector in (ours, theirs):
            with pytest.raises(TypeError, match="logistic does not accept dtype int32"):
                bijector.forward_and_log_det(x)
        return
    y = theirs.forward(x)
    for got, want in (
        (ours.forward_and_log_det(x), theirs.forward_and_log_det(x)),
        (ours.inverse_and_log_det(y), theirs.inverse_and_log_det(y)),
    ):
        for a, b in zip(got, want, strict=True):
            assert a.shape == b.shape == shape
            assert a.dtype == b.dtype
            np.testing.assert_allclose(a, b, rtol=2e-3, atol=2e-3)
