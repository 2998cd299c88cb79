"""The Beta distribution on ``[low, high]``, sampled and scored through its logit.

``X ~ Beta(a, b)`` is drawn as ``z = log G_a - log G_b`` with ``G_a ~ Gamma(a)`` and
``G_b ~ Gamma(b)``, so ``X = sigmoid(z)``, and the action is
``low + (high - low) * sigmoid(z)``. The pre-image ``z`` is what a sample remembers
and what a head stores: in float32 ``sigmoid(z)`` rounds onto a bound for many draws
(``jax.random.beta(key, 0.3, 0.3)`` returns exactly 1 about 3,800 times in 10**6),
where the Beta density of the action is infinite or zero, while
``log p(z) = a log sigmoid(z) + b log sigmoid(-z) - log B(a, b)`` is finite for every
finite ``z``. :class:`LogitBeta` is the distribution of ``z``, :class:`SquashedBeta`
the action's, and :func:`squashed_beta` builds one from a network output. Functions
of arrays and keys only; a sample's pre-image is remembered by the array's identity,
as :class:`samplers.SquashedNormal` does.
"""

from typing import Any, cast

import distrax
import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy import special
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray
from tensorflow_probability.substrates import jax as tfp

from samplers import _checks
from samplers._numerics import softplus
from samplers.distributions import _beta_math, _keys, _squashed
from samplers.distributions.bijectors import (
    Squashing,
    same_map,
    sigmoid_onto,
    squashing,
)
from samplers.distributions.pre_image import PreImageReplay

tfd = tfp.distributions


def _as_concentrations(concentration1, concentration0):
    """Both as floating arrays of one dtype (integers become the default float, float16
    and bfloat16 float32)."""
    a, b = jnp.asarray(concentration1), jnp.asarray(concentration0)
    for name, value in (("concentration1", a), ("concentration0", b)):
        if not (
            jnp.issubdtype(value.dtype, jnp.floating) or jnp.issubdtype(value.dtype, jnp.integer)
        ):
            raise TypeError(
                f"{name} must be real numbers, got dtype {value.dtype}; pass floating arrays."
            )
    dtype = (
        jnp.result_type(a, b, float)
        if not jnp.issubdtype(jnp.result_type(a, b), jnp.floating)
        else jnp.result_type(a, b)
    )
    dtype = _checks.computing_dtype(dtype)
    return a.astype(dtype), b.astype(dtype)


