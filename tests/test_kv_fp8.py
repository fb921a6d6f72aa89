"""FP8 KV cache (issue #31; kv_cache_dtype "fp8" / "fp8_e4m3"): e4m3 pages written as
x / scale (saturated to +-448) and dequantised on load.

- the reference attention on an FP8 pool equals the float32 attention over the
  dequantised values (the quantiser here is numpy's, independent of ref.quantize_fp8);
- the TPU kernel (interpreter) on an FP8 pool, plain and packed, and the GPU kernels
  (interpreter, through the engine's start-up self-test), ragged and decode, match the
  reference;
- the engine (`LLM(..., kv_cache_dtype="fp8")`, the shared chunked engine's shapes)
  equals the model run with a float32 cache holding the same dequantised values, and
  its log-probability drift against the float32 path is bounded (the figure is in
  BENCHMARKS.md, "FP8 KV cache: accuracy");
- a bad value is refused before anything compiles; a page holds half a bf16 page's
  bytes and the memory-sized page count doubles; checkpoint scales are read under
  vLLM's names; the TPU decode kernel compiles with libtpu without copying the pool, and
  the GPU kernels compile for the H200 (ptxas) without spills; on a head-sharded mesh
  every shard gets the scales.
"""

from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from lp_jax.config import resolve_kv_cache_dtype
from lp_jax.core.sampling_params import SamplingParams
from lp_jax.engine.config import EngineConfig
from lp_jax.executor import compile_guard
from lp_jax.models import kv_cache
from pallas_kernels import attention, compile_targets
from pallas_kernels.attention import ref, tpu

GOLDEN = np.load("tests/golden/tiny.npz")
PROMPTS = [GOLDEN[f"prompt_{i}"].tolist() for i in range(3)]
CONTINUATION = 7  # golden greedy tokens appended: teacher-forced, no divergence
# Max |logprob(fp8 cache) - logprob(float32)| over the 3 golden prompts plus 7 greedy
# tokens each (80 positions): 1.938, measured 2026-12-04 (BENCHMARKS.md, "FP8 KV
# cache"). The random tiny model (qk-norm gain 2, so sharp attention, 8 layers) amplifies
# rounding: a bf16 cache already drifts 0.29 there, e4m3's 2^-4 rounding 1.94. The bound
# is that figure with a margin; the exactness of the path is the oracle's 1e-4 check.
DRIFT_BOUND = 2.5


def _np_e4m3(x, scale):
    """numpy's e4m3 of x / scale, saturated (the cast alone overflows to NaN)."""
    return np.clip(np.asarray(x, np.float32) / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn)


def _batch(key, K=2, G=2, H=128, S=8, P=8):
    """Two sequences (7 and 5 tokens) on scattered pages; K/V large enough that some
    values saturate at the scales used."""
    kq, kk, kv = jax.random.split(key, 3)
    T = 12
    q = jax.random.normal(kq, (T, K * G, H), jnp.float32)
    k = jax.random.normal(kk, (T, K, H), jnp.float32) * 3
    v = jax.random.normal(kv, (T, K, H), jnp.float32) * 3
    slots = jnp.asarray([3 * S + i for i in range(7)] + [5 * S + i for i in range(5)])
    return dict(q=q, k=k, v=v, slots=slots, qs=jnp.asarray([0, 7, 12], jnp.int32),
                sl=jnp.asarray([7, 5], jnp.int32), pt=jnp.asarray([[3, 1], [5, 0]], jnp.int32),
                shape=(P, S, 2 * K, H))


K_SCALE, V_SCALE = 0.02, 0.05  # 3-sigma K / 0.02 = 450: the tails saturate


@functools.partial(jax.jit, static_argnames=("backend", "sm_scale"))
def _attend(q, pool, qs, sl, pt, *, backend, sm_scale, **scales):
    """One compiled program per case (the reference run eagerly compiles op by op)."""
    return attention.ragged_paged_attention(q, pool, qs, sl, pt, 2, sm_scale=sm_scale,
                                            backend=backend, **scales)


