"""When speculative decoding pays on a MoE: modelled speedup per generated token.

    python launch/bench_spec_pays.py [--context 2048] [--out runs/spec_pays]

For Qwen3-30B-A3B, GPT-OSS-20B and DeepSeek-V3 on the H200 and TPU v6e (lp_jax/roofline
presets, one layout each that holds the weights), prints per global batch B:
- the cost of a verification step with k n-gram drafts over a plain decode step,
  (T_verify + T_draft) / T_decode, for k = 1, 3, 7 (analytic roofline,
  lp_jax/roofline/spec_pays.py), and the same ratio for k = 3 from the simulator's
  cost-model executor (lp_jax/sim/executor.py: the plan's k + 1 verification rows, with
  its default calibration's per-step and per-layer overheads);
- the best k and its speedup at per-token acceptance 0.5, 0.7 and 0.9;
- the acceptance above which one draft pays (break-even alpha, k = 1);
then the best speedup of n-gram, EAGLE-3 and MTP drafts at alpha = 0.7 side by side.
Batches whose KV at `--context` tokens does not fit beside the weights are marked "*".
Writes spec_pays.csv and spec_pays.png (matplotlib, Agg, imported lazily as
lp_jax/roofline/plots.py does) under --out.

Kind of evidence: modelled (analytic roofline) and simulated; nothing here ran on a chip.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from lp_jax.core.plan import StepPlan
from lp_jax.core.sampling_params import SamplingParams
from lp_jax.core.sequence import Sequence
from lp_jax.roofline.hardware import get_hardware
from lp_jax.roofline.model_shape import resolve_model
from lp_jax.roofline.report import render
from lp_jax.roofline.routing import UNIFORM
from lp_jax.roofline.spec_pays import (
    DEFAULT_CONTEXT,
    DRAFTS,
    SpecSetup,
    break_even_alpha,
    max_batch,
)
from lp_jax.sim.executor import CostModelExecutor

# (model, weight format, {chip: ep}): one expert-parallel layout per chip that holds the
# weights (bf16 Qwen3 61 GB and GPT-OSS 42 GB on one 141 GB H200 or four 32 GB v6e;
# DeepSeek-V3 in its fp8 blocks, 671 GB, on 8 H200 or 32 v6e).
SETUPS = (
    ("Qwen3-30B-A3B", None, {"H200 SXM": 1, "TPU v6e": 4}),
    ("gpt-oss-20b", None, {"H200 SXM": 1, "TPU v6e": 4}),
    ("deepseek-v3", "fp8_block", {"H200 SXM": 8, "TPU v6e": 32}),
)
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
ALPHAS = (0.5, 0.7, 0.9)
PLOT_ALPHAS = (0.5, 0.6, 0.7, 0.8, 0.9)
MAX_K = 8
SIM_K = 3


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=DEFAULT_CONTEXT,
                   help="KV tokens per sequence (default %(default)s)")
    p.add_argument("--out", type=Path, default=Path("runs/spec_pays"))
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--no-sim", action="store_true", help="skip the simulator column")
    return p.parse_args(argv)


def sim_ratio(setup: SpecSetup, batch: int, k: int) -> float:
    """The simulator's step time with k drafts over without, for B sequences at the
    setup's context (uniform routing, tile 1, its default calibration)."""
    ex = CostModelExecutor(setup.shape, setup.hardware, tp=setup.tp, ep=setup.ep,
                           routing=UNIFORM)
    params = SamplingParams(max_tokens=MAX_K + 2)
    seqs = tuple(Sequence(i, [1] * setup.context, params) for i in range(batch))
    L = setup.shape.num_layers
    plain = ex.run(StepPlan(step_id=0, num_layers=L, decode=seqs)).seconds
    drafts = ((1,) * k,) * batch
    spec = ex.run(StepPlan(step_id=1, num_layers=L, decode=seqs, drafts=drafts)).seconds
    return spec / plain


