"""Independent references written from the maths, for the tests to compare against."""

import jax
import jax.numpy as jnp
import numpy as np


def params_float64(mean_and_std, *, min_std=1e-3, std_scale=1.0):
    """``(mean, std)`` from ``[mean | raw_std]`` in float64 NumPy."""
    mean_and_std = np.asarray(mean_and_std, np.float64)
    mean, raw_std = np.split(mean_and_std, 2, axis=-1)
    return mean, (np.logaddexp(raw_std, 0.0) + min_std) * std_scale


def tanh_normal_log_prob_float64(pre_image, mean, std):
    """Change of variables in float64: ``log N(x; mean, std) - log sech(x)^2``.

    ``log sech(x)^2 = 2 log 2 - 2 logaddexp(x, -x)``, written from cosh so that it
    shares no formula with the library's log-determinant.
    """
    x, mean, std = (np.asarray(a, np.float64) for a in (pre_image, mean, std))
    log_normal = -0.5 * ((x - mean) / std) ** 2 - np.log(std) - 0.5 * np.log(2 * np.pi)
    log_sech2 = 2 * np.log(2.0) - 2 * np.logaddexp(x, -x)
    return np.sum(log_normal - log_sech2, axis=-1)


def spec_sampler_call(
    rngs,
    mean_and_std,
    rollout_extras=None,
    *,
    deterministic=False,
    entropy_weight,
    min_std,
    std_scale,
):
    """The specified tanh sampler, step by step, drawing from ``rngs`` in its order.

    One key for the sample unless deterministic (drawn in replay too), then one
    for the entropy estimate.
    """
    mean, raw_std = jnp.split(mean_and_std, 2, axis=-1)
    std = (jax.nn.softplus(raw_std) + min_std) * std_scale
    if deterministic:
        sampled = mean
    else:
        sampled = mean + std * jax.random.normal(rngs(), mean.shape)
    raw = jax.lax.stop_gradient(sampled) if rollout_extras is None else rollout_extras

    def log_det(z):
        return 2.0 * (jnp.log(2.0) - z - jax.nn.softplus(-2.0 * z))

    log_normal = -0.5 * jnp.square((raw - mean) / std) - (0.5 * jnp.log(2 * jnp.pi) + jnp.log(std))
    log_likelihood = jnp.sum(log_normal - log_det(raw), axis=-1)
    noise = jax.lax.stop_gradient(jax.random.normal(rngs(), mean.shape))
    normal_entropy = 0.5 + 0.5 * jnp.log(2 * jnp.pi) + jnp.log(std)
    entropy = jnp.sum(normal_entropy + log_det(mean + std * noise), axis=-1)
    return {
        "action": jnp.tanh(raw),
        "log_likelihood": log_likelihood,
        "raw_action": raw,
        "regularization_loss": -entropy_weight * entropy,
        "mu": mean,
        "sigma": std,
    }


def tanh_normal_entropy_float64(mean, std):
    """Entropy of ``tanh(x)``, ``x ~ N(mean, std)`` (1-D), by float64 quadrature.

    ``H[y] = -E[log p_y(tanh x)]``, integrated over the pre-image on a dense grid.
    """
    x = np.linspace(mean - 14 * std, mean + 14 * std, 400_001)
    density = np.exp(-0.5 * ((x - mean) / std) ** 2) / (std * np.sqrt(2 * np.pi))
    log_p = tanh_normal_log_prob_float64(x[:, None], mean, std)
    return -np.trapezoid(density * log_p, x)
