"""Backend "tpu_jax": JAX's shipped Pallas Mosaic ragged paged attention kernel.

`jax.experimental.pallas.ops.tpu.ragged_paged_attention` reads our cache as is: it
takes one [P, S, 2K, H] pool with K head k at 2k and V head k at 2k + 1, physical
page tables [B, C], cumulative query offsets [B + 1] and per-sequence KV lengths,
and does prefill, chunked prefill and decode in one launch with query offset
kv_len - q_len. So both entry points can call it; this module only adapts arguments.
It is the A/B baseline for our own kernel (tpu.py, backend "tpu") on real TPUs.
The adaptations:

* num_seqs must be int32[1] (ours is a scalar);
* rows past query_start_B1[num_seqs] are left unwritten by the kernel (they hold
  VMEM garbage), so they are zeroed here;
* decode: padding sequences (seq_len 0) may sit anywhere in the batch. The kernel
  must not see kv_len 0 with q_len 1 (it would start a DMA it never waits for), so
  they run as one-token sequences on page 0 and their rows are zeroed;
* off TPU (interpret mode) the kernel's tuned block-size table cannot be consulted
  (it reads the TPU version), so explicit block sizes are passed.

Constraints, checked with a ValueError naming the failed one:
* head_dim a multiple of 128 (Mosaic's lane tiling of the [.., head_dim] buffers);
* 2K "fully tiled" for the cache dtype: with packing p = 4 / itemsize (1 for
  float32, 2 for bfloat16), 2K must be a multiple of p and 2K / p in {1, 2, 4, 8}
  or a multiple of 8 (the kernel raises NotImplementedError otherwise);
* N divisible by K; q and cache in {float32, bfloat16};
* every sequence in the batch has q_len <= seq_len (the kernel's own runtime rule).

Cost estimate: the shipped pallas_call declares none and takes none from us, so XLA
counts it as nearly free. `cost.estimate(cost.TPU_JAX_ATTENTION, ...)` (under the
kernel's own name) gives the figure of our kernel, which does the same work.

Interpret mode: `interpret=True` runs the call under `pltpu.force_tpu_interpret_mode()`.
In jax 0.11.2 this does NOT work for this kernel: the TPU interpreter cannot read
through a reshaped ref (`kv_bufs ... .reshape(...)` -> "'ReshapeTransform' object
has no attribute 'indices'"), and the generic HLO interpreter fails in its masked
`pltpu.store` discharge. The tests exercise the argument adaptation against the
kernel's own input validators and skip the numeric check with that reason; the
numbers must be checked compiled on a TPU.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as _rpa_kernel

from pallas_kernels.attention.ref import check_layout

# Module attribute so tests can swap in a stand-in (the kernel does not interpret on CPU).
_shipped_rpa = _rpa_kernel.ragged_paged_attention

# Block sizes used when the tuned table is unavailable (not on a TPU).
DEFAULT_KV_PAGES_PER_BLOCK = 8
DEFAULT_QUERIES_PER_BLOCK = 32


def _fully_tiled(x: int, packing: int) -> bool:
    if x % packing:
        return False
    x //= packing
    return x in (1, 2, 4, 8) or x % 8 == 0


def check_constraints(q_xNH, kv_pages_PSJH) -> None:
    """Raises ValueError naming the first TPU-kernel constraint the inputs fail."""
    _, N, H = q_xNH.shape
    _, S, J, H_kv = kv_pages_PSJH.shape
    check_layout("tpu attention", q_xNH, kv_pages_PSJH)
    if H % 128:
        raise ValueError(f"tpu attention: head_dim H={H} must be a multiple of 128 "
                         "(Mosaic lane tiling)")
    ok = [jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)]
    if q_xNH.dtype not in ok or kv_pages_PSJH.dtype not in ok:
        raise ValueError(f"tpu attention: dtypes q={q_xNH.dtype}, cache={kv_pages_PSJH.dtype} "
                         "not supported; use float32 or bfloat16")
    packing = 4 // jnp.dtype(kv_pages_PSJH.dtype).itemsize
    if not _fully_tiled(J, packing):
        raise ValueError(f"tpu attention: 2K={J} KV heads are not fully tiled for "
                         f"{kv_pages_PSJH.dtype} (need 2K % {packing} == 0 and 2K/{packing} "
                         "in {1, 2, 4, 8} or a multiple of 8)")


def _block_sizes(T, C, num_kv_pages_per_block, num_queries_per_block, interpret):
    on_tpu = jax.default_backend() == "tpu" and not interpret
    if on_tpu and num_kv_pages_per_block is None and num_queries_per_block is None:
        return None, None  # the kernel looks up its tuned table
    kv = num_kv_pages_per_block or min(C, DEFAULT_KV_PAGES_PER_BLOCK)
    q = num_queries_per_block or min(T, DEFAULT_QUERIES_PER_BLOCK)
    return kv, q


def ragged_paged_attention(q_TNH, kv_pages_PSJH, query_start_B1, seq_lens_B, page_table_BC,
                           num_seqs, *, sm_scale, num_kv_pages_per_block=None,
                           num_queries_per_block=None, vmem_limit_bytes=None,
                           interpret=False):
    """Causal paged attention of a ragged batch via the shipped TPU kernel."""
    check_constraints(q_TNH, kv_pages_PSJH)
    T = q_TNH.shape[0]
    C = page_table_BC.shape[1]
    query_start_B1 = jnp.asarray(query_start_B1, jnp.int32)
    num_seqs_1 = jnp.asarray(num_seqs, jnp.int32).reshape(1)
    kv_blk, q_blk = _block_sizes(T, C, num_kv_pages_per_block, num_queries_per_block,
                                 interpret)
    ctx = pltpu.force_tpu_interpret_mode() if interpret else contextlib.nullcontext()
    with ctx:
        o_TNH = _shipped_rpa(
            q_TNH, kv_pages_PSJH, jnp.asarray(seq_lens_B, jnp.int32),
            jnp.asarray(page_table_BC, jnp.int32), query_start_B1, num_seqs_1,
            sm_scale=sm_scale, num_kv_pages_per_block=kv_blk, num_queries_per_block=q_blk,
            vmem_limit_bytes=vmem_limit_bytes,
        )
    valid_T = jnp.arange(T) < query_start_B1[num_seqs_1[0]]
    return jnp.where(valid_T[:, None, None], o_TNH, jnp.zeros_like(o_TNH))


def decode_attention(q_BNH, kv_pages_PSJH, seq_lens_B, page_table_BC, *, sm_scale,
                     interpret=False, **block_sizes):
    """One token per sequence via the shipped kernel; seq_len 0 rows return zeros."""
    B = q_BNH.shape[0]
    seq_lens_B = jnp.asarray(seq_lens_B, jnp.int32)
    live_B = seq_lens_B > 0
    o_BNH = ragged_paged_attention(
        q_BNH, kv_pages_PSJH, jnp.arange(B + 1, dtype=jnp.int32),
        jnp.where(live_B, seq_lens_B, 1),
        jnp.where(live_B[:, None], jnp.asarray(page_table_BC, jnp.int32), 0),
        jnp.int32(B), sm_scale=sm_scale, interpret=interpret, **block_sizes,
    )
    return jnp.where(live_B[:, None, None], o_BNH, jnp.zeros_like(o_BNH))
