"""MoE feed-forward on TPU with Pallas Mosaic TPU.

Two kernels over the padded-tile layout of `layout.py`:

1. `gate_up_gather` (written here): fused gather + gate/up matmul + SiLU(gate)*up.
   Grid (tile, f_block, d_block) over the `num_tiles` used tiles only (a dynamic grid
   size), so the weights of an expert with no rows are never fetched: the weight
   BlockSpecs index the expert through the scalar-prefetched tile_group_M. The x rows of
   a tile are gathered straight from x_TD in HBM through the sorted token ids, one row
   DMA per real row (pad rows are not fetched), into a double-buffered VMEM tile; the
   next tile's rows are fetched while the current tile computes, and the token ids
   themselves are DMA'd into SMEM one tile ahead of that (so no [P]-sized scalar
   prefetch). Gate and up columns come from the one [E, D, 2F] array through two
   BlockSpecs (block n and block n + F/tn). The epilogue SiLU(gate)*up runs on the
   float32 accumulators; h is stored once in the activation dtype.
2. down projection: JAX's shipped megablox `gmm` on h in the padded layout with the
   padded group sizes. Every group starts on a tile boundary, so megablox's group
   metadata maps its grid only to tiles of non-empty experts (visit_empty_groups=False).

Combine is `layout.combine_padded` (XLA gather + weighted sum in float32).

`fused_gather=False` swaps kernel 1 for megablox `gmm` on a materialised padded copy
x_PD = x_TD[token_ids_P] followed by an elementwise SiLU*up (kept as a fallback and as
a comparison point; it writes and reads [P, 2F] and [P, D] extra).

Status: both paths pass the TPU interpreter tests and lower to Mosaic for a TPU v6e
(tests/test_moe_kernels.py); neither has been compiled or run on a TPU. The riskiest
part for Mosaic's compiler is the single-row DMA into a bfloat16 VMEM tile at an
arbitrary row (sublane) offset; if Mosaic rejects it, use fused_gather=False.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.moe.layout import combine_padded, make_tile_layout
from pallas_kernels.moe.ref import moe_stats, route

# `megablox.gmm` the attribute is the custom-vjp op; the module holds the raw kernel.
_megablox = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")


@dataclasses.dataclass(frozen=True)
class TpuTiling:
    """Tile sizes. tm: rows per tile (experts are padded to it). tk/tn: D and F blocks
    of the gate/up kernel (None: whole D; the largest divisor of F that is a multiple of
    128 and <= 1024, or F). down_tk/down_tn: F and D blocks of the megablox down gmm."""

    tm: int = 128
    tk: int | None = None
    tn: int | None = None
    down_tk: int | None = None
    down_tn: int | None = None


def _pick_block(dim: int, cap: int) -> int:
    if dim <= cap:
        return dim
    for b in range(cap - cap % 128, 127, -128):
        if dim % b == 0:
            return b
    return dim


def _interpret_arg(interpret):
    if isinstance(interpret, pltpu.InterpretParams):
        return interpret
    return pltpu.InterpretParams() if interpret else False


def _gate_up_kernel(
    tile_group_ref, tile_rows_ref,  # scalar prefetch
    ids_hbm, x_hbm, wg_ref, wu_ref,  # inputs
    h_ref,  # output
    xbuf, ids_smem, row_sem, ids_sem, *acc_refs,  # scratch
    tm: int, tk: int, tiles_k: int,
):
    i, n, k = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_tiles = pl.num_programs(0)
    slot = i % 2

    def ids_copy(tile, s):
        return pltpu.make_async_copy(
            ids_hbm.at[pl.ds(tile * tm, tm)], ids_smem.at[s], ids_sem.at[s]
        )

    def start_rows(tile, s):
        def issue(r, carry):
            tok = ids_smem[s, r]
            pltpu.make_async_copy(
                x_hbm.at[pl.ds(tok, 1)], xbuf.at[s, pl.ds(r, 1)], row_sem.at[s]
            ).start()
            return carry

        jax.lax.fori_loop(0, tile_rows_ref[tile], issue, 0)

    def wait_rows(tile, s):
        def wait(r, carry):
            pltpu.make_async_copy(
                x_hbm.at[pl.ds(0, 1)], xbuf.at[s, pl.ds(0, 1)], row_sem.at[s]
            ).wait()
            return carry

        jax.lax.fori_loop(0, tile_rows_ref[tile], wait, 0)

    # Gather pipeline, advanced once per tile: ids of tile i+2 -> SMEM, rows of tile
    # i+1 -> VMEM, both in flight while tile i computes.
    @pl.when((n == 0) & (k == 0))
    def _gather():
        @pl.when(i == 0)
        def _prologue():
            first = ids_copy(0, 0)
            first.start()
            first.wait()
            start_rows(0, 0)

            @pl.when(num_tiles > 1)
            def _():
                ids_copy(1, 1).start()

        wait_rows(i, slot)

        @pl.when(i + 1 < num_tiles)
        def _next():
            ids_copy(i + 1, 1 - slot).wait()
            start_rows(i + 1, 1 - slot)

            @pl.when(i + 2 < num_tiles)
            def _():
                ids_copy(i + 2, slot).start()

    if tiles_k == 1:
        x = xbuf[slot]
    else:
        x = xbuf[slot, :, pl.ds(pl.multiple_of(k * tk, tk), tk)]
    gate = jnp.dot(x, wg_ref[...], preferred_element_type=jnp.float32)
    up = jnp.dot(x, wu_ref[...], preferred_element_type=jnp.float32)

    if tiles_k == 1:
        h_ref[...] = (jax.nn.silu(gate) * up).astype(h_ref.dtype)
        return

    acc_g, acc_u = acc_refs

    @pl.when(k == 0)
    def _init():
        acc_g[...] = gate
        acc_u[...] = up

    @pl.when(k > 0)
    def _acc():
        acc_g[...] += gate
        acc_u[...] += up

    @pl.when(k == tiles_k - 1)
    def _store():
        h_ref[...] = (jax.nn.silu(acc_g[...]) * acc_u[...]).astype(h_ref.dtype)


def gate_up_gather(
    x_TD: jax.Array,
    w_gate_up_EDF2: jax.Array,
    token_ids_P: jax.Array,
    tile_group_M: jax.Array,
    tile_rows_M: jax.Array,
    num_tiles: jax.Array,
    *,
    tm: int,
    tk: int | None = None,
    tn: int | None = None,
    interpret: bool | pltpu.InterpretParams = False,
) -> jax.Array:
    """h_PF = SiLU(x[tok] @ Wg[e]) * (x[tok] @ Wu[e]) for the rows of the used tiles.

    Rows of unused tiles and pad rows are left unwritten / garbage.
    """
    T, D = x_TD.shape
    E, _, F2 = w_gate_up_EDF2.shape
    F = F2 // 2
    P = token_ids_P.shape[0]
    tk = D if tk is None else tk
    tn = _pick_block(F, 1024) if tn is None else tn
    if D % tk or F % tn or P % tm:
        raise ValueError(f"tiles must divide: D={D} tk={tk} F={F} tn={tn} P={P} tm={tm}")
    tiles_k, tiles_n = D // tk, F // tn

    def w_map(up_offset):
        def index_map(i, n, k, tile_group_ref, tile_rows_ref):
            return tile_group_ref[i], k, n + up_offset

        return index_map

    itemsize = jnp.dtype(x_TD.dtype).itemsize
    w_itemsize = jnp.dtype(w_gate_up_EDF2.dtype).itemsize
    vmem_bytes = (
        2 * tm * D * itemsize  # gathered x tiles
        + 2 * 2 * tk * tn * w_itemsize  # gate + up blocks, double-buffered
        + 2 * tm * tn * itemsize  # out blocks
        + (2 * tm * tn * 4 if tiles_k > 1 else 0)
        + 2 * tm * tn * 4  # float32 temporaries of the epilogue
    )
    scratch = [
        pltpu.VMEM((2, tm, D), x_TD.dtype),
        pltpu.SMEM((2, tm), jnp.int32),
        pltpu.SemaphoreType.DMA((2,)),
        pltpu.SemaphoreType.DMA((2,)),
    ]
    if tiles_k > 1:
        scratch += [pltpu.VMEM((tm, tn), jnp.float32)] * 2
    kernel = functools.partial(_gate_up_kernel, tm=tm, tk=tk, tiles_k=tiles_k)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((P, F), x_TD.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(num_tiles, tiles_n, tiles_k),
            in_specs=[
                pl.BlockSpec(memory_space=pl.ANY),
                pl.BlockSpec(memory_space=pl.ANY),
                pl.BlockSpec((None, tk, tn), w_map(0)),
                pl.BlockSpec((None, tk, tn), w_map(tiles_n)),
            ],
            out_specs=pl.BlockSpec((tm, tn), lambda i, n, k, *_: (i, n)),
            scratch_shapes=scratch,
        ),
        compiler_params=pltpu.CompilerParams(
            # The gather pipeline carries state from tile to tile: no parallel axis.
            dimension_semantics=("arbitrary", "arbitrary", "arbitrary"),
            vmem_limit_bytes=max(32 << 20, int(vmem_bytes * 1.5)),
        ),
        cost_estimate=pl.CostEstimate(
            flops=2 * P * D * F2,
            transcendentals=P * F,
            bytes_accessed=P * D * itemsize + P * F * itemsize
            + E * D * F2 * w_itemsize,
        ),
        interpret=_interpret_arg(interpret),
    )(tile_group_M, tile_rows_M, token_ids_P, x_TD, w_gate_up_EDF2, w_gate_up_EDF2)


def moe_ffn_tpu(
    x_TD: jax.Array,
    router_logits_TE: jax.Array,
    w_gate_up_EDF2: jax.Array,
    w_down_EFD: jax.Array,
    *,
    top_k: int,
    norm_topk_prob: bool,
    token_mask_T: jax.Array | None = None,
    tiling: TpuTiling = TpuTiling(),
    fused_gather: bool = True,
    interpret: bool | pltpu.InterpretParams = False,
):
    """The `tpu` backend of `moe_ffn`. Returns (y_TD, stats) like `ref.ref_moe_ffn`."""
    T, D = x_TD.shape
    E, _, F2 = w_gate_up_EDF2.shape
    F = F2 // 2
    tm = tiling.tm
    weights_TA, expert_ids_TA = route(router_logits_TE, top_k, norm_topk_prob)
    if token_mask_T is not None:
        weights_TA = jnp.where(token_mask_T[:, None], weights_TA, 0.0)
    layout = make_tile_layout(expert_ids_TA, E, token_mask_T, tm)

    if fused_gather:
        h_PF = gate_up_gather(
            x_TD, w_gate_up_EDF2, layout.token_ids_P, layout.tile_group_M,
            layout.tile_rows_M, layout.num_tiles,
            tm=tm, tk=tiling.tk, tn=tiling.tn, interpret=interpret,
        )
    else:
        x_PD = x_TD[layout.token_ids_P]
        gate_up_PF2 = _megablox.gmm(
            x_PD, w_gate_up_EDF2, layout.padded_sizes_E,
            preferred_element_type=jnp.float32,
            tiling=(tm, _pick_block(D, 2048), _pick_block(F2, 768)),
            interpret=_interpret_arg(interpret),
        )
        h_PF = (jax.nn.silu(gate_up_PF2[:, :F]) * gate_up_PF2[:, F:]).astype(x_TD.dtype)

    y_PD = _megablox.gmm(
        h_PF.astype(w_down_EFD.dtype), w_down_EFD, layout.padded_sizes_E,
        preferred_element_type=x_TD.dtype,
        tiling=(
            tm,
            tiling.down_tk or _pick_block(F, 2048),
            tiling.down_tn or _pick_block(D, 2048),
        ),
        interpret=_interpret_arg(interpret),
    )
    y_TD = combine_padded(y_PD, layout, weights_TA).astype(x_TD.dtype)
    return y_TD, moe_stats(layout.group_sizes_E, w_gate_up_EDF2, w_down_EFD)
