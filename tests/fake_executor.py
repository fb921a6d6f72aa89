"""An executor that computes nothing: `LLMEngine(config, executor=FakeExecutor)`.

It runs plans as the model runner would be asked to (the same StepHandle / StepResult
protocol) and samples a token that depends only on the sequence and its position, so every
policy, overlap setting and cache state must give each request the same tokens. It fills
log-probabilities and prompt log-probabilities for the rows that ask, with the shapes the
real runner gives, and checks what the real runner relies on: every prefilled position's KV
written once per layer range, placeholders only over the step they stand for, a slot for
every penalized sequence. A speculating decode's drafts stand while each equals the fake
token at its position (the greedy rule), so speculation must not change any token; its
pages must hold every verification row. No program is compiled.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

from lp_jax.core.plan import StepPlan, StepResult


def fake_token(seq_id: int, position: int, vocab_size: int) -> int:
    """The token sampled at `position` (the sequence's length before it)."""
    return (7919 * seq_id + 104729 * position + 13) % vocab_size


def fake_logprob(token: int) -> float:
    return -1.0 - (token % 17) / 16


class FakeHandle:
    def __init__(self, plan: StepPlan, result: StepResult):
        self.plan, self._result = plan, result

    def collect(self) -> StepResult:
        return self._result


class FakeExecutor:
    """The engine's executor, without a model: `executor=FakeExecutor`."""

    def __init__(self, sched_cfg, buckets, model_cfg):
        self.vocab_size = model_cfg.vocab_size
        self.page_size = sched_cfg.page_size
        self.num_layers = sched_cfg.num_layers
        self.spec = SimpleNamespace(buckets=tuple(buckets))
        self.programs: dict = {}
        self.compile_seconds = 0.0
        self.row_layers = {"useful": 0.0, "padded": 0.0, "max_step_ratio": 1.0}
        self.plans: list[StepPlan] = []
        self.dispatched = 0

    def warmup(self, log=print):
        if log:
            log(f"compiled 0 of {len(self.spec.buckets)} programs (fake executor)")

    def memory(self) -> dict[str, int]:
        return {"weights": 0, "kv": 0, "hidden": 0}

    def dispatch(self, plan: StepPlan, prev: FakeHandle | None = None) -> FakeHandle:
        self.plans.append(plan)
        self.dispatched += 1
        for s in plan.decode:
            assert s.num_pending_tokens == 0 or prev is not None, "a placeholder needs prev"
            if s.num_pending_tokens:
                assert s.seq_id in prev.plan_tokens, "placeholder from another step"
        rows = [c.seq for c in plan.prefill] if plan.unit_start == 0 else []
        for seq in rows + list(plan.sampling_seqs):
            if seq.sampling_params.has_penalties and not seq.is_finished:
                assert seq.slot is not None, f"seq {seq.seq_id} has penalties and no slot"
        tokens, logprobs, accepted, accepted_lp = {}, {}, {}, {}
        by_seq = plan.drafts_by_seq
        for s in plan.sampling_seqs:
            drafts = by_seq.get(s.seq_id, ())
            if drafts:
                assert not s.num_pending_tokens, "drafts after an unknown token"
                assert len(s.page_ids) * self.page_size >= s.num_tokens + len(drafts), \
                    "verification rows without pages"
            # The token lands at index num_tokens (after a decode's placeholder, if any).
            a = 0
            while a < len(drafts) and drafts[a] == fake_token(s.seq_id, s.num_tokens + a,
                                                               self.vocab_size):
                a += 1
            if a:
                accepted[s.seq_id] = drafts[:a]
            tok = fake_token(s.seq_id, s.num_tokens + a, self.vocab_size)
            tokens[s.seq_id] = tok
            k = s.sampling_params.logprobs
            if k is not None:
                lps = [self._logprobs(t, k) for t in (*drafts[:a], tok)]
                logprobs[s.seq_id] = lps[-1]
                if a:
                    accepted_lp[s.seq_id] = tuple(lps[:-1])
        scores = []
        if plan.is_last_group:
            for c in plan.prefill:
                k = c.seq.sampling_params.prompt_logprobs
                if k is None:
                    continue
                for p in range(c.start + 1, min(c.end, c.seq.num_prompt_tokens - 1) + 1):
                    t = c.seq.token_ids[p]
                    d = {t: fake_logprob(t)}
                    for j in range(k):
                        d.setdefault((t + 1 + j) % self.vocab_size, fake_logprob(t + 1 + j))
                    scores.append((c.seq.seq_id, p, d))
        now = time.perf_counter()
        result = StepResult(tokens=tokens, logprobs=logprobs, accepted=accepted,
                            accepted_logprobs=accepted_lp, prompt_logprobs=tuple(scores),
                            experts_activated=(0,), prefill_call=0 if plan.prefill else None,
                            dispatched_at=now, collected_at=now)
        handle = FakeHandle(plan, result)
        handle.plan_tokens = set(tokens)
        return handle

    def _logprobs(self, tok: int, k: int) -> dict[int, float]:
        d = {tok: fake_logprob(tok)}
        for j in range(k):
            d.setdefault((tok + 1 + j) % self.vocab_size, fake_logprob(tok + 1 + j))
        return d
