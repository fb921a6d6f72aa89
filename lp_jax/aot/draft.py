"""The draft model of `python -m lp_jax.aot --speculative-config '{"method": "mtp", ...}'`:
the checkpoint's next-token (MTP) layer built abstractly, placed as `loader.load_mtp`
places it, with its one-layer KV pool as the engine's runner makes it.

The MTP layer is a one-layer model of the target's class (lp_jax/models/mtp.py), so its
parameters take the target's logical axes and shardings (`loader.param_shardings`), and
enorm, hnorm and eh_proj are replicated. Its pool is the target pool's layout with one
layer, on the same pages: under data-parallel attention rank-major and split over
"data" as the target's, so each rank's chips hold its own pages of both. The layer's
embedding and head are counted as its own, as the published DeepSeek-V3 checkpoint
ships them (the engine shares the target's arrays where a checkpoint has none).

Only MTP drafts are built: an EAGLE-3 head's shapes come from its own config.json, which
the AOT does not take, and n-gram drafts add nothing to the programs.
"""

from __future__ import annotations

import jax
from flax import nnx

from lp_jax.config import ModelConfig
from lp_jax.models.kv_cache import kv_cache_axes, kv_cache_shape, kv_dtype
from lp_jax.models.mtp import MtpConfig, MtpParams, one_layer_config
from lp_jax.sharding import named_sharding, replicated
from lp_jax.spec.config import SpeculativeConfig


def draft_k(speculative_config) -> int:
    """k of an MTP `speculative_config` (a dict, its JSON, or None: 0). Raises ValueError
    for a method the AOT does not compile."""
    sc = SpeculativeConfig.parse(speculative_config)
    if sc is None:
        return 0
    if sc.method != "mtp":
        raise ValueError(f"speculative_config method {sc.method!r}: the AOT compiles MTP "
                         "drafts only (n-gram drafts add no program; an EAGLE-3 head's "
                         "shapes are in its own config.json)")
    return sc.num_speculative_tokens


def abstract_mtp(model_cfg: ModelConfig, dtype, mesh, kv_shape: tuple, *,
                 pages: int, packed: bool, replicas: int):
    """(MtpConfig, (MtpParams, draft_state)) as sharded ShapeDtypeStructs: the step's
    `draft` config and its draft_params / draft_state arguments. `kv_shape`: the
    target's pool, whose page size the draft's pool shares. Raises ValueError for a
    model without next-token layers."""
    from lp_jax.loader import abstract_model, param_shardings

    if model_cfg.num_nextn_predict_layers < 1:
        raise ValueError(f"speculative_config method 'mtp': the {model_cfg.model_type} "
                         "config has no next-token (MTP) layers (num_nextn_predict_layers 0)")
    if model_cfg.quantization is not None:
        raise ValueError("speculative_config method 'mtp': the next-token layer is served "
                         "from 16-bit checkpoints only, not with quantization "
                         f"{model_cfg.quantization.method!r} yet")
    one = one_layer_config(model_cfg)
    graphdef, abstract = abstract_model(one, dtype, mesh)
    state = jax.tree.map(
        lambda v, s: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s)),
        abstract, param_shardings(abstract, mesh), is_leaf=lambda x: isinstance(x, nnx.Variable))
    D, rep = model_cfg.hidden_size, replicated(mesh)
    vector = jax.ShapeDtypeStruct((D,), dtype, sharding=rep)
    params = MtpParams(state=state, w_enorm_D=vector, w_hnorm_D=vector,
                       w_eh_2DD=jax.ShapeDtypeStruct((2 * D, D), dtype, sharding=rep))
    layer_1 = model_cfg.replace(num_hidden_layers=1, layer_types=(), kv_scales=())
    shape_1 = kv_cache_shape(layer_1, pages, kv_shape[1], packed=packed, replicas=replicas)
    kv_1 = jax.ShapeDtypeStruct(shape_1, kv_dtype(layer_1, dtype), sharding=named_sharding(
        kv_cache_axes(layer_1), shape_1, mesh))
    cfg = MtpConfig(model_cfg=one, graphdef=graphdef, layer=model_cfg.num_hidden_layers)
    return cfg, (params, {"kv": kv_1})
