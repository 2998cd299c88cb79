"""The examples: their command lines, the PPO trainer and the parts they share, the SAC
losses, and whole runs.

The examples are not the library: all of these tests are in the slow tier
(``python -m pytest tests/examples -m slow``). A whole run compiles a training step
and an evaluation, about ten seconds or more even for a few hundred steps.
"""

import dataclasses
import json
import math
import pathlib
import struct
import subprocess
import sys
import time
import tomllib
import types

import gymnax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import samplers
from samplers.examples import _common, _ppo, cartpole, hybrid, pendulum, pendulum_sac, tictactoe

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).parents[2]
PNG = b"\x89PNG\r\n\x1a\n"


def test_the_packages_setuptools_ships_hold_every_example_module():
    setuptools = pytest.importorskip("setuptools")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    find = config["packages"]["find"]
    # pyproject's packages.find finds namespace packages unless told otherwise.
    finder = (
        setuptools.find_namespace_packages
        if find.get("namespaces", True)
        else setuptools.find_packages
    )
    where = ROOT / find.get("where", ["."])[0]
    include, exclude = find.get("include", ["*"]), find.get("exclude", [])
    packages = finder(str(where), include=include, exclude=exclude)
    assert "samplers.examples" in packages
    # setuptools ships every module of a package it finds.
    modules = {path.name for path in (where / "samplers" / "examples").glob("*.py")}
    expected = {"__init__.py", "_common.py", "pendulum.py", "pendulum_sac.py", "linen_actor.py"}
    expected |= {"_ppo.py", "cartpole.py", "tictactoe.py", "hybrid.py", "correlated.py"}
    expected |= {"units.py", "grpo.py"}
    assert expected <= modules


_EXAMPLES = [
    "pendulum",
    "pendulum_sac",
    "cartpole",
    "linen_actor",
    "tictactoe",
    "hybrid",
    "correlated",
    "units",
    "two_peaks",
    "grpo",
]

# Runs each module as ``python -m`` does (``runpy``, as ``__main__``) with ``--help``, in
# one fresh interpreter, and prints what each wrote and the code it exited with.
_RUN_AS_MAIN = """
import contextlib, io, json, runpy, sys
results = {}
for module in sys.argv[1:]:
    sys.argv = [module, "--help"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_module(f"samplers.examples.{module}", run_name="__main__", alter_sys=True)
            code = None
        except SystemExit as exit:
            code = exit.code
    results[module] = [code, out.getvalue()]
print(json.dumps(results))
"""


def test_each_example_runs_as_a_module():
    done = subprocess.run(
        [sys.executable, "-c", _RUN_AS_MAIN, *_EXAMPLES],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)
    assert set(results) == set(_EXAMPLES)
    for module, (code, stdout) in results.items():
        assert code == 0, (module, code)
        assert stdout.startswith("usage:") and "--seed" in stdout, module


TINY = {
    "--total-steps": ("total_steps", 1024),
    "--num-envs": ("num_envs", 8),
    "--rollout-length": ("rollout_length", 32),
    "--seed": ("seed", 3),
    "--eval-episodes": ("eval_episodes", 4),
}
SAC_TINY = {
    "--total-steps": ("total_steps", 400),
    "--num-envs": ("num_envs", 4),
    "--steps-per-call": ("steps_per_call", 10),
    "--warmup-steps": ("warmup_steps", 200),
    "--hidden": ("hidden", 16),
    "--seed": ("seed", 3),
    "--eval-episodes": ("eval_episodes", 4),
}

CARTPOLE_TINY = {
    "--total-steps": ("total_steps", 1024),
    "--num-envs": ("num_envs", 4),
    "--rollout-length": ("rollout_length", 32),
    "--entropy-weight": ("entropy_weight", 0.05),
    "--seed": ("seed", 3),
    "--eval-episodes": ("eval_episodes", 4),
}

HYBRID_TINY = {
    "--total-steps": ("total_steps", 2048),
    "--num-envs": ("num_envs", 8),
    "--seed": ("seed", 3),
    "--eval-episodes": ("eval_episodes", 8),
}

TICTACTOE_TINY = {
    "--total-steps": ("total_steps", 1024),
    "--num-envs": ("num_envs", 16),
    "--rollout-length": ("rollout_length", 16),
    "--seed": ("seed", 3),
    "--eval-episodes": ("eval_episodes", 256),
}


def _argv(flags: dict) -> list[str]:
    return [str(word) for flag, (_, value) in flags.items() for word in (flag, value)]


@pytest.mark.parametrize(
    ("example", "flags", "out"),
    [
        (pendulum, {**TINY, "--bijector": ("bijector", "identity")}, "pendulum-results"),
        (
            pendulum_sac,
            {**SAC_TINY, "--updates-per-step": ("updates_per_step", 2), "--head": ("head", "flow")},
            "pendulum-sac-results",
        ),
        (cartpole, CARTPOLE_TINY, "cartpole-results"),
        (tictactoe, TICTACTOE_TINY, "tictactoe-results"),
        (hybrid, HYBRID_TINY, "hybrid-results"),
        (pendulum, {**TINY, "--head": ("head", "beta")}, "pendulum-results"),
    ],
    ids=["pendulum", "pendulum_sac", "cartpole", "tictactoe", "hybrid", "pendulum-beta"],
)
def test_the_command_line_defaults_to_the_config_and_each_flag_sets_its_field(example, flags, out):
    config, args = example.parse_args([])
    assert config == example.Config()
    assert args.out == pathlib.Path(out) and not args.no_progress

    config, args = example.parse_args([*_argv(flags), "--out", "elsewhere", "--no-progress"])
    fields = dict(flags.values())
    assert all(getattr(example.Config(), name) != value for name, value in fields.items())
    assert config == dataclasses.replace(example.Config(), **fields)
    assert args.out == pathlib.Path("elsewhere") and args.no_progress


def test_pendulum_refuses_an_unknown_bijector(capsys):
    with pytest.raises(SystemExit):
        pendulum.parse_args(["--bijector", "sigmoid"])
    assert "invalid choice: 'sigmoid'" in capsys.readouterr().err


