"""SAC on a bandit with two good actions: a flow head against the squashed Normal.

Run ``python -m samplers.examples.two_peaks`` (``--help`` lists the flags). Each
round draws a state ``s ~ U(-1, 1)``; the reward of an action ``a`` in ``[-1, 1]`` is
two bumps of height 1 and width 0.05 at ``a = 0.3 s +- 0.25``, with a valley of
reward ~0 between them. SAC with a fixed temperature ``alpha = 0.2`` maximises
``E[r] + alpha H(pi(. | s))``, whose best policy, ``pi*(a | s) ~ exp(r(s, a) /
alpha)``, puts most of its mass on both bumps: its value is ``J*(s) = alpha log int
exp(r(s, a) / alpha) da``. A squashed Normal has one mode near the bumps, so it sits on
one of them (half the entropy) or spreads across the valley (less reward); a
``FlowSampler`` with spline layers conditioned on ``s`` can take both. This is
Haarnoja et al.'s multi-goal argument for maximum-entropy policies (2017), reduced to
one step, so that the optimum is known exactly.

The SAC parts, with one step per episode (no bootstrap): a critic ``Q(s, a)`` regressed
on the rewards of the actor's samples, and the actor loss ``alpha log pi(a | s) -
Q(s, a)`` for a fresh reparameterised sample. The summary reports, over 256 new states
with 1024 samples each, the mean reward, the soft value ``E[r - alpha log pi]`` against
``J*``, and ``both_peaks``: per state the smaller of the two fractions of samples
within 0.1 of a bump (0 for a policy that takes one bump only), averaged.
"""

import argparse
import itertools
import json
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import samplers

WIDTH, SEPARATION, ALPHA = 0.05, 0.25, 0.2


def reward(s: jax.Array, a: jax.Array) -> jax.Array:
    """Two bumps of height 1 at ``0.3 s +- 0.25``; ``s`` and ``a`` are ``[*batch]``."""
    centre = 0.3 * s
    bumps = [
        jnp.exp(-0.5 * jnp.square((a - centre - side) / WIDTH))
        for side in (-SEPARATION, SEPARATION)
    ]
    return bumps[0] + bumps[1]


def optimal_value(s: jax.Array, points: int = 20001) -> jax.Array:
    """``J*(s) = alpha log int_{-1}^{1} exp(r(s, a) / alpha) da``, by the trapezoid rule."""
    a = jnp.linspace(-1.0, 1.0, points)
    r = reward(s[:, None], jnp.broadcast_to(a, (s.shape[0], points)))
    top = jnp.max(r, axis=-1, keepdims=True)
    integral = jnp.trapezoid(jnp.exp((r - top) / ALPHA), dx=2.0 / (points - 1), axis=-1)
    return ALPHA * jnp.log(integral) + top[:, 0]


def _mlp(sizes: Sequence[int], rngs: nnx.Rngs) -> nnx.Sequential:
    layers: list = []
    for size_in, size_out in itertools.pairwise(sizes):
        layers += [nnx.Linear(size_in, size_out, rngs=rngs), nnx.relu]
    return nnx.Sequential(*layers[:-1])


class Actor(nnx.Module):
    """An MLP for ``[mean | raw_std]`` from the state, and the head; the flow head also
    sees the state as its feature.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> actor = Actor("flow", nnx.Rngs(0))
        >>> actor(jnp.zeros(5)).output["action"].shape
        (5, 1)
    """

    def __init__(self, head: str, rngs: nnx.Rngs, hidden: int = 64):
        self.torso = _mlp([1, hidden, hidden, 2], rngs)
        self.flow = head == "flow"
        if self.flow:
            self.head = samplers.FlowSampler(
                rngs, 0.0, action_dim=1, feature_dim=1, transform="spline", reparameterized=True
            )
        else:
            self.head = samplers.NormalTanhSampler(rngs, 0.0, reparameterized=True)

    def __call__(self, s: jax.Array) -> samplers.StatefulModuleOutput:
        """The head's output for states ``s`` of shape ``[batch]``."""
        params = self.torso(s[:, None])
        if self.flow:
            params = jnp.concatenate([params, s[:, None]], axis=-1)
        return self.head((), params)


