"""Per-operation FLOPs and HBM bytes of one decoder layer in one engine step, per device.

Design note. An engine step runs T tokens through a layer: `prefill_tokens` rows of
prompts (split over `prefill_seqs` sequences, each with `prefill_past` tokens already
cached) plus `decode_seqs` single-token rows with `decode_context` cached tokens each.
For every op we count useful FLOPs (2 per multiply-add) and the HBM bytes it must move
at minimum (weights once, activations in and out, KV cache read and written), then the
roofline time is max(FLOPs / peak, bytes / bandwidth) per op, summed over ops.

Parallel layout (per-device figures): a tp x ep mesh. Attention and dense MLPs are
tensor-parallel over tp (heads / width split; KV heads replicated when tp > K) and
data-parallel over ep (tokens and sequences split evenly). Routed experts are split
E/ep per device and their width F split over tp; routed rows reach their expert's
device by an all-to-all. Expected activated experts per device = E_act(T) / ep, with
E_act from the routing model over all T tokens of the step (balanced placement).
Interconnect traffic (tp all-reduces, ep all-to-all) is kept apart in `comm_bytes`,
costed at half the bidirectional link bandwidth, and assumed overlapped with the op
that produces it (an op's time is the max of compute, HBM and link time).

Simplifications, stated once: the expert MLP is fused (the T x F intermediate stays
on chip); flash attention reads each visible KV entry once per step; norms, rotary
embeddings, biases and softmax FLOPs are ignored; the router runs in the model dtype.
Tile padding of the grouped matmul is reported as `pad_flops`, wasted compute that
still costs time.

Formats (formats.py): weights move their stored bytes, scales included (the shape's weight
format), the KV cache its own itemsize, activations `dtype_bytes`; a quantized matmul runs
at the bf16 FLOP rate (W8A16 / W4A16). An explicit `dtype_bytes` argument sets all of them
to one itemsize, as before formats existed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from lp_jax.roofline.hardware import Hardware
from lp_jax.roofline.model_shape import ModelShape
from lp_jax.roofline.padding import expected_padded_rows
from lp_jax.roofline.routing import UNIFORM, Routing, active_from_probs


@dataclass(frozen=True, slots=True)
class OpCost:
    """Useful FLOPs and HBM bytes of one op on one device (plus padding and link bytes)."""

    flops: float
    bytes: float
    name: str
    pad_flops: float = 0.0  # compute wasted on tile padding
    comm_bytes: float = 0.0  # bytes sent over the interconnect

    def __post_init__(self) -> None:
        for field in ("flops", "bytes", "pad_flops", "comm_bytes"):
            value = getattr(self, field)
            if not (math.isfinite(value) and value >= -1e-6):
                raise ValueError(f"OpCost.{field} must be finite and >= 0, got {value}")
        if not self.name:
            raise ValueError("OpCost.name must be non-empty")

    @property
    def intensity(self) -> float:
        """Useful FLOPs per HBM byte."""
        return self.flops / self.bytes if self.bytes else math.inf

    def time_on(self, hardware: Hardware, efficiency: float = 1.0) -> float:
        """Roofline time: max(compute, HBM, interconnect) at `efficiency` of each peak."""
        if not 0.0 < efficiency <= 1.0:
            raise ValueError("efficiency must be in (0, 1]")
        compute = (self.flops + self.pad_flops) / (hardware.peak_flops * efficiency)
        memory = self.bytes / (hardware.hbm_bw * efficiency)
        comm = 0.0
        if self.comm_bytes > 0:
            link = 0.5 * hardware.interconnect_bw * efficiency
            comm = self.comm_bytes / link if link > 0 else math.inf
        return max(compute, memory, comm)

    def scaled(self, factor: float) -> OpCost:
        return OpCost(
            self.flops * factor,
            self.bytes * factor,
            self.name,
            self.pad_flops * factor,
            self.comm_bytes * factor,
        )

    def __add__(self, other: OpCost) -> OpCost:
        if other.name != self.name:
            raise ValueError(f"cannot add op {other.name!r} to {self.name!r}")
        return OpCost(
            self.flops + other.flops,
            self.bytes + other.bytes,
            self.name,
            self.pad_flops + other.pad_flops,
            self.comm_bytes + other.comm_bytes,
        )


@dataclass(frozen=True, slots=True)
class LayerCost:
    """The ops of one layer (or a sum of layers, merged by op name)."""

    ops: tuple[OpCost, ...]

    def __post_init__(self) -> None:
        names = [op.name for op in self.ops]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate op names in {names}")

    @property
    def flops(self) -> float:
        return sum(op.flops for op in self.ops)

    @property
    def bytes(self) -> float:
        return sum(op.bytes for op in self.ops)

    @property
    def pad_flops(self) -> float:
        return sum(op.pad_flops for op in self.ops)

    @property
    def comm_bytes(self) -> float:
        return sum(op.comm_bytes for op in self.ops)

    def op(self, name: str) -> OpCost:
        for op in self.ops:
            if op.name == name:
                return op
        raise KeyError(f"no op {name!r}; have {[op.name for op in self.ops]}")

    def time_on(self, hardware: Hardware, efficiency: float = 1.0) -> float:
        """Sum of per-op roofline times (ops run one after another)."""
        return sum(op.time_on(hardware, efficiency) for op in self.ops)

    def scaled(self, factor: float) -> LayerCost:
        return LayerCost(tuple(op.scaled(factor) for op in self.ops))

    def __add__(self, other: LayerCost) -> LayerCost:
        merged: dict[str, OpCost] = {op.name: op for op in self.ops}
        for op in other.ops:
            merged[op.name] = merged[op.name] + op if op.name in merged else op
        return LayerCost(tuple(merged.values()))


@dataclass(frozen=True, slots=True)
class StepTokens:
    """The tokens of one engine step: a prefill part and a decode part."""

    prefill_tokens: int = 0
    prefill_seqs: int = 1
    prefill_past: int = 0  # tokens of each prefill sequence already in the KV cache
    decode_seqs: int = 0
    decode_context: int = 0  # KV length per decode sequence, new token included

    def __post_init__(self) -> None:
        for field in (
            "prefill_tokens",
            "prefill_seqs",
            "prefill_past",
            "decode_seqs",
            "decode_context",
        ):
            value = getattr(self, field)
            if int(value) != value or value < 0:
                raise ValueError(f"StepTokens.{field} must be a non-negative integer")
        if self.prefill_tokens and not 1 <= self.prefill_seqs <= self.prefill_tokens:
            raise ValueError("need 1 <= prefill_seqs <= prefill_tokens")
        if self.decode_seqs and self.decode_context < 1:
            raise ValueError("decode sequences need decode_context >= 1")

    @property
    def tokens(self) -> int:
        return self.prefill_tokens + self.decode_seqs

    @property
    def prefill_chunk(self) -> float:
        """Prefill tokens per prefill sequence."""
        return self.prefill_tokens / self.prefill_seqs if self.prefill_tokens else 0.0


def _attended_pairs(past: float, chunk: float, window: int) -> float:
    """sum over chunk positions i = past+1 .. past+chunk of min(i, window) (0 = no window)."""
    if chunk <= 0:
        return 0.0
    first, last = past + 1.0, past + chunk
    if window <= 0:
        return chunk * past + chunk * (chunk + 1.0) / 2.0
    top = min(last, float(window))
    below = (first + top) * (top - first + 1.0) / 2.0 if top >= first else 0.0
    above = max(0.0, last - max(first - 1.0, float(window)))
    return below + window * above


@dataclass(frozen=True, slots=True)
class _Itemsizes:
    """Bytes per value moved: activations, expert / attention / dense-MLP weights, KV."""

    act: float
    expert: float
    attn: float
    mlp: float
    kv: float


def _itemsizes(
    shape: ModelShape, dtype_bytes: float | None, kv_dtype_bytes: float | None = None
) -> _Itemsizes:
    if dtype_bytes:  # one itemsize for everything (the pre-format behaviour)
        return _Itemsizes(dtype_bytes, dtype_bytes, dtype_bytes, dtype_bytes,
                          kv_dtype_bytes or dtype_bytes)
    d, f = shape.hidden_size, shape.dense_width
    mlp = shape.dense_mlp_bytes / (3 * d * f) if f else float(shape.dtype_bytes)
    return _Itemsizes(shape.dtype_bytes, shape.expert_weight_itemsize or shape.dtype_bytes,
                      shape.dense_weight_itemsize, mlp, kv_dtype_bytes or shape.kv_itemsize)


def _check_parallel(tp: int, ep: int) -> None:
    if tp < 1 or ep < 1 or int(tp) != tp or int(ep) != ep:
        raise ValueError("tp and ep must be positive integers")


def _attention_ops(
    shape: ModelShape, step: StepTokens, layer: int, tp: int, ep: int, sizes: _Itemsizes
) -> list[OpCost]:
    if shape.mla_ranks:
        return _mla_attention_ops(shape, step, tp, ep, sizes)
    b, kvb, wb = sizes.act, sizes.kv, sizes.attn
    d, h = shape.hidden_size, shape.head_dim
    q_dev = shape.num_q_heads / tp
    kv_dev = max(shape.num_kv_heads / tp, 1.0)
    tokens_dev = step.tokens / ep
    window = shape.sliding_window if shape.is_sliding_layer(layer) else 0
    qkv_width = (q_dev + 2.0 * kv_dev) * h

    qkv = OpCost(
        flops=2.0 * tokens_dev * d * qkv_width,
        bytes=wb * d * qkv_width + b * (tokens_dev * d + tokens_dev * qkv_width),
        name="qkv_proj",
    )

    kv_token_bytes = 2.0 * kv_dev * h * kvb  # one token's K and V on this device
    if shape.mla_ranks:  # MLA's latent, whole on every device
        kv_token_bytes = float(shape.kv_values_per_token_layer * kvb)
    seqs_dev = (step.prefill_seqs / ep) if step.prefill_tokens else 0.0
    chunk, past = step.prefill_chunk, float(step.prefill_past)
    visible_past = min(past, window - 1.0) if window else past
    attn_prefill = OpCost(
        flops=seqs_dev * 4.0 * q_dev * h * _attended_pairs(past, chunk, window),
        bytes=seqs_dev
        * (
            (visible_past + chunk) * kv_token_bytes
            + chunk * kv_token_bytes
            + 2.0 * chunk * q_dev * h * b
        ),
        name="attn_prefill",
    )

    decode_dev = step.decode_seqs / ep
    context = float(step.decode_context)
    visible = min(context, float(window)) if window else context
    attn_decode = OpCost(
        flops=decode_dev * 4.0 * q_dev * h * visible,
        bytes=decode_dev * ((visible + 1.0) * kv_token_bytes + 2.0 * q_dev * h * b),
        name="attn_decode",
    )

    o_proj = OpCost(
        flops=2.0 * tokens_dev * q_dev * h * d,
        bytes=wb * q_dev * h * d + b * (tokens_dev * q_dev * h + tokens_dev * d),
        name="o_proj",
        comm_bytes=2.0 * (tp - 1) / tp * tokens_dev * d * b,
    )
    return [qkv, attn_prefill, attn_decode, o_proj]


def _mla_attention_ops(
    shape: ModelShape, step: StepTokens, tp: int, ep: int, sizes: _Itemsizes
) -> list[OpCost]:
    """Latent attention (models/deepseek_v3.py): per token the low-rank query and the
    latent projections; decode rows absorbed, as the engine runs them (kv_b_proj folded
    into the query and the output, once a row; attention over the cached latent rows of
    A + R values); a sequence's prefill rows in whichever form needs fewer flops: expanded
    once a key (kv_b_proj over every key of the sequence, then per-head keys of qk_nope +
    rope and values of v_head_dim), cheaper for long chunks, or absorbed as decode rows
    are, cheaper below about A (H + O) / (2 A - H - O) rows a sequence (171 for
    DeepSeek-V3: verification steps, short chunks). The engine runs every row absorbed, so
    its long-prompt programs sit above this (compiled.WHY_MLA). The latent pool is whole
    on every device; heads split over tp."""
    b, kvb, wb = sizes.act, sizes.kv, sizes.attn
    Q, A, R, O = shape.mla_ranks
    d, n, H = shape.hidden_size, shape.num_q_heads / tp, shape.head_dim - R
    tokens, decode = step.tokens / ep, step.decode_seqs / ep
    q_params = d * Q + Q * n * (H + R) if Q else d * n * (H + R)
    proj, kv_b = q_params + d * (A + R), A * n * (H + O)
    qkv = OpCost(flops=2.0 * tokens * proj + 2.0 * decode * kv_b,
                 bytes=wb * (proj + kv_b) + b * tokens * (d + n * (H + R) + A + R),
                 name="qkv_proj")
    latent = (A + R) * kvb  # one cached token
    seqs = step.prefill_seqs / ep if step.prefill_tokens else 0.0
    chunk, past = step.prefill_chunk, float(step.prefill_past)
    keys = past + chunk
    pairs = _attended_pairs(past, chunk, 0)
    expanded = OpCost(
        flops=seqs * (2.0 * keys * kv_b + 2.0 * n * (H + R + O) * pairs),
        bytes=seqs * (keys * latent + 2.0 * keys * n * (H + O) * b + 2.0 * chunk * n * (H + R) * b),
        name="attn_prefill")
    absorbed = OpCost(  # W_UK into each row's query, W_UV after: kv_b once a row
        flops=seqs * (2.0 * chunk * kv_b + 2.0 * n * (2 * A + R) * pairs),
        bytes=seqs * (keys * latent + 2.0 * chunk * n * (A + R) * b),
        name="attn_prefill")
    attn_prefill = min(expanded, absorbed, key=lambda op: op.flops)
    context = float(step.decode_context)
    attn_decode = OpCost(flops=decode * 2.0 * n * (2 * A + R) * context,
                         bytes=decode * ((context + 1.0) * latent + 2.0 * n * (A + R) * b),
                         name="attn_decode")
    o_proj = OpCost(flops=2.0 * tokens * n * O * d,
                    bytes=wb * n * O * d + b * (tokens * n * O + tokens * d), name="o_proj",
                    comm_bytes=2.0 * (tp - 1) / tp * tokens * d * b)
    return [qkv, attn_prefill, attn_decode, o_proj]


def expert_traffic(
    shape: ModelShape,
    tokens: float | np.ndarray,
    *,
    tp: int = 1,
    ep: int = 1,
    routing: Routing = UNIFORM,
    dtype_bytes: int | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(FLOPs, weight bytes, activation bytes) of the expert GEMMs per device, vectorised.

    FLOPs 2 * 3 * D * F * k * T; weight bytes E_act(T) * 3 * D * F * stored itemsize (only
    the activated experts are loaded; the weight format's, scales included, split over tp);
    activation bytes k * T * D * dtype_bytes in and out. `dtype_bytes` overrides both.
    """
    _check_parallel(tp, ep)
    if not shape.is_moe:
        raise ValueError(f"{shape.name} has no routed experts")
    sizes = _itemsizes(shape, dtype_bytes)
    b, wb = sizes.act, sizes.expert
    t = np.asarray(tokens, dtype=np.float64)
    d, f_dev = shape.hidden_size, shape.expert_width / tp
    e, k = shape.num_experts, shape.top_k
    rows_dev = k * t / ep
    active_dev = np.asarray(active_from_probs(routing.probs_E(e, k), t)) / ep
    flops = 2.0 * 3.0 * d * f_dev * rows_dev
    weight_bytes = active_dev * 3.0 * d * f_dev * wb
    act_bytes = 2.0 * rows_dev * d * b
    return flops, weight_bytes, act_bytes


