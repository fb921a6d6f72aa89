"""Pallas Mosaic TPU paged attention that reads the shared KV cache in place.

One kernel, `ragged_paged_attention`, serves prefill, chunked prefill, decode and
mixed batches: causal attention of a ragged batch's new tokens to their cached
prefix plus themselves (query i of sequence b sits at position
seq_len_b - q_len_b + i). `decode_attention` is the q_len = 1 case.

Why our own kernel and not only JAX's shipped one (tpu_jax.py): in jax 0.11.2 the
shipped ragged paged attention cannot run in the TPU interpreter (it reshapes a VMEM
ref, which the interpreter does not model), so it cannot be checked anywhere but on a
TPU. This kernel is written to the interpreter's model and is tested there against
the reference; the shipped kernel stays selectable as backend "tpu_jax" for A/B runs
on real TPUs.

Work items. The wrapper cuts every sequence's tokens into items of at most
`block_q` tokens (`ref.query_blocks`; an item never spans two sequences) and packs
each item's queries into a [K, R, H] block: row r of KV head k is query head
k * G + r // block_q of the item's token r % block_q (R = G * block_q, padded to the
sublane tile). GQA therefore reads each KV page once for all G query heads. The
grid is (items,), "parallel"; the queries and outputs move with plain BlockSpecs,
and XLA gathers the tokens into items and back (O(T * N * H), small next to the
attention itself).

KV pages. The pool [P, S, 2K, H] stays in HBM (memory_space ANY). An item walks its
sequence's pages in blocks of `pages_per_block` pages, one DMA per whole page (all
2K heads, so every byte fetched is used), double-buffered: block j + 1 is in flight
while block j computes. Only pages up to the item's last visible key are fetched;
the rest of the buffer holds stale data, which the masks keep out (V rows are zeroed,
since 0 * NaN is NaN). K and V of head k are rows 2k and 2k + 1 of the page's
[2K, H] slabs. Online (flash) softmax in float32; matmuls accumulate in float32.

Constraints (ValueError naming the failed one): head_dim a multiple of 128 (lanes),
page_size a multiple of 8 (sublanes: [pages, S] merges into one key axis for free),
q and cache in {float32, bfloat16}, N divisible by K.

Status: passes the TPU interpreter tests (tests/test_attention_kernels.py, with the
interpreter's NaN-filled fresh buffers and its DMA race detector), and compiles with
the real TPU compiler (libtpu on a CPU host, compile-only v5e and v6e devices) at
Qwen3-30B-A3B shapes, ragged and decode (tests/test_tpu_compile.py): Mosaic accepts
the per-head slice kv[:, 2k, :] of the [X, 2K, H] page block. It has not run on a TPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.attention.ref import MASK_VALUE, check_layout, query_blocks, token_positions

SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16)
DEFAULT_BLOCK_ROWS = 256  # query rows (G * block_q) per item: one v6e MXU pass
DEFAULT_KV_BLOCK = 256  # keys per flash step (pages_per_block * page_size)


def check_constraints(q_xNH, kv_pages_PSJH) -> None:
    """Raises ValueError naming the first TPU-kernel constraint the inputs fail."""
    _, N, H = q_xNH.shape
    _, S, _, _ = kv_pages_PSJH.shape
    check_layout("tpu attention", q_xNH, kv_pages_PSJH)
    if H % 128:
        raise ValueError(f"tpu attention: head_dim H={H} must be a multiple of 128 "
                         "(Mosaic lane tiling)")
    if S % 8:
        raise ValueError(f"tpu attention: page_size S={S} must be a multiple of 8 "
                         "(Mosaic sublane tiling)")
    ok = [jnp.dtype(d) for d in SUPPORTED_DTYPES]
    if q_xNH.dtype not in ok or kv_pages_PSJH.dtype not in ok:
        raise ValueError(f"tpu attention: dtypes q={q_xNH.dtype}, cache={kv_pages_PSJH.dtype} "
                         "not supported; use float32 or bfloat16")


def _interpret_arg(interpret):
    if isinstance(interpret, pltpu.InterpretParams):
        return interpret
    return pltpu.InterpretParams() if interpret else False


def _kernel(meta_ref, pages_ref,  # scalar prefetch (SMEM): [M * 8], [B * C_pad]
            q_ref, kv_hbm,  # [K, R, H] block of this item; the whole pool in HBM
            o_ref,  # [K, R, H]
            kv_buf, sem,  # scratch: [2, ppb, S, 2K, H] VMEM, two DMA semaphores
            *, sm_scale, block_q, G, pages_per_block, page_size, pages_per_seq):
    i = pl.program_id(0)
    seq, n_rows = meta_ref[8 * i], meta_ref[8 * i + 2]
    pos0, kv_len = meta_ref[8 * i + 3], meta_ref[8 * i + 4]
    K, R, H = q_ref.shape
    X = pages_per_block * page_size
    # Keys this item can see: up to its last query's position.
    kv_stop = jnp.where(n_rows > 0, jnp.minimum(kv_len, pos0 + n_rows), 0)
    num_blocks = pl.cdiv(kv_stop, X)
    pages_needed = pl.cdiv(kv_stop, page_size)

    def page_copies(blk, slot):
        """(fetch?, descriptor) per page of key block `blk`, into buffer `slot`."""
        for p in range(pages_per_block):
            idx = blk * pages_per_block + p
            page = pages_ref[seq * pages_per_seq + jnp.minimum(idx, pages_per_seq - 1)]
            copy = pltpu.make_async_copy(kv_hbm.at[page], kv_buf.at[slot, p], sem.at[slot])
            yield idx < pages_needed, copy

    def start(blk, slot):
        for fetch, copy in page_copies(blk, slot):
            pl.when(fetch)(copy.start)

    def wait(blk, slot):
        for fetch, copy in page_copies(blk, slot):
            pl.when(fetch)(copy.wait)

    @pl.when(num_blocks > 0)
    def _prologue():
        start(0, 0)

    r_R1 = jax.lax.broadcasted_iota(jnp.int32, (R, 1), 0)
    t_R1 = r_R1 % block_q
    q_pos_R1 = jnp.where((r_R1 < G * block_q) & (t_R1 < n_rows), pos0 + t_R1, -1)

    def body(j, carry):
        slot = j % 2

        @pl.when(j + 1 < num_blocks)
        def _prefetch():
            start(j + 1, 1 - slot)

        wait(j, slot)
        kv_XJH = kv_buf[slot].reshape(X, 2 * K, H)
        key_pos_1X = j * X + jax.lax.broadcasted_iota(jnp.int32, (1, X), 1)
        visible_RX = key_pos_1X <= q_pos_R1  # implies key_pos < kv_stop
        key_live_X1 = (j * X + jax.lax.broadcasted_iota(jnp.int32, (X, 1), 0)) < kv_stop
        out = []
        for k in range(K):
            acc_RH, m_R1, l_R1 = carry[k]
            k_XH = kv_XJH[:, 2 * k, :]
            v_XH = jnp.where(key_live_X1, kv_XJH[:, 2 * k + 1, :], 0).astype(kv_XJH.dtype)
            s_RX = jax.lax.dot_general(q_ref[k], k_XH, (((1,), (1,)), ((), ())),
                                       preferred_element_type=jnp.float32) * sm_scale
            s_RX = jnp.where(visible_RX, s_RX, MASK_VALUE)
            m_new = jnp.maximum(m_R1, jnp.max(s_RX, axis=1, keepdims=True))
            p_RX = jnp.where(visible_RX, jnp.exp(s_RX - m_new), 0.0)
            alpha_R1 = jnp.exp(m_R1 - m_new)
            l_new = alpha_R1 * l_R1 + jnp.sum(p_RX, axis=1, keepdims=True)
            pv_RH = jnp.dot(p_RX.astype(v_XH.dtype), v_XH, preferred_element_type=jnp.float32)
            out.append((alpha_R1 * acc_RH + pv_RH, m_new, l_new))
        return tuple(out)

    init = tuple((jnp.zeros((R, H), jnp.float32), jnp.full((R, 1), MASK_VALUE, jnp.float32),
                  jnp.zeros((R, 1), jnp.float32)) for _ in range(K))
    final = jax.lax.fori_loop(0, num_blocks, body, init)
    for k in range(K):
        acc_RH, _, l_R1 = final[k]
        o_ref[k] = (acc_RH / jnp.where(l_R1 == 0.0, 1.0, l_R1)).astype(o_ref.dtype)


def _sublane_tile(dtype) -> int:
    return 8 * (4 // jnp.dtype(dtype).itemsize)


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_q", "pages_per_block",
                                             "interpret"))
def ragged_paged_attention(q_TNH, kv_pages_PSJH, query_start_B1, seq_lens_B, page_table_BC,
                           num_seqs, *, sm_scale, block_q=None, pages_per_block=None,
                           interpret=False):
    """Causal paged attention of a ragged batch (prefill chunks and decode tokens).

    block_q: tokens per work item (default: DEFAULT_BLOCK_ROWS // G, at least 1).
    pages_per_block: pages per flash step (default: DEFAULT_KV_BLOCK tokens' worth).
    Tokens past query_start_B1[num_seqs] return zeros. Defaults are untuned.
    """
    check_constraints(q_TNH, kv_pages_PSJH)
    T, N, H = q_TNH.shape
    P, S, J, _ = kv_pages_PSJH.shape
    K = J // 2
    G = N // K
    B, C = page_table_BC.shape
    bq = block_q or max(1, DEFAULT_BLOCK_ROWS // G)
    ppb = pages_per_block or max(1, DEFAULT_KV_BLOCK // S)
    tile = _sublane_tile(q_TNH.dtype)
    R = -(-(G * bq) // tile) * tile
    C_pad = -(-C // ppb) * ppb
    M = min(T, -(-T // bq) + B)  # every item holds >= 1 token

    query_start_B1 = jnp.asarray(query_start_B1, jnp.int32)
    seq_lens_B = jnp.asarray(seq_lens_B, jnp.int32)
    num_seqs = jnp.asarray(num_seqs, jnp.int32).reshape(())
    meta_M8, first_block_B = query_blocks(query_start_B1, seq_lens_B, num_seqs, bq, M)
    pages_flat = jnp.pad(jnp.asarray(page_table_BC, jnp.int32),
                         ((0, 0), (0, C_pad - C))).reshape(-1)

    # Tokens -> items: q_MKRH[m, k, g * bq + t] = q[t0_m + t, k * G + g].
    tok_Mb = jnp.minimum(meta_M8[:, 1:2] + jnp.arange(bq, dtype=jnp.int32)[None, :], T - 1)
    q_MbKGH = q_TNH.reshape(T, K, G, H)[tok_Mb]
    q_MKRH = q_MbKGH.transpose(0, 2, 3, 1, 4).reshape(M, K, G * bq, H)
    q_MKRH = jnp.pad(q_MKRH, ((0, 0), (0, 0), (0, R - G * bq), (0, 0)))

    kernel = functools.partial(_kernel, sm_scale=sm_scale, block_q=bq, G=G,
                               pages_per_block=ppb, page_size=S, pages_per_seq=C_pad)
    itemsize = jnp.dtype(kv_pages_PSJH.dtype).itemsize
    q_bytes = K * R * H * jnp.dtype(q_TNH.dtype).itemsize
    vmem_bytes = (2 * ppb * S * J * H * itemsize  # page buffers
                  + 4 * q_bytes  # q and o blocks, double-buffered
                  + K * R * H * 4 * 2  # accumulators and their update
                  + 3 * R * ppb * S * 4)  # scores, probabilities, masks
    o_MKRH = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((M, K, R, H), q_TNH.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(M,),
            in_specs=[
                pl.BlockSpec((None, K, R, H), lambda i, *_: (i, 0, 0, 0)),
                pl.BlockSpec(memory_space=pl.ANY),
            ],
            out_specs=pl.BlockSpec((None, K, R, H), lambda i, *_: (i, 0, 0, 0)),
            scratch_shapes=[
                pltpu.VMEM((2, ppb, S, J, H), kv_pages_PSJH.dtype),
                pltpu.SemaphoreType.DMA((2,)),
            ],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel",),
            vmem_limit_bytes=max(32 << 20, int(vmem_bytes * 1.5)),
        ),
        interpret=_interpret_arg(interpret),
        name="lp_tpu_ragged_paged_attention",
    )(meta_M8.reshape(-1), pages_flat, q_MKRH, kv_pages_PSJH)

    # Items -> tokens.
    seq_T, _, valid_T = token_positions(query_start_B1, seq_lens_B, num_seqs, T)
    local_T = jnp.arange(T, dtype=jnp.int32) - query_start_B1[seq_T]
    item_T = jnp.where(valid_T, first_block_B[seq_T] + local_T // bq, 0)
    o_MKGbH = o_MKRH[:, :, :G * bq].reshape(M, K, G, bq, H)
    o_TKGH = o_MKGbH[item_T, :, :, local_T % bq]
    o_TNH = o_TKGH.reshape(T, N, H)
    return jnp.where(valid_T[:, None, None], o_TNH, jnp.zeros_like(o_TNH))


def decode_attention(q_BNH, kv_pages_PSJH, seq_lens_B, page_table_BC, *, sm_scale,
                     interpret=False, pages_per_block=None):
    """One query token per sequence; seq_len 0 rows (anywhere in the batch) return zeros."""
    B = q_BNH.shape[0]
    return ragged_paged_attention(
        q_BNH, kv_pages_PSJH, jnp.arange(B + 1, dtype=jnp.int32), seq_lens_B, page_table_BC,
        jnp.int32(B), sm_scale=sm_scale, block_q=1, pages_per_block=pages_per_block,
        interpret=interpret,
    )
