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

Sinks and sliding windows (GPT-OSS, semantics in ref.py), both optional: with both
None the kernel has exactly its plain operands and program. A window (an int or a
traced int32, so sliding and full layers share one program) is a third scalar-prefetch
operand: an item's key blocks start at the page of the oldest key its first row sees
(`first_visible_page`, shared by the schedule and the kernel), so pages wholly before
the window are never DMA'd, and the edge masks add `key > q_pos - window`; a block is
interior only if it also lies inside the last row's window. Sinks come as one [K, R,
128] VMEM block (each row's sink in log2 units, fetched once for the grid) that
initialises m, with l = 1.

Head_dim 64 (GPT-OSS) needs the packed pool [P, S, K, 2H] (ref.py). XLA's TPU layout
for an unpacked [P, S, 2K, 64] pool puts the page axis minor (64 lanes would be half
padding), so every call would copy the whole pool into the row-major layout the kernel
DMAs from (tests/test_tpu_compile.py shows the copy). Packed, the pool is row-major
[P, S * K, 2H] to the kernel: one strided load per head brings its K | V rows, q is
zero-padded to 2H lanes (so V drops out of the scores), p @ [K | V] puts p @ V in the
upper lanes, and the wrapper keeps those. The MXU does the work of head_dim 128; HBM
traffic and the cache stay at head_dim 64.

Cost estimate: `cost.paged_attention` of the static shapes, assuming a full page table
(every sequence at C * S keys, the T tokens spread evenly over the B sequences) and no
window; flops count the real query heads and head_dim, not the sublane padding of R
nor, packed, the V lanes the MXU also multiplies.

FP8 pool (float8_e4m3fn, ref.py): the pages are DMA'd as they are stored, one byte a
value (half of bf16's traffic and VMEM), and each strided K / V load is dequantised in
registers: x * scale in float32, then q's dtype for the MXU (bf16's rounding of the
product, 2^-9 relative, is far below e4m3's 2^-4). k_scale and v_scale come as a [2]
float32 SMEM operand (traced: one program serves every layer), present only for an FP8
pool; packed, one lane-select applies k_scale to the K lanes and v_scale to the V ones.
The packed layout and 1-byte values: the real TPU compiler (libtpu, v5e and v6e) takes
the sublane-strided loads of the 8-bit buffer (4 rows per 32-bit sublane), and an e4m3
pool of 2K = 8 rows per key (Qwen3-30B-A3B) or packed [P, S, K, 128] (GPT-OSS) reaches
the kernel as a bitcast of the parameter, as bf16's does: no copy of the pool
(tests/test_kv_fp8.py). v5e has no fp8 arithmetic; the conversion is the VPU's. Not yet
run on a TPU, nor timed.

Constraints (ValueError naming the failed one): head_dim a multiple of 128 (lanes), or
2 * head_dim with a packed pool; page_size a multiple of 8 (sublanes), q in {float32,
bfloat16}, the cache q's dtype or float8_e4m3fn, N divisible by K.

Status: passes the TPU interpreter tests (tests/test_attention_kernels.py, with the
interpreter's NaN-filled fresh buffers, its DMA race detector, and a check that each
item's first pages are fetched during the previous item), and compiles with the real
TPU compiler (libtpu on a CPU host, compile-only v5e and v6e devices) at
Qwen3-30B-A3B shapes, and with sinks and a traced window at GPT-OSS-20B shapes (64 / 8
heads, head_dim 64, packed pool) (tests/test_tpu_compile.py, which also bounds the
decode kernel's spills and sublane rotates in the compiled LLO). It has not run on a
TPU.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import cost
from pallas_kernels.attention.ref import (
    FP8_DTYPE,
    MASK_VALUE,
    check_layout,
    is_fp8,
    is_packed,
    kv_scales,
    query_blocks,
    token_positions,
)
from pallas_kernels.platform import tpu_interpret

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
    _, S, _, L = kv_pages_PSJH.shape
    check_layout("tpu attention", q_xNH, kv_pages_PSJH)
    if L % 128:
        raise ValueError(f"tpu attention: head_dim H={H} must be a multiple of 128 "
                         "(Mosaic lane tiling), or 2H with the pool packed [P, S, K, 2H] "
                         "(ref.py): XLA lays an unpacked H=64 pool out page-minor, so every "
                         "call would copy it whole")
    if S % 8:
        raise ValueError(f"tpu attention: page_size S={S} must be a multiple of 8 "
                         "(Mosaic sublane tiling)")
    ok = [jnp.dtype(d) for d in SUPPORTED_DTYPES]
    if q_xNH.dtype not in ok or kv_pages_PSJH.dtype not in ok + [jnp.dtype(FP8_DTYPE)]:
        raise ValueError(f"tpu attention: dtypes q={q_xNH.dtype}, cache={kv_pages_PSJH.dtype} "
                         "not supported; use float32 or bfloat16 (the cache also "
                         "float8_e4m3fn)")


def _item(meta_ref, i):
    """(seq, first query position, keys visible, key blocks, slot of block 0) of item i."""
    return (meta_ref[8 * i], meta_ref[8 * i + 3], meta_ref[8 * i + 5], meta_ref[8 * i + 6],
            meta_ref[8 * i + 7])


def first_visible_page(pos0, window, page_size: int):
    """The page of the oldest key that a query at position pos0 (an item's first, so
    lowest, row) sees under sliding window `window` (<= 0: all keys, page 0). Plain
    jnp on scalars or arrays: the wrapper's schedule and the kernel share it."""
    return jnp.where(window > 0, jnp.maximum(pos0 - window + 1, 0) // page_size, 0)


def _block_page(first, blk, pages_per_block):
    """Page index (within the sequence) of key block `blk`'s first page; blocks start at
    the item's first visible page, or at page 0 when there is no window (first None)."""
    return blk * pages_per_block if first is None else first + blk * pages_per_block


def _kernel(*refs, has_window, has_sinks, has_scales, packed, sm_scale, block_q, G,
            pages_per_block, page_size, pages_per_seq, rows_per_chunk):
    """refs, in order (the bracketed ones only with a window / with sinks / FP8 pool):
    scalar prefetch (SMEM): meta [M * 8], page table [B * C_pad], [window [1]];
    inputs: q [K, R, H] block of this item, the pool as [P, S * 2K, H] in HBM (packed:
    q [K, R, 2H] with zero upper lanes, the pool as [P, S * K, 2H]),
    [sinks [K, R, 128]: each row's sink logit in log2 units, lane-replicated],
    [scales [2] float32 in SMEM: k_scale, v_scale];
    output: o, q's shape; scratch: see ragged_paged_attention."""
    meta_ref, pages_ref, *refs = refs
    window = refs.pop(0)[0] if has_window else None
    q_ref, kv_hbm, *refs = refs
    sink_ref = refs.pop(0) if has_sinks else None
    scales = None
    if has_scales:
        scale_ref = refs.pop(0)
        scales = (scale_ref[0], scale_ref[1])
    o_ref, kv_buf, sem, acc_ref, m_ref, l_ref = refs
    i, num_items = pl.program_id(0), pl.num_programs(0)
    seq, pos0, kv_stop, num_blocks, slot0 = _item(meta_ref, i)
    # Key blocks start at the first page any row of the item sees (with a window).
    first = None if window is None else first_visible_page(pos0, window, page_size)
    K, R, H = q_ref.shape
    J = K if packed else 2 * K  # pool rows per key
    X = pages_per_block * page_size
    page_rows = page_size * J

    def start(item_seq, item_stop, item_first, blk, slot):
        """Starts the DMAs of key block `blk` of a sequence (counted from its page
        item_first): only pages holding keys below item_stop."""
        pages_needed = pl.cdiv(item_stop, page_size)
        for p in range(pages_per_block):
            idx = _block_page(item_first, blk, pages_per_block) + p
            page = pages_ref[item_seq * pages_per_seq + jnp.minimum(idx, pages_per_seq - 1)]
            dst = kv_buf.at[slot, pl.ds(p * page_rows, page_rows)]
            copy = pltpu.make_async_copy(kv_hbm.at[page], dst, sem.at[slot])
            pl.when(idx < pages_needed)(copy.start)

    def wait(blk, slot):
        """Waits for block `blk`'s pages. A DMA semaphore counts bytes, so a few waits
        sized 2^b pages, one per set bit of the page count, cover any count."""
        fetched = jnp.clip(pl.cdiv(kv_stop, page_size) - _block_page(first, blk, pages_per_block),
                           0, pages_per_block)
        for b in range(pages_per_block.bit_length()):
            dst = kv_buf.at[slot, pl.ds(0, (1 << b) * page_rows)]
            copy = pltpu.make_async_copy(dst, dst, sem.at[slot])
            pl.when((fetched >> b) & 1 == 1)(copy.wait)

    # Block 0 was started by the previous item's last block unless that item had none.
    prev_blocks = meta_ref[8 * jnp.maximum(i - 1, 0) + 6]
    pl.when((num_blocks > 0) & ((i == 0) | (prev_blocks == 0)))(
        lambda: start(seq, kv_stop, first, 0, slot0))
    nxt_seq, nxt_pos0, nxt_stop, _, _ = _item(meta_ref, jnp.minimum(i + 1, num_items - 1))
    nxt_stop = jnp.where(i + 1 < num_items, nxt_stop, 0)
    nxt_first = None if window is None else first_visible_page(nxt_pos0, window, page_size)

    acc_ref[...] = jnp.zeros_like(acc_ref)
    if sink_ref is None:
        m_ref[...] = jnp.full_like(m_ref, MASK_VALUE)
        l_ref[...] = jnp.zeros_like(l_ref)
    else:  # the sink is the first "key": max = sink, sum = exp2(sink - sink) = 1
        m_ref[...] = sink_ref[...]
        l_ref[...] = jnp.ones_like(l_ref)
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
              None if first is None else jnp.where(last, nxt_first, first),
              jnp.where(last, 0, j + 1), 1 - slot)
        step = functools.partial(_flash_step, q_ref, kv_buf.at[slot], acc_ref, m_ref, l_ref,
                                 sm_scale=sm_scale, rows_per_chunk=rows_per_chunk,
                                 packed=packed, scales=scales)
        if window is None:
            # Every key of an interior block is live and visible to every query row.
            interior = (j + 1) * X <= pos0 + 1
            pl.when(interior)(lambda: step(None))
            pl.when(~interior)(lambda: step((q_pos_R1, j * X, kv_stop, None)))
        else:  # ... and inside the window of the item's last row
            key0 = _block_page(first, j, pages_per_block) * page_size
            in_window = (window <= 0) | (key0 > pos0 + n_rows - 1 - window)
            interior = (key0 + X <= pos0 + 1) & in_window
            pl.when(interior)(lambda: step(None))
            pl.when(~interior)(lambda: step((q_pos_R1, key0, kv_stop, window)))
        return 0

    jax.lax.fori_loop(0, num_blocks, body, 0)
    for k in range(K):
        l_RH = _lanes(l_ref[k], H)
        o_ref[k] = (acc_ref[k] / jnp.where(l_RH == 0.0, 1.0, l_RH)).astype(o_ref.dtype)


def _flash_step(q_ref, kv_ref, acc_ref, m_ref, l_ref, edge, sm_scale, rows_per_chunk,
                packed=False, scales=None):
    """Online-softmax update of every KV head's rows with one key block.

    kv_ref [X * 2K, H]: row x * 2K + j is head-row j of key x, so a sublane-strided load
    with stride 2K reads one head's K (j = 2k) or V (j = 2k + 1) rows. Packed, kv_ref is
    [X * K, 2H] and one load with stride K reads head k's K | V rows: q's zero upper
    lanes take V out of the scores, and the upper half of p @ [K | V] is p @ V (the
    wrapper keeps those lanes of the output). edge: None for an
    interior block, else (q_pos [R, 1], first key, kv_stop, window or None) for the
    masks. Rows go in chunks of rows_per_chunk so that one chunk's scores, m, l and alpha
    fit in vregs. scales: None, or (k_scale, v_scale) scalars of an FP8 pool, applied as
    each load is converted to q's dtype.
    """
    K, R, H = q_ref.shape
    J = K if packed else 2 * K
    X = kv_ref.shape[0] // J
    for k in range(K):
        if packed:
            k_XH = v_XH = kv_ref[pl.ds(k, X, stride=J), :]
        else:
            k_XH = kv_ref[pl.ds(2 * k, X, stride=J), :]
            v_XH = kv_ref[pl.ds(2 * k + 1, X, stride=J), :]
        if scales is not None:  # FP8 pool: dequantise in registers
            if packed:  # here H is 2 * head_dim: K in lanes [0, H // 2), V above
                lane_1L = jax.lax.broadcasted_iota(jnp.int32, (1, H), 1)
                scale_1L = jnp.where(lane_1L < H // 2, scales[0], scales[1])
                k_XH = v_XH = (k_XH.astype(jnp.float32) * scale_1L).astype(q_ref.dtype)
            else:
                k_XH = (k_XH.astype(jnp.float32) * scales[0]).astype(q_ref.dtype)
                v_XH = (v_XH.astype(jnp.float32) * scales[1]).astype(q_ref.dtype)
        if edge is not None:
            _, key0, kv_stop, _ = edge
            live_X1 = key0 + jax.lax.broadcasted_iota(jnp.int32, (X, 1), 0) < kv_stop
            # Slots past the last key hold stale data (maybe NaN): 0 * NaN is NaN.
            v_XH = jnp.where(live_X1, v_XH, 0).astype(v_XH.dtype)
            if packed:  # ... and packed, q's zero lanes meet V's stale ones in the scores
                k_XH = v_XH
        for r0 in range(0, R, rows_per_chunk):
            rows = pl.ds(r0, rows_per_chunk)
            # Scores in log2 units: exp2 on the EUP, no hidden multiply by log2(e).
            s_cX = jax.lax.dot_general(q_ref[k, rows], k_XH, (((1,), (1,)), ((), ())),
                                       preferred_element_type=jnp.float32) * (sm_scale * LOG2_E)
            if edge is not None:
                q_pos_R1, key0, _, window = edge
                key_pos_1X = key0 + jax.lax.broadcasted_iota(jnp.int32, (1, X), 1)
                q_pos_c1 = q_pos_R1[r0:r0 + rows_per_chunk]
                visible_cX = key_pos_1X <= q_pos_c1
                if window is not None:  # HF: key > query - window
                    visible_cX &= (window <= 0) | (key_pos_1X > q_pos_c1 - window)
                s_cX = jnp.where(visible_cX, s_cX, MASK_VALUE)
            m_c128 = m_ref[k, rows]  # m and l are lane-replicated: [c, 128]
            m_new = jnp.maximum(m_c128, jnp.max(s_cX, axis=1, keepdims=True))
            # Masked scores give exp(MASK_VALUE - m_new) = 0 once m_new is a real score or
            # sink. A row that has seen neither yet (its window starts in a later block)
            # gathers junk from finite keys with m = MASK_VALUE; its first visible key
            # makes alpha = 0, which drops it. Padding rows' output is dropped.
            p_cX = jnp.exp2(s_cX - _lanes(m_new, X))
            alpha_c128 = jnp.exp2(m_c128 - m_new)
            m_ref[k, rows] = m_new
            l_ref[k, rows] = alpha_c128 * l_ref[k, rows] + jnp.sum(p_cX, axis=1, keepdims=True)
            pv_cH = jnp.dot(p_cX.astype(v_XH.dtype), v_XH, preferred_element_type=jnp.float32)
            acc_ref[k, rows] = _lanes(alpha_c128, H) * acc_ref[k, rows] + pv_cH


def _lanes(x_c128, n):
    """[c, 128] lane-replicated -> [c, n]: whole-vreg copies (a lane slice below 128)."""
    return jnp.concatenate([x_c128] * -(-n // 128), axis=1)[:, :n]


def _schedule(meta_M8, block_keys: int, window=None, page_size: int = 0):
    """Fills columns 5-7 of query_blocks' rows: keys the item sees (up to its last query's
    position), its key blocks (from its first visible page with a window), and the
    buffer slot of its block 0 (slots alternate over the blocks of all items, so that an
    item's last block can prefetch the next item's block 0 into the other slot)."""
    rows_M, pos0_M, kv_len_M = meta_M8[:, 2], meta_M8[:, 3], meta_M8[:, 4]
    kv_stop_M = jnp.where(rows_M > 0, jnp.minimum(kv_len_M, pos0_M + rows_M), 0)
    if window is None:
        blocks_M = (kv_stop_M + block_keys - 1) // block_keys
    else:  # padding items (pos0 0, kv_stop 0) keep 0 blocks
        first_key_M = first_visible_page(pos0_M, window, page_size) * page_size
        blocks_M = (kv_stop_M - first_key_M + block_keys - 1) // block_keys
    slot0_M = (jnp.cumsum(blocks_M) - blocks_M) % 2
    return meta_M8.at[:, 5:].set(jnp.stack([kv_stop_M, blocks_M, slot0_M], axis=1))


def _sublane_tile(dtype) -> int:
    return 8 * (4 // jnp.dtype(dtype).itemsize)


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_q", "pages_per_block",
                                             "interpret"))
def ragged_paged_attention(q_TNH, kv_pages_PSJH, query_start_B1, seq_lens_B, page_table_BC,
                           num_seqs, *, sm_scale, block_q=None, pages_per_block=None,
                           interpret=False, sinks_N=None, sliding_window=None, k_scale=None,
                           v_scale=None):
    """Causal paged attention of a ragged batch (prefill chunks and decode tokens).

    block_q: tokens per work item (default: DEFAULT_BLOCK_ROWS // G, at least 1).
    pages_per_block: pages per flash step (default: DEFAULT_KV_BLOCK tokens' worth).
    Tokens past query_start_B1[num_seqs] return zeros. Defaults are untuned.
    sinks_N [N] (any float dtype, used in float32) and sliding_window (an int or a traced
    int32 scalar, <= 0: full attention) as in ref.py; the window reaches the kernel by
    scalar prefetch, the sinks as a VMEM block. With both None the kernel is exactly
    the one without them (no extra operands). k_scale / v_scale (floats or traced
    scalars, None: 1.0) dequantise an FP8 pool, which alone takes them (an SMEM operand).
    """
    check_constraints(q_TNH, kv_pages_PSJH)
    T, N, H = q_TNH.shape
    P, S, J, L = kv_pages_PSJH.shape  # J pool rows per key, L lanes: 2K, H or packed K, 2H
    packed = is_packed(q_TNH, kv_pages_PSJH)
    K = J if packed else J // 2
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
    window_1 = None
    if sliding_window is None:
        meta_M8 = _schedule(meta_M8, ppb * S)
    else:
        window_1 = jnp.asarray(sliding_window, jnp.int32).reshape(1)
        meta_M8 = _schedule(meta_M8, ppb * S, window_1[0], S)
    pages_flat = jnp.pad(jnp.asarray(page_table_BC, jnp.int32),
                         ((0, 0), (0, C_pad - C))).reshape(-1)

    # Tokens -> items: q_MKRH[m, k, g * bq + t] = q[t0_m + t, k * G + g].
    tok_Mb = jnp.minimum(meta_M8[:, 1:2] + jnp.arange(bq, dtype=jnp.int32)[None, :], T - 1)
    q_MbKGH = q_TNH.reshape(T, K, G, H)[tok_Mb]
    q_MKRH = q_MbKGH.transpose(0, 2, 3, 1, 4).reshape(M, K, G * bq, H)
    q_MKRH = jnp.pad(q_MKRH, ((0, 0), (0, 0), (0, R - G * bq), (0, L - H)))

    rows = math.gcd(R, ROWS_PER_CHUNK)
    fp8 = is_fp8(kv_pages_PSJH)
    kernel = functools.partial(_kernel, has_window=window_1 is not None,
                               has_sinks=sinks_N is not None, has_scales=fp8, packed=packed,
                               sm_scale=sm_scale, block_q=bq,
                               G=G, pages_per_block=ppb, page_size=S, pages_per_seq=C_pad,
                               rows_per_chunk=rows)
    prefetch = [meta_M8.reshape(-1), pages_flat] + ([] if window_1 is None else [window_1])
    in_specs = [pl.BlockSpec((None, K, R, L), lambda i, *_: (i, 0, 0, 0)),
                pl.BlockSpec(memory_space=pl.ANY)]
    inputs = [q_MKRH, kv_pages_PSJH.reshape(P, S * J, L)]
    if sinks_N is not None:  # one block for every item: fetched once
        in_specs.append(pl.BlockSpec((K, R, 128), lambda i, *_: (0, 0, 0)))
        inputs.append(_sink_rows(sinks_N, K, G, bq, R))
    if fp8:
        in_specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))
        inputs.append(kv_scales(k_scale, v_scale))
    itemsize = jnp.dtype(kv_pages_PSJH.dtype).itemsize
    q_bytes = K * R * L * jnp.dtype(q_TNH.dtype).itemsize
    vmem_bytes = (2 * ppb * S * J * L * itemsize  # page buffers
                  + 4 * q_bytes  # q and o blocks, double-buffered
                  + K * R * (L + 2 * 128) * 4  # acc, m, l
                  + 3 * rows * ppb * S * 4  # scores, probabilities, masks of one chunk
                  + 2 * ppb * S * L * itemsize  # one head's K and V
                  + (0 if sinks_N is None else 2 * K * R * 128 * 4))  # sink rows
    o_MKRH = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((M, K, R, L), q_TNH.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch),
            grid=(M,),
            in_specs=in_specs,
            out_specs=pl.BlockSpec((None, K, R, L), lambda i, *_: (i, 0, 0, 0)),
            scratch_shapes=[
                pltpu.VMEM((2, ppb * S * J, L), kv_pages_PSJH.dtype),  # key blocks
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.VMEM((K, R, L), jnp.float32),  # acc
                pltpu.VMEM((K, R, 128), jnp.float32),  # m: running max, lane-replicated
                pltpu.VMEM((K, R, 128), jnp.float32),  # l: running sum, lane-replicated
            ],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",),  # an item prefetches the next one's keys
            vmem_limit_bytes=max(32 << 20, int(vmem_bytes * 1.5)),
        ),
        interpret=tpu_interpret(interpret),
        name=cost.TPU_ATTENTION,
        cost_estimate=cost.paged_attention(
            tokens=T, seqs=B, pages_per_seq=C, page_size=S, heads=N, kv_heads=K, head_dim=H,
            q_itemsize=jnp.dtype(q_TNH.dtype).itemsize, kv_itemsize=itemsize,
            block_q=bq).pallas(),
    )(*prefetch, *inputs)

    if packed:  # the lanes of p @ V
        o_MKRH = o_MKRH[..., H:]
    # Items -> tokens.
    seq_T, _, valid_T = token_positions(query_start_B1, seq_lens_B, num_seqs, T)
    local_T = jnp.arange(T, dtype=jnp.int32) - query_start_B1[seq_T]
    item_T = jnp.where(valid_T, first_block_B[seq_T] + local_T // bq, 0)
    o_MKGbH = o_MKRH[:, :, :G * bq].reshape(M, K, G, bq, H)
    o_TKGH = o_MKGbH[item_T, :, :, local_T % bq]
    o_TNH = o_TKGH.reshape(T, N, H)
    return jnp.where(valid_T[:, None, None], o_TNH, jnp.zeros_like(o_TNH))


def _sink_rows(sinks_N, K: int, G: int, block_q: int, R: int):
    """[K, R, 128] float32: row r of KV head k holds query head k * G + r // block_q's sink
    in log2 units (the kernel's scores are), lane-replicated like m; padding rows 0."""
    sink_KG = sinks_N.astype(jnp.float32).reshape(K, G) * LOG2_E
    sink_KR = jnp.pad(jnp.repeat(sink_KG, block_q, axis=1), ((0, 0), (0, R - G * block_q)))
    return jnp.broadcast_to(sink_KR[:, :, None], (K, R, 128))


def decode_attention(q_BNH, kv_pages_PSJH, seq_lens_B, page_table_BC, *, sm_scale,
                     interpret=False, pages_per_block=None, sinks_N=None,
                     sliding_window=None, k_scale=None, v_scale=None):
    """One query token per sequence; seq_len 0 rows (anywhere in the batch) return zeros.
    sinks_N, sliding_window, k_scale, v_scale: as in ragged_paged_attention."""
    B = q_BNH.shape[0]
    extras = {k: v for k, v in (("sinks_N", sinks_N), ("sliding_window", sliding_window),
                                ("k_scale", k_scale), ("v_scale", v_scale))
              if v is not None}
    return ragged_paged_attention(
        q_BNH, kv_pages_PSJH, jnp.arange(B + 1, dtype=jnp.int32), seq_lens_B, page_table_BC,
        jnp.int32(B), sm_scale=sm_scale, block_q=1, pages_per_block=pages_per_block,
        interpret=interpret, **extras,
    )
