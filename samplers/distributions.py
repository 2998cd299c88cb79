"""The pure layer: network outputs in, a ``distrax`` distribution out.

``normal_tanh`` and ``squashed_normal`` turn a vector ``[mean | raw_std]`` into a
:class:`SquashedNormal` (``squashed_normal_from_std`` and
``squashed_normal_from_log_std`` take the two halves separately), a
``distrax.Transformed`` with the few operations that a policy head needs and
distrax lacks: scoring a stored pre-image, sampling the action and its pre-image
together, the deterministic action and a reparameterised entropy estimate; and
the ``distrax.Distribution`` methods (``log_prob`` exact for its own samples and
finite on the bounds, ``entropy``, ``mode``, moments, CDF, KL) that
``distrax.Transformed`` leaves NaN, wrong or unimplemented. Functions of arrays and
keys only; no state (a sample's pre-image is remembered by the array's identity, as
TFP's bijector cache does).
"""

import weakref
from collections.abc import Callable, Sequence
from typing import Any, cast

import distrax
import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy import special
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray
from tensorflow_probability.substrates import jax as tfp

from samplers import _checks, _squashed
from samplers._numerics import log_ndtr, softplus
from samplers.bijectors import BoundedTanh, Tanh, bijector_name, same_map, squashing

tfd = tfp.distributions
# distrax's own argument types for sample(): an integer seed or a key.
_Int = int | np.int16 | np.int32 | np.int64
_Seed = _Int | PRNGKeyArray
_SampleShape = _Int | Sequence[_Int]


