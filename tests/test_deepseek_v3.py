"""DeepSeek-V3 (deepseek_v3): multi-head latent attention against Hugging Face transformers.

Goldens (tests/golden/make_golden.py, transformers 5.24 on CPU, float32) of two tiny random
checkpoints in the published config.json dialect (checkpoints/make_tiny_deepseek.py):
"tiny-deepseek" (q_lora_rank, one expert group, YaRN factor 4 with mscale 0.707 and
mscale_all_dim 1, interleaved rotary) and "tiny-deepseek-groups" (q_proj, 16 experts in 4
groups of which 2 are eligible, default RoPE); both with a dense first layer, a shared
expert, a nonzero correction bias and one MTP layer in the checkpoint. Prompt logits within
1e-4 and greedy tokens identical through the model and through the engine under orca,
chunked and layered. The KV pool holds the latent (its bytes a token), the absorbed form
(every step's) agrees with the expanded one (the oracle), and a prefill step's attention
compiles without the per-query-row expansion.
"""

import functools
import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import GOLDEN_ENGINES, run_golden_prompts
from flax import nnx

from checkpoints.make_tiny import DEEPSEEK_PRESETS, ensure_tiny, weights_digest
from lp_jax import LLM, SamplingParams
from lp_jax.config import ModelConfig
from lp_jax.loader import _dequantize_fp8_blocks, load_model
from lp_jax.models import DeepseekV3ForCausalLM, KernelBackends
from lp_jax.models.kv_cache import init_kv_cache, kv_cache_shape, kv_page_bytes
from lp_jax.models.metadata import build_metadata
from lp_jax.models.simple import greedy_generate
from pallas_kernels.attention.mla_ref import ref_mla_paged_attention, write_latent
from pallas_kernels.moe.ref import Router

GOLDEN = "tests/golden/{}.npz"


def test_config_reads_the_published_dialect():
    cfg = ModelConfig.from_pretrained(ensure_tiny(preset="tiny-deepseek"))
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.head_dim, cfg.qk_nope_head_dim,
            cfg.v_head_dim) == (32, 32, 8, 16, 16)
    assert cfg.rope_interleave and cfg.kv_latent_dim == 40 and cfg.qk_head_dim == 24
    assert cfg.router == Router("sigmoid", n_group=1, topk_group=1, routed_scaling_factor=2.5)
    assert cfg.dense_layers == (0,) and cfg.moe_layers == (1, 2)
    assert cfg.has_router_correction_bias and cfg.num_nextn_predict_layers == 1
    # transformers' yarn_get_mscale: 0.1 * mscale * ln(factor) + 1
    m = lambda ms: 0.1 * ms * np.log(4.0) + 1.0  # noqa: E731
    assert cfg.rope_scaling.cos_sin_scale() == pytest.approx(m(0.707) / m(1.0))
    assert cfg.softmax_scale == pytest.approx(24**-0.5 * m(1.0) ** 2)
    groups = ModelConfig.from_pretrained(ensure_tiny(preset="tiny-deepseek-groups"))
    assert groups.q_lora_rank == 0 and groups.rope_scaling is None
    assert groups.softmax_scale == pytest.approx(24**-0.5)


@pytest.mark.parametrize("field,value,match", [
    ("attention_bias", True, "attention_bias"), ("hidden_act", "gelu", "hidden_act"),
    ("num_key_value_heads", 2, "num_key_value_heads"), ("kv_lora_rank", 0, "kv_lora_rank")])
def test_unsupported_fields_fail_before_building(field, value, match):
    hf = json.loads((ensure_tiny(preset="tiny-deepseek") / "config.json").read_text())
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict({**hf, field: value})


def test_not_yet_served_features_are_refused_by_name():
    cfg = ModelConfig.from_pretrained(ensure_tiny(preset="tiny-deepseek"))
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8'.*latent attention"):
        cfg.replace(kv_cache_dtype="fp8")
    model = load_model(ensure_tiny(preset="tiny-deepseek-groups"))
    with pytest.raises(ValueError, match="'tpu_jax'.*no latent-attention"):
        model.serving_backends(KernelBackends(attention="tpu_jax"))
    assert model.serving_backends(KernelBackends()).attention == "auto"


