"""The implementations timed side by side, each as two pure functions.

``rollout(mean_and_std, rng) -> ((action, log_likelihood, raw_action), next_rng)``
and ``loss(mean_and_std, raw_action, old_log_likelihood, advantage, rng) ->
(scalar, next_rng)`` (a clipped PPO surrogate plus the entropy cost, the noise
for the entropy drawn inside). Every step advances its random state, as it must
in a training loop: a JAX key is split, the ``samplers`` head advances its
``nnx.Rngs`` stream. The suite jits ``rollout`` and
``jax.value_and_grad(loss, has_aux=True)``.

The actor step (:func:`actor_steps`) is the SAC-style update of a policy:
``actor(mean_and_std, rng) -> (loss, next_rng)`` with ``loss = mean(ALPHA *
log_prob(a) - critic(a))`` for a fresh reparameterised sample ``a``, so that its
gradient is the pathwise one. The suite jits ``jax.value_and_grad(actor,
has_aux=True)``.

``handwritten`` is the reference every ratio is taken against: the specified
maths written out directly, as a user would without a library.
"""

import importlib.util
import math
from collections.abc import Callable
from typing import NamedTuple

import distrax
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tensorflow_probability.substrates import jax as tfp

import samplers

MIN_STD, STD_SCALE, ENTROPY_WEIGHT, CLIP = 1e-3, 1.0, 0.01, 0.2
ALPHA = 0.2  # the actor step's entropy temperature
_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


class Implementation(NamedTuple):
    name: str
    rollout: Callable
    loss: Callable | None  # None: no loss step (the floor's is the draw alone)
    random_input: Callable = lambda key: key  # what the functions take in place of a key


class ActorStep(NamedTuple):
    name: str
    step: Callable  # (mean_and_std, rng) -> (loss, next_rng)
    random_input: Callable = lambda key: key
    differentiable: bool = True  # False for the floor, timed without a gradient


def _splitting_key(step):
    """Wraps ``step(*inputs, key) -> out`` as ``step(*inputs, key) -> (out, next_key)``."""

    def threaded(*args):
        *inputs, key = args
        key, subkey = jax.random.split(key)
        return step(*inputs, subkey), key

    return threaded


def surrogate(log_likelihood, old_log_likelihood, advantage, entropy):
    """The clipped PPO surrogate minus the entropy bonus: the loss every suite times."""
    ratio = jnp.exp(log_likelihood - old_log_likelihood)
    clipped = jnp.clip(ratio, 1 - CLIP, 1 + CLIP)
    policy_loss = -jnp.mean(jnp.minimum(ratio * advantage, clipped * advantage))
    return policy_loss - ENTROPY_WEIGHT * jnp.mean(entropy)


def head_surrogate(out, old_log_likelihood, advantage):
    """:func:`surrogate` of a head's output: its log-likelihood, and the entropy of which
    its ``regularization_loss`` is the cost (the head built with ``ENTROPY_WEIGHT``)."""
    entropy = -out.regularization_loss / ENTROPY_WEIGHT
    return surrogate(out.output["log_likelihood"], old_log_likelihood, advantage, entropy)


def head_call(build):
    """``(call, random_input)`` of the head that ``build(rngs)`` makes, run as
    ``samplers.functional`` runs one: split once, merged inside the step, its streams'
    state passed in and returned.

    ``call(state, inputs, rollout_extras, mask=...) -> (out, next_state)`` calls the
    head positionally as ``head((), inputs, rollout_extras, mask=...)``;
    ``random_input(key)`` is the state of the head built with ``nnx.Rngs(key)``.
    """
    graphdef, _ = nnx.split(build(nnx.Rngs(0)))

    def call(state, *args, **options):
        head = nnx.merge(graphdef, state)
        out = head((), *args, **options)
        return out, nnx.to_pure_dict(nnx.state(head))

    def random_input(key):
        return nnx.to_pure_dict(nnx.state(build(nnx.Rngs(key))))

    return call, random_input


