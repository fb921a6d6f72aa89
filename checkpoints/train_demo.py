"""The demo model: a tiny Qwen3-MoE trained on Aesop's fables the first time it is needed.

`make demo` should print text a person can read, so that a working engine looks different
from a broken one. The random-weight checkpoints of make_tiny.py stay what the parity tests
use; this module trains a model of the same family on checkpoints/data/aesop_townsend.txt
(25 fables in G. F. Townsend's 1867 translation, public domain; see data/README.md) until
it has memorised them, then writes a Hugging Face Qwen3-MoE directory that the engine
loads like any other.

- The training forward below is the Qwen3-MoE math written out in plain JAX: RMSNorm,
  per-head q/k RMSNorm, rotate-half RoPE, grouped-query causal attention, a softmax top-k
  router with renormalised weights, SwiGLU experts and an untied head. Every expert runs
  on every token and the router's weights zero all but the top k, which is the same sum
  the engine's sparse kernels compute. tests/test_demo.py holds the engine's greedy tokens
  and log-probabilities to this forward's, so the two cannot mean different things.
- Adam is written here too (optax is not a dependency). float32, fixed seeds, one jit'd
  step; batches are drawn on device from a key folded with the step number, so two runs
  on one machine write the same bytes.
- The result is cached like make_tiny's checkpoints: a stamp of this file, make_tiny.py
  (the tokenizer trainer), the text and the JAX version; a stale or absent one retrains.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from lp_jax.paths import models_dir

from . import make_tiny

HERE = Path(__file__).resolve().parent
TEXT = HERE / "data" / "aesop_townsend.txt"
TEXT_TITLE = "Aesop's Fables, translated by George Fyler Townsend (1867)"
STAMP_FILE = ".train_demo_stamp"
INFO_FILE = "training.json"
FABLE_SEPARATOR = "\n\n\n"  # two blank lines between fables in the text file


@dataclasses.dataclass(frozen=True)
class Arch:
    """The model's shape (Qwen3-MoE config fields in short)."""

    layers: int = 2
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    experts: int = 8
    top_k: int = 2
    expert_width: int = 32  # moe_intermediate_size
    vocab: int = 1024
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    max_positions: int = 512


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How it is trained."""

    steps: int = 400
    batch: int = 8
    context: int = 64
    lr: float = 1e-2
    warmup: int = 20
    min_lr_frac: float = 0.1  # cosine decay to this fraction of lr
    clip_norm: float = 1.0
    aux_coef: float = 0.01  # Switch-style load balancing of the router
    seed: int = 0
    # XLA:CPU's backend at -O0: the step compiles in half the time and runs at half the
    # speed, the better trade for a run of a few steps (tests/test_demo.py).
    fast_compile: bool = False


# ----------------------------------------------------------------------------- data
def read_fables(path: Path = TEXT) -> list[str]:
    """The fables of the text file, each "Title\\n\\nBody"."""
    text = path.read_text(encoding="utf-8").strip()
    return [f.strip() for f in text.split(FABLE_SEPARATOR) if f.strip()]


def token_stream(tok, fables: list[str]) -> np.ndarray:
    """All fables as one id stream, each followed by <|endoftext|> (a generation stop)."""
    eos = tok.token_to_id(make_tiny.ENDOFTEXT)
    ids: list[int] = []
    for f in fables:
        ids += tok.encode(f).ids + [eos]
    return np.asarray(ids, np.int32)


# ---------------------------------------------------------------------------- model
def init_params(arch: Arch, seed: int) -> dict:
    """Stacked float32 parameters, linear weights [in, out]: N(0, 1/fan_in), the output
    projections of each residual branch scaled by 1/sqrt(2 layers), norms ones. Drawn
    with NumPy's legacy RandomState (a stream NumPy keeps fixed), tensor by tensor."""
    L, D, V, E, F = arch.layers, arch.hidden, arch.vocab, arch.experts, arch.expert_width
    NH, KH = arch.heads * arch.head_dim, arch.kv_heads * arch.head_dim
    rng = np.random.RandomState(seed)
    params = {name: (rng.standard_normal(shape) * std).astype(np.float32)
              for name, shape, std in (
                  ("embed", (V, D), 1.0),
                  ("q_proj", (L, D, NH), D**-0.5),
                  ("k_proj", (L, D, KH), D**-0.5),
                  ("v_proj", (L, D, KH), D**-0.5),
                  ("o_proj", (L, NH, D), (NH * 2 * L) ** -0.5),
                  ("router", (L, D, E), D**-0.5),
                  ("gate", (L, E, D, F), D**-0.5),
                  ("up", (L, E, D, F), D**-0.5),
                  ("down", (L, E, F, D), (F * 2 * L) ** -0.5),
                  ("lm_head", (D, V), D**-0.5))}
    for name, shape in (("input_norm", (L, D)), ("post_norm", (L, D)),
                        ("q_norm", (L, arch.head_dim)), ("k_norm", (L, arch.head_dim)),
                        ("final_norm", (D,))):
        params[name] = np.ones(shape, np.float32)
    return params


