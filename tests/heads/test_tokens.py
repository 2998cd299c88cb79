"""The token head ``TokenSampler``: replay bit for bit (eager, ``jax.jit``, ``nnx.jit``),
the first PPO ratio, ``eval()``, masks, per-token streams, the key rule, the loss and
its gradient against :class:`samplers.TokenCategorical`, metrics against float64, and
its errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import special

import samplers
from tests._tiers import SLOW, slow
from tests.helpers import TRACES, eager_call, jitted_call, keys_drawn
from tests.reference import masked_log_softmax_float64

V, D, N, K = 61, 8, 12, 16
BLOCK = (4, 16)  # tiles of 4 tokens, vocabulary blocks of 16 (the last one of 13)
WEIGHT = 0.1
TRUNCATIONS = {
    "full": {},
    "top_p": {"top_p": 0.8},
    "top_k+min_p": {"top_k": 5, "min_p": 0.05, "temperature": 0.7},
}


def _token_head(rngs=None, **options):
    rngs = nnx.Rngs(0) if rngs is None else rngs
    return samplers.TokenSampler(rngs, WEIGHT, vocab_size=V, max_kept=K, block=BLOCK, **options)


def _dist(inputs, mask=None, **options):
    return samplers.TokenCategorical(*inputs, mask=mask, max_kept=K, block=BLOCK, **options)


def _hidden_and_unembedding(seed=0, rows=N, bias=False):
    rng = np.random.default_rng(seed)
    hidden = rng.normal(size=(rows, D)).astype(np.float32)
    unembedding = (0.8 * rng.normal(size=(D, V))).astype(np.float32)
    if not bias:
        return jnp.asarray(hidden), jnp.asarray(unembedding)
    return jnp.asarray(hidden), jnp.asarray(unembedding), jnp.asarray(rng.normal(size=V), "float32")


def _mask(seed=0, rows=N):
    rng = np.random.default_rng(seed + 100)
    mask = rng.random((rows, V)) < 0.6
    mask[:, 0] = True
    return mask


def _log_probs64(inputs, mask, temperature=1.0):
    """float64 log-probabilities over the whole vocabulary, ``[N, V]``."""
    hidden, unembedding, *bias = (np.asarray(a, np.float64) for a in inputs)
    logits = (hidden @ unembedding + (bias[0] if bias else 0.0)) / temperature
    return masked_log_softmax_float64(logits, mask)


def _token(extras):
    return extras["token"] if isinstance(extras, dict) else extras


@functools.partial(jax.jit, static_argnums=0)
def _merged_call(graphdef, variables, state, inputs, extras, mask):
    return nnx.merge(graphdef, variables)(state, inputs, extras, mask=mask)


def _jax_jit_call(head, state, inputs, extras=None, mask=None):
    """The call under ``jax.jit``, the head split into its graph and variables: with
    per-token streams in the state, no call draws from the module's stream."""
    return _merged_call(*nnx.split(head), state, inputs, extras, mask)


CALLS = {"eager": eager_call, "jax.jit": _jax_jit_call, "nnx.jit": jitted_call}
DEFAULT_TIER = {("full", "nnx.jit"), ("top_p", "nnx.jit"), ("top_k+min_p", "jax.jit")}


