"""Simulator support for FlowPrefill: operator-unit costs, the A800 / Llama3-8B presets,
multi-SLO workloads (classes, weights, SLO = k x solo TTFT), SLOs reaching the scheduler,
per-class attainment, and FlowPrefill against FCFS layered prefill."""

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from conftest import launch_module
from conftest import make_seq as _seq

import lp_jax.core.scheduler as scheduler_module
from lp_jax.core.metrics import RequestMetrics
from lp_jax.core.plan import PrefillChunk, StepPlan
from lp_jax.core.slo import SLO
from lp_jax.roofline import LLAMA3_8B, QWEN3_30B_A3B, ModelShape, get_hardware, resolve_model
from lp_jax.sim import (
    QWENTRACE,
    SLO_SCALES,
    Calibration,
    CostModelExecutor,
    Request,
    SimConfig,
    Simulator,
    TaskClass,
    absolute_slos,
    class_slos,
    configure_classes,
    multi_slo_requests,
    parse_assignments,
    parse_task_class,
    prior_calibration,
    solo_ttft,
    ttft_attainment,
    warm_latency,
    weight_bytes,
)
from lp_jax.sim.ttft_fit import PROFILE_TOKENS, CubicTTFT, compare

H100 = get_hardware("h100")
A800 = get_hardware("a800")
SMALL = ModelShape(
    name="small-moe", hidden_size=256, num_layers=8, num_q_heads=4, num_kv_heads=2,
    head_dim=64, vocab_size=1000, num_experts=16, top_k=2, expert_width=128,
    dense_layers=(1,), dense_width=512, sliding_layers=(0, 2, 4, 6), sliding_window=64,
)  # fmt: skip
ROOT = Path(__file__).resolve().parents[1]


def _plan(shape, chunks, span=None, decode=(), layers=None) -> StepPlan:
    L = shape.num_layers
    kw = {}
    if span is not None:
        kw = dict(unit_start=span[0], unit_end=span[1], num_groups=2 * L)
    elif layers is not None:
        kw = dict(unit_start=2 * layers[0], unit_end=2 * layers[1], num_groups=L)
    return StepPlan(0, L, decode=tuple(decode), prefill=tuple(chunks),
                    prefill_batch_id=0 if chunks else None, **kw)  # fmt: skip


# ----- operator-unit costs ------------------------------------------------------------------
@pytest.mark.parametrize("shape", [SMALL, LLAMA3_8B, QWEN3_30B_A3B], ids=lambda s: s.name)
def test_operator_segments_cost_the_whole_stack(shape):
    """Ops only (no overheads): the segments of a prefill sum to the whole-stack plan."""
    ex = CostModelExecutor(shape, H100, calibration=Calibration())  # no overheads
    seq = _seq(0, 3000)
    chunks = (PrefillChunk(seq, 1000, 3000),)  # with a cached prefix
    whole = ex.run(_plan(shape, chunks))
    L = shape.num_layers
    for cuts in ([*range(2 * L + 1)], [0, 1, 4, 7, 2 * L - 1, 2 * L]):
        parts = [ex.run(_plan(shape, chunks, (a, b))) for a, b in zip(cuts, cuts[1:], strict=False)]
        assert sum(p.seconds for p in parts) == pytest.approx(whole.seconds, rel=1e-9)
        assert sum(p.flops for p in parts) == pytest.approx(whole.flops, rel=1e-9)
        assert sum(p.expert_bytes for p in parts) == pytest.approx(whole.expert_bytes, rel=1e-9)
        assert sum(p.layers for p in parts) == L


