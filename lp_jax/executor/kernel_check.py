"""Start-up self-test of the Pallas kernels an engine selects, with a safe fallback.

Before warm-up, every Pallas backend the configuration selects runs once on the real
device, checked against the `ref` version: the MoE on the last layer of the engine's own
loaded expert weights (the first device's shard of the stack, addressed by a traced layer
index as the step does, so a stride or offset that overflows at full depth shows; no
second stack is allocated), or of a small random stack when none is given; attention on
a small random paged pool with the model's head shapes (latent attention, cfg.is_mla:
the MLA decode kernel, absorbed form, on a random latent pool). A compile error, a runtime error
or a mismatch logs one warning naming the backend and the error, and switches that
operation to its safe backend: the MoE to `xla_tiles` (cost follows the routing, never
reads an idle expert), attention to `xla`, or on a TPU to `tpu_jax` (JAX's shipped
kernel) if it passes the same check (never for latent attention, which it lacks).
`mode="strict"` raises instead, `mode="off"` skips the check.

A one-shot test catches what a first contact with a compiler finds (a layout Mosaic
rejects, a kernel that faults, wrong numbers), not a rare race; the lowered-module tests
in tests/test_moe_kernels.py guard those.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from lp_jax.config import ModelConfig
from lp_jax.models.backends import KernelBackends
from lp_jax.models.kv_cache import kv_cache_shape, packs_kv
from lp_jax.models.layers import expert_activation
from pallas_kernels import attention, moe
from pallas_kernels.attention.ref import quantize_fp8, ref_ragged_paged_attention
from pallas_kernels.moe.ref import ref_moe_ffn

MODES = ("fallback", "strict", "off")
SAFE_MOE = ("xla_tiles",)
SAFE_ATTENTION = {"tpu": ("tpu_jax", "xla")}  # by platform; elsewhere "xla"
_MAX_EXPERTS = 16  # the check's expert count: the model's E changes only the grid size
_TOKENS = 24


class KernelCheckError(RuntimeError):
    pass


def _tolerance(dtype) -> float:
    return 2e-2 if jnp.dtype(dtype).itemsize < 4 else 1e-3


def _rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-6))


def model_experts(model) -> tuple | None:
    """(w_gate_up_LEDF2, w_down_LEFD, biases, quant) of a loaded model's stacked experts:
    biases () or (b_gate_up_LEF2, b_down_LED); quant {} or, for quantized experts,
    {"scales": (s_gate_up, s_down), "scheme": QuantScheme} as moe_ffn takes them. None
    for a model without MoE layers."""
    mlp = getattr(model.model.layers, "mlp", None)
    if mlp is None:
        return None
    biases = ()
    if hasattr(mlp, "experts_gate_up_proj_bias"):
        biases = (mlp.experts_gate_up_proj_bias[...], mlp.experts_down_proj_bias[...])
    quant = {}
    if hasattr(mlp, "experts_gate_up_proj_scale"):  # declared only for quantized experts
        quant = {"scales": (mlp.experts_gate_up_proj_scale[...],
                            mlp.experts_down_proj_scale[...]),
                 "scheme": model.config.quantization.scheme}
    return mlp.experts_gate_up_proj[...], mlp.experts_down_proj[...], biases, quant


def _local(x: jax.Array) -> jax.Array:
    """The first device's shard of `x` (the whole array when it is not sharded)."""
    return x.addressable_shards[0].data if len(x.addressable_shards) > 1 else x


def _random_experts(cfg: ModelConfig, dtype) -> tuple:
    """A two-layer random stack of the model's expert shapes (at most 16 experts)."""
    E = min(cfg.num_experts, _MAX_EXPERTS)
    D, F = cfg.hidden_size, cfg.moe_intermediate_size
    k = jax.random.split(jax.random.key(0), 4)
    w_gate_up = (jax.random.normal(k[2], (2, E, D, 2 * F), jnp.float32) * D**-0.5).astype(dtype)
    w_down = (jax.random.normal(k[3], (2, E, F, D), jnp.float32) * F**-0.5).astype(dtype)
    biases = ()
    if cfg.swiglu_limit is not None:  # GPT-OSS: expert biases, clamped SwiGLU
        kb = jax.random.split(jax.random.key(2), 2)
        biases = (jax.random.normal(kb[0], (2, E, 2 * F)).astype(dtype),
                  jax.random.normal(kb[1], (2, E, D)).astype(dtype))
    return w_gate_up, w_down, biases


