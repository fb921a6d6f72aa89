"""Trace replay with classes (lp_jax/sim/trace_file.py, docs/trace_format.md): per-row
SLOs reach the simulator's requests and lp-bench's, bad rows name their line."""

from __future__ import annotations

import json

import pytest

from lp_jax.bench import workload as bench
from lp_jax.core.slo import SLO
from lp_jax.roofline import get_hardware, resolve_model
from lp_jax.sim import SimConfig, Simulator, load_trace, trace_requests
from lp_jax.sim.workload import ARXIV_4K_CSV, AZURE_CONV_CSV

CSV = """arrival_time,input_len,output_len,slo_class,ttft_slo_ms,tbt_slo_ms
0.0,100,4,chat,250,100
0.5,6000,2,summarisation,,
0.25,800,3,,1500,
1.0,50,1,chat,400,
"""


def test_classed_csv_gives_each_request_its_slo(tmp_path):
    path = tmp_path / "qwen_like.csv"
    path.write_text(CSV)
    rows = load_trace(path)
    assert [r.line for r in rows] == [2, 3, 4, 5]
    classes = {"chat": SLO(0.3, 0.08, "chat"), "summarisation": SLO(6.0, 0.2, "summarisation")}
    reqs = trace_requests(path, classes=classes)
    # time order: rows 1, 3, 2, 4
    assert [r.arrival for r in reqs] == [0.0, 0.25, 0.5, 1.0]
    assert [r.task for r in reqs] == ["chat", "custom", "summarisation", "chat"]
    got = [(r.slo.ttft_s, r.slo.tbt_s) for r in reqs]
    # explicit values override the class's; a missing one falls back to it
    assert got == [(0.25, 0.1), (1.5, None), (6.0, 0.2), (0.4, 0.08)]
    # without configured classes a class is a label, only the row's values count
    bare = trace_requests(path)
    assert bare[2].slo is None and bare[2].slo_class == "summarisation"
    assert (bare[3].slo.ttft_s, bare[3].slo.tbt_s, bare[3].slo.name) == (0.4, None, "chat")
    scaled = trace_requests(path, classes=classes, slo_scale=2.0)
    assert scaled[0].slo.ttft_s == pytest.approx(0.5)
    with pytest.raises(ValueError, match="line 3: unknown slo_class 'summarisation'"):
        trace_requests(path, classes={"chat": classes["chat"]})


def test_jsonl_seconds_columns_and_lp_bench(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [{"timestamp": 2.0, "prompt_tokens": 8, "completion_tokens": 2, "class": "a",
             "ttft_slo_s": 0.5, "tbt_slo_s": 0.05},
            {"timestamp": 1.0, "prompt_tokens": 6, "completion_tokens": 3}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    got = load_trace(path)
    assert (got[0].ttft_slo_ms, got[0].tbt_slo_ms, got[0].slo_class) == (500.0, 50.0, "a")
    specs = bench.build_workload(num_requests=None, rate=1.0, trace=path)
    assert [(s.arrival, s.prompt_len, s.slo_class, s.ttft_slo_ms) for s in specs] == [
        (0.0, 6, None, None), (1.0, 8, "a", 500.0)]


@pytest.mark.parametrize("text, line, message", [
    ("prompt_len,output_len\n5,3\n7\n", 3, "1 fields, the header has 2"),
    ("prompt_len,output_len\n5,3\n\n7,0\n", 4, "whole number >= 1"),
    ("prompt_len,output_len\n5,3\nabc,2\n", 3, "prompt_len must be a number"),
    ("prompt_len,output_len,ttft_slo_ms\n5,3,-1\n", 2, "ttft_slo_ms must be > 0"),
    ("prompt_len,output_len,time\n5,3,nan\n", 2, "time must be finite"),
    ("a,output_len\n5,3\n", 2, "no prompt length column"),
    ("prompt_len,output_len\n5,3.5\n", 2, "output_len must be a whole number"),
])
def test_bad_csv_rows_name_their_line(tmp_path, text, line, message):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"bad\.csv:{line}: .*{message}"):
        load_trace(path)


def test_bad_jsonl_rows_name_their_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt_len": 3, "output_len": 1}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: a row must be an object"):
        load_trace(path)
    path.write_text('{"prompt_len": 3, "output_len": 1}\n{"prompt_len": 3,\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: not valid JSON"):
        load_trace(path)


def test_shipped_trace_heads_still_load(tmp_path):
    """The bundled files' formats (their full loads: tests/test_sim.py test_bundled_traces)."""
    for src, timed in ((AZURE_CONV_CSV, True), (ARXIV_4K_CSV, False)):
        head = tmp_path / src.name
        head.write_text("".join(src.open().readlines()[:51]))
        rows = load_trace(head)
        assert len(rows) == 50 and all((r.timestamp is not None) == timed for r in rows)
        assert all(r.slo_class is None and r.slo() is None for r in rows)
        assert all(r.slo is None for r in trace_requests(head, rate=1.0))


def test_trace_slos_reach_the_simulators_attainment(tmp_path):
    """Two identical requests, one with a TTFT SLO it meets and one it cannot: the
    simulator's per-class attainment reads each request's own SLO from the file."""
    cfg = SimConfig(shape=resolve_model("qwen3-30b-a3b"), hardware=get_hardware("h100"),
                    policy="orca", tp=2)
    alone = Simulator(cfg).run(trace_requests(_one(tmp_path, 10_000.0))).metrics[0].ttft
    path = tmp_path / "two.csv"
    path.write_text("time,prompt_len,output_len,class,ttft_slo_ms\n"
                    f"0,2048,1,loose,{2e3 * alone:.3f}\n"
                    f"100,2048,1,tight,{0.5e3 * alone:.3f}\n")
    att = Simulator(cfg).run(trace_requests(path)).ttft_attainment()
    assert att == {"loose": 1.0, "tight": 0.0, "all": 0.5}


def _one(tmp_path, ttft_ms: float):
    path = tmp_path / "one.csv"
    path.write_text(f"time,prompt_len,output_len,ttft_slo_ms\n0,2048,1,{ttft_ms}\n")
    return path
