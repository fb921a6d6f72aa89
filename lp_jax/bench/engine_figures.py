"""Engine-level figures of launch/gpu_validate.py: decode and prefill step times, the
chunked-against-layered comparison with expert bytes and NVML energy, a profiler split
of one step, and a short serving run.

The step figures drive `ModelRunner.dispatch` and `StepHandle.collect` with hand-built plans, so a
decode at a 2560-token context runs without prefilling it first and an 8192-token prompt
runs as chunked-512 or layered plans on the same engine. The fake sequences' pages may
overlap between figures: their KV contents do not matter for timing. Each function
returns a flat dict of figures that the script writes as one table row.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import time
from pathlib import Path

import jax
import numpy as np

from lp_jax.bench.kernel_figures import PAGE_SIZE

RANDOM_ROUTING = ("dummy weights route tokens at random, which activates more experts "
                  "than a trained router: expert bytes are an upper bound")
PALLAS_KERNELS = ("mosaic_gpu", "lp_paged", "lp_tpu")  # device-kernel names of ours
MATMULS = ("gemm", "cutlass", "xmma", "nvjet", "cublas", "dot")
FILE_LIMIT = 16 << 20  # bytes: the largest file a device session brings back


def build_engine(scale, cfg_dict: dict, model_dir: Path, verdict: dict, cache_dir: str):
    """A layered engine whose row buckets are exactly the ones measured: 1 and the decode
    batch (decode), the chunk (chunked prefill) and prompt + batch (layered, serving).
    Backends: what section 1 verified, else `auto` with the start-up self-test."""
    from lp_jax.engine.config import EngineConfig
    from lp_jax.engine.llm_engine import LLMEngine

    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(cfg_dict))
    B, ctx = scale.conc
    n_req, prompt, out = scale.serve
    pages = lambda n: -(-(n + 1) // PAGE_SIZE)  # noqa: E731
    kv_pages = 1 + max(B * pages(ctx), pages(scale.long_prompt), 2 * pages(scale.prompt_4k),
                       n_req * pages(prompt + out))
    checked = "moe" in verdict and "attention" in verdict
    config = EngineConfig(
        model=str(model_dir), scheduling="layered", max_model_len=scale.long_prompt + 2 * PAGE_SIZE,
        max_num_seqs=B, max_num_batched_tokens=scale.long_prompt, layer_groups=scale.groups,
        max_layer_groups=scale.groups, page_size=PAGE_SIZE, kv_pages=kv_pages,
        load_format="dummy", dtype="bfloat16", enable_prefix_caching=False,
        moe_backend={True: "gpu", False: "xla_tiles"}.get(verdict.get("moe"), "auto"),
        attention_backend={True: "gpu", False: "xla"}.get(verdict.get("attention"), "auto"),
        backends="off" if checked else "fallback",
        token_buckets=(1, B, scale.chunk, scale.long_prompt + B), warmup=False,
        compilation_cache_dir=cache_dir)
    return LLMEngine(config, log=print)


def engine_info(engine) -> dict:
    from lp_jax.core.policies import LayeredPolicy
    from lp_jax.core.programs import step_buckets

    c = engine.config
    default = step_buckets(dataclasses.replace(engine.scheduler.config, policy=LayeredPolicy))
    return dict(layers=engine.runner.L, buckets=list(engine.runner.spec.buckets),
                default_layered_programs=len(default), kv_pages=c.kv_pages,
                kernel_backends=engine.stats()["kernel_backends"])


def fake_seqs(engine, lengths) -> list:
    """Sequences of random tokens holding consecutive pages from page 0."""
    from lp_jax.core.sequence import Sequence

    rng, first, out = np.random.default_rng(len(lengths)), 0, []
    for i, n in enumerate(lengths):
        s = Sequence(10_000 + i, rng.integers(1, engine.model_config.vocab_size, n).tolist())
        s.page_ids = list(range(first, first + -(-(n + 1) // PAGE_SIZE)))
        first += len(s.page_ids)
        out.append(s)
    return out


def chunked_plans(seq, chunk: int, L: int) -> list:
    from lp_jax.core.plan import PrefillChunk, StepPlan

    n = seq.prefill_target
    return [StepPlan(i, L, prefill=(PrefillChunk(seq, s, min(s + chunk, n)),),
                     prefill_batch_id=i) for i, s in enumerate(range(0, n, chunk))]


def layered_plans(seqs, groups: int, L: int) -> list:
    from lp_jax.core.layer_groups import split_layers
    from lp_jax.core.plan import PrefillChunk, StepPlan

    chunks = tuple(PrefillChunk(s, 0, s.prefill_target) for s in seqs)
    ranges = split_layers(L, min(groups, L))
    return [StepPlan(g, L, prefill=chunks, prefill_batch_id=0, unit_start=2 * a, unit_end=2 * b,
                     group_index=g, num_groups=len(ranges)) for g, (a, b) in enumerate(ranges)]


def run_plans(runner, plans) -> tuple[float, int]:
    """(seconds, experts activated) of the plans one after another, each waited for."""
    t, experts = time.perf_counter(), 0
    for plan in plans:
        experts += sum(runner.dispatch(plan).collect().experts_activated)
    return time.perf_counter() - t, experts


def _roofline_s(engine, steps) -> float:
    from lp_jax.roofline import ModelShape, get_hardware, model_step_cost

    shape = ModelShape.from_json(Path(engine.model_dir) / "config.json")
    hw = get_hardware("H200 SXM")
    return sum(model_step_cost(shape, s).time_on(hw) for s in steps)


def time_decode(engine, B: int, context: int, iters: int) -> dict:
    """One decode step of B sequences: each waited for (sync), and `iters` dispatched back
    to back as the overlapped engine runs them (the per-token figure)."""
    from lp_jax.core.plan import StepPlan
    from lp_jax.roofline import StepTokens

    runner = engine.runner
    plan = StepPlan(0, runner.L, decode=fake_seqs(engine, [context] * B))
    run_plans(runner, [plan])
    sync = min(run_plans(runner, [plan])[0] for _ in range(iters))
    t = time.perf_counter()
    for h in [runner.dispatch(plan) for _ in range(iters)]:
        h.collect()
    step = (time.perf_counter() - t) / iters
    bound = _roofline_s(engine, [StepTokens(decode_seqs=B, decode_context=context)])
    return dict(batch=B, context=context, ms_per_token=1e3 * step, sync_step_ms=1e3 * sync,
                roofline_ms=1e3 * bound, roofline_ratio=bound / step)


def nvml_energy_j() -> float | None:
    """The GPU's total-energy counter (NVML), or None where NVML is not available."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetTotalEnergyConsumption(
            pynvml.nvmlDeviceGetHandleByIndex(0)) / 1e3
    except Exception:  # noqa: BLE001 - no package, no driver, or no counter on this GPU
        return None


