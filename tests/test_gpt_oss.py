"""GPT-OSS: config, the reference kernels' new features against numpy, MXFP4, logits and
greedy tokens against Hugging Face (tests/golden/tiny-gpt-oss*.npz), the engine under
every policy, and the full GPT-OSS-20B shapes built abstractly."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import GOLDEN_ENGINES, run_golden_prompts
from flax import nnx

from checkpoints.make_tiny import GPT_OSS_PRESETS, ensure_tiny, weights_digest
from lp_jax import LLM
from lp_jax.config import ModelConfig
from lp_jax.loader import abstract_model, dequantize_mxfp4, load_model, param_shardings
from lp_jax.models import GptOssForCausalLM, KernelBackends, gpt_oss
from lp_jax.models.gpt_oss import serving_backends
from lp_jax.models.simple import greedy_generate
from lp_jax.sharding import make_mesh
from pallas_kernels import attention, moe
from pallas_kernels.attention.ref import ref_decode_attention, ref_ragged_paged_attention
from pallas_kernels.moe.ref import ref_moe_ffn
from pallas_kernels.moe.xla_tiles import moe_ffn_xla_tiles

GOLDEN = "tests/golden/{}.npz"
CONFIG_20B = "checkpoints/configs/gpt-oss-20b.json"


# ------------------------------------------------------------------------ config
def test_config_20b():
    cfg = ModelConfig.from_pretrained_file(CONFIG_20B)
    assert (cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok) == (24, 32, 4)
    assert (cfg.hidden_size, cfg.moe_intermediate_size, cfg.head_dim) == (2880, 2880, 64)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (64, 8, 201088)
    assert [cfg.layer_window(i) for i in range(4)] == [128, None, 128, None]
    assert cfg.moe_layers == tuple(range(24)) and cfg.norm_topk_prob
    assert cfg.has_attention_sinks and cfg.has_moe_bias and cfg.attention_bias
    assert (cfg.swiglu_limit, cfg.swiglu_alpha, cfg.rms_norm_eps) == (7.0, 1.702, 1e-5)
    assert cfg.rope_theta == 150000.0 and cfg.rope_scaling.factor == 32.0
    assert cfg.rope_scaling.original_max_position_embeddings == 4096
    assert not cfg.rope_scaling.truncate
    # Qwen3 keeps its defaults: no window, sinks, biases or scaled RoPE.
    qwen = ModelConfig.from_pretrained_file("checkpoints/configs/Qwen3-30B-A3B.json")
    assert qwen.layer_window(0) is None and qwen.rope_scaling is None
    assert not (qwen.has_attention_sinks or qwen.has_moe_bias or qwen.attention_bias)
    assert qwen.swiglu_limit is None
    with pytest.raises(ValueError, match="sliding_window"):
        ModelConfig.from_hf_dict({**_hf(CONFIG_20B), "sliding_window": 0})
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig.from_hf_dict({**_hf(CONFIG_20B), "layer_types": ["full_attention"]})


def _hf(path):
    import json

    with open(path) as f:
        return json.load(f)


# --------------------------------------------------------------------- attention
def _np_attention(q_TNH, kv, tables, q_lens, ctx, *, scale, sinks_N, window):
    """Plain numpy: each sequence's queries against its gathered keys, HF's sink softmax."""
    T, N, H = q_TNH.shape
    S, K = kv.shape[1], kv.shape[2] // 2
    out = np.zeros((T, N, H), np.float32)
    t0 = 0
    for b, (n, c) in enumerate(zip(q_lens, ctx, strict=True)):
        pos = np.arange(c)
        rows = kv[tables[b][pos // S], pos % S]  # [c, 2K, H]
        k_cKH, v_cKH = rows[:, 0::2], rows[:, 1::2]
        for i in range(n):
            p = c - n + i
            vis = pos <= p
            if window:
                vis &= pos > p - window
            for h in range(N):
                s = (k_cKH[:, h // (N // K)] @ q_TNH[t0 + i, h]) * scale
                s = np.where(vis, s, -np.inf)
                logits = np.concatenate([s, [sinks_N[h] if sinks_N is not None else -np.inf]])
                w = np.exp(logits - logits.max())
                w = w[:-1] / w.sum()
                out[t0 + i, h] = w @ v_cKH[:, h // (N // K)]
        t0 += n
    return out


def _paged_problem(q_lens, ctx, *, S=8, N=4, K=2, H=16, pad_tokens=3):
    rng = np.random.default_rng(0)
    C = max(-(-c // S) for c in ctx)
    P = len(ctx) * C + 2
    kv = rng.standard_normal((P, S, 2 * K, H)).astype(np.float32)
    tables = rng.permutation(P)[: len(ctx) * C].reshape(len(ctx), C).astype(np.int32)
    q = rng.standard_normal((sum(q_lens) + pad_tokens, N, H)).astype(np.float32)
    sinks = rng.standard_normal(N).astype(np.float32)
    return kv, tables, q, sinks


@pytest.mark.parametrize("window", [0, 5, 16])
def test_ragged_attention_sinks_and_window(window):
    q_lens, ctx = [11, 5, 1, 20], [19, 5, 22, 40]  # chunks after context, a prompt, a decode
    kv, tables, q, sinks = _paged_problem(q_lens, ctx)
    qs = np.cumsum([0, *q_lens]).astype(np.int32)
    fn = jax.jit(lambda q, kv, w: ref_ragged_paged_attention(
        q, kv, jnp.asarray(qs), jnp.asarray(ctx, jnp.int32), jnp.asarray(tables), jnp.int32(4),
        sm_scale=0.25, block_q=16, sinks_N=jnp.asarray(sinks),
        sliding_window=w))  # the window is traced: one program for every layer kind
    got = np.asarray(fn(q, kv, np.int32(window)))
    want = _np_attention(q, kv, tables, q_lens, ctx, scale=0.25, sinks_N=sinks, window=window)
    np.testing.assert_allclose(got[: sum(q_lens)], want[: sum(q_lens)], atol=2e-5)
    assert not got[sum(q_lens):].any()  # padding tokens
    if window == 0:  # no sinks and no window: the original path
        plain = ref_ragged_paged_attention(*map(jnp.asarray, (q, kv, qs, ctx, tables)),
                                           jnp.int32(4), sm_scale=0.25)
        want0 = _np_attention(q, kv, tables, q_lens, ctx, scale=0.25, sinks_N=None, window=0)
        np.testing.assert_allclose(np.asarray(plain)[: sum(q_lens)], want0[: sum(q_lens)],
                                   atol=2e-5)


def test_decode_attention_sinks_window_and_page_skipping():
    ctx, window, S = [45, 38, 0], 6, 8  # the last sequence is padding
    kv, tables, q, sinks = _paged_problem([1, 1], ctx[:2], S=S, pad_tokens=1)
    want = _np_attention(q, kv, tables, [1, 1], ctx[:2], scale=0.25, sinks_N=sinks,
                         window=window)
    # Pages wholly before the window hold NaN: reading them (even masked) poisons the output.
    for b, c in enumerate(ctx[:2]):
        kv[tables[b][: (c - window) // S]] = np.nan
    tables = np.concatenate([tables, np.zeros_like(tables[:1])])
    got = np.asarray(ref_decode_attention(*map(jnp.asarray, (q, kv, ctx, tables)),
                                          sm_scale=0.25, sinks_N=jnp.asarray(sinks),
                                          sliding_window=window))
    np.testing.assert_allclose(got[:2], want[:2], atol=2e-5)
    assert np.isfinite(got).all() and not got[2].any()


def test_tpu_jax_refuses_sinks_and_gpt_oss_swaps_it(monkeypatch):
    """JAX's shipped TPU kernel has no sinks or windows: its entry point refuses them,
    and GPT-OSS layers asked to run on it take our TPU kernel, with a warning; every
    other backend serves GPT-OSS as asked."""
    kv, tables, q, sinks = _paged_problem([1], [9], pad_tokens=0)
    with attention.interpret_mode(), pytest.raises(ValueError, match="sinks_N"):
        attention.decode_attention(*map(jnp.asarray, (q, kv, [9], tables)), sm_scale=0.25,
                                   backend="tpu_jax", sinks_N=jnp.asarray(sinks))
    monkeypatch.setattr(gpt_oss, "_WARNED", set())  # warned once per process
    with pytest.warns(UserWarning, match="GPT-OSS: attention backend 'tpu_jax' -> 'tpu'"):
        chosen = serving_backends(KernelBackends(moe="tpu", attention="tpu_jax"))
    assert (chosen.moe, chosen.attention) == ("tpu", "tpu")
    for b in (KernelBackends(), KernelBackends(moe="gpu", attention="gpu"),
              KernelBackends(moe="tpu", attention="tpu")):
        assert serving_backends(b) == b


# --------------------------------------------------------------------------- MoE
def _np_moe(x, logits, wgu, bgu, wd, bd, top_k, limit, alpha=1.702):
    """transformers' GptOssMLP with the [gate | up] layout: top-k logits, softmax over
    them, clamped SwiGLU with biases."""
    F = wd.shape[1]
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        top = np.argsort(-logits[t])[:top_k]
        w = np.exp(logits[t, top] - logits[t, top].max())
        w /= w.sum()
        for e, we in zip(top, w, strict=True):
            gu = x[t] @ wgu[e] + bgu[e]
            gate, up = np.minimum(gu[:F], limit), np.clip(gu[F:], -limit, limit)
            h = (up + 1) * gate / (1 + np.exp(-alpha * gate))
            y[t] += we * (h @ wd[e] + bd[e])
    return y


def test_moe_biases_and_clamped_swiglu():
    rng = np.random.default_rng(1)
    T, D, E, F, L, A, limit = 12, 16, 6, 8, 2, 2, 0.8
    x = rng.standard_normal((T, D)).astype(np.float32)
    logits = rng.standard_normal((T, E)).astype(np.float32)
    wgu = (rng.standard_normal((L, E, D, 2 * F)) * D**-0.5).astype(np.float32)
    wd = (rng.standard_normal((L, E, F, D)) * F**-0.5).astype(np.float32)
    bgu = rng.standard_normal((L, E, 2 * F)).astype(np.float32) * 0.5
    bd = rng.standard_normal((L, E, D)).astype(np.float32) * 0.5
    mask = np.arange(T) < T - 2
    want = _np_moe(x, logits, wgu[1], bgu[1], wd[1], bd[1], A, limit) * mask[:, None]
    x, logits, wgu, wd, bgu, bd, mask = map(jnp.asarray, (x, logits, wgu, wd, bgu, bd, mask))
    kw = dict(layer=1, top_k=A, norm_topk_prob=True, token_mask_T=mask, biases=(bgu, bd),
              activation=moe.MoEActivation("gpt_oss_clamped", limit=limit))
    for fn in (ref_moe_ffn, moe_ffn_xla_tiles):
        got, stats = fn(x, logits, wgu, wd, **kw)
        np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, err_msg=fn.__name__)
        per_expert = (D * 2 * F + F * D + 2 * F + D) * 4  # weights and biases, float32
        assert float(stats["expert_bytes_loaded"]) == int(stats["experts_activated"]) * per_expert
    for backend in ("tpu", "gpu"):  # the Pallas kernels take them too (parity:
        # tests/test_moe_kernels.py); tracing them is enough here
        got = jax.eval_shape(lambda *a, b=backend: moe.moe_ffn(
            *a, backend=b, interpret=True, **kw)[0], x, logits, wgu, wd)
        assert got.shape == x.shape


def test_mxfp4_dequantization_matches_transformers():
    g = np.load(GOLDEN.format("tiny-gpt-oss-mxfp4"))
    # transformers' convert_moe_packed_tensors returns [E, in, out]; ours [..., in] rows.
    ours = dequantize_mxfp4(g["mxfp4_blocks"], g["mxfp4_scales"]).transpose(0, 2, 1)
    np.testing.assert_array_equal(ours, g["mxfp4_dequantized"])
    # Layer 0's experts as the loader builds them from the MXFP4 checkpoint.
    model = load_model(ensure_tiny(preset="tiny-gpt-oss-mxfp4"))
    gate_up = np.asarray(model.model.layers.mlp.experts_gate_up_proj[0])
    hf = g["mxfp4_layer0_gate_up_proj"]
    np.testing.assert_array_equal(gate_up, np.concatenate([hf[..., 0::2], hf[..., 1::2]], -1))
    np.testing.assert_array_equal(np.asarray(model.model.layers.mlp.experts_down_proj[0]),
                                  g["mxfp4_layer0_down_proj"])


# ------------------------------------------------------------------ Hugging Face
@pytest.mark.parametrize("preset", sorted(GPT_OSS_PRESETS))
def test_matches_transformers(preset):
    golden = np.load(GOLDEN.format(preset))
    model_dir = ensure_tiny(preset=preset)
    assert str(golden["weights_digest"]) == weights_digest(model_dir), "rerun make_golden.py"
    model = load_model(model_dir)
    assert isinstance(model, GptOssForCausalLM)
    rows = max(len(golden[f"prompt_{i}"]) for i in range(3))  # one prefill program
    for i in range(3):
        prompt = golden[f"prompt_{i}"].tolist()
        want = golden[f"greedy_{i}"].tolist()
        # 36-token pages: all three prompts' decode steps share one program, as in
        # tests/test_golden_parity.py (2 pages each, each crossing a page boundary).
        assert -(-(len(prompt) + len(want)) // 36) == 2
        tokens, logits = greedy_generate(model, prompt, len(want), page_size=36,
                                         return_prompt_logits=True, prefill_rows=rows)
        np.testing.assert_allclose(logits, golden[f"logits_{i}"], rtol=0, atol=1e-4)
        assert tokens == want, f"{preset} prompt {i}: greedy continuation differs"


@pytest.mark.parametrize("expert,tensor", [(2, 4), (1, 8), (8, 1)])
def test_mesh_matches_transformers(expert, tensor):
    """Experts over "expert", heads over "tensor": GSPMD partitions the reference kernels;
    the numbers stay Hugging Face's. The tiny model has 4 query and 2 KV heads, so 8-way
    tensor parallelism cuts inside heads (q_proj: half a head per device, k/v_proj a
    quarter; sinks and the KV pool stay replicated), unlike gpt-oss-20b's 64 / 8 heads;
    8-way expert parallelism puts one of its 8 experts on each device."""
    golden = np.load(GOLDEN.format("tiny-gpt-oss"))
    mesh = make_mesh(expert=expert, tensor=tensor)
    model = load_model(ensure_tiny(preset="tiny-gpt-oss"), mesh=mesh)
    if tensor == 8:
        q = model.model.layers.self_attn.q_proj[...]
        assert q.sharding.shard_shape(q.shape)[-1] == 64 // 8  # 8 of a head's 16 columns
    if expert == 8:
        w = model.model.layers.mlp.experts_gate_up_proj[...]
        assert w.sharding.shard_shape(w.shape)[1] == 1
    tokens, logits = greedy_generate(model, golden["prompt_1"].tolist(), 8,
                                     return_prompt_logits=True)
    np.testing.assert_allclose(logits, golden["logits_1"], rtol=0, atol=1e-4)
    assert tokens == golden["greedy_1"][:8].tolist()


def test_mesh_all_to_all_matches_transformers():
    """The MoE under the all_to_all dispatch (experts over "expert" (2), each routed row
    sent to its expert's shard with the biases and clamped SwiGLU there, heads over
    "tensor" (4)): the numbers stay Hugging Face's."""
    golden = np.load(GOLDEN.format("tiny-gpt-oss"))
    model = load_model(ensure_tiny(preset="tiny-gpt-oss"), mesh=make_mesh(expert=2, tensor=4))
    tokens, logits = greedy_generate(model, golden["prompt_1"].tolist(), 1,
                                     return_prompt_logits=True,
                                     backends=KernelBackends(moe_dispatch="all_to_all"))
    np.testing.assert_allclose(logits, golden["logits_1"], rtol=0, atol=1e-4)
    assert tokens == golden["greedy_1"][:1].tolist()


