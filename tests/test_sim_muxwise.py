"""MuxWise in the simulator: the SM-partition cost model (monotone in a stream's share, the
executor's solo cost at the whole device, bandwidth contention, sync and async launches,
step-time noise), and the policy driving the engine's scheduler (every request finishes,
no page leak, decode TBT within its SLO, short requests preempting long ones between
launches). The TBT checks measure the gaps between simulated token times; the one that
matters runs MuxWise on the engine's estimator, not on the simulator's own cost model, and
the same check is shown to catch a predictor that underestimates the decode step."""

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from conftest import launch_module

from lp_jax.core.latency import FEATURES, LatencyModel, ModelDims
from lp_jax.core.plan import PrefillChunk, StepPlan
from lp_jax.core.sampling_params import SamplingParams
from lp_jax.core.sequence import Sequence
from lp_jax.roofline import QWEN3_30B_A3B, get_hardware
from lp_jax.sim import (
    CostModelExecutor,
    Launch,
    MuxWiseExecutor,
    MuxWiseOptions,
    PartitionCostModel,
    Request,
    SimConfig,
    Simulator,
    muxwise_predict,
    prior_calibration,
    synthesize,
)
from lp_jax.sim.muxwise import MuxWisePolicy
from lp_jax.sim.muxwise_cost import Measured, contended

H100 = get_hardware("h100")
SHAPE = QWEN3_30B_A3B
L = SHAPE.num_layers
TBT = 0.1
ROOT = Path(__file__).resolve().parents[1]


def _executor() -> CostModelExecutor:
    return CostModelExecutor(SHAPE, H100, tp=2, calibration=prior_calibration(H100.name))


def _decoding(seq_id: int, context: int) -> Sequence:
    s = Sequence(seq_id, [1] * context, SamplingParams(max_tokens=8))
    s.token_ids.append(1)
    return s


def _prefill_plan(tokens: int, span: tuple[int, int] | None = None, decode=()) -> StepPlan:
    seq = Sequence(999, [1] * tokens, SamplingParams(max_tokens=8))
    kw = {} if span is None else dict(unit_start=span[0], unit_end=span[1], num_groups=2 * L)
    return StepPlan(0, L, decode=tuple(decode), prefill=(PrefillChunk(seq, 0, tokens),),
                    prefill_batch_id=0, **kw)  # fmt: skip


def _config(**kw) -> SimConfig:
    base = dict(shape=SHAPE, hardware=H100, policy="muxwise", tp=2, tbt_slo_s=TBT)
    return SimConfig(**(base | kw))


# ----- the cost model ------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["prefill", "prefill_span", "decode"])
def test_phase_cost_is_monotone_in_its_share(kind):
    model = PartitionCostModel(_executor(), MuxWiseOptions())
    plans = {
        "prefill": _prefill_plan(8192),
        "prefill_span": _prefill_plan(4096, (3, 20)),
        "decode": StepPlan(0, L, decode=tuple(_decoding(i, 4096) for i in range(32))),
    }
    stream = model.plan_stream(plans[kind])
    shares = np.linspace(0.02, 1.0, 50)
    t = [model.ops_seconds(stream, x) for x in shares]
    assert all(a >= b for a, b in zip(t, t[1:], strict=False))
    assert model.ops_seconds_W(stream) == pytest.approx(
        [model.ops_seconds(stream, x) for x in model.shares_W], rel=1e-12)
    # Next to a fixed other stream (contention included) the finish is still monotone.
    other = model.plan_stream(plans["decode" if kind != "decode" else "prefill"])
    t_o, mem_o = model.ops_seconds(other, 0.5), other.memory_s
    fin = [contended(ti, stream.memory_s, t_o, mem_o)[0] for ti in t]
    assert all(a >= b - 1e-15 for a, b in zip(fin, fin[1:], strict=False))


def test_whole_device_equals_the_executor_solo_cost():
    ex = _executor()
    model = PartitionCostModel(ex, MuxWiseOptions())
    mux = MuxWiseExecutor(model)
    cal = ex.calibration
    for plan in (_prefill_plan(8192), _prefill_plan(3000, (5, 40)),
                 StepPlan(0, L, decode=tuple(_decoding(i, 2048) for i in range(16)))):
        s = model.plan_stream(plan)
        ours = model.ops_seconds(s, 1.0) + cal.overhead_s + cal.layer_overhead_s * s.layers
        assert ours == pytest.approx(ex.run(plan).seconds, rel=1e-9)
        assert mux.run(plan, Launch(1.0)).seconds == pytest.approx(ex.run(plan).seconds)
        sync = model.options.sync_s
        assert mux.run(plan, Launch(1.0, True)).seconds == pytest.approx(
            ex.run(plan).seconds + sync)


