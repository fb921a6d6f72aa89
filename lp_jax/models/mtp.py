"""Next-token (MTP) layers as drafts: DeepSeek-V3's and GLM-4.5's
`num_nextn_predict_layers`, served as vLLM and SGLang serve them.

The checkpoint keeps the layer past the served ones, at index L = num_hidden_layers:
`enorm`, `hnorm`, `eh_proj` (2 D -> D), one whole decoder layer (attention and the MLP
that layer L would have: MoE for these models), `shared_head.norm`, `shared_head.head`,
and `embed_tokens`; a checkpoint without the last two shares the target's. For target
position i with last hidden state h_i (the residual stream leaving the last layer,
before the final norm) and next token t_{i+1}:

    e_i = embed(t_{i+1}), zero at position 0 (as vLLM and SGLang serve it)
    x_i = eh_proj([enorm(e_i) | hnorm(h_i)])              the embedding's half first
    o_i = decoder_layer(x_i)                                causal over the layer's own KV
    draft token at i + 2 = argmax shared_head.head(shared_head.norm(o_i))

A chained step feeds o_i back in place of h with the token it just drafted, one
position further, through the same layer (one MTP layer serves every k, as in vLLM).

The decoder layer is the target's own model class built with one layer (MtpConfig.
model_cfg), so MLA (DeepSeek-V3) or GQA with biases and partial RoPE (GLM-4.5), the
router and the shared experts are the code the target runs. Its `model.norm` and
`lm_head` hold shared_head's norm and head, its `embed_tokens` the layer's embedding
(or the target's very arrays, not a copy). Its KV is a one-layer pool in the target
pool's layout (the latent for MLA), on the target's pages: rollback and chaining are
the EAGLE-3 head's (draft_chain.py).

Under layered prefill nothing is kept for the draft: it runs in the call whose rows
leave the last layer, where every row's last hidden state is that call's output
(lp_jax/executor/step.py). Loading: lp_jax/loader.py `load_mtp`, only when
speculative_config's method is "mtp".
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from lp_jax.config import ModelConfig
from lp_jax.models.backends import KernelBackends
from lp_jax.models.draft_chain import chain_drafts
from lp_jax.models.layers import dot, rms_norm
from lp_jax.models.metadata import AttentionMetadata


def one_layer_config(target: ModelConfig) -> ModelConfig:
    """The config of the MTP layer as a one-layer model of the target's class: layer 0
    has the MLP that layer L (num_hidden_layers) would have in the target."""
    L = target.num_hidden_layers
    return target.replace(
        num_hidden_layers=1, first_k_dense_replace=0 if target.is_moe_layer(L) else 1,
        mlp_only_layers=(), decoder_sparse_step=1, layer_types=(), kv_scales=(),
        num_nextn_predict_layers=0)


@dataclasses.dataclass(frozen=True, eq=False)
class MtpConfig:
    """What the step program needs to run the layer: the one-layer model's config and
    graph (merged with MtpParams.state inside the program), and the checkpoint index."""

    model_cfg: ModelConfig
    graphdef: Any
    layer: int
    aux_layer_ids: tuple[int, ...] = ()  # none: the draft reads the last hidden state


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MtpParams:
    """The one-layer model's state and the layer's input projection, eh_proj as x @ w."""

    state: Any  # nnx.State of the one-layer model
    w_enorm_D: jax.Array
    w_hnorm_D: jax.Array
    w_eh_2DD: jax.Array


def mtp_layer(cfg: MtpConfig, p: MtpParams, tokens_T, h_TD, kv_pages, meta: AttentionMetadata,
              *, backends: KernelBackends, decode_only=False):
    """The layer on a ragged batch: row t stands for a target position with last hidden
    state h_TD[t] and next token tokens_T[t]. Writes the rows' KV at meta.slots_T.
    Returns (o_TD the state a chained step feeds back and `logits` reads, kv_pages)."""
    model = nnx.merge(cfg.graphdef, p.state)
    eps = cfg.model_cfg.rms_norm_eps
    e_TD = model.embed(tokens_T).astype(h_TD.dtype)
    e_TD = jnp.where((meta.positions_T == 0)[:, None], 0, e_TD)
    x_T2D = jnp.concatenate([rms_norm(e_TD, p.w_enorm_D, eps),
                             rms_norm(h_TD, p.w_hnorm_D, eps)], axis=-1)
    x_TD = dot(x_T2D, p.w_eh_2DD)
    o_TD, kv_pages, _ = model.run_units(x_TD, kv_pages, meta, 0, 2, decode_only=decode_only,
                                        backends=backends)
    return o_TD, kv_pages


def logits(cfg: MtpConfig, p: MtpParams, o_BD):
    """shared_head: the drafts' logits of layer outputs o_BD (float32 [B, V])."""
    return nnx.merge(cfg.graphdef, p.state).compute_logits(o_BD)


def propose(cfg: MtpConfig, p: MtpParams, kv_pages, h_TD, tokens_T, meta: AttentionMetadata,
            last_row_B, *, k: int, backends: KernelBackends, decode_only=False,
            num_pages_B=None, drafting_B=None):
    """k greedy drafts per sequence: the layer over the batch's rows (h_TD: the target's
    last hidden states, tokens_T: the token after each row), then k - 1 chained one-row
    steps from last_row_B (draft_chain.chain_drafts, whose arguments these are).
    Returns (drafts_BK, kv_pages)."""
    o_TD, kv_pages = mtp_layer(cfg, p, tokens_T, h_TD, kv_pages, meta, backends=backends,
                               decode_only=decode_only)
    step = functools.partial(_chained_step, cfg, p, backends)
    return chain_drafts(step, functools.partial(logits, cfg, p), o_TD, kv_pages, meta,
                        last_row_B, k=k, page_size=kv_pages.shape[1],
                        num_pages_B=num_pages_B, drafting_B=drafting_B)


def _chained_step(cfg, p, backends, tok_B, h_BD, kv, meta):
    # One row per sequence: the decode form (MLA absorbed) applies.
    return mtp_layer(cfg, p, tok_B, h_BD, kv, meta, backends=backends, decode_only=True)


def propose_program(cfg: MtpConfig, *, k: int, backends: KernelBackends = KernelBackends()):
    """`propose` compiled: (params, kv_pages, h_TD, tokens_T, meta, last_row_B) ->
    (drafts_BK, kv_pages), the pool donated."""
    return jax.jit(functools.partial(propose, cfg, k=k, backends=backends),
                   donate_argnums=(1,))
