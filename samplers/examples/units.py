"""PPO on a game whose legal moves depend on the chosen unit: an autoregressive head
with a mask of the chosen unit, against independent heads and one flat categorical.

Run ``python -m samplers.examples.units`` (``--help`` lists the flags). Three units
and a coin stand on a 4 x 4 board. Each step the agent picks a unit, then a move
(up, down, left, right); a move is legal when it stays on the board and does not
enter another unit's cell. A unit that reaches the coin collects it (+1) and a new
coin appears on a free cell; an episode is 32 steps (a time limit, not a terminal
state). The observation is the units' and the coin's cells, one-hot.

- ``--head autoregressive`` (the default): a :class:`samplers.AutoregressiveSampler`;
  the unit is masked to the units that can move, the move by a
  :class:`samplers.MaskTable` of the legal moves of each unit, indexed by the chosen
  one. No illegal pair can be drawn.
- ``--head flat``: one :class:`samplers.CategoricalSampler` over the 12 (unit, move)
  pairs, masked by the same table flattened. No illegal pair either.
- ``--head independent``: a :class:`samplers.CompositeSampler` of a unit and a move
  drawn independently; the move's mask can only be the moves legal for *some* unit,
  so an illegal pair can be drawn. The unit then stays where it is, and the pair is
  counted.

The reference is :func:`greedy_return`, a hand-written policy (the unit nearest the
coin steps towards it). The program prints the trained (sampling) policy's mean
return over ``--eval-episodes`` episodes, the environment steps after which an
iteration's episodes first averaged 75% of the reference, the illegal pairs drawn
in training, and writes ``summary.json`` to ``--out``.
"""

import dataclasses
import json
import time
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

import samplers
from samplers.examples import _common, _ppo

SIZE = 4  # the board is SIZE x SIZE
UNITS = 3
MOVES = jnp.array([[-1, 0], [1, 0], [0, -1], [0, 1]])  # up, down, left, right
LENGTH = 32  # steps per episode
HEADS = ("autoregressive", "flat", "independent")


class Board(NamedTuple):
    """One environment: the units' cells, the coin's cell and the step in the episode."""

    units: jax.Array
    coin: jax.Array
    time: jax.Array


def legal_moves(units: jax.Array) -> jax.Array:
    """``[UNITS, 4]``: which move of which unit stays on the board and enters no unit's cell.

    Example:
        >>> legal_moves(jnp.array([0, 1, 4])).astype(int).tolist()  # (0,0), (0,1), (1,0)
        [[0, 0, 0, 0], [0, 1, 0, 1], [0, 1, 0, 1]]
    """
    row, col = units // SIZE, units % SIZE
    to_row, to_col = row[:, None] + MOVES[None, :, 0], col[:, None] + MOVES[None, :, 1]
    on_board = (to_row >= 0) & (to_row < SIZE) & (to_col >= 0) & (to_col < SIZE)
    target = to_row * SIZE + to_col
    occupied = jnp.any(target[:, :, None] == units[None, None, :], axis=-1)
    return on_board & ~occupied


def _free_cell(key: jax.Array, units: jax.Array) -> jax.Array:
    occupied = jnp.any(jnp.arange(SIZE * SIZE)[:, None] == units[None, :], axis=-1)
    return jax.random.categorical(key, jnp.where(occupied, -jnp.inf, 0.0))


def observe(board: Board) -> jax.Array:
    """The units' cells and the coin's, one-hot: ``[(UNITS + 1) * SIZE**2]``."""
    cells = jnp.concatenate([board.units, board.coin[None]])
    return jax.nn.one_hot(cells, SIZE * SIZE).reshape(-1)


def make_env(head: str) -> _ppo.Env:
    """The game as the PPO trainer runs it, with ``head``'s action and mask."""

    def reset(key):
        cells = jax.random.choice(key, SIZE * SIZE, (UNITS + 1,), replace=False)
        board = Board(cells[:UNITS], cells[UNITS], jnp.zeros((), jnp.int32))
        return observe(board), board

    def step(key, board: Board, action) -> _ppo.Step:
        unit, move = pair(head, action)
        legal = legal_moves(board.units)[unit, move]
        cell = board.units[unit] + MOVES[move, 0] * SIZE + MOVES[move, 1]
        units = board.units.at[unit].set(jnp.where(legal, cell, board.units[unit]))
        collected = legal & (cell == board.coin)
        coin = jnp.where(collected, _free_cell(jax.random.fold_in(key, 1), units), board.coin)
        board = Board(units, coin, board.time + 1)
        done = board.time >= LENGTH
        fresh_obs, fresh = reset(key)
        next_board = jax.tree.map(lambda f, b: jnp.where(done, f, b), fresh, board)
        obs = observe(board)
        return _ppo.Step(
            next_board,
            jnp.where(done, fresh_obs, obs),
            collected.astype(jnp.float32),
            done,
            jnp.zeros((), bool),
            obs,
            {"illegal": ~legal},
        )

    return _ppo.Env(reset, step, lambda board: mask_for(head, legal_moves(board.units)))


def pair(head: str, action) -> tuple[jax.Array, jax.Array]:
    """``(unit, move)`` of ``head``'s action."""
    if head == "flat":
        return action // 4, action % 4
    return action["unit"], action["move"]


def mask_for(head: str, legal: jax.Array):
    """``head``'s mask from the legal moves ``[*batch, UNITS, 4]``."""
    can_move = jnp.any(legal, axis=-1)
    if head == "autoregressive":
        return {"unit": can_move, "move": samplers.MaskTable(legal, given="unit")}
    if head == "flat":
        return legal.reshape(*legal.shape[:-2], UNITS * 4)
    return {"unit": can_move, "move": jnp.any(legal, axis=-2)}


