"""The ``flax.linen`` actor example: our distribution inside a Linen module and SAC's loss.

The oracles are written here in float64 NumPy from the maths: the noise ``eps`` that
the key draws (``normal(key, mean.shape)``, as distrax and Brax draw it), the
pre-image ``x = mean + exp(log_std) * eps``, the actor loss by the change of
variables, and its gradient with respect to the network's output ``[mean | log_std]``
by the chain rule written out. That gradient is carried back to the Linen parameters
by the network's own vector-Jacobian product, and compared with what ``jax.grad`` of
the jitted loss returns.
"""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import samplers
from samplers.examples import linen_actor

pytestmark = pytest.mark.slow

GUIDE = pathlib.Path(__file__).parents[2] / "docs" / "guides" / "migrating.md"
OBS_DIM, A, B = 4, 3, 5
ALPHA = 0.2
# The made-up critic: Q(s, a) = -sum(W * (a - T)**2), the same for every state.
W = np.array([1.0, 0.5, 2.0])
T = np.array([0.3, -0.8, 0.9])


def _critic(observation, action):
    del observation
    weight, target = (jnp.broadcast_to(jnp.asarray(a, action.dtype), action.shape) for a in (W, T))
    return -jnp.sum(weight * jnp.square(action - target), axis=-1)


def _setup(mean_bias=None):
    actor = linen_actor.LinenActor(action_dim=A, hidden_dims=(16, 16))
    observations = jax.random.normal(jax.random.key(3), (B, OBS_DIM))
    params = actor.init(jax.random.key(4), observations)
    # Narrow the stds (log_std bias -1), and push the means far out when asked, so
    # that tanh saturates, through the last layer's bias.
    bias = params["params"]["head"]["bias"].at[A:].set(-1.0)
    if mean_bias is not None:
        bias = bias.at[:A].set(jnp.asarray(mean_bias))
    params["params"]["head"]["bias"] = bias
    return actor, params, observations


def _head_float64(actor, params, observations):
    mean, log_std = actor.apply(params, observations, method="distribution_parameters")
    return np.asarray(mean, np.float64), np.asarray(log_std, np.float64)


def _loss_and_head_gradient_float64(mean, log_std, eps):
    """The loss and its gradient with respect to ``mean`` and ``log_std``, by hand."""
    std = np.exp(log_std)
    x = mean + std * eps
    log_normal = -0.5 * eps**2 - log_std - 0.5 * np.log(2 * np.pi)
    log_sech2 = 2 * np.log(2.0) - 2 * np.logaddexp(x, -x)  # log(1 - tanh(x)**2)
    log_prob = np.sum(log_normal - log_sech2, -1)
    action = np.tanh(x)
    loss = np.mean(ALPHA * log_prob + np.sum(W * (action - T) ** 2, -1))
    # At fixed eps: d log_prob / dx = 2 tanh(x) (the Normal term depends on eps only),
    # d(-Q) / dx = 2 W (a - T) (1 - a**2); x moves 1:1 with mean and by std * eps with
    # log_std, and log_prob has the extra -1 of -log(std).
    d_x = ALPHA * 2 * action + 2 * W * (action - T) * (1 - action**2)
    d_mean = d_x / len(mean)
    d_log_std = (d_x * std * eps - ALPHA) / len(mean)
    return loss, d_mean, d_log_std


_loss_and_grad = jax.jit(
    jax.value_and_grad(linen_actor.sac_actor_loss), static_argnames=("actor", "critic")
)


def test_the_module_returns_our_distribution_with_the_clipped_log_std():
    actor, params, observations = _setup()
    dist = actor.apply(params, observations)
    assert isinstance(dist, samplers.SquashedNormal)
    assert dist.batch_shape == (B,) and dist.event_shape == (A,)
    mean, log_std = _head_float64(actor, params, observations)
    np.testing.assert_allclose(dist.loc, mean, rtol=1e-6)
    np.testing.assert_allclose(dist.scale, np.exp(np.clip(log_std, -20.0, 2.0)), rtol=1e-6)
    clipped = linen_actor.LinenActor(A, (16, 16), log_std_min=-0.01, log_std_max=0.01)
    np.testing.assert_allclose(
        clipped.apply(params, observations).scale, np.exp(np.clip(log_std, -0.01, 0.01)), rtol=1e-6
    )


@pytest.mark.parametrize("where", ["centre", "saturated"])
def test_jitted_actor_loss_and_gradient_are_the_float64_pathwise_ones(where):
    mean_bias = None if where == "centre" else [12.0, -12.0, 20.0]
    actor, params, observations = _setup(mean_bias)
    key = jax.random.key(5)
    loss, grads = _loss_and_grad(params, actor, _critic, observations, key, ALPHA)

    mean, log_std = _head_float64(actor, params, observations)
    eps = np.asarray(jax.random.normal(key, mean.shape), np.float64)
    pre_image = mean + np.exp(log_std) * eps
    if where == "saturated":
        assert np.all(np.abs(pre_image) >= 8.5)
        assert np.all(np.abs(jnp.tanh(jnp.float32(pre_image))) == 1.0)
    else:
        assert np.all(np.abs(pre_image) < 4.0)
    expected_loss, d_mean, d_log_std = _loss_and_head_gradient_float64(mean, log_std, eps)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5, atol=1e-5)

    def head(params):
        return actor.apply(params, observations, method="distribution_parameters")

    _, head_vjp = jax.vjp(head, params)
    (expected,) = head_vjp((jnp.float32(d_mean), jnp.float32(d_log_std)))
    leaves = jax.tree_util.tree_leaves_with_path(grads)
    expected_leaves = jax.tree_util.tree_leaves(expected)
    assert len(leaves) == len(expected_leaves) == 6
    for (path, ours), reference in zip(leaves, expected_leaves, strict=True):
        assert np.all(np.isfinite(ours)), jax.tree_util.keystr(path)
        np.testing.assert_allclose(
            ours, reference, rtol=1e-4, atol=1e-5, err_msg=jax.tree_util.keystr(path)
        )


def test_training_moves_the_median_action_onto_the_critics_best_action():
    summary = linen_actor.main(["--steps", "150", "--seed", "1"])
    assert summary["final_loss"] < summary["initial_loss"]
    assert summary["final_distance"] < 0.25 * summary["initial_distance"]


def test_the_guide_linen_example_is_the_module_line_for_line():
    """The migration guide's Linen block is this module's code, in order (docstrings aside)."""
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.DOTALL)
    (block,) = [b for b in blocks if "class LinenActor(linen.Module)" in b]
    source = pathlib.Path(linen_actor.__file__).read_text().splitlines()
    position = 0
    for line in (line for line in block.splitlines() if line.strip()):
        if line.lstrip().startswith("#") or line.startswith(("import ", "from ")):
            continue
        try:
            position = source.index(line, position) + 1
        except ValueError:
            pytest.fail(f"Guide line not in samplers/examples/linen_actor.py, in order: {line!r}")
