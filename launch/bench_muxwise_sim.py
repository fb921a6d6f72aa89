"""MuxWise (papers.md section 3) against chunked, layered, adaptive layered and FlowPrefill
in the simulator: sustainable rate and goodput at 90% SLO attainment.

Workloads, all on the layered-prefill paper's hardware model (2x H100 SXM, TP2, the GPU
prior calibration of lp_jax/sim/calibration.py) and one scheduler core:
- the layered-prefill paper's four panels (launch/reproduce_paper.py: Qwen3-30B-A3B and
  GPT-OSS-20B x arXiv and ShareGPT, Poisson arrivals, TTFT 10 s / 5 s, TBT 125 / 100 ms);
  a request passes iff TTFT and every inter-token gap meet them;
- multi-SLO, co-located: FlowPrefill's QwenTrace-like classes (lp_jax/sim/workload.py
  QWENTRACE; prompt lengths of one class ASSUMED, weights, k and outputs ASSUMED) with
  lognormal outputs, on Qwen3-30B-A3B; each class's TTFT SLO is k x the solo TTFT of its
  median prompt (one whole-prompt step), the TBT SLO Qwen's 125 ms for every class; a
  request passes iff it meets its class's TTFT SLO and the TBT SLO.

Policies: chunked-512 (Sarathi-Serve), layered (8192 budget, G = ceil(tokens / 512)),
layered with `layer_groups="adaptive"` (each iteration's span the most layers whose
predicted step meets the TBT SLO x (1 - 0.1)), FlowPrefill (operator segments, slack-aware
EDF; decodes ride with the group starts), and MuxWise (lp_jax/sim/muxwise.py: SM
partitions, layer-wise launches; its constants are ASSUMED, see that module);
`--policies muxwise-bw-linear` runs MuxWise with HBM bandwidth proportional to the SM
share (a sensitivity run).

Fair baselines and MuxWise variants (issue #30 finding 5):
- chunked-tbt: chunked prefill whose token budget is sized to the TBT SLO: the largest
  multiple of 128 tokens whose step, as the engine's estimator (warmed as below) predicts
  it beside `TBT_DECODES` (32, ASSUMED) decodes at the workload's mean context (mean
  prompt + half the mean output), stays within the TBT SLO x 0.9 (the margin adaptive
  layered uses);
- layered-g2 / -g4 / -g8 / -g16: layered with a fixed number of groups G (the fixed-G
  sweep);
- muxwise-est (sync launches) and muxwise-est-async: MuxWise on the engine's estimator
  (lp_jax/sim/muxwise_predict.py) with 5% step-time noise; muxwise-async: the oracle with
  async launches;
- any MuxWise spec may add `:field=value` overrides of MuxWiseOptions, e.g.
  `muxwise-est-async:bandwidth_saturation=0.2:sync_s=0.0002` (the sensitivity sweep, whose
  table `--sensitivity` adds: each variant's rate against its base spec).

The estimator-driven policies (FlowPrefill, adaptive layered, chunked-tbt's budget)
get a latency model warmed by a simulated profiling run with 8 output tokens a request,
then frozen (`--online-latency` keeps it learning; slower). Every policy pays
`--segment-overhead-us` (50 us) instead of the 2 ms per-iteration overhead for a plan that
only continues a prefill inside the stack (as bench_flowprefill_sim.py); MuxWise's prefill
launches next to decodes pay its 50 us launch overhead.

Per (workload, policy): attainment over a coarse rate grid (panels: multiples of the paper's
chunked rate; multi-SLO: fractions of a capacity estimate) up to the first failing rate,
then bisection (`lp_jax.sim.slo.sustainable_rate`). Goodput at the sustainable rate:
requests / s that meet their SLOs (rate x attainment) and their output tokens / s.

Requests per point: those arriving in a `--window-s` window (default 30 s: 3-6x the TTFT
SLOs, so a rate the system cannot sustain builds a queue that fails them; with a fixed
count, a fast policy passes any rate by draining the whole burst within the TTFT SLO),
clamped to [200, 2000]; `--requests N` fixes the count instead. Every rate point replays a
prefix of one seeded request sequence, arrivals compressed in time.

    .venv/bin/python launch/bench_muxwise_sim.py --out runs/muxwise_sim
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from launch.reproduce_paper import HARDWARE, MODELS, PANELS, TP  # noqa: E402
from lp_jax.core.metrics import percentile  # noqa: E402
from lp_jax.core.slo import SLO  # noqa: E402
from lp_jax.sim import (  # noqa: E402
    QWENTRACE,
    MuxWiseOptions,
    Request,
    SimConfig,
    Simulator,
    class_slos,
    multi_slo_requests,
    report,
    solo_ttft,
    synthesize,
    warm_latency,
)

TARGET = 0.9
MULTI_TBT = 0.125  # the layered paper's Qwen TBT SLO, for every multi-SLO class
POLICIES: dict[str, dict] = {
    "chunked-512": {"policy": "chunked", "max_num_batched_tokens": 512},
    "layered": {"policy": "layered"},
    "layered-adaptive": {"policy": "layered", "layer_groups": "adaptive"},
    "flowprefill": {"policy": "flowprefill", "preemption_granularity": "operator"},
    "muxwise": {"policy": "muxwise"},
    # sensitivity: HBM bandwidth proportional to the SM share (no saturation)
    "muxwise-bw-linear": {"policy": "muxwise",
                          "muxwise": MuxWiseOptions(bandwidth_saturation=1.0)},
    # fair baselines (module note)
    "chunked-tbt": {"policy": "chunked"},  # budget sized per workload (tbt_budget)
    **{f"layered-g{g}": {"policy": "layered", "layer_groups": g} for g in (2, 4, 8, 16)},
    # MuxWise on the engine's estimator, sync and async launches, and the oracle async
    "muxwise-est": {"policy": "muxwise",
                    "muxwise": MuxWiseOptions(predictor="estimator", noise=0.05)},
    "muxwise-est-async": {"policy": "muxwise",
                          "muxwise": MuxWiseOptions(predictor="estimator", noise=0.05,
                                                    launches="async")},
    "muxwise-async": {"policy": "muxwise", "muxwise": MuxWiseOptions(launches="async")},
}
DEFAULT_POLICIES = "chunked-512,layered,layered-adaptive,flowprefill,muxwise"
FAIR_POLICIES = ("chunked-512,chunked-tbt,layered,layered-g2,layered-g4,layered-g8,layered-g16,"
                 "layered-adaptive,muxwise,muxwise-async,muxwise-est,muxwise-est-async")
SENSITIVITY = tuple(f"muxwise-est-async:{kv}" for kv in (
    "bandwidth_saturation=0.2", "bandwidth_saturation=0.6", "bandwidth_saturation=1.0",
    "sync_s=0", "sync_s=0.0002", "sync_s=0.002", "launch_overhead_s=0.0002",
    "launch_overhead_s=0.001", "noise=0", "noise=0.1", "noise=0.2", "guard=0.8", "guard=1.0",
    "sm_steps=8", "sm_steps=32", "preempt_ratio=0"))
ESTIMATOR_DRIVEN = ("flowprefill", "layered-adaptive", "chunked-tbt")
TBT_DECODES = 32  # decodes the TBT-sized chunk must protect (ASSUMED)
PANEL_GRID = (1.0, 2.0, 3.0, 4.0, 5.0, 6.5)  # x the paper's chunked rate
MULTI_GRID = (0.1, 0.2, 0.3, 0.45, 0.6, 0.8)  # x the capacity estimate
SEED = 0


# ----- workloads -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    key: str
    title: str
    model: str  # key of reproduce_paper.MODELS
    tbt_slo: float
    ttft_slo: float | None  # None: per class (multi-SLO)
    grid: tuple[float, ...]  # req/s
    slos: dict | None = None  # class -> SLO (multi-SLO)
    paper_rates: tuple[float, float] | None = None  # layered paper: chunked, layered
    max_model_len: int = 32768

    def requests(self, rate: float, n: int, pool: int) -> list[Request]:
        """The first n of `pool` requests drawn at `rate` (one seed: every rate point
        replays a prefix of the same sequence, arrivals compressed in time)."""
        pool = max(pool, n)
        if self.slos is None:
            slo = SLO(self.ttft_slo, self.tbt_slo, self.key)
            reqs = synthesize(self.workload_name, pool, rate, seed=SEED)[:n]
            return [replace(r, slo=slo) for r in reqs]
        return multi_slo_requests(QWENTRACE, self.slos, pool, rate, seed=SEED,
                                  colocated=True)[:n]

    @property
    def workload_name(self) -> str:
        return self.key.split("-")[1]


def panel_workloads() -> list[Workload]:
    return [Workload(p.key, p.title, p.model, p.tbt_slo, p.ttft_slo,
                     tuple(g * p.paper_rates[0] for g in PANEL_GRID),
                     paper_rates=p.paper_rates) for p in PANELS]  # fmt: skip


def multi_slo_workload() -> tuple[Workload, dict]:
    """Qwen3-30B-A3B + QwenTrace classes, co-located; SLOs from solo TTFTs."""
    base = SimConfig(shape=MODELS["qwen"], hardware=HARDWARE, tp=TP, policy="orca",
                     max_model_len=40960)
    slo_ttft = class_slos(QWENTRACE, lambda n: solo_ttft(base, n))
    slos = {k: SLO(v.ttft_s, MULTI_TBT, k) for k, v in slo_ttft.items()}
    w = sum(c.weight for c in QWENTRACE)
    mean_s = sum(c.weight * solo_ttft(base, round(c.prompt_mean)) for c in QWENTRACE) / w
    capacity = 1.0 / mean_s
    info = {"capacity_rps": capacity,
            "classes": {c.name: {"prompt_mean": c.prompt_mean, "weight": c.weight,
                                 "k": c.slo_k, "ttft_slo_ms": 1e3 * slos[c.name].ttft_s}
                        for c in QWENTRACE}}  # fmt: skip
    wl = Workload("qwen-multislo", "Qwen3-30B-A3B + QwenTrace classes (co-located)", "qwen",
                  MULTI_TBT, None, tuple(g * capacity for g in MULTI_GRID), slos=slos,
                  max_model_len=40960)  # fmt: skip
    return wl, info


def passes(wl: Workload, r: Request, m) -> bool:
    ttft = wl.ttft_slo if wl.ttft_slo is not None else r.slo.ttft_s
    return m.ttft is not None and m.ttft <= ttft and m.max_itl <= wl.tbt_slo


# ----- one (workload, policy) -----------------------------------------------------------------
def policy_options(spec: str) -> dict:
    """SimConfig options of a policy spec: a POLICIES key, then `:field=value` overrides of
    MuxWiseOptions for a MuxWise spec."""
    base, *over = spec.split(":")
    if base not in POLICIES:
        raise ValueError(f"unknown policy {base!r}; known: {', '.join(POLICIES)}")
    opts = dict(POLICIES[base])
    if over:
        if opts["policy"] != "muxwise":
            raise ValueError(f"{spec!r}: only MuxWise specs take overrides")
        kv = {}
        for item in over:
            k, sep, v = item.partition("=")
            if not sep or k not in MuxWiseOptions.__dataclass_fields__:
                raise ValueError(f"{spec!r}: {item!r} is not field=value of MuxWiseOptions")
            cur = getattr(MuxWiseOptions(), k)
            kv[k] = v if isinstance(cur, str) else type(cur)(float(v))
        opts["muxwise"] = replace(opts.get("muxwise") or MuxWiseOptions(), **kv)
    return opts


def tbt_budget(wl: Workload, latency, shape) -> int:
    """The largest multiple of 128 prompt tokens whose chunked step beside TBT_DECODES
    decodes at the workload's mean context is predicted within 0.9 x the TBT SLO."""
    reqs = wl.requests(1.0, 200, 200)
    ctx = int(sum(r.prompt_len + r.output_len / 2 for r in reqs) / len(reqs))
    B, units = TBT_DECODES, 2 * shape.num_layers

    def fits(c: int) -> bool:
        x = latency.features([(c, 0)], 0, units, B, B * ctx)
        return latency.predict(x, B, c) <= 0.9 * wl.tbt_slo

    lo, hi = 1, 128  # in units of 128 tokens
    if not fits(128):
        return 128
    while hi < wl.max_model_len // 128 and fits(128 * hi):
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(128 * mid) else (lo, mid)
    return 128 * lo


