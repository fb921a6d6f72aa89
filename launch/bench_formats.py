"""How the weight and KV formats move the MoE ridge, the knee and layered prefill's gain.

For bf16, fp8 (= int8 for bytes: 1 B a weight plus a float32 scale per output channel)
and fp4 (MXFP4: 0.5 B plus an e8m0 byte per 32 weights) on H100, H200, TPU v5e and v6e
(lp_jax/roofline/formats.py has the stored-byte rules and where they come from), print:

- the chip's ridge point (bf16 peak / HBM bandwidth: the kernels run W8A16 / W4A16, so
  the FLOP rate is the bf16 one whatever the format; no int8-MXU variant, as the hardware
  table carries no int8 figure);
- for Qwen3-30B-A3B and GPT-OSS-20B, the tokens per layer step at which the expert GEMMs
  turn compute-bound in the paper's simple form ridge * E * w / (2k) (w = stored bytes per
  expert weight), and the knee in the exact form (only E_act(T) experts loaded, routed rows
  moved in bf16; Zipf routing fitted to the paper's Table 1), `ridge.compute_bound_tokens`;
- the layered-vs-chunked gain on one paper panel, Qwen3-30B-A3B + arXiv (TTFT 10 s, max
  ITL 125 ms, >= 90% passing both): the sustainable rate of chunked-512 and of layered
  (budget 8192, G = ceil(L / 512)) in the simulator, as launch/reproduce_paper.py computes
  it (rate grid 0.5 .. 16 req/s doubling, then 5 bisection steps: ~3% resolution), with
  the GPU prior calibration on every chip. Weights / KV: bf16 / bf16, fp8 / bf16 (the
  weights alone), fp8 / fp8 and fp4 / fp8 (the serving configurations); the chip count per
  chip type is the fewest (TP 2, 4 or 8) that holds the bf16 model with KV room, the same
  for every format so that only the bytes move.

One table on stdout (markdown) and one PNG. A few minutes on 2 CPU cores:

    .venv/bin/python launch/bench_formats.py [--out runs/formats] [--requests 300]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lp_jax.roofline import GPT_OSS_20B, QWEN3_30B_A3B, get_hardware  # noqa: E402
from lp_jax.roofline.model_shape import ModelShape  # noqa: E402
from lp_jax.roofline.ridge import compute_bound_tokens  # noqa: E402
from lp_jax.roofline.routing import ZipfRouting  # noqa: E402
from lp_jax.sim import SimConfig, Simulator, prior_calibration, report, synthesize  # noqa: E402
from lp_jax.sim.simulator import derive_num_pages, kv_bytes_per_token  # noqa: E402

HARDWARE = ("H100 SXM", "H200 SXM", "TPU v5e", "TPU v6e")
FORMATS = (("bf16", "bf16"), ("fp8", "bf16"), ("fp8", "fp8"), ("fp4", "fp8"))  # (weights, KV)
MODELS = (QWEN3_30B_A3B, GPT_OSS_20B)
TTFT_SLO, TBT_SLO = 10.0, 0.125  # the Qwen3 + arXiv panel
GRID = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0)  # req/s
SEED = 0


def chips_for(shape: ModelShape, hw_name: str) -> int:
    """Fewest TP chips (2, 4, 8) whose HBM holds the bf16 model and some KV."""
    hw = get_hardware(hw_name)
    for tp in (2, 4, 8):
        try:
            pages = derive_num_pages(SimConfig(shape=shape, hardware=hw, tp=tp))
        except ValueError:
            continue
        if pages * 16 >= 64 * 1024:  # room for at least 64k tokens
            return tp
    raise ValueError(f"{shape.name} does not fit 8 x {hw_name}")


def _attainment(shape, hw, tp, policy, rate, n) -> float:
    reqs = synthesize("arxiv", n, rate, seed=SEED)
    cfg = SimConfig(shape=shape, hardware=hw, policy=policy, tp=tp,
                    calibration=prior_calibration(hw.name))
    return Simulator(cfg).run(reqs).summary(TTFT_SLO, TBT_SLO)["slo_attainment"]


def _gain(task) -> tuple[str, str, str, float, bool]:
    hw_name, wfmt, kvfmt, policy, tp, n = task
    hw = get_hardware(hw_name)
    shape = QWEN3_30B_A3B.with_formats(wfmt, kvfmt)
    found, _ = report.search_rate(
        lambda r: {"a": _attainment(shape, hw, tp, policy, r, n)}, GRID, "a",
        bisect_steps=5, max_extensions=4, growth=2.0)
    return hw_name, f"{wfmt}/{kvfmt}", policy, found.rate, found.lower_bound_only


def analytic_rows() -> list[dict]:
    zipf = ZipfRouting()
    rows = []
    for hw_name in HARDWARE:
        hw = get_hardware(hw_name)
        for wfmt, kvfmt in FORMATS:
            row = {"hardware": hw.name, "weights": wfmt, "kv": kvfmt, "ridge": hw.ridge_point}
            for base in MODELS:
                shape = base.with_formats(wfmt, kvfmt)
                cb = compute_bound_tokens(shape, hw, routing=zipf)
                key = "qwen" if base is QWEN3_30B_A3B else "gpt"
                row[f"{key}_w"] = shape.expert_weight_itemsize
                row[f"{key}_simple"] = cb.simple_tokens
                row[f"{key}_knee"] = cb.exact_tokens
            qwen = QWEN3_30B_A3B.with_formats(wfmt, kvfmt)
            tp = chips_for(QWEN3_30B_A3B, hw_name)
            row["tp"] = tp
            row["kv_tokens"] = derive_num_pages(SimConfig(shape=qwen, hardware=hw, tp=tp)) * 16
            row["kv_bytes_per_token"] = kv_bytes_per_token(qwen, tp)
            rows.append(row)
    return rows


def _f(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:,.0f}"


def _rate(x: float | None, lower: bool) -> str:
    return "-" if x is None else f"{x:.3g}" + ("+" if lower else "")


def markdown(rows: list[dict]) -> str:
    head = (
        "| chip | weights / KV | ridge FLOP/B | Qwen3 w B | Qwen3 T* simple | Qwen3 knee T |"
        " GPT-OSS T* simple | GPT-OSS knee T | Qwen3 chips | KV tokens | chunked req/s |"
        " layered req/s | layered gain |\n" + "|---" * 13 + "|\n"
    )
    lines = []
    for r in rows:
        c, lay = r.get("chunked"), r.get("layered")
        gain = f"{100 * (lay - c) / c:+.0f}%" if c and lay else "-"
        lines.append(
            f"| {r['hardware']} | {r['weights']} / {r['kv']} | {r['ridge']:.1f} |"
            f" {r['qwen_w']:.4f} | {_f(r['qwen_simple'])} | {_f(r['qwen_knee'])} |"
            f" {_f(r['gpt_simple'])} | {_f(r['gpt_knee'])} | {r['tp']} |"
            f" {r['kv_tokens'] / 1e3:,.0f}k |"
            f" {_rate(c, r.get('chunked_lb'))} | {_rate(lay, r.get('layered_lb'))} |"
            f" {gain} |"
        )
    return head + "\n".join(lines)


def plot(rows: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(FORMATS)
    for i, (wfmt, kvfmt) in enumerate(FORMATS):
        sel = [r for r in rows if (r["weights"], r["kv"]) == (wfmt, kvfmt)]
        xs = [j + (i - (len(FORMATS) - 1) / 2) * width for j in range(len(sel))]
        ax1.bar(xs, [r["qwen_knee"] for r in sel], width, label=f"{wfmt} / {kvfmt}")
        gains = [100 * (r["layered"] - r["chunked"]) / r["chunked"] if r.get("chunked") else 0
                 for r in sel]
        ax2.bar(xs, gains, width, label=f"{wfmt} weights / {kvfmt} KV")
    for ax in (ax1, ax2):
        ax.set_xticks(range(len(HARDWARE)))
        ax.set_xticklabels(HARDWARE)
        ax.legend()
    ax1.set_ylabel("tokens per layer step")
    ax1.set_title("Qwen3-30B-A3B MoE knee (exact form, Zipf routing)")
    ax2.set_ylabel("layered vs chunked sustainable rate (%)")
    ax2.set_title("Qwen3-30B-A3B + arXiv, simulator (GPU prior)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/formats"))
    ap.add_argument("--requests", type=int, default=300, help="arXiv requests per rate point")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--no-sim", action="store_true", help="the analytic columns only")
    args = ap.parse_args()
    t0 = time.perf_counter()
    rows = analytic_rows()
    if not args.no_sim:
        tasks = [(r["hardware"], r["weights"], r["kv"], pol, r["tp"], args.requests)
                 for r in rows for pol in ("chunked", "layered")]
        by_key = {(r["hardware"], f"{r['weights']}/{r['kv']}"): r for r in rows}
        with report.pool(args.workers) as pool:
            for hw_name, wfmt, pol, rate, lower in pool.imap_unordered(_gain, tasks):
                by_key[(hw_name, wfmt)][pol] = rate
                by_key[(hw_name, wfmt)][f"{pol}_lb"] = lower
    print(markdown(rows))
    png = plot(rows, args.out / "formats.png") if not args.no_sim else None
    (args.out).mkdir(parents=True, exist_ok=True)
    (args.out / "formats.json").write_text(json.dumps(rows, indent=1))
    print(f"\nwall {time.perf_counter() - t0:.0f} s; {args.requests} arXiv requests per rate"
          f" point, seed {SEED}; wrote {args.out / 'formats.json'}" + (f", {png}" if png else ""))


if __name__ == "__main__":
    main()
