"""Kernel-level figures of launch/gpu_validate.py: the Pallas GPU kernels checked against
their references at a model's shapes, and the MoE and decode-attention microbenchmarks.

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


def check_moe(cfg, T: int) -> float:
    """moe_ffn[gpu] on two stacked layers (layer 1 addressed in place), the last eighth of
    the rows masked, against the float32 reference. Returns the relative error."""
    from pallas_kernels.moe import moe_ffn
    from pallas_kernels.moe.ref import ref_moe_ffn

    D, F, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    k = jax.random.split(jax.random.key(T), 4)
    x_TD = jax.random.normal(k[0], (T, D), DTYPE)
    logits_TE = jax.random.normal(k[1], (T, E), jnp.float32)
    w_gate_up_LEDF2 = jax.random.normal(k[2], (2, E, D, 2 * F), DTYPE) * D**-0.5
    w_down_LEFD = jax.random.normal(k[3], (2, E, F, D), DTYPE) * F**-0.5
    kw = dict(top_k=cfg.num_experts_per_tok, norm_topk_prob=cfg.norm_topk_prob,
              token_mask_T=jnp.arange(T) < T - T // 8)
    got, _ = jax.jit(lambda *a: moe_ffn(*a, layer=1, backend="gpu", **kw))(
        x_TD, logits_TE, w_gate_up_LEDF2, w_down_LEFD)
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    with jax.default_matmul_precision("highest"):
        want, _ = jax.jit(lambda *a: ref_moe_ffn(*a, **kw))(
            f32(x_TD), logits_TE, f32(w_gate_up_LEDF2[1]), f32(w_down_LEFD[1]))
    return rel_err(got, want)


def check_attention(cfg, smoke: bool) -> float:
    """The gpu attention backend's ragged call (prefill chunks after cached context, fresh
    prompts, decode tokens) and decode call (contexts up to 4100) on a random paged pool,
    against the xla backend. Returns the larger relative error."""
    from pallas_kernels import attention

    N, K, H, S = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, PAGE_SIZE
    q_lens, ctx = ([20, 9, 1], [20, 14, 40]) if smoke else (
        [300, 64, 1, 1, 1], [300, 101, 17, 2048, 4100])  # context after this step
    pages = [-(-n // S) for n in ctx]
    rng = np.random.default_rng(0)
    P = sum(pages) + 3
    table_BC = np.zeros((len(ctx), max(pages)), np.int32)
    free = iter(rng.permutation(P))
    for b, n in enumerate(pages):
        table_BC[b, :n] = [next(free) for _ in range(n)]
    k = jax.random.split(jax.random.key(1), 3)
    kv_PSJH = jax.random.normal(k[0], (P, S, 2 * K, H), DTYPE)
    q_TNH = jax.random.normal(k[1], (sum(q_lens), N, H), DTYPE)
    q_BNH = jax.random.normal(k[2], (len(ctx), N, H), DTYPE)
    args = (jnp.asarray(np.cumsum([0, *q_lens]), jnp.int32), jnp.asarray(ctx, jnp.int32),
            jnp.asarray(table_BC), jnp.int32(len(ctx)))
    out = {}
    for b in ("gpu", "xla"):
        fn = lambda *a, b=b: attention.ragged_paged_attention(  # noqa: E731
            *a, sm_scale=H**-0.5, backend=b)
        dec = lambda *a, b=b: attention.decode_attention(  # noqa: E731
            *a, sm_scale=H**-0.5, backend=b)
        out[b] = (jax.jit(fn)(q_TNH, kv_PSJH, *args), jax.jit(dec)(q_BNH, kv_PSJH, *args[1:3]))
    return max(rel_err(g, w) for g, w in zip(out["gpu"], out["xla"], strict=True))


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
