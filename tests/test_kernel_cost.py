"""Every Pallas kernel's cost estimate (`pallas_kernels.cost`) against a count made
without the kernel's code.

XLA counts a Pallas call only as much as its estimate declares, so a wrong estimate
misleads both the roofline and XLA:TPU's scheduler. For each kernel, at tiny shapes:

* MoE (TPU fused gather / unfused gate/up / down, GPU gate/up / down): a routing drawn
  from random logits, run through the reference (`ref.ref_moe_ffn`, whose stats count
  the routed rows and the activated experts' bytes); flops and transcendentals from
  XLA's cost analysis of plain matmuls and the activation over exactly those rows.
* Attention (TPU ragged / decode, packed head_dim 64 too; GPU decode / prefill; the
  shipped TPU kernel's registry entry): a full page table, run densely over contiguous
  K and V; XLA's cost analysis of that, scaled by the pairs the causal mask keeps
  (counted with numpy), and its argument and output bytes.
* MLA decode (TPU, GPU; absorbed form): dense latent attention over contiguous
  latent rows, counted the same way, at the full table and at half the context the
  estimate is told to assume.

TPU kernels' estimates are read off the pallas_call in the traced program (what
XLA:TPU gets), GPU kernels' from the registry, by the kernel's name. Tolerance: a
factor of 2 either way on each of flops, transcendentals and bytes. The estimates
count useful work and assume uniform routing and full contexts (cost.py), so they
differ from the count by the routing's luck (active experts, which are near-certain
at these shapes) and by small terms (the activation's extra elementwise ops, masks);
the old padded worst case (P rows) declared 126x the flops at the decode shape and 4.9x
at the prefill one, so 2x catches drift of that kind. Compiles for v6e (libtpu) check
that the compiled program's cost analysis carries the declared figures.
"""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import compile_targets, cost
from pallas_kernels.moe.ref import ref_moe_ffn

FACTOR = 2.0
bf16 = jnp.bfloat16
sd = jax.ShapeDtypeStruct


def _xla_cost(fn, *args) -> dict:
    """XLA:CPU's cost analysis of fn at args' shapes, plus its argument + output bytes."""
    compiled = jax.jit(fn).lower(*args).compile()
    costs = compiled.cost_analysis()
    mem = compiled.memory_analysis()
    return dict(flops=costs["flops"], transcendentals=costs.get("transcendentals", 0.0),
                io_bytes=mem.argument_size_in_bytes + mem.output_size_in_bytes)


def _pallas_calls(jaxpr):
    """(name, cost_estimate) of every pallas_call in a jaxpr, nested jaxprs included."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            yield eqn.params["name"], eqn.params["cost_estimate"]
            continue
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", value)
            if isinstance(inner, jax.extend.core.Jaxpr):
                yield from _pallas_calls(inner)


def _declared(fn, *args) -> dict:
    return dict(_pallas_calls(jax.make_jaxpr(fn)(*args).jaxpr))


def _assert_close(name, declared, flops, transcendentals, bytes_accessed):
    got = dict(flops=declared.flops, transcendentals=declared.transcendentals,
               bytes=declared.bytes_accessed)
    want = dict(flops=flops, transcendentals=transcendentals, bytes=bytes_accessed)
    for key in got:
        if want[key] == 0:
            assert got[key] == 0, (name, key, got, want)
            continue
        ratio = got[key] / want[key]
        assert 1 / FACTOR <= ratio <= FACTOR, f"{name} {key}: declared {got[key]:.4g}, " \
                                              f"counted {want[key]:.4g} ({ratio:.2f}x)"


# ----------------------------------------------------------------------------- MoE
MOE = {"decode": dict(T=4, D=256, E=16, A=2, F=256),  # 8 rows over 16 experts
       "prefill": dict(T=128, D=256, E=8, A=2, F=256)}  # 32 rows an expert


def _moe_count(T, D, E, A, F):
    """Routed rows, activated experts and the bytes of those experts, from the reference
    run on random logits; and XLA's counts of the matmuls and activation on those rows."""
    x = jax.random.normal(jax.random.key(0), (T, D), bf16)
    logits = jax.random.normal(jax.random.key(1), (T, E), jnp.float32)
    w_gate_up = jnp.zeros((E, D, 2 * F), bf16)
    w_down = jnp.zeros((E, F, D), bf16)
    _, stats = ref_moe_ffn(x, logits, w_gate_up, w_down, top_k=A, norm_topk_prob=True)
    R = int(np.sum(stats["tokens_per_expert"]))
    active = int(stats["experts_activated"])
    assert float(stats["expert_bytes_loaded"]) == active * 3 * D * F * 2  # bf16 experts
    gate_up = _xla_cost(lambda x, w: jax.nn.silu(x @ w[:, :F]) * (x @ w[:, F:]),
                        sd((R, D), bf16), sd((D, 2 * F), bf16))
    down = _xla_cost(lambda h, w: h @ w, sd((R, F), bf16), sd((F, D), bf16))
    io = 2 * R * (D + F)  # bf16 rows in and out, each matmul
    return dict(
        gate_up=(gate_up["flops"], gate_up["transcendentals"], io + active * D * 2 * F * 2),
        down=(down["flops"], 0, io + active * F * D * 2),
    )


