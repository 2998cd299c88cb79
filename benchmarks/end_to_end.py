"""``python -m benchmarks --end-to-end``: PPO trained whole in one compiled program.

PPO on gymnax ``CartPole-v1`` (``samplers.CategoricalSampler``) and ``Pendulum-v1``
(``samplers.NormalTanhSampler``), with the examples' trainer
(``samplers.examples._ppo.make_train_step``: rollout, advantages, epochs of
minibatch updates) run for every iteration of a run under one ``lax.scan`` inside
one ``jax.jit``, so that a run is one call of one compiled program. The same loop
runs with a hand-written head (:class:`HandWrittenCategorical`,
:class:`HandWrittenNormalTanh`): the same distribution's sample, log-likelihood
and entropy written out as formulas. Each environment and head is compiled once;
its seeds run the same executable, the two heads alternating per seed. Reported:
environment steps per second per run (compilation excluded, timed apart), the
ratio of the run times, and each run's evaluation return (the deterministic
policy). Writes ``results/end_to_end.md`` and ``results/end_to_end.json``.
"""

import dataclasses
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import gymnax
import jax
import jax.numpy as jnp
from flax import nnx

import samplers
from benchmarks import timing
from samplers.examples import _common, _ppo, cartpole, pendulum

NUM_ENVS = 2048
SEEDS = (0, 1, 2)
HEADS = ("samplers", "hand-written")
# NormalTanhSampler's default floor under the std.
MIN_STD = 1e-3
_LOG2 = math.log(2.0)
_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


class HandWrittenCategorical(nnx.Module):
    """A categorical policy head written out: ``log_softmax`` and ``jax.random.categorical``.

    The head call contract of the trainer, ``head(state, logits, rollout_extras=None,
    *, deterministic=None)``: a fresh action (or ``argmax`` when deterministic),
    stored as ``rollout_extras``, or the stored action scored under ``logits``; the
    regularisation is ``-entropy_weight`` times the exact entropy.
    """

    def __init__(self, rngs: nnx.Rngs, entropy_weight: float, num_actions: int):
        self.rngs = rngs
        self.entropy_weight = entropy_weight
        self.num_params = num_actions
        self.deterministic = False

    def __call__(self, state, logits, rollout_extras=None, *, deterministic=None):
        log_p = jax.nn.log_softmax(logits)
        if rollout_extras is not None:
            action = rollout_extras
        elif self.deterministic if deterministic is None else deterministic:
            action = jnp.argmax(logits, axis=-1)
        else:
            action = jax.random.categorical(self.rngs.default(), logits)
        log_likelihood = jnp.take_along_axis(log_p, action[..., None], axis=-1)[..., 0]
        entropy = -jnp.sum(jnp.exp(log_p) * log_p, axis=-1)
        output = {"action": action, "log_likelihood": log_likelihood}
        return samplers.StatefulModuleOutput((), output, -self.entropy_weight * entropy, {}, action)


