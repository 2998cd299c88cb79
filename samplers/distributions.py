"""The pure layer: network outputs in, a ``distrax`` distribution out.

``normal_tanh`` and ``squashed_normal`` turn a vector ``[mean | raw_std]`` into a
:class:`SquashedNormal` (``squashed_normal_from_std`` and
``squashed_normal_from_log_std`` take the two halves separately), a
``distrax.Transformed`` with the few operations that a policy head needs and
distrax lacks: scoring a stored pre-image, sampling the action and its pre-image
together, the deterministic action and a reparameterised entropy estimate; and
the ``distrax.Distribution`` methods (``log_prob`` finite on the bounds, ``mode``,
moments, CDF) that ``distrax.Transformed`` leaves NaN or unimplemented. Functions
of arrays and keys only; no state.
"""

from collections.abc import Callable
from typing import Any, cast

import distrax
import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy import special
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray

from samplers import _checks, _squashed
from samplers._numerics import softplus
from samplers.bijectors import Tanh, bijector_name, squashing


class SquashedNormal(distrax.Transformed):
    """A diagonal Normal over the last axis pushed through an elementwise bijector.

    ``x = loc + scale * eps`` with ``eps ~ N(0, I)``, and the action is
    ``y = f(x)`` for an elementwise bijector ``f`` such as tanh. The density is
    ``log p(y) = log N(x; loc, scale) - sum log|f'(x)|``.

    ``log_prob(y)`` does not invert ``f`` with ``atanh`` as ``distrax.Transformed``
    does (NaN once a float32 sample rounds to a bound, from ``|x| ~ 8`` for
    tanh): for tanh, ``BoundedTanh`` and sigmoid it works from the distances to
    the bounds, so ``dist.log_prob(dist.sample(seed=key))`` is finite for every
    sample (see :meth:`log_prob`). What it still costs against storing the
    pre-image: a sample on a bound is scored at a fixed point half a float step
    inside the bound, not at its own pre-image, which the sample has lost; and a
    sample near a bound holds its pre-image only to the float32 rounding of the
    action. Keep the pre-image ``x`` that produced an action and score it with
    :meth:`log_prob_from_pre_image`, which never inverts and is exact for any
    finite ``x``.

    Args:
        loc: Means of the base Normal, shape ``[*batch, action]``.
        scale: Standard deviations, the same shape, positive.
        bijector: An elementwise distrax (or TFP) bijector; its ``Block`` over the
            last axis becomes this distribution's bijector.

    Raises:
        ValueError: ``bijector`` is not elementwise or changes the action shape
            (e.g. bounds of the wrong length), or ``loc`` and ``scale`` differ
            in shape.

    Example:
        >>> import distrax, jax, jax.numpy as jnp, samplers
        >>> dist = samplers.SquashedNormal(jnp.zeros(2), jnp.ones(2), distrax.Tanh())
        >>> action = jnp.array([0.5, 1.0])  # on the bound in the second dimension
        >>> dist.log_prob(action)  # distrax.Transformed gives NaN
        Array(-25.66, dtype=float32)
    """

    def __init__(
        self,
        loc: Float[Array, "*batch action"],
        scale: Float[Array, "*batch action"],
        bijector: distrax.Bijector | Callable,
    ):
        if jnp.shape(loc) != jnp.shape(scale) or jnp.ndim(loc) < 1:
            raise ValueError(
                f"loc and scale must have the same shape [*batch, action], got "
                f"{jnp.shape(loc)} and {jnp.shape(scale)}."
            )
        bijector = distrax.as_bijector(bijector)
        if bijector.event_ndims_in != 0 or bijector.event_ndims_out != 0:
            raise ValueError(
                f"bijector must be elementwise (event_ndims_in == 0), got {bijector.name} "
                f"with event_ndims_in={bijector.event_ndims_in}; pass the scalar bijector, "
                f"e.g. distrax.Tanh() rather than distrax.Block(distrax.Tanh(), 1)."
            )
        _check_keeps_shape(bijector, loc)
        super().__init__(
            distrax.Independent(distrax.Normal(loc, scale), 1), distrax.Block(bijector, 1)
        )
        self._loc = loc
        self._scale = scale

    @property
    def loc(self) -> Float[Array, "*batch action"]:
        """Means of the base Normal (the pre-image of the deterministic action)."""
        return self._loc

    @property
    def scale(self) -> Float[Array, "*batch action"]:
        """Standard deviations of the base Normal."""
        return self._scale

    def log_prob(
        self, value: Float[ArrayLike, "*value_batch action"]
    ) -> Float[Array, "*broadcast_batch"]:
        """Log-density of an action, finite on the closed range ``[low, high]``.

        For ``samplers.Tanh``, ``distrax.Tanh``, ``samplers.BoundedTanh``,
        ``samplers.Sigmoid`` and ``distrax.Sigmoid`` (``y = c + h tanh(x / k)``, ``k = 2``
        for sigmoid): with ``d_lo = y - low`` and ``d_hi = high - y``, which float32
        holds exactly near a bound, ``x = k (log d_lo - log d_hi) / 2`` and
        ``log|f'(x)| = log d_lo + log d_hi - log(k h)``. Against the float64 change of
        variables at the same action, the error is within
        ``4 * eps * (1 + |x| |x - loc| / scale**2 + |log p|)`` per dimension
        (``eps = 2**-23`` in float32) at every distance from the bounds, strictly
        inside: it does not grow as the action nears a bound. An action on a bound
        is scored half a float step inside it (the coarser of the action's spacing
        there and, for tanh, ``tanh``'s step ``2**-24`` of the half range: ``2**-25``
        of the half range for tanh in float32, ``x ~ 9.0``; the smallest normal float
        at sigmoid's 0, ``x ~ -87.3``). Gradients with respect to the action,
        ``loc``, ``scale`` and the bounds are finite everywhere in ``[low, high]``.
        Actions outside it, or NaN, give NaN.

        Scoring a sample ``y = f(x)`` instead of its pre-image ``x`` (what
        :meth:`log_prob_from_pre_image` scores) costs what the rounding of ``y``
        lost. Strictly inside, ``y`` holds ``x`` to about
        ``k * eps * (1 + max(|low|, |high|) / h) / d``, ``d`` the distance to the
        nearer bound over the half range ``h``, so the two scores differ by at most
        the bound above plus ``|x - loc| / scale**2 + 2 / k`` times that, which
        grows as ``1 / d`` towards a bound. On a bound, the score is that of the
        point above, whatever ``x`` was.

        Other bijectors (the identity, a chain, a user's bijector) use
        ``distrax.Transformed.log_prob``, which inverts ``f``.

        Args:
            value: Actions, shape broadcastable with ``[*batch, action]`` (e.g.
                ``[*sample, *batch, action]``), as ``distrax`` broadcasts them.

        Returns:
            ``log p(value)``, the broadcast shape without its last axis.

        Raises:
            ValueError: ``value`` does not broadcast with the distribution's shape.
        """
        bounds = squashing(self.bijector)
        if bounds is None:
            return jnp.asarray(super().log_prob(value))
        action, loc, scale = self._broadcast("value", value)
        return _squashed.log_prob_from_action(bounds, action, loc, scale)

    def _broadcast(self, name: str, value) -> tuple[Array, Array, Array]:
        """``value``, ``loc`` and ``scale`` broadcast together, in their common dtype."""
        value = jnp.asarray(value)
        try:
            shape = jnp.broadcast_shapes(value.shape, self._loc.shape)
        except ValueError:
            raise ValueError(
                f"{name} must broadcast with the distribution's shape [*batch, action] = "
                f"{self._loc.shape}, got {value.shape}; give it shape [*sample, *batch, action]."
            ) from None
        dtype = jnp.result_type(value, self._loc)
        value, loc, scale = (
            jnp.broadcast_to(a, shape).astype(dtype) for a in (value, self._loc, self._scale)
        )
        return value, loc, scale

    def _sample_n_and_log_prob(self, key: PRNGKeyArray, n: int) -> tuple[Array, Array]:
        # distrax's version is the same no-inverse path, but broadcasts the base
        # Normal's parameters against the sample axis implicitly (refused under
        # jax_numpy_rank_promotion="raise"); this scores exactly the pre-image.
        pre_image = self.distribution.sample(seed=key, sample_shape=n)
        return jax.vmap(self.forward_and_log_prob)(pre_image)

    def _log_det(self, x):
        # The elementwise log-determinant, taken from the (possibly rebuilt) bijector
        # each time rather than stored, so a distribution that crossed a jit
        # boundary holds no stale reference.
        return cast(distrax.Block, self.bijector).bijector.forward_log_det_jacobian(x)

    def log_prob_from_pre_image(
        self, pre_image: Float[Array, "*batch action"]
    ) -> Float[Array, "*batch"]:
        """Log-density of the action ``f(pre_image)``, computed without inverting ``f``.

        ``base.log_prob(x) - bijector.forward_log_det_jacobian(x)``: finite for any
        finite ``x`` with the bijectors of this package and ``distrax.Tanh``.
        Gradients reach ``loc``, ``scale``, ``pre_image`` and the bijector's
        parameters.
        """
        return _squashed.log_prob_from_pre_image(self._log_det, pre_image, self._loc, self._scale)

    def forward_and_log_prob(
        self, pre_image: Float[Array, "*batch action"]
    ) -> tuple[Float[Array, "*batch action"], Float[Array, "*batch"]]:
        """The action ``f(pre_image)`` and its log-density."""
        return jnp.asarray(self.bijector.forward(pre_image)), self.log_prob_from_pre_image(
            pre_image
        )

    def sample_pre_image(self, *, seed: PRNGKeyArray) -> Float[Array, "*batch action"]:
        """Draws ``x = loc + scale * eps``, reparameterised (gradients reach loc and scale).

        ``seed`` is one key, or one typed key per batch element (shape
        ``[*batch]``, e.g. ``jax.random.split(key, n)``): each element then draws
        from its own key, so its sample does not depend on the rest of the batch.
        """
        return self._loc + self._scale * _standard_normal(seed, self._loc)

    def sample_with_pre_image(
        self, *, seed: PRNGKeyArray
    ) -> tuple[
        Float[Array, "*batch action"], Float[Array, "*batch action"], Float[Array, "*batch"]
    ]:
        """Samples ``(action, pre_image, log_prob)`` in one pass, with no inverse.

        Store ``pre_image`` to replay the action later with
        :meth:`log_prob_from_pre_image`.
        """
        pre_image = self.sample_pre_image(seed=seed)
        action, log_prob = self.forward_and_log_prob(pre_image)
        return action, pre_image, log_prob

    def deterministic_action(self) -> Float[Array, "*batch action"]:
        """``f(loc)``: the action a deterministic policy takes (the median for monotone ``f``)."""
        return jnp.asarray(self.bijector.forward(self._loc))

    def entropy_estimate(
        self, *, seed: PRNGKeyArray, num_samples: int = 1
    ) -> Float[Array, "*batch"]:
        """A reparameterised Monte Carlo estimate of the entropy, in nats.

        ``H[y] = H[x] + E[log|f'(x)|]``: the Normal's entropy in closed form plus
        the mean of ``forward_log_det_jacobian(loc + scale * eps)`` over
        ``num_samples`` draws of ``eps`` whose gradient is stopped, so gradients
        reach ``loc``, ``scale`` and the bijector's parameters. Unbiased, not
        exact: it varies with ``seed``, with a variance that falls as
        ``1 / num_samples``. One sample draws exactly ``normal(seed, loc.shape)``.
        ``seed`` may also be one key per batch element, as in
        :meth:`sample_pre_image`.
        """
        num_samples = _checks.positive_int("num_samples", num_samples)
        eps = _standard_normal(seed, self._loc, num_samples)
        return _squashed.entropy_estimate(self._log_det, self._loc, self._scale, eps)

    def entropy_quadrature(self, num_points: int = 8) -> Float[Array, "*batch"]:
        """The entropy by Gauss-Hermite quadrature of ``E[log|f'(x)|]``, in nats.

        Deterministic (no key, zero variance) and differentiable in ``loc`` and
        ``scale``, but biased: ``log|tanh'(x)|`` bends over a width of about 1, so
        the error grows with the std (8 nodes: under 3e-3 nats up to std 1.3, about
        -0.2 nats at std 4; 64 nodes: 2e-3 at std 4).
        """
        num_points = _checks.positive_int("num_points", num_points)
        nodes, weights = np.polynomial.hermite.hermgauss(num_points)
        nodes = jnp.asarray(np.sqrt(2.0) * nodes, self._loc.dtype)
        weights = jnp.asarray(weights / np.sqrt(np.pi), self._loc.dtype)
        shape = (num_points, *(1,) * self._loc.ndim)
        pre_images = self._loc[None] + self._scale[None] * nodes.reshape(shape)
        expected_log_det = jnp.tensordot(weights, self._log_det(pre_images), axes=1)
        return jnp.asarray(self.distribution.entropy()) + jnp.sum(expected_log_det, axis=-1)

    def __getitem__(self, index) -> "SquashedNormal":
        """Slices the batch shape as distrax's distributions do (``dist[0]``,
        ``dist[:, 1:]``, ``dist[..., 0]``): a ``SquashedNormal`` with the same bijector."""
        base = cast(
            distrax.Normal, cast(distrax.Independent, self.distribution[index]).distribution
        )
        loc, scale = jnp.asarray(base.loc), jnp.asarray(base.scale)
        return SquashedNormal(loc, scale, cast(distrax.Block, self.bijector).bijector)

    # The distrax.Distribution methods that distrax.Transformed leaves unimplemented
    # for a bijector whose Jacobian is not constant. For the squashings above they
    # are exact or computed by a stated method; for other bijectors distrax decides.

    def mode(self) -> Float[Array, "*batch action"]:
        """The most likely action, per dimension (the joint mode: the density factorises).

        For the squashings :meth:`log_prob` supports, ``samplers.mode(dist)`` (see
        there: not ``f(loc)``, and near a bound when the density is bimodal);
        otherwise ``distrax.Transformed.mode``, defined for a constant Jacobian.
        """
        bounds = squashing(self.bijector)
        if bounds is None:
            return jnp.asarray(super().mode())
        k = bounds.pre_image_scale
        return jnp.asarray(
            self.bijector.forward(_squashed.mode_pre_image(self._loc, self._scale, k))
        )

    def median(self) -> Float[Array, "*batch action"]:
        """``f(loc)``, each dimension's median (``f`` is increasing), as
        :meth:`deterministic_action`; ``distrax.Independent.median`` is also per
        dimension. Only for the squashings :meth:`log_prob` supports."""
        if squashing(self.bijector) is None:
            return jnp.asarray(super().median())
        return self.deterministic_action()

    def entropy(self, input_hint: Any = None) -> Float[Array, "*batch"]:
        """Refused for a squashing: no closed form exists, and a method without a key
        cannot be unbiased.

        Raises:
            NotImplementedError: the bijector's log-determinant is not constant;
                the message names :meth:`entropy_estimate` and
                :meth:`entropy_quadrature`. With a constant one (e.g. the
                identity), ``distrax.Transformed.entropy`` answers.
        """
        if self.bijector.is_constant_log_det:
            return jnp.asarray(super().entropy(input_hint))
        raise NotImplementedError(
            f"SquashedNormal.entropy has no closed form for {bijector_name(self.bijector)}; "
            f"use dist.entropy_estimate(seed=key, num_samples=n) (unbiased, reparameterised) "
            f"or dist.entropy_quadrature(num_points) (deterministic, biased for wide stds)."
        )

    def log_cdf(
        self, value: Float[ArrayLike, "*value_batch action"]
    ) -> Float[Array, "*broadcast_batch"]:
        """``log P[Y_i <= value_i for every i]``, the joint CDF of the event.

        As ``distrax.Independent`` defines it: the sum over the action axis of
        each dimension's ``log Phi((f^-1(value_i) - loc_i) / scale_i)``, with the
        pre-image taken from the distances to the bounds (exact on a bound,
        ``-inf`` at and below ``low``, 0 at and above ``high``). For the
        squashings :meth:`log_prob` supports; ``value`` broadcasts as there.
        """
        return jnp.sum(self._log_ndtr("log_cdf", "value", value, 1.0), axis=-1)

    def cdf(
        self, value: Float[ArrayLike, "*value_batch action"]
    ) -> Float[Array, "*broadcast_batch"]:
        """``P[Y_i <= value_i for every i]``, ``exp(log_cdf(value))``."""
        self._require_squashing("cdf")
        return jnp.exp(self.log_cdf(value))

    def log_survival_function(
        self, value: Float[ArrayLike, "*value_batch 1"]
    ) -> Float[Array, "*broadcast_batch"]:
        """``log P[Y > value]`` for a one-dimensional action, without cancellation.

        Raises:
            NotImplementedError: the action has more than one dimension, where
                ``P[Y > y]`` is not defined (distrax refuses it too).
        """
        self._require_one_dimension("log_survival_function", "1 - dist.cdf(value)")
        return jnp.sum(self._log_ndtr("log_survival_function", "value", value, -1.0), axis=-1)

    def survival_function(
        self, value: Float[ArrayLike, "*value_batch 1"]
    ) -> Float[Array, "*broadcast_batch"]:
        """``P[Y > value]`` for a one-dimensional action; see :meth:`log_survival_function`."""
        self._require_one_dimension("survival_function", "1 - dist.cdf(value)")
        self._require_squashing("survival_function")
        return jnp.exp(self.log_survival_function(value))

    def quantile(self, p: Float[ArrayLike, "*p_batch"]) -> Float[Array, "*broadcast_batch 1"]:
        """The action below which lies the mass ``p``, for a one-dimensional action.

        ``f(loc + scale * ndtri(p))``: exact, since ``f`` is increasing. ``p``
        broadcasts with the batch shape; ``p = 0`` and ``p = 1`` give the bounds,
        ``p`` outside ``[0, 1]`` NaN, and so does a non-finite ``loc`` or a ``scale``
        that is not positive and finite.

        Raises:
            NotImplementedError: the action has more than one dimension, where a
                quantile is not defined, or the bijector is not a supported squashing.
        """
        self._require_one_dimension("quantile", "dist.median() for the per-dimension medians")
        bounds = self._require_squashing("quantile")
        p = jnp.asarray(p)
        p = p.astype(jnp.result_type(p, self._loc))
        shape = jnp.broadcast_shapes((*p.shape, 1), self._loc.shape)
        p = jnp.broadcast_to(p[..., None], shape)
        loc, scale = (jnp.broadcast_to(a, shape) for a in (self._loc, self._scale))
        action = self.bijector.forward(loc + scale * special.ndtri(p))
        # Exactly the bounds at 0 and 1, which the affine step of BoundedTanh can miss.
        low, high = (jnp.broadcast_to(jnp.asarray(b, action.dtype), shape) for b in bounds[:2])
        action = jnp.where(p == 0, low, jnp.where(p == 1, high, action))
        return jnp.where(_squashed.valid_parameters(loc, scale), action, jnp.nan)

    def mean(self) -> Float[Array, "*batch action"]:
        """Each dimension's mean ``E[f(x)]``, by quadrature (see :meth:`variance`)."""
        bounds = squashing(self.bijector)
        if bounds is None:
            return jnp.asarray(super().mean())
        return _squashed.moments(bounds, self._loc, self._scale)[0]

    def variance(self) -> Float[Array, "*batch action"]:
        """Each dimension's variance, by quadrature; the covariance is diagonal.

        Against adaptive float64 integrals, the mean is within ``1e-6`` of the half
        range and the variance within ``1e-5`` relative in float32 (``1e-12`` and
        ``1e-10`` in float64), from ``scale / k = 1e-4`` to 10 and for means up to
        ``30 k`` (saturated), as long as the variance is at least ``2e-31`` of the
        squared half range (e.g. mean ``20 k``, scale ``k``); smaller float32
        variances lose digits and round to 0 below float32's smallest normal number.

        ``y = c + h tanh(t)``, ``t = x / k ~ N(m, s)``. For ``s <= 1/2``,
        32-node Gauss-Hermite in the Normal's variable; wider, where the
        integrand turns into a step, the trapezoidal rule (step 1/4, on 20 either
        side of the integrand's peak) of the moments integrated by parts against
        ``sech(t)**2``. Deterministic, and NaN for a non-finite ``loc`` or a
        ``scale`` that is not positive and finite.

        Raises:
            NotImplementedError: the bijector is not one of the squashings
                :meth:`log_prob` supports.
        """
        bounds = self._require_squashing("variance")
        return _squashed.moments(bounds, self._loc, self._scale)[1]

    def stddev(self) -> Float[Array, "*batch action"]:
        """``sqrt(variance())``, per dimension."""
        return jnp.sqrt(self.variance())

    def _log_ndtr(self, method: str, name: str, value, sign: float) -> Array:
        """``log Phi(sign * z)`` per dimension, ``z`` the standardized pre-image of ``value``."""
        bounds = self._require_squashing(method)
        action, loc, scale = self._broadcast(name, value)
        return special.log_ndtr(sign * _squashed.standardized_pre_image(bounds, action, loc, scale))

    def _require_squashing(self, method: str):
        bounds = squashing(self.bijector)
        if bounds is None:
            raise NotImplementedError(
                f"SquashedNormal.{method} needs an increasing squashing (samplers.Tanh, "
                f"distrax.Tanh, samplers.BoundedTanh or sigmoid), got "
                f"{bijector_name(self.bijector)}; sample and estimate it instead."
            )
        return bounds

    def _require_one_dimension(self, method: str, instead: str) -> None:
        if self._loc.shape[-1] != 1:
            raise NotImplementedError(
                f"SquashedNormal.{method} is defined for a one-dimensional action, got "
                f"{self._loc.shape[-1]} dimensions; use {instead}, or build one distribution "
                f"per dimension, e.g. SquashedNormal(dist.loc[..., i:i + 1], "
                f"dist.scale[..., i:i + 1], bijector)."
            )


