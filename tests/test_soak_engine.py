"""The soak of launch/soak.py, short: 300 mixed requests at concurrency 16 against a server
over the run's shared chunked engine (4 sequences, a 16-token budget), so it compiles
nothing. Every answer is checked by the soak itself (exact token and chunk counts, the
4xx of each bad request, no 5xx, no lost request); afterwards the gauges read 0 and the
counters agree with what was sent. BENCHMARKS.md records the 10,000-request run.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from conftest import launch_module

from lp_jax.server import OpenAIServer, ServerThread

soak = launch_module("soak")


def wait_idle(st_: ServerThread, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = st_.engine_call(lambda e: e.stats())
        idle = st_.engine_call(lambda e: not e.has_unfinished())
        if idle and stats["free_pages"] == stats["total_pages"]:
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.02)


def test_soak_300_requests_on_the_shared_engine(engines):
    engine = engines("chunked").engine
    assert not engine.has_unfinished() and engine.reset_prefix_cache()
    with ServerThread(OpenAIServer(engine, served_model_names=["tiny"])) as st_:
        r = asyncio.run(soak.run_soak(st_.url, requests=300, concurrency=16, seed=3,
                                      max_tokens=6, settle_s=20.0, log=print))
        stats = wait_idle(st_)
        assert st_.server.engine_loop.num_unadmitted == 0
    assert r["violations"] == [], (r["violations"], r["failures"][:5])
    assert sum(r["outcomes"].values()) == 300
    assert r["outcomes"]["ok"] >= 200 and r["outcomes"].get("cut_stream", 0) > 0
    assert all(r["kinds"][k] > 0 for k in soak.KINDS), r["kinds"]
    assert r["counters"]["rejected"]["invalid"] > 0 and r["counters"]["finished"]["abort"] > 0
    assert r["counters"]["prefix_cache_hits"] > 0
    assert all(r["gauges_end"][g] == 0 for g in
               ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"))
    assert stats["free_pages"] == stats["total_pages"]
    assert engine.reset_prefix_cache()  # leave the shared engine as found
    print("\n" + soak.markdown(r))


def _answer(k: int, n: int = 1) -> dict:
    return {"choices": [{"index": i, "text": "x" * k, "finish_reason": "length",
                         "logprobs": None} for i in range(n)],
            "usage": {"prompt_tokens": 3, "completion_tokens": n * k, "total_tokens": 3 + n * k}}


def _stream(k: int, n: int = 1, *, usage: int | None = None, done: bool = True) -> list[str]:
    chunks = [{"choices": [{"index": i, "text": "x",
                            "finish_reason": "length" if t == k - 1 else None}]}
              for t in range(k) for i in range(n)]
    chunks.append({"choices": [], "usage": {"completion_tokens": n * k if usage is None
                                            else usage}})
    events = [f"data: {json.dumps(c)}" for c in chunks]
    return events + ["data: [DONE]"] if done else events


@pytest.mark.parametrize("case", ["tokens", "reason", "index", "logprobs"])
def test_check_body_flags_wrong_answers(case):
    e = {"k": 4, "n": 2, "stream": False}
    assert soak.check_body(_answer(4, 2), e) == []
    resp = _answer(4, 2)
    if case == "tokens":
        resp["usage"]["completion_tokens"] = 7
    elif case == "reason":
        resp["choices"][1]["finish_reason"] = "stop"
    elif case == "index":
        resp["choices"].pop()
    else:
        e["logprobs"] = 2
        resp["choices"][0]["logprobs"] = {"tokens": ["a"] * 3, "top_logprobs": [{"a": -1}] * 3}
    assert soak.check_body(resp, e)


def test_check_stream_flags_wrong_streams():
    e = {"k": 3, "n": 2, "stream": True}
    assert soak.check_stream(_stream(3, 2), e) == []
    assert soak.check_stream(_stream(3, 2, done=False), e)  # no [DONE]
    assert soak.check_stream(_stream(3, 2, usage=5), e)  # usage disagrees
    assert soak.check_stream(_stream(2, 2), e)  # a chunk short
    assert soak.check_stream(_stream(4, 2), e)  # a chunk too many
    assert soak.check_stream(_stream(3, 3), e)  # a choice too many
    assert soak.check_stream(_stream(3, 2)[:-2] + ["data: [DONE]"], e)  # no usage chunk


def test_check_end_flags_leaks_and_miscounts():
    records = [{"kind": "completion", "outcome": "ok", "n": 1, "tokens": 4, "invalid": False},
               {"kind": "bad", "outcome": "ok", "n": 0, "tokens": 0, "invalid": True}]
    outcomes = {"ok": 2}
    gauges = {"num_requests_running": 0, "num_requests_waiting": 0, "kv_cache_usage_perc": 0,
              "compilations_after_warmup": 0, "engine_healthy": 1}
    counters = {"finished": {"length": 1, "stop": 0, "abort": 0},
                "rejected": {"invalid": 1, "overloaded": 0, "unauthorized": 0,
                             "engine_dead": 0, "shutting_down": 0},
                "generation_tokens": 4, "request_generation_tokens": 4,
                "prefix_cache_hits": 0, "prefix_cache_queries": 0}
    assert soak.check_end(records, outcomes, gauges, counters, requests=2) == []
    assert soak.check_end(records, outcomes, {**gauges, "kv_cache_usage_perc": 0.1},
                          counters, requests=2)
    assert soak.check_end(records, outcomes, gauges, counters, requests=3)  # one lost
    assert soak.check_end(records, {**outcomes, "5xx": 1}, gauges, counters, requests=2)
    assert soak.check_end(records, outcomes, gauges,
                          {**counters, "generation_tokens": 5}, requests=2)
    assert soak.check_end(records, outcomes, gauges,
                          {**counters, "finished": {"length": 0, "stop": 0, "abort": 1}},
                          requests=2)
