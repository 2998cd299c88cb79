"""What the test files share: network outputs, key counts, a head's outputs by name, one
traced call of a head, the squashings and their cases, and the hypothesis strategy of a
squashed Normal's parameters over the guarantees' ranges.

Written once here and imported; a helper that makes something particular to one
file stays in that file, under a name that says what it makes.
"""

import functools

import distrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import samplers
from tests._tiers import SLOW


def normal_inputs(batch_shape, width, *, scale=1.0, seed=0):
    """A network output ``[*batch_shape, width]``: ``scale`` times standard Normal
    entries drawn from ``jax.random.key(seed)``."""
    return scale * jax.random.normal(jax.random.key(seed), (*batch_shape, width))


def keys_drawn(module):
    """How many keys ``module`` (a head, or an ``nnx.Rngs``) has drawn, all streams
    together."""
    return sum(int(count) for count in jax.tree.leaves(nnx.state(module, nnx.RngCount)))


# A squashed-Normal head's outputs that tests compare, by name (``normal_head_outputs``).
NORMAL_HEAD_FIELDS = (
    "action",
    "log_likelihood",
    "rollout_extras",
    "regularization_loss",
    "mu",
    "sigma",
)


def head_outputs(out):
    """A head's action, log-likelihood, rollout extras and regularization loss, by name."""
    return {
        "action": out.output["action"],
        "log_likelihood": out.output["log_likelihood"],
        "rollout_extras": out.rollout_extras,
        "regularization_loss": out.regularization_loss,
    }


def normal_head_outputs(out):
    """The ``NORMAL_HEAD_FIELDS`` of a squashed-Normal head's output, by name."""
    return {**head_outputs(out), "mu": out.metrics["mu"], "sigma": out.metrics["sigma"]}


def clones_of(make):
    """A function that returns a new clone of the one head ``make()`` builds. Clones
    share its static configuration (a bijector or bounds, compared by identity), so that
    ``nnx.jit`` compiles each program once for all of them."""
    template = functools.cache(make)
    return lambda: nnx.clone(template())


# Every trace of ``jitted_call``: a test compares its length before and after calls.
TRACES = []


@functools.partial(nnx.jit, static_argnames=("deterministic",))
def jitted_call(head, state, inputs, extras=None, mask=None, deterministic=None):
    """``head(state, inputs, extras, mask=mask, deterministic=deterministic)`` under
    ``nnx.jit``, one function for every test, so that tests with the same head and
    shapes share its programs."""
    TRACES.append(None)
    return head(state, inputs, extras, mask=mask, deterministic=deterministic)


eager_call = jitted_call.__wrapped__


def stateless_call(jitted):
    """``head((), inputs, extras)`` for a head without a carry state, under ``nnx.jit``
    (``jitted_call``) or eagerly."""
    run = jitted_call if jitted else eager_call
    return lambda head, *args: run(head, (), *args)


# The squashings the guarantees name: Tanh (``normal_tanh``, ``NormalTanhSampler``),
# ``BoundedTanh``, ``samplers.Sigmoid()`` and the identity.
SQUASHING_KINDS = ["tanh", "bounded", "sigmoid", "identity"]

# One instance: nnx.jit treats the Lambda's function as static, a new one retraces.
IDENTITY = distrax.Lambda(lambda x: x)


def squashing(kind, bounds):
    """The bijector of a ``SQUASHING_KINDS`` kind other than ``"tanh"`` (the bounds
    ``(low, high)`` are a ``"bounded"`` one's)."""
    if kind == "bounded":
        return samplers.BoundedTanh(*bounds)
    if kind == "sigmoid":
        return samplers.Sigmoid()
    return IDENTITY


# Means and raw stds are drawn in [-LIMIT, LIMIT], std_scale from [STD_SCALE_FLOOR, 10]
# (smaller ones are only reached by pinned cases), and the float32 std is kept at or
# above STD_FLOOR (below it the gradient with respect to the std exceeds float32).
LIMIT = 1e3
STD_FLOOR = 1e-36
STD_SCALE_FLOOR = 1e-30
MIN_STDS = st.floats(0.0, 1.0)


