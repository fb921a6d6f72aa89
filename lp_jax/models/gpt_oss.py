"""GPT-OSS (Hugging Face `gpt_oss`, GptOssForCausalLM) in Flax NNX, on the same stacked
layer loop as Qwen3 (`StackedCausalLM` in stacked.py).

What differs from Qwen3, each checked against transformers' modeling_gpt_oss.py:

* attention: biases on q/k/v/o, no q/k norm, YaRN RoPE, and a learned sink logit per
  query head (`sinks` [L, N]) in the softmax denominator;
* layers alternate sliding-window (`sliding_window` keys, the query's own included)
  and full attention (`layer_types`). The window is a runtime scalar read from a
  per-layer table by the loop counter (0 = full), so both kinds share the one loop
  body and add no compiled program;
* every layer is MoE: a router with a bias, softmax over the top-k logits (the same
  weights as softmax, top-k, renormalise), experts `intermediate_size` wide with
  biases on both projections and the clamped SwiGLU
  (`MoEActivation("gpt_oss_clamped", ...)`: `layers.expert_activation`);
* RMSNorm scales in float32 before the cast (GptOssRMSNorm).

Parameter names follow the checkpoint (`model.layers.N.self_attn.sinks`,
`mlp.router.weight`, `mlp.experts.gate_up_proj_bias`, ...), flattened as in Qwen3:
`q_proj` / `q_proj_bias`, `router` / `router_bias`, `experts_gate_up_proj` /
`experts_gate_up_proj_bias`. Expert weights use the kernel layout, [gate | up] halves
(the checkpoint interleaves gate and up columns; the loader splits them).

Kernels. Every attention backend we own ("xla", "tpu", "gpu") has sinks and windows
(the kernels skip pages wholly before a window), and every MoE backend has the expert
biases and the clamped SwiGLU. JAX's shipped TPU attention ("tpu_jax") has neither:
`serving_backends` swaps it for "tpu", with a warning, and the entry point itself
refuses sinks and windows, so nothing can silently compute without them. On TPU the
KV pool is packed [.., K, 2H] for head_dim 64 (`kv_cache.packs_kv`). On a mesh the
MoE takes Qwen3's path (`sharded_kernels.model_moe_ffn`: allreduce or all_to_all).
"""

from __future__ import annotations

import dataclasses
import warnings

import jax.numpy as jnp
from flax import nnx

from lp_jax.config import ModelConfig
from lp_jax.models.backends import KernelBackends
from lp_jax.models.layers import (
    apply_rope,
    dot,
    expert_activation,
    param,
    rms_norm,
    rope_frequencies,
)
from lp_jax.models.sharded_kernels import model_moe_ffn
from lp_jax.models.stacked import StackedCausalLM
from lp_jax.quant.linear import set_weight
from pallas_kernels import attention

_WARNED: set[str] = set()


def serving_backends(backends: KernelBackends) -> KernelBackends:
    """The backends GPT-OSS layers run with: JAX's shipped TPU attention kernel
    ("tpu_jax") has no attention sinks or sliding windows, so those layers take our TPU
    kernel ("tpu") instead, with a warning once. "auto" resolves for the target platform
    at trace time, as the kernels' own entry points do. Every other backend has sinks,
    windows, expert biases and the clamped SwiGLU."""
    if attention.resolve_backend(backends.attention) != "tpu_jax":
        return backends
    message = ("GPT-OSS: attention backend 'tpu_jax' -> 'tpu' (JAX's shipped kernel has no "
               "attention sinks / sliding windows)")
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=2)
    return dataclasses.replace(backends, attention="tpu")


def quantized_params(cfg: ModelConfig) -> dict:
    """The scheme of each expert projection: MXFP4 under quantization="mxfp4" (as stored),
    int8 / fp8 per channel under quantization="int8" | "fp8" (at load, of a 16-bit
    checkpoint), else None. Attention, router, sinks and biases stay 16-bit in every
    format, as the MXFP4 checkpoint's modules_to_not_convert keeps them: the experts are
    ~96% of GPT-OSS-20B's weights."""
    scheme = None if cfg.quantization is None else cfg.quantization.scheme
    return {"mlp.experts_gate_up_proj": scheme, "mlp.experts_down_proj": scheme}


class GptOssAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, *, rngs: nnx.Rngs):
        L, D, N = cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads
        NH, KH = N * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        self.q_proj = param(rngs, (L, D, NH), ("layers", "embed", "q_heads"), dtype)
        self.k_proj = param(rngs, (L, D, KH), ("layers", "embed", "kv_heads"), dtype)
        self.v_proj = param(rngs, (L, D, KH), ("layers", "embed", "kv_heads"), dtype)
        # [L, D, N*H], the checkpoint's [out, in]: with D = 2880 (not a multiple of 128)
        # XLA:TPU lays [L, N*H, D] out N*H-minor and copied the whole stack (540 MB) to
        # the loop's layout every step; this way round the minor axis is N*H.
        self.o_proj = param(rngs, (L, D, NH), ("layers", "embed", "q_heads"), dtype,
                            fan_in=NH)
        if cfg.attention_bias:
            self.q_proj_bias = _zeros((L, NH), ("layers", "q_heads"), dtype)
            self.k_proj_bias = _zeros((L, KH), ("layers", "kv_heads"), dtype)
            self.v_proj_bias = _zeros((L, KH), ("layers", "kv_heads"), dtype)
            self.o_proj_bias = _zeros((L, D), ("layers", "embed"), dtype)
        self.sinks = _zeros((L, N), ("layers", None), dtype)


class GptOssMLP(nnx.Module):
    """Router and experts (with biases), stacked over the layers."""

    def __init__(self, cfg: ModelConfig, dtype, *, rngs: nnx.Rngs):
        L, D, E, F = (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_experts,
                      cfg.moe_intermediate_size)
        self.router = param(rngs, (L, D, E), ("layers", "embed", None), dtype)
        self.router_bias = _zeros((L, E), ("layers", None), dtype)
        scheme = quantized_params(cfg)["mlp.experts_gate_up_proj"]
        set_weight(self, "experts_gate_up_proj", rngs, (L, E, D, 2 * F),
                   ("layers", "experts", "embed", "expert_mlp"), dtype, scheme)
        self.experts_gate_up_proj_bias = _zeros((L, E, 2 * F),
                                                ("layers", "experts", "expert_mlp"), dtype)
        set_weight(self, "experts_down_proj", rngs, (L, E, F, D),
                   ("layers", "experts", "expert_mlp", "embed"), dtype, scheme)
        self.experts_down_proj_bias = _zeros((L, E, D), ("layers", "experts", "embed"), dtype)


def _zeros(shape, axes, dtype):
    return nnx.Param(jnp.zeros(shape, dtype), logical_axes=axes)


class GptOssDecoderLayers(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, *, rngs: nnx.Rngs):
        L, D = cfg.num_hidden_layers, cfg.hidden_size
        self.input_layernorm = param(rngs, (L, D), ("layers", "embed"), dtype, ones=True)
        self.post_attention_layernorm = param(rngs, (L, D), ("layers", "embed"), dtype, ones=True)
        self.self_attn = GptOssAttention(cfg, dtype, rngs=rngs)
        self.mlp = GptOssMLP(cfg, dtype, rngs=rngs)


