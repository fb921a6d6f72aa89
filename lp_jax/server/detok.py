"""Incremental detokenization and stop strings, on the event loop side.

`IncrementalDetokenizer` turns a growing list of token ids into text deltas. It decodes
two short windows that start at the same token (`prefix_offset`): the text already
returned and the text with the new tokens, and returns the difference. Starting both at
the same token keeps tokenizers that strip a leading space from the first decoded token
(SentencePiece) consistent, and the window stays a few tokens long, so each token costs
O(1). Text that ends in U+FFFD (a UTF-8 sequence split across tokens) is held back until
the next token completes it, or until the request finishes.

`TextAssembler` adds stop strings on top (`StopStrings`): it scans the text for the
earliest stop string, cuts the output there, and, while streaming, holds back the shortest
tail that could still grow into a stop string, so a client never sees a partial stop
string. A GPT-OSS harmony chat answer matches its stop strings against its content
instead, once its channels are parsed (choice.py): the analysis channel (reasoning) and a
call's arguments never stop it.
"""

from __future__ import annotations

_PROMPT_CONTEXT = 5  # prompt tokens decoded with the first output token, for spacing


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids=(), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT:]) if tokenizer else []
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def add(self, token_ids) -> str:
        if self.tokenizer is None or not token_ids:
            return ""
        self.ids.extend(token_ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character stays U+FFFD)."""
        if self.tokenizer is None or self.read_offset == len(self.ids):
            return ""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix):]


class StopStrings:
    """Text in, the text safe to send out: cut at the earliest stop string (`stopped`
    then), and while more may come, less the longest tail that could still grow into one.
    `text`: all text taken so far, cut at a stop string."""

    def __init__(self, stop: tuple[str, ...] = ()):
        self.stop = tuple(s for s in stop if s)
        self.text = ""
        self.sent = 0  # characters of `text` handed out
        self.stopped = False

    def push(self, new: str, final: bool = False) -> str:
        """Add text; `final`: nothing more comes, so nothing is held back."""
        if self.stopped:
            return ""
        if new:
            start = len(self.text)
            self.text += new
            if self.stop:
                cut = self._find_stop(start)
                if cut is not None:
                    self.text = self.text[:cut]
                    self.stopped = final = True
        end = len(self.text) if final else len(self.text) - self._held_tail()
        if end <= self.sent:
            return ""
        out = self.text[self.sent:end]
        self.sent = end
        return out

    def _find_stop(self, start: int) -> int | None:
        """Earliest stop string that ends in the new text (starting at or after `start`)."""
        best = None
        for s in self.stop:
            i = self.text.find(s, max(0, start - len(s) + 1))
            if i >= 0 and (best is None or i < best):
                best = i
        return best

    def _held_tail(self) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        held = 0
        text = self.text
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), held, -1):
                if text.endswith(s[:k]):
                    held = k
                    break
        return held


class TextAssembler:
    """Token ids in, text to send out; detects stop strings. See the module docstring."""

    def __init__(self, tokenizer, prompt_token_ids=(), stop: tuple[str, ...] = ()):
        self.detok = IncrementalDetokenizer(tokenizer, prompt_token_ids)
        self.stops = StopStrings(stop)
        self.num_tokens = 0

    @property
    def text(self) -> str:
        """All text decoded so far (cut at a stop string)."""
        return self.stops.text

    @property
    def stopped(self) -> bool:
        return self.stops.stopped

    def push(self, token_ids) -> str:
        """Add tokens; returns the text that is safe to send. Sets `stopped` on a stop string."""
        if self.stopped:
            return ""
        self.num_tokens += len(token_ids)
        return self.stops.push(self.detok.add(token_ids))

    def finish(self) -> str:
        """The request ended: the rest of the text, held-back characters included."""
        if self.stopped:
            return ""
        return self.stops.push(self.detok.flush(), final=True)
