"""Quantized loading (issue #31): HF fine-grained FP8 checkpoints read as they are,
int8 / fp8 per channel applied at load, and the errors, against the independent numpy
quantiser of checkpoints/make_tiny_quant.py.

Tolerances (float32 activations, so only the weight format differs):
* loaded FP8 weights dequantise exactly (bit for bit) to the numpy quantiser's;
* logits of the FP8 model against its float32 dequantised twin: |diff| <= LOGIT_ATOL
  (summation order only: the kernels' arithmetic is q * scale in float32);
* int8 / fp8 at load (of the float32 "tiny-fp8-base"): the quantized weights equal
  numpy's per-channel quantiser's (scales to one float32 ulp; values exactly, but
  for rounding ties, which that ulp may break either way), and the model's
  logits match the float32 model holding those dequantised weights within LOGIT_ATOL.
"""

import dataclasses
import functools
import json
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from checkpoints import make_tiny_quant as mtq
from checkpoints.make_tiny import ensure_tiny
from lp_jax.config import ModelConfig
from lp_jax.executor import compile_guard
from lp_jax.loader import load_model, save_params
from lp_jax.models.backends import KernelBackends
from lp_jax.models.simple import greedy_generate
from lp_jax.quant import QuantConfig
from lp_jax.quant.mxfp4 import MXFP4
from lp_jax.roofline.formats import weight_format
from lp_jax.safetensors_io import CheckpointError, SafetensorsFile
from lp_jax.sharding import make_mesh
from pallas_kernels.compile_targets import libtpu_available
from pallas_kernels.moe.ref import moe_stats
from pallas_kernels.quant import FP8_BLOCK, ref_dequantize, scheme_named

LOGIT_ATOL = 1e-4
PROMPT = [5, 17, 42, 99, 7, 250, 3, 64]
XLA = KernelBackends(moe="xla", attention="xla")
EXPERTS = [("mlp", "experts_gate_up_proj"), ("mlp", "experts_down_proj")]
DENSE = [("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"),
         ("dense_mlp", "gate_proj"), ("dense_mlp", "up_proj"), ("dense_mlp", "down_proj")]
QUANTIZED = DENSE + EXPERTS  # what tiny-fp8's checkpoint converts


@pytest.fixture(scope="module")
def fp8_dir():
    return mtq.ensure_tiny_quant("tiny-fp8")


@pytest.fixture(scope="module")
def dequant_dir():
    return mtq.ensure_tiny_quant("tiny-fp8-dequant")


@pytest.fixture(scope="module")
def base_dir():
    return mtq.ensure_tiny_quant("tiny-fp8-base")


@pytest.fixture(scope="module")
def at_load(base_dir):
    """method -> the tiny-fp8-base model quantized at load, loaded once for the module
    (the prefill programs of its _logits then serve the greedy references)."""
    return functools.cache(lambda method: load_model(base_dir, quantization=method))


@pytest.fixture(scope="module")
def fp8_model(fp8_dir):
    return load_model(fp8_dir)


@pytest.fixture(scope="module")
def dequant_model(dequant_dir):
    return load_model(dequant_dir)


def _params(model):
    return {p: v[...] for p, v in nnx.to_flat_state(nnx.state(model))}


def _dequantized(model, scheme=None, params=QUANTIZED):
    """{path: float32 dequantised weight} of the quantized `params` of `model`."""
    flat = _params(model)
    out = {}
    for kind, name in params:
        path = ("model", "layers", kind, name)
        w_q, s = np.asarray(flat[path]).astype(np.float32), np.asarray(flat[(*path[:-1],
                                                                               name + "_scale")])
        sch = scheme or FP8_BLOCK
        full = np.repeat(np.repeat(s, sch.block_k_for(w_q.shape[-2]), -2), sch.block_n, -1)
        out[path] = w_q * full[..., :w_q.shape[-2], :w_q.shape[-1]]
    return out


