"""The chip an AOT run targets: its name and HBM, which the audit checks programs against."""

from __future__ import annotations

from lp_jax.roofline.hardware import get_hardware

CHIPS = {"v5e": "TPU v5e", "v6e": "TPU v6e", "v5p": "TPU v5p", "v4": "TPU v4"}


def chip(cfg) -> tuple[str, float]:
    """(name, HBM bytes) of the target chip: a GPU's from its target config (what the
    device reports), a TPU's from the roofline table."""
    if cfg.platform == "cuda":
        from pallas_kernels.compile_targets import gpu_target_field

        return (gpu_target_field(cfg.gpu, "name"),
                float(gpu_target_field(cfg.gpu, "device_memory_size")))
    generation = cfg.topology.split(":")[0]
    if generation not in CHIPS:
        raise ValueError(f"unknown TPU generation in {cfg.topology!r}; known: {sorted(CHIPS)}")
    hw = get_hardware(CHIPS[generation])
    return hw.name, hw.hbm_bytes
