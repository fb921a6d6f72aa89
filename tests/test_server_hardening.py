"""Server hardening (issue #19), against the JAX-free MockEngine over loopback HTTP:
size limits, admission counting, surrogates, read timeouts, authentication, disconnect
logging, abort counting, seeds, parser-level errors and draining on SIGTERM."""

from __future__ import annotations

import asyncio
import hmac
import http.client
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import aiohttp
import pytest
from conftest import start_server

from lp_jax.server import OpenAIServer, ServerThread
from lp_jax.server.mock import MockEngine
from lp_jax.server.prometheus import parse_text
from lp_jax.server.protocol import MAX_STOP_TOKEN_IDS, parse_completion

ROOT = Path(__file__).resolve().parents[1]


def request(port, method, path, body=None, headers=None, raw: bytes | None = None):
    """(status, headers, body bytes) over a fresh loopback connection."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        conn.request(method, path, body=data,
                     headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def post(st_, body, path="/v1/completions", **kw):
    return request(st_.port, "POST", path, body, **kw)


def error_of(status, data, expect_status):
    assert status == expect_status, (status, data[:300])
    err = json.loads(data)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def metric(st_, key: str) -> float:
    return parse_text(st_.server.metrics.render()).get(key, 0.0)


def wait_for(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def raw_exchange(port, data: bytes, timeout=5.0) -> bytes:
    """Sends `data` on a raw socket; returns what comes back before the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
        return out


def http_parts(reply: bytes) -> tuple[int, bytes]:
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