def test_f8_e4m3_tensors_read(tmp_path):
    w = np.linspace(-448, 448, 24, dtype=np.float32).reshape(4, 6).astype(mtq.FP8)
    mtq.save_safetensors({"w.weight": w, "w.weight_scale_inv": np.ones((1, 1), mtq.BF16)},
                         tmp_path / "a.safetensors")
    f = SafetensorsFile(tmp_path / "a.safetensors")
    got = f.get("w.weight")
    assert got.dtype == np.dtype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(got.view(np.uint8), w.view(np.uint8))
    # A dtype lp_jax does not read is named as such, with the tensor, not a KeyError.
    raw = (tmp_path / "a.safetensors").read_bytes().replace(b'"F8_E4M3"', b'"F8_E5M2"')
    (tmp_path / "b.safetensors").write_bytes(raw)
    with pytest.raises(CheckpointError, match=r"'w.weight' has dtype F8_E5M2: e5m2"):
        SafetensorsFile(tmp_path / "b.safetensors")


def test_fp8_checkpoint_detected_and_kept_quantized(fp8_model):
    """The routed experts stay e4m3 with their block scales; the dense projections the
    checkpoint converts are held dequantised (quant.served_scheme), with no scale."""
    cfg = fp8_model.config
    assert cfg.quantization.method == "fp8_block" and cfg.quantization.from_checkpoint
    layers = fp8_model.model.layers
    for kind, name in DENSE:
        assert getattr(getattr(layers, kind), name).dtype == np.float32, name
        assert not hasattr(getattr(layers, kind), name + "_scale"), name
    for kind, name in EXPERTS:
        w = getattr(getattr(layers, kind), name)
        assert w.dtype == np.dtype(ml_dtypes.float8_e4m3fn), name
        s = getattr(getattr(layers, kind), name + "_scale")
        assert s.dtype == np.float32
        assert s.shape[-2:] == FP8_BLOCK.scale_shape(*w.shape[-2:]), name
    # modules_to_not_convert: the router and o_proj stay in the checkpoint's float32.
    assert layers.mlp.gate.dtype == np.float32 and layers.self_attn.o_proj.dtype == np.float32
    assert not hasattr(layers.self_attn, "o_proj_scale")


def test_fp8_weights_dequantise_to_numpy_quantiser(fp8_model, dequant_model, fp8_dir):
    want, held = _params(dequant_model), _params(fp8_model)
    for path, got in _dequantized(fp8_model, params=EXPERTS).items():
        np.testing.assert_array_equal(got, np.asarray(want[path]), err_msg=str(path))
    for kind, name in DENSE:  # dequantised at load
        path = ("model", "layers", kind, name)
        np.testing.assert_array_equal(np.asarray(held[path]), np.asarray(want[path]),
                                      err_msg=str(path))
    # and the layout against the raw checkpoint: expert 3 of MoE layer 2 (stack index 1)
    f = SafetensorsFile(fp8_dir / "model.safetensors")
    name = "model.layers.2.mlp.experts.3.down_proj.weight"
    q, s = f.get(name), f.get(name + "_scale_inv")
    assert s.dtype == mtq.BF16 and s.shape == (1, 2)  # [D/128, F/128] of [D, F]
    mlp = fp8_model.model.layers.mlp
    np.testing.assert_array_equal(np.asarray(mlp.experts_down_proj[...])[1, 3].view(np.uint8),
                                  q.T.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(mlp.experts_down_proj_scale[...])[1, 3],
                                  s.T.astype(np.float32))


def test_orbax_keeps_fp8(tmp_path, fp8_dir, fp8_model):
    d = tmp_path / "m"
    shutil.copytree(fp8_dir, d, ignore=shutil.ignore_patterns("*.safetensors"))
    save_params(fp8_model, d / "orbax")
    got, want = _params(load_model(d)), _params(fp8_model)
    assert got.keys() == want.keys()
    for p, w in want.items():
        assert got[p].dtype == w.dtype, p
        np.testing.assert_array_equal(np.asarray(got[p]).view(np.uint8),
                                      np.asarray(w).view(np.uint8), err_msg=str(p))


