"""Prefill policies: what goes into the prefill half of each plan.

A policy sees the scheduler core (queues, admission through `admit_head`, batch
ids) and returns a `PrefillPart`. Everything else a plan holds, decodes,
preemptions and bookkeeping, is the core's (scheduler.py). Adding a policy is a
subclass plus an entry in `scheduler.POLICIES`. FlowPrefill's preemptible policy is in
flowprefill.py.

With prefix caching an admitted sequence's prefill starts at its first uncached token
(`seq.num_computed_tokens`), and budgets count only the tokens a chunk computes; before
admission, `Scheduler.prefill_start` says where it would start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from lp_jax.core.layer_groups import ADAPTIVE, num_layer_groups, split_layers
from lp_jax.core.plan import PrefillChunk, StepPlan
from lp_jax.core.sequence import Sequence

if TYPE_CHECKING:
    from lp_jax.core.scheduler import Scheduler, SchedulerConfig

@dataclass(frozen=True, slots=True)
class PrefillPart:
    """The prefill half of a plan, as a policy decides it."""

    chunks: tuple[PrefillChunk, ...]
    batch_id: int | None
    layer_start: int = 0
    layer_end: int | None = None  # None: all layers
    group_index: int = 0
    num_groups: int = 1
    unit_start: int | None = None  # operator-unit span; None: the layer range
    unit_end: int | None = None
    rows: tuple[int, ...] = ()  # hidden-buffer row of each chunk; (): packed from 0


class Policy:
    """Chooses prefill chunks; admission goes through `Scheduler.admit_head`."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched

    @staticmethod
    def budget(cfg: SchedulerConfig) -> int:
        """Default max_num_batched_tokens."""
        raise NotImplementedError

    @staticmethod
    def check(cfg: SchedulerConfig) -> None:
        """Policy-specific config checks."""

    @staticmethod
    def hidden_slots(cfg: SchedulerConfig) -> int:
        """Prefill batches whose hidden states the executor keeps between plans, each in
        an area of max_num_batched_tokens rows (StepPlan.prefill_rows)."""
        return 0

    def schedule_prefill(self, num_decode: int, admit: bool) -> PrefillPart:
        raise NotImplementedError

    def on_advance(self, plan: StepPlan) -> None:
        """Called once per plan, when the scheduler applies its token-independent
        effects (at the next schedule() or at its commit, whichever comes first)."""

    def in_flight(self) -> tuple[Sequence, ...]:
        """Sequences of a prefill batch that spans iterations and has not completed."""
        return ()

    def decodes_now(self) -> bool:
        """Whether the next plan runs the decodes (they wait otherwise)."""
        return True

    def notify(self, event: str, seq: Sequence) -> None:
        """A request event: "arrival", "abort", "finish", "preempt", or "free" (a
        finished request's pages came back); event-driven policies run a round on it."""

    def release_paused(self, busy: set[int]) -> list[Sequence]:
        """Under memory pressure: sequences of a paused prefill to preempt, if any. Those
        in `busy` still have an outstanding plan writing their KV."""
        return []

    def can_plan_ahead(self, pending: StepPlan) -> bool:
        """May the next plan be made before `pending` commits? Planning ahead decides
        without the requests that arrive while `pending` runs; a policy that admits
        every step only delays those by one step, so the default is yes."""
        return True

    def _uncached(self, seq: Sequence) -> int:
        """Prefill tokens `seq` still has to compute (its cached prefix excluded)."""
        return seq.prefill_target - self.sched.prefill_start(seq)

    def _admitted_chunk(self, seq: Sequence, left: int) -> PrefillChunk:
        """The first chunk of a just admitted sequence: from its first uncached token, at
        most `left` tokens."""
        start = seq.num_computed_tokens
        return PrefillChunk(seq, start, start + min(seq.prefill_target - start, left))

    def _whole_stack(self, chunks: list[PrefillChunk]) -> PrefillPart:
        return PrefillPart(tuple(chunks), self.sched.new_batch_id() if chunks else None)

    def _continue_partials(self, left: int) -> tuple[list[PrefillChunk], int]:
        """Next chunks of admitted, partially prefilled sequences within `left` tokens."""
        chunks = []
        for seq in self.sched.prefilling:
            if left == 0:
                break
            start = seq.num_computed_tokens
            n = min(seq.prefill_target - start, left)
            chunks.append(PrefillChunk(seq, start, start + n))
            left -= n
        return chunks, left