def sim_config(wl: Workload, policy: str, args) -> SimConfig:
    opts = policy_options(policy)
    cfg = SimConfig(shape=MODELS[wl.model], hardware=HARDWARE, tp=TP, tbt_slo_s=wl.tbt_slo,
                    max_model_len=wl.max_model_len,
                    segment_overhead_s=args.segment_overhead_us * 1e-6, **opts)
    if policy in ESTIMATOR_DRIVEN:
        warm = warm_latency(cfg if policy != "chunked-tbt"
                            else replace(cfg, max_num_batched_tokens=8192), output_len=8)
        cfg = replace(cfg, latency=warm, observe_latency=args.online_latency)
        if policy == "chunked-tbt":
            cfg = replace(cfg, max_num_batched_tokens=tbt_budget(wl, warm, cfg.shape))
    return cfg


def point(wl: Workload, cfg: SimConfig, rate: float, n: int, pool: int) -> dict:
    reqs = wl.requests(rate, n, pool)
    try:
        res = Simulator(cfg).run(reqs)
    except RuntimeError as e:  # a scheduler that gets stuck scores 0
        if "stuck" not in str(e):
            raise
        return {"rate": rate, "attainment": 0.0, "stuck": True}
    ok = [passes(wl, r, m) for r, m in zip(reqs, res.metrics, strict=True)]
    att = sum(ok) / len(reqs)
    s = res.summary()
    out = {
        "rate": rate,
        "requests": len(reqs),
        "attainment": att,
        "goodput_rps": rate * att,
        "goodput_tokens_per_s": sum(m.num_tokens for m, k in zip(res.metrics, ok, strict=True)
                                    if k) / res.span_s,
        "tbt_attainment": sum(m.max_itl <= wl.tbt_slo for m in res.metrics) / len(reqs),
        "ttft_mean": s["ttft_mean"],
        "ttft_p99": s["ttft_p99"],
        "max_itl_p99": s["max_itl_p99"],
        "itl_p99_all_tokens": percentile([g for m in res.metrics for g in m.itls], 99),
        "e2e_mean": s["e2e_mean"],
        "expert_gb_per_100_requests": s["expert_gb_per_100_requests"],
        "mj_per_token": s["mj_per_token"],
        "wall_s": res.wall_s,
    }
    out.update(res.extra)
    return out


