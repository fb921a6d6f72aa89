"""The KV cache layout every model shares: one pool for all layers.

Latent pool (multi-head latent attention, cfg.is_mla: DeepSeek-V3): [L * P, S, 1, X]
with X = kv_lora_rank + qk_rope_head_dim (576 for DeepSeek-V3): a token's normed latent
and its one shared rotary key, once per token and layer, not once per head
(pallas_kernels/attention/mla_ref.py reads it). It is never split over heads. For the
TPU MLA kernel (`packs_kv`) each row is padded to whole 128-lane tiles (576 -> 640
values), since XLA would lay a 576-wide last axis out page-minor and copy the pool.

kv_pages_PSJH is [L * P, S, 2K, H]: layer i owns pages [i P, (i + 1) P), and K and V of
KV head k sit at J = 2k, 2k + 1. A model's attention half offsets the logical page ids
by its layer's first page (`StackedCausalLM._attention`), so the page table is the same
for every layer. `packs_kv` says when the pool takes the packed [.., S, K, 2H] form.

Tensor-parallel attention splits the J axis over the heads' devices, one whole (K, V)
pair or more per device. With more devices t than KV heads K the pool keeps r = t / K
copies of each head (`sharding.kv_head_replicas`): it holds K r heads, copy j of head k
at k r + j, so that query head n still reads head n // G of the copied pool (G = N /
(K r)) and each device stores only the head its query heads read: 1 / t of an
unreplicated pool per device instead of all of it. The model writes whatever heads the
pool has (`repeat_to_pool`); which r is a layout choice, made where the pool is built.

FP8 KV cache (cfg.kv_cache_dtype "fp8", vLLM's fp8 / fp8_e4m3): the pool is
float8_e4m3fn, one byte a value, so a page takes half a bf16 page's bytes and the
engine's default page count (sized from free memory, `kv_page_bytes`) doubles. Each
layer has a (k_scale, v_scale) pair, the checkpoint's where it has them (`read_kv_scales`:
the tensor names vLLM reads: `self_attn.k_scale` / `v_scale`, ModelOpt's
`self_attn.k_proj.k_scale` / `v_proj.v_scale`, the deprecated `self_attn.kv_scale` for
both), else 1.0 as in vLLM. They are constants of the model config (L pairs), so the
traced layer index picks them out of a small constant table (`layer_kv_scales`).
"""

from __future__ import annotations

import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from lp_jax.config import ModelConfig
from lp_jax.sharding import axes_size, axis_dividing, kv_head_replicas
from pallas_kernels import attention

KV_CACHE_AXES = ("kv_pages", None, "kv_combined_heads", None)  # logical axes of the pool


def packs_kv(cfg: ModelConfig, attention_backend: str) -> bool:
    """Whether the pool takes the packed [L * P, S, K, 2H] form: for our TPU kernel when
    head_dim is not a multiple of 128 (GPT-OSS: 64). The same bytes as [.., 2K, H], but
    a last axis under 128 lanes would make XLA's TPU layout page-minor and copy the
    whole pool before every kernel call (pallas_kernels/attention/tpu.py). A latent pool
    (cfg.is_mla) "packs" as rows padded to whole lanes (`latent_row`), for the same
    reason (pallas_kernels/attention/mla_tpu.py)."""
    if attention.resolve_backend(attention_backend) != "tpu":
        return False
    return cfg.kv_latent_dim % 128 != 0 if cfg.is_mla else cfg.head_dim % 128 != 0