def train(head: str, seed: int, steps: int = 3000, batch: int = 256) -> tuple[Actor, float]:
    """Trains SAC with ``head`` (``"normal"`` or ``"flow"``): the actor and the seconds taken."""
    rngs = nnx.Rngs(seed)
    actor, critic = Actor(head, rngs), _mlp([2, 64, 64, 1], rngs)
    actor_opt = nnx.Optimizer(actor, optax.adam(1e-3), wrt=nnx.Param)
    critic_opt = nnx.Optimizer(critic, optax.adam(1e-3), wrt=nnx.Param)

    @nnx.jit
    def update(actor, critic, actor_opt, critic_opt, key):
        s = jax.random.uniform(key, (batch,), minval=-1.0, maxval=1.0)

        def actor_loss(actor):
            out = actor(s).output
            a = out["action"][:, 0]
            q = critic(jnp.stack([s, a], -1))[:, 0]
            return jnp.mean(ALPHA * out["log_likelihood"] - q), a

        (_, a), grads = nnx.value_and_grad(actor_loss, has_aux=True)(actor)
        a = jax.lax.stop_gradient(a)

        def critic_loss(critic):
            return jnp.mean(jnp.square(critic(jnp.stack([s, a], -1))[:, 0] - reward(s, a)))

        critic_opt.update(critic, nnx.grad(critic_loss)(critic))
        actor_opt.update(actor, grads)

    key = jax.random.key(seed + 1000)
    start = time.perf_counter()
    for step_key in jax.random.split(key, steps):
        update(actor, critic, actor_opt, critic_opt, step_key)
    jax.block_until_ready(nnx.state(actor))
    return actor, time.perf_counter() - start


def evaluate(actor: Actor, seed: int, states: int = 256, samples: int = 1024) -> dict:
    """Mean reward, soft value against ``J*``, and the mass on the less-taken bump."""
    s = jax.random.uniform(jax.random.key(seed + 2000), (states,), minval=-1.0, maxval=1.0)
    repeated = jnp.repeat(s, samples)
    out = actor(repeated).output
    a = out["action"][:, 0].reshape(states, samples)
    r = reward(repeated, out["action"][:, 0]).reshape(states, samples)
    soft = r - ALPHA * out["log_likelihood"].reshape(states, samples)
    centre = 0.3 * s[:, None]
    near = [
        jnp.mean(jnp.abs(a - centre - side) < 0.1, axis=-1) for side in (-SEPARATION, SEPARATION)
    ]
    return {
        "reward": float(jnp.mean(r)),
        "soft_value": float(jnp.mean(soft)),
        "optimal_soft_value": float(jnp.mean(optimal_value(s))),
        "both_peaks": float(jnp.mean(jnp.minimum(*near))),
    }


def main(argv: Sequence[str] | None = None) -> list[dict]:
    """Trains each head for each seed and prints one JSON line per run."""
    parser = argparse.ArgumentParser(
        prog="python -m samplers.examples.two_peaks",
        description="SAC on a bandit with two good actions.",
    )
    parser.add_argument("--heads", default="normal,flow", help="comma-separated: normal, flow")
    parser.add_argument("--seed", type=int, default=0, help="the first seed")
    parser.add_argument("--seeds", type=int, default=5, help="how many seeds per head")
    parser.add_argument("--steps", type=int, default=3000, help="SAC updates per run")
    args = parser.parse_args(argv)
    heads = args.heads.split(",")
    if not set(heads) <= {"normal", "flow"}:
        parser.error(f"--heads takes normal and flow, got {args.heads!r}")
    results = []
    for seed in range(args.seed, args.seed + args.seeds):
        for head in heads:
            actor, train_s = train(head, seed, args.steps)
            results.append(
                {"head": head, "seed": seed, "train_s": train_s, **evaluate(actor, seed)}
            )
            print(json.dumps(results[-1]), flush=True)
    return results


if __name__ == "__main__":
    main()