def test_bandwidth_contention_and_overlap():
    assert contended(1.0, 0.2, 2.0, 0.4) == (1.0, 2.0)  # demands 0.2 + 0.2: no contention
    assert contended(1.0, 1.0, 1.0, 1.0) == (2.0, 2.0)  # both memory-bound: half each
    # The shorter stream slows by f = 1.5 while both run; the longer one then runs alone.
    fa, fb = contended(1.0, 1.0, 4.0, 2.0)
    assert (fa, fb) == pytest.approx((1.5, 1.5 + 3.0))
    model = PartitionCostModel(_executor(), MuxWiseOptions())
    assert model.bandwidth_cap(0.2) == pytest.approx(0.5) and model.bandwidth_cap(0.6) == 1.0
    # An overlapped iteration costs at least each phase alone on its partition and at most
    # running them one after the other on the whole... partitions.
    decode = tuple(_decoding(i, 4096) for i in range(32))
    plan = _prefill_plan(4096, (0, 8), decode)
    dec = StepPlan(0, L, decode=decode)
    for share in (0.25, 0.5, 0.75):
        it = model.iteration(plan, share)
        alone_d = model.ops_seconds(model.plan_stream(dec), 1 - share)
        assert it.decode_s >= alone_d
        assert it.seconds == max(it.decode_s, it.prefill_s)
    with pytest.raises(ValueError):
        model.iteration(plan, 1.0)


# ----- the policy in the simulator -----------------------------------------------------------
def _capture(sim: Simulator) -> list:
    made = []
    make = sim.make_scheduler

    def wrapped():
        made.append(make())
        return made[-1]

    sim.make_scheduler = wrapped
    return made


def test_muxwise_run_finishes_every_request_without_page_leak():
    reqs = synthesize("sharegpt", 60, 5.0, seed=1)
    sim = Simulator(_config())
    made = _capture(sim)
    res = sim.run(reqs)
    assert [m.num_tokens for m in res.metrics] == [r.output_len for r in reqs]
    sched = made[0]
    assert not sched.has_unfinished()
    assert sched.block_manager.num_free_pages == sched.config.num_pages
    assert res.extra["muxwise_overlapped_launches"] > 0
    assert 0 < res.extra["muxwise_mean_prefill_share"] < 1
    assert res.scheduler_stats["finished"] == len(reqs)


def test_muxwise_decode_tbt_within_the_slo():
    """Eight requests decode while long prompts prefill next to them: every token gap
    stays under the TBT SLO, and the prefill ran on a partition beside the decodes."""
    reqs = [Request(0.001 * i, 256, 120) for i in range(8)]
    reqs += [Request(0.3 + 0.4 * i, 24000, 4) for i in range(3)]
    res = Simulator(_config()).run(reqs)
    assert max(m.max_itl for m in res.metrics) <= TBT
    assert res.extra["muxwise_overlapped_launches"] > 0
    assert res.extra["muxwise_fallback_partitions"] == 0
    # The long prompts would have been a long stall for whole-prompt prefill.
    orca = Simulator(_config(policy="orca", tbt_slo_s=None)).run(reqs)
    assert max(m.max_itl for m in orca.metrics) > TBT


def _gaps(res) -> list[float]:
    """Every inter-token gap of the run, from the simulated token times."""
    return [g for m in res.metrics for g in m.itls]


def _heavy_decodes(tbt: float, **opts):
    """96 requests decode 4096-token contexts (a decode step near the SLO on a small
    share) while two 16k prompts prefill beside them."""
    reqs = [Request(0.001 * i, 4096, 60) for i in range(96)]
    reqs += [Request(1.0 + 0.3 * i, 16000, 4) for i in range(2)]
    sim = Simulator(_config(tbt_slo_s=tbt, muxwise=MuxWiseOptions(**opts)))
    made = _capture(sim)
    return sim.run(reqs), made[0].policy


def test_estimator_muxwise_meets_the_tbt_slo_measured_from_token_times(monkeypatch):
    """MuxWise planning with the engine's LatencyModel (noisy profile, online contention
    guard, 5% step-time jitter, async launches): every measured token gap stays within
    the 40 ms SLO. The same measurement fails a predictor that underestimates the decode
    step by 20% and does not learn from what it observes."""
    tbt = 0.04
    res, policy = _heavy_decodes(tbt, predictor="estimator", noise=0.05, launches="async")
    assert policy.predictor.kind == "estimator"
    assert policy.predictor.guard and policy.predictor.observed == res.iterations
    assert res.extra["muxwise_overlapped_launches"] > 20
    assert max(_gaps(res)) <= tbt
    assert all(m.num_tokens == 60 for m in res.metrics[:96])
    assert 0 < res.extra["muxwise_decode_pred_error"] < 0.5  # it is not the truth
    est = muxwise_predict.EstimatedPredictor
    alone = est.decode_alone
    monkeypatch.setattr(est, "decode_alone", lambda self, dec, w: 0.8 * alone(self, dec, w))
    monkeypatch.setattr(est, "observe", lambda *a: None)
    broken, _ = _heavy_decodes(tbt, predictor="estimator", noise=0.05, launches="async")
    gaps = _gaps(broken)
    assert sum(g > tbt for g in gaps) / len(gaps) > 0.02


