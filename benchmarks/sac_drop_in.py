"""SAC on gymnax ``Pendulum-v1`` as users write it, with a swappable actor distribution.

``python benchmarks/sac_drop_in.py --dist samplers --seeds 0 1 2`` trains soft
actor-critic in the common pure-JAX style: ``flax.linen`` MLPs for the actor and
the twin critics, optax's Adam, Polyak-averaged target critics, a learned
temperature with target entropy ``-action_dim``, a replay buffer of plain arrays,
and the environment steps, buffer writes and updates in one jitted ``lax.scan``.

The actor outputs ``mean, log_std``; ``log_std`` is clipped to ``[-20, 2]`` (the
usual SAC bounds), the action ``a = tanh(x)`` lies in ``[-1, 1]`` and the
environment gets the torque ``2 * a``, the scaling done outside the distribution.
``--dist`` chooses only how ``a`` and ``log pi(a | s)`` are computed
(:func:`sample_and_log_prob`); the rest of the code is the same for all four:

- ``hand-written``: ``x = mean + std * eps``, ``a = tanh(x)`` and the Normal
  log-density of ``x`` minus ``log(1 - tanh(x)**2)`` in its stable form;
- ``distrax``: ``distrax.Transformed(MultivariateNormalDiag, Block(Tanh(), 1))``,
  ``a = dist.sample(seed=k)`` then ``dist.log_prob(a)``: NaN once ``tanh(x)``
  rounds to ``+-1``, which the run records instead of stopping;
- ``samplers``: ``samplers.squashed_normal_from_log_std`` in the same idiom,
  ``dist.sample(seed=k)`` then ``dist.log_prob(a)``;
- ``samplers-pre-image``: ``a, x, logp = dist.sample_with_pre_image(seed=k)``.

``--initial-mean 10`` adds 10 to the actor's mean output, so that training starts
with every ``tanh(x)`` on a bound: a log-probability whose gradient points the wrong
way there keeps the policy saturated. The evaluation acts with ``2 * tanh(mean)``
for every ``--dist``. ``--gradients``
prints, instead of training, the gradient of ``mean(log pi)`` of a fresh sample
with respect to ``mean`` and ``log_std`` under each ``--dist`` against the
float64 pathwise value written out by hand (:func:`log_prob_gradients`).

Results go to ``--out`` (default ``benchmarks/results/sac_drop_in.json``), one
entry per ``--dist`` and initial mean (and ``gradients``); a run replaces only its
own entry.
"""

import argparse
import dataclasses
import json
import math
import pathlib
import time
from collections.abc import Sequence

import distrax
import flax.linen as nn
import gymnax
import jax
import jax.numpy as jnp
import numpy as np
import optax

import samplers

DISTS = ("hand-written", "distrax", "samplers", "samplers-pre-image")
MAX_TORQUE = 2.0
ACTION_DIM = 1
LOG_STD_MIN, LOG_STD_MAX = -20.0, 2.0
# (mean, log_std) of the gradient check. With mean 10 and std 0.05 every float32
# tanh(x) is exactly 1; with std 4.5 about 7% of them are. log_std 2 itself is
# avoided: it is the clip's bound, where jnp.clip passes half the gradient.
GRADIENT_SETTINGS = {"saturated": (10.0, -3.0), "wide": (2.0, 1.5), "moderate": (0.5, -1.0)}
_OBS_SCALE = (1.0, 1.0, 1.0 / 8.0)  # cos, sin, angular velocity in [-8, 8]
_DEFAULT_OUT = pathlib.Path(__file__).resolve().parent / "results" / "sac_drop_in.json"


@dataclasses.dataclass(frozen=True)
class Config:
    """Hyperparameters, those of ``samplers/examples/pendulum_sac.py``.

    ``total_steps`` environment steps of ``num_envs`` environments; the first
    ``warmup_steps`` act uniformly at random and update nothing, then each step of
    all environments is followed by one update on ``batch_size`` transitions.
    """

    total_steps: int = 48_000
    num_envs: int = 8
    warmup_steps: int = 4_000
    batch_size: int = 256
    buffer_size: int = 100_000
    hidden: int = 128
    learning_rate: float = 1e-3
    gamma: float = 0.99
    tau: float = 0.005
    initial_alpha: float = 1.0
    target_entropy: float = -float(ACTION_DIM)
    # Pendulum rewards lie in [-16.3, 0]; a tenth keeps Q near the log-probs' scale.
    reward_scale: float = 0.1
    eval_episodes: int = 32
    # Added to the actor's mean output: 10 starts every tanh(x) on a bound, where a
    # log-probability that points the wrong way would keep it there.
    initial_mean: float = 0.0