def _standard_normal(seed, loc, num_samples: int | None = None):
    """Noise like ``loc``, with a leading axis of ``num_samples`` unless it is ``None``.

    From one key: ``normal(seed, [num_samples, *loc.shape])`` (without the leading
    axis for ``None``, and as ``normal(seed, loc.shape)[None]`` for one sample).
    From a key per batch element: each element draws ``[num_samples, action]``
    from its own key.
    """
    dtype, action_size = loc.dtype, loc.shape[-1]
    batch_shape = loc.shape[:-1]
    if not _is_key_array(seed) or jnp.ndim(seed) == 0:
        if num_samples is None:
            return jax.random.normal(seed, loc.shape, dtype)
        if num_samples == 1:
            return jax.random.normal(seed, loc.shape, dtype)[None]
        return jax.random.normal(seed, (num_samples, *loc.shape), dtype)
    if seed.shape != batch_shape:
        raise ValueError(
            f"seed must be one key or one key per batch element, shape {batch_shape}, got "
            f"keys of shape {seed.shape}; make them with jax.random.split(key, n)."
        )
    event_shape = (action_size,) if num_samples is None else (num_samples, action_size)
    draw = jax.vmap(lambda key: jax.random.normal(key, event_shape, dtype))
    noise = draw(seed.reshape(-1)).reshape(*batch_shape, *event_shape)
    return noise if num_samples is None else jnp.moveaxis(noise, -2, 0)


