"""Progress a person can watch: the start-up compile and the serving stats line.

`Progress` counts finished programs. With a terminal on stderr (and tqdm installed) it is
a tqdm bar; otherwise, or under a log function that is not `print`, it writes a line
per finished program, at most one every `every_s` seconds (and the last one always):
"compiled 7/19 programs, 12.3 s, about 21 s left". The estimate is the mean time per
program so far times the programs left, which holds because the programs of one engine
compile in comparable times (they differ in row count only).

`StatsLine` turns two snapshots of `LLMEngine.stats()` into vLLM's periodic line:
prompt and generation throughput over the interval, running and waiting requests, KV
pages in use, the prefix cache's hit rate and the preemptions so far.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable


class Progress:
    def __init__(self, total: int, what: str, log: Callable[[str], None] | None, *,
                 every_s: float = 2.0, bar: bool | None = None):
        self.total, self.what, self.log, self.every_s = total, what, log, every_s
        self.done = 0
        self.t0 = self._last = time.perf_counter()
        if bar is None:
            bar = log is print and sys.stderr.isatty()
        self._bar = None
        if bar and log is not None:
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self._bar = tqdm(total=total, desc=f"compiling {what}", unit="program",
                                 dynamic_ncols=True, leave=False)

    def line(self) -> str:
        elapsed = time.perf_counter() - self.t0
        text = f"compiled {self.done}/{self.total} {self.what}, {elapsed:.1f} s"
        left = self.total - self.done
        if 0 < self.done and left:
            text += f", about {elapsed / self.done * left:.0f} s left"
        return text

    def advance(self, n: int = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
            return
        now = time.perf_counter()
        if self.log is not None and (self.done == self.total or now - self._last >= self.every_s):
            self._last = now
            self.log(self.line())

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class StatsLine:
    """vLLM-style periodic stats from successive `LLMEngine.stats()` snapshots."""

    def __init__(self, stats: dict, now: float | None = None):
        self._prev = stats
        self._t = time.monotonic() if now is None else now

    def __call__(self, stats: dict, *, running: int, waiting: int,
                 now: float | None = None) -> str:
        now = time.monotonic() if now is None else now
        dt = max(now - self._t, 1e-9)
        prev, self._prev, self._t = self._prev, stats, now
        prompt = (stats["prefill_tokens"] - prev["prefill_tokens"]) / dt
        gen = (stats["decode_tokens"] - prev["decode_tokens"]) / dt
        total = stats.get("total_pages") or 0
        used = 100.0 * (total - stats.get("free_pages", total)) / total if total else 0.0
        queries = stats["prefix_cache_queries"] - prev["prefix_cache_queries"]
        hits = stats["prefix_cache_hits"] - prev["prefix_cache_hits"]
        hit_rate = 100.0 * hits / queries if queries else 0.0
        return (f"prompt throughput: {prompt:.1f} tokens/s, generation throughput: "
                f"{gen:.1f} tokens/s, running: {running} reqs, waiting: {waiting} reqs, "
                f"KV cache usage: {used:.1f}%, prefix cache hit rate: {hit_rate:.1f}%, "
                f"preemptions: {stats['preemptions']}")
