"""The NNX shell: modules that hold the stream, ``deterministic`` and replay.

A head calls the pure layer (:mod:`samplers.distributions`) for its distribution
and adds what a training loop needs: the ``nnx.Rngs`` stream, advanced the same
way in rollout and replay; ``module.eval()``; the stored pre-image and its
replay; the entropy cost and metrics.
"""

from samplers.heads.action_sampler import ActionSampler, Scored
from samplers.heads.autoregressive import AutoregressiveSampler
from samplers.heads.beta import BetaSampler
from samplers.heads.composite import CompositeSampler, ParameterizedSampler
from samplers.heads.discrete import CategoricalSampler, MultiBinarySampler, MultiDiscreteSampler
from samplers.heads.distribution_sampler import DistributionSampler
from samplers.heads.flow import FlowSampler
from samplers.heads.functional import functional
from samplers.heads.module import StatefulModule, StatefulModuleOutput
from samplers.heads.spaces import head_for
from samplers.heads.squashed_normal import (
    NormalTanhSampler,
    SquashedNormalSampler,
    StateIndependentSampler,
)
from samplers.heads.tokens import TokenSampler

__all__ = [
    "ActionSampler",
    "AutoregressiveSampler",
    "BetaSampler",
    "CategoricalSampler",
    "CompositeSampler",
    "DistributionSampler",
    "FlowSampler",
    "MultiBinarySampler",
    "MultiDiscreteSampler",
    "NormalTanhSampler",
    "ParameterizedSampler",
    "Scored",
    "SquashedNormalSampler",
    "StateIndependentSampler",
    "StatefulModule",
    "StatefulModuleOutput",
    "TokenSampler",
    "functional",
    "head_for",
]
