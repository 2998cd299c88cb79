"""Policy heads from distribution objects, for reinforcement learning in JAX.

The pure layer (:func:`normal_tanh`, :func:`squashed_normal`,
:class:`SquashedNormal`, :class:`BoundedTanh`) turns network outputs into real
``distrax`` distributions; the NNX layer (:class:`NormalTanhSampler`,
:class:`SquashedNormalSampler`) wraps them with the RNG stream, deterministic
mode and replay of stored pre-images. Around them: scoring actions whose
pre-image was not kept (:func:`log_prob_from_action`), the mode, policy
diagnostics and KL, and :func:`cross_check` for a user's own log-likelihood.
"""

from samplers.bijectors import BoundedTanh, Sigmoid, Tanh
from samplers.diagnostics import (
    bound_distance,
    kl_divergence,
    ppo_log_ratio_stats,
    saturation_fraction,
)
from samplers.distribution_sampler import DistributionSampler
from samplers.distributions import (
    SquashedNormal,
    normal_tanh,
    squashed_normal,
    squashed_normal_from_log_std,
    squashed_normal_from_std,
)
from samplers.inverse import log_prob_from_action
from samplers.mode import mode, mode_pre_image
from samplers.sampler import (
    ActionSampler,
    NormalTanhSampler,
    SquashedNormalSampler,
    StateIndependentSampler,
    functional,
)
from samplers.testing import CrossCheckReport, cross_check
from samplers.types import StatefulModule, StatefulModuleOutput

__all__ = [
    "ActionSampler",
    "BoundedTanh",
    "CrossCheckReport",
    "DistributionSampler",
    "NormalTanhSampler",
    "Sigmoid",
    "SquashedNormal",
    "SquashedNormalSampler",
    "StateIndependentSampler",
    "StatefulModule",
    "StatefulModuleOutput",
    "Tanh",
    "bound_distance",
    "cross_check",
    "functional",
    "kl_divergence",
    "log_prob_from_action",
    "mode",
    "mode_pre_image",
    "normal_tanh",
    "ppo_log_ratio_stats",
    "saturation_fraction",
    "squashed_normal",
    "squashed_normal_from_log_std",
    "squashed_normal_from_std",
]
