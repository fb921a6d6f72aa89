"""FlowPrefill's host cost per segment, and what dispatching segments ahead trades for it
(issue #30 finding 4), on the real engine.

    python launch/bench_segment_dispatch.py --out runs/bench_segment_dispatch

One engine (the 8-layer random-weight tiny Qwen3-MoE of the tests by default: 16
operator segments a prompt) compiles its two row-bucket programs once; each
configuration, preemption granularity (operator, layer) x lookahead k
(`flowprefill_lookahead`, 1 2 4), is a fresh `Scheduler` on the same executor. Every
request is prefill-only (FlowPrefill's setting).

Host cost: a --long-len prompt prefills alone, --repeats times per configuration, the
configurations interleaved round by round so drift on a shared host hits them alike. Per
segment of the prompt: host milliseconds in the plan (`Scheduler.schedule`), the dispatch
(`ModelRunner.dispatch`: the calls' inputs and their launch) and the commit
(`Scheduler.commit`), the engine's whole host time (`stats()["host_seconds"]`: also the
engine's own bookkeeping and the latency estimator), and the segment's device time (the
step times the engine measures for its latency estimator, `Scheduler.observe`, divided by
the segments the step ran). On this CPU the "device" is the same two cores, so quote the
host : device ratio, not the milliseconds.

Blocking, twice. First as launch/bench_flowprefill.py measures it, on the wall clock:
a --short-len urgent request, stamped at its nominal arrival, at --block-repeats times
spread over [0.15, 0.65] of the long prompt's solo TTFT; blocking = its TTFT minus its
TTFT alone. The bound is k + 1 segments (the rest of the one running and k queued) of the
longest (an attention half at operator granularity), as the engine timed it; blocking
also holds the host's own wait for the step boundary and the urgent request's slowdown,
so it may pass it a little. Beside it, counted from the engine's plans (not timed):
the segments the outstanding plans held when the urgent request's first plan was made,
which is what k adds to its wait (at most k; the segment running at the arrival, or one
dispatched before the host saw it, comes on top).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from launch.bench_flowprefill import ONE_TOKEN, blocking  # noqa: E402
from lp_jax.bench.open_loop import use_policy  # noqa: E402
from lp_jax.bench.report import write_results  # noqa: E402
from lp_jax.engine.config import EngineConfig  # noqa: E402
from lp_jax.engine.llm_engine import LLMEngine  # noqa: E402

PARTS = ("plan", "dispatch", "commit")


class _Timed:
    """Timing hooks on one scheduler and the runner: seconds per part, device seconds."""

    def __init__(self, engine):
        self.t = dict.fromkeys(PARTS, 0.0)
        self.device = 0.0
        self.longest = 0.0  # seconds, the longest step per segment it ran
        sched, runner = engine.scheduler, engine.runner
        self._wrap(sched, "schedule", "plan")
        self._wrap(sched, "commit", "commit")
        self._wrap(runner, "dispatch", "dispatch")
        observe = sched.observe

        units = 2 if sched.config.preemption_granularity == "layer" else 1

        def timed_observe(plan, seconds, experts=None):
            self.device += seconds
            if plan.prefill:  # the longest segment, as its plan's time per segment
                n = max(1, (plan.unit_end - plan.unit_start) // units)
                self.longest = max(self.longest, seconds / n)
            return observe(plan, seconds, experts)

        sched.observe = timed_observe
        self._runner, self._dispatch = runner, runner.dispatch
        self._sched = sched

    def _wrap(self, obj, name, part):
        f = getattr(obj, name)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                self.t[part] += time.perf_counter() - t0

        setattr(obj, name, timed)

    def close(self):
        """Removes the runner's hook (the runner outlives this scheduler)."""
        del self._runner.dispatch


def segments_of(plan, policy) -> int:
    """How many of its batch's segments a FlowPrefill plan ran (1 without a batch)."""
    b = policy._find(plan.prefill_batch_id)
    if b is None:
        return 1
    return sum(1 for a, _ in b.segments if plan.unit_start <= a < plan.unit_end)


def one_prefill(engine, prompt: list[int]) -> dict:
    """Runs one prompt alone; the host and device seconds of its plans."""
    timed = _Timed(engine)
    policy = engine.scheduler.policy
    seen = {}
    schedule = engine.scheduler.schedule

    def counting_schedule(now):
        plan = schedule(now)
        if plan.prefill:
            seen[plan.step_id] = segments_of(plan, policy)
        return plan

    engine.scheduler.schedule = counting_schedule
    before = engine.stats()
    t0 = time.perf_counter()
    engine.add_request(prompt, ONE_TOKEN)
    while engine.has_unfinished():
        engine.step()
    wall = time.perf_counter() - t0
    after = engine.stats()
    timed.close()
    engine.scheduler.schedule = schedule
    return {"wall": wall, "plans": len(seen), "segments": sum(seen.values()),
            **timed.t, "host": after["host_seconds"] - before["host_seconds"],
            "exposed": (after["host_seconds"] - after["overlapped_host_seconds"])
            - (before["host_seconds"] - before["overlapped_host_seconds"]),
            "device": timed.device, "longest": timed.longest}


