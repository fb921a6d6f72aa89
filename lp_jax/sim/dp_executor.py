"""Data-parallel attention beside expert parallelism in the simulator: the step's cost when
the scheduler places every sequence on one of d attention ranks.

Design note. The mesh is the engine's (d, 1, t) on n = d t chips (docs/data_parallel.md):
rank r runs its own sequences' rows through attention on its t chips and keeps their KV
in its own pages; the experts split over all n chips. The scheduler is the engine's, with
`data_parallel_size = d` (its RankedBlockManager places each sequence at admission), and
the executor asks it which rank holds each sequence (`rank_of`). The step is SPMD in the
per-rank row layout the engine is built towards, so per chip:

* every op on a rank's own rows (projections, router, shared experts, dense MLP) runs
  the busiest rank's rows, max_r n_r, on every rank: the base executor's ops timed at
  d max_r n_r rows over ep = d ranks, i.e. the idle ranks' padding costs time; the
  routed experts run the real rows only (the all_to_all is ragged: padding reaches no
  expert), spread over all n chips;
* attention is the busiest rank's: each rank's decodes and chunks on its own t chips,
  and the step waits for the rank whose attention takes longest;
* the lm_head runs the busiest rank's sampled rows;
* link bytes a layer are `roofline.dp_attention.dp_link_bytes_per_layer` at the padded
  rows per rank: the o_proj all-reduce over t, the MoE all_to_all from the rank's rows to
  the experts' owners among n chips and back, the gather of the combined rows inside the
  rank; each overlaps the op that produces it (the base model's rule).

The padding the SPMD step costs (d max_r n_r - sum_r n_r rows a plan) is counted twice: by
the scheduler's own `count_rows`, per plan, as the engine counts it, and by `balance`, per
layer the rows cross (a layered prefill's chunk crosses 1 / G of the layers a plan), with
the link bytes; the simulator reports both.
"""

from __future__ import annotations

import dataclasses

from lp_jax.core.plan import StepPlan
from lp_jax.roofline.cost_model import LayerCost, StepTokens
from lp_jax.roofline.dp_attention import dp_link_bytes_per_layer
from lp_jax.sim.executor import _ATTENTION_HALF, _ATTENTION_OPS, CostModelExecutor, _Ops


@dataclasses.dataclass(slots=True)
class _RankRows:
    """One rank's share of a plan: decode rows, (summed context of its decode rows, of its
    sequences), the same within the sliding window, its prefill chunks (tokens, cached
    past) and its sampled rows."""

    decode: int = 0
    ctx: tuple[int, int] = (0, 0)
    slide: tuple[int, int] = (0, 0)
    pre: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    samples: int = 0


