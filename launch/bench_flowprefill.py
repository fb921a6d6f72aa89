"""FlowPrefill on the real engine (this CPU): per-class TTFT attainment and blocking time,
every policy side by side in one run, with the same arrivals.

    python launch/bench_flowprefill.py --out runs/bench_flowprefill

One engine (the embedded tiny Qwen3-MoE by default) compiles its row-bucket programs once;
each policy is a fresh `Scheduler` on the same executor, which is policy-agnostic (the
hidden buffer has FlowPrefill's row areas, which the other policies leave unused). Every
request is prefill-only (it ends at its first token), FlowPrefill's setting.

Workload: the simulator's QwenTrace-like classes (`lp_jax.sim.task_classes.QWENTRACE`), prompt
lengths times --length-scale so a run takes minutes. SLO base: each class's TTFT SLO is
k x the solo TTFT of its median prompt, measured here with one whole-prompt call
(policy orca), times --slo-scale. Poisson arrivals at --load x the capacity the solo
times imply.

Blocking: a long prompt (the longest class median, or --long-len) starts alone; a short
urgent request (the shortest class median) arrives with a tight SLO inside it, at
--repeats times spread evenly over [0.15, 0.65] of the long prompt's solo TTFT (where the
arrival falls within a segment decides the wait). Blocking = the urgent request's TTFT
minus its TTFT alone under the same policy (so the wait until its prefill starts, plus any
slowdown while it runs), in ms (mean and max) and as a share of the long prompt's solo
TTFT.

`--lookahead 1,2`: each FlowPrefill policy also runs with plans of up to k segments, as
the row <policy>-k<k> (issue #30 finding 4), on the same arrivals.

`--trace`: each policy's open-loop run also writes its decision trace
(`trace_<policy>.jsonl`, lp_jax/trace) and timeline (`timeline_<policy>.png`) to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import numpy as np

from lp_jax.bench import open_loop
from lp_jax.bench.open_loop import use_policy
from lp_jax.bench.report import write_results
from lp_jax.core.latency import profile_prompts
from lp_jax.core.metrics import percentile
from lp_jax.core.sampling_params import SamplingParams
from lp_jax.core.slo import SLO
from lp_jax.engine.config import EngineConfig
from lp_jax.engine.llm_engine import LLMEngine
from lp_jax.sim.simulator import ttft_attainment
from lp_jax.sim.task_classes import (
    QWENTRACE,
    class_slos,
    configure_classes,
    multi_slo_requests,
    parse_assignments,
    parse_task_class,
)
from lp_jax.trace import TraceWriter
from lp_jax.trace.timeline import plot_timeline

POLICIES = {
    "chunked-512": dict(policy="chunked", max_num_batched_tokens=512),
    "layered": dict(policy="layered"),
    "layered+preempt": dict(policy="layered", preemptible=True),
    "flowprefill-group": dict(policy="flowprefill", preemption_granularity="group"),
    "flowprefill-layer": dict(policy="flowprefill", preemption_granularity="layer"),
    "flowprefill-operator": dict(policy="flowprefill", preemption_granularity="operator"),
}
ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def prompt(rng, n: int) -> list[int]:
    return rng.integers(0, 500, int(n)).tolist()


def run_open_loop(engine, timed):
    return open_loop.run_open_loop(engine, timed, ONE_TOKEN)


def solo(engine: LLMEngine, p: list[int], repeats: int = 3) -> float:
    return statistics.median(run_open_loop(engine, [(0.0, p, None)])[0].ttft
                             for _ in range(repeats))


def blocking(engine, long_p, short_p, repeats: int):
    """The short request's extra TTFT when it arrives during the long prefill. It is
    stamped at its nominal arrival (the engine learns of it only at the next step
    boundary, and that wait is part of the blocking), with an SLO loose enough to stay
    feasible while it waits (the long prefill's solo time: still far ahead of the long
    request's deadline, so EDF ranks it first), so the figure is the preemption's and
    not slack-aware EDF's demotion of an infeasible request."""
    long_solo, short_solo = solo(engine, long_p), solo(engine, short_p)
    urgent = SLO(long_solo + short_solo)
    waits = []
    for arrive_at in np.linspace(0.15, 0.65, repeats):
        t0 = time.perf_counter()
        ids = {engine.add_request(long_p, ONE_TOKEN, slo=SLO(1e3), arrival_time=t0): "long"}
        arrival = t0 + arrive_at * long_solo
        while time.perf_counter() < arrival:
            engine.step()
        ids[engine.add_request(short_p, ONE_TOKEN, slo=urgent, arrival_time=arrival)] = "short"
        ttft = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    ttft[ids[out.request_id]] = out.metrics.ttft
        waits.append(ttft["short"] - short_solo)
    wait = statistics.mean(waits)
    return {"long_solo_ms": long_solo * 1e3, "short_solo_ms": short_solo * 1e3,
            "blocking_ms": wait * 1e3, "blocking_max_ms": max(waits) * 1e3,
            "blocking_share": wait / long_solo, "blocking_all_ms": [w * 1e3 for w in waits]}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/bench_flowprefill")
    p.add_argument("--model", default=None)
    p.add_argument("--length-scale", type=float, default=0.25)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--load", type=float, default=0.7, help="x capacity from solo TTFTs")
    p.add_argument("--slo-scale", type=float, default=1.0)
    p.add_argument("--budget", type=int, default=2048, help="layered / flowprefill tokens")
    p.add_argument("--max-model-len", type=int, default=2304)
    p.add_argument("--class", dest="classes", action="append", default=[],
                   help="name:prompt_mean:weight:k[:sigma] (adds or replaces a class)")
    p.add_argument("--slo-k", default="", help="name=k,... overrides")
    p.add_argument("--weights", default="", help="name=w,... overrides")
    p.add_argument("--long-len", type=int, default=None)
    p.add_argument("--repeats", type=int, default=6, help="blocking arrivals per policy")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lookahead", default="1",
                   help="flowprefill_lookahead k, or several (1,2): segments a FlowPrefill "
                        "plan may carry, each k a row <policy>-k<k> "
                        "(launch/bench_segment_dispatch.py; 1: one segment a plan)")
    p.add_argument("--trace", action="store_true",
                   help="write each policy's decision trace and timeline PNG to --out")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(args.seed)

    engine = LLMEngine(EngineConfig(
        model=args.model, scheduling="flowprefill", max_model_len=args.max_model_len,
        max_num_batched_tokens=args.budget, max_num_seqs=16, prefill_only=True,
        enable_prefix_caching=False), log=print)  # the same prompts are timed repeatedly
    base = engine.scheduler.config
    limit = args.max_model_len - 1
    classes = tuple(dataclasses.replace(
        c, prompt_mean=c.prompt_mean * args.length_scale,
        prompt_min=min(c.prompt_min, limit), prompt_max=min(c.prompt_max, limit))
        for c in configure_classes(QWENTRACE, slo_k=parse_assignments(args.slo_k),
                                   weights=parse_assignments(args.weights),
                                   extra=[parse_task_class(s) for s in args.classes]))

    # Warm the latency estimator on a profiling pass, then measure the SLO base.
    for wave in profile_prompts(args.budget, args.max_model_len, 16, rng):
        run_open_loop(engine, [(0.0, prompt(rng, n), None) for n in wave])
    use_policy(engine, base, policy="orca", max_num_batched_tokens=args.budget)
    solo_s = {c.prompt_median: solo(engine, prompt(rng, c.prompt_median)) for c in classes}
    slos = class_slos(classes, lambda n: solo_s[n], args.slo_scale)
    weights = np.array([c.weight for c in classes]) / sum(c.weight for c in classes)
    service = float(sum(w * solo_s[c.prompt_median] for w, c in zip(weights, classes,
                                                                     strict=True)))
    rate = args.load / service
    requests = multi_slo_requests(classes, slos, args.requests, rate, seed=args.seed)
    timed = [(r.arrival, prompt(rng, r.prompt_len), r.slo) for r in requests]
    long_len = args.long_len or max(c.prompt_median for c in classes)
    short_len = min(c.prompt_median for c in classes)
    long_p, short_p = prompt(rng, long_len), prompt(rng, short_len)

    results = {"config": vars(args), "rate_req_s": rate, "service_s": service,
               "classes": {c.name: {"median_prompt": c.prompt_median, "k": c.slo_k,
                                    "weight": c.weight, "solo_ttft_ms":
                                    solo_s[c.prompt_median] * 1e3,
                                    "ttft_slo_ms": slos[c.name].ttft_s * 1e3,
                                    "assumed": c.assumed} for c in classes},
               "policies": {}}
    lookaheads = [int(k) for k in str(args.lookahead).split(",")]
    runs = [(policy, k) for policy in args.policies.split(",")
            for k in (lookaheads if policy.startswith("flowprefill") else [1])]
    for policy, k in runs:
        name = policy if k == 1 else f"{policy}-k{k}"
        use_policy(engine, base, **POLICIES[policy], flowprefill_lookahead=k)
        if args.trace:
            engine.trace = TraceWriter(out / f"trace_{name}.jsonl", source="engine",
                                       policy=name, num_layers=base.num_layers, clock="wall")
        t = time.perf_counter()
        metrics = run_open_loop(engine, timed)
        wall = time.perf_counter() - t
        if args.trace:
            engine.trace.close()
            engine.trace = None
            plot_timeline(out / f"trace_{name}.jsonl", out / f"timeline_{name}.png",
                          title=f"bench_flowprefill: {name}")
            print(f"wrote {out / f'trace_{name}.jsonl'} and {out / f'timeline_{name}.png'}")
        s = engine.scheduler.stats()
        by_class = {}
        for c in classes:
            ttfts = [m.ttft for r, m in zip(requests, metrics, strict=True) if r.task == c.name]
            by_class[c.name] = {"n": len(ttfts), "ttft_p50_ms": percentile(ttfts, 50) * 1e3,
                                "ttft_p99_ms": percentile(ttfts, 99) * 1e3}
        res = {"attainment": ttft_attainment(requests, metrics), "by_class": by_class,
               "wall_s": wall, "rounds": s["scheduling_rounds"],
               "pauses": s["prefill_pauses"], "iterations": s["iterations"],
               "blocking": blocking(engine, long_p, short_p, args.repeats)}
        results["policies"][name] = res
        print(name, json.dumps({k: v for k, v in res.items() if k != "by_class"}))
    results["latency_model"] = engine.scheduler.latency.error()
    results["compilations_after_warmup"] = engine.stats()["compilations_after_warmup"]
    write_results(out, results, render)
    return results