def test_half_layer_costs_less_than_its_layer():
    ex = CostModelExecutor(LLAMA3_8B, A800, calibration=Calibration())
    chunks = (PrefillChunk(_seq(0, 4096), 0, 4096),)
    layer = ex.run(_plan(LLAMA3_8B, chunks, (4, 6))).seconds
    attn = ex.run(_plan(LLAMA3_8B, chunks, (4, 5))).seconds
    mlp = ex.run(_plan(LLAMA3_8B, chunks, (5, 6))).seconds
    assert 0 < attn < layer and 0 < mlp < layer
    assert attn + mlp == pytest.approx(layer, rel=1e-12)
    # MoE: only the MLP half loads experts.
    moe = CostModelExecutor(QWEN3_30B_A3B, A800, calibration=Calibration())
    assert moe.run(_plan(QWEN3_30B_A3B, chunks, (4, 5))).expert_bytes == 0
    assert moe.run(_plan(QWEN3_30B_A3B, chunks, (5, 6))).expert_bytes > 0


def test_layer_plans_and_unit_plans_agree():
    """A whole-layer plan costs the same given as layers or as units, decodes or not."""
    ex = CostModelExecutor(SMALL, H100, tp=2)
    chunks = (PrefillChunk(_seq(0, 900), 0, 900),)
    decodes = [_seq(10 + i, 50 + 30 * i, decoding=True) for i in range(5)]
    for dec in ((), decodes):
        for a, b in ((0, 3), (3, 8), (2, 5)):
            by_layers = ex.run(_plan(SMALL, chunks, layers=(a, b), decode=dec))
            by_units = ex.run(_plan(SMALL, chunks, (2 * a, 2 * b), decode=dec))
            assert by_layers == by_units


def test_decodes_cross_every_unit_of_a_segment_plan():
    ex = CostModelExecutor(SMALL, H100)
    chunks = (PrefillChunk(_seq(0, 600), 0, 600),)
    decodes = [_seq(10 + i, 100, decoding=True) for i in range(4)]
    alone = ex.run(_plan(SMALL, (), decode=decodes))
    for span in ((0, 1), (3, 4), (3, 6), (5, 16)):
        mixed = ex.run(_plan(SMALL, chunks, span, decode=decodes))
        assert mixed.layers == SMALL.num_layers  # decodes run every layer
        assert mixed.seconds > alone.seconds
        assert mixed.expert_bytes >= alone.expert_bytes
    # A half-layer prefill segment with no decodes counts half a layer of overhead.
    assert ex.run(_plan(SMALL, chunks, (3, 6))).layers == 1.5


def test_segment_overhead_only_for_mid_stack_continuations():
    cal = Calibration(overhead_s=2e-3)
    full = CostModelExecutor(LLAMA3_8B, A800, calibration=cal)
    cheap = CostModelExecutor(LLAMA3_8B, A800, calibration=cal, segment_overhead_s=50e-6)
    chunks = (PrefillChunk(_seq(0, 512), 0, 512),)
    dec = [_seq(9, 64, decoding=True)]
    mid = _plan(LLAMA3_8B, chunks, (4, 9))
    assert full.run(mid).seconds - cheap.run(mid).seconds == pytest.approx(2e-3 - 50e-6)
    for plan in (
        _plan(LLAMA3_8B, chunks, (0, 9)),  # embeds
        _plan(LLAMA3_8B, chunks, (9, 64)),  # samples
        _plan(LLAMA3_8B, chunks, (4, 9), decode=dec),  # decodes sample
        _plan(LLAMA3_8B, chunks),
    ):
        assert full.run(plan) == cheap.run(plan)
    with pytest.raises(ValueError):
        CostModelExecutor(LLAMA3_8B, A800, segment_overhead_s=-1.0)


# ----- presets ----------------------------------------------------------------------------------
def test_a800_and_llama3_8b_presets():
    a100 = get_hardware("a100")
    assert A800.name == "A800 SXM 80GB" and get_hardware("A800 SXM 80GB") is A800
    assert (A800.peak_flops, A800.hbm_bw, A800.hbm_bytes) == (
        a100.peak_flops, a100.hbm_bw, a100.hbm_bytes)  # fmt: skip
    assert A800.interconnect_bw == 400e9 < a100.interconnect_bw
    assert resolve_model("Llama3-8B") is LLAMA3_8B and not LLAMA3_8B.is_moe
    assert weight_bytes(LLAMA3_8B) / 2 == pytest.approx(8.03e9, rel=0.01)  # 8.03B parameters
    assert LLAMA3_8B.dense_layers_count == 32