def _is_key_array(seed) -> bool:
    dtype = getattr(seed, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)


def squashed_normal(
    mean_and_std: Float[ArrayLike, "*batch params"],
    bijector: distrax.Bijector | Callable,
    *,
    min_std: float = 1e-3,
    std_scale: float = 1.0,
) -> SquashedNormal:
    """Builds a :class:`SquashedNormal` from a network output ``[mean | raw_std]``.

    The last axis (of even length ``2 * action``) splits into ``mean`` and
    ``raw_std``; ``std = (softplus(raw_std) + min_std) * std_scale``, floored at the
    smallest normal float (``1.2e-38`` in float32) so that it never rounds to zero.

    Args:
        mean_and_std: Network output, shape ``[*batch, 2 * action]``, floating.
        bijector: Elementwise squashing, e.g. ``distrax.Tanh()``,
            ``samplers.BoundedTanh(low, high)``, ``distrax.Sigmoid()``.
        min_std: Floor added to the softplus, ``>= 0``.
        std_scale: Factor applied to the std, ``> 0``.

    Returns:
        A ``SquashedNormal`` (a ``distrax.Transformed``) with batch shape
        ``[*batch]`` and event shape ``[action]``. It computes in the input's
        dtype, but float16 and bfloat16 inputs are computed (and returned) in
        float32. A NaN or infinite mean or raw std makes that dimension's mean
        NaN, so its pre-image and action and the batch element's log-density are
        NaN, never a finite wrong number (``tanh(inf)`` would be the action 1).

    Raises:
        TypeError: ``mean_and_std`` is not floating, or an option is not a number.
        ValueError: the last axis is missing or odd, or an option is out of range.

    Example:
        >>> import distrax, jax.numpy as jnp, samplers
        >>> dist = samplers.squashed_normal(jnp.zeros((4, 6)), distrax.Sigmoid())
        >>> dist.batch_shape, dist.event_shape
        ((4,), (3,))
    """
    mean_and_std = _checks.float_array("mean_and_std", mean_and_std)
    min_std = _checks.real_number("min_std", min_std, minimum=0.0)
    std_scale = _checks.real_number("std_scale", std_scale, above=0.0)
    if mean_and_std.ndim < 1 or mean_and_std.shape[-1] % 2 or mean_and_std.shape[-1] == 0:
        raise ValueError(
            f"mean_and_std must have a last axis of even length 2 * action_dim "
            f"([mean | raw_std]), got shape {mean_and_std.shape}."
        )
    mean_and_std = mean_and_std.astype(_computing_dtype(mean_and_std.dtype))
    mean, raw_std = jnp.split(mean_and_std, 2, axis=-1)
    # A non-finite parameter makes its dimension NaN: f(+-inf) would be a finite action.
    mean = jnp.where(jnp.isfinite(mean) & jnp.isfinite(raw_std), mean, jnp.nan)
    # Floored at the smallest normal float: below it XLA flushes the std to zero.
    std = jnp.maximum((softplus(raw_std) + min_std) * std_scale, jnp.finfo(raw_std.dtype).tiny)
    return SquashedNormal(mean, std, bijector)


