"""Qwen3-MoE (and dense Qwen3) in Flax NNX, shaped for layer-range execution.

Module and parameter names follow the Hugging Face checkpoint
(`model.layers.self_attn.q_proj`, `model.layers.mlp.experts.gate_up_proj`, ...), so
loading is name matching. Unlike the checkpoint, layer parameters are *stacked*
along a leading layer axis: `run_layers(x, kv, meta, start, end)` loops over any
layer range [start, end), which is what layered prefill needs (one layer group per
iteration for the prefill tokens, all layers for decode tokens). The bounds may be
traced scalars, so one compiled program can serve every group of the same size.

Layers differ in their feed-forward block: MoE layers stack their router and
experts in `mlp` (leading axis = MoE layers), dense layers (`mlp_only_layers`,
`decoder_sparse_step`) stack a SwiGLU MLP in `dense_mlp`. A layer range is cut
into runs of one kind and each run is one loop, so an all-MoE model compiles one
layer body per loop.

Linear weights are stored [in, out] (the transpose of torch's [out, in]). Expert
weights use the kernel layout: `gate_up_proj` [E, D, 2F] (gate in [..., :F], up
in [..., F:]) and `down_proj` [E, F, D]. Every parameter declares its logical
axes (`logical_axes` metadata) for lp_jax.sharding.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from lp_jax.config import ModelConfig
from lp_jax.models.metadata import AttentionMetadata
from lp_jax.models.sharded_kernels import (
    is_pallas_attention,
    is_pallas_moe,
    kernel_mesh,
    sharded_decode_attention,
    sharded_moe_ffn,
    sharded_ragged_paged_attention,
)
from pallas_kernels.attention import write_kv


@dataclasses.dataclass(frozen=True)
class KernelBackends:
    """Which kernel implementation each op uses ("auto", "xla", "tpu", "gpu")."""

    moe: str = "auto"
    attention: str = "auto"


def _param(rngs: nnx.Rngs, shape, axes, dtype, *, fan_in: int | None = None, ones=False):
    if ones:
        value = jnp.ones(shape, dtype)
    else:
        std = 1.0 / math.sqrt(fan_in if fan_in else shape[-2])
        value = (jax.random.normal(rngs.params(), shape, jnp.float32) * std).astype(dtype)
    return nnx.Param(value, logical_axes=axes)


def rms_norm(x, weight, eps):
    """HF Qwen3RMSNorm: normalise in float32, cast back, then scale."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def apply_rope(x_TNH, positions_T, theta: float):
    """Rotary embedding in the rotate-half (non-interleaved) form Qwen3 uses."""
    H = x_TNH.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H))
    freqs_TH2 = positions_T.astype(jnp.float32)[:, None] * inv_freq[None, :]
    emb_TH = jnp.concatenate([freqs_TH2, freqs_TH2], axis=-1)
    cos, sin = jnp.cos(emb_TH)[:, None, :], jnp.sin(emb_TH)[:, None, :]
    cos, sin = cos.astype(x_TNH.dtype), sin.astype(x_TNH.dtype)
    x1, x2 = x_TNH[..., : H // 2], x_TNH[..., H // 2 :]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return x_TNH * cos + rotated * sin


def _dot(x, w):
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


class Qwen3MoeAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, num_layers: int, dtype, *, rngs: nnx.Rngs):
        L, D = num_layers, cfg.hidden_size
        NH = cfg.num_attention_heads * cfg.head_dim
        KH = cfg.num_key_value_heads * cfg.head_dim
        self.q_proj = _param(rngs, (L, D, NH), ("layers", "embed", "q_heads"), dtype)
        self.k_proj = _param(rngs, (L, D, KH), ("layers", "embed", "kv_heads"), dtype)
        self.v_proj = _param(rngs, (L, D, KH), ("layers", "embed", "kv_heads"), dtype)
        self.o_proj = _param(rngs, (L, NH, D), ("layers", "q_heads", "embed"), dtype)
        self.q_norm = _param(rngs, (L, cfg.head_dim), ("layers", "head_dim"), dtype, ones=True)
        self.k_norm = _param(rngs, (L, cfg.head_dim), ("layers", "head_dim"), dtype, ones=True)


class Qwen3MoeSparseMoeBlock(nnx.Module):
    """Router (`gate`) and experts, stacked over the MoE layers."""

    def __init__(self, cfg: ModelConfig, num_layers: int, dtype, *, rngs: nnx.Rngs):
        L, D, E, F = num_layers, cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        self.gate = _param(rngs, (L, D, E), ("layers", "embed", None), dtype)
        self.experts_gate_up_proj = _param(
            rngs, (L, E, D, 2 * F), ("layers", "experts", "embed", "expert_mlp"), dtype
        )
        self.experts_down_proj = _param(
            rngs, (L, E, F, D), ("layers", "experts", "expert_mlp", "embed"), dtype
        )