def time_prefill(run, engine, mode: str, lengths, scale) -> dict:
    """Prompts of `lengths` prefilled chunked (one prompt) or layered (one batch): a warm
    pass, then up to 3 passes while the section has twice their time; energy over them."""
    from lp_jax.roofline import StepTokens

    runner, seqs = engine.runner, fake_seqs(engine, lengths)
    plans = (chunked_plans(seqs[0], scale.chunk, runner.L) if mode == "chunked"
             else layered_plans(seqs, scale.groups, runner.L))
    last, _ = run_plans(runner, plans)
    energy0, passes = nvml_energy_j(), []
    while len(passes) < min(3, scale.iters) and (not passes or run.left() > 2 * last):
        last, experts = run_plans(runner, plans)
        passes.append(last)
    energy1, tokens, best = nvml_energy_j(), sum(lengths), min(passes)
    steps = ([StepTokens(prefill_tokens=p.prefill[0].num_tokens,
                         prefill_past=p.prefill[0].start) for p in plans] if mode == "chunked"
             else [StepTokens(prefill_tokens=tokens, prefill_seqs=len(lengths))])
    bound = _roofline_s(engine, steps)
    return dict(
        mode=mode, prompts=len(lengths), tokens=tokens, iterations=len(plans),
        passes=len(passes), ms=1e3 * best,
        tokens_per_s=tokens / best, expert_gb=experts * engine.model_config.expert_bytes / 1e9,
        mj_per_token=("unavailable (no NVML)" if energy0 is None or energy1 is None
                      else 1e3 * (energy1 - energy0) / (len(passes) * tokens)),
        roofline_ms=1e3 * bound, roofline_ratio=bound / best)


def add_comparison(sec: dict, tokens: int):
    """layered / chunked on the long prompt: time, expert bytes, energy."""
    rows = {r["mode"]: r for r in sec.get("prefill", [])
            if r.get("tokens") == tokens and r.get("prompts") == 1}
    if {"chunked", "layered"} <= set(rows):
        c, lay = rows["chunked"], rows["layered"]
        sec["layered_vs_chunked"] = {f"{k}_ratio": lay[k] / c[k] for k in
                                     ("ms", "expert_gb", "mj_per_token")
                                     if isinstance(c[k], float) and isinstance(lay[k], float)}


