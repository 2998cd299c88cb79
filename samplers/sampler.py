"""The NNX layer: a policy head's last layer, drawing from the ``nnx.Rngs`` it holds.

Behaviour is driven by ``rollout_extras``:

- ``None`` (rollout, inference): sample a fresh pre-image ``x`` and emit it as
  ``rollout_extras`` so that a later loss pass can replay it.
- an array (loss replay): score that stored pre-image under the current
  parameters. The stream still advances by the same keys as in the rollout, so
  other stochastic layers stay in lockstep.

``deterministic`` (set by ``module.eval()``) replaces the fresh sample by the
mean, so the action is ``f(mean)``; a replayed pre-image is still scored as given.
Each call draws one key for the sample (none when deterministic) and then one
for the entropy estimate.
"""

import abc
from collections.abc import Callable

import distrax
import jax
from flax import nnx
from jaxtyping import Array, Float

from samplers import _checks
from samplers.distributions import SquashedNormal, squashed_normal
from samplers.types import StatefulModule, StatefulModuleOutput


class ActionSampler(StatefulModule, abc.ABC):
    """A stateless policy head: distribution parameters in, an action out.

    Attributes:
        deterministic: If True (``module.eval()``), act with the distribution's
            deterministic action instead of sampling.
    """

    deterministic: bool = False

    @abc.abstractmethod
    def __call__(
        self,
        state: tuple[()],
        inputs: Float[Array, "*batch params"],
        rollout_extras: Float[Array, "*batch action"] | None = None,
    ) -> StatefulModuleOutput:
        """Samples (``rollout_extras is None``) or replays an action."""

    def initialize_state(self, batch_size: int) -> tuple[()]:
        """A sampler is stateless: ``()``."""
        return ()

    def reset_state(self, prev_state: tuple[()]) -> tuple[()]:
        """A sampler is stateless: ``()``."""
        return ()


class SquashedNormalSampler(ActionSampler):
    """Samples ``f(x)``, ``x ~ N(mean, std)``, for an elementwise distrax bijector ``f``.

    The input's last axis is ``[mean | raw_std]`` and
    ``std = (softplus(raw_std) + min_std) * std_scale``; the distribution is
    :func:`samplers.squashed_normal`. The output is
    ``{"action": f(x), "log_likelihood": log p(f(x))}``, with ``x`` in
    ``rollout_extras`` and the log-likelihood computed from ``x`` (never from
    ``f^-1(action)``, which is infinite once ``f`` saturates). The
    ``regularization_loss`` is ``-entropy_weight * H`` for a one-sample
    reparameterised entropy estimate ``H`` (unbiased, not exact); ``metrics``
    holds ``mu`` and ``sigma``.

    Args:
        rng: The stream to draw from; the sampler keeps and advances it.
        entropy_weight: Weight of the entropy bonus, finite.
        bijector: Elementwise squashing, e.g. ``samplers.BoundedTanh(low, high)``,
            ``distrax.Sigmoid()`` or ``distrax.Lambda(lambda x: x)``.
        min_std: Floor added to the softplus, ``>= 0``.
        std_scale: Factor applied to the std, ``> 0``.

    Raises:
        TypeError: ``rng`` is not an ``nnx.Rngs`` or an option is not a number.
        ValueError: an option is out of range or not finite.

    Example:
        >>> import distrax, jax.numpy as jnp, samplers
        >>> from flax import nnx
        >>> head = samplers.SquashedNormalSampler(nnx.Rngs(0), 0.01, bijector=distrax.Sigmoid())
        >>> out = head((), jnp.zeros((5, 4)))
        >>> out.output["action"].shape, out.rollout_extras.shape
        ((5, 2), (5, 2))
    """

    def __init__(
        self,
        rng: nnx.Rngs,
        entropy_weight: float,
        *,
        bijector: distrax.Bijector | Callable,
        min_std: float = 1e-3,
        std_scale: float = 1.0,
    ):
        if not isinstance(rng, nnx.Rngs):
            raise TypeError(
                f"rng must be an nnx.Rngs, got {type(rng).__name__}; pass e.g. nnx.Rngs(0)."
            )
        self.rng = rng
        self.entropy_weight = _checks.real_number("entropy_weight", entropy_weight)
        self.min_std = _checks.real_number("min_std", min_std, minimum=0.0)
        self.std_scale = _checks.real_number("std_scale", std_scale, above=0.0)
        # Bijector parameters (e.g. bounds) are arrays: nnx keeps them as data.
        self.bijector = nnx.data(distrax.as_bijector(bijector))
        self.deterministic = False

    def distribution(self, mean_and_std: Float[Array, "*batch params"]) -> SquashedNormal:
        """The distribution this sampler draws from for the given network output."""
        return squashed_normal(
            mean_and_std, self.bijector, min_std=self.min_std, std_scale=self.std_scale
        )

    def __call__(
        self,
        state: tuple[()],
        mean_and_std: Float[Array, "*batch params"],
        rollout_extras: Float[Array, "*batch action"] | None = None,
    ) -> StatefulModuleOutput:
        """Samples a fresh action, or replays the pre-image in ``rollout_extras``.

        Args:
            state: ``()`` (the sampler is stateless).
            mean_and_std: ``[mean | raw_std]``, shape ``[*batch, 2 * action]``.
            rollout_extras: ``None`` to sample; the ``rollout_extras`` of an
                earlier call (shape ``[*batch, action]``) to replay it.

        Raises:
            ValueError: the replayed pre-image's shape is not the action shape.
            TypeError: the replayed pre-image is not floating.
        """
        dist = self.distribution(mean_and_std)
        if rollout_extras is None:
            pre_image = dist.loc if self.deterministic else dist.sample_pre_image(seed=self.rng())
        else:
            if not self.deterministic:
                self.rng()  # the key the rollout sampled with, so the stream stays in step
            pre_image = _replayed(rollout_extras, dist.loc.shape)
        pre_image = jax.lax.stop_gradient(pre_image)
        action, log_likelihood = dist.forward_and_log_prob(pre_image)
        entropy = dist.entropy_estimate(seed=self.rng())
        return StatefulModuleOutput(
            next_state=(),
            output={"action": action, "log_likelihood": log_likelihood},
            regularization_loss=-self.entropy_weight * entropy,
            metrics={"mu": dist.loc, "sigma": dist.scale},
            rollout_extras=pre_image,
        )