def _logits(model):
    """Float32 logits of every prompt position (one prefill program per model)."""
    return greedy_generate(model, PROMPT, 1, backends=XLA, return_prompt_logits=True)[1]


@pytest.fixture(scope="module")
def dequant_logits(dequant_model):
    return _logits(dequant_model)


def test_fp8_logits_match_dequantised_float32(fp8_model, dequant_logits):
    diff = np.abs(_logits(fp8_model) - dequant_logits).max()
    print(f"fp8_block logits vs float32 dequantised: max |diff| {diff:.3g}")
    assert diff <= LOGIT_ATOL, diff


@pytest.mark.parametrize("moe, dispatch", [("tpu", "allreduce"), ("xla", "all_to_all")])
def test_fp8_experts_on_an_expert_mesh(fp8_dir, dequant_logits, monkeypatch, moe, dispatch):
    """The scales travel with their experts through shard_map: on a 2-way expert mesh,
    the TPU MoE kernel (interpret mode) under allreduce, and the reference under
    all_to_all (rows sent to their expert's shard), give the dequantised model's logits."""
    monkeypatch.setenv("LP_JAX_PALLAS_INTERPRET", "1")
    model = load_model(fp8_dir, mesh=make_mesh(expert=2))
    mlp = model.model.layers.mlp
    assert mlp.experts_down_proj_scale[...].sharding.spec[1] == "expert"
    backends = KernelBackends(moe=moe, attention="xla", moe_dispatch=dispatch)
    logits = greedy_generate(model, PROMPT, 1, return_prompt_logits=True, backends=backends)[1]
    diff = np.abs(logits - dequant_logits).max()
    assert diff <= LOGIT_ATOL, diff


def _assert_quantized_equal(got_q, want_q, ratio, err_msg):
    """got_q == want_q, except where the quantiser's input w / scale lies (within float32
    rounding of the division) on the midpoint between the two: a tie either way is right."""
    got, want = got_q.astype(np.float64), want_q.astype(np.float64)
    off = got != want
    mid = (got[off] + want[off]) / 2
    ties = np.abs(ratio[off] - mid) <= 1e-6 * np.maximum(np.abs(mid), 1)
    assert ties.all(), f"{err_msg}: {np.count_nonzero(~ties)} of {got.size} values differ"
    assert off.mean() < 1e-3, f"{err_msg}: {off.sum()} ties"


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_quantization_at_load(method, base_dir, at_load):
    model = at_load(method)
    assert model.config.quantization.method == method and model.config.expert_bytes < (
        3 * 64 * 256 * 4)
    twin = load_model(base_dir)
    f32, got = _params(twin), _params(model)
    assert model.model.layers.mlp.gate.dtype == np.float32  # the router is never converted
    for kind, name in [*QUANTIZED, ("self_attn", "o_proj")]:  # no modules_to_not_convert
        path = ("model", "layers", kind, name)
        w = np.asarray(f32[path])
        mats = w.reshape(-1, *w.shape[-2:])
        q_np, s_np = zip(*(mtq.quantize_per_channel(m, method) for m in mats), strict=True)
        q_np, s_np = np.stack(q_np).reshape(w.shape), np.stack(s_np)
        s_got = np.asarray(got[(*path[:-1], name + "_scale")])
        # amax / qmax: XLA divides by the constant as a multiply by its reciprocal, so
        # the scales agree to one float32 ulp, not bit for bit
        np.testing.assert_allclose(s_got, s_np.reshape(s_got.shape), rtol=2.4e-7, atol=0,
                                   err_msg=str(path))
        ratio = w.astype(np.float64) / s_np.reshape(s_got.shape)
        _assert_quantized_equal(np.asarray(got[path]), q_np, ratio, str(path))
        # the twin holds the dequantised weights of the model's own quantized values
        getattr(getattr(twin.model.layers, kind), name).set_value(jax.numpy.asarray(
            np.asarray(got[path]).astype(np.float32) * s_got))
    diff = np.abs(_logits(model) - _logits(twin)).max()
    print(f"{method} at load: logits vs float32 dequantised: max |diff| {diff:.3g}")
    assert diff <= LOGIT_ATOL, diff


