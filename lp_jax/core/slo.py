"""Per-request latency objectives (SLOs): values, named classes, and attainment counters.

A request may carry a TTFT objective (time to its first token) and a TBT objective (the
largest gap between two of its tokens). Both are optional; a request with neither is
best-effort. Named classes ("chat", "summarisation", ...) are configured at start-up, for
example from a JSON file:

    {"chat": {"ttft_ms": 250, "tbt_ms": 100}, "summarisation": {"ttft_ms": 4000}}

A request names a class, gives explicit values, or both (explicit values override the
class's). The scheduler reads `SLO.ttft_s` for FlowPrefill's deadlines
(flowprefill.py); `SLOTracker` counts, per class and kind, how many finished requests met
their objective, for `stats()` and Prometheus (`lp:slo_attained_total`).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

CUSTOM = "custom"  # the class of a request that gives values but names no class
_MAX_MS = 86_400_000.0  # one day: anything longer is a unit mistake


def _check_ms(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number of milliseconds, got {value!r}")
    if not (math.isfinite(value) and 0 < value <= _MAX_MS):
        raise ValueError(f"{name} must be in (0, {_MAX_MS:.0f}] ms, got {value}")
    return float(value)


@dataclass(frozen=True, slots=True)
class SLO:
    """Objectives in seconds (None: none of that kind) and the class they came from."""

    ttft_s: float | None = None
    tbt_s: float | None = None
    name: str = CUSTOM

    def __post_init__(self) -> None:
        for kind in ("ttft_s", "tbt_s"):
            v = getattr(self, kind)
            if v is not None:
                _check_ms(kind.replace("_s", "_slo"), v * 1e3)
        if not isinstance(self.name, str) or not self.name or len(self.name) > 64:
            raise ValueError(f"an SLO class name must be a non-empty string of at most 64 "
                             f"characters, got {self.name!r}")

    @classmethod
    def from_ms(cls, ttft_ms=None, tbt_ms=None, name: str = CUSTOM,
                fields=("ttft_slo_ms", "tbt_slo_ms")) -> SLO:
        """`fields`: how errors name the two values (request fields by default)."""
        return cls(None if ttft_ms is None else _check_ms(fields[0], ttft_ms) / 1e3,
                   None if tbt_ms is None else _check_ms(fields[1], tbt_ms) / 1e3, name)

    def scaled(self, factor: float) -> SLO:
        """Both objectives times `factor` (the SLO-scale sweeps)."""
        return SLO(None if self.ttft_s is None else self.ttft_s * factor,
                   None if self.tbt_s is None else self.tbt_s * factor, self.name)


def parse_slo_classes(spec) -> dict[str, SLO]:
    """Classes from a dict {name: {"ttft_ms": x, "tbt_ms": y}}, a JSON string, or the path
    of a JSON file. Raises ValueError naming the bad entry."""
    if isinstance(spec, str | Path) and not str(spec).lstrip().startswith("{"):
        path = Path(spec)
        if not path.is_file():
            raise ValueError(f"SLO classes file {str(path)!r} does not exist")
        spec = path.read_text()
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"SLO classes are not valid JSON: {e}") from None
    if not isinstance(spec, dict):
        raise ValueError(f"SLO classes must be an object of name -> objectives, got {spec!r}")
    classes = {}
    for name, entry in spec.items():
        if not isinstance(entry, dict) or set(entry) - {"ttft_ms", "tbt_ms"} or not entry:
            raise ValueError(f"SLO class {name!r} must be an object with ttft_ms and/or "
                             f"tbt_ms, got {entry!r}")
        if name == CUSTOM:
            raise ValueError(f"{CUSTOM!r} is reserved for requests that name no class")
        classes[name] = SLO.from_ms(entry.get("ttft_ms"), entry.get("tbt_ms"), name,
                                    fields=(f"{name}.ttft_ms", f"{name}.tbt_ms"))
    return classes


def resolve_slo(classes: dict[str, SLO], slo_class: str | None = None,
                ttft_ms=None, tbt_ms=None) -> SLO | None:
    """The SLO of a request: its class's objectives, overridden by explicit values.
    None when the request asks for none. Raises ValueError for an unknown class."""
    base = SLO()
    if slo_class is not None:
        if slo_class not in classes:
            known = ", ".join(sorted(classes)) or "none are configured"
            raise ValueError(f"unknown slo_class {slo_class!r} (known: {known})")
        base = classes[slo_class]
    if slo_class is None and ttft_ms is None and tbt_ms is None:
        return None
    explicit = SLO.from_ms(ttft_ms, tbt_ms)
    return SLO(explicit.ttft_s if ttft_ms is not None else base.ttft_s,
               explicit.tbt_s if tbt_ms is not None else base.tbt_s, base.name)


REQUEST_FIELDS = ("slo_class", "ttft_slo_ms", "tbt_slo_ms")


def request_slo(classes: dict[str, SLO], slo) -> SLO | None:
    """The SLO of a request from what the engines' add_request takes: None, an `SLO`, the
    name of a configured class, or a dict of the request fields (REQUEST_FIELDS). Raises
    ValueError for a bad or unknown one."""
    if slo is None or isinstance(slo, SLO):
        return slo
    if isinstance(slo, str):
        return resolve_slo(classes, slo)
    if isinstance(slo, dict):
        extra = set(slo) - set(REQUEST_FIELDS)
        if extra:
            raise ValueError(f"unknown SLO fields {sorted(extra)}; known: {list(REQUEST_FIELDS)}")
        return resolve_slo(classes, slo.get("slo_class"), slo.get("ttft_slo_ms"),
                           slo.get("tbt_slo_ms"))
    raise ValueError(f"slo must be an SLO, a class name or a dict of {list(REQUEST_FIELDS)}, "
                     f"got {slo!r}")


class SLOTracker:
    """Attained / total finished requests per (class, kind). Requests aborted before their
    first token, and kinds a request set no objective for, are not counted."""

    def __init__(self) -> None:
        self.attained: Counter[tuple[str, str]] = Counter()
        self.total: Counter[tuple[str, str]] = Counter()

    def record(self, slo: SLO | None, ttft: float | None, max_itl: float) -> None:
        if slo is None:
            return
        for kind, target, value in (("ttft", slo.ttft_s, ttft), ("tbt", slo.tbt_s, max_itl)):
            if target is None:
                continue
            self.total[slo.name, kind] += 1
            self.attained[slo.name, kind] += value is not None and value <= target

    def as_dict(self) -> dict[str, dict[str, dict[str, float]]]:
        """{class: {kind: {"attained", "total", "attainment"}}}."""
        out: dict[str, dict[str, dict[str, float]]] = {}
        for (name, kind), n in sorted(self.total.items()):
            a = self.attained[name, kind]
            out.setdefault(name, {})[kind] = {"attained": a, "total": n, "attainment": a / n}
        return out
