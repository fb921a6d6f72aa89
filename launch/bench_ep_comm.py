"""Expert-parallel MoE communication read from compiled programs: all-reduce against
all_to_all dispatch, beside the roofline's byte model (lp_jax/roofline/ep_comm.py).

    python launch/bench_ep_comm.py [--tokens 64,512,4096] [--out runs/ep_comm]

One Qwen3-30B-A3B MoE layer (D 2048, 128 experts, top-8, F 768, bf16 activations,
backend "xla") is compiled with its experts over an 8-device "expert" axis:
* TPU v6e:2x4 (compile-only devices; libtpu's real compiler): "allreduce" and
  "all_to_all" with the ragged transport (`ragged_all_to_all`);
* the capacity transport (`lax.all_to_all` rounds, CPU's) compiled for the same TPU,
  and for CPU with 8 host devices (XLA:CPU has no ragged_all_to_all).
Every collective in the compiled HLO is listed with its result shape, and its bytes per
device are derived from the op and the group size n: all-reduce 2(n-1)/n x size (ring),
all-gather and all-to-all (n-1)/n x size, reduce-scatter (n-1) x size (the result is one
shard), collective-permute x size. A ragged-all-to-all's traffic depends on the routing:
the table counts (n-1)/n of its smaller buffer (the dispatch's operand: a device's own
rows; the return's result: the rows it gets back), the uniform-routing expectation; the
other buffer is sized for the worst case. Collectives inside a while
loop (the capacity transport's rounds) count once: one round.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

D, E, F, TOP_K, EP = 2048, 128, 768, 8, 8
_OPS = ("all-reduce", "all-gather", "reduce-scatter", "ragged-all-to-all", "all-to-all",
        "collective-permute")
_DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1,
                "pred": 1, "s64": 8, "u64": 8}
_SHAPE = re.compile(r"\b(f32|bf16|f16|s32|u32|s8|u8|pred|s64|u64)\[([\d,]*)\]")


def _element_bytes(shape_text: str) -> list[int]:
    """Bytes of each array in an HLO result shape (one, or a tuple's elements)."""
    out = []
    for dtype, dims in _SHAPE.findall(shape_text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        out.append(n * _DTYPE_BYTES[dtype])
    return out


def collectives(hlo: str, n: int) -> list[dict]:
    """Each collective instruction of an HLO module: op, result shape, bytes per device."""
    found, shapes = [], {}
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (.+?) ([a-z\-]+?)(-start)?\((%?[\w.\-]+)?",
                     line)
        if not m:
            continue
        shapes[m.group(1)] = m.group(2)
        if m.group(3) not in _OPS:
            continue
        op, sizes = m.group(3), _element_bytes(m.group(2))
        # An async "-start" returns (operands, results): count the result (the largest).
        size = max(sizes) if m.group(4) else sum(sizes)
        if op == "ragged-all-to-all":
            # Operand and result are buffers, one of them sized for the worst case (the
            # dispatch receives up to every row, the return sends from that buffer). Under
            # uniform routing a device sends and receives as many rows as the smaller
            # buffer holds, (n-1)/n of them off-device.
            size = min(size, sum(_element_bytes(shapes.get(m.group(5).lstrip("%"), ""))))
        factor = {"all-reduce": 2 * (n - 1) / n, "all-gather": (n - 1) / n,
                  "all-to-all": (n - 1) / n, "ragged-all-to-all": (n - 1) / n,
                  "reduce-scatter": n - 1, "collective-permute": 1}[op]
        found.append({"op": op, "shape": m.group(1)[:60], "bytes": size * factor})
    return found


def _layer(dispatch, transport):
    import jax.numpy as jnp

    from lp_jax.models.sharded_kernels import sharded_moe_ffn

    def layer(mesh, x_TD, logits_TE, w1, w2):
        y_TD, _ = sharded_moe_ffn(mesh, x_TD, logits_TE, w1, w2, top_k=TOP_K,
                                  norm_topk_prob=True, backend="xla", dispatch=dispatch,
                                  _transport=transport)
        return y_TD.astype(jnp.bfloat16)

    return layer


def compiled_hlo(mesh, T: int, dispatch: str, transport: str | None) -> str:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    layer = _layer(dispatch, transport)
    rep, ex = NamedSharding(mesh, P()), NamedSharding(mesh, P("expert"))
    args = (jax.ShapeDtypeStruct((T, D), jnp.bfloat16, sharding=rep),
            jax.ShapeDtypeStruct((T, E), jnp.float32, sharding=rep),
            jax.ShapeDtypeStruct((E, D, 2 * F), jnp.bfloat16, sharding=ex),
            jax.ShapeDtypeStruct((E, F, D), jnp.bfloat16, sharding=ex))
    return jax.jit(lambda *a: layer(mesh, *a)).lower(*args).compile().as_text()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="64,512,4096")
    ap.add_argument("--topology", default="v6e:2x4")
    ap.add_argument("--out", default="runs/ep_comm")
    args = ap.parse_args(argv)
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={EP}")
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from lp_jax.roofline import ep_comm
    from pallas_kernels.compile_targets import tpu_topology_devices

    tpu = Mesh(np.asarray(tpu_topology_devices(args.topology)[:EP]), ("expert",))
    cpu = Mesh(np.asarray(jax.devices("cpu")[:EP]), ("expert",))
    cases = [("allreduce", None, tpu, "TPU " + args.topology),
             ("all_to_all", "ragged", tpu, "TPU " + args.topology),
             ("all_to_all", "capacity", tpu, "TPU " + args.topology),
             ("all_to_all", "capacity", cpu, "CPU x8")]
    rows = []
    for T in (int(t) for t in args.tokens.split(",")):
        for dispatch, transport, mesh, where in cases:
            found = collectives(compiled_hlo(mesh, T, dispatch, transport), EP)
            hlo_bytes = sum(c["bytes"] for c in found)
            model = (ep_comm.allreduce_bytes(T, D, EP) if dispatch == "allreduce" else
                     ep_comm.comm_bytes("all_to_all", T, D, TOP_K, EP, transport=transport))
            rows.append({"tokens": T, "dispatch": dispatch, "transport": transport,
                         "compiled_for": where, "hlo_bytes": hlo_bytes, "model_bytes": model,
                         "collectives": found})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    print(f"{'T':>5} {'scheme':22} {'compiled for':14} {'HLO KiB/dev':>12} "
          f"{'model KiB/dev':>14}  collectives")
    for r in rows:
        ops = {}
        for c in r["collectives"]:
            ops[c["op"]] = ops.get(c["op"], 0) + 1
        scheme = r["dispatch"] + (f" ({r['transport']})" if r["transport"] else "")
        print(f"{r['tokens']:>5} {scheme:22} {r['compiled_for']:14} {r['hlo_bytes'] / 1024:>12,.0f}"
              f" {r['model_bytes'] / 1024:>14,.0f}  "
              + ", ".join(f"{k} x{v}" for k, v in sorted(ops.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
