"""The server's limits, on the JAX-free MockEngine over loopback HTTP: bodies are never
decompressed, the waiting limit counts sequences and a request that can never fit is a
400, the caps on a request's sequences and log-probability entries refuse before any
engine work, an empty API key refuses to start, the key guards every route but the
public ones, one stats line per interval at most, and the server sees the engine only
through core/served.py's interface."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import time

import aiohttp.http_parser
import pytest
from conftest import start_server
from test_server_hardening import error_of, post, request

from lp_jax.core.sampling_params import SamplingParams
from lp_jax.core.served import ServedEngine
from lp_jax.server import OpenAIServer
from lp_jax.server.app import PUBLIC_PATHS, keyed_paths
from lp_jax.server.engine_loop import EngineLoop, NeverFitsError, OverloadedError
from lp_jax.server.mock import MockEngine


# ------------------------------------------------------------ Content-Encoding
class _CountingInflater(aiohttp.http_parser.ZLibDecompressor):
    made = 0

    def __init__(self, *args, **kw):
        type(self).made += 1
        super().__init__(*args, **kw)


@pytest.mark.parametrize("encoding,compress", [
    ("gzip", gzip.compress), ("gzip", None), ("deflate", None), ("br", None),
    ("GZip ", gzip.compress)])
def test_compressed_bodies_are_415_and_never_inflated(mock_server, monkeypatch, caplog,
                                                      encoding, compress):
    monkeypatch.setattr(aiohttp.http_parser, "ZLibDecompressor", _CountingInflater)
    _CountingInflater.made = 0
    body = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
    with caplog.at_level(logging.INFO):
        status, headers, data = post(mock_server, None, raw=compress(body) if compress else body,
                                     headers={"Content-Encoding": encoding})
    err = error_of(status, data, 415)
    assert encoding.strip().lower() in err["message"] and err["param"] == "Content-Encoding"
    assert headers.get("Connection") == "close"  # the unread body is never drained
    assert _CountingInflater.made == 0
    assert not [r for r in caplog.records if r.name.startswith(("lp_jax", "aiohttp"))]


def test_gzip_bomb_is_refused_unread(mock_server, monkeypatch):
    monkeypatch.setattr(aiohttp.http_parser, "ZLibDecompressor", _CountingInflater)
    _CountingInflater.made = 0
    bomb = gzip.compress(b"{\"prompt\": \"" + b" " * (64 << 20), compresslevel=1)  # 64 MiB
    status, _, data = post(mock_server, None, raw=bomb, headers={"Content-Encoding": "gzip"})
    error_of(status, data, 415)
    assert _CountingInflater.made == 0
    for encoding in ("identity", ""):
        status, _, _ = post(mock_server, {"prompt": "x", "max_tokens": 1},
                            headers={"Content-Encoding": encoding})
        assert status == 200


# ------------------------------------------------------------------ the queue limit
def _params(n=1):
    return SamplingParams(max_tokens=1, n=n)


def test_waiting_limit_counts_sequences():
    """4 slots + 2 waiting on an engine that admits nothing: a request of 5 sequences
    (prompts x n) takes the 4 slots and 1 waiting place; 2 more would wait past the
    limit (503), 1 more fits; 7 can never fit, however idle the engine (400)."""
    engine = MockEngine(progress=False, max_num_seqs=4)
    loop_ = EngineLoop(engine, max_waiting=2, log_stats_s=None).start()

    async def scenario():
        ids = [1, 2, 3]
        with pytest.raises(NeverFitsError, match="can never be admitted"):
            await loop_.add([(ids, _params())] * 7)
        assert len(engine.waiting) == 0  # refused before the engine saw it
        await loop_.add([(ids, _params(n=2))] * 2 + [(ids, _params())])
        assert loop_.num_waiting == 1
        with pytest.raises(OverloadedError, match="adds 2"):
            await loop_.add([(ids, _params(n=2))])
        await loop_.add([(ids, _params())])
        assert loop_.num_waiting == 2

    try:
        asyncio.run(scenario())
    finally:
        loop_.shutdown()


def test_idle_server_admits_any_request_it_can_ever_serve(tiny_dir):
    with start_server(MockEngine(model_dir=tiny_dir, max_num_seqs=4), max_waiting=2) as st_:
        for prompts, n in ((6, 1), (3, 2), (1, 6)):
            status, _, data = post(st_, {"prompt": ["x"] * prompts, "n": n, "max_tokens": 2})
            assert status == 200, data[:300]
            assert len(json.loads(data)["choices"]) == prompts * n
        for prompts, n, param in ((7, 1, "prompt"), (2, 4, "n")):
            status, headers, data = post(st_, {"prompt": ["x"] * prompts, "n": n})
            err = error_of(status, data, 400)
            assert "Retry-After" not in headers and err["param"] == param
            assert f"runs {prompts * n} sequences" in err["message"]
            assert "--max-waiting" in err["message"]
        assert st_.server.engine_loop.num_unadmitted == 0


# ------------------------------------------------------------ amplification caps
def test_sequence_cap_refuses_before_any_work(tiny_dir):
    engine = MockEngine(model_dir=tiny_dir)
    with start_server(engine, max_request_seqs=8) as st_:
        status, _, data = post(st_, {"prompt": ["x"] * 3, "n": 3, "max_tokens": 1})
        err = error_of(status, data, 400)
        assert "9 sequences" in err["message"] and "--max-request-seqs" in err["message"]
        assert err["param"] == "n" and engine._next_id == 0  # nothing reached the engine
        status, _, data = post(st_, {"prompt": ["x"] * 4, "n": 2, "max_tokens": 1})
        assert status == 200 and len(json.loads(data)["choices"]) == 8


def test_logprob_entry_cap_counts_output_entries(tiny_dir):
    """Output entries: max_tokens x n x (logprobs + 1) over the prompts; no max_tokens
    counts the rest of the context (max_model_len 64)."""
    engine = MockEngine(model_dir=tiny_dir, max_model_len=64)
    with start_server(engine, max_logprob_entries=1000) as st_:
        ok = {"prompt": [1], "max_tokens": 10, "logprobs": 20, "n": 4}  # 840 entries
        status, _, data = post(st_, ok)
        assert status == 200, data[:300]
        assert len(json.loads(data)["choices"]) == 4
        started = engine._next_id
        for body in ({**ok, "n": 5},  # 1,050
                     {"prompt": [1], "logprobs": 20},  # 63 x 21 = 1,323
                     {"prompt": [[1], [2]], "max_tokens": 24, "logprobs": 20}):  # 1,008
            status, _, data = post(st_, body)
            err = error_of(status, data, 400)
            assert "--max-logprob-entries" in err["message"] and err["param"] == "logprobs"
        chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 48,
                "logprobs": True, "top_logprobs": 20}  # 48 x 21 = 1,008
        status, _, data = post(st_, chat, path="/v1/chat/completions")
        assert error_of(status, data, 400)["param"] == "logprobs"
        assert engine._next_id == started  # refused before anything was queued


def test_full_context_prompt_without_max_tokens_is_400(mock_server):
    status, _, data = post(mock_server, {"prompt": list(range(1, 65))})  # max_model_len 64
    err = error_of(status, data, 400)
    assert "maximum context length is 64" in err["message"] and err["param"] == "prompt"
    status, _, data = post(mock_server, {"prompt": list(range(1, 64))})
    assert status == 200 and json.loads(data)["usage"]["completion_tokens"] == 1


# ----------------------------------------------------------------------- API key
def test_empty_api_key_refuses_to_start(tiny_dir, monkeypatch):
    from lp_jax import serve

    with pytest.raises(ValueError, match="empty"):
        OpenAIServer(MockEngine(model_dir=tiny_dir), api_key=" ")
    monkeypatch.setattr(serve, "build_engine", lambda *a, **k: pytest.fail("engine built"))
    monkeypatch.setenv("LP_API_KEY", "")
    with pytest.raises(SystemExit, match="API key is empty"):
        serve.main(["--mock-engine"])
    monkeypatch.setenv("LP_API_KEY", "k")
    with pytest.raises(SystemExit, match="API key is empty"):
        serve.main(["--mock-engine", "--api-key", ""])


def test_api_key_guards_every_route_but_the_public_ones(tiny_dir):
    from lp_jax.serve import build_parser

    with start_server(MockEngine(model_dir=tiny_dir), api_key="k") as st_:
        routes = {(r.method, r.resource.canonical) for r in st_.server.make_app().router.routes()
                  if r.method != "HEAD"}
        help_text = " ".join(build_parser().format_help().split())
        for method, path in sorted(routes):
            status = request(st_.port, method, path, {})[0]
            if path in PUBLIC_PATHS:
                assert status == 200, path
            else:
                assert status == 401, path
                assert path in keyed_paths() and path in help_text
        assert {p for _, p in routes} - PUBLIC_PATHS == set(keyed_paths())
        assert request(st_.port, "HEAD", "/health")[0] == 200


# ------------------------------------------------------------------ the stats line
def test_one_stats_line_per_interval_at_most(tiny_dir, caplog):
    """Busy spells within one interval write no line each; a line covers them once the
    interval has passed (here after shortening it to 0.2 s), and lines stay an interval
    apart."""
    engine = MockEngine(model_dir=tiny_dir)
    with (caplog.at_level(logging.INFO, logger="lp_jax.server"),
          start_server(engine, log_stats_s=60.0) as st_):
        def lines():
            return [r for r in caplog.records if "generation throughput" in r.message]

        for _ in range(6):
            assert post(st_, {"prompt": "x", "max_tokens": 2})[0] == 200
            time.sleep(0.01)  # the engine goes idle between requests: a spell each
        assert lines() == []
        st_.server.engine_loop.log_stats_s = 0.2
        assert post(st_, {"prompt": "x", "max_tokens": 2})[0] == 200  # wakes the thread
        deadline = time.monotonic() + 5
        while not lines():
            assert time.monotonic() < deadline, "no stats line after the interval"
            time.sleep(0.02)
        time.sleep(0.5)  # idle: at most the busy spell's closing line follows
        times = [r.created for r in lines()]
        assert len(times) <= 2 and all(b - a >= 0.19 for a, b in zip(times[:-1], times[1:],
                                                                     strict=True))


# --------------------------------------------------------- the engine's interface
class _OnlyServed:
    """An engine that exposes ServedEngine's members and nothing else: the server must
    work through them alone."""

    _MEMBERS = frozenset(name for name in dir(ServedEngine) if not name.startswith("_")) | {
        "tokenizer", "model_dir", "slo_classes"}

    def __init__(self, engine):
        object.__setattr__(self, "_engine", engine)

    def __getattr__(self, name):
        if name not in self._MEMBERS:
            raise AttributeError(f"the server read {name!r}, outside ServedEngine")
        return getattr(self._engine, name)


def test_server_uses_only_the_served_engine_interface(tiny_dir):
    engine = MockEngine(model_dir=tiny_dir, max_model_len=64)
    assert isinstance(engine, ServedEngine)
    with start_server(_OnlyServed(engine), max_waiting=4, log_stats_s=0.05,
                      api_key="k") as st_:
        auth = {"Authorization": "Bearer k"}
        status, _, data = post(st_, {"prompt": ["x", "y"], "n": 2, "max_tokens": 3,
                                     "logprobs": 1}, headers=auth)
        assert status == 200 and len(json.loads(data)["choices"]) == 4, data[:300]
        status, _, data = post(st_, {"messages": [{"role": "user", "content": "x"}],
                                     "max_tokens": 2, "stream": True},
                               path="/v1/chat/completions", headers=auth)
        assert status == 200 and data.endswith(b"data: [DONE]\n\n")
        for method, path in (("GET", "/metrics"), ("POST", "/reset_prefix_cache"),
                             ("GET", "/health")):
            assert request(st_.port, method, path, {}, headers=auth)[0] == 200, path
        time.sleep(0.1)  # a stats line (limits, queue state and stats only)
        assert st_.server.engine_loop.healthy and engine.free_pages == engine.num_pages


# ------------------------------------------------------------------ the probe
def test_probe_short_finds_nothing(mock_server):
    """lp-bench --probe's CI version: every battery case gets its documented status, no
    5xx, no hang, every checked answer complete, the gauges back at 0."""
    from lp_jax.bench.probe import run_probe

    lines = []
    r = run_probe(mock_server.url, short=True, log=lines.append)
    assert r["findings"] == [], lines
    assert set(r["phases"]) == {"battery", "gzip bombs", "amplification", "oversized bodies",
                                "overload", "load with cuts", "soak"}
    assert r["battery_cases"] >= 40 and not any(r["gauges_end"].values())


def test_probe_reports_what_it_does_not_expect(mock_server):
    """The probe is no rubber stamp: an answer other than the expected status is a finding."""
    from lp_jax.bench.probe import Case, Probe

    probe = Probe(mock_server.url, short=True, log=lambda _: None)

    async def check():
        import aiohttp

        async with aiohttp.ClientSession() as s:
            return await probe._check(s, Case("a 404", "/nothing", b"", (200,),
                                              method="GET"), "self-test:")

    assert asyncio.run(check()) == 404
    assert probe.findings and "HTTP 404 (expected 200)" in probe.findings[0]
