"""lp-bench: replay a workload against an OpenAI-compatible endpoint; TTFT, ITL, goodput.

    lp-bench --base-url http://127.0.0.1:8000 --workload sharegpt --num-requests 200 \\
        --request-rate 2,4,8 --ttft-slo 1.0 --itl-slo 0.1 --output-dir results/sharegpt

writes results.json, summary.png and TensorBoard scalars (tb/) to --output-dir.

    lp-bench --workload multi-slo --length-scale 0.05 --slo-scale 4 --output-len 8 \\
        --slo-class chat:590:250 --slo-class summarisation:6833:4000::0.5

sends FlowPrefill's mix of task classes, each request with its own TTFT objective, and
reports attainment per class.

    lp-bench --probe --base-url http://127.0.0.1:8000 --probe-pid PID --output-dir runs/probe

probes a running server's reliability (probe.py): exit status 1 on any finding.

    lp-bench --workload multi-turn --turns 4 --system-len 1024 --prompt-len 64 \
        --output-len 64 --turn-gap 2 --request-rate 0.5 --scrape-metrics

sends chat conversations whose every turn resends the whole history (--request-rate:
conversations per second), the workload prefix caching serves; the server's
lp:prefix_cache_hits_total lands in the results with --scrape-metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path

from lp_jax.bench import report
from lp_jax.bench.client import run_requests
from lp_jax.bench.progress import ProgressBar
from lp_jax.bench.workload import (
    LENGTH_MODELS,
    MULTI_SLO,
    MULTI_TURN,
    QWEN_TRACE_CLASSES,
    build_multi_slo_workload,
    build_multi_turn_workload,
    build_workload,
    load_trace,
    parse_slo_class,
    resolve_length_model,
    slo_classes_config,
)
from lp_jax.serve import HelpFormatter


def _rates(s: str) -> list[float]:
    try:
        rates = [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated rates, got {s!r}") from None
    if not rates or any(not r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"rates must be > 0 (inf allowed), got {s!r}")
    return rates


def _slo_class(s: str):
    try:
        return parse_slo_class(s)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"must be finite and > 0, got {s}")
    return v


def _default_classes_help() -> str:
    parts = []
    for c in QWEN_TRACE_CLASSES:
        mark = " (prompt length ASSUMED)" if "prompt_len" in c.assumed else ""
        parts.append(f"{c.name}:{c.prompt_len:g}:{c.ttft_ms:g}{mark}")
    return "; ".join(parts)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lp-bench", description=__doc__.splitlines()[0],
                                formatter_class=HelpFormatter)
    t = p.add_argument_group("target")
    t.add_argument("--base-url", default="http://127.0.0.1:8000")
    t.add_argument("--model", default=None, help="model name to send [default: the server's "
                   "first, from /v1/models]")
    t.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    t.add_argument("--api-key", default=None)
    t.add_argument("--extra-body", type=json.loads, default=None,
                   help="JSON object merged into every request body")
    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=(*LENGTH_MODELS, MULTI_SLO, MULTI_TURN),
                   default="sharegpt",
                   help="length model (ignored with --trace): sharegpt = ShareGPT-8k "
                   "quantiles; arxiv = whole articles, lognormal prompts (median 7000, "
                   "2048-16384) and outputs (median 200, 32-512); arxiv-4k / azure-conv = "
                   "lengths resampled from the bundled traces; fixed = --prompt-len / "
                   "--output-len; multi-slo = a mix of --slo-class task classes, each "
                   "request sending its class's ttft_slo_ms / tbt_slo_ms, outputs "
                   "--output-len; multi-turn = chat conversations resending their history "
                   "each turn (see the multi-turn options)")
    w.add_argument("--trace", default=None, help="CSV/JSONL trace: timestamp, input and "
                   "output lengths, optional class and TTFT / TBT SLO columns "
                   "(docs/trace_format.md)")
    w.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply trace timestamps (0.5 replays twice as fast)")
    w.add_argument("--num-requests", type=int, default=None,
                   help="[default: 100, or the whole trace]")
    w.add_argument("--request-rate", type=_rates, default=[1.0],
                   help="requests/s; comma-separated for a sweep; inf sends all at once")
    w.add_argument("--arrival", choices=("poisson", "gamma"), default="poisson")
    w.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape: gap CV 1/sqrt(burstiness), < 1 burstier than poisson")
    w.add_argument("--prompt-len", type=int, default=128, help="--workload fixed")
    w.add_argument("--output-len", type=int, default=128, help="--workload fixed")
    w.add_argument("--max-prompt-len", type=int, default=None,
                   help="fit prompt lengths under this (see --length-mode)")
    w.add_argument("--max-output-len", type=int, default=None)
    w.add_argument("--length-mode", choices=("scale", "clip"), default="scale")
    w.add_argument("--prompt-kind", choices=("token-ids", "text"), default="token-ids")
    w.add_argument("--vocab-size", type=int, default=500,
                   help="random token ids are drawn from [0, vocab-size)")
    w.add_argument("--tokenizer", default=None,
                   help="tokenizer.json (or its directory) for text prompts of exact length")
    w.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos (outputs may end early)")
    w.add_argument("--temperature", type=float, default=0.0)
    w.add_argument("--seed", type=int, default=0)
    m = p.add_argument_group("multi-SLO workload (--workload multi-slo)")
    m.add_argument("--slo-class", dest="slo_classes", action="append", type=_slo_class,
                   default=None, metavar="NAME:PROMPT_LEN:TTFT_MS[:TBT_MS][:WEIGHT]",
                   help="a task class, repeatable: mean prompt tokens, TTFT (and TBT) "
                   "objective in ms, relative weight (default 1; 'chat:590:250::2' sets a "
                   "weight without TBT) [default: FlowPrefill's QwenTrace classes, "
                   f"{_default_classes_help()}, equal weights; the TTFT objectives and "
                   "weights are ASSUMED, the paper gives neither]")
    m.add_argument("--length-scale", type=_positive, default=1.0,
                   help="multiply every class's prompt length (0.05 for CPU runs); lengths "
                   "are clipped to --max-prompt-len, if unset to the server's max_model_len "
                   "less --output-len")
    m.add_argument("--slo-scale", type=_positive, default=1.0,
                   help="multiply every class's objectives")
    m.add_argument("--length-sigma", type=float, default=0.25,
                   help="sigma of each class's lognormal prompt lengths")
    m.add_argument("--send-slo-class", action="store_true",
                   help="also send slo_class, so the server labels its SLO metrics by "
                   "class (it must know the classes: start it with --slo-classes set to "
                   "results.json's server_slo_classes)")
    c = p.add_argument_group("multi-turn chat (--workload multi-turn)")
    c.add_argument("--turns", type=int, default=4,
                   help="turns per conversation; --num-requests / turns conversations start "
                   "at --request-rate per second; a user turn adds --prompt-len tokens, an "
                   "answer --output-len")
    c.add_argument("--system-len", type=int, default=0,
                   help="tokens of a system prompt every conversation opens with")
    c.add_argument("--turn-gap", type=float, default=1.0,
                   help="seconds between a conversation's turns (open loop)")
    q = p.add_argument_group("reliability probe (lp_jax/bench/probe.py)")
    q.add_argument("--probe", action="store_true",
                   help="probe --base-url instead: bad inputs, compressed and oversized "
                        "bodies, amplification, load with cut clients, overload, a soak "
                        "(and a drain); exit 1 on any 5xx, hang, lost request or gauge left "
                        "nonzero. Uses --api-key, --num-requests (400), --max-concurrency "
                        "(48), --output-dir")
    q.add_argument("--probe-pid", type=int, default=None,
                   help="the server's pid (same machine): its RSS, and --probe-drain")
    q.add_argument("--probe-soak-s", type=float, default=240.0, help="seconds of soak")
    q.add_argument("--probe-short", action="store_true",
                   help="the CI version: a few seconds")
    q.add_argument("--probe-drain", action="store_true",
                   help="end by SIGTERM to --probe-pid while streams run (stops the server)")
    r = p.add_argument_group("run and results")
    r.add_argument("--ttft-slo", type=float, default=1.0, help="seconds")
    r.add_argument("--itl-slo", type=float, default=0.1, help="max inter-token latency, s")
    r.add_argument("--max-concurrency", type=int, default=None)
    r.add_argument("--request-timeout", type=float, default=600.0)
    r.add_argument("--output-dir", default=None, help="results.json, summary.png, tb/")
    r.add_argument("--no-plot", dest="plot", action="store_false")
    r.add_argument("--no-tensorboard", dest="tensorboard", action="store_false")
    r.add_argument("--no-progress", dest="progress", action="store_false")
    r.add_argument("--scrape-metrics", action="store_true",
                   help="read the server's /metrics after each run into the results")
    return p


async def _get_json(url: str, api_key: str | None, timeout: float = 10.0):
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession() as s, s.get(
            url, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
        resp.raise_for_status()
        return await (resp.json() if "json" in resp.content_type else resp.text())


def _load_tokenizer(path):
    if path is None:
        return None
    from tokenizers import Tokenizer

    p = Path(path)
    return Tokenizer.from_file(str(p / "tokenizer.json" if p.is_dir() else p))


async def run(args) -> dict:
    base = args.base_url.rstrip("/")
    model = args.model
    multi = args.workload == MULTI_SLO
    own_lengths = multi or args.workload == MULTI_TURN  # workloads that draw their lengths
    models = None
    if model is None or (own_lengths and args.max_prompt_len is None):
        try:
            models = (await _get_json(f"{base}/v1/models", args.api_key))["data"]
            model = model or models[0]["id"]
        except Exception as exc:  # noqa: BLE001 - the user can name the model instead
            if model is None:
                raise SystemExit(f"lp-bench: cannot list models at {base}/v1/models ({exc}); "
                                 "pass --model") from None
    if args.endpoint == "chat" and args.prompt_kind != "text":
        raise SystemExit("lp-bench: --endpoint chat needs --prompt-kind text")
    if own_lengths and args.trace:
        raise SystemExit(f"lp-bench: --workload {args.workload} draws its own lengths; "
                         "drop --trace")
    max_prompt_len = args.max_prompt_len
    if own_lengths and max_prompt_len is None:  # fit prompt + output in the server's context
        limit = next((m.get("max_model_len") for m in models or () if m.get("id") == model),
                     None)
        max_prompt_len = max(1, limit - args.output_len) if isinstance(limit, int) else None
    classes = tuple(args.slo_classes or QWEN_TRACE_CLASSES)
    try:
        trace = load_trace(args.trace) if args.trace else None
    except ValueError as exc:  # names the file and line
        raise SystemExit(f"lp-bench: {exc}") from None
    lengths = None if trace is not None or own_lengths else resolve_length_model(  # once
        args.workload, prompt_len=args.prompt_len, output_len=args.output_len)
    tokenizer = _load_tokenizer(args.tokenizer)
    assumed = {c.name: c.assumed for c in classes} if multi else None
    if multi:
        print(_describe_classes(classes, args), file=sys.stderr)
    runs = []
    for rate in args.request_rate:
        try:
            specs = _specs(args, rate, classes if multi else None, lengths, trace, tokenizer,
                           max_prompt_len)
        except ValueError as exc:
            raise SystemExit(f"lp-bench: {exc}") from None
        bar = ProgressBar(len(specs), desc=f"rate {rate:g} ", enabled=args.progress)
        records, duration = await run_requests(
            specs, base_url=base, model=model, endpoint=args.endpoint, api_key=args.api_key,
            ignore_eos=args.ignore_eos, temperature=args.temperature,
            max_concurrency=args.max_concurrency, timeout=args.request_timeout,
            extra_body=args.extra_body, send_slo_class=args.send_slo_class,
            on_done=lambda rec, bar=bar: bar.update(rec.ok))
        bar.close()
        summary = report.summarize_run(records, duration, args.ttft_slo, args.itl_slo,
                                       assumed=assumed)
        run_out = {"request_rate": rate, "summary": summary, "records": records}
        if args.scrape_metrics:
            try:
                from lp_jax.server.prometheus import parse_text

                text = await _get_json(f"{base}/metrics", args.api_key)
                run_out["server_metrics"] = {k: v for k, v in parse_text(text).items()
                                             if "_bucket{" not in k}
            except Exception as exc:  # noqa: BLE001 - optional
                run_out["server_metrics_error"] = str(exc)
        print(f"== rate {rate:g} req/s", file=sys.stderr)
        print(report.format_summary(summary), file=sys.stderr)
        failed = [r for r in records if not r.ok]
        if failed:
            print(f"first error: {failed[0].error}", file=sys.stderr)
        runs.append(run_out)
    out = {"model": model, "base_url": base, "endpoint": args.endpoint,
           "args": {k: (v if not isinstance(v, float) or math.isfinite(v) else str(v))
                    for k, v in vars(args).items() if k != "slo_classes"},
           "started": time.time(), "runs": runs}
    if multi:
        out["slo_classes"] = [{**asdict(c), "assumed": list(c.assumed)} for c in classes]
        out["server_slo_classes"] = slo_classes_config(classes, args.slo_scale)
    return out


def _specs(args, rate: float, classes, lengths, trace, tokenizer, max_prompt_len):
    """The requests of one rate: the multi-SLO mix when `classes` is given."""
    common = dict(num_requests=args.num_requests, rate=rate, seed=args.seed,
                  process=args.arrival, burstiness=args.burstiness,
                  max_prompt_len=max_prompt_len, output_len=args.output_len,
                  prompt_kind=args.prompt_kind, vocab_size=args.vocab_size,
                  tokenizer=tokenizer)
    if args.workload == MULTI_TURN:
        n = 100 if args.num_requests is None else args.num_requests
        return build_multi_turn_workload(
            num_conversations=max(1, -(-n // args.turns)), turns=args.turns, rate=rate,
            seed=args.seed, system_len=args.system_len, user_len=args.prompt_len,
            output_len=args.output_len, turn_gap=args.turn_gap, process=args.arrival,
            burstiness=args.burstiness, max_prompt_len=max_prompt_len,
            prompt_kind=args.prompt_kind, vocab_size=args.vocab_size, tokenizer=tokenizer)
    if classes is not None:
        return build_multi_slo_workload(classes, length_scale=args.length_scale,
                                        slo_scale=args.slo_scale,
                                        length_sigma=args.length_sigma, **common)
    return build_workload(length_model=lengths, trace=trace, time_scale=args.time_scale,
                          max_output_len=args.max_output_len, length_mode=args.length_mode,
                          prompt_len=args.prompt_len, **common)


def _describe_classes(classes, args) -> str:
    """The classes of a multi-SLO run, scaled, with the values that are guesses marked."""
    total = sum(c.weight for c in classes)
    lines = [f"multi-slo classes (prompt lengths x {args.length_scale:g}, objectives x "
             f"{args.slo_scale:g}):"]
    for c in classes:
        ttft, tbt = c.objectives(args.slo_scale)
        line = (f"  {c.name}: mean prompt {c.prompt_len * args.length_scale:.0f} tokens, "
                f"TTFT {ttft:g} ms" + ("" if tbt is None else f", TBT {tbt:g} ms")
                + f", share {c.weight / total:.2f}")
        if c.assumed:
            line += f"  [ASSUMED: {', '.join(c.assumed)}]"
        lines.append(line)
    return "\n".join(lines)


def write_outputs(results: dict, output_dir) -> dict[str, str]:
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": str(out / "results.json")}
    serial = dict(results)
    serial["runs"] = [{**r, "records": [rec.to_dict() for rec in r["records"]]}
                      for r in results["runs"]]
    report.write_json(paths["json"], serial)
    if results["args"].get("plot", True):
        paths["png"] = str(out / "summary.png")
        report.write_plot(paths["png"], results["runs"])
    if results["args"].get("tensorboard", True):
        paths["tensorboard"] = str(out / "tb")
        report.write_tensorboard(paths["tensorboard"], results["runs"])
    return paths


def run_cli(argv=None) -> dict:
    """Parses `argv`, runs the benchmark, writes the outputs; returns the results."""
    args = build_parser().parse_args(argv)
    if args.probe:
        from lp_jax.bench import probe

        return probe.main(args)
    results = asyncio.run(run(args))
    if args.output_dir:
        paths = write_outputs(results, args.output_dir)
        print("wrote " + ", ".join(paths.values()), file=sys.stderr)
    return results


def main(argv=None) -> None:
    run_cli(argv)


if __name__ == "__main__":
    main()