def num_requests(rate: float, args) -> int:
    """Requests at one rate point: --requests if given, else those arriving in --window-s
    seconds, within [--min-requests, --max-requests]."""
    if args.requests:
        return args.requests
    return int(min(max(round(rate * args.window_s), args.min_requests), args.max_requests))


def search(task) -> tuple[str, str, dict]:
    wl, policy, args = task
    t0 = time.perf_counter()
    cfg = sim_config(wl, policy, args)

    def measure(rate: float) -> dict:
        n = num_requests(rate, args)
        return point(wl, cfg, rate, n, max(n, args.max_requests))

    found, points = report.search_rate(measure, wl.grid, "attainment", target=TARGET,
                                       bisect_steps=args.bisect_steps,
                                       max_extensions=args.max_extensions, full_curve=False)
    out = {
        "rate": found.rate,
        "budget": cfg.max_num_batched_tokens,
        "lower_bound_only": found.lower_bound_only,
        "at_rate": points.get(found.rate),
        "curve": [points[r] for r in sorted(points)],
        "wall_s": time.perf_counter() - t0,
    }
    print(f"  {wl.key} / {policy}: {found.rate:.2f} req/s ({out['wall_s']:.0f} s)",
          file=sys.stderr, flush=True)
    return wl.key, policy, out