class LogitBeta(distrax.Distribution):
    """The logit of a Beta variable: ``z = logit(X) = log G_a - log G_b``, ``X ~ Beta(a, b)``.

    Elementwise (event shape ``()``); the batch shape is the broadcast shape of the
    two concentrations. ``log p(z) = a log sigmoid(z) + b log sigmoid(-z) - log B(a, b)``
    is finite for every finite ``z``. It is computed in Loader's saddle-point form,
    without the cancellation of terms of size ``a log a`` (which costs the textbook
    formula over 1e-3 nats in float32 at ``a = b = 1e4``): within ``8 eps (1 + |log p| +
    |a d_a log p| + |b d_b log p| + |z d_z log p|)`` of the exact value, the error of
    rounding each input, and each derivative within ``8 eps`` times the sum of the
    magnitudes of its terms (``log sigmoid(z) - digamma(a) + digamma(a + b)``,
    ``a sigmoid(-z) - b sigmoid(z)``). Sampling draws ``log G`` with
    ``jax.random.loggamma`` and is reparameterised: the derivative of a sample with
    respect to a concentration is the implicit one,
    ``d log G / d a = -(dP(a, G) / da) / (G p(G; a))`` (see
    :meth:`SquashedBeta.sample_pre_image` for its accuracy). Exact: :meth:`entropy`
    (``H[Beta(a, b)] - (digamma(a) + digamma(b) - 2 digamma(a + b))``),
    :meth:`mean` (``digamma(a) - digamma(b)``), :meth:`variance`
    (``trigamma(a) + trigamma(b)``), :meth:`mode` (``log(a / b)``); :meth:`cdf` and
    :meth:`log_cdf` are the regularised incomplete beta of ``sigmoid(z)``, in log
    space.

    Parameters are not checked (they cannot be inside ``jax.jit``): where either
    concentration is not positive and finite (NaN, ``inf``, ``<= 0``), both are NaN,
    and so is everything computed from them.

    Args:
        concentration1: ``a``, the exponent of ``x``, positive.
        concentration0: ``b``, the exponent of ``1 - x``, positive.

    Raises:
        TypeError: a concentration is not a real number.
        ValueError: the two shapes do not broadcast.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from samplers import LogitBeta
        >>> dist = LogitBeta(jnp.array([0.5, 2.0]), jnp.array([0.5, 3.0]))
        >>> dist.log_prob(jnp.array([80.0, 0.0])), dist.mode()
        (Array([-41.1447 , -0.9808], dtype=float32), Array([ 0. , -0.4055], dtype=float32))
    """

    def __init__(
        self, concentration1: Float[ArrayLike, "*batch"], concentration0: Float[ArrayLike, "*batch"]
    ):
        super().__init__()
        a, b = _as_concentrations(concentration1, concentration0)
        try:
            shape = jnp.broadcast_shapes(a.shape, b.shape)
        except ValueError:
            raise ValueError(
                f"concentration1 and concentration0 must broadcast, got shapes {a.shape} and "
                f"{b.shape}."
            ) from None
        self._a, self._b = _beta_math.nan_where_invalid(
            jnp.broadcast_to(a, shape), jnp.broadcast_to(b, shape)
        )

    @property
    def concentration1(self) -> Float[Array, "*batch"]:
        """``a``, NaN where the parameters are invalid."""
        return self._a

    @property
    def concentration0(self) -> Float[Array, "*batch"]:
        """``b``, NaN where the parameters are invalid."""
        return self._b

    @property
    def event_shape(self) -> tuple[int, ...]:
        return ()

    @property
    def batch_shape(self) -> tuple[int, ...]:
        return self._a.shape

    def _sample_n(self, key: PRNGKeyArray, n: int) -> Array:
        return _beta_math.logit_beta_sample(key, self._a, self._b, (n, *self._a.shape))

    def _broadcast(self, value) -> tuple[Array, Array, Array]:
        value = _checks.float_array("value", value)
        shape = jnp.broadcast_shapes(value.shape, self._a.shape)
        dtype = jnp.result_type(value, self._a)
        value, a, b = (jnp.broadcast_to(x, shape).astype(dtype) for x in (value, self._a, self._b))
        return value, a, b

    def log_prob(self, value: Float[ArrayLike, "*shape"]) -> Float[Array, "*shape"]:
        """``a log sigmoid(z) + b log sigmoid(-z) - log B(a, b)``, broadcast with the batch.

        Example:
            >>> import jax.numpy as jnp
            >>> from samplers import LogitBeta
            >>> LogitBeta(1.0, 1.0).log_prob(jnp.array([0.0, -100.0]))  # sigmoid(z) (1 - ...)
            Array([  -1.3863, -100.    ], dtype=float32)
        """
        z, a, b = self._broadcast(value)
        return _beta_math.log_density(a, b, z)

    def cdf(self, value: Float[ArrayLike, "*shape"]) -> Float[Array, "*shape"]:
        """``P[Z <= value] = I_{sigmoid(value)}(a, b)``, ``exp(log_cdf(value))``.

        Example:
            >>> import jax.numpy as jnp
            >>> from samplers import LogitBeta
            >>> LogitBeta(2.0, 2.0).cdf(jnp.array([0.0, 2.0]))
            Array([0.5   , 0.9608], dtype=float32)
        """
        return jnp.exp(self.log_cdf(value))

    def log_cdf(self, value: Float[ArrayLike, "*shape"]) -> Float[Array, "*shape"]:
        """``log I_x(a, b)`` for ``x = sigmoid(value)``, without underflow in the left tail.

        Computed in log space (a continued fraction times the density, or the
        complement above ``x = (a + 1) / (a + b + 2)``), differentiable in ``value``
        and both concentrations. ``-inf`` at ``value = -inf``, 0 at ``+inf``; NaN
        where the fraction has not converged within 5000 steps (near the median once
        the concentrations reach about 1e8). Its error, relative to ``I`` below
        ``(a + 1) / (a + b + 2)`` and
        to ``1 - I`` above, grows with the concentrations: with both in
        ``[0.01, 1e3]`` under 1e-4 in float32 and 3e-13 in float64, up to ``1e4``
        under 1e-3 and 3e-12.

        Example:
            >>> import jax.numpy as jnp
            >>> from samplers import LogitBeta
            >>> LogitBeta(2.0, 2.0).log_cdf(jnp.array([-100.0]))  # I_x ~ 3 x**2
            Array([-198.9014], dtype=float32)
        """
        z, a, b = self._broadcast(value)
        finite = jnp.where(jnp.isinf(z), 0.0, z)
        log_cdf = _beta_math.log_betainc_jit(a, b, finite)
        return jnp.where(z == jnp.inf, 0.0, jnp.where(z == -jnp.inf, -jnp.inf, log_cdf))

    def entropy(self) -> Float[Array, "*batch"]:
        """``H[Z] = H[Beta(a, b)] - (digamma(a) + digamma(b) - 2 digamma(a + b))``, exact.

        Example:
            >>> from samplers import LogitBeta
            >>> LogitBeta(1.0, 1.0).entropy()  # the logistic distribution's: 2
            Array(2., dtype=float32)
        """
        return _beta_math.logit_entropy(self._a, self._b)

    def mean(self) -> Float[Array, "*batch"]:
        """``E[Z] = digamma(a) - digamma(b)``.

        Example:
            >>> from samplers import LogitBeta
            >>> LogitBeta(2.0, 1.0).mean()  # digamma(2) - digamma(1) = 1
            Array(1., dtype=float32)
        """
        return special.digamma(self._a) - special.digamma(self._b)

    def variance(self) -> Float[Array, "*batch"]:
        """``Var[Z] = trigamma(a) + trigamma(b)``.

        Example:
            >>> from samplers import LogitBeta
            >>> LogitBeta(1.0, 1.0).variance()  # pi**2 / 3
            Array(3.2899, dtype=float32)
        """
        return special.polygamma(1, self._a) + special.polygamma(1, self._b)

    def stddev(self) -> Float[Array, "*batch"]:
        """``sqrt(variance())``.

        Example:
            >>> from samplers import LogitBeta
            >>> LogitBeta(1.0, 1.0).stddev()
            Array(1.8138, dtype=float32)
        """
        return jnp.sqrt(self.variance())

    def mode(self) -> Float[Array, "*batch"]:
        """``log(a / b)``, where ``a sigmoid(-z) = b sigmoid(z)``: defined for all ``a, b > 0``.

        Example:
            >>> from samplers import LogitBeta
            >>> LogitBeta(0.5, 2.0).mode()
            Array(-1.3863, dtype=float32)
        """
        return jnp.log(self._a) - jnp.log(self._b)

    def __getitem__(self, index) -> "LogitBeta":
        """Slices the batch shape, as distrax's distributions do.

        Example:
            >>> import jax.numpy as jnp
            >>> from samplers import LogitBeta
            >>> LogitBeta(jnp.ones((3, 2)), 2.0)[1:].batch_shape
            (2, 2)
        """
        # The event shape is (): every axis is a batch axis.
        return LogitBeta(self._a[index], self._b[index])


