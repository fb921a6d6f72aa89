"""Tool calling: requests (both families) and Qwen3's `<tool_call>{...}</tool_call>` blocks.

Requests: `tools` (OpenAI's function tools, rendered by the model's chat template),
`tool_choice` ("none", "auto", "required" or {"type": "function", "function": {"name"}})
and `parallel_tool_calls` (`parse_tools`). "required" and a named function are enforced
with the grammar engine (lp_jax/structured), so the call is well-formed: `tool_grammar`
(Qwen3: `<tool_call>` blocks around each function's JSON schema) or
`harmony_tool_grammar` (GPT-OSS: a function-call message on the commentary channel,
after free reasoning). "auto" lets the model choose and parses what it wrote; "none"
parses nothing.

Responses: `ToolCallParser` takes a Qwen3 choice's text (whole or streamed) and returns
the content outside the blocks and OpenAI's `tool_calls` deltas, `arguments` a JSON
string as the model wrote it. Whole, a block whose body is not a JSON object with a
string `name` stays content, and so does an unterminated block, so a malformed answer
degrades to plain content, never an error. Streamed, a call goes out as OpenAI streams
calls: a first delta with index, id, type, name and arguments "", once the block's JSON
has its name and reached its arguments (an "auto" call: once they open a JSON object),
then argument fragments up to the arguments' end. A delta cannot be taken back, so an
"auto" block that turns out malformed after that (invalid JSON, unterminated) stays a
call with the arguments the model wrote; one written another way (arguments before the
name, say) is checked at its end and goes out in one delta. Content waits while a block
is open. `parallel_tool_calls: false` drops the calls after the first.

Qwen3's markers are plain text in its tokenizer (added, not special), so its parser reads
the detokenized text. GPT-OSS harmony's (special tokens) are parsed from token ids, in
harmony.py.
"""

from __future__ import annotations

import json
import re

from lp_jax.server.harmony import analysis_rules, merge_deltas, new_call
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


def wanted_tools(tools: list, choice) -> list[dict]:
    """The functions a forced choice may call ("required": any; named: that one)."""
    wanted = choice["function"]["name"] if isinstance(choice, dict) else None
    return [t["function"] for t in tools if wanted is None or t["function"]["name"] == wanted]


def tool_grammar(tools: list, choice, parallel: bool) -> StructuredOutputsParams | None:
    """Qwen3's: the grammar that forces a call ("required": of any tool; named: of that
    one), one block or, with parallel calls, several; None for "auto" and "none"."""
    if choice in ("auto", "none"):
        return None
    alts = []
    for f in wanted_tools(tools, choice):
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


def harmony_tool_grammar(tools: list, choice,
                         max_tokens: int | None = None) -> StructuredOutputsParams | None:
    """GPT-OSS harmony's: the answer is (after an optional analysis message, the model's
    free reasoning, at most half of `max_tokens`: harmony.analysis_rules) one
    function-call message on the commentary channel,
    `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{arguments}<|call|>`,
    its arguments valid against the function's schema. One call: `<|call|>` ends the
    turn (an eos id of GPT-OSS). None for "auto" and "none"."""
    if choice in ("auto", "none"):
        return None
    alts = []
    for f in wanted_tools(tools, choice):
        schema = dict(f.get("parameters") or {"type": "object"})
        schema.setdefault("x-guidance", {"whitespace_flexible": False})
        head = json.dumps(f"commentary to=functions.{f['name']} ")  # a Lark literal
        alts.append(f'<|channel|> {head} <|constrain|> "json" <|message|> '
                    f"%json {json.dumps(schema)} <|call|>")
    lark = ("start: analysis? call\n" + analysis_rules(max_tokens)
            + f"call: {' | '.join(alts)}")
    return StructuredOutputsParams(grammar=lark)