def normal_tanh(
    mean_and_std: Float[ArrayLike, "*batch params"],
    *,
    min_std: float = 1e-3,
    std_scale: float = 1.0,
) -> SquashedNormal:
    """Builds ``Transformed(Normal(mean, std), Tanh)`` from ``[mean | raw_std]``.

    :func:`squashed_normal` with :class:`samplers.Tanh` (``distrax.Tanh`` with a
    cheaper derivative); see there for the arguments.

    Example:
        >>> import jax.numpy as jnp, samplers
        >>> dist = samplers.normal_tanh(jnp.array([0.0, 0.0, 0.5413, 0.5413]))
        >>> dist.scale.round(3), dist.deterministic_action()
        (Array([1.001, 1.001], dtype=float32), Array([0., 0.], dtype=float32))
    """
    return squashed_normal(mean_and_std, Tanh(), min_std=min_std, std_scale=std_scale)


# A module-level instance, so that the default is not a call in the signature.
_TANH = Tanh()


def squashed_normal_from_std(
    mean: Float[ArrayLike, "*batch action"],
    std: Float[ArrayLike, "*batch action"],
    bijector: distrax.Bijector | Callable = _TANH,
    *,
    min_std: float = 0.0,
) -> SquashedNormal:
    """Builds a :class:`SquashedNormal` from a mean and a standard deviation.

    ``std + min_std`` is floored at the smallest normal float (``1.2e-38`` in
    float32), as in :func:`squashed_normal`, so that a std that underflowed to 0
    stays positive. Values are not checked (they cannot be inside ``jax.jit``):
    as in :func:`squashed_normal`, a NaN or infinite ``mean`` or ``std``, or a
    negative ``std``, makes that dimension's mean NaN, so its samples, actions
    (also the deterministic one), log-densities and moments are NaN, never a
    finite number.

    Args:
        mean: Means of the base Normal, shape ``[*batch, action]``, floating.
        std: Standard deviations, the same shape, floating, ``> 0``.
        bijector: Elementwise squashing, ``samplers.Tanh()`` by default; e.g.
            ``samplers.BoundedTanh(low, high)``, ``samplers.Sigmoid()``.
        min_std: Added to ``std``, ``>= 0``.

    Returns:
        A ``SquashedNormal`` with batch shape ``[*batch]`` and event shape
        ``[action]``, in the inputs' common dtype; float16 and bfloat16 are
        computed (and returned) in float32.

    Raises:
        TypeError: ``mean`` or ``std`` is not floating, or ``min_std`` is not a number.
        ValueError: the shapes differ or have no action axis, or ``min_std < 0``.

    Example:
        >>> import jax.numpy as jnp, samplers
        >>> dist = samplers.squashed_normal_from_std(jnp.zeros(2), jnp.array([0.5, -1.0]))
        >>> dist.scale
        Array([0.5, nan], dtype=float32)
    """
    mean, std = _mean_and_spread("std", mean, std)
    min_std = _checks.real_number("min_std", min_std, minimum=0.0)
    valid = jnp.isfinite(mean) & jnp.isfinite(std) & (std >= 0)
    # f(+-inf) would be a finite action: an invalid parameter makes its dimension NaN.
    mean = jnp.where(valid, mean, jnp.nan)
    std = jnp.where(valid, jnp.maximum(std + min_std, jnp.finfo(std.dtype).tiny), jnp.nan)
    return SquashedNormal(mean, std, bijector)