# ----- report --------------------------------------------------------------------------------
def _rate(r: dict) -> str:
    return report.rate_cell(r["rate"], r["lower_bound_only"], r["curve"][0]["rate"])


def _x(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def markdown(results: dict, workloads: list[Workload], policies: list[str], meta: dict) -> str:
    lines = [f"## MuxWise in the simulator ({meta['requests']}, seed {SEED})",
             "", "Sustainable rate (req/s, >= 90% of requests meet TTFT and TBT SLOs):", "",
             "| workload | " + " | ".join(policies) + " | muxwise / chunked | muxwise / layered |"
             " paper chunked, layered |",
             "| --- | " + " | ".join(["---:"] * (len(policies) + 3)) + " |"]
    for wl in workloads:
        res = results[wl.key]
        cells = [_rate(res[p]) for p in policies]
        mux = res.get("muxwise", {}).get("rate", 0)
        ratios = [_x(mux, res[b]["rate"]) if b in res else "-" for b in ("chunked-512", "layered")]
        paper = "-" if wl.paper_rates is None else "{:g}, {:g}".format(*wl.paper_rates)
        lines.append(f"| {wl.title} | " + " | ".join(cells + ratios) + f" | {paper} |")
    lines += ["", "Goodput at each policy's sustainable rate: SLO-meeting requests / s and "
              "their output tokens / s.", "",
              "| workload | " + " | ".join(policies) + " |",
              "| --- | " + " | ".join(["---:"] * len(policies)) + " |"]
    for wl in workloads:
        cells = []
        for p in policies:
            a = results[wl.key][p]["at_rate"]
            cells.append("-" if not a else
                         f"{a['goodput_rps']:.2f} / {a['goodput_tokens_per_s']:.0f}")
        lines.append(f"| {wl.title} | " + " | ".join(cells) + " |")
    lines += _detail_table(results, workloads, policies)
    lines += _muxwise_table(results, workloads, policies)
    lines += _fair_table(results, workloads, policies)
    lines += _sensitivity_table(results, workloads, policies)
    return "\n".join(lines + [""])


def _detail_table(results: dict, workloads: list[Workload], policies: list[str]) -> list[str]:
    lines = ["", "At each policy's sustainable rate: mean / p99 TTFT (s), p99 of the largest "
             "gap (ms), expert GB per 100 requests, mJ per token.", "",
             "| workload | policy | TTFT mean | TTFT p99 | max-ITL p99 ms | expert GB/100 | "
             "mJ/token |", "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    return lines + _at_rate_rows(results, workloads, policies, lambda a: [
        report.cell(a["ttft_mean"], ".2f"), report.cell(a["ttft_p99"], ".2f"),
        report.cell(1e3 * a["max_itl_p99"], ".0f"),
        report.cell(a["expert_gb_per_100_requests"], ".0f"),
        report.cell(a["mj_per_token"], ".1f")])


