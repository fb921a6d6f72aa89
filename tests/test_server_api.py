"""End to end: the official `openai` client against lp-serve running the real tiny model.

One session-scoped server (the engine compiles in a few seconds) on a free loopback port,
served from a background thread.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import urllib.request

import aiohttp
import numpy as np
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


@pytest.fixture(scope="module")
def server(engines):
    engine = engines("chunked").engine  # the run's shared chunked engine
    assert not engine.has_unfinished() and engine.reset_prefix_cache()
    st = ServerThread(OpenAIServer(engine, served_model_names=[MODEL], max_waiting=1000,
                                   log_stats_s=0.2))
    st.start()
    yield st
    st.stop()


@pytest.fixture(scope="module")
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
    assert all(c.usage is None for c in chunks)  # only with include_usage, as OpenAI


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
    with pytest.raises(openai.BadRequestError, match="'n' must be at most 16"):
        client.completions.create(model=MODEL, prompt="x", n=17)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=MODEL, prompt=[1] * 300, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        # one bad prompt of a batch refuses the whole request
        client.completions.create(model=MODEL, prompt=[[1, 2], [1] * 300], max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model=MODEL, prompt="x", best_of=2)
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
                    stream_options={"include_usage": True},
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

    async def samples_and_batch():  # n = 3 streamed, and a batch of two prompts x n = 2
        async with aiohttp.ClientSession() as s:
            r = await s.post(f"{server.url}/v1/completions",
                             json={"model": MODEL, "prompt": "abort us " * 8, "n": 3,
                                   "max_tokens": 200, "ignore_eos": True, "stream": True})
            assert r.status == 200
            for _ in range(4):
                await r.content.readuntil(b"\n\n")
            r.close()
            task = asyncio.create_task(s.post(
                f"{server.url}/v1/completions",
                json={"model": MODEL, "prompt": ["a b c", "d e f"], "n": 2,
                      "max_tokens": 200, "ignore_eos": True}))
            await asyncio.sleep(0.3)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(samples_and_batch())
    after = wait_idle(server)
    assert after["aborted"] - before["aborted"] == 2 + 3 + 4  # every sample of both
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


# ---------------------------------------------- log-probabilities, penalties, bias
def _param(exc) -> str | None:
    return exc.value.body.get("param") if isinstance(exc.value.body, dict) else None


def test_completion_logprobs_stream_matches_non_stream(client, server):
    kw = dict(model=MODEL, prompt="The engine serves", max_tokens=8, temperature=0, logprobs=3,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    lp = full.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert "".join(lp.tokens) == full.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert v <= 0 and 3 <= len(top) <= 4 and top[tok] == v
        assert v == max(top.values())  # greedy takes the most likely token
    chunks = list(client.completions.create(stream=True, **kw))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert sum((getattr(x, key) for x in streamed), []) == getattr(lp, key)
    # without logprobs nothing is copied back
    assert client.completions.create(**{**kw, "logprobs": None}).choices[0].logprobs is None


def test_chat_logprobs_stream_matches_non_stream(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
              temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw)
    content = full.choices[0].logprobs.content
    assert len(content) == 6
    assert "".join(c.token for c in content) == full.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob == c.logprob
        assert c.bytes == list(c.token.encode())
    chunks = list(client.chat.completions.create(stream=True, **kw))
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs
                for e in ch.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    plain = client.chat.completions.create(**{**kw, "logprobs": None, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize("kind, kw, field", [
    ("chat", dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("chat", dict(top_logprobs=2), "top_logprobs"),
    ("completion", dict(logprobs=21), "logprobs"),
    ("completion", dict(presence_penalty=2.5), "presence_penalty"),
    ("completion", dict(frequency_penalty=-3), "frequency_penalty"),
    ("completion", dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"),
    ("completion", dict(logit_bias={"999999": 1}), "logit_bias"),
    ("completion", dict(logit_bias={"5": 101}), "logit_bias"),
    ("completion", dict(logit_bias={str(i): 1 for i in range(301)}), "logit_bias"),
    ("completion", dict(logit_bias={"x": 1}), "logit_bias"),
    ("completion", dict(extra_body={"min_tokens": 9}), "min_tokens"),
    ("completion", dict(extra_body={"min_tokens": -1}), "min_tokens"),
])
def test_bad_sampling_fields_name_the_field(client, kind, kw, field):
    with pytest.raises(openai.BadRequestError) as exc:
        if kind == "chat":
            client.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                                   "content": "x"}],
                                           max_tokens=8, **kw)
        else:
            client.completions.create(model=MODEL, prompt="x", max_tokens=8, **kw)
    assert _param(exc) == field


def test_penalties_bias_and_min_tokens_through_the_api(client, server):
    """A +100 bias makes greedy decoding emit one token throughout; penalties change a
    greedy continuation; min_tokens holds off a stop token that greedy would emit at
    once; streaming agrees with non-streaming; the engine keeps serving and frees all."""
    base = dict(model=MODEL, prompt="one two one two one two", max_tokens=10, temperature=0,
                extra_body={"ignore_eos": True})
    biased = client.completions.create(logit_bias={"42": 100}, logprobs=0, **base).choices[0]
    assert biased.logprobs.tokens == [biased.logprobs.tokens[0]] * 10
    # a milder bias repeats token 42; the penalties then push it down after it appears
    mild = {**base, "logit_bias": {"42": 14}, "logprobs": 0}
    pen = dict(presence_penalty=2, frequency_penalty=2,
               extra_body={"ignore_eos": True, "repetition_penalty": 2})
    repeated = client.completions.create(**mild).choices[0].logprobs.tokens
    penalized = client.completions.create(**{**mild, **pen}).choices[0]
    t42 = biased.logprobs.tokens[0]
    assert repeated.count(t42) == 10 and penalized.logprobs.tokens.count(t42) <= 2
    streamed = list(client.completions.create(stream=True, **{**mild, **pen}))
    assert "".join(c.choices[0].text for c in streamed) == penalized.text
    # the token greedy picks first, as a stop token: min_tokens holds it off
    stop_id = client.completions.create(**{**base, "max_tokens": 1}, logprobs=0)
    tok = stop_id.choices[0].logprobs.tokens[0]
    ids = server.engine_call(lambda e: e.tokenizer.encode(tok, add_special_tokens=False).ids)
    if len(ids) != 1:
        pytest.skip(f"first token {tok!r} does not round-trip")
    held = client.completions.create(**{**base, "extra_body": {
        "ignore_eos": True, "stop_token_ids": ids, "min_tokens": 4}})
    early = client.completions.create(**{**base, "extra_body": {
        "ignore_eos": True, "stop_token_ids": ids}})
    assert early.choices[0].finish_reason == "stop" and early.usage.completion_tokens == 1
    assert held.usage.completion_tokens >= 4
    assert wait_idle(server)["compilations_after_warmup"] == 0


# ------------------------------------------------------------- echo, n, prompt logprobs
def _golden_prompt():
    """A golden prompt and Hugging Face's log-softmax at each of its positions."""
    g = np.load("tests/golden/tiny.npz")
    return g["prompt_1"].tolist(), g["prompt_logprobs_1"]


