"""Cost estimates of the Pallas kernels: one function per kernel family, a registry by name.

XLA cannot see inside a Pallas call: a compiled program counts one only as much as its
`pl.CostEstimate` declares, and XLA:TPU's scheduler reads that figure when it overlaps
collectives and copies with compute. So every TPU kernel declares one, built here from
its static shapes (`KernelCost.pallas()`). The GPU lowerings drop `cost_estimate`
(`plgpu.kernel` takes none), so a GPU kernel's estimate is the same function, looked
up by the kernel's name: `estimate(name, **shapes)`.

What is counted:
* flops: the useful work, 2 per multiply-add of the real rows (routed rows, query
  heads, visible keys). The MXU / tensor cores also run the padding of row tiles, which
  only matters where the kernel is bandwidth-bound anyway (tiles of few rows).
* transcendentals: one per exp (attention scores) or sigmoid (gated activations).
* bytes_accessed: what the kernel moves between HBM and its on-chip memory.

Where work depends on run-time values, the estimate assumes:
* MoE, uniform routing: each of the T tokens picks its top-k of E experts uniformly,
  every token is real (no mask). R = T*k routed rows; the expected experts with a row,
  E * (1 - (1 - k/E)^T), each have their weights read once (once per row tile when the
  kernel's grid walks weight blocks within a tile, which refetches them per tile).
* Attention, one context length for every sequence: after this step each of the B
  sequences holds `context_len` keys (default C * S, a full page table of C pages of
  S), and the T new tokens are spread evenly over the B sequences as the last ones of
  each context, attending causally. A work item of block_q tokens reads its sequence's
  pages up to its last token: the kernels walk only the pages below each sequence's
  run-time length, so the work follows the contexts, not the page table's width, and
  a static estimate must be told the contexts it assumes. Sliding windows are left out
  (an upper bound for sliding layers: the window is a traced value).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple


@dataclasses.dataclass(frozen=True, slots=True)
class KernelCost:
    flops: int
    transcendentals: int
    bytes_accessed: int

    def pallas(self):
        """As the `pl.CostEstimate` a TPU pallas_call takes."""
        from jax.experimental import pallas as pl

        return pl.CostEstimate(flops=self.flops, transcendentals=self.transcendentals,
                               bytes_accessed=self.bytes_accessed)


# Kernel names: the pallas_call names of the TPU kernels and the Triton attention
# kernels. The GPU MoE kernels reach the HLO as `mosaic_gpu` custom calls (plgpu.kernel
# names them so); gate/up and down are told apart by their weight operand, [G, D, 2F]
# against [G, F, D].
TPU_MOE_GATE_UP_GATHER = "lp_tpu_moe_gate_up_gather"
TPU_MOE_GATE_UP = "lp_tpu_moe_gate_up"  # the unfused fallback, on a sorted copy of x
TPU_MOE_DOWN = "lp_tpu_moe_down"
TPU_ATTENTION = "lp_tpu_ragged_paged_attention"
TPU_JAX_ATTENTION = "ragged_paged_attention_kernel"  # JAX's shipped kernel (tpu_jax.py)
GPU_MOE_GATE_UP = "lp_gpu_moe_gate_up"
GPU_MOE_DOWN = "lp_gpu_moe_down"
GPU_DECODE_ATTENTION = "lp_paged_decode_attention"
GPU_PREFILL_ATTENTION = "lp_paged_prefill_attention"
TPU_MLA_DECODE = "lp_tpu_mla_decode"
GPU_MLA_DECODE = "lp_paged_mla_decode"  # "lp_paged": aot.resources counts it ours


class Routing(NamedTuple):
    """What a MoE kernel's estimate needs of the routing: T tokens, top-k, E experts
    (one layer's)."""

    tokens: int
    top_k: int
    experts: int


def expected_experts(tokens: int, top_k: int, experts: int) -> float:
    """Experts with at least one row when T tokens pick top-k of E uniformly."""
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


def moe_matmul(*, tokens: int, top_k: int, experts: int, k: int, n: int, glu: bool,
               lhs_itemsize: int, w_itemsize: int, out_itemsize: int,
               bias_itemsize: int = 0, tm: int = 1, refetch_per_tile: bool = False,
               scale_bytes: int = 0) -> KernelCost:
    """One grouped matmul of the MoE over the routed rows: [R, k] @ W[e] ([k, n], or
    [k, 2n] gate | up with glu: act(gate, up) is stored, [R, n]). Uniform routing (the
    module docstring). refetch_per_tile: the weights are read once per tm-row tile, the
    expected tiles being each active expert's share of the rows in whole tiles.
    Quantized weights: w_itemsize is the stored one (1 for int8 / fp8) and scale_bytes
    those of one expert's scales, read with its weights."""
    rows = tokens * top_k
    cols = 2 * n if glu else n
    active = expected_experts(tokens, top_k, experts)
    reads = active * math.ceil(rows / active / tm) if refetch_per_tile else active
    weight_bytes = (reads * (k * cols * w_itemsize + scale_bytes)
                    + active * cols * bias_itemsize)
    return KernelCost(
        flops=2 * rows * k * cols,
        transcendentals=rows * n if glu else 0,
        bytes_accessed=round(rows * k * lhs_itemsize + rows * n * out_itemsize + weight_bytes),
    )


def _token_split(tokens: int, seqs: int) -> list[int]:
    """The new tokens of each sequence when T spread evenly over B."""
    base, extra = divmod(tokens, seqs)
    return [base + (b < extra) for b in range(seqs)]


def paged_attention(*, tokens: int, seqs: int, pages_per_seq: int, page_size: int,
                    heads: int, kv_heads: int, head_dim: int, q_itemsize: int,
                    kv_itemsize: int, block_q: int = 1, out_bytes: int | None = None,
                    context_len: int | None = None) -> KernelCost:
    """Causal paged attention of T new tokens, each sequence at `context_len` keys after
    the step (None: the full page table, C * S; the module docstring): flops 4 * N * H
    per visible (query, key) pair, one exp per pair, the K and V rows of every key an
    item sees, q in and o out (out_bytes: if the kernel writes something else, e.g.
    float32 partials)."""
    ctx = pages_per_seq * page_size
    if context_len is not None:
        if not 1 <= context_len <= ctx:
            raise ValueError(f"context_len {context_len} is outside the page table's "
                             f"1..{ctx} keys ({pages_per_seq} pages of {page_size})")
        ctx = context_len
    pairs = keys_read = 0
    for q in _token_split(tokens, seqs):
        q = min(q, ctx)
        pairs += q * (ctx - q) + q * (q + 1) // 2
        keys_read += sum(ctx - q + min(j + block_q, q) for j in range(0, q, block_q))
    qo = tokens * heads * head_dim * q_itemsize
    return KernelCost(
        flops=4 * heads * head_dim * pairs,
        transcendentals=heads * pairs,
        bytes_accessed=keys_read * 2 * kv_heads * head_dim * kv_itemsize
        + qo + (qo if out_bytes is None else out_bytes),
    )


def mla_decode(*, tokens: int, seqs: int, context: int, heads: int, latent_dim: int,
               rope_dim: int, q_itemsize: int, kv_itemsize: int,
               out_bytes: int | None = None, row_dim: int | None = None) -> KernelCost:
    """Absorbed latent attention (MLA decode kernels) of T tokens spread evenly over B
    sequences of `context` keys each after this step (the context the caller assumes),
    the tokens the last of their contexts. Per visible (token, key) pair: 2 N (A + R)
    flops for the scores and 2 N A for p @ c, one exp per head; each token reads the
    latent row of every key it sees once for all N heads (row_dim values, default A + R;
    the TPU pool pads it to whole lanes); q_lat and q_pe in, o_lat out (out_bytes: if
    the kernel writes something else, e.g. float32 partials)."""
    pairs = 0
    for q in _token_split(tokens, seqs):
        q = min(q, context)
        pairs += q * (context - q) + q * (q + 1) // 2
    out = tokens * heads * latent_dim * q_itemsize
    return KernelCost(
        flops=2 * heads * (2 * latent_dim + rope_dim) * pairs,
        transcendentals=heads * pairs,
        bytes_accessed=pairs * (row_dim or latent_dim + rope_dim) * kv_itemsize
        + tokens * heads * (latent_dim + rope_dim) * q_itemsize
        + (out if out_bytes is None else out_bytes),
    )


ESTIMATES = {
    TPU_MOE_GATE_UP_GATHER: moe_matmul,
    TPU_MOE_GATE_UP: moe_matmul,
    TPU_MOE_DOWN: moe_matmul,
    GPU_MOE_GATE_UP: moe_matmul,
    GPU_MOE_DOWN: moe_matmul,
    TPU_ATTENTION: paged_attention,
    TPU_JAX_ATTENTION: paged_attention,
    GPU_DECODE_ATTENTION: paged_attention,
    GPU_PREFILL_ATTENTION: paged_attention,
    TPU_MLA_DECODE: mla_decode,
    GPU_MLA_DECODE: mla_decode,
}


def estimate(name: str, **shapes) -> KernelCost:
    """The cost of kernel `name` at the given shapes (the keyword arguments of its
    function: `moe_matmul`, `paged_attention` or `mla_decode`)."""
    if name not in ESTIMATES:
        raise KeyError(f"no cost estimate for kernel {name!r}; known: {sorted(ESTIMATES)}")
    return ESTIMATES[name](**shapes)
