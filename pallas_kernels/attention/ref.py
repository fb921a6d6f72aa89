"""Reference paged attention in plain JAX: the `xla` backend and the kernels' oracle.

KV-cache layout (shared by every backend):

    kv_pages_PSJH  [P, S, 2K, H]   K head k at index 2k, V head k at 2k+1

One pool holds the pages of every layer: layer l owns physical pages
[l * pages_per_layer, (l + 1) * pages_per_layer). The block manager hands out
*logical* page ids, the same for all layers, and the model adds the layer offset
before calling a kernel, so kernels only ever see physical page tables. The
interleaved K/V axis is the layout of JAX's TPU ragged paged attention, so that
kernel reads our cache without a copy.

Packed pool, for head_dim < 128 on TPU (GPT-OSS: 64):

    kv_pages_PSKX  [P, S, K, 2H]   K head k in lanes [0, H), V head k in [H, 2H)

the same row-major bytes as [P, S, 2K, H] under another shape. It exists because the
shape decides the TPU layout: XLA lays [P, S, 2K, 64] out page-minor (64 lanes would be
half padding), which no kernel can DMA pages from, while [P, S, K, 128] stays row-major
and unpadded. Every entry point accepts it (a pool whose last axis is twice q's
head_dim); `unpacked` gives the [P, S, 2K, H] view (a free reshape on GPU and CPU, a
relayout on TPU, where only the "tpu" kernel reads it in place).

Batches are ragged: the T query tokens are packed sequence after sequence.
Sequence b owns tokens [query_start_B1[b], query_start_B1[b+1]) and, after this
step's KV write, has seq_lens_B[b] tokens of context, so its i-th query token
sits at position seq_lens_B[b] - q_len_b + i and attends causally to positions
<= its own. Decode is the case q_len_b = 1. Tokens past query_start_B1[num_seqs]
are padding and return zeros.

Two optional features (GPT-OSS), off by default:

* `sliding_window` W (a Python int or a traced int32 scalar, so one program serves
  layers of both kinds; None or <= 0: full causal attention): the query at position p
  sees keys in (p - W, p], HF's `key > query - sliding_window`. Pages wholly before
  the window of every token of a query block are skipped, not just masked (here a
  block of `block_q` packed tokens may span sequences; the kernels' blocks never do).
* `sinks_N` [N]: a learned logit per query head that joins the softmax denominator
  (an extra key whose value is zero): softmax over [scores, sink], sink column dropped.
  The online softmax starts from it (running max = sink, running sum = 1), so a row
  that sees no key returns zeros, as it does without sinks.

FP8 pool (kv_cache_dtype "fp8", vLLM's e4m3): the pool's dtype is float8_e4m3fn and a
layer has two float32 scalars, `k_scale` and `v_scale` (the checkpoint's, else 1.0).
`write_kv` stores x / scale, saturated to +-448 (e4m3 has no infinity: an overflow would
be NaN); every backend dequantises what it loads, x * scale in float32, before the
scores and p @ V, so the arithmetic after the load is that of a 16-bit pool. The dtype
of the pool is the switch: a 16-bit pool ignores the scales. The packed form holds the
same bytes either way (1-byte values, row-major).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8_DTYPE).max)  # 448


def is_fp8(kv_pages) -> bool:
    """Whether the pool holds e4m3 values (and is read through k_scale / v_scale)."""
    return jnp.dtype(kv_pages.dtype) == jnp.dtype(FP8_DTYPE)


def kv_scales(k_scale=None, v_scale=None) -> jax.Array:
    """[2] float32 (k_scale, v_scale); a missing one is 1.0, vLLM's default."""
    return jnp.stack([jnp.asarray(1.0 if s is None else s, jnp.float32).reshape(())
                      for s in (k_scale, v_scale)])


def quantize_fp8(x, scale) -> jax.Array:
    """x / scale in e4m3, saturated to +-448 (the cast alone would give NaN)."""
    return jnp.clip(x.astype(jnp.float32) / scale, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)


def is_packed(q_xNH: jax.Array, kv_pages) -> bool:
    """Whether the pool is the packed [P, S, K, 2H] form (last axis twice head_dim)."""
    return kv_pages.shape[-1] == 2 * q_xNH.shape[-1]


