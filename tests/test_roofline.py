"""Tests for lp_jax.roofline: pinned hand-computed numbers, monotonicity, CLI smoke test."""

import math

import numpy as np
import pytest

from lp_jax.config import ModelConfig
from lp_jax.roofline import (
    GPT_OSS_20B,
    HARDWARE,
    QWEN3_30B_A3B,
    QWEN3_ZIPF_EXPONENT,
    MeasuredRouting,
    ModelShape,
    OpCost,
    StepTokens,
    UniformRouting,
    ZipfRouting,
    compute_bound_tokens,
    expected_active,
    expected_padded_rows,
    fig2_table,
    fit_zipf_exponent,
    get_hardware,
    layer_cost,
    layered_marginal_saving,
    marginal_expert_traffic,
    model_step_cost,
    moe_intensity,
    resolve_model,
    tokens_per_expert,
)
from lp_jax.roofline.cost_model import expert_cost
from lp_jax.roofline.model_shape import CONFIG_DIR

Q = QWEN3_30B_A3B
UNIFORM = UniformRouting()
SKEWED = ZipfRouting()


# ---- model shape ------------------------------------------------------------------------
def test_qwen3_30b_expert_bytes_per_layer():
    # 128 experts x 3 (gate, up, down) x 2048 x 768 x 2 bytes = 1,207,959,552 B
    assert Q.expert_bytes_per_layer == 128 * 3 * 2048 * 768 * 2 == 1_207_959_552
    assert Q.num_moe_layers == 48


def test_qwen3_config_file_matches_builtin_when_present():
    path = CONFIG_DIR / "Qwen3-30B-A3B.json"
    if not path.is_file():
        pytest.skip("checkpoints/configs/Qwen3-30B-A3B.json not written yet")
    assert ModelShape.from_json(path) == Q
    assert resolve_model("Qwen3-30B-A3B") == Q


def test_hf_dialects():
    base = {
        "hidden_size": 1024,
        "num_hidden_layers": 6,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "vocab_size": 1000,
        "intermediate_size": 4096,
    }
    # Qwen3-MoE: head_dim absent -> 1024/16; sparse step 2 and mlp_only_layers [1].
    moe = ModelShape.from_hf_config(
        base
        | {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 256,
            "decoder_sparse_step": 2,
            "mlp_only_layers": [1],
            "tie_word_embeddings": True,
        },
        name="m",
    )
    assert moe.head_dim == 64 and moe.expert_width == 256 and moe.dense_width == 4096
    # MoE iff (i + 1) % 2 == 0 and i not in [1]: layers 3 and 5.
    assert [moe.is_moe_layer(i) for i in range(6)] == [False, False, False, True, False, True]
    assert moe.tie_word_embeddings
    # GPT-OSS / Mixtral: num_local_experts, expert width in intermediate_size, sliding layers.
    oss = ModelShape.from_hf_config(
        base
        | {
            "num_local_experts": 4,
            "num_experts_per_tok": 1,
            "head_dim": 32,
            "layer_types": ["sliding_attention", "full_attention"] * 3,
            "sliding_window": 128,
        }
    )
    assert oss.num_experts == 4 and oss.expert_width == 4096 and oss.num_moe_layers == 6
    assert oss.sliding_layers == (0, 2, 4) and oss.sliding_window == 128
    # Qwen3 dense.
    dense = ModelShape.from_hf_config(base | {"torch_dtype": "float32"})
    assert not dense.is_moe and dense.dense_layers_count == 6 and dense.dtype_bytes == 4


def test_gpt_oss_builtin_and_validation():
    assert (GPT_OSS_20B.num_layers, GPT_OSS_20B.hidden_size) == (24, 2880)
    assert (GPT_OSS_20B.num_experts, GPT_OSS_20B.top_k, GPT_OSS_20B.expert_width) == (32, 4, 2880)
    assert (GPT_OSS_20B.num_q_heads, GPT_OSS_20B.num_kv_heads, GPT_OSS_20B.head_dim) == (64, 8, 64)
    assert GPT_OSS_20B.vocab_size == 201088
    with pytest.raises(ValueError):
        ModelShape("x", 8, 1, 2, 2, 4, 10, num_experts=4, top_k=5, expert_width=8)


@pytest.mark.parametrize(("shape", "config"), [(GPT_OSS_20B, "gpt-oss-20b.json"),
                                               (Q, "Qwen3-30B-A3B.json")])
