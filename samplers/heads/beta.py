"""The Beta head: actions on ``[low, high]`` from a Beta per dimension, sampled or replayed.

Behaviour is driven by ``rollout_extras``, as for the squashed-Normal heads:

- ``None`` (rollout, inference): sample a fresh pre-image ``z = logit(u)`` and emit
  it as ``rollout_extras``, so that a later loss pass can replay it.
- an array (loss replay): score that stored pre-image under the current
  parameters. The stream still advances by the same keys as in the rollout.

``deterministic`` (set by ``module.eval()``, or per call) replaces the fresh sample
by the mean; a replayed pre-image is still scored as given.
"""

from typing import cast

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray

from samplers import _checks
from samplers.distributions.beta import SquashedBeta, squashed_beta
from samplers.distributions.bijectors import BoundedTanh, Squashing, squashing
from samplers.heads.action_sampler import ActionSampler, bound_metrics
from samplers.heads.module import StatefulModuleOutput
from samplers.heads.static import Static


class BetaSampler(ActionSampler):
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
        >>> from samplers.heads.beta import BetaSampler
        >>> head = BetaSampler(nnx.Rngs(0), 0.01, low=-2.0, high=2.0)
        >>> out = head((), jnp.zeros((5, 4)))
        >>> again = head((), jnp.zeros((5, 4)), out.rollout_extras)
        >>> out.output["action"].shape, bool(
        ...     jnp.array_equal(again.output["log_likelihood"], out.output["log_likelihood"]))
        ((5, 2), True)
    """

    def __init__(
        self,
        rngs: nnx.Rngs | nnx.RngStream | None = None,
        entropy_weight: float | None = None,
        *,
        action_dim: int | None = None,
        low: Float[ArrayLike, "*action"] = 0.0,
        high: Float[ArrayLike, "*action"] = 1.0,
        min_concentration: float = 1.0,
        reparameterized: bool = False,
        per_env_streams: bool = False,
        rng_collection: str = "action",
        **deprecated,
    ):
        self._init_stream(rngs, rng_collection, per_env_streams, deprecated)
        self.entropy_weight = _checks.real_number("entropy_weight", entropy_weight)
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
        self.reparameterized = bool(reparameterized)

    @property
    def low(self):
        """The lower bounds, as given."""
        return self._bounds.value[0]

    @property
    def high(self):
        """The upper bounds, as given."""
        return self._bounds.value[1]

    @property
    def num_params(self) -> int:
        """``2 * action_dim``, the width of ``[raw_alpha | raw_beta]``.

        Raises:
            AttributeError: the head was built without ``action_dim``.
        """
        if self.action_dim is None:
            raise AttributeError(
                f"{type(self).__name__} was built without action_dim, so its input width "
                f"is 2 * the action dimension of each input; pass action_dim= to fix "
                f"num_params."
            )
        return 2 * self.action_dim

    def distribution(self, params: Float[Array, "*batch params"], /) -> SquashedBeta:
        """The distribution this sampler draws from for the given network output."""
        if self.action_dim is not None and jnp.shape(params)[-1:] != (self.num_params,):
            raise ValueError(
                f"{type(self).__name__} expects [raw_alpha | raw_beta] of shape "
                f"[*batch, {self.num_params}] (2 * action_dim), got {jnp.shape(params)}; "
                f"size the network's last layer to head.num_params."
            )
        return squashed_beta(params, self.low, self.high, min_concentration=self.min_concentration)

    def __call__(
        self,
        state: tuple[()] | PRNGKeyArray,
        params: Float[Array, "*batch params"],
        rollout_extras: Float[Array, "*batch action"] | None = None,
        *,
        deterministic: bool | None = None,
    ) -> StatefulModuleOutput:
        """Samples a fresh action, or replays the pre-image in ``rollout_extras``.

        Args:
            state: ``()``, or with ``per_env_streams`` one key per batch element.
            params: ``[raw_alpha | raw_beta]``, shape ``[*batch, 2 * action]``.
            rollout_extras: ``None`` to sample; the ``rollout_extras`` of an earlier
                call (the pre-image, ``[*batch, action]``) to replay it.
            deterministic: Overrides ``self.deterministic`` for this call.

        Raises:
            ValueError: the input width is not ``num_params``, the replayed
                pre-image's shape is not the action shape, or the per-environment
                keys do not match the batch shape.
            TypeError: the replayed pre-image is not floating or has fewer bits than
                the dtype the distribution computes in (its replay would not
                reproduce the log-likelihood), or ``state`` is not a key array with
                ``per_env_streams``.
        """
        dist = self.distribution(params)
        deterministic = self._deterministic(deterministic)
        # The entropy key is drawn but unused (the entropy is exact), so that the stream
        # advances as the squashed-Normal heads' does.
        next_state, sample_key, _ = self._keys(state, dist.batch_shape, deterministic)
        a, b = dist.concentration1, dist.concentration0
        if rollout_extras is None:
            if deterministic or sample_key is None:
                pre_image = dist.mean_pre_image()
            else:
                pre_image = dist.sample_pre_image(seed=sample_key)
            if not self.reparameterized:
                pre_image = jax.lax.stop_gradient(pre_image)
        else:
            pre_image = _checks.replayed_pre_image(
                rollout_extras, a.shape, a.dtype, hint=" (the stored pre-image z)"
            )
            pre_image = jax.lax.stop_gradient(pre_image)
        action, log_likelihood = dist.forward_and_log_prob(pre_image)
        bounds = cast(Squashing, squashing(dist.bijector))  # a SquashedBeta declares them
        saturation, bound_distance = bound_metrics(bounds, jax.lax.stop_gradient(action))
        metrics = {
            "alpha": a,
            "beta": b,
            "saturation": saturation,
            "bound_distance": bound_distance,
        }
        return StatefulModuleOutput(
            next_state=next_state,
            output={"action": action, "log_likelihood": log_likelihood},
            regularization_loss=-self.entropy_weight * dist.entropy(),
            metrics=metrics,
            rollout_extras=jax.lax.stop_gradient(pre_image),
        )
