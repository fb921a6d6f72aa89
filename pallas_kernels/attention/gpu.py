"""Pallas GPU (Triton-lowered) paged attention that reads the shared KV cache in place.

JAX ships a Triton paged-attention kernel (jax.experimental.pallas.ops.gpu.paged_attention),
but it wants separate K and V pools laid out [K, P, S, H]; our cache is one
[P, S, 2K, H] pool (see ref.py). Transposing per call would read and write the
whole cache for every decode step, so these kernels index our layout directly:
the K (V) operand of KV head k is the same pool viewed through a BlockSpec that
squeezes the J axis at element 2k (2k + 1); inside the kernel the ref is
[P, S, H] and a page-table gather `k_ref[pages]` loads `pages_per_block` pages.
JAX ships no paged prefill kernel with a query offset, hence `ragged_paged_attention`.

Both kernels run a flash-attention online softmax over blocks of pages and fold the
G = N / K query heads of a KV head into the rows of one matmul (GQA reads each
K/V page once per KV head, not once per query head).

* `decode_attention`: grid (B, K, splits). Long contexts at small batch are split
  over the page axis ("flash decoding"); the per-split (acc, max, sum) are merged
  in XLA. The number of splits is static (enough for ~DECODE_TARGET_PROGRAMS
  programs), but each split takes an equal share of its sequence's own key blocks,
  read from seq_lens at run time, so a page table wider than the contexts leaves no
  split idle while another does all the work; splits past a short sequence's end
  run no iteration. Rows = G padded to >= 16 (tl.dot's minimum M).
* `ragged_paged_attention`: causal attention of a ragged batch's new tokens to
  their cached prefix plus themselves (query i of sequence b sits at position
  seq_len_b - q_len_b + i). The wrapper cuts every sequence into blocks of
  `block_q` tokens (a block never spans two sequences), adds blocks over the rows
  past the last sequence (they store zeros), and the grid is (blocks, K); rows =
  block_q * G. q and o are the caller's arrays (a bitcast, no padded copies): an
  item near the end takes the block_q rows that end at T and stores its own under a
  mask.

Sinks and sliding windows (GPT-OSS, semantics in ref.py), both optional; with both
None the kernels have exactly their plain operands and programs. The window (an int or
a traced int32, one program for sliding and full layers) is one more [1] operand: a
block's page loop starts at the page of the oldest key its first row sees (decode: the
splits share the blocks from there), so pages wholly before the window are never
loaded, and the masks add `key > q_pos - window`. The page table gets one more block
of padding, as blocks then start mid-table. Sinks: the prefill kernel takes them as a
[K, Gp] operand and starts its online softmax from them (m = sink, l = 1); decode
merges them into its splits in XLA, as one more partial (acc 0, m = sink, l = 1).

Cost estimates: the Triton lowering drops `cost_estimate`, so each kernel's estimate is
`cost.estimate(name, ...)` under its pallas_call name (`cost.paged_attention`: a full
page table, tokens spread evenly over the sequences; decode's kernel writes float32
partials [B, K, splits, Gp, H + 2], its `out_bytes`).

FP8 pool (float8_e4m3fn, ref.py): the K and V blocks are loaded as stored (one byte a
value) and dequantised in registers, x * scale in float32 and then q's dtype, so tl.dot
still sees equal operand types; k_scale and v_scale are one more [2] float32 operand,
present only for an FP8 pool. Checked in the interpreter and compiled for the H200
(XLA's Triton and ptxas, sm_90a, Qwen3 heads: no spills; decode 168 registers against
bf16's 127, 3 blocks an SM instead of 4 (the design's floor); prefill at 128 rows
(`PREFILL_BLOCK_ROWS_FP8`) 249 at the 48-layer step's shapes, where bf16's 256 rows
take 255; the 1-byte pages halve the shared memory of the pipelined loads); not yet
run on a GPU.

Constraints (checked with a ValueError naming the failed one): head_dim a power of
two >= 16 and page_size a power of two (Triton block shapes must be powers of two;
tl.dot needs K >= 16); q and the cache of one dtype in {float32, bfloat16,
float16} (tl.dot needs equal operand types), or the cache float8_e4m3fn; N divisible
by K. float32 matmuls ask
for IEEE precision (Triton's default would be TF32, too coarse for 1e-5).

Interpret mode: `interpret=True` runs the pallas_calls in Pallas' generic HLO
interpreter on any backend (CPU tests). (`plgpu.force_gpu_interpret_mode()` from
jax.experimental.pallas.mosaic_gpu is the Mosaic GPU interpreter, not for these
Triton-style kernels.) Out-of-range dynamic slices would be clamped there, so every
slice the kernels take is in bounds by construction (page tables are padded to whole
blocks; a prefill item's q rows end at T at the latest).

Bandwidth and the Triton decision (no GPU here; BENCHMARKS.md, "GPU decode attention:
bandwidth estimate", has the arithmetic). Decode at 32 sequences x 4096 tokens with
Qwen3-30B-A3B heads reads 268 MB of K/V; at the H200's 4.8 TB/s that is 56 us. The
kernel runs 32 x 4 x 2 = 256 programs of 1 MiB each on 132 SMs; at 4 warps and 2
stages (~64 KiB of shared memory and ~16-21K registers each) three fit per SM, so all
run in one wave, and their next blocks in flight (~64 KiB per SM) exceed what Little's
law asks (~29 KB per SM at ~0.8 us). Each load gathers 256 B K or V rows, 2 KiB
apart, of the 16-token pages: every 32 B sector fetched is used, and TMA would fetch
the same sectors (Hopper's TMA cannot gather pages either, so a port issues one copy
per page and head); it saves address arithmetic and registers, not bytes. Estimate:
70-90% of peak (62-79 us). Decision: keep Triton (deprecated in jax 0.11.2, but it
lowers and runs) until the first H200 run measures it; port to Mosaic GPU (TMA per
page, all K heads of a page per program so that its 32 KiB are read together) if the
best swept configuration stays under 70%.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import cost
from pallas_kernels.attention.ref import (
    MASK_VALUE,
    check_layout,
    is_fp8,
    kv_scales,
    query_blocks,
)

SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
DECODE_TARGET_PROGRAMS = 256  # split the page axis until B * K * splits reaches this
PREFILL_BLOCK_ROWS = 256  # query rows of a prefill program (lp_jax.roofline reads it)
# An FP8 pool's: its dequantisation takes the registers that 256 rows would need (4 B
# spilled at Qwen3's 48-layer shapes), and its 1-byte pages already halve what each
# re-read moves.
PREFILL_BLOCK_ROWS_FP8 = 128


def prefill_keys_per_step(rows: int, head_dim: int) -> int:
    """Keys a prefill program takes per flash step. Its [rows, H] float32 accumulator
    lives in registers, rows * H / 256 a thread at 8 warps: 64 at 128 x 128, 128 of
    the 255 at 256 x 128. Beside it sit q, the scores [rows, keys] and the pointer
    tensors of the page gather, which grow with the keys; at 256 x 128 only 16-key steps
    leave them room (ptxas, sm_90a, over a 12.9 GB pool: 255 registers, no spills; 32
    keys spill 56 B a thread, 64 keys 220 B)."""
    return 64 if rows * head_dim <= 128 * 128 else 16


def _is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def check_constraints(q_xNH, kv_pages_PSJH, page_table_BC) -> None:
    """Raises ValueError naming the first GPU-kernel constraint the inputs fail."""
    _, N, H = q_xNH.shape
    _, S, J, H_kv = kv_pages_PSJH.shape
    check_layout("gpu attention", q_xNH, kv_pages_PSJH)
    if not (_is_pow2(H) and H >= 16):
        raise ValueError(f"gpu attention: head_dim H={H} must be a power of two >= 16 "
                         "(Triton block shapes are powers of two; tl.dot needs K >= 16)")
    if not _is_pow2(S):
        raise ValueError(f"gpu attention: page_size S={S} must be a power of two "
                         "(Triton block shapes are powers of two)")
    if q_xNH.dtype != kv_pages_PSJH.dtype and not is_fp8(kv_pages_PSJH):
        raise ValueError(f"gpu attention: q dtype {q_xNH.dtype} != cache dtype "
                         f"{kv_pages_PSJH.dtype} (tl.dot needs equal operand types)")
    if q_xNH.dtype not in [jnp.dtype(d) for d in SUPPORTED_DTYPES]:
        raise ValueError(f"gpu attention: dtype {q_xNH.dtype} not supported; "
                         "use float32, bfloat16 or float16")
    if page_table_BC.ndim != 2:
        raise ValueError(f"gpu attention: page table must be [B, C], got {page_table_BC.shape}")


def _kv_specs(P, S, H):
    """BlockSpecs viewing the pool as the K (J = 2k) and V (J = 2k + 1) pages of KV head k
    (grid axis 1 is the KV head in both kernels)."""

    def k_map(*ids):
        k = ids[1]
        return 0, 0, 2 * k, 0

    def v_map(*ids):
        k = ids[1]
        return 0, 0, 2 * k + 1, 0

    return pl.BlockSpec((P, S, None, H), k_map), pl.BlockSpec((P, S, None, H), v_map)


def _load_kv_block(k_ref, v_ref, pages_X, block_k, scale_ref=None, dtype=None):
    """K and V of the pages [X, H]; an FP8 pool's (scale_ref: [k_scale, v_scale])
    dequantised to `dtype` (q's)."""
    H = k_ref.shape[-1]
    k_XH = k_ref[pages_X].reshape(block_k, H)
    v_XH = v_ref[pages_X].reshape(block_k, H)
    if scale_ref is not None:
        k_XH = (k_XH.astype(jnp.float32) * scale_ref[0]).astype(dtype)
        v_XH = (v_XH.astype(jnp.float32) * scale_ref[1]).astype(dtype)
    return k_XH, v_XH


def _online_softmax_step(q_RH, k_XH, v_XH, visible_RX, key_ok_X, carry, sm_scale):
    """One flash step: rows R of queries against X keys; returns the new (acc, m, l)."""
    acc_RH, m_R, l_R = carry
    # allow_tf32=False: Triton's default precision runs float32 dots in TF32.
    s_RX = plgpu.dot(q_RH, k_XH, trans_b=True, allow_tf32=False) * sm_scale
    s_RX = jnp.where(visible_RX, s_RX, MASK_VALUE)
    m_new = jnp.maximum(m_R, jnp.max(s_RX, axis=1))
    p_RX = jnp.exp(s_RX - m_new[:, None])
    p_RX = jnp.where(visible_RX, p_RX, 0.0)
    alpha_R = jnp.exp(m_R - m_new)
    l_new = alpha_R * l_R + jnp.sum(p_RX, axis=1)
    # Slots past seq_len hold stale data (maybe NaN): zero them, 0 * NaN is NaN.
    v_XH = jnp.where(key_ok_X[:, None], v_XH, jnp.zeros_like(v_XH))
    acc_new = alpha_R[:, None] * acc_RH + plgpu.dot(p_RX.astype(v_XH.dtype), v_XH,
                                                    allow_tf32=False)
    return acc_new, m_new, l_new


# ----------------------------------------------------------------------------- decode


def _window_start(pos, window):
    """The oldest key position a query at `pos` sees under sliding window `window`
    (<= 0: full attention, key 0)."""
    return jnp.where(window > 0, jnp.maximum(pos - window + 1, 0), 0)


def _decode_kernel(*refs, has_window, has_scales, sm_scale, pages_per_block, page_size):
    """refs: seq_len [1], page-table row [C_pad], q [Gp, H], K and V views of the pool,
    [window [1]], [scales [2] of an FP8 pool] (each only with one), then the outputs
    acc [Gp, H], m [Gp], l [Gp]."""
    seq_len_ref, pages_ref, q_ref, k_ref, v_ref, *refs = refs
    window = refs.pop(0)[0] if has_window else None
    scale_ref = refs.pop(0) if has_scales else None
    o_ref, m_ref, l_ref = refs
    block_k = pages_per_block * page_size
    split, num_splits = pl.program_id(2), pl.num_programs(2)
    seq_len = seq_len_ref[0]
    num_pages = pl.cdiv(seq_len, page_size)
    # Splits share the sequence's own blocks (not the page table's width): split s takes
    # blocks [s * per_split, (s + 1) * per_split); splits past the end run no iteration.
    # With a window the blocks start at the page of the oldest key it holds.
    if window is None:
        seq_blocks = pl.cdiv(num_pages, pages_per_block)
    else:
        key_lo = _window_start(seq_len - 1, window)
        seq_page0 = key_lo // page_size
        seq_blocks = pl.cdiv(num_pages - seq_page0, pages_per_block)
    per_split = pl.cdiv(seq_blocks, num_splits)
    first_page = split * per_split * pages_per_block
    if window is not None:
        first_page = seq_page0 + first_page
    num_blocks = jnp.clip(seq_blocks - split * per_split, 0, per_split)
    q_GH = q_ref[...]
    Gp, H = q_GH.shape

    def body(i, carry):
        page0 = first_page + i * pages_per_block
        page_ids = pages_ref[pl.ds(page0, pages_per_block)]
        page_ids = jnp.where(page0 + jnp.arange(pages_per_block) < num_pages, page_ids, 0)
        k_XH, v_XH = _load_kv_block(k_ref, v_ref, page_ids, block_k, scale_ref, q_GH.dtype)
        key_pos_X = page0 * page_size + jnp.arange(block_k)
        key_ok_X = key_pos_X < seq_len
        visible_X = key_ok_X if window is None else key_ok_X & (key_pos_X >= key_lo)
        visible_GX = jnp.broadcast_to(visible_X[None, :], (Gp, block_k))
        return _online_softmax_step(q_GH, k_XH, v_XH, visible_GX, key_ok_X, carry, sm_scale)

    init = (jnp.zeros((Gp, H), jnp.float32), jnp.full((Gp,), MASK_VALUE, jnp.float32),
            jnp.zeros((Gp,), jnp.float32))
    acc_GH, m_G, l_G = jax.lax.fori_loop(0, num_blocks, body, init)
    o_ref[...] = acc_GH
    m_ref[...] = m_G
    l_ref[...] = l_G


@functools.partial(jax.jit, static_argnames=("sm_scale", "pages_per_block", "num_splits",
                                             "num_warps", "num_stages", "interpret"))
def decode_attention(q_BNH, kv_pages_PSJH, seq_lens_B, page_table_BC, *, sm_scale,
                     pages_per_block=None, num_splits=None, num_warps=4, num_stages=2,
                     interpret=False, sinks_N=None, sliding_window=None, k_scale=None,
                     v_scale=None):
    """One query token per sequence over paged KV; seq_len 0 rows return zeros.

    pages_per_block: pages per flash step (default: 64 tokens' worth). num_splits:
    partitions of the page axis (default: enough for ~256 programs).
    sliding_window (int or traced int32 scalar, <= 0: full): a scalar operand; the
    splits share the blocks from the window's first page. sinks_N [N]: joins the merge
    of the splits as one more partial (max = sink, sum = 1, acc = 0). Both None: the
    kernel and merge of plain causal attention, unchanged.
    """
    check_constraints(q_BNH, kv_pages_PSJH, page_table_BC)
    B, N, H = q_BNH.shape
    P, S, J, _ = kv_pages_PSJH.shape
    K = J // 2
    G = N // K
    Gp = max(16, _next_pow2(G))
    C = page_table_BC.shape[1]
    ppb = pages_per_block or max(1, 64 // S)
    if not _is_pow2(ppb):
        raise ValueError(f"gpu decode: pages_per_block={ppb} must be a power of two")
    total_blocks = pl.cdiv(C, ppb)
    splits = num_splits or max(1, min(total_blocks, pl.cdiv(DECODE_TARGET_PROGRAMS, B * K)))
    C_pad = total_blocks * ppb  # every block's page-id slice stays in bounds
    if sliding_window is not None:  # ... also when blocks start mid-table
        C_pad += ppb
    page_table_BC = jnp.pad(page_table_BC.astype(jnp.int32), ((0, 0), (0, C_pad - C)))
    seq_lens_B = seq_lens_B.astype(jnp.int32)
    q_BKGH = q_BNH.reshape(B, K, G, H)
    if Gp != G:
        q_BKGH = jnp.pad(q_BKGH, ((0, 0), (0, 0), (0, Gp - G), (0, 0)))

    k_spec, v_spec = _kv_specs(P, S, H)
    fp8 = is_fp8(kv_pages_PSJH)
    kernel = functools.partial(_decode_kernel, has_window=sliding_window is not None,
                               has_scales=fp8, sm_scale=sm_scale, pages_per_block=ppb,
                               page_size=S)
    in_specs = [
        pl.BlockSpec((1,), lambda b, k, s: (b,)),
        pl.BlockSpec((None, C_pad), lambda b, k, s: (b, 0)),
        pl.BlockSpec((None, None, Gp, H), lambda b, k, s: (b, k, 0, 0)),
        k_spec,
        v_spec,
    ]
    operands = [seq_lens_B, page_table_BC, q_BKGH, kv_pages_PSJH, kv_pages_PSJH]
    if sliding_window is not None:
        in_specs.append(pl.BlockSpec((1,), lambda b, k, s: (0,)))
        operands.append(jnp.asarray(sliding_window, jnp.int32).reshape(1))
    if fp8:
        in_specs.append(pl.BlockSpec((2,), lambda b, k, s: (0,)))
        operands.append(kv_scales(k_scale, v_scale))
    o_BKXGH, m_BKXG, l_BKXG = pl.pallas_call(
        kernel,
        grid=(B, K, splits),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, None, None, Gp, H), lambda b, k, s: (b, k, s, 0, 0)),
            pl.BlockSpec((None, None, None, Gp), lambda b, k, s: (b, k, s, 0)),
            pl.BlockSpec((None, None, None, Gp), lambda b, k, s: (b, k, s, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, K, splits, Gp, H), jnp.float32),
            jax.ShapeDtypeStruct((B, K, splits, Gp), jnp.float32),
            jax.ShapeDtypeStruct((B, K, splits, Gp), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=cost.GPU_DECODE_ATTENTION,
    )(*operands)

    # Merge the splits (empty ones carry m = MASK_VALUE, l = 0).
    m_BKG = jnp.max(m_BKXG, axis=2)
    if sinks_N is not None:  # the sink: one more partial, acc 0, m = sink, l = 1
        sink_BKG = jnp.broadcast_to(_sinks_KGp(sinks_N, K, G, Gp), m_BKG.shape)
        m_BKG = jnp.maximum(m_BKG, sink_BKG)
    w_BKXG = jnp.exp(m_BKXG - m_BKG[:, :, None])
    l_BKG = jnp.sum(l_BKXG * w_BKXG, axis=2)
    if sinks_N is not None:
        l_BKG = l_BKG + jnp.exp(sink_BKG - m_BKG)
    o_BKGH = jnp.sum(o_BKXGH * w_BKXG[..., None], axis=2)
    o_BKGH = o_BKGH / jnp.where(l_BKG == 0.0, 1.0, l_BKG)[..., None]
    return o_BKGH[:, :, :G].reshape(B, N, H).astype(q_BNH.dtype)


def _sinks_KGp(sinks_N, K: int, G: int, Gp: int):
    """[K, Gp] float32: query head k * G + g's sink at [k, g]; padding heads 0."""
    return jnp.pad(sinks_N.astype(jnp.float32).reshape(K, G), ((0, 0), (0, Gp - G)))


# ---------------------------------------------------------------------------- prefill


def _prefill_kernel(*refs, has_window, has_sinks, has_scales, sm_scale, block_q,
                    pages_per_block, page_size):
    """refs: meta [8], page table [B, C_pad], q [T, Gp, H], K and V views of the
    pool, [window [1]], [sinks [Gp] of this KV head], [scales [2] of an FP8 pool] (each
    only with one), output o."""
    meta_ref, pages_ref, q_ref, k_ref, v_ref, *refs = refs
    window = refs.pop(0)[0] if has_window else None
    sink_ref = refs.pop(0) if has_sinks else None
    scale_ref = refs.pop(0) if has_scales else None
    (o_ref,) = refs
    block_k = pages_per_block * page_size
    seq, t0, n_rows, pos0, kv_len = (meta_ref[0], meta_ref[1], meta_ref[2], meta_ref[3],
                                     meta_ref[4])
    T, Gp, H = q_ref.shape
    R = block_q * Gp
    # q and o are [T, Gp, H] as the caller has them (T >= block_q), not padded by a
    # block: an item near the end takes the block_q rows that end at T, its own being
    # the last n_rows from row `lead`. The rows before are other items' queries, under
    # positions that are not theirs; rows are independent, and only the item's are stored.
    # (A masked load would do without the shift, but costs the registers that keep the
    # 256-row item from spilling.)
    t_lo = jnp.minimum(t0, T - block_q)
    lead = t0 - t_lo
    q_RH = q_ref[pl.ds(t_lo, block_q)].reshape(R, H)
    q_pos_R = pos0 - lead + jnp.arange(R) // Gp
    kv_stop = jnp.where(n_rows > 0, jnp.minimum(kv_len, pos0 + n_rows), 0)
    if window is None:
        num_blocks = pl.cdiv(kv_stop, block_k)
    else:  # blocks start at the page of the oldest key any row sees (row 0's)
        seq_page0 = _window_start(pos0, window) // page_size
        num_blocks = pl.cdiv(kv_stop - seq_page0 * page_size, block_k)
    num_pages = pl.cdiv(kv_len, page_size)

    def body(j, carry):
        page0 = j * pages_per_block
        if window is not None:
            page0 = seq_page0 + page0
        page_ids = pages_ref[seq, pl.ds(page0, pages_per_block)]
        page_ids = jnp.where(page0 + jnp.arange(pages_per_block) < num_pages, page_ids, 0)
        k_XH, v_XH = _load_kv_block(k_ref, v_ref, page_ids, block_k, scale_ref, q_RH.dtype)
        key_pos_X = page0 * page_size + jnp.arange(block_k)
        key_ok_X = key_pos_X < kv_len
        # A stored row's position is below kv_len, so the causal test also keeps the keys
        # past kv_len out (their V rows are still zeroed: stale slots may hold NaN).
        visible_RX = key_pos_X[None, :] <= q_pos_R[:, None]
        if window is not None:  # HF: key > query - window
            visible_RX &= (window <= 0) | (key_pos_X[None, :] > q_pos_R[:, None] - window)
        return _online_softmax_step(q_RH, k_XH, v_XH, visible_RX, key_ok_X, carry, sm_scale)

    acc0_RH = jnp.zeros((R, H), jnp.float32)
    if sink_ref is None:
        m0_R, l0_R = jnp.full((R,), MASK_VALUE, jnp.float32), jnp.zeros((R,), jnp.float32)
    else:  # the sink is the first "key": max = sink, sum = exp(sink - sink) = 1
        m0_R = jnp.broadcast_to(sink_ref[...][None, :], (block_q, Gp)).reshape(R)
        l0_R = jnp.ones((R,), jnp.float32)
    init = (acc0_RH, m0_R, l0_R)
    acc_RH, _, l_R = jax.lax.fori_loop(0, num_blocks, body, init)
    o_RH = acc_RH / jnp.where(l_R == 0.0, 1.0, l_R)[:, None]
    row_Q = jnp.arange(block_q) - lead
    row_ok = jnp.broadcast_to(((row_Q >= 0) & (row_Q < n_rows))[:, None, None],
                              (block_q, Gp, H))
    plgpu.store(o_ref.at[pl.ds(t_lo, block_q)],
                o_RH.reshape(block_q, Gp, H).astype(o_ref.dtype), mask=row_ok)


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_rows", "pages_per_block",
                                             "num_warps", "num_stages", "interpret"))
