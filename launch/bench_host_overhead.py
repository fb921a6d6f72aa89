"""Host work per engine iteration at 128 running requests, against a device step.

The engine's host side (scheduling, building the step's inputs, committing tokens)
runs between device steps. Its cost does not depend on the accelerator, so it can
be measured here on the tiny model with 128 decoding requests; the device step it
must stay under 2% of is predicted by the roofline model for Qwen3-30B-A3B on an
H200 (a decode step at batch 128 streams nearly all expert weights).

    python launch/bench_host_overhead.py [--requests 128] [--steps 64]
"""

from __future__ import annotations

import argparse
import time


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64, help="decode iterations to time")
    ap.add_argument("--scheduling", default="layered")
    args = ap.parse_args(argv)

    from lp_jax import LLM, SamplingParams
    from lp_jax.roofline import HARDWARE, QWEN3_30B_A3B
    from lp_jax.roofline.cost_model import StepTokens, model_step_cost

    n = args.requests
    llm = LLM(scheduling=args.scheduling, max_num_seqs=n, max_model_len=256,
              max_num_batched_tokens=max(512, n * 8), prefill_buckets=(max(512, n * 8),),
              decode_buckets=(n,), log=None)
    eng = llm.engine
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=args.steps + 8,
                            ignore_eos=True)
    for i in range(n):
        eng.add_request([(7 * i + j) % 500 for j in range(8)], params)
    while len(eng.scheduler.running) < n:  # prefill everyone first
        eng.step()
    before = eng.stats()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        eng.step()
    wall = time.perf_counter() - t0
    after = eng.stats()
    iters = after["iterations"] - before["iterations"]
    host = (after["host_seconds"] - before["host_seconds"]) / iters
    device = (after["device_seconds"] - before["device_seconds"]) / iters

    h200 = HARDWARE["H200 SXM"]
    step = model_step_cost(QWEN3_30B_A3B, StepTokens(decode_seqs=n, decode_context=2048))
    predicted = step.time_on(h200)
    print(f"{n} running requests, {iters} decode iterations ({args.scheduling}), "
          f"{wall / iters * 1e3:.2f} ms wall per iteration on this machine")
    print(f"host work per iteration: {host * 1e3:.3f} ms "
          f"(device step here {device * 1e3:.2f} ms on the tiny model)")
    print(f"roofline decode step, Qwen3-30B-A3B batch {n} on {h200.name}: "
          f"{predicted * 1e3:.2f} ms -> host work = {100 * host / predicted:.1f}% "
          f"(target <= 2%)")


if __name__ == "__main__":
    main()