# ------------------------------------------------------------------------ engine
ENGINES = {
    **GOLDEN_ENGINES,
    # FlowPrefill: operator-level preemption points, slack-aware EDF over the prefills
    "flowprefill": dict(scheduling="flowprefill", max_num_batched_tokens=64,
                        token_buckets=(68,)),
}


@pytest.mark.parametrize("policy", list(ENGINES))
def test_engine_policies_match_golden_greedy(policy):
    """32 greedy tokens per prompt, equal to Hugging Face's, under every policy; the later
    prompts arrive while the first decodes, so prefills run beside decodes."""
    golden = np.load(GOLDEN.format("tiny-gpt-oss"))
    llm = LLM(str(ensure_tiny(preset="tiny-gpt-oss")), max_num_seqs=4, max_model_len=80,
              log=None, **ENGINES[policy])
    outs = run_golden_prompts(llm.engine, golden)
    for i in range(3):
        assert outs[i].token_ids == golden[f"greedy_{i}"].tolist(), f"{policy} prompt {i}"
    stats = llm.stats()
    # One program per row bucket: both layer kinds share the loop body.
    assert stats["programs"] == len(ENGINES[policy]["token_buckets"]), stats
    assert stats["compilations_after_warmup"] == 0, stats
    if policy == "layered":  # the batch went through its two layer groups in two steps
        assert stats["iterations_prefill"] + stats["iterations_hybrid"] > stats["prefill_batches"]
    llm.shutdown()