class SquashedNormal(distrax.Transformed):
    """A diagonal Normal over the last axis pushed through an elementwise bijector.

    ``x = loc + scale * eps`` with ``eps ~ N(0, I)``, and the action is
    ``y = f(x)`` for an elementwise bijector ``f`` such as tanh. The density is
    ``log p(y) = log N(x; loc, scale) - sum log|f'(x)|``.

    A sample remembers its pre-image, as TFP's bijector cache does:
    ``dist.log_prob(a)`` of the very array ``a`` that :meth:`sample` (or
    :meth:`sample_and_log_prob`, :meth:`sample_with_pre_image`, :meth:`mode`,
    :meth:`median`) returned scores the pre-image ``x`` that produced it, so its
    value and gradient are those of :meth:`log_prob_from_pre_image`, also when ``a``
    rounded onto a bound. Any other action (a copy, a stored action) is scored from
    its distances to the bounds (see :meth:`log_prob`). To replay an action later,
    store its pre-image and score it with :meth:`log_prob_from_pre_image`.

    Parameters are not checked (they cannot be inside ``jax.jit``): a NaN or
    infinite ``loc`` or ``scale``, or a ``scale`` that is not positive, makes that
    dimension's ``loc`` and ``scale`` NaN, so everything computed from it is NaN,
    never a finite number (``tanh(inf)`` would be the action 1).

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
        >>> dist = samplers.SquashedNormal(jnp.full(2, 10.0), jnp.full(2, 0.1), distrax.Tanh())
        >>> action = dist.sample(seed=jax.random.key(0))  # rounds to 1.0
        >>> action, dist.log_prob(action)  # distrax.Transformed gives NaN
        (Array([1., 1.], dtype=float32), Array(37.357, dtype=float32))
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
        valid = _squashed.valid_parameters(loc, scale)
        loc, scale = (jnp.where(valid, a, jnp.nan) for a in (loc, scale))
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

    @property
    def _elementwise(self) -> distrax.Bijector:
        # Taken from the (possibly rebuilt) Block each time rather than stored, so
        # that a distribution that crossed a jit boundary holds no stale reference.
        return cast(distrax.Block, self.bijector).bijector

    def _log_det(self, x):
        return self._elementwise.forward_log_det_jacobian(x)

    def _forward(self, pre_image) -> Array:
        """``f(pre_image)``; for the squashings, differentiated with ``f'(x) > 0`` also
        where ``f(x)`` rounds onto a bound (autodiff of float32 ``tanh`` gives 0 there)."""
        action = jnp.asarray(self.bijector.forward(pre_image))
        bounds = squashing(self.bijector)
        return action if bounds is None else _squashed.forward(bounds, pre_image, action)

    def _remember(self, pre_image) -> Array:
        """``f(pre_image)``, remembered with its pre-image for :meth:`log_prob`."""
        action = self._forward(pre_image)
        _PRE_IMAGES.remember(action, pre_image, self._elementwise)
        return action

    def log_prob(
        self, value: Float[ArrayLike, "*value_batch action"]
    ) -> Float[Array, "*broadcast_batch"]:
        """Log-density of an action.

        An array returned by this object's sampling methods is scored at its own
        pre-image (see the class docstring), exactly as :meth:`sample_and_log_prob`
        scores it. Any other action is scored without inverting ``f`` with
        ``atanh`` (NaN on a bound in ``distrax.Transformed``), for ``samplers.Tanh``,
        ``distrax.Tanh``, ``samplers.BoundedTanh`` and both sigmoids, from its
        distances to the bounds:

        - strictly inside ``(low, high)``: the log-density at that action,
          within the bound that the guarantees page states, with finite gradients
          with respect to the action, ``loc``, ``scale`` and the bounds;
        - on a bound: not a density but the log-probability of the atom that
          float rounding puts there, ``log P[f(X) rounds to the bound]``, i.e.
          ``log P[X >= x_r]`` at ``high`` (``log P[X <= x_r]`` at ``low``) for
          ``x_r`` the pre-image of the point half a float step inside the bound.
          Its gradient moves mass towards the bound, as a sample there asks;
          scoring a fixed point instead would pull ``loc`` back from a bound that
          the policy is right to saturate;
        - outside ``[low, high]``, or NaN: NaN.

        Other bijectors (the identity, a chain, a user's bijector) use
        ``distrax.Transformed.log_prob``, which inverts ``f``.

        Args:
            value: Actions, shape broadcastable with ``[*batch, action]`` (e.g.
                ``[*sample, *batch, action]``), as ``distrax`` broadcasts them.

        Returns:
            ``log p(value)``, the broadcast shape without its last axis.

        Raises:
            ValueError: ``value`` does not broadcast with the distribution's shape.

        Example:
            >>> import jax.numpy as jnp, samplers
            >>> dist = samplers.squashed_normal_from_std(jnp.array([3.0]), jnp.array([1.0]))
            >>> dist.log_prob(jnp.array([0.5])), dist.log_prob(jnp.array([1.0]))  # on the bound
            (Array(-3.634, dtype=float32), Array(-20.804, dtype=float32))
        """
        pre_image = _PRE_IMAGES.recall(value, self._elementwise)
        if pre_image is not None:
            return self.log_prob_from_pre_image(pre_image)
        bounds = squashing(self.bijector)
        if bounds is None:
            return jnp.asarray(super().log_prob(value))
        action, loc, scale = self._broadcast("value", value)
        return _squashed.log_prob_from_action(bounds, action, loc, scale)

    def _broadcast(self, name: str, value) -> tuple[Array, Array, Array]:
        """``value``, ``loc`` and ``scale`` broadcast together, in their common dtype."""
        value = _checks.float_array(name, value)
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

    def sample(
        self, *, seed: _Seed, sample_shape: _SampleShape = ()
    ) -> Float[Array, "*sample_and_batch action"]:
        """Samples actions, ``distrax.Transformed.sample``'s draws, remembering their pre-images.

        Example:
            >>> import jax, jax.numpy as jnp, samplers
            >>> dist = samplers.normal_tanh(jnp.zeros((5, 4)))
            >>> dist.sample(seed=jax.random.key(0), sample_shape=3).shape
            (3, 5, 2)
        """
        return self._remember(self.distribution.sample(seed=seed, sample_shape=sample_shape))

    def sample_and_log_prob(
        self, *, seed: _Seed, sample_shape: _SampleShape = ()
    ) -> tuple[Float[Array, "*sample_and_batch action"], Float[Array, "*sample_and_batch"]]:
        """Samples actions and scores their pre-images, with no inverse.

        The same draws as :meth:`sample`; the log-densities are those of
        :meth:`log_prob_from_pre_image`. distrax's version broadcasts the base
        Normal's parameters against the sample axis implicitly, which
        ``jax_numpy_rank_promotion="raise"`` refuses.
        """
        pre_image = self.distribution.sample(seed=seed, sample_shape=sample_shape)
        return self._remember(pre_image), self.log_prob_from_pre_image(pre_image)

    def log_prob_from_pre_image(
        self, pre_image: Float[ArrayLike, "*sample_and_batch action"]
    ) -> Float[Array, "*sample_and_batch"]:
        """Log-density of the action ``f(pre_image)``, computed without inverting ``f``.

        ``base.log_prob(x) - bijector.forward_log_det_jacobian(x)``: finite for any
        finite ``x`` with the bijectors of this package and ``distrax.Tanh``.
        Gradients reach ``loc``, ``scale``, ``pre_image`` and the bijector's
        parameters. ``pre_image`` broadcasts with ``[*batch, action]`` as in
        :meth:`log_prob`.

        Raises:
            TypeError: ``pre_image`` is not floating.
            ValueError: ``pre_image`` does not broadcast with the distribution's shape.

        Example:
            >>> import jax.numpy as jnp, samplers
            >>> dist = samplers.normal_tanh(jnp.zeros(2))
            >>> dist.log_prob_from_pre_image(jnp.array([20.0]))  # tanh(20) rounds to 1
            Array(-377.02, dtype=float32)
        """
        pre_image, loc, scale = self._broadcast("pre_image", pre_image)
        return _squashed.log_prob_from_pre_image(self._log_det, pre_image, loc, scale)

    def forward_and_log_prob(
        self, pre_image: Float[ArrayLike, "*sample_and_batch action"]
    ) -> tuple[Float[Array, "*sample_and_batch action"], Float[Array, "*sample_and_batch"]]:
        """The action ``f(pre_image)`` and its log-density (:meth:`log_prob_from_pre_image`).

        The action's derivative with respect to ``pre_image`` is ``f'(x)``, positive
        also where float32 ``f(x)`` rounds onto a bound (autodiff of ``tanh`` gives
        0 there), so ``Q(s, f(x))`` keeps its pathwise gradient.
        """
        log_prob = self.log_prob_from_pre_image(pre_image)
        return self._forward(pre_image), log_prob

    def sample_pre_image(self, *, seed: PRNGKeyArray | int) -> Float[Array, "*batch action"]:
        """Draws ``x = loc + scale * eps``, reparameterised (gradients reach loc and scale).

        ``seed`` is one key (or an integer, as in distrax), or one typed key per
        batch element (shape ``[*batch]``, e.g. ``jax.random.split(key, n)``): each
        element then draws from its own key, so its sample does not depend on the
        rest of the batch.
        """
        return self._loc + self._scale * _standard_normal(seed, self._loc)

    def sample_with_pre_image(
        self, *, seed: PRNGKeyArray | int
    ) -> tuple[
        Float[Array, "*batch action"], Float[Array, "*batch action"], Float[Array, "*batch"]
    ]:
        """Samples ``(action, pre_image, log_prob)`` in one pass, with no inverse.

        The draw of :meth:`sample_pre_image`. Store ``pre_image`` to replay the
        action later with :meth:`log_prob_from_pre_image`.
        """
        pre_image = self.sample_pre_image(seed=seed)
        return self._remember(pre_image), pre_image, self.log_prob_from_pre_image(pre_image)

    def deterministic_action(self) -> Float[Array, "*batch action"]:
        """``f(loc)``: the action a deterministic policy takes (the median for monotone ``f``)."""
        return self._remember(self._loc)

    def entropy_estimate(
        self, *, seed: PRNGKeyArray | int, num_samples: int = 1
    ) -> Float[Array, "*batch"]:
        """A reparameterised Monte Carlo estimate of the entropy, in nats.

        ``H[y] = H[x] + E[log|f'(x)|]``: the Normal's entropy in closed form plus
        the mean of ``forward_log_det_jacobian(loc + scale * eps)`` over
        ``num_samples`` draws of ``eps`` whose gradient is stopped, so gradients
        reach ``loc``, ``scale`` and the bijector's parameters. Unbiased, not
        exact (:meth:`entropy` is): it varies with ``seed``, with a variance that
        falls as ``1 / num_samples``. One sample draws exactly
        ``normal(seed, loc.shape)``. ``seed`` may also be one key per batch
        element, as in :meth:`sample_pre_image`.
        """
        num_samples = _checks.positive_int("num_samples", num_samples)
        eps = _standard_normal(seed, self._loc, num_samples)
        return _squashed.entropy_estimate(self._log_det, self._loc, self._scale, eps)

    def entropy_quadrature(self, num_points: int = 8) -> Float[Array, "*batch"]:
        """The entropy by Gauss-Hermite quadrature of ``E[log|f'(x)|]``, in nats.

        Deterministic and differentiable, for any bijector, but biased for wide
        stds, where ``log|tanh'(x)|`` bends within the nodes' spacing (see the
        guarantees page); :meth:`entropy` is exact for the squashings.

        Raises:
            ValueError: ``num_points`` is not in ``[1, 256]``.
        """
        num_points = _checks.positive_int("num_points", num_points)
        if num_points > _MAX_HERMITE_POINTS:
            raise ValueError(
                f"num_points must be at most {_MAX_HERMITE_POINTS}, got {num_points} "
                f"(NumPy's Gauss-Hermite weights overflow beyond about 300 nodes); for a "
                f"squashing use dist.entropy(), which is exact."
            )
        nodes, weights = np.polynomial.hermite.hermgauss(num_points)
        nodes = jnp.asarray(np.sqrt(2.0) * nodes, self._loc.dtype)
        weights = jnp.asarray(weights / np.sqrt(np.pi), self._loc.dtype)
        shape = (num_points, *(1,) * self._loc.ndim)
        pre_images = self._loc[None] + self._scale[None] * nodes.reshape(shape)
        expected_log_det = jnp.tensordot(weights, self._log_det(pre_images), axes=1)
        return jnp.asarray(self.distribution.entropy()) + jnp.sum(expected_log_det, axis=-1)

    def entropy(self, input_hint: Any = None) -> Float[Array, "*batch"]:
        """The exact entropy of the action, in nats, summed over the action axis.

        ``H[f(X)] = H[X] + E[log f'(X)]`` with the expectation computed by a
        fixed quadrature, so deterministic and differentiable with respect to
        ``loc``, ``scale`` and the bounds; its error is stated and tested on the
        guarantees page (under ``1e-8`` nats per dimension in float64). For
        ``samplers.Tanh``, ``distrax.Tanh``, ``samplers.BoundedTanh`` and both
        sigmoids; for a constant log-determinant (e.g. the identity),
        ``distrax.Transformed.entropy``.

        Raises:
            NotImplementedError: any other bijector; the message names
                :meth:`entropy_estimate` and :meth:`entropy_quadrature`.

        Example:
            >>> import jax.numpy as jnp, samplers
            >>> samplers.normal_tanh(jnp.array([0.0, 0.5413])).entropy()  # std 1
            Array(0.6696, dtype=float32)
        """
        if self.bijector.is_constant_log_det:
            return jnp.asarray(super().entropy(input_hint))
        bounds = squashing(self.bijector)
        if bounds is None:
            raise NotImplementedError(
                f"SquashedNormal.entropy has no exact form for {bijector_name(self.bijector)}; "
                f"use dist.entropy_estimate(seed=key, num_samples=n) (unbiased, "
                f"reparameterised) or dist.entropy_quadrature(num_points) (deterministic)."
            )
        return _squashed.entropy(bounds, self._loc, self._scale)

    def kl_divergence(self, other_dist, **kwargs) -> Float[Array, "*batch"]:
        """``KL(self || other_dist)``; for two ``SquashedNormal`` with one squashing, exact.

        A KL divergence does not change when both distributions are pushed through
        the same bijection, so it is the KL of the base diagonal Normals, summed
        over the action axis, with ``s_p**2 / s_q**2 - 1 - 2 log(s_p / s_q)``
        computed as ``expm1(2 t) - 2 t`` (``t = log(s_p / s_q)``) so that close
        stds keep their digits. The bijectors are compared by type and parameters
        (:func:`samplers.bijectors.same_map`), not by tracing as distrax does (which
        does not see the values of bounds). Bounds traced inside ``jax.jit`` or
        ``jax.vmap`` have no values when this runs: they are compared when the
        program runs, and where they differ the KL is NaN.

        Raises:
            ValueError: the bijectors differ or cannot be shown to be the same, or
                the action sizes or batch shapes do not match.
            NotImplementedError: ``other_dist`` is a ``distrax.Transformed`` that
                is not a ``SquashedNormal``.

        Example:
            >>> import jax.numpy as jnp, samplers
            >>> p = samplers.SquashedNormal(jnp.zeros(2), jnp.ones(2), samplers.Tanh())
            >>> q = samplers.SquashedNormal(jnp.ones(2), jnp.ones(2), samplers.Tanh())
            >>> p.kl_divergence(q)
            Array(1., dtype=float32)
        """
        return jnp.asarray(super().kl_divergence(other_dist, **kwargs))

    def __getitem__(self, index) -> "SquashedNormal":
        """Slices the batch shape as distrax's distributions do (``dist[0]``,
        ``dist[:, 1:]``, ``dist[..., 0]``): a ``SquashedNormal`` with the same bijector."""
        base = cast(
            distrax.Normal, cast(distrax.Independent, self.distribution[index]).distribution
        )
        loc, scale = jnp.asarray(base.loc), jnp.asarray(base.scale)
        return SquashedNormal(loc, scale, self._elementwise)

    # The distrax.Distribution methods that distrax.Transformed leaves unimplemented
    # for a bijector whose Jacobian is not constant. For the squashings above they
    # are exact or computed by a stated method; for other bijectors distrax decides.

    def mode(self) -> Float[Array, "*batch action"]:
        """The most likely action, per dimension (the joint mode: the density factorises).

        For the squashings :meth:`log_prob` supports, ``samplers.mode(dist)`` (see
        there: not ``f(loc)``, and near a bound when the density is bimodal);
        otherwise ``distrax.Transformed.mode``, defined for a constant Jacobian.
        Gradients are stopped.
        """
        bounds = squashing(self.bijector)
        if bounds is None:
            return jnp.asarray(super().mode())
        k = bounds.pre_image_scale
        return self._remember(_squashed.mode_pre_image(self._loc, self._scale, k))

    def median(self) -> Float[Array, "*batch action"]:
        """``f(loc)``, each dimension's median (``f`` is increasing), as
        :meth:`deterministic_action`; ``distrax.Independent.median`` is also per
        dimension. Only for the squashings :meth:`log_prob` supports."""
        if squashing(self.bijector) is None:
            return jnp.asarray(super().median())
        return self.deterministic_action()

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
        broadcasts with the batch shape; ``p = 0`` and ``p = 1`` give the bounds
        (there the gradient is 0 with respect to ``loc`` and ``scale``, 1 with
        respect to that bound, and ``+inf`` with respect to ``p``: the density
        vanishes at the bounds); ``p`` outside ``[0, 1]`` gives NaN, and so does a
        non-finite ``loc`` or a ``scale`` that is not positive and finite.

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
        low, high = (jnp.broadcast_to(jnp.asarray(b, p.dtype), shape) for b in bounds[:2])
        # ndtri(0) = -inf: the edges take the bounds exactly (which the affine step of
        # BoundedTanh can miss), and the branch not taken must not make gradients NaN.
        inside = jnp.where((p == 0) | (p == 1), 0.5, p)
        action = self._forward(loc + scale * special.ndtri(inside))
        action = jnp.where(p == 0, low, jnp.where(p == 1, high, action)) + _edge_slope(p)
        return jnp.where(_squashed.valid_parameters(loc, scale), action, jnp.nan)

    def mean(self) -> Float[Array, "*batch action"]:
        """Each dimension's mean ``E[f(x)]``, by quadrature (see :meth:`variance`)."""
        bounds = squashing(self.bijector)
        if bounds is None:
            return jnp.asarray(super().mean())
        return _squashed.moments(bounds, self._loc, self._scale)[0]

    def variance(self) -> Float[Array, "*batch action"]:
        """Each dimension's variance, by quadrature; the covariance is diagonal.

        Deterministic and differentiable; NaN for a non-finite ``loc`` or a ``scale``
        that is not positive and finite. Its error against float64 integrals is
        stated and tested on the guarantees page.

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
        return log_ndtr(sign * _squashed.standardized_pre_image(bounds, action, loc, scale))

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


# NumPy's Gauss-Hermite weights overflow to NaN beyond about 300 nodes.
_MAX_HERMITE_POINTS = 256


class _PreImageCache:
    """Which pre-image produced an action array, as TFP's bijector cache keeps it.

    Keyed by the array's identity (a ``jax.Array``, or a tracer of the current
    trace), which is what ``dist.log_prob(dist.sample(seed=key))`` passes back;
    an entry is dropped when its array is garbage-collected.
    """

    def __init__(self):
        self._entries: dict[int, tuple[weakref.ref, Array, distrax.Bijector]] = {}

    def remember(self, action, pre_image, bijector: distrax.Bijector) -> None:
        key = id(action)

        def forget(ref):
            if self._entries.get(key, (None,))[0] is ref:
                del self._entries[key]

        self._entries[key] = (weakref.ref(action, forget), pre_image, bijector)

    def recall(self, action, bijector: distrax.Bijector) -> Array | None:
        """The pre-image of ``action`` if it was remembered for the same map."""
        entry = self._entries.get(id(action))
        if entry is None or entry[0]() is not action or same_map(entry[2], bijector) is not True:
            return None
        return entry[1]


_PRE_IMAGES = _PreImageCache()


@jax.custom_jvp
def _edge_slope(p):
    """Zero, with the derivative of a quantile at ``p = 0`` and ``p = 1``: ``+inf``."""
    return jnp.zeros_like(p)


@_edge_slope.defjvp
def _edge_slope_jvp(primals, tangents):
    (p,), (p_dot,) = primals, tangents
    return jnp.zeros_like(p), jnp.where((p == 0) | (p == 1), jnp.inf, 0.0) * p_dot


def _kl_divergence(p: SquashedNormal, q: SquashedNormal, *_, **__) -> Array:
    """``KL(p || q)`` of two squashed Normals that share their bijector (see the method)."""
    same = _same_bijector(p._elementwise, q._elementwise)
    try:
        shape = jnp.broadcast_shapes(p.loc.shape, q.loc.shape)
    except ValueError:
        shape = None
    if shape is None or p.loc.shape[-1] != q.loc.shape[-1]:
        raise ValueError(
            f"p and q must have the same action size and broadcastable batch shapes, got "
            f"loc shapes {p.loc.shape} and {q.loc.shape}."
        )
    loc_p, scale_p, loc_q, scale_q = (
        jnp.broadcast_to(a, shape) for a in (p.loc, p.scale, q.loc, q.scale)
    )
    log_ratio = jnp.log(scale_p) - jnp.log(scale_q)
    per_dimension = 0.5 * (
        jnp.expm1(2.0 * log_ratio) - 2.0 * log_ratio + jnp.square((loc_p - loc_q) / scale_q)
    )
    if same is not True:
        # Bounds traced inside jax.jit or jax.vmap are compared when the program runs.
        per_dimension = jnp.where(jnp.all(same), per_dimension, jnp.nan)
    return jnp.sum(per_dimension, axis=-1)


def _same_bijector(f: distrax.Bijector, g: distrax.Bijector) -> bool | Array:
    """``same_map(f, g)``, raising where it is False at trace time."""
    same = same_map(f, g)
    if same is not False:
        return same
    if type(f) is BoundedTanh and type(g) is BoundedTanh:
        raise ValueError(
            f"p and q must share their bijector, got BoundedTanh(low={f.low}, "
            f"high={f.high}) and BoundedTanh(low={g.low}, high={g.high}); with different "
            f"bounds the supports differ and the KL is not that of the base Normals."
        )
    raise ValueError(
        f"p and q must share their bijector, got {bijector_name(f)} and "
        f"{bijector_name(g)} that cannot be shown to be the same map; build both "
        f"with the same bijector instance."
    )


def _kl_refused(p, q, *_, **__):
    raise NotImplementedError(
        f"the KL divergence between a {type(p).__name__} and a {type(q).__name__} is not "
        f"known to be that of their base distributions; build both as "
        f"samplers.SquashedNormal with the same bijector."
    )


tfd.RegisterKL(SquashedNormal, SquashedNormal)(_kl_divergence)
tfd.RegisterKL(SquashedNormal, distrax.Transformed)(_kl_refused)
tfd.RegisterKL(distrax.Transformed, SquashedNormal)(_kl_refused)


def _standard_normal(seed, loc, num_samples: int | None = None):
    """Noise like ``loc``, with a leading axis of ``num_samples`` unless it is ``None``.

    From one key (or an integer seed, as distrax takes): ``normal(seed,
    [num_samples, *loc.shape])`` (without the leading axis for ``None``, and as
    ``normal(seed, loc.shape)[None]`` for one sample). From a key per batch
    element: each element draws ``[num_samples, action]`` from its own key.
    """
    if isinstance(seed, (int, np.integer)):
        seed = jax.random.PRNGKey(int(seed))  # as distrax takes integer seeds
    seed = cast(Array, seed)
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
    stops the gradient strictly outside the bounds and passes it whole on them,
    as PyTorch's ``clamp`` does), then floored at the
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
    # Clipped with where: jnp.clip halves the gradient of a log_std on a bound.
    if log_std_min is not None:
        log_std = jnp.where(log_std < log_std_min, log_std_min, log_std)
    if log_std_max is not None:
        log_std = jnp.where(log_std > log_std_max, log_std_max, log_std)
    std = jnp.exp(log_std)
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
