"""Discrete-event serving simulator: the real `Scheduler` driven by a cost-model executor.

Design note. The loop is the engine's loop with the clock replaced: requests join the
scheduler once simulated time reaches their arrival; each iteration is
`plan = schedule(now)`, `dt = executor.run(plan).seconds`, `now += dt`,
`commit(plan, tokens, now)`; when nothing is live the clock jumps to the next arrival.
Every request asks for exactly its output length (`max_tokens=output_len`,
`ignore_eos=True`), so the token ids sampled are irrelevant and a constant is committed.
The scheduler module is imported, not copied: every policy runs unchanged.
`policy="muxwise"` (muxwise.py) runs the same core with a simulator-only policy class
(its SchedulerConfig.policy) that also picks an SM partition per plan, and an executor
that times the overlapped decode step and prefill launch under that partition.

A request's SLO reaches its `Sequence` (FlowPrefill's deadlines); `SimResult.ttft_attainment`
reports, per class, the share of requests whose TTFT met their own SLO. After every step the
scheduler's latency estimator observes the simulated seconds (and the experts the step
activated), as the engine's does with measured ones; each run starts from a copy of
`SimConfig.latency` (or a fresh model), and `warm_latency` fits one by a short profiling run.

Nothing here is random, so a run is a pure function of the requests (and those of a seed).
Per-iteration work is O(decodes + chunks) thanks to the executor's caches, so thousands of
requests at paper scale take seconds.

KV pages, when not given, come from HBM capacity: per device, memory_utilization * HBM
minus the weights' share (weights / (tp * ep)) minus an activation reserve, divided by one
page's KV bytes on that device (KV heads split over tp, replicated when tp > K); ep data-
parallel attention groups multiply the pool. Weights count their stored bytes and the KV
cache its format's (the shape's `weight_format` / `kv_format`): an FP8 cache holds twice
the tokens in the same room.

`dp` > 1 is the engine's data-parallel attention, mesh (dp, 1, tp) with the experts over
all dp x tp chips: the scheduler places each sequence on a rank (its RankedBlockManager,
as the engine's does), each rank's pool is one chip's KV room beside that mesh's weights
(`roofline.dp_attention.dp_chip_layout`), and `dp_executor.DPCostModelExecutor` costs
each step as the busiest rank's, with DP attention's link bytes. The result's `extra`
reports the rows each rank ran and the rows the SPMD step padded (`dp_stats`).
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field, replace

import numpy as np

from lp_jax.core.config import SchedulerConfig
from lp_jax.core.latency import LatencyModel, ModelDims, profile_prompts
from lp_jax.core.metrics import RequestMetrics, summarize
from lp_jax.core.plan import StepResult
from lp_jax.core.policies import resolve_policy
from lp_jax.core.sampling_params import SamplingParams
from lp_jax.core.scheduler import Scheduler
from lp_jax.core.sequence import Sequence
from lp_jax.roofline.dp_attention import dp_chip_layout
from lp_jax.roofline.hardware import Hardware
from lp_jax.roofline.model_shape import ModelShape
from lp_jax.roofline.routing import Routing
from lp_jax.sim.calibration import Calibration, prior_calibration
from lp_jax.sim.compiled_cost import CompiledCalibration
from lp_jax.sim.compiled_executor import CompiledCostExecutor
from lp_jax.sim.dp_executor import DPCostModelExecutor
from lp_jax.sim.energy import EnergyModel, energy_model_for
from lp_jax.sim.executor import CostModelExecutor
from lp_jax.sim.muxwise import MuxWisePolicy, muxwise_policy
from lp_jax.sim.muxwise_cost import MuxWiseExecutor, MuxWiseOptions, PartitionCostModel
from lp_jax.sim.workload import Request
from lp_jax.trace.writer import TraceWriter

_TOKEN = 1  # committed for every sampled position; requests ignore EOS


@dataclass(frozen=True, slots=True, kw_only=True)
class SimConfig:
    shape: ModelShape
    hardware: Hardware
    # A scheduler policy (a name, a Policy class or package.module:Class), or "muxwise"
    # (lp_jax/sim/muxwise.py, simulator-only).
    policy: str | type = "layered"
    tp: int = 1
    ep: int = 1
    # Data-parallel attention ranks (mesh (dp, 1, tp), experts over dp x tp; module note).
    dp: int = 1
    # None: the policy's default (512 / 8192); with dp > 1, each rank's (core/budget.py)
    max_num_batched_tokens: int | None = None
    layer_groups: str | int = "paper"
    max_layer_groups: int = 16
    max_num_seqs: int = 256
    max_model_len: int = 32768
    page_size: int = 16
    num_pages: int | None = None  # None: from HBM capacity (see module note)
    memory_utilization: float = 0.9  # share of HBM the engine may use (vLLM's default)
    activation_reserve_bytes: float = 4e9  # per device, for activations and workspace
    routing: Routing | None = None  # None: Zipf fitted to the paper's Table 1
    tile: int = 1  # grouped-matmul row tile; 1 ignores padding waste
    calibration: Calibration | None = None  # None: the GPU prior (or compiled_cost's)
    # Per-term factors read from compiled programs (compiled_cost.py, issue #26 §4): the
    # executor scales each op by them; None: the analytic cost model alone.
    compiled_cost: CompiledCalibration | None = None
    energy: EnergyModel | None = None  # None: the table entry for the hardware, if any
    token_buckets: tuple[int, ...] | None = None  # the engine's row buckets, to mimic padding
    # FlowPrefill (lp_jax/core/policies/flowprefill.py): segment size of a preemptible prefill,
    # preemptible layered batches, the SLO-aware batching alpha, paused batches kept, and
    # whose rules rank and batch ("reference" or "lp_jax").
    preemption_granularity: str = "operator"
    preemptible: bool = False
    slo_alpha: float = 0.1
    flowprefill_rules: str = "reference"
    max_paused_prefills: int = 8
    # segments of the running prefill one FlowPrefill plan carries (SchedulerConfig's
    # flowprefill_lookahead): one plan, so one per-plan overhead, for up to k segments
    flowprefill_lookahead: int = 1
    # The scheduler's step-latency estimator (FlowPrefill's slack): a copy of this model
    # at the start of every run (runs stay pure functions of their requests); None: a fresh
    # one for the shape, learning online from the simulated steps (`observe_latency`).
    # observe_latency None: only for the policies that read the estimator (flowprefill,
    # preemptible and adaptive layered); an observation costs ~15 us (the fit re-solves lazily).
    latency: LatencyModel | None = None
    observe_latency: bool | None = None
    # Overhead of a prefill-only continuation segment (executor.py); None: the calibration's.
    segment_overhead_s: float | None = None
    # The decode TBT SLO the policies that plan for one read: muxwise (required there) and
    # the adaptive layered policy (layer_groups="adaptive"; SchedulerConfig.tbt_slo_s).
    tbt_slo_s: float | None = None
    # MuxWise's constants (muxwise_cost.py); None: the defaults. Only with policy "muxwise".
    muxwise: MuxWiseOptions | None = None

    def __post_init__(self) -> None:
        if self.tp < 1 or self.ep < 1 or self.dp < 1:
            raise ValueError("tp, ep and dp must be >= 1")
        if self.dp > 1 and (self.ep != 1 or self.policy == "muxwise"
                            or self.compiled_cost is not None):
            raise ValueError("dp > 1 (data-parallel attention, mesh (dp, 1, tp)) takes ep 1, "
                             "the analytic cost model and a scheduler policy")
        if not 0 < self.memory_utilization <= 1:
            raise ValueError("memory_utilization must be in (0, 1]")
        if self.tbt_slo_s is not None and not (math.isfinite(self.tbt_slo_s)
                                               and self.tbt_slo_s > 0):
            raise ValueError(f"tbt_slo_s must be > 0, got {self.tbt_slo_s}")
        if self.policy == "muxwise" and self.tbt_slo_s is None:
            raise ValueError('policy "muxwise" needs tbt_slo_s (the decode TBT SLO)')
        if self.muxwise is not None and self.policy != "muxwise":
            raise ValueError('muxwise options apply to policy "muxwise" only')
        if self.policy == "muxwise" and self.preemptible:
            raise ValueError('policy "muxwise" preempts between its own launches; '
                             "preemptible applies to layered")
        if self.policy != "muxwise":
            resolve_policy(self.policy)  # raises ValueError naming what is wrong

    @property
    def is_muxwise(self) -> bool:
        return self.policy == "muxwise"


def weight_bytes(shape: ModelShape) -> float:
    """Stored parameter bytes: embeddings, lm_head and router in the activation dtype;
    attention, experts and dense MLPs in the shape's weight format, scales included."""
    d, e = shape.hidden_size, shape.num_experts
    plain = shape.vocab_size * d * (1 if shape.tie_word_embeddings else 2)
    plain += shape.num_moe_layers * d * e
    stored = shape.num_layers * shape.attention_weight_bytes
    stored += shape.num_moe_layers * shape.expert_bytes_per_layer
    stored += shape.dense_layers_count * shape.dense_mlp_bytes
    stored += shape.num_moe_layers * shape.shared_mlp_bytes
    return float(plain * shape.dtype_bytes + stored)


