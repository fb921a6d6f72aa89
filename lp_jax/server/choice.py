"""One choice of a response (a prompt's sample) and its OpenAI log-probability objects.

A request is one or more choices: a completions batch of prompts times `n` samples, each
an engine request. A choice keeps its own detokenizer, stop-string state, echo and
log-probability formatter; `usage` sums a request's choices as OpenAI counts them.
"""

from __future__ import annotations

from lp_jax.server import protocol
from lp_jax.server.detok import StopStrings, TextAssembler
from lp_jax.server.harmony import HarmonyParser, Piece
from lp_jax.server.reasoning import ALWAYS_REASONS, ThinkSplitter, split, starts_in_reasoning
from lp_jax.server.tool_formats import parser as tool_parser
from lp_jax.server.tool_formats import split as split_calls


def usage(choices: list[Choice]) -> dict:
    """OpenAI's usage of a request: each prompt's tokens once (however many samples), every
    choice's completion tokens; cached tokens as the first sample of each prompt found."""
    firsts = [c for c in choices if c.sample_index == 0]
    cached = [c.cached for c in firsts]
    return protocol.usage(sum(len(c.ids) for c in firsts),
                          sum(c.asm.num_tokens for c in choices),
                          None if any(x is None for x in cached) else sum(cached))


class Choice:
    """One choice of a response (a prompt's sample): its engine request, its text (with
    the echo, if asked), its log-probabilities."""

    def __init__(self, index: int, handle, ids: list[int], prompt, tokenizer, req, *,
                 reasoning: bool | str = False, harmony=None, tool_format: str = "qwen3"):
        """`reasoning`: a chat answer's reasoning goes apart from its content
        (reasoning.py; the server's reasoning_parser, or True for its default rules).
        `harmony`: the tokenizer's harmony markers (HarmonyTokens) when the model writes
        GPT-OSS harmony: a chat answer's channels and calls are parsed from its token ids
        (harmony.py). `tool_format`: otherwise, the text format of the model's tool calls
        (tool_formats.py)."""
        self.index, self.handle, self.ids, self.req = index, handle, ids, req
        self.sample_index = index % req.n
        self.tokenizer = tokenizer
        chat_harmony = harmony is not None and req.kind == "chat"
        # A harmony answer's stop strings match its content, once parsed (`_harmony_push`).
        self.asm = TextAssembler(tokenizer, ids, () if chat_harmony else req.stop)
        self.stops = StopStrings(req.stop) if chat_harmony else None
        self.lps = None if req.logprobs is None else LogprobFormatter(tokenizer, req)
        self.lp_tokens, self.lp_entries = [], []  # the whole choice's, when not streamed
        self.reason = self.last = self.cached = None
        self.started = False  # chat: its first chunk (with the role) went out
        self.prompt_lps = None  # the engine's prompt log-probabilities, from the first delta
        self.prompt_lps_pending = True  # streaming: not yet sent
        self.echo = self._echo_text(prompt)
        tools = req.kind == "chat" and bool(req.tools) and req.tool_choice != "none"
        forced = req.structured_param == "tool_choice"  # the grammar makes the calls
        self.harmony = self.tool_parser = None
        self.piece = Piece()  # harmony: what the last delta added
        if chat_harmony:
            self.harmony = HarmonyParser(tokenizer, harmony, tools=tools, forced=forced,
                                         parallel=req.parallel_tool_calls, stream=req.stream)
        elif tools:
            self._new_parser = lambda stream: tool_parser(
                tool_format, forced, req.parallel_tool_calls, stream, req.tools)
            self.tool_parser = self._new_parser(req.stream)
        self.in_reasoning = self.think = None
        self.drop_open = False
        if reasoning and req.kind == "chat" and self.harmony is None:
            tail = tokenizer.decode(ids[-8:], skip_special_tokens=False) if tokenizer else ""
            parser = reasoning if isinstance(reasoning, str) else None
            self.in_reasoning = starts_in_reasoning(parser, tail)
            self.drop_open = parser in ALWAYS_REASONS
            self.think = ThinkSplitter(self.in_reasoning, drop_open=self.drop_open)
        self.echo_pending = bool(self.echo) or (req.echo and self.lps is not None)

    def _echo_text(self, prompt) -> str:
        req = self.req
        if not req.echo:
            return ""
        if req.kind == "chat":  # vLLM's: the last message, when it is the assistant's
            last = req.messages[-1]
            return last["content"] if last["role"] == "assistant" else ""
        if isinstance(prompt, str):
            return prompt
        return self.tokenizer.decode(self.ids) if self.tokenizer else ""

    def push(self, delta, *, stream: bool) -> tuple[str, tuple | None]:
        """Takes one engine delta; returns (text to stream, None or the (tokens, entries)
        whose logprobs the chunk carries: formatted by `_chunk`, off the loop if big)."""
        self.last = delta
        out = delta.output
        self.cached = getattr(out, "num_cached_tokens", None)
        if self.prompt_lps is None:
            self.prompt_lps = getattr(out, "prompt_logprobs", None)
        text = self.asm.push(delta.new_token_ids)
        lp_delta = None
        # An engine without log-probabilities (the mock) answers logprobs: null.
        new_lps = getattr(out, "new_logprobs", None)
        if self.lps is not None and new_lps is not None:
            tokens, entries = list(delta.new_token_ids), list(new_lps)
            if self.echo_pending and self.req.kind == "completion":
                tokens, entries = list(self.ids) + tokens, self._prompt_lp_entries() + entries
            self.lp_tokens += tokens
            self.lp_entries += entries
            if stream:
                lp_delta = tokens, entries
        elif new_lps is None:
            self.lps = None
        echo = self.echo if self.echo_pending else ""
        if self.echo_pending:
            self.echo_pending = False
            text = self.echo + text
        if self.harmony is not None:
            self.piece = self._harmony_push(delta.new_token_ids, delta.finished)
            self.piece.content = echo + self.piece.content
        if self.asm.stopped or (self.stops is not None and self.stops.stopped):
            self.reason = "stop"
            self.handle.abort()  # the engine stops generating; the client is answered
        elif delta.finished:
            text += self.asm.finish()
            self.reason = delta.finish_reason
        if self.reason is not None:
            self.handle.finished = True
        return text, lp_delta

    def _harmony_push(self, ids, finished: bool) -> Piece:
        """What a delta's ids add to a harmony answer, its content through the stop
        strings: they match what the user gets as content (the final channel, and any
        text that comes back as content), never the analysis channel's reasoning or a
        call's arguments. With stop strings the ids are parsed one at a time, so that
        nothing after a stop string is parsed (no call made after it)."""
        out, stops = Piece(), self.stops
        for part in ([t] for t in ids) if stops.stop else [ids]:
            if stops.stopped:
                return out
            p = self.harmony.push(part)
            p.content = stops.push(p.content)
            out += p
        if finished and not stops.stopped:
            p = self.harmony.finish()
            p.content = stops.push(p.content, final=True)
            out += p
        return out

    def chat_delta(self, text: str) -> dict:
        """A streamed chat delta's text fields: content, and with a reasoning parser the
        reasoning it holds (a marker's possible start waits for the next text)."""
        r, c, last = "", text, self.reason is not None
        if self.harmony is not None:  # parsed from the token ids (push)
            p = self.piece
            return {"content": p.content,
                    **({"reasoning_content": p.reasoning, "reasoning": p.reasoning}
                       if p.reasoning else {}),
                    **({"tool_calls": p.tool_calls} if p.tool_calls else {})}
        if self.think is not None:
            r, c = self.think.push(text)
            if last:  # the last delta: what was held comes out
                r2, c2 = self.think.finish()
                r, c = r + r2, c + c2
        calls = []
        if self.tool_parser is not None:  # tools.py: when a call goes out
            c, calls = self.tool_parser.push(c)
            if last:
                c += self.tool_parser.finish()
        return {"content": c, **({"reasoning_content": r, "reasoning": r} if r else {}),
                **({"tool_calls": calls} if calls else {})}

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's: "tool_calls" for an answer that stopped after making calls."""
        parser = self.harmony or self.tool_parser
        if self.reason == "stop" and parser is not None and parser.calls:
            return "tool_calls"
        return self.reason

    def prompt_logprob_entries(self) -> int:
        """Entries its `prompt_logprobs` body holds: the token and its alternatives a row."""
        k = self.req.prompt_logprobs
        return 0 if k is None or self.prompt_lps is None else len(self.prompt_lps) * (k + 1)

    def chunk_entries(self, lp_delta) -> int:
        """As `num_entries`, for the next streamed chunk: its logprobs, its prompt's."""
        n = len(lp_delta[0]) * (self.req.logprobs + 2) if lp_delta else 0
        return n + (self.prompt_logprob_entries() if self.prompt_lps_pending else 0)

    def num_entries(self) -> int:
        """Roughly the JSON values its body holds: one a token, times the alternatives
        when log-probabilities are asked for; decides whether it is built off the loop."""
        tokens = self.asm.num_tokens + (len(self.ids) if self.req.echo else 0)
        per_token = 1 if self.req.logprobs is None else self.req.logprobs + 2
        return tokens * per_token + self.prompt_logprob_entries()

    def _prompt_lp_entries(self) -> list:
        """The echoed prompt's log-probability entries: None for the first token."""
        lps = self.prompt_lps or [None] * len(self.ids)
        return list(lps)

    def prompt_logprobs_body(self):
        """vLLM's `prompt_logprobs`: per prompt token, None (the first) or
        {token_id: {"logprob", "decoded_token"}} for the token and its top alternatives."""
        if self.prompt_lps is None:
            return None
        k = self.req.prompt_logprobs
        texts: dict[int, str] = {}  # a token's text, decoded once (rows share alternatives)

        def dec(t: int) -> str:
            if t not in texts:
                texts[t] = (self.tokenizer.decode([t], skip_special_tokens=False)
                            if self.tokenizer else f"token_id:{t}")
            return texts[t]

        out = []
        for d in self.prompt_lps:
            if d is None:
                out.append(None)
                continue
            first, *alts = d.items()  # the prompt token, then the engine's top alternatives
            keep = [first, *alts[:k]]
            out.append({str(t): {"logprob": v, "decoded_token": dec(t)} for t, v in keep})
        return out

    def choice_body(self) -> dict:
        lp = None if self.lps is None else self.lps.format(self.lp_tokens, self.lp_entries)
        if self.req.kind == "chat" and self.harmony is not None:
            reasoning, _, calls = self.harmony.message()
            content = self.stops.text  # the parsed content, cut at a stop string
            content = None if calls and not content.strip() else content
            message = {"role": "assistant",
                       "content": None if content is None else self.echo + content}
            if reasoning is not None:
                message.update(reasoning_content=reasoning, reasoning=reasoning)
            if calls:
                message["tool_calls"] = calls
            return {"index": self.index, "message": message, "logprobs": lp,
                    "finish_reason": self.finish_reason}
        if self.req.kind == "chat":
            message = {"role": "assistant", "content": self.echo + self.asm.text}
            content = self.asm.text
            if self.think is not None:
                reasoning, content = split(self.asm.text, self.in_reasoning,
                                           drop_open=self.drop_open)
                message.update(content=self.echo + content, reasoning_content=reasoning,
                               reasoning=reasoning)
            reason = self.reason
            if self.tool_parser is not None:
                rest, calls = split_calls(lambda: self._new_parser(False), content)
                if calls:
                    message["content"] = None if rest is None else self.echo + rest
                    message["tool_calls"] = calls
                    reason = "tool_calls" if reason == "stop" else reason
            return {"index": self.index, "message": message, "logprobs": lp,
                    "finish_reason": reason}
        body = {"index": self.index, "text": self.echo + self.asm.text, "logprobs": lp,
                "finish_reason": self.reason}
        if self.req.prompt_logprobs is not None:
            body["prompt_logprobs"] = self.prompt_logprobs_body()
        return body


