"""Deterministic tiny Qwen3 / Qwen3-MoE / GPT-OSS checkpoints in the Hugging Face layout.

A preset becomes a model directory that `transformers.AutoModelForCausalLM` loads as is:
config.json, model.safetensors (or two shards plus an index), tokenizer.json,
tokenizer_config.json and generation_config.json. The engine's loader tests and the golden
outputs in tests/golden/ are made from these directories, so the bytes must not drift:

- Weights come from the legacy `np.random.RandomState`, whose stream NumPy keeps fixed
  across versions (`default_rng` makes no such promise), drawn tensor by tensor in a fixed
  order. The golden script runs under another venv with another NumPy, so this matters.
- The byte-level BPE tokenizer is trained here on the small embedded corpus below, with
  the trainer's thread pool switched off.
- This module imports only numpy, safetensors and tokenizers and runs on Python 3.11,
  because tests/golden/make_golden.py loads it inside the transformers reference venv.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from lp_jax.paths import models_dir

HERE = Path(__file__).resolve().parent


def _sibling(name: str):
    """A module beside this one, imported from the package (a checkout's `checkpoints`,
    the wheel's `lp_jax.checkpoints`) or, when this file is loaded by path
    (tests/golden/make_golden.py), by path too. No import statement names the package,
    so the wheel's build (setup.py) leaves this file's bytes, and with them the demo
    model's stamp (train_demo._stamp), as the checkout has them."""
    if __package__:
        return importlib.import_module(f"{__package__}.{name}")
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_deepseek = _sibling("make_tiny_deepseek")
DEEPSEEK_PRESETS = _deepseek.DEEPSEEK_PRESETS
make_deepseek_weights = _deepseek.make_deepseek_weights
STAMP_FILE = ".make_tiny_stamp"

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)  # appended after the BPE vocab, as in Qwen
# GPT-OSS harmony's markers (o200k_harmony's names). The tiny checkpoints keep the
# tokenizer above, to which they are plain text; `build_tokenizer(specials=HARMONY_TOKENS)`
# makes the variant in which they are special tokens, as in the real tokenizer (tests of
# the harmony output parser, lp_jax/server/harmony.py).
HARMONY_TOKENS = (ENDOFTEXT, "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
                  "<|constrain|>", "<|return|>", "<|call|>")

# Fields every preset shares. Expert fields are dropped for model_type "qwen3".
_SHARED = {
    "attention_bias": False,
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    # 512: the engine's defaults size programs to the context, and no test prompt of the
    # tiny models comes near it (longer contexts are set per test with max_model_len).
    "max_position_embeddings": 512,
    "output_router_logits": False,
    "rms_norm_eps": 1e-6,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "torch_dtype": "float32",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 512,
}

_TINY = {
    "model_type": "qwen3_moe",
    "hidden_size": 64,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 32,
    "intermediate_size": 128,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "tie_word_embeddings": False,
}

PRESETS: dict[str, dict] = {
    "tiny": dict(_TINY),
    # Layer 1 is a dense MLP inside an MoE model; top-k weights are not renormalized.
    "tiny-mlp-only": {
        **_TINY,
        "num_hidden_layers": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "mlp_only_layers": [1],
        "norm_topk_prob": False,
    },
    # Every second layer is MoE (layers 1 and 3); one KV head serves four query heads.
    "tiny-tied": {
        **_TINY,
        "num_hidden_layers": 4,
        "tie_word_embeddings": True,
        "decoder_sparse_step": 2,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "num_key_value_heads": 1,
    },
    "tiny-dense": {**_TINY, "model_type": "qwen3", "num_hidden_layers": 4},
    # TPU-shaped attention (head_dim 128, lane-aligned) with GQA 4, for the Pallas TPU
    # attention kernel end to end.
    "tiny-h128": {**_TINY, "num_hidden_layers": 4, "head_dim": 128, "num_attention_heads": 8},
}

