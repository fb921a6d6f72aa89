"""Qwen3-MoE (and dense Qwen3) in Flax NNX, shaped for layer-range execution.

Module and parameter names follow the Hugging Face checkpoint
(`model.layers.self_attn.q_proj`, `model.layers.mlp.experts.gate_up_proj`, ...), so
loading is name matching. Unlike the checkpoint, layer parameters are *stacked*
along a leading layer axis: `run_layers(x, kv, meta, start, end)` loops over any
layer range [start, end), which is what layered prefill needs (one layer group per
iteration for the prefill tokens, all layers for decode tokens). The bounds are in
operator units (`run_units`: unit 2i is layer i's attention half, 2i + 1 its MLP
half) and may be traced scalars, so one compiled program serves every range.

Layers differ in their feed-forward block: MoE layers stack their router and
experts in `mlp` (leading axis = MoE layers), dense layers (`mlp_only_layers`,
`decoder_sparse_step`) stack a SwiGLU MLP in `dense_mlp`. A model mixing both
kinds picks the block per layer at run time (`lax.cond` on the layer index), so
one loop body serves every layer. The MoE kernels take the whole stacked expert
weights and the layer index: no layer's [E, D, 2F] slice is ever materialised.

Linear weights are stored [in, out] (the transpose of torch's [out, in]). Expert
weights use the kernel layout: `gate_up_proj` [E, D, 2F] (gate in [..., :F], up
in [..., F:]) and `down_proj` [E, F, D]. Every parameter declares its logical
axes (`logical_axes` metadata) for lp_jax.sharding.

What does not depend on the architecture (embedding, head, the attention half around
the model's projections, the operator-unit loop) lives in `StackedCausalLM`, which
GPT-OSS (gpt_oss.py) shares; a model supplies `_qkv`, `_o_proj` and `_mlp`.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from lp_jax.config import ModelConfig
from lp_jax.models.expert_dispatch import DISPATCHES
from lp_jax.models.metadata import AttentionMetadata
from lp_jax.models.sharded_kernels import (
    is_pallas_attention,
    kernel_mesh,
    model_moe_ffn,
    sharded_decode_attention,
    sharded_ragged_paged_attention,
)
from pallas_kernels import attention
from pallas_kernels.attention import write_kv


@dataclasses.dataclass(frozen=True)
class KernelBackends:
    """Which kernel implementation each op uses ("auto", "xla", "tpu", "gpu"), and how a
    MoE layer with its experts split over the "expert" mesh axis exchanges tokens:
    `moe_dispatch` "allreduce", "all_to_all" or "auto" (see models/expert_dispatch.py)."""

    moe: str = "auto"
    attention: str = "auto"
    moe_dispatch: str = "auto"

    def __post_init__(self):
        if self.moe_dispatch not in DISPATCHES:
            raise ValueError(f"moe_dispatch must be one of {DISPATCHES}, "
                             f"got {self.moe_dispatch!r}")


def _param(rngs: nnx.Rngs, shape, axes, dtype, *, fan_in: int | None = None, ones=False):
    if ones:
        value = jnp.ones(shape, dtype)
    else:
        std = 1.0 / math.sqrt(fan_in if fan_in else shape[-2])
        value = (jax.random.normal(rngs.params(), shape, jnp.float32) * std).astype(dtype)
    return nnx.Param(value, logical_axes=axes)


def rms_norm(x, weight, eps, *, scale_in_float32=False):
    """HF Qwen3RMSNorm: normalise in float32, cast back, then scale. With
    `scale_in_float32` (GptOssRMSNorm): scale in float32, then cast back."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if scale_in_float32:
        return (weight.astype(jnp.float32) * x32).astype(x.dtype)
    return weight * x32.astype(x.dtype)


