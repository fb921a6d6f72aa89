"""One request's state as the scheduler sees it.

A `Sequence` is mutable (the scheduler appends tokens and moves it between queues) but slotted
and light: token ids, KV progress, logical page ids, priority and the timestamps needed for
metrics. It knows nothing about devices.

`prefill_target` is how many tokens the next prefill must cover: the prompt at first
admission, or every token so far (prompt + outputs) after a recompute preemption. The prefill
writes KV for positions [0, prefill_target) and samples the token at position
`prefill_target`; each decode step writes KV for its last token and samples the next one.

`num_cached_tokens` is how much of the prompt the prefix cache held at the first
admission (block_manager.py): the prefill then started there. `page_hashes` memoizes the
chained hashes of the full pages of real tokens, computed as the block manager needs them.

Under overlapped scheduling a decode may be planned before the step that samples its
last token has been committed: `token_ids` then ends in `PENDING_TOKEN`, a placeholder
the commit of that step replaces (`num_pending_tokens` counts them, 0 or 1).
"""

from __future__ import annotations

from enum import Enum, auto

from lp_jax.core.metrics import RequestMetrics
from lp_jax.core.sampling_params import SamplingParams
from lp_jax.core.slo import SLO

PENDING_TOKEN = -1  # stands for a token a dispatched step samples, until its commit


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()  # admitted: prefilling or decoding, holds KV pages
    FINISHED_STOPPED = auto()  # eos or a stop token
    FINISHED_LENGTH = auto()  # max_tokens or max_model_len
    FINISHED_ABORTED = auto()


_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}


class Sequence:
    __slots__ = (
        "seq_id",
        "token_ids",
        "num_prompt_tokens",
        "sampling_params",
        "priority",
        "arrival_time",
        "status",
        "num_computed_tokens",
        "page_ids",
        "prefill_target",
        "first_scheduled_time",
        "token_times",
        "finish_time",
        "num_preemptions",
        "num_pending_tokens",
        "slo",
        "num_cached_tokens",
        "page_hashes",
        "logprobs",
        "prompt_logprobs",
        "index",
        "slot",
        "draft_tokens",
    )

    def __init__(
        self,
        seq_id: int,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        *,
        priority: int = 0,
        arrival_time: float = 0.0,
        slo: SLO | None = None,
        index: int = 0,
    ) -> None:
        self.seq_id = seq_id
        self.index = index  # which sample of its request (a request with n > 1 is n sequences)
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.sampling_params = sampling_params if sampling_params is not None else SamplingParams()
        self.priority = priority  # lower is served first
        self.arrival_time = float(arrival_time)
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.page_ids: list[int] = []  # logical KV pages, in position order
        self.prefill_target = self.num_prompt_tokens
        self.first_scheduled_time: float | None = None
        self.token_times: list[float] = []  # one per output token
        self.finish_time: float | None = None
        self.num_preemptions = 0
        self.num_pending_tokens = 0  # placeholders at the end of token_ids (0 or 1)
        self.slo = slo  # latency objectives; None: best-effort
        self.num_cached_tokens = 0  # prompt tokens hit in the prefix cache at first admission
        self.page_hashes: list[bytes] = []  # chained hashes of the first full pages
        # One {token_id: logprob} per output token when sampling_params.logprobs is set.
        self.logprobs: list[dict[int, float]] | None = (
            [] if self.sampling_params.logprobs is not None else None)
        # With sampling_params.prompt_logprobs: per prompt position, {token_id: logprob}
        # of that token and the top alternatives given the tokens before it (None at 0,
        # and until the prefill that scores it has run).
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            [None] * self.num_prompt_tokens
            if self.sampling_params.prompt_logprobs is not None else None)
        # Its slot among the admitted sequences, in [0, max_num_seqs), while admitted: the
        # executor keeps its on-device state there (the penalties' token counts).
        self.slot: int | None = None
        # A draft model's proposals for its next decode (EAGLE-3), set by each commit.
        self.draft_tokens: tuple[int, ...] = ()

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, {self.status.name}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}, computed={self.num_computed_tokens}, "
            f"pages={len(self.page_ids)})"
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def reads_prefix_cache(self) -> bool:
        """Whether admission may take this request's prefix from the cache. A request for
        prompt log-probabilities must compute every prompt position it scores, so it says
        False, as vLLM's requests with prompt_logprobs skip the cache lookup; its pages are
        still published. Penalties count every token of the prompt on device as its
        prefill runs, so a penalized request computes them all too."""
        p = self.sampling_params
        return not p.has_penalties and p.prompt_logprobs is None

    @property
    def is_finished(self) -> bool:
        return self.status in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        """ "stop", "length" or "abort" once finished, else None."""
        return _FINISH_REASONS.get(self.status)

    @property
    def deadline(self) -> float:
        """When its first token is due: arrival + TTFT objective (inf: none). Once the
        first token is out there is no TTFT deadline any more (inf), so a decode that was
        preempted and recomputes its prompt is not ranked as a late prefill."""
        if self.slo is None or self.slo.ttft_s is None or self.token_times:
            return float("inf")
        return self.arrival_time + self.slo.ttft_s

    @property
    def sort_key(self) -> tuple[int, float, int]:
        """Queue order: priority, then arrival, then id (lowest first)."""
        return (self.priority, self.arrival_time, self.seq_id)

    def metrics(self, num_tokens: int | None = None) -> RequestMetrics:
        """Latency metrics of the first `num_tokens` output tokens (default: all)."""
        return RequestMetrics(self.arrival_time, token_times=tuple(self.token_times[:num_tokens]))
