"""Which JAX backends to start: the ones this machine has.

With libtpu installed (the `tpu` extra) on a machine with no TPU, JAX's default backend
search starts libtpu anyway, which prints a page of TPU-discovery warnings and "Unable to
initialize backend 'tpu'" before falling back to the CPU. `skip_absent_tpu()` names the
backends explicitly in that case (the CPU, and CUDA where an NVIDIA device is visible and
its plugin installed), before any backend has started. JAX_PLATFORMS, or a backend that is
already running, is left as it is: the user's choice wins.
"""

from __future__ import annotations

import importlib.util


def skip_absent_tpu() -> str | None:
    """Sets jax_platforms when libtpu is installed and no TPU is attached; returns the
    value set, or None when nothing was changed."""
    import jax
    from jax._src import hardware_utils, xla_bridge

    if jax.config.jax_platforms or xla_bridge._backends:  # chosen already, or started
        return None
    if importlib.util.find_spec("libtpu") is None:
        return None
    if hardware_utils.num_available_tpu_chips_and_device_id()[0]:
        return None
    cuda = hardware_utils.has_visible_nvidia_gpu() and any(
        _installed(f"jax_plugins.xla_cuda{v}") for v in (12, 13))
    platforms = "cuda,cpu" if cuda else "cpu"
    jax.config.update("jax_platforms", platforms)
    return platforms


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is absent
        return False
