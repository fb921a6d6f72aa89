"""`lp-bench --probe`: a reliability probe of a running OpenAI-compatible server.

It tries what an outside user or attacker would, on loopback, in bounded loops:

1. a battery of bad inputs (malformed JSON, bad fields, path tricks, compressed bodies, a
   prompt of exactly the context, a batch no queue can take, amplification), each with
   the statuses lp-serve documents (docs/server_limits.md);
2. attacks, each sent `attack_copies` times at once while `/health` is polled: gzip bombs,
   oversized bodies, amplification requests, an overload burst;
3. load with cut clients: plain and streamed completions and chats whose token counts are
   checked (ignore_eos), and clients that leave mid-stream or before the answer;
4. a soak: that load again for `soak_s` seconds;
5. the end state: /metrics' running, waiting and KV gauges back to 0;
6. with `drain` and the server's pid: SIGTERM while streams run; they must finish, and
   the process must exit.

A finding is any 5xx, a status other than the documented one, a request that hangs past
`timeout_s` (or a lost connection), a wrong token count, or a gauge left nonzero; the
probe passes when there is none. Figures, not verdicts: the worst `/health` latency under
each phase, and the server's RSS (from /proc, given its pid) before, at peak and after.
They are benchmark figures, to be read against the tolerances in docs/benchmarks/probe.md.
`short=True` is the CI version (a few seconds on the mock engine).
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import signal
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from lp_jax.server.prometheus import parse_text

JSON = {"Content-Type": "application/json"}
GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")


@dataclass
class Case:
    """One request of the battery and the statuses it may get."""

    name: str
    path: str
    body: bytes
    want: tuple[int, ...]
    method: str = "POST"
    headers: dict = field(default_factory=dict)


def _j(obj) -> bytes:
    return json.dumps(obj).encode()


def gzip_bomb(inflated_bytes: int) -> bytes:
    """A gzip stream of a JSON prefix and `inflated_bytes` spaces (1 GiB: about 1 MB)."""
    comp = zlib.compressobj(9, zlib.DEFLATED, 31)  # 31: the gzip container
    out = [comp.compress(b'{"prompt": "')]
    chunk = b" " * (1 << 20)
    for _ in range(inflated_bytes >> 20):
        out.append(comp.compress(chunk))
    out.append(comp.flush())
    return b"".join(out)


def battery(max_model_len: int, model: str, bomb: bytes) -> list[Case]:
    """The bad-input battery for a server of `max_model_len` serving `model`."""
    ok = {"prompt": [1, 2, 3], "max_tokens": 1}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    full = list(range(1, max_model_len + 1))
    cases = [
        Case("malformed JSON", "/v1/completions", b'{"prompt": ', (400,)),
        Case("a JSON array", "/v1/completions", b"[1, 2]", (400,)),
        Case("a JSON string", "/v1/completions", b'"x"', (400,)),
        Case("empty body", "/v1/completions", b"", (400,)),
        Case("no prompt", "/v1/completions", _j({"max_tokens": 1}), (400,)),
        Case("empty prompt", "/v1/completions", _j({"prompt": ""}), (400,)),
        Case("empty id list", "/v1/completions", _j({"prompt": []}), (400,)),
        Case("id out of range", "/v1/completions", _j({"prompt": [10 ** 9]}), (400,)),
        Case("negative id", "/v1/completions", _j({"prompt": [-1]}), (400,)),
        Case("max_tokens -1", "/v1/completions", _j({**ok, "max_tokens": -1}), (400,)),
        Case("max_tokens a string", "/v1/completions", _j({**ok, "max_tokens": "x"}), (400,)),
        Case("temperature -1", "/v1/completions", _j({**ok, "temperature": -1}), (400,)),
        Case("top_p 2", "/v1/completions", _j({**ok, "top_p": 2}), (400,)),
        Case("n 0", "/v1/completions", _j({**ok, "n": 0}), (400,)),
        Case("n 10**6", "/v1/completions", _j({**ok, "n": 10 ** 6}), (400,)),
        Case("logprobs 21", "/v1/completions", _j({**ok, "logprobs": 21}), (400,)),
        Case("17 stop strings", "/v1/completions", _j({**ok, "stop": ["a"] * 17}), (400,)),
        Case("seed 2**70", "/v1/completions", _j({**ok, "seed": 2 ** 70}), (400,)),
        Case("lone surrogate", "/v1/completions", b'{"prompt": "a\\ud800"}', (400,)),
        Case("priority a string", "/v1/completions", _j({**ok, "priority": "x"}), (400,)),
        Case("negative TTFT SLO", "/v1/completions", _j({**ok, "ttft_slo_ms": -1}), (400,)),
        Case("unknown model", "/v1/completions", _j({**ok, "model": "no-such"}), (404,)),
        Case("messages not a list", "/v1/chat/completions", _j({"messages": "hi"}), (400,)),
        Case("bad role", "/v1/chat/completions",
             _j({"messages": [{"role": 5, "content": "hi"}]}), (400,)),
        Case("unknown route", "/v1/nothing", _j(ok), (401, 404)),
        Case("GET on a POST route", "/v1/completions", b"", (401, 405), method="GET"),
        Case("dot-dot path", "/v1/../../etc/passwd", b"", (401, 404), method="GET"),
        Case("encoded dot-dot", "/%2e%2e/%2e%2e/etc/passwd", b"", (404,), method="GET"),
        Case("tokenize a bad field", "/tokenize", _j({"prompt": 5}), (400,)),
        Case("detokenize bad ids", "/detokenize", _j({"tokens": ["x"]}), (400,)),
        # The failures.
        Case("Content-Encoding gzip, plain body", "/v1/completions", _j(ok), (415,),
             headers={"Content-Encoding": "gzip"}),
        Case("Content-Encoding deflate, plain body", "/v1/completions", _j(ok), (415,),
             headers={"Content-Encoding": "deflate"}),
        Case("Content-Encoding br", "/v1/completions", _j(ok), (415,),
             headers={"Content-Encoding": "br"}),
        Case("a gzipped body", "/v1/completions", gzip.compress(_j(ok)), (415,),
             headers={"Content-Encoding": "gzip"}),
        Case("a gzip bomb", "/v1/completions", bomb, (415,),
             headers={"Content-Encoding": "gzip"}),
        Case("21 prompts on an idle server", "/v1/completions",
             _j({"prompt": [[1, 2]] * 21, "max_tokens": 1}), (200, 400)),
        Case("4,096 sequences", "/v1/completions",
             _j({"prompt": [[1, 2]] * 256, "n": 16, "max_tokens": 1}), (400,)),
        Case("amplification", "/v1/completions", _j(_amplifier()), (400,)),
        Case("full context, no max_tokens", "/v1/completions", _j({"prompt": full}), (400,)),
        Case("full context, max_tokens 1", "/v1/completions",
             _j({"prompt": full, "max_tokens": 1}), (400,)),
        Case("a good completion", "/v1/completions", _j({**ok, "model": model}), (200,)),
        Case("a good chat", "/v1/chat/completions", _j(chat), (200,)),
    ]
    return cases


def _amplifier() -> dict:
    """256 prompts x n = 16 x 128 tokens x 21 log-probability entries: 11 million entries
    from a 1.4 KB body."""
    return {"prompt": [[1, 2]] * 256, "n": 16, "max_tokens": 128, "logprobs": 20,
            "ignore_eos": True}


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024 / 1e6
    except OSError:
        return None
    return None


class Probe:
    """See the module docstring. `run()` returns the report (a dict, `findings` empty when
    the server passed)."""

    def __init__(self, url: str, *, api_key: str | None = None, pid: int | None = None,
                 short: bool = False, drain: bool = False, timeout_s: float = 120.0,
                 concurrency: int = 48, requests: int = 400, soak_s: float = 240.0,
                 attack_copies: int = 4, log=print):
        self.url = url.rstrip("/")
        self.auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.pid = pid
        self.drain = drain
        self.timeout_s = timeout_s
        self.log = log
        if short:
            concurrency, requests, soak_s, attack_copies = 8, 40, 1.0, 2
        self.short = short
        self.concurrency, self.requests = concurrency, requests
        self.soak_s, self.attack_copies = soak_s, attack_copies
        self.findings: list[str] = []
        self.phases: dict[str, dict] = {}
        self.outcomes: dict[str, int] = {}  # load requests by kind and outcome: "plain ok"
        self.rss: list[float] = []

    # ------------------------------------------------------------------ helpers
    def _count(self, kind: str, outcome: str) -> None:
        key = f"{kind} {outcome}"
        self.outcomes[key] = self.outcomes.get(key, 0) + 1

    def find(self, what: str) -> None:
        self.findings.append(what)
        self.log(f"FINDING: {what}")

    def _sample_rss(self) -> float | None:
        v = rss_mb(self.pid) if self.pid else None
        if v is not None:
            self.rss.append(v)
        return v

    async def _send(self, s, case: Case) -> tuple[int, dict, bytes]:
        async with s.request(case.method, self.url + case.path, data=case.body,
                             headers={**JSON, **self.auth, **case.headers}) as r:
            return r.status, dict(r.headers), await r.read()

    async def _check(self, s, case: Case, label: str) -> int:
        """Sends `case`; a finding for a 5xx, another status than documented, or a hang."""
        try:
            async with asyncio.timeout(self.timeout_s):
                status, headers, data = await self._send(s, case)
        except TimeoutError:
            self.find(f"{label} {case.name}: no answer within {self.timeout_s:g} s")
            return 0
        except aiohttp.ClientError as exc:
            if 415 in case.want or 413 in case.want:  # refused and closed mid-upload
                return case.want[0]
            self.find(f"{label} {case.name}: {type(exc).__name__}: {exc}")
            return 0
        if status not in case.want:
            self.find(f"{label} {case.name}: HTTP {status} (expected "
                      f"{' or '.join(map(str, case.want))}): {data[:200]!r}")
        elif status == 503 and "Retry-After" not in headers:
            self.find(f"{label} {case.name}: a 503 without Retry-After")
        return status

    async def _phase(self, name: str, work) -> None:
        """Runs `work()` while polling /health; records its worst latency and the RSS."""
        worst = 0.0
        failures = 0
        done = asyncio.Event()

        async def monitor():
            nonlocal worst, failures
            async with aiohttp.ClientSession() as s:
                while not done.is_set():
                    t0 = time.perf_counter()
                    try:
                        async with asyncio.timeout(self.timeout_s):
                            async with s.get(self.url + "/health") as r:
                                await r.read()
                                if r.status != 200:
                                    failures += 1
                    except (TimeoutError, aiohttp.ClientError):
                        failures += 1
                    worst = max(worst, time.perf_counter() - t0)
                    self._sample_rss()
                    await asyncio.sleep(0.02)

        mon = asyncio.create_task(monitor())
        t0 = time.perf_counter()
        sent = None
        try:
            sent = await work()
        finally:
            done.set()
            await mon
        if failures:
            self.find(f"{name}: /health failed {failures} times")
        self.phases[name] = {"seconds": round(time.perf_counter() - t0, 2),
                             "worst_health_ms": round(worst * 1e3, 1)}
        if isinstance(sent, int):
            self.phases[name]["requests"] = sent
        self.log(f"{name}: {self.phases[name]}")

    # -------------------------------------------------------------------- phases
    async def _battery(self, s, cases: list[Case]) -> None:
        for case in cases:
            await self._check(s, case, "battery:")

    async def _attack(self, s, case: Case) -> None:
        await asyncio.gather(*(self._check(s, case, "attack:")
                               for _ in range(self.attack_copies)))

    async def _overload(self, s) -> None:
        body = _j({"prompt": [1, 2, 3], "max_tokens": 8, "ignore_eos": True})
        case = Case("overload", "/v1/completions", body, (200, 503))
        await asyncio.gather(*(self._check(s, case, "overload:")
                               for _ in range(4 * self.concurrency)))

    async def _one(self, s, i: int, model: str) -> None:
        """One request of the load mix: plain or streamed, completion or chat, checked; or
        a client that leaves (mid-stream, or before any answer)."""
        kind = ("plain", "stream", "chat", "chat-stream", "cut-stream", "cut-early")[i % 6]
        k = 1 + i % 8
        chat = kind.startswith("chat")
        body = {"model": model, "max_tokens": k, "ignore_eos": True, "temperature": 0,
                "stream": "stream" in kind, "stream_options": {"include_usage": True}}
        if chat:
            body["messages"] = [{"role": "user", "content": f"say {i}"}]
        else:
            body["prompt"] = [1 + i % 50, 2, 3]
        if not body["stream"]:
            body.pop("stream_options")
        path = "/v1/chat/completions" if chat else "/v1/completions"
        url, hdrs = self.url + path, {**JSON, **self.auth}
        if kind == "cut-early":
            task = asyncio.ensure_future(s.post(url, data=_j(body), headers=hdrs))
            await asyncio.sleep(0.005 * (i % 4))
            task.cancel()
            r = (await asyncio.gather(task, return_exceptions=True))[0]
            if isinstance(r, aiohttp.ClientResponse):
                if r.status >= 500:
                    self.find(f"load {kind} {i}: HTTP {r.status}")
                r.close()
            self._count(kind, "left")
            return
        async with asyncio.timeout(self.timeout_s):
            async with s.post(url, data=_j(body), headers=hdrs) as r:
                if r.status != 200:
                    self.find(f"load {kind} {i}: HTTP {r.status}: {(await r.read())[:200]!r}")
                    return
                if kind == "cut-stream":
                    await r.content.readuntil(b"\n\n")
                    self._count(kind, "left")
                    return  # leaves: the server must abort the request
                data = await r.read()
        if body["stream"]:
            events = [e[6:] for e in data.decode().split("\n\n") if e.startswith("data: ")]
            if not events or events[-1] != "[DONE]":
                self.find(f"load {kind} {i}: the stream did not end with [DONE]")
                return
            usage = json.loads(events[-2]).get("usage") or {}
        else:
            usage = json.loads(data).get("usage") or {}
        if usage.get("completion_tokens") != k:
            self.find(f"load {kind} {i}: {usage.get('completion_tokens')} tokens, asked {k}")
        else:
            self._count(kind, "ok")

    async def _load(self, s, model: str, requests: int | None = None,
                    until: float | None = None) -> int:
        """The load mix at `concurrency`: `requests` of them, or until `until`."""
        sent = 0

        async def worker():
            nonlocal sent
            while (sent < requests) if requests is not None else (time.monotonic() < until):
                i, sent = sent, sent + 1
                try:
                    await self._one(s, i, model)
                except TimeoutError:
                    self.find(f"load {i}: no answer within {self.timeout_s:g} s")
                except (aiohttp.ClientError, ValueError, KeyError, IndexError) as exc:
                    self.find(f"load {i}: {type(exc).__name__}: {exc}")

        await asyncio.gather(*(worker() for _ in range(self.concurrency)))
        return sent

    async def _gauges(self, s, model: str) -> dict:
        """The running / waiting / KV gauges, once they read 0 (or after 30 s)."""
        deadline = time.monotonic() + 30.0
        while True:
            async with s.get(self.url + "/metrics", headers=self.auth) as r:
                m = parse_text(await r.text())
            g = {name: sum(v for key, v in m.items()
                           if key.partition("{")[0] in (f"lp:{name}", f"vllm:{name}"))
                 for name in GAUGES}
            if not any(g.values()) or time.monotonic() > deadline:
                return g
            await asyncio.sleep(0.2)

    async def _drain(self, s, model: str, max_model_len: int) -> None:
        """SIGTERM once 4 long streams have their first token: each must still end with
        [DONE] (the drain lets it finish), and the process must exit."""
        body = {"model": model, "prompt": [1, 2, 3], "max_tokens": min(256, max_model_len - 4),
                "ignore_eos": True, "stream": True}
        hdrs = {**JSON, **self.auth}
        started = asyncio.Semaphore(0)

        async def stream():
            async with s.post(self.url + "/v1/completions", data=_j(body), headers=hdrs) as r:
                first = await r.content.readuntil(b"\n\n")
                started.release()
                rest = await r.read()
                return r.status, (first + rest).endswith(b"data: [DONE]\n\n")

        tasks = [asyncio.create_task(stream()) for _ in range(4)]
        async with asyncio.timeout(self.timeout_s):
            for _ in tasks:
                await started.acquire()
        t0 = time.perf_counter()
        os.kill(self.pid, signal.SIGTERM)
        in_flight = sum(not t.done() for t in tasks)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for r in results:
            if r != (200, True):
                self.find(f"drain: an in-flight stream ended as {r!r}")
        while Path(f"/proc/{self.pid}").exists() and time.perf_counter() - t0 < 60:
            await asyncio.sleep(0.05)
        if Path(f"/proc/{self.pid}").exists():
            self.find("drain: the server still runs 60 s after SIGTERM")
        self.phases["drain"] = {"seconds": round(time.perf_counter() - t0, 2),
                                "requests": in_flight}

    # ----------------------------------------------------------------------- run
    async def run(self) -> dict:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        conn = aiohttp.TCPConnector(limit=4 * self.concurrency + 16)
        async with aiohttp.ClientSession(connector=conn, timeout=timeout) as s:
            async with s.get(self.url + "/v1/models", headers=self.auth) as r:
                card = (await r.json())["data"][0]
            model, max_model_len = card["id"], card["max_model_len"]
            rss_before = self._sample_rss()
            bomb = gzip_bomb((16 << 20) if self.short else (1 << 30))
            cases = battery(max_model_len, model, bomb)
            await self._phase("battery", lambda: self._battery(s, cases))
            names = {"a gzip bomb": "gzip bombs", "amplification": "amplification"}
            for case in cases:
                if case.name in names:
                    await self._phase(names[case.name], lambda c=case: self._attack(s, c))
            big = Case("oversized body", "/v1/completions",
                       b'{"prompt": "' + b"a" * ((4 if self.short else 16) << 20) + b'"}',
                       (413,))
            await self._phase("oversized bodies", lambda: self._attack(s, big))
            await self._phase("overload", lambda: self._overload(s))
            await self._phase("load with cuts", lambda: self._load(s, model, self.requests))
            until = time.monotonic() + self.soak_s
            await self._phase("soak", lambda: self._load(s, model, until=until))
            gauges = await self._gauges(s, model)
            for name, v in gauges.items():
                if v:
                    self.find(f"end: {name} is {v:g}, not 0")
            rss_after = self._sample_rss()
            if self.drain and self.pid:
                await self._drain(s, model, max_model_len)
        return {"url": self.url, "model": model, "max_model_len": max_model_len,
                "short": self.short, "concurrency": self.concurrency,
                "requests": self.requests, "soak_s": self.soak_s,
                "battery_cases": len(cases), "phases": self.phases, "gauges_end": gauges,
                "load_outcomes": dict(sorted(self.outcomes.items())),
                "rss_mb": {"before": rss_before, "peak": max(self.rss, default=None),
                           "after": rss_after},
                "findings": self.findings}


def markdown(r: dict) -> str:
    lines = [f"probe of {r['url']} ({r['model']}, max_model_len {r['max_model_len']}): "
             f"{r['battery_cases']} battery cases, load of {r['requests']} requests at "
             f"concurrency {r['concurrency']}, soak {r['soak_s']:g} s",
             "", "| phase | seconds | requests | worst /health ms |",
             "| --- | ---: | ---: | ---: |"]
    lines += [f"| {name} | {p['seconds']} | {p.get('requests', '-')} | "
              f"{p.get('worst_health_ms', '-')} |" for name, p in r["phases"].items()]
    rss = r["rss_mb"]
    if rss["before"] is not None:
        lines.append(f"\nserver RSS MB: before {rss['before']:.0f}, peak {rss['peak']:.0f}, "
                     f"after {rss['after']:.0f}")
    lines.append("load requests: " + ", ".join(f"{k} {v}"
                                               for k, v in r["load_outcomes"].items()))
    lines.append("gauges at the end: " + ", ".join(f"{k} {v:g}"
                                                   for k, v in r["gauges_end"].items()))
    lines.append("findings: " + ("; ".join(r["findings"]) or "none"))
    return "\n".join(lines) + "\n"


def run_probe(url: str, **kw) -> dict:
    return asyncio.run(Probe(url, **kw).run())


def main(args) -> dict:
    """lp-bench --probe: runs the probe with the parsed flags, prints the report, writes
    probe.json and probe.md to --output-dir; exit status 1 on any finding."""
    r = run_probe(args.base_url, api_key=args.api_key, pid=args.probe_pid,
                  short=args.probe_short, drain=args.probe_drain,
                  concurrency=args.max_concurrency or 48,
                  requests=args.num_requests or 400, soak_s=args.probe_soak_s)
    md = markdown(r)
    print(md)
    if args.output_dir:
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "probe.json").write_text(json.dumps(r, indent=1))
        (out / "probe.md").write_text(md)
    if r["findings"]:
        raise SystemExit(1)
    return r