def rope_frequencies(cfg: ModelConfig) -> tuple[jax.Array, float]:
    """(inv_freq [H/2] float32, cos/sin scale), computed as transformers does: the
    default RoPE, or YaRN (`_compute_yarn_parameters`) when cfg.rope_scaling is set."""
    H, theta, yarn = cfg.head_dim, cfg.rope_theta, cfg.rope_scaling
    inv_freq = 1.0 / (theta ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H))
    if yarn is None:
        return inv_freq, 1.0
    scale = yarn.attention_factor
    if scale is None:
        scale = 0.1 * math.log(yarn.factor) + 1.0 if yarn.factor > 1 else 1.0

    def correction_dim(rotations):
        return (H * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi))
                / (2 * math.log(theta)))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, H - 1)
    high = high + 0.001 if low == high else high  # as HF: no zero-width ramp
    ramp = jnp.clip((jnp.arange(H // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # 1: keep the original frequency; 0: interpolate by factor
    pos_freqs = theta ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H)
    inv_freq = (1.0 / (yarn.factor * pos_freqs) * (1 - extrapolation)
                + 1.0 / pos_freqs * extrapolation)
    return inv_freq, float(scale)


def apply_rope(x_TNH, positions_T, inv_freq_H2, scale: float = 1.0):
    """Rotary embedding in the rotate-half (non-interleaved) form Qwen3 and GPT-OSS use;
    `scale` multiplies cos and sin (YaRN's attention factor)."""
    H = x_TNH.shape[-1]
    freqs_TH2 = positions_T.astype(jnp.float32)[:, None] * inv_freq_H2[None, :]
    emb_TH = jnp.concatenate([freqs_TH2, freqs_TH2], axis=-1)
    cos, sin = jnp.cos(emb_TH)[:, None, :], jnp.sin(emb_TH)[:, None, :]
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
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
        self.embed_tokens = _param(rngs, (V, embed_width(cfg)), ("vocab", "embed"), dtype,
                                   fan_in=D)
        self.layers = Qwen3MoeDecoderLayers(cfg, dtype, rngs=rngs)
        self.norm = _param(rngs, (D,), ("embed",), dtype, ones=True)


class StackedCausalLM(nnx.Module):
    """The architecture-independent part of a stacked decoder: embedding, final norm
    and head, the attention half of a layer around the model's projections, and the
    operator-unit loop. A model sets `config`, `dtype`, `model` (with `embed_tokens`,
    `norm`, `layers.input_layernorm`, `layers.self_attn.q_proj`) and `lm_head` (None
    when tied), and supplies `_qkv`, `_o_proj` and `_mlp`; `_attention_extras` and
    `_norm` have defaults."""

    config: ModelConfig

    def serving_backends(self, backends: KernelBackends) -> KernelBackends:
        """The kernel backends this model's layers run with, given those asked for (a
        model whose features a backend lacks swaps it; the executor sizes the KV pool
        for the result, see `packs_kv`)."""
        return backends

    # ----------------------------------------------------------------- pieces
    def embed(self, token_ids_T: jax.Array) -> jax.Array:
        x_TX = jnp.take(self.model.embed_tokens[...], token_ids_T, axis=0)
        return x_TX[:, : self.config.hidden_size]  # the padding columns (embed_width)

    def _norm(self, x_TD, weight):
        return rms_norm(x_TD, weight, self.config.rms_norm_eps)

    def compute_logits(self, x_TD: jax.Array) -> jax.Array:
        """Final RMSNorm and lm_head; float32 logits [T, V]."""
        h_TD = self._norm(x_TD, self.model.norm[...])
        if self.lm_head is None:
            w_VX = self.model.embed_tokens[...]
            h_TX = jnp.pad(h_TD, ((0, 0), (0, w_VX.shape[1] - h_TD.shape[1])))
            return jnp.einsum("tx,vx->tv", h_TX, w_VX, preferred_element_type=jnp.float32)
        return jnp.dot(h_TD, self.lm_head[...], preferred_element_type=jnp.float32)

    def _qkv(self, i, h_TD, positions_T):
        """Layer i's q_TNH, k_TKH, v_TKH from the normed hidden states, RoPE applied."""
        raise NotImplementedError

    def _o_proj(self, i, o_TX):
        """Layer i's output projection of the attention output [T, N*H]."""
        raise NotImplementedError

    def _attention_extras(self, i) -> dict:
        """Attention keyword arguments of layer i (GPT-OSS: `sinks_N`, `sliding_window`,
        traced); {} for none."""
        return {}

    def _mlp(self, i, x_TD, token_mask_T, backends: KernelBackends):
        """MLP half of layer i with its residual: (x_TD, experts activated)."""
        raise NotImplementedError

    def _attention(self, i, x_TD, kv_pages_PSJH, meta: AttentionMetadata, decode_only, backend):
        """Attention half of layer i (a traced index): pre-norm, projections, RoPE, KV write,
        paged attention, output projection and residual."""
        cfg = self.config
        T = x_TD.shape[0]
        N, H = cfg.num_attention_heads, cfg.head_dim
        # The projections are XLA dots on w[i]: XLA addresses the layer in place (TPU
        # operand fusion, GPU dynamic-slice fusion); `python -m lp_jax.aot` audits it.
        h_TD = self._norm(x_TD, self.model.layers.input_layernorm[i])
        q_TNH, k_TKH, v_TKH = self._qkv(i, h_TD, meta.positions_T)

        # Logical pages -> this layer's physical pages in the shared pool.
        P_total, S = kv_pages_PSJH.shape[:2]
        page_offset = i * (P_total // cfg.num_hidden_layers)
        slots_T = jnp.where(meta.slots_T >= 0, meta.slots_T + page_offset * S, -1)
        kv_pages_PSJH = write_kv(kv_pages_PSJH, k_TKH, v_TKH, slots_T)
        page_table_BC = meta.page_table_BC + page_offset
        o_TNH = self._attend(i, q_TNH, kv_pages_PSJH, meta, page_table_BC, decode_only,
                             backend)
        x_TD = x_TD + self._o_proj(i, o_TNH.reshape(T, N * H))
        return x_TD, kv_pages_PSJH

    def _attend(self, i, q_TNH, kv_pages_PSJH, meta, page_table_BC, decode_only, backend):
        """Paged attention. `decode_only` (a bool, or a traced bool chosen per call) picks a
        backend's decode kernel where it has one distinct from its ragged kernel."""
        sm_scale = self.config.head_dim**-0.5
        extras = self._attention_extras(i)
        # A Pallas kernel on a multi-device mesh runs per head shard (GSPMD would
        # gather the whole pool onto every device); see sharded_kernels.
        attn = self.model.layers.self_attn
        mesh = kernel_mesh(attn.q_proj[...]) if is_pallas_attention(backend) else None

        def ragged():
            if mesh is None:
                return attention.ragged_paged_attention(
                    q_TNH, kv_pages_PSJH, meta.query_start_B1, meta.seq_lens_B,
                    page_table_BC, meta.num_seqs, sm_scale=sm_scale, backend=backend,
                    **extras)
            return sharded_ragged_paged_attention(
                mesh, q_TNH, kv_pages_PSJH, meta.query_start_B1, meta.seq_lens_B,
                page_table_BC, meta.num_seqs, sm_scale=sm_scale, backend=backend, **extras)

        # The XLA reference serves decode through its ragged path; the kernels' decode
        # entry points take one query row per sequence.
        if decode_only is False or not is_pallas_attention(backend):
            return ragged()

        def decode():
            # One token per sequence: the first B rows (B = page-table rows) are the queries.
            B, T = meta.seq_lens_B.shape[0], q_TNH.shape[0]
            o_BNH = sharded_decode_attention(mesh, q_TNH[:B], kv_pages_PSJH, meta.seq_lens_B,
                                             page_table_BC, sm_scale=sm_scale, backend=backend,
                                             **extras)
            return jnp.pad(o_BNH, ((0, T - B), (0, 0), (0, 0)))

        if decode_only is True:
            return decode()
        return jax.lax.cond(decode_only, decode, ragged)

    # ------------------------------------------------------------- layer range
    def run_layers(self, x_TD, kv_pages_PSJH, meta, start, end, *, decode_only=False,
                   backends: KernelBackends = KernelBackends()):
        """Runs decoder layers [start, end): `run_units` over units [2 start, 2 end)."""
        return self.run_units(x_TD, kv_pages_PSJH, meta, 2 * start, 2 * end,
                              decode_only=decode_only, backends=backends)

    def run_units(
        self,
        x_TD: jax.Array,
        kv_pages_PSJH: jax.Array,
        meta: AttentionMetadata,
        lo,
        hi,
        *,
        decode_only=False,
        backends: KernelBackends = KernelBackends(),
    ):
        """Runs operator units [lo, hi) on x_TD: unit 2i is layer i's attention half, unit
        2i + 1 its MLP half, so a range may start or stop between a layer's two halves.

        Returns (x_TD, kv_pages_PSJH, experts_activated): the last is the number of
        experts the real tokens activated, summed over the range's MoE layers.
        `lo` and `hi` may be Python ints or traced int32 scalars: one loop body serves
        every layer (the weights are indexed by the loop counter), so one compiled program
        runs any range it is given. The loop covers layers [lo // 2, ceil(hi / 2)); a half
        outside [lo, hi) (only possible in the first and last layer) is skipped by a
        `lax.cond` on the unit: it writes no KV, activates no expert, leaves x unchanged
        and costs nothing, so a one-unit segment (FlowPrefill's operator granularity)
        computes one half. The KV pool passes through the untaken branch in place (no
        copy: the AOT audit checks the compiled programs).
        """
        L2 = 2 * self.config.num_hidden_layers
        if isinstance(lo, int) and isinstance(hi, int) and not 0 <= lo <= hi <= L2:
            raise ValueError(f"unit range [{lo}, {hi}) outside [0, {L2})")
        token_mask_T = meta.token_mask()

        def layer(i, carry):
            x, kv, n = carry
            x, kv = jax.lax.cond(
                2 * i >= lo,
                lambda x, kv: self._attention(i, x, kv, meta, decode_only, backends.attention),
                lambda x, kv: (x, kv), x, kv)
            x, activated = jax.lax.cond(
                2 * i + 1 < hi, lambda x: self._mlp(i, x, token_mask_T, backends),
                lambda x: (x, jnp.int32(0)), x)
            return x, kv, n + activated

        return jax.lax.fori_loop(lo // 2, (hi + 1) // 2, layer,
                                 (x_TD, kv_pages_PSJH, jnp.int32(0)))


class Qwen3MoeForCausalLM(StackedCausalLM):
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

    def _qkv(self, i, h_TD, positions_T):
        """Projections, per-head q/k RMSNorm, RoPE."""
        cfg, attn = self.config, self.model.layers.self_attn
        T = h_TD.shape[0]
        N, K, H = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q_TNH = _dot(h_TD, attn.q_proj[i]).reshape(T, N, H)
        k_TKH = _dot(h_TD, attn.k_proj[i]).reshape(T, K, H)
        v_TKH = _dot(h_TD, attn.v_proj[i]).reshape(T, K, H)
        q_TNH = rms_norm(q_TNH, attn.q_norm[i], cfg.rms_norm_eps)
        k_TKH = rms_norm(k_TKH, attn.k_norm[i], cfg.rms_norm_eps)
        inv_freq_H2, scale = rope_frequencies(cfg)
        q_TNH = apply_rope(q_TNH, positions_T, inv_freq_H2, scale)
        k_TKH = apply_rope(k_TKH, positions_T, inv_freq_H2, scale)
        return q_TNH, k_TKH, v_TKH

    def _o_proj(self, i, o_TX):
        return _dot(o_TX, self.model.layers.self_attn.o_proj[i])

    def _moe(self, j, h_TD, token_mask_T, backends: KernelBackends):
        """MoE block of MoE layer j: the kernels get the whole stacked expert weights and
        the layer index, and address the layer themselves (no [E, D, 2F] slice is made);
        mesh and dispatch as `sharded_kernels.model_moe_ffn` picks them."""
        cfg, mlp = self.config, self.model.layers.mlp
        logits_TE = jnp.dot(h_TD.astype(jnp.float32), mlp.gate[j].astype(jnp.float32))
        y_TD, stats = model_moe_ffn(
            h_TD, logits_TE, mlp.experts_gate_up_proj[...], mlp.experts_down_proj[...],
            layer=j, top_k=cfg.num_experts_per_tok, norm_topk_prob=cfg.norm_topk_prob,
            backend=backends.moe, moe_dispatch=backends.moe_dispatch,
            token_mask_T=token_mask_T)
        return y_TD, stats["experts_activated"]

    def _dense_mlp(self, j, h_TD):
        mlp = self.model.layers.dense_mlp
        g_TF = _dot(h_TD, mlp.gate_proj[j])
        u_TF = _dot(h_TD, mlp.up_proj[j])
        return _dot(jax.nn.silu(g_TF) * u_TF, mlp.down_proj[j]), jnp.int32(0)

    def _mlp(self, i, x_TD, token_mask_T, backends: KernelBackends):
        """MLP half of layer i: post-attention norm, MoE or dense MLP, residual. Returns
        (x_TD, experts activated). In a model mixing both kinds, the kind is chosen at run
        time from the layer index, so one loop body serves every layer."""
        cfg = self.config
        h_TD = rms_norm(x_TD, self.model.layers.post_attention_layernorm[i], cfg.rms_norm_eps)
        stack_j = jnp.asarray(self._stack_index, jnp.int32)[i]
        moe = lambda: self._moe(stack_j, h_TD, token_mask_T, backends)
        dense = lambda: self._dense_mlp(stack_j, h_TD)
        if not cfg.moe_layers:
            y_TD, activated = dense()
        elif not cfg.dense_layers:
            y_TD, activated = moe()
        else:
            is_moe = jnp.asarray([cfg.is_moe_layer(l) for l in range(cfg.num_hidden_layers)])
            y_TD, activated = jax.lax.cond(is_moe[i], moe, dense)
        return x_TD + y_TD, activated


KV_CACHE_AXES = ("kv_pages", None, "kv_combined_heads", None)  # logical axes of the pool


def embed_width(cfg: ModelConfig) -> int:
    """Columns of the embedding table: hidden_size rounded up to 128 lanes, the padding
    zero (loader.py). XLA:TPU copies a whole [V, D] table before a row gather when D is
    not a multiple of 128 (GPT-OSS-20B: 2880, a 1.1 GB copy per step); the padded table
    is gathered in place, and `embed` drops the padding columns."""
    return -(-cfg.hidden_size // 128) * 128


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
