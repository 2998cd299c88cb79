"""Checking a hand-written squashed-Gaussian log-likelihood against references.

Implementations of ``log p(tanh(x))`` often get the Jacobian term wrong: they drop
``log(half_range)`` when the bounds are not ``[-1, 1]``, or write
``log(1 - tanh(x)**2)``, which is ``-inf`` once float32 ``tanh`` rounds to 1.
:func:`cross_check` evaluates a user's function on a grid that reaches into the
saturated regime and reports where it disagrees with this library, a float64
closed form, ``distrax`` and TensorFlow Probability.
"""

import dataclasses
import itertools
import math
from collections.abc import Callable

import distrax
import jax.numpy as jnp
import numpy as np
from jaxtyping import ArrayLike, Float
from tensorflow_probability.substrates import jax as tfp

from samplers import _checks
from samplers.distributions.bijectors import BoundedTanh, Tanh
from samplers.distributions.squashed_normal import SquashedNormal

# Pre-images from the centre to deep saturation (float32 tanh is +-1 from |x| ~ 8),
# means and stds a policy head produces.
_PRE_IMAGES = (
    -1e3, -50.0, -20.0, -12.0, -9.0, -8.0, -5.0, -2.0, -0.5,
    0.0, 0.7, 3.0, 7.0, 8.5, 10.0, 20.0, 50.0, 1e3,
)  # fmt: skip
_MEANS = (-2.0, 0.0, 1.5)
_STDS = (0.1, 1.0, 4.0)
_ACTION_DIM = 3
# Dimension d takes the grid point d * _SHIFT further on: its pre-image, mean and std
# indices each move by 1 (2 with a carry), so neighbouring dimensions differ in all three.
_SHIFT = len(_MEANS) * len(_STDS) + len(_STDS) + 1


@dataclasses.dataclass(frozen=True)
class Disagreement:
    """The worst disagreement with one reference over the grid.

    Attributes:
        reference: Its name.
        scores: What it scores: ``"pre-image"``, or ``"action"`` for references
            that invert the squashing.
        max_abs_error: The largest ``|user - reference|`` over the points where the
            reference is finite (``inf`` where the user's value is not finite).
        pre_image: The pre-tanh value of the worst point in the first action
            dimension (the other dimensions hold other grid values).
        mean: The mean there, in the first action dimension.
        std: The std there, in the first action dimension.
        compared: Points where the reference is finite.
        skipped: Points where it is not (``distrax`` and TFP invert the
            saturated action and return NaN or infinity).
    """

    reference: str
    scores: str
    max_abs_error: float
    pre_image: float
    mean: float
    std: float
    compared: int
    skipped: int


@dataclasses.dataclass(frozen=True)
class CrossCheckReport:
    """What :func:`cross_check` found: one :class:`Disagreement` per reference.

    Attributes:
        rows: ``float64``, ``samplers``, ``distrax`` and ``tfp``, in that order.
        passed: Whether the function is finite and within ``atol + rtol * |ref|``
            of the float64 closed form at every grid point. The action-based
            references (``distrax``, ``tfp``) are shown, not judged: they lose
            digits near the bounds themselves.
        atol: The absolute tolerance used.
        rtol: The relative tolerance used.
    """

    rows: tuple[Disagreement, ...]
    passed: bool
    atol: float
    rtol: float

    def __getitem__(self, reference: str) -> Disagreement:
        """The row for ``reference`` (``"float64"``, ``"samplers"``, ...)."""
        for row in self.rows:
            if row.reference == reference:
                return row
        raise KeyError(
            f"no reference {reference!r}; the references are "
            f"{[row.reference for row in self.rows]}."
        )

    def __str__(self) -> str:
        header = (
            f"{'reference':<10} {'scores':<9} {'max |error|':>12} {'at x':>7} {'mean':>6} "
            f"{'std':>5} {'compared':>9} {'skipped':>8}"
        )
        lines = [header, "-" * len(header)]
        for row in self.rows:
            lines.append(
                f"{row.reference:<10} {row.scores:<9} {row.max_abs_error:>12.4g} "
                f"{row.pre_image:>7g} {row.mean:>6g} {row.std:>5g} {row.compared:>9d} "
                f"{row.skipped:>8d}"
            )
        verdict = "PASSED" if self.passed else "FAILED"
        lines.append(f"{verdict} against float64 (atol={self.atol:g}, rtol={self.rtol:g})")
        return "\n".join(lines)


