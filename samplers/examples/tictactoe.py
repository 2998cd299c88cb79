"""PPO on pgx's ``tic_tac_toe`` with :class:`samplers.CategoricalSampler` and legal-move masks.

Run ``python -m samplers.examples.tictactoe`` (``--help`` lists the flags). The
agent plays pgx player 0 against a fixed opponent that picks uniformly among the
legal moves; who moves first is drawn for each game. The agent sees pgx's
observation for its player (its marks and the opponent's, ``3 x 3 x 2``) and the
game's ``legal_action_mask``. Its reward is pgx's at the end of the game: 1 for a
win, 0 for a draw, -1 for a loss. An environment step is one move of the agent
and the opponent's reply.

The policy head is a :class:`samplers.CategoricalSampler` over the 9 cells; the
examples' PPO trainer, ``_ppo.train``, trains it. The rollout calls the head with
``mask=state.legal_action_mask`` and stores that mask beside the action it took;
the PPO loss replays the stored action under the stored mask, so the ratio is
computed between the same masked distributions. With
``--no-mask`` the same agent is trained without the mask: it may pick an occupied
cell, and pgx then ends the game as a loss for it.

At the end it plays the greedy policy (the most probable allowed move), the
sampling policy and a uniformly random legal player against the opponent, from
the same first movers, prints a summary, and writes ``tictactoe.png`` (learning
curves, the probability the policy puts on illegal moves, the final outcomes)
and ``summary.json`` to ``--out``. ``--compare`` trains both agents, the masked
one first, with the same seed, and draws them in one figure.
"""

import argparse
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pgx
from flax import nnx

import samplers
from samplers.examples import _common, _ppo

AGENT = 0  # the agent's pgx player id; the opponent is player 1
NUM_CELLS = 9
# The agent moves at most 5 times in a game (9 cells, the first mover takes 5).
MAX_AGENT_MOVES = 5
ENV = pgx.make("tic_tac_toe")


@dataclasses.dataclass(frozen=True)
class Config(_ppo.Config):
    """Hyperparameters: ``_ppo.Config``'s with tic-tac-toe's defaults, and the mask's choice.

    The budget counts agent moves. The command-line flags override
    ``total_steps``, ``seed``, ``num_envs``, ``rollout_length``, ``mask`` and
    ``eval_episodes``.
    """

    total_steps: int = 500_000
    num_envs: int = 64
    rollout_length: int = 32
    eval_episodes: int = 10_000
    hidden: int = 128
    mask: bool = True


def opponent_move(key: jax.Array, legal: jax.Array) -> jax.Array:
    """A cell drawn uniformly among the legal ones.

    Args:
        key: A PRNG key.
        legal: Booleans ``[*batch, 9]``, True where a move is legal; each row
            allows at least one.

    Returns:
        Cell indices ``[*batch]``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> legal = jnp.array([False, False, True, False, False, False, False, True, False])
        >>> int(opponent_move(jax.random.key(0), legal)) in (2, 7)
        True
    """
    return jax.random.categorical(key, jnp.where(legal, 0.0, -jnp.inf)).astype(jnp.int32)


def _select(pred: jax.Array, on_true, on_false):
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def _reply(state, key: jax.Array):
    """The opponent's move if the game goes on and it is its turn, else ``state``."""
    its_turn = ~state.terminated & (state.current_player != AGENT)
    return _select(its_turn, ENV.step(state, opponent_move(key, state.legal_action_mask)), state)


def new_game(key: jax.Array):
    """A fresh game with the agent to move: pgx draws who moves first; the opponent may have.

    Args:
        key: A PRNG key; one game.

    Returns:
        The pgx state.
    """
    init_key, reply_key = jax.random.split(key)
    return _reply(ENV.init(init_key), reply_key)


def play(state, cell: jax.Array, key: jax.Array):
    """The agent takes ``cell`` and the opponent replies if the game goes on.

    Args:
        state: One game, the agent to move.
        cell: The agent's move, an index into the 9 cells.
        key: A PRNG key for the opponent.

    Returns:
        ``(state, reward, illegal)``: the game after the reply, the agent's reward
        (pgx gives it on the last move only, so it is the reward of whichever move
        came last) and whether ``cell`` was occupied (pgx then ends the game, a loss
        for the agent).
    """
    illegal = ~state.legal_action_mask[cell]
    state = _reply(ENV.step(state, cell), key)
    return state, state.rewards[AGENT], illegal


