"""Runnable examples that use only the public ``samplers`` API.

Install them with ``pip install 'samplers[examples]'``; each is a module run as
``python -m samplers.examples.<name>``:

- ``pendulum``: PPO on gymnax's ``Pendulum-v1`` with a squashed-Normal policy head
  that stores the pre-squash action in the rollout and replays it in the loss.
- ``pendulum_sac``: SAC on the same task, with the head in reparameterised mode so
  that the actor loss differentiates through the sampled action.
- ``cartpole``: PPO on gymnax's ``CartPole-v1`` with the Categorical head, which
  stores the sampled action and replays it in the loss.
- ``tictactoe``: PPO on pgx's tic-tac-toe against a random player, with the legal
  moves as the head's mask (``--no-mask`` to train without it).
- ``linen_actor``: a ``flax.linen`` MLP that returns a ``samplers.SquashedNormal``,
  trained with SAC's actor loss under ``jax.jit``.
"""
