"""The discrete heads ``CategoricalSampler``, ``MultiDiscreteSampler`` and
``MultiBinarySampler``: replay bit for bit, masks in rollout and replay, ``eval()``,
per-environment streams, and the loss and metrics against float64 formulas."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import special

import samplers
from tests._tiers import SLOW, each_value_once
from tests.helpers import TRACES, eager_call, jitted_call
from tests.reference import masked_log_softmax_float64

KINDS = ("categorical", "multi_discrete", "multi_binary")
NUM_ACTIONS, NVEC, NUM_BITS = 4, (3, 1, 5, 2), 3
WEIGHT = 0.1
B = 8


def _discrete_head(kind, rngs=None, **options):
    rngs = nnx.Rngs(0) if rngs is None else rngs
    if kind == "categorical":
        return samplers.CategoricalSampler(rngs, WEIGHT, num_actions=NUM_ACTIONS, **options)
    if kind == "multi_discrete":
        return samplers.MultiDiscreteSampler(rngs, WEIGHT, nvec=NVEC, **options)
    return samplers.MultiBinarySampler(rngs, WEIGHT, num_bits=NUM_BITS, **options)


NUM_PARAMS = {"categorical": NUM_ACTIONS, "multi_discrete": sum(NVEC), "multi_binary": NUM_BITS}


def _mask_shape(kind, batch_shape):
    if kind == "multi_binary":
        return (*batch_shape, NUM_BITS, 2)
    return (*batch_shape, NUM_PARAMS[kind])


def _parts(kind, values):
    """Views of a mask (or flat logits) per sub-action, each ``[*batch, choices]``."""
    if kind == "categorical":
        return [values]
    if kind == "multi_discrete":
        return np.split(values, np.cumsum(NVEC)[:-1], axis=-1)
    return [values[..., i, :] for i in range(NUM_BITS)]


def _choice_logits(kind, logits):
    """float64 logits of each sub-action's choices; a bit's are ``[0, log-odds]``."""
    logits = np.asarray(logits, np.float64)
    if kind == "multi_binary":
        return [
            np.stack([np.zeros_like(logits[..., i]), logits[..., i]], -1) for i in range(NUM_BITS)
        ]
    return _parts(kind, logits)


def _sub_actions(kind, action):
    action = np.asarray(action)
    return [action] if kind == "categorical" else [action[..., i] for i in range(action.shape[-1])]


def _logits_and_mask(kind, batch_shape, seed=0, scale=2.0):
    """float32 logits and a random mask that allows a choice of every sub-action."""
    rng = np.random.default_rng(seed)
    logits = (scale * rng.normal(size=(*batch_shape, NUM_PARAMS[kind]))).astype(np.float32)
    mask = rng.random(_mask_shape(kind, batch_shape)) < 0.6
    for part in _parts(kind, mask):
        flat = part.reshape(-1, part.shape[-1])
        none = ~flat.any(-1)
        flat[none, rng.integers(part.shape[-1], size=none.sum())] = True
        part[...] = flat.reshape(part.shape)
    return logits, mask


def _oracle(kind, logits, mask, action):
    """float64 log-likelihood of ``action``, entropy, allowed combinations and the
    probability that the unmasked logits put on forbidden choices, per batch element."""
    log_likelihood = entropy = log_allowed_mass = 0.0
    allowed = 1
    for x, m, a in zip(
        _choice_logits(kind, logits), _parts(kind, mask), _sub_actions(kind, action), strict=True
    ):
        log_probs = masked_log_softmax_float64(x, m)
        log_likelihood = log_likelihood + np.take_along_axis(log_probs, a[..., None], -1)[..., 0]
        probs = np.exp(log_probs)
        entropy = entropy - np.sum(np.where(m, probs * np.where(m, log_probs, 0.0), 0.0), -1)
        allowed = allowed * m.sum(-1)
        # The unmasked softmax's forbidden mass f; log(1 - f) without cancellation.
        log_all = special.logsumexp(x, axis=-1)
        log_forbidden = special.logsumexp(np.where(m, -np.inf, x), axis=-1) - log_all
        log_allowed = special.logsumexp(np.where(m, x, -np.inf), axis=-1) - log_all
        small = log_forbidden < np.log(0.5)
        log_allowed_mass = log_allowed_mass + np.where(
            small, np.log1p(-np.exp(np.minimum(log_forbidden, np.log(0.5)))), log_allowed
        )
    return log_likelihood, entropy, allowed, -np.expm1(log_allowed_mass)


def _mode(kind, logits, mask):
    modes = [
        np.argmax(np.where(m, x, -np.inf), -1)
        for x, m in zip(_choice_logits(kind, logits), _parts(kind, mask), strict=True)
    ]
    return modes[0] if kind == "categorical" else np.stack(modes, -1)


def _is_allowed(kind, mask, action):
    """Whether every sub-action of ``action`` is an allowed choice, per batch element."""
    return np.all(
        [
            np.take_along_axis(m, a[..., None], -1)[..., 0]
            for m, a in zip(_parts(kind, mask), _sub_actions(kind, action), strict=True)
        ],
        axis=0,
    )


def _kinds(*fast):
    """The kinds as parameters, those not in ``fast`` in the slow tier only."""
    return [pytest.param(k, id=k, marks=() if k in fast else SLOW) for k in KINDS]


def _key_data(keys):
    return np.asarray(jax.random.key_data(keys))


def _state(head, batch_shape):
    if not head.per_env_streams:
        return ()
    return head.initialize_state(int(np.prod(batch_shape, dtype=int))).reshape(batch_shape)


REPLAY_NAMES, REPLAY_CASES = each_value_once(
    {
        "kind": {kind: kind for kind in KINDS},
        "batch_shape": {"(B,)": (B,), "()": (), "(T,B)": (2, 4)},
        "jitted": {"nnx.jit": True, "eager": False},
        "per_env_streams": {"shared-stream": False, "per-env-streams": True},
    },
    slow_ids=("eager",),
)


@pytest.mark.parametrize(REPLAY_NAMES, REPLAY_CASES)
def test_replay_with_the_same_mask_reproduces_the_log_likelihood_bit_for_bit(
    kind, batch_shape, jitted, per_env_streams
):
    logits, mask = _logits_and_mask(kind, batch_shape)
    call = jitted_call if jitted else eager_call
    rollout_rngs, replay_rngs = nnx.Rngs(0), nnx.Rngs(0)
    rollout_head = _discrete_head(kind, rollout_rngs, per_env_streams=per_env_streams)
    replay_head = _discrete_head(kind, replay_rngs, per_env_streams=per_env_streams)
    out = call(rollout_head, _state(rollout_head, batch_shape), logits, mask=mask)
    replay_state = _state(replay_head, batch_shape)
    drawn = int(replay_rngs.default.count[...])
    again = call(replay_head, replay_state, logits, out.rollout_extras, mask)
    old, new = np.asarray(out.output["log_likelihood"]), np.asarray(again.output["log_likelihood"])
    assert old.shape == batch_shape and np.all(np.isfinite(old))
    np.testing.assert_array_equal(new, old)
    assert np.all(np.exp(new - old) == 1.0)  # the PPO ratio
    np.testing.assert_array_equal(again.output["action"], out.output["action"])
    np.testing.assert_array_equal(out.rollout_extras, out.output["action"])
    expected, *_ = _oracle(kind, logits, mask, out.output["action"])
    np.testing.assert_allclose(old, expected, rtol=1e-5, atol=1e-6)
    assert np.all(_is_allowed(kind, mask, out.output["action"]))
    # A replay needs no noise: it leaves the stream, and the per-environment keys, as
    # they were.
    assert int(replay_rngs.default.count[...]) == drawn
    if per_env_streams:
        np.testing.assert_array_equal(_key_data(again.next_state), _key_data(replay_state))
    # A further rollout with new logits and state reuses the traced program.
    traces = len(TRACES)
    later = call(rollout_head, out.next_state, logits + 1.0, mask=mask)
    assert len(TRACES) == traces + (not jitted)
    expected, *_ = _oracle(kind, logits + 1.0, mask, later.output["action"])
    np.testing.assert_allclose(later.output["log_likelihood"], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", _kinds("multi_discrete"))
def test_a_stored_action_the_replay_mask_forbids_scores_minus_inf_and_zero_ppo_gradient(kind):
    logits, mask = _logits_and_mask(kind, (B,))
    head = _discrete_head(kind)
    out = jitted_call(head, (), logits, mask=mask)
    action, old = out.rollout_extras, out.output["log_likelihood"]
    # The replay forbids element 0's stored choice of its first sub-action (and allows
    # every other choice, so that the element still has a distribution).
    replay_mask = mask.copy()
    first = _parts(kind, replay_mask)[0]
    first[0] = True
    first[0, _sub_actions(kind, action)[0][0]] = False
    advantage = jnp.linspace(-1.0, 1.0, B)

    def loss(head, logits):
        replay = head((), logits, action, mask=replay_mask)
        new = replay.output["log_likelihood"]
        ppo = -(jnp.exp(new - old) * advantage).sum()
        # The metrics, added to the loss, must change no gradient.
        return ppo + sum(jnp.sum(m) for m in replay.metrics.values()), new

    grad, new = nnx.jit(nnx.grad(loss, argnums=1, has_aux=True))(head, jnp.asarray(logits))
    new, grad = np.asarray(new), np.asarray(grad)
    assert new[0] == -np.inf and not np.isnan(new[0])
    np.testing.assert_array_equal(new[1:], np.asarray(old)[1:])
    assert np.all(np.isfinite(grad)) and np.all(grad[0] == 0)
    # The other elements' gradients: -advantage * d log p(a) / d logits, which is
    # 1[a = j] - p_j over each sub-action's allowed choices (a bit: a - p(one)).
    expected = []
    for x, m, a in zip(
        _choice_logits(kind, logits), _parts(kind, mask), _sub_actions(kind, action), strict=True
    ):
        probs = np.exp(masked_log_softmax_float64(x, m))
        part = np.where(m, (np.arange(x.shape[-1]) == np.asarray(a)[:, None]) - probs, 0.0)
        expected.append(part[:, 1:] if kind == "multi_binary" else part)
    expected = -np.asarray(advantage)[:, None] * np.concatenate(expected, -1)
    np.testing.assert_allclose(grad[1:], expected[1:], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", _kinds("categorical"))
def test_an_element_with_nothing_allowed_has_nan_log_likelihood_and_acts_zero(kind):
    logits, mask = _logits_and_mask(kind, (B,))
    _parts(kind, mask)[-1][1] = False  # element 1's last sub-action allows nothing
    head = _discrete_head(kind)
    for mode in ("train", "eval"):
        getattr(head, mode)()
        out = jitted_call(head, (), logits, mask=mask)
        again = jitted_call(head, (), logits, out.rollout_extras, mask=mask)
        for result in (out, again):
            log_likelihood = np.asarray(result.output["log_likelihood"])
            assert np.isnan(log_likelihood[1]) and np.all(np.isfinite(np.delete(log_likelihood, 1)))
            assert np.isnan(result.regularization_loss[1])
        assert _sub_actions(kind, out.output["action"])[-1][1] == 0
        assert out.metrics["allowed_actions"][1] == 0 and out.metrics["masked_probability"][1] == 1


@pytest.mark.parametrize("kind", _kinds("multi_binary"))
def test_sampled_actions_are_never_masked(kind):
    """Over 30 seeds, and 30 steps of per-environment streams, with the unmasked logits
    favouring the forbidden choices by e^10."""
    logits, mask = _logits_and_mask(kind, (B,), seed=1)
    if kind == "multi_binary":  # the forbidden value of a forced bit favoured
        logits = logits + 10.0 * ~mask[..., 1] - 10.0 * ~mask[..., 0]
    else:
        logits = np.where(mask, logits, logits + 10.0)
    logits = logits.astype(np.float32)
    actions = [
        jitted_call(_discrete_head(kind, nnx.Rngs(seed)), (), logits, mask=mask)
        for seed in range(30)
    ]
    head = _discrete_head(kind, per_env_streams=True)
    state = head.initialize_state(B)
    for _ in range(30):
        actions.append(jitted_call(head, state, logits, mask=mask))
        state = actions[-1].next_state
    for out in actions:
        assert np.all(_is_allowed(kind, mask, out.output["action"]))
        assert np.all(np.isfinite(out.output["log_likelihood"]))
    # Not always the same actions: the draws differ between seeds and between steps.
    drawn = {np.asarray(out.output["action"]).tobytes() for out in actions}
    assert len(drawn) > 10


@pytest.mark.parametrize("kind", _kinds("categorical"))
def test_eval_acts_with_the_masked_mode_and_train_samples_again(kind):
    logits, mask = _logits_and_mask(kind, (B,), scale=1.0)
    head = _discrete_head(kind)
    head.eval()
    assert head.deterministic
    mode = _mode(kind, logits, mask)
    for _ in range(2):
        out = jitted_call(head, (), logits, mask=mask)
        np.testing.assert_array_equal(out.output["action"], mode)
    expected, *_ = _oracle(kind, logits, mask, mode)
    np.testing.assert_allclose(out.output["log_likelihood"], expected, rtol=1e-5, atol=1e-6)
    overridden = jitted_call(head, (), logits, mask=mask, deterministic=False).output["action"]
    assert not np.array_equal(overridden, mode)
    head.train()
    assert not head.deterministic
    samples = [
        np.asarray(jitted_call(head, (), logits, mask=mask).output["action"]) for _ in range(3)
    ]
    assert not np.array_equal(samples[0], mode) and not np.array_equal(samples[0], samples[1])
    assert all(np.all(_is_allowed(kind, mask, s)) for s in samples)


@pytest.mark.parametrize("kind", _kinds("multi_discrete"))
def test_per_env_streams_an_environment_s_samples_do_not_depend_on_the_batch_split(kind):
    logits, mask = _logits_and_mask(kind, (B,))
    head = _discrete_head(kind, per_env_streams=True)
    keys = head.initialize_state(B)
    whole = jitted_call(head, keys, logits, mask=mask)
    # Each environment alone (batch shape ()) draws what it draws in the whole batch.
    alone = [jitted_call(head, keys[i], logits[i], mask=mask[i]) for i in range(B)]
    for name in ("action", "log_likelihood"):
        joined = np.stack([np.asarray(one.output[name]) for one in alone])
        np.testing.assert_array_equal(joined, whole.output[name])
    joined = np.stack([_key_data(one.next_state) for one in alone])
    np.testing.assert_array_equal(joined, _key_data(whole.next_state))
    # The keys advance: the next step draws differently.
    later = jitted_call(head, whole.next_state, logits, mask=mask)
    assert not np.array_equal(later.output["action"], whole.output["action"])


LOSS_NAMES, LOSS_CASES = each_value_once(
    {"kind": {kind: kind for kind in KINDS}, "dtype": {"float32": "float32", "float64": "float64"}}
)


@pytest.mark.parametrize(LOSS_NAMES, LOSS_CASES)
def test_regularization_loss_and_metrics_match_float64_formulas(kind, dtype):
    tol = 1e-5 if dtype == "float32" else 1e-12
    logits, mask = _logits_and_mask(kind, (B,), seed=2)
    with jax.enable_x64(dtype == "float64"):
        out = jitted_call(_discrete_head(kind), (), jnp.asarray(logits, dtype), mask=mask)
        assert out.regularization_loss.dtype == dtype
        out = jax.tree.map(np.asarray, out)
    log_likelihood, entropy, allowed, masked_probability = _oracle(
        kind, logits, mask, out.output["action"]
    )
    np.testing.assert_allclose(out.output["log_likelihood"], log_likelihood, rtol=tol, atol=tol)
    np.testing.assert_allclose(out.regularization_loss, -WEIGHT * entropy, rtol=tol, atol=tol)
    np.testing.assert_array_equal(out.metrics["allowed_actions"], allowed)
    np.testing.assert_allclose(out.metrics["masked_probability"], masked_probability, rtol=tol)
    assert np.all((masked_probability > 0) & (masked_probability < 1))


def test_multi_binary_log_odds_of_plus_or_minus_inf_make_a_certain_bit():
    logits = np.tile(np.float32([np.inf, -np.inf, 0.3]), (B, 1))
    mask = np.ones((B, NUM_BITS, 2), bool)
    mask[1, 0, 1] = False  # element 1 forbids its sure one: bit 0 is zero there
    out = jax.tree.map(
        np.asarray, jitted_call(_discrete_head("multi_binary"), (), logits, mask=mask)
    )
    action = out.output["action"]
    np.testing.assert_array_equal(action[:, 0], np.arange(B) != 1)
    assert np.all(action[:, 1] == 0)
    # Only bit 2 is uncertain: Bernoulli(sigmoid(0.3)).
    log_p = np.where(action[:, 2] == 1, special.log_expit(0.3), special.log_expit(-0.3))
    np.testing.assert_allclose(out.output["log_likelihood"], log_p, rtol=1e-6)
    p = special.expit(0.3)
    entropy = -(p * np.log(p) + (1 - p) * np.log1p(-p))
    np.testing.assert_allclose(out.regularization_loss, -WEIGHT * entropy, rtol=1e-6)
    # Before the mask, element 1's bit 0 is one for sure: all its probability is forbidden.
    np.testing.assert_array_equal(out.metrics["masked_probability"], np.arange(B) == 1)
    np.testing.assert_array_equal(out.metrics["allowed_actions"], np.where(np.arange(B) == 1, 4, 8))


def _tiny(kind, forbidden):
    """Logits [B, num_params] whose forbidden choices hold about ``forbidden`` of the
    unmasked probability (element 0: one forbidden choice; element 2: every choice of
    the first sub-action but one forbidden) or all but about ``forbidden`` (element 1);
    the other elements repeat element 0."""
    log_tiny = np.log(forbidden)
    if kind == "multi_binary":  # bit 0 may not be one; the others are free
        logits = np.array([[log_tiny, 0.5, -0.3], [-log_tiny, 0.5, -0.3], [log_tiny, 0.0, 0.0]])
        mask = np.ones((3, NUM_BITS, 2), bool)
        mask[:, 0, 1] = False
    else:
        n = NUM_ACTIONS if kind == "categorical" else NVEC[0]
        logits = np.zeros((3, NUM_PARAMS[kind]))
        logits[:2, :3] = [0.2, log_tiny, -0.3]
        logits[1, 1] = -log_tiny
        logits[2, 1:n] = np.log(forbidden / (n - 1))
        mask = np.ones((3, NUM_PARAMS[kind]), bool)
        mask[:2, 1] = False
        mask[2, 1:n] = False
    rows = np.minimum(np.arange(B), 3) % 3
    return logits[rows].astype(np.float32), mask[rows]


@pytest.mark.parametrize("kind", _kinds("multi_discrete"))
def test_a_tiny_forbidden_probability_is_not_rounded_to_zero_in_float32(kind):
    head = _discrete_head(kind)
    for forbidden in (1e-20, 1e-35):
        logits, mask = _tiny(kind, forbidden)
        out = jitted_call(head, (), logits, mask=mask)
        *_, expected = _oracle(kind, logits, mask, np.asarray(out.output["action"]))
        tiny = expected[[0, 2]]
        assert np.all((tiny > forbidden / 10) & (tiny < 1.01 * forbidden)) and expected[1] == 1
        np.testing.assert_allclose(out.metrics["masked_probability"], expected, rtol=1e-5)


@pytest.mark.parametrize("kind", _kinds("categorical"))
def test_num_params_is_the_logits_width_and_without_a_mask_nothing_is_forbidden(kind):
    head = _discrete_head(kind)
    assert head.num_params == {"categorical": 4, "multi_discrete": 11, "multi_binary": 3}[kind]
    logits, _ = _logits_and_mask(kind, (B,))
    out = jitted_call(head, (), logits)
    shape = (B,) if kind == "categorical" else (B, {"multi_discrete": 4, "multi_binary": 3}[kind])
    assert out.output["action"].shape == shape and out.output["log_likelihood"].shape == (B,)
    combinations = {"categorical": 4, "multi_discrete": 30, "multi_binary": 8}[kind]
    np.testing.assert_array_equal(out.metrics["allowed_actions"], combinations)
    assert np.all(out.metrics["masked_probability"] == 0)
    everything = np.ones(_mask_shape(kind, (B,)), bool)
    log_likelihood, entropy, *_ = _oracle(kind, logits, everything, out.output["action"])
    np.testing.assert_allclose(out.output["log_likelihood"], log_likelihood, rtol=1e-5)
    np.testing.assert_allclose(out.regularization_loss, -WEIGHT * entropy, rtol=1e-5)


ERRORS = {
    "categorical": (r"mask must have shape \(8, 4\), logits' shape, got \(8, 3\)", r"\(8,\)"),
    "multi_discrete": (r"mask must have shape \(8, 11\), got \(8, 3\)", r"\(8, 4\)"),
    "multi_binary": (
        r"mask must have shape \(8, 3, 2\) \(bit i may be 0, bit i may be 1\), got \(8, 3\)",
        r"\(8, 3\)",
    ),
}


@pytest.mark.parametrize("kind", _kinds("multi_binary"))
def test_bad_inputs_are_refused_by_name(kind):
    head = _discrete_head(kind)
    name, width = type(head).__name__, head.num_params
    logits, mask = _logits_and_mask(kind, (B,))
    mask_match, action_shape = ERRORS[kind]
    expects = rf"{name} expects logits of shape \[\*batch, {width}\] \(head.num_params\), got"
    with pytest.raises(ValueError, match=rf"{expects} \(8, {width + 1}\); size the network"):
        head((), jnp.zeros((B, width + 1)))
    with pytest.raises(ValueError, match=rf"{expects} \(\)"):
        head((), jnp.zeros(()))
    with pytest.raises(TypeError, match="logits must be numbers, got booleans"):
        head((), jnp.zeros((B, width), bool))
    # Integer logits are taken as distrax.Categorical takes them: as float32.
    integers = jnp.arange(B * width, dtype=jnp.int32).reshape(B, width) % 3
    as_floats = _discrete_head(kind)((), integers.astype(jnp.float32), mask=mask)
    np.testing.assert_array_equal(
        head((), integers, mask=mask).output["log_likelihood"],
        as_floats.output["log_likelihood"],
    )
    with pytest.raises(ValueError, match=mask_match):
        head((), logits, mask=np.ones((B, 3), bool))
    with pytest.raises(TypeError, match=r"mask must be boolean .* got dtype float32"):
        head((), logits, mask=mask.astype(np.float32))
    action = jitted_call(head, (), logits, mask=mask).rollout_extras
    with pytest.raises(TypeError, match="rollout_extras must have an integer dtype"):
        head((), logits, action.astype(jnp.float32), mask=mask)
    with pytest.raises(ValueError, match=rf"the action shape {action_shape}, got \(7"):
        head((), logits, action[:7], mask=mask)


def test_masked_probability_is_nan_where_a_forbidden_logit_is_nan_or_plus_inf():
    head = samplers.CategoricalSampler(nnx.Rngs(0), 0.01, num_actions=3)
    logits = jnp.array([[0.0, jnp.nan, 1.0], [0.0, jnp.inf, 1.0], [0.0, -jnp.inf, 1.0]])
    mask = jnp.array([[True, False, True]] * 3)
    out = head((), logits, jnp.array([2, 2, 2]), mask=mask)
    assert np.all(np.isnan(out.metrics["masked_probability"][:2]))
    assert out.metrics["masked_probability"][2] == 0.0
    # The head itself is unaffected: the forbidden logits reach no other output.
    likelihood, loss = out.output["log_likelihood"], out.regularization_loss
    assert likelihood[0] == likelihood[1] == likelihood[2] and loss[0] == loss[1] == loss[2]
