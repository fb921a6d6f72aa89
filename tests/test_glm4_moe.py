"""GLM-4.5 (glm4_moe) against Hugging Face transformers, and its config dialect.

Goldens (tests/golden/make_golden.py, transformers 5.24 on CPU, float32) of two tiny
random checkpoints in the hubs' config.json dialect (checkpoints/make_tiny.py): "tiny-glm"
(QK norm, q/k/v biases, partial rotary 0.5, a dense first layer, one shared expert,
sigmoid routing with a correction bias, scaling 2.5, one MTP layer in the checkpoint)
and "tiny-glm-groups" (no QK norm, 16 experts in 4 groups of which 2 are eligible,
top-4). Prompt logits within 1e-4 and greedy tokens identical, through the model
(`greedy_generate`) and through the engine under orca, chunked and layered, each with
one program (the dense first layer shares the loop body through `lax.cond`); expert
parallelism; logprobs, prefix caching and structured outputs; int8 at load and the HF
FP8 checkpoint format against the float model holding the dequantised weights; fp8 at
load with the FP8 KV cache against that model with its K/V rounded to e4m3 on write.
"""

import json
import logging

import numpy as np
import pytest
from conftest import GOLDEN_ENGINES, run_golden_prompts

from checkpoints.make_tiny import GLM_PRESETS, ensure_tiny, weights_digest
from lp_jax import LLM, SamplingParams
from lp_jax.config import ModelConfig
from lp_jax.loader import load_model
from lp_jax.loader_quant import param_schemes
from lp_jax.models import Glm4MoeForCausalLM, KernelBackends
from lp_jax.models.simple import greedy_generate
from lp_jax.sharding import make_mesh
from pallas_kernels.moe.ref import Router
from pallas_kernels.quant import ref_dequantize

GOLDEN = "tests/golden/{}.npz"


def test_config_reads_the_published_dialect():
    cfg = ModelConfig.from_pretrained(ensure_tiny(preset="tiny-glm-groups"))
    assert cfg.router == Router("sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5)
    assert (cfg.num_experts, cfg.n_shared_experts, cfg.rotary_dim) == (16, 1, 8)
    assert cfg.dense_layers == (0,) and cfg.moe_layers == (1, 2, 3)
    assert cfg.attention_bias and not cfg.use_qk_norm and cfg.num_nextn_predict_layers == 1
    # transformers 5's dialect: partial_rotary_factor inside rope_parameters
    hf = json.loads((ensure_tiny(preset="tiny-glm") / "config.json").read_text())
    factor, theta = hf.pop("partial_rotary_factor"), hf.pop("rope_theta")
    hf["rope_parameters"] = {"rope_type": "default", "rope_theta": theta,
                             "partial_rotary_factor": factor}
    assert ModelConfig.from_hf_dict(hf) == ModelConfig.from_pretrained(
        ensure_tiny(preset="tiny-glm")).replace(extra_eos_token_ids=())


@pytest.mark.parametrize("field,value", [("hidden_act", "gelu"), ("scoring_func", "softmax"),
                                         ("topk_method", "greedy"), ("n_group", 3)])
def test_unsupported_fields_fail_before_building(field, value):
    hf = json.loads((ensure_tiny(preset="tiny-glm") / "config.json").read_text())
    with pytest.raises(ValueError, match=field if field != "n_group" else "n_group=3"):
        ModelConfig.from_hf_dict({**hf, field: value})


@pytest.mark.parametrize("preset", sorted(GLM_PRESETS))
def test_matches_transformers(preset, caplog):
    golden = np.load(GOLDEN.format(preset))
    model_dir = ensure_tiny(preset=preset)
    assert str(golden["weights_digest"]) == weights_digest(model_dir), "rerun make_golden.py"
    with caplog.at_level(logging.INFO, logger="lp_jax.loader"):
        model = load_model(model_dir)
    assert "skipping 1 next-token (MTP) layer(s)" in caplog.text
    assert isinstance(model, Glm4MoeForCausalLM)
    rows = max(len(golden[f"prompt_{i}"]) for i in range(3))  # one prefill program
    for i in range(3):
        prompt, want = golden[f"prompt_{i}"].tolist(), golden[f"greedy_{i}"].tolist()
        assert -(-(len(prompt) + len(want)) // 36) == 2  # one decode program
        tokens, logits = greedy_generate(model, prompt, len(want), page_size=36,
                                         return_prompt_logits=True, prefill_rows=rows)
        np.testing.assert_allclose(logits, golden[f"logits_{i}"], rtol=0, atol=1e-4)
        assert tokens == want, f"{preset} prompt {i}: greedy continuation differs"


ENGINES = GOLDEN_ENGINES


@pytest.fixture(scope="module")
def glm_engines():
    """policy -> an engine on tiny-glm-groups, built on first use, shut down at the end."""
    built = {}

    def get(policy):
        if policy not in built:
            built[policy] = LLM(str(ensure_tiny(preset="tiny-glm-groups")), max_num_seqs=4,
                                max_model_len=80, log=None, **ENGINES[policy])
        return built[policy]

    yield get
    for llm in built.values():
        llm.shutdown()


@pytest.mark.parametrize("policy", list(ENGINES))
def test_engine_policies_match_golden_greedy(policy, glm_engines):
    """32 greedy tokens per prompt equal to transformers' under each policy, prefills
    beside decodes; one program per row bucket (dense and MoE layers share it)."""
    golden = np.load(GOLDEN.format("tiny-glm-groups"))
    llm = glm_engines(policy)
    outs = run_golden_prompts(llm.engine, golden)
    for i in range(3):
        assert outs[i].token_ids == golden[f"greedy_{i}"].tolist(), f"{policy} prompt {i}"
    stats = llm.stats()
    assert stats["programs"] == 1 and stats["compilations_after_warmup"] == 0, stats


def test_logprobs_prefix_cache_and_structured_outputs(glm_engines):
    """On the chunked engine: sampled log-probabilities equal transformers' log-softmax
    (1e-4), a repeated prompt hits the prefix cache and still gives transformers' token,
    and a regex-constrained answer matches its regex."""
    golden = np.load(GOLDEN.format("tiny-glm-groups"))
    llm = glm_engines("chunked")
    prompt = golden["prompt_2"].tolist()
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True, logprobs=3))[0]
    assert out.token_ids == golden["greedy_2"][:4].tolist()
    for s, d in enumerate(out.logprobs):
        assert abs(d[out.token_ids[s]] - golden["greedy_logprobs_2"][s]) < 1e-4
    hits = llm.stats()["prefix_cache_hits"]
    again = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        temperature=0, max_tokens=1))[0]
    assert llm.stats()["prefix_cache_hits"] > hits
    assert again.token_ids == golden["greedy_2"][:1].tolist()
    regex = llm.generate(["The answer is"], SamplingParams(
        temperature=0, max_tokens=8, structured_outputs={"regex": "(yes|no)\\."}))[0]
    assert regex.text in ("yes.", "no."), regex.text
    assert llm.stats()["compilations_after_warmup"] == 0


