"""Preemptible prefill batches: the bookkeeping FlowPrefill (flowprefill.py) and the
simulator's MuxWise (lp_jax/sim/muxwise.py) share. One batch runs, others are paused, and
each owns one of `1 + max_paused_prefills` row areas of the executor's hidden buffer
(`StepPlan.prefill_rows`), so a paused batch resumes where it stopped with nothing
recomputed."""

from __future__ import annotations

from lp_jax.core.config import SchedulerConfig
from lp_jax.core.plan import PrefillChunk, StepPlan
from lp_jax.core.policies.base import Policy
from lp_jax.core.sequence import Sequence


class PausableBatches(Policy):
    """The bookkeeping of preemptible prefill batches, shared by FlowPrefill and the
    simulator's MuxWise: one running batch, paused ones, and the hidden-buffer row areas
    they own. A batch is any object with `batch_id`, `chunks`, `rows` and `slot`."""

    def __init__(self, sched) -> None:
        super().__init__(sched)
        self._running = None
        self._paused: list = []
        self._free_slots = list(range(self.hidden_slots(sched.config)))
        self._event = True  # a scheduling round is due

    def notify(self, event: str, seq: Sequence) -> None:
        """Every request event calls for a round; an aborted member leaves its batch."""
        self._event = True
        if event == "abort":
            self._drop_seq(seq)

    @staticmethod
    def default_budget(cfg: SchedulerConfig) -> int:
        return 8192

    @staticmethod
    def hidden_slots(cfg: SchedulerConfig) -> int:
        return 1 + cfg.max_paused_prefills

    def can_plan_ahead(self, pending: StepPlan) -> bool:
        return True  # an arrival meanwhile preempts at the next segment boundary

    def release_paused(self, busy: set[int]) -> list[Sequence]:
        """Gives up the paused batch ranked last (`_batch_key`) whose KV no outstanding
        plan writes; returns its sequences for the scheduler to preempt (recompute)."""
        now = self.sched.now
        for b in sorted(self._paused, key=lambda b: self._batch_key(b, now), reverse=True):
            if not any(s.seq_id in busy for s in b.seqs):
                self._remove(b)
                self.sched.count("paused_prefills_preempted")
                return b.seqs
        return []

    def _begin_round(self, admit: bool):
        """Counts a scheduling round and returns (now, the live batches, the candidates
        not in a batch: admitted prefills, and the waiting requests when `admit`)."""
        s = self.sched
        s.count("scheduling_rounds")
        self._event = not admit  # a round that could not admit is retried next plan
        batches = ([self._running] if self._running else []) + self._paused
        in_batch = {q.seq_id for b in batches for q in b.seqs}
        free = [q for q in s.prefilling if q.seq_id not in in_batch]
        if admit:
            free += s.waiting
        return s.now, batches, free

    def _batch_key(self, b, now: float) -> tuple:
        """Rank of a batch (lower runs first)."""
        raise NotImplementedError

    def _take_rows(self, chunks: list[PrefillChunk]) -> tuple[int, list[int]]:
        """A free row area for a new batch, and each chunk's first row in it."""
        slot = self._free_slots.pop(0)
        rows, r = [], slot * self.sched.config.max_num_batched_tokens
        for c in chunks:
            rows.append(r)
            r += c.num_tokens
        return slot, rows

    def _switch(self, target) -> None:
        """Run `target` (None: nothing), pausing the running batch."""
        r, s = self._running, self.sched
        if target is r:
            return
        if r is not None:
            self._paused.append(r)
            s.count("prefill_pauses")
        if target is not None and target in self._paused:
            self._paused.remove(target)
            s.count("prefill_resumes")
        self._running = target

    def _find(self, batch_id: int | None):
        if self._running is not None and self._running.batch_id == batch_id:
            return self._running
        return next((b for b in self._paused if b.batch_id == batch_id), None)

    def _remove(self, b) -> None:
        if b is self._running:
            self._running = None
        else:
            self._paused.remove(b)
        self._free_slots.append(b.slot)
        self._free_slots.sort()

    def _drop_seq(self, seq: Sequence):
        """An aborted member leaves its batch; the other chunks keep their rows. Returns
        the batch it left, if any."""
        for b in ([self._running] if self._running else []) + self._paused:
            for i, c in enumerate(b.chunks):
                if c.seq is seq:
                    del b.chunks[i], b.rows[i]
                    if not b.chunks:
                        self._remove(b)
                    return b
        return None
