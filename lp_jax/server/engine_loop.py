"""The engine thread: the only thread that touches the engine.

The engine is seen only through core/served.py's `ServedEngine` (limits, queue state, add,
abort, step, stats). HTTP handlers live on an asyncio event loop. They never call the
engine: they put commands (add, abort, call) on a deque guarded by a condition variable and
await the answer. The engine thread takes all pending commands, runs one `engine.step()` if
there is work, and hands each request's new tokens to its asyncio queue with
`loop.call_soon_threadsafe`, batched per step. With no work it sleeps on the condition until
a command arrives.

    handler --add/abort/call--> deque + Condition --> engine thread --step()--> engine
    handler <--Delta per step-- asyncio.Queue <--call_soon_threadsafe-- engine thread

An abort (client gone, handler cancelled, stop string seen) drops the request's queue at
once and calls `engine.abort`, which frees its KV pages (or frees them after the in-flight
step, for a request a device step is still writing). If the engine raises, the thread marks
itself dead, fails every pending command and every open request with `EngineDeadError`,
and refuses new work; /health then reports unhealthy.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
import traceback
from dataclasses import dataclass

from lp_jax.progress import StatsLine

log = logging.getLogger("lp_jax.server")


class EngineDeadError(RuntimeError):
    """The engine thread stopped (crashed or shut down); no request can complete."""


class OverloadedError(RuntimeError):
    """More than `max_waiting` sequences would wait for a free slot."""


class NeverFitsError(ValueError):
    """A request of more sequences than the engine's slots and `max_waiting` together: no
    server state, idle included, could take it, so retrying cannot help (a 400)."""


@dataclass(slots=True)
class Delta:
    """New output tokens of one request from one engine step."""

    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    output: object  # the engine's RequestOutput

    @property
    def metrics(self):
        """RequestMetrics of the request so far (built on first access, off the engine
        thread: the engine's outputs snapshot them lazily)."""
        return self.output.metrics


class RequestHandle:
    """The asyncio side of one engine request: an async iterator of `Delta`s."""

    def __init__(self, loop_: EngineLoop, num_prompt_tokens: int,
                 queue: asyncio.Queue | None = None):
        self._engine_loop = loop_
        self.queue: asyncio.Queue = asyncio.Queue() if queue is None else queue
        self.request_id: int | None = None
        self.num_prompt_tokens = num_prompt_tokens
        self.finished = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> Delta:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        """Stop generating (idempotent); the engine frees the request's pages."""
        if not self.finished and self.request_id is not None:
            self.finished = True
            self._engine_loop.abort(self.request_id)


class _Sink:
    __slots__ = ("loop", "handle", "started")

    def __init__(self, loop, handle):
        self.loop = loop
        self.handle = handle
        self.started = False


class EngineLoop:
    """Runs `engine` on a dedicated thread; see the module docstring.

    `max_waiting` bounds the sequences (engine requests: a request's prompts x n) that
    really wait: added, not yet admitted by the scheduler, beyond the free slots
    (`max_num_seqs` less the admitted sequences, as of the last step). None: unbounded.
    `add` takes a request's sequences all or none: OverloadedError if they would take the
    waiting count past `max_waiting` now, NeverFitsError if they are more than
    `max_num_seqs + max_waiting` (what an idle server takes). `metrics` (a
    ServerMetrics) gets the queue-time histogram and the prompt token counter. Generated
    tokens are counted by the handlers, as they take them: tokens that reach a request's
    queue after its client left are never its tokens, in the counter as in its histogram.
    """

    def __init__(self, engine, *, max_waiting: int | None = None, metrics=None,
                 log_stats_s: float | None = 10.0):
        self.engine = engine
        # vLLM's periodic stats line, every log_stats_s while requests run (None: off).
        self.log_stats_s = log_stats_s
        self._stats_line: StatsLine | None = None
        self._stats_at = 0.0
        self._active = False  # steps ran since the last stats line
        self.max_waiting = max_waiting
        self.metrics = metrics
        self._cv = threading.Condition()
        self._cmds: collections.deque = collections.deque()
        self._sinks: dict[int, _Sink] = {}
        self._unscheduled: dict[int, float] = {}  # request id -> arrival time
        self._unadmitted = 0  # add commands queued + requests not yet admitted
        self._max_num_seqs = engine.limits.max_num_seqs
        self._free_slots = self._max_num_seqs  # updated with _unadmitted, after each step
        self._dead = False
        self._stopping = False
        self.error: str | None = None
        self.last_stats: dict = {}
        self.last_counts = (0, 0)  # (running, waiting)
        self._thread = threading.Thread(target=self._run, name="lp-engine", daemon=True)

    # ------------------------------------------------------------- any thread
    @property
    def healthy(self) -> bool:
        return not self._dead and self._thread.is_alive()

    @property
    def num_unadmitted(self) -> int:
        return self._unadmitted

    @property
    def num_waiting(self) -> int:
        """Sequences that wait beyond the free slots; `max_waiting` bounds this."""
        return max(0, self._unadmitted - self._free_slots)

    @property
    def max_request_seqs(self) -> int | None:
        """The most sequences one request may have: what an idle server admits at once
        (`max_num_seqs` + `max_waiting`); None: no bound here."""
        return None if self.max_waiting is None else self._max_num_seqs + self.max_waiting

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def abort(self, request_id: int) -> None:
        """Fire and forget; safe from any thread."""
        with self._cv:
            if self._dead:
                return
            self._cmds.append(("abort", request_id))
            self._cv.notify()

    # ------------------------------------------------------------ event loop
    async def add(self, prompts, *, priority: int = 0, arrival_time: float | None = None,
                  slo=None, queue: asyncio.Queue | None = None) -> list[list[RequestHandle]]:
        """Queue one HTTP request's prompts, all or none: `prompts` is a list of
        (prompt token ids, SamplingParams); each prompt runs as one engine request per
        sample (`sampling_params.samples()`, the later ones after the first's prefill).
        Returns each prompt's handles, one per sample. Raises ValueError (a bad request,
        NeverFitsError included), OverloadedError, EngineDeadError.
        `slo`: anything `engine.add_request(slo=...)` takes; None: best-effort.
        `queue`: where the handles' deltas go (several requests may share one; read it
        instead of iterating the handles); default: a queue per handle."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        work = [(ids, params.samples()) for ids, params in prompts]
        handles = [[RequestHandle(self, len(ids), queue) for _ in samples]
                   for ids, samples in work]
        num_seqs = sum(len(samples) for _, samples in work)
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        limit = self.max_request_seqs
        if limit is not None and num_seqs > limit:
            raise NeverFitsError(
                f"this request has {num_seqs} sequences (prompts x n); this server runs "
                f"{self._max_num_seqs} at once and lets {self.max_waiting} more wait "
                f"(--max-num-seqs + --max-waiting = {limit}), so it can never be admitted; "
                "send fewer prompts or a smaller n")
        with self._cv:
            if self._dead or self._stopping:
                raise EngineDeadError(self.error or "the engine is not running")
            if self.max_waiting is not None:
                after = max(0, self._unadmitted + num_seqs - self._free_slots)
                if after > self.max_waiting:
                    raise OverloadedError(
                        f"{self.num_waiting} sequences wait for a free slot and this "
                        f"request adds {num_seqs} (limit {self.max_waiting} waiting)")
            self._unadmitted += num_seqs
            self._cmds.append(("add", (work, priority, arrival, slo, loop, fut, handles)))
            self._cv.notify()
        ids = await fut  # cancelled: _resolve aborts the requests
        for prompt_handles, prompt_ids in zip(handles, ids, strict=True):
            for handle, rid in zip(prompt_handles, prompt_ids, strict=True):
                handle.request_id = rid
        return handles

    async def call(self, fn, timeout: float | None = None):
        """Runs `fn(engine)` on the engine thread between steps and returns its result."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._cv:
            if self._dead or self._stopping:
                raise EngineDeadError(self.error or "the engine is not running")
            self._cmds.append(("call", (fn, loop, fut)))
            self._cv.notify()
        return await asyncio.wait_for(fut, timeout)

    # ---------------------------------------------------------- engine thread
    def _run(self) -> None:
        engine = self.engine
        empty_steps = last_idle = 0
        try:
            self._refresh_stats()
            if self.log_stats_s:
                self._stats_line = StatsLine(self.last_stats)
                self._stats_at = time.monotonic()
            while True:
                with self._cv:
                    while not self._cmds and not self._stopping and not engine.has_unfinished():
                        self._refresh_stats()
                        wait_s = self._stats_due(time.monotonic())
                        if wait_s is not None and wait_s <= 0:  # a busy spell's last line,
                            self._log_stats(time.monotonic())  # one interval after the last
                            continue
                        self._cv.wait(wait_s)
                    if self._stopping:
                        break
                    if empty_steps > 64 and not self._cmds:
                        # Work that makes no progress (a stuck mock, say): poll, don't spin.
                        self._cv.wait(min(0.05, 0.001 * 2 ** min(empty_steps - 64, 6)))
                    cmds = list(self._cmds)
                    self._cmds.clear()
                for cmd in cmds:
                    self._apply(cmd)
                if not engine.has_unfinished():
                    continue
                t0 = time.perf_counter()
                outputs = engine.step()
                state = engine.queue_state()
                if outputs:
                    empty_steps = 0
                else:  # only idle iterations count: a long chunked prefill is progress
                    empty_steps = empty_steps + 1 if state.idle_steps != last_idle else 0
                last_idle = state.idle_steps
                self._note_admissions(t0, state)
                self._dispatch(outputs)
                self._active = True
                now = time.monotonic()
                wait_s = self._stats_due(now)
                if wait_s is not None and wait_s <= 0:
                    self._refresh_stats(state)
                    self._log_stats(now)
            self._fail(EngineDeadError("the server is shutting down"))
        except BaseException as exc:  # noqa: BLE001 - any failure kills the engine
            log.error("engine thread crashed:\n%s", traceback.format_exc())
            self._fail(EngineDeadError(f"engine failed: {type(exc).__name__}: {exc}"))

    def _apply(self, cmd) -> None:
        kind, payload = cmd
        if kind == "add":
            work, priority, arrival, slo, loop, fut, handles = payload
            kwargs = {} if slo is None else {"slo": slo}  # engines without SLOs take none
            ids_per_prompt = []
            try:
                for ids, samples in work:
                    rids = []
                    ids_per_prompt.append(rids)
                    for i, params in enumerate(samples):
                        extra = {"prefill_after": rids[0], "index": i} if rids else {}
                        rids.append(self.engine.add_request(ids, params, priority=priority,
                                                            arrival_time=arrival, **kwargs,
                                                            **extra))
            except Exception as exc:  # noqa: BLE001 - ValueError is a bad request
                for rids in ids_per_prompt:  # every prompt's samples or none
                    for rid in rids:
                        self.engine.abort(rid)
                with self._cv:
                    self._unadmitted -= sum(len(samples) for _, samples in work)
                if not isinstance(exc, ValueError):
                    log.error("add_request failed:\n%s", traceback.format_exc())
                    exc = RuntimeError(f"internal error: {type(exc).__name__}: {exc}")
                loop.call_soon_threadsafe(_resolve, fut, None, exc, self)
                return
            for rids, prompt_handles in zip(ids_per_prompt, handles, strict=True):
                for rid, handle in zip(rids, prompt_handles, strict=True):
                    self._sinks[rid] = _Sink(loop, handle)
                    self._unscheduled[rid] = arrival
            loop.call_soon_threadsafe(_resolve, fut, ids_per_prompt, None, self)
        elif kind == "abort":
            rid = payload
            self._sinks.pop(rid, None)
            if self._unscheduled.pop(rid, None) is not None:
                with self._cv:
                    self._unadmitted -= 1
            self.engine.abort(rid)
        elif kind == "call":
            fn, loop, fut = payload
            try:
                result, exc = fn(self.engine), None
            except Exception as e:  # noqa: BLE001 - handed to the caller
                result, exc = None, e
            loop.call_soon_threadsafe(_resolve, fut, result, exc, None)

    def _note_admissions(self, step_start: float, state) -> None:
        """Requests that left the waiting queue in the last step were admitted at its start.
        The admitted count and the free slots change together, under the lock, so `add`
        never sees one updated without the other."""
        waiting = state.waiting_ids
        done = [(rid, t) for rid, t in self._unscheduled.items() if rid not in waiting]
        for rid, arrival in done:
            del self._unscheduled[rid]
            if self.metrics is not None:
                self.metrics.queue.observe(max(0.0, step_start - arrival))
        with self._cv:
            self._unadmitted -= len(done)
            self._free_slots = max(0, self._max_num_seqs - state.running)

    def _dispatch(self, outputs) -> None:
        by_loop: dict[object, list] = {}
        prompt_tokens = 0
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if out.finished:
                self._sinks.pop(out.request_id, None)
                if self._unscheduled.pop(out.request_id, None) is not None:
                    with self._cv:
                        self._unadmitted -= 1
            if sink is None:
                continue
            new = list(out.new_token_ids)
            if new and not sink.started:
                sink.started = True
                prompt_tokens += len(out.prompt_token_ids)
            delta = Delta(new, out.finished, out.finish_reason, out)
            by_loop.setdefault(sink.loop, []).append((sink.handle.queue, delta))
        if self.metrics is not None and prompt_tokens:
            self.metrics.prompt_tokens.inc(prompt_tokens)
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that event loop is closed: its requests are gone
                pass

    def _refresh_stats(self, state=None) -> None:
        state = state or self.engine.queue_state()
        self.last_counts = (state.running, state.waiting)
        self.last_stats = self.engine.stats()
        with self._cv:  # idle: aborts may have freed slots since the last step
            self._free_slots = max(0, self._max_num_seqs - self.last_counts[0])

    def _stats_due(self, now: float) -> float | None:
        """Seconds until the next stats line is due (<= 0: now); None: no line pending
        (logging off, or no step since the last line). A line covers an interval: at most
        one per `log_stats_s`, however many busy spells it held."""
        if self._stats_line is None or not self._active:
            return None
        return self._stats_at + self.log_stats_s - now

    def _log_stats(self, now: float) -> None:
        """Engine thread: the stats line from `last_stats` (refreshed by the caller)."""
        self._active, self._stats_at = False, now
        if self._stats_line is None:
            return
        try:
            running, waiting = self.last_counts
            log.info("%s", self._stats_line(self.last_stats, running=running, waiting=waiting,
                                            now=now))
        except KeyError:  # an engine without the scheduler's counters (a test double)
            self._stats_line = None

    def snapshot(self) -> tuple[dict, int, int]:
        """Engine thread only (use through `call`): fresh stats and queue lengths."""
        self._refresh_stats()
        return self.last_stats, *self.last_counts

    def _fail(self, exc: BaseException) -> None:
        with self._cv:
            self._dead = True
            self.error = str(exc)
            cmds = list(self._cmds)
            self._cmds.clear()
            sinks = list(self._sinks.values())
            self._sinks.clear()
        if self.metrics is not None:
            self.metrics.healthy.set(0)
        for kind, payload in cmds:
            if kind in ("add", "call"):
                loop, fut = payload[-3:-1] if kind == "add" else payload[1:]
                _threadsafe(loop, _resolve, fut, None, exc, None)
        for sink in sinks:
            _threadsafe(sink.loop, _deliver, [(sink.handle.queue, exc)])


def _threadsafe(loop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # loop closed
        pass


def _resolve(fut: asyncio.Future, result, exc, engine_loop: EngineLoop | None) -> None:
    """On the event loop: complete `fut`, or abort the new request if nobody waits for it."""
    if fut.cancelled():
        if engine_loop is not None and exc is None and result is not None:
            for rids in result:  # the request ids an add made, per prompt
                for rid in rids:
                    engine_loop.abort(rid)
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


def _deliver(items) -> None:
    for queue, item in items:
        queue.put_nowait(item)