def critic(action):
    """The fixed, made-up critic of the actor step: ``Q(a) = -sum(w * (a - c)**2)``.

    ``c`` runs from -0.5 to 0.5 and ``w`` from 0.5 to 1.5 over the action axis,
    the same for every implementation.
    """
    target = jnp.linspace(-0.5, 0.5, action.shape[-1], dtype=action.dtype)
    weight = jnp.linspace(0.5, 1.5, action.shape[-1], dtype=action.dtype)
    return -jnp.sum(weight * jnp.square(action - target), axis=-1)


def _actor_objective(action, log_likelihood):
    return jnp.mean(ALPHA * log_likelihood - critic(action))


def _split(mean_and_std):
    mean, raw_std = jnp.split(mean_and_std, 2, axis=-1)
    return mean, (jax.nn.softplus(raw_std) + MIN_STD) * STD_SCALE


# --- hand-written: the specified formula, fused by XLA ---------------------------


def _tanh_log_det(z):
    return 2.0 * (jnp.log(2.0) - z - jax.nn.softplus(-2.0 * z))


def _handwritten_log_prob(z, mean, std):
    log_normal = -0.5 * jnp.square((z - mean) / std) - (_HALF_LOG_2PI + jnp.log(std))
    return jnp.sum(log_normal - _tanh_log_det(z), axis=-1)


def handwritten_rollout(mean_and_std, key):
    mean, std = _split(mean_and_std)
    z = mean + std * jax.random.normal(key, mean.shape)
    return jnp.tanh(z), _handwritten_log_prob(z, mean, std), z


def handwritten_loss(mean_and_std, raw, old_log_likelihood, advantage, key):
    mean, std = _split(mean_and_std)
    eps = jax.lax.stop_gradient(jax.random.normal(key, mean.shape))
    entropy = jnp.sum(0.5 + _HALF_LOG_2PI + jnp.log(std) + _tanh_log_det(mean + std * eps), -1)
    return surrogate(_handwritten_log_prob(raw, mean, std), old_log_likelihood, advantage, entropy)


def actor_loss_from_noise(mean_and_std, eps):
    """The hand-written actor loss for the standard-normal noise ``eps``."""
    mean, std = _split(mean_and_std)
    x = mean + std * eps
    return _actor_objective(jnp.tanh(x), _handwritten_log_prob(x, mean, std))


