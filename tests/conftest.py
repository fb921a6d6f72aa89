"""Test-wide setup: 8 simulated CPU devices for the mesh tests, set before JAX loads."""

import os

flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_dir():
    from checkpoints.make_tiny import ensure_tiny

    return ensure_tiny(preset="tiny")


@pytest.fixture(scope="session")
def tiny_model(tiny_dir):
    from lp_jax.loader import load_model

    return load_model(tiny_dir)
