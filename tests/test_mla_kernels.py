"""The MLA decode kernels (pallas_kernels/attention/mla_tpu.py, mla_gpu.py) against the
reference (mla_ref.py), in the Pallas interpreters on CPU.

Small shapes with DeepSeek-V3's structure (many heads against one latent row a key; the
row padded to whole lanes for the TPU kernel), a ragged batch with odd context lengths
(a sequence of 1 key, one ending one key into a page, one spanning several key blocks,
two tokens of one sequence, a padding token), in bfloat16 and with an FP8 latent pool.
The pool's pages that no sequence holds, the padding lanes of each row and the page-table
entries past each sequence's pages are poison (NaN, or page ids far out of range), so a
kernel that reads past a token's own context fails."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lp_jax.executor.kernel_check import check_backends
from lp_jax.models.backends import KernelBackends
from pallas_kernels.attention import interpret_mode, mla, mla_gpu, mla_tpu
from pallas_kernels.attention.mla_ref import quantize_latent, ref_mla_paged_attention

N, A, R, H, O, S = 16, 128, 32, 32, 32, 8  # heads, latent, rope, nope, value, page
Q_LENS, CTX = (1, 2, 1, 1), (1, 6 * S + 3, S + 1, 13)  # context after this step
C = 8  # page-table width: wider than every context
P = 48
BAD_PAGE = 10**6
# The interpreted kernels are large XLA:CPU programs: compiling them unoptimised halves
# the tests' time, and the arithmetic is the same.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _batch(kv_dtype, X, seed=0):
    """(args of ref_mla_paged_attention, kv_scale) for the ragged batch above."""
    rng = np.random.default_rng(seed)  # numpy: no random-number programs to compile
    T = sum(Q_LENS) + 1  # one padding token
    pool = np.full((P, S, 1, X), np.nan, np.float32)
    pages = rng.permutation(P)
    table = np.full((len(CTX), C), BAD_PAGE, np.int32)
    used = 0
    for b, ctx in enumerate(CTX):
        n = -(-ctx // S)
        table[b, :n] = pages[used:used + n]
        used += n
        pool[table[b, :n], :, :, :A + R] = rng.standard_normal((n, S, 1, A + R))
    scale = None
    if kv_dtype == "fp8":
        scale = jnp.float32(0.25)
        pool_x = quantize_latent(jnp.asarray(pool), scale)
        dtype = jnp.bfloat16
    else:
        dtype = kv_dtype
        pool_x = jnp.asarray(pool).astype(dtype)

    def normal(*shape, scale=1.0):
        return jnp.asarray(rng.standard_normal(shape, np.float32) * scale).astype(dtype)

    q_nope, q_pe = normal(T, N, H), normal(T, N, R)
    w_uk, w_uv = normal(A, N, H, scale=A**-0.5), normal(A, N, O, scale=A**-0.5)
    args = (q_nope, q_pe, pool_x, w_uk, w_uv, jnp.asarray(np.cumsum([0, *Q_LENS]), jnp.int32),
            jnp.asarray(CTX, jnp.int32), jnp.asarray(table), jnp.int32(len(CTX)))
    return args, scale


def _ref(args, scale):
    """The reference reads whole pages of a block of tokens (masked, but 0 * NaN is NaN):
    give it a table of held pages only."""
    def ref(*a):
        return ref_mla_paged_attention(*a, sm_scale=(H + R) ** -0.5, absorbed=True,
                                       kv_scale=scale)

    return jax.jit(ref, compiler_options=FAST_COMPILE)(*args[:7], _clean(args[7]), args[8])


def _clean(table):
    return jnp.where(table == BAD_PAGE, table[0, 0], table)


def _check(got, want, dtype):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.all(np.isfinite(got))
    tol = 2e-2 if dtype != jnp.float32 else 2e-5
    np.testing.assert_allclose(got, want, atol=tol * np.abs(want).max(), rtol=0)
    assert not got[-1].any()  # the padding token


def _kernel_output(module, args, scale, **kw):
    def run(q_nope, q_pe, pool, w_uk, w_uv, *rest):
        o_lat = module.mla_decode_attention(
            mla.absorb_query(q_nope, w_uk), q_pe, pool, *rest, sm_scale=(H + R) ** -0.5,
            kv_scale=scale, interpret=True, **kw)
        return jnp.einsum("tna,ano->tno", o_lat.astype(jnp.float32), w_uv.astype(jnp.float32))

    return jax.jit(run, compiler_options=FAST_COMPILE)(*args)


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_tpu_kernel_matches_the_reference(kv):
    """Two pages a key block: the long sequence takes 4 blocks, double-buffered."""
    args, scale = _batch(jnp.bfloat16 if kv == "bf16" else "fp8", X=256)
    got = _kernel_output(mla_tpu, args, scale, pages_per_block=2)
    _check(got, _ref(args, scale), jnp.bfloat16)


@pytest.mark.parametrize("kv", ["f32", "fp8"])
def test_gpu_kernel_matches_the_reference(kv):
    """Two head blocks and three splits of the page axis, merged in XLA; the unpadded
    row of A + R values."""
    dtype = jnp.float32 if kv == "f32" else "fp8"
    args, scale = _batch(dtype, X=A + R)
    got = _kernel_output(mla_gpu, args, scale, pages_per_block=1, num_splits=3)
    _check(got, _ref(args, scale), jnp.float32 if kv == "f32" else jnp.bfloat16)


def test_backend_switch_runs_the_kernel_for_decode_and_xla_for_prefill(monkeypatch):
    """mla.mla_paged_attention: the absorbed form goes to the named kernel (W_UK folded
    into its query, W_UV applied to its latent output), the expanded (prefill) form to
    the reference; 'tpu_jax' has no latent form. The kernel is stood in for by the
    reference's latent output (the kernel itself is checked above), so the absorbed
    result must match the expanded one."""
    args, _ = _batch(jnp.float32, X=256)
    clean = args[:7] + (_clean(args[7]), args[8])
    eye_AA1 = jnp.eye(A)[:, None, :]
    calls = []

    def latent_ref(q_lat, q_pe, pool, *rest, sm_scale, kv_scale, interpret):
        calls.append(interpret)  # the reference with W_UK = W_UV = I is o_lat itself
        T = q_lat.shape[0]
        w = jnp.broadcast_to(eye_AA1, (A, N, A))
        return ref_mla_paged_attention(q_lat, q_pe, pool, w, w, *rest[:2], _clean(rest[2]),
                                       rest[3], sm_scale=sm_scale, absorbed=True)[:T]

    monkeypatch.setattr(mla_tpu, "mla_decode_attention", latent_ref)
    with interpret_mode():
        decode, prefill = (jax.jit(lambda *a, absorbed=absorbed: mla.mla_paged_attention(
            *a, sm_scale=(H + R) ** -0.5, absorbed=absorbed, backend="tpu"),
            compiler_options=FAST_COMPILE)(*a) for absorbed, a in ((True, args), (False, clean)))
    assert calls == [True]
    _check(decode, prefill, jnp.float32)  # the two forms agree (mla_ref.py)
    with pytest.raises(ValueError, match="tpu_jax"):
        mla.mla_paged_attention(*args, sm_scale=1.0, absorbed=True, backend="tpu_jax")


def test_kernels_refuse_what_they_cannot_read():
    args, _ = _batch(jnp.float32, X=A + R)
    q_lat = mla.absorb_query(args[0], args[3])
    with pytest.raises(ValueError, match="multiple of 128"):  # TPU: an unpadded row
        mla_tpu.mla_decode_attention(q_lat, args[1], args[2], *args[5:], sm_scale=1.0)
    with pytest.raises(ValueError, match="block_h"):
        mla_gpu.mla_decode_attention(q_lat, args[1], args[2], *args[5:], sm_scale=1.0,
                                     block_h=24)
    with pytest.raises(ValueError, match=r"\[P, S, 1, X >= 160\]"):
        mla_gpu.mla_decode_attention(q_lat, args[1], args[2][..., :A], *args[5:], sm_scale=1.0)


@pytest.fixture(scope="module")
def mla_cfg():
    """tiny-deepseek's config at kernel-friendly latent widths (A 128, R 32)."""
    from checkpoints.make_tiny import ensure_tiny
    from lp_jax.config import ModelConfig

    cfg = ModelConfig.from_pretrained(ensure_tiny(preset="tiny-deepseek"))
    return cfg.replace(kv_lora_rank=A, head_dim=R)  # head_dim: the rotary width


