"""Quantized expert weights in the TPU MoE kernels (W8A16): scale operands and dots.

The kernels of `tpu.py` take int8 / float8_e4m3fn weight blocks, as stored (1 byte a
weight: half the HBM traffic of bfloat16), and convert each block on chip to the
activations' dtype (bfloat16, or float32 in tests). int8 and e4m3 values are exact in
bfloat16, so the MXU multiplies exactly what is stored; the sums are float32. Scales
follow `pallas_kernels.quant` ([G, k, n] float32, w = w_q * scale per block):

* per channel (int8, fp8: k = 1, n = N): a [1, width] row of scales per weight block,
  by BlockSpec at the block's columns, multiplies the float32 sum in the epilogue.
  The scale of output column j is constant over the K-sum, so one multiply per output
  element, after every K step, is exact.
* blocks (HF fine-grained fp8, 128 x 128): the scale changes every 128 K rows, so the
  dot of a weight block runs as one float32 partial dot per 128-row K chunk, each
  multiplied by its [1, width] row of block scales, and summed. The tile's expert's
  whole [k, n] scales come in one small block (the last two dims whole: no (8, 128)
  alignment needed for Qwen3's [16, 12] / [6, 16]); the per-column expansion is a
  select per column block and the row of a K chunk a one-hot sum (no dynamic lane or
  sublane offsets). K chunks must not straddle a 128-row block: the gather kernel's
  bfloat16 halves (D/2 rows each) and any k tile must be whole blocks (Qwen3: D/2 =
  1024, F = 768 = 6 x 128). N blocks may straddle and end partial (2F = 192: one whole,
  one partial block): the expansion maps each column to its own block.

MXFP4 (W4A16, `quant.MXFP4`: int8 [G, K/2, N] bytes of two e2m1 codes, byte row j
holding rows j and j + K/2, and e8m0 scales [G, k, N], K/32 rows padded to k, a multiple
of 8). Mosaic has no fp4 vectors, so a weight block is decoded with integer ops and
selects (`quant.decode_e2m1`), multiplied by its rows' scales (float32; exact in
bfloat16: a power of two times an e2m1 value) and converted to the activations' dtype,
then two dots, low nibbles against x's first half of K and high nibbles against its
second, sum in float32. The gate/up kernel already holds x as those two halves
(`tpu.pack_rows`); the down kernel takes h as words the same way. A block's columns are
decoded a chunk of <= 1024 at a time (a multiple of 128 lanes dividing the block), so
the decoded float32 temporaries stay a few MB at GPT-OSS-20B's whole-K [1440, 5760]
gate/up block. Each column chunk's dots run over the whole K: the scales vary every 32
rows of K, and applied to the weights (not to partial sums) no K chunk needs a lane
offset that is no multiple of 128 (1440 is none). The kernels therefore take MXFP4 with
whole-K blocks only (tk = D, down_tk = F, their defaults) and refuse other k tiles by
name; the scale block is the expert's whole [k, width] rows at the weight block's
columns (k a whole dim; the padding rows past K/32 come along and are never read: w row
r reads scale row r // 32 < K/32).

Nothing dequantises a layer, or an expert, into HBM: the audit's dequantised-copy rule
(`lp_jax/aot/audit.py`) checks that on the compiled programs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.quant import decode_e2m1


@dataclasses.dataclass(frozen=True)
class Quant:
    """How a kernel applies its weights' scales (static). "channel": one scale per
    output column (block_k = K, block_n = 1), multiplied in the epilogue. "block":
    block_k x block_n blocks (HF fine-grained FP8: 128 x 128); each K chunk of block_k
    rows gets its own float32 partial dot, scaled by its row of block scales before the
    K-sum. cdt: the dtype the weight tiles are converted to on chip (the activations')."""

    mode: str
    block_k: int
    block_n: int
    cdt: object


def quant_of(scheme, scale, cdt) -> Quant | None:
    if scale is None:
        return None
    if scheme.pack == 2 and scheme.block_k == 32 and scheme.block_n == 1:
        return Quant("mxfp4", 32, 1, jnp.dtype(cdt))
    if scheme.block_k is None and scheme.block_n == 1:
        return Quant("channel", 0, 1, jnp.dtype(cdt))
    if scheme.block_k is not None and scheme.block_n > 1:
        return Quant("block", scheme.block_k, scheme.block_n, jnp.dtype(cdt))
    raise NotImplementedError(f"no TPU kernel for scheme {scheme}")


def scale_operands(scale_Gkn, quant: Quant | None, width: int, offsets):
    """BlockSpecs and operands for the weight scales [G, k, n] (none if unquantized).
    channel: a [1, width] row per weight block (gate, up), at the block's columns.
    block: the tile's expert's whole [k, n] scales (a few hundred bytes), once."""
    if quant is None:
        return [], []
    if quant.mode in ("channel", "mxfp4"):
        rows = scale_Gkn.shape[1]  # 1 (channel) or k >= K/32 (mxfp4: whole K blocks)

        def spec(offset):
            return pl.BlockSpec((None, rows, width),
                                lambda i, n, k, g, *_: (g[i], 0, n + offset))

        return [spec(o) for o in offsets], [scale_Gkn] * len(offsets)
    kq, nq = scale_Gkn.shape[1:]
    return [pl.BlockSpec((None, kq, nq), lambda i, n, k, g, *_: (g[i], 0, 0))], [scale_Gkn]


def scale_vmem_bytes(scale_args, quant: Quant | None, width: int, num_w: int) -> int:
    """VMEM of the scale blocks (double-buffered) and, in block mode, of the expanded
    [k, width] float32 scales of each weight block."""
    if quant is None:
        return 0
    if quant.mode == "channel":
        return 2 * len(scale_args) * width * 4
    if quant.mode == "mxfp4":  # e8m0 blocks + the decode temporaries of one column chunk
        rows = scale_args[0].shape[1]
        return 2 * num_w * rows * width + 12 * 32 * rows * mxfp4_chunk(width)
    kq, nq = scale_args[0].shape[1:]
    return 2 * kq * nq * 4 + num_w * kq * width * 4


def check_block_chunks(quant: Quant | None, rows: int, tiles_k: int, tk_rows: int,
                       what: str):
    """Block mode: K chunks of block_k rows must not straddle a K block: the rows of
    one weight part (`rows`) and, with several k blocks, the k block itself must be
    whole multiples of block_k."""
    if quant is None or quant.mode != "block":
        return
    bk = quant.block_k
    if rows % bk or (tiles_k > 1 and tk_rows % bk):
        raise ValueError(f"{what}: block-quantized weights need K tiles that are whole "
                         f"{bk}-row blocks: {rows} rows per part, k tile {tk_rows}")


def check_mxfp4_tiles(quant: Quant | None, tiles_k: int, what: str):
    """MXFP4 takes whole-K weight blocks (see the module docstring)."""
    if quant is not None and quant.mode == "mxfp4" and tiles_k > 1:
        raise ValueError(f"{what}: MXFP4 weights are decoded in whole-K blocks (tk = D for "
                         f"gate/up, down_tk = F for down); got {tiles_k} k blocks")


def mxfp4_chunk(width: int) -> int:
    """Columns decoded at a time: the largest multiple of 128 dividing width, <= 1024
    (GPT-OSS-20B's 5760-wide [gate | up] block: 640; Qwen3-30B-A3B's 768: 768); else
    the whole width."""
    for c in range(1024, 127, -128):
        if width % c == 0:
            return c
    return width


def _row_scales(s_kw, start: int, rows: int):
    """float32 [rows, w]: row r gets scale row (start + r) // 32 of s_kw [k, w] (static:
    a sublane concatenation of broadcast rows; rows past K/32, padding, are never read)."""
    parts, r = [], start
    while r < start + rows:
        q = r // 32
        end = min(32 * (q + 1), start + rows)
        parts.append(jnp.broadcast_to(s_kw[q:q + 1], (end - r, s_kw.shape[1])))
        r = end
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)


