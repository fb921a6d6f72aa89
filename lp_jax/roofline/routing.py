"""Expected activated experts E_act(T) when T tokens each pick top-k of E experts.

Design note. Every routing model here reduces to per-expert inclusion probabilities
p_E (the chance that one token selects expert e; sum_e p_e = k) and treats tokens as
independent, so

    E_act(T) = sum_e 1 - (1 - p_e)^T,   and E_act(1) = k exactly.

- `UniformRouting`: p_e = k/E, giving the closed form E * (1 - (1 - k/E)^T).
- `ZipfRouting(s)`: expert popularity follows a Zipf law over popularity rank r,
  w_r ∝ r^-s (the usual rank-frequency shape of MoE expert load). A token's k experts
  are modelled as the distinct experts hit by a Poisson number of popularity-weighted
  draws, so p_r = 1 - exp(-lam * w_r) with lam solved so that sum_r p_r = k. This keeps
  every p_r in (0, 1) without ad-hoc clipping and has one free parameter, s.
  Fitted (least squares on coverage fraction) to the layered-prefill paper's Table 1
  for Qwen3-30B-A3B (E=128, k=8): a decode batch of 32 tokens activates ~55% of the
  experts and 128 tokens ~86%. The fit gives s = QWEN3_ZIPF_EXPONENT = 1.279, which
  reproduces 53.8% and 87.1%; uniform routing would give 87.3% and 99.97%.
  Reusing the same s for another (E, k) is an assumption, not a measurement.
- `MeasuredRouting`: a per-expert histogram supplied by the user (e.g. router counts
  collected by the engine), normalised to sum to k.

Tokens of one request are correlated in reality (they share topics), which also lowers
coverage; the Zipf fit absorbs that into one skew parameter.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

QWEN3_ZIPF_EXPONENT = 1.279
PAPER_TABLE1_TARGETS: tuple[tuple[int, float], ...] = ((32, 0.55), (128, 0.86))


class Routing(Protocol):
    """Anything that yields per-expert inclusion probabilities for (E, k)."""

    @property
    def label(self) -> str: ...

    def probs_E(self, num_experts: int, top_k: int) -> np.ndarray: ...


def _check_ek(num_experts: int, top_k: int) -> None:
    if num_experts < 1 or not 1 <= top_k <= num_experts:
        raise ValueError(f"need 1 <= top_k <= num_experts, got E={num_experts}, k={top_k}")


@dataclass(frozen=True, slots=True)
class UniformRouting:
    """Every expert equally likely: p_e = k / E."""

    @property
    def label(self) -> str:
        return "uniform"

    def probs_E(self, num_experts: int, top_k: int) -> np.ndarray:
        _check_ek(num_experts, top_k)
        return np.full(num_experts, top_k / num_experts)


def zipf_inclusion_probs(num_experts: int, top_k: int, exponent: float) -> np.ndarray:
    """p_r = 1 - exp(-lam * w_r), w_r ∝ r^-exponent, lam such that sum_r p_r = top_k."""
    _check_ek(num_experts, top_k)
    if top_k == num_experts:
        return np.ones(num_experts)
    ranks_E = np.arange(1, num_experts + 1, dtype=np.float64)
    w_E = ranks_E**-exponent
    w_E /= w_E.sum()

    def mass(lam: float) -> float:
        return float(np.sum(-np.expm1(-lam * w_E)))

    lo, hi = 0.0, float(top_k)
    while mass(hi) < top_k:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mass(mid) < top_k:
            lo = mid
        else:
            hi = mid
    return -np.expm1(-hi * w_E)


@dataclass(frozen=True, slots=True)
class ZipfRouting:
    """Zipf(s) expert popularity with Poissonised top-k inclusion (see module note)."""

    exponent: float = QWEN3_ZIPF_EXPONENT

    def __post_init__(self) -> None:
        if not (math.isfinite(self.exponent) and self.exponent >= 0):
            raise ValueError("ZipfRouting.exponent must be a finite number >= 0")

    @property
    def label(self) -> str:
        return f"zipf(s={self.exponent:g})"

    def probs_E(self, num_experts: int, top_k: int) -> np.ndarray:
        return zipf_inclusion_probs(num_experts, top_k, self.exponent)


@dataclass(frozen=True, slots=True)
class MeasuredRouting:
    """A measured routing histogram: per-expert selection probabilities (sum = top_k)."""

    probs: tuple[float, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.probs, tuple) or not self.probs:
            raise ValueError("MeasuredRouting.probs must be a non-empty tuple")
        if any(not (0.0 <= p <= 1.0) for p in self.probs):
            raise ValueError("MeasuredRouting.probs must lie in [0, 1]")

    @property
    def label(self) -> str:
        return "measured"

    @classmethod
    def from_counts(cls, counts_E: Sequence[float] | np.ndarray, top_k: int) -> MeasuredRouting:
        """From per-expert routed-row counts over some tokens: p_e = k * c_e / sum(c)."""
        c_E = np.asarray(counts_E, dtype=np.float64)
        if c_E.ndim != 1 or c_E.size < top_k or np.any(c_E < 0) or c_E.sum() <= 0:
            raise ValueError("counts_E must be a 1-D non-negative histogram with a positive sum")
        p_E = np.minimum(top_k * c_E / c_E.sum(), 1.0)
        return cls(tuple(float(p) for p in p_E))

    def probs_E(self, num_experts: int, top_k: int) -> np.ndarray:
        _check_ek(num_experts, top_k)
        p_E = np.asarray(self.probs, dtype=np.float64)
        if p_E.size != num_experts:
            raise ValueError(f"histogram has {p_E.size} experts, model has {num_experts}")
        total = p_E.sum()
        if not math.isclose(total, top_k, rel_tol=0.02):
            raise ValueError(f"histogram sums to {total:.4g}, expected top_k={top_k}")
        return p_E * (top_k / total)


UNIFORM = UniformRouting()
SKEWED = ZipfRouting()


def active_from_probs(p_E: np.ndarray, tokens: float | np.ndarray) -> float | np.ndarray:
    """sum_e 1 - (1 - p_e)^T, vectorised over `tokens`."""
    t = np.asarray(tokens, dtype=np.float64)
    if np.any(t < 0):
        raise ValueError("tokens must be >= 0")
    miss_E = 1.0 - np.clip(p_E, 0.0, 1.0)
    out = (1.0 - np.power(miss_E, t[..., None])).sum(axis=-1)
    return float(out) if np.ndim(out) == 0 else out


def expected_active(
    routing: Routing, num_experts: int, top_k: int, tokens: float | np.ndarray
) -> float | np.ndarray:
    """E_act(T): expected number of distinct experts activated by `tokens` tokens."""
    return active_from_probs(routing.probs_E(num_experts, top_k), tokens)


def fit_zipf_exponent(
    num_experts: int = 128,
    top_k: int = 8,
    targets: Sequence[tuple[int, float]] = PAPER_TABLE1_TARGETS,
    lo: float = 0.0,
    hi: float = 4.0,
) -> float:
    """Least-squares Zipf exponent s matching (tokens, coverage fraction) targets.

    Coverage falls monotonically in s, so the squared error is unimodal on [lo, hi];
    a golden-section search finds the minimum to ~1e-9.
    """
    if not targets:
        raise ValueError("need at least one target")

    def loss(s: float) -> float:
        p_E = zipf_inclusion_probs(num_experts, top_k, s)
        return sum((active_from_probs(p_E, t) / num_experts - frac) ** 2 for t, frac in targets)

    inv_phi = (math.sqrt(5.0) - 1.0) / 2.0
    a, b = lo, hi
    c, d = b - inv_phi * (b - a), a + inv_phi * (b - a)
    fc, fd = loss(c), loss(d)
    while b - a > 1e-9:
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - inv_phi * (b - a)
            fc = loss(c)
        else:
            a, c, fc = c, d, fd
            d = a + inv_phi * (b - a)
            fd = loss(d)
    return 0.5 * (a + b)
