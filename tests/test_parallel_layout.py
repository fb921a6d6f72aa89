"""Tensor-parallel attention beside expert parallelism over the same devices (8 simulated
CPUs): the layout rules, vLLM's parallel sizes, and engines on TP 4 with more devices
than KV heads giving the single-device model's tokens under chunked and layered, for
Qwen3-MoE and GPT-OSS, with no compile while serving and within the program budget; the
row-split residual stream of large row buckets (models/sequence_parallel.py) too."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from checkpoints import make_tiny_quant as mtq
from checkpoints.make_tiny import ensure_tiny
from lp_jax import LLM, SamplingParams
from lp_jax.aot import AotConfig, build, load_config
from lp_jax.engine.config import EngineConfig
from lp_jax.loader import load_model, restore_params, save_params
from lp_jax.models import sequence_parallel
from lp_jax.models.backends import KernelBackends
from lp_jax.models.kv_cache import init_kv_cache, kv_page_bytes
from lp_jax.models.metadata import build_metadata
from lp_jax.models.simple import _forward, greedy_generate
from lp_jax.roofline.hardware import get_hardware
from lp_jax.roofline.layout import chip_layout, sim_parallelism
from lp_jax.roofline.model_shape import QWEN3_30B_A3B
from lp_jax.sharding import (
    kv_head_columns,
    kv_head_replicas,
    make_mesh,
    parallel_mesh_shape,
    partition_spec,
)
from lp_jax.sim.simulator import SimConfig, derive_num_pages
from pallas_kernels import compile_targets

EXPERTS = ("layers", "experts", "embed", "expert_mlp")
KV = ("kv_pages", None, "kv_combined_heads", None)
PROMPTS = [[5, 17, 99, 3, 250, 42, 7, 311, 64, 128, 9], list(range(1, 21))]
NEW_TOKENS = 6
MAX_PROGRAMS = 32  # the start-up budget at defaults (tests/test_programs.py)


def test_experts_split_over_every_chip_attention_over_tensor():
    tp8, ep8, both = make_mesh(1, 1, 8), make_mesh(1, 8, 1), make_mesh(1, 2, 4)
    assert partition_spec(EXPERTS, (4, 16, 64, 64), tp8) == P(None, "tensor", None, None)
    assert partition_spec(EXPERTS, (4, 16, 64, 64), ep8) == P(None, "expert", None, None)
    assert partition_spec(EXPERTS, (4, 16, 64, 64), both) == P(
        None, ("expert", "tensor"), None, None)
    # 12 experts do not split 8 ways: the first axis alone that divides them.
    assert partition_spec(EXPERTS, (4, 12, 64, 64), both) == P(None, "expert", None, None)
    assert partition_spec(EXPERTS, (4, 9, 64, 64), both) == P(None, None, None, None)
    # Attention's heads and the vocabulary split over "tensor" only.
    assert partition_spec(("embed", "q_heads"), (64, 256), both) == P(None, "tensor")
    assert partition_spec(("vocab", "embed"), (512, 64), ep8) == P(None, None)
    # KV pool: whole (K, V) pairs per device, else replicated.
    assert partition_spec(KV, (8, 16, 16, 8), tp8) == P(None, None, "tensor", None)
    assert partition_spec(KV, (8, 16, 8, 8), tp8) == P(None, None, None, None)


def test_kv_head_replicas_keep_one_head_per_device():
    tp8 = make_mesh(1, 1, 8)
    assert kv_head_replicas(4, 32, tp8) == 2  # Qwen3-30B-A3B on 8 chips
    assert kv_head_replicas(8, 64, tp8) == 1  # GPT-OSS-20B: one head each already
    assert kv_head_replicas(4, 32, make_mesh(1, 8, 1)) == 1  # attention not split
    assert kv_head_replicas(3, 24, tp8) == 1  # 3 does not divide 8: replicated pool
    assert kv_head_replicas(2, 4, tp8) == 1  # 4 query heads cannot split 8 ways
    # The k/v projections' columns follow the pool: Qwen3-30B-A3B's 4 heads of 128, twice.
    assert list(kv_head_columns(4, 128, 2)[::128]) == [0, 0, 128, 128, 256, 256, 384, 384]
    assert list(kv_head_columns(4, 128, 2, block=128)) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert list(kv_head_columns(2, 16, 2, block=128)) == [0]  # one partial block
    assert kv_head_columns(2, 192, 2, block=128) is None  # a block would mix two heads
    cfg = load_config("qwen3-30b-a3b")
    whole = kv_page_bytes(cfg, 16)
    assert kv_page_bytes(cfg, 16, mesh=make_mesh(1, 8, 1)) == whole
    assert kv_page_bytes(cfg, 16, mesh=tp8) == whole // 4


def test_vllm_parallel_sizes_map_onto_the_mesh():
    assert parallel_mesh_shape(tensor_parallel_size=8, enable_expert_parallel=True) == {
        "data": 1, "expert": 1, "tensor": 8}
    assert parallel_mesh_shape(mesh_shape=(2, 4)) == {"data": 1, "expert": 2, "tensor": 4}
    assert parallel_mesh_shape(tensor_parallel_size=4, has_experts=False)["tensor"] == 4
    with pytest.raises(ValueError, match="needs enable_expert_parallel"):
        parallel_mesh_shape(tensor_parallel_size=8)
    with pytest.raises(ValueError, match="independent replicas"):
        parallel_mesh_shape(data_parallel_size=2)
    with pytest.raises(ValueError, match="cannot be combined"):
        EngineConfig(mesh_shape=(1, 8), tensor_parallel_size=8)
    with pytest.raises(ValueError, match="positive int"):
        EngineConfig(tensor_parallel_size=0)


def test_aot_and_lp_serve_take_vllms_flags(capsys):
    from lp_jax.aot.__main__ import main
    from lp_jax.serve import build_parser, engine_config

    args = ["--platform", "tpu", "--preset", "qwen3-30b-a3b", "--out", "/tmp/unused"]
    assert main([*args, "--tensor-parallel-size", "8"]) == 2  # refused before compiling
    assert "needs enable_expert_parallel" in capsys.readouterr().err
    assert main([*args, "--mesh", "1,8,1", "--enable-expert-parallel"]) == 2
    assert "cannot be combined" in capsys.readouterr().err
    cfg = engine_config(build_parser().parse_args(
        ["--tensor-parallel-size", "8", "--enable-expert-parallel"]))
    assert (cfg.tensor_parallel_size, cfg.enable_expert_parallel) == (8, True)


@pytest.mark.skipif(not compile_targets.libtpu_available(), reason=compile_targets.LIBTPU_HINT)
def test_tp8_with_experts_holds_a_quarter_of_the_kv_a_chip():
    """Qwen3-30B-A3B on v6e 2x4 (abstract build, nothing compiled): TP 8 with the experts on
    the same chips holds a quarter of (1, 8, 1)'s KV bytes a chip for the same pool, and
    the roofline's layout gives the build's weight and KV bytes."""
    cfg, aot = load_config("qwen3-30b-a3b"), dict(platform="tpu", topology="v6e:2x4")
    builds = {mesh: build(cfg, AotConfig(mesh_shape=mesh, **aot))
              for mesh in ((1, 8, 1), (1, 1, 8))}
    assert builds[(1, 1, 8)].kv_bytes_per_device * 4 == builds[(1, 8, 1)].kv_bytes_per_device
    for mesh, b in builds.items():
        layout = chip_layout(QWEN3_30B_A3B, mesh)
        tokens = b.args[1].shape[0] // cfg.num_hidden_layers * b.args[1].shape[1]
        assert b.kv_bytes_per_device == tokens * layout.kv_bytes_per_token
        assert b.weight_bytes_per_device == pytest.approx(layout.weight_bytes, rel=0.01)


def test_the_simulator_sees_the_layouts_kv_room():
    hw = get_hardware("TPU v6e")
    sim = SimConfig(shape=QWEN3_30B_A3B, hardware=hw, **sim_parallelism((1, 1, 8)))
    layout = chip_layout(QWEN3_30B_A3B, (1, 1, 8))
    # The simulator splits every weight t ways; the engine keeps the router whole (22 MB).
    assert derive_num_pages(sim) * sim.page_size == pytest.approx(
        layout.kv_tokens(hw.hbm_bytes), rel=1e-2)
    assert layout.kv_tokens(hw.hbm_bytes) > 4 * chip_layout(QWEN3_30B_A3B, (1, 8, 1)).kv_tokens(
        hw.hbm_bytes)
    with pytest.raises(ValueError, match="expresses lp_jax's"):
        sim_parallelism((1, 8, 1))


def _kv_projections(model) -> dict[str, np.ndarray]:
    """Every k/v projection weight and bias of `model` in float32, a quantized weight
    dequantised by its scale (numpy, per block of the format's scheme)."""
    attn, q = model.model.layers.self_attn, model.config.quantization
    out = {}
    for name in ("k_proj", "v_proj", "k_proj_bias", "v_proj_bias"):
        if not hasattr(attn, name):
            continue
        w = np.asarray(getattr(attn, name)[...]).astype(np.float32)
        if hasattr(attn, name + "_scale"):
            s = np.asarray(getattr(attn, name + "_scale")[...])
            bk, bn = q.scheme.block_k_for(w.shape[-2]), q.scheme.block_n
            w = w * np.repeat(np.repeat(s, bk, -2), bn, -1)[..., :w.shape[-2], :w.shape[-1]]
        out[name] = w
    return out


@pytest.mark.parametrize("preset,kw", [
    ("tiny-glm", {}),  # biases, q/k norms
    ("tiny-fp8", {}),  # HF FP8 blocks: a 128-column block spans both heads
    ("tiny-fp8-base", {"quantization": "int8"}),  # per channel, at load
])
def test_kv_projections_hold_whole_heads_on_more_devices_than_kv_heads(preset, kw):
    """TP 4 over 2 KV heads: the k/v projections hold each head twice, as the pool does,
    so each device holds one whole head (no head-half exchange in the layer, no
    relayout of a sub-lane shard on TPU); in every format the loader produces, with the
    single-device model's values."""
    d = mtq.ensure_tiny_quant(preset) if preset.startswith("tiny-fp8") else ensure_tiny(
        preset=preset)
    one, tp4 = load_model(d, **kw), load_model(d, mesh=make_mesh(1, 1, 4), **kw)
    K, H = one.config.num_key_value_heads, one.config.head_dim
    want = {n: np.repeat(w.reshape(*w.shape[:-1], K, H), 2, axis=-2).reshape(
        *w.shape[:-1], 2 * K * H) for n, w in _kv_projections(one).items()}
    got = _kv_projections(tp4)
    assert got.keys() == want.keys() and {"k_proj", "v_proj"} <= set(got)
    for name, w in want.items():
        np.testing.assert_array_equal(got[name], w, err_msg=name)
    k = tp4.model.layers.self_attn.k_proj[...]
    assert k.sharding.spec[-1] == "tensor" and k.sharding.shard_shape(k.shape)[-1] == H


def test_saved_params_keep_the_checkpoints_kv_heads(tmp_path, tiny_dir, tiny_model):
    """Saved from TP 4 (heads copied), the parameters are the checkpoint's K heads: one
    device restores the single-device model, TP 4 the copies again."""
    tp4 = load_model(tiny_dir, mesh=make_mesh(1, 1, 4))
    save_params(tp4, tmp_path / "ckpt")
    for model, mesh in ((tiny_model, None), (tp4, make_mesh(1, 1, 4))):
        restored = restore_params(tiny_model.config, tmp_path / "ckpt", mesh=mesh)
        for name in ("k_proj", "v_proj", "q_proj"):
            a = getattr(restored.model.layers.self_attn, name)[...]
            b = getattr(model.model.layers.self_attn, name)[...]
            assert a.sharding.spec == b.sharding.spec, name
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


@pytest.fixture(scope="module")
def references():
    """{preset: greedy tokens of the single-device model} (xla kernels)."""
    out = {}
    for preset in ("tiny", "tiny-gpt-oss"):
        model = load_model(ensure_tiny(preset=preset))
        rows = max(map(len, PROMPTS))
        out[preset] = [greedy_generate(model, p, NEW_TOKENS, backends=KernelBackends(
            moe="xla", attention="xla"), prefill_rows=rows,
            num_pages=-(-(rows + NEW_TOKENS) // 16)) for p in PROMPTS]
    return out


@pytest.fixture(scope="module")
def tp_engines():
    """tp_engines(preset, scheduling): the module's TP 4 engine of that kind, built on
    first use. One row bucket (16 prefill rows beside 2 decodes), so one program serves
    every step; backends "off": the xla kernels need no start-up self-test."""
    built = {}

    def get(preset: str, scheduling: str) -> LLM:
        if (preset, scheduling) not in built:
            built[preset, scheduling] = LLM(
                str(ensure_tiny(preset=preset)), tensor_parallel_size=4,
                enable_expert_parallel=True, scheduling=scheduling, max_num_seqs=2,
                max_model_len=64, max_num_batched_tokens=16, token_buckets=(18,),
                kv_pages=16, backends="off", log=None)
        return built[preset, scheduling]

    return get


@pytest.mark.parametrize("preset,scheduling", [("tiny", "chunked"), ("tiny", "layered"),
                                               ("tiny-gpt-oss", "chunked"),
                                               ("tiny-gpt-oss", "layered")])
def test_tp_attention_with_experts_on_the_same_devices(references, tp_engines, preset,
                                                       scheduling):
    """TP 4 over 2 KV heads: the pool keeps each head twice, one per device; the experts
    split over the same 4 devices; tokens are the single-device model's."""
    llm = tp_engines(preset, scheduling)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=SamplingParams(
        temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in outs] == references[preset]
    runner = llm.engine.runner
    kv = runner.kv_pages
    K = llm.engine.model_config.num_key_value_heads
    assert kv.shape[2] == 2 * K * 2 and kv.sharding.spec == P(None, None, "tensor")
    assert kv.sharding.shard_shape(kv.shape)[2] == 2  # one (K, V) pair per device
    k_proj = runner.state["model"]["layers"]["self_attn"]["k_proj"][...]  # heads copied too
    assert k_proj.sharding.shard_shape(k_proj.shape)[-1] == llm.engine.model_config.head_dim
    experts = runner.state["model"]["layers"]["mlp"]["experts_gate_up_proj"][...]
    assert experts.sharding.spec[1] == "tensor" and len(experts.sharding.device_set) == 4
    stats = llm.stats()
    assert stats["compilations_after_warmup"] == 0
    assert stats["programs"] == 1 and stats["startup_compilations"] <= MAX_PROGRAMS


def test_penalties_read_counts_kept_on_the_vocabulary_split(references, tp_engines, engines):
    """The sampler's token counts live split over the vocabulary as the logits do (no
    vocabulary-wide gather a step); penalised greedy tokens equal the single-device
    engine's, and differ from plain greedy ones, so the counts were read."""
    penalized = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                               presence_penalty=0.5, frequency_penalty=0.5,
                               repetition_penalty=1.5)
    llm = tp_engines("tiny", "chunked")
    got = [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS,
                                             sampling_params=penalized)]
    counts = llm.engine.runner.counts
    assert all(x.sharding.spec == P(None, "tensor") for x in counts.values())
    want = [o.token_ids for o in engines("chunked").generate(prompt_token_ids=PROMPTS,
                                                             sampling_params=penalized)]
    assert got == want and got != references["tiny"]
    assert llm.stats()["compilations_after_warmup"] == 0


def test_row_split_residual_stream_gives_the_single_device_tokens(references, monkeypatch):
    """TP 4 with the experts over the same devices, the 20-row prefill above the row
    threshold (lowered for the test): each device keeps 5 rows of the residual stream,
    o_proj's partial sums are reduce-scattered to them, and the prefill's greedy token is
    the single-device model's (decode keeps the replicated stream: one row)."""
    monkeypatch.setattr(sequence_parallel, "MIN_ROWS", 16)
    model = load_model(ensure_tiny(preset="tiny"), mesh=make_mesh(1, 1, 4))
    row_axis, tp4 = sequence_parallel.row_axis, make_mesh(1, 1, 4)
    assert row_axis(tp4, 20, 8) == "tensor" and row_axis(None, 20, 8) is None
    assert row_axis(tp4, 18, 8) is None and row_axis(tp4, 12, 8) is None  # 4 ways; < 16
    assert row_axis(make_mesh(1, 4, 1), 20, 8) is None  # attention not split
    backends = KernelBackends(moe="xla", attention="xla")
    prompt, rows = PROMPTS[1], max(map(len, PROMPTS))
    pages = -(-(rows + NEW_TOKENS) // 16)
    got = greedy_generate(model, prompt, 1, backends=backends, prefill_rows=rows,
                          num_pages=pages)
    assert got == references["tiny"][1][:1]
    graphdef, state = nnx.split(model)
    meta = build_metadata([(0, len(prompt), list(range(pages)))], page_size=16,
                          num_tokens=rows, num_seqs=1, pages_per_seq=pages)
    text = _forward.lower(graphdef, state, init_kv_cache(model.config, pages, 16, model.dtype),
                          jnp.zeros(rows, jnp.int32), meta, decode_only=False,
                          backends=backends).as_text()
    # XLA:CPU writes a reduce-scatter as an all-reduce and a slice, so the split is read
    # off the program's sharding constraints: the stream entering the loop and o_proj's
    # output split over rows, the normed rows gathered whole before q/k/v and the MoE.
    stream = f"tensor<{rows}x{model.config.hidden_size}x"
    split = [ln for ln in text.splitlines() if "sharding_constraint" in ln and stream in ln]
    assert sum('[{"tensor"}, {}]' in ln for ln in split) == 2
    assert sum("[{}, {}]" in ln for ln in split) >= 2