class SquashedBeta(PreImageReplay):
    """A Beta distribution per action dimension, on ``[low, high]``, through its logit.

    ``y = low + (high - low) * sigmoid(z)`` for ``z ~ LogitBeta(a, b)`` in each
    dimension, independently: ``(y - low) / (high - low) ~ Beta(a, b)``. A
    ``distrax.Transformed`` of ``Independent(LogitBeta(a, b), 1)`` through the
    elementwise sigmoid onto the bounds (``samplers.Sigmoid`` on ``[0, 1]``), which
    declares its :class:`samplers.Squashing`. Shapes: the concentrations are
    ``[*batch, action]``; the batch shape is ``[*batch]``, the event shape
    ``[action]``, a log-density ``[*batch]``. The bounds are scalars or one per
    action dimension, and may be asymmetric.

    The density is ``log p(y) = sum over the action of (a - 1) log u + (b - 1)
    log(1 - u) - log B(a, b) - log(high - low)``, ``u = sigmoid(z)``. Exact:
    :meth:`entropy`, :meth:`mean`, :meth:`variance`, :meth:`mode`, :meth:`cdf`, the
    KL divergence to another ``SquashedBeta`` on the same bounds.

    Numerical caveat: in float32, ``sigmoid(z)`` rounds onto a bound for many draws
    when a concentration is below 1 (``a = b = 0.3``: about 0.4% of them onto 1), where the
    Beta density is infinite or zero and ``distrax.Beta.log_prob`` gives ``inf`` or
    NaN with NaN gradients. A sample therefore remembers its pre-image ``z``:
    ``dist.log_prob(a)`` of the very array that :meth:`sample` (or
    :meth:`sample_and_log_prob`, :meth:`sample_with_pre_image`, :meth:`mean`,
    :meth:`mode`) returned is :meth:`log_prob_from_pre_image` of that ``z``, finite
    also where the action rounded onto a bound. Any other action is scored from its
    distances to the bounds (see :meth:`log_prob`). To replay an action later, store
    its pre-image.

    Parameters are not checked (they cannot be inside ``jax.jit``): where a
    concentration is not positive and finite, both concentrations of that dimension
    are NaN, and so is everything computed from them.

    Args:
        concentration1: ``a`` per dimension, ``[*batch, action]``, positive.
        concentration0: ``b``, the same shape.
        low: Lower bounds, a scalar or one per action dimension.
        high: Upper bounds, the same shape as ``low``, above it.

    Raises:
        TypeError: a concentration is not a real number.
        ValueError: the concentrations differ in shape or have no action axis, or
            the bounds are invalid (as :class:`samplers.BoundedTanh` refuses them)
            or are not of shape ``()`` or ``(action,)``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from samplers import SquashedBeta
        >>> dist = SquashedBeta(jnp.full(2, 0.3), jnp.full(2, 0.3), low=-2.0, high=2.0)
        >>> action = dist.sample(seed=jax.random.key(83))  # rounds onto the upper bound
        >>> action, dist.log_prob(action)  # scored from its pre-image
        (Array([ 2.    , -1.7364], dtype=float32), Array(7.5173, dtype=float32))
    """

    _replay_hint = " (the stored pre-image z)"

    def __init__(
        self,
        concentration1: Float[ArrayLike, "*batch action"],
        concentration0: Float[ArrayLike, "*batch action"],
        low: Float[ArrayLike, "*action"] = 0.0,
        high: Float[ArrayLike, "*action"] = 1.0,
    ):
        a, b = _as_concentrations(concentration1, concentration0)
        if a.shape != b.shape or a.ndim < 1:
            raise ValueError(
                f"concentration1 and concentration0 must have the same shape [*batch, action], "
                f"got {a.shape} and {b.shape}."
            )
        bijector = sigmoid_onto(low, high)
        bounds = cast(Squashing, squashing(bijector))
        if np.shape(bounds.low) not in ((), (a.shape[-1],)):
            raise ValueError(
                f"low and high must have shape () or (action,) = ({a.shape[-1]},), got "
                f"{np.shape(bounds.low)}; give one bound per action dimension."
            )
        # Computed in the result dtype of the concentrations and the bounds, as
        # BoundedTanh computes in its input's and its bounds': float64 bound arrays keep
        # their precision (a float32 width 1e-9 above 1 would be 0).
        dtype = _checks.computing_dtype(jnp.result_type(a, bounds.low, bounds.high))
        a, b = _beta_math.nan_where_invalid(a.astype(dtype), b.astype(dtype))
        super().__init__(distrax.Independent(LogitBeta(a, b), 1), distrax.Block(bijector, 1))
        self._a, self._b = a, b

    @property
    def concentration1(self) -> Float[Array, "*batch action"]:
        """``a`` per dimension, ``[*batch, action]``; NaN where the parameters are invalid.

        Example:
            >>> import jax.numpy as jnp
            >>> from samplers import SquashedBeta
            >>> dist = SquashedBeta(jnp.array([2.0, -1.0]), jnp.array([3.0, 3.0]))
            >>> dist.concentration1, dist.concentration0
            (Array([ 2., nan], dtype=float32), Array([ 3., nan], dtype=float32))
        """
        return self._a

    @property
    def concentration0(self) -> Float[Array, "*batch action"]:
        """``b`` per dimension, as :attr:`concentration1` gives ``a``."""
        return self._b

    @property
    def _parameters(self) -> tuple[Array, Array]:
        return self._a, self._b

    @property
    def _squashing(self) -> Squashing:
        return cast(Squashing, self.bounds)

    def deterministic_replay_data(self) -> Float[Array, "*batch action"]:
        """:meth:`mean_pre_image`: the deterministic action is the mean."""
        return self.mean_pre_image()

    def _log_range(self, shape, dtype) -> Array:
        """``log(high - low)`` in ``dtype``, broadcast to ``shape``: the width is taken in
        the bounds' own precision first (Python numbers are weakly typed, held in float64
        under ``jax_enable_x64``), as :class:`samplers.BoundedTanh` takes its own."""
        low, high = (jnp.asarray(v) for v in self._squashing[:2])
        return jnp.broadcast_to(jnp.log(high - low), shape).astype(dtype)

    def log_prob_from_pre_image(
        self, pre_image: Float[ArrayLike, "*sample_and_batch action"]
    ) -> Float[Array, "*sample_and_batch"]:
        """Log-density of the action of ``pre_image``, computed from ``z`` alone.

        The sum over the action axis of ``(a - 1) log sigmoid(z) + (b - 1) log
        sigmoid(-z) - log B(a, b) - log(high - low)``: finite for every finite ``z``,
        also where the action rounds onto a bound, with gradients with respect to
        ``z``, both concentrations and the bounds. Deterministic: the same ``z`` and
        parameters give the same bits, so a replayed pre-image reproduces the
        rollout's log-likelihood. ``pre_image`` broadcasts with ``[*batch, action]``.

        Raises:
            TypeError: ``pre_image`` is not floating.
            ValueError: ``pre_image`` does not broadcast with the distribution's shape.

        Example:
            >>> import jax.numpy as jnp
            >>> from samplers import SquashedBeta
            >>> dist = SquashedBeta(jnp.array([0.3]), jnp.array([0.3]))
            >>> dist.log_prob_from_pre_image(jnp.array([120.0]))  # sigmoid rounds to 1
            Array(82.2066, dtype=float32)
        """
        z, a, b = self._broadcast("pre_image", pre_image)
        return _log_prob_from_pre_image(a, b, z, self._log_range(z.shape, z.dtype))

    def sample_pre_image(self, *, seed: PRNGKeyArray | int) -> Float[Array, "*batch action"]:
        """Draws ``z = log G_a - log G_b``, reparameterised (gradients reach ``a`` and ``b``).

        Args:
            seed: One key (or an integer, as distrax takes), split into the keys of
                the two Gamma draws as ``jax.random.beta`` splits it, so that
                ``sigmoid(z)`` is ``jax.random.beta(seed, a, b)`` up to rounding; or
                one typed key per batch element (shape ``[*batch]``), each element
                then drawing from its own key.

        The derivative with respect to the concentrations is the implicit one (see
        :class:`LogitBeta`): below ``G = 1`` from the series of the incomplete gamma
        function in log space, which ``jax.random.loggamma``'s own derivative gets
        wrong where ``exp(log G)`` underflows (``a = 0.01``); above, from
        ``jax.lax.random_gamma_grad``, whose float32 relative error grows with the
        concentration: under 2e-5 up to 2.5, 1e-4 at 1e3, 1e-3 at 1e4 (float64:
        under 1e-7).

        Returns:
            Pre-images, shape ``[*batch, action]``; NaN where the parameters are.

        Raises:
            ValueError: ``seed`` is an array of keys not of the batch shape.

        Example:
            >>> import jax, jax.numpy as jnp
            >>> from samplers import SquashedBeta
            >>> dist = SquashedBeta(jnp.full(2, 0.3), jnp.full(2, 0.3))
            >>> z = dist.sample_pre_image(seed=jax.random.key(0))
            >>> z, jax.nn.sigmoid(z)  # the Beta draws
            (Array([2.688, 9.3579], dtype=float32), Array([0.9363, 0.9999 ], dtype=float32))
        """
        seed = _keys.integer_seed(seed)
        a, b = self._a, self._b
        if not _keys.per_element(seed):
            return _beta_math.logit_beta_sample(seed, a, b, a.shape)
        _keys.check_keys(seed, a.shape[:-1])
        rows = a.shape[-1:]
        draw = jax.vmap(lambda key, a, b: _beta_math.logit_beta_sample(key, a, b, rows))
        flat = draw(seed.reshape(-1), a.reshape(-1, *rows), b.reshape(-1, *rows))
        return flat.reshape(a.shape)

    def log_prob(
        self, value: Float[ArrayLike, "*value_batch action"]
    ) -> Float[Array, "*broadcast_batch"]:
        """Log-density of an action, finite on the whole closed range ``[low, high]``.

        An array returned by this object's sampling methods (or :meth:`mean`,
        :meth:`mode`) is scored at its own pre-image: :meth:`log_prob_from_pre_image`.
        Any other action is scored from its distances to the bounds, each held
        exactly, never through ``logit`` of a rounded quotient:

        - strictly inside ``(low, high)``: the Beta log-density there;
        - exactly on a bound: not a density but the log-probability of the atom
          that float rounding puts there, ``log P[U <= u_r]`` at ``low`` and
          ``log P[U >= 1 - u_r]`` at ``high``, ``U = (Y - low) / (high - low)`` and
          ``u_r`` the distance of the point half a float step inside the bound, over
          ``high - low``; computed in log space, so finite also where ``u_r`` is the
          smallest normal float;
        - outside ``[low, high]``, or NaN: NaN.

        Args:
            value: Actions, shape broadcastable with ``[*batch, action]``.

        Returns:
            ``log p(value)``, the broadcast shape without its last axis.

        Raises:
            TypeError: ``value`` is not floating.
            ValueError: ``value`` does not broadcast with the distribution's shape.

        Example:
            >>> import jax.numpy as jnp, samplers
            >>> dist = samplers.SquashedBeta(jnp.array([0.3]), jnp.array([2.0]))
            >>> dist.log_prob(jnp.array([[0.5], [0.0], [1.0]]))  # inside, the two atoms
            Array([ -1.1496, -25.9386 , -36.2921 ], dtype=float32)
        """
        return super().log_prob(value)

    def _log_prob_of_action(self, value) -> Array:
        action, a, b = self._broadcast("value", value)
        return _log_prob_from_action(*self._squashing[:2], action, a, b)

    def entropy(self, input_hint: Any = None) -> Float[Array, "*batch"]:
        """The exact entropy of the action, ``sum of H[Beta(a, b)] + log(high - low)``.

        Computed as ``H[LogitBeta] + E[log U + log(1 - U)] + log(high - low)`` in
        Loader's form, without the cancellation of the textbook formula's terms of
        size ``a digamma(a)``: within ``32 eps (1 + |H[Beta]| + |H[logit]| +
        log(a + b))`` per dimension of the exact value. Differentiable in both
        concentrations and the bounds.

        Args:
            input_hint: Unused; distrax's signature.

        Example:
            >>> import jax.numpy as jnp
            >>> from samplers import SquashedBeta
            >>> SquashedBeta(jnp.ones(2), jnp.ones(2), -1.0, 1.0).entropy()  # uniform: 2 log 2
            Array(1.3863, dtype=float32)
        """
        per_dimension = _beta_math.beta_entropy(self._a, self._b)
        return jnp.sum(per_dimension + self._log_range(self._a.shape, self._a.dtype), axis=-1)

    def mean(self) -> Float[Array, "*batch action"]:
        """``low + (high - low) a / (a + b)`` per dimension, the action of ``z = log a - log b``.

        Computed as the action of that pre-image, which it remembers (so it is the
        deterministic action of :class:`samplers.heads.beta.BetaSampler` bit for bit,
        and ``dist.log_prob(dist.mean())`` is the density there); ``sigmoid(z)`` is
        within ``8 eps (1 + |log a| + |log b|)`` of ``a / (a + b)``, relative.
        Defined for all ``a, b > 0``.

        Example:
            >>> import jax.numpy as jnp
            >>> from samplers import SquashedBeta
            >>> dist = SquashedBeta(jnp.array([1.0, 2.0]), jnp.array([3.0, 2.0]), -1.0, 1.0)
            >>> dist.mean()
            Array([-0.5,  0. ], dtype=float32)
        """
        return self._remember(self.mean_pre_image())

    def mean_pre_image(self) -> Float[Array, "*batch action"]:
        """``log a - log b``, the pre-image of :meth:`mean` (``sigmoid`` of it is ``a / (a + b)``).

        Example:
            >>> import jax.numpy as jnp
            >>> from samplers import SquashedBeta
            >>> SquashedBeta(jnp.array([2.0]), jnp.array([2.0])).mean_pre_image()
            Array([0.], dtype=float32)
        """
        return jnp.log(self._a) - jnp.log(self._b)

    def variance(self) -> Float[Array, "*batch action"]:
        """``(high - low)**2 a b / ((a + b)**2 (a + b + 1))`` per dimension.

        Example:
            >>> import jax.numpy as jnp
            >>> from samplers import SquashedBeta
            >>> SquashedBeta(jnp.ones(1), jnp.ones(1), -1.0, 1.0).variance()  # 4 / 12
            Array([0.3333], dtype=float32)
        """
        n = self._a + self._b
        # The width in the bounds' own precision first, as _log_range takes it.
        low, high = (jnp.asarray(v) for v in self._squashing[:2])
        width = jnp.broadcast_to(high - low, n.shape).astype(n.dtype)
        return jnp.square(width) * (self._a / n) * (self._b / n) / (n + 1.0)

    def stddev(self) -> Float[Array, "*batch action"]:
        """``sqrt(variance())`` per dimension.

        Example:
            >>> import jax.numpy as jnp
            >>> from samplers import SquashedBeta
            >>> SquashedBeta(jnp.ones(1), jnp.ones(1), -1.0, 1.0).stddev()
            Array([0.5774], dtype=float32)
        """
        return jnp.sqrt(self.variance())

    def mode(self) -> Float[Array, "*batch action"]:
        """``low + (high - low) (a - 1) / (a + b - 2)`` per dimension, for ``a > 1`` and ``b > 1``.

        The action of ``z = log(a - 1) - log(b - 1)``, remembered as :meth:`mean`
        remembers its own. Where ``a <= 1`` or ``b <= 1`` the density has no
        maximum strictly inside (it is unbounded, flat or largest on a bound), and
        that dimension is NaN, not a bound.

        Example:
            >>> import jax.numpy as jnp
            >>> from samplers import SquashedBeta
            >>> SquashedBeta(jnp.array([2.0, 0.5]), jnp.array([3.0, 3.0])).mode()
            Array([0.3333,    nan], dtype=float32)
        """
        defined = (self._a > 1) & (self._b > 1)
        a = jnp.where(defined, self._a, 2.0)
        b = jnp.where(defined, self._b, 2.0)
        pre_image = jnp.where(defined, jnp.log(a - 1.0) - jnp.log(b - 1.0), jnp.nan)
        return self._remember(pre_image)

    def median(self) -> Float[Array, "*batch action"]:
        """Not implemented: no inverse of the incomplete beta here is exact to float precision.

        Raises:
            NotImplementedError: always; ``tfp.math.betaincinv`` is off by 17% at
                ``a = b = 0.3`` and by 2% at ``a = 2, b = 5`` in float64 against
                ``scipy.special.betaincinv``.

        Example:
            >>> import jax.numpy as jnp
            >>> from samplers import SquashedBeta
            >>> SquashedBeta(jnp.ones(1), jnp.ones(1)).median()  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            NotImplementedError: SquashedBeta.median has no implementation exact to float ...
        """
        raise NotImplementedError(
            "SquashedBeta.median has no implementation exact to float precision "
            "(tfp.math.betaincinv is off by 17% at a = b = 0.3 in float64); use dist.mean() "
            "or dist.mode(), or solve dist.cdf(y) = 0.5 per dimension by bisection."
        )

    def log_cdf(
        self, value: Float[ArrayLike, "*value_batch action"]
    ) -> Float[Array, "*broadcast_batch"]:
        """``log P[Y_i <= value_i for every i]``: the sum over the action axis of
        ``log I_u(a, b)``, ``u = (value - low) / (high - low)``.

        In log space (see :meth:`LogitBeta.log_cdf`), from the distances to the
        bounds: ``-inf`` at and below ``low``, 0 at and above ``high``, NaN for
        invalid parameters.

        Example:
            >>> import jax.numpy as jnp
            >>> from samplers import SquashedBeta
            >>> dist = SquashedBeta(jnp.array([2.0]), jnp.array([2.0]), -1.0, 1.0)
            >>> dist.log_cdf(jnp.array([[-1.0], [0.0], [1.0]]))
            Array([   -inf, -0.6931,  0.    ], dtype=float32)
        """
        action, a, b = self._broadcast("value", value)
        return _log_cdf_from_action(*self._squashing[:2], action, a, b)

    def cdf(
        self, value: Float[ArrayLike, "*value_batch action"]
    ) -> Float[Array, "*broadcast_batch"]:
        """``exp(log_cdf(value))``, the joint CDF of the event.

        Example:
            >>> import jax.numpy as jnp
            >>> from samplers import SquashedBeta
            >>> SquashedBeta(jnp.full(2, 2.0), jnp.full(2, 2.0)).cdf(jnp.array([0.5, 0.5]))
            Array(0.25, dtype=float32)
        """
        return jnp.exp(self.log_cdf(value))

    def kl_divergence(self, other_dist, **kwargs) -> Float[Array, "*batch"]:
        """``KL(self || other_dist)`` for another ``SquashedBeta`` on the same bounds, exact.

        The sum over the action axis of the Betas' KL (the map onto the bounds
        changes nothing), registered with TFP; exactly 0 for equal parameters, and
        per dimension within ``16 eps (1 + |KL| + sum over the four parameters t of
        |t dKL/dt|)`` of the exact value, the error of rounding each parameter (no
        cancellation of terms of size ``a log a``). Its derivatives are the closed
        forms, exactly 0 at equal parameters and each within ``16 eps (1 + |dKL/dt| +
        sum over the four parameters s of |s d2KL/ds dt|)`` of the exact one (both
        bounds checked for concentrations from ``1e-3`` to ``1e5``, in float32 and
        float64), and differentiable again: at equal parameters the Hessian with
        respect to ``self``'s concentrations is the Beta's Fisher information.
        Bounds that differ are refused; bounds traced inside ``jax.jit`` are
        compared when the program runs, and where they differ the KL is NaN.

        Raises:
            ValueError: the bounds differ, or the action sizes or batch shapes do
                not match.

        Example:
            >>> import jax.numpy as jnp
            >>> from samplers import SquashedBeta
            >>> p = SquashedBeta(jnp.array([2.0]), jnp.array([2.0]))
            >>> p.kl_divergence(SquashedBeta(jnp.array([1.0]), jnp.array([1.0])))
            Array(0.1251, dtype=float32)
        """
        return jnp.asarray(super().kl_divergence(other_dist, **kwargs))

    def __getitem__(self, index) -> "SquashedBeta":
        """Slices the batch shape; the action axis stays whole.

        Example:
            >>> import jax.numpy as jnp
            >>> from samplers import SquashedBeta
            >>> SquashedBeta(jnp.ones((3, 4, 2)), jnp.ones((3, 4, 2)))[0, 1:].batch_shape
            (3,)
        """
        base = cast(LogitBeta, cast(distrax.Independent, self.distribution[index]).distribution)
        low, high = self._squashing[:2]
        return SquashedBeta(base.concentration1, base.concentration0, low, high)


