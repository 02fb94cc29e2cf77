"""SlotAllocator / PageAllocator semantics, and chained block hashes."""

import hashlib
import hmac
import struct

import pytest
import xxhash

from k3serve.engine.allocators import PageAllocator, SlotAllocator
from k3serve.engine.block_hash import block_hashes, model_fingerprint, prefix_key


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
K0, K1 = prefix_key(7, "deployment-secret-one"), prefix_key(7, "deployment-secret-two")


def _ref_hash(key: bytes, data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, key=key, person=b"k3s-prefix-v1").digest(), "little")


def test_block_hashes_match_the_documented_formula():
    toks = list(range(100, 124))
    key = prefix_key(42, "s" * 32)
    assert key == hmac.new(b"s" * 32, b"k3serve-prefix-v1" + (42).to_bytes(8, "little"), hashlib.sha256).digest()
    h = block_hashes(toks, 8, key, "tenant")
    assert len(h) == 3
    h0 = _ref_hash(key, b"salt" + b"tenant")
    assert h[0] == _ref_hash(key, h0.to_bytes(8, "little") + struct.pack("<8I", *toks[:8]))
    assert h[1] == _ref_hash(key, h[0].to_bytes(8, "little") + struct.pack("<8I", *toks[8:16]))
    assert h[2] == _ref_hash(key, h[1].to_bytes(8, "little") + struct.pack("<8I", *toks[16:24]))


def test_partial_final_block_not_hashed():
    toks = list(range(20))
    assert block_hashes(toks, 8, K0) == block_hashes(toks[:16], 8, K0)
    assert len(block_hashes(toks, 8, K0)) == 2
    assert block_hashes(toks[:7], 8, K0) == []
    assert block_hashes([], 8, K0) == []


def test_earlier_block_change_changes_every_later_hash():
    toks = list(range(40))
    base = block_hashes(toks, 8, K0)
    changed = list(toks)
    changed[3] = 999  # inside block 0
    after = block_hashes(changed, 8, K0)
    assert all(a != b for a, b in zip(base, after))
    changed = list(toks)
    changed[17] = 999  # inside block 2
    after = block_hashes(changed, 8, K0)
    assert after[:2] == base[:2] and all(a != b for a, b in zip(base[2:], after[2:]))


def test_same_block_at_different_positions_hashes_differently():
    block = list(range(8))
    h = block_hashes(block * 3, 8, K0)
    assert len(set(h)) == 3


def test_the_deployment_secret_model_and_salt_each_change_every_hash():
    """Keyed: without the deployment's secret nobody computes (or aims a collision at) a cached block's hash."""
    toks = list(range(32))
    base = block_hashes(toks, 8, K0)
    for other in (block_hashes(toks, 8, K1), block_hashes(toks, 8, prefix_key(8, "deployment-secret-one")),
                  block_hashes(toks, 8, K0, "a-tenant")):
        assert all(x != y for x, y in zip(base, other))
    prev = 0  # the unkeyed xxh64 chain seeded with the fingerprint (what hashes were before keying) differs too
    for i in range(4):
        prev = xxhash.xxh64_intdigest(prev.to_bytes(8, "little") + struct.pack("<8I", *toks[8 * i: 8 * i + 8]))
        assert base[i] != prev


def test_block_hash_input_validation():
    with pytest.raises(ValueError):
        block_hashes([1, 2], 0, K0)
    with pytest.raises(ValueError, match="key"):
        block_hashes([1, 2], 2, 0)  # a bare seed is not a key
    with pytest.raises(ValueError, match="key"):
        block_hashes([1, 2], 2, b"")
    with pytest.raises(ValueError, match="fingerprint"):
        prefix_key(1 << 64, "x")
    with pytest.raises(ValueError, match="token"):
        block_hashes([1, 1 << 32], 2, K0)
    with pytest.raises(ValueError, match="token"):
        block_hashes([-1, 0], 2, K0)


def test_model_fingerprint_canonical_and_distinct():
    a = model_fingerprint({"hidden": 256, "layers": 9, "kda": {"heads": 4}})
    b = model_fingerprint({"layers": 9, "kda": {"heads": 4}, "hidden": 256})
    c = model_fingerprint({"hidden": 256, "layers": 10, "kda": {"heads": 4}})
    assert a == b != c
    assert 0 <= a < 1 << 64
    toks = list(range(16))
    assert block_hashes(toks, 8, prefix_key(a, "s")) != block_hashes(toks, 8, prefix_key(c, "s"))
