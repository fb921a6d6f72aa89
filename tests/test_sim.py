"""Simulator tests: determinism, the real scheduler under every policy, workloads, grain
trace loading, cost-model sanity, calibration and energy fits, and the rate search."""

import json
import math

import numpy as np
import pytest

import lp_jax.core.scheduler as scheduler_module
from lp_jax.core.metrics import RequestMetrics
from lp_jax.core.plan import PrefillChunk, StepPlan
from lp_jax.core.sequence import Sequence
from lp_jax.roofline import GPT_OSS_20B, QWEN3_30B_A3B, ModelShape, get_hardware
from lp_jax.sim import (
    ARXIV_PAPER,
    SHAREGPT_8K,
    Calibration,
    CostModelExecutor,
    EnergyModel,
    Request,
    SimConfig,
    Simulator,
    StepFeatures,
    arrival_times,
    attainment,
    derive_num_pages,
    load_trace,
    sustainable_rate,
    synthesize,
    trace_requests,
)
from lp_jax.sim import simulator as simulator_module
from lp_jax.sim.workload import ARXIV_4K_CSV, AZURE_CONV_CSV

H100 = get_hardware("h100")
SMALL = ModelShape(
    name="small-moe", hidden_size=256, num_layers=8, num_q_heads=4, num_kv_heads=2,
    head_dim=64, vocab_size=1000, num_experts=16, top_k=2, expert_width=128,
    sliding_layers=(0, 2, 4, 6), sliding_window=64,
)  # fmt: skip


def small_config(policy, **kw):
    base = dict(
        shape=SMALL,
        hardware=H100,
        policy=policy,
        max_num_seqs=16,
        max_model_len=4096,
        num_pages=2048,
    )
    base.update(kw)
    return SimConfig(**base)


def small_requests(n=24, rate=50.0, seed=0):
    reqs = synthesize(SHAREGPT_8K, n, rate, seed=seed)
    return [Request(r.arrival, min(r.prompt_len, 1500), min(r.output_len, 40)) for r in reqs]


# ----- determinism and the real scheduler ----------------------------------------------------
def test_same_seed_same_metrics():
    a = Simulator(small_config("layered")).run(small_requests(seed=3))
    b = Simulator(small_config("layered")).run(small_requests(seed=3))
    assert a.metrics == b.metrics
    assert (a.iterations, a.expert_bytes, a.energy_j) == (b.iterations, b.expert_bytes, b.energy_j)
    c = Simulator(small_config("layered")).run(small_requests(seed=4))
    assert c.metrics != a.metrics


@pytest.mark.parametrize("policy", ["orca", "chunked", "layered"])
def test_every_policy_runs_the_real_scheduler(policy, monkeypatch):
    assert simulator_module.Scheduler is scheduler_module.Scheduler
    plans = []
    real_schedule = scheduler_module.Scheduler.schedule

    def spy(self, now):
        plan = real_schedule(self, now)
        plans.append(plan)
        return plan

    monkeypatch.setattr(scheduler_module.Scheduler, "schedule", spy)
    reqs = small_requests()
    budget = {"orca": None, "chunked": 256, "layered": 2048}[policy]
    res = Simulator(small_config(policy, max_num_batched_tokens=budget)).run(reqs)
    assert len(plans) == res.iterations
    assert res.scheduler_stats["finished"] == len(reqs)
    for r, m in zip(reqs, res.metrics, strict=True):
        assert m.num_tokens == r.output_len
        assert m.ttft > 0
    groups = {p.num_groups for p in plans if p.prefill}
    assert (max(groups) > 1) == (policy == "layered")
    assert res.expert_bytes > 0 and res.flops > 0 and res.energy_j > 0


def test_idle_gaps_jump_to_next_arrival():
    reqs = [Request(0.0, 100, 3), Request(1000.0, 100, 3)]
    res = Simulator(small_config("chunked")).run(reqs)
    assert res.metrics[1].token_times[0] > 1000.0
    assert res.busy_s < 1.0 < res.span_s


# ----- workloads --------------------------------------------------------------------------
def test_sharegpt_lengths_match_the_quantile_table():
    p, o = SHAREGPT_8K.sample(40_000, np.random.default_rng(0))
    assert abs(np.median(p) / 1730 - 1) < 0.03
    assert abs(np.percentile(p, 90) / 5696 - 1) < 0.03
    assert abs(np.median(o) / 415 - 1) < 0.03
    assert abs(p.mean() / 2340 - 1) < 0.03 and abs(o.mean() / 439 - 1) < 0.03
    assert p.min() >= 1 and p.max() <= 8141 and o.max() <= 1024


def test_arxiv_paper_lengths_are_whole_articles():
    p, o = ARXIV_PAPER.sample(20_000, np.random.default_rng(1))
    assert 6000 < np.median(p) < 8000 and 150 < np.median(o) < 250
    assert 25 < p.mean() / o.mean() < 45


@pytest.mark.parametrize("cv", [0.5, 1.0, 2.0])
def test_gamma_arrivals_rate_and_cv(cv):
    t = arrival_times(40_000, 4.0, np.random.default_rng(2), cv)
    gaps = np.diff(t)
    assert abs(gaps.mean() * 4.0 - 1) < 0.03
    assert abs(gaps.std() / gaps.mean() / cv - 1) < 0.06


