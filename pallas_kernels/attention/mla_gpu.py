"""Pallas GPU (Triton-lowered, as gpu.py) decode kernel for multi-head latent attention,
absorbed form, reading the latent pool [P, S, 1, A + R] in place.

What it computes is mla_tpu.py's: per query token, N heads against one latent row
[c | k_pe] a key, scores q_lat . c + q_pe . k_pe, output softmax @ c (W_UK and W_UV
are applied outside, mla.py). The pool is seen through two BlockSpec views of the same
array, like gpu.py's K and V views: c (lanes [0, A)) and k_pe (lanes [A, A + R), block
index A / R of the last axis), each gathered page by page with the token's page table.

Grid (T, N / block_h, splits). Heads go in blocks of `block_h` rows: the [block_h, A]
float32 accumulator lives in registers (A = 512: block_h 16 at 8 warps is 32 registers a
thread), so the latent is read once per head block (from L2 after the first). ptxas at
DeepSeek-V3's shapes (launch/compile_mla_kernels.py): 8 warps take 124 registers and no
spills, two blocks (16 warps) an SM; 4 warps took 243 registers for the same two blocks
(8 warps), and block_h 32 at 8 warps 170 registers, one block an SM. The page
axis is split ("flash decoding") so that a small batch still fills the SMs: the number
of splits is static (enough for ~TARGET_PROGRAMS programs), each split takes an equal
share of its token's own key blocks at run time (work follows the real context, not the
page table's width), and the splits' float32 (acc, m, l) are merged here in XLA.

FP8 latent cache (float8_e4m3fn, one float32 scale): blocks are loaded as stored and
converted to q's dtype (e4m3 -> bf16 is exact); the scale multiplies the scores and the
merged output, never each element. Present as a [1] operand only for an FP8 pool.

Cost: the Triton lowering drops `cost_estimate`; `cost.estimate(cost.GPU_MLA_DECODE,
...)` (`cost.mla_decode`, the assumed context an input) is its declaration.

Constraints (ValueError naming the failed one): A and R powers of two >= 16 with R
dividing A (the k_pe view's block index), page size a power of two, block_h a power of
two >= 16 (tl.dot's minimum M; fewer heads than a multiple of it are padded with zero
rows, DeepSeek-V3's 128 and Kimi-K2's 64 need none), q in {float32, bfloat16,
float16}, the pool q's dtype or float8_e4m3fn.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import cost
from pallas_kernels.attention.mla_ref import check_mla_dtypes, check_mla_layout
from pallas_kernels.attention.ref import MASK_VALUE, is_fp8, token_positions

SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
TARGET_PROGRAMS = 264  # two programs per H200 SM
DEFAULT_KV_BLOCK = 32  # keys per flash step: a [32, 512] bf16 block is 32 KiB a stage


def _is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


def check_constraints(q_lat_TNA, q_pe_TNR, kv_pages_PS1X, block_h: int) -> None:
    """Raises ValueError naming the first GPU MLA-kernel constraint the inputs fail."""
    check_mla_layout("gpu mla", q_lat_TNA, q_pe_TNR, kv_pages_PS1X)
    N, A = q_lat_TNA.shape[1:]
    R, S = q_pe_TNR.shape[-1], kv_pages_PS1X.shape[1]
    if not (_is_pow2(A) and _is_pow2(R) and R >= 16 and A % R == 0):
        raise ValueError(f"gpu mla: kv_lora_rank A={A} and rope dim R={R} must be powers of "
                         "two >= 16 with R dividing A (Triton block shapes; the k_pe view)")
    if not _is_pow2(S):
        raise ValueError(f"gpu mla: page_size S={S} must be a power of two")
    if not (_is_pow2(block_h) and block_h >= 16):
        raise ValueError(f"gpu mla: block_h={block_h} must be a power of two >= 16 "
                         "(tl.dot's minimum M)")
    check_mla_dtypes("gpu mla", q_lat_TNA, kv_pages_PS1X, SUPPORTED_DTYPES)


def _kernel(*refs, has_scale, sm_scale, pages_per_block, page_size):
    """refs: keys visible [1], this token's page-table row [C_pad], q_lat [block_h, A],
    q_pe [block_h, R], the c and k_pe views of the pool ([P, S, A], [P, S, R]),
    [scale [1]]; outputs acc [block_h, A], m [block_h], l [block_h] of this split."""
    stop_ref, pages_ref, qc_ref, qr_ref, c_ref, pe_ref, *refs = refs
    scale = refs.pop(0)[0] if has_scale else 1.0
    o_ref, m_ref, l_ref = refs
    split, num_splits = pl.program_id(2), pl.num_programs(2)
    stop = stop_ref[0]
    X = pages_per_block * page_size
    num_pages = pl.cdiv(stop, page_size)
    seq_blocks = pl.cdiv(num_pages, pages_per_block)
    per_split = pl.cdiv(seq_blocks, num_splits)
    first_page = split * per_split * pages_per_block
    num_blocks = jnp.clip(seq_blocks - split * per_split, 0, per_split)
    qc_HA, qr_HR = qc_ref[...], qr_ref[...]
    Hb, A = qc_HA.shape
    score_scale = sm_scale * scale

    def body(i, carry):
        acc_HA, m_H, l_H = carry
        page0 = first_page + i * pages_per_block
        page_ids = pages_ref[pl.ds(page0, pages_per_block)]
        page_ids = jnp.where(page0 + jnp.arange(pages_per_block) < num_pages, page_ids, 0)
        c_XA = c_ref[page_ids].reshape(X, A).astype(qc_HA.dtype)  # e4m3 -> bf16: exact
        pe_XR = pe_ref[page_ids].reshape(X, qr_HR.shape[-1]).astype(qc_HA.dtype)
        key_ok_X = page0 * page_size + jnp.arange(X) < stop
        # allow_tf32=False: Triton's default precision runs float32 dots in TF32.
        s_HX = (plgpu.dot(qc_HA, c_XA, trans_b=True, allow_tf32=False)
                + plgpu.dot(qr_HR, pe_XR, trans_b=True, allow_tf32=False)) * score_scale
        s_HX = jnp.where(key_ok_X[None, :], s_HX, MASK_VALUE)
        m_new = jnp.maximum(m_H, jnp.max(s_HX, axis=1))
        p_HX = jnp.where(key_ok_X[None, :], jnp.exp(s_HX - m_new[:, None]), 0.0)
        alpha_H = jnp.exp(m_H - m_new)
        # Slots past the context hold stale data (maybe NaN): 0 * NaN is NaN.
        c_XA = jnp.where(key_ok_X[:, None], c_XA, jnp.zeros_like(c_XA))
        acc_HA = alpha_H[:, None] * acc_HA + plgpu.dot(p_HX.astype(c_XA.dtype), c_XA,
                                                       allow_tf32=False)
        return acc_HA, m_new, alpha_H * l_H + jnp.sum(p_HX, axis=1)

    init = (jnp.zeros((Hb, A), jnp.float32), jnp.full((Hb,), MASK_VALUE, jnp.float32),
            jnp.zeros((Hb,), jnp.float32))
    acc_HA, m_H, l_H = jax.lax.fori_loop(0, num_blocks, body, init)
    o_ref[...] = acc_HA * scale  # the values are the stored latents times the scale
    m_ref[...] = m_H
    l_ref[...] = l_H


@functools.partial(jax.jit, static_argnames=("sm_scale", "pages_per_block", "num_splits",
                                             "block_h", "num_warps", "num_stages",
                                             "interpret", "assumed_context"))
def mla_decode_attention(q_lat_TNA, q_pe_TNR, kv_pages_PS1X, query_start_B1, seq_lens_B,
                         page_table_BC, num_seqs, *, sm_scale, kv_scale=None,
                         pages_per_block=None, num_splits=None, block_h=16, num_warps=8,
                         num_stages=2, interpret=False, assumed_context=None):
    """Absorbed latent attention of a ragged batch's tokens: o_lat_TNA in q's dtype,
    zeros for padding tokens (mla_tpu.mla_decode_attention's contract). num_splits:
    partitions of the page axis (default: enough for ~TARGET_PROGRAMS programs)."""
    check_constraints(q_lat_TNA, q_pe_TNR, kv_pages_PS1X, block_h)
    T, N, A = q_lat_TNA.shape
    R = q_pe_TNR.shape[-1]
    P, S, _, _ = kv_pages_PS1X.shape
    B, C = page_table_BC.shape
    ppb = pages_per_block or max(1, DEFAULT_KV_BLOCK // S)
    if not _is_pow2(ppb):
        raise ValueError(f"gpu mla: pages_per_block={ppb} must be a power of two")
    total_blocks = pl.cdiv(C, ppb)
    heads = -(-N // block_h)
    if heads * block_h != N:  # zero query rows up to whole head blocks, dropped below
        pad = ((0, 0), (0, heads * block_h - N), (0, 0))
        q_lat_TNA, q_pe_TNR = jnp.pad(q_lat_TNA, pad), jnp.pad(q_pe_TNR, pad)
    splits = num_splits or max(1, min(total_blocks, pl.cdiv(TARGET_PROGRAMS, T * heads)))
    C_pad = total_blocks * ppb
    seq_T, pos_T, valid_T = token_positions(
        jnp.asarray(query_start_B1, jnp.int32), jnp.asarray(seq_lens_B, jnp.int32),
        jnp.asarray(num_seqs, jnp.int32).reshape(()), T)
    stop_T = jnp.where(valid_T, pos_T + 1, 0).astype(jnp.int32)
    pages_TC = jnp.pad(jnp.asarray(page_table_BC, jnp.int32),
                       ((0, 0), (0, C_pad - C)))[seq_T]
    fp8 = is_fp8(kv_pages_PS1X)
    in_specs = [
        pl.BlockSpec((1,), lambda t, h, s: (t,)),
        pl.BlockSpec((None, C_pad), lambda t, h, s: (t, 0)),
        pl.BlockSpec((None, block_h, A), lambda t, h, s: (t, h, 0)),
        pl.BlockSpec((None, block_h, R), lambda t, h, s: (t, h, 0)),
        pl.BlockSpec((P, S, None, A), lambda t, h, s: (0, 0, 0, 0)),
        pl.BlockSpec((P, S, None, R), lambda t, h, s: (0, 0, 0, A // R)),
    ]
    operands = [stop_T, pages_TC, q_lat_TNA, q_pe_TNR, kv_pages_PS1X, kv_pages_PS1X]
    if fp8:
        in_specs.append(pl.BlockSpec((1,), lambda t, h, s: (0,)))
        operands.append(jnp.asarray(1.0 if kv_scale is None else kv_scale,
                                    jnp.float32).reshape(1))
    kernel = functools.partial(_kernel, has_scale=fp8, sm_scale=sm_scale,
                               pages_per_block=ppb, page_size=S)
    o_TXNA, m_TXN, l_TXN = pl.pallas_call(
        kernel,
        grid=(T, heads, splits),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, None, block_h, A), lambda t, h, s: (t, s, h, 0)),
            pl.BlockSpec((None, None, block_h), lambda t, h, s: (t, s, h)),
            pl.BlockSpec((None, None, block_h), lambda t, h, s: (t, s, h)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((T, splits, heads * block_h, A), jnp.float32),
            jax.ShapeDtypeStruct((T, splits, heads * block_h), jnp.float32),
            jax.ShapeDtypeStruct((T, splits, heads * block_h), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=cost.GPU_MLA_DECODE,
    )(*operands)

    # Merge the splits (empty ones carry m = MASK_VALUE, l = 0).
    m_TN = jnp.max(m_TXN, axis=1)
    w_TXN = jnp.exp(m_TXN - m_TN[:, None])
    l_TN = jnp.sum(l_TXN * w_TXN, axis=1)
    o_TNA = jnp.sum(o_TXNA * w_TXN[..., None], axis=1)
    o_TNA = o_TNA / jnp.where(l_TN == 0.0, 1.0, l_TN)[..., None]
    o_TNA = jnp.where(valid_T[:, None, None], o_TNA[:, :N], 0.0)
    return o_TNA.astype(q_lat_TNA.dtype)