def test_dummy_weights_quantized(base_dir):
    cfg = ModelConfig.from_pretrained(base_dir)
    model = load_model(config=cfg, load_format="dummy", quantization="int8")
    mlp = model.model.layers.mlp
    assert mlp.experts_gate_up_proj.dtype == np.int8
    s = np.asarray(mlp.experts_gate_up_proj_scale[...])
    assert s.shape == (3, 8, 1, 512) and np.all(s > 0) and np.all(np.isfinite(s))
    q = np.asarray(mlp.experts_gate_up_proj[...])
    assert np.abs(q).max() == 127  # absmax quantisation reaches the grid's end per channel
    assert model.model.layers.self_attn.o_proj_scale.shape == (4, 1, 64)


def _edit_config(src, dst, edit):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("field, value, match", [
    ("weight_block_size", [64, 64], r"weight_block_size \[64, 64\] is not supported"),
    ("quant_method", "awq", r"quant_method 'awq' is not supported"),
    ("activation_scheme", "static", r"activation_scheme 'static' is not supported"),
])
def test_unsupported_quantization_config(tmp_path, fp8_dir, field, value, match):
    d = _edit_config(fp8_dir, tmp_path / "m",
                     lambda c: c["quantization_config"].__setitem__(field, value))
    compile_guard.install()
    before = compile_guard.compilations()
    with pytest.raises(ValueError, match=match):
        load_model(d)
    assert compile_guard.compilations() == before


def test_quantization_errors_before_compile(tmp_path, fp8_dir, dequant_dir):
    compile_guard.install()
    before = compile_guard.compilations()
    with pytest.raises(ValueError, match=r"quantization='int8' disagrees with the checkpoint"):
        load_model(fp8_dir, quantization="int8")
    with pytest.raises(ValueError, match=r"unknown quantization 'int4'"):
        load_model(dequant_dir, quantization="int4")
    # asking for the format the checkpoint has is no error (as vLLM's --quantization fp8)
    assert load_model(fp8_dir, quantization="fp8").config.quantization.method == "fp8_block"
    # FP8 tensors with no quantization_config
    d = _edit_config(fp8_dir, tmp_path / "noqc", lambda c: c.pop("quantization_config"))
    with pytest.raises(CheckpointError, match=r"'model.layers.0.self_attn.q_proj.weight' is "
                                              r"FP8 \(F8_E4M3\) but config.json has no fp8"):
        load_model(d)
    # modules_to_not_convert says o_proj is converted, the checkpoint has it in float32
    d = _edit_config(fp8_dir, tmp_path / "conv", lambda c: c["quantization_config"].__setitem__(
        "modules_to_not_convert", ["lm_head", "model.embed_tokens", "mlp.gate"]))
    with pytest.raises(CheckpointError, match=r"'model.layers.0.self_attn.o_proj.weight' is "
                                              r"float32, but quantization_config \(fp8\)"):
        load_model(d)
    # some layers' o_proj kept, others converted: one stacked parameter cannot mix
    d = _edit_config(fp8_dir, tmp_path / "mixed", lambda c: c["quantization_config"].__setitem__(
        "modules_to_not_convert", ["lm_head", "mlp.gate", "model.layers.0.self_attn.o_proj"]))
    with pytest.raises(ValueError, match=r"stacked parameter self_attn.o_proj"):
        load_model(d)
    # a router stored in FP8: lp_jax never converts it
    d = tmp_path / "router"
    shutil.copytree(fp8_dir, d)
    f = SafetensorsFile(fp8_dir / "model.safetensors")
    tensors = {n: np.array(f.get(n)) for n in f.tensors}
    tensors["model.layers.2.mlp.gate.weight"] = tensors["model.layers.2.mlp.gate.weight"].astype(
        mtq.FP8)
    mtq.save_safetensors(tensors, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"'model.layers.2.mlp.gate.weight' is FP8 \("
                                              r"F8_E4M3\) but lp_jax reads model.layers.mlp.gate"):
        load_model(d)
    assert compile_guard.compilations() == before
    assert scheme_named("int8").block_k is None


