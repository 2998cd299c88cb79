"""``python -m samplers``: build a policy head, sample, replay, and cross-check.

Prints one rollout and its replay, then a table of log-likelihoods of a 1-D
tanh-squashed Normal computed three ways: by this library from the stored
pre-image, by ``distrax`` and by TensorFlow Probability from the squashed action
(through the inverse). Past ``|x| ~ 9`` float32 ``tanh`` rounds to exactly 1 and
the inverse path returns NaN or infinity; the pre-image path stays finite.
"""

import distrax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tensorflow_probability.substrates import jax as tfp

import samplers

_PRE_IMAGES = (0.5, 3.0, 8.0, 9.1, 10.0, 20.0, -50.0)


def _float64_log_prob(x: float, mean: float, std: float) -> float:
    log_normal = -0.5 * ((x - mean) / std) ** 2 - np.log(std) - 0.5 * np.log(2 * np.pi)
    return float(log_normal - (2 * np.log(2.0) - 2 * np.logaddexp(x, -x)))


def main() -> None:
    head = samplers.NormalTanhSampler(nnx.Rngs(0), entropy_weight=0.01)
    mean_and_std = jnp.array([[0.5, -1.0, 0.0, 0.0], [12.0, 0.2, -1.0, -1.0]])
    rollout = head((), mean_and_std)
    replay = head((), mean_and_std, rollout.rollout_extras)
    ratio = jnp.exp(replay.output["log_likelihood"] - rollout.output["log_likelihood"])
    print("rollout action      ", np.array2string(np.asarray(rollout.output["action"])))
    print("stored pre-tanh     ", np.array2string(np.asarray(rollout.rollout_extras)))
    print("replay ratio        ", np.array2string(np.asarray(ratio)))
    print()

    mean, raw_std = 0.0, 0.0
    dist = samplers.normal_tanh(jnp.array([mean, raw_std]))
    std = float(dist.scale[0])
    tfd, tfb = tfp.distributions, tfp.bijectors
    tfp_dist = tfd.TransformedDistribution(tfd.Normal(mean, std), tfb.Tanh())
    plain_distrax = distrax.Transformed(distrax.Normal(mean, std), distrax.Tanh())
    print(f"log p(tanh(x)) for x ~ N({mean}, {std:.4f}), float32")
    print(f"{'x':>8} {'tanh(x)':>12} {'samplers':>12} {'float64':>12} {'distrax':>12} {'tfp':>12}")
    for x in _PRE_IMAGES:
        action = jnp.tanh(jnp.float32(x))
        ours = float(dist.log_prob_from_pre_image(jnp.array([x])))
        print(
            f"{x:>8} {float(action):>12.8f} {ours:>12.4f} {_float64_log_prob(x, mean, std):>12.4f}"
            f" {float(plain_distrax.log_prob(action)):>12.4f}"
            f" {float(tfp_dist.log_prob(action)):>12.4f}"
        )


if __name__ == "__main__":
    main()