def test_pendulum_refuses_a_batch_that_minibatches_do_not_divide(tmp_path):
    with pytest.raises(ValueError, match=r"divisible by minibatches=8, got 3 \* 30 = 90"):
        pendulum.main(["--num-envs", "3", "--rollout-length", "30", "--out", str(tmp_path)])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_envs": 0}, r"num_envs must be >= 1, got 0"),
        ({"batch_size": 0}, r"batch_size must be >= 1, got 0"),
        ({"warmup_steps": -1}, r"warmup_steps must be >= 0, got -1"),
        ({"buffer_size": 4}, r"got buffer_size=4 < num_envs=8; raise buffer_size"),
        ({"head": "gaussian"}, r"head must be 'normal' or 'flow', got 'gaussian'"),
    ],
    ids=["num_envs", "batch_size", "warmup_steps", "buffer_size", "head"],
)
def test_pendulum_sac_refuses_a_bad_config(overrides, message):
    with pytest.raises(ValueError, match=message):
        pendulum_sac.train(pendulum_sac.Config(**overrides), progress=False)


def test_run_keeps_every_call_and_the_mean_return_of_the_calls_where_episodes_ended(capsys):
    @jax.jit
    def train_step(state, runner):
        state = state + 1
        # Two episodes end on every second call, each with return -100 * state.
        episodes = jnp.where(state % 2 == 0, 2, 0)
        metrics = {"episodes": episodes, "return_sum": -100.0 * state * episodes, "sigma": state}
        return state, runner, metrics

    run = _common.run(
        train_step,
        jnp.int32(0),
        (),
        calls=5,
        steps_per_call=10,
        label="TEST",
        column=("std", lambda metrics: f"{metrics['sigma']:.3f}"),
        progress=True,
    )
    assert int(run.state) == 5
    assert [metrics["sigma"] for metrics in run.history] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert run.curve_steps == [20, 40]
    assert run.curve_returns == [-200.0, -400.0]
    assert run.compile_s > 0 and run.train_s > 0
    bar = capsys.readouterr().out
    assert "TEST" in bar and "50/50" in bar and "std 5.000" in bar


def test_first_step_at_is_the_first_point_of_the_curve_at_or_above_the_threshold():
    log = {"curve_steps": [10, 20, 30], "curve_returns": [-900.0, -200.0, -100.0]}
    assert _common.first_step_at(log, -200.0) == 20
    assert _common.first_step_at(log, -150.0) == 30
    assert _common.first_step_at(log, -50.0) is None


def test_largest_is_the_maximum_and_zero_unless_a_value_is_nan():
    assert _ppo.largest([1e-7, 3e-7, 2e-7]) == 3e-7
    assert _ppo.largest(iter([-1.0])) == 0.0
    assert math.isnan(_ppo.largest([1e-7, math.nan, 3e-7]))
    assert math.isnan(_ppo.largest([math.nan, 1e-7]))


@pytest.mark.parametrize("example", [pendulum, cartpole, tictactoe, hybrid])
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"minibatches": 0}, r"minibatches must be >= 1, got 0\."),
        (
            {"num_envs": 3, "rollout_length": 30, "minibatches": 4},
            r"divisible by minibatches=4, got 3 \* 30 = 90; pick a multiple of 4 for num_envs\.",
        ),
    ],
    ids=["minibatches", "divisible"],
)
def test_each_ppo_example_refuses_a_config_before_it_trains(example, overrides, message):
    config = dataclasses.replace(example.Config(), **overrides)
    with pytest.raises(ValueError, match=message):
        example.train(config, progress=False)


def test_tanh_mlp_starts_orthogonal_with_zero_biases_and_its_outputs_within_the_bound():
    net = _ppo.tanh_mlp(8, 8, hidden=8, last_scale=0.01, rngs=nnx.Rngs(0))
    layers = (net.layers[0], net.layers[2], net.layers[4])
    assert net.layers[1] is nnx.tanh and net.layers[3] is nnx.tanh
    for layer, scale in zip(layers, (math.sqrt(2), math.sqrt(2), 0.01), strict=True):
        kernel = np.asarray(layer.kernel[...], np.float64)
        np.testing.assert_allclose(kernel.T @ kernel, scale**2 * np.eye(8), atol=1e-6 * scale**2)
        assert not np.asarray(layer.bias[...]).any()
    obs = 100.0 * jax.random.normal(jax.random.key(1), (256, 8))
    assert float(jnp.abs(net(obs)).max()) <= 0.01 * math.sqrt(8) * (1 + 1e-6)


def test_ppo_loss_and_its_gradients_are_the_clipped_objective_computed_in_float64():
    config = types.SimpleNamespace(clip_epsilon=0.2, value_weight=0.5)
    n = 16
    rng = np.random.default_rng(0)
    log_prob, advantage, value, target, regularization = rng.normal(size=(5, n)).astype(np.float32)
    # Ratios from 0.5 to 1.6: below, inside and above [0.8, 1.2], none on a bound.
    log_likelihood = log_prob + np.log(np.linspace(0.5, 1.6, n, dtype=np.float32))
    batch = {"log_prob": log_prob, "advantage": advantage, "target": target}

    @jax.jit
    def loss_and_grads(log_likelihood, value, regularization, batch):
        def loss(log_likelihood, value):
            out = samplers.StatefulModuleOutput(
                (), {"log_likelihood": log_likelihood}, regularization, {}
            )
            return _ppo.ppo_loss(out, value, batch, config)

        return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(log_likelihood, value)

    (loss, metrics), (d_log_likelihood, d_value) = loss_and_grads(
        log_likelihood, value, regularization, batch
    )

    log_ratio = np.float64(log_likelihood) - np.float64(log_prob)
    ratio = np.exp(log_ratio)
    a = np.float64(advantage)
    a = (a - a.mean()) / (a.std() + 1e-8)
    unclipped, clipped = ratio * a, np.clip(ratio, 0.8, 1.2) * a
    expected = {
        "policy_loss": -np.minimum(unclipped, clipped).mean(),
        "value_loss": 0.5 * np.mean((np.float64(value) - np.float64(target)) ** 2),
        "entropy_loss": np.float64(regularization).mean(),
        "approx_kl": np.mean((ratio - 1.0) - log_ratio),
        "clip_fraction": np.mean(np.abs(ratio - 1.0) > 0.2),
    }
    assert 0 < expected["clip_fraction"] < 1
    assert metrics.keys() == expected.keys()
    for name, want in expected.items():
        assert float(metrics[name]) == pytest.approx(want, rel=1e-5, abs=1e-6), name
    total = expected["policy_loss"] + 0.5 * expected["value_loss"] + expected["entropy_loss"]
    assert float(loss) == pytest.approx(total, rel=1e-5, abs=1e-6)
    # The ratio gets a gradient where the unclipped term is the smaller (inside the
    # range the two are equal), -ratio * A / n; where the clipped one is, none.
    want = np.where(unclipped <= clipped, -ratio * a / n, 0.0)
    assert (want == 0.0).any() and (want != 0.0).any()
    np.testing.assert_allclose(d_log_likelihood, want, rtol=1e-5, atol=1e-7)
    want = 0.5 * (np.float64(value) - np.float64(target)) / n
    np.testing.assert_allclose(d_value, want, rtol=1e-5, atol=1e-7)