# Orca and chunked share one program (the same row bucket and hidden buffer, as the shared
# engines of tests/conftest.py), so a format costs two compiles: that one and layered's,
# whose hidden buffer carries its 64-token batch between groups. Chunked's 16-token budget
# splits the 30-token prompt; layered runs it in G=2 groups.
QUANT_ENGINES = {
    "orca": dict(scheduling="orca", max_num_batched_tokens=16, token_buckets=(66,)),
    "chunked": dict(scheduling="chunked", max_num_batched_tokens=16, token_buckets=(66,)),
    "layered": dict(scheduling="layered", layer_groups=2, max_num_batched_tokens=64,
                    token_buckets=(66,)),
}
GREEDY = dict(max_tokens=4, temperature=0.0, ignore_eos=True)


def _policy_tokens(model_dir, quantization, prompts, method):
    """{policy: greedy tokens of `prompts`} from LLM(quantization=...) under each policy,
    checking the engine serves `method` and compiles nothing after warm-up."""
    from lp_jax import LLM, SamplingParams

    got = {}
    for name, kw in QUANT_ENGINES.items():
        llm = LLM(str(model_dir), quantization=quantization, max_num_seqs=2, max_model_len=64,
                  moe_backend="xla", attention_backend="xla", log=None, **kw)
        assert llm.engine.model_config.quantization.method == method
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(**GREEDY))
        got[name] = [o.token_ids for o in outs]
        assert llm.stats()["compilations_after_warmup"] == 0, name
    return got


def test_int8_greedy_tokens_equal_across_policies(base_dir, at_load):
    """LLM(quantization="int8") serves the same greedy tokens under orca, chunked and
    layered as the plain model loop on the same quantized weights, compiling nothing
    after warm-up (one row bucket, the xla kernels)."""
    from lp_jax import LLM

    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 509, n).tolist() for n in (7, 30)]
    ref = at_load("int8")
    want = [greedy_generate(ref, p, 4, num_pages=4, prefill_rows=30, backends=XLA)
            for p in prompts]  # one prefill and one decode program for both
    for name, got in _policy_tokens(base_dir, "int8", prompts, "int8").items():
        assert got == want, name
    with pytest.raises(ValueError, match="quantization must be None or one of"):
        LLM(str(base_dir), quantization="int4")


@pytest.mark.parametrize("fmt", ["fp8_block", "fp8"])
def test_fp8_greedy_tokens_equal_across_policies(fmt, fp8_dir, base_dir, fp8_model, at_load):
    """The HF FP8 checkpoint (128 x 128 blocks) and fp8 per channel at load: orca, chunked
    and layered give the same greedy tokens, and PROMPT's are the model loop's."""
    rng = np.random.default_rng(6)
    prompts = [PROMPT, rng.integers(0, 509, 30).tolist()]
    model_dir, quantization = (fp8_dir, None) if fmt == "fp8_block" else (base_dir, "fp8")
    got = _policy_tokens(model_dir, quantization, prompts, fmt)
    model = fp8_model if fmt == "fp8_block" else at_load("fp8")
    want = greedy_generate(model, PROMPT, GREEDY["max_tokens"], backends=XLA)
    for name, tokens in got.items():
        assert tokens == got["orca"], name
        assert tokens[0] == want, name


