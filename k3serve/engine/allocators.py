"""Driver-side allocators for the two state pools (docs/architecture.md §7, §10).

Pure bookkeeping, no tensors: the scheduler decides which KDA state slot and which MLA pages a request uses and
sends copy/zero operations to the workers separately. Both allocators hand out the lowest free id first, so a
schedule is reproducible run to run (tests and failover replays compare slot/page ids).
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable


class SlotAllocator:
    """KDA state slots: one per running request, plus the prefix cache's immutable checkpoint slots.

    A slot is either free or used; who uses it (a request or the prefix cache) is the caller's bookkeeping.
    """

    def __init__(self, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self._capacity = num_slots
        self._free: list[int] = list(range(num_slots))  # a min-heap; already sorted, so already a heap
        self._used: set[int] = set()

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def is_used(self, slot: int) -> bool:
        """True when ``slot`` is currently allocated."""
        return slot in self._used

    def alloc(self) -> int | None:
        """Take the lowest free slot; None when the pool is exhausted (the caller evicts or waits)."""
        if not self._free:
            return None
        slot = heapq.heappop(self._free)
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        """Return ``slot`` to the pool. Freeing a free or unknown slot raises ValueError (a bookkeeping bug)."""
        if slot not in self._used:
            if 0 <= slot < self._capacity:
                raise ValueError(f"double free of KDA slot {slot}")
            raise ValueError(f"unknown KDA slot {slot} (capacity {self._capacity})")
        self._used.remove(slot)
        heapq.heappush(self._free, slot)


class PageAllocator:
    """MLA pages with reference counts.

    A page is shared by every request whose prompt prefix covers it and by the prefix cache; it returns to the
    free list only when the last holder releases it. ``incref``/``decref`` validate the whole batch before
    changing anything, so a bad call leaves the allocator as it was.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        self._capacity = num_pages
        self._free: list[int] = list(range(num_pages))  # min-heap
        self._refs: list[int] = [0] * num_pages

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self._capacity - len(self._free)

    def refcount(self, page: int) -> int:
        """Number of holders of ``page`` (0 when free)."""
        self._check_id(page)
        return self._refs[page]

    def alloc(self, n: int) -> list[int] | None:
        """Take ``n`` pages, each with refcount 1, lowest ids first; None (nothing taken) if fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            return None
        pages = [heapq.heappop(self._free) for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        """Add one reference per occurrence in ``pages``; every page must be allocated (ValueError otherwise)."""
        pages = list(pages)
        for p in pages:
            self._check_id(p)
            if self._refs[p] == 0:
                raise ValueError(f"incref of free MLA page {p}")
        for p in pages:
            self._refs[p] += 1

    def decref(self, pages: Iterable[int]) -> None:
        """Drop one reference per occurrence in ``pages``; a page reaching 0 is free again.

        Releasing more references than a page has (e.g. decref of a free page) raises ValueError.
        """
        counts = Counter(pages)
        for p, c in counts.items():
            self._check_id(p)
            if self._refs[p] == 0:
                raise ValueError(f"decref of free MLA page {p}")
            if self._refs[p] < c:
                raise ValueError(f"decref of MLA page {p}: {c} release(s) but refcount {self._refs[p]}")
        for p, c in counts.items():
            self._refs[p] -= c
            if self._refs[p] == 0:
                heapq.heappush(self._free, p)

    def _check_id(self, page: int) -> None:
        if not 0 <= page < self._capacity:
            raise ValueError(f"unknown MLA page {page} (capacity {self._capacity})")
