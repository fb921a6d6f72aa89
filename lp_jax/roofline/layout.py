"""What lp_jax's parallel layout puts on each chip of a slice, and what it moves between
chips: the roofline's and the simulator's view of a mesh (data, expert, tensor).

The engine's layout (lp_jax/sharding.py's LOGICAL_RULES): attention heads, the vocabulary
(embedding and lm_head) and dense MLPs split over the t chips of "tensor"; the experts
over "expert" x "tensor", n = e t chips; every chip sees every token (attention is
replicated over "expert"); the KV pool's heads split over t, each of the K KV heads kept
t / K times when t > K (`sharding.kv_head_replicas`), so a chip holds K / t heads, or one;
a K that t does not fit keeps all K on every chip. Per chip, at T rows a step:

* weights: attention / t (k/v projections with the pool's copies of each head), experts
  / n, embedding and lm_head / t (when t divides V); norms and the router whole;
* KV bytes a token (all layers), and the KV room: tokens of KV that fit beside the
  weights in HBM x utilization - reserve (the pool is one array; each chip holds its
  heads of every page, so this is also what the slice holds);
* bytes read outside the layer loop: the lm_head's V / t columns and the T embedding rows
  (sampling's own buffers are left out; the compiled roofline counts them);
* link bytes a layer: the o_proj all-reduce 2 (t - 1) / t T D (t > 1), and the MoE
  dispatch over n chips, "allreduce" (2 (n - 1) / n T D at the reduce width) or
  "all_to_all" (`ep_comm.comm_bytes`), whichever `ep_comm.choose_dispatch` picks.

The simulator (lp_jax/sim) costs a tp x ep slice with attention split over tp and
data-parallel over ep. lp_jax's (1, 1, t) with the experts on the same chips is its
(tp = t, ep = 1): the same weight and KV bytes a chip, so the same KV room
(`sim_parallelism`). The (1, e, 1) layout, attention whole on every chip, is no sim
layout: its (tp = 1, ep = e) would split the KV pool e ways that the engine replicates.
"""

from __future__ import annotations

import dataclasses

from lp_jax.roofline import ep_comm
from lp_jax.roofline.model_shape import ModelShape


@dataclasses.dataclass(frozen=True)
class ChipLayout:
    """Per-chip figures of one mesh for one model (bytes; see the module docstring)."""

    mesh: tuple[int, int, int]  # (data, expert, tensor)
    kv_heads_per_chip: float
    weight_bytes: float
    kv_bytes_per_token: float
    outside_bytes_per_row: float  # bytes read outside the layers a step, per row
    outside_bytes_fixed: float  # ... and independent of the rows (the lm_head)

    def outside_bytes(self, rows: int) -> float:
        return self.outside_bytes_fixed + rows * self.outside_bytes_per_row

    def kv_tokens(self, hbm_bytes: float, utilization: float = 0.9,
                  reserve_bytes: float = 4e9) -> int:
        """Tokens of KV that fit in one chip's HBM x utilization beside the weights and an
        activation reserve (the simulator's `derive_num_pages` rule)."""
        free = hbm_bytes * utilization - self.weight_bytes - reserve_bytes
        return max(int(free // self.kv_bytes_per_token), 0)


def _split(size: int, ways: int) -> float:
    """A dimension of `size` over `ways` chips: split when they divide it, else whole."""
    return size / ways if size % ways == 0 else float(size)


def _expert_ways(shape: ModelShape, mesh: tuple[int, int, int]) -> int:
    """Chips the experts split over: e t if that divides E, else e or t alone that does
    (`sharding.axis_dividing`), else 1."""
    _, e, t = mesh
    return next((n for n in (e * t, e, t) if shape.num_experts % n == 0), 1)


def chip_layout(shape: ModelShape, mesh: tuple[int, int, int]) -> ChipLayout:
    _, e, t = mesh
    d, b = shape.hidden_size, shape.dtype_bytes
    K, N = shape.num_kv_heads, shape.num_q_heads
    replicas = t // K if t > K and t % K == 0 and N % t == 0 else 1
    heads = _split(2 * K * replicas, t) / 2  # whole (K, V) pairs per chip, else all
    vocab = _split(shape.vocab_size, t)
    embed = vocab * d * b * (1 if shape.tie_word_embeddings else 2)
    # k_proj / v_proj hold the pool's copies of each head (loader.kv_columns)
    kv_proj = 0 if shape.mla_ranks else 2 * shape.linear_bytes(d, K * shape.head_dim)
    attention = shape.num_layers * (shape.attention_weight_bytes + (replicas - 1) * kv_proj) / t
    experts = shape.num_moe_layers * shape.expert_bytes_per_layer / _expert_ways(shape, mesh)
    dense = shape.dense_layers_count * shape.dense_mlp_bytes / t
    router = shape.num_moe_layers * d * shape.num_experts * b
    kv_token = shape.num_layers * 2 * heads * shape.head_dim * shape.kv_itemsize
    if shape.mla_ranks:  # the latent pool, whole on every chip
        kv_token = shape.num_layers * shape.kv_values_per_token_layer * shape.kv_itemsize
    return ChipLayout(mesh=tuple(mesh), kv_heads_per_chip=heads,
                      weight_bytes=float(embed + attention + experts + dense + router),
                      kv_bytes_per_token=float(kv_token), outside_bytes_per_row=float(d * b),
                      outside_bytes_fixed=float(vocab * d * b))


def link_bytes_per_layer(shape: ModelShape, mesh: tuple[int, int, int], rows: int, *,
                         dispatch: str = "auto", transport: str = "ragged",
                         reduce_bytes: int | None = None) -> dict:
    """{"attention", "moe", "dispatch"}: one chip's link bytes in one layer at `rows`, for
    the MoE dispatch asked ("auto": `ep_comm.choose_dispatch`'s pick). `reduce_bytes`: the
    all-reduce's element width (TPU reduces in the activation dtype; None: that)."""
    _, e, t = mesh
    n = _expert_ways(shape, mesh)
    d, b = shape.hidden_size, shape.dtype_bytes
    attention = 2.0 * (t - 1) / t * rows * d * b
    if n == 1:
        return {"attention": attention, "moe": 0.0, "dispatch": "none"}
    red = reduce_bytes or b
    if dispatch == "auto":
        dispatch = ep_comm.choose_dispatch(rows, d, shape.top_k, n, act_bytes=b,
                                           transport=transport, reduce_bytes=red)
    moe = (ep_comm.allreduce_bytes(rows, d, n, reduce_bytes=red) if dispatch == "allreduce" else
           ep_comm.comm_bytes("all_to_all", rows, d, shape.top_k, n, act_bytes=b,
                              transport=transport))
    return {"attention": attention, "moe": float(moe), "dispatch": dispatch}


def sim_parallelism(mesh: tuple[int, int, int]) -> dict[str, int]:
    """The simulator's {tp, ep} for an lp_jax mesh; ValueError for one it cannot express."""
    data, e, t = mesh
    if data != 1 or (e > 1 and t > 1) or (e > 1 and t == 1):
        raise ValueError(
            f"mesh (data, expert, tensor) = {tuple(mesh)}: the simulator's tp x ep slice "
            "splits attention over tp and its tokens over ep; it expresses lp_jax's "
            "(1, 1, t) (tensor-parallel attention, experts on the same chips) only")
    return {"tp": t, "ep": 1}
