"""MoE in plain XLA that costs what the routing costs: the CPU execution path.

`jax.lax.ragged_dot` is the reference, but XLA:CPU lowers it to a dense matmul
against every expert (E/k times the real work; BENCHMARKS.md has the measurement),
which would make CPU timings blind to routing. This path uses the kernels' tile layout
(`layout.py`): rows sorted by expert and padded to `tm`-row tiles, then a loop over
the tiles in use only, each tile multiplying by its own expert's weights. Work and
weight reads scale with the rows and the activated experts, as on an accelerator.

Stacked weights [L, E, ...] are reshaped (for free) to [L*E, ...] and a tile of
expert e reads group layer*E + e: each tile indexes one expert of one layer out of
the whole array, never a copy of the layer. Expert biases and the activation (GPT-OSS)
are as in `ref.ref_moe_ffn`; the biases are addressed the same way.

Quantized experts (`scales`, `scheme`: quant.py's contract): each tile dequantises its
own expert's weights to float32 (one expert, [D, 2F] / [F, D], never a layer) and
multiplies in float32; h is stored in the activation dtype, as the kernels store it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.moe.layout import combine_padded, make_tile_layout
from pallas_kernels.moe.ref import (
    SILU,
    SOFTMAX,
    MoEActivation,
    Router,
    check_bias,
    check_scales,
    glu,
    moe_stats,
    route,
    stacked_experts,
)
from pallas_kernels.quant import QuantScheme, ref_dequantize

TILE_ROWS = 32


def moe_ffn_xla_tiles(x_TD, router_logits_TE, w_gate_up_LEDF2, w_down_LEFD, *, layer=None,
                      top_k, norm_topk_prob, token_mask_T=None, biases=None,
                      activation: MoEActivation = SILU, scales=None,
                      scheme: QuantScheme | None = None, router: Router = SOFTMAX,
                      correction_bias_E=None, tm: int = TILE_ROWS):
    D = x_TD.shape[1]
    w_gate_up_GDF2, w_down_GFD, group_offset = stacked_experts(
        w_gate_up_LEDF2, w_down_LEFD, layer)
    b_gate_up, b_down = check_bias(biases, w_gate_up_LEDF2, w_down_LEFD)
    if b_gate_up is not None:  # [L*E, ...] like the weights: a free reshape
        b_gate_up_GF2 = b_gate_up.reshape(-1, b_gate_up.shape[-1])
        b_down_GD = b_down.reshape(-1, b_down.shape[-1])
    s_gate_up, s_down = check_scales(scales, scheme, w_gate_up_LEDF2, w_down_LEFD)
    s_gate_up_Gkn = s_down_Gkn = None
    if s_gate_up is not None:  # [L*E, k, n] like the weights
        s_gate_up_Gkn = s_gate_up.reshape(-1, *s_gate_up.shape[-2:])
        s_down_Gkn = s_down.reshape(-1, *s_down.shape[-2:])

    def expert(w_G, s_G, g):
        """Expert g's weights, dequantised to float32 when quantized."""
        return w_G[g] if s_gate_up is None else ref_dequantize(w_G[g], s_G[g], scheme)

    h_dtype = w_down_GFD.dtype if s_gate_up is None else x_TD.dtype
    E = w_gate_up_LEDF2.shape[-3]
    weights_TA, expert_ids_TA = route(router_logits_TE, top_k, norm_topk_prob, router,
                                      correction_bias_E)
    layout = make_tile_layout(expert_ids_TA, E, token_mask_T, tm)
    x_MtD = x_TD[layout.token_ids_P].reshape(-1, tm, D)

    def tile(m, y_MtD):
        g = layout.tile_group_M[m] + group_offset
        w_gate_up_DF2 = expert(w_gate_up_GDF2, s_gate_up_Gkn, g)
        gate_up_tF2 = jnp.dot(x_MtD[m], w_gate_up_DF2, preferred_element_type=jnp.float32)
        if b_gate_up is not None:
            gate_up_tF2 = gate_up_tF2 + b_gate_up_GF2[g].astype(jnp.float32)
        h_tF = glu(gate_up_tF2, activation).astype(h_dtype)
        w_down_FD = expert(w_down_GFD, s_down_Gkn, g)
        y_tD = jnp.dot(h_tF, w_down_FD, preferred_element_type=jnp.float32)
        if b_down is not None:
            y_tD = y_tD + b_down_GD[g].astype(jnp.float32)
        return y_MtD.at[m].set(y_tD.astype(y_MtD.dtype))

    y_MtD = jax.lax.fori_loop(0, layout.num_tiles, tile, jnp.zeros_like(x_MtD))
    y_TD = combine_padded(y_MtD.reshape(-1, D), layout, weights_TA).astype(x_TD.dtype)
    return y_TD, moe_stats(layout.group_sizes_E, w_gate_up_LEDF2, w_down_LEFD,
                           b_gate_up, b_down, scales=(s_gate_up, s_down))
