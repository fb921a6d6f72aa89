"""lp_jax on one H200 in one short run: its answers inside a fixed budget (380 s).

    python3 launch/gpu_validate.py --out $OUT/gpu_validate --budget-s 380  # device timeout 480 s
    python3 launch/gpu_validate.py --out runs/gv --cpu-smoke                # any machine, ~1 min
    python3 launch/gpu_validate.py --out DIR --skip kernels                 # a rerun
    python3 launch/gpu_validate.py --out runs/gv-ct --compile-times h200    # CPU host, plugin

First, before any section, a preflight is written to OUT/results.json: python, jax,
jaxlib, the CUDA plugin, flax and orbax versions, jax.devices(), nvidia-smi, the ptxas
path and free HBM. Every exit writes results.json with its reason in meta.exit ("done",
"no GPU backend: ...", an exception, a SIGTERM from the device's timeout; the watchdog
records meta.watchdog).

Sections, most valuable first, each with its share of the budget (seconds of 380; a
section's deadline is the sum of the shares so far, so time one leaves passes on):

  1 kernels   75  Pallas GPU kernels against their references at Qwen3-30B-A3B shapes,
                  bf16, on layer L-1 of a full-depth stack (~58 GB of random experts,
                  an L-layer KV pool), in a subprocess with a timeout: a hung kernel or a
                  sticky CUDA error ends the child, not the run. An op whose check failed
                  is not served later; a case not reached (or killed mid-way) is "not
                  run" and leaves its op unchecked, which the engine then serves with
                  `auto`, its start-up self-test and fallback. The share is sized from
                  the check programs' compile times measured on a CPU host
                  (`--compile-times h200`; BENCHMARKS.md).
  2 engine   185  the engine (dummy weights, only the four row buckets measured): batch-1
                  decode, concurrency-10 decode at 2048 + 512 context, 4k-prompt prefill
                  tokens/s, one 8192-token prompt chunked-512 against layered G=16 (time,
                  expert bytes, NVML energy), and a jax.profiler trace of one decode and
                  one prefill step split into Pallas kernels, matmuls and other XLA glue.
  3 moe       50  moe_ffn per layer (an 8-layer loop over stacked weights) against
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
Nothing here imports a package the H200 lacks (it has jax, flax, orbax, nvidia-ml-py and
a few more, not grain): meta.third_party_modules lists what a run imported.
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
import signal
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
from lp_jax.bench.kernel_figures import kernel_verdicts  # noqa: E402

SMOKE_LABEL = "CPU smoke, not a measurement"
# kernels: ~10 s of Python + CUDA start, the full-depth random stacks (~58 GB, one small
# program), and the 10 check programs' compiles, 1.8-8.3 s each (~40 s) deviceless on a
# 2-core host (`--compile-times h200`, BENCHMARKS.md): 75 s, taken from the MoE
# microbenchmark, whose largest token counts go first when it runs short.
SHARES_S = {"kernels": 75, "engine": 185, "moe": 50, "attention": 30, "serving": 40}


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
    serve=(4, 2048, 32), iters=10,
    # compile: a 48-layer step program compiles deviceless for the H200 in 32-46 s on a
    # 2-core host (python -m lp_jax.aot --platform cuda; BENCHMARKS.md); the H200's host
    # has more cores but autotunes, so the slowest is the guess until one is measured
    guess_s={"init": 45, "compile": 46, "case": 8, "prefill": 5})
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
        from lp_jax.config import ModelConfig

        self.scale = SMOKE if self.smoke else H200
        self.model = ModelConfig.from_hf_dict(model_config(self.smoke))
        self.engine, self.verdict = None, {}
        self.tmp = Path(tempfile.mkdtemp(prefix="gpu_validate_"))

    def finish(self, reason: str):
        """Records why the run ended (every exit path comes here) and writes the results."""
        self.data["meta"]["exit"] = reason
        self.data["meta"]["elapsed_s"] = self.clock() - self.t0
        self.save()
        shutil.rmtree(self.tmp, ignore_errors=True)


# ------------------------------------------------------------------ 1. kernels
def check_cases(cfg, smoke: bool) -> list[tuple[str, str, object]]:
    """(op, case, build) in the order the child runs them; build() -> [(name, kernel,
    reference, args, make_args)]: two jittable functions of the same arguments
    (ShapeDtypeStructs), and a function making random values of them. Every check
    addresses layer L-1 of a full-depth stack (the MoE weights, the KV pool), as the
    engine's last layer does: ~58 GB of random experts at Qwen3-30B-A3B's shapes."""
    scale, L = (SMOKE if smoke else H200), cfg.num_hidden_layers
    first, *rest = scale.check_tokens
    moe = lambda T: ("moe", f"moe_ffn[gpu] T={T}, layer {L - 1} of {L}",  # noqa: E731
                     lambda: kf.moe_check(cfg, T))
    attention = ("attention", f"attention[gpu] ragged + decode, layer {L - 1} of {L}, "
                 "contexts to " + ("40" if smoke else "4100"),
                 lambda: kf.attention_check(cfg, smoke))
    return [moe(first), attention, *map(moe, rest)]  # both ops get a verdict early



def section_kernels(run: Validation, sec: dict):
    """The checks run in a child process; its results file survives a kill."""
    path = run.out / "kernels.json"
    path.unlink(missing_ok=True)  # an earlier run's verdict must not stand in for this one
    cmd = [sys.executable, __file__, "--kernel-check", str(path), "--out", str(run.tmp)]
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=run.args.cache_dir)
    if run.smoke:
        cmd.append("--cpu-smoke")
        env["LP_JAX_PALLAS_INTERPRET"] = "1"
    timeout, killed = max(run.left(), 1.0), False
    run.step = f"kernel checks (subprocess, {timeout:.0f} s)"
    try:
        proc = subprocess.run(cmd, env=env, stderr=subprocess.PIPE, text=True, timeout=timeout)
        if proc.returncode:
            sec.update(returncode=proc.returncode, stderr_tail=proc.stderr[-2000:])
    except subprocess.TimeoutExpired:
        killed = True
        sec["not_reached"] = [f"the child was killed after {timeout:.0f} s (hung or slow)"]
    cases = json.loads(path.read_text())["cases"] if path.is_file() else []
    planned = [(op, name) for op, name, _ in check_cases(run.model, run.smoke)]
    run.verdict, not_run = kernel_verdicts(cases, planned, killed)
    sec["cases"] = cases
    if not_run:
        sec["not_run"] = not_run
    sec["verdict"] = dict(run.verdict)


def kernel_check_child(path: Path, smoke: bool):
    from lp_jax.config import ModelConfig

    cfg = ModelConfig.from_hf_dict(model_config(smoke))
    out = {"device": str(jax.devices()[0].device_kind), "cases": []}

    def write():
        path.with_suffix(".tmp").write_text(json.dumps(out, indent=1))
        path.with_suffix(".tmp").replace(path)  # whole, even if the child is killed

    for op, name, build in check_cases(cfg, smoke):
        row = {"op": op, "case": name, "status": "running"}
        out["cases"].append(row)
        write()  # a kill from here on leaves this case "running": interrupted, not failed
        t = time.perf_counter()
        row.update(attempt(lambda b=build: kf.run_check(b)))
        row.update(status="done", tol=kf.TOL, ok=row.get("rel_err", math.inf) <= kf.TOL,
                   seconds=time.perf_counter() - t)
        write()
        print(row, flush=True)


def compile_times(gpu: str, out: Path | None) -> dict:
    """Every kernel-check program compiled here for `gpu` (no device: the CUDA plugin and
    ptxas on this host), with its compile time: what section 1's share is sized from."""
    from lp_jax.config import ModelConfig
    from pallas_kernels import compile_targets

    cfg = ModelConfig.from_hf_dict(model_config(False))
    rows = []
    for op, case, build in check_cases(cfg, smoke=False):
        for name, kernel, reference, args, _ in build():
            for role, fn in (("kernel", kernel), ("reference", reference)):
                t = time.perf_counter()
                compile_targets.compile_cuda(fn, args, gpu=gpu)
                rows.append(dict(op=op, case=case, program=f"{name} {role}",
                                 compile_s=round(time.perf_counter() - t, 2)))
                print(rows[-1], flush=True)
    data = {"gpu": gpu, "programs": rows, "total_s": round(sum(r["compile_s"] for r in rows), 1)}
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / "compile_times.json").write_text(json.dumps(data, indent=1))
    return data


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
H200_PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "flax",
                 "orbax-checkpoint", "nvidia-cuda-nvcc", "nvidia-ml-py")