def handwritten_actor(mean_and_std, key):
    noise_shape = (*mean_and_std.shape[:-1], mean_and_std.shape[-1] // 2)
    return actor_loss_from_noise(mean_and_std, jax.random.normal(key, noise_shape))


def handwritten_sampler_call(mean_and_std, key, count):
    """Everything one sampler call returns, with a key counter as its stream."""
    mean, std = _split(mean_and_std)
    z = mean + std * jax.random.normal(jax.random.fold_in(key, count), mean.shape)
    eps = jax.random.normal(jax.random.fold_in(key, count + 1), mean.shape)
    entropy = jnp.sum(0.5 + _HALF_LOG_2PI + jnp.log(std) + _tanh_log_det(mean + std * eps), -1)
    outputs = (jnp.tanh(z), _handwritten_log_prob(z, mean, std), z, -ENTROPY_WEIGHT * entropy)
    return (*outputs, mean, std), count + 2


# --- samplers: the NNX head through its pure-function path -----------------------


def samplers_functions(**options):
    """The head's state (its stream) is the random input, passed in like a key.

    ``options`` go to ``NormalTanhSampler`` (e.g. ``entropy="quadrature"``).
    """

    def head(seed):
        return samplers.NormalTanhSampler(nnx.Rngs(seed), ENTROPY_WEIGHT, **options)

    apply, _ = samplers.functional(head(0))

    def rollout(mean_and_std, state):
        out, state = apply(state, mean_and_std)
        return (out.output["action"], out.output["log_likelihood"], out.rollout_extras), state

    def loss(mean_and_std, raw, old_log_likelihood, advantage, state):
        out, state = apply(state, mean_and_std, raw)
        return head_surrogate(out, old_log_likelihood, advantage), state

    def random_input(key):
        return samplers.functional(head(key))[1]

    return rollout, loss, random_input


def samplers_actor():
    """The actor step through the NNX head, ``reparameterized=True``, via ``functional``.

    Returns ``(actor, random_input)``; the head's state is the random input.
    """

    def head(seed):
        return samplers.NormalTanhSampler(nnx.Rngs(seed), 0.0, reparameterized=True)

    apply, _ = samplers.functional(head(0))

    def actor(mean_and_std, state):
        out, state = apply(state, mean_and_std)
        return _actor_objective(out.output["action"], out.output["log_likelihood"]), state

    return actor, lambda key: samplers.functional(head(key))[1]


def _samplers_pure_actor(mean_and_std, key):
    action, _, log_prob = samplers.normal_tanh(mean_and_std).sample_with_pre_image(seed=key)
    return _actor_objective(action, log_prob)


# --- distrax and TFP: the plain idiom, scoring the stored pre-image --------------


def _distrax_functions():
    def parts(mean_and_std):
        mean, std = _split(mean_and_std)
        return distrax.MultivariateNormalDiag(mean, std), distrax.Block(distrax.Tanh(), 1)

    def rollout(mean_and_std, key):
        base, bijector = parts(mean_and_std)
        z = base.sample(seed=key)
        action, log_det = bijector.forward_and_log_det(z)
        return action, base.log_prob(z) - log_det, z

    def loss(mean_and_std, raw, old_log_likelihood, advantage, key):
        base, bijector = parts(mean_and_std)
        log_likelihood = base.log_prob(raw) - bijector.forward_log_det_jacobian(raw)
        eps = jax.lax.stop_gradient(jax.random.normal(key, raw.shape))
        z = base.mean() + base.stddev() * eps
        entropy = base.entropy() + bijector.forward_log_det_jacobian(z)
        return surrogate(log_likelihood, old_log_likelihood, advantage, entropy)

    def actor(mean_and_std, key):
        mean, std = _split(mean_and_std)
        dist = distrax.Transformed(
            distrax.MultivariateNormalDiag(mean, std), distrax.Block(distrax.Tanh(), 1)
        )
        return _actor_objective(*dist.sample_and_log_prob(seed=key))

    return rollout, loss, actor


def _tfp_functions():
    tfd, tfb = tfp.distributions, tfp.bijectors

    def log_det(z):  # TFP's Tanh is elementwise: sum over the event axis
        return jnp.sum(tfb.Tanh().forward_log_det_jacobian(z, event_ndims=0), axis=-1)

    def rollout(mean_and_std, key):
        base = tfd.MultivariateNormalDiag(*_split(mean_and_std))
        z = base.sample(seed=key)
        return tfb.Tanh().forward(z), base.log_prob(z) - log_det(z), z

    def loss(mean_and_std, raw, old_log_likelihood, advantage, key):
        mean, std = _split(mean_and_std)
        base = tfd.MultivariateNormalDiag(mean, std)
        eps = jax.lax.stop_gradient(jax.random.normal(key, raw.shape))
        entropy = base.entropy() + log_det(mean + std * eps)
        return surrogate(base.log_prob(raw) - log_det(raw), old_log_likelihood, advantage, entropy)

    def actor(mean_and_std, key):
        # log_prob of the sample finds its pre-image in the bijector's cache
        # instead of inverting tanh.
        dist = tfd.TransformedDistribution(
            tfd.MultivariateNormalDiag(*_split(mean_and_std)), tfb.Tanh()
        )
        action = dist.sample(seed=key)
        return _actor_objective(action, dist.log_prob(action))

    return rollout, loss, actor


# --- Brax, when installed --------------------------------------------------------


def _brax_functions():
    from brax.training import distribution

    def rollout(mean_and_std, key):
        dist = distribution.NormalTanhDistribution(mean_and_std.shape[-1] // 2, min_std=MIN_STD)
        raw = dist.sample_no_postprocessing(mean_and_std, key)
        return dist.postprocess(raw), dist.log_prob(mean_and_std, raw), raw

    def loss(mean_and_std, raw, old_log_likelihood, advantage, key):
        dist = distribution.NormalTanhDistribution(mean_and_std.shape[-1] // 2, min_std=MIN_STD)
        entropy = dist.entropy(mean_and_std, key)
        return surrogate(dist.log_prob(mean_and_std, raw), old_log_likelihood, advantage, entropy)

    def actor(mean_and_std, key):
        dist = distribution.NormalTanhDistribution(mean_and_std.shape[-1] // 2, min_std=MIN_STD)
        raw = dist.sample_no_postprocessing(mean_and_std, key)
        return _actor_objective(dist.postprocess(raw), dist.log_prob(mean_and_std, raw))

    return rollout, loss, actor


# --- the floor: the noise draws alone --------------------------------------------


def floor_rollout(mean_and_std, key):
    return jax.random.normal(key, (*mean_and_std.shape[:-1], mean_and_std.shape[-1] // 2))


def _peers():
    """``(name, (rollout, loss, actor))`` of the key-based peer libraries available here."""
    peers = [("distrax", _distrax_functions()), ("tfp", _tfp_functions())]
    if importlib.util.find_spec("brax") is not None:
        peers.append(("brax", _brax_functions()))
    return peers


def all_implementations() -> list[Implementation]:
    """Every implementation of the rollout and loss steps available here, the reference first."""
    key_based = [("handwritten", (handwritten_rollout, handwritten_loss))]
    key_based += [(name, fns[:2]) for name, fns in _peers()]
    found = [Implementation(name, *map(_splitting_key, fns)) for name, fns in key_based]
    found.insert(1, Implementation("samplers", *samplers_functions()))
    found.append(Implementation("floor (draw alone)", _splitting_key(floor_rollout), None))
    return found


def actor_steps() -> list[ActorStep]:
    """Every implementation of the actor step available here, the reference first."""
    key_based = [
        ("handwritten", handwritten_actor),
        ("samplers (pure layer)", _samplers_pure_actor),
    ]
    key_based += [(name, fns[2]) for name, fns in _peers()]
    found = [ActorStep(name, _splitting_key(step)) for name, step in key_based]
    found.insert(1, ActorStep("samplers", *samplers_actor()))
    found.append(
        ActorStep("floor (draw alone)", _splitting_key(floor_rollout), differentiable=False)
    )
    return found


# --- discrete heads: distrax as users write it inline, and the samplers heads ------
#
# ``rollout(logits, mask, rng) -> ((action, log_likelihood), next_rng)`` and
# ``loss(logits, mask, action, old_log_likelihood, advantage, rng) -> (scalar,
# next_rng)``: the clipped PPO surrogate of the stored action's log-likelihood plus
# the entropy cost (exact for a discrete distribution, so no draw). ``mask`` is
# None for the heads timed without one.

NUM_ACTIONS, NVEC, NUM_BITS = 18, (3, 5, 7), 16


class DiscreteCase(NamedTuple):
    name: str
    num_params: int  # the logits' last axis
    masked: bool  # whether the timed calls pass a mask
    distribution: Callable  # (logits, mask) -> the distrax distribution a user writes
    samplers_distribution: Callable  # (logits, mask) -> the samplers distribution
    head: Callable  # nnx.Rngs -> the samplers head


def _categorical(logits, mask):
    return distrax.Categorical(logits=logits)


def _masked_categorical(logits, mask):
    # Mava's and JaxMARL's masking: forbidden logits set to the lowest finite float.
    return distrax.Categorical(logits=jnp.where(mask, logits, jnp.finfo(logits.dtype).min))


def _multi_discrete(logits, mask):
    # sbx's: split into the sub-actions, pad each with -inf to the largest, stack.
    parts = jnp.split(logits, np.cumsum(NVEC[:-1]), axis=-1)
    width = max(NVEC)
    padded = jnp.stack(
        [
            jnp.pad(
                part,
                [(0, 0)] * (part.ndim - 1) + [(0, width - part.shape[-1])],
                constant_values=-jnp.inf,
            )
            for part in parts
        ],
        axis=-2,
    )
    return distrax.Independent(distrax.Categorical(logits=padded), 1)


def _multi_binary(logits, mask):
    return distrax.Independent(distrax.Bernoulli(logits=logits), 1)


def discrete_cases() -> list[DiscreteCase]:
    """The discrete heads timed: Categorical without and with a mask, MultiDiscrete, MultiBinary."""
    w = ENTROPY_WEIGHT
    return [
        DiscreteCase(
            "Categorical",
            NUM_ACTIONS,
            False,
            _categorical,
            lambda logits, mask: samplers.MaskedCategorical(logits, mask),
            lambda rngs: samplers.CategoricalSampler(rngs, w, num_actions=NUM_ACTIONS),
        ),
        DiscreteCase(
            "Categorical, masked",
            NUM_ACTIONS,
            True,
            _masked_categorical,
            lambda logits, mask: samplers.MaskedCategorical(logits, mask),
            lambda rngs: samplers.CategoricalSampler(rngs, w, num_actions=NUM_ACTIONS),
        ),
        DiscreteCase(
            "MultiDiscrete",
            sum(NVEC),
            False,
            _multi_discrete,
            lambda logits, mask: samplers.MultiDiscrete(logits, NVEC, mask),
            lambda rngs: samplers.MultiDiscreteSampler(rngs, w, nvec=NVEC),
        ),
        DiscreteCase(
            "MultiBinary",
            NUM_BITS,
            False,
            _multi_binary,
            lambda logits, mask: samplers.MultiBinary(logits, mask),
            lambda rngs: samplers.MultiBinarySampler(rngs, w, num_bits=NUM_BITS),
        ),
    ]


def discrete_distribution_rollout(distribution):
    """``rollout(logits, mask, key)``: a sample of ``distribution`` and its log-probability."""

    def rollout(logits, mask, key):
        dist = distribution(logits, mask)
        action = dist.sample(seed=key)
        return action, dist.log_prob(action)

    return rollout


def discrete_distribution_loss(distribution):
    """``loss(logits, mask, action, old_log_likelihood, advantage)`` of ``distribution``."""

    def loss(logits, mask, action, old_log_likelihood, advantage):
        dist = distribution(logits, mask)
        return surrogate(dist.log_prob(action), old_log_likelihood, advantage, dist.entropy())

    return loss


def _keyless(loss):
    """The loss draws nothing: its random input passes through unchanged."""

    def threaded(*args):
        *inputs, rng = args
        return loss(*inputs), rng

    return threaded


def discrete_head_rollout_with_metrics(case):
    """The head's rollout, returning its ``metrics`` too.

    ``rollout(logits, mask, state) -> ((action, log_likelihood, metrics), next_state)``.
    """
    call, _ = head_call(case.head)

    def rollout(logits, mask, state):
        out, state = call(state, logits, None, mask=mask)
        return (out.output["action"], out.output["log_likelihood"], out.metrics), state

    return rollout


def _discrete_head_functions(case):
    """``(rollout, loss, random_input)`` of the head (:func:`head_call`)."""
    call, random_input = head_call(case.head)

    def rollout(logits, mask, state):
        out, state = call(state, logits, None, mask=mask)
        return (out.output["action"], out.output["log_likelihood"]), state

    def loss(logits, mask, action, old_log_likelihood, advantage, state):
        out, state = call(state, logits, action, mask=mask)
        return head_surrogate(out, old_log_likelihood, advantage), state

    return rollout, loss, random_input


def discrete_implementations(case: DiscreteCase) -> list[Implementation]:
    """The reference (distrax as users write it) first, then the head and its pure layer."""

    def key_based(distribution):
        return (
            _splitting_key(discrete_distribution_rollout(distribution)),
            _keyless(discrete_distribution_loss(distribution)),
        )

    return [
        Implementation("handwritten", *key_based(case.distribution)),
        Implementation("samplers", *_discrete_head_functions(case)),
        Implementation("samplers (pure layer)", *key_based(case.samplers_distribution)),
    ]
