"""The installed package's version (pyproject.toml)."""

from importlib.metadata import PackageNotFoundError, version


def lp_jax_version() -> str:
    try:
        return version("lp_jax")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"