def preflight() -> dict:
    """What the machine is, before anything is measured: versions, devices, nvidia-smi,
    ptxas and free HBM. Every probe is guarded: a missing tool is recorded, not fatal."""
    import importlib.metadata as md

    from pallas_kernels import compile_targets

    def version(pkg):
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return None

    def smi():
        query = ("name,driver_version,memory.total,memory.used,memory.free,temperature.gpu,"
                 "power.draw,clocks.sm")
        try:
            proc = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv"],
                                  capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"unavailable: {type(e).__name__}: {e}"
        return (proc.stdout or proc.stderr).strip()[:2000]

    def hbm():
        stats = jax.devices()[0].memory_stats() or {}
        if "bytes_limit" not in stats:
            return "unavailable (no memory_stats)"
        return dict(limit_gb=stats["bytes_limit"] / 1e9,
                    free_gb=(stats["bytes_limit"] - stats.get("bytes_in_use", 0)) / 1e9)

    def cache_key_parts():
        """What JAX's persistent-cache key takes from the device (issue 25, 4b): compare
        with the compile-only H200's, BENCHMARKS.md."""
        from jax._src.lib import xla_client

        devices = jax.devices()
        return {"platform_version": devices[0].client.platform_version,
                "topology_fingerprint": xla_client.get_topology_for_devices(
                    devices[:1]).fingerprint()}

    from jax._src import lib as jax_lib

    return dict(
        python=sys.version.split()[0], executable=sys.executable,
        versions={pkg: version(pkg) for pkg in H200_PACKAGES},
        backend=jax.default_backend(), devices=attempt(lambda: {
            "devices": [f"{d.platform}:{d.id} {getattr(d, 'device_kind', '')}"
                        for d in jax.devices()]}),
        nvidia_smi=smi(), ptxas=compile_targets.ptxas_path(),
        jax_cuda_path=str(getattr(jax_lib, "cuda_path", None)),
        xla_flags=os.environ.get("XLA_FLAGS", ""), hbm=attempt(lambda: {"hbm": hbm()}),
        cache_key=attempt(cache_key_parts))