def expert_cost(
    shape: ModelShape,
    tokens: int,
    *,
    tp: int = 1,
    ep: int = 1,
    routing: Routing = UNIFORM,
    tile: int = 1,
    dtype_bytes: int | None = None,
) -> OpCost:
    """The routed-expert GEMMs (gate, up, down) for `tokens` tokens, per device.

    See `expert_traffic`; `tile` > 1 adds the grouped matmul's padding as `pad_flops`.
    """
    b = dtype_bytes or shape.dtype_bytes
    flops, weight_bytes, act_bytes = expert_traffic(
        shape, tokens, tp=tp, ep=ep, routing=routing, dtype_bytes=dtype_bytes
    )
    rows_dev = shape.top_k * tokens / ep
    pad_flops = 0.0
    if tile > 1 and tokens:
        p_E = routing.probs_E(shape.num_experts, shape.top_k)
        padded_dev = expected_padded_rows(p_E, int(tokens), tile) / ep
        pad_flops = float(flops) * max(0.0, padded_dev / rows_dev - 1.0)
    return OpCost(
        flops=float(flops),
        bytes=float(weight_bytes + act_bytes),
        name="experts",
        pad_flops=pad_flops,
        comm_bytes=2.0 * (tp - 1) / tp * (tokens / ep) * shape.hidden_size * b,
    )