# ----- multi-SLO workload -----------------------------------------------------------------------
def test_classes_weights_and_lengths():
    slos = {c.name: SLO(1.0, None, c.name) for c in QWENTRACE}
    reqs = multi_slo_requests(QWENTRACE, slos, 6000, 5.0, seed=1)
    total = sum(c.weight for c in QWENTRACE)
    for c in QWENTRACE:
        mine = [r for r in reqs if r.task == c.name]
        assert len(mine) / len(reqs) == pytest.approx(c.weight / total, abs=0.03)
        mean = np.mean([r.prompt_len for r in mine])
        assert mean == pytest.approx(c.prompt_mean, rel=0.06)
        assert np.median([r.prompt_len for r in mine]) == pytest.approx(c.prompt_median, rel=0.06)
        assert all(r.slo is slos[c.name] and r.output_len == 1 for r in mine)  # prefill-only
    means = {c.name: c.prompt_mean for c in QWENTRACE}
    assert (means["chat"], means["web_search"], means["summarisation"]) == (590, 5976, 6833)
    # The `assumed` note follows the data: a class whose prompt mean is not one of the
    # paper's (papers.md section 2) names its mean as assumed, with the value it has.
    paper = {"chat": 590, "web_search": 5976, "summarisation": 6833}
    for c in QWENTRACE:
        from_paper = paper.get(c.name) == c.prompt_mean
        assert from_paper == (f"prompt mean {c.prompt_mean:g}" not in c.assumed), c.name


def test_requests_are_common_across_rates_and_colocated_outputs():
    slos = {c.name: SLO(1.0, None, c.name) for c in QWENTRACE}
    a = multi_slo_requests(QWENTRACE, slos, 300, 2.0, seed=3)
    b = multi_slo_requests(QWENTRACE, slos, 300, 4.0, seed=3)
    assert [(r.prompt_len, r.task) for r in a] == [(r.prompt_len, r.task) for r in b]
    assert b[-1].arrival == pytest.approx(a[-1].arrival / 2)
    co = multi_slo_requests(QWENTRACE, slos, 300, 2.0, seed=3, colocated=True)
    assert [r.prompt_len for r in co] == [r.prompt_len for r in a]
    assert np.mean([r.output_len for r in co]) > 50
    with pytest.raises(ValueError, match="no SLO"):
        multi_slo_requests(QWENTRACE, {"chat": SLO(1.0)}, 10, 1.0)


def test_slo_is_k_times_solo_ttft_and_scales():
    base = SimConfig(shape=LLAMA3_8B, hardware=A800, policy="orca")
    solo = {c.name: solo_ttft(base, c.prompt_median) for c in QWENTRACE}
    slos = class_slos(QWENTRACE, lambda n: solo_ttft(base, n))
    for c in QWENTRACE:
        assert slos[c.name].ttft_s == pytest.approx(c.slo_k * solo[c.name])
        assert slos[c.name].name == c.name and slos[c.name].tbt_s is None
    assert solo["chat"] < solo["image_understanding"] < solo["web_search"] < solo["summarisation"]
    half = class_slos(QWENTRACE, lambda n: solo_ttft(base, n), scale=0.5)
    assert half["chat"].ttft_s == pytest.approx(0.5 * slos["chat"].ttft_s)
    assert solo_ttft(replace(base, hardware=H100), 590) < solo_ttft(base, 590)  # H100 faster
    with pytest.raises(ValueError):
        class_slos(QWENTRACE, lambda n: 1.0, scale=0.0)


