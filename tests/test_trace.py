"""The decision trace (lp_jax/trace), its timeline plot, and the engine's virtual clock
(lp_jax/core/clock.py): engine runs use the fake executor (tests/fake_executor.py), so
nothing compiles; the simulator writes the same format."""

import random
import time

import pytest
from fake_executor import FakeExecutor

from checkpoints.make_tiny import ensure_tiny
from lp_jax import LLM, SamplingParams
from lp_jax.core.slo import SLO
from lp_jax.roofline import LLAMA3_8B, get_hardware
from lp_jax.sim import Request, SimConfig, Simulator
from lp_jax.trace import load
from lp_jax.trace.__main__ import main as trace_main
from lp_jax.trace.timeline import plot_timeline, summary

PLAN_KEYS = {"event", "t", "step", "phase", "decode", "prefill", "batch_id", "unit_start",
             "unit_end", "group_index", "num_groups", "start", "end", "predicted_s",
             "measured_s"}
PARAMS = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


def fake_engine(tmp_path, name="trace.jsonl", **kw):
    args = dict(model=str(ensure_tiny(preset="tiny")), max_num_seqs=4, max_model_len=256,
                log=None, executor=FakeExecutor, scheduling="layered", layer_groups=2,
                max_num_batched_tokens=64, trace_path=str(tmp_path / name)) | kw
    return LLM(**args).engine


def drive(eng, adds, sleep=None):
    """adds: {step index: [(prompt, slo)]}; steps until all finish. Returns
    {request id: RequestMetrics}."""
    ids, metrics, i = [], {}, 0
    adds = dict(adds)
    while adds or eng.has_unfinished():
        for prompt, slo in adds.pop(i, []):
            ids.append(eng.add_request(prompt, PARAMS, slo=slo))
        for out in eng.step():
            if out.finished:
                metrics[out.request_id] = out.metrics
        if sleep:
            sleep()
        i += 1
        assert i < 2000, "no progress"
    assert sorted(metrics) == sorted(ids)
    return metrics


def prompt(n, base=0):
    return [(base + 7 * j) % 500 for j in range(n)]


def test_engine_trace_has_one_line_per_plan_and_every_request(tmp_path):
    eng = fake_engine(tmp_path, max_num_batched_tokens=128)
    drive(eng, {0: [(prompt(100), None), (prompt(20, 3), None)], 3: [(prompt(40, 5), None)]})
    eng.shutdown()
    lines = load(tmp_path / "trace.jsonl")
    assert lines[0]["event"] == "header" and lines[0]["source"] == "engine"
    assert lines[0]["num_layers"] == eng.scheduler.config.num_layers
    plans = [d for d in lines if d["event"] == "plan"]
    assert sorted(d["step"] for d in plans) == [p.step_id for p in eng.runner.plans]
    for d in plans:
        assert set(d) == PLAN_KEYS
        assert d["t"] <= d["start"] <= d["end"] and d["predicted_s"] is not None
    # The layered batch of two prompts crosses the stack in two groups, same batch id.
    first = [d for d in plans if d["prefill"]][:2]
    assert [d["group_index"] for d in first] == [0, 1]
    assert first[0]["batch_id"] == first[1]["batch_id"]
    assert [c["seq"] for c in first[0]["prefill"]] == [0, 1]
    assert first[0]["unit_end"] == first[1]["unit_start"]
    for ev in ("arrival", "finish"):
        assert sorted(d["seq"] for d in lines if d["event"] == ev) == [0, 1, 2]
    assert {d["reason"] for d in lines if d["event"] == "finish"} == {"length"}
    units = 2 * lines[0]["num_layers"]
    decoded = sum(len(d["decode"]) for d in plans) + sum(
        c["samples"] for d in plans for c in d["prefill"] if d["unit_end"] == units)
    assert decoded == 3 * PARAMS.max_tokens  # every token came from one traced plan


def test_an_abort_is_a_finish(tmp_path):
    eng = fake_engine(tmp_path)
    rid = eng.add_request(prompt(30), PARAMS)
    eng.step()
    assert eng.abort(rid)
    while eng.has_unfinished():
        eng.step()
    fin = [d for d in load(tmp_path / "trace.jsonl") if d["event"] == "finish"]
    assert [(d["seq"], d["reason"]) for d in fin] == [(rid, "abort")]


def flowprefill_run(tmp_path, name="fp.jsonl", **kw):
    """A long prompt with a loose SLO, then an urgent short one: it preempts the long
    prefill at an operator boundary, which resumes in place."""
    eng = fake_engine(tmp_path, name, scheduling="flowprefill", layer_groups="paper",
                      preemption_granularity="operator", max_num_batched_tokens=128,
                      virtual_clock=True, **kw)
    drive(eng, {0: [(prompt(120), SLO(ttft_s=1e3))], 2: [(prompt(9, 1), SLO(ttft_s=1.0))]})
    eng.shutdown()
    return eng, load(tmp_path / name)


