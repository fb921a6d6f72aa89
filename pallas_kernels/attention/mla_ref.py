"""Multi-head latent attention (DeepSeek-V3) over a latent paged KV pool, in plain JAX:
the XLA path (absorbed form), and the oracles of the MLA kernels (both forms).

Pool layout (lp_jax/models/kv_cache.py):

    kv_pages_PS1X  [P, S, 1, X]   X = A + R: a token's normed latent c (A =
                                  kv_lora_rank) then its shared rotary key k_pe (R =
                                  qk_rope_head_dim), once per token, for all heads

X may exceed A + R (lanes past A + R are padding, never read): the TPU kernel's pool
rounds X up to a multiple of 128 (576 -> 640 for DeepSeek-V3), since XLA lays a pool
whose last axis is not a multiple of 128 lanes out page-minor and would copy it whole
before every kernel call (mla_tpu.py).

Head n of a key is [c @ W_UK[:, n] (H = qk_nope_head_dim), k_pe] and its value c @ W_UV[:, n]
(O = v_head_dim), with kv_b_proj = [W_UK | W_UV] per head ([A, N, H + O]). Two forms give
the same attention:

* expanded: every page's latents are expanded into per-head keys and values (what
  transformers computes). Here a page is expanded for each query row that reads it
  (A N (H + O) multiply-adds a query row and key), which only an oracle can afford: the
  engine never runs this form (lp_jax/models/deepseek_v3.py);
* absorbed: W_UK is folded into the query (q_lat = q_nope @ W_UK^T, [N, A]) and W_UV
  applied once to the attention-weighted latent: scores are q_lat . c + q_pe . k_pe, the
  output (p @ c) @ W_UV. No per-head key or value exists for cached tokens; a query
  token reads A + R values a cached token instead of N (H + R + O), and a (query row,
  key) pair costs N (2A + R) multiply-adds. Every engine step runs this form.

Batches are ragged as in ref.py (`token_positions`); padding tokens return zeros. The
softmax runs in float32 over query blocks of `block_q` packed tokens, one page at a time.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.attention.ref import FP8_DTYPE, MASK_VALUE, is_fp8, token_positions


def check_mla_layout(name: str, q_lat_TNA, q_pe_TNR, kv_pages_PS1X) -> None:
    """Raises ValueError unless the pool is [P, S, 1, X >= A + R] for q_lat [T, N, A]
    and q_pe [T, N, R]."""
    if q_lat_TNA.ndim != 3 or q_pe_TNR.shape[:2] != q_lat_TNA.shape[:2]:
        raise ValueError(f"{name}: q_lat {q_lat_TNA.shape} and q_pe {q_pe_TNR.shape} must "
                         "be [T, N, A] and [T, N, R]")
    A, R = q_lat_TNA.shape[-1], q_pe_TNR.shape[-1]
    if (kv_pages_PS1X.ndim != 4 or kv_pages_PS1X.shape[2] != 1
            or kv_pages_PS1X.shape[3] < A + R):
        raise ValueError(f"{name}: latent pool {kv_pages_PS1X.shape} must be "
                         f"[P, S, 1, X >= {A + R}] (kv_lora_rank {A} + rope dim {R})")


def check_mla_dtypes(name: str, q_lat_TNA, kv_pages_PS1X, supported) -> None:
    """Raises ValueError unless q is one of `supported` and the pool q's dtype or e4m3."""
    ok = [jnp.dtype(d) for d in supported]
    if q_lat_TNA.dtype not in ok or kv_pages_PS1X.dtype not in (
            q_lat_TNA.dtype, jnp.dtype(FP8_DTYPE)):
        raise ValueError(f"{name}: dtypes q={q_lat_TNA.dtype}, cache={kv_pages_PS1X.dtype} "
                         f"not supported; q one of {', '.join(d.name for d in ok)}, the "
                         "cache q's dtype or float8_e4m3fn")


def quantize_latent(latent_TX: jax.Array, kv_scale) -> jax.Array:
    """A latent row as an FP8 pool stores it: x / scale, saturated to e4m3's range."""
    limit = float(jnp.finfo(FP8_DTYPE).max)
    x = latent_TX.astype(jnp.float32) / jnp.asarray(kv_scale, jnp.float32)
    return jnp.clip(x, -limit, limit).astype(FP8_DTYPE)