def test_mxfp4_greedy_tokens_equal_across_policies():
    """GPT-OSS with its experts in MXFP4 (quantization="mxfp4"): orca, chunked and layered
    give transformers' greedy tokens (tests/golden, on the dequantised weights) for the
    17- and 40-token golden prompts (windows of 8; the 40-token one is 3 chunks)."""
    golden = np.load("tests/golden/tiny-gpt-oss-mxfp4.npz")
    prompts = [golden[f"prompt_{i}"].tolist() for i in (1, 2)]
    want = [golden[f"greedy_{i}"][:GREEDY["max_tokens"]].tolist() for i in (1, 2)]
    d = ensure_tiny(preset="tiny-gpt-oss-mxfp4")
    for name, got in _policy_tokens(d, "mxfp4", prompts, "mxfp4").items():
        assert got == want, name


@pytest.mark.skipif(not libtpu_available(), reason="libtpu is not installed")
def test_aot_int8_qwen3_30b_fits_a_v5e_2x2():
    """The AOT plan (no compile): Qwen3-30B-A3B's bf16 weights alone overflow a v5e chip
    of a 2x2 slice with the experts split 4 ways; int8 halves them and fits."""
    from lp_jax.aot import AotConfig, build, load_config

    cfg = load_config("qwen3-30b-a3b")
    aot = dict(platform="tpu", topology="v5e:2x2", mesh_shape=(1, 4, 1), max_num_seqs=8)
    with pytest.raises(ValueError, match=r"does not fit: .* \(weights 17.6 GB"):
        build(cfg, AotConfig(**aot))
    b = build(cfg, AotConfig(**aot, quantization="int8"))
    assert b.model_config.quantization.method == "int8"
    assert b.weight_bytes_per_device + b.kv_bytes_per_device < 16e9
    assert b.layer_expert_bytes_per_device == 32 * 3 * 2048 * 768  # 1 byte a weight
    with pytest.raises(ValueError, match="unknown quantization 'int4'"):
        build(cfg, AotConfig(**aot, quantization="int4"))


