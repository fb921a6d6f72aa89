"""The OpenAI-compatible HTTP server on aiohttp. See lp_jax/server/__init__.py for the API.

Limits that keep one client from stalling the others:
- a request body may be at most what a prompt of `max_model_len` tokens can fill (each
  token at its widest, see `max_token_bytes`) plus `BODY_ROOM_BYTES`; a prompt text that
  is longer than `max_model_len` such tokens is refused before it is tokenized;
- tokenizing and chat templates run on worker threads, never on the event loop;
- a connection must deliver a request's headers within `read_timeout` of opening (or of
  its previous response; aiohttp's keep-alive timer), and the body within `read_timeout`
  of the headers (408);
- aiohttp's own 4xx (a malformed request line, an oversized header, found before any route
  runs) get OpenAI error bodies from `_Protocol`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import signal
import threading
import time
import uuid
from pathlib import Path

from aiohttp import web

from lp_jax.server import encoding, protocol, vllm_routes
from lp_jax.server.chat import ChatFormatter, ChatTemplateError
from lp_jax.server.detok import TextAssembler
from lp_jax.server.engine_loop import EngineDeadError, EngineLoop, OverloadedError
from lp_jax.server.metrics import ServerMetrics
from lp_jax.server.prometheus import CONTENT_TYPE
from lp_jax.server.protocol import APIError

log = logging.getLogger("lp_jax.server")

# Room in a request body for everything but the prompt: JSON syntax, the other fields
# (16 stop strings of 512 characters take up to 100 KiB escaped), chat message wrappers.
BODY_ROOM_BYTES = 2 ** 20
READ_TIMEOUT_S = 60.0
# After a drain, handlers still running are cancelled this long into the runner's cleanup.
_CLEANUP_TIMEOUT_S = 1.0
SERVER_KEY = web.AppKey("lp_server", object)
RETRY_AFTER_S = 1
# Besides /v1: the routes that need the API key when one is set (/health, /ping, /version
# stay public, for load balancers).
KEYED_PATHS = ("/reset_prefix_cache", "/tokenize", "/detokenize")
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no"}


def _sse(obj) -> bytes:
    return encoding.sse(encoding.dumps(obj))


def error_response(err: APIError) -> web.Response:
    # ASCII escapes: a message that quotes the request can never fail to encode.
    return web.Response(status=err.status, text=json.dumps(err.body()),
                        content_type="application/json", headers=err.headers)


def max_token_bytes(tokenizer, vocab_size: int) -> int:
    """The most bytes one prompt token can take in a request body: the longest token written
    as JSON with ASCII escapes (the widest a client can write it), +1 for the leading space
    that SentencePiece decoders drop from a lone token; or one token id and its separator."""
    widest_id = len(str(vocab_size - 1)) + 2  # "123, "
    if tokenizer is None:
        return widest_id
    texts = tokenizer.decode_batch([[i] for i in range(tokenizer.get_vocab_size())],
                                   skip_special_tokens=False)
    return max(widest_id, max(len(json.dumps(t)) - 2 for t in texts) + 1)


class OpenAIServer:
    """Wraps an engine (LLMEngine or anything with its interface) in the HTTP API.

    The engine is used only from the engine thread (see engine_loop.py). `start()` the
    engine loop, then serve `make_runner()` with aiohttp, or use `ServerThread` or `serve`.
    `api_key` guards /v1, /tokenize, /detokenize, /reset_prefix_cache and, unless
    `metrics_public`, /metrics. `max_prompt_logprob_entries` caps a request's scored prompt
    entries (see `protocol.prompt_logprob_entries`); `chat_template` (Jinja source) replaces
    the model directory's; `vllm_metric_names` also exposes the `vllm:` names of
    metrics.VLLM_NAMES; `log_stats_s` logs vLLM's stats line that often while requests run
    (lp-serve: every 10 s; None: never).
    """

    def __init__(self, engine, *, served_model_names=None, api_key: str | None = None,
                 max_waiting: int | None = None, metrics_public: bool = False,
                 read_timeout: float = READ_TIMEOUT_S, max_n: int = protocol.DEFAULT_MAX_N,
                 max_prompt_logprob_entries: int = protocol.DEFAULT_MAX_PROMPT_LOGPROB_ENTRIES,
                 chat_template: str | None = None, vllm_metric_names: bool = False,
                 log_stats_s: float | None = None):
        self.engine = engine
        self.max_n = max_n  # choices per prompt a request may ask for
        self.max_prompt_logprob_entries = max_prompt_logprob_entries
        model_dir = getattr(engine, "model_dir", None)
        # The default name is the directory's, never its path: /v1/models is public.
        self.served_model_names = list(served_model_names or [])
        if not self.served_model_names:
            self.served_model_names = [Path(model_dir).name if model_dir else "lp-jax"]
        self.model_name = self.served_model_names[0]
        self._api_key = api_key.encode() if api_key else None
        self.metrics_public = metrics_public
        self.read_timeout = read_timeout
        self.tokenizer = engine.tokenizer
        self.vocab_size = engine.model_config.vocab_size
        self.max_model_len = engine.scheduler.config.max_model_len
        self.max_prompt_bytes = self.max_model_len * max_token_bytes(self.tokenizer,
                                                                     self.vocab_size)
        self.max_body_bytes = self.max_prompt_bytes + BODY_ROOM_BYTES
        self.chat = ChatFormatter.from_model_dir(model_dir, self.tokenizer,
                                                 template=chat_template)
        self.metrics = ServerMetrics(self.model_name, vllm_names=vllm_metric_names)
        self.metrics.declare_slo_classes(getattr(engine, "slo_classes", {}))
        self.engine_loop = EngineLoop(engine, max_waiting=max_waiting, metrics=self.metrics,
                                      log_stats_s=log_stats_s)
        self.created = int(time.time())
        self.draining = False
        self._inflight = 0  # generation handlers running

    def start(self) -> OpenAIServer:
        self.engine_loop.start()
        return self

    def shutdown(self) -> None:
        self.engine_loop.shutdown()

    async def drain(self, grace_s: float) -> None:
        """Refuse new requests (503) and wait up to `grace_s` for those in flight."""
        self.draining = True
        log.info("draining: %d requests in flight, %g s to finish", self._inflight, grace_s)
        deadline = time.monotonic() + grace_s
        while self._inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._inflight:
            log.warning("%d requests still in flight after %g s: aborting them",
                        self._inflight, grace_s)

    # ------------------------------------------------------------------- app
    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes,
                              middlewares=[self._error_middleware, self._auth_middleware])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        vllm_routes.add_routes(app, self)
        app[SERVER_KEY] = self
        return app

    def make_runner(self, *, access_log: bool = False) -> web.AppRunner:
        """An aiohttp runner for `make_app()`. The handler of a closed connection is cancelled
        (which aborts its request); the keep-alive timer is the header read timeout."""
        kwargs = {} if access_log else {"access_log": None}
        return _Runner(self.make_app(), handler_cancellation=True,
                       keepalive_timeout=self.read_timeout,
                       shutdown_timeout=_CLEANUP_TIMEOUT_S, **kwargs)

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
        if self._api_key is not None and self._needs_key(request):
            scheme, _, key = request.headers.get("Authorization", "").partition(" ")
            # surrogatepass: any header text encodes, and distinct texts stay distinct.
            if not (scheme.lower() == "bearer" and hmac.compare_digest(
                    key.strip().encode("utf-8", "surrogatepass"), self._api_key)):
                self.metrics.rejected.inc(reason="unauthorized")
                raise APIError(401, "invalid or missing API key (Authorization: Bearer ...)",
                               type="authentication_error", code="invalid_api_key")
        return await handler(request)

    def _needs_key(self, request) -> bool:
        resource = request.match_info.route.resource
        path = resource.canonical if resource is not None else request.path
        return (path.startswith("/v1") or path in KEYED_PATHS
                or (path == "/metrics" and not self.metrics_public))

    # ------------------------------------------------------------- endpoints
    async def health(self, request) -> web.Response:
        if self.draining:
            return web.json_response({"status": "draining"}, status=503)
        if self.engine_loop.healthy:
            return web.json_response({"status": "ok"})
        return web.json_response({"status": "unhealthy", "error": self.engine_loop.error},
                                 status=503)

    async def models(self, request) -> web.Response:
        data = [{"id": name, "object": "model", "created": self.created, "owned_by": "lp_jax",
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

    async def reset_prefix_cache(self, request) -> web.Response:
        """POST /reset_prefix_cache, as vLLM's: forgets every cached KV page. 200 once
        done; 409, as vLLM, while requests hold pages (the cache resets only when idle)."""
        try:
            done = await self.engine_loop.call(lambda e: e.reset_prefix_cache(), timeout=30.0)
        except EngineDeadError as exc:
            raise APIError(500, str(exc), type="internal_server_error",
                           code="engine_dead") from None
        if not done:
            raise APIError(409, "prefix cache reset failed: requests still hold KV pages; "
                           "retry once they finish", type="conflict_error", code="busy")
        log.info("prefix cache reset")
        return web.Response(status=200)

    async def completions(self, request) -> web.StreamResponse:
        return await self._generate(request, protocol.parse_completion)

    async def chat_completions(self, request) -> web.StreamResponse:
        return await self._generate(request, protocol.parse_chat)

    # -------------------------------------------------------------- requests
    async def _generate(self, request, parse) -> web.StreamResponse:
        self._inflight += 1
        try:
            if self.draining:
                self.metrics.rejected.inc(reason="shutting_down")
                raise APIError(503, "the server is shutting down", type="server_unavailable",
                               code="shutting_down",
                               headers={"Retry-After": str(RETRY_AFTER_S)})
            try:
                req = await self._read_request(request, parse)
                choices = await self._submit(req)
            except asyncio.CancelledError:  # the client left before its request was queued
                log.info("client disconnected before its request was queued")
                self.metrics.success.inc(finished_reason="abort")
                raise
            return await self._respond(request, req, choices)
        finally:
            self._inflight -= 1

    def check_model(self, model: str) -> None:
        """404 unless `model` is empty or a served name."""
        if model and model not in self.served_model_names:
            raise APIError(404, f"the model '{model[:200]}' does not exist; this server "
                           f"serves {self.served_model_names}", type="not_found_error",
                           param="model", code="model_not_found")

    async def _read_request(self, request, parse):
        try:
            req = parse(protocol.parse_json(await self.read_body(request)))
            self.check_model(req.model)
            req.slo = self._resolve_slo(req.slo_fields)
            return req
        except APIError:
            self.metrics.rejected.inc(reason="invalid")
            raise

    def _resolve_slo(self, fields: dict | None):
        """The engine's SLO for a request's SLO fields (None: none given); a 400 naming the
        field for an unknown class or a value the engine refuses, before anything is queued.
        `resolve_slo` only reads the classes fixed at start-up, so any thread may call it."""
        if fields is None:
            return None
        resolve = getattr(self.engine, "resolve_slo", None)
        if resolve is None:
            raise protocol.unsupported(next(iter(fields)), "this engine has no latency SLOs")
        try:
            return resolve(fields)
        except ValueError as exc:
            msg = str(exc)
            param = next((f for f in protocol.SLO_FIELDS if f in msg and f in fields),
                         next(iter(fields)))
            raise protocol.bad(msg, param) from None

    async def read_body(self, request) -> bytes:
        too_large = APIError(
            413, f"the request body is over {self.max_body_bytes} bytes, more than a prompt "
            f"of {self.max_model_len} tokens (this model's context) can use",
            code="request_too_large")
        if (request.content_length or 0) > self.max_body_bytes:
            raise too_large
        try:
            async with asyncio.timeout(self.read_timeout):
                return await request.read()
        except web.HTTPRequestEntityTooLarge:  # a chunked body outgrew the limit
            raise too_large from None
        except TimeoutError:
            raise APIError(408, f"the request body did not arrive within "
                           f"{self.read_timeout:g} s", code="request_timeout") from None

    def _tokenize(self, req, prompt) -> list[int]:
        """Runs on a worker thread, so that a long prompt does not stall the event loop.
        `encode_batch` releases the GIL while it works; `encode` holds it throughout."""
        if req.kind == "chat":
            try:
                text = self.chat.render(req.messages, req.add_generation_prompt)
            except ChatTemplateError as exc:
                raise protocol.bad(str(exc), "messages") from None
            if self.tokenizer is None:
                raise protocol.bad("chat needs a tokenizer and this model has none", "messages")
            ids = self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
        elif isinstance(prompt, str):
            if self.tokenizer is None:
                raise protocol.bad("this model has no tokenizer: send 'prompt' as a list of "
                                   "token ids", "prompt")
            ids = self.tokenizer.encode_batch([prompt])[0].ids
        else:
            ids = list(prompt)
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

    async def _submit(self, req) -> list[_Choice]:
        """Tokenizes every prompt and queues each prompt's `n` samples, all or none; one
        `_Choice` per sample, in OpenAI's choice order (prompt-major)."""
        arrival = time.perf_counter()
        try:
            if req.n > self.max_n:
                raise protocol.bad(f"'n' must be at most {self.max_n} (this server's --max-n), "
                                   f"got {req.n}", "n")
            if req.prompt_bytes > self.max_prompt_bytes:
                raise protocol.bad(
                    f"the prompt has {req.prompt_bytes} bytes, more than {self.max_model_len} "
                    "tokens (this model's maximum context length) can hold",
                    "messages" if req.kind == "chat" else "prompt")
            prompts = req.prompts if req.kind == "completion" else [None]
            ids_list = await asyncio.to_thread(
                lambda: [self._tokenize(req, p) for p in prompts])
            self._check_prompt_logprobs(req, ids_list)
            params = [req.sampling_params(self._budget(req, len(ids)), self.vocab_size)
                      for ids in ids_list]
            # Queued together (one engine iteration takes them all); all or none. Every
            # choice's deltas go to one queue, in the order the engine made them.
            queue = asyncio.Queue()
            added = await asyncio.gather(
                *(self.engine_loop.add(ids, p, priority=req.priority, arrival_time=arrival,
                                       slo=req.slo, queue=queue)
                  for ids, p in zip(ids_list, params, strict=True)),
                return_exceptions=True)
            failed = [a for a in added if isinstance(a, BaseException)]
            if failed:
                for handles in added:
                    for h in () if isinstance(handles, BaseException) else handles:
                        h.abort()
                raise failed[0]
            choices = []
            for prompt, ids, handles in zip(prompts, ids_list, added, strict=True):
                for handle in handles:
                    choices.append(_Choice(len(choices), handle, ids, prompt, self, req))
            return choices
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

    def _check_prompt_logprobs(self, req, ids_list: list[list[int]]) -> None:
        """A 400 for a request whose scored prompts hold more than
        `max_prompt_logprob_entries` entries, before anything is queued."""
        entries = protocol.prompt_logprob_entries(req, [len(ids) for ids in ids_list])
        if entries > self.max_prompt_logprob_entries:
            k = req.scored_prompt()
            param = "prompt_logprobs" if req.prompt_logprobs is not None else "logprobs"
            raise protocol.bad(
                f"this request scores {entries} prompt log-probability entries ("
                f"{sum(len(ids) for ids in ids_list)} prompt tokens x {req.n} samples x "
                f"{k + 1} entries per token), more than this server's limit of "
                f"{self.max_prompt_logprob_entries} (lp-serve --max-prompt-logprob-entries); "
                "send fewer or shorter prompts, or fewer alternatives", param)

    async def _respond(self, request, req, choices: list[_Choice]) -> web.StreamResponse:
        rid = f"{'chatcmpl' if req.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        model = req.model or self.model_name
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
                    self.metrics.generation_tokens.inc(choice.asm.num_tokens - n_tokens)
                if choice.reason is not None:
                    live -= 1
                if req.stream and (item.new_token_ids or choice.reason is not None):
                    if resp is None:
                        resp = web.StreamResponse(headers=_SSE_HEADERS)
                        await resp.prepare(request)
                    big = choice.chunk_entries(lp_delta) > encoding.BIG_BODY_ENTRIES
                    text_ = await encoding.render(
                        lambda c=choice, t=text, lp=lp_delta: self._chunk(
                            req, rid, created, model, c, t, logprobs=lp), big=big)
                    await resp.write(encoding.sse(text_))
            if req.stream:
                if req.include_usage:
                    await resp.write(_sse({"id": rid, "object": self._chunk_object(req),
                                           "created": created, "model": model, "choices": [],
                                           "usage": _usage(choices)}))
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
                self.metrics.observe_finished(reason=c.reason or "abort",
                                              metrics=c.last.metrics if c.last else None,
                                              num_tokens=c.asm.num_tokens,
                                              num_prompt_tokens=len(c.ids))
        def build() -> dict:
            body = {"id": rid, "object": "chat.completion" if req.kind == "chat"
                    else "text_completion", "created": created, "model": model,
                    "choices": [c.choice_body() for c in choices], "usage": _usage(choices)}
            if req.kind == "chat" and req.prompt_logprobs is not None:
                body["prompt_logprobs"] = choices[0].prompt_logprobs_body()
            return body

        big = sum(c.num_entries() for c in choices) > encoding.BIG_BODY_ENTRIES
        return web.Response(text=await encoding.render(build, big=big),
                            content_type="application/json")

    @staticmethod
    def _chunk_object(req) -> str:
        return "chat.completion.chunk" if req.kind == "chat" else "text_completion"

    def _chunk(self, req, rid, created, model, choice, text, *, logprobs=None) -> dict:
        """One choice's SSE chunk. It never carries `usage`: that comes, as OpenAI sends it,
        only with `stream_options.include_usage`, in a final chunk with empty `choices`."""
        reason = choice.reason
        if logprobs is not None:
            logprobs = choice.lps.format(*logprobs)
        if req.kind == "chat":
            first, choice.started = not choice.started, True
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            body = {"index": choice.index, "delta": delta, "logprobs": logprobs,
                    "finish_reason": reason}
        else:
            body = {"index": choice.index, "text": text, "logprobs": logprobs,
                    "finish_reason": reason}
        if req.prompt_logprobs is not None and choice.prompt_lps_pending:
            choice.prompt_lps_pending = False
            body["prompt_logprobs"] = choice.prompt_logprobs_body()
        return {"id": rid, "object": self._chunk_object(req), "created": created,
                "model": model, "choices": [body]}


