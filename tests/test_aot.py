"""`python -m lp_jax.aot`: the engine's programs compiled for a real TPU (libtpu on this
host) and for an H200 (the CUDA plugin and ptxas on this host, kernel resources read
from the compilers' reports), exported for cuda where the plugin is absent, and audited;
configurations that cannot fit are refused.

A mid-size Qwen3-MoE (head_dim 128, the TPU attention kernel's lane width) keeps the
compiles to seconds; one row bucket is enough to exercise every part of the step.
"""

import json

import pytest

from lp_jax.aot import AotConfig, build, load_config, run
from lp_jax.aot.__main__ import main
from pallas_kernels.compile_targets import libtpu_available

MID = {
    "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 2048,
    "hidden_size": 512, "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 128, "intermediate_size": 1024,
    "moe_intermediate_size": 256, "num_experts": 16, "num_experts_per_tok": 4,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 1024,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "eos_token_id": 0,
}
ENGINE = dict(scheduling="layered", max_model_len=256, max_num_seqs=4,
              max_num_batched_tokens=60, token_buckets=(64,))
needs_libtpu = pytest.mark.skipif(not libtpu_available(),
                                  reason="libtpu is not installed: pip install -e '.[tpu]'")


@pytest.fixture(scope="module")
def mid_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("mid")
    (d / "config.json").write_text(json.dumps(MID))
    return d


@needs_libtpu
def test_tpu_compile_on_an_expert_parallel_mesh_passes_the_audit(mid_dir, tmp_path):
    out = tmp_path / "tpu"
    code = main(["--platform", "tpu", "--topology", "v6e:2x2", "--mesh", "1,2,1",
                 "--config", str(mid_dir), "--scheduling", "layered", "--max-model-len", "256",
                 "--max-num-seqs", "4", "--max-num-batched-tokens", "60",
                 "--token-buckets", "64", "--out", str(out)])
    summary = json.loads((out / "summary.json").read_text())
    assert code == 0 and summary["violations"] == [] and summary["num_programs"] == 1
    prog = summary["programs"][0]
    assert prog["compile_s"] > 0 and prog["serialized_bytes"] > 0
    assert 0 < prog["memory"]["temp"] < summary["layer_expert_bytes_per_device"]
    assert prog["listed"]["pallas_calls"]["tpu_custom_call"] >= 3  # MoE x2, attention
    assert (out / "program_64.stablehlo.txt").stat().st_size > 0


@needs_libtpu
def test_tpu_compile_for_a_multi_host_slice(tmp_path):
    """v6e:4x4 is 16 chips on 4 hosts: the compile-only devices span 4 processes and one
    program is compiled for all of them. 8 experts per chip as in the test above (with 1,
    a chip's [1, D, 2F] experts have one q_proj layer's shape; on v5e XLA prefetches this
    tiny model's whole expert stack into VMEM in per-layer slices: both trip the audit)."""
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(dict(MID, num_experts=128)))
    out = tmp_path / "tpu16"
    code = main(["--platform", "tpu", "--topology", "v6e:4x4", "--mesh", "1,16,1",
                 "--config", str(tmp_path / "cfg"), "--max-model-len", "256", "--max-num-seqs",
                 "4", "--max-num-batched-tokens", "60", "--token-buckets", "64", "--out", str(out)])
    summary = json.loads((out / "summary.json").read_text())
    assert code == 0 and summary["violations"] == []
    assert summary["devices"] == 16 and summary["hosts"] == 4
    assert "mhlo.num_partitions = 16" in (out / "program_64.stablehlo.txt").read_text()


@pytest.fixture
def export_only(monkeypatch):
    """As on a host without the CUDA plugin: cuda programs are exported, not compiled."""
    import pallas_kernels.compile_targets as ct

    monkeypatch.setattr(ct, "cuda_compiler_missing",
                        lambda: f"no CUDA compiler here (a test): {ct.CUDA_HINT}")


@pytest.fixture(scope="module")
def cuda_compiled(mid_dir, tmp_path_factory):
    """One mid-size program compiled for an H200 by the CLI, and its printed lines."""
    out, lines = tmp_path_factory.mktemp("cuda"), []
    summary = run(load_config(str(mid_dir)), AotConfig(platform="cuda", **ENGINE), out,
                  log=lines.append)
    return summary, lines, out


