"""Where staging buffers come from: the process heap (gRPC plane) or one registered region (data planes).

```
 HeapBuffers      torch.empty per transfer, freed buffers kept in a bounded pool of warm pages (pool_bytes)
 RegionBuffers    one contiguous region, allocated (and registered with the data plane) once; transfers get
                  aligned byte ranges of it, first fit:

   region.base                                                              region.base + size
   |[ t1 kda | t1 mla ]....free....[ t2 kda | t2 mla ][ quarantined (t3, cancelled) ]....free....|
        ^ addresses handed to senders (OpenReply.kda_addr / mla_addr)
```
A range freed while a sender may still be writing into it (the transfer was cancelled or expired, or a
stream was mid-copy) is *quarantined* for `quarantine_s` before reuse: a late remote write then lands in
memory no other transfer owns. A transfer that was installed had every stream's manifest verified, so no
sender writes there any more and its range is free at once.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable

import torch


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class HeapBuffers:
    """Fresh tensors from the heap; released ones are pooled (bounded) so refilling them does not page-fault."""

    def __init__(self, pool_bytes: int) -> None:
        self.pool_bytes = pool_bytes
        self._pool: dict[tuple, list[torch.Tensor]] = {}
        self.pooled = 0

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        free = self._pool.get((shape, dtype))
        if free:
            t = free.pop()
            self.pooled -= _nbytes(t)
            return t
        return torch.empty(shape, dtype=dtype)

    def release(self, t: torch.Tensor, maybe_written: bool) -> None:
        """`t` is no longer staged; `maybe_written`: a stream may still be copying into it (then it is dropped)."""
        n = _nbytes(t)
        if not maybe_written and n and self.pooled + n <= self.pool_bytes:
            self._pool.setdefault((tuple(t.shape), t.dtype), []).append(t)
            self.pooled += n

    def close(self) -> None:
        self._pool.clear()
        self.pooled = 0


class RegionBuffers:
    """Aligned sub-ranges of one pre-touched buffer of `size` bytes (thread-safe).

    `buffer` is the region itself (uint8, `[size]`): register `buffer.data_ptr()` .. `+ size` once."""

    def __init__(self, size: int, align: int = 4096, quarantine_s: float = 120.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if size <= 0 or align <= 0 or align & (align - 1):
            raise ValueError(f"region size must be > 0 and align a power of two, got {size}, {align}")
        self.size, self.align, self.quarantine_s, self._clock = size, align, quarantine_s, clock
        self.buffer = torch.zeros(size, dtype=torch.uint8)  # zeros + the kernel: pages resident before use
        self.buffer.fill_(0)
        self.base = self.buffer.data_ptr()
        self._lock = threading.Lock()
        self._free: list[tuple[int, int]] = [(0, size)]  # sorted (offset, length), coalesced
        self._used: dict[int, int] = {}  # offset -> length
        self._quarantine: list[tuple[float, int, int]] = []  # (release time, offset, length)

    # ------------------------------------------------------------------------------------------- API
    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """A tensor of `shape`/`dtype` inside the region, or None when no free range is large enough."""
        n = 1
        for s in shape:
            n *= s
        need = max(self.align, -(-n * torch.empty((), dtype=dtype).element_size() // self.align) * self.align)
        with self._lock:
            self._release_quarantined()
            for i, (off, length) in enumerate(self._free):
                if length >= need:
                    if length == need:
                        del self._free[i]
                    else:
                        self._free[i] = (off + need, length - need)
                    self._used[off] = need
                    nbytes = n * torch.empty((), dtype=dtype).element_size()
                    return self.buffer[off: off + nbytes].view(dtype).view(shape)
        return None

    def release(self, t: torch.Tensor, maybe_written: bool) -> None:
        """Give a range back: at once, or after `quarantine_s` when a sender may still write into it."""
        off = t.data_ptr() - self.base
        with self._lock:
            length = self._used.pop(off, None)
            if length is None:
                raise ValueError(f"tensor at region offset {off} was not allocated here (or released twice)")
            if maybe_written and self.quarantine_s > 0:
                self._quarantine.append((self._clock(), off, length))
            else:
                self._insert(off, length)

    def address(self, t: torch.Tensor) -> int:
        return t.data_ptr()

    @property
    def used_bytes(self) -> int:
        """Bytes held by live transfers (not counting quarantine)."""
        with self._lock:
            return sum(self._used.values())

    @property
    def quarantined_bytes(self) -> int:
        with self._lock:
            self._release_quarantined()
            return sum(length for _, _, length in self._quarantine)

    def close(self) -> None:
        with self._lock:
            self._free, self._used, self._quarantine = [(0, self.size)], {}, []

    # -------------------------------------------------------------------------------------- internals
    def _release_quarantined(self) -> None:
        now = self._clock()
        keep = []
        for when, off, length in self._quarantine:
            if now - when >= self.quarantine_s:
                self._insert(off, length)
            else:
                keep.append((when, off, length))
        self._quarantine = keep

    def _insert(self, off: int, length: int) -> None:
        i = bisect.bisect_left(self._free, (off, 0))
        self._free.insert(i, (off, length))
        # coalesce with the right, then the left neighbour
        if i + 1 < len(self._free) and off + length == self._free[i + 1][0]:
            self._free[i] = (off, length + self._free[i + 1][1])
            del self._free[i + 1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == off:
            self._free[i - 1] = (self._free[i - 1][0], self._free[i - 1][1] + self._free[i][1])
            del self._free[i]
