"""A NaN or infinite parameter gives NaN outputs, never a plausible finite number.

``tanh(+-inf)`` is the finite action ``+-1``: without a guard an infinite mean (or
std, through ``mean + inf * eps``) would give a finite action. Each case sets one
parameter of one batch element and checks that element's outputs are NaN where
they depend on it, and every other output is what the clean input gives.
"""

import distrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import samplers
from tests._tiers import slow

A = 3  # action dimensions
DIM = 2  # the action dimension that receives the bad value
# One grid of non-finite inputs, one case a batch row: (column of [mean | raw_std], value).
# Rows past the grid stay clean, so one call checks every case and that rows do not mix.
BAD = [(DIM, jnp.inf), (DIM, -jnp.inf), (DIM, jnp.nan), (A + DIM, jnp.inf), (A + DIM, -jnp.inf)]
BAD_ROWS = np.arange(len(BAD))
BATCH = len(BAD) + 2
BIJECTORS = {
    "Tanh": samplers.Tanh(),
    "BoundedTanh": samplers.BoundedTanh(jnp.array([-2.0, 0.0, -0.1]), jnp.array([2.0, 1.0, 0.3])),
    "Sigmoid": samplers.Sigmoid(),
    "distrax.Tanh": distrax.Tanh(),
}


def _clean_and_bad(grid=BAD):
    """Clean inputs, and the same with row ``i`` given the ``i``-th bad (column, value)."""
    clean = jnp.linspace(-1.0, 1.0, BATCH * 2 * A).reshape(BATCH, 2 * A)
    bad = clean
    for row, (column, value) in enumerate(grid):
        bad = bad.at[row, column].set(value)
    return clean, bad


def _assert_nan_in_bad_rows_only(bad, clean, *, action_shaped, rows=BAD_ROWS):
    """NaN at [row, DIM] (or [row]) of every bad row, bit-identical to the clean run elsewhere."""
    bad, clean = np.asarray(bad), np.asarray(clean)
    where = (rows, DIM) if action_shaped else (rows,)
    assert np.all(np.isnan(bad[where])), bad[where]
    keep = np.ones(bad.shape, bool)
    keep[where] = False
    np.testing.assert_array_equal(bad[keep], clean[keep])


# distrax's Tanh is samplers.Tanh's map: slow.
@pytest.mark.parametrize(
    "name", [slow(n) if n == "distrax.Tanh" else pytest.param(n) for n in BIJECTORS]
)
def test_the_pure_layer_gives_nan_for_a_non_finite_parameter(name):
    clean_input, bad_input = _clean_and_bad()
    build = (
        samplers.normal_tanh
        if name == "Tanh"
        else (lambda x: samplers.squashed_normal(x, BIJECTORS[name]))
    )
    clean, bad = build(clean_input), build(bad_input)
    key = jax.random.key(0)
    action, pre_image, log_prob = bad.sample_with_pre_image(seed=key)
    clean_action, clean_pre_image, clean_log_prob = clean.sample_with_pre_image(seed=key)
    _assert_nan_in_bad_rows_only(action, clean_action, action_shaped=True)
    _assert_nan_in_bad_rows_only(pre_image, clean_pre_image, action_shaped=True)
    _assert_nan_in_bad_rows_only(log_prob, clean_log_prob, action_shaped=False)
    _assert_nan_in_bad_rows_only(
        bad.deterministic_action(), clean.deterministic_action(), action_shaped=True
    )
    _assert_nan_in_bad_rows_only(
        bad.log_prob_from_pre_image(clean_pre_image),
        clean.log_prob_from_pre_image(clean_pre_image),
        action_shaped=False,
    )
    _assert_nan_in_bad_rows_only(
        bad.entropy_estimate(seed=key), clean.entropy_estimate(seed=key), action_shaped=False
    )
    _assert_nan_in_bad_rows_only(
        bad.entropy_quadrature(), clean.entropy_quadrature(), action_shaped=False
    )


def _from_log_std(mean_and_log_std):
    return samplers.squashed_normal_from_log_std(*jnp.split(mean_and_log_std, 2, axis=-1))


@pytest.mark.parametrize(
    "build", ["normal_tanh", "squashed_flow", slow("squashed_normal_from_log_std")]
)
def test_a_masked_out_non_finite_row_gets_a_zero_gradient_and_the_others_their_own(build):
    # A loss that masks the non-finite rows out (as a user filtering them does): their
    # gradient with respect to the network output is exactly 0 in both the reparameterised
    # actor loss and the replay, and every other row's is the clean input's, bit for bit;
    # but for raw_std = NaN (the row after BAD's), where softplus's derivative is NaN, and
    # for log_std = +inf, where exp's is infinite.
    clean_input, bad_input = _clean_and_bad([*BAD, (A + DIM, jnp.nan)])
    make, expected = getattr(samplers, build), np.zeros((len(BAD), 2 * A))
    if build == "squashed_normal_from_log_std":
        make = _from_log_std
        expected[BAD.index((A + DIM, jnp.inf)), A + DIM] = np.nan
    pre_image = make(clean_input).sample_with_pre_image(seed=jax.random.key(1))[1]

    def actor(params):
        return make(params).sample_with_pre_image(seed=jax.random.key(2))[2]

    def replay(params):
        return make(params).log_prob_from_pre_image(pre_image)

    for log_prob_of in (actor, replay):

        def masked(params, log_prob_of=log_prob_of):
            log_prob = log_prob_of(params)
            return jnp.sum(jnp.where(jnp.isfinite(log_prob), log_prob, 0.0))

        bad, clean = jax.grad(masked)(bad_input), jax.grad(masked)(clean_input)
        np.testing.assert_array_equal(bad[BAD_ROWS], expected)
        assert np.isnan(bad[len(BAD), A + DIM])
        np.testing.assert_array_equal(bad[len(BAD) + 1 :], clean[len(BAD) + 1 :])


