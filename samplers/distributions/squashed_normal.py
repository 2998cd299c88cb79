"""``SquashedNormal``: a diagonal Normal pushed through an elementwise squashing.

A ``distrax.Transformed`` with the few operations that a policy head needs and
distrax lacks (scoring a stored pre-image, sampling the action and its pre-image
together, the deterministic action, entropy estimates) and the
``distrax.Distribution`` methods that ``distrax.Transformed`` leaves NaN, wrong or
unimplemented (``log_prob`` on the bounds, ``entropy``, ``mode``, moments, CDF,
quantile, KL, registered with TFP). Functions of arrays and keys only; no state (a
sample's pre-image is remembered by the array's identity, as TFP's bijector cache
does). The constructors from network outputs are in
:mod:`samplers.distributions.constructors`; how each method computes, and the
error bounds that the tests check, are on the documentation's guarantees page.
"""

from collections.abc import Callable
from typing import Any, cast

import distrax
import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy import special
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray
from tensorflow_probability.substrates import jax as tfp

from samplers import _checks
from samplers._numerics import log_ndtr, with_slope
from samplers.distributions import _keys, _squashed
from samplers.distributions.bijectors import bijector_name, same_map, squashing
from samplers.distributions.pre_image import PreImageReplay

tfd = tfp.distributions