class ToolCallParser:
    """Content and tool-call deltas from a choice's text, whole or in pieces.

    `forced`: the grammar makes the calls (tool_choice "required" or a named function),
    so a call goes out as soon as its name is known (a first delta with index, id, type,
    name and arguments ""), then its arguments in fragments as they come; cut short, it
    stays a call with what it has. `stream` (tool_choice "auto", streamed): the same, once
    the block's JSON has its name and its arguments have started as a JSON object;
    a block written otherwise (arguments first, say) is checked at its end and goes out
    in one delta. Whole (`stream=False`), an auto call is checked first: a call once its
    block closes and parses, else content. `parallel=False`: calls after the first are
    dropped."""

    def __init__(self, forced: bool = False, parallel: bool = True, stream: bool = False):
        self.forced, self.parallel, self.stream = forced, parallel, stream
        self._buf = ""
        self.calls: list[dict] = []
        self._open = None  # forced: the open block's call, once its name is known
        self._value = None  # forced: where its arguments end (_ValueEnd)

    def push(self, text: str) -> tuple[str, list[dict]]:
        """(content this text adds, tool-call deltas it makes)."""
        self._buf += text
        content, deltas = "", []
        while True:
            i = self._buf.find(START)
            if i < 0:  # no block open: all but a possible marker start is content
                keep = marker_prefix(self._buf, START)
                content += self._buf[: len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep:]
                return content, merge_deltas(deltas)
            content += self._buf[:i]
            self._buf = self._buf[i:]
            j = self._buf.find(END, len(START))
            if self.forced or self.stream:
                deltas += self._stream(self._buf[len(START): j if j >= 0 else None])
            if j < 0:  # a block is open: its text waits for the end
                return content, merge_deltas(deltas)
            body, self._buf = self._buf[len(START): j], self._buf[j + len(END):]
            if self._open is not None:  # a streamed call: already out
                self._open = self._value = None
                continue
            call = _call(body, len(self.calls))
            if call is None:  # not a call: the block stays text
                content += START + body + END
            elif self.parallel or not self.calls:  # else: a second call is dropped
                self.calls.append(call)
                deltas.append(call)

    def _stream(self, body: str) -> list[dict]:
        """A streamed block's new deltas (forced, or auto once its arguments open an
        object), from its text so far."""
        out = []
        if self._open is None:
            m = _HEAD.match(body)
            if m is None or not (self.parallel or not self.calls):
                return out
            try:
                name = json.loads(m.group(1))
            except ValueError:  # not a JSON string: left to the block's end, as text
                return out
            if not name:
                return out
            if not self.forced and not body[m.end():].lstrip().startswith("{"):
                return out  # auto: not yet (or not) arguments that are a JSON object
            self._open = new_call(len(self.calls), name, "")
            self._open["start"] = m.end()
            self._value = _ValueEnd()
            self.calls.append(self._open)
            out.append({k: v for k, v in self._open.items() if k != "start"}
                       | {"function": dict(self._open["function"])})
        call = self._open
        fn = call["function"]
        if not fn["arguments"]:  # the whitespace before the arguments is not theirs
            rest = body[call["start"]:]
            call["start"] += len(rest) - len(rest.lstrip())
        new = body[call["start"] + len(fn["arguments"]):]
        new = new[: self._value.feed(new)]
        if new:
            fn["arguments"] += new
            out.append({"index": call["index"], "function": {"arguments": new}})
        return out

    def finish(self) -> str:
        """The text held at the end (an unterminated block stays content, unless it is a
        call already out)."""
        out, self._buf = self._buf, ""
        if self._open is not None:
            self._open = self._value = None
            return ""
        return out

    def whole_calls(self) -> list[dict]:
        """The calls made, as a message's `tool_calls` (no index)."""
        return [{k: v for k, v in c.items() if k not in ("index", "start")} for c in self.calls]


def split_calls(text: str, forced: bool = False,
                parallel: bool = True) -> tuple[str | None, list[dict]]:
    """A whole answer as (content or None when only calls, calls as a message's
    `tool_calls`)."""
    return read_whole(ToolCallParser(forced, parallel), text)


def read_whole(parser, text: str) -> tuple[str | None, list[dict]]:
    """A whole answer read by a fresh `parser` (any format's): (content, or None when the
    answer is only calls; the calls as a message's `tool_calls`)."""
    content, _ = parser.push(text)
    content += parser.finish()
    calls = parser.whole_calls()
    if calls and not content.strip():
        return None, calls
    return content, calls


# The start of a call block's JSON up to its arguments, as the grammar writes it.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')


class _ValueEnd:
    """How much of a text, read piece by piece, is the JSON value it starts with."""

    def __init__(self):
        self.depth, self.in_str, self.esc, self.started, self.done = 0, False, False, False, False

    def feed(self, text: str) -> int:
        for k, ch in enumerate(text):
            if self.done:
                return k
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif ch == "\\":
                    self.esc = True
                elif ch == '"':
                    self.in_str = False
                    self.done = self.depth == 0
            elif ch == '"':
                self.in_str = self.started = True
            elif ch in "{[":
                self.depth, self.started = self.depth + 1, True
            elif ch in "}]":
                if self.depth == 0:  # the enclosing object's end: a scalar value ended
                    self.done = True
                    return k
                self.depth -= 1
                self.done = self.depth == 0
            elif ch in ", \n\t\r" and self.started and self.depth == 0:
                self.done = True
                return k
            else:
                self.started = True
        return len(text)


def _call(body: str, index: int) -> dict | None:
    """A block's call, its arguments as the model wrote them (a JSON string); None when
    the block is not a JSON object with a non-empty string `name`."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    m = _HEAD.match(body)
    if m is not None:
        _, end = json.JSONDecoder().raw_decode(body, m.end())
        args = body[m.end(): end]
    else:
        args = json.dumps(obj.get("arguments", obj.get("parameters", {})))
    return new_call(index, obj["name"], args)
