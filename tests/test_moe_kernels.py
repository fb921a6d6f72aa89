"""MoE feed-forward: the tile layout, and the Pallas backends in interpret mode.

Every backend is checked against both `ref_moe_ffn` (sort + ragged_dot) and the dense
oracle `ref_moe_ffn_dense`, norm-relative, 1e-5 in float32 and 2e-2 in bfloat16, over
cases with an expert that gets no token, one token, group sizes not divisible by the
tile, top-1/2/4 and masked padding tokens.

* tpu:      our fused-gather gate/up kernel + megablox gmm (down), TPU interpreter.
* tpu_gmm:  the fallback: megablox gmm for both matmuls on a materialised copy.
* gpu:      our Mosaic GPU tile-list kernel (gate/up+SwiGLU, down), GPU interpreter.

Tiles are tiny (tm=8, 16-wide K/N blocks) so that every kernel runs several tiles, K
steps and N blocks. Shapes are shared between tests so the jitted interpreters compile
once per (backend, shape). Both kernels are also lowered (no hardware needed) at
Qwen3-30B-A3B shapes: to Mosaic TPU for a TPU v6e, and to Mosaic GPU (layout
inference and the shared-memory budget included) for an H200.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import moe
from pallas_kernels.moe import gpu, layout, tpu
from pallas_kernels.moe.ref import ref_moe_ffn, ref_moe_ffn_dense, route
from pallas_kernels.moe.xla_tiles import moe_ffn_xla_tiles

TOL = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 2e-2}
D, F, E = 32, 32, 8
TM = 8
TPU_TILING = tpu.TpuTiling(tm=TM, tk=16, tn=16, down_tk=16, down_tn=16)
GPU_TILING = gpu.GpuTiling(tm=TM, bk=16, gate_up_bn=16, down_bn=16, stages=2)
GPU_SMS = 8
BACKENDS = ("xla_tiles", "tpu", "tpu_gmm", "gpu")


def rel_err(x, y):
    x = np.asarray(x, np.float32)
    y = np.asarray(y, np.float32)
    assert np.isfinite(x).all(), "non-finite values in output"
    return float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))


@functools.cache
def _runner(backend: str, top_k: int, interpret=True):
    def f(x, logits, wgu, wd, mask):
        kw = dict(top_k=top_k, norm_topk_prob=True, token_mask_T=mask)
        if backend == "tpu":
            return tpu.moe_ffn_tpu(x, logits, wgu, wd, **kw, tiling=TPU_TILING,
                                   interpret=interpret)
        if backend == "tpu_gmm":
            return tpu.moe_ffn_tpu(x, logits, wgu, wd, **kw, tiling=TPU_TILING,
                                   fused_gather=False, interpret=interpret)
        if backend == "gpu":
            return gpu.moe_ffn_gpu(x, logits, wgu, wd, **kw, tiling=GPU_TILING,
                                   num_sms=GPU_SMS, interpret=interpret)
        if backend == "xla_tiles":
            return moe_ffn_xla_tiles(x, logits, wgu, wd, **kw, tm=8)
        assert backend == "xla"
        return ref_moe_ffn(x, logits, wgu, wd, **kw)

    return jax.jit(f)


def run(backend, case, wgu=None):
    return _runner(backend, case.top_k)(
        case.x, case.logits, case.wgu if wgu is None else wgu, case.wd, case.mask)


class Case:
    def __init__(self, name, T, top_k, dtype, *, seed=0, masked=(), dead_experts=()):
        self.name, self.top_k, self.dtype = name, top_k, jnp.dtype(dtype)
        k = jax.random.split(jax.random.key(seed), 4)
        self.x = jax.random.normal(k[0], (T, D), jnp.float32).astype(dtype)
        logits = np.asarray(jax.random.normal(k[1], (T, E), jnp.float32)) * 2.0
        logits[:, list(dead_experts)] = -30.0  # never in anyone's top-k
        self.logits = jnp.asarray(logits)
        self.wgu = (jax.random.normal(k[2], (E, D, 2 * F)) / np.sqrt(D)).astype(dtype)
        self.wd = (jax.random.normal(k[3], (E, F, D)) / np.sqrt(F)).astype(dtype)
        mask = np.ones(T, bool)
        mask[list(masked)] = False
        self.mask = jnp.asarray(mask)

    def kwargs(self):
        return dict(top_k=self.top_k, norm_topk_prob=True, token_mask_T=self.mask)

    def active_experts(self):
        """Distinct experts among the valid tokens, recounted in numpy from the logits
        (softmax is monotonic, so top-k of the logits)."""
        ids = np.argsort(-np.asarray(self.logits), axis=1, kind="stable")[:, : self.top_k]
        return set(ids[np.asarray(self.mask)].ravel().tolist())

    def __repr__(self):
        return self.name


CASES = [
    Case("top1_f32", 16, 1, jnp.float32, seed=1),
    Case("top2_f32_dead_expert_masked", 16, 2, jnp.float32, seed=2, masked=(0, 7, 15),
         dead_experts=(3,)),
    Case("top4_f32_one_token", 1, 4, jnp.float32, seed=3),
    Case("top2_bf16_masked", 16, 2, jnp.bfloat16, seed=4, masked=(2, 3), dead_experts=(5,)),
    Case("top4_bf16_dead_experts", 16, 4, jnp.bfloat16, seed=5, dead_experts=(0, 6)),
]
# The fallback path shares its code with tpu except the gate/up matmul: two cases.
PAIRS = [(b, c) for b in ("tpu", "gpu") for c in CASES] + [
    ("tpu_gmm", CASES[1]), ("tpu_gmm", CASES[3])]


def test_cases_cover_the_spec():
    sizes = [np.bincount(
        np.argsort(-np.asarray(c.logits), 1)[:, : c.top_k][np.asarray(c.mask)].ravel(),
        minlength=E) for c in CASES]
    assert any((s == 0).any() for s in sizes), "an expert with zero tokens"
    assert any(((s % TM) != 0).any() for s in sizes), "group sizes not divisible by tm"
    assert any(c.x.shape[0] == 1 for c in CASES)
    assert {c.top_k for c in CASES} == {1, 2, 4}
    assert any(not np.asarray(c.mask).all() for c in CASES)


@pytest.mark.parametrize("backend,case", PAIRS, ids=lambda v: str(v))
def test_backend_matches_references(backend, case):
    y, stats = run(backend, case)
    y_ref, stats_ref = ref_moe_ffn(case.x, case.logits, case.wgu, case.wd, **case.kwargs())
    y_dense = ref_moe_ffn_dense(case.x, case.logits, case.wgu, case.wd, **case.kwargs())
    tol = TOL[case.dtype]
    assert y.dtype == case.dtype and y.shape == case.x.shape
    assert rel_err(y, y_ref) < tol
    assert rel_err(y, y_dense) < tol
    assert not np.asarray(y)[~np.asarray(case.mask)].any(), "padding tokens output 0"
    for key in ("tokens_per_expert", "experts_activated", "expert_bytes_loaded"):
        np.testing.assert_array_equal(stats[key], stats_ref[key], err_msg=key)


@pytest.mark.parametrize("backend", ("xla",) + BACKENDS)
def test_expert_bytes_loaded_is_a_recount_of_the_routing(backend):
    for case in (CASES[1], CASES[3]):
        _, stats = run(backend, case)
        active = case.active_experts()
        itemsize = case.dtype.itemsize
        assert int(stats["experts_activated"]) == len(active)
        assert float(stats["expert_bytes_loaded"]) == len(active) * 3 * D * F * itemsize
        counts = np.zeros(E, int)
        ids = np.argsort(-np.asarray(case.logits), 1)[:, : case.top_k]
        np.add.at(counts, ids[np.asarray(case.mask)].ravel(), 1)
        np.testing.assert_array_equal(stats["tokens_per_expert"], counts)


@pytest.mark.parametrize("backend", BACKENDS)
def test_inactive_experts_weights_are_never_read(backend):
    """NaN-filled weights for every expert without a token: the output stays finite and
    unchanged (a kernel that touched those tiles would spread NaN into real rows)."""
    for case in (CASES[1], CASES[4]):
        inactive = sorted(set(range(E)) - case.active_experts())
        assert inactive
        nan_wgu = case.wgu.at[jnp.asarray(inactive)].set(jnp.nan)
        y, _ = run(backend, case)
        y_nan, _ = run(backend, case, wgu=nan_wgu)
        assert np.isfinite(np.asarray(y_nan, np.float32)).all()
        np.testing.assert_array_equal(np.asarray(y_nan, np.float32), np.asarray(y, np.float32))


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_tokens_masked(backend):
    """No token routed: no tile, an empty kernel grid / loop, zeros out."""
    case = CASES[1]
    y, stats = _runner(backend, case.top_k)(
        case.x, case.logits, case.wgu, case.wd, jnp.zeros_like(case.mask))
    np.testing.assert_array_equal(np.asarray(y, np.float32), 0.0)
    assert int(stats["experts_activated"]) == 0 and float(stats["expert_bytes_loaded"]) == 0


def test_tpu_grids_visit_only_active_experts():
    """Instrument the TPU interpreter: record every grid point the gate/up kernel runs
    and map it to its expert; and check megablox's metadata for the down gmm."""
    case = CASES[1]
    _, expert_ids = route(case.logits, case.top_k, True)
    lay = layout.make_tile_layout(expert_ids, E, case.mask, TM)
    visited = []

    def record(token, point, core):  # io_callback: threads the interpreter's token
        visited.append(tuple(int(i) for i in point))
        return token

    params = pltpu.InterpretParams(grid_point_recorder=record)
    h = tpu.gate_up_gather(case.x, case.wgu, lay.token_ids_P, lay.tile_group_M,
                           lay.tile_rows_M, lay.num_tiles, tm=TM, tk=16, tn=16,
                           interpret=params)
    jax.block_until_ready(h)
    num_tiles = int(lay.num_tiles)
    active = case.active_experts()
    sizes = np.asarray(lay.group_sizes_E)
    assert num_tiles == int(np.sum(-(-sizes // TM)))
    assert len(visited) == num_tiles * (F // 16) * (D // 16)
    assert {t for t, _, _ in visited} == set(range(num_tiles))
    tile_group = np.asarray(lay.tile_group_M)
    assert {int(tile_group[t]) for t, _, _ in visited} == active

    (_, group_ids, _), n_active = tpu._megablox.make_group_metadata(
        group_sizes=lay.padded_sizes_E, m=lay.num_padded_rows, tm=TM,
        start_group=jnp.int32(0), num_nonzero_groups=E, visit_empty_groups=False)
    assert int(n_active) == num_tiles
    assert set(np.asarray(group_ids)[:num_tiles].tolist()) == active


def _h_reference(case, lay):
    """SiLU(x Wg) * (x Wu) for the real rows of the padded layout (numpy, float32)."""
    x = np.asarray(case.x, np.float32)
    w = np.asarray(case.wgu, np.float32)
    tok, tg, rows = (np.asarray(a) for a in (lay.token_ids_P, lay.tile_group_M, lay.tile_rows_M))
    real = [(m * TM + r) for m in range(int(lay.num_tiles)) for r in range(rows[m])]
    z = np.einsum("pd,pdf->pf", x[tok[real]], w[tg[np.asarray(real) // TM]])
    return real, (z[:, :F] / (1 + np.exp(-z[:, :F]))) * z[:, F:]


def test_interpreters_detect_no_races():
    """The gate/up kernels under the interpreters' happens-before race detectors; the
    TPU one also with DMAs executed eagerly at start (a prefetch into the buffer being
    computed on would then corrupt the result)."""
    case = CASES[3]
    _, expert_ids = route(case.logits, case.top_k, True)
    lay = layout.make_tile_layout(expert_ids, E, case.mask, TM)
    real, h_ref = _h_reference(case, lay)
    # The interpreters keep the detector of the last kernel run in module state.
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interp
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as gpu_interp

    params = pltpu.InterpretParams(detect_races=True, dma_execution_mode="eager")
    h = tpu.gate_up_gather(case.x, case.wgu, lay.token_ids_P, lay.tile_group_M,
                           lay.tile_rows_M, lay.num_tiles, tm=TM, tk=16, tn=16,
                           interpret=params)
    h = np.asarray(h, np.float32)
    assert tpu_interp.races is not None and not tpu_interp.races.races_found
    assert rel_err(h[real], h_ref) < TOL[case.dtype]
    x_SD = case.x[lay.token_ids_S]
    h = gpu.tile_gmm(x_SD, case.wgu, lay.tile_group_M, lay.tile_src_M, lay.num_tiles,
                     swiglu=True, tm=TM, bk=16, bn=16, stages=2, num_sms=4,
                     interpret=plgpu.InterpretGPUParams(detect_races=True))
    h = np.asarray(h, np.float32)
    assert not gpu_interp.get_races().races_found
    assert rel_err(h[real], h_ref) < TOL[case.dtype]


def test_gpu_kernel_writes_exactly_the_used_tiles():
    """Unused tiles point at an active expert here, so a kernel that ran past
    num_tiles would write finite rows there; the interpreter leaves unwritten output
    NaN."""
    case = CASES[1]
    _, expert_ids = route(case.logits, case.top_k, True)
    lay = layout.make_tile_layout(expert_ids, E, case.mask, TM)
    n = int(lay.num_tiles)
    assert n < lay.tile_group_M.shape[0]
    h = gpu.tile_gmm(case.x[lay.token_ids_S], case.wgu, lay.tile_group_M, lay.tile_src_M,
                     lay.num_tiles, swiglu=True, tm=TM, bk=16, bn=16, stages=2, num_sms=4,
                     interpret=True)
    h = np.asarray(h, np.float32)
    assert np.isfinite(h[: n * TM]).all()
    assert np.isnan(h[n * TM:]).all()


# ----------------------------------------------------------------------------- layout


@settings(max_examples=25, deadline=None)
@given(
    T=st.integers(1, 24),
    A=st.sampled_from([1, 2, 4]),
    tm=st.sampled_from([8, 16]),
    seed=st.integers(0, 2**16),
    mask_frac=st.floats(0.0, 1.0),
)
def test_tile_layout_invariants(T, A, tm, seed, mask_frac):
    rng = np.random.default_rng(seed)
    t_max = 24  # one compile per (A, tm); tokens past T are padding
    ids = np.stack([rng.choice(E, A, replace=False) for _ in range(t_max)]).astype(np.int32)
    mask = (rng.random(t_max) >= mask_frac) & (np.arange(t_max) < T)
    lay = _layout_jit(jnp.asarray(ids), jnp.asarray(mask), tm)
    sizes = np.bincount(ids[mask].ravel(), minlength=E)
    np.testing.assert_array_equal(lay.group_sizes_E, sizes)
    tiles = -(-sizes // tm)
    n = int(lay.num_tiles)
    assert n == tiles.sum() and n <= lay.tile_group_M.shape[0]
    tg, rows, src = (np.asarray(a) for a in (lay.tile_group_M, lay.tile_rows_M, lay.tile_src_M))
    np.testing.assert_array_equal(np.bincount(tg[:n], minlength=E), tiles)
    assert (rows[:n] > 0).all() and (rows[n:] == 0).all()
    np.testing.assert_array_equal(np.bincount(tg[:n], weights=rows[:n], minlength=E), sizes)
    assert (src % 8 == 0).all() and (src[:n] + tm <= lay.token_ids_S.shape[0]).all()
    tok_P, tok_S = np.asarray(lay.token_ids_P), np.asarray(lay.token_ids_S)
    pos, valid = np.asarray(lay.row_pos_TA), np.asarray(lay.valid_TA)
    np.testing.assert_array_equal(valid, np.repeat(mask[:, None], A, 1))
    for t, a in zip(*np.nonzero(valid), strict=True):
        p = pos[t, a]
        m, r = divmod(int(p), tm)
        assert m < n and tg[m] == ids[t, a] and r < rows[m]
        assert tok_P[p] == t and tok_S[src[m] + r] == t
    assert len(set(pos[valid].tolist())) == int(valid.sum())


@functools.partial(jax.jit, static_argnums=2)
def _layout_jit(ids, mask, tm):
    return layout.make_tile_layout(ids, E, mask, tm)


# ----------------------------------------------------------------------- entry points


def test_moe_ffn_entry_point(monkeypatch):
    assert moe.BACKENDS == ("auto", "xla", "xla_tiles", "tpu", "gpu")
    assert moe.resolve_backend("auto") == "xla_tiles"  # CPU
    with pytest.raises(ValueError, match="unknown MoE backend"):
        moe.resolve_backend("cuda")
    monkeypatch.delenv(moe.INTERPRET_ENV, raising=False)
    assert moe.resolve_interpret(None) is False
    monkeypatch.setenv(moe.INTERPRET_ENV, "1")
    assert moe.resolve_interpret(None) is True
    assert moe.resolve_interpret(False) is False
    case = CASES[3]
    y_ref, _ = ref_moe_ffn(case.x, case.logits, case.wgu, case.wd, **case.kwargs())
    y_auto, _ = moe.moe_ffn(case.x, case.logits, case.wgu, case.wd, **case.kwargs())
    assert rel_err(y_auto, y_ref) < TOL[case.dtype]
    # Default tilings (tm=128 / tm=64) through the public entry point, interpret via env.
    for backend in ("tpu", "gpu"):
        y, _ = moe.moe_ffn(case.x, case.logits, case.wgu, case.wd, **case.kwargs(),
                           backend=backend)
        assert rel_err(y, y_ref) < TOL[case.dtype], backend


def test_gpu_kernel_refuses_float32_on_hardware():
    x = jnp.zeros((64, 64), jnp.float32)
    w = jnp.zeros((2, 64, 64), jnp.float32)
    i = jnp.zeros((1,), jnp.int32)
    with pytest.raises(NotImplementedError, match="bfloat16"):
        gpu.tile_gmm(x, w, i, i, jnp.int32(1), swiglu=False, tm=64, bk=64, bn=64, stages=2)


# --------------------------------------------------------------- lowering for hardware

QWEN = dict(T=256, D=2048, F=768, E=128, A=8)


def _export(fn, platform, device_kind, num_cores, disabled=()):
    sd = jax.ShapeDtypeStruct
    T, D_, F_, E_ = QWEN["T"], QWEN["D"], QWEN["F"], QWEN["E"]
    args = (sd((T, D_), jnp.bfloat16), sd((T, E_), jnp.float32),
            sd((E_, D_, 2 * F_), jnp.bfloat16), sd((E_, F_, D_), jnp.bfloat16),
            sd((T,), jnp.bool_))
    dev = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=num_cores,
                                      platform="gpu" if platform == "cuda" else platform)
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev)
    with jax.sharding.use_abstract_mesh(mesh):
        exp = jax.export.export(jax.jit(fn), platforms=[platform],
                                disabled_checks=list(disabled))
        return exp(*args).mlir_module()


@pytest.mark.parametrize("fused_gather", [True, False])
def test_tpu_kernels_lower_to_mosaic(fused_gather):
    """Qwen3-30B-A3B expert shapes, default tiling, for a TPU v6e: our gate/up kernel
    (or the megablox fallback) and megablox's down gmm become two Mosaic custom calls
    (Mosaic's own compile needs a TPU)."""
    fn = lambda x, l, w1, w2, m: tpu.moe_ffn_tpu(x, l, w1, w2, top_k=QWEN["A"],
                                                norm_topk_prob=True, token_mask_T=m,
                                                fused_gather=fused_gather)
    mlir = _export(fn, "tpu", "TPU v6 lite", 1)
    assert mlir.count("stablehlo.custom_call @tpu_custom_call") == 2


def test_gpu_kernels_lower_to_mosaic_gpu():
    """Qwen3-30B-A3B expert shapes, default tiling, for an H200: both kernels go
    through Mosaic GPU lowering (layout inference, shared-memory budget); the PTX
    compile and the run need the GPU."""
    fn = lambda x, l, w1, w2, m: gpu.moe_ffn_gpu(x, l, w1, w2, top_k=QWEN["A"],
                                                norm_topk_prob=True, token_mask_T=m,
                                                num_sms=132)
    checks = [jax.export.DisabledSafetyCheck.custom_call("mosaic_gpu_v2")]
    mlir = _export(fn, "cuda", "NVIDIA H200", 132, checks)
    assert mlir.count("custom_call @mosaic_gpu_v2") == 2


# ------------------------------------------------------------------------ in the model


def test_tiny_model_prefill_with_pallas_moe(tiny_model, monkeypatch):
    """The model's own call (inside jit and lax.scan over layers) with the tpu and gpu
    MoE backends in interpret mode (via the env var): same prompt logits as xla."""
    from lp_jax.models.qwen3_moe import KernelBackends
    from lp_jax.models.simple import greedy_generate

    monkeypatch.setenv(moe.INTERPRET_ENV, "1")
    prompt = [5, 17, 42, 8, 99, 3, 7, 11, 13]
    logits = {}
    for b in ("xla", "tpu", "gpu"):
        _, logits[b] = greedy_generate(tiny_model, prompt, 1, return_prompt_logits=True,
                                       backends=KernelBackends(moe=b, attention="xla"))
    for b in ("tpu", "gpu"):
        assert rel_err(logits[b], logits["xla"]) < 1e-5, b
