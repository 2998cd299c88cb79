"""PPO on pgx's ``tic_tac_toe`` with :class:`samplers.CategoricalSampler` and legal-move masks.

Run ``python -m samplers.examples.tictactoe`` (``--help`` lists the flags). The
agent plays pgx player 0 against a fixed opponent that picks uniformly among the
legal moves; who moves first is drawn for each game. The agent sees pgx's
observation for its player (its marks and the opponent's, ``3 x 3 x 2``) and the
game's ``legal_action_mask``. Its reward is pgx's at the end of the game: 1 for a
win, 0 for a draw, -1 for a loss. An environment step is one move of the agent
and the opponent's reply.

The policy head is a :class:`samplers.CategoricalSampler` over the 9 cells. The
rollout calls it with ``mask=state.legal_action_mask`` and stores that mask beside
the action it took; the PPO loss replays the stored action under the stored mask,
so the ratio is computed between the same masked distributions. With
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
class Config:
    """Hyperparameters; the command-line flags override the first few.

    The budget is ``total_steps`` agent moves, done in iterations of
    ``num_envs * rollout_length`` moves, each followed by ``epochs`` passes of
    ``minibatches`` updates over that batch.
    """

    total_steps: int = 500_000
    seed: int = 0
    num_envs: int = 64
    rollout_length: int = 32
    mask: bool = True
    eval_episodes: int = 10_000
    epochs: int = 4
    minibatches: int = 4
    gamma: float = 0.99
    gae_lambda: float = 0.95
    learning_rate: float = 1e-3
    clip_epsilon: float = 0.2
    value_weight: float = 0.5
    entropy_weight: float = 0.01
    max_grad_norm: float = 0.5
    hidden: int = 128


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


class ActorCritic(nnx.Module):
    """Two tanh MLPs on the observation, and the sampler as the policy's last layer.

    Args:
        head: The policy head; it owns the sampling stream.
        hidden: Width of the hidden layers.
        rngs: Initialisation stream for the weights.
    """

    def __init__(self, head: samplers.CategoricalSampler, hidden: int, rngs: nnx.Rngs):
        # A small last layer starts the policy near uniform over the 9 cells.
        self.actor = _ppo.tanh_mlp(18, head.num_params, hidden=hidden, last_scale=0.01, rngs=rngs)
        self.critic = _ppo.tanh_mlp(18, 1, hidden=hidden, last_scale=1.0, rngs=rngs)
        self.head = head

    def policy(self, obs, mask, action=None, *, deterministic: bool | None = None):
        """The head's output: a fresh move, or a replay of ``action``, under ``mask``."""
        return self.head((), self.actor(obs), action, mask=mask, deterministic=deterministic)

    def value(self, obs: jax.Array) -> jax.Array:
        """State values, shape ``obs.shape[:-1]``."""
        return self.critic(obs)[..., 0]


def make_train_step(config: Config, graphdef):
    """Builds the jitted function ``(state, runner) -> (state, runner, metrics)``.

    ``state`` is ``nnx.split((model, optimizer))[1]``; ``runner`` carries the
    games, a key and the running returns. One call collects ``rollout_length``
    moves in every game and runs the PPO epochs.
    """
    batch_size = config.num_envs * config.rollout_length

    def mask_of(legal):
        return legal if config.mask else None

    def rollout(model, runner):
        model_def, model_state = nnx.split(model)

        def env_step(carry, _):
            model_state, games, key, episode_return = carry
            model = nnx.merge(model_def, model_state)
            obs, legal = observe(games), games.legal_action_mask
            out = model.policy(obs, mask_of(legal))
            key, play_key, reset_key = jax.random.split(key, 3)
            games, reward, illegal = jax.vmap(play)(
                games, out.output["action"], jax.random.split(play_key, config.num_envs)
            )
            done = games.terminated
            fresh = jax.vmap(new_game)(jax.random.split(reset_key, config.num_envs))
            games = jax.vmap(_select)(done, fresh, games)
            episode_return = episode_return + reward
            transition = {
                "obs": obs,
                "legal": legal,
                "action": out.rollout_extras,
                "log_prob": out.output["log_likelihood"],
                "reward": reward,
                "done": done,
                "illegal": illegal,
                "finished_return": jnp.where(done, episode_return, 0.0),
                "masked_probability": out.metrics["masked_probability"],
            }
            episode_return = jnp.where(done, 0.0, episode_return)
            return (nnx.state(model), games, key, episode_return), transition

        carry = (model_state, *runner)
        (model_state, *runner), trajectory = jax.lax.scan(
            env_step, carry, length=config.rollout_length
        )
        # The module again, with the sampling stream advanced by the scan.
        return nnx.merge(model_def, model_state), tuple(runner), trajectory

    def loss_fn(model, batch):
        # Replay: the head scores the stored move under the current weights and the
        # mask stored with it.
        out = model.policy(batch["obs"], mask_of(batch["legal"]), batch["action"])
        # The entropy term is the head's regularization_loss, -entropy_weight times
        # the entropy over the allowed moves when masked.
        return _ppo.ppo_loss(out, model.value(batch["obs"]), batch, config)

    @jax.jit
    def train_step(state, runner):
        model, optimizer = nnx.merge(graphdef, state)
        key, epoch_key = jax.random.split(runner[1])
        model, (games, key, episode_return), trajectory = rollout(
            model, (runner[0], key, runner[2])
        )
        value = model.value(trajectory["obs"])
        last_value = model.value(observe(games))
        # A game ends only by its rules, never by a time limit: the step after a
        # finished game is the new game's, and the finished one bootstraps from nothing.
        next_value = jnp.concatenate([value[1:], last_value[None]])
        done = trajectory["done"]
        advantage = _ppo.gae(
            trajectory["reward"], value, next_value, done, done, config.gamma, config.gae_lambda
        )
        batch = {
            "obs": trajectory["obs"],
            "legal": trajectory["legal"],
            "action": trajectory["action"],
            "log_prob": trajectory["log_prob"],
            "advantage": advantage,
            "target": advantage + value,
        }

        # Before any update the weights are those of the rollout: replaying the stored
        # moves under the stored masks, one step of all games at a time as the rollout
        # ran them, must give a ratio of exactly 1. The loss's minibatches are other
        # shapes, where the network may round differently.
        def replay(model_state, step):
            # The head draws from its stream in replay too: a copy of the model carries it.
            obs, legal, action = step
            copy = nnx.merge(model_def, model_state)
            out = copy.policy(obs, mask_of(legal), action)
            return nnx.state(copy), out.output["log_likelihood"]

        model_def, model_state = nnx.split(model)
        steps = (trajectory["obs"], trajectory["legal"], trajectory["action"])
        _, replayed = jax.lax.scan(replay, model_state, steps)
        ratio_error = jnp.abs(jnp.exp(replayed - trajectory["log_prob"]) - 1.0)
        batch = jax.tree.map(lambda x: x.reshape(batch_size, *x.shape[2:]), batch)
        _, flat = replay(model_state, (batch["obs"], batch["legal"], batch["action"]))
        flat_error = jnp.abs(jnp.exp(flat - batch["log_prob"]) - 1.0)
        state, metrics = _ppo.update_epochs(
            loss_fn, graphdef, nnx.state((model, optimizer)), batch, epoch_key, config
        )
        metrics |= {
            "replay_ratio_error": ratio_error.max(),
            "minibatch_ratio_error": flat_error.max(),
            "episodes": trajectory["done"].sum(),
            "return_sum": trajectory["finished_return"].sum(),
            "illegal_moves": trajectory["illegal"].sum(),
            "illegal_fraction": trajectory["illegal"].mean(),
            "masked_probability": trajectory["masked_probability"].mean(),
        }
        return state, (games, key, episode_return), metrics

    return train_step


