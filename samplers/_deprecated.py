"""What is deprecated, in one place: the free functions that repeated a
``SquashedNormal`` method (each warns and calls the method, the one implementation),
and the heads' old argument names.
"""

import functools
import inspect
import warnings

from jaxtyping import Array, ArrayLike, Float

from samplers.distributions import _squashed
from samplers.distributions.bijectors import bijector_name, squashing
from samplers.distributions.squashed_normal import SquashedNormal


def _warn(old: str, new: str) -> None:
    warnings.warn(
        f"samplers.{old} is deprecated and will be removed in 0.5; use {new}.",
        DeprecationWarning,
        stacklevel=3,
    )


def _require(dist, name: str) -> None:
    if not isinstance(dist, SquashedNormal):
        raise TypeError(
            f"{name} must be a samplers.SquashedNormal, got {type(dist).__name__}; build it "
            f"with samplers.normal_tanh or samplers.squashed_normal."
        )


def log_prob_from_action(
    dist: SquashedNormal,
    action: Float[ArrayLike, "*sample_and_batch action"],
    *,
    min_distance: float | None = None,
) -> Float[Array, "*sample_and_batch"]:
    """Deprecated: ``dist.log_prob(action, min_distance=min_distance)``.

    Example:
        >>> import jax.numpy as jnp, pytest, samplers
        >>> dist = samplers.normal_tanh(jnp.zeros(2))
        >>> with pytest.deprecated_call():
        ...     samplers.log_prob_from_action(dist, jnp.array([0.999]))
        Array(-9.3246, dtype=float32)
    """
    _warn("log_prob_from_action(dist, action)", "dist.log_prob(action)")
    _require(dist, "dist")
    return dist.log_prob(action, min_distance=min_distance)


def mode(dist: SquashedNormal) -> Float[Array, "*batch action"]:
    """Deprecated: ``dist.mode()``.

    Example:
        >>> import jax.numpy as jnp, pytest, samplers
        >>> dist = samplers.squashed_normal_from_std(jnp.array([0.3]), jnp.array([1.0]))
        >>> with pytest.deprecated_call():
        ...     samplers.mode(dist)
        Array([0.978], dtype=float32)
    """
    _warn("mode(dist)", "dist.mode()")
    _require(dist, "dist")
    return dist.mode()


def mode_pre_image(dist: SquashedNormal) -> Float[Array, "*batch action"]:
    """Deprecated: the pre-image of ``dist.mode()``.

    ``dist.mode()`` remembers its pre-image, so ``dist.log_prob(dist.mode())``
    scores it exactly, also where the mode rounds onto a bound.

    Example:
        >>> import jax.numpy as jnp, pytest, samplers
        >>> dist = samplers.squashed_normal_from_std(jnp.array([0.5]), jnp.array([0.3]))
        >>> with pytest.deprecated_call():
        ...     samplers.mode_pre_image(dist)
        Array([0.596], dtype=float32)
    """
    _warn("mode_pre_image(dist)", "dist.mode(), whose log_prob scores its pre-image")
    _require(dist, "dist")
    bounds = squashing(dist.bijector)
    if bounds is None:
        raise TypeError(
            f"mode_pre_image supports the squashings onto bounds, got "
            f"{bijector_name(dist.bijector)}; for the identity the mode is dist.loc."
        )
    return _squashed.mode_pre_image(dist.loc, dist.scale, bounds.pre_image_scale)


def kl_divergence(p: SquashedNormal, q: SquashedNormal) -> Float[Array, "*batch"]:
    """Deprecated: ``p.kl_divergence(q)``.

    Example:
        >>> import jax.numpy as jnp, pytest, samplers
        >>> p = samplers.SquashedNormal(jnp.zeros(2), jnp.ones(2), samplers.Tanh())
        >>> q = samplers.SquashedNormal(jnp.ones(2), jnp.ones(2), samplers.Tanh())
        >>> with pytest.deprecated_call():
        ...     samplers.kl_divergence(p, q)
        Array(1., dtype=float32)
    """
    _warn("kl_divergence(p, q)", "p.kl_divergence(q)")
    _require(p, "p")
    _require(q, "q")
    return p.kl_divergence(q)


# The heads' deprecated arguments.

# The network output's keyword names before it was ``inputs`` everywhere.
_OLD_INPUT_NAMES = ("mean_and_std", "params", "logits", "mean")


def renamed_inputs(method):
    """Takes the network output under its old keyword names, with a deprecation warning."""

    # How many positional arguments come before ``inputs`` (``self`` not counted).
    position = list(inspect.signature(method).parameters).index("inputs") - 1

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        for old in _OLD_INPUT_NAMES:
            if old in kwargs:
                warnings.warn(
                    f"{type(self).__name__}.{method.__name__}({old}=...) is deprecated; pass "
                    f"the network output positionally or as inputs=.",
                    DeprecationWarning,
                    stacklevel=2,
                )
                if "inputs" in kwargs or len(args) > position:
                    raise TypeError(f"pass the network output once, not also as {old}=.")
                kwargs["inputs"] = kwargs.pop(old)
        return method(self, *args, **kwargs)

    return call


def renamed_rng(rngs, rng):
    """``rngs``, or the stream passed under its deprecated name ``rng=``."""
    if rng is None:
        return rngs
    _warn_caller(
        "the rng= keyword is deprecated; pass the nnx.Rngs as rngs= (flax's name) "
        "or as the first positional argument."
    )
    if rngs is not None:
        raise TypeError("pass the random stream once, as rngs, not also as rng=.")
    return rng


def counted_entropy(entropy, entropy_points, counted):
    """``entropy``, or ``(entropy, entropy_points)`` passed under the deprecated
    ``entropy_points=`` (``counted``: the choices that take a count)."""
    if entropy_points is None:
        return entropy
    _warn_caller(
        f"entropy_points= is deprecated; pass entropy=({entropy!r}, {entropy_points!r}) "
        f"as one value."
    )
    if entropy not in counted:
        raise ValueError(
            f"entropy={entropy!r} takes no entropy_points, got {entropy_points!r}; "
            f"use entropy=('sample', n) or ('quadrature', n)."
        )
    return entropy, entropy_points


def _warn_caller(message: str) -> None:
    """A ``DeprecationWarning`` attributed to the first caller outside this package."""
    frame, level = inspect.currentframe(), 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith("samplers"):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, DeprecationWarning, stacklevel=level)
