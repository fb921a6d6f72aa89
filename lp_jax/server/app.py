"""The OpenAI-compatible HTTP server on aiohttp. See lp_jax/server/__init__.py for the API."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid

from aiohttp import web

from lp_jax.server import protocol
from lp_jax.server.chat import ChatFormatter, ChatTemplateError
from lp_jax.server.detok import TextAssembler
from lp_jax.server.engine_loop import EngineDeadError, EngineLoop, OverloadedError
from lp_jax.server.metrics import ServerMetrics
from lp_jax.server.prometheus import CONTENT_TYPE
from lp_jax.server.protocol import APIError

log = logging.getLogger("lp_jax.server")

MAX_BODY_BYTES = 32 * 2 ** 20
SERVER_KEY = web.AppKey("lp_server", object)
RETRY_AFTER_S = 1
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no"}


def _dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _sse(obj) -> bytes:
    return f"data: {_dumps(obj)}\n\n".encode()


def error_response(err: APIError) -> web.Response:
    return web.Response(status=err.status, text=_dumps(err.body()),
                        content_type="application/json", headers=err.headers)


class OpenAIServer:
    """Wraps an engine (LLMEngine or anything with its interface) in the HTTP API.

    The engine is used only from the engine thread (see engine_loop.py). `start()` the
    engine loop, then serve `make_app()` with aiohttp, or use `ServerThread`.
    """

    def __init__(self, engine, *, served_model_names=None, api_key: str | None = None,
                 max_waiting: int | None = None):
        self.engine = engine
        names = list(served_model_names or [])
        if not names:
            names = [str(getattr(engine, "model_dir", None) or "lp-jax")]
        self.served_model_names = names
        self.model_name = names[0]
        self.api_key = api_key
        self.tokenizer = engine.tokenizer
        self.vocab_size = engine.model_config.vocab_size
        self.max_model_len = engine.scheduler.config.max_model_len
        self.chat = ChatFormatter.from_model_dir(getattr(engine, "model_dir", None),
                                                 self.tokenizer)
        self.metrics = ServerMetrics(self.model_name)
        self.engine_loop = EngineLoop(engine, max_waiting=max_waiting, metrics=self.metrics)
        self.created = int(time.time())

    def start(self) -> OpenAIServer:
        self.engine_loop.start()
        return self

    def shutdown(self) -> None:
        self.engine_loop.shutdown()

    # ------------------------------------------------------------------- app
    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES,
                              middlewares=[self._error_middleware, self._auth_middleware])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        app[SERVER_KEY] = self
        return app

    @web.middleware
    async def _error_middleware(self, request, handler):
        try:
            return await handler(request)
        except APIError as err:
            return error_response(err)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            kind = "not_found_error" if exc.status == 404 else "invalid_request_error"
            return error_response(APIError(exc.status, exc.reason or str(exc), type=kind,
                                           headers={k: v for k, v in exc.headers.items()
                                                    if k == "Allow"}))
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as exc:  # noqa: BLE001 - a bug must not take the server down
            log.exception("unhandled error on %s %s", request.method, request.path)
            return error_response(APIError(500, f"internal error: {type(exc).__name__}",
                                            type="internal_server_error"))

    @web.middleware
    async def _auth_middleware(self, request, handler):
        if self.api_key is not None and request.path.startswith("/v1"):
            auth = request.headers.get("Authorization", "")
            if auth != f"Bearer {self.api_key}":
                self.metrics.rejected.inc(reason="unauthorized")
                raise APIError(401, "invalid or missing API key (Authorization: Bearer ...)",
                               type="authentication_error", code="invalid_api_key")
        return await handler(request)

    # ------------------------------------------------------------- endpoints
    async def health(self, request) -> web.Response:
        if self.engine_loop.healthy:
            return web.json_response({"status": "ok"})
        return web.json_response({"status": "unhealthy", "error": self.engine_loop.error},
                                 status=503)

    async def models(self, request) -> web.Response:
        data = [{"id": name, "object": "model", "created": self.created, "owned_by": "lp_jax",
                 "root": str(getattr(self.engine, "model_dir", name)),
                 "max_model_len": self.max_model_len} for name in self.served_model_names]
        return web.json_response({"object": "list", "data": data})

    async def prometheus(self, request) -> web.Response:
        el = self.engine_loop
        stats, running, waiting = el.last_stats, *el.last_counts
        if el.healthy:
            try:
                stats, running, waiting = await el.call(lambda _: el.snapshot(), timeout=5.0)
            except (TimeoutError, EngineDeadError):
                pass  # a long step (or a crash): serve the last snapshot
        self.metrics.update_from_engine(stats, running=running, waiting=waiting)
        return web.Response(body=self.metrics.render().encode(),
                            headers={"Content-Type": CONTENT_TYPE})

    async def completions(self, request) -> web.StreamResponse:
        req = self._checked(protocol.parse_completion, await request.read())
        return await self._generate(request, req)

    async def chat_completions(self, request) -> web.StreamResponse:
        req = self._checked(protocol.parse_chat, await request.read())
        return await self._generate(request, req)

    # -------------------------------------------------------------- requests
    def _checked(self, parse, raw: bytes):
        try:
            req = parse(protocol.parse_json(raw))
            if req.model and req.model not in self.served_model_names:
                raise APIError(404, f"the model '{req.model}' does not exist; this server "
                               f"serves {self.served_model_names}", type="not_found_error",
                               param="model", code="model_not_found")
            return req
        except APIError:
            self.metrics.rejected.inc(reason="invalid")
            raise

    def _tokenize(self, req) -> list[int]:
        if req.kind == "chat":
            try:
                text = self.chat.render(req.messages, req.add_generation_prompt)
            except ChatTemplateError as exc:
                raise protocol.bad(str(exc), "messages") from None
            if self.tokenizer is None:
                raise protocol.bad("chat needs a tokenizer and this model has none", "messages")
            ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        elif isinstance(req.prompt, str):
            if self.tokenizer is None:
                raise protocol.bad("this model has no tokenizer: send 'prompt' as a list of "
                                   "token ids", "prompt")
            ids = self.tokenizer.encode(req.prompt).ids
        else:
            ids = list(req.prompt)
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise protocol.bad(f"token ids {bad[:5]} outside [0, {self.vocab_size})",
                                   "prompt")
        if not ids:
            raise protocol.bad("the prompt is empty after tokenization", "prompt")
        return ids

    def _budget(self, req, n_prompt: int) -> int:
        limit = self.max_model_len
        if n_prompt > limit:
            raise protocol.bad(f"this model's maximum context length is {limit} tokens; the "
                               f"prompt has {n_prompt}", "prompt")
        if req.max_tokens is None:
            return max(1, limit - n_prompt)
        if n_prompt + req.max_tokens > limit:
            raise protocol.bad(
                f"this model's maximum context length is {limit} tokens; you requested "
                f"{n_prompt + req.max_tokens} ({n_prompt} in the prompt, {req.max_tokens} "
                "in the completion)", "max_tokens")
        return req.max_tokens

    async def _submit(self, req):
        arrival = time.perf_counter()
        try:
            ids = self._tokenize(req)
            params = req.sampling_params(self._budget(req, len(ids)), self.vocab_size)
            return ids, await self.engine_loop.add(ids, params, priority=req.priority,
                                                   arrival_time=arrival)
        except APIError:
            self.metrics.rejected.inc(reason="invalid")
            raise
        except ValueError as exc:  # the engine's own validation
            self.metrics.rejected.inc(reason="invalid")
            raise protocol.bad(str(exc)) from None
        except OverloadedError as exc:
            self.metrics.rejected.inc(reason="overloaded")
            raise APIError(503, f"server overloaded: {exc}; retry later",
                           type="server_overloaded", code="overloaded",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except EngineDeadError as exc:
            self.metrics.rejected.inc(reason="engine_dead")
            raise APIError(500, str(exc), type="internal_server_error",
                           code="engine_dead") from None
        except RuntimeError as exc:
            raise APIError(500, str(exc), type="internal_server_error") from None

    async def _generate(self, request, req) -> web.StreamResponse:
        ids, handle = await self._submit(req)
        chat = req.kind == "chat"
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        model = req.model or self.model_name
        asm = TextAssembler(self.tokenizer, ids, req.stop)
        state = {"delta": None, "reason": None, "sent": False}
        resp: web.StreamResponse | None = None
        try:
            async for delta in handle:
                state["delta"] = delta
                text = asm.push(delta.new_token_ids)
                reason = None
                if asm.stopped:
                    reason = "stop"
                    handle.abort()  # the engine stops generating; the client is answered
                elif delta.finished:
                    text += asm.finish()
                    reason = delta.finish_reason
                state["reason"] = reason
                if req.stream and (delta.new_token_ids or reason is not None):
                    if resp is None:
                        resp = web.StreamResponse(headers=_SSE_HEADERS)
                        await resp.prepare(request)
                    await resp.write(self._chunk(req, rid, created, model, text, reason,
                                                 first=not state["sent"],
                                                 usage_=(len(ids), asm.num_tokens)))
                    state["sent"] = True
                if reason is not None:
                    break
        except EngineDeadError as exc:
            err = APIError(500, str(exc), type="internal_server_error", code="engine_dead")
            if resp is None:
                raise err from None
            await resp.write(_sse(err.body()))
            await resp.write(b"data: [DONE]\n\n")
            return resp
        finally:
            reason = state["reason"]
            if reason is None:  # cancelled, disconnected or failed: stop the request
                handle.abort()
            last = state["delta"]  # its metrics are read (and built) only here, once
            self.metrics.observe_finished(reason=reason or "abort",
                                          metrics=last.metrics if last else None,
                                          num_tokens=asm.num_tokens,
                                          num_prompt_tokens=len(ids))
        usage = protocol.usage(len(ids), asm.num_tokens)
        if req.stream:
            if req.include_usage:
                await resp.write(_sse({"id": rid, "object": self._chunk_object(req),
                                       "created": created, "model": model, "choices": [],
                                       "usage": usage}))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": asm.text},
                      "logprobs": None, "finish_reason": state["reason"]}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": asm.text, "logprobs": None,
                      "finish_reason": state["reason"]}
            obj = "text_completion"
        return web.Response(text=_dumps({"id": rid, "object": obj, "created": created,
                                         "model": model, "choices": [choice],
                                         "usage": usage}),
                            content_type="application/json")

    @staticmethod
    def _chunk_object(req) -> str:
        return "chat.completion.chunk" if req.kind == "chat" else "text_completion"

    def _chunk(self, req, rid, created, model, text, reason, *, first, usage_) -> bytes:
        if req.kind == "chat":
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        chunk = {"id": rid, "object": self._chunk_object(req), "created": created,
                 "model": model, "choices": [choice]}
        if reason is not None and not req.include_usage:
            chunk["usage"] = protocol.usage(*usage_)  # usage always ends the stream
        return _sse(chunk)


class ServerThread:
    """Serves an OpenAIServer on its own event loop in a background thread.

    For tests and benchmarks: `with ServerThread(server) as st: ... st.url ...`.
    Port 0 picks a free port.
    """

    def __init__(self, server: OpenAIServer, host: str = "127.0.0.1", port: int = 0):
        self.server = server
        self.host = host
        self.port = port
        self.loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="lp-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> ServerThread:
        self.server.start()
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("the HTTP server did not start")
        if self._error is not None:
            raise self._error
        return self

    def _main(self):
        self.loop = asyncio.new_event_loop()
        try:
            self.loop.run_until_complete(self._serve())
        except BaseException as exc:  # noqa: BLE001 - reported to start()
            self._error = exc
            self._ready.set()
        finally:
            self.loop.close()

    async def _serve(self):
        self._stop = asyncio.Event()
        runner = web.AppRunner(self.server.make_app(), handler_cancellation=True,
                               access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port)
        await site.start()
        self.port = runner.addresses[0][1]
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await runner.cleanup()

    def engine_call(self, fn, timeout: float = 30.0):
        """Runs `fn(engine)` on the engine thread from any other thread (a test hook)."""
        fut = asyncio.run_coroutine_threadsafe(self.server.engine_loop.call(fn, timeout),
                                               self.loop)
        return fut.result(timeout + 1.0)

    def stop(self, timeout: float = 10.0) -> None:
        if self.loop is not None and self._stop is not None and not self.loop.is_closed():
            try:
                self.loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:
                pass
        self._thread.join(timeout)
        self.server.shutdown()

    def __enter__(self) -> ServerThread:
        return self.start() if not self._thread.is_alive() else self

    def __exit__(self, *exc) -> None:
        self.stop()


async def serve(server: OpenAIServer, host: str, port: int, *, access_log: bool = False) -> None:
    """Serve until cancelled (Ctrl-C). `access_log`: one log line per request."""
    server.start()
    kwargs = {} if access_log else {"access_log": None}
    runner = web.AppRunner(server.make_app(), handler_cancellation=True, **kwargs)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    log.info("serving %s on http://%s:%d", server.served_model_names, host, port)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
        server.shutdown()