def cross_check(
    log_prob_fn: Callable,
    *,
    low: Float[ArrayLike, "*action"] | None = None,
    high: Float[ArrayLike, "*action"] | None = None,
    action_dim: int | None = None,
    atol: float = 1e-3,
    rtol: float = 1e-5,
) -> CrossCheckReport:
    """Compares a user's log-likelihood of a tanh-squashed Normal with references.

    ``log_prob_fn(pre_image, mean, std)`` must return ``log p(y)`` for the action
    ``y = center + half_range * tanh(pre_image)`` of a diagonal Normal pushed
    through tanh onto ``[low, high]``, summed over the last axis: float32 inputs of
    shape ``[N, A]``, output ``[N]``. It takes the pre-image, not the action,
    because the action of a saturated sample does not determine it; a function
    that scores actions can be wrapped as ``lambda x, m, s: fn(y(x), m, s)``, and
    its saturated points then show up as disagreements.

    The grid crosses the pre-images ``-1e3, -50, -20, -12, -9, -8, -5, -2, -0.5,
    0, 0.7, 3, 7, 8.5, 10, 20, 50, 1e3`` (float32 ``tanh`` is ``+-1`` from
    ``|x| ~ 8``) with means ``(-2, 0, 1.5)`` and stds ``(0.1, 1, 4)``: ``N = 162``
    points. Every action dimension runs through all of them, each in another
    order: between neighbouring dimensions the pre-image, the mean and the std
    all differ, so a function that mixes dimensions or does not sum over them
    disagrees. The inputs are float32, and the float64 reference is evaluated at
    exactly the float32 values handed to ``log_prob_fn`` and at the float32
    bounds, so a function exact to one float32 rounding passes at ``atol=0``,
    ``rtol=1e-7``. References: ``float64``, the change of variables in NumPy
    float64 with ``log sech(x)**2`` from ``logaddexp``; ``samplers``,
    :meth:`SquashedNormal.log_prob_from_pre_image`; ``distrax`` and ``tfp``,
    their ``log_prob`` of the float32 action (through the inverse).

    Args:
        log_prob_fn: The function to check, as above.
        low: Lower bounds, a scalar or one per action dimension; ``None`` with
            ``high=None`` for plain tanh onto ``[-1, 1]``. Pass the environment's
            bounds: with ``[-1, 1]`` the ``log(half_range)`` term is zero and a
            missing one goes unnoticed.
        high: Upper bounds, the same shape as ``low``.
        action_dim: ``A``, the number of action dimensions; ``None`` for the
            length of vector bounds, or 3.
        atol: Absolute tolerance against the float64 reference.
        rtol: Relative tolerance against the float64 reference.

    Returns:
        A :class:`CrossCheckReport`; ``print`` it for a table.

    Raises:
        ValueError: only one of ``low`` and ``high`` is given, the bounds are
            invalid, ``action_dim`` is not their length, or ``log_prob_fn``
            does not return shape ``[N]``.
        TypeError: ``action_dim`` is not a positive integer.

    Example:
        >>> import jax.numpy as jnp, jax.scipy.stats as st
        >>> from samplers.testing import cross_check
        >>> def wrong(x, mean, std):  # log(1 - tanh**2) is -inf where tanh rounds to 1
        ...     return jnp.sum(st.norm.logpdf(x, mean, std) - jnp.log(1 - jnp.tanh(x) ** 2), -1)
        >>> report = cross_check(wrong)
        >>> report.passed, report["float64"].max_abs_error
        (False, inf)
    """
    if (low is None) != (high is None):
        raise ValueError(
            f"pass both low and high or neither (plain tanh onto [-1, 1]), got "
            f"low={low} and high={high}."
        )
    atol = _checks.real_number("atol", atol, minimum=0.0)
    rtol = _checks.real_number("rtol", rtol, minimum=0.0)
    if low is None or high is None:
        bijector, low32, high32 = Tanh(), np.float32(-1.0), np.float32(1.0)
    else:
        BoundedTanh(low, high)  # refuses invalid bounds, naming them as given
        low32, high32 = (np.asarray(bound, np.float32) for bound in (low, high))
        bijector = BoundedTanh(low32, high32)
    vector = np.ndim(low32) == 1
    if action_dim is None:
        action_dim = np.size(low32) if vector else _ACTION_DIM
    action_dim = _checks.positive_int("action_dim", action_dim)
    if vector and action_dim != np.size(low32):
        raise ValueError(
            f"action_dim must be the length of the bounds, {np.size(low32)}, got "
            f"{action_dim}; drop it or pass bounds of that length."
        )
    grid = np.array(list(itertools.product(_PRE_IMAGES, _MEANS, _STDS)))
    index = (np.arange(len(grid))[:, None] + _SHIFT * np.arange(action_dim)) % len(grid)
    x32, mean32, std32 = (jnp.asarray(grid[index, column], jnp.float32) for column in range(3))
    # The float64 reference is evaluated at exactly the float32 values the function sees.
    x, mean, std = (np.asarray(a, np.float64) for a in (x32, mean32, std32))
    low_np, high_np = (np.broadcast_to(np.float64(b), (action_dim,)) for b in (low32, high32))

    user = np.asarray(log_prob_fn(x32, mean32, std32), np.float64)
    if user.shape != (len(grid),):
        raise ValueError(
            f"log_prob_fn must return one log-likelihood per row, shape ({len(grid)},) for "
            f"inputs of shape {x32.shape}, got {user.shape}; sum over the last (action) axis."
        )
    action = bijector.forward(x32)
    references = {
        "float64": _float64_log_prob(x, mean, std, low_np, high_np),
        "samplers": SquashedNormal(mean32, std32, bijector).log_prob_from_pre_image(x32),
        "distrax": _distrax_log_prob(mean32, std32, low_np, high_np).log_prob(action),
        "tfp": _tfp_log_prob(mean32, std32, low_np, high_np).log_prob(action),
    }
    first = (x[:, 0], mean[:, 0], std[:, 0])
    rows = tuple(
        _worst(name, "action" if name in ("distrax", "tfp") else "pre-image", user, ref, first)
        for name, ref in references.items()
    )
    expected = references["float64"]
    passed = bool(
        np.all(np.isfinite(user))
        and np.all(np.abs(user - expected) <= atol + rtol * np.abs(expected))
    )
    return CrossCheckReport(rows=rows, passed=passed, atol=atol, rtol=rtol)


