"""The cost-model executor with each op scaled by the compiled programs' factors.

Design note. `CostModelExecutor` (executor.py) prices a step from the analytic cost model;
this subclass multiplies each op's seconds at peak (compute and memory alike, so the op's
binding roof is kept) by `CompiledCalibration.factor(term, rows)` (compiled_cost.py), with
the rows of the call that runs the op, as the engine picks a program by its rows:

    qkv_proj, o_proj, router, dense MLP  layer_rest  rows of the layer set: the decodes
    experts                              experts       alone, or prefill + decode rows
    attn_decode                          attention   the decode rows
    attn_prefill                         attention   the step's prefill rows
    lm_head                              outside     the step's largest call: prefill +
                                                     decode rows, or the decodes

FLOPs, HBM bytes and expert bytes stay the analytic counts (the energy model and the
expert-traffic figures read them); only time is corrected. The per-iteration and per-layer
overheads are the calibration's, unscaled.
"""

from __future__ import annotations

from lp_jax.core.plan import StepPlan
from lp_jax.roofline.cost_model import StepTokens
from lp_jax.sim.compiled_cost import OP_TERMS, CompiledCalibration
from lp_jax.sim.executor import _ATTENTION_HALF, _ATTENTION_OPS, CostModelExecutor, _Acc, _Ops


class CompiledCostExecutor(CostModelExecutor):
    def __init__(self, shape, hardware, *, compiled: CompiledCalibration, tp: int = 1,
                 ep: int = 1, **kwargs) -> None:
        compiled.check_matches(shape, hardware.name, tp, ep)
        self.compiled = compiled
        self._call_rows = 0  # rows of the step's largest call, set per plan
        self._head_rows_cache: dict[tuple[int, int], tuple[float, float, float, float]] = {}
        super().__init__(shape, hardware, tp=tp, ep=ep, **kwargs)

    def with_calibration(self, calibration):
        other = object.__new__(type(self))
        for name in vars(self):
            setattr(other, name, getattr(self, name))
        other.calibration = calibration
        return other

    def _terms(self, plan: StepPlan):
        B = plan.num_decode_rows
        n_pre = sum(c.end - c.start for c in plan.prefill)
        self._call_rows = self._bucket(n_pre + B, self._buckets)
        return super()._terms(plan)

    def _linear_ops(self, k: int, tokens: int, half: int | None) -> _Ops:
        lc = self._layer(k, StepTokens(decode_seqs=tokens, decode_context=1))
        kept = [op for op in lc.ops if op.name not in _ATTENTION_OPS
                and (half is None or (op.name in _ATTENTION_HALF) == (half == 0))]
        terms = []
        for op in kept:
            f = self.compiled.factor(OP_TERMS[op.name], tokens)
            c, m = self._seconds(op)
            terms.append((c * f, m * f))
        return _Ops(tuple(terms), sum(op.flops + op.pad_flops for op in kept),
                    sum(op.bytes for op in kept))

    def _scale_last(self, acc: _Acc, rows: int) -> None:
        n, c, m = acc.terms[-1]
        f = self.compiled.factor("attention", rows)
        acc.terms[-1] = (n, c * f, m * f)

    def _add_decode_attention(self, acc: _Acc, k: int, count: int, B: int, ctx: tuple,
                              slide: tuple) -> None:
        super()._add_decode_attention(acc, k, count, B, ctx, slide)
        self._scale_last(acc, B)

    def _add_prefill_attention(self, acc: _Acc, k: int, count: int, pre) -> None:
        super()._add_prefill_attention(acc, k, count, pre)
        self._scale_last(acc, sum(n for n, _ in pre))

    def _lm_head(self, rows: int):
        key = (rows, self._call_rows)
        hit = self._head_rows_cache.get(key)
        if hit is None:
            c, m, fl, by = super()._lm_head(rows)
            f = self.compiled.factor("outside", max(self._call_rows, rows))
            hit = self._head_rows_cache[key] = (c * f, m * f, fl, by)
        return hit
