"""Test-wide setup: 8 simulated CPU devices for the mesh tests, set before JAX loads."""

import os

flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

# The slowest files first (`make test` runs two xdist workers, a file each at a time):
# longest-first keeps one long file from running alone at the end.
SLOWEST_FIRST = ("test_programs.py", "test_engine.py", "test_moe_kernels.py",
                 "test_gpu_validate.py", "test_pallas_end_to_end.py",
                 "test_attention_kernels.py", "test_sharded_kernels.py",
                 "test_golden_parity.py", "test_kernel_check.py", "test_tpu_compile.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: keeps order


@pytest.fixture(scope="session")
def tiny_dir():
    from checkpoints.make_tiny import ensure_tiny

    return ensure_tiny(preset="tiny")


@pytest.fixture(scope="session")
def tiny_model(tiny_dir):
    from lp_jax.loader import load_model

    return load_model(tiny_dir)


def start_server(engine, **kw):
    """An OpenAI server for `engine` on a loopback port, in a background thread."""
    from lp_jax.server import OpenAIServer, ServerThread

    return ServerThread(OpenAIServer(engine, served_model_names=["mock"], **kw)).start()


@pytest.fixture(scope="module")
def mock_server(tiny_dir):
    """The server over a mock engine (max_model_len 64), shared by a test module."""
    from lp_jax.server.mock import MockEngine

    st_ = start_server(MockEngine(model_dir=tiny_dir, max_model_len=64))
    yield st_
    st_.stop()
