"""Soak: a bounded, mixed load on lp-serve over the real engine, with every answer checked.

`run_soak(url, ...)` is the client: `concurrency` workers send `requests` requests drawn
from a seeded mix (KINDS: plain and streamed completions and chat, n > 1, logprobs and
top_logprobs, prompt_logprobs, prompts sharing a long prefix, penalties, clients that
leave mid-stream or before the answer, and bad requests), and check each answer (the mix
and the checks of one answer are lp_jax/bench/soak_mix.py):

- a good request is answered in full: every choice ends with "length" (all of them set
  ignore_eos), usage.completion_tokens is n x max_tokens, a stream sends one chunk per
  token per choice, then its usage chunk and [DONE]; log-probability lists have one entry
  per token;
- a bad request gets the 4xx it should, with an OpenAI error body;
- nothing gets a 5xx; no request is lost (every one is answered, or cut by the client);
- at the end the running/waiting/KV gauges return to 0, and the counters agree with what
  was sent (finished requests, invalid ones, generated tokens in both counts).

`main()` starts `python -m lp_jax.serve` (the tiny model by default) on 127.0.0.1 and a
free port, samples the server's RSS each `--sample-s`, runs the soak, SIGTERMs the
server (it must drain and exit 0) and writes soak.json and soak.md to --out. Exit
status 1 on any violation.

    .venv/bin/python launch/soak.py --requests 10000 --concurrency 32 --max-tokens 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402

from lp_jax.bench.soak_mix import (  # noqa: E402
    CUT_MAX_TOKENS,
    ERROR_KEYS,
    INVALID_ROUTES,
    KINDS,
    Mix,
    check_body,
    check_stream,
)
from lp_jax.core.metrics import percentile  # noqa: E402
from lp_jax.server.prometheus import parse_text  # noqa: E402

SERVER_FLAGS = ("--scheduling", "layered", "--max-num-seqs", "16", "--max-model-len", "512",
                "--max-num-batched-tokens", "256", "--token-buckets", "4,16,64,272",
                "--max-waiting", "4096", "--log-stats-interval", "60")


def metric(m: dict[str, float], name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for key, v in m.items() if key.partition("{")[0] == name
               and all(w in key for w in want))


# ---------------------------------------------------------------------- client
async def _send(s, url: str, kind: str, path: str, body, e: dict) -> tuple[str, int, str]:
    """One request: (outcome, HTTP status, detail). Outcomes: ok, mismatch, 5xx, status
    (an unexpected status), cut_stream, cut_early (the client gave up before an answer)."""
    if kind == "bad":
        method, bpath, data, want = body
        async with s.request(method, url + bpath, data=data,
                             headers={"Content-Type": "application/json"}) as r:
            text = await r.text()
        if r.status >= 500:
            return "5xx", r.status, text[:300]
        try:
            err = json.loads(text)["error"]
            ok = r.status == want and set(err) == ERROR_KEYS
        except (ValueError, KeyError, TypeError):
            ok = False
        return ("ok" if ok else "status"), r.status, "" if ok else f"{bpath}: {text[:300]}"
    if kind == "cut":
        if body["stream"]:
            r = await s.post(url + path, json=body)
            if r.status != 200:
                text = await r.text()
                r.close()
                return ("5xx" if r.status >= 500 else "status"), r.status, text[:300]
            for _ in range(e["after"]):
                await r.content.readuntil(b"\n\n")
            r.close()  # leave mid-stream: the server must abort the request
            return "cut_stream", 200, ""
        task = asyncio.ensure_future(s.post(url + path, json=body))
        await asyncio.sleep(e["delay"])
        if task.done():  # answered (headers at least) before the client gave up
            r = task.result()
            r.close()
            return ("5xx" if r.status >= 500 else "cut_early"), r.status, ""
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return "cut_early", 0, ""
    async with s.post(url + path, json=body) as r:
        data = await r.read()
    if r.status != 200:
        return ("5xx" if r.status >= 500 else "status"), r.status, data[:300].decode("replace")
    if e["stream"]:
        events = [ev for ev in data.decode().split("\n\n") if ev.strip()]
        bad = check_stream(events, e)
    else:
        bad = check_body(json.loads(data), e)
    return ("mismatch" if bad else "ok"), 200, "; ".join(bad)[:500]


async def _get_metrics(s, url: str) -> dict[str, float]:
    async with s.get(f"{url}/metrics") as r:
        return parse_text(await r.text())


async def _settle(s, url: str, model: str, timeout: float) -> dict[str, float]:
    """/metrics once the running and waiting gauges and KV usage read 0 (or at timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        m = await _get_metrics(s, url)
        gauges = [metric(m, f"lp:{g}", model_name=model) for g in
                  ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")]
        if not any(gauges) or time.monotonic() > deadline:
            return m
        await asyncio.sleep(0.2)


async def run_soak(url: str, *, requests: int, concurrency: int, seed: int = 0,
                   max_tokens: int = 8, request_timeout: float = 300.0,
                   sample_s: float = 60.0, probe=None, settle_s: float = 60.0,
                   log=print) -> dict:
    """Runs the soak against `url`; returns counts, per-minute figures, the end gauges and
    `violations` (empty: the server passed). `probe()`, if given, is called every
    `sample_s` seconds and at the end; its dict (e.g. {"rss_mb": ...}) is recorded."""
    timeout = aiohttp.ClientTimeout(total=request_timeout)
    conn = aiohttp.TCPConnector(limit=concurrency + 4)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as s:
        async with s.get(f"{url}/v1/models") as r:
            card = (await r.json())["data"][0]
        model, max_model_len = card["id"], card["max_model_len"]
        mix = Mix(seed, max_model_len, max_tokens)
        before = await _get_metrics(s, url)
        records: list[dict] = []
        samples: list[dict] = []
        t0 = time.perf_counter()
        next_i = 0

        async def worker():
            nonlocal next_i
            while next_i < requests:
                i, next_i = next_i, next_i + 1
                kind, path, body, e = mix(i)
                start = time.perf_counter()
                try:
                    outcome, status, detail = await _send(s, url, kind, path, body, e)
                except (TimeoutError, aiohttp.ClientError) as exc:
                    outcome, status, detail = "lost", 0, f"{type(exc).__name__}: {exc}"
                except (ValueError, KeyError, TypeError, IndexError) as exc:  # a bad body
                    outcome, status, detail = "mismatch", 200, f"{type(exc).__name__}: {exc}"
                except Exception as exc:  # noqa: BLE001 - say, a stream cut short: counted
                    outcome, status, detail = "lost", 0, f"{type(exc).__name__}: {exc}"
                end = time.perf_counter()
                records.append({"i": i, "kind": kind, "outcome": outcome, "status": status,
                                "detail": detail, "t": end - t0, "latency": end - start,
                                "n": e.get("n", 0), "tokens": e.get("n", 0) * e.get("k", 0),
                                "invalid": kind == "bad" and body[:2] in INVALID_ROUTES})
                if outcome not in ("ok", "cut_stream", "cut_early"):
                    log(f"request {i} ({kind}): {outcome} {status} {detail}")

        async def sampler():
            while True:
                samples.append({"t": time.perf_counter() - t0, "done": len(records),
                                **(probe() if probe else {})})
                await asyncio.sleep(sample_s)

        sampling = asyncio.create_task(sampler())
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds = time.perf_counter() - t0
        sampling.cancel()
        after = await _settle(s, url, model, settle_s)
        samples.append({"t": time.perf_counter() - t0, "done": len(records),
                        **(probe() if probe else {})})
    return summarize(records, samples, before, after, model=model, seconds=seconds,
                     requests=requests, concurrency=concurrency, seed=seed,
                     max_model_len=max_model_len, bad=len(mix.bad))


def summarize(records, samples, before, after, *, model, seconds, requests, **info) -> dict:
    kinds = {k: sum(r["kind"] == k for r in records) for k in KINDS}
    outcomes: dict[str, int] = {}
    for r in records:
        outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
    good = [r for r in records if r["kind"] not in ("bad", "cut")]
    ok = [r for r in good if r["outcome"] == "ok"]
    minutes = []
    for m in range(int(seconds // 60) + 1):
        lat = [r["latency"] * 1e3 for r in ok if m * 60 <= r["t"] < (m + 1) * 60]
        rss = [x["rss_mb"] for x in samples if "rss_mb" in x and m * 60 <= x["t"] < (m + 1) * 60]
        minutes.append({"minute": m, "requests": sum(m * 60 <= r["t"] < (m + 1) * 60
                                                     for r in records),
                        "p50_ms": percentile(lat, 50), "p99_ms": percentile(lat, 99),
                        "rss_mb": max(rss) if rss else None})

    def delta(name, **labels):
        return metric(after, name, model_name=model, **labels) - metric(
            before, name, model_name=model, **labels)

    gauges = {g: metric(after, f"lp:{g}", model_name=model) for g in
              ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
               "compilations_after_warmup", "engine_healthy")}
    counters = {"finished": {reason: delta("lp:request_success_total", finished_reason=reason)
                             for reason in ("length", "stop", "abort")},
                "rejected": {reason: delta("lp:request_rejected_total", reason=reason)
                             for reason in ("invalid", "overloaded", "unauthorized",
                                            "engine_dead", "shutting_down")},
                "generation_tokens": delta("lp:generation_tokens_total"),
                "request_generation_tokens": delta("lp:request_generation_tokens_sum"),
                "prefix_cache_hits": delta("lp:prefix_cache_hits_total"),
                "prefix_cache_queries": delta("lp:prefix_cache_queries_total")}
    violations = check_end(records, outcomes, gauges, counters, requests=requests)
    return {"model": model, "requests": requests, "seconds": seconds, **info,
            "kinds": kinds, "outcomes": outcomes, "gauges_end": gauges, "counters": counters,
            "good_tokens": sum(r["tokens"] for r in ok), "minutes": minutes,
            "samples": samples, "violations": violations,
            "failures": [r for r in records if r["outcome"] not in
                         ("ok", "cut_stream", "cut_early")][:50]}


def check_end(records, outcomes, gauges, counters, *, requests) -> list[str]:
    """The run's violations: any lost, 5xx, mismatched or mis-answered request, gauges
    not back at 0, counters that disagree with what was sent."""
    v = [f"{outcomes[o]} requests {o}" for o in ("lost", "5xx", "mismatch", "status")
         if outcomes.get(o)]
    if len(records) != requests:
        v.append(f"{requests - len(records)} requests never finished on the client")
    for g in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
              "compilations_after_warmup"):
        if gauges[g]:
            v.append(f"lp:{g} is {gauges[g]} at the end")
    if gauges["engine_healthy"] != 1:
        v.append("lp:engine_healthy is not 1")
    good = [r for r in records if r["kind"] not in ("bad", "cut")]
    fin = counters["finished"]
    n_good = sum(r["n"] for r in good)
    cut_stream = outcomes.get("cut_stream", 0)
    cuts = cut_stream + outcomes.get("cut_early", 0)
    total = sum(fin.values())
    # A client that gives up within milliseconds may close before the server dispatches
    # its request, and a cut request may finish before the server sees the client leave.
    if not n_good + cut_stream <= total <= n_good + cuts:
        v.append(f"{total:.0f} requests finished on the server; expected "
                 f"{n_good + cut_stream}..{n_good + cuts} ({n_good} good choices, {cuts} cut)")
    if fin["length"] < n_good or fin["stop"]:
        v.append(f"finished by reason {fin}: expected >= {n_good} length, 0 stop")
    invalid = sum(r["kind"] == "bad" and r["outcome"] == "ok" and r["invalid"]
                  for r in records)
    rej = counters["rejected"]
    if rej["invalid"] != invalid or any(rej[k] for k in rej if k != "invalid"):
        v.append(f"rejected {rej}: expected {invalid} invalid and nothing else")
    if counters["generation_tokens"] != counters["request_generation_tokens"]:
        v.append(f"lp:generation_tokens_total grew {counters['generation_tokens']:.0f}, "
                 f"lp:request_generation_tokens_sum {counters['request_generation_tokens']:.0f}")
    sent = sum(r["tokens"] for r in good)
    if not sent <= counters["generation_tokens"] <= sent + cuts * CUT_MAX_TOKENS:
        v.append(f"generation_tokens grew {counters['generation_tokens']:.0f} for {sent} "
                 f"tokens sent and {cuts} cut requests")
    if any(r["kind"] == "prefix" for r in good) and not counters["prefix_cache_hits"]:
        v.append("no prefix-cache hit although prompts shared a prefix")
    return v


# ---------------------------------------------------------------------- report
def _fmt(x) -> str:
    return "-" if x is None or x != x else f"{x:.0f}"


def markdown(r: dict) -> str:
    rss = [x["rss_mb"] for x in r["samples"] if "rss_mb" in x]
    lines = [f"soak: {r['requests']} requests at concurrency {r['concurrency']} (seed "
             f"{r['seed']}) in {r['seconds']:.0f} s ({r['requests'] / r['seconds']:.1f} req/s), "
             f"model {r['model']}, max_model_len {r['max_model_len']}",
             "", "| kind | requests |", "| --- | ---: |"]
    lines += [f"| {k} | {v} |" for k, v in r["kinds"].items()]
    lines += ["", "outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(r["outcomes"].items())),
              f"tokens generated for checked requests: {r['good_tokens']}",
              "finished on the server: " + ", ".join(
                  f"{k} {v:.0f}" for k, v in r["counters"]["finished"].items()),
              "rejected: " + ", ".join(f"{k} {v:.0f}" for k, v in
                                       r["counters"]["rejected"].items() if v),
              f"prefix cache: {r['counters']['prefix_cache_hits']:.0f} of "
              f"{r['counters']['prefix_cache_queries']:.0f} prompt tokens hit",
              "gauges at the end: " + ", ".join(f"{k} {v:g}" for k, v in
                                                r["gauges_end"].items())]
    if rss:
        lines.append(f"server RSS: start {rss[0]:.0f} MB, peak {max(rss):.0f} MB, "
                     f"end {rss[-1]:.0f} MB")
    if "server_exit" in r:
        lines.append(f"server exit status after SIGTERM: {r['server_exit']}")
    lines += ["", "| minute | requests | p50 ms | p99 ms | peak RSS MB |", "| ---: | ---: | ---: | "
              "---: | ---: |"]
    lines += [f"| {m['minute']} | {m['requests']} | {_fmt(m['p50_ms'])} | {_fmt(m['p99_ms'])} "
              f"| {_fmt(m['rss_mb'])} |" for m in r["minutes"]]
    lines += ["", "violations: " + ("; ".join(r["violations"]) or "none")]
    return "\n".join(lines) + "\n"


def rss_mb(pid: int) -> float:
    """VmRSS of process `pid` in MB (1e6 bytes)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024 / 1e6
    raise ValueError(f"no VmRSS for {pid}")


def main(argv=None) -> int:
    from lp_jax.bench.processes import free_port, wait_healthy

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=8,
                   help="good requests ask for 1 to this many tokens")
    p.add_argument("--sample-s", type=float, default=60.0, help="seconds between RSS samples")
    p.add_argument("--max-rss-growth-mb", type=float, default=300.0,
                   help="a violation if the server's RSS grows more than this after the "
                        "first minute")
    p.add_argument("--url", default=None, help="soak this running server instead of starting "
                                               "one (no RSS then)")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "soak")
    p.add_argument("server_args", nargs="*", help=f"lp-serve flags after '--' [default: "
                                                  f"{' '.join(SERVER_FLAGS)}]")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    proc = None
    probe = None
    url = args.url
    if url is None:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "lp_jax.serve", "--host", "127.0.0.1", "--port", str(port),
               *(args.server_args or SERVER_FLAGS)]
        print("server:", " ".join(cmd[1:]), flush=True)
        env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        log_file = open(args.out / "server.log", "w")  # noqa: SIM115 - the server's lifetime
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log_file,
                                stderr=subprocess.STDOUT)
        probe = lambda: {"rss_mb": rss_mb(proc.pid)}  # noqa: E731
    try:
        if proc is not None:
            t0 = time.monotonic()
            wait_healthy(url, proc, timeout=args.startup_timeout)
            print(f"healthy after {time.monotonic() - t0:.0f} s; soaking", flush=True)
        r = asyncio.run(run_soak(url, requests=args.requests, concurrency=args.concurrency,
                                 seed=args.seed, max_tokens=args.max_tokens,
                                 sample_s=args.sample_s, probe=probe))
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = "killed after 60 s"
    if proc is not None:
        r["server_exit"] = code
        if code != 0:
            r["violations"].append(f"the server exited with {code} after SIGTERM")
        rss = [x["rss_mb"] for x in r["samples"]]
        base = next((x["rss_mb"] for x in r["samples"] if x["t"] >= 60), rss[0])
        if max(rss) - base > args.max_rss_growth_mb:
            r["violations"].append(f"server RSS grew from {base:.0f} MB (after a minute) to "
                                   f"{max(rss):.0f} MB")
        errors = [line for line in (args.out / "server.log").read_text().splitlines()
                  if " ERROR " in line or "Traceback" in line]
        r["server_log_errors"] = errors[:20]
        if errors:
            r["violations"].append(f"{len(errors)} ERROR/Traceback lines in server.log")
    r["command"] = " ".join(["launch/soak.py", *(argv if argv is not None else sys.argv[1:])])
    (args.out / "soak.json").write_text(json.dumps(r, indent=1))
    md = markdown(r)
    (args.out / "soak.md").write_text(md)
    print(md, f"wrote {args.out}/soak.json and soak.md", sep="\n")
    return 1 if r["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
