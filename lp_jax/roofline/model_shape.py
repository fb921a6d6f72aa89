"""The shape of a decoder-only (MoE) transformer, as the roofline model needs it.

Design note. The cost model needs sizes, not weights: D, L, N, K, H, E, A (top-k), F,
V, the dense MLP width, which layers are MoE, and the parameter dtype. `ModelShape`
holds exactly that and is built from a Hugging Face config dict, accepting the dialects
we serve:

- Qwen3-MoE: `num_experts`, `num_experts_per_tok`, `moe_intermediate_size`,
  `decoder_sparse_step`, `mlp_only_layers` (layer i is MoE iff i is not in
  `mlp_only_layers` and (i + 1) % decoder_sparse_step == 0);
- Qwen3 dense: no experts; every layer uses `intermediate_size`;
- GPT-OSS / Mixtral: `num_local_experts` (or `experts_per_token`), expert width in
  `intermediate_size`, optional `layer_types` with "sliding_attention" + `sliding_window`.

`head_dim` may be absent, in which case it is hidden_size / num_attention_heads.

The MoE blocks of GLM-4.5 and DeepSeek-V3: `first_k_dense_replace` dense first layers
(in `dense_layers`), `n_shared_experts` shared experts (`shared_width` = n_shared *
moe_intermediate_size: a dense SwiGLU on every token of every MoE layer, read whole
each step, counted with the dense weights and not in `expert_bytes`, which is the routed
experts' traffic the engine's expert-bytes counter measures), and group-limited
routing (`n_group`, `topk_group`). The routing variant leaves the expected activated
experts as they are: with tokens independent and experts exchangeable, each expert's
inclusion probability stays k/E whether or not the groups limit a token's choice
(tests/test_roofline_moe_blocks.py checks this against `moe.ref.route`), so
`routing.expected_active` serves every variant (what groups change is how many expert
shards one token reaches under expert parallelism, not modelled here).
DeepSeek-V3's multi-head latent attention (`mla_ranks`) is counted for its weights and
its KV bytes a token (`kv_values_per_token_layer`: the latent, once per token, as the
engine's pool holds it); the cost model's attention flops still use the per-head form.

One description per model: the two built-in shapes of the paper reproduction,
Qwen3-30B-A3B and GPT-OSS-20B, are the engine's own `ModelConfig` read from
`checkpoints/configs/` (`from_model_config`), the file the engine, the AOT presets and the
simulator all read; so is any config file of a model type the engine serves. Other config
dialects (Mixtral, DeepSeek) go through `from_hf_config`. Llama3-8B (dense), written out
here, serves the FlowPrefill comparison. The cost model reads GPT-OSS's sliding layers
(`sliding_layers`, `sliding_window`: a sliding layer attends to at most that many keys);
its attention sinks (one logit per head) and bias vectors are below the model's precision
and are left out. GPT-OSS-20B keeps MXFP4 expert weights on disk; the built-in shape assumes
bf16 serving, as the engine's loader dequantizes them by default.

Formats. `dtype_bytes` is the activation itemsize. `weight_format` (formats.py: bf16, int8,
fp8, fp8_block, fp4) sets the stored bytes of the weights it covers, scales included, and
`kv_format` (bf16, fp8) the KV cache's; None keeps both at `dtype_bytes`, every figure as
before. `with_formats` gives the same model in other formats.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from lp_jax.config import SUPPORTED_MODEL_TYPES, ModelConfig
from lp_jax.paths import bundled
from lp_jax.roofline.formats import KV_FORMATS, WEIGHT_FORMATS, WeightFormat

_DTYPE_BYTES = {
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "float32": 4,
    "fp32": 4,
    "float": 4,
    "float8_e4m3fn": 1,
    "fp8": 1,
    "int8": 1,
}

CONFIG_DIR = bundled("checkpoints") / "configs"
# The engine's quantization methods (lp_jax/quant/config.py) as roofline weight formats.
_ENGINE_FORMATS = {"int8": "int8", "fp8": "fp8", "fp8_block": "fp8_block", "mxfp4": "fp4"}


@dataclass(frozen=True, slots=True)
class ModelShape:
    """Sizes of one model. Experts = 0 means a dense model (every layer has a dense MLP)."""

    name: str
    hidden_size: int  # D
    num_layers: int  # L
    num_q_heads: int  # N
    num_kv_heads: int  # K
    head_dim: int  # H
    vocab_size: int  # V
    num_experts: int = 0  # E
    top_k: int = 0  # A
    expert_width: int = 0  # F of each routed expert
    dense_width: int = 0  # F of a dense MLP layer (0 if there is none)
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP instead of experts
    sliding_layers: tuple[int, ...] = ()  # layers using sliding-window attention
    sliding_window: int = 0
    tie_word_embeddings: bool = False
    dtype_bytes: int = 2  # activations (and weights / KV when their format is None)
    weight_format: str | None = None  # formats.WEIGHT_FORMATS; None: dtype_bytes a weight
    kv_format: str | None = None  # formats.KV_FORMATS; None: dtype_bytes a value
    shared_width: int = 0  # F of the shared experts (n_shared * expert F), every MoE layer
    n_group: int = 1  # group-limited routing: E experts in n_group groups ...
    topk_group: int = 1  # ... of which a token's experts come from topk_group
    # MLA (DeepSeek-V3): (q_lora_rank, kv_lora_rank, qk_rope_head_dim, v_head_dim), with
    # head_dim = qk_nope + qk_rope; () for standard attention.
    mla_ranks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for field in ("hidden_size", "num_layers", "num_q_heads", "num_kv_heads", "head_dim"):
            if getattr(self, field) < 1:
                raise ValueError(f"ModelShape.{field} must be >= 1")
        if self.vocab_size < 1:
            raise ValueError("ModelShape.vocab_size must be >= 1")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError("num_q_heads must be a multiple of num_kv_heads")
        if self.num_experts < 0 or self.expert_width < 0 or self.dense_width < 0:
            raise ValueError("expert / MLP sizes must be >= 0")
        if self.num_experts:
            if not 1 <= self.top_k <= self.num_experts:
                raise ValueError(f"top_k must be in [1, num_experts], got {self.top_k}")
            if self.expert_width < 1:
                raise ValueError("an MoE model needs expert_width >= 1")
        elif self.top_k:
            raise ValueError("top_k must be 0 when num_experts is 0")
        for field in ("dense_layers", "sliding_layers"):
            layers = getattr(self, field)
            if not isinstance(layers, tuple) or any(not 0 <= i < self.num_layers for i in layers):
                raise ValueError(f"ModelShape.{field} must be a tuple of layer indices")
        if self.dense_layers_count and self.dense_width < 1:
            raise ValueError("dense layers need dense_width >= 1")
        if self.sliding_layers and self.sliding_window < 1:
            raise ValueError("sliding_layers need sliding_window >= 1")
        if self.dtype_bytes not in (1, 2, 4):
            raise ValueError("dtype_bytes must be 1, 2 or 4")
        if self.weight_format is not None and self.weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"weight_format must be one of {sorted(WEIGHT_FORMATS)} or None,"
                             f" got {self.weight_format!r}")
        if self.kv_format is not None and self.kv_format not in KV_FORMATS:
            raise ValueError(f"kv_format must be one of {sorted(KV_FORMATS)} or None,"
                             f" got {self.kv_format!r}")

    def with_formats(self, weight_format: str | None, kv_format: str | None) -> ModelShape:
        """The same model with weights and KV cache stored in these formats."""
        return replace(self, weight_format=weight_format, kv_format=kv_format)

    # ---- stored formats --------------------------------------------------------------
    @property
    def weight_format_spec(self) -> WeightFormat | None:
        return None if self.weight_format is None else WEIGHT_FORMATS[self.weight_format]

    def linear_bytes(self, k: int, n: int, *, expert: bool = False) -> int:
        """Stored bytes of a [k, n] projection: in the weight format when it covers the
        matrix (routed experts; attention and dense MLPs too unless the format is
        experts-only), else dtype_bytes a weight."""
        fmt = self.weight_format_spec
        if fmt is None or not (expert or fmt.dense):
            return k * n * self.dtype_bytes
        return fmt.matrix_bytes(k, n)

    @property
    def expert_weight_itemsize(self) -> float:
        """Stored bytes per routed-expert weight, scales included (dtype_bytes for bf16)."""
        return self.expert_bytes / self.expert_params if self.expert_params else 0.0

    @property
    def dense_weight_itemsize(self) -> float:
        """Stored bytes per attention-projection weight, scales included."""
        return self.attention_weight_bytes / self.attention_params

    @property
    def kv_itemsize(self) -> int:
        """Bytes of one cached K or V value."""
        return self.dtype_bytes if self.kv_format is None else KV_FORMATS[self.kv_format]

    # ---- layer structure -------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.num_layers})")
        return self.is_moe and layer not in self.dense_layers

    def is_sliding_layer(self, layer: int) -> bool:
        return layer in self.sliding_layers

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - len(self.dense_layers) if self.is_moe else 0

    @property
    def dense_layers_count(self) -> int:
        return self.num_layers if not self.is_moe else len(self.dense_layers)

    # ---- weight sizes ----------------------------------------------------------------
    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert: gate, up and down projections, 3*D*F."""
        return 3 * self.hidden_size * self.expert_width

    @property
    def expert_bytes(self) -> int:
        """Stored bytes of one expert's weights: gate | up [D, 2F] and down [F, D], in the
        weight format with its scales (the engine's ModelConfig.expert_bytes, less biases).
        """
        if not self.expert_width:
            return 0
        d, f = self.hidden_size, self.expert_width
        return self.linear_bytes(d, 2 * f, expert=True) + self.linear_bytes(f, d, expert=True)

    @property
    def expert_bytes_per_layer(self) -> int:
        """Bytes of all routed experts of one MoE layer: E * expert_bytes."""
        return self.num_experts * self.expert_bytes

    @property
    def shared_mlp_bytes(self) -> int:
        """Stored bytes of one MoE layer's shared experts (gate | up, down)."""
        d, f = self.hidden_size, self.shared_width
        return self.linear_bytes(d, 2 * f) + self.linear_bytes(f, d) if f else 0

    def param_counts(self) -> tuple[int, int]:
        """(total, active) parameters, norms and biases left out. Active: what one
        token's forward multiplies, embedding and head excluded (the convention of the
        GLM-4.5 and DeepSeek-V3 cards' "active"): attention and dense MLPs whole, the
        router, the shared experts and top_k routed experts of each MoE layer."""
        d, moe = self.hidden_size, self.num_moe_layers
        embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        common = (self.num_layers * self.attention_params
                  + self.dense_layers_count * 3 * d * self.dense_width
                  + moe * (d * self.num_experts + 3 * d * self.shared_width))
        total = embed + common + moe * self.num_experts * self.expert_params
        return total, common + moe * self.top_k * self.expert_params

    @property
    def attention_params(self) -> int:
        """Parameters of Q, K, V and O projections of one layer (MLA: its low-rank q and
        kv projections, the decompressions and O)."""
        d, h = self.hidden_size, self.head_dim
        if self.mla_ranks:
            q_rank, kv_rank, rope, v = self.mla_ranks
            n = self.num_q_heads
            q = d * q_rank + q_rank * n * h if q_rank else d * n * h
            return q + d * (kv_rank + rope) + kv_rank * n * (h - rope + v) + n * v * d
        return d * (self.num_q_heads + 2 * self.num_kv_heads) * h + self.num_q_heads * h * d

    @property
    def kv_values_per_token_layer(self) -> int:
        """Values one token caches in one layer: K and V of every KV head (2 K H), or MLA's
        latent and shared rotary key (kv_lora_rank + qk_rope_head_dim), for all heads."""
        if self.mla_ranks:
            return self.mla_ranks[1] + self.mla_ranks[2]
        return 2 * self.num_kv_heads * self.head_dim

    @property
    def attention_weight_bytes(self) -> int:
        """Stored bytes of one layer's Q|K|V [D, (N + 2K) H] and O [N H, D] projections
        (MLA: q_a | q_b or q_proj, kv_a_proj_with_mqa, kv_b_proj and o_proj)."""
        d, h = self.hidden_size, self.head_dim
        if self.mla_ranks:
            q_rank, kv_rank, rope, v = self.mla_ranks
            n = self.num_q_heads
            q = (self.linear_bytes(d, q_rank) + self.linear_bytes(q_rank, n * h) if q_rank
                 else self.linear_bytes(d, n * h))
            return (q + self.linear_bytes(d, kv_rank + rope)
                    + self.linear_bytes(kv_rank, n * (h - rope + v)) + self.linear_bytes(n * v, d))
        qkv = self.linear_bytes(d, (self.num_q_heads + 2 * self.num_kv_heads) * h)
        return qkv + self.linear_bytes(self.num_q_heads * h, d)

    @property
    def dense_mlp_bytes(self) -> int:
        """Stored bytes of one dense MLP layer: gate | up [D, 2F] and down [F, D]."""
        if not self.dense_width:
            return 0
        d, f = self.hidden_size, self.dense_width
        return self.linear_bytes(d, 2 * f) + self.linear_bytes(f, d)

    # ---- construction ----------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, config: Mapping, name: str | None = None) -> ModelShape:
        """Build from a Hugging Face `config.json` dict (Qwen3-MoE, Qwen3, GPT-OSS)."""
        cfg = dict(config)
        hidden = int(cfg["hidden_size"])
        layers = int(cfg["num_hidden_layers"])
        q_heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or q_heads)
        head_dim = cfg.get("head_dim")
        if head_dim is None:
            if hidden % q_heads:
                raise ValueError("head_dim is absent and hidden_size % num_attention_heads != 0")
            head_dim = hidden // q_heads
        experts = int(
            cfg.get("num_experts")
            or cfg.get("num_local_experts")
            or cfg.get("n_routed_experts")
            or 0
        )
        top_k = int(cfg.get("num_experts_per_tok") or cfg.get("experts_per_token") or 0)
        intermediate = int(cfg.get("intermediate_size") or 0)
        mla = ()
        if cfg.get("kv_lora_rank"):  # DeepSeek-V3's MLA: weights only (see above)
            rope = int(cfg["qk_rope_head_dim"])
            head_dim = int(cfg["qk_nope_head_dim"]) + rope
            mla = (int(cfg.get("q_lora_rank") or 0), int(cfg["kv_lora_rank"]), rope,
                   int(cfg["v_head_dim"]))
        if experts:
            expert_width = int(cfg.get("moe_intermediate_size") or intermediate)
            step = int(cfg.get("decoder_sparse_step") or cfg.get("moe_layer_freq") or 1)
            first_dense = int(cfg.get("first_k_dense_replace") or 0)
            mlp_only = {int(i) for i in cfg.get("mlp_only_layers") or ()}
            dense_layers = tuple(i for i in range(layers)
                                 if i < first_dense or i in mlp_only or (i + 1) % step != 0)
            dense_width = intermediate if dense_layers else 0
        else:
            expert_width, top_k, dense_layers, dense_width = 0, 0, (), intermediate
        layer_types = cfg.get("layer_types") or ()
        sliding_layers = tuple(
            i for i, kind in enumerate(layer_types) if str(kind).startswith("sliding")
        )
        window = int(cfg.get("sliding_window") or 0) if sliding_layers else 0
        dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").lower()
        dtype = dtype.removeprefix("torch.")
        if dtype not in _DTYPE_BYTES:
            raise ValueError(f"unknown dtype {dtype!r}")
        return cls(
            name=name or str(cfg.get("_name_or_path") or cfg.get("model_type") or "model"),
            hidden_size=hidden,
            num_layers=layers,
            num_q_heads=q_heads,
            num_kv_heads=kv_heads,
            head_dim=int(head_dim),
            vocab_size=int(cfg["vocab_size"]),
            num_experts=experts,
            top_k=top_k,
            expert_width=expert_width,
            dense_width=dense_width,
            dense_layers=dense_layers,
            sliding_layers=sliding_layers,
            sliding_window=window,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            dtype_bytes=_DTYPE_BYTES[dtype],
            shared_width=int(cfg.get("n_shared_experts") or 0) * expert_width,
            n_group=int(cfg.get("n_group") or 1) if experts else 1,
            topk_group=int(cfg.get("topk_group") or 1) if experts else 1,
            mla_ranks=mla,
        )

    @classmethod
    def from_model_config(cls, cfg: ModelConfig, name: str) -> ModelShape:
        """The shape of the model the engine builds from `cfg`, in its weight format
        (`cfg.quantization`) and KV format (`cfg.kv_cache_dtype`)."""
        moe = cfg.num_experts > 0
        dense_layers = cfg.dense_layers if moe else ()
        sliding = tuple(i for i in range(cfg.num_hidden_layers) if cfg.layer_window(i))
        dtype = cfg.dtype.lower().removeprefix("torch.")
        if dtype not in _DTYPE_BYTES:
            raise ValueError(f"unknown dtype {dtype!r}")
        return cls(
            name=name,
            hidden_size=cfg.hidden_size,
            num_layers=cfg.num_hidden_layers,
            num_q_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.qk_head_dim,
            vocab_size=cfg.vocab_size,
            num_experts=cfg.num_experts,
            top_k=cfg.num_experts_per_tok if moe else 0,
            expert_width=cfg.moe_intermediate_size if moe else 0,
            dense_width=cfg.intermediate_size if dense_layers or not moe else 0,
            dense_layers=dense_layers,
            sliding_layers=sliding,
            sliding_window=cfg.sliding_window if sliding else 0,
            tie_word_embeddings=cfg.tie_word_embeddings,
            dtype_bytes=_DTYPE_BYTES[dtype],
            weight_format=_ENGINE_FORMATS[cfg.quantization.method] if cfg.quantization else None,
            kv_format="fp8" if cfg.kv_cache_dtype == "fp8" else None,
            shared_width=cfg.n_shared_experts * cfg.moe_intermediate_size if moe else 0,
            n_group=cfg.n_group,
            topk_group=cfg.topk_group,
            mla_ranks=(cfg.q_lora_rank, cfg.kv_lora_rank, cfg.head_dim, cfg.v_head_dim)
            if cfg.is_mla else (),
        )

    @classmethod
    def from_json(cls, path: str | Path, name: str | None = None) -> ModelShape:
        """Build from a `config.json` file, through the engine's `ModelConfig` when the
        engine serves its model type; the name defaults to the file's stem."""
        path = Path(path)
        with path.open() as f:
            config = json.load(f)
        name = name or path.stem
        if config.get("model_type") in SUPPORTED_MODEL_TYPES:
            return cls.from_model_config(ModelConfig.from_hf_dict(config, source=str(path)), name)
        return cls.from_hf_config(config, name=name)


