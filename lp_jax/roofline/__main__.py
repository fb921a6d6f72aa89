"""`python -m lp_jax.roofline`: print the roofline tables and write the plots.

Design note. One run answers the questions of the layered-prefill paper for a model on
every accelerator in the table: ridge points; tokens per layer step at which the MoE
turns compute-bound; the Fig. 2 chunk table (expert bytes and MoE time for one prompt);
activated experts vs decode batch (uniform vs skewed routing); and the marginal expert
traffic that layering saves next to a decode batch. `--measure` adds a microbenchmark
of the current JAX device and a measured MoE knee (a few seconds on CPU).
`--ep-comm` prints only the expert-parallel communication section instead (ep_comm.py:
all-reduce vs all_to_all dispatch bytes, the tokens where all_to_all turns faster, and
the scheme `auto` picks) for both Qwen3 MoE models, on NVLink and ICI.
`--weight-format` / `--kv-format` (formats.py) give the model's stored weight and KV
formats: every byte count, the compute-bound tokens and the Fig. 2 table follow them, at
the bf16 FLOP rate (the kernels run W8A16 / W4A16). launch/bench_formats.py sweeps them.
`--aot DIR` reads the compiled programs of a `python -m lp_jax.aot` run instead
(compiled.py): per program, the cost outside the layer loop and per layer, the
predicted time on the chip that run targeted, and the gap to the analytic model.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from lp_jax.roofline import compiled, compiled_render, plots, report
from lp_jax.roofline.formats import KV_FORMATS, WEIGHT_FORMATS
from lp_jax.roofline.hardware import HARDWARE, get_hardware, measure_current_device
from lp_jax.roofline.model_shape import resolve_model
from lp_jax.roofline.ridge import PAPER_CHUNKS, compute_bound_tokens, fig2_table
from lp_jax.roofline.routing import (
    PAPER_TABLE1_TARGETS,
    QWEN3_ZIPF_EXPONENT,
    UniformRouting,
    ZipfRouting,
)

DEFAULT_OUT = Path("runs/roofline")
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
EP_MODELS = ("Qwen3-30B-A3B", "Qwen3-235B-A22B")
EP_SIZES = (2, 4, 8, 16, 32, 64)
EP_TOKENS = (64, 1024, 8192)
EP_HARDWARE = ("H100 SXM", "H200 SXM", "TPU v5e", "TPU v6e")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lp_jax.roofline", description=__doc__)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="directory for the PNG plots")
    p.add_argument(
        "--model",
        default="Qwen3-30B-A3B",
        help="config.json path, a name in checkpoints/configs/, or a built-in shape",
    )
    p.add_argument("--hardware", default="H100 SXM", help="hardware for the Fig. 2 table")
    p.add_argument("--weight-format", choices=sorted(WEIGHT_FORMATS), default=None,
                   help="stored weight format (default: the config's dtype)")
    p.add_argument("--kv-format", choices=sorted(KV_FORMATS), default=None,
                   help="KV-cache format (default: the config's dtype)")
    p.add_argument("--prompt-len", type=int, default=8192)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--tile", type=int, default=128, help="grouped-matmul row tile (1 = none)")
    p.add_argument("--skew", type=float, default=QWEN3_ZIPF_EXPONENT, help="Zipf exponent")
    p.add_argument(
        "--measure",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="microbenchmark the current JAX device and measure a MoE knee",
    )
    p.add_argument(
        "--ep-comm",
        action="store_true",
        help="print only the expert-parallel dispatch section (all-reduce vs all_to_all)",
    )
    p.add_argument("--aot", type=Path, default=None, metavar="DIR",
                   help="print the compiled-program roofline of a python -m lp_jax.aot run")
    p.add_argument("--eff-compute", type=float, default=compiled.EFF_COMPUTE,
                   help="--aot: share of peak FLOP/s an op reaches (default %(default)s, "
                        "ASSUMED until fitted on the H200)")
    p.add_argument("--context-len", type=int, default=None, metavar="KEYS",
                   help="--aot: keys per sequence after the step that the attention "
                        "estimates and the analytic model assume (default: max_model_len, "
                        "a full page table; the kernels do work for the real lengths)")
    p.add_argument("--eff-mem", type=float, default=compiled.EFF_MEM,
                   help="--aot: share of HBM bandwidth an op reaches (default %(default)s, "
                        "ASSUMED until fitted on the H200)")
    return p.parse_args(argv)


def print_ep_comm(models: Sequence[str] = EP_MODELS) -> None:
    """The expert-parallel communication section: bytes, crossover and `auto`'s pick."""
    hardware = [get_hardware(name) for name in EP_HARDWARE]
    for name in models:
        shape = resolve_model(name)
        print(
            f"model {shape.name}: D={shape.hidden_size} k={shape.top_k} E={shape.num_experts}"
            f" act bytes={shape.dtype_bytes}; MoE layers {shape.num_moe_layers}\n"
        )
        print(
            report.render(
                f"{shape.name}: bytes one device sends per MoE layer (uniform routing;"
                " capacity = one round, factor 2); auto = fewer bytes (ragged)",
                report.ep_bytes_table(shape, EP_SIZES, EP_TOKENS),
            )
        )
        print()
        print(
            report.render(
                f"{shape.name}: tokens per layer step above which all_to_all (ragged) is"
                " faster (time model: bytes / one-way link bandwidth + steps x latency)",
                report.ep_crossover_table(shape, EP_SIZES, hardware, "ragged"),
            )
        )
        print()
    print(
        "notes: link latencies are ASSUMED (hardware.py); torus hops = mean hops of an\n"
        "all_to_all on the most even 2D sub-slice with wraparound (v5e/v6e), 1 on NVSwitch.\n"
        "H100/H200 HGX NVLink reaches 8 GPUs: ep > 8 rows assume one NVLink domain of ep\n"
        "GPUs; across HGX nodes the traffic goes over InfiniBand, much slower (not modelled).\n"
        "the all-reduce is counted in float32, as the source sums; TPU's compiler casts to bf16\n"
        "before it (compiled HLO, launch/bench_ep_comm.py): half the bytes, and the engine's\n"
        "auto uses that width on TPU.\n"
        "auto picks by bytes alone, which ignores the all_to_all's extra collective steps:\n"
        "below the crossover the all-reduce is faster even where auto picks A2A;\n"
        "choose_dispatch(..., link=ep_comm.Link.from_hardware(hw)) picks by the time model."
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.aot is not None:
        summary, hw, rooflines = compiled.read_aot(args.aot, eff_compute=args.eff_compute,
                                                   eff_mem=args.eff_mem,
                                                   context_len=args.context_len)
        print(compiled_render.render(summary, hw, rooflines, args.eff_compute,
                                     args.eff_mem, args.context_len))
        return 0
    if args.ep_comm:
        print_ep_comm()
        return 0
    shape = resolve_model(args.model).with_formats(args.weight_format, args.kv_format)
    if not shape.is_moe:
        print(f"{shape.name} has no routed experts; the MoE roofline tables do not apply")
        return 2
    uniform, skewed = UniformRouting(), ZipfRouting(args.skew)
    routings = (uniform, skewed)
    table = list(HARDWARE.values())
    fig2_hw = get_hardware(args.hardware)

    print(
        f"model {shape.name}: D={shape.hidden_size} L={shape.num_layers} "
        f"(MoE layers {shape.num_moe_layers}) E={shape.num_experts} k={shape.top_k} "
        f"F={shape.expert_width} itemsize={shape.dtype_bytes}; weights "
        f"{shape.weight_format or 'as dtype'} ({shape.expert_weight_itemsize:.5g} B/expert weight,"
        f" scales included), KV {shape.kv_format or 'as dtype'} ({shape.kv_itemsize} B); "
        f"expert bytes per layer {shape.expert_bytes_per_layer:,} B; tp={args.tp} ep={args.ep}"
    )
    targets = ", ".join(f"{t} tokens -> {100 * f:.0f}%" for t, f in PAPER_TABLE1_TARGETS)
    print(f"skewed routing: Zipf exponent s={args.skew:g} (fitted to paper Table 1: {targets})\n")

    print(
        report.render(
            "Hardware (per chip; ridge = peak / HBM bandwidth)", report.hardware_table(table)
        )
    )
    print()
    print(
        report.render(
            f"Tokens per layer step at which {shape.name}'s MoE turns compute-bound",
            report.compute_bound_table(shape, table, routings, tp=args.tp, ep=args.ep),
        )
    )
    print()
    rows = fig2_table(
        shape,
        fig2_hw,
        prompt_len=args.prompt_len,
        chunks=PAPER_CHUNKS,
        routing=uniform,
        tp=args.tp,
        ep=args.ep,
        tile=args.tile,
    )
    print(
        report.render(
            f"Fig. 2: one {args.prompt_len}-token prompt on {fig2_hw.name}, uniform routing,"
            f" tile {args.tile} (per device)",
            report.chunk_table(rows),
        )
    )
    print()
    print(
        report.render(
            "Activated experts per layer vs decode batch",
            report.active_experts_table(shape, routings, DECODE_BATCHES),
        )
    )
    print()
    print(
        report.render(
            f"Marginal expert traffic of one {args.prompt_len}-token prompt next to a decode"
            f" batch ({skewed.label}, all MoE layers, per device)",
            report.marginal_table(
                shape, skewed, (0, 8, 32, 128, 256), args.prompt_len, 512, args.tp, args.ep
            ),
        )
    )
    print()

    plotted_hw = list(table)
    if args.measure:
        from lp_jax.roofline.knee import measure_moe_knee

        measured = measure_current_device()
        plotted_hw.append(measured)
        cb = compute_bound_tokens(shape, measured, routing=uniform)
        print(
            f"{measured.name}: {measured.peak_flops / 1e9:,.1f} GFLOP/s, "
            f"{measured.hbm_bw / 1e9:,.1f} GB/s, ridge {measured.ridge_point:.1f} FLOP/B; "
            f"{shape.name} compute-bound at T ~ {cb.exact_tokens:,.0f} tokens"
        )
        knee = measure_moe_knee()
        print(
            report.render(
                f"Measured MoE knee on {knee.device} (the engine's moe_ffn, small shape): knee at"
                f" T={knee.knee_tokens} ({100 * knee.threshold:.0f}% of max FLOP/s)",
                report.knee_table(knee),
            )
        )
        print()

    out = args.out
    written = [
        plots.plot_intensity(shape, plotted_hw, routings, out / "intensity_vs_tokens.png"),
        plots.plot_chunk_bytes(shape, rows, out / "expert_bytes_vs_chunk.png"),
        plots.plot_active_experts(shape, routings, out / "active_experts_vs_batch.png"),
    ]
    print("plots written to " + str(out) + ":")
    for path in written:
        print(f"  {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