def test_echo_with_logprobs_scores_the_prompt(client, server):
    """Evaluation harnesses' loglikelihood request: echo + logprobs (+ max_tokens 1). The
    prompt's token log-probabilities match the Hugging Face log-softmax within 1e-4, the
    first is null, the text starts with the prompt; streamed and not agree."""
    ids, logp = _golden_prompt()
    kw = dict(model=MODEL, prompt=ids, max_tokens=1, temperature=0, logprobs=2, echo=True)
    full = client.completions.create(**kw)
    lp = full.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for p in range(1, len(ids)):
        assert abs(lp.token_logprobs[p] - logp[p - 1, ids[p]]) < 1e-4, p
        # the prompt token and the top 2, keyed by text (ids that decode alike collide)
        want = sorted([logp[p - 1, ids[p]], *np.sort(logp[p - 1])[-2:]])
        assert 1 <= len(lp.top_logprobs[p]) <= 3
        for v in lp.top_logprobs[p].values():
            assert min(abs(v - w) for w in want) < 1e-4, (p, v, want)
    prompt_text = server.engine_call(lambda e: e.tokenizer.decode(ids))
    assert full.choices[0].text.startswith(prompt_text)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    chunks = list(client.completions.create(stream=True, **kw))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert sum((getattr(x, key) for x in streamed), []) == getattr(lp, key)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    # echo alone: text only, and the engine computes no prompt scores for it
    plain = client.completions.create(**{**kw, "logprobs": None})
    assert plain.choices[0].text == full.choices[0].text and plain.choices[0].logprobs is None
    assert wait_idle(server)["compilations_after_warmup"] == 0


