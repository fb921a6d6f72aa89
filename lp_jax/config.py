"""Model configuration read from a Hugging Face `config.json`.

One frozen dataclass holds what the model code needs and nothing else. Both config
dialects in the wild are accepted: `num_experts` or `num_local_experts`, and
`rope_theta` at top level or inside `rope_parameters` (newer transformers).

Model types: "qwen3_moe" and "qwen3" (Qwen3MoeForCausalLM / Qwen3ForCausalLM), and
"gpt_oss" (GptOssForCausalLM). GPT-OSS adds per-layer sliding windows (`layer_types`,
`sliding_window`), learned attention sinks, biases on the attention projections, the
router and both expert projections, a clamped SwiGLU (`swiglu_limit`, `swiglu_alpha`)
and YaRN RoPE; its experts are `intermediate_size` wide, all its layers are MoE, and
its router renormalises over the top-k (softmax of the top-k logits).

"glm4_moe" (Glm4MoeForCausalLM, GLM-4.5 / 4.6) adds the MoE blocks DeepSeek-V3 shares:
sigmoid routing with a correction bias, group-limited top-k and a routed scaling factor
(`router`), `n_shared_experts` always-on experts beside the routed ones, and
`first_k_dense_replace` dense first layers; attention has q/k/v biases, optional
per-head q/k RMSNorm (`use_qk_norm`) and RoPE on the first `partial_rotary_factor` of
each head. Its next-token (MTP) layers (`num_nextn_predict_layers`) are not part of the
served model (speculative decoding may read them as drafts, lp_jax/models/mtp.py). A
field lp_jax does not serve fails here, naming it, before anything is built or compiled.

"deepseek_v3" (DeepseekV3ForCausalLM; Kimi-K2's "kimi_k2" reads as it) has GLM-4.5's MoE
blocks under multi-head latent attention (`is_mla`: q_lora_rank, kv_lora_rank,
qk_nope_head_dim, v_head_dim; head_dim is qk_rope_head_dim, the rotary width), interleaved
rotary and YaRN with DeepSeek's mscale / mscale_all_dim (`softmax_scale`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from lp_jax.quant.config import QuantConfig
from lp_jax.quant.config import from_hf as quant_from_hf
from pallas_kernels.moe.ref import Router

SUPPORTED_MODEL_TYPES = ("qwen3_moe", "qwen3", "gpt_oss", "glm4_moe", "deepseek_v3")
# vLLM's kv_cache_dtype values lp_jax serves: "auto" (the model's dtype) and e4m3 pages.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


def resolve_kv_cache_dtype(value) -> str:
    """"auto" or "fp8" (fp8_e4m3 is its alias, as in vLLM); ValueError for anything else."""
    if value not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got "
                         f"{value!r} (fp8 / fp8_e4m3: float8_e4m3fn KV pages with per-layer "
                         "k_scale / v_scale)")
    return "auto" if value == "auto" else "fp8"
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclasses.dataclass(frozen=True, slots=True)
class RopeScaling:
    """YaRN RoPE parameters (`rope_type: "yarn"`), as transformers'
    `_compute_yarn_parameters` reads them; `attention_factor` None means 0.1 ln(factor) + 1."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    # DeepSeek's: with both set (and no attention_factor) cos/sin scale by
    # mscale(factor, mscale) / mscale(factor, mscale_all_dim); mscale_all_dim alone
    # also multiplies the softmax scale by mscale(factor, mscale_all_dim)^2.
    mscale: float = 0.0
    mscale_all_dim: float = 0.0

    @classmethod
    def from_hf(cls, rope: dict, *, max_position_embeddings: int,
                allow_mscale: bool = False) -> RopeScaling:
        if not allow_mscale and (rope.get("mscale") or rope.get("mscale_all_dim")):
            raise ValueError("YaRN with mscale / mscale_all_dim is only served for "
                             "deepseek_v3")
        original = rope.get("original_max_position_embeddings") or max_position_embeddings
        factor = rope.get("factor") or max_position_embeddings / original
        return cls(factor=float(factor), original_max_position_embeddings=int(original),
                   beta_fast=float(rope.get("beta_fast") or 32.0),
                   beta_slow=float(rope.get("beta_slow") or 1.0),
                   truncate=bool(rope.get("truncate", True)),
                   attention_factor=rope.get("attention_factor"),
                   mscale=float(rope.get("mscale") or 0.0),
                   mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0))

    def cos_sin_scale(self) -> float:
        """The factor on cos and sin, as transformers' `_compute_yarn_parameters`."""
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor,
                                                                       self.mscale_all_dim)
        return yarn_mscale(self.factor)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 mscale ln(factor) + 1 (1 for factor <= 1)."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0

_GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                 "truncate": False, "original_max_position_embeddings": 4096}


@dataclasses.dataclass(frozen=True, slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    moe_intermediate_size: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # More ids that end a completion: the rest of config.json's eos list and
    # generation_config.json's (Qwen3: <|im_end|> and <|endoftext|>; GPT-OSS: <|return|>,
    # <|call|>), as vLLM stops on them.
    extra_eos_token_ids: tuple[int, ...] = ()
    # GPT-OSS; the defaults are Qwen3's (no window, no biases, plain SiLU, default RoPE).
    rope_scaling: RopeScaling | None = None
    layer_types: tuple[str, ...] = ()  # per layer, from LAYER_TYPES; () = all full
    sliding_window: int = 0  # keys a sliding layer sees, its own position included
    attention_bias: bool = False  # biases on q/k/v/o projections
    swiglu_limit: float | None = None  # None: SiLU(gate) * up; else the clamped SwiGLU
    swiglu_alpha: float = 1.702
    # GLM-4.5 (and the DeepSeek-V3 family's MoE blocks); the defaults are Qwen3's.
    scoring_func: str = "softmax"  # router scores: "softmax" or "sigmoid"
    n_group: int = 1  # group-limited top-k: experts in n_group groups ...
    topk_group: int = 1  # ... of which the topk_group best are eligible
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0  # always-on experts, moe_intermediate_size wide each
    first_k_dense_replace: int = 0  # layers [0, k) are dense
    use_qk_norm: bool = True  # per-head RMSNorm of q and k
    partial_rotary_factor: float = 1.0  # RoPE on the first factor * head_dim of a head
    num_nextn_predict_layers: int = 0  # MTP layers in the checkpoint: drafts (models/mtp.py)
    # DeepSeek-V3's multi-head latent attention (kv_lora_rank > 0): queries through an
    # optional q_lora_rank bottleneck; keys and values from one per-token latent of
    # kv_lora_rank values plus one shared rotary key of qk_rope_head_dim (head_dim).
    q_lora_rank: int = 0  # 0: a plain q_proj
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # rotary pairs (x0, x1), (x2, x3), ... (DeepSeek)
    # Weight format (lp_jax/quant): from config.json's quantization_config, or set by the
    # loader for quantization="int8" | "fp8"; None: the checkpoint's 16/32-bit weights.
    quantization: QuantConfig | None = None
    # The KV pool's format (set by the engine): "auto" (self.dtype) or "fp8" (e4m3 pages),
    # with per-layer (k_scale, v_scale) read from the checkpoint; () means 1.0 everywhere.
    kv_cache_dtype: str = "auto"
    kv_scales: tuple[tuple[float, float], ...] = ()
    # Data-parallel attention (set by the engine): the KV pool's ranks, each holding its
    # own pages of every layer as one contiguous block of rows (kv_cache.layer_pages).
    kv_ranks: int = 1

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {self.model_type!r}; "
                f"lp_jax supports {SUPPORTED_MODEL_TYPES}"
            )
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "kv_ranks"):
            if getattr(self, name) <= 0:
                raise ValueError(f"config field {name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"num_experts_per_tok must be in [1, {self.num_experts}], "
                    f"got {self.num_experts_per_tok}"
                )
            if self.moe_intermediate_size <= 0:
                raise ValueError("an MoE config needs moe_intermediate_size > 0")
            if self.decoder_sparse_step < 1:
                raise ValueError("decoder_sparse_step must be >= 1")
            self.router.check(self.num_experts, self.num_experts_per_tok)
        rotary = self.head_dim * self.partial_rotary_factor
        if not 0 < rotary <= self.head_dim or int(rotary) % 2:
            raise ValueError(f"partial_rotary_factor {self.partial_rotary_factor} of head_dim "
                             f"{self.head_dim} must give an even rotary width in (0, head_dim]")
        if self.has_dense_layers and self.intermediate_size <= 0:
            raise ValueError("dense MLP layers need intermediate_size > 0")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(f"mlp_only_layers {bad} outside [0, {self.num_hidden_layers})")
        if self.layer_types:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(f"layer_types has {len(self.layer_types)} entries for "
                                 f"{self.num_hidden_layers} layers")
            unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if unknown:
                raise ValueError(f"unknown layer_types {unknown}; expected {LAYER_TYPES}")
            if "sliding_attention" in self.layer_types and self.sliding_window <= 0:
                raise ValueError("sliding_attention layers need sliding_window > 0")
        q = self.quantization
        gpt_oss = self.model_type == "gpt_oss"
        if q is not None and q.method == ("fp8_block" if gpt_oss else "mxfp4"):
            raise ValueError(f"quantization {q.method!r} is not supported for "
                             f"{self.model_type}: gpt_oss serves its MXFP4 experts "
                             "(quantization='mxfp4'), int8 / fp8 at load or 16-bit weights, "
                             "the Qwen3 models int8 / fp8 / HF FP8")

        if self.is_mla:
            self._check_mla()

    def _check_mla(self):
        """What DeepSeek-V3's latent attention does not serve yet, refused by name."""
        if self.kv_cache_dtype != "auto":
            raise ValueError(f"{self.model_type}: kv_cache_dtype {self.kv_cache_dtype!r} is "
                             "not served with latent attention yet (no per-layer scale for "
                             "the latent); use kv_cache_dtype='auto'")
        if self.num_key_value_heads != self.num_attention_heads:
            raise ValueError("latent attention expands one key and value per query head: "
                             "num_key_value_heads must equal num_attention_heads")

    def is_moe_layer(self, layer: int) -> bool:
        """The Hugging Face rule for which decoder layers carry a sparse MoE block."""
        return (
            self.num_experts > 0
            and layer >= self.first_k_dense_replace
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def router(self) -> Router:
        """The routing variant every MoE backend takes (moe.ref.Router)."""
        return Router(self.scoring_func, self.n_group, self.topk_group,
                      self.routed_scaling_factor)

    @property
    def has_router_correction_bias(self) -> bool:
        """An [E] e_score_correction_bias per MoE layer (GLM-4.5), used to choose the
        experts but not to weight them."""
        return self.model_type in ("glm4_moe", "deepseek_v3")

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (deepseek_v3): the KV pool holds the latent."""
        return self.kv_lora_rank > 0

    @property
    def kv_latent_dim(self) -> int:
        """Values an MLA pool stores a token a layer: latent plus shared rotary key."""
        return self.kv_lora_rank + self.head_dim

    @property
    def qk_head_dim(self) -> int:
        """Width of a query / key head: head_dim, or MLA's nope plus rotary parts."""
        return self.qk_nope_head_dim + self.head_dim if self.is_mla else self.head_dim

    @property
    def softmax_scale(self) -> float:
        """Attention's sm_scale: qk_head_dim^-0.5, times mscale(factor,
        mscale_all_dim)^2 under DeepSeek's YaRN (transformers' `yarn_apply_mscale`)."""
        scale = self.qk_head_dim**-0.5
        yarn = self.rope_scaling
        if yarn is not None and yarn.mscale_all_dim:
            scale *= yarn_mscale(yarn.factor, yarn.mscale_all_dim) ** 2
        return scale

    @property
    def rotary_dim(self) -> int:
        """Channels of a head that RoPE rotates (the first ones); the rest pass."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends a completion (unless ignore_eos)."""
        first = () if self.eos_token_id is None else (self.eos_token_id,)
        return frozenset(first + tuple(self.extra_eos_token_ids))

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.is_moe_layer(i))

    @property
    def dense_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if not self.is_moe_layer(i))

    @property
    def has_dense_layers(self) -> bool:
        return len(self.dense_layers) > 0

    def layer_window(self, layer: int) -> int | None:
        """Keys a layer's queries see (the query's own position included; HF's mask is
        `key > query - sliding_window`), or None for a full-attention layer."""
        if self.layer_types and self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def has_attention_sinks(self) -> bool:
        """Learned per-head sink logits in the softmax denominator (GPT-OSS)."""
        return self.model_type == "gpt_oss"

    @property
    def has_moe_bias(self) -> bool:
        """Biases on the router and on both expert projections (GPT-OSS)."""
        return self.model_type == "gpt_oss"

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert's weights (gate, up, down, and biases if any) as stored: in
        the model dtype, or quantized with their scales (QuantScheme.stored_bytes: 1 B a
        weight + float32 scales for int8 / fp8, 0.5 B + an e8m0 byte per 32 for MXFP4, its
        scale rows padded to a multiple of 8)."""
        itemsize = 2 if self.dtype in ("bfloat16", "float16") else 4
        D, F = self.hidden_size, self.moe_intermediate_size
        bias = 2 * F + D if self.has_moe_bias else 0
        if self.quantization is None:
            return (3 * D * F + bias) * itemsize
        scheme = self.quantization.scheme
        return scheme.stored_bytes(D, 2 * F) + scheme.stored_bytes(F, D) + bias * itemsize

    @classmethod
    def from_hf_dict(cls, hf: dict, *, source: str = "config.json") -> ModelConfig:
        model_type = hf.get("model_type")
        if model_type == "kimi_k2":  # Kimi-K2 ships DeepSeek-V3's architecture
            model_type = "deepseek_v3"
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"{source}: unsupported model_type {model_type!r}; lp_jax supports "
                f"{SUPPORTED_MODEL_TYPES}"
            )
        gpt_oss = model_type == "gpt_oss"
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        if gpt_oss and not rope.get("rope_type", rope.get("type")):
            rope = {**_GPT_OSS_ROPE, **rope}  # GptOssConfig's default
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None, "yarn"):
            raise ValueError(f"{source}: rope type {rope_type!r} is not supported yet")
        default_theta = 150_000.0 if gpt_oss else 10_000.0
        rope_theta = hf.get("rope_theta", rope.get("rope_theta", default_theta))
        num_experts = hf.get("num_experts", hf.get("num_local_experts",
                                                   hf.get("n_routed_experts", 0))) or 0
        if model_type == "qwen3":
            num_experts = 0
        heads = hf["num_attention_heads"]
        eos, extra_eos = hf.get("eos_token_id"), ()
        if isinstance(eos, list):
            eos, extra_eos = (eos[0], tuple(eos[1:])) if eos else (None, ())
        max_pos = hf.get("max_position_embeddings", 131072 if gpt_oss else 40960)
        quantization = quant_from_hf(hf.get("quantization_config"), source=source)
        try:
            moe = dict(
                moe_intermediate_size=hf.get("moe_intermediate_size", 0),
                num_experts_per_tok=hf.get("num_experts_per_tok", 0),
                norm_topk_prob=bool(hf.get("norm_topk_prob",
                                           model_type in ("glm4_moe", "deepseek_v3"))),
            ) if num_experts else {}
            extra = {}
            if gpt_oss:  # every layer MoE, experts intermediate_size wide, top-k softmax
                moe.update(moe_intermediate_size=hf["intermediate_size"], norm_topk_prob=True,
                           num_experts_per_tok=hf.get("num_experts_per_tok", 4))
                L = hf["num_hidden_layers"]
                extra = dict(
                    layer_types=tuple(hf.get("layer_types") or (
                        "sliding_attention" if (i + 1) % 2 else "full_attention"
                        for i in range(L))),
                    sliding_window=hf.get("sliding_window") or 0,
                    attention_bias=bool(hf.get("attention_bias", True)),
                    swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
                    swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
                )
            if model_type == "glm4_moe":
                extra = _glm4_moe_fields(hf, rope, source)
            if model_type == "deepseek_v3":
                extra = _deepseek_v3_fields(hf, source)
            if rope_type == "yarn":
                extra["rope_scaling"] = RopeScaling.from_hf(
                    rope, max_position_embeddings=max_pos,
                    allow_mscale=model_type == "deepseek_v3")
            return cls(
                model_type=model_type,
                vocab_size=hf["vocab_size"],
                hidden_size=hf["hidden_size"],
                num_hidden_layers=hf["num_hidden_layers"],
                num_attention_heads=heads,
                num_key_value_heads=hf.get("num_key_value_heads", heads),
                head_dim=(hf["qk_rope_head_dim"] if model_type == "deepseek_v3" else
                          hf.get("head_dim") or hf["hidden_size"] // heads),
                intermediate_size=hf.get("intermediate_size", 0),
                num_experts=num_experts,
                decoder_sparse_step=hf.get("decoder_sparse_step", 1) or 1,
                mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
                rms_norm_eps=hf.get("rms_norm_eps", 1e-5 if gpt_oss else 1e-6),
                rope_theta=float(rope_theta),
                max_position_embeddings=max_pos,
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                dtype=hf.get("torch_dtype") or hf.get("dtype") or "bfloat16",
                bos_token_id=hf.get("bos_token_id"),
                eos_token_id=eos,
                extra_eos_token_ids=extra_eos,
                quantization=quantization,
                **moe,
                **extra,
            )
        except KeyError as e:
            raise ValueError(f"{source}: missing required field {e.args[0]!r}") from None
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in model directory {model_dir}")
        cfg = cls.from_pretrained_file(path)
        gen = _generation_eos(Path(model_dir) / "generation_config.json")
        more = tuple(t for t in gen if t != cfg.eos_token_id and t not in cfg.extra_eos_token_ids)
        return cfg.replace(extra_eos_token_ids=cfg.extra_eos_token_ids + more) if more else cfg

    @classmethod
    def from_pretrained_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        try:
            hf = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: invalid JSON ({e})") from None
        return cls.from_hf_dict(hf, source=str(path))

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)


# GLM-4.5 fields that would change what the model computes, and the one value lp_jax
# serves: any other value is refused, naming the field.
_GLM4_MOE_FIXED = {"hidden_act": "silu", "scoring_func": "sigmoid", "topk_method": "noaux_tc"}


def _refuse_unfixed(hf: dict, fixed: dict, model_type: str, source: str) -> None:
    for name, value in fixed.items():
        if hf.get(name, value) != value:
            raise ValueError(f"{source}: {name}={hf[name]!r} is not supported for "
                             f"{model_type} (lp_jax serves {name}={value!r})")


def _sigmoid_moe_fields(hf: dict, *, dense_layers: int) -> dict:
    """The routing, shared-expert and next-token fields GLM-4.5 and DeepSeek-V3 share
    (sigmoid group-limited routing; `dense_layers`: first_k_dense_replace's default)."""
    return dict(
        scoring_func="sigmoid",
        n_group=int(hf.get("n_group") or 1),
        topk_group=int(hf.get("topk_group") or 1),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        n_shared_experts=int(hf.get("n_shared_experts", 1) or 0),
        first_k_dense_replace=int(hf.get("first_k_dense_replace", dense_layers) or 0),
        num_nextn_predict_layers=int(hf.get("num_nextn_predict_layers", 0) or 0),
    )


def _glm4_moe_fields(hf: dict, rope: dict, source: str) -> dict:
    """ModelConfig fields of a `glm4_moe` config.json, in the hubs' dialect (top-level
    rope_theta and partial_rotary_factor) or transformers 5's (inside rope_parameters),
    with Glm4MoeConfig's defaults."""
    _refuse_unfixed(hf, _GLM4_MOE_FIXED, "glm4_moe", source)
    return dict(
        _sigmoid_moe_fields(hf, dense_layers=1),
        use_qk_norm=bool(hf.get("use_qk_norm", False)),
        attention_bias=bool(hf.get("attention_bias", False)),
        partial_rotary_factor=float(hf.get("partial_rotary_factor",
                                           rope.get("partial_rotary_factor", 0.5))),
    )


_DEEPSEEK_V3_FIXED = {**_GLM4_MOE_FIXED, "attention_bias": False}


def _deepseek_v3_fields(hf: dict, source: str) -> dict:
    """ModelConfig fields of a `deepseek_v3` config.json (DeepSeek-V3 / R1 / V3.1), with
    DeepseekV3Config's defaults; head_dim is qk_rope_head_dim (the rotary width)."""
    _refuse_unfixed(hf, _DEEPSEEK_V3_FIXED, "deepseek_v3", source)
    for name in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
        if not hf.get(name):
            raise ValueError(f"{source}: deepseek_v3 needs a positive {name}")
    return dict(
        _sigmoid_moe_fields(hf, dense_layers=0),
        use_qk_norm=False,
        q_lora_rank=int(hf.get("q_lora_rank") or 0),
        kv_lora_rank=int(hf["kv_lora_rank"]),
        qk_nope_head_dim=int(hf["qk_nope_head_dim"]),
        v_head_dim=int(hf["v_head_dim"]),
        rope_interleave=bool(hf.get("rope_interleave", True)),
    )


def _generation_eos(path: Path) -> tuple[int, ...]:
    """generation_config.json's eos_token_id (an int or a list), () if absent or unreadable."""
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return ()
    eos = eos if isinstance(eos, list) else [eos]
    return tuple(t for t in eos if isinstance(t, int) and not isinstance(t, bool) and t >= 0)
