"""Prefix caching on and off, side by side in one process.

Requests share a long system prompt (`--system-len` tokens, 1,024 by default) followed by
`--user-len` tokens of their own (64), and arrive as a Poisson stream. The same requests
are served by two engines that differ only in `enable_prefix_caching`; reported for each:
TTFT p50 / p99, E2E p50, prefill tokens computed, prefix-cache queries and hits (tokens),
expert bytes loaded: in all, and by the calls that ran a prefill (decode rows riding in them
included). On the tiny model decode steps read most expert bytes, so the total also moves
with how the decodes happen to batch: a run whose requests queue decodes them together.

With `--turns N` (N > 1) every conversation sends N turns, each resending its whole
history (lp-bench's multi-turn chat workload, driven in process: the assistant turns in
the history are random tokens, so hits stop at the previous prompt).

The model is the embedded tiny checkpoint (8 layers, 16 experts, hidden 64) by default,
or `--model small`: bench_policies.py's small MoE (32 experts, hidden 512) with random
weights, whose prefill costs more than its Python overhead on a CPU.

    python launch/bench_prefix_cache.py [--requests 24] [--rate 2] [--turns 1]
        [--scheduling layered,chunked] [--model tiny|small] [--out runs/bench_prefix_cache]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from launch.bench_policies import SMALL_MOE, serve  # noqa: E402

# Budgets and row buckets: a cold request (system + user tokens) fits one chunk or one
# layered batch, a cached one a few rows; few buckets keep start-up short on a CPU.
POLICIES = {
    "layered": dict(scheduling="layered", max_num_batched_tokens=2048,
                    token_buckets=(16, 96, 256, 1152, 2056)),
    "chunked": dict(scheduling="chunked", max_num_batched_tokens=512,
                    token_buckets=(16, 96, 256, 512)),
}


def requests(args, vocab_size):
    """(arrival s, prompt) pairs from lp-bench's multi-turn builder (turns=1: one shared
    system prompt and a user turn per request)."""
    from lp_jax.bench.workload import build_multi_turn_workload

    specs = build_multi_turn_workload(
        num_conversations=-(-args.requests // args.turns), turns=args.turns, rate=args.rate,
        seed=args.seed, system_len=args.system_len, user_len=args.user_len,
        output_len=args.output_len, turn_gap=args.turn_gap, vocab_size=vocab_size)
    return [(s.arrival, s.prompt) for s in specs][: args.requests]


def measure(outs, stats, before):
    from lp_jax.core.metrics import summarize

    s = summarize([o.metrics for o in outs])

    def delta(key):
        return stats[key] - before[key]

    return {"ttft_p50_s": s["ttft_p50"], "ttft_p99_s": s["ttft_p99"], "e2e_p50_s": s["e2e_p50"],
            "prefill_tokens": delta("prefill_tokens"),
            "prefix_cache_queries": delta("prefix_cache_queries"),
            "prefix_cache_hits": delta("prefix_cache_hits"),
            "cached_tokens_mean": sum(o.num_cached_tokens for o in outs) / len(outs),
            "expert_bytes": delta("expert_bytes_loaded"),
            "prefill_expert_bytes": sum(v for k, v in stats["expert_bytes_per_prefill_batch"]
                                        .items()
                                        if k not in before["expert_bytes_per_prefill_batch"]),
            "busy_iterations": delta("iterations") - delta("iterations_idle"),
            "compilations_after_warmup": stats["compilations_after_warmup"]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--rate", type=float, default=2.0,
                    help="Poisson arrivals per second (of conversations, with --turns)")
    ap.add_argument("--system-len", type=int, default=1024)
    ap.add_argument("--user-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--turns", type=int, default=1)
    ap.add_argument("--turn-gap", type=float, default=2.0, help="seconds between turns")
    ap.add_argument("--scheduling", default="layered", help="comma-separated: layered, chunked")
    ap.add_argument("--model", choices=("tiny", "small"), default="tiny")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/bench_prefix_cache")
    args = ap.parse_args(argv)
    policies = args.scheduling.split(",")
    if set(policies) - set(POLICIES):
        ap.error(f"--scheduling takes {sorted(POLICIES)}, got {args.scheduling!r}")

    from lp_jax import LLM

    out = Path(args.out)
    if args.model == "small":
        model, extra = out / "model", {"load_format": "dummy"}
        model.mkdir(parents=True, exist_ok=True)
        (model / "config.json").write_text(json.dumps(SMALL_MOE, indent=1))
        vocab = SMALL_MOE["vocab_size"]
    else:
        from checkpoints.make_tiny import ensure_tiny

        model, extra, vocab = ensure_tiny(preset="tiny"), {}, 509
    reqs = requests(args, vocab)
    longest = max(len(p) for _, p in reqs) + args.output_len
    print(f"$ python {' '.join(sys.argv)}")
    print(f"workload: {len(reqs)} requests, Poisson {args.rate}/s, {args.turns} turn(s), "
          f"system prompt {args.system_len} + {args.user_len} tokens a turn, "
          f"{args.output_len} output tokens; model {args.model}")

    results = {}
    for name in policies:
        for caching in (False, True):
            t = time.perf_counter()
            llm = LLM(str(model), max_num_seqs=8, max_model_len=max(2048, longest), log=None,
                      enable_prefix_caching=caching, **POLICIES[name], **extra)
            print(f"[{name}, caching {'on' if caching else 'off'}] engine ready in "
                  f"{time.perf_counter() - t:.1f} s")
            before = llm.stats()
            outs = serve(llm, reqs, args.output_len)
            key = f"{name}/{'on' if caching else 'off'}"
            results[key] = measure(outs, llm.stats(), before)
            del llm

    print(f"\n{'policy/caching':<16} {'TTFT p50':>9} {'TTFT p99':>9} {'E2E p50':>8} "
          f"{'prefill tok':>11} {'hits/queries':>13} {'expert MB':>9} {'prefill MB':>10} "
          f"{'steps':>6}")
    for key, r in results.items():
        hits = f"{r['prefix_cache_hits']}/{r['prefix_cache_queries']}"
        print(f"{key:<16} {r['ttft_p50_s'] * 1e3:>7.1f}ms {r['ttft_p99_s'] * 1e3:>7.1f}ms "
              f"{r['e2e_p50_s'] * 1e3:>6.0f}ms {r['prefill_tokens']:>11} {hits:>13} "
              f"{r['expert_bytes'] / 2**20:>9.1f} {r['prefill_expert_bytes'] / 2**20:>10.1f} "
              f"{r['busy_iterations']:>6}")
    for name in policies:
        on, off = results[f"{name}/on"], results[f"{name}/off"]
        print(f"{name}: caching on / off: TTFT p50 x{on['ttft_p50_s'] / off['ttft_p50_s']:.2f}, "
              f"p99 x{on['ttft_p99_s'] / off['ttft_p99_s']:.2f}, prefill tokens "
              f"x{on['prefill_tokens'] / off['prefill_tokens']:.2f}, expert bytes "
              f"x{on['expert_bytes'] / off['expert_bytes']:.2f} (prefill calls "
              f"x{on['prefill_expert_bytes'] / off['prefill_expert_bytes']:.2f})")
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    path.write_text(json.dumps({"date": str(date.today()), "host": platform.node(),
                                "args": vars(args), "results": results}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
