"""A stand-in engine for tests and for timing the HTTP layer: it implements the server's
view of an engine (core/served.py's ServedEngine), as LLMEngine does.

It imports no JAX. Each `step()` admits waiting requests (up to `max_num_seqs`, if their
pages fit) and gives every running request one token, so it "generates" as fast as the
server can drain it. Knobs: `step_delay` (seconds slept per step), `progress=False` (never
admits anything: requests wait forever), `fail_at_step` (step() raises there), and a
tokenizer from a model directory (the tiny model's, typically) for text prompts and chat.
Pages are counted like the real block manager's, so abort tests can watch them come back.
Latency SLOs are taken and checked as LLMEngine takes them (`slo_classes`, `resolve_slo`)
and counted in `stats()["slo_attainment"]`; they do not change the (FCFS) order.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from lp_jax.core.metrics import RequestMetrics
from lp_jax.core.sampling_params import SamplingParams
from lp_jax.core.served import EngineLimits, QueueState
from lp_jax.core.slo import SLO, SLOTracker, parse_slo_classes, request_slo
from lp_jax.paths import no_tokenizer_reason


@dataclass
class MockOutput:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    metrics: RequestMetrics
    text: str | None = None
    new_text: str | None = None
    num_cached_tokens: int | None = None  # None: no prefix cache (no usage details)


@dataclass
class _Seq:
    seq_id: int
    prompt: list[int]
    params: SamplingParams
    priority: int
    arrival_time: float
    out: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    pages: int = 0
    finish_reason: str | None = None
    slo: SLO | None = None


class MockEngine:
    def __init__(self, *, model_dir=None, vocab_size: int = 512, eos_token_id: int | None = None,
                 max_model_len: int = 4096, max_num_seqs: int = 256, page_size: int = 16,
                 num_pages: int | None = None, step_delay: float = 0.0, progress: bool = True,
                 fail_at_step: int | None = None, token_fn=None, slo_classes=None):
        self.model_dir = str(model_dir) if model_dir is not None else None
        self.tokenizer = None
        if model_dir is not None and (Path(model_dir) / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
        self.limits = EngineLimits(max_model_len, max_num_seqs, vocab_size)
        self.eos_token_id = eos_token_id
        self.page_size = page_size
        self.num_pages = num_pages or max_num_seqs * math.ceil(max_model_len / page_size)
        self.free_pages = self.num_pages
        self.step_delay = step_delay
        self.progress = progress
        self.fail_at_step = fail_at_step
        # Output tokens: printable single-byte tokens by default, never eos.
        self.token_fn = token_fn or (lambda seq_id, i: 65 + (seq_id + i) % 26)
        self.waiting: list[_Seq] = []  # FCFS by (priority, arrival)
        self.running: list[_Seq] = []
        self.slo_classes = parse_slo_classes(slo_classes or {})
        self.slo_tracker = SLOTracker()
        self._next_id = 0
        self._done: list[_Seq] = []
        self._stats = {"iterations": 0, "iterations_decode": 0, "iterations_prefill": 0,
                       "iterations_hybrid": 0, "iterations_idle": 0, "prefill_tokens": 0,
                       "decode_tokens": 0, "preemptions": 0, "finished": 0, "aborted": 0,
                       "prefix_cache_queries": 0, "prefix_cache_hits": 0}

    def add_request(self, prompt, sampling_params=None, *, priority=0, arrival_time=None,
                    slo=None, prefill_after=None, index=0) -> int:
        """As LLMEngine.add_request; `prefill_after` and `index` (a later sample of a
        request with n > 1) change nothing here: the mock has no prefix cache."""
        slo = None if slo is None else self.resolve_slo(slo)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(no_tokenizer_reason(self.model_dir))
            prompt = self.tokenizer.encode(prompt).ids
        prompt = list(prompt)
        if not prompt:
            raise ValueError("empty prompt")
        if len(prompt) > self.limits.max_model_len:
            raise ValueError("prompt longer than max_model_len")
        if any(not isinstance(t, int) or not 0 <= t < self.limits.vocab_size
               for t in prompt):
            raise ValueError("token id out of range")
        params = sampling_params or SamplingParams()
        if params.structured_outputs is not None:  # its tokens follow no grammar
            raise ValueError("structured_outputs is not supported by the mock engine")
        seq = _Seq(self._next_id, prompt, params, priority,
                   time.perf_counter() if arrival_time is None else arrival_time, slo=slo)
        self._next_id += 1
        self.waiting.append(seq)
        self.waiting.sort(key=lambda s: (s.priority, s.arrival_time, s.seq_id))
        return seq.seq_id

    def resolve_slo(self, slo) -> SLO | None:
        """As LLMEngine.resolve_slo (core/slo.py's request_slo)."""
        return request_slo(self.slo_classes, slo)

    def abort(self, request_id: int) -> bool:
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.seq_id == request_id:
                    queue.remove(seq)
                    self._finish(seq, "abort")
                    self._stats["aborted"] += 1
                    return True
        return False

    def queue_state(self) -> QueueState:
        return QueueState(len(self.running), frozenset(s.seq_id for s in self.waiting),
                          self._stats["iterations_idle"])

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._done)

    def reset_prefix_cache(self) -> bool:
        """As LLMEngine's; there is no cache, so only whether no request holds pages."""
        return self.free_pages == self.num_pages

    def _finish(self, seq: _Seq, reason: str) -> None:
        self.free_pages += seq.pages
        seq.pages = 0
        seq.finish_reason = reason
        self._done.append(seq)

    def _output(self, seq: _Seq, new: list[int]) -> MockOutput:
        return MockOutput(seq.seq_id, seq.prompt, list(seq.out), new,
                          seq.finish_reason is not None, seq.finish_reason,
                          RequestMetrics(seq.arrival_time, token_times=tuple(seq.times)))

    def step(self) -> list[MockOutput]:
        if self.fail_at_step is not None and self._stats["iterations"] >= self.fail_at_step:
            raise RuntimeError("mock engine failure")
        if self.step_delay:
            time.sleep(self.step_delay)
        outputs = [self._output(s, []) for s in self._done]  # aborted since the last step
        self._done = []
        if not self.progress:
            self._stats["iterations"] += 1
            self._stats["iterations_idle"] += 1
            return outputs
        while self.waiting and len(self.running) < self.limits.max_num_seqs:
            seq = self.waiting[0]
            need = math.ceil((len(seq.prompt) + seq.params.max_tokens) / self.page_size)
            if need > self.free_pages:
                break
            self.waiting.pop(0)
            seq.pages = need
            self.free_pages -= need
            self.running.append(seq)
            self._stats["prefill_tokens"] += len(seq.prompt)
        now = time.perf_counter()
        for seq in list(self.running):
            tok = self.token_fn(seq.seq_id, len(seq.out))
            seq.out.append(tok)
            seq.times.append(now)
            p = seq.params
            reason = None
            if tok in p.stop_token_ids or (not p.ignore_eos
                                           and tok == self.eos_token_id):
                reason = "stop"
            elif (len(seq.out) >= p.max_tokens
                  or len(seq.prompt) + len(seq.out) >= self.limits.max_model_len):
                reason = "length"
            if reason:
                self.running.remove(seq)
                self.free_pages += seq.pages
                seq.pages = 0
                seq.finish_reason = reason
                self._stats["finished"] += 1
                m = RequestMetrics(seq.arrival_time, token_times=tuple(seq.times))
                self.slo_tracker.record(seq.slo, m.ttft, m.max_itl)
            outputs.append(self._output(seq, [tok]))
        self._stats["iterations"] += 1
        self._stats["iterations_decode" if self.running or outputs else "iterations_idle"] += 1
        self._stats["decode_tokens"] += len(outputs)
        return outputs

    def stats(self) -> dict:
        s = dict(self._stats)
        s.update(programs=0, compilations_after_warmup=0, expert_bytes_loaded=0,
                 free_pages=self.free_pages, total_pages=self.num_pages,
                 host_overhead_fraction=0.0, slo_attainment=self.slo_tracker.as_dict())
        return s