class OrcaPolicy(Policy):
    """Whole prompts while they fit the budget; always at least one."""

    @staticmethod
    def budget(cfg: SchedulerConfig) -> int:
        return cfg.max_model_len

    def schedule_prefill(self, num_decode: int, admit: bool) -> PrefillPart:
        s, left, chunks = self.sched, self.sched.config.max_num_batched_tokens, []
        while admit and s.waiting and not (chunks and self._uncached(s.waiting[0]) > left):
            seq = s.admit_head()
            if seq is None:
                break
            chunks.append(self._admitted_chunk(seq, seq.prefill_target))
            left -= chunks[-1].num_tokens
        return self._whole_stack(chunks)


class ChunkedPolicy(Policy):
    """Decodes, then in-flight partial prefills, then new requests, within one token budget."""

    @staticmethod
    def budget(cfg: SchedulerConfig) -> int:
        return 512

    @staticmethod
    def check(cfg: SchedulerConfig) -> None:
        if cfg.max_num_batched_tokens < cfg.max_num_seqs:
            raise ValueError(
                f"chunked prefill needs max_num_batched_tokens ({cfg.max_num_batched_tokens}) "
                f">= max_num_seqs ({cfg.max_num_seqs}) so all decodes fit the budget"
            )

    def schedule_prefill(self, num_decode: int, admit: bool) -> PrefillPart:
        s = self.sched
        chunks, left = self._continue_partials(s.config.max_num_batched_tokens - num_decode)
        while admit and left > 0 and (seq := s.admit_head()) is not None:
            chunks.append(self._admitted_chunk(seq, left))
            left -= chunks[-1].num_tokens
        return self._whole_stack(chunks)


@dataclass(slots=True)
class _LayeredBatch:
    batch_id: int
    chunks: tuple[PrefillChunk, ...]
    groups: list[tuple[int, int]]  # layer ranges; "adaptive" appends one per iteration
    index: int = 0  # the group the next plan runs


