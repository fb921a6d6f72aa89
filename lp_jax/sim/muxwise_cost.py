"""MuxWise in the simulator: prefill and decode on disjoint SM partitions of one device.

Design note. MuxWise (papers.md section 3) runs prefill and decode concurrently on two SM
partitions of one GPU (CUDA Green Contexts). XLA gives a JAX program no SM partitioning,
so the engine cannot run it; the simulator models it on top of the roofline executor.

Cost model (`PartitionCostModel`). A *stream* is one phase's ops, as the executor's
`StepFeatures` give them: per op, seconds at peak FLOP/s (c) and at peak HBM bandwidth (m),
both divided by the calibration's efficiencies. On a share x of the SMs a stream's ops take

    t(x) = sum_op max(c / x, m / beta(x)),   beta(x) = min(1, x / bandwidth_saturation)

compute scales with 1 / x; a few SMs cannot issue enough loads to saturate HBM, so the
bandwidth a partition can draw grows linearly up to `bandwidth_saturation` of the SMs
(ASSUMED 0.4: HBM-bound kernels on Hopper reach near-peak bandwidth with roughly 40% of the
SMs; MuxWise's paper gives no number). t is non-increasing in x, and t(1) is the
executor's ops time exactly. Two concurrent streams contend for HBM: stream i uses on
average d_i = (sum m) / t_i of the bandwidth; while both run, bandwidth is split in
proportion to demand, so when d_1 + d_2 > 1 both slow down by f = d_1 + d_2 (the equal
slowdown proportional sharing implies), and once the shorter one ends the other runs
alone:

    shorter: f * t_s;   longer: f * t_s + (t_l - t_s)

This averages each stream's demand over its run (a compute-bound op next to a memory-bound
one is not resolved in time): a documented simplification. Fixed costs are added after the
ops: the decode stream pays the calibration's per-iteration overhead (host work, sampling)
and per-layer overhead; a prefill launch pays `launch_overhead_s` (ASSUMED 50 us: one graph
launch on its own stream; FlowPrefill's segment overhead in the simulator) and the per-layer
overhead of the layers it runs. An iteration lasts until both streams are done, plus
`sync_s` (ASSUMED 20 us; "microseconds" in the paper) when the partition changes. A step with
only one phase runs on the whole device at exactly the executor's solo cost.

One plan = one MuxWise iteration: one decode step of every running request (one token each)
on 1 - s of the SMs, concurrent with one prefill launch of [unit_start, unit_end) operator
units of one batch on s. Launches (`MuxWiseOptions.launches`):
- "sync" (default): the next decode step waits for the plan's prefill launch, so the
  iteration lasts until both streams are done, which is why the policy sizes launches to
  return before the decode step does; the prefill partition idles between its launch's end
  and the decode step's.
- "async" (the paper's engine): the iteration ends when the decode step does; a launch that
  runs longer carries its remaining work (`carry`, seconds alone on its partition, with its
  share of the memory demand) into the next iteration, where it runs first on the prefill
  stream and contends with the next decode step. Two exceptions wait for the prefill stream:
  a launch that ends its batch (its first tokens need it: TTFT is stamped when it is done)
  and a repartition (Green Contexts change only on drained streams: the carry is a stall).
Step-time noise (`noise`, ASSUMED off by default): each stream's finish is multiplied by
exp(noise x z), z standard normal, drawn from (noise_seed, step_id), so a run stays a pure
function of its requests; the observed time is the actual one (as in the engine, whose
measured step is what happened). The policy is told what each iteration took through
`Launch.observe` (`Measured`: each stream's finish and the carry), which is how an
estimator-driven MuxWise (muxwise_predict.py) learns.

The policy that sizes partitions and launches is `MuxWisePolicy` (muxwise.py).

Local axis letters (beyond docs/glossary.md): O = ops of a stream, W = points of the SM-share
grid (share (w + 1) / sm_steps), U = operator units of the stack (U1: U + 1 prefix sums).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from lp_jax.core.plan import StepPlan
from lp_jax.sim.calibration import StepFeatures
from lp_jax.sim.executor import CostModelExecutor, StepCost


@dataclass(frozen=True, slots=True)
class MuxWiseOptions:
    """The MuxWise model's constants (see the module note for what is ASSUMED)."""

    sm_steps: int = 16  # SM-share grid: shares k / sm_steps
    bandwidth_saturation: float = 0.4  # SM share that can draw the full HBM bandwidth
    sync_s: float = 20e-6  # stream sync when the partition changes
    launch_overhead_s: float = 50e-6  # per prefill launch on its own stream
    guard: float = 0.9  # decode steps aim at guard x TBT SLO
    preempt_ratio: float = 0.25  # a prompt this short vs the running batch preempts it
    # What the policy predicts with: "oracle" (this cost model: exact, the simulated
    # MuxWise's upper bound) or "estimator" (muxwise_predict.py: the engine's LatencyModel
    # from a noisy simulated profile, per-partition factors and a contention guard, learning
    # online from the observed iterations).
    predictor: str = "oracle"
    launches: str = "sync"  # "sync" or "async" (module note)
    noise: float = 0.0  # log-sd of each stream's step-time jitter (module note)
    noise_seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.sm_steps, bool) or not isinstance(self.sm_steps, int) \
                or self.sm_steps < 2:
            raise ValueError(f"sm_steps must be an int >= 2, got {self.sm_steps!r}")
        if not 0 < self.bandwidth_saturation <= 1:
            raise ValueError("bandwidth_saturation must be in (0, 1]")
        if not (self.sync_s >= 0 and self.launch_overhead_s >= 0):
            raise ValueError("sync_s and launch_overhead_s must be >= 0")
        if not 0 < self.guard <= 1:
            raise ValueError("guard must be in (0, 1]")
        if not 0 <= self.preempt_ratio < 1:
            raise ValueError("preempt_ratio must be in [0, 1)")
        if self.predictor not in ("oracle", "estimator"):
            raise ValueError(f'predictor must be "oracle" or "estimator", got {self.predictor!r}')
        if self.launches not in ("sync", "async"):
            raise ValueError(f'launches must be "sync" or "async", got {self.launches!r}')
        if not (math.isfinite(self.noise) and 0 <= self.noise <= 1):
            raise ValueError(f"noise must be in [0, 1], got {self.noise}")


