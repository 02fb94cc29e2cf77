"""Budget-based admission per (cluster, request class), shared by all router replicas through Redis (DESIGN.md §7).

Requests are classed by *uncached* prompt tokens (``classify``), so a 1M-token prompt and a 2K one never compete
for one budget. Each (cluster, class) has an in-flight token budget, a concurrency cap and a bounded FIFO queue.
All state lives in Redis and every decision is one Lua script, so budgets hold across replicas and restarts
(DESIGN.md §2.4), and every entry carries a lease, so a crashed router leaks nothing past one TTL.

Keys (``{...}`` is a Redis Cluster hash tag: all keys of one (cluster, class) share a slot; ``ns`` the namespace):

    k3s:{ns}:adm:{CLUSTER/CLASS}:lease   ZSET  request_id -> lease expiry (Redis ms)     in-flight reservations
    k3s:{ns}:adm:{CLUSTER/CLASS}:tok     HASH  request_id -> tokens
    k3s:{ns}:adm:{CLUSTER/CLASS}:q       ZSET  request_id -> arrival sequence number     waiters, FIFO
    k3s:{ns}:adm:{CLUSTER/CLASS}:qlease  ZSET  request_id -> waiter lease expiry (ms)
    k3s:{ns}:adm:{CLUSTER/CLASS}:qtok    HASH  request_id -> tokens wanted
    k3s:{ns}:adm:{CLUSTER/CLASS}:seq     STRING arrival counter

The admission rule, evaluated atomically with Redis's own clock after purging expired leases and waiters:

* ``fits(t)``: nothing of the class is in flight, or (in-flight tokens + t <= budget and count < max_concurrent).
  So a request larger than the whole class budget is admitted only when it would run alone; without that
  exception it could never run at all. While it runs, it alone may exceed the budget.
* No overtaking that delays the oldest waiter: a request that is not the queue head is admitted only if it fits
  *and* the head would still fit after it. Once the head cannot fit (say, an oversized request waiting for the
  class to drain), nothing passes it, in-flight work drains and the head gets in: no request waits forever
  behind a stream of smaller ones. Classes keep sizes similar, so FIFO within a class costs little.
* A request that does not get in joins the queue if it is shorter than ``queue_limit``; a waiter re-polls
  (with jitter) and renews its waiter lease each time, up to ``max_wait_s``; then ``AdmissionRejected`` with a
  retry hint (gRPC ``RESOURCE_EXHAUSTED``).

The class specs are passed with each call, so all router replicas must run with the same specs.
"""

from __future__ import annotations

import operator
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import redis

from k3serve.router.membership import check_id, key_prefix, ttl_ms

__all__ = [
    "ClassSpec",
    "classify",
    "validate_classes",
    "Reservation",
    "ClassLoad",
    "AdmissionRejected",
    "AdmissionConfig",
    "Admission",
]


@dataclass(frozen=True)
class ClassSpec:
    """A request class. ``max_uncached_tokens`` is the class's upper bound (inclusive; None = no bound).

    Budget and caps apply per (cluster, class). ``queue_limit`` 0 means no waiting: reject at once.
    """

    name: str
    max_uncached_tokens: int | None
    inflight_token_budget: int
    max_concurrent: int
    queue_limit: int
    max_wait_s: float

    def __post_init__(self) -> None:
        check_id("class name", self.name)
        if self.max_uncached_tokens is not None and self.max_uncached_tokens < 0:
            raise ValueError(f"class {self.name}: max_uncached_tokens must be >= 0")
        if self.inflight_token_budget <= 0 or self.max_concurrent <= 0:
            raise ValueError(f"class {self.name}: inflight_token_budget and max_concurrent must be > 0")
        if self.queue_limit < 0 or self.max_wait_s < 0:
            raise ValueError(f"class {self.name}: queue_limit and max_wait_s must be >= 0")


