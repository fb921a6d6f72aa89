"""The OpenAI-compatible HTTP server on aiohttp: `OpenAIServer`, its routes, middlewares and
connection handler. See lp_jax/server/__init__.py for the API. A generation request runs
through submit.py (body -> queued engine requests) and respond.py (deltas -> response);
serving.py runs the server (`ServerThread`, `serve`).

Limits that keep one client from stalling the others:
- a request body may be at most what a prompt of `max_model_len` tokens can fill (each
  token at its widest, see `max_token_bytes`) plus `BODY_ROOM_BYTES`; a prompt text that
  is longer than `max_model_len` such tokens is refused before it is tokenized;
- tokenizing and chat templates run on worker threads, never on the event loop
  (submit.py);
- a connection must deliver a request's headers within `read_timeout` of opening (or of
  its previous response; aiohttp's keep-alive timer), and the body within `read_timeout`
  of the headers (408);
- aiohttp's own 4xx (a malformed request line, an oversized header, found before any route
  runs) get OpenAI error bodies from `_Protocol`;
- bodies are never decompressed: a request with a `Content-Encoding` other than identity
  is a 415 naming it, its body unread, the connection closed. Accepting compression would
  let a 1 MB body inflate to a GiB on the event loop (a bomb), and OpenAI's clients send
  plain JSON.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import time
from pathlib import Path

from aiohttp import web

from lp_jax.server import protocol, respond, submit, tool_formats, vllm_routes
from lp_jax.server.chat import ChatFormatter
from lp_jax.server.engine_loop import EngineDeadError, EngineLoop
from lp_jax.server.harmony import harmony_tokens
from lp_jax.server.metrics import ServerMetrics
from lp_jax.server.prometheus import CONTENT_TYPE
from lp_jax.server.protocol import APIError
from lp_jax.server.reasoning import PARSERS

log = logging.getLogger("lp_jax.server")

# Room in a request body for everything but the prompt: JSON syntax, the other fields
# (16 stop strings of 512 characters take up to 100 KiB escaped), chat message wrappers.
BODY_ROOM_BYTES = 2 ** 20
READ_TIMEOUT_S = 60.0
# After a drain, handlers still running are cancelled this long into the runner's cleanup.
_CLEANUP_TIMEOUT_S = 1.0
SERVER_KEY = web.AppKey("lp_server", object)
# (method, path, handler): the handler is an OpenAIServer method's name, or a function of
# vllm_routes taking the server first. Every route needs the API key when one is set but
# the PUBLIC_PATHS (for load balancers) and, with `metrics_public`, /metrics.
ROUTES = (
    ("POST", "/v1/completions", "completions"),
    ("POST", "/v1/chat/completions", "chat_completions"),
    ("GET", "/v1/models", "models"),
    ("GET", "/health", "health"),
    ("GET", "/metrics", "prometheus"),
    ("POST", "/reset_prefix_cache", "reset_prefix_cache"),
    ("GET", "/version", vllm_routes.version),
    ("GET", "/ping", "health"),
    ("POST", "/ping", "health"),
    ("POST", "/tokenize", vllm_routes.tokenize),
    ("POST", "/detokenize", vllm_routes.detokenize),
)
PUBLIC_PATHS = frozenset({"/health", "/ping", "/version"})


def keyed_paths(*, metrics_public: bool = False) -> list[str]:
    """The paths the API key guards, in ROUTES' order (lp-serve --help lists them)."""
    public = PUBLIC_PATHS | ({"/metrics"} if metrics_public else set())
    return list(dict.fromkeys(path for _, path, _ in ROUTES if path not in public))


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
    """Wraps an engine (core/served.py's ServedEngine: LLMEngine, MockEngine) in the HTTP API.

    The engine is used only from the engine thread (see engine_loop.py). `start()` the
    engine loop, then serve `make_runner()` with aiohttp, or use `ServerThread` or `serve`.
    `api_key` guards every route but PUBLIC_PATHS and, with `metrics_public`, /metrics
    (`keyed_paths`); an empty key is a ValueError (it would turn authentication off).
    `max_prompt_logprob_entries` caps a request's scored prompt entries (see
    `protocol.prompt_logprob_entries`), `max_logprob_entries` its prompt and output entries
    together, `max_request_seqs` its sequences (prompts x n); `chat_template` (Jinja source)
    replaces the model directory's; `vllm_metric_names` also exposes the `vllm:` names of
    metrics.VLLM_NAMES; `log_stats_s` logs vLLM's stats line that often while requests run
    (lp-serve: every 10 s; None: never); `reasoning_parser` ("qwen3", or None) splits chat
    answers into reasoning and content (reasoning.py). A model whose tokenizer has GPT-OSS
    harmony's markers as special tokens gets its chat answers parsed as harmony from their
    token ids, whatever `reasoning_parser` says (harmony.py). Other models' tool calls are
    read in the format `tool_call_parser` names ("qwen3" or "glm45"; None: the model's,
    tool_formats.detect).
    """

    def __init__(self, engine, *, served_model_names=None, api_key: str | None = None,
                 max_waiting: int | None = None, metrics_public: bool = False,
                 read_timeout: float = READ_TIMEOUT_S, max_n: int = protocol.DEFAULT_MAX_N,
                 max_prompt_logprob_entries: int = protocol.DEFAULT_MAX_PROMPT_LOGPROB_ENTRIES,
                 max_logprob_entries: int = protocol.DEFAULT_MAX_LOGPROB_ENTRIES,
                 max_request_seqs: int = protocol.DEFAULT_MAX_REQUEST_SEQS,
                 chat_template: str | None = None, vllm_metric_names: bool = False,
                 log_stats_s: float | None = None, reasoning_parser: str | None = None,
                 tool_call_parser: str | None = None):
        if reasoning_parser not in (None, *PARSERS):
            raise ValueError(f"reasoning_parser must be one of {PARSERS} or None, got "
                             f"{reasoning_parser!r}")
        if tool_call_parser not in (None, *tool_formats.FORMATS):
            raise ValueError(f"tool_call_parser must be one of {tool_formats.FORMATS} or "
                             f"None, got {tool_call_parser!r}")
        self.reasoning_parser = reasoning_parser
        self.engine = engine
        self.max_n = max_n  # choices per prompt a request may ask for
        self.max_prompt_logprob_entries = max_prompt_logprob_entries
        self.max_logprob_entries = max_logprob_entries
        self.max_request_seqs = max_request_seqs
        if api_key is not None and not api_key.strip():
            raise ValueError("the API key is empty: that would turn authentication off; "
                             "give a key, or none (no --api-key, LP_API_KEY unset)")
        model_dir = getattr(engine, "model_dir", None)
        self.model_dir = model_dir
        # The default name is the directory's, never its path: /v1/models is public.
        self.served_model_names = list(served_model_names or [])
        if not self.served_model_names:
            self.served_model_names = [Path(model_dir).name if model_dir else "lp-jax"]
        self.model_name = self.served_model_names[0]
        self._api_key = api_key.encode() if api_key is not None else None
        self.metrics_public = metrics_public
        self.read_timeout = read_timeout
        self.tokenizer = engine.tokenizer
        self.harmony = harmony_tokens(self.tokenizer)  # None: not a harmony model
        limits = engine.limits
        self.vocab_size = limits.vocab_size
        self.max_model_len = limits.max_model_len
        self.max_prompt_bytes = self.max_model_len * max_token_bytes(self.tokenizer,
                                                                     self.vocab_size)
        self.max_body_bytes = self.max_prompt_bytes + BODY_ROOM_BYTES
        self.chat = ChatFormatter.from_model_dir(model_dir, self.tokenizer,
                                                 template=chat_template)
        self.tool_format = tool_call_parser or tool_formats.detect(model_dir, self.chat.source)
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
                              middlewares=[self._error_middleware, self._auth_middleware,
                                           self._encoding_middleware])
        for method, path, handler in ROUTES:
            handler = (getattr(self, handler) if isinstance(handler, str)
                       else functools.partial(handler, self))
            if method == "GET":  # with HEAD, as aiohttp's add_get (load balancers use it)
                app.router.add_get(path, handler)
            else:
                app.router.add_route(method, path, handler)
        app[SERVER_KEY] = self
        return app

    def make_runner(self, *, access_log: bool = False) -> web.AppRunner:
        """An aiohttp runner for `make_app()`. The handler of a closed connection is cancelled
        (which aborts its request); the keep-alive timer is the header read timeout."""
        kwargs = {} if access_log else {"access_log": None}
        return _Runner(self.make_app(), handler_cancellation=True, auto_decompress=False,
                       keepalive_timeout=self.read_timeout,
                       shutdown_timeout=_CLEANUP_TIMEOUT_S, **kwargs)

    @web.middleware
    async def _error_middleware(self, request, handler):
        try:
            return await handler(request)
        except APIError as err:
            resp = error_response(err)
            if err.status in (408, 413, 415):  # the body is unread: aiohttp would read it
                resp.force_close()            # to its end after the answer
            return resp
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
        if resource is None:  # no such route: a 404, except under /v1 (OpenAI's 401)
            return request.path.startswith("/v1")
        path = resource.canonical
        return path not in PUBLIC_PATHS and not (path == "/metrics" and self.metrics_public)

    @web.middleware
    async def _encoding_middleware(self, request, handler):
        encoding = request.headers.get("Content-Encoding", "").strip().lower()
        if encoding not in ("", "identity"):
            self.metrics.rejected.inc(reason="invalid")
            raise APIError(415, f"Content-Encoding '{encoding[:40]}' is not accepted: send "
                           "the body uncompressed (identity)", param="Content-Encoding",
                           code="unsupported_content_encoding")
        return await handler(request)

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
                               headers={"Retry-After": str(submit.RETRY_AFTER_S)})
            try:
                req = await submit.read_request(self, request, parse)
                choices = await submit.submit(self, req)
            except asyncio.CancelledError:  # the client left before its request was queued
                log.info("client disconnected before its request was queued")
                self.metrics.success.inc(finished_reason="abort")
                raise
            return await respond.respond(self, request, req, choices)
        finally:
            self._inflight -= 1

    def check_model(self, model: str) -> None:
        """404 unless `model` is empty or a served name."""
        if model and model not in self.served_model_names:
            raise APIError(404, f"the model '{model[:200]}' does not exist; this server "
                           f"serves {self.served_model_names}", type="not_found_error",
                           param="model", code="model_not_found")

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
