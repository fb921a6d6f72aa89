"""The residual stream split over rows between tensor-parallel attention and the experts
(sequence parallelism), for large row buckets on the TP t + EP t layout.

With attention split over t chips by heads and the experts over the same t chips, a
layer replicated over rows ends each half with an all-reduce of [T, D]: o_proj's partial
sums, and the experts' partial outputs. Every chip then adds, norms and copies all T
rows of the residual stream, t times the work there is. Split over rows instead, each
chip keeps T / t rows of the residual stream between the collectives:

    x_tD  (rows of this chip)     norm -> all-gather -> h_TD on every chip
    q/k/v, attention, o_proj      heads of this chip; o_proj's partial [T, D]
    reduce-scatter -> o_tD        x_tD + o_tD, post-attention norm on t rows
    experts                       "allreduce" dispatch: all-gather the normed rows, the
                                  local experts on all T, reduce-scatter (psum_scatter)
                                  "all_to_all" dispatch: each chip routes and sends its
                                  own rows; the outputs come back to the row shard
    x_tD + y_tD

An all-reduce is a reduce-scatter and an all-gather, so the collectives move what the
two all-reduces moved (all_to_all: its rows there and back instead of the experts' pair),
and the residual adds, norms and copies shrink t-fold. The two reduce-scatters sum
partials in the activation dtype (o_proj's dot and the experts' partial outputs leave
each chip in bf16, as other engines' tensor-parallel all-reduces do), where the
replicated stream's all-reduces sum float32 partials: half the bytes on the links, at
the price of rounding each chip's partial before the sum (t roundings, not one). It is
taken only from `MIN_ROWS` rows on, where the [T, D] passes are large (decode buckets
keep the replicated stream and its programs). Rows enter split (a free slice of replicated rows) and
leave replicated (one all-gather a call), so nothing outside the layer loop changes.

`row_axis` decides; the model applies `constrain` at the points above (GSPMD places the
collectives) and passes `scatter_rows` to the MoE's shard_map
(`sharded_kernels.sharded_moe_ffn`), which writes its output on the row shard.
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lp_jax.sharding import axes_size, axis_dividing, mesh_axes

# Fewest rows a step must have for the row-split residual stream (see the docstring).
MIN_ROWS = 256


def row_axis(mesh, rows: int, num_experts: int) -> str | None:
    """The mesh axis the residual stream's rows split over, or None (replicated rows).

    Only when attention's heads split over one axis (`tensor`, t > 1), the experts split
    over that same axis alone (the TP t + EP t layout; not the data-parallel one), and
    `rows` is at least `MIN_ROWS` and a multiple of t."""
    if mesh is None or rows < MIN_ROWS:
        return None
    heads = mesh_axes("q_heads", mesh)
    if not isinstance(heads, str) or rows % axes_size(heads, mesh):
        return None
    return heads if axis_dividing("experts", num_experts, mesh) == heads else None


def constrain(x: jax.Array, mesh, axis: str | None) -> jax.Array:
    """x with its rows split over `axis` (None: replicated), under GSPMD."""
    spec = P(axis, *([None] * (x.ndim - 1))) if axis is not None else P()
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
