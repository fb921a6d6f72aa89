"""The paper's four panels on an H200 and a v6e-8 slice, spec prior against the compiled cost.

Issue #26 §4. For each machine (launch/reproduce_paper.py MACHINES: one H200; a TPU v6e 2x4
slice with the experts over 8 chips and attention and the KV pool on every chip) and each
cost model:
- prior:    the analytic cost model with the spec prior (lp_jax/sim/calibration.py: 0.70 of
            peak FLOP/s, 0.85 of HBM bandwidth, 2 ms per iteration, 20 us per layer);
- compiled: the same model scaled per term by the compiled programs' factors
            (lp_jax/sim/compiled_cost.py, files lp_jax/sim/data/compiled/), at the compiled
            roofline's ASSUMED efficiencies (0.6 / 0.8) and the prior's overheads;
it runs Qwen3-30B-A3B and GPT-OSS-20B on arXiv and ShareGPT, chunked-512 against layered
(reproduce_paper's panels and SLOs), and reports the sustainable rate, and at the chunked
policy's sustainable rate (each cost model its own): mean TTFT, mean and p99 ITL over all
token gaps, expert traffic per 100 requests. A third row set prices four single steps
under the prior, the prior's overheads at the assumed efficiencies without factors, and the
compiled cost, to split what the factors change from what the efficiencies change.

The rate search is smaller than reproduce_paper's (grid 0.5-6x the paper's chunked rate,
stopped at the first failure, 3 bisection steps: ~6% resolution).

    .venv/bin/python launch/sim_compiled_panels.py --out runs/compiled_panels [--workers 1]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import reproduce_paper as rp  # noqa: E402

from lp_jax.core.plan import PrefillChunk, StepPlan  # noqa: E402
from lp_jax.core.sequence import Sequence  # noqa: E402
from lp_jax.sim import Calibration, report  # noqa: E402

GRID = (0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # x the paper's chunked rate
BISECT = 3
COSTS = ("prior", "compiled")


def _search(args):
    machine, cost_name, panel, policy, n, cost = args
    grid = [g * panel.paper_rates[0] for g in GRID]
    found, points = report.search_rate(
        lambda rate: rp._point(panel, policy, rate, n, cost), grid, "slo_attainment",
        bisect_steps=BISECT, full_curve=False, max_extensions=4)
    return machine, cost_name, panel.key, policy, found.rate, found.lower_bound_only, points


def _common(args):
    machine, cost_name, panel, policy, n, cost, rate = args
    return machine, cost_name, panel.key, policy, rp._point(panel, policy, rate, n, cost)


def costs_for(machine: str) -> dict[str, dict[str, rp.Cost]]:
    m = rp.MACHINES[machine]
    return {"prior": {k: rp.prior_cost(m) for k in rp.MODELS},
            "compiled": {k: rp.compiled_cost(m, k) for k in rp.MODELS}}


def run(machines, n_for, workers) -> dict:
    costs = {m: costs_for(m) for m in machines}
    tasks = [(m, c, p, pol, n_for[p.workload], costs[m][c][p.model])
             for m in machines for c in COSTS for p in rp.PANELS for pol in rp.POLICIES]
    res: dict = {m: {c: {p.key: {} for p in rp.PANELS} for c in COSTS} for m in machines}
    with report.pool(workers) as pool:
        for m, c, key, pol, rate, lb, points in pool.imap_unordered(_search, tasks):
            res[m][c][key][pol] = {"rate": rate, "lower_bound_only": lb,
                                   "curve": {f"{r:.6g}": s for r, s in sorted(points.items())}}
        refs = []
        for m in machines:
            for c in COSTS:
                for p in rp.PANELS:
                    common = res[m][c][p.key]["chunked"]["rate"] or p.paper_rates[0]
                    res[m][c][p.key]["common_rate"] = common
                    refs += [(m, c, p, pol, n_for[p.workload], costs[m][c][p.model], common)
                             for pol in rp.POLICIES]
        for m, c, key, pol, s in pool.imap_unordered(_common, refs):
            res[m][c][key][pol]["common"] = s
    return res


# ----- single steps: what the factors change, apart from the efficiencies ------------------
def _seqs(n: int, tokens: int, first: int = 0) -> tuple[Sequence, ...]:
    return tuple(Sequence(first + i, [1] * tokens) for i in range(n))


def anchor_steps(machine: str, model: str) -> list[dict]:
    """Seconds of four steps under the prior, the prior's overheads at the compiled
    efficiencies (no factors), and the compiled cost."""
    from lp_jax.sim import Simulator

    costs = costs_for(machine)
    prior, compiled = costs["prior"][model], costs["compiled"][model]
    eff_only = rp.Cost(prior.machine, Calibration(
        compiled.calibration.compute_efficiency, compiled.calibration.bandwidth_efficiency,
        prior.calibration.overhead_s, prior.calibration.layer_overhead_s, "efficiencies only"))
    L = rp.MODELS[model].num_layers
    long = Sequence(999, [1] * 8192)
    steps = {
        "decode 1 x 4096": StepPlan(0, L, decode=_seqs(1, 4096)),
        "decode 32 x 4096": StepPlan(0, L, decode=_seqs(32, 4096)),
        "prefill 512 of 8192 (chunk 4) + 32 decodes x 4096": StepPlan(
            0, L, decode=_seqs(32, 4096), prefill=(PrefillChunk(long, 2048, 2560),),
            prefill_batch_id=0),
        "prefill 8192 whole, all layers": StepPlan(
            0, L, prefill=(PrefillChunk(long, 0, 8192),), prefill_batch_id=0),
    }
    panel = next(p for p in rp.PANELS if p.model == model)
    execs = {name: Simulator(rp._config(panel, "layered", c)).executor
             for name, c in (("prior", prior), ("efficiencies only", eff_only),
                             ("compiled", compiled))}
    return [{"step": s, **{name: ex.run(plan).seconds for name, ex in execs.items()}}
            for s, plan in steps.items()]


# ----- tables ---------------------------------------------------------------------------------
def _f(x, pct=False) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    if pct:
        return f"{100 * x:+.0f}%"
    return f"{x:.3g}" if abs(x) < 1000 else f"{x:,.0f}"


METRICS = (
    ("sustainable rate (req/s)", None, 1.0),
    ("mean TTFT (s)", "ttft_mean", 1.0),
    ("mean ITL (ms)", "itl_mean_all_tokens", 1e3),
    ("p99 ITL (ms)", "itl_p99_all_tokens", 1e3),
    ("expert traffic per 100 requests (GB)", "expert_gb_per_100_requests", 1.0),
)


def table(res: dict, machine: str) -> str:
    head = ("| panel | metric | prior chunked | prior layered | prior change | compiled chunked "
            "| compiled layered | compiled change | compiled / prior (chunked / layered) |")
    lines = [head, "|" + " --- |" * 9]
    for p in rp.PANELS:
        for label, key, scale in METRICS:
            vals = {}
            for c in COSTS:
                r = res[machine][c][p.key]
                for pol in rp.POLICIES:
                    if key is None:
                        v = r[pol]["rate"]
                    else:
                        v = r[pol]["common"].get(key, math.nan) * scale
                    vals[c, pol] = v
            cells = []
            for c in COSTS:
                a, b = vals[c, "chunked"], vals[c, "layered"]
                cells += [_f(a), _f(b), _f((b - a) / a if a else math.nan, True)]
            ratio = [vals["compiled", pol] / vals["prior", pol] if vals["prior", pol] else math.nan
                     for pol in rp.POLICIES]
            lines.append(f"| {p.title} | {label} | " + " | ".join(cells)
                         + f" | {ratio[0]:.2f} / {ratio[1]:.2f} |")
    common = "; ".join(
        f"{p.title}: prior {res[machine]['prior'][p.key]['common_rate']:.2f}, compiled "
        f"{res[machine]['compiled'][p.key]['common_rate']:.2f}" for p in rp.PANELS)
    lb = [f"{m} {c} {k} {pol}" for m in [machine] for c in COSTS for k in res[m][c]
          for pol in rp.POLICIES if res[m][c][k][pol]["lower_bound_only"]]
    lines += ["", f"TTFT, ITL and expert traffic at the chunked sustainable rate (req/s) of "
              f"each cost model: {common}."]
    if lb:
        lines.append("Lower bounds only (the search never failed): " + ", ".join(lb) + ".")
    return "\n".join(lines)


def anchor_table(anchors: dict) -> str:
    lines = ["| machine | model | step | prior (ms) | assumed efficiencies, no factors (ms) | "
             "compiled (ms) | compiled / prior |", "|" + " --- |" * 7]
    for (m, model), rows in anchors.items():
        for r in rows:
            lines.append(f"| {m} | {rp.MODELS[model].name} | {r['step']} | "
                         f"{1e3 * r['prior']:.2f} | {1e3 * r['efficiencies only']:.2f} | "
                         f"{1e3 * r['compiled']:.2f} | {r['compiled'] / r['prior']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/compiled_panels")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--machines", default="h200,v6e-8")
    ap.add_argument("--sharegpt-requests", type=int, default=500)
    ap.add_argument("--arxiv-requests", type=int, default=300)
    args = ap.parse_args()
    machines = [m for m in args.machines.split(",") if m]
    bad = [m for m in machines if m not in rp.MACHINES]
    if bad:
        ap.error(f"unknown machines {bad}; known: {sorted(rp.MACHINES)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    n_for = {"sharegpt": args.sharegpt_requests, "arxiv": args.arxiv_requests}
    t0 = time.perf_counter()
    anchors = {(m, k): anchor_steps(m, k) for m in machines for k in rp.MODELS}
    res = run(machines, n_for, args.workers)
    wall = time.perf_counter() - t0
    md = [anchor_table(anchors), ""]
    for m in machines:
        md += [f"### {rp.MACHINES[m].title}", "", table(res, m), ""]
    md.append(f"{n_for['sharegpt']} ShareGPT / {n_for['arxiv']} arXiv requests per point, "
              f"seed {rp.SEED}; {wall:.0f} s wall with {args.workers} worker(s).")
    text = "\n".join(md)
    print(text)
    (out / "results.md").write_text(text + "\n")
    payload = {"results": res, "anchors": {f"{m}/{k}": v for (m, k), v in anchors.items()},
               "requests": n_for, "grid": GRID, "bisect_steps": BISECT, "wall_s": wall}
    (out / "results.json").write_text(json.dumps(rp._clean(payload), indent=1))
    print(f"wrote {out}/results.md, results.json")


if __name__ == "__main__":
    main()