def make_head(head: str, entropy_weight: float, rngs: nnx.Rngs, features: int):
    """The autoregressive head, the flat categorical or the independent composite."""
    if head == "flat":
        return samplers.CategoricalSampler(rngs, entropy_weight, UNITS * 4)
    parts = {
        "unit": samplers.CategoricalSampler(rngs, entropy_weight, UNITS),
        "move": samplers.CategoricalSampler(rngs, entropy_weight, 4),
    }
    if head == "independent":
        return samplers.CompositeSampler(parts, rngs=rngs)
    return samplers.AutoregressiveSampler(
        parts, features=features, entropy_weight=entropy_weight, rngs=rngs, hidden=64
    )


def greedy_return(episodes: int = 1024, seed: int = 0) -> float:
    """The mean return of the reference policy: the unit nearest the coin (Manhattan
    distance, lowest index first) takes its first legal move that brings it closer;
    where none does, the first legal pair.

    Example:
        >>> round(greedy_return(256))
        21
    """
    env = make_env("flat")

    def act(board: Board) -> jax.Array:
        legal = legal_moves(board.units)
        row, col = board.units // SIZE, board.units % SIZE
        coin_row, coin_col = board.coin // SIZE, board.coin % SIZE
        distance = jnp.abs(row - coin_row) + jnp.abs(col - coin_col)
        after = jnp.abs(row[:, None] + MOVES[None, :, 0] - coin_row)
        after = after + jnp.abs(col[:, None] + MOVES[None, :, 1] - coin_col)
        closer = legal & (after < distance[:, None])
        score = jnp.where(closer, distance[:, None], SIZE * SIZE)
        score = jnp.where(legal, score, 2 * SIZE * SIZE).reshape(-1)
        return jnp.argmin(score)

    @jax.jit
    def play(key):
        reset_key, run_key = jax.random.split(key)
        _, board = jax.vmap(env.reset)(jax.random.split(reset_key, episodes))

        def one(board, key):
            action = jax.vmap(act)(board)
            step = jax.vmap(env.step)(jax.random.split(key, episodes), board, action)
            return step.state, step.reward

        _, rewards = jax.lax.scan(one, board, jax.random.split(run_key, LENGTH))
        return rewards.sum(0).mean()

    return float(play(jax.random.key(seed)))


@dataclasses.dataclass(frozen=True)
class Config(_ppo.Config):
    """``_ppo.Config`` with this game's defaults, and the head."""

    total_steps: int = 1_000_000
    eval_episodes: int = 256
    gamma: float = 0.9
    head: str = "autoregressive"


def train(config: Config, *, progress: bool = True) -> tuple[_ppo.ActorCritic, dict]:
    """Trains the actor-critic with ``_ppo.train``; returns ``(model, log)``."""

    def make_model(sampling_rngs: nnx.Rngs, rngs: nnx.Rngs) -> _ppo.ActorCritic:
        head = make_head(config.head, config.entropy_weight, sampling_rngs, features=32)
        return _ppo.ActorCritic((UNITS + 1) * SIZE**2, head, hidden=config.hidden, rngs=rngs)

    return _ppo.train(
        config,
        make_model,
        make_env(config.head),
        column=("return", lambda m: f"{m['return_sum'] / max(m['episodes'], 1):.1f}"),
        label=f"PPO {config.head}",
        progress=progress,
    )


def evaluate(model: _ppo.ActorCritic, config: Config) -> tuple[float, float]:
    """The trained, sampling policy's mean return and fraction of illegal pairs."""
    key = jax.random.key(config.seed + 1)
    rewards, counts = _ppo.play(model, make_env(config.head), config.eval_episodes, LENGTH, key)
    return float(rewards.sum(0).mean()), float(counts["illegal"].mean())


def main(argv: Sequence[str] | None = None) -> dict:
    """Trains, evaluates, prints a summary and writes ``summary.json``."""
    config, args = _common.command_line(
        argv,
        Config(),
        prog="python -m samplers.examples.units",
        description="PPO on a game whose legal moves depend on the chosen unit: an "
        "AutoregressiveSampler against independent heads and one flat categorical.",
        flags={"--head": {"choices": HEADS, "default": "autoregressive", "help": "the head"}},
        out="units-results",
        figure="(no figure)",
    )
    start = time.perf_counter()
    model, log = train(config, progress=not args.no_progress)
    episode_return, illegal = evaluate(model, config)
    reference = greedy_return()
    summary = {
        "config": dataclasses.asdict(config),
        "return": episode_return,
        "greedy_return": reference,
        "steps_to_75_percent": _ppo.steps_to(log, 0.75 * reference),
        "illegal_in_training": sum(log["per_iteration"]["illegal"]) / log["steps"],
        "illegal_in_evaluation": illegal,
        "wall_s": time.perf_counter() - start,
        "train_s": log["train_s"],
        "compile_s": log["compile_s"],
        "replay_ratio_error": log["replay_ratio_error"],
        "curve_steps": log["curve_steps"],
        "curve_returns": log["curve_returns"],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(
        f"{config.head} head, seed {config.seed}: return {episode_return:.2f} (greedy "
        f"{reference:.2f}); 75% of greedy after {summary['steps_to_75_percent']} steps; "
        f"illegal pairs {summary['illegal_in_training']:.2%} of training steps; "
        f"wall {summary['wall_s']:.0f} s"
    )
    return summary


if __name__ == "__main__":
    main()
