"""Policy heads from distribution objects, for reinforcement learning in JAX.

Two layers, one direction of imports:

- :mod:`samplers.distributions`, the pure layer: network outputs in, real
  ``distrax`` distributions out, which sample an action with the data that scores
  it again exactly. The bijectors :class:`Tanh`, :class:`Sigmoid` and
  :class:`BoundedTanh` declare their bounds as a :class:`Squashing`;
  :class:`SquashedNormal` is built by :func:`normal_tanh`, :func:`squashed_normal`,
  :func:`squashed_normal_from_std` and :func:`squashed_normal_from_log_std`;
  :class:`SquashedBeta` (built by :func:`squashed_beta`) is a Beta on a box, sampled
  and scored through its logit, whose distribution is :class:`LogitBeta`;
  :class:`MaskedCategorical`, :class:`MultiDiscrete` and :class:`MultiBinary` are
  discrete distributions with action masks; :class:`Composite` (independent parts
  of a ``Dict`` or ``Tuple`` action), :class:`Parameterized` (a choice among
  discrete actions with parameters of their own) and :class:`Autoregressive`
  (sub-actions each conditioned on the earlier ones, masked by functions of them or
  by a :class:`MaskTable`) are distributions over structured actions;
  :class:`SquashedFlow` (built by :func:`squashed_flow`) is a Normal through learned
  layers, such as state-conditioned coupling layers, then a squashing;
  :class:`TokenCategorical` is a Categorical over a language model's vocabulary,
  truncated, streamed in blocks, whose support a sample stores
  (:func:`support_from_kept_ids` imports a sampling engine's); :class:`Replayable` is
  the protocol of a distribution that samples an action with its replay data;
  :func:`saturation_fraction`, :func:`bound_distance` and :func:`ppo_log_ratio_stats`
  diagnose the actions.
- :mod:`samplers.heads`, the NNX shell: heads built on :class:`ActionSampler` that
  hold the RNG stream, deterministic mode, the replay of stored data and the entropy
  cost. :class:`SquashedNormalSampler` (and its specified name
  :class:`NormalTanhSampler`) and :class:`StateIndependentSampler` for squashed
  Normals, :class:`BetaSampler` for a Beta on a box, :class:`CategoricalSampler`,
  :class:`MultiDiscreteSampler` and :class:`MultiBinarySampler` for masked discrete
  actions, :class:`CompositeSampler` for ``Dict`` and ``Tuple`` actions,
  :class:`ParameterizedSampler` for parameterised actions,
  :class:`AutoregressiveSampler` for sub-actions conditioned (and masked) on the
  earlier ones, :class:`FlowSampler` for a flow of coupling layers it learns,
  :class:`TokenSampler` for a language model's next token (a :class:`TokenCategorical`
  of its hidden states and unembedding), and :class:`DistributionSampler` for any
  distrax distribution; :func:`head_for` picks
  the head for a gymnasium or gymnax action space.

:func:`cross_check` compares a user's own log-likelihood with this library's.
"""

from samplers import distributions, heads
from samplers._deprecated import kl_divergence, log_prob_from_action, mode, mode_pre_image
from samplers.distributions import *  # noqa: F403  (its __all__, added below)
from samplers.heads import *  # noqa: F403
from samplers.testing import CrossCheckReport, cross_check

# The two layers' names, and the cross-check and deprecated functions of the package.
__all__ = [
    "CrossCheckReport",
    "cross_check",
    "kl_divergence",
    "log_prob_from_action",
    "mode",
    "mode_pre_image",
]
__all__ += distributions.__all__
__all__ += heads.__all__