def _usage(choices: list[_Choice]) -> dict:
    """OpenAI's usage of a request: each prompt's tokens once (however many samples), every
    choice's completion tokens; cached tokens as the first sample of each prompt found."""
    firsts = [c for c in choices if c.sample_index == 0]
    cached = [c.cached for c in firsts]
    return protocol.usage(sum(len(c.ids) for c in firsts),
                          sum(c.asm.num_tokens for c in choices),
                          None if any(x is None for x in cached) else sum(cached))


class _Choice:
    """One choice of a response (a prompt's sample): its engine request, its text (with
    the echo, if asked), its log-probabilities."""

    def __init__(self, index: int, handle, ids: list[int], prompt, server: OpenAIServer, req):
        self.index, self.handle, self.ids, self.req = index, handle, ids, req
        self.sample_index = index % req.n
        self.tokenizer = server.tokenizer
        self.asm = TextAssembler(server.tokenizer, ids, req.stop)
        self.lps = None if req.logprobs is None else LogprobFormatter(server.tokenizer, req)
        self.lp_tokens, self.lp_entries = [], []  # the whole choice's, when not streamed
        self.reason = self.last = self.cached = None
        self.started = False  # chat: its first chunk (with the role) went out
        self.prompt_lps = None  # the engine's prompt log-probabilities, from the first delta
        self.prompt_lps_pending = True  # streaming: not yet sent
        self.echo = self._echo_text(prompt)
        self.echo_pending = bool(self.echo) or (req.echo and self.lps is not None)

    def _echo_text(self, prompt) -> str:
        req = self.req
        if not req.echo:
            return ""
        if req.kind == "chat":  # vLLM's: the last message, when it is the assistant's
            last = req.messages[-1]
            return last["content"] if last["role"] == "assistant" else ""
        if isinstance(prompt, str):
            return prompt
        return self.tokenizer.decode(self.ids) if self.tokenizer else ""

    def push(self, delta, *, stream: bool) -> tuple[str, tuple | None]:
        """Takes one engine delta; returns (text to stream, None or the (tokens, entries)
        whose logprobs the chunk carries: formatted by `_chunk`, off the loop if big)."""
        self.last = delta
        out = delta.output
        self.cached = getattr(out, "num_cached_tokens", None)
        if self.prompt_lps is None:
            self.prompt_lps = getattr(out, "prompt_logprobs", None)
        text = self.asm.push(delta.new_token_ids)
        lp_delta = None
        # An engine without log-probabilities (the mock) answers logprobs: null.
        new_lps = getattr(out, "new_logprobs", None)
        if self.lps is not None and new_lps is not None:
            tokens, entries = list(delta.new_token_ids), list(new_lps)
            if self.echo_pending and self.req.kind == "completion":
                tokens, entries = list(self.ids) + tokens, self._prompt_lp_entries() + entries
            self.lp_tokens += tokens
            self.lp_entries += entries
            if stream:
                lp_delta = tokens, entries
        elif new_lps is None:
            self.lps = None
        if self.echo_pending:
            self.echo_pending = False
            text = self.echo + text
        if self.asm.stopped:
            self.reason = "stop"
            self.handle.abort()  # the engine stops generating; the client is answered
        elif delta.finished:
            text += self.asm.finish()
            self.reason = delta.finish_reason
        if self.reason is not None:
            self.handle.finished = True
        return text, lp_delta

    def prompt_logprob_entries(self) -> int:
        """Entries its `prompt_logprobs` body holds: the token and its alternatives a row."""
        k = self.req.prompt_logprobs
        return 0 if k is None or self.prompt_lps is None else len(self.prompt_lps) * (k + 1)

    def chunk_entries(self, lp_delta) -> int:
        """As `num_entries`, for the next streamed chunk: its logprobs, its prompt's."""
        n = len(lp_delta[0]) * (self.req.logprobs + 2) if lp_delta else 0
        return n + (self.prompt_logprob_entries() if self.prompt_lps_pending else 0)

    def num_entries(self) -> int:
        """Roughly the JSON values its body holds: one a token, times the alternatives
        when log-probabilities are asked for; decides whether it is built off the loop."""
        tokens = self.asm.num_tokens + (len(self.ids) if self.req.echo else 0)
        per_token = 1 if self.req.logprobs is None else self.req.logprobs + 2
        return tokens * per_token + self.prompt_logprob_entries()

    def _prompt_lp_entries(self) -> list:
        """The echoed prompt's log-probability entries: None for the first token."""
        lps = self.prompt_lps or [None] * len(self.ids)
        return list(lps)

    def prompt_logprobs_body(self):
        """vLLM's `prompt_logprobs`: per prompt token, None (the first) or
        {token_id: {"logprob", "decoded_token"}} for the token and its top alternatives."""
        if self.prompt_lps is None:
            return None
        k = self.req.prompt_logprobs
        texts: dict[int, str] = {}  # a token's text, decoded once (rows share alternatives)

        def dec(t: int) -> str:
            if t not in texts:
                texts[t] = (self.tokenizer.decode([t], skip_special_tokens=False)
                            if self.tokenizer else f"token_id:{t}")
            return texts[t]

        out = []
        for d in self.prompt_lps:
            if d is None:
                out.append(None)
                continue
            first, *alts = d.items()  # the prompt token, then the engine's top alternatives
            keep = [first, *alts[:k]]
            out.append({str(t): {"logprob": v, "decoded_token": dec(t)} for t, v in keep})
        return out

    def choice_body(self) -> dict:
        lp = None if self.lps is None else self.lps.format(self.lp_tokens, self.lp_entries)
        if self.req.kind == "chat":
            return {"index": self.index, "message": {"role": "assistant",
                                                     "content": self.echo + self.asm.text},
                    "logprobs": lp, "finish_reason": self.reason}
        body = {"index": self.index, "text": self.echo + self.asm.text, "logprobs": lp,
                "finish_reason": self.reason}
        if self.req.prompt_logprobs is not None:
            body["prompt_logprobs"] = self.prompt_logprobs_body()
        return body


