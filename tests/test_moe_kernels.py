"""MoE feed-forward: the tile layout, and the Pallas backends in interpret mode.

Every backend is checked against both `ref_moe_ffn` (sort + ragged_dot) and the dense
oracle `ref_moe_ffn_dense`, norm-relative, 1e-5 in float32 and 2e-2 in bfloat16, over
cases with an expert that gets no token, one token, group sizes not divisible by the
tile, top-1/2/4 and masked padding tokens.

* tpu:      our fused-gather gate/up kernel + our tile-grid kernel (down), TPU
            interpreter.
* tpu_gmm:  the fallback: the tile-grid kernel for gate/up too, on a materialised copy.
* gpu:      our Mosaic GPU tile-list kernel (gate/up+SwiGLU, down), GPU interpreter.

Tiles are tiny (tm=8, 16-wide K/N blocks) so that every kernel runs several tiles, K
steps and N blocks. Shapes are shared between tests so the jitted interpreters compile
once per (backend, shape).

Stacked weights: every backend given [L, E, ...] weights and a layer (a Python int,
or traced in a fori_loop over the layers) equals the one-layer call on w[layer]. The
kernels are also lowered (no hardware needed) at Qwen3-30B-A3B shapes with stacked
weights and a traced layer: to Mosaic TPU for a TPU v6e, and to Mosaic GPU (layout
inference and the shared-memory budget included) for an H200; the StableHLO shows
that each kernel takes the stacked weights whole (no slice of a layer), and the
lowered Mosaic GPU modules that every pipelined WGMMA loop waits for its WGMMAs
before TMA refills their shared memory. Real TPU compiles: tests/test_tpu_compile.py.

GPT-OSS experts (issue 18): biases on both projections and the clamped SwiGLU, with
values past the clamp, stacked [2, E, ...] weights and biases and a traced layer: every
Pallas path (tpu with split and with joint [gate | up] blocks, tpu_gmm, gpu) equals
`ref_moe_ffn`; "auto" lowers to the kernels; at GPT-OSS-20B shapes (2880 wide) the TPU
kernels compile for a v6e (libtpu) taking the stacked weights and biases whole, and
the GPU kernels export for cuda. Qwen3's kernels keep their operand lists.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import compile_targets, moe
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


def _call(backend, x, logits, wgu, wd, mask, *, top_k, layer=None, interpret=True):
    kw = dict(layer=layer, top_k=top_k, norm_topk_prob=True, token_mask_T=mask)
    if backend == "tpu":
        return tpu.moe_ffn_tpu(x, logits, wgu, wd, **kw, tiling=TPU_TILING, interpret=interpret)
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


@functools.cache
def _runner(backend: str, top_k: int, interpret=True):
    def f(x, logits, wgu, wd, mask):
        return _call(backend, x, logits, wgu, wd, mask, top_k=top_k, interpret=interpret)

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
    """Instrument the TPU interpreter: record every grid point the gate/up kernel and
    the down kernel run and map it to its expert."""
    case = CASES[1]
    _, expert_ids = route(case.logits, case.top_k, True)
    lay = layout.make_tile_layout(expert_ids, E, case.mask, TM)
    num_tiles = int(lay.num_tiles)
    sizes = np.asarray(lay.group_sizes_E)
    assert num_tiles == int(np.sum(-(-sizes // TM)))
    tile_group = np.asarray(lay.tile_group_M)

    def visited_by(kernel):
        visited = []

        def record(token, point, core):  # io_callback: threads the interpreter's token
            visited.append(tuple(int(i) for i in point))
            return token

        jax.block_until_ready(kernel(pltpu.InterpretParams(grid_point_recorder=record)))
        return visited

    gate_up = visited_by(lambda params: tpu.gate_up_gather(
        case.x, case.wgu, lay.token_ids_P, lay.tile_group_M, lay.tile_rows_M, lay.num_tiles,
        tm=TM, tk=16, tn=16, interpret=params))
    h = jnp.zeros((lay.num_padded_rows, F), case.dtype)
    down = visited_by(lambda params: tpu.tile_gmm(
        h, case.wd, lay.tile_group_M, lay.num_tiles, swiglu=False, tm=TM, tk=16, tn=16,
        interpret=params))
    for visited, blocks in ((gate_up, (F // 16) * (D // 16)), (down, (D // 16) * (F // 16))):
        assert len(visited) == num_tiles * blocks
        assert {t for t, _, _ in visited} == set(range(num_tiles))
        assert {int(tile_group[t]) for t, _, _ in visited} == case.active_experts()


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
    # Default tilings (tm=128 / tm=64) through the public entry point, interpret via env;
    # the GPU kernel's work spread over GPU_SMS simulated SMs, not the H200's 132.
    monkeypatch.setattr(gpu, "_num_sms", lambda: GPU_SMS)
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


# ------------------------------------------------------------------- stacked weights
STACK = 3  # layers in the stacked test weights


def _stacked(case):
    """[STACK, E, ...] weights: layer 1 is the case's own, the others are different."""
    k1, k2 = jax.random.split(jax.random.key(99))
    wgu = (jax.random.normal(k1, (STACK, E, D, 2 * F)) / np.sqrt(D)).astype(case.dtype)
    wd = (jax.random.normal(k2, (STACK, E, F, D)) / np.sqrt(F)).astype(case.dtype)
    return wgu.at[1].set(case.wgu), wd.at[1].set(case.wd)


