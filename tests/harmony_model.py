"""A tiny GPT-OSS model directory whose tokenizer has harmony's markers as special tokens.

The tiny checkpoints' tokenizer treats `<|start|>`, `<|channel|>`, ... as plain text (its
512 ids are taken by Qwen's specials), so the harmony output parser (parsed from token
ids, lp_jax/server/harmony.py) needs this variant: tiny-gpt-oss's config, weights and chat
template, a tokenizer trained as make_tiny's with `HARMONY_TOKENS` as its special tokens,
and, as the published GPT-OSS checkpoints, `<|return|>` and `<|call|>` as the eos ids.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from checkpoints.make_tiny import HARMONY_TOKENS, build_tokenizer, ensure_tiny


def write_harmony_model_dir(out: Path) -> Path:
    src = ensure_tiny(preset="tiny-gpt-oss")
    out.mkdir(parents=True, exist_ok=True)
    for name in ("model.safetensors", "chat_template.jinja", "tokenizer_config.json"):
        shutil.copy(src / name, out / name)
    cfg = json.loads((src / "config.json").read_text())
    tok = build_tokenizer(cfg["vocab_size"], specials=HARMONY_TOKENS)
    tok.save(str(out / "tokenizer.json"))
    ret, call = tok.token_to_id("<|return|>"), tok.token_to_id("<|call|>")
    cfg["eos_token_id"] = ret
    cfg["bos_token_id"] = cfg["pad_token_id"] = tok.token_to_id(HARMONY_TOKENS[0])
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg["bos_token_id"], "eos_token_id": [ret, call],
         "pad_token_id": cfg["pad_token_id"]}))
    tc = json.loads((out / "tokenizer_config.json").read_text())
    tc.update(eos_token="<|return|>", bos_token=HARMONY_TOKENS[0], pad_token=HARMONY_TOKENS[0])
    (out / "tokenizer_config.json").write_text(json.dumps(tc, indent=2, sort_keys=True))
    return out
