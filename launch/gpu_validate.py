"""lp_jax on one H200 in one short run: its answers inside a fixed budget (380 s).

    python3 launch/gpu_validate.py --out $OUT/gpu_validate --budget-s 380  # device timeout 480 s
    python3 launch/gpu_validate.py --out runs/gv --cpu-smoke                # any machine, ~1 min
    python3 launch/gpu_validate.py --out DIR --skip kernels                 # a rerun

Sections, most valuable first, each with its share of the budget (seconds of 380; a
section's deadline is the sum of the shares so far, so time one leaves passes on):

  1 kernels   60  Pallas GPU kernels against their references at Qwen3-30B-A3B shapes,
                  bf16, in a subprocess with a timeout: a hung kernel or a sticky CUDA
                  error ends the child, not the run. A failed kernel is not served later.
  2 engine   185  the engine (dummy weights, only the four row buckets measured): batch-1
                  decode, concurrency-10 decode at 2048 + 512 context, 4k-prompt prefill
                  tokens/s, one 8192-token prompt chunked-512 against layered G=16 (time,
                  expert bytes, NVML energy), and a jax.profiler trace of one decode and
                  one prefill step split into Pallas kernels, matmuls and other XLA glue.
  3 moe       65  moe_ffn per layer (an 8-layer loop over stacked weights) against
                  lax.ragged_dot and jax's ragged_dot_mgpu (timed only: untrusted, it
                  refills a WGMMA slot without waiting): us, GB/s, TFLOP/s.
  4 attention 30  decode attention GB/s against the H200's 4.8 TB/s.
  5 serving   40  a short LLMEngine.step() run: TTFT, inter-token latency, compiles.

The deadline machinery is lp_jax/bench/budget.py: every step that compiles first checks
the time left, what does not fit is listed under `not_reached`, a section that cannot
start is `skipped` with the reason, OUT/results.json and OUT/results.md are rewritten
after every figure (a kill keeps what was done), and a watchdog ends a run hung past the
budget (+ --grace-s), naming the step. The budget counts from JAX's start, a few seconds
into the process. The figures themselves are lp_jax/bench/{kernel,engine}_figures.py.

Weights are the loader's `dummy` format, drawn one layer slice at a time on the device
(`--init lean`: no whole-model init is compiled just to size memory). Dummy weights
route tokens at random, which activates more experts than a trained router: every
expert-bytes figure says so. With --cpu-smoke everything runs on tiny shapes (the GPU
kernels interpreted) and every figure is labelled "CPU smoke, not a measurement".
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if "--cpu-smoke" in sys.argv:
    os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # the kernel child shares the GPU
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")  # 61 GB of weights + KV
REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "launch")]

import jax  # noqa: E402

from lp_jax.bench import engine_figures as ef  # noqa: E402
from lp_jax.bench import kernel_figures as kf  # noqa: E402
from lp_jax.bench.budget import BudgetRun, attempt, summary  # noqa: E402

SMOKE_LABEL = "CPU smoke, not a measurement"
SHARES_S = {"kernels": 60, "engine": 185, "moe": 65, "attention": 30, "serving": 40}


@dataclasses.dataclass(frozen=True)
class Scale:
    """Every size the run uses: the H200 set and the CPU-smoke set."""

    check_tokens: tuple[int, ...]  # MoE kernel check
    b1_context: int
    conc: tuple[int, int]  # decode batch, context (2048 prompt + half of 1024 outputs)
    chunk: int
    long_prompt: int
    groups: int
    prompt_4k: int
    moe_tokens: tuple[int, ...]
    moe_loop: int  # layers of the moe_ffn timing loop
    attn_points: tuple[tuple[str, int, int], ...]  # backend, batch, context
    serve: tuple[int, int, int]  # requests, prompt tokens, output tokens
    iters: int
    guess_s: dict  # seconds a step is assumed to take before one is measured


H200 = Scale(
    check_tokens=(1, 128, 2048), b1_context=2048, conc=(10, 2560), chunk=512,
    long_prompt=8192, groups=16, prompt_4k=4096, moe_tokens=(1, 32, 128, 4096, 16384),
    moe_loop=8, attn_points=(("auto", 32, 4096), ("auto", 1, 8192), ("auto", 128, 4096),
                             ("xla", 32, 4096)),
    serve=(4, 2048, 32), iters=10, guess_s={"init": 45, "compile": 40, "case": 8, "prefill": 5})
SMOKE = Scale(
    check_tokens=(16,), b1_context=48, conc=(3, 64), chunk=32, long_prompt=256, groups=4,
    prompt_4k=128, moe_tokens=(1, 32), moe_loop=2, attn_points=(("auto", 2, 64),),
    serve=(2, 48, 4), iters=2, guess_s={"init": 10, "compile": 10, "case": 3, "prefill": 2})


def model_config(smoke: bool) -> dict:
    if smoke:
        from checkpoints.make_tiny import build_config

        return {**build_config("tiny"), "num_hidden_layers": 4, "max_window_layers": 4,
                "torch_dtype": "bfloat16"}
    return json.loads((REPO / "checkpoints/configs/Qwen3-30B-A3B.json").read_text())


class Validation(BudgetRun):
    """The budgeted run, and what its sections share: sizes, kernel verdicts, the engine."""

    def __init__(self, args, clock):
        self.args, self.smoke = args, args.cpu_smoke
        super().__init__(args.out, args.budget_s, title="GPU validation", clock=clock,
                         section_label=SMOKE_LABEL if self.smoke else None,
                         grace_s=args.grace_s)
        self.scale = SMOKE if self.smoke else H200
        self.engine, self.verdict = None, {}
        self.tmp = Path(tempfile.mkdtemp(prefix="gpu_validate_"))


# ------------------------------------------------------------------ 1. kernels
def section_kernels(run: Validation, sec: dict):
    """The checks run in a child process; its results file survives a kill."""
    path = run.out / "kernels.json"
    path.unlink(missing_ok=True)  # an earlier run's verdict must not stand in for this one
    cmd = [sys.executable, __file__, "--kernel-check", str(path), "--out", str(run.tmp)]
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=run.args.cache_dir)
    if run.smoke:
        cmd.append("--cpu-smoke")
        env["LP_JAX_PALLAS_INTERPRET"] = "1"
    timeout = max(run.left(), 1.0)
    run.step = f"kernel checks (subprocess, {timeout:.0f} s)"
    try:
        proc = subprocess.run(cmd, env=env, stderr=subprocess.PIPE, text=True, timeout=timeout)
        if proc.returncode:
            sec.update(returncode=proc.returncode, stderr_tail=proc.stderr[-2000:])
    except subprocess.TimeoutExpired:
        sec["not_reached"] = [f"the child was killed after {timeout:.0f} s (hung or slow)"]
    cases = json.loads(path.read_text())["cases"] if path.is_file() else []
    sec["cases"] = cases
    expected = {"moe": len(run.scale.check_tokens), "attention": 1}  # a crash ends a case
    for op, n in expected.items():
        mine = [c for c in cases if c["op"] == op]
        run.verdict[op] = len(mine) == n and all(c["ok"] for c in mine)
    sec["verdict"] = dict(run.verdict)


def kernel_check_child(path: Path, smoke: bool):
    from lp_jax.config import ModelConfig

    cfg = ModelConfig.from_hf_dict(model_config(smoke))
    scale = SMOKE if smoke else H200
    cases = [("moe", f"moe_ffn[gpu] T={T}", lambda T=T: kf.check_moe(cfg, T))
             for T in scale.check_tokens]
    cases.append(("attention", "attention[gpu] ragged + decode, contexts to 4100",
                  lambda: kf.check_attention(cfg, smoke)))
    out = {"device": str(jax.devices()[0].device_kind), "cases": []}
    for op, name, check in cases:
        t = time.perf_counter()
        row = {"op": op, "case": name, **attempt(lambda c=check: {"rel_err": c()})}
        row.update(tol=kf.TOL, ok=row.get("rel_err", math.inf) <= kf.TOL,
                   seconds=time.perf_counter() - t)
        out["cases"].append(row)
        path.with_suffix(".tmp").write_text(json.dumps(out, indent=1))
        path.with_suffix(".tmp").replace(path)  # whole, even if the child is killed
        print(row, flush=True)


# ------------------------------------------------------------------- 2. engine
def get_engine(run: Validation, sec: dict):
    """The engine shared by sections 2 and 5, built on first use; None if out of time or
    if its build failed (which is not retried)."""
    meta = run.data["meta"]
    if run.engine is None and "engine" in meta:
        sec.setdefault("not_reached", []).append("the engine: its build failed in section 2")
    elif run.engine is None and run.fits(sec, run.scale.guess_s["init"], "model init + engine"):
        t, meta["engine"] = time.perf_counter(), {"init": "failed"}
        run.engine = ef.build_engine(run.scale, model_config(run.smoke), run.tmp / "model",
                                     run.verdict if not run.smoke else {}, run.args.cache_dir)
        meta["engine"] = dict(init_s=time.perf_counter() - t, **ef.engine_info(run.engine))
        run.save()
    return run.engine


def ensure_programs(run: Validation, sec: dict, buckets) -> bool:
    """Compiles the row buckets a figure needs. Once one compile has been timed, all the
    remaining measured buckets compile together (in parallel) if that fits, else only the
    figure's own, one by one, each only if it fits."""
    runner, engine_meta = run.engine.runner, run.data["meta"]["engine"]
    todo = [N for N in runner.spec.buckets if N not in runner.programs]
    compiles = engine_meta.setdefault("compiles", [])
    one = max((c["seconds"] for c in compiles if len(c["buckets"]) == 1),
              default=run.scale.guess_s["compile"])
    if compiles and len(todo) > 1 and run.fits(sec, one * (0.5 + 0.5 * len(todo)),
                                               f"compile buckets {todo} in parallel"):
        t = time.perf_counter()
        runner.warmup(log=None)
        compiles.append({"buckets": todo, "seconds": time.perf_counter() - t})
    for N in buckets:
        if N in runner.programs:
            continue
        if not run.fits(sec, 1.2 * one, f"compile bucket {N}"):
            return False
        t = time.perf_counter()
        runner._program(N)
        compiles.append({"buckets": [N], "seconds": time.perf_counter() - t})
    return True


