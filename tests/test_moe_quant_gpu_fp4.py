"""W4A16 MXFP4 in the Hopper MoE kernel (issue 31), in the GPU interpreter, against an
independent numpy oracle.

The weights are random e2m1 codes and e8m0 exponents, packed here in numpy by
quant.py's documented layout (byte row j of [K/2, N]: row j's code in the low nibble,
row j + K/2's in the high one; scales [K/32, N] in row order), and dequantised here in
numpy from a value table (not through quant.py or the kernel's decoder). The oracle
routes in float64 (softmax, top-k, renormalised) and runs each routed row through the
float64 experts, GPT-OSS's biases and clamped SwiGLU included.

Shapes (the fewest simulated SMs, 1, as tests/test_pallas_end_to_end.py): D = 128 (two
64-row K steps for gate/up), F = 64 (one for down), N blocks of 16, tm = 8, E = 4 over
two stacked layers run at layer 1, 13 tokens top-2 with two masked: expert 2 gets no
row and the others groups that are not multiples of the tile (partial tiles).
Tolerances: float32 activations 1e-5 (the decode is exact, the e8m0 scales are powers
of two: only the summation order differs); bfloat16 1e-2 (x, the decoded weights and h
are bfloat16: a few roundings of 2^-9).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import quant
from pallas_kernels.moe import gpu
from pallas_kernels.moe.ref import MoEActivation

L, E, T, TOP_K, D, F, EMPTY = 2, 4, 13, 2, 128, 64, 2
VALUES = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])
ACT = MoEActivation("gpt_oss_clamped", limit=7.0, alpha=1.702)
TILING = gpu.GpuTiling(tm=8, gate_up_bn=16, down_bn=16, stages=2)


def _pack(codes):
    """numpy codes [..., K, N] -> int8 [..., K/2, N]: rows j and j + K/2 in byte row j."""
    K = codes.shape[-2]
    lo, hi = codes[..., :K // 2, :], codes[..., K // 2:, :]
    return (lo | (hi << 4)).astype(np.uint8).view(np.int8)


def _dequantise(codes, exps):
    """float64 weights from the codes [..., K, N] and e8m0 exponents [..., K/32, N]."""
    return VALUES[codes] * np.repeat(np.ldexp(1.0, exps.astype(np.int64) - 127), 32, axis=-2)


@functools.cache
def case():
    rng = np.random.default_rng(7)
    c_gu, c_d = rng.integers(0, 16, (L, E, D, 2 * F)), rng.integers(0, 16, (L, E, F, D))
    e_gu = rng.integers(122, 126, (L, E, D // 32, 2 * F)).astype(np.uint8)
    e_d = rng.integers(122, 126, (L, E, F // 32, D)).astype(np.uint8)
    x = rng.standard_normal((T, D))
    logits = rng.standard_normal((T, E)) * 2
    logits[:, EMPTY] = -30.0
    mask = np.ones(T, bool)
    mask[[4, 9]] = False
    b_gu, b_d = rng.standard_normal((L, E, 2 * F)) * .1, rng.standard_normal((L, E, D)) * .1
    weights = (_dequantise(c_gu, e_gu)[1], _dequantise(c_d, e_d)[1], b_gu[1], b_d[1])
    e8m0 = lambda e: jnp.asarray(e.view(ml_dtypes.float8_e8m0fnu))
    args = dict(w=(jnp.asarray(_pack(c_gu)), jnp.asarray(_pack(c_d))),
                scales=(e8m0(e_gu), e8m0(e_d)),
                biases=(jnp.asarray(b_gu, jnp.float32), jnp.asarray(b_d, jnp.float32)))
    return x, logits, mask, args, weights


def oracle(x, logits, mask, w_gu, w_d, b_gu, b_d):
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    y = np.zeros_like(x)
    for t in np.flatnonzero(mask):
        top = np.argsort(-p[t])[:TOP_K]
        for e, wt in zip(top, p[t, top] / p[t, top].sum(), strict=True):
            z = x[t] @ w_gu[e] + b_gu[e]
            gate, up = np.minimum(z[:F], ACT.limit), np.clip(z[F:], -ACT.limit, ACT.limit)
            h = (up + 1) * gate / (1 + np.exp(-ACT.alpha * gate))
            y[t] += wt * (h @ w_d[e] + b_d[e])
    return y


def _run(dtype, **kw):
    x, logits, mask, a, _ = case()
    fn = lambda x_, lg, *w: gpu.moe_ffn_gpu(
        x_, lg, *w, layer=1, top_k=TOP_K, norm_topk_prob=True, token_mask_T=jnp.asarray(mask),
        biases=a["biases"], activation=ACT, scales=a["scales"], scheme=quant.MXFP4,
        num_sms=1, interpret=True, **kw)
    return jax.jit(fn)(jnp.asarray(x, dtype), jnp.asarray(logits, jnp.float32), *a["w"])


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
def test_mxfp4_kernel_matches_the_numpy_oracle(dtype, tol):
    x, logits, mask, _, weights = case()
    y, stats = _run(dtype, tiling=TILING)
    x_q = np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64)
    want = oracle(x_q, logits, mask, *weights)
    got = np.asarray(y.astype(jnp.float32), np.float64)
    assert np.isfinite(got).all()
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err < tol, err
    assert np.all(got[~mask] == 0)
    assert int(stats["tokens_per_expert"][EMPTY]) == 0


def test_refusals():
    """What the packed kernel does not take gets a clear error: a K step other than 64,
    MXFP4 as unpacked float4_e2m1fn values, and hardware (outside the interpreter), where
    the Mosaic GPU lowering fails (BENCHMARKS.md)."""
    with pytest.raises(ValueError, match="K steps of 64"):
        jax.eval_shape(lambda: _run(jnp.bfloat16, tiling=gpu.GpuTiling(tm=8, bk=32)))
    x, logits, mask, a, _ = case()
    unpacked = jnp.zeros((L, E, D, 2 * F), jnp.float4_e2m1fn)
    with pytest.raises(NotImplementedError, match="packed two e2m1 codes a byte"):
        jax.eval_shape(lambda: gpu.moe_ffn_gpu(
            jnp.asarray(x, jnp.bfloat16), jnp.asarray(logits), unpacked, a["w"][1], layer=1,
            top_k=TOP_K, norm_topk_prob=True, scales=a["scales"], scheme=quant.MXFP4,
            interpret=True))
    x_, w, sc = jnp.asarray(x, jnp.bfloat16), a["w"], a["scales"]
    with pytest.raises(NotImplementedError, match="GPU interpreter only"):
        jax.eval_shape(lambda: gpu.moe_ffn_gpu(
            x_, jnp.asarray(logits), *w, layer=1, top_k=TOP_K, norm_topk_prob=True,
            scales=sc, scheme=quant.MXFP4))


def test_auto_sends_packed_mxfp4_on_hopper_to_xla_tiles(monkeypatch):
    """Until the Hopper kernel's MXFP4 path lowers, "auto" on an H200 serves packed MXFP4
    through xla_tiles (no Mosaic GPU call in the export), while int8 still takes the kernel
    (test_moe_quant.py); the kernel itself refuses MXFP4 outside the interpreter."""
    from pallas_kernels import compile_targets
    from pallas_kernels import moe as moe_pkg

    sd = jax.ShapeDtypeStruct
    e8m0 = jnp.float8_e8m0fnu
    args = (sd((16, D), jnp.bfloat16), sd((16, E), jnp.float32),
            sd((L, E, D // 2, 2 * F), jnp.int8), sd((L, E, F // 2, D), jnp.int8),
            sd((L, E, D // 32, 2 * F), e8m0), sd((L, E, F // 32, D), e8m0))

    def fn(x, logits, w_gu, w_d, s_gu, s_d):
        return moe_pkg.moe_ffn(x, logits, w_gu, w_d, layer=1, top_k=TOP_K, norm_topk_prob=True,
                               scales=(s_gu, s_d), scheme=quant.MXFP4)[0]

    monkeypatch.setattr(moe_pkg, "resolve_backend", lambda backend: "gpu")  # an H200
    assert "@mosaic_gpu" not in compile_targets.export_cuda(fn, args).mlir_module()
