"""Layered against chunked prefill for DeepSeek-V3 at pod scale under data-parallel
attention, in the simulator (lp_jax/sim/dp_executor.py; simulated, nothing ran on a TPU).

    python launch/bench_dp_sim.py [--chips 64] [--chip "TPU v6e"] [--n 400]
        [--meshes 16x4,8x8,1x64] [--sharegpt-rate 40] [--arxiv-rate 4] [--json PATH]
        [--global-budget]

DeepSeek-V3 with FP8 128 x 128 block weights and a bf16 latent on --chips chips. Each mesh
d x t is (d, 1, t): d data-parallel attention ranks of t chips, the experts over all
chips (1 x n is TP attention over every chip, the simulator's (tp = n, ep = 1)). The
engine's scheduler places each sequence on a rank (its RankedBlockManager, each rank's
pool one chip's KV room), every step runs the busiest rank's rows on every rank, and the
link bytes are DP attention's (dp_link_bytes_per_layer). Policies, with the layered-prefill
paper's token budgets, each a rank's own (max_num_batched_tokens is a data rank's budget:
lp_jax/core/budget.py): chunked prefill at 512 and 2,048 a rank, layered prefill at 8,192
a rank with the paper's layer groups. --global-budget gives one budget of d times them
to the whole plan instead (the scheduler's rule before budgets a rank), for comparison.
Workloads: ShareGPT-8k and arXiv-paper lengths, Poisson arrivals at one rate each, --n
requests, max_num_seqs 512 over the slice (ceil(512 / d) a rank).

Per row: TTFT p50 / p99, the p99 of each request's longest inter-token gap, mean E2E,
output tokens a second, routed-expert GB read per 100 requests, the share of row-layers
that were an idle or lighter rank's padding, the busiest rank's rows over the mean, one
chip's link GB per output token, KV tokens a rank, and preemptions (a rank out of pages).
The cost model is the roofline with the documented GPU prior (lp_jax/sim/calibration.py)
and Zipf routing fitted for Qwen3 reused at E = 256, k = 8: assumptions, not a TPU
measurement.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Token budgets a rank (the layered-prefill paper's: chunked 512, layered 8,192).
POLICIES = (("chunked-512", "chunked", 512), ("chunked-2048", "chunked", 2048),
            ("layered-8192", "layered", 8192))
MAX_NUM_SEQS = 512  # over the slice (chunked needs budget >= max_num_seqs at d = 1)


def run_point(shape, hw, mesh, policy, budget, requests, global_budget=False) -> dict:
    from lp_jax.core.policies import resolve_policy
    from lp_jax.sim import SimConfig, Simulator

    d, t = mesh
    if global_budget:  # the same policy with one budget, d times a rank's, for the plan
        base = resolve_policy(policy)
        policy = type(f"{base.__name__}OneBudget", (base,), {"rank_budgets": False})
        budget *= d
    cfg = SimConfig(shape=shape, hardware=hw, policy=policy, dp=d, tp=t,
                    max_num_batched_tokens=budget, max_num_seqs=MAX_NUM_SEQS,
                    max_model_len=32768)
    sim = Simulator(cfg)
    r = sim.run(requests)
    s = r.summary()
    out_tokens = r.output_tokens
    return {"ttft_p50": s["ttft_p50"], "ttft_p99": s["ttft_p99"],
            "max_itl_p99": s["max_itl_p99"], "e2e_mean": s["e2e_mean"],
            "tokens_per_s": out_tokens / r.span_s,
            "expert_gb_per_100": s["expert_gb_per_100_requests"],
            "padding": r.extra.get("dp_padding", 0.0),
            "imbalance": r.extra.get("dp_imbalance", 1.0),
            "link_gb_per_token": r.extra.get("dp_link_bytes", float("nan")) / 1e9 / out_tokens,
            "kv_tokens_per_rank": sim.num_pages // d * cfg.page_size,
            "preemptions": s["preemptions"], "wall_s": r.wall_s}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chips", type=int, default=64)
    ap.add_argument("--chip", default="TPU v6e")
    ap.add_argument("--n", type=int, default=400, help="requests a workload")
    ap.add_argument("--meshes", default="16x4,8x8,1x64", help="d x t meshes, comma-separated")
    ap.add_argument("--sharegpt-rate", type=float, default=40.0, help="requests a second")
    ap.add_argument("--arxiv-rate", type=float, default=4.0, help="requests a second")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--global-budget", action="store_true",
                    help="one budget of d times a rank's for the whole plan")
    args = ap.parse_args(argv)
    from lp_jax.roofline.hardware import get_hardware
    from lp_jax.roofline.model_shape import DEEPSEEK_V3
    from lp_jax.sim import synthesize

    shape, hw = DEEPSEEK_V3.with_formats("fp8_block", None), get_hardware(args.chip)
    meshes = [tuple(int(x) for x in m.split("x")) for m in args.meshes.split(",")]
    for d, t in meshes:
        if d * t != args.chips:
            ap.error(f"mesh {d}x{t} is not {args.chips} chips")
    report, t0 = [], time.time()
    print(f"DeepSeek-V3 (FP8 blocks) on {args.chips} x {hw.name}, simulated; {args.n} "
          f"requests a workload, seed {args.seed}; token budgets "
          + ("one for the plan, d times a rank's" if args.global_budget else "a rank's own"))
    print("| workload @ rate | mesh (d, 1, t) | policy | TTFT p50 / p99 (s) | max ITL p99 (ms) "
          "| E2E mean (s) | output tok/s | expert GB / 100 req | padding | imbalance "
          "| link GB / out token | KV tokens / rank | preemptions |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for lengths, rate in (("sharegpt", args.sharegpt_rate), ("arxiv", args.arxiv_rate)):
        requests = synthesize(lengths, args.n, rate, seed=args.seed)
        for d, t in meshes:
            for name, policy, budget in POLICIES:
                p = run_point(shape, hw, (d, t), policy, budget, requests, args.global_budget)
                report.append({"workload": lengths, "rate": rate, "mesh": (d, 1, t),
                               "policy": name, **p})
                print(f"| {lengths} @ {rate:g} | ({d}, 1, {t}) | {name} | {p['ttft_p50']:.2f} / "
                      f"{p['ttft_p99']:.2f} | {1e3 * p['max_itl_p99']:.0f} | "
                      f"{p['e2e_mean']:.1f} | {p['tokens_per_s']:,.0f} | "
                      f"{p['expert_gb_per_100']:,.0f} | {p['padding']:.0%} | "
                      f"{p['imbalance']:.2f} | {p['link_gb_per_token']:.3f} | "
                      f"{p['kv_tokens_per_rank']:,d} | {p['preemptions']:.0f} |", flush=True)
    print(f"({time.time() - t0:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
