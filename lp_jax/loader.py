"""Builds a sharded Qwen3MoeForCausalLM from a Hugging Face directory, random
weights ("dummy"), or an orbax checkpoint of converted parameters.

Loading streams: the model is first built abstractly (`nnx.eval_shape`), each
parameter gets its NamedSharding from its logical axes, and every device shard is
then assembled by `jax.make_array_from_callback` from exactly the checkpoint
slices it covers (per-expert tensors transposed and stacked on the fly). The host
never holds more than one shard's worth of a parameter, so no second copy of the
model exists. Before anything is read, every expected tensor is checked for
presence and shape, so a bad checkpoint fails whole, not half-loaded.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from lp_jax.config import ModelConfig
from lp_jax.models.qwen3_moe import Qwen3MoeForCausalLM
from lp_jax.safetensors_io import CheckpointError, SafetensorsFile
from lp_jax.sharding import make_mesh, named_sharding

LOAD_FORMATS = ("auto", "safetensors", "dummy", "orbax")


@dataclasses.dataclass(frozen=True)
class _Source:
    """How one stacked parameter is read: its leading stacked axes enumerate
    checkpoint tensors; `names(*idx)` lists the tensors for one entry and
    `build` turns their arrays into that entry's [trailing dims] block."""

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


def hf_sources(cfg: ModelConfig) -> dict[tuple[str, ...], _Source]:
    """The Hugging Face tensor names behind every parameter path of the model."""
    L, D, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
    N, K, H = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    moe, dense = cfg.moe_layers, cfg.dense_layers
    E, F, Fd = cfg.num_experts, cfg.moe_intermediate_size, cfg.intermediate_size
    lay = "model.layers.{}."

    def per_layer(suffix, shape, build=_transpose, layers=None):
        layers = tuple(range(L)) if layers is None else layers
        return _Source(
            (len(layers),),
            lambda i: [lay.format(layers[i]) + suffix],
            build,
            lambda i: [shape],
        )

    src = {
        ("model", "embed_tokens"): _Source((), lambda: ["model.embed_tokens.weight"], _identity,
                                           lambda: [(V, D)]),
        ("model", "norm"): _Source((), lambda: ["model.norm.weight"], _identity, lambda: [(D,)]),
        ("model", "layers", "input_layernorm"): per_layer("input_layernorm.weight", (D,),
                                                          _identity),
        ("model", "layers", "post_attention_layernorm"): per_layer(
            "post_attention_layernorm.weight", (D,), _identity),
        ("model", "layers", "self_attn", "q_proj"): per_layer("self_attn.q_proj.weight",
                                                              (N * H, D)),
        ("model", "layers", "self_attn", "k_proj"): per_layer("self_attn.k_proj.weight",
                                                              (K * H, D)),
        ("model", "layers", "self_attn", "v_proj"): per_layer("self_attn.v_proj.weight",
                                                              (K * H, D)),
        ("model", "layers", "self_attn", "o_proj"): per_layer("self_attn.o_proj.weight",
                                                              (D, N * H)),
        ("model", "layers", "self_attn", "q_norm"): per_layer("self_attn.q_norm.weight", (H,),
                                                              _identity),
        ("model", "layers", "self_attn", "k_norm"): per_layer("self_attn.k_norm.weight", (H,),
                                                              _identity),
    }
    if not cfg.tie_word_embeddings:
        src[("lm_head",)] = _Source((), lambda: ["lm_head.weight"], _transpose, lambda: [(V, D)])
    if moe:
        src[("model", "layers", "mlp", "gate")] = per_layer("mlp.gate.weight", (E, D), layers=moe)
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
            src[("model", "layers", "dense_mlp", name)] = per_layer(f"mlp.{name}.weight", shape,
                                                                    layers=dense)
    return src


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

    def read(self, src: _Source, index: tuple[slice, ...], dtype) -> np.ndarray:
        """The block of the stacked parameter covered by `index` (a shard's slices)."""
        n_stack = len(src.stack_sizes)
        stack_ranges = [range(*s.indices(n)) for s, n in zip(index, src.stack_sizes, strict=False)]
        inner = index[n_stack:]
        blocks = []
        for idx in np.ndindex(*[len(r) for r in stack_ranges]):
            entry = tuple(r[i] for r, i in zip(stack_ranges, idx, strict=True))
            arrs = [self.where[n].get(n) for n in src.names(*entry)]
            blocks.append(np.asarray(src.build(arrs)[inner], dtype=dtype))
        if not n_stack:
            return blocks[0]
        return np.stack(blocks).reshape(*[len(r) for r in stack_ranges], *blocks[0].shape)