@pytest.mark.parametrize(
    "truncation, call",
    [
        pytest.param(t, c, id=f"{t}-{c}", marks=() if (t, c) in DEFAULT_TIER else SLOW)
        for t in TRUNCATIONS
        for c in CALLS
    ],
)
def test_a_replay_reproduces_the_rollout_bit_for_bit(truncation, call):
    options, per_env = TRUNCATIONS[truncation], call == "jax.jit"
    rollout_head = _token_head(**options, per_env_streams=per_env)
    replay_head = _token_head(**options, per_env_streams=per_env)
    inputs, mask = _hidden_and_unembedding(), _mask()
    state = rollout_head.initialize_state(N) if per_env else ()
    out = CALLS[call](rollout_head, state, inputs, mask=mask)
    again = CALLS[call](replay_head, state, inputs, out.rollout_extras, mask)
    old = np.asarray(out.output["log_likelihood"])
    assert old.shape == (N,) and np.all(np.isfinite(old))
    np.testing.assert_array_equal(again.output["log_likelihood"], old)
    np.testing.assert_array_equal(again.output["action"], out.output["action"])
    np.testing.assert_array_equal(_token(out.rollout_extras), out.output["action"])
    # The rollout's log-likelihood and entropy cost against float64, on its support.
    log_probs = _log_probs64(inputs, mask, options.get("temperature", 1.0))
    if options:
        support = np.asarray(out.rollout_extras["support"])
        assert support.shape == (N, K) and np.all(support[:, 0] >= 0)
        kept = np.zeros((N, V + 1), bool)  # padding marks the extra column
        np.put_along_axis(kept, np.where(support >= 0, support, V), True, -1)
        log_probs = np.where(kept[:, :V], log_probs, -np.inf)
        log_probs -= special.logsumexp(log_probs, axis=-1, keepdims=True)
    action = np.asarray(out.output["action"])
    expected = np.take_along_axis(log_probs, action[:, None], -1)[:, 0]
    np.testing.assert_allclose(old, expected, rtol=1e-5, atol=1e-5)
    probs = np.exp(log_probs)
    entropy = -np.sum(probs * np.where(probs > 0, log_probs, 0.0), -1)
    for o in (out, again):
        np.testing.assert_allclose(o.regularization_loss, -WEIGHT * entropy, rtol=1e-5, atol=1e-6)


@nnx.jit
def _ppo_through_head(head, inputs, extras, old, advantage, mask):
    def loss(inputs):
        out = head((), inputs, extras, mask=mask)
        log_likelihood = out.output["log_likelihood"]
        return _ppo(log_likelihood, old, advantage, out.regularization_loss), log_likelihood

    return jax.value_and_grad(loss, has_aux=True)(inputs)


@functools.partial(jax.jit, static_argnames="truncation")
def _ppo_direct(inputs, extras, old, advantage, mask, truncation):
    def loss(inputs):
        dist = _dist(inputs, mask, **TRUNCATIONS[truncation])
        _, log_likelihood = dist.replay(extras)
        if dist.truncated:
            entropy = dist.entropy_on_support(extras["support"])
        else:
            entropy = dist.full_entropy()
        return _ppo(log_likelihood, old, advantage, -WEIGHT * entropy)

    return jax.value_and_grad(loss)(inputs)


def _ppo(log_likelihood, old, advantage, regularization):
    ratio = jnp.exp(log_likelihood - old)
    clipped = jnp.clip(ratio, 0.8, 1.2)
    surrogate = jnp.minimum(ratio * advantage, clipped * advantage)
    return -jnp.mean(surrogate) + jnp.mean(regularization)


@pytest.mark.parametrize("truncation", [slow("full", id="full"), "top_p"])
def test_the_ppo_loss_and_its_gradient_are_those_of_the_distribution(truncation):
    """The first PPO ratio is exactly 1; after an update, the loss and its gradient
    w.r.t. the hidden states, the unembedding and the bias are TokenCategorical's."""
    head = _token_head(**TRUNCATIONS[truncation])
    rollout_inputs, mask = _hidden_and_unembedding(seed=6, bias=True), _mask(seed=6)
    out = jitted_call(head, (), rollout_inputs, mask=mask)
    extras, old = out.rollout_extras, out.output["log_likelihood"]
    advantage = jnp.asarray(np.random.default_rng(6).normal(size=N), jnp.float32)
    (_, first), _ = _ppo_through_head(head, rollout_inputs, extras, old, advantage, mask)
    assert np.all(np.exp(np.asarray(first) - np.asarray(old)) == 1.0)  # the first ratio
    inputs = tuple(a + 0.05 for a in rollout_inputs)  # the parameters after an update
    (value, _), grads = _ppo_through_head(head, inputs, extras, old, advantage, mask)
    expected, expected_grads = _ppo_direct(inputs, extras, old, advantage, mask, truncation)
    assert keys_drawn(head) == 2  # the rollout's keys only
    np.testing.assert_allclose(value, expected, rtol=1e-6)
    for got, want in zip(grads, expected_grads, strict=True):  # hidden, unembedding, bias
        assert np.any(np.asarray(want) != 0)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("truncation", [slow("full", id="full"), "top_p"])
