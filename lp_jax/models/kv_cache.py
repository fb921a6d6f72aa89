"""The KV cache layout every model shares: one pool for all layers.

kv_pages_PSJH is [L * P, S, 2K, H]: layer i owns pages [i P, (i + 1) P), and K and V of
KV head k sit at J = 2k, 2k + 1. A model's attention half offsets the logical page ids
by its layer's first page (`StackedCausalLM._attention`), so the page table is the same
for every layer. `packs_kv` says when the pool takes the packed [.., S, K, 2H] form.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lp_jax.config import ModelConfig
from pallas_kernels import attention

KV_CACHE_AXES = ("kv_pages", None, "kv_combined_heads", None)  # logical axes of the pool


def packs_kv(cfg: ModelConfig, attention_backend: str) -> bool:
    """Whether the pool takes the packed [L * P, S, K, 2H] form: for our TPU kernel when
    head_dim is not a multiple of 128 (GPT-OSS: 64). The same bytes as [.., 2K, H], but
    a last axis under 128 lanes would make XLA's TPU layout page-minor and copy the
    whole pool before every kernel call (pallas_kernels/attention/tpu.py)."""
    return attention.resolve_backend(attention_backend) == "tpu" and cfg.head_dim % 128 != 0


def kv_cache_shape(cfg: ModelConfig, pages_per_layer: int, page_size: int, *,
                   packed: bool = False) -> tuple[int, int, int, int]:
    """[L * pages_per_layer, S, 2K, H], or the packed [.., S, K, 2H] (`packs_kv`)."""
    K, H = cfg.num_key_value_heads, cfg.head_dim
    heads = (K, 2 * H) if packed else (2 * K, H)
    return (cfg.num_hidden_layers * pages_per_layer, page_size, *heads)


def init_kv_cache(cfg: ModelConfig, pages_per_layer: int, page_size: int, dtype=None,
                  sharding=None, *, packed: bool = False) -> jax.Array:
    """The shared KV pool kv_pages_PSJH (`kv_cache_shape`), zeroed."""
    shape = kv_cache_shape(cfg, pages_per_layer, page_size, packed=packed)
    dtype = jnp.dtype(dtype or cfg.dtype)
    if sharding is None:
        return jnp.zeros(shape, dtype)
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()
