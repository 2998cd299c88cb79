"""What the examples share: the task, the training loop, evaluation, the figure.

``pendulum``, ``cartpole``, ``tictactoe`` and ``hybrid`` (PPO) and ``pendulum_sac``
(SAC) share the progress bar, the deterministic-versus-random evaluation, the
figure's learning curve, the command line and the printed summary, written here
once, with the Pendulum task's observation scaling and torque panels. The four PPO
examples share one trainer, ``_ppo.train``.
"""

import argparse
import dataclasses
import json
import math
import pathlib
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

import distrax
import gymnax
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import samplers

MAX_TORQUE = 2.0
# Observations are (cos, sin, angular velocity in [-8, 8]): the velocity comes to the
# unit range of the other two so that no input dominates at initialisation.
OBS_SCALE = (1.0, 1.0, 1.0 / 8.0)
# States (angle from upright, angular velocity) whose action distributions are drawn:
# hanging down at rest, hanging down and swinging, upright at rest.
PROBE_STATES = ((math.pi, 0.0), (math.pi, -2.0), (0.0, 0.0))


def scaled(obs: jax.Array) -> jax.Array:
    """The observation with each entry brought to unit range, as the networks take it."""
    return obs * jnp.broadcast_to(jnp.asarray(OBS_SCALE, obs.dtype), obs.shape)


def reset(key: jax.Array, num_envs: int, env_id: str = "Pendulum-v1"):
    """``(obs, env_state)`` of ``num_envs`` fresh gymnax ``env_id`` environments, a key each."""
    env, env_params = gymnax.make(env_id)
    return jax.vmap(env.reset, in_axes=(0, None))(jax.random.split(key, num_envs), env_params)


class Run(NamedTuple):
    """What :func:`run` returns."""

    state: Any
    """The training state after the last call."""
    history: list[dict[str, float]]
    """Every call's metrics, as floats."""
    curve_steps: list[int]
    """Environment steps after each call in which some episodes ended."""
    curve_returns: list[float]
    """The mean return of those episodes."""
    compile_s: float
    """Seconds spent compiling ``train_step``."""
    train_s: float
    """Seconds spent in the calls."""


def run(
    train_step,
    state,
    runner,
    *,
    calls: int,
    steps_per_call: int,
    label: str,
    column: tuple[str, Callable[[dict[str, float]], str]],
    progress: bool,
) -> Run:
    """Compiles ``train_step`` and calls it ``calls`` times under a live progress bar.

    Args:
        train_step: A jitted ``(state, runner) -> (state, runner, metrics)``;
            ``metrics`` holds ``episodes`` and ``return_sum``, the number and the
            summed returns of the episodes that ended during the call.
        state: The training state.
        runner: What else the call carries (environments, keys, buffers).
        calls: Number of calls.
        steps_per_call: Environment steps per call, over all environments.
        label: The bar's first column, the algorithm's name.
        column: ``(title, show)``: the bar's last column is ``title`` and
            ``show(metrics)`` of the latest call.
        progress: Show the bar.

    Returns:
        The state after the last call, the learning curve and the timings.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    start = time.perf_counter()
    train_step = train_step.lower(state, runner).compile()
    compile_s = time.perf_counter() - start

    title, show = column
    bar = Progress(
        TextColumn(label),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("steps"),
        TimeElapsedColumn(),
        TextColumn("{task.fields[rate]} steps/s"),
        TextColumn("return {task.fields[ret]}"),
        TextColumn(title + " {task.fields[extra]}"),
        disable=not progress,
    )
    history, curve_steps, curve_returns = [], [], []
    last_return = float("nan")
    start = time.perf_counter()
    with bar:
        task = bar.add_task("", total=calls * steps_per_call, rate="-", ret="-", extra="-")
        for call in range(calls):
            state, runner, metrics = train_step(state, runner)
            metrics = {name: float(value) for name, value in jax.device_get(metrics).items()}
            history.append(metrics)
            steps = (call + 1) * steps_per_call
            if metrics["episodes"]:
                last_return = metrics["return_sum"] / metrics["episodes"]
                curve_steps.append(steps)
                curve_returns.append(last_return)
            bar.update(
                task,
                completed=steps,
                rate=f"{steps / (time.perf_counter() - start):,.0f}",
                ret="-" if math.isnan(last_return) else f"{last_return:7.1f}",
                extra=show(metrics),
            )
    train_s = time.perf_counter() - start
    return Run(state, history, curve_steps, curve_returns, compile_s, train_s)


def first_step_at(log: dict, threshold: float) -> int | None:
    """The first step of the learning curve whose mean return is ``>= threshold``, or None.

    Example:
        >>> first_step_at({"curve_steps": [10, 20, 30], "curve_returns": [-900, -150, -300]}, -200)
        20
    """
    pairs = zip(log["curve_steps"], log["curve_returns"], strict=True)
    return next((steps for steps, ret in pairs if ret >= threshold), None)


def _episode_returns(act, carry, key: jax.Array, num_episodes: int, env_id: str) -> jax.Array:
    """Returns of ``num_episodes`` episodes of ``act(carry, obs, key) -> (carry, action)``.

    Each episode counts the rewards up to its end (termination or the time limit);
    what the environment plays after its automatic reset is not counted.
    """
    env, env_params = gymnax.make(env_id)
    reset_key, key = jax.random.split(key)
    obs, env_state = reset(reset_key, num_episodes, env_id)

    def step(loop, step_key):
        carry, env_state, obs, total, running = loop
        act_key, env_key = jax.random.split(step_key)
        carry, action = act(carry, obs, act_key)
        obs, env_state, reward, terminated, truncated, _ = jax.vmap(
            env.step, in_axes=(0, 0, 0, None)
        )(jax.random.split(env_key, num_episodes), env_state, action, env_params)
        total = total + jnp.where(running, reward, 0.0)
        running = running & ~(terminated | truncated)
        return (carry, env_state, obs, total, running), None

    keys = jax.random.split(key, env_params.max_steps_in_episode)
    running = jnp.ones(num_episodes, dtype=bool)
    loop = (carry, env_state, obs, jnp.zeros(num_episodes), running)
    (_, _, _, total, _), _ = jax.lax.scan(step, loop, keys)
    return total


def _random_actions(env_id: str, key: jax.Array, num_episodes: int) -> jax.Array:
    """Uniform random actions for ``num_episodes`` environments: a box's range, or a choice."""
    env, env_params = gymnax.make(env_id)
    space = env.action_space(env_params)
    if hasattr(space, "n"):
        return jax.random.randint(key, (num_episodes,), 0, space.n)
    shape = (num_episodes, *space.shape)
    return jax.random.uniform(key, shape, minval=space.low, maxval=space.high)


