"""Energy model: static power over time, plus energy per FLOP and per HBM byte.

Design note. Per device, E = P_static * t + e_flop * FLOPs + e_byte * HBM bytes. Static
power is charged for the whole simulated span (idle gaps too: a served GPU is never off);
FLOPs and bytes are the cost model's per-device counts times the number of devices.
Interconnect traffic is not charged separately (it is small at TP2 and its energy is not
well published).

Constants are first-principles estimates, not fits to the layered-prefill paper:

H100 SXM (the paper's GPU)
- TDP 700 W: NVIDIA H100 datasheet (https://www.nvidia.com/en-us/data-center/h100/).
- P_static = 100 W (uncertainty +-30%): idle H100/H200 SXM boards report ~70-80 W in
  nvidia-smi; a serving GPU sits at raised clocks between kernels, so we add ~25 W.
- e_flop = 0.8 pJ/FLOP (+-40%): derived. A large bf16 GEMM reaches ~700-750 TFLOP/s and
  runs at the 700 W cap, so (700 - 100) W / 7.2e14 FLOP/s = 0.83 pJ per FLOP, which
  includes the register-file and shared-memory traffic a tensor-core FLOP needs.
- e_byte = 80 pJ/B (+-50%): HBM device + PHY costs ~3.9 pJ/bit = 31 pJ/B (O'Connor et al.,
  "Fine-Grained DRAM", MICRO 2017, for HBM2; HBM3 is of the same order); moving the data on
  chip (crossbar, L2, SM load path) costs about as much again. With 80 pJ/B a kernel
  streaming at 85% of 3.35 TB/s draws 100 + 228 = ~330 W, inside the 270-450 W that
  public measurements report for memory-bound LLM decoding on H100 (e.g. The ML.ENERGY
  Leaderboard, https://ml.energy/leaderboard). This is the least certain constant.
H200 SXM: same GH100 die and 700 W TDP; HBM3e assumed 15% cheaper per byte (70 pJ/B).
A100 SXM 80GB: 400 W TDP (NVIDIA A100 datasheet), idle ~55 W, ~230 TFLOP/s achieved GEMM at
the cap -> (400 - 60) / 2.3e14 = 1.5 pJ/FLOP; HBM2e 80 pJ/B.
A800 SXM 80GB: the A100 with slower NVLink (400 W TDP too): the A100's constants.

`fit` refits (P_static, e_flop, e_byte) from measured (seconds, FLOPs, bytes, joules) per
device, e.g. NVML energy counters read around engine steps (a GPU task for later). Local
axis letters: N = samples, K = the three fitted constants.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lp_jax.roofline.hardware import Hardware

PJ = 1e-12


@dataclass(frozen=True, slots=True)
class EnergyModel:
    """Per-device energy: static watts, joules per FLOP, joules per HBM byte."""

    static_w: float
    j_per_flop: float
    j_per_byte: float
    source: str = "user"

    def __post_init__(self) -> None:
        for name in ("static_w", "j_per_flop", "j_per_byte"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"EnergyModel.{name} must be finite and >= 0, got {v}")

    def joules(self, seconds: float, flops: float, hbm_bytes: float, devices: int = 1) -> float:
        """Energy of `devices` devices over `seconds`, with FLOPs and bytes summed over them."""
        return (
            self.static_w * seconds * devices
            + self.j_per_flop * flops
            + self.j_per_byte * hbm_bytes
        )

    @classmethod
    def fit(
        cls, samples: Sequence[tuple[float, float, float, float]], *, source: str = "fitted"
    ) -> EnergyModel:
        """Non-negative least squares from per-device (seconds, FLOPs, bytes, joules) samples."""
        if len(samples) < 3:
            raise ValueError("need at least three samples to fit three constants")
        a_NK = np.array([[s, f, b] for s, f, b, _ in samples], dtype=np.float64)
        y_N = np.array([j for *_, j in samples], dtype=np.float64)
        scale_K = np.maximum(np.abs(a_NK).max(axis=0), 1e-300)  # columns differ by ~1e12
        best, best_loss = np.zeros(3), float(np.sum(y_N**2))
        for mask in range(1, 8):
            keep = [k for k in range(3) if mask >> k & 1]
            sol, *_ = np.linalg.lstsq(a_NK[:, keep] / scale_K[keep], y_N, rcond=None)
            if np.any(sol < 0):
                continue
            x = np.zeros(3)
            x[keep] = sol / scale_K[keep]
            loss = float(np.sum((a_NK @ x - y_N) ** 2))
            if loss < best_loss:
                best, best_loss = x, loss
        return cls(float(best[0]), float(best[1]), float(best[2]), f"{source} on {len(samples)}")


_TABLE: dict[str, EnergyModel] = {
    "H100 SXM": EnergyModel(100.0, 0.8 * PJ, 80.0 * PJ, "H100 SXM first-principles estimate"),
    "H200 SXM": EnergyModel(100.0, 0.8 * PJ, 70.0 * PJ, "H200 SXM first-principles estimate"),
    "A100 SXM 80GB": EnergyModel(60.0, 1.5 * PJ, 80.0 * PJ, "A100 first-principles estimate"),
    "A800 SXM 80GB": EnergyModel(60.0, 1.5 * PJ, 80.0 * PJ, "A800: the A100 estimate"),
}


def energy_model_for(hardware: Hardware | str) -> EnergyModel | None:
    """The documented constants for a hardware entry, or None when we have none."""
    name = hardware if isinstance(hardware, str) else hardware.name
    return _TABLE.get(name)