def _label(config: Config) -> str:
    return "mask" if config.mask else "no mask"


def train(config: Config, *, progress: bool = True) -> tuple[ActorCritic, dict]:
    """Trains the actor-critic for ``config.total_steps`` agent moves.

    Args:
        config: Hyperparameters.
        progress: Show a live progress bar.

    Returns:
        ``(model, log)``: ``log`` holds the learning curve (``curve_steps``,
        ``curve_returns``: mean return of the games that ended in each
        iteration), per iteration the head's mean ``masked_probability`` over the
        rollout's moves (0 without a mask) and the fraction of moves that were
        illegal, ``illegal_moves`` (all iterations), ``replay_ratio_error`` (the
        largest ``|ratio - 1|`` of the replay before each iteration's first
        update, in the rollout's shapes, over all iterations),
        ``minibatch_ratio_error`` (the same for the whole batch at once), the
        timings and the last iteration's losses.
    """
    _ppo.check_ppo_config(config)
    key = jax.random.key(config.seed)
    head_key, param_key, env_key, runner_key = jax.random.split(key, 4)
    head = samplers.CategoricalSampler(nnx.Rngs(head_key), config.entropy_weight, NUM_CELLS)
    model = ActorCritic(head, config.hidden, nnx.Rngs(param_key))

    steps_per_iteration = config.num_envs * config.rollout_length
    iterations = max(1, config.total_steps // steps_per_iteration)
    optimizer = _ppo.ppo_optimizer(model, config, iterations)
    graphdef, state = nnx.split((model, optimizer))

    games = jax.vmap(new_game)(jax.random.split(env_key, config.num_envs))
    runner = (games, runner_key, jnp.zeros(config.num_envs))
    name = "masked_probability" if config.mask else "illegal_fraction"
    run = _common.run(
        make_train_step(config, graphdef),
        state,
        runner,
        calls=iterations,
        steps_per_call=steps_per_iteration,
        label=f"PPO, {_label(config)}",
        column=("illegal p", lambda metrics: f"{metrics[name]:.4f}"),
        progress=progress,
    )
    model, _ = nnx.merge(graphdef, run.state)
    log = {
        "steps": iterations * steps_per_iteration,
        "iterations": iterations,
        "curve_steps": run.curve_steps,
        "curve_returns": run.curve_returns,
        "iteration_steps": [(i + 1) * steps_per_iteration for i in range(iterations)],
        "masked_probability": [m["masked_probability"] for m in run.history],
        "illegal_fraction": [m["illegal_fraction"] for m in run.history],
        "illegal_moves": int(sum(m["illegal_moves"] for m in run.history)),
        "replay_ratio_error": _ppo.largest(m["replay_ratio_error"] for m in run.history),
        "minibatch_ratio_error": _ppo.largest(m["minibatch_ratio_error"] for m in run.history),
        "compile_s": run.compile_s,
        "train_s": run.train_s,
        "steps_per_second": iterations * steps_per_iteration / run.train_s,
        "last_iteration": run.history[-1],
    }
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


def evaluate(model: ActorCritic, config: Config) -> dict[str, Any]:
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
            out = model.policy(obs, legal if mask else None, deterministic=deterministic)
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
            values, what = summary["masked_probability"], "mask: masked_probability"
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
        f"{summary['masked_probability'][-1]:.2e}, fraction played "
        f"{summary['illegal_fraction'][-1]:.2e}",
        f"replay ratio before the first update: max |ratio - 1| = "
        f"{summary['replay_ratio_error']:.1e} in the rollout's shapes, "
        f"{summary['minibatch_ratio_error']:.1e} over the whole batch",
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