def kv_bytes_per_token(shape: ModelShape, tp: int = 1) -> float:
    """KV-cache bytes of one token on one device (all layers; KV heads split over tp), in
    the shape's KV format. MLA's latent is not split over heads: every device holds it."""
    if shape.mla_ranks:
        return float(shape.num_layers * shape.kv_values_per_token_layer * shape.kv_itemsize)
    heads = max(shape.num_kv_heads / tp, 1.0)
    return shape.num_layers * 2 * heads * shape.head_dim * shape.kv_itemsize


def derive_num_pages(cfg: SimConfig) -> int:
    if cfg.dp > 1:  # each rank's pool: one chip's room beside the (dp, 1, tp) weights
        chip = dp_chip_layout(cfg.shape, cfg.dp, cfg.tp)
        tokens = chip.kv_tokens(cfg.hardware.hbm_bytes, cfg.memory_utilization,
                                cfg.activation_reserve_bytes)
        if tokens < cfg.page_size:
            raise ValueError(f"{cfg.shape.name} on mesh ({cfg.dp}, 1, {cfg.tp}) of "
                             f"{cfg.hardware.name}: no room for KV beside the weights")
        return cfg.dp * (tokens // cfg.page_size)
    per_device = cfg.hardware.hbm_bytes * cfg.memory_utilization
    free = per_device - weight_bytes(cfg.shape) / (cfg.tp * cfg.ep) - cfg.activation_reserve_bytes
    page = kv_bytes_per_token(cfg.shape, cfg.tp) * cfg.page_size
    pages = int(free // page) * cfg.ep
    if pages < 1:
        raise ValueError(
            f"{cfg.shape.name} does not fit {cfg.tp * cfg.ep} x {cfg.hardware.name}: "
            f"{free / 1e9:.1f} GB left per device for KV"
        )
    return pages


@dataclass(slots=True)
class SimResult:
    requests: list[Request]
    metrics: list[RequestMetrics]  # in request order
    span_s: float  # first arrival to last token
    busy_s: float  # sum of iteration times
    iterations: int
    scheduler_stats: dict[str, int]
    expert_bytes: float
    flops: float
    hbm_bytes: float
    energy_j: float  # NaN without an energy model
    wall_s: float  # host seconds the simulation took
    extra: dict[str, float] = field(default_factory=dict)
    latency: LatencyModel | None = None  # the scheduler's estimator after the run

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_len for r in self.requests)

    @property
    def output_tokens(self) -> int:
        return sum(m.num_tokens for m in self.metrics)

    def ttft_attainment(self) -> dict[str, float]:
        """Share of requests with TTFT <= their own SLO, per class and "all"
        (`ttft_attainment`)."""
        return ttft_attainment(self.requests, self.metrics)

    def summary(self, ttft_slo: float | None = None, tbt_slo: float | None = None) -> dict:
        s = summarize(self.metrics, ttft_slo, tbt_slo)
        e2e = [m.e2e for m in self.metrics if m.e2e is not None]
        tokens = self.prompt_tokens + self.output_tokens
        n = len(self.requests)
        s.update(
            e2e_mean=sum(e2e) / len(e2e) if e2e else math.nan,
            span_s=self.span_s,
            busy_fraction=self.busy_s / self.span_s if self.span_s else math.nan,
            iterations=float(self.iterations),
            preemptions=float(self.scheduler_stats.get("preemptions", 0)),
            expert_gb=self.expert_bytes / 1e9,
            expert_gb_per_100_requests=self.expert_bytes / 1e9 * 100.0 / n if n else math.nan,
            energy_j=self.energy_j,
            mj_per_token=1e3 * self.energy_j / tokens if tokens else math.nan,
            mj_per_output_token=(
                1e3 * self.energy_j / self.output_tokens if self.output_tokens else math.nan
            ),
            wall_s=self.wall_s,
        )
        return s


def ttft_attainment(requests: list[Request], metrics: list[RequestMetrics]) -> dict[str, float]:
    """Share of requests with TTFT <= their own SLO's ttft_s, per class and "all".

    Only requests with a TTFT objective count; one that produced no token fails. Classes
    are `Request.task` ("custom" for an SLO with neither a class nor a name)."""
    passed: dict[str, int] = {}
    total: dict[str, int] = {}
    for r, m in zip(requests, metrics, strict=True):
        if r.slo is None or r.slo.ttft_s is None:
            continue
        ok = int(m.ttft is not None and m.ttft <= r.slo.ttft_s)
        for key in (r.task or "custom", "all"):
            total[key] = total.get(key, 0) + 1
            passed[key] = passed.get(key, 0) + ok
    return {k: passed[k] / total[k] for k in total}


class Simulator:
    def __init__(self, config: SimConfig, executor: CostModelExecutor | None = None) -> None:
        self.config = config
        cc = config.compiled_cost
        cal = config.calibration or (cc.calibration() if cc is not None
                                     else prior_calibration(config.hardware.name))
        options = dict(tp=config.tp, ep=config.ep, routing=config.routing, tile=config.tile,
                       calibration=cal, token_buckets=config.token_buckets,
                       segment_overhead_s=config.segment_overhead_s)
        if executor is None and cc is not None:
            executor = CompiledCostExecutor(config.shape, config.hardware, compiled=cc,
                                            **options)
        if executor is None and config.dp > 1:
            del options["ep"]  # the data ranks are the experts' other axis
            executor = DPCostModelExecutor(config.shape, config.hardware, dp=config.dp,
                                           **options)
        self.executor = executor or CostModelExecutor(config.shape, config.hardware, **options)
        if config.dp > 1 and not isinstance(self.executor, DPCostModelExecutor):
            raise ValueError(f"dp = {config.dp} needs a DPCostModelExecutor, got "
                             f"{type(self.executor).__name__}")
        self.energy = config.energy or energy_model_for(config.hardware)
        self.num_pages = config.num_pages or derive_num_pages(config)
        self.partition: PartitionCostModel | None = None
        if config.is_muxwise:
            options = config.muxwise or MuxWiseOptions()
            self.partition = PartitionCostModel(self.executor, options)
            self.mux_executor = MuxWiseExecutor(self.partition)

    def scheduler_config(self) -> SchedulerConfig:
        """The engine's scheduler config, with MuxWise's policy class bound to this
        simulator's partition model under policy "muxwise"."""
        c = self.config
        policy = (muxwise_policy(self.partition, c.tbt_slo_s) if c.is_muxwise
                  else resolve_policy(c.policy))
        return SchedulerConfig(
            policy=policy,
            num_layers=c.shape.num_layers, max_model_len=c.max_model_len,
            page_size=c.page_size, num_pages=self.num_pages, vocab_size=c.shape.vocab_size,
            max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens,
            layer_groups=c.layer_groups, max_layer_groups=c.max_layer_groups,
            preemption_granularity=c.preemption_granularity, preemptible=c.preemptible,
            slo_alpha=c.slo_alpha, max_paused_prefills=c.max_paused_prefills,
            flowprefill_rules=c.flowprefill_rules, tbt_slo_s=c.tbt_slo_s,
            flowprefill_lookahead=c.flowprefill_lookahead, data_parallel_size=c.dp,
        )  # fmt: skip

    @property
    def observes_latency(self) -> bool:
        """Whether runs feed step times to the scheduler's estimator (SimConfig note)."""
        c = self.config
        if c.observe_latency is None:
            return (self.scheduler_config().policy_class.uses_latency
                    or c.layer_groups == "adaptive")
        return c.observe_latency

    def make_scheduler(self) -> Scheduler:
        """The engine's scheduler with a copy of the configured latency model (or a fresh
        one that knows the model's MoE layers)."""
        c = self.config
        latency = copy.deepcopy(c.latency) if c.latency is not None else None
        if latency is None:
            latency = LatencyModel(ModelDims.from_config(c.shape))
        return Scheduler(self.scheduler_config(), latency=latency)

    def _step_function(self, sched: Scheduler):
        """plan -> StepCost: the executor's, or MuxWise's overlapped iteration under the
        partition the policy chose for the plan."""
        if self.partition is None:
            return self.executor.run
        policy = sched.policy
        assert isinstance(policy, MuxWisePolicy)
        run = self.mux_executor.run
        return lambda plan: run(plan, policy.take_launch(plan.step_id))

    def run(self, requests: list[Request], trace=None) -> SimResult:
        """`trace`: a path, a text file or a TraceWriter for the run's decision trace
        (lp_jax/trace/writer.py; the engine's format, on the simulated clock)."""
        wall0 = time.perf_counter()
        sched = self.make_scheduler()
        if trace is not None and not isinstance(trace, TraceWriter):
            with TraceWriter(trace, source="sim", policy=sched.config.name,
                             num_layers=sched.config.num_layers, clock="simulated") as w:
                return self.run(requests, trace=w)
        run_step = self._step_function(sched)
        ranked = self.config.dp > 1
        if ranked:  # the executor costs each rank's share of a plan
            self.executor.rank_of = sched.block_manager.rank_of
            dp_totals = dict(rows=0.0, padded=0.0, link_bytes=0.0)
        observe = sched.observe if self.observes_latency else None
        expert_size = self.config.shape.expert_bytes or 1
        order = sorted(range(len(requests)), key=lambda i: (requests[i].arrival, i))
        seqs: list[Sequence | None] = [None] * len(requests)
        now = requests[order[0]].arrival if order else 0.0
        start = now
        nxt = 0
        busy = flops = nbytes = expert_bytes = 0.0
        iterations = 0
        while nxt < len(order) or sched.has_unfinished():
            while nxt < len(order) and requests[order[nxt]].arrival <= now:
                i = order[nxt]
                r = requests[i]
                seq = Sequence(
                    i, [_TOKEN] * r.prompt_len,
                    SamplingParams(max_tokens=r.output_len, ignore_eos=True),
                    arrival_time=r.arrival, slo=r.slo,
                )  # fmt: skip
                sched.add(seq)
                seqs[i] = seq
                if trace is not None:
                    trace.arrival(seq, r.arrival)
                nxt += 1
            if not sched.has_unfinished():
                now = requests[order[nxt]].arrival
                continue
            plan = sched.schedule(now)
            if trace is not None:
                trace.plan(plan, now, sched.latency.peek_plan(plan)
                           if plan.phase != "idle" else None, sched)
            if plan.phase == "idle":
                if self.partition is not None:
                    sched.policy.take_launch(plan.step_id)
                sched.commit(plan, StepResult(), now)
                if nxt >= len(order):
                    raise RuntimeError(f"simulation stuck at t={now:.3f}: nothing can run")
                now = max(now, requests[order[nxt]].arrival)
                continue
            if ranked:  # the rows each rank runs, and the SPMD step's padding
                sched.block_manager.count_rows(plan)
                for key, value in self.executor.balance(plan).items():
                    dp_totals[key] += value
            cost = run_step(plan)
            if trace is not None:
                trace.step_done(plan, cost.seconds, now, now + cost.seconds)
            now += cost.seconds
            busy += cost.seconds
            flops += cost.flops
            nbytes += cost.hbm_bytes
            expert_bytes += cost.expert_bytes
            iterations += 1
            if observe is not None:  # the experts the step activated, over its MoE layers
                experts = cost.expert_bytes / expert_size if self.config.shape.is_moe else None
                observe(plan, cost.seconds, experts)
            done = sched.commit(plan, StepResult({s.seq_id: _TOKEN for s in plan.sampling_seqs}),
                                now)
            if trace is not None:
                for seq in done:
                    trace.finish(seq, now)
        span = now - start
        energy = math.nan
        if self.energy is not None:
            energy = self.energy.joules(span, flops, nbytes, devices=self.executor.devices)
        extra = sched.policy.stats() if isinstance(sched.policy, MuxWisePolicy) else {}
        if ranked:
            extra.update(dp_stats(sched.block_manager.balance(), dp_totals))
        return SimResult(
            requests=list(requests),
            metrics=[s.metrics() for s in seqs],
            span_s=span,
            busy_s=busy,
            iterations=iterations,
            scheduler_stats=sched.stats(),
            expert_bytes=expert_bytes,
            flops=flops,
            hbm_bytes=nbytes,
            energy_j=energy,
            wall_s=time.perf_counter() - wall0,
            extra=extra,
            latency=sched.latency,
        )


def dp_stats(balance: dict, totals: dict) -> dict[str, float]:
    """A run's data-parallel balance: from the scheduler's RankedBlockManager.balance, the
    rows each rank ran (`dp_rows_<r>`, a plan's rows counted once per plan, as the engine
    counts them) and the rows padded; from the executor's per-layer counts
    (`DPCostModelExecutor.balance` summed), the share of row-layers that were padding, the
    busiest rank's rows over the mean (1 when balanced), and one chip's link bytes."""
    rows = balance["rows"]
    total = sum(rows)
    out = {f"dp_rows_{r}": float(n) for r, n in enumerate(rows)}
    run, pad = totals["rows"], totals["padded"]
    out.update(dp_padded_rows=float(balance["padded_rows"]),
               dp_padding=pad / (run + pad) if run else 0.0,
               dp_imbalance=max(rows) * len(rows) / total if total else 1.0,
               dp_link_bytes=totals["link_bytes"])
    return out


def simulate(config: SimConfig, requests: list[Request], trace=None) -> SimResult:
    return Simulator(config).run(requests, trace=trace)


def warm_latency(config: SimConfig, *, seed: int = 0, output_len: int = 1) -> LatencyModel:
    """A latency model fitted by a short profiling run under `config`: the waves of
    `lp_jax.core.latency.profile_prompts` (one prompt, then a batch of shorter ones, for
    sizes 2-90% of the token budget), each wave alone on the machine."""
    sim = Simulator(replace(config, observe_latency=True))
    cfg = sim.scheduler_config()
    rng = np.random.default_rng(seed)
    waves = profile_prompts(cfg.max_num_batched_tokens, cfg.max_model_len, cfg.max_num_seqs, rng)
    requests = [Request(1000.0 * w, n, output_len) for w, wave in enumerate(waves) for n in wave]
    result = sim.run(requests)
    model = result.latency
    model.source = f"simulated profile ({len(waves)} waves, {cfg.name})"
    return model


def solo_ttft(config: SimConfig, prompt_len: int) -> float:
    """TTFT of one prompt alone on an idle simulated machine under `config` (the SLO base
    of a multi-SLO workload; pass e.g. policy "orca" for one whole-prompt step)."""
    result = Simulator(config).run([Request(0.0, int(prompt_len), 1)])
    ttft = result.metrics[0].ttft
    if ttft is None:
        raise RuntimeError(f"a lone {prompt_len}-token prompt produced no token")
    return ttft