class SquashedNormal(PreImageReplay):
    """A diagonal Normal over the last axis pushed through an elementwise bijector.

    ``x = loc + scale * eps`` with ``eps ~ N(0, I)``, and the action is
    ``y = f(x)`` for an elementwise bijector ``f`` such as tanh. The density is
    ``log p(y) = log N(x; loc, scale) - sum log|f'(x)|``, the sum over the action
    axis. Shapes: ``loc`` and ``scale`` are ``[*batch, action]``; the batch shape is
    ``[*batch]`` and the event shape ``[action]``, so an action is
    ``[*batch, action]`` and its log-density ``[*batch]``. For the squashings onto
    bounds (``samplers.Tanh``, ``distrax.Tanh``, ``samplers.BoundedTanh``, both
    sigmoids, and any bijector that declares a :class:`samplers.Squashing`) the
    methods that ``distrax.Transformed`` leaves unimplemented (``entropy``,
    ``mode``, ``median``, moments, CDF, quantile) are exact or computed by a stated
    method; other bijectors get ``distrax.Transformed``'s.

    Numerical caveat: in float32, ``tanh(x)`` is exactly ``+-1`` once ``|x|``
    passes about 8 to 9 (the backend's ``tanh`` decides where), so a saturated
    action no longer tells which pre-image produced it, and
    ``distrax.Transformed.log_prob`` of it is NaN. A sample therefore remembers its
    pre-image, as TFP's bijector cache does: ``dist.log_prob(a)`` of the very array
    ``a`` that :meth:`sample` (or :meth:`sample_and_log_prob`,
    :meth:`sample_with_pre_image`, :meth:`mode`, :meth:`median`) returned scores the
    pre-image ``x`` that produced it, so its value and gradient are those of
    :meth:`log_prob_from_pre_image`, also when ``a`` rounded onto a bound. Any other
    action (a copy, a stored action) is scored from its distances to the bounds
    (see :meth:`log_prob`). To replay an action later, store its pre-image and
    score it with :meth:`log_prob_from_pre_image`.

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

    _replay_hint = " (the stored pre-tanh action)"

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
        loc, scale = _squashed.nan_where_invalid(loc, scale)
        super().__init__(
            distrax.Independent(distrax.Normal(loc, scale), 1), distrax.Block(bijector, 1)
        )
        self._loc = loc
        self._scale = scale

    @property
    def loc(self) -> Float[Array, "*batch action"]:
        """Means of the base Normal, ``[*batch, action]``: the pre-image of the
        deterministic action. NaN in a dimension whose parameters are invalid.

        Example:
            >>> import jax.numpy as jnp, samplers
            >>> scale = jnp.array([1.0, -1.0])  # not positive in the second dimension
            >>> samplers.SquashedNormal(jnp.array([0.3, 0.3]), scale, samplers.Tanh()).loc
            Array([0.3, nan], dtype=float32)
        """
        return self._loc

    @property
    def scale(self) -> Float[Array, "*batch action"]:
        """Standard deviations of the base Normal, ``[*batch, action]``, positive; NaN
        in a dimension whose parameters are invalid.

        Example:
            >>> import jax.numpy as jnp, samplers
            >>> scale = jnp.array([1.0, -1.0])
            >>> samplers.SquashedNormal(jnp.array([0.3, 0.3]), scale, samplers.Tanh()).scale
            Array([ 1., nan], dtype=float32)
        """
        return self._scale

    @property
    def _parameters(self) -> tuple[Array, Array]:
        return self._loc, self._scale

    def deterministic_replay_data(self) -> Float[Array, "*batch action"]:
        """``loc``, the pre-image of :meth:`deterministic_action`."""
        return self._loc

    def _log_det(self, x):
        """``log|f'(x)|`` elementwise, the shape of ``x``."""
        return self._elementwise.forward_log_det_jacobian(x)

    def log_prob(
        self,
        value: Float[ArrayLike, "*value_batch action"],
        *,
        min_distance: float | None = None,
    ) -> Float[Array, "*broadcast_batch"]:
        """Log-density of an action, also on the bounds.

        An array returned by this object's sampling methods is scored at its own
        pre-image (see the class docstring), exactly as :meth:`sample_and_log_prob`
        scores it. For a squashing (a bijector with a :class:`samplers.Squashing`),
        any other action is scored from its distances to the bounds, never by
        inverting ``f`` with ``atanh`` (NaN on a bound in ``distrax.Transformed``):

        - strictly inside ``(low, high)``: the log-density at that action, within
          the error bound that the guarantees page states, with finite gradients
          with respect to the action, ``loc``, ``scale`` and the bounds;
        - on a bound: not a density but the log-probability of the atom that
          float rounding puts there, ``log P[X >= x_r]`` at ``high``
          (``log P[X <= x_r]`` at ``low``) for ``x_r`` the pre-image of the point
          half a float step inside the bound; its gradient moves mass towards the
          bound (the guarantees page says why, and how large the step is);
        - outside ``[low, high]``, or NaN: NaN.

        Other bijectors (the identity, a chain, a user's bijector without a
        ``squashing``) use ``distrax.Transformed.log_prob``, which inverts ``f``.

        Args:
            value: Actions, shape broadcastable with ``[*batch, action]`` (e.g.
                ``[*sample, *batch, action]``), as ``distrax`` broadcasts them.
            min_distance: ``None`` (the default) for the above. Otherwise, for the
                squashings, the smallest distance to a bound as a fraction of the
                half range, in ``(0, 1)``: every action closer to a bound than that
                (a fresh sample too) is scored as the density at that distance,
                the clamp other libraries use (``1e-3`` is Acme's ``0.999``); its
                gradient pulls ``loc`` towards the clamped point.

        Returns:
            ``log p(value)``, the broadcast shape without its last axis.

        Raises:
            TypeError: ``value`` is not floating, or ``min_distance`` is given for
                a bijector without a :class:`samplers.Squashing`.
            ValueError: ``value`` does not broadcast with the distribution's
                shape, or ``min_distance`` is not in ``(0, 1)``.

        Example:
            >>> import jax.numpy as jnp, samplers
            >>> dist = samplers.squashed_normal_from_std(jnp.array([3.0]), jnp.array([1.0]))
            >>> dist.log_prob(jnp.array([0.5])), dist.log_prob(jnp.array([1.0]))  # on the bound
            (Array(-3.634, dtype=float32), Array(-20.804, dtype=float32))
            >>> dist.log_prob(jnp.array([1.0]), min_distance=1e-3)  # the density at 0.999
            Array(4.976, dtype=float32)
        """
        if min_distance is not None:
            return self._clamped_log_prob(value, min_distance)
        return super().log_prob(value)

    def _log_prob_of_action(self, value) -> Array:
        bounds = squashing(self.bijector)
        if bounds is None:
            return jnp.asarray(distrax.Transformed.log_prob(self, value))
        action, loc, scale = self._broadcast("value", value)
        return _squashed.log_prob_from_action(bounds, action, loc, scale)

    def _clamped_log_prob(self, value, min_distance) -> Array:
        """:meth:`log_prob` with ``min_distance``, validated here; ``[*broadcast_batch]``."""
        bounds = squashing(self.bijector)
        if bounds is None:
            raise TypeError(
                f"min_distance needs a squashing onto bounds (samplers.Tanh, distrax.Tanh, "
                f"samplers.BoundedTanh or sigmoid), got {bijector_name(self.bijector)}; "
                f"drop min_distance for dist.log_prob(value)."
            )
        min_distance = _checks.real_number("min_distance", min_distance, above=0.0)
        if min_distance >= 1.0:
            raise ValueError(
                f"min_distance must be in (0, 1) (a fraction of the half range), got "
                f"{min_distance}."
            )
        action, loc, scale = self._broadcast("value", value)
        return _squashed.log_prob_from_action(bounds, action, loc, scale, min_distance)

    def log_prob_from_pre_image(
        self, pre_image: Float[ArrayLike, "*sample_and_batch action"]
    ) -> Float[Array, "*sample_and_batch"]:
        """Log-density of the action ``f(pre_image)``, computed without inverting ``f``.

        ``base.log_prob(x) - bijector.forward_log_det_jacobian(x)``: finite for any
        finite ``x`` with the bijectors of this package and ``distrax.Tanh``, and
        within the error bound the guarantees page states. Gradients reach ``loc``,
        ``scale``, ``pre_image`` and the bijector's parameters. This is the replay
        path: score a stored pre-image with it. ``pre_image`` broadcasts with
        ``[*batch, action]`` as in :meth:`log_prob`; the result has the broadcast
        shape without its last axis.

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
        if squashing(self.bijector) is not None:
            return _squashed.squashing_log_prob_from_pre_image(
                self._elementwise, pre_image, loc, scale
            )
        return _squashed.log_prob_from_pre_image(self._log_det, pre_image, loc, scale)

    def sample_pre_image(self, *, seed: PRNGKeyArray | int) -> Float[Array, "*batch action"]:
        """Draws ``x = loc + scale * eps``, reparameterised (gradients reach loc and scale).

        Args:
            seed: One key (or an integer, as in distrax), which draws
                ``eps = normal(seed, loc.shape)``; or one typed key per batch
                element (shape ``[*batch]``, e.g. ``jax.random.split(key, n)``):
                each element then draws from its own key, so its sample does not
                depend on the rest of the batch.

        Returns:
            Pre-images, shape ``[*batch, action]``; NaN where the parameters are.

        Raises:
            ValueError: ``seed`` holds keys whose shape is neither ``()`` nor the
                batch shape.

        Example:
            >>> import jax, jax.numpy as jnp, samplers
            >>> dist = samplers.normal_tanh(jnp.zeros((3, 2)))
            >>> keys = jax.random.split(jax.random.key(0), 3)
            >>> x = dist.sample_pre_image(seed=keys)
            >>> bool(jnp.array_equal(x[1:], dist[1:].sample_pre_image(seed=keys[1:])))
            True
        """
        return self._loc + self._scale * _keys.standard_normal(seed, self._loc)

    def deterministic_action(self) -> Float[Array, "*batch action"]:
        """``f(loc)``: the action a deterministic policy takes (the median for increasing ``f``).

        Shape ``[*batch, action]``; it remembers its pre-image ``loc``, so
        ``dist.log_prob`` of it scores ``loc``. Not the mode (see :meth:`mode`).

        Example:
            >>> import jax.numpy as jnp, samplers
            >>> dist = samplers.squashed_normal_from_std(jnp.array([0.5, 20.0]), jnp.ones(2))
            >>> action = dist.deterministic_action()
            >>> action, bool(dist.log_prob(action) == dist.log_prob_from_pre_image(dist.loc))
            (Array([0.4621, 1.    ], dtype=float32), True)
        """
        return self._remember(self._loc)

    def entropy_estimate(
        self, *, seed: PRNGKeyArray | int, num_samples: int = 1
    ) -> Float[Array, "*batch"]:
        """A reparameterised Monte Carlo estimate of the entropy, in nats.

        The Normal's entropy in closed form plus the mean of
        ``forward_log_det_jacobian(loc + scale * eps)`` over ``num_samples`` draws
        of ``eps`` whose gradient is stopped, so gradients reach ``loc``, ``scale``
        and the bijector's parameters. Unbiased, not exact (:meth:`entropy` is): it
        varies with ``seed``, with a variance that falls as ``1 / num_samples``.
        Defined for any elementwise bijector.

        Args:
            seed: As in :meth:`sample_pre_image`: one key (one sample draws exactly
                ``normal(seed, loc.shape)``) or one key per batch element.
            num_samples: Draws averaged, a positive integer.

        Returns:
            The estimate, summed over the action axis, shape ``[*batch]``.

        Raises:
            TypeError: ``num_samples`` is not an integer.
            ValueError: ``num_samples`` is not positive.

        Example:
            >>> import jax, jax.numpy as jnp, samplers
            >>> dist = samplers.squashed_normal_from_std(jnp.array([0.0]), jnp.array([1.0]))
            >>> dist.entropy_estimate(seed=jax.random.key(0), num_samples=1000), dist.entropy()
            (Array(0.6935, dtype=float32), Array(0.6698, dtype=float32))
        """
        num_samples = _checks.positive_int("num_samples", num_samples)
        eps = _keys.standard_normal(seed, self._loc, num_samples)
        if squashing(self.bijector) is not None:
            return _squashed.squashing_entropy_estimate(
                self._elementwise, self._loc, self._scale, eps
            )
        return _squashed.entropy_estimate(self._log_det, self._loc, self._scale, eps)

    def entropy_quadrature(self, num_points: int = 8) -> Float[Array, "*batch"]:
        """The entropy by Gauss-Hermite quadrature of ``E[log|f'(x)|]``, in nats.

        The Normal's entropy plus ``E[log|f'(x)|]`` over ``num_points`` nodes.
        Deterministic and differentiable, for any elementwise bijector, but biased
        for wide stds (the guarantees page states by how much);
        :meth:`entropy` is exact for the squashings.

        Args:
            num_points: Gauss-Hermite nodes, in ``[1, 256]``.

        Returns:
            The entropy, summed over the action axis, shape ``[*batch]``.

        Raises:
            TypeError: ``num_points`` is not an integer.
            ValueError: ``num_points`` is not in ``[1, 256]``.

        Example:
            >>> import jax.numpy as jnp, samplers
            >>> wide = samplers.squashed_normal_from_std(jnp.array([0.0]), jnp.array([4.0]))
            >>> wide.entropy_quadrature(8) - wide.entropy()  # std 4: biased low
            Array(-0.2022, dtype=float32)
            >>> wide.entropy_quadrature(64) - wide.entropy()
            Array(-0.0013, dtype=float32)
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

        ``H[f(X)] = H[X] + E[log f'(X)]``, with ``E[log sech(X / k)**2]`` taken
        through the logistic law as a Normal scale mixture of six terms (nine in
        float64), each in closed form: deterministic and differentiable with respect
        to ``loc``, ``scale`` and the bounds, with one rule for every mean and std;
        its error is bounded, stated and tested on the guarantees page. Its value and
        gradient cost an ``rsqrt``, an ``exp`` and an ``erf`` per term and dimension:
        1.8 times the one-sample :meth:`entropy_estimate` on 2 CPU cores at
        ``B = 65536``, ``A = 8``. A float32 program compiled for an accelerator takes
        one such term and five Gaussian bumps (an ``rsqrt`` and an ``exp`` each)
        instead: 0.87 times the one-sample estimate on a TPU v5e at ``B = 2**20``,
        ``A = 8``. For the squashings (a bijector with a
        :class:`samplers.Squashing`); for a constant log-determinant (e.g. the
        identity), ``distrax.Transformed.entropy``.

        Args:
            input_hint: Unused; distrax's signature.

        Returns:
            The entropy, shape ``[*batch]``; NaN for a batch element with invalid
            parameters.

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
        """``KL(self || other_dist)``; for two ``SquashedNormal`` with one bijector, exact.

        The KL of the base diagonal Normals, summed over the action axis (the
        guarantees page derives it), registered with TFP for two
        ``SquashedNormal``. The bijectors must be the same map, compared by type and
        parameters (:func:`samplers.distributions.bijectors.same_map`), not by
        tracing as distrax does (which does not see the values of bounds). Bounds
        traced inside ``jax.jit`` or ``jax.vmap`` have no values when this runs:
        they are compared when the program runs, and where they differ the KL is
        NaN.

        Args:
            other_dist: A ``SquashedNormal`` with the same action size, batch shape
                broadcastable with this one's, and the same bijector.
            **kwargs: Passed to ``distrax.Distribution.kl_divergence``.

        Returns:
            The KL in nats, shape the broadcast batch shape.

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
        """Slices the batch shape as distrax's distributions do: a ``SquashedNormal``
        with the same bijector.

        The index applies to ``[*batch]``; the action axis stays whole, so
        ``dist[..., 0]`` drops the last batch axis, not an action dimension.

        Example:
            >>> import jax.numpy as jnp, samplers
            >>> dist = samplers.normal_tanh(jnp.zeros((3, 4, 2)))  # batch (3, 4), action 1
            >>> dist[0].batch_shape, dist[:, 1:].batch_shape, dist[..., 0].batch_shape
            ((4,), (3, 3), (3,))
        """
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

        For the squashings, not :meth:`median` ``f(loc)``: with a narrow std the
        mode is a little further from the centre (``loc=0.5, scale=0.3``: mode
        0.534, median 0.462); with ``scale > 1 / sqrt(2)`` and a small ``|loc|`` the
        density is bimodal and the mode sits near the bound on the side of the mean
        (``loc=0.3, scale=1``: 0.978). Found by a root search of fixed length (the
        guarantees page gives the method), jit- and vmap-friendly. The mode
        remembers its pre-image, so ``dist.log_prob(dist.mode())`` is its density
        also where the mode rounds onto a bound in float32 (``loc=0.3, scale=3``).
        Other bijectors get ``distrax.Transformed.mode``, defined for a constant
        Jacobian.

        Returns:
            The mode, shape ``[*batch, action]``, gradients stopped.

        Example:
            >>> import jax.numpy as jnp, samplers
            >>> loc, scale = jnp.array([0.3, 0.5]), jnp.array([1.0, 0.3])
            >>> dist = samplers.squashed_normal_from_std(loc, scale)
            >>> dist.mode().round(3), dist.median().round(3)
            (Array([0.978, 0.534], dtype=float32), Array([0.291, 0.462], dtype=float32))
            >>> wide = samplers.squashed_normal_from_std(jnp.array([0.3]), jnp.array([3.0]))
            >>> mode = wide.mode()  # rounds onto 1.0
            >>> mode, wide.log_prob(mode)  # the density at the mode
            (Array([1.], dtype=float32), Array(15.1962, dtype=float32))
            >>> wide.log_prob(jnp.array([1.0]))  # a copy: the rounding atom
            Array(-6.2957, dtype=float32)
        """
        bounds = squashing(self.bijector)
        if bounds is None:
            return jnp.asarray(super().mode())
        k = bounds.pre_image_scale
        return self._remember(_squashed.mode_pre_image(self._loc, self._scale, k))

    def median(self) -> Float[Array, "*batch action"]:
        """``f(loc)``, each dimension's median (``f`` is increasing), as
        :meth:`deterministic_action`.

        Per dimension, as ``distrax.Independent.median`` is; shape
        ``[*batch, action]``, remembering its pre-image. Only for the squashings;
        other bijectors get distrax's, which raises ``NotImplementedError``.

        Example:
            >>> import jax.numpy as jnp, samplers
            >>> loc, scale = jnp.array([0.3, -1.0]), jnp.array([1.0, 0.5])
            >>> dist = samplers.squashed_normal_from_std(loc, scale)
            >>> dist.median(), dist.cdf(dist.median())  # half the mass in each dimension
            (Array([ 0.2913, -0.7616], dtype=float32), Array(0.25, dtype=float32))
        """
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
        ``-inf`` at and below ``low``, 0 at and above ``high``), keeping its far
        left tail.

        ``value`` broadcasts as in :meth:`log_prob`; the result has the broadcast
        shape without its last axis.

        Raises:
            NotImplementedError: the bijector is not a squashing.
            TypeError, ValueError: ``value`` as in :meth:`log_prob`.

        Example:
            >>> import jax.numpy as jnp, samplers
            >>> dist = samplers.squashed_normal_from_std(jnp.array([0.3]), jnp.array([1.0]))
            >>> dist.log_cdf(jnp.array([[-1.0], [0.0], [1.0]]))
            Array([ -inf, -0.9621, 0. ], dtype=float32)
        """
        return jnp.sum(self._log_ndtr("log_cdf", "value", value, 1.0), axis=-1)

    def cdf(
        self, value: Float[ArrayLike, "*value_batch action"]
    ) -> Float[Array, "*broadcast_batch"]:
        """``P[Y_i <= value_i for every i]``, ``exp(log_cdf(value))``; see :meth:`log_cdf`.

        Example:
            >>> import jax.numpy as jnp, samplers
            >>> loc, scale = jnp.array([0.3, -1.0]), jnp.array([1.0, 0.5])
            >>> dist = samplers.squashed_normal_from_std(loc, scale)
            >>> dist.cdf(jnp.array([0.0, 0.0])), dist.cdf(jnp.array([1.0, 1.0]))
            (Array(0.3734, dtype=float32), Array(1., dtype=float32))
        """
        self._require_squashing("cdf")
        return jnp.exp(self.log_cdf(value))

    def log_survival_function(
        self, value: Float[ArrayLike, "*value_batch 1"]
    ) -> Float[Array, "*broadcast_batch"]:
        """``log P[Y > value]`` for a one-dimensional action, without cancellation.

        Keeps the far right tail where ``1 - cdf`` would round to 0; ``-inf`` at and
        above ``high``, 0 at and below ``low``. ``value`` broadcasts as in
        :meth:`log_prob`; the result has the broadcast shape without its last axis.

        Raises:
            NotImplementedError: the action has more than one dimension, where
                ``P[Y > y]`` is not defined (distrax refuses it too), or the
                bijector is not a squashing.

        Example:
            >>> import jax.numpy as jnp, samplers
            >>> dist = samplers.squashed_normal_from_std(jnp.array([0.3]), jnp.array([1.0]))
            >>> dist.log_survival_function(jnp.array([0.999]))
            Array(-8.3668, dtype=float32)
        """
        self._require_one_dimension("log_survival_function", "1 - dist.cdf(value)")
        return jnp.sum(self._log_ndtr("log_survival_function", "value", value, -1.0), axis=-1)

    def survival_function(
        self, value: Float[ArrayLike, "*value_batch 1"]
    ) -> Float[Array, "*broadcast_batch"]:
        """``P[Y > value]`` for a one-dimensional action; see :meth:`log_survival_function`.

        Example:
            >>> import jax.numpy as jnp, samplers
            >>> dist = samplers.squashed_normal_from_std(jnp.array([0.3]), jnp.array([1.0]))
            >>> dist.survival_function(jnp.array([[0.0], [1.0]]))
            Array([0.6179, 0.    ], dtype=float32)
        """
        self._require_one_dimension("survival_function", "1 - dist.cdf(value)")
        self._require_squashing("survival_function")
        return jnp.exp(self.log_survival_function(value))

    def quantile(self, p: Float[ArrayLike, "*p_batch"]) -> Float[Array, "*broadcast_batch 1"]:
        """The action below which lies the mass ``p``, for a one-dimensional action.

        ``f(loc + scale * ndtri(p))``: exact, since ``f`` is increasing. ``p = 0``
        and ``p = 1`` give the bounds (there the gradient is 0 with respect to
        ``loc`` and ``scale``, 1 with respect to that bound, and ``+inf`` with
        respect to ``p``: the density vanishes at the bounds); ``p`` outside
        ``[0, 1]`` gives NaN, and so does a non-finite ``loc`` or a ``scale`` that
        is not positive and finite.

        ``p`` broadcasts with the batch shape ``[*batch]``; the result has shape
        ``[*broadcast_batch, 1]``.

        Raises:
            NotImplementedError: the action has more than one dimension, where a
                quantile is not defined, or the bijector is not a supported squashing.

        Example:
            >>> import jax.numpy as jnp, samplers
            >>> dist = samplers.squashed_normal_from_std(jnp.array([0.3]), jnp.array([1.0]))
            >>> dist.quantile(jnp.array([0.0, 0.5, 1.0]))[:, 0]
            Array([-1.    ,  0.2913,  1.    ], dtype=float32)
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
        """Each dimension's mean ``E[f(x)]``, by quadrature, shape ``[*batch, action]``.

        For the squashings: deterministic and differentiable, NaN where the
        parameters are invalid; its error is stated and tested on the guarantees
        page. Other bijectors get ``distrax.Transformed.mean``, defined for a
        constant Jacobian.

        Example:
            >>> import jax.numpy as jnp, samplers
            >>> dist = samplers.squashed_normal_from_std(jnp.array([0.3]), jnp.array([1.0]))
            >>> dist.mean(), dist.median()
            (Array([0.1801], dtype=float32), Array([0.2913], dtype=float32))
        """
        bounds = squashing(self.bijector)
        if bounds is None:
            return jnp.asarray(super().mean())
        return _squashed.moments(bounds, self._loc, self._scale)[0]

    def variance(self) -> Float[Array, "*batch action"]:
        """Each dimension's variance, by quadrature; the covariance is diagonal.

        Shape ``[*batch, action]``. Deterministic and differentiable; NaN for a
        non-finite ``loc`` or a ``scale`` that is not positive and finite. Its error
        against float64 integrals is stated and tested on the guarantees page.

        Raises:
            NotImplementedError: the bijector is not one of the squashings
                :meth:`log_prob` supports.

        Example:
            >>> import jax.numpy as jnp, samplers
            >>> dist = samplers.squashed_normal_from_std(jnp.array([0.3]), jnp.array([1.0]))
            >>> dist.variance()
            Array([0.378], dtype=float32)
        """
        bounds = self._require_squashing("variance")
        return _squashed.moments(bounds, self._loc, self._scale)[1]

    def stddev(self) -> Float[Array, "*batch action"]:
        """``sqrt(variance())``, per dimension, shape ``[*batch, action]``; raises as
        :meth:`variance`.

        Example:
            >>> import jax.numpy as jnp, samplers
            >>> samplers.squashed_normal_from_std(jnp.array([0.3]), jnp.array([1.0])).stddev()
            Array([0.6148], dtype=float32)
        """
        return jnp.sqrt(self.variance())

    def _log_ndtr(self, method: str, name: str, value, sign: float) -> Array:
        """``log Phi(sign * z)`` per dimension, ``z`` the standardized pre-image of ``value``.

        Shape: ``value`` broadcast with ``[*batch, action]``. Raises as
        :meth:`_require_squashing` and :meth:`_broadcast`.
        """
        bounds = self._require_squashing(method)
        action, loc, scale = self._broadcast(name, value)
        return log_ndtr(sign * _squashed.standardized_pre_image(bounds, action, loc, scale))

    def _require_squashing(self, method: str):
        """The bijector's :class:`samplers.Squashing`; ``NotImplementedError`` naming
        ``method`` if it has none."""
        bounds = squashing(self.bijector)
        if bounds is None:
            raise NotImplementedError(
                f"SquashedNormal.{method} needs an increasing squashing (samplers.Tanh, "
                f"distrax.Tanh, samplers.BoundedTanh or sigmoid), got "
                f"{bijector_name(self.bijector)}; sample and estimate it instead."
            )
        return bounds

    def _require_one_dimension(self, method: str, instead: str) -> None:
        """``NotImplementedError`` naming ``method`` and ``instead`` unless the action has
        one dimension."""
        if self._loc.shape[-1] != 1:
            raise NotImplementedError(
                f"SquashedNormal.{method} is defined for a one-dimensional action, got "
                f"{self._loc.shape[-1]} dimensions; use {instead}, or build one distribution "
                f"per dimension, e.g. SquashedNormal(dist.loc[..., i:i + 1], "
                f"dist.scale[..., i:i + 1], bijector)."
            )


