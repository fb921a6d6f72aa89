"""Kernel-level figures of launch/gpu_validate.py: the Pallas GPU kernels checked against
their references at a model's shapes, and the MoE and decode-attention microbenchmarks.

A check (`moe_check`, `attention_check`) addresses layer L-1 of a full-depth stack, as the
engine's last layer does, and is built as (kernel, reference, argument shapes, argument
maker), so it can be compiled without a device (`--compile-times`) or run (`run_check`);
`kernel_verdicts` turns the checks a child process finished, or did not, into a verdict
per op.

`moe_ffn` is timed per layer inside a loop over several layers' stacked weights, as the
model runs it: no host dispatch per call and no cache reuse between layers. The grouped
matmul baselines (`lax.ragged_dot`, jax's `ragged_dot_mgpu`, wrapped by
launch/bench_kernels.py) run once on rows already sorted by expert.
"""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.timing import time_call

TOL = 2e-2  # bfloat16: max |got - want| / max |want|, as the engine's start-up self-test
DTYPE = jnp.bfloat16
PAGE_SIZE = 16
MGPU_UNTRUSTED = ("untrusted: jax's ragged_dot_mgpu refills a WGMMA slot before waiting for "
                  "it (tests/test_moe_kernels.py::test_jax_ragged_dot_mgpu_refills_without_"
                  "waiting); timed only, never used")


def is_hopper() -> bool:
    dev = jax.devices()[0]
    return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9")


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if not np.all(np.isfinite(got)):
        return math.inf
    return float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-6))


def _random_stack(key, shape, scale: float):
    """[L, ...] random bfloat16, one layer drawn at a time (float32 temporaries of one
    layer, not of the stack; every index stays under 2^31)."""
    def fill(i, w):
        one = jax.random.normal(jax.random.fold_in(key, i), shape[1:], jnp.float32) * scale
        return jax.lax.dynamic_update_index_in_dim(w, one.astype(DTYPE), i, 0)

    return jax.lax.fori_loop(0, shape[0], fill, jnp.zeros(shape, DTYPE))