def squashed_normal_from_log_std(
    mean: Float[ArrayLike, "*batch action"],
    log_std: Float[ArrayLike, "*batch action"],
    bijector: distrax.Bijector | Callable = _TANH,
    *,
    log_std_min: float | None = None,
    log_std_max: float | None = None,
) -> SquashedNormal:
    """Builds a :class:`SquashedNormal` from a mean and a log standard deviation.

    ``std = exp(clip(log_std, log_std_min, log_std_max))``, each bound optional
    (SAC implementations commonly clip to ``[-20, 2]`` or ``[-5, 2]``; the clip
    stops the gradient outside the bounds, as theirs does), then floored at the
    smallest normal float as in :func:`squashed_normal` (``exp(log_std)`` falls
    below it from ``log_std ~ -87.3`` in float32). As in :func:`squashed_normal`, a
    NaN or infinite ``mean`` or ``log_std`` (checked before the clip) makes that
    dimension's mean NaN, so everything computed from it is NaN.

    Args:
        mean: Means of the base Normal, shape ``[*batch, action]``, floating.
        log_std: Natural logarithms of the standard deviations, the same shape,
            floating.
        bijector: Elementwise squashing, ``samplers.Tanh()`` by default.
        log_std_min: Lower clip of ``log_std``, or ``None`` for none.
        log_std_max: Upper clip of ``log_std``, or ``None`` for none.

    Returns:
        A ``SquashedNormal`` as :func:`squashed_normal_from_std` returns it.

    Raises:
        TypeError: ``mean`` or ``log_std`` is not floating, or a bound is not a number.
        ValueError: the shapes differ or have no action axis, a bound is not
            finite, or ``log_std_min > log_std_max``.

    Example:
        >>> import jax.numpy as jnp, samplers
        >>> log_std = jnp.array([-30.0, 0.0, 5.0])
        >>> dist = samplers.squashed_normal_from_log_std(
        ...     jnp.zeros(3), log_std, log_std_min=-20.0, log_std_max=2.0
        ... )
        >>> dist.scale
        Array([2.061e-09, 1.000e+00, 7.389e+00], dtype=float32)
    """
    mean, log_std = _mean_and_spread("log_std", mean, log_std)
    if log_std_min is not None:
        log_std_min = _checks.real_number("log_std_min", log_std_min)
    if log_std_max is not None:
        log_std_max = _checks.real_number("log_std_max", log_std_max)
    if log_std_min is not None and log_std_max is not None and log_std_min > log_std_max:
        raise ValueError(
            f"log_std_min must be <= log_std_max, got {log_std_min} > {log_std_max}; "
            f"swap them (e.g. log_std_min=-20.0, log_std_max=2.0)."
        )
    mean = jnp.where(jnp.isfinite(mean) & jnp.isfinite(log_std), mean, jnp.nan)
    std = jnp.exp(jnp.clip(log_std, log_std_min, log_std_max))
    std = jnp.maximum(std, jnp.finfo(std.dtype).tiny)
    return SquashedNormal(mean, std, bijector)


