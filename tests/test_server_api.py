"""End to end: the official `openai` client against lp-serve running the real tiny model.

One session-scoped server (the engine compiles in a few seconds) on a free loopback port,
served from a background thread.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import aiohttp
import openai
import pytest

from lp_jax.server import OpenAIServer, ServerThread
from lp_jax.server.prometheus import parse_text

MODEL = "tiny"
REQUIRED_METRICS = [
    "lp:time_to_first_token_seconds", "lp:inter_token_latency_seconds",
    "lp:e2e_request_latency_seconds", "lp:request_queue_time_seconds",
    "lp:num_requests_running", "lp:num_requests_waiting", "lp:kv_cache_usage_perc",
    "lp:prompt_tokens_total", "lp:generation_tokens_total", "lp:iterations_total",
    "lp:expert_bytes_loaded_total", "lp:compilations_after_warmup", "lp:request_success_total",
]


@pytest.fixture(scope="session")
def server(tiny_dir):
    from lp_jax.engine.config import EngineConfig
    from lp_jax.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(
        model=str(tiny_dir), scheduling="chunked", max_num_seqs=8, max_model_len=256,
        max_num_batched_tokens=256,
        token_buckets=(8, 64, 256), compilation_cache_dir=None), log=None)
    st = ServerThread(OpenAIServer(engine, served_model_names=[MODEL], max_waiting=1000))
    st.start()
    yield st
    st.stop()


@pytest.fixture(scope="session")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                         timeout=60)


def metrics(server) -> dict[str, float]:
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as r:
        return parse_text(r.read().decode())


def wait_idle(server, timeout=20.0) -> dict:
    """Engine stats once nothing runs and every KV page is free again."""
    deadline = time.monotonic() + timeout
    while True:
        stats = server.engine_call(lambda e: e.stats())
        idle = server.engine_call(lambda e: not e.has_unfinished())
        if idle and stats["free_pages"] == stats["total_pages"]:
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.02)


def test_completion_stream_matches_non_stream(client):
    kw = dict(model=MODEL, prompt="The engine serves", max_tokens=12, temperature=0,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    assert full.object == "text_completion"
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 12
    assert full.usage.total_tokens == full.usage.prompt_tokens + 12
    chunks = list(client.completions.create(stream=True, **kw))
    assert len(chunks) == 12  # one chunk per token
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 12  # usage ends every stream


def test_token_id_prompt_and_include_usage(client):
    chunks = list(client.completions.create(
        model=MODEL, prompt=[5, 6, 7, 8], max_tokens=5, temperature=0.8, seed=3, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[-1].choices == []
    assert chunks[-1].usage.prompt_tokens == 4 and chunks[-1].usage.completion_tokens == 5


def test_chat(client):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    resp = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant"
    assert resp.usage.completion_tokens == 6
    # The prompt went through the ChatML template of tokenizer_config.json.
    assert resp.usage.prompt_tokens > 6
    stream = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6,
                                            temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == resp.choices[0].message.content


def test_stop_string_on_detokenized_text(client):
    kw = dict(model=MODEL, prompt="Rain falls on the", max_tokens=20, temperature=0,
              extra_body={"ignore_eos": True})
    text = client.completions.create(**kw).choices[0].text
    visible = text.replace("\ufffd", "")
    if len(visible) < 8:
        pytest.skip(f"greedy output too short to pick a stop string: {text!r}")
    stop = visible[4:6]
    resp = client.completions.create(stop=[stop], **kw)
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].text == text[:text.find(stop)]
    assert resp.usage.completion_tokens < 20


def test_errors_through_openai_client(client):
    with pytest.raises(openai.BadRequestError, match="n"):
        client.completions.create(model=MODEL, prompt="x", n=2)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=MODEL, prompt=[1] * 300, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="log-probabilities"):
        client.completions.create(model=MODEL, prompt="x", logprobs=2)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x")
    assert client.models.list().data[0].id == MODEL


def test_200_concurrent_requests(server):
    """200 requests at concurrency 32, half streamed, all complete with the right counts."""
    aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused",
                                 max_retries=0, timeout=60)

    async def one(i, sem):
        n = 2 + i % 5
        async with sem:
            if i % 2:
                toks = 0
                stream = await aclient.completions.create(
                    model=MODEL, prompt=f"request {i}", max_tokens=n, stream=True,
                    extra_body={"ignore_eos": True, "priority": i % 3})
                async for chunk in stream:
                    if chunk.usage:
                        toks = chunk.usage.completion_tokens
                return toks == n
            resp = await aclient.completions.create(
                model=MODEL, prompt=[i % 500 + 1, 2, 3], max_tokens=n, temperature=0.7,
                seed=i, extra_body={"ignore_eos": True})
            return resp.usage.completion_tokens == n

    async def main():
        sem = asyncio.Semaphore(32)
        try:
            return await asyncio.gather(*(one(i, sem) for i in range(200)))
        finally:
            await aclient.close()

    before = metrics(server)
    t0 = time.perf_counter()
    ok = asyncio.run(main())
    elapsed = time.perf_counter() - t0
    assert all(ok) and len(ok) == 200
    assert elapsed < 60
    after = metrics(server)
    key = 'lp:request_success_total{model_name="tiny",finished_reason="length"}'
    assert after[key] - before[key] == 200
    wait_idle(server)


def test_disconnect_mid_stream_frees_pages(server):
    before = wait_idle(server)

    async def scenario():
        async with aiohttp.ClientSession() as s:
            r = await s.post(f"{server.url}/v1/completions",
                             json={"model": MODEL, "prompt": "abort me", "max_tokens": 240,
                                   "ignore_eos": True, "stream": True})
            assert r.status == 200
            for _ in range(3):
                await r.content.readuntil(b"\n\n")
            running = server.engine_call(lambda e: len(e.scheduler.running))
            r.close()  # drop the connection mid-stream
            # and a non-streamed request the client gives up on
            task = asyncio.create_task(s.post(
                f"{server.url}/v1/completions",
                json={"model": MODEL, "prompt": "me too", "max_tokens": 240,
                      "ignore_eos": True}))
            await asyncio.sleep(0.3)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return running

    assert asyncio.run(scenario()) == 1
    after = wait_idle(server)
    assert after["aborted"] - before["aborted"] == 2
    assert after["free_pages"] == after["total_pages"]
    m = metrics(server)
    assert m['lp:kv_cache_usage_perc{model_name="tiny"}'] == 0
    assert m['lp:num_requests_running{model_name="tiny"}'] == 0


def test_metrics_exposition(server, client):
    client.completions.create(model=MODEL, prompt="metrics", max_tokens=3)
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as r:
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = r.read().decode()
    for name in REQUIRED_METRICS:
        assert f"# TYPE {name} " in text, name
    m = parse_text(text)
    assert m['lp:compilations_after_warmup{model_name="tiny"}'] == 0
    assert m['lp:time_to_first_token_seconds_count{model_name="tiny"}'] >= 1
    assert m['lp:time_to_first_token_seconds_bucket{model_name="tiny",le="+Inf"}'] == \
        m['lp:time_to_first_token_seconds_count{model_name="tiny"}']
    assert m['lp:request_queue_time_seconds_count{model_name="tiny"}'] >= 1
    assert m['lp:iterations_total{model_name="tiny",phase="decode"}'] > 0
    assert m['lp:expert_bytes_loaded_total{model_name="tiny"}'] > 0
    assert m['lp:generation_tokens_total{model_name="tiny"}'] >= 3
    with urllib.request.urlopen(f"{server.url}/health", timeout=30) as r:
        assert json.loads(r.read())["status"] == "ok"


def test_huge_top_k_is_clamped(client, server):
    # SamplingParams accepts any top_k, but the runner packs it into int32: the server
    # clamps top_k >= vocab_size to "disabled" so such a request cannot kill the engine.
    resp = client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=1.0,
                                     extra_body={"top_k": 2 ** 40, "ignore_eos": True})
    assert resp.usage.completion_tokens == 2
    assert server.server.engine_loop.healthy