def _rms_norm(x, w, eps):
    return w * (x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps))


def _rope(x_BTNH, theta):
    T, H = x_BTNH.shape[1], x_BTNH.shape[-1]
    inv_freq_H2 = 1.0 / theta ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H)
    freqs_TH2 = jnp.arange(T, dtype=jnp.float32)[:, None] * inv_freq_H2[None, :]
    emb_TH = jnp.concatenate([freqs_TH2, freqs_TH2], axis=-1)
    cos, sin = jnp.cos(emb_TH)[None, :, None, :], jnp.sin(emb_TH)[None, :, None, :]
    x1, x2 = x_BTNH[..., : H // 2], x_BTNH[..., H // 2:]
    return x_BTNH * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


LAYER_PARAMS = ("input_norm", "q_proj", "k_proj", "v_proj", "q_norm", "k_norm", "o_proj",
                "post_norm", "router", "gate", "up", "down")


def forward(params: dict, ids_BT, arch: Arch):
    """Logits [B, T, V] of token ids [B, T] (positions 0..T-1), and the router's
    load-balancing loss averaged over the layers (a scan over the stacked layers)."""
    B, T = ids_BT.shape
    N, K, H, E = arch.heads, arch.kv_heads, arch.head_dim, arch.experts
    eps = arch.rms_eps
    causal_TT = jnp.tril(jnp.ones((T, T), bool))

    def layer(x, w):
        h = _rms_norm(x, w["input_norm"], eps)
        q = _rms_norm((h @ w["q_proj"]).reshape(B, T, N, H), w["q_norm"], eps)
        k = _rms_norm((h @ w["k_proj"]).reshape(B, T, K, H), w["k_norm"], eps)
        v = (h @ w["v_proj"]).reshape(B, T, K, H)
        q, k = _rope(q, arch.rope_theta), _rope(k, arch.rope_theta)
        q = q.reshape(B, T, K, N // K, H)  # query head n uses KV head n // (N / K)
        s = jnp.einsum("btkgh,bskh->bkgts", q, k) * H**-0.5
        p = jax.nn.softmax(jnp.where(causal_TT, s, -jnp.inf), axis=-1)
        o = jnp.einsum("bkgts,bskh->btkgh", p, v).reshape(B, T, N * H)
        x = x + o @ w["o_proj"]

        h = _rms_norm(x, w["post_norm"], eps)
        probs = jax.nn.softmax(h @ w["router"], axis=-1)  # [B, T, E]
        top_w, top_e = jax.lax.top_k(probs, arch.top_k)
        top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)  # norm_topk_prob
        chosen = jax.nn.one_hot(top_e, E, dtype=jnp.float32)  # [B, T, K, E]
        combine = jnp.einsum("btk,btke->bte", top_w, chosen)
        g = jnp.einsum("btd,edf->btef", h, w["gate"])
        u = jnp.einsum("btd,edf->btef", h, w["up"])
        y = jnp.einsum("btef,efd,bte->btd", jax.nn.silu(g) * u, w["down"], combine)
        # Switch-style balance: fraction of routed slots per expert (a constant) times
        # the mean router probability, 1 when balanced
        frac_E = jax.lax.stop_gradient(jnp.mean(jnp.sum(chosen, axis=2), axis=(0, 1)))
        aux = E * jnp.sum(frac_E * jnp.mean(probs, axis=(0, 1))) / arch.top_k
        return x + y, aux

    x, aux_L = jax.lax.scan(layer, params["embed"][ids_BT],
                            {name: params[name] for name in LAYER_PARAMS})
    x = _rms_norm(x, params["final_norm"], eps)
    return x @ params["lm_head"], jnp.mean(aux_L)


def loss_fn(params, batch_BT1, arch: Arch, aux_coef: float):
    logits, aux = forward(params, batch_BT1[:, :-1], arch)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.mean(jnp.take_along_axis(logp, batch_BT1[:, 1:, None], axis=-1))
    return nll + aux_coef * aux, nll


# ---------------------------------------------------------------------------- train
def _lr(step, recipe: Recipe):
    warm = (step + 1) / recipe.warmup
    t = jnp.clip((step - recipe.warmup) / max(1, recipe.steps - recipe.warmup), 0.0, 1.0)
    cos = recipe.min_lr_frac + (1 - recipe.min_lr_frac) * 0.5 * (1 + jnp.cos(math.pi * t))
    return recipe.lr * jnp.where(step < recipe.warmup, warm, cos)


def make_train_step(arch: Arch, recipe: Recipe, stream, unravel):
    """step(flat, m, v, step) -> (flat, m, v, nll): one Adam step (b1 0.9, b2 0.99,
    bias-corrected, global-norm clipping) on a batch of random windows of the stream.
    The parameters travel as one flat vector (`unravel` rebuilds the dict), so the
    update is one fused loop rather than one per tensor, which XLA compiles faster."""
    stream = jnp.asarray(stream)
    width = recipe.context + 1
    b1, b2, adam_eps = 0.9, 0.99, 1e-8
    base_key = jax.random.key(recipe.seed + 1)

    def batch(step):
        starts = jax.random.randint(jax.random.fold_in(base_key, step), (recipe.batch,), 0,
                                    stream.shape[0] - width + 1)
        return jax.vmap(lambda s: jax.lax.dynamic_slice(stream, (s,), (width,)))(starts)

    def step_fn(flat, m, v, step):
        (_, nll), g = jax.value_and_grad(
            lambda f: loss_fn(unravel(f), batch(step), arch, recipe.aux_coef), has_aux=True)(flat)
        g = g * jnp.minimum(1.0, recipe.clip_norm / (jnp.sqrt(jnp.sum(g * g)) + 1e-12))
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        t = (step + 1).astype(jnp.float32)
        lr = _lr(step, recipe) * jnp.sqrt(1 - b2**t) / (1 - b1**t)
        return flat - lr * m / (jnp.sqrt(v) + adam_eps), m, v, nll

    return jax.jit(step_fn, donate_argnums=(0, 1, 2))


def train(arch: Arch, recipe: Recipe, stream: np.ndarray, *, log=print):
    """(params as numpy arrays, per-step losses, seconds)."""
    if stream.shape[0] <= recipe.context + 1:
        raise ValueError(f"{stream.shape[0]} tokens do not fill a {recipe.context}-token window")
    from lp_jax.backend_select import skip_absent_tpu

    skip_absent_tpu()  # no TPU-discovery noise on a host with libtpu and no TPU
    # Always the CPU, whatever accelerator is present: the same bytes on every host kind.
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        return _train(arch, recipe, stream, log)


def _train(arch: Arch, recipe: Recipe, stream: np.ndarray, log):
    t0 = time.perf_counter()
    flat, unravel = ravel_pytree(init_params(arch, recipe.seed))
    m, v = jnp.zeros_like(flat), jnp.zeros_like(flat)
    step_fn = make_train_step(arch, recipe, stream, unravel)
    if recipe.fast_compile:
        step_fn = step_fn.lower(flat, m, v, jnp.int32(0)).compile(
            compiler_options={"xla_backend_optimization_level": 0})
    losses = []
    for step in range(recipe.steps):
        flat, m, v, nll = step_fn(flat, m, v, jnp.int32(step))
        losses.append(nll)
        if log and (step + 1) % 100 == 0:
            log(f"  step {step + 1}/{recipe.steps}: loss {float(nll):.3f}")
    losses = [float(x) for x in losses]
    params = jax.tree.map(np.asarray, unravel(flat))
    return params, losses, time.perf_counter() - t0


def greedy(params: dict, arch: Arch, prompt_ids: list[int], max_tokens: int,
           stop_ids: tuple[int, ...] = ()) -> list[int]:
    """Greedy continuation by the training forward (the whole sequence recomputed per
    token, at a fixed padded length so one program serves every step)."""
    ids, width = list(prompt_ids), len(prompt_ids) + max_tokens
    out: list[int] = []
    for _ in range(max_tokens):
        nxt = int(np.argmax(log_probs(params, arch, ids, width)[len(ids) - 1]))
        out.append(nxt)
        ids.append(nxt)
        if nxt in stop_ids:
            break
    return out


_log_softmax = jax.jit(lambda p, ids, arch: jax.nn.log_softmax(forward(p, ids, arch)[0][0]),
                       static_argnums=2)


def log_probs(params: dict, arch: Arch, ids: list[int], width: int = 0) -> np.ndarray:
    """Log-softmax [len(ids), V] of one sequence by the training forward, computed at
    the power of two at or above max(len(ids), width) (causal: padding after a position
    changes nothing at it), so one program serves many lengths."""
    width = 1 << (max(len(ids), width) - 1).bit_length()
    padded = np.asarray([list(ids) + [0] * (width - len(ids))], np.int32)
    return np.asarray(_log_softmax(params, padded, arch))[: len(ids)]


# -------------------------------------------------------------------- HF directory
def build_config(arch: Arch) -> dict:
    cfg = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": make_tiny.special_token_id(arch.vocab, make_tiny.ENDOFTEXT),
        "decoder_sparse_step": 1,
        "eos_token_id": make_tiny.special_token_id(arch.vocab, make_tiny.IM_END),
        "head_dim": arch.head_dim,
        "hidden_act": "silu",
        "hidden_size": arch.hidden,
        "initializer_range": 0.02,
        "intermediate_size": 4 * arch.hidden,  # unused: every layer is MoE
        "max_position_embeddings": arch.max_positions,
        "max_window_layers": arch.layers,
        "mlp_only_layers": [],
        "model_type": "qwen3_moe",
        "moe_intermediate_size": arch.expert_width,
        "norm_topk_prob": True,
        "num_attention_heads": arch.heads,
        "num_experts": arch.experts,
        "num_experts_per_tok": arch.top_k,
        "num_hidden_layers": arch.layers,
        "num_key_value_heads": arch.kv_heads,
        "output_router_logits": False,
        "rms_norm_eps": arch.rms_eps,
        "rope_scaling": None,
        "rope_theta": arch.rope_theta,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": arch.vocab,
    }
    return dict(sorted(cfg.items()))