@jax.jit
def _log_prob_from_pre_image(a, b, z, log_range):
    """``sum(log p(z) + softplus(z) + softplus(-z) - log(high - low), -1)``."""
    per_dimension = _beta_math.log_density(a, b, z) + softplus(z) + softplus(-z) - log_range
    return jnp.sum(per_dimension, axis=-1)


@jax.jit
def _log_prob_from_action(low, high, action, a, b):
    """``log p(y)`` summed over the last axis, from the distances to the bounds."""
    bounds = Squashing(low, high, 2.0)
    z, log_det, on_low, on_high = _squashed.pre_image_from_distances(bounds, action)
    inside = _beta_math.log_density(a, b, z) - log_det
    # On a bound z is the pre-image of the rounding threshold: P[U <= u_r] at low, and
    # P[U >= 1 - u_r] = I_{u_r}(b, a) at high. Elsewhere a point deep in the left tail,
    # where the continued fraction stops at once.
    on_bound = on_low | on_high
    far = jnp.asarray(-30.0, z.dtype)
    atom = _beta_math.log_betainc(
        jnp.where(on_high, b, a),
        jnp.where(on_high, a, b),
        jnp.where(on_high, -z, jnp.where(on_low, z, far)),
    )
    return jnp.sum(jnp.where(on_bound, atom, inside), axis=-1)


