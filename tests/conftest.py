import gc
import os
from pathlib import Path

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

# Compiled programs are kept on disk (JAX's persistent compilation cache) for every
# process of the session and the next: a program the default tier compiled, the slow
# tier loads, and so do the other xdist workers. No size limit: with one, every entry
# written takes a lock and scans the folder (the default tier took 17 minutes, not 5).
# An entry read while another worker writes it is torn; JAX then compiles the program
# (pyproject.toml ignores its warning).
jax.config.update("jax_compilation_cache_dir", str(Path(__file__).parents[1] / ".jax_cache"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _memory_mappings():
    """How many memory mappings this process holds, and the kernel's limit on them
    (Linux; elsewhere ``(0, None)``)."""
    try:
        with open("/proc/self/maps") as maps, open("/proc/sys/vm/max_map_count") as limit:
            return sum(1 for _ in maps), int(limit.read())
    except OSError:
        return 0, None


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Releases the compiled programs when a test module ends with the process past half
    the kernel's limit on memory mappings (vm.max_map_count, 65530 here). Each compiled
    CPU program keeps its machine code mapped: a worker held about 20,000 mappings after
    its half of the default tier, the slow tier adds more, and past the limit compiling
    crashes. Below half of it the programs stay (releasing them after every module cost
    about 20 s of the default tier's time)."""
    yield
    mappings, limit = _memory_mappings()
    if limit is not None and mappings > limit // 2:
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
