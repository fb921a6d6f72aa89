"""The model's reasoning kept apart from its answer: Qwen3's and GLM-4.5's `<think>...</think>`.

With `OpenAIServer(reasoning_parser="qwen3")` (vLLM's `--reasoning-parser qwen3`; "glm45",
vLLM's `glm45`, is the same block and the same rules for GLM-4.5 / 4.6), a chat
choice's text is split where the reasoning ends: what comes before `</think>` goes to the
message's (or the streamed delta's) `reasoning_content`, and to `reasoning` (vLLM's field
since late 2025); what follows goes to `content`. A choice is in its reasoning from the
start when its text opens with `<think>` or when the prompt ends with one (templates that
open the block for the model). Otherwise it has no reasoning: an answer that never opens
a block is all content. Text that never closes its block is all reasoning.

Qwen3's markers are added tokens but not special ones, so they survive detokenization and
the split reads the text. Harmony's (GPT-OSS) are special, and the detokenizer drops
them: that family's analysis channel is split from the token ids (harmony.py, on for every
model whose tokenizer has harmony's markers). While streaming, a
tail that may be the start of a marker ("</thi") is held back until the next text
decides it. With a reasoning parser, the grammar of a chat request whose prompt opens the
block (structured outputs) starts after its `</think>` (`grammar_after`): the reasoning
is free text.

"deepseek_r1" (vLLM's `deepseek_r1`, DeepSeek-R1 and V3.1 in thinking mode): the same
block, but the model always reasons first, so its answer starts inside the block whatever
the prompt ends with (R1's template opens `<think>` for it; earlier templates let the model
write it, and a leading `<think>` of the answer is dropped): text that never writes
`</think>` is all reasoning.
"""

from __future__ import annotations

PARSERS = ("qwen3", "glm45", "deepseek_r1")
ALWAYS_REASONS = ("deepseek_r1",)  # parsers whose model always opens with its reasoning
START, END = "<think>", "</think>"


def starts_in_reasoning(parser: str | None, prompt_tail: str) -> bool:
    """Whether a chat answer starts inside its reasoning block under `parser`."""
    return parser in ALWAYS_REASONS or opens_reasoning(prompt_tail)


def opens_reasoning(prompt_text: str) -> bool:
    """Whether a rendered prompt leaves the model inside a reasoning block."""
    return prompt_text.rstrip().endswith(START)


def grammar_after(spec, tokenizer, prompt_tail: str):
    """A chat request's output format with the reasoning left free: when the prompt opens
    a reasoning block, its grammar starts after `</think>`. Otherwise it starts at once: a
    model that would open a block itself answers in the format without reasoning, rather
    than one that never thinks running free. `spec`: StructuredOutputsParams or None."""
    if spec is None or tokenizer is None or not opens_reasoning(prompt_tail):
        return spec
    import dataclasses

    ids = tokenizer.encode(END, add_special_tokens=False).ids
    return dataclasses.replace(spec, start_after=tuple(ids))


class ThinkSplitter:
    """Streams text in, (reasoning, content) pieces out."""

    def __init__(self, in_reasoning: bool = False, *, drop_open: bool = False):
        """`drop_open`: in a block from the start, a leading `<think>` of the text is
        dropped, not reasoning (deepseek_r1)."""
        self.state = "reasoning" if in_reasoning else "start"  # start -> reasoning -> content
        self._held = ""
        self._after_end = False  # the newlines that follow </think> are not content
        self._drop_open = in_reasoning and drop_open  # until the text decides

    def push(self, text: str) -> tuple[str, str]:
        """The reasoning and content this text (after what was held) adds."""
        buf, self._held = self._held + text, ""
        if self._drop_open:
            stripped = buf.lstrip()
            if START.startswith(stripped) and len(stripped) < len(START):
                self._held = buf  # could still be the model's own <think>
                return "", ""
            self._drop_open = False
            if stripped.startswith(START):
                buf = stripped[len(START):]
        if self.state == "start":
            stripped = buf.lstrip()
            if START.startswith(stripped) and len(stripped) < len(START):
                self._held = buf  # could still open a block
                return "", ""
            if stripped.startswith(START):
                self.state, buf = "reasoning", stripped[len(START):]
            else:
                self.state = "content"
        if self.state == "content":
            return "", self._content(buf)
        i = buf.find(END)
        if i >= 0:
            self.state, self._after_end = "content", True
            return buf[:i], self._content(buf[i + len(END):])
        keep = marker_prefix(buf, END)
        self._held = buf[len(buf) - keep:]
        return buf[: len(buf) - keep], ""

    def _content(self, text: str) -> str:
        if self._after_end:
            text = text.lstrip("\n")
            self._after_end = not text
        return text

    def finish(self) -> tuple[str, str]:
        """What was held back, at the end of the text."""
        held, self._held = self._held, ""
        if self.state == "reasoning":
            return held, ""
        return "", held


def split(text: str, in_reasoning: bool = False, *,
          drop_open: bool = False) -> tuple[str | None, str]:
    """A whole text as (reasoning or None, content); `drop_open` as ThinkSplitter's."""
    s = ThinkSplitter(in_reasoning, drop_open=drop_open)
    r, c = s.push(text)
    r2, c2 = s.finish()
    has = in_reasoning or text.lstrip().startswith(START)
    return (r + r2 if has else None), c + c2


def marker_prefix(text: str, marker: str) -> int:
    """The length of the longest tail of text that starts marker (0 if none)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