class _TwoScalars(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.zeros(()))
        self.v = nnx.Param(jnp.zeros(()))


def test_update_epochs_steps_on_every_row_once_a_pass_and_logs_the_last_pass():
    config = types.SimpleNamespace(epochs=3, minibatches=4)
    model = _TwoScalars()
    graphdef, state = nnx.split((model, nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param)))
    x = np.random.default_rng(0).normal(size=16).astype(np.float32)

    def loss_fn(model, minibatch):
        # d/dw is the minibatch's mean of x; d/dv is 1, so v counts the steps.
        return (model.w * minibatch["x"]).mean() + model.v, {"v": model.v[...]}

    @jax.jit
    def update(state, batch, key):
        return _ppo.update_epochs(loss_fn, graphdef, state, batch, key, config)

    state, metrics = update(state, {"x": x}, jax.random.key(1))
    model, _ = nnx.merge(graphdef, state)
    # 12 steps of 0.5; in the last pass v was -4, -4.5, -5 and -5.5 before its steps.
    assert float(model.v[...]) == -6.0
    assert float(metrics["v"]) == -4.75
    # Each pass's 4 minibatch means sum to 4 mean(x) only if every row is in one of them.
    assert float(model.w[...]) == pytest.approx(-0.5 * 3 * 4 * float(x.mean()), rel=1e-5)


def test_ppo_optimizer_clips_the_gradient_and_its_rate_falls_to_zero_over_the_run():
    config = types.SimpleNamespace(learning_rate=1.0, max_grad_norm=5e-5, epochs=1, minibatches=2)
    model = _TwoScalars()
    optimizer = _ppo.ppo_optimizer(model, config, iterations=1)

    @nnx.jit
    def step(model, optimizer):
        # A gradient of global norm 50, clipped to (3e-5, 4e-5).
        optimizer.update(model, nnx.grad(lambda model: 30.0 * model.w + 40.0 * model.v)(model))

    params = []
    for _ in range(3):
        step(model, optimizer)
        params.append((float(model.w[...]), float(model.v[...])))
    # Adam moves each parameter by rate * g / (|g| + 1e-5) under a constant gradient
    # (up to the rounding of its float32 constants), the rate 1, then 0.5, then 0: the
    # run is 2 updates. Unclipped, g / (|g| + 1e-5) would be 30 / 30.00001 ~ 1.
    unit = np.array([0.75, 0.8])
    np.testing.assert_allclose(params, -np.outer([1.0, 1.5, 1.5], unit), rtol=1e-4)


def _gae_by_sums(reward, value, next_value, done, terminated, gamma, gae_lambda):
    """Each advantage as ``sum_k (gamma lambda)^k delta_{t+k}`` up to its episode's end, float64."""
    delta = reward + gamma * (1.0 - terminated) * next_value - value
    steps, envs = reward.shape
    advantage = np.zeros((steps, envs))
    for n in range(envs):
        for t in range(steps):
            for k in range(steps - t):
                advantage[t, n] += (gamma * gae_lambda) ** k * delta[t + k, n]
                if done[t + k, n]:
                    break
    return advantage


def test_gae_sums_the_discounted_errors_to_the_episodes_end_and_bootstraps_at_a_time_limit():
    rng = np.random.default_rng(0)
    reward, value, next_value = rng.normal(size=(3, 7, 3)).astype(np.float32)
    done, terminated = np.zeros((2, 7, 3), bool)
    # Environment 0 never ends; 1 terminates at step 2 and is cut by a time limit at 5;
    # 2 terminates at the last step.
    done[[2, 5], 1] = terminated[2, 1] = True
    done[6, 2] = terminated[6, 2] = True
    gae = jax.jit(_ppo.gae, static_argnums=(5, 6))
    got = gae(reward, value, next_value, done, terminated, 0.9, 0.8)

    r, v, nv = (np.float64(x) for x in (reward, value, next_value))
    want = _gae_by_sums(r, v, nv, done, np.float64(terminated), 0.9, 0.8)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # The last step of an episode is its own error: bootstrapped at the time limit,
    # not at the termination.
    assert want[5, 1] == r[5, 1] + 0.9 * nv[5, 1] - v[5, 1]
    assert want[2, 1] == r[2, 1] - v[2, 1]


def test_actor_critic_feeds_both_networks_the_preprocessed_observation_and_the_head_the_mask():
    head = samplers.CategoricalSampler(nnx.Rngs(0), 0.0, num_actions=3)
    model = _ppo.ActorCritic(2, head, hidden=8, rngs=nnx.Rngs(1), preprocess=lambda x: 3.0 * x)
    obs = jax.random.normal(jax.random.key(2), (6, 2))
    np.testing.assert_array_equal(model.value(obs), model.critic(3.0 * obs)[:, 0])

    logits = np.float64(model.actor(3.0 * obs))
    greedy = logits.argmax(axis=-1)
    assert np.array_equal(model.policy(obs, deterministic=True).output["action"], greedy)
    # Forbid each state's most probable action: the head acts among the other two.
    mask = np.arange(3) != greedy[:, None]
    out = model.policy(obs, mask=jnp.asarray(mask))
    action = np.asarray(out.output["action"])
    assert mask[np.arange(6), action].all()
    allowed = np.where(mask, logits, -np.inf)
    log_softmax = allowed - np.log(np.exp(allowed).sum(axis=-1, keepdims=True))
    replay = model.policy(obs, out.rollout_extras, mask=jnp.asarray(mask))
    np.testing.assert_allclose(
        replay.output["log_likelihood"], log_softmax[np.arange(6), action], rtol=1e-5
    )


