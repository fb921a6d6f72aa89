"""Open-loop driving of an in-process engine: requests join at their arrival times.

Benchmarks on the real engine (launch/bench_flowprefill.py, launch/bench_adaptive.py) add
each request when the wall clock reaches its arrival, stamped with the scheduled time (as
a server stamps a request on receipt), and step the engine between arrivals; the latency
of a request thus includes any time it waited for the step loop.
"""

from __future__ import annotations

import dataclasses
import time

from lp_jax.core.policies import resolve_policy
from lp_jax.core.scheduler import Scheduler


def use_policy(engine, base, **changes) -> None:
    """A fresh scheduler with `changes` to the SchedulerConfig `base` (`policy` may be a
    name), on the engine's compiled executor (which is policy-agnostic) and latency
    estimator."""
    if "policy" in changes:
        changes["policy"] = resolve_policy(changes["policy"])
    engine.scheduler = Scheduler(dataclasses.replace(base, **changes), engine.scheduler.latency)


def run_open_loop(engine, timed, params) -> list:
    """timed: [(offset s, prompt ids, slo)] sorted by offset; params: one SamplingParams or
    one per request. Returns each request's RequestMetrics, in order."""
    t0 = time.perf_counter()
    ids, done, i = {}, {}, 0
    while i < len(timed) or engine.has_unfinished():
        now = time.perf_counter() - t0
        while i < len(timed) and timed[i][0] <= now:
            off, prompt, slo = timed[i]
            p = params[i] if isinstance(params, list) else params
            ids[engine.add_request(prompt, p, arrival_time=t0 + off, slo=slo)] = i
            i += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, timed[i][0] - (time.perf_counter() - t0)))
            continue
        for out in engine.step():
            if out.finished:
                done[ids[out.request_id]] = out.metrics
    return [done[k] for k in range(len(timed))]