def float32_at_least(value: float) -> float:
    """The smallest float32 that is >= ``value``, as a Python float."""
    rounded = np.float32(value)
    if rounded < value:
        rounded = np.nextafter(rounded, np.float32(np.inf))
    return float(rounded)


def softplus_inverse(y: float) -> float:
    """The raw std whose softplus is ``y``."""
    return float(y + np.log(-np.expm1(-y)))


@st.composite
def squashed_normal_parameters(
    draw,
    batch_shape,
    *,
    action_dim,
    mean_limit=LIMIT,
    raw_limit=LIMIT,
    min_stds=MIN_STDS,
    std_scales=None,
    std_floor=STD_FLOOR,
):
    """``(mean_and_std, min_std, std_scale)`` whose float32 std is at least ``std_floor``.

    ``std_scale`` is drawn from ``[1e-30, 10]``, raised to where the floor is
    reachable at all; the lowest raw std is raised where ``min_std * std_scale``
    alone is below the floor (twice the floor, so that float32 rounding of the std
    cannot cross it).
    """
    min_std = draw(min_stds)
    if std_scales is None:
        reachable = 4 * std_floor / np.logaddexp(raw_limit, 0.0)
        std_scales = st.floats(max(STD_SCALE_FLOOR, reachable), 10.0)
    std_scale = draw(std_scales)
    shortfall = 2 * std_floor / std_scale - min_std
    raw_low = -LIMIT if shortfall <= 0 else max(-LIMIT, softplus_inverse(shortfall))
    shape = (*batch_shape, action_dim)
    mean = draw(
        hnp.arrays(np.float32, shape, elements=st.floats(-mean_limit, mean_limit, width=32))
    )
    raw_std = draw(
        hnp.arrays(
            np.float32,
            shape,
            elements=st.floats(float32_at_least(raw_low), raw_limit, width=32),
        )
    )
    return np.concatenate([mean, raw_std], axis=-1), min_std, std_scale


# The squashings ``SquashedNormal`` scores from the distances to its bounds, with ``k``, the
# scale of their pre-image (``tanh(x / k)``): a case's parameters are ``k`` times tanh's.
SQUASHINGS_AND_K = {
    "samplers.Tanh": (samplers.Tanh(), 1.0),
    "distrax.Tanh": (distrax.Tanh(), 1.0),
    "BoundedTanh[-0.1,0.3]": (samplers.BoundedTanh(-0.1, 0.3), 1.0),
    "BoundedTanh[-2,3]": (samplers.BoundedTanh(jnp.array([-2.0, 0.0]), jnp.array([3.0, 1.0])), 1.0),
    "samplers.Sigmoid": (samplers.Sigmoid(), 2.0),
    "distrax.Sigmoid": (distrax.Sigmoid(), 2.0),
}


def squashing_and_k_cases(*default):
    """``(bijector, k)`` of every ``SQUASHINGS_AND_K`` entry as ``parametrize`` cases, those
    not named in ``default`` slow."""
    return [
        pytest.param(*value, id=name, marks=[] if name in default else [SLOW])
        for name, value in SQUASHINGS_AND_K.items()
    ]


def squashing_bounds_float64(bijector):
    """A ``SQUASHINGS_AND_K`` bijector's ``(low, high)``, float64, one per action dimension
    of the two."""
    bounds = samplers.distributions.bijectors.squashing(bijector)
    low, high = (np.broadcast_to(np.asarray(b, np.float64), (2,)) for b in bounds[:2])
    return low, high


# ``(loc, log_std)`` in units of ``k``, ``[4, 2]``: means that saturate (|x| of 10 k and more,
# float32 f(x) on a bound) and that do not.
SATURATING_LOC = np.array([[10.0, 0.3], [2.0, -12.0], [-0.5, 25.0], [0.0, 1.0]], np.float32)
SATURATING_LOG_STD = np.array([[-3.0, 2.0], [2.0, -3.0], [0.0, -1.0], [-20.0, 0.5]], np.float32)