def _best(res: dict, names: list[str]) -> tuple[str, float]:
    """(policy, rate) of the best of `names` that ran."""
    got = [(res[p]["rate"], p) for p in names if p in res]
    if not got:
        return "-", 0.0
    rate, p = max(got)
    return p, rate


def _fair_table(results: dict, workloads: list[Workload], policies: list[str]) -> list[str]:
    """MuxWise variants against the best baseline that spends the TBT slack."""
    base = [p for p in policies if not p.startswith("muxwise")]
    fixed_g = [p for p in base if p.startswith("layered-g")]
    muxes = [p for p in policies if p.startswith("muxwise") and ":" not in p]
    if not (base and muxes):
        return []
    lines = ["", "Fair baselines: the TBT-sized chunk budget, the best fixed G, the best "
             "baseline of all, and each MuxWise variant's rate against that best baseline.",
             "", "| workload | chunked-tbt budget | best fixed G | best baseline | "
             + " | ".join(f"{m} / best" for m in muxes) + " |",
             "| --- | ---: | --- | --- | " + " | ".join(["---:"] * len(muxes)) + " |"]
    for wl in workloads:
        res = results[wl.key]
        budget = str(res["chunked-tbt"].get("budget")) if "chunked-tbt" in res else "-"
        g, g_rate = _best(res, fixed_g)
        b, b_rate = _best(res, base)
        cells = [_x(res[m]["rate"], b_rate) for m in muxes]
        lines.append(report.row([wl.title, budget, f"{g} ({g_rate:.2f})" if g_rate else "-",
                                 f"{b} ({b_rate:.2f})" if b_rate else "-", *cells]))
    return lines