def evaluate(
    module: nnx.Module,
    act: Callable[[Any, jax.Array], jax.Array],
    *,
    num_episodes: int,
    seed: int,
    env_id: str = "Pendulum-v1",
) -> dict[str, float]:
    """Mean and std of the episode returns of the deterministic policy and of a random one.

    Both play ``num_episodes`` episodes of gymnax ``env_id`` from the same initial
    states (the same reset keys), each to its end or its time limit. The policy acts
    in ``eval()`` mode (for Pendulum, the torque ``f(mean)``); the random policy
    draws each action uniformly from the action space (for Pendulum, a torque in
    ``[-2, 2]``). ``module`` is left in training mode.

    Args:
        module: The policy; ``eval()`` makes its head deterministic.
        act: ``act(module, obs)``, the actions the module takes for a batch of
            observations.
        num_episodes: Episodes each policy plays.
        seed: The training seed; the evaluation draws from a key of its own.
        env_id: The gymnax environment.

    Returns:
        ``deterministic_return``, ``random_return`` and their ``_std``, per episode.
    """
    module.eval()
    graphdef, state = nnx.split(module)
    module.train()

    def act_deterministic(state, obs, _):
        # The head draws from its stream even when deterministic: carry it.
        module = nnx.merge(graphdef, state)
        return nnx.state(module), act(module, obs)

    def act_random(carry, obs, key):
        return carry, _random_actions(env_id, key, num_episodes)

    @jax.jit
    def play(state, key):
        deterministic = _episode_returns(act_deterministic, state, key, num_episodes, env_id)
        return deterministic, _episode_returns(act_random, (), key, num_episodes, env_id)

    key = jax.random.fold_in(jax.random.key(seed), 1)
    deterministic, uniform = jax.device_get(play(state, key))
    return {
        "deterministic_return": float(deterministic.mean()),
        "deterministic_return_std": float(deterministic.std()),
        "random_return": float(uniform.mean()),
        "random_return_std": float(uniform.std()),
    }


