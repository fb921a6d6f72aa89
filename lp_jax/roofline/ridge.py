"""The ridge-point recheck: when does a MoE layer turn compute-bound, and what does
chunking cost in expert-weight traffic?

Design note. Three analyses, all per device and per MoE layer unless stated:

1. Compute-bound token count. The expert GEMMs do 2*3*D*F*k*T FLOPs. The paper's simple
   intensity loads all E experts: I(T) = 2*k*T / (E * itemsize), i.e. tokens per expert
   k*T/E for bf16, so the crossing is T* = ridge * E * itemsize / (2k) (= ridge * E/k for
   bf16). itemsize w is the experts' stored bytes per weight, scales included (the
   shape's weight format: 1 + 4/K for per-channel int8 / fp8, 0.53125 for MXFP4), while
   the FLOPs stay those of the bf16 matmul the W8A16 kernels run. The exact form loads
   only E_act(T) experts and also moves the routed rows in the activation itemsize a:
   I(T) = 6*D*F*k*T / (3*D*F*E_act(T)*w + 2*k*T*D*a). I(T) rises monotonically
   (E_act(T)/T falls) towards 3F/a, and we bisect for the crossing; if 3F/a is below the
   ridge the layer never turns compute-bound (inf). While all E experts are active the
   crossing is T* = 3*ridge*E*F*w / (2k*(3F - a*ridge)): proportional to w, so fp8 halves
   it; the asymptote 3F/a does not move with w, so a chip whose ridge is above it stays
   memory-bound in every weight format.
2. Fig. 2 of the paper: one prompt of L tokens prefilled with chunk c loads each MoE
   layer's activated experts ceil(L/c) times, so expert bytes ~ L/c * E_act(c) * bytes
   per expert: inversely proportional to c once E_act(c) ~ E. Layered prefill runs each
   layer over all L tokens once (G groups over G iterations), so its expert bytes equal
   those of the largest chunk, c = L, while one iteration carries only 1/G of the layers.
3. Marginal traffic next to a decode batch of B tokens: the decode rows already activate
   E_act(B) experts, so a prefill of T tokens adds only E_act(B + T) - E_act(B). Under
   uniform routing that is E * (1-k/E)^B * (1 - (1-k/E)^T): the absolute saving of
   layered prefill shrinks like (1-k/E)^B as B*k approaches E.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lp_jax.roofline.cost_model import expert_cost, expert_traffic
from lp_jax.roofline.hardware import Hardware
from lp_jax.roofline.model_shape import ModelShape
from lp_jax.roofline.routing import UNIFORM, Routing, expected_active

PAPER_CHUNKS: tuple[int, ...] = (256, 512, 1024, 2048, 4096, 8192)


def tokens_per_expert(shape: ModelShape, tokens: float | np.ndarray) -> float | np.ndarray:
    """k * T / E: mean routed rows per expert; the paper's intensity I(T) for bf16."""
    return shape.top_k * np.asarray(tokens, dtype=np.float64) / shape.num_experts


def moe_intensity(
    shape: ModelShape,
    tokens: float | np.ndarray,
    *,
    routing: Routing = UNIFORM,
    exact: bool = True,
    tp: int = 1,
    ep: int = 1,
) -> float | np.ndarray:
    """FLOP per HBM byte of the expert GEMMs at `tokens` tokens per layer step.

    exact=False: the paper's form, all E experts' weights and no activations,
    2*k*T / (E*itemsize). exact=True: E_act(T) experts' weights plus routed rows.
    """
    t = np.asarray(tokens, dtype=np.float64)
    if exact:
        flops, weight_bytes, act_bytes = expert_traffic(shape, t, tp=tp, ep=ep, routing=routing)
        out = flops / (weight_bytes + act_bytes)
    else:
        out = 2.0 * shape.top_k * t / (shape.num_experts * shape.expert_weight_itemsize)
    return float(out) if np.ndim(out) == 0 else out


