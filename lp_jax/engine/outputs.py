"""What a step returns per request, as vLLM's: `RequestOutput` and its `CompletionOutput`s."""

from __future__ import annotations

import dataclasses

from lp_jax.core.metrics import RequestMetrics
from lp_jax.core.sequence import Sequence


@dataclasses.dataclass(frozen=True, slots=True)
class CompletionOutput:
    """One sample of a request, as vLLM's: `RequestOutput.outputs[i]`."""

    index: int
    text: str | None
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None


class RequestOutput:
    """A request's state after a step: what it streamed now, and snapshots of the rest.

    `new_token_ids` is this step's delta. `token_ids` (all outputs so far),
    `prompt_token_ids`, `metrics`, `text` and `new_text` are computed on access from
    the sequence, cut at the output count of this step, so they are exact snapshots
    while a streaming step costs O(1) per request instead of copying whole prompts,
    token times and decoded text.
    """

    __slots__ = ("request_id", "new_token_ids", "finished", "finish_reason", "_seq",
                 "_num_out", "_metrics", "_tokenizer", "samples")

    def __init__(self, seq: Sequence, new_token_ids: list[int], *, tokenizer=None):
        self.request_id = seq.seq_id
        self.new_token_ids = new_token_ids
        self.finished = seq.is_finished
        self.finish_reason = seq.finish_reason
        self._seq = seq
        self._num_out = seq.num_output_tokens
        self._metrics = None
        self._tokenizer = tokenizer
        # Every sample's output when this request is one of n (LLM.generate fills it).
        self.samples: list[RequestOutput] | None = None

    @property
    def index(self) -> int:
        """Which sample of its request this is (0 unless the request had n > 1)."""
        return self._seq.index

    @property
    def outputs(self) -> list[CompletionOutput]:
        """vLLM's shape: one CompletionOutput per sample (just this one unless filled)."""
        return [CompletionOutput(o.index, o.text, o.token_ids, o.logprobs, o.finish_reason)
                for o in (self.samples or [self])]

    @property
    def prompt_logprobs(self) -> list[dict[int, float] | None] | None:
        """With SamplingParams.prompt_logprobs: per prompt position, {token_id: logprob}
        of that token (first) and the top alternatives given the tokens before it; None
        at position 0. Complete from the request's first output token on."""
        lps = self._seq.prompt_logprobs
        return None if lps is None else list(lps)

    @property
    def text(self) -> str | None:
        """The whole output decoded (None without a tokenizer)."""
        return self._tokenizer.decode(self.token_ids) if self._tokenizer else None

    @property
    def new_text(self) -> str | None:
        """This step's tokens decoded on their own (a multi-byte character split across
        steps decodes badly; a server should detokenize incrementally instead)."""
        if not self._tokenizer or not self.new_token_ids:
            return None
        return self._tokenizer.decode(self.new_token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._seq.prompt_token_ids

    @property
    def token_ids(self) -> list[int]:
        start = self._seq.num_prompt_tokens
        return self._seq.token_ids[start : start + self._num_out]

    @property
    def logprobs(self) -> list[dict[int, float]] | None:
        """Per output token, {token_id: logprob}: the sampled token and the top
        `SamplingParams.logprobs` alternatives (None when the request asked none)."""
        lps = self._seq.logprobs
        return None if lps is None else lps[: self._num_out]

    @property
    def new_logprobs(self) -> list[dict[int, float]] | None:
        """The entries of `logprobs` for `new_token_ids`."""
        lps = self._seq.logprobs
        if lps is None:
            return None
        return lps[self._num_out - len(self.new_token_ids) : self._num_out]

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens the prefix cache held when the request was first admitted."""
        return self._seq.num_cached_tokens

    @property
    def metrics(self) -> RequestMetrics:
        if self._metrics is None:
            self._metrics = self._seq.metrics(self._num_out)
        return self._metrics

    def __repr__(self) -> str:
        return (f"RequestOutput(id={self.request_id}, tokens={self._num_out}, "
                f"finished={self.finished}, reason={self.finish_reason})")
