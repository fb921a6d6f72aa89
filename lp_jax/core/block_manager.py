"""Logical KV-page allocator, with automatic prefix caching.

The KV cache is a pool of P pages of S tokens each. A sequence holds a list of page ids in
position order, so token position `pos` lives in page `page_ids[pos // S]` at offset
`pos % S`, i.e. at flat slot `page_ids[pos // S] * S + pos % S`.

Prefix caching (vLLM v1's design). A full page is named by a chained hash: sha256 of the
previous page's hash, the page's S token ids, and a slot for anything else that changes
its KV (a LoRA id, later). `publish(seq, n)` makes the full pages of seq's first n
positions hit-able; the scheduler calls it only once every layer has written them. A
later sequence whose tokens start with the same pages takes them by reference at
`allocate`, which returns how many tokens it hit, and prefills from there. Hits stop one
token short of the prefill target: the last token must be computed for its logits, so a
prompt that hits in full recomputes its last page.

Pages carry reference counts. A page whose last holder frees it returns to the free pool
and keeps its hash, so it can still be hit until it is handed out again. Fresh pages are
taken hashless first, then cached ones least recently freed first; a sequence's pages are
freed tail first, so a chain is evicted from its end and its head stays hit-able. The
free count includes the cached free pages: they are evictable.

Pages are handed out only through `allocate` / `append_slot` and returned only through
`free`, and every page records its holders: freeing a page the sequence does not hold (a
double free) raises, and `allocate` refuses a sequence that still holds pages. Only
published pages are ever shared, and a sequence never writes a page it hit: its writes
start at its first missed position.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque

from lp_jax.core.sequence import Sequence

_ROOT_HASH = hashlib.sha256(b"lp_jax prefix cache v1").digest()  # the parent of page 0


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold `num_tokens` tokens."""
    return -(-num_tokens // page_size)


def hash_page(parent: bytes, token_ids: list[int], extra: bytes = b"") -> bytes:
    """The chained hash of one full page: sha256 over the parent page's hash, `extra`
    (length-prefixed: anything besides the tokens that changes the KV, e.g. a LoRA id)
    and the token ids as int32. A cryptographic hash, as vLLM's default, so that no
    client can craft a prompt whose pages collide with another's."""
    h = hashlib.sha256(parent)
    h.update(len(extra).to_bytes(4, "little"))
    h.update(extra)
    h.update(array("i", token_ids).tobytes())
    return h.digest()


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, *, enable_caching: bool = False,
                 first_page: int = 0) -> None:
        """Pages [first_page, first_page + num_pages) of the pool: a data-parallel rank's
        share of it (dp_placement.py) is a range of the global page ids."""
        if num_pages < 1 or page_size < 1 or first_page < 0:
            raise ValueError(f"need num_pages, page_size >= 1 and first_page >= 0, got "
                             f"{num_pages}, {page_size}, {first_page}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_caching = enable_caching
        self._holders: dict[int, set[int]] = {}  # page id -> seq ids, for held pages only
        # Free pages without a hash.
        self._free_plain: deque[int] = deque(range(first_page, first_page + num_pages))
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # free, hashed; LRU first
        self._hash_of: dict[int, bytes] = {}  # published page -> its hash
        self._page_of: dict[bytes, int] = {}  # hash -> the page that holds it
        self._published: dict[int, int] = {}  # seq id -> its leading pages already hashed

    @property
    def num_free_pages(self) -> int:
        """Pages not held by any sequence, cached ones included (they are evictable)."""
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_cached_pages(self) -> int:
        """Pages a prefix may hit, held or free."""
        return len(self._page_of)

    def pages_for(self, num_tokens: int) -> int:
        return pages_for(num_tokens, self.page_size)

    # ------------------------------------------------------------- lookups
    def cached_prefix(self, seq: Sequence, num_tokens: int) -> int:
        """Tokens of seq's first `num_tokens` that `allocate` would take from the cache
        now (a multiple of S, at most num_tokens - 1). Changes nothing."""
        return len(self._hits(seq, num_tokens)) * self.page_size

    def _hits(self, seq: Sequence, num_tokens: int) -> list[int]:
        # Prompt log-probabilities (not supported yet) will need every position they
        # score computed: such a request sets Sequence.reads_prefix_cache False.
        if not self.enable_caching or not seq.reads_prefix_cache:
            return []
        real = min(num_tokens, seq.num_tokens - seq.num_pending_tokens)
        hits = []
        for i in range((real - 1) // self.page_size):
            p = self._page_of.get(self._page_hash(seq, i))
            if p is None:
                break
            hits.append(p)
        return hits

    def _page_hash(self, seq: Sequence, i: int) -> bytes:
        """Hash of seq's page i (full, of real tokens), extending the sequence's memo."""
        hashes, S = seq.page_hashes, self.page_size
        while len(hashes) <= i:
            j = len(hashes)
            if (j + 1) * S > seq.num_tokens - seq.num_pending_tokens:
                raise RuntimeError(f"seq {seq.seq_id}: page {j} is not full")
            hashes.append(hash_page(hashes[-1] if hashes else _ROOT_HASH,
                                    seq.token_ids[j * S:(j + 1) * S]))
        return hashes[i]

    # ---------------------------------------------------------- allocation
    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether `allocate(seq, num_tokens)` would succeed now."""
        return self._shortfall(seq, num_tokens, self._hits(seq, num_tokens)) <= 0

    def _shortfall(self, seq: Sequence, num_tokens: int, hits: list[int]) -> int:
        # A hit on a free page takes it out of the pool as a fresh page would.
        need = self.pages_for(num_tokens) - len(hits)
        need += sum(p in self._free_cached for p in hits)
        return need - self.num_free_pages

    def allocate(self, seq: Sequence, num_tokens: int) -> int:
        """Give a page-less `seq` the pages for its first `num_tokens` positions: the
        cached prefix by reference, fresh pages after it. Returns the tokens hit."""
        if seq.page_ids:
            raise RuntimeError(f"seq {seq.seq_id} already holds {len(seq.page_ids)} pages")
        if num_tokens < 1:
            raise ValueError(f"allocate needs num_tokens >= 1, got {num_tokens}")
        hits = self._hits(seq, num_tokens)
        short = self._shortfall(seq, num_tokens, hits)
        if short > 0:
            raise RuntimeError(f"seq {seq.seq_id} needs {self.pages_for(num_tokens)} pages "
                               f"({len(hits)} cached), {short} more than are free")
        for p in hits:
            self._free_cached.pop(p, None)
            self._holders.setdefault(p, set()).add(seq.seq_id)
        fresh = [self._take(seq) for _ in range(self.pages_for(num_tokens) - len(hits))]
        seq.page_ids = hits + fresh
        self._published[seq.seq_id] = len(hits)
        return len(hits) * self.page_size

    def _needed(self, seq: Sequence, extra: int = 0) -> int:
        # The next decode step writes KV for position num_tokens - 1 (and, verifying
        # `extra` drafts, for the positions after it).
        return max(0, self.pages_for(seq.num_tokens + extra) - len(seq.page_ids))

    def can_append(self, seq: Sequence, extra: int = 0) -> bool:
        return self._needed(seq, extra) <= self.num_free_pages

    def append_slot(self, seq: Sequence, extra: int = 0) -> None:
        """Make room for the KV of `seq`'s last token and of `extra` draft tokens after
        it: new pages where they cross a boundary."""
        if not seq.page_ids:
            raise RuntimeError(f"seq {seq.seq_id} holds no pages; allocate it first")
        n = self._needed(seq, extra)
        if n > self.num_free_pages:
            raise RuntimeError(f"seq {seq.seq_id} needs {n} pages, "
                               f"{self.num_free_pages} are free")
        seq.page_ids.extend(self._take(seq) for _ in range(n))

    def _take(self, seq: Sequence) -> int:
        """A fresh page: a hashless one if any, else the least recently freed cached one,
        whose hash is dropped (evicted)."""
        if self._free_plain:
            p = self._free_plain.popleft()
        else:
            p, _ = self._free_cached.popitem(last=False)
            del self._page_of[self._hash_of.pop(p)]
        self._holders[p] = {seq.seq_id}
        return p

    # --------------------------------------------------------- publication
    def publish(self, seq: Sequence, num_tokens: int) -> None:
        """Make seq's full pages within its first `num_tokens` positions hit-able. Call it
        only once their KV is written in every layer. A page whose hash another page
        already holds (the same prefix computed twice at once) stays private."""
        if not self.enable_caching:
            return
        n = min(num_tokens // self.page_size, len(seq.page_ids))
        done = self._published.get(seq.seq_id, 0)
        for i in range(done, n):
            h = self._page_hash(seq, i)
            if h not in self._page_of:
                p = seq.page_ids[i]
                self._page_of[h] = p
                self._hash_of[p] = h
        if n > done:
            self._published[seq.seq_id] = n

    def reset_prefix_cache(self) -> bool:
        """Forget every cached page, as vLLM's reset_prefix_cache: only while no sequence
        holds a page (a hash in use cannot be dropped safely). Returns whether it did."""
        if self._holders:
            return False
        self._free_plain.extend(self._free_cached)
        self._free_cached.clear()
        self._hash_of.clear()
        self._page_of.clear()
        return True

    # --------------------------------------------------------------- free
    def truncate(self, seq: Sequence, extra: int = 0) -> None:
        """Frees the pages past what seq's next decode needs (pages_for(num_tokens)),
        with `extra` drafts after it: pages that only drafts wrote (rejected, or dropped
        before the step). They were never published (only positions of seq's real tokens
        are), so they return to the pool hashless; a kept page's rejected positions are
        past seq's length, unread, and rewritten by the next tokens."""
        keep = self.pages_for(seq.num_tokens + extra)
        tail, seq.page_ids = seq.page_ids[keep:], seq.page_ids[:keep]
        for p in reversed(tail):
            if self._holders.get(p) != {seq.seq_id} or p in self._hash_of:
                raise RuntimeError(f"seq {seq.seq_id}: draft page {p} is shared or cached")
            del self._holders[p]
            self._free_plain.appendleft(p)

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s hold on all its pages; a page nobody holds returns to the pool
        (keeping its hash, if published). A second free of the same pages raises."""
        if not seq.page_ids:
            raise RuntimeError(f"seq {seq.seq_id} holds no pages to free")
        if len(set(seq.page_ids)) != len(seq.page_ids):
            raise RuntimeError(f"seq {seq.seq_id} lists a page twice: {seq.page_ids}")
        for p in seq.page_ids:
            if seq.seq_id not in self._holders.get(p, ()):
                raise RuntimeError(f"seq {seq.seq_id} frees page {p} it does not hold")
        for p in reversed(seq.page_ids):  # tail first: evicted first; and a re-admission
            holders = self._holders[p]   # without hits gets the same pages back
            holders.remove(seq.seq_id)
            if holders:
                continue
            del self._holders[p]
            if p in self._hash_of:
                self._free_cached[p] = None
            else:
                self._free_plain.appendleft(p)
        seq.page_ids = []
        self._published.pop(seq.seq_id, None)