@dataclass(frozen=True, slots=True)
class ComputeBound:
    """Tokens per layer step at which the expert GEMMs reach the hardware's ridge point."""

    hardware: str
    ridge: float  # FLOP/B
    simple_tokens: float  # ridge * E * itemsize / (2k)
    exact_tokens: float  # crossing with E_act(T) and activations (inf if never)

    def __post_init__(self) -> None:
        if self.ridge <= 0 or self.simple_tokens <= 0 or self.exact_tokens <= 0:
            raise ValueError("ComputeBound figures must be positive")


def compute_bound_tokens(
    shape: ModelShape,
    hardware: Hardware,
    *,
    routing: Routing = UNIFORM,
    tp: int = 1,
    ep: int = 1,
) -> ComputeBound:
    """Smallest tokens-per-step T at which the MoE layer is compute-bound on `hardware`."""
    ridge = hardware.ridge_point
    simple = ridge * shape.num_experts * shape.expert_weight_itemsize / (2.0 * shape.top_k)

    def intensity(t: float) -> float:
        return float(moe_intensity(shape, t, routing=routing, tp=tp, ep=ep))

    lo, hi = 1.0, 1e12
    if intensity(hi) < ridge:
        exact = math.inf
    elif intensity(lo) >= ridge:
        exact = lo
    else:
        for _ in range(200):
            mid = math.sqrt(lo * hi)
            if intensity(mid) >= ridge:
                hi = mid
            else:
                lo = mid
            if hi / lo < 1 + 1e-12:
                break
        exact = hi
    return ComputeBound(hardware.name, ridge, simple, exact)


@dataclass(frozen=True, slots=True)
class ChunkRow:
    """One row of the Fig. 2 table: a prompt prefilled with one chunk size, or layered."""

    label: str
    chunk: int  # tokens each MoE layer sees per iteration
    iterations: int  # iterations to finish the prompt
    active_experts: float  # mean activated experts per layer per iteration
    expert_bytes: float  # expert weight bytes loaded over the whole prompt, all MoE layers
    moe_seconds: float  # roofline expert-GEMM time over the whole prompt
    step_moe_seconds: float  # the heaviest iteration's expert-GEMM time
    pad_fraction: float  # padded FLOPs / useful FLOPs

    def __post_init__(self) -> None:
        if self.chunk < 1 or self.iterations < 1:
            raise ValueError("chunk and iterations must be >= 1")


