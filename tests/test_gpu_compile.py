"""Every GPU kernel through the real NVIDIA compile chain, for an H200 (sm_90a), on this
CPU host: XLA:GPU, XLA's Triton, the Mosaic GPU passes and ptxas (the `gpu-compile`
extra: the CUDA PJRT plugin and nvidia-cuda-nvcc, no GPU). `make test` installs it; a
host without it fails here, it does not skip.

Model shapes in bfloat16: the MoE at Qwen3-30B-A3B's (D 2048, 128 experts, top-8, F 768)
and GPT-OSS-20B's (D = F = 2880, 32 experts, top-4, expert biases and the clamped
SwiGLU), weights stacked [L=2, ...] with a traced layer; attention (decode and ragged
prefill, one program each model) at Qwen3's heads (32 / 4, head_dim 128) and GPT-OSS's
(64 / 8, head_dim 64, sinks and a traced sliding window), 16-token pages of the 48-layer
step's pool (past 2 GiB: 64-bit page offsets); the MLA decode
kernel at DeepSeek-V3's heads (128, latent 512 + 64) over an FP8 pool. Five compiles
in all, shared by the checks (a module fixture); each kernel's resources come from
ptxas's own report (`lp_jax.aot.resources`).

Checked per kernel: no register spills and no stack frame; at most 255 registers;
threads and grid as the kernel is written (one 128-thread warpgroup per SM for the
MoE's persistent grid; 4 and 8 warps for decode and prefill attention); shared memory
within the H200's 227 KiB a block; and the occupancy the design counts on (decode
attention: at least 3 blocks an SM). The figures are in BENCHMARKS.md.

Two more small compiles check the projections' dots: one row (`row_dot`) reads its weight
once instead of storing the float32 product, and several rows (`dense_dot`) leave the
merged q/k/v GEMM in bf16.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from lp_jax.aot import resources
from pallas_kernels import compile_targets

sd = jax.ShapeDtypeStruct
bf16, i32 = jnp.bfloat16, jnp.int32
SMEM_PER_BLOCK = 232448  # the H200's opt-in shared memory a block (target config)
SMEM_PER_SM, REGS_PER_SM, MAX_THREADS_PER_SM = 233472, 65536, 2048
QWEN = dict(D=2048, E=128, A=8, F=768)
GPT_OSS = dict(D=2880, E=32, A=4, F=2880)


def _moe(model: dict, biases: bool):
    from pallas_kernels.moe import MoEActivation
    from pallas_kernels.moe.gpu import moe_ffn_gpu

    D, E, A, F, L, T = model["D"], model["E"], model["A"], model["F"], 2, 64
    args = [sd((T, D), bf16), sd((T, E), jnp.float32), sd((L, E, D, 2 * F), bf16),
            sd((L, E, F, D), bf16), sd((), i32)]
    kw = dict(top_k=A, norm_topk_prob=True)
    if biases:
        args += [sd((L, E, 2 * F), bf16), sd((L, E, D), bf16)]
        kw.update(activation=MoEActivation("gpt_oss_clamped", limit=7.0, alpha=1.702))

    def fn(x, logits, w_gate_up, w_down, layer, *b):
        return moe_ffn_gpu(x, logits, w_gate_up, w_down, layer=layer, biases=b, **kw)[0]

    return fn, args


def _attention(N: int, K: int, H: int, gpt_oss: bool):
    from pallas_kernels.attention import gpu

    # The 48-layer step's pool (12.9 GB of Qwen3's pages): past 2 GiB the kernels' page
    # offsets are 64-bit, which costs registers that a small pool's 32-bit ones do not.
    S, pages, B, C, T = 16, 393216, 8, 16, 64
    args = [sd((T, N, H), bf16), sd((pages, S, 2 * K, H), bf16), sd((B + 1,), i32),
            sd((B,), i32), sd((B, C), i32), sd((), i32), sd((B, N, H), bf16)]
    if gpt_oss:
        args += [sd((N,), bf16), sd((), i32)]

    def fn(q, kv, starts, lens, table, n, q_dec, *extra):
        e = dict(sinks_N=extra[0], sliding_window=extra[1]) if extra else {}
        return (gpu.ragged_paged_attention(q, kv, starts, lens, table, n, sm_scale=H**-0.5, **e),
                gpu.decode_attention(q_dec, kv, lens, table, sm_scale=H**-0.5, **e))

    return fn, args


def _mla_deepseek_v3():
    """The MLA decode kernel at DeepSeek-V3's heads (128, latent 512 + 64), FP8 pool."""
    from pallas_kernels.attention import mla_gpu

    B, C, S, N, A, R = 8, 16, 16, 128, 512, 64
    args = [sd((B, N, A), bf16), sd((B, N, R), bf16),
            sd((4096, S, 1, A + R), jnp.float8_e4m3fn), sd((B + 1,), i32), sd((B,), i32),
            sd((B, C), i32), sd((), i32), sd((), jnp.float32)]

    def fn(q_lat, q_pe, pool, starts, lens, table, n, scale):
        return mla_gpu.mla_decode_attention(q_lat, q_pe, pool, starts, lens, table, n,
                                            sm_scale=0.1, kv_scale=scale)

    return fn, args