def render(r: dict) -> str:
    names = list(r["classes"])
    lines = [f"rate {r['rate_req_s']:.2f} req/s (load {r['config']['load']} x capacity from "
             f"solo TTFTs), {r['config']['requests']} requests, length scale "
             f"{r['config']['length_scale']}", "",
             "| class | median prompt | k | solo TTFT ms | TTFT SLO ms |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for n, c in r["classes"].items():
        lines.append(f"| {n}{' (assumed: ' + c['assumed'] + ')' if c['assumed'] else ''} | "
                     f"{c['median_prompt']} | {c['k']} | {c['solo_ttft_ms']:.0f} | "
                     f"{c['ttft_slo_ms']:.0f} |")
    lines += ["", "| policy | attainment, all | " + " | ".join(names)
              + " | chat TTFT p50 / p99 ms | blocking ms, mean / max | blocking / long "
              "prefill | rounds | pauses |",
              "| --- | ---: | " + " | ".join("---:" for _ in names) + " | ---: | ---: | ---: "
              "| ---: | ---: |"]
    first = names[0]  # the tightest class (chat)
    for p, res in r["policies"].items():
        a, b = res["attainment"], res["blocking"]
        lines.append(f"| {p} | {a['all']:.2f} | "
                     + " | ".join(f"{a.get(n, float('nan')):.2f}" for n in names)
                     + f" | {res['by_class'][first]['ttft_p50_ms']:.0f} / "
                     f"{res['by_class'][first]['ttft_p99_ms']:.0f} | {b['blocking_ms']:.1f} / "
                     f"{b['blocking_max_ms']:.1f} | {b['blocking_share']:.3f} | "
                     f"{res['rounds']} | {res['pauses']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
