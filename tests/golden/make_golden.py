"""Golden outputs of the reference implementation (Hugging Face transformers) for the tiny presets.

Runs in its own Python 3.11 venv with CPU torch, outside the repo, never under pytest:

    python3 -m venv /tmp/hfref
    /tmp/hfref/bin/pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
    /tmp/hfref/bin/pip install transformers==5.24.0 safetensors==0.8.0 tokenizers==0.23.3 \
        numpy==2.4.6
    /tmp/hfref/bin/python tests/golden/make_golden.py [preset ...]   # from the repo root

(tests/golden/README.md records the versions and machine each file came from; float32
logits move by ~1e-5 between CPUs with different SIMD widths.)

It loads checkpoints/make_tiny.py by path (that module needs no jax), writes each preset
to a temporary directory, loads it with AutoModelForCausalLM in float32 with eager
attention, and writes tests/golden/<preset>.npz with, for prompt i in 0..2:

    prompt_i               int32 [T]        prompt token ids (lengths 5, 17, 40)
    logits_i               float32 [T, V]   logits at every prompt position
    prompt_logprobs_i      float32 [T, V]   log_softmax of logits_i
    greedy_i               int32 [32]       greedy continuation, argmax each step, no eos stop
    greedy_margin_i        float32 [32]     top-1 minus top-2 logit at each greedy step
    greedy_logprobs_i      float32 [32]     log-probability of greedy token j at step j
    greedy_top_logprobs_i  float32 [32, 20] the 20 largest log-probabilities at each greedy
                                            step, descending
    greedy_top_ids_i       int32 [32, 20]   their token ids (column 0 is greedy_i)
    router_margin_i        float32 []       smallest gap between the k-th and (k+1)-th router
                                            logit over all MoE layers and positions (inf if
                                            dense)
    text_1, text_2         str              the text that prompts 1 and 2 were cut from

plus preset, weights_digest (make_tiny.weights_digest of the model), and the
transformers / torch versions. The MXFP4 preset adds `mxfp4_*` arrays: transformers'
dequantisation of hand-made blocks and scales, and of layer 0's experts
(`mxfp4_reference`). The margins say how much numerical slack a comparison has.

Log-probabilities are torch.log_softmax in float64 of the float32 logits, rounded to
float32, so float32(numpy float64 log-softmax of `logits_i`) equals `prompt_logprobs_i`.
The greedy-step ones come from the same one-pass logits as greedy_margin_i (not stored).

Quantized formats (QUANT_GOLDENS, issue #31), on checkpoints/make_tiny_quant.py's 4-layer
"tiny-fp8" model (needs `pip install ml_dtypes==0.7.0 accelerate==1.16.0` in the venv
too). transformers runs each in float32 on its dequantised weights:

    tiny-fp8            the HF fine-grained FP8 checkpoint (e4m3 + 128 x 128
                        weight_scale_inv), dequantised by transformers itself
                        (FineGrainedFP8Config(dequantize=True)); the script checks that
                        every parameter equals its own torch dequantisation of the raw
                        safetensors file, bit for bit
    tiny-fp8-base-int8  "tiny-fp8-base" (float32) with every weight that lp_jax's
    tiny-fp8-base-fp8   quantization="int8" | "fp8" converts at load (attention q/k/v/o,
                        dense and expert projections; not the router, embedding or head)
                        replaced by q * scale of make_tiny_quant.quantize_per_channel
                        (numpy, per output channel)

Their files hold the fields above (no weights_digest) plus

    checkpoint_sha256   str        sha256 of the model.safetensors lp_jax serves (tiny-fp8's,
                                   or tiny-fp8-base's for the at-load formats)
    quantization_gap_i  float32 [] max |logits_i - the unquantized float32 model's logits|:
                                   how far the format moves them
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.numpy import load_file as load_numpy
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import load_file as load_torch
from transformers import AutoModelForCausalLM, AutoTokenizer, FineGrainedFP8Config, Mxfp4Config

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).resolve().parent
N_NEW = 32
TOP_LOGPROBS = 20
PROMPT_LENS = (5, 17, 40)
TEXT_1 = "The forecast promises rain on Friday, so the onion soup will simmer while the wind blows."
CHAT = [
    {"role": "system", "content": "You are a small test model that answers briefly."},
    {
        "role": "user",
        "content": "How many tokens fit in a page of the cache, and why does it matter?",
    },
]


# golden file -> (make_tiny_quant preset lp_jax serves, quantization= at load or None)
QUANT_GOLDENS = {
    "tiny-fp8": ("tiny-fp8", None),
    "tiny-fp8-base-int8": ("tiny-fp8-base", "int8"),
    "tiny-fp8-base-fp8": ("tiny-fp8-base", "fp8"),
}


def load_make_tiny():
    spec = importlib.util.spec_from_file_location("make_tiny", ROOT / "checkpoints/make_tiny.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def prompts(tok, vocab_size: int, n_special: int) -> tuple[list[list[int]], dict[str, str]]:
    """Prompt 0: random ordinary ids; 1: plain text; 2: a ChatML conversation, rendered
    with make_tiny's ChatML template for every preset (the GPT-OSS checkpoints ship a
    harmony template that prints the current date, which would make the file depend on
    the day it was made)."""
    ids0 = np.random.RandomState(1234).randint(0, vocab_size - n_special, PROMPT_LENS[0]).tolist()
    text_2 = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True,
                                     chat_template=load_make_tiny().CHAT_TEMPLATE)
    out = [ids0]
    for text, n in ((TEXT_1, PROMPT_LENS[1]), (text_2, PROMPT_LENS[2])):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert len(ids) >= n, (len(ids), n)
        out.append(ids[:n])
    return out, {"text_1": TEXT_1, "text_2": text_2}


def check_gpt_oss_structure(model, cfg: dict) -> None:
    """GPT-OSS: window per layer, clamp limit, YaRN scale and the dequantised experts."""
    inner = model.model
    for i, layer in enumerate(inner.layers):
        sliding = cfg["layer_types"][i] == "sliding_attention"
        assert layer.self_attn.sliding_window == (cfg["sliding_window"] if sliding else None), i
        assert layer.mlp.experts.limit == cfg["swiglu_limit"]
        assert layer.mlp.experts.gate_up_proj.dtype == torch.float32
    assert model.config.rope_parameters["rope_type"] == "yarn"
    factor = cfg["rope_scaling"]["factor"]
    assert abs(inner.rotary_emb.attention_scaling - (0.1 * np.log(factor) + 1)) < 1e-6
    assert not cfg["tie_word_embeddings"]


def check_structure(model, cfg: dict, make_tiny) -> None:
    """Fail loudly if transformers read the config differently from what make_tiny meant."""
    if cfg["model_type"] == "gpt_oss":
        return check_gpt_oss_structure(model, cfg)
    inner = model.model
    deepseek = cfg["model_type"] == "deepseek_v3"
    head_dim = cfg["qk_rope_head_dim"] if deepseek else cfg["head_dim"]  # MLA: rotary part
    assert model.config.head_dim == head_dim
    h = int(head_dim * cfg.get("partial_rotary_factor", 1.0))  # GLM: rotary part
    want = 1.0 / cfg["rope_theta"] ** (torch.arange(0, h, 2, dtype=torch.float32) / h)
    if not cfg.get("rope_scaling"):  # YaRN's frequencies are lp_jax's test to pass
        torch.testing.assert_close(inner.rotary_emb.inv_freq, want)
    if deepseek:
        attn = inner.layers[0].self_attn
        assert (attn.q_proj is None) == bool(cfg["q_lora_rank"]), "q_lora_rank"
        assert model.config.rope_interleave == cfg["rope_interleave"]
        if cfg.get("rope_scaling"):  # mscale_all_dim moves the softmax scale
            assert attn.scaling != attn.qk_head_dim**-0.5
    for i, layer in enumerate(inner.layers):
        assert hasattr(layer.mlp, "experts") == make_tiny.is_moe_layer(cfg, i), i
        if cfg["model_type"] == "glm4_moe":
            assert hasattr(layer.self_attn, "q_norm") == cfg["use_qk_norm"], i
            assert layer.self_attn.q_proj.bias is not None and layer.self_attn.o_proj.bias is None
            assert hasattr(layer.mlp, "shared_experts") == make_tiny.is_moe_layer(cfg, i), i
    tied = model.lm_head.weight.data_ptr() == inner.embed_tokens.weight.data_ptr()
    assert tied == cfg["tie_word_embeddings"]


class GlmRouterMargin:
    """GLM-4.5's router margin: the smallest gap between the k-th and (k+1)-th expert's
    choice score (sigmoid + correction bias, outside the kept groups -inf) over the MoE
    layers and positions of the forwards since the last `pop`, from hooks on each
    Glm4MoeTopkRouter (its first output is the float32 router logits)."""

    def __init__(self, model, cfg: dict):
        self.k, self.gaps = cfg["num_experts_per_tok"], []
        g, kg = cfg["n_group"], cfg["topk_group"]
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is None:
                continue

            def hook(mod, args, out, g=g, kg=kg):
                choice = out[0].sigmoid() + mod.e_score_correction_bias
                grouped = choice.view(choice.shape[0], g, -1)
                score = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(-1)
                kept = torch.zeros_like(score).scatter_(1, score.topk(kg, dim=-1)[1], 1)
                choice = grouped.masked_fill(kept[..., None] == 0, -torch.inf).flatten(1)
                top = choice.topk(self.k + 1, dim=-1).values
                self.gaps.append((top[:, -2] - top[:, -1]).min().item())

            gate.register_forward_hook(hook)

    def pop(self) -> np.float32:
        gaps, self.gaps = self.gaps, []
        return np.float32(min(gaps))


@torch.no_grad()
def run_prompt(model, ids: list[int], top_k: int | None) -> dict[str, np.ndarray]:
    """Prompt logits, then a greedy loop that recomputes the whole sequence each step."""
    seq = torch.tensor([ids])
    prompt_logits_t = model(seq).logits[0]
    prompt_logits = prompt_logits_t.numpy().astype(np.float32)
    for _ in range(N_NEW):
        nxt = model(seq).logits[0, -1].argmax()
        seq = torch.cat([seq, nxt.view(1, 1)], dim=1)
    greedy = seq[0, len(ids) :]
    # One pass over prompt + continuation gives the logits of every greedy step.
    if isinstance(top_k, GlmRouterMargin):
        top_k.pop()  # the margin of the one-pass forward below only
    out = model(seq[:, :-1], output_router_logits=isinstance(top_k, int))
    steps = out.logits[0, len(ids) - 1 :]
    assert torch.equal(steps.argmax(-1), greedy), "full-sequence pass disagrees with the loop"
    top2 = steps.topk(2, dim=-1).values
    # Log-probabilities: float64 log_softmax of the float32 logits, stored as float32.
    prompt_logprobs = torch.log_softmax(prompt_logits_t.double(), dim=-1)
    step_logprobs = torch.log_softmax(steps.double(), dim=-1)
    greedy_logprobs = step_logprobs.gather(-1, greedy.view(-1, 1))[:, 0]
    top = step_logprobs.topk(TOP_LOGPROBS, dim=-1)  # sorted, descending
    assert torch.equal(top.indices[:, 0], greedy), "top-1 log-probability is not greedy"
    router_margin = np.float32(np.inf)
    if isinstance(top_k, GlmRouterMargin):
        router_margin = top_k.pop()
    elif top_k is not None:
        gaps = [r.topk(top_k + 1, dim=-1).values for r in out.router_logits]
        router_margin = np.float32(min((g[:, -2] - g[:, -1]).min().item() for g in gaps))
    # HF's cached generate() must give the same tokens. eos_token_id=None turns off eos
    # stopping; min_new_tokens would instead mask eos out and change the argmax.
    gen = model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        do_sample=False,
        max_new_tokens=N_NEW,
        eos_token_id=None,
    )
    assert torch.equal(gen[0, len(ids) :], greedy), "generate() disagrees with the greedy loop"
    return {
        "logits": prompt_logits,
        "greedy": greedy.numpy().astype(np.int32),
        "greedy_margin": (top2[:, 0] - top2[:, 1]).numpy().astype(np.float32),
        "prompt_logprobs": prompt_logprobs.numpy().astype(np.float32),
        "greedy_logprobs": greedy_logprobs.numpy().astype(np.float32),
        "greedy_top_logprobs": top.values.numpy().astype(np.float32),
        "greedy_top_ids": top.indices.numpy().astype(np.int32),
        "router_margin": router_margin,
    }


def mxfp4_reference(model) -> dict[str, np.ndarray]:
    """transformers' MXFP4 dequantisation, for the loader's own to be checked against:
    `convert_moe_packed_tensors` on every byte value under a range of exponents, and
    layer 0's expert weights as the MXFP4 model loaded them (interleaved gate/up)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks = np.arange(256, dtype=np.uint8).reshape(1, 2, 8, 16)  # [E, out, G, 16]
    scales = np.array([[[120, 124, 126, 127, 128, 130, 134, 140]] * 2], np.uint8)
    deq = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                     dtype=torch.float32)
    experts = model.model.layers[0].mlp.experts
    return {
        "mxfp4_blocks": blocks,
        "mxfp4_scales": scales,
        "mxfp4_dequantized": deq.numpy(),  # [E, in = G*32, out]
        "mxfp4_layer0_gate_up_proj": experts.gate_up_proj.detach().numpy(),
        "mxfp4_layer0_down_proj": experts.down_proj.detach().numpy(),
    }