# GPT-OSS (GptOssForCausalLM): 4 layers alternating sliding (window 8, shorter than the
# 17- and 40-token golden prompts) and full attention, sinks, biases everywhere, YaRN as in
# gpt-oss-20b, 8 experts top-2. swiglu_limit 1.5 (20b: 7.0) so the clamp of the SwiGLU
# really cuts values at this scale. Kept apart from PRESETS, whose tests assume Qwen3.
_GPT_OSS = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "attention_bias": True,
    "attention_dropout": 0.0,
    "head_dim": 16,
    "hidden_act": "silu",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 32,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "max_position_embeddings": 4096,
    "num_attention_heads": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 4,
    "num_key_value_heads": 2,
    "num_local_experts": 8,
    "output_router_logits": False,
    "rms_norm_eps": 1e-5,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                     "original_max_position_embeddings": 4096, "rope_type": "yarn",
                     "truncate": False},
    "rope_theta": 150000.0,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 8,
    "swiglu_limit": 1.5,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "use_cache": True,
    "vocab_size": 512,
}

GPT_OSS_PRESETS: dict[str, dict] = {
    "tiny-gpt-oss": dict(_GPT_OSS),
    # The same model with its experts stored as MXFP4 blocks and scales, as the published
    # checkpoints are (weights drawn on the FP4 grid; see make_weights).
    "tiny-gpt-oss-mxfp4": {**_GPT_OSS, "quantization_config": {
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"],
        "quant_method": "mxfp4"}},
}
# GLM-4.5 (Glm4MoeForCausalLM) in the hubs' dialect: top-level rope_theta and
# partial_rotary_factor, n_routed_experts, e_score_correction_bias tensors, one MTP layer
# past num_hidden_layers (which lp_jax skips). Layer 0 dense; q/k/v biases; sigmoid
# routing scaled by 2.5 with one shared expert. "tiny-glm-groups": no QK norm, 16
# experts in 4 groups of which 2 are eligible, top-4.
_GLM = {
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
    "attention_bias": True, "attention_dropout": 0.0, "first_k_dense_replace": 1,
    "head_dim": 16, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
    "intermediate_size": 128, "max_position_embeddings": 512, "moe_intermediate_size": 32,
    "n_group": 1, "n_routed_experts": 8, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 4, "num_experts_per_tok": 2, "num_hidden_layers": 4,
    "num_key_value_heads": 2, "num_nextn_predict_layers": 1, "partial_rotary_factor": 0.5,
    "rms_norm_eps": 1e-5, "rope_scaling": None, "rope_theta": 1000000.0,
    "routed_scaling_factor": 2.5, "tie_word_embeddings": False, "topk_group": 1,
    "torch_dtype": "float32", "use_cache": True, "use_qk_norm": True, "vocab_size": 512,
}
GLM_PRESETS: dict[str, dict] = {
    "tiny-glm": dict(_GLM),
    "tiny-glm-groups": {**_GLM, "use_qk_norm": False, "n_routed_experts": 16, "n_group": 4,
                        "topk_group": 2, "num_experts_per_tok": 4},
}
ALL_PRESETS = {**PRESETS, **GPT_OSS_PRESETS, **GLM_PRESETS, **DEEPSEEK_PRESETS}

_EXPERT_KEYS = (
    "decoder_sparse_step",
    "mlp_only_layers",
    "moe_intermediate_size",
    "norm_topk_prob",
    "num_experts",
    "num_experts_per_tok",
    "output_router_logits",
    "router_aux_loss_coef",
)

