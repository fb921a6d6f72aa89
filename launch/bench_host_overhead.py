"""Host work per engine iteration at 128 running requests, against a device step.

The engine's host side (scheduling, building the step's inputs, committing tokens)
runs between device steps. Its cost does not depend on the accelerator, so it can
be measured here on the tiny model with 128 decoding requests; the device step it
must stay under 2% of is predicted by the roofline model for Qwen3-30B-A3B on an
H200 (a decode step at batch 128 streams nearly all expert weights).

Runs the engine twice, side by side: one step at a time (async_scheduling=False),
and overlapped (the default), where a decode step's planning, input building,
dispatch and the previous step's commit run while the device computes. "Exposed"
host work is the part done while no step was in flight: the part that adds to the
step time when the device step is longer than the host work, as on an H200.

A second scenario adds a 256-token prompt at every step while the decodes run, so
most steps are hybrid (a layered prefill group beside the decode batch).

    python launch/bench_host_overhead.py [--requests 128] [--steps 64]
"""

from __future__ import annotations

import argparse
import time


def measure(n: int, steps: int, scheduling: str, async_scheduling: bool,
            arrivals: bool = False) -> dict:
    from lp_jax import LLM, SamplingParams

    extra = steps if arrivals else 0  # room for the arriving requests
    budget = max(512, n * 8)
    llm = LLM(scheduling=scheduling, max_num_seqs=n + extra, max_model_len=512,
              max_num_batched_tokens=budget, token_buckets=(n, n + extra, budget + n + extra),
              async_scheduling=async_scheduling, enable_prefix_caching=False, log=None)
    eng = llm.engine
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=steps + 8,
                            ignore_eos=True)
    for i in range(n):
        eng.add_request([(7 * i + j) % 500 for j in range(8)], params)
    while len(eng.scheduler.running) < n:  # prefill everyone first
        eng.step()
    before = eng.stats()
    t0 = time.perf_counter()
    short = SamplingParams(temperature=0.8, max_tokens=4, ignore_eos=True)
    for i in range(steps):
        if arrivals:
            eng.add_request([(3 * i + j) % 500 for j in range(256)], short)
        eng.step()
    wall = time.perf_counter() - t0
    after = eng.stats()
    iters = after["iterations"] - before["iterations"]

    def per_iter(key):
        return (after[key] - before[key]) / iters

    host = per_iter("host_seconds")
    return {"iters": iters, "wall": wall / iters, "host": host,
            "exposed": host - per_iter("overlapped_host_seconds"),
            "device": per_iter("device_seconds")}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64, help="decode iterations to time")
    ap.add_argument("--scheduling", default="layered")
    args = ap.parse_args(argv)

    from lp_jax.roofline import HARDWARE, QWEN3_30B_A3B
    from lp_jax.roofline.cost_model import StepTokens, model_step_cost

    n = args.requests
    h200 = HARDWARE["H200 SXM"]
    predicted = model_step_cost(
        QWEN3_30B_A3B, StepTokens(decode_seqs=n, decode_context=2048)).time_on(h200)
    print(f"{n} running requests, {args.steps} decode steps ({args.scheduling}); roofline "
          f"decode step, Qwen3-30B-A3B batch {n} on {h200.name}: {predicted * 1e3:.2f} ms")
    print(f"{'scenario':<16} {'mode':<12} {'wall ms/it':>10} {'host ms/it':>10} "
          f"{'exposed ms/it':>13} {'wait ms/it':>10} {'exposed/H200 step':>17}")
    for scenario, arrivals in (("decode only", False), ("+ prompt/step", True)):
        rows = {}
        for mode, flag in (("synchronous", False), ("overlapped", True)):
            r = rows[mode] = measure(n, args.steps, args.scheduling, flag, arrivals)
            print(f"{scenario:<16} {mode:<12} {r['wall'] * 1e3:>10.3f} "
                  f"{r['host'] * 1e3:>10.3f} {r['exposed'] * 1e3:>13.3f} "
                  f"{r['device'] * 1e3:>10.3f} {100 * r['exposed'] / predicted:>16.2f}%")
        s, o = rows["synchronous"], rows["overlapped"]
        print(f"{scenario:<16} overlapped : synchronous wall per iteration = "
              f"{o['wall'] / s['wall']:.2f}x (target: exposed <= 2% of the step)")


if __name__ == "__main__":
    main()
