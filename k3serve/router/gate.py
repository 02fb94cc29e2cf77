"""The router's admission gate: request class by uncached prompt tokens, budget reservations in Redis.

```
 uncached = prompt - the prefix the serving cluster already holds for this session
            (the session's last prompt, if this prompt extends it, rounded down to a 512-token block end:
             the K3 cache checkpoints the KDA state at the last block end of every prompt)
 class    = classify(uncached)               e.g. short <= 4096 < long
 reserve  = (cluster, class) budget in Redis: wait in the class queue up to max_wait_s, else
            RESOURCE_EXHAUSTED with a retry-after hint; leases renewed while the request streams
```
A warm 1M-token session with a 2K-token turn is therefore a short request. When Redis is unreachable the gate
lets requests through (counted as ``bypassed``): serving continues on the last known membership, and budgets
resume when Redis is back.
"""

from __future__ import annotations

import struct
import threading
from collections import Counter
from collections.abc import Sequence

import redis
import xxhash

from k3serve.router.admission import Admission, AdmissionRejected, ClassSpec, Reservation, classify
from k3serve.router.membership import key_prefix


def prefix_digest(tokens: Sequence[int]) -> str:
    return xxhash.xxh64(struct.pack(f"<{len(tokens)}I", *tokens)).hexdigest()


class AdmissionGate:
    def __init__(self, client: redis.Redis, namespace: str, classes: Sequence[ClassSpec], *, enabled: bool = True,
                 lease_ttl_s: float = 10.0, block_size: int = 512, context_ttl_s: float = 3600.0) -> None:
        self.client, self.classes, self.enabled = client, list(classes), enabled
        self.admission = Admission(client, namespace)
        self.lease_ttl_s, self.block_size, self.context_ttl_s = lease_ttl_s, block_size, context_ttl_s
        self._prefix = key_prefix(namespace)
        self._held: dict[str, Reservation] = {}
        self._lock = threading.Lock()
        self.counters: Counter[str] = Counter()
        self._closed = threading.Event()
        self._renewer = threading.Thread(target=self._renew_loop, name="lease-renewer", daemon=True)
        self._renewer.start()

    # --------------------------------------------------------------------------------------- classification
    def uncached_tokens(self, session: str, prompt: Sequence[int]) -> int:
        """Prompt tokens the serving cluster is not expected to hold for this session."""
        try:
            rec = self.client.get(f"{self._prefix}ctx:{session}")
        except (redis.RedisError, OSError):
            return len(prompt)
        if not rec:
            return len(prompt)
        length_s, _, digest = str(rec).partition(":")
        length = int(length_s)
        if length > len(prompt) or prefix_digest(prompt[:length]) != digest:
            return len(prompt)
        cached = min(length // self.block_size * self.block_size, len(prompt) - 1)
        return len(prompt) - max(cached, 0)

    def record_prompt(self, session: str, prompt: Sequence[int]) -> None:
        """Remember the prompt the session's cluster just prefilled (the next turn's cache estimate)."""
        try:
            self.client.set(f"{self._prefix}ctx:{session}", f"{len(prompt)}:{prefix_digest(prompt)}",
                            px=int(self.context_ttl_s * 1000))
        except (redis.RedisError, OSError):
            pass

    def request_class(self, uncached: int) -> ClassSpec:
        return classify(uncached, self.classes)

    # ------------------------------------------------------------------------------------------ reservations
    def admit(self, cluster: str, request_id: str, uncached: int, cancel: threading.Event | None = None
              ) -> Reservation | None:
        """Reserve `uncached` tokens of the request's class on `cluster`; None when budgets are off or bypassed.

        Raises AdmissionRejected (queue full, or waited max_wait_s).
        """
        if not self.enabled:
            return None
        cls = self.request_class(uncached)
        try:
            res = self.admission.reserve_or_wait(cluster, cls, request_id, max(uncached, 1), self.lease_ttl_s,
                                                 cancel=cancel)
        except AdmissionRejected:
            self.counters[f"rejected:{cls.name}"] += 1
            raise
        except (redis.RedisError, OSError):
            self.counters["bypassed"] += 1
            return None
        self.counters[f"admitted:{cls.name}"] += 1
        with self._lock:
            self._held[request_id] = res
        return res

    def release(self, res: Reservation | None) -> None:
        if res is None:
            return
        with self._lock:
            self._held.pop(res.request_id, None)
        try:
            self.admission.release(res)
        except (redis.RedisError, OSError):
            pass  # the lease expires on its own

    def _renew_loop(self) -> None:
        while not self._closed.wait(self.lease_ttl_s / 3):
            with self._lock:
                held = list(self._held.values())
            if not held:
                continue
            try:
                renewed = self.admission.renew_many(held)
            except (redis.RedisError, OSError):
                continue
            with self._lock:
                for old, new in zip(held, renewed):
                    if new is not None and old.request_id in self._held:
                        self._held[old.request_id] = new

    def class_stats(self, clusters: Sequence[str]) -> dict[str, dict[str, int]]:
        """Per class: in-flight tokens, requests and queued waiters summed over `clusters`."""
        out = {}
        for cls in self.classes:
            tokens = count = queued = 0
            for c in clusters:
                try:
                    load = self.admission.stats(c, cls.name)
                except (redis.RedisError, OSError):
                    continue
                tokens, count, queued = tokens + load.tokens, count + load.count, queued + load.queued
            out[cls.name] = {"inflight_tokens": tokens, "inflight_requests": count, "queued": queued,
                             "rejected": self.counters[f"rejected:{cls.name}"]}
        return out

    def close(self) -> None:
        self._closed.set()