@jax.jit
def _log_cdf_from_action(low, high, action, a, b):
    """``sum(log I_u(a, b), -1)``: ``-inf`` at and below ``low``, 0 at and above ``high``."""
    bounds = Squashing(low, high, 2.0)
    low, high = (jnp.broadcast_to(jnp.asarray(v, action.dtype), action.shape) for v in (low, high))
    inside = jnp.clip(action, low, high)
    z, _, on_low, on_high = _squashed.pre_image_from_distances(bounds, inside)
    on_low, on_high = on_low | (action < low), on_high | (action > high)
    log_cdf = _beta_math.log_betainc(a, b, jnp.where(on_low | on_high, 0.0, z))
    log_cdf = jnp.sum(jnp.where(on_high, 0.0, jnp.where(on_low, -jnp.inf, log_cdf)), axis=-1)
    # NaN applied after the sum: XLA's CPU backend folds exp(sum(where(p, 0, nan))) to 1.
    defined = jnp.all(_beta_math.valid(a, b) & ~jnp.isnan(action), axis=-1)
    return jnp.where(defined, log_cdf, jnp.nan)


def _kl_divergence(p, q, *_, **__) -> Array:
    """``KL(p || q)`` of two ``SquashedBeta`` (summed over the action) or two ``LogitBeta``."""
    squashed = isinstance(p, SquashedBeta)
    same = same_map(p._elementwise, q._elementwise) if squashed else True
    if same is False:
        bounds_p, bounds_q = p.bounds, q.bounds
        raise ValueError(
            f"p and q must have the same bounds, got [{bounds_p.low}, {bounds_p.high}] and "
            f"[{bounds_q.low}, {bounds_q.high}]; with different supports the KL is not that "
            f"of the Betas (it is infinite where q gives no mass)."
        )
    try:
        shape = jnp.broadcast_shapes(p._a.shape, q._a.shape)
    except ValueError:
        shape = None
    if shape is None or (squashed and p._a.shape[-1] != q._a.shape[-1]):
        raise ValueError(
            f"p and q must have the same action size and broadcastable batch shapes, got "
            f"concentration shapes {p._a.shape} and {q._a.shape}."
        )
    a1, b1, a2, b2 = (jnp.broadcast_to(x, shape) for x in (p._a, p._b, q._a, q._b))
    kl = _beta_math.kl(a1, b1, a2, b2)
    if same is not True:
        kl = jnp.where(jnp.all(same), kl, jnp.nan)
    return jnp.sum(kl, axis=-1) if squashed else kl


tfd.RegisterKL(LogitBeta, LogitBeta)(_kl_divergence)
tfd.RegisterKL(SquashedBeta, SquashedBeta)(_kl_divergence)
