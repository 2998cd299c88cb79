"""PPO on two games whose second sub-action must depend on the first: autoregressive
against independent heads.

Run ``python -m samplers.examples.correlated`` (``--help`` lists the flags). Each step
the agent picks two bits, ``first`` and ``second``; ``--head autoregressive`` uses a
:class:`samplers.AutoregressiveSampler` (``second`` conditioned on ``first``),
``--head independent`` a :class:`samplers.CompositeSampler` of two
:class:`samplers.CategoricalSampler` parts.

- ``--game guess`` (the default): the observation is constant. An opponent guesses
  ``first`` as the majority of the agent's last ``K = 5`` first bits (across
  episodes; random before the first); the agent gets
  +1 when the guess is wrong and +1 when ``second == first``. The best policy draws
  ``first`` 50/50 and copies it into ``second``: 1.5 a step. Independent heads cannot
  copy a random bit; their best is :func:`independent_ceiling` (1.071 for ``K = 5``),
  and the learned policies are measured against it.
- ``--game correlated``: RLlib's ``CorrelatedActionsEnv``, ported. The observation is
  a random bit; +5 when ``first`` equals it, +5 when ``second == first``; 20 steps,
  best 200. A deterministic policy reaches 200 with independent heads too (the
  second bit can copy the observation), so it is a sanity check, not a separation.

It prints the mean reward per step of the trained (sampling) policy over
``--eval-episodes`` episodes and the steps to reach 95% of the best, and writes
``summary.json`` to ``--out``.
"""

import dataclasses
import json
import math
import time
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

import samplers
from samplers.examples import _common, _ppo

K = 5  # the opponent's memory in the guessing game
GUESS_LENGTH = 32
CORRELATED_LENGTH = 20
BEST = {"guess": 1.5 * GUESS_LENGTH, "correlated": 10.0 * CORRELATED_LENGTH}


class Game(NamedTuple):
    """One environment: the last ``K`` first bits (guess), the observed bit
    (correlated), and the step within the episode."""

    history: jax.Array
    bit: jax.Array
    time: jax.Array


