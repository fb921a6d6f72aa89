"""Why co-located FlowPrefill trails layered FCFS in the simulator (issue #30 finding 3a).

bench_muxwise_sim.py's setup (2x H100, TP2, GPU prior, 50 us per continuing segment), at
one fixed rate per workload: layered's sustainable rate there (--rates). Every variant
runs the same requests; a request passes iff TTFT <= its SLO and every gap <= the TBT
SLO. Variants: layered FCFS; FlowPrefill at each granularity under the reference and the
lp_jax rules; FlowPrefill / operator with the 2048 and 8192 budgets; no per-segment cost.
Columns: pass share, TTFT-only and TBT-only pass shares, mean / p99 TTFT, p99 of the
largest gap, iterations, pauses, expert bytes read, device-busy seconds.

    .venv/bin/python launch/diag_flowprefill_colocated.py --out runs/diag_flowprefill_colocated

`--sustainable fp-lp_jax-operator,fp-ref-group-8192` instead runs bench_muxwise_sim's rate
search (every workload) for those variants, beside its own policies.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from launch import bench_muxwise_sim as mw  # noqa: E402
from lp_jax.sim import Simulator, warm_latency  # noqa: E402

FP = {"policy": "flowprefill"}
VARIANTS: dict[str, dict] = {
    "layered": {"policy": "layered"},
    "fp-ref-operator": {**FP, "preemption_granularity": "operator"},
    "fp-ref-layer": {**FP, "preemption_granularity": "layer"},
    "fp-ref-group": {**FP, "preemption_granularity": "group"},
    "fp-ref-operator-8192": {**FP, "preemption_granularity": "operator",
                             "max_num_batched_tokens": 8192},
    "fp-ref-group-8192": {**FP, "preemption_granularity": "group",
                          "max_num_batched_tokens": 8192},
    "fp-lp_jax-operator": {**FP, "preemption_granularity": "operator",
                           "flowprefill_rules": "lp_jax"},
    "fp-lp_jax-group": {**FP, "preemption_granularity": "group", "flowprefill_rules": "lp_jax"},
    "fp-lp_jax-operator-0us": {**FP, "preemption_granularity": "operator",
                               "flowprefill_rules": "lp_jax", "segment_overhead_s": 0.0},
    "layered-preemptible": {"policy": "layered", "preemptible": True},
}


def run(wl, name: str, rate: float, n: int) -> dict:
    opts = dict(VARIANTS[name])
    seg = opts.pop("segment_overhead_s", 50e-6)
    cfg = mw.SimConfig(shape=mw.MODELS[wl.model], hardware=mw.HARDWARE, tp=mw.TP,
                       tbt_slo_s=wl.tbt_slo, max_model_len=wl.max_model_len,
                       segment_overhead_s=seg, **opts)
    if opts["policy"] == "flowprefill" or opts.get("preemptible"):
        cfg = replace(cfg, latency=warm_latency(cfg, output_len=8))
    reqs = wl.requests(rate, n, n)
    sim = Simulator(cfg)
    res = sim.run(reqs)
    ttft_ok = [m.ttft is not None and m.ttft <= (wl.ttft_slo or r.slo.ttft_s)
               for r, m in zip(reqs, res.metrics, strict=True)]
    tbt_ok = [m.max_itl <= wl.tbt_slo for m in res.metrics]
    st = res.scheduler_stats
    s = res.summary()
    batches = st.get("prefill_batches", 0)
    return {
        "pass": sum(a and b for a, b in zip(ttft_ok, tbt_ok, strict=True)) / n,
        "ttft_pass": sum(ttft_ok) / n, "tbt_pass": sum(tbt_ok) / n,
        "ttft_mean": s["ttft_mean"], "ttft_p99": s["ttft_p99"],
        "max_itl_p99_ms": 1e3 * s["max_itl_p99"], "iterations": res.iterations,
        "expert_gb": res.expert_bytes / 1e9, "busy_s": res.busy_s, "span_s": res.span_s,
        "prefill_batches": batches, "pauses": st.get("prefill_pauses", 0),
        "budget": sim.scheduler_config().max_num_batched_tokens,
        "stats": st,
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/diag_flowprefill_colocated")
    ap.add_argument("--workloads", default="qwen-arxiv,qwen-multislo")
    ap.add_argument("--rates", default="8.34,2.90", help="req/s per workload")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--sustainable", default=None,
                    help="variants to give bench_muxwise_sim's rate search instead")
    args = ap.parse_args(argv)
    if args.sustainable:
        names = args.sustainable.split(",")
        for name in names:
            opts = dict(VARIANTS[name])
            opts.pop("segment_overhead_s", None)
            mw.POLICIES[name] = opts
        mw.ESTIMATOR_DRIVEN = (*mw.ESTIMATOR_DRIVEN, *names)
        return mw.main(["--policies", args.sustainable, "--workers", "1", "--out", args.out])
    wls, _ = mw.select_workloads("panels,multislo")
    by_key = {w.key: w for w in wls}
    out: dict = {}
    for key, rate in zip(args.workloads.split(","), map(float, args.rates.split(",")),
                         strict=True):
        wl = by_key[key]
        out[key] = {"rate": rate}
        for name in args.variants.split(","):
            r = run(wl, name, rate, args.requests)
            out[key][name] = r
            print(f"{key} @ {rate:g} {name:24s} pass {r['pass']:.3f} ttft {r['ttft_pass']:.3f} "
                  f"tbt {r['tbt_pass']:.3f} ttft mean {r['ttft_mean']:.2f} p99 "
                  f"{r['ttft_p99']:.2f} s, max-ITL p99 {r['max_itl_p99_ms']:.0f} ms, iters "
                  f"{r['iterations']}, pauses {r['pauses']}, expert {r['expert_gb']:.0f} GB, busy "
                  f"{r['busy_s']:.1f} s", flush=True)
    path = Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    (path / "diag.json").write_text(json.dumps(out, indent=1, default=str))
    return out


if __name__ == "__main__":
    main()
