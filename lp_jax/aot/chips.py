"""The chip an AOT run targets: its name and the HBM of one JAX device, which the audit
checks programs against.

A TPU7x (Ironwood) chip holds two TensorCores that libtpu presents as two devices
(a "tpu7x:2x2x1" slice of 4 chips has 8), each with half the chip's HBM; the other
generations here present one device a chip (v4 and v5p fuse theirs as a megacore)."""

from __future__ import annotations

from lp_jax.roofline.hardware import get_hardware

CHIPS = {"v5e": "TPU v5e", "v6e": "TPU v6e", "v5p": "TPU v5p", "v4": "TPU v4",
         "tpu7x": "TPU7x (Ironwood)"}  # topology prefix (libtpu's name) -> roofline table
DEVICES_PER_CHIP = {"tpu7x": 2}


def chip(cfg) -> tuple[str, float]:
    """(name, HBM bytes of one device) of the target chip: a GPU's from its target config
    (what the device reports), a TPU's from the roofline table."""
    if cfg.platform == "cuda":
        from pallas_kernels.compile_targets import gpu_target_field

        return (gpu_target_field(cfg.gpu, "name"),
                float(gpu_target_field(cfg.gpu, "device_memory_size")))
    generation = cfg.topology.split(":")[0]
    if generation not in CHIPS:
        raise ValueError(f"unknown TPU generation in {cfg.topology!r}; known: {sorted(CHIPS)}")
    hw = get_hardware(CHIPS[generation])
    return hw.name, hw.hbm_bytes / DEVICES_PER_CHIP.get(generation, 1)
