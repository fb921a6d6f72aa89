"""Data-parallel attention beside expert parallelism against TP attention, per chip of a
slice (modelled, lp_jax/roofline/dp_attention.py; nothing is compiled).

    python launch/bench_data_parallel.py [--chips 64] [--rows 512] [--json PATH]

For DeepSeek-V3 FP8 (block-scaled weights, bf16 latent) on TPU v6e and v5p slices of
--chips chips, and Qwen3-30B-A3B (bf16) on 8 v6e chips: per chip the weights, KV bytes a
token and KV room (tokens beside the weights in 90% of HBM less a 4 GB reserve), the KV
tokens the slice holds, and one chip's link bytes a layer when the slice runs --rows rows
a step, --rows / d per rank (o_proj all-reduce, MoE all_to_all dispatch + combine, the
rank's gather). (1, 1, n) is TP
attention with the experts on the same chips; (d, 1, t) data-parallel attention.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def rows_for(shape, hw, chips: int, rows: int) -> list[dict]:
    from lp_jax.roofline.dp_attention import (
        dp_chip_layout,
        dp_link_bytes_per_layer,
        slice_kv_tokens,
    )
    from lp_jax.roofline.layout import chip_layout

    out = []
    t = chips
    while t >= 1:
        d = chips // t
        c = chip_layout(shape, (1, 1, t)) if d == 1 else dp_chip_layout(shape, d, t)
        links = dp_link_bytes_per_layer(shape, d, t, rows // d)
        out.append({"mesh": (d, 1, t), "weights_gb": c.weight_bytes / 1e9,
                    "kv_kb_per_token": c.kv_bytes_per_token / 1e3,
                    "chip_kv_tokens": c.kv_tokens(hw.hbm_bytes),
                    "slice_kv_tokens": slice_kv_tokens(shape, (d, 1, t), hw.hbm_bytes),
                    "link_kb_per_layer": sum(links.values()) / 1e3})
        t //= 2
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chips", type=int, default=64)
    ap.add_argument("--rows", type=int, default=512, help="rows of the slice a step")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from lp_jax.roofline.hardware import get_hardware
    from lp_jax.roofline.model_shape import DEEPSEEK_V3, QWEN3_30B_A3B

    cases = [(DEEPSEEK_V3.with_formats("fp8_block", None), "TPU v6e", args.chips),
             (DEEPSEEK_V3.with_formats("fp8_block", None), "TPU v5p", args.chips),
             (QWEN3_30B_A3B, "TPU v6e", 8)]
    report = []
    for shape, chip, chips in cases:
        hw = get_hardware(chip)
        table = rows_for(shape, hw, chips, args.rows)
        report.append({"model": shape.name, "chip": chip, "chips": chips, "rows": table})
        print(f"\n{shape.name} ({shape.weight_format or 'bf16'}), {chips} x {chip}, per chip "
              f"(modelled), link bytes at {args.rows} rows a step")
        print(f"{'mesh':>12} | {'weights GB':>10} {'KV kB/token':>11} {'chip KV tokens':>14} "
              f"{'slice KV tokens':>15} {'link kB/layer':>13}")
        for r in table:
            print(f"{str(r['mesh']):>12} | {r['weights_gb']:10.1f} {r['kv_kb_per_token']:11.1f} "
                  f"{r['chip_kv_tokens']:14,d} {r['slice_kv_tokens']:15,d} "
                  f"{r['link_kb_per_layer']:13,.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