def test_expert_parallel_matches_transformers():
    """Routed experts over the mesh's ("expert", "tensor") chips (2 of the 16 on each of
    4 x 2 shards), heads over "tensor" (2); the shared experts and the correction bias on
    every shard. The all_to_all dispatch routes with the sigmoid group-limited router: the
    numbers stay transformers'. (allreduce with the same router: tests/test_moe_router.py.)"""
    golden = np.load(GOLDEN.format("tiny-glm-groups"))
    model = load_model(ensure_tiny(preset="tiny-glm-groups"), mesh=make_mesh(expert=4, tensor=2))
    w = model.model.layers.mlp.experts_gate_up_proj[...]
    assert w.sharding.shard_shape(w.shape)[1] == 2
    tokens, logits = greedy_generate(model, golden["prompt_1"].tolist(), 2,
                                     return_prompt_logits=True,
                                     backends=KernelBackends(moe_dispatch="all_to_all"))
    np.testing.assert_allclose(logits, golden["logits_1"], rtol=0, atol=1e-4)
    assert tokens == golden["greedy_1"][:2].tolist()


def test_quantized_at_load():
    """int8 per channel at load (fp8 takes the same parameter table): attention, dense,
    routed and shared experts converted (router, correction bias, embedding and head
    not), and the quantized model
    computes what the float32 model with those weights dequantised computes (the format
    moves the logits far more than that: the tiny model's router margins are ~1e-4)."""
    model_dir = ensure_tiny(preset="tiny-glm")
    model = load_model(model_dir, quantization="int8")
    layers = model.model.layers
    for module, name in ((layers.shared_experts, "gate_proj"), (layers.mlp, "experts_down_proj"),
                         (layers.dense_mlp, "up_proj"), (layers.self_attn, "q_proj")):
        assert getattr(module, name)[...].dtype.itemsize == 1, name
    assert layers.mlp.e_score_correction_bias[...].dtype == np.float32
    oracle = load_model(model_dir)
    for path, scheme in param_schemes(model.config).items():
        q, dq = model, oracle
        for key in path[:-1]:
            q, dq = getattr(q, key), getattr(dq, key)
        getattr(dq, path[-1]).set_value(ref_dequantize(
            getattr(q, path[-1])[...], getattr(q, path[-1] + "_scale")[...], scheme))
    prompt = np.load(GOLDEN.format("tiny-glm"))["prompt_1"].tolist()
    _, logits = greedy_generate(model, prompt, 1, return_prompt_logits=True)
    _, want = greedy_generate(oracle, prompt, 1, return_prompt_logits=True)
    np.testing.assert_allclose(logits, want, rtol=0, atol=1e-3)


