"""GPT-OSS harmony answers, parsed from token ids: reasoning, content and tool calls.

A harmony answer is a run of messages, `<|start|>{header}<|message|>{body}{end}`, the
first one's `<|start|>assistant` already in the prompt. The header names the channel
(`<|channel|>analysis`, `commentary`, `final`) and, for a function call, the recipient
(`to=functions.NAME`, before or after the channel) and the format (`<|constrain|>json`);
a body ends with `<|end|>`, `<|call|>` (a call) or `<|return|>` (the answer is done).
The markers are special tokens, which the detokenizer drops, so `HarmonyParser` reads the
token ids and decodes only the headers and bodies between them:
- the analysis channel goes to `reasoning` (and `reasoning_content`);
- a message to `functions.NAME` is a tool call (when the request has tools), its body
  the `arguments` JSON string;
- everything else (the final channel, a commentary preamble) is `content`.

Malformed output degrades to content, never an error: a header that never reaches
`<|message|>` (or runs past MAX_HEADER_TOKENS, then streams on as content: the model
writes no harmony), a call to anything but `functions.*`, or (tool_choice "auto") a call whose
body is not a JSON object or is cut off, comes back as its body's text.

Calls stream as OpenAI streams them: a first delta with index, id, type, name and
arguments "", then argument fragments as they are decoded. A call that the grammar forces
(tool_choice "required" or a named function, `forced=True`) cannot be malformed: it goes
out at its header; cut short by max_tokens, it stays a call with the arguments it has,
streamed or not. A streamed "auto" call (`stream=True`) goes out once its body starts as
a JSON object (`{`, after any whitespace; its trailing whitespace waits for more text, as
the whole answer's arguments are the body stripped), so a well-formed one reassembles to
the call the whole answer makes. A delta cannot be taken back: if such a body then turns
out malformed (invalid JSON, or cut off), the call stays a call, its arguments the text
the model wrote (OpenAI documents that arguments may be invalid JSON); a body that never
starts as an object is content, as whole. With `parallel=False` the calls after the first
are dropped.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid

from lp_jax.server.detok import IncrementalDetokenizer

MARKERS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
           "<|return|>", "<|call|>")
# A header longer than this (harmony's are a few tokens, a function name and all) is not
# one: the model writes no harmony, and its text streams as content.
MAX_HEADER_TOKENS = 64
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")


@dataclasses.dataclass(frozen=True)
class HarmonyTokens:
    """The ids of harmony's markers in a tokenizer."""

    start: int
    end: int
    message: int
    channel: int
    constrain: int
    ret: int
    call: int

    @property
    def ends(self) -> frozenset[int]:
        return frozenset((self.end, self.ret, self.call))


def harmony_tokens(tokenizer) -> HarmonyTokens | None:
    """The markers' ids when the tokenizer has every one as a special token (GPT-OSS's
    o200k_harmony does); None otherwise (the output is not harmony)."""
    added = getattr(tokenizer, "get_added_tokens_decoder", None)
    if added is None:
        return None
    special = {t.content: i for i, t in added().items() if t.special}
    ids = [special.get(m) for m in MARKERS]
    return None if None in ids else HarmonyTokens(*ids)


def analysis_rules(max_tokens: int | None) -> str:
    """Lark rules for a harmony grammar's optional analysis message (free reasoning, then
    the next message's `<|start|>assistant`): `analysis`, its text limited to half of the
    request's `max_tokens` tokens (llguidance's `max_tokens` rule attribute, which may let
    a token more through), so that the message the grammar forces after it has about the
    other half: a format whose longest text fits there is always reached."""
    budget = "" if max_tokens is None else f"[max_tokens={max(1, max_tokens // 2)}]"
    return ('analysis: <|channel|> "analysis" <|message|> thought <|end|> <|start|> '
            '"assistant"\n'
            f"thought{budget}: THOUGHT\n"
            "THOUGHT: /(?s:.*)/\n")


