"""Tiny random EAGLE-3 draft heads in the published layout (`LlamaForCausalLMEagle3`),
for a target model directory's config.

A head directory holds what the hubs ship for EAGLE-3 drafts: config.json (a one-layer
Llama config with `draft_vocab_size`, and optionally `eagle_config`'s
`eagle_aux_hidden_state_layer_ids`) and model.safetensors with

    fc.weight                                  [D, 3 D]  over three target hidden states
    midlayer.input_layernorm.weight            [D]       norms the token's embedding
    midlayer.hidden_norm.weight                [D]       norms the fc output
    midlayer.self_attn.{q,k,v}_proj.weight     [N H | K H, 2 D]   attention over 2 x hidden
    midlayer.self_attn.o_proj.weight           [D, N H]
    midlayer.post_attention_layernorm.weight   [D]
    midlayer.mlp.{gate,up}_proj.weight         [F, D], down_proj [D, F]
    norm.weight                                [D]
    lm_head.weight                             [draft V, D]
    d2t                                        [draft V] int64: target id - draft id
    t2d                                        [V] bool: target ids in the draft vocabulary
    embed_tokens.weight                        [V, D], only with `embed=True`

Weights come from the legacy `np.random.RandomState` (a stream NumPy keeps fixed). The
draft vocabulary is a random sorted subset of the target's, as a trained head's is its
most frequent tokens. Like make_tiny, this module imports only numpy and safetensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def eagle3_config(target: dict, *, draft_vocab_size: int, aux_layer_ids=None,
                  intermediate_size: int = 96) -> dict:
    """The head's config.json for a target config dict: the target's hidden size,
    heads, KV heads and head_dim (the draft's KV shares the target's pool layout)."""
    D = target["hidden_size"]
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": D, "intermediate_size": intermediate_size, "num_hidden_layers": 1,
        "num_attention_heads": target["num_attention_heads"],
        "num_key_value_heads": target["num_key_value_heads"],
        "head_dim": target.get("head_dim", D // target["num_attention_heads"]),
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "rope_scaling": None, "max_position_embeddings": target["max_position_embeddings"],
        "tie_word_embeddings": False, "torch_dtype": "float32",
        "vocab_size": target["vocab_size"], "draft_vocab_size": draft_vocab_size,
    }
    if aux_layer_ids is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids),
                               "use_aux_hidden_state": True}
    return cfg


def make_eagle3_weights(cfg: dict, seed: int = 0, *, embed: bool = False
                        ) -> dict[str, np.ndarray]:
    """The head's tensors under the published names (see the module docstring)."""
    rng = np.random.RandomState(seed)
    D, F, H = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    N, K = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    V, Vd = cfg["vocab_size"], cfg["draft_vocab_size"]
    out: dict[str, np.ndarray] = {}

    def linear(name, n_out, n_in):
        out[name] = (rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(np.float32)

    def norm(name):
        out[name] = (1.0 + 0.1 * rng.standard_normal(D)).astype(np.float32)

    linear("fc.weight", D, 3 * D)
    norm("midlayer.input_layernorm.weight")
    norm("midlayer.hidden_norm.weight")
    linear("midlayer.self_attn.q_proj.weight", N * H, 2 * D)
    linear("midlayer.self_attn.k_proj.weight", K * H, 2 * D)
    linear("midlayer.self_attn.v_proj.weight", K * H, 2 * D)
    linear("midlayer.self_attn.o_proj.weight", D, N * H)
    norm("midlayer.post_attention_layernorm.weight")
    linear("midlayer.mlp.gate_proj.weight", F, D)
    linear("midlayer.mlp.up_proj.weight", F, D)
    linear("midlayer.mlp.down_proj.weight", D, F)
    norm("norm.weight")
    linear("lm_head.weight", Vd, D)
    draft_ids = np.sort(rng.choice(V, size=Vd, replace=False))
    out["d2t"] = (draft_ids - np.arange(Vd)).astype(np.int64)
    t2d = np.zeros(V, np.bool_)
    t2d[draft_ids] = True
    out["t2d"] = t2d
    if embed:
        out["embed_tokens.weight"] = rng.standard_normal((V, D)).astype(np.float32)
    return out


def write_eagle3_dir(out_dir, target_dir, *, draft_vocab_size: int = 128, seed: int = 0,
                     aux_layer_ids=None, embed: bool = False) -> Path:
    """Writes a random head for the model in `target_dir` into `out_dir`."""
    from safetensors.numpy import save_file

    target = json.loads((Path(target_dir) / "config.json").read_text())
    cfg = eagle3_config(target, draft_vocab_size=draft_vocab_size,
                        aux_layer_ids=aux_layer_ids)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    save_file(make_eagle3_weights(cfg, seed, embed=embed), str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out