def test_ref_attention_on_fp8_pool_equals_dequantised_oracle():
    b = _batch(jax.random.key(0))
    pool = attention.write_kv(jnp.zeros(b["shape"], ref.FP8_DTYPE), b["k"], b["v"],
                              b["slots"], k_scale=K_SCALE, v_scale=V_SCALE)
    assert pool.dtype == jnp.float8_e4m3fn
    k8, v8 = _np_e4m3(b["k"], K_SCALE), _np_e4m3(b["v"], V_SCALE)
    stored = np.asarray(pool).reshape(-1, *b["shape"][2:])[np.asarray(b["slots"])]
    np.testing.assert_array_equal(stored[:, 0::2].view(np.uint8), k8.view(np.uint8))
    np.testing.assert_array_equal(stored[:, 1::2].view(np.uint8), v8.view(np.uint8))
    assert np.abs(k8.astype(np.float32)).max() == 448  # saturated, not NaN
    # The oracle: float32 attention over the dequantised values.
    deq = attention.write_kv(jnp.zeros(b["shape"], jnp.float32),
                             jnp.asarray(k8.astype(np.float32) * K_SCALE),
                             jnp.asarray(v8.astype(np.float32) * V_SCALE), b["slots"])
    args = (b["qs"], b["sl"], b["pt"])
    sm = b["shape"][-1] ** -0.5
    want = _attend(b["q"], deq, *args, sm_scale=sm, backend="xla")
    got = _attend(b["q"], pool, *args, sm_scale=sm, backend="xla", k_scale=K_SCALE,
                  v_scale=V_SCALE)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)
    # Without the scales the same pages read as 1.0-scaled: wrong, and visibly so.
    unscaled = _attend(b["q"], pool, *args, sm_scale=sm, backend="xla",
                       k_scale=1.0, v_scale=1.0)
    assert np.abs(np.asarray(unscaled) - np.asarray(want)).max() > 1.0


@pytest.mark.parametrize("packed", [False, True], ids=["2K-H128", "packed-H64"])
def test_tpu_kernel_reads_fp8_pool(packed):
    H = 64 if packed else 128
    b = _batch(jax.random.key(1), H=H)
    pool = attention.write_kv(jnp.zeros(b["shape"], ref.FP8_DTYPE), b["k"], b["v"],
                              b["slots"], k_scale=K_SCALE, v_scale=V_SCALE)
    args = (b["qs"], b["sl"], b["pt"])
    want = _attend(b["q"], pool, *args, sm_scale=H**-0.5, backend="xla", k_scale=K_SCALE,
                   v_scale=V_SCALE)
    if packed:  # the same bytes as [P, S, K, 2H]
        P, S, J, _ = b["shape"]
        pool = pool.reshape(P, S, J // 2, 2 * H)
        assert attention.is_packed(b["q"], pool)
    with attention.interpret_mode():
        got = _attend(b["q"], pool, *args, sm_scale=H**-0.5, backend="tpu",
                      k_scale=K_SCALE, v_scale=V_SCALE)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)


def test_tpu_jax_refuses_fp8_pool_by_name():
    """JAX's shipped TPU kernel has no FP8 path (the GPU kernels' FP8 check is the
    start-up self-test's, test_startup_self_test_checks_the_fp8_pool)."""
    b = _batch(jax.random.key(2))
    pool = jnp.zeros(b["shape"], ref.FP8_DTYPE)
    with attention.interpret_mode(), pytest.raises(ValueError, match="FP8"):
        attention.decode_attention(b["q"][:2], pool, b["sl"], b["pt"], sm_scale=1.0,
                                   backend="tpu_jax")


@pytest.fixture(scope="module")
def fp8_llm(engines):
    from lp_jax import LLM

    return LLM(**engines.kwargs("chunked"), kv_cache_dtype="fp8")