def validate_classes(classes: Sequence[ClassSpec]) -> None:
    """ValueError unless there is at least one class, names are unique and at most one class is unbounded."""
    if not classes:
        raise ValueError("at least one request class is needed")
    names = [c.name for c in classes]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate class names: {names}")
    if sum(c.max_uncached_tokens is None for c in classes) > 1:
        raise ValueError("at most one class may have max_uncached_tokens=None")


def classify(uncached_tokens: int, classes: Sequence[ClassSpec]) -> ClassSpec:
    """The class with the smallest ``max_uncached_tokens`` >= ``uncached_tokens``; else the unbounded class;
    else (longer than every bound) the class with the largest bound, so every request has a class."""
    validate_classes(classes)
    if uncached_tokens < 0:
        raise ValueError(f"uncached_tokens must be >= 0, got {uncached_tokens}")
    bounded = sorted((c for c in classes if c.max_uncached_tokens is not None), key=lambda c: c.max_uncached_tokens)
    for c in bounded:
        if uncached_tokens <= c.max_uncached_tokens:
            return c
    unbounded = [c for c in classes if c.max_uncached_tokens is None]
    return unbounded[0] if unbounded else bounded[-1]


@dataclass(frozen=True)
class Reservation:
    """Tokens held in one (cluster, class) budget until released or the lease (Redis time) expires."""

    cluster: str
    cls: str
    request_id: str
    tokens: int
    expires_at: float  # Redis server time, epoch seconds
    lease_ttl_s: float


@dataclass(frozen=True)
class ClassLoad:
    tokens: int  # in-flight tokens
    count: int  # in-flight requests
    queued: int  # waiters


class AdmissionRejected(Exception):
    """Not admitted: ``reason`` is "queue_full", "timeout", "over_budget" (no waiting allowed) or "cancelled".
    Map to gRPC RESOURCE_EXHAUSTED with ``retry_after_s`` as the hint."""

    def __init__(self, retry_after_s: float, message: str, reason: str = "timeout") -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.message = message
        self.reason = reason


@dataclass(frozen=True)
class AdmissionConfig:
    """Waiting behaviour. Waiters poll every U(poll_min_s, poll_max_s) seconds (jitter keeps replicas from
    polling in lock-step); a waiter that stops polling (crashed router) leaves the queue ``queue_lease_s`` later."""

    poll_min_s: float = 0.005
    poll_max_s: float = 0.03
    queue_lease_s: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.poll_min_s <= self.poll_max_s:
            raise ValueError(f"need 0 < poll_min_s <= poll_max_s, got {self}")
        if self.queue_lease_s <= self.poll_max_s:
            raise ValueError("queue_lease_s must exceed poll_max_s, or live waiters would expire between polls")


_LUA_COMMON = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
-- Drop the members of lease zset z whose expiry <= now, and the same members from hash h and zset z2 (if given).
-- In chunks, because unpack() has a stack limit.
local function purge(z, h, z2)
  while true do
    local dead = redis.call('ZRANGEBYSCORE', z, '-inf', now, 'LIMIT', 0, 500)
    if #dead == 0 then return end
    redis.call('ZREM', z, unpack(dead))
    redis.call('HDEL', h, unpack(dead))
    if z2 then redis.call('ZREM', z2, unpack(dead)) end
  end
end
local function inflight(lease, tok)
  local sum = 0
  for _, v in ipairs(redis.call('HVALS', tok)) do sum = sum + tonumber(v) end
  return sum, redis.call('ZCARD', lease)
end
"""

# KEYS: lease, tok, q, qlease, qtok, seq.
# ARGV: request_id, tokens, budget, max_concurrent, lease_ms, mode (0 try, 1 wait), queue_limit, qlease_ms.
# Returns {status, inflight tokens, inflight count, queue length, lease expiry ms}
# status: 1 reserved, 0 not reserved (mode 0), 2 queued / still waiting, 3 queue full.
_RESERVE = _LUA_COMMON + """
local rid, tokens = ARGV[1], tonumber(ARGV[2])
local budget, maxc, lease_ms = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local mode, qlimit, qlease_ms = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
purge(KEYS[1], KEYS[2])
purge(KEYS[4], KEYS[5], KEYS[3])
local sum, count = inflight(KEYS[1], KEYS[2])
if redis.call('ZSCORE', KEYS[1], rid) then
  -- a retried call (e.g. the reply was lost): the reservation exists, renew it
  redis.call('ZADD', KEYS[1], now + lease_ms, rid)
  return {1, sum, count, redis.call('ZCARD', KEYS[3]), now + lease_ms}