def observe(state) -> jax.Array:
    """pgx's observation, flattened to 18 floats per game.

    pgx observes for the player to move, the agent in every game it acts in:
    :func:`new_game` and :func:`play` hand the agent a game that is its turn, or over.
    """
    obs = state.observation
    return obs.reshape(*obs.shape[:-3], -1).astype(jnp.float32)


def env_step(key: jax.Array, state, cell: jax.Array) -> _ppo.Step:
    """The agent's move and the opponent's reply, then a fresh game if this one ended.

    The step counts ``illegal_moves``: whether ``cell`` was occupied. A game ends
    only by its rules, never by a time limit, so its end is terminal.
    """
    play_key, reset_key = jax.random.split(key)
    state, reward, illegal = play(state, cell, play_key)
    final_obs, done = observe(state), state.terminated
    state = _select(done, new_game(reset_key), state)
    return _ppo.Step(
        state, observe(state), reward, done, done, final_obs, {"illegal_moves": illegal}
    )


def make_env(mask: bool) -> _ppo.Env:
    """Tic-tac-toe against the random opponent, with the legal moves as the head's mask or not."""

    def reset(key: jax.Array):
        state = new_game(key)
        return observe(state), state

    return _ppo.Env(reset, env_step, (lambda state: state.legal_action_mask) if mask else None)


def _label(config: Config) -> str:
    return "mask" if config.mask else "no mask"


def train(config: Config, *, progress: bool = True) -> tuple[_ppo.ActorCritic, dict]:
    """Trains the actor-critic with ``_ppo.train`` for ``config.total_steps`` agent moves.

    Args:
        config: Hyperparameters.
        progress: Show a live progress bar.

    Returns:
        ``(model, log)``: ``_ppo.train``'s log, whose ``per_iteration`` has the
        head's mean ``masked_probability`` over the rollout's moves (0 without a
        mask) and the count of ``illegal_moves``; ``illegal_fraction``, the
        fraction of each iteration's moves that were illegal, and
        ``illegal_moves``, their count over all iterations.
    """

    def make_model(sampling_rngs: nnx.Rngs, rngs: nnx.Rngs) -> _ppo.ActorCritic:
        head = samplers.CategoricalSampler(sampling_rngs, config.entropy_weight, NUM_CELLS)
        return _ppo.ActorCritic(2 * NUM_CELLS, head, hidden=config.hidden, rngs=rngs)

    moves = config.num_envs * config.rollout_length
    if config.mask:
        column = ("illegal p", lambda metrics: f"{metrics['masked_probability']:.4f}")
    else:
        column = ("illegal p", lambda metrics: f"{metrics['illegal_moves'] / moves:.4f}")
    model, log = _ppo.train(
        config,
        make_model,
        make_env(config.mask),
        column=column,
        rollout_metrics=lambda model, obs, out: {
            "masked_probability": out.metrics["masked_probability"]
        },
        label=f"PPO, {_label(config)}",
        progress=progress,
    )
    illegal = log["per_iteration"]["illegal_moves"]
    log["illegal_fraction"] = [count / moves for count in illegal]
    log["illegal_moves"] = int(sum(illegal))
    return model, log


def _games(act: Callable, carry, key: jax.Array, num_games: int):
    """Plays ``num_games`` whole games of ``act(carry, obs, legal, key) -> (carry, cell)``.

    Returns each game's return, whether the agent lost it by an illegal move, and
    whether it is over.
    """
    reset_key, key = jax.random.split(key)
    games = jax.vmap(new_game)(jax.random.split(reset_key, num_games))

    def move(loop, move_key):
        carry, games, total, lost_illegal, running = loop
        act_key, play_key = jax.random.split(move_key)
        carry, cell = act(carry, observe(games), games.legal_action_mask, act_key)
        games, reward, illegal = jax.vmap(play)(games, cell, jax.random.split(play_key, num_games))
        total = total + jnp.where(running, reward, 0.0)
        lost_illegal = lost_illegal | (running & illegal)
        return (carry, games, total, lost_illegal, running & ~games.terminated), None

    zeros = jnp.zeros(num_games, bool)
    loop = (carry, games, jnp.zeros(num_games), zeros, ~zeros)
    (_, _, total, lost_illegal, running), _ = jax.lax.scan(
        move, loop, jax.random.split(key, MAX_AGENT_MOVES)
    )
    return total, lost_illegal, ~running


def _outcomes(total, lost_illegal, over) -> dict[str, Any]:
    total = np.asarray(total)
    return {
        "return": float(total.mean()),
        "return_std": float(total.std()),
        "win": float(np.mean(total == 1.0)),
        "draw": float(np.mean(total == 0.0)),
        "loss": float(np.mean(total == -1.0)),
        "illegal_loss": float(np.mean(lost_illegal)),
        "finished": float(np.mean(over)),
    }