@pytest.mark.skipif(not libtpu_available(), reason="libtpu is not installed")
def test_aot_gpt_oss_20b_formats_on_a_v5e_2x2():
    """The AOT plan (no compile) of GPT-OSS-20B, experts 4 ways: int8 and fp8 (at load
    of a BF16 checkpoint) store an expert weight in 1 byte, MXFP4 in half of one (XLA
    packs e2m1 two a byte, as the TPU compiler's argument sizes show), so one layer's
    experts on a chip are 1/2 and 1/4 of bf16's."""
    from lp_jax.aot import AotConfig, build, load_config

    cfg = load_config("gpt-oss-20b")
    aot = dict(platform="tpu", topology="v5e:2x2", mesh_shape=(1, 4, 1), max_num_seqs=8)
    plans = {q: build(cfg, AotConfig(**aot, quantization=q))
             for q in (None, "int8", "fp8", "mxfp4")}
    E, D, F = cfg.num_experts // 4, cfg.hidden_size, cfg.moe_intermediate_size
    layer = {q: b.layer_expert_bytes_per_device for q, b in plans.items()}
    assert layer == {None: 2 * E * 3 * D * F, "int8": E * 3 * D * F, "fp8": E * 3 * D * F,
                     "mxfp4": E * 3 * D * F // 2}
    weights = {q: b.weight_bytes_per_device for q, b in plans.items()}
    assert weights["mxfp4"] < weights["int8"] == weights["fp8"] < weights[None]
    assert plans["int8"].model_config.quantization.method == "int8"


def test_lp_serve_and_aot_take_quantization():
    from lp_jax.aot.__main__ import main as aot_main
    from lp_jax.serve import build_parser, engine_config

    assert engine_config(build_parser().parse_args(["--quantization", "fp8"])).quantization \
        == "fp8"
    assert engine_config(build_parser().parse_args([])).quantization is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--quantization", "int4"])
    with pytest.raises(SystemExit):
        aot_main(["--platform", "tpu", "--preset", "qwen3-8b", "--quantization", "awq",
                  "--out", "/tmp/unused"])


def test_mxfp4_kept_in_4_bits(tmp_path):
    """quantization="mxfp4": GPT-OSS's experts stay e2m1 (packed two a byte) with their
    power-of-two scales, dequantise exactly to what the default (16-bit) load makes of
    them, and give
    transformers' logits and greedy tokens (tests/golden, made on the dequantised
    weights)."""
    d = ensure_tiny(preset="tiny-gpt-oss-mxfp4")
    model = load_model(d, quantization="mxfp4")
    dense = load_model(d)
    mlp, want = model.model.layers.mlp, dense.model.layers.mlp
    for name in ("experts_gate_up_proj", "experts_down_proj"):
        w_q = getattr(mlp, name)[...]
        # packed: two e2m1 codes a byte, [.., K/2, N] (pallas_kernels.quant's MXFP4 layout)
        assert w_q.dtype == jax.numpy.int8
        assert w_q.shape[-2] * 2 == getattr(want, name).shape[-2]
        scale = getattr(mlp, name + "_scale")[...]
        got = ref_dequantize(w_q, scale, MXFP4)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(getattr(want, name)[...]))
        # K/32 scale rows (2 for D = 64, 1 for F = 32) stored padded to 8 with e8m0 1.0,
        # which nothing reads: NaN there dequantises the same
        k = getattr(want, name).shape[-2] // 32
        assert scale.shape[-2] == 8 and k < 8
        assert (np.asarray(scale).view(np.uint8)[..., k:, :] == 127).all()
        poisoned = scale.at[..., k:, :].set(jax.numpy.nan)
        np.testing.assert_array_equal(np.asarray(ref_dequantize(w_q, poisoned, MXFP4)),
                                      np.asarray(got))
    assert model.model.layers.self_attn.q_proj.dtype == np.float32  # attention unconverted
    assert model.config.expert_bytes < dense.config.expert_bytes / 5
    # Stored bytes: e2m1 at half a byte, one e8m0 byte per 32 values (the checkpoint's)
    # plus the padding scale rows, float32 biases; the engine's counter and the kernels'
    # stats count that, the roofline's "fp4" the 0.53125 B a weight without the padding.
    assert mlp.experts_down_proj_scale.dtype == jax.numpy.float8_e8m0fnu
    cfg = model.config
    D, F = cfg.hidden_size, cfg.moe_intermediate_size
    unpadded = 3 * D * F // 2 + 3 * D * F // 32 + 4 * (2 * F + D)
    want_bytes = 3 * D * F // 2 + 8 * 2 * F + 8 * D + 4 * (2 * F + D)
    assert cfg.expert_bytes == want_bytes
    fp4 = weight_format("fp4")
    assert fp4.matrix_bytes(D, 2 * F) + fp4.matrix_bytes(F, D) + 4 * (2 * F + D) == unpadded
    E = cfg.num_experts
    stats = moe_stats(jax.numpy.ones(E, jax.numpy.int32), mlp.experts_gate_up_proj[...],
                      mlp.experts_down_proj[...], mlp.experts_gate_up_proj_bias[...],
                      mlp.experts_down_proj_bias[...], scales=(
                          mlp.experts_gate_up_proj_scale[...], mlp.experts_down_proj_scale[...]))
    assert float(stats["expert_bytes_loaded"]) == E * want_bytes
    golden = np.load("tests/golden/tiny-gpt-oss-mxfp4.npz")
    prompt, greedy = golden["prompt_1"].tolist(), golden["greedy_1"].tolist()
    tokens, logits = greedy_generate(model, prompt, 3, backends=XLA,
                                     return_prompt_logits=True)
    np.testing.assert_allclose(logits, golden["logits_1"], rtol=0, atol=1e-4)
    assert tokens == greedy[:3]
    with pytest.raises(CheckpointError, match="has no \\*_blocks / \\*_scales experts"):
        load_model(ensure_tiny(preset="tiny-gpt-oss"), quantization="mxfp4")
    with pytest.raises(ValueError, match="'mxfp4' is not supported for qwen3_moe"):
        load_model(mtq.ensure_tiny_quant("tiny-fp8-base"), quantization="mxfp4")
    # int8 / fp8 serve GPT-OSS from a 16-bit checkpoint (test_gpt_oss_quantized_at_load),
    # not from this already-quantized one; HF FP8 blocks are Qwen3's only
    with pytest.raises(CheckpointError, match="'int8' disagrees with the checkpoint"):
        load_model(d, quantization="int8")
    with pytest.raises(ValueError, match="'fp8_block' is not supported for gpt_oss"):
        model.config.replace(quantization=QuantConfig("fp8_block", from_checkpoint=True))