end
local function fits(t, s, c) return c == 0 or (s + t <= budget and c < maxc) end
local ok = fits(tokens, sum, count)
if ok then
  local head = redis.call('ZRANGE', KEYS[3], 0, 0)
  if #head > 0 and head[1] ~= rid then
    local ht = tonumber(redis.call('HGET', KEYS[5], head[1]) or '0')
    ok = fits(ht, sum + tokens, count + 1)
  end
end
if ok then
  redis.call('ZADD', KEYS[1], now + lease_ms, rid)
  redis.call('HSET', KEYS[2], rid, ARGV[2])
  redis.call('ZREM', KEYS[3], rid)
  redis.call('ZREM', KEYS[4], rid)
  redis.call('HDEL', KEYS[5], rid)
  return {1, sum + tokens, count + 1, redis.call('ZCARD', KEYS[3]), now + lease_ms}
end
local qlen = redis.call('ZCARD', KEYS[3])
if mode == 0 then return {0, sum, count, qlen, 0} end
if redis.call('ZSCORE', KEYS[4], rid) then
  redis.call('ZADD', KEYS[4], now + qlease_ms, rid)
  return {2, sum, count, qlen, 0}
end
if qlen >= qlimit then return {3, sum, count, qlen, 0} end
redis.call('ZADD', KEYS[3], redis.call('INCR', KEYS[6]), rid)
redis.call('ZADD', KEYS[4], now + qlease_ms, rid)
redis.call('HSET', KEYS[5], rid, ARGV[2])
return {2, sum, count, qlen + 1, 0}
"""

# KEYS: lease, tok. ARGV: request_id, lease_ms. Returns the new expiry (ms), or 0 when the lease is gone or expired
# (an expired lease is never revived: its tokens may already be promised to someone else).
_RENEW = _LUA_COMMON + """
purge(KEYS[1], KEYS[2])
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
return now + tonumber(ARGV[2])
"""

# KEYS: lease, tok, q, qlease, qtok. Returns {inflight tokens, inflight count, queue length}.
_STATS = _LUA_COMMON + """
purge(KEYS[1], KEYS[2])
purge(KEYS[4], KEYS[5], KEYS[3])
local sum, count = inflight(KEYS[1], KEYS[2])
return {sum, count, redis.call('ZCARD', KEYS[3])}
"""

_OK, _NO, _QUEUED, _FULL = 1, 0, 2, 3


class Admission:
    """Admission control over one Redis, under one deployment namespace. No state of its own beyond the client
    and a jitter RNG: any number of instances and router processes share budgets through Redis. Thread-safe as
    far as the redis-py client is (its connection pool is)."""

    def __init__(
        self,
        client: redis.Redis,
        namespace: str,
        config: AdmissionConfig = AdmissionConfig(),
        rng: random.Random | None = None,
        sleep=time.sleep,
        clock=time.monotonic,
    ) -> None:
        self._r = client
        self.prefix = key_prefix(namespace)
        self.config = config
        self._rng = rng if rng is not None else random.Random()
        self._rng_lock = threading.Lock()
        self._sleep = sleep
        self._clock = clock
        self._reserve = client.register_script(_RESERVE)
        self._renew = client.register_script(_RENEW)
        self._stats = client.register_script(_STATS)

    # ------------------------------------------------------------------------------------------- keys
    def keys(self, cluster: str, cls: str) -> dict[str, str]:
        """The six keys of one (cluster, class) budget, by role."""
        check_id("cluster id", cluster)
        check_id("class name", cls)
        base = f"{self.prefix}adm:{{{cluster}/{cls}}}:"
        return {k: base + k for k in ("lease", "tok", "q", "qlease", "qtok", "seq")}

    # ---------------------------------------------------------------------------------- reservations
    def _call_reserve(self, cluster, cls: ClassSpec, request_id, tokens, lease_ttl_s, mode):
        try:
            tokens = operator.index(tokens)  # ints, numpy ints; not floats
        except TypeError:
            raise ValueError(f"tokens must be an integer, got {tokens!r}") from None
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        if not request_id:
            raise ValueError("empty request_id")
        k = self.keys(cluster, cls.name)
        raw = self._reserve(
            keys=[k["lease"], k["tok"], k["q"], k["qlease"], k["qtok"], k["seq"]],
            args=[request_id, tokens, cls.inflight_token_budget, cls.max_concurrent, ttl_ms(lease_ttl_s), mode,
                  cls.queue_limit, ttl_ms(self.config.queue_lease_s)],
        )  # fmt: skip
        status, _sum, _count, qlen, expiry_ms = (int(x) for x in raw)
        res = None
        if status == _OK:
            res = Reservation(cluster, cls.name, request_id, tokens, expiry_ms / 1000.0, lease_ttl_s)
        return status, res, qlen

    def try_reserve(
        self, cluster: str, cls: ClassSpec, request_id: str, tokens: int, lease_ttl_s: float
    ) -> Reservation | None:
        """Reserve ``tokens`` of ``cls``'s budget on ``cluster`` now, or None (never waits, never queues).

        Idempotent per ``request_id``: calling again while the reservation is held renews it and returns it."""
        _, res, _ = self._call_reserve(cluster, cls, request_id, tokens, lease_ttl_s, 0)
        return res

    def reserve_or_wait(
        self,
        cluster: str,
        cls: ClassSpec,
        request_id: str,
        tokens: int,
        lease_ttl_s: float,
        *,
        max_wait_s: float | None = None,
        cancel: threading.Event | None = None,
    ) -> Reservation:
        """Reserve, waiting in the class queue up to ``max_wait_s`` (default ``cls.max_wait_s``).

        Raises AdmissionRejected: "queue_full" when the queue already holds ``queue_limit`` waiters, "timeout"
        after the wait, "over_budget" when waiting is disabled (max wait 0), "cancelled" when ``cancel`` is set.
        The waiter leaves the queue on every exit path (and its lease clears it if this process dies).
        """
        wait = cls.max_wait_s if max_wait_s is None else max_wait_s
        mode = 1 if wait > 0 else 0
        status, res, qlen = self._call_reserve(cluster, cls, request_id, tokens, lease_ttl_s, mode)
        if status == _OK:
            return res
        if status == _NO:
            raise self._rejected(cls, "over_budget", f"{cls.name} on {cluster}: over budget and no waiting allowed")
        if status == _FULL:
            raise self._rejected(cls, "queue_full", f"{cls.name} on {cluster}: queue full ({qlen} waiting)")
        deadline = self._clock() + wait
        try:
            while True:
                now = self._clock()
                if cancel is not None and cancel.is_set():
                    raise self._rejected(cls, "cancelled", f"{request_id} cancelled while queued for {cls.name}")
                if now >= deadline:
                    raise self._rejected(
                        cls, "timeout", f"{cls.name} on {cluster}: not admitted within {wait:.3g}s ({qlen} waiting)"
                    )
                self._sleep(min(self._jitter(), deadline - now))
                status, res, qlen = self._call_reserve(cluster, cls, request_id, tokens, lease_ttl_s, 1)
                if status == _OK:
                    return res
                # _FULL here means our waiter lease lapsed (a stall longer than queue_lease_s) and the queue filled
                # meanwhile: give up like any other newcomer would.
                if status == _FULL:
                    raise self._rejected(cls, "queue_full", f"{cls.name} on {cluster}: lost its place in a full queue")
        except BaseException:
            self._leave_queue(cluster, cls.name, request_id)
            raise

    def renew(self, reservation: Reservation, lease_ttl_s: float | None = None) -> Reservation | None:
        """Extend the lease by ``lease_ttl_s`` (default: the reservation's) from now; None when the lease was
        already gone (expired or released): the caller no longer holds budget and should re-reserve or fail."""
        ttl = reservation.lease_ttl_s if lease_ttl_s is None else lease_ttl_s
        k = self.keys(reservation.cluster, reservation.cls)
        expiry = int(self._renew(keys=[k["lease"], k["tok"]], args=[reservation.request_id, ttl_ms(ttl)]))
        if expiry == 0:
            return None
        return Reservation(reservation.cluster, reservation.cls, reservation.request_id, reservation.tokens,
                           expiry / 1000.0, ttl)  # fmt: skip

    def renew_many(self, reservations: Sequence[Reservation]) -> list[Reservation | None]:
        """``renew`` for every reservation a router holds, in one round trip (a pipeline of script calls)."""
        pipe = self._r.pipeline(transaction=False)
        for r in reservations:
            k = self.keys(r.cluster, r.cls)
            self._renew(keys=[k["lease"], k["tok"]], args=[r.request_id, ttl_ms(r.lease_ttl_s)], client=pipe)
        out: list[Reservation | None] = []
        for r, expiry in zip(reservations, pipe.execute(), strict=True):
            expiry = int(expiry)
            out.append(
                None if expiry == 0 else Reservation(r.cluster, r.cls, r.request_id, r.tokens, expiry / 1000.0,
                                                     r.lease_ttl_s)  # fmt: skip
            )
        return out

    def release(self, reservation: Reservation) -> bool:
        """Return the tokens to the budget. Idempotent: True if this call released them, False if they were
        already gone (released before, or the lease expired)."""
        k = self.keys(reservation.cluster, reservation.cls)
        pipe = self._r.pipeline(transaction=True)
        pipe.zrem(k["lease"], reservation.request_id)
        pipe.hdel(k["tok"], reservation.request_id)
        removed, _ = pipe.execute()
        return bool(removed)

    # ---------------------------------------------------------------------------------------- reads
    def stats(self, cluster: str, cls: str) -> ClassLoad:
        """In-flight tokens and requests and queue length of one (cluster, class), expired leases purged first."""
        k = self.keys(cluster, cls)
        tokens, count, queued = self._stats(keys=[k["lease"], k["tok"], k["q"], k["qlease"], k["qtok"]])
        return ClassLoad(int(tokens), int(count), int(queued))

    def inflight(self, cluster: str, cls: str) -> tuple[int, int]:
        """(in-flight tokens, in-flight requests) of one (cluster, class)."""
        s = self.stats(cluster, cls)
        return s.tokens, s.count

    # ------------------------------------------------------------------------------------- internals
    def _leave_queue(self, cluster: str, cls: str, request_id: str) -> None:
        """Best effort: if Redis is unreachable the waiter lease removes the entry anyway."""
        k = self.keys(cluster, cls)
        try:
            pipe = self._r.pipeline(transaction=True)
            pipe.zrem(k["q"], request_id)
            pipe.zrem(k["qlease"], request_id)
            pipe.hdel(k["qtok"], request_id)
            pipe.execute()
        except (redis.RedisError, OSError):
            pass

    def _jitter(self) -> float:
        with self._rng_lock:
            return self._rng.uniform(self.config.poll_min_s, self.config.poll_max_s)

    def _rejected(self, cls: ClassSpec, reason: str, message: str) -> AdmissionRejected:
        # The queue turns over in about max_wait_s; jitter the hint (x0.5..1.5) so rejected clients do not all
        # come back at the same instant.
        with self._rng_lock:
            hint = max(cls.max_wait_s, 0.1) * self._rng.uniform(0.5, 1.5)
        return AdmissionRejected(round(hint, 3), message, reason)