def make_preset(make_tiny, preset: str, tmp: Path) -> dict[str, np.ndarray]:
    model_dir = make_tiny.write_model_dir(tmp / preset, preset)
    cfg = make_tiny.build_config(preset)
    extra = {}
    if cfg["model_type"] == "gpt_oss":
        extra["experts_implementation"] = "eager"  # GptOssExperts.forward as written
    if cfg.get("quantization_config", {}).get("quant_method") == "mxfp4":
        # transformers' own MXFP4 dequantisation (convert_moe_packed_tensors), to float32
        extra["quantization_config"] = Mxfp4Config(dequantize=True)
    model, info = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager", output_loading_info=True,
        **extra,
    )
    # GLM-4.5's next-token (MTP) layer, past num_hidden_layers, is unused by both.
    mtp = f"model.layers.{cfg['num_hidden_layers']}."
    info["unexpected_keys"] = [k for k in info.get("unexpected_keys", [])
                               if not k.startswith(mtp)]
    bad = {k: v for k, v in info.items() if v}
    assert not bad, f"{preset}: loading problems {bad}"
    model.eval()
    check_structure(model, cfg, make_tiny)
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids_list, texts = prompts(tok, cfg["vocab_size"], len(make_tiny.SPECIAL_TOKENS))
    num_experts = cfg.get("num_experts", cfg.get("num_local_experts", 0))
    top_k = cfg.get("num_experts_per_tok") if num_experts else None
    if cfg["model_type"] in ("glm4_moe", "deepseek_v3"):  # the same router
        top_k = GlmRouterMargin(model, cfg)
    record: dict[str, np.ndarray] = {
        "preset": np.array(preset),
        "weights_digest": np.array(make_tiny.weights_digest(model_dir)),
        "transformers_version": np.array(transformers.__version__),
        "torch_version": np.array(torch.__version__),
        **{k: np.array(v) for k, v in texts.items()},
    }
    if "quantization_config" in extra:
        record.update(mxfp4_reference(model))
    for i, ids in enumerate(ids_list):
        record[f"prompt_{i}"] = np.array(ids, dtype=np.int32)
        for key, val in run_prompt(model, ids, top_k).items():
            record[f"{key}_{i}"] = val
    return record