def test_cuda_compile_reads_every_kernel_and_passes_the_audit(cuda_compiled):
    summary, lines, out = cuda_compiled
    assert lines[0].startswith("cuda: compiling every program for one NVIDIA H200 141GB HBM3e")
    assert summary["mode"] == "compile" and summary["violations"] == []
    prog = summary["programs"][0]
    assert prog["compile_s"] > 0 and prog["serialized_bytes"] > 0
    assert prog["memory"]["alias"] >= summary["kv_bytes_per_device"]
    assert prog["listed"]["pallas_calls"]["mosaic_gpu"] >= 2  # gate/up and down
    assert any("q_proj" in name for name in prog["listed"]["sliced_for_xla_dots"])
    ours = {k["kernel"].split("[")[0]: k for k in summary["our_kernels"]}
    assert set(ours) == {"mosaic_gpu", "lp_paged_decode_attention",
                         "lp_paged_prefill_attention"}
    assert len(summary["our_kernels"]) == 4  # the two Mosaic kernels differ
    for k in summary["our_kernels"]:
        assert k["registers"] > 0 and k["spill_stores"] == 0 and k["stack"] == 0
        assert k["threads"][0] in (128, 256) and k["shared_bytes"] > 0 and k["grids"]
    xla = [k for k in prog["kernels"] if k["source"] == "xla"]
    assert xla and all("grid" in k and "threads" in k for k in xla)
    assert not (out / "dumps").exists()  # removed once read


def test_the_compiled_audit_catches_spills_an_unaliased_pool_and_no_room(cuda_compiled,
                                                                        mid_dir):
    import copy
    import dataclasses

    from lp_jax.aot.audit import _check_compiled

    summary, _, _ = cuda_compiled
    cfg = AotConfig(platform="cuda", **ENGINE)
    b = build(load_config(str(mid_dir)), cfg)
    prog = copy.deepcopy(summary["programs"][0])
    assert _check_compiled(prog, b, cfg) == []
    spilled = next(k for k in prog["kernels"] if k["source"] == "mosaic_gpu")
    spilled["spill_stores"] = 8
    prog["memory"]["alias"] = 0
    found = _check_compiled(prog, b, dataclasses.replace(cfg, memory_fraction=1e-4))
    assert len(found) == 3, found
    assert "is not aliased" in found[0] and "spills or uses stack" in found[1]
    assert "weights + KV + temporaries" in found[2] and "x memory fraction 0.0001" in found[2]


def test_ptxas_reports_are_read_per_function():
    from lp_jax.aot.resources import ptxas_report

    text = ("ptxas info    : (C7519) warpgroup.arrive is injected in around line 9 by "
            "compiler to allow use of registers in GMMA in function 'k1'\n" + """\
ptxas info    : Compiling entry function 'k1' for 'sm_90a'
ptxas info    : Function properties for k1
    16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 255 registers, used 2 barriers, 1 bytes smem
ptxas info    : Compiling entry function 'k2' for 'sm_90a'
ptxas info    : Function properties for k2
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 380 bytes cmem[0]
""")
    assert ptxas_report(text) == {
        "k1": dict(arch="sm_90a", notes=["C7519"], stack=16, spill_stores=8, spill_loads=4,
                   registers=255, barriers=2, static_smem=1),
        "k2": dict(arch="sm_90a", notes=[], stack=0, spill_stores=0, spill_loads=0,
                   registers=40, barriers=1, static_smem=0)}


def test_cuda_export_is_the_fallback_without_the_plugin(mid_dir, tmp_path, export_only):
    lines = []
    summary = run(load_config(str(mid_dir)), AotConfig(platform="cuda", **ENGINE), tmp_path,
                  log=lines.append)
    assert lines[0].startswith("cuda: EXPORT ONLY")
    assert "pip install -e '.[gpu-compile]'" in lines[0]
    assert summary["mode"] == "export" and summary["violations"] == []
    listed = summary["programs"][0]["listed"]
    assert listed["pallas_calls"]["mosaic_gpu"] >= 2  # gate/up and down
    assert "kernels" not in summary["programs"][0] and "our_kernels" not in summary


