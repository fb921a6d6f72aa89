"""FlowPrefill: preemptible prefill segments under event-driven, slack-aware EDF.

A prefill batch runs as a sequence of *segments*, one per plan. A segment is a span of
operator units (unit 2i: layer i's attention half, 2i + 1: its MLP half) of the size
`preemption_granularity` names: "operator" (one unit), "layer" (two) or "group" (the
layered policy's groups). A compiled program cannot be interrupted, so segment boundaries
are the preemption points; the step's unit bounds are runtime values (step.py), so
segments add no programs. With at most two plans outstanding (overlapped scheduling),
an urgent request waits for at most two segments, or k + 1 with a lookahead of k
(below).

A paused batch keeps its KV pages and its boundary hidden states: every batch owns one of
`1 + max_paused_prefills` row areas of the executor's hidden buffer
(`StepPlan.prefill_rows`), so it resumes where it stopped with nothing recomputed. Its
pages reach the prefix cache only when its last segment has run (scheduler.py); a paused
or preempted batch publishes nothing, and a request admitted meanwhile recomputes them.

Scheduling rounds run only on events: an arrival, an abort, a finished request, a
preemption, or the end of a batch. Between events, a plan is the running batch's next
segment, at O(1) cost. A round ranks every candidate (the running batch, paused batches,
and requests not in a batch) by slack-aware EDF:

    deadline = arrival + TTFT SLO (infinite without one, or once the first token is out)
    slack    = deadline - now - predicted remaining prefill time (latency.py)

and forms a new batch by SLO-aware batching when the top candidate is a request; the
running batch is paused if the new top is not it. `SchedulerConfig.flowprefill_rules`
picks whose rules rank and batch:

"reference" (default): the released FlowPrefill code (a vLLM fork,
    HSIEHCHIACHI/FlowPrefill: `Request.update_priority`, `EngineCore.slo_aware_batching`).
    Priority = sign(slack) / deadline, highest first: feasible candidates (slack > 0)
    earliest deadline first, then infeasible ones latest deadline first. A batch is
    ranked by its head (its first member). The head runs alone if its remaining prompt
    exceeds the token budget (2048 by default, the code's token bound; the prompt is cut
    into budget-sized chunks) or if deadline - now < alpha * its TTFT SLO. Otherwise the
    other candidates are added in rank order, skipping any that would take the batch over
    the budget (or that cannot be admitted now), and adding stops at the first one with
    which the head's deadline - now - the batch's predicted time < alpha * its TTFT SLO:
    the margin is alpha times the SLO, and only the head's is checked.
"lp_jax": this project's earlier rules. Order = priority, then feasible (slack >= 0)
    before infeasible, then deadline (earliest first in both). A batch is ranked by its
    most urgent member. Candidates are added in rank order while the batch fits the
    budget (8192 by default) and every member that can still make its deadline keeps
    slack >= alpha * its TTFT SLO with the batch's predicted time; adding stops at the
    first candidate that fails.

Infeasible requests are demoted, never dropped. A batch that needs a row area when none
is free waits. Under memory pressure a paused batch is a preemption victim before running
decodes (its pages are freed and its prompt recomputed).

Lookahead (`SchedulerConfig.flowprefill_lookahead`, k; issue #30 finding 4). A queued XLA
execution cannot be cancelled, so a segment dispatched ahead is a segment an urgent
arrival waits for; dispatching only one ahead (k = 1) pays a host plan, dispatch and
commit for every segment. With k > 1 a plan carries a *run* of up to k consecutive
segments of the running batch, executed as one call over their unit span (the step's
unit bounds are runtime values: no new program), so the host work is paid once per run.
A run is at most k + 1 minus the segments of the plans still outstanding (with
overlapped scheduling, k after a one-segment plan and 1 after a k-segment one), so at
most k + 1 segments are on the device at once: an event (an arrival, a finish) is acted
on in the next plan, at a segment boundary, after at most k + 1 segments (k = 1: two,
as before). Pauses land on segment boundaries, and a paused batch resumes at the
segment where it stopped. The predicted remaining time counts (k + 1) / 2 segments a
plan.

Decodes, if any, run through all layers in the plans whose segment begins one of the
batch's layered groups (co-located mode; see `decodes_now`); a run stops before such a
segment while decodes are running. With
`EngineConfig.prefill_only` every request ends at its first token, the setting of the
FlowPrefill paper (the prefill instance of a disaggregated deployment).
"""