def test_eval_takes_the_greedy_token_and_draws_no_key(truncation):
    options = TRUNCATIONS[truncation]
    head = _token_head(**options)
    inputs, mask = _hidden_and_unembedding(seed=2), _mask(seed=2)
    head.eval()
    out = jitted_call(head, (), inputs, mask=mask)
    assert keys_drawn(head) == 0
    greedy = np.argmax(_log_probs64(inputs, mask), -1)  # the truncation keeps it
    np.testing.assert_array_equal(out.output["action"], greedy)
    np.testing.assert_array_equal(out.output["action"], _dist(inputs, mask, **options).mode())
    head.train()
    again = jitted_call(head, (), inputs, out.rollout_extras, mask)
    np.testing.assert_array_equal(again.output["log_likelihood"], out.output["log_likelihood"])


@pytest.mark.parametrize("truncation", ["full", slow("top_p", id="top_p")])
def test_a_forbidden_token_is_never_sampled_and_scores_minus_inf(truncation):
    head = _token_head(**TRUNCATIONS[truncation])
    hidden, unembedding = _hidden_and_unembedding(seed=3)
    inputs = (jnp.tile(hidden[:1], (N, 1)), unembedding)  # N draws from one distribution
    favourite = int(np.argmax(np.asarray(hidden[0] @ unembedding)))
    mask = np.ones((N, V), bool)
    mask[:, [favourite, (favourite + 1) % V]] = False  # the most probable tokens
    for _ in range(4):
        out = jitted_call(head, (), inputs, mask=mask)
        action = np.asarray(out.output["action"])
        assert np.all(mask[0, action]) and np.all(np.isfinite(out.output["log_likelihood"]))
    # A replay whose mask also forbids the token of every other row scores -inf there.
    forbid = mask.copy()
    forbid[np.arange(0, N, 2), action[::2]] = False
    again = jitted_call(head, (), inputs, out.rollout_extras, forbid)
    log_likelihood = np.asarray(again.output["log_likelihood"])
    assert np.all(log_likelihood[::2] == -np.inf)
    assert np.all(np.isfinite(log_likelihood[1::2]))


@pytest.mark.slow
def test_a_sub_batch_with_its_keys_samples_the_same_tokens_bit_for_bit():
    head = _token_head(top_p=0.8, per_env_streams=True)
    hidden, unembedding = _hidden_and_unembedding(seed=4)
    mask = _mask(seed=4)
    keys = head.initialize_state(N)
    whole = jitted_call(head, keys, (hidden, unembedding), mask=mask)
    part = jitted_call(head, keys[3:9], (hidden[3:9], unembedding), mask=mask[3:9])
    for name in ("action", "log_likelihood"):
        np.testing.assert_array_equal(part.output[name], whole.output[name][3:9])
    np.testing.assert_array_equal(
        part.rollout_extras["support"], whole.rollout_extras["support"][3:9]
    )
    # The keys advance: the next step draws other tokens.
    later = jitted_call(head, whole.next_state, (hidden, unembedding), mask=mask)
    assert np.any(np.asarray(later.output["action"]) != np.asarray(whole.output["action"]))


@pytest.mark.parametrize(
    "per_env_streams", [pytest.param(False, id="shared-stream"), slow(True, id="per-env")]
)
def test_a_replay_draws_no_key(per_env_streams):
    head = _token_head(top_p=0.8, per_env_streams=per_env_streams)
    inputs, mask = _hidden_and_unembedding(seed=5), _mask(seed=5)
    state = head.initialize_state(N) if per_env_streams else ()
    drawn = keys_drawn(head)
    out = jitted_call(head, state, inputs, mask=mask)
    assert keys_drawn(head) == drawn + (0 if per_env_streams else 2)
    drawn = keys_drawn(head)
    again = jitted_call(head, state, inputs, out.rollout_extras, mask)
    assert keys_drawn(head) == drawn
    if per_env_streams:
        np.testing.assert_array_equal(
            jax.random.key_data(again.next_state), jax.random.key_data(state)
        )