def _mlp_ops(
    shape: ModelShape,
    step: StepTokens,
    layer: int,
    tp: int,
    ep: int,
    sizes: _Itemsizes,
    dtype_bytes: int | None,
    routing: Routing,
    tile: int,
) -> list[OpCost]:
    b = sizes.act
    d = shape.hidden_size
    tokens_dev = step.tokens / ep
    if shape.is_moe_layer(layer):
        e, k = shape.num_experts, shape.top_k
        router = OpCost(
            flops=2.0 * tokens_dev * d * e,
            bytes=b * (d * e + tokens_dev * d + tokens_dev * e),
            name="router",
            comm_bytes=2.0 * tokens_dev * k * d * b * (ep - 1) / ep,  # all-to-all out and back
        )
        experts = expert_cost(
            shape, step.tokens, tp=tp, ep=ep, routing=routing, tile=tile,
            dtype_bytes=dtype_bytes,
        )
        if not shape.shared_width:
            return [router, experts]
        # Shared experts (GLM-4.5, DeepSeek-V3): a dense SwiGLU on every token, split
        # over tp like a dense MLP.
        fs_dev = shape.shared_width / tp
        shared = OpCost(
            flops=2.0 * 3.0 * tokens_dev * d * fs_dev,
            bytes=shape.shared_mlp_bytes / tp + b * 2.0 * tokens_dev * d,
            name="shared_experts",
        )
        return [router, experts, shared]
    f_dev = shape.dense_width / tp
    mlp = OpCost(
        flops=2.0 * 3.0 * tokens_dev * d * f_dev,
        bytes=sizes.mlp * 3.0 * d * f_dev + b * 2.0 * tokens_dev * d,
        name="dense_mlp",
        comm_bytes=2.0 * (tp - 1) / tp * tokens_dev * d * b,
    )
    return [mlp]