def queued_ahead(engine, short_len: int) -> tuple[list[int], object]:
    """Hooks the scheduler: for each request of `short_len` tokens, the segments the
    plans still outstanding hold when its first plan is made (what it waits for beyond
    the step boundary). Returns the list it fills and the hook's undo."""
    sched, seen, counts = engine.scheduler, set(), []
    schedule = sched.schedule

    def watched(now):
        plan = schedule(now)
        for c in plan.prefill:
            q = c.seq
            if q.num_prompt_tokens == short_len and q.seq_id not in seen:
                seen.add(q.seq_id)
                counts.append(sum(segments_of(p, sched.policy)
                                  for p in sched.outstanding_plans[:-1]))
        return plan

    sched.schedule = watched
    return counts, lambda: setattr(sched, "schedule", schedule)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/bench_segment_dispatch")
    p.add_argument("--model", default=None, help="default: the tests' 8-layer tiny model")
    p.add_argument("--long-len", type=int, default=512)
    p.add_argument("--short-len", type=int, default=16)
    p.add_argument("--lookahead", default="1,2,4")
    p.add_argument("--granularity", default="operator,layer")
    p.add_argument("--repeats", type=int, default=12, help="host-cost runs per config")
    p.add_argument("--block-repeats", type=int, default=12, help="urgent arrivals per config")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = args.model
    if model is None:
        from checkpoints.make_tiny import ensure_tiny

        model = str(ensure_tiny(preset="tiny"))
    budget = args.long_len
    engine = LLMEngine(EngineConfig(
        model=model, scheduling="flowprefill", max_model_len=max(1024, budget + 1),
        max_num_batched_tokens=budget, max_num_seqs=4, prefill_only=True,
        enable_prefix_caching=False, token_buckets=(4, budget + 4)), log=print)
    base = engine.scheduler.config
    rng = np.random.default_rng(args.seed)
    long_p = rng.integers(0, 500, args.long_len).tolist()
    short_p = rng.integers(0, 500, args.short_len).tolist()
    configs = [(g, int(k)) for g in args.granularity.split(",")
               for k in args.lookahead.split(",")]
    name = {c: f"{c[0]} k={c[1]}" for c in configs}

    runs = {c: [] for c in configs}
    for rep in range(args.repeats + 1):  # round 0 warms each configuration up
        for c in configs:
            use_policy(engine, base, preemption_granularity=c[0], flowprefill_lookahead=c[1])
            r = one_prefill(engine, long_p)
            if rep:
                runs[c].append(r)
    results = {"config": vars(args) | {"model": model}, "runs": {}}
    for c in configs:
        rs = runs[c]
        segs = rs[0]["segments"]
        per_seg = {k: statistics.median(r[k] for r in rs) / segs * 1e3
                   for k in ("wall", *PARTS, "host", "exposed", "device")}
        use_policy(engine, base, preemption_granularity=c[0], flowprefill_lookahead=c[1])
        queued, undo = queued_ahead(engine, len(short_p))
        blk = blocking(engine, long_p, short_p, args.block_repeats)
        undo()
        queued = queued[-args.block_repeats:]  # the arrivals during the long prefill
        results["runs"][name[c]] = {
            "granularity": c[0], "lookahead": c[1], "segments": segs,
            "plans": statistics.median(r["plans"] for r in rs), "per_segment_ms": per_seg,
            "host_to_device": per_seg["host"] / per_seg["device"],
            "longest_segment_ms": statistics.median(r["longest"] for r in rs) * 1e3,
            "blocking": blk, "queued_segments": queued}
        res = results["runs"][name[c]]
        res["bound_ms"] = (c[1] + 1) * res["longest_segment_ms"]

        print(name[c], json.dumps(results["runs"][name[c]]))
    results["compilations_after_warmup"] = engine.stats()["compilations_after_warmup"]
    write_results(out, results, render)
    return results


def render(r: dict) -> str:
    cfg = r["config"]
    lines = [f"{cfg['long_len']}-token prompt alone, {cfg['repeats']} runs per row (medians); "
             f"blocking of a {cfg['short_len']}-token urgent arrival, "
             f"{cfg['block_repeats']} arrivals per row; compiles while serving: "
             f"{r['compilations_after_warmup']}", "",
             "| granularity | k | segments / plans | plan | dispatch | commit | engine host "
             "| exposed host | device | host : device | wall | blocking mean / max | "
             "(k + 1) x longest segment | segments queued ahead, mean / max |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
             "| ---: | ---: | ---: |"]
    for res in r["runs"].values():
        s, b, q = res["per_segment_ms"], res["blocking"], res["queued_segments"]
        lines.append(
            f"| {res['granularity']} | {res['lookahead']} | {res['segments']} / "
            f"{res['plans']:g} | {s['plan']:.3f} | {s['dispatch']:.3f} | {s['commit']:.3f} | "
            f"{s['host']:.3f} | {s['exposed']:.3f} | {s['device']:.3f} | "
            f"{res['host_to_device']:.2f} | {s['wall']:.3f} | {b['blocking_ms']:.1f} / "
            f"{b['blocking_max_ms']:.1f} | {res['bound_ms']:.1f} | "
            f"{statistics.mean(q):.2f} / {max(q)} |")
    lines.append("")
    lines.append("Per-segment columns in ms (host parts, the engine's host total, the part "
                 "not overlapped with a step, the device step time per segment, wall). "
                 "Blocking in ms on the wall clock; segments queued ahead: those the "
                 "outstanding plans held when the urgent request's first plan was made.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
