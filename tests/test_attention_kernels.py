"""Paged attention: reference, write_kv, and the Pallas kernels in interpret mode.

Every case is checked against a dense float64 numpy oracle over each sequence's
full context, so the reference and the kernels are tested the same way. Shapes
are tiny: the Pallas interpreter runs on CPU.

* GPU (Triton) kernels: numerics in the Pallas HLO interpreter, plus a check that
  they lower to Triton IR for an H200 (no GPU needed for lowering).
* TPU (our Mosaic kernel): numerics in the TPU interpreter (NaN-filled fresh
  buffers, DMA race detector on), the order of its page DMAs across work items, plus
  a check that it lowers to Mosaic for a v6e.
* TPU (JAX's shipped ragged paged attention, backend "tpu_jax"): in jax 0.11.2 it
  does not run in either Pallas interpreter (see tpu_jax.py), so only its argument
  adaptation is checked, against the kernel's own input validators, and the call
  must lower to Mosaic for a TPU v6.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_kernels import attention
from pallas_kernels.attention import gpu, tpu, tpu_jax
from pallas_kernels.attention.ref import (
    ref_attention_dense,
    ref_decode_attention,
    ref_ragged_paged_attention,
    write_kv,
)

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def rel_err(x, y):
    x = np.asarray(x, np.float32)
    y = np.asarray(y, np.float32)
    assert np.isfinite(x).all(), "non-finite values in output"
    return float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))


@dataclasses.dataclass
class Batch:
    q_TNH: jax.Array
    kv_pages_PSJH: jax.Array
    query_start_B1: jax.Array
    seq_lens_B: jax.Array
    page_table_BC: jax.Array
    num_seqs: jax.Array
    expected_TNH: np.ndarray  # dense oracle, zeros for padding tokens
    sm_scale: float

    def ragged_args(self):
        return (self.q_TNH, self.kv_pages_PSJH, self.query_start_B1, self.seq_lens_B,
                self.page_table_BC, self.num_seqs)


def as_dtype(x, dtype):
    """Rounds numpy data to `dtype` and back to float32."""
    return np.asarray(x).astype(jnp.dtype(dtype)).astype(np.float32)


def dense_oracle(q_LNH, k_LKH, v_LKH, sm_scale, sinks_N=None, window=None):
    """Causal attention over one contiguous sequence in float64 numpy. sinks_N: a logit
    per head joining the softmax as a key of value zero; window W: query t sees keys
    in (t - W, t] (GPT-OSS)."""
    L, N, _ = q_LNH.shape
    G = N // k_LKH.shape[1]
    k = np.repeat(k_LKH, G, axis=1).astype(np.float64)
    v = np.repeat(v_LKH, G, axis=1).astype(np.float64)
    s = np.einsum("tnh,snh->nts", q_LNH.astype(np.float64), k) * sm_scale
    t, key = np.arange(L)[:, None], np.arange(L)[None, :]
    visible = key <= t
    if window:
        visible &= key > t - window
    s = np.where(visible[None], s, -np.inf)
    if sinks_N is not None:  # the sink column, dropped after the softmax
        sink = np.broadcast_to(np.asarray(sinks_N, np.float64)[:, None, None], (N, L, 1))
        s = np.concatenate([s, sink], axis=-1)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("nts,snh->tnh", p[..., :L], v).astype(np.float32)


def make_batch(seqs, *, S, K, G, H, dtype, T=None, B=None, C=None, extra_pages=3, seed=0,
               sinks_N=None, window=None):
    """seqs: (cached prefix length, new tokens) per sequence; q_len 0 with prefix 0 is
    a padding sequence. Each sequence's pages are scattered randomly over the pool and
    its whole context is written with write_kv; the oracle attends over the context
    (with sinks_N / a sliding window if given) and keeps the new tokens' rows. Data is
    rounded to `dtype` first."""
    rng = np.random.default_rng(seed)
    N = K * G
    B = B or len(seqs)
    seq_lens = [p + n for p, n in seqs]
    pages_needed = [-(-s // S) for s in seq_lens]
    C = C or max(1, max(pages_needed))
    P = sum(pages_needed) + extra_pages
    perm = rng.permutation(P)
    page_table = np.zeros((B, C), np.int32)
    used = 0
    for b, n in enumerate(pages_needed):
        page_table[b, :n] = perm[used:used + n]
        used += n
    q_lens = [n for _, n in seqs]
    T = T or max(1, sum(q_lens))
    query_start = np.zeros(B + 1, np.int32)
    query_start[1:len(seqs) + 1] = np.cumsum(q_lens)
    query_start[len(seqs) + 1:] = sum(q_lens)

    # Pool starts as garbage (stale data); only context slots are written, all at
    # once with write_kv.
    kv0 = jnp.asarray(rng.normal(size=(P, S, 2 * K, H)) * 3.0, dtype)
    q_TNH = as_dtype(rng.normal(size=(T, N, H)), dtype)
    expected = np.zeros((T, N, H), np.float32)
    sm_scale = H**-0.5
    ks, vs, slots = [], [], []
    for b, (prefix, n) in enumerate(seqs):
        L = prefix + n
        if L == 0:
            continue
        k_LKH = as_dtype(rng.normal(size=(L, K, H)), dtype)
        v_LKH = as_dtype(rng.normal(size=(L, K, H)), dtype)
        pos = np.arange(L)
        ks.append(k_LKH)
        vs.append(v_LKH)
        slots.append(page_table[b, pos // S] * S + pos % S)
        q_full = as_dtype(rng.normal(size=(L, N, H)), dtype)
        t0 = query_start[b]
        q_full[prefix:] = q_TNH[t0:t0 + n]
        expected[t0:t0 + n] = dense_oracle(q_full, k_LKH, v_LKH, sm_scale, sinks_N,
                                           window)[prefix:]
    kv = kv0
    if ks:
        kv = write_kv(kv0, jnp.asarray(np.concatenate(ks), dtype),
                      jnp.asarray(np.concatenate(vs), dtype),
                      jnp.asarray(np.concatenate(slots), jnp.int32))
    return Batch(
        q_TNH=jnp.asarray(q_TNH, dtype), kv_pages_PSJH=kv,
        query_start_B1=jnp.asarray(query_start),
        seq_lens_B=jnp.asarray(seq_lens + [0] * (B - len(seqs)), jnp.int32),
        page_table_BC=jnp.asarray(page_table), num_seqs=jnp.int32(len(seqs)),
        expected_TNH=expected, sm_scale=sm_scale,
    )


def decode_batch(ctx_lens, **kw):
    """One new token per sequence; ctx_len 0 is a padding sequence (anywhere)."""
    b = make_batch([(max(c - 1, 0), 1 if c else 0) for c in ctx_lens], **kw)
    # make_batch packs tokens; decode wants token b for sequence b.
    B = len(ctx_lens)
    q_BNH = np.zeros((B,) + b.q_TNH.shape[1:], np.float32)
    exp_BNH = np.zeros_like(q_BNH)
    t = 0
    for i, c in enumerate(ctx_lens):
        if c:
            q_BNH[i] = np.asarray(b.q_TNH[t], np.float32)
            exp_BNH[i] = b.expected_TNH[t]
            t += 1
    return dataclasses.replace(b, q_TNH=jnp.asarray(q_BNH, b.q_TNH.dtype), expected_TNH=exp_BNH)


# A mixed ragged batch: chunked prefill over a 3-page prefix ending mid-page, a
# decode token, a fresh prefill longer than a query block, a prefill ending
# mid-page; then padding sequences and padding tokens.
MIXED = [(19, 5), (6, 1), (0, 20), (3, 6)]


def without_tokens(b: Batch) -> Batch:
    """`b` with one sequence of no tokens and no context (and padding sequences): the
    same shapes, so a kernel compiled for `b` runs it from the jit cache; all zeros."""
    return dataclasses.replace(
        b, query_start_B1=jnp.zeros_like(b.query_start_B1),
        seq_lens_B=jnp.zeros_like(b.seq_lens_B), num_seqs=jnp.int32(1),
        expected_TNH=np.zeros_like(b.expected_TNH))


# ---------------------------------------------------------------- write_kv and ref


def test_write_kv_skips_negative_slots_and_writes_mid_page():
    P, S, K, H = 3, 4, 2, 2
    kv = jnp.zeros((P, S, 2 * K, H), jnp.float32)
    k = jnp.arange(3 * K * H, dtype=jnp.float32).reshape(3, K, H) + 1
    v = -k
    slots = jnp.array([5, -1, 10], jnp.int32)  # page 1 offset 1, skipped, page 2 offset 2
    out = np.asarray(write_kv(kv, k, v, slots))
    want = np.zeros((P, S, 2 * K, H), np.float32)
    for t, s in ((0, 5), (2, 10)):
        for kh in range(K):
            want[s // S, s % S, 2 * kh] = np.asarray(k[t, kh])
            want[s // S, s % S, 2 * kh + 1] = np.asarray(v[t, kh])
    np.testing.assert_array_equal(out, want)
    # A second write into the same page leaves the earlier rows alone.
    out2 = np.asarray(write_kv(jnp.asarray(out), k[:1] * 0 + 7, v[:1] * 0 + 7,
                               jnp.array([4], jnp.int32)))
    np.testing.assert_array_equal(out2[1, 1], want[1, 1])
    assert (out2[1, 0] == 7).all()


def test_packed_pool_is_the_same_bytes():
    """write_kv into a packed [P, S, K, 2H] pool writes what it writes into [P, S, 2K, H]
    (same bytes), and the reference reads either form."""
    b = decode_batch([13, 6], S=8, K=2, G=2, H=16, dtype=jnp.float32)
    P, S, J, H = b.kv_pages_PSJH.shape
    rng = np.random.default_rng(2)
    k, v = (jnp.asarray(rng.normal(size=(3, 2, H)), jnp.float32) for _ in range(2))
    slots = jnp.array([5, -1, 17], jnp.int32)
    kv = write_kv(b.kv_pages_PSJH, k, v, slots)
    kv_packed = write_kv(packed(b).kv_pages_PSJH, k, v, slots)
    assert kv_packed.shape == (P, S, J // 2, 2 * H)
    np.testing.assert_array_equal(np.asarray(kv_packed).reshape(kv.shape), np.asarray(kv))
    ref = jax.jit(functools.partial(ref_decode_attention, sm_scale=b.sm_scale))
    for x in (b, packed(b)):
        out = ref(x.q_TNH, x.kv_pages_PSJH, x.seq_lens_B, x.page_table_BC)
        assert rel_err(out, b.expected_TNH) < 1e-5


def test_ref_attention_dense_matches_oracle():
    rng = np.random.default_rng(1)
    q, k, v = (rng.normal(size=s).astype(np.float32) for s in ((9, 8, 16), (9, 2, 16),
                                                                (9, 2, 16)))
    out = ref_attention_dense(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), sm_scale=0.25)
    assert rel_err(out, dense_oracle(q, k, v, 0.25)) < 1e-5


@pytest.mark.parametrize("G", [1, 4])
def test_ref_ragged_matches_dense_multi_page_prefix(G):
    b = make_batch(MIXED, S=8, K=2, G=G, H=16, dtype=jnp.float32, T=40, B=6)
    out = ref_ragged_paged_attention(*b.ragged_args(), sm_scale=b.sm_scale, block_q=8)
    assert rel_err(out, b.expected_TNH) < 1e-5
    assert not np.asarray(out[32:]).any()  # padding tokens are zeros


def test_ref_decode_matches_dense():
    b = decode_batch([27, 1, 8, 13, 0, 0], S=8, K=2, G=4, H=16, dtype=jnp.float32)
    out = ref_decode_attention(b.q_TNH, b.kv_pages_PSJH, b.seq_lens_B, b.page_table_BC,
                               sm_scale=b.sm_scale)
    assert rel_err(out, b.expected_TNH) < 1e-5
    assert not np.asarray(out[4:]).any()


# ----------------------------------------------------------------- GPU (interpret)

GPU_CASES = [  # (G, dtype)
    (1, jnp.float32), (4, jnp.float32), (8, jnp.float32),
    (1, jnp.bfloat16), (4, jnp.bfloat16), (8, jnp.bfloat16),
]


@pytest.mark.parametrize("G,dtype", GPU_CASES)
def test_gpu_decode_interpret(G, dtype):
    # one-token context, mid-page ends, 4-page context, padding in the middle and end
    b = decode_batch([1, 27, 0, 8, 13, 0], S=8, K=2, G=G, H=32, dtype=dtype, C=5)
    splits = 2 if G == 4 else 1  # split-K path: a split may be empty
    out = gpu.decode_attention(b.q_TNH, b.kv_pages_PSJH, b.seq_lens_B, b.page_table_BC,
                               sm_scale=b.sm_scale, pages_per_block=1, num_splits=splits,
                               interpret=True)
    assert out.dtype == dtype
    assert rel_err(out, b.expected_TNH) < TOL[dtype]
    assert not np.asarray(out[2]).any() and not np.asarray(out[5]).any()


def test_gpu_decode_splits_share_each_sequences_own_blocks(monkeypatch):
    """Splits divide a sequence's own key blocks, not the page table's width: contexts of
    8 and 5 pages in a 64-page-wide table, 4 splits. (Sized from the width, split 0 took
    pages 0-15, so all the work, and splits 1-3 idled.) Reads the kernel's per-split
    softmax sums l [B, K, split, G]: l > 0 where a split saw keys."""
    partials = []
    pallas_call = pl.pallas_call

    def recording_pallas_call(*args, **kwargs):
        call = pallas_call(*args, **kwargs)
        return lambda *operands: partials.append(call(*operands)) or partials[-1]

    monkeypatch.setattr(pl, "pallas_call", recording_pallas_call)
    b = decode_batch([60, 33], S=8, K=1, G=4, H=32, dtype=jnp.float32, C=64)
    decode = gpu.decode_attention.__wrapped__  # eager, so the partials are values
    out = decode(b.q_TNH, b.kv_pages_PSJH, b.seq_lens_B, b.page_table_BC,
                 sm_scale=b.sm_scale, pages_per_block=1, num_splits=4, interpret=True)
    assert rel_err(out, b.expected_TNH) < 1e-5
    (_, _, l_BKXG), = partials
    worked_BX = np.asarray(l_BKXG[:, 0, :, :4] > 0).all(axis=-1)
    np.testing.assert_array_equal(worked_BX, [[True] * 4, [True, True, True, False]])


def _gpu_ragged(b: Batch, G: int):
    return gpu.ragged_paged_attention(*b.ragged_args(), sm_scale=b.sm_scale, block_rows=16,
                                      pages_per_block=2 if G == 1 else 1, interpret=True)


@pytest.mark.parametrize("G,dtype", GPU_CASES)
def test_gpu_ragged_interpret(G, dtype):
    b = make_batch(MIXED, S=8, K=2, G=G, H=32, dtype=dtype, T=40, B=6)
    out = _gpu_ragged(b, G)
    assert out.dtype == dtype
    assert rel_err(out, b.expected_TNH) < TOL[dtype]
    assert not np.asarray(out[32:]).any()


def test_gpu_single_token_interpret():
    b = make_batch([(0, 1)], S=8, K=1, G=4, H=16, dtype=jnp.float32)
    out = gpu.ragged_paged_attention(*b.ragged_args(), sm_scale=b.sm_scale, interpret=True)
    assert rel_err(out, b.expected_TNH) < 1e-5
    d = decode_batch([1], S=8, K=1, G=4, H=16, dtype=jnp.float32)
    out = gpu.decode_attention(d.q_TNH, d.kv_pages_PSJH, d.seq_lens_B, d.page_table_BC,
                               sm_scale=d.sm_scale, interpret=True)
    assert rel_err(out, d.expected_TNH) < 1e-5


def test_gpu_no_real_sequences_gives_zeros():
    """No token in the batch (one empty sequence, then padding ones), at the shapes of
    test_gpu_ragged_interpret[4-float32], whose program it reuses."""
    b = without_tokens(make_batch(MIXED, S=8, K=2, G=4, H=32, dtype=jnp.float32, T=40, B=6))
    out = _gpu_ragged(b, 4)
    assert np.isfinite(np.asarray(out)).all() and not np.asarray(out).any()


def test_gpu_constraints_raise():
    q = jnp.zeros((2, 4, 24), jnp.float32)
    with pytest.raises(ValueError, match="head_dim H=24 must be a power of two"):
        gpu.check_constraints(q, jnp.zeros((4, 8, 2, 24), jnp.float32), jnp.zeros((2, 1)))
    q = jnp.zeros((2, 4, 32), jnp.float32)
    with pytest.raises(ValueError, match="page_size S=12"):
        gpu.check_constraints(q, jnp.zeros((4, 12, 2, 32), jnp.float32), jnp.zeros((2, 1)))
    with pytest.raises(ValueError, match="q dtype float32 != cache dtype bfloat16"):
        gpu.check_constraints(q, jnp.zeros((4, 8, 2, 32), jnp.bfloat16), jnp.zeros((2, 1)))
    with pytest.raises(ValueError, match="not divisible by KV heads K=3"):
        gpu.check_constraints(q, jnp.zeros((4, 8, 6, 32), jnp.float32), jnp.zeros((2, 1)))


def _h200_mesh():
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    return jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev)


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("G,dtype", [(1, jnp.float32), (8, jnp.bfloat16)])
def test_gpu_kernels_lower_to_triton(G, dtype, monkeypatch):
    """Both kernels lower to Triton IR at Qwen3-MoE shapes (H=128, S=16) for an H200,
    with IEEE (not TF32) float32 dots; only the PTX compile needs a GPU."""
    from jax._src.pallas.triton import lowering

    modules = []
    lower = lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = lower(*args, **kwargs)
        modules.append(str(result.module))
        return result

    monkeypatch.setattr(lowering, "lower_jaxpr_to_triton_module", capture)
    K, H, S, P, B, T, C = 4, 128, 16, 64, 8, 64, 16
    sd = jax.ShapeDtypeStruct
    q_B, q_T = sd((B, K * G, H), dtype), sd((T, K * G, H), dtype)
    kv, i32 = sd((P, S, 2 * K, H), dtype), lambda *s: sd(s, jnp.int32)
    check = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    dec = jax.jit(lambda q, kv, l, pt: gpu.decode_attention(q, kv, l, pt, sm_scale=0.1))
    pre = jax.jit(lambda q, kv, qs, l, pt, n: gpu.ragged_paged_attention(
        q, kv, qs, l, pt, n, sm_scale=0.1))
    with jax.sharding.use_abstract_mesh(_h200_mesh()):
        m1 = jax.export.export(dec, platforms=["cuda"], disabled_checks=check)(
            q_B, kv, i32(B), i32(B, C)).mlir_module()
        m2 = jax.export.export(pre, platforms=["cuda"], disabled_checks=check)(
            q_T, kv, i32(B + 1), i32(B), i32(B, C), i32()).mlir_module()
    assert "lp_paged_decode_attention" in m1 and "xla.gpu.triton" in m1
    assert "lp_paged_prefill_attention" in m2
    assert len(modules) == 2 and all("tt.dot" in m for m in modules)
    assert not any("tf32" in m for m in modules)


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
def test_gpu_kernels_lower_with_sinks_and_window():
    """Both kernels lower for CUDA (an H200; only ptxas needs a GPU) at GPT-OSS-20B
    attention shapes: 64 query heads, 8 KV heads, head_dim 64, bf16 sinks, a traced
    window; the window and sinks are extra operands of the Triton calls."""
    from pallas_kernels import compile_targets

    N, K, H, S, P, B, T, C = 64, 8, 64, 16, 256, 8, 64, 16
    sd, bf16, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
    kv, sinks, w = sd((P, S, 2 * K, H), bf16), sd((N,), bf16), sd((), i32)
    check = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    dec = compile_targets.export_cuda(
        lambda q, kv, l, pt, s, w: gpu.decode_attention(
            q, kv, l, pt, sm_scale=H ** -0.5, sinks_N=s, sliding_window=w),
        (sd((B, N, H), bf16), kv, sd((B,), i32), sd((B, C), i32), sinks, w),
        disabled_checks=check).mlir_module()
    pre = compile_targets.export_cuda(
        lambda q, kv, qs, l, pt, n, s, w: gpu.ragged_paged_attention(
            q, kv, qs, l, pt, n, sm_scale=H ** -0.5, sinks_N=s, sliding_window=w),
        (sd((T, N, H), bf16), kv, sd((B + 1,), i32), sd((B,), i32), sd((B, C), i32),
         sd((), i32), sinks, w), disabled_checks=check).mlir_module()
    assert "lp_paged_decode_attention" in dec and "lp_paged_prefill_attention" in pre
    # decode: seq_lens, pages, q, K, V, window; prefill: also the sinks [K, Gp] (decode
    # merges them into its splits in XLA)
    for module, operands in ((dec, 6), (pre, 7)):
        (call,) = [ln for ln in module.splitlines() if "xla.gpu.triton" in ln]
        assert call.split("(", 1)[1].split(")", 1)[0].count("%") == operands


# ------------------------------------------------------------------------------ TPU


TPU_CASES = [(G, dtype) for dtype in (jnp.float32, jnp.bfloat16) for G in (1, 4, 8)]


def _tpu_interpret():
    """Interpreter settings: fresh buffers are NaN, DMAs land only at their wait, and
    the happens-before race detector watches every DMA and buffer access."""
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.InterpretParams(detect_races=True, dma_execution_mode="on_wait",
                                 uninitialized_memory="nan")


def _assert_no_races():
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc

    assert ipc.races is not None and not ipc.races.races_found


def _tpu_ragged(b: Batch):
    # 8-token items: the 20-token prefill spans three, one ending mid-item; two-page
    # key blocks: prefixes end mid-block and mid-page.
    return tpu.ragged_paged_attention(*b.ragged_args(), sm_scale=b.sm_scale, block_q=8,
                                      pages_per_block=2, interpret=_tpu_interpret())


@pytest.mark.parametrize("G,dtype", TPU_CASES)
def test_tpu_ragged_interpret(G, dtype):
    b = make_batch(MIXED, S=8, K=2, G=G, H=128, dtype=dtype, T=40, B=6)
    out = _tpu_ragged(b)
    _assert_no_races()
    assert out.dtype == dtype
    assert rel_err(out, b.expected_TNH) < TOL[dtype]
    assert not np.asarray(out[32:], np.float32).any()


@pytest.mark.parametrize("G,dtype", [(4, jnp.float32), (8, jnp.bfloat16)])
def test_tpu_decode_interpret(G, dtype):
    # one-token context, mid-page ends, a 4-page context, padding in the middle and end
    b = decode_batch([1, 27, 0, 8, 13, 0], S=8, K=2, G=G, H=128, dtype=dtype, C=5)
    out = tpu.decode_attention(b.q_TNH, b.kv_pages_PSJH, b.seq_lens_B, b.page_table_BC,
                               sm_scale=b.sm_scale, pages_per_block=1,
                               interpret=_tpu_interpret())
    _assert_no_races()
    assert rel_err(out, b.expected_TNH) < TOL[dtype]
    assert not np.asarray(out[2], np.float32).any() and not np.asarray(out[5], np.float32).any()


def test_tpu_prefetches_the_next_items_first_block_interpret(monkeypatch):
    """An item's last key block starts the DMAs of the next item's first block, and every
    page an item needs is fetched once. Records, in the TPU interpreter, each item's
    query-block read (the start of its grid step) and each DMA's source page."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc

    events = []
    get, dma_start = ipc.get, ipc.dma_start

    def recording_get(*args, input_name=None, **kwargs):
        if input_name is not None:  # a BlockSpec input read: the queries of item args[6][0]
            events.append(("item", int(args[6][0])))
        return get(*args, input_name=input_name, **kwargs)

    def recording_dma_start(token, device_id, core, space, buffer, src_transforms, *args,
                            **kwargs):
        events.append(("page", int(src_transforms[0].indices[0])))
        return dma_start(token, device_id, core, space, buffer, src_transforms, *args,
                         **kwargs)

    recording_get.__wrapped__ = get.__wrapped__  # the interpreter's DMAs call the raw get
    monkeypatch.setattr(ipc, "get", recording_get)
    monkeypatch.setattr(ipc, "dma_start", recording_dma_start)
    # Two-page blocks: 2 pages (1 block), 4 pages (2 blocks), padding, 3 pages (2 blocks).
    b = decode_batch([9, 30, 0, 17], S=8, K=1, G=4, H=128, dtype=jnp.float32, C=4)
    out = tpu.decode_attention(b.q_TNH, b.kv_pages_PSJH, b.seq_lens_B, b.page_table_BC,
                               sm_scale=b.sm_scale, pages_per_block=2,
                               interpret=_tpu_interpret())
    _assert_no_races()
    assert rel_err(out, b.expected_TNH) < 1e-5
    pt = np.asarray(b.page_table_BC)
    pages = [("page", int(p)) for p in pt[0, :2]], [("page", int(p)) for p in pt[1, :4]]
    last = [("page", int(p)) for p in pt[3, :3]]
    assert events == [
        ("item", 0), *pages[0], *pages[1][:2],  # item 1's first block, during item 0
        ("item", 1), *pages[1][2:],
        ("item", 2),  # padding: no pages, so item 3 starts its own first block
        ("item", 3), *last]


