"""Data-parallel attention's page pools: one BlockManager per data rank, one scheduler.

With data_parallel_size d, each data rank owns a slice of the running sequences and its
own share of the KV pool: rank r holds the global page ids [r P_r, (r + 1) P_r) with
P_r = P / d, so a sequence's pages, and the KV its attention reads, never leave its
rank. `RankedBlockManager` keeps BlockManager's interface (the scheduler calls it
unchanged): a sequence without pages is placed on a rank when it is allocated, and every
later call (append, publish, truncate, free) goes to that rank's manager. Prefix caching
is per rank too: a page published on rank r can only be hit by a sequence placed there.

Placement (`place`): among the ranks with a free sequence slot and the pages the
sequence needs (and, under per-rank prefill budgets, budget left in the plan being made:
budget.py), the one with the fewest pages in use after the allocation (tokens held,
in pages) less the pages its prefix cache already holds of the prompt (each hit page is
a page neither allocated nor prefilled: prefix affinity, weighed against the load), then
the fewest sequences, then the lowest rank. A preempted sequence frees its pages and is
placed again when it is readmitted.

`count_rows(plan)` records what the step's SPMD layout costs: every rank runs the same
rows per rank (the largest rank's), so a plan of rows n_r pads d max(n_r) - sum(n_r)
rows; `balance()` reports it beside each rank's sequences and pages.
"""

from __future__ import annotations

from lp_jax.core.block_manager import BlockManager, pages_for
from lp_jax.core.sequence import Sequence