GPT_OSS_EXPERTS = ("experts_gate_up_proj", "experts_down_proj")


@pytest.mark.parametrize("method, moe", [("int8", "xla"), ("fp8", "tpu")])
def test_gpt_oss_quantized_at_load(method, moe, monkeypatch):
    """GPT-OSS int8 / fp8 at load of its 16-bit checkpoint: the experts quantized per
    channel as numpy's quantiser does (their biases, the router and attention kept in
    the checkpoint's float32); the logits (the biased, clamped-SwiGLU experts with their
    scales through the reference, and through the TPU MoE kernel in interpret mode)
    match the float32 model holding the dequantised experts (reference MoE) within
    LOGIT_ATOL. The MXFP4 checkpoint, already quantized, refuses both."""
    from lp_jax import LLM

    d = ensure_tiny(preset="tiny-gpt-oss")
    model, twin = load_model(d, quantization=method), load_model(d)
    assert model.config.quantization.method == method
    assert model.config.expert_bytes < twin.config.expert_bytes / 3
    mlp, twin_mlp = model.model.layers.mlp, twin.model.layers.mlp
    for name in GPT_OSS_EXPERTS:
        w = np.asarray(getattr(twin_mlp, name)[...])
        q_np, s_np = zip(*(mtq.quantize_per_channel(m, method)
                           for m in w.reshape(-1, *w.shape[-2:])), strict=True)
        q_got, s_got = np.asarray(getattr(mlp, name)[...]), np.asarray(
            getattr(mlp, name + "_scale")[...])
        s_np = np.stack(s_np).reshape(s_got.shape)
        np.testing.assert_allclose(s_got, s_np, rtol=2.4e-7, atol=0, err_msg=name)
        _assert_quantized_equal(q_got, np.stack(q_np).reshape(w.shape),
                                w.astype(np.float64) / s_np, name)
        getattr(twin_mlp, name).set_value(jax.numpy.asarray(q_got.astype(np.float32) * s_got))
    for p in (mlp.router, mlp.router_bias, mlp.experts_gate_up_proj_bias,
              model.model.layers.self_attn.q_proj):
        assert p.dtype == np.float32
    monkeypatch.setenv("LP_JAX_PALLAS_INTERPRET", "1")
    got = greedy_generate(model, PROMPT, 1, return_prompt_logits=True,
                          backends=KernelBackends(moe=moe, attention="xla"))[1]
    diff = np.abs(got - _logits(twin)).max()
    print(f"gpt_oss {method} at load ({moe} MoE): logits vs float32 dequantised: "
          f"max |diff| {diff:.3g}")
    assert diff <= LOGIT_ATOL, diff
    # LLM and lp-serve: the engine's model config carries the format (its expert-bytes
    # counter the model's); the fake executor compiles nothing
    from lp_jax.serve import build_parser, engine_config
    from tests.fake_executor import FakeExecutor

    args = build_parser().parse_args(["--model", str(d), "--quantization", method])
    llm = LLM(**{**dataclasses.asdict(engine_config(args)), "log": None},
              executor=FakeExecutor)
    assert llm.engine.model_config.quantization.method == method
    assert llm.engine.model_config.expert_bytes == model.config.expert_bytes
    mx = ensure_tiny(preset="tiny-gpt-oss-mxfp4")
    with pytest.raises(CheckpointError, match=rf"quantization='{method}' disagrees with the "
                                              r"checkpoint, whose experts are already"):
        LLM(str(mx), quantization=method, log=None)