def _mean_and_spread(name: str, mean, spread) -> tuple[Array, Array]:
    """``mean`` and ``spread`` (std or log-std) checked, in one dtype of at least 32 bits."""
    mean = _checks.float_array("mean", mean)
    spread = _checks.float_array(name, spread)
    if mean.ndim < 1:
        raise ValueError(
            f"mean and {name} need an action axis, shape [*batch, action], got "
            f"{mean.shape}; for one action dimension use shape (1,)."
        )
    if mean.shape != spread.shape:
        raise ValueError(
            f"mean and {name} must have the same shape [*batch, action], got {mean.shape} "
            f"and {spread.shape}; broadcast them yourself (e.g. a state-independent {name} "
            f"with jnp.broadcast_to({name}, mean.shape))."
        )
    dtype = _computing_dtype(jnp.result_type(mean, spread))
    return mean.astype(dtype), spread.astype(dtype)


def _computing_dtype(dtype):
    """float16 and bfloat16 lose the tails of log-densities: they compute in float32."""
    return jnp.float32 if jnp.finfo(dtype).bits < 32 else dtype


def _check_keeps_shape(bijector: distrax.Bijector, loc) -> None:
    """Refuses a bijector that would broadcast the action into another shape."""
    spec = jax.ShapeDtypeStruct(jnp.shape(loc), jnp.result_type(loc))
    try:
        out_shape = jax.eval_shape(bijector.forward, spec).shape
    except (TypeError, ValueError) as error:
        out_shape = f"an error ({error})"
    if out_shape != spec.shape:
        raise ValueError(
            f"bijector {bijector.name} maps actions of shape {spec.shape} to {out_shape}; "
            f"its parameters (e.g. bounds) must have shape () or (action_dim,) = "
            f"({spec.shape[-1]},)."
        )
