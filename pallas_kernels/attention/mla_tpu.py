"""Pallas Mosaic TPU decode kernel for multi-head latent attention (MLA), absorbed form.

What it computes (mla_ref.py has the math): for each query token t of a ragged batch,
all N heads against the one latent row [c | k_pe] (A + R values, 512 + 64 for
DeepSeek-V3) of every key its sequence holds up to t's position:

    s_NX = q_lat_NA . c_XA + q_pe_NR . k_pe_XR,   o_lat_NA = softmax(s) @ c_XA

W_UK is already folded into q_lat and W_UV is applied after the kernel (mla.py), so the
kernel is multi-query attention with N query rows (128 for DeepSeek-V3, 64 for
Kimi-K2) over one shared key whose value is its first A lanes: one latent page is read
once for all heads, and the [N, X] score and [N, A] output matmuls keep the MXU's rows
full.

Work. The grid is one program per query token ("parallel": self-contained, so a
megacore chip splits it). A token walks its sequence's pages in blocks of
`pages_per_block`, up to its own position only: the work follows each token's real
context, not the page table's width, and padding tokens run no block. The pool stays
in HBM (memory_space ANY) viewed as [P, S, X] (its [P, S, 1, X] shape without the
unit axis, a bitcast: X is padded to whole lanes, below); each page is one DMA of S
whole rows into a double-buffered VMEM block (block j + 1 in flight while block j
computes). A DMA semaphore counts bytes, so each
page's wait reuses its own descriptor. Only the last block of a token can hold keys
past its position or stale slots; it alone takes the masks (stale rows of c are zeroed
too, as 0 * NaN is NaN).

Softmax: online (flash) in float32, in log2 units (exp2); m and l lane-replicated
[N, 128] in VMEM scratch beside acc [N, A] (acc alone is 64 vregs at N = 128).

FP8 latent cache (float8_e4m3fn, one float32 scale per layer, as the FP8 KV path stores
k_scale): pages are DMA'd as stored (one byte a value). An e4m3 value converts to bf16
exactly, so the kernel converts and leaves the scale out of the matmuls: the scores
take it once (with sm_scale) and the output once at the end. The scale is a [1] SMEM
operand (traced: one program serves every layer), present only for an FP8 pool.

Cost estimate: `cost.mla_decode` with the context length it assumes as an argument
(`assumed_context`, default the page table's full width).

Constraints (ValueError naming the failed one): A a multiple of 128 (lanes), page size
a multiple of 8 (sublanes), q in {float32, bfloat16}, the pool q's dtype or
float8_e4m3fn, the pool [P, S, 1, X] with X >= A + R a multiple of 128.

The pool's padded row. A [P, S, 1, 576] pool (DeepSeek-V3) gets a page-minor TPU layout
from XLA (576 is not a multiple of 128 lanes), and every call would copy all of it into
the row-major layout the kernel DMAs from (168 MB of temporaries for a 151 MB pool at
v6e; the compile shows the copy). So the TPU pool rounds each token's row up to 640
values (kv_cache.packs_kv; lanes past A + R are padding, never read): 11% more pool
memory and DMA bytes, against a whole-pool copy per layer. Two tokens a 1152-lane row
would avoid the padding at the cost of unaligned lane slices; not done.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import cost
from pallas_kernels.attention.mla_ref import check_mla_dtypes, check_mla_layout
from pallas_kernels.attention.ref import MASK_VALUE, is_fp8, token_positions
from pallas_kernels.platform import tpu_interpret

SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16)
LOG2_E = math.log2(math.e)
DEFAULT_KV_BLOCK = 256  # keys per flash step (pages_per_block * page_size)


def check_constraints(q_lat_TNA, q_pe_TNR, kv_pages_PS1X) -> None:
    """Raises ValueError naming the first TPU MLA-kernel constraint the inputs fail."""
    check_mla_layout("tpu mla", q_lat_TNA, q_pe_TNR, kv_pages_PS1X)
    A, S = q_lat_TNA.shape[-1], kv_pages_PS1X.shape[1]
    if A % 128:
        raise ValueError(f"tpu mla: kv_lora_rank A={A} must be a multiple of 128 (lanes)")
    X = kv_pages_PS1X.shape[-1]
    if X % 128:
        raise ValueError(f"tpu mla: the pool's row of X={X} values must be padded to a "
                         "multiple of 128 (kv_cache.packs_kv): XLA lays a narrower last "
                         "axis out page-minor and would copy the whole pool every call")
    if S % 8:
        raise ValueError(f"tpu mla: page_size S={S} must be a multiple of 8 (sublanes)")
    check_mla_dtypes("tpu mla", q_lat_TNA, kv_pages_PS1X, SUPPORTED_DTYPES)


def _kernel(*refs, has_scale, sm_scale, pages_per_block, page_size, pages_per_seq):
    """refs: scalar prefetch seq [T], keys visible [T], page table [B * C_pad];
    q_lat [N, A] and q_pe [N, R] of this token, the pool [P, S, X] in HBM, [scale [1]
    in SMEM]; output o_lat [N, A]; scratch: page blocks [2, X_blk, X], DMA semaphores
    [2], acc [N, A], m and l [N, 128]."""
    seq_ref, stop_ref, pages_ref, qc_ref, qr_ref, kv_hbm, *refs = refs
    scale = refs.pop(0)[0] if has_scale else None
    o_ref, buf, sem, acc_ref, m_ref, l_ref = refs
    t = pl.program_id(0)
    seq, stop = seq_ref[t], stop_ref[t]
    N, A = qc_ref.shape
    S = page_size
    X_blk = pages_per_block * S
    pages_needed = pl.cdiv(stop, S)
    num_blocks = pl.cdiv(stop, X_blk)

    def copies(blk, slot):
        """(page valid, DMA descriptor) of each page of key block `blk` into `slot`."""
        out = []
        for p in range(pages_per_block):
            idx = blk * pages_per_block + p
            page = pages_ref[seq * pages_per_seq + jnp.minimum(idx, pages_per_seq - 1)]
            dst = buf.at[slot, pl.ds(p * S, S)]
            out.append((idx < pages_needed,
                        pltpu.make_async_copy(kv_hbm.at[page], dst, sem.at[slot])))
        return out

    def start(blk, slot):
        for ok, copy in copies(blk, slot):
            pl.when(ok)(copy.start)

    def wait(blk, slot):
        for ok, copy in copies(blk, slot):
            pl.when(ok)(copy.wait)

    pl.when(num_blocks > 0)(lambda: start(0, 0))
    acc_ref[...] = jnp.zeros_like(acc_ref)
    m_ref[...] = jnp.full_like(m_ref, MASK_VALUE)
    l_ref[...] = jnp.zeros_like(l_ref)
    score_scale = sm_scale * LOG2_E * (1.0 if scale is None else scale)

    def body(j, _):
        slot = j % 2
        wait(j, slot)
        pl.when(j + 1 < num_blocks)(lambda: start(j + 1, 1 - slot))
        step = functools.partial(_flash_step, qc_ref, qr_ref, buf.at[slot], acc_ref, m_ref,
                                 l_ref, score_scale=score_scale)
        last = j + 1 == num_blocks
        pl.when(~last)(lambda: step(None))
        pl.when(last)(lambda: step(stop - j * X_blk))
        return 0

    jax.lax.fori_loop(0, num_blocks, body, 0)
    l_NA = _lanes(l_ref[...], A)
    o_NA = acc_ref[...] / jnp.where(l_NA == 0.0, 1.0, l_NA)
    if scale is not None:  # the values are the stored latents times the scale
        o_NA = o_NA * scale
    o_ref[...] = o_NA.astype(o_ref.dtype)


def _flash_step(qc_ref, qr_ref, kv_ref, acc_ref, m_ref, l_ref, live, score_scale):
    """Online-softmax update of all N rows with one key block kv_ref [X, A + R].
    live: None (every key visible) or the number of visible keys at its start."""
    N, A = qc_ref.shape
    X = kv_ref.shape[0]
    dtype = qc_ref.dtype
    c_XA = kv_ref[:, pl.ds(0, A)].astype(dtype)  # e4m3 -> bf16 is exact
    pe_XR = kv_ref[:, pl.ds(A, qr_ref.shape[1])].astype(dtype)
    if live is not None:  # stale slots (maybe NaN) out of p @ c
        live_X1 = jax.lax.broadcasted_iota(jnp.int32, (X, 1), 0) < live
        c_XA = jnp.where(live_X1, c_XA, 0).astype(dtype)
        pe_XR = jnp.where(live_X1, pe_XR, 0).astype(dtype)
    dims = (((1,), (1,)), ((), ()))
    s_NX = (jax.lax.dot_general(qc_ref[...], c_XA, dims, preferred_element_type=jnp.float32)
            + jax.lax.dot_general(qr_ref[...], pe_XR, dims,
                                  preferred_element_type=jnp.float32)) * score_scale
    if live is not None:
        s_NX = jnp.where(jax.lax.broadcasted_iota(jnp.int32, (1, X), 1) < live, s_NX,
                         MASK_VALUE)
    m_N128 = m_ref[...]
    m_new = jnp.maximum(m_N128, jnp.max(s_NX, axis=1, keepdims=True))
    p_NX = jnp.exp2(s_NX - _lanes(m_new, X))
    alpha_N128 = jnp.exp2(m_N128 - m_new)
    m_ref[...] = m_new
    l_ref[...] = alpha_N128 * l_ref[...] + jnp.sum(p_NX, axis=1, keepdims=True)
    pv_NA = jnp.dot(p_NX.astype(dtype), c_XA, preferred_element_type=jnp.float32)
    acc_ref[...] = _lanes(alpha_N128, A) * acc_ref[...] + pv_NA


def _lanes(x_c128, n):
    """[c, 128] lane-replicated -> [c, n]."""
    return jnp.concatenate([x_c128] * -(-n // 128), axis=1)[:, :n]


@functools.partial(jax.jit, static_argnames=("sm_scale", "pages_per_block", "interpret",
                                             "assumed_context"))
def mla_decode_attention(q_lat_TNA, q_pe_TNR, kv_pages_PS1X, query_start_B1, seq_lens_B,
                         page_table_BC, num_seqs, *, sm_scale, kv_scale=None,
                         pages_per_block=None, interpret=False, assumed_context=None):
    """Absorbed latent attention of a ragged batch's tokens (decodes, prefill chunks,
    or both; each token over its own causal context): o_lat_TNA in q's dtype, zeros for
    padding tokens. kv_scale: the FP8 pool's scale (None: 1.0; a 16-bit pool takes
    none). assumed_context: the context length the cost estimate assumes (default: the
    page table's width)."""
    check_constraints(q_lat_TNA, q_pe_TNR, kv_pages_PS1X)
    T, N, A = q_lat_TNA.shape
    R = q_pe_TNR.shape[-1]
    P, S, _, X = kv_pages_PS1X.shape
    B, C = page_table_BC.shape
    ppb = pages_per_block or max(1, DEFAULT_KV_BLOCK // S)
    C_pad = -(-C // ppb) * ppb
    seq_T, pos_T, valid_T = token_positions(
        jnp.asarray(query_start_B1, jnp.int32), jnp.asarray(seq_lens_B, jnp.int32),
        jnp.asarray(num_seqs, jnp.int32).reshape(()), T)
    stop_T = jnp.where(valid_T, pos_T + 1, 0).astype(jnp.int32)
    pages_flat = jnp.pad(jnp.asarray(page_table_BC, jnp.int32),
                         ((0, 0), (0, C_pad - C))).reshape(-1)
    fp8 = is_fp8(kv_pages_PS1X)
    in_specs = [pl.BlockSpec((None, N, A), lambda t, *_: (t, 0, 0)),
                pl.BlockSpec((None, N, R), lambda t, *_: (t, 0, 0)),
                pl.BlockSpec(memory_space=pl.ANY)]
    inputs = [q_lat_TNA, q_pe_TNR, kv_pages_PS1X.reshape(P, S, X)]
    if fp8:
        in_specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))
        inputs.append(jnp.asarray(1.0 if kv_scale is None else kv_scale,
                                  jnp.float32).reshape(1))
    kv_itemsize = jnp.dtype(kv_pages_PS1X.dtype).itemsize
    q_itemsize = jnp.dtype(q_lat_TNA.dtype).itemsize
    X_blk = ppb * S
    vmem_bytes = (2 * X_blk * X * kv_itemsize  # page blocks
                  + 4 * N * (A + R + A) * q_itemsize  # q and o blocks, double-buffered
                  + N * (A + 256) * 4  # acc, m, l
                  + 3 * N * X_blk * 4  # scores, probabilities, masks
                  + 2 * X_blk * X * q_itemsize)  # the block converted to q's dtype
    kernel = functools.partial(_kernel, has_scale=fp8, sm_scale=sm_scale,
                               pages_per_block=ppb, page_size=S, pages_per_seq=C_pad)
    o_TNA = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((T, N, A), q_lat_TNA.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(T,),
            in_specs=in_specs,
            out_specs=pl.BlockSpec((None, N, A), lambda t, *_: (t, 0, 0)),
            scratch_shapes=[
                pltpu.VMEM((2, X_blk, X), kv_pages_PS1X.dtype),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.VMEM((N, A), jnp.float32),  # acc
                pltpu.VMEM((N, 128), jnp.float32),  # m, lane-replicated
                pltpu.VMEM((N, 128), jnp.float32),  # l, lane-replicated
            ],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel",),
            vmem_limit_bytes=max(32 << 20, int(vmem_bytes * 1.5)),
        ),
        interpret=tpu_interpret(interpret),
        name=cost.TPU_MLA_DECODE,
        cost_estimate=cost.mla_decode(
            tokens=T, seqs=B, context=assumed_context or C * S, heads=N, latent_dim=A,
            rope_dim=R, q_itemsize=q_itemsize, kv_itemsize=kv_itemsize, row_dim=X).pallas(),
    )(seq_T, stop_T, pages_flat, *inputs)
    return jnp.where(valid_T[:, None, None], o_TNA, jnp.zeros_like(o_TNA))