def check_moe(cfg: ModelConfig, backend: str, dtype, experts: tuple | None = None) -> None:
    """Runs `backend` on the last layer of a stack of expert weights (`experts`, as
    `model_experts` gives them; default: a small random stack), addressed in place by a
    traced index, for a batch with masked rows; raises on an error or a mismatch with the
    reference."""
    w_gate_up, w_down, biases, quant = experts or (*_random_experts(cfg, dtype), {})
    w_gate_up, w_down = _local(w_gate_up), _local(w_down)
    biases = tuple(_local(b) for b in biases)
    scales = tuple(_local(s) for s in quant.get("scales", ()))
    scheme = quant.get("scheme")
    device = next(iter(w_gate_up.devices()))
    L, E, D = w_gate_up.shape[:3]
    top_k = min(cfg.num_experts_per_tok, E)
    k = jax.random.split(jax.random.key(0), 2)
    x_dtype = dtype if scheme is not None else w_gate_up.dtype  # 8-bit weights: W8A16
    x_TD = jax.device_put(jax.random.normal(k[0], (_TOKENS, D), jnp.float32).astype(
        x_dtype), device)
    logits_TE = jax.device_put(jax.random.normal(k[1], (_TOKENS, E), jnp.float32), device)
    mask_T = jnp.arange(_TOKENS) < _TOKENS - 3
    kw = dict(top_k=top_k, norm_topk_prob=cfg.norm_topk_prob, token_mask_T=mask_T,
              activation=expert_activation(cfg))
    layer = jnp.int32(L - 1)
    def quant_of(scales, at=None):
        if scheme is None:
            return {}
        return {"scales": scales if at is None else tuple(s[at] for s in scales),
                "scheme": scheme}

    got, _ = jax.jit(lambda *a, layer, biases, scales: moe.moe_ffn(
        *a, layer=layer, backend=backend, biases=biases, **quant_of(scales), **kw))(
        x_TD, logits_TE, w_gate_up, w_down, layer=layer, biases=biases, scales=scales)
    want, _ = jax.jit(lambda x, lg, wg, wd, layer, biases, scales: ref_moe_ffn(
        x, lg, wg[layer], wd[layer], biases=tuple(b[layer] for b in biases),
        **quant_of(scales, layer), **kw))(
        x_TD, logits_TE, w_gate_up, w_down, layer=layer, biases=biases, scales=scales)
    err = _rel_err(got, want)
    if not err <= _tolerance(dtype):
        raise KernelCheckError(f"output differs from the reference: relative error {err:.3g}")


def check_attention(cfg: ModelConfig, backend: str, dtype, page_size: int) -> None:
    """Runs `backend`'s ragged (a prefill chunk after cached context, a fresh prompt, a
    decode token) and decode entry points on a small paged pool; raises on a mismatch."""
    N, H, S = cfg.num_attention_heads, cfg.head_dim, page_size
    pages_per_seq, num_pages = 4, 16
    k = jax.random.split(jax.random.key(1), 4)
    shape = kv_cache_shape(cfg.replace(num_hidden_layers=1), num_pages, S,
                           packed=packs_kv(cfg, backend))
    kv = jax.random.normal(k[0], shape, jnp.float32).astype(dtype)
    q_lens, ctx = [S + 3, 5, 1], [2 * S + 3, 5, 3 * S - 2]  # context after this step
    T = sum(q_lens)
    q = jax.random.normal(k[1], (T, N, H), jnp.float32).astype(dtype)
    query_start = jnp.asarray(np.cumsum([0, *q_lens]), jnp.int32)
    seq_lens = jnp.asarray(ctx, jnp.int32)
    perm = np.asarray(jax.random.permutation(k[2], num_pages))
    table = jnp.asarray(perm[: 3 * pages_per_seq].reshape(3, pages_per_seq), jnp.int32)
    scale = H**-0.5
    extras = {}
    if cfg.model_type == "gpt_oss":  # sinks, and a window that skips whole pages
        extras = dict(sinks_N=jax.random.normal(k[3], (N,)).astype(dtype),
                      sliding_window=jnp.int32(S + 3))
    if cfg.kv_cache_dtype == "fp8":  # the pool the engine serves: e4m3, scaled
        kv = quantize_fp8(kv, 0.5)
        extras |= dict(k_scale=jnp.float32(0.5), v_scale=jnp.float32(0.25))
    args = (q, kv, query_start, seq_lens, table, jnp.int32(3))
    got = jax.jit(lambda *a, **e: attention.ragged_paged_attention(
        *a, sm_scale=scale, backend=backend, **e))(*args, **extras)
    want = jax.jit(lambda *a, **e: ref_ragged_paged_attention(*a, sm_scale=scale, **e))(
        *args, **extras)
    dec_q, dec_lens = q[:3], seq_lens
    got_dec = jax.jit(lambda *a, **e: attention.decode_attention(
        *a, sm_scale=scale, backend=backend, **e))(dec_q, kv, dec_lens, table, **extras)
    want_dec = jax.jit(lambda *a, **e: attention.decode_attention(
        *a, sm_scale=scale, backend="xla", **e))(dec_q, kv, dec_lens, table, **extras)
    err = max(_rel_err(got, want), _rel_err(got_dec, want_dec))
    if not err <= _tolerance(dtype):
        raise KernelCheckError(f"output differs from the reference: relative error {err:.3g}")