@pytest.mark.parametrize("backend", ("xla",) + BACKENDS)
def test_stacked_weights_address_the_layer(backend):
    """[3, E, ...] weights with layer=1 give the one-layer call on w[1], stats included
    (bytes of one expert of one layer); a layer traced in a fori_loop over all three
    layers gives the reference on each w[l]."""
    case = CASES[1]
    wgu, wd = _stacked(case)
    args = (case.x, case.logits, wgu, wd, case.mask)
    y, stats = jax.jit(lambda *a: _call(backend, *a, top_k=case.top_k, layer=1))(*args)
    y_want, stats_want = run(backend, case)
    np.testing.assert_allclose(y, y_want, rtol=1e-6, atol=1e-6)
    for key in stats_want:
        np.testing.assert_array_equal(stats[key], stats_want[key], err_msg=key)

    def layer_loop(x, logits, wgu, wd, mask):
        def body(layer, ys):
            y, _ = _call(backend, x, logits, wgu, wd, mask, top_k=case.top_k, layer=layer)
            return ys.at[layer].set(y)

        return jax.lax.fori_loop(0, STACK, body, jnp.zeros((STACK, *x.shape), x.dtype))

    ys = jax.jit(layer_loop)(*args)
    for layer in range(STACK):
        y_ref, _ = ref_moe_ffn(case.x, case.logits, wgu[layer], wd[layer], **case.kwargs())
        assert rel_err(ys[layer], y_ref) < TOL[case.dtype], layer


def test_stacked_weights_are_checked():
    case = CASES[1]
    wgu, wd = _stacked(case)
    with pytest.raises(ValueError, match="layer=None takes"):
        moe.moe_ffn(case.x, case.logits, wgu, wd, **case.kwargs(), backend="xla_tiles")
    with pytest.raises(ValueError, match="stacked"):
        moe.moe_ffn(case.x, case.logits, case.wgu, case.wd, layer=0, **case.kwargs())
    with pytest.raises(IndexError, match="out of range"):
        moe.moe_ffn(case.x, case.logits, wgu, wd, layer=STACK, **case.kwargs())


def _result_dims(hlo_text: str) -> set[tuple[int, ...]]:
    """Result shapes of every instruction in compiled HLO text, leading 1s dropped."""
    dims = set()
    for m in re.finditer(r"= \w+\[([\d,]*)\]", hlo_text):
        shape = tuple(int(d) for d in m.group(1).split(",") if d)
        while shape[:1] == (1,):
            shape = shape[1:]
        dims.add(shape)
    return dims