def test_synthesize_is_seeded_and_rates_compress_time():
    a, b = synthesize("sharegpt", 50, 2.0, seed=7), synthesize("sharegpt", 50, 2.0, seed=7)
    assert a == b
    c = synthesize("sharegpt", 50, 4.0, seed=7)
    assert [r.prompt_len for r in c] == [r.prompt_len for r in a]
    assert c[-1].arrival == pytest.approx(a[-1].arrival / 2)


def test_trace_round_trip_csv_and_jsonl(tmp_path):
    rows = [(0.5, 10, 3), (1.25, 200, 7), (4.0, 31, 1)]
    csv_path = tmp_path / "t.csv"
    csv_path.write_text(
        "timestamp,prompt_len,output_len\n" + "".join(f"{t},{p},{o}\n" for t, p, o in rows)
    )
    jsonl_path = tmp_path / "t.jsonl"
    jsonl_path.write_text(
        "".join(
            json.dumps({"arrived_at": t, "num_prefill_tokens": p, "num_decode_tokens": o}) + "\n"
            for t, p, o in rows
        )
    )
    for path in (csv_path, jsonl_path):
        got = load_trace(path)
        assert [(r.timestamp, r.prompt_len, r.output_len) for r in got] == rows
        reqs = trace_requests(path)
        assert [r.arrival for r in reqs] == [0.0, 0.75, 3.5]
        scaled = trace_requests(path, rate=2.0)  # 2 gaps over 1 s
        assert scaled[-1].arrival == pytest.approx(1.0)
    no_time = tmp_path / "lengths.csv"
    no_time.write_text("num_prefill_tokens,num_decode_tokens\n5,6\n7,8\n")
    assert load_trace(no_time)[0].timestamp is None
    with pytest.raises(ValueError, match="rate"):
        trace_requests(no_time)
    assert len(trace_requests(no_time, rate=1.0)) == 2


def test_bundled_traces():
    azure = load_trace(AZURE_CONV_CSV)
    assert len(azure) == 19_366
    assert np.median([r.prompt_len for r in azure]) == 1020
    assert np.median([r.output_len for r in azure]) == 129
    arxiv = load_trace(ARXIV_4K_CSV)
    assert len(arxiv) == 28_257 and max(r.prompt_len + r.output_len for r in arxiv) <= 4096


# ----- cost model -------------------------------------------------------------------------
def one_prompt(policy, tokens=8192):
    cfg = SimConfig(shape=QWEN3_30B_A3B, hardware=H100, policy=policy, tp=2)
    return Simulator(cfg).run([Request(0.0, tokens, 1)])


def test_layered_loads_experts_once_per_prompt():
    chunked, layered = one_prompt("chunked"), one_prompt("layered")
    assert chunked.iterations == layered.iterations == 16
    ratio = chunked.expert_bytes / layered.expert_bytes
    assert 14.0 < ratio <= 16.0
    # Once per layer: 48 layers x (nearly) all 128 experts x one expert's bytes.
    full = QWEN3_30B_A3B.num_layers * QWEN3_30B_A3B.num_experts * QWEN3_30B_A3B.expert_bytes
    assert layered.expert_bytes == pytest.approx(full, rel=0.01)


def test_step_time_grows_with_context_and_decodes():
    ex = CostModelExecutor(QWEN3_30B_A3B, H100, tp=2)
    L = QWEN3_30B_A3B.num_layers

    def decode_plan(batch, context):
        seqs = tuple(Sequence(i, [1] * context) for i in range(batch))
        return StepPlan(0, L, decode=seqs)

    t = [ex.run(decode_plan(b, c)).seconds for b, c in ((8, 512), (8, 4096), (32, 4096))]
    assert t[0] < t[1] < t[2]
    long = Sequence(99, [1] * 8192)
    group = StepPlan(
        0,
        L,
        prefill=(PrefillChunk(long, 0, 8192),),
        prefill_batch_id=0,
        unit_start=0,
        unit_end=6,
        num_groups=16,
    )
    cost = ex.run(group)
    assert cost.layers == 3 and cost.seconds > 0


def test_kv_pages_from_hbm():
    pages = derive_num_pages(SimConfig(shape=QWEN3_30B_A3B, hardware=H100, tp=2))
    # ~38 GB per GPU left for KV at 49 KB per token per GPU -> ~770k tokens
    assert 600_000 < pages * 16 < 900_000
    with pytest.raises(ValueError, match="does not fit"):
        derive_num_pages(SimConfig(shape=GPT_OSS_20B, hardware=get_hardware("v5e"), tp=1))