def test_reference_absolute_slos_and_scales():
    """The released FlowPrefill benchmark's SLO set (text, image, search, file) under the
    QwenTrace-like class names, scaled together; its sweep 0.4 ... 2.0 in steps of 0.2."""
    slos = absolute_slos(QWENTRACE)
    got = {k: (v.ttft_s, v.tbt_s) for k, v in slos.items()}
    assert got == {"chat": (0.25, 0.1), "web_search": (4.0, 0.2), "summarisation": (6.0, 0.2),
                   "image_understanding": (0.5, 0.1)}
    half = absolute_slos(QWENTRACE, 0.5)
    assert half["web_search"].ttft_s == 2.0 and half["chat"].tbt_s == pytest.approx(0.05)
    assert SLO_SCALES == (0.4, 0.6, 0.8, 1.0, 1.2, 1.4, 1.6, 1.8, 2.0)
    with pytest.raises(ValueError, match="no absolute SLO"):
        absolute_slos((TaskClass("code", 900.0, 1.0, 3.0),))


def test_class_configuration_from_cli_strings():
    assert parse_assignments("chat=2, web_search=6.5") == {"chat": 2.0, "web_search": 6.5}
    assert parse_assignments(None) == {}
    with pytest.raises(ValueError):
        parse_assignments("chat")
    code = parse_task_class("code:3000:0.1:2.5")
    assert (code.name, code.prompt_mean, code.weight, code.slo_k) == ("code", 3000, 0.1, 2.5)
    assert parse_task_class("x:100:1:2:0.2").prompt_sigma == 0.2
    classes = configure_classes(
        QWENTRACE, only=["summarisation", "chat", "code"], slo_k={"chat": 1.5},
        weights={"summarisation": 0.5}, extra=[code],
    )  # fmt: skip
    assert [c.name for c in classes] == ["summarisation", "chat", "code"]
    assert classes[1].slo_k == 1.5 and classes[0].weight == 0.5 and classes[2] is code
    with pytest.raises(ValueError, match="unknown class"):
        configure_classes(QWENTRACE, slo_k={"nope": 1.0})
    with pytest.raises(ValueError):
        TaskClass("bad", -1.0, 1.0, 1.0)


# ----- SLOs in the simulator --------------------------------------------------------------------
def test_slos_reach_the_scheduler_and_config_options(monkeypatch):
    seen = {}
    real_add = scheduler_module.Scheduler.add

    def spy(self, seq):
        seen[seq.seq_id] = (seq.slo, seq.deadline)
        cfg = self.config
        seen["cfg"] = (cfg.preemption_granularity, cfg.slo_alpha, cfg.max_paused_prefills)
        return real_add(self, seq)

    monkeypatch.setattr(scheduler_module.Scheduler, "add", spy)
    chat, summ = SLO(0.2, None, "chat"), SLO(3.0, None, "summarisation")
    reqs = [Request(0.0, 4000, 1, summ), Request(0.01, 300, 1, chat), Request(0.02, 100, 1)]
    cfg = SimConfig(
        shape=LLAMA3_8B,
        hardware=A800,
        policy="flowprefill",
        preemption_granularity="layer",
        slo_alpha=0.2,
        max_paused_prefills=3,
    )
    result = Simulator(cfg).run(reqs)
    assert seen[0] == (summ, pytest.approx(3.0)) and seen[1] == (chat, pytest.approx(0.21))
    assert seen[2] == (None, math.inf)
    assert seen["cfg"] == ("layer", 0.2, 3)
    assert result.scheduler_stats["scheduling_rounds"] > 0
    assert result.latency is not None and result.latency.num_observed == result.iterations


def test_per_class_ttft_attainment():
    chat, summ = SLO(0.1, None, "chat"), SLO(1.0, None, "summarisation")
    reqs = [Request(0.0, 10, 1, chat), Request(0.0, 10, 1, chat), Request(0.0, 10, 1, summ),
            Request(0.0, 10, 1, SLO(0.5, None, "x"), "mine"), Request(0.0, 10, 1)]  # fmt: skip
    ttfts = [0.05, 0.2, 0.9, 0.6, 5.0]
    metrics = [RequestMetrics(0.0, t, (t,)) for t in ttfts]
    att = ttft_attainment(reqs, metrics)
    assert att == {"chat": 0.5, "summarisation": 1.0, "mine": 0.0, "all": 0.5}
    metrics[1] = RequestMetrics(0.0)  # no token: fails
    assert ttft_attainment(reqs, metrics)["chat"] == 0.5