def layer_cost(
    shape: ModelShape,
    step: StepTokens,
    *,
    layer: int = 0,
    tp: int = 1,
    ep: int = 1,
    routing: Routing = UNIFORM,
    tile: int = 1,
    dtype_bytes: int | None = None,
    kv_dtype_bytes: int | None = None,
) -> LayerCost:
    """Per-device cost of decoder layer `layer` for one step: attention ops then the MLP.

    Ops: qkv_proj, attn_prefill, attn_decode, o_proj, then router + experts (+
    shared_experts where the model has them) on a MoE layer, or dense_mlp (dense layer).
    """
    _check_parallel(tp, ep)
    sizes = _itemsizes(shape, dtype_bytes, kv_dtype_bytes)
    ops = _attention_ops(shape, step, layer, tp, ep, sizes)
    ops += _mlp_ops(shape, step, layer, tp, ep, sizes, dtype_bytes, routing, tile)
    return LayerCost(tuple(ops))


def lm_head_cost(
    shape: ModelShape,
    logits_tokens: int,
    *,
    tp: int = 1,
    ep: int = 1,
    dtype_bytes: int | None = None,
) -> OpCost:
    """The vocabulary projection for the rows that need logits (vocab split over tp)."""
    _check_parallel(tp, ep)
    b = dtype_bytes or shape.dtype_bytes
    d, v_dev = shape.hidden_size, shape.vocab_size / tp
    t_dev = logits_tokens / ep
    return OpCost(
        flops=2.0 * t_dev * d * v_dev,
        bytes=b * (d * v_dev + t_dev * d + t_dev * v_dev),
        name="lm_head",
    )