def test_sim_presets_read_the_engine_config():
    """The simulator's GPT-OSS-20B and Qwen3-30B-A3B are the engine's ModelConfig: its MoE
    and sliding layers, and its window."""
    from lp_jax.config import ModelConfig
    from lp_jax.roofline.model_shape import CONFIG_DIR

    for shape, config in ((GPT_OSS_20B, "gpt-oss-20b.json"),
                          (QWEN3_30B_A3B, "Qwen3-30B-A3B.json")):
        cfg = ModelConfig.from_pretrained_file(CONFIG_DIR / config)
        assert shape == ModelShape.from_model_config(cfg, shape.name)
        ex = CostModelExecutor(shape, H100)
        kinds = [ex._kinds[k] for k in ex._kind_of]
        assert kinds == [(cfg.is_moe_layer(i), cfg.layer_window(i) is not None)
                         for i in range(cfg.num_hidden_layers)]
        assert ex._window == cfg.sliding_window


# ----- calibration and energy fits ----------------------------------------------------------
def test_calibration_fit_recovers_known_factors():
    rng = np.random.default_rng(0)
    truth = Calibration(0.55, 0.8, 1.5e-3, 3e-5)
    samples = []
    for _ in range(60):
        ops = int(rng.integers(3, 9))
        c = tuple(rng.uniform(0, 4e-3, ops) * rng.choice([0.05, 1.0], ops))
        m = tuple(rng.uniform(0, 4e-3, ops) * rng.choice([0.05, 1.0], ops))
        f = StepFeatures(c, m, int(rng.integers(1, 49)))
        samples.append((f, truth.step_seconds(f)))
    fit = Calibration.fit(samples)
    assert fit.compute_efficiency == pytest.approx(0.55, rel=1e-3)
    assert fit.bandwidth_efficiency == pytest.approx(0.8, rel=1e-3)
    assert fit.overhead_s == pytest.approx(1.5e-3, rel=1e-2)
    assert fit.layer_overhead_s == pytest.approx(3e-5, rel=1e-2)


def test_calibration_fit_on_executor_features():
    ex = CostModelExecutor(QWEN3_30B_A3B, H100, tp=2)
    L = QWEN3_30B_A3B.num_layers
    truth = Calibration(0.4, 0.6, 2e-3, 0.0)
    samples = []
    for b in (1, 4, 16, 64):
        for n in (0, 256, 2048, 8192):
            seqs = tuple(Sequence(i, [1] * 1024) for i in range(b))
            pre = (PrefillChunk(Sequence(999, [1] * n), 0, n),) if n else ()
            plan = StepPlan(0, L, decode=seqs, prefill=pre, prefill_batch_id=0 if n else None)
            f = ex.features(plan)
            samples.append((f, truth.step_seconds(f)))
    fit = Calibration.fit(samples)
    assert fit.compute_efficiency == pytest.approx(0.4, rel=1e-2)
    assert fit.bandwidth_efficiency == pytest.approx(0.6, rel=1e-2)
    assert ex.with_calibration(fit).run(plan).seconds == pytest.approx(samples[-1][1], rel=1e-3)


def test_energy_fit_recovers_constants():
    truth = EnergyModel(90.0, 0.7e-12, 60e-12)
    rng = np.random.default_rng(1)
    samples = []
    for _ in range(20):
        s, f, b = rng.uniform(0.01, 1), rng.uniform(0, 1e14), rng.uniform(0, 3e12)
        samples.append((s, f, b, truth.joules(s, f, b)))
    fit = EnergyModel.fit(samples)
    assert fit.static_w == pytest.approx(90.0, rel=1e-6)
    assert fit.j_per_flop == pytest.approx(0.7e-12, rel=1e-6)
    assert fit.j_per_byte == pytest.approx(60e-12, rel=1e-6)


# ----- SLOs ---------------------------------------------------------------------------------
def toy(rate):
    return float(np.clip(1.0 - (rate - 3.0) / 2.0, 0.0, 1.0))  # 90% at 3.2 req/s


def test_sustainable_rate_bisects_a_monotone_curve():
    found = sustainable_rate(toy, [1, 2, 3, 4, 5], bisect_steps=8)
    assert found.rate == pytest.approx(3.2, abs=0.01) and not found.lower_bound_only
    assert toy(found.rate) >= 0.9
    rates, att = found.curve()
    assert rates == sorted(rates) and len(att) == len(rates)
    assert 5 not in found.points  # stops at the first failing grid rate
    assert 5 in sustainable_rate(toy, [1, 2, 3, 4, 5], full_curve=True).points


def test_sustainable_rate_edges():
    everything = sustainable_rate(lambda r: 1.0, [1, 2], max_extensions=2)
    assert everything.lower_bound_only and everything.rate == pytest.approx(2 * 1.5**2)
    low = sustainable_rate(toy, [4, 5], bisect_steps=10)
    assert low.rate == pytest.approx(3.2, abs=0.01)
    assert sustainable_rate(lambda r: 0.0, [1.0], bisect_steps=3).rate == 0.0


def test_attainment_uses_slo_pass():
    ok = RequestMetrics(0.0, token_times=(1.0, 1.05, 1.1))
    slow_first = RequestMetrics(0.0, token_times=(6.0, 6.05))
    stall = RequestMetrics(0.0, token_times=(1.0, 1.5))
    assert attainment([ok, slow_first, stall], 5.0, 0.1) == pytest.approx(1 / 3)
    assert math.isnan(attainment([], 5.0, 0.1))
