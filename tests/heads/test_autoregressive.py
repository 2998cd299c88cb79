"""``samplers.AutoregressiveSampler``: the shell around ``samplers.Autoregressive``, its
conditioners, masks that depend on the earlier sub-actions, and its entropy cost."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import samplers
from tests._tiers import slow

B, F = 6, 5
# Unit 0 may only wait (target 0); units 1 and 2 may go anywhere but target 3 for unit 2.
LEGAL = jnp.array([[True, False, False, False], [True] * 4, [True, True, True, False]])


def _legal_targets(prefix):
    return LEGAL[prefix["unit"]]


def _unit_and_target_head(entropy="exact", move=True):
    """A unit, a target legal for it, and (with ``move``) a squashed Normal move."""
    rngs = nnx.Rngs(0)
    steps = {
        "unit": samplers.CategoricalSampler(rngs, 0.0, num_actions=3),
        "target": samplers.CategoricalSampler(rngs, 0.0, num_actions=4),
    }
    if move:
        steps["move"] = samplers.SquashedNormalSampler(rngs, 0.0, action_dim=2)
    return samplers.AutoregressiveSampler(
        steps, features=F, entropy_weight=0.1, rngs=rngs, entropy=entropy
    )


def _features(seed=1):
    return jax.random.normal(jax.random.key(seed), (B, F))


MASK = {
    "unit": jnp.array([[False, True, True]] * 3 + [[True, True, True]] * 3),
    "target": _legal_targets,
}


@pytest.mark.parametrize("entropy", ["exact", slow("along_sample")])
def test_replay_reproduces_the_rollout_bit_for_bit_and_the_cost_is_the_distributions(entropy):
    head = _unit_and_target_head(entropy)
    x = _features()

    @nnx.jit
    def rollout(head, x):
        return head((), x, mask=MASK)

    @nnx.jit
    def loss_pass(head, x, extras):
        return head((), x, extras, mask=MASK)

    out = rollout(head, x)
    stored = jax.tree.map(np.asarray, out.rollout_extras)
    again = loss_pass(head, x, stored)
    np.testing.assert_array_equal(again.output["log_likelihood"], out.output["log_likelihood"])
    for name in ("unit", "target"):
        np.testing.assert_array_equal(again.output["action"][name], out.output["action"][name])
    action = out.output["action"]
    assert np.all(action["unit"][:3] != 0)  # masked units
    assert np.all(LEGAL[action["unit"], action["target"]])  # legal for the chosen unit

    @jax.jit
    def expected_entropy(x, stored):
        dist = head.distribution(x, mask=MASK)
        return dist.entropy() if entropy == "exact" else dist.entropy_along(stored)

    expected = expected_entropy(x, stored)
    np.testing.assert_allclose(again.regularization_loss, -0.1 * expected, rtol=1e-6)
    parts = again.output["log_likelihoods"]
    np.testing.assert_array_equal(
        (parts["unit"] + parts["target"]) + parts["move"], again.output["log_likelihood"]
    )
    assert set(again.metrics) == {
        f"{n}/{m}" for n in ("unit", "target", "move") for m in ("log_likelihood", "entropy")
    }


@pytest.mark.slow
def test_masked_choices_get_exactly_zero_gradient_and_the_replay_draws_no_key():
    head = _unit_and_target_head(move=False)
    x = _features()
    out = nnx.jit(lambda head, x: head((), x, mask=MASK))(head, x)
    count = sum(int(c) for c in jax.tree.leaves(nnx.state(head, nnx.RngCount)))

    def loss(head, x, extras):
        out = head((), x, extras, mask=MASK)
        return jnp.mean(out.output["log_likelihood"]) + jnp.mean(out.regularization_loss)

    grads = nnx.jit(nnx.grad(loss))(head, x, out.rollout_extras)
    assert sum(int(c) for c in jax.tree.leaves(nnx.state(head, nnx.RngCount))) == count
    leaves = jax.tree.leaves(nnx.state(grads, nnx.Param))
    assert all(np.all(np.isfinite(g)) for g in leaves)

    # The unit conditioner's output column for unit 0, forbidden in rows 0 to 2, gets
    # gradient from rows 3 to 5 only: with those rows forbidden too, exactly zero.
    all_forbidden = {**MASK, "unit": jnp.broadcast_to(jnp.array([False, True, True]), (B, 3))}

    def masked_loss(head, x):
        out = head((), x, jax.tree.map(jnp.asarray, rollout), mask=all_forbidden)
        return jnp.mean(out.output["log_likelihood"]) + jnp.mean(out.regularization_loss)

    rollout = nnx.jit(lambda head, x: head((), x, mask=all_forbidden))(head, x).rollout_extras
    grads = nnx.jit(nnx.grad(masked_loss))(head, x)
    bias = grads.conditioners["unit"].out.bias[...]
    kernel = grads.conditioners["unit"].out.kernel[...]
    assert bias[0] == 0 and np.all(kernel[:, 0] == 0)
    assert np.all(bias[1:] != 0)


@pytest.mark.slow
def test_greedy_eval_takes_the_most_probable_sub_action_at_each_step():
    head = _unit_and_target_head()
    x = _features()
    head.eval()
    out = nnx.jit(lambda head, x: head((), x, mask=MASK))(head, x)
    dist = head.distribution(x, mask=MASK)
    steps = dist.step_distributions(out.rollout_extras)
    np.testing.assert_array_equal(out.output["action"]["unit"], jnp.argmax(steps["unit"].probs, -1))
    np.testing.assert_array_equal(
        out.output["action"]["target"], jnp.argmax(steps["target"].probs, -1)
    )
    np.testing.assert_array_equal(out.output["action"]["move"], jnp.tanh(steps["move"].loc))


@pytest.mark.slow
def test_reparameterized_keeps_the_pathwise_gradient_through_the_later_sub_actions():
    rngs = nnx.Rngs(0)
    steps = {
        "move": samplers.SquashedNormalSampler(rngs, 0.0, action_dim=2),
        "fire": samplers.CategoricalSampler(rngs, 0.0, num_actions=2),
    }
    x = _features()

    def expected_fire(x, head):
        out = head((), x)
        probs = head.distribution(x).step_distributions(out.rollout_extras)["fire"].probs
        return jnp.sum(probs[:, 1]) + jnp.sum(out.output["action"]["move"])

    for reparameterized in (False, True):
        head = samplers.AutoregressiveSampler(
            steps,
            features=F,
            entropy_weight=0.0,
            rngs=nnx.Rngs(0),
            entropy="along_sample",
            reparameterized=reparameterized,
        )
        # A clone for each call: the same keys every time.
        grad = jax.grad(lambda x, head=head: expected_fire(x, nnx.clone(head)))(x)
        step = 1e-2
        e = jnp.zeros_like(x).at[0, 0].set(step)
        fd = (expected_fire(x + e, nnx.clone(head)) - expected_fire(x - e, nnx.clone(head))) / (
            2 * step
        )
        if reparameterized:
            np.testing.assert_allclose(grad[0, 0], fd, rtol=2e-2, atol=1e-4)
        else:
            assert abs(grad[0, 0] - fd) > 1e-3  # the sample's path is cut


def test_a_mask_table_is_the_function_mask_as_arrays_a_rollout_can_store():
    head = _head_with(entropy="along_sample")
    x = _features()
    table = {**MASK, "target": samplers.MaskTable(jnp.broadcast_to(LEGAL, (B, 3, 4)), "unit")}

    def call(head, x, mask, extras=None):
        out = head((), x, extras, mask=mask)
        return out.output["log_likelihood"], out.regularization_loss, out.rollout_extras

    # Stored as a rollout stores it: stacked over steps (a pytree of arrays), then sliced;
    # a function cannot be passed to a jitted step, a table can.
    stored = jax.tree.map(lambda t: jnp.stack([t, t])[1], table)
    forked = nnx.clone(head)
    by_function = nnx.jit(lambda head, x: call(head, x, MASK))(head, x)
    by_table = nnx.jit(call)(forked, x, stored)
    for a, b in zip(by_function, by_table, strict=True):
        jax.tree.map(np.testing.assert_array_equal, a, b)
    replayed = nnx.jit(call)(head, x, stored, by_function[2])
    np.testing.assert_array_equal(replayed[0], by_function[0])

    # Several names index the axes in order.
    cube = jax.random.bernoulli(jax.random.key(2), 0.5, (B, 3, 4, 2))
    prefix = {"unit": jnp.arange(B) % 3, "target": jnp.arange(B) % 4}
    rows = samplers.MaskTable(cube, given=("unit", "target"))(prefix)
    np.testing.assert_array_equal(rows, cube[jnp.arange(B), prefix["unit"], prefix["target"]])


def test_bad_options_and_masks_are_refused_by_name():
    rngs = nnx.Rngs(0)
    move_first = {
        "move": samplers.SquashedNormalSampler(rngs, 0.0, action_dim=2),
        "fire": samplers.CategoricalSampler(rngs, 0.0, num_actions=2),
    }
    with pytest.raises(
        ValueError, match=r"'move' .* is not discrete .*; pass entropy='along_sample'"
    ):
        samplers.AutoregressiveSampler(move_first, features=F, entropy_weight=0.1, rngs=rngs)
    with pytest.raises(ValueError, match="enumerate 3 prefixes, more than max_prefixes=2"):
        _head_with(max_prefixes=2)
    with pytest.raises(TypeError, match="non-empty dict of heads"):
        samplers.AutoregressiveSampler([], features=F, entropy_weight=0.1, rngs=rngs)
    head = _unit_and_target_head()
    with pytest.raises(ValueError, match=r"mask has names \['tgt'\]"):
        head((), _features(), mask={"tgt": LEGAL})
    with pytest.raises(ValueError, match="expects features of shape"):
        head((), jnp.zeros((B, F + 1)))
    with pytest.raises(ValueError, match=r"has shape \(3, 4\); it needs the batch shape \(6,\)"):
        head((), _features(), mask={"target": samplers.MaskTable(LEGAL, "unit")})
    for name, given in (("unit", "unit"), ("target", "move"), ("target", "nothing")):
        with pytest.raises(ValueError, match=f"indexed by '{given}', which is not a categorical"):
            head((), _features(), mask={name: samplers.MaskTable(jnp.zeros((B, 3, 2)), given)})
    for given in (3, (), ("unit", 1)):
        with pytest.raises(TypeError, match="MaskTable's given is a sub-action's name"):
            samplers.MaskTable(LEGAL, given)


def _head_with(**options):
    rngs = nnx.Rngs(0)
    steps = {
        "unit": samplers.CategoricalSampler(rngs, 0.0, num_actions=3),
        "target": samplers.CategoricalSampler(rngs, 0.0, num_actions=4),
    }
    return samplers.AutoregressiveSampler(
        steps, features=F, entropy_weight=0.1, rngs=rngs, **options
    )


@pytest.mark.slow
def test_per_env_streams_draw_each_environment_alike_however_the_batch_is_split():
    rngs = nnx.Rngs(0)
    steps = {
        "unit": samplers.CategoricalSampler(rngs, 0.0, 3, per_env_streams=True),
        "move": samplers.SquashedNormalSampler(rngs, 0.0, action_dim=2, per_env_streams=True),
    }
    head = samplers.AutoregressiveSampler(
        steps, features=F, entropy_weight=0.1, rngs=rngs, per_env_streams=True
    )
    keys = head.initialize_state(B)
    x = _features()
    whole, tail = head(keys, x), head(keys[2:], x[2:])
    for name in ("unit", "move"):
        np.testing.assert_array_equal(whole.output["action"][name][2:], tail.output["action"][name])
    again = head(whole.next_state, x, whole.rollout_extras)
    np.testing.assert_array_equal(again.output["log_likelihood"], whole.output["log_likelihood"])


@pytest.mark.parametrize(
    "shape",
    [
        pytest.param((B + 1, 4), id="other-batch"),
        slow((4,), id="no-batch"),
        slow((1, 4), id="[1,4]"),
    ],
)
def test_a_wrong_shaped_array_mask_is_refused_naming_the_sub_action(shape):
    head = _head_with()
    expected = re.escape(
        f"mask['target'], the mask of sub-action 'target' (CategoricalSampler) at the "
        f"features' batch shape ({B},), is refused: mask must have shape ({B}, 4)"
    )
    with pytest.raises(ValueError, match=f"{expected}.*got {re.escape(str(shape))}; jnp.broadc"):
        nnx.jit(lambda head, x: head((), x, mask={"target": jnp.ones(shape, bool)}))(
            head, _features()
        )
    with pytest.raises(TypeError, match=r"mask\['target'\], .* mask must be boolean"):
        head((), _features(), mask={"target": jnp.ones((B, 4), jnp.int32)})


def test_options_of_the_step_heads_that_the_head_would_ignore_are_refused():
    rngs = nnx.Rngs(0)

    def build(unit, **options):
        steps = {"unit": unit, "target": samplers.CategoricalSampler(rngs, 0.0, num_actions=4)}
        return samplers.AutoregressiveSampler(
            steps,
            features=F,
            entropy="along_sample",
            rngs=rngs,
            **{"entropy_weight": 0.1, **options},
        )

    with pytest.raises(
        ValueError,
        match=r"step head 'unit' \(CategoricalSampler\) has entropy_weight=0.05, which "
        r"AutoregressiveSampler ignores \(it uses its own, 0.1, .*out.metrics\['<name>/entropy'\]",
    ):
        build(samplers.CategoricalSampler(rngs, 0.05, num_actions=3))
    part = samplers.CategoricalSampler(rngs, 0.05, num_actions=3)
    with pytest.raises(ValueError, match=r"step head 'unit/parts/u' .* entropy_weight=0.05"):
        build(samplers.CompositeSampler({"u": part}, rngs=rngs))
    for option, unit in (
        ("per_env_streams", samplers.CategoricalSampler(rngs, 0.0, 3, per_env_streams=True)),
        (
            "reparameterized",
            samplers.SquashedNormalSampler(rngs, 0.0, action_dim=2, reparameterized=True),
        ),
    ):
        with pytest.raises(ValueError, match=f"has {option}=True, .* with {option}=False and pass"):
            build(unit)
        build(unit, **{option: True})  # the head's own value
    unit = samplers.CategoricalSampler(rngs, 0.0, num_actions=3)
    unit.eval()
    with pytest.raises(
        ValueError, match=r"deterministic=True, .* head.eval\(\) and head.train\(\)"
    ):
        build(unit)
    unit.train()
    head = build(unit)
    # The same weight as the head's is no weight lost.
    build(samplers.CategoricalSampler(rngs, 0.1, num_actions=3))
    head.eval()  # sets it on the steps too
    assert head.steps["unit"].deterministic and head.steps["target"].deterministic
    head.steps["unit"].train()
    with pytest.raises(ValueError, match=r"'unit' .* deterministic=False, .* its own, True"):
        head((), _features())


@pytest.mark.parametrize("entropy", [slow("exact"), slow("along_sample")])
def test_a_replayed_unit_forbidden_now_whose_targets_are_all_forbidden_scores_minus_inf(entropy):
    head = _head_with(entropy=entropy)
    x = _features()
    only_unit_2 = jnp.array([[False, False, True]] * 3 + [[True] * 3] * 3)
    rollout = head((), x, mask={"unit": only_unit_2})
    units = rollout.output["action"]["unit"]
    assert np.all(units[:3] == 2)
    # Now unit 2 is forbidden and has no legal target.
    legal = LEGAL.at[2].set(False)
    mask = {
        "unit": jnp.broadcast_to(jnp.array([True, True, False]), (B, 3)),
        "target": lambda p: legal[p["unit"]],
    }

    def loss(head, x):
        out = head((), x, rollout.rollout_extras, mask=mask)
        finite = jnp.where(
            jnp.isfinite(out.output["log_likelihood"]), out.output["log_likelihood"], 0.0
        )
        return jnp.mean(finite) + jnp.mean(out.regularization_loss), out

    grads, out = nnx.jit(nnx.grad(loss, has_aux=True))(head, x)
    log_likelihood = out.output["log_likelihood"]
    np.testing.assert_array_equal(np.isneginf(log_likelihood), units == 2)
    assert np.all(np.isfinite(log_likelihood[units != 2]))
    assert np.all(np.isfinite(out.regularization_loss))
    assert np.all(out.metrics["target/entropy"][units == 2] == 0)
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(nnx.state(grads, nnx.Param)))


class _Counted(nnx.Module):
    """A conditioner that counts its evaluations on arrays (not its traces)."""

    def __init__(self, inner):
        self.inner = inner
        self.evaluations = 0

    def __call__(self, x):
        if not isinstance(x, jax.core.Tracer):
            self.evaluations += 1
        return self.inner(x)


@pytest.mark.parametrize("entropy", ["exact", slow("along_sample")])
def test_a_call_builds_each_sub_action_s_distribution_once_from_its_data(entropy):
    # The replay scores the stored data, and its entropy cost and metrics read what the
    # scoring computed; the exact entropy builds the later sub-actions once more, over
    # every prefix. A rollout builds each later sub-action for its draw and once more to
    # score the data drawn.
    rngs = nnx.Rngs(0)
    steps = {
        "unit": samplers.CategoricalSampler(rngs, 0.0, num_actions=3),
        "target": samplers.CategoricalSampler(rngs, 0.0, num_actions=4),
    }
    conditioners = {
        "unit": _Counted(nnx.Linear(F, 3, rngs=rngs)),
        "target": _Counted(nnx.Linear(F + 3, 4, rngs=rngs)),
    }
    head = samplers.AutoregressiveSampler(
        steps,
        features=F,
        entropy_weight=0.1,
        rngs=rngs,
        conditioners=conditioners,
        entropy=entropy,
    )
    enumerated = 1 if entropy == "exact" else 0

    def evaluations(call):
        for conditioner in conditioners.values():
            conditioner.evaluations = 0
        out = call()
        return out, [conditioners[name].evaluations for name in ("unit", "target")]

    out, rollout = evaluations(lambda: head((), _features(), mask=MASK))
    _, replay = evaluations(lambda: head((), _features(), out.rollout_extras, mask=MASK))
    assert replay == [1, 1 + enumerated]
    assert rollout == [1, 2 + enumerated]
