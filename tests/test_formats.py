"""Weight and KV formats in the roofline and the simulator (issue #31): stored bytes with
their scales, the ridge crossing, KV capacity, and defaults that leave every figure as it
was. Expected values are derived here from the formats' definitions, not read back."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from lp_jax.roofline import GPT_OSS_20B, QWEN3_30B_A3B, get_hardware
from lp_jax.roofline.__main__ import parse_args
from lp_jax.roofline.cost_model import StepTokens, model_step_cost
from lp_jax.roofline.model_shape import CONFIG_DIR, ModelShape
from lp_jax.roofline.ridge import compute_bound_tokens
from lp_jax.roofline.routing import UNIFORM
from lp_jax.sim.simulator import SimConfig, derive_num_pages, kv_bytes_per_token, weight_bytes

D, F, E, K = 2048, 768, 128, 8  # Qwen3-30B-A3B's experts (checkpoints/configs)
QWEN_BF16 = 3 * D * F * 2
QWEN_FP8 = 3 * D * F + 4 * (2 * F + D)  # per output channel: [D, 2F] and [F, D] scales
QWEN_FP4 = 3 * D * F // 2 + (D // 32) * 2 * F + (F // 32) * D  # an e8m0 byte per 32 along K


def test_model_shape_is_qwen3():
    s = QWEN3_30B_A3B
    assert (s.hidden_size, s.expert_width, s.num_experts, s.top_k) == (D, F, E, K)


def test_expert_bytes_per_format():
    assert QWEN3_30B_A3B.expert_bytes == QWEN_BF16
    assert QWEN3_30B_A3B.with_formats("bf16", None).expert_bytes == QWEN_BF16
    assert QWEN3_30B_A3B.with_formats("fp8", None).expert_bytes == QWEN_FP8
    assert QWEN3_30B_A3B.with_formats("int8", None).expert_bytes == QWEN_FP8
    fp4 = QWEN3_30B_A3B.with_formats("fp4", None)
    assert fp4.expert_bytes == QWEN_FP4
    assert fp4.expert_bytes > 3 * D * F // 2  # the scales are counted
    assert fp4.expert_weight_itemsize == pytest.approx(0.5 + 1 / 32)
    blocks = QWEN3_30B_A3B.with_formats("fp8_block", None).expert_bytes
    assert blocks == 3 * D * F + 4 * ((D // 128) * (2 * F // 128) + (F // 128) * (D // 128))


def test_expert_bytes_match_the_engine_counter():
    from lp_jax.config import ModelConfig
    from lp_jax.quant.config import QuantConfig

    hf = json.loads((CONFIG_DIR / "Qwen3-30B-A3B.json").read_text())
    cfg = ModelConfig.from_hf_dict(hf)
    for method in ("int8", "fp8"):
        engine = dataclasses.replace(cfg, quantization=QuantConfig(method)).expert_bytes
        assert QWEN3_30B_A3B.with_formats(method, None).expert_bytes == engine


def test_engine_config_carries_its_formats():
    from lp_jax.config import ModelConfig
    from lp_jax.quant.config import QuantConfig

    hf = json.loads((CONFIG_DIR / "Qwen3-30B-A3B.json").read_text())
    cfg = ModelConfig.from_hf_dict(hf)
    assert ModelShape.from_model_config(cfg, "q") == dataclasses.replace(QWEN3_30B_A3B, name="q")
    quant = dataclasses.replace(cfg, quantization=QuantConfig("fp8"), kv_cache_dtype="fp8")
    shape = ModelShape.from_model_config(quant, "q")
    assert (shape.weight_format, shape.kv_format) == ("fp8", "fp8")


def test_fp8_halves_the_compute_bound_tokens():
    h100 = get_hardware("H100 SXM")
    bf16 = compute_bound_tokens(QWEN3_30B_A3B, h100, routing=UNIFORM)
    fp8 = compute_bound_tokens(QWEN3_30B_A3B.with_formats("fp8", "fp8"), h100, routing=UNIFORM)
    w = QWEN_FP8 / (3 * D * F)
    ridge = 989.4e12 / 3.35e12
    assert bf16.simple_tokens == pytest.approx(ridge * E * 2 / (2 * K))
    assert fp8.simple_tokens == pytest.approx(ridge * E * w / (2 * K))
    assert fp8.simple_tokens / bf16.simple_tokens == pytest.approx(w / 2)
    # Exact form at T ~ thousands: all E experts load, so 6DFkT = R (3DF E w + 2kTD a).
    a = 2
    want = ridge * E * w * 3 * F / (2 * K * (3 * F - a * ridge))
    assert fp8.exact_tokens == pytest.approx(want, rel=1e-3)
    assert fp8.exact_tokens < 0.51 * bf16.exact_tokens


def test_formats_leave_the_activation_bytes_alone():
    step = StepTokens(prefill_tokens=4096, prefill_seqs=1, decode_seqs=32, decode_context=2048)
    base = model_step_cost(QWEN3_30B_A3B, step, routing=UNIFORM)
    same = model_step_cost(QWEN3_30B_A3B.with_formats("bf16", "bf16"), step, routing=UNIFORM)
    assert [op.bytes for op in same.ops] == pytest.approx([op.bytes for op in base.ops])
    assert same.flops == base.flops
    quant = model_step_cost(QWEN3_30B_A3B.with_formats("fp8", "fp8"), step, routing=UNIFORM)
    assert quant.flops == base.flops  # W8A16: same matmuls
    # One decode row: the experts op is the active experts' weights plus 2 * k * D bf16.
    one = StepTokens(decode_seqs=1, decode_context=1)
    e16 = model_step_cost(QWEN3_30B_A3B, one, routing=UNIFORM).op("experts").bytes
    e8 = model_step_cost(QWEN3_30B_A3B.with_formats("fp8", None), one, routing=UNIFORM)
    layers = QWEN3_30B_A3B.num_moe_layers
    assert e16 == pytest.approx(layers * (K * QWEN_BF16 + 2 * K * D * 2))
    assert e8.op("experts").bytes == pytest.approx(layers * (K * QWEN_FP8 + 2 * K * D * 2))
    kv16 = base.op("attn_decode").bytes
    kv8 = quant.op("attn_decode").bytes
    q_bytes = QWEN3_30B_A3B.num_layers * 32 * 2 * 32 * 128 * 2  # 32 rows' q in, out in bf16
    assert kv8 - q_bytes == pytest.approx((kv16 - q_bytes) / 2)


def test_fp8_kv_doubles_the_kv_capacity():
    h100 = get_hardware("H100 SXM")
    shape = QWEN3_30B_A3B.with_formats("fp8", None)
    kv16 = kv_bytes_per_token(shape, tp=2)
    kv8 = kv_bytes_per_token(shape.with_formats("fp8", "fp8"), tp=2)
    assert kv16 == 48 * 2 * 2 * 128 * 2 and kv8 == kv16 / 2
    pages16 = derive_num_pages(SimConfig(shape=shape, hardware=h100, tp=2))
    pages8 = derive_num_pages(SimConfig(shape=shape.with_formats("fp8", "fp8"), hardware=h100,
                                        tp=2))
    free = 80e9 * 0.9 - weight_bytes(shape) / 2 - 4e9
    assert pages16 == math.floor(free / (kv16 * 16))  # per device; TP2 splits the heads
    assert pages8 == math.floor(free / (kv8 * 16))
    assert abs(pages8 - 2 * pages16) <= 1


def test_fp4_keeps_attention_in_16_bits():
    fp4 = GPT_OSS_20B.with_formats("fp4", None)
    assert fp4.attention_weight_bytes == GPT_OSS_20B.attention_weight_bytes
    saved = GPT_OSS_20B.num_moe_layers * GPT_OSS_20B.num_experts * (
        GPT_OSS_20B.expert_bytes - fp4.expert_bytes)
    assert weight_bytes(fp4) == weight_bytes(GPT_OSS_20B) - saved
    fp8 = GPT_OSS_20B.with_formats("fp8", None)
    assert fp8.attention_weight_bytes < 0.51 * GPT_OSS_20B.attention_weight_bytes


def test_bad_formats_are_refused():
    with pytest.raises(ValueError, match="weight_format"):
        QWEN3_30B_A3B.with_formats("fp6", None)
    with pytest.raises(ValueError, match="kv_format"):
        dataclasses.replace(QWEN3_30B_A3B, kv_format="int4")
    with pytest.raises(SystemExit):
        parse_args(["--weight-format", "nf4"])
    args = parse_args(["--weight-format", "fp4", "--kv-format", "fp8"])
    assert (args.weight_format, args.kv_format) == ("fp4", "fp8")
    assert isinstance(QWEN3_30B_A3B.with_formats(args.weight_format, None), ModelShape)


def test_fp8_block_counts_what_the_engine_holds():
    """An FP8 checkpoint (128 x 128 blocks): the engine holds its attention projections
    dequantised to 16 bits and its routed experts in e4m3 with their scales; the
    roofline's bytes are those of the model's own parameters (abstract, no weights)."""
    from flax import nnx

    from lp_jax.config import ModelConfig
    from lp_jax.models import model_class
    from lp_jax.quant.config import QuantConfig

    hf = {**json.loads((CONFIG_DIR / "Qwen3-30B-A3B.json").read_text()), "num_hidden_layers": 1}
    cfg = dataclasses.replace(ModelConfig.from_hf_dict(hf), quantization=QuantConfig(
        "fp8_block", from_checkpoint=True))
    model = nnx.eval_shape(lambda: model_class(cfg.model_type)(cfg, rngs=nnx.Rngs(0)))
    layers = model.model.layers
    held = {kind: sum(math.prod(a.shape) * a.dtype.itemsize
                      for path, v in nnx.to_flat_state(nnx.state(getattr(layers, kind)))
                      if not path[-1].endswith(("_norm", "gate")) for a in [v.get_value()])
            for kind in ("self_attn", "mlp")}
    shape = ModelShape.from_model_config(cfg, "q")
    assert shape.weight_format == "fp8_block"
    assert shape.attention_weight_bytes == held["self_attn"]
    assert shape.expert_bytes_per_layer == held["mlp"]