@pytest.mark.parametrize("truncation", [t if t == "top_p" else slow(t, id=t) for t in TRUNCATIONS])
def test_the_metrics_against_float64(truncation):
    options = TRUNCATIONS[truncation]
    inputs, mask = _hidden_and_unembedding(seed=7), _mask(seed=7)
    call = _jax_jit_call if truncation == "top_k+min_p" else jitted_call  # the programs above
    head = _token_head(**options, per_env_streams=call is _jax_jit_call, kept_mass_metric=True)
    out = call(head, head.initialize_state(N) if head.per_env_streams else (), inputs, mask=mask)
    size, kept_mass = np.asarray(out.metrics["support_size"]), out.metrics["kept_mass"]
    if not options:
        np.testing.assert_array_equal(size, np.full(N, V))
        np.testing.assert_array_equal(kept_mass, np.ones(N))
        return
    support = np.asarray(out.rollout_extras["support"])
    np.testing.assert_array_equal(size, np.sum(support >= 0, -1))
    log_probs = _log_probs64(inputs, mask, options.get("temperature", 1.0))
    kept = np.take_along_axis(log_probs, np.maximum(support, 0), -1)
    expected = np.exp(special.logsumexp(np.where(support >= 0, kept, -np.inf), axis=-1))
    np.testing.assert_allclose(kept_mass, expected, rtol=1e-5)
    assert np.all(expected < 1) and np.all(size <= K)


@pytest.mark.parametrize(
    "kept_mass_metric", [pytest.param(False, id="False"), slow(True, id="True")]
)
def test_a_loss_pass_streams_the_vocabulary_only_for_the_kept_mass(kept_mass_metric):
    # A truncated loss pass scores the stored support alone; its metrics returned as
    # they are, the whole vocabulary's matrix products appear only for kept_mass.
    head = _token_head(top_p=0.8, kept_mass_metric=kept_mass_metric)
    inputs = _hidden_and_unembedding(seed=8)
    extras = head((), inputs).rollout_extras
    graph, state = nnx.split(head)

    def loss(state, inputs):
        out = nnx.merge(graph, state)((), inputs, extras)
        return jnp.sum(out.output["log_likelihood"]), out.metrics

    jaxpr = str(jax.make_jaxpr(jax.value_and_grad(loss, argnums=1, has_aux=True))(state, inputs))
    metrics = jax.eval_shape(loss, state, inputs)[1]
    assert set(metrics) == ({"support_size", "kept_mass"} if kept_mass_metric else {"support_size"})
    assert ("dot_general" in jaxpr) == kept_mass_metric


def test_the_network_output_must_be_hidden_states_and_an_unembedding():
    head = _token_head()
    hidden, unembedding = _hidden_and_unembedding()
    takes = r"TokenSampler takes inputs=\(hidden \[\*batch, D\], unembedding \[D, V\]\)"
    with pytest.raises(TypeError, match=takes + r".*got float of length|got float;"):
        head((), 1.0)
    with pytest.raises(TypeError, match=takes + r".*got tuple of length 1;"):
        head((), (hidden,))
    with pytest.raises(TypeError, match=r"got list of length 4;"):
        head.distribution([hidden, unembedding, unembedding[0], unembedding[0]])
    wrong = r"vocab_size=61, so the unembedding must be \[D, V\] with V = 61, got \(8, 60\)"
    with pytest.raises(ValueError, match=wrong):
        head((), (hidden, unembedding[:, :60]))
    wrong = r"so the logits must be \[\*batch, V\] with V = 61, got \(12, 60\)"
    with pytest.raises(ValueError, match=wrong):
        head((), (hidden @ unembedding)[:, :60])
    with pytest.raises(TypeError, match=r"inputs dict takes .* got \['weights'\]"):
        head((), {"hidden": hidden, "weights": unembedding})
    with pytest.raises(TypeError, match=r"the hidden states .* or the logits, one of them"):
        head((), {"embedding": unembedding.T})
    with pytest.raises(AttributeError, match="TokenSampler has no num_params"):
        head.num_params  # noqa: B018
    assert keys_drawn(head) == 0  # refused before drawing a key


