"""One-shot validation of lp_jax on a GPU (an H200): kernels, MoE throughput, step times,
serving. Made for a short device session: everything runs in one process under one
deadline and the results survive a kill.

    python launch/gpu_validate.py --out DIR [--budget-s 480] [--layers N] [--quick]
    python launch/gpu_validate.py --out DIR --cpu-smoke        # tiny shapes, any machine

Sections, in order of value. Each checks the time left before it starts (too little:
"skipped: out of time"), stops its inner loops at its share of the budget (the rows it
did not reach are listed), and records an exception with its traceback instead of
stopping the run:

  1 kernels  the Pallas GPU kernels (MoE `gpu`; attention `gpu` decode and ragged
             prefill) compiled and checked against the XLA references (rel. error
             1e-5 float32, 2e-2 16-bit; the MoE kernel takes 16-bit weights only), plus
             a KV pool past 2**31 elements (GPU only)
  2 moe      moe_ffn vs jax.lax.ragged_dot vs ragged_dot_mgpu at Qwen3-30B-A3B expert
             shapes over tokens per call; the knee against the ridge points (table and
             measured); is ragged_dot a dense fallback (timing vs one dense matmul, and
             the compiled HLO); decode-attention GB/s
  3 steps    a Qwen3-30B-A3B-shaped model with random weights (--layers of 48): decode
             step at batch 1/32/128 and 10 (2560 context), an 8192-token prefill chunked
             at 512 vs layered with G=16 (time, expert bytes), 4k-prompt prefill
             throughput, hybrid iterations; each beside its roofline bound
  4 serving  a short Poisson run of long prompts under chunked and layered on the same
             engine: TTFT, max-ITL p99, expert bytes, energy per token from NVML

DIR/results.json and DIR/results.md (a BENCHMARKS.md section) are rewritten after every
measurement. Compile cost is explicit: a persistent compilation cache (DIR/jax_cache or
--cache-dir), minimal bucket sets, programs compiled on first use with their seconds
recorded. Step times drive the engine's ModelRunner with hand-built plans (contexts of
any length without prefilling them); serving goes through LLMEngine.step().

A kernel that fails its check in section 1 is replaced by its XLA reference in sections
3-4 (recorded). Against hangs (a kernel never run on hardware may deadlock) a watchdog
ends the process --hang-grace-s past a section's deadline, after writing which step it
was in; rerun with --avoid moe_gpu / attn_gpu / mgpu and --sections to skip the culprit.
Weights: the engine's load_format="dummy" loader when its one-jit init fits in free
memory (checked by compiling it first), else a per-layer random init of the same tree.

On a machine without a GPU, or with --cpu-smoke, every section runs on tiny shapes, the
Pallas GPU kernels in interpret mode, and every figure is labelled "CPU smoke, not a
measurement": the run only proves the code paths.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import gc
import json
import math
import os
import platform
import shlex
import statistics
import sys
import threading
import time
import traceback
from pathlib import Path

if __name__ == "__main__" and "--cpu-smoke" in sys.argv:
    os.environ["JAX_PLATFORMS"] = "cpu"
# JAX preallocates 75% of GPU memory; the 61 GB model plus its KV pool needs more.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

SMOKE_LABEL = "CPU smoke, not a measurement"
SECTIONS = ("kernels", "moe", "steps", "serving")
# Cumulative share of the budget at which each section must stop; time a section does
# not use passes to the next ones. Second number: seconds a section needs to start.
PLAN = {"kernels": (0.14, 20), "moe": (0.38, 30), "steps": (0.76, 60), "serving": (1.0, 30)}
PAPER = {  # /work/shared/papers.md, Layered Prefill (2x H100, TP2, vLLM)
    "prefill_chunked": "8192-token input, chunk 512: total prefill > 500 ms, MoE > 50% of it",
    "prefill_layered": "chunk 4096-8192: MoE load < 100 GB, prefill ~200 ms",
    "ttft": "mean TTFT up to -70% (GPT-OSS); E2E -41% (Qwen+arXiv)",
    "energy": "Qwen3-30B-A3B 56.6 -> 44.2 mJ/token (-22%) at max in-SLO rate",
    "expert_bytes": "expert-load traffic -39% (arXiv), -12% (ShareGPT)",
    "ridge": "MoE below the ridge point (100-300 FLOP/B) at 512-token chunks",
}
TOL = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 2e-2}
LOOP = 8  # layers in the per-layer MoE timing loop


@dataclasses.dataclass(frozen=True)
class Scale:
    """Every size the run uses: the H200 set and the CPU-smoke set."""

    moe_check: tuple  # (D, F, E, top_k) of the kernel check
    moe_cases: tuple  # (tokens, dtype, masked token ids)
    attn: tuple  # (N, K, H, S)
    attn_decode_ctx: tuple  # context lengths (0: padding sequence)
    attn_ragged: tuple  # (cached prefix, new tokens)
    attn_dtypes: tuple
    big_pool_pages: int  # 0: skip the > 2**31-element pool check
    moe_shape: tuple  # (D, F, E, top_k) of the sweep
    moe_tokens: tuple  # most valuable first; reported sorted
    moe_secondary: tuple  # tokens at which moe_ffn[xla] and the dense matmul also run
    moe_loop_tokens: tuple  # tokens at which moe_ffn is also timed per layer in a loop
    attn_bw_points: tuple  # (batch, context)
    long_prompt: int
    chunk: int
    groups: int
    decode_batches: tuple
    decode_ctx: int
    conc: tuple  # (batch, context) of the concurrency-10 target
    prompt_4k: int
    hybrid_batch: int
    serve: dict
    iters: int
    warmup: int
    reps: int


H200 = Scale(
    moe_check=(2048, 768, 128, 8),
    moe_cases=((1, "bfloat16", ()), (64, "bfloat16", (0, 5, 63)), (1024, "bfloat16", ()),
               (256, "float16", ())),
    attn=(32, 4, 128, 16), attn_decode_ctx=(1, 17, 300, 2048, 0, 4100),
    attn_ragged=((0, 100), (37, 64), (500, 1), (0, 300), (0, 0)),
    attn_dtypes=("float32", "bfloat16"), big_pool_pages=140_000,
    moe_shape=(2048, 768, 128, 8),
    moe_tokens=(1, 32, 128, 512, 4096, 8192, 16384, 2, 8, 64, 256, 1024, 2048, 4, 16),
    moe_secondary=(1, 128, 512, 8192), moe_loop_tokens=(1, 32, 128),
    attn_bw_points=((1, 8192), (32, 2048), (128, 2048)),
    long_prompt=8192, chunk=512, groups=16, decode_batches=(1, 32, 128), decode_ctx=2048,
    conc=(10, 2560), prompt_4k=4096, hybrid_batch=32,
    serve=dict(requests=12, rate=1.5, prompt=(4096, 8192), out=64, bucket=32),
    iters=20, warmup=2, reps=2,
)
SMOKE = Scale(
    moe_check=(64, 64, 8, 2),
    moe_cases=((1, "float32", ()), (16, "bfloat16", (2, 3)), (16, "float32", ())),
    attn=(4, 2, 16, 16), attn_decode_ctx=(1, 17, 40, 0),
    attn_ragged=((0, 20), (5, 9), (30, 1), (0, 0)),
    attn_dtypes=("float32", "bfloat16"), big_pool_pages=64,
    moe_shape=(128, 64, 16, 4), moe_tokens=(1, 64, 8), moe_secondary=(1, 64),
    moe_loop_tokens=(1,),
    attn_bw_points=((2, 64),),
    long_prompt=256, chunk=32, groups=4, decode_batches=(1, 4, 8), decode_ctx=48,
    conc=(3, 64), prompt_4k=128, hybrid_batch=4,
    serve=dict(requests=3, rate=20.0, prompt=(64, 256), out=4, bucket=4),
    iters=2, warmup=1, reps=1,
)
TINY_MOE = {  # the smoke model: Qwen3-MoE layout, every dimension tiny
    "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 512,
    "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
    "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 4096,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "eos_token_id": 0,
}


# ------------------------------------------------------------------------ plumbing
class Ctx:
    """The run: arguments, the report, the deadline, state shared between sections."""

    def __init__(self, args, smoke: bool):
        self.args, self.smoke = args, smoke
        self.scale = SMOKE if smoke else H200
        if args.quick and not smoke:
            self.scale = dataclasses.replace(
                H200, moe_tokens=(1, 32, 128, 512, 4096, 8192), iters=10, reps=1,
                serve={**H200.serve, "requests": 6})
        elif args.quick:  # the test's setting: one case per kind, fewest programs
            self.scale = dataclasses.replace(
                SMOKE, moe_cases=SMOKE.moe_cases[1:2], attn_dtypes=("bfloat16",),
                moe_tokens=(1, 8), moe_secondary=(8,), attn_bw_points=(), decode_batches=(1, 4),
                serve={**SMOKE.serve, "requests": 2})
        self.t0 = time.perf_counter()
        self.deadline = self.t0 + args.budget_s
        self.section_deadline = self.deadline
        self.out = Path(args.out)
        self.state: dict = {}
        self.data = {"meta": {}, "sections": {}, "targets": []}
        self.lock = threading.RLock()
        self.avoid = set(filter(None, args.avoid.split(",")))

    def log(self, msg: str):
        """Prints progress and records it, so a hang shows where it happened."""
        self.data["meta"]["current"] = msg
        print(f"  {time.perf_counter() - self.t0:7.1f} s  {msg}", flush=True)
        self.flush()

    def left(self) -> float:
        return self.section_deadline - time.perf_counter()

    def time_for(self, seconds: float) -> bool:
        return self.left() >= seconds

    def flush(self):
        with self.lock:  # the watchdog thread flushes too
            self.out.mkdir(parents=True, exist_ok=True)
            for name, text in (("results.json", json.dumps(self.data, indent=1,
                                                           default=_jsonable)),
                               ("results.md", render_md(self.data))):
                tmp = self.out / (name + ".tmp")
                tmp.write_text(text)
                tmp.replace(self.out / name)


def _jsonable(x):
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return str(x)


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[:500]}"


def _timeit(fn, *args, iters: int, warmup: int):
    """(best, median) seconds of fn(*args), outputs blocked on."""
    from pallas_kernels.timing import time_call

    return tuple(time_call(fn, *args, iters=iters, warmup=warmup))


def _compile(fn, *args):
    """(compiled, seconds) of jax.jit(fn) for args."""
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled, time.perf_counter() - t0


def rel_err(x, y) -> float:
    x = np.asarray(x, np.float32)
    y = np.asarray(y, np.float32)
    if not np.isfinite(x).all():
        return math.inf
    return float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))


def _is_hopper() -> bool:
    dev = jax.devices()[0]
    return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9")


def _load_launch(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"_launch_{name}", REPO / "launch" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _hardware():
    from lp_jax.roofline import get_hardware

    return get_hardware("H200 SXM")


def _memory() -> dict:
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - CPU backends may have none
        stats = {}
    return {k: stats[k] for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")
            if k in stats}


def add_target(ctx, name, value, target, op, unit, *, paper=None, note=None):
    """One row of the targets table; `met` stays None on a smoke run or without a value."""
    met = None
    if value is not None and not ctx.smoke and math.isfinite(value):
        met = value <= target if op == "<=" else value >= target
    row = dict(name=name, value=value, target=target, op=op, unit=unit, met=met,
               distance=None if value is None else value - target)
    if paper:
        row["paper"] = paper
    if note:
        row["note"] = note
    ctx.data["targets"] = [t for t in ctx.data["targets"] if t["name"] != name] + [row]


# ------------------------------------------------------------------ 1. kernels
def _moe_inputs(T, D, F, E, dtype, seed, masked=()):
    k = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(k[0], (T, D), jnp.float32).astype(dtype)
    logits = jax.random.normal(k[1], (T, E), jnp.float32) * 2.0
    wgu = (jax.random.normal(k[2], (E, D, 2 * F), jnp.float32) / math.sqrt(D)).astype(dtype)
    wd = (jax.random.normal(k[3], (E, F, D), jnp.float32) / math.sqrt(F)).astype(dtype)
    mask = np.ones(T, bool)
    mask[[m for m in masked if m < T]] = False
    return x, logits, wgu, wd, jnp.asarray(mask)


def check_moe_kernel(ctx, sec):
    from pallas_kernels.moe.ref import ref_moe_ffn

    D, F, E, A = ctx.scale.moe_check
    rows = sec.setdefault("moe_gpu", [])
    if "moe_gpu" in ctx.avoid:
        sec["moe_gpu_skipped"] = "skipped: --avoid moe_gpu"
        ctx.state["moe_gpu_ok"] = False
        return
    kw = dict(top_k=A, norm_topk_prob=True)
    for i, (T, dtype, masked) in enumerate(ctx.scale.moe_cases):
        ctx.log(f"kernels: moe_ffn[gpu] T={T} {dtype}")
        if not ctx.time_for(5):
            sec.setdefault("not_reached", []).append(f"moe_gpu T={T} {dtype}")
            continue
        row = dict(kernel="moe_ffn[gpu]", tokens=T, dtype=dtype, shape=f"D={D} F={F} E={E} k={A}")
        rows.append(row)
        try:
            x, logits, wgu, wd, mask = _moe_inputs(T, D, F, E, jnp.dtype(dtype), i, masked)
            with jax.default_matmul_precision("highest"):
                y_ref, s_ref = jax.jit(lambda x, lg, a, b, m: ref_moe_ffn(
                    x, lg, a, b, token_mask_T=m, **kw))(
                    x.astype(jnp.float32), logits, wgu.astype(jnp.float32),
                    wd.astype(jnp.float32), mask)
            fn = functools.partial(_moe_call, backend="gpu", interpret=ctx.smoke or None, **kw)
            compiled, row["compile_s"] = _compile(fn, x, logits, wgu, wd, mask)
            y, stats = compiled(x, logits, wgu, wd, mask)
            row["rel_err"] = rel_err(y, y_ref)
            row["tol"] = TOL[dtype]
            row["experts_match"] = int(stats["experts_activated"]) == int(
                s_ref["experts_activated"])
            row["ok"] = row["rel_err"] <= row["tol"] and row["experts_match"]
        except Exception as e:  # noqa: BLE001 - one case failing must not hide the others
            row.update(ok=False, error=_err(e), traceback=traceback.format_exc())
        print(f"    {row.get('rel_err', row.get('error'))} (compile {row.get('compile_s')} s)")
    ctx.state["moe_gpu_ok"] = bool(rows) and all(r.get("ok") for r in rows)


def _moe_call(x, logits, wgu, wd, mask, *, backend, interpret, **kw):
    from pallas_kernels.moe import moe_ffn

    return moe_ffn(x, logits, wgu, wd, backend=backend, token_mask_T=mask,
                   interpret=interpret, **kw)


def attention_batch(seqs, *, N, K, H, S, dtype, seed, pool_pages=None, decode=False):
    """A ragged (or decode: one token per sequence) batch on a random paged pool.

    seqs: (cached prefix, new tokens) per sequence; (0, 0) is a padding sequence. The
    pages of the batch are distinct, drawn from the top of a pool of `pool_pages` pages
    (default: just enough), and filled whole with random data, so a kernel that reads a
    wrong page or an unmasked slot disagrees with the reference."""
    rng = np.random.default_rng(seed)
    lens = [p + n for p, n in seqs]
    need = [-(-n // S) for n in lens]
    C = max(1, max(need))
    P = max(pool_pages or 0, sum(need) + 3)
    pages = P - 1 - rng.permutation(sum(need) + 3)[: sum(need)]
    table = np.zeros((len(seqs), C), np.int32)
    used = 0
    for b, n in enumerate(need):
        table[b, :n] = pages[used:used + n]
        used += n
    pool = jnp.zeros((P, S, 2 * K, H), dtype)
    if used:
        fill = jax.random.normal(jax.random.key(seed), (used, S, 2 * K, H), jnp.float32)
        pool = pool.at[jnp.asarray(pages[:used])].set(fill.astype(dtype))
    q_lens = [1 if decode and n else (0 if decode else n) for _, n in seqs]
    T = len(seqs) if decode else max(1, sum(q_lens))
    q = jax.random.normal(jax.random.key(seed + 1), (T, N, H), jnp.float32).astype(dtype)
    query_start = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return dict(q=q, pool=pool, seq_lens=jnp.asarray(lens, jnp.int32),
                table=jnp.asarray(table), query_start=jnp.asarray(query_start),
                num_seqs=jnp.int32(len(seqs)))


def _attn_run(kind, b, *, backend, sm_scale, f32=False):
    from pallas_kernels import attention

    q, pool = b["q"], b["pool"]
    if f32:
        q, pool = q.astype(jnp.float32), pool.astype(jnp.float32)
    if kind == "decode":
        return attention.decode_attention(q, pool, b["seq_lens"], b["table"],
                                          sm_scale=sm_scale, backend=backend)
    return attention.ragged_paged_attention(q, pool, b["query_start"], b["seq_lens"],
                                            b["table"], b["num_seqs"], sm_scale=sm_scale,
                                            backend=backend)


def check_attention_kernels(ctx, sec):
    from pallas_kernels import attention

    N, K, H, S = ctx.scale.attn
    rows = sec.setdefault("attention_gpu", [])
    if "attn_gpu" in ctx.avoid:
        sec["attention_gpu_skipped"] = "skipped: --avoid attn_gpu"
        ctx.state["attn_gpu_ok"] = False
        return
    cases = []
    for dtype in ctx.scale.attn_dtypes:
        cases.append(("decode", dtype, [(max(c - 1, 0), 1 if c else 0)
                                        for c in ctx.scale.attn_decode_ctx], None))
        cases.append(("ragged", dtype, list(ctx.scale.attn_ragged), None))
    if ctx.scale.big_pool_pages:
        big = [(2047, 1), (4000, 1), (0, 0)]
        cases.append(("decode", "bfloat16", big, ctx.scale.big_pool_pages))
        cases.append(("ragged", "bfloat16", [(300, 64), (0, 128)], ctx.scale.big_pool_pages))
    for i, (kind, dtype, seqs, pool_pages) in enumerate(cases):
        ctx.log(f"kernels: attention[gpu] {kind} {dtype}" + (" big pool" if pool_pages else ""))
        if not ctx.time_for(5):
            sec.setdefault("not_reached", []).append(f"attention {kind} {dtype}")
            continue
        row = dict(kernel=f"attention[gpu] {kind}", dtype=dtype, seqs=str(seqs),
                   shape=f"N={N} K={K} H={H} S={S}")
        rows.append(row)
        try:
            b = attention_batch(seqs, N=N, K=K, H=H, S=S, dtype=jnp.dtype(dtype), seed=10 + i,
                                pool_pages=pool_pages, decode=kind == "decode")
            if pool_pages:
                row["pool_elements"] = int(b["pool"].size)
                row["kernel"] += f" (pages at the top of a {row['pool_elements']:.3g}-element pool)"
            with jax.default_matmul_precision("highest"):
                ref = jax.jit(functools.partial(_attn_run, kind, backend="xla", sm_scale=H**-0.5,
                                                f32=not pool_pages))(b)
            with attention.interpret_mode(ctx.smoke):
                compiled, row["compile_s"] = _compile(
                    functools.partial(_attn_run, kind, backend="gpu", sm_scale=H**-0.5), b)
            row["rel_err"] = rel_err(compiled(b), ref)
            row["tol"] = TOL[dtype]
            row["ok"] = row["rel_err"] <= row["tol"]
            del b, ref
        except Exception as e:  # noqa: BLE001
            row.update(ok=False, error=_err(e), traceback=traceback.format_exc())
        print(f"    {row.get('rel_err', row.get('error'))} (compile {row.get('compile_s')} s)")
    normal = [r for r in rows if "pool_elements" not in r]
    ctx.state["attn_gpu_ok"] = bool(normal) and all(r.get("ok") for r in normal)
    bigs = [r for r in rows if r.get("pool_elements", 0) >= 2**31]
    ctx.state["big_pool_ok"] = all(r.get("ok") for r in bigs) if bigs else None


def section_kernels(ctx, sec):
    sec["interpret"] = ctx.smoke
    check_moe_kernel(ctx, sec)
    check_attention_kernels(ctx, sec)
    sec["verdict"] = {k: ctx.state.get(k) for k in ("moe_gpu_ok", "attn_gpu_ok", "big_pool_ok")}


# ---------------------------------------------------------------------- 2. moe
def section_moe(ctx, sec):
    from lp_jax.roofline import compute_bound_tokens, measure_current_device
    from lp_jax.roofline.cost_model import expert_traffic
    from lp_jax.roofline.knee import default_moe_shape
    from pallas_kernels.moe.ref import dispatch, route

    bk = _load_launch("bench_kernels")
    D, F, E, A = ctx.scale.moe_shape
    dtype = jnp.bfloat16
    layer_shape = dataclasses.replace(default_moe_shape(2, small=False), hidden_size=D,
                                      expert_width=F, num_experts=E, top_k=A,
                                      name=f"moe D={D} F={F} E={E} k={A}")
    backends = ["xla_tiles", "xla"] if ctx.smoke else ["gpu", "xla"]
    if "moe_gpu" in ctx.avoid and not ctx.smoke:
        backends = ["xla"]
    primary = backends[0]
    sec.update(shape=dict(D=D, F=F, E=E, top_k=A, dtype="bfloat16"), primary=primary)
    k1, k2 = jax.random.split(jax.random.key(0))
    w1 = (jax.random.normal(k1, (E, D, 2 * F), jnp.float32) / math.sqrt(D)).astype(dtype)
    w2 = (jax.random.normal(k2, (E, F, D), jnp.float32) / math.sqrt(F)).astype(dtype)
    bytes_per_expert = 3 * D * F * 2
    ops = {f"moe_ffn[{b}]": functools.partial(_moe_sweep_call, backend=b, top_k=A)
           for b in backends}
    if ctx.smoke and "moe_gpu" not in ctx.avoid:  # the Hopper kernel, interpreted, tiny T
        ops["moe_ffn[gpu] (interpret)"] = functools.partial(
            _moe_sweep_call, backend="gpu", top_k=A, interpret=True)
    ops["ragged_dot"] = bk._grouped_ffn(jax.lax.ragged_dot)
    ops["dense_matmul"] = _dense_ffn
    secondary = {"moe_ffn[xla]", "dense_matmul"} - {f"moe_ffn[{primary}]"}
    # Per layer as the model runs it: a fori_loop over LOOP layers' distinct weights, so
    # neither host dispatch (~10-50 us per call) nor L2 reuse of one layer's experts counts.
    loop_name = f"moe_ffn[{primary}] per layer ({LOOP}-layer loop)"
    ops[loop_name] = functools.partial(_moe_layer_loop, backend=primary, top_k=A)
    w1s = jnp.stack([w1 * (1.0 + i / 64) for i in range(LOOP)])
    w2s = jnp.stack([w2 * (1.0 + i / 64) for i in range(LOOP)])
    if _is_hopper() and "mgpu" not in ctx.avoid:
        ops["ragged_dot_mgpu"] = bk._grouped_ffn(bk._mgpu_ragged_dot())
    else:
        sec["ragged_dot_mgpu"] = _mgpu_lowering_check(bk, D, F, E)
    rows = sec.setdefault("rows", [])
    hw_table = _hardware()
    ctx.log("moe: measure_current_device (the roofline's measured entry)")
    try:
        ctx.state["measured_hw"] = measure_current_device()
    except Exception as e:  # noqa: BLE001
        sec["measured_device_error"] = _err(e)
    for T in ctx.scale.moe_tokens:
        if not ctx.time_for(3):
            sec.setdefault("not_reached", []).append(T)
            continue
        kx, kl = jax.random.split(jax.random.fold_in(jax.random.key(1), T))
        x = jax.random.normal(kx, (T, D), jnp.float32).astype(dtype)
        logits = jax.random.normal(kl, (T, E), jnp.float32)
        _, ids = route(logits, A, True)
        _, token_ids, sizes = dispatch(ids, E, None)
        activated = int(jnp.sum(sizes > 0))
        x_rows = x[token_ids]
        flops = 2.0 * T * A * D * 3 * F
        fl, wb, ab = expert_traffic(layer_shape, T)  # roofline: uniform-routing E_act(T)
        bound_ms = 1e3 * max(float(fl) / hw_table.peak_flops, float(wb + ab) / hw_table.hbm_bw)
        for name, fn in ops.items():
            if ("interpret" in name and T > 8) or (
                    name in secondary and T not in ctx.scale.moe_secondary) or (
                    name == loop_name and T not in ctx.scale.moe_loop_tokens):
                continue
            ctx.log(f"moe: {name} T={T}")
            if not ctx.time_for(2):
                sec.setdefault("not_reached", []).append(f"{name} T={T}")
                continue
            if name == loop_name:
                args = (x, logits, w1s, w2s)
            elif name.startswith("moe_ffn"):
                args = (x, logits, w1, w2)
            elif name == "dense_matmul":
                args = (x_rows, w1[0], w2[0])
            else:
                args = (x_rows, w1, w2, sizes)
            row = dict(op=name, tokens=T, experts_activated=activated)
            rows.append(row)
            try:
                compiled, row["compile_s"] = _compile(fn, *args)
                iters = 1 if "interpret" in name else ctx.scale.iters
                best, med = _timeit(compiled, *args, iters=iters, warmup=ctx.scale.warmup)
                if name == loop_name:
                    best, med = best / LOOP, med / LOOP
                weight_bytes = (bytes_per_expert if name == "dense_matmul"
                                else activated * bytes_per_expert)
                row.update(best_ms=best * 1e3, median_ms=med * 1e3, tflops=flops / best / 1e12,
                           weight_gbps=weight_bytes / best / 1e9, bound_ms=bound_ms)
                if name == "ragged_dot" and T >= sec.get("ragged_dot_hlo", {}).get("tokens", 0):
                    sec["ragged_dot_hlo"] = dict(tokens=T, **_hlo_summary(compiled))
            except Exception as e:  # noqa: BLE001
                row.update(error=_err(e), traceback=traceback.format_exc())
    rows.sort(key=lambda r: (r["tokens"], r["op"]))
    _moe_verdicts(ctx, sec, primary, E)
    # The knee, credited with the cost model's useful work, against the ridge points.
    from lp_jax.roofline.knee import KneePoint, KneeResult

    points = []
    for r in rows:
        if r["op"] == f"moe_ffn[{primary}]" and "best_ms" in r:
            fl, wb, ab = expert_traffic(layer_shape, r["tokens"])
            s = r["best_ms"] / 1e3
            points.append(KneePoint(r["tokens"], s, float(fl), float(wb + ab), float(fl) / s,
                                    float(wb + ab) / s))
    knee = dict(op=f"moe_ffn[{primary}]", threshold=0.8)
    if points:
        peak = max(p.flops_per_s for p in points)
        res = KneeResult(tuple(points), min(p.tokens for p in points
                                            if p.flops_per_s >= 0.8 * peak), 0.8,
                         jax.devices()[0].device_kind)
        knee.update(knee_tokens=res.knee_tokens, max_tflops=res.max_flops_per_s / 1e12,
                    largest_tokens_measured=max(p.tokens for p in points))
    cb = compute_bound_tokens(layer_shape, hw_table)
    knee["table"] = dict(hardware=hw_table.name, ridge_flop_per_byte=hw_table.ridge_point,
                         compute_bound_tokens_simple=cb.simple_tokens,
                         compute_bound_tokens_exact=cb.exact_tokens)
    measured = ctx.state.get("measured_hw")
    if measured is not None:
        cbm = compute_bound_tokens(layer_shape, measured)
        knee["measured"] = dict(hardware=measured.name, tflops=measured.peak_flops / 1e12,
                                gbps=measured.hbm_bw / 1e9,
                                ridge_flop_per_byte=measured.ridge_point,
                                compute_bound_tokens_exact=cbm.exact_tokens)
    sec["knee"] = knee
    ctx.flush()
    _attention_bandwidth(ctx, sec)


def _moe_layer_loop(x, logits, w1s, w2s, *, backend, top_k):
    def layer(i, x):
        return _moe_sweep_call(x, logits, w1s[i], w2s[i], backend=backend, top_k=top_k)

    return jax.lax.fori_loop(0, w1s.shape[0], layer, x)


def _moe_sweep_call(x, logits, w1, w2, *, backend, top_k, interpret=None):
    from pallas_kernels.moe import moe_ffn

    return moe_ffn(x, logits, w1, w2, top_k=top_k, norm_topk_prob=True, backend=backend,
                   interpret=interpret)[0]


def _dense_ffn(x_RD, w_gate_up_DF2, w_down_FD):
    """The same rows through ONE expert: the dense floor a grouped matmul should reach."""
    F = w_down_FD.shape[0]
    h = x_RD @ w_gate_up_DF2
    return (jax.nn.silu(h[:, :F]) * h[:, F:]).astype(x_RD.dtype) @ w_down_FD


def _hlo_summary(compiled) -> dict:
    """What XLA made of ragged_dot: loops, dots and custom calls in the compiled HLO."""
    try:
        text = compiled.as_text()
    except Exception as e:  # noqa: BLE001
        return {"error": _err(e)}
    lines = text.splitlines()
    pick = [ln.strip()[:200] for ln in lines
            if any(s in ln for s in (" dot(", "ragged", "custom-call(", "custom_call_target"))]
    return {"while_loops": sum(" while(" in ln for ln in lines),
            "dots": sum(" dot(" in ln for ln in lines),
            "ragged_ops": sum("ragged" in ln.lower() for ln in lines),
            "custom_calls": sum("custom-call(" in ln for ln in lines),
            "lines": pick[:12]}


def _mgpu_lowering_check(bk, D, F, E) -> dict:
    """Off Hopper: lower ragged_dot_mgpu for an H200 (catches API breaks; not a run)."""
    T, A = 64, 4
    sd = jax.ShapeDtypeStruct
    args = (sd((T * A, D), jnp.bfloat16), sd((E, D, 2 * F), jnp.bfloat16),
            sd((E, F, D), jnp.bfloat16), sd((E,), jnp.int32))
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev)
    try:
        with jax.sharding.use_abstract_mesh(mesh):
            exp = jax.export.export(
                bk._grouped_ffn(bk._mgpu_ragged_dot()), platforms=["cuda"],
                disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("mosaic_gpu_v2")])
            mlir = exp(*args).mlir_module()
        return {"status": "lowered for an H200, not run (no Hopper GPU here)",
                "mosaic_calls": mlir.count("custom_call @mosaic_gpu")}
    except Exception as e:  # noqa: BLE001
        return {"status": "lowering failed", "error": _err(e)}


def _moe_verdicts(ctx, sec, primary, E):
    rows = [r for r in sec["rows"] if "best_ms" in r]
    by = {(r["op"], r["tokens"]): r for r in rows}
    prim = f"moe_ffn[{primary}]"
    loop = f"{prim} per layer ({LOOP}-layer loop)"
    one = by.get((loop, 1)) or by.get((prim, 1))
    add_target(ctx, "moe_ffn 1 token, per layer", one and one["best_ms"] * 1e3, 35, "<=", "us",
               note=one and f"from {one['op']}")
    mid = [max(by[(op, t)]["weight_gbps"] for op in (prim, loop) if (op, t) in by)
           for t in (32, 64, 128) if (prim, t) in by or (loop, t) in by]
    add_target(ctx, "moe_ffn 32-128 tokens: expert-weight streaming (min)",
               min(mid) / 1e3 if mid else None, 3.3, ">=", "TB/s")
    big = [by[(prim, t)]["tflops"] for t in (4096, 8192, 16384) if (prim, t) in by]
    add_target(ctx, "moe_ffn 4k-16k tokens (min)", min(big) if big else None, 500, ">=",
               "TFLOP/s")
    speed = [by[("ragged_dot", t)]["best_ms"] / by[(prim, t)]["best_ms"]
             for (op, t) in by if op == prim and t <= 512 and ("ragged_dot", t) in by]
    add_target(ctx, "moe_ffn vs ragged_dot at <= 512 tokens (min speed-up)",
               min(speed) if speed else None, 1.2, ">=", "x")
    # Dense fallback: a dense lowering computes every expert for every row, ~E x the
    # useful work, so its time against one dense matmul of the same rows grows towards E.
    ratios = {t: by[("ragged_dot", t)]["best_ms"] / by[("dense_matmul", t)]["best_ms"]
              for (op, t) in by if op == "ragged_dot" and ("dense_matmul", t) in by}
    if ratios:
        t_max = max(ratios)
        r = ratios[t_max]
        verdict = ("looks like a dense fallback (time ~ E x one dense matmul)" if r > E / 4 else
                   "grouped: within a few x of one dense matmul" if r < 4 else "unclear")
        sec["ragged_dot_dense_check"] = dict(ratio_by_tokens=ratios, tokens=t_max, ratio=r,
                                             experts=E, verdict=verdict)


def _attention_bandwidth(ctx, sec):
    from pallas_kernels.attention import bench

    rows = sec.setdefault("decode_attention", [])
    shapes = (dict(num_heads=4, num_kv_heads=2, head_dim=16, page_size=16) if ctx.smoke else
              dict(num_heads=32, num_kv_heads=4, head_dim=128, page_size=16))
    for batch, context in ctx.scale.attn_bw_points:
        ctx.log(f"moe: decode attention B={batch} ctx={context}")
        if not ctx.time_for(3):
            sec.setdefault("not_reached", []).append(f"decode attention B={batch} ctx={context}")
            continue
        try:
            row = bench.bench_decode_attention(batch=batch, context=context,
                                               repeats=ctx.scale.iters,
                                               peak_bw=_hardware().hbm_bw, **shapes)
        except Exception as e:  # noqa: BLE001
            row = dict(batch=batch, context=context, error=_err(e))
        rows.append(row)


# ---------------------------------------------------------------------- 3. steps
def model_config(ctx) -> dict:
    if ctx.smoke:
        cfg = dict(TINY_MOE)
        if ctx.args.layers:
            cfg["num_hidden_layers"] = ctx.args.layers
        return cfg
    cfg = json.loads((REPO / "checkpoints/configs/Qwen3-30B-A3B.json").read_text())
    cfg["num_hidden_layers"] = ctx.args.layers or cfg["num_hidden_layers"]
    return cfg


def lean_dummy_model(cfg, dtype, mesh, seed=0):
    """Random weights like load_format="dummy", generated one layer slice at a time, so
    no parameter-sized float32 temporary exists (the one-jit dummy init may need one)."""
    from flax import nnx

    from lp_jax.loader import abstract_model, param_shardings

    graphdef, abstract = abstract_model(cfg, dtype)
    shardings = dict(nnx.to_flat_state(param_shardings(abstract, mesh)))
    flat = nnx.to_flat_state(abstract)
    key = jax.random.key(seed)

    @functools.partial(jax.jit, donate_argnums=0)
    def fill_slice(buf, k, i, std):
        v = jax.random.normal(k, buf.shape[1:], jnp.float32) * std
        return jax.lax.dynamic_update_index_in_dim(buf, v.astype(buf.dtype), i, 0)

    for n, (path, var) in enumerate(flat):
        name, shape, dt, sh = str(path[-1]), tuple(var.shape), var.dtype, shardings[path]
        k = jax.random.fold_in(key, n)
        std = 1.0 / math.sqrt(shape[-1] if name == "embed_tokens" else shape[-2]
                              if len(shape) > 1 else 1)
        if "norm" in name:
            value = jax.jit(lambda s=shape, d=dt: jnp.ones(s, d), out_shardings=sh)()
        elif math.prod(shape) * 4 <= 2**31 or len(shape) < 3:
            value = jax.jit(lambda k, s=shape, d=dt, c=std: (
                jax.random.normal(k, s, jnp.float32) * c).astype(d), out_shardings=sh)(k)
        else:
            value = jax.jit(lambda s=shape, d=dt: jnp.zeros(s, d), out_shardings=sh)()
            for i in range(shape[0]):
                value = fill_slice(value, jax.random.fold_in(k, i), jnp.int32(i),
                                   jnp.float32(std))
        var.set_value(value)
    jax.block_until_ready([v.get_value() for _, v in flat])
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def build_model(ctx, sec, cfg_dict):
    """The engine's dummy loader if its one-jit init fits in free memory, else the lean
    init (`--init` forces either). Returns (model, ModelConfig)."""
    from flax import nnx

    from lp_jax.config import ModelConfig
    from lp_jax.loader import abstract_model, load_model, param_shardings
    from lp_jax.models.qwen3_moe import Qwen3MoeForCausalLM
    from lp_jax.sharding import make_mesh

    cfg = ModelConfig.from_hf_dict(cfg_dict)
    mesh = make_mesh()
    mode = ctx.args.init
    info = sec.setdefault("model", {})
    if mode == "auto":
        _, abstract = abstract_model(cfg, "bfloat16")
        shardings = param_shardings(abstract, mesh)
        init = jax.jit(lambda: nnx.state(Qwen3MoeForCausalLM(cfg, rngs=nnx.Rngs(0),
                                                             dtype="bfloat16")),
                       out_shardings=shardings)
        mem = init.lower().compile().memory_analysis()
        need = mem.output_size_in_bytes + mem.temp_size_in_bytes
        limit = _memory().get("bytes_limit")
        free = limit - _memory().get("bytes_in_use", 0) if limit else None
        info.update(dummy_init_output_bytes=mem.output_size_in_bytes,
                    dummy_init_temp_bytes=mem.temp_size_in_bytes, free_bytes=free)
        mode = "dummy" if free is None or need <= 0.95 * free else "lean"
    t0 = time.perf_counter()
    ctx.log(f"steps: {mode} init of {cfg.num_hidden_layers} layers")
    model = None
    if mode == "dummy":
        try:
            model = load_model(config=cfg, load_format="dummy", mesh=mesh, dtype="bfloat16")
            jax.block_until_ready(nnx.state(model))
        except Exception as e:  # noqa: BLE001 - e.g. out of memory: the lean init next
            info["dummy_error"] = _err(e)
            model, mode = None, "lean"
            gc.collect()
    if model is None:
        model = lean_dummy_model(cfg, "bfloat16", mesh)
    info.update(init=mode, init_s=time.perf_counter() - t0, layers=cfg.num_hidden_layers,
                params_bytes=sum(v.nbytes for v in jax.tree.leaves(nnx.state(model))),
                memory_after=_memory())
    if ctx.smoke and mode != "lean":  # prove the lean path too (the GPU may need it)
        lean = lean_dummy_model(cfg, "bfloat16", mesh)
        a = [(x.shape, x.dtype) for x in jax.tree.leaves(nnx.state(model))]
        b = [(x.shape, x.dtype) for x in jax.tree.leaves(nnx.state(lean))]
        info["lean_init_matches_dummy_tree"] = a == b
        del lean
    return model, cfg


@contextlib.contextmanager
def reuse_model(model):
    """LLMEngine loads its model through lp_jax.loader.load_model; hand it ours."""
    import lp_jax.loader as loader

    orig = loader.load_model
    loader.load_model = lambda *a, **k: model
    try:
        yield
    finally:
        loader.load_model = orig


def page_plan(ctx, L, S, page_elems):
    """Disjoint page regions for the fake sequences, and the pool size (pages per layer).
    If the kernels failed on a pool past 2**31 elements, the pool stays under it and the
    decode contexts shrink to fit (recorded)."""
    sc = ctx.scale
    pages = lambda n: -(-(n + 1) // S)  # noqa: E731 - as fake_seq allocates
    decode_ctx = {B: sc.decode_ctx for B in sc.decode_batches}
    decode_ctx[sc.conc[0]] = sc.conc[1]
    fixed = pages(sc.long_prompt) + 2 * pages(sc.prompt_4k) + 8
    want = max(B * pages(c) for B, c in decode_ctx.items()) + fixed
    cap = None
    if ctx.state.get("big_pool_ok") is False:
        cap = (2**31 - 1) // (page_elems * L)
        for B in decode_ctx:
            decode_ctx[B] = min(decode_ctx[B], S * ((cap - fixed) // B) - 2)
    total = min(want, cap) if cap else want
    return decode_ctx, total


class Pages:
    def __init__(self):
        self.next = 0

    def take(self, n):
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def fake_seq(sid, n_tokens, pager, S, vocab, rng, max_tokens=1 << 20):
    from lp_jax.engine.sampling_params import SamplingParams
    from lp_jax.engine.sequence import Sequence

    s = Sequence(sid, rng.integers(1, vocab, n_tokens).tolist(),
                 SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    s.page_ids = pager.take(-(-(n_tokens + 1) // S))
    return s


def run_plans(runner, plans):
    """Executes plans one after another; per-plan seconds, experts activated, compile s."""
    times, experts = [], 0
    c0 = runner.compile_seconds
    for p in plans:
        t0 = time.perf_counter()
        _, counts = runner.execute(p)  # returns after the device step
        times.append(time.perf_counter() - t0)
        experts += sum(counts)
    return times, experts, runner.compile_seconds - c0


def chunked_plans(seq, chunk, L, decode=(), first_id=0):
    from lp_jax.engine.plan import PrefillChunk, StepPlan

    n = seq.prefill_target
    return [StepPlan(first_id + i, L, decode=decode,
                     prefill=(PrefillChunk(seq, s, min(s + chunk, n)),),
                     prefill_batch_id=first_id + i)
            for i, s in enumerate(range(0, n, chunk))]


def layered_plans(seqs, groups, L, decode=(), batch_id=0):
    from lp_jax.engine.layer_groups import split_layers
    from lp_jax.engine.plan import PrefillChunk, StepPlan

    chunks = tuple(PrefillChunk(s, 0, s.prefill_target) for s in seqs)
    ranges = split_layers(L, groups)
    return [StepPlan(batch_id * 100 + g, L, decode=decode, prefill=chunks,
                     prefill_batch_id=batch_id, layer_start=a, layer_end=b, group_index=g,
                     num_groups=len(ranges))
            for g, (a, b) in enumerate(ranges)]


def timed_passes(ctx, runner, make_plans, reps):
    """One warm pass (compiles), then up to `reps` timed passes; per-plan best times."""
    warm, _, compile_s = run_plans(runner, make_plans())
    best, experts = None, 0
    for _ in range(reps):
        if best is not None and not ctx.time_for(3 * sum(best)):
            break
        times, experts, _ = run_plans(runner, make_plans())
        best = times if best is None else [min(a, b) for a, b in zip(best, times, strict=True)]
    return dict(iter_s=best, total_s=sum(best), experts=experts, compile_s=compile_s,
                warm_total_s=sum(warm))


def make_engine(ctx, sec):
    """The model (random weights) and an LLMEngine around it, shared by steps and serving.

    Programs compile on first use (warmup=False); bucket sets are the minimal ones the
    measurements reach. A kernel that failed (or was avoided) in section 1 is replaced by
    its XLA reference."""
    from lp_jax.engine.config import EngineConfig
    from lp_jax.engine.llm_engine import LLMEngine

    sc = ctx.scale
    cfg_dict = model_config(ctx)
    model_dir = ctx.out / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(cfg_dict, indent=1))
    L = cfg_dict["num_hidden_layers"]
    G = min(sc.groups, L)
    sec["config"] = dict(layers=L, groups=G, chunk=sc.chunk, long_prompt=sc.long_prompt)
    if not ctx.smoke and L != 48:
        sec["config"]["note"] = f"{L} of Qwen3-30B-A3B's 48 layers (--layers)"
    ok = lambda k, a: ctx.state.get(k, True) and a not in ctx.avoid  # noqa: E731
    backends = dict(moe="auto" if ok("moe_gpu_ok", "moe_gpu") else "xla",
                    attention="auto" if ok("attn_gpu_ok", "attn_gpu") else "xla")
    sec["backends"] = backends
    model, mcfg = build_model(ctx, sec, cfg_dict)
    S = 16
    decode_ctx, kv_pages = page_plan(ctx, L, S, S * 2 * mcfg.num_key_value_heads * mcfg.head_dim)
    sec["config"].update(kv_pages=kv_pages, decode_ctx=decode_ctx)
    econf = EngineConfig(
        model=str(model_dir), scheduling="chunked", max_model_len=sc.long_prompt + 128,
        max_num_seqs=max(sc.decode_batches), max_num_batched_tokens=sc.chunk,
        page_size=S, kv_pages=kv_pages, load_format="dummy", dtype="bfloat16",
        moe_backend=backends["moe"], attention_backend=backends["attention"],
        prefill_buckets=(sc.chunk, sc.long_prompt), decode_buckets=sc.decode_batches,
        warmup=False, compilation_cache_dir=str(ctx.cache_dir))
    ctx.log("engine: building (programs compile on first use)")
    with reuse_model(model):
        engine = LLMEngine(econf, log=None)
    sec["memory_engine"] = _memory()
    ctx.state.update(engine=engine, L=L, G=G, mcfg=mcfg, decode_ctx=decode_ctx, S=S,
                     model_dir=model_dir)
    return engine


def section_steps(ctx, sec):
    from lp_jax.engine.plan import StepPlan
    from lp_jax.roofline import ModelShape, StepTokens, model_step_cost
    from lp_jax.roofline.cost_model import expert_traffic

    sc = ctx.scale
    engine = make_engine(ctx, sec)
    st = ctx.state
    L, G, mcfg, decode_ctx, S = st["L"], st["G"], st["mcfg"], st["decode_ctx"], st["S"]
    model_dir = st["model_dir"]
    runner = engine.runner
    shape = ModelShape.from_json(model_dir / "config.json", name=f"Qwen3-MoE L={L}")
    hw = _hardware()
    rng = np.random.default_rng(0)
    V = mcfg.vocab_size
    pager_decode = Pages()
    decode_pool = {}

    def decode_seqs(B, c):
        key = (B, c)
        if key not in decode_pool:
            pager_decode.next = 0  # regions of different tests may overlap: only timing
            decode_pool[key] = tuple(fake_seq(1000 + i, c, pager_decode, S, V, rng)
                                     for i in range(B))
        return decode_pool[key]

    # Decode steps.
    rows = sec.setdefault("decode", [])
    points = [(B, decode_ctx[B]) for B in sc.decode_batches]
    if sc.conc not in points:
        points.append((sc.conc[0], decode_ctx[sc.conc[0]]))
    for B, c in points:
        ctx.log(f"steps: decode B={B} ctx={c}")
        if not ctx.time_for(10):
            sec.setdefault("not_reached", []).append(f"decode B={B}")
            continue
        row = dict(batch=B, context=c)
        rows.append(row)
        try:
            plan = StepPlan(0, L, decode=decode_seqs(B, c))
            c0 = runner.compile_seconds
            times, _, _ = run_plans(runner, [plan] * sc.warmup)
            row["compile_s"] = runner.compile_seconds - c0
            times, experts, _ = run_plans(runner, [plan] * sc.iters)
            cost = model_step_cost(shape, StepTokens(decode_seqs=B, decode_context=c))
            best = min(times)
            row.update(best_ms=best * 1e3, median_ms=statistics.median(times) * 1e3,
                       bound_ms=cost.time_on(hw) * 1e3, bytes=cost.bytes,
                       achieved_gbps=cost.bytes / best / 1e9,
                       hbm_utilisation=cost.bytes / best / hw.hbm_bw,
                       experts_per_step=experts / len(times),
                       cost_model_experts_per_step=float(
                           expert_traffic(shape, B)[1] / shape.expert_bytes) * L)
        except Exception as e:  # noqa: BLE001
            row.update(error=_err(e), traceback=traceback.format_exc())
        print(f"    best {row.get('best_ms', row.get('error'))} ms "
              f"(compile {row.get('compile_s')} s)")
    by_b = {(r["batch"], r["context"]): r for r in rows if "best_ms" in r}
    b1 = by_b.get((1, decode_ctx[1]))
    add_target(ctx, "decode batch 1, ms/token", b1 and b1["best_ms"], 2.5, "<=", "ms",
               note=b1 and f"roofline floor {b1['bound_ms']:.2f} ms (issue: ~1.3 ms)")
    bc = by_b.get((sc.conc[0], decode_ctx[sc.conc[0]]))
    add_target(ctx, f"decode concurrency {sc.conc[0]}, context {decode_ctx[sc.conc[0]]}, "
               "ms/token", bc and bc["best_ms"], 9.0, "<=", "ms",
               note=f"one decode step (bucket {_bucket(sc.conc[0], sc.decode_batches)}) at the "
               "mean context of a 2048-token prompt with 1024 outputs")

    # Prefill of one long prompt: chunked vs layered; then 4k prompts; then hybrid.
    pager = Pages()
    pager.next = max(B * -(-(c + 1) // S) for B, c in decode_ctx.items()) + 1
    long_seq = fake_seq(1, sc.long_prompt, pager, S, V, rng)
    seqs_4k = [fake_seq(2 + i, sc.prompt_4k, pager, S, V, rng) for i in range(2)]
    ebytes = mcfg.expert_bytes
    pre = sec.setdefault("prefill", [])
    hyb_B, hyb_c = sc.hybrid_batch, decode_ctx.get(sc.hybrid_batch, sc.decode_ctx)
    cases = [
        ("chunked", sc.long_prompt, lambda: chunked_plans(long_seq, sc.chunk, L)),
        ("layered", sc.long_prompt, lambda: layered_plans([long_seq], G, L)),
        ("chunked 4k", sc.prompt_4k, lambda: chunked_plans(seqs_4k[0], sc.chunk, L)),
        ("layered 2x4k", 2 * sc.prompt_4k, lambda: layered_plans(seqs_4k, G, L, batch_id=1)),
        ("hybrid chunked", sc.long_prompt, lambda: chunked_plans(
            long_seq, sc.chunk, L, decode=decode_seqs(hyb_B, hyb_c))),
        ("hybrid layered", sc.long_prompt, lambda: layered_plans(
            [long_seq], G, L, decode=decode_seqs(hyb_B, hyb_c), batch_id=2)),
    ]
    for name, tokens, make in cases:
        ctx.log(f"steps: prefill {name}")
        if not ctx.time_for(15):
            sec.setdefault("not_reached", []).append(name)
            continue
        row = dict(mode=name, tokens=tokens)
        if name.startswith("hybrid"):
            row.update(decode_batch=hyb_B, decode_context=hyb_c)
        pre.append(row)
        try:
            r = timed_passes(ctx, runner, make, sc.reps)
            plans = make()
            predicted = [_plan_cost(shape, p, L, hw, hyb_c) for p in plans]
            row.update(iterations=len(plans), total_ms=r["total_s"] * 1e3,
                       iter_median_ms=statistics.median(r["iter_s"]) * 1e3,
                       iter_max_ms=max(r["iter_s"]) * 1e3,
                       bound_total_ms=sum(t for t, _ in predicted) * 1e3,
                       bound_iter_max_ms=max(t for t, _ in predicted) * 1e3,
                       expert_gb=r["experts"] * ebytes / 1e9,
                       cost_model_expert_gb=sum(b for _, b in predicted) / 1e9,
                       tokens_per_s=tokens / r["total_s"], compile_s=r["compile_s"],
                       warm_total_ms=r["warm_total_s"] * 1e3)
        except Exception as e:  # noqa: BLE001
            row.update(error=_err(e), traceback=traceback.format_exc())
        print(f"    total {row.get('total_ms', row.get('error'))} ms "
              f"(compile {row.get('compile_s')} s)")
    by_m = {r["mode"]: r for r in pre if "total_ms" in r}
    if "chunked" in by_m and "layered" in by_m:
        c, lay = by_m["chunked"], by_m["layered"]
        sec["layered_vs_chunked"] = dict(time_ratio=lay["total_ms"] / c["total_ms"],
                                         expert_bytes_ratio=lay["expert_gb"] / c["expert_gb"],
                                         ideal_expert_bytes_ratio=1 / (sc.long_prompt // sc.chunk))
    tput = [by_m[m]["tokens_per_s"] for m in ("chunked 4k", "layered 2x4k") if m in by_m]
    add_target(ctx, "prefill throughput, 4k prompts (best of chunked / layered)",
               max(tput) / 1e3 if tput else None, 44, ">=", "k tokens/s")
    sec["compiled_programs"] = [str(k) for k in runner.programs]
    sec["compile_s_total"] = runner.compile_seconds
    sec["memory_peak"] = _memory()


def _bucket(n, buckets):
    return next((b for b in buckets if n <= b), None)


def _plan_cost(shape, plan, L, hw, dec_ctx):
    """Roofline (seconds, expert bytes) of one plan: prefill rows in [a, b), decodes in
    every layer, logits for the decodes and the sampling chunks."""
    from lp_jax.roofline import StepTokens, model_step_cost
    from lp_jax.roofline.cost_model import expert_traffic

    a, b = plan.layer_start, plan.layer_end
    chunk = plan.prefill[0]
    n_pre = plan.num_prefill_tokens
    B = len(plan.decode)
    mixed = StepTokens(prefill_tokens=n_pre, prefill_seqs=len(plan.prefill),
                       prefill_past=chunk.start, decode_seqs=B,
                       decode_context=dec_ctx if B else 0)
    logits = B + sum(c.samples for c in plan.prefill if plan.is_last_group)
    cost = model_step_cost(shape, mixed, layers=range(a, b), logits_tokens=logits)
    seconds = cost.time_on(hw)
    rest = [i for i in range(L) if not a <= i < b]
    if B and rest:
        dec = model_step_cost(shape, StepTokens(decode_seqs=B, decode_context=dec_ctx),
                              layers=rest, logits_tokens=0)
        seconds += dec.time_on(hw)
    experts = float(expert_traffic(shape, n_pre + B)[1]) * (b - a)
    if B:
        experts += float(expert_traffic(shape, B)[1]) * len(rest)
    return seconds, experts


# -------------------------------------------------------------------- 4. serving
class Energy:
    """GPU energy from NVML (mJ since driver load), or the reason it is not measured."""

    def __init__(self):
        self.handle, self.reason = None, None
        try:
            import pynvml
        except ImportError:
            self.reason = "not measured: pynvml missing"
            return
        try:
            pynvml.nvmlInit()
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            self.nvml = pynvml
            self.read()
        except Exception as e:  # noqa: BLE001
            self.handle, self.reason = None, f"not measured: NVML unavailable ({_err(e)})"

    def read(self):
        if self.handle is None:
            return None
        return self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)


def workload(sc, seed, vocab):
    rng = np.random.default_rng(seed)
    s = sc.serve
    arrivals = np.cumsum(rng.exponential(1.0 / s["rate"], s["requests"]))
    arrivals -= arrivals[0]
    lo, hi = s["prompt"]
    prompts = [rng.integers(1, vocab, int(rng.integers(lo, hi + 1))).tolist()
               for _ in range(s["requests"])]
    return list(zip(arrivals.tolist(), prompts, strict=True))


def serve(ctx, engine, requests, out_len):
    """Feeds requests at their arrival times; aborts what is left at the deadline."""
    from lp_jax.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    pending, done, truncated, ids = list(requests), [], False, []
    t0 = time.perf_counter()
    while pending or engine.has_unfinished():
        if ctx.left() < 5 and not truncated:
            truncated = True
            pending = []
            finished = {o.request_id for o in done}
            for rid in ids:
                if rid not in finished:
                    engine.abort(rid)
        now = time.perf_counter() - t0
        while pending and pending[0][0] <= now:
            t, prompt = pending.pop(0)
            ids.append(engine.add_request(prompt, params, arrival_time=t0 + t))
        if engine.has_unfinished():
            done += [o for o in engine.step() if o.finished and o.finish_reason != "abort"]
        elif pending:
            time.sleep(max(0.0, pending[0][0] - (time.perf_counter() - t0)))
    return done, time.perf_counter() - t0, truncated


def section_serving(ctx, sec):
    from lp_jax.engine.metrics import summarize
    from lp_jax.engine.scheduler import Scheduler

    sc = ctx.scale
    engine = ctx.state.get("engine") or make_engine(ctx, sec)
    L, G = ctx.state["L"], ctx.state["G"]
    runner = engine.runner
    energy = Energy()
    sec["energy_source"] = energy.reason or "NVML nvmlDeviceGetTotalEnergyConsumption (mJ)"
    Bs, out_len = sc.serve["bucket"], sc.serve["out"]
    requests = workload(sc, 0, engine.model_config.vocab_size)
    sec["workload"] = dict(**sc.serve, prompt_tokens=sum(len(p) for _, p in requests))
    policies = {
        "chunked": dict(policy="chunked", max_num_batched_tokens=sc.chunk, buckets=(sc.chunk,)),
        "layered": dict(policy="layered", max_num_batched_tokens=sc.long_prompt,
                        layer_groups=G, buckets=(sc.long_prompt,)),
    }
    saved = (engine.scheduler, runner.prefill_buckets, runner.decode_buckets)
    runs = sec.setdefault("runs", {})
    try:
        for name, kw in policies.items():
            if not ctx.time_for(20):
                sec.setdefault("not_reached", []).append(name)
                continue
            row = runs[name] = {}
            buckets = kw.pop("buckets")
            cfg = dataclasses.replace(saved[0].config, max_num_seqs=Bs, **kw)
            engine.scheduler = Scheduler(cfg)
            runner.prefill_buckets, runner.decode_buckets = buckets, (Bs,)
            # Compile (or find) every program this policy can reach before serving.
            keys = [(0, 0, 0, Bs)]
            ranges = [(0, L)] if name == "chunked" else split_ranges(L, G)
            keys += [runner.program_key(a, b, buckets[0], B) for a, b in ranges
                     for B in (0, Bs)]
            ctx.log(f"serving: {name}, {len(keys)} programs")
            c0 = runner.compile_seconds
            for key in keys:
                runner._program(key)
            row["compile_s"] = runner.compile_seconds - c0
            ctx.log(f"serving: {name} run")
            before = engine.stats()
            e0 = energy.read()
            outs, wall, truncated = serve(ctx, engine, requests, out_len)
            e1 = energy.read()
            after = engine.stats()
            s = summarize([o.metrics for o in outs])
            out_tokens = sum(len(o.token_ids) for o in outs)
            prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
            row.update(
                requests_finished=len(outs), truncated=truncated, wall_s=wall,
                ttft_mean_s=s["ttft_mean"], ttft_p50_s=s["ttft_p50"], ttft_p99_s=s["ttft_p99"],
                max_itl_p50_s=s["max_itl_p50"], max_itl_p99_s=s["max_itl_p99"],
                e2e_p50_s=s["e2e_p50"], output_tokens=out_tokens, prompt_tokens=prompt_tokens,
                expert_gb=(after["expert_bytes_loaded"] - before["expert_bytes_loaded"]) / 1e9,
                iterations=after["iterations"] - before["iterations"],
                host_s=after["host_seconds"] - before["host_seconds"],
                device_s=after["device_seconds"] - before["device_seconds"],
                compiles_while_serving=(after["compilations_after_warmup"]
                                        - before["compilations_after_warmup"]))
            if e0 is not None and e1 is not None:
                mj = float(e1 - e0)
                row.update(energy_j=mj / 1e3, avg_power_w=mj / 1e3 / wall,
                           mj_per_output_token=mj / max(out_tokens, 1),
                           mj_per_token=mj / max(out_tokens + prompt_tokens, 1))
                if wall < 2.0:
                    row["energy_note"] = f"run of {wall:.2f} s < 2 s: energy unreliable"
            else:
                row["energy"] = energy.reason
            ctx.flush()
    finally:
        engine.scheduler, runner.prefill_buckets, runner.decode_buckets = saved
    if {"chunked", "layered"} <= runs.keys() and all("ttft_mean_s" in r for r in runs.values()):
        c, lay = runs["chunked"], runs["layered"]
        red = 1 - _ratio(lay["ttft_mean_s"], c["ttft_mean_s"])
        sec["layered_vs_chunked"] = dict(
            ttft_mean_reduction=red,
            ttft_p99_reduction=1 - _ratio(lay["ttft_p99_s"], c["ttft_p99_s"]),
            max_itl_p99_ratio=_ratio(lay["max_itl_p99_s"], c["max_itl_p99_s"]),
            expert_bytes_ratio=_ratio(lay["expert_gb"], c["expert_gb"]),
            mj_per_token_ratio=_ratio(lay.get("mj_per_token"), c.get("mj_per_token")),
            truncated=c["truncated"] or lay["truncated"])
        add_target(ctx, "layered vs chunked: mean TTFT reduction", 100 * red, 30, ">=", "%",
                   paper=PAPER["ttft"])
        add_target(ctx, "layered / chunked max-ITL p99", sec["layered_vs_chunked"][
            "max_itl_p99_ratio"], 1.0, "<=", "x")


def _ratio(a, b):
    return a / b if a is not None and b else math.nan


def split_ranges(L, G):
    from lp_jax.engine.layer_groups import split_layers

    return split_layers(L, G)


# --------------------------------------------------------------------- report
def _fmt(x, nd=3):
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if isinstance(x, float):
        if not math.isfinite(x):
            return "n/a" if math.isnan(x) else str(x)
        return f"{x:.{nd}g}" if abs(x) < 1e5 else f"{x:,.0f}"
    return str(x)


def _table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(_fmt(c) for c in r) + " |" for r in rows]
    return out


def render_md(data) -> str:
    m = data["meta"]
    smoke = m.get("smoke")
    title = f"## GPU validation: {m.get('device_kind', '?')}, {m.get('date', '?')}"
    lines = [title, ""]
    if smoke:
        lines += [f"> **{SMOKE_LABEL}.** Tiny shapes, Pallas GPU kernels in interpret mode; "
                  "the figures below only prove the code paths run.", ""]
    lines += [f"- command: `{m.get('command', '')}`",
              f"- machine: {m.get('device_kind')} ({m.get('platform')}), "
              f"{m.get('host_cpus')} host CPUs, jax {m.get('jax')}, python {m.get('python')}",
              f"- budget {m.get('budget_s')} s, used {_fmt(m.get('elapsed_s'))} s; "
              f"compilation cache: `{m.get('cache_dir')}`"]
    if m.get("watchdog"):
        lines.append(f"- **{m['watchdog']}**")
    elif m.get("current") not in (None, "done"):
        lines.append(f"- run in progress or killed during: {m['current']}")
    lines.append("")
    t = data.get("targets", [])
    if t:
        lines += ["### Targets", ""]
        lines += _table(["check", "measured", "target", "unit", "met", "distance", "paper / note"],
                        [[r["name"], r["value"], f"{r['op']} {r['target']}", r["unit"],
                          "n/a (smoke)" if smoke else r["met"], r["distance"],
                          "; ".join(x for x in (r.get("paper"), r.get("note")) if x) or "-"]
                         for r in t])
        lines.append("")
    for name in SECTIONS:
        sec = data["sections"].get(name)
        if sec is None:
            continue
        lines += [f"### {SECTIONS.index(name) + 1}. {name}: {sec.get('status')}"
                  + (f" ({_fmt(sec.get('seconds'))} s)" if "seconds" in sec else ""), ""]
        if sec.get("reason"):
            lines += [f"{sec['reason']}", ""]
        lines += RENDER[name](sec)
        if sec.get("not_reached"):
            lines += ["", f"Not reached (out of time): {sec['not_reached']}"]
        if sec.get("error"):
            lines += ["", f"**Error**: `{sec['error']}`", "", "```",
                      sec.get("traceback", "")[-3000:], "```"]
        lines.append("")
    return "\n".join(lines)


def _md_kernels(sec):
    rows = sec.get("moe_gpu", []) + sec.get("attention_gpu", [])
    if not rows:
        return []
    out = _table(["kernel", "case", "dtype", "compile s", "rel err", "tol", "ok"],
                 [[r["kernel"], r.get("shape", "") + (f" T={r['tokens']}" if "tokens" in r
                                                      else f" {r.get('seqs', '')}"),
                   r["dtype"], r.get("compile_s"), r.get("rel_err"), r.get("tol"),
                   r.get("ok")] for r in rows])
    errs = [f"- {r['kernel']} {r['dtype']}: `{r['error']}`" for r in rows if "error" in r]
    return out + ([""] + errs if errs else [])


def _md_moe(sec):
    out = []
    rows = [r for r in sec.get("rows", []) if "best_ms" in r or "error" in r]
    if rows:
        out += [f"Shape {sec.get('shape')}; best of N (median beside); GB/s = activated "
                "experts' weights / best time.", ""]
        out += _table(["tokens", "op", "experts", "best ms", "median ms", "roofline ms",
                       "TFLOP/s", "GB/s", "compile s"],
                      [[r["tokens"], r["op"], r.get("experts_activated"), r.get("best_ms"),
                        r.get("median_ms"), r.get("bound_ms"), r.get("tflops"),
                        r.get("weight_gbps"),
                        r.get("compile_s") if "error" not in r else r["error"][:80]]
                       for r in rows])
    k = sec.get("knee")
    if k:
        out += ["", f"Knee ({k['op']}, FLOP/s >= 80% of max, cost-model credit): "
                f"{_fmt(k.get('knee_tokens'))} tokens (max {_fmt(k.get('max_tflops'))} TFLOP/s, "
                f"largest measured {_fmt(k.get('largest_tokens_measured'))}); "
                f"{k['table']['hardware']} ridge {_fmt(k['table']['ridge_flop_per_byte'])} FLOP/B"
                f" -> compute-bound from {_fmt(k['table']['compute_bound_tokens_exact'])} tokens"
                + (f"; measured device ridge {_fmt(k['measured']['ridge_flop_per_byte'])} FLOP/B"
                   f" ({_fmt(k['measured']['tflops'])} TFLOP/s, {_fmt(k['measured']['gbps'])}"
                   f" GB/s) -> {_fmt(k['measured']['compute_bound_tokens_exact'])} tokens"
                   if "measured" in k else "") + f". Paper: {PAPER['ridge']}."]
    d = sec.get("ragged_dot_dense_check")
    if d:
        out += ["", f"ragged_dot vs one dense matmul of the same rows at {d['tokens']} tokens:"
                f" {_fmt(d['ratio'])}x (E={d['experts']}): {d['verdict']}."]
    h = sec.get("ragged_dot_hlo")
    if h:
        out += [f"ragged_dot compiled HLO at {h['tokens']} tokens: {h.get('while_loops')} while "
                f"loops, {h.get('dots')} dots, {h.get('ragged_ops')} ragged ops, "
                f"{h.get('custom_calls')} custom calls."]
    if "ragged_dot_mgpu" in sec:
        out += [f"ragged_dot_mgpu: {sec['ragged_dot_mgpu']}"]
    att = sec.get("decode_attention", [])
    if att:
        out += ["", "Decode attention (useful bytes / best time, vs 4.8 TB/s):", ""]
        out += _table(["backend", "batch", "context", "ms", "GB/s", "of peak"],
                      [[r.get("backend"), r.get("batch"), r.get("context"),
                        r.get("seconds", 0) * 1e3 if "seconds" in r else r.get("error"),
                        r.get("gbps"), r.get("fraction_of_peak")] for r in att])
    return out


def _md_steps(sec):
    out = []
    c = sec.get("config")
    if c:
        m = sec.get("model", {})
        out += [f"Model: {c['layers']} layers{' (' + c['note'] + ')' if 'note' in c else ''}, "
                f"weights by `{m.get('init')}` init in {_fmt(m.get('init_s'))} s "
                f"({_fmt((m.get('params_bytes') or 0) / 1e9)} GB); G={c['groups']}, chunk "
                f"{c['chunk']}; backends {sec.get('backends')}; KV pool {c.get('kv_pages')} "
                f"pages/layer. Roofline bounds: H200 SXM table (989 TFLOP/s, 4.8 TB/s), "
                f"uniform routing.", ""]
    if sec.get("decode"):
        out += _table(["decode batch", "context", "best ms", "median ms", "roofline ms",
                       "achieved GB/s", "HBM util", "compile s"],
                      [[r["batch"], r["context"], r.get("best_ms"), r.get("median_ms"),
                        r.get("bound_ms"), r.get("achieved_gbps"), r.get("hbm_utilisation"),
                        r.get("compile_s") if "error" not in r else r["error"][:80]]
                       for r in sec["decode"]])
    if sec.get("prefill"):
        out += ["", "Prefill (best of the timed passes, per iteration):", ""]
        out += _table(["mode", "tokens", "iters", "total ms", "roofline ms", "iter median ms",
                       "iter max ms", "expert GB", "cost-model GB", "tokens/s", "paper"],
                      [[r["mode"] + (f" +{r['decode_batch']} decodes" if "decode_batch" in r
                                     else ""), r["tokens"], r.get("iterations"),
                        r.get("total_ms") if "error" not in r else r["error"][:80],
                        r.get("bound_total_ms"), r.get("iter_median_ms"), r.get("iter_max_ms"),
                        r.get("expert_gb"), r.get("cost_model_expert_gb"), r.get("tokens_per_s"),
                        PAPER.get("prefill_" + r["mode"], "-")] for r in sec["prefill"]])
    lv = sec.get("layered_vs_chunked")
    if lv:
        out += ["", f"Layered / chunked on one long prompt: time {_fmt(lv['time_ratio'])}x, "
                f"expert bytes {_fmt(lv['expert_bytes_ratio'])}x (ideal "
                f"{_fmt(lv['ideal_expert_bytes_ratio'])})."]
    if "compile_s_total" in sec:
        out += [f"Programs compiled: {len(sec.get('compiled_programs', {}))}, "
                f"{_fmt(sec['compile_s_total'])} s."]
    return out


def _md_serving(sec):
    out = []
    w = sec.get("workload")
    if w:
        out += [f"Workload: {w['requests']} requests, Poisson {w['rate']}/s, prompts "
                f"{w['prompt'][0]}-{w['prompt'][1]} tokens, {w['out']} output tokens, decode "
                f"bucket {w['bucket']}. Energy: {sec.get('energy_source')}.", ""]
    runs = sec.get("runs", {})
    if runs:
        out += _table(["policy", "done", "TTFT mean s", "TTFT p99 s", "max-ITL p99 s",
                       "E2E p50 s", "expert GB", "mJ/output token", "mJ/token", "W",
                       "compiles", "wall s"],
                      [[n, r.get("requests_finished"), r.get("ttft_mean_s"), r.get("ttft_p99_s"),
                        r.get("max_itl_p99_s"), r.get("e2e_p50_s"), r.get("expert_gb"),
                        r.get("mj_per_output_token", r.get("energy")), r.get("mj_per_token"),
                        r.get("avg_power_w"), r.get("compiles_while_serving"), r.get("wall_s")]
                       for n, r in runs.items()])
    lv = sec.get("layered_vs_chunked")
    if lv:
        out += ["", f"Layered vs chunked: mean TTFT {_fmt(-100 * lv['ttft_mean_reduction'])}%, "
                f"p99 TTFT {_fmt(-100 * lv['ttft_p99_reduction'])}%, max-ITL p99 "
                f"{_fmt(lv['max_itl_p99_ratio'])}x, expert bytes "
                f"{_fmt(lv['expert_bytes_ratio'])}x, energy per token "
                f"{_fmt(lv.get('mj_per_token_ratio'))}x"
                + (" (a run was cut at the deadline)" if lv.get("truncated") else "")
                + f". Paper: {PAPER['ttft']}; {PAPER['energy']}; {PAPER['expert_bytes']}."]
    return out


RENDER = {"kernels": _md_kernels, "moe": _md_moe, "steps": _md_steps, "serving": _md_serving}
RUN = {"kernels": section_kernels, "moe": section_moe, "steps": section_steps,
       "serving": section_serving}


def summary(data) -> str:
    lines = [f"{'section':<10}{'status':<10}{'seconds':>9}  notes"]
    for name in SECTIONS:
        s = data["sections"].get(name, {})
        note = s.get("reason") or s.get("error") or ""
        lines.append(f"{name:<10}{s.get('status', '-'):<10}{_fmt(s.get('seconds')):>9}  "
                     f"{note[:90]}")
    lines.append("")
    lines.append(f"{'target':<62}{'measured':>12}{'target':>12}  met")
    for t in data.get("targets", []):
        lines.append(f"{t['name'][:61]:<62}{_fmt(t['value']):>12}"
                     f"{t['op'] + ' ' + _fmt(t['target']):>12}  "
                     f"{'n/a' if t['met'] is None else _fmt(t['met'])} {t['unit']}")
    return "\n".join(lines)


# ----------------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="results directory")
    p.add_argument("--budget-s", type=float, default=480.0, help="global deadline (seconds)")
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers of the model (default: all 48; smoke: 4)")
    p.add_argument("--quick", action="store_true", help="fewer sweep points and repeats")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny shapes on the CPU, kernels in interpret mode")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"comma list of sections to run (of {','.join(SECTIONS)})")
    p.add_argument("--cache-dir", default=None,
                   help="persistent compilation cache (default: OUT/jax_cache)")
    p.add_argument("--avoid", default="",
                   help="comma list of kernels to leave out after a crash or hang: moe_gpu, "
                        "attn_gpu (the model then uses the XLA reference), mgpu")
    p.add_argument("--hang-grace-s", type=float, default=90.0,
                   help="the watchdog ends the run this long past a section's deadline "
                        "(or a quarter of it past the global one), keeping the results")
    p.add_argument("--init", choices=("auto", "dummy", "lean"), default="auto",
                   help="model weights: the engine's dummy loader, the lean per-layer init, "
                        "or auto (dummy if its init fits in free memory)")
    args = p.parse_args(argv)
    bad = set(args.sections.split(",")) - set(SECTIONS)
    if bad:
        p.error(f"unknown sections {sorted(bad)}")
    bad = set(filter(None, args.avoid.split(","))) - {"moe_gpu", "attn_gpu", "mgpu"}
    if bad:
        p.error(f"unknown --avoid entries {sorted(bad)}")
    return args


def watchdog(ctx):
    """Ends the process (results kept) when a step runs far past its deadline: a hung
    kernel or compile would otherwise hold the device until the session's own timeout."""
    grace = ctx.args.hang_grace_s
    while not ctx.finished:
        time.sleep(1.0)
        now = time.perf_counter()
        if now < ctx.section_deadline + grace and now < ctx.deadline + grace / 4:
            continue
        name = ctx.current_section
        msg = (f"watchdog: ended the run during '{ctx.data['meta'].get('current')}' "
               f"({now - ctx.section_deadline:.0f} s past the section's deadline)")
        print(msg, flush=True)
        for _ in range(5):
            try:
                ctx.data["meta"]["watchdog"] = msg
                sec = ctx.data["sections"].get(name)
                if sec is not None and sec.get("status") == "running":
                    sec.update(status="hung", reason=msg, seconds=now - ctx.section_t0)
                for other in SECTIONS[SECTIONS.index(name) + 1:]:
                    ctx.data["sections"].setdefault(other, {"status": "skipped",
                                                            "reason": "skipped: " + msg})
                ctx.flush()
                print(summary(ctx.data), flush=True)
                break
            except RuntimeError:  # the main thread changed a dict under json.dumps
                time.sleep(0.2)
        os._exit(3)


