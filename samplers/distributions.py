"""The pure layer: network outputs in, a ``distrax`` distribution out.

``normal_tanh`` and ``squashed_normal`` turn a vector ``[mean | raw_std]`` into a
:class:`SquashedNormal`, a ``distrax.Transformed`` with the few operations that a
policy head needs and distrax lacks: scoring a stored pre-image, sampling the
action and its pre-image together, the deterministic action and a reparameterised
entropy estimate. Functions of arrays and keys only; no state.
"""

from collections.abc import Callable

import distrax
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray

from samplers import _checks


class SquashedNormal(distrax.Transformed):
    """A diagonal Normal over the last axis pushed through an elementwise bijector.

    ``x = loc + scale * eps`` with ``eps ~ N(0, I)``, and the action is
    ``y = f(x)`` for an elementwise bijector ``f`` (``distrax.Tanh`` by default).
    The density is ``log p(y) = log N(x; loc, scale) - sum log|f'(x)|``.

    Numerical caveat: ``log_prob(y)`` (inherited from ``distrax.Transformed``)
    needs ``x = f^-1(y)``. In float32 ``tanh(x)`` rounds to exactly 1 from
    ``x ~ 8`` on (XLA's ``tanh``), so ``log_prob(tanh(x))`` is NaN there. Keep the pre-image ``x``
    that produced an action and score it with :meth:`log_prob_from_pre_image`,
    which never inverts and is finite for any finite ``x``.

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
        >>> action, pre_image, log_prob = dist.sample_with_pre_image(seed=jax.random.key(0))
        >>> bool(jnp.allclose(log_prob, dist.log_prob(action), atol=1e-4))
        True
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

    def log_prob_from_pre_image(
        self, pre_image: Float[Array, "*batch action"]
    ) -> Float[Array, "*batch"]:
        """Log-density of the action ``f(pre_image)``, computed without inverting ``f``.

        ``base.log_prob(x) - bijector.forward_log_det_jacobian(x)``: finite for any
        finite ``x`` with the bijectors of this package and ``distrax.Tanh``.
        """
        return self.distribution.log_prob(pre_image) - self.bijector.forward_log_det_jacobian(
            pre_image
        )

    def forward_and_log_prob(
        self, pre_image: Float[Array, "*batch action"]
    ) -> tuple[Float[Array, "*batch action"], Float[Array, "*batch"]]:
        """The action ``f(pre_image)`` and its log-density, sharing the bijector's work."""
        action, log_det = self.bijector.forward_and_log_det(pre_image)
        return action, self.distribution.log_prob(pre_image) - log_det

    def sample_pre_image(self, *, seed: PRNGKeyArray) -> Float[Array, "*batch action"]:
        """Draws ``x = loc + scale * eps``, reparameterised (gradients reach loc and scale)."""
        eps = jax.random.normal(seed, self._loc.shape, self._loc.dtype)
        return self._loc + self._scale * eps

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
        return self.bijector.forward(self._loc)

    def entropy_estimate(self, *, seed: PRNGKeyArray) -> Float[Array, "*batch"]:
        """A one-sample reparameterised estimate of the entropy, in nats.

        ``H[y] = H[x] + E[log|f'(x)|]``: the Normal's entropy in closed form plus
        ``forward_log_det_jacobian(loc + scale * eps)`` for one ``eps`` whose
        gradient is stopped, so gradients reach ``loc`` and ``scale``. It is an
        unbiased estimate, not the exact entropy: it varies with ``seed``.
        """
        eps = jax.lax.stop_gradient(jax.random.normal(seed, self._loc.shape, self._loc.dtype))
        return self.distribution.entropy() + self.bijector.forward_log_det_jacobian(
            self._loc + self._scale * eps
        )


def squashed_normal(
    mean_and_std: Float[ArrayLike, "*batch params"],
    bijector: distrax.Bijector | Callable,
    *,
    min_std: float = 1e-3,
    std_scale: float = 1.0,
) -> SquashedNormal:
    """Builds a :class:`SquashedNormal` from a network output ``[mean | raw_std]``.

    The last axis (of even length ``2 * action``) splits into ``mean`` and
    ``raw_std``; ``std = (softplus(raw_std) + min_std) * std_scale``.

    Args:
        mean_and_std: Network output, shape ``[*batch, 2 * action]``, floating.
        bijector: Elementwise squashing, e.g. ``distrax.Tanh()``,
            ``samplers.BoundedTanh(low, high)``, ``distrax.Sigmoid()``.
        min_std: Floor added to the softplus, ``>= 0``.
        std_scale: Factor applied to the std, ``> 0``.

    Returns:
        A ``SquashedNormal`` (a ``distrax.Transformed``) with batch shape
        ``[*batch]`` and event shape ``[action]``.

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
    mean, raw_std = jnp.split(mean_and_std, 2, axis=-1)
    std = (jax.nn.softplus(raw_std) + min_std) * std_scale
    return SquashedNormal(mean, std, bijector)


def normal_tanh(
    mean_and_std: Float[ArrayLike, "*batch params"],
    *,
    min_std: float = 1e-3,
    std_scale: float = 1.0,
) -> SquashedNormal:
    """Builds ``Transformed(Normal(mean, std), Tanh)`` from ``[mean | raw_std]``.

    :func:`squashed_normal` with ``distrax.Tanh()``; see there for the arguments.

    Example:
        >>> import jax.numpy as jnp, samplers
        >>> dist = samplers.normal_tanh(jnp.array([0.0, 0.0, 0.5413, 0.5413]))
        >>> dist.scale.round(3), dist.deterministic_action()
        (Array([1.001, 1.001], dtype=float32), Array([0., 0.], dtype=float32))
    """
    return squashed_normal(mean_and_std, distrax.Tanh(), min_std=min_std, std_scale=std_scale)


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
