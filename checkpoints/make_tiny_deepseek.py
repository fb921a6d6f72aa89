"""Tiny DeepSeek-V3 (DeepseekV3ForCausalLM) presets for checkpoints/make_tiny.py: config.json
in the hubs' dialect and the weights under the checkpoint's names.

The config is DeepSeek-V3's published form: `rope_scaling` with `type: yarn`, `mscale`,
`mscale_all_dim` and `original_max_position_embeddings`, a top-level `rope_theta`,
`n_routed_experts`, one next-token (MTP) layer past num_hidden_layers (lp_jax skips it).
Layer 0 is dense, the others MoE with one shared expert and a nonzero
`e_score_correction_bias`; sigmoid routing scaled by 2.5.

* "tiny-deepseek": q_lora_rank 32 (q_a_proj, q_a_layernorm, q_b_proj), one expert group,
  YaRN factor 4 with mscale 0.707 / mscale_all_dim 1.0 (both the cos/sin factor and
  the softmax scale move);
* "tiny-deepseek-groups": q_proj (no q_lora_rank), 16 experts in 4 groups of which 2
  are eligible, top-4, default RoPE;
* "tiny-deepseek-a128": "tiny-deepseek" with a 128-wide latent and a 16-wide rotary key,
  the smallest shapes both Pallas MLA kernels take (the TPU kernel's latent is whole
  128-lane rows, the GPU kernel's widths powers of two >= 16).

Like make_tiny, this module imports only numpy, so the transformers venv loads it.
"""

from __future__ import annotations

import numpy as np

_DEEPSEEK = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "attention_bias": False, "attention_dropout": 0.0, "first_k_dense_replace": 1,
    "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
    "intermediate_size": 128, "kv_lora_rank": 32, "max_position_embeddings": 512,
    "moe_intermediate_size": 32, "n_group": 1, "n_routed_experts": 8, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 4, "num_experts_per_tok": 2,
    "num_hidden_layers": 3, "num_key_value_heads": 4, "num_nextn_predict_layers": 1,
    "q_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "rms_norm_eps": 1e-6,
    "rope_interleave": True, "rope_theta": 10000.0, "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid", "tie_word_embeddings": False, "topk_group": 1,
    "topk_method": "noaux_tc", "torch_dtype": "float32", "use_cache": True,
    "v_head_dim": 16, "vocab_size": 512,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "beta_fast": 32, "beta_slow": 1,
                     "mscale": 0.707, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 128},
}
DEEPSEEK_PRESETS: dict[str, dict] = {
    "tiny-deepseek": dict(_DEEPSEEK),
    "tiny-deepseek-groups": {**_DEEPSEEK, "q_lora_rank": None, "n_routed_experts": 16,
                             "n_group": 4, "topk_group": 2, "num_experts_per_tok": 4,
                             "rope_scaling": None},
    "tiny-deepseek-a128": {**_DEEPSEEK, "kv_lora_rank": 128, "qk_rope_head_dim": 16},
}


def make_deepseek_weights(cfg: dict, is_moe_layer, scales: dict, seed: int = 0):
    """Float32 tensors under DeepSeek-V3's names, torch [out, in], in a fixed draw order
    (legacy RandomState, as make_tiny). Linear weights N(0, 1/fan_in); norm weights 1 +
    N(0, 0.1^2); the query projection doubled (`scales["qk_norm"]`, as for GLM without a
    q/k norm) so that attention does not average the context away."""
    rng = np.random.RandomState(seed)
    d, v, n = cfg["hidden_size"], cfg["vocab_size"], cfg["num_attention_heads"]
    a, r, q = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], cfg["q_lora_rank"]
    h, o, f = cfg["qk_nope_head_dim"], cfg["v_head_dim"], cfg["moe_intermediate_size"]
    out: dict[str, np.ndarray] = {}

    def normal(name, shape, std):
        out[name] = (rng.standard_normal(shape) * std).astype(np.float32)

    def norm(name, size):
        out[name] = (1.0 + 0.1 * rng.standard_normal(size)).astype(np.float32)

    def linear(name, n_out, n_in, gain=1.0):
        normal(name, (n_out, n_in), gain * n_in**-0.5)

    def mlp(prefix, width):
        linear(f"{prefix}.gate_proj.weight", width, d)
        linear(f"{prefix}.up_proj.weight", width, d)
        linear(f"{prefix}.down_proj.weight", d, width)

    normal("model.embed_tokens.weight", (v, d), scales["embed"] * d**-0.5)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        norm(f"{p}.input_layernorm.weight", d)
        norm(f"{p}.post_attention_layernorm.weight", d)
        if q:
            linear(f"{p}.self_attn.q_a_proj.weight", q, d)
            norm(f"{p}.self_attn.q_a_layernorm.weight", q)
            linear(f"{p}.self_attn.q_b_proj.weight", n * (h + r), q, scales["qk_norm"])
        else:
            linear(f"{p}.self_attn.q_proj.weight", n * (h + r), d, scales["qk_norm"])
        linear(f"{p}.self_attn.kv_a_proj_with_mqa.weight", a + r, d)
        norm(f"{p}.self_attn.kv_a_layernorm.weight", a)
        linear(f"{p}.self_attn.kv_b_proj.weight", n * (h + o), a)
        linear(f"{p}.self_attn.o_proj.weight", d, n * o)
        if is_moe_layer(cfg, i):
            e = cfg["n_routed_experts"]
            normal(f"{p}.mlp.gate.weight", (e, d), scales["router"] * d**-0.5)
            for x in range(e):
                mlp(f"{p}.mlp.experts.{x}", f)
            normal(f"{p}.mlp.gate.e_score_correction_bias", (e,), 0.1)
            mlp(f"{p}.mlp.shared_experts", cfg["n_shared_experts"] * f)
        else:
            mlp(f"{p}.mlp", cfg["intermediate_size"])
    mtp = f"model.layers.{cfg['num_hidden_layers']}"  # the MTP layer, not served
    linear(f"{mtp}.eh_proj.weight", d, 2 * d)
    norm(f"{mtp}.enorm.weight", d)
    norm("model.norm.weight", d)
    normal("lm_head.weight", (v, d), scales["head"] * d**-0.5)
    return out