# NumPy's Gauss-Hermite weights overflow to NaN beyond about 300 nodes.
_MAX_HERMITE_POINTS = 256


# Zero, with the derivative of a quantile at p = 0 and p = 1: +inf there, else 0.
_edge_slope = with_slope(
    lambda p: (jnp.zeros_like(p), jnp.where((p == 0) | (p == 1), jnp.inf, 0.0))
)


def _check_keeps_shape(bijector: distrax.Bijector, loc) -> None:
    """Refuses (``ValueError``) a bijector that maps ``loc``'s shape to another one,
    e.g. bounds of the wrong length broadcast against the action."""
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


# The KL divergence of two squashed Normals, registered with TFP as distrax does: the KL
# of the base Normals when both share their squashing, refused for a SquashedNormal
# against a plain distrax.Transformed.


def _kl_divergence(p: SquashedNormal, q: SquashedNormal, *_, **__) -> Array:
    """``KL(p || q)`` of two squashed Normals that share their bijector (see the method).

    Registered with TFP; ``[*broadcast_batch]``. Raises ``ValueError`` for other
    bijectors, action sizes or batch shapes; NaN where traced bounds differ.
    """
    same = _same_bijector(p.bijector, q.bijector)
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
    """``same_map(f, g)``: ``True``, or a boolean array for traced bounds.

    Raises ``ValueError`` where it is ``False`` at trace time, naming both maps.
    """
    same = same_map(f, g)
    if same is not False:
        return same
    f_squashing, g_squashing = squashing(f), squashing(g)
    if f_squashing is not None and g_squashing is not None:
        raise ValueError(
            f"p and q must share their bijector, got {bijector_name(f)} onto "
            f"[{f_squashing.low}, {f_squashing.high}] and {bijector_name(g)} onto "
            f"[{g_squashing.low}, {g_squashing.high}]; with different maps the supports or "
            f"Jacobians differ and the KL is not that of the base Normals."
        )
    raise ValueError(
        f"p and q must share their bijector, got {bijector_name(f)} and "
        f"{bijector_name(g)} that cannot be shown to be the same map; build both "
        f"with the same bijector instance."
    )


def _kl_refused(p, q, *_, **__):
    """Registered for a ``SquashedNormal`` and another ``distrax.Transformed``: refuses."""
    raise NotImplementedError(
        f"the KL divergence between a {type(p).__name__} and a {type(q).__name__} is not "
        f"known to be that of their base distributions; build both as "
        f"samplers.SquashedNormal with the same bijector."
    )


tfd.RegisterKL(SquashedNormal, SquashedNormal)(_kl_divergence)
tfd.RegisterKL(SquashedNormal, distrax.Transformed)(_kl_refused)
tfd.RegisterKL(distrax.Transformed, SquashedNormal)(_kl_refused)