# The engine's configs (Qwen/Qwen3-30B-A3B and openai/gpt-oss-20b config.json): every
# layer MoE; GPT-OSS's even layers use a 128-token sliding window.
QWEN3_30B_A3B = ModelShape.from_json(CONFIG_DIR / "Qwen3-30B-A3B.json", name="Qwen3-30B-A3B")
GPT_OSS_20B = ModelShape.from_json(CONFIG_DIR / "gpt-oss-20b.json", name="GPT-OSS-20B")
# zai-org/GLM-4.5 and GLM-4.5-Air, openai/gpt-oss-120b: shared experts, dense first
# layers (GLM), sigmoid routing; 120b as 20b with 36 layers and 128 experts.
GLM_4_5 = ModelShape.from_json(CONFIG_DIR / "glm-4.5.json", name="GLM-4.5")
GLM_4_5_AIR = ModelShape.from_json(CONFIG_DIR / "glm-4.5-air.json", name="GLM-4.5-Air")
GPT_OSS_120B = ModelShape.from_json(CONFIG_DIR / "gpt-oss-120b.json", name="GPT-OSS-120B")
# deepseek-ai/DeepSeek-V3 (671B) and moonshotai/Kimi-K2 (1T, the same architecture):
# latent attention, 256 / 384 routed experts, one shared expert, dense first layers.
DEEPSEEK_V3 = ModelShape.from_json(CONFIG_DIR / "deepseek-v3.json", name="DeepSeek-V3")
KIMI_K2 = ModelShape.from_json(CONFIG_DIR / "kimi-k2.json", name="Kimi-K2")

