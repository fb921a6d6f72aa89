"""The EAGLE-3 draft head (lp_jax/models/eagle3.py): loading the published layout
(checkpoints/make_tiny_eagle3.py writes a tiny random head), its checks, and the
paged, chained proposer against a dense recompute written here from the head's
published definition."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import record_drafts

from checkpoints.make_tiny import ensure_tiny
from checkpoints.make_tiny_eagle3 import write_eagle3_dir
from lp_jax.config import ModelConfig
from lp_jax.models.eagle3 import default_aux_layers, load_eagle3, propose_program
from lp_jax.models.kv_cache import kv_cache_shape
from lp_jax.models.metadata import build_metadata
from lp_jax.safetensors_io import CheckpointError

K_DRAFTS = 3
PAGE = 4


@pytest.fixture(scope="module")
def target():
    d = ensure_tiny(preset="tiny")
    return d, ModelConfig.from_pretrained(d).replace(dtype="float32")


@pytest.fixture(scope="module")
def head(target, tmp_path_factory):
    return write_eagle3_dir(tmp_path_factory.mktemp("eagle3"), target[0], draft_vocab_size=96)


def _embed(cfg):
    return np.random.RandomState(1).standard_normal((cfg.vocab_size, 128)).astype(np.float32)


# --------------------------------------------------------------- dense reference
def _rms(x, w, eps=1e-6):
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _rope(x_TNH, pos_T, theta):
    H = x_TNH.shape[-1]
    f = pos_T[:, None] / theta ** (np.arange(0, H, 2) / H)[None, :]
    f = np.concatenate([f, f], -1)[:, None]
    cos, sin = np.cos(f), np.sin(f)
    return x_TNH * cos + np.concatenate([-x_TNH[..., H // 2:], x_TNH[..., :H // 2]], -1) * sin


def _dense_layer(t, hf, embed, tokens, g_TD):
    """The head's layer over a whole sequence at positions 0.., causal: (logits, h)."""
    T, N, K, H = len(tokens), hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    D = hf["hidden_size"]
    x = np.concatenate([_rms(embed[tokens, :D], t["midlayer.input_layernorm.weight"]),
                        _rms(g_TD, t["midlayer.hidden_norm.weight"])], -1)
    a = "midlayer.self_attn."
    pos = np.arange(T)
    q = _rope((x @ t[a + "q_proj.weight"].T).reshape(T, N, H), pos, hf["rope_theta"])
    k = _rope((x @ t[a + "k_proj.weight"].T).reshape(T, K, H), pos, hf["rope_theta"])
    v = (x @ t[a + "v_proj.weight"].T).reshape(T, K, H)
    k, v = np.repeat(k, N // K, 1), np.repeat(v, N // K, 1)
    s = np.einsum("tnh,snh->nts", q, k) / np.sqrt(H) + np.triu(np.full((T, T), -1e30), 1)
    p = np.exp(s - s.max(-1, keepdims=True))
    o = np.einsum("nts,snh->tnh", p / p.sum(-1, keepdims=True), v).reshape(T, N * H)
    r = g_TD + o @ t[a + "o_proj.weight"].T
    u = _rms(r, t["midlayer.post_attention_layernorm.weight"])
    m = "midlayer.mlp."
    gate = u @ t[m + "gate_proj.weight"].T
    act = (gate / (1 + np.exp(-gate))) * (u @ t[m + "up_proj.weight"].T)
    h = r + act @ t[m + "down_proj.weight"].T
    return _rms(h, t["norm.weight"]) @ t["lm_head.weight"].T, h


def _dense_drafts(head_dir, embed, aux_T3D, next_T, k):
    """k greedy drafts after a sequence's rows, recomputing the whole sequence each step."""
    from safetensors.numpy import load_file

    t = {n: x.astype(np.float64) for n, x in load_file(str(head_dir / "model.safetensors")).items()}
    hf = json.loads((head_dir / "config.json").read_text())
    g = aux_T3D.reshape(len(next_T), -1) @ t["fc.weight"].T
    tokens, drafts = list(next_T), []
    for _ in range(k):
        logits, h = _dense_layer(t, hf, embed.astype(np.float64), np.asarray(tokens), g)
        j = int(np.argmax(logits[-1]))
        drafts.append(j + int(t["d2t"][j]))
        tokens.append(drafts[-1])
        g = np.concatenate([g, h[-1:]])
    return drafts


# -------------------------------------------------------------------- tests
def test_loads_published_layout_with_default_and_named_aux_layers(target, head, tmp_path):
    d, cfg = target
    ecfg, p = load_eagle3(head, cfg, _embed(cfg))
    assert ecfg.aux_layer_ids == default_aux_layers(8) == (2, 4, 5)
    assert p.embed_VE.shape == (cfg.vocab_size, 128)  # the target's: the head ships none
    assert (np.asarray(p.d2t_W) + np.arange(96)).max() < cfg.vocab_size
    named = write_eagle3_dir(tmp_path / "named", d, draft_vocab_size=96, aux_layer_ids=(1, 3, 6),
                             embed=True)
    ecfg, p = load_eagle3(named, cfg, _embed(cfg))
    assert ecfg.aux_layer_ids == (1, 3, 6)
    assert p.embed_VE.shape == (cfg.vocab_size, cfg.hidden_size)  # its own


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(architectures=["LlamaForCausalLM"]), "not an EAGLE-3 head"),
    (lambda c: c.update(vocab_size=1024), "vocab_size 1024 differs"),
    (lambda c: c.update(num_key_value_heads=4), "shares the target's pool layout"),
    (lambda c: c.update(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 8]}),
     "three layers in"),
    (lambda c: c.update(rope_scaling={"rope_type": "llama3"}), "rope_scaling"),
    (lambda c: c.update(intermediate_size=64), "has shape"),
])
def test_bad_head_gets_a_clear_error(target, head, tmp_path, edit, message):
    import shutil

    bad = shutil.copytree(head, tmp_path / "bad")
    c = json.loads((bad / "config.json").read_text())
    edit(c)
    (bad / "config.json").write_text(json.dumps(c))
    with pytest.raises(ValueError, match=message):
        load_eagle3(bad, target[1], _embed(target[1]))
    with pytest.raises(ValueError, match="no config.json"):
        load_eagle3(tmp_path / "nowhere", target[1], _embed(target[1]))


