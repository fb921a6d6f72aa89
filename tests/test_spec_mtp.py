"""MTP drafts (lp_jax/models/mtp.py): the checkpoint's next-token layer read under its
published names (checkpoints/make_tiny_mtp.py writes them), refusals, and the engine's
drafts under the policies against a recompute of the layer from its published definition
over the target's own last hidden states."""

import functools
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import GOLDEN_ENGINES, record_drafts, run_golden_prompts
from flax import nnx

from checkpoints.make_tiny_mtp import ensure_tiny_mtp
from lp_jax import LLM, serve
from lp_jax.loader import load_model, load_mtp
from lp_jax.models.kv_cache import init_kv_cache
from lp_jax.models.metadata import build_metadata
from lp_jax.safetensors_io import CheckpointError

K_DRAFTS = 3
# The recompute's one batch shape (one compile for every length): up to BATCH sequences.
ROWS, PAGE, BATCH = 1024, 16, 16
POOL_PAGES = ROWS // PAGE + BATCH
def _tensors(d):
    from safetensors.numpy import load_file

    return {n: x.astype(np.float64) for n, x in load_file(str(d / "model.safetensors")).items()}


@pytest.fixture(scope="module")
def two_token_dir(two_token_mtp_dir):
    """tiny-deepseek-mtp with a two-token head (conftest.two_token_mtp_dir)."""
    return two_token_mtp_dir


# ------------------------------------------------------------------ loading
@pytest.mark.parametrize("preset, own", [("tiny-deepseek-mtp", True), ("tiny-glm-mtp", False)])
def test_loads_the_next_token_layer_under_its_published_names(preset, own):
    """The decoder layer at index L becomes layer 0 of a one-layer model of the target's
    class; shared_head's norm and head its final norm and head; eh_proj, enorm, hnorm
    the input projection. Without its own embed_tokens and head, the layer holds the
    target's very arrays."""
    d = ensure_tiny_mtp(preset)
    target = load_model(d)
    mcfg, p = load_mtp(d, target)
    L, t = target.config.num_hidden_layers, _tensors(d)
    at = f"model.layers.{L}."
    assert mcfg.layer == L and mcfg.model_cfg.num_hidden_layers == 1
    one = nnx.merge(mcfg.graphdef, p.state)
    attn = "kv_a_proj_with_mqa" if target.config.is_mla else "k_proj"
    close = lambda a, b: np.testing.assert_allclose(np.asarray(a, np.float64), b, atol=1e-6)
    w_in_out = t[f"{at}self_attn.{attn}.weight"].T  # kv_a_proj: held tile-padded, zeros
    w = np.asarray(getattr(one.model.layers.self_attn, attn)[0], np.float64)
    close(w, np.pad(w_in_out, ((0, 0), (0, w.shape[1] - w_in_out.shape[1]))))
    close(one.model.layers.mlp.gate[0], t[f"{at}mlp.gate.weight"].T)
    close(one.model.layers.input_layernorm[0], t[f"{at}input_layernorm.weight"])
    close(one.model.norm[...], t[f"{at}shared_head.norm.weight"])
    close(p.w_eh_2DD, t[f"{at}eh_proj.weight"].T)
    close(p.w_enorm_D, t[f"{at}enorm.weight"])
    close(p.w_hnorm_D, t[f"{at}hnorm.weight"])
    if own:
        close(one.lm_head[...], t[f"{at}shared_head.head.weight"].T)
        close(one.embed(jnp.arange(4)), t[f"{at}embed_tokens.weight"][:4])
    else:
        assert one.lm_head.get_value() is target.lm_head.get_value()
        assert one.model.embed_tokens.get_value() is target.model.embed_tokens.get_value()