@pytest.mark.parametrize("backend,copies_a_layer", [("xla_tiles", False), ("xla", True)])
def test_xla_paths_in_a_layer_loop_compiled(backend, copies_a_layer):
    """The compiled CPU program of a layer loop: xla_tiles indexes one expert of one
    layer per tile and never materialises a layer's [E, D, 2F] / [E, F, D] weights;
    the xla reference slices them (the check can fail)."""
    case = CASES[1]
    wgu, wd = _stacked(case)

    def layer_loop(x, logits, wgu, wd, mask):
        def body(layer, acc):
            return acc + _call(backend, x, logits, wgu, wd, mask, top_k=case.top_k,
                               layer=layer)[0]

        return jax.lax.fori_loop(0, STACK, body, jnp.zeros_like(x))

    hlo = jax.jit(layer_loop).lower(case.x, case.logits, wgu, wd, case.mask).compile()
    dims = _result_dims(hlo.as_text())
    assert bool({(E, D, 2 * F), (E, F, D)} & dims) == copies_a_layer


# --------------------------------------------------------------- lowering for hardware

QWEN = dict(T=256, D=2048, F=768, E=128, A=8, L=3)  # L=3: no stacked size equals a layer's


def _qwen_args():
    sd = jax.ShapeDtypeStruct
    T, D_, F_, E_, L_ = QWEN["T"], QWEN["D"], QWEN["F"], QWEN["E"], QWEN["L"]
    return (sd((T, D_), jnp.bfloat16), sd((T, E_), jnp.float32),
            sd((L_, E_, D_, 2 * F_), jnp.bfloat16), sd((L_, E_, F_, D_), jnp.bfloat16),
            sd((T,), jnp.bool_))


def _layer_loop(moe_fn, slice_first=False):
    """A model's layer loop reduced to its MoE: fori_loop over the stacked layers, the
    loop counter as the layer. slice_first: the wrong way, w[layer] sliced before the
    kernel (to show that the check below catches it)."""
    def f(x, logits, wgu, wd, mask):
        def body(layer, acc):
            if slice_first:
                y, _ = moe_fn(x, logits, wgu[layer], wd[layer], mask, layer=None)
            else:
                y, _ = moe_fn(x, logits, wgu, wd, mask, layer=layer)
            return acc + y

        return jax.lax.fori_loop(0, QWEN["L"], body, jnp.zeros_like(x))

    return f


def _weight_slice_problems(stablehlo: str, target: str) -> list[str]:
    """What shows that a kernel did not take the stacked weights whole."""
    L_, E_, D_, F_ = QWEN["L"], QWEN["E"], QWEN["D"], QWEN["F"]
    one_layer = {E_ * D_ * 2 * F_, E_ * F_ * D_}  # elements of a layer's gate/up, down
    stacked = {L_ * n for n in one_layer}
    calls = compile_targets.custom_call_operand_shapes(stablehlo, target)
    operands = {compile_targets.num_elements(s) for call in calls for s in call}
    sliced = {compile_targets.num_elements(s) for s in compile_targets.sliced_shapes(stablehlo)}
    problems = []
    if not stacked <= operands:
        problems.append(f"the {target} calls do not take the stacked weights whole")
    if one_layer & operands:
        problems.append(f"a {target} call takes one layer's weights")
    if one_layer & sliced:
        problems.append("one layer's weights are sliced out of the stacked arrays")
    return problems


def _tpu_moe(fused_gather):
    return lambda x, l, w1, w2, m, layer: tpu.moe_ffn_tpu(
        x, l, w1, w2, layer=layer, top_k=QWEN["A"], norm_topk_prob=True, token_mask_T=m,
        fused_gather=fused_gather)


def _export_tpu(fn):
    with compile_targets.tpu_target("v6e"):
        return jax.export.export(jax.jit(fn), platforms=["tpu"])(*_qwen_args()).mlir_module()


