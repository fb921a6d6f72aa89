"""The compiled-program roofline as text (`python -m lp_jax.roofline --aot DIR`): one row a
program (outside the layer loop, one layer, the call, the analytic model), then per program
its Pallas kernels' estimates, one layer of each kind against the analytic model, and the
gaps by op class with what explains each (compiled.WHY; compiled.WHY_MLA for latent
attention)."""

from __future__ import annotations

import math

from lp_jax.roofline.compiled import (
    CLASSES,
    EFF_COMPUTE,
    EFF_MEM,
    FLAG_ABOVE,
    WHY,
    WHY_MLA,
    ProgramRoofline,
)
from lp_jax.roofline.hardware import Hardware


def render(summary: dict, hw: Hardware, rooflines: list[ProgramRoofline],
           eff_compute: float = EFF_COMPUTE, eff_mem: float = EFF_MEM,
           context_len: int | None = None) -> str:
    L = summary["num_layers"]
    why = WHY_MLA if summary["model_shape"].get("mla_ranks") else {}
    mesh = summary["config"]["mesh_shape"]
    max_len = summary["config"]["max_model_len"]
    ctx = max_len if context_len is None else context_len
    full = " (max_model_len: a full page table)" if ctx == max_len else ""
    lines = [
        f"compiled-program roofline: {summary['model']} on {hw.name} (mesh data,expert,tensor "
        f"= {tuple(mesh)}), {len(rooflines)} programs, per device; a call runs all {L} layers",
        f"efficiencies ASSUMED (not fitted): compute {eff_compute:g} of "
        f"{hw.peak_flops / 1e12:.0f} TFLOP/s, memory {eff_mem:g} of {hw.hbm_bw / 1e12:.2f} "
        "TB/s (links: half the bidirectional bandwidth x memory efficiency)",
        "Pallas calls costed by pallas_kernels/cost.py by kernel name: uniform routing; "
        f"context ASSUMED (--context-len): every sequence at {ctx} keys after the step{full}, "
        "in the kernels' estimates and the analytic model alike",
        "",
        f"{'rows':>6} | {'outside GFLOP':>13} {'MB':>8} {'ms':>7} | {'layer GFLOP':>11} "
        f"{'MB':>8} {'ms':>7} | {'call ms':>8} | {'analytic ms':>11} {'ratio':>6} | "
        f"{'XLA GFLOP*':>10}",
    ]
    for r in rooflines:
        ratio = r.call_s / r.analytic_s if r.analytic_s else math.inf
        xla = f"{r.xla_flops / 1e9:10.3f}" if r.xla_flops else f"{'-':>10}"
        lines.append(
            f"{r.rows:>6} | {r.outside.flops / 1e9:13.3f} {r.outside.bytes / 1e6:8.1f} "
            f"{r.outside.seconds * 1e3:7.3f} | {r.body.flops / 1e9:11.3f} "
            f"{r.body.bytes / 1e6:8.1f} {r.body.seconds * 1e3:7.3f} | {r.call_s * 1e3:8.3f} | "
            f"{r.analytic_s * 1e3:11.3f} {ratio:6.2f} | {xla}"
            + ("  FLAG" if abs(ratio - 1) > FLAG_ABOVE else ""))
    lines.append("* XLA's cost_analysis(): the layer loop counted once, Pallas calls as "
                 "declared")
    for r in rooflines:
        lines.append("")
        lines.append(f"rows {r.rows}: Pallas kernels per call (cost.py): " + "; ".join(
            f"{k} {c.flops / 1e9:.3f} GFLOP {c.bytes_accessed / 1e6:.1f} MB"
            for k, c in sorted(r.kernels.items())))
        lines.append(f"rows {r.rows}: one layer (ms, compiled vs analytic): " + "; ".join(
            f"{kind} x{n} {b.seconds * 1e3:.3f} vs {r.analytic_layer_s[kind] * 1e3:.3f}"
            for kind, (n, b) in r.bodies.items()))
        ratio = r.call_s / r.analytic_s if r.analytic_s else math.inf
        if abs(ratio - 1) <= FLAG_ABOVE:
            lines.append(f"rows {r.rows}: within {FLAG_ABOVE:.0%} of the analytic model")
            continue
        compiled = r.by_class
        gaps = sorted(CLASSES, key=lambda c: -abs(compiled[c] - r.analytic_by_class[c]))
        lines.append(f"rows {r.rows}: compiled / analytic = {ratio:.2f}; by op class "
                     "(ms, compiled vs analytic):")
        for c in gaps:
            diff = compiled[c] - r.analytic_by_class[c]
            if abs(diff) < FLAG_ABOVE * abs(r.call_s - r.analytic_s) / 2:
                continue
            lines.append(f"  {c:<16} {compiled[c] * 1e3:8.3f} vs "
                         f"{r.analytic_by_class[c] * 1e3:8.3f} ({diff * 1e3:+.3f}): "
                         f"{why.get(c, WHY[c])}")
    return "\n".join(lines)