class LayeredPolicy(Policy):
    """One prefill batch in flight; iteration g of the batch runs layer group g.

    With layer_groups="adaptive" the groups are not fixed in advance: each iteration runs
    the most of the batch's remaining layers for which the latency estimator predicts the
    step (all decodes through every layer, the batch through those layers) within the TBT
    objective times (1 - adaptive_margin): the whole stack at once when nothing decodes or
    the objective is loose, fewer layers as the decode batch and its context grow."""

    def __init__(self, sched: Scheduler) -> None:
        super().__init__(sched)
        self._batch: _LayeredBatch | None = None
        self.adaptive = sched.config.layer_groups == ADAPTIVE

    @staticmethod
    def budget(cfg: SchedulerConfig) -> int:
        return 8192

    @staticmethod
    def hidden_slots(cfg: SchedulerConfig) -> int:
        return 1

    def schedule_prefill(self, num_decode: int, admit: bool) -> PrefillPart:
        if self._batch is None:
            self._batch = self._form_batch(admit)
        b = self._batch
        if b is None:
            return PrefillPart((), None)
        if b.index == len(b.groups):  # adaptive: choose this iteration's span
            start = b.groups[-1][1] if b.groups else 0
            b.groups.append((start, start + self._adaptive_span(b, start, num_decode)))
        start, end = b.groups[b.index]
        more = self.adaptive and end < self.sched.config.num_layers
        return PrefillPart(b.chunks, b.batch_id, start, end, b.index, len(b.groups) + more)

    def tbt_target(self) -> float | None:
        """The TBT objective the decodes must keep: the tightest running request's, or the
        engine's; None: no limit."""
        cfg = self.sched.config
        own = [q.slo.tbt_s for q in self.sched.running
               if q.slo is not None and q.slo.tbt_s is not None]
        targets = own + ([cfg.tbt_slo_s] if cfg.tbt_slo_s is not None else [])
        return min(targets) if targets else None

    def _adaptive_span(self, b: _LayeredBatch, start: int, num_decode: int) -> int:
        """How many layers from `start` this iteration runs (at least one)."""
        cfg, s = self.sched.config, self.sched
        left = cfg.num_layers - start
        target = self.tbt_target()
        if not num_decode or target is None:
            return left
        limit = target * (1.0 - cfg.adaptive_margin)
        chunks = [(c.num_tokens, c.start) for c in b.chunks]
        tokens = sum(t for t, _ in chunks)
        ctx = sum(q.num_tokens for q in s.running)

        def fits(k: int) -> bool:
            a = 2 * start
            x = s.latency.features(chunks, a, a + 2 * k, num_decode, ctx)
            return s.latency.predict(x, num_decode, tokens) <= limit

        lo, hi = 1, left  # the largest k that fits, by bisection (time grows with k)
        if fits(hi):
            return hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    def _form_batch(self, admit: bool) -> _LayeredBatch | None:
        s, cfg = self.sched, self.sched.config
        # The rest of a prompt cut by the previous batch goes first.
        chunks, left = self._continue_partials(cfg.max_num_batched_tokens)
        # Whole prompts while they fit; a prompt longer than the budget opens a batch alone.
        while admit and left > 0 and s.waiting:
            if chunks and self._uncached(s.waiting[0]) > left:
                break
            seq = s.admit_head()
            if seq is None:
                break
            chunks.append(self._admitted_chunk(seq, left))
            left -= chunks[-1].num_tokens
        if not chunks:
            return None
        g = num_layer_groups(
            sum(c.num_tokens for c in chunks),
            cfg.layer_groups,
            max_layer_groups=cfg.max_layer_groups,
            num_layers=cfg.num_layers,
        )
        groups = [] if self.adaptive else list(split_layers(cfg.num_layers, g))
        return _LayeredBatch(s.new_batch_id(), tuple(chunks), groups)

    def on_advance(self, plan: StepPlan) -> None:
        b = self._batch
        if b is not None and plan.prefill_batch_id == b.batch_id:
            b.index += 1
            if b.groups[b.index - 1][1] == self.sched.config.num_layers:
                self._batch = None

    def in_flight(self) -> tuple[Sequence, ...]:
        return tuple(c.seq for c in self._batch.chunks) if self._batch else ()

    def can_plan_ahead(self, pending: StepPlan) -> bool:
        """Not when the next plan may form a batch of several groups from waiting
        requests: a request arriving while `pending` runs would miss it and wait all
        G iterations, where a step-by-step engine would have taken it in. (Missing a
        one-group batch costs one step, as a late admission does under chunked.)"""
        b = self._batch
        L = self.sched.config.num_layers
        ends_batch = b is None or (pending.prefill_batch_id == b.batch_id
                                   and b.groups[b.index][1] == L)
        if not ends_batch or not self.sched.waiting:
            return True
        s, cfg = self.sched, self.sched.config
        if self.adaptive:  # one group unless decodes and a TBT objective cut it
            return not (s.running and self.tbt_target() is not None)
        done = {c.seq.seq_id: c.end for c in pending.prefill}  # once `pending` ends
        tokens = sum(q.prefill_target - done.get(q.seq_id, q.num_computed_tokens)
                     for q in s.prefilling)
        for q in s.waiting:  # until the batch would be full: a long queue costs nothing
            if tokens >= cfg.max_num_batched_tokens:
                break
            tokens += self._uncached(q)
        groups = num_layer_groups(min(tokens, cfg.max_num_batched_tokens), cfg.layer_groups,
                                  max_layer_groups=cfg.max_layer_groups,
                                  num_layers=cfg.num_layers)
        return groups == 1