def sample_and_log_prob(dist: str, mean, log_std, key):
    """A fresh reparameterised action in ``[-1, 1]`` and its log-probability.

    Args:
        dist: One of :data:`DISTS`.
        mean: Pre-tanh means, shape ``[batch, action]``.
        log_std: Unclipped log standard deviations, the same shape.
        key: A JAX key; every ``dist`` draws ``eps = jax.random.normal(key, mean.shape)``.

    Returns:
        ``(action, log_prob)`` of shapes ``[batch, action]`` and ``[batch]``.
    """
    if dist == "hand-written":
        log_std = jnp.clip(log_std, LOG_STD_MIN, LOG_STD_MAX)
        std = jnp.exp(log_std)
        x = mean + std * jax.random.normal(key, mean.shape)
        # log(1 - tanh(x)^2) in the stable form that Brax's SAC writes by hand and
        # TFP's Tanh bijector (behind the JAX SACs of jaxrl, sbx and CleanRL) computes.
        # log(1 - tanh(x)**2 + 1e-6), common in PyTorch code, is biased near the
        # bounds and has no gradient where tanh(x) rounds to +-1.
        log_det = 2.0 * (math.log(2.0) - x - jax.nn.softplus(-2.0 * x))
        log_prob = jax.scipy.stats.norm.logpdf(x, mean, std) - log_det
        return jnp.tanh(x), log_prob.sum(axis=-1)
    if dist == "distrax":
        std = jnp.exp(jnp.clip(log_std, LOG_STD_MIN, LOG_STD_MAX))
        policy = distrax.Transformed(
            distrax.MultivariateNormalDiag(mean, std), distrax.Block(distrax.Tanh(), 1)
        )
        action = policy.sample(seed=key)
        return action, policy.log_prob(action)
    if dist not in DISTS:
        raise ValueError(f"dist must be one of {DISTS}, got {dist!r}.")
    policy = samplers.squashed_normal_from_log_std(
        mean, log_std, log_std_min=LOG_STD_MIN, log_std_max=LOG_STD_MAX
    )
    if dist == "samplers":
        action = policy.sample(seed=key)
        return action, policy.log_prob(action)
    action, _, log_prob = policy.sample_with_pre_image(seed=key)
    return action, log_prob


def log_prob_gradients(dist: str, mean: float, log_std: float, *, batch: int = 256) -> dict:
    """The gradient of ``mean(log pi)`` of a fresh sample, and its float64 pathwise value.

    ``mean`` and ``log_std`` fill a ``[batch, 1]`` array each; the gradient is with
    respect to these two numbers, in float32 under ``dist``. The reference takes
    the same ``eps`` to float64: per element, with ``x = mean + std * eps``,
    ``log pi = -eps^2 / 2 - log_std - log(2 pi) / 2 - log(1 - tanh(x)^2)``, so
    ``d/dmean = 2 tanh(x)`` and ``d/dlog_std = -1 + 2 tanh(x) std eps``.

    Args:
        dist: One of :data:`DISTS`.
        mean: The pre-tanh mean.
        log_std: The log standard deviation, strictly inside the clip bounds.
        batch: Number of samples.

    Returns:
        ``d_mean``, ``d_log_std`` and ``value`` (``mean(log pi)``), each also as
        ``reference_*``, and ``saturated``: the fraction of actions exactly ``+-1``.

    Raises:
        ValueError: ``log_std`` is not strictly inside ``(LOG_STD_MIN, LOG_STD_MAX)``.
    """
    if not LOG_STD_MIN < log_std < LOG_STD_MAX:
        raise ValueError(
            f"log_std must lie strictly inside ({LOG_STD_MIN}, {LOG_STD_MAX}), got {log_std}; "
            f"on or beyond a bound the clip changes the gradient."
        )
    key = jax.random.key(0)
    shape = (batch, ACTION_DIM)

    def mean_log_prob(m, s):
        action, log_prob = sample_and_log_prob(dist, jnp.full(shape, m), jnp.full(shape, s), key)
        return log_prob.mean(), action

    grad = jax.jit(jax.value_and_grad(mean_log_prob, argnums=(0, 1), has_aux=True))
    (value, action), (d_mean, d_log_std) = grad(jnp.float32(mean), jnp.float32(log_std))
    eps = np.asarray(jax.random.normal(key, shape), np.float64)
    std = math.exp(log_std)
    x = mean + std * eps
    log_det = 2.0 * (math.log(2.0) - x - np.logaddexp(0.0, -2.0 * x))
    log_prob = -0.5 * eps**2 - log_std - 0.5 * math.log(2.0 * math.pi) - log_det
    return {
        "d_mean": float(d_mean),
        "d_log_std": float(d_log_std),
        "value": float(value),
        "reference_d_mean": float(np.mean(np.sum(2.0 * np.tanh(x), -1))),
        "reference_d_log_std": float(np.mean(np.sum(-1.0 + 2.0 * np.tanh(x) * std * eps, -1))),
        "reference_value": float(np.mean(np.sum(log_prob, -1))),
        "saturated": float(jnp.mean(jnp.abs(action) == 1.0)),
    }


