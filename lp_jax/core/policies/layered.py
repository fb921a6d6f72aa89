"""Layered prefill (the paper's policy): one batch of prompt tokens crosses one group of
layers per iteration, next to decodes through every layer, so each layer sees each prompt
token once (its experts load once per batch, not once per chunk) and decodes never stall.
The group count G comes from the batch's tokens (layer_groups.py), or per iteration from
the latency estimator with layer_groups="adaptive"."""

from __future__ import annotations

from dataclasses import dataclass

from lp_jax.core.config import SchedulerConfig
from lp_jax.core.layer_groups import ADAPTIVE, num_layer_groups, split_layers
from lp_jax.core.plan import PrefillChunk, StepPlan
from lp_jax.core.policies.base import Policy, PrefillPart
from lp_jax.core.policies.flowprefill import FlowPrefillPolicy
from lp_jax.core.sequence import Sequence


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

    name = "layered"
    adaptive_groups = True
    rank_budgets = True
    preemptible_policy = FlowPrefillPolicy  # preemptible=True: pauses at group boundaries

    def __init__(self, sched) -> None:
        super().__init__(sched)
        self._batch: _LayeredBatch | None = None
        self.adaptive = sched.config.layer_groups == ADAPTIVE

    @staticmethod
    def default_budget(cfg: SchedulerConfig) -> int:
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
        return PrefillPart(b.chunks, b.batch_id, 2 * start, 2 * end, b.index,
                           len(b.groups) + more)

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
        budget = s.prefill_budget()  # under data-parallel attention, one a rank
        # The rest of a prompt cut by the previous batch goes first.
        chunks = self._continue_partials(budget)
        # Whole prompts while they fit (their rank's budget); a prompt longer than the
        # budget opens a batch (a rank's share of it) alone.
        while admit and s.waiting:
            seq = s.admit_head(budget.ranks(s.waiting[0]))
            if seq is None:
                break
            chunks.append(self._admitted_chunk(seq, budget))
        if not chunks:
            return None
        # G from the busiest rank's tokens: under SPMD a step's prefill costs its rows.
        g = num_layer_groups(
            budget.max_taken,
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