class RankedBlockManager:
    """BlockManager's interface over `ranks` managers of num_pages / ranks pages each,
    each rank at most `max_seqs_per_rank` sequences."""

    def __init__(self, num_pages: int, page_size: int, ranks: int, *, max_seqs_per_rank: int,
                 enable_caching: bool = False) -> None:
        if ranks < 1 or num_pages % ranks:
            raise ValueError(f"{num_pages} KV pages do not split evenly over {ranks} "
                             "data-parallel ranks")
        if max_seqs_per_rank < 1:
            raise ValueError(f"max_seqs_per_rank must be >= 1, got {max_seqs_per_rank}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_caching = enable_caching
        self.pages_per_rank = num_pages // ranks
        self.max_seqs_per_rank = max_seqs_per_rank
        self.ranks = [BlockManager(self.pages_per_rank, page_size, enable_caching=enable_caching,
                                   first_page=r * self.pages_per_rank) for r in range(ranks)]
        self._rank_of: dict[int, int] = {}  # seq id -> its rank, while it holds pages
        self._seqs = [0] * ranks  # sequences holding pages, per rank
        self._rows = [0] * ranks  # rows run, summed over plans, per rank
        self._padded_rows = 0  # rows the ranks ran as padding (SPMD: max rows per rank)

    # --------------------------------------------------------------- state
    @property
    def num_free_pages(self) -> int:
        return sum(bm.num_free_pages for bm in self.ranks)

    @property
    def num_cached_pages(self) -> int:
        return sum(bm.num_cached_pages for bm in self.ranks)

    def pages_for(self, num_tokens: int) -> int:
        return pages_for(num_tokens, self.page_size)

    def rank_of(self, seq: Sequence) -> int | None:
        """The rank whose pages seq holds; None while it holds none."""
        return self._rank_of.get(seq.seq_id)

    def same_rank(self, a: Sequence, b: Sequence) -> bool:
        """Whether a and b hold pages on the same rank (a preemption for b's page frees
        only a victim of b's rank)."""
        r = self._rank_of.get(a.seq_id)
        return r is not None and r == self._rank_of.get(b.seq_id)

    def balance(self) -> dict:
        """Per rank: sequences holding pages, pages in use, free pages, rows run; and the
        rows the SPMD step padded (`count_rows`)."""
        return {"seqs": list(self._seqs),
                "used_pages": [bm.num_pages - bm.num_free_pages for bm in self.ranks],
                "free_pages": [bm.num_free_pages for bm in self.ranks],
                "rows": list(self._rows), "padded_rows": self._padded_rows}

    # ----------------------------------------------------------- placement
    def place(self, seq: Sequence, num_tokens: int,
              ranks: tuple[int, ...] | None = None) -> int | None:
        """The rank a page-less seq would be allocated on now (see the module docstring),
        among `ranks` if given (those with prefill budget left: budget.py); None when no
        such rank has a sequence slot and the pages. Changes nothing."""
        best, best_key = None, None
        for r, bm in enumerate(self.ranks):
            if ranks is not None and r not in ranks:
                continue
            if self._seqs[r] >= self.max_seqs_per_rank or not bm.can_allocate(seq, num_tokens):
                continue
            hit = self.pages_for(bm.cached_prefix(seq, num_tokens))
            used = bm.num_pages - bm.num_free_pages + self.pages_for(num_tokens) - hit
            key = (used - hit, self._seqs[r], r)
            if best_key is None or key < best_key:
                best, best_key = r, key
        return best

    def _rank(self, seq: Sequence) -> BlockManager:
        r = self._rank_of.get(seq.seq_id)
        if r is None:
            raise RuntimeError(f"seq {seq.seq_id} holds no pages on any rank")
        return self.ranks[r]

    # ------------------------------------------------- BlockManager's calls
    def cached_prefix(self, seq: Sequence, num_tokens: int) -> int:
        if seq.seq_id in self._rank_of:
            return self._rank(seq).cached_prefix(seq, num_tokens)
        r = self.place(seq, num_tokens)
        return 0 if r is None else self.ranks[r].cached_prefix(seq, num_tokens)

    def cached_on(self, seq: Sequence, num_tokens: int, rank: int) -> int:
        """The cached prefix a page-less seq would take if allocated on `rank`."""
        return self.ranks[rank].cached_prefix(seq, num_tokens)

    def can_allocate(self, seq: Sequence, num_tokens: int,
                     ranks: tuple[int, ...] | None = None) -> bool:
        return self.place(seq, num_tokens, ranks) is not None

    def allocate(self, seq: Sequence, num_tokens: int,
                 ranks: tuple[int, ...] | None = None) -> int:
        if seq.seq_id in self._rank_of or seq.page_ids:
            raise RuntimeError(f"seq {seq.seq_id} already holds {len(seq.page_ids)} pages")
        r = self.place(seq, num_tokens, ranks)
        if r is None:
            raise RuntimeError(f"seq {seq.seq_id}: no data-parallel rank has a sequence slot "
                               f"and {self.pages_for(num_tokens)} free pages")
        hit = self.ranks[r].allocate(seq, num_tokens)
        self._rank_of[seq.seq_id] = r
        self._seqs[r] += 1
        return hit

    def can_append(self, seq: Sequence, extra: int = 0) -> bool:
        return self._rank(seq).can_append(seq, extra)

    def append_slot(self, seq: Sequence, extra: int = 0) -> None:
        self._rank(seq).append_slot(seq, extra)

    def publish(self, seq: Sequence, num_tokens: int) -> None:
        self._rank(seq).publish(seq, num_tokens)

    def truncate(self, seq: Sequence, extra: int = 0) -> None:
        self._rank(seq).truncate(seq, extra)

    def free(self, seq: Sequence) -> None:
        self._rank(seq).free(seq)
        self._seqs[self._rank_of.pop(seq.seq_id)] -= 1

    def reset_prefix_cache(self) -> bool:
        """Forget every rank's cached pages: only while no sequence holds a page."""
        if self._rank_of:
            return False
        return all([bm.reset_prefix_cache() for bm in self.ranks])

    # ------------------------------------------------------------- metrics
    def count_rows(self, plan) -> None:
        """Adds a plan's rows per rank (a decode's 1 + drafts rows, a chunk's tokens) and
        the padding that running them as [ranks, max rows per rank] costs."""
        rows = [0] * len(self.ranks)
        drafts = plan.drafts or ((),) * len(plan.decode)
        for seq, d in zip(plan.decode, drafts, strict=True):
            r = self._rank_of.get(seq.seq_id)
            if r is not None:
                rows[r] += 1 + len(d)
        for chunk in plan.prefill:
            r = self._rank_of.get(chunk.seq.seq_id)
            if r is not None:
                rows[r] += chunk.num_tokens
        if any(rows):
            self._padded_rows += len(rows) * max(rows) - sum(rows)
            self._rows = [a + b for a, b in zip(self._rows, rows, strict=True)]
