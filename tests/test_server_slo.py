"""Per-request latency SLOs through the HTTP API, lp-serve's FlowPrefill flags, the SLO
Prometheus counters, and lp-bench's multi-SLO workload.

Most tests run against the JAX-free MockEngine with two SLO classes; one real-engine server
(the tiny model, flowprefill scheduling) checks that the fields reach the engine's own
tracker through the official openai client.
"""

from __future__ import annotations

import http.client
import json
import math

import numpy as np
import pytest
from conftest import start_server

from lp_jax.bench import report, workload
from lp_jax.bench.__main__ import build_parser as bench_parser
from lp_jax.bench.__main__ import run_cli
from lp_jax.bench.client import RequestRecord, request_body
from lp_jax.server.mock import MockEngine
from lp_jax.server.prometheus import parse_text

CLASSES = {"chat": {"ttft_ms": 250, "tbt_ms": 100}, "batch": {"ttft_ms": 60000}}


def request(st_, method, path, body=None, raw: bytes | None = None):
    """(status, headers, body bytes) over a fresh loopback connection."""
    conn = http.client.HTTPConnection("127.0.0.1", st_.port, timeout=30)
    try:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def post(st_, path, body, raw: bytes | None = None):
    return request(st_, "POST", path, body, raw)


def assert_error(status, data, expect_status):
    assert status == expect_status, (status, data)
    return json.loads(data)["error"]


@pytest.fixture(scope="module")
def slo_server(tiny_dir):
    """A mock server with the CLASSES; `added` lists the SLO of every queued request."""
    eng = MockEngine(model_dir=tiny_dir, max_model_len=64, slo_classes=CLASSES)
    added = []
    add = eng.add_request

    def counting_add(*args, **kw):
        rid = add(*args, **kw)
        added.append(eng.resolve_slo(kw.get("slo")))
        return rid

    eng.add_request = counting_add
    st_ = start_server(eng)
    st_.added = added
    yield st_
    st_.stop()


def metric(st_, name: str, **labels) -> float:
    text = request(st_, "GET", "/metrics")[2].decode()
    key = name + "{" + ",".join(f'{k}="{v}"' for k, v in
                                {"model_name": "mock", **labels}.items()) + "}"
    return parse_text(text).get(key, math.nan)


