"""Expert-parallel MoE dispatch (lp_jax.models.expert_dispatch) on 8 simulated CPU devices.

* all_to_all, with the CPU transport (capacity rounds) and with the ragged one on
  `ref_ragged_all_to_all`, gives the allreduce path's and the single-device moe_ffn's
  outputs and stats: stacked [L, E, ...] weights, a traced layer, a token mask, token
  counts that ep does and does not divide, and all tokens routed to the first experts
  (the capacity transport then needs several rounds).
* `ref_ragged_all_to_all` against a numpy model of `lax.ragged_all_to_all`.
* Every MoE backend runs under all_to_all (xla_tiles; tpu, the Pallas kernel interpreted).
* GPT-OSS experts (biases, clamped SwiGLU) under all_to_all and allreduce equal the
  single-device moe_ffn (xla; tpu interpreted).
* The all_to_all program moves tokens by all-to-all, with no all-reduce of [T, D];
  "auto" runs what `roofline.ep_comm.choose_dispatch` picks.
* With libtpu: the ragged transport compiles for a v6e slice.
* The engine on a (2, 4) mesh with moe_dispatch="all_to_all" gives the single-device
  greedy tokens (Hugging Face's golden ones, which tests/test_golden_parity.py checks
  the single-device model gives), through a chunked prefill, and its program holds
  the MoE's all-to-alls.

The MoE runs on the "xla" reference backend unless said otherwise (the engine: "auto",
xla_tiles on CPU); XLA:CPU compile time, not the kernels, sets this file's pace.
"""

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from lp_jax import LLM, SamplingParams
from lp_jax.models.expert_dispatch import ref_ragged_all_to_all
from lp_jax.models.sharded_kernels import kernel_mesh, resolve_moe_dispatch, sharded_moe_ffn
from lp_jax.roofline.ep_comm import choose_dispatch
from lp_jax.sharding import make_mesh, named_sharding
from pallas_kernels import compile_targets
from pallas_kernels.moe import MoEActivation, moe_ffn

L, D, E, F, A = 2, 32, 8, 16, 2
LAYER = 1
W_AXES = (("layers", "experts", "embed", "expert_mlp"),
          ("layers", "experts", "expert_mlp", "embed"))
# XLA:CPU compile time sets this file's pace; these programs need no optimisation.
FAST_COMPILE = {"xla_backend_optimization_level": 0}
SCHEMES = {  # name -> sharded_moe_ffn arguments
    "allreduce": dict(dispatch="allreduce"),
    "capacity": dict(dispatch="all_to_all", _transport="capacity"),
    "ref_ragged": dict(dispatch="all_to_all", _transport="ref_ragged"),
}


def _weights():
    rng = np.random.default_rng(0)  # numpy: eager jax.random costs a compile per op
    return (jnp.asarray(rng.normal(size=(L, E, D, 2 * F)) * 0.2, jnp.float32),
            jnp.asarray(rng.normal(size=(L, E, F, D)) * 0.2, jnp.float32))


def _tokens(T, hot: bool, seed: int, dtype=jnp.float32):
    """x_TD, logits_TE and a mask dropping about a quarter of the tokens (never all).
    hot: every token's top-A experts are experts 0..A-1 (the first shard's, or with one
    expert per shard the first A shards')."""
    rng = np.random.default_rng(seed + 1)
    logits_TE = rng.normal(size=(T, E))
    if hot:
        logits_TE[:, :A] += 10.0
    mask_T = rng.uniform(size=T) > 0.25
    mask_T[0] = True
    return (jnp.asarray(rng.normal(size=(T, D)), dtype), jnp.asarray(logits_TE, jnp.float32),
            jnp.asarray(mask_T))


def _sharded_weights(mesh):
    return tuple(jax.device_put(w, named_sharding(axes, w.shape, mesh))
                 for w, axes in zip(_weights(), W_AXES, strict=True))


