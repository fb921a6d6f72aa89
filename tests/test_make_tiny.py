"""The tiny checkpoint generator and the golden files made from it (no jax, a few seconds)."""

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from checkpoints import make_tiny
from lp_jax.paths import models_dir

GOLDEN = Path(__file__).resolve().parent / "golden"
PRESETS = sorted(make_tiny.PRESETS)
FILES = {
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
}


def read_bytes(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


@pytest.mark.parametrize("sharded", [False, True])
def test_two_runs_write_identical_bytes(tmp_path, sharded):
    a = make_tiny.write_model_dir(tmp_path / "a", "tiny", write_sharded=sharded)
    b = make_tiny.write_model_dir(tmp_path / "b", "tiny", write_sharded=sharded)
    assert read_bytes(a) == read_bytes(b)


@pytest.mark.parametrize("preset", PRESETS)
def test_model_dir_has_hf_layout(preset):
    d = make_tiny.ensure_tiny(preset=preset)
    assert d == models_dir() / preset
    assert FILES | {"model.safetensors"} <= {p.name for p in d.iterdir()}
    cfg = json.loads((d / "config.json").read_text())
    assert cfg == make_tiny.build_config(preset)
    assert cfg["vocab_size"] == 512 and cfg["torch_dtype"] == "float32"
    dense = cfg["model_type"] == "qwen3"
    assert cfg["architectures"] == ["Qwen3ForCausalLM" if dense else "Qwen3MoeForCausalLM"]
    assert ("num_experts" in cfg) != dense

    w = load_file(str(d / "model.safetensors"))
    assert all(t.dtype == np.float32 for t in w.values())
    D, V, H = cfg["hidden_size"], cfg["vocab_size"], cfg["head_dim"]
    N, K = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    assert w["model.embed_tokens.weight"].shape == (V, D)
    assert ("lm_head.weight" in w) != cfg["tie_word_embeddings"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        assert w[f"{p}.self_attn.q_proj.weight"].shape == (N * H, D)
        assert w[f"{p}.self_attn.k_proj.weight"].shape == (K * H, D)
        assert w[f"{p}.self_attn.o_proj.weight"].shape == (D, N * H)
        assert w[f"{p}.self_attn.q_norm.weight"].shape == (H,)
        moe = make_tiny.is_moe_layer(cfg, i)
        assert (f"{p}.mlp.gate.weight" in w) == moe
        if moe:
            E, F = cfg["num_experts"], cfg["moe_intermediate_size"]
            assert w[f"{p}.mlp.gate.weight"].shape == (E, D)
            assert w[f"{p}.mlp.experts.{E - 1}.down_proj.weight"].shape == (D, F)
        else:
            assert w[f"{p}.mlp.up_proj.weight"].shape == (cfg["intermediate_size"], D)


def test_layer_patterns_follow_the_hf_rule():
    pattern = {
        p: [make_tiny.is_moe_layer(make_tiny.build_config(p), i) for i in range(4)] for p in PRESETS
    }
    assert pattern["tiny"] == [True] * 4
    assert pattern["tiny-mlp-only"] == [True, False, True, True]
    assert pattern["tiny-tied"] == [False, True, False, True]
    assert pattern["tiny-dense"] == [False] * 4


def test_tokenizer_round_trip_and_special_ids():
    d = make_tiny.ensure_tiny()
    cfg = json.loads((d / "config.json").read_text())
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    assert tok.get_vocab_size() == cfg["vocab_size"]
    text = "The soup simmers while the server decodes 42 tokens: café, naïve, 😀!"
    ids = tok.encode(text).ids
    assert len(ids) < len(text.encode())  # BPE merged something
    assert tok.decode(ids) == text
    tcfg = json.loads((d / "tokenizer_config.json").read_text())
    assert tok.token_to_id(tcfg["bos_token"]) == cfg["bos_token_id"]
    assert tok.token_to_id(tcfg["eos_token"]) == cfg["eos_token_id"]
    assert tok.encode("<|im_start|>user").ids[0] == tok.token_to_id("<|im_start|>")
    gen = json.loads((d / "generation_config.json").read_text())
    assert cfg["eos_token_id"] in gen["eos_token_id"]


def test_chat_template_renders_chatml():
    jinja2 = pytest.importorskip("jinja2")
    tcfg = json.loads((make_tiny.ensure_tiny() / "tokenizer_config.json").read_text())
    msgs = [{"role": "user", "content": "hi"}]
    out = jinja2.Template(tcfg["chat_template"]).render(messages=msgs, add_generation_prompt=True)
    assert out == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_sharded_index_maps_every_tensor(tmp_path):
    d = make_tiny.write_model_dir(tmp_path / "m", "tiny", write_sharded=True)
    assert not (d / "model.safetensors").exists()
    index = json.loads((d / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    seen, total = {}, 0
    for f in files:
        for name, t in load_file(str(d / f)).items():
            assert index["weight_map"][name] == f
            seen[name] = f
            total += t.nbytes
    assert set(seen) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == total
    assert make_tiny.weights_digest(d) == make_tiny.weights_digest(make_tiny.ensure_tiny())


def test_ensure_tiny_reuses_and_refuses_foreign_dirs(tmp_path):
    d = make_tiny.ensure_tiny(tmp_path / "t", "tiny-tied")
    mtime = (d / "model.safetensors").stat().st_mtime_ns
    assert make_tiny.ensure_tiny(tmp_path / "t", "tiny-tied") == d
    assert (d / "model.safetensors").stat().st_mtime_ns == mtime
    (tmp_path / "foreign").mkdir()
    with pytest.raises(FileExistsError):
        make_tiny.ensure_tiny(tmp_path / "foreign")


def test_cli_writes_a_sharded_dir(tmp_path, capsys):
    make_tiny.main(["--preset", "tiny-dense", "--out", str(tmp_path / "x"), "--sharded"])
    assert capsys.readouterr().out.strip() == str(tmp_path / "x")
    assert (tmp_path / "x" / "model.safetensors.index.json").exists()


@pytest.mark.parametrize("preset", PRESETS)
def test_golden_files_match_the_generator(preset):
    g = np.load(GOLDEN / f"{preset}.npz", allow_pickle=False)
    d = make_tiny.ensure_tiny(preset=preset)
    assert str(g["preset"]) == preset
    assert str(g["weights_digest"]) == make_tiny.weights_digest(d), "rerun make_golden.py"
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    for i, n in enumerate((5, 17, 40)):
        prompt = g[f"prompt_{i}"]
        assert prompt.dtype == np.int32 and prompt.shape == (n,)
        assert g[f"logits_{i}"].dtype == np.float32 and g[f"logits_{i}"].shape == (n, 512)
        assert np.isfinite(g[f"logits_{i}"]).all()
        greedy = g[f"greedy_{i}"]
        assert greedy.dtype == np.int32 and greedy.shape == (32,)
        assert len(set(greedy.tolist())) > 8
        assert g[f"greedy_margin_{i}"].shape == (32,)
        assert g[f"router_margin_{i}"].shape == ()
        if i:
            ids = tok.encode(str(g[f"text_{i}"]), add_special_tokens=False).ids
            assert ids[:n] == prompt.tolist()
    assert str(g["transformers_version"]) and str(g["torch_version"])
