"""Soak: 2,000 mixed requests against lp-serve over loopback, with bad inputs and client
disconnects interleaved, 32 at a time. Every good request must be answered in full, every
bad one with a 4xx and an OpenAI error body; nothing is logged above INFO; afterwards every
KV page is free and the running/waiting gauges read 0.

The engine is the MockEngine (one token per request per step, 0.5 ms a step), so the
test measures the server and stays within a few seconds on a 2-core CI machine; it prints
the throughput and latency that BENCHMARKS.md records (run with -s to see them).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import aiohttp
import numpy as np

from lp_jax.server import OpenAIServer, ServerThread
from lp_jax.server.mock import MockEngine
from lp_jax.server.prometheus import parse_text

N_REQUESTS = 2000
CONCURRENCY = 32
MAX_MODEL_LEN = 256
GENERATE = ("/v1/completions", "/v1/chat/completions")


def bad_requests(server: OpenAIServer) -> list[tuple[str, str, bytes, int]]:
    """(method, path, body, expected status)."""
    def js(obj) -> bytes:
        return json.dumps(obj).encode()

    return [
        ("POST", "/v1/completions", b"{", 400),
        ("POST", "/v1/completions", b'{"prompt": "a\\ud800"}', 400),
        ("POST", "/v1/completions", js({"prompt": "x", "seed": 2 ** 63}), 400),
        ("POST", "/v1/completions", js({"prompt": "x", "stop_token_ids": list(range(65))}),
         400),
        ("POST", "/v1/completions", js({"prompt": [1] * (MAX_MODEL_LEN + 1)}), 400),
        ("POST", "/v1/completions", js({"prompt": "a" * (server.max_prompt_bytes + 1)}), 400),
        ("POST", "/v1/completions", b" " * (server.max_body_bytes + 1), 413),
        ("POST", "/v1/completions", js({"model": "other", "prompt": "x"}), 404),
        ("POST", "/v1/completions", js({"prompt": "x", "n": 2, "max_tokens": 0}), 400),
        ("POST", "/v1/chat/completions", js({"messages": []}), 400),
        ("POST", "/v1/chat/completions",
         js({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}), 400),
        ("GET", "/v1/completions", b"", 405),
        ("POST", "/v1/nothing", b"{}", 404),
    ]


def good_request(i: int) -> tuple[str, dict]:
    n = 1 + i % 16
    stream = i % 3 == 0
    if i % 4 == 0:
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": f"hi {i}"}],
                                        "max_tokens": n, "stream": stream}
    prompt = f"request {i}" if i % 2 else [1 + i % 500, 2, 3]
    return "/v1/completions", {"prompt": prompt, "max_tokens": n, "stream": stream,
                               "temperature": 0.7, "seed": i}


def sse_events(data: bytes) -> list[str]:
    return [e for e in data.decode().split("\n\n") if e.strip()]


async def run_good(s, url, i) -> float:
    path, body = good_request(i)
    t0 = time.perf_counter()
    async with s.post(url + path, json=body) as r:
        assert r.status == 200, (i, await r.text())
        data = await r.read()
    n = body["max_tokens"]
    if body["stream"]:
        events = sse_events(data)
        assert events[-1] == "data: [DONE]", (i, events[-3:])
        chunks = [json.loads(e[6:]) for e in events[:-1]]
        assert len(chunks) == n and chunks[-1]["choices"][0]["finish_reason"] == "length"
    else:
        resp = json.loads(data)
        assert resp["choices"][0]["finish_reason"] == "length"
        assert resp["usage"]["completion_tokens"] == n
    return time.perf_counter() - t0


async def run_bad(s, url, case) -> None:
    method, path, body, status = case
    async with s.request(method, url + path, data=body,
                         headers={"Content-Type": "application/json"}) as r:
        assert r.status == status, (case[:2], body[:80], r.status, await r.text())
        err = (await r.json(content_type=None))["error"]
        assert set(err) == {"message", "type", "param", "code"}


async def run_disconnect(s, url, i) -> bool:
    """Leaves mid-stream (True), or gives up on a plain request before it is answered."""
    body = {"prompt": f"leave {i}", "max_tokens": 200, "stream": i % 2 == 0}
    if body["stream"]:
        r = await s.post(f"{url}/v1/completions", json=body)
        assert r.status == 200
        for _ in range(1 + i % 3):
            await r.content.readuntil(b"\n\n")
        r.close()  # drop the connection mid-stream
    else:
        task = asyncio.create_task(s.post(f"{url}/v1/completions", json=body))
        await asyncio.sleep(0.001 * (i % 10))
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return body["stream"]


async def soak(url: str, bad: list) -> dict:
    sem = asyncio.Semaphore(CONCURRENCY)
    latencies: list[float] = []
    counts = {"good": 0, "bad": 0, "invalid": 0, "disconnect": 0, "mid_stream": 0}

    async def one(s, i):
        async with sem:
            kind = i % 10
            if kind < 6:
                latencies.append(await run_good(s, url, i))
                counts["good"] += 1
            elif kind < 8:
                method, path, *_ = case = bad[i % len(bad)]
                await run_bad(s, url, case)
                counts["bad"] += 1
                counts["invalid"] += method == "POST" and path in GENERATE  # not the router's
            else:
                counts["mid_stream"] += await run_disconnect(s, url, i)
                counts["disconnect"] += 1

    connector = aiohttp.TCPConnector(limit=CONCURRENCY)
    async with aiohttp.ClientSession(connector=connector) as s:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(s, i) for i in range(N_REQUESTS)))
        counts["seconds"] = time.perf_counter() - t0
    counts["latencies"] = latencies
    return counts


def wait_idle(st_: ServerThread, timeout=20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = st_.engine_call(lambda e: e.stats())
        idle = st_.engine_call(lambda e: not e.has_unfinished())
        if idle and stats["free_pages"] == stats["total_pages"]:
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.02)


def test_soak_2000_mixed_requests(tiny_dir, caplog):
    eng = MockEngine(model_dir=tiny_dir, max_model_len=MAX_MODEL_LEN, max_num_seqs=32,
                     step_delay=0.0005)
    with ServerThread(OpenAIServer(eng, served_model_names=["mock"], max_waiting=4096)) as st_:
        r = asyncio.run(soak(st_.url, bad_requests(st_.server)))
        assert r["good"] + r["bad"] + r["disconnect"] == N_REQUESTS
        wait_idle(st_)
        with_key = 'lp:{}{{model_name="mock",{}}}'.format
        m = parse_text(asyncio.run(_get(f"{st_.url}/metrics")))
        assert m['lp:num_requests_running{model_name="mock"}'] == 0
        assert m['lp:num_requests_waiting{model_name="mock"}'] == 0
        assert m['lp:kv_cache_usage_perc{model_name="mock"}'] == 0
        assert st_.server.engine_loop.num_unadmitted == 0
        finished = {reason: m[with_key("request_success_total", f'finished_reason="{reason}"')]
                    for reason in ("stop", "length", "abort")}
        # Every request that reached a handler is counted once, answered or aborted; a client
        # that gives up within milliseconds may close before aiohttp dispatches its request.
        assert r["good"] + r["mid_stream"] <= sum(finished.values()) <= r["good"] + r[
            "disconnect"]
        assert finished["length"] >= r["good"] and finished["abort"] > 0
        assert m[with_key("request_rejected_total", 'reason="invalid"')] == r["invalid"]
        assert st_.server.engine_loop.healthy
    assert not [rec for rec in caplog.records if rec.levelno >= logging.WARNING]
    lat = np.array(r["latencies"]) * 1e3
    print(f"\nsoak: {N_REQUESTS} requests ({r['good']} good, {r['bad']} bad, "
          f"{r['disconnect']} disconnects) at concurrency {CONCURRENCY} in {r['seconds']:.2f} s: "
          f"{N_REQUESTS / r['seconds']:.0f} req/s; good-request latency p50 "
          f"{np.percentile(lat, 50):.1f} ms, p99 {np.percentile(lat, 99):.1f} ms; "
          f"aborted {finished['abort']:.0f}")


async def _get(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return await r.text()
