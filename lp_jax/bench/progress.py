"""A one-line progress bar on stderr (no tqdm)."""

from __future__ import annotations

import sys
import time


class ProgressBar:
    def __init__(self, total: int, *, desc: str = "", width: int = 30, stream=None,
                 min_interval: float = 0.1, enabled: bool = True):
        self.total = max(total, 0)
        self.desc = desc
        self.width = width
        self.stream = stream if stream is not None else sys.stderr
        self.min_interval = min_interval
        self.enabled = enabled
        self.done = 0
        self.failed = 0
        self.start = time.perf_counter()
        self._last = 0.0

    def update(self, ok: bool = True) -> None:
        self.done += 1
        self.failed += not ok
        now = time.perf_counter()
        if self.done >= self.total or now - self._last >= self.min_interval:
            self._last = now
            self.render(now)

    def line(self, now: float | None = None) -> str:
        now = time.perf_counter() if now is None else now
        elapsed = now - self.start
        frac = self.done / self.total if self.total else 1.0
        fill = int(round(frac * self.width))
        rate = self.done / elapsed if elapsed > 0 else 0.0
        bar = "#" * fill + "." * (self.width - fill)
        fail = f", {self.failed} failed" if self.failed else ""
        return (f"{self.desc}[{bar}] {self.done}/{self.total}{fail} "
                f"{rate:.1f} req/s {elapsed:.1f} s")

    def render(self, now: float | None = None) -> None:
        if self.enabled:
            self.stream.write("\r" + self.line(now))
            self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.render()
            self.stream.write("\n")
            self.stream.flush()
