import gc
import os

import jax
import pytest
from hypothesis import settings

from tests._tiers import BATCH_SHAPES, slow

# Hypothesis profiles: "ci" (the default) draws the same examples on every run, so a
# failure in CI reproduces locally; "thorough" draws 20 times as many, afresh each run
# (HYPOTHESIS_PROFILE=thorough python -m pytest tests/heads/test_invariants.py).
settings.register_profile("ci", max_examples=25, derandomize=True, deadline=None, print_blob=True)
settings.register_profile("thorough", max_examples=500, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Implicit rank promotion hides shape bugs; the test session refuses it.
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Releases a test module's compiled programs when it ends. A worker that runs many
    modules would otherwise keep every program's machine code mapped, and once the
    process reaches the kernel's limit on memory mappings (vm.max_map_count, 65530
    here; the slow tier passed 15,000 within two modules) compiling crashes."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """Docstring examples run in the slow tier, with the guides' code blocks: they run
    the library eagerly, an operation at a time, as a reader would."""
    for item in items:
        if item.nodeid.startswith("samplers/"):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(params=BATCH_SHAPES)
def batch_shape(request):
    return request.param


@pytest.fixture(params=[slow(False, id="eager"), pytest.param(True, id="jit")])
def maybe_jit(request):
    return jax.jit if request.param else (lambda f: f)