def evaluate(model: _ppo.ActorCritic, config: Config) -> dict[str, Any]:
    """Outcomes of the final policy and of a random legal player against the opponent.

    Each plays ``config.eval_episodes`` games with the same first movers (the same
    keys). The greedy policy plays the head's most probable move
    (``deterministic=True``), the sampling policy a fresh draw; both see the
    legal-move mask exactly when the agent was trained with it. The random player
    picks uniformly among the legal moves, as the opponent does.

    Returns:
        For ``greedy``, ``sampled`` and ``random``: the mean ``return`` and its
        ``return_std`` per game, the fractions of games won (``win``), drawn, lost
        and lost by an illegal move (``illegal_loss``), and the fraction that ended
        (``finished``, 1). ``deterministic_return``, ``random_return`` and their
        ``_std`` repeat the greedy and random returns.
    """
    graphdef, state = nnx.split(model)
    mask = config.mask

    def policy(deterministic):
        def act(state, obs, legal, _):
            model = nnx.merge(graphdef, state)
            out = model.policy(obs, mask=legal if mask else None, deterministic=deterministic)
            return nnx.state(model), out.output["action"]

        return act

    def act_random(carry, obs, legal, key):
        return carry, opponent_move(key, legal)

    @jax.jit
    def play_all(state, key):
        return {
            "greedy": _games(policy(True), state, key, config.eval_episodes),
            "sampled": _games(policy(False), state, key, config.eval_episodes),
            "random": _games(act_random, (), key, config.eval_episodes),
        }

    key = jax.random.fold_in(jax.random.key(config.seed), 1)
    played = jax.device_get(play_all(state, key))
    result = {name: _outcomes(*games) for name, games in played.items()}
    for name, summary_name in (("greedy", "deterministic"), ("random", "random")):
        result[f"{summary_name}_return"] = result[name]["return"]
        result[f"{summary_name}_return_std"] = result[name]["return_std"]
    return result


