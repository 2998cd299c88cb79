import ast
import importlib.util
import math
import pathlib
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from beartype import beartype
from flax import nnx
from jaxtyping import TypeCheckError, jaxtyped

import samplers
from tests._tiers import BATCH_SHAPES, slow


def test_public_names_are_pinned():
    assert sorted(samplers.__all__) == [
        "ActionSampler",
        "Autoregressive",
        "AutoregressiveSampler",
        "BetaSampler",
        "BoundedTanh",
        "CategoricalSampler",
        "Composite",
        "CompositeSampler",
        "CrossCheckReport",
        "DistributionSampler",
        "FlowSampler",
        "LogitBeta",
        "MaskTable",
        "MaskedCategorical",
        "MultiBinary",
        "MultiBinarySampler",
        "MultiDiscrete",
        "MultiDiscreteSampler",
        "NormalTanhSampler",
        "Parameterized",
        "ParameterizedSampler",
        "Replayable",
        "Scored",
        "Sigmoid",
        "SquashedBeta",
        "SquashedFlow",
        "SquashedNormal",
        "SquashedNormalSampler",
        "Squashing",
        "StateIndependentSampler",
        "StatefulModule",
        "StatefulModuleOutput",
        "Tanh",
        "TokenCategorical",
        "TokenSampler",
        "bound_distance",
        "cross_check",
        "functional",
        "head_for",
        "kl_divergence",
        "log_prob_from_action",
        "mode",
        "mode_pre_image",
        "normal_tanh",
        "ppo_log_ratio_stats",
        "saturation_fraction",
        "squashed_beta",
        "squashed_flow",
        "squashed_normal",
        "squashed_normal_from_log_std",
        "squashed_normal_from_std",
        "support_from_kept_ids",
    ]
    assert all(hasattr(samplers, name) for name in samplers.__all__)


@pytest.mark.slow
def test_main_prints_a_cross_check_where_only_the_pre_image_path_is_finite():
    result = subprocess.run(
        [sys.executable, "-m", "samplers"], capture_output=True, text=True, check=True, timeout=300
    )
    rows = [line.split() for line in result.stdout.splitlines() if line.split()[:1] == ["20.0"]]
    assert len(rows) == 1, result.stdout
    _, action, ours, float64, distrax_value, tfp_value = rows[0]
    assert float(action) == 1.0
    assert math.isfinite(float(ours)) and float(ours) == pytest.approx(float(float64), rel=1e-6)
    assert distrax_value == "nan" and tfp_value == "nan"
    assert "replay ratio         [1. 1.]" in result.stdout


# Shape is the point: no batch and two batch axes by default, one axis in the slow tier.
ANNOTATED_BATCHES = [
    pytest.param((), id="(A,)"),
    slow((5,), id="(B,A)"),
    pytest.param((3, 4), id="(T,B,A)"),
]


def _checked(function):
    return jaxtyped(typechecker=beartype)(function)


@pytest.mark.parametrize("batch", ANNOTATED_BATCHES)
def test_shape_annotations_hold_at_run_time(batch):
    mean_and_std = jnp.zeros((*batch, 6))
    dist = _checked(samplers.normal_tanh)(mean_and_std)
    action, pre_image, _ = _checked(samplers.SquashedNormal.sample_with_pre_image)(
        dist, seed=nnx.Rngs(0)()
    )
    _checked(samplers.SquashedNormal.log_prob_from_pre_image)(dist, pre_image)
    _checked(samplers.SquashedNormal.entropy_estimate)(dist, seed=nnx.Rngs(1)())
    head = samplers.NormalTanhSampler(nnx.Rngs(0), 0.01)
    out = _checked(samplers.NormalTanhSampler.__call__)(head, (), mean_and_std)
    _checked(samplers.NormalTanhSampler.__call__)(head, (), mean_and_std, out.rollout_extras)
    assert action.shape == (*batch, 3)


@pytest.mark.parametrize("batch", BATCH_SHAPES)
def test_distribution_method_annotations_hold_at_run_time(batch):
    mean, std = jnp.zeros((*batch, 1)), jnp.ones((*batch, 1))
    dist = _checked(samplers.squashed_normal_from_std)(mean, std)
    dist = _checked(samplers.squashed_normal_from_log_std)(mean, jnp.log(std), log_std_min=-5.0)
    for value in (jnp.zeros(1), jnp.zeros((*batch, 1)), jnp.zeros((7, *batch, 1))):
        for method in ("log_prob", "log_cdf", "cdf", "survival_function", "log_survival_function"):
            assert (
                getattr(dist, method)(value).shape
                == jnp.broadcast_shapes(value.shape, mean.shape)[:-1]
            )
            _checked(getattr(samplers.SquashedNormal, method))(dist, value)
    _checked(samplers.SquashedNormal.quantile)(dist, jnp.full((7, *batch), 0.3))
    for method in ("mode", "median", "mean", "variance", "stddev"):
        assert _checked(getattr(samplers.SquashedNormal, method))(dist).shape == mean.shape