@pytest.mark.parametrize("backend", ["gpu"])  # the TPU kernel's check runs the same code
def test_start_up_check_keeps_a_working_kernel(mla_cfg, backend, monkeypatch):
    monkeypatch.setenv("LP_JAX_PALLAS_INTERPRET", "1")
    logs = []
    chosen, report = check_backends(mla_cfg, KernelBackends(moe="xla", attention=backend),
                                    jnp.float32, page_size=S, log=logs.append)
    assert chosen.attention == backend and report["attention"] == (backend, None), report
    assert not logs


def test_start_up_check_falls_back_to_xla_not_the_shipped_gqa_kernel(mla_cfg, monkeypatch):
    """A failing MLA kernel falls back to "xla" with one warning, also on a TPU (where
    GQA attention would try JAX's shipped kernel first, which has no latent form)."""
    from lp_jax.executor import kernel_check

    def broken(*args, **kwargs):
        raise RuntimeError("Mosaic: unsupported lane slice (simulated)")

    monkeypatch.setenv("LP_JAX_PALLAS_INTERPRET", "1")
    monkeypatch.setattr(mla_tpu, "mla_decode_attention", broken)
    monkeypatch.setattr(kernel_check.jax, "default_backend", lambda: "tpu")
    logs = []
    chosen, report = check_backends(mla_cfg, KernelBackends(moe="xla", attention="tpu"),
                                    jnp.float32, page_size=S, log=logs.append)
    assert chosen.attention == "xla" and "Mosaic" in report["attention"][1]
    assert len(logs) == 1 and logs[0].startswith("WARNING") and "'xla'" in logs[0]


def test_kernel_refusal_names_shapes_a_kernel_cannot_take():
    """What serving_backends consults before "auto" picks a kernel: DeepSeek-V3's and
    Kimi-K2's heads fit both kernels; the tiny presets' 32-wide latent fits neither."""
    for heads in (128, 64):
        assert mla.kernel_refusal("tpu", heads, 512, 64) is None
        assert mla.kernel_refusal("gpu", heads, 512, 64) is None
    assert "multiple of 128" in mla.kernel_refusal("tpu", 4, 32, 8)
    assert "powers of two >= 16" in mla.kernel_refusal("gpu", 4, 32, 8)
    assert mla.kernel_refusal("xla", 4, 32, 8) is None