def model_step_cost(
    shape: ModelShape,
    step: StepTokens,
    *,
    tp: int = 1,
    ep: int = 1,
    routing: Routing = UNIFORM,
    tile: int = 1,
    layers: range | None = None,
    logits_tokens: int | None = None,
) -> LayerCost:
    """Sum of `layer_cost` over `layers` (default all) plus the lm_head, merged by op name.

    `logits_tokens` defaults to one row per decode sequence and per prefill sequence;
    pass 0 to leave the lm_head out.
    """
    layers = range(shape.num_layers) if layers is None else layers
    kinds: dict[tuple[bool, bool], int] = {}
    for layer in layers:
        key = (shape.is_moe_layer(layer), shape.is_sliding_layer(layer))
        kinds.setdefault(key, layer)
    total = LayerCost(())
    for key, first in kinds.items():
        count = sum(1 for i in layers if (shape.is_moe_layer(i), shape.is_sliding_layer(i)) == key)
        one = layer_cost(shape, step, layer=first, tp=tp, ep=ep, routing=routing, tile=tile)
        total = total + one.scaled(count)
    if logits_tokens is None:
        logits_tokens = step.decode_seqs + (step.prefill_seqs if step.prefill_tokens else 0)
    if logits_tokens:
        total = total + LayerCost((lm_head_cost(shape, logits_tokens, tp=tp, ep=ep),))
    return total
