"""Paper-scale discrete-event simulator for lp_jax's scheduler.

The real `lp_jax.core.scheduler.Scheduler` (every policy, unchanged) is driven by a
roofline cost model instead of the JAX executor:

- `executor`    -- `CostModelExecutor`: StepPlan -> seconds, FLOPs, HBM bytes, expert bytes;
- `calibration` -- `Calibration` efficiency factors and overheads, least-squares `fit`;
- `energy`      -- `EnergyModel`: static W + J/FLOP + J/byte, documented constants, `fit`;
- `workload`    -- Poisson / gamma arrivals, ShareGPT-8k, arXiv and Azure length models,
                   CSV / JSONL traces loaded through grain; multi-SLO task classes
                   (FlowPrefill's QwenTrace) whose TTFT SLOs are k x a solo TTFT;
- `simulator`   -- `SimConfig`, `Simulator.run(requests) -> SimResult`;
- `dp_executor` -- `DPCostModelExecutor`: data-parallel attention beside expert
                   parallelism (`SimConfig(dp=...)`), each sequence on the rank the
                   engine's scheduler places it, a step the busiest rank's;
- `muxwise_cost` -- MuxWise's SM-partition cost model of concurrent prefill / decode
                   streams, and its executor;
- `muxwise`     -- MuxWise's policy (`SimConfig(policy="muxwise", tbt_slo_s=...)`);
- `muxwise_predict` -- what MuxWise predicts with: the cost model (oracle) or the
                   engine's LatencyModel, per-partition factors and a contention guard;
- `ttft_fit`    -- FlowPrefill's cubic-in-tokens TTFT fit against the LatencyModel;
- `slo`         -- attainment and the sustainable-rate search;
- `disagg`      -- prefill / decode disaggregated serving (`DisaggConfig`,
                   `run_disaggregated`), KV transfers over `kv_link` (NVLink, ICI, DCN);
- `trace_file`  -- the CSV / JSONL trace format (docs/trace_format.md).

`launch/reproduce_paper.py` reproduces the layered-prefill paper's comparison with it,
`launch/bench_flowprefill_sim.py` FlowPrefill's (goodput, SLO scale, blocking time), and
`launch/sim_fidelity.py` checks it against the real engine on CPU.
"""

from lp_jax.sim.calibration import GPU_PRIOR, Calibration, StepFeatures, prior_calibration
from lp_jax.sim.disagg import DisaggConfig, DisaggResult, replicated, run_disaggregated
from lp_jax.sim.dp_executor import DPCostModelExecutor
from lp_jax.sim.energy import EnergyModel, energy_model_for
from lp_jax.sim.executor import CostModelExecutor, StepCost
from lp_jax.sim.kv_link import KVLink, kv_link
from lp_jax.sim.muxwise import MuxWisePolicy, muxwise_policy
from lp_jax.sim.muxwise_cost import Launch, MuxWiseExecutor, MuxWiseOptions, PartitionCostModel
from lp_jax.sim.simulator import (
    SimConfig,
    SimResult,
    Simulator,
    derive_num_pages,
    kv_bytes_per_token,
    simulate,
    solo_ttft,
    ttft_attainment,
    warm_latency,
    weight_bytes,
)
from lp_jax.sim.slo import RateSearch, attainment, sustainable_rate
from lp_jax.sim.task_classes import (
    QWENTRACE,
    REFERENCE_SLOS,
    SLO_SCALES,
    SLO_SETS,
    TaskClass,
    absolute_slos,
    class_slos,
    configure_classes,
    multi_slo_requests,
    parse_assignments,
    parse_task_class,
)
from lp_jax.sim.trace_file import TraceError, parse_record
from lp_jax.sim.workload import (
    ARXIV_PAPER,
    SHAREGPT_8K,
    EmpiricalLengths,
    LognormalLengths,
    QuantileLengths,
    Request,
    TraceRow,
    arrival_times,
    length_model,
    load_trace,
    synthesize,
    trace_requests,
)

__all__ = [
    "ARXIV_PAPER",
    "GPU_PRIOR",
    "QWENTRACE",
    "SHAREGPT_8K",
    "Calibration",
    "CostModelExecutor",
    "DPCostModelExecutor",
    "DisaggConfig",
    "DisaggResult",
    "EmpiricalLengths",
    "EnergyModel",
    "KVLink",
    "Launch",
    "LognormalLengths",
    "MuxWiseExecutor",
    "MuxWiseOptions",
    "MuxWisePolicy",
    "PartitionCostModel",
    "QuantileLengths",
    "RateSearch",
    "Request",
    "SimConfig",
    "SimResult",
    "Simulator",
    "StepCost",
    "StepFeatures",
    "TaskClass",
    "TraceError",
    "TraceRow",
    "REFERENCE_SLOS",
    "SLO_SCALES",
    "SLO_SETS",
    "absolute_slos",
    "arrival_times",
    "attainment",
    "class_slos",
    "configure_classes",
    "derive_num_pages",
    "energy_model_for",
    "kv_bytes_per_token",
    "kv_link",
    "length_model",
    "load_trace",
    "multi_slo_requests",
    "muxwise_policy",
    "parse_assignments",
    "parse_record",
    "parse_task_class",
    "prior_calibration",
    "replicated",
    "run_disaggregated",
    "simulate",
    "solo_ttft",
    "sustainable_rate",
    "synthesize",
    "trace_requests",
    "ttft_attainment",
    "warm_latency",
    "weight_bytes",
]
