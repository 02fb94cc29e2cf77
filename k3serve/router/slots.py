"""The router's bound on concurrent Generate streams, so that no request waits in a hidden queue.

gRPC's thread pool serves one stream per thread, and a request that waits for admission waits on its thread
too. Without a bound, streams beyond the pool queue invisibly inside gRPC, and health checks and status queue
behind them. So the server runs ``max_streams`` + headroom threads (the headroom keeps health, status and quick
rejections answering), and a stream over ``max_streams`` is refused at once with RESOURCE_EXHAUSTED and a
retry-after: when the first of this router's streams is expected to end (progress.StreamProgress).
"""

from __future__ import annotations

import threading

from k3serve.router.progress import StreamProgress

MIN_HINT_S = 0.05


class StreamSlots:
    def __init__(self, max_streams: int) -> None:
        if max_streams < 1:
            raise ValueError(f"max_streams must be >= 1, got {max_streams}")
        self.max_streams = max_streams
        self._lock = threading.Lock()
        self._active: set[StreamProgress] = set()

    def try_acquire(self, progress: StreamProgress) -> bool:
        with self._lock:
            if len(self._active) >= self.max_streams:
                return False
            self._active.add(progress)
            return True

    def release(self, progress: StreamProgress) -> None:
        with self._lock:
            self._active.discard(progress)

    def active(self) -> int:
        with self._lock:
            return len(self._active)

    def retry_after_s(self) -> float:
        """When a slot is expected to free: the soonest expected end among this router's streams."""
        with self._lock:
            active = list(self._active)
        return max(min((p.remaining_s() for p in active), default=0.0), MIN_HINT_S)