def latent_row(cfg: ModelConfig, packed: bool = False) -> int:
    """Values a token a layer of a latent pool: kv_latent_dim, rounded up to a multiple
    of 128 lanes when packed for the TPU kernel (`packs_kv`)."""
    return -(-cfg.kv_latent_dim // 128) * 128 if packed else cfg.kv_latent_dim


def kv_dtype(cfg: ModelConfig, dtype=None):
    """The pool's dtype: float8_e4m3fn for kv_cache_dtype "fp8", else `dtype` (the
    model's) or cfg.dtype."""
    if cfg.kv_cache_dtype == "fp8":
        return jnp.dtype(attention.ref.FP8_DTYPE)
    return jnp.dtype(dtype or cfg.dtype)


def kv_page_bytes(cfg: ModelConfig, page_size: int, dtype=None, mesh=None, *,
                  packed: bool = False) -> int:
    """Bytes of one logical page over all layers (K and V of every KV head); with `mesh`,
    the bytes one device holds of it (the pool's heads split, or replicated, over the
    mesh as `sharding.LOGICAL_RULES` lays them out). A latent pool holds
    `latent_row` values a token a layer, whole on every device."""
    if cfg.is_mla:
        return (cfg.num_hidden_layers * page_size * latent_row(cfg, packed)
                * kv_dtype(cfg, dtype).itemsize)
    whole = (cfg.num_hidden_layers * page_size * 2 * cfg.num_key_value_heads * cfg.head_dim
             * kv_dtype(cfg, dtype).itemsize)
    if mesh is None:
        return whole
    r = kv_head_replicas(cfg.num_key_value_heads, cfg.num_attention_heads, mesh)
    J = 2 * cfg.num_key_value_heads * r
    shards = axes_size(axis_dividing("kv_combined_heads", J, mesh), mesh)
    return whole * r // shards


def pool_kv_heads(kv_pages_PSJH: jax.Array, head_dim: int) -> int:
    """The KV heads the pool holds: J / 2, or J of the packed [P, S, K, 2H] form."""
    J, X = kv_pages_PSJH.shape[2:]
    return J if X == 2 * head_dim else J // 2


def repeat_to_pool(k_TKH: jax.Array, v_TKH: jax.Array, kv_pages_PSJH: jax.Array):
    """k_TKH and v_TKH with each head repeated to the pool's K r heads (copy j of head k
    at k r + j); unchanged when the pool holds K."""
    K, H = k_TKH.shape[1:]
    r = pool_kv_heads(kv_pages_PSJH, H) // K
    if r == 1:
        return k_TKH, v_TKH
    return jnp.repeat(k_TKH, r, axis=1), jnp.repeat(v_TKH, r, axis=1)


def layer_kv_scales(cfg: ModelConfig, i) -> dict:
    """{k_scale, v_scale} of layer i (a traced index) for an FP8 pool; {} otherwise."""
    if cfg.kv_cache_dtype != "fp8":
        return {}
    table_L2 = jnp.asarray(cfg.kv_scales or [(1.0, 1.0)] * cfg.num_hidden_layers, jnp.float32)
    return {"k_scale": table_L2[i, 0], "v_scale": table_L2[i, 1]}


def _scalar(f, name: str) -> float:
    value = np.asarray(f.get(name), np.float32)
    if value.size != 1 or not math.isfinite(float(value.reshape(-1)[0])) or value.reshape(
            -1)[0] <= 0:
        raise ValueError(f"{f.path}: KV-cache scale {name!r} must be one positive finite "
                         f"number, got shape {value.shape} {value.reshape(-1)[:4]}")
    return float(value.reshape(-1)[0])


def read_kv_scales(model_dir: str | Path | None, cfg: ModelConfig) -> tuple:
    """Per-layer (k_scale, v_scale) from a checkpoint's safetensors, the names vLLM
    reads; () when the checkpoint has none (1.0, vLLM's default). A checkpoint with
    scales for some layers only gets 1.0 for the rest, as vLLM's parameters default."""
    from lp_jax.safetensors_io import SafetensorsFile

    files = sorted(Path(model_dir).glob("*.safetensors")) if model_dir else []
    where = {}
    for path in files:
        f = SafetensorsFile(path)
        for name in f.tensors:
            if name.endswith("_scale") and ".self_attn." in name:
                where[name] = f
    if not where:
        return ()
    pairs = []
    for i in range(cfg.num_hidden_layers):
        attn = f"model.layers.{i}.self_attn."
        pair = []
        for kind in ("k", "v"):
            for name in (f"{attn}{kind}_scale", f"{attn}{kind}_proj.{kind}_scale",
                         f"{attn}kv_scale"):
                if name in where:
                    pair.append(_scalar(where[name], name))
                    break
            else:
                pair.append(1.0)
        pairs.append(tuple(pair))
    return tuple(pairs) if any(p != (1.0, 1.0) for p in pairs) else ()


def kv_cache_shape(cfg: ModelConfig, pages_per_layer: int, page_size: int, *,
                   packed: bool = False, replicas: int = 1) -> tuple[int, int, int, int]:
    """[L * pages_per_layer, S, 2K, H], or the packed [.., S, K, 2H] (`packs_kv`); with
    `replicas` r (`sharding.kv_head_replicas`), K r heads in place of K. A latent
    pool (cfg.is_mla) is [L * pages_per_layer, S, 1, latent_row(cfg, packed)]."""
    if cfg.is_mla:
        return (cfg.num_hidden_layers * pages_per_layer, page_size, 1,
                latent_row(cfg, packed))
    K, H = cfg.num_key_value_heads * replicas, cfg.head_dim
    heads = (K, 2 * H) if packed else (2 * K, H)
    return (cfg.num_hidden_layers * pages_per_layer, page_size, *heads)


def init_kv_cache(cfg: ModelConfig, pages_per_layer: int, page_size: int, dtype=None,
                  sharding=None, *, packed: bool = False, replicas: int = 1) -> jax.Array:
    """The shared KV pool kv_pages_PSJH (`kv_cache_shape`), zeroed; e4m3 for an FP8
    cache (`kv_dtype`), else `dtype` (default cfg.dtype)."""
    shape = kv_cache_shape(cfg, pages_per_layer, page_size, packed=packed, replicas=replicas)
    dtype = kv_dtype(cfg, dtype)
    if sharding is None:
        return jnp.zeros(shape, dtype)
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()
