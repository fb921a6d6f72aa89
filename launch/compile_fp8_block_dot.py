"""One dense projection of a DeepSeek-V3 FP8 checkpoint, x [T, 7168] @ w [7168, 18432], compiled
by the real compilers on this CPU host, in the two forms the engine could hold w in:

* e4m3 with its 128 x 128 block scales, dequantised in the step (`quant.linear`);
* bf16, dequantised once at load (what the engine holds since `quant.served_scheme`).

Prints each program's temporaries and whether a weight-shaped array is written to memory
(an instruction of the weight's shape outside a fused computation), for a v5p chip (no FP8
matmul) and an H200 (FP8 tensor cores; XLA:GPU's FP8 GEMM rewrite takes per-tensor
scales only). Kind of evidence: compiled for a chip on this host; nothing runs.

    python launch/compile_fp8_block_dot.py               # TPU v5p and H200, rows 1, 64, 8224
    python launch/compile_fp8_block_dot.py --only tpu --rows 64
"""

from __future__ import annotations

import argparse
import math
import re

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

from lp_jax.quant.linear import linear
from pallas_kernels import compile_targets
from pallas_kernels.quant import FP8_BLOCK

K, N = 7168, 18432  # DeepSeek-V3's dense MLP gate / up projection


def materialised(hlo: str) -> int:
    """Instructions with as many float32 / bf16 elements as the weight (any shape: the
    expanded scale is laid out [896, 8, 144, 128] on TPU), in a computation that is not a
    fusion's, other than parameters and bitcasts."""
    count, fused = 0, False
    for line in hlo.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            fused = "fused" in line.split("(")[0] or "fusion" in line.split("(")[0]
        m = re.search(r"= (?:f32|bf16)\[([\d,]+)\]\S* (\S+?)\(", line)
        if not fused and m and m.group(2) not in ("bitcast", "parameter") and math.prod(
                int(d) for d in m.group(1).split(",")) == K * N:
            count += 1
    return count


def compile_one(device, rows: int, fp8: bool):
    on = SingleDeviceSharding(device)
    x = jax.ShapeDtypeStruct((rows, K), jnp.bfloat16, sharding=on)
    if fp8:
        args = (x, jax.ShapeDtypeStruct((K, N), jnp.float8_e4m3fn, sharding=on),
                jax.ShapeDtypeStruct((K // 128, N // 128), jnp.float32, sharding=on))
        fn = lambda x, w, s: linear(x, w, s, FP8_BLOCK)  # noqa: E731
    else:
        args = (x, jax.ShapeDtypeStruct((K, N), jnp.bfloat16, sharding=on))
        fn = linear
    return jax.jit(fn).lower(*args).compile()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", choices=["tpu", "cuda"])
    p.add_argument("--rows", default="1,64,8224")
    args = p.parse_args()
    targets = []
    if args.only != "cuda":
        targets.append(("TPU v5p", compile_targets.tpu_topology_devices("v5p:2x2x1")[0]))
    if args.only != "tpu":
        targets.append(("H200", compile_targets.cuda_topology_devices("h200")[0]))
    print(f"x [T, {K}] @ w [{K}, {N}]; w is {K * N * 2 / 2**20:.0f} MiB in bf16")
    print(f"{'chip':>8} {'rows':>5} {'w held as':>10} {'temporaries MiB':>16} "
          f"{'weight-shaped arrays written':>28}")
    for name, device in targets:
        for rows in (int(r) for r in args.rows.split(",")):
            for fp8 in (True, False):
                c = compile_one(device, rows, fp8)
                temp = c.memory_analysis().temp_size_in_bytes / 2**20
                print(f"{name:>8} {rows:>5} {'e4m3+scale' if fp8 else 'bf16':>10} "
                      f"{temp:16.1f} {materialised(c.as_text()):28d}")


if __name__ == "__main__":
    main()
