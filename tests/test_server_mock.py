"""Server tests against the JAX-free MockEngine: protocol, errors, overload, crashes,
aborts, metrics format, and property tests of the request schema. Real HTTP on loopback."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time

import aiohttp
import pytest
from conftest import start_server
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from lp_jax.server.chat import ChatFormatter
from lp_jax.server.detok import IncrementalDetokenizer, TextAssembler
from lp_jax.server.mock import MockEngine
from lp_jax.server.prometheus import Registry, parse_text


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))


def request(st_, method, path, body=None, headers=None, raw: bytes | None = None,
            timeout=30.0):
    """(status, headers, body bytes) over a fresh loopback connection."""
    conn = http.client.HTTPConnection("127.0.0.1", st_.port, timeout=timeout)
    try:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def post(st_, path, body, **kw):
    status, headers, data = request(st_, "POST", path, body, **kw)
    return status, headers, data


def sse_chunks(data: bytes) -> list:
    events = [e for e in data.decode().split("\n\n") if e.strip()]
    assert all(e.startswith("data: ") for e in events), events
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[6:]) for e in events[:-1]]


def assert_error(status, data, expect_status=None):
    assert 400 <= status < 600, status
    if expect_status is not None:
        assert status == expect_status, (status, data)
    err = json.loads(data)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    return err


# ------------------------------------------------------------------ protocol basics
def test_completion_and_usage(mock_server):
    status, _, data = post(mock_server, "/v1/completions",
                           {"model": "mock", "prompt": [1, 2, 3], "max_tokens": 5})
    assert status == 200
    body = json.loads(data)
    assert body["object"] == "text_completion"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}


def test_stream_usage_in_last_chunk(mock_server):
    status, headers, data = post(mock_server, "/v1/completions",
                                 {"prompt": "hi there", "max_tokens": 4, "stream": True})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    chunks = sse_chunks(data)
    assert len(chunks) == 4  # one chunk per token
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in c for c in chunks)  # only with include_usage, as OpenAI
    # include_usage: OpenAI's extra final chunk with empty choices
    _, _, data = post(mock_server, "/v1/completions",
                      {"prompt": "hi", "max_tokens": 3, "stream": True,
                       "stream_options": {"include_usage": True}})
    chunks = sse_chunks(data)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] > 3
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_chat_stream_role_first(mock_server):
    _, _, data = post(mock_server, "/v1/chat/completions",
                      {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3,
                       "stream": True})
    chunks = sse_chunks(data)
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "role" not in chunks[1]["choices"][0]["delta"]


def test_stop_string_truncates(tiny_dir):
    # Tokens spell A, B, C, ... (byte tokens); stop at "CD" cuts the text before it.
    eng = MockEngine(model_dir=tiny_dir, max_model_len=64,
                     token_fn=lambda sid, i: eng.tokenizer.token_to_id("ABCDEFGH"[i % 8]))
    with start_server(eng) as st_:
        for stream in (False, True):
            status, _, data = post(st_, "/v1/completions",
                                   {"prompt": "x", "max_tokens": 8, "stop": ["CD", "zz"],
                                    "stream": stream})
            assert status == 200
            if stream:
                chunks = sse_chunks(data)
                text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
                last = chunks[-1]
            else:
                last = json.loads(data)
                text = last["choices"][0]["text"]
            assert text == "AB"
            assert last["choices"][0]["finish_reason"] == "stop"
            if not stream:
                assert last["usage"]["completion_tokens"] == 4  # up to the one ending "CD"
        # Stop token ids, as vLLM: the engine stops on them.
        stop_id = eng.tokenizer.token_to_id("C")
        _, _, data = post(st_, "/v1/completions",
                          {"prompt": "x", "max_tokens": 8, "stop_token_ids": [stop_id]})
        body = json.loads(data)
        assert body["choices"][0]["finish_reason"] == "stop"
        assert body["usage"]["completion_tokens"] == 3


def test_models_health_and_unknown_routes(mock_server):
    status, _, data = request(mock_server, "GET", "/v1/models")
    assert status == 200 and json.loads(data)["data"][0]["id"] == "mock"
    status, _, data = request(mock_server, "GET", "/health")
    assert status == 200
    status, _, data = request(mock_server, "GET", "/v1/nothing")
    assert_error(status, data, 404)
    status, _, data = request(mock_server, "GET", "/v1/completions")
    assert_error(status, data, 405)


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 10 ** 9}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "x", "n": 17}, "n"),  # over the server's max_n (16)
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "best_of": 2}, "best_of"),
    ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [1, 2, 100000]}, "prompt"),
    ({"prompt": [1, -2]}, "prompt"),
    ({"prompt": list(range(65))}, "prompt"),  # over max_model_len 64
    ({"prompt": ["a", ""]}, "prompt"),
    ({"prompt": ["a"] * 257}, "prompt"),  # over MAX_BATCH_PROMPTS
    ({}, "prompt"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "priority": 1.5}, "priority"),
    ({"prompt": "x", "ignore_eos": "yes"}, "ignore_eos"),
])
def test_bad_fields_are_400(mock_server, body, param):
    status, _, data = post(mock_server, "/v1/completions", body)
    err = assert_error(status, data, 400)
    assert err["param"] == param, err


def test_malformed_bodies(mock_server):
    for raw in (b"{", b"[1, 2]", b"null", b'{"prompt": NaN}', b"\xff\xfe", b"[" * 100000):
        status, _, data = post(mock_server, "/v1/completions", None, raw=raw)
        assert_error(status, data, 400)
    status, _, data = post(mock_server, "/v1/chat/completions", {"messages": []})
    assert_error(status, data, 400)
    status, _, data = post(mock_server, "/v1/chat/completions",
                           {"messages": [{"role": "user", "content": [{"type": "image"}]}]})
    assert_error(status, data, 400)
    status, _, data = post(mock_server, "/v1/completions", {"model": "other", "prompt": "x"})
    err = assert_error(status, data, 404)
    assert err["code"] == "model_not_found"


def test_api_key(tiny_dir):
    with start_server(MockEngine(model_dir=tiny_dir), api_key="sekret") as st_:
        status, _, data = post(st_, "/v1/completions", {"prompt": "x", "max_tokens": 1})
        assert assert_error(status, data, 401)["type"] == "authentication_error"
        status, _, data = post(st_, "/v1/completions", {"prompt": "x", "max_tokens": 1},
                               headers={"Authorization": "Bearer wrong"})
        assert status == 401
        status, _, _ = post(st_, "/v1/completions", {"prompt": "x", "max_tokens": 1},
                            headers={"Authorization": "Bearer sekret"})
        assert status == 200
        assert request(st_, "GET", "/health")[0] == 200  # no key needed


# -------------------------------------------------------------- overload and crashes
def test_503_when_waiting_queue_full(tiny_dir):
    # Admits nothing, ever: one request takes the free slot, two more wait.
    eng = MockEngine(model_dir=tiny_dir, progress=False, max_num_seqs=1)
    with start_server(eng, max_waiting=2) as st_:
        async def scenario():
            url = f"{st_.url}/v1/completions"
            async with aiohttp.ClientSession() as s:
                async def hang():
                    async with s.post(url, json={"prompt": "x", "max_tokens": 2}) as r:
                        return r.status

                tasks = [asyncio.create_task(hang()) for _ in range(3)]
                for _ in range(200):
                    if st_.server.engine_loop.num_waiting == 2:
                        break
                    await asyncio.sleep(0.01)
                assert st_.server.engine_loop.num_waiting == 2
                async with s.post(url, json={"prompt": "x", "max_tokens": 2}) as r:
                    assert r.status == 503
                    assert int(r.headers["Retry-After"]) >= 1
                    assert (await r.json())["error"]["code"] == "overloaded"
                async with s.get(f"{st_.url}/metrics") as r:
                    m = parse_text(await r.text())
                assert m['lp:num_requests_waiting{model_name="mock"}'] == 3
                assert m['lp:request_rejected_total{model_name="mock",reason="overloaded"}'] == 1
                for t in tasks:  # clients give up: the server aborts their requests
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run(scenario())
        for _ in range(200):
            if st_.server.engine_loop.num_unadmitted == 0 and not eng.waiting:
                break
            time.sleep(0.01)
        assert st_.server.engine_loop.num_unadmitted == 0
        assert st_.engine_call(lambda e: e.stats()["aborted"]) == 3


def test_engine_crash_fails_every_request(tiny_dir):
    eng = MockEngine(model_dir=tiny_dir, step_delay=0.01, fail_at_step=20)
    with start_server(eng) as st_:
        results = {}

        def go(name, stream):
            results[name] = post(st_, "/v1/completions",
                                 {"prompt": "x", "max_tokens": 1000, "stream": stream})

        threads = [threading.Thread(target=go, args=(n, n == "stream"))
                   for n in ("plain", "stream")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        status, _, data = results["plain"]
        assert assert_error(status, data, 500)["code"] == "engine_dead"
        status, _, data = results["stream"]
        assert status == 200  # headers went out with the first token
        events = [e for e in data.decode().split("\n\n") if e.strip()]
        assert events[-1] == "data: [DONE]"
        assert "error" in json.loads(events[-2][6:])
        status, _, data = request(st_, "GET", "/health")
        assert status == 503 and json.loads(data)["status"] == "unhealthy"
        status, _, data = post(st_, "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert_error(status, data, 500)
        status, _, data = request(st_, "GET", "/metrics")
        assert status == 200
        assert parse_text(data.decode())['lp:engine_healthy{model_name="mock"}'] == 0


def test_disconnect_aborts_and_frees_pages(tiny_dir):
    eng = MockEngine(model_dir=tiny_dir, step_delay=0.002, num_pages=1000)
    with start_server(eng) as st_:
        async def scenario():
            async with aiohttp.ClientSession() as s:
                # streamed: read two chunks, then drop the connection
                r = await s.post(f"{st_.url}/v1/completions",
                                 json={"prompt": "x", "max_tokens": 3000, "stream": True})
                await r.content.readline()
                await r.content.readline()
                r.close()
                # not streamed: give up after a moment
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(
                        s.post(f"{st_.url}/v1/completions",
                               json={"prompt": "x", "max_tokens": 3000}), 0.1)

        asyncio.run(scenario())
        for _ in range(500):
            stats = st_.engine_call(lambda e: e.stats())
            if stats["aborted"] == 2 and stats["free_pages"] == stats["total_pages"]:
                break
            time.sleep(0.01)
        assert stats["aborted"] == 2
        assert stats["free_pages"] == stats["total_pages"]
        m = parse_text(request(st_, "GET", "/metrics")[2].decode())
        assert m['lp:request_success_total{model_name="mock",finished_reason="abort"}'] == 2
        assert m['lp:kv_cache_usage_perc{model_name="mock"}'] == 0


# ------------------------------------------------------------------ property tests
_FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
           "top_p", "top_k", "seed", "stop", "stop_token_ids", "n", "stream", "stream_options",
           "logprobs", "priority", "ignore_eos", "echo", "best_of", "presence_penalty",
           "response_format", "tools", "user", "add_generation_prompt"]
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2 ** 70), 2 ** 70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=12)
_plausible = {
    "model": st.sampled_from(["mock", "other", ""]) | _json,
    "prompt": st.text(max_size=30) | st.lists(st.integers(-5, 600), max_size=70) | _json,
    "messages": st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant"]) | _json,
         "content": st.text(max_size=20) | _json}), max_size=3) | _json,
    "max_tokens": st.integers(-3, 100) | _json,
    "temperature": st.floats(-1, 3) | _json,
    "top_k": st.integers(-2, 2 ** 40) | _json,
    "stream": st.booleans() | _json,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | _json,
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3) | _json,
}
_bodies = st.dictionaries(
    st.sampled_from(_FIELDS) | st.text(max_size=6),
    _json, max_size=8,
).flatmap(lambda d: st.fixed_dictionaries(
    {k: (_plausible.get(k, st.just(v))) for k, v in d.items()}))


def _check_response(status, headers, data):
    event(f"status {status}")
    assert 200 <= status < 500, (status, data[:300])
    if status == 200:
        if headers.get("Content-Type", "").startswith("text/event-stream"):
            events = [e for e in data.decode().split("\n\n") if e.strip()]
            assert events[-1] == "data: [DONE]"
            chunks = [json.loads(e[6:]) for e in events[:-1]]
            assert chunks
        else:
            body = json.loads(data)
            assert body["choices"] and body["usage"]["completion_tokens"] >= 1
    else:
        assert_error(status, data)


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(body=_bodies, path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_arbitrary_bodies_never_crash(mock_server, body, path):
    _check_response(*post(mock_server, path, body))


_VALID = {"/v1/completions": {"prompt": "hello", "max_tokens": 3},
          "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}],
                                   "max_tokens": 3}}
_overrides = st.lists(st.sampled_from(_FIELDS), max_size=3, unique=True).flatmap(
    lambda keys: st.fixed_dictionaries({k: _plausible.get(k, _json) for k in keys}))


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(over=_overrides, path=st.sampled_from(sorted(_VALID)))
def test_mutated_valid_bodies_never_crash(mock_server, over, path):
    _check_response(*post(mock_server, path, {**_VALID[path], **over}))


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=200) | _json.map(lambda v: json.dumps(v).encode()))
def test_arbitrary_bytes_never_crash(mock_server, raw):
    _check_response(*post(mock_server, "/v1/completions", None, raw=raw))


def test_still_healthy_after_fuzzing(mock_server):
    assert request(mock_server, "GET", "/health")[0] == 200
    status, _, data = post(mock_server, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert status == 200
    assert mock_server.server.engine_loop.healthy


# --------------------------------------------------------------------- units
def test_detokenizer_matches_full_decode(tokenizer):
    text = "Héllo wörld — naïve café ☕ 日本語 text"
    ids = tokenizer.encode(text).ids
    d = IncrementalDetokenizer(tokenizer, prompt_token_ids=[])
    out = "".join(d.add([t]) for t in ids) + d.flush()
    assert out == tokenizer.decode(ids)
    # split multi-byte characters are held back, never shown as U+FFFD
    d = IncrementalDetokenizer(tokenizer)
    pieces = [d.add([t]) for t in ids]
    assert all("\ufffd" not in p for p in pieces)


def test_text_assembler_holds_partial_stop(tokenizer):
    ids = tokenizer.encode("one two three four").ids
    asm = TextAssembler(tokenizer, [], stop=("three",))
    sent = ""
    for t in ids:
        sent += asm.push([t])
        assert "thr" not in sent or asm.stopped
        if asm.stopped:
            break
    sent += asm.finish()
    assert asm.stopped and sent == "one two " and asm.text == sent


def test_chat_fallbacks(tokenizer):
    msgs = [{"role": "user", "content": "hi"}]
    assert ChatFormatter(None, {}, tokenizer).render(msgs) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert ChatFormatter(None, {}, None).render(msgs) == "user: hi\nassistant:"
    f = ChatFormatter("{{ raise_exception('no') }}", {})
    with pytest.raises(ValueError):
        f.render(msgs)


def test_prometheus_format():
    r = Registry({"model_name": 'a"b'})
    c = r.counter("lp:x_total", "help", ("k",))
    c.inc(2, k="v")
    h = r.histogram("lp:h_seconds", "h", (0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 3.0):
        h.observe(v)
    text = r.render()
    assert "# TYPE lp:x_total counter" in text and "# TYPE lp:h_seconds histogram" in text
    m = parse_text(text)
    assert m['lp:x_total{model_name="a\\"b",k="v"}'] == 2
    assert m['lp:h_seconds_bucket{model_name="a\\"b",le="0.1"}'] == 2  # le is inclusive
    assert m['lp:h_seconds_bucket{model_name="a\\"b",le="1"}'] == 3
    assert m['lp:h_seconds_bucket{model_name="a\\"b",le="+Inf"}'] == 4
    assert m['lp:h_seconds_count{model_name="a\\"b"}'] == 4
    assert m['lp:h_seconds_sum{model_name="a\\"b"}'] == pytest.approx(3.65)
    with pytest.raises(ValueError):
        c.inc(-1, k="v")
