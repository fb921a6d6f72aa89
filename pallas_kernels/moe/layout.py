"""Padded-tile row layout shared by the Pallas MoE backends, and the combine step.

The dispatch of `ref.dispatch` orders the R = T*A (token, expert) rows by expert. The
kernels work on row tiles of `tm` rows, and a tile must hold rows of one expert only, so
each expert's rows are padded up to a multiple of `tm` (the hardware tile, no further).
The padded layout has P rows (P a static bound, see `padded_rows`) and M = P // tm
tiles, of which only the first `num_tiles` (a traced scalar) are used:

    tile m < num_tiles belongs to expert tile_group_M[m]; its first tile_rows_M[m] rows
    are real rows, the rest are padding whose results are never read.

Experts with zero rows own no tile, so a kernel that walks tiles 0..num_tiles-1 never
touches their weights. Rows of masked (padding) tokens belong to no expert and to no
tile.

Row sources: padded row p of a real row is `row_pos_TA` of its (token, slot); its token
is token_ids_P[p] (pad rows: token 0). A kernel that cannot gather rows itself reads
a compact sorted copy x_SD = x_TD[token_ids_S] instead, in which each expert's rows
start on a multiple of `src_align` rows (TMA of a swizzled tile needs an aligned row
offset; padding to 8 rows is much cheaper than to tm): tile m is the tm consecutive
rows of x_SD from tile_src_M[m] (a multiple of src_align), of which the first
tile_rows_M[m] are its real rows. S leaves tm spare rows so every window fits.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.moe.ref import dispatch


def padded_rows(num_rows: int, num_experts: int, tm: int) -> int:
    """Static bound P on the padded row count: every non-empty expert adds < tm rows."""
    bound = num_rows + min(num_experts, num_rows) * (tm - 1)
    return max(tm, -(-bound // tm) * tm)


def source_rows(num_rows: int, num_experts: int, tm: int, src_align: int) -> int:
    """Rows S of the aligned sorted copy: experts padded to src_align, plus tm spare."""
    return padded_rows(num_rows, num_experts, src_align) + tm


class TileLayout(NamedTuple):
    tm: int
    sort_order_R: jax.Array  # int32 [R] flat row (token*A + slot) of each sorted row
    token_ids_R: jax.Array  # int32 [R] token of each sorted row
    group_sizes_E: jax.Array  # int32 [E] real rows per expert
    padded_sizes_E: jax.Array  # int32 [E] rows per expert rounded up to tm (0 stays 0)
    num_tiles: jax.Array  # int32 [] tiles in use
    tile_group_M: jax.Array  # int32 [M] expert of each tile (unused tiles: last used one)
    tile_rows_M: jax.Array  # int32 [M] real rows in each tile (0 for unused tiles)
    tile_src_M: jax.Array  # int32 [M] row of x_SD where each tile starts
    token_ids_P: jax.Array  # int32 [P] token of each padded row (0 for pad rows)
    token_ids_S: jax.Array  # int32 [S] token of each row of the aligned sorted copy
    row_pos_TA: jax.Array  # int32 [T, A] padded row of each (token, slot)
    valid_TA: jax.Array  # bool [T, A] the (token, slot) is routed (token not masked)

    @property
    def num_padded_rows(self) -> int:
        return self.token_ids_P.shape[0]


def make_tile_layout(
    expert_ids_TA: jax.Array,
    num_experts: int,
    token_mask_T: jax.Array | None,
    tm: int,
    src_align: int = 8,
) -> TileLayout:
    T, A = expert_ids_TA.shape
    R, E = T * A, num_experts
    P = padded_rows(R, E, tm)
    M = P // tm
    sort_order_R, token_ids_R, group_sizes_E = dispatch(expert_ids_TA, E, token_mask_T)

    tiles_E = (group_sizes_E + tm - 1) // tm
    tile_start_E = jnp.cumsum(tiles_E) - tiles_E  # first tile of each expert
    group_start_E = jnp.cumsum(group_sizes_E) - group_sizes_E  # first sorted row
    aligned_E = (group_sizes_E + src_align - 1) // src_align * src_align
    src_start_E = jnp.cumsum(aligned_E) - aligned_E  # first row in x_SD
    num_tiles = jnp.sum(tiles_E).astype(jnp.int32)

    m_M = jnp.arange(M, dtype=jnp.int32)
    tile_group_M = jnp.repeat(
        jnp.arange(E, dtype=jnp.int32), tiles_E, total_repeat_length=M
    )
    last_group = tile_group_M[jnp.maximum(num_tiles - 1, 0)]
    used_M = m_M < num_tiles
    tile_group_M = jnp.where(used_M, tile_group_M, last_group)
    j_M = m_M - tile_start_E[tile_group_M]  # tile index within its expert
    tile_rows_M = jnp.where(
        used_M, jnp.clip(group_sizes_E[tile_group_M] - j_M * tm, 0, tm), 0
    ).astype(jnp.int32)
    tile_src_M = jnp.where(used_M, src_start_E[tile_group_M] + j_M * tm, 0)

    # Padded position of every sorted row; masked rows (sentinel expert E) get P.
    ids_R = expert_ids_TA.reshape(R)
    if token_mask_T is not None:
        ids_R = jnp.where(jnp.repeat(token_mask_T.astype(bool), A), ids_R, E)
    sorted_ids_R = ids_R[sort_order_R]
    valid_sorted_R = sorted_ids_R < E
    g_R = jnp.minimum(sorted_ids_R, E - 1)
    r_R = jnp.arange(R, dtype=jnp.int32)
    pos_R = jnp.where(valid_sorted_R, tile_start_E[g_R] * tm + r_R - group_start_E[g_R], P)
    token_ids_P = jnp.zeros((P,), jnp.int32).at[pos_R].set(token_ids_R, mode="drop")
    S = source_rows(R, E, tm, src_align)
    src_R = jnp.where(valid_sorted_R, src_start_E[g_R] + r_R - group_start_E[g_R], S)
    token_ids_S = jnp.zeros((S,), jnp.int32).at[src_R].set(token_ids_R, mode="drop")
    row_pos_flat_R = jnp.zeros((R,), jnp.int32).at[sort_order_R].set(jnp.minimum(pos_R, P - 1))
    return TileLayout(
        tm=tm,
        sort_order_R=sort_order_R,
        token_ids_R=token_ids_R,
        group_sizes_E=group_sizes_E,
        padded_sizes_E=(tiles_E * tm).astype(jnp.int32),
        num_tiles=num_tiles,
        tile_group_M=tile_group_M.astype(jnp.int32),
        tile_rows_M=tile_rows_M,
        tile_src_M=tile_src_M.astype(jnp.int32),
        token_ids_P=token_ids_P,
        token_ids_S=token_ids_S,
        row_pos_TA=row_pos_flat_R.reshape(T, A),
        valid_TA=(ids_R < E).reshape(T, A),
    )


def combine_padded(y_PD: jax.Array, layout: TileLayout, weights_TA: jax.Array) -> jax.Array:
    """y_TD[t] = sum_a weights[t, a] * y_PD[row_pos[t, a]] in float32.

    A gather per (token, slot), not a scatter-add: deterministic, and rows of y_PD that
    are padding or that no kernel wrote (garbage, possibly NaN) are never read. Masked
    slots are selected away (not multiplied by 0, which would let a NaN through).
    """
    rows_TAD = y_PD[layout.row_pos_TA].astype(jnp.float32)
    contrib_TAD = jnp.where(layout.valid_TA[..., None], weights_TA[..., None] * rows_TAD, 0.0)
    return jnp.sum(contrib_TAD, axis=1)