def check_mla_attention(cfg: ModelConfig, backend: str, dtype, page_size: int) -> None:
    """Runs `backend`'s latent-attention (MLA) kernel, absorbed form, on a ragged batch
    (decode tokens, two tokens of one sequence, a padding token) over a small random
    latent pool of the model's shapes; raises on a mismatch with the reference."""
    from pallas_kernels.attention import mla
    from pallas_kernels.attention.mla_ref import quantize_latent, ref_mla_paged_attention

    N, A, R = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.head_dim  # R: rotary width
    H, O, S = cfg.qk_nope_head_dim, cfg.v_head_dim, page_size
    pages_per_seq, num_pages = 4, 16
    rng = np.random.default_rng(3)  # numpy: no random-number programs to compile

    def normal(*shape, scale=1.0):
        return jnp.asarray(rng.standard_normal(shape, np.float32) * scale)

    shape = kv_cache_shape(cfg.replace(num_hidden_layers=1), num_pages, S,
                           packed=packs_kv(cfg, backend))
    kv = normal(*shape)
    q_lens, ctx = [1, 2, 1], [2 * S + 3, 5, 3 * S - 2]  # context after this step
    T = sum(q_lens) + 1  # one padding token
    extras = {}
    if cfg.kv_cache_dtype == "fp8":  # the pool the engine serves: e4m3, scaled
        kv = quantize_latent(kv, 0.5)
        extras = dict(kv_scale=jnp.float32(0.5))
    else:
        kv = kv.astype(dtype)
    q_nope = normal(T, N, H).astype(dtype)
    q_pe = normal(T, N, R).astype(dtype)
    w_uk = normal(A, N, H, scale=A**-0.5).astype(dtype)
    w_uv = normal(A, N, O, scale=A**-0.5).astype(dtype)
    table = jnp.asarray(rng.permutation(num_pages)[: 3 * pages_per_seq].reshape(
        3, pages_per_seq), jnp.int32)
    args = (q_nope, q_pe, kv, w_uk, w_uv, jnp.asarray(np.cumsum([0, *q_lens]), jnp.int32),
            jnp.asarray(ctx, jnp.int32), table, jnp.int32(3))
    scale = (H + R) ** -0.5
    got = jax.jit(lambda *a, **e: mla.mla_paged_attention(
        *a, sm_scale=scale, absorbed=True, backend=backend, **e))(*args, **extras)
    want = jax.jit(lambda *a, **e: ref_mla_paged_attention(
        *a, sm_scale=scale, absorbed=True, **e))(*args, **extras)
    err = _rel_err(got, want)
    if not err <= _tolerance(dtype):
        raise KernelCheckError(f"output differs from the reference: relative error {err:.3g}")


def check_backends(cfg: ModelConfig, backends: KernelBackends, dtype, *, page_size: int,
                   mode: str = "fallback", log=print,
                   experts: tuple | None = None) -> tuple[KernelBackends, dict]:
    """Checks the Pallas backends `backends` resolves to; the MoE on `experts` (the loaded
    model's, `model_experts`) when given. Returns (the backends to serve with, {op:
    (backend, None | the error that made it fall back)})."""
    if mode not in MODES:
        raise ValueError(f"backends must be one of {MODES}, got {mode!r}")
    if cfg.model_type == "gpt_oss":  # JAX's shipped TPU attention has no sinks
        from lp_jax.models.gpt_oss import serving_backends

        backends = serving_backends(backends)
    chosen = {"moe": moe.resolve_backend(backends.moe),
              "attention": attention.resolve_backend(backends.attention)}
    if backends.moe == "auto" and chosen["moe"] == "gpu" and jnp.dtype(dtype).itemsize != 2:
        chosen["moe"] = "xla_tiles"  # the Hopper kernel takes 16-bit weights only
    report = {op: (b, None) for op, b in chosen.items()}
    if mode == "off":
        return dataclasses.replace(backends, **chosen), report
    platform = jax.default_backend()
    attention_check = check_mla_attention if cfg.is_mla else check_attention
    checks = {"moe": (lambda b: check_moe(cfg, b, dtype, experts), SAFE_MOE,
                      chosen["moe"] in ("tpu", "gpu") and bool(cfg.moe_layers)),
              "attention": (lambda b: attention_check(cfg, b, dtype, page_size),
                            ("xla",) if cfg.is_mla else SAFE_ATTENTION.get(platform, ("xla",)),
                            chosen["attention"] != "xla")}
    for op, (check, safe, is_pallas) in checks.items():
        if not is_pallas:
            continue
        error = _run(check, chosen[op])
        if error is None:
            continue
        if mode == "strict":
            raise KernelCheckError(f"{op} backend {chosen[op]!r} failed its start-up check "
                                   f"(backends='strict'): {error}")
        fallback = next(b for b in safe if b in ("xla", "xla_tiles") or _run(check, b) is None)
        log(f"WARNING: {op} backend {chosen[op]!r} failed its start-up check ({error}); "
            f"serving with {fallback!r}")
        report[op] = (fallback, f"{chosen[op]}: {error}")
        chosen[op] = fallback
    return dataclasses.replace(backends, **chosen), report


def _run(check, backend) -> str | None:
    """None if `check(backend)` passes, else a one-line description of what failed."""
    try:
        check(backend)
    except Exception as e:  # noqa: BLE001 - any failure of a kernel means: do not serve it
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return f"{type(e).__name__}: {first[:300]}"
    return None
