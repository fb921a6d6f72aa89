"""Which tool-call format a model writes, chosen in one place for the chat path.

Two text formats share the `<tool_call>` marker: Qwen3's (a JSON object per block,
tools.py) and GLM-4.5's (a name and `<arg_key>` / `<arg_value>` pairs, glm45_tools.py).
GPT-OSS harmony's calls are special tokens, parsed from token ids (harmony.py); the
server decides harmony from the tokenizer before it looks here.

`detect` picks the format from the model: GLM-4.5 / 4.6 checkpoints (config.json's
`model_type` "glm4_moe" or a `Glm4Moe*` architecture) and any chat template that writes
`<arg_key>` (GLM's own, given with --chat-template to another model) get "glm45"; every
other model Qwen3's. `OpenAIServer(tool_call_parser=...)` overrides it. `parser` and
`grammar` then give the format's response parser (streamed or whole, auto or forced) and
its forced-call grammar (tool_choice "required" or a named function).
"""

from __future__ import annotations

import json
from pathlib import Path

from lp_jax.server import glm45_tools, tools

FORMATS = ("qwen3", "glm45")


def detect(model_dir, template: str | None) -> str:
    """The tool-call format of the model in `model_dir`, whose chat template is `template`."""
    if template and "<arg_key>" in template:
        return "glm45"
    cfg_path = Path(model_dir) / "config.json" if model_dir else None
    if cfg_path is not None and cfg_path.is_file():
        cfg = json.loads(cfg_path.read_text())
        archs = cfg.get("architectures") or []
        if cfg.get("model_type") == "glm4_moe" or any(str(a).startswith("Glm4Moe")
                                                      for a in archs):
            return "glm45"
    return "qwen3"


def parser(fmt: str, forced: bool, parallel: bool, stream: bool, request_tools: list):
    """A response parser of the format (push / finish / whole_calls / calls)."""
    if fmt == "glm45":
        return glm45_tools.Glm45ToolCallParser(forced, parallel, stream, tools=request_tools)
    return tools.ToolCallParser(forced, parallel, stream)


def grammar(fmt: str, request_tools: list, choice, parallel: bool):
    """The format's grammar forcing a call (None for "auto" / "none"); a ToolsError
    naming the field for a schema the format's grammar cannot express."""
    if fmt == "glm45":
        return glm45_tools.tool_grammar(request_tools, choice, parallel)
    return tools.tool_grammar(request_tools, choice, parallel)


def split(new_parser, text: str) -> tuple[str | None, list[dict]]:
    """A whole answer, read by a fresh parser, as (content or None when only calls, the
    calls as a message's `tool_calls`)."""
    return tools.read_whole(new_parser(), text)
