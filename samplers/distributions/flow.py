"""A normalizing-flow policy: a Normal, learned layers, then a squashing.

``x0 ~ N(loc, scale)`` goes through the layers ``g_1 .. g_K`` (bijectors on the
action vector, such as distrax's ``MaskedCoupling``, whose conditioners may also see
the state) and then an elementwise squashing ``f``: the action is
``f(g_K(... g_1(x0)))``. The replay data is the squashing's pre-image
``x_K = g_K(... g_1(x0))``, which fixes the action; it is scored through the layers'
inverses (exact in closed form for coupling layers), never the squashing's.
"""

from collections.abc import Callable, Sequence
from typing import Any

import distrax
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray
from tensorflow_probability.substrates import jax as tfp

from samplers import _checks
from samplers._numerics import HALF_LOG_2PI, k3
from samplers.distributions import _keys, _squashed
from samplers.distributions.bijectors import Tanh, bijector_name, same_map
from samplers.distributions.pre_image import PreImageReplay
from samplers.distributions.replay import SampleShape, Seed

_TANH = Tanh()


class SquashedFlow(PreImageReplay):
    """``f(g_K(... g_1(x0)))`` with ``x0 ~ N(loc, scale)``: a flow between a diagonal
    Normal and an elementwise squashing.

    The density is ``log p(a) = log N(x0; loc, scale) - sum_k log|det J_k(x_{k-1})|
    - sum log|f'(x_K)|``, each layer's log-determinant from the layer itself (for a
    coupling layer, the sum of its elementwise transform's over the transformed
    dimensions: its Jacobian is triangular). Shapes: ``loc`` and ``scale`` are
    ``[*batch, action]``; the batch shape is ``[*batch]`` and the event shape
    ``[action]``. This is ``distrax.Transformed(Independent(Normal(loc, scale), 1),
    Chain([Block(f, 1), g_K, ..., g_1]))``, and its ``log_prob`` agrees with that
    object's wherever the inverses are finite.

    The pre-image: as for :class:`samplers.SquashedNormal`, it is the squashing's,
    ``x_K``, here after the layers. Once ``f`` saturates (``tanh`` rounds to +-1 in
    float32 from ``|x_K| ~ 9``) the action no longer tells which ``x_K`` produced it,
    and the inverse path (distrax's ``log_prob``) is NaN or infinite; ``x_K`` itself
    is finite. :meth:`log_prob_from_pre_image` scores it by inverting the layers,
    ``log p = log N(x0; loc, scale) + sum_k log|det J_k^-1| - sum log|f'(x_K)|`` with
    ``x0 = g_1^-1(... g_K^-1(x_K))``: a coupling layer inverts exactly, its
    conditioner seeing the dimensions it keeps, which the layer does not change. The
    base draw ``x0`` would not do as replay data: once the layers have learned, it
    stands for another action, and its score's gradient with respect to the layers
    is not the gradient of the log-density of the action taken. A sample remembers
    its ``x_K``, so that ``dist.log_prob`` of the very array :meth:`sample` returned
    scores it. Any other action is scored through the inverses, the squashing's
    included (``distrax.Transformed.log_prob``): NaN or infinite where that inverse
    is (on a bound, or within rounding of one), never a plausible finite number.
    ``entropy()`` has no closed form; see :meth:`entropy_estimate`.

    Parameters are not checked: a NaN or infinite ``loc`` or ``scale``, or a
    ``scale`` that is not positive, makes that dimension's ``loc`` and ``scale`` NaN,
    as in :class:`samplers.SquashedNormal`.

    Args:
        loc: Means of the base Normal, shape ``[*batch, action]``.
        scale: Its standard deviations, the same shape, positive.
        layers: Invertible bijectors on the action vector (``event_ndims_in == 1``)
            that keep its shape, applied in order (``layers[0]`` first); ``()`` gives
            the squashed Normal.
        bijector: The elementwise squashing ``f``, applied last (tanh by default).

    Raises:
        TypeError: a layer is not a distrax bijector on vectors.
        ValueError: ``loc`` and ``scale`` differ in shape, or ``bijector`` is not
            elementwise.

    Example:
        >>> import distrax, jax, jax.numpy as jnp, samplers
        >>> layer = distrax.MaskedCoupling(
        ...     jnp.array([True, False]),
        ...     lambda x: jnp.stack([x, x], -1),
        ...     lambda p: distrax.ScalarAffine(shift=p[..., 0], log_scale=0.5 * p[..., 1]),
        ... )
        >>> dist = samplers.SquashedFlow(jnp.array([0.0, 30.0]), jnp.ones(2), [layer])
        >>> action, pre_image, log_prob = dist.sample_with_replay(seed=jax.random.key(0))
        >>> float(action[1]), bool(jnp.isfinite(log_prob))  # on the bound, finite
        (1.0, True)
        >>> bool(dist.replay(pre_image)[1] == log_prob)  # the stored pre-image replays it
        True
    """

    _replay_hint = " (the stored pre-squash action)"

    def __init__(
        self,
        loc: Float[Array, "*batch action"],
        scale: Float[Array, "*batch action"],
        layers: Sequence[distrax.Bijector] = (),
        bijector: distrax.Bijector = _TANH,
    ):
        if jnp.shape(loc) != jnp.shape(scale) or jnp.ndim(loc) < 1:
            raise ValueError(
                f"loc and scale must have the same shape [*batch, action], got "
                f"{jnp.shape(loc)} and {jnp.shape(scale)}."
            )
        layers = tuple(layers)
        for index, layer in enumerate(layers):
            if not isinstance(layer, distrax.Bijector) or layer.event_ndims_in != 1:
                raise TypeError(
                    f"layers[{index}] must be a distrax bijector on the action vector "
                    f"(event_ndims_in == 1, e.g. distrax.MaskedCoupling), got "
                    f"{type(layer).__name__}; wrap an elementwise one as distrax.Block(b, 1)."
                )
        bijector = distrax.as_bijector(bijector)
        if bijector.event_ndims_in != 0:
            raise ValueError(
                f"bijector must be elementwise (event_ndims_in == 0), got {bijector.name} "
                f"with event_ndims_in={bijector.event_ndims_in}; pass e.g. samplers.Tanh()."
            )
        loc, scale = _squashed.nan_where_invalid(loc, scale)
        chain = distrax.Chain([distrax.Block(bijector, 1), *reversed(layers)])
        super().__init__(distrax.Independent(distrax.Normal(loc, scale), 1), chain)
        self._loc, self._scale = loc, scale
        self._layers, self._squashing = layers, bijector

    @property
    def loc(self) -> Float[Array, "*batch action"]:
        """The base Normal's mean."""
        return self._loc

    @property
    def scale(self) -> Float[Array, "*batch action"]:
        """The base Normal's standard deviation."""
        return self._scale

    @property
    def layers(self) -> tuple[distrax.Bijector, ...]:
        """The flow's layers, in the order they are applied."""
        return self._layers

    @property
    def squashing(self) -> distrax.Bijector:
        """The elementwise bijector applied last."""
        return self._squashing

    def _forward_layers(self, base_draw) -> tuple[Array, Array]:
        """``(x_K, sum_k log|det J_k|)`` for a draw ``x0`` of the base Normal."""
        x, log_det = base_draw, jnp.zeros(base_draw.shape[:-1], base_draw.dtype)
        for layer in self._layers:
            y, layer_log_det = layer.forward_and_log_det(x)
            x, log_det = self._same_shape(layer, x, y), log_det + layer_log_det
        return x, log_det

    def _inverse_layers(self, pre_image, layers=None) -> tuple[Array, Array]:
        """``(x0, sum_k log|det J_k^-1|)`` for the squashing's pre-image ``x_K``."""
        x, log_det = pre_image, jnp.zeros(pre_image.shape[:-1], pre_image.dtype)
        for layer in reversed(self._layers if layers is None else layers):
            y, layer_log_det = layer.inverse_and_log_det(x)
            x, log_det = self._same_shape(layer, x, y), log_det + layer_log_det
        return x, log_det

    @staticmethod
    def _same_shape(layer, x, y) -> Array:
        if jnp.shape(y) != jnp.shape(x):
            raise ValueError(
                f"a flow layer ({type(layer).__name__}) changed the shape {x.shape} to "
                f"{jnp.shape(y)}; each layer must keep the action shape."
            )
        return jnp.asarray(y)

    @property
    def _parameters(self) -> tuple[Array, Array]:
        return self._loc, self._scale

    @property
    def _elementwise(self) -> distrax.Bijector:
        return self._squashing

    def _pre_image_of(self, draw) -> Array:
        """``x_K``: a base draw through the layers."""
        return self._forward_layers(draw)[0]

    def log_prob_from_pre_image(
        self, pre_image: Float[ArrayLike, "*sample_and_batch action"]
    ) -> Float[Array, "*sample_and_batch"]:
        """The log-density of the action ``f(x_K)``, from the squashing's pre-image
        ``x_K`` alone: the layers inverted, the squashing not (the replay's score).

        Finite for any finite ``x_K`` with coupling layers; ``pre_image`` broadcasts
        with ``[*batch, action]``. Gradients reach ``loc``, ``scale``, ``pre_image``
        and whatever the layers close over (a conditioner's parameters): for a stored
        ``x_K`` they are those of the log-density of that action.
        """
        return self._score_pre_image(pre_image)

    def _score_pre_image(self, pre_image, layers=None) -> Array:
        x, loc, scale = self._broadcast("pre_image", pre_image)
        base_draw, inverse_log_det = self._inverse_layers(x, layers)
        return self._density(base_draw, loc, scale, inverse_log_det, x)

    def sample_with_replay(
        self, *, seed: PRNGKeyArray | int, reparameterized: bool = True
    ) -> tuple[
        Float[Array, "*batch action"], Float[Array, "*batch action"], Float[Array, "*batch"]
    ]:
        """``(action, x_K, log_prob)`` with ``log_prob`` the replay of ``x_K`` bit for
        bit: the draw goes forward through the layers, then is scored back through
        their inverses, as :meth:`log_prob_from_pre_image` scores a stored ``x_K``.

        When the last layer is a ``distrax.MaskedCoupling``, its conditioner runs once:
        the dimensions it sees are the ones it keeps, the same bits on the way out and
        on the way back, so its inverse reuses the forward pass's parameters. The
        layers below it are inverted as a replay inverts them. With
        ``reparameterized=False`` ``x_K`` is a constant, as a stored one is:
        ``log_prob``'s gradient is then its replay's.

        Example:
            >>> import jax, jax.numpy as jnp, samplers
            >>> from samplers.distributions.flow import coupling_layer
            >>> def conditioner(seen):  # the kept dimensions and a feature: 4 parameters
            ...     return jnp.concatenate([seen, seen[..., :1]], axis=-1)
            >>> layer = coupling_layer(0, 2, conditioner, jnp.ones(1), ("affine", 0), 5.0)
            >>> dist = samplers.SquashedFlow(jnp.array([0.5, -1.0]), jnp.ones(2), [layer])
            >>> action, pre_image, log_prob = dist.sample_with_replay(seed=jax.random.key(0))
            >>> bool(dist.replay(pre_image)[1] == log_prob)
            True
        """
        last = self._layers[-1] if self._layers else None
        if not isinstance(last, distrax.MaskedCoupling):
            return super().sample_with_replay(seed=seed, reparameterized=reparameterized)
        below = self._layers[:-1]
        x = self._base_draw(seed)
        for layer in below:
            x = self._same_shape(layer, x, layer.forward(x))
        if not reparameterized:
            x = jax.lax.stop_gradient(x)
        # The layer's own mask and inner event rank (distrax keeps them as ``_event_mask``
        # and ``_inner_event_ndims``): the conditioner's input is the forward pass's.
        parameters = last.conditioner(jnp.where(last._event_mask, x, 0.0))
        once = distrax.MaskedCoupling(
            last.mask,
            lambda _: parameters,
            last.bijector,
            event_ndims=last.event_ndims_in,
            inner_event_ndims=last._inner_event_ndims,
        )
        pre_image = self._same_shape(last, x, once.forward(x))
        if not reparameterized:
            pre_image = jax.lax.stop_gradient(pre_image)
        log_prob = self._score_pre_image(pre_image, (*below, once))
        return self._remember(pre_image), pre_image, log_prob

    def _density(self, base_draw, loc, scale, inverse_log_det, pre_image) -> Array:
        """``log N(x0; loc, scale) + sum_k log|det J_k^-1| - sum log|f'(x_K)|``."""
        log_normal = jnp.sum(_squashed.log_normal(base_draw, loc, scale), axis=-1)
        squash_log_det = jnp.sum(self._squashing.forward_log_det_jacobian(pre_image), axis=-1)
        return log_normal + inverse_log_det - squash_log_det

    def _log_prob_of_action(self, value) -> Array:
        return jnp.asarray(distrax.Transformed.log_prob(self, value))

    def sample_pre_image(self, *, seed: PRNGKeyArray | int) -> Float[Array, "*batch action"]:
        """Draws ``x_K = g_K(... g_1(loc + scale * eps))``, reparameterised (gradients
        reach ``loc``, ``scale`` and the layers); ``seed`` is one key (or an integer) or
        one typed key per batch element."""
        return self._pre_image_of(self._base_draw(seed))

    def sample_and_log_prob(
        self, *, seed: Seed, sample_shape: SampleShape = ()
    ) -> tuple[Float[Array, "*sample_and_batch action"], Float[Array, "*sample_and_batch"]]:
        """The draws of :meth:`sample`, each scored forward, as ``distrax.Transformed``
        scores a fresh draw: ``log N(x0; loc, scale) - sum_k log|det J_k(x_{k-1})| -
        sum log|f'(x_K)|``, the layers' log-determinants taken on the way out.

        No layer runs twice, so a SAC actor loss costs what the same flow written in
        distrax costs, and no inverse is taken: a draw that rounded onto a bound is
        finite. The value is :meth:`log_prob_from_pre_image` of the same ``x_K`` to
        float rounding, not bit for bit (the inverses round differently), and
        ``dist.log_prob`` of the returned action
        scores its ``x_K`` through the inverses, as a replay does. A rollout that
        stores ``x_K`` for a replay takes :meth:`sample_with_replay`, whose
        log-probability is the replay's bit for bit. Gradients reach ``loc``,
        ``scale`` and the layers, through the draw too (reparameterised).

        Example:
            >>> import distrax, jax, jax.numpy as jnp, samplers
            >>> layer = distrax.MaskedCoupling(
            ...     jnp.array([True, False]),
            ...     lambda x: jnp.stack([x, x], -1),
            ...     lambda p: distrax.ScalarAffine(shift=p[..., 0], log_scale=0.5 * p[..., 1]),
            ... )
            >>> dist = samplers.SquashedFlow(jnp.zeros(2), jnp.ones(2), [layer])
            >>> action, log_prob = dist.sample_and_log_prob(seed=jax.random.key(0))
            >>> replayed = dist.log_prob(action)  # through the inverse
            >>> bool(jnp.abs(replayed - log_prob) < 1e-5 * (1 + jnp.abs(log_prob)))
            True
        """
        draw = self.distribution.sample(seed=seed, sample_shape=sample_shape)
        pre_image, log_prob = self._scored_forward(draw)
        return self._remember(pre_image), log_prob

    def sample_with_pre_image(
        self, *, seed: PRNGKeyArray | int
    ) -> tuple[
        Float[Array, "*batch action"], Float[Array, "*batch action"], Float[Array, "*batch"]
    ]:
        """``(action, x_K, log_prob)`` in one pass, with no inverse: the draw scored
        forward, as :meth:`sample_and_log_prob` scores it (the same values for the same
        key), with the pre-image ``x_K`` to store.

        A replay of ``x_K`` scores it through the inverses and agrees to float
        rounding, not bit for bit; :meth:`sample_with_replay` gives the replay's
        ``log_prob``, at the cost of the inverses. ``seed`` is one key (or an
        integer), or one typed key per batch element. Gradients reach ``loc``,
        ``scale`` and the layers, through the draw too (reparameterised).

        Example:
            >>> import distrax, jax, jax.numpy as jnp, samplers
            >>> layer = distrax.Block(distrax.ScalarAffine(shift=0.5, scale=2.0), 1)
            >>> dist = samplers.SquashedFlow(jnp.zeros(2), jnp.ones(2), [layer])
            >>> action, pre_image, log_prob = dist.sample_with_pre_image(seed=jax.random.key(0))
            >>> bool(dist.sample_and_log_prob(seed=jax.random.key(0))[1] == log_prob)
            True
            >>> replayed = dist.replay(pre_image)[1]  # through the inverse
            >>> bool(jnp.abs(replayed - log_prob) < 1e-5 * (1 + jnp.abs(log_prob)))
            True
        """
        pre_image, log_prob = self._scored_forward(self._base_draw(seed))
        return self._remember(pre_image), pre_image, log_prob

    def _base_draw(self, seed) -> Array:
        """``x0 = loc + scale * eps``, from one key or one key per batch element."""
        return self._loc + self._scale * _keys.standard_normal(seed, self._loc)

    def _scored_forward(self, draw) -> tuple[Array, Array]:
        """``(x_K, log_prob)`` of a base draw ``x0``, the layers' log-determinants
        taken on the way out."""
        x, loc, scale = self._broadcast("draw", draw)
        pre_image, layers_log_det = self._forward_layers(x)
        return pre_image, self._density(x, loc, scale, -layers_log_det, pre_image)

    def deterministic_replay_data(self) -> Float[Array, "*batch action"]:
        """``g_K(... g_1(loc))``: the deterministic action is the flow and squashing of the
        base mean (not the mode of a multimodal flow)."""
        return self._pre_image_of(self._loc)

    def deterministic_action(self) -> Float[Array, "*batch action"]:
        """``f(g_K(... g_1(loc)))``, remembered with its pre-image for ``log_prob``."""
        return self._remember(self.deterministic_replay_data())

    def entropy(self, input_hint: Any = None) -> Array:
        """Not available: a flow's entropy has no closed form.

        Raises:
            NotImplementedError: always; use :meth:`entropy_estimate`.
        """
        raise NotImplementedError(
            "SquashedFlow has no closed-form entropy; use "
            "dist.entropy_estimate(seed=key, num_samples=n), an unbiased estimate."
        )

    def entropy_estimate(
        self, *, seed: PRNGKeyArray | int, num_samples: int = 1
    ) -> Float[Array, "*batch"]:
        """A reparameterised Monte Carlo estimate of the entropy, in nats.

        The base Normal's entropy in closed form plus the mean, over ``num_samples``
        draws of ``eps`` (gradient stopped), of the log-determinant of the layers and
        the squashing at ``x0 = loc + scale * eps``: unbiased, with a variance that
        falls as ``1 / num_samples``. With no layers it is
        :meth:`samplers.SquashedNormal.entropy_estimate` for the same draws, to
        rounding (``1e-6`` relative). Gradients
        reach ``loc``, ``scale`` and the layers' parameters.

        Raises:
            TypeError: ``num_samples`` is not an integer.
            ValueError: ``num_samples`` is not positive.
        """
        num_samples = _checks.positive_int("num_samples", num_samples)
        eps = jax.lax.stop_gradient(_keys.standard_normal(seed, self._loc, num_samples))
        x, layers_log_det = self._forward_layers(self._loc[None] + self._scale[None] * eps)
        log_det = layers_log_det + jnp.sum(self._squashing.forward_log_det_jacobian(x), -1)
        normal = jnp.sum(0.5 + HALF_LOG_2PI + jnp.log(self._scale), axis=-1)
        return normal + jnp.mean(log_det, axis=0)

    def kl_divergence(
        self,
        other_dist: distrax.Distribution,
        *,
        seed: PRNGKeyArray | int | None = None,
        num_samples: int = 1,
        **kwargs,
    ) -> Float[Array, "*batch"]:
        """A reparameterised Monte Carlo estimate of ``KL(self || other_dist)``, in nats.

        A flow's KL has no closed form. With ``r = log q(x_K) - log p(x_K)`` at
        ``num_samples`` pre-images ``x_K`` drawn from ``self`` (``p``), each scored
        by :meth:`log_prob_from_pre_image`, the estimate is the mean of ``k3(r) =
        expm1(r) - r`` (the ``approx_kl`` of the heads' metrics): unbiased, since
        the mean of ``exp(r)`` under ``p`` is 1, never negative, and exactly 0 where
        ``other_dist`` has the same parameters and layers. The draws are
        reparameterised, so its gradient with respect to either distribution's
        parameters is unbiased for the KL's too.

        Args:
            other_dist: A ``SquashedFlow`` with the same squashing and the same
                shape ``[*batch, action]`` (its layers may differ).
            seed: A key (or an integer) for the draws; required.
            num_samples: How many draws to average, a positive integer.
            **kwargs: Without ``seed``, passed to ``distrax.Distribution.kl_divergence``.

        Returns:
            The estimate, shape ``[*batch]``; NaN where traced bounds of the
            squashings differ.

        Raises:
            NotImplementedError: ``seed`` is not given (no exact KL exists).
            TypeError: ``other_dist`` is not a ``SquashedFlow``.
            ValueError: the squashings differ, or the shapes do not match.

        Example:
            >>> import jax, jax.numpy as jnp, samplers
            >>> p = samplers.SquashedFlow(jnp.zeros(2), jnp.ones(2))
            >>> q = samplers.SquashedFlow(jnp.ones(2), jnp.ones(2))
            >>> kl = p.kl_divergence(q, seed=jax.random.key(0), num_samples=4096)
            >>> bool(abs(kl - 1.0) < 0.1)  # the base Normals' KL, 1, for the same squashing
            True
        """
        if seed is None:
            return jnp.asarray(super().kl_divergence(other_dist, **kwargs))
        if not isinstance(other_dist, SquashedFlow):
            raise TypeError(
                f"the sample estimate of a SquashedFlow's KL needs another SquashedFlow, got "
                f"{type(other_dist).__name__}; build both with samplers.squashed_flow."
            )
        if other_dist.loc.shape != self._loc.shape:
            raise ValueError(
                f"p and q must have the same shape [*batch, action], got "
                f"{self._loc.shape} and {other_dist.loc.shape}."
            )
        same = same_map(self._squashing, other_dist.squashing)
        if same is False:
            raise ValueError(
                f"p and q must share their squashing, got {bijector_name(self._squashing)} "
                f"and {bijector_name(other_dist.squashing)}; with different squashings a "
                f"pre-image stands for two actions. Build both with the same bijector."
            )
        num_samples = _checks.positive_int("num_samples", num_samples)
        eps = _keys.standard_normal(seed, self._loc, num_samples)
        pre_image = self._forward_layers(self._loc[None] + self._scale[None] * eps)[0]
        log_q = other_dist.log_prob_from_pre_image(pre_image)
        log_ratio = log_q - self.log_prob_from_pre_image(pre_image)
        estimate = jnp.mean(k3(log_ratio), axis=0)
        return estimate if same is True else jnp.where(jnp.all(same), estimate, jnp.nan)

    def __getitem__(self, index) -> "SquashedFlow":
        raise NotImplementedError(
            "a SquashedFlow cannot be indexed: its layers may close over the whole batch "
            "(a conditioner's features); build the distribution from the rows you need."
        )


