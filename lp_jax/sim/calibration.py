"""Calibratable efficiency factors that turn roofline seconds into predicted step seconds.

Design note. The cost-model executor reduces a `StepPlan` to `StepFeatures`: for every op
(summed over the layers that run it) the seconds it would take at peak FLOP/s and at peak
HBM bandwidth, plus the number of decoder layers the step runs. A `Calibration` maps
features to seconds:

    t = sum_op max(c_op / eta_c, m_op / eta_b) + overhead + layer_overhead * layers

eta_c and eta_b are the achieved fractions of peak compute and bandwidth; `overhead` is the
per-iteration host / launch / sampling time; `layer_overhead` is the per-layer fixed cost
(kernel launches and tail effects, TP all-reduce latency). `fit` least-squares fits all four
from measured (features, seconds) pairs. The model is piecewise linear in (1/eta_c, 1/eta_b)
and convex, so we start from a coarse log grid (with the overheads solved exactly for each
grid point) and then refine by active-set Gauss-Newton: with each op's binding roof fixed the
model is linear, solve, re-assign, repeat. Local axis letters (beyond docs/glossary.md):
N = measured samples, O = ops of a step, K = fitted columns.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np


@dataclass(frozen=True, slots=True)
class StepFeatures:
    """Roofline seconds of one step's ops at 100% of peak, and the layers it runs."""

    compute_s: tuple[float, ...]  # per op, FLOPs / peak FLOP/s, summed over layers
    memory_s: tuple[float, ...]  # per op, max(HBM bytes / bw, link bytes / link bw)
    layers: float  # decoder layers executed (L, or a group's size when no decodes; 0.5: a half)

    def __post_init__(self) -> None:
        if len(self.compute_s) != len(self.memory_s):
            raise ValueError("compute_s and memory_s must have one entry per op")
        if self.layers < 0:
            raise ValueError("layers must be >= 0")