def test_prompt_logprobs_extension(client):
    """vLLM's `prompt_logprobs` field (completions: per choice; chat: top level)."""
    ids, logp = _golden_prompt()
    resp = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0,
                                     extra_body={"prompt_logprobs": 1})
    plp = resp.choices[0].model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    for p in range(1, len(ids)):
        entry = plp[p]
        assert str(ids[p]) in entry and len(entry) <= 2
        assert abs(entry[str(ids[p])]["logprob"] - logp[p - 1, ids[p]]) < 1e-4
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        extra_body={"prompt_logprobs": 0})
    assert chat.model_extra["prompt_logprobs"][0] is None
    assert all(len(e) == 1 for e in chat.model_extra["prompt_logprobs"][1:])


def test_n_choices_share_the_prompt(client, server):
    """n = 3: three choices, indices 0..2; seeded: reproducible, and the samples differ; the
    later samples take the prompt's pages from the prefix cache; streamed = not."""
    prompt = list(range(100, 160))  # 60 tokens: 3 full pages of 16
    before = server.engine_call(lambda e: e.stats())
    kw = dict(model=MODEL, prompt=prompt, max_tokens=6, temperature=1.0, seed=11, n=3,
              extra_body={"ignore_eos": True})
    a = client.completions.create(**kw)
    after = server.engine_call(lambda e: e.stats())
    assert [c.index for c in a.choices] == [0, 1, 2]
    texts = [c.text for c in a.choices]
    assert len(set(texts)) == 3, texts
    assert a.usage.prompt_tokens == 60 and a.usage.completion_tokens == 18
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    assert hits >= 2 * 48, (hits, after)  # samples 1 and 2 hit 3 full pages each
    b = client.completions.create(**kw)
    assert [c.text for c in b.choices] == texts
    chunks = list(client.completions.create(stream=True, **kw))
    streamed = ["".join(c.choices[0].text for c in chunks if c.choices
                        and c.choices[0].index == i) for i in range(3)]
    assert streamed == texts
    chat = client.chat.completions.create(model=MODEL, n=2, max_tokens=4, seed=3,
                                          messages=[{"role": "user", "content": "hi"}])
    assert [c.index for c in chat.choices] == [0, 1]
    assert wait_idle(server)["compilations_after_warmup"] == 0


def test_batched_prompts_and_chat_echo(client, server):
    """A list of prompts: one choice per prompt (times n), in order, each equal to the
    prompt sent alone. Chat echo (vLLM's): an assistant's last message starts the reply."""
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    kw = dict(model=MODEL, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    batch = client.completions.create(prompt=prompts, n=2, **kw)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    alone = [client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]
    assert [c.text for c in batch.choices] == [alone[0]] * 2 + [alone[1]] * 2
    assert batch.usage.prompt_tokens == 7 and batch.usage.completion_tokens == 16
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure,"}]
    echoed = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=3, temperature=0,
        extra_body={"echo": True, "add_generation_prompt": False})
    plain = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=3, temperature=0,
        extra_body={"add_generation_prompt": False})
    assert echoed.choices[0].message.content == "Sure," + plain.choices[0].message.content
    assert wait_idle(server)["compilations_after_warmup"] == 0


def test_stats_line_while_serving(client, caplog):
    """vLLM's periodic line: logged while requests run and once when the engine goes idle,
    with the tokens of the interval."""
    caplog.set_level(logging.INFO, logger="lp_jax.server")
    out = client.completions.create(model=MODEL, prompt="hello there", max_tokens=12,
                                    temperature=0.0)
    assert out.usage.completion_tokens == 12
    pattern = re.compile(r"prompt throughput: ([0-9.]+) tokens/s, generation throughput: "
                         r"([0-9.]+) tokens/s, running: \d+ reqs, waiting: \d+ reqs, KV cache "
                         r"usage: [0-9.]+%, prefix cache hit rate: [0-9.]+%, preemptions: \d+")
    deadline = time.monotonic() + 10
    while True:
        found = [pattern.search(r.getMessage()) for r in caplog.records]
        found = [m for m in found if m]
        if any(float(m.group(2)) > 0 for m in found) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert found and any(float(m.group(2)) > 0 for m in found), caplog.text[-2000:]


def test_llm_engine_is_a_served_engine(server):
    """LLMEngine implements the server's view of an engine (core/served.py), with the
    limits and queue state the server reads."""
    from lp_jax.core.served import ServedEngine

    engine = server.server.engine
    assert isinstance(engine, ServedEngine)
    limits = engine.limits
    assert (limits.max_model_len, limits.max_num_seqs) == (
        engine.scheduler.config.max_model_len, engine.scheduler.config.max_num_seqs)
    assert limits.vocab_size == engine.model_config.vocab_size
    state = server.engine_call(lambda e: e.queue_state())
    assert (state.running, state.waiting) == (0, 0) and state.idle_steps >= 0
