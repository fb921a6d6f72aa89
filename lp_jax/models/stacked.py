"""The stacked causal LM shell that every model family shares, shaped for layer-range
execution.

Unlike the checkpoint, layer parameters are *stacked* along a leading layer axis:
`run_layers(x, kv, meta, start, end)` loops over any layer range [start, end), which is
what layered prefill needs (one layer group per iteration for the prefill tokens, all
layers for decode tokens). The bounds are in operator units (`run_units`: unit 2i is
layer i's attention half, 2i + 1 its MLP half) and may be traced scalars, so one
compiled program serves every range.

What does not depend on the architecture lives here: the checkpoint's `model.` shell
(`DecoderModel`: `embed_tokens`, the stacked `layers`, `norm`), the head, the attention
half around a model's projections, and the operator-unit loop (`StackedCausalLM`). A
model family (qwen3_moe.py, gpt_oss.py) supplies its decoder-layer stack and `_qkv`,
`_o_proj` and `_mlp`. The KV pool's layout is in kv_cache.py, the building blocks
(parameters, RMSNorm, RoPE) in layers.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from lp_jax.config import ModelConfig
from lp_jax.models.backends import KernelBackends
from lp_jax.models.data_ranks import per_rank
from lp_jax.models.kv_cache import layer_kv_scales, layer_pages, layer_slots, repeat_to_pool
from lp_jax.models.layers import param, rms_norm
from lp_jax.models.metadata import AttentionMetadata
from lp_jax.models.sequence_parallel import constrain
from lp_jax.models.sharded_kernels import (
    is_pallas_attention,
    kernel_mesh,
    sharded_decode_attention,
    sharded_ragged_paged_attention,
)
from pallas_kernels import attention
from pallas_kernels.attention import is_fp8, write_kv


def embed_width(cfg: ModelConfig) -> int:
    """Columns of the embedding table: hidden_size rounded up to 128 lanes, the padding
    zero (loader.py). XLA:TPU copies a whole [V, D] table before a row gather when D is
    not a multiple of 128 (GPT-OSS-20B: 2880, a 1.1 GB copy per step); the padded table
    is gathered in place, and `embed` drops the padding columns."""
    return -(-cfg.hidden_size // 128) * 128


class DecoderModel(nnx.Module):
    """The checkpoint's `model.`: `embed_tokens` [V, embed_width], the stacked decoder
    layers of the model family (`decoder_layers(cfg, dtype, rngs=)`: Qwen3MoeDecoderLayers,
    GptOssDecoderLayers) and the final `norm`; Qwen3MoeModel and GptOssModel in HF."""

    def __init__(self, cfg: ModelConfig, decoder_layers: type[nnx.Module], dtype, *,
                 rngs: nnx.Rngs):
        V, D = cfg.vocab_size, cfg.hidden_size
        self.embed_tokens = param(rngs, (V, embed_width(cfg)), ("vocab", "embed"), dtype,
                                  fan_in=D)
        self.layers = decoder_layers(cfg, dtype, rngs=rngs)
        self.norm = param(rngs, (D,), ("embed",), dtype, ones=True)


class StackedCausalLM(nnx.Module):
    """The architecture-independent part of a stacked decoder: embedding, final norm
    and head, the attention half of a layer around the model's projections, and the
    operator-unit loop. A model passes its decoder-layer stack (with `input_layernorm`,
    `post_attention_layernorm`, `self_attn.q_proj`) to `__init__` and supplies `_qkv`,
    `_o_proj` and `_mlp`; `_attention_extras` and `_norm` have defaults."""

    config: ModelConfig

    def __init__(self, cfg: ModelConfig, decoder_layers: type[nnx.Module], *,
                 rngs: nnx.Rngs, dtype=None):
        dtype = jnp.dtype(dtype or cfg.dtype)
        self.config = cfg
        self.dtype = dtype
        self.model = DecoderModel(cfg, decoder_layers, dtype, rngs=rngs)
        self.lm_head = None if cfg.tie_word_embeddings else param(
            rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), dtype)

    def serving_backends(self, backends: KernelBackends) -> KernelBackends:
        """The kernel backends this model's layers run with, given those asked for (a
        model whose features a backend lacks swaps it; the executor sizes the KV pool
        for the result, see `packs_kv`)."""
        return backends

    # ----------------------------------------------------------------- pieces
    def embed(self, token_ids_T: jax.Array) -> jax.Array:
        x_TX = jnp.take(self.model.embed_tokens[...], token_ids_T, axis=0)
        return x_TX[:, : self.config.hidden_size]  # the padding columns (embed_width)

    def _norm(self, x_TD, weight):
        return rms_norm(x_TD, weight, self.config.rms_norm_eps)

    def compute_logits(self, x_TD: jax.Array) -> jax.Array:
        """Final RMSNorm and lm_head; float32 logits [T, V]."""
        h_TD = self._norm(x_TD, self.model.norm[...])
        if self.lm_head is None:
            w_VX = self.model.embed_tokens[...]
            h_TX = jnp.pad(h_TD, ((0, 0), (0, w_VX.shape[1] - h_TD.shape[1])))
            return jnp.einsum("tx,vx->tv", h_TX, w_VX, preferred_element_type=jnp.float32)
        return jnp.dot(h_TD, self.lm_head[...], preferred_element_type=jnp.float32)

    def _qkv(self, i, h_TD, positions_T):
        """Layer i's q_TNH, k_TKH, v_TKH from the normed hidden states, RoPE applied."""
        raise NotImplementedError

    def _o_proj(self, i, o_TX):
        """Layer i's output projection of the attention output [T, N*H]."""
        raise NotImplementedError

    def _row_axis(self, rows: int):
        """(mesh, axis) when the residual stream of a `rows`-row step splits over the
        rows (sequence_parallel.py), else None: the stream stays replicated."""
        return None

    def _attention_extras(self, i) -> dict:
        """Attention keyword arguments of layer i (GPT-OSS: `sinks_N`, `sliding_window`,
        traced); {} for none."""
        return {}

    def _mlp(self, i, x_TD, token_mask_T, backends: KernelBackends):
        """MLP half of layer i with its residual: (x_TD, experts activated)."""
        raise NotImplementedError

    def _attention(self, i, x_TD, kv_pages_PSJH, meta: AttentionMetadata, decode_only, backend):
        """Attention half of layer i (a traced index): pre-norm, projections, RoPE, KV write,
        paged attention, output projection and residual."""
        cfg = self.config
        T = x_TD.shape[0]
        N, H = cfg.num_attention_heads, cfg.head_dim
        # The projections are XLA dots on w[i]: XLA addresses the layer in place (TPU
        # operand fusion, GPU dynamic-slice fusion); `python -m lp_jax.aot` audits it.
        h_TD = self._norm(x_TD, self.model.layers.input_layernorm[i])
        split = self._row_axis(T)
        if split is not None:  # the normed rows of every chip, to every chip
            h_TD = constrain(h_TD, split[0], None)
        q_TNH, k_TKH, v_TKH = self._qkv(i, h_TD, meta.positions_T)
        k_TKH, v_TKH = repeat_to_pool(k_TKH, v_TKH, kv_pages_PSJH)  # a pool of K r heads

        # An FP8 pool (kv_cache.py): the layer's k_scale / v_scale quantise here and
        # dequantise in the kernel; {} for a 16-bit pool.
        scales = layer_kv_scales(cfg, i) if is_fp8(kv_pages_PSJH) else {}

        def write_and_attend(cfg, kv_pages_PSJH, meta, q_TNH, k_TKH, v_TKH):
            # Logical pages -> this layer's physical pages in the shared pool.
            P_total, S = kv_pages_PSJH.shape[:2]
            slots_T = layer_slots(cfg, i, meta.slots_T, P_total, S)
            kv_pages_PSJH = write_kv(kv_pages_PSJH, k_TKH, v_TKH, slots_T, **scales)
            page_table_BC = layer_pages(cfg, i, meta.page_table_BC, P_total)
            return self._attend(i, q_TNH, kv_pages_PSJH, meta, page_table_BC, decode_only,
                                backend, scales), kv_pages_PSJH

        # Under data-parallel attention, on each data rank's rows and pool shard.
        o_TNH, kv_pages_PSJH = per_rank(cfg, write_and_attend, kv_pages_PSJH, meta, q_TNH,
                                        k_TKH, v_TKH)
        o_TD = self._o_proj(i, o_TNH.reshape(T, N * H))
        if split is not None:  # the partial sums reduce-scattered to the row shards
            o_TD = constrain(o_TD, *split)
        return x_TD + o_TD, kv_pages_PSJH

    def _attend(self, i, q_TNH, kv_pages_PSJH, meta, page_table_BC, decode_only, backend,
                scales=None):
        """Paged attention. `decode_only` (a bool, or a traced bool chosen per call) picks a
        backend's decode kernel where it has one distinct from its ragged kernel.
        `scales`: an FP8 pool's {k_scale, v_scale} of layer i."""
        sm_scale = self.config.head_dim**-0.5
        extras = self._attention_extras(i) | (scales or {})
        # A Pallas kernel on a multi-device mesh runs per head shard (GSPMD would
        # gather the whole pool onto every device); see sharded_kernels.
        attn = self.model.layers.self_attn
        mesh = kernel_mesh(attn.q_proj[...]) if is_pallas_attention(backend) else None

        def ragged():
            if mesh is None:
                return attention.ragged_paged_attention(
                    q_TNH, kv_pages_PSJH, meta.query_start_B1, meta.seq_lens_B,
                    page_table_BC, meta.num_seqs, sm_scale=sm_scale, backend=backend,
                    **extras)
            return sharded_ragged_paged_attention(
                mesh, q_TNH, kv_pages_PSJH, meta.query_start_B1, meta.seq_lens_B,
                page_table_BC, meta.num_seqs, sm_scale=sm_scale, backend=backend, **extras)

        # The XLA reference serves decode through its ragged path; the kernels' decode
        # entry points take one query row per sequence.
        if decode_only is False or not is_pallas_attention(backend):
            return ragged()

        def decode():
            # One token per sequence: the first B rows (B = page-table rows) are the queries.
            B, T = meta.seq_lens_B.shape[0], q_TNH.shape[0]
            o_BNH = sharded_decode_attention(mesh, q_TNH[:B], kv_pages_PSJH, meta.seq_lens_B,
                                             page_table_BC, sm_scale=sm_scale, backend=backend,
                                             **extras)
            return jnp.pad(o_BNH, ((0, T - B), (0, 0), (0, 0)))

        if decode_only is True:
            return decode()
        return jax.lax.cond(decode_only, decode, ragged)

    # ------------------------------------------------------------- layer range
    def run_layers(self, x_TD, kv_pages_PSJH, meta, start, end, *, decode_only=False,
                   backends: KernelBackends = KernelBackends()):
        """Runs decoder layers [start, end): `run_units` over units [2 start, 2 end)."""
        return self.run_units(x_TD, kv_pages_PSJH, meta, 2 * start, 2 * end,
                              decode_only=decode_only, backends=backends)

    def run_units(
        self,
        x_TD: jax.Array,
        kv_pages_PSJH: jax.Array,
        meta: AttentionMetadata,
        lo,
        hi,
        *,
        decode_only=False,
        backends: KernelBackends = KernelBackends(),
        aux_layers: tuple[int, ...] = (),
        aux_NAD: jax.Array | None = None,
    ):
        """Runs operator units [lo, hi) on x_TD: unit 2i is layer i's attention half, unit
        2i + 1 its MLP half, so a range may start or stop between a layer's two halves.

        Returns (x_TD, kv_pages_PSJH, experts_activated): the last is the number of
        experts the real tokens activated, summed over the range's MoE layers.
        `lo` and `hi` may be Python ints or traced int32 scalars: one loop body serves
        every layer (the weights are indexed by the loop counter), so one compiled program
        runs any range it is given. The loop covers layers [lo // 2, ceil(hi / 2)); a half
        outside [lo, hi) (only possible in the first and last layer) is skipped by a
        `lax.cond` on the unit: it writes no KV, activates no expert, leaves x unchanged
        and costs nothing, so a one-unit segment (FlowPrefill's operator granularity)
        computes one half. The KV pool passes through the untaken branch in place (no
        copy: the AOT audit checks the compiled programs).

        With `aux_layers` (A static layer ids) and `aux_NAD`, the residual stream entering
        each of those layers whose attention half runs here is kept in aux_NAD[:, j]
        (an EAGLE-3 draft's inputs, lp_jax/models/eagle3.py), and the result gains it as a
        fourth element: rows carried between calls carry their aux states too.
        """
        L2 = 2 * self.config.num_hidden_layers
        if isinstance(lo, int) and isinstance(hi, int) and not 0 <= lo <= hi <= L2:
            raise ValueError(f"unit range [{lo}, {hi}) outside [0, {L2})")
        token_mask_T = meta.token_mask()

        def layer(i, carry):
            x, kv, n, *aux = carry
            for j, at in enumerate(aux_layers):  # the layer's input, if it runs here
                aux[0] = aux[0].at[:, j].set(
                    jnp.where((i == at) & (2 * i >= lo), x, aux[0][:, j]))
            x, kv = jax.lax.cond(
                2 * i >= lo,
                lambda x, kv: self._attention(i, x, kv, meta, decode_only, backends.attention),
                lambda x, kv: (x, kv), x, kv)
            x, activated = jax.lax.cond(
                2 * i + 1 < hi, lambda x: self._mlp(i, x, token_mask_T, backends),
                lambda x: (x, jnp.int32(0)), x)
            return x, kv, n + activated, *aux

        aux = (aux_NAD,) if aux_layers else ()
        split = self._row_axis(x_TD.shape[0])
        if split is not None:  # each chip keeps its rows of the stream through the loop
            x_TD = constrain(x_TD, *split)
        x_TD, *rest = jax.lax.fori_loop(lo // 2, (hi + 1) // 2, layer,
                                        (x_TD, kv_pages_PSJH, jnp.int32(0), *aux))
        if split is not None:
            x_TD = constrain(x_TD, split[0], None)
        return (x_TD, *rest)