class LogprobFormatter:
    """OpenAI `logprobs` objects for a request's tokens, chunk by chunk or whole (the same
    tokens give the same entries either way). Completions: the legacy shape (tokens,
    token_logprobs, top_logprobs with the sampled token and the top `logprobs`, as vLLM's,
    text_offset); chat: content entries with the top `top_logprobs` alternatives. Token
    text is each id decoded alone (special tokens kept), so it may be a partial character."""

    def __init__(self, tokenizer, req):
        self.tokenizer, self.chat, self.top = tokenizer, req.kind == "chat", req.logprobs
        self.offset = 0  # completions: the next token's character offset in the text

    def _text(self, t: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{t}"
        return self.tokenizer.decode([t], skip_special_tokens=False)

    def _entry(self, t: int, lp: float) -> dict:
        text = self._text(t)
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    def format(self, token_ids: list[int], entries: list[dict]) -> dict:
        if self.chat:
            return {"content": [
                {**self._entry(t, d[t]),
                 "top_logprobs": [self._entry(a, v) for a, v in
                                  sorted(d.items(), key=lambda kv: -kv[1])[: self.top]]}
                for t, d in zip(token_ids, entries, strict=True)]}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, d in zip(token_ids, entries, strict=True):
            text = self._text(t)
            out["tokens"].append(text)  # d is None for an echoed prompt's first token
            out["token_logprobs"].append(None if d is None else d[t])
            out["top_logprobs"].append(None if d is None else
                                       {self._text(a): v for a, v in d.items()})
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out


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
        runner = self.server.make_runner()
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


async def serve(server: OpenAIServer, host: str, port: int, *, grace_s: float,
                access_log: bool = False) -> None:
    """Serve until SIGTERM, then drain (`OpenAIServer.drain`: 503 to new requests, `grace_s`
    for those in flight) and return. Ctrl-C stops at once. `access_log`: a line a request."""
    server.start()
    runner = server.make_runner(access_log=access_log)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        log.info("serving %s on http://%s:%d", server.served_model_names, host,
                 runner.addresses[0][1])
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
        await server.drain(grace_s)
    finally:
        await runner.cleanup()
        server.shutdown()


class _Protocol(web.RequestHandler):
    """aiohttp's connection handler, with OpenAI error bodies for the 4xx that aiohttp sends
    itself, before any route or middleware runs (a malformed request line, an oversized
    header), logged in one line instead of a traceback."""

    def handle_error(self, request, status=500, exc=None, message=None):
        if status >= 500:
            return super().handle_error(request, status, exc, message)
        log.debug("malformed HTTP request from %s: %s", request.remote, message)
        resp = error_response(APIError(status, f"malformed HTTP request: {message}"))
        resp.force_close()
        return resp


class _Server(web.Server):
    def __call__(self) -> _Protocol:
        return _Protocol(self, loop=self._loop, **self._kwargs)


class _Runner(web.AppRunner):
    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _Server  # aiohttp has no option for the connection handler class
        return server