def test_missing_tensor_is_named(target, head, tmp_path):
    from safetensors.numpy import load_file, save_file

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((head / "config.json").read_text())
    t = load_file(str(head / "model.safetensors"))
    del t["d2t"]
    save_file(t, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing tensor 'd2t'"):
        load_eagle3(bad, target[1], _embed(target[1]))


def test_paged_chained_proposer_matches_dense_recompute_and_rolls_back(target, head):
    """Two ragged sequences on scattered pages: the extend plus k - 1 chained steps give
    the drafts a full recompute gives. Then sequence A rejects its last two rows and is
    extended from there with other rows: its stale KV (those rows and the chain's writes)
    must not reach the new drafts."""
    _, cfg = target
    ecfg, p = load_eagle3(head, cfg, _embed(cfg))
    embed = _embed(cfg)
    rng = np.random.RandomState(2)
    D = cfg.hidden_size
    aux_a, aux_b = rng.standard_normal((9, 3, D)), rng.standard_normal((3, 3, D))
    next_a, next_b = rng.randint(0, cfg.vocab_size, 9), rng.randint(0, cfg.vocab_size, 3)
    pages_a, pages_b = [5, 2, 7, 11], [9, 1]
    program = propose_program(ecfg, k=K_DRAFTS, backend="xla")
    kv = jnp.zeros(kv_cache_shape(cfg.replace(num_hidden_layers=1), 12, PAGE), jnp.float32)

    def run(kv, seqs, aux, nxt, last_rows):
        meta = build_metadata(seqs, page_size=PAGE, num_tokens=16, num_seqs=4, pages_per_seq=4)
        aux_T3D = np.zeros((16, 3, D), np.float32)
        aux_T3D[:len(aux)] = aux
        tok_T = np.zeros(16, np.int32)
        tok_T[:len(nxt)] = nxt
        last_B = np.zeros(4, np.int32)
        last_B[:len(last_rows)] = last_rows
        return program(p, kv, aux_T3D, tok_T, meta, last_B)

    # A's first rows 4 and 5 differ from the ones that will stand (rejected drafts).
    aux_first, next_first = aux_a[:6].copy(), next_a[:6].copy()
    aux_first[4:], next_first[4:] = rng.standard_normal((2, 3, D)), [7, 8]
    drafts, kv = run(kv, [(0, 6, pages_a), (0, 3, pages_b)],
                     np.concatenate([aux_first, aux_b]), np.concatenate([next_first, next_b]),
                     [5, 8])
    assert drafts.shape == (4, K_DRAFTS)
    assert drafts[0].tolist() == _dense_drafts(head, embed, aux_first, next_first, K_DRAFTS)
    assert drafts[1].tolist() == _dense_drafts(head, embed, aux_b, next_b, K_DRAFTS)

    # A keeps positions 0..3 and is extended over 4..8 with the rows that stand.
    drafts, kv = run(kv, [(4, 5, pages_a)], aux_a[4:9], next_a[4:9], [4])
    assert drafts[0].tolist() == _dense_drafts(head, embed, aux_a[:9], next_a[:9], K_DRAFTS)


# ------------------------------------------------------------ in the engine
GOLDEN = "tests/golden/{}.npz"
# Drafts of the two-token head: 289 and 194, which the golden greedy outputs of the tiny
# Qwen3-MoE checkpoint repeat (prompts 0 and 2), so some drafts stand.
TWO_TOKENS = (289, 194)
_aux_cache = {}


def _two_token_head(target_dir, out):
    """A head whose lm_head has two nonzero rows, v and -v: its draft is TWO_TOKENS[0] or
    [1] by the sign of norm(h) . v, a function of every computation before it, so a wrong
    aux state, next token, KV entry or drafting row flips it half the time."""
    from safetensors.numpy import load_file, save_file

    head = write_eagle3_dir(out, target_dir, draft_vocab_size=96)
    t = load_file(str(head / "model.safetensors"))
    v = t["lm_head.weight"][0].copy()
    t["lm_head.weight"][:] = 0
    t["lm_head.weight"][0], t["lm_head.weight"][1] = v, -v
    t["d2t"][:2] = TWO_TOKENS[0], TWO_TOKENS[1] - 1
    save_file(t, str(head / "model.safetensors"), metadata={"format": "pt"})
    return head


def _target_aux(llm, tokens):
    """The target's aux states at every position of `tokens` (one full prefill run by
    the engine's own model, outside the engine), float64 [T, 3, D]."""
    from flax import nnx

    from lp_jax.models.kv_cache import init_kv_cache

    key = (llm.engine.model_config.model_type, tuple(tokens))
    if key not in _aux_cache:
        runner = llm.engine.runner
        model = nnx.merge(runner.graphdef, runner.state)
        cfg, T = model.config, len(tokens)
        pages = -(-T // 16)
        meta = jax.tree.map(jnp.asarray, build_metadata(
            [(0, T, list(range(pages)))], page_size=16, num_tokens=T, num_seqs=1,
            pages_per_seq=pages))
        # A rank-major pool (data-parallel engines) takes a whole number of pages a rank.
        kv = init_kv_cache(cfg, -(-pages // cfg.kv_ranks) * cfg.kv_ranks, 16, model.dtype)
        aux = jnp.zeros((T, 3, cfg.hidden_size), model.dtype)
        _, _, _, aux = model.run_units(
            model.embed(jnp.asarray(tokens)), kv, meta, 0, 2 * cfg.num_hidden_layers,
            aux_layers=default_aux_layers(cfg.num_hidden_layers), aux_NAD=aux)
        _aux_cache[key] = np.asarray(aux, np.float64)
    return _aux_cache[key]


# Layered on tiny runs under data-parallel attention (test_eagle3_under_data_parallel_attention).
@pytest.mark.parametrize("policy, preset", [
    ("orca", "tiny"), ("orca", "tiny-gpt-oss"), ("chunked", "tiny"), ("chunked", "tiny-gpt-oss"),
    ("layered", "tiny-gpt-oss")])
def test_eagle3_engine_greedy_equals_golden_and_drafts_equal_a_recompute(
        engines, tmp_path, preset, policy):
    """An engine with an EAGLE-3 head (k = 3, the two-token head) reproduces the Hugging
    Face greedy tokens under every policy: its prompts' aux states cross layer groups and
    chunks, drafts are accepted and rejected. Every draft the engine proposed equals a
    dense recompute of the head over the target's own aux states at that point (the
    engine's draft KV, rolled back past rejected rows, gives the same as none). No
    program beyond one per row bucket, no compile while serving, every page back."""
    from lp_jax import LLM, SamplingParams

    golden = np.load(GOLDEN.format(preset))
    target_dir = ensure_tiny(preset=preset)
    head = _two_token_head(target_dir, tmp_path / "head")
    # One 100-row program (orca and chunked share it; layered has a larger hidden
    # buffer), for a model's three engines to compile two programs between them.
    kw = dict(engines.kwargs(policy), model=str(target_dir), max_model_len=96,
              token_buckets=(100,))
    llm = LLM(**kw, speculative_config={"method": "eagle3", "model": str(head),
                                        "num_speculative_tokens": K_DRAFTS})
    seen = record_drafts(llm)  # (tokens so far, the drafts proposed after them)
    prompts = [golden[f"prompt_{i}"].tolist() for i in (0, 2)]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(
        temperature=0, max_tokens=32, ignore_eos=True))
    for i, out in zip((0, 2), outs, strict=True):
        assert out.outputs[0].token_ids == golden[f"greedy_{i}"].tolist()
    embed = np.asarray(llm.engine.runner.draft_params.embed_VE, np.float64)
    assert len(seen) > 40
    for tokens, drafts in seen:
        full = next(p + o.outputs[0].token_ids for p, o in zip(prompts, outs, strict=True)
                    if (p + o.outputs[0].token_ids)[:len(tokens)] == tokens)
        aux = _target_aux(llm, full)[: len(tokens) - 1]
        want = _dense_drafts(head, embed, aux, np.asarray(tokens[1:]), K_DRAFTS)
        assert 1 <= len(drafts) and list(drafts) == want[: len(drafts)], (len(tokens), drafts)
    s = llm.stats()
    if preset == "tiny":
        assert s["spec_decode_num_accepted_tokens"] > 0
    assert s["spec_decode_num_draft_tokens"] > s["spec_decode_num_accepted_tokens"]
    assert s["programs"] == len(kw["token_buckets"]) and s["startup_compilations"] <= 32
    assert s["compilations_after_warmup"] == 0
    assert s["free_pages"] == s["total_pages"]


def test_eagle3_under_data_parallel_attention(tmp_path):
    """DP 2 x TP 4 (the tiny model's 2 KV heads copied to the 4 tensor ranks), layered
    (aux states carried between layer groups in rows split over the ranks): the head's
    pool is split over "data" as the target's and its extend and chained steps attend per
    rank. Greedy tokens are the golden ones, every draft equals the dense recompute,
    drafts are accepted, pages stay on their rank and all come back, one program, no
    compile while serving, no rows but the sampled ones all-reduced across the data ranks."""
    from conftest import GOLDEN_ENGINES, run_golden_prompts
    from test_data_parallel import _all_reduces, rows_across_ranks
    from test_dp_families import RankChecked

    from lp_jax import LLM

    golden, dp, tokens = np.load(GOLDEN.format("tiny")), 2, 16
    target_dir = ensure_tiny(preset="tiny")
    head = _two_token_head(target_dir, tmp_path / "head")
    llm = LLM(str(target_dir), data_parallel_size=dp, tensor_parallel_size=4,
              enable_expert_parallel=True, max_num_seqs=4, max_model_len=80,
              kv_pages=10 * dp, backends="off", log=None, **GOLDEN_ENGINES["layered"],
              speculative_config={"method": "eagle3", "model": str(head),
                                  "num_speculative_tokens": K_DRAFTS})
    kv = llm.engine.runner.draft_state["kv"]
    assert kv.sharding.shard_shape(kv.shape)[0] == kv.shape[0] // dp
    seen = record_drafts(llm)
    outs = run_golden_prompts(RankChecked(llm.engine), golden, max_tokens=tokens)
    for i, out in outs.items():
        assert out.outputs[0].token_ids == golden[f"greedy_{i}"][:tokens].tolist(), i
    # The whole golden sequences: the aux states the tests above computed (causal, so a
    # prefix's are the first rows).
    fulls = [golden[f"prompt_{i}"].tolist() + golden[f"greedy_{i}"].tolist() for i in range(3)]
    embed = np.asarray(llm.engine.runner.draft_params.embed_VE, np.float64)
    assert len(seen) > 20
    for toks, drafts in seen:
        full = next(f for f in fulls if f[:len(toks)] == toks)
        aux = _target_aux(llm, full)[: len(toks) - 1]
        want = _dense_drafts(head, embed, aux, np.asarray(toks[1:]), K_DRAFTS)
        assert 1 <= len(drafts) and list(drafts) == want[: len(drafts)], (len(toks), drafts)
    s = llm.stats()
    assert 0 < s["spec_decode_num_accepted_tokens"] < s["spec_decode_num_draft_tokens"]
    assert s["data_parallel"]["free_pages"] == [10] * dp
    assert s["free_pages"] == s["total_pages"] == 10 * dp
    assert s["programs"] == 1 and s["compilations_after_warmup"] == 0
    (_, program), = llm.engine.runner.programs.items()
    reduces = _all_reduces(program.as_text(), data=dp, tensor=4)
    assert reduces and not rows_across_ranks(reduces, max_num_seqs=4)
    llm.shutdown()


def test_greedy_draft_model_chains_keep_the_target_distribution():
    """part 1's distribution test with drafts as an EAGLE-3 head makes them: a greedy
    chain of a draft model's own argmax (here of a bigram table q unlike the target),
    so each draft is a point mass that depends on the context. Every verification row is
    sampled from the target given the drafts before it and compared
    (lp_jax/spec/accept.py), as the step does: the 3-token sequences follow the
    target's law. Treating the same argmax drafts as samples of q (the general test,
    min(1, p / q) and the residual p - q) does not, and fails the same test."""
    from test_spec import _B, _BIGRAM_STEP, _N, _START, _TABLE_VV, _chi2_pvalue

    from lp_jax.spec.accept import accept_sampled

    p_VV = np.exp(_TABLE_VV)
    q_VV = np.full((5, 5), 0.1) + 0.5 * np.eye(5)[[3, 4, 0, 1, 2]]
    q_VV /= q_VV.sum(1, keepdims=True)
    greedy_V = q_VV.argmax(1)
    k, B = 2, _B
    rng = np.random.default_rng(4)

    def point_masses(ctx_B, drafts_BK, count_B):
        rows_BK = np.concatenate([ctx_B[:, None], drafts_BK], 1)
        u_BK = rng.random(rows_BK.shape)
        sampled_BK = (np.cumsum(p_VV[rows_BK], 2) < u_BK[..., None]).sum(2)
        runs = [accept_sampled(d, x) for d, x in zip(drafts_BK.tolist(), sampled_BK.tolist(),
                                                      strict=True)]
        tokens_BK = np.concatenate([drafts_BK, np.zeros((B, 1), np.int64)], 1)
        tokens_BK[np.arange(B), [a for a, _ in runs]] = [t for _, t in runs]
        return tokens_BK, np.array([a for a, _ in runs])

    def as_samples_of_q(ctx_B, drafts_BK, count_B):
        return map(np.asarray, _BIGRAM_STEP(jnp.asarray(ctx_B, jnp.int32),
                                            jnp.asarray(drafts_BK, jnp.int32),
                                            jnp.asarray(count_B, jnp.int32), jnp.asarray(q_VV)))

    def generate(verify) -> np.ndarray:
        out_BN = np.full((B, _N + k + 1), -1)
        count_B = np.zeros(B, np.int64)
        while (count_B < _N).any():
            ctx_B = np.where(count_B == 0, _START,
                             out_BN[np.arange(B), np.maximum(count_B - 1, 0)])
            drafts_BK = np.stack([greedy_V[ctx_B], greedy_V[greedy_V[ctx_B]]], 1)
            tokens_BK, acc_B = verify(ctx_B, drafts_BK, count_B)
            for j in range(k + 1):
                put = (j <= acc_B) & (count_B < _N)
                out_BN[put, count_B[put] + j] = tokens_BK[put, j]
            count_B = np.where(count_B < _N, count_B + acc_B + 1, count_B)
        return out_BN[:, :_N]

    assert _chi2_pvalue(generate(point_masses)) > 1e-3
    assert _chi2_pvalue(generate(as_samples_of_q)) < 1e-6


def test_config_and_lp_serve_take_eagle3(engines, tmp_path):
    """{"method": "eagle3", "model": path} parses on LLM() and `lp-serve
    --speculative-config`; a path without a head fails at LLM() with the path named."""
    from lp_jax import LLM, serve

    spec = '{"method": "eagle3", "model": "/heads/x", "num_speculative_tokens": 2}'
    args = serve.build_parser().parse_args(["--speculative-config", spec])
    sc = serve.engine_config(args).speculative_config
    assert (sc.method, sc.model, sc.num_speculative_tokens) == ("eagle3", "/heads/x", 2)
    with pytest.raises(SystemExit):
        serve.build_parser().parse_args(["--speculative-config", '{"method": "eagle3"}'])
    with pytest.raises(ValueError, match="no config.json"):
        LLM(**engines.kwargs("chunked"),
            speculative_config={"method": "eagle3", "model": str(tmp_path)})
