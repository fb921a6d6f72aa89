"""The compiled-program roofline's byte and class rules on small hand-written HLO.

XLA:TPU nests the dynamic-slice of a stacked [L, ...] layer weight in a fusion of its
own inside the fusion of the dot that uses it. The Qwen3-30B-A3B programs showed it:
charging the whole operand made every dense matmul in the layer loop read all 48 layers
(a step predicted at 9-16x the formula). The rules here run without libtpu.
"""

import dataclasses
import types

from lp_jax.roofline import hlo
from lp_jax.roofline.compiled import Walker
from lp_jax.roofline.hardware import get_hardware

L, D, N, T = 48, 64, 32, 8

NESTED = f"""HloModule nested

%slice_layer (p0: bf16[{L},{D},{N}], p1: s32[]) -> bf16[{D},{N}] {{
  %p0 = bf16[{L},{D},{N}]{{2,1,0}} parameter(0)
  %p1 = s32[] parameter(1)
  %c = s32[] constant(0)
  %ds = bf16[1,{D},{N}]{{2,1,0}} dynamic-slice(%p0, %p1, %c, %c), dynamic_slice_sizes={{1,{D},{N}}}
  ROOT %b = bf16[{D},{N}]{{1,0}} bitcast(%ds)
}}

%dot_fusion (q0: bf16[{T},{D}], q1: bf16[{L},{D},{N}], q2: s32[]) -> f32[{T},{N}] {{
  %q0 = bf16[{T},{D}]{{1,0}} parameter(0)
  %q1 = bf16[{L},{D},{N}]{{2,1,0}} parameter(1)
  %q2 = s32[] parameter(2)
  %w = bf16[{D},{N}]{{1,0}} fusion(%q1, %q2), kind=kLoop, calls=%slice_layer
  ROOT %d = f32[{T},{N}]{{1,0}} dot(%q0, %w), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}

%whole_fusion (r0: bf16[{L},{D},{N}]) -> bf16[{L},{D},{N}] {{
  %r0 = bf16[{L},{D},{N}]{{2,1,0}} parameter(0)
  ROOT %n = bf16[{L},{D},{N}]{{2,1,0}} negate(%r0)
}}

%matvec (s0: f32[{D}], s1: f32[{D},{N}]) -> f32[{N}] {{
  %s0 = f32[{D}]{{0}} parameter(0)
  %s1 = f32[{D},{N}]{{1,0}} parameter(1)
  %bc = f32[{D},{N}]{{1,0}} broadcast(%s0), dimensions={{0}}
  %m = f32[{D},{N}]{{1,0}} multiply(%bc, %s1)
  %z = f32[] constant(0)
  ROOT %r = f32[{N}]{{0}} reduce(%m, %z), dimensions={{0}}, to_apply=%sum
}}

%sum (a: f32[], b: f32[]) -> f32[] {{
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}}

ENTRY %main (x: bf16[{T},{D}], w: bf16[{L},{D},{N}]) -> f32[{T},{N}] {{
  %x = bf16[{T},{D}]{{1,0}} parameter(0)
  %w = bf16[{L},{D},{N}]{{2,1,0}} parameter(1)
  %l = s32[] parameter(2)
  %v = f32[{D}]{{0}} parameter(3)
  %m = f32[{D},{N}]{{1,0}} parameter(4)
  %whole = bf16[{L},{D},{N}]{{2,1,0}} fusion(%w), kind=kLoop, calls=%whole_fusion
  %mv = f32[{N}]{{0}} fusion(%v, %m), kind=kLoop, calls=%matvec
  ROOT %f = f32[{T},{N}]{{1,0}} fusion(%x, %w, %l), kind=kOutput, calls=%dot_fusion
}}
"""


def _walker():
    module = hlo.parse(NESTED)
    p = types.SimpleNamespace(shape=types.SimpleNamespace(vocab_size=1000), tp=1)
    return module, Walker(module, p, get_hardware("TPU v6e"), 0.6, 0.8)


def test_a_stacked_weight_sliced_in_a_nested_fusion_moves_one_layer():
    module, walker = _walker()
    entry = module.computations[module.entry]
    moved = walker._fusion_bytes(entry, entry.instrs["f"])
    one_layer = D * N * 2
    want = T * D * 2 + one_layer + 4 + T * N * 4  # x, the slice, the index, the output
    assert moved == want, (moved, want, L * one_layer)


