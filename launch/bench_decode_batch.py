"""Decode time per token against batch size, every batch on one engine.

A decode step costs its program's rows plus the model's fixed work, so on any machine
the time per output token should grow slowly from batch 1 to 2: a batch-1 step much
slower than a batch-2 one means the 1-row program does work the other does not (it
once copied the whole KV pool in every layer on XLA:CPU: tests/test_program_memory.py).

One engine (the tiny model unless --model), one program per batch size (token_buckets =
the batch sizes), so each batch runs in a program of exactly its rows. For each batch B:
B short prompts are prefilled, --warmup decode steps are run and dropped, then --steps
decode steps are timed one by one; the table gives the median step (each sequence's time
per output token), its ratio to batch 2's, and the tokens per second of the batch.

    python launch/bench_decode_batch.py [--batches 1,2,4,8,16,32,64] [--kv-pages 1024]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time


def decode_steps(eng, batch: int, prompt_len: int, warmup: int, steps: int) -> list[float]:
    """Wall seconds of each timed decode step of `batch` sequences (steps that returned
    one token for every sequence), after `warmup` untimed ones. The requests ask for more
    tokens than the steps take (prefill may admit them over several steps) and are
    aborted once timed."""
    from lp_jax import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    ids = [eng.add_request([(31 * i + 7 * j) % 400 + 1 for j in range(prompt_len)], params)
           for i in range(batch)]
    while eng.scheduler.waiting or any(s.num_output_tokens == 0 for s in eng.scheduler.running):
        eng.step()
    for _ in range(warmup):
        eng.step()
    times = []
    while len(times) < steps:
        t0 = time.perf_counter()
        outs = eng.step()
        if len(outs) == batch:
            times.append(time.perf_counter() - t0)
    for rid in ids:
        eng.abort(rid)
    while eng.has_unfinished():
        eng.step()
    return times


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: tiny)")
    ap.add_argument("--batches", default="1,2,4,8,16,32,64")
    ap.add_argument("--kv-pages", type=int, default=1024, help="pages per layer")
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=5, help="decode steps dropped per batch")
    ap.add_argument("--steps", type=int, default=20, help="decode steps timed per batch")
    args = ap.parse_args(argv)
    batches = sorted({int(b) for b in args.batches.split(",")})

    import jax

    from lp_jax import LLM

    t0 = time.perf_counter()
    llm = LLM(args.model, kv_pages=args.kv_pages, max_model_len=512, scheduling="chunked",
              max_num_seqs=batches[-1], max_num_batched_tokens=batches[-1],
              token_buckets=tuple(batches), log=None)
    eng = llm.engine
    pool = eng.runner.kv_pages
    print(f"{jax.devices()[0].platform} ({platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores), jax {jax.__version__}; {len(batches)} programs "
          f"compiled in {time.perf_counter() - t0:.1f} s; KV pool {args.kv_pages} pages "
          f"per layer, {pool.nbytes / 2**20:.1f} MiB; {args.steps} timed steps per batch "
          f"after {args.warmup}")
    median = {b: statistics.median(decode_steps(eng, b, args.prompt_len, args.warmup,
                                                args.steps)) for b in batches}
    base = median.get(2)
    print("\n| batch | ms per token (median step) | ratio to batch 2 | tokens/s |")
    print("| ---: | ---: | ---: | ---: |")
    for b, t in median.items():
        ratio = f"{t / base:.2f}x" if base else "-"
        print(f"| {b} | {t * 1e3:.2f} | {ratio} | {b / t:,.0f} |")


if __name__ == "__main__":
    main()