def _teacher_forced(llm, i):
    """Logprobs of prompt i + 7 golden greedy tokens at every position after the first."""
    ids = PROMPTS[i] + GOLDEN[f"greedy_{i}"][:CONTINUATION].tolist()
    out = llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(
        temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    return ids, np.asarray([out.prompt_logprobs[p][ids[p]] for p in range(1, len(ids))])


def _golden_logprobs(i):
    """The float32 path's (HF's golden; the float32 cache matches it within 1e-4,
    tests/test_logprobs.py) logprobs of the same positions."""
    ids = PROMPTS[i]
    plp = GOLDEN[f"prompt_logprobs_{i}"]
    prompt = [plp[p - 1, ids[p]] for p in range(1, len(ids))]
    return np.asarray(prompt + GOLDEN[f"greedy_logprobs_{i}"][:CONTINUATION].tolist())


def test_engine_fp8_cache_equals_dequantised_oracle_and_drift_is_bounded(
        fp8_llm, tiny_model, monkeypatch):
    from lp_jax.models import simple, stacked

    runner = fp8_llm.engine.runner
    assert runner.kv_pages.dtype == jnp.float8_e4m3fn
    # Oracle: the float32 model, its cache holding e4m3(x) * 1.0 (the tiny checkpoint has
    # no scales: vLLM's 1.0), through the plain single-sequence forward.
    def fake_quant_write(kv, k, v, slots, **_):
        deq = [jnp.clip(x, -448, 448).astype(jnp.float8_e4m3fn).astype(jnp.float32)
               for x in (k, v)]
        return ref.write_kv(kv, *deq, slots)

    monkeypatch.setattr(stacked, "write_kv", fake_quant_write)
    simple._forward.clear_cache()  # no program traced with the plain write_kv
    drift = 0.0
    for i in range(3):
        ids, got = _teacher_forced(fp8_llm, i)
        if i == 2:  # the 40-token prompt (its prefill is 3 chunks): one oracle program
            _, logits = simple.greedy_generate(tiny_model, ids, 1, return_prompt_logits=True)
            logp = np.asarray(jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1))
            want = np.asarray([logp[p - 1, ids[p]] for p in range(1, len(ids))])
            np.testing.assert_allclose(got, want, atol=1e-4)
        drift = max(drift, float(np.abs(got - _golden_logprobs(i)).max()))
    simple._forward.clear_cache()  # nor one traced with the fake quantiser left behind
    print(f"fp8 KV cache: max |d logprob| vs float32 = {drift:.3f}")
    assert 0.0 < drift < DRIFT_BOUND
    assert fp8_llm.stats()["compilations_after_warmup"] == 0


