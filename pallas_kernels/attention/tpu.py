"""Pallas Mosaic TPU paged attention that reads the shared KV cache in place.

One kernel, `ragged_paged_attention`, serves prefill, chunked prefill, decode and
mixed batches: causal attention of a ragged batch's new tokens to their cached
prefix plus themselves (query i of sequence b sits at position
seq_len_b - q_len_b + i). `decode_attention` is the q_len = 1 case.

Why our own kernel and not only JAX's shipped one (tpu_jax.py): in jax 0.11.2 the
shipped ragged paged attention cannot run in the TPU interpreter (it reshapes and
bitcasts VMEM refs, which the interpreter does not model), so it cannot be checked
anywhere but on a TPU. This kernel is written to the interpreter's model (refs are
only sliced, strided included) and is tested there against the reference; the
shipped kernel stays selectable as backend "tpu_jax" for A/B runs on real TPUs.

Work items. The wrapper cuts every sequence's tokens into items of at most
`block_q` tokens (`ref.query_blocks`; an item never spans two sequences) and packs
each item's queries into a [K, R, H] block: row r of KV head k is query head
k * G + r // block_q of the item's token r % block_q (R = G * block_q, padded to the
sublane tile). GQA therefore reads each KV page once for all G query heads. The
queries and outputs move with plain BlockSpecs, and XLA gathers the tokens into
items and back (O(T * N * H), small next to the attention itself).

KV pages. The pool stays in HBM (memory_space ANY), viewed as [P, S * 2K, H] (a
bitcast of [P, S, 2K, H] under the (8, 128) tiling XLA gives it; the compile test
checks that no copy feeds the kernel). An item walks its sequence's pages in blocks
of `pages_per_block` pages, one DMA per whole page (all 2K heads, so every byte
fetched is used), double-buffered: block j + 1 is in flight while block j computes,
and an item's last block starts the next item's first one, so a new item does not
wait for a whole block's latency (the grid is therefore "arbitrary": sequential on
one core, as v5e and v6e have). Buffer slots alternate over the blocks of all items
(`_schedule`). Only pages up to the item's last visible key are fetched; the rest
of the buffer holds stale data, which the masks keep out (V rows are zeroed, since
0 * NaN is NaN). One wait per set bit of the block's page count covers its DMAs (a
DMA semaphore counts bytes).

Compute. Head-row j of key x is buffer row x * 2K + j, so K (j = 2k) and V
(j = 2k + 1) of head k come from sublane-strided loads. Slicing one head out of a
loaded [X, 2K, H] value instead made Mosaic shuffle sublanes (1,792 rotates and
~2,000 selects per 256-key block at Qwen3 shapes), with ~2,000 spill loads and
stores per block in decode. acc, m and l live in VMEM scratch (m and l
lane-replicated [R, 128], as [R, 1] columns need a lane broadcast per use), updated
per chunk of ROWS_PER_CHUNK rows. Interior blocks (every key live and visible to
every row) skip the masks. Online (flash) softmax in float32, in log2 units (exp2); matmuls
accumulate in float32.

Constraints (ValueError naming the failed one): head_dim a multiple of 128 (lanes),
page_size a multiple of 8 (sublanes), q and cache in {float32, bfloat16}, N
divisible by K.

Status: passes the TPU interpreter tests (tests/test_attention_kernels.py, with the
interpreter's NaN-filled fresh buffers, its DMA race detector, and a check that each
item's first pages are fetched during the previous item), and compiles with the real
TPU compiler (libtpu on a CPU host, compile-only v5e and v6e devices) at
Qwen3-30B-A3B shapes (tests/test_tpu_compile.py, which also bounds the decode
kernel's spills and sublane rotates in the compiled LLO). It has not run on a TPU.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.attention.ref import MASK_VALUE, check_layout, query_blocks, token_positions

SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16)
LOG2_E = math.log2(math.e)
DEFAULT_BLOCK_ROWS = 256  # query rows (G * block_q) per item: one v6e MXU pass
DEFAULT_KV_BLOCK = 256  # keys per flash step (pages_per_block * page_size)
# Query rows per softmax update: 64 re-push the MXU weights twice as often (~2x the
# bundles per prefill block on v6e), 256 spill more.
ROWS_PER_CHUNK = 128


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


def _item(meta_ref, i):
    """(seq, first query position, keys visible, key blocks, slot of block 0) of item i."""
    return (meta_ref[8 * i], meta_ref[8 * i + 3], meta_ref[8 * i + 5], meta_ref[8 * i + 6],
            meta_ref[8 * i + 7])


def _kernel(meta_ref, pages_ref,  # scalar prefetch (SMEM): [M * 8], [B * C_pad]
            q_ref, kv_hbm,  # [K, R, H] block of this item; the pool as [P, S * 2K, H] in HBM
            o_ref,  # [K, R, H]
            kv_buf, sem, acc_ref, m_ref, l_ref,  # scratch, see ragged_paged_attention
            *, sm_scale, block_q, G, pages_per_block, page_size, pages_per_seq,
            rows_per_chunk):
    i, num_items = pl.program_id(0), pl.num_programs(0)
    seq, pos0, kv_stop, num_blocks, slot0 = _item(meta_ref, i)
    K, R, H = q_ref.shape
    J = 2 * K
    X = pages_per_block * page_size
    page_rows = page_size * J

    def start(item_seq, item_stop, blk, slot):
        """Starts the DMAs of key block `blk` of a sequence: only pages holding keys
        below item_stop."""
        pages_needed = pl.cdiv(item_stop, page_size)
        for p in range(pages_per_block):
            idx = blk * pages_per_block + p
            page = pages_ref[item_seq * pages_per_seq + jnp.minimum(idx, pages_per_seq - 1)]
            dst = kv_buf.at[slot, pl.ds(p * page_rows, page_rows)]
            copy = pltpu.make_async_copy(kv_hbm.at[page], dst, sem.at[slot])
            pl.when(idx < pages_needed)(copy.start)

    def wait(blk, slot):
        """Waits for block `blk`'s pages. A DMA semaphore counts bytes, so a few waits
        sized 2^b pages, one per set bit of the page count, cover any count."""
        fetched = jnp.clip(pl.cdiv(kv_stop, page_size) - blk * pages_per_block, 0,
                           pages_per_block)
        for b in range(pages_per_block.bit_length()):
            dst = kv_buf.at[slot, pl.ds(0, (1 << b) * page_rows)]
            copy = pltpu.make_async_copy(dst, dst, sem.at[slot])
            pl.when((fetched >> b) & 1 == 1)(copy.wait)

    # Block 0 was started by the previous item's last block unless that item had none.
    prev_blocks = meta_ref[8 * jnp.maximum(i - 1, 0) + 6]
    pl.when((num_blocks > 0) & ((i == 0) | (prev_blocks == 0)))(
        lambda: start(seq, kv_stop, 0, slot0))
    nxt_seq, _, nxt_stop, _, _ = _item(meta_ref, jnp.minimum(i + 1, num_items - 1))
    nxt_stop = jnp.where(i + 1 < num_items, nxt_stop, 0)

    acc_ref[...] = jnp.zeros_like(acc_ref)
    m_ref[...] = jnp.full_like(m_ref, MASK_VALUE)
    l_ref[...] = jnp.zeros_like(l_ref)
    r_R1 = jax.lax.broadcasted_iota(jnp.int32, (R, 1), 0)
    t_R1 = r_R1 % block_q
    n_rows = meta_ref[8 * i + 2]
    q_pos_R1 = jnp.where((r_R1 < G * block_q) & (t_R1 < n_rows), pos0 + t_R1, -1)

    def body(j, _):
        slot = (slot0 + j) % 2
        wait(j, slot)
        # The next block: this item's, or after its last, the next item's first.
        last = j + 1 == num_blocks
        start(jnp.where(last, nxt_seq, seq), jnp.where(last, nxt_stop, kv_stop),
              jnp.where(last, 0, j + 1), 1 - slot)
        # Every key of an interior block is live and visible to every query row.
        interior = (j + 1) * X <= pos0 + 1
        step = functools.partial(_flash_step, q_ref, kv_buf.at[slot], acc_ref, m_ref, l_ref,
                                 sm_scale=sm_scale, rows_per_chunk=rows_per_chunk)
        pl.when(interior)(lambda: step(None))
        pl.when(~interior)(lambda: step((q_pos_R1, j * X, kv_stop)))
        return 0

    jax.lax.fori_loop(0, num_blocks, body, 0)
    for k in range(K):
        l_RH = _lanes(l_ref[k], H)
        o_ref[k] = (acc_ref[k] / jnp.where(l_RH == 0.0, 1.0, l_RH)).astype(o_ref.dtype)


def _flash_step(q_ref, kv_ref, acc_ref, m_ref, l_ref, edge, sm_scale, rows_per_chunk):
    """Online-softmax update of every KV head's rows with one key block.

    kv_ref [X * 2K, H]: row x * 2K + j is head-row j of key x, so a sublane-strided load
    with stride 2K reads one head's K (j = 2k) or V (j = 2k + 1) rows. edge: None for an
    interior block, else (q_pos [R, 1], first key, kv_stop) for the masks. Rows go in
    chunks of rows_per_chunk so that one chunk's scores, m, l and alpha fit in vregs.
    """
    K, R, H = q_ref.shape
    J = 2 * K
    X = kv_ref.shape[0] // J
    for k in range(K):
        k_XH = kv_ref[pl.ds(2 * k, X, stride=J), :]
        v_XH = kv_ref[pl.ds(2 * k + 1, X, stride=J), :]
        if edge is not None:
            _, key0, kv_stop = edge
            live_X1 = key0 + jax.lax.broadcasted_iota(jnp.int32, (X, 1), 0) < kv_stop
            # Slots past the last key hold stale data (maybe NaN): 0 * NaN is NaN.
            v_XH = jnp.where(live_X1, v_XH, 0).astype(v_XH.dtype)
        for r0 in range(0, R, rows_per_chunk):
            rows = pl.ds(r0, rows_per_chunk)
            # Scores in log2 units: exp2 on the EUP, no hidden multiply by log2(e).
            s_cX = jax.lax.dot_general(q_ref[k, rows], k_XH, (((1,), (1,)), ((), ())),
                                       preferred_element_type=jnp.float32) * (sm_scale * LOG2_E)
            if edge is not None:
                q_pos_R1, key0, _ = edge
                key_pos_1X = key0 + jax.lax.broadcasted_iota(jnp.int32, (1, X), 1)
                visible_cX = key_pos_1X <= q_pos_R1[r0:r0 + rows_per_chunk]
                s_cX = jnp.where(visible_cX, s_cX, MASK_VALUE)
            m_c128 = m_ref[k, rows]  # m and l are lane-replicated: [c, 128]
            m_new = jnp.maximum(m_c128, jnp.max(s_cX, axis=1, keepdims=True))
            # Masked scores give exp(MASK_VALUE - m_new) = 0: every real row has seen key 0
            # by now, so its m_new is a real score (padding rows' output is dropped).
            p_cX = jnp.exp2(s_cX - _lanes(m_new, X))
            alpha_c128 = jnp.exp2(m_c128 - m_new)
            m_ref[k, rows] = m_new
            l_ref[k, rows] = alpha_c128 * l_ref[k, rows] + jnp.sum(p_cX, axis=1, keepdims=True)
            pv_cH = jnp.dot(p_cX.astype(v_XH.dtype), v_XH, preferred_element_type=jnp.float32)
            acc_ref[k, rows] = _lanes(alpha_c128, H) * acc_ref[k, rows] + pv_cH


def _lanes(x_c128, n):
    """[c, 128] lane-replicated -> [c, n]: whole-vreg copies (a lane slice below 128)."""
    return jnp.concatenate([x_c128] * -(-n // 128), axis=1)[:, :n]


def _schedule(meta_M8, block_keys: int):
    """Fills columns 5-7 of query_blocks' rows: keys the item sees (up to its last query's
    position), its key blocks, and the buffer slot of its block 0 (slots alternate over
    the blocks of all items, so that an item's last block can prefetch the next item's
    block 0 into the other slot)."""
    rows_M, pos0_M, kv_len_M = meta_M8[:, 2], meta_M8[:, 3], meta_M8[:, 4]
    kv_stop_M = jnp.where(rows_M > 0, jnp.minimum(kv_len_M, pos0_M + rows_M), 0)
    blocks_M = (kv_stop_M + block_keys - 1) // block_keys
    slot0_M = (jnp.cumsum(blocks_M) - blocks_M) % 2
    return meta_M8.at[:, 5:].set(jnp.stack([kv_stop_M, blocks_M, slot0_M], axis=1))


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
    meta_M8 = _schedule(meta_M8, ppb * S)
    pages_flat = jnp.pad(jnp.asarray(page_table_BC, jnp.int32),
                         ((0, 0), (0, C_pad - C))).reshape(-1)

    # Tokens -> items: q_MKRH[m, k, g * bq + t] = q[t0_m + t, k * G + g].
    tok_Mb = jnp.minimum(meta_M8[:, 1:2] + jnp.arange(bq, dtype=jnp.int32)[None, :], T - 1)
    q_MbKGH = q_TNH.reshape(T, K, G, H)[tok_Mb]
    q_MKRH = q_MbKGH.transpose(0, 2, 3, 1, 4).reshape(M, K, G * bq, H)
    q_MKRH = jnp.pad(q_MKRH, ((0, 0), (0, 0), (0, R - G * bq), (0, 0)))

    rows = math.gcd(R, ROWS_PER_CHUNK)
    kernel = functools.partial(_kernel, sm_scale=sm_scale, block_q=bq, G=G,
                               pages_per_block=ppb, page_size=S, pages_per_seq=C_pad,
                               rows_per_chunk=rows)
    itemsize = jnp.dtype(kv_pages_PSJH.dtype).itemsize
    q_bytes = K * R * H * jnp.dtype(q_TNH.dtype).itemsize
    vmem_bytes = (2 * ppb * S * J * H * itemsize  # page buffers
                  + 4 * q_bytes  # q and o blocks, double-buffered
                  + K * R * (H + 2 * 128) * 4  # acc, m, l
                  + 3 * rows * ppb * S * 4  # scores, probabilities, masks of one chunk
                  + 2 * ppb * S * H * itemsize)  # one head's K and V
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
                pltpu.VMEM((2, ppb * S * J, H), kv_pages_PSJH.dtype),  # key blocks
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.VMEM((K, R, H), jnp.float32),  # acc
                pltpu.VMEM((K, R, 128), jnp.float32),  # m: running max, lane-replicated
                pltpu.VMEM((K, R, 128), jnp.float32),  # l: running sum, lane-replicated
            ],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",),  # an item prefetches the next one's keys
            vmem_limit_bytes=max(32 << 20, int(vmem_bytes * 1.5)),
        ),
        interpret=_interpret_arg(interpret),
        name="lp_tpu_ragged_paged_attention",
    )(meta_M8.reshape(-1), pages_flat, q_MKRH, kv_pages_PSJH.reshape(P, S * J, H))

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
