"""Chunked prefill against layered prefill, side by side in one process.

A small MoE (8 layers, 32 experts, top-4, hidden 512; random weights) serves the
same Poisson workload of long prompts under `chunked` (512-token budget) and
`layered` (8192-token budget, paper groups), and `orca` (whole prompts) if asked.
`--model` picks the small Qwen3-MoE, a GPT-OSS of the same sizes (alternating
128-token sliding windows, sinks, biases, clamped SwiGLU), or both in turn.
Reported per model and policy: TTFT p50/p99,
max-ITL p99, E2E, expert bytes loaded, host overhead per iteration. Then one
8192-token prompt alone, whose expert-bytes ratio layered : chunked is ideally 1/16.

Finally the device's ridge point (measured) against the MoE's arithmetic
intensity at a 512-token chunk: on a CPU the MoE is compute-bound already, so the
byte savings do not turn into time savings there. The GPU validation measures time.

`--modes sync,async` also serves the workload with each engine mode (one step at a
time, and overlapped scheduling, the default), interleaved in the same process, and
prints async : sync per policy.

    python launch/bench_policies.py [--requests 10] [--rate 0.25] [--modes async]
                                    [--model qwen3,gpt-oss] [--policies chunked,layered,orca]
                                    [--out runs/bench_policies]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time
from datetime import date
from pathlib import Path

import numpy as np

SMALL_MOE = {
    "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
    "vocab_size": 8192, "hidden_size": 512, "num_hidden_layers": 8,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
    "intermediate_size": 1024, "moe_intermediate_size": 256, "num_experts": 32,
    "num_experts_per_tok": 4, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "rms_norm_eps": 1e-6, "rope_theta": 1e6,
    "max_position_embeddings": 16384, "tie_word_embeddings": False, "torch_dtype": "float32",
    "eos_token_id": 0,
}
# SMALL_MOE's sizes in GPT-OSS's form: every layer MoE with experts intermediate_size wide,
# sliding (window 128, gpt-oss-20b's) and full attention alternating.
SMALL_GPT_OSS = {
    "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"],
    "vocab_size": 8192, "hidden_size": 512, "num_hidden_layers": 8,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
    "intermediate_size": 256, "num_local_experts": 32, "num_experts_per_tok": 4,
    "layer_types": ["sliding_attention", "full_attention"] * 4, "sliding_window": 128,
    "attention_bias": True, "swiglu_limit": 7.0, "rms_norm_eps": 1e-5, "rope_theta": 150000.0,
    "max_position_embeddings": 16384, "tie_word_embeddings": False, "torch_dtype": "float32",
    "eos_token_id": 0,
}
MODELS = {"qwen3": SMALL_MOE, "gpt-oss": SMALL_GPT_OSS}
POLICIES = {  # default row buckets (core.programs.step_buckets)
    "chunked": dict(scheduling="chunked", max_num_batched_tokens=512),
    "layered": dict(scheduling="layered", max_num_batched_tokens=8192),
    "orca": dict(scheduling="orca"),  # budget: max_model_len
}
# The scheme before row buckets (programs keyed by prefill bucket x decode bucket), with the
# buckets this benchmark used then: its padding is recomputed from the same plans.
OLD_BUCKETS = {"chunked": ((512,), (8,)), "layered": ((512, 1024, 2048, 4096, 8192), (8,))}


def _pad(n, buckets):
    return next(b for b in buckets if n <= b)


def old_scheme_row_layers(plan, prefill_buckets, decode_buckets):
    """(useful, padded) row-layers of `plan` under the old scheme: decode rows padded to a
    decode bucket through every layer outside the prefill group, and prefill rows padded to
    a prefill bucket next to them inside it."""
    L, n_dec = plan.num_layers, len(plan.decode)
    g = plan.layer_end - plan.layer_start if plan.prefill else 0
    n_pre = plan.num_prefill_tokens
    B = _pad(n_dec, decode_buckets) if n_dec else 0
    T = _pad(n_pre, prefill_buckets) if n_pre else 0
    return n_dec * L + n_pre * g, B * (L - g) + (T + B) * g


def record_plans(llm, plans):
    """Keeps every plan the runner dispatches."""
    runner = llm.engine.runner
    dispatch = runner.dispatch

    def recording(plan, prev=None):
        plans.append(plan)
        return dispatch(plan, prev)

    runner.dispatch = recording


def padding(stats, before, plans, name):
    """Padded / useful row-layers of the new scheme (engine counters) and the old one."""
    useful = stats["row_layers_useful"] - before["row_layers_useful"]
    padded = stats["row_layers_padded"] - before["row_layers_padded"]
    new = {"padding_new": padded / useful, "max_step_padding_new": stats["max_step_padding_ratio"]}
    if name not in OLD_BUCKETS:
        return new
    old = [old_scheme_row_layers(p, *OLD_BUCKETS[name]) for p in plans]
    old_useful, old_padded = sum(u for u, _ in old), sum(p for _, p in old)
    return {**new, "padding_old": old_padded / old_useful,
            "max_step_padding_old": max(p / u for u, p in old if u)}


def workload(n, rate, lo, hi, out_len, seed):
    from lp_jax.sim.workload import arrival_times

    rng = np.random.default_rng(seed)
    arrivals = arrival_times(n, rate, rng)  # Poisson
    prompts = [rng.integers(1, SMALL_MOE["vocab_size"], int(rng.integers(lo, hi + 1))).tolist()
               for _ in range(n)]
    return list(zip(arrivals.tolist(), prompts, strict=True)), out_len


def serve(llm, requests, out_len):
    """Feeds requests at their wall-clock arrival times; returns finished outputs."""
    from lp_jax import SamplingParams

    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    pending, done = list(requests), []
    t0 = time.perf_counter()
    while pending or eng.has_unfinished():
        now = time.perf_counter() - t0
        while pending and pending[0][0] <= now:
            t, prompt = pending.pop(0)
            eng.add_request(prompt, params, arrival_time=t0 + t)
        if eng.has_unfinished():
            done += [o for o in eng.step() if o.finished]
        elif pending:
            time.sleep(max(0.0, pending[0][0] - (time.perf_counter() - t0)))
    return done


def summarize(outs, stats, before):
    """Latency metrics of `outs`, and the engine counters accrued since `before`."""
    from lp_jax.core.metrics import summarize as summ

    s = summ([o.metrics for o in outs])

    def delta(key):
        return stats[key] - before[key]

    iters = max(delta("iterations") - delta("iterations_idle"), 1)
    host = delta("host_seconds")
    exposed = host - delta("overlapped_host_seconds")
    return {
        "ttft_p50_s": s["ttft_p50"], "ttft_p99_s": s["ttft_p99"],
        "max_itl_p99_s": s["max_itl_p99"], "e2e_p50_s": s["e2e_p50"],
        "e2e_mean_s": float(np.mean([o.metrics.e2e for o in outs])),
        "expert_bytes": delta("expert_bytes_loaded"), "iterations": iters,
        "host_ms_per_iter": 1e3 * host / iters,
        "device_ms_per_iter": 1e3 * delta("device_seconds") / iters,
        "host_overhead_fraction": exposed / max(exposed + delta("device_seconds"), 1e-12),
        "compile_s": stats["compile_seconds"], "programs": stats["programs"],
        "compilations_after_warmup": stats["compilations_after_warmup"],
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=10)
    ap.add_argument("--rate", type=float, default=0.25, help="Poisson arrivals per second")
    ap.add_argument("--prompt-min", type=int, default=1024)
    ap.add_argument("--prompt-max", type=int, default=4096)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--single", type=int, default=8192, help="single-prompt length (0: skip)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/bench_policies")
    ap.add_argument("--modes", default="async",
                    help="engine modes, comma-separated: async (overlapped, the default), "
                         "sync (one step at a time)")
    ap.add_argument("--model", default="qwen3",
                    help=f"small models, comma-separated, from {sorted(MODELS)}")
    ap.add_argument("--policies", default="chunked,layered",
                    help=f"comma-separated, from {sorted(POLICIES)}; chunked first (the "
                         "ratios' baseline)")
    args = ap.parse_args(argv)
    modes, models = args.modes.split(","), args.model.split(",")
    policies = args.policies.split(",")
    if not modes or set(modes) - {"sync", "async"}:
        ap.error(f"--modes takes sync and/or async, got {args.modes!r}")
    if set(models) - set(MODELS):
        ap.error(f"--model takes {sorted(MODELS)}, got {args.model!r}")
    if set(policies) - set(POLICIES) or policies[0] != "chunked":
        ap.error(f"--policies takes chunked first, then {sorted(POLICIES)}")

    from lp_jax import LLM, SamplingParams
    from lp_jax.roofline.hardware import measure_current_device

    out = Path(args.out)
    requests, out_len = workload(args.requests, args.rate, args.prompt_min, args.prompt_max,
                                 args.output_len, args.seed)
    print(f"workload: {args.requests} requests, Poisson {args.rate}/s, prompts "
          f"{args.prompt_min}-{args.prompt_max} tokens, {out_len} output tokens")

    results = {m: {mode: {} for mode in modes} for m in models}
    single = {m: {} for m in models}
    for model in models:
        model_dir = out / ("model" if model == "qwen3" else f"model-{model}")
        model_dir.mkdir(parents=True, exist_ok=True)
        (model_dir / "config.json").write_text(json.dumps(MODELS[model], indent=1))
        for name in policies:
            t = time.perf_counter()
            llm = LLM(str(model_dir), load_format="dummy", max_num_seqs=8,
                      max_model_len=args.single + 64 if args.single else 8192,
                      enable_prefix_caching=False, **POLICIES[name])  # modes re-send prompts
            print(f"[{model} {name}] engine ready in {time.perf_counter() - t:.1f} s")
            plans = []
            record_plans(llm, plans)
            for mode in modes:
                llm.engine.config = dataclasses.replace(llm.engine.config,
                                                        async_scheduling=mode == "async")
                before = llm.stats()
                t = time.perf_counter()
                outs = serve(llm, requests, out_len)
                res = results[model][mode][name] = summarize(outs, llm.stats(), before)
                res.update(padding(llm.stats(), before, plans, name))
                res["serve_s"] = time.perf_counter() - t
                res["throughput_tok_s"] = sum(len(o.token_ids) for o in outs) / res["serve_s"]
                plans.clear()
                print(f"[{model} {name}, {mode}] {json.dumps(res)}")
            if args.single:
                before = llm.stats()["expert_bytes_loaded"]
                prompt = np.random.default_rng(1).integers(1, 8192, args.single).tolist()
                t = time.perf_counter()
                llm.generate(prompt_token_ids=[prompt],
                             sampling_params=SamplingParams(temperature=0, max_tokens=1,
                                                            ignore_eos=True))
                single[model][name] = {
                    "expert_bytes": llm.stats()["expert_bytes_loaded"] - before,
                    "seconds": time.perf_counter() - t}
                print(f"[{model} {name}] single {args.single}-token prompt: "
                      f"{single[model][name]}")
            llm.shutdown()
            del llm

    hw = measure_current_device()
    E, k = SMALL_MOE["num_experts"], SMALL_MOE["num_experts_per_tok"]
    rows_per_expert = 512 * k / E  # tokens per expert in a 512-token chunk
    intensity = 2 * rows_per_expert / 4  # FLOP per weight byte, float32 weights
    report = {
        "date": date.today().isoformat(), "machine": f"{platform.machine()} CPU, "
        f"{platform.processor() or 'unknown'}", "command": "python launch/bench_policies.py "
        + " ".join(argv or []), "args": vars(args), "models": results, "single_prompt": single,
        "cpu_ridge_flop_per_byte": hw.ridge_point, "cpu_peak_flops": hw.peak_flops,
        "cpu_bandwidth": hw.hbm_bw, "moe_intensity_chunk512": intensity,
    }
    (out / "results.json").write_text(json.dumps(report, indent=1))

    keys = ("ttft_p50_s", "ttft_p99_s", "max_itl_p99_s", "e2e_mean_s", "throughput_tok_s",
            "expert_bytes", "iterations", "host_ms_per_iter", "host_overhead_fraction",
            "programs", "compile_s", "padding_new", "padding_old", "max_step_padding_new",
            "max_step_padding_old")
    for model in models:
        for mode in modes:
            res = results[model][mode]
            others = policies[1:]
            print(f"\n{model}, {mode}:\n| metric | " + " | ".join(policies) + " | "
                  + " | ".join(f"{p} / chunked" for p in others) + " |\n"
                  + "|---" * (len(policies) + len(others) + 1) + "|")
            for key in keys:
                vals = [res[p].get(key, float("nan")) for p in policies]
                ratios = [v / vals[0] if vals[0] else float("nan") for v in vals[1:]]
                print(f"| {key} | " + " | ".join(f"{v:.4g}" for v in vals) + " | "
                      + " | ".join(f"{r:.3f}" for r in ratios) + " |")
        if len(modes) == 2:
            print(f"\n{model}:\n| metric | "
                  + " | ".join(f"{p} async / sync" for p in policies) + " |\n"
                  + "|---" * (len(policies) + 1) + "|")
            for key in keys:
                r = [results[model]["async"][p].get(key, float("nan"))
                     / results[model]["sync"][p].get(key, float("nan"))
                     if results[model]["sync"][p].get(key) else float("nan") for p in policies]
                print(f"| {key} | " + " | ".join(f"{x:.3f}" for x in r) + " |")
        one = single[model]
        if "layered" in one:
            r = one["layered"]["expert_bytes"] / one["chunked"]["expert_bytes"]
            print(f"\n{model}: single {args.single}-token prompt: expert bytes layered : "
                  f"chunked = {r:.4f} (1/{1 / r:.1f}; ideal 1/16); time "
                  f"{one['layered']['seconds']:.2f} s vs {one['chunked']['seconds']:.2f} s")
    print(f"\nCPU: {hw.peak_flops / 1e9:.1f} GFLOP/s, {hw.hbm_bw / 1e9:.1f} GB/s, ridge "
          f"{hw.ridge_point:.1f} FLOP/B; MoE at a 512-token chunk: {rows_per_expert:.0f} rows "
          f"per expert = {intensity:.0f} FLOP/B (float32) -> "
          f"{'compute' if intensity > hw.ridge_point else 'memory'}-bound")
    print(f"wrote {out / 'results.json'}")


if __name__ == "__main__":
    main()
