"""A normalizing-flow policy: a Normal, learned layers, then a squashing.

``x0 ~ N(loc, scale)`` goes through the layers ``g_1 .. g_K`` (bijectors on the
action vector, such as distrax's ``MaskedCoupling``, whose conditioners may also see
the state) and then an elementwise squashing ``f``: the action is
``f(g_K(... g_1(x0)))``. The replay data is the squashing's pre-image
``x_K = g_K(... g_1(x0))``, which fixes the action; it is scored through the layers'
inverses (exact in closed form for coupling layers), never the squashing's.
"""

from collections.abc import Sequence
from typing import Any

import distrax
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray

from samplers import _checks
from samplers._numerics import HALF_LOG_2PI
from samplers.distributions import _pre_images, _squashed
from samplers.distributions.bijectors import Tanh, squashing
from samplers.distributions.replay import Replayable, SampleShape, Seed

_TANH = Tanh()


class SquashedFlow(distrax.Transformed, Replayable):
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

    def _inverse_layers(self, pre_image) -> tuple[Array, Array]:
        """``(x0, sum_k log|det J_k^-1|)`` for the squashing's pre-image ``x_K``."""
        x, log_det = pre_image, jnp.zeros(pre_image.shape[:-1], pre_image.dtype)
        for layer in reversed(self._layers):
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

    def _squash(self, x) -> Array:
        """``f(x)``, for the squashings differentiated with ``f'(x) > 0`` also on a bound."""
        if squashing(self._squashing) is None:
            return jnp.asarray(self._squashing.forward(x))
        return _squashed.squashing_forward(self._squashing, x)

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
        pre_image = _checks.float_array("pre_image", pre_image)
        try:
            shape = jnp.broadcast_shapes(pre_image.shape, self._loc.shape)
        except ValueError:
            raise ValueError(
                f"pre_image must broadcast with the distribution's shape [*batch, action] = "
                f"{self._loc.shape}, got {pre_image.shape}; give it shape "
                f"[*sample, *batch, action]."
            ) from None
        dtype = jnp.result_type(pre_image, self._loc)
        x, loc, scale = (
            jnp.broadcast_to(a, shape).astype(dtype) for a in (pre_image, self._loc, self._scale)
        )
        base_draw, layers_log_det = self._inverse_layers(x)
        log_normal = jnp.sum(_squashed.log_normal(base_draw, loc, scale), axis=-1)
        squash_log_det = jnp.sum(self._squashing.forward_log_det_jacobian(x), axis=-1)
        return log_normal + layers_log_det - squash_log_det

    def forward_and_log_prob(
        self, pre_image: Float[ArrayLike, "*sample_and_batch action"]
    ) -> tuple[Float[Array, "*sample_and_batch action"], Float[Array, "*sample_and_batch"]]:
        """The action ``f(x_K)`` and :meth:`log_prob_from_pre_image` of ``x_K``.

        The action's derivative with respect to ``x_K`` is ``f'(x_K)``, positive also
        where ``f(x_K)`` rounds onto a bound.
        """
        log_prob = self.log_prob_from_pre_image(pre_image)
        return self._squash(jnp.asarray(pre_image)), log_prob

    def sample_pre_image(self, *, seed: PRNGKeyArray | int) -> Float[Array, "*batch action"]:
        """Draws ``x_K = g_K(... g_1(loc + scale * eps))``, reparameterised (gradients
        reach ``loc``, ``scale`` and the layers); ``seed`` is one key (or an integer) or
        one typed key per batch element."""
        base_draw = self._loc + self._scale * _pre_images.standard_normal(seed, self._loc)
        return self._forward_layers(base_draw)[0]

    def _remember(self, pre_image, action) -> Array:
        _pre_images.PRE_IMAGES.remember(action, pre_image, self.bijector)
        return action

    def sample_replay_data(self, *, seed) -> Array:
        """:meth:`sample_pre_image`: the squashing's pre-image is the replay data."""
        return self.sample_pre_image(seed=seed)

    def deterministic_replay_data(self) -> Float[Array, "*batch action"]:
        """``g_K(... g_1(loc))``: the deterministic action is the flow and squashing of the
        base mean (not the mode of a multimodal flow)."""
        return self._forward_layers(self._loc)[0]

    def replay(self, replay_data) -> tuple[Float[Array, "*batch action"], Float[Array, "*batch"]]:
        """The action of the stored pre-image ``x_K`` (remembered, as a sample's) and its
        log-density."""
        action, log_prob = self.forward_and_log_prob(replay_data)
        return self._remember(replay_data, action), log_prob

    def check_replay_data(self, replay_data) -> Array:
        """A stored pre-image of the action shape, floating, at the parameters' precision."""
        return _checks.replayed_pre_image(
            replay_data, self._loc.shape, self._loc.dtype, hint=" (the stored pre-squash action)"
        )

    def deterministic_action(self) -> Float[Array, "*batch action"]:
        """``f(g_K(... g_1(loc)))``, remembered with its pre-image for ``log_prob``."""
        return self.replay(self.deterministic_replay_data())[0]

    def sample(self, *, seed: Seed, sample_shape: SampleShape = ()) -> Array:
        """Samples actions, remembering their pre-images ``x_K``: ``log_prob`` of the
        returned array scores them. Shape ``[*sample_shape, *batch, action]``."""
        pre_image = self._forward_layers(
            self.distribution.sample(seed=seed, sample_shape=sample_shape)
        )[0]
        return self._remember(pre_image, self._squash(pre_image))

    def sample_and_log_prob(
        self, *, seed: Seed, sample_shape: SampleShape = ()
    ) -> tuple[Array, Array]:
        """The draws of :meth:`sample` and their log-densities, as their replay scores
        them (the layers inverted, the squashing not)."""
        base_draw = self.distribution.sample(seed=seed, sample_shape=sample_shape)
        pre_image = self._forward_layers(base_draw)[0]
        action, log_prob = self.forward_and_log_prob(pre_image)
        return self._remember(pre_image, action), log_prob

    def log_prob(self, value: Float[ArrayLike, "*value_batch action"]) -> Array:
        """A sample's log-density from its remembered pre-image; any other action's
        through the inverses, the squashing's included (``distrax.Transformed.log_prob``):
        NaN or infinite where that inverse is (on a bound, or within rounding of one)."""
        pre_image = _pre_images.PRE_IMAGES.recall(value, self.bijector)
        if pre_image is not None:
            return self.log_prob_from_pre_image(pre_image)
        return jnp.asarray(super().log_prob(value))

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
        eps = jax.lax.stop_gradient(_pre_images.standard_normal(seed, self._loc, num_samples))
        x, layers_log_det = self._forward_layers(self._loc[None] + self._scale[None] * eps)
        log_det = layers_log_det + jnp.sum(self._squashing.forward_log_det_jacobian(x), -1)
        normal = jnp.sum(0.5 + HALF_LOG_2PI + jnp.log(self._scale), axis=-1)
        return normal + jnp.mean(log_det, axis=0)

    def __getitem__(self, index) -> "SquashedFlow":
        raise NotImplementedError(
            "a SquashedFlow cannot be indexed: its layers may close over the whole batch "
            "(a conditioner's features); build the distribution from the rows you need."
        )