def test_warm_latency_model_predicts_simulated_steps():
    cfg = SimConfig(shape=LLAMA3_8B, hardware=A800, policy="flowprefill",
                    segment_overhead_s=50e-6)  # fmt: skip
    model = warm_latency(cfg)
    assert model.num_observed > 100
    assert model.error()["recent_abs_rel_error"] < 0.2
    # A frozen copy drives the run; the given model is not changed by it.
    before = model.num_observed
    Simulator(replace(cfg, latency=model)).run([Request(0.0, 800, 1, SLO(1.0))])
    assert model.num_observed == before


# ----- FlowPrefill against FCFS -----------------------------------------------------------------
def _mixed_setup():
    base = SimConfig(shape=LLAMA3_8B, hardware=H100, policy="orca", segment_overhead_s=50e-6,
                     observe_latency=False)  # fmt: skip
    slos = class_slos(QWENTRACE, lambda n: solo_ttft(base, n))
    return base, slos


def test_flowprefill_beats_fcfs_layered_on_the_tight_class():
    base, slos = _mixed_setup()
    reqs = multi_slo_requests(QWENTRACE, slos, 150, 7.0, seed=0)
    fcfs = Simulator(replace(base, policy="layered")).run(reqs)
    fp_cfg = replace(base, policy="flowprefill")
    fp = Simulator(replace(fp_cfg, latency=warm_latency(fp_cfg))).run(reqs)
    a_fcfs, a_fp = fcfs.ttft_attainment(), fp.ttft_attainment()
    assert a_fp["chat"] > a_fcfs["chat"]
    assert a_fp["all"] > a_fcfs["all"]
    assert fp.scheduler_stats["prefill_pauses"] > 0 == fcfs.scheduler_stats["prefill_pauses"]
    chat_ttft = {
        name: np.mean([m.ttft for r, m in zip(reqs, res.metrics, strict=True)
                       if r.task == "chat"])
        for name, res in (("fcfs", fcfs), ("fp", fp))
    }  # fmt: skip
    assert chat_ttft["fp"] < chat_ttft["fcfs"]


def test_finer_preemption_blocks_the_short_request_less():
    base, slos = _mixed_setup()
    long_req = Request(0.0, 8192, 1, SLO(20.0, None, "long"))
    short = Request(0.0, 500, 1, slos["chat"])
    at_N = solo_ttft(base, 8192) * np.random.default_rng(0).uniform(0.05, 0.95, 10)
    wait = {}
    for name, opts in {
        "layered_fcfs": {"policy": "layered"},
        "group": {"policy": "flowprefill", "preemption_granularity": "group"},
        "layer": {"policy": "flowprefill", "preemption_granularity": "layer"},
        "operator": {"policy": "flowprefill", "preemption_granularity": "operator"},
    }.items():
        cfg = replace(base, **opts)
        if opts["policy"] == "flowprefill":
            cfg = replace(cfg, latency=warm_latency(cfg))
        sim = Simulator(cfg)
        alone = sim.run([short]).metrics[0].ttft
        both = [sim.run([long_req, replace(short, arrival=at)]).metrics[1].ttft for at in at_N]
        wait[name] = np.mean(both) - alone  # mean over arrival times inside the long prefill
    assert wait["operator"] < wait["layer"] < wait["group"] < wait["layered_fcfs"]


# ----- FlowPrefill's cubic TTFT predictor against the LatencyModel ----------------------------
def test_cubic_ttft_fit_recovers_a_cubic_and_is_blind_to_cached_context():
    n = np.array(PROFILE_TOKENS, dtype=float)
    truth = (2e-3, 3e-5, 4e-10, 5e-15)
    y = sum(c * n**k for k, c in enumerate(truth))
    for relative in (True, False):
        fit = CubicTTFT.fit(n, y, relative=relative)
        assert [fit.predict(t) for t in (100.0, 5000.0, 20000.0)] == pytest.approx(
            [sum(c * t**k for k, c in enumerate(truth)) for t in (100.0, 5000.0, 20000.0)],
            rel=1e-6)
    with pytest.raises(ValueError):
        CubicTTFT.fit([1, 2, 3], [1, 2, 3])
    # One simulated profile with batches and cached prefixes: the LatencyModel's T x P
    # feature predicts a prompt after a cached prefix; a cubic in new tokens cannot.
    ex = CostModelExecutor(LLAMA3_8B, A800, calibration=prior_calibration(A800.name))
    r = compare(ex, profile_kind="mixed")
    assert r["profile_points"] == 3 * len(PROFILE_TOKENS)
    assert r["cached"]["latency_model"]["mean"] < 0.05 < r["cached"]["cubic"]["mean"]
    with pytest.raises(ValueError):
        compare(ex, profile_kind="table")