def final_channel_grammar(spec, max_tokens: int | None = None):
    """A chat request's output format (StructuredOutputsParams or None) on a harmony
    model: the whole answer is constrained to harmony's shape, an optional analysis
    message (`analysis_rules`) then the final channel, `<|channel|>final<|message|>`, whose
    text is the format's and which ends the answer with `<|return|>`. So the answer always
    reaches the final channel, with the format's text as its content, whatever the model
    (random weights included) would write."""
    if spec is None:
        return None
    frame = ("start: analysis? final\n" + analysis_rules(max_tokens)
             + 'final: <|channel|> "final" <|message|> @body <|return|>\n')
    return dataclasses.replace(spec, frame=frame, start_after=())


@dataclasses.dataclass
class Piece:
    """What some tokens add: reasoning text, content text, tool-call deltas."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list = dataclasses.field(default_factory=list)

    def __iadd__(self, other: Piece) -> Piece:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls = merge_deltas(self.tool_calls + other.tool_calls)
        return self


def merge_deltas(deltas: list[dict]) -> list[dict]:
    """Tool-call deltas with consecutive argument fragments of one index joined. A call's
    first delta (id, type, name, arguments "") stays apart, as OpenAI sends it: a chunk
    may then carry it and the call's first fragment."""
    out: list[dict] = []
    for d in deltas:
        if out and out[-1]["index"] == d["index"] and "id" not in out[-1] and "id" not in d:
            prev = out[-1]
            fn = {**prev["function"]}
            fn["arguments"] = fn.get("arguments", "") + d["function"].get("arguments", "")
            out[-1] = {**prev, "function": fn}
        else:
            out.append(d)
    return out


