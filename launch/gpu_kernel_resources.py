"""Our GPU kernels compiled for an H200 on this CPU host, at a tiling of your choice: what
ptxas gives each (registers, spills, shared memory, launch) and what that allows per SM.

    python launch/gpu_kernel_resources.py                        # the defaults
    python launch/gpu_kernel_resources.py --moe-bn 64            # gate/up N block 64
    python launch/gpu_kernel_resources.py --prefill-rows 128 --prefill-pages 4  # 128 x 64
    python launch/gpu_kernel_resources.py --mxfp4                # + W4A16 MoE, GPT-OSS-20B

Needs the `gpu-compile` extra (the CUDA plugin and ptxas), no GPU. Qwen3-30B-A3B shapes,
bfloat16: the MoE's two Mosaic GPU kernels (stacked [2, 128, ...] experts, 64 tokens),
and the Triton decode and ragged prefill attention (32 / 4 heads, head_dim 128, 16-token
pages). Prints one line per kernel and writes --out (JSON) if given.

--mxfp4 adds the MoE kernels with GPT-OSS-20B's packed MXFP4 experts (W4A16, issue #31:
D = F = 2880, 32 experts, top-4, biases, clamped SwiGLU, int8 [2, 32, K/2, N] codes and
e8m0 [2, 32, k, N] scales, k as quant.py stores them (K/32 or padded), 64 tokens) and
the dequantised-copy audit of that program (lp_jax.aot.audit.dequantised_copies: no
16/32-bit value shaped like one layer's experts, logical or packed, in its StableHLO or
its compiled HLO).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from lp_jax.aot import resources  # noqa: E402
from pallas_kernels import compile_targets  # noqa: E402

sd = jax.ShapeDtypeStruct
REGS_PER_SM, SMEM_PER_SM, THREADS_PER_SM = 65536, 233472, 2048


def occupancy(k: dict) -> dict:
    """Blocks and warps an SM can hold, and what limits them (registers are allocated
    per warp in 256-register units; 1 KiB of shared memory is reserved a block)."""
    threads = k["threads"][0] * k["threads"][1] * k["threads"][2]
    warps = -(-threads // 32)
    limits = {"registers": REGS_PER_SM // (warps * -(-k["registers"] * 32 // 256) * 256),
              "shared memory": SMEM_PER_SM // (k.get("shared_bytes", 0)
                                               + k.get("static_smem", 0) + 1024),
              "threads": THREADS_PER_SM // threads}
    blocks = min(limits.values())
    return dict(blocks_per_sm=blocks, warps_per_sm=blocks * warps,
                limited_by=[n for n, v in limits.items() if v == blocks])


def compile_kernels(fn, args, gpu: str) -> tuple[list[dict], float]:
    mesh = compile_targets.cuda_mesh(gpu)
    with tempfile.TemporaryDirectory() as tmp:
        dump = Path(tmp)
        t = time.perf_counter()
        with jax.set_mesh(mesh), resources.mosaic_dumps(dump / "mosaic"):
            lowered = jax.jit(fn).lower(*compile_targets._shard_args(args, mesh, None))
            lowered.compile(compiler_options=resources.xla_dump_options(dump / "xla"))
        seconds = time.perf_counter() - t
        kernels = resources.collect(dump / "xla", dump / "mosaic", compile_targets.ptxas_path())
    return [k for k in kernels if k["ours"]], seconds


def compile_mxfp4_moe(gpu: str, tiling) -> tuple[list[dict], float, list[str]]:
    """The W4A16 MXFP4 MoE at GPT-OSS-20B shapes: (our kernels, compile seconds, the
    dequantised-copy audit's findings, [] when it passes)."""
    from lp_jax.aot.audit import dequantised_copies
    from pallas_kernels import quant
    from pallas_kernels.moe.gpu import moe_ffn_gpu
    from pallas_kernels.moe.ref import MoEActivation

    T, D, E, A, F, L = 64, 2880, 32, 4, 2880, 2
    s = quant.MXFP4
    args = (sd((T, D), jnp.bfloat16), sd((T, E), jnp.float32),
            sd((L, E, *s.stored_shape(D, 2 * F)), s.weight_dtype),
            sd((L, E, *s.stored_shape(F, D)), s.weight_dtype),
            sd((L, E, *s.scale_shape(D, 2 * F)), s.scale_dtype),
            sd((L, E, *s.scale_shape(F, D)), s.scale_dtype),
            sd((L, E, 2 * F), jnp.bfloat16), sd((L, E, D), jnp.bfloat16), sd((), jnp.int32))
    act = MoEActivation("gpt_oss_clamped", limit=7.0, alpha=1.702)

    def moe(x, logits, w_gu, w_d, s_gu, s_d, b_gu, b_d, layer):
        return moe_ffn_gpu(x, logits, w_gu, w_d, layer=layer, top_k=A, norm_topk_prob=True,
                           biases=(b_gu, b_d), activation=act, scales=(s_gu, s_d),
                           scheme=s, tiling=tiling)[0]

    layers = [(L, E, D, 2 * F), (L, E, F, D), (L, E, D // 2, 2 * F), (L, E, F // 2, D)]
    shapes = {w for full in layers for w in (full, full[1:], (1, *full[1:]))}
    mesh = compile_targets.cuda_mesh(gpu)
    with tempfile.TemporaryDirectory() as tmp:
        dump = Path(tmp)
        t = time.perf_counter()
        with jax.set_mesh(mesh), resources.mosaic_dumps(dump / "mosaic"):
            lowered = jax.jit(moe).lower(*compile_targets._shard_args(args, mesh, None))
            compiled = lowered.compile(
                compiler_options=resources.xla_dump_options(dump / "xla"))
        seconds = time.perf_counter() - t
        kernels = resources.collect(dump / "xla", dump / "mosaic", compile_targets.ptxas_path())
    found = dequantised_copies(lowered.as_text(), shapes)
    found += dequantised_copies(compiled.as_text(), shapes)
    return [k for k in kernels if k["ours"]], seconds, found


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpu", default="h200", choices=compile_targets.GPU_TARGETS)
    p.add_argument("--moe-tm", type=int, default=64)
    p.add_argument("--moe-bn", type=int, default=128, help="gate/up N block")
    p.add_argument("--moe-down-bn", type=int, default=256)
    p.add_argument("--moe-stages", type=int, default=4)
    p.add_argument("--prefill-rows", type=int, default=None,
                   help="query rows a program (default: the kernel's, PREFILL_BLOCK_ROWS)")
    p.add_argument("--prefill-pages", type=int, default=None,
                   help="pages a flash step (default: the kernel's prefill_keys_per_step)")
    p.add_argument("--prefill-warps", type=int, default=8)
    p.add_argument("--prefill-stages", type=int, default=2)
    p.add_argument("--decode-warps", type=int, default=4)
    p.add_argument("--mxfp4", action="store_true",
                   help="also the W4A16 MXFP4 MoE at GPT-OSS-20B shapes, with the audit")
    p.add_argument("--only-mxfp4", action="store_true", help="that one alone")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    missing = compile_targets.cuda_compiler_missing()
    if missing:
        p.error(missing)
    from pallas_kernels.attention import gpu as attention
    from pallas_kernels.moe.gpu import GpuTiling, moe_ffn_gpu

    tiling = GpuTiling(tm=args.moe_tm, gate_up_bn=args.moe_bn, down_bn=args.moe_down_bn,
                       stages=args.moe_stages)
    T, D, E, A, F, L = 64, 2048, 128, 8, 768, 2
    moe_args = (sd((T, D), jnp.bfloat16), sd((T, E), jnp.float32),
                sd((L, E, D, 2 * F), jnp.bfloat16), sd((L, E, F, D), jnp.bfloat16),
                sd((), jnp.int32))
    N, K, H, S, B, C = 32, 4, 128, 16, 8, 16
    # the 48-layer step's pool (12.9 GB): its 64-bit page offsets cost registers
    attn_args = (sd((64, N, H), jnp.bfloat16), sd((393216, S, 2 * K, H), jnp.bfloat16),
                 sd((B + 1,), jnp.int32), sd((B,), jnp.int32), sd((B, C), jnp.int32),
                 sd((), jnp.int32), sd((B, N, H), jnp.bfloat16))

    def moe(x, logits, w_gate_up, w_down, layer):
        return moe_ffn_gpu(x, logits, w_gate_up, w_down, layer=layer, top_k=A,
                           norm_topk_prob=True, tiling=tiling)[0]

    def attn(q, kv, starts, lens, table, n, q_dec):
        return (attention.ragged_paged_attention(
                    q, kv, starts, lens, table, n, sm_scale=H**-0.5,
                    block_rows=args.prefill_rows, pages_per_block=args.prefill_pages,
                    num_warps=args.prefill_warps, num_stages=args.prefill_stages),
                attention.decode_attention(q_dec, kv, lens, table, sm_scale=H**-0.5,
                                           num_warps=args.decode_warps))

    rows, audit = [], None
    jobs = [] if args.only_mxfp4 else [("moe", moe, moe_args), ("attention", attn, attn_args)]
    if args.mxfp4 or args.only_mxfp4:
        jobs.append(("moe-mxfp4 (gpt-oss-20b)", None, None))
    for name, fn, fargs in jobs:
        if fn is None:
            kernels, seconds, audit = compile_mxfp4_moe(args.gpu, tiling)
            print(f"  audit (16/32-bit values shaped like one layer's experts): "
                  f"{'pass' if not audit else audit}")
        else:
            kernels, seconds = compile_kernels(fn, fargs, args.gpu)
        print(f"{name}: compiled in {seconds:.1f} s")
        for k in kernels:
            k.update(occupancy(k))
            rows.append(k)
            print(f"  {resources.short(k)}; {k['blocks_per_sm']} blocks ({k['warps_per_sm']} "
                  f"warps) an SM, limited by {', '.join(k['limited_by'])}")
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                        "kernels": rows, "mxfp4_audit": audit}, indent=1))
    return rows


if __name__ == "__main__":
    main()