CORPUS = (
    "A language model server spends most of its day waiting for memory. Each request "
    "arrives as a short prompt, the prompt is split into tokens, and the tokens are pushed "
    "through every layer of the network at once. That first pass is called prefill. After "
    "it, the server produces one new token per step for each request, reading the whole "
    "key and value cache again and again. This second phase is called decode, and it is "
    "limited by how fast the cache can be read rather than by arithmetic.",
    "Mixture of experts models make the picture more interesting. A small router looks at "
    "every token and picks a few experts out of many, so only a slice of the weights is "
    "used for any one token. When thousands of tokens share a batch, almost every expert "
    "is busy; when a single token is decoded, most experts sit idle. A good scheduler "
    "groups the layers, mixes prefill and decode work, and keeps the accelerator fed.",
    "The weather this week has been strange. Monday began with fog so thick that the "
    "harbour lights looked like candles, then the wind turned and blew the clouds out to "
    "sea. By Wednesday the sky was clear and cold, and the puddles froze at night. The "
    "forecast promises rain on Friday, warm air from the south on Saturday, and a storm "
    "that may or may not arrive before Sunday evening.",
    "To cook a simple soup, slice two onions and let them soften in butter over a low "
    "flame. Add a few carrots, a potato cut into cubes, a bay leaf and enough water to "
    "cover everything. Simmer for twenty minutes, season with salt and black pepper, and "
    "blend until smooth. A spoon of cream and some fresh bread turn it into dinner.",
    "Questions and answers make good test data. What time is it? It is a quarter past "
    "seven. How many tokens fit in a page of the cache? Sixteen, in this small model. "
    "Why do we check the outputs against a reference? Because a serving engine that is "
    "fast but wrong is not useful to anyone, and small numbers are easy to compare.",
    "Numbers and symbols: 0 1 2 3 4 5 6 7 8 9, 10, 42, 128, 2048, 3.14; (a + b) * c = d; "
    "user@example.com; path/to/file.txt; 50% off, $12.99, #tag, x_y-z!",
)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# GPT-OSS's "harmony" format, written here from the format's description: each message is
# <|start|>{role}<|message|>{content}<|end|>, an assistant turn names its channel
# (<|start|>assistant<|channel|>final<|message|>...), a reply is prompted by
# <|start|>assistant and a finished one ends with <|return|>. System and developer messages
# become the developer message's instructions; the system message states the identity,
# knowledge cutoff, today's date, reasoning effort and channels. It uses the constructs of
# the published template (macro, namespace, loop.last, strftime_now, raise_exception,
# tojson, str.startswith, trim) but not its text: real checkpoints ship their own.
# Tools (issue #32): the developer message lists the request's functions (a `# Tools`
# section, each function's JSON schema as written), the system message sends their calls
# to the commentary channel; an assistant message's calls are
# <|start|>assistant<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>
# {arguments}<|call|> (after its reasoning on the analysis channel, if it has any), and a
# tool's answer is <|start|>functions.{name} to=assistant<|channel|>commentary<|message|>
# {content}<|end|>, named by its tool_call_id (else its `name`, else the last call).
# Without tools the rendering is as before.
# The tiny tokenizer's 512 ids are taken, so the markers are plain text to it.
HARMONY_TEMPLATE = (
    "{%- macro turn(header, body, end='<|end|>') %}"
    "{{- '<|start|>' ~ header ~ '<|message|>' ~ body ~ end }}"
    "{%- endmacro %}\n"
    "{%- set ns = namespace(instructions='', conversation=false, tools='', last_call='',"
    " tool='') %}\n"
    "{%- for message in messages %}\n"
    "  {%- if message.role in ['system', 'developer'] %}\n"
    "    {%- if ns.conversation %}"
    "{{- raise_exception('system and developer messages must come first') }}{%- endif %}\n"
    "    {%- set text = message.content | trim %}\n"
    "    {%- set ns.instructions = ns.instructions ~ '\\n\\n' ~ text "
    "if ns.instructions else text %}\n"
    "  {%- else %}{%- set ns.conversation = true %}{%- endif %}\n"
    "{%- endfor %}\n"
    "{{- turn('system', (model_identity | default('You are a helpful assistant.'))"
    " ~ '\\nKnowledge cutoff: 2024-06\\nCurrent date: ' ~ strftime_now('%Y-%m-%d')"
    " ~ '\\n\\nReasoning: ' ~ (reasoning_effort | default('medium'))"
    " ~ '\\n\\n# Valid channels: analysis, commentary, final. Every assistant message"
    " names one.' ~ ('\\nCalls to these tools must go to the commentary channel:"
    " \\'functions\\'.' if tools else '')) }}\n"
    "{%- if tools %}\n"
    "  {%- set ns.tools = '# Tools\\n\\n## functions\\n\\nnamespace functions {\\n\\n' %}\n"
    "  {%- for t in tools %}\n"
    "    {%- set f = t.function %}\n"
    "    {%- set ns.tools = ns.tools ~ ('// ' ~ f.description ~ '\\n' if f.description else '')"
    " ~ 'type ' ~ f.name ~ ' = (_: ' ~ (f.parameters | default({'type': 'object'}) | tojson)"
    " ~ ') => any;\\n\\n' %}\n"
    "  {%- endfor %}\n"
    "  {%- set ns.tools = ns.tools ~ '} // namespace functions' %}\n"
    "{%- endif %}\n"
    "{%- if ns.instructions or ns.tools %}\n"
    "  {%- set header = '' if ns.instructions.startswith('# Instructions')"
    " else '# Instructions\\n\\n' %}\n"
    "  {%- set body = header ~ ns.instructions if ns.instructions else '' %}\n"
    "  {{- turn('developer', body ~ ('\\n\\n' if body and ns.tools else '') ~ ns.tools) }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "  {%- if message.role == 'user' %}{{- turn('user', message.content) }}\n"
    "  {%- elif message.role == 'assistant' and message.tool_calls %}\n"
    "    {%- if message.reasoning_content %}"
    "{{- turn('assistant<|channel|>analysis', message.reasoning_content | trim) }}{%- endif %}\n"
    "    {%- if message.content | trim %}"
    "{{- turn('assistant<|channel|>commentary', message.content | trim) }}{%- endif %}\n"
    "    {%- for call in message.tool_calls %}\n"
    "      {%- set args = call.function.arguments %}\n"
    "      {{- turn('assistant<|channel|>commentary to=functions.' ~ call.function.name"
    " ~ ' <|constrain|>json', args if args is string else args | tojson, '<|call|>') }}\n"
    "      {%- set ns.last_call = call.function.name %}\n"
    "    {%- endfor %}\n"
    "  {%- elif message.role == 'assistant' %}\n"
    "    {%- set end = '<|return|>' if loop.last and not add_generation_prompt else '<|end|>' %}\n"
    "    {{- turn('assistant<|channel|>final', message.content | trim, end) }}\n"
    "  {%- elif message.role == 'tool' %}\n"
    "    {%- set ns.tool = message.name or ns.last_call %}\n"
    "    {%- for m in messages %}{%- for c in m.tool_calls or [] %}"
    "{%- if message.tool_call_id and c.id == message.tool_call_id %}"
    "{%- set ns.tool = c.function.name %}{%- endif %}{%- endfor %}{%- endfor %}\n"
    "    {%- if not ns.tool %}{{- raise_exception('role \"tool\" is not supported here: a"
    " tool message must answer an assistant tool call') }}{%- endif %}\n"
    "    {{- turn('functions.' ~ ns.tool ~ ' to=assistant<|channel|>commentary',"
    " message.content) }}\n"
    "  {%- elif message.role not in ['system', 'developer'] %}\n"
    "    {{- raise_exception('role ' ~ message.role | tojson ~ ' is not supported') }}\n"
    "  {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}\n"
)


