"""A run of measurement sections under one deadline, whose results survive a kill.

Made for short device sessions (launch/gpu_validate.py): every section has a share of
the budget, and a section's deadline is the sum of the shares so far, so time one leaves
passes on. Before anything slow (a compile above all, which cannot be interrupted) a
section asks `fits(sec, seconds, what)`; what does not fit is listed in the section's
`not_reached`, and a section with under `MIN_START_S` left is `skipped` with the reason.
OUT/results.json and OUT/results.md (the same data as a markdown section: each list of
rows becomes a table) are rewritten atomically after every change, so a kill keeps what
was done. A watchdog thread ends a run hung past the budget plus a grace period, after
recording the step it hung in.
"""

from __future__ import annotations

import json
import os
import threading
import time
import traceback
from pathlib import Path

MIN_START_S = 2.0


class BudgetRun:
    """The deadline, the results, and the sections run under them (see the module doc)."""

    def __init__(self, out: str | Path, budget_s: float, *, title: str,
                 section_label: str | None = None, grace_s: float = 60.0,
                 clock=time.perf_counter):
        self.out, self.budget_s, self.title, self.clock = Path(out), budget_s, title, clock
        self.section_label, self.grace_s = section_label, grace_s
        self.out.mkdir(parents=True, exist_ok=True)
        self.t0 = clock()
        self.deadline = self.section_deadline = self.t0 + budget_s
        self.data = {"meta": {"budget_s": budget_s}, "sections": {}}
        self.step, self.finished = "start", False

    def left(self) -> float:
        """Seconds left in the current section."""
        return self.section_deadline - self.clock()

    def fits(self, sec: dict, seconds: float, what: str) -> bool:
        """True (and `what` becomes the current step) if `seconds` are left in the section;
        else `what` is recorded as not reached."""
        if self.left() >= seconds:
            self.step = what
            print(f"  {self.clock() - self.t0:6.1f} s  {what}", flush=True)
            return True
        sec.setdefault("not_reached", []).append(
            f"{what}: out of time ({max(self.left(), 0):.0f} s left, needs ~{seconds:.0f} s)")
        self.save()
        return False

    def save(self):
        for name, text in (("results.json", json.dumps(self.data, indent=1, default=str)),
                           ("results.md", render_md(self.title, self.data))):
            tmp = self.out / f".{name}.tmp"
            tmp.write_text(text)
            tmp.replace(self.out / name)

    def run(self, sections, skip=()) -> dict:
        """sections: (name, share of the budget, fn(run, sec)) in order; returns the data."""
        threading.Thread(target=self._watchdog, daemon=True).start()
        total, done = sum(share for _, share, _ in sections), 0.0
        for name, share, fn in sections:
            done += share
            sec = self.data["sections"][name] = {"status": "pending"}
            if self.section_label:
                sec["label"] = self.section_label
            self.section_deadline = min(self.t0 + self.budget_s * done / total, self.deadline)
            if name in skip:
                sec.update(status="skipped", reason="skipped: asked to")
            elif self.left() < MIN_START_S:
                sec.update(status="skipped", reason=f"skipped: out of time ({self.left():.0f} "
                           "s left in its share of the budget)")
            else:
                self._section(name, sec, fn)
            self.data["meta"]["elapsed_s"] = self.clock() - self.t0
            self.save()
        self.finished, self.data["meta"]["step"] = True, "done"
        self.save()
        return self.data

    def _section(self, name: str, sec: dict, fn):
        print(f"[{name}] {self.left():.0f} s", flush=True)
        t, sec["status"] = self.clock(), "running"
        self.save()
        try:
            fn(self, sec)
            sec["status"] = "partial" if sec.get("not_reached") else "ok"
        except Exception as e:  # noqa: BLE001 - record it and go on with the next section
            sec.update(status="error", error=f"{type(e).__name__}: {str(e)[:500]}",
                       traceback=traceback.format_exc()[-3000:])
        sec["seconds"] = self.clock() - t

    def _watchdog(self):
        while self.clock() < self.deadline + self.grace_s:
            time.sleep(1.0)
            if self.finished:
                return
        for sec in self.data["sections"].values():
            if sec["status"] == "running":
                sec.update(status="hung", reason=f"hung in: {self.step}")
        self.data["meta"]["watchdog"] = f"ended the run {self.grace_s:.0f} s past the budget"
        for _ in range(5):
            try:
                self.save()
                break
            except RuntimeError:  # the main thread changed a dict while it was written out
                time.sleep(0.2)
        os._exit(3)


def attempt(measure) -> dict:
    """measure()'s figures, or the error it raised: one failing figure hides no other."""
    try:
        return measure()
    except Exception as e:  # noqa: BLE001 - a compile error, a kernel fault, out of memory
        return {"error": f"{type(e).__name__}: {str(e)[:400]}"}


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _items(d: dict, indent: str = "") -> list[str]:
    """Markdown of a dict: each list of rows becomes a table, anything else a bullet."""
    lines = []
    for key, value in d.items():
        if key in ("status", "traceback"):
            continue
        if isinstance(value, list) and value and isinstance(value[0], dict):
            cols = list(dict.fromkeys(c for row in value for c in row))
            lines += ["", f"{key}:", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
            lines += ["| " + " | ".join(_fmt(r.get(c, "")) for c in cols) + " |" for r in value]
            lines.append("")
        elif isinstance(value, dict) and any(isinstance(v, list) for v in value.values()):
            lines += [f"{indent}- {key}:", *_items(value, indent + "  ")]
        else:
            lines.append(f"{indent}- {key}: {_fmt(value)}")
    return lines


def render_md(title: str, data: dict) -> str:
    lines = [f"## {title}", "", *_items(data["meta"]), ""]
    for name, sec in data["sections"].items():
        lines += [f"### {name}: {sec['status']}", "", *_items(sec), ""]
    return "\n".join(lines)


def summary(data: dict) -> str:
    rows = [f"{name:<10} {sec['status']:<8} {_fmt(sec.get('seconds', '-')):>8} s  "
            f"{sec.get('reason') or sec.get('error') or ''}"
            for name, sec in data["sections"].items()]
    return "\n".join(["section    status    seconds", *rows])