def abstract_model(cfg: ModelConfig, dtype=None):
    """(graphdef, abstract state) of the model without allocating anything."""
    model = nnx.eval_shape(lambda: Qwen3MoeForCausalLM(cfg, rngs=nnx.Rngs(0), dtype=dtype))
    return nnx.split(model)


def param_shardings(abstract_state, mesh: Mesh):
    """NamedSharding for every parameter, from its declared logical axes."""
    return jax.tree.map(
        lambda v: named_sharding(v.get_metadata()["logical_axes"], v.shape, mesh),
        abstract_state,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )


def _dummy_param(path, var, sharding, key):
    """Random weights of the model's init scale, made on device in the target sharding.

    Stacked parameters are drawn one leading slice at a time (`lax.map`), so a 30B
    model needs temporaries of one layer's slice, not float32 copies of everything.
    Norm weights are ones, as at init.
    """
    shape, dtype = var.shape, var.dtype
    if path[-1].endswith("norm"):
        return jax.jit(lambda: jnp.ones(shape, dtype), out_shardings=sharding)()
    fan_in = shape[-1] if path[-1] == "embed_tokens" else shape[-2]
    std = 1.0 / math.sqrt(fan_in)

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
) -> Qwen3MoeForCausalLM:
    """Builds the model sharded over `mesh` (default: one device).

    load_format: "safetensors" (a Hugging Face directory), "dummy" (random weights
    of the real shapes; needs only a config), "orbax" (parameters saved by
    `save_params`), or "auto" (orbax if `model_dir/orbax` exists, else safetensors).
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; expected one of {LOAD_FORMATS}")
    if config is None:
        if model_dir is None:
            raise ValueError("load_model needs a model_dir or a config")
        config = ModelConfig.from_pretrained(model_dir)
    mesh = mesh or make_mesh()
    if load_format == "auto":
        has_orbax = model_dir is not None and (Path(model_dir) / "orbax").is_dir()
        load_format = "orbax" if has_orbax else "safetensors"
    if load_format == "orbax":
        return restore_params(config, Path(model_dir) / "orbax", mesh=mesh, dtype=dtype)

    graphdef, abstract = abstract_model(config, dtype)
    shardings = param_shardings(abstract, mesh)
    if load_format == "dummy":
        flat_shardings = dict(nnx.to_flat_state(shardings))
        keys = iter(jax.random.split(jax.random.key(seed), len(flat_shardings)))
        return nnx.merge(graphdef, _with_values(
            abstract, lambda p, v: _dummy_param(p, v, flat_shardings[p], next(keys))))

    ckpt = HFCheckpoint(model_dir)
    sources = hf_sources(config)
    missing = {p for p, _ in nnx.to_flat_state(abstract)} - set(sources)
    if missing:  # a model parameter without a checkpoint mapping is a bug here
        raise AssertionError(f"no checkpoint mapping for parameters {sorted(missing)}")
    ckpt.check(sources)
    flat_shardings = dict(nnx.to_flat_state(shardings))

    def make_value(path, var):
        src, sharding = sources[path], flat_shardings[path]
        return jax.make_array_from_callback(
            var.shape, sharding, lambda index: ckpt.read(src, index, var.dtype)
        )

    return nnx.merge(graphdef, _with_values(abstract, make_value))


# ------------------------------------------------------------------ orbax
def save_params(model: Qwen3MoeForCausalLM, path: str | Path):
    """Saves converted parameters with orbax (a directory; must not exist)."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(Path(path).absolute(), nnx.to_pure_dict(nnx.state(model)))


def restore_params(cfg: ModelConfig, path: str | Path, *, mesh: Mesh | None = None,
                   dtype=None) -> Qwen3MoeForCausalLM:
    """Restores `save_params` output straight into the target sharding."""
    import orbax.checkpoint as ocp

    mesh = mesh or make_mesh()
    graphdef, abstract = abstract_model(cfg, dtype)
    shardings = param_shardings(abstract, mesh)
    target = jax.tree.map(
        lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s),
        nnx.to_pure_dict(abstract), nnx.to_pure_dict(shardings),
    )
    with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(Path(path).absolute(), target)
    state = _with_values(abstract, lambda p, v: _get_path(restored, p))
    return nnx.merge(graphdef, state)


def _get_path(tree, path):
    for key in path:
        tree = tree[key]
    return tree


__all__ = ["CheckpointError", "load_model", "save_params", "restore_params", "hf_sources"]
