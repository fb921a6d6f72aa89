"""Checkpoint loading: layouts, config dialects, dummy weights, orbax, bad input."""

import json
import shutil

import jax
import numpy as np
import pytest

from checkpoints.make_tiny import write_model_dir
from lp_jax.config import ModelConfig
from lp_jax.loader import load_model, restore_params, save_params
from lp_jax.safetensors_io import CheckpointError, SafetensorsFile, save_file
from lp_jax.sharding import make_mesh


def _params(model):
    from flax import nnx

    return {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model))}


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_expert_layout_matches_checkpoint(tiny_dir, tiny_model):
    f = SafetensorsFile(tiny_dir / "model.safetensors")
    layer, expert = 3, 5
    gate = f.get(f"model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight")  # [F, D]
    up = f.get(f"model.layers.{layer}.mlp.experts.{expert}.up_proj.weight")
    down = f.get(f"model.layers.{layer}.mlp.experts.{expert}.down_proj.weight")  # [D, F]
    mlp = tiny_model.model.layers.mlp
    gate_up = np.asarray(mlp.experts_gate_up_proj[...])[layer, expert]  # [D, 2F]
    F = gate.shape[0]
    np.testing.assert_array_equal(gate_up[:, :F], gate.T)
    np.testing.assert_array_equal(gate_up[:, F:], up.T)
    np.testing.assert_array_equal(np.asarray(mlp.experts_down_proj[...])[layer, expert], down.T)


def test_sharded_checkpoint_loads_identically(tmp_path, tiny_model):
    d = write_model_dir(tmp_path / "sharded", preset="tiny", write_sharded=True)
    assert (d / "model.safetensors.index.json").is_file()
    assert not (d / "model.safetensors").exists()
    a, b = _params(tiny_model), _params(load_model(d))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=str(k))


def test_both_config_dialects(tiny_dir):
    hf = json.loads((tiny_dir / "config.json").read_text())
    base = ModelConfig.from_hf_dict(hf)
    alt = dict(hf)
    alt["num_local_experts"] = alt.pop("num_experts")
    alt["rope_parameters"] = {"rope_type": "default", "rope_theta": alt.pop("rope_theta")}
    assert ModelConfig.from_hf_dict(alt) == base
    assert base.num_experts == hf["num_experts"] and base.rope_theta == hf["rope_theta"]


def test_bf16_checkpoint_and_dtype(tmp_path, tiny_dir, tiny_model):
    import ml_dtypes

    d = _copy(tiny_dir, tmp_path / "bf16")
    f = SafetensorsFile(d / "model.safetensors")
    tensors = {n: np.asarray(f.get(n)).astype(ml_dtypes.bfloat16) for n in f.tensors}
    save_file(tensors, d / "model.safetensors")
    cfg = json.loads((d / "config.json").read_text())
    cfg["torch_dtype"] = "bfloat16"
    (d / "config.json").write_text(json.dumps(cfg))
    model = load_model(d)
    w = model.model.layers.self_attn.q_proj[...]
    assert w.dtype == np.dtype(ml_dtypes.bfloat16)
    ref = np.asarray(tiny_model.model.layers.self_attn.q_proj[...])
    np.testing.assert_allclose(np.asarray(w, np.float32), ref, rtol=1e-2, atol=1e-2)


def test_dummy_load_has_real_shapes_without_weights(tiny_dir, tiny_model):
    cfg = ModelConfig.from_pretrained(tiny_dir)
    dummy = load_model(config=cfg, load_format="dummy", seed=1)
    a, b = _params(tiny_model), _params(dummy)
    assert {k: v.shape for k, v in a.items()} == {k: v.shape for k, v in b.items()}
    assert not np.allclose(a[("model", "embed_tokens")], b[("model", "embed_tokens")])


@pytest.mark.parametrize("name", ["Qwen3-30B-A3B", "Qwen3-235B-A22B", "Qwen3-8B"])
def test_shipped_configs_build_abstractly(name):
    from lp_jax.loader import abstract_model

    cfg = ModelConfig.from_pretrained_file(f"checkpoints/configs/{name}.json")
    _, state = abstract_model(cfg)
    n_params = sum(int(np.prod(v.shape)) for v in jax.tree.leaves(state))
    expected = {"Qwen3-30B-A3B": 30.5e9, "Qwen3-235B-A22B": 235e9, "Qwen3-8B": 8.2e9}[name]
    assert abs(n_params - expected) / expected < 0.03, n_params