LLAMA3_8B = ModelShape(
    # meta-llama/Meta-Llama-3-8B config.json: dense, GQA 32 query / 8 KV heads, untied
    # embeddings; FlowPrefill's main model.
    name="Llama3-8B",
    hidden_size=4096,
    num_layers=32,
    num_q_heads=32,
    num_kv_heads=8,
    head_dim=128,
    vocab_size=128256,
    dense_width=14336,
    tie_word_embeddings=False,
    dtype_bytes=2,
)

BUILTIN_SHAPES: dict[str, ModelShape] = {
    s.name: s for s in (QWEN3_30B_A3B, GPT_OSS_20B, LLAMA3_8B, GLM_4_5, GLM_4_5_AIR,
                        GPT_OSS_120B, DEEPSEEK_V3, KIMI_K2)}


def _norm(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum())


def resolve_model(name_or_path: str | Path, config_dir: str | Path | None = None) -> ModelShape:
    """A shape from a config path, a file in `checkpoints/configs/`, or a built-in name.

    Order: an existing file path; `<config_dir>/<name>.json`; a built-in shape.
    """
    path = Path(name_or_path)
    if path.is_file():
        return ModelShape.from_json(path)
    directory = Path(config_dir) if config_dir is not None else CONFIG_DIR
    candidate = directory / f"{path.name}.json"
    if candidate.is_file():
        return ModelShape.from_json(candidate)
    for shape in BUILTIN_SHAPES.values():
        if _norm(shape.name) == _norm(str(name_or_path)):
            return shape
    raise KeyError(
        f"no config for {name_or_path!r}: not a file, not in {directory}, not one of"
        f" {sorted(BUILTIN_SHAPES)}"
    )