def plot(path, summaries: list[dict]) -> None:
    """Writes the learning curves, the illegal-move probability and the outcomes to a PNG.

    Uses matplotlib's object API with the Agg canvas, so it needs no display and
    leaves pyplot's global state alone.

    Args:
        path: Where the PNG goes; its folder is created.
        summaries: One or two runs' summaries (with and without the mask).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(16, 4), layout="constrained")
    FigureCanvasAgg(fig)
    curve, illegal, outcomes = fig.subplots(1, 3, width_ratios=[1.4, 1.4, 1])
    for summary in summaries:
        masked = summary["config"]["mask"]
        color, name = ("C0", "mask") if masked else ("C3", "no mask")
        curve.plot(summary["curve_steps"], summary["curve_returns"], color=color, label=name)
        curve.axhline(summary["deterministic_return"], color=color, linestyle="--", linewidth=1)
        if masked:
            values = summary["per_iteration"]["masked_probability"]
            what = "mask: masked_probability"
        else:
            values, what = summary["illegal_fraction"], "no mask: fraction of moves illegal"
        illegal.plot(summary["iteration_steps"], values, color=color, label=what)
    random_return = summaries[0]["random_return"]
    curve.axhline(random_return, color="0.4", linestyle=":", label="uniform random legal")
    curve.plot([], [], color="k", linestyle="--", linewidth=1, label="greedy, final")
    # Log axes of moves: the mask matters most in the first few iterations.
    curve.set_xscale("log")
    curve.set_xlabel("agent moves")
    curve.set_ylabel("return per game (win 1, draw 0, loss -1)")
    curve.set_title("(a) PPO against a random legal player")
    curve.legend(loc="lower right")
    # An iteration without an illegal move is 0, which a log axis leaves out.
    illegal.set_xscale("log")
    illegal.set_yscale("log")
    illegal.set_xlabel("agent moves")
    illegal.set_ylabel("probability, mean over the iteration's moves")
    illegal.set_title("(b) the policy's probability of an illegal move")
    illegal.legend(loc="lower left")

    players = [("random", "random legal", summaries[0])]
    for summary in summaries:
        name = "mask" if summary["config"]["mask"] else "no mask"
        players += [(kind, f"{name}, {kind}", summary) for kind in ("greedy", "sampled")]
    rows = np.arange(len(players))
    left = np.zeros(len(players))
    parts = (("win", "C2"), ("draw", "0.7"), ("loss", "C1"), ("illegal_loss", "C3"))
    for part, color in parts:
        # A loss by an illegal move is shown apart from the other losses.
        width = np.array([summary[kind][part] for kind, _, summary in players])
        if part == "loss":
            width -= np.array([summary[kind]["illegal_loss"] for kind, _, summary in players])
        outcomes.barh(rows, width, left=left, color=color, label=part.replace("_", " "))
        left += width
    outcomes.set_yticks(rows, [label for _, label, _ in players])
    outcomes.invert_yaxis()
    outcomes.set_xlim(0, 1)
    outcomes.set_xlabel(f"fraction of {summaries[0]['config']['eval_episodes']:,} games")
    outcomes.set_title("(c) final outcomes")
    outcomes.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), fontsize="small", ncols=4)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def parse_args(argv: Sequence[str] | None = None) -> tuple[Config, argparse.Namespace]:
    """The config a command line asks for, and its other arguments.

    Args:
        argv: Command-line arguments (``sys.argv[1:]`` when None).

    Returns:
        ``(config, args)``: ``args.out`` is the output folder, ``args.no_progress``
        hides the progress bar and ``args.compare`` trains without the mask too.
    """
    defaults = Config()
    config, args = _common.command_line(
        argv,
        defaults,
        prog="python -m samplers.examples.tictactoe",
        description="Train PPO on pgx tic_tac_toe against a random legal player with "
        "samplers.CategoricalSampler and the legal-move mask. The progress bar shows the "
        "mean return of the games that ended in the last iteration and the policy's "
        "probability of an illegal move (the head's masked_probability, or without the "
        "mask the fraction of moves that were illegal).",
        flags={
            "--rollout-length": dict(
                type=int,
                default=defaults.rollout_length,
                help="moves per game slot between updates",
            ),
            "--no-mask": dict(
                dest="mask",
                action="store_false",
                help="train without the legal-move mask (an illegal move loses the game)",
            ),
            "--compare": dict(
                action="store_true",
                help="train with the mask, then without it, and draw both",
            ),
        },
        out="tictactoe-results",
        figure="tictactoe.png",
    )
    if args.compare and not config.mask:
        raise SystemExit("--compare trains with and without the mask; drop --no-mask.")
    return config, args


def _lines(summary: dict) -> list[str]:
    lines = []
    for kind in ("greedy", "sampled", "random"):
        games = summary[kind]
        lines.append(
            f"{kind:>7}: win {games['win']:.3f}  draw {games['draw']:.3f}  "
            f"loss {games['loss']:.3f} (illegal move {games['illegal_loss']:.3f})"
        )
    reached = summary["steps_to_half"]
    return [
        *lines,
        "training games first averaged a return >= 0.5 after "
        f"{'-' if reached is None else f'{reached:,}'} moves",
        f"illegal moves in training: {summary['illegal_moves']:,}; probability of an "
        f"illegal move in the last iteration: masked_probability "
        f"{summary['per_iteration']['masked_probability'][-1]:.2e}, fraction played "
        f"{summary['illegal_fraction'][-1]:.2e}",
        _ppo.replay_line(summary),
    ]


def main(argv: Sequence[str] | None = None) -> dict:
    """Trains, evaluates, prints a summary and writes the figure and ``summary.json``.

    Args:
        argv: Command-line arguments (``sys.argv[1:]`` when None).

    Returns:
        The summary written to ``summary.json``; with ``--compare``, the masked
        run's, holding the other run's summary as ``without_mask``.
    """
    config, args = parse_args(argv)
    start = time.perf_counter()
    configs = [config, dataclasses.replace(config, mask=False)] if args.compare else [config]
    summaries = []
    for run_config in configs:
        model, log = train(run_config, progress=not args.no_progress)
        summary = {"config": dataclasses.asdict(run_config), **evaluate(model, run_config), **log}
        summary["steps_to_half"] = _common.first_step_at(log, 0.5)
        summaries.append(summary)
    figure = args.out / "tictactoe.png"
    plot(figure, summaries)
    summary, *others = summaries
    details = _lines(summary)
    for other in others:
        summary["without_mask"] = other
        details += [
            f"without the mask ({other['steps']:,} moves, compile {other['compile_s']:.1f} s, "
            f"{other['steps_per_second']:,.0f} moves/s): greedy return "
            f"{other['deterministic_return']:.3f} +- {other['deterministic_return_std']:.3f}",
            *_lines(other),
        ]
    _common.finish(
        summary,
        figure,
        start,
        header=f"tic_tac_toe, {_label(config)}, {summary['steps']:,} moves, seed {config.seed}",
        details=details,
    )
    return summary


if __name__ == "__main__":
    main()
