"""Accelerator table for the roofline model, with a source for every number.

Design note. A roofline needs two numbers per chip: peak dense bf16 FLOP/s and HBM
bandwidth; their ratio is the ridge point (FLOP/B) below which a kernel is memory-bound.
We also keep HBM capacity, on-chip memory and interconnect bandwidth because the
layered-prefill argument touches all three (weights resident per device, tiles held
on chip, all-reduce / all-to-all traffic under tp / ep).

Conventions, applied to every entry:
- figures are per chip (a TPU v4/v5p/TPU7x chip has two TensorCores; we count both);
- FLOP/s are dense (no 2:4 sparsity) bf16 matrix-unit peaks, as the vendor states them;
- byte counts use the vendor's unit as printed (decimal GB unless the vendor says GiB);
- on-chip memory is the largest kernel-visible SRAM pool: L2 for GPUs (shared memory is
  per SM and noted in the source), VMEM summed over TensorCores plus CMEM for TPUs;
- interconnect is the vendor's per-chip aggregate, bidirectional (NVLink, ICI);
- link latency is the fixed cost of one collective step (one ring step, one peer message),
  used by ep_comm.py's time model; no vendor prints it, so every value is ASSUMED from a
  cited model; the topology says how chips reach each other (NVSwitch or a torus).
Where a number is uncertain, or derived rather than printed, the source says so.

`measure_current_device()` adds a "measured" entry for whatever device JAX runs on.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

GB = 1e9
GiB = 2**30
MiB = 2**20


@dataclass(frozen=True, slots=True)
class Sources:
    """Where each number of a `Hardware` entry comes from (URL plus a short note)."""

    peak_flops: str
    hbm_bw: str
    hbm_bytes: str
    onchip_bytes: str
    interconnect_bw: str
    link_latency_s: str = "not given"
    link_topology: str = "not given"

    def __post_init__(self) -> None:
        for name in (
            "peak_flops",
            "hbm_bw",
            "hbm_bytes",
            "onchip_bytes",
            "interconnect_bw",
            "link_latency_s",
            "link_topology",
        ):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"Sources.{name} must be a non-empty string")


@dataclass(frozen=True, slots=True)
class Hardware:
    """One accelerator chip: peak dense bf16 FLOP/s, HBM bandwidth and capacity, etc."""

    name: str
    peak_flops: float  # dense bf16 FLOP/s
    hbm_bw: float  # HBM bandwidth, B/s
    hbm_bytes: float  # HBM capacity, bytes (0 when unknown)
    onchip_bytes: float  # L2 or VMEM(+CMEM), bytes (0 when unknown)
    interconnect_bw: float  # NVLink / ICI per chip, bidirectional B/s (0 when none)
    sources: Sources
    link_latency_s: float = 0.0  # seconds per collective step (ASSUMED, see sources)
    link_topology: str = "switch"  # "switch" (NVSwitch), "torus2d" or "torus3d" (ICI)

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("Hardware.name must be non-empty")
        for field in ("peak_flops", "hbm_bw"):
            value = getattr(self, field)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"Hardware.{field} must be a positive finite number, got {value}")
        for field in ("hbm_bytes", "onchip_bytes", "interconnect_bw"):
            value = getattr(self, field)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"Hardware.{field} must be a finite number >= 0, got {value}")
        if not (math.isfinite(self.link_latency_s) and self.link_latency_s >= 0):
            raise ValueError(f"Hardware.link_latency_s must be >= 0, got {self.link_latency_s}")
        if self.link_topology not in ("switch", "torus2d", "torus3d"):
            raise ValueError(f"Hardware.link_topology unknown: {self.link_topology!r}")
        if not isinstance(self.sources, Sources):
            raise TypeError("Hardware.sources must be a Sources instance")

    @property
    def ridge_point(self) -> float:
        """Arithmetic intensity (FLOP per HBM byte) above which a kernel is compute-bound."""
        return self.peak_flops / self.hbm_bw


_NV_H100 = "https://www.nvidia.com/en-us/data-center/h100/ (H100 datasheet)"
_NV_H200 = "https://www.nvidia.com/en-us/data-center/h200/ (H200 datasheet)"
_GCP = "https://cloud.google.com/tpu/docs/"
_JAX_TPU_INFO = "jax/_src/tpu_info.py in jax 0.11.2 (per-TensorCore VMEM/CMEM table)"
_NVLINK_STEP_S = 1.9e-6
_NVLINK_LATENCY = (
    "ASSUMED: NCCL's tuning model (src/graph/tuning.cc, 2.18+), hwLat[NVLINK][Ring][LL128]"
    " = 1.9 us per ring step (LL 0.6, Simple 3.4); its per-collective baseLat (6.6-14 us)"
    " is not modelled"
)
_NVSWITCH = "HGX baseboard: every GPU reaches every other through NVSwitch in one hop"
_ICI_STEP_S = 1e-6
_TORUS2D = (
    f"{_GCP}system-architecture-tpu-vm: v5e / v6e chips have 4 ICI links in a 2D torus;"
    " wraparound links in every sub-slice ASSUMED (optimistic for all-to-all)"
)
_TORUS3D = (
    f"{_GCP}system-architecture-tpu-vm: v4 / v5p / Ironwood chips have 6 ICI links in a 3D"
    " torus (wraparound from a full 4x4x4 cube)"
)
_ICI_LATENCY = (
    "ASSUMED: 1 us per collective step; Google prints no ICI latency, neighbour links are"
    " described as sub-microsecond (e.g. 'ICI, OCS & the 3D torus' talk notes), plus DMA"
    " issue and synchronisation"
)

_TABLE: tuple[Hardware, ...] = (
    Hardware(
        name="A100 SXM 80GB",
        peak_flops=312e12,
        hbm_bw=2.039e12,
        hbm_bytes=80 * GB,
        onchip_bytes=40 * MiB,
        interconnect_bw=600 * GB,
        link_latency_s=_NVLINK_STEP_S,
        link_topology="switch",
        sources=Sources(
            peak_flops="NVIDIA A100 datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf):"
            " BF16 Tensor Core 312 TFLOPS dense, 624 with sparsity",
            hbm_bw="NVIDIA A100 datasheet: A100 80GB SXM 2,039 GB/s HBM2e",
            hbm_bytes="NVIDIA A100 datasheet: 80 GB HBM2e",
            onchip_bytes="NVIDIA Ampere architecture whitepaper: 40 MB L2 (deviceQuery 41,943,040"
            " bytes); shared memory up to 164 KB per SM x 108 SMs is separate",
            interconnect_bw="NVIDIA A100 datasheet: NVLink 3 600 GB/s per GPU (bidirectional)",
            link_latency_s=_NVLINK_LATENCY,
            link_topology=_NVSWITCH,
        ),
    ),
    Hardware(
        # FlowPrefill's testbed (8x A800). The A800 is the GA100 A100 with NVLink cut from 600
        # to 400 GB/s for the Oct 2022 US export rules; compute, HBM and L2 are the A100's.
        name="A800 SXM 80GB",
        peak_flops=312e12,
        hbm_bw=2.039e12,
        hbm_bytes=80 * GB,
        onchip_bytes=40 * MiB,
        interconnect_bw=400 * GB,
        link_latency_s=_NVLINK_STEP_S,
        link_topology="switch",
        sources=Sources(
            peak_flops="derived: NVIDIA's statement on the A800 (Reuters, 7 Nov 2022) says only"
            " the interconnect differs from the A100; A100 datasheet BF16 312 TFLOPS dense",
            hbm_bw="derived: A100 80GB SXM figure (A100 datasheet: 2,039 GB/s HBM2e), same"
            " memory system on the A800 80GB SXM",
            hbm_bytes="NVIDIA A800 80GB SXM listings: 80 GB HBM2e (as the A100 80GB)",
            onchip_bytes="same GA100 die as the A100: 40 MB L2 (Ampere whitepaper)",
            interconnect_bw="NVIDIA's statement on the A800 (Reuters, 7 Nov 2022): NVLink"
            " 400 GB/s per GPU (bidirectional), vs 600 GB/s on the A100",
            link_latency_s=_NVLINK_LATENCY,
            link_topology=_NVSWITCH,
        ),
    ),
    Hardware(
        name="H100 SXM",
        peak_flops=989.4e12,
        hbm_bw=3.35e12,
        hbm_bytes=80 * GB,
        onchip_bytes=50 * MiB,
        interconnect_bw=900 * GB,
        link_latency_s=_NVLINK_STEP_S,
        link_topology="switch",
        sources=Sources(
            peak_flops=f"{_NV_H100}: BF16 Tensor Core 1,979 TFLOPS with sparsity -> 989.4 dense"
            " (Hopper whitepaper table)",
            hbm_bw=f"{_NV_H100}: H100 SXM 3.35 TB/s HBM3",
            hbm_bytes=f"{_NV_H100}: 80 GB HBM3",
            onchip_bytes="NVIDIA Hopper architecture whitepaper: 50 MB L2; shared memory up to"
            " 228 KB per SM x 132 SMs is separate",
            interconnect_bw=f"{_NV_H100}: NVLink 4 900 GB/s per GPU (bidirectional)",
            link_latency_s=_NVLINK_LATENCY,
            link_topology=_NVSWITCH,
        ),
    ),
    Hardware(
        name="H200 SXM",
        peak_flops=989.4e12,
        hbm_bw=4.8e12,
        hbm_bytes=141 * GB,
        onchip_bytes=50 * MiB,
        interconnect_bw=900 * GB,
        link_latency_s=_NVLINK_STEP_S,
        link_topology="switch",
        sources=Sources(
            peak_flops=f"{_NV_H200}: BF16 Tensor Core 1,979 TFLOPS with sparsity -> 989.4 dense"
            " (same GH100 compute as H100 SXM)",
            hbm_bw=f"{_NV_H200}: 4.8 TB/s HBM3e",
            hbm_bytes=f"{_NV_H200}: 141 GB HBM3e",
            onchip_bytes="same GH100 die as H100: 50 MB L2 (Hopper whitepaper)",
            interconnect_bw=f"{_NV_H200}: NVLink 4 900 GB/s per GPU (bidirectional)",
            link_latency_s=_NVLINK_LATENCY,
            link_topology=_NVSWITCH,
        ),
    ),
    Hardware(
        name="B200",
        peak_flops=2.25e15,
        hbm_bw=8.0e12,
        hbm_bytes=180 * GB,
        onchip_bytes=126 * MiB,
        interconnect_bw=1800 * GB,
        link_latency_s=_NVLINK_STEP_S,
        link_topology="switch",
        sources=Sources(
            peak_flops="https://www.nvidia.com/en-us/data-center/hgx/ (HGX B200, 1000 W):"
            " FP16/BF16 36 PFLOPS per 8 GPUs with sparsity -> 2.25 PFLOPS dense per GPU;"
            " the GB200 part at 1200 W is quoted at 2.5 PFLOPS, so the SKU matters (uncertain)",
            hbm_bw="NVIDIA HGX B200 spec: 64 TB/s per 8 GPUs -> 8 TB/s per GPU",
            hbm_bytes="NVIDIA HGX B200 spec: 1.44 TB per 8 GPUs -> 180 GB per GPU (192 GB"
            " physical on some listings; uncertain)",
            onchip_bytes="uncertain: 126 MB L2 as measured by chipsandcheese.com 'Nvidia's B200:"
            " Keeping the CUDA Juggernaut Rolling'; NVIDIA does not print it in the datasheet",
            interconnect_bw="NVIDIA HGX B200 spec: NVLink 5 1.8 TB/s GPU-to-GPU (bidirectional)",
            link_latency_s=_NVLINK_LATENCY,
            link_topology=_NVSWITCH,
        ),
    ),
    Hardware(
        name="TPU v4",
        peak_flops=275e12,
        hbm_bw=1.2e12,
        hbm_bytes=32 * GiB,
        onchip_bytes=2 * 16 * MiB + 128 * MiB,
        interconnect_bw=600 * GB,
        link_latency_s=_ICI_STEP_S,
        link_topology="torus3d",
        sources=Sources(
            peak_flops=f"{_GCP}v4: peak compute per chip 275 TFLOPS (bf16 or int8)",
            hbm_bw=f"{_GCP}v4: HBM2 32 GiB, 1200 GBps",
            hbm_bytes=f"{_GCP}v4: HBM2 32 GiB",
            onchip_bytes=f"{_JAX_TPU_INFO}: 16 MiB VMEM per TensorCore x 2 plus 128 MiB CMEM"
            " (134e6 bytes) per chip",
            interconnect_bw="uncertain, derived: 6 ICI links x ~400 Gb/s per direction"
            " (glennklockwood.com/garden/processors/TPUv4; TPU v4 ISCA 2023 paper) -> ~600 GB/s"
            " bidirectional per chip; GCP does not print a per-chip figure",
            link_latency_s=_ICI_LATENCY,
            link_topology=_TORUS3D,
        ),
    ),
    Hardware(
        name="TPU v5e",
        peak_flops=197e12,
        hbm_bw=819e9,
        hbm_bytes=16 * GB,
        onchip_bytes=128 * MiB,
        interconnect_bw=400 * GB,
        link_latency_s=_ICI_STEP_S,
        link_topology="torus2d",
        sources=Sources(
            peak_flops=f"{_GCP}v5e: peak compute per chip (bf16) 197 TFLOPs",
            hbm_bw=f"{_GCP}v5e: HBM2 16 GB, 819 GBps (a newer revision prints 800 GiBps)",
            hbm_bytes=f"{_GCP}v5e: HBM2 16 GB",
            onchip_bytes=f"{_JAX_TPU_INFO}: 128 MiB VMEM (one TensorCore per chip)",
            interconnect_bw=f"{_GCP}v5e: bidirectional ICI bandwidth per chip 400 GBps (1600 Gbps)",
            link_latency_s=_ICI_LATENCY,
            link_topology=_TORUS2D,
        ),
    ),
    Hardware(
        name="TPU v5p",
        peak_flops=459e12,
        hbm_bw=2.765e12,
        hbm_bytes=95 * GB,
        onchip_bytes=2 * 64 * MiB,
        interconnect_bw=600 * GB,
        link_latency_s=_ICI_STEP_S,
        link_topology="torus3d",
        sources=Sources(
            peak_flops=f"{_GCP}v5p: peak compute per chip (bf16) 459 TFLOPs",
            hbm_bw=f"{_GCP}v5p: HBM2e 95 GB, 2765 GBps",
            hbm_bytes=f"{_GCP}v5p: HBM2e 95 GB",
            onchip_bytes=f"{_JAX_TPU_INFO}: 64 MiB VMEM per TensorCore x 2 TensorCores",
            interconnect_bw=f"{_GCP}v5p: interchip interconnect BW 4800 Gbps = 600 GB/s"
            " (bidirectional per chip assumed)",
            link_latency_s=_ICI_LATENCY,
            link_topology=_TORUS3D,
        ),
    ),
    Hardware(
        name="TPU v6e",
        peak_flops=918e12,
        hbm_bw=1.638e12,
        hbm_bytes=32 * GB,
        onchip_bytes=128 * MiB,
        interconnect_bw=800 * GB,
        link_latency_s=_ICI_STEP_S,
        link_topology="torus2d",
        sources=Sources(
            peak_flops=f"{_GCP}v6e (Trillium): peak compute per chip (bf16) 918 TFLOPs",
            hbm_bw=f"{_GCP}v6e: HBM bandwidth per chip 1638 GBps (older revision: 1640)",
            hbm_bytes=f"{_GCP}v6e: HBM capacity per chip 32 GB",
            onchip_bytes=f"{_JAX_TPU_INFO}: 128 MiB VMEM (one TensorCore per chip)",
            interconnect_bw=f"{_GCP}v6e: bidirectional ICI bandwidth per chip 800 GBps",
            link_latency_s=_ICI_LATENCY,
            link_topology=_TORUS2D,
        ),
    ),
    Hardware(
        name="TPU7x (Ironwood)",
        peak_flops=2307e12,
        hbm_bw=7.38e12,
        hbm_bytes=192 * GiB,
        onchip_bytes=2 * 64 * MiB,
        interconnect_bw=1200 * GB,
        link_latency_s=_ICI_STEP_S,
        link_topology="torus3d",
        sources=Sources(
            peak_flops=f"{_GCP}tpu7x: peak compute per chip (BF16) 2307 TFLOPs (FP8 4614)",
            hbm_bw="uncertain: the GCP tpu7x table row was not retrievable here; jax 0.11.2"
            " tpu_info lists 7.40e12 B/s and Hot Chips 2025 coverage 7.3-7.37 TB/s; 7.38e12 used",
            hbm_bytes=f"{_GCP}tpu7x: HBM capacity per chip 192 GiB",
            onchip_bytes=f"uncertain: {_JAX_TPU_INFO}: 64 MiB VMEM per TensorCore x 2"
            " TensorCores, CMEM not listed",
            interconnect_bw="Google Cloud Ironwood announcement (April 2025): ICI 1.2 TB/s"
            " bidirectional per chip",
            link_latency_s=_ICI_LATENCY,
            link_topology=_TORUS3D,
        ),
    ),
)

HARDWARE: dict[str, Hardware] = {hw.name: hw for hw in _TABLE}

_ALIASES = {
    "a100": "A100 SXM 80GB",
    "a800": "A800 SXM 80GB",
    "h100": "H100 SXM",
    "h200": "H200 SXM",
    "b200": "B200",
    "v4": "TPU v4",
    "v5e": "TPU v5e",
    "v5p": "TPU v5p",
    "v6e": "TPU v6e",
    "trillium": "TPU v6e",
    "tpu7x": "TPU7x (Ironwood)",
    "ironwood": "TPU7x (Ironwood)",
}


def _key(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum())


def get_hardware(name: str) -> Hardware:
    """Look up a table entry by its name or a short alias ("h100", "v5e", "ironwood")."""
    wanted = _key(name)
    for hw in _TABLE:
        if _key(hw.name) == wanted:
            return hw
    for alias, full in _ALIASES.items():
        if _key(alias) == wanted or _key("tpu" + alias) == wanted:
            return HARDWARE[full]
    raise KeyError(f"unknown hardware {name!r}; known: {sorted(HARDWARE)}")


def _best_seconds(fn: Callable[[], object], repeats: int) -> float:
    from pallas_kernels.timing import time_call

    return time_call(fn, iters=repeats).best


def measure_current_device(
    *,
    matmul_size: int | None = None,
    copy_bytes: int | None = None,
    repeats: int = 3,
    dtype: str | None = None,
) -> Hardware:
    """Microbenchmark the first JAX device and return a "measured" `Hardware` entry.

    FLOP/s: best of `repeats` runs of an n x n matmul (2 n^3 FLOP); bf16 on accelerators,
    f32 on CPU (XLA:CPU has no fast bf16 path). Bandwidth: best of `repeats` in-place
    (donated) `x + 1` passes over `copy_bytes` of f32, one read plus one write. Defaults
    keep the run within a few seconds on a 2-core CPU and use sizes that reach peak on a
    GPU/TPU.
    """
    import jax
    import jax.numpy as jnp

    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    device = jax.devices()[0]
    on_cpu = device.platform == "cpu"
    n = matmul_size or (1024 if on_cpu else 8192)
    nbytes = copy_bytes or (64 * MiB if on_cpu else GiB)
    dtype_name = dtype or ("float32" if on_cpu else "bfloat16")
    mm_dtype = jnp.dtype(dtype_name)

    a_MM = jnp.ones((n, n), mm_dtype)  # M: the benchmark matmul's side n (local letter)
    b_MM = jnp.full((n, n), 0.5, mm_dtype)
    matmul = jax.jit(lambda x, y: x @ y)
    mm_seconds = _best_seconds(lambda: matmul(a_MM, b_MM).block_until_ready(), repeats)
    flops = 2.0 * n**3 / mm_seconds

    # Donate the input so each pass writes into the buffer it read from: timing a fresh
    # output allocation would measure page faults, not HBM / DRAM bandwidth.
    add_one = jax.jit(lambda v: v + 1.0, donate_argnums=0)
    buffer = [jnp.zeros((nbytes // 4,), jnp.float32)]
    moved = 2.0 * buffer[0].nbytes  # one read plus one write

    def copy_pass() -> None:
        buffer[0] = add_one(buffer[0])
        buffer[0].block_until_ready()

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*donated buffers.*")
        copy_seconds = _best_seconds(copy_pass, repeats)
    bandwidth = moved / copy_seconds

    capacity = 0.0
    try:
        stats = device.memory_stats() or {}
        capacity = float(stats.get("bytes_limit", 0))
    except Exception:  # noqa: BLE001 - CPU backends may not implement memory_stats
        capacity = 0.0

    kind = getattr(device, "device_kind", device.platform)
    note = f"measured with jax {jax.__version__} on {kind}"
    return Hardware(
        name=f"measured ({kind})",
        peak_flops=flops,
        hbm_bw=bandwidth,
        hbm_bytes=capacity,
        onchip_bytes=0.0,
        interconnect_bw=0.0,
        sources=Sources(
            peak_flops=f"{note}: best of {repeats} {n}x{n} {dtype_name} matmuls",
            hbm_bw=f"{note}: best of {repeats} in-place x+1 passes, {moved:.0f} bytes moved each",
            hbm_bytes=f"{note}: device.memory_stats()['bytes_limit'] (0 if unavailable)",
            onchip_bytes="not measured",
            interconnect_bw="not measured",
        ),
    )
