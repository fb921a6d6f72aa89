"""What lowers in the Hopper MoE kernel's packed-MXFP4 decode (issue #31, W4A16): the
decode step of `pallas_kernels.moe.gpu` cut into variants, each lowered by Mosaic GPU
(layout inference included, for an H200; no ptxas needed) in its own process with a
time limit.

The first kernel's K step (64 rows) is a [32, bn] int8 tile (bn = 64 here) of two e2m1
codes a byte, plus two e8m0 scale rows [bn] (low and high nibbles). Its variants, none
of which gave a kernel (BENCHMARKS.md):

  noscale    decode both nibble halves unscaled into rows [0, 32) / [32, 64) of a
             [64, bn] bf16 tile (32-row register tiles)
  row        the same, times each half's scale row broadcast over the 32 rows
  bcast64    a scale row loaded in WGMMA column layout, broadcast over 64 rows, stored
  cat        the halves concatenated to one 64-row tile cast to the WGMMA layout
  rescale64  noscale, then the 64-row tile reloaded in the WGMMA layout and scaled
  wgmma64    noscale's tile as the B operand of a [64, 64] x [64, bn] WGMMA, the
             accumulator times a scale row (scaling on the accumulator)

The kernel's K step now (128 rows) is a [64, bn] int8 tile, each nibble half a 64-row
register tile whose 32-row blocks take two scale rows (of the work item's [K/32, bn]
rows in shared memory, dynamic row index):

  tile64       the byte tile and scale rows loaded in inferred layouts, each half times
               a select (row < 32) between two broadcast scale rows, into a [128, bn] tile
  tile64w      the same, the byte tile loaded in the WGMMA layout and the scale rows in
               its column layout (WGMMA.reduce(0)): the kernel's decode
  tile64w_mma  tile64w's tile as the B operand of a [64, 128] x [128, bn] WGMMA

    .venv/bin/python launch/compile_mxfp4_gpu_decode.py [--timeout 60]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

VARIANTS = ("noscale", "row", "bcast64", "cat", "rescale64", "wgmma64", "tile64", "tile64w",
            "tile64w_mma")
K_SCALE_ROWS = 90  # GPT-OSS-20B: K/32
BN = 64


def lower(variant: str) -> None:
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from pallas_kernels import compile_targets
    from pallas_kernels.moe.gpu import _e2m1_times_scale

    W = plgpu.Layout.WGMMA

    def scale_row(s_smem, h, layout=None):
        s = (plgpu.load(s_smem.at[h, 0], layout=layout) if layout else s_smem[h, 0])
        return jax.lax.bitcast_convert_type((s.astype(jnp.int32) & 0xFF) << 23, jnp.float32)

    if variant.startswith("tile64"):
        return lower_tile64(variant)

    def body(x_gmem, w_gmem, s_gmem, o_gmem):
        def scope(x_smem, w_smem, s_smem, o_smem, wb, bar):
            for src, dst in ((x_gmem, x_smem), (w_gmem, w_smem), (s_gmem, s_smem)):
                plgpu.copy_gmem_to_smem(src, dst, bar)
                plgpu.barrier_wait(bar)
            b = w_smem[...].astype(jnp.int32) & 0xFF
            halves = (b & 15, b >> 4)
            if variant in ("noscale", "rescale64", "wgmma64"):
                dst = wb if variant == "wgmma64" else o_smem
                for h, code in enumerate(halves):
                    dst[pl.ds(h * 32, 32), :] = _e2m1_times_scale(code, 1.0, jnp.bfloat16)
            if variant == "wgmma64":
                plgpu.commit_smem()

                def mma(acc):
                    plgpu.wgmma(acc, x_smem, wb)
                    plgpu.wgmma_wait(0)
                    return acc[...]

                acc = pl.run_scoped(mma, plgpu.ACC((64, BN)))
                s = jax.lax.broadcast_in_dim(scale_row(s_smem, 0, W.reduce(0)), acc.shape, [1])
                o_smem[...] = (acc * s).astype(jnp.bfloat16)
            if variant == "row":
                for h, code in enumerate(halves):
                    s = jax.lax.broadcast_in_dim(scale_row(s_smem, h), code.shape, [1])
                    o_smem[pl.ds(h * 32, 32), :] = _e2m1_times_scale(code, s, jnp.bfloat16)
            if variant == "bcast64":
                s = scale_row(s_smem, 0, W.reduce(0))
                o_smem[...] = jax.lax.broadcast_in_dim(s, (64, BN), [1]).astype(jnp.bfloat16)
            if variant == "cat":
                codes = plgpu.layout_cast(jnp.concatenate(halves, axis=0), W)
                o_smem[...] = _e2m1_times_scale(codes, 1.0, jnp.bfloat16)
            if variant == "rescale64":
                plgpu.commit_smem()
                s = jax.lax.broadcast_in_dim(scale_row(s_smem, 0, W.reduce(0)), (64, BN), [1])
                o_smem[...] = (plgpu.load(o_smem, layout=W).astype(jnp.float32)
                               * s).astype(jnp.bfloat16)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_gmem)
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(scope, plgpu.SMEM((64, 64), jnp.bfloat16), plgpu.SMEM((32, BN), jnp.int8),
                      plgpu.SMEM((2, 1, BN), jnp.int8), plgpu.SMEM((64, BN), jnp.bfloat16),
                      plgpu.SMEM((64, BN), jnp.bfloat16), plgpu.Barrier(num_arrivals=1))

    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((64, BN), jnp.bfloat16), grid=(1,),
        grid_names=("sm",), compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
    sd = jax.ShapeDtypeStruct
    with compile_targets.mosaic_gpu_modules():
        compile_targets.export_cuda(kernel, (sd((64, 64), jnp.bfloat16), sd((32, BN), jnp.int8),
                                             sd((2, 1, BN), jnp.int8))).mlir_module()


def lower_tile64(variant: str) -> None:
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from pallas_kernels import compile_targets
    from pallas_kernels.moe.gpu import _e2m1_times_scale

    W = plgpu.Layout.WGMMA
    laid = variant != "tile64"

    def body(x_gmem, w_gmem, s_gmem, o_gmem):
        def scope(x_smem, w_smem, s_smem, wb, o_smem, bar):
            for src, dst in ((x_gmem, x_smem), (w_gmem, w_smem), (s_gmem, s_smem)):
                plgpu.copy_gmem_to_smem(src, dst, bar)
                plgpu.barrier_wait(bar)
            b = plgpu.load(w_smem, layout=W) if laid else w_smem[...]
            b = b.astype(jnp.int32) & 0xFF
            top = jax.lax.broadcasted_iota(jnp.int32, b.shape, 0) < 32
            k = jax.lax.axis_index("sm")  # a dynamic scale row, as the kernel's step has

            def scale_row(r):
                s = plgpu.load(s_smem.at[r], layout=W.reduce(0)) if laid else s_smem[r]
                s = jax.lax.bitcast_convert_type((s.astype(jnp.int32) & 0xFF) << 23,
                                                 jnp.float32)
                return jax.lax.broadcast_in_dim(s, b.shape, [1])

            for h, code in enumerate((b & 15, b >> 4)):
                r = 2 * k + h * (K_SCALE_ROWS // 2)
                s = jnp.where(top, scale_row(r), scale_row(r + 1))
                wb[pl.ds(h * 64, 64), :] = _e2m1_times_scale(code, s, jnp.bfloat16)
            plgpu.commit_smem()
            if variant == "tile64w_mma":
                def mma(acc):
                    plgpu.wgmma(acc, x_smem, wb)
                    plgpu.wgmma_wait(0)
                    return acc[...]

                o_smem[...] = pl.run_scoped(mma, plgpu.ACC((64, BN))).astype(jnp.bfloat16)
            else:
                o_smem[...] = wb[pl.ds(0, 64), :]
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_gmem)
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(scope, plgpu.SMEM((64, 128), jnp.bfloat16),
                      plgpu.SMEM((64, BN), jnp.int8),
                      plgpu.SMEM((K_SCALE_ROWS, BN), jnp.int8),
                      plgpu.SMEM((128, BN), jnp.bfloat16), plgpu.SMEM((64, BN), jnp.bfloat16),
                      plgpu.Barrier(num_arrivals=1))

    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((64, BN), jnp.bfloat16), grid=(1,),
        grid_names=("sm",), compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
    sd = jax.ShapeDtypeStruct
    with compile_targets.mosaic_gpu_modules():
        compile_targets.export_cuda(kernel, (sd((64, 128), jnp.bfloat16), sd((64, BN), jnp.int8),
                                             sd((K_SCALE_ROWS, BN), jnp.int8))).mlir_module()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--variant", choices=VARIANTS, help="lower this one here (internal)")
    args = p.parse_args()
    if args.variant:
        lower(args.variant)
        return
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    for v in VARIANTS:
        t = time.perf_counter()
        try:
            r = subprocess.run([sys.executable, __file__, "--variant", v], env=env,
                               capture_output=True, text=True, timeout=args.timeout)
            err = [ln for ln in r.stderr.splitlines() if "Error:" in ln]
            out = "lowers" if r.returncode == 0 else (err[-1] if err else f"rc {r.returncode}")
        except subprocess.TimeoutExpired:
            out = f"layout search still running after {args.timeout:.0f} s (killed)"
        print(f"{v:10s} {time.perf_counter() - t:6.1f} s  {out[:200]}")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
