"""Policy heads from distribution objects, for reinforcement learning in JAX.

Two layers, one direction of imports:

- :mod:`samplers.distributions`, the pure layer: network outputs in, real
  ``distrax`` objects out (:func:`normal_tanh`, :func:`squashed_normal`,
  :class:`SquashedNormal`, the bijectors :class:`Tanh`, :class:`Sigmoid`,
  :class:`BoundedTanh`, :class:`SquashedBeta` (a Beta on a box, sampled and
  scored through its logit), :class:`MaskedCategorical` for discrete actions with a
  mask, and diagnostics of the actions);
- :mod:`samplers.heads`, the NNX shell: :class:`SquashedNormalSampler` (and its
  specified name :class:`NormalTanhSampler`), :class:`StateIndependentSampler`
  and :class:`DistributionSampler` hold the RNG stream, deterministic mode and
  replay of stored pre-images.

:func:`cross_check` compares a user's own log-likelihood with this library's.
"""

from samplers._deprecated import kl_divergence, log_prob_from_action, mode, mode_pre_image
from samplers.distributions import (
    BoundedTanh,
    LogitBeta,
    MaskedCategorical,
    MultiBinary,
    MultiDiscrete,
    Sigmoid,
    SquashedBeta,
    SquashedNormal,
    Squashing,
    Tanh,
    bound_distance,
    normal_tanh,
    ppo_log_ratio_stats,
    saturation_fraction,
    squashed_beta,
    squashed_normal,
    squashed_normal_from_log_std,
    squashed_normal_from_std,
)
from samplers.heads import (
    ActionSampler,
    BetaSampler,
    CategoricalSampler,
    CompositeSampler,
    DistributionSampler,
    MultiBinarySampler,
    MultiDiscreteSampler,
    NormalTanhSampler,
    ParameterizedSampler,
    SquashedNormalSampler,
    StatefulModule,
    StatefulModuleOutput,
    StateIndependentSampler,
    functional,
    head_for,
)
from samplers.testing import CrossCheckReport, cross_check

__all__ = [
    "ActionSampler",
    "BetaSampler",
    "BoundedTanh",
    "CategoricalSampler",
    "CompositeSampler",
    "CrossCheckReport",
    "DistributionSampler",
    "LogitBeta",
    "MaskedCategorical",
    "MultiBinary",
    "MultiBinarySampler",
    "MultiDiscrete",
    "MultiDiscreteSampler",
    "NormalTanhSampler",
    "ParameterizedSampler",
    "Sigmoid",
    "SquashedBeta",
    "SquashedNormal",
    "SquashedNormalSampler",
    "Squashing",
    "StateIndependentSampler",
    "StatefulModule",
    "StatefulModuleOutput",
    "Tanh",
    "bound_distance",
    "cross_check",
    "functional",
    "head_for",
    "kl_divergence",
    "log_prob_from_action",
    "mode",
    "mode_pre_image",
    "normal_tanh",
    "ppo_log_ratio_stats",
    "saturation_fraction",
    "squashed_beta",
    "squashed_normal",
    "squashed_normal_from_log_std",
    "squashed_normal_from_std",
]
