"""Workloads: arrival processes, request-length models and trace files.

Design note. A workload is a list of `Request(arrival, prompt_len, output_len[, slo,
slo_class])`. Arrivals
come from a gamma renewal process with mean gap 1/rate and coefficient of variation `cv`
(cv = 1 is Poisson, cv > 1 bursty); gaps are drawn at unit rate and divided by the rate, and
lengths come from a separate seeded stream, so a sweep over rates replays the same requests
compressed in time (common random numbers: attainment curves are smooth in the rate).

Length models:
- `SHAREGPT_8K`: the paper's chat workload, sampled by linear interpolation of the 5%
  quantile table in /work/shared/data/traces/README.md; prompt and output independent
  (their correlation in the raw data is 0.04).
- `ARXIV_PAPER`: the paper's summarisation workload used whole arXiv articles, which the
  shared <=4k file cannot give. Assumed model: prompt ~ lognormal(median 7000, sigma 0.3)
  clipped to [2048, 16384] tokens (5-95%: 4.3k-11.4k; the arXiv corpus of Cohan et al. 2018
  averages ~4.9k words per article, ~6.5-7k Llama-2 tokens, and papers.md says 6-8k or
  more); output ~ lognormal(median 200, sigma 0.35) clipped to [32, 512] (abstract length,
  papers.md: about 200). Mean prompt/output ~ 35, near the paper's "about 40x".
- `arxiv-4k`: the bundled filtered arXiv CSV, resampled row by row (keeps the pairing).
- `azure-conv`: the bundled Azure 2023 conversation trace; `trace_requests` replays its
  real arrival times, optionally time-scaled to another mean rate.

A request may carry an `lp_jax.core.slo.SLO` and a class name; task_classes.py builds
the multi-SLO workloads (FlowPrefill's QwenTrace-like classes).

`load_trace` (trace_file.py; the format is docs/trace_format.md) reads any CSV or JSONL
trace, with optional class and TTFT / TBT SLO columns; `trace_requests` replays it, each
request carrying its row's SLO (resolved against the configured classes, if any).

`lp_jax.bench.workload` (the lp-bench load generator) is a thin layer over this module: the
same length models, arrival process and trace loader, plus prompts and length fitting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from lp_jax.core.slo import SLO
from lp_jax.sim.trace_file import TraceRow, load_trace

DATA_DIR = Path(__file__).resolve().parent / "data"
ARXIV_4K_CSV = DATA_DIR / "arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv"
AZURE_CONV_CSV = DATA_DIR / "splitwise_conv.csv"

@dataclass(frozen=True, slots=True)
class Request:
    arrival: float  # seconds
    prompt_len: int
    output_len: int
    slo: SLO | None = None  # latency objectives; None: best-effort
    slo_class: str | None = None  # task class; None: the SLO's name, if any

    def __post_init__(self) -> None:
        if not (math.isfinite(self.arrival) and self.arrival >= 0):
            raise ValueError(f"arrival must be finite and >= 0, got {self.arrival}")
        if self.prompt_len < 1 or self.output_len < 1:
            raise ValueError(f"lengths must be >= 1, got {self.prompt_len}, {self.output_len}")
        if self.slo is not None and not isinstance(self.slo, SLO):
            raise TypeError(f"slo must be an lp_jax.core.slo.SLO, got {self.slo!r}")

    @property
    def task(self) -> str | None:
        """The request's class: `slo_class`, else its SLO's name, else None."""
        if self.slo_class is not None:
            return self.slo_class
        return self.slo.name if self.slo is not None else None


class LengthModel(Protocol):
    @property
    def name(self) -> str: ...

    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]: ...


# ----- length models ---------------------------------------------------------------------
# The concrete models also have `max_lengths`: the largest (prompt, output) `sample` can
# return (lp-bench scales lengths by it to fit a small model's context).
_Q5 = tuple(range(0, 101, 5))


@dataclass(frozen=True, slots=True)
class QuantileLengths:
    """Independent prompt / output lengths from quantile tables (linear interpolation)."""

    name: str
    quantiles: tuple[float, ...]  # percent, increasing, 0 .. 100
    prompt: tuple[float, ...]
    output: tuple[float, ...]

    def __post_init__(self) -> None:
        q = self.quantiles
        if q[0] != 0 or q[-1] != 100 or any(b <= a for a, b in zip(q, q[1:], strict=False)):
            raise ValueError("quantiles must increase from 0 to 100")
        for table in (self.prompt, self.output):
            if len(table) != len(q) or any(b < a for a, b in zip(table, table[1:], strict=False)):
                raise ValueError("each table needs one non-decreasing value per quantile")

    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        u_N = rng.random((2, n)) * 100.0
        p_N = np.interp(u_N[0], self.quantiles, self.prompt)
        o_N = np.interp(u_N[1], self.quantiles, self.output)
        return as_lengths(p_N), as_lengths(o_N)

    @property
    def max_lengths(self) -> tuple[int, int]:
        return max(1, round(self.prompt[-1])), max(1, round(self.output[-1]))


@dataclass(frozen=True, slots=True)
class LognormalLengths:
    """Independent clipped lognormal prompt and output lengths."""

    name: str
    prompt_median: float
    prompt_sigma: float
    prompt_min: int
    prompt_max: int
    output_median: float
    output_sigma: float
    output_min: int
    output_max: int

    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        z_N = rng.standard_normal((2, n))
        p_N = np.clip(
            self.prompt_median * np.exp(self.prompt_sigma * z_N[0]),
            self.prompt_min,
            self.prompt_max,
        )
        o_N = np.clip(
            self.output_median * np.exp(self.output_sigma * z_N[1]),
            self.output_min,
            self.output_max,
        )
        return as_lengths(p_N), as_lengths(o_N)

    @property
    def max_lengths(self) -> tuple[int, int]:
        return self.prompt_max, self.output_max


@dataclass(frozen=True, slots=True)
class EmpiricalLengths:
    """(prompt, output) pairs resampled with replacement, keeping their pairing."""

    name: str
    prompt: tuple[int, ...]
    output: tuple[int, ...]

    @classmethod
    def from_trace(cls, path: str | Path, name: str | None = None) -> EmpiricalLengths:
        rows = load_trace(path)
        return cls(
            name or Path(path).stem,
            tuple(r.prompt_len for r in rows),
            tuple(r.output_len for r in rows),
        )

    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        idx_N = rng.integers(0, len(self.prompt), n)
        return np.asarray(self.prompt)[idx_N], np.asarray(self.output)[idx_N]

    @property
    def max_lengths(self) -> tuple[int, int]:
        return max(self.prompt), max(self.output)


def as_lengths(x_N: np.ndarray) -> np.ndarray:
    return np.maximum(1, np.rint(x_N)).astype(np.int64)


SHAREGPT_8K = QuantileLengths(
    "sharegpt-8k",
    _Q5,
    (1, 29, 74, 180, 382, 580, 777, 973, 1203, 1457, 1730, 2060, 2401, 2799, 3235, 3734, 4278,
     4918, 5696, 6563, 8141),
    (2, 44, 84, 130, 181, 228, 271, 312, 346, 381, 415, 453, 493, 534, 581, 628, 683, 754, 834,
     920, 1024),
)  # fmt: skip

ARXIV_PAPER = LognormalLengths("arxiv-paper", 7000.0, 0.3, 2048, 16384, 200.0, 0.35, 32, 512)


def length_model(name: str) -> LengthModel:
    """ "sharegpt" / "sharegpt-8k", "arxiv" / "arxiv-paper", "arxiv-4k" or "azure-conv"."""
    key = name.lower()
    if key in ("sharegpt", "sharegpt-8k"):
        return SHAREGPT_8K
    if key in ("arxiv", "arxiv-paper"):
        return ARXIV_PAPER
    if key == "arxiv-4k":
        return EmpiricalLengths.from_trace(ARXIV_4K_CSV, "arxiv-4k")
    if key == "azure-conv":
        return EmpiricalLengths.from_trace(AZURE_CONV_CSV, "azure-conv")
    raise KeyError(f"unknown length model {name!r}")


# ----- arrivals --------------------------------------------------------------------------
def arrival_times(n: int, rate: float, rng: np.random.Generator, cv: float = 1.0) -> np.ndarray:
    """n arrival times of a gamma renewal process: mean gap 1/rate, gap CV `cv`, first at 0."""
    if n < 0 or not (rate > 0 and math.isfinite(rate)) or not (cv > 0 and math.isfinite(cv)):
        raise ValueError(f"need n >= 0, rate > 0, cv > 0; got {n}, {rate}, {cv}")
    shape = 1.0 / (cv * cv)
    gaps_N = rng.gamma(shape, 1.0 / shape, n)  # unit mean
    gaps_N[:1] = 0.0
    return np.cumsum(gaps_N) / rate


def synthesize(
    lengths: LengthModel | str, n: int, rate: float, *, cv: float = 1.0, seed: int = 0
) -> list[Request]:
    """n requests with gamma(cv) arrivals at `rate` req/s; deterministic given the seed."""
    model = length_model(lengths) if isinstance(lengths, str) else lengths
    t_N = arrival_times(n, rate, np.random.default_rng([seed, 0]), cv)
    p_N, o_N = model.sample(n, np.random.default_rng([seed, 1]))
    return [Request(float(t), int(p), int(o)) for t, p, o in zip(t_N, p_N, o_N, strict=True)]


# ----- trace files -----------------------------------------------------------------------
def trace_requests(
    path: str | Path | list[TraceRow],
    *,
    n: int | None = None,
    start: int = 0,
    rate: float | None = None,
    cv: float = 1.0,
    seed: int = 0,
    classes: dict[str, SLO] | None = None,
    slo_scale: float = 1.0,
) -> list[Request]:
    """Requests from rows [start, start + n) of a trace (a path or `load_trace`'s rows).

    With timestamps: arrivals relative to the earliest row, in time order (ties keep file
    order), time-scaled so the mean rate is `rate` when given. Without: gamma(cv) arrivals
    at `rate` (required then), in file order. Each request carries its row's class and
    SLO (`TraceRow.slo(classes)`: the class's objectives from `classes`, overridden by the
    row's own columns), both objectives times `slo_scale`.
    """
    if not (math.isfinite(slo_scale) and slo_scale > 0):
        raise ValueError(f"slo_scale must be > 0, got {slo_scale}")
    rows = load_trace(path) if isinstance(path, str | Path) else list(path)
    rows = rows[start:]
    rows = rows[:n] if n is not None else rows
    if not rows:
        raise ValueError(f"no rows in {path} from {start}")
    if all(r.timestamp is not None for r in rows):
        rows = sorted(rows, key=lambda r: r.timestamp)
        t_N = np.array([r.timestamp for r in rows], dtype=np.float64)
        t_N -= t_N[0]
        if rate is not None and len(rows) > 1 and t_N[-1] > 0:
            t_N *= (len(rows) - 1) / t_N[-1] / rate
    elif rate is None:
        raise ValueError(f"{path} has no timestamps; pass a rate")
    else:
        t_N = arrival_times(len(rows), rate, np.random.default_rng([seed, 0]), cv)
    out = []
    for t, r in zip(t_N, rows, strict=True):
        slo = r.slo(classes)
        if slo is not None and slo_scale != 1.0:
            slo = slo.scaled(slo_scale)
        out.append(Request(float(t), r.prompt_len, r.output_len, slo, r.slo_class))
    return out
