"""Qwen3-MoE (and dense Qwen3), and the GLM-4.5 blocks on top of them, in Flax NNX, on
the stacked layer loop (stacked.py).

Module and parameter names follow the Hugging Face checkpoint
(`model.layers.self_attn.q_proj`, `model.layers.mlp.experts.gate_up_proj`, ...), so
loading is name matching; layer parameters are stacked along a leading layer axis
(`StackedCausalLM`).

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

GLM-4.5 (glm4_moe.py) is this model with blocks that the config switches on: q/k/v
biases (`attention_bias`), q/k norms only with `use_qk_norm`, partial RoPE
(`partial_rotary_factor`), a router variant with its per-layer
`e_score_correction_bias` (`cfg.router`: sigmoid, groups, scaling), shared experts
(`shared_experts`, stacked over the MoE layers) and dense first layers
(`first_k_dense_replace`, through the same `lax.cond` as `mlp_only_layers`).

Shared experts are a dense SwiGLU of width n_shared * moe_intermediate_size on every
token, not extra always-selected rows of the MoE kernel: every token uses them, so
the dense dot does exactly their work, while as kernel rows they would add T rows to
the expert sort, the gather and the tile padding, and widen the all-to-all (each
row travels) under expert parallelism. As dense weights they shard like the dense MLP
(tensor parallel, "mlp" axis), and every expert shard holds them.

Quantized (cfg.quantization, lp_jax/quant): the projections and experts that the
format converts are int8 / e4m3 with a float32 `<name>_scale` beside them
(pallas_kernels.quant's layout); the router `gate`, norms, embedding and head stay
16-bit. `quantized_params` says which, from the HF modules behind each parameter
and `modules_to_not_convert`; a stack whose layers disagree is refused.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from lp_jax.config import ModelConfig
from lp_jax.models.backends import KernelBackends
from lp_jax.models.layers import apply_rope, param, rms_norm, rope_frequencies
from lp_jax.models.sequence_parallel import constrain, row_axis
from lp_jax.models.sharded_kernels import kernel_mesh, model_moe_ffn, resolve_moe_dispatch
from lp_jax.models.stacked import StackedCausalLM
from lp_jax.quant.config import served_scheme
from lp_jax.quant.linear import linear, scale_of, set_weight
from pallas_kernels.quant import QuantScheme

# Parameters that a weight format may convert, with the HF modules behind them
# ({layer}: a decoder layer of the stack; {expert}: each expert).
QUANTIZABLE = {
    "self_attn.q_proj": ("self_attn.q_proj",),
    "self_attn.k_proj": ("self_attn.k_proj",),
    "self_attn.v_proj": ("self_attn.v_proj",),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.experts_gate_up_proj": ("mlp.experts.{expert}.gate_proj", "mlp.experts.{expert}.up_proj"),
    "mlp.experts_down_proj": ("mlp.experts.{expert}.down_proj",),
    "dense_mlp.gate_proj": ("mlp.gate_proj",),
    "dense_mlp.up_proj": ("mlp.up_proj",),
    "dense_mlp.down_proj": ("mlp.down_proj",),
    "shared_experts.gate_proj": ("mlp.shared_experts.gate_proj",),
    "shared_experts.up_proj": ("mlp.shared_experts.up_proj",),
    "shared_experts.down_proj": ("mlp.shared_experts.down_proj",),
}


@functools.cache
def quantized_params(cfg: ModelConfig) -> dict[str, QuantScheme | None]:
    """The scheme the model holds every QUANTIZABLE parameter in (None: 16-bit):
    `stored_params`, less an FP8 checkpoint's dense projections, which the loader
    dequantises (lp_jax.quant.served_scheme)."""
    return {name: served_scheme(name, s) for name, s in stored_params(cfg).items()}


@functools.cache
def stored_params(cfg: ModelConfig) -> dict[str, QuantScheme | None]:
    """The scheme of every QUANTIZABLE parameter's checkpoint tensors (None: 16-bit)
    under cfg.quantization. Raises ValueError when modules_to_not_convert keeps some
    layers' (or experts') modules of one stacked parameter and not others."""
    q = cfg.quantization
    out = {}
    for name, modules in QUANTIZABLE.items():
        if q is None or (cfg.is_mla and name.startswith("self_attn.")):
            out[name] = None  # latent attention: 16-bit (an FP8 checkpoint's, dequantised)
            continue
        layers = {"self_attn": range(cfg.num_hidden_layers), "mlp": cfg.moe_layers,
                  "dense_mlp": cfg.dense_layers,
                  "shared_experts": cfg.moe_layers if cfg.n_shared_experts else ()
                  }[name.split(".")[0]]
        experts = range(cfg.num_experts) if "{expert}" in modules[0] else [0]
        names = [f"model.layers.{i}." + m.format(expert=e)
                 for i in layers for e in experts for m in modules]
        converted = {n: q.converts(n) for n in names}
        if len(set(converted.values())) > 1:
            kept = [n for n, c in converted.items() if not c]
            raise ValueError(f"quantization_config.modules_to_not_convert keeps {kept[:3]} "
                             f"in 16 bits but converts other modules of the stacked "
                             f"parameter {name}; lp_jax needs all of its layers alike")
        out[name] = q.scheme if names and all(converted.values()) else None
    return out


class Qwen3MoeAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, num_layers: int, dtype, *, rngs: nnx.Rngs):
        L, D = num_layers, cfg.hidden_size
        NH = cfg.num_attention_heads * cfg.head_dim
        KH = cfg.num_key_value_heads * cfg.head_dim
        quant = quantized_params(cfg)
        for name, shape, axes in (("q_proj", (L, D, NH), ("layers", "embed", "q_heads")),
                                  ("k_proj", (L, D, KH), ("layers", "embed", "kv_heads")),
                                  ("v_proj", (L, D, KH), ("layers", "embed", "kv_heads")),
                                  ("o_proj", (L, NH, D), ("layers", "q_heads", "embed"))):
            set_weight(self, name, rngs, shape, axes, dtype, quant[f"self_attn.{name}"])
            if cfg.attention_bias and name != "o_proj":  # GLM-4.5: q/k/v only
                setattr(self, f"{name}_bias", nnx.Param(
                    jnp.zeros((L, shape[-1]), dtype), logical_axes=("layers", axes[-1])))
        if cfg.use_qk_norm:
            self.q_norm = param(rngs, (L, cfg.head_dim), ("layers", "head_dim"), dtype,
                                ones=True)
            self.k_norm = param(rngs, (L, cfg.head_dim), ("layers", "head_dim"), dtype,
                                ones=True)


class Qwen3MoeSparseMoeBlock(nnx.Module):
    """Router (`gate`, and GLM-4.5's float32 `e_score_correction_bias`) and experts,
    stacked over the MoE layers."""

    def __init__(self, cfg: ModelConfig, num_layers: int, dtype, *, rngs: nnx.Rngs):
        L, D, E, F = num_layers, cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        quant = quantized_params(cfg)
        self.gate = param(rngs, (L, D, E), ("layers", "embed", None), dtype)
        if cfg.has_router_correction_bias:
            self.e_score_correction_bias = nnx.Param(jnp.zeros((L, E), jnp.float32),
                                                     logical_axes=("layers", None))
        set_weight(self, "experts_gate_up_proj", rngs, (L, E, D, 2 * F),
                   ("layers", "experts", "embed", "expert_mlp"), dtype,
                   quant["mlp.experts_gate_up_proj"])
        set_weight(self, "experts_down_proj", rngs, (L, E, F, D),
                   ("layers", "experts", "expert_mlp", "embed"), dtype,
                   quant["mlp.experts_down_proj"])
        if quant["mlp.experts_gate_up_proj"] != quant["mlp.experts_down_proj"]:
            raise ValueError("the experts' gate/up and down projections must share one "
                             "format (modules_to_not_convert keeps one of them 16-bit)")


class Qwen3MLP(nnx.Module):
    """Dense SwiGLU MLP, stacked over the dense layers (`kind` "dense_mlp",
    intermediate_size wide) or, as GLM-4.5's shared experts, over the MoE layers
    ("shared_experts", n_shared_experts * moe_intermediate_size wide)."""

    def __init__(self, cfg: ModelConfig, num_layers: int, dtype, *, rngs: nnx.Rngs,
                 kind: str = "dense_mlp"):
        L, D = num_layers, cfg.hidden_size
        F = (cfg.intermediate_size if kind == "dense_mlp"
             else cfg.n_shared_experts * cfg.moe_intermediate_size)
        quant = quantized_params(cfg)
        for name, shape, axes in (("gate_proj", (L, D, F), ("layers", "embed", "mlp")),
                                  ("up_proj", (L, D, F), ("layers", "embed", "mlp")),
                                  ("down_proj", (L, F, D), ("layers", "mlp", "embed"))):
            set_weight(self, name, rngs, shape, axes, dtype, quant[f"{kind}.{name}"])


class Qwen3MoeDecoderLayers(nnx.Module):
    attention_class: type[nnx.Module] = Qwen3MoeAttention  # DeepSeek-V3: latent attention

    def __init__(self, cfg: ModelConfig, dtype, *, rngs: nnx.Rngs):
        L, D = cfg.num_hidden_layers, cfg.hidden_size
        self.input_layernorm = param(rngs, (L, D), ("layers", "embed"), dtype, ones=True)
        self.post_attention_layernorm = param(rngs, (L, D), ("layers", "embed"), dtype, ones=True)
        self.self_attn = self.attention_class(cfg, L, dtype, rngs=rngs)
        n_moe, n_dense = len(cfg.moe_layers), len(cfg.dense_layers)
        self.mlp = Qwen3MoeSparseMoeBlock(cfg, n_moe, dtype, rngs=rngs) if n_moe else None
        self.dense_mlp = Qwen3MLP(cfg, n_dense, dtype, rngs=rngs) if n_dense else None
        self.shared_experts = (Qwen3MLP(cfg, n_moe, dtype, rngs=rngs, kind="shared_experts")
                               if n_moe and cfg.n_shared_experts else None)


class Qwen3MoeForCausalLM(StackedCausalLM):
    """Qwen3MoeForCausalLM / Qwen3ForCausalLM (and, with its blocks switched on by the
    config, Glm4MoeForCausalLM). Use `run_layers` for any layer range."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=None,
                 decoder_layers: type[nnx.Module] = Qwen3MoeDecoderLayers):
        super().__init__(cfg, decoder_layers, rngs=rngs, dtype=dtype)
        # Position of each layer inside its kind's stack (MoE or dense).
        moe, dense = cfg.moe_layers, cfg.dense_layers
        self._stack_index = tuple(
            moe.index(i) if i in moe else dense.index(i) for i in range(cfg.num_hidden_layers)
        )

    def _row_axis(self, rows: int):
        """The row-split residual stream (sequence_parallel.py) of a model whose every
        layer is a routed MoE with nothing beside it (no dense layers or shared experts):
        (mesh, axis) or None."""
        cfg = self.config
        if cfg.dense_layers or cfg.n_shared_experts or not cfg.moe_layers:
            return None
        mesh = kernel_mesh(self.model.layers.self_attn.q_proj[...])
        axis = row_axis(mesh, rows, cfg.num_experts)
        return None if axis is None else (mesh, axis)

    def _proj(self, module, kind: str, name: str, i, x_TK):
        """x @ module.name[i], quantized (lp_jax.quant.linear) if the format converts it."""
        scale = scale_of(module, name)
        return linear(x_TK, getattr(module, name)[i], None if scale is None else scale[i],
                      quantized_params(self.config)[f"{kind}.{name}"])

    def _qkv(self, i, h_TD, positions_T):
        """Projections (and biases), per-head q/k RMSNorm, RoPE on the first
        cfg.rotary_dim channels of each head."""
        cfg, attn = self.config, self.model.layers.self_attn
        T = h_TD.shape[0]
        N, H = cfg.num_attention_heads, cfg.head_dim
        q_TNH = self._proj(attn, "self_attn", "q_proj", i, h_TD).reshape(T, N, H)
        # K heads, or the K r the loader laid out for the mesh (loader.kv_columns).
        k_TKH = self._proj(attn, "self_attn", "k_proj", i, h_TD).reshape(T, -1, H)
        v_TKH = self._proj(attn, "self_attn", "v_proj", i, h_TD).reshape(T, -1, H)
        if cfg.attention_bias:
            q_TNH = q_TNH + attn.q_proj_bias[i].reshape(N, H)
            k_TKH = k_TKH + attn.k_proj_bias[i].reshape(-1, H)
            v_TKH = v_TKH + attn.v_proj_bias[i].reshape(-1, H)
        if cfg.use_qk_norm:
            q_TNH = rms_norm(q_TNH, attn.q_norm[i], cfg.rms_norm_eps)
            k_TKH = rms_norm(k_TKH, attn.k_norm[i], cfg.rms_norm_eps)
        inv_freq_H2, scale = rope_frequencies(cfg)
        q_TNH = apply_rope(q_TNH, positions_T, inv_freq_H2, scale)
        k_TKH = apply_rope(k_TKH, positions_T, inv_freq_H2, scale)
        return q_TNH, k_TKH, v_TKH

    def _o_proj(self, i, o_TX):
        attn = self.model.layers.self_attn
        if self._row_axis(o_TX.shape[0]) is not None and scale_of(attn, "o_proj") is None:
            # each chip's partial sum leaves in the activation dtype: the reduce-scatter
            # moves bf16 rows, not float32 ones (sequence_parallel.py)
            return jnp.dot(o_TX, attn.o_proj[i], preferred_element_type=o_TX.dtype)
        return self._proj(attn, "self_attn", "o_proj", i, o_TX)

    def _moe(self, j, h_TD, token_mask_T, backends: KernelBackends):
        """MoE block of MoE layer j: the kernels get the whole stacked expert weights and
        the layer index, and address the layer themselves (no [E, D, 2F] slice is made);
        mesh and dispatch as `sharded_kernels.model_moe_ffn` picks them. The router
        variant (cfg.router) with the layer's correction bias; shared experts added."""
        cfg, mlp = self.config, self.model.layers.mlp
        split = self._row_axis(h_TD.shape[0])
        if split is not None and resolve_moe_dispatch(
                split[0], backends.moe_dispatch, h_TD, mlp.experts_gate_up_proj[...],
                cfg.num_experts_per_tok) == "allreduce":
            h_TD = constrain(h_TD, split[0], None)  # every chip's experts see every row
        logits_TE = jnp.dot(h_TD.astype(jnp.float32), mlp.gate[j].astype(jnp.float32))
        quant, scheme = {}, quantized_params(cfg)["mlp.experts_gate_up_proj"]
        if scheme is not None:
            quant = dict(scales=(mlp.experts_gate_up_proj_scale[...],
                                 mlp.experts_down_proj_scale[...]), scheme=scheme)
        if cfg.has_router_correction_bias:
            quant["correction_bias_E"] = mlp.e_score_correction_bias[j]
        y_TD, stats = model_moe_ffn(
            h_TD, logits_TE, mlp.experts_gate_up_proj[...], mlp.experts_down_proj[...],
            layer=j, top_k=cfg.num_experts_per_tok, norm_topk_prob=cfg.norm_topk_prob,
            backend=backends.moe, moe_dispatch=backends.moe_dispatch,
            token_mask_T=token_mask_T, router=cfg.router, scatter_rows=split is not None,
            **quant)
        if self.model.layers.shared_experts is not None:
            y_TD = y_TD + self._swiglu(self.model.layers.shared_experts, "shared_experts",
                                       j, h_TD)
        return y_TD, stats["experts_activated"]

    def _swiglu(self, mlp, kind: str, j, h_TD):
        """down(SiLU(gate(h)) * up(h)) of the j-th entry of a stacked `Qwen3MLP`."""
        g_TF = self._proj(mlp, kind, "gate_proj", j, h_TD)
        u_TF = self._proj(mlp, kind, "up_proj", j, h_TD)
        return self._proj(mlp, kind, "down_proj", j, jax.nn.silu(g_TF) * u_TF)

    def _dense_mlp(self, j, h_TD):
        return self._swiglu(self.model.layers.dense_mlp, "dense_mlp", j, h_TD), jnp.int32(0)

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
