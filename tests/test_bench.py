"""lp-bench: metric maths by hand, workload models, trace files, and a full run against the
mock-engine server on loopback (JSON, PNG and TensorBoard outputs)."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import numpy as np
import pytest

from lp_jax.bench import report, workload
from lp_jax.bench.__main__ import run_cli
from lp_jax.bench.client import RequestRecord, _is_token_event
from lp_jax.bench.progress import ProgressBar
from lp_jax.sim import workload as sim_workload


def rec(i, send, times, ok=True, tokens=None):
    r = RequestRecord(index=i, scheduled=send, prompt_len=10, output_len=len(times))
    r.send_time, r.token_times, r.ok = send, list(times), ok
    r.completion_tokens = len(times) if tokens is None else tokens
    r.end_time = times[-1] if times else send
    return r


def test_metric_maths_by_hand():
    records = [
        rec(0, 0.0, [0.5, 0.6, 0.8]),  # TTFT 0.5, ITLs 0.1 0.2: fails the ITL SLO
        rec(1, 1.0, [1.2, 1.25]),  # TTFT 0.2, ITL 0.05: passes
        rec(2, 2.0, [3.5]),  # TTFT 1.5: fails the TTFT SLO
        rec(3, 2.5, [], ok=False),  # failed: counts against attainment
    ]
    s = report.summarize_run(records, duration=4.0, ttft_slo=1.0, itl_slo=0.15)
    assert s["num_requests"] == 4 and s["num_failed"] == 1
    assert s["num_slo_passed"] == 1
    assert s["slo_attainment"] == pytest.approx(0.25)
    assert s["goodput"] == pytest.approx(0.25)  # 1 request / 4 s
    assert s["request_throughput"] == pytest.approx(0.75)
    assert s["output_throughput"] == pytest.approx(6 / 4)
    assert s["total_token_throughput"] == pytest.approx((6 + 30) / 4)
    # TTFTs [0.2, 0.5, 1.5]: p50 0.5; p90 at position 1.8 -> 0.5 + 0.8 * 1.0
    assert s["ttft_p50"] == pytest.approx(0.5)
    assert s["ttft_p90"] == pytest.approx(1.3)
    assert s["ttft_mean"] == pytest.approx(2.2 / 3)
    # max ITL per request [0.2, 0.05, 0.0]; pooled ITLs [0.1, 0.2, 0.05]
    assert s["max_itl_p50"] == pytest.approx(0.05)
    assert s["itl_p50"] == pytest.approx(0.1)
    assert s["itl_mean"] == pytest.approx(0.35 / 3)
    # E2E [0.8, 0.25, 1.5]; TPOT [(0.8 - 0.5) / 2, 0.05 / 1]
    assert s["e2e_p50"] == pytest.approx(0.8)
    assert s["tpot_mean"] == pytest.approx(0.1)


def test_token_events():
    assert not _is_token_event({"delta": {"role": "assistant", "content": ""}}, chat=True)
    assert _is_token_event({"delta": {"role": "assistant", "content": "a"}}, chat=True)
    assert _is_token_event({"delta": {"content": ""}}, chat=True)
    assert _is_token_event({"delta": {}, "finish_reason": "stop"}, chat=True)
    assert _is_token_event({"text": ""}, chat=False)


def test_sharegpt_lengths_follow_the_quantiles():
    model = workload.resolve_length_model("sharegpt")
    assert model is sim_workload.SHAREGPT_8K  # one quantile table
    p, o = model.sample(20000, np.random.default_rng(0))
    pmax, omax = model.max_lengths
    assert np.median(p) == pytest.approx(1730, rel=0.05)
    assert np.percentile(p, 90) == pytest.approx(5696, rel=0.05)
    assert np.median(o) == pytest.approx(415, rel=0.05)
    assert p.min() >= 1 and p.max() <= pmax == 8141 and o.max() <= omax == 1024
    scaled = workload.fit_lengths(p, pmax, 200)
    assert scaled.max() <= 200 and scaled.min() >= 1
    assert np.median(scaled) == pytest.approx(1730 * 200 / 8141, rel=0.1)
    assert workload.fit_lengths(p, pmax, 200, "clip").max() == 200


def test_arxiv_lengths():
    # The simulator's ARXIV_PAPER: prompts lognormal(median 7000, sigma 0.3) clipped to
    # [2048, 16384], outputs lognormal(median 200, sigma 0.35) clipped to [32, 512].
    model = workload.resolve_length_model("arxiv")
    assert model is sim_workload.ARXIV_PAPER
    p, o = model.sample(20000, np.random.default_rng(1))
    assert model.max_lengths == (16384, 512)
    assert p.min() >= 2048 and p.max() <= 16384 and o.min() >= 32 and o.max() <= 512
    assert np.median(p) == pytest.approx(7000, rel=0.03)
    assert np.percentile(p, [5, 95]) == pytest.approx([7000 * math.exp(-1.645 * 0.3),
                                                       7000 * math.exp(1.645 * 0.3)], rel=0.04)
    assert np.median(o) == pytest.approx(200, rel=0.03)
    assert 25 < p.mean() / o.mean() < 45  # the paper's "about 40x"
    fixed = workload.resolve_length_model("fixed", prompt_len=12, output_len=4)
    assert [a.tolist() for a in fixed.sample(3, np.random.default_rng(0))] == [[12] * 3, [4] * 3]
    assert fixed.max_lengths == (12, 4)
    with pytest.raises(ValueError, match="unknown length model"):
        workload.resolve_length_model("nope")


@pytest.mark.parametrize("process,burst", [("poisson", 1.0), ("gamma", 0.25), ("gamma", 4.0)])
def test_arrivals(process, burst):
    t = workload.arrival_times(20000, 5.0, np.random.default_rng(2), process=process,
                               burstiness=burst)
    gaps = np.diff(t)
    assert t[0] == 0.0
    assert gaps.mean() == pytest.approx(0.2, rel=0.05)
    assert (gaps.std() / gaps.mean()) ** 2 == pytest.approx(1 / burst, rel=0.1)
    assert np.all(workload.arrival_times(5, math.inf, np.random.default_rng(0)) == 0)
    # one arrival process: the simulator's, with CV 1 / sqrt(burstiness)
    sim_t = sim_workload.arrival_times(20000, 5.0, np.random.default_rng(2),
                                       workload.arrival_cv(process, burst))
    assert np.array_equal(t, sim_t)


def test_build_workload_matches_the_simulator():
    specs = workload.build_workload(num_requests=50, rate=3.0, seed=7, length_model="arxiv",
                                    process="gamma", burstiness=0.25)
    reqs = sim_workload.synthesize("arxiv", 50, 3.0, cv=2.0, seed=7)
    assert [(s.arrival, s.prompt_len, s.output_len) for s in specs] == [
        (r.arrival, r.prompt_len, r.output_len) for r in reqs]
    burst = workload.build_workload(num_requests=50, rate=math.inf, seed=7,
                                    length_model="arxiv", max_prompt_len=1024)
    assert all(s.arrival == 0.0 for s in burst)
    assert [s.prompt_len for s in burst] == [round(r.prompt_len * 1024 / 16384) for r in reqs]


def test_trace_files(tmp_path):
    csv_path = tmp_path / "t.csv"
    csv_path.write_text("timestamp,prompt_len,output_len\n10.0,5,3\n10.5,7,2\n12.0,9,4\n")
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text("\n".join(json.dumps({"prompt_len": n, "output_len": 2})
                               for n in (4, 6)))
    specs = workload.build_workload(num_requests=None, rate=1.0, trace=csv_path,
                                    time_scale=2.0)
    assert [s.arrival for s in specs] == [0.0, 1.0, 4.0]
    assert [s.prompt_len for s in specs] == [5, 7, 9]
    assert [len(s.prompt) for s in specs] == [5, 7, 9]
    assert [s.output_len for s in specs] == [3, 2, 4]
    specs = workload.build_workload(num_requests=None, rate=math.inf, trace=jsonl,
                                    prompt_kind="text")
    assert [s.arrival for s in specs] == [0.0, 0.0]
    assert isinstance(specs[0].prompt, str) and len(specs[0].prompt.split()) == 4
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="no prompt length column"):
        workload.load_trace(bad)
    # OpenAI usage names, rows out of time order, --num-requests; and no zero lengths
    usage = tmp_path / "usage.jsonl"
    usage.write_text("\n".join(json.dumps({"arrival_time": t, "prompt_tokens": p,
                                           "completion_tokens": 2})
                               for t, p in ((3.0, 8), (1.0, 6), (2.0, 4))))
    specs = workload.build_workload(num_requests=2, rate=1.0, trace=usage)
    assert [(s.arrival, s.prompt_len, s.output_len) for s in specs] == [(0.0, 6, 2),
                                                                         (1.0, 4, 2)]
    zero = tmp_path / "zero.csv"
    zero.write_text("prompt_len,output_len\n5,0\n")
    with pytest.raises(ValueError, match=">= 1"):
        workload.load_trace(zero)


def test_shared_traces_load():
    d = Path("/work/shared/data/traces")
    if not d.is_dir():
        pytest.skip("shared traces not present")
    conv = workload.load_trace(d / "splitwise_conv.csv")
    assert all(r.timestamp is not None for r in conv) and len(conv) > 1000
    arxiv = workload.load_trace(d / "arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv")
    assert all(r.timestamp is None for r in arxiv) and max(r.prompt_len for r in arxiv) <= 4096


def test_progress_bar():
    out = io.StringIO()
    bar = ProgressBar(4, stream=out, min_interval=0.0)
    for ok in (True, False, True, True):
        bar.update(ok)
    bar.close()
    last = out.getvalue().split("\r")[-1]
    assert "4/4" in last and "1 failed" in last and "#" * 30 in last


@pytest.fixture(scope="module")
def mock_server(tiny_dir):
    from lp_jax.server import OpenAIServer, ServerThread
    from lp_jax.server.mock import MockEngine

    st = ServerThread(OpenAIServer(MockEngine(model_dir=tiny_dir, max_model_len=512),
                                   served_model_names=["mock"])).start()
    yield st
    st.stop()


def test_lp_bench_end_to_end(mock_server, tmp_path, capsys):
    results = run_cli([
        "--base-url", mock_server.url, "--workload", "sharegpt", "--num-requests", "30",
        "--request-rate", "200,inf", "--max-prompt-len", "64", "--max-output-len", "8",
        "--vocab-size", "500", "--output-dir", str(tmp_path), "--scrape-metrics"])
    err = capsys.readouterr().err
    assert "30/30" in err and "goodput" in err
    assert results["model"] == "mock"  # from /v1/models
    data = json.loads((tmp_path / "results.json").read_text())
    assert len(data["runs"]) == 2
    for run in data["runs"]:
        assert run["summary"]["num_failed"] == 0
        assert run["summary"]["slo_attainment"] is not None
        for r in run["records"]:
            assert r["ok"] and r["completion_tokens"] == r["output_len"]
            assert len(r["token_times"]) == r["output_len"]  # one event per token
    assert data["runs"][1]["server_metrics"][
        'lp:request_success_total{model_name="mock",finished_reason="length"}'] == 60
    assert (tmp_path / "summary.png").stat().st_size > 10000
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(tmp_path / "tb"))
    ea.Reload()
    tags = ea.Tags()["scalars"]
    assert "summary/goodput" in tags and "run0/request/ttft" in tags
    assert [e.step for e in ea.Scalars("summary/request_rate")] == [0]  # inf is not logged
    assert len(ea.Scalars("run1/request/ttft")) == 30


def test_lp_bench_chat_text_prompts(mock_server, tiny_dir, tmp_path):
    results = run_cli([
        "--base-url", mock_server.url, "--model", "mock", "--endpoint", "chat",
        "--prompt-kind", "text", "--tokenizer", str(tiny_dir), "--workload", "fixed",
        "--prompt-len", "12", "--output-len", "4", "--num-requests", "6",
        "--request-rate", "inf", "--no-progress"])
    recs = results["runs"][0]["records"]
    assert all(r.ok and r.completion_tokens == 4 and len(r.token_times) == 4 for r in recs)