PROGRAMS = {
    "moe_qwen3": lambda: _moe(QWEN, biases=False),
    "moe_gpt_oss": lambda: _moe(GPT_OSS, biases=True),
    "attention_qwen3": lambda: _attention(32, 4, 128, gpt_oss=False),
    "attention_gpt_oss": lambda: _attention(64, 8, 64, gpt_oss=True),
    "mla_deepseek_v3": _mla_deepseek_v3,
}


@pytest.fixture(scope="module")
def kernels(tmp_path_factory) -> dict[str, list[dict]]:
    """{program: its kernels of ours}, each compiled once for the H200."""
    missing = compile_targets.cuda_compiler_missing()
    assert missing is None, missing  # CI installs the extra: its absence is a failure
    mesh, ptxas, out = compile_targets.cuda_mesh("h200"), compile_targets.ptxas_path(), {}
    for name, make in PROGRAMS.items():
        fn, args = make()
        dump = tmp_path_factory.mktemp(name)
        with jax.set_mesh(mesh), resources.mosaic_dumps(dump / "mosaic"):
            lowered = jax.jit(fn).lower(*compile_targets._shard_args(args, mesh, None))
            lowered.compile(compiler_options=resources.xla_dump_options(dump / "xla"))
        out[name] = [k for k in resources.collect(dump / "xla", dump / "mosaic", ptxas)
                     if k["ours"]]
    return out