class HandWrittenNormalTanh(nnx.Module):
    """A tanh-squashed Normal policy head written out, as the specified formulas.

    The input is ``[mean | raw]``, ``std = softplus(raw) + MIN_STD``; the action is
    ``tanh(z)``, ``z = mean + std * eps`` (``tanh(mean)`` when deterministic), ``z``
    is stored, and its log-likelihood is the Normal's log-density minus the tanh
    log-determinant ``2 (log 2 - z - softplus(-2 z))``, summed over the action axis.
    The regularisation is ``-entropy_weight`` times the one-sample entropy estimate
    (the Normal's entropy plus the log-determinant at a fresh draw), as the samplers
    head's default. Each call draws two keys from the stream, the sample's and the
    entropy's.
    """

    def __init__(self, rngs: nnx.Rngs, entropy_weight: float, action_dim: int):
        self.rngs = rngs
        self.entropy_weight = entropy_weight
        self.num_params = 2 * action_dim
        self.deterministic = False

    def __call__(self, state, inputs, rollout_extras=None, *, deterministic=None):
        mean, raw = jnp.split(inputs, 2, axis=-1)
        std = jax.nn.softplus(raw) + MIN_STD
        sample_key, entropy_key = jax.random.split(self.rngs.default())
        if rollout_extras is not None:
            z = rollout_extras
        elif self.deterministic if deterministic is None else deterministic:
            z = mean
        else:
            z = mean + std * jax.random.normal(sample_key, mean.shape)
        z = jax.lax.stop_gradient(z)
        log_normal = -0.5 * jnp.square((z - mean) / std) - _HALF_LOG_2PI - jnp.log(std)
        log_likelihood = jnp.sum(log_normal - _tanh_log_det(z), axis=-1)
        eps = jax.lax.stop_gradient(jax.random.normal(entropy_key, mean.shape))
        normal_entropy = 0.5 + _HALF_LOG_2PI + jnp.log(std)
        entropy = jnp.sum(normal_entropy + _tanh_log_det(mean + std * eps), axis=-1)
        output = {"action": jnp.tanh(z), "log_likelihood": log_likelihood}
        return samplers.StatefulModuleOutput((), output, -self.entropy_weight * entropy, {}, z)


def _tanh_log_det(z):
    return 2.0 * (_LOG2 - z - jax.nn.softplus(-2.0 * z))


@dataclasses.dataclass(frozen=True)
class Task:
    """An environment, its PPO config (``num_envs`` and the budget set per run) and heads."""

    env_id: str
    config: _ppo.Config
    steps: int  # environment steps per run at budget 1
    obs_size: int
    heads: dict[str, Callable[[nnx.Rngs, float], nnx.Module]]
    to_action: Callable[[jax.Array], jax.Array] | None = None
    preprocess: Callable[[jax.Array], jax.Array] | None = None


def tasks() -> list[Task]:
    """CartPole and Pendulum, with settings for thousands of environments.

    A short rollout per environment keeps many updates in the budget; the
    minibatches are 4096 (CartPole) and 2048 (Pendulum) steps at 2048 environments.
    """
    torque = pendulum.torque_scale(pendulum.Config(bijector="tanh"))
    return [
        Task(
            "CartPole-v1",
            cartpole.Config(rollout_length=16, minibatches=8),
            steps=3_000_000,
            obs_size=4,
            heads={
                "samplers": lambda rngs, w: samplers.CategoricalSampler(rngs, w, num_actions=2),
                "hand-written": lambda rngs, w: HandWrittenCategorical(rngs, w, num_actions=2),
            },
        ),
        Task(
            "Pendulum-v1",
            pendulum.Config(bijector="tanh", rollout_length=32, minibatches=32),
            steps=6_000_000,
            obs_size=3,
            heads={
                "samplers": lambda rngs, w: samplers.NormalTanhSampler(rngs, w, action_dim=1),
                "hand-written": lambda rngs, w: HandWrittenNormalTanh(rngs, w, action_dim=1),
            },
            to_action=lambda action: jnp.clip(torque * action, -torque, torque),
            preprocess=_common.scaled,
        ),
    ]


