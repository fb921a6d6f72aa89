"""Cost-model executor: a `StepPlan` in, predicted seconds, FLOPs, bytes and expert traffic out.

Design note. It stands where the JAX `ModelRunner` stands: the scheduler hands it a plan and
it says what the step costs, using `lp_jax.roofline.cost_model` for every op. A plan splits
the decoder stack in two layer sets:

- layers [layer_start, layer_end) of a plan with prefill run the prefill chunks and the
  decodes together, T = prefill tokens + decodes rows; the MoE loads the experts that the
  union of rows activates, E_act(T) from the routing model;
- every other layer runs the decodes alone (T = decodes); with no decodes it does not run.

Preemptible prefill segments (FlowPrefill) may start or end inside a layer: the prefill span
is [unit_start, unit_end) in operator units (unit 2i is layer i's attention half: qkv_proj,
attention, o_proj; unit 2i + 1 its MLP half: router + experts, or the dense MLP). A layer
whose attention half is in the span and MLP half is not (or the reverse) charges the
prefill rows to that half's ops only; the decodes still cross both halves of every layer.
With no decodes such a half layer counts 0.5 towards the per-layer overhead.

Per layer the token-linear ops (qkv_proj, o_proj, router, experts or dense_mlp) depend only
on T and the layer kind (MoE or dense, sliding or full attention), so they are cached per
(kind, T). Attention is linear in each sequence's visible context, so decode attention is
one multiply-add on the summed context (min(context, window) for sliding layers); prefill
attention is cached per (kind, chunk length, cached prefix). The lm_head runs on the rows
that sample. Each op's time is `Calibration.op_seconds(compute_s, memory_s)`; a step adds the
calibration's per-iteration and per-layer overheads.

Expert traffic uses the engine's definition: per MoE layer per step, activated experts times
one expert's bytes (whole model, not per device). FLOPs and HBM bytes are summed over the
tp * ep devices, for the energy model.

`segment_overhead_s` (None: the calibration's `overhead_s`) replaces the per-iteration
overhead of a plan that only continues a prefill batch between two segment boundaries
inside the stack: no decodes, no tokens to embed, no logits to sample, and (FlowPrefill
between events, or a layered batch's middle group) an O(1) scheduling decision. What is
left of the host's per-step work there is a launch or graph replay.

Optional `token_buckets` mimic the engine's padding of each call's rows to compiled sizes
(model_runner.py: decode rows alone, and prefill + decode rows in the prefill group), used
when calibrating against the real engine.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from lp_jax.core.plan import StepPlan
from lp_jax.roofline.cost_model import StepTokens, layer_cost, lm_head_cost
from lp_jax.roofline.hardware import Hardware
from lp_jax.roofline.model_shape import ModelShape
from lp_jax.roofline.routing import MeasuredRouting, Routing, ZipfRouting, expected_active
from lp_jax.sim.calibration import Calibration, StepFeatures

_ATTENTION_OPS = ("attn_prefill", "attn_decode")
_ATTENTION_HALF = ("qkv_proj", "o_proj")  # token-linear ops of unit 2i; the rest: 2i + 1


@dataclass(frozen=True, slots=True)
class StepCost:
    seconds: float
    flops: float  # summed over devices, tile padding included
    hbm_bytes: float  # summed over devices
    expert_bytes: float  # activated experts x expert bytes, over MoE layers (engine's count)
    layers: float  # decoder layers executed (a prefill-only half layer counts 0.5)


@dataclass(frozen=True, slots=True)
class _Ops:
    """Per-layer ops: (compute_s, memory_s) pairs at peak, FLOPs and bytes per device."""

    terms: tuple[tuple[float, float], ...]
    flops: float
    bytes: float


@dataclass(slots=True)
class _Acc:
    """A step's running totals: (count, compute_s, memory_s) terms, per-device FLOPs and
    bytes, expert bytes and layers executed."""

    terms: list[tuple[int, float, float]] = field(default_factory=list)
    flops: float = 0.0
    nbytes: float = 0.0
    expert_bytes: float = 0.0
    layers: float = 0  # stays an int unless a prefill-only half layer adds 0.5

    def add_ops(self, ops: _Ops, count: int) -> None:
        self.terms += [(count, c, m) for c, m in ops.terms]
        self.flops += count * ops.flops
        self.nbytes += count * ops.bytes


class CostModelExecutor:
    def __init__(
        self,
        shape: ModelShape,
        hardware: Hardware,
        *,
        tp: int = 1,
        ep: int = 1,
        routing: Routing | None = None,
        tile: int = 1,
        calibration: Calibration | None = None,
        token_buckets: tuple[int, ...] | None = None,
        segment_overhead_s: float | None = None,
    ) -> None:
        self.shape, self.hardware = shape, hardware
        if segment_overhead_s is not None and not segment_overhead_s >= 0:
            raise ValueError(f"segment_overhead_s must be >= 0, got {segment_overhead_s}")
        self.segment_overhead_s = segment_overhead_s
        self.tp, self.ep, self.tile = tp, ep, tile
        self.devices = tp * ep
        self.calibration = calibration or Calibration()
        self.routing = routing or ZipfRouting()
        self._buckets = tuple(sorted(token_buckets)) if token_buckets else None
        if shape.is_moe:  # solve the routing model once; layer_cost then reads a fixed table
            p_E = self.routing.probs_E(shape.num_experts, shape.top_k)
            self._fixed_routing: Routing = MeasuredRouting(tuple(float(p) for p in p_E))
        else:
            self._fixed_routing = self.routing
        L = shape.num_layers
        keys = [(shape.is_moe_layer(i), shape.is_sliding_layer(i)) for i in range(L)]
        self._kinds = sorted(set(keys))
        self._rep = [keys.index(k) for k in self._kinds]  # first layer of each kind
        kind_of = [self._kinds.index(k) for k in keys]
        self._kind_of = kind_of
        # prefix[k][i]: layers of kind k among layers [0, i)
        self._prefix = [[0] * (L + 1) for _ in self._kinds]
        for k in range(len(self._kinds)):
            for i in range(L):
                self._prefix[k][i + 1] = self._prefix[k][i] + (kind_of[i] == k)
        self._all = tuple(p[L] for p in self._prefix)
        self._window = shape.sliding_window
        self._attn_dec = [self._decode_attention_coeffs(k) for k in range(len(self._kinds))]
        self._lin_cache: dict[tuple[int, int], _Ops] = {}
        self._half_cache: dict[tuple[int, int, int], _Ops] = {}
        self._pre_cache: dict[tuple[int, int, int], tuple[float, float, float, float]] = {}
        self._head_cache: dict[int, tuple[float, float, float, float]] = {}
        self._experts_cache: dict[int, float] = {}
        self._range_cache: dict[tuple[int, int], tuple[int, ...]] = {}

    # ------------------------------------------------------------------ public
    def with_calibration(self, calibration: Calibration) -> CostModelExecutor:
        """A new executor with other factors (caches hold peak seconds, so they carry over)."""
        other = object.__new__(CostModelExecutor)
        for name in vars(self):
            setattr(other, name, getattr(self, name))
        other.calibration = calibration
        return other

    def features(self, plan: StepPlan) -> StepFeatures:
        terms, _, _, _, layers = self._terms(plan)
        compute = tuple(n * c for n, c, _ in terms)
        memory = tuple(n * m for n, _, m in terms)
        return StepFeatures(compute, memory, layers)

    def run(self, plan: StepPlan) -> StepCost:
        terms, flops, nbytes, expert_bytes, layers = self._terms(plan)
        cal = self.calibration
        ic, ib = 1.0 / cal.compute_efficiency, 1.0 / cal.bandwidth_efficiency
        seconds = sum(n * max(c * ic, m * ib) for n, c, m in terms)
        if layers:
            seconds += self._step_overhead(plan) + cal.layer_overhead_s * layers
        d = self.devices
        return StepCost(seconds, flops * d, nbytes * d, expert_bytes, layers)

    def _step_overhead(self, plan: StepPlan) -> float:
        """Per-iteration overhead: `segment_overhead_s` for a plan that only continues a
        prefill batch mid-stack (no decodes, nothing to embed or sample), else the
        calibration's."""
        s = self.segment_overhead_s
        if s is not None and plan.prefill and not plan.decode:
            if not plan.is_first_group and not plan.is_last_group:
                return s
        return self.calibration.overhead_s

    # ----------------------------------------------------------------- the plan
    def _terms(self, plan: StepPlan):
        """(count, compute_s, memory_s) terms, per-device FLOPs and bytes, expert bytes."""
        decode, chunks = plan.decode, plan.prefill
        B = plan.num_decode_rows  # a speculating decode runs k + 1 verification rows
        acc = _Acc()
        ctx = slide = (0, 0)
        if B:
            drafts = plan.drafts or ((),) * len(decode)
            # KV length of each row with its own token: row j of a sequence sees j drafts
            rows = [s.num_tokens + j for s, d in zip(decode, drafts, strict=True)
                    for j in range(len(d) + 1)]
            last = [s.num_tokens + len(d) for s, d in zip(decode, drafts, strict=True)]
            # FLOPs follow every row's context; a sequence's rows read its KV once
            ctx = (sum(rows), sum(last))
            if self._window:
                w = self._window
                slide = (sum(min(n, w) for n in rows), sum(min(n, w) for n in last))
        partial: list[tuple[int, int]] = []  # (layer, half with the prefill rows)
        if chunks:
            us, ue = plan.unit_start, plan.unit_end
            mixed = self._range_counts((us + 1) // 2, ue // 2)  # layers wholly in the span
            if us % 2:
                partial.append((us // 2, 1))
            if ue % 2:
                partial.append((ue // 2, 0))
            n_pre = sum(c.end - c.start for c in chunks)
            pre = [(c.end - c.start, c.start) for c in chunks]
        else:
            mixed, n_pre, pre = None, 0, []
        b_time, t_mix = self._time_rows(plan, B, n_pre)
        cut = [0] * len(self._kinds)  # half-prefill layers of each kind
        for layer, _ in partial:
            cut[self._kind_of[layer]] += 1
        for k in range(len(self._kinds)):
            n_mix = mixed[k] if mixed else 0
            n_dec = (self._all[k] - n_mix - cut[k]) if B else 0
            for count, t_time, t_real, with_pre in (
                (n_dec, b_time, B, False),
                (n_mix, t_mix, n_pre + B, True),
            ):
                if not count:
                    continue
                acc.layers += count
                acc.add_ops(self._lin(k, t_time, t_real), count)
                if self._kinds[k][0]:
                    acc.expert_bytes += count * self._expert_bytes(t_real)
                if B:
                    self._add_decode_attention(acc, k, count, B, ctx, slide)
                if with_pre:
                    self._add_prefill_attention(acc, k, count, pre)
        rows = (b_time, t_mix), (B, n_pre + B)  # (bucketed, real) rows: decodes, + prefill
        for layer, half in partial:
            self._add_half_layer(acc, self._kind_of[layer], half, rows, pre, ctx, slide)
        n_rows = self._head_rows(plan)
        if n_rows:
            c, m, fl, by = self._lm_head(n_rows)
            acc.terms.append((1, c, m))
            acc.flops += fl
            acc.nbytes += by
        return acc.terms, acc.flops, acc.nbytes, acc.expert_bytes, acc.layers

    def _time_rows(self, plan: StepPlan, B: int, n_pre: int) -> tuple[int, int]:
        """The rows the step's calls are timed at: the decodes alone, and the prefill
        tokens beside them (0 without chunks), each padded to the engine's row bucket."""
        b_time = self._bucket(B, self._buckets) if B else 0
        return b_time, self._bucket(n_pre + B, self._buckets) if plan.prefill else 0

    def _head_rows(self, plan: StepPlan) -> int:
        """Rows the lm_head runs: every decode row, and each chunk's samples in the last
        layer group."""
        samples = sum(c.samples for c in plan.prefill) if plan.is_last_group else 0
        return plan.num_decode_rows + samples

    def _add_half_layer(self, acc: _Acc, k: int, half: int, rows, pre, ctx: tuple,
                        slide: tuple):
        """A layer whose `half` (0 attention, 1 MLP) runs the prefill rows and the decodes,
        its other half the decodes alone (nothing when there are none)."""
        (b_time, t_mix), (B, t_all) = rows
        acc.layers += 1 if B else 0.5
        for h in (0, 1):
            t_time, t_real = (t_mix, t_all) if h == half else (b_time, B)
            if not t_real:
                continue
            acc.add_ops(self._lin_half(k, t_time, h, t_real), 1)
            if h == 0:
                if B:
                    self._add_decode_attention(acc, k, 1, B, ctx, slide)
                if h == half:
                    self._add_prefill_attention(acc, k, 1, pre)
            elif self._kinds[k][0]:
                acc.expert_bytes += self._expert_bytes(t_real)

    def _add_decode_attention(
        self, acc: _Acc, k: int, count: int, B: int, ctx: tuple, slide: tuple
    ) -> None:
        """B decode rows; ctx and slide: (summed visible context of the rows, of the
        sequences), the first costing FLOPs and the second KV bytes."""
        c, m, fl, by = self._decode_attention(k, B, ctx, slide)
        acc.terms.append((count, c, m))
        acc.flops += count * fl
        acc.nbytes += count * by

    def _decode_attention(self, k: int, B: int, ctx: tuple, slide: tuple):
        """(compute_s, memory_s, FLOPs, bytes) of B decode rows' attention in one layer."""
        f1, f0, b1, b0 = self._attn_dec[k]
        vis_rows, vis_seqs = slide if self._kinds[k][1] else ctx
        fl, by = f1 * vis_rows + f0 * B, b1 * vis_seqs + b0 * B
        return fl / self._peak, by / self._bw, fl, by

    def _add_prefill_attention(self, acc: _Acc, k: int, count: int, pre) -> None:
        c_sum = m_sum = 0.0
        for n, past in pre:
            c, m, fl, by = self._prefill_attention(k, n, past)
            c_sum, m_sum = c_sum + c, m_sum + m
            acc.flops += count * fl
            acc.nbytes += count * by
        acc.terms.append((count, c_sum, m_sum))

    # ------------------------------------------------------------------ caches
    @property
    def _peak(self) -> float:
        return self.hardware.peak_flops

    @property
    def _bw(self) -> float:
        return self.hardware.hbm_bw

    def _seconds(self, op) -> tuple[float, float]:
        hw = self.hardware
        compute = (op.flops + op.pad_flops) / hw.peak_flops
        memory = op.bytes / hw.hbm_bw
        if op.comm_bytes > 0 and hw.interconnect_bw > 0:
            memory = max(memory, op.comm_bytes / (0.5 * hw.interconnect_bw))
        return compute, memory

    def _layer(self, k: int, step: StepTokens):
        return layer_cost(
            self.shape, step, layer=self._rep[k], tp=self.tp, ep=self.ep,
            routing=self._fixed_routing, tile=self.tile,
        )  # fmt: skip

    def _lin(self, k: int, tokens: int, real: int | None = None) -> _Ops:
        """The token-linear ops of a whole layer (all but attention itself) at `tokens`
        rows; `real`: those rows less padding, which this executor runs through every op
        as the engine's row buckets do (a subclass may not)."""
        key = (k, tokens)
        ops = self._lin_cache.get(key)
        if ops is None:
            ops = self._lin_cache[key] = self._linear_ops(k, tokens, None)
        return ops

    def _lin_half(self, k: int, tokens: int, half: int, real: int | None = None) -> _Ops:
        """The token-linear ops of one half layer: 0 = qkv_proj + o_proj, 1 = the MLP."""
        key = (k, tokens, half)
        ops = self._half_cache.get(key)
        if ops is None:
            ops = self._half_cache[key] = self._linear_ops(k, tokens, half)
        return ops

    def _linear_ops(self, k: int, tokens: int, half: int | None) -> _Ops:
        lc = self._layer(k, StepTokens(decode_seqs=tokens, decode_context=1))
        kept = [
            op
            for op in lc.ops
            if op.name not in _ATTENTION_OPS
            and (half is None or (op.name in _ATTENTION_HALF) == (half == 0))
        ]
        return _Ops(
            tuple(self._seconds(op) for op in kept),
            sum(op.flops + op.pad_flops for op in kept),
            sum(op.bytes for op in kept),
        )

    def _decode_attention_coeffs(self, k: int) -> tuple[float, float, float, float]:
        """attn_decode FLOPs = f1 * context + f0 * seqs, bytes = b1 * context + b0 * seqs."""
        one = self._layer(k, StepTokens(decode_seqs=1, decode_context=1)).op("attn_decode")
        two = self._layer(k, StepTokens(decode_seqs=1, decode_context=2)).op("attn_decode")
        f1, b1 = two.flops - one.flops, two.bytes - one.bytes
        return f1, one.flops - f1, b1, one.bytes - b1

    def _prefill_attention(self, k: int, n: int, past: int):
        key = (k, n, past)
        hit = self._pre_cache.get(key)
        if hit is None:
            step = StepTokens(prefill_tokens=n, prefill_seqs=1, prefill_past=past)
            op = self._layer(k, step).op("attn_prefill")
            hit = (*self._seconds(op), op.flops, op.bytes)
            self._pre_cache[key] = hit
        return hit

    def _lm_head(self, rows: int):
        hit = self._head_cache.get(rows)
        if hit is None:
            op = lm_head_cost(self.shape, rows, tp=self.tp, ep=self.ep)
            hit = (*self._seconds(op), op.flops, op.bytes)
            self._head_cache[rows] = hit
        return hit

    def _expert_bytes(self, tokens: int) -> float:
        hit = self._experts_cache.get(tokens)
        if hit is None:
            s = self.shape
            active = expected_active(self._fixed_routing, s.num_experts, s.top_k, tokens)
            hit = float(active) * s.expert_bytes
            self._experts_cache[tokens] = hit
        return hit

    def _range_counts(self, a: int, b: int) -> tuple[int, ...]:
        hit = self._range_cache.get((a, b))
        if hit is None:
            hit = tuple(p[b] - p[a] for p in self._prefix)
            self._range_cache[(a, b)] = hit
        return hit

    @staticmethod
    def _bucket(n: int, buckets: tuple[int, ...] | None) -> int:
        if not buckets or n == 0:
            return n
        i = bisect.bisect_left(buckets, n)
        return buckets[i] if i < len(buckets) else n