def to_hf(params: dict, arch: Arch) -> dict[str, np.ndarray]:
    """The Hugging Face tensors (torch [out, in] layout) of the stacked parameters."""
    out = {"model.embed_tokens.weight": params["embed"]}
    for i in range(arch.layers):
        p = f"model.layers.{i}"
        out[f"{p}.input_layernorm.weight"] = params["input_norm"][i]
        out[f"{p}.post_attention_layernorm.weight"] = params["post_norm"][i]
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[f"{p}.self_attn.{name}.weight"] = params[name][i].T
        out[f"{p}.self_attn.q_norm.weight"] = params["q_norm"][i]
        out[f"{p}.self_attn.k_norm.weight"] = params["k_norm"][i]
        out[f"{p}.mlp.gate.weight"] = params["router"][i].T
        for e in range(arch.experts):
            x = f"{p}.mlp.experts.{e}"
            out[f"{x}.gate_proj.weight"] = params["gate"][i, e].T
            out[f"{x}.up_proj.weight"] = params["up"][i, e].T
            out[f"{x}.down_proj.weight"] = params["down"][i, e].T
    out["model.norm.weight"] = params["final_norm"]
    out["lm_head.weight"] = params["lm_head"].T
    return {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}


def write_demo_dir(out_dir: str | os.PathLike, *, arch: Arch = Arch(),
                   recipe: Recipe = Recipe(), text: Path = TEXT, log=print):
    """Trains the model and writes its Hugging Face directory into out_dir.
    Returns (out_dir, params, per-step losses)."""
    from safetensors.numpy import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fables = read_fables(text)
    tok = make_tiny.build_tokenizer(arch.vocab, corpus=tuple(fables))
    stream = token_stream(tok, fables)
    if log:
        log(f"training the demo model on {text.name} ({len(fables)} fables, "
            f"{stream.shape[0]} tokens): {recipe.steps} steps of {recipe.batch} x "
            f"{recipe.context} tokens")
    params, losses, seconds = train(arch, recipe, stream, log=log)
    cfg = build_config(arch)
    tensors = to_hf(params, arch)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    tok.save(str(out / "tokenizer.json"))
    dump = make_tiny._dump_json
    dump(out / "config.json", cfg)
    dump(out / "tokenizer_config.json", {
        "add_bos_token": False,
        "bos_token": make_tiny.ENDOFTEXT,
        "chat_template": make_tiny.CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": make_tiny.IM_END,
        "model_max_length": cfg["max_position_embeddings"],
        "pad_token": make_tiny.ENDOFTEXT,
        "tokenizer_class": "PreTrainedTokenizerFast",
    })
    dump(out / "generation_config.json", {
        "bos_token_id": cfg["bos_token_id"],
        "do_sample": False,
        "eos_token_id": [cfg["eos_token_id"], cfg["bos_token_id"]],
        "pad_token_id": cfg["bos_token_id"],
    })
    n_params = sum(int(t.size) for t in tensors.values())
    dump(out / INFO_FILE, {  # no timings: the directory's bytes must not vary run to run
        "text": TEXT_TITLE,
        "text_file": f"checkpoints/data/{text.name}",
        "fables": len(fables),
        "tokens": int(stream.shape[0]),
        "parameters": n_params,
        "steps": recipe.steps,
        "first_loss": round(losses[0], 4),
        "final_loss": round(losses[-1], 4),
        "arch": dataclasses.asdict(arch),
        "recipe": dataclasses.asdict(recipe),
    })
    if log:
        log(f"trained {recipe.steps} steps: loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
            f"{seconds:.1f} s, {n_params:,} parameters")
    return out, params, losses