def test_pool_holds_the_latent_once_a_token():
    """A token takes kv_lora_rank + qk_rope_head_dim values a layer (576 for DeepSeek-V3),
    not 2 * heads * head_dim: 61 layers * 576 * 2 bytes = 70,272 bytes a token in bf16."""
    v3 = ModelConfig.from_pretrained_file("tests/configs/DeepSeek-V3.json")
    assert v3.kv_latent_dim == 576
    assert kv_page_bytes(v3, 16) // 16 == 61 * 576 * 2
    assert kv_cache_shape(v3, 10, 16) == (61 * 10, 16, 1, 576)
    # 71x fewer than its 128 heads' expanded keys (192) and values (128) would take
    expanded = 61 * 128 * (192 + 128) * 2
    assert expanded // (kv_page_bytes(v3, 16) // 16) == 71


def test_presets_for_the_roofline_simulator_and_aot():
    """deepseek-v3 (671B) and kimi-k2 (1T, model_type kimi_k2: DeepSeek-V3's
    architecture) as the AOT, roofline and simulator read them: totals as the model
    cards', and the simulator's KV bytes a token the latent's, not split over heads."""
    from lp_jax.aot import load_config
    from lp_jax.roofline.model_shape import DEEPSEEK_V3, KIMI_K2
    from lp_jax.sim import kv_bytes_per_token

    for shape, total in ((DEEPSEEK_V3, 671e9), (KIMI_K2, 1026e9)):
        assert shape.param_counts()[0] == pytest.approx(total, rel=2e-3), shape.name
        assert kv_bytes_per_token(shape, tp=8) == 61 * 576 * 2
    assert load_config("deepseek-v3").num_experts == 256
    # Kimi-K2-Instruct's published config.json (checkpoints/configs/kimi-k2.json)
    kimi = load_config("kimi-k2")
    assert kimi.is_mla and kimi.model_type == "deepseek_v3"
    assert (kimi.hidden_size, kimi.num_experts, kimi.num_experts_per_tok, kimi.n_shared_experts,
            kimi.n_group, kimi.topk_group, kimi.num_attention_heads, kimi.first_k_dense_replace,
            kimi.vocab_size, kimi.max_position_embeddings) == (
                7168, 384, 8, 1, 1, 1, 64, 1, 163840, 131072)
    y = kimi.rope_scaling
    assert (kimi.rope_theta, y.factor, y.original_max_position_embeddings, y.beta_fast,
            y.beta_slow, y.mscale, y.mscale_all_dim) == (50000.0, 32.0, 4096, 1.0, 1.0, 1.0, 1.0)


def _latent_batch(A=32, R=8, H=16, O=16, N=4, S=4):
    """Two sequences (7 cached tokens + 3 new, and 1 cached + 1 new) and a padding token
    on a pool of pages of S tokens, with random latents (numpy: no eager JAX op)."""
    rng = np.random.RandomState(0)
    T = 5
    pool = rng.standard_normal((8, S, 1, A + R)).astype(np.float32)
    q_nope = rng.standard_normal((T, N, H)).astype(np.float32)
    q_pe = rng.standard_normal((T, N, R)).astype(np.float32)
    w_uk = (rng.standard_normal((A, N, H)) / A**0.5).astype(np.float32)
    w_uv = (rng.standard_normal((A, N, O)) / A**0.5).astype(np.float32)
    meta = dict(query_start_B1=np.array([0, 3, 4, 4]), seq_lens_B=np.array([10, 2, 0]),
                page_table_BC=np.array([[5, 2, 7], [1, 0, 0], [0, 0, 0]]),
                num_seqs=np.int32(2))
    return q_nope, q_pe, pool, w_uk, w_uv, meta