def test_the_audit_catches_a_weight_copy(mid_dir, tmp_path, monkeypatch, export_only):
    """The `xla` MoE reference slices w[layer] (a copy of one layer's experts): a step
    built on it must fail the audit, naming the op."""
    import lp_jax.aot as aot
    from lp_jax.models.backends import KernelBackends

    monkeypatch.setattr(aot, "KernelBackends",
                        lambda moe, attention, **kw: KernelBackends(moe="xla", attention=attention,
                                                                    **kw))
    summary = run(load_config(str(mid_dir)), AotConfig(platform="cuda", **ENGINE), tmp_path,
                  log=None)
    assert summary["violations"] and "one layer's experts" in summary["violations"][0]


def test_a_model_that_cannot_fit_is_refused_before_compiling():
    with pytest.raises(ValueError, match=r"does not fit: .* GB per device .* H200"):
        build(load_config("qwen3-235b-a22b"), AotConfig(platform="cuda"))
    with pytest.raises(ValueError, match=r"does not fit: .* GB per device .* H100 80GB"):
        build(load_config("qwen3-30b-a3b"), AotConfig(platform="cuda", gpu="h100",
                                                      max_num_seqs=128))


@needs_libtpu
def test_tpu7x_is_a_target_with_two_devices_a_chip():
    """libtpu names Ironwood "tpu7x" and presents each chip as two devices; the audit
    checks a device against half the chip's 192 GiB."""
    from lp_jax.aot.chips import chip
    from pallas_kernels.compile_targets import tpu_topology_devices

    devices = tpu_topology_devices("tpu7x:2x2x1")
    assert len(devices) == 2 * 4 and devices[0].device_kind == "TPU7x"
    assert chip(AotConfig(platform="tpu", topology="tpu7x:2x2x1")) == (
        "TPU7x (Ironwood)", 96 * 2**30)


@needs_libtpu
def test_qwen3_30b_needs_a_slice_not_one_chip():
    cfg = load_config("qwen3-30b-a3b")
    with pytest.raises(ValueError, match=r"does not fit: .* TPU v6e"):
        build(cfg, AotConfig(platform="tpu", topology="v6e:2x2", mesh_shape=(1, 1, 1)))
    fits = build(cfg, AotConfig(platform="tpu", topology="v6e:2x4", mesh_shape=(1, 8, 1)))
    assert fits.weight_bytes_per_device + fits.kv_bytes_per_device < 32e9


def test_cli_reports_a_bad_configuration(capsys):
    assert main(["--platform", "cuda", "--config", "/nonexistent", "--out", "/tmp/x"]) == 2
    assert "neither a preset" in capsys.readouterr().err


def test_gpt_oss_20b_preset_exports_for_cuda(tmp_path, export_only):
    """The gpt-oss-20b preset, abstractly (no weights): one program exports and passes the
    audit (its compile: the CLI, BENCHMARKS.md; its kernels: tests/test_gpu_compile.py).
    Its [E, D] = [32, 2880] expert biases share their shape with a 32-row tile of
    activations, so the audit must not count them as expert weights."""
    cfg = load_config("gpt-oss-20b")
    assert cfg.model_type == "gpt_oss" and [cfg.layer_window(i) for i in (0, 1)] == [128, None]
    summary = run(cfg, AotConfig(platform="cuda", **ENGINE), tmp_path, log=None)
    assert summary["violations"] == [] and summary["num_programs"] == 1
    D = F = 2880
    assert summary["layer_expert_bytes_per_device"] == 32 * (D * 2 * F + F * D) * 2
    assert 41e9 < summary["weight_bytes_per_device"] < 43e9  # 21B parameters in bf16


