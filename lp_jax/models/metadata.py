"""Per-step batch metadata: an explicit pytree that travels into the jitted step.

A batch is ragged: sequence b owns tokens [query_start_B1[b], query_start_B1[b+1])
of the flat token array. Shapes are padded to compile-time buckets (T tokens, B
sequences, C pages per sequence); padding tokens have slot -1 and padding
sequences have seq_len 0. Slots and page ids are *logical* (the same in every
layer); the model adds the layer's page offset. See pallas_kernels/attention/ref.py
for the KV-cache layout.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    positions_T: jax.Array  # int32 RoPE positions; 0 for padding
    slots_T: jax.Array  # int32 logical KV slot (page * S + offset); -1 for padding
    query_start_B1: jax.Array  # int32 cumulative query offsets
    seq_lens_B: jax.Array  # int32 context length after this step; 0 for padding
    page_table_BC: jax.Array  # int32 logical page ids
    num_seqs: jax.Array  # int32 scalar: real sequences

    def token_mask(self) -> jax.Array:
        """Real tokens: every token with a KV slot. Padding rows may sit anywhere."""
        return self.slots_T >= 0


def build_metadata(
    seqs: list[tuple[int, int, list[int]]],
    *,
    page_size: int,
    num_tokens: int,
    num_seqs: int,
    pages_per_seq: int,
) -> AttentionMetadata:
    """Host-side builder (numpy) for a padded ragged batch.

    seqs: one (first_position, num_new_tokens, page_ids) per sequence, in batch
    order; the new tokens occupy positions [first, first + n) and the sequence's
    context after the step is first + n.
    """
    T, B, C, S = num_tokens, num_seqs, pages_per_seq, page_size
    if len(seqs) > B:
        raise ValueError(f"{len(seqs)} sequences exceed the batch bucket {B}")
    positions = np.zeros(T, np.int32)
    slots = np.full(T, -1, np.int32)
    query_start = np.zeros(B + 1, np.int32)
    seq_lens = np.zeros(B, np.int32)
    page_table = np.zeros((B, C), np.int32)
    t = 0
    for b, (first, n, page_ids) in enumerate(seqs):
        if t + n > T:
            raise ValueError(f"{t + n} tokens exceed the token bucket {T}")
        if len(page_ids) > C:
            raise ValueError(f"{len(page_ids)} pages exceed the page-table width {C}")
        pos = np.arange(first, first + n, dtype=np.int32)
        pages = np.asarray(page_ids, np.int32)
        positions[t : t + n] = pos
        slots[t : t + n] = pages[pos // S] * S + pos % S
        page_table[b, : len(pages)] = pages
        seq_lens[b] = first + n
        t += n
        query_start[b + 1] = t
    query_start[len(seqs) + 1 :] = t
    return AttentionMetadata(
        positions_T=positions,
        slots_T=slots,
        query_start_B1=query_start,
        seq_lens_B=seq_lens,
        page_table_BC=page_table,
        num_seqs=np.int32(len(seqs)),
    )


def build_decode_metadata(
    positions: list[int],
    page_lists: list[list[int]],
    *,
    page_size: int,
    num_seqs: int,
    pages_per_seq: int,
    num_tokens: int | None = None,
) -> AttentionMetadata:
    """`build_metadata` for one new token per sequence, vectorised: the per-iteration
    decode batch is the host's hottest path (128+ sequences every step). Token t belongs
    to sequence t; tokens past the sequences (up to `num_tokens`, default `num_seqs`)
    are padding."""
    B, C, S, n = num_seqs, pages_per_seq, page_size, len(positions)
    T = B if num_tokens is None else num_tokens
    if n > min(B, T):
        raise ValueError(f"{n} sequences exceed the batch bucket {min(B, T)}")
    page_table = np.zeros((B, C), np.int32)
    for b, pages in enumerate(page_lists):
        page_table[b, : len(pages)] = pages
    pos = np.zeros(T, np.int32)
    pos[:n] = positions
    slots = np.full(T, -1, np.int32)
    rows = np.arange(n)
    slots[:n] = page_table[rows, pos[:n] // S] * S + pos[:n] % S
    seq_lens = np.zeros(B, np.int32)
    seq_lens[:n] = pos[:n] + 1
    return AttentionMetadata(
        positions_T=pos,
        slots_T=slots,
        query_start_B1=np.minimum(np.arange(B + 1, dtype=np.int32), n),
        seq_lens_B=seq_lens,
        page_table_BC=page_table,
        num_seqs=np.int32(n),
    )


def build_ranked_metadata(
    ranks: list[list[tuple[int, int, list[int]]]],
    *,
    page_size: int,
    num_tokens: int,
    num_seqs: int,
    pages_per_seq: int,
) -> AttentionMetadata:
    """`build_metadata` of each data rank's sequences (page ids local to the rank),
    stacked: the rows of rank r at [r N, (r + 1) N) of the flat positions_T and slots_T
    (N = num_tokens), and a leading rank axis on the per-sequence arrays:
    query_start_B1 [R, B + 1], seq_lens_B [R, B], page_table_BC [R, B, C], num_seqs [R]
    (lp_jax/models/data_ranks.py runs attention on each rank's share)."""
    each = [build_metadata(seqs, page_size=page_size, num_tokens=num_tokens,
                           num_seqs=num_seqs, pages_per_seq=pages_per_seq) for seqs in ranks]
    return AttentionMetadata(
        positions_T=np.concatenate([m.positions_T for m in each]),
        slots_T=np.concatenate([m.slots_T for m in each]),
        query_start_B1=np.stack([m.query_start_B1 for m in each]),
        seq_lens_B=np.stack([m.seq_lens_B for m in each]),
        page_table_BC=np.stack([m.page_table_BC for m in each]),
        num_seqs=np.asarray([m.num_seqs for m in each], np.int32),
    )
