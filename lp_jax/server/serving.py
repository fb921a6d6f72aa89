"""Running an OpenAIServer: `ServerThread` (its own event loop in a background thread, for
tests and benchmarks) and `serve` (lp-serve's: until SIGTERM, then drain)."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading

from aiohttp import web

from lp_jax.server.app import OpenAIServer

log = logging.getLogger("lp_jax.server")


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
