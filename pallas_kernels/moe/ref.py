"""Reference MoE feed-forward in plain JAX: routing, dispatch, grouped matmul, combine.

This is the `xla` backend of `moe_ffn` and the oracle every Pallas kernel is tested
against. The steps are the ones the kernels fuse:

1. route:    float32 softmax over experts, top-k, optional renormalisation (Qwen3-MoE).
2. dispatch: order the T*A (token, expert) rows by expert; count rows per expert.
3. grouped matmul with `jax.lax.ragged_dot`: gate/up fused [E, D, 2F], SiLU(gate)*up,
   then down [E, F, D]. Rows of masked-out (padding) tokens sort after every real
   group and are not counted, so they activate no expert.
4. combine:  weighted sum of each token's A expert outputs back to [T, D].

Weights come as one layer's [E, D, 2F] / [E, F, D] (layer=None), or as a stacked
model's [L, E, D, 2F] / [L, E, F, D] plus a layer index. `stacked_experts` turns the
stacked form into [L*E, ...] (a free reshape) and the offset layer*E that the kernels
add to their expert ids, so they address the layer inside the whole array. This
reference takes the slice w[layer] instead, a copy of one layer's experts: it is the
oracle, not a path that has to be fast.

GPT-OSS experts (off by default): biases on both projections, `biases=(b_gate_up,
b_down)` with b_gate_up [E, 2F] and b_down [E, D] (stacked [L, E, 2F] / [L, E, D] with
`layer`), in the same [gate | up] order as the weights, and the clamped SwiGLU
`activation=MoEActivation("gpt_oss_clamped", limit, alpha)`. The activation is one
frozen options object, so every backend takes it as one static argument; the biases
are operands. The router bias is the model's: it is in the router logits before they
get here.

Quantized experts (issue 31, off by default): `scales=(s_gate_up, s_down)` and `scheme=`
a `pallas_kernels.quant.QuantScheme`; the weights are then int8 / float8_e4m3fn (or
MXFP4's packed int8 [.., K/2, N], two e2m1 codes a byte) and the scales float32
(MXFP4's e8m0 [.., K/32, N], rows padded to a multiple of 8 and never read), stacked
like the weights ([L, E, k, n] with `layer`),
shaped by quant.py's contract. W8A16 / W4A16: the kernels dequantise tiles on chip and
multiply the activation dtype, accumulating in float32.
This reference dequantises the layer's slice to float32 (`quant.ref_dequantize`) and
runs both matmuls in float32, storing h in the activation dtype in between as the
kernels do.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.quant import QuantScheme, check_scale, ref_dequantize, stored_bytes

ACTIVATIONS = ("silu", "gpt_oss_clamped")


@dataclasses.dataclass(frozen=True)
class MoEActivation:
    """The experts' gated activation: frozen and hashable, so a static argument of every
    backend. Called on gate and up given apart (the kernels' epilogues hold them in two
    accumulators), in float32 if given float32.

    "silu": SiLU(gate) * up (Qwen3); `limit` and `alpha` are unused. "gpt_oss_clamped"
    (transformers' GptOssExperts): gate clamped above at `limit`, up to [-limit, limit],
    then (up + 1) * gate * sigmoid(alpha * gate).
    """

    kind: str = "silu"
    limit: float = 7.0
    alpha: float = 1.702

    def __post_init__(self):
        if self.kind not in ACTIVATIONS:
            raise ValueError(f"unknown MoE activation {self.kind!r}; expected one of "
                             f"{ACTIVATIONS}")

    def __call__(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        if self.kind == "silu":
            return jax.nn.silu(gate) * up
        gate = jnp.minimum(gate, self.limit)
        up = jnp.clip(up, -self.limit, self.limit)
        return (up + 1) * (gate * jax.nn.sigmoid(gate * self.alpha))


SILU = MoEActivation()


def glu(gate_up_xF2: jax.Array, activation: MoEActivation = SILU) -> jax.Array:
    """`activation` on fused [gate | up] rows."""
    F = gate_up_xF2.shape[-1] // 2
    return activation(gate_up_xF2[..., :F], gate_up_xF2[..., F:])


def check_bias(biases, w_gate_up, w_down) -> tuple:
    """(b_gate_up, b_down), or (None, None) for no biases (None or ()). Biases come as a
    pair, shaped like the weights without their input axis."""
    if not biases:
        return None, None
    if len(biases) != 2:
        raise ValueError(f"expert biases come in pairs (b_gate_up, b_down), got {len(biases)}")
    b_gate_up, b_down = biases
    want = (w_gate_up.shape[:-2] + w_gate_up.shape[-1:], w_down.shape[:-2] + w_down.shape[-1:])
    if (b_gate_up.shape, b_down.shape) != want:
        raise ValueError(f"expert biases {b_gate_up.shape} / {b_down.shape} do not match the "
                         f"weights {w_gate_up.shape} / {w_down.shape}: want {want}")
    return b_gate_up, b_down


def check_scales(scales, scheme: QuantScheme | None, w_gate_up, w_down) -> tuple:
    """(s_gate_up, s_down), or (None, None) for 16-bit weights (scales None or ()).
    Quantized weights need both the scales and their scheme (quant.py's contract)."""
    if not scales:
        if scheme is not None:
            raise ValueError(f"scheme={scheme.name} given without scales")
        if jnp.dtype(w_gate_up.dtype).itemsize == 1 or jnp.dtype(w_down.dtype).itemsize == 1:
            raise ValueError(f"8-bit expert weights ({w_gate_up.dtype} / {w_down.dtype}) "
                             "need scales= and scheme=")
        return None, None
    if scheme is None:
        raise ValueError("scales given without a scheme (a pallas_kernels.quant.QuantScheme)")
    if len(scales) != 2:
        raise ValueError(f"expert scales come in pairs (s_gate_up, s_down), got {len(scales)}")
    s_gate_up, s_down = scales
    check_scale(w_gate_up, s_gate_up, scheme)
    check_scale(w_down, s_down, scheme)
    return s_gate_up, s_down


ROUTER_SCORES = ("softmax", "sigmoid")


@dataclasses.dataclass(frozen=True)
class Router:
    """How router logits become each token's top-k experts and their weights: frozen
    and hashable, a static argument of every backend (like `MoEActivation`).

    scoring: "softmax" over the experts (Qwen3, GPT-OSS), or "sigmoid" of each logit
      (DeepSeek-V3, GLM-4.5). A correction bias (`route`'s correction_bias_E, an
      operand) is added to the scores to *choose* the experts but not to weight them.
    n_group, topk_group: group-limited top-k. The E experts form n_group groups of
      E / n_group consecutive ids; a group scores the sum of its two best (biased)
      scores; only the topk_group best groups' experts can be chosen. n_group=1: off.
    routed_scaling_factor: multiplies the weights (after norm_topk_prob).
    """

    scoring: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    def __post_init__(self):
        if self.scoring not in ROUTER_SCORES:
            raise ValueError(f"unknown router scoring {self.scoring!r}; expected one of "
                             f"{ROUTER_SCORES}")
        if self.n_group < 1 or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"group-limited routing needs 1 <= topk_group <= n_group, got "
                             f"n_group={self.n_group}, topk_group={self.topk_group}")

    def check(self, num_experts: int, top_k: int):
        """Raises ValueError unless E splits into the groups and top_k experts fit in
        topk_group groups."""
        if num_experts % self.n_group:
            raise ValueError(f"{num_experts} experts do not split into n_group="
                             f"{self.n_group} groups")
        if top_k > self.topk_group * (num_experts // self.n_group):
            raise ValueError(f"top_k={top_k} experts do not fit in topk_group="
                             f"{self.topk_group} groups of {num_experts // self.n_group}")


SOFTMAX = Router()


def route(router_logits_TE: jax.Array, top_k: int, norm_topk_prob: bool,
          router: Router = SOFTMAX, correction_bias_E: jax.Array | None = None):
    """Returns (weights_TA float32, expert_ids_TA int32), best expert first; ties go to
    the lower expert id (`lax.top_k`).

    Softmax without groups, bias or scaling is the plain softmax top-k, bit for bit.
    Otherwise: scores (softmax or sigmoid, float32); choice = scores + correction_bias_E;
    group-limited masking of choice (experts outside the kept groups can never be
    chosen); top_k of choice; the weights are the *unbiased* scores of the chosen
    experts, renormalised if norm_topk_prob (sigmoid: sum + 1e-20, as the published
    models), times routed_scaling_factor.
    """
    logits_TE = router_logits_TE.astype(jnp.float32)
    if router == SOFTMAX and correction_bias_E is None:
        probs_TE = jax.nn.softmax(logits_TE, axis=-1)
        weights_TA, expert_ids_TA = jax.lax.top_k(probs_TE, top_k)
        if norm_topk_prob:
            weights_TA = weights_TA / jnp.sum(weights_TA, axis=-1, keepdims=True)
        return weights_TA, expert_ids_TA.astype(jnp.int32)
    T, E = logits_TE.shape
    router.check(E, top_k)
    sigmoid = router.scoring == "sigmoid"
    scores_TE = jax.nn.sigmoid(logits_TE) if sigmoid else jax.nn.softmax(logits_TE, axis=-1)
    choice_TE = scores_TE
    if correction_bias_E is not None:
        choice_TE = scores_TE + correction_bias_E.astype(jnp.float32)
    if router.n_group > 1:
        G = router.n_group
        choice_TGe = choice_TE.reshape(T, G, E // G)
        group_TG = jnp.sum(jax.lax.top_k(choice_TGe, min(2, E // G))[0], axis=-1)
        _, kept_TK = jax.lax.top_k(group_TG, router.topk_group)
        kept_TG = jnp.any(kept_TK[:, :, None] == jnp.arange(G), axis=1)
        choice_TE = jnp.where(kept_TG[:, :, None], choice_TGe, -jnp.inf).reshape(T, E)
    _, expert_ids_TA = jax.lax.top_k(choice_TE, top_k)
    weights_TA = jnp.take_along_axis(scores_TE, expert_ids_TA, axis=-1)
    if norm_topk_prob:
        eps = 1e-20 if sigmoid else 0.0
        weights_TA = weights_TA / (jnp.sum(weights_TA, axis=-1, keepdims=True) + eps)
    weights_TA = weights_TA * router.routed_scaling_factor
    return weights_TA, expert_ids_TA.astype(jnp.int32)


def dispatch(expert_ids_TA: jax.Array, num_experts: int, token_mask_T: jax.Array | None):
    """Orders (token, expert) rows by expert.

    Returns (sort_order_R, token_ids_R, group_sizes_E): row r of the sorted order is
    flat row sort_order_R[r] = token_ids_R[r] * A + slot. Masked tokens get the
    sentinel expert E, so they sort last and fall outside every group.
    """
    T, A = expert_ids_TA.shape
    ids_R = expert_ids_TA.reshape(T * A)
    if token_mask_T is not None:
        valid_R = jnp.repeat(token_mask_T.astype(bool), A)
        ids_R = jnp.where(valid_R, ids_R, num_experts)
    sort_order_R = jnp.argsort(ids_R, stable=True).astype(jnp.int32)
    token_ids_R = sort_order_R // A
    group_sizes_E = jnp.bincount(ids_R, length=num_experts + 1)[:num_experts].astype(jnp.int32)
    return sort_order_R, token_ids_R, group_sizes_E


def stacked_experts(w_gate_up, w_down, layer):
    """(w_gate_up_GDF2, w_down_GFD, group_offset) for kernels that index experts.

    layer=None: the one-layer weights [E, D, 2F] / [E, F, D], offset 0. Otherwise the
    stacked [L, E, D, 2F] / [L, E, F, D] reshaped to G = L*E groups (a bitcast, no
    copy) and offset layer*E (int32; layer may be traced): group g = offset + expert.
    """
    if layer is None:
        if w_gate_up.ndim != 3 or w_down.ndim != 3:
            raise ValueError(f"layer=None takes [E, D, 2F] / [E, F, D] weights, got "
                             f"{w_gate_up.shape} / {w_down.shape}")
        return w_gate_up, w_down, 0
    if w_gate_up.ndim != 4 or w_down.ndim != 4:
        raise ValueError(f"layer= takes stacked [L, E, D, 2F] / [L, E, F, D] weights, got "
                         f"{w_gate_up.shape} / {w_down.shape}")
    L, E = w_gate_up.shape[:2]
    if isinstance(layer, int) and not 0 <= layer < L:
        raise IndexError(f"layer {layer} out of range for {L} stacked layers")
    return (w_gate_up.reshape(L * E, *w_gate_up.shape[2:]),
            w_down.reshape(L * E, *w_down.shape[2:]),
            jnp.asarray(layer, jnp.int32) * E)


def moe_stats(group_sizes_E: jax.Array, w_gate_up: jax.Array, w_down: jax.Array,
              *biases: jax.Array | None, scales=()):
    """Expert traffic of one call: experts with at least one row are read once, whole.

    The weights (and biases, scales if given) are one layer's [E, ...] or the stacked
    [L, E, ...]: bytes per expert are those of one expert of one layer, in the dtype the
    arrays have (stored bytes, `quant.stored_bytes`: 1 per weight for int8 / fp8, half
    for MXFP4, whose int8 array has K/2 rows, plus the scales at their own width: 4 B
    float32, 1 B MXFP4's e8m0).
    """
    experts_activated = jnp.sum(group_sizes_E > 0).astype(jnp.int32)
    bytes_per_expert = sum(stored_bytes(a.shape[-2:], a.dtype)
                           for a in (w_gate_up, w_down, *scales) if a is not None)
    bytes_per_expert += sum(b.shape[-1] * b.dtype.itemsize for b in biases if b is not None)
    return {
        "tokens_per_expert": group_sizes_E,
        "experts_activated": experts_activated,
        # float32 because int32 overflows at 2 GiB and x64 is off; the engine sums
        # experts_activated in Python ints for the exact total.
        "expert_bytes_loaded": experts_activated.astype(jnp.float32) * float(bytes_per_expert),
    }


def combine(y_RD: jax.Array, sort_order_R: jax.Array, weights_TA: jax.Array, num_tokens: int):
    """Weighted sum of the sorted rows back to [T, D] (float32 accumulation)."""
    A = weights_TA.shape[1]
    w_R = weights_TA.reshape(-1)[sort_order_R]
    contrib_RD = y_RD.astype(jnp.float32) * w_R[:, None]
    return jax.ops.segment_sum(contrib_RD, sort_order_R // A, num_segments=num_tokens)


def ref_moe_ffn(
    x_TD: jax.Array,
    router_logits_TE: jax.Array,
    w_gate_up_LEDF2: jax.Array,
    w_down_LEFD: jax.Array,
    *,
    layer=None,
    top_k: int,
    norm_topk_prob: bool,
    token_mask_T: jax.Array | None = None,
    biases=None,
    activation: MoEActivation = SILU,
    scales=None,
    scheme: QuantScheme | None = None,
    router: Router = SOFTMAX,
    correction_bias_E: jax.Array | None = None,
):
    """Sort-based MoE with `jax.lax.ragged_dot`. Returns (y_TD, stats).

    With `layer`, slices w[layer] out of the stacked weights: a copy of one layer's
    experts, acceptable for the reference only (the kernels address the layer in place).
    `biases` and `activation`; `scales` and `scheme` (quantized weights, dequantised
    here to float32): see the module docstring.
    """
    stacked_experts(w_gate_up_LEDF2, w_down_LEFD, layer)  # checks the shapes
    b_gate_up, b_down = check_bias(biases, w_gate_up_LEDF2, w_down_LEFD)
    s_gate_up, s_down = check_scales(scales, scheme, w_gate_up_LEDF2, w_down_LEFD)
    if layer is None:
        w_gate_up_EDF2, w_down_EFD = w_gate_up_LEDF2, w_down_LEFD
        b_gate_up_EF2, b_down_ED = b_gate_up, b_down
        s_gate_up_Ekn, s_down_Ekn = s_gate_up, s_down
    else:
        w_gate_up_EDF2, w_down_EFD = w_gate_up_LEDF2[layer], w_down_LEFD[layer]
        b_gate_up_EF2, b_down_ED = (None, None) if b_gate_up is None else (b_gate_up[layer],
                                                                          b_down[layer])
        s_gate_up_Ekn, s_down_Ekn = (None, None) if s_gate_up is None else (s_gate_up[layer],
                                                                           s_down[layer])
    moe_stats_args = (w_gate_up_EDF2, w_down_EFD, b_gate_up_EF2, b_down_ED)
    h_dtype = w_down_EFD.dtype
    if s_gate_up is not None:  # the oracle: float32 weights, h stored as the kernels do
        w_gate_up_EDF2 = ref_dequantize(w_gate_up_EDF2, s_gate_up_Ekn, scheme)
        w_down_EFD = ref_dequantize(w_down_EFD, s_down_Ekn, scheme)
        h_dtype = x_TD.dtype
    T = x_TD.shape[0]
    E = w_gate_up_EDF2.shape[0]
    weights_TA, expert_ids_TA = route(router_logits_TE, top_k, norm_topk_prob, router,
                                      correction_bias_E)
    if token_mask_T is not None:
        weights_TA = jnp.where(token_mask_T[:, None], weights_TA, 0.0)
    sort_order_R, token_ids_R, group_sizes_E = dispatch(expert_ids_TA, E, token_mask_T)
    x_RD = x_TD[token_ids_R]
    if s_gate_up is not None:
        x_RD = x_RD.astype(jnp.float32)
    gate_up_RF2 = jax.lax.ragged_dot(x_RD, w_gate_up_EDF2, group_sizes_E)
    if b_gate_up_EF2 is not None:  # rows of masked tokens get some bias; their weight is 0
        expert_R = expert_ids_TA.reshape(-1)[sort_order_R]
        gate_up_RF2 = gate_up_RF2 + b_gate_up_EF2[expert_R].astype(gate_up_RF2.dtype)
    h_RF = glu(gate_up_RF2, activation).astype(h_dtype)
    y_RD = jax.lax.ragged_dot(h_RF.astype(w_down_EFD.dtype), w_down_EFD, group_sizes_E)
    if b_down_ED is not None:
        y_RD = y_RD + b_down_ED[expert_R].astype(y_RD.dtype)
    y_TD = combine(y_RD, sort_order_R, weights_TA, T).astype(x_TD.dtype)
    return y_TD, moe_stats(group_sizes_E, *moe_stats_args, scales=(s_gate_up, s_down))


def ref_moe_ffn_dense(
    x_TD, router_logits_TE, w_gate_up_EDF2, w_down_EFD, *, top_k, norm_topk_prob,
    token_mask_T=None, biases=None, activation: MoEActivation = SILU, scales=None,
    scheme: QuantScheme | None = None, router: Router = SOFTMAX, correction_bias_E=None,
):
    """Every expert on every token, weighted by the routing: the oracle for tests only
    (quantized weights dequantised to float32)."""
    b_gate_up, b_down = check_bias(biases, w_gate_up_EDF2, w_down_EFD)
    s_gate_up, s_down = check_scales(scales, scheme, w_gate_up_EDF2, w_down_EFD)
    if s_gate_up is not None:
        w_gate_up_EDF2 = ref_dequantize(w_gate_up_EDF2, s_gate_up, scheme)
        w_down_EFD = ref_dequantize(w_down_EFD, s_down, scheme)
    E = w_gate_up_EDF2.shape[0]
    weights_TA, expert_ids_TA = route(router_logits_TE, top_k, norm_topk_prob, router,
                                      correction_bias_E)
    if token_mask_T is not None:
        weights_TA = jnp.where(token_mask_T[:, None], weights_TA, 0.0)
    dense_w_TE = jnp.sum(jax.nn.one_hot(expert_ids_TA, E) * weights_TA[..., None], axis=1)
    x32 = x_TD.astype(jnp.float32)
    gate_up_TEF2 = jnp.einsum("td,edf->tef", x32, w_gate_up_EDF2.astype(jnp.float32))
    if b_gate_up is not None:
        gate_up_TEF2 = gate_up_TEF2 + b_gate_up.astype(jnp.float32)
    h_TEF = glu(gate_up_TEF2, activation)
    y_TED = jnp.einsum("tef,efd->ted", h_TEF, w_down_EFD.astype(jnp.float32))
    if b_down is not None:
        y_TED = y_TED + b_down.astype(jnp.float32)
    return jnp.einsum("ted,te->td", y_TED, dense_w_TE).astype(x_TD.dtype)