def build_config(preset: str = "tiny") -> dict:
    """The Hugging Face config.json contents for a preset."""
    if preset not in ALL_PRESETS:
        raise KeyError(f"unknown preset {preset!r}; choose from {sorted(ALL_PRESETS)}")
    if preset in GPT_OSS_PRESETS or preset in GLM_PRESETS or preset in DEEPSEEK_PRESETS:
        cfg = dict(ALL_PRESETS[preset])
        vocab = cfg["vocab_size"]
        cfg["bos_token_id"] = cfg["pad_token_id"] = special_token_id(vocab, ENDOFTEXT)
        cfg["eos_token_id"] = special_token_id(vocab, IM_END)
        return dict(sorted(cfg.items()))
    cfg = {**_SHARED, **PRESETS[preset]}
    cfg["max_window_layers"] = cfg["num_hidden_layers"]
    vocab = cfg["vocab_size"]
    cfg["bos_token_id"] = special_token_id(vocab, ENDOFTEXT)
    cfg["eos_token_id"] = special_token_id(vocab, IM_END)
    if cfg["model_type"] == "qwen3":
        cfg["architectures"] = ["Qwen3ForCausalLM"]
        for key in _EXPERT_KEYS:
            cfg.pop(key, None)
    else:
        cfg["architectures"] = ["Qwen3MoeForCausalLM"]
    return dict(sorted(cfg.items()))