class Actor(nn.Module):
    """An MLP from the observation to ``(mean, log_std)``, each ``[batch, action]``."""

    hidden: int
    mean_offset: float = 0.0

    @nn.compact
    def __call__(self, obs):
        """``(mean, log_std)``; ``log_std`` unclipped (the distribution clips it)."""
        h = obs * jnp.broadcast_to(jnp.asarray(_OBS_SCALE), obs.shape)
        h = nn.relu(nn.Dense(self.hidden)(h))
        h = nn.relu(nn.Dense(self.hidden)(h))
        mean, log_std = jnp.split(nn.Dense(2 * ACTION_DIM)(h), 2, axis=-1)
        return mean + self.mean_offset, log_std


class TwinCritic(nn.Module):
    """Two Q-networks on ``(observation, action in [-1, 1])``, each returning ``[batch]``."""

    hidden: int

    @nn.compact
    def __call__(self, obs, action):
        """``(Q1, Q2)``."""
        h = jnp.concatenate(
            [obs * jnp.broadcast_to(jnp.asarray(_OBS_SCALE), obs.shape), action], -1
        )
        qs = []
        for _ in range(2):
            q = nn.relu(nn.Dense(self.hidden)(h))
            q = nn.relu(nn.Dense(self.hidden)(q))
            qs.append(nn.Dense(1)(q)[:, 0])
        return qs[0], qs[1]