@pytest.mark.parametrize(
    "build",
    [
        samplers.normal_tanh,
        lambda x: samplers.squashed_normal(x, samplers.BoundedTanh(-2.0, 3.0)),
        samplers.squashed_flow,
    ],
    ids=["normal_tanh", "squashed_normal", "squashed_flow"],
)
def test_the_gradient_keeps_one_mask_of_the_batch_s_shape(build):
    # The NaN policy's derivative needs the distribution's mask of invalid dimensions
    # alone; a second one, from the constructor, would be another array the backward
    # pass keeps (written and read back on a TPU).
    params = jnp.linspace(-1.0, 1.0, 4 * 2 * A).reshape(4, 2 * A)
    _, backward = jax.vjp(lambda p: build(p).log_prob_from_pre_image(jnp.zeros((4, A))), params)
    masks = [
        leaf for leaf in jax.tree.leaves(backward) if getattr(leaf, "dtype", None) == np.dtype(bool)
    ]
    assert [mask.shape for mask in masks] == [(4, A)]


def _squashed_samplers():
    return {
        "NormalTanhSampler": samplers.NormalTanhSampler(nnx.Rngs(0), 0.01),
        "NormalTanhSampler-quadrature": samplers.NormalTanhSampler(
            nnx.Rngs(0), 0.01, entropy="quadrature"
        ),
        **{
            f"SquashedNormalSampler-{name}": samplers.SquashedNormalSampler(
                nnx.Rngs(0), 0.01, bijector=bijector
            )
            for name, bijector in BIJECTORS.items()
            if name != "Tanh"
        },
    }


def _assert_outputs(bad, clean, mode, rows=BAD_ROWS):
    if mode == "replay":
        # The action is f(the stored pre-image): it does not depend on the parameters.
        np.testing.assert_array_equal(bad.output["action"], clean.output["action"])
    else:
        _assert_nan_in_bad_rows_only(
            bad.output["action"], clean.output["action"], action_shaped=True, rows=rows
        )
        for metric in ("saturation", "bound_distance"):
            if metric in clean.metrics:
                _assert_nan_in_bad_rows_only(
                    bad.metrics[metric], clean.metrics[metric], action_shaped=False, rows=rows
                )
    _assert_nan_in_bad_rows_only(
        bad.output["log_likelihood"],
        clean.output["log_likelihood"],
        action_shaped=False,
        rows=rows,
    )
    _assert_nan_in_bad_rows_only(
        bad.regularization_loss, clean.regularization_loss, action_shaped=False, rows=rows
    )


@pytest.mark.parametrize("mode", ["rollout", "replay", "eval"])
@pytest.mark.parametrize("name", list(_squashed_samplers()))
def test_squashed_samplers_give_nan_for_a_non_finite_parameter(name, mode):
    clean_input, bad_input = _clean_and_bad()
    outputs = []
    for inputs in (clean_input, bad_input):
        head = _squashed_samplers()[name]
        stored = head((), clean_input).rollout_extras  # a clean stored pre-image
        if mode == "eval":
            head.eval()
        outputs.append(head((), inputs, stored if mode == "replay" else None))
    _assert_outputs(outputs[1], outputs[0], mode)


@pytest.mark.parametrize("mode", ["rollout", "replay", "eval"])
def test_state_independent_sampler_gives_nan_for_a_non_finite_mean(mode):
    clean_input = jnp.linspace(-1.0, 1.0, BATCH * A).reshape(BATCH, A)
    bad_input = clean_input
    for row, value in enumerate([jnp.inf, -jnp.inf, jnp.nan]):
        bad_input = bad_input.at[row, DIM].set(value)
    outputs = []
    for inputs in (clean_input, bad_input):
        head = samplers.StateIndependentSampler(nnx.Rngs(0), A, 0.01)
        stored = head((), clean_input).rollout_extras
        if mode == "eval":
            head.eval()
        outputs.append(head((), inputs, stored if mode == "replay" else None))
    _assert_outputs(outputs[1], outputs[0], mode, rows=np.arange(3))