# ----- the benchmark script ---------------------------------------------------------------------
def test_bench_script_quick(tmp_path):
    bench = launch_module("bench_flowprefill_sim")
    report = bench.main([
        "--out", str(tmp_path), "--hardware", "h100", "--models", "llama3-8b",
        "--policies", "layered_fcfs,flowprefill_layer", "--requests", "40",
        "--rate-fractions", "0.2,0.6", "--bisect-steps", "0", "--slo-scales", "0.5,2",
        "--blocking-long", "4096", "--blocking-points", "2", "--slo-k", "chat=4",
    ])  # fmt: skip
    saved = json.loads((tmp_path / "flowprefill_sim.json").read_text())
    (combo,) = saved["results"]
    assert combo["model"] == "Llama3-8B" and set(combo["policies"]) == {
        "layered_fcfs", "flowprefill_layer"}  # fmt: skip
    assert [c["slo_k"] for c in combo["classes"] if c["name"] == "chat"] == [4.0]
    for p in combo["policies"].values():
        assert set(p) >= {"goodput", "sweep", "blocking", "tightest_scale"}
    md = (tmp_path / "flowprefill_sim.md").read_text()
    assert "| FlowPrefill / layer |" in md and "Blocking" in md
    assert report["results"][0]["capacity_rps"] > 0


def test_bench_script_rules_side_by_side_on_absolute_slos(tmp_path):
    bench = launch_module("bench_flowprefill_sim")
    keys = [s.key for s in bench.with_rules(list(bench.POLICY_SPECS[3:6]), ["reference", "lp_jax"])]
    assert keys == ["layered_fcfs", "layered_preemptible", "layered_preemptible_lp_jax",
                    "flowprefill_operator", "flowprefill_operator_lp_jax"]
    bench.main([
        "--out", str(tmp_path), "--hardware", "h100", "--models", "llama3-8b",
        "--policies", "flowprefill_layer", "--rules", "reference,lp_jax", "--requests", "30",
        "--parts", "sweep", "--slo-scales", "1,2", "--slo-set", "reference",
    ])  # fmt: skip
    (combo,) = json.loads((tmp_path / "flowprefill_sim.json").read_text())["results"]
    assert set(combo["policies"]) == {"flowprefill_layer", "flowprefill_layer_lp_jax"}
    assert {c["name"]: c["ttft_slo_ms"] for c in combo["classes"]}["chat"] == 250.0
    assert "FlowPrefill / layer, lp_jax rules" in (tmp_path / "flowprefill_sim.md").read_text()


def test_flowprefill_does_not_deadlock_on_a_loose_partial_prefill():
    cfg = SimConfig(
        shape=LLAMA3_8B,
        hardware=H100,
        policy="flowprefill",
        preemption_granularity="layer",
        page_size=16,
        num_pages=12000 // 16,
    )
    reqs = [
        Request(0.0, 10000, 1, SLO(100.0, None, "long")),  # batch [0, 8192), then loose
        Request(0.05, 5000, 1, SLO(5.0, None, "chat")),  # ranks first, no pages for it
    ]
    # A long prompt's first batch ends while a better-ranked request waits for pages: the
    # admitted, partly prefilled prompt must go on (it used to leave nothing runnable).
    result = Simulator(cfg).run(reqs)
    assert all(m.ttft is not None for m in result.metrics)
