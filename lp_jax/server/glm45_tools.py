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

`tool_grammar` forces a call (tool_choice "required" or a named function) in this format,
as GLM-4.5's chat template writes one: the name, then each argument of the function's
schema in schema order (the required ones always, the others optionally), a string
argument as raw text (without "<", within its minLength / maxLength, or one of its
enum / const), any other typed one as compact JSON valid against its own schema. Schema
features this cannot express (a `pattern` or `format` on a string, `anyOf` / `$ref` /
`patternProperties` on the parameters, ...) are a ToolsError naming the field, raised
before anything compiles.
"""

from __future__ import annotations

import json
import re

from lp_jax.server.harmony import new_call
from lp_jax.server.reasoning import marker_prefix
from lp_jax.server.tools import ToolsError, read_whole, wanted_tools
from lp_jax.structured.params import StructuredOutputsParams

START, END = "<tool_call>", "</tool_call>"
TAIL = "</arg_value>\n"
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
    return read_whole(Glm45ToolCallParser(parallel=parallel, tools=tools), text)


# The parameters' schema keywords the forced grammar reads or may ignore (documentation,
# and additionalProperties: the grammar writes only the declared arguments).
_OBJECT_KEYS = {"type", "properties", "required", "additionalProperties", "description",
                "title", "$schema"}
_STRING_KEYS = {"type", "description", "title", "minLength", "maxLength", "enum", "const",
                "default", "examples"}


def _string_value(schema: dict, where: str) -> str:
    """A Lark expression for a string argument's raw text."""
    extra = sorted(set(schema) - _STRING_KEYS)
    if extra:
        raise ToolsError(f"{where}.{extra[0]}: GLM-4.5's forced tool calls cannot express "
                         f"'{extra[0]}' on a string argument; use tool_choice 'auto'",
                         "tools")
    if "const" in schema or "enum" in schema:
        values = [schema["const"]] if "const" in schema else schema["enum"]
        if not values or not all(isinstance(v, str) and "<" not in v for v in values):
            raise ToolsError(f"{where}: a string argument's enum / const must be strings "
                             "without '<'", "tools")
        return "(" + " | ".join(json.dumps(v) for v in values) + ")"
    lo, hi = schema.get("minLength", 0), schema.get("maxLength")
    if not isinstance(lo, int) or not (hi is None or isinstance(hi, int) and hi >= lo):
        raise ToolsError(f"{where}: minLength / maxLength must be integers, min <= max",
                         "tools")
    return f"/[^<]{{{lo},{'' if hi is None else hi}}}/"


def _call_rule(f: dict, where: str) -> str:
    """A Lark expression for one function's call body (its name and arguments)."""
    params = f.get("parameters") or {"type": "object"}
    extra = sorted(set(params) - _OBJECT_KEYS)
    if extra or params.get("type", "object") != "object":
        field = extra[0] if extra else "type"
        raise ToolsError(f"{where}.{field}: GLM-4.5's forced tool calls take a parameters "
                         "schema of type object with plain properties; use tool_choice "
                         "'auto'", "tools")
    props, required = params.get("properties") or {}, params.get("required") or []
    missing = [k for k in required if k not in props]
    if missing:
        raise ToolsError(f"{where}.required names {missing[0]!r}, not in its properties",
                         "tools")
    parts = [json.dumps(f["name"] + "\n")]
    for key, schema in props.items():
        if "<" in key or not isinstance(schema, dict):
            raise ToolsError(f"{where}.properties.{key}: GLM-4.5's forced tool calls need "
                             "keys without '<' and schema objects", "tools")
        if schema.get("type", "string") == "string":
            value = _string_value(schema, f"{where}.properties.{key}")
        else:
            value = "%json " + json.dumps({**schema, "x-guidance": {
                "whitespace_flexible": False}})
        head = json.dumps(f"<arg_key>{key}</arg_key>\n<arg_value>")
        pair = f"{head} {value} {json.dumps(TAIL)}"
        parts.append(f"({pair})" + ("" if key in required else "?"))
    return " ".join(parts)


def tool_grammar(tools: list, choice, parallel: bool) -> StructuredOutputsParams | None:
    """GLM-4.5's: the grammar that forces a call ("required": of any tool; named: of that
    one) in `<tool_call>` blocks, one or, with parallel calls, several (newline apart);
    None for "auto" and "none". A ToolsError for a schema it cannot express."""
    if choice in ("auto", "none"):
        return None
    names = [t["function"]["name"] for t in tools]
    rules = [(f"f{i}", _call_rule(f, f"tools[{names.index(f['name'])}].function.parameters"))
             for i, f in enumerate(wanted_tools(tools, choice))]
    calls = 'call ("\\n" call)*' if parallel else "call"
    lark = (f"start: {calls}\n"
            f"call: {json.dumps(START)} body {json.dumps(END)}\n"
            f"body: {' | '.join(name for name, _ in rules)}\n"
            + "".join(f"{name}: {rule}\n" for name, rule in rules))
    return StructuredOutputsParams(grammar=lark)
