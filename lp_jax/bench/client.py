"""Streaming OpenAI client for lp-bench: sends each request at its arrival time and
timestamps every streamed chunk.

A chunk counts as one token event when it has a choice with text (completions) or a delta
with content (chat), or a finish_reason; a chat chunk that only announces the role does
not count. Servers that stream one chunk per token (vLLM, SGLang, lp_jax) thus give one
event per token, so TTFT is the time to the first event and the ITLs are the gaps between
events. `completion_tokens` comes from the `usage` the stream ends with (requested with
`stream_options.include_usage`), else the number of events.

A request of the multi-SLO workload carries its objectives as `ttft_slo_ms` / `tbt_slo_ms`
(and, with `send_slo_class`, its class as `slo_class`, which the server must know: start
it with the same `--slo-classes`, and its SLO metrics are labelled by class).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import aiohttp

from lp_jax.bench.workload import RequestSpec


@dataclass
class RequestRecord:
    index: int
    scheduled: float  # intended send time, seconds after the run's start
    prompt_len: int
    output_len: int  # requested
    send_time: float = 0.0  # seconds after the run's start
    token_times: list[float] = field(default_factory=list)
    end_time: float = 0.0
    completion_tokens: int = 0
    prompt_tokens: int | None = None
    ok: bool = False
    status: int | None = None
    error: str | None = None
    finish_reason: str | None = None
    slo_class: str | None = None  # multi-slo: the class and its objectives
    ttft_slo_ms: float | None = None
    tbt_slo_ms: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def request_body(spec: RequestSpec, *, model: str | None, chat: bool, ignore_eos: bool,
                 temperature: float, extra: dict | None = None,
                 send_slo_class: bool = False) -> dict:
    body: dict = {"max_tokens": spec.output_len, "stream": True,
                  "stream_options": {"include_usage": True}, "temperature": temperature}
    if model:
        body["model"] = model
    if chat:
        if not isinstance(spec.prompt, str):
            raise ValueError("the chat endpoint needs text prompts (--prompt-kind text)")
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    if ignore_eos:
        body["ignore_eos"] = True
    if spec.ttft_slo_ms is not None:
        body["ttft_slo_ms"] = spec.ttft_slo_ms
    if spec.tbt_slo_ms is not None:
        body["tbt_slo_ms"] = spec.tbt_slo_ms
    if send_slo_class and spec.slo_class is not None:
        body["slo_class"] = spec.slo_class
    if extra:
        body.update(extra)
    return body


async def sse_events(content: aiohttp.StreamReader):
    """Yields the data of each server-sent event, as text."""
    data: list[str] = []
    async for raw in content:
        line = raw.decode("utf-8", "replace").rstrip("\r\n")
        if not line:
            if data:
                yield "\n".join(data)
                data = []
            continue
        if line.startswith("data:"):
            data.append(line[5:].lstrip(" "))
    if data:
        yield "\n".join(data)


def _is_token_event(choice: dict, chat: bool) -> bool:
    if choice.get("finish_reason") is not None:
        return True
    if chat:
        delta = choice.get("delta") or {}
        return "content" in delta and (delta["content"] or "role" not in delta)
    return "text" in choice


async def send_one(session: aiohttp.ClientSession, url: str, body: dict, rec: RequestRecord,
                   t0: float, *, chat: bool, headers: dict, timeout: float) -> RequestRecord:
    rec.send_time = time.perf_counter() - t0
    try:
        async with session.post(url, json=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            rec.status = resp.status
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return rec
            async for data in sse_events(resp.content):
                now = time.perf_counter() - t0
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    rec.error = f"stream error: {json.dumps(obj['error'])[:300]}"
                    return rec
                for choice in obj.get("choices") or ():
                    if _is_token_event(choice, chat):
                        rec.token_times.append(now)
                    if choice.get("finish_reason") is not None:
                        rec.finish_reason = choice["finish_reason"]
                usage = obj.get("usage")
                if usage:
                    rec.completion_tokens = int(usage.get("completion_tokens") or 0)
                    rec.prompt_tokens = usage.get("prompt_tokens")
            if not rec.completion_tokens:
                rec.completion_tokens = len(rec.token_times)
            rec.ok = bool(rec.token_times)
            if not rec.ok:
                rec.error = "no tokens streamed"
    except (aiohttp.ClientError, TimeoutError, ValueError, OSError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        rec.end_time = time.perf_counter() - t0
    return rec


async def run_requests(specs: list[RequestSpec], *, base_url: str, model: str | None,
                       endpoint: str = "completions", api_key: str | None = None,
                       ignore_eos: bool = True, temperature: float = 0.0,
                       max_concurrency: int | None = None, timeout: float = 600.0,
                       extra_body: dict | None = None, send_slo_class: bool = False,
                       on_done: Callable[[RequestRecord], None] | None = None,
                       ) -> tuple[list[RequestRecord], float]:
    """Replays `specs` (sorted by arrival); returns the records and the run's duration."""
    chat = endpoint == "chat"
    url = base_url.rstrip("/") + ("/v1/chat/completions" if chat else "/v1/completions")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    bodies = [request_body(s, model=model, chat=chat, ignore_eos=ignore_eos,
                           temperature=temperature, extra=extra_body,
                           send_slo_class=send_slo_class) for s in specs]
    records = [RequestRecord(s.index, s.arrival, s.prompt_len, s.output_len,
                             slo_class=s.slo_class, ttft_slo_ms=s.ttft_slo_ms,
                             tbt_slo_ms=s.tbt_slo_ms) for s in specs]
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0, force_close=False)

    async with aiohttp.ClientSession(connector=connector) as session:
        t0 = time.perf_counter()

        async def one(i: int) -> None:
            delay = specs[i].arrival - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is not None:
                async with sem:
                    await send_one(session, url, bodies[i], records[i], t0, chat=chat,
                                   headers=headers, timeout=timeout)
            else:
                await send_one(session, url, bodies[i], records[i], t0, chat=chat,
                               headers=headers, timeout=timeout)
            if on_done is not None:
                on_done(records[i])

        await asyncio.gather(*(one(i) for i in range(len(specs))))
        duration = time.perf_counter() - t0
    return records, duration