# ---------------------------------------------------------------------- profiler
def trace_step(run, engine, kind: str, scale) -> dict:
    """A jax.profiler trace of one decode step (the concurrency batch) or one prefill
    chunk, split by device kernel names; the trace file is kept if small enough."""
    from lp_jax.core.plan import StepPlan

    runner = engine.runner
    B, ctx = scale.conc
    plans = ([StepPlan(0, runner.L, decode=fake_seqs(engine, [ctx] * B))] if kind == "decode"
             else chunked_plans(fake_seqs(engine, [scale.chunk])[0], scale.chunk, runner.L))
    run_plans(runner, plans)
    folder = run.tmp / f"trace_{kind}"
    with jax.profiler.trace(str(folder)):
        wall, _ = run_plans(runner, plans)
    [path] = sorted(folder.rglob("*.xplane.pb"))[-1:]
    if path.stat().st_size <= FILE_LIMIT:
        shutil.copy(path, run.out / f"trace_{kind}.xplane.pb")
    split = trace_split(path, jax.default_backend() == "gpu")
    return dict(wall_ms=1e3 * wall, host_or_idle_ms=1e3 * wall - split["device_busy_ms"],
                **split)


def trace_split(path: Path, gpu: bool) -> dict:
    """Device time by kind: our Pallas kernels, matmuls (cuBLAS, XLA dots), other XLA glue
    (norms, routing, gathers, sampling); the busiest kernel names. On a GPU the events are
    the kernels of the device's streams; on a CPU, the host's XLA ops (nested: a smoke
    figure only)."""
    from jax.profiler import ProfileData

    profile = ProfileData.from_file(str(path))  # the planes live as long as it does
    planes = list(profile.planes)
    if gpu:
        device = [line for p in planes if p.name.startswith("/device:") for line in p.lines]
        lines = [line for line in device if line.name.startswith("Stream")]
        events = [(e.name, e.start_ns, e.duration_ns) for line in lines for e in line.events]
    else:
        lines = [line for p in planes if p.name == "/host:CPU" for line in p.lines]
        events = [(e.name, e.start_ns, e.duration_ns) for line in lines for e in line.events
                  if any(k == "hlo_op" for k, _ in e.stats)]
    if not events:
        return {"device_busy_ms": 0.0, "error": "no device events in the trace (CUPTI?); "
                f"device lines: {[line.name for line in device] if gpu else []}"}
    split = {"pallas_kernels_ms": 0.0, "matmuls_ms": 0.0, "other_xla_ms": 0.0}
    by_name: dict[str, float] = {}
    for name, _, ns in events:
        low = name.lower()
        kind = ("pallas_kernels_ms" if any(s in low for s in PALLAS_KERNELS) else
                "matmuls_ms" if any(s in low for s in MATMULS) else "other_xla_ms")
        split[kind] += ns / 1e6
        by_name[name[:60]] = by_name.get(name[:60], 0.0) + ns / 1e6
    busy, end = 0.0, -math.inf
    for _, start, ns in sorted(events, key=lambda e: e[1]):  # union of the intervals
        busy += max(0.0, start + ns - max(start, end))
        end = max(end, start + ns)
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:8]
    return dict(device_busy_ms=busy / 1e6, **split,
                top_kernels="; ".join(f"{n} {ms:.3g} ms" for n, ms in top))


# ------------------------------------------------------------------------ serving
def serve(engine, n: int, prompt: int, out: int, run) -> dict:
    """n requests at once through LLMEngine.step() until done or out of time."""
    from lp_jax.core.metrics import summarize
    from lp_jax.core.sampling_params import SamplingParams

    rng = np.random.default_rng(7)
    params = SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True)
    before = engine.stats()
    for _ in range(n):
        engine.add_request(rng.integers(1, engine.model_config.vocab_size, prompt).tolist(),
                           params)
    done, t = [], time.perf_counter()
    while engine.has_unfinished() and run.left() > 1.0:
        done += [o for o in engine.step() if o.finished]
    s, after = summarize([o.metrics for o in done]), engine.stats()
    delta = {k: after[k] - before[k] for k in ("expert_bytes_loaded", "row_layers_useful",
                                               "row_layers_padded")}
    return dict(
        finished=len(done), cut_at_deadline=engine.has_unfinished(),
        wall_s=time.perf_counter() - t, ttft_mean_s=s["ttft_mean"], ttft_p99_s=s["ttft_p99"],
        max_itl_p99_s=s["max_itl_p99"], e2e_p50_s=s["e2e_p50"],
        expert_gb=delta["expert_bytes_loaded"] / 1e9,
        expert_bytes_note=RANDOM_ROUTING,
        compiles_while_serving=after["compilations_after_warmup"],
        host_overhead_fraction=after["host_overhead_fraction"],
        padding_ratio=delta["row_layers_padded"] / max(delta["row_layers_useful"], 1),
        kernel_backends=after["kernel_backends"])