def action_distributions(
    network: Callable[[jax.Array], jax.Array],
    head: samplers.SquashedNormalSampler | samplers.BetaSampler | samplers.FlowSampler,
    torque_scale: float = 1.0,
    *,
    num_samples: int = 20_000,
    grid: int = 2_001,
) -> list[dict]:
    """Samples and density of the torque the policy takes in each of ``PROBE_STATES``.

    The samples come from the head in training mode. The density is computed
    from the head's distribution object on a grid of pre-images ``x`` spanning
    ``loc +- 6 scale`` (for the Beta head, the logit's mean +- 6 stds; for a flow head,
    base draws, which its layers then move): the torque
    is ``torque_scale * f(x)`` and its density is
    ``exp(log_prob_from_pre_image(x)) / torque_scale``, which stays finite where
    ``f`` saturates and ``log_prob`` of the action would need ``atanh(+-1)``.

    Args:
        network: The scaled observation to the head's input (``[mean | raw_std]``, then
            a flow head's features).
        head: The policy head; one call draws the samples from its stream.
        torque_scale: The torque per unit of action.
        num_samples: Samples per state.
        grid: Points of the density's grid.

    Returns:
        A list of dicts with ``state``, ``samples``, ``torque`` (grid), ``density``
        and ``deterministic`` (the torque of ``eval()``: ``torque_scale * f(mean)``,
        or the Beta's mean).
    """
    result = []
    for theta, theta_dot in PROBE_STATES:
        obs = jnp.array([math.cos(theta), math.sin(theta), theta_dot])
        mean_and_std = network(scaled(obs))
        width = mean_and_std.shape[-1]
        sampled = head((), jnp.broadcast_to(mean_and_std, (num_samples, width)))
        dist = head.distribution(jnp.broadcast_to(mean_and_std, (grid, width)))
        if isinstance(dist, samplers.SquashedBeta):
            # The LogitBeta of each dimension, inside the Independent.
            logit = cast(
                samplers.LogitBeta, cast(distrax.Independent, dist.distribution).distribution
            )
            center, spread = logit.mean(), logit.stddev()
            deterministic = dist.mean()
        else:
            dist = cast(samplers.SquashedNormal | samplers.SquashedFlow, dist)
            center, spread = dist.loc, dist.scale
            deterministic = dist.deterministic_action()
        pre_image = center + spread * jnp.linspace(-6.0, 6.0, grid)[:, None]
        if isinstance(dist, samplers.SquashedFlow):
            # The grid is of base draws: the layers (increasing, as coupling transforms
            # in one dimension are) take it to the squashing's pre-images.
            for layer in dist.layers:
                pre_image = jnp.asarray(layer.forward(pre_image))
        action, log_prob = dist.forward_and_log_prob(pre_image)
        action = action[:, 0]
        density = jnp.exp(log_prob) / torque_scale
        result.append(
            {
                "state": (theta, theta_dot),
                "samples": np.asarray(torque_scale * sampled.output["action"][:, 0]),
                "torque": np.asarray(torque_scale * action),
                "density": np.asarray(density),
                "deterministic": float(torque_scale * deterministic[0, 0]),
            }
        )
    return result


def plot(
    path: pathlib.Path,
    summary: dict,
    distributions: list[dict],
    *,
    title: str,
    warmup_steps: int | None = None,
    draw: Callable[[Any, list[dict]], None] | None = None,
    episode: str = "200 steps",
) -> None:
    """Writes the learning curve and one panel per probed state to a PNG at ``path``.

    Uses matplotlib's object API with the Agg canvas, so it needs no display and
    leaves pyplot's global state alone.

    Args:
        path: Where the PNG goes; its folder is created.
        summary: Holds ``curve_steps``, ``curve_returns``, ``deterministic_return``
            and ``random_return``.
        distributions: One entry per panel; by default what
            :func:`action_distributions` returns.
        title: The learning curve's title.
        warmup_steps: Where a grey line marks the end of a warm-up, if any.
        draw: ``draw(axes, distributions)`` fills the panels right of the curve,
            one axis per entry; None draws Pendulum's torque densities.
        episode: How long an episode is, for the curve's axis label.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(16, 4), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 1 + len(distributions), width_ratios=[1.6] + [1] * len(distributions))
    curve = axes[0]
    curve.plot(summary["curve_steps"], summary["curve_returns"], color="C0", label="training")
    curve.axhline(
        summary["deterministic_return"], color="C2", linestyle="--", label="deterministic, final"
    )
    curve.axhline(summary["random_return"], color="C3", linestyle=":", label="uniform random")
    if warmup_steps is not None:
        curve.axvline(warmup_steps, color="0.6", linewidth=1, label="warm-up end")
    curve.set_xlabel("environment steps")
    curve.set_ylabel(f"return per episode ({episode})")
    curve.set_title(title)
    curve.legend(loc="lower right")
    (draw or _torque_panels)(axes[1:], distributions)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def _torque_panels(axes, distributions: list[dict]) -> None:
    """Pendulum's panels: sampled torques against the density, bounds in black."""
    from matplotlib.ticker import MaxNLocator

    for ax, dist in zip(axes, distributions, strict=True):
        samples = dist["samples"]
        low, high = np.quantile(samples, [0.0005, 0.9995])
        # Zoom onto the samples: a nearly deterministic policy is a spike at full width.
        pad = 0.15 * max(high - low, 0.2)
        ax.set_xlim(low - pad, high + pad)
        heights, _, _ = ax.hist(
            samples,
            bins=60,
            range=(low, high),
            density=True,
            color="C0",
            alpha=0.5,
            label="samples",
        )
        ax.plot(dist["torque"], dist["density"], color="C1", label="exp(log_prob)")
        ax.axvline(
            dist["deterministic"], color="C2", linestyle="--", label="deterministic (eval())"
        )
        for bound in (-MAX_TORQUE, MAX_TORQUE):
            ax.axvline(bound, color="k", linewidth=1.5)
        # A squashing that saturates piles density against a bound; keep the bulk readable.
        ax.set_ylim(0, 1.3 * max(heights.max(), 1e-3))
        theta, theta_dot = dist["state"]
        ax.set_title(f"angle {math.degrees(theta):.0f} deg, velocity {theta_dot:+.1f} rad/s")
        ax.set_xlabel("torque (black: bounds)")
        ax.xaxis.set_major_locator(MaxNLocator(5))
    axes[0].set_ylabel("(b) density of the learned action")
    axes[0].legend(loc="best", fontsize="small")