def special_token_id(vocab_size: int, token: str) -> int:
    return vocab_size - len(SPECIAL_TOKENS) + SPECIAL_TOKENS.index(token)


def is_moe_layer(cfg: dict, i: int) -> bool:
    """The rule of transformers' Qwen3MoeDecoderLayer (and Glm4MoeDecoderLayer's)."""
    return (
        cfg.get("num_experts", cfg.get("n_routed_experts", 0)) > 0
        and i >= cfg.get("first_k_dense_replace", 0)
        and i not in cfg.get("mlp_only_layers", [])
        and (i + 1) % cfg.get("decoder_sparse_step", 1) == 0
    )


# Gains found by a small scan with transformers so that random weights do not collapse into
# one repeated greedy token. embed, router and head multiply 1/sqrt(hidden_size): embedding
# rows of norm ~2 sit beside sublayer outputs of norm ~sqrt(hidden_size), so a tied head does
# not just echo the input token; router and vocab logits come out ~ N(0, 4), which keeps
# top-k and argmax choices clear of near-ties. qk_norm is the mean of the q/k norm weights:
# 2 sharpens attention enough that it does not average the context into a fixed point.
SCALES = {"embed": 2.0, "router": 2.0, "head": 2.0, "qk_norm": 2.0}


def make_weights(cfg: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Float32 tensors under the HF names, torch [out, in] layout, in a fixed draw order.

    Linear weights are N(0, 1/fan_in), so activations keep their scale through a layer;
    norm weights are their mean plus N(0, 0.1^2) noise, so a misapplied norm shows.
    """
    if cfg["model_type"] == "gpt_oss":
        return make_gpt_oss_weights(cfg, seed)
    if cfg["model_type"] == "deepseek_v3":
        return make_deepseek_weights(cfg, is_moe_layer, SCALES, seed)
    rng = np.random.RandomState(seed)
    d, v = cfg["hidden_size"], cfg["vocab_size"]
    h, n, k = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    out: dict[str, np.ndarray] = {}

    def normal(name: str, shape: tuple[int, ...], std: float) -> None:
        out[name] = (rng.standard_normal(shape) * std).astype(np.float32)

    def norm(name: str, size: int, mean: float = 1.0) -> None:
        out[name] = (mean + 0.1 * rng.standard_normal(size)).astype(np.float32)

    def linear(name: str, n_out: int, n_in: int) -> None:
        normal(name, (n_out, n_in), n_in**-0.5)

    def mlp(prefix: str, width: int) -> None:
        linear(f"{prefix}.gate_proj.weight", width, d)
        linear(f"{prefix}.up_proj.weight", width, d)
        linear(f"{prefix}.down_proj.weight", d, width)

    glm = cfg["model_type"] == "glm4_moe"  # GLM: biases, optional qk norm, shared experts
    n_experts = cfg.get("n_routed_experts", cfg.get("num_experts"))
    normal("model.embed_tokens.weight", (v, d), SCALES["embed"] * d**-0.5)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        norm(f"{p}.input_layernorm.weight", d)
        norm(f"{p}.post_attention_layernorm.weight", d)
        qk_norm = cfg.get("use_qk_norm", True)
        linear(f"{p}.self_attn.q_proj.weight", n * h, d)
        if not qk_norm:  # sharpen attention as the q norm's gain does
            out[f"{p}.self_attn.q_proj.weight"] *= SCALES["qk_norm"]
        linear(f"{p}.self_attn.k_proj.weight", k * h, d)
        linear(f"{p}.self_attn.v_proj.weight", k * h, d)
        linear(f"{p}.self_attn.o_proj.weight", d, n * h)
        for name, width in (("q_proj", n * h), ("k_proj", k * h), ("v_proj", k * h)):
            if cfg.get("attention_bias"):
                normal(f"{p}.self_attn.{name}.bias", (width,), 0.1)
        if qk_norm:
            norm(f"{p}.self_attn.q_norm.weight", h, SCALES["qk_norm"])
            norm(f"{p}.self_attn.k_norm.weight", h, SCALES["qk_norm"])
        if is_moe_layer(cfg, i):
            normal(f"{p}.mlp.gate.weight", (n_experts, d), SCALES["router"] * d**-0.5)
            for e in range(n_experts):
                mlp(f"{p}.mlp.experts.{e}", cfg["moe_intermediate_size"])
            if glm:  # biases of a sigmoid score's scale: they change choices
                normal(f"{p}.mlp.gate.e_score_correction_bias", (n_experts,), 0.1)
                shared = cfg["n_shared_experts"] * cfg["moe_intermediate_size"]
                mlp(f"{p}.mlp.shared_experts", shared)
        else:
            mlp(f"{p}.mlp", cfg["intermediate_size"])
    if glm:  # the next-token (MTP) layer's own tensors, which lp_jax does not read
        mtp = f"model.layers.{cfg['num_hidden_layers']}"
        linear(f"{mtp}.eh_proj.weight", d, 2 * d)
        norm(f"{mtp}.enorm.weight", d)
    norm("model.norm.weight", d)
    if not cfg["tie_word_embeddings"]:
        normal("lm_head.weight", (v, d), SCALES["head"] * d**-0.5)
    return out


FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def _mxfp4(rng: np.random.RandomState, e: int, n_out: int, n_in: int, std: float):
    """Random MXFP4 blocks [e, n_out, n_in/32, 16] and scales [e, n_out, n_in/32] with
    values of about `std`: uniform nibbles (rms 2.9) and exponents from two powers of 2."""
    g = n_in // 32
    blocks = rng.randint(0, 256, (e, n_out, g, 16)).astype(np.uint8)
    exp = int(np.floor(np.log2(std / 2.9)))
    scales = (127 + exp + rng.randint(0, 2, (e, n_out, g))).astype(np.uint8)
    return blocks, scales


def make_gpt_oss_weights(cfg: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """GPT-OSS tensors under the checkpoint's names: linear layers [out, in], experts
    [E, in, out] with gate/up columns interleaved, or, with an MXFP4 quantization_config,
    expert `*_blocks` / `*_scales` (see `_mxfp4`). Biases N(0, 0.1^2) (router 0.5^2),
    sinks N(0, 1) so they take a visible share of attention, q_proj doubled (no q/k norm
    here to sharpen attention)."""
    rng = np.random.RandomState(seed)
    d, v = cfg["hidden_size"], cfg["vocab_size"]
    h, n, k = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    e, f = cfg["num_local_experts"], cfg["intermediate_size"]
    mxfp4 = cfg.get("quantization_config", {}).get("quant_method") == "mxfp4"
    out: dict[str, np.ndarray] = {}

    def normal(name: str, shape: tuple[int, ...], std: float) -> None:
        out[name] = (rng.standard_normal(shape) * std).astype(np.float32)

    normal("model.embed_tokens.weight", (v, d), SCALES["embed"] * d**-0.5)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{p}.{norm}.weight"] = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
        for name, n_out, n_in, gain in (("q_proj", n * h, d, SCALES["qk_norm"]),
                                        ("k_proj", k * h, d, 1.0), ("v_proj", k * h, d, 1.0),
                                        ("o_proj", d, n * h, 1.0)):
            normal(f"{p}.self_attn.{name}.weight", (n_out, n_in), gain * n_in**-0.5)
            normal(f"{p}.self_attn.{name}.bias", (n_out,), 0.1)
        normal(f"{p}.self_attn.sinks", (n,), 1.0)
        normal(f"{p}.mlp.router.weight", (e, d), SCALES["router"] * d**-0.5)
        normal(f"{p}.mlp.router.bias", (e,), 0.5)
        x = f"{p}.mlp.experts"
        if mxfp4:
            for name, n_out, n_in in (("gate_up_proj", 2 * f, d), ("down_proj", d, f)):
                blocks, scales = _mxfp4(rng, e, n_out, n_in, n_in**-0.5)
                out[f"{x}.{name}_blocks"], out[f"{x}.{name}_scales"] = blocks, scales
        else:
            normal(f"{x}.gate_up_proj", (e, d, 2 * f), d**-0.5)
            normal(f"{x}.down_proj", (e, f, d), f**-0.5)
        normal(f"{x}.gate_up_proj_bias", (e, 2 * f), 0.1)
        normal(f"{x}.down_proj_bias", (e, d), 0.1)
    out["model.norm.weight"] = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    normal("lm_head.weight", (v, d), SCALES["head"] * d**-0.5)
    return out


@contextlib.contextmanager
def _serial_tokenizers():
    """Run the tokenizers library without its thread pool for the duration."""
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old


def build_tokenizer(vocab_size: int = 512, corpus: tuple[str, ...] | None = None,
                    specials: tuple[str, ...] = SPECIAL_TOKENS):
    """A byte-level BPE tokenizer with exactly vocab_size ids, `specials` last (special
    tokens, in that order), trained on `corpus` (default: CORPUS above;
    checkpoints/train_demo.py passes its own text)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.trainers import BpeTrainer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = BpeTrainer(
        vocab_size=vocab_size - len(specials),
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    with _serial_tokenizers():
        tok.train_from_iterator(list(CORPUS if corpus is None else corpus), trainer=trainer)
        tok.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t in specials]
        )
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"trained {tok.get_vocab_size()} ids, wanted {vocab_size}")
    for i, t in enumerate(specials):
        assert tok.token_to_id(t) == vocab_size - len(specials) + i, t
    return tok


