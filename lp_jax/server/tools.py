"""Tool calling, Qwen3's way: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks.

Requests: `tools` (OpenAI's function tools, rendered by the model's chat template),
`tool_choice` ("none", "auto", "required" or {"type": "function", "function": {"name"}})
and `parallel_tool_calls` (`parse_tools`). "required" and a named function are enforced
with the grammar engine (`tool_grammar`: a Lark grammar of `<tool_call>` blocks around
each function's JSON schema, lp_jax/structured), so the call is well-formed; "auto" lets
the model choose and parses what it wrote. "none" parses nothing.

Responses: `ToolCallParser` takes a choice's text (whole or streamed) and returns the
content outside the blocks and each complete call as OpenAI's `tool_calls` entry, with
`arguments` as a JSON string. A block whose body is not a JSON object with a string
`name` stays content; so does an unterminated block at the end, so a malformed answer
degrades to plain content, never an error. Streamed, a call goes out in one delta once its
block closes (index, id, name and the whole arguments string), and content waits while
a block is open.

The markers are plain text in Qwen3's tokenizer (added, not special), so the split reads
the detokenized text. GPT-OSS harmony's function calls (commentary channel, special
tokens) need token ids and are not parsed here.
"""

from __future__ import annotations

import json
import uuid

from lp_jax.server.reasoning import marker_prefix
from lp_jax.structured.params import StructuredOutputsParams

START, END = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128


class ToolsError(ValueError):
    """A bad `tools` / `tool_choice` / `parallel_tool_calls`; `param` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def bad(message: str, param: str) -> ToolsError:
    return ToolsError(message, param)


def parse_tools(body: dict):
    """(tools or None, tool_choice, parallel_tool_calls) of a chat request; 400 if bad."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if tools in (None, []):
        if choice not in (None, "none", "auto"):
            raise bad(f"'tool_choice' {json.dumps(choice)[:80]} needs 'tools'", "tool_choice")
        return None, "none", parallel
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise bad(f"'tools' must be a list of at most {MAX_TOOLS} tools", "tools")
    names = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if (not isinstance(t, dict) or t.get("type") != "function" or not isinstance(f, dict)
                or not isinstance(f.get("name"), str) or not f["name"]):
            raise bad(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                      "'parameters': {...}}}}", "tools")
        params = f.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise bad(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        names.append(f["name"])
    if len(set(names)) != len(names):
        raise bad("'tools' names a function twice", "tools")
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" \
            else None
        if name not in names:
            raise bad(f"'tool_choice' must be 'none', 'auto', 'required' or "
                      f"{{'type': 'function', 'function': {{'name': one of {names}}}}}, got "
                      f"{json.dumps(choice)[:80]}", "tool_choice")
        choice = {"type": "function", "function": {"name": name}}
    elif choice not in ("none", "auto", "required"):
        raise bad(f"'tool_choice' must be 'none', 'auto', 'required' or a named function, "
                  f"got {json.dumps(choice)[:80]}", "tool_choice")
    return tools, choice, parallel


def tool_grammar(tools: list, choice, parallel: bool) -> StructuredOutputsParams | None:
    """The grammar that forces a call ("required": of any tool; named: of that one), one
    block or, with parallel calls, several; None for "auto" and "none"."""
    if choice in ("auto", "none"):
        return None
    wanted = [choice["function"]["name"]] if isinstance(choice, dict) else None
    alts = []
    for t in tools:
        f = t["function"]
        if wanted is not None and f["name"] not in wanted:
            continue
        schema = {"type": "object", "additionalProperties": False,
                  "required": ["name", "arguments"],
                  "properties": {"name": {"const": f["name"]},
                                 "arguments": f.get("parameters") or {"type": "object"}},
                  "x-guidance": {"whitespace_flexible": False}}
        alts.append("%json " + json.dumps(schema))
    calls = "call+" if parallel else "call"
    lark = (f"start: {calls}\ncall: \"{START}\\n\" body \"\\n{END}\"\n"
            f"body: {' | '.join(alts)}")
    return StructuredOutputsParams(grammar=lark)


class ToolCallParser:
    """Content and complete tool calls from a choice's text, whole or in pieces."""

    def __init__(self):
        self._buf = ""
        self.calls: list[dict] = []

    def push(self, text: str) -> tuple[str, list[dict]]:
        """(content this text adds, calls it completes)."""
        self._buf += text
        content, done = "", []
        while True:
            i = self._buf.find(START)
            if i < 0:  # no block open: all but a possible marker start is content
                keep = marker_prefix(self._buf, START)
                content += self._buf[: len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep:]
                return content, done
            j = self._buf.find(END, i + len(START))
            if j < 0:  # a block is open: its text waits for the end
                content += self._buf[:i]
                self._buf = self._buf[i:]
                return content, done
            call = _call(self._buf[i + len(START): j], len(self.calls))
            if call is None:  # not a call: the block stays text
                content += self._buf[: j + len(END)]
            else:
                content += self._buf[:i]
                self.calls.append(call)
                done.append(call)
            self._buf = self._buf[j + len(END):]

    def finish(self) -> str:
        """The text held at the end (an unterminated block stays content)."""
        out, self._buf = self._buf, ""
        return out


def split_calls(text: str) -> tuple[str | None, list[dict]]:
    """A whole answer as (content or None when only calls, calls)."""
    p = ToolCallParser()
    content, calls = p.push(text)
    content += p.finish()
    if calls and not content.strip():
        return None, calls
    return content, calls


def _call(body: str, index: int) -> dict | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {"index": index, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args)}}
