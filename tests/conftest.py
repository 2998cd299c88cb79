import jax
import pytest

# Implicit rank promotion hides shape bugs; the test session refuses it.
jax.config.update("jax_numpy_rank_promotion", "raise")

# Readable ids for the leading shapes the library supports: (), (B,), (T, B).
BATCH_SHAPES = [(), (5,), (3, 4)]
BATCH_IDS = ["(A,)", "(B,A)", "(T,B,A)"]


@pytest.fixture(params=BATCH_SHAPES, ids=BATCH_IDS)
def batch_shape(request):
    return request.param


@pytest.fixture(params=[False, True], ids=["eager", "jit"])
def maybe_jit(request):
    return jax.jit if request.param else (lambda f: f)
