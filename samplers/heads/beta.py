"""The Beta head: actions on ``[low, high]`` from a Beta per dimension, sampled or replayed.

The replay data is the pre-image ``z = logit(u)``, as the squashed-Normal heads store
theirs; the call is :class:`samplers.ActionSampler`'s.
"""

import numpy as np
from flax import nnx
from jaxtyping import Array, ArrayLike, Float

from samplers import _checks
from samplers.distributions.beta import SquashedBeta
from samplers.distributions.bijectors import BoundedTanh
from samplers.distributions.constructors import squashed_beta
from samplers.heads.pre_image import PreImageSampler
from samplers.heads.static import Static


class BetaSampler(PreImageSampler):
    """Samples actions on ``[low, high]`` from a Beta per dimension (:class:`SquashedBeta`).

    The input's last axis is ``[raw_alpha | raw_beta]`` and each concentration is
    ``min_concentration + softplus(raw)`` (:func:`squashed_beta`). The action is
    ``low + (high - low) * sigmoid(z)`` for the pre-image ``z = log G_a - log G_b``,
    which is emitted as ``rollout_extras``; the log-likelihood is computed from
    ``z``, so it is finite also where the action rounds onto a bound, and a replay
    of the stored ``z`` gives the rollout's log-likelihood bit for bit (same
    parameters, same batch shape). The output is ``{"action", "log_likelihood"}``;
    the ``regularization_loss`` is ``-entropy_weight * H``, ``H`` the exact entropy
    of the action (:meth:`SquashedBeta.entropy`).

    ``metrics`` holds, per batch element, ``alpha`` and ``beta`` (the
    concentrations, ``[*batch, action]``), ``saturation``, the fraction of action
    dimensions exactly on a bound, and ``bound_distance``, the smallest distance of
    the action to a bound.

    The deterministic action (``module.eval()``) is the mean,
    ``low + (high - low) a / (a + b)``, whose pre-image is ``log a - log b``: unlike
    the mode it is defined for every ``a, b > 0``, lies inside the range (strictly,
    but for float rounding), and is smooth in the parameters, which is what a
    TD3-style ``-Q(s, mean)`` needs.

    Args:
        rngs: The ``nnx.Rngs`` to draw from (positional or ``rngs=``), or one
            ``nnx.RngStream`` of it; the sampler keeps and advances it.
        entropy_weight: Weight of the entropy bonus, finite (required).
        action_dim: The number of action dimensions, keyword-only, if known: then
            :attr:`num_params` is ``2 * action_dim`` and a call refuses an input of
            another width. ``None`` takes it from each input.
        low: Lower bounds, a scalar or one per action dimension.
        high: Upper bounds, the same shape, above ``low``.
        min_concentration: The floor of each concentration, ``>= 0``; the default
            1 keeps the density unimodal and finite on the bounds.
        reparameterized: If True, a fresh sample (and the mean in eval mode) keeps
            its pathwise gradient with respect to the concentrations (implicit
            reparameterisation of the Gamma draws), as SAC's
            ``alpha * log_likelihood - Q(s, action)`` needs. If False (the default,
            for PPO-style replay) the action is a constant and gradients reach the
            parameters through its log-density only. Values do not depend on it.
        per_env_streams: If True, each environment has its own random stream in
            the carry state (see :meth:`initialize_state`), so its samples do not
            depend on how the batch is split.
        log_ratio_metrics: As in :class:`samplers.ActionSampler`: the rollout
            emits ``{"pre_image", "log_likelihood"}``, a replay reports ``log_ratio``
            and ``approx_kl``.
        rng_collection: The stream keys are drawn from, falling back to
            ``default``.

    Raises:
        TypeError: no stream, or an option is not a number, or an unknown keyword.
        ValueError: an option is out of range or not finite, or the bounds are
            invalid (as :class:`samplers.BoundedTanh` refuses them) or not of shape
            ``()`` or ``(action_dim,)``.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from samplers import BetaSampler
        >>> head = BetaSampler(nnx.Rngs(0), 0.01, low=-2.0, high=2.0)
        >>> out = head((), jnp.zeros((5, 4)))
        >>> again = head((), jnp.zeros((5, 4)), out.rollout_extras)
        >>> out.output["action"].shape, bool(
        ...     jnp.array_equal(again.output["log_likelihood"], out.output["log_likelihood"]))
        ((5, 2), True)
    """

    def __init__(
        self,
        rngs: nnx.Rngs | nnx.RngStream,
        entropy_weight: float,
        *,
        action_dim: int | None = None,
        low: Float[ArrayLike, "*action"] = 0.0,
        high: Float[ArrayLike, "*action"] = 1.0,
        min_concentration: float = 1.0,
        reparameterized: bool = False,
        per_env_streams: bool = False,
        log_ratio_metrics: bool = False,
        rng_collection: str = "action",
    ):
        super().__init__(
            rngs,
            entropy_weight,
            reparameterized=reparameterized,
            per_env_streams=per_env_streams,
            log_ratio_metrics=log_ratio_metrics,
            rng_collection=rng_collection,
        )
        self.action_dim = (
            None if action_dim is None else _checks.positive_int("action_dim", action_dim)
        )
        self.min_concentration = _checks.real_number(
            "min_concentration", min_concentration, minimum=0.0
        )
        BoundedTanh(low, high)  # the checks every bounded head applies to its bounds
        if self.action_dim is not None and np.shape(low) not in ((), (self.action_dim,)):
            raise ValueError(
                f"low and high must have shape () or (action_dim,) = ({self.action_dim},), "
                f"got {np.shape(low)}."
            )
        self._bounds = Static((low, high))

    @property
    def low(self):
        """The lower bounds, as given."""
        return self._bounds.value[0]

    @property
    def high(self):
        """The upper bounds, as given."""
        return self._bounds.value[1]

    def _distribution(self, inputs: Float[Array, "*batch params"], mask=None) -> SquashedBeta:
        if self.action_dim is not None:
            self._check_width(inputs, "[raw_alpha | raw_beta]", "2 * action_dim")
        return squashed_beta(inputs, self.low, self.high, min_concentration=self.min_concentration)

    def _metrics(self, inputs, dist, scored) -> dict:
        alpha, beta = dist.concentration1, dist.concentration0
        return {"alpha": alpha, "beta": beta, **super()._metrics(inputs, dist, scored)}
