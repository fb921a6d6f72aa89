"""From engine deltas to the HTTP response of a generation request: server-sent event
chunks, one per generated token, or one body once every choice is done.

A request's choices share one queue of deltas, in the order the engine made them. Chunks
and bodies with many entries are built and encoded off the event loop (encoding.py). A
stream that fails after its first chunk ends with an error event and `[DONE]`; a client
that leaves aborts every choice still running.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from aiohttp import web

from lp_jax.server import encoding
from lp_jax.server.choice import Choice, usage
from lp_jax.server.engine_loop import EngineDeadError
from lp_jax.server.protocol import APIError

log = logging.getLogger("lp_jax.server")

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}


def _sse(obj) -> bytes:
    return encoding.sse(encoding.dumps(obj))


async def respond(server, request, req, choices: list[Choice]) -> web.StreamResponse:
    rid = f"{'chatcmpl' if req.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    created = int(time.time())
    model = req.model or server.model_name
    by_rid = {c.handle.request_id: c for c in choices}
    queue = choices[0].handle.queue
    live = len(choices)
    resp = None
    try:
        while live:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            choice = by_rid.get(item.output.request_id)
            if choice is None or choice.reason is not None:
                continue  # a late delta of a choice already answered
            n_tokens = choice.asm.num_tokens
            text, lp_delta = choice.push(item, stream=req.stream)
            # Counted as the request counts them (`num_tokens` below): tokens the
            # engine made after the client left, or after a stop string, are not.
            if choice.asm.num_tokens > n_tokens:
                server.metrics.generation_tokens.inc(choice.asm.num_tokens - n_tokens)
            if choice.reason is not None:
                live -= 1
            if req.stream and (item.new_token_ids or choice.reason is not None):
                if resp is None:
                    resp = web.StreamResponse(headers=SSE_HEADERS)
                    await resp.prepare(request)
                big = choice.chunk_entries(lp_delta) > encoding.BIG_BODY_ENTRIES
                text_ = await encoding.render(
                    lambda c=choice, t=text, lp=lp_delta: _chunk(
                        req, rid, created, model, c, t, logprobs=lp), big=big)
                await resp.write(encoding.sse(text_))
        if req.stream:
            if req.include_usage:
                await resp.write(_sse({"id": rid, "object": _chunk_object(req),
                                       "created": created, "model": model, "choices": [],
                                       "usage": usage(choices)}))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
    except EngineDeadError as exc:
        err = APIError(500, str(exc), type="internal_server_error", code="engine_dead")
        if resp is None:
            raise err from None
        await resp.write(_sse(err.body()))
        await resp.write(b"data: [DONE]\n\n")
        return resp
    except (asyncio.CancelledError, ConnectionResetError) as exc:
        # aiohttp cancels the handler of a closed connection, or a write finds it closed.
        log.info("%s: client disconnected after %d tokens", rid,
                 sum(c.asm.num_tokens for c in choices))
        if isinstance(exc, asyncio.CancelledError):
            raise
        return resp
    finally:
        for c in choices:
            if c.reason is None:  # cancelled, disconnected or failed: stop the request
                c.handle.abort()
            server.metrics.observe_finished(reason=c.reason or "abort",
                                          metrics=c.last.metrics if c.last else None,
                                          num_tokens=c.asm.num_tokens,
                                          num_prompt_tokens=len(c.ids))
    def build() -> dict:
        body = {"id": rid, "object": "chat.completion" if req.kind == "chat"
                else "text_completion", "created": created, "model": model,
                "choices": [c.choice_body() for c in choices], "usage": usage(choices)}
        if req.kind == "chat" and req.prompt_logprobs is not None:
            body["prompt_logprobs"] = choices[0].prompt_logprobs_body()
        return body

    big = sum(c.num_entries() for c in choices) > encoding.BIG_BODY_ENTRIES
    return web.Response(text=await encoding.render(build, big=big),
                        content_type="application/json")


def _chunk_object(req) -> str:
    return "chat.completion.chunk" if req.kind == "chat" else "text_completion"

def _chunk(req, rid, created, model, choice, text, *, logprobs=None) -> dict:
    """One choice's SSE chunk. It never carries `usage`: that comes, as OpenAI sends it,
    only with `stream_options.include_usage`, in a final chunk with empty `choices`."""
    reason = choice.reason
    if logprobs is not None:
        logprobs = choice.lps.format(*logprobs)
    if req.kind == "chat":
        first, choice.started = not choice.started, True
        delta = ({"role": "assistant"} if first else {}) | choice.chat_delta(text)
        body = {"index": choice.index, "delta": delta, "logprobs": logprobs,
                "finish_reason": choice.finish_reason}
    else:
        body = {"index": choice.index, "text": text, "logprobs": logprobs,
                "finish_reason": reason}
    if req.prompt_logprobs is not None and choice.prompt_lps_pending:
        choice.prompt_lps_pending = False
        body["prompt_logprobs"] = choice.prompt_logprobs_body()
    return {"id": rid, "object": _chunk_object(req), "created": created,
            "model": model, "choices": [body]}
