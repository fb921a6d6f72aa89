"""Layered against chunked prefill on GLM-4.5 (355B) in the simulator: the paper's panels.

The layered-prefill paper's comparison (launch/reproduce_paper.py) on the `glm-4.5`
preset: its arXiv and ShareGPT-8k workloads with Poisson arrivals, chunked prefill
(512-token budget) against layered prefill (8192-token budget), the same SLOs as the
paper's GPT-OSS panels (TTFT 10 s arXiv / 5 s ShareGPT, max ITL 100 ms). GLM-4.5 in
bf16 (710 GB of weights) does not fit the paper's 2x H100, so the machine is 8x H200
with TP8 (1.1 TB). Per workload: each policy's sustainable rate (>= 90% of requests
meet both SLOs; grid then bisection), and at a common rate (chunked's sustainable rate)
routed-expert traffic per 100 requests, mean TTFT and E2E.

Cost model: the roofline with the GPU prior (lp_jax/sim/calibration.py), Zipf routing
fitted to the paper's Table 1 for Qwen3 and reused at GLM-4.5's E=160, k=8 (an
assumption, lp_jax/roofline/routing.py); the shared expert and the 3 dense first
layers are read every step by both policies and are not expert traffic. Simulated, not
measured: nothing ran on an H200.

    .venv/bin/python launch/sim_glm.py [--out runs/sim_glm] [--workers 2] [--n 300]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lp_jax.roofline import get_hardware  # noqa: E402
from lp_jax.roofline.model_shape import GLM_4_5  # noqa: E402
from lp_jax.sim import prior_calibration, report  # noqa: E402

spec = importlib.util.spec_from_file_location("reproduce_paper", ROOT / "launch/reproduce_paper.py")
rp = importlib.util.module_from_spec(spec)
sys.modules["reproduce_paper"] = rp  # its dataclasses and the worker pool look it up
spec.loader.exec_module(rp)

rp.MODELS["glm"] = GLM_4_5
MACHINE = rp.Machine("h200x8", "h200", tp=8)
COST = rp.Cost(MACHINE, prior_calibration(get_hardware(MACHINE.hardware).name))
# paper_rates only seed the rate grid here (x GRID); GLM-4.5 has no paper figures.
PANELS = (
    rp.Panel("glm-arxiv", "glm", "arxiv", 10.0, 0.100, (1.0, 1.0), False),
    rp.Panel("glm-sharegpt", "glm", "sharegpt", 5.0, 0.100, (3.0, 3.0), False),
)
KEYS = ("slo_attainment", "ttft_mean", "e2e_mean", "expert_gb_per_100_requests", "iterations")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/sim_glm")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--n", type=int, default=300, help="requests per rate point")
    args = ap.parse_args()
    t0 = time.time()
    tasks = [(p, pol, args.n, COST) for p in PANELS for pol in rp.POLICIES]
    results: dict = {}
    with report.pool(args.workers) as pool:
        for key, pol, out in pool.imap_unordered(rp._search, tasks):
            results.setdefault(key, {})[pol] = {"sustainable": out}
    refs = [(p, pol, "common", results[p.key]["chunked"]["sustainable"]["rate"], args.n, COST)
            for p in PANELS for pol in rp.POLICIES]
    with report.pool(args.workers) as pool:
        for key, pol, label, s in pool.imap_unordered(rp._reference, refs):
            results[key][pol][label] = s
    rows = ["| panel | policy | sustainable rate (req/s) | expert GB / 100 req | mean TTFT (s) "
            "| mean E2E (s) | iterations |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for p in PANELS:
        for pol in rp.POLICIES:
            r = results[p.key][pol]
            c = r["common"]
            rows.append(f"| {p.title} @ {c['rate']:.3g} req/s | {pol} | "
                        f"{r['sustainable']['rate']:.3g} | {c['expert_gb_per_100_requests']:,.0f} "
                        f"| {c['ttft_mean']:.2f} | {c['e2e_mean']:.1f} | {c['iterations']:,.0f} |")
        ch, la = (results[p.key][pol]["common"]["expert_gb_per_100_requests"]
                  for pol in rp.POLICIES)
        rows.append(f"| {p.title} | layered vs chunked expert traffic | | {la / ch - 1:+.1%} "
                    "| | | |")
    table = "\n".join(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {p: {pol: {k: results[p][pol]["common"][k] for k in KEYS} | {
        "sustainable_rate": results[p][pol]["sustainable"]["rate"]} for pol in results[p]}
        for p in results}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    print(f"GLM-4.5 (355B, bf16) on {MACHINE.title}, simulated; {args.n} requests a point; "
          f"{time.time() - t0:.0f} s")
    print(table)
    print(f"wrote {out / 'summary.json'}")


if __name__ == "__main__":
    main()
