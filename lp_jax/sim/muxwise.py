"""MuxWise's policy in the simulator: SM partitions and prefill launches, one MuxWise
iteration a plan, priced by the partition cost model of muxwise_cost.py (which also
says why this runs only in the simulator).

Policy (`MuxWisePolicy`, a `Policy` for the engine's own `Scheduler`; the core does queues,
pages, decodes and preemption as for every policy):
- partition: the smallest decode share on a grid of `sm_steps` steps (ASSUMED 16: Green
  Contexts hand out SMs in groups; 132 SMs / 8 ~ 16) whose decode step, with the prefill
  launch's contention, ends within guard x TBT SLO; prefill gets the rest. The TBT SLO is
  the policy's `tbt_slo_s`, tightened by any running request's own `SLO.tbt_s`. With no
  decodes the prefill gets the whole device (the "move remaining layers to a larger
  partition" step), with no prefill the decodes do.
- launches: the most operator units of the running batch whose launch ends no later than
  the decode step (at least one unit); with no decodes, the most that fit guard x TBT SLO
  (a quantum, so arrivals are looked at and decodes start soon). When the batch's whole
  remainder fits, there is no prefill backlog for the large partition (one plan carries
  one launch), so the prefill share drops to the one with the shortest iteration that
  still runs the remainder within the target: the decodes get the SMs prefill would idle.
- the predictor (`MuxWiseOptions.predictor`, muxwise_predict.py): "oracle", this cost model
  itself (exact: the simulated MuxWise is then an upper bound as far as prediction error
  goes), or "estimator", the engine's `LatencyModel` from a noisy offline profile with
  per-partition factors and a contention guard, learning online from what each iteration
  measured (`Launch.observe`).
- async launches (`launches="async"`, muxwise_cost.py): a launch may end after the decode
  step; its carry is predicted as measured at the last iteration and runs first on the
  prefill stream, and a launch is sized so that its midpoint-of-last-unit finish is within
  the decode step (no prefill-partition idle from rounding down); with no room left (the
  carry alone outlasts the decode step) the plan launches nothing and the carry runs on.
- batches: one runs, up to `max_paused_prefills` are paused, each with its own hidden-row
  area (as FlowPrefill's). Scheduling rounds run on events (arrival, finish, preemption,
  pages coming back, a batch ending). Order: priority, then requests that can still meet
  their TTFT deadline (predicted at full device) before those that cannot, then deadline,
  then arrival (FCFS without SLOs). Between launches the running batch is paused for a
  more urgent candidate (higher priority, or an earlier deadline) or for short requests:
  ones whose prompt is at most `preempt_ratio` of the running batch's remaining
  token-units (remaining tokens x share of units left); when nothing runs, short requests
  (vs the best candidate's next batch) start first; never where that would make the
  candidate they pass miss a TTFT deadline it can still meet. A batch short requests
  started is only preempted by priority. A new batch takes whole prompts in rank order up
  to the token budget (the first may be cut), while every member that can still meet its
  deadline keeps doing so at the current prefill share (whole-device time / that share).
  `preempt_ratio` 0.25 is ASSUMED (the paper gives no rule for "short").

Local axis letters (beyond docs/glossary.md): O = ops of a stream, W = points of the SM-share
grid (share (w + 1) / sm_steps), U = operator units of the stack (U1: U + 1 prefix sums).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lp_jax.core.plan import PrefillChunk, StepPlan
from lp_jax.core.policies.base import PrefillPart
from lp_jax.core.policies.pausable import PausableBatches
from lp_jax.core.sequence import Sequence, SequenceStatus
from lp_jax.sim.muxwise_cost import Launch, Measured, Overlap, PartitionCostModel
from lp_jax.sim.muxwise_predict import UnitTable, make_predictor

_INF = float("inf")


@dataclass(slots=True)
class _Batch:
    batch_id: int
    chunks: list[PrefillChunk]
    rows: list[int]
    slot: int
    unit: int = 0  # the next unit to launch
    protected: bool = False  # started by short requests: only urgency preempts it
    table: UnitTable | None = None

    @property
    def seqs(self) -> list[Sequence]:
        return [c.seq for c in self.chunks]

    @property
    def tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


@dataclass(slots=True)
class _Counters:
    launches: int = 0
    overlapped: int = 0  # launches next to decodes
    units: int = 0
    share_sum: float = 0.0  # prefill share, over overlapped launches
    repartitions: int = 0
    short_preemptions: int = 0  # short requests started ahead of a longer batch
    deadline_preemptions: int = 0
    fallback_partitions: int = 0  # no share met the TBT target
    decode_only: int = 0  # fallbacks that ran the decodes alone (decode SLO first)
    carry_waits: int = 0  # async: plans that launched nothing, the carry still running
    predicted: int = 0  # overlapped iterations with a prediction, and its error summed:
    decode_err: float = 0.0  # |predicted - measured| / measured decode finish
    prefill_err: float = 0.0  # the same for the prefill stream's finish


class MuxWisePolicy(PausableBatches):
    """MuxWise's partitioning and layer-wise prefill launches (module note). Bind a cost
    model and a TBT SLO with `muxwise_policy` before handing it to a `Scheduler`."""

    name = "muxwise"
    cost_model: PartitionCostModel
    tbt_slo_s: float

    def __init__(self, sched) -> None:
        super().__init__(sched)
        if not hasattr(self, "cost_model"):
            raise TypeError("bind a cost model first: muxwise_policy(model, tbt_slo_s)")
        cfg = sched.config
        self.options = self.cost_model.options
        self._units = 2 * cfg.num_layers
        self._share = 0.0  # the current partition's prefill share
        self._launches: dict[int, Launch] = {}
        self.counters = _Counters()
        self.predictor = make_predictor(self.cost_model, cfg.num_layers)
        self._async = self.options.launches == "async"
        self._carry = 0.0  # async: prefill work the last iteration left, as measured
        self._expect: tuple[int | None, Overlap | None] = (None, None)

    # ------------------------------------------------------------------ protocol
    def take_launch(self, step_id: int) -> Launch:
        """The partition the policy chose for plan `step_id` (once per plan)."""
        return self._launches.pop(step_id)

    def on_advance(self, plan: StepPlan) -> None:
        b = self._find(plan.prefill_batch_id)
        if b is None:
            return
        b.unit = plan.unit_end
        if b.unit == self._units:
            self._remove(b)
            self._event = True

    def stats(self) -> dict[str, float]:
        c = self.counters
        return {
            "muxwise_launches": float(c.launches),
            "muxwise_units_per_launch": c.units / c.launches if c.launches else math.nan,
            "muxwise_mean_prefill_share": (
                c.share_sum / c.overlapped if c.overlapped else math.nan),
            "muxwise_overlapped_launches": float(c.overlapped),
            "muxwise_repartitions": float(c.repartitions),
            "muxwise_short_preemptions": float(c.short_preemptions),
            "muxwise_deadline_preemptions": float(c.deadline_preemptions),
            "muxwise_fallback_partitions": float(c.fallback_partitions),
            "muxwise_decode_only_fallbacks": float(c.decode_only),
            "muxwise_carry_waits": float(c.carry_waits),
            "muxwise_decode_pred_error": c.decode_err / c.predicted if c.predicted else math.nan,
            "muxwise_prefill_pred_error": (
                c.prefill_err / c.predicted if c.predicted else math.nan),
        }

    # ------------------------------------------------------------------ one plan
    def schedule_prefill(self, num_decode: int, admit: bool) -> PrefillPart:
        if self._event:
            self._round(admit)
        b = self._running
        if b is None:
            self._record(0.0, 0)
            return PrefillPart((), None)
        self._expect = (None, None)
        share, k = self._choose_launch(b, num_decode)
        self._record(share, k)
        if not k:
            return PrefillPart((), None)
        a, e = b.unit, b.unit + k
        return PrefillPart(tuple(b.chunks), b.batch_id, group_index=a, num_groups=self._units,
                           unit_start=a, unit_end=e, rows=tuple(b.rows))

    def _record(self, share: float, units: int) -> None:
        c = self.counters
        changed = share != self._share
        c.repartitions += changed
        if units:
            c.launches += 1
            c.units += units
            if share < 1.0:
                c.overlapped += 1
                c.share_sum += share
        w, expected = self._expect
        self._launches[self.sched.next_step_id] = Launch(
            share, changed, lambda plan, m: self._observe(plan, w, expected, m))
        self._share = share

    def _observe(self, plan: StepPlan, w: int | None, expected: Overlap | None,
                 measured: Measured) -> None:
        self._carry = measured.carry_s
        if expected is not None and measured.decode_s > 0 and measured.prefill_s > 0:
            c = self.counters
            c.predicted += 1
            c.decode_err += abs(expected.decode_s - measured.decode_s) / measured.decode_s
            c.prefill_err += abs(expected.prefill_s - measured.prefill_s) / measured.prefill_s
        self.predictor.observe(plan, w, expected, measured)

    def _tbt_target(self) -> float:
        tbt = self.tbt_slo_s
        for q in self.sched.running:
            if q.slo is not None and q.slo.tbt_s is not None:
                tbt = min(tbt, q.slo.tbt_s)
        return self.options.guard * tbt

    def _choose_launch(self, b: _Batch, num_decode: int) -> tuple[float, int]:
        """(prefill share, units to launch) for the running batch's next launch."""
        table = self._table(b)
        left = self._units - b.unit
        target = self._tbt_target()
        pred, n = self.predictor, self.options.sm_steps
        if not num_decode:  # the whole device, for a quantum
            return 1.0, _last_true(1, left, lambda k: pred.whole_launch(table, b.unit, k)
                                   <= target)
        dec = pred.decode(self.sched.running)
        carry = self._carry if self._async else 0.0
        order = list(range(n - 2, -1, -1))  # prefill share (w + 1) / n, largest first
        cur = round(self._share * n) - 1
        if carry and 0 <= cur < n - 1:  # a repartition would drain the carry: keep it
            order.remove(cur)
            order.insert(0, cur)
        for w in order:
            if pred.decode_alone(dec, w) > target:
                continue
            k = self._fit_units(table, w, b.unit, left, dec, target, carry)
            if k == left:  # the rest fits: no backlog for the big partition
                w = self._quickest_share(table, w, b.unit, left, dec, target, carry)
            if k:
                self._expect = (w, pred.overlap(table, w, b.unit, k, dec, carry))
                return float(self.cost_model.shares_W[w]), k
            if self._async and carry and pred.overlap(table, w, b.unit, 1, dec,
                                                      carry).decode_s <= target:
                self.counters.carry_waits += 1  # the stream is busy: the carry runs on
                self._expect = (w, pred.overlap(table, w, b.unit, 0, dec, carry))
                return float(self.cost_model.shares_W[w]), 0
        self.counters.fallback_partitions += 1
        if pred.decode_whole(dec) <= target:
            self.counters.decode_only += 1  # the decode SLO first: no launch this step
            return 0.0, 0
        return float(self.cost_model.shares_W[0]), 1

    def _fit_units(self, table: UnitTable, w: int, a: int, left: int, dec, target: float,
                   carry: float) -> int:
        """Most units (>= 1) whose launch on share w ends by the decode step (async: its
        last unit's midpoint does, after the carry), which must meet the TBT target; 0 if
        even one unit breaks it (async: or the carry alone outlasts the decode step)."""
        pred = self.predictor
        one = pred.overlap(table, w, a, 1, dec, carry)
        if not self._async:
            if one.seconds > target:
                return 0
            return _last_true(1, left, lambda k: (o := pred.overlap(table, w, a, k, dec))
                              .prefill_s <= o.decode_s and o.decode_s <= target)
        if one.decode_s > target or carry >= one.decode_s:
            return 0

        def fits(k: int) -> bool:
            o = pred.overlap(table, w, a, k, dec, carry)
            mid = 0.5 * (o.prefill_s + pred.overlap(table, w, a, k - 1, dec, carry).prefill_s)
            return mid <= o.decode_s and o.decode_s <= target

        return _last_true(1, left, fits)

    def _quickest_share(self, table: UnitTable, w: int, a: int, left: int, dec,
                        target: float, carry: float) -> int:
        """When the batch's remaining units all fit next to the decode step on share w:
        the prefill share (<= w) with the shortest iteration that still runs them all
        within the TBT target, so the decodes get the SMs the prefill would leave idle."""
        pred = self.predictor
        best, best_s = w, pred.overlap(table, w, a, left, dec, carry).seconds
        for v in range(w - 1, -1, -1):
            o = pred.overlap(table, v, a, left, dec, carry)
            if o.seconds < best_s and o.decode_s <= target:
                best, best_s = v, o.seconds
            elif o.prefill_s > best_s:
                break  # smaller shares only lengthen the prefill
        return best

    # ------------------------------------------------------------------ batches
    def _table(self, b: _Batch) -> UnitTable:
        if b.table is None:
            b.table = self.predictor.table(b.chunks, b.batch_id)
        return b.table

    def _round(self, admit: bool) -> None:
        now, _, free = self._begin_round(admit)
        free.sort(key=lambda q: self._seq_key(q, now))
        r = self._running
        if r is None:
            self._start_best(free, now)
            return
        self._maybe_preempt(r, free, now)

    def _start_best(self, free: list[Sequence], now: float) -> None:
        """Nothing runs: short requests (vs the best candidate's work), else the best paused
        batch or a new batch, whichever ranks first."""
        best = min(self._paused, key=lambda b: self._batch_key(b, now), default=None)
        head = bool(free) and (best is None
                               or self._seq_key(free[0], now) < self._batch_key(best, now))
        if head:
            work = min(_need(free[0]), self.sched.config.max_num_batched_tokens)
            deadline, rest = free[0].deadline, self._solo_s(work, free[0].num_computed_tokens)
        elif best is not None:
            work, deadline, rest = self._work(best), self._batch_deadline(best), \
                self._batch_rest_s(best)
        else:
            work, deadline, rest = 0.0, _INF, 0.0
        short = self._shorts(free, work, deadline, rest, now)
        for group, is_short in ((short, True), (free if head else [], False)):
            new = self._form_batch(group, now) if group else None
            if new is not None:
                new.protected = is_short
                self.counters.short_preemptions += is_short
                self._switch(new)
                return
        if best is not None:
            self._switch(best)

    def _maybe_preempt(self, r: _Batch, free: list[Sequence], now: float) -> None:
        """Between launches: pause the running batch for a more urgent candidate (higher
        priority; or, unless short requests started it, an earlier feasible deadline) or
        for short requests."""
        urgent = self._urgency_test(r, now)
        ahead = [b for b in self._paused if urgent(self._batch_key(b, now))]
        best = min(ahead, key=lambda b: self._batch_key(b, now), default=None)
        cands = [q for q in free if urgent(self._seq_key(q, now))]
        if best is not None and (not cands
                                 or self._batch_key(best, now) < self._seq_key(cands[0], now)):
            self.counters.deadline_preemptions += 1
            self._switch(best)
            return
        short = self._shorts(free, self._work(r), self._batch_deadline(r), self._batch_rest_s(r),
                             now)
        for group, is_short in ((cands, False), (short, True)):
            new = self._form_batch(group, now) if group else None
            if new is not None:
                new.protected = is_short
                if is_short:
                    self.counters.short_preemptions += 1
                else:
                    self.counters.deadline_preemptions += 1
                self._switch(new)
                return

    def _shorts(self, free: list[Sequence], work: float, deadline: float, rest_s: float,
                now: float) -> list[Sequence]:
        """Requests short enough (<= preempt_ratio x `work` tokens) to go before a
        candidate with `work` tokens left, `rest_s` predicted seconds and `deadline`,
        unless going first would make it miss a deadline it can still meet."""
        limit = self.options.preempt_ratio * work
        short = [q for q in free if _need(q) <= limit]
        if not short or deadline == _INF or now + rest_s > deadline:
            return short
        share = self._share if 0 < self._share else 1.0
        budget = self.sched.config.max_num_batched_tokens
        first = min(sum(_need(q) for q in short), budget)
        if now + (rest_s + self._solo_s(first, 0)) / share > deadline:
            return []
        return short

    def _batch_deadline(self, b: _Batch) -> float:
        return min(q.deadline for q in b.seqs)

    def _batch_rest_s(self, b: _Batch) -> float:
        """Predicted seconds of the batch's remaining units at the whole device."""
        return self._table(b).ops(self.options.sm_steps - 1, b.unit, self._units)

    def _urgency_test(self, r: _Batch, now: float):
        """key -> whether that candidate may preempt the running batch `r`."""
        pr, infeasible, deadline = self._batch_key(r, now)[:3]

        def urgent(key: tuple) -> bool:
            if key[0] != pr:
                return key[0] < pr
            return not r.protected and key[1:3] < (infeasible, deadline)

        return urgent

    def _form_batch(self, cands: list[Sequence], now: float) -> _Batch | None:
        """Whole prompts in rank order within the token budget (the first may be cut);
        waiting requests are admitted head-of-line. None if the first cannot start."""
        s, cfg = self.sched, self.sched.config
        if not self._free_slots:
            return None
        chunks: list[PrefillChunk] = []
        left = cfg.max_num_batched_tokens
        for q in cands:
            need = q.prefill_target - q.num_computed_tokens
            n = min(need, left)
            if chunks and n < need:
                break
            trial = chunks + [PrefillChunk(q, q.num_computed_tokens, q.num_computed_tokens + n)]
            if chunks and not self._keeps_deadlines(trial, now):
                break
            if q.status is SequenceStatus.WAITING and s.admit(q) is None:
                break
            chunks, left = trial, left - n
            if not left:
                break
        if not chunks:
            return None
        slot, rows = self._take_rows(chunks)
        return _Batch(s.new_batch_id(), chunks, rows, slot)

    def _keeps_deadlines(self, chunks: list[PrefillChunk], now: float) -> bool:
        """Every member that can make its deadline alone still does in the batch, at the
        current prefill share."""
        share = self._share if 0 < self._share else 1.0
        together = sum(self._solo_s(c.num_tokens, c.start) for c in chunks) / share
        for c in chunks:
            if c.seq.deadline == _INF or not c.samples:
                continue
            alone = self._solo_s(c.num_tokens, c.start) / share
            if now + alone <= c.seq.deadline < now + together:
                return False
        return True

    # ------------------------------------------------------------------ ranking
    def _solo_s(self, tokens: int, start: int) -> float:
        """Predicted prefill seconds of `tokens` after `start` cached ones, whole device."""
        return self.predictor.solo_s(tokens, start)

    def _work(self, b: _Batch) -> float:
        """Remaining token-units of a batch, in tokens."""
        return b.tokens * (self._units - b.unit) / self._units

    def _seq_key(self, q: Sequence, now: float) -> tuple:
        deadline = q.deadline
        infeasible = False
        if deadline != _INF:
            n = q.prefill_target - q.num_computed_tokens
            infeasible = now + self._solo_s(n, q.num_computed_tokens) > deadline
        return (q.priority, infeasible, deadline, q.arrival_time, q.seq_id)

    def _batch_key(self, b: _Batch, now: float) -> tuple:
        first = min(b.seqs, key=lambda q: (q.priority, q.deadline, q.arrival_time, q.seq_id))
        deadline = self._batch_deadline(b)
        infeasible = deadline != _INF and now + self._batch_rest_s(b) > deadline
        return (first.priority, infeasible, deadline, first.arrival_time, first.seq_id)

    # ------------------------------------------------------------------ bookkeeping
    def _drop_seq(self, seq: Sequence):
        b = super()._drop_seq(seq)
        if b is not None:
            b.table = None  # its unit costs change with its chunks
        return b


def _need(q: Sequence) -> int:
    """Prompt tokens a sequence still has to prefill."""
    return q.prefill_target - q.num_computed_tokens


def _last_true(lo: int, hi: int, pred) -> int:
    """Largest k in [lo, hi] with pred(k), pred monotone (true then false); lo if none."""
    if pred(hi):
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if pred(mid):
            lo = mid
        else:
            hi = mid
    return lo


def muxwise_policy(model: PartitionCostModel, tbt_slo_s: float) -> type[MuxWisePolicy]:
    """A `MuxWisePolicy` class bound to a cost model and a TBT SLO: a SchedulerConfig's
    `policy`."""
    if not (math.isfinite(tbt_slo_s) and tbt_slo_s > 0):
        raise ValueError(f"tbt_slo_s must be > 0, got {tbt_slo_s}")
    return type("BoundMuxWisePolicy", (MuxWisePolicy,),
                {"cost_model": model, "tbt_slo_s": float(tbt_slo_s)})
