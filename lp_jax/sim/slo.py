"""SLO attainment and the sustainable-rate search.

A request passes iff its TTFT <= the TTFT SLO and every inter-token gap <= the TBT SLO
(`lp_jax.core.metrics.slo_pass`). The sustainable rate is the highest request rate whose
attainment is >= 90%. Attainment is only roughly monotone in the rate (finite samples), so
`sustainable_rate` walks an increasing grid until the first failing rate (extending the grid
geometrically while everything passes), then bisects between the last passing and the first
failing rate. Every evaluated point is returned for plotting.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from lp_jax.core.metrics import RequestMetrics, slo_pass


def attainment(metrics: Iterable[RequestMetrics], ttft_slo: float, tbt_slo: float) -> float:
    ms = list(metrics)
    if not ms:
        return math.nan
    return sum(slo_pass(m, ttft_slo, tbt_slo) for m in ms) / len(ms)


@dataclass(slots=True)
class RateSearch:
    rate: float  # highest rate found with attainment >= target (0.0 if none)
    lower_bound_only: bool  # True when even the highest rate tried passed ("rate+")
    points: dict[float, float] = field(default_factory=dict)  # rate -> attainment

    def curve(self) -> tuple[list[float], list[float]]:
        rates = sorted(self.points)
        return rates, [self.points[r] for r in rates]


def sustainable_rate(
    evaluate: Callable[[float], float],
    rates: Sequence[float],
    *,
    target: float = 0.9,
    bisect_steps: int = 3,
    max_extensions: int = 3,
    growth: float = 1.5,
    full_curve: bool = False,
) -> RateSearch:
    """Highest rate with evaluate(rate) >= target.

    `rates`: an increasing grid. Without `full_curve` the walk stops at the first failure;
    with it every grid rate is evaluated (for plots) and the first failure still decides.
    """
    grid = sorted(set(float(r) for r in rates))
    if not grid or grid[0] <= 0:
        raise ValueError("rates must be a non-empty set of positive numbers")
    points: dict[float, float] = {}

    def ev(r: float) -> float:
        if r not in points:
            points[r] = float(evaluate(r))
        return points[r]

    lo, hi = 0.0, None
    for r in grid:
        if ev(r) >= target:
            if hi is None:
                lo = r
        elif hi is None:
            hi = r
            if not full_curve:
                break
    extensions = 0
    while hi is None and extensions < max_extensions:
        r = grid[-1] * growth ** (extensions + 1)
        if ev(r) >= target:
            lo = r
        else:
            hi = r
        extensions += 1
    if hi is None:
        return RateSearch(lo, True, points)
    for _ in range(bisect_steps):  # lo may be 0: the lowest rate already failed
        mid = 0.5 * (lo + hi)
        if ev(mid) >= target:
            lo = mid
        else:
            hi = mid
    return RateSearch(lo, False, points)