class DPCostModelExecutor(CostModelExecutor):
    """`CostModelExecutor` of mesh (dp, 1, tp); `rank_of(seq)` (the scheduler's
    `block_manager.rank_of`) must be set before `run`."""

    def __init__(self, shape, hardware, *, dp: int, tp: int = 1, **options) -> None:
        if dp < 2:
            raise ValueError(f"data-parallel attention needs dp >= 2 ranks, got {dp}")
        if not shape.is_moe:
            raise ValueError(f"data-parallel attention spreads experts; {shape.name} has none")
        self.dp = dp  # before the base's set-up, which costs layers through _layer
        super().__init__(shape, hardware, tp=tp, ep=dp, **options)
        self.rank_of = None
        self._ragged_cache: dict[tuple, _Ops] = {}
        self._ranks: list[_RankRows] = []  # the plan being costed, split by rank

    # ------------------------------------------------------------- the split
    def _split(self, plan: StepPlan) -> list[_RankRows]:
        if self.rank_of is None:
            raise RuntimeError("DPCostModelExecutor.rank_of is not set (the scheduler's "
                               "block_manager.rank_of)")
        ranks = [_RankRows() for _ in range(self.dp)]
        w = self._window
        drafts = plan.drafts or ((),) * len(plan.decode)
        for seq, d in zip(plan.decode, drafts, strict=True):
            r = ranks[self._rank(seq)]
            rows = [seq.num_tokens + j for j in range(len(d) + 1)]
            last = seq.num_tokens + len(d)
            r.decode += len(rows)
            r.ctx = (r.ctx[0] + sum(rows), r.ctx[1] + last)
            if w:
                r.slide = (r.slide[0] + sum(min(n, w) for n in rows), r.slide[1] + min(last, w))
        for c in plan.prefill:
            r = ranks[self._rank(c.seq)]
            r.pre.append((c.end - c.start, c.start))
            if plan.is_last_group:
                r.samples += c.samples
        return ranks

    def _rank(self, seq) -> int:
        r = self.rank_of(seq)
        if r is None:
            raise RuntimeError(f"seq {seq.seq_id} is in a plan but holds no pages on any rank")
        return r

    def _terms(self, plan: StepPlan):
        self._ranks = self._split(plan)
        return super()._terms(plan)

    def balance(self, plan: StepPlan) -> dict[str, float]:
        """What a plan runs, per chip: "rows" and "padded" (rows x the layers they cross,
        summed over the ranks: each rank's own rows, and the rows an idle or lighter rank
        pads to the busiest's), and "link_bytes" (DP attention's link bytes of one chip,
        over the layers the plan runs, the MoE terms on MoE layers only)."""
        ranks, d, L = self._split(plan), self.dp, self.shape.num_layers
        span = (plan.unit_end - plan.unit_start) / 2 if plan.prefill else 0.0
        dec = [r.decode for r in ranks]
        mix = [r.decode + sum(n for n, _ in r.pre) for r in ranks]
        moe = self.shape.num_moe_layers / L
        out = dict(rows=0.0, padded=0.0, link_bytes=0.0)
        for rows, layers in ((dec, L - span), (mix, span)):
            if not layers or not max(rows):
                continue
            out["rows"] += sum(rows) * layers
            out["padded"] += (d * max(rows) - sum(rows)) * layers
            link = dp_link_bytes_per_layer(self.shape, d, self.tp, max(rows))
            out["link_bytes"] += layers * (link["attention"] + moe * (
                link["dispatch"] + link["combine"] + link["gather"]))
        return out

    # ----------------------------------------------------------- padded rows
    def _time_rows(self, plan: StepPlan, B: int, n_pre: int) -> tuple[int, int]:
        """d times the busiest rank's rows (bucketed per rank): every rank runs them."""
        d, ranks = self.dp, self._ranks
        dec = max(r.decode for r in ranks)
        mix = max(r.decode + sum(n for n, _ in r.pre) for r in ranks) if plan.prefill else 0
        return (d * self._bucket(dec, self._buckets) if dec else 0,
                d * self._bucket(mix, self._buckets) if mix else 0)

    def _head_rows(self, plan: StepPlan) -> int:
        return self.dp * max(r.decode + r.samples for r in self._ranks)

    # ------------------------------------------------------------- attention
    # The base figures are per device of a balanced split over ep = d ranks, linear in
    # the rows and contexts; one rank's own rows on its t chips cost d times them.
    def _add_decode_attention(self, acc, k, count, B, ctx, slide) -> None:
        d = self.dp
        c, m, fl, by = max((self._decode_attention(k, r.decode, r.ctx, r.slide)
                            for r in self._ranks if r.decode), key=self._op_seconds)
        acc.terms.append((count, d * c, d * m))
        acc.flops += count * d * fl
        acc.nbytes += count * d * by

    def _add_prefill_attention(self, acc, k, count, pre) -> None:
        d = self.dp
        per_rank = []
        for r in self._ranks:
            if r.pre:
                parts = [self._prefill_attention(k, n, past) for n, past in r.pre]
                per_rank.append(tuple(sum(x) for x in zip(*parts, strict=True)))
        c, m, fl, by = max(per_rank, key=self._op_seconds)
        acc.terms.append((count, d * c, d * m))
        acc.flops += count * d * fl
        acc.nbytes += count * d * by

    def _op_seconds(self, cost) -> float:
        cal = self.calibration
        return max(cost[0] / cal.compute_efficiency, cost[1] / cal.bandwidth_efficiency)

    # ------------------------------------------------------- token-linear ops
    # Every op on a rank's rows runs the padded rows; the experts run the real ones: the
    # all_to_all is ragged, so padding reaches no expert (the link time is still the
    # busiest rank's, from `_layer`).
    def _lin(self, k: int, tokens: int, real: int | None = None) -> _Ops:
        return self._ragged_ops(k, tokens, None, real)

    def _lin_half(self, k: int, tokens: int, half: int, real: int | None = None) -> _Ops:
        return self._ragged_ops(k, tokens, half, real)

    def _ragged_ops(self, k: int, tokens: int, half: int | None, real: int | None) -> _Ops:
        key = (k, tokens, half, real)
        ops = self._ragged_cache.get(key)
        if ops is None:
            padded = self._layer(k, StepTokens(decode_seqs=tokens, decode_context=1))
            run = (self._layer(k, StepTokens(decode_seqs=real, decode_context=1))
                   if real and real != tokens else padded)
            kept = [dataclasses.replace(run.op("experts"), comm_bytes=op.comm_bytes)
                    if op.name == "experts" else op for op in padded.ops
                    if op.name not in _ATTENTION_OPS
                    and (half is None or (op.name in _ATTENTION_HALF) == (half == 0))]
            ops = self._ragged_cache[key] = _Ops(
                tuple(self._seconds(op) for op in kept),
                sum(op.flops + op.pad_flops for op in kept), sum(op.bytes for op in kept))
        return ops

    # ------------------------------------------------------------ link bytes
    def _layer(self, k: int, step: StepTokens) -> LayerCost:
        """The base layer with DP attention's link bytes at step.tokens / d rows a rank."""
        lc = super()._layer(k, step)
        link = dp_link_bytes_per_layer(self.shape, self.dp, self.tp, step.tokens / self.dp)
        comm = {"o_proj": link["attention"], "router": link["dispatch"] + link["combine"],
                "experts": link["gather"]}
        return LayerCost(tuple(dataclasses.replace(op, comm_bytes=comm[op.name])
                               if op.name in comm else op for op in lc.ops))
