"""DeepSeek-V3 / R1 / V3.1 (Hugging Face `deepseek_v3`, DeepseekV3ForCausalLM): GLM-4.5's
MoE blocks (sigmoid group-limited routing with a correction bias, shared experts, dense
first layers; qwen3_moe.py) under multi-head latent attention (MLA).

MLA, as transformers' modeling_deepseek_v3.py computes it (goldens:
tests/test_deepseek_v3.py):

* queries: `q_proj`, or the low-rank `q_a_proj` -> `q_a_layernorm` -> `q_b_proj`
  (q_lora_rank), N heads of qk_nope_head_dim + qk_rope_head_dim;
* keys and values: `kv_a_proj_with_mqa` gives a latent of kv_lora_rank (normed by
  `kv_a_layernorm`) and one rotary key of qk_rope_head_dim shared by all heads;
  `kv_b_proj` expands the latent into each head's key (nope part) and value;
* rotary on the qk_rope_head_dim part only, interleaved pairs (`rope_interleave`), YaRN
  with mscale in cos/sin and mscale_all_dim in the softmax scale (cfg.softmax_scale).

The KV pool holds what transformers' cache holds: the normed latent and the rotated
shared key, kv_lora_rank + qk_rope_head_dim values a token a layer (kv_cache.py; padded
to whole 128-lane rows for the TPU kernel), written once per token. Every step reads it
in the absorbed form (pallas_kernels/attention/mla_ref.py): W_UK folded into the query,
W_UV applied after attention, so no per-head key or value exists for cached tokens. A
(query row, key) pair costs N (2A + R) multiply-adds, prefill and decode rows alike; the
expanded form (kv_b_proj on each page of latents, what transformers computes) is the
oracle the tests compare against, never run by the engine: its reference expands each
page once per query row, A N (H + O) multiply-adds a pair (~120x the absorbed form's at
DeepSeek-V3's shapes). Expanding once per key of a sequence would undercut the absorbed
form for long prompts; that prefill is not built.

Quantised at load (`quantization="int8" | "fp8"`, per output channel): the latent
projections, kv_b_proj included, are int8 / e4m3 with a float32 scale as every other
model's (`quantized_params`). kv_b_proj's scale is one value per head and output channel,
so it leaves the weight exactly in both forms: W_UK's scale multiplies the query's nope
part (score = sum_h q_h s_h (c @ W_UK_q)_h) and W_UV's the attention output, and the
latent attention reads the unscaled int8 / e4m3 values, which bf16 holds exactly. An FP8
checkpoint's latent projections are dequantised once at load instead (loader._mla_sources):
its 128 x 128 block scales vary along the latent, which absorption would have to undo.

Backends (pallas_kernels/attention/mla.py): the Pallas MLA kernel on TPU and GPU
("auto", or "tpu" / "gpu" by name; it walks each query token's own causal context, so it
takes prefill chunks as well as decodes), the XLA reference elsewhere. "tpu_jax" (JAX's
shipped GQA kernel) has no latent form and is refused. On a multi-device mesh the kernel
runs per head shard (shard_map; the latent pool is whole on every device). The refusals
of not-yet-served features are in ModelConfig._check_mla.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from lp_jax.config import ModelConfig
from lp_jax.models import qwen3_moe
from lp_jax.models.backends import KernelBackends
from lp_jax.models.data_ranks import per_rank
from lp_jax.models.kv_cache import layer_pages, layer_slots
from lp_jax.models.layers import (
    apply_rope,
    apply_rope_interleaved,
    param,
    rms_norm,
    rope_frequencies,
)
from lp_jax.models.metadata import AttentionMetadata
from lp_jax.models.qwen3_moe import Qwen3MoeDecoderLayers, Qwen3MoeForCausalLM
from lp_jax.models.sharded_kernels import kernel_mesh
from lp_jax.quant.config import AT_LOAD
from lp_jax.quant.linear import linear, scale_of, set_weight
from lp_jax.sharding import axes_size, mesh_axes
from pallas_kernels.attention import mla
from pallas_kernels.attention.mla_ref import write_latent


def mla_linears(cfg: ModelConfig) -> tuple[str, ...]:
    """The latent-attention projections of cfg's checkpoint (self_attn.<name>)."""
    q = ("q_a_proj", "q_b_proj") if cfg.q_lora_rank else ("q_proj",)
    return (*q, "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


@functools.cache
def quantized_params(cfg: ModelConfig):
    """qwen3_moe.quantized_params for the MoE blocks, with the latent projections: the
    at-load scheme (int8, fp8), or None (16-bit; an FP8 checkpoint's are dequantised)."""
    out = {k: s for k, s in qwen3_moe.quantized_params(cfg).items()
           if not k.startswith("self_attn.")}
    q = cfg.quantization
    scheme = q.scheme if q is not None and q.method in AT_LOAD else None
    return out | {f"self_attn.{name}": scheme for name in mla_linears(cfg)}


def kv_a_width(cfg: ModelConfig) -> int:
    """Columns of the stored kv_a_proj_with_mqa: kv_lora_rank + qk_rope_head_dim rounded
    up to whole 128-lane tiles (the padding columns are zero and never read)."""
    return -(-(cfg.kv_lora_rank + cfg.head_dim) // 128) * 128


class MlaAttention(nnx.Module):
    """Latent attention's projections, stacked over the layers, [in, out] as the other
    models' linears (names as in the checkpoint), each with a `_scale` when quantised.

    Two are held in the layout the step reads, so that XLA:TPU needs no relayout copy
    of them (it would hoist one of the whole stack before the layer loop, every call):

    * kv_a_proj_with_mqa [L, D, kv_a_width]: its A + R output columns (576 for
      DeepSeek-V3) zero-padded to whole 128-lane tiles (640). A minor axis that is not a
      multiple of 128 gets a column-minor device layout, which the dot does not read;
    * kv_b_proj [L, N, A, H + O]: per head, the latent-by-[W_UK | W_UV] matrix, heads
      major. The [A, N * (H + O)] form puts the heads among the two tiled minor axes,
      where the per-head (batched) dots of both attention forms cannot read them. Its
      per-(head, channel) scale, [L, N, 1, H + O], is the reduction over A as before.
    """

    def __init__(self, cfg: ModelConfig, num_layers: int, dtype, *, rngs: nnx.Rngs):
        L, D, N = num_layers, cfg.hidden_size, cfg.num_attention_heads
        A, R, Q = cfg.kv_lora_rank, cfg.head_dim, cfg.q_lora_rank
        H, O = cfg.qk_nope_head_dim, cfg.v_head_dim
        shapes = {"q_a_proj": ((L, D, Q), ("layers", "embed", None)),
                  "q_b_proj": ((L, Q, N * (H + R)), ("layers", None, "q_heads")),
                  "q_proj": ((L, D, N * (H + R)), ("layers", "embed", "q_heads")),
                  "kv_a_proj_with_mqa": ((L, D, kv_a_width(cfg)), ("layers", "embed", None)),
                  "kv_b_proj": ((L, N, A, H + O), ("layers", "q_heads", None, None)),
                  "o_proj": ((L, N * O, D), ("layers", "q_heads", "embed"))}
        quant = quantized_params(cfg)
        for name in mla_linears(cfg):
            shape, axes = shapes[name]
            set_weight(self, name, rngs, shape, axes, dtype, quant[f"self_attn.{name}"])
        if Q:
            self.q_a_layernorm = param(rngs, (L, Q), ("layers", None), dtype, ones=True)
        self.kv_a_layernorm = param(rngs, (L, A), ("layers", None), dtype, ones=True)


class DeepseekV3DecoderLayers(Qwen3MoeDecoderLayers):
    attention_class = MlaAttention


class DeepseekV3ForCausalLM(Qwen3MoeForCausalLM):
    """DeepseekV3ForCausalLM: the Qwen3-MoE stack with latent attention (see above)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=None):
        if not cfg.is_mla:
            raise ValueError(f"{cfg.model_type}: DeepseekV3ForCausalLM needs kv_lora_rank > 0")
        super().__init__(cfg, rngs=rngs, dtype=dtype,
                         decoder_layers=DeepseekV3DecoderLayers)

    def serving_backends(self, backends: KernelBackends) -> KernelBackends:
        """Latent attention runs on "auto", "xla", "tpu" and "gpu" (pallas_kernels/
        attention/mla.py); "tpu_jax" is refused before anything compiles. "auto" becomes
        "xla" where the platform's kernel cannot take the model's head shapes (the tiny
        presets' 32-wide latent); a kernel named for them raises at its first call."""
        if backends.attention == "tpu_jax":
            raise ValueError(f"{self.config.model_type}: attention backend 'tpu_jax' (JAX's "
                             "shipped GQA kernel) has no latent-attention (MLA) form; use "
                             "attention_backend 'auto', 'tpu', 'gpu' or 'xla'")
        cfg = self.config
        if backends.attention == "auto" and mla.kernel_refusal(
                "auto", cfg.num_attention_heads, cfg.kv_lora_rank, cfg.head_dim):
            return KernelBackends(moe=backends.moe, attention="xla",
                                  moe_dispatch=backends.moe_dispatch)
        mla.resolve_mla_backend(backends.attention)
        return backends

    def _mla_proj(self, name: str, i, x_TK):
        """x @ self_attn.name[i], quantised (lp_jax.quant.linear) when the format is."""
        attn = self.model.layers.self_attn
        scale = scale_of(attn, name)
        return linear(x_TK, getattr(attn, name)[i], None if scale is None else scale[i],
                      quantized_params(self.config)[f"self_attn.{name}"])

    def mla_inputs(self, i, h_TD, positions_T):
        """Layer i's (q_nope_TNH, q_pe_TNR, latent_TX): queries split into their nope and
        rotary parts, and the pool row [normed latent | rotated shared key] of each token."""
        cfg, attn = self.config, self.model.layers.self_attn
        T, N = h_TD.shape[0], cfg.num_attention_heads
        A, H, R = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.head_dim
        if cfg.q_lora_rank:
            q_TQ = rms_norm(self._mla_proj("q_a_proj", i, h_TD), attn.q_a_layernorm[i],
                            cfg.rms_norm_eps)
            q_TX = self._mla_proj("q_b_proj", i, q_TQ)
        else:
            q_TX = self._mla_proj("q_proj", i, h_TD)
        q_TNX = q_TX.reshape(T, N, -1)
        kv_TX = self._mla_proj("kv_a_proj_with_mqa", i, h_TD)
        latent_TA = rms_norm(kv_TX[:, :A], attn.kv_a_layernorm[i], cfg.rms_norm_eps)
        inv_freq_R2, scale = rope_frequencies(cfg)
        rope = apply_rope_interleaved if cfg.rope_interleave else apply_rope
        q_pe_TNR = rope(q_TNX[..., H:], positions_T, inv_freq_R2, scale)
        k_pe_TR = rope(kv_TX[:, None, A:A + R], positions_T, inv_freq_R2, scale)[:, 0]
        return q_TNX[..., :H], q_pe_TNR, jnp.concatenate([latent_TA, k_pe_TR], axis=-1)

    def _attention(self, i, x_TD, kv_pages_PS1X, meta: AttentionMetadata, decode_only,
                   backend):
        """Attention half of layer i: latent written to the pool, then attention in the
        absorbed form for every row, prefill and decode alike (module docstring);
        `decode_only` picks nothing here: one form serves every step."""
        cfg, attn = self.config, self.model.layers.self_attn
        T, N = x_TD.shape[0], cfg.num_attention_heads
        H, O = cfg.qk_nope_head_dim, cfg.v_head_dim
        h_TD = self._norm(x_TD, self.model.layers.input_layernorm[i])
        q_nope_TNH, q_pe_TNR, latent_TX = self.mla_inputs(i, h_TD, meta.positions_T)

        w_kv_NAX = attn.kv_b_proj[i].astype(h_TD.dtype)  # heads major (MlaAttention)
        w_uk_ANH, w_uv_ANO = (jnp.swapaxes(w, 0, 1) for w in (w_kv_NAX[..., :H], w_kv_NAX[..., H:]))
        kv_b_scale = scale_of(attn, "kv_b_proj")
        if kv_b_scale is not None:  # per (head, channel): W_UK's into q, W_UV's after
            s_NX = kv_b_scale[i].reshape(N, H + O)
            q_nope_TNH = (q_nope_TNH.astype(jnp.float32) * s_NX[:, :H]).astype(h_TD.dtype)

        def write_and_attend(cfg, kv_pages_PS1X, meta, q_nope_TNH, q_pe_TNR, latent_TX):
            P_total, S = kv_pages_PS1X.shape[:2]
            slots_T = layer_slots(cfg, i, meta.slots_T, P_total, S)
            page_table_BC = layer_pages(cfg, i, meta.page_table_BC, P_total)
            kv_pages_PS1X = write_latent(kv_pages_PS1X, latent_TX, slots_T)
            return _sharded_mla(
                q_nope_TNH, q_pe_TNR, kv_pages_PS1X, w_uk_ANH, w_uv_ANO,
                meta.query_start_B1, meta.seq_lens_B, page_table_BC, meta.num_seqs,
                sm_scale=cfg.softmax_scale, absorbed=True, backend=backend), kv_pages_PS1X

        # Under data-parallel attention, on each data rank's rows and pool shard.
        o_TNO, kv_pages_PS1X = per_rank(cfg, write_and_attend, kv_pages_PS1X, meta,
                                        q_nope_TNH, q_pe_TNR, latent_TX)
        if kv_b_scale is not None:
            o_TNO = (o_TNO.astype(jnp.float32) * s_NX[:, H:]).astype(x_TD.dtype)
        # The residual stays in the model's dtype (lax.cond in run_units needs both
        # branches alike).
        o_TD = self._mla_proj("o_proj", i, o_TNO.reshape(T, N * O))
        return (x_TD + o_TD).astype(x_TD.dtype), kv_pages_PS1X


def _sharded_mla(q_nope_TNH, q_pe_TNR, kv_pages_PS1X, w_uk_ANH, w_uv_ANO, *rest, sm_scale,
                 absorbed, backend):
    """`mla.mla_paged_attention`; a Pallas kernel on a multi-device mesh runs per head
    shard (GSPMD cannot split a kernel, and would gather every head onto each device):
    queries, W_UK and W_UV split over the query heads' axes, the pool and the batch
    metadata whole."""
    kernel = functools.partial(mla.mla_paged_attention, sm_scale=sm_scale,
                               absorbed=absorbed, backend=backend)
    mesh = kernel_mesh(w_uk_ANH)
    if mesh is None or not absorbed or mla.resolve_mla_backend(backend) == "xla":
        return kernel(q_nope_TNH, q_pe_TNR, kv_pages_PS1X, w_uk_ANH, w_uv_ANO, *rest)
    heads = mesh_axes("q_heads", mesh)
    if heads is not None and q_nope_TNH.shape[1] % axes_size(heads, mesh):
        heads = None
    q, w = P(None, heads, None), P(None, heads, None)
    rest = tuple(jnp.asarray(r, jnp.int32) for r in rest)
    return jax.shard_map(
        kernel, mesh=mesh, in_specs=(q, q, P(), w, w, *(P() for _ in rest)),
        out_specs=q, check_vma=False)(q_nope_TNH, q_pe_TNR, kv_pages_PS1X, w_uk_ANH,
                                       w_uv_ANO, *rest)