def _moe_args(T, D, E, A, F):
    return (sd((T, D), bf16), sd((T, E), jnp.float32), sd((E, D, 2 * F), bf16),
            sd((E, F, D), bf16))


@pytest.mark.parametrize("fused_gather", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("regime", MOE)
def test_tpu_moe_kernels_declare_the_routed_work(regime, fused_gather):
    from pallas_kernels.moe import tpu

    shapes = MOE[regime]
    declared = _declared(
        lambda *a: tpu.moe_ffn_tpu(*a, top_k=shapes["A"], norm_topk_prob=True,
                                   fused_gather=fused_gather)[0], *_moe_args(**shapes))
    gate_up = cost.TPU_MOE_GATE_UP_GATHER if fused_gather else cost.TPU_MOE_GATE_UP
    assert set(declared) == {gate_up, cost.TPU_MOE_DOWN}
    counts = _moe_count(**shapes)
    _assert_close(gate_up, declared[gate_up], *counts["gate_up"])
    _assert_close(cost.TPU_MOE_DOWN, declared[cost.TPU_MOE_DOWN], *counts["down"])


@pytest.mark.parametrize("regime", MOE)
def test_gpu_moe_estimates_match_the_routed_work(regime):
    T, D, E, A, F = MOE[regime].values()
    counts = _moe_count(T, D, E, A, F)
    common = dict(tokens=T, top_k=A, experts=E, lhs_itemsize=2, w_itemsize=2, out_itemsize=2)
    _assert_close("gpu gate/up", cost.estimate(cost.GPU_MOE_GATE_UP, k=D, n=F, glu=True,
                                               **common), *counts["gate_up"])
    _assert_close("gpu down", cost.estimate(cost.GPU_MOE_DOWN, k=F, n=D, glu=False,
                                            **common), *counts["down"])


# ----------------------------------------------------------------------- attention
B, C, S = 3, 4, 16  # sequences, pages each (a full table), page size: 64 keys each


def _attention_count(q_len, N, K, H):
    """Dense causal attention of q_len new tokens a sequence over its B contiguous
    contexts of C * S keys: XLA's count scaled by the pairs the mask keeps."""
    ctx, G = C * S, N // K

    def dense(q_BqKGH, k_BcKH, v_BcKH):
        s = jnp.einsum("bqkgh,bckh->bkgqc", q_BqKGH, k_BcKH, preferred_element_type=jnp.float32)
        visible = np.arange(ctx)[None, :] <= np.arange(ctx - q_len, ctx)[:, None]
        p = jax.nn.softmax(jnp.where(visible, s, -1e30), axis=-1)
        return jnp.einsum("bkgqc,bckh->bqkgh", p.astype(bf16), v_BcKH)

    c = _xla_cost(dense, sd((B, q_len, K, G, H), bf16), sd((B, ctx, K, H), bf16),
                  sd((B, ctx, K, H), bf16))
    kept = np.sum(np.arange(ctx)[None, :] <= np.arange(ctx - q_len, ctx)[:, None]) / (q_len * ctx)
    return c["flops"] * kept, c["transcendentals"] * kept, c["io_bytes"]


def _attention_args(T, N, K, H, packed=False):
    pool = (B * C, S, K, 2 * H) if packed else (B * C, S, 2 * K, H)
    return (sd((T, N, H), bf16), sd(pool, bf16), sd((B + 1,), jnp.int32), sd((B,), jnp.int32),
            sd((B, C), jnp.int32), sd((), jnp.int32))


ATTENTION = {"decode": dict(q_len=1, N=4, K=2, H=128),
             "prefill_chunk": dict(q_len=16, N=4, K=2, H=128),
             "decode_packed_h64": dict(q_len=1, N=4, K=2, H=64)}


@pytest.mark.parametrize("case", ATTENTION)
def test_tpu_attention_declares_the_full_table_work(case):
    from pallas_kernels.attention import tpu

    q_len, N, K, H = ATTENTION[case].values()
    q, kv, qs, lens, pt, n = _attention_args(B * q_len, N, K, H, packed=H < 128)
    if q_len == 1:
        fn = lambda q, kv, lens, pt: tpu.decode_attention(q, kv, lens, pt, sm_scale=0.1)  # noqa: E731
        declared = _declared(fn, q, kv, lens, pt)
    else:
        fn = lambda *a: tpu.ragged_paged_attention(*a, sm_scale=0.1)  # noqa: E731
        declared = _declared(fn, q, kv, qs, lens, pt, n)
    assert set(declared) == {cost.TPU_ATTENTION}
    _assert_close(case, declared[cost.TPU_ATTENTION], *_attention_count(q_len, N, K, H))


@pytest.mark.parametrize("case", ["decode", "prefill_chunk"])
def test_gpu_and_shipped_attention_estimates_match(case):
    """The GPU kernels' names are the registry's keys (their pallas_call names); the
    shipped TPU kernel (tpu_jax.py) declares nothing, so it has only its registry entry."""
    from pallas_kernels.attention import gpu

    q_len, N, K, H = ATTENTION[case].values()
    args = _attention_args(B * q_len, N, K, H)
    if q_len == 1:
        name = cost.GPU_DECODE_ATTENTION
        fn = lambda q, kv, lens, pt: gpu.decode_attention(q, kv, lens, pt, sm_scale=0.1)  # noqa: E731
        args = (args[0], args[1], args[3], args[4])
    else:
        name = cost.GPU_PREFILL_ATTENTION
        fn = lambda *a: gpu.ragged_paged_attention(*a, sm_scale=0.1)  # noqa: E731
    assert set(_declared(fn, *args)) == {name}
    count = _attention_count(q_len, N, K, H)
    shapes = dict(tokens=B * q_len, seqs=B, pages_per_seq=C, page_size=S, heads=N,
                  kv_heads=K, head_dim=H, q_itemsize=2, kv_itemsize=2, block_q=q_len)
    _assert_close(name, cost.estimate(name, **shapes), *count)
    _assert_close("tpu_jax", cost.estimate(cost.TPU_JAX_ATTENTION, **shapes), *count)


def test_attention_estimate_follows_the_assumed_context_not_the_table():
    """The kernels walk only the pages below each sequence's run-time length, so the
    estimate takes the context it assumes: a 4-page table read as 2-page contexts costs
    what a 2-page table costs, and None is the full table."""
    shapes = dict(tokens=B, seqs=B, page_size=S, heads=4, kv_heads=2, head_dim=128,
                  q_itemsize=2, kv_itemsize=2)
    full = cost.paged_attention(pages_per_seq=C, **shapes)
    assert cost.paged_attention(pages_per_seq=C, context_len=C * S, **shapes) == full
    half = cost.paged_attention(pages_per_seq=C, context_len=2 * S, **shapes)
    assert half == cost.paged_attention(pages_per_seq=2, **shapes)
    assert half.bytes_accessed < full.bytes_accessed and half.flops < full.flops
    for bad in (0, C * S + 1):
        with pytest.raises(ValueError, match="outside the page table"):
            cost.paged_attention(pages_per_seq=C, context_len=bad, **shapes)


def _mla_count(q_len, N, A, R):
    """Absorbed latent attention of q_len new tokens a sequence over B contiguous
    contexts of C * S latent rows: XLA's count scaled by the pairs the mask keeps; bytes:
    q_lat, q_pe, the rows, o_lat."""
    ctx = C * S

    def dense(q_lat_BqNA, q_pe_BqNR, c_BcA, pe_BcR):
        s = (jnp.einsum("bqna,bca->bnqc", q_lat_BqNA, c_BcA, preferred_element_type=jnp.float32)
             + jnp.einsum("bqnr,bcr->bnqc", q_pe_BqNR, pe_BcR,
                          preferred_element_type=jnp.float32))
        visible = np.arange(ctx)[None, :] <= np.arange(ctx - q_len, ctx)[:, None]
        p = jax.nn.softmax(jnp.where(visible, s, -1e30), axis=-1)
        return jnp.einsum("bnqc,bca->bqna", p.astype(bf16), c_BcA)

    c = _xla_cost(dense, sd((B, q_len, N, A), bf16), sd((B, q_len, N, R), bf16),
                  sd((B, ctx, A), bf16), sd((B, ctx, R), bf16))
    kept = np.sum(np.arange(ctx)[None, :] <= np.arange(ctx - q_len, ctx)[:, None]) / (q_len * ctx)
    return c["flops"] * kept, c["transcendentals"] * kept, c["io_bytes"]


def test_mla_kernels_declare_the_latent_work_at_the_assumed_context():
    """TPU (read off its pallas_call; its pool rows padded to 256 values, which it
    reads) and GPU (the registry) MLA decode kernels, one token a sequence over a full
    table; assumed_context, the estimate's input, halves
    the context and with it the pairs and the latent bytes."""
    from pallas_kernels.attention import mla_tpu

    N, A, R = 8, 128, 64
    args = (sd((B, N, A), bf16), sd((B, N, R), bf16), sd((B * C, S, 1, 256), bf16),
            sd((B + 1,), jnp.int32), sd((B,), jnp.int32), sd((B, C), jnp.int32),
            sd((), jnp.int32))
    declared = _declared(lambda *a: mla_tpu.mla_decode_attention(*a, sm_scale=0.1), *args)
    assert set(declared) == {cost.TPU_MLA_DECODE}
    count = _mla_count(1, N, A, R)
    _assert_close("tpu mla", declared[cost.TPU_MLA_DECODE], *count)
    shapes = dict(tokens=B, seqs=B, context=C * S, heads=N, latent_dim=A, rope_dim=R,
                  q_itemsize=2, kv_itemsize=2)
    _assert_close("gpu mla", cost.estimate(cost.GPU_MLA_DECODE, **shapes), *count)
    half = _declared(lambda *a: mla_tpu.mla_decode_attention(
        *a, sm_scale=0.1, assumed_context=C * S // 2), *args)[cost.TPU_MLA_DECODE]
    full = declared[cost.TPU_MLA_DECODE]
    assert half.flops < 0.51 * full.flops and half.transcendentals < 0.51 * full.transcendentals
    assert half.bytes_accessed < full.bytes_accessed


def test_unknown_kernel_names_the_known_ones():
    with pytest.raises(KeyError, match="lp_tpu_moe_down"):
        cost.estimate("no_such_kernel")


# ------------------------------------------------------------ through the TPU compiler
@pytest.mark.skipif(not compile_targets.libtpu_available(), reason=compile_targets.LIBTPU_HINT)
@pytest.mark.parametrize("program", ["moe", "decode"])
def test_compiled_tpu_programs_carry_the_declared_costs(program, monkeypatch):
    """XLA:TPU's cost analysis of a compiled MoE layer or decode step counts the
    kernels' declared figures: declaring 10x more moves the program's flops and bytes by
    exactly 9x the declared sums. The rest is XLA's glue (routing, layout, combine,
    q packing), whose bytes on TPU (small arrays padded to whole tiles) exceed these
    tiny kernels' own. tm = 128 (the default): the gather's ids DMA needs 512 bytes."""
    from pallas_kernels.attention import tpu as attention_tpu
    from pallas_kernels.moe import tpu as moe_tpu

    if program == "moe":
        shapes = MOE["prefill"]
        fn = lambda *a: moe_tpu.moe_ffn_tpu(*a, top_k=shapes["A"], norm_topk_prob=True)[0]  # noqa: E731
        args = _moe_args(**shapes)
    else:
        fn = lambda q, kv, lens, pt: attention_tpu.decode_attention(  # noqa: E731
            q, kv, lens, pt, sm_scale=0.1)
        q, kv, _, lens, pt, _ = _attention_args(B, 4, 2, 128)
        args = (q, kv, lens, pt)
    declared = list(_declared(fn, *args).values())
    flops = sum(c.flops for c in declared)
    nbytes = sum(c.bytes_accessed for c in declared)

    def compiled_costs():
        compiled = compile_targets.compile_tpu(fn, args, topology="v6e:2x2", mesh_shape=(1,))
        return compiled.cost_analysis()

    honest = compiled_costs()
    assert flops <= honest["flops"] <= 1.25 * flops, (honest["flops"], flops)
    pallas = cost.KernelCost.pallas
    monkeypatch.setattr(cost.KernelCost, "pallas", lambda c: pallas(cost.KernelCost(
        10 * c.flops, 10 * c.transcendentals, 10 * c.bytes_accessed)))
    jax.clear_caches()
    tenfold = compiled_costs()
    assert tenfold["flops"] - honest["flops"] == pytest.approx(9 * flops, rel=1e-3)
    assert tenfold["bytes accessed"] - honest["bytes accessed"] == pytest.approx(9 * nbytes,
                                                                                rel=1e-3)