def test_tpu_single_token_and_default_blocks_interpret():
    b = make_batch([(0, 1)], S=16, K=1, G=4, H=128, dtype=jnp.float32)
    out = tpu.ragged_paged_attention(*b.ragged_args(), sm_scale=b.sm_scale, interpret=True)
    assert rel_err(out, b.expected_TNH) < 1e-5
    # default block sizes on a long prefix: several key blocks per item
    b = make_batch([(300, 9), (0, 3)], S=16, K=1, G=2, H=128, dtype=jnp.float32)
    out = tpu.ragged_paged_attention(*b.ragged_args(), sm_scale=b.sm_scale, interpret=True)
    assert rel_err(out, b.expected_TNH) < 1e-5


def test_tpu_no_real_sequences_gives_zeros():
    """No token in the batch (one empty sequence, then padding ones), at the shapes of
    test_tpu_ragged_interpret[4-float32], whose program it reuses: NaN-filled fresh
    buffers and the race detector on, and every item has no key block."""
    b = without_tokens(make_batch(MIXED, S=8, K=2, G=4, H=128, dtype=jnp.float32, T=40, B=6))
    out = _tpu_ragged(b)
    _assert_no_races()
    assert np.isfinite(np.asarray(out)).all() and not np.asarray(out).any()


def test_tpu_constraints_raise():
    with pytest.raises(ValueError, match="multiple of 128"):
        tpu.check_constraints(jnp.zeros((2, 4, 64)), jnp.zeros((4, 16, 4, 64)))
    with pytest.raises(ValueError, match="page_size S=12"):
        tpu.check_constraints(jnp.zeros((2, 4, 128)), jnp.zeros((4, 12, 4, 128)))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        tpu.check_constraints(jnp.zeros((2, 4, 128), jnp.float16),
                              jnp.zeros((4, 16, 4, 128), jnp.float16))


