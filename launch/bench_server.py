"""How many requests per second the HTTP layer itself sustains.

Starts `lp-serve --mock-engine` (an engine that generates instantly, so everything
measured is the server: HTTP parsing, validation, tokenization, the engine-thread hand-off,
detokenization, JSON and SSE) in a subprocess on a free loopback port, then fires
--num-requests requests at --concurrency from this process, non-streamed and streamed,
and prints requests/s, tokens/s and latency percentiles. The client shares the machine
with the server, so the figures are a lower bound.

    .venv/bin/python launch/bench_server.py --num-requests 2000 --concurrency 64
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402

from lp_jax.bench.processes import free_port, wait_healthy  # noqa: E402
from lp_jax.core.metrics import percentile  # noqa: E402


async def load(url: str, n: int, concurrency: int, max_tokens: int, stream: bool) -> dict:
    body = {"prompt": "The quick brown fox jumps over the lazy dog", "max_tokens": max_tokens,
            "ignore_eos": True, "stream": stream}
    latencies: list[float] = []
    tokens = errors = 0
    next_i = 0

    async def worker(session):
        nonlocal tokens, errors, next_i
        while next_i < n:
            next_i += 1
            t0 = time.perf_counter()
            async with session.post(f"{url}/v1/completions", json=body) as r:
                if r.status != 200:
                    errors += 1
                    await r.read()
                    continue
                if stream:
                    async for line in r.content:
                        if line.startswith(b"data: {"):
                            tokens += 1
                else:
                    tokens += (await r.json())["usage"]["completion_tokens"]
            latencies.append(time.perf_counter() - t0)

    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
    return {"requests": n, "errors": errors, "seconds": elapsed, "req_per_s": n / elapsed,
            "tok_per_s": tokens / elapsed, "p50_ms": percentile(latencies, 50) * 1e3,
            "p99_ms": percentile(latencies, 99) * 1e3}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=16)
    args = p.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.Popen([sys.executable, "-m", "lp_jax.serve", "--mock-engine", "--port",
                             str(port), "--log-level", "warning"], cwd=ROOT, env=env)
    try:
        wait_healthy(url, proc)
        asyncio.run(load(url, min(100, args.num_requests), 8, args.max_tokens, False))  # warm
        print(f"mock engine, {args.num_requests} requests, concurrency {args.concurrency}, "
              f"max_tokens {args.max_tokens}, {os.cpu_count()} CPUs (client + server)")
        for stream in (False, True):
            r = asyncio.run(load(url, args.num_requests, args.concurrency, args.max_tokens,
                                 stream))
            print(f"{'streamed' if stream else 'non-streamed':>12}: {r['req_per_s']:7.1f} req/s"
                  f"  {r['tok_per_s']:8.0f} tok/s  p50 {r['p50_ms']:6.1f} ms  p99 "
                  f"{r['p99_ms']:6.1f} ms  errors {r['errors']}")
    finally:
        proc.terminate()
        proc.wait(10)


if __name__ == "__main__":
    main()