def table(setup: SpecSetup, sim: bool) -> tuple[list[str], list[list[str]], list[dict]]:
    fits = max_batch(setup)
    header = ["B", "T_decode ms", "r k=1", "r k=3", "r k=7"]
    header += [f"sim r k={SIM_K}"] if sim else []
    header += [f"a={a}: k, S" for a in ALPHAS] + ["a to pay, k=1"]
    rows, records = [], []
    for B in BATCHES:
        mark = "" if B <= fits else "*"
        r = {k: setup.step_ratio(B, k) for k in (1, 3, 7)}
        row = [f"{B}{mark}", f"{1e3 * setup.decode_seconds(B):.3f}",
               *(f"{r[k]:.2f}" for k in (1, 3, 7))]
        rec = {"model": setup.shape.name, "hardware": setup.hardware.name, "ep": setup.ep,
               "context": setup.context, "batch": B, "kv_fits": B <= fits,
               "decode_ms": 1e3 * setup.decode_seconds(B),
               **{f"ratio_k{k}": r[k] for k in (1, 3, 7)}}
        if sim:
            rec["sim_ratio_k3"] = sim_ratio(setup, B, SIM_K)
            row.append(f"{rec['sim_ratio_k3']:.2f}")
        for a in ALPHAS:
            k, s = setup.best_k(a, B, MAX_K)
            row.append(f"{k}, {s:.2f}")
            rec[f"best_k_a{a}"], rec[f"speedup_a{a}"] = k, s
        be = break_even_alpha(r[1], 1)
        row.append(f"{be:.2f}" if be <= 1 else "never")
        rec["break_even_alpha_k1"] = be
        rows.append(row)
        records.append(rec)
    return header, rows, records


def plot(setups: dict, path: Path) -> Path:
    from lp_jax.roofline.plots import _pyplot, _save

    plt = _pyplot()
    models = list(dict.fromkeys(m for m, _ in setups))
    chips = list(dict.fromkeys(h for _, h in setups))
    fig, axes = plt.subplots(len(chips), len(models), figsize=(3.6 * len(models),
                             2.9 * len(chips)), sharey=True, squeeze=False)
    batch_B = [2**i for i in range(11)]
    for (model, chip), setup in setups.items():
        ax = axes[chips.index(chip)][models.index(model)]
        for a in PLOT_ALPHAS:
            ax.plot(batch_B, [setup.best_k(a, B, MAX_K)[1] for B in batch_B], "o-", ms=3,
                    label=f"alpha {a}")
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        fits = max_batch(setup)
        if fits < batch_B[-1]:
            ax.axvspan(max(fits, 1), batch_B[-1], color="0.85", lw=0)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{model} on {chip} (ep {setup.ep})", fontsize=9)
        ax.set_xlabel("batch B (sequences)")
        ax.set_ylabel("speedup per token, best k <= 8")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"n-gram speculation on MoE: modelled (roofline), context {setup.context};"
                 " grey: KV does not fit", fontsize=10)
    return _save(fig, plt, path)


def main(argv=None) -> int:
    args = parse_args(argv)
    setups: dict[tuple[str, str], SpecSetup] = {}
    records: list[dict] = []
    for model, fmt, chips in SETUPS:
        shape = resolve_model(model).with_formats(fmt, None)
        for chip, ep in chips.items():
            setup = SpecSetup(shape, get_hardware(chip), ep=ep, context=args.context)
            setups[(model, chip)] = setup
            header, rows, recs = table(setup, not args.no_sim)
            records += recs
            print(render(f"{model} ({fmt or 'bf16'}) on {chip} x {ep} (ep {ep}), n-gram "
                         f"drafts, context {args.context}; r = step cost over a decode "
                         f"step, S = speedup per token", (header, rows)))
            print()
    header = ["model", "chip", "B", *(f"{d}: k, S" for d in DRAFTS)]
    rows = []
    for (model, chip), base in setups.items():
        for B in (1, 16, 256):
            row = [model, chip, str(B)]
            for draft in DRAFTS:
                s = SpecSetup(base.shape, base.hardware, draft=draft, ep=base.ep,
                              context=base.context)
                k, sp = s.best_k(0.7, B, MAX_K)
                row.append(f"{k}, {sp:.2f}")
            rows.append(row)
    print(render("Draft cost: best k and speedup at alpha 0.7 (EAGLE-3 and MTP per draft "
                 "step: spec_pays.py)", (header, rows)))
    args.out.mkdir(parents=True, exist_ok=True)
    csv_path = args.out / "spec_pays.csv"
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows(records)
    print(f"\nwrote {csv_path}")
    if not args.no_plot:
        print(f"wrote {plot(setups, args.out / 'spec_pays.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
