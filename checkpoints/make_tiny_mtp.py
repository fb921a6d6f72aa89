"""Tiny checkpoints with a complete next-token (MTP) layer, for MTP drafts
(lp_jax/models/mtp.py), in the published layout past the served layers (L of them):

    model.layers.{L}.enorm.weight, hnorm.weight        [D]       norm the embedding, the hidden
    model.layers.{L}.eh_proj.weight                    [D, 2 D]  over [enorm(e) | hnorm(h)]
    model.layers.{L}.input_layernorm ... mlp.*                   one decoder layer, as layer L
                                                                 of the target would be
    model.layers.{L}.shared_head.norm.weight           [D]
    model.layers.{L}.shared_head.head.weight           [V, D]    (DeepSeek-V3 ships it)
    model.layers.{L}.embed_tokens.weight               [V, D]    (DeepSeek-V3 ships it)

"tiny-deepseek-mtp" is "tiny-deepseek" (MLA, a MoE MTP layer) with its own embedding and
head, as DeepSeek-V3's checkpoint has them; "tiny-glm-mtp" is "tiny-glm" (GQA) without
them, so the target's are shared. The target's tensors are the base
preset's, read back bit for bit, so the base preset's goldens hold for the target; the
MTP tensors come from other seeds. Imports numpy, safetensors and checkpoints.make_tiny.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
from pathlib import Path

import numpy as np

from lp_jax.paths import models_dir

from . import make_tiny
from .build_cache import ensure_built

# preset -> (base preset, ships its own embed_tokens and shared_head.head)
MTP_PRESETS: dict[str, tuple[str, bool]] = {
    "tiny-deepseek-mtp": ("tiny-deepseek", True),
    "tiny-glm-mtp": ("tiny-glm", False),
}


def make_mtp_layer(cfg: dict, seed: int = 0, *, own_head: bool) -> dict[str, np.ndarray]:
    """The MTP layer's tensors beyond the `eh_proj` and `enorm` that make_tiny already
    writes at index L: the decoder layer is layer L of make_tiny's generator run one layer
    deeper (another seed), the norms and the optional embedding and head drawn here."""
    L, d, v = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
    p = f"model.layers.{L}."
    deeper = make_tiny.make_weights({**cfg, "num_hidden_layers": L + 1}, seed + 1)
    out = {n: t for n, t in deeper.items()
           if n.startswith(p) and not n.startswith((p + "eh_proj", p + "enorm"))}
    rng = np.random.RandomState(seed + 2)
    norm = lambda: (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    out[p + "hnorm.weight"] = norm()
    out[p + "shared_head.norm.weight"] = norm()
    if own_head:  # the scale of make_tiny's embedding and head (SCALES)
        for name in ("embed_tokens.weight", "shared_head.head.weight"):
            out[p + name] = (rng.standard_normal((v, d)) * 2 * d**-0.5).astype(np.float32)
    return out


def write_mtp_dir(out_dir, preset: str = "tiny-deepseek-mtp") -> Path:
    """The base preset's directory, its weights joined by the full MTP layer."""
    from safetensors.numpy import load_file, save_file

    if preset not in MTP_PRESETS:
        raise KeyError(f"unknown preset {preset!r}; choose from {sorted(MTP_PRESETS)}")
    base, own_head = MTP_PRESETS[preset]
    src, out = make_tiny.ensure_tiny(preset=base), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json",
              "generation_config.json"):
        shutil.copy(src / f, out / f)
    cfg = make_tiny.build_config(base)
    tensors = load_file(str(src / "model.safetensors"))
    tensors |= make_mtp_layer(cfg, own_head=own_head)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / make_tiny.STAMP_FILE).write_text(_stamp(preset) + "\n")
    return out


def _stamp(preset: str) -> str:
    h = hashlib.sha256(Path(__file__).read_bytes() + Path(make_tiny.__file__).read_bytes()
                       + (make_tiny.HERE / "make_tiny_deepseek.py").read_bytes())
    return f"{preset} src={h.hexdigest()[:16]}"


def ensure_tiny_mtp(preset: str = "tiny-deepseek-mtp", out_dir=None) -> Path:
    """<lp_jax's cache>/models/<preset>/, made first if absent or stale (renamed into place,
    so concurrent callers never see half a model)."""
    out = Path(out_dir) if out_dir else models_dir() / preset
    return ensure_built(out, _stamp(preset), lambda tmp: write_mtp_dir(tmp, preset),
                        "make_tiny_mtp")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny-deepseek-mtp", choices=sorted(MTP_PRESETS))
    ap.add_argument("--out", help="target directory (default: <lp_jax's cache>/models/<preset>)")
    args = ap.parse_args(argv)
    print(write_mtp_dir(args.out, args.preset) if args.out else ensure_tiny_mtp(args.preset))


if __name__ == "__main__":
    main()