@pytest.mark.parametrize("fused_gather", [True, False])
def test_tpu_kernels_lower_to_mosaic_with_stacked_weights(fused_gather):
    """Qwen3-30B-A3B expert shapes, default tiling, for a TPU v6e, in a layer loop:
    the gate/up kernel (or its fallback) and the down kernel become two Mosaic custom
    calls per layer that take the stacked weights whole; no layer slice exists."""
    mlir = _export_tpu(_layer_loop(_tpu_moe(fused_gather)))
    assert mlir.count("stablehlo.custom_call @tpu_custom_call") == 2
    assert _weight_slice_problems(mlir, "tpu_custom_call") == []
    # No bias operands without biases (issue 18): grid size, scalar prefetch, rows or
    # ids and x, then gate and up weights; down: grid size, groups, h, weights.
    calls = compile_targets.custom_call_operand_shapes(mlir, "tpu_custom_call")
    assert [len(c) for c in calls] == [7 if fused_gather else 5, 4]


def test_weight_slice_check_catches_a_sliced_layer():
    mlir = _export_tpu(_layer_loop(_tpu_moe(True), slice_first=True))
    assert len(_weight_slice_problems(mlir, "tpu_custom_call")) == 3


@functools.cache
def _gpu_export():
    """StableHLO and the lowered Mosaic GPU modules of the gpu backend in a layer loop
    at Qwen3-30B-A3B expert shapes, default tiling, for an H200."""
    moe_fn = lambda x, l, w1, w2, m, layer: gpu.moe_ffn_gpu(
        x, l, w1, w2, layer=layer, top_k=QWEN["A"], norm_topk_prob=True, token_mask_T=m,
        num_sms=132)
    with compile_targets.mosaic_gpu_modules() as modules:
        exported = compile_targets.export_cuda(_layer_loop(moe_fn), _qwen_args())
    return exported.mlir_module(), modules


def test_gpu_kernels_lower_to_mosaic_gpu_with_stacked_weights():
    """Both kernels go through Mosaic GPU lowering (layout inference, shared-memory
    budget) and take the stacked weights whole; the PTX compile and the run need the
    GPU."""
    mlir, modules = _gpu_export()
    assert mlir.count("custom_call @mosaic_gpu_v2") == 2 and len(modules) == 2
    assert _weight_slice_problems(mlir, "mosaic_gpu_v2") == []
    calls = compile_targets.custom_call_operand_shapes(mlir, "mosaic_gpu_v2")
    assert [len(c) for c in calls] == [5, 5]  # no bias operands without biases


def test_gpu_pipelines_wait_for_wgmma_before_refill():
    """Issue 12, finding 1. With delay_release=1 the pipeline refills, after step s,
    the shared-memory slot that step s-1's WGMMAs read; WGMMAs are asynchronous, so
    the K loop must wait for them first. In both lowered kernels every loop that
    issues WGMMAs has a wgmma.wait_group between its WGMMAs and its TMA refills."""
    _, modules = _gpu_export()
    for module in modules:
        loops, unsafe = compile_targets.wgmma_refill_check(module)
        assert loops > 0 and unsafe == 0


