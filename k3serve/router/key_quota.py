"""Per-key quotas, global across router replicas: how many streams one API key (tenant) may hold at once and how
many of its requests may wait inside admission, counted in Redis so that N routers do not give a key N shares.

Each held place is a lease in a Redis sorted set (member: a random lease id, score: expiry in Redis's own ms)::

    k3s:{ns}:quota:{TENANT}:streams   ZSET  lease id -> expiry ms    streams at once (waiting or running)
    k3s:{ns}:quota:{TENANT}:queued    ZSET  lease id -> expiry ms    requests inside admission

Taking a place is one Lua script (purge expired leases, count, add if under the limit), so two routers can never
both take the last place. Each router's renewer re-asserts the leases it holds every ``lease_ttl_s / 3``; a router
that dies renews nothing, and its places come free within ``lease_ttl_s``. A limit of 0 is off (no Redis call).
When Redis cannot be reached the router falls back to its own count (the per-replica limit) and says so in the
log: a Redis outage never refuses requests that this router alone would admit.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import redis

from k3serve.router.membership import key_prefix, ttl_ms

log = logging.getLogger(__name__)

LEASE_TTL_S = 6.0  # a dead router's places come free within this
WARN_EVERY_S = 30.0  # at most one "Redis unreachable" warning per kind this often

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""
# KEYS[1] the tenant's zset; ARGV: lease id, limit, lease ttl ms. Returns {1, held} when taken, {0, held} when full.
_TAKE = _NOW + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local n = redis.call('ZCARD', KEYS[1])
if n >= tonumber(ARGV[2]) then return {0, n} end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], 2 * tonumber(ARGV[3]))
return {1, n + 1}
"""
# KEYS: zsets; ARGV[1] lease ttl ms, ARGV[1 + i] the lease in KEYS[i]. Re-asserts each lease (also one Redis lost).
_RENEW = _NOW + """
local ttl = tonumber(ARGV[1])
for i, k in ipairs(KEYS) do
  redis.call('ZADD', k, now + ttl, ARGV[i + 1])
  redis.call('PEXPIRE', k, 2 * ttl)
end
return #KEYS
"""