# ---------------------------------------------------------------- 20B, abstractly
def test_20b_builds_abstractly_with_expected_bytes():
    cfg = ModelConfig.from_pretrained_file(CONFIG_20B)
    _, abstract = abstract_model(cfg)  # nnx.eval_shape: nothing is allocated
    flat = nnx.to_flat_state(abstract)
    assert all(v.dtype == jnp.bfloat16 for _, v in flat)
    L, D, V, E, F = 24, 2880, 201088, 32, 2880
    NH, KH, N = 64 * 64, 8 * 64, 64
    attn = 2 * D * NH + 2 * D * KH + NH + 2 * KH + D + N
    mlp = D * E + E + E * (D * 2 * F + 2 * F + F * D + D)
    params = 2 * V * D + D + L * (attn + 2 * D + mlp)
    # the embedding table is padded to 2944 = 23 x 128 columns (stacked.embed_width)
    assert sum(math.prod(v.shape) for _, v in flat) == params + V * (2944 - D)
    assert 20.5e9 < params < 21.5e9  # "gpt-oss-20b": 21B parameters
    assert cfg.expert_bytes == (3 * D * F + 2 * F + D) * 2
    # The shardings a 2 x 4 (expert x tensor) mesh gives it, from shapes alone: the 32
    # experts over all 8 chips (both axes), 4 a chip.
    shardings = dict(nnx.to_flat_state(param_shardings(abstract, make_mesh(expert=2, tensor=4))))
    spec = shardings[("model", "layers", "mlp", "experts_gate_up_proj")].spec
    assert tuple(spec)[:2] == (None, ("expert", "tensor"))


def test_dummy_load_runs():
    cfg = ModelConfig.from_pretrained(ensure_tiny(preset="tiny-gpt-oss"))
    model = load_model(config=cfg, load_format="dummy", seed=3)
    assert not np.asarray(model.model.layers.self_attn.sinks[...]).any()
    assert not np.asarray(model.model.layers.mlp.experts_down_proj_bias[...]).any()
    # the golden prompt 0's shapes and test_matches_transformers' pages: its programs
    tokens = greedy_generate(model, [1, 2, 3, 4, 5], 32, page_size=36)
    assert len(tokens) == 32