def test_async_launches_carry_work_into_the_next_decode_step():
    """A launch longer than the decode step: sync waits for it; async ends with the
    decode step and carries the rest, which the next iteration runs first (beside its
    decodes); a launch that ends the batch waits; a repartition drains the carry."""
    decode = tuple(_decoding(i, 1024) for i in range(8))
    long_launch = _prefill_plan(8192, (0, 24), decode)
    last = _prefill_plan(8192, (2 * L - 4, 2 * L), decode)
    ex = _executor()
    sync = MuxWiseExecutor(PartitionCostModel(ex, MuxWiseOptions()))
    asyn = MuxWiseExecutor(PartitionCostModel(ex, MuxWiseOptions(launches="async")))
    seen = []
    launch = Launch(0.5, False, lambda plan, m: seen.append(m))
    s = sync.run(long_launch, launch).seconds
    m_sync = seen[-1]
    assert m_sync.prefill_s > m_sync.decode_s and s == pytest.approx(m_sync.prefill_s)
    a = asyn.run(replace(long_launch, step_id=1), launch).seconds
    m = seen[-1]
    assert a == pytest.approx(m.decode_s) and a < s
    assert m.carry_s == pytest.approx(m.prefill_s - m.decode_s) and m.carry_s > 0
    # The next decode step runs beside the carry (no new launch on the prefill stream).
    nxt = asyn.run(StepPlan(2, L, decode=decode), launch).seconds
    m2 = seen[-1]
    assert m2.carry_in_s == pytest.approx(m.carry_s) and m2.prefill_s >= m.carry_s
    alone = sync.run(StepPlan(3, L, decode=decode), Launch(0.0)).seconds
    assert nxt >= alone
    # The batch's last launch waits for the prefill stream, in async mode too.
    asyn.run(replace(long_launch, step_id=4), launch)
    end = asyn.run(replace(last, step_id=5), launch).seconds
    assert end == pytest.approx(max(seen[-1].decode_s, seen[-1].prefill_s))
    assert seen[-1].carry_s == 0
    # A repartition with work in flight stalls on it.
    asyn.run(replace(long_launch, step_id=6), launch)
    carry = seen[-1].carry_s
    re = asyn.run(StepPlan(7, L, decode=decode), Launch(0.0, True)).seconds
    assert re == pytest.approx(alone + carry + MuxWiseOptions().sync_s)
    # A new run (step ids start over) drops the carry.
    asyn.run(replace(long_launch, step_id=8), launch)
    assert asyn.run(StepPlan(0, L, decode=decode), launch).seconds == pytest.approx(alone)
    assert isinstance(seen[-1], Measured)


def test_noise_is_seeded_and_the_oracle_sees_none_of_it():
    reqs = [Request(0.001 * i, 512, 40) for i in range(16)] + [Request(0.2, 12000, 2)]
    runs = {}
    for key, opts in (("none", {}), ("a", dict(noise=0.1)), ("a2", dict(noise=0.1)),
                      ("b", dict(noise=0.1, noise_seed=1))):
        runs[key] = Simulator(_config(muxwise=MuxWiseOptions(**opts))).run(reqs)
    assert _gaps(runs["a"]) == _gaps(runs["a2"])  # a pure function of the requests
    assert _gaps(runs["a"]) != _gaps(runs["b"]) != _gaps(runs["none"])
    assert np.std(_gaps(runs["a"])) > np.std(_gaps(runs["none"]))


def test_short_request_preempts_a_long_prefill_between_launches():
    """Launches next to running decodes are short, so a short request arriving in the
    middle of a long prefill batch pauses it at the next launch boundary."""
    long_n, short_n = 30000, 300
    decodes = [Request(0.0, 128, 300) for _ in range(4)]
    reqs = decodes + [Request(0.05, long_n, 2), Request(0.17, short_n, 2)]
    cfg = _config(max_model_len=32768)
    res = Simulator(cfg).run(reqs)
    ttft_long, ttft_short = res.metrics[-2].ttft, res.metrics[-1].ttft
    assert res.extra["muxwise_short_preemptions"] == 1
    assert res.scheduler_stats["prefill_pauses"] == 1
    assert res.scheduler_stats["prefill_resumes"] == 1
    assert ttft_short < 2 * TBT  # the launch in progress, then its own prefill
    assert ttft_short < ttft_long / 2
    assert max(m.max_itl for m in res.metrics) <= TBT
    # Without the short-request rule it waits for the long prefill's whole batch.
    fcfs = Simulator(replace(cfg, muxwise=MuxWiseOptions(preempt_ratio=0.0))).run(reqs)
    assert fcfs.scheduler_stats["prefill_pauses"] == 0
    assert fcfs.metrics[-1].ttft > 2 * ttft_short


