"""Input-side failures of the server, each against the JAX-free MockEngine over real HTTP:
logit_bias keys, the prompt log-probability cap, big bodies built off the event loop,
fields accepted and then ignored, the generated-token counter after a cut stream, and
usage in streams only when asked for."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time

import aiohttp
import pytest
from conftest import start_server

from lp_jax.serve import build_parser
from lp_jax.server.mock import MockEngine
from lp_jax.server.prometheus import parse_text
from lp_jax.server.protocol import DEFAULT_MAX_PROMPT_LOGPROB_ENTRIES

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]


def request(st_, method, path, body=None, timeout=60.0):
    """(status, body bytes) over a fresh loopback connection."""
    conn = http.client.HTTPConnection("127.0.0.1", st_.port, timeout=timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def post(st_, path, body):
    return request(st_, "POST", path, body)


def error_param(status, data, expect=400):
    assert status == expect, (status, data[:300])
    return json.loads(data)["error"]["param"]


def sse_chunks(data: bytes) -> list[dict]:
    events = [e for e in data.decode().split("\n\n") if e.strip()]
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[6:]) for e in events[:-1]]


def metrics(st_) -> dict[str, float]:
    return parse_text(request(st_, "GET", "/metrics")[1].decode())


def wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def body_for(path, **kw):
    base = {"messages": MSGS} if path == CHAT else {"prompt": "hi"}
    return {**base, "max_tokens": 2, **kw}


# ---------------------------------------------------------------- logit_bias keys
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("key", ["²", "1²", "١٢", "１", "-1", "+1", "1.0", "", "0x1"])
def test_logit_bias_keys_other_than_ascii_digits_are_400(mock_server, path, key):
    # "²" was a 500 (str.isdigit takes it, int() does not); "١٢" and "１" were ids 12, 1.
    status, data = post(mock_server, path, body_for(path, logit_bias={key: 1}))
    assert error_param(status, data) == "logit_bias"
    assert "ASCII" in json.loads(data)["error"]["message"]


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_logit_bias_ascii_ids_pass(mock_server, path):
    status, data = post(mock_server, path, body_for(path, logit_bias={"12": 1, " 7 ": -5}))
    assert status == 200, data


# --------------------------------------------------- prompt log-probability entries
def test_prompt_logprob_entries_capped_by_default(mock_server):
    # 256 prompts x 40 tokens x (20 + 1) = 215,040 entries, over the default 200,000;
    # the same shape as the 612 KB body that made a 158 MB response.
    prompts = [[1 + (i + j) % 500 for j in range(40)] for i in range(256)]
    status, data = post(mock_server, COMPLETIONS,
                        {"prompt": prompts, "max_tokens": 1, "prompt_logprobs": 20})
    assert error_param(status, data) == "prompt_logprobs"
    msg = json.loads(data)["error"]["message"]
    assert "215040" in msg and "--max-prompt-logprob-entries" in msg
    # echo + logprobs scores the prompt too: the field is then `logprobs`
    status, data = post(mock_server, COMPLETIONS, {"prompt": prompts, "max_tokens": 1,
                                                   "echo": True, "logprobs": 20})
    assert error_param(status, data) == "logprobs"
    m = metrics(mock_server)
    assert m['lp:request_rejected_total{model_name="mock",reason="invalid"}'] >= 2
    assert post(mock_server, COMPLETIONS, body_for(COMPLETIONS))[0] == 200  # still serving


def test_prompt_logprob_cap_counts_samples_and_can_be_raised(tiny_dir):
    body = {"prompt": list(range(1, 41)), "max_tokens": 1, "prompt_logprobs": 20}
    # 40 tokens x 21 = 840 entries a sample
    with start_server(MockEngine(model_dir=tiny_dir, max_model_len=64),
                      max_prompt_logprob_entries=1000) as st_:
        assert post(st_, COMPLETIONS, body)[0] == 200
        assert error_param(*post(st_, COMPLETIONS, {**body, "n": 2})) == "prompt_logprobs"
        chat = {"messages": MSGS * 20, "max_tokens": 1, "prompt_logprobs": 20}
        assert error_param(*post(st_, CHAT, chat)) == "prompt_logprobs"
    with start_server(MockEngine(model_dir=tiny_dir, max_model_len=64),
                      max_prompt_logprob_entries=2000) as st_:
        assert post(st_, COMPLETIONS, {**body, "n": 2})[0] == 200


def test_prompt_logprob_cap_flag():
    assert build_parser().parse_args([]).max_prompt_logprob_entries == 200_000
    assert DEFAULT_MAX_PROMPT_LOGPROB_ENTRIES == 200_000
    args = build_parser().parse_args(["--max-prompt-logprob-entries", "5000000"])
    assert args.max_prompt_logprob_entries == 5_000_000
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--max-prompt-logprob-entries", "0"])


class ScoringMock(MockEngine):
    """A mock whose outputs carry prompt log-probabilities, as LLMEngine's do: per prompt
    position None (the first) or {prompt token, then its k alternatives: logprob}."""

    def _output(self, seq, new):
        out = super()._output(seq, new)
        k = seq.params.prompt_logprobs
        if k is not None:
            if not hasattr(seq, "prompt_lps"):
                v = self.limits.vocab_size
                seq.prompt_lps = [None] + [
                    {t: -1.5, **{(t + 1 + j) % v: -2.0 - j for j in range(k)}}
                    for t in seq.prompt[1:]]
            out.prompt_logprobs = seq.prompt_lps
        return out


def test_big_response_is_built_off_the_event_loop(tiny_dir):
    """32 prompts x 500 tokens x 21 = 336,000 entries (the cap raised), 15 MB: building and
    encoding that body on the event loop held /health for 1.5 s; off it, for 0.1 s."""
    prompts = [[1 + (i * 7 + j) % 500 for j in range(500)] for i in range(32)]
    body = {"prompt": prompts, "max_tokens": 1, "prompt_logprobs": 20}
    eng = ScoringMock(model_dir=tiny_dir, max_model_len=1024)
    with start_server(eng, max_prompt_logprob_entries=400_000) as st_:
        result = {}

        def big():
            t0 = time.perf_counter()
            result["status"], result["data"] = post(st_, COMPLETIONS, body)
            result["seconds"] = time.perf_counter() - t0  # parsed below: this process's
            # GIL is the server's too, and one json.loads of the body holds it throughout

        thread = threading.Thread(target=big)
        thread.start()
        worst, probes = 0.0, 0
        while thread.is_alive():
            t0 = time.perf_counter()
            status, _ = request(st_, "GET", "/health", timeout=30.0)
            assert status == 200
            worst = max(worst, time.perf_counter() - t0)
            probes += 1
            time.sleep(0.01)
        thread.join()
        assert result["status"] == 200
        choices = json.loads(result["data"])["choices"]
        assert len(choices) == 32 and len(choices[0]["prompt_logprobs"]) == 500
        assert choices[0]["prompt_logprobs"][0] is None
        assert len(choices[0]["prompt_logprobs"][1]) == 21
        assert probes >= 5, result["seconds"]  # the probes overlapped the big response
        assert worst < 0.5, (worst, result["seconds"])


# ------------------------------------------------------------- lenient acceptance
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("rf", [{"type": "json_object"}, {"type": "json_schema",
                                                          "json_schema": {"name": "x"}},
                                "text", 1])
def test_non_text_response_format_is_400_on_both_routes(mock_server, path, rf):
    """Malformed formats are refused by the parser; json_object parses and the mock engine,
    which cannot constrain its tokens, refuses it (test_structured_outputs serves them)."""
    status, data = post(mock_server, path, body_for(path, response_format=rf))
    assert error_param(status, data) == "response_format"


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_text_response_format_passes(mock_server, path):
    assert post(mock_server, path, body_for(path, response_format={"type": "text"}))[0] == 200


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "f"}}, "any", 3])
def test_tool_choice_that_needs_tools_is_400(mock_server, choice):
    status, data = post(mock_server, CHAT, body_for(CHAT, tool_choice=choice))
    assert error_param(status, data) == "tool_choice"


@pytest.mark.parametrize("choice", ["none", "auto"])
def test_tool_choice_none_or_auto_passes(mock_server, choice):
    assert post(mock_server, CHAT, body_for(CHAT, tool_choice=choice))[0] == 200


@pytest.mark.parametrize("prompt", [["a", [1, 2]], [[1, 2], "a"], ["a", "b", [3]]])
def test_prompt_batch_mixing_text_and_ids_is_400(mock_server, prompt):
    status, data = post(mock_server, COMPLETIONS, {"prompt": prompt, "max_tokens": 1})
    assert error_param(status, data) == "prompt"


@pytest.mark.parametrize("prompt", [["a", "b"], [[1, 2], [3]]])
def test_uniform_prompt_batches_pass(mock_server, prompt):
    status, data = post(mock_server, COMPLETIONS, {"prompt": prompt, "max_tokens": 1})
    assert status == 200 and len(json.loads(data)["choices"]) == 2


# ------------------------------------------------------------------- metrics
def test_generation_token_counter_agrees_with_histogram_after_cut_streams(tiny_dir):
    """A client that leaves mid-stream: the tokens the engine made after it left reached
    the request's queue but no client; neither the counter nor the histogram counts them."""
    eng = MockEngine(model_dir=tiny_dir, max_model_len=4096, num_pages=4000,
                     token_fn=lambda sid, i: eng.tokenizer.token_to_id("ABCDEFGH"[i % 8]))
    with start_server(eng) as st_:
        async def cut(n_lines: int):
            async with aiohttp.ClientSession() as s:
                r = await s.post(f"{st_.url}{COMPLETIONS}",
                                 json={"prompt": "x", "max_tokens": 3000, "stream": True})
                for _ in range(n_lines):
                    await r.content.readline()
                r.close()

        for n in (4, 20, 60):
            asyncio.run(cut(n))
        key = 'lp:request_success_total{model_name="mock",finished_reason="abort"}'
        wait_for(lambda: metrics(st_)[key] == 3)
        wait_for(lambda: st_.engine_call(lambda e: not e.has_unfinished()))
        # and one that finishes, one cut by a stop string (the engine made more)
        assert post(st_, COMPLETIONS, {"prompt": "x", "max_tokens": 5})[0] == 200
        assert post(st_, COMPLETIONS, {"prompt": "x", "max_tokens": 50, "stop": "E",
                                       "stream": True})[0] == 200
        wait_for(lambda: st_.engine_call(lambda e: not e.has_unfinished()))
        m = metrics(st_)
        total = m['lp:generation_tokens_total{model_name="mock"}']
        assert total == m['lp:request_generation_tokens_sum{model_name="mock"}']
        assert total > 5


# ------------------------------------------------------------- usage in streams
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("n", [1, 2])
def test_stream_carries_usage_only_when_asked(mock_server, path, n):
    status, data = post(mock_server, path, body_for(path, stream=True, n=n, max_tokens=3))
    assert status == 200
    chunks = sse_chunks(data)
    assert len(chunks) == 3 * n
    assert all("usage" not in c for c in chunks), [c for c in chunks if "usage" in c]
    reasons = [c["choices"][0]["finish_reason"] for c in chunks]
    assert reasons.count("length") == n and reasons.count(None) == 2 * n

    status, data = post(mock_server, path, body_for(
        path, stream=True, n=n, max_tokens=3, stream_options={"include_usage": True}))
    chunks = sse_chunks(data)
    *tokens, last = chunks
    assert all("usage" not in c and len(c["choices"]) == 1 for c in tokens)
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3 * n
    assert last["usage"]["total_tokens"] == last["usage"]["prompt_tokens"] + 3 * n


def test_stream_without_usage_when_include_usage_false(mock_server):
    status, data = post(mock_server, COMPLETIONS, body_for(
        COMPLETIONS, stream=True, stream_options={"include_usage": False}))
    assert status == 200 and all("usage" not in c for c in sse_chunks(data))
