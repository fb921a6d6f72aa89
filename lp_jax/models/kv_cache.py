"""The KV cache layout every model shares: one pool for all layers.

Latent pool (multi-head latent attention, cfg.is_mla: DeepSeek-V3): [L * P, S, 1, X]
with X = kv_lora_rank + qk_rope_head_dim (576 for DeepSeek-V3): a token's normed latent
and its one shared rotary key, once per token and layer, not once per head
(pallas_kernels/attention/mla_ref.py reads it). It is never split over heads. For the
TPU MLA kernel (`packs_kv`) each row is padded to whole 128-lane tiles (576 -> 640
values), since XLA would lay a 576-wide last axis out page-minor and copy the pool.

kv_pages_PSJH is [L * P, S, 2K, H]: layer i owns pages [i P, (i + 1) P), and K and V of
KV head k sit at J = 2k, 2k + 1. A model's attention half maps the logical page ids to
its layer's rows (`layer_pages`), so the page table is the same for every layer.
`packs_kv` says when the pool takes the packed [.., S, K, 2H] form.

Data-parallel attention (cfg.kv_ranks R > 1, docs/data_parallel.md) makes the pool
rank-major: rank r owns the logical pages [r P_r, (r + 1) P_r) (P_r = P / R) and holds
them for every layer as the one block of rows [r L P_r, (r + 1) L P_r), layer i's at
r L P_r + i P_r. Split over the "data" mesh axis (LOGICAL_RULES' "kv_pages"), each rank's
devices then hold only its own pages: 1 / R of the pool.

Tensor-parallel attention splits the J axis over the heads' devices, one whole (K, V)
pair or more per device. With more devices t than KV heads K the pool keeps r = t / K
copies of each head (`sharding.kv_head_replicas`): it holds K r heads, copy j of head k
at k r + j, so that query head n still reads head n // G of the copied pool (G = N /
(K r)) and each device stores only the head its query heads read: 1 / t of an
unreplicated pool per device instead of all of it. The loader lays k_proj / v_proj out
with the same copies (`loader.kv_columns`), so each device computes the head it writes;
the model fits whatever heads its projections give to the heads the pool has
(`repeat_to_pool`). Which r is a layout choice, made where the pool is built.

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
from lp_jax.sharding import axes_size, axis_dividing, kv_head_replicas, mesh_axes
from pallas_kernels import attention

KV_CACHE_AXES = ("kv_pages", None, "kv_combined_heads", None)  # logical axes of the pool


def kv_cache_axes(cfg: ModelConfig) -> tuple:
    """The pool's logical axes: its rows split over the data ranks only when it is
    rank-major (cfg.kv_ranks > 1); otherwise a data axis would cut it between layers."""
    return KV_CACHE_AXES if cfg.kv_ranks > 1 else (None, *KV_CACHE_AXES[1:])


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
                * kv_dtype(cfg, dtype).itemsize) // (1 if mesh is None else
                                                      _data_shards(cfg, mesh))
    whole = (cfg.num_hidden_layers * page_size * 2 * cfg.num_key_value_heads * cfg.head_dim
             * kv_dtype(cfg, dtype).itemsize)
    if mesh is None:
        return whole
    r = kv_head_replicas(cfg.num_key_value_heads, cfg.num_attention_heads, mesh)
    J = 2 * cfg.num_key_value_heads * r
    shards = axes_size(axis_dividing("kv_combined_heads", J, mesh), mesh)
    return whole * r // shards // _data_shards(cfg, mesh)


def _data_shards(cfg: ModelConfig, mesh) -> int:
    """Devices a rank-major pool's pages split over (one rank's devices hold 1 / R of the
    pages): the data axis when cfg.kv_ranks > 1, else 1."""
    return axes_size(mesh_axes("kv_pages", mesh), mesh) if cfg.kv_ranks > 1 else 1


def pool_kv_heads(kv_pages_PSJH: jax.Array, head_dim: int) -> int:
    """The KV heads the pool holds: J / 2, or J of the packed [P, S, K, 2H] form."""
    J, X = kv_pages_PSJH.shape[2:]
    return J if X == 2 * head_dim else J // 2


def repeat_to_pool(k_TKH: jax.Array, v_TKH: jax.Array, kv_pages_PSJH: jax.Array):
    """k_TKH and v_TKH as the pool's heads: each of their heads repeated to the pool's
    copies (copy j of head k at k r + j), or, where the projections already hold more
    copies than the pool (loader.kv_columns' layout beside a pool built for one
    device), every r-th head; unchanged when the counts agree."""
    K, H = k_TKH.shape[1:]
    J = pool_kv_heads(kv_pages_PSJH, H)
    if J == K:
        return k_TKH, v_TKH
    if J % K == 0:
        return jnp.repeat(k_TKH, J // K, axis=1), jnp.repeat(v_TKH, J // K, axis=1)
    if K % J == 0:
        return k_TKH[:, :: K // J], v_TKH[:, :: K // J]
    raise ValueError(f"k/v projections of {K} heads cannot fill a pool of {J}")


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


def layer_pages(cfg: ModelConfig, i, page_ids, pool_rows: int):
    """Logical page ids -> layer i's rows of a pool of `pool_rows` rows: page p of rank
    r = p // P_r at r L P_r + i P_r + p % P_r, i.e. p + i P_r + r (L - 1) P_r (one rank:
    p + i P)."""
    L = cfg.num_hidden_layers
    P_r = pool_rows // (L * cfg.kv_ranks)
    return page_ids + i * P_r + (page_ids // P_r) * ((L - 1) * P_r)


def layer_slots(cfg: ModelConfig, i, slots_T, pool_rows: int, page_size: int):
    """Logical KV slots (page * S + offset; -1: none) -> layer i's slots of the pool."""
    S = page_size
    rows_T = layer_pages(cfg, i, jnp.maximum(slots_T, 0) // S, pool_rows)
    return jnp.where(slots_T >= 0, rows_T * S + slots_T % S, -1)


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