@dataclass(frozen=True)
class QuotaLimits:
    """Per key, across every router of the deployment; 0 = no limit."""

    max_streams: int = 0
    max_queued: int = 0

    @classmethod
    def resolve(cls, max_streams: int, max_queued: int, router_streams: int, keys: int,
                routers: int = 1) -> "QuotaLimits":
        """The deploy keys' values. ``max_streams`` 0 means the default: with two or more keys, half of the
        deployment's streams (``routers`` x ``router_streams``; it bounds the key's waiting requests too); with
        fewer keys there is nobody to share with, so no limit (a refusal then would leave streams idle).
        ``max_queued`` is off unless set: it counts every request inside admission, also one admitted at once, so
        a small default would refuse a key's concurrent arrivals while rooms are free."""
        if keys < 2:
            return cls(max_streams, max_queued)
        return cls(max_streams or max(1, routers * router_streams // 2), max_queued)


class QuotaExceeded(Exception):
    """This key holds its share already; the message says which limit."""


class KeyQuota:
    """One router's view of the global per-key quota (client None: this router's own count only)."""

    def __init__(self, limits: QuotaLimits, client: redis.Redis | None = None, namespace: str = "",
                 lease_ttl_s: float = LEASE_TTL_S) -> None:
        self.limits, self.lease_ttl_s = limits, lease_ttl_s
        self._ttl_ms = ttl_ms(lease_ttl_s)
        self._client = client
        self._prefix = key_prefix(namespace) + "quota:" if client is not None else ""
        self._take = client.register_script(_TAKE) if client is not None else None
        self._renew = client.register_script(_RENEW) if client is not None else None
        self._counts: dict[str, Counter[str]] = {"streams": Counter(), "queued": Counter()}
        self._leases: dict[str, str] = {}  # lease id -> its zset, for the renewer
        self._lock = threading.Lock()  # local counts and leases
        self._redis_lock = threading.Lock()  # a release never interleaves with a renewal (which would re-add it)
        self._warned: dict[str, float] = {}
        self._closed = threading.Event()
        self._renewer: threading.Thread | None = None
        if client is not None:
            self._renewer = threading.Thread(target=self._renew_loop, name="quota-renew", daemon=True)
            self._renewer.start()

    @contextmanager
    def stream(self, tenant: str) -> Iterator[None]:
        """Hold one of ``tenant``'s streams for the block; QuotaExceeded when it holds max_streams already."""
        with self._held("streams", tenant, self.limits.max_streams, "streams at once"):
            yield

    @contextmanager
    def queued(self, tenant: str) -> Iterator[None]:
        """Hold one of ``tenant``'s admission-queue places for the block (max_queued)."""
        with self._held("queued", tenant, self.limits.max_queued, "requests waiting for admission"):
            yield

    @contextmanager
    def _held(self, kind: str, tenant: str, limit: int, what: str) -> Iterator[None]:
        counts = self._counts[kind]
        with self._lock:
            if limit and counts[tenant] >= limit:
                raise QuotaExceeded(f"this API key has {limit} {what} (its limit)")
            counts[tenant] += 1
        lease = None
        try:
            if limit and self._client is not None:
                lease = self._take_lease(kind, tenant, limit, what)
            yield
        finally:
            if lease is not None:
                self._release(lease)
            with self._lock:
                counts[tenant] -= 1
                if not counts[tenant]:
                    del counts[tenant]

    def _take_lease(self, kind: str, tenant: str, limit: int, what: str) -> str | None:
        """A lease on one of ``tenant``'s places across routers; None when Redis is unreachable (local count)."""
        key, lease = f"{self._prefix}{tenant}:{kind}", secrets.token_hex(8)
        try:
            taken, held = self._take(keys=[key], args=[lease, limit, self._ttl_ms])
        except (redis.RedisError, OSError) as e:
            self._warn(kind, f"per-key quota falls back to this router's count (Redis: {type(e).__name__}: {e})")
            return None
        if not taken:
            raise QuotaExceeded(f"this API key has {limit} {what} across the routers (its limit)")
        with self._lock:
            self._leases[lease] = key
        return lease

    def _release(self, lease: str) -> None:
        with self._redis_lock:
            with self._lock:
                key = self._leases.pop(lease)
            try:
                self._client.zrem(key, lease)
            except (redis.RedisError, OSError) as e:  # the lease lapses within lease_ttl_s
                self._warn("release", f"a quota lease was not released (Redis: {type(e).__name__}: {e})")

    def _renew_loop(self) -> None:
        while not self._closed.wait(self.lease_ttl_s / 3):
            with self._redis_lock:
                with self._lock:
                    held = list(self._leases.items())
                if not held:
                    continue
                try:
                    self._renew(keys=[k for _, k in held], args=[self._ttl_ms, *(lease for lease, _ in held)])
                except (redis.RedisError, OSError) as e:
                    self._warn("renew", f"quota leases not renewed (Redis: {type(e).__name__}: {e})")

    def _warn(self, kind: str, message: str) -> None:
        now = time.monotonic()
        if now - self._warned.get(kind, -WARN_EVERY_S) >= WARN_EVERY_S:
            self._warned[kind] = now
            log.warning(message)

    def held(self, tenant: str) -> tuple[int, int]:
        """(streams, queued) that ``tenant`` holds on this router now."""
        with self._lock:
            return self._counts["streams"][tenant], self._counts["queued"][tenant]

    def close(self) -> None:
        """Stop renewing (the leases still held lapse within lease_ttl_s)."""
        self._closed.set()
        if self._renewer is not None:
            self._renewer.join(timeout=self.lease_ttl_s + 10.0)
