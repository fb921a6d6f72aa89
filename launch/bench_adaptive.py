"""Adaptive layered prefill against fixed group counts and chunked prefill, on the real
engine (this CPU), side by side in one run with the same arrivals.

    python launch/bench_adaptive.py --out runs/bench_adaptive

One engine (the embedded tiny Qwen3-MoE by default) compiles its programs once; each
policy is a fresh scheduler on the same executor and latency estimator
(lp_jax.bench.open_loop.use_policy). The estimator is first warmed by the profiling pass
of `python -m lp_jax.engine.profile_latency` (profile_engine), then keeps learning online.

TBT SLO (unless --tbt-slo-ms): the median inter-token gap of a decode-only batch of
--max-num-seqs requests plus --tbt-share of the solo prefill time of the p90 prompt, so a
step may carry about 8 x tbt-share of that prompt's layers: reachable by a small enough
span, broken by a fixed G too coarse for the longest prompts. Workload: Poisson
arrivals at --load x the capacity implied by solo prefill times, prompts of mixed lengths
(lognormal around --prompt-mean, scaled for the CPU), --output-len tokens each, so
prefills arrive while decodes run.

Per policy: the share of requests whose largest inter-token gap is within the SLO, the
p99 of that largest gap, TTFT p50 / p99, expert bytes read, and iterations per prefill
batch (fewer: fewer expert reloads).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from lp_jax.bench.open_loop import run_open_loop, use_policy
from lp_jax.bench.report import write_results
from lp_jax.core.metrics import percentile
from lp_jax.core.sampling_params import SamplingParams
from lp_jax.engine.config import EngineConfig
from lp_jax.engine.llm_engine import LLMEngine
from lp_jax.engine.profile_latency import profile_engine

POLICIES = {
    "chunked-512": dict(policy="chunked", max_num_batched_tokens=512),
    "layered paper": dict(policy="layered", layer_groups="paper"),
    "layered pow2": dict(policy="layered", layer_groups="pow2"),
    "layered G=2": dict(policy="layered", layer_groups=2),
    "layered G=4": dict(policy="layered", layer_groups=4),
    "adaptive": dict(policy="layered", layer_groups="adaptive"),
}


def median_itl(engine, n: int, output_len: int, rng) -> float:
    """Median gap between tokens of n short requests decoding together."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    ms = run_open_loop(engine, [(0.0, rng.integers(0, 500, 8).tolist(), None)
                                for _ in range(n)], params)
    return statistics.median(g for m in ms for g in m.itls[2:])


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/bench_adaptive")
    p.add_argument("--model", default=None)
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--load", type=float, default=0.5)
    p.add_argument("--prompt-mean", type=float, default=600.0)
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--tbt-share", type=float, default=0.3)
    p.add_argument("--tbt-slo-ms", type=float, default=None)
    p.add_argument("--margin", type=float, default=0.2, help="adaptive_margin")
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=2304)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(args.seed)

    engine = LLMEngine(EngineConfig(
        model=args.model, scheduling="layered", max_model_len=args.max_model_len,
        max_num_batched_tokens=args.budget, max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=False), log=print)  # prompts repeat: measure prefill
    base = engine.scheduler.config
    profile_engine(engine, output_tokens=4, seed=args.seed)
    use_policy(engine, base, policy="chunked", max_num_batched_tokens=512)
    itl = median_itl(engine, args.max_num_seqs, 24, rng)

    lens = np.clip(rng.lognormal(np.log(args.prompt_mean) - 0.5 * 0.8 ** 2, 0.8,
                                 args.requests), 16, args.budget).astype(int)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    use_policy(engine, base, policy="layered", layer_groups=1)
    solo = {n: run_open_loop(engine, [(0.0, rng.integers(0, 500, n).tolist(), None)],
                             SamplingParams(max_tokens=1))[0].ttft
            for n in sorted({int(x) for x in np.quantile(lens, [0.1, 0.5, 0.9])})}
    service = float(np.mean(list(solo.values())))
    tbt = args.tbt_slo_ms / 1e3 if args.tbt_slo_ms else itl + args.tbt_share * max(
        solo.values())
    rate = args.load / service
    gaps = rng.exponential(1.0 / rate, args.requests)
    timed = [(float(t), rng.integers(0, 500, int(n)).tolist(), None)
             for t, n in zip(np.cumsum(gaps) - gaps[0], lens, strict=True)]

    results = {"config": vars(args), "decode_itl_ms": itl * 1e3, "tbt_slo_ms": tbt * 1e3,
               "rate_req_s": rate, "solo_prefill_ms": {n: t * 1e3 for n, t in solo.items()},
               "policies": {}}
    for name in args.policies.split(","):
        use_policy(engine, base, tbt_slo_s=tbt, adaptive_margin=args.margin, **POLICIES[name])
        before = engine.stats()
        t = time.perf_counter()
        ms = run_open_loop(engine, timed, params)
        wall = time.perf_counter() - t
        s = engine.stats()
        max_itl = [m.max_itl for m in ms]
        ttft = [m.ttft for m in ms]
        prefill_iters = s["iterations_prefill"] + s["iterations_hybrid"]
        res = {"tbt_attainment": sum(x <= tbt for x in max_itl) / len(ms),
               "max_itl_p50_ms": percentile(max_itl, 50) * 1e3,
               "max_itl_p99_ms": percentile(max_itl, 99) * 1e3,
               "ttft_p50_ms": percentile(ttft, 50) * 1e3,
               "ttft_p99_ms": percentile(ttft, 99) * 1e3,
               "expert_bytes": s["expert_bytes_loaded"] - before["expert_bytes_loaded"],
               "iterations_per_prefill_batch": prefill_iters / max(1, s["prefill_batches"]),
               "wall_s": wall}
        results["policies"][name] = res
        print(name, json.dumps(res))
    results["latency_model"] = engine.scheduler.latency.error()
    results["compilations_after_warmup"] = engine.stats()["compilations_after_warmup"]
    write_results(out, results, render)
    return results


def render(r: dict) -> str:
    base = r["policies"].get("chunked-512", {}).get("expert_bytes") or None
    lines = [f"TBT SLO {r['tbt_slo_ms']:.1f} ms (the {r['decode_itl_ms']:.1f} ms decode gap "
             f"+ {r['config']['tbt_share']} x the p90 prompt's solo prefill), rate "
             f"{r['rate_req_s']:.2f} req/s, "
             f"{r['config']['requests']} requests x {r['config']['output_len']} tokens, "
             f"adaptive margin {r['config']['margin']}", "",
             "| policy | within TBT SLO | max-ITL p50 / p99 ms | TTFT p50 / p99 ms | expert "
             "bytes (x chunked) | iterations / prefill batch |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name, x in r["policies"].items():
        ratio = f" ({x['expert_bytes'] / base:.2f}x)" if base else ""
        lines.append(f"| {name} | {x['tbt_attainment']:.2f} | {x['max_itl_p50_ms']:.0f} / "
                     f"{x['max_itl_p99_ms']:.0f} | {x['ttft_p50_ms']:.0f} / "
                     f"{x['ttft_p99_ms']:.0f} | {x['expert_bytes'] / 1e6:.1f} MB{ratio} | "
                     f"{x['iterations_per_prefill_batch']:.1f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