def blocks_per_sm(k: dict) -> int:
    """Resident blocks an SM can hold: registers (allocated per warp in units of 256),
    shared memory (plus 1 KiB reserved a block) and threads."""
    threads = k["threads"][0] * k["threads"][1] * k["threads"][2]
    warps = -(-threads // 32)
    regs = warps * -(-k["registers"] * 32 // 256) * 256
    smem = k.get("shared_bytes", 0) + k.get("static_smem", 0) + 1024
    return min(REGS_PER_SM // regs, SMEM_PER_SM // smem, MAX_THREADS_PER_SM // threads)


def _by_weights(ks: list[dict], shape: str) -> dict:
    (k,) = [k for k in ks if k["source"] == "mosaic_gpu" and f"[{shape}" in k["name"]]
    return k


@pytest.mark.parametrize("program", PROGRAMS)
def test_no_kernel_of_ours_spills_or_uses_stack(kernels, program):
    ks = kernels[program]
    # MoE gate/up + down; ragged + decode; MLA decode alone
    assert len(ks) == (1 if program.startswith("mla") else 2), [k["name"] for k in ks]
    assert resources.problems(ks) == []
    for k in ks:
        assert k["arch"] == "sm_90a" and k["spill_stores"] == k["spill_loads"] == 0
        assert k["stack"] == 0 and 0 < k["registers"] <= 255
        assert k["shared_bytes"] + k["static_smem"] <= SMEM_PER_BLOCK
        assert blocks_per_sm(k) >= 1


@pytest.mark.parametrize("program, model", [("moe_qwen3", QWEN), ("moe_gpt_oss", GPT_OSS)])
def test_moe_kernels_are_one_warpgroup_per_sm_on_the_stacked_weights(kernels, program, model):
    """Both MoE kernels take the whole [L*E, ...] stack (no layer copy) and run a
    persistent grid of one block per SM (132) of one warpgroup, with a multi-stage TMA
    pipeline in shared memory (Qwen3: 4 stages, 160 KiB; GPT-OSS's 64-wide blocks: 96
    KiB, which would let 2 blocks share an SM, but the grid launches one an SM)."""
    D, E, F = model["D"], model["E"], model["F"]
    gate_up = _by_weights(kernels[program], f"{2 * E}x{D}x{2 * F}xbf16")
    down = _by_weights(kernels[program], f"{2 * E}x{F}x{D}xbf16")
    for k in (gate_up, down):
        assert k["threads"] == [128, 1, 1] and k["grid"] == [132, 1, 1]
        assert k["shared_bytes"] >= 64 * 1024 and blocks_per_sm(k) >= 1
    assert gate_up["registers"] >= down["registers"]  # two accumulators against one


@pytest.mark.parametrize("program", ["attention_qwen3", "attention_gpt_oss"])
def test_attention_kernels_launch_as_written(kernels, program):
    """Decode: 4 warps, grid (B, K, splits), at least 3 blocks an SM (what the kernel's
    bandwidth estimate counts on); ragged prefill: 8 warps, grid (blocks, K, 1)."""
    K = 4 if program == "attention_qwen3" else 8
    ks = {k["name"]: k for k in kernels[program]}
    decode, prefill = ks["lp_paged_decode_attention"], ks["lp_paged_prefill_attention"]
    assert decode["threads"] == [128, 1, 1] and decode["grid"][:2] == [8, K]
    assert blocks_per_sm(decode) >= 3
    assert prefill["threads"] == [256, 1, 1] and prefill["grid"][1:] == [K, 1]


def test_one_row_projection_reads_its_weight_once():
    """A one-row projection of a stacked [L, K, N] weight (Qwen3's k_proj: 2048 x 512):
    written as a plain dot, XLA:GPU stores the whole float32 product [K, N] (4 MiB here)
    and reduces it in a second fusion; `row_dot`'s partial dots fuse the multiply into
    the reduce, so the temporaries are the [K / 512, N] partials. The sliced form is the
    plain dot's value (float32 sums in another order)."""
    import numpy as np

    from lp_jax.quant.linear import linear, sliced_row_dot

    L, K, N = 2, 2048, 512

    def layers(w_LKN, x_1K):
        return jax.lax.fori_loop(0, L, lambda i, x: jnp.tanh(
            jnp.tile(linear(x, w_LKN[i]), (1, K // N))), x_1K)

    compiled = compile_targets.compile_cuda(layers, (sd((L, K, N), bf16), sd((1, K), bf16)))
    assert compiled.memory_analysis().temp_size_in_bytes < K * N * 4 // 16
    assert f"f32[1,{K},{N}]" not in compiled.as_text()
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (1, K), jnp.float32)
    w = jax.random.normal(kw, (K, N), jnp.float32)
    np.testing.assert_allclose(sliced_row_dot(x, w), x @ w, rtol=1e-4, atol=1e-3)


def test_projections_of_several_rows_leave_the_gemm_in_bf16():
    """q / k / v projections of 1,024 rows with per-head norms after q and k (Qwen3's
    pattern): XLA merges the three dots into one GEMM. With float32 dots and casts its
    output was float32 (f32[1024, 1536] here), read whole by each norm; `dense_dot` asks
    the dot for bf16, so the GEMM writes bf16 and no float32 product of the merged
    width exists."""
    from lp_jax.models.layers import rms_norm
    from lp_jax.quant.linear import linear

    T, D, NH, KH = 1024, 256, 1024, 256

    def qkv(x, wq, wk, wv, g):
        q = rms_norm(linear(x, wq).reshape(T, -1, 128), g, 1e-6)
        k = rms_norm(linear(x, wk).reshape(T, -1, 128), g, 1e-6)
        return q, k, linear(x, wv)

    compiled = compile_targets.compile_cuda(qkv, (sd((T, D), bf16), sd((D, NH), bf16),
                                                  sd((D, KH), bf16), sd((D, KH), bf16),
                                                  sd((128,), bf16)))
    text = compiled.as_text()
    assert f"bf16[{T},{NH + 2 * KH}]" in text  # the merged GEMM
    assert f"f32[{T},{NH + 2 * KH}]" not in text


def test_mla_kernel_launches_as_written(kernels):
    """8 warps, grid (tokens, head blocks of 16, splits), two blocks an SM."""
    (k,) = kernels["mla_deepseek_v3"]
    assert k["name"] == "lp_paged_mla_decode"
    assert k["threads"] == [256, 1, 1] and k["grid"][:2] == [8, 128 // 16]
    assert blocks_per_sm(k) >= 2