class NormalTanhSampler(SquashedNormalSampler):
    """Samples ``tanh(x)``, ``x ~ N(mean, std)``: :class:`SquashedNormalSampler` with tanh.

    Args:
        rng: The stream to draw from; the sampler keeps and advances it.
        entropy_weight: Weight of the entropy bonus, finite.
        min_std: Floor added to the softplus, ``>= 0``.
        std_scale: Factor applied to the std, ``> 0``.

    Example:
        >>> import jax.numpy as jnp, samplers
        >>> from flax import nnx
        >>> head = samplers.NormalTanhSampler(nnx.Rngs(0), entropy_weight=0.01)
        >>> out = head((), jnp.zeros(4))
        >>> again = head((), jnp.zeros(4), out.rollout_extras)
        >>> bool(jnp.allclose(again.output["log_likelihood"], out.output["log_likelihood"]))
        True
        >>> head.eval()
        >>> head((), jnp.zeros(4)).output["action"]
        Array([0., 0.], dtype=float32)
    """

    def __init__(
        self,
        rng: nnx.Rngs,
        entropy_weight: float,
        min_std: float = 1e-3,
        std_scale: float = 1.0,
    ):
        super().__init__(
            rng, entropy_weight, bijector=distrax.Tanh(), min_std=min_std, std_scale=std_scale
        )


def _replayed(rollout_extras, action_shape: tuple[int, ...]) -> Float[Array, "*batch action"]:
    """Checks a replayed pre-image against the action shape of this call."""
    pre_image = _checks.float_array(
        "rollout_extras", rollout_extras, hint=" (the stored pre-tanh action)"
    )
    if pre_image.shape != action_shape:
        raise ValueError(
            f"rollout_extras must have the action shape {action_shape} (the stored raw "
            f"action of this batch), got {pre_image.shape}; pass the rollout_extras that "
            f"the rollout call returned for these inputs."
        )
    return pre_image
