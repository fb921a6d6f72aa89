"""The GPU prefill kernel takes q and writes o as the caller has them, [T, N, H]: no
padded copy of q in, no select over o out, at a head grouping of a power of two.
Rows past the batch's last token are zeros written by the kernel's own tail items,
and an item that ends near T takes the block_q rows that end at T (the interpret
tests in test_attention_kernels.py check the values; here, the program's shape and
the edge the shift serves). The roofline reader costs each program's prefill call at
the block it was compiled with."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core as jax_core

from lp_jax.roofline import compiled, hlo
from pallas_kernels import cost
from pallas_kernels.attention import gpu
from pallas_kernels.attention.ref import ref_ragged_paged_attention

S, K, G, H = 8, 1, 8, 16


def _batch(q_lens, ctx_lens, T, P=16, C=4, seed=0):
    rng = np.random.default_rng(seed)
    B = len(q_lens)
    q = jnp.asarray(rng.normal(size=(T, K * G, H)), jnp.float32)
    kv = jnp.asarray(rng.normal(size=(P, S, 2 * K, H)), jnp.float32)
    starts = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    table = jnp.asarray(rng.permutation(P)[: B * C].reshape(B, C), jnp.int32)
    return q, kv, starts, jnp.asarray(ctx_lens, jnp.int32), table, jnp.int32(B)


def _primitives(jaxpr) -> list:
    out = []
    for eqn in jaxpr.eqns:
        out.append(eqn)
        for sub in jax_core.jaxprs_in_params(eqn.params):
            out += _primitives(sub)
    return out


def test_prefill_takes_q_and_writes_o_in_place():
    args = _batch([20, 7], [25, 7], T=32)
    fn = jax.jit(lambda *a: gpu.ragged_paged_attention(*a, sm_scale=0.25, block_rows=64))
    eqns = _primitives(jax.make_jaxpr(fn)(*args).jaxpr)
    names = [e.primitive.name for e in eqns]
    assert "pallas_call" in names
    float_pads = [e for e in eqns if e.primitive.name == "pad"
                  and jnp.issubdtype(e.invars[0].aval.dtype, jnp.floating)]
    assert float_pads == []  # (the page table's pad, int32 [B, C], stays)
    selects = [e for e in eqns if e.primitive.name == "select_n"
               and e.outvars[0].aval.shape == (32, K * G, H)]
    assert selects == []


def test_items_near_the_end_and_the_tail_rows():
    """block_q 8 (64 rows of 8 heads), 22 tokens of 24 rows: the last sequence's last
    item (token 21, one row) and the tail item (rows 22, 23) would run past T; both take
    rows 16..23, and the rows past the tokens are zeros (the output buffer starts
    uninitialised in the interpreter)."""
    q_lens, T = [13, 9], 24
    ctx = [q + 5 for q in q_lens]
    q, kv, starts, lens, table, n = _batch(q_lens, ctx, T)
    got = gpu.ragged_paged_attention(q, kv, starts, lens, table, n, sm_scale=0.25,
                                     block_rows=64, pages_per_block=1, interpret=True)
    want = ref_ragged_paged_attention(q, kv, starts, lens, table, n, sm_scale=0.25)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert not np.asarray(got[sum(q_lens):]).any()


def _prefill_call(items: int, seqs: int, rows: int) -> hlo.Instr:
    """The prefill kernel's custom call as an H200 program's HLO writes it (operands: the
    meta rows, the page table, q, the pool twice)."""
    layouts = (f"s32[{items},8]{{1,0}}, s32[{seqs},256]{{1,0}}, bf16[{rows},4,8,128]{{3,2,1,0}}, "
               "bf16[393216,16,8,128]{3,2,1,0}, bf16[393216,16,8,128]{3,2,1,0}")
    return hlo.Instr(name="pallas_call.0", type=f"bf16[{rows},4,8,128]{{3,2,1,0}}",
                     opcode="custom-call", operands=[], args="", called=[],
                     attrs=f'custom_call_target="__gpu$xla.gpu.triton", '
                           f"operand_layout_constraints={{{layouts}}}, backend_config={{}}")


def test_reader_costs_the_prefill_kernel_at_the_programs_block():
    """The reader reads the tokens a work item takes from the call's meta rows (ceil(T /
    block_q) + B), so a program of 128-row items (16 Qwen3 tokens: 546 items at 8,224
    rows) and one of 256-row items (289) are each costed at their own; BLOCK_ROWS, the
    fallback, is the kernel's default."""
    p = SimpleNamespace(rows=8224)
    assert compiled.prefill_block_q(_prefill_call(546, 32, 8224), p) == 16
    assert compiled.prefill_block_q(_prefill_call(289, 32, 8224), p) == 32
    assert compiled.prefill_block_q(_prefill_call(300, 32, 8224), p) is None
    assert compiled.BLOCK_ROWS[cost.GPU_PREFILL_ATTENTION] == gpu.PREFILL_BLOCK_ROWS
    assert gpu.prefill_keys_per_step(256, 128) == 16  # the spill-free step (docstring)
    assert gpu.prefill_keys_per_step(128, 128) == gpu.prefill_keys_per_step(256, 64) == 64
