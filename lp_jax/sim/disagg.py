"""Prefill / decode disaggregated serving in the simulator (a baseline; DistServe-style).

Design note. `num_prefill` prefill instances and `num_decode` decode instances, each a
model replica on its own `tp x ep` chips, so `DisaggConfig.chips` can be set equal to a
co-located run's. A request's life:

1. arrival -> a prefill instance, round-robin in arrival order. Each prefill instance is a
   `Simulator` running the engine's scheduler under its own policy (chunked, FlowPrefill,
   ...) on prefill-only requests (output 1: a request leaves at its first token), so no
   decode ever runs there. Its TTFT SLO, if any, is shortened by the predicted transfer
   time of its KV alone on the link (`deduct_transfer`), so FlowPrefill's deadlines leave
   room for the hand-off.
2. prefill done -> the KV moves over the instance's outgoing link (kv_link.py), one
   transfer at a time in the order prefills finish (a FIFO link). The first token reaches
   the user only when the decode instance has the KV: TTFT = prefill finish + link wait +
   transfer.
3. transfer done -> a decode instance, round-robin in that order. A decode instance
   (`DecodeInstance`) runs decode-only plans of the engine's `StepPlan` type, costed by
   the same `CostModelExecutor`: continuous batching of up to `max_num_seqs` requests; a
   request is admitted, first come first served, once pages for its prompt and whole
   output are free (reserved up front, so a decode is never preempted), and gets one
   token per step. The wait for pages shows in the request's first inter-token gap;
   where its KV sits meanwhile is not modelled (DistServe keeps it on the prefill
   instance until the decode instance pulls it).

Every instance's executor charges its calibrated per-iteration overhead. Nothing is
random: a run is a pure function of the requests.

`replicated` runs `n` co-located replicas of one `SimConfig` on a round-robin split, to
compare at an equal chip count when a disaggregated deployment has more than two
instances.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

from lp_jax.core.metrics import RequestMetrics
from lp_jax.core.plan import StepPlan
from lp_jax.core.slo import SLO
from lp_jax.sim.kv_link import KVLink
from lp_jax.sim.simulator import SimConfig, SimResult, Simulator, kv_bytes_per_token
from lp_jax.sim.workload import Request


@dataclass(frozen=True, slots=True, kw_only=True)
class DisaggConfig:
    prefill: SimConfig  # one prefill instance: its policy, tp, ep, ...
    decode: SimConfig  # one decode instance: tp, ep, max_num_seqs, pages (policy unused)
    link: KVLink
    num_prefill: int = 1
    num_decode: int = 1
    deduct_transfer: bool = True  # prefill instances see TTFT SLO - predicted transfer

    def __post_init__(self) -> None:
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError("need at least one prefill and one decode instance")
        if self.prefill.shape != self.decode.shape:
            raise ValueError("prefill and decode instances must serve the same model")
        if self.prefill.is_muxwise:
            raise ValueError('a prefill instance runs a scheduler policy, not "muxwise"')

    @property
    def chips(self) -> int:
        p, d = self.prefill, self.decode
        return self.num_prefill * p.tp * p.ep + self.num_decode * d.tp * d.ep

    @property
    def transfer_chips(self) -> int:
        """Chips sending one request's KV in parallel (each holds its share of heads)."""
        return min(self.prefill.tp, self.decode.tp)

    def kv_bytes(self, prompt_len: int) -> float:
        """The whole KV cache of a prompt (all layers, all KV heads)."""
        return prompt_len * kv_bytes_per_token(self.prefill.shape, tp=1)

    def transfer_s(self, prompt_len: int) -> float:
        """One prompt's KV alone on the link."""
        return self.link.seconds(self.kv_bytes(prompt_len), self.transfer_chips)


@dataclass(slots=True)
class DisaggResult:
    result: SimResult  # the requests' end-to-end metrics and summed counters
    prefill_done_s: list[float]  # per request: when its prefill finished
    transfer_s: list[float]  # per request: KV transfer time (link wait excluded)
    link_wait_s: list[float]  # per request: waiting for the link
    decode_wait_s: list[float]  # per request: KV arrived -> admitted on a decode instance
    decode_plans: list[StepPlan] = field(default_factory=list)  # when kept (keep_plans)

    def ttft_attainment(self) -> dict[str, float]:
        return self.result.ttft_attainment()


