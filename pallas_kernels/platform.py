"""Which platform a kernel is being built for.

Usually the host's (`jax.default_backend()`). When a program is lowered for an
accelerator the host lacks (`python -m lp_jax.aot`: compile-only TPU devices, or an
abstract H200 for a cuda export), the mesh in context names the target's devices, and
its platform is the one that counts, for "auto" and for the kernels' platform checks.
"""

from __future__ import annotations

import jax


def target_platform() -> str:
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    platform = device.platform if device is not None else jax.default_backend()
    return "gpu" if platform in ("cuda", "rocm") else platform


def tpu_interpret(interpret):
    """A TPU pallas_call's `interpret` argument from a kernel's: its InterpretParams as
    given, the defaults for True, False (compiled) otherwise."""
    from jax.experimental.pallas import tpu as pltpu

    if isinstance(interpret, pltpu.InterpretParams):
        return interpret
    return pltpu.InterpretParams() if interpret else False