def _sensitivity_table(results: dict, workloads: list[Workload],
                       policies: list[str]) -> list[str]:
    """Each `base:overrides` spec's rate against its base spec's."""
    variants = [p for p in policies if ":" in p]
    if not variants:
        return []
    lines = ["", "Sensitivity: sustainable rate of each override (its ratio to the base "
             "spec).", "", "| variant | " + " | ".join(wl.title for wl in workloads) + " |",
             "| --- | " + " | ".join(["---:"] * len(workloads)) + " |"]
    for v in variants:
        base = v.split(":")[0]
        cells = []
        for wl in workloads:
            res = results[wl.key]
            r, b = res[v]["rate"], res.get(base, {}).get("rate", 0.0)
            cells.append(f"{r:.2f} ({_x(r, b)})")
        lines.append(report.row([v.split(":", 1)[1].replace(":", ", "), *cells]))
    return lines


def _muxwise_table(results: dict, workloads: list[Workload], policies: list[str]) -> list[str]:
    muxes = [p for p in policies if p.startswith("muxwise")]
    if not muxes:
        return []
    lines = ["", "MuxWise at its sustainable rate: mean prefill SM share next to decodes, "
             "operator units per launch, repartitions, short-request preemptions, plans "
             "where no share met the TBT target, the share of requests whose every gap met "
             "the TBT SLO, and the mean error of the predicted decode / prefill finish.", "",
             "| workload | variant | prefill share | units / launch | repartitions | "
             "short preemptions | no share fits | TBT met | decode / prefill error |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    nan = float("nan")
    return lines + _at_rate_rows(results, workloads, muxes, lambda a: [
        report.cell(a["muxwise_mean_prefill_share"], ".2f"),
        report.cell(a["muxwise_units_per_launch"], ".1f"), f"{a['muxwise_repartitions']:.0f}",
        f"{a['muxwise_short_preemptions']:.0f}", f"{a['muxwise_fallback_partitions']:.0f}",
        report.cell(a["tbt_attainment"], ".3f"),
        f"{report.cell(a.get('muxwise_decode_pred_error', nan), '.3f')} / "
        f"{report.cell(a.get('muxwise_prefill_pred_error', nan), '.3f')}"])


def _at_rate_rows(results: dict, workloads: list[Workload], policies: list[str],
                  cells) -> list[str]:
    """A row per (workload, policy) that ran at its sustainable rate: the workload, the
    policy, then `cells(its point there)`."""
    return [report.row([wl.title, p, *cells(a)]) for wl in workloads for p in policies
            for a in [results[wl.key][p]["at_rate"]] if a and not a.get("stuck")]


def _requests_text(args) -> str:
    if args.requests:
        return f"{args.requests} requests per point"
    return (f"rate x {args.window_s:g} s of arrivals per point, {args.min_requests}-"
            f"{args.max_requests} requests")


def write_csv(results: dict, path: Path) -> None:
    rows = [(wk, p, pt["rate"], pt["attainment"]) for wk, by in results.items()
            for p, r in by.items() for pt in r["curve"]]
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["workload", "policy", "rate_rps", "attainment"])
        w.writerows(rows)