# ------------------------------------------------------------------------- HTTP fields
@pytest.mark.parametrize("path,extra", [
    ("/v1/completions", {"prompt": [1, 2, 3]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
])
def test_slo_fields_reach_the_engine(slo_server, path, extra):
    cases = [
        ({"ttft_slo_ms": 500, "tbt_slo_ms": 50.5}, (0.5, 0.0505, "custom")),
        ({"slo_class": "chat"}, (0.25, 0.1, "chat")),
        ({"slo_class": "chat", "ttft_slo_ms": 1000}, (1.0, 0.1, "chat")),  # explicit wins
        ({"slo_class": "batch", "stream": True}, (60.0, None, "batch")),
        ({}, None),  # best-effort
    ]
    for fields, want in cases:
        n = len(slo_server.added)
        status, _, data = post(slo_server, path, {**extra, "max_tokens": 3, **fields})
        assert status == 200, data
        assert len(slo_server.added) == n + 1
        slo = slo_server.added[-1]
        got = None if slo is None else (slo.ttft_s, slo.tbt_s, slo.name)
        assert got == (pytest.approx(want) if want else None), fields


@pytest.mark.parametrize("fields,param,words", [
    ({"ttft_slo_ms": -1}, "ttft_slo_ms", "(0.0, 86400000.0]"),
    ({"ttft_slo_ms": 0}, "ttft_slo_ms", "(0.0"),
    ({"tbt_slo_ms": 1e12}, "tbt_slo_ms", "86400000"),
    ({"ttft_slo_ms": "250"}, "ttft_slo_ms", "finite number"),
    ({"tbt_slo_ms": True}, "tbt_slo_ms", "finite number"),
    ({"ttft_slo_ms": [250]}, "ttft_slo_ms", "finite number"),
    ({"slo_class": "nope"}, "slo_class", "unknown slo_class 'nope' (known: batch, chat)"),
    ({"slo_class": "nope", "ttft_slo_ms": 100}, "slo_class", "unknown slo_class"),
    ({"slo_class": 5}, "slo_class", "non-empty string"),
    ({"slo_class": ""}, "slo_class", "non-empty string"),
    ({"slo_class": "x" * 65}, "slo_class", "at most 64"),
])
def test_bad_slo_fields_are_400_and_queue_nothing(slo_server, fields, param, words):
    n = len(slo_server.added)
    for path, extra in (("/v1/completions", {"prompt": "x"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user",
                                                                "content": "x"}]})):
        status, _, data = post(slo_server, path, {**extra, "max_tokens": 2, **fields})
        err = assert_error(status, data, 400)
        assert err["param"] == param and words in err["message"], err
    assert len(slo_server.added) == n  # refused before the engine saw it


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_slo_is_400_naming_the_field(slo_server, constant):
    n = len(slo_server.added)
    raw = f'{{"prompt": "x", "max_tokens": 2, "ttft_slo_ms": {constant}}}'.encode()
    status, _, data = post(slo_server, "/v1/completions", None, raw=raw)
    err = assert_error(status, data, 400)
    assert err["param"] == "ttft_slo_ms" and constant in err["message"], err
    status, _, data = post(slo_server, "/v1/completions", None,
                           raw=b'{"prompt": "x", "stop": [NaN]}')  # nested: no field named
    assert "not valid JSON" in assert_error(status, data, 400)["message"]
    assert len(slo_server.added) == n
    # and the server still serves
    status, _, _ = post(slo_server, "/v1/completions",
                        {"prompt": "x", "max_tokens": 2, "ttft_slo_ms": 100})
    assert status == 200


class _NoSLOEngine(MockEngine):
    @property
    def resolve_slo(self):
        raise AttributeError("an engine without SLOs")


def test_slo_without_engine_support_is_400(tiny_dir):
    with start_server(_NoSLOEngine(model_dir=tiny_dir, max_model_len=64)) as st_:
        status, _, data = post(st_, "/v1/completions",
                               {"prompt": "x", "max_tokens": 1, "ttft_slo_ms": 100})
        assert assert_error(status, data, 400)["param"] == "ttft_slo_ms"
        assert post(st_, "/v1/completions", {"prompt": "x", "max_tokens": 1})[0] == 200


# -------------------------------------------------------------------------- Prometheus
def test_slo_counters(tiny_dir):
    with start_server(MockEngine(model_dir=tiny_dir, max_model_len=64,
                                 slo_classes=CLASSES)) as st_:
        text = request(st_, "GET", "/metrics")[2].decode()
        assert "# TYPE lp:slo_attained_total counter" in text
        assert "# HELP lp:slo_requests_total " in text
        # declared at start-up, for the kinds each class sets
        assert metric(st_, "lp:slo_requests_total", slo_class="chat", kind="tbt") == 0
        assert metric(st_, "lp:slo_attained_total", slo_class="batch", kind="ttft") == 0
        assert math.isnan(metric(st_, "lp:slo_requests_total", slo_class="batch", kind="tbt"))
        for fields in ({"slo_class": "chat"}, {"slo_class": "batch"},
                       {"slo_class": "batch", "stream": True},
                       {"ttft_slo_ms": 1e-6}, {}):  # 1 ns: missed
            assert post(st_, "/v1/completions",
                        {"prompt": [1, 2], "max_tokens": 3, **fields})[0] == 200
        assert metric(st_, "lp:slo_requests_total", slo_class="chat", kind="ttft") == 1
        assert metric(st_, "lp:slo_attained_total", slo_class="chat", kind="ttft") == 1
        assert metric(st_, "lp:slo_requests_total", slo_class="chat", kind="tbt") == 1
        assert metric(st_, "lp:slo_requests_total", slo_class="batch", kind="ttft") == 2
        assert metric(st_, "lp:slo_attained_total", slo_class="batch", kind="ttft") == 2
        assert metric(st_, "lp:slo_requests_total", slo_class="custom", kind="ttft") == 1
        assert metric(st_, "lp:slo_attained_total", slo_class="custom", kind="ttft") == 0
        assert math.isnan(metric(st_, "lp:slo_requests_total", slo_class="custom", kind="tbt"))