class SpyTokenizer:
    """The tiny model's tokenizer, counting the calls that tokenize and their seconds."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self.calls = 0
        self.seconds = 0.0

    def encode(self, *args, **kw):
        return self._count(self._tok.encode, args, kw)

    def encode_batch(self, *args, **kw):
        return self._count(self._tok.encode_batch, args, kw)

    def _count(self, fn, args, kw):
        self.calls += 1
        t0 = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            self.seconds += time.perf_counter() - t0

    def __getattr__(self, name):
        return getattr(self._tok, name)


# ---------------------------------------------------------------- 1. prompt size
def test_prompt_of_max_model_len_widest_tokens_passes(tiny_dir):
    eng = MockEngine(model_dir=tiny_dir, max_model_len=2048)
    with start_server(eng) as st_:
        texts = eng.tokenizer.decode_batch([[i] for i in range(eng.tokenizer.get_vocab_size())],
                                           skip_special_tokens=False)
        widest = max(texts, key=lambda t: len(json.dumps(t)))
        # ensure_ascii: the widest way to write it (each non-ASCII byte as a \u escape)
        raw = json.dumps({"prompt": widest * 2048}).encode()
        status, _, data = post(st_, None, raw=raw)
        # Read and tokenized (no 413): a full context leaves no room for an output token.
        err = error_of(status, data, 400)
        assert "maximum context length is 2048" in err["message"]
        assert "the prompt has 2048" in err["message"] and err["param"] == "prompt"
        raw = json.dumps({"prompt": widest * 2047}).encode()
        status, _, data = post(st_, None, raw=raw)
        assert status == 200, data[:300]
        assert json.loads(data)["usage"]["prompt_tokens"] == 2047


def test_oversized_prompt_refused_before_tokenizing(tiny_dir):
    with start_server(MockEngine(model_dir=tiny_dir, max_model_len=64)) as st_:
        srv = st_.server
        srv.tokenizer = spy = SpyTokenizer(srv.tokenizer)
        assert srv.max_body_bytes < 2 * 2 ** 20  # not 32 MiB: what 64 tokens can use
        status, _, data = post(st_, {"prompt": "a" * (srv.max_prompt_bytes + 1)})
        assert error_of(status, data, 400)["param"] == "prompt"
        status, _, data = post(st_, {"messages": [{"role": "user", "content": "é" * (
            srv.max_prompt_bytes // 2)}]}, path="/v1/chat/completions")
        assert error_of(status, data, 400)["param"] == "messages"
        status, _, data = post(st_, None, raw=b" " * (srv.max_body_bytes + 1))
        assert error_of(status, data, 413)["code"] == "request_too_large"
        assert spy.calls == 0
        status, _, _ = post(st_, {"prompt": "a" * 20, "max_tokens": 1})
        assert status == 200 and spy.calls == 1


def test_tokenizing_runs_off_the_event_loop(tiny_dir):
    # A prompt of about 1 MB takes the tiny tokenizer over a second. /health must keep
    # answering meanwhile: neither the event loop nor the GIL may be held that long.
    with start_server(MockEngine(model_dir=tiny_dir, max_model_len=2 ** 20)) as st_:
        st_.server.tokenizer = spy = SpyTokenizer(st_.server.tokenizer)

        async def scenario():
            async with aiohttp.ClientSession() as s:
                slow = asyncio.create_task(s.post(f"{st_.url}/v1/completions", json={
                    "prompt": "hello world " * 120000, "max_tokens": 1}))
                gaps, last = [], time.perf_counter()
                while not slow.done():
                    async with s.get(f"{st_.url}/health") as r:
                        assert r.status == 200
                    gaps.append(time.perf_counter() - last)
                    last = time.perf_counter()
                    await asyncio.sleep(0.01)
                assert (await slow).status == 200
                return max(gaps)

        worst_gap = asyncio.run(scenario())
        assert spy.calls == 1 and spy.seconds > 0.5 and worst_gap < spy.seconds / 2


# ------------------------------------------------------------ 2. admission count
async def _burst(st_, n: int, *, stuck: bool = False) -> list[int]:
    """Sends n requests at once; returns the statuses of those answered. `stuck`: the engine
    admits nothing, so wait until each request is answered or queued, then cancel the rest."""
    url = f"{st_.url}/v1/completions"
    async with aiohttp.ClientSession() as session:
        async def one():
            async with session.post(url, json={"prompt": "x", "max_tokens": 2}) as r:
                return r.status

        tasks = [asyncio.create_task(one()) for _ in range(n)]
        if not stuck:
            return await asyncio.gather(*tasks)
        for _ in range(500):
            if sum(t.done() for t in tasks) + st_.server.engine_loop.num_unadmitted == n:
                break
            await asyncio.sleep(0.01)
        for t in tasks:
            t.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        return [r for r in results if isinstance(r, int)]


def test_burst_within_free_slots_gets_no_503(tiny_dir):
    eng = MockEngine(model_dir=tiny_dir, progress=False, max_num_seqs=8)
    with start_server(eng, max_waiting=1) as st_:
        assert asyncio.run(_burst(st_, 8, stuck=True)) == []


def test_burst_beyond_slots_and_queue_gets_503_for_the_excess(tiny_dir):
    eng = MockEngine(model_dir=tiny_dir, progress=False, max_num_seqs=4)
    with start_server(eng, max_waiting=2) as st_:
        assert asyncio.run(_burst(st_, 4 + 2 + 3, stuck=True)) == [503] * 3


def test_burst_at_idle_progressing_server_gets_no_503(tiny_dir):
    eng = MockEngine(model_dir=tiny_dir, max_num_seqs=16, step_delay=0.002)
    with start_server(eng, max_waiting=1) as st_:
        for _ in range(3):
            assert asyncio.run(_burst(st_, 16)) == [200] * 16


# ------------------------------------------------------ 3. lone UTF-16 surrogates
@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", '{"model": "\\ud800", "prompt": "x"}', "model"),
    ("/v1/completions", '{"prompt": "a\\udfffb"}', "prompt"),
    ("/v1/completions", '{"prompt": "x", "stop": ["\\ud83d"]}', "stop"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\udc00"}]}',
     "messages"),
    ("/v1/chat/completions", '{"messages": [{"role": "\\ud800", "content": "x"}]}',
     "messages"),
])
def test_lone_surrogates_are_400(mock_server, caplog, path, body, param):
    status, _, data = post(mock_server, None, path=path, raw=body.encode())
    assert error_of(status, data, 400)["param"] == param
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_surrogate_pairs_are_text(mock_server):
    status, _, data = post(mock_server, None, raw=b'{"prompt": "\\ud83d\\ude00", "max_tokens": 1}')
    assert status == 200, data


# ------------------------------------------------------------- 4. stop_token_ids
def test_stop_token_ids_capped_deduplicated_and_named(mock_server):
    ok = list(range(MAX_STOP_TOKEN_IDS))
    assert post(mock_server, {"prompt": "x", "max_tokens": 1, "stop_token_ids": ok})[0] == 200
    status, _, data = post(mock_server, {"prompt": "x", "stop_token_ids": ok + [1]})
    assert error_of(status, data, 400)["param"] == "stop_token_ids"
    status, _, data = post(mock_server, {"prompt": "x", "stop_token_ids": [5, 100000]})
    err = error_of(status, data, 400)
    assert err["param"] == "stop_token_ids" and "100000" in err["message"]
    assert parse_completion({"prompt": "x", "stop_token_ids": [3, 3, 4]}).stop_token_ids == {3, 4}


# -------------------------------------------------------------- 5. read timeouts
def test_body_slower_than_read_timeout_gets_408(tiny_dir):
    with start_server(MockEngine(model_dir=tiny_dir), read_timeout=0.5) as st_:
        t0 = time.perf_counter()
        with socket.create_connection(("127.0.0.1", st_.port), timeout=5) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
                         b'{"prompt":')
            reply = sock.recv(65536)
        elapsed = time.perf_counter() - t0
        status, body = http_parts(reply)
        assert status == 408 and json.loads(body)["error"]["code"] == "request_timeout"
        assert 0.5 <= elapsed < 3.0


def test_headers_slower_than_read_timeout_are_dropped(tiny_dir):
    with start_server(MockEngine(model_dir=tiny_dir), read_timeout=0.5) as st_:
        t0 = time.perf_counter()
        with socket.create_connection(("127.0.0.1", st_.port), timeout=5) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            sock.settimeout(0.1)
            closed = False
            while not closed and time.perf_counter() - t0 < 4.0:
                try:
                    sock.sendall(b"X-Slow: 1\r\n")  # one header line at a time (slowloris)
                    closed = sock.recv(1) == b""
                except TimeoutError:
                    pass
                except OSError:  # reset: closed as well
                    closed = True
        assert closed and time.perf_counter() - t0 < 3.0


# --------------------------------------------------------------- 6. authentication
def test_api_key_scheme_compare_and_metrics(tiny_dir, monkeypatch):
    compared = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: compared.append(1) or real(a, b))
    body = {"prompt": "x", "max_tokens": 1}
    with start_server(MockEngine(model_dir=tiny_dir), api_key="sekret") as st_:
        for auth in ("Bearer sekret", "bearer sekret", "BEARER  sekret"):
            assert post(st_, body, headers={"Authorization": auth})[0] == 200, auth
        for auth in ("Bearer sekret2", "Basic sekret", "sekret", "Bearer \xff"):
            assert post(st_, body, headers={"Authorization": auth})[0] == 401, auth
        assert compared
        status, _, data = request(st_.port, "GET", "/metrics")
        assert error_of(status, data, 401)["type"] == "authentication_error"
        assert request(st_.port, "GET", "/metrics",
                       headers={"Authorization": "Bearer sekret"})[0] == 200
        assert request(st_.port, "GET", "/health")[0] == 200
    with start_server(MockEngine(model_dir=tiny_dir), api_key="sekret",
                      metrics_public=True) as st_:
        assert request(st_.port, "GET", "/metrics")[0] == 200
        assert post(st_, body)[0] == 401


def test_models_do_not_reveal_the_model_path(tiny_dir):
    with ServerThread(OpenAIServer(MockEngine(model_dir=tiny_dir))) as st_:
        status, _, data = request(st_.port, "GET", "/v1/models")
        assert status == 200 and json.loads(data)["data"][0]["id"] == tiny_dir.name
        assert str(tiny_dir.parent).encode() not in data


# -------------------------------------------------- 7, 8. disconnects and aborts
def test_disconnect_is_one_info_line(tiny_dir, caplog):
    caplog.set_level(logging.INFO)
    # Tokens flow without pause, so some disconnects surface as a failed write and others
    # as aiohttp cancelling the handler; both must log one line.
    eng = MockEngine(model_dir=tiny_dir)
    with start_server(eng) as st_:
        async def scenario():
            async with aiohttp.ClientSession() as s:
                for i in range(20):
                    r = await s.post(f"{st_.url}/v1/completions",
                                     json={"prompt": "x", "max_tokens": 3000, "stream": True})
                    for _ in range(i % 5 + 1):
                        await r.content.readline()
                    r.close()

        asyncio.run(scenario())
        wait_for(lambda: metric(st_, 'lp:request_success_total{model_name="mock",'
                                     'finished_reason="abort"}') == 20)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    lines = [r for r in caplog.records if "client disconnected" in r.getMessage()]
    assert len(lines) == 20 and all(r.levelno == logging.INFO and not r.exc_info
                                    for r in lines)


def test_abort_counted_when_client_leaves_before_submission(tiny_dir):
    gate = threading.Event()
    # The engine thread blocks inside its first step until the gate opens, so a second
    # request's add command stays queued: its client leaves before it is submitted.
    eng = MockEngine(model_dir=tiny_dir, token_fn=lambda sid, i: gate.wait(10) and 65)
    abort_key = 'lp:request_success_total{model_name="mock",finished_reason="abort"}'
    with start_server(eng) as st_:
        async def scenario():
            async with aiohttp.ClientSession() as s:
                url = f"{st_.url}/v1/completions"
                first = asyncio.create_task(s.post(url, json={"prompt": "a", "max_tokens": 2}))
                while not eng.running:
                    await asyncio.sleep(0.01)
                second = asyncio.create_task(s.post(url, json={"prompt": "b", "max_tokens": 2}))
                while st_.server.engine_loop.num_unadmitted < 2:  # the first counts until
                    await asyncio.sleep(0.01)  # its step ends
                second.cancel()
                await asyncio.gather(second, return_exceptions=True)
                for _ in range(200):
                    if metric(st_, abort_key) == 1:
                        break
                    await asyncio.sleep(0.01)
                aborted = metric(st_, abort_key)
                gate.set()
                assert (await first).status == 200
                return aborted

        assert asyncio.run(scenario()) == 1


# ------------------------------------------------------------------------ 9. seeds
@pytest.mark.parametrize("seed,status", [(0, 200), (42 + 2 ** 31, 200), (-1, 200),
                                         (2 ** 63 - 1, 200), (2 ** 63, 400), ("7", 400)])
def test_seeds_are_int64(mock_server, seed, status):
    """Every int64 is a seed (the sampler keys on all 64 bits: test_sampler checks that
    42 and 42 + 2**31 draw differently); anything else is a 400 naming the field."""
    got, _, data = post(mock_server, {"prompt": "x", "max_tokens": 1, "seed": seed})
    if status == 400:
        assert error_of(got, data, 400)["param"] == "seed"
    assert got == status


# ---------------------------------------------------------- 10. error bodies
@pytest.mark.parametrize("raw", [
    b"GARBAGE\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nbad header\r\n\r\n",
])
def test_parser_level_errors_are_openai_json(mock_server, caplog, raw):
    status, body = http_parts(raw_exchange(mock_server.port, raw))
    assert status == 400
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "application/json", "multipart/form-data"])
def test_body_is_json_whatever_the_content_type(mock_server, content_type):
    hdrs = {"Content-Type": content_type}
    status, _, data = post(mock_server, None, raw=b"prompt=hello", headers=hdrs)
    assert error_of(status, data, 400)["type"] == "invalid_request_error"
    status, _, _ = post(mock_server, {"prompt": "hello", "max_tokens": 1}, headers=hdrs)
    assert status == 200


# --------------------------------------------------------------- 11. SIGTERM
_SERVE = """
import sys
from lp_jax import serve
from lp_jax.server.mock import MockEngine
serve.build_engine = lambda args, log=print: MockEngine(model_dir=args.model, step_delay=0.01)
serve.main(sys.argv[1:])
"""


def test_sigterm_drains_in_flight_requests_and_exits_0(tiny_dir):
    env = dict(os.environ, LP_API_KEY="sekret", PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVE, "--mock-engine", "--model", str(tiny_dir), "--port", "0",
         "--shutdown-grace", "20"], env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:
            if m := re.search(r"serving .* on http://127\.0\.0\.1:(\d+)", line):
                port = int(m.group(1))
                break
        else:
            pytest.fail(f"lp-serve exited with {proc.wait()}")
        key = {"Authorization": "Bearer sekret"}
        assert request(port, "GET", "/v1/models")[0] == 401  # LP_API_KEY
        status, _, data = request(port, "GET", "/v1/models", headers=key)
        assert json.loads(data)["data"][0]["id"] == tiny_dir.name
        assert str(tiny_dir.parent).encode() not in data

        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("POST", "/v1/completions", headers={**key, "Content-Type": "application/json"},
                     body=json.dumps({"prompt": "x", "max_tokens": 100, "ignore_eos": True,
                                      "stream": True}))
        stream = conn.getresponse()
        first = stream.readline()
        assert first.startswith(b"data: ")
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: request(port, "GET", "/health")[0] == 503)
        status, headers, data = request(port, "POST", "/v1/completions",
                                        {"prompt": "x", "max_tokens": 1}, headers=key)
        assert error_of(status, data, 503)["code"] == "shutting_down"
        assert "Retry-After" in headers
        chunks = [e for e in (first + stream.read()).decode().split("\n\n") if e.strip()]
        conn.close()
        assert chunks[-1] == "data: [DONE]"
        last = json.loads(chunks[-2][6:])
        assert last["choices"][0]["finish_reason"] == "length"
        assert len(chunks) - 1 == 100  # every token's chunk, then [DONE]
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