def _export_for_v6e(fn, *args):
    dev = jax.sharding.AbstractDevice(device_kind="TPU v6 lite", num_cores=1, platform="tpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev)
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.export.export(jax.jit(fn), platforms=["tpu"])(*args).mlir_module()


def _qwen3_moe_shapes(dtype):
    sd = jax.ShapeDtypeStruct
    K, N, H, S, P, B, T, C = 4, 32, 128, 16, 64, 8, 64, 16
    return (sd((T, N, H), dtype), sd((P, S, 2 * K, H), dtype), sd((B + 1,), jnp.int32),
            sd((B,), jnp.int32), sd((B, C), jnp.int32), sd((), jnp.int32))


def test_tpu_kernel_lowers_to_mosaic():
    """Our kernel lowers for a TPU v6e at Qwen3-30B-A3B attention shapes, in bf16."""
    m = _export_for_v6e(lambda q, kv, qs, l, pt, n: tpu.ragged_paged_attention(
        q, kv, qs, l, pt, n, sm_scale=0.1), *_qwen3_moe_shapes(jnp.bfloat16))
    assert "tpu_custom_call" in m and "lp_tpu_ragged_paged_attention" in m


def _validating_stand_in(calls):
    """Stands in for the shipped kernel: runs its static and dynamic input validators,
    then answers with our reference and NaN in the rows the kernel leaves unwritten."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa

    def fake(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale,
             num_kv_pages_per_block, num_queries_per_block, vmem_limit_bytes):
        kw = dict(sm_scale=sm_scale, num_kv_pages_per_block=num_kv_pages_per_block,
                  num_queries_per_block=num_queries_per_block)
        rpa.dynamic_validate_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                                    **kw)
        rpa.get_min_heads_per_blk(q.shape[1], kv_pages.shape[2], q.dtype, kv_pages.dtype)
        calls.append(kw)
        out = ref_ragged_paged_attention(q, kv_pages, cu_q_lens, kv_lens, page_indices,
                                         num_seqs[0], sm_scale=sm_scale)
        t = jnp.arange(q.shape[0])[:, None, None]
        return jnp.where(t < cu_q_lens[num_seqs[0]], out, jnp.nan).astype(q.dtype)

    return fake


def test_tpu_jax_wrapper_arguments(monkeypatch):
    calls = []
    monkeypatch.setattr(tpu_jax, "_shipped_rpa", _validating_stand_in(calls))
    b = make_batch(MIXED, S=16, K=2, G=4, H=128, dtype=jnp.bfloat16, T=40, B=6)
    out = tpu_jax.ragged_paged_attention(*b.ragged_args(), sm_scale=b.sm_scale)
    assert rel_err(out, b.expected_TNH) < 2e-2
    assert not np.asarray(out[32:], np.float32).any()
    # decode with padding sequences in the middle: kv_len 0 must not reach the kernel
    d = decode_batch([1, 0, 27, 0], S=16, K=2, G=4, H=128, dtype=jnp.float32)
    out = tpu_jax.decode_attention(d.q_TNH, d.kv_pages_PSJH, d.seq_lens_B, d.page_table_BC,
                                   sm_scale=d.sm_scale)
    assert rel_err(out, d.expected_TNH) < 1e-5
    assert calls[0]["num_kv_pages_per_block"] and calls[0]["num_queries_per_block"]


def test_tpu_jax_constraints_raise():
    with pytest.raises(ValueError, match="multiple of 128"):
        tpu_jax.check_constraints(jnp.zeros((2, 4, 64)), jnp.zeros((4, 16, 4, 64)))
    with pytest.raises(ValueError, match="not fully tiled"):
        tpu_jax.check_constraints(jnp.zeros((2, 6, 128), jnp.bfloat16),
                                  jnp.zeros((4, 16, 6, 128), jnp.bfloat16))


def test_tpu_jax_kernel_lowers_to_mosaic():
    """The shipped kernel, called the way we call it, lowers for a TPU v6e."""
    m = _export_for_v6e(lambda q, kv, qs, l, pt, n: tpu_jax.ragged_paged_attention(
        q, kv, qs, l, pt, n, sm_scale=0.1), *_qwen3_moe_shapes(jnp.bfloat16))
    assert "tpu_custom_call" in m


# ------------------------------------------------- sinks and sliding windows (GPT-OSS)

# A sliding layer's batch (window 40, pages of 8): a chunk of 2 new tokens at 70 whose
# window starts on page 3 (pages 0-2 are skipped; with two-page TPU key blocks a block
# is interior to both the causal mask and the window), a decode token, a prefill whose
# rows all see their whole prefix, and a decode token at 52 whose window skips page 0.
SLIDING, WINDOW = [(70, 2), (6, 1), (0, 20), (52, 1)], 40


def poison_before_window(b: Batch, first_pos_B, window: int) -> Batch:
    """The batch with every page wholly before the window of its sequence's first query
    (so of every query) filled with NaN: a kernel that reads one, even masked, returns
    NaN (0 * NaN), so finite outputs equal to the oracle prove the pages were skipped."""
    S = b.kv_pages_PSJH.shape[1]
    table = np.asarray(b.page_table_BC)
    poisoned = [table[seq, p] for seq, pos in enumerate(first_pos_B)
                for p in range(max(pos - window + 1, 0) // S)]
    assert poisoned, "the case must have pages wholly outside the window"
    kv = b.kv_pages_PSJH.at[np.asarray(poisoned)].set(jnp.nan)
    return dataclasses.replace(b, kv_pages_PSJH=kv)


def gpt_oss_layers(make, first_pos_B, N, dtype, seed=3):
    """(sinks_N, full layer's batch, sliding layer's batch): the same data, oracles with
    sinks and without / with WINDOW; the sliding one poisoned before its windows."""
    sinks_N = as_dtype(np.random.default_rng(seed).normal(size=N) * 2.0, dtype)
    full = make(sinks_N=sinks_N, window=None)
    sliding = poison_before_window(make(sinks_N=sinks_N, window=WINDOW), first_pos_B, WINDOW)
    return jnp.asarray(sinks_N, dtype), full, sliding


def check_layer_kinds(kernel, full: Batch, sliding: Batch, dtype, decode=False):
    """kernel: jitted (window, *arrays) -> out, the window a traced int32. One program
    runs window 0 (a full layer) on the clean pool, then WINDOW on the poisoned one;
    both match their oracles, and padding tokens give exact zeros."""
    def arrays(b):
        return ((b.q_TNH, b.kv_pages_PSJH, b.seq_lens_B, b.page_table_BC) if decode
                else b.ragged_args())

    outs = [kernel(jnp.int32(w), *arrays(b)) for b, w in ((full, 0), (sliding, WINDOW))]
    assert kernel._cache_size() == 1  # both layer kinds ran the same program
    for out, b in zip(outs, (full, sliding), strict=True):
        assert out.dtype == dtype
        assert rel_err(out, b.expected_TNH) < TOL[dtype]  # finite: no poisoned page read
        padding_T = ~b.expected_TNH.any(axis=(1, 2))
        assert padding_T.any() and not np.asarray(out, np.float32)[padding_T].any()


def test_ref_sinks_and_window_skip_pages():
    make = functools.partial(make_batch, SLIDING, S=8, K=2, G=4, H=16, dtype=jnp.float32,
                             T=32, B=6)
    sinks_N, full, sliding = gpt_oss_layers(make, [p for p, _ in SLIDING], 8, jnp.float32)
    # One-token blocks: the reference's blocks may span sequences, and a block skips
    # only the pages before the window of all its tokens.
    ref = jax.jit(lambda w, *a: ref_ragged_paged_attention(
        *a, sm_scale=full.sm_scale, block_q=1, sinks_N=sinks_N, sliding_window=w))
    check_layer_kinds(ref, full, sliding, jnp.float32)


def _sink_window_kernel(backend, entry, sinks_N, sm_scale):
    """The kernel under test as jitted (window, *arrays), with small blocks: TPU two-page
    key blocks (windows start mid-block) and 8-token items, its interpreter checking
    races on NaN-filled fresh buffers; GPU 4-token blocks, decode split in two."""
    extras = dict(sm_scale=sm_scale, sinks_N=sinks_N)
    if backend == "tpu":
        extras.update(interpret=_tpu_interpret(), pages_per_block=2)
        if entry == "ragged":
            return jax.jit(lambda w, *a: tpu.ragged_paged_attention(
                *a, block_q=8, sliding_window=w, **extras))
        return jax.jit(lambda w, *a: tpu.decode_attention(*a, sliding_window=w, **extras))
    extras.update(interpret=True)
    if entry == "ragged":
        return jax.jit(lambda w, *a: gpu.ragged_paged_attention(
            *a, block_rows=16, pages_per_block=2, sliding_window=w, **extras))
    return jax.jit(lambda w, *a: gpu.decode_attention(
        *a, pages_per_block=1, num_splits=2, sliding_window=w, **extras))


def packed(b: Batch) -> Batch:
    """The batch with its pool packed [P, S, K, 2H] (ref.py): the same bytes."""
    P, S, J, H = b.kv_pages_PSJH.shape
    return dataclasses.replace(b, kv_pages_PSJH=b.kv_pages_PSJH.reshape(P, S, J // 2, 2 * H))


@pytest.mark.parametrize("backend,entry,G,dtype,H,pack", [
    ("tpu", "ragged", 4, jnp.float32, 128, False),
    ("tpu", "decode", 8, jnp.bfloat16, 64, True),  # GPT-OSS's head_dim, packed pool
    ("gpu", "ragged", 4, jnp.float32, 32, False),
    ("gpu", "decode", 8, jnp.bfloat16, 64, False)])
def test_kernel_sinks_and_window_interpret(backend, entry, G, dtype, H, pack):
    """GPT-OSS layers through our kernels: a full layer with sinks and a sliding layer
    with sinks and a 40-token window (shorter than the contexts, its skipped pages NaN),
    the window a traced scalar, against the float64 oracle."""
    if entry == "ragged":
        first_pos_B = [p for p, _ in SLIDING]
        make = functools.partial(make_batch, SLIDING, T=32, B=6)
    else:  # a 9-page context whose window skips 3 pages, padding in the middle
        ctx = [71, 1, 0, 60, 9]
        first_pos_B = [c - 1 for c in ctx]
        make = functools.partial(decode_batch, ctx, C=9)
    make = functools.partial(make, S=8, K=2, G=G, H=H, dtype=dtype)
    sinks_N, full, sliding = gpt_oss_layers(make, first_pos_B, 2 * G, dtype)
    if pack:
        full, sliding = packed(full), packed(sliding)
    kernel = _sink_window_kernel(backend, entry, sinks_N, full.sm_scale)
    check_layer_kinds(kernel, full, sliding, dtype, decode=entry == "decode")
    if backend == "tpu":
        _assert_no_races()


# ----------------------------------------------------------------- entry points, bench


def test_entry_points_dispatch():
    assert attention.resolve_backend("auto") == "xla"  # CPU
    with pytest.raises(ValueError, match="unknown attention backend"):
        attention.resolve_backend("cuda")
    b = make_batch(MIXED, S=8, K=2, G=4, H=16, dtype=jnp.float32, T=40, B=6)
    with pytest.raises(ValueError, match="interpret_mode"):
        attention.ragged_paged_attention(*b.ragged_args(), sm_scale=b.sm_scale, backend="gpu")
    ref = attention.ragged_paged_attention(*b.ragged_args(), sm_scale=b.sm_scale)
    assert rel_err(ref, b.expected_TNH) < 1e-5
    with attention.interpret_mode():
        assert attention.interpret_enabled()
        out = attention.ragged_paged_attention(*b.ragged_args(), sm_scale=b.sm_scale,
                                               backend="gpu")
        d = decode_batch([5, 17, 0], S=8, K=2, G=4, H=16, dtype=jnp.float32)
        dec = attention.decode_attention(d.q_TNH, d.kv_pages_PSJH, d.seq_lens_B,
                                         d.page_table_BC, sm_scale=d.sm_scale, backend="gpu")
    assert not attention.interpret_enabled()
    assert rel_err(out, b.expected_TNH) < 1e-5
    assert rel_err(dec, d.expected_TNH) < 1e-5


def test_entry_points_pass_sinks_and_window(monkeypatch):
    """"tpu" and "gpu" hand sinks_N / sliding_window to their kernels, and nothing when
    both are None (the plain call, unchanged); "tpu_jax" refuses them."""
    calls = []

    def record(*args, **kwargs):
        calls.append(sorted(kwargs))
        return args[0]

    for module in (tpu, gpu):
        monkeypatch.setattr(module, "ragged_paged_attention", record)
        monkeypatch.setattr(module, "decode_attention", record)
    d = decode_batch([5, 17], S=8, K=2, G=4, H=16, dtype=jnp.float32)
    dec_args = (d.q_TNH, d.kv_pages_PSJH, d.seq_lens_B, d.page_table_BC)
    sinks_N, window = jnp.zeros((8,), jnp.float32), jnp.int32(4)
    with attention.interpret_mode():
        for backend in ("tpu", "gpu"):
            attention.decode_attention(*dec_args, sm_scale=0.1, backend=backend,
                                       sinks_N=sinks_N, sliding_window=window)
            attention.ragged_paged_attention(*dec_args[:2], jnp.arange(3), *dec_args[2:],
                                             2, sm_scale=0.1, backend=backend)
        with pytest.raises(ValueError, match="'tpu_jax' has no sinks_N / sliding_window"):
            attention.decode_attention(*dec_args, sm_scale=0.1, backend="tpu_jax",
                                       sinks_N=sinks_N, sliding_window=window)
    full = ["interpret", "sinks_N", "sliding_window", "sm_scale"]
    assert calls == [full, ["interpret", "sm_scale"]] * 2
    # A packed pool: "tpu" reads it as it is, "gpu" through its [P, S, 2K, H] view.
    pools = []
    for module in (tpu, gpu):
        monkeypatch.setattr(module, "decode_attention",
                            lambda q, kv, *a, **kw: pools.append(kv.shape) or q)
    with attention.interpret_mode():
        for backend in ("tpu", "gpu"):
            attention.decode_attention(d.q_TNH, packed(d).kv_pages_PSJH, *dec_args[2:],
                                       sm_scale=0.1, backend=backend)
    P, S, J, H = d.kv_pages_PSJH.shape
    assert pools == [(P, S, J // 2, 2 * H), (P, S, J, H)]


def test_decode_bench_small():
    from lp_jax.bench.attention_kernels import bench_decode_attention

    row = bench_decode_attention(batch=2, context=40, num_heads=4, num_kv_heads=2, head_dim=16,
                                 page_size=8, dtype=jnp.float32, backend="xla", repeats=1,
                                 peak_bw=1e9)
    assert row["backend"] == "xla" and row["bytes"] == 2 * 40 * 4 * 16 * 4 + 2 * 2 * 4 * 16 * 4
    assert row["gbps"] > 0 and row["fraction_of_peak"] > 0


def test_gpu_decode_sweep_small():
    from lp_jax.bench.attention_kernels import sweep_gpu_decode

    configs = [dict(num_splits=None, pages_per_block=1, num_warps=4, num_stages=2),
               dict(num_splits=2, pages_per_block=2, num_warps=8, num_stages=3)]
    with attention.interpret_mode():
        rows = sweep_gpu_decode(batch=2, context=40, configs=configs, num_heads=4,
                                num_kv_heads=2, head_dim=16, page_size=8, dtype=jnp.float32,
                                repeats=1, peak_bw=1e9)
    assert sorted(row["pages_per_block"] for row in rows) == [1, 2]
    assert rows[0]["seconds"] <= rows[1]["seconds"]
    assert all(row["gbps"] > 0 and row["fraction_of_peak"] > 0 for row in rows)
