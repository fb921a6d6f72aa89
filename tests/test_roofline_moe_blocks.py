"""The roofline's model shape with the MoE blocks of GLM-4.5 and DeepSeek-V3.

* Parameter counts from the published config.json shapes (checkpoints/configs/glm-4.5*.json,
  tests/configs/DeepSeek-V3.json) against the model cards' totals: GLM-4.5 355B total /
  32B active, GLM-4.5-Air 106B / 12B, DeepSeek-V3 671B / 37B (MTP layers excluded, as the
  cards count them apart), gpt-oss-120b 117B total. Tolerance: 1.5% on the totals, 5% on
  the active counts, whose convention (embedding and head in or out) the cards do not
  state; ours leaves both out.
* Shared experts and dense first layers reach the cost model and the simulator's
  weight bytes; the engine's config and the raw config dict give the same shape.
* Group-limited sigmoid routing (`moe.ref.route`) activates the experts
  `routing.expected_active` predicts for independent tokens, so the routed expert bytes
  need no routing-variant term.
"""

import json

import jax
import numpy as np
import pytest

from lp_jax.roofline.cost_model import StepTokens, layer_cost
from lp_jax.roofline.model_shape import CONFIG_DIR, GLM_4_5, GLM_4_5_AIR, GPT_OSS_120B, ModelShape
from lp_jax.roofline.routing import UNIFORM, expected_active
from lp_jax.sim.simulator import weight_bytes
from pallas_kernels.moe.ref import Router, route

DEEPSEEK_V3 = ModelShape.from_json("tests/configs/DeepSeek-V3.json", name="DeepSeek-V3")


@pytest.mark.parametrize("shape,total,active", [
    (GLM_4_5, 355e9, 32e9), (GLM_4_5_AIR, 106e9, 12e9), (DEEPSEEK_V3, 671e9, 37e9),
    (GPT_OSS_120B, 117e9, None)], ids=lambda v: getattr(v, "name", ""))
def test_parameter_counts_match_the_published_totals(shape, total, active):
    got_total, got_active = shape.param_counts()
    assert abs(got_total / total - 1) < 0.015, got_total
    if active is not None:
        assert abs(got_active / active - 1) < 0.05, got_active


def test_glm_blocks_in_the_shape():
    assert GLM_4_5.dense_layers == (0, 1, 2) and GLM_4_5.num_moe_layers == 89
    assert GLM_4_5.shared_width == 1536 and (GLM_4_5.n_group, GLM_4_5.topk_group) == (1, 1)
    assert (DEEPSEEK_V3.dense_layers, DEEPSEEK_V3.n_group, DEEPSEEK_V3.topk_group) == (
        (0, 1, 2), 8, 4)
    # the engine's ModelConfig and the raw dict agree on the GLM-4.5 shape
    raw = json.loads((CONFIG_DIR / "glm-4.5.json").read_text())
    assert ModelShape.from_hf_config(raw, name="GLM-4.5") == GLM_4_5


def test_shared_experts_reach_the_cost_model_and_weight_bytes():
    step = StepTokens(decode_seqs=8, decode_context=512)
    ops = {op.name: op for op in layer_cost(GLM_4_5, step, layer=3).ops}
    d, fs = GLM_4_5.hidden_size, GLM_4_5.shared_width
    assert ops["shared_experts"].flops == 2 * 3 * 8 * d * fs
    assert ops["shared_experts"].bytes >= 3 * d * fs * 2
    assert "shared_experts" not in {op.name for op in layer_cost(GLM_4_5, step, layer=0).ops}
    total, _ = GLM_4_5.param_counts()
    assert abs(weight_bytes(GLM_4_5) / (2 * total) - 1) < 0.001  # bf16, norms aside


def test_group_limited_routing_activates_the_uniform_expectation():
    E, k, T, trials = 256, 8, 32, 64
    logits = jax.random.normal(jax.random.key(0), (trials * T, E))
    router = Router("sigmoid", n_group=8, topk_group=4, routed_scaling_factor=2.5)
    _, ids = jax.jit(lambda x: route(x, k, True, router))(logits)
    ids = np.asarray(ids).reshape(trials, T * k)
    active = np.mean([len(set(row.tolist())) for row in ids])
    want = float(expected_active(UNIFORM, E, k, T))
    assert abs(active / want - 1) < 0.02, (active, want)
    groups = np.asarray(ids).reshape(trials * T, k) // (E // 8)
    assert max(len(set(g.tolist())) for g in groups) == 4  # the limit holds, and binds


def test_mla_attention_costs_its_own_projections():
    """DeepSeek-V3's latent attention in the analytic model: one decode row reads each
    latent projection once (q_a, q_b, kv_a_proj_with_mqa, kv_b_proj absorbed, o_proj of
    v_head_dim), which is the shape's attention weight bytes; and a sequence's prefill
    rows are costed in the form with fewer flops: a long chunk expanded, kv_b_proj over
    the keys of its sequence once; a short chunk (a verification step's k + 1 rows)
    absorbed, kv_b_proj once a row, as the engine runs it."""
    one = layer_cost(DEEPSEEK_V3, StepTokens(decode_seqs=1, decode_context=1), layer=3)
    ops = {op.name: op for op in one.ops}
    assert ops["qkv_proj"].bytes + ops["o_proj"].bytes == pytest.approx(
        DEEPSEEK_V3.attention_weight_bytes, rel=1e-3)
    Q, A, R, O = DEEPSEEK_V3.mla_ranks
    N, H = DEEPSEEK_V3.num_q_heads, DEEPSEEK_V3.head_dim - R
    kv_b = A * N * (H + O)

    def prefill_flops(chunk, past):
        step = StepTokens(prefill_tokens=chunk, prefill_seqs=1, prefill_past=past)
        return {op.name: op for op in layer_cost(DEEPSEEK_V3, step, layer=3).ops}[
            "attn_prefill"].flops

    pairs = lambda chunk, past: chunk * past + chunk * (chunk + 1) / 2
    # 1,024 rows on 1,024 keys: expanded once a key.
    assert prefill_flops(1024, 0) == pytest.approx(
        2 * 1024 * kv_b + 2 * N * (H + R + O) * pairs(1024, 0))
    # 4 rows (a verification step of k = 3) on 2,048 keys: absorbed, far below expanding
    # the 2,048 keys.
    assert prefill_flops(4, 2044) == pytest.approx(
        2 * 4 * kv_b + 2 * N * (2 * A + R) * pairs(4, 2044))
    assert prefill_flops(4, 2044) < 2 * 2048 * kv_b / 10