def independent_value(p: float, k: int = K) -> float:
    """The expected reward a step of the guessing game when ``first ~ Bernoulli(p)``
    and ``second`` is the likelier bit, independently of ``first``.

    The opponent's majority guess of ``k`` past bits is wrong with probability
    ``p (1 - M) + (1 - p) M``, ``M`` the probability that most of ``k`` draws are 1;
    ``second`` agrees with ``first`` ``max(p, 1 - p)`` of the time, the most an
    independent bit can.
    """
    majority = sum(math.comb(k, j) * p**j * (1 - p) ** (k - j) for j in range(k // 2 + 1, k + 1))
    return p * (1 - majority) + (1 - p) * majority + max(p, 1 - p)


def independent_ceiling(k: int = K) -> float:
    """The best :func:`independent_value` over ``p`` on a grid of 10^4 points.

    Example:
        >>> round(independent_ceiling(1), 4), round(independent_ceiling(5), 4)
        (1.125, 1.0706)
    """
    return max(independent_value(i / 10_000, k) for i in range(10_001))


def make_env(game: str) -> _ppo.Env:
    """The game as the PPO trainer runs it; an episode's end is terminal."""
    length = GUESS_LENGTH if game == "guess" else CORRELATED_LENGTH

    def reset(key):
        history_key, bit_key = jax.random.split(key)
        state = Game(
            jax.random.bernoulli(history_key, 0.5, (K,)).astype(jnp.int32),
            jax.random.bernoulli(bit_key).astype(jnp.int32),
            jnp.zeros((), jnp.int32),
        )
        return observe(state, game), state

    def step(key, state: Game, action: dict) -> _ppo.Step:
        first, second = jnp.asarray(action["first"]), jnp.asarray(action["second"])
        agree = (second == first).astype(jnp.float32)
        if game == "guess":
            guess = (2 * jnp.sum(state.history) > K).astype(jnp.int32)
            reward = (first != guess).astype(jnp.float32) + agree
        else:
            reward = 5.0 * (first == state.bit) + 5.0 * agree
        history = jnp.concatenate([state.history[1:], first[None]])
        bit = jax.random.bernoulli(jax.random.fold_in(key, 1)).astype(jnp.int32)
        state = Game(history, bit, state.time + 1)
        done = state.time >= length
        fresh_obs, fresh = reset(key)
        fresh = fresh._replace(history=history)  # the opponent remembers across episodes
        next_state = jax.tree.map(lambda f, s: jnp.where(done, f, s), fresh, state)
        obs = observe(state, game)
        return _ppo.Step(next_state, jnp.where(done, fresh_obs, obs), reward, done, done, obs, {})

    return _ppo.Env(reset, step)


def observe(state: Game, game: str) -> jax.Array:
    """``[1, 0]`` in the guessing game (nothing to see); ``[1, bit]`` in the other."""
    bit = state.bit if game == "correlated" else jnp.zeros((), jnp.int32)
    return jnp.stack([jnp.ones(()), bit.astype(jnp.float32)])


def make_head(kind: str, entropy_weight: float, rngs: nnx.Rngs, features: int):
    """The autoregressive head, or the composite of two independent bits."""
    bits = {n: samplers.CategoricalSampler(rngs, entropy_weight, 2) for n in ("first", "second")}
    if kind == "independent":
        return samplers.CompositeSampler(bits, rngs=rngs)
    return samplers.AutoregressiveSampler(
        bits, features=features, entropy_weight=entropy_weight, rngs=rngs, hidden=32
    )


@dataclasses.dataclass(frozen=True)
class Config(_ppo.Config):
    """``_ppo.Config`` with these games' defaults, the game and the head."""

    total_steps: int = 100_000
    eval_episodes: int = 256
    gamma: float = 0.5
    entropy_weight: float = 0.003
    game: str = "guess"
    head: str = "autoregressive"


def train(config: Config, *, progress: bool = True) -> tuple[_ppo.ActorCritic, dict]:
    """Trains the actor-critic with ``_ppo.train``; returns ``(model, log)``."""

    def make_model(sampling_rngs: nnx.Rngs, rngs: nnx.Rngs) -> _ppo.ActorCritic:
        head = make_head(config.head, config.entropy_weight, sampling_rngs, features=16)
        return _ppo.ActorCritic(2, head, hidden=config.hidden, rngs=rngs)

    return _ppo.train(
        config,
        make_model,
        make_env(config.game),
        column=("return", lambda m: f"{m['return_sum'] / max(m['episodes'], 1):.1f}"),
        label=f"PPO {config.head}",
        progress=progress,
    )


def evaluate(model: _ppo.ActorCritic, config: Config) -> float:
    """The mean reward per step of the trained, sampling policy."""
    length = GUESS_LENGTH if config.game == "guess" else CORRELATED_LENGTH
    key = jax.random.key(config.seed + 1)
    rewards, _ = _ppo.play(model, make_env(config.game), config.eval_episodes, length, key)
    return float(rewards.mean())


def main(argv: Sequence[str] | None = None) -> dict:
    """Trains, evaluates, prints a summary and writes ``summary.json``."""
    config, args = _common.command_line(
        argv,
        Config(),
        prog="python -m samplers.examples.correlated",
        description="PPO on games whose second bit must depend on the first: "
        "an AutoregressiveSampler against independent heads.",
        flags={
            "--game": {"choices": ["guess", "correlated"], "default": "guess", "help": "the game"},
            "--head": {
                "choices": ["autoregressive", "independent"],
                "default": "autoregressive",
                "help": "the head",
            },
        },
        out="correlated-results",
        figure="(no figure)",
    )
    start = time.perf_counter()
    model, log = train(config, progress=not args.no_progress)
    per_step = evaluate(model, config)
    length = GUESS_LENGTH if config.game == "guess" else CORRELATED_LENGTH
    summary = {
        "config": dataclasses.asdict(config),
        "reward_per_step": per_step,
        "best_per_step": BEST[config.game] / length,
        "independent_ceiling": independent_ceiling() if config.game == "guess" else None,
        "steps_to_95_percent": _ppo.steps_to(log, 0.95 * BEST[config.game]),
        "wall_s": time.perf_counter() - start,
        "train_s": log["train_s"],
        "compile_s": log["compile_s"],
        "curve_steps": log["curve_steps"],
        "curve_returns": log["curve_returns"],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(
        f"{config.game}, {config.head} head, seed {config.seed}: "
        f"{per_step:.3f} reward per step (best {summary['best_per_step']:.3f}"
        + (
            f", independent ceiling {summary['independent_ceiling']:.3f}"
            if config.game == "guess"
            else ""
        )
        + f"); 95% of the best after {summary['steps_to_95_percent']} steps; "
        f"wall {summary['wall_s']:.0f} s"
    )
    return summary


if __name__ == "__main__":
    main()