def mxfp4_qdot(x_lo, x_hi, load_w, load_s, K: int, width: int, cdt):
    """x @ w in float32 for a packed MXFP4 block of K rows and `width` columns: x_lo
    = x[:, :K/2], x_hi = x[:, K/2:] (cdt), load_w(c0, c) the int8 bytes [K/2, c] of
    columns c0.., load_s(c0, c) their e8m0 scales [k, c] (k >= K/32: padding rows
    unread). Decoded a column chunk at a time (`mxfp4_chunk`)."""
    half, wc, outs = K // 2, mxfp4_chunk(width), []
    for c0 in range(0, width, wc):
        b = load_w(c0, wc).astype(jnp.int32) & 0xFF
        s_kw = load_s(c0, wc).astype(jnp.float32)
        lo = (decode_e2m1(b & 15) * _row_scales(s_kw, 0, half)).astype(cdt)
        hi = (decode_e2m1(b >> 4) * _row_scales(s_kw, half, half)).astype(cdt)
        outs.append(jnp.dot(x_lo, lo, preferred_element_type=jnp.float32)
                    + jnp.dot(x_hi, hi, preferred_element_type=jnp.float32))
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)


def block_scales(scale_ref, quant: Quant, col0, width: int):
    """The block scales of columns [col0, col0 + width) of the tile's expert, as
    float32 [k, width]: each column gets its block's scale (a select per column block:
    no dynamic lane offsets)."""
    s_kn = scale_ref[...].astype(jnp.float32)
    kq, nq = s_kn.shape
    col_block = (col0 + jax.lax.broadcasted_iota(jnp.int32, (kq, width), 1)) // quant.block_n
    out = jnp.zeros((kq, width), jnp.float32)
    for j in range(nq):
        out = jnp.where(col_block == j, s_kn[:, j:j + 1], out)
    return out


def scale_row(s_kw, kb):
    """Row kb (traced) of s_kw [k, width], as [1, width] (a one-hot sum)."""
    rows = jax.lax.broadcasted_iota(jnp.int32, s_kw.shape, 0)
    return jnp.sum(jnp.where(rows == kb, s_kw, 0.0), axis=0, keepdims=True)


def qdot(x, w, quant: Quant | None, row0=0, s_kw=None):
    """x @ w in float32. Quantized w: converted on chip to the activations' dtype
    (int8 and e4m3 values are exact in bfloat16); in block mode one partial dot per
    block_k rows, scaled by that K block's row of s_kw. row0: the global K row of w's
    first row (a multiple of block_k; may be traced)."""
    if quant is None:
        return jnp.dot(x, w, preferred_element_type=jnp.float32)
    w = w.astype(quant.cdt)
    if quant.mode == "channel":
        return jnp.dot(x, w, preferred_element_type=jnp.float32)
    bk, rows = quant.block_k, w.shape[0]
    out = 0.0
    for c in range(0, rows, bk):
        part = jnp.dot(x[:, c:c + bk], w[c:c + bk], preferred_element_type=jnp.float32)
        out = out + part * scale_row(s_kw, (row0 + c) // bk)
    return out