def plot(results: dict, workloads: list[Workload], policies: list[str], path: Path) -> bool:
    try:
        plt = report.pyplot()
    except ImportError:
        return False
    panels = [{"title": wl.title, "legend": {"fontsize": 7},
               "curves": [([pt["rate"] for pt in r["curve"]],
                           [100 * pt["attainment"] for pt in r["curve"]],
                           {"ms": 3, "label": f"{p} ({_rate(r)})"})
                          for p in policies for r in [results[wl.key][p]]]}
              for wl in workloads]  # fmt: skip
    report.plot_attainment(path, panels, grid=(2, 3), figsize=(15, 8), dpi=110,
                           target_pct=100 * TARGET, plt=plt,
                           title="SLO attainment vs rate: MuxWise and the layered-prefill "
                           "baselines (simulated 2x H100, TP2)")
    return True


# ----- driver --------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/muxwise_sim")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--requests", type=int, default=None,
                    help="a fixed number of requests per rate point (default: a window)")
    ap.add_argument("--window-s", type=float, default=30.0,
                    help="arrival window per rate point: rate x window requests")
    ap.add_argument("--min-requests", type=int, default=200)
    ap.add_argument("--max-requests", type=int, default=2000)
    ap.add_argument("--policies", default=DEFAULT_POLICIES,
                    help="comma-separated specs, or 'fair' for the fair-baseline set")
    ap.add_argument("--sensitivity", action="store_true",
                    help="add the sensitivity specs (and their base muxwise-est-async)")
    ap.add_argument("--workloads", default="panels,multislo", help="panels, multislo or keys")
    ap.add_argument("--bisect-steps", type=int, default=4)
    ap.add_argument("--max-extensions", type=int, default=5,
                    help="x1.5 steps past the grid while every rate passes")
    ap.add_argument("--segment-overhead-us", type=float, default=50.0)
    ap.add_argument("--online-latency", action="store_true",
                    help="keep the estimator-driven policies' latency model learning")
    return ap.parse_args(argv)


def select_workloads(spec: str) -> tuple[list[Workload], dict]:
    want = spec.split(",")
    out = [w for w in panel_workloads() if "panels" in want or w.key in want]
    info = {}
    if "multislo" in want or "qwen-multislo" in want:
        wl, info = multi_slo_workload()
        out.append(wl)
    return out, info


def main(argv=None) -> dict:
    args = parse_args(argv)
    t0 = time.perf_counter()
    spec = FAIR_POLICIES if args.policies == "fair" else args.policies
    policies = [p for p in spec.split(",") if p]
    if args.sensitivity:
        policies += [p for p in ("muxwise-est-async", *SENSITIVITY) if p not in policies]
    for p in policies:
        policy_options(p)  # a bad spec fails before any run
    workloads, multi_info = select_workloads(args.workloads)
    tasks = [(wl, p, args) for wl in workloads for p in policies]
    results: dict[str, dict] = {wl.key: {} for wl in workloads}
    with report.pool(args.workers) as pool:
        for key, p, out in pool.imap_unordered(search, tasks):
            results[key][p] = out
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"requests": _requests_text(args), "multi_slo": multi_info,
            "wall_s": time.perf_counter() - t0, "args": vars(args)}
    md = markdown(results, workloads, policies, meta)
    write_csv(results, out_dir / "muxwise_sim_curves.csv")
    if plot(results, workloads, policies, out_dir / "muxwise_sim_attainment.png"):
        md += "\nAttainment against rate: muxwise_sim_attainment.png\n"
    (out_dir / "muxwise_sim.md").write_text(md)
    saved = {"meta": meta, "results": results}
    (out_dir / "muxwise_sim.json").write_text(json.dumps(saved, indent=1, default=str))
    print(md)
    print(f"total {meta['wall_s']:.0f} s", file=sys.stderr)
    return saved


if __name__ == "__main__":
    main()