@pytest.mark.parametrize(
    "options, error, match",
    [
        ({"vocab_size": 0}, ValueError, "vocab_size must be a positive integer, got 0"),
        ({"vocab_size": 6.0}, TypeError, "vocab_size must be a positive integer, got 6.0"),
        ({"top_p": 1.5}, ValueError, r"top_p must be in \(0, 1\], got 1.5"),
        ({"min_p": -0.1}, ValueError, "min_p must be >= 0.0, got -0.1"),
        ({"top_k": 20}, ValueError, "top_k must be at most max_kept = 16, got 20"),
        ({"temperature": 0.0}, ValueError, "temperature must be > 0.0, got 0.0"),
        ({"block": (0, 16)}, ValueError, "block must be a positive integer, got 0"),
    ],
    ids=["vocab_size=0", "vocab_size-float", "top_p", "min_p", "top_k", "temperature", "block"],
)
def test_bad_options_raise_at_construction(options, error, match):
    options = {"vocab_size": V, "max_kept": K, **options}
    with pytest.raises(error, match=match):
        samplers.TokenSampler(nnx.Rngs(0), WEIGHT, **options)


def test_a_composite_refuses_it_for_its_tuple_of_inputs():
    with pytest.raises(ValueError, match="num_params"):
        samplers.CompositeSampler({"token": _token_head()}, rngs=nnx.Rngs(0))


def test_nnx_jit_traces_once_for_new_inputs_and_state():
    head, mask = _token_head(top_p=0.8), _mask()
    out = jitted_call(head, (), _hidden_and_unembedding(seed=8), mask=mask)
    jitted_call(head, (), _hidden_and_unembedding(seed=8), out.rollout_extras, mask)
    traces = len(TRACES)
    later = jitted_call(head, (), _hidden_and_unembedding(seed=9), mask=mask)
    jitted_call(head, (), _hidden_and_unembedding(seed=9), later.rollout_extras, mask)
    assert len(TRACES) == traces


@pytest.mark.slow
def test_logits_and_a_dict_of_arrays_with_per_row_options_are_network_outputs():
    hidden, unembedding, bias = _hidden_and_unembedding(seed=10, bias=True)
    logits = hidden @ unembedding + bias[None]
    head = _token_head(top_p=0.8)
    key_head = _token_head(top_p=0.8)
    out = jitted_call(head, (), (hidden, unembedding, bias))
    by_logits = jitted_call(key_head, (), logits)  # the same keys, the same distribution
    np.testing.assert_array_equal(by_logits.output["action"], out.output["action"])
    np.testing.assert_allclose(
        by_logits.output["log_likelihood"], out.output["log_likelihood"], rtol=1e-5, atol=1e-6
    )
    again = jitted_call(key_head, (), logits, by_logits.rollout_extras)
    np.testing.assert_array_equal(
        again.output["log_likelihood"], by_logits.output["log_likelihood"]
    )
    # Per-row options in a dict replace the head's for the call, and replay bit for bit.
    options = {"temperature": jnp.linspace(0.5, 1.5, N), "top_p": jnp.linspace(0.5, 1.0, N)}
    inputs = {"hidden": hidden, "embedding": unembedding.T, "bias": bias, **options}
    rolled = jitted_call(head, (), inputs)
    replayed = jitted_call(head, (), inputs, rolled.rollout_extras)
    np.testing.assert_array_equal(
        replayed.output["log_likelihood"], rolled.output["log_likelihood"]
    )
    support = np.asarray(rolled.rollout_extras["support"])
    expected = _dist((hidden, unembedding, bias), **options).support()
    np.testing.assert_array_equal(support, expected)
    assert support[-1, 0] == samplers.distributions.tokens.FULL  # top_p 1: untruncated
    np.testing.assert_array_equal(rolled.metrics["support_size"][-1], V)


def test_temperature_zero_points_to_eval():
    with pytest.raises(ValueError, match=r"temperature 0 is greedy decoding.*eval\(\)"):
        samplers.TokenSampler(nnx.Rngs(0), WEIGHT, vocab_size=V, temperature=0)