@dataclass(frozen=True, slots=True)
class Measured:
    """What one iteration took: its seconds (sync, stall and noise included), the decode
    stream's and the prefill stream's finish from the iteration's start (0: no such
    stream; the prefill's includes the carried-in work), the carry-in it started with and
    the prefill work it leaves for the next iteration (async launches)."""

    seconds: float
    decode_s: float = 0.0
    prefill_s: float = 0.0
    carry_in_s: float = 0.0
    carry_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Launch:
    """The partition a plan runs under: the prefill stream's SM share (0: no prefill, the
    decodes own the device) and whether it differs from the previous plan's; `observe`,
    if given, is told the plan and its `Measured` once it has run."""

    prefill_share: float
    repartition: bool = False
    observe: Callable | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class Stream:
    """One phase's ops at peak / efficiency: compute and memory seconds per op."""

    c_O: np.ndarray
    m_O: np.ndarray
    layers: float

    @property
    def memory_s(self) -> float:
        """Seconds of the whole HBM bandwidth the stream's bytes need."""
        return float(self.m_O.sum())


@dataclass(frozen=True, slots=True)
class Overlap:
    """An overlapped iteration: each stream's finish time (ops, contention, fixed costs)."""

    seconds: float
    decode_s: float
    prefill_s: float


# ----------------------------------------------------------------------- cost model
class PartitionCostModel:
    """Two streams on SM partitions of one device, from the executor's roofline terms."""

    def __init__(self, executor: CostModelExecutor, options: MuxWiseOptions) -> None:
        self.executor = executor
        self.options = options
        cal = executor.calibration
        self._ic, self._ib = 1.0 / cal.compute_efficiency, 1.0 / cal.bandwidth_efficiency
        self.shares_W = np.arange(1, options.sm_steps + 1) / options.sm_steps
        self._beta_W = np.minimum(1.0, self.shares_W / options.bandwidth_saturation)

    def bandwidth_cap(self, share: float) -> float:
        """Share of the HBM bandwidth a partition of `share` of the SMs can draw."""
        return min(1.0, share / self.options.bandwidth_saturation)

    def stream(self, features: StepFeatures) -> Stream:
        c_O = np.asarray(features.compute_s, dtype=np.float64) * self._ic
        m_O = np.asarray(features.memory_s, dtype=np.float64) * self._ib
        return Stream(c_O, m_O, features.layers)

    def plan_stream(self, plan: StepPlan) -> Stream:
        return self.stream(self.executor.features(plan))

    def ops_seconds(self, stream: Stream, share: float) -> float:
        """The stream's ops alone on `share` of the SMs (non-increasing in share)."""
        if not 0 < share <= 1:
            raise ValueError(f"an SM share must be in (0, 1], got {share}")
        if not stream.c_O.size:
            return 0.0
        beta = self.bandwidth_cap(share)
        return float(np.maximum(stream.c_O / share, stream.m_O / beta).sum())

    def ops_seconds_W(self, stream: Stream) -> np.ndarray:
        """`ops_seconds` at every share of the grid."""
        if not stream.c_O.size:
            return np.zeros_like(self.shares_W)
        t_OW = np.maximum(stream.c_O[:, None] / self.shares_W, stream.m_O[:, None] / self._beta_W)
        return t_OW.sum(axis=0)

    def decode_fixed_s(self, layers: float) -> float:
        cal = self.executor.calibration
        return cal.overhead_s + cal.layer_overhead_s * layers

    def prefill_fixed_s(self, layers: float) -> float:
        return self.options.launch_overhead_s + self.executor.calibration.layer_overhead_s * layers

    def overlap(self, t_d: float, mem_d: float, t_p: float, mem_p: float,
                layers_d: float, layers_p: float) -> Overlap:
        """Decode ops t_d and prefill ops t_p (alone on their partitions, needing mem_d and
        mem_p seconds of the whole bandwidth) run concurrently; fixed costs follow."""
        fin_d, fin_p = contended(t_d, mem_d, t_p, mem_p)
        fin_d += self.decode_fixed_s(layers_d)
        fin_p += self.prefill_fixed_s(layers_p)
        return Overlap(max(fin_d, fin_p), fin_d, fin_p)

    def iteration(self, plan: StepPlan, prefill_share: float) -> Overlap:
        """A plan with decodes and prefill: decodes on 1 - share, prefill on share."""
        if not (plan.decode and plan.prefill):
            raise ValueError("an overlapped iteration needs decodes and prefill")
        if not 0 < prefill_share < 1:
            raise ValueError(f"prefill_share must be in (0, 1), got {prefill_share}")
        return self.split_iteration(*split_plan(plan), prefill_share)

    def split_iteration(self, dec: StepPlan, pre: StepPlan, prefill_share: float) -> Overlap:
        """`iteration` of a plan already split by `split_plan`."""
        sd, sp = self.plan_stream(dec), self.plan_stream(pre)
        t_d = self.ops_seconds(sd, 1.0 - prefill_share)
        t_p = self.ops_seconds(sp, prefill_share)
        return self.overlap(t_d, sd.memory_s, t_p, sp.memory_s, sd.layers, sp.layers)