def _worst(name: str, scores: str, user, reference, first) -> Disagreement:
    """The worst point; ``first`` holds the pre-images, means and stds of dimension 0."""
    reference = np.asarray(reference, np.float64)
    finite = np.isfinite(reference)
    with np.errstate(invalid="ignore"):
        error = np.where(finite, np.abs(user - reference), -1.0)
    error = np.where(finite & ~np.isfinite(user), np.inf, error)
    worst = int(np.argmax(error))
    x, mean, std = (column[worst] for column in first)
    return Disagreement(
        reference=name,
        scores=scores,
        max_abs_error=float(error[worst]) if finite.any() else math.nan,
        pre_image=float(x),
        mean=float(mean),
        std=float(std),
        compared=int(finite.sum()),
        skipped=int((~finite).sum()),
    )


def _float64_log_prob(x, mean, std, low, high):
    """``log N(x) - log(half_range) - log sech(x)**2``, in float64, from ``cosh``."""
    half_range = (high - low) / 2
    log_normal = -0.5 * ((x - mean) / std) ** 2 - np.log(std) - 0.5 * np.log(2 * np.pi)
    log_sech2 = 2 * np.log(2.0) - 2 * np.logaddexp(x, -x)
    return np.sum(log_normal - np.log(half_range) - log_sech2, axis=-1)


def _distrax_log_prob(mean, std, low, high):
    center, half_range = _center_and_half_range(mean.shape, low, high)
    squash = distrax.Chain([distrax.ScalarAffine(center, half_range), distrax.Tanh()])
    return distrax.Transformed(distrax.MultivariateNormalDiag(mean, std), distrax.Block(squash, 1))


def _tfp_log_prob(mean, std, low, high):
    tfd, tfb = tfp.distributions, tfp.bijectors
    center, half_range = _center_and_half_range(mean.shape, low, high)
    squash = tfb.Chain([tfb.Shift(center), tfb.Scale(half_range), tfb.Tanh()])
    return tfd.Independent(tfd.TransformedDistribution(tfd.Normal(mean, std), squash), 1)


def _center_and_half_range(shape, low, high):
    # Broadcast to the full shape: the references' bijectors would otherwise promote ranks.
    return (
        jnp.asarray(np.broadcast_to(a, shape), jnp.float32)
        for a in ((high + low) / 2, (high - low) / 2)
    )