def test_jax_ragged_dot_mgpu_refills_without_waiting():
    """JAX 0.11.2's own ragged_dot_mgpu has the same pipeline without the wait (its K
    loop refills a slot its last WGMMA may still read), so it is no safe fallback. If
    this fails, JAX has fixed it: re-check before using it as one."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    sd = jax.ShapeDtypeStruct
    M, K, N, G = 512, QWEN["D"], 2 * QWEN["F"], QWEN["E"]
    fn = lambda lhs, rhs, sizes: ragged_dot_mgpu.ragged_dot(
        lhs, rhs, group_sizes=sizes, block_m=64, block_n=128, block_k=64,
        max_concurrent_steps=4, grid_block_n=1)
    with compile_targets.mosaic_gpu_modules() as modules:
        compile_targets.export_cuda(fn, (sd((M, K), jnp.bfloat16),
                                         sd((G, K, N), jnp.bfloat16), sd((G,), jnp.int32)))
    [module] = modules
    loops, unsafe = compile_targets.wgmma_refill_check(module)
    assert loops > 0 and unsafe > 0


# ------------------------------------------------------------------------ in the model


@pytest.mark.parametrize("device_kind,platform,want", [
    ("NVIDIA H200", "gpu", "gpu"), ("NVIDIA A100-SXM4-80GB", "gpu", "xla_tiles"),
    ("TPU v6 lite", "tpu", "tpu"), ("cpu", "cpu", "xla_tiles")])
def test_auto_never_picks_a_path_that_reads_every_expert(device_kind, platform, want):
    """"auto" resolves for the target in context (an AOT compile's abstract device), and
    on a GPU it is the Hopper kernel or xla_tiles, never ragged_dot (whose cuda lowering
    carries a dense every-expert fallback)."""
    with compile_targets.pallas_target(device_kind, platform=platform):
        assert moe.resolve_backend("auto") == want


# ------------------------------------------------------------ GPT-OSS experts (issue 18)
# Biases on both projections and the clamped SwiGLU, stacked [L=2, E, ...] weights and
# biases and a traced layer. The weights are large enough that the pre-activations pass
# the clamp limit (checked), so a kernel that skipped the clamp would fail.
OSS_LIMIT, OSS_DEAD = 7.0, 3  # swiglu_limit; an expert no token picks
OSS_TILINGS = {  # backend -> (kernel, keyword arguments)
    "tpu": TPU_TILING,  # gate and up in two 16-wide blocks each
    # tn=None: F (32) is no multiple of 128, so one [gate | up] block (as for GPT-OSS's
    # F = 2880), cut in the epilogue; tk=16 adds the K accumulation.
    "tpu_joint": tpu.TpuTiling(tm=TM, tk=16, down_tk=16, down_tn=16),
    "tpu_gmm": TPU_TILING,
    "gpu": GPU_TILING,
}


@functools.cache
def _oss_case():
    """x, logits, mask and [2, E, ...] weights and biases (numpy: no compile per op)."""
    rng = np.random.default_rng(18)
    T = 16
    x = rng.standard_normal((T, D)).astype(np.float32)
    logits = rng.standard_normal((T, E)).astype(np.float32) * 2
    logits[:, OSS_DEAD] = -30.0
    wgu = (rng.standard_normal((2, E, D, 2 * F)) * 1.1).astype(np.float32)  # |z| ~ 6
    wd = (rng.standard_normal((2, E, F, D)) / np.sqrt(F)).astype(np.float32)
    bgu = (rng.standard_normal((2, E, 2 * F)) * 2).astype(np.float32)
    bd = rng.standard_normal((2, E, D)).astype(np.float32)
    mask = np.arange(T) % 7 != 3
    return x, logits, wgu, wd, bgu, bd, mask


def _oss_kwargs(mask, **kw):
    return dict(top_k=2, norm_topk_prob=True, token_mask_T=jnp.asarray(mask),
                activation=moe.MoEActivation("gpt_oss_clamped", limit=OSS_LIMIT), **kw)


def test_gpt_oss_case_passes_the_clamp():
    """In numpy: the case's routed rows have gate > limit and |up| > limit in both
    layers, and the clamp changes their activations by far more than the tolerance."""
    x, logits, wgu, wd, bgu, bd, mask = _oss_case()
    top = np.argsort(-logits, axis=1)[:, :2][mask]
    tok = np.nonzero(mask)[0][:, None]
    for layer in range(2):
        z = np.einsum("rd,radf->raf", x[tok[:, 0]], wgu[layer][top]) + bgu[layer][top]
        gate, up = z[..., :F], z[..., F:]
        assert (gate > OSS_LIMIT).mean() > 0.05, layer
        assert (np.abs(up) > OSS_LIMIT).mean() > 0.05, layer
        glu = lambda g, u: (u + 1) * g / (1 + np.exp(-1.702 * g))
        h = glu(np.minimum(gate, OSS_LIMIT), np.clip(up, -OSS_LIMIT, OSS_LIMIT))
        assert rel_err(h, glu(gate, up)) > 0.1, layer


def _oss_call(backend, x, logits, wgu, wd, bgu, bd, mask, layer):
    kw = _oss_kwargs(mask, layer=layer, biases=(bgu, bd))
    tiling = OSS_TILINGS[backend]
    if backend == "gpu":
        return gpu.moe_ffn_gpu(x, logits, wgu, wd, **kw, tiling=tiling, num_sms=GPU_SMS,
                               interpret=True)
    return tpu.moe_ffn_tpu(x, logits, wgu, wd, **kw, tiling=tiling,
                           fused_gather=backend != "tpu_gmm", interpret=True)


@pytest.mark.parametrize("backend", list(OSS_TILINGS))
def test_gpt_oss_experts_match_reference(backend):
    """Each layer of the stacked weights, the layer traced (one program for both):
    outputs and stats (biases counted) equal `ref_moe_ffn`'s, padding tokens output 0
    (not a bias), and NaN weights and biases of the expert no token picks stay unread
    (the TPU kernels read a layer's bias rows of all experts and must select, not
    multiply, the tile's)."""
    x, logits, wgu, wd, bgu, bd, mask = map(jnp.asarray, _oss_case())
    poisoned = [a.at[:, OSS_DEAD].set(jnp.nan) for a in (wgu, wd, bgu, bd)]
    run_layer = jax.jit(functools.partial(_oss_call, backend))
    for layer in range(2):
        y, stats = run_layer(x, logits, *poisoned, mask, jnp.int32(layer))
        y_ref, stats_ref = ref_moe_ffn(x, logits, wgu, wd, **_oss_kwargs(
            mask, layer=layer, biases=(bgu, bd)))
        assert rel_err(y, y_ref) < 1e-5, layer
        assert not np.asarray(y)[~np.asarray(mask)].any(), "padding tokens output 0"
        for key in stats_ref:
            np.testing.assert_array_equal(stats[key], stats_ref[key], err_msg=key)


def test_gpt_oss_auto_backend_is_the_kernel():
    """moe_ffn(backend="auto") with biases and the clamped SwiGLU resolves as for Qwen3
    (no longer to xla_tiles): for a TPU v6e it lowers to the two Mosaic TPU kernels, for
    an H200 (bfloat16) to the two Mosaic GPU kernels, default tilings."""
    x, logits, wgu, wd, bgu, bd, mask = (jnp.asarray(a, jnp.bfloat16)
                                         for a in _oss_case())
    kw = _oss_kwargs(mask.astype(bool), layer=0)

    def fn(x, logits, wgu, wd, bgu, bd):
        return moe.moe_ffn(x, logits, wgu, wd, biases=(bgu, bd), **kw)[0]

    args = (x, logits.astype(jnp.float32), wgu, wd, bgu, bd)
    with compile_targets.tpu_target("v6e"):
        mlir = jax.export.export(jax.jit(fn), platforms=["tpu"])(*args).mlir_module()
    assert mlir.count("stablehlo.custom_call @tpu_custom_call") == 2
    mlir = compile_targets.export_cuda(fn, args).mlir_module()
    assert mlir.count("custom_call @mosaic_gpu_v2") == 2


# GPT-OSS-20B's experts: hidden 2880, 32 experts, top-4, width 2880, bfloat16. Neither
# 2880 is a multiple of 128: the gate/up kernel takes whole [gate | up] rows (tn = F, see
# tpu._gate_up_blocks), the down kernel whole F x D blocks (_pick_block finds no
# 128-multiple divisor), the GPU kernel 64-wide blocks (_fit_block halves 128 / 256).
OSS20B = dict(T=64, D=2880, F=2880, E=32, A=4, L=2)


def _oss20b_args():
    sd = jax.ShapeDtypeStruct
    T, D_, F_, E_, L_ = (OSS20B[k] for k in "TDFEL")
    return (sd((T, D_), jnp.bfloat16), sd((T, E_), jnp.float32),
            sd((L_, E_, D_, 2 * F_), jnp.bfloat16), sd((L_, E_, F_, D_), jnp.bfloat16),
            sd((L_, E_, 2 * F_), jnp.bfloat16), sd((L_, E_, D_), jnp.bfloat16),
            sd((), jnp.int32))


def _oss20b_moe(kernel, **kw):
    return lambda x, logits, wgu, wd, bgu, bd, layer: kernel(
        x, logits, wgu, wd, layer=layer, top_k=OSS20B["A"], norm_topk_prob=True,
        biases=(bgu, bd), activation=moe.MoEActivation("gpt_oss_clamped"), **kw)


def _hlo_roots(hlo: str, target: str) -> list[list[tuple[str, str]]]:
    """(opcode, type) of what each operand of each `target` custom call comes from, in
    compiled HLO text, following bitcasts and copy-start / copy-done (XLA moving a whole
    array to another memory space: same shape, not a slice)."""
    pattern = r"^\s*(?:ROOT )?%([\w.\-]+) = (\(.*?\)|\S+?\[[\d,]*\])\S* ([\w\-]+)\((.*?)\)"
    insts = {m.group(1): (re.sub(r"\{.*", "", m.group(2)), m.group(3),
                          re.findall(r"%([\w.\-]+)", m.group(4)))
             for m in re.finditer(pattern, hlo, re.M)}
    calls = []
    for name, (_, opcode, operands) in insts.items():
        if opcode != "custom-call" or not re.search(
                rf'%{re.escape(name)} = .*custom_call_target="{target}"', hlo):
            continue
        roots = []
        for op in operands:
            while insts[op][1] in ("bitcast", "copy-done", "copy-start"):
                op = insts[op][2][0]
            roots.append((insts[op][1], insts[op][0]))
        calls.append(roots)
    return calls


@pytest.mark.skipif(not compile_targets.libtpu_available(),
                    reason=f"libtpu is not importable: {compile_targets.LIBTPU_HINT}")
def test_gpt_oss_20b_tpu_kernels_compile_with_stacked_weights_and_biases():
    """The real TPU compiler (v6e) at GPT-OSS-20B expert shapes, stacked [2, E, ...]
    weights and biases, traced layer: each Mosaic call takes its weight and its bias as
    the stacked parameters themselves (no slice, no copy of a layer), and temporaries
    stay below one layer's experts."""
    L_, E_, D_, F_ = (OSS20B[k] for k in "LEDF")
    compiled = compile_targets.compile_tpu(_oss20b_moe(tpu.moe_ffn_tpu), _oss20b_args(),
                                           topology="v6e:2x2", mesh_shape=(1,))
    calls = _hlo_roots(compiled.as_text(), "tpu_custom_call")
    params = [sorted(t for op, t in roots if op == "parameter" and t.startswith("bf16"))
              for roots in calls]
    assert sorted(params) == sorted([
        sorted([f"bf16[{L_},{E_},{D_},{2 * F_}]", f"bf16[{L_},{E_},{2 * F_}]"]),  # gate/up
        sorted([f"bf16[{L_},{E_},{F_},{D_}]", f"bf16[{L_},{E_},{D_}]"]),  # down
    ]), calls
    one_layer = {(E_, D_, 2 * F_), (E_, F_, D_), (E_, 2 * F_), (E_, D_)}
    assert not one_layer & _result_dims(compiled.as_text())
    assert compiled.memory_analysis().temp_size_in_bytes < E_ * D_ * 2 * F_ * 2


def test_gpt_oss_20b_gpu_kernels_export_for_cuda():
    """The Hopper kernels with biases through Mosaic GPU lowering (layout inference of
    the bias broadcast, the shared-memory budget) for an H200 at GPT-OSS-20B expert
    shapes: two calls, each taking its stacked weight and stacked bias whole (as free
    [L*E, ...] views), and WGMMA-safe pipelines."""
    L_, E_, D_, F_ = (OSS20B[k] for k in "LEDF")
    with compile_targets.mosaic_gpu_modules() as modules:
        exported = compile_targets.export_cuda(
            _oss20b_moe(gpu.moe_ffn_gpu, num_sms=132), _oss20b_args())
    calls = compile_targets.custom_call_operand_shapes(exported.mlir_module(), "mosaic_gpu_v2")
    G = L_ * E_
    assert [c[-2:] for c in calls] == [[(G, D_, 2 * F_), (G, 2 * F_)], [(G, F_, D_), (G, D_)]]
    assert len(modules) == 2
    for module in modules:
        loops, unsafe = compile_targets.wgmma_refill_check(module)
        assert loops > 0 and unsafe == 0
