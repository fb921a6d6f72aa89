"""Multi-SLO workloads (FlowPrefill, papers.md section 2): request classes with their own
prompt lengths and TTFT objectives.

`TaskClass` describes one class (prompt mean, lognormal sigma, weight, SLO multiplier k);
`QWENTRACE` holds QwenTrace-like classes (chat, web_search, summarisation with the paper's
mean prompt lengths; image_understanding's 1500 tokens, every weight, k and output length
ASSUMED). `class_slos` sets each class's TTFT SLO to scale x k x the solo TTFT of its
median prompt (the caller supplies the solo TTFT, e.g. `lp_jax.sim.simulator.solo_ttft`);
`REFERENCE_SLOS` is the released FlowPrefill benchmark's absolute SLO set instead (TTFT /
TBT in seconds per class; `absolute_slos` scales it), and `SLO_SCALES` its SLO-scale
sweep (0.4-2.0 in steps of 0.2). `multi_slo_requests` draws classes by weight,
prefill-only (output 1: the request ends at its first token) or co-located (lognormal
outputs).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from lp_jax.core.slo import SLO
from lp_jax.sim.workload import Request, arrival_times, as_lengths


@dataclass(frozen=True, slots=True)
class TaskClass:
    """One request class of a multi-SLO workload.

    Prompt lengths ~ lognormal with mean `prompt_mean` and log-sd `prompt_sigma`, clipped to
    [prompt_min, prompt_max]; outputs likewise (co-located runs only; prefill-only requests
    end at their first token). The TTFT SLO is `slo_k` x the solo TTFT of the class's median
    prompt (`class_slos`). `assumed` says what is not from the paper.
    """

    name: str
    prompt_mean: float
    weight: float  # share of requests (normalised over the classes)
    slo_k: float
    prompt_sigma: float = 0.4
    prompt_min: int = 16
    prompt_max: int = 32768
    output_mean: float = 256.0
    output_sigma: float = 0.5
    output_max: int = 2048
    assumed: str = ""

    def __post_init__(self) -> None:
        if not self.name or len(self.name) > 64:
            raise ValueError(f"a class name must have 1-64 characters, got {self.name!r}")
        for field_name in ("prompt_mean", "slo_k", "output_mean"):
            v = getattr(self, field_name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"TaskClass.{field_name} must be > 0, got {v}")
        if not (math.isfinite(self.weight) and self.weight >= 0):
            raise ValueError(f"TaskClass.weight must be >= 0, got {self.weight}")
        if self.prompt_sigma < 0 or self.output_sigma < 0:
            raise ValueError("sigmas must be >= 0")
        if not 1 <= self.prompt_min <= self.prompt_max or self.output_max < 1:
            raise ValueError("need 1 <= prompt_min <= prompt_max and output_max >= 1")

    @property
    def prompt_median(self) -> int:
        """exp(mu) of the lognormal whose mean is prompt_mean, clipped to the range."""
        m = self.prompt_mean * math.exp(-0.5 * self.prompt_sigma**2)
        return int(min(max(round(m), self.prompt_min), self.prompt_max))

    @property
    def output_median(self) -> float:
        return self.output_mean * math.exp(-0.5 * self.output_sigma**2)


# QwenTrace-like classes (papers.md section 2: FlowPrefill). Prompt means are the paper's;
# image_understanding's length, all weights, output lengths and the SLO multipliers are
# ASSUMED: the paper gives per-class TTFT SLOs but not these numbers. k: tight for chat (the
# latency-critical class that long prompts block), looser for the long-prompt classes.
QWENTRACE: tuple[TaskClass, ...] = (
    TaskClass("chat", 590.0, 0.4, 3.0, output_mean=250.0,
              assumed="weight, k, output length"),
    TaskClass("web_search", 5976.0, 0.2, 5.0, output_mean=300.0,
              assumed="weight, k, output length"),
    TaskClass("summarisation", 6833.0, 0.2, 5.0, output_mean=200.0,
              assumed="weight, k, output length"),
    TaskClass("image_understanding", 1500.0, 0.2, 4.0, output_mean=100.0,
              assumed="prompt mean 1500 (not in the paper), weight, k, output length"),
)  # fmt: skip


# The released FlowPrefill benchmark's absolute SLOs (HSIEHCHIACHI/FlowPrefill,
# benchmarks/benchmark_offline.ipynb, SLO_DICT: text, image, search, file), TTFT / TBT in
# seconds, under the names of the QwenTrace-like classes above.
REFERENCE_SLOS: dict[str, tuple[float, float]] = {
    "chat": (0.25, 0.1),  # text
    "image_understanding": (0.5, 0.1),  # image
    "web_search": (4.0, 0.2),  # search
    "summarisation": (6.0, 0.2),  # file
}
# Its SLO-scale sweep: attainment at scale x each request's SLO, 0.4 ... 2.0.
SLO_SCALES: tuple[float, ...] = tuple(round(0.4 + 0.2 * i, 1) for i in range(9))
SLO_SETS = ("k", "reference")  # class_slos (k x solo TTFT) or absolute_slos


def absolute_slos(classes: tuple[TaskClass, ...], scale: float = 1.0,
                  table: dict[str, tuple[float, float]] | None = None) -> dict[str, SLO]:
    """TTFT and TBT SLO per class from an absolute table (default `REFERENCE_SLOS`), both
    times `scale`; a class the table lacks raises ValueError."""
    table = REFERENCE_SLOS if table is None else table
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be > 0, got {scale}")
    missing = [c.name for c in classes if c.name not in table]
    if missing:
        raise ValueError(f"no absolute SLO for classes {missing} (known: {', '.join(table)})")
    return {c.name: SLO(scale * table[c.name][0], scale * table[c.name][1], c.name)
            for c in classes}  # fmt: skip


def parse_assignments(spec: str | None) -> dict[str, float]:
    """ "chat=3,web_search=5" -> {"chat": 3.0, "web_search": 5.0} (None or "" -> {})."""
    out: dict[str, float] = {}
    for item in (spec or "").split(","):
        if not item.strip():
            continue
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"expected name=value, got {item!r}")
        out[name.strip()] = float(value)
    return out


def parse_task_class(spec: str) -> TaskClass:
    """ "name:prompt_mean:weight:k[:prompt_sigma]" -> a TaskClass (a CLI-defined class)."""
    parts = spec.split(":")
    if not 4 <= len(parts) <= 5:
        raise ValueError(f"expected name:prompt_mean:weight:k[:sigma], got {spec!r}")
    extra = {"prompt_sigma": float(parts[4])} if len(parts) == 5 else {}
    return TaskClass(parts[0], float(parts[1]), float(parts[2]), float(parts[3]), **extra)


def configure_classes(
    classes: tuple[TaskClass, ...] = QWENTRACE,
    *,
    only: list[str] | None = None,
    slo_k: dict[str, float] | None = None,
    weights: dict[str, float] | None = None,
    extra: list[TaskClass] | None = None,
) -> tuple[TaskClass, ...]:
    """Classes with overrides: keep `only` (names, in that order), replace k and weights by
    name, then add or replace whole classes from `extra`."""
    by_name = {c.name: c for c in classes}
    for c in extra or ():
        by_name[c.name] = c
    names = list(only) if only else list(by_name)
    for name in [*names, *(slo_k or {}), *(weights or {})]:
        if name not in by_name:
            raise ValueError(f"unknown class {name!r} (known: {', '.join(by_name)})")
    out = []
    for name in names:
        c = by_name[name]
        kw = {}
        if slo_k and name in slo_k:
            kw["slo_k"] = slo_k[name]
        if weights and name in weights:
            kw["weight"] = weights[name]
        out.append(replace(c, **kw) if kw else c)
    if not sum(c.weight for c in out) > 0:
        raise ValueError("class weights must not all be 0")
    return tuple(out)


def class_slos(
    classes: tuple[TaskClass, ...], solo_ttft: Callable[[int], float], scale: float = 1.0
) -> dict[str, SLO]:
    """TTFT SLO per class: scale x k x solo_ttft(median prompt of the class)."""
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be > 0, got {scale}")
    return {c.name: SLO(scale * c.slo_k * solo_ttft(c.prompt_median), None, c.name)
            for c in classes}  # fmt: skip


def multi_slo_requests(
    classes: tuple[TaskClass, ...],
    slos: dict[str, SLO],
    n: int,
    rate: float,
    *,
    cv: float = 1.0,
    seed: int = 0,
    colocated: bool = False,
) -> list[Request]:
    """n requests of mixed classes (drawn by weight) at `rate` req/s, each carrying its
    class's SLO. Prefill-only (default): output_len = 1, the request ends at its first
    token (disaggregated prefill, FlowPrefill's setting); `colocated`: lognormal outputs.
    Classes and lengths do not depend on the rate or the SLOs (common random numbers)."""
    if not classes:
        raise ValueError("need at least one class")
    missing = [c.name for c in classes if c.name not in slos]
    if missing:
        raise ValueError(f"no SLO for classes {missing}")
    t_N = arrival_times(n, rate, np.random.default_rng([seed, 0]), cv)
    w_C = np.array([c.weight for c in classes], dtype=np.float64)
    cls_N = np.random.default_rng([seed, 2]).choice(len(classes), size=n, p=w_C / w_C.sum())
    z_2N = np.random.default_rng([seed, 1]).standard_normal((2, n))
    p_N = np.empty(n)
    o_N = np.ones(n)
    for i, c in enumerate(classes):
        sel_N = cls_N == i
        p_N[sel_N] = np.clip(
            c.prompt_mean * np.exp(c.prompt_sigma * z_2N[0, sel_N] - 0.5 * c.prompt_sigma**2),
            c.prompt_min, c.prompt_max,
        )  # fmt: skip
        if colocated:
            o_N[sel_N] = np.clip(
                c.output_median * np.exp(c.output_sigma * z_2N[1, sel_N]), 1, c.output_max
            )
    p_N, o_N = as_lengths(p_N), as_lengths(o_N)
    return [
        Request(float(t), int(p), int(o), slos[classes[k].name], classes[k].name)
        for t, p, o, k in zip(t_N, p_N, o_N, cls_N, strict=True)
    ]