def test_a_fusion_that_reads_the_whole_stack_is_charged_the_whole_stack():
    module, walker = _walker()
    entry = module.computations[module.entry]
    assert walker._fusion_bytes(entry, entry.instrs["whole"]) == 2 * L * D * N * 2


def test_a_multiply_reduce_matvec_counts_as_a_matmul():
    module, walker = _walker()
    entry = module.computations[module.entry]
    flops, has_dot = walker._flops(entry, entry.instrs["mv"])
    assert has_dot and flops >= D * N
    flops, has_dot = walker._flops(entry, entry.instrs["whole"])
    assert not has_dot


def test_mosaic_gpu_calls_in_optimized_hlo_are_costed_as_the_moe_kernels():
    """XLA:GPU's optimized HLO names Mosaic GPU calls "mosaic_gpu_v2" (StableHLO says
    "mosaic_gpu"); unrecognised, the H200 programs charged each call the whole expert
    stack as an ordinary op (58 GB per layer)."""
    from lp_jax.roofline.compiled import PALLAS_TARGETS, kernel_name
    from pallas_kernels import cost

    line = ('  %mpmd_map.2 = bf16[512,768]{1,0} custom-call(%a, %b, %c, %x, %w), '
            'custom_call_target="mosaic_gpu_v2", operand_layout_constraints={s32[64]{0}, '
            's32[64]{0}, s32[1]{0}, bf16[576,2048]{1,0}, bf16[6144,2048,1536]{2,1,0}}')
    ins = hlo._parse_instr(line)
    assert ins.attr("custom_call_target") in PALLAS_TARGETS
    p = types.SimpleNamespace(shape=types.SimpleNamespace(expert_width=768), tp=1)
    assert kernel_name(ins, p) == cost.GPU_MOE_GATE_UP
    down = line.replace("bf16[6144,2048,1536]", "bf16[6144,768,2048]")
    assert kernel_name(hlo._parse_instr(down), p) == cost.GPU_MOE_DOWN


X, V, U = 32, 4096, 8  # count rows, vocabulary, scattered tokens
DIMS = ("update_window_dims={}, inserted_window_dims={0,1}, "
        "scatter_dims_to_operand_dims={0,1}, index_vector_dim=1")
BUF, IDX, UPD = f"s32[{X},{V}]{{1,0}}", f"s32[{U},2]{{1,0}}", f"s32[{U}]{{0}}"
SPARSECORE = f"""HloModule sparsecore

%add (a: s32[], b: s32[]) -> s32[] {{
  %a = s32[] parameter(0)
  %b = s32[] parameter(1)
  ROOT %s = s32[] add(%a, %b)
}}

%scatter_fusion (p0: s32[{X},{V}], p1: s32[{U},2], p2: s32[{U}]) -> s32[{X},{V}] {{
  %p0 = s32[{X},{V}]{{1,0}} parameter(0)
  %p1 = s32[{U},2]{{1,0}} parameter(1)
  %p2 = s32[{U}]{{0}} parameter(2)
  ROOT %sc = {BUF} scatter(%p0, %p1, %p2), {DIMS}, to_apply=%add
}}

%offloaded (q0: s32[{X},{V}], q1: s32[{U},2], q2: s32[{U}]) -> s32[{X},{V}] {{
  %q0 = s32[{X},{V}]{{1,0}} parameter(0)
  %q1 = s32[{U},2]{{1,0}} parameter(1)
  %q2 = s32[{U}]{{0}} parameter(2)
  ROOT %f = s32[{X},{V}]{{1,0}} fusion(%q0, %q1, %q2), kind=kCustom, calls=%scatter_fusion
}}

ENTRY %main (c: s32[{X},{V}], i: s32[{U},2], u: s32[{U}]) -> s32[{X},{V}] {{
  %c = s32[{X},{V}]{{1,0}} parameter(0)
  %i = s32[{U},2]{{1,0}} parameter(1)
  %u = s32[{U}]{{0}} parameter(2)
  %start = ((), (), s32[]) call-start(), async_execution_thread="sparsecore", to_apply=%offloaded
  %update = (({BUF}, {IDX}, {UPD}), {BUF}) call-update(%start, %c, %i, %u)
  ROOT %done = s32[{X},{V}]{{1,0}} call-done(%update)
}}
"""


