"""Co-located layered / adaptive layered prefill against prefill/decode-disaggregated
chunked and FlowPrefill, at an equal chip count, in the simulator.

Setup: the workloads of launch/bench_muxwise_sim.py (the layered-prefill paper's four
panels, Qwen3-30B-A3B and GPT-OSS-20B x arXiv and ShareGPT, TTFT 10 s / 5 s, TBT 125 /
100 ms; and the co-located multi-SLO QwenTrace-like mix on Qwen3-30B-A3B, TTFT k x solo,
TBT 125 ms) on H100 SXM with the GPU prior calibration; a request passes iff it meets its
TTFT and TBT SLOs. Sustainable rate = highest Poisson rate with >= 90% passing (grid, then
bisection; lp_jax.sim.slo.sustainable_rate), requests per point from a 30 s arrival window
(clamped to [200, 2000]), one seed.

Deployments at `--chips` chips (2: the paper's 2x H100; 4: twice that):
- co-located `layered` and `layered-adaptive` (TBT-SLO-sized layer spans; latency model
  warmed and frozen): chips / 2 replicas of the paper's TP2 engine, requests round-robin;
- disaggregated `pd-chunked` (prefill instances chunked, 2048-token budget: FlowPrefill's
  CP2K) and `pd-flowprefill` (FlowPrefill, operator segments, reference rules; latency
  model warmed on prefill-only requests and frozen; `pd-flowprefill-lp_jax` under
  lp_jax's earlier rules, `flowprefill_rules="lp_jax"`): `--layout` prefill and decode
  instances (default for 2 chips: one TP1 prefill + one TP1 decode; for 4: one TP2 + one
  TP2), decode instances decode only (lp_jax/sim/disagg.py). KV moves over `--link`
  (nvlink: half the table's bidirectional NVLink 4, 450 GB/s one way per chip; dcn: 50 GB/s
  one way per chip, lp_jax/sim/kv_link.py), charged to TTFT; `--links nvlink,dcn` runs both.
  The prefill scheduler sees each TTFT SLO minus the request's predicted transfer.
Every plan that only continues a prefill inside the stack pays `--segment-overhead-us`
(50 us) instead of 2 ms, as in bench_muxwise_sim.py / bench_flowprefill_sim.py.

    .venv/bin/python launch/bench_disagg_sim.py --out runs/disagg_sim [--chips 2,4]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from launch.bench_muxwise_sim import (  # noqa: E402
    HARDWARE,
    MODELS,
    SEED,
    TARGET,
    TP,
    Workload,
    num_requests,
    passes,
    select_workloads,
)
from lp_jax.core.metrics import percentile  # noqa: E402
from lp_jax.sim import (  # noqa: E402
    DisaggConfig,
    SimConfig,
    kv_link,
    replicated,
    report,
    run_disaggregated,
    warm_latency,
)

COLOCATED = {"layered": {"policy": "layered"},
             "layered-adaptive": {"policy": "layered", "layer_groups": "adaptive"}}
PD = {"pd-chunked": {"policy": "chunked", "max_num_batched_tokens": 2048},
      "pd-flowprefill": {"policy": "flowprefill", "preemption_granularity": "operator"},
      # lp_jax's earlier FlowPrefill rules (8192 bound, every member checked, EDF for all)
      "pd-flowprefill-lp_jax": {"policy": "flowprefill", "preemption_granularity": "operator",
                                "flowprefill_rules": "lp_jax"}}
DEFAULT_LAYOUT = {2: "1x1:1x1", 4: "1x2:1x2"}  # prefill instances x tp : decode x tp


def parse_layout(spec: str) -> tuple[int, int, int, int]:
    """ "1x2:1x2" -> (prefill instances, prefill tp, decode instances, decode tp)."""
    try:
        p, d = spec.split(":")
        (np_, tp_p), (nd, tp_d) = (map(int, p.split("x")), map(int, d.split("x")))
    except ValueError:
        raise ValueError(f"layout must look like 1x2:1x2, got {spec!r}") from None
    return np_, tp_p, nd, tp_d


# ----- deployments ---------------------------------------------------------------------
def deployment(wl: Workload, key: str, chips: int, layout: str, args):
    """-> (description, serve(requests) -> SimResult, chips used)."""
    base = SimConfig(shape=MODELS[wl.model], hardware=HARDWARE, tp=TP, tbt_slo_s=wl.tbt_slo,
                     max_model_len=wl.max_model_len,
                     segment_overhead_s=args.segment_overhead_us * 1e-6)
    if key in COLOCATED:
        if chips % TP:
            raise ValueError(f"{chips} chips do not split into TP{TP} replicas")
        cfg = replace(base, **COLOCATED[key])
        if key == "layered-adaptive":
            cfg = replace(cfg, latency=warm_latency(cfg, output_len=8), observe_latency=False)
        n = chips // TP
        return f"{n} x TP{TP} co-located", (lambda reqs: replicated(cfg, n, reqs)), n * TP
    policy, _, link = key.partition("/")
    np_, tp_p, nd, tp_d = parse_layout(layout)
    pre = replace(base, tp=tp_p, tbt_slo_s=None, **PD[policy])
    if policy.startswith("pd-flowprefill"):
        pre = replace(pre, latency=warm_latency(pre, output_len=1), observe_latency=False)
    dec = replace(base, tp=tp_d, tbt_slo_s=None, policy="chunked")
    cfg = DisaggConfig(prefill=pre, decode=dec, link=kv_link(link, HARDWARE),
                       num_prefill=np_, num_decode=nd)
    if cfg.chips != chips:
        raise ValueError(f"layout {layout} has {cfg.chips} chips, not {chips}")
    return (f"{np_}P x TP{tp_p} + {nd}D x TP{tp_d}, {link}",
            (lambda reqs: run_disaggregated(cfg, reqs).result), cfg.chips)


def point(wl: Workload, serve, rate: float, n: int, pool: int) -> dict:
    reqs = wl.requests(rate, n, pool)
    res = serve(reqs)
    ok = [passes(wl, r, m) for r, m in zip(reqs, res.metrics, strict=True)]
    ttft_ok = [m.ttft is not None and m.ttft <= (wl.ttft_slo or r.slo.ttft_s)
               for r, m in zip(reqs, res.metrics, strict=True)]
    s = res.summary()
    out = {"rate": rate, "requests": len(reqs), "attainment": sum(ok) / len(reqs),
           "ttft_attainment": sum(ttft_ok) / len(reqs),
           "tbt_attainment": sum(m.max_itl <= wl.tbt_slo for m in res.metrics) / len(reqs),
           "ttft_mean": s["ttft_mean"], "ttft_p99": s["ttft_p99"],
           "max_itl_p99": s["max_itl_p99"],
           "itl_p99_all_tokens": percentile([g for m in res.metrics for g in m.itls], 99),
           "e2e_mean": s["e2e_mean"], "mj_per_token": s["mj_per_token"]}
    out.update({k: v for k, v in res.extra.items() if k != "chips"})
    return out


def search(task) -> tuple[str, int, str, dict]:
    wl, key, chips, layout, args = task
    t0 = time.perf_counter()
    desc, serve, used = deployment(wl, key, chips, layout, args)
    grid = [g * chips / TP for g in wl.grid]  # rates scale with the chips

    def measure(rate: float) -> dict:
        n = num_requests(rate, args)
        return point(wl, serve, rate, n, max(n, args.max_requests))

    found, points = report.search_rate(measure, grid, "attainment", target=TARGET,
                                       bisect_steps=args.bisect_steps,
                                       max_extensions=args.max_extensions, full_curve=False)
    out = {"rate": found.rate, "lower_bound_only": found.lower_bound_only,
           "deployment": desc, "chips": used, "at_rate": points.get(found.rate),
           "curve": [points[r] for r in sorted(points)], "wall_s": time.perf_counter() - t0}
    print(f"  {wl.key} / {chips} chips / {key}: {found.rate:.2f} req/s "
          f"({out['wall_s']:.0f} s)", file=sys.stderr, flush=True)
    return wl.key, chips, key, out


# ----- report --------------------------------------------------------------------------
def _rate(r: dict) -> str:
    return report.rate_cell(r["rate"], r["lower_bound_only"], r["curve"][0]["rate"])


def markdown(results: dict, workloads: list[Workload], keys: list[str], chips: list[int],
             meta: dict) -> str:
    pd = [k for k in keys if k not in COLOCATED]
    lines = [f"## Disaggregated (PD) against co-located serving in the simulator "
             f"({meta['requests']}, seed {SEED})", "",
             "Sustainable rate (req/s, >= 90% of requests meet TTFT and TBT SLOs); ratios "
             "are each PD deployment over co-located layered:", "",
             "| workload | chips | " + " | ".join(keys) + " | "
             + " | ".join(f"{k} / layered" for k in pd) + " |",
             "| --- | ---: | " + " | ".join(["---:"] * (len(keys) + len(pd))) + " |"]
    for wl in workloads:
        for c in chips:
            res = results[wl.key][c]
            lay = res.get("layered", {}).get("rate", 0)
            ratios = [f"{res[k]['rate'] / lay:.2f}x" if lay and res[k]["rate"] else "-"
                      for k in pd]
            lines.append(report.row([wl.title, str(c), *[_rate(res[k]) for k in keys],
                                     *ratios]))
    lines += ["", "Deployments: " + "; ".join(
        f"{c} chips: " + ", ".join(f"{k} = {results[workloads[0].key][c][k]['deployment']}"
                                   for k in keys) for c in chips), "",
              "At each deployment's sustainable rate: TTFT / TBT attainment, mean and p99 "
              "TTFT (s), p99 of the largest gap (ms), mean KV transfer (ms), mean wait for "
              "a decode slot (s).", "",
              "| workload | chips | deployment | TTFT att. | TBT att. | TTFT mean | TTFT p99 | "
              "max-ITL p99 ms | KV transfer ms | decode wait s |",
              "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for wl in workloads:
        for c in chips:
            for k in keys:
                a = results[wl.key][c][k]["at_rate"]
                if not a:
                    continue
                lines.append(report.row([
                    wl.title, str(c), k, report.cell(a["ttft_attainment"], ".2f"),
                    report.cell(a["tbt_attainment"], ".2f"), report.cell(a["ttft_mean"], ".2f"),
                    report.cell(a["ttft_p99"], ".2f"), report.cell(1e3 * a["max_itl_p99"], ".0f"),
                    report.cell(1e3 * a.get("kv_transfer_mean_s", float("nan")), ".2f"),
                    report.cell(a.get("decode_wait_mean_s"), ".2f")]))
    return "\n".join(lines + [""])


# ----- driver --------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/disagg_sim")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--chips", default="2,4", help="chip counts, each a multiple of 2")
    ap.add_argument("--layout", action="append", default=[],
                    help="CHIPS=PxTP:DxTP, e.g. 4=2x1:1x2 (default 2=1x1:1x1, 4=1x2:1x2)")
    ap.add_argument("--links", default="nvlink", help="nvlink, dcn (comma-separated)")
    ap.add_argument("--deployments", default="layered,layered-adaptive,pd-chunked,"
                    "pd-flowprefill")
    ap.add_argument("--workloads", default="panels,multislo", help="panels, multislo or keys")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--window-s", type=float, default=30.0)
    ap.add_argument("--min-requests", type=int, default=200)
    ap.add_argument("--max-requests", type=int, default=2000)
    ap.add_argument("--bisect-steps", type=int, default=4)
    ap.add_argument("--max-extensions", type=int, default=5)
    ap.add_argument("--segment-overhead-us", type=float, default=50.0)
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    t0 = time.perf_counter()
    chips = [int(c) for c in args.chips.split(",") if c]
    layouts = dict(DEFAULT_LAYOUT)
    for item in args.layout:
        c, _, spec = item.partition("=")
        parse_layout(spec)
        layouts[int(c)] = spec
    keys = []
    for d in args.deployments.split(","):
        if d in COLOCATED:
            keys.append(d)
        elif d in PD:
            keys += [f"{d}/{link}" for link in args.links.split(",") if link]
        elif d:
            raise SystemExit(f"unknown deployment {d!r}; known: {[*COLOCATED, *PD]}")
    workloads, multi_info = select_workloads(args.workloads)
    tasks = [(wl, k, c, layouts[c], args) for wl in workloads for c in chips for k in keys]
    results: dict = {wl.key: {c: {} for c in chips} for wl in workloads}
    with report.pool(args.workers) as pool:
        for wk, c, k, out in pool.imap_unordered(search, tasks):
            results[wk][c][k] = out
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    req_text = (f"{args.requests} requests per point" if args.requests else
                f"rate x {args.window_s:g} s of arrivals per point, {args.min_requests}-"
                f"{args.max_requests} requests")
    meta = {"requests": req_text, "multi_slo": multi_info, "layouts": layouts,
            "wall_s": time.perf_counter() - t0, "args": vars(args)}
    md = markdown(results, workloads, keys, chips, meta)
    (out_dir / "disagg_sim.md").write_text(md)
    saved = {"meta": meta, "results": results}
    (out_dir / "disagg_sim.json").write_text(json.dumps(saved, indent=1, default=str))
    print(md)
    print(f"total {meta['wall_s']:.0f} s", file=sys.stderr)
    return saved


if __name__ == "__main__":
    main()
