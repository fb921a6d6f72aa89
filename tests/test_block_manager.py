"""BlockManager: page accounting, decode growth, slots and misuse detection. Prefix
caching (hashes, sharing, eviction) is in test_prefix_cache.py."""

import pytest

from lp_jax.core.block_manager import BlockManager, pages_for
from lp_jax.core.sequence import Sequence


def seq(seq_id, n):
    return Sequence(seq_id, list(range(n)))


def test_pages_for():
    assert [pages_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_allocate_and_free_round_trip():
    bm = BlockManager(8, 4)
    a, b = seq(0, 9), seq(1, 4)
    assert bm.can_allocate(a, 9) and bm.num_free_pages == 8
    bm.allocate(a, 9)
    bm.allocate(b, 4)
    assert len(a.page_ids) == 3 and len(b.page_ids) == 1
    assert not set(a.page_ids) & set(b.page_ids)
    assert bm.num_free_pages == 4
    assert bm.can_allocate(seq(2, 17), 16) and not bm.can_allocate(seq(2, 17), 17)
    bm.free(a)
    bm.free(b)
    assert a.page_ids == [] and b.page_ids == []
    assert bm.num_free_pages == 8


def test_allocate_refuses_without_changing_state():
    bm = BlockManager(2, 4)
    a = seq(0, 9)
    assert not bm.can_allocate(a, 9)
    with pytest.raises(RuntimeError, match="needs 3 pages"):
        bm.allocate(a, 9)
    assert a.page_ids == [] and bm.num_free_pages == 2
    with pytest.raises(ValueError):
        bm.allocate(a, 0)


def test_allocate_twice_raises():
    bm = BlockManager(4, 4)
    a = seq(0, 3)
    bm.allocate(a, 3)
    with pytest.raises(RuntimeError, match="already holds"):
        bm.allocate(a, 3)
    assert bm.num_free_pages == 3


def test_double_free_raises():
    bm = BlockManager(4, 4)
    a = seq(0, 3)
    bm.allocate(a, 3)
    pages = list(a.page_ids)
    bm.free(a)
    with pytest.raises(RuntimeError, match="no pages"):
        bm.free(a)
    a.page_ids = pages  # a stale copy of the page list
    with pytest.raises(RuntimeError, match="does not hold"):
        bm.free(a)
    assert bm.num_free_pages == 4


def test_free_of_foreign_pages_raises():
    bm = BlockManager(4, 4)
    a, b = seq(0, 3), seq(1, 3)
    bm.allocate(a, 3)
    b.page_ids = list(a.page_ids)
    with pytest.raises(RuntimeError, match="does not hold"):
        bm.free(b)
    a.page_ids = a.page_ids * 2
    with pytest.raises(RuntimeError, match="twice"):
        bm.free(a)
    assert bm.num_free_pages == 3


def test_append_slot_takes_a_page_only_at_a_boundary():
    bm = BlockManager(3, 4)
    a = seq(0, 4)
    bm.allocate(a, 4)  # the prefill writes positions 0..3
    a.token_ids.append(7)  # first output: its KV goes to position 4, a new page
    assert bm.can_append(a)
    bm.append_slot(a)
    assert len(a.page_ids) == 2 and bm.num_free_pages == 1
    for _ in range(3):  # positions 5, 6, 7 stay in the second page
        a.token_ids.append(7)
        bm.append_slot(a)
        assert len(a.page_ids) == 2
    a.token_ids.append(7)  # position 8: third page
    bm.append_slot(a)
    assert len(a.page_ids) == 3 and bm.num_free_pages == 0
    a.token_ids.extend([7] * 4)  # position 12 would need a fourth page
    assert not bm.can_append(a)
    with pytest.raises(RuntimeError):
        bm.append_slot(a)
    assert len(a.page_ids) == 3
    bm.free(a)
    assert bm.num_free_pages == 3


def test_append_slot_needs_an_allocated_sequence():
    bm = BlockManager(3, 4)
    with pytest.raises(RuntimeError, match="allocate"):
        bm.append_slot(seq(0, 2))


def test_freed_pages_are_reused():
    bm = BlockManager(2, 1)
    for i in range(10):
        s = seq(i, 2)
        bm.allocate(s, 2)
        assert sorted(s.page_ids) == [0, 1]
        bm.free(s)
    assert bm.num_free_pages == 2


def test_bad_pool_shape():
    with pytest.raises(ValueError):
        BlockManager(0, 4)
    with pytest.raises(ValueError):
        BlockManager(4, 0)
