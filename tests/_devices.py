"""The environment of a test subprocess that sees several forced CPU devices."""

import os
import pathlib

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


def cpu_devices_environment(devices: int) -> dict:
    """``os.environ`` with ``devices`` host CPU devices and the test session's settings."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["JAX_NUMPY_RANK_PROMOTION"] = "raise"
    # Warnings are errors, as in the test session; tfp-nightly, imported by distrax,
    # uses an API that jax deprecates.
    env["PYTHONWARNINGS"] = (
        "error,ignore:jax.core.pytype_aval_mappings is deprecated:DeprecationWarning"
    )
    env["PYTHONPATH"] = os.pathsep.join(
        path for path in (str(REPO_ROOT), env.get("PYTHONPATH")) if path
    )
    return env