class Qwen3MLP(nnx.Module):
    """Dense SwiGLU MLP, stacked over the dense layers."""

    def __init__(self, cfg: ModelConfig, num_layers: int, dtype, *, rngs: nnx.Rngs):
        L, D, F = num_layers, cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = _param(rngs, (L, D, F), ("layers", "embed", "mlp"), dtype)
        self.up_proj = _param(rngs, (L, D, F), ("layers", "embed", "mlp"), dtype)
        self.down_proj = _param(rngs, (L, F, D), ("layers", "mlp", "embed"), dtype)


class Qwen3MoeDecoderLayers(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, *, rngs: nnx.Rngs):
        L, D = cfg.num_hidden_layers, cfg.hidden_size
        self.input_layernorm = _param(rngs, (L, D), ("layers", "embed"), dtype, ones=True)
        self.post_attention_layernorm = _param(rngs, (L, D), ("layers", "embed"), dtype, ones=True)
        self.self_attn = Qwen3MoeAttention(cfg, L, dtype, rngs=rngs)
        n_moe, n_dense = len(cfg.moe_layers), len(cfg.dense_layers)
        self.mlp = Qwen3MoeSparseMoeBlock(cfg, n_moe, dtype, rngs=rngs) if n_moe else None
        self.dense_mlp = Qwen3MLP(cfg, n_dense, dtype, rngs=rngs) if n_dense else None


class Qwen3MoeModel(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, *, rngs: nnx.Rngs):
        V, D = cfg.vocab_size, cfg.hidden_size
        self.embed_tokens = _param(rngs, (V, D), ("vocab", "embed"), dtype, fan_in=D)
        self.layers = Qwen3MoeDecoderLayers(cfg, dtype, rngs=rngs)
        self.norm = _param(rngs, (D,), ("embed",), dtype, ones=True)


