"""The numerics of ``TokenCategorical`` (``samplers/distributions/_token_math.py``): the
exact arithmetic's ``exp`` and ``log`` against float64 over dense grids, its sums and
log-softmax giving a row the same bits whatever the array around it, and the two-stage
top-k against ``lax.top_k`` with ties."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from samplers import TokenCategorical
from samplers.distributions import _token_math as math
from tests._tiers import slow


def _ulps(got, exact):
    """``|got - exact|`` in units of the float32 spacing at ``exact``."""
    spacing = np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64)
    return np.abs(np.asarray(got, np.float64) - exact) / spacing


@pytest.mark.slow
def test_exp_is_within_its_documented_ulps_of_float64():
    x = np.concatenate(
        [
            np.linspace(-87.3, 88.7, 2_000_001),
            np.linspace(-1e-3, 1e-3, 10_001),
            np.float32(np.log(np.finfo(np.float32).tiny)) + np.arange(-4, 5) * 1e-5,
        ]
    ).astype(np.float32)
    exact = np.exp(x.astype(np.float64))
    got = np.asarray(jax.jit(math.exp)(jnp.asarray(x)))
    normal = exact >= np.finfo(np.float32).tiny
    assert _ulps(got[normal], exact[normal]).max() <= 1.01
    # Below the smallest normal: 0; the ends and NaN.
    assert np.all(got[~normal] == 0)
    special = np.asarray(math.exp(jnp.array([-jnp.inf, -100.0, 100.0, jnp.inf, jnp.nan])))
    np.testing.assert_array_equal(special, [0.0, 0.0, np.inf, np.inf, np.nan])


@pytest.mark.parametrize(
    "exponents, every",
    [
        slow((0, -1), False, id="sampled"),
        slow((-126, -20, -2, -1, 0, 1, 2, 20, 127), True, id="every-mantissa"),
    ],
)
def test_log_is_within_its_documented_ulps_of_float64(exponents, every):
    # float32 of [1, 2) times 2**e: every mantissa the reduction sees, or a sample.
    mantissas = np.arange(2**23, dtype=np.uint32)
    if not every:
        mantissas = np.random.default_rng(0).choice(mantissas, 2**20, replace=False)
    mantissas = (mantissas | np.uint32(127 << 23)).view(np.float32)
    log = jax.jit(math.log)
    for e in exponents:
        x = (mantissas.astype(np.float64) * 2.0**e).astype(np.float32)
        exact = np.log(x.astype(np.float64))
        got = np.asarray(log(jnp.asarray(x)))
        nonzero = exact != 0
        assert _ulps(got[nonzero], exact[nonzero]).max() <= 0.83, e
        assert np.all(got[~nonzero] == 0)
    special = np.asarray(math.log(jnp.array([0.0, -1.0, jnp.inf, jnp.nan])))
    np.testing.assert_array_equal(special, [-np.inf, np.nan, np.inf, np.nan])


@pytest.mark.slow
def test_float64_uses_jax_exp_and_log():
    with jax.enable_x64(True):
        x = jnp.linspace(-700.0, 700.0, 1001)
        np.testing.assert_array_equal(math.exp(x), jnp.exp(x))
        np.testing.assert_array_equal(math.log(jnp.exp(x)), jnp.log(jnp.exp(x)))


@pytest.mark.parametrize("width", [slow(1), pytest.param(5), slow(64), slow(100)])
def test_tree_sum_gives_a_row_the_same_bits_on_any_axis_and_in_any_batch(width):
    x = jax.random.normal(jax.random.key(width), (37, width)) * 10.0
    rows = np.asarray(jax.jit(math.tree_sum)(x))
    columns = np.asarray(jax.jit(lambda x: math.tree_sum(x, axis=0))(x.T))
    np.testing.assert_array_equal(rows, columns)
    for count in (1, 3, 8):
        np.testing.assert_array_equal(jax.jit(math.tree_sum)(x[:count]), rows[:count])
    np.testing.assert_allclose(rows, np.asarray(x, np.float64).sum(-1), rtol=1e-5, atol=1e-4)


@pytest.mark.slow
def test_the_log_softmax_gives_a_row_the_same_bits_in_any_batch_jitted_or_not():
    raw = jax.random.normal(jax.random.key(0), (300, 64)) * 5.0
    raw = raw.at[3, :10].set(-jnp.inf)
    scale = jnp.linspace(0.5, 2.0, 300)
    whole = np.asarray(jax.jit(math.log_softmax)(raw, scale))
    for count in (1, 7, 32, 48, 256):
        np.testing.assert_array_equal(
            jax.jit(math.log_softmax)(raw[:count], scale[:count]), whole[:count]
        )
    np.testing.assert_array_equal(
        jax.jit(math.log_softmax)(raw.reshape(3, 100, 64)[1], scale[100:200]), whole[100:200]
    )
    expected = jax.nn.log_softmax(np.asarray(raw, np.float64) * np.asarray(scale)[:, None])
    np.testing.assert_allclose(whole, expected, rtol=2e-6, atol=2e-6)
    # A row with no finite logit is NaN.
    assert np.all(np.isnan(math.log_softmax(jnp.full((1, 4), -jnp.inf), jnp.ones(1))))


@pytest.mark.parametrize(
    "chunk, width, k",
    [
        pytest.param(8, 1000, 7, id="chunks-of-8"),
        slow(16, 1000, 7, id="chunks-of-16"),
        slow(8, 4096, 64, id="chunks-of-8-k64"),
        slow(16, 4096, 64, id="chunks-of-16-k64"),
        slow(16, 1000, 60, id="few-chunks"),
        slow(8, 37, 5, id="narrow"),
    ],
)
def test_the_two_stage_top_k_is_lax_top_k_with_its_ties(chunk, width, k):
    rng = np.random.default_rng(width + k)
    # Few distinct values: many ties, within and across chunks; some -inf.
    values = rng.integers(0, 12, size=(9, width)).astype(np.float32)
    values[0] = 3.0  # all equal
    values[1, ::3] = -np.inf
    values = jnp.asarray(values)
    want_values, want_positions = jax.lax.top_k(values, k)
    got_values, got_positions = jax.jit(lambda v: math.top_k(v, k, chunk=chunk))(values)
    np.testing.assert_array_equal(got_values, want_values)
    np.testing.assert_array_equal(got_positions, want_positions)


@pytest.mark.parametrize("rows", [slow(300, id="300"), slow(7, id="7")])
def test_a_bfloat16_tables_gradient_is_summed_in_float32_and_rounded_once(rows):
    # Without a float32 buffer of the table's size: the terms sorted by row, summed in
    # float32 window by window, an id spanning two windows carried across.
    hidden = jax.random.normal(jax.random.key(0), (rows, 32))
    table = (jax.random.normal(jax.random.key(1), (2000, 32)) / 3).astype(jnp.bfloat16)
    options = dict(top_p=0.95, max_kept=64)
    data = TokenCategorical(hidden, embedding=table, **options).sample_replay_data(
        seed=jax.random.key(2)
    )

    def loss(h, e):
        return TokenCategorical(h, embedding=e, **options).replay(data)[1].sum()

    got = jax.grad(loss, argnums=1)(hidden, table)
    exact = jax.grad(loss, argnums=1)(hidden, table.astype(jnp.float32))
    assert got.dtype == jnp.bfloat16
    got, exact = np.asarray(got, np.float64), np.asarray(exact, np.float64)
    rounded = np.asarray(jnp.asarray(exact, jnp.float32).astype(jnp.bfloat16), np.float64)
    # The float32 sums in another order differ in their last bits: once rounded, the
    # same almost everywhere, and never by more than a bfloat16 ulp.
    assert np.mean(got == rounded) >= 0.999
    np.testing.assert_array_less(np.abs(got - exact), 2.0**-7 * np.abs(exact) + 1e-30)
    assert np.count_nonzero(exact) > 1000


def _row_sums_inputs(dtype):
    """Ids ``[300, 8]`` over a vocabulary of 1300 (two blocks of 512 and a remainder):
    padding, both ends, one id in 700 terms (past a chunk of 512) and coefficients
    of mixed signs and sizes."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 1300, size=(300, 8))
    ids[:, 0] = 511  # 300 terms of one id, and 400 more of another across a block's edge
    ids[:200, 1], ids[200:, 1] = 512, 1299
    ids[:200, 2] = 0
    ids[::7, 3] = 0  # clipped padding, with a coefficient of 0
    coefficients = rng.normal(size=ids.shape) * np.exp(rng.uniform(-8, 8, size=ids.shape))
    coefficients[::7, 3] = 0.0
    hidden = rng.normal(size=(300, 16))
    hidden = np.asarray(jnp.asarray(hidden, dtype).astype(jnp.float32), np.float64)
    return ids, coefficients.astype(np.float32), hidden