def test_an_offloaded_scatter_moves_its_updates_not_the_buffer():
    """XLA:TPU runs the counts' scatter-add on the SparseCore as call-start / call-update /
    call-done around the scatter's computation: the scatter is costed there (in place, its
    updates), and the wrappers move nothing of their own. Charged as ordinary ops, the
    wrappers cost the whole [X, V] buffer three times over."""
    module = hlo.parse(SPARSECORE)
    p = types.SimpleNamespace(shape=types.SimpleNamespace(vocab_size=V), tp=1)
    walker = Walker(module, p, get_hardware("TPU v6e"), 0.6, 0.8)
    ops = walker.walk(module.computations[module.entry], {}, top=True)
    moved = sum(op.bytes for op in ops)
    assert 0 < moved <= 2 * U * 4 + U * 2 * 4, moved  # the updates twice, the indices


def test_layer_kinds_and_known_trip_counts_on_a_compiled_program():
    """A layer loop whose body picks the MLP by the layer index, as DeepSeek-V3's first
    dense layers do (`_moe` or the dense `_swiglu`), compiled by XLA:CPU: each kind is
    costed on its own branch, and a `lax.map` inside the MoE branch counts the trips XLA
    knows, not one."""
    import jax
    import jax.numpy as jnp

    from lp_jax.roofline import QWEN3_30B_A3B
    from lp_jax.roofline.compiled import Program

    class Model:
        def _moe(self, x, w):  # 4 blocks of 8 rows
            return jax.lax.map(lambda xb: xb @ w, x.reshape(4, 8, D)).reshape(4 * 8, D)

        def _swiglu(self, x, w):
            return x @ w @ w

    model = Model()

    def step(x, w, is_moe):
        return jax.lax.fori_loop(0, 4, lambda i, x: jax.lax.cond(
            is_moe[i], lambda x: model._moe(x, w), lambda x: model._swiglu(x, w), x), x)

    text = jax.jit(step).lower(jax.ShapeDtypeStruct((32, D), jnp.float32),
                               jax.ShapeDtypeStruct((D, D), jnp.float32),
                               jax.ShapeDtypeStruct((4,), jnp.bool_)).compile().as_text()
    shape = dataclasses.replace(QWEN3_30B_A3B, num_layers=4, dense_layers=(0,), dense_width=D)
    p = Program(rows=32, seqs=32, pages_per_seq=1, page_size=16, tp=1, ep=1, shape=shape,
                context_len=16)
    _, bodies = Walker(hlo.parse(text), p, get_hardware("H200"), 0.6, 0.8).split_kinds()
    flops = {kind: sum(op.flops for op in ops if op.cls == "dense matmuls")
             for kind, ops in bodies.items()}
    assert flops == {"moe": 4 * 2 * 8 * D * D, "dense": 2 * 2 * 32 * D * D}


# XLA:TPU's form of the MLA oracle's page expansion (einsum "bsa,anh->bsnh" on 64 rows x
# 16 keys):
# a convolution whose 128-wide window, padded 127 on each side, slides over a spatial
# dimension of size 1; and XLA:TPU's loop over 8 query blocks, with no known_trip_count.
LAT, W = "bf16[64,16,512,1]{2,1,3,0}", "bf16[512,128,128,1]{2,0,1,3}"
CARRY = f"(s32[], {LAT}, {W})"
TPU_LOOP = f"""HloModule tpu_loop

%body (p: {CARRY}) -> {CARRY} {{
  %p = {CARRY} parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %lat = {LAT} get-tuple-element(%p), index=1
  %w = {W} get-tuple-element(%p), index=2
  %k = f32[64,16,128,128]{{3,1,2,0}} convolution(%lat, %w), window={{size=1x128 \
pad=0_0x127_127 rhs_reversal=0x1}}, dim_labels=0bf1_i1o0->0b1f
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = {CARRY} tuple(%next, %lat, %w)
}}

%cond (c: {CARRY}) -> pred[] {{
  %c = {CARRY} parameter(0)
  %n = s32[] constant(8)
  %j = s32[] get-tuple-element(%c), index=0
  ROOT %lt = pred[] compare(%j, %n), direction=LT
}}

ENTRY %main (a: {CARRY}) -> {CARRY} {{
  %a = {CARRY} parameter(0)
  ROOT %loop = {CARRY} while(%a), condition=%cond, body=%body
}}
"""