def test_shape_annotations_catch_a_mismatched_pre_image():
    dist = samplers.normal_tanh(jnp.zeros((5, 6)))
    with pytest.raises(TypeCheckError):
        _checked(samplers.SquashedNormal.forward_and_log_prob)(dist, jnp.zeros((5, 3), jnp.int32))


def _imported_modules(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            # `from samplers import _checks` imports the module samplers._checks.
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                yield submodule if _is_module(submodule) else node.module


def _module_path(name: str) -> pathlib.Path | None:
    spec = importlib.util.find_spec(name)
    return pathlib.Path(spec.origin) if spec and spec.origin else None


def _imports_within_the_package(name: str, seen: set[str]) -> set[str]:
    """Every module that ``name`` imports, following this package's modules."""
    path = _module_path(name)
    if path is None or name in seen:
        return set()
    seen.add(name)
    found = set()
    for imported in _imported_modules(path):
        found.add(imported)
        if imported.startswith("samplers"):
            found |= _imports_within_the_package(imported, seen)
    return found


def test_the_pure_layer_never_imports_the_nnx_layer():
    package = pathlib.Path(samplers.__file__).parent
    pure = sorted((package / "distributions").glob("*.py"))
    assert pure, "no pure-layer modules found"
    for path in pure:
        name = f"samplers.distributions.{path.stem}"
        if path.stem == "__init__":
            name = "samplers.distributions"
        imported = _imports_within_the_package(name, set())
        shell = {m for m in imported if m.startswith(("samplers.heads", "flax"))}
        assert not shell, f"{name} imports {sorted(shell)}, directly or through samplers"
    imported = _imports_within_the_package("samplers.heads", set())
    assert "samplers.distributions.squashed_normal" in imported  # the check follows imports
    assert "samplers.testing" not in imported


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # the parent is a module, not a package
        return False


def test_no_module_imports_another_modules_private_names():
    package = pathlib.Path(samplers.__file__).parent
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("samplers"):
                # A private module (samplers._numerics) is shared; its private members are not.
                private = [
                    alias.name
                    for alias in node.names
                    if alias.name.startswith("_") and not _is_module(f"{node.module}.{alias.name}")
                ]
                assert not private, f"{path.name} imports {private} from {node.module}"


NEAR_BOUND = jnp.array([0.9999, 0.2])


@pytest.mark.parametrize(
    "old, new",
    [
        (
            lambda dist: samplers.log_prob_from_action(dist, jnp.array([0.5, 1.0])),
            lambda dist: dist.log_prob(jnp.array([0.5, 1.0])),
        ),
        (
            lambda dist: samplers.log_prob_from_action(
                dist, jnp.array([0.9999, 0.2]), min_distance=1e-3
            ),
            lambda dist: dist.log_prob(jnp.array([0.9999, 0.2]), min_distance=1e-3),
        ),
        (samplers.mode, lambda dist: dist.mode()),
        (
            lambda dist: samplers.kl_divergence(dist, dist[0]),
            lambda dist: dist.kl_divergence(dist[0]),
        ),
    ],
    ids=["log_prob_from_action", "log_prob_from_action clamped", "mode", "kl_divergence"],
)
def test_deprecated_free_functions_warn_and_return_the_method(old, new):
    dist = samplers.squashed_normal_from_std(jnp.array([[0.3, -2.0], [1.0, 4.0]]), jnp.ones((2, 2)))
    with pytest.deprecated_call(match=r"samplers\.\w+.* is deprecated and will be removed in 0\.5"):
        ours = old(dist)
    np.testing.assert_array_equal(ours, new(dist))


def test_deprecated_mode_pre_image_is_the_pre_image_the_mode_remembers():
    dist = samplers.squashed_normal_from_std(jnp.array([0.3, -0.7]), jnp.array([3.0, 1.5]))
    with pytest.deprecated_call():
        pre_image = samplers.mode_pre_image(dist)
    action = dist.mode()
    np.testing.assert_array_equal(action, dist.bijector.forward(pre_image))
    np.testing.assert_array_equal(dist.log_prob(action), dist.log_prob_from_pre_image(pre_image))


def test_the_test_session_keeps_its_compiled_programs_in_the_projects_jax_cache():
    # As the README says: .jax_cache/ holds what the session compiles.
    folder = pathlib.Path(__file__).parents[1] / ".jax_cache"
    assert jax.config.jax_compilation_cache_dir == str(folder)
    before = set(folder.iterdir()) if folder.exists() else set()
    unique = float(time.time_ns() % (1 << 24))  # a program no earlier run compiled
    jax.jit(lambda x: x * unique + 1.0)(jnp.ones(3)).block_until_ready()
    assert any(path.name.endswith("-cache") for path in set(folder.iterdir()) - before)
