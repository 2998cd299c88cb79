"""What the heads replayed by a pre-image share: the entropy choice and the bound metrics.

The squashed-Normal, flow and Beta heads store the pre-image of their squashing
(:class:`samplers.distributions.pre_image.PreImageReplay`); they differ in their
distribution and in which entropies they offer.
"""

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array

from samplers import _checks
from samplers._deprecated import counted_entropy
from samplers.distributions.diagnostics import bound_metrics
from samplers.heads.action_sampler import ActionSampler, Scored

# The entropy choices that take a number of samples or nodes, with its default.
_COUNTED = {"sample": 1, "quadrature": 8}
_CLOSED_FORMS = ("exact", "base")

Entropy = str | tuple[str, int]


class PreImageSampler(ActionSampler):
    """A head whose replay data is the pre-image of an elementwise squashing.

    Its entropy cost is ``-entropy_weight * H`` for the entropy ``H`` chosen by
    ``entropy``: ``"sample"`` (``("sample", n)``: the mean of ``n`` reparameterised
    samples, an unbiased estimate, the only choice that draws a key),
    ``"quadrature"`` (``("quadrature", n)``), ``"exact"`` (``dist.entropy()``) or
    ``"base"`` (the entropy before the squashing); each head says which it offers.
    Its metrics are its parameters' and, for a bounded squashing, per batch element
    ``saturation``, the fraction of action dimensions exactly on a bound, and
    ``bound_distance``, the smallest distance of the action to a bound.
    """

    _stored_name = "pre_image"

    def __init__(
        self,
        rngs: nnx.Rngs | nnx.RngStream | None,
        entropy_weight: float | None,
        *,
        entropy: Entropy = "exact",
        reparameterized: bool = False,
        per_env_streams: bool = False,
        log_ratio_metrics: bool = False,
        rng_collection: str = "action",
        rng: nnx.Rngs | nnx.RngStream | None = None,
        entropy_points: int | None = None,
    ):
        super().__init__(
            rngs,
            entropy_weight,
            reparameterized=reparameterized,
            per_env_streams=per_env_streams,
            log_ratio_metrics=log_ratio_metrics,
            rng_collection=rng_collection,
            rng=rng,
        )
        self.entropy = _entropy_choice(counted_entropy(entropy, entropy_points, _COUNTED))

    @property
    def num_params(self) -> int:
        """``2 * action_dim``: two parameters per action dimension.

        Raises:
            AttributeError: the head was built without ``action_dim``, so it takes
                inputs of any even width.
        """
        action_dim = getattr(self, "action_dim", None)
        if action_dim is None:
            raise AttributeError(
                f"{type(self).__name__} was built without action_dim, so its input width "
                f"is 2 * the action dimension of each input; pass action_dim= (or build it "
                f"with samplers.head_for) to fix num_params."
            )
        return 2 * action_dim

    def _sample(self, inputs, dist, modes: Any, key) -> Scored:
        if modes:
            return super()._sample(inputs, dist, modes, key)
        if self.reparameterized:
            # An actor that differentiates a fresh sample (SAC) scores it forward.
            action, pre_image, log_likelihood = dist.sample_with_pre_image(seed=key)
        else:  # a rollout: a constant pre-image, scored as its replay will score it
            sampled = dist.sample_with_replay(seed=key, reparameterized=False)
            action, pre_image, log_likelihood = sampled
        return Scored(pre_image, action, log_likelihood)

    def _entropy_needs_key(self) -> bool:
        return self.entropy[0] == "sample"

    def _regularization(self, dist, key, scored: Scored) -> Array:
        name, points = self.entropy
        if name == "sample":
            entropy = dist.entropy_estimate(seed=key, num_samples=points)
        elif name == "quadrature":
            entropy = dist.entropy_quadrature(points)
        elif name == "exact":
            entropy = dist.entropy()
        else:
            entropy = dist.distribution.entropy()
        return -self.entropy_weight * jnp.asarray(entropy)

    def _metrics(self, inputs, dist, scored: Scored) -> dict:
        if dist.bounds is None:
            return {}
        action = jax.lax.stop_gradient(scored.action)
        saturation, bound_distance = bound_metrics(dist.bounds, action)
        return {"saturation": saturation, "bound_distance": bound_distance}


def _entropy_choice(entropy) -> tuple[str, int]:
    """``entropy`` as ``(name, points)`` (0 for the closed forms)."""
    if isinstance(entropy, str) and entropy in _CLOSED_FORMS:
        return entropy, 0
    if isinstance(entropy, str) and entropy in _COUNTED:
        return entropy, _COUNTED[entropy]
    if isinstance(entropy, tuple) and len(entropy) == 2 and entropy[0] in _COUNTED:
        return entropy[0], _checks.positive_int(f"the count in entropy={entropy!r}", entropy[1])
    raise ValueError(
        f"entropy must be 'sample', 'quadrature', 'exact' or 'base', or ('sample', n) or "
        f"('quadrature', n) with n >= 1, got {entropy!r}."
    )