class Qwen3MoeForCausalLM(nnx.Module):
    """Qwen3MoeForCausalLM / Qwen3ForCausalLM. Use `run_layers` for any layer range."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=None):
        dtype = jnp.dtype(dtype or cfg.dtype)
        self.config = cfg
        self.dtype = dtype
        self.model = Qwen3MoeModel(cfg, dtype, rngs=rngs)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = _param(
                rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), dtype
            )
        # Position of each layer inside its kind's stack (MoE or dense).
        moe, dense = cfg.moe_layers, cfg.dense_layers
        self._stack_index = tuple(
            moe.index(i) if i in moe else dense.index(i) for i in range(cfg.num_hidden_layers)
        )

    # ----------------------------------------------------------------- pieces
    def embed(self, token_ids_T: jax.Array) -> jax.Array:
        return jnp.take(self.model.embed_tokens[...], token_ids_T, axis=0)

    def compute_logits(self, x_TD: jax.Array) -> jax.Array:
        """Final RMSNorm and lm_head; float32 logits [T, V]."""
        h_TD = rms_norm(x_TD, self.model.norm[...], self.config.rms_norm_eps)
        if self.lm_head is None:
            w_VD = self.model.embed_tokens[...]
            return jnp.einsum("td,vd->tv", h_TD, w_VD, preferred_element_type=jnp.float32)
        return jnp.dot(h_TD, self.lm_head[...], preferred_element_type=jnp.float32)

    def _attention(self, i, x_TD, kv_pages_PSJH, meta: AttentionMetadata, decode_only, backend):
        cfg, attn = self.config, self.model.layers.self_attn
        T = x_TD.shape[0]
        N, K, H = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h_TD = rms_norm(x_TD, self.model.layers.input_layernorm[i], cfg.rms_norm_eps)
        q_TNH = _dot(h_TD, attn.q_proj[i]).reshape(T, N, H)
        k_TKH = _dot(h_TD, attn.k_proj[i]).reshape(T, K, H)
        v_TKH = _dot(h_TD, attn.v_proj[i]).reshape(T, K, H)
        q_TNH = rms_norm(q_TNH, attn.q_norm[i], cfg.rms_norm_eps)
        k_TKH = rms_norm(k_TKH, attn.k_norm[i], cfg.rms_norm_eps)
        q_TNH = apply_rope(q_TNH, meta.positions_T, cfg.rope_theta)
        k_TKH = apply_rope(k_TKH, meta.positions_T, cfg.rope_theta)

        # Logical pages -> this layer's physical pages in the shared pool.
        P_total, S = kv_pages_PSJH.shape[:2]
        page_offset = i * (P_total // cfg.num_hidden_layers)
        slots_T = jnp.where(meta.slots_T >= 0, meta.slots_T + page_offset * S, -1)
        kv_pages_PSJH = write_kv(kv_pages_PSJH, k_TKH, v_TKH, slots_T)
        page_table_BC = meta.page_table_BC + page_offset
        sm_scale = H**-0.5
        # A Pallas kernel on a multi-device mesh runs per head shard (GSPMD would
        # gather the whole pool onto every device); see sharded_kernels.
        mesh = kernel_mesh(attn.q_proj[...]) if is_pallas_attention(backend) else None
        if decode_only:
            o_TNH = sharded_decode_attention(mesh, q_TNH, kv_pages_PSJH, meta.seq_lens_B,
                                             page_table_BC, sm_scale=sm_scale, backend=backend)
        else:
            o_TNH = sharded_ragged_paged_attention(
                mesh, q_TNH, kv_pages_PSJH, meta.query_start_B1, meta.seq_lens_B,
                page_table_BC, meta.num_seqs, sm_scale=sm_scale, backend=backend,
            )
        x_TD = x_TD + _dot(o_TNH.reshape(T, N * H), attn.o_proj[i])
        return x_TD, kv_pages_PSJH

    def _moe(self, j, h_TD, token_mask_T, backend):
        cfg, mlp = self.config, self.model.layers.mlp
        logits_TE = jnp.dot(h_TD.astype(jnp.float32), mlp.gate[j].astype(jnp.float32))
        w_gate_up_EDF2, w_down_EFD = mlp.experts_gate_up_proj[j], mlp.experts_down_proj[j]
        # A Pallas kernel on a multi-device mesh runs per expert shard; see sharded_kernels.
        mesh = kernel_mesh(w_gate_up_EDF2) if is_pallas_moe(backend) else None
        y_TD, stats = sharded_moe_ffn(
            mesh, h_TD, logits_TE, w_gate_up_EDF2, w_down_EFD, top_k=cfg.num_experts_per_tok,
            norm_topk_prob=cfg.norm_topk_prob, backend=backend, token_mask_T=token_mask_T,
        )
        return y_TD, stats["experts_activated"]

    def _dense_mlp(self, j, h_TD):
        mlp = self.model.layers.dense_mlp
        g_TF = _dot(h_TD, mlp.gate_proj[j])
        u_TF = _dot(h_TD, mlp.up_proj[j])
        return _dot(jax.nn.silu(g_TF) * u_TF, mlp.down_proj[j])

    # ------------------------------------------------------------- layer range
    @property
    def uniform_layers(self) -> bool:
        """True when every layer has the same kind (all MoE or all dense)."""
        return not (self.config.moe_layers and self.config.dense_layers)

    def run_layers(
        self,
        x_TD: jax.Array,
        kv_pages_PSJH: jax.Array,
        meta: AttentionMetadata,
        start,
        end,
        *,
        decode_only: bool = False,
        backends: KernelBackends = KernelBackends(),
    ):
        """Runs decoder layers [start, end) on x_TD.

        Returns (x_TD, kv_pages_PSJH, experts_activated): the last is the number of
        experts the real tokens activated, summed over the MoE layers of the range.
        `start` and `end` may be Python ints or traced int32 scalars; traced bounds
        need a model whose layers are all of one kind, so that one loop body serves
        every layer and a program can run any layer range it is given.
        """
        cfg = self.config
        token_mask_T = meta.token_mask()

        def layer(i, j, x, kv, is_moe):
            """Layer i; j is its index in its kind's stack."""
            x, kv = self._attention(i, x, kv, meta, decode_only, backends.attention)
            h = rms_norm(x, self.model.layers.post_attention_layernorm[i], cfg.rms_norm_eps)
            if is_moe:
                y, activated = self._moe(j, h, token_mask_T, backends.moe)
            else:
                y, activated = self._dense_mlp(j, h), jnp.int32(0)
            return x + y, kv, activated

        def loop(lo, hi, stack_offset, is_moe, carry):
            def body(i, c):
                x, kv, n = c
                x, kv, activated = layer(i, i - stack_offset, x, kv, is_moe)
                return x, kv, n + activated

            return jax.lax.fori_loop(lo, hi, body, carry)

        carry = (x_TD, kv_pages_PSJH, jnp.int32(0))
        if isinstance(start, int) and isinstance(end, int):
            if not 0 <= start <= end <= cfg.num_hidden_layers:
                raise ValueError(
                    f"layer range [{start}, {end}) outside [0, {cfg.num_hidden_layers})")
            for is_moe, s, e in self._segments(start, end):
                carry = loop(s, e, s - self._stack_index[s], is_moe, carry)
        else:
            if not self.uniform_layers:
                raise ValueError("traced layer bounds need layers of one kind; "
                                 f"{cfg.model_type} mixes dense and MoE layers")
            carry = loop(start, end, 0, bool(cfg.moe_layers), carry)
        return carry

    def _segments(self, start: int, end: int):
        """Maximal runs of same-kind layers inside [start, end): (is_moe, s, e)."""
        segs = []
        for i in range(start, end):
            kind = self.config.is_moe_layer(i)
            if segs and segs[-1][0] == kind:
                segs[-1][2] = i + 1
            else:
                segs.append([kind, i, i + 1])
        return [tuple(seg) for seg in segs]


def init_kv_cache(cfg: ModelConfig, pages_per_layer: int, page_size: int, dtype=None,
                  sharding=None) -> jax.Array:
    """The shared KV pool kv_pages_PSJH [L * pages_per_layer, S, 2K, H], zeroed."""
    shape = (cfg.num_hidden_layers * pages_per_layer, page_size,
             2 * cfg.num_key_value_heads, cfg.head_dim)
    dtype = jnp.dtype(dtype or cfg.dtype)
    if sharding is None:
        return jnp.zeros(shape, dtype)
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()