def unpacked(kv_pages_PSKX: jax.Array) -> jax.Array:
    """The packed pool as [P, S, 2K, H] (same bytes, row-major)."""
    P, S, K, X = kv_pages_PSKX.shape
    return kv_pages_PSKX.reshape(P, S, 2 * K, X // 2)


def check_layout(name: str, q_xNH: jax.Array, kv_pages_PSJH: jax.Array) -> int:
    """The layout rules every backend shares (a packed pool as its [P, S, 2K, H] view);
    returns K. `name` prefixes the error."""
    _, N, H = q_xNH.shape
    _, _, J, H_kv = kv_pages_PSJH.shape
    if is_packed(q_xNH, kv_pages_PSJH):
        J, H_kv = 2 * J, H_kv // 2
    if J % 2:
        raise ValueError(f"{name}: cache axis J={J} must be 2K (K and V interleaved)")
    K = J // 2
    if H_kv != H:
        raise ValueError(f"{name}: q head_dim {H} != cache head_dim {H_kv}")
    if N % K:
        raise ValueError(f"{name}: query heads N={N} not divisible by KV heads K={K}")
    return K


def write_kv(kv_pages_PSJH: jax.Array, k_TKH: jax.Array, v_TKH: jax.Array,
             slots_T: jax.Array, *, k_scale=None, v_scale=None) -> jax.Array:
    """Scatters new K/V rows into physical slots (page * S + offset); slot < 0 is skipped.
    A packed pool [P, S, K, 2H] takes each head's K and V side by side. An FP8 pool
    stores k / k_scale and v / v_scale (`quantize_fp8`; None: 1.0)."""
    P, S, J, H = kv_pages_PSJH.shape
    T, K, _ = k_TKH.shape
    if is_fp8(kv_pages_PSJH):
        scale_2 = kv_scales(k_scale, v_scale)
        k_TKH, v_TKH = quantize_fp8(k_TKH, scale_2[0]), quantize_fp8(v_TKH, scale_2[1])
    if H == 2 * k_TKH.shape[-1]:  # packed
        kv_TJH = jnp.concatenate([k_TKH, v_TKH], axis=-1).astype(kv_pages_PSJH.dtype)
    else:
        kv_TJH = jnp.stack([k_TKH, v_TKH], axis=2).reshape(T, J, H).astype(kv_pages_PSJH.dtype)
    # Indexed by (page, offset) in the pool's own shape, not as rows of a [P * S, J, H]
    # reshape: XLA turns a one-row scatter into a dynamic-update-slice, and XLA:CPU fused
    # that with the reshape back to [P, S, J, H] into a fusion it does not run in place,
    # copying the whole pool in every layer of a 1-row program (tests/test_program_memory).
    page_T = jnp.where(slots_T < 0, P, slots_T // S)  # page P is out of range: dropped
    return kv_pages_PSJH.at[page_T, slots_T % S].set(kv_TJH, mode="drop")


def token_positions(query_start_B1: jax.Array, seq_lens_B: jax.Array, num_seqs: jax.Array,
                    num_tokens: int):
    """Per-token (sequence index, position, valid) for a ragged batch."""
    t_T = jnp.arange(num_tokens, dtype=jnp.int32)
    seq_T = jnp.searchsorted(query_start_B1[1:], t_T, side="right").astype(jnp.int32)
    valid_T = t_T < query_start_B1[num_seqs]
    seq_T = jnp.where(valid_T, seq_T, 0)
    q_len_T = query_start_B1[seq_T + 1] - query_start_B1[seq_T]
    pos_T = seq_lens_B[seq_T] - q_len_T + (t_T - query_start_B1[seq_T])
    return seq_T, jnp.where(valid_T, pos_T, -1), valid_T


def query_blocks(query_start_B1, seq_lens_B, num_seqs, block_q: int, max_blocks: int):
    """Cuts every sequence's new tokens into work items of at most `block_q` tokens (an
    item never spans two sequences), as the Pallas kernels schedule them.

    Returns (meta_M8, first_block_B): int32 rows of (seq, first token, valid rows,
    position of row 0, kv_len, 0, 0, 0) for `max_blocks` items (unused items have 0
    valid rows), and the index of each sequence's first item. Sequence b's token
    t0 + i lands in item first_block_B[b] + i // block_q, row i % block_q.
    """
    B = seq_lens_B.shape[0]
    active_B = jnp.arange(B) < num_seqs
    q_len_B = jnp.where(active_B, query_start_B1[1:] - query_start_B1[:-1], 0)
    nblk_B = (q_len_B + block_q - 1) // block_q
    cum_B = jnp.cumsum(nblk_B)
    i_M = jnp.arange(max_blocks, dtype=jnp.int32)
    seq_M = jnp.minimum(jnp.searchsorted(cum_B, i_M, side="right"), B - 1).astype(jnp.int32)
    local_M = i_M - (cum_B[seq_M] - nblk_B[seq_M])
    valid_M = i_M < cum_B[-1]
    t0_M = query_start_B1[seq_M] + local_M * block_q
    rows_M = jnp.where(valid_M, jnp.minimum(block_q, query_start_B1[seq_M + 1] - t0_M), 0)
    pos0_M = seq_lens_B[seq_M] - q_len_B[seq_M] + local_M * block_q
    zero = jnp.zeros_like(i_M)
    meta = jnp.stack([seq_M, jnp.where(valid_M, t0_M, 0), rows_M,
                      jnp.where(valid_M, pos0_M, 0), jnp.where(valid_M, seq_lens_B[seq_M], 0),
                      zero, zero, zero], axis=1)
    return meta.astype(jnp.int32), (cum_B - nblk_B).astype(jnp.int32)


def ref_ragged_paged_attention(
    q_TNH: jax.Array,
    kv_pages_PSJH: jax.Array,
    query_start_B1: jax.Array,
    seq_lens_B: jax.Array,
    page_table_BC: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    block_q: int = 64,
    sinks_N: jax.Array | None = None,
    sliding_window=None,
    k_scale=None,
    v_scale=None,
) -> jax.Array:
    """Causal paged attention for a ragged batch (prefill, decode, or both).

    Flash-style: query blocks of `block_q` tokens walk their sequences' pages one
    page at a time with an online softmax, from the first page any token of the block
    can see (0 without a window) to the last. Memory is O(block_q * S), not
    O(T * context). `sinks_N`, `sliding_window` and, for an FP8 pool, `k_scale` /
    `v_scale`: see the module docstring.
    """
    if is_packed(q_TNH, kv_pages_PSJH):
        kv_pages_PSJH = unpacked(kv_pages_PSJH)
    T, N, H = q_TNH.shape
    _, S, J, _ = kv_pages_PSJH.shape
    K = J // 2
    G = N // K  # query heads per KV head; head n reads KV head n // G (HF repeat_kv)
    num_seqs = jnp.asarray(num_seqs, jnp.int32).reshape(())
    seq_T, pos_T, valid_T = token_positions(query_start_B1, seq_lens_B, num_seqs, T)

    block_q = min(block_q, T)
    num_blocks = -(-T // block_q)
    pad = num_blocks * block_q - T
    q_QKGH = jnp.pad(q_TNH, ((0, pad), (0, 0), (0, 0))).reshape(num_blocks, block_q, K, G, H)
    seq_Q = jnp.pad(seq_T, (0, pad)).reshape(num_blocks, block_q)
    pos_Q = jnp.pad(pos_T, (0, pad), constant_values=-1).reshape(num_blocks, block_q)
    window = None if sliding_window is None else jnp.asarray(sliding_window, jnp.int32)
    scale_2 = kv_scales(k_scale, v_scale) if is_fp8(kv_pages_PSJH) else None

    def one_block(args):
        q_bKGH, seq_b, pos_b = args
        q_bKGH = q_bKGH.astype(jnp.float32) * sm_scale
        pages_bC = page_table_BC[seq_b]
        last_pos = jnp.max(pos_b)
        num_pages = last_pos // S + 1  # 0 when the whole block is padding
        first_page = 0
        if window is not None:  # the page of the oldest key any real row still sees
            first_pos = jnp.min(jnp.where(pos_b >= 0, pos_b, last_pos))
            first_page = jnp.where(window > 0, jnp.maximum(first_pos - window + 1, 0) // S, 0)

        def body(c, carry):
            m_bKG, l_bKG, acc_bKGH = carry
            kv_bSJH = kv_pages_PSJH[pages_bC[:, c]].astype(jnp.float32)
            k_bSKH, v_bSKH = kv_bSJH[:, :, 0::2], kv_bSJH[:, :, 1::2]
            if scale_2 is not None:  # dequantise on load
                k_bSKH, v_bSKH = k_bSKH * scale_2[0], v_bSKH * scale_2[1]
            s_bKGS = jnp.einsum("bkgh,bskh->bkgs", q_bKGH, k_bSKH)
            key_pos_S = c * S + jnp.arange(S)
            visible_bS = key_pos_S[None, :] <= pos_b[:, None]
            if window is not None:
                in_window_bS = key_pos_S[None, :] > pos_b[:, None] - window
                visible_bS &= (window <= 0) | in_window_bS
            s_bKGS = jnp.where(visible_bS[:, None, None, :], s_bKGS, MASK_VALUE)
            m_new = jnp.maximum(m_bKG, jnp.max(s_bKGS, axis=-1))
            p_bKGS = jnp.exp(s_bKGS - m_new[..., None])
            p_bKGS = jnp.where(visible_bS[:, None, None, :], p_bKGS, 0.0)
            alpha = jnp.exp(m_bKG - m_new)
            l_new = alpha * l_bKG + jnp.sum(p_bKGS, axis=-1)
            acc_new = alpha[..., None] * acc_bKGH + jnp.einsum("bkgs,bskh->bkgh", p_bKGS, v_bSKH)
            return m_new, l_new, acc_new

        if sinks_N is None:
            m0, l0 = jnp.full(q_bKGH.shape[:3], MASK_VALUE, jnp.float32), 0.0
        else:  # the sink is the first "key": max = sink, sum = exp(sink - sink) = 1
            m0, l0 = jnp.broadcast_to(sink_KG, q_bKGH.shape[:3]), 1.0
        init = (m0, jnp.full(q_bKGH.shape[:3], l0, jnp.float32),
                jnp.zeros(q_bKGH.shape, jnp.float32))
        _, l_bKG, acc_bKGH = jax.lax.fori_loop(first_page, num_pages, body, init)
        return acc_bKGH / jnp.where(l_bKG == 0.0, 1.0, l_bKG)[..., None]

    sink_KG = None if sinks_N is None else sinks_N.astype(jnp.float32).reshape(K, G)
    o_QKGH = jax.lax.map(one_block, (q_QKGH, seq_Q, pos_Q))
    o_TNH = o_QKGH.reshape(num_blocks * block_q, N, H)[:T]
    return jnp.where(valid_T[:, None, None], o_TNH, 0.0).astype(q_TNH.dtype)


def ref_decode_attention(q_BNH, kv_pages_PSJH, seq_lens_B, page_table_BC, *, sm_scale,
                         sinks_N=None, sliding_window=None, k_scale=None, v_scale=None):
    """One query token per sequence; sequences with seq_len 0 are padding (zeros)."""
    B = q_BNH.shape[0]
    query_start_B1 = jnp.arange(B + 1, dtype=jnp.int32)
    num_seqs = jnp.sum(seq_lens_B > 0).astype(jnp.int32)
    # Padding sequences must sit at the end for the ragged form; decode batches do.
    return ref_ragged_paged_attention(
        q_BNH, kv_pages_PSJH, query_start_B1, seq_lens_B, page_table_BC, num_seqs,
        sm_scale=sm_scale, block_q=B, sinks_N=sinks_N, sliding_window=sliding_window,
        k_scale=k_scale, v_scale=v_scale,
    )


def ref_attention_dense(q_TNH, k_TKH, v_TKH, *, sm_scale):
    """Plain causal attention over one contiguous sequence: the oracle for tests."""
    T, N, H = q_TNH.shape
    G = N // k_TKH.shape[1]
    k_TNH = jnp.repeat(k_TKH, G, axis=1).astype(jnp.float32)
    v_TNH = jnp.repeat(v_TKH, G, axis=1).astype(jnp.float32)
    s_NTT = jnp.einsum("tnh,snh->nts", q_TNH.astype(jnp.float32), k_TNH) * sm_scale
    s_NTT = jnp.where(jnp.tril(jnp.ones((T, T), bool))[None], s_NTT, MASK_VALUE)
    return jnp.einsum("nts,snh->tnh", jax.nn.softmax(s_NTT, axis=-1), v_TNH).astype(q_TNH.dtype)
