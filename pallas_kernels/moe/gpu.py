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
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.moe.layout import combine_padded, make_tile_layout
from pallas_kernels.moe.ref import (
    SILU,
    MoEActivation,
    check_bias,
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
    interpret: bool | plgpu.InterpretGPUParams = False,
) -> jax.Array:
    """out[m*tm:(m+1)*tm] = f(lhs[row_start[m] : row_start[m]+tm] @ rhs[g] + bias[g]),
    g = tile_group[m].

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
    if K != K2 or K % bk or N % bn:
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
    if lhs_SK.dtype != rhs_GKN2.dtype:
        raise ValueError(f"lhs {lhs_SK.dtype} and rhs {rhs_GKN2.dtype} dtypes differ")
    grid_n, grid_k = N // bn, K // bk
    n_accs = 2 if swiglu else 1
    col_offsets = (0, grid_n) if swiglu else (0,)  # gate (and up) blocks in rhs's N
    in_item, out_item = jnp.dtype(lhs_SK.dtype).itemsize, jnp.dtype(out_dtype).itemsize
    stage_bytes = (tm * bk + n_accs * bk * bn) * in_item
    bias_bytes = 0 if bias is None else n_accs * bn * bias.dtype.itemsize
    while (stages > 2
           and stages * stage_bytes + tm * bn * out_item + bias_bytes > _SMEM_BUDGET):
        stages -= 1
    bias_args = () if bias is None else (bias.reshape(-1, bias.shape[-1]),)  # [G, N2]

    def body(tile_group_gmem, row_start_gmem, num_tiles_gmem, lhs_gmem, rhs_gmem, *refs):
        bias_gmem, out_gmem = refs if bias_args else (None, *refs)

        @plgpu.nd_loop((num_tiles_gmem[0], grid_n), collective_axes="sm")
        def _work(info: plgpu.NDLoopInfo):
            m, n = info.index
            lhs_tile = lhs_gmem.at[pl.ds(pl.multiple_of(row_start_gmem[m], row_align), tm)]
            g = tile_group_gmem[m]
            rhs_expert = rhs_gmem.at[g]  # a ref slice in global memory
            rhs_specs = [
                plgpu.BlockSpec((bk, bn), lambda k, c=c: (k, n + c), delay_release=1)
                for c in col_offsets
            ]

            def mma_scope(*accs):
                def step(_, lhs_smem, *rhs_smems):
                    for acc, rhs_smem in zip(accs, rhs_smems, strict=True):
                        plgpu.wgmma(acc, lhs_smem, rhs_smem)
                    # delay_release=1: after this step the pipeline refills the slots
                    # the previous step's WGMMAs read. At most this step's groups (one
                    # per accumulator) may stay in flight: the previous ones are done.
                    plgpu.wgmma_wait(n_accs)

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
    )


def _add_bias(accs, bias_N2, n, bn: int, col_offsets):
    """accs[c] + bias_N2[(n + col_offsets[c]) * bn :][:bn] over the rows, in float32.
    The bias slices (one expert's, in global memory) come by TMA into shared memory."""

    def scope(b_smem, barrier):
        for c, off in enumerate(col_offsets):
            plgpu.copy_gmem_to_smem(bias_N2.at[pl.ds((n + off) * bn, bn)], b_smem.at[c],
                                    barrier)
            plgpu.barrier_wait(barrier)
        return tuple(
            acc + jax.lax.broadcast_in_dim(b_smem[c].astype(jnp.float32), acc.shape, [1])
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

    Quantized weights (`scales`, `scheme`) are not implemented here: `moe_ffn` sends
    them to xla_tiles; this raises NotImplementedError if given any.
    """
    if scales or scheme is not None:
        raise NotImplementedError(
            "the Hopper MoE kernel takes 16-bit weights only (no shared-memory dequantise "
            "yet); moe_ffn(backend='gpu') runs quantized experts on xla_tiles")
    D = x_TD.shape[1]
    w_gate_up_GDF2, w_down_GFD, group_offset = stacked_experts(
        w_gate_up_LEDF2, w_down_LEFD, layer)
    b_gate_up, b_down = check_bias(biases, w_gate_up_LEDF2, w_down_LEFD)
    E = w_gate_up_LEDF2.shape[-3]
    F = w_down_GFD.shape[1]
    tm = tiling.tm
    bk = tiling.bk or 128 // jnp.dtype(w_gate_up_GDF2.dtype).itemsize
    weights_TA, expert_ids_TA = route(router_logits_TE, top_k, norm_topk_prob)
    if token_mask_T is not None:
        weights_TA = jnp.where(token_mask_T[:, None], weights_TA, 0.0)
    layout = make_tile_layout(expert_ids_TA, E, token_mask_T, tm)
    M = layout.tile_group_M.shape[0]

    # Expert-sorted copy of x, experts 8-row aligned (see the module docstring).
    x_SD = x_TD.astype(w_gate_up_GDF2.dtype)[layout.token_ids_S]
    common = dict(
        tile_group_M=layout.tile_group_M + group_offset, num_tiles=layout.num_tiles, tm=tm,
        stages=tiling.stages, num_sms=num_sms, interpret=interpret,
    )
    h_PF = tile_gmm(
        x_SD, w_gate_up_GDF2, row_start_M=layout.tile_src_M, swiglu=True,
        bk=_fit_block(D, bk), bn=_fit_block(F, tiling.gate_up_bn),
        out_dtype=w_down_GFD.dtype, bias=b_gate_up, act=activation, **common,
    )
    y_PD = tile_gmm(
        h_PF, w_down_GFD, row_start_M=jnp.arange(M, dtype=jnp.int32) * tm, swiglu=False,
        bk=_fit_block(F, bk), bn=_fit_block(D, tiling.down_bn),
        out_dtype=x_TD.dtype, bias=b_down, **common,
    )
    y_TD = combine_padded(y_PD, layout, weights_TA).astype(x_TD.dtype)
    return y_TD, moe_stats(layout.group_sizes_E, w_gate_up_LEDF2, w_down_LEFD,
                           b_gate_up, b_down)
