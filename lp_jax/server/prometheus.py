"""A small Prometheus text-format (0.0.4) writer: counters, gauges and histograms.

Written here instead of depending on prometheus_client: the server needs a dozen metric
families, labels and one lock, nothing more. Every metric is safe to update from any
thread (one lock per family). `Registry.render()` returns the exposition text.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Callable, Iterable, Sequence

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def format_value(v: float) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int):
        return str(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if v == int(v) and abs(v) < 1e15:
        return str(int(v))
    return repr(float(v))


def _labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape_label(str(v))}"' for n, v in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


class _Family:
    kind = ""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (),
                 const_labels: dict[str, str] | None = None):
        self.name = name
        self.documentation = documentation
        const = dict(const_labels or {})
        self._const_names = tuple(const)
        self._const_values = tuple(const.values())
        self.labelnames = tuple(labelnames)
        self._lock = threading.Lock()
        self._children: dict[tuple[str, ...], object] = {}

    def _key(self, labels: dict[str, str]) -> tuple[str, ...]:
        if set(labels) != set(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {sorted(labels)}")
        return tuple(str(labels[n]) for n in self.labelnames)

    def _names_values(self, key: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return self._const_names + self.labelnames, self._const_values + key

    def header(self, name: str) -> list[str]:
        return [f"# HELP {name} {_escape_help(self.documentation)}",
                f"# TYPE {name} {self.kind}"]


class Counter(_Family):
    """Monotonic count. `set_total` mirrors a counter kept elsewhere (the engine's)."""

    kind = "counter"

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise ValueError(f"counter {self.name} cannot decrease (inc by {amount})")
        key = self._key(labels)
        with self._lock:
            self._children[key] = self._children.get(key, 0) + amount

    def set_total(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            self._children[key] = value

    def value(self, **labels: str) -> float:
        with self._lock:
            return self._children.get(self._key(labels), 0)

    def render(self, name: str | None = None) -> list[str]:
        """Exposition lines, under `name` (an alias) if given."""
        name = name or self.name
        with self._lock:
            items = sorted(self._children.items())
        if not items and not self.labelnames:
            items = [((), 0)]
        out = self.header(name)
        for key, v in items:
            names, values = self._names_values(key)
            out.append(f"{name}{_labels(names, values)} {format_value(v)}")
        return out


class Gauge(Counter):
    """A value that goes up and down."""

    kind = "gauge"

    def set(self, value: float, **labels: str) -> None:
        self.set_total(value, **labels)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            self._children[key] = self._children.get(key, 0) + amount


class Histogram(_Family):
    """Cumulative buckets `_bucket{le=...}`, plus `_sum` and `_count`."""

    kind = "histogram"

    def __init__(self, name: str, documentation: str, buckets: Iterable[float],
                 labelnames: Sequence[str] = (), const_labels: dict[str, str] | None = None):
        super().__init__(name, documentation, labelnames, const_labels)
        bs = sorted(float(b) for b in buckets)
        if not bs or any(math.isnan(b) for b in bs) or len(set(bs)) != len(bs):
            raise ValueError(f"histogram {name}: buckets must be distinct numbers, got {bs}")
        if bs[-1] != math.inf:
            bs.append(math.inf)
        self.buckets = tuple(bs)

    def observe(self, value: float, **labels: str) -> None:
        self.observe_many((value,), **labels)

    def observe_many(self, values: Iterable[float], **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            child = self._children.get(key)
            if child is None:
                child = self._children[key] = [[0] * len(self.buckets), 0.0, 0]
            counts = child[0]
            for v in values:
                v = float(v)
                if math.isnan(v):
                    continue
                counts[bisect.bisect_left(self.buckets, v)] += 1  # le: v <= bound
                child[1] += v
                child[2] += 1

    def snapshot(self, **labels: str) -> tuple[list[int], float, int]:
        """(cumulative bucket counts, sum, count)."""
        with self._lock:
            child = self._children.get(self._key(labels))
            if child is None:
                return [0] * len(self.buckets), 0.0, 0
            counts, total, n = list(child[0]), child[1], child[2]
        cum, acc = [], 0
        for c in counts:
            acc += c
            cum.append(acc)
        return cum, total, n

    def render(self, name: str | None = None) -> list[str]:
        """Exposition lines, under `name` (an alias) if given."""
        name = name or self.name
        with self._lock:
            keys = sorted(self._children)
        if not keys and not self.labelnames:
            keys = [()]
        out = self.header(name)
        for key in keys:
            cum, total, n = self.snapshot(**dict(zip(self.labelnames, key, strict=True)))
            names, values = self._names_values(key)
            for bound, c in zip(self.buckets, cum, strict=True):
                le = f'le="{format_value(bound)}"'
                out.append(f"{name}_bucket{_labels(names, values, le)} {c}")
            out.append(f"{name}_sum{_labels(names, values)} {format_value(total)}")
            out.append(f"{name}_count{_labels(names, values)} {n}")
        return out


class Registry:
    """The metric families; `aliases` (name -> more names) renders a family again under
    each of its aliases, with the same samples (another system's names for them)."""

    def __init__(self, const_labels: dict[str, str] | None = None,
                 aliases: dict[str, tuple[str, ...]] | None = None):
        self.const_labels = dict(const_labels or {})
        self.aliases = dict(aliases or {})
        self._families: dict[str, _Family] = {}
        self._collectors: list[Callable[[], None]] = []

    def _add(self, family):
        if family.name in self._families:
            raise ValueError(f"metric {family.name} registered twice")
        self._families[family.name] = family
        return family

    def counter(self, name, documentation, labelnames=()) -> Counter:
        return self._add(Counter(name, documentation, labelnames, self.const_labels))

    def gauge(self, name, documentation, labelnames=()) -> Gauge:
        return self._add(Gauge(name, documentation, labelnames, self.const_labels))

    def histogram(self, name, documentation, buckets, labelnames=()) -> Histogram:
        return self._add(Histogram(name, documentation, buckets, labelnames, self.const_labels))

    def get(self, name: str) -> _Family:
        return self._families[name]

    def render(self) -> str:
        lines: list[str] = []
        for fam in self._families.values():
            lines.extend(fam.render())
            for alias in self.aliases.get(fam.name, ()):
                lines.extend(fam.render(alias))
        return "\n".join(lines) + "\n"


def parse_text(text: str) -> dict[str, float]:
    """Sample line -> value, keyed by the name with its label block as written.

    Enough of a parser for tests and lp-bench to read this module's output back.
    """
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        out[name] = float(value.replace("+Inf", "inf").replace("-Inf", "-inf"))
    return out