def test_engine_fp8_greedy_serves_and_pool_bytes(fp8_llm):
    """Greedy decoding through the FP8 cache runs (prefill, decode across a page), and
    the pool is one byte a value: a quarter of the float32 tiny model's, half of bf16."""
    outs = fp8_llm.generate(prompt_token_ids=PROMPTS, sampling_params=SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [8, 8, 8]
    cfg, sc = fp8_llm.engine.model_config, fp8_llm.engine.scheduler.config
    assert fp8_llm.engine.runner.memory()["kv"] == sc.num_pages * kv_cache.kv_page_bytes(
        cfg, sc.page_size)
    bf16 = cfg.replace(kv_cache_dtype="auto")
    assert 2 * kv_cache.kv_page_bytes(cfg, 16) == kv_cache.kv_page_bytes(bf16, 16, "bfloat16")


def test_default_page_count_doubles(fp8_llm, monkeypatch):
    """The engine sizes the pool from free memory: the same memory holds twice the FP8
    pages of bf16."""
    from lp_jax.engine.llm_engine import LLMEngine

    cfg = fp8_llm.engine.model_config
    fake = types.SimpleNamespace(config=EngineConfig(max_num_seqs=10_000, page_size=16,
                                                     kv_memory_fraction=0.5),
                                 mesh=fp8_llm.engine.mesh, _draft_model=None)
    dev = types.SimpleNamespace(memory_stats=lambda: {"bytes_limit": 1 << 30,
                                                      "bytes_in_use": 0})
    monkeypatch.setattr(jax, "local_devices", lambda: [dev])
    pages = {}
    for fmt in ("auto", "fp8"):
        fake.model_config = cfg.replace(kv_cache_dtype=fmt, dtype="bfloat16")
        pages[fmt] = LLMEngine._default_kv_pages(fake, types.SimpleNamespace(
            dtype=jnp.bfloat16), max_model_len=512)
    assert pages["fp8"] == 2 * pages["auto"] > 0


@pytest.mark.parametrize("bad", ["fp16", "int8", "fp8_e5m2", None])
def test_bad_kv_cache_dtype_refused_before_compiling(bad, tiny_dir):
    from lp_jax import LLM

    before = compile_guard.compilations()
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        LLM(model=str(tiny_dir), kv_cache_dtype=bad, log=None)
    assert compile_guard.compilations() == before
    assert resolve_kv_cache_dtype("fp8_e4m3") == resolve_kv_cache_dtype("fp8") == "fp8"
    from lp_jax.aot import AotConfig

    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        AotConfig(platform="tpu", kv_cache_dtype=bad)


def test_checkpoint_scales_under_vllm_names(tmp_path, tiny_dir):
    from lp_jax.config import ModelConfig
    from lp_jax.safetensors_io import save_file

    cfg = ModelConfig.from_pretrained(tiny_dir).replace(kv_cache_dtype="fp8")
    assert kv_cache.read_kv_scales(tiny_dir, cfg) == ()  # none: 1.0 everywhere
    a = "model.layers.{}.self_attn."
    save_file({
        a.format(0) + "k_scale": np.float32(0.5).reshape(()),  # vLLM's own names
        a.format(0) + "v_scale": np.asarray([0.25], np.float32),
        a.format(1) + "k_proj.k_scale": np.float32(2.0).reshape(()),  # ModelOpt's
        a.format(1) + "v_proj.v_scale": np.float32(4.0).reshape(()),
        a.format(2) + "kv_scale": np.float32(3.0).reshape(()),  # deprecated: both
        a.format(3) + "q_proj.weight_scale": np.ones((4, 1), np.float32),  # not a KV scale
    }, tmp_path / "model.safetensors")
    scales = kv_cache.read_kv_scales(tmp_path, cfg)
    assert scales[:4] == ((0.5, 0.25), (2.0, 4.0), (3.0, 3.0), (1.0, 1.0))
    assert len(scales) == cfg.num_hidden_layers
    table = kv_cache.layer_kv_scales(cfg.replace(kv_scales=scales), jnp.int32(1))
    assert (float(table["k_scale"]), float(table["v_scale"])) == (2.0, 4.0)
    assert kv_cache.layer_kv_scales(cfg.replace(kv_cache_dtype="auto"), 0) == {}
    save_file({a.format(0) + "k_scale": np.float32(-1.0).reshape(())},
              tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="positive finite"):
        kv_cache.read_kv_scales(tmp_path, cfg)


@pytest.mark.skipif(not compile_targets.libtpu_available(),
                    reason=f"libtpu is not importable: {compile_targets.LIBTPU_HINT}")
def test_fp8_decode_kernel_compiles_for_v5e_without_a_pool_copy():
    """The real TPU compiler (libtpu) at Qwen3-30B-A3B heads (K = 4: 2K = 8 e4m3 rows per
    key, under the 32-row tile of 8-bit values): the pool reaches the Mosaic call as a
    bitcast of the parameter, never a copy; the scales are the [2] SMEM operand. v5e:
    no fp8 arithmetic, the conversion is the VPU's (v6e and the packed GPT-OSS pool
    compile the same, measured 2026-12-04)."""
    from tests.test_tpu_compile import _kernel_operand_root

    sd = jax.ShapeDtypeStruct
    kv = sd((8192, 16, 8, 128), ref.FP8_DTYPE)
    args = (sd((8, 32, 128), jnp.bfloat16), kv, sd((8,), jnp.int32), sd((8, 16), jnp.int32),
            sd((2,), jnp.float32))
    compiled = compile_targets.compile_tpu(
        lambda q, kv, lens, pt, s: tpu.decode_attention(q, kv, lens, pt, sm_scale=0.1,
                                                        k_scale=s[0], v_scale=s[1]),
        args, topology="v5e:2x2", mesh_shape=(1,))
    hlo = compiled.as_text()
    assert _kernel_operand_root(hlo, 3) == ("parameter", "f8e4m3fn[8192,16,8,128]")
    assert _kernel_operand_root(hlo, 4) == ("parameter", "f32[2]")


def test_fp8_gpu_kernels_compile_for_h200_without_spills(tmp_path):
    """XLA's Triton and ptxas for sm_90a (no GPU), Qwen3 heads: both kernels on an FP8
    pool compile with no spill or stack, under 255 registers, and decode keeps the 3
    blocks an SM its design counts on (168 registers measured, bf16: 127)."""
    from lp_jax.aot import resources
    from pallas_kernels.attention import gpu
    from tests.test_gpu_compile import blocks_per_sm

    missing = compile_targets.cuda_compiler_missing()
    assert missing is None, missing  # as test_gpu_compile: its absence is a failure
    sd, bf16, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
    N, K, H, S, B, C = 32, 4, 128, 16, 8, 16
    # the 48-layer step's pool: past 2 GiB of pages, 64-bit offsets cost registers
    args = [sd((64, N, H), bf16), sd((393216, S, 2 * K, H), ref.FP8_DTYPE), sd((B + 1,), i32),
            sd((B,), i32), sd((B, C), i32), sd((), i32), sd((B, N, H), bf16),
            sd((2,), jnp.float32)]

    def fn(q, kv, starts, lens, table, n, q_dec, s):
        e = dict(sm_scale=H**-0.5, k_scale=s[0], v_scale=s[1])
        return (gpu.ragged_paged_attention(q, kv, starts, lens, table, n, **e),
                gpu.decode_attention(q_dec, kv, lens, table, **e))

    mesh = compile_targets.cuda_mesh("h200")
    with jax.set_mesh(mesh), resources.mosaic_dumps(tmp_path / "mosaic"):
        lowered = jax.jit(fn).lower(*compile_targets._shard_args(args, mesh, None))
        lowered.compile(compiler_options=resources.xla_dump_options(tmp_path / "xla"))
    ks = {k["name"]: k for k in resources.collect(tmp_path / "xla", tmp_path / "mosaic",
                                                  compile_targets.ptxas_path()) if k["ours"]}
    assert set(ks) == {"lp_paged_decode_attention", "lp_paged_prefill_attention"}
    assert resources.problems(list(ks.values())) == []
    for k in ks.values():
        assert k["arch"] == "sm_90a" and k["spill_stores"] == k["spill_loads"] == 0
        assert k["stack"] == 0 and 0 < k["registers"] <= 255
    assert blocks_per_sm(ks["lp_paged_decode_attention"]) >= 3


def test_startup_self_test_checks_the_fp8_pool(tiny_dir, monkeypatch):
    """The engine's kernel self-test (kernel_check) runs an FP8 model's attention kernels
    on an e4m3 pool with scales, the path it serves: the GPU kernels (interpreter),
    ragged and decode, match the reference within its tolerance, and a decode kernel
    that ignored the scales fails it."""
    from lp_jax.config import ModelConfig
    from lp_jax.executor import kernel_check
    from pallas_kernels.attention import gpu

    cfg = ModelConfig.from_pretrained(tiny_dir).replace(kv_cache_dtype="fp8")
    with attention.interpret_mode():
        kernel_check.check_attention(cfg, "gpu", jnp.float32, page_size=8)
        real = gpu.decode_attention
        monkeypatch.setattr(gpu, "decode_attention", lambda *a, k_scale=None, v_scale=None,
                            **kw: real(*a, **kw))
        with pytest.raises(kernel_check.KernelCheckError, match="differs"):
            kernel_check.check_attention(cfg, "gpu", jnp.float32, page_size=8)


def test_lp_serve_and_aot_flags_reach_the_configs():
    from lp_jax import serve
    from lp_jax.aot.__main__ import main as aot_main

    args = serve.build_parser().parse_args(["--kv-cache-dtype", "fp8_e4m3"])
    assert serve.engine_config(args).kv_cache_dtype == "fp8_e4m3"
    assert serve.engine_config(serve.build_parser().parse_args([])).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):  # argparse names the choices
        serve.build_parser().parse_args(["--kv-cache-dtype", "fp16"])
    with pytest.raises(SystemExit):
        aot_main(["--platform", "tpu", "--preset", "qwen3-30b-a3b", "--kv-cache-dtype",
                  "int8", "--out", "/nonexistent"])


