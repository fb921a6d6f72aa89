"""Logical KV-page allocator.

The KV cache is a pool of P pages of S tokens each. A sequence owns a list of page ids in
position order, so token position `pos` lives in page `page_ids[pos // S]` at offset
`pos % S`, i.e. at flat slot `page_ids[pos // S] * S + pos % S`.

Pages are handed out only through `allocate` / `append_slot` and returned only through `free`,
and every page records its owner: freeing a page that the sequence does not own (a double free)
raises, and `allocate` refuses a sequence that still holds pages, so a page can neither leak
nor be shared. No prefix caching: pages are never shared between sequences.
"""

from __future__ import annotations

from collections import deque

from lp_jax.engine.sequence import Sequence


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold `num_tokens` tokens."""
    return -(-num_tokens // page_size)


class BlockManager:
    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need num_pages, page_size >= 1, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: deque[int] = deque(range(num_pages))
        self._owner: dict[int, int] = {}  # page id -> seq_id, for allocated pages only

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return pages_for(num_tokens, self.page_size)

    def can_allocate(self, num_tokens: int) -> bool:
        return self.pages_for(num_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Give a page-less `seq` the pages for its first `num_tokens` positions."""
        if seq.page_ids:
            raise RuntimeError(f"seq {seq.seq_id} already holds {len(seq.page_ids)} pages")
        if num_tokens < 1:
            raise ValueError(f"allocate needs num_tokens >= 1, got {num_tokens}")
        n = self.pages_for(num_tokens)
        if n > len(self._free):
            raise RuntimeError(f"seq {seq.seq_id} needs {n} pages, {len(self._free)} are free")
        seq.page_ids = [self._take(seq) for _ in range(n)]

    def _needed(self, seq: Sequence) -> int:
        # The next decode step writes KV for position num_tokens - 1.
        return max(0, self.pages_for(seq.num_tokens) - len(seq.page_ids))

    def can_append(self, seq: Sequence) -> bool:
        return self._needed(seq) <= len(self._free)

    def append_slot(self, seq: Sequence) -> None:
        """Make room for the KV of `seq`'s last token: a new page when it crosses a boundary."""
        if not seq.page_ids:
            raise RuntimeError(f"seq {seq.seq_id} holds no pages; allocate it first")
        n = self._needed(seq)
        if n > len(self._free):
            raise RuntimeError(f"seq {seq.seq_id} needs {n} pages, {len(self._free)} are free")
        seq.page_ids.extend(self._take(seq) for _ in range(n))

    def free(self, seq: Sequence) -> None:
        """Return all of `seq`'s pages to the pool; a second free of the same pages raises."""
        if not seq.page_ids:
            raise RuntimeError(f"seq {seq.seq_id} holds no pages to free")
        if len(set(seq.page_ids)) != len(seq.page_ids):
            raise RuntimeError(f"seq {seq.seq_id} lists a page twice: {seq.page_ids}")
        for p in seq.page_ids:
            if self._owner.get(p) != seq.seq_id:
                raise RuntimeError(f"seq {seq.seq_id} frees page {p} it does not own")
        for p in reversed(seq.page_ids):  # reversed so a re-admission gets the same pages back
            del self._owner[p]
            self._free.appendleft(p)
        seq.page_ids = []

    def _take(self, seq: Sequence) -> int:
        p = self._free.popleft()
        self._owner[p] = seq.seq_id
        return p