def _dump_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _write_weights(out: Path, tensors: dict[str, np.ndarray], cfg: dict, sharded: bool) -> None:
    from safetensors.numpy import save_file

    meta = {"format": "pt"}
    if not sharded:
        save_file(tensors, str(out / "model.safetensors"), metadata=meta)
        return
    half = cfg["num_hidden_layers"] // 2

    def shard_of(name: str) -> int:
        if name.startswith("model.layers."):
            return 0 if int(name.split(".")[2]) < half else 1
        return 0 if name == "model.embed_tokens.weight" else 1

    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    weight_map = {}
    for s, fname in enumerate(files):
        part = {n: t for n, t in tensors.items() if shard_of(n) == s}
        save_file(part, str(out / fname), metadata=meta)
        weight_map.update({n: fname for n in part})
    total = sum(t.nbytes for t in tensors.values())
    _dump_json(
        out / "model.safetensors.index.json",
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
    )


def write_model_dir(
    out_dir: str | os.PathLike,
    preset: str = "tiny",
    *,
    write_sharded: bool = False,
    seed: int = 0,
) -> Path:
    """Write a complete model directory for `preset` into out_dir (created if needed)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("*.safetensors"), out / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)  # no shards left over from another layout
    cfg = build_config(preset)
    vocab = cfg["vocab_size"]
    _dump_json(out / "config.json", cfg)
    _write_weights(out, make_weights(cfg, seed), cfg, write_sharded)
    build_tokenizer(vocab).save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "add_bos_token": False,
        "bos_token": ENDOFTEXT,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "model_max_length": cfg["max_position_embeddings"],
        "pad_token": ENDOFTEXT,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if preset in GPT_OSS_PRESETS:  # as the published checkpoints: a chat_template.jinja file
        del tokenizer_config["chat_template"]
        (out / "chat_template.jinja").write_text(HARMONY_TEMPLATE)
    _dump_json(out / "tokenizer_config.json", tokenizer_config)
    _dump_json(
        out / "generation_config.json",
        {
            "bos_token_id": cfg["bos_token_id"],
            "do_sample": False,
            # As in Qwen3: stop on <|im_end|> or <|endoftext|>.
            "eos_token_id": [cfg["eos_token_id"], cfg["bos_token_id"]],
            "pad_token_id": cfg["bos_token_id"],
        },
    )
    (out / STAMP_FILE).write_text(_stamp(preset, write_sharded, seed) + "\n")
    return out


def write_harmony_variant(out_dir: str | os.PathLike) -> Path:
    """tiny-gpt-oss with harmony's markers as special tokens, in out_dir: the preset's
    config, weights and chat template, a tokenizer trained as `build_tokenizer`'s with
    HARMONY_TOKENS as its specials (so the ids differ from the preset's), and, as the
    published GPT-OSS checkpoints, `<|return|>` and `<|call|>` as the eos ids. For the
    harmony output parser's tests and checks (parsed from token ids)."""
    src, out = ensure_tiny(preset="tiny-gpt-oss"), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("model.safetensors", "chat_template.jinja"):
        shutil.copy(src / name, out / name)
    cfg = json.loads((src / "config.json").read_text())
    tok = build_tokenizer(cfg["vocab_size"], specials=HARMONY_TOKENS)
    tok.save(str(out / "tokenizer.json"))
    ret, call, pad = (tok.token_to_id(t) for t in ("<|return|>", "<|call|>", ENDOFTEXT))
    cfg.update(eos_token_id=ret, bos_token_id=pad, pad_token_id=pad)
    _dump_json(out / "config.json", cfg)
    _dump_json(out / "generation_config.json",
               {"bos_token_id": pad, "eos_token_id": [ret, call], "pad_token_id": pad})
    tc = json.loads((src / "tokenizer_config.json").read_text())
    tc.update(eos_token="<|return|>", bos_token=ENDOFTEXT, pad_token=ENDOFTEXT)
    _dump_json(out / "tokenizer_config.json", tc)
    return out


def _stamp(preset: str, sharded: bool, seed: int) -> str:
    """Changes whenever this generator's source changes, so stale caches get rebuilt."""
    src = hashlib.sha256(Path(__file__).read_bytes()
                         + (HERE / "make_tiny_deepseek.py").read_bytes()).hexdigest()[:16]
    return f"{preset} sharded={sharded} seed={seed} src={src}"


def ensure_tiny(out_dir: str | os.PathLike | None = None, preset: str = "tiny") -> Path:
    """Path to the preset's model directory, generating it first if absent or stale.

    Defaults to <lp_jax's cache>/models/<preset>/ (lp_jax/paths.py). The directory is built beside
    the target and renamed into place, so concurrent callers never see half a model.
    """
    out = Path(out_dir) if out_dir is not None else models_dir() / preset
    stamp = out / STAMP_FILE
    want = _stamp(preset, False, 0)
    if stamp.exists() and stamp.read_text().strip() == want:
        return out
    if out.exists():
        if not stamp.exists():
            raise FileExistsError(f"{out} exists and was not made by make_tiny")
        shutil.rmtree(out)  # a stale build of ours
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        write_model_dir(tmp, preset)
        tmp.chmod(0o755)  # mkdtemp makes it owner-only
        os.rename(tmp, out)
    except OSError:
        if not (stamp.exists() and stamp.read_text().strip() == want):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def weights_digest(model_dir: str | os.PathLike) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes, independent of sharding."""
    from safetensors.numpy import load_file

    tensors: dict[str, np.ndarray] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = np.ascontiguousarray(tensors[name])
        h.update(f"{name}|{t.dtype.str}|{list(t.shape)}|".encode())
        h.update(t.tobytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny", choices=sorted(ALL_PRESETS))
    ap.add_argument("--out", help="target directory (default: <lp_jax's cache>/models/<preset>)")
    ap.add_argument("--sharded", action="store_true", help="two shards plus an index")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.out is None and not args.sharded and args.seed == 0:
        path = ensure_tiny(preset=args.preset)
    else:
        out = args.out or models_dir() / args.preset
        path = write_model_dir(out, args.preset, write_sharded=args.sharded, seed=args.seed)
    print(path)


if __name__ == "__main__":
    main()
