"""The building blocks both model families use: parameters with logical axes, the
float32-accumulating dot, RMSNorm, rotary embeddings (default RoPE and YaRN) and the
experts' activation, each computed as transformers computes it, so a model file holds
only what is its own."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from lp_jax.config import ModelConfig
from lp_jax.quant.linear import dense_dot
from pallas_kernels.moe import SILU, MoEActivation


def param(rngs: nnx.Rngs, shape, axes, dtype, *, fan_in: int | None = None, ones=False):
    """A parameter N(0, 1/fan_in) (fan_in: shape[-2] unless given), or ones, declaring its
    logical axes (`logical_axes` metadata) for lp_jax.sharding."""
    if ones:
        value = jnp.ones(shape, dtype)
    else:
        std = 1.0 / math.sqrt(fan_in if fan_in else shape[-2])
        value = (jax.random.normal(rngs.params(), shape, jnp.float32) * std).astype(dtype)
    return nnx.Param(value, logical_axes=axes)


def dot(x, w):
    """x @ w accumulated in float32, returned in x's dtype (`dense_dot`: on a GPU one row
    reads w once, and several rows leave the GEMM in x's dtype)."""
    return dense_dot(x, w)


def expert_activation(cfg: ModelConfig) -> MoEActivation:
    """The MoE kernels' activation for cfg: GPT-OSS's clamped SwiGLU when the config has
    a `swiglu_limit`, else SiLU(gate) * up."""
    if cfg.swiglu_limit is None:
        return SILU
    return MoEActivation("gpt_oss_clamped", limit=cfg.swiglu_limit, alpha=cfg.swiglu_alpha)


def rms_norm(x, weight, eps, *, scale_in_float32=False):
    """HF Qwen3RMSNorm: normalise in float32, cast back, then scale. With
    `scale_in_float32` (GptOssRMSNorm): scale in float32, then cast back."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if scale_in_float32:
        return (weight.astype(jnp.float32) * x32).astype(x.dtype)
    return weight * x32.astype(x.dtype)


def rope_frequencies(cfg: ModelConfig) -> tuple[jax.Array, float]:
    """(inv_freq [R/2] float32, cos/sin scale), computed as transformers does: the
    default RoPE, or YaRN (`_compute_yarn_parameters`) when cfg.rope_scaling is set.
    R = cfg.rotary_dim: head_dim, or its first partial_rotary_factor (GLM-4.5)."""
    H, theta, yarn = cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling
    inv_freq = 1.0 / (theta ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H))
    if yarn is None:
        return inv_freq, 1.0
    scale = yarn.cos_sin_scale()

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
    """Rotary embedding in the rotate-half (non-interleaved) form Qwen3, GPT-OSS and
    GLM-4.5 use, on the first R = 2 * len(inv_freq_H2) channels of each head (partial
    rotary: the rest pass unchanged); `scale` multiplies cos and sin (YaRN's attention
    factor)."""
    R = 2 * inv_freq_H2.shape[0]
    if R < x_TNH.shape[-1]:
        rotated = apply_rope(x_TNH[..., :R], positions_T, inv_freq_H2, scale)
        return jnp.concatenate([rotated, x_TNH[..., R:]], axis=-1)
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


def apply_rope_interleaved(x_TNR, positions_T, inv_freq_R2, scale: float = 1.0):
    """Rotary embedding on interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek's
    `rope_interleave`), written out de-interleaved, [rotated evens | rotated odds], as
    transformers' `apply_rotary_pos_emb_interleave` does: queries and keys get the same
    order, so their dot products are those of the interleaved form."""
    freqs_TR2 = positions_T.astype(jnp.float32)[:, None] * inv_freq_R2[None, :]
    cos, sin = jnp.cos(freqs_TR2)[:, None, :], jnp.sin(freqs_TR2)[:, None, :]
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    cos, sin = cos.astype(x_TNR.dtype), sin.astype(x_TNR.dtype)
    x1, x2 = x_TNR[..., 0::2], x_TNR[..., 1::2]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