def make_train(config: Config, dist: str):
    """``train(key) -> (actor_params, metrics)``: the whole run, one ``lax.scan``.

    ``metrics`` has one entry per step of all environments: the number of
    episodes that ended, the sum of their returns, whether the update's losses
    were finite, ``alpha``, the entropy estimate ``-mean(log pi)``, the fraction
    of the actor loss's actions that are exactly ``+-1`` and the largest ``|mean|``
    of its batch (these five NaN during the warm-up).
    """
    env, env_params = gymnax.make("Pendulum-v1")
    actor, critic = Actor(config.hidden, config.initial_mean), TwinCritic(config.hidden)
    optimizer = optax.adam(config.learning_rate)
    iterations = config.total_steps // config.num_envs
    warmup = config.warmup_steps // config.num_envs

    def policy(params, obs, key):
        return sample_and_log_prob(dist, *actor.apply(params, obs), key)

    def update(state, buffer, key):
        batch_key, next_key, actor_key = jax.random.split(key, 3)
        rows = jax.random.randint(batch_key, (config.batch_size,), 0, buffer["count"])
        obs, action, reward, next_obs = (
            buffer[k][rows] for k in ("obs", "action", "reward", "next_obs")
        )
        alpha = jnp.exp(state["log_alpha"])

        next_action, next_log_prob = policy(state["actor"], next_obs, next_key)
        next_q = jnp.minimum(*critic.apply(state["target"], next_obs, next_action))
        # Pendulum never terminates, only truncates: every target bootstraps.
        y = config.reward_scale * reward + config.gamma * (next_q - alpha * next_log_prob)

        def critic_loss(params):
            q1, q2 = critic.apply(params, obs, action)
            return 0.5 * (jnp.square(q1 - y) + jnp.square(q2 - y)).mean()

        q_loss, grads = jax.value_and_grad(critic_loss)(state["critic"])
        updates, critic_opt = optimizer.update(grads, state["critic_opt"])
        critic_params = optax.apply_updates(state["critic"], updates)

        def actor_loss(params):
            mean, log_std = actor.apply(params, obs)
            new_action, log_prob = sample_and_log_prob(dist, mean, log_std, actor_key)
            q = jnp.minimum(*critic.apply(critic_params, obs, new_action))
            return (alpha * log_prob - q).mean(), (log_prob, new_action, jnp.abs(mean).max())

        (pi_loss, (log_prob, new_action, max_abs_mean)), grads = jax.value_and_grad(
            actor_loss, has_aux=True
        )(state["actor"])
        updates, actor_opt = optimizer.update(grads, state["actor_opt"])
        actor_params = optax.apply_updates(state["actor"], updates)

        def alpha_loss(log_alpha):
            return -(log_alpha * (jax.lax.stop_gradient(log_prob) + config.target_entropy)).mean()

        a_loss, grads = jax.value_and_grad(alpha_loss)(state["log_alpha"])
        updates, alpha_opt = optimizer.update(grads, state["alpha_opt"])
        state = {
            "actor": actor_params,
            "critic": critic_params,
            "target": optax.incremental_update(critic_params, state["target"], config.tau),
            "log_alpha": optax.apply_updates(state["log_alpha"], updates),
            "actor_opt": actor_opt,
            "critic_opt": critic_opt,
            "alpha_opt": alpha_opt,
        }
        finite = jnp.isfinite(q_loss) & jnp.isfinite(pi_loss) & jnp.isfinite(a_loss)
        metrics = {
            "finite": finite.astype(jnp.float32),
            "alpha": alpha,
            "entropy": -log_prob.mean(),
            "saturated": jnp.mean(jnp.abs(new_action) == 1.0),
            "max_abs_mean": max_abs_mean,
        }
        return state, metrics

    def no_update(state, buffer, key):
        return state, dict.fromkeys(
            ("finite", "alpha", "entropy", "saturated", "max_abs_mean"), jnp.float32(jnp.nan)
        )

    def env_step(carry, t):
        state, buffer, env_state, obs, episode_return, key = carry
        key, act_key, random_key, env_key, update_key = jax.random.split(key, 5)
        action, _ = policy(state["actor"], obs, act_key)
        random_action = jax.random.uniform(random_key, action.shape, minval=-1.0, maxval=1.0)
        action = jnp.where(t < warmup, random_action, action)
        env_keys = jax.random.split(env_key, config.num_envs)
        next_obs, env_state, reward, _, done, info = jax.vmap(env.step, in_axes=(0, 0, 0, None))(
            env_keys, env_state, MAX_TORQUE * action, env_params
        )
        rows = (t * config.num_envs + jnp.arange(config.num_envs)) % config.buffer_size
        step = {
            "obs": obs,
            "action": action,
            "reward": reward,
            "next_obs": info["final_observation"],
        }
        buffer = {k: buffer[k].at[rows].set(v) for k, v in step.items()} | {
            "count": jnp.minimum((t + 1) * config.num_envs, config.buffer_size)
        }
        state, metrics = jax.lax.cond(t >= warmup, update, no_update, state, buffer, update_key)
        episode_return = episode_return + reward
        metrics |= {
            "episodes": done.sum(),
            "return_sum": jnp.where(done, episode_return, 0.0).sum(),
        }
        episode_return = jnp.where(done, 0.0, episode_return)
        return (state, buffer, env_state, next_obs, episode_return, key), metrics

    def train(key):
        actor_key, critic_key, env_key, key = jax.random.split(key, 4)
        obs, env_state = jax.vmap(env.reset, in_axes=(0, None))(
            jax.random.split(env_key, config.num_envs), env_params
        )
        actor_params = actor.init(actor_key, obs)
        critic_params = critic.init(critic_key, obs, jnp.zeros((config.num_envs, ACTION_DIM)))
        log_alpha = jnp.asarray(math.log(config.initial_alpha))
        state = {
            "actor": actor_params,
            "critic": critic_params,
            "target": critic_params,
            "log_alpha": log_alpha,
            "actor_opt": optimizer.init(actor_params),
            "critic_opt": optimizer.init(critic_params),
            "alpha_opt": optimizer.init(log_alpha),
        }
        shapes = {"obs": (3,), "action": (ACTION_DIM,), "reward": (), "next_obs": (3,)}
        buffer = {k: jnp.zeros((config.buffer_size, *s)) for k, s in shapes.items()}
        buffer["count"] = jnp.int32(0)
        carry = (state, buffer, env_state, obs, jnp.zeros(config.num_envs), key)
        carry, metrics = jax.lax.scan(env_step, carry, jnp.arange(iterations))
        return carry[0]["actor"], metrics

    return train


