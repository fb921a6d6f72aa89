"""Builds a sharded model (the class of its `model_type`: Qwen3MoeForCausalLM,
GptOssForCausalLM) from a Hugging Face directory, random weights ("dummy"), or an
orbax checkpoint of converted parameters.

Loading streams: the model is first built abstractly (`nnx.eval_shape`), each
parameter gets its NamedSharding from its logical axes, and every device shard is
then assembled by `jax.make_array_from_callback` from exactly the checkpoint
slices it covers (per-expert tensors transposed and stacked on the fly). The host
never holds more than one shard's worth of a parameter, so no second copy of the
model exists. Before anything is read, every expected tensor is checked for
presence and shape, so a bad checkpoint fails whole, not half-loaded.

GPT-OSS checkpoints keep each layer's experts in one tensor, [E, D, 2F] with gate and
up columns interleaved (bf16, as transformers saves them), or in MXFP4 (`*_blocks`
uint8 [E, out, G, 16]: two FP4 values a byte, low nibble first; `*_scales` uint8
[E, out, G]: a power-of-two exponent + 127 per 32 values; `dequantize_mxfp4`). Either
way one expert is read (and dequantised) at a time, for the shards that hold it.

Quantized serving (lp_jax/quant): a checkpoint's `quantization_config` (HF
fine-grained FP8) is read as is, and `quantization="int8" | "fp8"` quantises a 16-bit
checkpoint, or dummy weights, per output channel while loading; `quant.resolve`
refuses a request that disagrees with the checkpoint. The tensors behind each
quantized parameter and its scale are in loader_quant.py, checked with the rest
before anything is read.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from lp_jax.config import ModelConfig
from lp_jax.loader_quant import (
    check_fp8_checkpoint,
    check_mxfp4_request,
    dequantize_fp8_blocks,
    dummy_quantized,
    param_schemes,
    quantized_sources,
    scale_path,
)
from lp_jax.models import StackedCausalLM, model_class
from lp_jax.models.deepseek_v3 import kv_a_width
from lp_jax.models.stacked import embed_width
from lp_jax.quant import resolve as resolve_quantization
from lp_jax.quant.mxfp4 import packed_from_blocks as mxfp4_packed_from_blocks
from lp_jax.quant.mxfp4 import scales_from_checkpoint as mxfp4_scales
from lp_jax.safetensors_io import CheckpointError, SafetensorsFile
from lp_jax.sharding import kv_head_columns, kv_head_replicas, make_mesh, named_sharding

LOAD_FORMATS = ("auto", "safetensors", "dummy", "orbax")
logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Source:
    """How one stacked parameter is read: its leading stacked axes enumerate
    checkpoint tensors; `names(*idx)` lists the tensors for one entry and
    `build` turns their arrays into that entry's [trailing dims] block. A name may be
    (name, i): row i of that tensor (one expert of a per-layer expert tensor);
    `shapes` gives the whole tensors' shapes."""

    stack_sizes: tuple[int, ...]
    names: Callable[..., list[str]]
    build: Callable[[list[np.ndarray]], np.ndarray]
    shapes: Callable[..., list[tuple[int, ...]]]


def _transpose(arrs):
    return arrs[0].T


def _identity(arrs):
    return arrs[0]


def _gate_up(arrs):
    return np.concatenate([arrs[0].T, arrs[1].T], axis=-1)


def _deinterleave(a):
    """[..., 2F] with gate/up columns interleaved (GPT-OSS) -> [gate | up] halves."""
    return np.concatenate([a[..., 0::2], a[..., 1::2]], axis=-1)


FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 blocks [..., G, B] uint8 and scales [..., G] uint8 -> float32 [..., G*2B]:
    value j of a block is FP4_VALUES[nibble] * 2^(scale - 127), the low nibble of byte b
    first (transformers' `convert_moe_packed_tensors`, before its final transpose)."""
    blocks = np.asarray(blocks, np.uint8)
    if blocks.shape[:-1] != scales.shape:
        raise CheckpointError(f"MXFP4 blocks {blocks.shape} do not match scales {scales.shape}")
    out = np.empty((*blocks.shape, 2), np.float32)
    out[..., 0] = FP4_VALUES[blocks & 0x0F]
    out[..., 1] = FP4_VALUES[blocks >> 4]
    exp = np.asarray(scales, np.int32) - 127
    out = np.ldexp(out, exp[..., None, None])
    return out.reshape(*blocks.shape[:-2], -1)


def _mxfp4_expert(arrs):
    """One expert's [out, G, B] blocks and [out, G] scales -> [in, out] float32."""
    return dequantize_mxfp4(arrs[0], arrs[1]).T


def hf_sources(cfg: ModelConfig, *, mxfp4: bool = False) -> dict[tuple[str, ...], _Source]:
    """The Hugging Face tensor names behind every parameter path of the model (for
    GPT-OSS, `mxfp4` says the experts are stored as MXFP4 blocks and scales)."""
    if cfg.model_type == "gpt_oss":
        return _gpt_oss_sources(cfg, mxfp4)
    return _qwen3_sources(cfg)


def _per_layer(layers, suffix, shape, build=_transpose):
    lay = "model.layers.{}."
    return _Source((len(layers),), lambda i: [lay.format(layers[i]) + suffix], build,
                   lambda i: [shape])


def _shared_sources(cfg: ModelConfig) -> dict[tuple[str, ...], _Source]:
    """Embedding, final norm, head and the two layer norms (every model type)."""
    L, D, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
    layers = tuple(range(L))
    src = {
        ("model", "embed_tokens"): _Source(
            (), lambda: ["model.embed_tokens.weight"],
            lambda a: np.pad(a[0], ((0, 0), (0, embed_width(cfg) - D))), lambda: [(V, D)]),
        ("model", "norm"): _Source((), lambda: ["model.norm.weight"], _identity, lambda: [(D,)]),
        ("model", "layers", "input_layernorm"): _per_layer(layers, "input_layernorm.weight",
                                                           (D,), _identity),
        ("model", "layers", "post_attention_layernorm"): _per_layer(
            layers, "post_attention_layernorm.weight", (D,), _identity),
    }
    if not cfg.tie_word_embeddings:
        src[("lm_head",)] = _Source((), lambda: ["lm_head.weight"], _transpose, lambda: [(V, D)])
    return src


def _gpt_oss_sources(cfg: ModelConfig, mxfp4: bool) -> dict[tuple[str, ...], _Source]:
    L, D = cfg.num_hidden_layers, cfg.hidden_size
    N, K, H = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    E, F = cfg.num_experts, cfg.moe_intermediate_size
    layers = tuple(range(L))
    attn, mlp = ("model", "layers", "self_attn"), ("model", "layers", "mlp")
    src = _shared_sources(cfg)
    for name, (n_out, n_in) in {"q_proj": (N * H, D), "k_proj": (K * H, D),
                                "v_proj": (K * H, D), "o_proj": (D, N * H)}.items():
        # o_proj stays [out, in] (see GptOssAttention); the others become [in, out]
        src[(*attn, name)] = _per_layer(layers, f"self_attn.{name}.weight", (n_out, n_in),
                                        _identity if name == "o_proj" else _transpose)
        if cfg.attention_bias:
            src[(*attn, f"{name}_bias")] = _per_layer(layers, f"self_attn.{name}.bias",
                                                      (n_out,), _identity)
    src[(*attn, "sinks")] = _per_layer(layers, "self_attn.sinks", (N,), _identity)
    src[(*mlp, "router")] = _per_layer(layers, "mlp.router.weight", (E, D))
    src[(*mlp, "router_bias")] = _per_layer(layers, "mlp.router.bias", (E,), _identity)
    experts = "model.layers.{}.mlp.experts."

    def per_expert(tensors, shapes, build):  # row e of per-layer [E, ...] tensors
        return _Source((L, E), lambda j, e: [(experts.format(j) + t, e) for t in tensors],
                       build, lambda j, e: shapes)

    if mxfp4 and cfg.quantization is not None:  # kept packed (quant/mxfp4.py)
        G = D // 32
        for name, n_out, g in (("gate_up_proj", 2 * F, G), ("down_proj", D, F // 32)):
            fix = _deinterleave if name == "gate_up_proj" else (lambda a: a)
            src[(*mlp, f"experts_{name}")] = per_expert(
                [f"{name}_blocks"], [(E, n_out, g, 16)],
                lambda a, fix=fix: fix(mxfp4_packed_from_blocks(a[0])))
            src[(*mlp, f"experts_{name}_scale")] = per_expert(
                [f"{name}_scales"], [(E, n_out, g)], lambda a, fix=fix: fix(mxfp4_scales(a[0])))
    elif mxfp4:
        G = D // 32  # gate_up's input is D; down's is F
        src[(*mlp, "experts_gate_up_proj")] = per_expert(
            ["gate_up_proj_blocks", "gate_up_proj_scales"],
            [(E, 2 * F, G, 16), (E, 2 * F, G)], lambda a: _deinterleave(_mxfp4_expert(a)))
        src[(*mlp, "experts_down_proj")] = per_expert(
            ["down_proj_blocks", "down_proj_scales"],
            [(E, D, F // 32, 16), (E, D, F // 32)], _mxfp4_expert)
    else:
        src[(*mlp, "experts_gate_up_proj")] = per_expert(
            ["gate_up_proj"], [(E, D, 2 * F)], lambda a: _deinterleave(a[0]))
        src[(*mlp, "experts_down_proj")] = per_expert(["down_proj"], [(E, F, D)], _identity)
    src[(*mlp, "experts_gate_up_proj_bias")] = per_expert(
        ["gate_up_proj_bias"], [(E, 2 * F)], lambda a: _deinterleave(a[0]))
    src[(*mlp, "experts_down_proj_bias")] = per_expert(["down_proj_bias"], [(E, D)], _identity)
    return src


def _qwen3_sources(cfg: ModelConfig) -> dict[tuple[str, ...], _Source]:
    L, D = cfg.num_hidden_layers, cfg.hidden_size
    N, K, H = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    moe, dense = cfg.moe_layers, cfg.dense_layers
    E, F, Fd = cfg.num_experts, cfg.moe_intermediate_size, cfg.intermediate_size
    layers, lay = tuple(range(L)), "model.layers.{}."
    attn = ("model", "layers", "self_attn")
    src = _shared_sources(cfg)
    if cfg.is_mla:
        src.update(_mla_sources(cfg))
    for name, shape in {} if cfg.is_mla else {
            "q_proj": (N * H, D), "k_proj": (K * H, D), "v_proj": (K * H, D),
            "o_proj": (D, N * H)}.items():
        src[(*attn, name)] = _per_layer(layers, f"self_attn.{name}.weight", shape)
        if cfg.attention_bias and name != "o_proj":  # GLM-4.5: q/k/v only
            src[(*attn, f"{name}_bias")] = _per_layer(layers, f"self_attn.{name}.bias",
                                                      shape[:1], _identity)
    for name in ("q_norm", "k_norm") if cfg.use_qk_norm else ():
        src[(*attn, name)] = _per_layer(layers, f"self_attn.{name}.weight", (H,), _identity)
    if moe:
        src[("model", "layers", "mlp", "gate")] = _per_layer(moe, "mlp.gate.weight", (E, D))
        if cfg.has_router_correction_bias:
            src[("model", "layers", "mlp", "e_score_correction_bias")] = _per_layer(
                moe, "mlp.gate.e_score_correction_bias", (E,), _identity)
        expert = lay + "mlp.experts.{}."
        src[("model", "layers", "mlp", "experts_gate_up_proj")] = _Source(
            (len(moe), E),
            lambda j, e: [expert.format(moe[j], e) + "gate_proj.weight",
                          expert.format(moe[j], e) + "up_proj.weight"],
            _gate_up,
            lambda j, e: [(F, D), (F, D)],
        )
        src[("model", "layers", "mlp", "experts_down_proj")] = _Source(
            (len(moe), E),
            lambda j, e: [expert.format(moe[j], e) + "down_proj.weight"],
            _transpose,
            lambda j, e: [(D, F)],
        )
    if dense:
        for name, shape in (("gate_proj", (Fd, D)), ("up_proj", (Fd, D)), ("down_proj", (D, Fd))):
            src[("model", "layers", "dense_mlp", name)] = _per_layer(dense, f"mlp.{name}.weight",
                                                                     shape)
    Fs = cfg.n_shared_experts * F
    for name, shape in (("gate_proj", (Fs, D)), ("up_proj", (Fs, D)), ("down_proj", (D, Fs))):
        if moe and Fs:
            src[("model", "layers", "shared_experts", name)] = _per_layer(
                moe, f"mlp.shared_experts.{name}.weight", shape)
    return src


def _mla_sources(cfg: ModelConfig) -> dict[tuple[str, ...], _Source]:
    """DeepSeek-V3's latent-attention projections (models/deepseek_v3.py)."""
    D, N, A, R = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.head_dim
    H, O, Q = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.q_lora_rank
    layers, attn = tuple(range(cfg.num_hidden_layers)), ("model", "layers", "self_attn")
    linears = {"kv_a_proj_with_mqa": (A + R, D), "kv_b_proj": (N * (H + O), A),
               "o_proj": (D, N * O)}
    norms = {"kv_a_layernorm": A}
    if Q:
        linears |= {"q_a_proj": (Q, D), "q_b_proj": (N * (H + R), Q)}
        norms["q_a_layernorm"] = Q
    else:
        linears["q_proj"] = (N * (H + R), D)
    # [in, out] -> the layout MlaAttention holds: kv_a_proj_with_mqa's columns padded to
    # whole 128-lane tiles, kv_b_proj [A, N * (H + O)] as [N, A, H + O] (heads major).
    width = kv_a_width(cfg)
    layout = {"kv_a_proj_with_mqa": lambda w: np.pad(w, ((0, 0), (0, width - A - R))),
              "kv_b_proj": lambda w: w.reshape(A, N, H + O).transpose(1, 0, 2)}
    lay_out = {n: layout.get(n, lambda w: w) for n in linears}
    src = {(*attn, n): _per_layer(layers, f"self_attn.{n}.weight", s,
                                  lambda a, f=lay_out[n]: f(a[0].T))
           for n, s in linears.items()}
    src |= {(*attn, n): _per_layer(layers, f"self_attn.{n}.weight", (w,), _identity)
            for n, w in norms.items()}
    q = cfg.quantization
    if q is not None and q.method == "fp8_block":  # the FP8 ones dequantised once, here
        for n, shape in linears.items():
            converted = {q.converts(f"model.layers.{i}.self_attn.{n}") for i in layers}
            if len(converted) > 1:
                raise ValueError(f"quantization_config.modules_to_not_convert keeps "
                                 f"self_attn.{n} 16-bit in some layers only")
            if not converted.pop():
                continue
            lay = "model.layers.{}.self_attn." + n
            src[(*attn, n)] = _Source(
                (len(layers),), lambda i, lay=lay: [lay.format(i) + ".weight",
                                                    lay.format(i) + ".weight_scale_inv"],
                lambda a, f=lay_out[n]: f(_dequantize_fp8_blocks(a)),
                lambda i, shape=shape: [shape, tuple(-(-d // FP8_BLOCK_SIZE) for d in shape)])
    return src


FP8_BLOCK_SIZE = 128  # HF fine-grained FP8: one weight_scale_inv a 128 x 128 block


def _dequantize_fp8_blocks(arrs):
    """An FP8 [out, in] weight and its weight_scale_inv -> the float32 [in, out] weight."""
    return dequantize_fp8_blocks(arrs[0], arrs[1]).T


class HFCheckpoint:
    """The tensors of a Hugging Face model directory, across one or many files."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        index = self.dir / "model.safetensors.index.json"
        single = self.dir / "model.safetensors"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: invalid index file ({e!r})") from None
            files = sorted(set(weight_map.values()))
        elif single.is_file():
            files = ["model.safetensors"]
        else:
            files = sorted(p.name for p in self.dir.glob("*.safetensors"))
            if not files:
                raise CheckpointError(
                    f"{self.dir}: no model.safetensors, model.safetensors.index.json or "
                    "*.safetensors file found"
                )
        self.files = {f: SafetensorsFile(self.dir / f) for f in files}
        self.where: dict[str, SafetensorsFile] = {}
        for f in self.files.values():
            for name in f.tensors:
                self.where[name] = f

    def check(self, sources: dict[tuple[str, ...], _Source]):
        """Every expected tensor exists with the expected shape, or a clear error."""
        for src in sources.values():
            for idx in np.ndindex(*src.stack_sizes):
                for name, shape in zip(src.names(*idx), src.shapes(*idx), strict=True):
                    name = name[0] if isinstance(name, tuple) else name
                    f = self.where.get(name)
                    if f is None:
                        raise CheckpointError(
                            f"{self.dir}: missing tensor {name!r} (searched "
                            f"{', '.join(self.files)})"
                        )
                    if f.shape(name) != shape:
                        raise CheckpointError(
                            f"{f.path}: tensor {name!r} has shape {f.shape(name)}, "
                            f"expected {shape}"
                        )

    def _tensor(self, name) -> np.ndarray:
        """A zero-copy view of a tensor, or of its row i for name = (name, i)."""
        if isinstance(name, tuple):
            return self.where[name[0]].get(name[0])[name[1]]
        return self.where[name].get(name)

    def has_mxfp4_experts(self) -> bool:
        return any(n.endswith("mlp.experts.gate_up_proj_blocks") for n in self.where)

    def read(self, src: _Source, index: tuple[slice, ...], dtype) -> np.ndarray:
        """The block of the stacked parameter covered by `index` (a shard's slices)."""
        n_stack = len(src.stack_sizes)
        stack_ranges = [range(*s.indices(n)) for s, n in zip(index, src.stack_sizes, strict=False)]
        inner = index[n_stack:]
        blocks = []
        for idx in np.ndindex(*[len(r) for r in stack_ranges]):
            entry = tuple(r[i] for r, i in zip(stack_ranges, idx, strict=True))
            arrs = [self._tensor(n) for n in src.names(*entry)]
            blocks.append(np.asarray(src.build(arrs)[inner], dtype=dtype))
        if not n_stack:
            return blocks[0]
        return np.stack(blocks).reshape(*[len(r) for r in stack_ranges], *blocks[0].shape)


def abstract_model(cfg: ModelConfig, dtype=None, mesh: Mesh | None = None):
    """(graphdef, abstract state) of the model (the class of cfg.model_type) without
    allocating anything; with `mesh`, the KV heads' columns laid out for it
    (`kv_columns`), else the checkpoint's."""
    cls = model_class(cfg.model_type)
    model = nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0), dtype=dtype))
    graphdef, state = nnx.split(model)
    columns = kv_columns(cfg, state, mesh)
    if columns:
        state = _with_values(state, lambda p, v: v.get_value() if p not in columns else
                             jax.ShapeDtypeStruct((*v.shape[:-1], len(columns[p])), v.dtype))
    return graphdef, state


def kv_columns(cfg: ModelConfig, abstract_state, mesh: Mesh | None) -> dict[tuple, np.ndarray]:
    """The parameters whose last logical axis is "kv_heads" (k_proj, v_proj, their
    biases and scales), each with the checkpoint column that each of its columns holds
    on `mesh` (a block scale: the column block; `sharding.kv_head_columns`).

    When the pool keeps r = `kv_head_replicas` copies of each KV head, so do these
    parameters: copy j of head k at k r + j, as in the pool, so that each device holds
    the whole head it stores and its query heads read. Split into K heads over t = K r
    devices instead, a device would hold H / r columns of a head: the projection would
    exchange head halves every layer, and on TPU a shard under 128 columns is relaid
    out every call (docs/benchmarks/layout.md). {} (the checkpoint's K heads) when r is
    1, and when a block scale does not align with the heads; `kv_cache.repeat_to_pool`
    then copies the heads each layer."""
    if mesh is None or cfg.is_mla:
        return {}
    K, H = cfg.num_key_value_heads, cfg.head_dim
    r = kv_head_replicas(K, cfg.num_attention_heads, mesh)
    if r == 1:
        return {}
    blocks = {scale_path(p): s.block_n for p, s in param_schemes(cfg).items()}
    out = {}
    for path, var in nnx.to_flat_state(abstract_state):
        if var.get_metadata().get("logical_axes", (None,))[-1] == "kv_heads":
            out[path] = kv_head_columns(K, H, r, blocks.get(path, 1))
            if out[path] is None:
                return {}
    return out


@functools.partial(jax.jit, static_argnums=(1, 2))
def _take_columns(a, columns: tuple[int, ...], sharding):
    """a[..., columns], made in `sharding` (load time only)."""
    return jax.lax.with_sharding_constraint(a[..., np.asarray(columns)], sharding)


def _lay_out_kv_columns(state, columns: dict, shardings):
    """`state` in the checkpoint's layout (K heads) -> the layout `columns` gives
    (`kv_columns`), on device."""
    flat_shardings = dict(nnx.to_flat_state(shardings))
    return _with_values(state, lambda p, v: v.get_value() if p not in columns else
                        _take_columns(v.get_value(), tuple(map(int, columns[p])),
                                      flat_shardings[p]))


def param_shardings(abstract_state, mesh: Mesh):
    """NamedSharding for every parameter, from its declared logical axes."""
    return jax.tree.map(
        lambda v: named_sharding(v.get_metadata()["logical_axes"], v.shape, mesh),
        abstract_state,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )


def _dummy_std(path, var) -> float:
    shape = var.shape
    fan_in = shape[-1] if path[-1] == "embed_tokens" else shape[-2]
    if path[-1] == "o_proj" and var.get_metadata().get("logical_axes", ())[-1] == "q_heads":
        fan_in = shape[-1]  # GPT-OSS keeps o_proj [out, in]
    return 1.0 / math.sqrt(fan_in)


def _dummy_param(path, var, sharding, key):
    """Random weights of the model's init scale, made on device in the target sharding.

    Stacked parameters are drawn one leading slice at a time (`lax.map`), so a 30B
    model needs temporaries of one layer's slice, not float32 copies of everything.
    Norm weights are ones, biases and attention sinks zeros, as at init.
    """
    shape, dtype = var.shape, var.dtype
    if path[-1].endswith("norm"):
        return jax.jit(lambda: jnp.ones(shape, dtype), out_shardings=sharding)()
    if path[-1].endswith("_bias") or path[-1] == "sinks":
        return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()
    std = _dummy_std(path, var)

    def draw(k, shp):
        return (jax.random.normal(k, shp, jnp.float32) * std).astype(dtype)

    def init(k):
        if len(shape) < 3:
            return draw(k, shape)
        return jax.lax.map(lambda ki: draw(ki, shape[1:]), jax.random.split(k, shape[0]))

    return jax.jit(init, out_shardings=sharding)(key)


def _with_values(abstract_state, make_value):
    """Replaces each abstract Variable's value by make_value(path, variable)."""
    flat = nnx.to_flat_state(abstract_state)
    for path, var in flat:
        var.set_value(make_value(path, var))
    return nnx.from_flat_state(flat)


def load_model(
    model_dir: str | Path | None = None,
    *,
    config: ModelConfig | None = None,
    load_format: str = "auto",
    mesh: Mesh | None = None,
    dtype=None,
    seed: int = 0,
    quantization: str | None = None,
) -> StackedCausalLM:
    """Builds the model sharded over `mesh` (default: one device).

    load_format: "safetensors" (a Hugging Face directory), "dummy" (random weights
    of the real shapes; needs only a config), "orbax" (parameters saved by
    `save_params`), or "auto" (orbax if `model_dir/orbax` exists, else safetensors).
    quantization: None (the checkpoint's format), "int8" or "fp8" (per channel, at
    load, for a 16-bit checkpoint); see lp_jax/quant.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; expected one of {LOAD_FORMATS}")
    if config is None:
        if model_dir is None:
            raise ValueError("load_model needs a model_dir or a config")
        config = ModelConfig.from_pretrained(model_dir)
    config = config.replace(quantization=resolve_quantization(config.quantization,
                                                              quantization))
    mesh = mesh or make_mesh()
    if load_format == "auto":
        has_orbax = model_dir is not None and (Path(model_dir) / "orbax").is_dir()
        load_format = "orbax" if has_orbax else "safetensors"
    if load_format == "orbax":
        return restore_params(config, Path(model_dir) / "orbax", mesh=mesh, dtype=dtype)

    graphdef, abstract = abstract_model(config, dtype, mesh)
    if load_format == "dummy":  # drawn in the checkpoint's layout: the same on every mesh
        _, drawn = abstract_model(config, dtype)
        state = _dummy_state(config, drawn, param_shardings(drawn, mesh), seed)
        return nnx.merge(graphdef, _lay_out_kv_columns(
            state, kv_columns(config, abstract, mesh), param_shardings(abstract, mesh)))

    ckpt = HFCheckpoint(model_dir)
    _log_skipped_mtp(ckpt, config)
    check_mxfp4_request(ckpt.dir, config, ckpt.has_mxfp4_experts())
    sources = quantized_sources(config, hf_sources(config, mxfp4=ckpt.has_mxfp4_experts()))
    return nnx.merge(graphdef, _read_params(ckpt, config, abstract, mesh, sources))


def _read_params(ckpt: HFCheckpoint, config: ModelConfig, abstract, mesh: Mesh, sources,
                 given=None):
    """The model's state, every parameter read from its source in `ckpt` (checked whole
    first) into its sharding, except those in `given` (path -> an array already laid out
    so, used as is)."""
    given = given or {}
    shardings = param_shardings(abstract, mesh)
    columns = kv_columns(config, abstract, mesh)
    missing = {p for p, _ in nnx.to_flat_state(abstract)} - set(sources) - set(given)
    if missing:  # a model parameter without a checkpoint mapping is a bug here
        raise AssertionError(f"no checkpoint mapping for parameters {sorted(missing)}")
    sources = {p: s for p, s in sources.items() if p not in given}
    check_fp8_checkpoint(ckpt, config, sources)
    ckpt.check(sources)
    for path, cols in columns.items():  # each entry built whole, then its heads copied
        if path in sources:
            sources[path] = dataclasses.replace(
                sources[path], build=lambda a, src=sources[path], c=cols: src.build(a)[..., c])
    flat_shardings = dict(nnx.to_flat_state(shardings))

    def make_value(path, var):
        if path in given:
            return given[path]
        src, sharding = sources[path], flat_shardings[path]
        return jax.make_array_from_callback(
            var.shape, sharding, lambda index: ckpt.read(src, index, var.dtype)
        )

    return _with_values(abstract, make_value)


def _log_skipped_mtp(ckpt: HFCheckpoint, cfg: ModelConfig):
    """Logs the next-token (MTP) layers the checkpoint holds past the served ones
    (GLM-4.5: `model.layers.{num_hidden_layers}`); speculative decoding would read them."""
    prefixes = tuple(f"model.layers.{cfg.num_hidden_layers + i}."
                     for i in range(cfg.num_nextn_predict_layers))
    skipped = [n for n in ckpt.where if prefixes and n.startswith(prefixes)]
    if skipped:
        logger.info("%s: skipping %d next-token (MTP) layer(s), %d tensors under %s; they "
                    "are not part of the served model (speculative_config method 'mtp' "
                    "reads them as drafts)", ckpt.dir, cfg.num_nextn_predict_layers,
                    len(skipped), ", ".join(p.rstrip(".") for p in prefixes))


def _renamed(src: _Source, rename) -> _Source:
    """`src` reading the tensors `rename` maps its names to."""
    def names(*idx):
        return [(rename(n[0]), n[1]) if isinstance(n, tuple) else rename(n)
                for n in src.names(*idx)]
    return dataclasses.replace(src, names=names)


def load_mtp(model_dir: str | Path, target: StackedCausalLM, *, mesh: Mesh | None = None):
    """(MtpConfig, MtpParams) of the checkpoint's first next-token (MTP) layer, index L =
    num_hidden_layers (lp_jax/models/mtp.py), sharded as the target is: the decoder layer
    read as layer 0 of a one-layer model of the target's class, `shared_head.norm` as its
    final norm, `shared_head.head` and `embed_tokens` as its head and embedding, or the
    target's own arrays where the checkpoint has none. Raises ValueError for a model
    without one, CheckpointError naming a missing or misshaped tensor."""
    from lp_jax.models.mtp import MtpConfig, MtpParams, one_layer_config
    from lp_jax.sharding import replicated

    cfg = target.config
    if cfg.num_nextn_predict_layers < 1:
        raise ValueError(f"speculative_config method 'mtp': {cfg.model_type} checkpoint "
                         f"{model_dir} has no next-token (MTP) layers (config.json's "
                         "num_nextn_predict_layers is 0); use method 'ngram' or 'eagle3'")
    if cfg.quantization is not None:
        raise ValueError(f"speculative_config method 'mtp': the next-token layer is served "
                         f"from 16-bit checkpoints only, not with quantization "
                         f"{cfg.quantization.method!r} yet")
    mesh = mesh or make_mesh()
    one, at = one_layer_config(cfg), f"model.layers.{cfg.num_hidden_layers}."
    graphdef, abstract = abstract_model(one, target.dtype, mesh)
    ckpt = HFCheckpoint(model_dir)
    layer0 = "model.layers.0."
    sources = {path: _renamed(src, lambda n: at + n[len(layer0):] if n.startswith(layer0)
                              else n)
               for path, src in hf_sources(one).items()}
    sources[("model", "norm")] = _renamed(sources[("model", "norm")],
                                          lambda n: at + "shared_head.norm.weight")
    given = {}
    for path, name, theirs in ((("model", "embed_tokens"), "embed_tokens.weight",
                                target.model.embed_tokens),
                               (("lm_head",), "shared_head.head.weight", target.lm_head)):
        if path not in sources:  # tied embeddings: no head of its own
            continue
        if at + name in ckpt.where:
            sources[path] = _renamed(sources[path], lambda n, name=name: at + name)
        else:
            given[path] = theirs.get_value()
    state = _read_params(ckpt, one, abstract, mesh, sources, given)
    D = cfg.hidden_size
    extra = {"enorm": _Source((), lambda: [at + "enorm.weight"], _identity, lambda: [(D,)]),
             "hnorm": _Source((), lambda: [at + "hnorm.weight"], _identity, lambda: [(D,)]),
             "eh_proj": _Source((), lambda: [at + "eh_proj.weight"], _transpose,
                                lambda: [(D, 2 * D)])}
    ckpt.check(extra)
    read = {k: jax.device_put(ckpt.read(src, (), target.dtype), replicated(mesh))
            for k, src in extra.items()}
    logger.info("%s: next-token (MTP) layer %s loaded as a draft (%s embedding, %s head)",
                ckpt.dir, at.rstrip("."), "own" if ("model", "embed_tokens") not in given
                else "the target's", "own" if ("lm_head",) not in given else "the target's")
    return (MtpConfig(model_cfg=one, graphdef=graphdef, layer=cfg.num_hidden_layers),
            MtpParams(state=state, w_enorm_D=read["enorm"], w_hnorm_D=read["hnorm"],
                      w_eh_2DD=read["eh_proj"]))


def _dummy_state(config: ModelConfig, abstract, shardings, seed: int):
    """Random weights for every parameter; a quantized weight and its scale from one
    draw (loader_quant.dummy_quantized)."""
    flat_shardings = dict(nnx.to_flat_state(shardings))
    keys = iter(jax.random.split(jax.random.key(seed), len(flat_shardings)))
    schemes = param_schemes(config)
    scales = {scale_path(p): p for p in schemes}
    made, abstract_flat = {}, dict(nnx.to_flat_state(abstract))

    def value(path, var):
        weight = scales.get(path, path)
        if weight not in schemes:
            return _dummy_param(path, var, flat_shardings[path], next(keys))
        if weight not in made:
            wvar = abstract_flat[weight]
            made[weight] = dummy_quantized(
                wvar.shape, schemes[weight], _dummy_std(weight, wvar),
                (flat_shardings[weight], flat_shardings[scale_path(weight)]), next(keys))
        return made[weight][1 if path in scales else 0]

    return _with_values(abstract, value)


# ------------------------------------------------------------------ orbax
def save_params(model: StackedCausalLM, path: str | Path):
    """Saves converted parameters with orbax (a directory; must not exist), the KV heads'
    columns in the checkpoint's layout (K heads), so that any mesh restores them."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(Path(path).absolute(), _checkpoint_layout(model))


def _checkpoint_layout(model: StackedCausalLM) -> dict:
    """The model's parameters (a pure dict), each copied KV head (`kv_columns`) kept
    once."""
    cfg, state = model.config, nnx.state(model)
    K, H = cfg.num_key_value_heads, cfg.head_dim
    blocks = {scale_path(p): s.block_n for p, s in param_schemes(cfg).items()}
    kv = {p: v.get_value() for p, v in nnx.to_flat_state(state)
          if v.get_metadata().get("logical_axes", (None,))[-1] == "kv_heads"}
    r = max((a.shape[-1] // (K * H) for p, a in kv.items() if p not in blocks), default=1)
    pure = nnx.to_pure_dict(state)
    for p, a in kv.items() if r > 1 else ():
        columns = kv_head_columns(K, H, r, blocks.get(p, 1))
        _get_path(pure, p[:-1])[p[-1]] = a[..., np.unique(columns, return_index=True)[1]]
    return pure


def restore_params(cfg: ModelConfig, path: str | Path, *, mesh: Mesh | None = None,
                   dtype=None) -> StackedCausalLM:
    """Restores `save_params` output straight into the target sharding (the KV heads'
    columns then laid out for `mesh`, `kv_columns`)."""
    import orbax.checkpoint as ocp

    mesh = mesh or make_mesh()
    graphdef, abstract = abstract_model(cfg, dtype, mesh)
    _, saved = abstract_model(cfg, dtype)
    target = jax.tree.map(
        lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s),
        nnx.to_pure_dict(saved), nnx.to_pure_dict(param_shardings(saved, mesh)),
    )
    with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(Path(path).absolute(), target)
    state = _with_values(saved, lambda p, v: _get_path(restored, p))
    return nnx.merge(graphdef, _lay_out_kv_columns(
        state, kv_columns(cfg, abstract, mesh), param_shardings(abstract, mesh)))


def _get_path(tree, path):
    for key in path:
        tree = tree[key]
    return tree


__all__ = ["CheckpointError", "load_model", "save_params", "restore_params", "hf_sources",
           "dequantize_mxfp4"]