def command_line(
    argv: Sequence[str] | None,
    defaults,
    *,
    prog: str,
    description: str,
    flags: dict[str, dict],
    out: str,
    figure: str,
) -> tuple[Any, argparse.Namespace]:
    """Parses an example's command line into its config.

    Every example takes ``--total-steps``, ``--seed`` and ``--num-envs`` first and
    ``--eval-episodes``, ``--out`` and ``--no-progress`` last; ``flags`` are its own,
    in between. A flag sets the config field of the same name.

    Args:
        argv: Command-line arguments (``sys.argv[1:]`` when None).
        defaults: The example's default config, a frozen dataclass.
        prog: The program's name in ``--help``.
        description: The ``--help`` text.
        flags: The example's own flags, name to ``add_argument`` keywords.
        out: The default output folder.
        figure: The figure's file name, for ``--help``.

    Returns:
        ``(config, args)``: ``args.out`` and ``args.no_progress`` are not in the config.

    Example:
        >>> import dataclasses
        >>> @dataclasses.dataclass(frozen=True)
        ... class Config:
        ...     total_steps: int = 100
        ...     seed: int = 0
        ...     num_envs: int = 4
        ...     eval_episodes: int = 8
        >>> config, args = command_line(
        ...     ["--seed", "3"], Config(), prog="demo", description="", flags={}, out="o",
        ...     figure="f.png",
        ... )
        >>> config, str(args.out), args.no_progress
        (Config(total_steps=100, seed=3, num_envs=4, eval_episodes=8), 'o', False)
    """
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument(
        "--total-steps", type=int, default=defaults.total_steps, help="environment steps to train"
    )
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument(
        "--num-envs", type=int, default=defaults.num_envs, help="environments run in parallel"
    )
    for name, options in flags.items():
        parser.add_argument(name, **options)
    parser.add_argument(
        "--eval-episodes",
        type=int,
        default=defaults.eval_episodes,
        help="episodes for the final deterministic-vs-random evaluation",
    )
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        default=pathlib.Path(out),
        help=f"folder for {figure} and summary.json",
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = parser.parse_args(argv)
    fields = [field.name for field in dataclasses.fields(defaults) if hasattr(args, field.name)]
    config = dataclasses.replace(defaults, **{name: getattr(args, name) for name in fields})
    return config, args


def finish(
    summary: dict, figure: pathlib.Path, start: float, *, header: str, details: Sequence[str]
) -> None:
    """Completes ``summary``, writes it to ``summary.json`` beside the figure, and prints it.

    Args:
        summary: What :func:`evaluate` returns, the training log and the config;
            ``wall_s`` (since ``start``, a ``time.perf_counter()``) and ``figure`` are added.
        figure: The figure's path.
        start: When the run began.
        header: The first line printed.
        details: Lines printed after the evaluation and the timings.
    """
    summary["wall_s"] = time.perf_counter() - start
    summary["figure"] = str(figure)
    written = figure.parent / "summary.json"
    written.write_text(json.dumps(summary, indent=2))
    lines = [
        header,
        f"deterministic policy: {summary['deterministic_return']:8.1f} "
        f"+- {summary['deterministic_return_std']:.1f} per episode "
        f"({summary['config']['eval_episodes']} episodes)",
        f"uniform random:       {summary['random_return']:8.1f} "
        f"+- {summary['random_return_std']:.1f} per episode (same initial states)",
        f"wall time {summary['wall_s']:.1f} s (compile {summary['compile_s']:.1f} s), "
        f"{summary['steps_per_second']:,.0f} steps/s while training",
        *details,
        f"wrote {figure} and {written}",
    ]
    print("\n  ".join(lines))