# ------------------------------------------------------------------ the real engine
@pytest.fixture(scope="module")
def real_server(engines):
    from lp_jax import LLM
    from lp_jax.server import OpenAIServer, ServerThread

    # the run's flowprefill-128 shapes (conftest), with this module's SLO classes
    engine = LLM(**engines.kwargs("flowprefill-128"), slo_classes=CLASSES).engine
    st_ = ServerThread(OpenAIServer(engine, served_model_names=["mock"])).start()
    yield st_
    st_.stop()


def test_real_engine_slo(real_server):
    import openai

    client = openai.OpenAI(base_url=f"{real_server.url}/v1", api_key="unused",
                           max_retries=0, timeout=120)
    for extra in ({"slo_class": "chat"}, {"slo_class": "batch", "tbt_slo_ms": 60000},
                  {"ttft_slo_ms": 60000}):
        out = client.completions.create(model="mock", prompt="The engine", max_tokens=4,
                                        extra_body={"ignore_eos": True, **extra})
        assert out.usage.completion_tokens == 4
    chat = client.chat.completions.create(
        model="mock", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        extra_body={"ignore_eos": True, "slo_class": "chat"})
    assert chat.usage.completion_tokens == 2
    for extra, param in (({"slo_class": "gold"}, "slo_class"),
                         ({"ttft_slo_ms": -5}, "ttft_slo_ms"),
                         ({"tbt_slo_ms": "fast"}, "tbt_slo_ms")):
        with pytest.raises(openai.BadRequestError) as exc:
            client.completions.create(model="mock", prompt="x", max_tokens=1,
                                      extra_body=extra)
        assert exc.value.body["param"] == param
    stats = real_server.engine_call(lambda e: e.stats())
    att = stats["slo_attainment"]
    assert att["chat"]["ttft"]["total"] == 2 and att["batch"]["ttft"]["total"] == 1
    assert att["batch"]["tbt"]["total"] == 1 and att["custom"]["ttft"]["total"] == 1
    assert att["batch"]["ttft"]["attained"] == 1  # a minute is plenty
    assert stats["compilations_after_warmup"] == 0
    assert metric(real_server, "lp:slo_requests_total", slo_class="chat", kind="ttft") == 2
    assert metric(real_server, "lp:slo_attained_total", slo_class="custom", kind="ttft") == 1


# ---------------------------------------------------------------------- lp-serve flags
def test_serve_flowprefill_flags(tmp_path):
    from lp_jax import serve
    from lp_jax.core.config import GRANULARITIES

    path = tmp_path / "classes.json"
    path.write_text(json.dumps(CLASSES))
    args = serve.build_parser().parse_args([
        "--scheduling", "flowprefill", "--preemption-granularity", "layer",
        "--slo-alpha", "0.2", "--max-paused-prefills", "3", "--slo-classes", str(path),
        "--prefill-only", "--latency-model", str(path), "--flowprefill-lookahead", "2"])
    cfg = serve.engine_config(args)
    assert cfg.flowprefill_lookahead == 2
    assert (cfg.scheduling, cfg.preemption_granularity, cfg.slo_alpha) == ("flowprefill",
                                                                            "layer", 0.2)
    assert cfg.max_paused_prefills == 3 and cfg.prefill_only and not cfg.preemptible
    assert cfg.slo_classes == CLASSES and cfg.latency_model == str(path)
    args = serve.build_parser().parse_args(["--preemptible", "--slo-classes",
                                            '{"chat": {"ttft_ms": 100}}'])
    cfg = serve.engine_config(args)
    assert cfg.preemptible and cfg.slo_classes == {"chat": {"ttft_ms": 100}}
    assert cfg.latency_model is None and not cfg.prefill_only
    action = next(a for a in serve.build_parser()._actions
                  if a.dest == "preemption_granularity")
    assert tuple(action.choices) == GRANULARITIES
    eng = serve.build_engine(serve.build_parser().parse_args(
        ["--mock-engine", "--slo-classes", str(path)]))
    assert set(eng.slo_classes) == {"chat", "batch"}