@dataclass(frozen=True, slots=True)
class Calibration:
    """eta_c, eta_b in (0, 10] (fractions of peak) and fixed overheads in seconds."""

    compute_efficiency: float = 1.0
    bandwidth_efficiency: float = 1.0
    overhead_s: float = 0.0  # per iteration
    layer_overhead_s: float = 0.0  # per decoder layer executed
    source: str = "roofline (no calibration)"

    def __post_init__(self) -> None:
        for name in ("compute_efficiency", "bandwidth_efficiency"):
            v = getattr(self, name)
            if not (math.isfinite(v) and 0.0 < v <= 10.0):
                raise ValueError(f"{name} must be in (0, 10], got {v}")
        for name in ("overhead_s", "layer_overhead_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0.0):
                raise ValueError(f"{name} must be finite and >= 0, got {v}")

    def op_seconds(self, compute_s: float, memory_s: float) -> float:
        return max(compute_s / self.compute_efficiency, memory_s / self.bandwidth_efficiency)

    def step_seconds(self, f: StepFeatures) -> float:
        ic, ib = 1.0 / self.compute_efficiency, 1.0 / self.bandwidth_efficiency
        ops = sum(max(c * ic, m * ib) for c, m in zip(f.compute_s, f.memory_s, strict=True))
        return ops + self.overhead_s + self.layer_overhead_s * f.layers

    @classmethod
    def fit(
        cls,
        samples: Sequence[tuple[StepFeatures, float]],
        *,
        relative: bool = True,
        fit_overheads: bool = True,
        source: str = "fitted",
    ) -> Calibration:
        """Least-squares factors from (features, measured seconds) pairs.

        relative=True minimises squared relative error (steps span orders of magnitude);
        fit_overheads=False keeps both overheads at 0.
        """
        if len(samples) < 2:
            raise ValueError("need at least two samples to fit")
        width = max(len(f.compute_s) for f, _ in samples)
        c_NO = np.zeros((len(samples), width))
        m_NO = np.zeros((len(samples), width))
        layers_N = np.zeros(len(samples))
        y_N = np.zeros(len(samples))
        for i, (f, y) in enumerate(samples):
            if not (math.isfinite(y) and y > 0):
                raise ValueError(f"measured seconds must be positive, got {y}")
            c_NO[i, : len(f.compute_s)] = f.compute_s
            m_NO[i, : len(f.memory_s)] = f.memory_s
            layers_N[i] = f.layers
            y_N[i] = y
        w_N = 1.0 / y_N if relative else np.ones_like(y_N)
        x = _fit(c_NO, m_NO, layers_N, y_N, w_N, fit_overheads)
        xc, xb, over, per_layer = x
        return cls(
            compute_efficiency=float(min(10.0, 1.0 / xc)),
            bandwidth_efficiency=float(min(10.0, 1.0 / xb)),
            overhead_s=float(over),
            layer_overhead_s=float(per_layer),
            source=f"{source} on {len(samples)} steps",
        )

    def with_source(self, source: str) -> Calibration:
        return replace(self, source=source)


_X_BOUNDS = (0.1, 1e4)  # 1/eta: from 10x peak (a mis-measured peak) to 1e-4 of it


def _loss(c_NO, m_NO, layers_N, y_N, w_N, x) -> float:
    xc, xb, over, per_layer = x
    pred = np.maximum(c_NO * xc, m_NO * xb).sum(axis=1) + over + per_layer * layers_N
    return float(np.sum((w_N * (pred - y_N)) ** 2))


def _solve_overheads(rest_N, layers_N, w_N, fit_overheads) -> tuple[float, float]:
    """Non-negative least squares for (overhead, layer_overhead) on the residual `rest_N`."""
    if not fit_overheads:
        return 0.0, 0.0
    best, best_loss = (0.0, 0.0), float(np.sum((w_N * rest_N) ** 2))
    cols = {"o": np.ones_like(layers_N), "l": layers_N}
    for subset in (("o",), ("l",), ("o", "l")):
        a_NK = np.stack([cols[k] * w_N for k in subset], axis=1)
        sol, *_ = np.linalg.lstsq(a_NK, rest_N * w_N, rcond=None)
        if np.any(sol < 0):
            continue
        vals = dict(zip(subset, sol, strict=True))
        cand = (float(vals.get("o", 0.0)), float(vals.get("l", 0.0)))
        loss = float(np.sum((w_N * (rest_N - cand[0] - cand[1] * layers_N)) ** 2))
        if loss < best_loss:
            best, best_loss = cand, loss
    return best


def _fit(c_NO, m_NO, layers_N, y_N, w_N, fit_overheads) -> tuple[float, float, float, float]:
    lo, hi = (math.log10(b) for b in _X_BOUNDS)
    grid = np.logspace(lo, hi, 49)
    best, best_loss = None, math.inf
    for xc, xb in itertools.product(grid, grid):
        ops_N = np.maximum(c_NO * xc, m_NO * xb).sum(axis=1)
        over, per_layer = _solve_overheads(y_N - ops_N, layers_N, w_N, fit_overheads)
        x = (xc, xb, over, per_layer)
        loss = _loss(c_NO, m_NO, layers_N, y_N, w_N, x)
        if loss < best_loss:
            best, best_loss = x, loss
    # Active-set refinement: fix each op's binding roof, solve the linear problem, repeat.
    x = best
    for _ in range(50):
        xc, xb = x[0], x[1]
        comp_NO = c_NO * xc >= m_NO * xb
        cols = [np.where(comp_NO, c_NO, 0.0).sum(axis=1), np.where(comp_NO, 0.0, m_NO).sum(axis=1)]
        if fit_overheads:
            cols += [np.ones_like(layers_N), layers_N]
        a_NK = np.stack(cols, axis=1) * w_N[:, None]
        keep = np.abs(a_NK).sum(axis=0) > 0
        sol = np.zeros(a_NK.shape[1])
        sol[keep], *_ = np.linalg.lstsq(a_NK[:, keep], y_N * w_N, rcond=None)
        if not keep[0]:
            sol[0] = xc  # no sample is compute-bound: keep the grid's value
        if not keep[1]:
            sol[1] = xb
        sol[:2] = np.clip(sol[:2], *_X_BOUNDS)
        if fit_overheads:
            sol[2:] = np.maximum(sol[2:], 0.0)
            cand = tuple(float(v) for v in sol)
        else:
            cand = (float(sol[0]), float(sol[1]), 0.0, 0.0)
        loss = _loss(c_NO, m_NO, layers_N, y_N, w_N, cand)
        if loss >= best_loss * (1 - 1e-12):
            break
        x, best_loss = cand, loss
    return x


# Priors from hardware specs and published kernel measurements, not fitted to any paper:
# - compute 0.70: large bf16 GEMMs in cuBLAS reach ~650-750 of the 989 dense TFLOP/s of an
#   H100 SXM; MoE grouped GEMMs at few rows per expert fall under the memory roof anyway.
# - bandwidth 0.85: stream-style kernels read ~2.8-3.0 of the 3.35 TB/s HBM3 peak.
# - 2 ms per iteration: host-side scheduling, input preparation and sampling of a
#   vLLM-class engine with CUDA graphs at TP2 (vLLM's v0.6 performance blog attributed more
#   than half of a small model's step time to such CPU work before its fixes; 1-3 ms after).
# - 20 us per layer: two TP all-reduces per layer at ~5-10 us NVLink latency each, plus
#   kernel tails and launch gaps inside a CUDA graph.
GPU_PRIOR = Calibration(
    compute_efficiency=0.70,
    bandwidth_efficiency=0.85,
    overhead_s=2e-3,
    layer_overhead_s=20e-6,
    source="prior from hardware specs (see lp_jax/sim/calibration.py)",
)


def prior_calibration(hardware_name: str) -> Calibration:
    """The documented prior for a GPU; the same numbers for every table entry for now."""
    return GPU_PRIOR.with_source(f"{GPU_PRIOR.source}, {hardware_name}")
