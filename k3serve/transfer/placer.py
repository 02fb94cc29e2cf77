"""A receiver stream's chunk placement on a worker thread, beside the handler thread that reads messages.

```
 handler thread (grpcio)  next(msg 0)  decode  submit(0)  next(msg 1)  decode  submit(1)  next(msg 2) ...
 place worker                                  [copy+CRC 0 ................]  [copy+CRC 1 ..........]
                                               at most `depth` chunks of a stream in flight: the handler
                                               waits for the oldest before it submits another
 manifest: drain() (every placement done, its error raised) -> StagingStore.finish
```
On a host where the transfer is CPU-bound but a core is idle (one sender, one receiver, two cores), grpcio
assembles the next message while the previous one is copied and CRC'd: the copy and CRC32C release the GIL
(numpy, google_crc32c), so the two run on different cores. A placement's error (DATA_LOSS, a header that does
not match the plan) comes out of the next submit() or drain(), so the stream fails as it did inline; close()
waits for whatever is still running (the staging's writer count covers a stream that fails mid-copy).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait


class StreamPlacer:
    """One Push stream's placements. Not thread-safe: the stream's handler thread alone calls it."""

    def __init__(self, pool: ThreadPoolExecutor, depth: int = 2) -> None:
        """pool: the receiver's placement workers (shared by its streams); depth: chunks in flight (0: place
        inline, in the handler thread, as before the workers existed)."""
        if depth < 0:
            raise ValueError(f"StreamPlacer depth must be >= 0, got {depth}")
        self._pool, self._depth = pool, depth
        self._pending: deque[Future] = deque()
        self.applied = 0  # placements done that applied a chunk (a duplicate of a verified transfer did not)

    def submit(self, place: Callable[[], bool]) -> None:
        """Run `place` (returns whether it applied a chunk) on a worker; raises an earlier placement's error."""
        if self._depth == 0:
            self.applied += bool(place())
            return
        while len(self._pending) >= self._depth:
            self._collect(self._pending.popleft())
        self._pending.append(self._pool.submit(place))

    def drain(self) -> int:
        """Wait for every placement; raises the first error. Returns the chunks applied so far."""
        while self._pending:
            self._collect(self._pending.popleft())
        return self.applied

    def close(self) -> None:
        """Wait for placements still running (after a failure: their results no longer matter)."""
        wait(list(self._pending))
        self._pending.clear()

    def _collect(self, f: Future) -> None:
        self.applied += bool(f.result())