def section_engine(run: Validation, sec: dict):
    sc, engine = run.scale, get_engine(run, sec)
    if engine is None:
        return
    B, ctx = sc.conc
    pre_rows = sc.long_prompt + B
    figures = [
        ("decode", "batch 1", (1,), lambda: ef.time_decode(engine, 1, sc.b1_context, sc.iters)),
        ("decode", f"concurrency {B}", (B,), lambda: ef.time_decode(engine, B, ctx, sc.iters)),
        ("prefill", f"{sc.long_prompt}-token prompt, chunked-{sc.chunk}", (sc.chunk,),
         lambda: ef.time_prefill(run, engine, "chunked", [sc.long_prompt], sc)),
        ("prefill", f"{sc.long_prompt}-token prompt, layered G={sc.groups}", (pre_rows,),
         lambda: ef.time_prefill(run, engine, "layered", [sc.long_prompt], sc)),
        ("prefill", f"{sc.prompt_4k}-token prompt, chunked-{sc.chunk}", (sc.chunk,),
         lambda: ef.time_prefill(run, engine, "chunked", [sc.prompt_4k], sc)),
        ("prefill", f"2 x {sc.prompt_4k}-token prompts, layered G={sc.groups}", (pre_rows,),
         lambda: ef.time_prefill(run, engine, "layered", [sc.prompt_4k] * 2, sc)),
        ("trace", "one decode step", (B,), lambda: ef.trace_step(run, engine, "decode", sc)),
        ("trace", f"one prefill step (chunk {sc.chunk})", (sc.chunk,),
         lambda: ef.trace_step(run, engine, "prefill", sc)),
    ]
    for table, name, buckets, measure in figures:
        if not ensure_programs(run, sec, buckets):
            continue
        if not run.fits(sec, sc.guess_s["prefill"], f"engine: {name}"):
            continue
        sec.setdefault(table, []).append({"figure": name, **attempt(measure)})
        run.save()
    ef.add_comparison(sec, sc.long_prompt)
    sec["expert_bytes_note"] = ef.RANDOM_ROUTING
    sec["kernel_backends"] = engine.stats()["kernel_backends"]


