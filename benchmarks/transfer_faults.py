"""Fault injection for the transfer path (tests and benches): a `StreamTap` handed to a sender (gRPC payloads)
or a `LandingTap` (Mooncake: the payload was written by the engine, the header is next).

Faults hit the first ``attempts`` attempts of each matching stream, so a retry succeeds; ``attempts=0`` hits
every attempt, so the transfer must end in a clean failure. Killing a receiver or a sender process is done
from outside (the test kills the process); these switches cover what happens inside a stream.

```
 drop_after_chunks = k   the stream is cut (cancelled, like a reset connection) after k chunks
 corrupt_chunk = k       payload byte 0 of chunk k is flipped after its CRC was taken (Mooncake: the landed
                         byte in the receiver's staging is overwritten with its complement)
 stall_after_chunks = k  the stream stops for stall_s after k chunks (past a short deadline)
```
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class SenderFaults:
    drop_after_chunks: int | None = None
    corrupt_chunk: int | None = None
    stall_after_chunks: int | None = None
    stall_s: float = 0.0
    attempts: int = 1  # faults apply to attempts 1..attempts of a stream; 0 = every attempt
    dst_ranks: frozenset[int] | None = None  # only streams to these decode ranks (None: all)

    def __post_init__(self) -> None:
        if self.attempts < 0 or self.stall_s < 0:
            raise ValueError(f"fault attempts and stall_s must be >= 0: {self}")

    def active(self, attempt: int, dst: int) -> bool:
        if not self.any:
            return False
        if self.dst_ranks is not None and dst not in self.dst_ranks:
            return False
        return self.attempts == 0 or attempt <= self.attempts

    @property
    def any(self) -> bool:
        return any(v is not None for v in (self.drop_after_chunks, self.corrupt_chunk, self.stall_after_chunks))

    def inject(self, index: int, chunk, data: bytes, cancel_stream: Callable[[], None],
               pause: Callable[[float], object]) -> bytes | None:
        """The StreamTap hook (transfer/sender.py): chunk `index` of a faulty stream, about to be sent."""
        if self.drop_after_chunks == index:
            cancel_stream()  # like a reset connection: the receiver sees the stream cancelled
            return None
        if self.stall_after_chunks == index:
            pause(self.stall_s)
        if self.corrupt_chunk == index:
            buf = bytearray(data)
            buf[len(buf) - chunk.length] ^= 0xFF  # first payload byte, after its CRC went into the header
            data = bytes(buf)
        return data

    def landed(self, index: int, chunk, corrupt: Callable[[], None], cancel_stream: Callable[[], None],
               pause: Callable[[float], object]) -> bool:
        """The LandingTap hook (transfer/mooncake/sender.py): chunk `index` landed in staging, its header is next."""
        if self.drop_after_chunks == index:
            cancel_stream()
            return False
        if self.stall_after_chunks == index:
            pause(self.stall_s)
        if self.corrupt_chunk == index:
            corrupt()
        return True


NO_FAULTS = SenderFaults()
