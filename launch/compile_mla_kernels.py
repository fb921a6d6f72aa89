"""The MLA decode kernels compiled by the real compilers on this CPU host, at DeepSeek-V3's
(128 heads) and Kimi-K2's (64 heads) attention shapes: kv_lora_rank 512, rope 64, a
bf16 and an FP8 (e4m3) latent pool.

    python launch/compile_mla_kernels.py                 # TPU v6e and H200, all four
    python launch/compile_mla_kernels.py --only tpu --out mla.json

TPU (libtpu, compile-only v6e): compile seconds, and whether the pool reaches the
Mosaic call as the parameter itself (a bitcast) or through a copy, with the program's
temporaries. The TPU pool rows are padded to 640 values (kv_cache.packs_kv);
--unpadded-tpu compiles the 576-wide pool too, to show the copy the padding avoids.
H200 (the CUDA plugin and ptxas, sm_90a): what ptxas gives the Triton kernel
(registers, spills, shared memory, threads) and the blocks an SM holds
(launch/gpu_kernel_resources.py's occupancy).

Shapes: a decode step of 32 sequences at 4096 tokens of context (16-token pages, a
page table of 256 pages a sequence, 8192 pages in the pool).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels import compile_targets  # noqa: E402

sd = jax.ShapeDtypeStruct
MODELS = {"deepseek-v3": 128, "kimi-k2": 64}  # query heads; both A 512, R 64
A, R, S, B, C = 512, 64, 16, 32, 256
KV = {"bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn}


def _args(N: int, kv: str, X: int):
    args = [sd((B, N, A), jnp.bfloat16), sd((B, N, R), jnp.bfloat16),
            sd((B * C, S, 1, X), KV[kv]), sd((B + 1,), jnp.int32), sd((B,), jnp.int32),
            sd((B, C), jnp.int32), sd((), jnp.int32)]
    return tuple(args + ([sd((), jnp.float32)] if kv == "fp8" else []))


def _fn(module, **kw):
    def fn(q_lat, q_pe, pool, qs, lens, table, n, *scale):
        return module.mla_decode_attention(q_lat, q_pe, pool, qs, lens, table, n,
                                           sm_scale=(128 + R) ** -0.5,
                                           kv_scale=scale[0] if scale else None, **kw)
    return fn


def pool_operand(hlo: str) -> str:
    """'parameter' or the opcode feeding the Mosaic call's pool operand (bitcasts
    followed), from the compiled HLO text."""
    insts = {}
    pattern = r"^\s*(?:ROOT )?%([\w.\-]+) = \S+ ([\w\-]+)\((.*?)\)"
    for m in re.finditer(pattern, hlo, re.M):
        insts[m.group(1)] = (m.group(2), re.findall(r"%([\w.\-]+)", m.group(3)))
    (line,) = [ln for ln in hlo.splitlines() if 'custom_call_target="tpu_custom_call"' in ln]
    name = re.match(r"^\s*(?:ROOT )?%([\w.\-]+) =", line).group(1)
    operand = insts[name][1][5]  # 3 scalar prefetch, q_lat, q_pe, then the pool
    while insts[operand][0] == "bitcast":
        operand = insts[operand][1][0]
    return insts[operand][0]


def tpu(topology: str, unpadded: bool) -> list[dict]:
    from pallas_kernels.attention import mla_tpu

    rows = []
    widths = [640] + ([A + R] if unpadded else [])
    for model, N in MODELS.items():
        for kv in KV:
            for X in widths:
                check = mla_tpu.check_constraints
                if X % 128:  # the kernel refuses this row: compile it anyway, to show why
                    mla_tpu.check_constraints = lambda *a: None
                t = time.perf_counter()
                try:
                    compiled = compile_targets.compile_tpu(_fn(mla_tpu), _args(N, kv, X),
                                                           topology=topology, mesh_shape=(1,))
                finally:
                    mla_tpu.check_constraints = check
                mem = compiled.memory_analysis()
                row = dict(target=topology, model=model, heads=N, kv=kv, row=X,
                           seconds=round(time.perf_counter() - t, 1),
                           pool_from=pool_operand(compiled.as_text()),
                           temp_mb=round(mem.temp_size_in_bytes / 1e6, 1),
                           pool_mb=round(B * C * S * X * jnp.dtype(KV[kv]).itemsize / 1e6, 1))
                rows.append(row)
                print(f"{topology} {model} ({N} heads) {kv} row {X}: compiled in "
                      f"{row['seconds']} s; pool from {row['pool_from']}; temporaries "
                      f"{row['temp_mb']} MB (pool {row['pool_mb']} MB)")
    return rows


def gpu(target: str, **tiling) -> list[dict]:
    from launch.gpu_kernel_resources import compile_kernels, occupancy
    from lp_jax.aot import resources
    from pallas_kernels.attention import mla_gpu

    rows = []
    for model, N in MODELS.items():
        for kv in KV:
            kernels, seconds = compile_kernels(_fn(mla_gpu, **tiling), _args(N, kv, A + R),
                                               target)
            for k in kernels:
                k.update(occupancy(k), model=model, heads=N, kv=kv, **tiling,
                         seconds=round(seconds, 1), target=target)
                rows.append(k)
                print(f"{target} {model} ({N} heads) {kv}: compiled in {seconds:.1f} s; "
                      f"{resources.short(k)}; {k['blocks_per_sm']} blocks "
                      f"({k['warps_per_sm']} warps) an SM, limited by "
                      f"{', '.join(k['limited_by'])}")
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=("tpu", "gpu"))
    p.add_argument("--topology", default="v6e:2x2")
    p.add_argument("--gpu", default="h200", choices=compile_targets.GPU_TARGETS)
    p.add_argument("--unpadded-tpu", action="store_true",
                   help="also the 576-wide TPU pool (the kernel's check bypassed)")
    p.add_argument("--gpu-warps", type=int, default=8)
    p.add_argument("--gpu-block-h", type=int, default=16, help="heads a GPU program")
    p.add_argument("--gpu-pages-per-block", type=int, default=None)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    rows = []
    if args.only != "gpu":
        if not compile_targets.libtpu_available():
            p.error(compile_targets.LIBTPU_HINT)
        rows += tpu(args.topology, args.unpadded_tpu)
    if args.only != "tpu":
        missing = compile_targets.cuda_compiler_missing()
        if missing:
            p.error(missing)
        rows += gpu(args.gpu, num_warps=args.gpu_warps, block_h=args.gpu_block_h,
                    pages_per_block=args.gpu_pages_per_block)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1, default=str))
    return rows


if __name__ == "__main__":
    main()
