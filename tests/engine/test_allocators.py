"""SlotAllocator / PageAllocator semantics, and chained block hashes."""

import struct

import pytest
import xxhash

from k3serve.engine.allocators import PageAllocator, SlotAllocator
from k3serve.engine.block_hash import block_hashes, model_fingerprint


# ------------------------------------------------------------------------------------------------- slots
def test_slots_alloc_until_exhausted_then_none():
    s = SlotAllocator(3)
    assert (s.capacity, s.num_free, s.num_used) == (3, 3, 0)
    assert [s.alloc(), s.alloc(), s.alloc()] == [0, 1, 2]
    assert s.alloc() is None
    assert (s.num_free, s.num_used) == (0, 3)


def test_slots_free_reuses_lowest_first():
    s = SlotAllocator(4)
    for _ in range(4):
        s.alloc()
    s.free(2)
    s.free(0)
    assert s.is_used(1) and not s.is_used(0)
    assert s.alloc() == 0 and s.alloc() == 2 and s.alloc() is None


def test_slots_double_free_and_unknown_raise():
    s = SlotAllocator(2)
    a = s.alloc()
    s.free(a)
    with pytest.raises(ValueError, match="double free"):
        s.free(a)
    with pytest.raises(ValueError, match="unknown"):
        s.free(7)
    with pytest.raises(ValueError, match="unknown"):
        s.free(-1)
    assert s.num_free == 2


def test_slots_negative_capacity_raises():
    with pytest.raises(ValueError):
        SlotAllocator(-1)
    assert SlotAllocator(0).alloc() is None


# ------------------------------------------------------------------------------------------------- pages
def test_pages_all_or_nothing():
    p = PageAllocator(5)
    assert p.alloc(3) == [0, 1, 2]
    assert p.alloc(3) is None  # only 2 free: nothing is taken
    assert p.num_free == 2 and p.num_used == 3
    assert p.alloc(2) == [3, 4]
    assert p.alloc(0) == []
    with pytest.raises(ValueError):
        p.alloc(-1)


def test_pages_refcounts_free_at_zero():
    p = PageAllocator(4)
    a = p.alloc(2)
    assert [p.refcount(x) for x in a] == [1, 1]
    p.incref(a)
    p.incref([a[0]])
    assert [p.refcount(x) for x in a] == [3, 2]
    p.decref(a)
    assert p.num_free == 2  # still referenced
    p.decref(a)
    assert p.refcount(a[0]) == 1 and p.refcount(a[1]) == 0 and p.num_free == 3
    p.decref([a[0]])
    assert p.num_free == 4 and p.capacity == 4 and p.num_used == 0


def test_pages_errors_leave_state_unchanged():
    p = PageAllocator(4)
    a = p.alloc(2)
    with pytest.raises(ValueError, match="free"):
        p.decref([3])
    with pytest.raises(ValueError):
        p.decref([a[0], a[0]])  # two releases, one reference: nothing changes
    assert p.refcount(a[0]) == 1
    with pytest.raises(ValueError, match="incref of free"):
        p.incref([a[1], 3])
    assert p.refcount(a[1]) == 1
    with pytest.raises(ValueError, match="unknown"):
        p.refcount(4)
    with pytest.raises(ValueError, match="unknown"):
        p.incref([-1])


def test_pages_freed_page_is_reallocated():
    p = PageAllocator(2)
    a = p.alloc(2)
    p.decref([a[1]])
    assert p.alloc(1) == [a[1]] and p.refcount(a[1]) == 1


# ------------------------------------------------------------------------------------------------ hashes
def _ref_hash(prev: int, block: list[int]) -> int:
    return xxhash.xxh64_intdigest(prev.to_bytes(8, "little") + struct.pack(f"<{len(block)}I", *block))


def test_block_hashes_match_the_documented_formula():
    toks = list(range(100, 124))
    h = block_hashes(toks, 8, seed=42)
    assert len(h) == 3
    assert h[0] == _ref_hash(42, toks[:8])
    assert h[1] == _ref_hash(h[0], toks[8:16])
    assert h[2] == _ref_hash(h[1], toks[16:24])


def test_partial_final_block_not_hashed():
    toks = list(range(20))
    assert block_hashes(toks, 8, 0) == block_hashes(toks[:16], 8, 0)
    assert len(block_hashes(toks, 8, 0)) == 2
    assert block_hashes(toks[:7], 8, 0) == []
    assert block_hashes([], 8, 0) == []


def test_earlier_block_change_changes_every_later_hash():
    toks = list(range(40))
    base = block_hashes(toks, 8, 0)
    changed = list(toks)
    changed[3] = 999  # inside block 0
    after = block_hashes(changed, 8, 0)
    assert all(a != b for a, b in zip(base, after))
    changed = list(toks)
    changed[17] = 999  # inside block 2
    after = block_hashes(changed, 8, 0)
    assert after[:2] == base[:2] and all(a != b for a, b in zip(base[2:], after[2:]))


def test_same_block_at_different_positions_hashes_differently():
    block = list(range(8))
    h = block_hashes(block * 3, 8, 0)
    assert len(set(h)) == 3


def test_seed_changes_all_hashes():
    toks = list(range(32))
    a, b = block_hashes(toks, 8, 1), block_hashes(toks, 8, 2)
    assert all(x != y for x, y in zip(a, b))


def test_block_hash_input_validation():
    with pytest.raises(ValueError):
        block_hashes([1, 2], 0, 0)
    with pytest.raises(ValueError):
        block_hashes([1, 2], 2, -1)
    with pytest.raises(ValueError):
        block_hashes([1, 2], 2, 1 << 64)
    with pytest.raises(ValueError, match="token"):
        block_hashes([1, 1 << 32], 2, 0)
    with pytest.raises(ValueError, match="token"):
        block_hashes([-1, 0], 2, 0)


def test_model_fingerprint_canonical_and_distinct():
    a = model_fingerprint({"hidden": 256, "layers": 9, "kda": {"heads": 4}})
    b = model_fingerprint({"layers": 9, "kda": {"heads": 4}, "hidden": 256})
    c = model_fingerprint({"hidden": 256, "layers": 10, "kda": {"heads": 4}})
    assert a == b != c
    assert 0 <= a < 1 << 64
    toks = list(range(16))
    assert block_hashes(toks, 8, a) != block_hashes(toks, 8, c)
