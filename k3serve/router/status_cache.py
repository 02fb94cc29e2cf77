"""What ClusterStatus and /metrics report from Redis (pins per cluster, per-class admission state), read by one
background thread every ``interval_s`` and served from the last read.

Counting pins is a SCAN over the pin keys and the class state a script over every (cluster, class): work that
grows with the deployment. Done per call, a client looping ClusterStatus (or a fast scraper) would tie up router
threads and Redis until admission's own scripts time out; done here, its cost is fixed per router whatever the
callers do, and a call costs a dictionary copy.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

STATUS_INTERVAL_S = 2.0


class StatusCache:
    """``pins()``: sessions pinned per cluster; ``classes()``: per-class stats (gate.class_stats' shape)."""

    def __init__(self, pins: Callable[[], dict[str, int]], classes: Callable[[], dict[str, dict[str, int]]],
                 interval_s: float = STATUS_INTERVAL_S) -> None:
        self._read_pins, self._read_classes, self.interval_s = pins, classes, interval_s
        self._pins: dict[str, int] = {}
        self._classes: dict[str, dict[str, int]] = {}
        self.read_at = 0.0  # time.monotonic() of the last completed read (0: none yet)
        self.reads = 0
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.refresh()  # the first answer is a real one
        self._thread = threading.Thread(target=self._loop, name="status", daemon=True)
        self._thread.start()

    def refresh(self) -> None:
        """Read both from Redis now (the sources answer {} themselves when Redis is down)."""
        try:
            pins, classes = self._read_pins(), self._read_classes()
        except Exception as e:  # noqa: BLE001 - status is best effort; the last read stays
            log.warning("status read failed: %s: %s", type(e).__name__, e)
            return
        with self._lock:
            self._pins, self._classes = dict(pins), {k: dict(v) for k, v in classes.items()}
            self.read_at = time.monotonic()
            self.reads += 1

    def _loop(self) -> None:
        while not self._closed.wait(self.interval_s):
            self.refresh()

    def pins(self) -> dict[str, int]:
        with self._lock:
            return dict(self._pins)

    def classes(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {k: dict(v) for k, v in self._classes.items()}

    def close(self) -> None:
        self._closed.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval_s + 10.0)