class LogprobFormatter:
    """OpenAI `logprobs` objects for a request's tokens, chunk by chunk or whole (the same
    tokens give the same entries either way). Completions: the legacy shape (tokens,
    token_logprobs, top_logprobs with the sampled token and the top `logprobs`, as vLLM's,
    text_offset); chat: content entries with the top `top_logprobs` alternatives. Token
    text is each id decoded alone (special tokens kept), so it may be a partial character."""

    def __init__(self, tokenizer, req):
        self.tokenizer, self.chat, self.top = tokenizer, req.kind == "chat", req.logprobs
        self.offset = 0  # completions: the next token's character offset in the text

    def _text(self, t: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{t}"
        return self.tokenizer.decode([t], skip_special_tokens=False)

    def _entry(self, t: int, lp: float) -> dict:
        text = self._text(t)
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    def format(self, token_ids: list[int], entries: list[dict]) -> dict:
        if self.chat:
            return {"content": [
                {**self._entry(t, d[t]),
                 "top_logprobs": [self._entry(a, v) for a, v in
                                  sorted(d.items(), key=lambda kv: -kv[1])[: self.top]]}
                for t, d in zip(token_ids, entries, strict=True)]}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, d in zip(token_ids, entries, strict=True):
            text = self._text(t)
            out["tokens"].append(text)  # d is None for an echoed prompt's first token
            out["token_logprobs"].append(None if d is None else d[t])
            out["top_logprobs"].append(None if d is None else
                                       {self._text(a): v for a, v in d.items()})
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out