def _stamp(text: Path = TEXT) -> str:
    """Changes with this file, make_tiny.py (the tokenizer trainer), the text and JAX."""
    h = hashlib.sha256()
    for f in (Path(__file__), Path(make_tiny.__file__), text):
        h.update(f.read_bytes())
    return f"demo src={h.hexdigest()[:16]} jax={jax.__version__}"


def _ensure(out: Path, log=print) -> Path:
    """out holds the current demo model, trained first if absent or stale; built beside
    the target and renamed into place, so a concurrent reader never sees half a model."""
    stamp, want = out / STAMP_FILE, _stamp()
    if stamp.exists() and stamp.read_text().strip() == want:
        return out
    if out.exists():
        if not stamp.exists():
            raise FileExistsError(f"{out} exists and was not made by train_demo")
        shutil.rmtree(out)  # a stale build of ours
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        write_demo_dir(tmp, log=log)
        (tmp / STAMP_FILE).write_text(want + "\n")
        tmp.chmod(0o755)  # mkdtemp makes it owner-only
        os.rename(tmp, out)
    except OSError:
        if not (stamp.exists() and stamp.read_text().strip() == want):
            raise  # else another process finished first
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def ensure_demo(root: str | os.PathLike | None = None, *, log=print) -> Path:
    """Path to the demo model, <root>/demo (default <lp_jax's cache>/models/demo),
    trained first (400 steps, about 60 CPU-seconds) if absent or stale."""
    return _ensure(Path(root if root is not None else models_dir()) / "demo", log=log)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="model directory (default: <lp_jax's cache>/models/demo)")
    ap.add_argument("--force", action="store_true", help="retrain even if the cache is current")
    args = ap.parse_args(argv)
    out = Path(args.out) if args.out else models_dir() / "demo"
    if args.force and (out / STAMP_FILE).exists():
        shutil.rmtree(out)
    print(_ensure(out))


if __name__ == "__main__":
    main()