def test_builtin_shapes_are_the_engine_config(shape, config):
    """One description: the presets are the engine's ModelConfig, field by field."""
    cfg = ModelConfig.from_pretrained_file(CONFIG_DIR / config)
    assert shape == ModelShape.from_model_config(cfg, shape.name)
    assert (shape.hidden_size, shape.num_layers, shape.vocab_size) == (
        cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size)
    assert (shape.num_q_heads, shape.num_kv_heads, shape.head_dim) == (
        cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
    assert (shape.num_experts, shape.top_k, shape.expert_width) == (
        cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size)
    assert shape.dense_layers == cfg.dense_layers == ()
    assert [shape.sliding_window if shape.is_sliding_layer(i) else None
            for i in range(shape.num_layers)] == [cfg.layer_window(i)
                                                  for i in range(cfg.num_hidden_layers)]
    assert shape.tie_word_embeddings == cfg.tie_word_embeddings and shape.dtype_bytes == 2
    assert resolve_model(CONFIG_DIR / config) == ModelShape.from_json(CONFIG_DIR / config)
    # GPT-OSS: 12 sliding layers of 128 keys, as the hand-written shape had them.
    if shape is GPT_OSS_20B:
        assert shape.sliding_layers == tuple(range(0, 24, 2)) and shape.sliding_window == 128


# ---- routing ----------------------------------------------------------------------------
def test_uniform_active_experts_pinned():
    assert expected_active(UNIFORM, 128, 8, 1) == pytest.approx(8.0, abs=1e-12)
    # 128 * (1 - (1 - 8/128)^32) = 128 * (1 - 0.9375^32) = 111.771035344...
    assert expected_active(UNIFORM, 128, 8, 32) == pytest.approx(111.77103534374396, abs=1e-6)
    assert expected_active(UNIFORM, 128, 8, 32) == pytest.approx(128 * (1 - (1 - 8 / 128) ** 32))


def test_skewed_routing_matches_paper_table1():
    assert expected_active(SKEWED, 128, 8, 1) == pytest.approx(8.0, abs=1e-9)
    assert expected_active(SKEWED, 128, 8, 32) / 128 == pytest.approx(0.55, abs=0.03)
    assert expected_active(SKEWED, 128, 8, 128) / 128 == pytest.approx(0.86, abs=0.03)
    # The documented constant is the least-squares fit.
    assert fit_zipf_exponent(128, 8) == pytest.approx(QWEN3_ZIPF_EXPONENT, abs=0.005)
    p_E = SKEWED.probs_E(128, 8)
    assert p_E.sum() == pytest.approx(8.0) and np.all((p_E > 0) & (p_E < 1))


def test_measured_histogram_routing():
    flat = MeasuredRouting.from_counts(np.ones(128), top_k=8)
    assert expected_active(flat, 128, 8, 32) == pytest.approx(expected_active(UNIFORM, 128, 8, 32))
    counts_E = np.r_[np.full(16, 100.0), np.full(112, 1.0)]
    hot = MeasuredRouting.from_counts(counts_E, top_k=8)
    assert expected_active(hot, 128, 8, 32) < expected_active(UNIFORM, 128, 8, 32)
    with pytest.raises(ValueError):
        hot.probs_E(64, 8)


# ---- hardware ---------------------------------------------------------------------------
def test_h100_ridge_point_and_table():
    h100 = get_hardware("h100")
    assert h100.ridge_point == pytest.approx(989.4e12 / 3.35e12)  # ~295.34 FLOP/B
    assert h100.ridge_point == pytest.approx(295.34, abs=0.01)
    names = set(HARDWARE)
    for wanted in ("A100 SXM 80GB", "H200 SXM", "B200", "TPU v4", "TPU v5e", "TPU v5p", "TPU v6e"):
        assert wanted in names
    assert get_hardware("ironwood").name == "TPU7x (Ironwood)"
    for hw in HARDWARE.values():
        assert 100 < hw.ridge_point < 1000
        assert hw.sources.peak_flops and hw.sources.hbm_bw


def test_measure_current_device_tiny():
    hw = get_hardware("v5e")
    assert hw.ridge_point == pytest.approx(197e12 / 819e9)
    from lp_jax.roofline import measure_current_device

    measured = measure_current_device(matmul_size=128, copy_bytes=1 << 20, repeats=1)
    assert measured.peak_flops > 0 and measured.hbm_bw > 0 and measured.ridge_point > 0
    assert measured.name.startswith("measured")


# ---- intensity and compute-bound tokens -------------------------------------------------
def test_paper_intensity_is_tokens_per_expert():
    # 512 tokens x top-8 over 128 experts = 32 rows per expert = 32 FLOP/B for bf16 weights.
    assert tokens_per_expert(Q, 512) == 32.0
    assert moe_intensity(Q, 512, exact=False) == pytest.approx(32.0)
    exact_T = moe_intensity(Q, np.array([64, 512, 4096, 65536]))
    assert np.all(np.diff(exact_T) > 0) and exact_T[-1] < 3 * 768 / 2  # asymptote 3F/itemsize


def test_compute_bound_tokens_h100():
    cb = compute_bound_tokens(Q, get_hardware("H100 SXM"))
    # simple form: ridge * E / k = 295.34 * 16 = 4725.5 tokens
    assert cb.simple_tokens == pytest.approx(989.4e12 / 3.35e12 * 16)
    # exact form also moves the routed rows, so it needs more tokens
    assert cb.simple_tokens < cb.exact_tokens < 2 * cb.simple_tokens
    assert moe_intensity(Q, cb.exact_tokens) == pytest.approx(cb.ridge, rel=1e-6)


# ---- cost model -------------------------------------------------------------------------
def test_tp_and_ep_reduce_per_device_bytes():
    step = StepTokens(prefill_tokens=512, decode_seqs=32, decode_context=4096)
    one = layer_cost(Q, step)
    tp2 = layer_cost(Q, step, tp=2)
    ep2 = layer_cost(Q, step, ep=2)
    assert tp2.bytes < one.bytes and ep2.bytes < one.bytes
    assert tp2.flops == pytest.approx(one.flops / 2, rel=0.05)
    # Expert weights halve exactly under tp=2 or ep=2 (same tokens, same E_act).
    w1 = expert_cost(Q, step.tokens).bytes - 2 * 8 * step.tokens * 2048 * 2
    w_tp = expert_cost(Q, step.tokens, tp=2).bytes - 2 * 8 * step.tokens * 2048 * 2
    assert w_tp == pytest.approx(w1 / 2)
    assert tp2.comm_bytes > 0 and ep2.op("router").comm_bytes > 0 and one.comm_bytes == 0


def test_attention_counts_kv_cache_reads_and_sliding_window():
    short = layer_cost(Q, StepTokens(decode_seqs=8, decode_context=1024)).op("attn_decode")
    long = layer_cost(Q, StepTokens(decode_seqs=8, decode_context=8192)).op("attn_decode")
    # KV bytes per token per layer: 2 (K,V) x 4 heads x 128 x 2 bytes = 2048 B
    assert long.bytes - short.bytes == pytest.approx(8 * (8192 - 1024) * 2048)
    step = StepTokens(decode_seqs=1, decode_context=8192)
    slide = layer_cost(GPT_OSS_20B, step, layer=0).op("attn_decode")
    full = layer_cost(GPT_OSS_20B, step, layer=1).op("attn_decode")
    assert slide.flops < full.flops / 50
    chunk = layer_cost(Q, StepTokens(prefill_tokens=512, prefill_past=1024)).op("attn_prefill")
    # causal pairs: 512 * 1024 + 512 * 513 / 2; 4 * N * H FLOPs per pair
    assert chunk.flops == pytest.approx(4 * 32 * 128 * (512 * 1024 + 512 * 513 / 2))


def test_model_step_cost_and_roofline_time():
    step = StepTokens(decode_seqs=64, decode_context=2048)
    total = model_step_cost(Q, step)
    layer = layer_cost(Q, step)
    assert total.flops == pytest.approx(48 * layer.flops + total.op("lm_head").flops)
    h100 = get_hardware("H100 SXM")
    op = OpCost(flops=1e12, bytes=1e9, name="x")
    assert op.time_on(h100) == pytest.approx(1e12 / 989.4e12)
    assert op.time_on(h100, efficiency=0.5) == pytest.approx(2e12 / 989.4e12)
    # decode is memory-bound: the step time is at least its bytes over bandwidth
    assert total.time_on(h100) >= total.bytes / h100.hbm_bw * 0.999


def test_tile_padding_waste_at_small_chunks():
    # 256 tokens x 8 / 128 = 16 rows per expert, padded to one 128-row tile: 8x the rows.
    p_E = UNIFORM.probs_E(128, 8)
    assert expected_padded_rows(p_E, 256, 1) == pytest.approx(2048)
    assert expected_padded_rows(p_E, 256, 128) == pytest.approx(128 * 128, rel=1e-6)
    small = expert_cost(Q, 256, tile=128)
    large = expert_cost(Q, 8192, tile=128)
    assert small.pad_flops / small.flops == pytest.approx(7.0, abs=1e-3)
    assert large.pad_flops / large.flops < 0.2
    assert expert_cost(Q, 256, tile=1).pad_flops == 0.0


# ---- Fig. 2 and marginal traffic --------------------------------------------------------
def test_fig2_expert_bytes_inverse_in_chunk_and_layered_equals_largest():
    rows = fig2_table(Q, get_hardware("H100 SXM"), prompt_len=8192)
    chunked = [r for r in rows if r.label.startswith("chunk")]
    layered = rows[-1]
    assert layered.label == "layered G=16" and layered.iterations == 16
    for a, b in zip(chunked, chunked[1:], strict=False):
        assert a.expert_bytes > b.expert_bytes
        assert a.expert_bytes * a.chunk == pytest.approx(b.expert_bytes * b.chunk, rel=0.01)
    assert layered.expert_bytes == pytest.approx(chunked[-1].expert_bytes)
    # chunk 512: 16 chunks x 48 layers x 1,207,959,552 B = 927.7 GB; layered 58.0 GB
    by_chunk = {r.chunk: r for r in chunked}
    assert by_chunk[512].expert_bytes == pytest.approx(16 * 48 * 1_207_959_552, rel=1e-6)
    assert layered.expert_bytes == pytest.approx(48 * 1_207_959_552, rel=1e-6)
    assert layered.step_moe_seconds == pytest.approx(layered.moe_seconds / 16)


def test_marginal_traffic_shrinks_with_decode_batch():
    m = marginal_expert_traffic(Q, 32, 512)
    # uniform: E (1 - k/E)^B (1 - (1 - k/E)^T)
    q = 1 - 8 / 128
    assert m.marginal_active == pytest.approx(128 * q**32 * (1 - q**512))
    assert m.marginal_bytes == pytest.approx(m.marginal_active * 3 * 2048 * 768 * 2)
    savings = [layered_marginal_saving(Q, b, routing=SKEWED).saved_bytes for b in (0, 32, 256)]
    assert savings[0] > savings[1] > savings[2] > 0
    assert math.isclose(
        layered_marginal_saving(Q, 0).layered_bytes, 48 * Q.expert_bytes_per_layer, rel_tol=1e-6
    )


# ---- measured knee and CLI --------------------------------------------------------------
def test_measure_moe_knee_with_callable():
    from lp_jax.roofline.knee import default_moe_shape, make_default_moe, measure_moe_knee

    shape = default_moe_shape(4)
    result = measure_moe_knee(make_default_moe(shape), shape=shape, tokens=(2, 32), repeats=1)
    assert [p.tokens for p in result.points] == [2, 32]
    assert result.knee_tokens in (2, 32)
    assert all(p.flops_per_s > 0 and p.bytes_per_s > 0 for p in result.points)


def test_default_moe_capacity_matches_dropless_ragged():
    import jax
    import jax.numpy as jnp

    from lp_jax.roofline.knee import default_moe_shape, make_default_moe

    shape = default_moe_shape(4)
    # capacity factor E/k gives every expert room for all T rows: nothing is dropped.
    cap = make_default_moe(shape, impl="capacity",
                           capacity_factor=shape.num_experts / shape.top_k)
    ragged = make_default_moe(shape, impl="ragged")
    engine = make_default_moe(shape, impl="engine")
    x_TD = jax.random.normal(jax.random.PRNGKey(3), (16, shape.hidden_size), jnp.float32)
    np.testing.assert_allclose(cap(x_TD), ragged(x_TD), rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(engine(x_TD), ragged(x_TD), rtol=2e-4, atol=2e-5)


def test_cli_writes_three_plots(tmp_path, capsys):
    from lp_jax.roofline.__main__ import main

    assert main(["--out", str(tmp_path), "--no-measure", "--model", "Qwen3-30B-A3B"]) == 0
    printed = capsys.readouterr().out
    for name in (
        "intensity_vs_tokens.png",
        "expert_bytes_vs_chunk.png",
        "active_experts_vs_batch.png",
    ):
        assert (tmp_path / name).stat().st_size > 1000
    assert "plots written to" in printed and "layered G=16" in printed