def contended(t_a: float, mem_a: float, t_b: float, mem_b: float) -> tuple[float, float]:
    """Finish times of two streams started together (ops t alone, needing mem seconds of
    the whole bandwidth): both slow down by f = total demand while both run, if over 1."""
    d_a = mem_a / t_a if t_a > 0 else 0.0
    d_b = mem_b / t_b if t_b > 0 else 0.0
    f = max(1.0, d_a + d_b)
    if t_a <= t_b:
        return f * t_a, f * t_a + (t_b - t_a)
    return f * t_b + (t_a - t_b), f * t_b


def split_plan(plan: StepPlan) -> tuple[StepPlan, StepPlan]:
    """(its decodes alone through every layer, its prefill span alone)."""
    dec = StepPlan(plan.step_id, plan.num_layers, decode=plan.decode)
    pre = replace(plan, decode=())
    return dec, pre


class MuxWiseExecutor:
    """A `StepPlan` and its `Launch` in, the iteration's `StepCost` out (module note: sync
    or async launches, noise). Holds the async carry between plans; a plan whose step id
    is not above the last one's starts a new run (the carry is dropped)."""

    def __init__(self, model: PartitionCostModel) -> None:
        self.model = model
        self.base = model.executor
        self.devices = self.base.devices
        self._last_step = -1
        self._carry_t = self._carry_m = 0.0  # ops seconds and memory seconds left over

    def _jitter(self, step_id: int) -> tuple[float, float]:
        o = self.model.options
        if not o.noise:
            return 1.0, 1.0
        rng = random.Random(o.noise_seed * 1_000_003 + step_id)
        return math.exp(o.noise * rng.gauss(0, 1)), math.exp(o.noise * rng.gauss(0, 1))

    def run(self, plan: StepPlan, launch: Launch) -> StepCost:
        if plan.step_id <= self._last_step:
            self._carry_t = self._carry_m = 0.0
        self._last_step = plan.step_id
        model, o = self.model, self.model.options
        e_d, e_p = self._jitter(plan.step_id)
        sync = o.sync_s if launch.repartition else 0.0
        carry_in = self._carry_t
        stall = 0.0
        share = launch.prefill_share
        if carry_in and (launch.repartition or not 0 < share < 1):
            stall, carry_in = carry_in * e_p, 0.0  # drain the prefill stream first
            self._carry_t = self._carry_m = 0.0
        if not (plan.decode and plan.prefill) and not (plan.decode and carry_in):
            cost = self.base.run(plan)  # one phase: the whole device
            seconds = cost.seconds * (e_d if plan.decode else e_p)
            measured = Measured(seconds + sync + stall, seconds if plan.decode else 0.0,
                                0.0 if plan.decode else seconds)
            self._tell(launch, plan, measured)
            return replace(cost, seconds=measured.seconds)
        if not 0 < share < 1:
            raise ValueError(f"prefill_share must be in (0, 1), got {share}")
        dec, pre = split_plan(plan)
        a = self.base.run(dec)
        sd = model.plan_stream(dec)
        t_d = model.ops_seconds(sd, 1.0 - share)
        t_p, mem_p, layers_p = carry_in, self._carry_m, 0.0
        b = None
        if plan.prefill:
            b = self.base.run(pre)
            sp = model.plan_stream(pre)
            t_p += model.ops_seconds(sp, share)
            mem_p += sp.memory_s
            layers_p = sp.layers
        fin_d, fin_p = contended(t_d, sd.memory_s, t_p, mem_p)
        fin_d = (fin_d + model.decode_fixed_s(sd.layers)) * e_d
        fin_p = (fin_p + (model.prefill_fixed_s(layers_p) if plan.prefill else 0.0)) * e_p
        ends_batch = bool(plan.prefill) and plan.unit_end == 2 * plan.num_layers
        if o.launches == "async" and not ends_batch:
            seconds, left = fin_d, max(0.0, fin_p - fin_d)
        else:
            seconds, left = max(fin_d, fin_p), 0.0
        self._carry_t = left
        self._carry_m = mem_p * left / fin_p if left else 0.0
        measured = Measured(seconds + sync + stall, fin_d, fin_p, carry_in, left)
        self._tell(launch, plan, measured)
        if b is None:
            return replace(a, seconds=measured.seconds)
        return StepCost(measured.seconds, a.flops + b.flops, a.hbm_bytes + b.hbm_bytes,
                        a.expert_bytes + b.expert_bytes, a.layers + b.layers)

    @staticmethod
    def _tell(launch: Launch, plan: StepPlan, measured: Measured) -> None:
        if launch.observe is not None:
            launch.observe(plan, measured)