@pytest.mark.parametrize("log_std", [jnp.inf, -jnp.inf, jnp.nan], ids=["+inf", "-inf", "nan"])
def test_state_independent_sampler_gives_nan_for_a_non_finite_learned_std(log_std):
    head = samplers.StateIndependentSampler(nnx.Rngs(0), A, 0.01)
    head.log_std[...] = head.log_std[...].at[DIM].set(log_std)
    out = head((), jnp.zeros((4, A)))
    assert np.all(np.isnan(out.output["action"][:, DIM]))
    assert np.all(np.isfinite(out.output["action"][:, :DIM]))
    assert np.all(np.isnan(out.output["log_likelihood"]))
    assert np.all(np.isnan(out.regularization_loss))


def test_distribution_sampler_passes_non_finite_parameters_to_the_distribution():
    # The distribution decides: a Normal's sample and log-likelihood are not finite.
    def normal(params):
        loc, log_scale = jnp.split(params, 2, axis=-1)
        return distrax.Independent(distrax.Normal(loc, jnp.exp(log_scale)), 1)

    grid = [(DIM, jnp.inf), (DIM, -jnp.inf), (DIM, jnp.nan)]
    clean_input, bad_input = _clean_and_bad(grid)
    clean, bad = (
        samplers.DistributionSampler(nnx.Rngs(0), 0.01, normal)((), inputs)
        for inputs in (clean_input, bad_input)
    )
    assert not np.any(np.isfinite(bad.output["action"][:3, DIM]))
    _assert_nan_in_bad_rows_only(
        bad.output["log_likelihood"],
        clean.output["log_likelihood"],
        action_shaped=False,
        rows=np.arange(3),
    )
    # A Categorical's action is an integer and cannot be NaN; its score is not finite.
    row = 1
    logits = jnp.zeros((2, 3)).at[row, 0].set(jnp.nan)
    out = samplers.DistributionSampler(nnx.Rngs(0), 0.01, lambda x: distrax.Categorical(logits=x))(
        (), logits
    )
    assert not np.isfinite(out.output["log_likelihood"][row])
    assert np.isnan(out.regularization_loss[row])
    assert np.all(np.isfinite(out.output["log_likelihood"][:row]))


def test_distribution_sampler_leaves_masked_categorical_logits_alone():
    # -inf logits are how action masks are written: a valid distribution, not an error.
    logits = jnp.array([[0.0, -jnp.inf, 1.0], [-jnp.inf, 0.0, 0.0]])
    out = samplers.DistributionSampler(nnx.Rngs(0), 0.01, lambda x: distrax.Categorical(logits=x))(
        (), logits
    )
    assert np.all(np.isfinite(out.output["log_likelihood"]))
    assert out.output["action"][0] != 1 and out.output["action"][1] != 0


# (mean, spread) of the bad dimension for the two-halves constructors, one case a row.
HALVES_BAD = [(jnp.inf, 1.0), (-jnp.inf, 1.0), (jnp.nan, 1.0), (0.5, jnp.inf), (0.5, jnp.nan)]


def _halves(constructor, bijector):
    mean = jnp.linspace(-1.0, 1.0, BATCH * A).reshape(BATCH, A)
    spread = jnp.full((BATCH, A), 0.7)
    clean = constructor(mean, spread, bijector)
    bad_mean, bad_spread = mean, spread
    for row, (mean_value, spread_value) in enumerate(HALVES_BAD):
        bad_mean = bad_mean.at[row, DIM].set(mean_value)
        bad_spread = bad_spread.at[row, DIM].set(spread_value)
    return clean, constructor(bad_mean, bad_spread, bijector)


@pytest.mark.parametrize(
    "constructor",
    [samplers.squashed_normal_from_std, samplers.squashed_normal_from_log_std],
    ids=["from_std", "from_log_std"],
)
@pytest.mark.parametrize("bijector", BIJECTORS.values(), ids=BIJECTORS.keys())
def test_the_two_halves_constructors_follow_the_nan_policy(constructor, bijector):
    clean, bad = _halves(constructor, bijector)
    key = jax.random.key(0)
    for method in ("deterministic_action", "median", "mode"):
        _assert_nan_in_bad_rows_only(
            getattr(bad, method)(), getattr(clean, method)(), action_shaped=True
        )
    _assert_nan_in_bad_rows_only(bad.sample(seed=key), clean.sample(seed=key), action_shaped=True)
    action = clean.sample(seed=key)
    _assert_nan_in_bad_rows_only(bad.log_prob(action), clean.log_prob(action), action_shaped=False)


def test_a_negative_std_and_an_infinite_log_std_are_nan_too():
    mean = jnp.zeros((1, 2))
    from_std = samplers.squashed_normal_from_std(mean, jnp.array([[-1.0, 1.0]]))
    from_log_std = samplers.squashed_normal_from_log_std(
        mean, jnp.array([[-jnp.inf, 0.0]]), log_std_min=-20.0
    )
    for dist in (from_std, from_log_std):
        action = dist.sample(seed=jax.random.key(0))
        assert np.isnan(action[0, 0]) and np.isfinite(action[0, 1])