def test_fp8_pool_on_a_head_sharded_mesh():
    """A Pallas kernel on a mesh runs per KV-head shard (shard_map); an FP8 pool's scales
    go to every shard (replicated): 2-way tensor mesh, GPU kernel (interpreter), equal to
    the unsharded reference."""
    from lp_jax.models.sharded_kernels import sharded_decode_attention
    from lp_jax.sharding import make_mesh

    b = _batch(jax.random.key(3))
    pool = attention.write_kv(jnp.zeros(b["shape"], ref.FP8_DTYPE), b["k"], b["v"],
                              b["slots"], k_scale=K_SCALE, v_scale=V_SCALE)
    q_dec, sm = b["q"][jnp.asarray([6, 11])], 128**-0.5
    scales = dict(k_scale=jnp.float32(K_SCALE), v_scale=jnp.float32(V_SCALE))
    want = attention.decode_attention(q_dec, pool, b["sl"], b["pt"], sm_scale=sm,
                                      backend="xla", **scales)
    mesh = make_mesh(1, 1, 2)
    with attention.interpret_mode():
        got = jax.jit(lambda q, kv, lens, pt, s: sharded_decode_attention(
            mesh, q, kv, lens, pt, sm_scale=sm, backend="gpu", **s))(
            q_dec, pool, b["sl"], b["pt"], scales)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)
