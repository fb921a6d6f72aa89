"""k greedy drafts from a one-layer draft model (an EAGLE-3 head, an MTP layer) that has
just run over a call's rows: the first draft of each sequence from its last row that
stands, then k - 1 chained one-row steps, each feeding the layer its own output state and
the token it just drafted, one position further.

The draft's KV is a one-layer pool in the target pool's layout, addressed by the
target's page table, so the KV of draft position p sits where the target's does:
dropping the pages of rejected drafts rolls the draft back too, and an entry a chained
step wrote is rewritten by the next verification's extend before anything reads it. A
chained step whose position lies past the pages its sequence holds writes nothing, and
it and the steps after it draft -1 (no draft).

Under data-parallel attention (ranked metadata, lp_jax/models/data_ranks.py) the draft's
pool is rank-major and split over "data" as the target's is (one layer: rank r's pages are
rows [r P_r, (r + 1) P_r)), the extend's rows are the call's R N rows, and the per-sequence
arrays are rank-major, B = R B_r (rank r's B_r sequences first, in its metadata's order).
A chained step is then R B_r rows, sequence b's row b, on rank b // B_r, with ranked
metadata of its own, so the layer's attention runs per rank on the rank's pool shard with
the rank-local page ids of the metadata's page table.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lp_jax.models.metadata import AttentionMetadata


def rows_of(x_T, rows_B, ranks: int = 1):
    """x_T[rows_B]. Under data-parallel attention (ranks R > 1) slot s of the B = R B_r
    rank-major slots is rank s // B_r's, and rows_B[s] lies in that rank's share of the
    T = R N rows: each rank gathers from its own share (a gather batched over the rank
    axis, which stays split over "data"), so nothing crosses ranks."""
    if ranks == 1:
        return x_T[rows_B]
    N, B_r = x_T.shape[0] // ranks, rows_B.shape[0] // ranks
    x_RN = x_T.reshape(ranks, N, *x_T.shape[1:])
    out_RB = jax.vmap(lambda x_N, rows: x_N[rows])(x_RN, (rows_B % N).reshape(ranks, B_r))
    return out_RB.reshape(rows_B.shape[0], *x_T.shape[1:])


def chain_drafts(layer, head, h_TD, kv, meta: AttentionMetadata, last_row_B, *, k: int,
                 page_size: int, to_target=lambda ids: ids, num_pages_B=None,
                 drafting_B=None):
    """(drafts_BK target ids, kv) from the extend's output states h_TD.

    layer(tokens_B, h_BD, kv, step_meta) -> (h_BD, kv): one draft step over one row per
    sequence; head(h_BD) -> logits_BW: the draft's logits of a state, taken only at the
    rows that draft (not at every row of the extend). last_row_B: the row each sequence
    drafts from (padding sequences ignored); num_pages_B: the pages each sequence holds
    (None: all of its page table); drafting_B: the sequences that draft (others chain
    nothing: their KV past the extend is left as it is); to_target: draft-vocabulary
    ids -> the target's. With ranked metadata, B = R B_r rank-major (module docstring)."""
    B = last_row_B.shape[0]
    ranked = jnp.ndim(meta.num_seqs) == 1
    ranks = meta.num_seqs.shape[0] if ranked else 1
    # Rank-major slots: sequence b is rank b // B_r's (b % B_r)-th; one rank: B_r = B.
    B_r = meta.page_table_BC.shape[-2]
    if B_r * ranks != B:
        raise ValueError(f"{B} drafting sequences do not match the metadata's "
                         f"{meta.page_table_BC.shape[:-1]} sequences")
    h_BD = rows_of(h_TD, last_row_B, ranks)
    pos_B = rows_of(meta.positions_T, last_row_B, ranks)
    draft_B = jnp.argmax(head(h_BD), axis=-1).astype(jnp.int32)
    real_B = (jnp.arange(B) % B_r) < jnp.repeat(jnp.atleast_1d(meta.num_seqs), B_r)
    if drafting_B is not None:
        real_B = real_B & drafting_B
    S, C = page_size, meta.page_table_BC.shape[-1]
    page_table_BC = meta.page_table_BC.reshape(B, C)  # rank-local ids under ranks
    if num_pages_B is None:
        num_pages_B = jnp.full((B,), C, jnp.int32)
    held_B = jnp.minimum(num_pages_B, C)
    rows = jnp.arange(B_r + 1, dtype=jnp.int32)
    query_start = (jnp.minimum(rows[None, :], meta.num_seqs[:, None]) if ranked
                   else jnp.minimum(rows, meta.num_seqs))
    as_meta = (lambda x_B: x_B.reshape(ranks, B_r)) if ranked else (lambda x_B: x_B)

    def chained(s, carry):
        draft_B, h_BD, kv, drafts_BK = carry
        tok_B = to_target(draft_B)
        drafts_BK = drafts_BK.at[:, s - 1].set(tok_B)
        pos = pos_B + s
        page_B = jnp.take_along_axis(page_table_BC, jnp.minimum(pos // S, C - 1)[:, None],
                                     axis=1)[:, 0]
        write_B = real_B & (pos // S < held_B)
        step_meta = AttentionMetadata(
            positions_T=pos, slots_T=jnp.where(write_B, page_B * S + pos % S, -1),
            query_start_B1=query_start, seq_lens_B=as_meta(jnp.where(real_B, pos + 1, 0)),
            page_table_BC=meta.page_table_BC, num_seqs=meta.num_seqs)
        h_BD, kv = layer(tok_B, h_BD, kv, step_meta)
        return jnp.argmax(head(h_BD), axis=-1).astype(jnp.int32), h_BD, kv, drafts_BK

    drafts_BK = jnp.zeros((B, k), jnp.int32)
    draft_B, _, kv, drafts_BK = jax.lax.fori_loop(1, k, chained,
                                                  (draft_B, h_BD, kv, drafts_BK))
    drafts_BK = drafts_BK.at[:, k - 1].set(to_target(draft_B))
    s_K = jnp.arange(k)
    held_BK = (pos_B[:, None] + s_K[None, :]) // S < held_B[:, None]
    return jnp.where(held_BK | (s_K == 0)[None, :], drafts_BK, -1), kv