def load_make_tiny_quant():
    """checkpoints.make_tiny_quant (numpy, ml_dtypes and make_tiny; no jax)."""
    sys.path.insert(0, str(ROOT))
    from checkpoints import make_tiny_quant

    return make_tiny_quant


def load_float32(model_dir: Path, **extra):
    model, info = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager", output_loading_info=True,
        **extra,
    )
    bad = {k: v for k, v in info.items() if v}
    assert not bad, f"{model_dir.name}: loading problems {bad}"
    return model.eval()


def torch_dequantize_fp8(raw: dict[str, torch.Tensor], block: int) -> dict[str, torch.Tensor]:
    """Every `<m>.weight` with a `<m>.weight_scale_inv` as float32 w[o, i] * s[o // block,
    i // block], from the raw checkpoint tensors; other tensors as float32."""
    out = {}
    for name, t in raw.items():
        if name.endswith("_scale_inv"):
            continue
        w = t.to(torch.float32)
        s = raw.get(name + "_scale_inv")
        if s is not None:
            o, i = torch.arange(w.shape[0]) // block, torch.arange(w.shape[1]) // block
            w = w * s.to(torch.float32)[o[:, None], i[None, :]]
        out[name] = w
    return out


def check_fp8_dequantised(model, model_dir: Path, cfg: dict) -> None:
    """transformers' FP8 dequantisation of every parameter equals ours, bit for bit (the
    experts as transformers fuses them: gate_up_proj [E, 2F, D] = gate rows then up rows)."""
    block = cfg["quantization_config"]["weight_block_size"][0]
    raw = load_torch(str(model_dir / "model.safetensors"))
    assert {t.dtype for t in raw.values()} >= {torch.float8_e4m3fn, torch.bfloat16}
    want = torch_dequantize_fp8(raw, block)
    got = dict(model.state_dict())
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp.experts"
        if f"{p}.down_proj" not in got:
            continue
        E = cfg["num_experts"]
        gate_up = [torch.cat([want.pop(f"{p}.{e}.gate_proj.weight"),
                              want.pop(f"{p}.{e}.up_proj.weight")]) for e in range(E)]
        want[f"{p}.gate_up_proj"] = torch.stack(gate_up)
        want[f"{p}.down_proj"] = torch.stack([want.pop(f"{p}.{e}.down_proj.weight")
                                              for e in range(E)])
    assert got.keys() == want.keys(), got.keys() ^ want.keys()
    for name, w in want.items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], w), name