def _setup(task: Task, head: str, config: _ppo.Config):
    """The model, optimizer and environments at the start of a run, as ``_ppo.train`` sets them."""
    _ppo.check_ppo_config(config)
    key = jax.random.key(config.seed)
    head_key, param_key, env_key, runner_key = jax.random.split(key, 4)
    policy_head = task.heads[head](nnx.Rngs(head_key), config.entropy_weight)
    model = _ppo.ActorCritic(
        task.obs_size,
        policy_head,
        hidden=config.hidden,
        rngs=nnx.Rngs(param_key),
        preprocess=task.preprocess,
    )
    iterations = max(1, config.total_steps // (config.num_envs * config.rollout_length))
    optimizer = _ppo.ppo_optimizer(model, config, iterations)
    graphdef, state = nnx.split((model, optimizer))
    env = _ppo.gymnax_env(task.env_id, task.to_action)
    obs, env_state = jax.vmap(env.reset)(jax.random.split(env_key, config.num_envs))
    runner = (env_state, obs, runner_key, jnp.zeros(config.num_envs))
    return graphdef, state, runner, iterations, env


def whole_run(config: _ppo.Config, graphdef, env: _ppo.Env, iterations: int):
    """``(state, runner) -> (state, metrics)``: every iteration of a run, in one jitted scan.

    ``metrics`` holds each iteration's ``episodes``, ``return_sum`` and the two
    replay errors of :func:`samplers.examples._ppo.make_train_step`.
    """
    train_step = _ppo.make_train_step(config, graphdef, env, None)
    kept = ("episodes", "return_sum", "replay_ratio_error", "minibatch_ratio_error")

    def iteration(carry, _):
        state, runner, metrics = train_step(*carry)
        return (state, runner), {name: metrics[name] for name in kept}

    @jax.jit
    def run(state, runner):
        (state, _), metrics = jax.lax.scan(iteration, (state, runner), length=iterations)
        return state, metrics

    return run


def evaluator(env_id: str, to_action, model_def, episodes: int):
    """``(model_state, key) -> returns``: the deterministic policy's ``episodes`` returns.

    Each episode runs from a fresh state to its end or its time limit.
    """
    env = _ppo.gymnax_env(env_id, to_action)
    max_steps = gymnax.make(env_id)[1].max_steps_in_episode

    @jax.jit
    def evaluate(model_state, key):
        reset_key, key = jax.random.split(key)
        obs, env_state = jax.vmap(env.reset)(jax.random.split(reset_key, episodes))

        def step(carry, key):
            model_state, env_state, obs, total, running = carry
            model = nnx.merge(model_def, model_state)
            action = model.policy(obs, deterministic=True).output["action"]
            s = jax.vmap(env.step)(jax.random.split(key, episodes), env_state, action)
            total = total + jnp.where(running, s.reward, 0.0)
            running = running & ~s.done
            return (nnx.state(model), s.state, s.obs, total, running), None

        carry = (model_state, env_state, obs, jnp.zeros(episodes), jnp.ones(episodes, bool))
        (_, _, _, total, _), _ = jax.lax.scan(step, carry, jax.random.split(key, max_steps))
        return total

    return evaluate


def _train(task: Task, num_envs: int, budget: float, seeds, log):
    """Compiles each head's whole run once, then runs the seeds, the heads alternating."""
    steps = max(1, round(task.steps * budget))
    runs = {}
    for head in HEADS:
        config = dataclasses.replace(task.config, num_envs=num_envs, total_steps=steps, seed=0)
        graphdef, state, runner, iterations, env = _setup(task, head, config)
        log(f"compiling {task.env_id}, {head} head, {iterations} iterations of {num_envs} envs")
        start = time.perf_counter()
        compiled = whole_run(config, graphdef, env, iterations).lower(state, runner).compile()
        runs[head] = {"compiled": compiled, "compile_s": time.perf_counter() - start}
        log(f"compiled in {runs[head]['compile_s']:.1f} s")
        runs[head].update(iterations=iterations, graphdef=graphdef, evaluate=None, seeds={})
    for index, seed in enumerate(seeds):
        for head in HEADS if index % 2 == 0 else HEADS[::-1]:
            config = dataclasses.replace(
                task.config, num_envs=num_envs, total_steps=steps, seed=seed
            )
            record = runs[head]["seeds"][seed] = _run_seed(task, head, config, runs[head])
            log(
                f"{task.env_id}, {head} head, seed {seed}: {record['steps_per_second']:,.0f} "
                f"steps/s, evaluation return {record['evaluation_return']:.1f}"
            )
    config = dataclasses.replace(task.config, num_envs=num_envs, total_steps=steps)
    return config, runs


def _run_seed(task: Task, head: str, config: _ppo.Config, entry: dict) -> dict:
    """One timed run of ``entry``'s compiled program from ``config.seed``'s start, evaluated."""
    _, state, runner, _, _ = _setup(task, head, config)
    jax.block_until_ready((state, runner))
    start = time.perf_counter()
    state, metrics = jax.block_until_ready(entry["compiled"](state, runner))
    seconds = time.perf_counter() - start
    model, _ = nnx.merge(entry["graphdef"], state)
    model_def, model_state = nnx.split(model)
    if entry["evaluate"] is None:  # compiled once, for the first seed
        entry["evaluate"] = evaluator(task.env_id, task.to_action, model_def, config.eval_episodes)
    returns = entry["evaluate"](model_state, jax.random.fold_in(jax.random.key(config.seed), 1))
    metrics, returns = jax.device_get((metrics, returns))
    # The last iteration in which episodes ended: at 2048 environments of 16 steps, a
    # CartPole policy at 500 ends none in most iterations.
    ended = [i for i, count in enumerate(metrics["episodes"]) if count]
    last = (
        (metrics["return_sum"][ended[-1]] / metrics["episodes"][ended[-1]]) if ended else math.nan
    )
    steps = entry["iterations"] * config.num_envs * config.rollout_length
    return {
        "seconds": seconds,
        "steps_per_second": steps / seconds,
        "evaluation_return": float(returns.mean()),
        "evaluation_return_std": float(returns.std()),
        "last_training_return": float(last),
        "replay_ratio_error": float(metrics["replay_ratio_error"].max()),
        "minibatch_ratio_error": float(metrics["minibatch_ratio_error"].max()),
    }


def _summary(task: Task, config: _ppo.Config, runs: dict, seeds) -> dict:
    ratios = [
        runs["samplers"]["seeds"][seed]["seconds"] / runs["hand-written"]["seeds"][seed]["seconds"]
        for seed in seeds
    ]
    iterations = runs["samplers"]["iterations"]
    return {
        "environment": task.env_id,
        "num_envs": config.num_envs,
        "rollout_length": config.rollout_length,
        "epochs": config.epochs,
        "minibatches": config.minibatches,
        "iterations": iterations,
        "steps": iterations * config.num_envs * config.rollout_length,
        "time_ratio": {
            "ratio": statistics.median(ratios),
            "low": min(ratios),
            "high": max(ratios),
        },
        "heads": {
            head: {
                "compile_s": runs[head]["compile_s"],
                "median_steps_per_second": statistics.median(
                    runs[head]["seeds"][seed]["steps_per_second"] for seed in seeds
                ),
                "seeds": [{"seed": seed, **runs[head]["seeds"][seed]} for seed in seeds],
            }
            for head in HEADS
        },
    }


def _number(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.1f}"


def _tables(summaries: list[dict], seeds) -> list[str]:
    speed = []
    for s in summaries:
        for head in HEADS:
            entry = s["heads"][head]
            ratio = s["time_ratio"]
            speed.append(
                (
                    s["environment"],
                    head,
                    f"{entry['median_steps_per_second']:,.0f}",
                    ", ".join(f"{r['steps_per_second']:,.0f}" for r in entry["seeds"]),
                    f"{entry['compile_s']:.1f}",
                    f"{ratio['ratio']:.2f} ({ratio['low']:.2f}-{ratio['high']:.2f})"
                    if head == "samplers"
                    else "1",
                )
            )
    returns = []
    for s in summaries:
        for head in HEADS:
            records = s["heads"][head]["seeds"]
            values = [r["evaluation_return"] for r in records]
            returns.append(
                (
                    s["environment"],
                    head,
                    *(f"{v:.1f}" for v in values),
                    f"{statistics.mean(values):.1f}",
                    ", ".join(_number(r["last_training_return"]) for r in records),
                    f"{max(r['replay_ratio_error'] for r in records):.1e}",
                )
            )
    seed_columns = [f"seed {seed}" for seed in seeds]
    return [
        "## Speed",
        "",
        "Environment steps per second of a whole run (its one compiled call, compilation "
        "excluded), median over the seeds and per seed; compilation (trace, lower, compile) "
        "of the run's program, once per environment and head; and the time of a samplers "
        "run over the hand-written run of the same seed (median, min-max over the seeds; "
        "below 1 is faster).",
        "",
        timing.table(
            speed,
            ("environment", "head", "steps/s", "per seed", "compile s", "time / hand-written"),
        ),
        "",
        "## Returns",
        "",
        "Evaluation: the deterministic policy's mean return over the config's "
        "`eval_episodes` episodes, each to its end or time limit (CartPole: at most 500; "
        "Pendulum: 200 steps, a return near -150 is upright). Last training return: the "
        "mean return of the episodes that ended in the last iteration in which any ended, per "
        "seed. Replay: "
        "the largest `|ratio - 1|` before each iteration's first update, over the seeds.",
        "",
        timing.table(
            returns,
            (
                "environment",
                "head",
                *seed_columns,
                "mean",
                "last training return, per seed",
                "replay, largest abs(ratio - 1)",
            ),
        ),
    ]


def run(
    num_envs: int = NUM_ENVS,
    out_dir: Path | str = Path(__file__).parent / "results",
    *,
    device=None,
    name: str = "end_to_end",
    budget: float = 1.0,
    seeds=SEEDS,
    command: str | None = None,
    env_ids=None,
) -> str:
    """Trains every task with both heads for each seed; writes ``{name}.md`` and ``{name}.json``.

    Args:
        num_envs: Environments run side by side.
        out_dir: Folder of the report.
        device: The device to run on (JAX's default when None).
        name: Stem of the report's file names.
        budget: Factor on each task's environment steps per run
            (``Task.steps``: 3M for CartPole, 6M for Pendulum).
        seeds: The seeds, each a run per head.
        command: The command line, for the report.
        env_ids: Only these environments (all when None).

    Returns:
        The report's text.
    """
    device = jax.devices()[0] if device is None else device
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    conditions = timing.Conditions(command or "python -m benchmarks --end-to-end", device)
    chosen = [task for task in tasks() if env_ids is None or task.env_id in env_ids]
    summaries = []
    with jax.default_device(device):
        for task in chosen:
            config, runs = _train(task, num_envs, budget, seeds, print)
            summaries.append(_summary(task, config, runs, seeds))
    conditions.stop()
    settings = "; ".join(
        f"{s['environment']}: {s['steps']:,} steps per run, {s['iterations']} iterations of "
        f"{s['num_envs']} environments x {s['rollout_length']} steps, {s['epochs']} epochs of "
        f"{s['minibatches']} minibatches"
        for s in summaries
    )
    sections = [
        "# PPO end to end: samplers heads against a hand-written head",
        "",
        conditions.line(),
        "",
        "PPO with the examples' trainer (`samplers.examples._ppo.make_train_step`: rollout, "
        "advantages, epochs of minibatch updates), every iteration of a run under one "
        "`lax.scan` in one `jax.jit`: a run is one call of one compiled program. CartPole-v1 "
        "with `samplers.CategoricalSampler` against `log_softmax` and "
        "`jax.random.categorical`; Pendulum-v1 with `samplers.NormalTanhSampler` against "
        "`tanh(mean + std * eps)`, `std = softplus(raw) + 1e-3`, scored with the tanh "
        "log-determinant `2 (log 2 - z - softplus(-2 z))`, torque `2 * action`. The rest of "
        f"the loop is the same code. {settings}; seeds {', '.join(map(str, seeds))}.",
        "",
        *_tables(summaries, seeds),
    ]
    record = {**conditions.record(len(seeds)), "budget": budget, "tasks": summaries}
    return timing.write_report(out_dir, name, sections, record)