def third_party_modules() -> list[str]:
    """Top-level modules imported so far that are neither the standard library nor ours:
    what this run needs installed (the H200 has no grain, for one)."""
    ours = {"lp_jax", "pallas_kernels", "checkpoints", "bench_kernels", "gpu_validate",
            "__main__"}
    top = {m.split(".")[0] for m in list(sys.modules)} - set(sys.stdlib_module_names) - ours
    return sorted(m for m in top if not m.startswith("_")
                  and getattr(sys.modules.get(m), "__spec__", None) is not None
                  and sys.modules[m].__spec__.origin != "built-in")


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
    p.add_argument("--compile-times", metavar="GPU", default=None,
                   help="no run: compile the kernel checks here for GPU (h200, h100), timed")
    p.add_argument("--kernel-check", type=Path, help=argparse.SUPPRESS)  # the child's mode
    args = p.parse_args(argv)
    if args.kernel_check:
        return kernel_check_child(args.kernel_check, args.cpu_smoke)
    if args.compile_times:
        return compile_times(args.compile_times, Path(args.out))
    run = Validation(args, clock)
    run.data["meta"].update(
        jax=jax.__version__, date=datetime.datetime.now().isoformat(timespec="seconds"),
        label=SMOKE_LABEL if run.smoke else "measurement", smoke=run.smoke,
        command="python3 launch/gpu_validate.py " + shlex.join(
            sys.argv[1:] if argv is None else argv))
    run.data["meta"]["preflight"] = preflight()
    run.save()  # first: whatever happens next, the machine's description is on disk
    skip = set(filter(None, args.skip.split(",")))
    if skip - {name for name, _ in SECTIONS}:
        run.finish(f"bad --skip {args.skip!r}")
        p.error(f"--skip takes section names: {[name for name, _ in SECTIONS]}")
    if not run.smoke and jax.default_backend() != "gpu":
        run.finish(f"no GPU backend: jax.default_backend() is {jax.default_backend()!r} "
                   "(see preflight)")
        p.error("no GPU here: use --cpu-smoke")
    dev = jax.devices()[0]
    run.data["meta"]["device"] = getattr(dev, "device_kind", dev.platform)

    def on_sigterm(signum, frame):
        run.finish(f"killed by signal {signum} in step: {run.step}")
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        data = run.run([(name, SHARES_S[name], fn) for name, fn in SECTIONS], skip)
    except BaseException as e:
        if "exit" not in run.data["meta"]:  # a signal's handler has recorded its own
            run.finish(f"{type(e).__name__}: {str(e)[:500]} in step: {run.step}")
        raise
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    data["meta"]["third_party_modules"] = third_party_modules()
    run.finish("done")
    print(summary(data))
    print(f"wrote {run.out / 'results.json'} and {run.out / 'results.md'}")
    return data


if __name__ == "__main__":
    main()
    # Every result is written. Skip the interpreter's finalization: a daemon thread killed
    # there while inside C++ code has aborted the process ("terminate called after
    # throwing ... FATAL: exception not rethrown"), twice in the suite's smoke run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
