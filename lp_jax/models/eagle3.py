"""The EAGLE-3 draft head (`LlamaForCausalLMEagle3`, as vLLM and SGLang load it): one
decoder layer that reads the target's hidden states and proposes k tokens.

What the head computes, for target position i with token t_i:

    g_i  = fc([a0_i | a1_i | a2_i])               three target hidden states, 3 D -> D
    x_i  = [input_layernorm(embed(t_{i+1})) | hidden_norm(g_i)]          2 D
    r_i  = g_i + o_proj(attention(q, k, v of x_i))  causal, over the draft's own KV
    h_i  = r_i + mlp(post_attention_layernorm(r_i))  the "prenorm" state
    draft token at i + 2 = d2t-mapped argmax of lm_head(norm(h_i))

The aux states a_j are the target's residual stream entering layers
`eagle_aux_hidden_state_layer_ids` (default (2, L // 2, L - 3)). A chained step
feeds its own h back in place of g (no fc) with the token it just drafted, one position
further, so k drafts cost one extend over the verified rows and k - 1 one-row steps.

The draft's KV is a one-layer paged pool in the target pool's layout ([P, S, 2K, H],
kv_cache.py) addressed by the target's page table: its KV at position i sits where the
target's does, so dropping the pages of rejected drafts (`BlockManager.truncate`) rolls
the draft back too, and a rejected row's entry is rewritten by the next extend before
anything reads it. This is why the head must share the target's KV head count and
head_dim (`load_eagle3` checks).

The head's vocabulary is a subset of the target's: `d2t[j]` is target id - draft id
(vLLM's `draft_id_to_target_id` offsets). A head without `embed_tokens` uses the
target's embedding table.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from lp_jax.config import ModelConfig
from lp_jax.models.data_ranks import per_rank
from lp_jax.models.draft_chain import chain_drafts
from lp_jax.models.kv_cache import repeat_to_pool
from lp_jax.models.layers import apply_rope, dot, rms_norm
from lp_jax.models.metadata import AttentionMetadata
from lp_jax.safetensors_io import CheckpointError, SafetensorsFile
from pallas_kernels import attention
from pallas_kernels.attention import write_kv

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """vLLM's and SGLang's aux layers when the head's config names none."""
    return (2, num_layers // 2, num_layers - 3)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Eagle3Config:
    """The head's shape, from its config.json checked against the target's."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: tuple[int, int, int]
    # The target's data ranks: the head's pool is rank-major and its attention runs per
    # rank as the target's does (lp_jax/models/data_ranks.py).
    kv_ranks: int = 1

    def replace(self, **changes) -> Eagle3Config:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_dict(cls, hf: dict, target: ModelConfig, *, source: str = "config.json"):
        """Raises ValueError, naming `source`, for a head this engine cannot run on
        `target`."""
        def bad(msg):
            return ValueError(f"{source}: {msg}")

        archs = hf.get("architectures") or []
        if not set(archs) & set(ARCHITECTURES):
            raise bad(f"architectures {archs} is not an EAGLE-3 head ({list(ARCHITECTURES)})")
        if hf.get("num_hidden_layers", 1) != 1:
            raise bad(f"num_hidden_layers {hf['num_hidden_layers']}: EAGLE-3 heads have one "
                      "layer")
        if hf.get("rope_scaling"):
            raise bad(f"rope_scaling {hf['rope_scaling']} is not supported for a draft head")
        if hf.get("hidden_act", "silu") != "silu":
            raise bad(f"hidden_act {hf['hidden_act']!r}: only silu")
        D, N = hf["hidden_size"], hf["num_attention_heads"]
        cfg = cls(
            hidden_size=D, num_attention_heads=N,
            num_key_value_heads=hf.get("num_key_value_heads", N),
            head_dim=hf.get("head_dim") or D // N,
            intermediate_size=hf["intermediate_size"],
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(hf.get("rope_theta", 10000.0)),
            vocab_size=hf["vocab_size"],
            draft_vocab_size=hf.get("draft_vocab_size") or hf["vocab_size"],
            aux_layer_ids=tuple((hf.get("eagle_config") or {}).get(
                "eagle_aux_hidden_state_layer_ids")
                or default_aux_layers(target.num_hidden_layers)),
            kv_ranks=target.kv_ranks)
        checks = (
            (cfg.hidden_size == target.hidden_size,
             f"hidden_size {D} differs from the target's {target.hidden_size}"),
            (cfg.vocab_size == target.vocab_size,
             f"vocab_size {cfg.vocab_size} differs from the target's {target.vocab_size}"),
            (1 <= cfg.draft_vocab_size <= cfg.vocab_size,
             f"draft_vocab_size {cfg.draft_vocab_size} outside [1, {cfg.vocab_size}]"),
            ((cfg.num_key_value_heads, cfg.head_dim)
             == (target.num_key_value_heads, target.head_dim),
             f"(num_key_value_heads, head_dim) ({cfg.num_key_value_heads}, {cfg.head_dim}) "
             f"differs from the target's ({target.num_key_value_heads}, "
             f"{target.head_dim}): the draft's KV shares the target's pool layout"),
            (N % cfg.num_key_value_heads == 0,
             f"num_attention_heads {N} is not a multiple of num_key_value_heads"),
            (len(cfg.aux_layer_ids) == 3
             and all(0 <= i < target.num_hidden_layers for i in cfg.aux_layer_ids),
             f"aux hidden-state layers {list(cfg.aux_layer_ids)} must be three layers in "
             f"[0, {target.num_hidden_layers})"),
        )
        for ok, msg in checks:
            if not ok:
                raise bad(msg)
        return cfg


def _tensor_shapes(cfg: Eagle3Config) -> dict[str, tuple[int, ...]]:
    D, F, H = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    N, K = cfg.num_attention_heads, cfg.num_key_value_heads
    a, m = "midlayer.self_attn.", "midlayer.mlp."
    return {"fc.weight": (D, 3 * D), "midlayer.input_layernorm.weight": (D,),
            "midlayer.hidden_norm.weight": (D,), f"{a}q_proj.weight": (N * H, 2 * D),
            f"{a}k_proj.weight": (K * H, 2 * D), f"{a}v_proj.weight": (K * H, 2 * D),
            f"{a}o_proj.weight": (D, N * H), "midlayer.post_attention_layernorm.weight": (D,),
            f"{m}gate_proj.weight": (F, D), f"{m}up_proj.weight": (F, D),
            f"{m}down_proj.weight": (D, F), "norm.weight": (D,),
            "lm_head.weight": (cfg.draft_vocab_size, D), "d2t": (cfg.draft_vocab_size,)}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Eagle3Params:
    """The head's weights, transposed to x @ w, and its vocabulary map."""

    w_fc_3DD: jax.Array
    w_in_norm_D: jax.Array
    w_hidden_norm_D: jax.Array
    w_q_2DX: jax.Array  # X = N H
    w_k_2DY: jax.Array  # Y = K H
    w_v_2DY: jax.Array
    w_o_XD: jax.Array
    w_post_norm_D: jax.Array
    w_gate_DF: jax.Array
    w_up_DF: jax.Array
    w_down_FD: jax.Array
    w_norm_D: jax.Array
    w_head_DW: jax.Array  # W = draft vocabulary
    d2t_W: jax.Array  # int32: target id - draft id
    embed_VE: jax.Array  # the head's embedding, or the target's (E >= D, padded)


def load_eagle3(path: str | Path, target: ModelConfig, target_embed_VE, dtype=None):
    """(Eagle3Config, Eagle3Params) from a head's directory. `target_embed_VE`: the
    target's embedding table, used when the head ships no `embed_tokens`. Raises
    ValueError (CheckpointError) naming what is missing or of the wrong shape."""
    d = Path(path)
    if not (d / "config.json").is_file():
        raise ValueError(f"EAGLE-3 draft {str(path)!r}: no config.json in that directory")
    try:
        hf = json.loads((d / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{d / 'config.json'}: invalid JSON ({e})") from None
    cfg = Eagle3Config.from_hf_dict(hf, target, source=str(d / "config.json"))
    files = [SafetensorsFile(p) for p in sorted(d.glob("*.safetensors"))]
    where = {n: f for f in files for n in f.tensors}
    want = _tensor_shapes(cfg)
    if "embed_tokens.weight" in where:
        want["embed_tokens.weight"] = (cfg.vocab_size, cfg.hidden_size)
    for name, shape in want.items():
        if name not in where:
            raise CheckpointError(f"{d}: missing tensor {name!r} of the EAGLE-3 head")
        if where[name].shape(name) != shape:
            raise CheckpointError(f"{where[name].path}: tensor {name!r} has shape "
                                  f"{where[name].shape(name)}, expected {shape}")
    get = lambda n: np.asarray(where[n].get(n))
    d2t = get("d2t").astype(np.int64)
    target_ids = np.arange(cfg.draft_vocab_size) + d2t
    if target_ids.min() < 0 or target_ids.max() >= cfg.vocab_size:
        raise CheckpointError(f"{d}: d2t maps draft ids outside the target vocabulary "
                              f"[0, {cfg.vocab_size})")
    dtype = jnp.dtype(dtype or target.dtype)
    w = lambda n: jnp.asarray(get(n), dtype)
    wt = lambda n: jnp.asarray(get(n).T, dtype)
    a, m = "midlayer.self_attn.", "midlayer.mlp."
    embed = (w("embed_tokens.weight") if "embed_tokens.weight" in where
             else target_embed_VE)
    params = Eagle3Params(
        w_fc_3DD=wt("fc.weight"), w_in_norm_D=w("midlayer.input_layernorm.weight"),
        w_hidden_norm_D=w("midlayer.hidden_norm.weight"), w_q_2DX=wt(f"{a}q_proj.weight"),
        w_k_2DY=wt(f"{a}k_proj.weight"), w_v_2DY=wt(f"{a}v_proj.weight"),
        w_o_XD=wt(f"{a}o_proj.weight"),
        w_post_norm_D=w("midlayer.post_attention_layernorm.weight"),
        w_gate_DF=wt(f"{m}gate_proj.weight"), w_up_DF=wt(f"{m}up_proj.weight"),
        w_down_FD=wt(f"{m}down_proj.weight"), w_norm_D=w("norm.weight"),
        w_head_DW=wt("lm_head.weight"), d2t_W=jnp.asarray(d2t, jnp.int32), embed_VE=embed)
    return cfg, params


# ------------------------------------------------------------------ forward
def _rope_freqs(cfg: Eagle3Config):
    H = cfg.head_dim
    return 1.0 / (cfg.rope_theta ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H))


def midlayer(cfg: Eagle3Config, p: Eagle3Params, tokens_T, g_TD, kv_pages_PSJH,
             meta: AttentionMetadata, *, backend="auto"):
    """The head's layer on a ragged batch: row t is token tokens_T[t] (the token after
    the target position it stands for) with hidden g_TD[t]. Writes the rows' KV at
    meta.slots_T. Returns (h_TD the prenorm state a chained step feeds back and `logits`
    reads, kv_pages_PSJH)."""
    eps, D = cfg.rms_norm_eps, cfg.hidden_size
    N, K, H = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    T = g_TD.shape[0]
    e_TD = jnp.take(p.embed_VE, tokens_T, axis=0)[:, :D].astype(g_TD.dtype)
    x_T2D = jnp.concatenate([rms_norm(e_TD, p.w_in_norm_D, eps),
                             rms_norm(g_TD, p.w_hidden_norm_D, eps)], axis=-1)
    freqs = _rope_freqs(cfg)
    q_TNH = apply_rope(dot(x_T2D, p.w_q_2DX).reshape(T, N, H), meta.positions_T, freqs)
    k_TKH = apply_rope(dot(x_T2D, p.w_k_2DY).reshape(T, K, H), meta.positions_T, freqs)
    v_TKH = dot(x_T2D, p.w_v_2DY).reshape(T, K, H)
    k_TKH, v_TKH = repeat_to_pool(k_TKH, v_TKH, kv_pages_PSJH)  # a pool of K r heads

    def write_and_attend(cfg, kv_pages_PSJH, meta, q_TNH, k_TKH, v_TKH):
        kv_pages_PSJH = write_kv(kv_pages_PSJH, k_TKH, v_TKH, meta.slots_T)
        return attention.ragged_paged_attention(
            q_TNH, kv_pages_PSJH, meta.query_start_B1, meta.seq_lens_B, meta.page_table_BC,
            meta.num_seqs, sm_scale=H**-0.5, backend=backend), kv_pages_PSJH

    # Under data-parallel attention, on each data rank's rows and pool shard.
    o_TNH, kv_pages_PSJH = per_rank(cfg, write_and_attend, kv_pages_PSJH, meta, q_TNH,
                                    k_TKH, v_TKH)
    r_TD = g_TD + dot(o_TNH.reshape(T, N * H), p.w_o_XD)
    u_TD = rms_norm(r_TD, p.w_post_norm_D, eps)
    h_TD = r_TD + dot(jax.nn.silu(dot(u_TD, p.w_gate_DF)) * dot(u_TD, p.w_up_DF),
                      p.w_down_FD)
    return h_TD, kv_pages_PSJH


def logits(cfg: Eagle3Config, p: Eagle3Params, h_BD):
    """The head's draft-vocabulary logits (float32 [B, W]) of prenorm states h_BD."""
    return jnp.dot(rms_norm(h_BD, p.w_norm_D, cfg.rms_norm_eps), p.w_head_DW,
                   preferred_element_type=jnp.float32)


def to_target(p: Eagle3Params, draft_ids):
    """Target-vocabulary ids of draft-vocabulary ids."""
    return draft_ids + p.d2t_W[draft_ids]


def propose(cfg: Eagle3Config, p: Eagle3Params, kv_pages_PSJH, aux_T3D, tokens_T,
            meta: AttentionMetadata, last_row_B, *, k: int, backend="auto",
            num_pages_B=None, drafting_B=None):
    """k greedy drafts per sequence, in one program: an extend over the batch's rows,
    then k - 1 chained one-row steps (draft_chain.py).

    aux_T3D: the three target hidden states of each row; tokens_T: the token after each
    row (the next prompt token, or the token sampled at it); meta: the rows' ragged
    batch, as the target ran them; last_row_B: the row each sequence drafts from (its
    last row whose next token is known; padding sequences ignored). Returns (drafts_BK
    target ids, kv_pages_PSJH). Chained step s writes the KV of position
    positions_T[last_row_B] + s, where the next verification's rows will rewrite it;
    with `num_pages_B` (the pages each sequence holds), a step whose position lies past
    them writes nothing, and it and the steps after it draft -1 (no draft). Sequences
    not `drafting_B` (a prompt chunk that samples nothing) chain nothing: their KV past
    the extend is left as it is."""
    g_TD = dot(aux_T3D.reshape(aux_T3D.shape[0], 3 * cfg.hidden_size), p.w_fc_3DD)
    h_TD, kv_pages_PSJH = midlayer(cfg, p, tokens_T, g_TD, kv_pages_PSJH, meta,
                                   backend=backend)
    step = lambda tok_B, h_BD, kv, m: midlayer(cfg, p, tok_B, h_BD, kv, m, backend=backend)
    return chain_drafts(step, functools.partial(logits, cfg, p), h_TD, kv_pages_PSJH, meta,
                        last_row_B, k=k, page_size=kv_pages_PSJH.shape[1],
                        to_target=functools.partial(to_target, p), num_pages_B=num_pages_B,
                        drafting_B=drafting_B)


def propose_program(cfg: Eagle3Config, *, k: int, backend="auto"):
    """`propose` compiled: (params, kv_pages_PSJH, aux_T3D, tokens_T, meta, last_row_B)
    -> (drafts_BK, kv_pages_PSJH), the pool donated. One program per row bucket."""
    return jax.jit(functools.partial(propose, cfg, k=k, backend=backend), donate_argnums=(1,))
