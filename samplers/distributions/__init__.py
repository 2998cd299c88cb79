"""The pure layer: network outputs in, real ``distrax`` objects out.

Functions of arrays and keys, no state: the bijectors (:mod:`.bijectors`), the
:class:`SquashedNormal` distribution (:mod:`.squashed_normal`), the
:class:`MaskedCategorical` (:mod:`.categorical`), :class:`MultiDiscrete` and
:class:`MultiBinary` (:mod:`.discrete`), the Beta on a box :class:`SquashedBeta`
and its pre-image's :class:`LogitBeta` (:mod:`.beta`), the flow :class:`SquashedFlow`
(:mod:`.flow`), the vocabulary-sized :class:`TokenCategorical` (:mod:`.tokens`), the
squashed Normal's and the flow's constructors from network outputs (:mod:`.constructors`)
and the diagnostics of its actions (:mod:`.diagnostics`). The NNX shell
(:mod:`samplers.heads`) imports this layer, never the other way round.
"""

from samplers.distributions.autoregressive import Autoregressive, MaskTable
from samplers.distributions.beta import LogitBeta, SquashedBeta
from samplers.distributions.bijectors import BoundedTanh, Sigmoid, Squashing, Tanh
from samplers.distributions.categorical import MaskedCategorical
from samplers.distributions.composite import Composite, Parameterized
from samplers.distributions.constructors import (
    normal_tanh,
    squashed_beta,
    squashed_flow,
    squashed_normal,
    squashed_normal_from_log_std,
    squashed_normal_from_std,
)
from samplers.distributions.diagnostics import (
    bound_distance,
    ppo_log_ratio_stats,
    saturation_fraction,
)
from samplers.distributions.discrete import MultiBinary, MultiDiscrete
from samplers.distributions.flow import SquashedFlow
from samplers.distributions.replay import Replayable
from samplers.distributions.squashed_normal import SquashedNormal
from samplers.distributions.tokens import TokenCategorical, support_from_kept_ids

__all__ = [
    "Autoregressive",
    "BoundedTanh",
    "Composite",
    "LogitBeta",
    "MaskTable",
    "MaskedCategorical",
    "MultiBinary",
    "MultiDiscrete",
    "Parameterized",
    "Replayable",
    "Sigmoid",
    "SquashedBeta",
    "SquashedFlow",
    "SquashedNormal",
    "Squashing",
    "Tanh",
    "TokenCategorical",
    "bound_distance",
    "normal_tanh",
    "ppo_log_ratio_stats",
    "saturation_fraction",
    "squashed_beta",
    "squashed_flow",
    "squashed_normal",
    "squashed_normal_from_log_std",
    "squashed_normal_from_std",
    "support_from_kept_ids",
]
