"""What MuxWise's policy believes an iteration will take: the oracle (the simulator's own
partition cost model) or an estimator built on the engine's LatencyModel.

Design note. The policy (muxwise.py) asks four things: a batch's per-unit prefill seconds
at every SM share of the grid (`table`), the decode step's finish next to a launch
(`overlap`), the decode step alone (`decode_alone`, `decode_whole`) and a prompt's solo
prefill (`solo_s`). `OraclePredictor` answers from `PartitionCostModel`, exactly (no
prediction error: the simulated MuxWise is then an upper bound). `EstimatedPredictor`
answers as MuxWise's paper describes its estimator (papers.md section 3: a solo-run
predictor per phase plus a contention guard profiled per partition):

- solo costs at the whole device: the engine's `LatencyModel` (lp_jax/core/latency.py, the
  one FlowPrefill and adaptive layered use), fitted by an offline profile of prefill-only
  and decode-only plans whose measured times carry the same step-time noise as the runs,
  then learning online from every whole-device step of the run;
- per partition: a factor per (phase, SM share, size bucket) = measured time on that share
  / the solo prediction, from the same offline profile (prefill spans of 1-16 units at
  128-8192 tokens; decode batches of 1-256 rows), nearest profiled size bucket when unseen;
- contention: a guard per (phase, share, prefill-token bucket, decode-row bucket) (the
  paper's guard is profiled against input length, decode batch size and partition), an
  exponential moving average (decay 0.8, clamped to [0.25, 4]) of measured / predicted
  over the overlapped iterations of the run; an unseen cell borrows its (phase, share)
  average, else 1 (the profile runs each phase alone). A guard per (phase, share) only
  mispredicted the decode finish by 45% on the multi-SLO mix, whose launches range from a
  590-token chat prompt to an 8k batch.

Neither learns memory bytes, so `EstimatedPredictor` tables carry no memory column; its
errors (the linear solo fit, the bucketed factors, the guard's lag, the noise) are what an
engine would have, and what the TBT tests measure against the simulated token times.
The profile of a cost model and noise setting is cached on the model (one per simulator).
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass

import numpy as np

from lp_jax.core.latency import LatencyModel, ModelDims
from lp_jax.core.plan import PrefillChunk, StepPlan
from lp_jax.core.sampling_params import SamplingParams
from lp_jax.core.sequence import Sequence
from lp_jax.sim.muxwise_cost import Measured, Overlap, PartitionCostModel, Stream

_PROFILE_TOKENS = (128, 512, 2048, 8192)
_PROFILE_SPANS = (1, 4, 16)  # operator units per profiled launch
_PROFILE_DECODES = (1, 4, 16, 64, 256)
_PROFILE_CONTEXT = (512, 4096)


@dataclass(slots=True)
class UnitTable:
    """A batch's per-unit prefill costs: ops seconds at every grid share (prefix sums over
    units), memory seconds (prefix sums; zeros for the estimator) and, for the estimator,
    the fixed seconds of a whole-device prefill step."""

    t_WU1: np.ndarray
    mem_U1: np.ndarray
    fixed_s: float = 0.0
    tokens: int = 0  # the batch's prompt tokens (the estimator's guard cell)

    def ops(self, w: int, a: int, b: int) -> float:
        return float(self.t_WU1[w, b] - self.t_WU1[w, a])

    def mem(self, a: int, b: int) -> float:
        return float(self.mem_U1[b] - self.mem_U1[a])


def _bucket(n: int) -> int:
    return int(n).bit_length()


def _decode_plan(running, num_layers: int) -> StepPlan:
    return StepPlan(0, num_layers, decode=tuple(running))


# ----------------------------------------------------------------------- the oracle
class OraclePredictor:
    """The partition cost model itself (the simulator's ground truth)."""

    kind = "oracle"

    def __init__(self, model: PartitionCostModel, num_layers: int) -> None:
        self.model = model
        self.num_layers = num_layers
        self.units = 2 * num_layers
        self._solo: dict[tuple[int, int], float] = {}

    def table(self, chunks, batch_id: int) -> UnitTable:
        """Units alike in layer kind and half share a row."""
        model, L = self.model, self.num_layers
        shape = model.executor.shape
        units, rows = self.units, {}
        t_WU = np.zeros((model.options.sm_steps, units))
        mem_U = np.zeros(units)
        for u in range(units):
            layer = u // 2
            key = (shape.is_moe_layer(layer), shape.is_sliding_layer(layer), u % 2,
                   u == units - 1)
            if key not in rows:
                plan = StepPlan(0, L, prefill=tuple(chunks), prefill_batch_id=batch_id,
                                unit_start=u, unit_end=u + 1, group_index=u, num_groups=units)
                s = model.plan_stream(plan)
                rows[key] = (model.ops_seconds_W(s), s.memory_s)
            t_WU[:, u], mem_U[u] = rows[key]
        zero_W1 = np.zeros((model.options.sm_steps, 1))
        return UnitTable(np.concatenate([zero_W1, np.cumsum(t_WU, axis=1)], axis=1),
                         np.concatenate([[0.0], np.cumsum(mem_U)]))

    def decode(self, running) -> tuple[Stream, np.ndarray]:
        sd = self.model.plan_stream(_decode_plan(running, self.num_layers))
        return sd, self.model.ops_seconds_W(sd)

    def decode_alone(self, dec, w: int) -> float:
        """The decode step alone on the decode share next to prefill share index w."""
        sd, t_dW = dec
        n = self.model.options.sm_steps
        return float(t_dW[n - 2 - w]) + self.model.decode_fixed_s(sd.layers)

    def decode_whole(self, dec) -> float:
        sd, _ = dec
        return self.model.ops_seconds(sd, 1.0) + self.model.decode_fixed_s(sd.layers)

    def whole_launch(self, table: UnitTable, a: int, k: int) -> float:
        """Units [a, a + k) alone on the whole device (a plan with no decodes)."""
        n = self.model.options.sm_steps
        return (table.ops(n - 1, a, a + k) + self.model.prefill_fixed_s(k / 2)
                + self.model.executor.calibration.overhead_s)

    def overlap(self, table: UnitTable, w: int, a: int, k: int, dec,
                carry_s: float = 0.0) -> Overlap:
        """Units [a, a + k) on prefill share w (after `carry_s` of carried-in work) next
        to the decode step on the rest."""
        sd, t_dW = dec
        n = self.model.options.sm_steps
        return self.model.overlap(float(t_dW[n - 2 - w]), sd.memory_s,
                                  table.ops(w, a, a + k) + carry_s, table.mem(a, a + k),
                                  sd.layers, k / 2)

    def solo_s(self, tokens: int, start: int) -> float:
        """Prefill seconds of `tokens` after `start` cached ones, whole device."""
        key = (tokens, start)
        hit = self._solo.get(key)
        if hit is None:
            seq = Sequence(-1, [1] * (start + tokens))
            plan = StepPlan(0, self.num_layers,
                            prefill=(PrefillChunk(seq, start, start + tokens),),
                            prefill_batch_id=0)
            hit = self._solo[key] = self.model.executor.run(plan).seconds
        return hit

    def observe(self, plan: StepPlan, w: int | None, expected: Overlap | None,
                measured: Measured) -> None:
        """The oracle learns nothing."""


# ----------------------------------------------------------------------- the estimator
@dataclass(slots=True)
class _Profile:
    latency: LatencyModel
    r_pre: dict  # (share index w, token bucket) -> measured / solo-predicted
    r_dec: dict  # (prefill share index w, decode-row bucket) -> measured / solo-predicted


def _nearest(table: dict, w: int, b: int) -> float:
    hit = table.get((w, b))
    if hit is not None:
        return hit
    near = min((k for k in table if k[0] == w), key=lambda k: abs(k[1] - b), default=None)
    return 1.0 if near is None else table[near]


def profile(model: PartitionCostModel, num_layers: int) -> _Profile:
    """The offline profile (module note): a LatencyModel fitted to noisy whole-device
    prefill-only and decode-only plans, and the per-partition factors."""
    cache = getattr(model, "_muxwise_profile", None)
    if cache is not None:
        return cache
    o, ex = model.options, model.executor
    rng = random.Random(o.noise_seed * 7_919 + 17)

    def jitter() -> float:
        return float(np.exp(o.noise * rng.gauss(0, 1))) if o.noise else 1.0

    latency = LatencyModel(ModelDims.from_config(ex.shape),
                           source="simulated MuxWise profile (noisy)")
    expert_size = ex.shape.expert_bytes or 1
    U, n = 2 * num_layers, o.sm_steps
    samples: list[tuple[StepPlan, float]] = []
    spans = []
    for tokens in _PROFILE_TOKENS:
        seq = Sequence(-1, [1] * tokens, SamplingParams(max_tokens=1))
        chunk = (PrefillChunk(seq, 0, tokens),)
        samples.append((StepPlan(0, num_layers, prefill=chunk, prefill_batch_id=0), 0))
        for k in _PROFILE_SPANS:
            for a in (0, U // 2 - 1):
                plan = StepPlan(0, num_layers, prefill=chunk, prefill_batch_id=0,
                                unit_start=a, unit_end=a + k, group_index=a, num_groups=U)
                samples.append((plan, 0))
                spans.append((tokens, plan))
    decodes = []
    for b in _PROFILE_DECODES:
        for ctx in _PROFILE_CONTEXT:
            running = []
            for i in range(b):
                s = Sequence(i, [1] * ctx, SamplingParams(max_tokens=8))
                s.token_ids.append(1)
                running.append(s)
            plan = _decode_plan(running, num_layers)
            samples.append((plan, 0))
            decodes.append((b, plan))
    for plan, _ in samples:
        cost = ex.run(plan)
        experts = cost.expert_bytes / expert_size if ex.shape.is_moe else None
        latency.observe(plan, cost.seconds * jitter(), experts)
    r_pre: dict = {}
    for tokens, plan in spans:
        s = model.plan_stream(plan)
        solo = latency.predict_plan(plan) - _fixed(latency, plan.prefill)
        if solo <= 0:
            continue
        for w in range(n - 1):
            t = (model.ops_seconds(s, model.shares_W[w])
                 + model.prefill_fixed_s(s.layers)) * jitter()
            r_pre.setdefault((w, _bucket(tokens)), []).append(t / solo)
    r_dec: dict = {}
    for b, plan in decodes:
        s = model.plan_stream(plan)
        solo = latency.predict_plan(plan)
        for w in range(n - 1):
            t = (model.ops_seconds(s, 1.0 - model.shares_W[w])
                 + model.decode_fixed_s(s.layers)) * jitter()
            r_dec.setdefault((w, _bucket(b)), []).append(t / solo)
    out = _Profile(latency, {k: float(np.mean(v)) for k, v in r_pre.items()},
                   {k: float(np.mean(v)) for k, v in r_dec.items()})
    model._muxwise_profile = out
    return out


def _fixed(latency: LatencyModel, chunks) -> float:
    """The estimator's fixed seconds of a prefill-only step (no unit run)."""
    return latency.predict(latency.features([(c.num_tokens, c.start) for c in chunks], 0, 0))


class EstimatedPredictor:
    """The engine's LatencyModel, per-partition factors and a contention guard (module
    note), learning online from `observe`."""

    kind = "estimator"
    decay = 0.8

    def __init__(self, model: PartitionCostModel, num_layers: int) -> None:
        self.model = model
        self.num_layers = num_layers
        self.units = 2 * num_layers
        prof = profile(model, num_layers)
        self.latency = copy.deepcopy(prof.latency)  # a run learns on its own copy
        self.r_pre, self.r_dec = prof.r_pre, prof.r_dec
        self.guard: dict[tuple, float] = {}  # (phase, w, token bucket, row bucket) cells
        self.coarse: dict[tuple[str, int], float] = {}  # (phase, w)
        self.observed = 0

    def _g(self, phase: str, w: int, tokens: int, rows: int) -> float:
        hit = self.guard.get((phase, w, _bucket(tokens), _bucket(rows)))
        return hit if hit is not None else self.coarse.get((phase, w), 1.0)

    def table(self, chunks, batch_id: int) -> UnitTable:
        lat, n, U = self.latency, self.model.options.sm_steps, self.units
        tp = [(c.num_tokens, c.start) for c in chunks]
        fixed = lat.predict(lat.features(tp, 0, 0))
        P_U1 = np.array([lat.predict(lat.features(tp, 0, b)) for b in range(U + 1)]) - fixed
        P_U1 = np.maximum.accumulate(np.maximum(P_U1, 0.0))
        tb = _bucket(sum(t for t, _ in tp))
        r_W = np.array([_nearest(self.r_pre, w, tb) for w in range(n - 1)] + [1.0])
        return UnitTable(r_W[:, None] * P_U1[None, :], np.zeros(U + 1), max(fixed, 0.0),
                         sum(t for t, _ in tp))

    def decode(self, running) -> tuple[float, int]:
        return self.latency.predict_plan(_decode_plan(running, self.num_layers)), len(running)

    def decode_alone(self, dec, w: int) -> float:
        solo, b = dec
        return solo * _nearest(self.r_dec, w, _bucket(b))

    def decode_whole(self, dec) -> float:
        return dec[0]

    def whole_launch(self, table: UnitTable, a: int, k: int) -> float:
        return table.ops(self.model.options.sm_steps - 1, a, a + k) + table.fixed_s

    def overlap(self, table: UnitTable, w: int, a: int, k: int, dec,
                carry_s: float = 0.0) -> Overlap:
        rows = dec[1]
        fin_d = self.decode_alone(dec, w) * self._g("decode", w, table.tokens, rows)
        fin_p = table.ops(w, a, a + k) * self._g("prefill", w, table.tokens, rows) + carry_s
        return Overlap(max(fin_d, fin_p), fin_d, fin_p)

    def solo_s(self, tokens: int, start: int) -> float:
        return self.latency.prefill_seconds([(tokens, start)], 0, self.units)

    def observe(self, plan: StepPlan, w: int | None, expected: Overlap | None,
                measured: Measured) -> None:
        """A whole-device step trains the LatencyModel; an overlapped one the guard."""
        self.observed += 1
        if w is None or expected is None:
            if plan.decode and not plan.prefill and measured.decode_s > 0:
                self.latency.observe(plan, measured.decode_s)
            elif plan.prefill and not plan.decode and measured.prefill_s > 0:
                self.latency.observe(plan, measured.prefill_s)
            return
        tokens, rows = plan.num_prefill_tokens, len(plan.decode)
        for phase, want, got in (
                ("decode", expected.decode_s / self._g("decode", w, tokens, rows),
                 measured.decode_s),
                ("prefill", (expected.prefill_s - measured.carry_in_s)
                 / self._g("prefill", w, tokens, rows), measured.prefill_s - measured.carry_in_s)):
            if want > 0 and got > 0:
                ratio = min(max(got / want, 0.25), 4.0)
                for table, key in ((self.guard, (phase, w, _bucket(tokens), _bucket(rows))),
                                   (self.coarse, (phase, w))):
                    old = table.get(key)
                    table[key] = ratio if old is None else (
                        self.decay * old + (1 - self.decay) * ratio)


def make_predictor(model: PartitionCostModel, num_layers: int):
    """The predictor `model.options.predictor` names."""
    if model.options.predictor == "estimator":
        return EstimatedPredictor(model, num_layers)
    return OraclePredictor(model, num_layers)