def test_gymnax_env_applies_the_action_map_and_ends_at_the_time_limit_without_terminating():
    env = _ppo.gymnax_env("Pendulum-v1", lambda action: 2.0 * action)
    gym, params = gymnax.make("Pendulum-v1")
    _, state = env.reset(jax.random.key(0))
    state = state.replace(time=params.max_steps_in_episode - 1)
    step = jax.jit(env.step)(jax.random.key(1), state, jnp.array([0.25]))
    obs, _, reward, _, _, info = gym.step(jax.random.key(1), state, jnp.array([0.5]), params)
    assert bool(step.done) and not bool(step.terminated)
    assert float(step.reward) == pytest.approx(float(reward), rel=1e-6)
    # The value bootstraps from where the episode stopped, not from the next one's start.
    np.testing.assert_allclose(step.final_obs, info["final_observation"], rtol=1e-6)
    np.testing.assert_allclose(step.obs, obs, rtol=1e-6)
    assert not np.allclose(step.obs, step.final_obs)


def _clock(length: int) -> _ppo.Env:
    """Episodes of ``length`` steps that earn 1 each; the observation is the time, and
    the mask allows only action 0 (the step counts the forbidden action 1)."""

    def reset(key):
        return jnp.zeros(1), jnp.int32(0)

    def step(key, time, action):
        time = time + 1
        done = time == length
        after = jnp.where(done, 0, time)
        obs, final_obs = (jnp.full(1, t, jnp.float32) for t in (after, time))
        counts = {"ends": done, "forbidden": action == 1}
        return _ppo.Step(after, obs, jnp.float32(1.0), done, done, final_obs, counts)

    return _ppo.Env(reset, step, mask=lambda time: jnp.array([True, False]))


def test_train_counts_episodes_returns_and_metrics_and_replays_under_the_stored_mask():
    config = _ppo.Config(total_steps=24, num_envs=2, rollout_length=4, epochs=2, hidden=8)

    def make_model(sampling_rngs, rngs):
        head = samplers.CategoricalSampler(sampling_rngs, 0.01, num_actions=2)
        return _ppo.ActorCritic(1, head, hidden=config.hidden, rngs=rngs)

    _, log = _ppo.train(
        config,
        make_model,
        _clock(3),
        column=("time", lambda metrics: f"{metrics['time']:.2f}"),
        rollout_metrics=lambda model, obs, out: {"time": obs[:, 0]},
        progress=False,
    )
    per_iteration = log["per_iteration"]
    # 3 iterations of 4 steps: episodes end at steps 3, 6, 9 and 12, in both environments.
    assert log["iterations"] == 3 and log["iteration_steps"] == [8, 16, 24]
    assert per_iteration["ends"] == per_iteration["episodes"] == [2.0, 2.0, 4.0]
    assert per_iteration["return_sum"] == [6.0, 6.0, 12.0]
    assert log["curve_steps"] == [8, 16, 24] and log["curve_returns"] == [3.0, 3.0, 3.0]
    # The observed times are 0 1 2 0 | 1 2 0 1 | 2 0 1 2.
    assert per_iteration["time"] == [0.75, 1.0, 1.25]
    assert per_iteration["forbidden"] == [0.0, 0.0, 0.0]
    # The one allowed action has probability 1 under any weights, so the ratio is 1
    # exactly in every update; a loss that dropped the stored mask would score it
    # about 1/2 and clip it.
    assert per_iteration["clip_fraction"] == per_iteration["approx_kl"] == [0.0, 0.0, 0.0]
    assert log["replay_ratio_error"] == log["minibatch_ratio_error"] == 0.0


class _ConstantPolicy(nnx.Module):
    """A head on the same ``[mean | raw_std]`` in every state."""

    def __init__(self, mean: float, raw_std: float):
        self.params = (mean, raw_std)
        self.head = samplers.SquashedNormalSampler(
            nnx.Rngs(0), 0.0, bijector=samplers.BoundedTanh(-2.0, 2.0)
        )

    def __call__(self, obs):
        return self.head((), jnp.broadcast_to(jnp.array(self.params), (*obs.shape[:-1], 2)))


def test_evaluate_plays_f_of_the_mean_and_leaves_the_module_training():
    # A std of softplus(5) ~ 5 saturates the samples at +-2: sampling would not be
    # the constant torque 2 tanh(0.3).
    policy = _ConstantPolicy(0.3, 5.0)
    returns = _common.evaluate(
        policy, lambda policy, obs: policy(obs).output["action"], num_episodes=4, seed=0
    )

    def constant(_, obs):
        return samplers.BoundedTanh(-2.0, 2.0).forward(jnp.full((*obs.shape[:-1], 1), 0.3))

    expected = _common.evaluate(policy, constant, num_episodes=4, seed=0)
    assert returns["deterministic_return"] == pytest.approx(
        expected["deterministic_return"], rel=1e-4
    )
    assert returns["random_return"] == expected["random_return"]
    assert returns["random_return"] != returns["deterministic_return"]
    # An episode lasts 200 steps: every return lies in [-16.3 * 200, 0].
    assert -16.3 * 200 <= returns["random_return"] <= 0
    assert policy.head.deterministic is False


