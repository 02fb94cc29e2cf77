"""Liveness of the cluster calls in flight: the router cuts a call for lack of progress, never for its length.

A generation may legitimately run for hours, so there is no per-call deadline (the client's own deadline, if
any, is forwarded to the cluster and is the client's business). What ends a call as a *cluster* fault is:

* its cluster's heartbeat expired (registered, not alive): the front is gone or wedged;
* a stall: ``stall_timeout_s`` without a message once tokens flow. Before the first token a long prefill may
  take minutes and the cluster's heartbeat is the liveness signal; between tokens a decode step takes
  milliseconds, so a long silence means a stuck cluster.

One watchdog thread per router checks every watched call each ``tick_s`` and cancels the ones that failed;
the stream loop then sees a cancelled call with ``fault`` set and fails over.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import grpc

from k3serve.router.progress import StreamProgress


class Watch:
    """One watched cluster call: ``fault`` is set (before the call is cancelled) when the watchdog cut it."""

    def __init__(self, cluster: str, call: grpc.Future, progress: StreamProgress) -> None:
        self.cluster, self.call, self.progress = cluster, call, progress
        self.fault: str = ""
        self.since = time.monotonic()  # this attempt's start (progress spans failovers)


class Watchdog:
    def __init__(self, alive: Callable[[str], bool], stall_timeout_s: float = 30.0, tick_s: float = 0.25,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if stall_timeout_s <= 0 or tick_s <= 0:
            raise ValueError("stall_timeout_s and tick_s must be > 0")
        self._alive, self.stall_timeout_s, self.tick_s, self._clock = alive, stall_timeout_s, tick_s, clock
        self._lock = threading.Lock()
        self._watches: set[Watch] = set()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="liveness", daemon=True)
        self._thread.start()

    def watch(self, cluster: str, call, progress: StreamProgress) -> Watch:
        w = Watch(cluster, call, progress)
        with self._lock:
            self._watches.add(w)
        return w

    def unwatch(self, w: Watch) -> None:
        with self._lock:
            self._watches.discard(w)

    def check(self) -> None:
        """One pass over the watched calls (the thread's body; tests call it directly)."""
        now = self._clock()
        with self._lock:
            watches = list(self._watches)
        for w in watches:
            p = w.progress
            last = max(p.last_progress, w.since)
            if not self._alive(w.cluster):
                w.fault = f"cluster {w.cluster} stopped heartbeating"
            elif p.first_token_at is not None and now - last > self.stall_timeout_s:
                w.fault = f"no token from {w.cluster} for {now - last:.1f}s (stall timeout {self.stall_timeout_s}s)"
            if w.fault:
                self.unwatch(w)
                w.call.cancel()

    def _run(self) -> None:
        while not self._closed.wait(self.tick_s):
            self.check()

    def close(self) -> None:
        self._closed.set()