@pytest.mark.parametrize("value,words", [
    ("missing.json", "cannot read SLO classes file"),
    ("{not json", "bad SLO classes"),
    ('{"chat": {"ttft_ms": -1}}', "must be in (0, 86400000]"),
    ('{"chat": {"ttft": 100}}', "must be an object with ttft_ms"),
    ('{"custom": {"ttft_ms": 100}}', "reserved"),
])
def test_serve_bad_slo_classes_fail_at_start_up(tmp_path, capsys, value, words):
    from lp_jax import serve

    if value == "missing.json":
        value = str(tmp_path / value)
    with pytest.raises(SystemExit) as exc:
        serve.main(["--mock-engine", "--slo-classes", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--slo-classes" in err and words in err, err


@pytest.mark.parametrize("argv", [["--slo-alpha", "1"], ["--max-paused-prefills", "-1"],
                                  ["--preemption-granularity", "token"],
                                  ["--flowprefill-lookahead", "0"],
                                  ["--latency-model", "/nonexistent/model.json"]])
def test_serve_bad_flowprefill_flags(argv, capsys):
    from lp_jax import serve

    with pytest.raises(SystemExit):
        serve.build_parser().parse_args(argv)
    assert argv[0] in capsys.readouterr().err


# -------------------------------------------------------------- lp-bench multi-SLO
def test_parse_slo_class():
    c = workload.parse_slo_class("chat:590:250")
    assert (c.name, c.prompt_len, c.ttft_ms, c.tbt_ms, c.weight) == ("chat", 590, 250, None, 1)
    c = workload.parse_slo_class("web:5976:2000:80:0.5")
    assert (c.tbt_ms, c.weight) == (80, 0.5)
    c = workload.parse_slo_class("s:100:50::3")
    assert (c.tbt_ms, c.weight) == (None, 3)
    for bad, words in (("chat:590", "expected NAME"), ("chat:x:250", "must be numbers"),
                       (":590:250", "class name"), ("chat:590:-1", "ttft_ms must be"),
                       ("chat:590:250:100:0", "weight must be"), ("c::250", "required"),
                       ("a:1:2:3:4:5", "expected NAME"), ("c:nan:250", "prompt_len")):
        with pytest.raises(ValueError, match=words):
            workload.parse_slo_class(bad)


def test_default_classes_are_flowprefill_qwentrace():
    by = {c.name: c for c in workload.QWEN_TRACE_CLASSES}
    assert {k: v.prompt_len for k, v in by.items()} == {
        "chat": 590, "web_search": 5976, "summarisation": 6833, "image_understanding": 1500}
    assert "prompt_len" in by["image_understanding"].assumed
    assert all("prompt_len" not in by[k].assumed for k in ("chat", "web_search",
                                                             "summarisation"))
    assert all("ttft_ms" in c.assumed for c in by.values())


def test_multi_slo_workload():
    classes = (workload.SLOClass("short", 100, 200, 50, weight=3),
               workload.SLOClass("long", 2000, 4000))
    specs = workload.build_multi_slo_workload(
        classes, num_requests=4000, rate=5.0, seed=3, length_scale=0.5, slo_scale=2.0,
        length_sigma=0.25, output_len=7)
    assert len(specs) == 4000 and [s.index for s in specs] == list(range(4000))
    short = [s for s in specs if s.slo_class == "short"]
    long_ = [s for s in specs if s.slo_class == "long"]
    assert len(short) / len(specs) == pytest.approx(0.75, abs=0.03)
    assert np.mean([s.prompt_len for s in short]) == pytest.approx(50, rel=0.03)
    assert np.mean([s.prompt_len for s in long_]) == pytest.approx(1000, rel=0.03)
    assert np.std(np.log([s.prompt_len for s in long_])) == pytest.approx(0.25, rel=0.1)
    assert all(len(s.prompt) == s.prompt_len and s.output_len == 7 for s in specs)
    assert {(s.ttft_slo_ms, s.tbt_slo_ms) for s in short} == {(400, 100)}
    assert {(s.ttft_slo_ms, s.tbt_slo_ms) for s in long_} == {(8000, None)}
    # the arrivals of build_workload for the same seed; the same requests at every rate
    base = workload.build_workload(num_requests=4000, rate=5.0, seed=3, length_model="fixed")
    assert [s.arrival for s in specs] == [s.arrival for s in base]
    again = workload.build_multi_slo_workload(classes, num_requests=4000, rate=50.0, seed=3,
                                              length_scale=0.5, slo_scale=2.0, output_len=7)
    assert [(s.slo_class, s.prompt_len) for s in again] == [
        (s.slo_class, s.prompt_len) for s in specs]
    clipped = workload.build_multi_slo_workload(classes, num_requests=200, rate=math.inf,
                                                max_prompt_len=60)
    assert max(s.prompt_len for s in clipped) == 60 and min(s.prompt_len for s in clipped) >= 1
    assert all(s.arrival == 0 for s in clipped)
    default = workload.build_multi_slo_workload(num_requests=400, rate=1.0, length_scale=0.05)
    assert {s.slo_class for s in default} == {c.name for c in workload.QWEN_TRACE_CLASSES}
    for kw, words in (({"length_scale": 0}, "length_scale"), ({"slo_scale": -1}, "slo_scale"),
                      ({"length_sigma": math.nan}, "length_sigma")):
        with pytest.raises(ValueError, match=words):
            workload.build_multi_slo_workload(classes, num_requests=2, rate=1.0, **kw)
    with pytest.raises(ValueError, match="named twice"):
        workload.build_multi_slo_workload(classes * 2, num_requests=2, rate=1.0)
    assert workload.slo_classes_config(classes, 2.0) == {
        "short": {"ttft_ms": 400, "tbt_ms": 100}, "long": {"ttft_ms": 8000}}


def test_multi_slo_request_bodies():
    spec = workload.RequestSpec(0, 0.0, 3, 2, [1, 2, 3], slo_class="chat", ttft_slo_ms=250.0,
                                tbt_slo_ms=None)
    body = request_body(spec, model="m", chat=False, ignore_eos=True, temperature=0.0)
    assert body["ttft_slo_ms"] == 250.0
    assert "tbt_slo_ms" not in body and "slo_class" not in body
    body = request_body(spec, model="m", chat=False, ignore_eos=True, temperature=0.0,
                        send_slo_class=True, extra={"ttft_slo_ms": 5})
    assert body["slo_class"] == "chat" and body["ttft_slo_ms"] == 5  # --extra-body wins
    plain = workload.RequestSpec(0, 0.0, 3, 2, [1, 2, 3])
    body = request_body(plain, model="m", chat=False, ignore_eos=True, temperature=0.0)
    assert not set(body) & {"slo_class", "ttft_slo_ms", "tbt_slo_ms"}


def test_multi_slo_cli_parser():
    args = bench_parser().parse_args([
        "--workload", "multi-slo", "--slo-class", "chat:590:250:100:2",
        "--slo-class", "batch:6000:4000", "--length-scale", "0.05", "--slo-scale", "3",
        "--send-slo-class"])
    assert [c.name for c in args.slo_classes] == ["chat", "batch"]
    assert args.slo_classes[0].weight == 2 and args.length_scale == 0.05
    assert args.slo_scale == 3 and args.send_slo_class
    args = bench_parser().parse_args(["--workload", "multi-slo"])
    assert args.slo_classes is None and args.length_scale == 1.0
    help_text = next(a.help for a in bench_parser()._actions if a.dest == "slo_classes")
    assert "image_understanding:1500:1000 (prompt length ASSUMED)" in help_text
    assert "objectives and weights are ASSUMED" in help_text
    for argv in (["--slo-class", "chat:590"], ["--length-scale", "0"],
                 ["--slo-scale", "inf"]):
        with pytest.raises(SystemExit):
            bench_parser().parse_args(argv)


def _rec(i, cls, ttft_slo, times, ok=True, tbt_slo=None):
    r = RequestRecord(index=i, scheduled=0.0, prompt_len=10, output_len=len(times),
                      slo_class=cls, ttft_slo_ms=ttft_slo, tbt_slo_ms=tbt_slo)
    r.send_time, r.token_times, r.ok = 0.0, list(times), ok
    r.completion_tokens = len(times)
    return r


def test_per_class_report():
    records = [
        _rec(0, "chat", 250, [0.1, 0.15], tbt_slo=100),  # meets both
        _rec(1, "chat", 250, [0.3, 0.31], tbt_slo=100),  # TTFT missed, TBT met
        _rec(2, "chat", 250, [0.2, 0.5], tbt_slo=100),  # TBT missed
        _rec(3, "chat", 250, [], ok=False, tbt_slo=100),  # failed: misses both
        _rec(4, "batch", 4000, [3.0]),
        _rec(5, "batch", 4000, [5.0]),
    ]
    s = report.summarize_run(records, duration=5.0, ttft_slo=1.0, itl_slo=1.0,
                             assumed={"batch": ("ttft_ms",)})
    chat, batch = s["per_class"]["chat"], s["per_class"]["batch"]
    assert chat["num_requests"] == 4 and chat["num_failed"] == 1
    assert chat["num_ttft_attained"] == 2 and chat["ttft_attainment"] == 0.5
    assert chat["tbt_attainment"] == 0.5 and chat["tbt_slo_ms"] == 100
    assert chat["ttft_p50"] == pytest.approx(0.2) and "assumed" not in chat
    assert batch["ttft_attainment"] == 0.5 and "tbt_attainment" not in batch
    assert batch["ttft_p99"] == pytest.approx(3.0 + 0.99 * 2.0)
    assert batch["assumed"] == ["ttft_ms"]
    assert s["class_ttft_attainment"] == pytest.approx(3 / 6)
    assert s["class_slo_attainment"] == pytest.approx(2 / 6)
    assert s["class_slo_goodput"] == pytest.approx(2 / 5)
    text = report.format_summary(s)
    assert "TTFT <= 250 ms: 0.500" in text and "[ASSUMED: ttft_ms]" in text
    assert "per_class" not in report.summarize_run(records[:0] + [_rec(0, None, None, [1.0])],
                                                   1.0, 1.0, 1.0)


def test_lp_bench_multi_slo_end_to_end(slo_server, tmp_path, capsys):
    results = run_cli([
        "--base-url", slo_server.url, "--workload", "multi-slo",
        "--slo-class", "chat:590:250:100:3", "--slo-class", "batch:6000:60000",
        "--length-scale", "0.02", "--output-len", "4", "--num-requests", "40",
        "--request-rate", "inf", "--send-slo-class", "--scrape-metrics", "--no-progress",
        "--no-plot", "--no-tensorboard", "--output-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert "multi-slo classes" in err and "per-class SLOs" in err
    run = results["runs"][0]
    assert run["summary"]["num_failed"] == 0
    per = run["summary"]["per_class"]
    assert set(per) == {"chat", "batch"}
    assert per["chat"]["num_requests"] + per["batch"]["num_requests"] == 40
    assert per["batch"]["ttft_attainment"] == 1.0  # a minute
    # batch prompts (mean 120) are clipped to the server's context less the output
    assert max(r.prompt_len for r in run["records"]) == 60
    m = run["server_metrics"]
    key = 'lp:slo_requests_total{model_name="mock",slo_class="batch",kind="ttft"}'
    assert m[key] >= per["batch"]["num_requests"]
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["server_slo_classes"] == {"chat": {"ttft_ms": 250, "tbt_ms": 100},
                                          "batch": {"ttft_ms": 60000}}
    assert data["runs"][0]["records"][0]["slo_class"] in ("chat", "batch")