from __future__ import annotations

from dataclasses import dataclass

from lp_jax.core.config import SchedulerConfig
from lp_jax.core.layer_groups import num_layer_groups, split_layers
from lp_jax.core.plan import PrefillChunk, StepPlan
from lp_jax.core.policies.base import PrefillPart
from lp_jax.core.policies.pausable import PausableBatches
from lp_jax.core.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class _Batch:
    batch_id: int
    chunks: list[PrefillChunk]
    rows: list[int]  # hidden-buffer row of each chunk's first token
    slot: int  # row area
    segments: tuple[tuple[int, int], ...]  # unit spans, in order
    decode_units: frozenset[int]  # segment starts that decodes ride with (group starts)
    index: int = 0  # the segment the next plan runs

    @property
    def seqs(self) -> list[Sequence]:
        return [c.seq for c in self.chunks]


class FlowPrefillPolicy(PausableBatches):
    """Event-driven slack-aware EDF over preemptible prefill batches."""

    name = "flowprefill"
    uses_latency = True  # slack = deadline - now - predicted remaining prefill

    def __init__(self, sched) -> None:
        super().__init__(sched)
        cfg = sched.config
        # A preemptible layered batch (preemptible=True) pauses at its group boundaries.
        self.granularity = "group" if cfg.preemptible else cfg.preemption_granularity
        self.alpha = cfg.slo_alpha
        self.reference = cfg.flowprefill_rules == "reference"
        self.lookahead = cfg.flowprefill_lookahead
        self._plan_segments: dict[int, int] = {}  # step id -> segments, outstanding plans
        self._load_at, self._load = None, (0, 0)  # decodes (rows, context) at a plan

    @staticmethod
    def default_budget(cfg: SchedulerConfig) -> int:
        """The reference code's token bound (2048) under its rules; a preemptible layered
        batch keeps layered's budget (and programs)."""
        if cfg.preemptible:
            return cfg.policy.default_budget(cfg)
        return 2048 if cfg.flowprefill_rules == "reference" else 8192

    def on_advance(self, plan: StepPlan) -> None:
        b = self._find(plan.prefill_batch_id)
        if b is None:
            return
        while b.index < len(b.segments) and b.segments[b.index][0] < plan.unit_end:
            b.index += 1  # every segment of the plan's run
        if b.index == len(b.segments):
            self._remove(b)
            self._event = True

    def in_flight(self) -> tuple[Sequence, ...]:
        return ()  # an aborted member leaves its batch at once (see _drop_seq)

    def decodes_now(self) -> bool:
        """Decodes ride with the segments that begin one of the batch's layered groups
        (the paper's G rule), so they step as often as under layered prefill while the
        preemption points stay at the chosen granularity."""
        b = self._running
        return b is None or b.segments[b.index][0] in b.decode_units

    # ------------------------------------------------------------------ plans
    def schedule_prefill(self, num_decode: int, admit: bool) -> PrefillPart:
        if self._event:
            self._round(admit)
        b = self._running
        if b is None:
            return PrefillPart((), None)
        n = self._run_length(b)
        a, e = b.segments[b.index][0], b.segments[b.index + n - 1][1]
        return PrefillPart(tuple(b.chunks), b.batch_id, group_index=b.index,
                           num_groups=len(b.segments), unit_start=a, unit_end=e,
                           rows=tuple(b.rows))

    def _run_length(self, b: _Batch) -> int:
        """How many of b's segments, from its next one, the plan being made carries
        (module docstring, "Lookahead"): at most k, and at most k + 1 minus the segments
        still outstanding, so that no more than k + 1 are on the device at once; a run
        stops before a segment decodes ride with (co-located mode), so they still step
        at every group start."""
        k, left = self.lookahead, len(b.segments) - b.index
        if k == 1 or left == 1:
            return 1
        outstanding = self.sched.outstanding_plans
        self._plan_segments = {p.step_id: self._plan_segments.get(p.step_id, 1)
                               for p in outstanding}
        queued = sum(self._plan_segments.values())
        n = max(1, min(k, k + 1 - queued, left))
        if self.sched.running:
            n = next((j for j in range(1, n)
                      if b.segments[b.index + j][0] in b.decode_units), n)
        self._plan_segments[self.sched.next_step_id] = n
        return n

    def _round(self, admit: bool) -> None:
        now, batches, free = self._begin_round(admit)
        ranked = sorted([(self._batch_key(b, now), 0, b) for b in batches]
                        + [(self._seq_key(q, now), 1, q) for q in free],
                        key=lambda t: t[:2])
        target, blocked = None, False
        for i, (_, is_seq, top) in enumerate(ranked):
            if not is_seq:
                target = top
                break
            if not self._free_slots or (blocked and top.status is SequenceStatus.WAITING):
                continue  # it cannot start now: the best batch or admitted request goes on
            # Admission is head-of-line: once the top waiting request cannot be admitted,
            # no lower one is (admitted, partly prefilled requests still run).
            target = self._form_batch([q for _, k, q in ranked[i:] if k and not (
                blocked and q.status is SequenceStatus.WAITING)], now)
            if target is not None:
                break
            blocked = True
        self._switch(target)

    # ------------------------------------------------------------------ ranking
    def _seq_key(self, q: Sequence, now: float) -> tuple:
        start = self.sched.prefill_start(q)  # a waiting request's cached prefix is free
        remaining = self._remaining([(q.prefill_target - start, start)], 0)
        return self._key(q.priority, q.deadline, now, remaining, q.arrival_time, q.seq_id)

    def _batch_key(self, b: _Batch, now: float) -> tuple:
        remaining = self._remaining([(c.num_tokens, c.start) for c in b.chunks],
                                    b.segments[b.index][0], len(b.segments) - b.index)
        if self.reference:  # the reference code ranks a batch by its head request
            head = b.seqs[0]
            return self._key(head.priority, head.deadline, now, remaining,
                             head.arrival_time, head.seq_id)
        first = min(b.seqs, key=lambda q: (q.priority, q.deadline, q.arrival_time))
        return self._key(first.priority, min(q.deadline for q in b.seqs), now, remaining,
                         first.arrival_time, first.seq_id)

    def _key(self, priority, deadline, now, remaining, arrival, seq_id) -> tuple:
        """Sort key, lowest runs first (module docstring: the rules)."""
        if self.reference:  # sign(slack) / deadline, highest first
            if deadline - now - remaining > 0:
                return (priority, False, deadline, arrival, seq_id)
            return (priority, True, -deadline, arrival, seq_id)
        infeasible = deadline - now - remaining < 0
        return (priority, infeasible, deadline, arrival, seq_id)

    def _remaining(self, chunks_TP, start_unit: int, segments: int | None = None) -> float:
        """Predicted time to run chunks from `start_unit` to the end of the stack, next
        to the decodes as they are now."""
        s = self.sched
        if segments is None:
            segments = self._num_segments(sum(t for t, _ in chunks_TP))
        if self.lookahead > 1:  # runs of k and of one alternate: (k + 1) / 2 a plan
            segments = max(1, -(-2 * segments // (self.lookahead + 1)))
        if self._load_at != s.next_step_id:  # once per plan's ranking, not per candidate
            self._load_at = s.next_step_id
            self._load = (sum(map(s.max_decode_rows, s.running)),
                          sum(q.num_tokens for q in s.running))
        B, ctx = self._load
        return s.latency.prefill_seconds(chunks_TP, start_unit, 2 * s.config.num_layers,
                                         segments=segments, num_decode=B, decode_context=ctx)

    # ------------------------------------------------------------------ batches
    def _form_batch(self, candidates: list[Sequence], now: float) -> _Batch | None:
        """SLO-aware batching from candidates in rank order (a row area is free); None if
        the first cannot be admitted."""
        if self.reference:
            return self._form_batch_reference(candidates, now)
        s, cfg = self.sched, self.sched.config
        chunks: list[PrefillChunk] = []
        left = cfg.max_num_batched_tokens
        for q in candidates:
            # A waiting request starts after its cached prefix, which admission (just
            # below, with the pool unchanged in between) takes as computed.
            start = s.prefill_start(q)
            n = min(q.prefill_target - start, left)
            if n < q.prefill_target - start and chunks:
                break  # prompts are cut only when they open a batch
            trial = chunks + [PrefillChunk(q, start, start + n)]
            if chunks and not self._keeps_slo(trial, now):
                break
            if q.status is SequenceStatus.WAITING and s.admit(q) is None:
                break
            chunks = trial
            left -= n
            if left == 0:
                break
        return self._new_batch(chunks)

    def _form_batch_reference(self, candidates: list[Sequence], now: float) -> _Batch | None:
        """The reference code's SLO-aware batching (module docstring)."""
        s, left = self.sched, self.sched.config.max_num_batched_tokens
        head, rest = candidates[0], candidates[1:]
        start = s.prefill_start(head)  # the cached prefix admission takes as computed
        need = head.prefill_target - start
        if head.status is SequenceStatus.WAITING and s.admit(head) is None:
            return None
        chunks = [PrefillChunk(head, start, start + min(need, left))]
        left -= chunks[0].num_tokens
        slo = head.slo.ttft_s if head.slo is not None else None
        margin = None if slo is None else self.alpha * slo
        if need > chunks[0].num_tokens or (margin is not None
                                           and head.deadline - now < margin):
            rest = []  # over the bound, or too urgent to share: the head runs alone
        for q in rest:
            if left == 0:
                break
            start = s.prefill_start(q)
            n = q.prefill_target - start
            if n > left:
                continue  # it would take the batch over the bound
            trial = chunks + [PrefillChunk(q, start, start + n)]
            if margin is not None and head.deadline - now - self._remaining(
                    [(c.num_tokens, c.start) for c in trial], 0) < margin:
                break  # the head's margin is spent: nothing more joins
            if q.status is SequenceStatus.WAITING and s.admit(q) is None:
                continue
            chunks = trial
            left -= n
        return self._new_batch(chunks)

    def _new_batch(self, chunks: list[PrefillChunk]) -> _Batch | None:
        if not chunks:
            return None
        s = self.sched
        slot, rows = self._take_rows(chunks)
        tokens = sum(c.num_tokens for c in chunks)
        return _Batch(s.new_batch_id(), chunks, rows, slot, self._segments(tokens),
                      frozenset(a for a, _ in self._segments(tokens, "group")))

    def _keeps_slo(self, chunks: list[PrefillChunk], now: float) -> bool:
        """lp_jax rules: every member that can still make its deadline keeps slack >=
        alpha * its SLO."""
        t = self._remaining([(c.num_tokens, c.start) for c in chunks], 0)
        for c in chunks:
            slo = c.seq.slo
            if slo is None or slo.ttft_s is None or not c.samples:
                continue
            alone = self._remaining([(c.num_tokens, c.start)], 0)
            if c.seq.deadline - now - alone < 0:
                continue  # already infeasible: batching cannot break it
            if c.seq.deadline - now - t < self.alpha * slo.ttft_s:
                return False
        return True

    def _num_segments(self, tokens: int) -> int:
        L = self.sched.config.num_layers
        if self.granularity == "operator":
            return 2 * L
        if self.granularity == "layer":
            return L
        cfg = self.sched.config
        return num_layer_groups(tokens, cfg.layer_groups, max_layer_groups=cfg.max_layer_groups,
                                num_layers=L)

    def _segments(self, tokens: int, granularity: str | None = None):
        """The unit spans a batch of `tokens` runs in, at `granularity` (default: the
        policy's)."""
        cfg = self.sched.config
        L = cfg.num_layers
        granularity = granularity or self.granularity
        if granularity == "operator":
            return tuple((u, u + 1) for u in range(2 * L))
        if granularity == "layer":
            return tuple((2 * i, 2 * i + 2) for i in range(L))
        g = num_layer_groups(tokens, cfg.layer_groups, max_layer_groups=cfg.max_layer_groups,
                             num_layers=L)
        return tuple((2 * a, 2 * b) for a, b in split_layers(L, g))
