"""A policy head for any distrax distribution: sample it, store the sample, replay it.

For distributions without a bijector to saturate (a Beta over ``[0, 1]``, a
Categorical over discrete actions) the stored sample itself is what the loss pass
scores; the stream, deterministic mode and the output contract are those of
:class:`samplers.SquashedNormalSampler`.
"""

from collections.abc import Callable

import distrax
import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from samplers.heads.action_sampler import ActionSampler, Scored
from samplers.heads.static import Static


class DistributionSampler(ActionSampler):
    """Samples from ``make_distribution(params)``, any distrax distribution.

    The rollout draws ``action = dist.sample(seed)`` and emits it as
    ``rollout_extras``; the loss pass scores the stored action with
    ``dist.log_prob`` under the current parameters (for a Categorical, the
    stored index). ``deterministic`` acts with ``dist.mode()`` instead. The
    ``regularization_loss`` is ``-entropy_weight * dist.entropy()``, exact where
    distrax has a closed form (Beta, Categorical, Normal). A rollout draws a key for
    its sample (and one more, unused, as every head does); a replay or an ``eval()``
    call draws none (see :class:`samplers.ActionSampler`).

    Numerical caveat: the stored action is scored as it is. A float32 Beta sample
    can round to exactly 0 or 1, where ``log_prob`` is infinite; for squashed
    Normals store the pre-image instead (:class:`samplers.SquashedNormalSampler`).
    A stored action of another kind than the samples (``dist.dtype``) is refused,
    as distrax would score it as some other action: a float action for a
    distribution of integers (a Categorical gives a stored ``1.7`` the
    log-likelihood 0), and an integer action, or one with fewer bits (bfloat16,
    float16), for a distribution of floats.

    NaN or infinite parameters reach ``make_distribution`` as they are, and what
    they give is that distribution's: a distrax Normal's sample and
    log-likelihood are not finite; a Categorical's log-likelihood is not finite
    and its entropy is NaN, but its action is an integer and cannot be NaN;
    ``-inf`` logits, as action masks use, are a valid Categorical.

    Args:
        rngs: The ``nnx.Rngs`` to draw from (positional or ``rngs=``), or one
            ``nnx.RngStream`` of it; the sampler keeps and advances it.
        entropy_weight: Weight of the entropy bonus, finite (required).
        make_distribution: ``params -> distrax.Distribution``, a pure function of
            the network output.
        per_env_streams: If True, one random stream per environment in the carry
            state, as in :class:`samplers.SquashedNormalSampler`; each batch
            element then samples its row of the distribution (``jax.vmap`` over
            the distribution's arrays, which lead with the batch axes) with its
            own key.
        log_ratio_metrics: If True, the rollout emits ``{"replay_data",
            "log_likelihood"}`` and a replay reports ``log_ratio`` and ``approx_kl``
            (see :class:`samplers.ActionSampler`).
        rng_collection: The stream keys are drawn from, falling back to
            ``default``; see :class:`samplers.ActionSampler`.
        rng: Deprecated, the old name of ``rngs``.

    Raises:
        TypeError: ``rngs`` is not an ``nnx.Rngs`` or ``nnx.RngStream``,
            ``make_distribution`` is not callable or returns something other than
            a distrax distribution.
        ValueError: (when called) the distribution's batch shape is not the
            params' batch shape (all but their last axis), e.g. a
            ``distrax.Normal`` over the action axis not wrapped in
            ``distrax.Independent(..., 1)``.

    Example:
        >>> import distrax, jax.numpy as jnp, samplers
        >>> from flax import nnx
        >>> head = samplers.DistributionSampler(
        ...     nnx.Rngs(0), 0.01, lambda logits: distrax.Categorical(logits=logits)
        ... )
        >>> out = head((), jnp.zeros((4, 3)))
        >>> again = head((), jnp.zeros((4, 3)), out.rollout_extras)
        >>> out.output["action"].shape, bool(jnp.all(again.output["log_likelihood"] < 0))
        ((4,), True)
    """

    def __init__(
        self,
        rngs: nnx.Rngs | nnx.RngStream | None = None,
        entropy_weight: float | None = None,
        make_distribution: Callable[[Array], distrax.Distribution] | None = None,
        *,
        per_env_streams: bool = False,
        log_ratio_metrics: bool = False,
        rng_collection: str = "action",
        rng: nnx.Rngs | nnx.RngStream | None = None,
    ):
        if not callable(make_distribution):
            raise TypeError(
                f"make_distribution must be a function params -> distrax distribution, got "
                f"{type(make_distribution).__name__}."
            )
        super().__init__(
            rngs,
            entropy_weight,
            per_env_streams=per_env_streams,
            log_ratio_metrics=log_ratio_metrics,
            rng_collection=rng_collection,
            rng=rng,
        )
        self._make_distribution = Static(make_distribution)

    @property
    def num_params(self) -> int:
        """None: ``make_distribution`` takes network outputs of any width.

        Raises:
            AttributeError: always.
        """
        raise AttributeError(
            "DistributionSampler has no num_params: make_distribution takes network outputs "
            "of any width; in a composite, use a head with a fixed width."
        )

    def _distribution(self, inputs: Float[Array, "*batch params"], mask=None):
        params = inputs
        dist = self._make_distribution.value(params)
        if not isinstance(dist, distrax.Distribution):
            raise TypeError(
                f"make_distribution must return a distrax.Distribution, got "
                f"{type(dist).__name__}; wrap a TFP distribution with distrax.as_distribution."
            )
        params_batch = jnp.shape(params)[:-1]
        if dist.batch_shape != params_batch:
            raise ValueError(
                f"make_distribution returned a distribution of batch shape {dist.batch_shape} "
                f"for params of batch shape {params_batch} (all but the last axis), so the "
                f"log-likelihood would have one value per action dimension; wrap it as "
                f"distrax.Independent(dist, 1) to score the action vector as one event."
            )
        return dist

    def _sample(self, inputs, dist, modes, key) -> Scored:
        if modes or not self.per_env_streams:
            return super()._sample(inputs, dist, modes, key)
        # Each row of the user's distribution, made from its row of inputs: a distrax
        # distribution's arrays need not lead with the batch axes.
        batch_shape = key.shape
        rows = inputs.reshape(-1, *inputs.shape[len(batch_shape) :])
        draw = jax.vmap(lambda row, k: self._make_distribution.value(row).sample(seed=k))
        samples = draw(rows, key.reshape(-1))
        return self._replay(
            dist, jax.lax.stop_gradient(samples.reshape(key.shape + samples.shape[1:]))
        )