def new_call(index: int, name: str, arguments: str) -> dict:
    """An OpenAI tool call (its streamed delta shape: with the index)."""
    return {"index": index, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


class HarmonyParser:
    """Token ids of one harmony answer in, `Piece`s out; see the module docstring.
    `tools`: messages to functions.* are calls (the request has tools and tool_choice is
    not "none"); `forced`: the grammar makes the calls (stream their arguments);
    `stream`: the answer streams, so an auto call goes out as its body comes (whole, it
    is checked first)."""

    def __init__(self, tokenizer, marks: HarmonyTokens, *, tools: bool = False,
                 forced: bool = False, parallel: bool = True, stream: bool = False):
        self.tok, self.marks = tokenizer, marks
        self.tools, self.forced, self.parallel, self.stream = tools, forced, parallel, stream
        self.state = "header"  # header -> body -> between -> header ...
        self.header: list[int] = []
        self.kind = self.name = None  # the open body's: "reasoning" | "content" | "call"
        self.detok = None
        self.body = ""  # the open body's text so far
        self.call = None  # the open call's entry in self.calls, once it is out
        self.ws = ""  # an auto call's trailing whitespace, sent only if more text follows
        self.reasoning: str | None = None  # None: no analysis message
        self.content = ""
        self.calls: list[dict] = []

    # ---------------------------------------------------------------- streaming
    def push(self, ids) -> Piece:
        out = Piece()
        m = self.marks
        for t in ids:
            if self.state == "header":
                if t == m.message:
                    out += self._open()
                elif t == m.start:  # a new header: the unfinished one was not a message
                    out += self._text(self._decode(self.header))
                    self.header = []
                elif t in m.ends:
                    out += self._text(self._decode(self.header))
                    self.header, self.state = [], "between"
                else:
                    self.header.append(t)
                    if len(self.header) > MAX_HEADER_TOKENS:
                        self._begin("content")
                        out += self._body(self.detok.add(self.header))
                        self.header = []
            elif self.state == "body":
                if t in m.ends or t == m.start:
                    out += self._close(complete=t in m.ends)
                    self.state = "header" if t == m.start else "between"
                    self.header = []
                else:
                    out += self._body(self.detok.add([t]))
            elif t == m.start:  # between messages
                self.state, self.header = "header", []
            elif t not in m.ends:  # stray text between messages is content
                out += self._text(self._decode([t]))
        return out

    def finish(self) -> Piece:
        """The end of the answer: an open header or body closes as it stands."""
        out = Piece()
        if self.state == "header":
            out += self._text(self._decode(self.header))
        elif self.state == "body":
            out += self._close(complete=False)
        self.state, self.header = "between", []
        return out

    # ---------------------------------------------------------------- messages
    def _decode(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True) if ids else ""

    def _open(self) -> Piece:
        """A header is complete: what its body is."""
        head = self.tok.decode(self.header, skip_special_tokens=False)
        recipient = _RECIPIENT.search(head)
        channel = _CHANNEL.search(head)
        self.kind, self.name, self.call = "content", None, None
        if recipient is not None:
            to = recipient.group(1)
            if self.tools and to.startswith("functions.") and len(to) > len("functions."):
                self.kind, self.name = "call", to[len("functions."):]
        elif channel is not None and channel.group(1) == "analysis":
            self.kind = "reasoning"
            self.reasoning = self.reasoning or ""
        self._begin(self.kind)
        if self.kind == "call" and self.forced and self._wanted():
            self.call = new_call(len(self.calls), self.name, "")
            self.calls.append(self.call)
            return Piece(tool_calls=[dict(self.call, function=dict(self.call["function"]))])
        return Piece()

    def _begin(self, kind: str) -> None:
        self.kind, self.state, self.body = kind, "body", ""
        self.detok = IncrementalDetokenizer(self.tok, skip_special_tokens=True)

    def _wanted(self) -> bool:
        return self.parallel or not self.calls

    def _body(self, text: str) -> Piece:
        if not text:
            return Piece()
        self.body += text
        if self.kind == "reasoning":
            self.reasoning += text
            return Piece(reasoning=text)
        if self.kind == "content":
            return self._text(text)
        if self.call is not None:  # a call out already: its arguments stream
            return self._fragment(text)
        head = self.body.lstrip()
        if self.forced or not self.stream or not self._wanted() or not head.startswith("{"):
            return Piece()  # checked at its end: dropped, blank so far, or not an object
        # A streamed auto call goes out once its body starts as a JSON object.
        self.call = new_call(len(self.calls), self.name, "")
        self.calls.append(self.call)
        out = Piece(tool_calls=[dict(self.call, function=dict(self.call["function"]))])
        out += self._fragment(head)
        return out

    def _fragment(self, text: str) -> Piece:
        """An argument fragment of the open call. An auto call's trailing whitespace waits
        for more text (the whole answer's arguments are its body, stripped)."""
        if not self.forced:
            text = self.ws + text
            body = text.rstrip()
            text, self.ws = body, text[len(body):]
        if not text:
            return Piece()
        self.call["function"]["arguments"] += text
        return Piece(tool_calls=[{"index": self.call["index"],
                                  "function": {"arguments": text}}])

    def _close(self, complete: bool) -> Piece:
        out = self._body(self.detok.flush())
        kind, body, opened = self.kind, self.body, self.call
        self.kind = self.call = None
        self.ws = ""
        # A forced call is out already; one past the first without parallel calls (forced:
        # never opened) is dropped.
        if kind != "call" or opened is not None or not self._wanted():
            return out
        args = body.strip()
        if complete and _is_object(args):
            call = new_call(len(self.calls), self.name, args)
            self.calls.append(call)
            out.tool_calls = merge_deltas(out.tool_calls + [call])
            return out
        out += self._text(body)  # malformed: its text is content
        return out

    def _text(self, text: str) -> Piece:
        if not text:
            return Piece()
        self.content += text
        return Piece(content=text)

    # ---------------------------------------------------------------- whole
    def message(self) -> tuple[str | None, str | None, list[dict]]:
        """The whole answer as (reasoning or None, content or None when only calls, calls
        without their index)."""
        calls = [{k: v for k, v in c.items() if k != "index"} for c in self.calls]
        content = None if calls and not self.content.strip() else self.content
        return self.reasoning, content, calls


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False