def quantize_at_load(mtq, tensors: dict[str, np.ndarray], kind: str) -> dict[str, np.ndarray]:
    """The weights lp_jax's quantization=kind converts (make_tiny_quant.converts with no
    modules kept) replaced by q * scale of make_tiny_quant.quantize_per_channel (per
    output channel), float32 [out, in]."""
    out = {}
    for name, w in tensors.items():
        if mtq.converts(name, {"modules_to_not_convert": []}):
            q_KN, s_1N = mtq.quantize_per_channel(w.T, kind)
            w = np.ascontiguousarray((q_KN.astype(np.float32) * s_1N).T)
        out[name] = w
    return out


def make_quant_golden(make_tiny, golden: str, tmp: Path) -> dict[str, np.ndarray]:
    mtq = load_make_tiny_quant()
    preset, kind = QUANT_GOLDENS[golden]
    model_dir = mtq.write_quant_dir(tmp / golden, preset)
    served_sha = hashlib.sha256((model_dir / "model.safetensors").read_bytes()).hexdigest()
    cfg = json.loads((model_dir / "config.json").read_text())
    base = load_float32(mtq.write_quant_dir(tmp / f"{golden}-unquantized", "tiny-fp8-base"))
    if kind is None:
        model = load_float32(model_dir, quantization_config=FineGrainedFP8Config(dequantize=True))
        check_fp8_dequantised(model, model_dir, cfg)
    else:
        tensors = load_numpy(str(model_dir / "model.safetensors"))
        assert {t.dtype for t in tensors.values()} == {np.dtype(np.float32)}
        save_numpy(quantize_at_load(mtq, tensors, kind), str(model_dir / "model.safetensors"))
        model = load_float32(model_dir)
    check_structure(model, cfg, make_tiny)
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids_list, texts = prompts(tok, cfg["vocab_size"], len(make_tiny.SPECIAL_TOKENS))
    record: dict[str, np.ndarray] = {
        "preset": np.array(golden),
        "checkpoint_sha256": np.array(served_sha),
        "transformers_version": np.array(transformers.__version__),
        "torch_version": np.array(torch.__version__),
        **{k: np.array(v) for k, v in texts.items()},
    }
    for i, ids in enumerate(ids_list):
        record[f"prompt_{i}"] = np.array(ids, dtype=np.int32)
        for key, val in run_prompt(model, ids, cfg["num_experts_per_tok"]).items():
            record[f"{key}_{i}"] = val
        with torch.no_grad():
            unquantized = base(torch.tensor([ids])).logits[0].numpy()
        record[f"quantization_gap_{i}"] = np.float32(np.abs(record[f"logits_{i}"]
                                                            - unquantized).max())
    return record


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    make_tiny = load_make_tiny()
    with tempfile.TemporaryDirectory() as tmp:
        for preset in sys.argv[1:] or [*make_tiny.ALL_PRESETS, *QUANT_GOLDENS]:
            if preset in QUANT_GOLDENS:
                rec = make_quant_golden(make_tiny, preset, Path(tmp))
            else:
                rec = make_preset(make_tiny, preset, Path(tmp))
            for i in range(len(PROMPT_LENS)):
                g = rec[f"greedy_{i}"]
                assert len(set(g.tolist())) > 1, f"{preset}: greedy_{i} repeats one token"
            np.savez(OUT / f"{preset}.npz", **rec)
            margins = [float(rec[f"greedy_margin_{i}"].min()) for i in range(len(PROMPT_LENS))]
            routers = [float(rec[f"router_margin_{i}"]) for i in range(len(PROMPT_LENS))]
            print(f"{preset}: greedy_0={rec['greedy_0'].tolist()}")
            print(f"  min greedy margins {margins}, min router margins {routers}")
            if "quantization_gap_0" in rec:
                gaps = [float(rec[f"quantization_gap_{i}"]) for i in range(len(PROMPT_LENS))]
                print(f"  max |logits - unquantized logits| {gaps}")
    print(
        f"transformers {transformers.__version__}, torch {torch.__version__}, "
        f"python {sys.version.split()[0]}"
    )


if __name__ == "__main__":
    main()