def test_hf_fp8_block_checkpoint(tmp_path):
    """GLM-4.5's published FP8 format (HF fine-grained e4m3, 128 x 128 weight_scale_inv):
    a tiny-glm with 128-wide experts whose attention, dense, routed and shared expert
    projections make_tiny_quant's numpy quantiser converted (router and o_proj kept, as
    modules_to_not_convert says) computes what the float32 model holding the dequantised
    weights computes."""
    from checkpoints import make_tiny
    from checkpoints import make_tiny_quant as mtq

    cfg = {**make_tiny.build_config("tiny-glm"), "moe_intermediate_size": 128,
           "intermediate_size": 256}
    qc = mtq.quantization_config({**cfg, "num_experts": cfg["n_routed_experts"]})
    fp8, dequant = {}, {}
    for name, w in make_tiny.make_weights(cfg).items():
        module = name.removesuffix(".weight")
        if (w.ndim == 2 and name.endswith("_proj.weight") and "eh_proj" not in name
                and module not in qc["modules_to_not_convert"]):
            q, s = mtq.quantize_fp8_blocks(w, np.float32)
            fp8[name], fp8[name + "_scale_inv"] = q, s
            dequant[name] = mtq.dequantize_fp8_blocks(q, s)
        else:
            fp8[name] = dequant[name] = w
    src = ensure_tiny(preset="tiny-glm")
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
    layers = model.model.layers  # routed experts kept e4m3, dense ones dequantised at load
    assert layers.mlp.experts_gate_up_proj[...].dtype.itemsize == 1
    assert layers.shared_experts.gate_proj[...].dtype.itemsize == 4
    prompt = np.load(GOLDEN.format("tiny-glm"))["prompt_1"].tolist()
    _, logits = greedy_generate(model, prompt, 1, return_prompt_logits=True)
    _, want = greedy_generate(load_model(dirs["dequant"]), prompt, 1, return_prompt_logits=True)
    np.testing.assert_allclose(logits, want, rtol=0, atol=1e-3)


def test_fp8_kv_cache_and_fp8_weights_equal_their_oracle(monkeypatch):
    """fp8 at load and the FP8 KV cache together on tiny-glm (the chunked engine, one
    bucket): teacher-forced prompt log-probabilities equal those of the float32 model
    holding the fp8-dequantised weights with its K/V rounded to e4m3 on write (scale
    1.0, as the engine's: no checkpoint scales), through the plain forward (measured
    2026-12-07: within 1.2e-5; the same oracle with float K/V is 2.8 away, so the check
    sees the cache's rounding)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from lp_jax.models import simple, stacked
    from pallas_kernels.attention import ref

    model_dir = ensure_tiny(preset="tiny-glm")
    llm = LLM(str(model_dir), max_num_seqs=4, max_model_len=80, log=None,
              quantization="fp8", kv_cache_dtype="fp8", **ENGINES["chunked"])
    try:
        assert llm.engine.runner.kv_pages.dtype == jnp.float8_e4m3fn
        golden = np.load(GOLDEN.format("tiny-glm"))
        ids = golden["prompt_2"].tolist() + golden["greedy_2"][:7].tolist()
        out = llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(
            temperature=0, max_tokens=1, prompt_logprobs=0))[0]
        got = np.asarray([out.prompt_logprobs[p][ids[p]] for p in range(1, len(ids))])
        assert llm.stats()["compilations_after_warmup"] == 0
        assert llm.stats()["free_pages"] == llm.stats()["total_pages"]
        runner = llm.engine.runner  # the engine's own fp8 weights
        model = nnx.merge(runner.graphdef, runner.state)
    finally:
        llm.shutdown()
    assert model.model.layers.shared_experts.gate_proj[...].dtype == jnp.float8_e4m3fn
    oracle = load_model(model_dir)
    for path, scheme in param_schemes(model.config).items():
        q, dq = model, oracle
        for key in path[:-1]:
            q, dq = getattr(q, key), getattr(dq, key)
        getattr(dq, path[-1]).set_value(ref_dequantize(
            getattr(q, path[-1])[...], getattr(q, path[-1] + "_scale")[...], scheme))

    def e4m3_write(kv, k, v, slots, **_):
        deq = [jnp.clip(x, -448, 448).astype(jnp.float8_e4m3fn).astype(jnp.float32)
               for x in (k, v)]
        return ref.write_kv(kv, *deq, slots)

    monkeypatch.setattr(stacked, "write_kv", e4m3_write)
    simple._forward.clear_cache()  # no program traced with the plain write_kv
    try:
        _, logits = simple.greedy_generate(oracle, ids, 1, return_prompt_logits=True)
    finally:
        simple._forward.clear_cache()  # nor one traced with the fake quantiser left behind
    logp = np.asarray(jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1))
    want = np.asarray([logp[p - 1, ids[p]] for p in range(1, len(ids))])
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-3)
