"""The router's bound on concurrent Generate streams, so that no request waits in a hidden queue.

gRPC serves one stream per thread, and a request waiting for admission waits on its thread too: streams beyond
the pool would queue invisibly inside gRPC, with health checks and status behind them. So the server runs
``max_streams`` + headroom threads (for health, status and quick rejections) and refuses a stream over
``max_streams`` at once with RESOURCE_EXHAUSTED and a retry-after: when its streams are expected to have freed
slots (``retry_after_s``) or the admission budget it would join to have room, whichever is later (server.py).
"""

from __future__ import annotations

import threading

from k3serve.router.progress import StreamProgress
from k3serve.router.retry_hint import HINT_LATENESS, MIN_RETRY_AFTER_S


class StreamSlots:
    def __init__(self, max_streams: int) -> None:
        if max_streams < 1:
            raise ValueError(f"need max_streams >= 1, got {max_streams}")
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

    def pending_on(self, cluster: str) -> int:
        """This router's streams bound for ``cluster`` that have not reached admission yet."""
        with self._lock:
            return sum(p.pending_on == cluster for p in self._active)

    def retry_after_s(self) -> float:
        """When slots are expected to free: the median expected end among this router's streams. Not the
        soonest: the first slot to free goes to whichever client comes back first, and a full router has many
        refused clients; by the median end half of the slots are free."""
        with self._lock:
            active = sorted(p.remaining_s() for p in self._active)
        # scaled late like admission's hints (HINT_LATENESS, router/retry_hint.py): the estimates run early in a burst
        return max(active[len(active) // 2] * HINT_LATENESS if active else 0.0, MIN_RETRY_AFTER_S)