def _kl_needs_a_seed(p, q, *_, **__):
    """Registered for two ``SquashedFlow``: a flow's KL has no closed form."""
    raise NotImplementedError(
        f"the KL divergence of a {type(p).__name__} and a {type(q).__name__} has no closed "
        f"form; pass a key for its unbiased sample estimate, "
        f"p.kl_divergence(q, seed=key, num_samples=n)."
    )


tfp.distributions.RegisterKL(SquashedFlow, SquashedFlow)(_kl_needs_a_seed)


# An affine layer's log-scale is bounded by a soft clamp, so that one step of training
# cannot make a layer's scale overflow.
_MAX_LOG_SCALE = 3.0


def coupling_layer(
    index: int,
    action_dim: int,
    conditioner: Callable[[Array], Array],
    features: Float[Array, "*batch features"],
    transform: tuple[str, int],
    spline_range: float,
) -> distrax.MaskedCoupling:
    """Coupling layer ``index`` of a flow over ``action_dim`` dimensions, conditioned on
    the untouched dimensions and ``features``: a ``distrax.MaskedCoupling`` that keeps
    the dimensions of the parity of ``index`` (it transforms the one dimension of an
    action of one, conditioned on ``features`` alone) and moves each
    other one by an elementwise transform whose parameters ``conditioner`` computes
    from ``concat(kept, features)``, ``[*batch, action * width]``.

    ``transform`` is ``("affine", 0)``, a shift and a scale whose log is softly clamped
    to ``(-3, 3)`` (width 2), or ``("spline", bins)``, distrax's rational-quadratic
    spline with identity slopes at its ends on ``[-spline_range, spline_range]`` and
    the identity outside (width ``3 * bins + 1``).

    Example:
        >>> import jax.numpy as jnp
        >>> from samplers.distributions.flow import coupling_layer
        >>> layer = coupling_layer(0, 2, lambda x: jnp.zeros((*x.shape[:-1], 4)),
        ...                        jnp.zeros((5, 3)), ("affine", 0), 5.0)
        >>> layer.forward(jnp.ones((5, 2))).shape
        (5, 2)
    """

    def parameters(kept):
        shape = (*kept.shape[:-1], features.shape[-1])
        seen = jnp.concatenate([kept, jnp.broadcast_to(features, shape)], axis=-1)
        return conditioner(seen).reshape(*kept.shape, -1)

    def inner(params) -> distrax.Bijector:
        if transform[0] == "affine":
            log_scale = _MAX_LOG_SCALE * jnp.tanh(params[..., 1] / _MAX_LOG_SCALE)
            return distrax.ScalarAffine(shift=params[..., 0], log_scale=log_scale)
        spline = distrax.RationalQuadraticSpline(
            params, range_min=-spline_range, range_max=spline_range, boundary_slopes="identity"
        )
        # The spline is the identity outside its range whatever its parameters: a shift by
        # 0 * their sum carries a NaN parameter into the value there too.
        guard = distrax.ScalarAffine(shift=0.0 * jnp.sum(params, axis=-1))
        return distrax.Chain([guard, spline])

    if action_dim > 1:
        keep = np.arange(action_dim) % 2 == index % 2
    else:
        keep = np.zeros(1, bool)
    return distrax.MaskedCoupling(jnp.asarray(keep), parameters, inner)