def moe_check(cfg, T: int):
    """moe_ffn[gpu] on layer L-1 (a traced index) of full-depth stacked weights, the last
    eighth of the rows masked, against the float32 reference on that layer."""
    from pallas_kernels.moe import moe_ffn
    from pallas_kernels.moe.ref import ref_moe_ffn

    D, F, E, L = (cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts,
                  cfg.num_hidden_layers)
    sd, f32 = jax.ShapeDtypeStruct, jnp.float32
    args = (sd((T, D), DTYPE), sd((T, E), f32), sd((L, E, D, 2 * F), DTYPE),
            sd((L, E, F, D), DTYPE), sd((), jnp.int32))
    kw = dict(top_k=cfg.num_experts_per_tok, norm_topk_prob=cfg.norm_topk_prob,
              token_mask_T=np.arange(T) < T - T // 8)

    def kernel(x, logits, w_gate_up, w_down, layer):
        return moe_ffn(x, logits, w_gate_up, w_down, layer=layer, backend="gpu", **kw)[0]

    def reference(x, logits, w_gate_up, w_down, layer):
        with jax.default_matmul_precision("highest"):
            return ref_moe_ffn(x.astype(f32), logits, w_gate_up[layer].astype(f32),
                               w_down[layer].astype(f32), **kw)[0]

    def make_args():
        k = jax.random.split(jax.random.key(T), 4)
        stack = jax.jit(_random_stack, static_argnums=(1, 2))
        return (jax.random.normal(k[0], (T, D), DTYPE), jax.random.normal(k[1], (T, E)),
                stack(k[2], args[2].shape, D**-0.5), stack(k[3], args[3].shape, F**-0.5),
                jnp.int32(L - 1))

    return [("moe_ffn", kernel, reference, args, make_args)]


def attention_check(cfg, smoke: bool):
    """The gpu attention backend's ragged call (prefill chunks after cached context, fresh
    prompts, decode tokens) and decode call, on layer L-1's pages of an L-layer pool
    (the page table offset by (L-1) x pages per layer, as the model does), against the
    xla backend on the same inputs."""
    from pallas_kernels import attention

    N, K, H, S = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, PAGE_SIZE
    L = cfg.num_hidden_layers
    q_lens, ctx = ([20, 9, 1], [20, 14, 40]) if smoke else (
        [300, 64, 1, 1, 1], [300, 101, 17, 2048, 4100])  # context after this step
    pages = [-(-n // S) for n in ctx]
    P, B = sum(pages) + 3, len(ctx)  # pages per layer
    sd, i32 = jax.ShapeDtypeStruct, jnp.int32
    pool, C = sd((L * P, S, 2 * K, H), DTYPE), max(pages)
    ragged_args = (sd((sum(q_lens), N, H), DTYPE), pool, sd((B + 1,), i32), sd((B,), i32),
                   sd((B, C), i32), sd((), i32))
    decode_args = (sd((B, N, H), DTYPE), pool, sd((B,), i32), sd((B, C), i32))

    def inputs():
        rng = np.random.default_rng(0)
        table_BC = np.zeros((B, C), np.int32)
        free = iter(rng.permutation(P))
        for b, n in enumerate(pages):
            table_BC[b, :n] = [(L - 1) * P + next(free) for _ in range(n)]
        k = jax.random.split(jax.random.key(1), 3)
        return dict(kv=jax.random.normal(k[0], pool.shape, DTYPE), table=jnp.asarray(table_BC),
                    q_T=jax.random.normal(k[1], ragged_args[0].shape, DTYPE),
                    q_B=jax.random.normal(k[2], decode_args[0].shape, DTYPE),
                    starts=jnp.asarray(np.cumsum([0, *q_lens]), i32),
                    lens=jnp.asarray(ctx, i32))

    cache = {}
    made = lambda: cache.setdefault("inputs", inputs())  # noqa: E731 - one pool for both
    ragged = {b: (lambda *a, b=b: attention.ragged_paged_attention(*a, sm_scale=H**-0.5,
                                                                    backend=b))
              for b in ("gpu", "xla")}
    decode = {b: (lambda *a, b=b: attention.decode_attention(*a, sm_scale=H**-0.5, backend=b))
              for b in ("gpu", "xla")}
    return [
        ("ragged", ragged["gpu"], ragged["xla"], ragged_args,
         lambda: (lambda m: (m["q_T"], m["kv"], m["starts"], m["lens"], m["table"],
                             jnp.int32(B)))(made())),
        ("decode", decode["gpu"], decode["xla"], decode_args,
         lambda: (lambda m: (m["q_B"], m["kv"], m["lens"], m["table"]))(made())),
    ]


def run_check(build) -> dict:
    """Compiles (timed) and runs each pair of a check; the largest relative error."""
    errs, compile_s = [], 0.0
    for _, kernel, reference, _, make_args in build():
        args = make_args()
        outs = []
        for fn in (kernel, reference):
            t = time.perf_counter()
            compiled = jax.jit(fn).lower(*args).compile()
            compile_s += time.perf_counter() - t
            outs.append(compiled(*args))
        errs.append(rel_err(*outs))
    return {"rel_err": max(errs), "compile_s": compile_s}


def kernel_verdicts(cases: list, planned: list, killed: bool) -> tuple[dict, list]:
    """(verdict per op, cases not run) from the child's rows. An op passes if every case
    planned for it ran and passed, fails if one ran and failed (a case the child died in,
    unkilled, failed too), and has no verdict otherwise: a case the child did not reach,
    or was killed in, proves nothing, and the engine then runs `auto` with its own
    start-up self-test and fallback."""
    rows = {(c["op"], c["case"]): c for c in cases}
    states, not_run = {}, []  # (op, case) -> True / False / None (no verdict), in order
    for key in planned:
        row = rows.get(key)
        if row is None:
            not_run.append(f"{key[1]}: not reached")
            states[key] = None
        elif row.get("status") == "running" and killed:
            row.update(status="interrupted", ok=None)
            not_run.append(f"{key[1]}: interrupted by the kill")
            states[key] = None
        elif row.get("status") == "running":
            row.update(status="crashed", ok=False)
            states[key] = False
        else:
            states[key] = bool(row["ok"])
    verdict = {}
    for op in dict.fromkeys(op for op, _ in planned):
        mine = [v for (o, _), v in states.items() if o == op]
        if False in mine:
            verdict[op] = False
        elif all(mine):
            verdict[op] = True
    return verdict, not_run


class MoeBench:
    """Random bf16 experts of the model's shape, stacked over a few layers; `time` builds
    the inputs of a token count and times a callable on them."""

    def __init__(self, cfg, layers: int):
        D, F, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
        self.cfg, self.layers = cfg, layers
        k1, k2 = jax.random.split(jax.random.key(0))
        self.w_gate_up_LEDF2 = jax.random.normal(k1, (layers, E, D, 2 * F), DTYPE) * D**-0.5
        self.w_down_LEFD = jax.random.normal(k2, (layers, E, F, D), DTYPE) * F**-0.5
        self.w_gate_up_EDF2, self.w_down_EFD = self.w_gate_up_LEDF2[0], self.w_down_LEFD[0]

    def moe_ffn(self, backend: str):
        from pallas_kernels.moe import moe_ffn

        kw = dict(top_k=self.cfg.num_experts_per_tok, norm_topk_prob=self.cfg.norm_topk_prob,
                  backend=backend)

        def loop(x_TD, logits_TE, w_gate_up_LEDF2, w_down_LEFD):
            body = lambda i, x: moe_ffn(x, logits_TE, w_gate_up_LEDF2, w_down_LEFD,  # noqa: E731
                                        layer=i, **kw)[0]
            return jax.lax.fori_loop(0, self.layers, body, x_TD)

        return jax.jit(loop)

    def time(self, name: str, fn, T: int, iters: int) -> dict:
        """Compile and time `fn` (moe_ffn loop or grouped baseline) at T tokens."""
        from pallas_kernels.moe.ref import dispatch, route

        c = self.cfg
        D, F, E, A = c.hidden_size, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok
        kx, kl = jax.random.split(jax.random.key(T))
        x_TD = jax.random.normal(kx, (T, D), DTYPE)
        logits_TE = jax.random.normal(kl, (T, E), jnp.float32)
        _, expert_ids_TA = route(logits_TE, A, c.norm_topk_prob)
        _, token_ids_R, group_sizes_E = dispatch(expert_ids_TA, E, None)
        per_layer = name.startswith("moe_ffn")
        args = ((x_TD, logits_TE, self.w_gate_up_LEDF2, self.w_down_LEFD) if per_layer else
                (x_TD[token_ids_R], self.w_gate_up_EDF2, self.w_down_EFD, group_sizes_E))
        t = time.perf_counter()
        compiled = jax.jit(fn).lower(*args).compile()
        compile_s = time.perf_counter() - t
        s = time_call(compiled, *args, iters=iters, warmup=1).best / (
            self.layers if per_layer else 1)
        experts = int(jnp.sum(group_sizes_E > 0))
        return dict(experts=experts, us=1e6 * s, compile_s=compile_s,
                    weight_gbps=experts * 3 * D * F * jnp.dtype(DTYPE).itemsize / s / 1e9,
                    tflops=2 * T * A * D * 3 * F / s / 1e12)


def time_attention(cfg, backend: str, batch: int, context: int, iters: int) -> dict:
    from lp_jax.bench.attention_kernels import bench_decode_attention
    from lp_jax.roofline import get_hardware

    row = bench_decode_attention(
        batch=batch, context=context, num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, page_size=PAGE_SIZE,
        dtype=DTYPE, backend=backend, repeats=iters, peak_bw=get_hardware("H200 SXM").hbm_bw)
    return {**row, "ms": 1e3 * row.pop("seconds")}