def ragged_paged_attention(q_TNH, kv_pages_PSJH, query_start_B1, seq_lens_B, page_table_BC,
                           num_seqs, *, sm_scale, block_rows=None,
                           pages_per_block=None, num_warps=8, num_stages=2, interpret=False,
                           sinks_N=None, sliding_window=None, k_scale=None, v_scale=None):
    """Causal paged attention of a ragged batch (prefill chunks and decode tokens).

    block_rows: query rows per program, block_q * G (block_q = block_rows // G tokens,
    at least 1; rows are raised to 16; default PREFILL_BLOCK_ROWS, an FP8 pool's
    PREFILL_BLOCK_ROWS_FP8). Every K/V tile a program loads serves its
    block_q tokens, so a long prompt reads its context once per block_q tokens: 256
    rows (32 tokens of Qwen3's 8 query heads a KV head) read it half as often as 128.
    pages_per_block: pages per flash step (default `prefill_keys_per_step`). 8 warps,
    not yet tuned on hardware. Tokens past query_start_B1[num_seqs] return zeros.
    sliding_window (int or traced int32 scalar, <= 0: full) and sinks_N [N] (float32 in
    the kernel) are extra operands only when given: a block walks the pages from the
    first one any of its rows sees, and its softmax starts from the sinks.
    """
    check_constraints(q_TNH, kv_pages_PSJH, page_table_BC)
    T, N, H = q_TNH.shape
    P, S, J, _ = kv_pages_PSJH.shape
    K = J // 2
    G = N // K
    Gp = _next_pow2(G)
    if block_rows is None:
        block_rows = PREFILL_BLOCK_ROWS_FP8 if is_fp8(kv_pages_PSJH) else PREFILL_BLOCK_ROWS
    block_q = max(1, _next_pow2(max(block_rows, 16)) // Gp)
    if block_q * Gp < 16:
        block_q = 16 // Gp
    ppb = pages_per_block or max(1, prefill_keys_per_step(block_q * Gp, H) // S)
    if not _is_pow2(ppb):
        raise ValueError(f"gpu prefill: pages_per_block={ppb} must be a power of two")
    B, C = page_table_BC.shape
    C_pad = pl.cdiv(C, ppb) * ppb
    if sliding_window is not None:  # blocks may start mid-table: one more block in bounds
        C_pad += ppb
    page_table_BC = jnp.pad(page_table_BC.astype(jnp.int32), ((0, 0), (0, C_pad - C)))
    query_start_B1 = query_start_B1.astype(jnp.int32)
    seq_lens_B = seq_lens_B.astype(jnp.int32)
    num_seqs = jnp.asarray(num_seqs, jnp.int32).reshape(())
    meta_M8 = _prefill_items(query_start_B1, seq_lens_B, num_seqs, T, block_q)

    # q and o keep the caller's [T, N, H] (a bitcast to [T, K, G, H]); only a G that is
    # no power of two is padded to Gp heads, and fewer than block_q rows to block_q.
    T_in = max(T, block_q)
    q_TKGH = q_TNH.reshape(T, K, G, H)
    if Gp != G or T_in != T:
        q_TKGH = jnp.pad(q_TKGH, ((0, T_in - T), (0, 0), (0, Gp - G), (0, 0)))

    k_spec, v_spec = _kv_specs(P, S, H)
    fp8 = is_fp8(kv_pages_PSJH)
    kernel = functools.partial(_prefill_kernel, has_window=sliding_window is not None,
                               has_sinks=sinks_N is not None, has_scales=fp8,
                               sm_scale=sm_scale,
                               block_q=block_q, pages_per_block=ppb, page_size=S)
    in_specs = [
        pl.BlockSpec((None, 8), lambda i, k: (i, 0)),
        pl.BlockSpec((B, C_pad), lambda i, k: (0, 0)),
        pl.BlockSpec((T_in, None, Gp, H), lambda i, k: (0, k, 0, 0)),
        k_spec,
        v_spec,
    ]
    operands = [meta_M8, page_table_BC, q_TKGH, kv_pages_PSJH, kv_pages_PSJH]
    if sliding_window is not None:
        in_specs.append(pl.BlockSpec((1,), lambda i, k: (0,)))
        operands.append(jnp.asarray(sliding_window, jnp.int32).reshape(1))
    if sinks_N is not None:
        in_specs.append(pl.BlockSpec((None, Gp), lambda i, k: (k, 0)))
        operands.append(_sinks_KGp(sinks_N, K, G, Gp))
    if fp8:
        in_specs.append(pl.BlockSpec((2,), lambda i, k: (0,)))
        operands.append(kv_scales(k_scale, v_scale))
    o_TKGH = pl.pallas_call(
        kernel,
        grid=(meta_M8.shape[0], K),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((T_in, None, Gp, H), lambda i, k: (0, k, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((T_in, K, Gp, H), q_TNH.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=cost.GPU_PREFILL_ATTENTION,
    )(*operands)

    return o_TKGH[:T, :, :G].reshape(T, N, H)


def _prefill_items(query_start_B1, seq_lens_B, num_seqs, T: int, block_q: int):
    """The prefill grid's work items, meta rows as `query_blocks`: the sequences' blocks,
    then blocks over the rows past the last sequence's tokens (kv_len 0: they attend to
    nothing and store zeros), so that every one of the T rows of the output is written
    by exactly one item. Items: the sequences' blocks are at most ceil(T_real / block_q)
    + B - 1, the tail's ceil((T - T_real) / block_q), together at most ceil(T /
    block_q) + B; items past them have 0 rows."""
    B = seq_lens_B.shape[0]
    max_blocks = pl.cdiv(T, block_q) + B
    meta_M8, _ = query_blocks(query_start_B1, seq_lens_B, num_seqs, block_q, max_blocks)
    used = jnp.sum(meta_M8[:, 2] > 0)
    tail0 = query_start_B1[num_seqs]
    t0_M = tail0 + (jnp.arange(max_blocks, dtype=jnp.int32) - used) * block_q
    tail_M = (meta_M8[:, 2] == 0) & (t0_M < T)
    tail_meta_M8 = jnp.zeros_like(meta_M8).at[:, 1].set(t0_M).at[:, 2].set(
        jnp.clip(T - t0_M, 0, block_q))
    return jnp.where(tail_M[:, None], tail_meta_M8, meta_M8)