def make_evaluate(config: Config):
    """``evaluate(actor_params, key) -> returns``: episodes acting with ``2 * tanh(mean)``."""
    env, env_params = gymnax.make("Pendulum-v1")
    actor = Actor(config.hidden, config.initial_mean)
    n = config.eval_episodes

    def evaluate(actor_params, key):
        reset_key, key = jax.random.split(key)
        obs, env_state = jax.vmap(env.reset, in_axes=(0, None))(
            jax.random.split(reset_key, n), env_params
        )

        def step(carry, step_key):
            env_state, obs, total = carry
            mean, _ = actor.apply(actor_params, obs)
            obs, env_state, reward, *_ = jax.vmap(env.step, in_axes=(0, 0, 0, None))(
                jax.random.split(step_key, n), env_state, MAX_TORQUE * jnp.tanh(mean), env_params
            )
            return (env_state, obs, total + reward), None

        keys = jax.random.split(key, env_params.max_steps_in_episode)
        (_, _, total), _ = jax.lax.scan(step, (env_state, obs, jnp.zeros(n)), keys)
        return total

    return evaluate


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _finite(reduce, x) -> float | None:
    """``reduce`` over the finite entries of ``x``; ``None`` where there are none."""
    x = x[np.isfinite(x)]
    return float(reduce(x)) if x.size else None


