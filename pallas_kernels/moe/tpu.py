"""MoE feed-forward on TPU with Pallas Mosaic TPU.

Two kernels over the padded-tile layout of `layout.py`, each a grid (tile, n block,
k block) over the `num_tiles` used tiles only (a dynamic grid size), so the weights of
an expert with no rows are never fetched:

1. `gate_up_gather`: fused gather + gate/up matmul + SiLU(gate)*up. The x rows of a
   tile are DMA'd straight from x in HBM, one DMA per real row (pad rows are not
   fetched), into a double-buffered VMEM tile: the next tile's rows arrive while the
   current tile computes, and the token ids themselves are DMA'd into SMEM one tile
   ahead of that (no [P]-sized scalar prefetch). The epilogue SiLU(gate)*up runs on
   the float32 accumulators; h is stored once in the activation dtype.
2. `tile_gmm`: the same grid with the lhs rows read by BlockSpec from an array already
   in tile order: the down projection h_PF @ Wd, and the gate/up fallback
   (`fused_gather=False`, on a materialised copy x_PD = x_TD[token_ids_P], which
   writes and reads [P, D] extra; P is the layout's static bound, up to R + E*(tm-1)
   rows for R routed rows).

Weights and layers. The kernels take weights [G, D, 2F] / [G, F, D] and scalar-
prefetched tile groups; the weight BlockSpecs index the group through them. A stacked
model's [L, E, ...] arrays reach the kernels whole, reshaped (for free) to
[L*E, ...], with layer*E added to the tile groups: the index maps fetch the layer's
expert blocks straight from the stacked array, and no per-layer slice is made. Gate
and up columns come from the one [G, D, 2F] array through two BlockSpecs (block n and
block n + F/tn). (JAX's megablox `gmm`, which took the down projection before, cannot
do this: its group_offset shifts which lhs row groups a call computes and indexes
rhs from 0, so a layer of [L*E, ...] needs a slice or group sizes over all L*E
groups in its scalar-prefetched metadata.)

Row gather and Mosaic's tiling rule. A DMA into or out of VMEM must start on a tile
boundary of the two minor dims (8 sublanes of 32-bit words); one bfloat16 row at
row r of a [tm, D] buffer does not, and the TPU compiler rejects it ("Offsets along
tiled dimensions must be aligned to tiles ... divisible by the tile dimension 8").
So a token row travels as one index of an untiled leading dim, in 32-bit words: XLA
packs x into words [T, 1, D/pack] (`pack_rows`, a copy of x itself: pack = 2 for
bfloat16, 1 for float32), and each row DMA fills row r of the VMEM tile
[tm, 1, D/pack]. Word j of a bfloat16 row holds x[j] in its low half and x[D/2 + j]
in its high half; each half moved into the high 16 bits is that value as a float32,
exactly. The gate/up weights are viewed as [G, pack, D/pack, 2F] to match (free), so
the two halves are two dots.

Epilogues. The gate/up kernels end in act(gate, up) (a `ref.MoEActivation`: SiLU(gate) * up,
or GPT-OSS's clamped SwiGLU), the down kernel in the identity, on the float32 sums.
GPT-OSS expert biases ([E, N] or stacked [L, E, N], passed whole like the weights)
come as one more BlockSpec per weight block: the [E, tn] block of the tile's layer
(group // E), so a grid step reads that layer's bias rows of all E experts (a few
hundred KB, no dynamic sublane offset) and the epilogue picks the tile's expert with a
one-hot select before adding it in float32; the down bias thus lands on each routed
row before the weighted combine, as in transformers' GptOssExperts. Without biases no
bias operand exists: Qwen3's kernels are unchanged.

Widths that are no multiple of 128 (GPT-OSS: D = F = 2880 = 22.5 x 128). A block's
last two dims must be multiples of (8, 128) or the whole dim, so no tn-wide gate block
and up block (at column n + F/tn of the [.., 2F] array) exist. With tn = F (the
default when no multiple of 128 divides F), the gate/up kernels then take one block of
the whole [gate | up] row (2F: a whole dim), run one dot and cut it at F in the
epilogue (`_gate_up_blocks`). D needs nothing: the gather kernel takes whole D rows
(tk = D) and the down kernel whole F x D blocks (`_pick_block` falls back to the
whole dim). At GPT-OSS-20B shapes a gate/up block is then one expert's whole
[2, 1440, 5760] bfloat16 (33 MB, double-buffered 66 MB of VMEM): it compiles for v5e
and v6e (128 MiB VMEM) but would not fit a chip with 64 MiB (not checked); padding F
to 3072 at load time (zero columns and rows: exact) would restore 128-multiple blocks.

Combine is `layout.combine_padded` (XLA gather + weighted sum in float32).

Cost estimates. Each pallas_call declares `cost.moe_matmul` of its shapes, assuming
uniform routing (the tokens, top-k and experts come from `moe_ffn_tpu`): the routed
rows' flops, the expected active experts' weights read once (once per tile when a tile
walks more than one weight block), rows in and out. P, the padded bound, is no part of
it: the used tiles are a run-time value, and P is about tm times the routed rows when
they are fewer than the experts (decode), so declaring P rows overstated decode's flops
about tm-fold (tests/test_kernel_cost.py).

Quantized weights (issue 31, `tpu_quant.py`): int8 / fp8 weights with their scales
([G, k, n], stacked [L, E, k, n] passed whole like the weights, indexed by the tile's
group); every weight block is converted on chip and multiplied in the activation
dtype, the scales applied to the float32 sums (per channel in the epilogue, fp8 blocks
per 128-row K chunk). h is stored in the activation dtype. The cost estimate counts
the stored bytes (1 per weight plus the scales). MXFP4 (W4A16): packed int8 [G, K/2, N]
bytes of two e2m1 codes and e8m0 scales, decoded per column chunk on chip
(`tq.mxfp4_qdot`), low nibbles against x's first half of K, high against its second;
whole-K blocks only (0.5 B a weight in the cost).

Status: both gate/up paths and the down kernel pass the TPU interpreter tests, and
compile with the real TPU compiler (libtpu on a CPU host, compile-only v5e and v6e
devices) at Qwen3-30B-A3B shapes with stacked weights (tests/test_tpu_compile.py),
and for v6e at GPT-OSS-20B shapes with biases (tests/test_moe_kernels.py). Quantized:
int8, fp8 and fp8 blocks pass the interpreter (tests/test_moe_quant.py) and compile
for v5e and v6e at Qwen3-30B-A3B shapes (int8 on v6e in that test file); MXFP4 passes
the interpreter against a numpy oracle and compiles for v6e at GPT-OSS-20B shapes
(launch/compile_gpt_oss_mxfp4.py).
None has run on a TPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import cost
from pallas_kernels.moe import tpu_quant as tq
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
from pallas_kernels.platform import tpu_interpret

GATHER_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class TpuTiling:
    """Tile sizes. tm: rows per tile (experts are padded to it). tk/tn: D and F blocks
    of the gate/up kernel (None: whole D; the largest divisor of F that is a multiple of
    128 and <= 1024, or else F: then whole [gate | up] rows, see the module docstring).
    down_tk/down_tn: F and D blocks of the down kernel (None:
    the largest such divisor <= 2048)."""

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


def _row_pack(dtype) -> int:
    """Elements of one 32-bit word: rows are gathered as [pack, D/pack] words."""
    if jnp.dtype(dtype) not in GATHER_DTYPES:
        raise NotImplementedError(f"fused gather takes bfloat16 or float32 x, got {dtype}")
    return 4 // jnp.dtype(dtype).itemsize


def pack_rows(x_TD: jax.Array) -> jax.Array:
    """x as 32-bit words [T, D/pack]. bfloat16: word j of row t holds x[t, j] in its
    low and x[t, D/2 + j] in its high 16 bits; float32: the value's own bits."""
    T, D = x_TD.shape
    pack = _row_pack(x_TD.dtype)
    if pack == 1:
        return jax.lax.bitcast_convert_type(x_TD, jnp.uint32)
    halves_TWP = jnp.swapaxes(x_TD.reshape(T, pack, D // pack), 1, 2)
    return jax.lax.bitcast_convert_type(halves_TWP, jnp.uint32)


def _unpack_words(words, pack: int, part: int):
    """The x values of part `part` (< pack) of each 32-bit word, as float32 (exact)."""
    if pack == 1:
        return pltpu.bitcast(words, jnp.float32)
    high = words if part == 1 else words << 16  # a bfloat16 is a float32's high half
    return pltpu.bitcast(high & jnp.uint32(0xFFFF0000), jnp.float32)


def _compiler_params(semantics, vmem_bytes: int):
    return pltpu.CompilerParams(
        dimension_semantics=semantics,
        vmem_limit_bytes=max(32 << 20, int(vmem_bytes * 1.5)),
    )


def _bias_row(bias_ref, expert):
    """Row `expert` of a bias block [E, tn] (one layer's experts), as float32 [1, tn]:
    a one-hot sum over the E rows, which needs no dynamic sublane offset."""
    bias_Et = bias_ref[...].astype(jnp.float32)
    rows_Et = jax.lax.broadcasted_iota(jnp.int32, bias_Et.shape, 0)
    return jnp.sum(jnp.where(rows_Et == expert, bias_Et, 0.0), axis=0, keepdims=True)


def _epilogue(act, bias_refs=(), group_ref=None, tile=None, split=None, channel_scales=()):
    """f(float32 sums) -> the stored block: per-channel weight scales multiplied (a
    [1, width] row per sum: the scale of output column j commutes with the K-sum), bias
    rows of the tile's expert added (expert = group % E: groups are layer*E + expert),
    then act(gate, up), or the sum itself with act None. split: one [gate | up] sum, cut
    at column `split`."""

    def apply(vals):
        if channel_scales:
            vals = [v * s[...] for v, s in zip(vals, channel_scales, strict=True)]
        if bias_refs:
            expert = group_ref[tile] % bias_refs[0].shape[0]
            vals = [v + _bias_row(b, expert) for v, b in zip(vals, bias_refs, strict=True)]
        if split is not None:
            vals = [vals[0][:, :split], vals[0][:, split:]]
        return vals[0] if act is None else act(*vals)

    return apply


def _gate_up_blocks(F: int, tn: int, tiles_n: int):
    """(block width, block offsets, split) of the gate/up weight columns: a gate and an
    up block, n and n + F/tn, of tn columns; or, when F is no multiple of 128 lanes
    (GPT-OSS: 2880, so no 128-multiple block divides it) and tn == F, one block of the
    whole [gate | up] row (a block may span a whole dim), one dot, cut at F in the
    epilogue (Mosaic moves the up half across lanes there: tm x F float32, not the
    weights)."""
    if tn == F and F % 128:
        return 2 * F, (0,), F
    return tn, (0, tiles_n), None


def _accumulate_and_store(k, tiles_k: int, dots, acc_refs, out_ref, epilogue):
    """Adds this k block's dots into the accumulators; at the last k block stores
    epilogue(sums)."""

    def finish(vals):
        out_ref[...] = epilogue(vals).astype(out_ref.dtype)

    if tiles_k == 1:
        finish(dots)
        return

    @pl.when(k == 0)
    def _init():
        for acc, d in zip(acc_refs, dots, strict=True):
            acc[...] = d

    @pl.when(k > 0)
    def _acc():
        for acc, d in zip(acc_refs, dots, strict=True):
            acc[...] += d

    @pl.when(k == tiles_k - 1)
    def _store():
        finish([acc[...] for acc in acc_refs])


# ------------------------------------------------------------------ gate/up, fused gather
def _gate_up_gather_kernel(
    tile_group_ref, tile_rows_ref,  # scalar prefetch
    ids_hbm, x_hbm, *refs,  # inputs: weights (gate, up or one joint), biases; then
    # output h, then scratch: xbuf, ids_smem, row_sem, ids_sem, accumulators
    tm: int, tk: int, tiles_k: int, pack: int, act, num_w: int, num_bias: int, split,
    quant: tq.Quant | None = None, num_scale: int = 0, width: int = 0, offsets=(0,),
):
    w_refs, bias_refs = refs[:num_w], refs[num_w:num_w + num_bias]
    scale_refs = refs[num_w + num_bias:num_w + num_bias + num_scale]
    h_ref, xbuf, ids_smem, row_sem, ids_sem, *acc_refs = refs[num_w + num_bias + num_scale:]
    i, n, k = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_tiles = pl.num_programs(0)
    slot = i % 2

    def ids_copy(tile, s):
        return pltpu.make_async_copy(
            ids_hbm.at[pl.ds(tile * tm, tm)], ids_smem.at[s], ids_sem.at[s]
        )

    def start_rows(tile, s):
        def issue(r, carry):
            pltpu.make_async_copy(
                x_hbm.at[ids_smem[s, r]], xbuf.at[s, r], row_sem.at[s]
            ).start()
            return carry

        jax.lax.fori_loop(0, tile_rows_ref[tile], issue, 0)

    def wait_rows(tile, s):
        def wait(r, carry):
            pltpu.make_async_copy(x_hbm.at[0], xbuf.at[s, 0], row_sem.at[s]).wait()
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

    kw = tk // pack  # words per k block
    if tiles_k == 1:
        words = xbuf[slot]
    else:
        words = xbuf[slot, :, :, pl.ds(pl.multiple_of(k * kw, kw), kw)]
    words = words.reshape(tm, kw)
    cdt = w_refs[0].dtype if quant is None else quant.cdt
    s_kws = [None] * num_w
    if quant is not None and quant.mode == "block":
        s_kws = [tq.block_scales(scale_refs[0], quant, (n + o) * width, width) for o in offsets]
    part_rows = xbuf.shape[-1]  # D / pack: part p holds rows [p * D/pack, (p+1) * D/pack)
    dots = [0.0] * num_w  # gate, up; or the joint [gate | up]
    if quant is not None and quant.mode == "mxfp4":  # packed e2m1: rows j, D/2 + j a byte
        xs = [_unpack_words(words, pack, part).astype(cdt) for part in range(pack)]
        D = pack * part_rows
        x_lo, x_hi = xs if pack == 2 else (xs[0][:, :D // 2], xs[0][:, D // 2:])
        for j, (w_ref, s_ref) in enumerate(zip(w_refs, scale_refs, strict=True)):
            dots[j] = tq.mxfp4_qdot(x_lo, x_hi, lambda c0, c, w=w_ref: w[0, :, c0:c0 + c],
                                    lambda c0, c, s=s_ref: s[:, c0:c0 + c], D, width, cdt)
    for part in range(pack if quant is None or quant.mode != "mxfp4" else 0):
        x = _unpack_words(words, pack, part).astype(cdt)
        for j, w_ref in enumerate(w_refs):
            dots[j] += tq.qdot(x, w_ref[part], quant, part * part_rows + k * kw, s_kws[j])
    channel = scale_refs if quant is not None and quant.mode == "channel" else ()
    _accumulate_and_store(k, tiles_k, dots, acc_refs, h_ref,
                          _epilogue(act, bias_refs, tile_group_ref, i, split, channel))


def gate_up_gather(
    x_TD: jax.Array,
    w_gate_up_GDF2: jax.Array,
    token_ids_P: jax.Array,
    tile_group_M: jax.Array,
    tile_rows_M: jax.Array,
    num_tiles: jax.Array,
    *,
    tm: int,
    tk: int | None = None,
    tn: int | None = None,
    b_gate_up=None,
    act=SILU,
    s_gate_up=None,
    scheme=None,
    routing: cost.Routing | None = None,
    interpret: bool | pltpu.InterpretParams = False,
) -> jax.Array:
    """h_PF = act(x[tok] @ Wg[g] + bg[g], x[tok] @ Wu[g] + bu[g]) for the rows of the
    used tiles, g = tile_group_M[tile] (a row of the possibly stacked [G, D, 2F]
    weights); act is a `ref.MoEActivation` (SiLU(gate) * up unless given).

    b_gate_up: None, or the biases [E, 2F] / stacked [L, E, 2F] like the weights (G =
    L*E): each grid step reads the block of the tile's layer, all E experts (a few
    hundred KB), and picks the tile's expert in the epilogue (float32).
    Rows of unused tiles and pad rows are left unwritten / garbage.
    s_gate_up, scheme: None, or the weights' scales [G, k, n] and their
    `quant.QuantScheme` (int8 / fp8 weights, dequantised per tile on chip, W8A16).

    routing: the (tokens, top_k, experts) behind the layout, for the cost estimate
    (`cost.moe_matmul`: uniform routing); None: P rows routed over the G groups.
    """
    D = x_TD.shape[1]
    G, _, F2 = w_gate_up_GDF2.shape
    F = F2 // 2
    P = token_ids_P.shape[0]
    pack = _row_pack(x_TD.dtype)
    tk = D if tk is None else tk
    tn = _pick_block(F, 1024) if tn is None else tn
    if D % tk or tk % pack or F % tn or P % tm:
        raise ValueError(f"tiles must divide: D={D} tk={tk} F={F} tn={tn} P={P} tm={tm}")
    tiles_k, tiles_n = D // tk, F // tn
    width, offsets, split = _gate_up_blocks(F, tn, tiles_n)
    quant = tq.quant_of(scheme, s_gate_up, x_TD.dtype)
    tq.check_block_chunks(quant, D // pack if pack > 1 else 0, tiles_k, tk // pack,
                        "gate_up_gather")
    tq.check_mxfp4_tiles(quant, tiles_k, "gate_up_gather")
    mx = quant is not None and quant.mode == "mxfp4"

    def w_map(up_offset):
        def index_map(i, n, k, tile_group_ref, tile_rows_ref):
            return tile_group_ref[i], 0, k, n + up_offset

        return index_map

    itemsize = jnp.dtype(x_TD.dtype).itemsize
    w_itemsize = jnp.dtype(w_gate_up_GDF2.dtype).itemsize
    vmem_bytes = (
        2 * tm * D * itemsize  # gathered x tiles
        + 2 * 2 * tk * tn * w_itemsize  # gate + up blocks, double-buffered
        + 2 * tm * tn * itemsize  # out blocks
        + (2 * tm * tn * 4 if tiles_k > 1 else 0)
        + (2 + 2 * (split is not None)) * tm * tn * 4  # float32 epilogue temporaries
    )
    scratch = [
        pltpu.VMEM((2, tm, 1, D // pack), jnp.uint32),
        pltpu.SMEM((2, tm), jnp.int32),
        pltpu.SemaphoreType.DMA((2,)),
        pltpu.SemaphoreType.DMA((2,)),
    ]
    if tiles_k > 1:
        scratch += [pltpu.VMEM((tm, width), jnp.float32)] * len(offsets)
    bias_specs, bias_args = _bias_operands(b_gate_up, width, offsets)
    scale_specs, scale_args = tq.scale_operands(s_gate_up, quant, width, offsets)
    vmem_bytes += _bias_vmem_bytes(bias_args, width)
    vmem_bytes += tq.scale_vmem_bytes(scale_args, quant, width, len(offsets))
    if quant is not None:  # the weight blocks converted to the activation dtype
        vmem_bytes += len(offsets) * tk * width * itemsize
    kernel = functools.partial(_gate_up_gather_kernel, tm=tm, tk=tk, tiles_k=tiles_k,
                               pack=pack, act=act, num_w=len(offsets),
                               num_bias=len(bias_args), split=split, quant=quant,
                               num_scale=len(scale_args), width=width, offsets=offsets)
    # MXFP4: one [D/2, width] block of bytes serves both halves of x (quant.py's layout)
    w_parts = 1 if mx else pack
    w_spec = functools.partial(pl.BlockSpec, (None, w_parts, tk // 2 if mx else tk // pack,
                                              width))
    w_GPKF2 = w_gate_up_GDF2.reshape(G, w_parts, -1, F2)  # a bitcast
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((P, F), x_TD.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(num_tiles, tiles_n, tiles_k),
            in_specs=[
                pl.BlockSpec(memory_space=pl.ANY),
                pl.BlockSpec(memory_space=pl.ANY),
                *(w_spec(w_map(o)) for o in offsets),
                *bias_specs,
                *scale_specs,
            ],
            out_specs=pl.BlockSpec((tm, tn), lambda i, n, k, *_: (i, n)),
            scratch_shapes=scratch,
        ),
        # The gather pipeline carries state from tile to tile: no parallel axis.
        compiler_params=_compiler_params(("arbitrary",) * 3, vmem_bytes),
        cost_estimate=_moe_cost(routing, P, G, k=D, n=F, glu=True, lhs_dtype=x_TD.dtype,
                                w_dtype=w_gate_up_GDF2.dtype, out_dtype=x_TD.dtype,
                                bias=b_gate_up, tm=tm, blocks=tiles_n * tiles_k,
                                scale=s_gate_up, w_pack=2 if mx else 1),
        interpret=tpu_interpret(interpret),
        name=cost.TPU_MOE_GATE_UP_GATHER,
    )(tile_group_M, tile_rows_M, token_ids_P, pack_rows(x_TD)[:, None],
      *([w_GPKF2] * len(offsets)), *bias_args, *scale_args)


def _bias_operands(bias, tn: int, offsets):
    """BlockSpecs and operands for a bias [E, N] / stacked [L, E, N] (none if None):
    one spec per block offset (gate: 0, up: F/tn), each a [E, tn] block of the layer
    of the tile's group (group // E). The [L, E, N] array is passed whole."""
    if bias is None:
        return [], []
    E, N = bias.shape[-2:]
    bias_LEN = bias.reshape(-1, E, N)  # a unit leading dim when not stacked: free

    def spec(offset):
        return pl.BlockSpec((None, E, tn), lambda i, n, k, g, *_: (g[i] // E, 0, n + offset))

    return [spec(o) for o in offsets], [bias_LEN] * len(offsets)


def _bias_vmem_bytes(bias_args, width: int) -> int:
    """VMEM of the bias blocks: [E, width] each, double-buffered."""
    return sum(2 * b.shape[-2] * width * b.dtype.itemsize for b in bias_args)


def _moe_cost(routing, P: int, G: int, *, k: int, n: int, glu: bool, lhs_dtype, w_dtype,
              out_dtype, bias, tm: int, blocks: int, scale=None, w_pack: int = 1):
    """`cost.moe_matmul` of a kernel call as a pl.CostEstimate. A grid of more than one
    weight block per tile (blocks > 1) walks them again for every tile. Quantized
    weights count their stored bytes: 1 per weight (MXFP4: 1 per w_pack = 2) plus one
    expert's scales [k, n]."""
    routing = routing or cost.Routing(tokens=P, top_k=1, experts=G)
    scale_bytes = 0 if scale is None else math.prod(scale.shape[-2:]) * scale.dtype.itemsize
    return cost.moe_matmul(
        **routing._asdict(), k=k, n=n, glu=glu, lhs_itemsize=jnp.dtype(lhs_dtype).itemsize,
        w_itemsize=jnp.dtype(w_dtype).itemsize / w_pack, out_itemsize=jnp.dtype(out_dtype).itemsize,
        bias_itemsize=0 if bias is None else bias.dtype.itemsize, tm=tm,
        refetch_per_tile=blocks > 1, scale_bytes=scale_bytes).pallas()


# ------------------------------------------------------------- grouped matmul by tiles
def _tile_gmm_kernel(tile_group_ref, lhs_ref, *refs, tiles_k: int, act, n_rhs: int,
                     num_bias: int, split, quant: tq.Quant | None = None, num_scale: int = 0,
                     width: int = 0, offsets=(0,), lhs_pack: int = 1):
    n, k = pl.program_id(1), pl.program_id(2)
    rhs_refs, bias_refs = refs[:n_rhs], refs[n_rhs:n_rhs + num_bias]
    scale_refs = refs[n_rhs + num_bias:n_rhs + num_bias + num_scale]
    out_ref, *acc_refs = refs[n_rhs + num_bias + num_scale:]
    lhs = lhs_ref[...]
    if quant is not None and quant.mode == "mxfp4":  # lhs as words (lhs_pack 2) or values
        K = 2 * rhs_refs[0].shape[0]
        if lhs_pack == 2:
            x_lo, x_hi = (_unpack_words(lhs, 2, p).astype(quant.cdt) for p in (0, 1))
        else:
            x_lo, x_hi = lhs[:, :K // 2].astype(quant.cdt), lhs[:, K // 2:].astype(quant.cdt)
        dots = [tq.mxfp4_qdot(x_lo, x_hi, lambda c0, c, r=r: r[:, c0:c0 + c],
                              lambda c0, c, s=s: s[:, c0:c0 + c], K, width, quant.cdt)
                for r, s in zip(rhs_refs, scale_refs, strict=True)]
        _accumulate_and_store(k, tiles_k, dots, acc_refs, out_ref,
                              _epilogue(act, bias_refs, tile_group_ref, pl.program_id(0),
                                        split))
        return
    s_kws = [None] * n_rhs
    if quant is not None and quant.mode == "block":
        s_kws = [tq.block_scales(scale_refs[0], quant, (n + o) * width, width) for o in offsets]
    tk = lhs.shape[1]
    dots = [tq.qdot(lhs, r[...], quant, k * tk, s) for r, s in zip(rhs_refs, s_kws, strict=True)]
    channel = scale_refs if quant is not None and quant.mode == "channel" else ()
    _accumulate_and_store(k, tiles_k, dots, acc_refs, out_ref,
                          _epilogue(act, bias_refs, tile_group_ref, pl.program_id(0), split,
                                    channel))


def tile_gmm(
    lhs_PK: jax.Array,
    rhs_GKN2: jax.Array,
    tile_group_M: jax.Array,
    num_tiles: jax.Array,
    *,
    swiglu: bool,
    tm: int,
    tk: int,
    tn: int,
    out_dtype=None,
    bias=None,
    act=SILU,
    scale=None,
    scheme=None,
    routing: cost.Routing | None = None,
    interpret: bool | pltpu.InterpretParams = False,
) -> jax.Array:
    """out[m*tm:(m+1)*tm] = f(lhs[m*tm:(m+1)*tm] @ rhs[g] + bias[g]), g = tile_group[m],
    for m < num_tiles.

    swiglu=False: f is the identity and out is [P, N]. swiglu=True: rhs is [G, K, 2F],
    f(z) = act(z[:, :F], z[:, F:]) (a `ref.MoEActivation`: SiLU(gate) * up unless given), out is
    [P, F]. bias: None, or [E, N or 2F] / stacked [L, E, ...] like rhs (G = L*E), added
    in float32 (see `gate_up_gather`). Rows of unused tiles are left unwritten.
    scale, scheme: quantized rhs (int8 / fp8) and its scales [G, k, n], as in
    `gate_up_gather`. routing: for the cost estimate, as in `gate_up_gather`.
    """
    P, K = lhs_PK.shape
    G, K2, N2 = rhs_GKN2.shape
    quant = tq.quant_of(scheme, scale, lhs_PK.dtype)
    mx = quant is not None and quant.mode == "mxfp4"
    K2 = scheme.logical_k(K2) if mx else K2  # packed MXFP4: K/2 rows of bytes
    N = N2 // 2 if swiglu else N2
    out_dtype = lhs_PK.dtype if out_dtype is None else out_dtype
    if K != K2 or K % tk or N % tn or P % tm:
        raise ValueError(f"shapes: lhs {lhs_PK.shape} rhs {rhs_GKN2.shape} tm={tm} tk={tk} "
                         f"tn={tn}")
    tiles_k, tiles_n = K // tk, N // tn
    width, offsets, split = _gate_up_blocks(N, tn, tiles_n) if swiglu else (tn, (0,), None)
    tq.check_block_chunks(quant, 0, tiles_k, tk, "tile_gmm")
    tq.check_mxfp4_tiles(quant, tiles_k, "tile_gmm")
    # MXFP4 needs lhs as its two K halves: bfloat16 rows as 32-bit words (pack_rows: word
    # j = lhs[:, j], lhs[:, K/2 + j]), a copy like the gather's; float32 sliced in-kernel.
    lhs_pack = 2 if mx and jnp.dtype(lhs_PK.dtype) == jnp.dtype(jnp.bfloat16) else 1
    lhs_in = pack_rows(lhs_PK) if lhs_pack == 2 else lhs_PK

    def rhs_spec(offset):
        return pl.BlockSpec((None, tk // 2 if mx else tk, width),
                            lambda i, n, k, g: (g[i], k, n + offset))

    rhs_specs = [rhs_spec(o) for o in offsets]
    bias_specs, bias_args = _bias_operands(bias, width, offsets)
    scale_specs, scale_args = tq.scale_operands(scale, quant, width, offsets)
    n_rhs = len(rhs_specs)
    in_item, out_item = jnp.dtype(lhs_PK.dtype).itemsize, jnp.dtype(out_dtype).itemsize
    w_item = jnp.dtype(rhs_GKN2.dtype).itemsize
    vmem_bytes = (2 * tm * tk * in_item + 2 * n_rhs * tk * width * w_item
                  + 2 * tm * tn * out_item + (n_rhs + 1) * tm * width * 4
                  + _bias_vmem_bytes(bias_args, width)
                  + tq.scale_vmem_bytes(scale_args, quant, width, n_rhs)
                  + (0 if quant is None else n_rhs * tk * width * in_item))
    scratch = [pltpu.VMEM((tm, width), jnp.float32)] * n_rhs if tiles_k > 1 else []
    return pl.pallas_call(
        functools.partial(_tile_gmm_kernel, tiles_k=tiles_k, act=act if swiglu else None,
                          n_rhs=n_rhs, num_bias=len(bias_args), split=split, quant=quant,
                          num_scale=len(scale_args), width=width, offsets=offsets,
                          lhs_pack=lhs_pack),
        out_shape=jax.ShapeDtypeStruct((P, N), out_dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(num_tiles, tiles_n, tiles_k),
            in_specs=[pl.BlockSpec((tm, tk // lhs_pack), lambda i, n, k, g: (i, k)),
                      *rhs_specs,
                      *bias_specs, *scale_specs],
            out_specs=pl.BlockSpec((tm, tn), lambda i, n, k, g: (i, n)),
            scratch_shapes=scratch,
        ),
        # No "parallel" axis: parallel axes must lead the grid and have a static size
        # (the interpreter permutes them), and the tile axis is dynamic.
        compiler_params=_compiler_params(("arbitrary",) * 3, vmem_bytes),
        cost_estimate=_moe_cost(routing, P, G, k=K, n=N, glu=swiglu, lhs_dtype=lhs_PK.dtype,
                                w_dtype=rhs_GKN2.dtype, out_dtype=out_dtype, bias=bias, tm=tm,
                                blocks=tiles_n * tiles_k, scale=scale,
                                w_pack=2 if mx else 1),
        interpret=tpu_interpret(interpret),
        name=cost.TPU_MOE_GATE_UP if swiglu else cost.TPU_MOE_DOWN,
    )(tile_group_M, lhs_in, *([rhs_GKN2] * n_rhs), *bias_args, *scale_args)


# --------------------------------------------------------------------------- the layer
def moe_ffn_tpu(
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
    tiling: TpuTiling = TpuTiling(),
    fused_gather: bool = True,
    interpret: bool | pltpu.InterpretParams = False,
):
    """The `tpu` backend of `moe_ffn`. Returns (y_TD, stats) like `ref.ref_moe_ffn`.

    `biases` (b_gate_up, b_down) and `activation` (GPT-OSS) as in `ref.ref_moe_ffn`:
    b_gate_up is added before the activation in the gate/up epilogue, b_down to each
    routed row in the down epilogue (before the weighted combine), both in float32; the
    stacked [L, E, ...] biases are passed whole, like the weights. fused_gather needs
    bfloat16 or float32 x; other dtypes take the fallback.
    `scales` (s_gate_up, s_down) and `scheme`: int8 / fp8 weights (quant.py), stacked
    like the weights and passed whole; W8A16, h stored in the activation dtype.
    """
    D = x_TD.shape[1]
    w_gate_up_GDF2, w_down_GFD, group_offset = stacked_experts(
        w_gate_up_LEDF2, w_down_LEFD, layer)
    b_gate_up, b_down = check_bias(biases, w_gate_up_LEDF2, w_down_LEFD)
    s_gate_up, s_down = check_scales(scales, scheme, w_gate_up_LEDF2, w_down_LEFD)
    if s_gate_up is not None:  # [L*E, k, n] like the weights: free reshapes
        s_gate_up = s_gate_up.reshape(-1, *s_gate_up.shape[-2:])
        s_down = s_down.reshape(-1, *s_down.shape[-2:])
    E = w_gate_up_LEDF2.shape[-3]
    F = w_down_GFD.shape[1] * (1 if s_down is None else scheme.pack)  # MXFP4: F/2 rows
    tm = tiling.tm
    weights_TA, expert_ids_TA = route(router_logits_TE, top_k, norm_topk_prob, router,
                                      correction_bias_E)
    if token_mask_T is not None:
        weights_TA = jnp.where(token_mask_T[:, None], weights_TA, 0.0)
    layout = make_tile_layout(expert_ids_TA, E, token_mask_T, tm)
    tile_group_M = layout.tile_group_M + group_offset
    routing = cost.Routing(tokens=x_TD.shape[0], top_k=top_k, experts=E)

    if fused_gather and x_TD.dtype in GATHER_DTYPES:
        h_PF = gate_up_gather(
            x_TD, w_gate_up_GDF2, layout.token_ids_P, tile_group_M,
            layout.tile_rows_M, layout.num_tiles,
            tm=tm, tk=tiling.tk, tn=tiling.tn, b_gate_up=b_gate_up, act=activation,
            s_gate_up=s_gate_up, scheme=scheme, routing=routing, interpret=interpret,
        )
    else:
        h_PF = tile_gmm(
            x_TD[layout.token_ids_P], w_gate_up_GDF2, tile_group_M, layout.num_tiles,
            swiglu=True, tm=tm, tk=tiling.tk or D, tn=tiling.tn or _pick_block(F, 1024),
            bias=b_gate_up, act=activation, scale=s_gate_up, scheme=scheme,
            routing=routing, interpret=interpret,
        )
    h_dtype = w_down_GFD.dtype if s_down is None else x_TD.dtype
    y_PD = tile_gmm(
        h_PF.astype(h_dtype), w_down_GFD, tile_group_M, layout.num_tiles,
        swiglu=False, tm=tm, tk=tiling.down_tk or _pick_block(F, 2048),
        tn=tiling.down_tn or _pick_block(D, 2048), out_dtype=x_TD.dtype, bias=b_down,
        scale=s_down, scheme=scheme, routing=routing, interpret=interpret,
    )
    y_TD = combine_padded(y_PD, layout, weights_TA).astype(x_TD.dtype)
    return y_TD, moe_stats(layout.group_sizes_E, w_gate_up_LEDF2, w_down_LEFD,
                           b_gate_up, b_down, scales=scales or ())