def test_materialized_slices_count_new_buffers_only():
    """The audit's listed layer copies: an unfused copy or custom call shaped like one
    layer of a stacked weight is one; the parameters, tuples, get-tuple-elements, bitcasts
    and async prefetches of that shape (lines of glm-4.5-air's v6e program) are not."""
    from lp_jax.aot.audit import layer_copy

    others = {(1, 4096, 10944): "gate_proj|up_proj"}
    w = "bf16[1,4096,10944]{2,1,0:T(8,128)(2,1)}"
    made = [f"  %copy.203 = {w} copy(%param.85)",
            f"  %custom-call.115 = {w} custom-call(%slice-done.4, %slice-done.5)"]
    views = [f"  %param.85 = {w} parameter(3), sharding={{replicated}}",
             f"  %get-tuple-element.702 = {w} get-tuple-element(%param.29), index=0",
             f"  %tuple.181 = ({w}, bf16[520,4096]{{1,0}}) tuple(%get-tuple-element.723)",
             f"  %bitcast.528 = {w} bitcast(%custom-call.115)",
             f"  %copy-start.3 = ({w}, {w}, u32[]{{:S(2)}}) copy-start(%get-tuple-element.703)",
             f"  %copy-done.3 = {w} copy-done(%copy-start.3)",
             "  %copy.9 = bf16[4096,1408]{1,0} copy(%param.1)"]  # another shape
    assert [layer_copy(x, others) for x in made] == ["gate_proj|up_proj"] * 2
    assert [layer_copy(x, others) for x in views] == [None] * len(views)


@needs_libtpu
def test_the_step_compiles_without_a_cross_program_prefetch_on_tpu():
    """XLA:TPU would copy a whole vocabulary shard into on-chip memory every call to
    gather a few embedding rows (a cross-program prefetch); the step's compile options
    (used by the engine and the AOT alike) allow none. Without them the same program
    has one, so the check can fail."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from lp_jax.executor.step import compiler_options
    from pallas_kernels.compile_targets import tpu_topology_devices

    on = SingleDeviceSharding(tpu_topology_devices("v6e:2x2")[0])

    def embed_and_head(table_VD, ids_T, head_DV):
        x_TD = jnp.take(table_VD, ids_T, axis=0)
        return jnp.dot(x_TD, head_DV, preferred_element_type=jnp.float32).argmax(-1)

    lowered = jax.jit(embed_and_head).lower(
        jax.ShapeDtypeStruct((4096, 2048), jnp.bfloat16, sharding=on),
        jax.ShapeDtypeStruct((8,), jnp.int32, sharding=on),
        jax.ShapeDtypeStruct((2048, 4096), jnp.bfloat16, sharding=on))
    prefetch = "cross_program_prefetch_index"
    assert prefetch in lowered.compile().as_text()
    assert prefetch not in lowered.compile(compiler_options=compiler_options("tpu")).as_text()
    assert compiler_options("cpu") == {}  # the flag exists only in TPU's compiler


@pytest.mark.parametrize("scheduling, draft", [("layered", None), ("chunked", {"method": "mtp"})])
def test_the_aot_schedules_as_the_engine_under_data_parallel_attention(scheduling, draft):
    """The AOT's scheduler config is the engine's for the same arguments: under DP 4 a
    budget a rank, the hidden buffer split over data, the per-rank row buckets; with an MTP
    draft its decode rows. (It had left out the data ranks and the draft, and compiled a
    replicated hidden buffer the engine does not hold.)"""
    from lp_jax.aot import AotConfig, scheduler_config
    from lp_jax.config import ModelConfig
    from lp_jax.core.programs import step_buckets
    from lp_jax.engine.config import EngineConfig

    model_cfg = ModelConfig.from_pretrained_file("checkpoints/configs/deepseek-v3-reduced.json")
    sc = None if draft is None else draft | {"num_speculative_tokens": 2}
    aot = scheduler_config(model_cfg, AotConfig(
        platform="tpu", scheduling=scheduling, max_model_len=2048, max_num_seqs=16,
        max_num_batched_tokens=64, mesh_shape=(4, 1, 2), speculative_config=sc), 4096)
    engine = EngineConfig(scheduling=scheduling, max_model_len=2048, max_num_seqs=16,
                          max_num_batched_tokens=64, data_parallel_size=4,
                          tensor_parallel_size=2, enable_expert_parallel=True,
                          speculative_config=sc).scheduler_config(
        model_cfg, max_model_len=2048, num_pages=4096)
    assert aot.data_parallel_size == 4 and aot.rank_budgets == engine.rank_budgets
    assert aot.max_decode_rows_per_rank == engine.max_decode_rows_per_rank
    assert step_buckets(aot) == step_buckets(engine)