class DecodeInstance:
    """Decode-only continuous batching on one replica (module note, step 3)."""

    def __init__(self, config: SimConfig, keep_plans: bool = False) -> None:
        sim = Simulator(config)
        self.config, self.executor, self.num_pages = config, sim.executor, sim.num_pages
        self.energy = sim.energy
        self.keep_plans = keep_plans

    def pages(self, tokens: int) -> int:
        return -(-tokens // self.config.page_size)

    def run(self, jobs: list[tuple[float, int, int, int]]):
        """`jobs`: (KV arrival time, request index, prompt length, output length) with
        output length >= 2 (the first token came from prefill). Returns {index: token
        times after the first}, {index: admission wait}, and counters."""
        cfg = self.config
        for _, i, p, o in jobs:
            if self.pages(p + o) > self.num_pages:
                raise ValueError(f"request {i} ({p} + {o} tokens) can never fit the decode "
                                 f"instance's {self.num_pages} pages")
        jobs = sorted(jobs)
        tokens: dict[int, list[float]] = {i: [] for _, i, _, _ in jobs}
        wait: dict[int, float] = {}
        running: list[_Decoding] = []
        free, nxt, now, step = self.num_pages, 0, jobs[0][0] if jobs else 0.0, 0
        busy = flops = nbytes = expert_bytes = 0.0
        plans = []
        while nxt < len(jobs) or running:
            while (nxt < len(jobs) and jobs[nxt][0] <= now and len(running) < cfg.max_num_seqs
                   and self.pages(jobs[nxt][2] + jobs[nxt][3]) <= free):
                t, i, p, o = jobs[nxt]
                free -= self.pages(p + o)
                wait[i] = now - t
                running.append(_Decoding(i, p + 1, o - 1, self.pages(p + o)))
                nxt += 1
            if not running:
                now = jobs[nxt][0]
                continue
            plan = StepPlan(step, cfg.shape.num_layers, decode=tuple(running))
            step += 1
            cost = self.executor.run(plan)
            if self.keep_plans:
                plans.append(plan)
            now += cost.seconds
            busy += cost.seconds
            flops, nbytes = flops + cost.flops, nbytes + cost.hbm_bytes
            expert_bytes += cost.expert_bytes
            still = []
            for d in running:
                tokens[d.seq_id].append(now)
                d.num_tokens += 1
                d.left -= 1
                if d.left:
                    still.append(d)
                else:
                    free += d.num_pages
            running = still
        counters = {"busy_s": busy, "flops": flops, "hbm_bytes": nbytes,
                    "expert_bytes": expert_bytes, "iterations": step, "end": now}
        return tokens, wait, counters, plans


@dataclass(slots=True)
class _Decoding:
    """What a decode plan reads of a sequence (`num_tokens`: its KV length with the new
    token), plus the instance's bookkeeping."""

    seq_id: int  # the request index
    num_tokens: int
    left: int  # tokens still to decode
    num_pages: int


def _prefill_request(r: Request, cfg: DisaggConfig) -> Request:
    slo = r.slo
    if cfg.deduct_transfer and slo is not None and slo.ttft_s is not None:
        slo = SLO(max(slo.ttft_s - cfg.transfer_s(r.prompt_len), 1e-6), slo.tbt_s, slo.name)
    return replace(r, output_len=1, slo=slo)


def run_disaggregated(cfg: DisaggConfig, requests: list[Request], *,
                      keep_plans: bool = False) -> DisaggResult:
    """Serve `requests` on the disaggregated deployment (module note)."""
    wall0 = time.perf_counter()
    n = len(requests)
    order = sorted(range(n), key=lambda i: (requests[i].arrival, i))
    done = [math.nan] * n
    agg = {"busy_s": 0.0, "flops": 0.0, "hbm_bytes": 0.0, "expert_bytes": 0.0,
           "iterations": 0, "energy_j": 0.0}
    stats: dict[str, int] = {}
    prefill_sims = []
    for k in range(cfg.num_prefill):
        mine = order[k::cfg.num_prefill]
        if not mine:
            continue
        res = Simulator(cfg.prefill).run([_prefill_request(requests[i], cfg) for i in mine])
        prefill_sims.append(res)
        for i, m in zip(mine, res.metrics, strict=True):
            done[i] = m.first_token_time
        for key, v in res.scheduler_stats.items():
            stats[key] = stats.get(key, 0) + v
        for key in ("busy_s", "flops", "hbm_bytes", "expert_bytes", "iterations"):
            agg[key] += getattr(res, key)
        agg["energy_j"] += res.energy_j
    # the link of each prefill instance: transfers one at a time, in finishing order
    transfer = [cfg.transfer_s(r.prompt_len) for r in requests]
    ready, link_wait = [math.nan] * n, [0.0] * n
    for k in range(cfg.num_prefill):
        free_at = -math.inf
        for i in sorted(order[k::cfg.num_prefill], key=lambda i: (done[i], i)):
            start = max(done[i], free_at)
            link_wait[i] = start - done[i]
            ready[i] = free_at = start + transfer[i]
    # decode instances, round-robin in KV-arrival order
    by_ready = sorted(range(n), key=lambda i: (ready[i], i))
    decoding = [i for i in by_ready if requests[i].output_len > 1]
    later: dict[int, list[float]] = {}
    decode_wait = [0.0] * n
    plans: list[StepPlan] = []
    end = max(ready, default=0.0)
    decoder = DecodeInstance(cfg.decode, keep_plans)
    for k in range(cfg.num_decode):
        jobs = [(ready[i], i, requests[i].prompt_len, requests[i].output_len)
                for i in decoding[k::cfg.num_decode]]
        if not jobs:
            continue
        tokens, wait, counters, kept = decoder.run(jobs)
        later.update(tokens)
        for i, w in wait.items():
            decode_wait[i] = w
        plans += kept
        end = max(end, counters["end"])
        for key in ("busy_s", "flops", "hbm_bytes", "expert_bytes", "iterations"):
            agg[key] += counters[key]
        agg["energy_j"] += math.nan if decoder.energy is None else decoder.energy.joules(
            counters["end"] - jobs[0][0], counters["flops"], counters["hbm_bytes"],
            devices=decoder.executor.devices)
    metrics = [RequestMetrics(r.arrival, token_times=(ready[i], *later.get(i, ())))
               for i, r in enumerate(requests)]
    start = requests[order[0]].arrival if n else 0.0
    waits = [link_wait[i] for i in range(n)]
    extra = {"chips": float(cfg.chips),
             "kv_transfer_mean_s": sum(transfer) / n if n else math.nan,
             "kv_transfer_max_s": max(transfer, default=math.nan),
             "link_wait_mean_s": sum(waits) / n if n else math.nan,
             "decode_wait_mean_s": sum(decode_wait) / n if n else math.nan}
    result = SimResult(
        requests=list(requests), metrics=metrics, span_s=end - start, busy_s=agg["busy_s"],
        iterations=int(agg["iterations"]), scheduler_stats=stats,
        expert_bytes=agg["expert_bytes"], flops=agg["flops"], hbm_bytes=agg["hbm_bytes"],
        energy_j=agg["energy_j"], wall_s=time.perf_counter() - wall0, extra=extra,
    )  # fmt: skip
    return DisaggResult(result, done, transfer, link_wait, decode_wait, plans)


def replicated(config: SimConfig, replicas: int, requests: list[Request]) -> SimResult:
    """`replicas` co-located copies of `config`, requests round-robin in arrival order;
    metrics in request order, counters summed, span first arrival to last token."""
    if replicas < 1:
        raise ValueError("need at least one replica")
    if replicas == 1:
        return Simulator(config).run(requests)
    wall0 = time.perf_counter()
    n = len(requests)
    order = sorted(range(n), key=lambda i: (requests[i].arrival, i))
    metrics: list[RequestMetrics | None] = [None] * n
    parts = []
    for k in range(replicas):
        mine = order[k::replicas]
        if not mine:
            continue
        res = Simulator(config).run([requests[i] for i in mine])
        parts.append(res)
        for i, m in zip(mine, res.metrics, strict=True):
            metrics[i] = m
    stats: dict[str, int] = {}
    for res in parts:
        for key, v in res.scheduler_stats.items():
            stats[key] = stats.get(key, 0) + v
    last = max(max((m.token_times[-1] for m in res.metrics if m.token_times), default=0.0)
               for res in parts)
    return SimResult(
        requests=list(requests), metrics=metrics, span_s=last - requests[order[0]].arrival,
        busy_s=sum(r.busy_s for r in parts), iterations=sum(r.iterations for r in parts),
        scheduler_stats=stats, expert_bytes=sum(r.expert_bytes for r in parts),
        flops=sum(r.flops for r in parts), hbm_bytes=sum(r.hbm_bytes for r in parts),
        energy_j=sum(r.energy_j for r in parts), wall_s=time.perf_counter() - wall0,
        extra={"chips": float(replicas * config.tp * config.ep)},
    )  # fmt: skip