def write_latent(kv_pages_PS1X: jax.Array, latent_TX: jax.Array, slots_T: jax.Array,
                 kv_scale=None):
    """Scatters each token's [c | k_pe] row into its physical slot; slot < 0 is skipped.
    An FP8 pool stores it divided by `kv_scale` (None: 1.0)."""
    P, S, _, X = kv_pages_PS1X.shape
    latent_TX = jnp.pad(latent_TX, ((0, 0), (0, X - latent_TX.shape[-1])))
    if is_fp8(kv_pages_PS1X):
        latent_TX = quantize_latent(latent_TX, 1.0 if kv_scale is None else kv_scale)
    page_T = jnp.where(slots_T < 0, P, slots_T // S)  # page P is out of range: dropped
    return kv_pages_PS1X.at[page_T, slots_T % S, 0].set(
        latent_TX.astype(kv_pages_PS1X.dtype), mode="drop")


def ref_mla_paged_attention(
    q_nope_TNH: jax.Array,
    q_pe_TNR: jax.Array,
    kv_pages_PS1X: jax.Array,
    w_uk_ANH: jax.Array,
    w_uv_ANO: jax.Array,
    query_start_B1: jax.Array,
    seq_lens_B: jax.Array,
    page_table_BC: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    absorbed: bool,
    block_q: int = 64,
    kv_scale=None,
) -> jax.Array:
    """Causal latent attention for a ragged batch; o_TNO in q's dtype. `absorbed` picks
    the form (module docstring); both read the same pool and agree to rounding. An FP8
    pool is read as x * kv_scale (None: 1.0) in float32."""
    T, N, _ = q_nope_TNH.shape
    out_dtype = q_pe_TNR.dtype
    A, R = w_uk_ANH.shape[0], q_pe_TNR.shape[-1]
    O = w_uv_ANO.shape[-1]
    S = kv_pages_PS1X.shape[1]
    num_seqs = jnp.asarray(num_seqs, jnp.int32).reshape(())
    seq_T, pos_T, valid_T = token_positions(query_start_B1, seq_lens_B, num_seqs, T)
    w_uk_ANH = w_uk_ANH.astype(jnp.float32)
    w_uv_ANO = w_uv_ANO.astype(jnp.float32)
    q_nope_TNH = q_nope_TNH.astype(jnp.float32) * sm_scale
    q_pe_TNR = q_pe_TNR.astype(jnp.float32) * sm_scale
    if absorbed:  # W_UK folded into the query
        q_nope_TNH = jnp.einsum("tnh,anh->tna", q_nope_TNH, w_uk_ANH)
    dequant = 1.0
    if is_fp8(kv_pages_PS1X) and kv_scale is not None:
        dequant = jnp.asarray(kv_scale, jnp.float32)
    Y = A if absorbed else O  # what p multiplies: latents, or per-head values

    block_q = min(block_q, T)
    num_blocks = -(-T // block_q)
    pad = num_blocks * block_q - T

    def blocks(x):
        return jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1)).reshape(
            num_blocks, block_q, *x.shape[1:])

    def one_block(args):
        qn_bNx, qr_bNR, seq_b, pos_b = args
        pages_bC = page_table_BC[seq_b]
        num_pages = jnp.max(pos_b) // S + 1  # 0 when the whole block is padding

        def body(c, carry):
            m_bN, l_bN, acc_bNY = carry
            kv_bSX = kv_pages_PS1X[pages_bC[:, c], :, 0].astype(jnp.float32) * dequant
            lat_bSA, k_pe_bSR = kv_bSX[..., :A], kv_bSX[..., A:A + R]
            s_bNS = jnp.einsum("bnr,bsr->bns", qr_bNR, k_pe_bSR)
            if absorbed:
                s_bNS += jnp.einsum("bna,bsa->bns", qn_bNx, lat_bSA)
            else:  # expand this page's latents into per-head keys and values
                k_bSNH = jnp.einsum("bsa,anh->bsnh", lat_bSA, w_uk_ANH)
                s_bNS += jnp.einsum("bnh,bsnh->bns", qn_bNx, k_bSNH)
            key_pos_S = c * S + jnp.arange(S)
            visible_bS = key_pos_S[None, :] <= pos_b[:, None]
            s_bNS = jnp.where(visible_bS[:, None, :], s_bNS, MASK_VALUE)
            m_new = jnp.maximum(m_bN, jnp.max(s_bNS, axis=-1))
            p_bNS = jnp.where(visible_bS[:, None, :], jnp.exp(s_bNS - m_new[..., None]), 0.0)
            alpha = jnp.exp(m_bN - m_new)
            if absorbed:  # p @ c: the values stay latent
                pv_bNY = jnp.einsum("bns,bsa->bna", p_bNS, lat_bSA)
            else:
                pv_bNY = jnp.einsum("bns,bsno->bno", p_bNS,
                                    jnp.einsum("bsa,ano->bsno", lat_bSA, w_uv_ANO))
            return (m_new, alpha * l_bN + jnp.sum(p_bNS, axis=-1),
                    alpha[..., None] * acc_bNY + pv_bNY)

        b = seq_b.shape[0]
        init = (jnp.full((b, N), MASK_VALUE, jnp.float32), jnp.zeros((b, N), jnp.float32),
                jnp.zeros((b, N, Y), jnp.float32))
        _, l_bN, acc_bNY = jax.lax.fori_loop(0, num_pages, body, init)
        return acc_bNY / jnp.where(l_bN == 0.0, 1.0, l_bN)[..., None]

    pos_Q = jnp.pad(pos_T, (0, pad), constant_values=-1).reshape(num_blocks, block_q)
    o_QbNY = jax.lax.map(one_block, (blocks(q_nope_TNH), blocks(q_pe_TNR), blocks(seq_T),
                                     pos_Q))
    o_TNY = o_QbNY.reshape(num_blocks * block_q, N, Y)[:T]
    if absorbed:  # W_UV after attention
        o_TNY = jnp.einsum("tna,ano->tno", o_TNY, w_uv_ANO)
    return jnp.where(valid_T[:, None, None], o_TNY, 0.0).astype(out_dtype)