def test_absorbed_equals_expanded_and_dense():
    """Both forms over the same latent pool equal dense attention over the expanded
    per-head keys and values (float32, 1e-5), and padding rows are zero."""
    q_nope, q_pe, pool, w_uk, w_uv, meta = _latent_batch()
    scale = 0.2

    @jax.jit
    def both(pool, new_TX, slots_T):
        m = {k: jnp.asarray(v) for k, v in meta.items()}
        o = [ref_mla_paged_attention(q_nope, q_pe, pool, w_uk, w_uv, **m, sm_scale=scale,
                                     absorbed=a, block_q=2) for a in (False, True)]
        return o, write_latent(pool, new_TX, slots_T)

    A = w_uk.shape[0]
    new_TX = np.ones((2, pool.shape[-1]), np.float32)
    (expanded, absorbed), written = both(pool, new_TX, np.array([9, -1]))
    np.testing.assert_allclose(absorbed, expanded, rtol=0, atol=1e-5)
    # dense oracle (numpy) for sequence 0's three new tokens at positions 7, 8, 9
    ctx = pool[[5, 2, 7]].reshape(12, -1)[:10].astype(np.float64)  # [10, A + R]
    k = np.concatenate([np.einsum("sa,anh->snh", ctx[:, :A], w_uk),
                        np.broadcast_to(ctx[:, None, A:], (10, 4, 8))], -1)
    v = np.einsum("sa,ano->sno", ctx[:, :A], w_uv)
    q = np.concatenate([q_nope[:3], q_pe[:3]], -1)
    s = np.einsum("tnh,snh->nts", q, k) * scale
    s = np.where(np.arange(10)[None, None, :] <= np.arange(7, 10)[None, :, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("nts,sno->tno", p / p.sum(-1, keepdims=True), v)
    np.testing.assert_allclose(absorbed[:3], want, rtol=0, atol=1e-5)
    assert not np.asarray(expanded[4]).any() and not np.asarray(absorbed[4]).any()
    # the write puts a token's row in its slot (9: page 2, offset 1) and drops slot -1
    want_pool = pool.copy()
    want_pool[2, 1, 0] = 1.0
    np.testing.assert_array_equal(written, want_pool)


def _flops(fn, *args) -> float:
    cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost)["flops"]


def test_prefill_attention_expands_no_latent_per_query_row():
    """A prefill step's attention runs absorbed: the compiled layer's flops stay below what
    the expanded form spends expanding one page's keys with W_UK for each query row of one
    block (2 b S A N H), which that form pays on every trip of its page loop (XLA's cost
    analysis counts a loop body once)."""
    model = load_model(ensure_tiny(preset="tiny-deepseek"))
    cfg, (T, S) = model.config, (64, 16)  # one query block of 64 rows, 4 pages
    A, N = cfg.kv_lora_rank, cfg.num_attention_heads
    H, O, R = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.head_dim
    meta = jax.tree.map(jnp.asarray, build_metadata([(0, T, list(range(T // S)))],
                                                    page_size=S, num_tokens=T, num_seqs=1,
                                                    pages_per_seq=T // S))
    kv = init_kv_cache(cfg, T // S, S, model.dtype)
    graphdef, state = nnx.split(model)
    x_TD = jax.ShapeDtypeStruct((T, cfg.hidden_size), model.dtype)
    step = _flops(lambda st, x, kv, m: nnx.merge(graphdef, st)._attention(
        1, x, kv, m, False, "xla"), state, x_TD, kv, meta)
    per_row_expansion = 2 * T * S * A * N * H

    def expanded(kv, m):  # the oracle form, as prefill steps ran it before
        q_nope, q_pe = jnp.zeros((T, N, H)), jnp.zeros((T, N, R))
        w_uk, w_uv = jnp.zeros((A, N, H)), jnp.zeros((A, N, O))
        return ref_mla_paged_attention(q_nope, q_pe, kv, w_uk, w_uv, m.query_start_B1,
                                       m.seq_lens_B, m.page_table_BC, m.num_seqs,
                                       sm_scale=1.0, absorbed=False)

    oracle = _flops(expanded, kv, meta)
    assert oracle > per_row_expansion > step, (oracle, per_row_expansion, step)


@pytest.mark.parametrize("preset", sorted(DEEPSEEK_PRESETS))
def test_matches_transformers(preset, caplog):
    """Prompt logits and greedy tokens equal transformers', prefill and decode both run
    in the absorbed form."""
    golden = np.load(GOLDEN.format(preset))
    model_dir = ensure_tiny(preset=preset)
    assert str(golden["weights_digest"]) == weights_digest(model_dir), "rerun make_golden.py"
    with caplog.at_level(logging.INFO, logger="lp_jax.loader"):
        model = load_model(model_dir)
    assert "skipping 1 next-token (MTP) layer(s)" in caplog.text
    assert isinstance(model, DeepseekV3ForCausalLM)
    rows = max(len(golden[f"prompt_{i}"]) for i in range(3))  # one prefill program
    for i in range(3):
        prompt, want = golden[f"prompt_{i}"].tolist(), golden[f"greedy_{i}"].tolist()
        tokens, logits = greedy_generate(model, prompt, len(want), page_size=36,
                                         return_prompt_logits=True, prefill_rows=rows)
        np.testing.assert_allclose(logits, golden[f"logits_{i}"], rtol=0, atol=1e-4)
        assert tokens == want, f"{preset} prompt {i}: greedy continuation differs"


ENGINES = GOLDEN_ENGINES


@pytest.fixture(scope="module")
def deepseek_engines():
    """policy -> an engine on tiny-deepseek, built on first use, shut down at the end."""
    built = {}

    def get(policy):
        if policy not in built:
            built[policy] = LLM(str(ensure_tiny(preset="tiny-deepseek")), max_num_seqs=4,
                                max_model_len=80, log=None, **ENGINES[policy])
        return built[policy]

    yield get
    for llm in built.values():
        llm.shutdown()


@pytest.mark.parametrize("policy", list(ENGINES))
def test_engine_policies_match_golden_greedy(policy, deepseek_engines):
    """32 greedy tokens per prompt equal to transformers' under each policy, prefills
    beside decodes (the expanded form) and decode-only steps (absorbed) in one program;
    the pool is the latent one."""
    golden = np.load(GOLDEN.format("tiny-deepseek"))
    llm = deepseek_engines(policy)
    outs = run_golden_prompts(llm.engine, golden)
    for i in range(3):
        assert outs[i].token_ids == golden[f"greedy_{i}"].tolist(), f"{policy} prompt {i}"
    stats = llm.stats()
    assert stats["programs"] == 1 and stats["compilations_after_warmup"] == 0, stats


def test_hf_fp8_block_checkpoint_with_partial_blocks(tmp_path):
    """DeepSeek-V3's published FP8 format (e4m3, 128 x 128 weight_scale_inv) on a
    tiny-deepseek-groups with 128-wide experts: every _proj weight converted but o_proj
    and the router, so the latent projections have partial blocks (kv_a_proj_with_mqa:
    40 rows of one 128-block, like DeepSeek-V3's 576 = 4.5 blocks; kv_b_proj 128 x 32).
    The latent projections, kv_b_proj included, are dequantised once at load (16-bit
    parameters: the absorbed decode folds kv_b_proj), the experts stay e4m3; the model
    computes what the float32 model holding the dequantised weights computes."""
    from checkpoints import make_tiny
    from checkpoints import make_tiny_quant as mtq

    cfg = {**make_tiny.build_config("tiny-deepseek-groups"), "moe_intermediate_size": 128}
    qc = mtq.quantization_config({**cfg, "num_experts": cfg["n_routed_experts"]})
    fp8, dequant = {}, {}
    for name, w in make_tiny.make_weights(cfg).items():
        module = name.removesuffix(".weight")
        if (w.ndim == 2 and name.endswith(("_proj.weight", "_mqa.weight"))
                and "eh_proj" not in name and module not in qc["modules_to_not_convert"]):
            q, scale = mtq.quantize_fp8_blocks(w, np.float32)
            fp8[name], fp8[name + "_scale_inv"] = q, scale
            dequant[name] = mtq.dequantize_fp8_blocks(q, scale)
        else:
            fp8[name] = dequant[name] = w
    assert fp8["model.layers.1.self_attn.kv_a_proj_with_mqa.weight_scale_inv"].shape == (1, 1)
    src = ensure_tiny(preset="tiny-deepseek-groups")
    dirs = {}
    for kind, tensors, config in (("fp8", fp8, {**cfg, "quantization_config": qc}),
                                  ("dequant", dequant, cfg)):
        d = dirs[kind] = tmp_path / kind
        d.mkdir()
        (d / "config.json").write_text(json.dumps(config))
        mtq.save_safetensors(tensors, d / "model.safetensors")
        for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            (d / f).write_bytes((src / f).read_bytes())
    model = load_model(dirs["fp8"])
    layers = model.model.layers
    assert layers.mlp.experts_gate_up_proj[...].dtype.itemsize == 1
    assert layers.self_attn.kv_b_proj[...].dtype.itemsize == 4
    prompt = np.load(GOLDEN.format("tiny-deepseek-groups"))["prompt_1"].tolist()
    _, logits = greedy_generate(model, prompt, 1, return_prompt_logits=True)
    _, want = greedy_generate(load_model(dirs["dequant"]), prompt, 1, return_prompt_logits=True)
    np.testing.assert_allclose(logits, want, rtol=0, atol=1e-3)
    # DeepSeek-V3's own shape: 576 rows are 4.5 blocks (numpy, no model)
    w = np.random.RandomState(0).standard_normal((576, 200)).astype(np.float32)
    q, scale = mtq.quantize_fp8_blocks(w, np.float32)
    assert scale.shape == (5, 2)
    np.testing.assert_array_equal(_dequantize_fp8_blocks([q, scale]),
                                  mtq.dequantize_fp8_blocks(q, scale).T)


@pytest.mark.parametrize("text,want", [
    ("plan it</think>\n\nThe answer.", ("plan it", "The answer.")),  # the template opened it
    ("<think>plan it</think>The answer.", ("plan it", "The answer.")),  # the model did
    ("still thinking, cut off", ("still thinking, cut off", "")),  # never closed: reasoning
    ("\n<thin", ("\n<thin", "")),  # not the marker after all
])
def test_deepseek_r1_reasoning_parser(text, want):
    """DeepSeek-R1 answers start in their reasoning whatever the prompt ends with: the
    streamed split (cut at every character) equals the whole text's, and the parser is a
    choice of lp-serve's --reasoning-parser."""
    from lp_jax.serve import build_parser
    from lp_jax.server import reasoning

    parser = "deepseek_r1"
    in_reasoning = reasoning.starts_in_reasoning(parser, "User: hi\nAssistant:")
    assert in_reasoning and not reasoning.starts_in_reasoning("qwen3", "Assistant:")
    assert reasoning.split(text, in_reasoning, drop_open=True) == want
    s, r, c = reasoning.ThinkSplitter(in_reasoning, drop_open=True), "", ""
    for ch in text:
        dr, dc = s.push(ch)
        r, c = r + dr, c + dc
    dr, dc = s.finish()
    assert (r + dr, c + dc) == want
    assert build_parser().parse_args(["--reasoning-parser", parser]).reasoning_parser == parser


# ----- everything else keeps working on DeepSeek-V3 (the chunked engine above, shared) -----
GREEDY4 = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def test_prefix_cache_hits_give_the_tokens_computed_cold(deepseek_engines):
    """The latent pool's pages are shared as any model's KV pages: a prompt whose first two
    pages are cached gives the tokens computed from scratch, and the hits are counted."""
    golden = np.load(GOLDEN.format("tiny-deepseek"))
    llm = deepseek_engines("chunked")
    eng = llm.engine
    system = golden["prompt_2"].tolist()[:32]  # two pages of 16
    prompts = [system + golden["prompt_1"].tolist()[:8], system + golden["prompt_0"].tolist()]
    cold = []
    for p in prompts:  # each alone on an empty cache
        assert eng.reset_prefix_cache()
        cold.append(llm.generate(prompt_token_ids=[p], sampling_params=GREEDY4)[0].token_ids)
    assert eng.reset_prefix_cache()
    before = llm.stats()
    warm = [llm.generate(prompt_token_ids=[p], sampling_params=GREEDY4)[0] for p in prompts]
    after = llm.stats()
    assert [o.token_ids for o in warm] == cold
    assert [o.num_cached_tokens for o in warm] == [0, 32]
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == 32
    assert after["compilations_after_warmup"] == 0
    assert after["free_pages"] == after["total_pages"]


def test_logprobs_match_transformers(deepseek_engines):
    """Prompt log-probabilities (the 40-token prompt in two chunks) and the sampled tokens'
    equal transformers' log-softmax within 1e-4, the top 3 included."""
    golden = np.load(GOLDEN.format("tiny-deepseek"))
    llm = deepseek_engines("chunked")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3,
                            prompt_logprobs=3)
    prompts = [golden[f"prompt_{i}"].tolist() for i in range(3)]
    for i, out in enumerate(llm.generate(prompt_token_ids=prompts, sampling_params=params)):
        ids, want = prompts[i], golden[f"prompt_logprobs_{i}"]
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
        for p in range(1, len(ids)):
            d = out.prompt_logprobs[p]
            assert set(d) == {ids[p], *np.argsort(-want[p - 1])[:3].tolist()}, (i, p)
            for t, v in d.items():
                assert abs(v - want[p - 1, t]) < 1e-4, (i, p, t)
        assert out.token_ids == golden[f"greedy_{i}"][:4].tolist()
        for s, d in enumerate(out.logprobs):
            top = golden[f"greedy_top_ids_{i}"][s, :3].tolist()
            assert set(d) == {out.token_ids[s], *top}
            for t, v in zip(top, golden[f"greedy_top_logprobs_{i}"][s, :3], strict=True):
                assert abs(d[t] - v) < 1e-4, (i, s, t)


def test_structured_outputs_keep_random_weights_in_the_language(deepseek_engines):
    """With random weights only the grammar's mask keeps samples in a regex; every one
    stops at eos after a complete match, and no matcher or page is left behind."""
    import re

    from lp_jax.structured.params import StructuredOutputsParams

    llm = deepseek_engines("chunked")
    regex = r"[a-c]{2,5}-[0-9]{1,3}"
    params = [SamplingParams(temperature=1.0, seed=7 + i, max_tokens=24,
                             structured_outputs=StructuredOutputsParams(regex=regex))
              for i in range(8)]
    outs = [o.outputs[0] for o in llm.generate(prompt_token_ids=[[1, 2, 3, 4]] * 8,
                                               sampling_params=params)]
    assert all(o.finish_reason == "stop" and re.fullmatch(regex, o.text) for o in outs), \
        [(o.finish_reason, o.text) for o in outs]
    stats = llm.stats()
    assert stats["structured_outputs"]["live"] == 0
    assert stats["free_pages"] == stats["total_pages"]


@functools.partial(jax.jit, static_argnums=0)
def _prefill_program(graphdef, state, token_ids_T, meta):
    model = nnx.merge(graphdef, state)
    kv = init_kv_cache(model.config, 2, 36, model.dtype)
    x_TD = model.run_layers(model.embed(token_ids_T), kv, meta, 0,
                            model.config.num_hidden_layers)[0]
    return model.compute_logits(x_TD)


def _prompt_logits(model, prompt):
    """A prompt's logits from one prefill: one program per model structure and layout."""
    T = len(prompt)
    meta = jax.tree.map(jnp.asarray, build_metadata([(0, T, [0, 1])], page_size=36,
                                                    num_tokens=T, num_seqs=1, pages_per_seq=2))
    graphdef, state = nnx.split(model)
    return np.asarray(_prefill_program(graphdef, state, jnp.asarray(prompt, jnp.int32), meta))


@pytest.mark.parametrize("method,expert", [("int8", 1), ("fp8", 8)])
def test_quantized_at_load_and_expert_parallel(method, expert):
    """quantization="int8" / "fp8" on the float checkpoint: the latent projections,
    kv_b_proj included, and the experts become int8 / e4m3 with per-channel scales, and
    the model computes what the float model on one device holding the dequantised
    weights computes (kv_b_proj's scale folded into the query and the output is exact).
    The fp8 model runs with its routed experts over the 8 devices (expert parallelism,
    one expert a device, scales beside them)."""
    from lp_jax.models.deepseek_v3 import quantized_params
    from lp_jax.quant.linear import scale_of
    from lp_jax.sharding import make_mesh

    model_dir = ensure_tiny(preset="tiny-deepseek")
    quantized = load_model(model_dir, quantization=method, mesh=make_mesh(expert=expert))
    dequantised = load_model(model_dir)
    attn, mlp = quantized.model.layers.self_attn, quantized.model.layers.mlp
    assert attn.kv_b_proj[...].dtype == jnp.dtype(jnp.int8 if method == "int8"
                                                    else jnp.float8_e4m3fn)
    assert attn.kv_b_proj_scale[...].shape == (3, 4, 1, 16 + 16)  # per (head, channel)
    for w in (mlp.experts_gate_up_proj[...], mlp.experts_gate_up_proj_scale[...]):
        assert len(w.sharding.device_set) == expert
        assert w.sharding.shard_shape(w.shape)[1] == 8 // expert  # experts a device
    converted = 0
    for key, scheme in quantized_params(quantized.config).items():
        if scheme is not None:
            kind, name = key.split(".")
            q_mod, f_mod = (getattr(m.model.layers, kind) for m in (quantized, dequantised))
            assert scheme.block_k is None  # per output channel: a [.., 1, N] scale
            w_q = np.asarray(getattr(q_mod, name)[...]).astype(np.float32)
            getattr(f_mod, name).set_value(w_q * np.asarray(scale_of(q_mod, name)[...]))
            converted += 1
    assert converted == 13  # 5 latent projections, experts (2), dense MLP (3), shared (3)
    prompt = np.load(GOLDEN.format("tiny-deepseek"))["prompt_2"].tolist()
    np.testing.assert_allclose(_prompt_logits(quantized, prompt),
                               _prompt_logits(dequantised, prompt), rtol=0, atol=1e-4)


def test_kimi_k2_serves_token_ids_and_names_its_tokenizer(tmp_path, deepseek_engines):
    """Kimi-K2 as published: model_type kimi_k2 and a tiktoken tokenizer with custom code,
    no tokenizer.json. The engine serves token ids (the tiny-deepseek weights: the golden
    tokens) and refuses text naming why, in LLM() and the server (400); with a
    tokenizer.json beside it, text is served."""
    from conftest import start_server
    from test_server_input import COMPLETIONS, post

    from lp_jax.server.mock import MockEngine

    src = ensure_tiny(preset="tiny-deepseek")
    kimi = tmp_path / "Kimi-K2-tiny"
    kimi.mkdir()
    hf = json.loads((src / "config.json").read_text())
    (kimi / "config.json").write_text(json.dumps({**hf, "model_type": "kimi_k2"}))
    for f in ("model.safetensors", "generation_config.json"):
        (kimi / f).symlink_to(src / f)
    (kimi / "tiktoken.model").write_text("")  # the shapes of Kimi-K2's files only
    (kimi / "tokenization_kimi.py").write_text("")
    golden = np.load(GOLDEN.format("tiny-deepseek"))
    llm = LLM(str(kimi), max_num_seqs=4, max_model_len=80, log=None, **ENGINES["chunked"])
    try:
        out = llm.generate(prompt_token_ids=[golden["prompt_1"].tolist()],
                           sampling_params=GREEDY4)[0]
        assert out.token_ids == golden["greedy_1"][:4].tolist()
        with pytest.raises(ValueError, match="tiktoken with custom code.*tokenization_kimi"
                                             ".*tokenizer.json"):
            llm.generate(["hello"], GREEDY4)
        assert not llm.engine.has_unfinished()
    finally:
        llm.shutdown()
    with start_server(MockEngine(model_dir=kimi, max_model_len=64)) as st:
        status, data = post(st, COMPLETIONS, {"prompt": "hello", "max_tokens": 2})
        assert status == 400 and b"tiktoken with custom code" in data, data
        assert str(tmp_path).encode() not in data  # the directory's name, not its path
        status, data = post(st, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert status == 400 and b"tiktoken with custom code" in data, data
        assert post(st, COMPLETIONS, {"prompt": [5, 6], "max_tokens": 2})[0] == 200
    (kimi / "tokenizer.json").symlink_to(src / "tokenizer.json")
    with start_server(MockEngine(model_dir=kimi, max_model_len=64)) as st:
        assert post(st, COMPLETIONS, {"prompt": "hello", "max_tokens": 2})[0] == 200


def test_orbax_round_trip_keeps_the_latent_projections_layout(tmp_path):
    """The latent projections as MlaAttention holds them (kv_a_proj_with_mqa tile-padded
    with zero columns, kv_b_proj heads-major with its per-(head, channel) int8 scale)
    survive save_params / restore_params onto a mesh that splits the heads: kv_b_proj
    and its scale one head a device, every value unchanged."""
    from lp_jax.loader import restore_params, save_params
    from lp_jax.models.deepseek_v3 import kv_a_width
    from lp_jax.sharding import make_mesh

    model = load_model(ensure_tiny(preset="tiny-deepseek"), quantization="int8")
    cfg, attn = model.config, model.model.layers.self_attn
    A, R = cfg.kv_lora_rank, cfg.head_dim
    kv_a = np.asarray(attn.kv_a_proj_with_mqa[...])
    assert kv_a.shape[-1] == kv_a_width(cfg) == 128 and not kv_a[..., A + R:].any()
    save_params(model, tmp_path / "ckpt")
    restored = restore_params(cfg, tmp_path / "ckpt", mesh=make_mesh(tensor=4))
    got = restored.model.layers.self_attn
    for name in ("kv_a_proj_with_mqa", "kv_b_proj", "kv_b_proj_scale"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name)[...]),
                                      np.asarray(getattr(attn, name)[...]), err_msg=name)
    for w in (got.kv_b_proj[...], got.kv_b_proj_scale[...]):  # [L, N, A | 1, H + O]
        assert w.sharding.shard_shape(w.shape)[1] == 1, w.sharding
