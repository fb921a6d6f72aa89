"""Latency metrics of one request, SLO checks and percentile summaries.

Plain Python with no engine imports: the engine fills these from its sequences and the
simulator fills them from its cost model, and both summarise them with the same code.

`token_times` holds the time of every output token, the first included, so TTFT is
`token_times[0] - arrival_time` and the inter-token latencies (ITLs, the TBT of the papers)
are the gaps between consecutive entries. A request preempted and recomputed keeps its
earlier token times, so the stall shows up as one long ITL, as a user would see it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None  # defaults to token_times[0]
    token_times: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        times = tuple(float(t) for t in self.token_times)
        object.__setattr__(self, "token_times", times)
        if any(b < a for a, b in zip(times, times[1:], strict=False)):
            raise ValueError(f"token_times must be non-decreasing, got {times}")
        if self.first_token_time is None and times:
            object.__setattr__(self, "first_token_time", times[0])
        if self.first_token_time is not None:
            if not times or times[0] != self.first_token_time:
                raise ValueError(
                    f"first_token_time {self.first_token_time} must equal token_times[0] "
                    f"(token_times={times})"
                )
            if self.first_token_time < self.arrival_time:
                raise ValueError(
                    f"first token at {self.first_token_time} precedes arrival "
                    f"at {self.arrival_time}"
                )

    @property
    def num_tokens(self) -> int:
        return len(self.token_times)

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    @property
    def max_itl(self) -> float:
        """Largest inter-token latency; 0.0 for requests with fewer than two tokens."""
        return max(self.itls, default=0.0)

    @property
    def e2e(self) -> float | None:
        if not self.token_times:
            return None
        return self.token_times[-1] - self.arrival_time


def slo_pass(metrics: RequestMetrics, ttft_slo: float, tbt_slo: float) -> bool:
    """True iff the request produced a token, its TTFT <= ttft_slo and every ITL <= tbt_slo."""
    ttft = metrics.ttft
    return ttft is not None and ttft <= ttft_slo and metrics.max_itl <= tbt_slo


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method); NaN for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(
    metrics: Iterable[RequestMetrics],
    ttft_slo: float | None = None,
    tbt_slo: float | None = None,
) -> dict[str, float]:
    """p50/p90/p99 of TTFT, max-ITL and end-to-end latency, plus mean TTFT.

    Requests that produced no token (aborted early) count in `num_requests` but not in the
    latency statistics. With both SLOs given, `slo_attainment` is the share of all requests
    that pass `slo_pass`.
    """
    ms = list(metrics)
    done = [m for m in ms if m.first_token_time is not None]
    ttfts = [m.ttft for m in done]
    max_itls = [m.max_itl for m in done]
    e2es = [m.e2e for m in done]
    out: dict[str, float] = {
        "num_requests": float(len(ms)),
        "num_with_tokens": float(len(done)),
        "ttft_mean": sum(ttfts) / len(ttfts) if ttfts else math.nan,
    }
    for name, xs in (("ttft", ttfts), ("max_itl", max_itls), ("e2e", e2es)):
        for q in (50, 90, 99):
            out[f"{name}_p{q}"] = percentile(xs, q)
    if ttft_slo is not None and tbt_slo is not None:
        passed = sum(slo_pass(m, ttft_slo, tbt_slo) for m in ms)
        out["slo_attainment"] = passed / len(ms) if ms else math.nan
    return out
