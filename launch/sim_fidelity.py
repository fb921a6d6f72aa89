"""How well does the simulator predict the real engine? Calibrate on CPU, then compare.

1. Build the real engine on a small dummy-weight Qwen3-MoE (8 layers, 32 experts, top-4,
   hidden 512) on this machine's CPU, with few compiled buckets.
2. Microbenchmark the CPU (`measure_current_device`) for the roofline's peaks.
3. Calibration run: a closed batch of requests of varied lengths; every `engine.step()` is
   timed end to end (host + device) and paired with the cost model's features of its plan;
   `Calibration.fit` least-squares fits the efficiencies and overheads.
4. Fidelity run: one Poisson workload fed to the real engine by wall clock (requests are
   added between steps once their arrival time has passed, and their metrics count from
   that arrival time), then the same requests through the simulator with the fitted
   calibration (and with the uncalibrated roofline, for scale).
5. Report TTFT and inter-token latency p50 / p90 / p99 of both, their relative error, and
   the per-step prediction error on the fidelity run's own steps (out of sample).

Errors can be large: XLA:CPU is not an accelerator (its `ragged_dot` computes every expert
group densely, its timings are noisy on shared cores), and the cost model knows nothing of
that. The point is an honest number and a harness that a GPU run can reuse.

    .venv/bin/python launch/sim_fidelity.py [--out runs/sim_fidelity] [--policies chunked,layered]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from lp_jax.core.metrics import percentile  # noqa: E402
from lp_jax.core.sampling_params import SamplingParams  # noqa: E402
from lp_jax.roofline import ModelShape, UniformRouting  # noqa: E402
from lp_jax.sim import (  # noqa: E402
    Calibration,
    CostModelExecutor,
    Request,
    SimConfig,
    Simulator,
    arrival_times,
)

MODEL = {
    "model_type": "qwen3_moe", "vocab_size": 512, "hidden_size": 512, "num_hidden_layers": 8,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "num_experts": 32,
    "num_experts_per_tok": 4, "moe_intermediate_size": 256, "intermediate_size": 1024,
    "norm_topk_prob": True, "max_position_embeddings": 4096, "torch_dtype": "float32",
    "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": False, "eos_token_id": 0,
}  # fmt: skip
ENGINE = dict(max_num_seqs=8, max_model_len=512, page_size=16, kv_pages=256,
              token_buckets=(4, 8, 32, 72, 520))  # fmt: skip
BUDGET = {"chunked": 64, "layered": 64, "orca": 256}


class TimedEngine:
    """Wraps an LLMEngine: times each step() and keeps the cost model's features of its plan.
    The engine runs with async_scheduling=False, so one step() is one plan, as simulated."""

    def __init__(self, engine, executor: CostModelExecutor) -> None:
        self.engine, self.executor = engine, executor
        self.steps: list[tuple[object, float]] = []  # (features, seconds)
        self._plan_features = None
        runner = engine.runner
        dispatch = runner.dispatch

        def traced(plan, prev=None):
            self._plan_features = executor.features(plan)  # before commit mutates the seqs
            return dispatch(plan, prev)

        runner.dispatch = traced  # instance attribute on our own engine object

    def step(self):
        self._plan_features = None
        t = time.perf_counter()
        outs = self.engine.step()
        dt = time.perf_counter() - t
        if self._plan_features is not None:
            self.steps.append((self._plan_features, dt))
        return outs


def build_engine(policy: str, model_dir: str):
    from lp_jax.llm import LLM

    t = time.perf_counter()
    llm = LLM(
        model=model_dir,
        load_format="dummy",
        scheduling=policy,
        max_num_batched_tokens=BUDGET[policy],
        layer_groups=2,
        async_scheduling=False,
        enable_prefix_caching=False,  # the simulator models no cache
        log=None,
        **ENGINE,
    )
    print(f"engine ({policy}) built and compiled in {time.perf_counter() - t:.1f} s")
    return llm.engine


def random_prompt(rng, n):
    return [int(t) for t in rng.integers(1, MODEL["vocab_size"], n)]


def calibration_run(timed: TimedEngine, rng) -> list:
    """Waves of requests: prefill-heavy, mixed and decode-heavy; (features, seconds) per step."""
    eng = timed.engine
    waves = [
        (6, (60, 200), (2, 6)),
        (8, (4, 160), (2, 14)),
        (10, (4, 40), (16, 40)),
        (12, (4, 200), (4, 24)),
    ]  # (requests, prompt range, output range)
    for count, (p_lo, p_hi), (o_lo, o_hi) in waves:
        for k in range(count):
            n, out = int(rng.integers(p_lo, p_hi)), int(rng.integers(o_lo, o_hi))
            eng.add_request(random_prompt(rng, n), SamplingParams(max_tokens=out, ignore_eos=True))
            if k % 3 == 2:  # stagger admissions so decode batches of every size occur
                for _ in range(2):
                    if eng.has_unfinished():
                        timed.step()
        while eng.has_unfinished():
            timed.step()
    samples = timed.steps[3:]  # the first steps pay one-time dispatch costs
    timed.steps = []
    return samples


def workload(n: int, rate: float, seed: int) -> list[Request]:
    rng = np.random.default_rng([seed, 1])
    t = arrival_times(n, rate, np.random.default_rng([seed, 0]))
    prompts = rng.integers(8, 200, n)
    outputs = rng.integers(4, 24, n)
    return [Request(float(a), int(p), int(o)) for a, p, o in zip(t, prompts, outputs, strict=True)]


def real_run(timed: TimedEngine, reqs: list[Request], seed: int) -> list:
    eng = timed.engine
    rng = np.random.default_rng([seed, 2])
    prompts = [random_prompt(rng, r.prompt_len) for r in reqs]
    metrics: dict[int, object] = {}
    ids: dict[int, int] = {}
    t0 = time.perf_counter()
    i = 0
    while i < len(reqs) or eng.has_unfinished():
        now = time.perf_counter() - t0
        while i < len(reqs) and reqs[i].arrival <= now:
            r = reqs[i]
            rid = eng.add_request(prompts[i], SamplingParams(max_tokens=r.output_len,
                                                             ignore_eos=True),
                                  arrival_time=t0 + r.arrival)  # fmt: skip
            ids[rid] = i
            i += 1
        if not eng.has_unfinished():
            time.sleep(max(0.0, reqs[i].arrival - (time.perf_counter() - t0)))
            continue
        for out in timed.step():
            if out.finished:
                metrics[ids[out.request_id]] = out.metrics
    return [metrics[k] for k in range(len(reqs))]


def latency_stats(metrics) -> dict[str, float]:
    ttft = [m.ttft for m in metrics]
    itl = [g for m in metrics for g in m.itls]
    out = {}
    for name, xs in (("ttft", ttft), ("itl", itl)):
        for q in (50, 90, 99):
            out[f"{name}_p{q}"] = percentile(xs, q)
    out["e2e_mean"] = sum(m.e2e for m in metrics) / len(metrics)
    return out


def evaluate(policy: str, hardware, shape: ModelShape, model_dir: str, args, rate):
    """Calibrate, run the workload on the engine and in the simulator; (markdown, payload)."""
    engine = build_engine(policy, model_dir)
    buckets = dict(token_buckets=ENGINE["token_buckets"])
    routing = UniformRouting()  # random dummy router weights spread tokens about evenly
    executor = CostModelExecutor(shape, hardware, routing=routing, **buckets)
    timed = TimedEngine(engine, executor)

    t = time.perf_counter()
    samples = calibration_run(timed, np.random.default_rng([args.seed, 9]))
    cal = Calibration.fit(samples, source=f"fitted to CPU engine steps ({policy})")
    fit_err = [cal.step_seconds(f) / s - 1 for f, s in samples]
    print(
        f"calibration: {len(samples)} steps in {time.perf_counter() - t:.1f} s -> "
        f"compute {cal.compute_efficiency:.3g}, bandwidth {cal.bandwidth_efficiency:.3g} of "
        f"peak, {1e3 * cal.overhead_s:.2f} ms/step, {1e6 * cal.layer_overhead_s:.0f} us/layer;"
        f" in-sample |error| p50 {100 * percentile([abs(e) for e in fit_err], 50):.0f}%"
    )

    sim_cfg = SimConfig(
        shape=shape, hardware=hardware, policy=policy, max_num_seqs=ENGINE["max_num_seqs"],
        max_model_len=ENGINE["max_model_len"], page_size=ENGINE["page_size"],
        num_pages=ENGINE["kv_pages"], max_num_batched_tokens=BUDGET[policy],
        layer_groups=2, routing=routing, calibration=cal, **buckets,
    )  # fmt: skip
    if rate is None:  # ~60% busy in the simulator
        probe = workload(args.requests, 1.0, args.seed)
        rate = 0.6 * args.requests / Simulator(sim_cfg).run(probe).busy_s
    reqs = workload(args.requests, rate, args.seed)
    t = time.perf_counter()
    real = real_run(timed, reqs, args.seed)
    real_wall = time.perf_counter() - t
    step_err = [cal.step_seconds(f) / s - 1 for f, s in timed.steps]
    sim = Simulator(sim_cfg).run(reqs)
    raw_cfg = SimConfig(
        **{
            **{k: getattr(sim_cfg, k) for k in sim_cfg.__dataclass_fields__},
            "calibration": Calibration(source="roofline, uncalibrated"),
        }
    )
    raw = Simulator(raw_cfg).run(reqs)

    stats = {"real": latency_stats(real), "sim": latency_stats(sim.metrics),
             "sim_uncalibrated": latency_stats(raw.metrics)}  # fmt: skip
    rows = ["| metric | real | sim | error | sim, uncalibrated roofline | error |",
            "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for key in stats["real"]:
        r, s, u = (stats[k][key] for k in ("real", "sim", "sim_uncalibrated"))
        rows.append(f"| {key} (ms) | {1e3 * r:.1f} | {1e3 * s:.1f} | {100 * (s / r - 1):+.0f}% | "
                    f"{1e3 * u:.2f} | {100 * (u / r - 1):+.0f}% |")  # fmt: skip
    abs_err = [abs(e) for e in step_err]
    lines = [
        f"## {policy}", "",
        f"{args.requests} Poisson requests at {rate:.3f} req/s (prompts 8-199, outputs 4-23 "
        "tokens).", "",
        f"Calibration ({len(samples)} steps, in-sample |error| p50 "
        f"{100 * percentile([abs(e) for e in fit_err], 50):.0f}%): compute "
        f"{cal.compute_efficiency:.3g}, bandwidth {cal.bandwidth_efficiency:.3g} of the CPU's "
        f"measured peaks, {1e3 * cal.overhead_s:.2f} ms per step, "
        f"{1e6 * cal.layer_overhead_s:.0f} us per layer.", "",
        "\n".join(rows), "",
        f"Per-step prediction error on the fidelity run's {len(step_err)} steps (out of sample):"
        f" |error| p50 {100 * percentile(abs_err, 50):.0f}%, "
        f"p90 {100 * percentile(abs_err, 90):.0f}%;"
        f" mean signed {100 * sum(step_err) / max(len(step_err), 1):+.0f}%. "
        f"Real run {real_wall:.1f} s wall, simulated span {sim.span_s:.1f} s.",
    ]  # fmt: skip
    payload = {"rate": rate, "requests": [vars_of(r) for r in reqs],
               "calibration": {k: getattr(cal, k) for k in cal.__dataclass_fields__},
               "stats": stats, "step_error": step_err, "fit_error": fit_err,
               "real_wall_s": real_wall, "sim_span_s": sim.span_s}  # fmt: skip
    return lines, payload, rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/sim_fidelity")
    ap.add_argument("--policies", default="chunked,layered", help="comma-separated")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--rate", type=float, default=None, help="req/s; default: ~60%% load")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    t_start = time.perf_counter()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    from lp_jax.roofline import measure_current_device

    hardware = measure_current_device()
    print(f"CPU roofline: {hardware.peak_flops / 1e9:.1f} GFLOP/s, "
          f"{hardware.hbm_bw / 1e9:.1f} GB/s")  # fmt: skip
    shape = ModelShape.from_hf_config(MODEL, name="fidelity-moe")
    model_dir = tempfile.mkdtemp(prefix="lp_sim_fidelity_")
    (Path(model_dir) / "config.json").write_text(json.dumps(MODEL))
    keys = ("hidden_size", "num_hidden_layers", "num_experts", "num_experts_per_tok",
            "moe_intermediate_size")  # fmt: skip
    lines = [
        "# Simulator fidelity on CPU", "",
        f"Model (dummy weights, float32): {json.dumps({k: MODEL[k] for k in keys})}; engine "
        f"{ENGINE}, budgets {BUDGET}, layered with 2 fixed groups. CPU roofline "
        f"{hardware.peak_flops / 1e9:.1f} GFLOP/s, {hardware.hbm_bw / 1e9:.1f} GB/s.", "",
    ]  # fmt: skip
    payload = {"hardware": {"peak_flops": hardware.peak_flops, "hbm_bw": hardware.hbm_bw},
               "model": MODEL, "engine": {k: list(v) if isinstance(v, tuple) else v
                                          for k, v in ENGINE.items()}}  # fmt: skip
    rate = args.rate
    for policy in args.policies.split(","):
        part, payload[policy], rate = evaluate(policy, hardware, shape, model_dir, args, rate)
        lines += part + [""]
        print("\n".join(part))
    lines.append(
        f"Total script {time.perf_counter() - t_start:.0f} s. Command: "
        f"`.venv/bin/python launch/sim_fidelity.py --policies {args.policies}`."
    )
    (out_dir / "fidelity.md").write_text("\n".join(lines) + "\n")
    (out_dir / "fidelity.json").write_text(json.dumps(payload, indent=1))
    print(f"total {time.perf_counter() - t_start:.0f} s; wrote {out_dir}/fidelity.md, .json")


def vars_of(r: Request) -> dict:
    return {"arrival": r.arrival, "prompt_len": r.prompt_len, "output_len": r.output_len}


if __name__ == "__main__":
    main()