def test_flowprefill_pauses_and_resumes_are_traced(tmp_path):
    eng, lines = flowprefill_run(tmp_path)
    stats = eng.scheduler.stats()
    pauses = [d for d in lines if d["event"] == "pause"]
    resumes = [d for d in lines if d["event"] == "resume"]
    assert len(pauses) == stats["prefill_pauses"] >= 1
    assert len(resumes) == stats["prefill_resumes"] >= 1
    assert pauses[0]["seqs"] == [0] and resumes[0]["seqs"] == [0]
    plans = sorted((d for d in lines if d["event"] == "plan"), key=lambda d: d["step"])
    long_ = [d for d in plans if d["prefill"] and d["prefill"][0]["seq"] == 0]
    # Operator segments: one unit each, contiguous across the pause, one batch id.
    assert all(d["unit_end"] - d["unit_start"] == 1 for d in long_)
    assert [d["unit_start"] for d in long_] == list(range(len(long_)))
    assert len({d["batch_id"] for d in long_}) == 1
    urgent = [d for d in plans if d["prefill"] and d["prefill"][0]["seq"] == 1]
    assert pauses[0]["t"] <= urgent[0]["t"] and urgent[-1]["step"] < long_[-1]["step"]
    assert lines[0]["clock"] == "virtual"


def test_virtual_clock_makes_runs_identical_despite_a_noisy_host(tmp_path):
    """Two runs with random host delays between steps: the same trace (bar the measured
    wall times) and the same token times. On the wall clock they differ."""
    def run(name, virtual, seed):
        rng = random.Random(seed)
        eng = fake_engine(tmp_path, name, virtual_clock=virtual)
        adds = {0: [(prompt(100), None)], 2: [(prompt(30, 1), None)],
                5: [(prompt(60, 2), {"ttft_slo_ms": 50})]}
        m = drive(eng, adds, sleep=lambda: time.sleep(rng.uniform(0, 0.002)))
        eng.shutdown()
        lines = [{k: v for k, v in d.items() if k != "measured_s"}
                 for d in load(tmp_path / name)]
        return lines, {r: (x.arrival_time, x.token_times) for r, x in m.items()}, eng

    a, ma, eng = run("a.jsonl", True, 0)
    b, mb, _ = run("b.jsonl", True, 1)
    assert a == b and ma == mb
    assert ma[0][0] == 0.0 and ma[0][1][0] > 0  # virtual time starts at 0 and moves
    # Token times are the ends of the plans that sampled them, predicted by the model.
    ends = {d["end"] for d in a if d["event"] == "plan"}
    assert all(t in ends for _, times in ma.values() for t in times)
    assert eng.scheduler.latency.num_observed == 0  # wall times never reach the model
    assert eng.stats()["slo_attainment"]
    w1, mw1, _ = run("w1.jsonl", False, 0)
    w2, mw2, _ = run("w2.jsonl", False, 1)
    assert mw1 != mw2


def test_the_simulator_writes_the_same_format(tmp_path):
    cfg = SimConfig(shape=LLAMA3_8B, hardware=get_hardware("a800"), policy="flowprefill",
                    segment_overhead_s=50e-6)
    reqs = [Request(0.0, 3000, 3, SLO(ttft_s=100.0)), Request(0.01, 200, 3, SLO(ttft_s=0.2))]
    sim = Simulator(cfg)
    plain = sim.run(reqs)
    traced = sim.run(reqs, trace=tmp_path / "sim.jsonl")
    assert traced.metrics == plain.metrics  # tracing changes nothing
    lines = load(tmp_path / "sim.jsonl")
    assert lines[0]["source"] == "sim" and lines[0]["clock"] == "simulated"
    plans = [d for d in lines if d["event"] == "plan"]
    assert len(plans) == plain.iterations
    assert all(set(d) == PLAN_KEYS for d in plans)
    assert all(d["end"] - d["start"] == pytest.approx(d["measured_s"]) for d in plans)
    assert sum(d["event"] == "pause" for d in lines) == plain.scheduler_stats["prefill_pauses"]
    assert sorted(d["seq"] for d in lines if d["event"] == "finish") == [0, 1]
    assert summary(lines)["plan"] == len(plans)


def test_the_timeline_is_a_png_with_a_row_per_request(tmp_path, capsys):
    _, lines = flowprefill_run(tmp_path)
    png = tmp_path / "timeline.png"
    labels = plot_timeline(tmp_path / "fp.jsonl", png)
    assert labels == ["seq 0", "seq 1"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    trace_main(["plot", str(tmp_path / "fp.jsonl"), "--out", str(tmp_path / "cli.png")])
    assert "2 requests" in capsys.readouterr().out
    assert (tmp_path / "cli.png").read_bytes()[:4] == b"\x89PNG"
