"""GLM-4.5's tool calls: `<tool_call>NAME` then `<arg_key>K</arg_key><arg_value>V</arg_value>`
pairs, then `</tool_call>` (the format vLLM's `glm45` tool parser reads).

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Beijing</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

A value is text, not JSON: it is kept as a string where the tool's schema says the
argument is a string (or says nothing), and read as JSON otherwise (numbers, booleans,
objects, arrays), falling back to the string when it does not parse. `arguments` goes
out as a JSON object string, as OpenAI's API carries it.

`Glm45ToolCallParser` has `tools.ToolCallParser`'s interface (push / finish /
whole_calls, `forced`, `parallel`, `stream`), so the server takes either for a model's
format. A block's call goes out whole when the block closes (streamed too: one delta
with index, id, type, name and arguments); content waits while a block is open. A block
without a name, or with text between the pairs that is not a pair, stays content; so
does an unterminated block, so a malformed answer degrades to plain content.
`parallel=False` drops the calls after the first. GLM-4.5's reasoning block is Qwen3's
`<think>...</think>` (reasoning.py, parser "glm45").
"""

from __future__ import annotations

import json
import re

from lp_jax.server.harmony import new_call
from lp_jax.server.reasoning import marker_prefix

START, END = "<tool_call>", "</tool_call>"
_PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def _string_args(tools: list | None) -> dict[str, set[str]]:
    """Function name -> the arguments its schema types as strings (or leaves untyped)."""
    out = {}
    for t in tools or ():
        f = t.get("function") or {}
        props = (f.get("parameters") or {}).get("properties") or {}
        out[f.get("name")] = {k for k, s in props.items()
                              if not isinstance(s, dict) or s.get("type", "string") == "string"}
    return out


def parse_block(body: str, string_args: set[str] | None, index: int) -> dict | None:
    """The call of one block's body (between the markers), or None if it is not one."""
    head, _, rest = body.partition("<arg_key>")
    name = head.strip()
    if not name or "\n" in name or "<" in name:
        return None
    rest = "<arg_key>" + rest if rest else ""
    args, pos = {}, 0
    for m in _PAIR.finditer(rest):
        if m.start() != pos:
            return None
        key, value = m.group(1).strip(), m.group(2)
        if string_args is not None and key in string_args:
            args[key] = value
        else:
            try:
                args[key] = json.loads(value)
            except ValueError:
                args[key] = value
        pos = m.end()
    if rest[pos:].strip():
        return None
    return new_call(index, name, json.dumps(args, ensure_ascii=False))


class Glm45ToolCallParser:
    """Content and tool-call deltas from a GLM-4.5 choice's text, whole or in pieces.
    `tools`: the request's, for the arguments' types (None: every value read as JSON
    where it parses)."""

    def __init__(self, forced: bool = False, parallel: bool = True, stream: bool = False,
                 tools: list | None = None):
        self.forced, self.parallel, self.stream = forced, parallel, stream
        self._strings = _string_args(tools) if tools else None
        self._buf = ""
        self.calls: list[dict] = []

    def push(self, text: str) -> tuple[str, list[dict]]:
        """(content this text adds, tool-call deltas it makes)."""
        self._buf += text
        content, deltas = "", []
        while True:
            i = self._buf.find(START)
            if i < 0:
                keep = marker_prefix(self._buf, START)
                content += self._buf[: len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep:]
                return content, deltas
            content += self._buf[:i]
            self._buf = self._buf[i:]
            j = self._buf.find(END, len(START))
            if j < 0:
                return content, deltas
            body, self._buf = self._buf[len(START): j], self._buf[j + len(END):]
            name = body.partition("<arg_key>")[0].strip()
            strings = None if self._strings is None else self._strings.get(name, set())
            call = parse_block(body, strings, len(self.calls))
            if call is None:
                content += START + body + END
            elif self.parallel or not self.calls:
                self.calls.append(call)
                deltas.append(call)

    def finish(self) -> str:
        """The text held at the end (an unterminated block stays content)."""
        out, self._buf = self._buf, ""
        return out

    def whole_calls(self) -> list[dict]:
        """The calls made, as a message's `tool_calls` (no index)."""
        return [{k: v for k, v in c.items() if k != "index"} for c in self.calls]


def split_calls(text: str, tools: list | None = None,
                parallel: bool = True) -> tuple[str | None, list[dict]]:
    """A whole answer as (content or None when only calls, calls as `tool_calls`)."""
    p = Glm45ToolCallParser(parallel=parallel, tools=tools)
    content, _ = p.push(text)
    content += p.finish()
    calls = p.whole_calls()
    if calls and not content.strip():
        return None, calls
    return content, calls
