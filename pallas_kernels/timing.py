"""Wall-clock timing of jitted calls, shared by every benchmark and microbenchmark."""

from __future__ import annotations

import statistics
import time
from typing import NamedTuple

import jax


class Timing(NamedTuple):
    best: float  # seconds
    median: float


def time_call(fn, *args, iters: int = 3, warmup: int = 1) -> Timing:
    """Times fn(*args) after `warmup` calls (compilation included there), blocking on
    its outputs each time."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(max(iters, 1)):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return Timing(min(times), statistics.median(times))