def test_a_padded_window_convolution_and_a_constant_bounded_loop():
    """The convolution costs its real multiply-adds (512 a output, one window position
    on the input), not 128 x that; the loop its 8 trips, read from `i < 8`."""
    module = hlo.parse(TPU_LOOP)
    p = types.SimpleNamespace(shape=types.SimpleNamespace(vocab_size=1000), tp=1)
    ops = Walker(module, p, get_hardware("TPU v6e"), 0.6, 0.8).walk(
        module.computations[module.entry], {}, top=False)
    assert sum(op.flops for op in ops) == 8 * (2 * 64 * 16 * 128 * 128 * 512 + 1)


# XLA:TPU's form of the absorbed query's batched einsum "tnh,anh->tna" (t 512, n 128 heads,
# h 128, a 512): the head axis a spatial dimension under a window of 128 over an input
# dilated by 128, so one real position a window.
ABSORB = """HloModule absorb

ENTRY %main (q: bf16[512,128,128], w: bf16[512,128,128]) -> bf16[128,512,512] {
  %q = bf16[512,128,128]{0,2,1} parameter(0)
  %w = bf16[512,128,128]{0,2,1} parameter(1)
  ROOT %c = bf16[128,512,512]{2,1,0} convolution(%q, %w), window={size=128 stride=127 \
lhs_dilate=128}, dim_labels=b0f_o0i->0bf
}
"""


def test_a_dilated_window_convolution_counts_its_real_positions():
    """The batched einsum costs 2 t n h a flops, not 128 (the window) times that."""
    module = hlo.parse(ABSORB)
    p = types.SimpleNamespace(shape=types.SimpleNamespace(vocab_size=1000), tp=1)
    ops = Walker(module, p, get_hardware("TPU v5p"), 0.6, 0.8).walk(
        module.computations[module.entry], {}, top=False)
    assert sum(op.flops for op in ops) == 2 * 512 * 128 * 128 * 512


MLA_STEP = """HloModule mla_step

ENTRY %main (x: bf16[512,576]) -> bf16[512,576] {
  %x = bf16[512,576]{1,0} parameter(0)
  ROOT %k = bf16[512,576]{1,0} custom-call(%x), custom_call_target="tpu_custom_call", \
metadata={op_name="jit(step)/lp_tpu_mla_decode"}
}
"""


def test_mla_prefill_rows_cost_the_kernel_at_the_programs_rows():
    """Every step runs the MLA kernel (no branch): a program of more rows than
    max_num_seqs costs it at all its rows, each over the context (cost.mla_decode)."""
    from lp_jax.roofline.compiled import Program
    from lp_jax.roofline.model_shape import ModelShape
    from pallas_kernels import cost

    shape = ModelShape.from_json("tests/configs/DeepSeek-V3.json", name="DeepSeek-V3")
    module = hlo.parse(MLA_STEP)
    p = Program(rows=512, seqs=32, pages_per_seq=256, page_size=16, tp=1, ep=1,
                shape=shape, context_len=4096)
    ops = Walker(module, p, get_hardware("TPU v5p"), 0.6, 0.8).walk(
        module.computations[module.entry], {}, top=False)
    want = cost.estimate(cost.TPU_MLA_DECODE, tokens=512, seqs=32, context=4096, heads=128,
                         latent_dim=512, rope_dim=64, q_itemsize=2, kv_itemsize=2)
    assert [(op.kernel, op.cls, op.flops) for op in ops] == [
        (cost.TPU_MLA_DECODE, "attention", want.flops)]


R = 16  # rows of the reduce-scatter
FUSED_REDUCE_SCATTER = f"""HloModule fused_reduce_scatter

%sum (a: f32[], b: f32[]) -> f32[] {{
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}}

%all-reduce-scatter (input: f32[{R},{D}]) -> f32[{R // 8},{D}] {{
  %input = f32[{R},{D}]{{1,0}} parameter(0)
  %ar = f32[{R},{D}]{{1,0}} all-reduce(%input), to_apply=%sum
  %id = u32[] partition-id()
  %c = u32[] constant({R // 8})
  %start = u32[] multiply(%id, %c)
  %z = u32[] constant(0)
  ROOT %ds = f32[{R // 8},{D}]{{1,0}} dynamic-slice(%ar, %start, %z),
      dynamic_slice_sizes={{{R // 8},{D}}}
}}

ENTRY %main (x: f32[{R},{D}]) -> f32[{R // 8},{D}] {{
  %x = f32[{R},{D}]{{1,0}} parameter(0)
  ROOT %rs = f32[{R // 8},{D}]{{1,0}} fusion(%x), kind=kCustom, calls=%all-reduce-scatter
}}
"""


