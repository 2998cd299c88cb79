"""A ``flax.linen`` actor that returns a ``samplers`` distribution, trained with SAC's loss.

Run ``python -m samplers.examples.linen_actor`` (``--help`` lists the flags). An MLP
written with ``flax.linen`` maps observations to ``[mean | log_std]`` and returns a
:class:`samplers.SquashedNormal` with ``std = exp(clip(log_std, -20, 2))``, the
parameterisation of SB3's and sbx's SAC actors. The actor loss is SAC's,
``alpha * log_prob(a) - Q(s, a)`` for a fresh ``a`` drawn with
``sample_with_pre_image``: the action and its log-density come from one pre-image,
with no inverse of ``tanh``, and the gradient flows through ``x = mean + std * eps``
(the pathwise gradient). A few hundred Adam steps against a fixed, made-up critic
``Q(s, a) = -|a - tanh(s W)|**2`` pull the policy's median action onto the critic's
best action; the program prints the loss and that distance before and after.
"""

import argparse
import functools
from collections.abc import Callable, Sequence
from typing import cast

import jax
import jax.numpy as jnp
import optax
from flax import linen

import samplers

_DESCRIPTION = "Trains a flax.linen SAC actor that returns a samplers.SquashedNormal."


class LinenActor(linen.Module):
    """Observations in, a tanh-squashed Normal over actions out.

    Attributes:
        action_dim: Number of action dimensions.
        hidden_dims: Widths of the ReLU hidden layers.
        log_std_min: Lower clip of the log-std (SB3's and sbx's ``-20``).
        log_std_max: Upper clip of the log-std (``2``).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> actor = LinenActor(action_dim=2)
        >>> observations = jnp.zeros((5, 4))
        >>> params = actor.init(jax.random.key(0), observations)
        >>> dist = actor.apply(params, observations)
        >>> dist.batch_shape, dist.event_shape
        ((5,), (2,))
    """

    action_dim: int
    hidden_dims: Sequence[int] = (64, 64)
    log_std_min: float = -20.0
    log_std_max: float = 2.0

    def setup(self):
        self.hidden = [linen.Dense(width) for width in self.hidden_dims]
        self.head = linen.Dense(2 * self.action_dim)

    def distribution_parameters(self, observation: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The network's output split into ``mean`` and the unclipped ``log_std``."""
        h = observation
        for layer in self.hidden:
            h = linen.relu(layer(h))
        mean, log_std = jnp.split(self.head(h), 2, axis=-1)
        return mean, log_std

    def __call__(self, observation: jax.Array) -> samplers.SquashedNormal:
        mean, log_std = self.distribution_parameters(observation)
        return samplers.squashed_normal_from_log_std(
            mean, log_std, log_std_min=self.log_std_min, log_std_max=self.log_std_max
        )


def sac_actor_loss(
    params,
    actor: LinenActor,
    critic: Callable[[jax.Array, jax.Array], jax.Array],
    observations: jax.Array,
    key: jax.Array,
    alpha: float = 0.2,
) -> jax.Array:
    """SAC's actor loss, ``mean(alpha * log_prob(a) - Q(s, a))`` for ``a`` drawn afresh.

    ``sample_with_pre_image`` returns the action ``tanh(x)`` and its log-density
    computed from ``x = mean + std * eps`` itself, so the log-density is finite even
    where ``tanh(x)`` rounds to ``+-1``, and gradients reach the actor's parameters
    through both terms.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> actor = LinenActor(action_dim=2)
        >>> observations = jnp.zeros((5, 4))
        >>> params = actor.init(jax.random.key(0), observations)
        >>> critic = lambda s, a: -jnp.sum(jnp.square(a), axis=-1)
        >>> loss_and_grad = jax.jit(
        ...     jax.value_and_grad(sac_actor_loss), static_argnames=("actor", "critic")
        ... )
        >>> loss, grads = loss_and_grad(params, actor, critic, observations, jax.random.key(1))
        >>> bool(jnp.isfinite(loss))
        True
    """
    # Linen types apply's result loosely (the output, or it and the mutated state).
    dist = cast(samplers.SquashedNormal, actor.apply(params, observations))
    action, _, log_prob = dist.sample_with_pre_image(seed=key)
    return jnp.mean(alpha * log_prob - critic(observations, action))


def _made_up_critic(weights: jax.Array) -> Callable[[jax.Array, jax.Array], jax.Array]:
    def critic(observation, action):
        best_action = jnp.tanh(observation @ weights)
        return -jnp.sum(jnp.square(action - best_action), axis=-1)

    return critic


def main(argv: Sequence[str] | None = None) -> dict:
    """Trains the actor against the made-up critic; returns and prints a summary."""
    parser = argparse.ArgumentParser(description=_DESCRIPTION)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--alpha", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    obs_dim, action_dim = 4, 2
    init_key, weight_key, obs_key, train_key = jax.random.split(jax.random.key(args.seed), 4)
    weights = jax.random.normal(weight_key, (obs_dim, action_dim))
    critic = _made_up_critic(weights)
    actor = LinenActor(action_dim)
    observations = jax.random.normal(obs_key, (args.batch, obs_dim))
    params = actor.init(init_key, observations)
    optimizer = optax.adam(3e-3)
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state, key):
        loss_fn = functools.partial(sac_actor_loss, actor=actor, critic=critic, alpha=args.alpha)
        loss, grads = jax.value_and_grad(loss_fn)(params, observations=observations, key=key)
        updates, opt_state = optimizer.update(grads, opt_state)
        return optax.apply_updates(params, updates), opt_state, loss

    def distance_to_best(params):
        dist = cast(samplers.SquashedNormal, actor.apply(params, observations))
        median = dist.deterministic_action()
        return float(jnp.mean(jnp.abs(median - jnp.tanh(observations @ weights))))

    summary = {"initial_distance": distance_to_best(params)}
    losses = []
    for key in jax.random.split(train_key, args.steps):
        params, opt_state, loss = step(params, opt_state, key)
        losses.append(float(loss))
    summary.update(
        initial_loss=losses[0], final_loss=losses[-1], final_distance=distance_to_best(params)
    )
    print(
        f"actor loss {summary['initial_loss']:.3f} -> {summary['final_loss']:.3f}; "
        f"mean |median action - best action| "
        f"{summary['initial_distance']:.3f} -> {summary['final_distance']:.3f}"
    )
    return summary


if __name__ == "__main__":
    main()
