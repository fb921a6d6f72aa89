"""Tiny quantized Qwen3-MoE checkpoints in Hugging Face's fine-grained FP8 layout, made
by a numpy quantiser of their own (not lp_jax's or pallas_kernels'), and their float32
twin holding exactly the weights the FP8 tensors mean.

Preset "tiny-fp8": make_tiny's weights for a 4-layer model (layer 1 a dense MLP, 8
experts top-2) whose widths span several 128-blocks (expert and dense width 256), so
block order and the [out, in] -> [in, out] transpose of the scales matter. As in the
published FP8 checkpoints (Qwen3-30B-A3B-FP8), each converted linear layer is
`<module>.weight` F8_E4M3 [out, in] plus `<module>.weight_scale_inv` [ceil(out/128),
ceil(in/128)]; the experts' scales are bf16, the attention's float32 (both ship).
`modules_to_not_convert` keeps the router (`mlp.gate`), embedding, head and, to test
that it is honoured, every layer's `self_attn.o_proj` in 16 (here 32) bits.

"tiny-fp8-dequant" is the same model in float32 with every converted weight replaced
by its dequantisation `q * scale` (numpy, float32): the oracle of the kernels'
arithmetic. "tiny-fp8-base" is the model before quantisation (make_tiny's float32
draws), the 16-bit-style checkpoint that quantization="int8" | "fp8" quantises at
load; `quantize_per_channel` is the oracle of that.

Imports numpy, ml_dtypes and checkpoints.make_tiny only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np

from lp_jax.paths import models_dir

from . import make_tiny
from .build_cache import ensure_built

BLOCK = 128
E4M3_MAX, INT8_MAX = 448.0, 127.0
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
BF16 = np.dtype(ml_dtypes.bfloat16)
_ST_DTYPES = {np.dtype(np.float32): "F32", BF16: "BF16", FP8: "F8_E4M3",
              np.dtype(np.int8): "I8"}

TINY_FP8 = {**make_tiny.PRESETS["tiny"], "num_hidden_layers": 4, "num_experts": 8,
            "num_experts_per_tok": 2, "moe_intermediate_size": 256,
            "intermediate_size": 256, "mlp_only_layers": [1]}
QUANT_PRESETS = ("tiny-fp8", "tiny-fp8-dequant", "tiny-fp8-base")
# The linear layers FP8 converts (Qwen3-MoE): attention, dense MLP and expert projections.
_CONVERTIBLE = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(experts\.\d+\.)?"
                          r"(gate|up|down)_proj)\.weight$")


def quantization_config(cfg: dict) -> dict:
    L = cfg["num_hidden_layers"]
    keep = ["lm_head", "model.embed_tokens"]
    keep += [f"model.layers.{i}.mlp.gate" for i in range(L) if make_tiny.is_moe_layer(cfg, i)]
    keep += [f"model.layers.{i}.self_attn.o_proj" for i in range(L)]
    return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
            "modules_to_not_convert": keep, "weight_block_size": [BLOCK, BLOCK]}


def converts(name: str, qc: dict) -> bool:
    """Whether FP8 converts tensor `name` (a `.weight`) under config `qc`."""
    module = name.removesuffix(".weight")
    return bool(_CONVERTIBLE.match(name)) and module not in qc["modules_to_not_convert"]


def _blocks(a: np.ndarray, bo: int, bi: int) -> np.ndarray:
    """[O, I] padded with zeros to whole blocks, viewed [bo, B, bi, B]."""
    O, I = a.shape
    return np.pad(a, ((0, bo * BLOCK - O), (0, bi * BLOCK - I))).reshape(bo, BLOCK, bi, BLOCK)


def quantize_fp8_blocks(w_OI: np.ndarray, scale_dtype) -> tuple[np.ndarray, np.ndarray]:
    """(e4m3 [O, I], weight_scale_inv [ceil(O/128), ceil(I/128)] in scale_dtype): absmax
    per 128 x 128 block, scale = amax / 448 rounded to its stored dtype, q = w / scale."""
    O, I = w_OI.shape
    bo, bi = -(-O // BLOCK), -(-I // BLOCK)
    amax = np.abs(_blocks(w_OI.astype(np.float32), bo, bi)).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / E4M3_MAX, 1.0).astype(scale_dtype)
    q = w_OI / expand_blocks(scale, O, I)
    return np.clip(q, -E4M3_MAX, E4M3_MAX).astype(FP8), scale


def expand_blocks(scale: np.ndarray, O: int, I: int) -> np.ndarray:
    """A block scale repeated over its block, float32 [O, I]."""
    full = np.repeat(np.repeat(scale.astype(np.float32), BLOCK, 0), BLOCK, 1)
    return full[:O, :I]


def dequantize_fp8_blocks(q_OI: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return q_OI.astype(np.float32) * expand_blocks(scale, *q_OI.shape)


def quantize_per_channel(w_KN: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """Per-output-channel absmax of an [in, out] weight: (q [K, N], scale [1, N] float32),
    int8 rounded half to even or e4m3; the oracle of quantization="int8" | "fp8"."""
    w = w_KN.astype(np.float32)
    qmax = INT8_MAX if kind == "int8" else E4M3_MAX
    amax = np.abs(w).max(axis=0, keepdims=True)
    scale = np.where(amax > 0, amax / np.float32(qmax), np.float32(1)).astype(np.float32)
    q = w / scale
    if kind == "int8":
        return np.clip(np.rint(q), -qmax, qmax).astype(np.int8), scale
    return q.astype(FP8), scale


def save_safetensors(tensors: dict[str, np.ndarray], path: Path) -> None:
    """The safetensors format written directly: the `safetensors` package's numpy API
    has no float8 or bfloat16, and lp_jax.safetensors_io's own writer shares the reader's
    dtype table, which these checkpoints exist to check."""
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        blob = a.tobytes()
        header[name] = {"dtype": _ST_DTYPES[a.dtype], "shape": list(a.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for blob in blobs:
            f.write(blob)


def make_tensors(preset: str) -> tuple[dict, dict]:
    """(config.json, tensors) of a QUANT_PRESETS preset."""
    base = make_tiny.build_config("tiny")
    cfg = dict(sorted({**base, **TINY_FP8, "max_window_layers": 4}.items()))
    qc = quantization_config(cfg)
    out = {}
    for name, w in make_tiny.make_weights(cfg).items():
        if preset == "tiny-fp8-base" or not converts(name, qc):
            out[name] = w
            continue
        scale_dtype = BF16 if ".experts." in name else np.float32
        q, s = quantize_fp8_blocks(w, scale_dtype)
        if preset == "tiny-fp8":
            out[name], out[name + "_scale_inv"] = q, s
        else:
            out[name] = dequantize_fp8_blocks(q, s)
    if preset == "tiny-fp8":
        cfg["quantization_config"] = qc
    return cfg, out


def write_quant_dir(out_dir, preset: str = "tiny-fp8") -> Path:
    if preset not in QUANT_PRESETS:
        raise KeyError(f"unknown preset {preset!r}; choose from {QUANT_PRESETS}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg, tensors = make_tensors(preset)
    make_tiny._dump_json(out / "config.json", cfg)
    save_safetensors(tensors, out / "model.safetensors")
    # Tokenizer and generation config: the tiny preset's files, unchanged.
    src = make_tiny.ensure_tiny(preset="tiny")
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(src / f, out / f)
    (out / make_tiny.STAMP_FILE).write_text(_stamp(preset) + "\n")
    return out


def _stamp(preset: str) -> str:
    h = hashlib.sha256(Path(__file__).read_bytes() + Path(make_tiny.__file__).read_bytes())
    return f"{preset} src={h.hexdigest()[:16]}"


def ensure_tiny_quant(preset: str = "tiny-fp8", out_dir=None) -> Path:
    """<lp_jax's cache>/models/<preset>/, made first if absent or stale (renamed into place)."""
    out = Path(out_dir) if out_dir else models_dir() / preset
    return ensure_built(out, _stamp(preset), lambda tmp: write_quant_dir(tmp, preset),
                        "make_tiny_quant")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny-fp8", choices=QUANT_PRESETS)
    ap.add_argument("--out", help="target directory (default: <lp_jax's cache>/models/<preset>)")
    args = ap.parse_args(argv)
    print(write_quant_dir(args.out, args.preset) if args.out else ensure_tiny_quant(args.preset))


if __name__ == "__main__":
    main()
