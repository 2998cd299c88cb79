import math
import subprocess
import sys

import jax.numpy as jnp
import pytest
from beartype import beartype
from flax import nnx
from jaxtyping import TypeCheckError, jaxtyped

import samplers


def test_public_names_are_pinned():
    assert sorted(samplers.__all__) == [
        "ActionSampler",
        "BoundedTanh",
        "CrossCheckReport",
        "DistributionSampler",
        "NormalTanhSampler",
        "Sigmoid",
        "SquashedNormal",
        "SquashedNormalSampler",
        "StateIndependentSampler",
        "StatefulModule",
        "StatefulModuleOutput",
        "Tanh",
        "bound_distance",
        "cross_check",
        "functional",
        "kl_divergence",
        "log_prob_from_action",
        "mode",
        "mode_pre_image",
        "normal_tanh",
        "ppo_log_ratio_stats",
        "saturation_fraction",
        "squashed_normal",
        "squashed_normal_from_log_std",
        "squashed_normal_from_std",
    ]
    assert all(hasattr(samplers, name) for name in samplers.__all__)


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


def _checked(function):
    return jaxtyped(typechecker=beartype)(function)


@pytest.mark.parametrize("batch", [(), (5,), (3, 4)], ids=["(A,)", "(B,A)", "(T,B,A)"])
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


@pytest.mark.parametrize("batch", [(), (5,), (3, 4)], ids=["(A,)", "(B,A)", "(T,B,A)"])
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