def test_short_request_goes_first_when_nothing_runs():
    """Prefill alone: a whole batch fits one launch quantum; the short request that
    arrived meanwhile starts before the long prompt's next batch."""
    reqs = [Request(0.0, 30000, 2), Request(0.01, 300, 2)]
    res = Simulator(_config(max_model_len=32768)).run(reqs)
    assert res.extra["muxwise_short_preemptions"] == 1
    assert res.metrics[1].ttft < res.metrics[0].ttft / 2


def test_muxwise_config_checks():
    with pytest.raises(ValueError, match="tbt_slo_s"):
        SimConfig(shape=SHAPE, hardware=H100, policy="muxwise")
    with pytest.raises(ValueError, match="muxwise"):
        SimConfig(shape=SHAPE, hardware=H100, policy="layered", muxwise=MuxWiseOptions())
    with pytest.raises(ValueError):
        MuxWiseOptions(sm_steps=1)
    for bad in (dict(predictor="guess"), dict(launches="later"), dict(noise=-0.1)):
        with pytest.raises(ValueError):
            MuxWiseOptions(**bad)
    with pytest.raises(ValueError, match="memory_utilization"):
        _config(memory_utilization=1.5)
    # The TBT SLO reaches the scheduler (the adaptive layered policy reads it there).
    sim = Simulator(_config(policy="layered", layer_groups="adaptive"))
    assert sim.scheduler_config().tbt_slo_s == TBT and sim.observes_latency
    # MuxWise runs the core as its own policy class, with a layered-size budget
    mux = Simulator(_config()).scheduler_config()
    assert issubclass(mux.policy, MuxWisePolicy) and mux.name == "muxwise"
    assert mux.max_num_batched_tokens == 8192 and mux.policy_class is mux.policy


def test_bench_script_smoke(tmp_path):
    """launch/bench_muxwise_sim.py end to end on a tiny grid: JSON, markdown and CSV."""
    bench = launch_module("bench_muxwise_sim")
    bench.main(["--out", str(tmp_path), "--workloads", "qwen-sharegpt,multislo",
                "--policies", "layered,muxwise", "--requests", "24", "--bisect-steps", "0",
                "--max-extensions", "0", "--workers", "1"])  # fmt: skip
    saved = json.loads((tmp_path / "muxwise_sim.json").read_text())
    assert set(saved["results"]) == {"qwen-sharegpt", "qwen-multislo"}
    for by_policy in saved["results"].values():
        assert set(by_policy) == {"layered", "muxwise"}
        assert all(0 <= pt["attainment"] <= 1 for r in by_policy.values() for pt in r["curve"])
    md = (tmp_path / "muxwise_sim.md").read_text()
    assert "| Qwen3-30B-A3B + ShareGPT |" in md and "MuxWise at its sustainable rate" in md
    assert (tmp_path / "muxwise_sim_curves.csv").read_text().startswith("workload,policy")


def test_bench_policy_specs_and_the_tbt_sized_budget():
    """Specs with MuxWiseOptions overrides, bad specs refused, and the TBT-sized chunk:
    the largest multiple of 128 tokens the estimator predicts within 0.9 x TBT."""
    bench = launch_module("bench_muxwise_sim")
    o = bench.policy_options("muxwise-est-async:bandwidth_saturation=0.2:sm_steps=8")["muxwise"]
    assert (o.bandwidth_saturation, o.sm_steps, o.predictor, o.launches) == (
        0.2, 8, "estimator", "async")
    for bad in ("nope", "layered:noise=0.1", "muxwise:nonsense=1", "muxwise:noise"):
        with pytest.raises(ValueError):
            bench.policy_options(bad)
    wl = next(w for w in bench.panel_workloads() if w.key == "qwen-sharegpt")
    coef = [0.0] * len(FEATURES)
    coef[FEATURES.index("step")] = 0.01
    coef[FEATURES.index("mlp_t")] = 2e-5 / L  # L MLP units x T: 2e-5 s a token
    c = bench.tbt_budget(wl, LatencyModel(ModelDims(L), coef), SHAPE)
    limit = 0.9 * wl.tbt_slo
    assert c % 128 == 0 and 0.01 + 2e-5 * c <= limit < 0.01 + 2e-5 * (c + 128)

