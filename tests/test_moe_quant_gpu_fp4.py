"""W4A16 MXFP4 in the Hopper MoE kernel (issue 31), in the GPU interpreter, against an
independent numpy oracle.

The weights are random e2m1 codes and e8m0 exponents, packed here in numpy by
quant.py's documented layout (byte row j of [K/2, N]: row j's code in the low nibble,
row j + K/2's in the high one; scales [K/32, N] in row order), and dequantised here in
numpy from a value table (not through quant.py or the kernel's decoder). The oracle
routes in float64 (softmax, top-k, renormalised) and runs each routed row through the
float64 experts, GPT-OSS's biases and clamped SwiGLU included.

Shapes (the fewest simulated SMs, 1, as tests/test_pallas_end_to_end.py): D = 192 (gate/up:
K/2 = 96 byte rows, two 128-row K steps, the second overlapping the first by 32 byte rows,
as GPT-OSS-20B's 1440 = 22.5 x 64 does), F = 128 (down: one step, no overlap), N blocks
of 32 (gate/up) and 64 (down), tm = 8, E = 4 over two stacked layers run at layer 1, 13
tokens top-2 with two masked: expert 2 gets no row and the others groups that are not
multiples of the tile (partial tiles). The scales come as stored (quant.py: rows padded
to `scale_shape`'s count), their padding rows set to e8m0 NaN (byte 255) here, so a
kernel that read one would give non-finite output.
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

L, E, T, TOP_K, D, F, EMPTY = 2, 4, 13, 2, 192, 128, 2
VALUES = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])
ACT = MoEActivation("gpt_oss_clamped", limit=7.0, alpha=1.702)
TILING = gpu.GpuTiling(tm=8, gate_up_bn=32, down_bn=64, stages=2)


def _pack(codes):
    """numpy codes [..., K, N] -> int8 [..., K/2, N]: rows j and j + K/2 in byte row j."""
    K = codes.shape[-2]
    lo, hi = codes[..., :K // 2, :], codes[..., K // 2:, :]
    return (lo | (hi << 4)).astype(np.uint8).view(np.int8)


def _dequantise(codes, exps):
    """float64 weights from the codes [..., K, N] and e8m0 exponents [..., K/32, N]."""
    return VALUES[codes] * np.repeat(np.ldexp(1.0, exps.astype(np.int64) - 127), 32, axis=-2)


def _padded(exps, K):
    """e8m0 exponents [..., K/32, N] with quant.py's stored row count, the padding rows NaN."""
    rows = quant.MXFP4.scale_shape(K, exps.shape[-1])[0]
    pad = np.full((*exps.shape[:-2], rows - K // 32, exps.shape[-1]), 255, np.uint8)
    return np.concatenate([exps, pad], axis=-2)


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
                scales=(e8m0(_padded(e_gu, D)), e8m0(_padded(e_d, F))),
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


def test_scale_padding_and_step_overlap_are_exercised():
    """The oracle test's shapes do what its docstring says: padded scale rows (NaN) and a
    gate/up K whose last step overlaps, with zero lhs columns for the repeated rows."""
    _, _, _, a, _ = case()
    assert a["scales"][0].shape[-2] > D // 32 and a["scales"][1].shape[-2] > F // 32
    index, valid = gpu.mxfp4_column_order(D)
    assert index.shape == (256,) and int(valid.sum()) == D
    assert sorted(index[valid].tolist()) == list(range(D))  # every row of w exactly once
    assert valid[:64].all() and not valid[128:160].any() and valid[160:192].all()
    assert gpu.mxfp4_column_order(F)[1].all()  # F: K/2 = 64, one step, no overlap


def test_refusals():
    """What the packed kernel does not take gets a clear error: a K step other than 128,
    a K that is not a multiple of 64 (nor at least 128), and MXFP4 as unpacked
    float4_e2m1fn values."""
    with pytest.raises(ValueError, match="K steps of 128"):
        jax.eval_shape(lambda: _run(jnp.bfloat16, tiling=gpu.GpuTiling(tm=8, bk=64)))
    x, logits, mask, a, _ = case()
    for K in (96, 160):  # below one step; not a multiple of 64
        assert not gpu.mxfp4_fits(K)
        with pytest.raises(ValueError, match="multiple of 64"):
            gpu._check_mxfp4_step(quant.MXFP4, K, gpu.MXFP4_BK)
    unpacked = jnp.zeros((L, E, D, 2 * F), jnp.float4_e2m1fn)
    with pytest.raises(NotImplementedError, match="packed two e2m1 codes a byte"):
        jax.eval_shape(lambda: gpu.moe_ffn_gpu(
            jnp.asarray(x, jnp.bfloat16), jnp.asarray(logits), unpacked, a["w"][1], layer=1,
            top_k=TOP_K, norm_topk_prob=True, scales=a["scales"], scheme=quant.MXFP4,
            interpret=True))


def _mxfp4_args(D_, F_):
    sd = jax.ShapeDtypeStruct
    s = quant.MXFP4
    return (sd((16, D_), jnp.bfloat16), sd((16, E), jnp.float32),
            sd((L, E, D_ // 2, 2 * F_), jnp.int8), sd((L, E, F_ // 2, D_), jnp.int8),
            sd((L, E, *s.scale_shape(D_, 2 * F_)), s.scale_dtype),
            sd((L, E, *s.scale_shape(F_, D_)), s.scale_dtype))


def test_auto_takes_packed_mxfp4_on_hopper_to_the_kernel(monkeypatch):
    """"auto" on an H200 serves packed MXFP4 through the Hopper kernel (two Mosaic GPU
    calls in the export: the lowering, layout inference included, for hardware) where D and
    F fit its 128-row steps, each WGMMA loop waiting for its WGMMAs before the decoded
    tiles are rewritten; a K that does not fit (F = 32, the tiny GPT-OSS's) goes to
    xla_tiles (no Mosaic GPU call)."""
    from pallas_kernels import compile_targets
    from pallas_kernels import moe as moe_pkg

    def fn(x, logits, w_gu, w_d, s_gu, s_d):
        return moe_pkg.moe_ffn(x, logits, w_gu, w_d, layer=1, top_k=TOP_K, norm_topk_prob=True,
                               scales=(s_gu, s_d), scheme=quant.MXFP4)[0]

    monkeypatch.setattr(moe_pkg, "resolve_backend", lambda backend: "gpu")  # an H200
    with compile_targets.mosaic_gpu_modules() as modules:
        mlir = compile_targets.export_cuda(fn, _mxfp4_args(D, F)).mlir_module()
    assert mlir.count("@mosaic_gpu") == 2 and len(modules) == 2
    for module in modules:
        assert compile_targets.wgmma_refill_check(module)[1] == 0
        for body in compile_targets._loop_bodies(module):
            mma = [i for i, line in enumerate(body) if "wgmma.mma_async" in line]
            waits = [i for i, line in enumerate(body) if "wgmma.wait_group.sync.aligned 0;" in line]
            assert not mma or (waits and waits[-1] > mma[-1])
    assert "@mosaic_gpu" not in compile_targets.export_cuda(fn, _mxfp4_args(D, 32)).mlir_module()