def main(argv=None):
    args = parse_args(argv)
    smoke = args.cpu_smoke or jax.default_backend() != "gpu"
    ctx = Ctx(args, smoke)
    ctx.cache_dir = Path(args.cache_dir or ctx.out / "jax_cache").absolute()
    jax.config.update("jax_compilation_cache_dir", str(ctx.cache_dir))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    dev = jax.devices()[0]
    ctx.data["meta"] = dict(
        date=datetime.datetime.now().isoformat(timespec="seconds"),
        device_kind=getattr(dev, "device_kind", dev.platform), platform=dev.platform,
        device_count=jax.device_count(), host_cpus=os.cpu_count(), jax=jax.__version__,
        python=platform.python_version(),
        command="python " + " ".join(shlex.quote(a) for a in [
            "launch/gpu_validate.py", *(sys.argv[1:] if argv is None else argv)]),
        smoke=smoke, label=SMOKE_LABEL if smoke else "measurement", budget_s=args.budget_s,
        cache_dir=str(ctx.cache_dir), quick=args.quick, scale=dataclasses.asdict(ctx.scale))
    selected = args.sections.split(",")
    ctx.finished, ctx.current_section, ctx.section_t0 = False, SECTIONS[0], time.perf_counter()
    dog = threading.Thread(target=watchdog, args=(ctx,), daemon=True)
    dog.start()
    print(f"gpu_validate: {ctx.data['meta']['device_kind']} ({dev.platform}), budget "
          f"{args.budget_s:.0f} s{', ' + SMOKE_LABEL if smoke else ''}", flush=True)
    for name in SECTIONS:
        frac, need = PLAN[name]
        sec = ctx.data["sections"][name] = {"status": "pending"}
        if smoke:
            sec["label"] = SMOKE_LABEL
        now = time.perf_counter()
        if name not in selected:
            sec.update(status="skipped", reason="skipped: not selected (--sections)")
            continue
        if ctx.deadline - now < need:
            sec.update(status="skipped", reason=f"skipped: out of time "
                       f"({ctx.deadline - now:.0f} s left, needs >= {need} s)")
            ctx.flush()
            continue
        ctx.section_deadline = min(ctx.deadline, max(ctx.t0 + frac * args.budget_s, now + need))
        ctx.current_section, ctx.section_t0 = name, now
        print(f"[{name}] start, {ctx.section_deadline - now:.0f} s allotted", flush=True)
        sec["status"] = "running"
        ctx.flush()
        try:
            RUN[name](ctx, sec)
            sec["status"] = "partial" if sec.get("not_reached") else "ok"
        except Exception as e:  # noqa: BLE001 - record and go on with the next section
            sec.update(status="error", error=_err(e), traceback=traceback.format_exc())
            print(traceback.format_exc(), flush=True)
        sec["seconds"] = time.perf_counter() - now
        ctx.data["meta"]["elapsed_s"] = time.perf_counter() - ctx.t0
        ctx.flush()
        print(f"[{name}] {sec['status']} in {sec['seconds']:.1f} s", flush=True)
        gc.collect()
    ctx.finished = True
    dog.join(timeout=5)
    ctx.data["meta"]["elapsed_s"] = time.perf_counter() - ctx.t0
    ctx.data["meta"]["current"] = "done"
    ctx.flush()
    print()
    print(summary(ctx.data))
    print(f"\nwrote {ctx.out / 'results.json'} and {ctx.out / 'results.md'}")
    return ctx.data


if __name__ == "__main__":
    main()
