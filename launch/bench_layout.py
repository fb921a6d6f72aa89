"""Qwen3-30B-A3B on a v6e 2x4 slice: today's (1, 8, 1) layout against tensor-parallel
attention with the experts on the same 8 chips, (1, 1, 8), then layered against chunked
prefill on the new layout in the simulator.

    python launch/bench_layout.py [--requests 200] [--rate 1.0] [--out runs/layout]

Part 1 (modelled, lp_jax/roofline/layout.py): per chip, weights, KV bytes a token, the KV
room (tokens beside the weights in 90% of HBM less a 4 GB reserve), bytes read outside the
layers at 8 rows, and link bytes a layer at 8, 64 and 512 rows with the MoE dispatch
"auto" picks (ragged transport, bf16 all-reduce as TPU compiles it).
Part 2 (simulated, lp_jax/sim, analytic cost model): the same Poisson workload of
arxiv-paper lengths under chunked (512-token budget) and layered (8192) prefill on
(tp 8, ep 1), the simulator's form of (1, 1, 8), with the KV pages the layout leaves.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MESHES = ((1, 8, 1), (1, 1, 8))
ROWS = (8, 64, 512)


def layout_rows(shape, hw) -> list[dict]:
    from lp_jax.roofline.layout import chip_layout, link_bytes_per_layer

    out = []
    for mesh in MESHES:
        c = chip_layout(shape, mesh)
        links = {T: link_bytes_per_layer(shape, mesh, T) for T in ROWS}
        out.append({"mesh": mesh, "weights_gb": c.weight_bytes / 1e9,
                    "kv_heads_per_chip": c.kv_heads_per_chip,
                    "kv_kb_per_token": c.kv_bytes_per_token / 1e3,
                    "kv_room_tokens": c.kv_tokens(hw.hbm_bytes),
                    "outside_mb_at_8": c.outside_bytes(8) / 1e6, "links": links})
    return out


def simulate_policies(shape, hw, requests: int, rate: float) -> list[dict]:
    from lp_jax.roofline.layout import sim_parallelism
    from lp_jax.sim.simulator import SimConfig, simulate
    from lp_jax.sim.workload import synthesize

    reqs = synthesize("arxiv-paper", requests, rate, seed=0)
    out = []
    for policy in ("chunked", "layered"):
        cfg = SimConfig(shape=shape, hardware=hw, policy=policy, **sim_parallelism((1, 1, 8)))
        s = simulate(cfg, reqs).summary()
        out.append({"policy": policy, **{k: s[k] for k in (
            "ttft_p50", "ttft_p99", "max_itl_p99", "e2e_mean", "expert_gb_per_100_requests")
            if k in s}})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--rate", type=float, default=1.0)
    ap.add_argument("--out", default="runs/layout")
    args = ap.parse_args(argv)
    from lp_jax.roofline.hardware import get_hardware
    from lp_jax.roofline.model_shape import QWEN3_30B_A3B

    hw = get_hardware("TPU v6e")
    rows = layout_rows(QWEN3_30B_A3B, hw)
    print("Qwen3-30B-A3B, TPU v6e 2x4, per chip (modelled)")
    print(f"{'mesh':>10} | {'weights GB':>10} {'KV heads':>8} {'KV kB/token':>11} "
          f"{'KV room tokens':>14} {'outside MB @8':>13} | link kB/layer (dispatch) "
          + "  ".join(f"@{T}" for T in ROWS))
    for r in rows:
        links = "  ".join(f"{(v['attention'] + v['moe']) / 1e3:.0f} ({v['dispatch']})"
                          for v in r["links"].values())
        print(f"{str(r['mesh']):>10} | {r['weights_gb']:10.2f} {r['kv_heads_per_chip']:8.1f} "
              f"{r['kv_kb_per_token']:11.1f} {r['kv_room_tokens']:14,d} "
              f"{r['outside_mb_at_8']:13.1f} | {links}")
    sims = simulate_policies(QWEN3_30B_A3B, hw, args.requests, args.rate)
    print(f"\nsimulated, (1, 1, 8) as tp 8: {args.requests} arxiv-paper requests at "
          f"{args.rate} req/s")
    for s in sims:
        print("  " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                               for k, v in s.items()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "layout.json").write_text(json.dumps({"layouts": rows, "sim": sims}, indent=1,
                                                default=str))
    print(f"wrote {out}/layout.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
