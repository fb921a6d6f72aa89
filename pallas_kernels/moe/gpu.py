"""MoE feed-forward on Hopper GPUs with Pallas Mosaic GPU.

One grouped-matmul kernel, `tile_gmm`, used twice over the padded-tile layout of
`layout.py`:

1. gate/up with the SwiGLU epilogue fused: for tile m and F block n it accumulates
   x_tile @ Wg[e][:, n] and x_tile @ Wu[e][:, n] in two WGMMA accumulators (the up
   columns are block n + F/bn of the same [E, D, 2F] array) and stores
   SiLU(gate) * up once, in the activation dtype: no [R, 2F] intermediate.
2. down: the same kernel without the epilogue, h_PF @ Wd[e].

Work items are (tile, n) pairs for the `num_tiles` used tiles only (a dynamic loop
bound read in the kernel), spread over the SMs by `plgpu.nd_loop`; every tile belongs
to exactly one expert, so an expert with no rows is never read, every store is a whole
tile (no masked or partial stores) and no two SMs write the same rows. The K loop is
a TMA + WGMMA pipeline (`plgpu.emit_pipeline`) with delay_release=1: after step s it
refills the shared-memory slots that step s-1's WGMMAs read. WGMMAs run
asynchronously, so each step ends with `plgpu.wgmma_wait(n)` (n = this step's WGMMA
groups, one per accumulator), which leaves only the current step's WGMMAs in flight,
as JAX's Hopper matmul does; without it TMA could overwrite operands a WGMMA is still
reading. The GPU interpreter runs WGMMAs synchronously (jax 0.11.2), so its race
detector cannot see this; tests/test_moe_kernels.py checks the wait in the lowered
Mosaic module instead.

Epilogues: act(gate, up) on the float32 accumulators (a `ref.MoEActivation`: SiLU(gate) * up,
or GPT-OSS's clamped SwiGLU) for gate/up, the identity for down. GPT-OSS expert
biases ([E, N] / stacked [L, E, N], viewed for free as [G, N]) are one more operand:
each work item TMAs its expert's bn-wide bias slices (gate and up) into shared memory
and adds them, broadcast over the rows, to the accumulators in float32 before the
activation (down: before the store, so each routed row carries its down bias into the
weighted combine). Without biases the kernel takes exactly Qwen3's operands.
Widths that no 128-wide block divides (GPT-OSS: 2880) take 64-wide N blocks
(`_fit_block`), still whole 128-byte swizzle rows.

Quantized weights (issue 31; int8 / e4m3 with `quant.py` scales): WGMMA takes an
N-major B operand from shared memory only in 16 bits, so each K step's 8-bit weight
tiles (TMA'd as stored: half the bytes and half the pipeline's shared memory) are
loaded into registers, converted to the activations' 16-bit dtype (exact for int8;
e4m3 goes through float16, the one conversion sm_90's ptxas has, also exact) and
stored into one 16-bit shared-memory tile per accumulator, which the WGMMAs read
after `commit_smem` (a proxy fence and a warpgroup barrier). The step then waits for
all its WGMMAs (wgmma_wait(0)) before the next step rewrites those tiles, which gives
up the overlap of one step's MMAs with the next step's conversion. Per-channel scales
multiply the float32 accumulators in the epilogue (a bn-wide slice by TMA, like the
biases); fp8 128 x 128 block scales multiply each converted tile by its block's scale
(one block per tile: bn <= 128, bk = 64 divides 128), so those weights are rounded to
bfloat16 once after scaling (2^-9 relative), unlike the TPU kernels' exact float32
scaling. ptxas at Qwen3-30B-A3B shapes for an H200 (`test_compile_matrix` in
tests/test_moe_quant.py): gate/up 206 registers (int8, fp8) and 255 (fp8 blocks: at
the cap, no spill), down 227 / 231 / 168, no spills, no stack, 128 KiB of shared
memory (fp8-block down: 80 KiB).

MXFP4 (W4A16, issue 31; quant.py's packed layout: int8 [K/2, N], byte row j the e2m1
codes of rows j and j + K/2, e8m0 scales [K/32, N], maybe padded with rows past K/32 that
are never read): a K step is 128 rows, the 64 byte rows [r0, r0 + 64) TMA'd as stored (a
quarter of bf16's bytes; a `pl.Element` block, r0 = min(64k, K/2 - 64)), loaded into
registers in the WGMMA layout as one 64-row tile and decoded (integer ops and selects;
the e8m0 byte becomes the float32 exponent field, so scaling is exact) into one 16-bit
[128, bn] shared-memory tile per accumulator, low-nibble rows over high ones, each
nibble half a 64-row register tile whose two 32-row scale blocks are a select between
two broadcast scale rows. A work item's K/32 scale rows (gate and up: the scales viewed
as [G, k, 2, F]) come by one TMA issued before its K loop and waited for in step 0,
behind the pipeline's first loads. lhs's columns are permuted to match
(`mxfp4_column_order`: step k reads x columns r0 + [0, 64) and K/2 + r0 + [0, 64)), for x
inside the row gather XLA already makes, for h as one more copy of h between the two
kernels. When 64 does not
divide K/2 (GPT-OSS-20B: 1440 = 22.5 x 64) the last step overlaps the one before and the
lhs columns of its repeated byte rows are zeros, so the weights are never copied or
padded. Needs K a multiple of 64 and at least 128. Mosaic GPU's layout inference (jax
0.11.2) finds no layout for 32-row decoded register tiles (the first version of this
path), hence the 64-row tiles; ptxas for an H200 at GPT-OSS-20B shapes: gate/up 224
registers, down 159, no spills, 140 / 102 KiB of shared memory (BENCHMARKS.md, "MXFP4
in the Hopper MoE kernel (W4A16) lowers and compiles for the H200").

Weights: rhs is [G, K, N]; the weight tile of a work item is `rhs.at[g]`, a ref slice
in global memory with g = tile_group_M[m]. A stacked model's [L, E, ...] weights come
whole, reshaped (for free) to [L*E, ...], with layer*E added to the tile groups, so no
per-layer copy of the weights is made.

x is NOT gathered inside the kernel: Hopper's TMA has no row gather, and a TMA into
the swizzled WGMMA operand layout needs a row offset that is a multiple of the 8-row
swizzle tile. Instead XLA materialises an expert-sorted copy x_SD = x_TD[token_ids_S]
(the copy `ref.ref_moe_ffn` makes, with each expert's rows starting on a multiple of 8:
at most 7 extra rows per active expert, plus tm spare rows at the end) and each tile
reads tm consecutive rows of it from tile_src_M[m]. The tm-row padding of the tile
layout itself costs no copy.

JAX's shipped `ragged_dot_mgpu` is not used inside `moe_ffn`: its grid covers
cdiv(M, block_m) + G - 1 work items whatever the routing, and items that fall on no
group or on an empty group starting mid-block still run the K pipeline over an
expert's weights (expert 0 for the spare ones), i.e. it loads weights of experts with
no tokens; it also unrolls a loop over all G groups per work item. And in jax 0.11.2
its K loop has the race described above (delay_release=1, no wgmma_wait; the same
lowered-module check flags it), so it is no safe fallback either. It is timed next to
this backend in `launch/bench_kernels.py`.

Cost estimates: `plgpu.kernel` takes none and the GPU lowering would drop one, so the
two calls' estimates are `cost.estimate(cost.GPU_MOE_GATE_UP / GPU_MOE_DOWN, ...)`
(`cost.moe_matmul`, uniform routing). In the HLO both are `mosaic_gpu` custom calls,
told apart by their weight operand. Bytes count each active expert's weights once: a
tile's (tile, n) work items, and the tiles of one expert, run side by side, so repeats
come from L2 (an assumption until the H200 measures it).

Status: passes the GPU interpreter tests and goes through
Mosaic GPU lowering (layout inference, shared-memory budget) for an H200 at
Qwen3-30B-A3B shapes with stacked weights, and at GPT-OSS-20B shapes with biases, in
tests/test_moe_kernels.py; the PTX compile, a run and the timings need the H200.
Quantized: int8 and fp8 blocks pass the GPU interpreter (tests/test_moe_quant.py), MXFP4
too (tests/test_moe_quant_gpu_fp4.py), and all four schemes compile through ptxas
(above); none has run on a GPU, and the
interpreter runs WGMMAs synchronously, so it cannot check the wgmma_wait(0) ordering.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.moe.layout import combine_padded, make_tile_layout
from pallas_kernels.moe.ref import (
    SILU,
    SOFTMAX,
    MoEActivation,
    Router,
    check_bias,
    check_scales,
    moe_stats,
    route,
    stacked_experts,
)


@dataclasses.dataclass(frozen=True)
class GpuTiling:
    """tm: rows per tile (= WGMMA block_m; experts are padded to it). bk: K block (None:
    one 128-byte swizzle row: 64 bf16, 32 float32). gate_up_bn / down_bn: N blocks.
    stages: pipeline depth (lowered if the stages would not fit in shared memory)."""

    tm: int = 64
    bk: int | None = None
    gate_up_bn: int = 128
    down_bn: int = 256
    stages: int = 4


_SMEM_BUDGET = 200 * 1024  # of the 227 KiB a Hopper block may use; the rest: barriers


def _num_sms() -> int:
    try:
        dev = jax.devices()[0]
        if dev.platform == "gpu" and getattr(dev, "core_count", None):
            return int(dev.core_count)
    except RuntimeError:
        pass
    return 132  # H100 / H200 SXM


def _interpret_arg(interpret):
    if isinstance(interpret, plgpu.InterpretGPUParams):
        return interpret
    return plgpu.InterpretGPUParams() if interpret else None


def _fit_block(dim: int, preferred: int) -> int:
    """The preferred block, halved until it divides dim (tiny test shapes)."""
    b = min(preferred, dim)
    while dim % b:
        b //= 2
    return b


def tile_gmm(
    lhs_SK: jax.Array,
    rhs_GKN2: jax.Array,
    tile_group_M: jax.Array,
    row_start_M: jax.Array,
    num_tiles: jax.Array,
    *,
    swiglu: bool,
    tm: int,
    bk: int,
    bn: int,
    stages: int,
    out_dtype=None,
    row_align: int = 8,
    num_sms: int | None = None,
    bias=None,
    act=SILU,
    scale=None,
    scheme=None,
    interpret: bool | plgpu.InterpretGPUParams = False,
) -> jax.Array:
    """out[m*tm:(m+1)*tm] = f(lhs[row_start[m] : row_start[m]+tm] @ rhs[g] + bias[g]),
    g = tile_group[m].

    scale, scheme: 8-bit rhs (int8 / e4m3) and its scales [G, k, n] (`quant.py`): each K
    step converts its rhs tiles in registers to lhs's 16-bit dtype into shared memory
    for the WGMMA (see the module docstring); per-channel scales multiply the float32
    accumulators before f, block scales the converted tile.

    For m < num_tiles only. rhs is [G, K, N] (G = E, or L*E for stacked layers with
    the layer's offset already in tile_group). swiglu=False: f is the identity and out
    is [M*tm, N]. swiglu=True: rhs is [G, K, 2F], f(z) = act(z[:, :F], z[:, F:])
    (a `ref.MoEActivation`: SiLU(gate) * up unless given), out is [M*tm, F].
    bias: None, or [E, N or 2F] / stacked [L, E, ...] like rhs, viewed (for free) as
    [G, ...]: each work item TMAs its expert's bn-wide slices (gate and up) into shared
    memory and adds them to the float32 accumulators before f.
    lhs must have row_start[m] + tm rows for every used tile; every row_start must be a
    multiple of row_align (8: the row tile of the swizzled operand layout).
    """
    S, K = lhs_SK.shape
    G, K2, N2 = rhs_GKN2.shape
    M = tile_group_M.shape[0]
    N = N2 // 2 if swiglu else N2
    out_dtype = lhs_SK.dtype if out_dtype is None else out_dtype
    packed = scale is not None and scheme.pack > 1  # MXFP4: two e2m1 codes a byte
    if packed:  # lhs is [S, mxfp4_lhs_width(K2)]: K2 the logical K, padded to whole steps
        K2 *= scheme.pack
        _check_mxfp4_step(scheme, K2, bk)
        if K == mxfp4_lhs_width(K2):
            K = K2
    if K != K2 or (K % bk and not packed) or N % bn:
        raise ValueError(f"shapes: lhs {lhs_SK.shape} rhs {rhs_GKN2.shape}, bk={bk} bn={bn}")
    if jnp.dtype(lhs_SK.dtype).itemsize != 2 and not interpret:
        # The weights are [K, N] (N-major) in shared memory; WGMMA takes an N-major B
        # operand only for 16-bit types (tf32 needs K-major B).
        raise NotImplementedError(
            f"the gpu MoE kernel needs bfloat16/float16 operands, got {lhs_SK.dtype}; "
            "use backend='xla' for float32"
        )
    if tm % row_align:
        raise ValueError(f"tm={tm} must be a multiple of row_align={row_align}")
    quantized = scale is not None
    if not quantized and lhs_SK.dtype != rhs_GKN2.dtype:
        raise ValueError(f"lhs {lhs_SK.dtype} and rhs {rhs_GKN2.dtype} dtypes differ")
    grid_n = N // bn
    grid_k = -(-K // bk) if packed else K // bk  # packed: the last step may overlap
    n_accs = 2 if swiglu else 1
    col_offsets = (0, grid_n) if swiglu else (0,)  # gate (and up) blocks in rhs's N
    per_channel = quantized and scheme.block_k is None
    if quantized and not packed and not per_channel and (scheme.block_k % bk or scheme.block_n % bn
                                          or (swiglu and N % scheme.block_n)):
        raise ValueError(f"block scales {scheme.block_k} x {scheme.block_n} need K / N "
                         f"steps that divide them: bk={bk} bn={bn} N={N}")
    in_item, out_item = jnp.dtype(lhs_SK.dtype).itemsize, jnp.dtype(out_dtype).itemsize
    w_item = jnp.dtype(rhs_GKN2.dtype).itemsize
    stage_bytes = tm * bk * in_item + n_accs * bk * bn * w_item
    if packed:  # bk/2 byte rows of codes
        stage_bytes = tm * bk * in_item + n_accs * (bk // 2) * bn
    bias_bytes = 0 if bias is None else n_accs * bn * bias.dtype.itemsize
    if quantized:  # the converted tiles (one per accumulator) and per-channel scales
        bias_bytes += n_accs * bk * bn * in_item + n_accs * bn * 4
    if packed:  # a work item's e8m0 scale rows, all K/32 of them (one load an item)
        bias_bytes += n_accs * (K // 32) * bn
    while (stages > 2
           and stages * stage_bytes + tm * bn * out_item + bias_bytes > _SMEM_BUDGET):
        stages -= 1
    bias_args = () if bias is None else (bias.reshape(-1, bias.shape[-1]),)  # [G, N2]
    # per channel: [G, 1, N2] viewed as [G, N2] (free); blocks: [G, k, n] as they are
    scale_args = () if not quantized else (
        scale.reshape(scale.shape[0], -1) if per_channel else scale,)
    if packed:  # e8m0 bytes as int8 (a bitcast), [G, k, N2] viewed as [G, k, accs, N]:
        # the gate (and up) columns of N block n are [:, :, :, n*bn : (n+1)*bn]; rows past
        # K/32 are never read
        if scale.shape[-2] < K // 32:
            raise ValueError(f"mxfp4 scales {scale.shape} need at least K/32 = {K // 32} rows")
        scale_args = (jax.lax.bitcast_convert_type(scale, jnp.int8).reshape(
            G, scale.shape[-2], n_accs, N),)
    half = K // 2  # packed: byte rows of an expert's codes

    def body(tile_group_gmem, row_start_gmem, num_tiles_gmem, lhs_gmem, rhs_gmem, *refs):
        refs = list(refs)
        bias_gmem = refs.pop(0) if bias_args else None
        scale_gmem = refs.pop(0) if scale_args else None
        (out_gmem,) = refs

        @plgpu.nd_loop((num_tiles_gmem[0], grid_n), collective_axes="sm")
        def _work(info: plgpu.NDLoopInfo):
            m, n = info.index
            lhs_tile = lhs_gmem.at[pl.ds(pl.multiple_of(row_start_gmem[m], row_align), tm)]
            g = tile_group_gmem[m]
            rhs_expert = rhs_gmem.at[g]  # a ref slice in global memory
            if packed:  # step k: byte rows [r0, r0 + bk/2), r0 = min(k bk/2, K/2 - bk/2)
                rhs_specs = [
                    plgpu.BlockSpec((pl.Element(bk // 2), bn),
                                    lambda k, c=c: (_mxfp4_step_row(k, half, bk), n + c),
                                    delay_release=1)
                    for c in col_offsets
                ]
            else:
                rhs_specs = [
                    plgpu.BlockSpec((bk, bn), lambda k, c=c: (k, n + c), delay_release=1)
                    for c in col_offsets
                ]

            def mma_scope(*accs):
                if not quantized:
                    return pipeline(accs, (), None, None)
                bufs = [plgpu.SMEM((bk, bn), lhs_SK.dtype)] * n_accs  # converted tiles
                if packed:  # this item's scale rows [0, K/32), gate and up: one TMA
                    bufs += [plgpu.SMEM((K // 32, n_accs, bn), jnp.int8),
                             plgpu.Barrier(num_arrivals=1)]

                def scoped(*bufs):
                    wbufs, s_smem, barrier = bufs[:n_accs], None, None
                    if packed:  # waited for in step 0, behind the pipeline's first TMAs
                        s_smem, barrier = bufs[n_accs:]
                        plgpu.copy_gmem_to_smem(
                            scale_gmem.at[g, pl.ds(0, K // 32), :, pl.ds(n * bn, bn)],
                            s_smem, barrier)
                    return pipeline(accs, wbufs, s_smem, barrier)

                return pl.run_scoped(scoped, *bufs)

            def pipeline(accs, wbufs, s_smem, s_barrier):
                def step(idx, lhs_smem, *rhs_smems):
                    if packed:
                        @pl.when(idx[0] == 0)
                        def _():
                            plgpu.barrier_wait(s_barrier)

                        rhs_smems = _decode_mxfp4_step(
                            rhs_smems, s_smem, wbufs, lhs_smem.dtype,
                            _mxfp4_step_row(idx[0], half, bk) // 32, half // 32)
                    elif quantized:
                        rhs_smems = _dequantize_step(rhs_smems, wbufs, lhs_smem.dtype,
                                                     scale_gmem, g, idx[0], n, bk, bn,
                                                     col_offsets, None if per_channel
                                                     else scheme)
                    for acc, rhs_smem in zip(accs, rhs_smems, strict=True):
                        plgpu.wgmma(acc, lhs_smem, rhs_smem)
                    # delay_release=1: after this step the pipeline refills the slots
                    # the previous step's WGMMAs read. At most this step's groups (one
                    # per accumulator) may stay in flight: the previous ones are done.
                    # Quantized: none may, since the next step rewrites the converted
                    # tiles they read.
                    plgpu.wgmma_wait(0 if quantized else n_accs)

                plgpu.emit_pipeline(
                    step,
                    grid=(grid_k,),
                    in_specs=[
                        plgpu.BlockSpec((tm, bk), lambda k: (0, k), delay_release=1),
                        *rhs_specs,
                    ],
                    max_concurrent_steps=max(stages, 2),
                )(lhs_tile, *([rhs_expert] * n_accs))
                return tuple(acc[...] for acc in accs)

            accs = pl.run_scoped(mma_scope, *([plgpu.ACC((tm, bn))] * n_accs))
            if per_channel:
                accs = _add_bias(accs, scale_gmem.at[g], n, bn, col_offsets, jnp.multiply)
            if bias_gmem is not None:
                accs = _add_bias(accs, bias_gmem.at[g], n, bn, col_offsets)
            out = act(*accs) if swiglu else accs[0]

            @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((tm, bn), out_dtype))
            def _store(o_smem):
                o_smem[...] = out.astype(out_dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(
                    o_smem, out_gmem.at[pl.ds(m * tm, tm), pl.ds(n * bn, bn)]
                )
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((M * tm, N), out_dtype),
        grid=(num_sms or _num_sms(),),
        grid_names=("sm",),
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup,
        ),
        interpret=_interpret_arg(interpret),
    )
    return kernel(
        tile_group_M.astype(jnp.int32),
        row_start_M.astype(jnp.int32),
        jnp.reshape(num_tiles, (1,)).astype(jnp.int32),
        lhs_SK,
        rhs_GKN2,
        *bias_args,
        *scale_args,
    )


def _dequantize_step(rhs_smems, wbufs, dtype, scale_gmem, g, k, n, bk: int, bn: int,
                     col_offsets, block_scheme):
    """The 8-bit rhs tiles of one K step, converted in registers to `dtype` (exact for
    int8 and e4m3) and stored into the 16-bit shared-memory tiles `wbufs` that the WGMMAs
    read; with block scales (block_scheme), each tile times its block's scale (one
    block per tile: bk and bn divide the block) before the conversion."""
    for c, (rhs_smem, wbuf) in enumerate(zip(rhs_smems, wbufs, strict=True)):
        w = rhs_smem[...]
        if w.dtype == jnp.float8_e4m3fn:  # sm_90's ptxas converts e4m3 to f16 only
            w = w.astype(jnp.float16)  # exact
        if block_scheme is None:
            wbuf[...] = w.astype(dtype)
        else:
            s = scale_gmem[g, k * bk // block_scheme.block_k,
                           (n + col_offsets[c]) * bn // block_scheme.block_n]
            wbuf[...] = (w.astype(jnp.float32) * s).astype(dtype)
    plgpu.commit_smem()
    return wbufs


MXFP4_BK = 128  # logical K rows a step: 64 byte rows, each nibble half a 64-row tile


def _check_mxfp4_step(scheme, K: int, bk: int) -> None:
    """Refuses a packed-MXFP4 K step other than 128 rows (64 byte rows: its low nibbles
    are 64 rows of w's first half, its high nibbles the same rows of the second half, two
    e8m0 scale rows each) and a K that is not a multiple of 64 (K/2 whole scale blocks)
    or below 128 (one whole step)."""
    if scheme.pack != 2 or scheme.block_k != 32 or scheme.block_n != 1:
        raise NotImplementedError(f"the gpu MoE kernel packs only MXFP4 (2 codes a byte, "
                                  f"32 x 1 scale blocks), got {scheme}")
    if bk != MXFP4_BK or not mxfp4_fits(K):
        raise ValueError(f"mxfp4 on the gpu kernel: K steps of {MXFP4_BK} rows over a K "
                         f"that is a multiple of 64 and at least {MXFP4_BK}; got bk={bk}, "
                         f"K={K}")


def mxfp4_fits(K: int) -> bool:
    """Whether the packed-MXFP4 kernel takes a K (`_check_mxfp4_step`)."""
    return K % 64 == 0 and K >= MXFP4_BK


def _mxfp4_step_row(k, half: int, bk: int):
    """The first byte row of step k: k * bk/2, the last step moved back to end at K/2
    (half) when bk/2 does not divide it, so it overlaps the step before."""
    return jnp.minimum(k * (bk // 2), half - bk // 2)


def mxfp4_lhs_width(K: int) -> int:
    """Columns of the packed kernel's lhs: K rounded up to whole 128-row steps."""
    return -(-K // MXFP4_BK) * MXFP4_BK


def mxfp4_column_order(K: int):
    """(index, valid), numpy [mxfp4_lhs_width(K)]: lhs column i of the packed-MXFP4 kernel
    is x column index[i] where valid[i], else 0. Step k's 128 columns are the rows of w
    whose codes are its 64 byte rows [r0, r0 + 64) (quant.py's layout: byte row j holds
    rows j and j + K/2): r0 + [0, 64) then K/2 + r0 + [0, 64), so its decoded [128, bn]
    tile is low-nibble rows over high-nibble rows. r0 = min(64k, K/2 - 64): when 64 does
    not divide K/2 the last step overlaps the one before, and the byte rows that one
    covered already (below 64k) get zero lhs columns: they add 0 x w."""
    half, rows = K // 2, MXFP4_BK // 2
    k = np.arange(mxfp4_lhs_width(K) // MXFP4_BK)[:, None]
    r0 = np.minimum(k * rows, half - rows)
    j = r0 + np.arange(rows)[None, :]  # [steps, 64] byte rows
    valid = np.broadcast_to(j >= k * rows, j.shape)
    index = np.concatenate([j, j + half], axis=1).reshape(-1)
    return index, np.concatenate([valid, valid], axis=1).reshape(-1)


def mxfp4_lhs(x_SK: jax.Array) -> jax.Array:
    """x's columns in the packed kernel's order (`mxfp4_column_order`): one gather, with
    the zero columns of an overlapping last step."""
    index, valid = mxfp4_column_order(x_SK.shape[-1])
    return jnp.where(jnp.asarray(valid), x_SK[:, index], jnp.zeros((), x_SK.dtype))


def _e2m1_times_scale(code_i32, scale_f32, dtype):
    """e2m1 codes (int32 0..15) times their float32 scales, in `dtype`: integer ops,
    selects and one multiply (sm_90 has no fp4 type to convert from)."""
    e, m = (code_i32 >> 1) & 3, (code_i32 & 1).astype(jnp.float32)
    pow2 = jnp.where(e == 1, 1.0, jnp.where(e == 2, 2.0, 4.0))
    mag = jnp.where(e == 0, 0.5 * m, pow2 * (1.0 + 0.5 * m)) * scale_f32
    return jnp.where((code_i32 & 8) != 0, -mag, mag).astype(dtype)


def _decode_mxfp4_step(code_smems, s_smem, wbufs, dtype, s_lo, s_hi_offset: int):
    """One K step of packed MXFP4 weights decoded into the 16-bit shared-memory tiles the
    WGMMAs read: byte tile [64, bn] (loaded in the WGMMA register layout: one 64-row
    tile, which Mosaic GPU's layout inference accepts a broadcast scale row over) -> low
    nibbles times scale rows s_lo (tile rows [0, 32)) and s_lo + 1 ([32, 64)) into rows
    [0, 64), high nibbles times rows s_lo + s_hi_offset (K/64) and the one after into
    rows [64, 128). s_smem [K/32, accumulators, bn]: the work item's e8m0 bytes; the
    byte s is the float32 2^(s - 127) with s as its exponent field (s = 0, 2^-127, reads
    as 0: no checkpoint scale is that small)."""
    wgmma = plgpu.Layout.WGMMA
    rows = MXFP4_BK // 2
    for c, (code_smem, wbuf) in enumerate(zip(code_smems, wbufs, strict=True)):
        b = plgpu.load(code_smem, layout=wgmma).astype(jnp.int32) & 0xFF
        top = jax.lax.broadcasted_iota(jnp.int32, b.shape, 0) < 32

        def scale_row(r, shape=b.shape, c=c):
            s = plgpu.load(s_smem.at[r, c], layout=wgmma.reduce(0)).astype(jnp.int32) & 0xFF
            s = jax.lax.bitcast_convert_type(s << 23, jnp.float32)
            return jax.lax.broadcast_in_dim(s, shape, [1])

        for h, code in enumerate((b & 15, b >> 4)):
            r = s_lo + h * s_hi_offset
            s = jnp.where(top, scale_row(r), scale_row(r + 1))
            wbuf[pl.ds(h * rows, rows), :] = _e2m1_times_scale(code, s, dtype)
    plgpu.commit_smem()
    return wbufs


def _add_bias(accs, bias_N2, n, bn: int, col_offsets, op=jnp.add):
    """op(accs[c], bias_N2[(n + col_offsets[c]) * bn :][:bn]) over the rows, in float32
    (op: add for biases, multiply for per-channel weight scales). The slices (one
    expert's, in global memory) come by TMA into shared memory."""

    def scope(b_smem, barrier):
        for c, off in enumerate(col_offsets):
            plgpu.copy_gmem_to_smem(bias_N2.at[pl.ds((n + off) * bn, bn)], b_smem.at[c],
                                    barrier)
            plgpu.barrier_wait(barrier)
        return tuple(
            op(acc, jax.lax.broadcast_in_dim(b_smem[c].astype(jnp.float32), acc.shape, [1]))
            for c, acc in enumerate(accs))

    return pl.run_scoped(scope, plgpu.SMEM((len(col_offsets), bn), bias_N2.dtype),
                         plgpu.Barrier(num_arrivals=1))


def moe_ffn_gpu(
    x_TD: jax.Array,
    router_logits_TE: jax.Array,
    w_gate_up_LEDF2: jax.Array,
    w_down_LEFD: jax.Array,
    *,
    layer=None,
    top_k: int,
    norm_topk_prob: bool,
    token_mask_T: jax.Array | None = None,
    biases=None,
    activation: MoEActivation = SILU,
    scales=None,
    scheme=None,
    router: Router = SOFTMAX,
    correction_bias_E: jax.Array | None = None,
    tiling: GpuTiling = GpuTiling(),
    num_sms: int | None = None,
    interpret: bool | plgpu.InterpretGPUParams = False,
):
    """The `gpu` backend of `moe_ffn`. Returns (y_TD, stats) like `ref.ref_moe_ffn`.

    `biases` (b_gate_up, b_down) and `activation` (GPT-OSS) as in `ref.ref_moe_ffn`, the
    biases added in float32 in the epilogues: b_gate_up before the activation, b_down to
    each routed row before the weighted combine; stacked [L, E, ...] biases are passed
    whole, like the weights.

    Hardware needs bfloat16/float16 weights (WGMMA takes the N-major [K, N] weight tiles
    only for 16-bit types); float32 runs in interpret mode only (for tests), and
    `moe_ffn(backend="auto")` sends float32 to xla.

    Quantized weights (`scales`, `scheme`; quant.py): the tiles are converted to x's
    16-bit dtype in shared memory (module docstring); h is stored in x's dtype. Block
    scales cap the N blocks at the scale block (128).
    """
    D = x_TD.shape[1]
    w_gate_up_GDF2, w_down_GFD, group_offset = stacked_experts(
        w_gate_up_LEDF2, w_down_LEFD, layer)
    b_gate_up, b_down = check_bias(biases, w_gate_up_LEDF2, w_down_LEFD)
    if scales and jnp.dtype(w_gate_up_LEDF2.dtype) == jnp.dtype(jnp.float4_e2m1fn):
        raise NotImplementedError(
            "the gpu MoE kernel takes MXFP4 packed two e2m1 codes a byte (int8 [.., K/2, N], "
            "quant.MXFP4 / quant.pack_mxfp4), not float4_e2m1fn [.., K, N]")
    s_gate_up, s_down = check_scales(scales, scheme, w_gate_up_LEDF2, w_down_LEFD)
    if s_gate_up is not None:  # [L*E, k, n] like the weights
        s_gate_up = s_gate_up.reshape(-1, *s_gate_up.shape[-2:])
        s_down = s_down.reshape(-1, *s_down.shape[-2:])
    E = w_gate_up_LEDF2.shape[-3]
    packed = s_gate_up is not None and scheme.pack > 1  # MXFP4 (quant.py's layout)
    F = w_gate_up_GDF2.shape[-1] // 2
    tm = tiling.tm
    cdt = w_gate_up_GDF2.dtype if s_gate_up is None else x_TD.dtype  # the MMA dtype
    bk = tiling.bk or (MXFP4_BK if packed else 128 // jnp.dtype(cdt).itemsize)
    if packed and bk != MXFP4_BK:
        raise ValueError(f"mxfp4 on the gpu kernel takes K steps of {MXFP4_BK} rows, "
                         f"got tiling.bk={tiling.bk}")
    weights_TA, expert_ids_TA = route(router_logits_TE, top_k, norm_topk_prob, router,
                                      correction_bias_E)
    if token_mask_T is not None:
        weights_TA = jnp.where(token_mask_T[:, None], weights_TA, 0.0)
    layout = make_tile_layout(expert_ids_TA, E, token_mask_T, tm)
    M = layout.tile_group_M.shape[0]

    # Expert-sorted copy of x, experts 8-row aligned (see the module docstring); MXFP4:
    # its columns in the packed kernel's K order (the same gather, a permuted index).
    x_cdt = x_TD.astype(cdt)
    if packed:
        x_cdt = mxfp4_lhs(x_cdt)
    x_SD = x_cdt[layout.token_ids_S]
    h_dtype = w_down_GFD.dtype if s_down is None else cdt
    common = dict(
        tile_group_M=layout.tile_group_M + group_offset, num_tiles=layout.num_tiles, tm=tm,
        stages=tiling.stages, num_sms=num_sms, interpret=interpret,
    )
    # fp8 block scales: one scale block per tile (bn at most block_n)
    bn_cap = (scheme.block_n if s_gate_up is not None and scheme.block_k and not packed
              else 1 << 30)
    h_PF = tile_gmm(
        x_SD, w_gate_up_GDF2, row_start_M=layout.tile_src_M, swiglu=True,
        bk=bk if packed else _fit_block(D, bk), bn=_fit_block(F, min(tiling.gate_up_bn, bn_cap)),
        out_dtype=h_dtype, bias=b_gate_up, act=activation, scale=s_gate_up, scheme=scheme,
        **common,
    )
    if packed:  # h's columns in the down kernel's K order: a copy of h (activations)
        h_PF = mxfp4_lhs(h_PF)
    y_PD = tile_gmm(
        h_PF, w_down_GFD, row_start_M=jnp.arange(M, dtype=jnp.int32) * tm, swiglu=False,
        bk=bk if packed else _fit_block(F, bk), bn=_fit_block(D, min(tiling.down_bn, bn_cap)),
        out_dtype=x_TD.dtype, bias=b_down, scale=s_down, scheme=scheme, **common,
    )
    y_TD = combine_padded(y_PD, layout, weights_TA).astype(x_TD.dtype)
    return y_TD, moe_stats(layout.group_sizes_E, w_gate_up_LEDF2, w_down_LEFD,
                           b_gate_up, b_down, scales=scales or ())