def test_a_reduce_scatter_written_as_a_fusion_is_a_collective():
    """XLA:TPU writes a reduce-scatter as a fusion of an all-reduce and the slice of it
    each device keeps; costed as a plain fusion, its link bytes went uncounted."""
    module = hlo.parse(FUSED_REDUCE_SCATTER)
    p = types.SimpleNamespace(shape=types.SimpleNamespace(vocab_size=1000), tp=8)
    walker = Walker(module, p, get_hardware("TPU v6e"), 0.6, 0.8)
    (op,) = walker.walk(module.computations[module.entry], {}, top=True)
    assert op.cls == "collectives" and op.link_bytes == R * D * 4 / 2


G = "{0,1,2,3,4,5,6,7}"  # replica_groups
COLLECTIVES = f"""HloModule collectives

%sum (a: f32[], b: f32[]) -> f32[] {{
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}}

ENTRY %main (x: f32[{R},{D}], y: f32[{R // 8},{D}]) -> f32[{R},{D}] {{
  %x = f32[{R},{D}]{{1,0}} parameter(0)
  %y = f32[{R // 8},{D}]{{1,0}} parameter(1)
  %ar = f32[{R},{D}]{{1,0}} all-reduce(%x), replica_groups={{{G}}}, to_apply=%sum
  %rs = f32[{R // 8},{D}]{{1,0}} reduce-scatter(%x), replica_groups={{{G}}}, dimensions={{0}},
      to_apply=%sum
  %ag = f32[{R},{D}]{{1,0}} all-gather(%y), replica_groups={{{G}}}, dimensions={{0}}
  %a2a = f32[{R},{D}]{{1,0}} all-to-all(%x), replica_groups={{{G}}}, dimensions={{0}}
  ROOT %cp = f32[{R},{D}]{{1,0}} collective-permute(%x), source_target_pairs={{{{0,1}},{{1,0}}}}
}}
"""


def test_a_reduce_scatter_and_an_all_gather_together_cost_an_all_reduce():
    """A ring all-reduce is a reduce-scatter and an all-gather of the same buffer: each
    of those two is charged half the all-reduce's link bytes (as ep_comm and the layout
    model count them), an all-to-all half its buffer, a collective-permute all of it."""
    module = hlo.parse(COLLECTIVES)
    p = types.SimpleNamespace(shape=types.SimpleNamespace(vocab_size=1000), tp=8)
    walker = Walker(module, p, get_hardware("TPU v6e"), 0.6, 0.8)
    ops = walker.walk(module.computations[module.entry], {}, top=True)
    sent = [op.link_bytes for op in ops if op.cls == "collectives"]
    buffer = R * D * 4
    assert sent == [buffer, buffer / 2, buffer / 2, buffer / 2, buffer]


CALL = "__cublas$lt$matmul"
GEMM = ('backend_config={"gemm_backend_config":{"dot_dimension_numbers":'
        '{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}')
CUBLAS = f"""HloModule cublas

ENTRY %main (x: bf16[{T},{D}], w: bf16[{D},{N}]) -> bf16[{T},{N}] {{
  %x = bf16[{T},{D}]{{1,0}} parameter(0)
  %w = bf16[{D},{N}]{{1,0}} parameter(1)
  %mm = (bf16[{T},{N}], s8[4194304]) custom-call(%x, %w), custom_call_target="{CALL}", {GEMM}
  ROOT %y = bf16[{T},{N}]{{1,0}} get-tuple-element(%mm), index=0
}}
"""


def test_a_gemm_handed_to_cublas_is_costed_as_a_dot():
    """With Triton GEMMs off (or where the autotuner picks cuBLAS) XLA:GPU calls cuBLAS:
    its flops are the dot's, its bytes its operands and result, not the workspace."""
    module = hlo.parse(CUBLAS)
    p = types.SimpleNamespace(shape=types.SimpleNamespace(vocab_size=1000), tp=1)
    walker = Walker(module, p, get_hardware("H200"), 0.6, 0.8)
    ops = walker.walk(module.computations[module.entry], {}, top=True)
    (op,) = [op for op in ops if op.flops]
    assert op.cls == "dense matmuls" and op.flops == 2 * T * D * N
    assert op.bytes == 2 * (T * D + D * N + T * N)
