"""The router's bound on concurrent Generate streams, so that no request waits in a hidden queue.

gRPC's thread pool serves one stream per thread, and a request that waits for admission waits on its thread
too. Without a bound, streams beyond the pool queue invisibly inside gRPC, and health checks and status queue
behind them. So the server runs ``max_streams`` + headroom threads (the headroom keeps health, status and quick
rejections answering), and a stream over ``max_streams`` is refused at once with RESOURCE_EXHAUSTED and a
retry-after: when its streams are expected to have freed slots (see ``retry_after_s``), or when the admission
budget the request would join is expected to have room, whichever is later (server.py).
"""

from __future__ import annotations

import threading

from k3serve.router.retry_hint import HINT_LATENESS
from k3serve.router.progress import StreamProgress

MIN_HINT_S = 0.05


class StreamSlots:
    """``ticket_extra``: slots beyond ``max_streams`` that only requests coming back with a retry ticket that holds
    a place may take. A ticket holder's place in the admission line was kept for it, and it was told to come back
    when the place is free; a router full of newcomers that are about to be refused (they only hold a slot for one
    Lua call) must not turn it away again. So ``max_streams`` bounds first attempts, and a refused client's wait
    is its place's, not this router's. Bounded, and within the server's thread headroom (server.py), so health
    and status still answer."""

    def __init__(self, max_streams: int, ticket_extra: int = 0) -> None:
        if max_streams < 1 or ticket_extra < 0:
            raise ValueError(f"need max_streams >= 1 and ticket_extra >= 0, got {max_streams}, {ticket_extra}")
        self.max_streams, self.ticket_extra = max_streams, ticket_extra
        self._lock = threading.Lock()
        self._active: set[StreamProgress] = set()

    def try_acquire(self, progress: StreamProgress, ticket: bool = False) -> bool:
        with self._lock:
            if len(self._active) >= self.max_streams + (self.ticket_extra if ticket else 0):
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
        return max(active[len(active) // 2] * HINT_LATENESS if active else 0.0, MIN_HINT_S)