def test_action_distributions_are_the_same_torques_whichever_factor_scales_them():
    def network(obs):
        return jnp.stack([obs[1] + 0.5, obs[0]])

    bounded = samplers.SquashedNormalSampler(
        nnx.Rngs(0), 0.0, bijector=samplers.BoundedTanh(-2.0, 2.0)
    )
    doubled = samplers.NormalTanhSampler(nnx.Rngs(0), 0.0)
    options = {"num_samples": 2_000, "grid": 401}
    torques = _common.action_distributions(network, bounded, **options)
    scaled = _common.action_distributions(network, doubled, 2.0, **options)

    assert len(torques) == len(_common.PROBE_STATES)
    for one, other in zip(torques, scaled, strict=True):
        np.testing.assert_allclose(one["torque"], other["torque"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(one["density"], other["density"], rtol=1e-4)
        assert np.trapezoid(one["density"], one["torque"]) == pytest.approx(1.0, abs=1e-3)
        assert np.all(np.abs(one["samples"]) <= 2.0)
        mean = math.sin(one["state"][0]) + 0.5
        assert one["deterministic"] == pytest.approx(2.0 * math.tanh(mean), rel=1e-5)
        assert other["deterministic"] == pytest.approx(one["deterministic"], rel=1e-5)


def test_plot_writes_a_png_of_the_curve_and_one_panel_per_state(tmp_path):
    rng = np.random.default_rng(0)
    torque = np.linspace(-2.0, 2.0, 101)
    distributions = [
        {
            "state": state,
            "samples": np.clip(rng.normal(size=500), -2.0, 2.0),
            "torque": torque,
            "density": np.exp(-0.5 * torque**2) / math.sqrt(2 * math.pi),
            "deterministic": 0.0,
        }
        for state in _common.PROBE_STATES
    ]
    summary = {
        "curve_steps": [100, 200, 300],
        "curve_returns": [-1200.0, -800.0, -300.0],
        "deterministic_return": -250.0,
        "random_return": -1200.0,
    }
    figure = tmp_path / "new" / "figure.png"
    _common.plot(figure, summary, distributions, title="(a) test", warmup_steps=150)
    data = figure.read_bytes()
    assert data[:8] == PNG
    # 16 x 4 inches at 100 dpi.
    assert struct.unpack(">II", data[16:24]) == (1600, 400)


def test_finish_writes_the_summary_beside_the_figure_and_prints_it(tmp_path, capsys):
    summary = {
        "config": {"eval_episodes": 4},
        "deterministic_return": -150.25,
        "deterministic_return_std": 10.0,
        "random_return": -1200.0,
        "random_return_std": 300.0,
        "compile_s": 1.5,
        "steps_per_second": 12345.6,
    }
    figure = tmp_path / "figure.png"
    _common.finish(summary, figure, time.perf_counter(), header="Header", details=["detail"])

    written = json.loads((tmp_path / "summary.json").read_text())
    assert written == summary
    assert written["figure"] == str(figure) and 0 <= written["wall_s"] < 60
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "Header"
    assert lines[1] == "  deterministic policy:   -150.2 +- 10.0 per episode (4 episodes)"
    assert lines[2] == "  uniform random:        -1200.0 +- 300.0 per episode (same initial states)"
    assert lines[3].startswith("  wall time ") and lines[3].endswith(
        "s (compile 1.5 s), 12,346 steps/s while training"
    )
    assert lines[4:] == ["  detail", f"  wrote {figure} and {tmp_path / 'summary.json'}"]


def test_pendulum_sac_actor_gradient_reaches_the_network_through_the_sampled_torque():
    actor = pendulum_sac.Actor(16, nnx.Rngs(0), nnx.Rngs(1))
    critic = pendulum_sac.TwinCritic(16, nnx.Rngs(2))
    theta = jnp.linspace(-3.0, 3.0, 32)
    obs = jnp.stack([jnp.cos(theta), jnp.sin(theta), jnp.zeros_like(theta)], axis=-1)

    @nnx.jit
    @nnx.grad
    def critic_term(actor):
        # The example's actor loss at alpha = 0, -min_i Q_i(s, a): only dQ/da can
        # carry a gradient to the actor.
        return pendulum_sac.actor_loss(actor, critic, 0.0, obs)[0]

    def largest(grads):
        return max(float(jnp.abs(leaf).max()) for leaf in jax.tree.leaves(grads))

    assert largest(critic_term(actor)) > 1e-4
    # The default (PPO) head stops the gradient at a fresh sample: the same loss
    # would give the actor nothing to climb the critic with.
    actor.head = samplers.SquashedNormalSampler(
        nnx.Rngs(1), 0.0, bijector=samplers.BoundedTanh(-2.0, 2.0)
    )
    assert largest(critic_term(actor)) == 0.0


def test_pendulum_sac_stores_the_observation_before_the_reset_and_not_the_time_limit():
    env, params = gymnax.make("Pendulum-v1")

    # One program, compiled once, as the example's training step runs it.
    @jax.jit
    def last_step(torque):
        obs, state = env.reset(jax.random.key(0), params)
        state = state.replace(time=params.max_steps_in_episode - 1)
        next_obs, _, reward, _, _, info = env.step(jax.random.key(1), state, torque, params)
        return next_obs, info, pendulum_sac.transitions(obs, torque, reward, info)

    next_obs, info, stored = last_step(jnp.array([0.5]))
    # The step hit the time limit, so gymnax returned the next episode's first observation.
    assert bool(info["truncated"]) and not np.allclose(next_obs, info["final_observation"])
    assert np.array_equal(stored["next_obs"], info["final_observation"])
    assert stored["terminated"] == 0.0


def test_pendulum_sac_critic_loss_is_the_soft_bellman_error_cut_only_at_terminal_states():
    config = pendulum_sac.Config()
    actor = pendulum_sac.Actor(16, nnx.Rngs(0), nnx.Rngs(1))
    critic = pendulum_sac.TwinCritic(16, nnx.Rngs(2))
    target = pendulum_sac.TwinCritic(16, nnx.Rngs(3))
    keys = jax.random.split(jax.random.key(4), 4)
    batch = {
        "obs": jax.random.normal(keys[0], (8, 3)),
        "torque": jax.random.uniform(keys[1], (8, 1), minval=-2.0, maxval=2.0),
        "reward": jax.random.uniform(keys[2], (8,), minval=-16.0, maxval=0.0),
        "next_obs": jax.random.normal(keys[3], (8, 3)),
        "terminated": jnp.array([1.0, 0.0] * 4),
    }
    alpha = 0.3

    @nnx.jit
    def expected(actor, critic, target, batch):
        # A copy of the actor continues the same stream: it draws the loss's next torques.
        next_action = nnx.clone(actor)(batch["next_obs"]).output
        next_q = jnp.minimum(*target(batch["next_obs"], next_action["action"]))
        soft_value = next_q - alpha * next_action["log_likelihood"]
        reward = config.reward_scale * batch["reward"]
        y = reward + config.gamma * jnp.array([0.0, 1.0] * 4) * soft_value
        q1, q2 = critic(batch["obs"], batch["torque"])
        loss = 0.5 * (jnp.square(q1 - y) + jnp.square(q2 - y)).mean()
        no_bootstrap = 0.5 * (jnp.square(q1 - reward) + jnp.square(q2 - reward)).mean()
        return loss, no_bootstrap

    want, no_bootstrap = expected(actor, critic, target, batch)
    critic_loss = nnx.jit(pendulum_sac.critic_loss, static_argnums=5)
    loss, _ = critic_loss(critic, target, actor, alpha, batch, config)
    assert jnp.allclose(loss, want, rtol=1e-6, atol=0.0)
    # Bootstrapping matters on the non-terminal rows: the loss without it differs.
    assert not jnp.allclose(loss, no_bootstrap, rtol=1e-3)


@pytest.mark.parametrize(
    ("flags", "replay_error"),
    [
        *((["--bijector", bijector], 0.0) for bijector in pendulum.BIJECTORS),
        (["--head", "beta"], 1e-6),
    ],
    ids=[*pendulum.BIJECTORS, "beta"],
)
def test_pendulum_runs_writes_its_figure_and_replays_with_ratio_one(tmp_path, flags, replay_error):
    summary = pendulum.main([*_argv(TINY), *flags, "--out", str(tmp_path), "--no-progress"])

    figure = tmp_path / "pendulum.png"
    assert figure.read_bytes()[:8] == PNG
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 1024
    assert summary["iterations"] == 4
    # Before the first update of each iteration the weights are the rollout's, so
    # replaying the stored pre-images must reproduce the stored log-likelihoods, in
    # the rollout's shapes exactly for the squashed Normals; the Beta's log-density,
    # compiled into another program than the rollout's, may round apart (4.8e-7 over
    # the default run's 122 iterations).
    assert summary["replay_ratio_error"] <= replay_error
    assert summary["minibatch_ratio_error"] < 1e-5
    # An episode lasts 200 steps: every return lies in [-16.3 * 200, 0].
    for name in ("deterministic_return", "random_return"):
        assert -3300 < summary[name] <= 0, name
    assert summary["final_sigma"] > 0 and summary["steps_per_second"] > 0


def test_pendulum_sac_runs_writes_its_figure_and_learns_the_temperature(tmp_path):
    summary = pendulum_sac.main([*_argv(SAC_TINY), "--out", str(tmp_path), "--no-progress"])

    figure = tmp_path / "pendulum_sac.png"
    assert figure.read_bytes()[:8] == PNG
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["steps"] == 400 and written["figure"] == str(figure)
    for name in ("deterministic", "random"):
        assert math.isfinite(written[f"{name}_return"] + written[f"{name}_return_std"]), name
    assert written["config"]["warmup_steps"] == 200 and written["steps_per_second"] > 0
    # 10 calls of 10 steps of 4 environments; the first 200 environment steps
    # (50 steps of all environments) take random torques and update nothing.
    assert summary["calls"] == 10
    assert summary["updates"] == 50
    last = summary["last_update"]
    assert all(math.isfinite(value) for value in last.values()), last
    # The policy starts far above the target entropy of -1, so alpha falls from 1.
    assert 0 < last["alpha"] < 1.0
    # An episode lasts 200 steps: every return lies in [-16.3 * 200, 0].
    for name in ("deterministic_return", "random_return"):
        assert -16.3 * 200 <= summary[name] <= 0, name


def test_pendulum_sac_runs_with_the_flow_head_and_plots_its_torques(tmp_path):
    argv = [*_argv(SAC_TINY), "--head", "flow", "--out", str(tmp_path), "--no-progress"]
    summary = pendulum_sac.main(argv)
    assert (tmp_path / "pendulum_sac.png").read_bytes()[:8] == PNG
    assert summary["config"]["head"] == "flow"
    assert all(math.isfinite(value) for value in summary["last_update"].values())
    for name in ("deterministic_return", "random_return"):
        assert -16.3 * 200 <= summary[name] <= 0, name
    # The flow head's torques, and their density on the grid, lie within the bounds.
    actor = pendulum_sac.Actor(16, nnx.Rngs(0), nnx.Rngs(1), "flow")
    assert isinstance(actor.head, samplers.FlowSampler)
    (panel, *_) = _common.action_distributions(actor.head_inputs, actor.head, grid=101)
    assert np.all(np.abs(panel["torque"]) <= 2.0) and np.all(np.abs(panel["samples"]) <= 2.0)
    assert np.all(np.isfinite(panel["density"])) and np.all(np.diff(panel["torque"]) >= 0)


def _tictactoe_outcomes_of_random_play() -> dict[str, float]:
    """Exact win/draw/loss probabilities of a uniformly random legal player against
    another, first mover drawn fairly, by recursion over the boards (pure Python)."""
    lines = [(0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8)]
    lines.append((2, 4, 6))
    memo = {}

    def first_mover(board):  # (win, draw, loss) of the player who moved first, "x"
        if board not in memo:
            if any(board[a] == board[b] == board[c] != "." for a, b, c in lines):
                # The player who just moved won.
                x_moved_last = board.count("x") > board.count("o")
                memo[board] = (1.0, 0.0, 0.0) if x_moved_last else (0.0, 0.0, 1.0)
            elif "." not in board:
                memo[board] = (0.0, 1.0, 0.0)
            else:
                mark = "x" if board.count("x") == board.count("o") else "o"
                free = [i for i, cell in enumerate(board) if cell == "."]
                after = [first_mover(board[:i] + mark + board[i + 1 :]) for i in free]
                memo[board] = tuple(sum(part) / len(free) for part in zip(*after, strict=True))
        return memo[board]

    win, draw, loss = first_mover("." * 9)
    # The agent moves first in half the games: its wins are then the first mover's.
    return {"win": (win + loss) / 2, "draw": draw, "loss": (loss + win) / 2}


def test_tictactoe_random_play_against_the_opponent_matches_the_exact_outcomes():
    exact = _tictactoe_outcomes_of_random_play()
    # The known figures of random play: the first mover wins 58.5%, draws 12.7%.
    assert exact["draw"] == pytest.approx(0.127, abs=5e-4)

    @jax.jit
    def games(key):
        def act(carry, obs, legal, key):
            return carry, tictactoe.opponent_move(key, legal)

        return tictactoe._games(act, (), key, 20_000)

    total, lost_illegal, over = jax.device_get(games(jax.random.key(0)))
    assert over.all() and not lost_illegal.any()
    # 20,000 games: a rate's standard error is below 0.0036.
    assert np.mean(total == 1.0) == pytest.approx(exact["win"], abs=0.015)
    assert np.mean(total == 0.0) == pytest.approx(exact["draw"], abs=0.01)
    assert np.mean(total == -1.0) == pytest.approx(exact["loss"], abs=0.015)


def test_tictactoe_opponent_draws_uniformly_among_the_legal_cells_only():
    keys = jax.random.split(jax.random.key(0), 30_000)
    legal = jax.random.bernoulli(jax.random.key(1), 0.4, (30_000, 9))
    legal = legal.at[:, 4].set(True)  # at least one legal cell in every row
    cells = jax.jit(jax.vmap(tictactoe.opponent_move))(keys, legal)
    assert bool(jnp.all(jnp.take_along_axis(legal, cells[:, None], axis=1)))

    one_board = jnp.array([True, False, False, False, True, False, False, False, True])
    cells = jax.jit(jax.vmap(tictactoe.opponent_move, in_axes=(0, None)))(keys, one_board)
    frequency = np.bincount(np.asarray(cells), minlength=9) / len(keys)
    np.testing.assert_allclose(frequency[[0, 4, 8]], 1 / 3, atol=0.015)


def test_tictactoe_an_occupied_cell_ends_the_game_as_a_loss():
    # Games where the opponent moved first: one mark on the board, the agent to move.
    games = jax.jit(jax.vmap(tictactoe.new_game))(jax.random.split(jax.random.key(0), 64))
    assert bool(jnp.all(games.current_player == tictactoe.AGENT))
    opened = np.asarray(~games.legal_action_mask).sum(axis=1)
    assert set(opened) == {0, 1}
    # pgx observes for the player to move, the agent: its marks first, then the opponent's.
    obs = np.asarray(tictactoe.observe(games)).reshape(64, 9, 2)
    np.testing.assert_array_equal(obs.sum(axis=1), np.stack([0 * opened, opened], axis=1))
    keys = jax.random.split(jax.random.key(1), 64)
    taken = jnp.argmax(~games.legal_action_mask, axis=1)  # the opponent's cell, or 0
    after, reward, illegal = jax.jit(jax.vmap(tictactoe.play))(games, taken, keys)
    np.testing.assert_array_equal(illegal, opened == 1)
    np.testing.assert_array_equal(reward, np.where(opened == 1, -1.0, 0.0))
    np.testing.assert_array_equal(after.terminated, opened == 1)
    # The others go on, the agent to move again after the opponent's reply.
    going = ~np.asarray(after.terminated)
    assert bool(jnp.all(after.current_player[going] == tictactoe.AGENT))
    np.testing.assert_array_equal((~after.legal_action_mask[going]).sum(axis=1), 2)


def test_tictactoe_env_step_counts_an_illegal_move_and_starts_a_new_game_after_an_end():
    games = jax.jit(jax.vmap(tictactoe.new_game))(jax.random.split(jax.random.key(0), 64))
    opened = np.asarray(~games.legal_action_mask).sum(axis=1)
    taken = jnp.argmax(~games.legal_action_mask, axis=1)  # the opponent's cell, or 0
    keys = jax.random.split(jax.random.key(1), 64)
    step = jax.jit(jax.vmap(tictactoe.env_step))(keys, games, taken)
    lost = opened == 1
    np.testing.assert_array_equal(step.counts["illegal_moves"], lost)
    np.testing.assert_array_equal(step.done, lost)
    np.testing.assert_array_equal(step.terminated, lost)
    np.testing.assert_array_equal(step.reward, np.where(lost, -1.0, 0.0))
    # The final observation is the board the move led to: in a lost game the
    # opponent's opening alone (the occupied cell was not taken again); in the
    # others, where the agent moved first, its mark and the opponent's reply.
    final = np.asarray(step.final_obs).reshape(64, 9, 2).sum(axis=(1, 2))
    np.testing.assert_array_equal(final, np.where(lost, 1, 2))
    # Every game goes on, the agent to move: a lost one was replaced by a new game,
    # whose observation the step returns.
    assert not bool(step.state.terminated.any())
    assert bool(jnp.all(step.state.current_player == tictactoe.AGENT))
    np.testing.assert_array_equal(step.obs, tictactoe.observe(step.state))
    marks = np.asarray(step.obs).reshape(64, 9, 2).sum(axis=(1, 2))
    assert set(marks[lost]) == {0, 1} and set(marks[~lost]) == {2}


def test_tictactoe_refuses_compare_without_the_mask():
    config, args = tictactoe.parse_args(["--no-mask"])
    assert not config.mask and not args.compare
    config, args = tictactoe.parse_args(["--compare"])
    assert config.mask and args.compare
    with pytest.raises(SystemExit, match="--compare trains with and without the mask"):
        tictactoe.parse_args(["--compare", "--no-mask"])


def test_tictactoe_runs_with_and_without_the_mask_and_the_masked_agent_plays_only_legal_moves(
    tmp_path,
):
    argv = [*_argv(TICTACTOE_TINY), "--compare", "--out", str(tmp_path), "--no-progress"]
    summary = tictactoe.main(argv)

    assert (tmp_path / "tictactoe.png").read_bytes()[:8] == PNG
    assert json.loads((tmp_path / "summary.json").read_text())["without_mask"]["steps"] == 1024
    unmasked = summary["without_mask"]
    assert summary["config"]["mask"] and not unmasked["config"]["mask"]
    # Replayed in the rollout's shapes under the stored masks, before any update, the
    # stored moves score the stored log-likelihoods exactly.
    assert summary["replay_ratio_error"] == 0.0
    assert unmasked["replay_ratio_error"] == 0.0
    assert summary["minibatch_ratio_error"] < 1e-5
    # The masked agent never takes an occupied cell, in training or in evaluation.
    assert summary["illegal_moves"] == 0
    assert summary["greedy"]["illegal_loss"] == summary["sampled"]["illegal_loss"] == 0.0
    # A near-uniform policy without the mask does: 4 iterations of 256 moves.
    assert unmasked["illegal_moves"] > 0 and unmasked["sampled"]["illegal_loss"] > 0
    # The head's masked_probability: positive with a mask (cells are taken), 0 without.
    assert all(0 < p < 1 for p in summary["per_iteration"]["masked_probability"])
    assert unmasked["per_iteration"]["masked_probability"] == [0.0] * 4
    # The fraction of each iteration's 256 moves that were illegal adds up to the count.
    fractions = unmasked["illegal_fraction"]
    assert sum(fractions) * 256 == pytest.approx(unmasked["illegal_moves"], abs=1e-9)
    assert summary["illegal_fraction"] == [0.0] * 4
    for run in (summary, unmasked):
        for kind in ("greedy", "sampled", "random"):
            games = run[kind]
            assert games["finished"] == 1.0
            assert games["win"] + games["draw"] + games["loss"] == pytest.approx(1.0)


def test_cartpole_runs_writes_its_figure_and_replays_with_ratio_one(tmp_path):
    summary = cartpole.main([*_argv(CARTPOLE_TINY), "--out", str(tmp_path), "--no-progress"])

    figure = tmp_path / "cartpole.png"
    data = figure.read_bytes()
    assert data[:8] == PNG
    # The curve and one panel per probed state, 16 x 4 inches at 100 dpi.
    assert struct.unpack(">II", data[16:24]) == (1600, 400)
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["steps"] == 1024 and written["figure"] == str(figure)
    # 1024 steps in iterations of 4 environments x 32 steps.
    assert summary["iterations"] == 8
    # Before the first update of each iteration the weights are the rollout's, so
    # replaying the stored actions must reproduce the stored log-likelihoods.
    assert summary["replay_ratio_error"] == 0.0
    assert summary["minibatch_ratio_error"] < 1e-5
    # An episode earns 1 per step and lasts at most 500 steps; a uniformly random
    # policy drops the pole within a few dozen, and only steps up to the end count.
    for name in ("deterministic_return", "random_return"):
        assert 1 <= summary[name] <= 500, name
    assert summary["random_return"] < 100
    assert 0 < summary["final_entropy"] <= math.log(2) + 1e-6
    assert all(math.isfinite(value) for value in summary["last_iteration"].values())


def test_cartpole_default_config_reaches_the_maximum_return(tmp_path):
    summary = cartpole.main(["--out", str(tmp_path), "--no-progress"])

    # Seed 0: every one of the 64 episodes of the deterministic policy lasts the
    # 500 steps of the time limit.
    assert summary["config"] == dataclasses.asdict(cartpole.Config())
    assert summary["deterministic_return"] == 500.0
    assert summary["deterministic_return_std"] == 0.0
    assert summary["steps_to_500"] is not None
    assert summary["replay_ratio_error"] == 0.0
    assert summary["minibatch_ratio_error"] < 1e-5


def test_reach_moves_by_direction_and_distance_clips_to_the_line_and_ends_after_16_steps():
    # Jitted as the example runs it (and compiled once, not op by op).
    step = jax.jit(hybrid.step)
    state = hybrid.Reach(jnp.float32(0.9), jnp.float32(-0.5), jnp.int32(0))
    # Right by 0.5 * 0.4 = 0.2 from 0.9 is clipped to the end of the line.
    obs, state, reward, done = step(state, {"direction": 2, "distance": jnp.array([0.4])})
    assert float(state.position) == 1.0 and float(reward) == -1.5 and not bool(done)
    assert obs.tolist() == pytest.approx([1.0, -0.5, -1.5, 15 / 16])
    # Left by the most a step allows, then staying: the distance does not matter.
    _, state, reward, _ = step(state, {"direction": 0, "distance": jnp.array([1.0])})
    assert float(state.position) == 0.5 and float(reward) == -1.0
    _, state, _, _ = step(state, {"direction": 1, "distance": jnp.array([1.0])})
    assert float(state.position) == 0.5
    for _ in range(12):
        _, state, _, done = step(state, {"direction": 1, "distance": jnp.array([0.0])})
    assert int(state.time) == 15 and not bool(done)
    _, state, _, done = step(state, {"direction": 1, "distance": jnp.array([0.0])})
    assert bool(done)
    # The hand-written policy moves exactly onto a target within reach.
    action = hybrid.straight_to_target(hybrid.observe(hybrid.Reach(0.0, -0.3, 0)))
    assert int(action["direction"]) == 0 and float(action["distance"][0]) == pytest.approx(0.6)


def test_reach_env_step_starts_a_fresh_episode_where_one_ends_and_keeps_its_last_observation():
    env_step = jax.jit(hybrid.env_step)
    action = {"direction": jnp.int32(0), "distance": jnp.array([0.4])}
    key = jax.random.key(1)
    fresh_obs, fresh = hybrid.reset(key)
    for elapsed, ends in ((3, False), (15, True)):
        state = hybrid.Reach(jnp.float32(0.2), jnp.float32(-0.5), jnp.int32(elapsed))
        step = env_step(key, state, action)
        # Left by 0.5 * 0.4 from 0.2: at 0.0, the target 0.5 away.
        last_obs = [0.0, -0.5, -0.5, 1 - (elapsed + 1) / 16]
        np.testing.assert_allclose(step.final_obs, last_obs, atol=1e-7)
        assert float(step.reward) == -0.5
        assert bool(step.done) == bool(step.terminated) == ends
        if ends:
            np.testing.assert_array_equal(step.obs, fresh_obs)
            assert jax.tree.all(jax.tree.map(jnp.array_equal, step.state, fresh))
        else:
            np.testing.assert_array_equal(step.obs, step.final_obs)
            assert int(step.state.time) == elapsed + 1


def test_hybrid_runs_writes_its_figure_and_replays_with_ratio_one(tmp_path):
    summary = hybrid.main([*_argv(HYBRID_TINY), "--out", str(tmp_path), "--no-progress"])

    assert (tmp_path / "hybrid.png").read_bytes()[:8] == PNG
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 2048
    assert summary["iterations"] == 4
    # The composite head replays the stored dict of parts at unchanged weights.
    assert summary["replay_ratio_error"] == 0.0
    assert summary["minibatch_ratio_error"] < 1e-5
    # A reward is minus a distance on [-1, 1]: each of the 16 steps earns [-2, 0].
    for name in ("deterministic_return", "random_return", "straight_return"):
        assert -32 <= summary[name] <= 0, name
    assert summary["straight_return"] > summary["random_return"]


def test_hybrid_default_config_learns_to_reach(tmp_path):
    summary = hybrid.main(["--out", str(tmp_path), "--no-progress"])

    # Seed 0 with the defaults: about -0.6 per episode, against about -11 for the
    # uniform policy and -0.4 for the hand-written one (which knows the dynamics).
    assert summary["deterministic_return"] > -1.0
    assert summary["random_return"] < -9.0
    assert summary["replay_ratio_error"] == 0.0
    assert summary["minibatch_ratio_error"] < 1e-5
