"""Runnable examples that use only the public ``samplers`` API.

Install them with ``pip install 'samplers[examples]'``; each is a module run as
``python -m samplers.examples.<name>``:

- ``pendulum``: PPO on gymnax's ``Pendulum-v1`` with a ``SquashedNormalSampler``
  onto ``BoundedTanh(-2, 2)`` that stores the pre-squash action in the rollout and
  replays it in the loss; ``--bijector tanh`` uses ``NormalTanhSampler`` and
  ``--head beta`` a ``BetaSampler`` on ``[-2, 2]``, which stores its logit.
- ``pendulum_sac``: SAC on the same task, with the ``SquashedNormalSampler`` built
  with ``reparameterized=True`` so that the actor loss differentiates through the
  sampled action.
- ``cartpole``: PPO on gymnax's ``CartPole-v1`` with a ``CategoricalSampler``, which
  stores the sampled action and replays it in the loss.
- ``tictactoe``: PPO on pgx's tic-tac-toe against a random player, with a
  ``CategoricalSampler`` and the legal moves as its mask (``--no-mask`` to train
  without it, ``--compare`` to train both).
- ``hybrid``: PPO on a ``Dict(direction=Discrete(3), distance=Box(0, 1, (1,)))``
  action with the head ``head_for`` builds for it, a ``CompositeSampler`` of a
  ``CategoricalSampler`` and a ``SquashedNormalSampler``.
- ``correlated``: PPO on two games whose second bit must depend on the first, with an
  ``AutoregressiveSampler`` or a ``CompositeSampler`` of two independent bits.
- ``units``: PPO on a game whose legal moves depend on the chosen unit, with an
  ``AutoregressiveSampler`` masked by a ``MaskTable`` of the chosen unit, a
  ``CompositeSampler`` of independent parts, or one ``CategoricalSampler`` over the
  pairs.
- ``two_peaks``: SAC on a one-step bandit with two good actions, whose best
  maximum-entropy policy takes both: a ``FlowSampler`` with spline layers against a
  ``NormalTanhSampler``.
- ``grpo``: GRPO on a tiny transformer that learns to reverse digits, each token
  drawn from a ``TokenCategorical`` with top-p and replayed on its stored support.
- ``linen_actor``: a ``flax.linen`` MLP that returns a ``samplers.SquashedNormal``,
  trained with SAC's actor loss under ``jax.jit``; it uses no head.

Every head derives from ``ActionSampler``. ``StateIndependentSampler``,
``MultiDiscreteSampler``, ``MultiBinarySampler``, ``ParameterizedSampler``,
``TokenSampler`` and ``DistributionSampler`` have no example program; the guides show
them.
"""