def test_bad_requests_get_clear_errors(tmp_path, engines):
    """A model without next-token layers is refused at LLM(), naming why; a missing
    tensor is named, a quantized target refused; lp-serve passes the config through
    (vLLM's "deepseek_mtp" is "mtp"), refuses a bad one when it parses its arguments,
    and exits at start-up with the engine's reason."""
    with pytest.raises(ValueError, match="no next-token \\(MTP\\) layers"):
        LLM(**engines.kwargs("chunked"),
            speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    bad = shutil.copytree(ensure_tiny_mtp("tiny-glm-mtp"), tmp_path / "bad")
    from safetensors.numpy import load_file, save_file

    t = load_file(str(bad / "model.safetensors"))
    del t["model.layers.4.hnorm.weight"]
    save_file(t, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing tensor 'model.layers.4.hnorm.weight'"):
        load_mtp(bad, load_model(bad))
    with pytest.raises(ValueError, match="16-bit checkpoints only, not with quantization"):
        load_mtp(bad, load_model(bad, quantization="int8"))
    spec = '{"method": "deepseek_mtp", "num_speculative_tokens": 2}'
    sc = serve.engine_config(serve.build_parser().parse_args(
        ["--speculative-config", spec])).speculative_config
    assert (sc.method, sc.num_speculative_tokens, sc.drafts_on_device) == ("mtp", 2, True)
    with pytest.raises(SystemExit):
        serve.build_parser().parse_args(["--speculative-config", json.dumps(
            {"method": "mtp", "num_speculative_tokens": "auto"})])
    with pytest.raises(SystemExit, match="lp-serve: .*no next-token \\(MTP\\) layers"):
        serve.main(["--model", engines.kwargs("chunked")["model"], "--speculative-config",
                    spec, "--max-model-len", "64", "--max-num-seqs", "2"])


# --------------------------------------------------------------- recompute
def _rms(x, w, eps):
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _run_units(graphdef, cfg, units, state, x_ND, meta):
    """Units [0, units) of a model over a ragged batch on a fresh pool: [N, D]."""
    model = nnx.merge(graphdef, state)
    kv = init_kv_cache(cfg, POOL_PAGES, PAGE, x_ND.dtype)
    return model.run_units(x_ND, kv, meta, 0, units)[0]


def _ragged(rows: list[np.ndarray]):
    """Sequences of rows from position 0, packed into one ROWS-row batch: (x_ND, meta)."""
    x_ND, seqs, r, page = np.zeros((ROWS, rows[0].shape[1]), rows[0].dtype), [], 0, 0
    for x in rows:
        n = len(x)
        seqs.append((0, n, list(range(page, page + -(-n // PAGE)))))
        x_ND[r:r + n], r, page = x, r + n, page + -(-n // PAGE)
    meta = build_metadata(seqs, page_size=PAGE, num_tokens=ROWS, num_seqs=BATCH,
                          pages_per_seq=ROWS // PAGE)
    return x_ND, jax.tree.map(jnp.asarray, meta)


def _batches(items, n_rows):
    """items in groups whose rows fit one ragged batch."""
    group, used = [], 0
    for it in items:
        if group and (used + n_rows(it) > ROWS - PAGE * BATCH or len(group) == BATCH):
            yield group
            group, used = [], 0
        group.append(it)
        used += n_rows(it)
    if group:
        yield group


class _Recompute:
    """The target's last hidden states (before the final norm) of whole sequences, and the
    MTP layer's drafts after prefixes from its published definition: the embedding (zero
    at position 0) and hidden state normed and concatenated, eh_proj, the decoder layer over
    the whole sequence at positions 0.. (causal, a fresh pool), and shared_head; k steps,
    each recomputing everything with its draft appended. The norms, the projection and the
    head are numpy, from the checkpoint's tensors by name; the decoder layer is the loaded
    one (its tensors are checked against their names above)."""

    def __init__(self, llm, model_dir):
        runner = llm.engine.runner
        self.target = runner.graphdef, runner.state
        self.mcfg, self.p, _ = llm.engine._draft_model
        self.cfg = runner.cfg
        self.t, self.at = _tensors(model_dir), f"model.layers.{self.cfg.num_hidden_layers}."

    def last_hidden(self, fulls):
        """{tuple(sequence): its hidden states [T, D] float64}."""
        graphdef, state = self.target
        model = nnx.merge(graphdef, state)
        out = {}
        for group in _batches(fulls, len):
            x_ND, meta = _ragged([np.asarray(model.embed(jnp.asarray(f))) for f in group])
            h_ND = np.asarray(_run_units(graphdef, self.cfg, 2 * self.cfg.num_hidden_layers,
                                         state, jnp.asarray(x_ND), meta), np.float64)
            r = 0
            for f in group:
                out[tuple(f)], r = h_ND[r:r + len(f)], r + len(f)
        return out

    def drafts(self, cases, k):
        """k drafts for each (h_TD, next_T) case: the target's hidden states of a prefix's
        positions and the token after each."""
        t, at, eps, D = self.t, self.at, self.cfg.rms_norm_eps, self.cfg.hidden_size
        embed = t.get(at + "embed_tokens.weight", t["model.embed_tokens.weight"])
        head = t.get(at + "shared_head.head.weight", t.get("lm_head.weight"))
        state = [[list(nxt), h, []] for h, nxt in cases]  # tokens, hidden rows, drafts
        for _ in range(k):
            for group in _batches(state, lambda c: len(c[0])):
                xs = []
                for tokens, g, _ in group:
                    e = embed[tokens, :D].copy()
                    e[0] = 0
                    x = np.concatenate([_rms(e, t[at + "enorm.weight"], eps),
                                        _rms(g, t[at + "hnorm.weight"], eps)], -1)
                    xs.append((x @ t[at + "eh_proj.weight"].T).astype(np.float32))
                x_ND, meta = _ragged(xs)
                o_ND = np.asarray(_run_units(self.mcfg.graphdef, self.mcfg.model_cfg, 2,
                                             self.p.state, jnp.asarray(x_ND), meta), np.float64)
                r = 0
                for case, x in zip(group, xs, strict=True):
                    r += len(x)
                    o = o_ND[r - 1]
                    case[2].append(int(np.argmax(
                        _rms(o, t[at + "shared_head.norm.weight"], eps) @ head.T)))
                    case[0].append(case[2][-1])
                    case[1] = np.concatenate([case[1], o[None]])
        return [out for _, _, out in state]


# ------------------------------------------------------------ in the engine
# orca, chunked: one program; layered runs under data-parallel attention (below).
@pytest.mark.parametrize("policy", ["orca", "chunked"])
def test_mtp_engine_greedy_equals_golden_and_drafts_equal_a_recompute(two_token_dir, policy):
    """tiny-deepseek's golden greedy tokens (the target's weights are tiny-deepseek's)
    with MTP drafts, k = 3, the golden prompts staggered so prefills run beside decodes.
    Every draft the engine proposed equals the recompute
    over the target's own hidden states at that point, so the draft KV on the target's
    pages, rolled back past rejected rows, gives what none gives. Drafts are accepted and
    rejected; no program beyond one per row bucket, no compile while serving, every page
    back."""
    golden = np.load("tests/golden/tiny-deepseek.npz")
    llm = LLM(str(two_token_dir), max_num_seqs=4, max_model_len=80, log=None,
              **GOLDEN_ENGINES[policy],
              speculative_config={"method": "mtp", "num_speculative_tokens": K_DRAFTS})
    seen = record_drafts(llm)  # (tokens so far, the drafts proposed after them)
    outs = run_golden_prompts(llm.engine, golden)
    fulls = []
    for i, out in outs.items():
        assert out.outputs[0].token_ids == golden[f"greedy_{i}"].tolist()
        fulls.append(golden[f"prompt_{i}"].tolist() + out.outputs[0].token_ids)
    ref = _Recompute(llm, two_token_dir)
    hidden = ref.last_hidden(fulls)
    assert len(seen) > 40
    cases = []
    for tokens, _ in seen:
        full = next(f for f in fulls if f[:len(tokens)] == tokens)
        cases.append((hidden[tuple(full)][: len(tokens) - 1], tokens[1:]))
    for (tokens, drafts), want in zip(seen, ref.drafts(cases, K_DRAFTS), strict=True):
        assert 1 <= len(drafts) and list(drafts) == want[: len(drafts)], (len(tokens), drafts)
    s = llm.stats()
    assert 0 < s["spec_decode_num_accepted_tokens"] < s["spec_decode_num_draft_tokens"]
    assert s["programs"] == len(GOLDEN_ENGINES[policy]["token_buckets"])
    assert s["startup_compilations"] <= 32 and s["compilations_after_warmup"] == 0
    assert s["free_pages"] == s["total_pages"]
    if policy == "chunked":  # the same engine behind lp-serve's OpenAI server
        _serve_one_completion(llm, golden)


def _serve_one_completion(llm, golden):
    """A greedy completion through the server speculates and returns the golden text."""
    import urllib.request

    from conftest import start_server

    before = llm.stats()["spec_decode_num_drafts"]
    server = start_server(llm.engine)
    try:
        body = json.dumps({"model": "mock", "prompt": golden["prompt_0"].tolist(),
                           "max_tokens": 12, "temperature": 0, "ignore_eos": True}).encode()
        req = urllib.request.Request(f"{server.url}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            out = json.load(r)
    finally:
        server.stop()
    assert out["choices"][0]["text"] == llm.engine.tokenizer.decode(
        golden["greedy_0"][:12].tolist())
    assert llm.stats()["spec_decode_num_drafts"] > before


# ------------------------------------------------- under data-parallel attention
# One layout for both policies: the recompute's programs compile once for the two
# (DP 2 x TP 4 is test_spec_eagle's EAGLE-3 layout).
@pytest.mark.parametrize("policy, dp, tp", [("chunked", 4, 2), ("layered", 4, 2)])
def test_mtp_under_data_parallel_attention(two_token_dir, policy, dp, tp):
    """DP 4 x TP 2 over the 8 devices: the draft's one-layer pool is split over "data" as
    the target's, each rank's extend and chained steps run on its own rows and pool shard
    (rank-local page ids); under layered prefill each prompt's last hidden states leave
    the last layer group in a later call than its first. Greedy tokens are the golden
    ones, every draft equals the recompute (a draft KV entry written or read on the
    wrong rank or page changes it), drafts are accepted and rejected, every sequence's
    pages stay in its rank's range at every step and all come back, one program, nothing
    compiled while serving. The drafting rows are gathered on their own rank: no
    all-reduce in the program spans the data ranks (a global gather of them needs one)."""
    from test_data_parallel import _all_reduces, rows_across_ranks
    from test_dp_families import RankChecked

    golden = np.load("tests/golden/tiny-deepseek.npz")
    llm = LLM(str(two_token_dir), data_parallel_size=dp, tensor_parallel_size=tp,
              enable_expert_parallel=True, max_num_seqs=4, max_model_len=80,
              kv_pages=10 * dp, backends="off", log=None, **GOLDEN_ENGINES[policy],
              speculative_config={"method": "mtp", "num_speculative_tokens": K_DRAFTS})
    runner = llm.engine.runner
    for kv in (runner.kv_pages, runner.draft_state["kv"]):  # a rank's devices: its pages
        assert kv.sharding.shard_shape(kv.shape)[0] == kv.shape[0] // dp
    seen = record_drafts(llm)
    outs = run_golden_prompts(RankChecked(llm.engine), golden, max_tokens=16)
    fulls = []
    for i, out in outs.items():
        assert out.outputs[0].token_ids == golden[f"greedy_{i}"][:16].tolist(), i
        fulls.append(golden[f"prompt_{i}"].tolist() + out.outputs[0].token_ids)
    ref = _Recompute(llm, two_token_dir)
    hidden = ref.last_hidden(fulls)
    cases = []
    for tokens, _ in seen:
        full = next(f for f in fulls if f[:len(tokens)] == tokens)
        cases.append((hidden[tuple(full)][: len(tokens) - 1], tokens[1:]))
    assert len(seen) > 20
    for (tokens, drafts), want in zip(seen, ref.drafts(cases, K_DRAFTS), strict=True):
        assert 1 <= len(drafts) and list(drafts) == want[: len(drafts)], (len(tokens), drafts)
    s = llm.stats()
    assert 0 < s["spec_decode_num_accepted_tokens"] < s["spec_decode_num_draft_tokens"]
    assert sum(r > 0 for r in s["data_parallel"]["rows"]) == min(dp, 3)  # ranks ran rows
    assert s["data_parallel"]["free_pages"] == [10] * dp
    assert s["free_pages"] == s["total_pages"] == 10 * dp
    assert s["programs"] == 1 and s["startup_compilations"] <= 32
    assert s["compilations_after_warmup"] == 0
    (_, program), = runner.programs.items()
    reduces = _all_reduces(program.as_text(), data=dp, tensor=tp)
    assert reduces and not rows_across_ranks(reduces, max_num_seqs=4)
    llm.shutdown()