def _chunk_sizes(prompt_len: int, chunk: int) -> list[int]:
    sizes = [chunk] * (prompt_len // chunk)
    if prompt_len % chunk:
        sizes.append(prompt_len % chunk)
    return sizes


def layered_groups(prompt_len: int, target: int = 512) -> int:
    """The paper's G(L) = max(1, ceil(L / 512))."""
    return max(1, math.ceil(prompt_len / target))


def fig2_table(
    shape: ModelShape,
    hardware: Hardware,
    *,
    prompt_len: int = 8192,
    chunks: Sequence[int] = PAPER_CHUNKS,
    groups: int | None = None,
    routing: Routing = UNIFORM,
    tp: int = 1,
    ep: int = 1,
    tile: int = 1,
    efficiency: float = 1.0,
) -> tuple[ChunkRow, ...]:
    """Expert bytes and MoE time for one prompt, chunked at each size, then layered."""
    if prompt_len < 1 or any(c < 1 for c in chunks):
        raise ValueError("prompt_len and chunks must be >= 1")
    moe_layers = shape.num_moe_layers
    cache: dict[int, tuple[float, float, float, float, float]] = {}

    def per_layer(tokens: int) -> tuple[float, float, float, float, float]:
        if tokens not in cache:
            op = expert_cost(shape, tokens, tp=tp, ep=ep, routing=routing, tile=tile)
            _, weight_bytes, _ = expert_traffic(shape, tokens, tp=tp, ep=ep, routing=routing)
            active = expected_active(routing, shape.num_experts, shape.top_k, tokens)
            cache[tokens] = (
                float(weight_bytes),
                op.time_on(hardware, efficiency),
                float(active),
                op.pad_flops,
                op.flops,
            )
        return cache[tokens]

    rows = []
    for chunk in chunks:
        sizes = _chunk_sizes(prompt_len, min(chunk, prompt_len))
        stats = [per_layer(s) for s in sizes]
        rows.append(
            ChunkRow(
                label=f"chunk {chunk}",
                chunk=min(chunk, prompt_len),
                iterations=len(sizes),
                active_experts=sum(s[2] for s in stats) / len(stats),
                expert_bytes=moe_layers * sum(s[0] for s in stats),
                moe_seconds=moe_layers * sum(s[1] for s in stats),
                step_moe_seconds=moe_layers * max(s[1] for s in stats),
                pad_fraction=sum(s[3] for s in stats) / max(sum(s[4] for s in stats), 1e-300),
            )
        )
    g = groups or layered_groups(prompt_len)
    weight_bytes, seconds, active, pad, flops = per_layer(prompt_len)
    rows.append(
        ChunkRow(
            label=f"layered G={g}",
            chunk=prompt_len,
            iterations=g,
            active_experts=active,
            expert_bytes=moe_layers * weight_bytes,
            moe_seconds=moe_layers * seconds,
            step_moe_seconds=math.ceil(moe_layers / g) * seconds,
            pad_fraction=pad / max(flops, 1e-300),
        )
    )
    return tuple(rows)


@dataclass(frozen=True, slots=True)
class MarginalTraffic:
    """Experts a prefill adds on top of those a co-running decode batch already loads."""

    decode_seqs: int
    prefill_tokens: int
    decode_active: float  # E_act(B)
    union_active: float  # E_act(B + T)
    marginal_active: float  # E_act(B + T) - E_act(B)
    marginal_bytes: float  # their weight bytes, per MoE layer, per device


def marginal_expert_traffic(
    shape: ModelShape,
    decode_seqs: int,
    prefill_tokens: int,
    *,
    routing: Routing = UNIFORM,
    tp: int = 1,
    ep: int = 1,
) -> MarginalTraffic:
    """Expert bytes activated by `prefill_tokens` rows that `decode_seqs` rows did not."""
    if decode_seqs < 0 or prefill_tokens < 0:
        raise ValueError("token counts must be >= 0")
    e, k = shape.num_experts, shape.top_k
    decode = float(expected_active(routing, e, k, decode_seqs))
    union = float(expected_active(routing, e, k, decode_seqs + prefill_tokens))
    per_expert_dev = shape.expert_bytes / tp / ep
    return MarginalTraffic(
        decode_seqs=decode_seqs,
        prefill_tokens=prefill_tokens,
        decode_active=decode,
        union_active=union,
        marginal_active=union - decode,
        marginal_bytes=(union - decode) * per_expert_dev,
    )


@dataclass(frozen=True, slots=True)
class LayeredSaving:
    """Marginal expert bytes of one prompt next to a decode batch: chunked vs layered."""

    decode_seqs: int
    chunk: int
    chunked_bytes: float  # sum over chunks of marginal bytes, all MoE layers
    layered_bytes: float  # marginal bytes of the whole prompt once per layer
    saved_bytes: float
    saved_fraction: float


def layered_marginal_saving(
    shape: ModelShape,
    decode_seqs: int,
    *,
    prompt_len: int = 8192,
    chunk: int = 512,
    routing: Routing = UNIFORM,
    tp: int = 1,
    ep: int = 1,
) -> LayeredSaving:
    """How much expert traffic layered prefill saves over chunked, given a decode batch."""
    layers = shape.num_moe_layers
    chunked = layers * sum(
        marginal_expert_traffic(shape, decode_seqs, s, routing=routing, tp=tp, ep=ep).marginal_bytes
        for s in _chunk_sizes(prompt_len, chunk)
    )
    layered = (
        layers
        * marginal_expert_traffic(
            shape, decode_seqs, prompt_len, routing=routing, tp=tp, ep=ep
        ).marginal_bytes
    )
    saved = chunked - layered
    return LayeredSaving(
        decode_seqs=decode_seqs,
        chunk=chunk,
        chunked_bytes=chunked,
        layered_bytes=layered,
        saved_bytes=saved,
        saved_fraction=saved / chunked if chunked > 0 else 0.0,
    )
