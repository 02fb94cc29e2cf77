"""Staging buffers from one registered region: aligned first-fit ranges, coalesced on release, and a
quarantine for ranges a remote sender may still write into."""

from __future__ import annotations

import pytest
import torch

from k3serve.transfer.buffers import HeapBuffers, RegionBuffers


def test_region_ranges_are_aligned_disjoint_and_coalesce():
    region = RegionBuffers(64 << 10, align=4096)
    a = region.alloc((3, 100), torch.float32)  # 1200 B -> one 4 KiB range
    b = region.alloc((5000,), torch.bfloat16)  # 10000 B -> 12 KiB
    assert a.shape == (3, 100) and b.dtype == torch.bfloat16
    offs = sorted(t.data_ptr() - region.base for t in (a, b))
    assert offs == [0, 4096] and region.used_bytes == 16 << 10
    a.fill_(1.0)
    b.fill_(2.0)
    assert torch.all(a == 1.0) and torch.all(b == 2.0)  # no overlap
    assert region.alloc((64 << 10,), torch.uint8) is None  # does not fit beside them
    region.release(a, False)
    region.release(b, False)
    assert region.used_bytes == 0
    with pytest.raises(ValueError, match="released twice"):
        region.release(a, False)
    whole = region.alloc((64 << 10,), torch.uint8)  # the free ranges coalesced back into one
    assert whole is not None and whole.data_ptr() == region.base


def test_quarantined_range_is_reused_only_after_quarantine_s():
    now = [0.0]
    region = RegionBuffers(8192, align=4096, quarantine_s=5.0, clock=lambda: now[0])
    a = region.alloc((4096,), torch.uint8)
    region.alloc((4096,), torch.uint8)
    region.release(a, True)  # a sender may still be writing there
    assert region.used_bytes == 4096 and region.quarantined_bytes == 4096
    assert region.alloc((4096,), torch.uint8) is None
    now[0] = 5.0
    again = region.alloc((4096,), torch.uint8)
    assert again is not None and again.data_ptr() == a.data_ptr() and region.quarantined_bytes == 0


def test_heap_buffers_pool_only_unwritten_buffers_within_budget():
    heap = HeapBuffers(pool_bytes=4096)
    t = heap.alloc((1024,), torch.float32)
    heap.release(t, True)  # maybe still written: dropped
    assert heap.pooled == 0
    heap.release(t, False)
    assert heap.pooled == 4096 and heap.alloc((1024,), torch.float32).data_ptr() == t.data_ptr()
    heap.release(torch.empty(2048), False)  # over the budget: dropped
    assert heap.pooled == 0