# ---------------------------------------------------------------------- 3. moe
def section_moe(run: Validation, sec: dict):
    import bench_kernels as bk

    from lp_jax.config import ModelConfig

    sc = run.scale
    cfg = ModelConfig.from_hf_dict(model_config(run.smoke))
    bench = kf.MoeBench(cfg, sc.moe_loop)
    primary = "xla_tiles" if run.smoke else "gpu"
    ops = {f"moe_ffn[{primary}]": bench.moe_ffn(primary),
           "ragged_dot": bk._grouped_ffn(jax.lax.ragged_dot)}
    if run.verdict.get("moe") is False:
        ops.pop(f"moe_ffn[{primary}]")
        sec["moe_ffn"] = "not timed: it failed its check in section 1"
    if kf.is_hopper():
        ops["ragged_dot_mgpu"] = bk._grouped_ffn(bk._mgpu_ragged_dot())
    sec["ragged_dot_mgpu_note"] = kf.MGPU_UNTRUSTED if kf.is_hopper() else "not run: no Hopper"
    sec["method"] = (f"moe_ffn: per layer, in a {sc.moe_loop}-layer loop over stacked weights; "
                     "ragged_dot(_mgpu): one call on pre-sorted rows, no routing or combine")
    last = {}  # op -> (tokens, seconds per call): guards against a dense fallback's time
    for T in sc.moe_tokens:
        for op, fn in ops.items():
            T0, call_s = last.get(op, (T, 0.0))
            if not run.fits(sec, sc.guess_s["case"] + call_s * T / T0 * (sc.iters + 2),
                            f"moe: {op} T={T}"):
                continue
            row = {"op": op, "tokens": T,
                   **attempt(lambda op=op, fn=fn, T=T: bench.time(op, fn, T, sc.iters))}
            if "us" in row:
                last[op] = (T, row["us"] / 1e6 * (sc.moe_loop if "moe_ffn" in op else 1))
            if op == "ragged_dot_mgpu":
                row["trusted"] = False
            sec.setdefault("rows", []).append(row)
            run.save()


