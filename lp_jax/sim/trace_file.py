"""Request trace files (CSV or JSONL): one request per row, with optional class and SLOs.

Design note. The simulator (`lp_jax.sim.workload.trace_requests`) and lp-bench
(`lp_jax.bench.workload.build_workload`) read traces only through `load_trace`, so a file
replays the same requests in both. The format is docs/trace_format.md: a row has an
input and an output length, optionally an arrival time in seconds, a class name and TTFT /
TBT objectives in milliseconds (or seconds, with an `_s` column). Each column has a few
accepted names (the first present wins) so the public traces load as they are.

Rows are parsed one line at a time through grain (`grain.MapDataset.source` over the
file's non-blank lines, `.map` to parse); every error names the file and the 1-based line
(the CSV header is line 1), and what was wrong with it. A row's SLO is resolved later, by
`TraceRow.slo`, against the named classes the caller configured (possibly none), with the
engine's own rule (`lp_jax.core.slo.resolve_slo`: explicit values override the class's).
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from lp_jax.core.slo import SLO, resolve_slo

TIME_COLUMNS = ("timestamp", "arrived_at", "arrival_time", "arrival", "time")
PROMPT_COLUMNS = ("prompt_len", "num_prefill_tokens", "input_len", "input_length",
                  "prompt_tokens")
OUTPUT_COLUMNS = ("output_len", "num_decode_tokens", "output_length", "output_tokens",
                  "max_tokens", "completion_tokens")
CLASS_COLUMNS = ("slo_class", "class", "task", "task_type")
# (column, factor to milliseconds)
TTFT_COLUMNS = (("ttft_slo_ms", 1.0), ("ttft_slo_s", 1e3))
TBT_COLUMNS = (("tbt_slo_ms", 1.0), ("tbt_slo_s", 1e3))
JSON_SUFFIXES = (".jsonl", ".ndjson", ".json")


class TraceError(ValueError):
    """A bad trace row; the message starts with "file:line:"."""


@dataclass(frozen=True, slots=True)
class TraceRow:
    timestamp: float | None  # seconds; None when the row has no time
    prompt_len: int
    output_len: int
    slo_class: str | None = None
    ttft_slo_ms: float | None = None
    tbt_slo_ms: float | None = None
    line: int = field(default=0, compare=False)  # 1-based line in its file (0: not a file)

    def __post_init__(self) -> None:
        if self.prompt_len < 1 or self.output_len < 1:
            raise ValueError(
                f"trace lengths must be >= 1, got {self.prompt_len}, {self.output_len}"
            )
        if self.timestamp is not None and not math.isfinite(self.timestamp):
            raise ValueError(f"trace time must be finite, got {self.timestamp}")
        if self.slo_class is not None and not (0 < len(self.slo_class) <= 64):
            raise ValueError(f"a class name must have 1-64 characters, got {self.slo_class!r}")
        if self.ttft_slo_ms is not None or self.tbt_slo_ms is not None:
            SLO.from_ms(self.ttft_slo_ms, self.tbt_slo_ms)  # raises naming the bad value

    def slo(self, classes: dict[str, SLO] | None = None) -> SLO | None:
        """The row's SLO: its class's objectives from `classes`, overridden by the row's
        own values; None when it asks for none. Without `classes` a class is a label and
        only the row's values count. With them an unknown class raises ValueError naming
        the line."""
        if classes is None:
            if self.ttft_slo_ms is None and self.tbt_slo_ms is None:
                return None
            named = SLO.from_ms(self.ttft_slo_ms, self.tbt_slo_ms)
            return named if self.slo_class is None else SLO(named.ttft_s, named.tbt_s,
                                                            self.slo_class)
        try:
            return resolve_slo(classes, self.slo_class, self.ttft_slo_ms, self.tbt_slo_ms)
        except ValueError as e:
            raise TraceError(f"line {self.line}: {e}") from None


class _LineSource:
    """A grain random-access data source over (line number, text) of a file's rows."""

    def __init__(self, lines: list[tuple[int, str]], origin: str) -> None:
        self._lines, self._origin = lines, origin

    def __len__(self) -> int:
        return len(self._lines)

    def __getitem__(self, index: int) -> tuple[int, str]:
        return self._lines[index]

    def __repr__(self) -> str:
        return f"_LineSource({self._origin!r}, {len(self._lines)} lines)"


def _pick(record: dict, names) -> tuple[str | None, object]:
    for name in names:
        if record.get(name) not in ("", None):
            return name, record[name]
    return None, None


def _number(name: str, value) -> float:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(x):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return x


def _length(record: dict, names, what: str) -> int:
    name, value = _pick(record, names)
    if name is None:
        raise ValueError(f"no {what} column (one of {', '.join(names)})")
    x = _number(name, value)
    if x != int(x) or x < 1:
        raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
    return int(x)


def _slo_ms(record: dict, columns) -> float | None:
    name, value = _pick(record, [c for c, _ in columns])
    if name is None:
        return None
    x = _number(name, value) * dict(columns)[name]
    if x <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return x


def parse_record(record, line: int = 0) -> TraceRow:
    """A row from one parsed record (a dict of column -> value); raises ValueError."""
    if not isinstance(record, dict):
        raise ValueError(f"a row must be an object of column -> value, got {record!r}")
    name, ts = _pick(record, TIME_COLUMNS)
    ts = None if name is None else _number(name, ts)
    cname, cls = _pick(record, CLASS_COLUMNS)
    if cname is not None and not isinstance(cls, str):
        raise ValueError(f"{cname} must be a string, got {cls!r}")
    return TraceRow(ts, _length(record, PROMPT_COLUMNS, "prompt length"),
                    _length(record, OUTPUT_COLUMNS, "output length"),
                    None if cls is None else cls.strip() or None,
                    _slo_ms(record, TTFT_COLUMNS), _slo_ms(record, TBT_COLUMNS), line)


def load_trace(path: str | Path) -> list[TraceRow]:
    """The rows of a CSV (header line first) or JSONL (.jsonl / .ndjson / .json: one
    object per line) trace, in file order; blank lines are skipped. Column names and
    units: docs/trace_format.md. Raises TraceError "path:line: what" on a bad row."""
    import grain

    path = Path(path)
    if not path.is_file():
        raise TraceError(f"{path}: no such trace file")
    numbered = [(i, ln) for i, ln in enumerate(path.read_text().splitlines(), 1) if ln.strip()]
    if not numbered:
        raise TraceError(f"{path}: the trace is empty")
    if path.suffix in JSON_SUFFIXES:
        def parse(line: str) -> dict:
            try:
                return json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"not valid JSON ({e.msg})") from None
    else:
        header = [h.strip() for h in next(csv.reader([numbered[0][1]]))]
        numbered = numbered[1:]

        def parse(line: str, header=header) -> dict:
            values = next(csv.reader([line]))
            if len(values) != len(header):
                raise ValueError(f"{len(values)} fields, the header has {len(header)}")
            return dict(zip(header, (v.strip() for v in values), strict=True))

    def row(item: tuple[int, str]) -> TraceRow:
        line, text = item
        try:
            return parse_record(parse(text), line)
        except ValueError as e:
            raise TraceError(f"{path}:{line}: {e}") from None

    ds = grain.MapDataset.source(_LineSource(numbered, str(path))).map(row)
    return [ds[i] for i in range(len(ds))]
