"""Multi-head latent attention over the latent paged pool, with a backend switch.

`mla_paged_attention` takes the model's per-head queries (q_nope, q_pe) and kv_b_proj's
halves (W_UK, W_UV) and returns o_TNO in either form (mla_ref.py):

* absorbed (what the engine runs for every step, prefill and decode rows alike): "xla"
  is the reference; "tpu" (mla_tpu.py) and "gpu" (mla_gpu.py) fold W_UK into the query
  here, run the Pallas kernel over the latent pool (N heads against one latent row a
  key, each query token over its own causal context), and apply W_UV to its latent
  output;
* expanded: the reference on every backend, the oracle the tests compare the absorbed
  form against (kv_b_proj on each page of latents, once per query row; docs/mla_kernels.md).

Backends resolve as the other attention kernels' do (pallas_kernels.attention: "auto"
is "tpu" on TPU, "gpu" on GPU, "xla" elsewhere; interpret mode runs a named kernel in
the Pallas interpreter; a kernel asked for on another platform is an error).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.attention import _kernel_backend
from pallas_kernels.attention import mla_gpu as _gpu
from pallas_kernels.attention import mla_tpu as _tpu
from pallas_kernels.attention.mla_ref import ref_mla_paged_attention, write_latent

BACKENDS = ("auto", "xla", "tpu", "gpu")
_KERNELS = {"tpu": _tpu, "gpu": _gpu}


def resolve_mla_backend(backend: str) -> str:
    """The MLA backend `backend` names ("tpu_jax", JAX's shipped GQA kernel, has no MLA
    form and is refused)."""
    if backend not in BACKENDS:
        raise ValueError(f"latent attention (MLA) has no backend {backend!r}; expected one "
                         f"of {BACKENDS}")
    from pallas_kernels.attention import resolve_backend

    return resolve_backend(backend)


def kernel_refusal(backend: str, heads: int, latent_dim: int, rope_dim: int,
                   dtype=jnp.bfloat16) -> str | None:
    """Why `backend`'s MLA kernel cannot serve these head shapes (16-token pages, the
    TPU row padded to whole lanes), or None when it can, or for "xla"."""
    resolved = resolve_mla_backend(backend)
    if resolved == "xla":
        return None
    row = latent_dim + rope_dim
    if resolved == "tpu":
        row = -(-row // 128) * 128
    q_lat = jax.ShapeDtypeStruct((1, heads, latent_dim), dtype)
    q_pe = jax.ShapeDtypeStruct((1, heads, rope_dim), dtype)
    pool = jax.ShapeDtypeStruct((1, 16, 1, row), dtype)
    try:
        if resolved == "tpu":
            _tpu.check_constraints(q_lat, q_pe, pool)
        else:
            _gpu.check_constraints(q_lat, q_pe, pool, block_h=16)
    except ValueError as e:
        return str(e)
    return None


def absorb_query(q_nope_TNH, w_uk_ANH):
    """q_lat_TNA = q_nope . W_UK (per head), in q's dtype, float32 products."""
    q_lat = jnp.einsum("tnh,anh->tna", q_nope_TNH.astype(jnp.float32),
                       w_uk_ANH.astype(jnp.float32))
    return q_lat.astype(q_nope_TNH.dtype)


def mla_paged_attention(q_nope_TNH, q_pe_TNR, kv_pages_PS1X, w_uk_ANH, w_uv_ANO,
                        query_start_B1, seq_lens_B, page_table_BC, num_seqs, *, sm_scale,
                        absorbed: bool, backend: str = "auto", kv_scale=None):
    """Causal latent attention of a ragged batch: o_TNO in q's dtype (mla_ref.py's
    semantics). kv_scale: an FP8 pool's scale (None: 1.0)."""
    resolve_mla_backend(backend)
    resolved, interpret = _kernel_backend(backend)
    if resolved == "xla" or not absorbed:
        return ref_mla_paged_attention(
            q_nope_TNH, q_pe_TNR, kv_pages_PS1X, w_uk_ANH, w_uv_ANO, query_start_B1,
            seq_lens_B, page_table_BC, num_seqs, sm_scale=sm_scale, absorbed=absorbed,
            kv_scale=kv_scale)
    q_lat_TNA = absorb_query(q_nope_TNH, w_uk_ANH)
    o_lat_TNA = _KERNELS[resolved].mla_decode_attention(
        q_lat_TNA, q_pe_TNR.astype(q_lat_TNA.dtype), kv_pages_PS1X, query_start_B1,
        seq_lens_B, page_table_BC, num_seqs, sm_scale=sm_scale, kv_scale=kv_scale,
        interpret=interpret)
    o_TNO = jnp.einsum("tna,ano->tno", o_lat_TNA.astype(jnp.float32),
                       w_uv_ANO.astype(jnp.float32))
    return o_TNO.astype(q_pe_TNR.dtype)


__all__ = ["BACKENDS", "mla_paged_attention", "absorb_query", "resolve_mla_backend",
           "kernel_refusal", "write_latent"]