def _capacity_rounds(logits_TE, mask_T, ep, capacity_factor):
    """Rounds the capacity transport runs: the longest (source, owner) run / C."""
    T = logits_TE.shape[0]
    t = -(-T // ep)
    C = max(1, math.ceil(capacity_factor * t * A / ep))
    top_TA = np.argsort(-np.asarray(logits_TE), axis=1)[:, :A]
    owner_TA = np.where(np.asarray(mask_T)[:, None], top_TA // (E // ep), -1)
    owner_TA = np.pad(owner_TA, ((0, t * ep - T), (0, 0)), constant_values=-1)
    worst = max(np.sum(owner_TA[s * t:(s + 1) * t] == o) for s in range(ep) for o in range(ep))
    return -(-worst // C)


# (data, expert, tensor) -> (T, hot) cases; every mesh gets a hot case and an uneven T.
MESH_CASES = {
    (1, 8, 1): [(1, False), (3, False), (37, False), (64, True)],
    (1, 2, 4): [(8, False), (37, True)],
    (1, 4, 2): [(64, False), (37, True)],
}


@pytest.mark.parametrize("mesh_shape", list(MESH_CASES), ids=lambda s: "x".join(map(str, s)))
def test_all_to_all_matches_allreduce_and_single_device(mesh_shape):
    mesh = make_mesh(*mesh_shape)
    ep = mesh.shape["expert"]
    cases = [_tokens(T, hot, seed) for seed, (T, hot) in enumerate(MESH_CASES[mesh_shape])]
    kw = dict(top_k=A, norm_topk_prob=True, backend="xla")
    w_gate_up, w_down = _weights()
    want = jax.jit(lambda cases: [
        moe_ffn(x, lg, w_gate_up[LAYER], w_down[LAYER], token_mask_T=m, **kw)
        for x, lg, m in cases])(cases)
    # The hot case also runs with a small capacity: several rounds on every mesh.
    small = 0.25
    hot = next(i for i, (_, h) in enumerate(MESH_CASES[mesh_shape]) if h)
    assert _capacity_rounds(cases[hot][1], cases[hot][2], ep, small) > 1

    def run(cases, w_gate_up, w_down, layer):
        out = {}
        for name, scheme in SCHEMES.items():
            out[name] = [sharded_moe_ffn(kernel_mesh(w_gate_up), x, lg, w_gate_up, w_down,
                                         layer=layer, token_mask_T=m, **scheme, **kw)
                         for x, lg, m in cases]
        x, lg, m = cases[hot]
        out["capacity_small"] = {hot: sharded_moe_ffn(
            kernel_mesh(w_gate_up), x, lg, w_gate_up, w_down, layer=layer, token_mask_T=m,
            capacity_factor=small, **SCHEMES["capacity"], **kw)}
        return out

    args = (cases, *_sharded_weights(mesh), jnp.int32(LAYER))
    got = jax.jit(run).lower(*args).compile(FAST_COMPILE)(*args)
    for name, results in got.items():
        items = results.items() if isinstance(results, dict) else enumerate(results)
        for i, (y, stats) in items:
            where = f"{name}, T={cases[i][0].shape[0]}"
            np.testing.assert_allclose(y, want[i][0], rtol=1e-5, atol=1e-6, err_msg=where)
            assert set(stats) == set(want[i][1])
            for stat in stats:
                np.testing.assert_array_equal(stats[stat], want[i][1][stat],
                                              err_msg=f"{where}: {stat}")


@pytest.mark.parametrize("backend", ["xla_tiles", "tpu"])  # tpu: the Pallas kernel, interpreted
def test_all_to_all_runs_every_moe_backend(backend):
    mesh = make_mesh(expert=4, tensor=2)
    x_TD, logits_TE, mask_T = _tokens(13, hot=False, seed=7)
    w_gate_up, w_down = _weights()
    kw = dict(top_k=A, norm_topk_prob=True, token_mask_T=mask_T)
    want_y, want_stats = moe_ffn(x_TD, logits_TE, w_gate_up[LAYER], w_down[LAYER],
                                 backend="xla", **kw)
    args = (x_TD, logits_TE, *_sharded_weights(mesh), jnp.int32(LAYER))
    fn = lambda x, lg, wg, wd, layer: sharded_moe_ffn(
        kernel_mesh(wg), x, lg, wg, wd, layer=layer, backend=backend, interpret=True, **kw,
        **SCHEMES["capacity"])
    y, stats = jax.jit(fn).lower(*args).compile(FAST_COMPILE)(*args)
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-6)
    for stat in want_stats:
        np.testing.assert_array_equal(stats[stat], want_stats[stat], err_msg=stat)


def _gpt_oss_experts(mesh):
    """Stacked [L, E, ...] weights and GPT-OSS biases, sharded as the model shards them
    (experts over "expert") when a mesh is given."""
    rng = np.random.default_rng(18)
    b_gate_up = jnp.asarray(rng.normal(size=(L, E, 2 * F)), jnp.float32)
    b_down = jnp.asarray(rng.normal(size=(L, E, D)) * 0.5, jnp.float32)
    arrays = (*_weights(), b_gate_up, b_down)
    if mesh is None:
        return arrays
    axes = (*W_AXES, ("layers", "experts", "expert_mlp"), ("layers", "experts", "embed"))
    return tuple(jax.device_put(a, named_sharding(ax, a.shape, mesh))
                 for a, ax in zip(arrays, axes, strict=True))


GPT_OSS_ACT = MoEActivation("gpt_oss_clamped", limit=0.5, alpha=1.702)


@pytest.mark.parametrize("backend", ["xla", "tpu"])  # tpu: the Pallas kernel, interpreted
def test_gpt_oss_experts_under_all_to_all(backend):
    """GPT-OSS-shaped experts (biases on both projections, the clamped SwiGLU at a limit
    the rows pass) split over 4 expert shards: all_to_all (both transports) and
    allreduce give the single-device moe_ffn's outputs and stats (biases counted), with a
    traced layer of stacked weights and biases."""
    mesh = make_mesh(expert=4, tensor=2)
    x_TD, logits_TE, mask_T = _tokens(13, hot=False, seed=18)
    wg, wd, bg, bd = _gpt_oss_experts(None)
    kw = dict(top_k=A, norm_topk_prob=True, token_mask_T=mask_T, activation=GPT_OSS_ACT)
    want_y, want_stats = moe_ffn(x_TD, logits_TE, wg, wd, layer=LAYER, backend="xla",
                                 biases=(bg, bd), **kw)
    unclamped = dataclasses.replace(GPT_OSS_ACT, limit=1e9)
    free_y, _ = moe_ffn(x_TD, logits_TE, wg, wd, layer=LAYER, backend="xla",
                        biases=(bg, bd), **{**kw, "activation": unclamped})
    assert np.linalg.norm(free_y - want_y) > 0.1 * np.linalg.norm(want_y)  # clamped
    schemes = SCHEMES if backend == "xla" else {"capacity": SCHEMES["capacity"]}

    def run(x, lg, wg, wd, bg, bd, layer):
        return {name: sharded_moe_ffn(kernel_mesh(wg), x, lg, wg, wd, layer=layer,
                                      backend=backend, interpret=True, biases=(bg, bd),
                                      **kw, **scheme)
                for name, scheme in schemes.items()}

    args = (x_TD, logits_TE, *_gpt_oss_experts(mesh), jnp.int32(LAYER))
    got = jax.jit(run).lower(*args).compile(FAST_COMPILE)(*args)
    for name, (y, stats) in got.items():
        np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-5, err_msg=name)
        for stat in want_stats:
            np.testing.assert_array_equal(stats[stat], want_stats[stat], err_msg=stat)


# ------------------------------------------------------------ ref_ragged_all_to_all
def _np_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets):
    """lax.ragged_all_to_all's docstring, per device (lists over the axis): sender s's
    slice i goes to device i // k at its output_offsets[i]."""
    ep, N = len(operand), len(input_offsets[0])
    k = N // ep
    result = [o.copy() for o in output]
    for s in range(ep):
        for i in range(N):
            rows = operand[s][input_offsets[s][i]:input_offsets[s][i] + send_sizes[s][i]]
            result[i // k][output_offsets[s][i]:output_offsets[s][i] + len(rows)] = rows
    return result


@pytest.mark.parametrize("k", [1, 2])  # slices per destination
def test_ref_ragged_all_to_all_matches_numpy(k):
    ep, M, O = 4, 16, 24  # devices, operand rows, output rows
    rng = np.random.default_rng(k)
    N = ep * k
    send = rng.integers(0, 3, (ep, N))
    input_offsets = np.zeros((ep, N), np.int64)
    for s in range(ep):  # slices in a random order, with gaps
        pos = 0
        for i in rng.permutation(N):
            pos += rng.integers(0, 2)
            input_offsets[s, i], pos = pos, pos + send[s, i]
    output_offsets = np.zeros((ep, N), np.int64)
    recv = np.zeros((ep, N), np.int64)
    for d in range(ep):  # each receiver lays out what it gets, with gaps
        pos = 0
        for s in range(ep):
            for c in range(k):
                pos += rng.integers(0, 2)
                output_offsets[s, d * k + c], recv[d, s * k + c] = pos, send[s, d * k + c]
                pos += send[s, d * k + c]
    assert input_offsets.max() + 3 <= M and output_offsets.max() + 3 <= O
    operand = rng.normal(size=(ep, M, 3)).astype(np.float32)
    output = rng.normal(size=(ep, O, 3)).astype(np.float32)  # rows not written are kept
    want = _np_ragged_all_to_all(operand, output, input_offsets, send, output_offsets)

    mesh = Mesh(np.asarray(jax.devices()[:ep]), ("x",))
    flat = lambda a: jnp.asarray(a.reshape(ep * a.shape[1], *a.shape[2:]), a.dtype)
    i32 = lambda a: jnp.asarray(a.reshape(-1), jnp.int32)
    got = jax.jit(jax.shard_map(
        lambda *a: ref_ragged_all_to_all(*a, axis_name="x"), mesh=mesh,
        in_specs=P("x"), out_specs=P("x"), check_vma=False,
    ))(flat(operand), flat(output), i32(input_offsets), i32(send), i32(output_offsets),
       i32(recv))
    np.testing.assert_array_equal(np.asarray(got).reshape(ep, O, 3), np.stack(want))


# ------------------------------------------------------------ programs and "auto"
def _collective_shapes(hlo: str, op: str) -> list[str]:
    """Result shapes ("f32[40,32]") of every `op` collective in compiled HLO text (the
    first element's, for a tuple result)."""
    return re.findall(rf"= \(?(\w+\[[\d,]*\])[^=\n]*? {op}(?:-start)?\(", hlo)


EXPERT_GROUPS = ("{'expert'}", "{'tensor'}", "{'expert','tensor'}")  # the experts' axes


def _moe_all_to_alls(hlo: str) -> list[str]:
    """The all-to-alls over the experts' mesh axes that the program asked for (GSPMD
    adds its own to reshard, e.g. around attention's head split; it marks those)."""
    return [line for line in hlo.splitlines() if " all-to-all(" in line
            and any(g in line for g in EXPERT_GROUPS)
            and 'is_spmd_generated="true"' not in line]


def _program(mesh, T, top_k=A, **scheme):
    x_TD, logits_TE, mask_T = _tokens(T, hot=False, seed=0)
    fn = lambda x, lg, wg, wd, layer: sharded_moe_ffn(
        kernel_mesh(wg), x, lg, wg, wd, layer=layer, top_k=top_k, norm_topk_prob=True,
        backend="xla", token_mask_T=mask_T, **scheme)
    return jax.jit(fn).lower(x_TD, logits_TE, *_sharded_weights(mesh), jnp.int32(LAYER))


def test_all_to_all_program_sends_rows_not_an_all_reduce_of_tokens():
    mesh = make_mesh(expert=4, tensor=2)
    T = 37  # padded to 40 = 4 x 10
    a2a = _program(mesh, T, **SCHEMES["capacity"]).compile(FAST_COMPILE).as_text()
    allreduce = _program(mesh, T, **SCHEMES["allreduce"]).compile(FAST_COMPILE).as_text()
    tokens = {f"f32[{n},{D}]" for n in (T, 40)}
    assert tokens & set(_collective_shapes(allreduce, "all-reduce"))  # the check can fail
    assert _moe_all_to_alls(a2a) and not _moe_all_to_alls(allreduce)
    assert not tokens & set(_collective_shapes(a2a, "all-reduce"))
    assert set(_collective_shapes(a2a, "all-reduce")) <= {"s32[]"}  # at most a count
    assert f"f32[40,{D}]" in _collective_shapes(a2a, "all-gather")


# (T, top_k): in float32 on 8 shards the capacity transport's bytes beat the all-reduce's
# only at top_k = 1 and many tokens (roofline/ep_comm.py).
AUTO_CASES = [(1, 2), (64, 2), (1, 1), (512, 1)]


@pytest.mark.parametrize("T,top_k", AUTO_CASES)
def test_auto_runs_what_ep_comm_chooses(T, top_k):
    mesh = make_mesh(expert=8)
    w_gate_up = _sharded_weights(mesh)[0]
    x_TD = jnp.zeros((T, D), jnp.bfloat16)
    for transport in ("capacity", "ragged"):
        want = choose_dispatch(T, D, top_k, 8, act_bytes=2, transport=transport)
        assert resolve_moe_dispatch(mesh, "auto", x_TD, w_gate_up, top_k, transport) == want
    # On CPU the capacity transport runs; the program does what ep_comm chooses.
    want = choose_dispatch(T, D, top_k, 8, act_bytes=4, transport="capacity")
    text = _program(mesh, T, dispatch="auto", top_k=top_k).as_text()
    assert ("all_to_all" in text) == (want == "all_to_all"), want
    # The tensor axis carries expert parallelism too (attention's chips hold experts).
    assert resolve_moe_dispatch(make_mesh(tensor=8), "auto", x_TD, w_gate_up, top_k) == (
        resolve_moe_dispatch(mesh, "auto", x_TD, w_gate_up, top_k))
    # So does the data axis (data-parallel attention: EP = DP x TP).
    assert resolve_moe_dispatch(make_mesh(data=8), "auto", x_TD, w_gate_up, top_k) == (
        resolve_moe_dispatch(mesh, "auto", x_TD, w_gate_up, top_k))
    # ep == 1 (the axes do not divide E = 8): no dispatch.
    no_ep = make_mesh(expert=3)
    assert resolve_moe_dispatch(no_ep, "auto", x_TD, w_gate_up, top_k) == "allreduce"
    assert resolve_moe_dispatch(no_ep, "all_to_all", x_TD, w_gate_up, top_k) == "allreduce"


def test_auto_cases_see_both_schemes():
    picks = {choose_dispatch(T, D, k, 8, act_bytes=4, transport="capacity")
             for T, k in AUTO_CASES}
    assert picks == {"allreduce", "all_to_all"}


@pytest.mark.skipif(not compile_targets.libtpu_available(), reason=compile_targets.LIBTPU_HINT)
def test_ragged_all_to_all_compiles_for_tpu():
    """The GPU/TPU transport through the real TPU compiler (libtpu, compile-only v6e
    devices): the mesh's platform picks "ragged"; the rows move by ragged-all-to-all."""
    T, D_, E_, A_, F_ = 64, 256, 16, 4, 128
    sd = jax.ShapeDtypeStruct
    args = (sd((T, D_), jnp.bfloat16), sd((T, E_), jnp.float32),
            sd((L, E_, D_, 2 * F_), jnp.bfloat16), sd((L, E_, F_, D_), jnp.bfloat16),
            sd((), jnp.int32))
    fn = lambda x, lg, wg, wd, layer: sharded_moe_ffn(
        kernel_mesh(wg), x, lg, wg, wd, layer=layer, top_k=A_, norm_topk_prob=True,
        backend="xla", dispatch="all_to_all")
    w_spec = P(None, "expert", None, None)
    hlo = compile_targets.compile_tpu(
        fn, args, topology="v6e:2x2", mesh_shape=(1, 4, 1),
        axis_names=("data", "expert", "tensor"),
        in_specs=(P(), P(), w_spec, w_spec, P())).as_text()
    assert _collective_shapes(hlo, "ragged-all-to-all")
    assert set(_collective_shapes(hlo, "all-reduce")) <= {"s32[]"}
    assert f"bf16[{T},{D_}]" in _collective_shapes(hlo, "all-gather")


# ---------------------------------------------------------------------- engine
NEW_TOKENS = 3


def test_engine_all_to_all_matches_single_device(tiny_dir):
    """Golden prompts 0 and 1 (5 and 17 tokens) under a 16-token budget: the second is
    prefilled in two chunks, the second chunk beside the first prompt's decode. One row
    bucket, so one program (~13 s of XLA:CPU compile on this mesh) serves every step."""
    golden = np.load("tests/golden/tiny.npz")
    prompts = [golden[f"prompt_{i}"].tolist() for i in range(2)]
    llm = LLM(str(tiny_dir), mesh_shape=(2, 4), moe_dispatch="all_to_all", scheduling="chunked",
              max_num_seqs=2, max_model_len=32, max_num_batched_tokens=16,
              token_buckets=(16,), kv_pages=8, warmup=False, log=None)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(
        temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    want = [golden[f"greedy_{i}"][:NEW_TOKENS].tolist() for i in range(2)]
    assert [o.token_ids for o in outputs] == want
    assert set(llm.engine.runner.programs) == {16}
    for program in llm.engine.runner.programs.values():  # the MoE really went all-to-all
        assert _moe_all_to_alls(program.as_text())


# ------------------------------------------------------- the row-split residual stream
@pytest.mark.parametrize("scheme", ["allreduce", "capacity"])
def test_scatter_rows_leaves_each_shard_its_rows(scheme):
    """scatter_rows (the row-split residual stream, models/sequence_parallel.py): the
    output is the replicated call's, split by rows over the experts' axis, and the
    allreduce scheme reduce-scatters where it would all-reduce, the all_to_all scheme
    skips its all_gather of the outputs."""
    mesh = make_mesh(tensor=4)
    T = 16
    x_TD, logits_TE, mask_T = _tokens(T, hot=False, seed=3)
    kw = dict(top_k=A, norm_topk_prob=True, backend="xla", **SCHEMES[scheme])

    def both(x, lg, wg, wd, layer):
        return [sharded_moe_ffn(kernel_mesh(wg), x, lg, wg, wd, layer=layer,
                                token_mask_T=mask_T, scatter_rows=rows, **kw)[0]
                for rows in (False, True)]

    args = (x_TD, logits_TE, *_sharded_weights(mesh), jnp.int32(LAYER))
    compiled = jax.jit(both).lower(*args).compile(FAST_COMPILE)
    whole, rows = compiled(*args)
    np.testing.assert_allclose(rows, whole, rtol=1e-6, atol=1e-6)
    assert rows.sharding.spec == P("tensor") and whole.sharding.is_fully_replicated
    hlo = compiled.as_text()
    outputs = {f"f32[{n},{D}]" for n in (T, T // 4)}
    if scheme == "allreduce":
        assert f"f32[{T // 4},{D}]" in _collective_shapes(hlo, "reduce-scatter")
        assert f"f32[{T},{D}]" in _collective_shapes(hlo, "all-reduce")  # the replicated one
    else:  # one all_gather of the outputs: the replicated call's
        assert [s for s in _collective_shapes(hlo, "all-gather") if s in outputs] == [
            f"f32[{T},{D}]"]