class GptOssForCausalLM(StackedCausalLM):
    """GptOssForCausalLM. Use `run_layers` / `run_units` for any layer range."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=None):
        if cfg.model_type != "gpt_oss":
            raise ValueError(f"GptOssForCausalLM needs model_type 'gpt_oss', got "
                             f"{cfg.model_type!r}")
        super().__init__(cfg, GptOssDecoderLayers, rngs=rngs, dtype=dtype)
        # Keys each layer sees; 0 = full attention. Read by the loop counter at run time.
        self._windows = tuple(cfg.layer_window(i) or 0 for i in range(cfg.num_hidden_layers))

    def _norm(self, x_TD, weight):
        return rms_norm(x_TD, weight, self.config.rms_norm_eps, scale_in_float32=True)

    def _linear(self, i, h_TX, name):
        attn = self.model.layers.self_attn
        y = dot(h_TX, getattr(attn, name)[i])
        if self.config.attention_bias:
            y = y + getattr(attn, f"{name}_bias")[i]
        return y

    def _qkv(self, i, h_TD, positions_T):
        cfg = self.config
        T = h_TD.shape[0]
        N, H = cfg.num_attention_heads, cfg.head_dim
        q_TNH = self._linear(i, h_TD, "q_proj").reshape(T, N, H)
        # K heads, or the K r the loader laid out for the mesh (loader.kv_columns).
        k_TKH = self._linear(i, h_TD, "k_proj").reshape(T, -1, H)
        v_TKH = self._linear(i, h_TD, "v_proj").reshape(T, -1, H)
        inv_freq_H2, scale = rope_frequencies(cfg)
        return (apply_rope(q_TNH, positions_T, inv_freq_H2, scale),
                apply_rope(k_TKH, positions_T, inv_freq_H2, scale), v_TKH)

    def _o_proj(self, i, o_TX):
        attn = self.model.layers.self_attn
        y_TD = jnp.einsum("tx,dx->td", o_TX, attn.o_proj[i],
                          preferred_element_type=jnp.float32).astype(o_TX.dtype)
        return y_TD + attn.o_proj_bias[i] if self.config.attention_bias else y_TD

    def _attention_extras(self, i) -> dict:
        extras = {"sinks_N": self.model.layers.self_attn.sinks[i]}
        if any(self._windows):
            extras["sliding_window"] = jnp.asarray(self._windows, jnp.int32)[i]
        return extras

    def _mlp(self, i, x_TD, token_mask_T, backends: KernelBackends):
        """Post-attention norm, router (with bias), experts, residual. The MoE backends
        get the whole stacked expert weights and biases and the layer index, on the mesh
        and with the dispatch (allreduce / all_to_all) Qwen3 uses
        (`sharded_kernels.model_moe_ffn`)."""
        cfg, mlp = self.config, self.model.layers.mlp
        h_TD = self._norm(x_TD, self.model.layers.post_attention_layernorm[i])
        logits_TE = (jnp.dot(h_TD.astype(jnp.float32), mlp.router[i].astype(jnp.float32))
                     + mlp.router_bias[i].astype(jnp.float32))
        quant, scheme = {}, quantized_params(cfg)["mlp.experts_gate_up_proj"]
        if scheme is not None:  # MXFP4 (lp_jax/quant/mxfp4.py), int8 or fp8 experts
            quant = dict(scales=(mlp.experts_gate_up_proj_scale[...],
                                 mlp.experts_down_proj_scale[...]), scheme=scheme)
        y_TD, stats = model_moe_ffn(
            h_TD, logits_TE, mlp.experts_gate_up_proj[...], mlp.experts_down_proj[...],
            layer=i, top_k=cfg.num_experts_per_tok, norm_topk_prob=True,
            backend=backends.moe, moe_dispatch=backends.moe_dispatch,
            token_mask_T=token_mask_T,
            biases=(mlp.experts_gate_up_proj_bias[...], mlp.experts_down_proj_bias[...]),
            activation=expert_activation(cfg), **quant)
        return x_TD + y_TD, stats["experts_activated"]

    def serving_backends(self, backends: KernelBackends) -> KernelBackends:
        return serving_backends(backends)

    def run_units(self, x_TD, kv_pages_PSJH, meta, lo, hi, *, decode_only=False,
                  backends: KernelBackends = KernelBackends(), **aux):
        """`StackedCausalLM.run_units` with the backends GPT-OSS layers can run
        (`serving_backends`; the executor applies it too, so idempotent)."""
        return super().run_units(x_TD, kv_pages_PSJH, meta, lo, hi, decode_only=decode_only,
                                 backends=serving_backends(backends), **aux)
