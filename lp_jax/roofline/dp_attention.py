"""Data-parallel attention beside expert parallelism, modelled per chip of a slice.

The layout of docs/data_parallel.md, mesh (d, 1, t) on n = d t chips, with the rows laid
out per rank (the layout the engine's step is built towards): rank r runs its own n_r
rows through attention on its t chips and keeps its own KV pages; the experts split over
all n chips. Per chip:

* weights: attention, embedding / lm_head and dense MLPs as tensor parallelism over t
  (`layout.chip_layout` of (1, 1, t)), copied on every rank; the experts / n;
* KV: a chip holds only its rank's tokens, its heads split as TP t splits them (an MLA
  latent whole on each of the rank's t chips), so the slice holds d times one chip's room
  (`slice_kv_tokens`), where TP attention over all n chips, (1, 1, n), holds every token
  on every chip: its slice room is one chip's;
* link bytes a layer at n_r rows on a rank: the o_proj all-reduce over t,
  2 (t - 1) / t n_r D, and the MoE all_to_all from the rank's rows, each of its t chips
  sending n_r / t rows' top_k copies to their experts' owners among n chips and taking
  the outputs back, then the combined rows gathered inside the rank (t - 1) n_r / t D;
* imbalance: every rank runs the busiest rank's rows (SPMD), so ranks of n_r rows pad
  d max(n_r) - sum(n_r) rows (`padded_rows`, as `dp_placement.count_rows` counts them).
"""

from __future__ import annotations

import dataclasses

from lp_jax.models.dispatch_bytes import EXPERT_ID_BYTES
from lp_jax.roofline.layout import ChipLayout, _expert_ways, chip_layout
from lp_jax.roofline.model_shape import ModelShape


def dp_chip_layout(shape: ModelShape, d: int, t: int) -> ChipLayout:
    """One chip's weights and KV bytes a token on mesh (d, 1, t)."""
    if d < 1 or t < 1:
        raise ValueError(f"need d, t >= 1, got {d}, {t}")
    tp = chip_layout(shape, (1, 1, t))
    experts = shape.num_moe_layers * shape.expert_bytes_per_layer
    weights = (tp.weight_bytes - experts / _expert_ways(shape, (1, 1, t))
               + experts / _expert_ways(shape, (1, d, t)))
    return dataclasses.replace(tp, mesh=(d, 1, t), weight_bytes=float(weights))


def slice_kv_tokens(shape: ModelShape, mesh: tuple[int, int, int], hbm_bytes: float) -> int:
    """Tokens of KV the whole slice holds: d ranks of one chip's room each on (d, 1, t);
    one chip's room for a mesh without data ranks (every chip holds every token)."""
    d, e, t = mesh
    if d == 1:
        return chip_layout(shape, mesh).kv_tokens(hbm_bytes)
    if e != 1:
        raise ValueError(f"data-parallel attention is (d, 1, t), got {mesh}")
    return d * dp_chip_layout(shape, d, t).kv_tokens(hbm_bytes)


def dp_link_bytes_per_layer(shape: ModelShape, d: int, t: int, rows_per_rank: int) -> dict:
    """{"attention", "dispatch", "combine", "gather"}: one chip's link bytes in one layer
    with `rows_per_rank` rows on its rank (uniform routing, ragged transport)."""
    n = d * t
    D, b = shape.hidden_size, shape.dtype_bytes
    rows = rows_per_rank / t  # rows each of the rank's chips dispatches
    sent = rows * shape.top_k * (n - 1) / n  # copies routed to other chips' experts
    return {"attention": 2.0 * (t - 1) / t * rows_per_rank * D * b,
            "dispatch": sent * (D * b + EXPERT_ID_BYTES), "combine": sent * D * b,
            "gather": (t - 1) * rows * D * b}


def padded_rows(rows_per_rank: list[int]) -> int:
    """Rows the ranks run as padding when each runs the busiest rank's rows."""
    return len(rows_per_rank) * max(rows_per_rank) - sum(rows_per_rank)