def test_orbax_round_trip_into_target_sharding(tmp_path, tiny_dir, tiny_model):
    save_params(tiny_model, tmp_path / "ckpt")
    # tensor 2 (= the KV heads): the parameters keep their shapes (the copied KV heads of
    # more tensor devices: test_parallel_layout)
    mesh = make_mesh(expert=4, tensor=2)
    restored = restore_params(tiny_model.config, tmp_path / "ckpt", mesh=mesh)
    w = restored.model.layers.mlp.experts_gate_up_proj[...]
    assert w.sharding.mesh.shape == mesh.shape and len(w.sharding.device_set) == 8
    a, b = _params(tiny_model), _params(restored)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=str(k))


# ---------------------------------------------------------------- bad input
def test_missing_file(tmp_path, tiny_dir):
    d = _copy(tiny_dir, tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_model(d)


def test_missing_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)


def test_unknown_model_type(tmp_path, tiny_dir):
    d = _copy(tiny_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "llama"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"config.json: unsupported model_type 'llama'"):
        load_model(d)


def _rewrite(d, edit):
    f = SafetensorsFile(d / "model.safetensors")
    tensors = {n: np.asarray(f.get(n)) for n in f.tensors}
    edit(tensors)
    save_file(tensors, d / "model.safetensors")


def test_missing_expert_tensor(tmp_path, tiny_dir):
    d = _copy(tiny_dir, tmp_path / "m")
    name = "model.layers.2.mlp.experts.7.up_proj.weight"
    _rewrite(d, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=f"missing tensor '{name}'"):
        load_model(d)


def test_shape_mismatch(tmp_path, tiny_dir):
    d = _copy(tiny_dir, tmp_path / "m")
    name = "model.layers.1.self_attn.q_proj.weight"
    _rewrite(d, lambda t: t.__setitem__(name, t[name][:-1]))
    with pytest.raises(CheckpointError, match=rf"model.safetensors: tensor '{name}' has shape"):
        load_model(d)


@pytest.mark.parametrize("corruption", ["truncated", "bad_json", "bad_offsets", "huge_length"])
def test_corrupt_header(tmp_path, tiny_dir, corruption):
    d = _copy(tiny_dir, tmp_path / "m")
    path = d / "model.safetensors"
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    if corruption == "truncated":
        raw = raw[:5]
    elif corruption == "bad_json":
        raw = raw[:8] + b"x" + raw[9:]
    elif corruption == "bad_offsets":
        header = json.loads(raw[8 : 8 + n])
        name = next(k for k in header if k != "__metadata__")
        header[name]["data_offsets"][1] += 4
        h = json.dumps(header).encode()
        h += b" " * (n - len(h)) if len(h) <= n else b""
        raw = len(h).to_bytes(8, "little") + h + raw[8 + n :]
    else:
        raw = (10**12).to_bytes(8, "little") + raw[8:]
    path.write_bytes(raw)
    with pytest.raises(CheckpointError, match=r"model.safetensors: corrupt safetensors header"):
        load_model(d)


def test_eos_ids_from_config_list_and_generation_config(tmp_path, tiny_dir):
    """Every eos id ends a completion, as vLLM's: config.json's list and
    generation_config.json's (Qwen3 lists <|im_end|> and <|endoftext|> there)."""
    hf = json.loads((tiny_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, "eos_token_id": [5, 6]}))
    assert ModelConfig.from_pretrained(tmp_path).eos_token_ids == {5, 6}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [6, 9]}))
    cfg = ModelConfig.from_pretrained(tmp_path)
    assert cfg.eos_token_id == 5 and cfg.eos_token_ids == {5, 6, 9}
    (tmp_path / "generation_config.json").write_text("not json")  # ignored, as absent
    assert ModelConfig.from_pretrained(tmp_path).eos_token_ids == {5, 6}