@pytest.mark.parametrize(
    "sums, dtype",
    [
        pytest.param("_block_row_sums", jnp.bfloat16, id="block-bfloat16"),
        slow("_block_row_sums", jnp.float32, id="block-float32"),
        slow("_sorted_row_sums", jnp.bfloat16, id="sorted-bfloat16"),
        slow("_sorted_row_sums", jnp.float32, id="sorted-float32"),
    ],
)
def test_a_supports_table_gradient_against_float64(sums, dtype):
    # Each row's terms summed in float32 and rounded to the table's dtype once: the
    # scatter of sorted windows (the CPU's) and the MXU's products by vocabulary block
    # (a TPU's), run here on the CPU.
    ids, coefficients, hidden = _row_sums_inputs(dtype)
    terms = coefficients.astype(np.float64)[:, :, None] * hidden[:, None, :]
    exact, size = np.zeros((1300, 16)), np.zeros((1300, 16))
    np.add.at(exact, ids.reshape(-1), terms.reshape(-1, 16))
    np.add.at(size, ids.reshape(-1), np.abs(terms).reshape(-1, 16))
    fn = jax.jit(getattr(math, sums), static_argnums=(3, 4))
    got = fn(jnp.asarray(ids), jnp.asarray(coefficients), jnp.asarray(hidden, dtype), 1300, dtype)
    assert got.dtype == dtype
    got = np.asarray(got.astype(jnp.float32), np.float64)
    ulp = 2.0**-8 if dtype == jnp.bfloat16 else 2.0**-24
    np.testing.assert_array_less(np.abs(got - exact), ulp * np.abs(exact) + 2.0**-20 * size + 1e-37)
    rounded = np.asarray(jnp.asarray(exact, jnp.float32).astype(dtype).astype(jnp.float32))
    assert np.mean(got == rounded) >= (0.99 if dtype == jnp.bfloat16 else 0.5)
    assert np.all(got[size == 0] == 0) and np.count_nonzero(size) > 1000