# ---------------------------------------------------------------- 4. attention
def section_attention(run: Validation, sec: dict):
    from lp_jax.config import ModelConfig

    cfg = ModelConfig.from_hf_dict(model_config(run.smoke))
    for backend, batch, context in run.scale.attn_points:
        if backend == "auto" and run.verdict.get("attention") is False:
            sec.setdefault("not_reached", []).append(f"{backend} B={batch}: failed its check")
            continue
        if run.fits(sec, run.scale.guess_s["case"], f"attention {backend} B={batch} x {context}"):
            sec.setdefault("rows", []).append({"backend": backend, **attempt(
                lambda b=backend, B=batch, c=context: kf.time_attention(
                    cfg, b, B, c, run.scale.iters))})
            run.save()


# ------------------------------------------------------------------ 5. serving
def section_serving(run: Validation, sec: dict):
    sc, engine = run.scale, get_engine(run, sec)
    if engine is None or not ensure_programs(run, sec, engine.runner.spec.buckets):
        return
    n, prompt, out = sc.serve
    sec["workload"] = f"{n} requests of {prompt} random tokens at once, {out} outputs each"
    sec.update(ef.serve(engine, n, prompt, out, run))


SECTIONS = (("kernels", section_kernels), ("engine", section_engine), ("moe", section_moe),
            ("attention", section_attention), ("serving", section_serving))


# --------------------------------------------------------------------- main
def main(argv=None, clock=time.perf_counter):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="results folder")
    p.add_argument("--budget-s", type=float, default=380.0)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU")
    p.add_argument("--init", choices=("lean",), default="lean",
                   help="weights: the loader's dummy format, one layer slice at a time")
    p.add_argument("--skip", default="", help="comma list of sections to leave out (a rerun)")
    p.add_argument("--grace-s", type=float, default=60.0, help="watchdog: past the budget")
    p.add_argument("--cache-dir", default=str(Path.home() / ".cache/lp_jax/jax_cache"))
    p.add_argument("--kernel-check", type=Path, help=argparse.SUPPRESS)  # the child's mode
    args = p.parse_args(argv)
    if args.kernel_check:
        return kernel_check_child(args.kernel_check, args.cpu_smoke)
    skip = set(filter(None, args.skip.split(",")))
    if skip - {name for name, _ in SECTIONS}:
        p.error(f"--skip takes section names: {[name for name, _ in SECTIONS]}")
    if not args.cpu_smoke and jax.default_backend() != "gpu":
        p.error("no GPU here: use --cpu-smoke")
    run = Validation(args, clock)
    dev = jax.devices()[0]
    run.data["meta"].update(
        device=getattr(dev, "device_kind", dev.platform), jax=jax.__version__,
        date=datetime.datetime.now().isoformat(timespec="seconds"),
        label=SMOKE_LABEL if run.smoke else "measurement", smoke=run.smoke,
        command="python3 launch/gpu_validate.py " + shlex.join(
            sys.argv[1:] if argv is None else argv))
    data = run.run([(name, SHARES_S[name], fn) for name, fn in SECTIONS], skip)
    shutil.rmtree(run.tmp, ignore_errors=True)
    print(summary(data))
    print(f"wrote {run.out / 'results.json'} and {run.out / 'results.md'}")
    return data


if __name__ == "__main__":
    main()
