"""Independent references written from the maths, for the tests to compare against.

One function per formula, in float64 NumPy and SciPy (``spec_sampler_call`` in jnp: the
specified sampler, step by step). None calls the library; a test imports the one it
needs instead of writing the formula again.
"""

import jax
import jax.numpy as jnp
import numpy as np
from scipy import special


def softplus_std_float64(raw_std, min_std=1e-3, std_scale=1.0):
    """The std of a squashed-Normal head, ``(softplus(raw_std) + min_std) * std_scale``."""
    return (np.logaddexp(np.asarray(raw_std, np.float64), 0.0) + min_std) * std_scale


def params_float64(mean_and_std, *, min_std=1e-3, std_scale=1.0):
    """``(mean, std)`` from ``[mean | raw_std]`` in float64 NumPy."""
    mean_and_std = np.asarray(mean_and_std, np.float64)
    mean, raw_std = np.split(mean_and_std, 2, axis=-1)
    return mean, softplus_std_float64(raw_std, min_std, std_scale)


def normal_log_prob_float64(x, mean, std):
    """``log N(x; mean, std)``, elementwise."""
    x, mean, std = (np.asarray(a, np.float64) for a in (x, mean, std))
    return -0.5 * ((x - mean) / std) ** 2 - np.log(std) - 0.5 * np.log(2 * np.pi)


def tanh_log_derivative_float64(x, low=-1.0, high=1.0):
    """``log |f'(x)|`` of ``f(x) = (high + low) / 2 + (high - low) / 2 * tanh(x)``,
    elementwise.

    ``log sech(x)^2 = 2 log 2 - 2 logaddexp(x, -x)``, written from cosh so that it
    shares no formula with the library's log-determinant.
    """
    x, low, high = (np.asarray(a, np.float64) for a in (x, low, high))
    return np.log((high - low) / 2) + 2 * np.log(2.0) - 2 * np.logaddexp(x, -x)


def sigmoid_log_derivative_float64(x):
    """``log sigmoid'(x) = -log(1 + e^x) - log(1 + e^-x)``, elementwise."""
    x = np.asarray(x, np.float64)
    return -np.logaddexp(0.0, x) - np.logaddexp(0.0, -x)


def tanh_normal_log_prob_float64(pre_image, mean, std, low=-1.0, high=1.0):
    """Change of variables, summed over the last axis: ``log N(x; mean, std) - log |f'(x)|``
    at the pre-image ``x`` of the tanh onto ``[low, high]``."""
    log_normal = normal_log_prob_float64(pre_image, mean, std)
    return np.sum(log_normal - tanh_log_derivative_float64(pre_image, low, high), axis=-1)


def normal_entropy_float64(std):
    """``H[N(mean, std)] = 1/2 + log(2 pi) / 2 + log(std)``, elementwise."""
    return 0.5 + 0.5 * np.log(2 * np.pi) + np.log(np.asarray(std, np.float64))


def tanh_normal_entropy_estimate_float64(pre_image, std, low=-1.0, high=1.0):
    """The one-sample entropy estimate of the tanh onto ``[low, high]`` of ``N(mean, std)``
    at a sampled pre-image, summed over the last axis: ``H[N] + log |f'(pre_image)|``."""
    log_derivative = tanh_log_derivative_float64(pre_image, low, high)
    return np.sum(normal_entropy_float64(std) + log_derivative, axis=-1)


def masked_log_softmax_float64(logits, mask=None):
    """Log-probabilities of the softmax over the last axis, among the entries ``mask``
    allows: -inf where it forbids, NaN in a row that allows none (or whose allowed
    logits are all -inf)."""
    logits = np.asarray(logits, np.float64)
    if mask is not None:
        logits = np.where(mask, logits, -np.inf)
    some = np.any(logits > -np.inf, axis=-1, keepdims=True)
    safe = np.where(some, logits, 0.0)
    return np.where(some, safe - special.logsumexp(safe, axis=-1, keepdims=True), np.nan)


def categorical_entropy_float64(log_probs):
    """``-sum p log p`` over the last axis (``0 log 0 = 0``); NaN for a row of NaN."""
    log_probs = np.asarray(log_probs, np.float64)
    probs = np.exp(log_probs)
    terms = np.where(probs > 0, -probs * np.where(probs > 0, log_probs, 0.0), 0.0)
    return np.where(np.isnan(log_probs).all(-1), np.nan, terms.sum(-1))


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
        "rollout_extras": raw,
        "regularization_loss": -entropy_weight * entropy,
        "mu": mean,
        "sigma": std,
    }


def squashed_normal_entropy_float64(mean, std, log_derivative=tanh_log_derivative_float64):
    """Entropy of ``f(x)``, ``x ~ N(mean, std)`` (1-D), by float64 quadrature, for the
    squashing whose ``log |f'(x)|`` is ``log_derivative`` (default: tanh).

    ``H[y] = -E[log p_y(f(x))]``, integrated over the pre-image on a dense grid.
    """
    x = np.linspace(mean - 14 * std, mean + 14 * std, 400_001)
    log_normal = normal_log_prob_float64(x, mean, std)
    log_p = log_normal - log_derivative(x)
    return -np.trapezoid(np.exp(log_normal) * log_p, x)