def _summary(seed: int, returns, metrics, config: Config, wall_s: float) -> dict:
    """Per-seed results; non-finite returns are written as ``null``."""
    m = {k: np.asarray(v, np.float64) for k, v in metrics.items()}
    warmup = config.warmup_steps // config.num_envs
    bad = np.flatnonzero(m["finite"][warmup:] == 0.0)
    tail = slice(len(m["finite"]) - max(1, (len(m["finite"]) - warmup) // 10), None)
    # A learning curve of 24 points: mean return of the training episodes ended in each.
    chunks = np.array_split(np.arange(len(m["episodes"])), 24)
    ended = [c for c in chunks if m["episodes"][c].sum()]
    curve = [m["return_sum"][c].sum() / m["episodes"][c].sum() for c in ended]
    return {
        "seed": seed,
        "return": _finite_or_none(float(np.mean(returns))),
        "return_std": _finite_or_none(float(np.std(returns))),
        "wall_s": wall_s,
        "first_nonfinite_step": int((warmup + bad[0] + 1) * config.num_envs) if bad.size else None,
        # Of the actor loss's samples, over all updates; alpha and entropy over the last tenth.
        "saturated_fraction_max": _finite(np.max, m["saturated"]),
        "max_abs_mean": _finite(np.max, m["max_abs_mean"]),
        "alpha": _finite(np.mean, m["alpha"][tail]),
        "entropy": _finite(np.mean, m["entropy"][tail]),
        "curve_steps": [int((c[-1] + 1) * config.num_envs) for c in ended],
        "curve_returns": [_finite_or_none(float(r)) for r in curve],
    }


def gradient_table() -> list[dict]:
    """:func:`log_prob_gradients` for every ``--dist`` at each of ``GRADIENT_SETTINGS``.

    Non-finite values (distrax's, where a sample saturates) are ``None``.
    """
    table = []
    for name, (mean, log_std) in GRADIENT_SETTINGS.items():
        for dist in DISTS:
            result = log_prob_gradients(dist, mean, log_std)
            row = {k: _finite_or_none(v) for k, v in result.items()}
            table.append({"dist": dist, "setting": name, "mean": mean, "log_std": log_std} | row)
    return table


def _write(out: pathlib.Path, name: str, entry) -> None:
    results = json.loads(out.read_text()) if out.exists() else {}
    results[name] = entry
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    defaults = Config()
    parser = argparse.ArgumentParser(
        prog="python benchmarks/sac_drop_in.py",
        description="SAC on gymnax Pendulum-v1; --dist chooses only the actor's "
        "distribution and log-probability.",
    )
    parser.add_argument("--dist", choices=DISTS, default="samplers-pre-image")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--total-steps", type=int, default=defaults.total_steps)
    parser.add_argument("--warmup-steps", type=int, default=defaults.warmup_steps)
    parser.add_argument("--num-envs", type=int, default=defaults.num_envs)
    parser.add_argument("--eval-episodes", type=int, default=defaults.eval_episodes)
    parser.add_argument("--reward-scale", type=float, default=defaults.reward_scale)
    parser.add_argument("--target-entropy", type=float, default=defaults.target_entropy)
    parser.add_argument(
        "--initial-mean",
        type=float,
        default=defaults.initial_mean,
        help="added to the actor's mean output (10: start saturated)",
    )
    parser.add_argument("--out", type=pathlib.Path, default=_DEFAULT_OUT)
    parser.add_argument(
        "--gradients",
        action="store_true",
        help="print the gradient check of every --dist instead of training",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict | list[dict]:
    """Trains and evaluates each seed (or, with ``--gradients``, checks gradients).

    Args:
        argv: Command-line arguments (``sys.argv[1:]`` when None).

    Returns:
        The entry written to ``--out``: a dict of the run, or the gradient table.
    """
    args = _parse(argv)
    if not 0 <= args.warmup_steps < args.total_steps:
        raise ValueError(
            f"--warmup-steps must lie in [0, --total-steps), got {args.warmup_steps} and "
            f"{args.total_steps}; lower --warmup-steps."
        )
    if args.gradients:
        table = gradient_table()
        header = ("d/dmean", "float64", "d/dlog_std", "float64", "mean logp", "float64")
        print(f"{'dist':19} {'setting':9} {'sat':>5}" + "".join(f"{h:>11}" for h in header))
        for r in table:
            names = ("d_mean", "d_log_std", "value")
            cells = [r[k] for name in names for k in (name, f"reference_{name}")]
            print(
                f"{r['dist']:19} {r['setting']:9} {r['saturated']:5.2f}"
                + "".join(f"{'nan':>11}" if c is None else f"{c:11.4f}" for c in cells)
            )
        _write(args.out, "gradients", table)
        return table

    config = Config(
        total_steps=args.total_steps,
        warmup_steps=args.warmup_steps,
        num_envs=args.num_envs,
        eval_episodes=args.eval_episodes,
        reward_scale=args.reward_scale,
        target_entropy=args.target_entropy,
        initial_mean=args.initial_mean,
    )
    start = time.perf_counter()
    key = jax.random.key(0)
    train = jax.jit(make_train(config, args.dist)).lower(key).compile()
    actor_params = jax.eval_shape(
        Actor(config.hidden, config.initial_mean).init, key, jnp.zeros((1, 3))
    )
    evaluate = jax.jit(make_evaluate(config)).lower(actor_params, key).compile()
    compile_s = time.perf_counter() - start
    print(
        f"--dist {args.dist}: {config.total_steps:,} steps per seed, compiled in {compile_s:.1f} s"
    )

    runs = []
    for seed in args.seeds:
        start = time.perf_counter()
        actor_params, metrics = train(jax.random.key(seed))
        returns = np.asarray(evaluate(actor_params, jax.random.fold_in(jax.random.key(seed), 1)))
        run = _summary(seed, returns, jax.device_get(metrics), config, time.perf_counter() - start)
        runs.append(run)
        ret = "nan" if run["return"] is None else f"{run['return']:8.1f} +- {run['return_std']:.1f}"
        print(
            f"  seed {seed}: deterministic return {ret} ({config.eval_episodes} episodes), "
            f"{run['wall_s']:.1f} s; first non-finite update at step "
            f"{run['first_nonfinite_step']}; in the actor loss, largest |mean| "
            f"{run['max_abs_mean']:.3g}, largest fraction of actions exactly +-1 "
            f"{run['saturated_fraction_max']:.3g}"
        )
    entry = {
        "dist": args.dist,
        "config": dataclasses.asdict(config),
        "log_std_clip": [LOG_STD_MIN, LOG_STD_MAX],
        "compile_s": compile_s,
        "jax": jax.__version__,
        "runs": runs,
    }
    name = (
        args.dist if not config.initial_mean else f"{args.dist}, initial mean {args.initial_mean:g}"
    )
    _write(args.out, name, entry)
    print(f"  wrote {args.out}")
    return entry


if __name__ == "__main__":
    main()
