"""Cluster registry and health in Redis, plus the router's cached view and per-cluster circuit breaker (docs/architecture.md §11).

Cluster agents write; routers read. Keys (``ns`` = deployment namespace, so tests and deployments sharing one
Redis never collide):

    k3s:{ns}:clusters        SET   ids of registered clusters (pruned lazily once a registration expired)
    k3s:{ns}:reg:{cluster}   HASH  endpoints (JSON), sig, ttl_ms, registered_ms, last_ms   -- PX ttl_ms, renewed
                                   by every heartbeat; gone => the cluster is forgotten
    k3s:{ns}:hb:{cluster}    HASH  load (JSON), ts_ms                                 -- PX heartbeat ttl;
                                   present => the cluster is alive, expired => dead

Timestamps come from Redis ``TIME`` inside the scripts, so ages are comparable without synchronised clocks.
The scripts are atomic but build key names from set members, so they assume one Redis instance (or one
Sentinel-managed primary), not Redis Cluster.

Signed: ``sig`` is HMAC-SHA256(deployment secret, namespace, cluster id, endpoints JSON). Readers drop an entry
whose signature does not verify (counted in ``Membership.forged``), so a process that can write Redis but does
not hold the secret cannot register a cluster that routers would send prompts to. Loads are not signed: a
forged load can skew balancing, not redirect a request.

Router side: ``MembershipView`` caches the last successful read so that routing continues on the last known
membership while Redis is unreachable (``stale=True``), and a ``CircuitBreaker`` removes a cluster at its first
gRPC failure, long before its heartbeat key would expire.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
import logging
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import redis

__all__ = [
    "key_prefix",
    "check_id",
    "ttl_ms",
    "ClusterInfo",
    "Membership",
    "MembershipSnapshot",
    "MembershipView",
    "BreakerConfig",
    "CircuitBreaker",
    "ClusterState",
]

log = logging.getLogger(__name__)
_ID_RE = re.compile(r"[A-Za-z0-9_.\-]{1,64}")  # fullmatch: `$` lets a trailing newline by


def check_id(kind: str, value: str) -> str:
    """Validate a namespace / cluster id / class name used inside Redis key names (ValueError otherwise).

    Restricted to ``[A-Za-z0-9_.-]{1,64}`` so key names stay unambiguous (no ``:``) and contain no ``{}``,
    which Redis Cluster would read as hash tags.
    """
    if not isinstance(value, str) or not _ID_RE.fullmatch(value):
        raise ValueError(f"{kind} must match [A-Za-z0-9_.-]{{1,64}}, got {value!r}")
    return value


def key_prefix(namespace: str) -> str:
    """``"k3s:{namespace}:"``: every key this package writes starts with it."""
    return f"k3s:{check_id('namespace', namespace)}:"


def ttl_ms(ttl_s: float) -> int:
    """Seconds to a positive whole number of milliseconds (Redis PX/PEXPIRE); ValueError below 1 ms."""
    ms = int(round(ttl_s * 1000))
    if ms <= 0:
        raise ValueError(f"ttl must be > 0 s (at least 1 ms), got {ttl_s}")
    return ms


# KEYS: reg, hb, clusters set. ARGV: id, endpoints json, reg ttl ms, hb ttl ms, signature.
_REGISTER = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'endpoints', ARGV[2], 'sig', ARGV[5], 'ttl_ms', ARGV[3], 'registered_ms', now,
           'last_ms', now)
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], 'load', '{}', 'ts_ms', now)
redis.call('PEXPIRE', KEYS[2], ARGV[4])
redis.call('SADD', KEYS[3], ARGV[1])
return now
"""

# KEYS: reg, hb. ARGV: load json, hb ttl ms. Returns 0 when the registration is gone (the agent must register
# again: a heartbeat alone cannot resurrect a cluster whose endpoints nobody knows any more).
_HEARTBEAT = """
local reg_ttl = redis.call('HGET', KEYS[1], 'ttl_ms')
if not reg_ttl then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', KEYS[1], 'last_ms', now)
redis.call('PEXPIRE', KEYS[1], reg_ttl)
redis.call('HSET', KEYS[2], 'load', ARGV[1], 'ts_ms', now)
redis.call('PEXPIRE', KEYS[2], ARGV[2])
return 1
"""

# KEYS: clusters set. ARGV: key prefix. Returns {now_ms, id, endpoints, last_ms, alive(0/1), load|'', sig|'', ...}.
# One atomic snapshot; ids whose registration expired are removed from the set here, inside the script, so a
# concurrent re-register (SADD after its HSET) can never be undone by a router's cleanup.
_SCAN = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {now}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local reg = redis.call('HMGET', ARGV[1] .. 'reg:' .. id, 'endpoints', 'last_ms', 'sig')
  if not reg[1] then
    redis.call('SREM', KEYS[1], id)
  else
    local hb = redis.call('HMGET', ARGV[1] .. 'hb:' .. id, 'load', 'ts_ms')
    local alive = 0
    local load = ''
    if hb[1] then alive = 1; load = hb[1] end
    table.insert(out, id); table.insert(out, reg[1]); table.insert(out, reg[2] or '0')
    table.insert(out, alive); table.insert(out, load); table.insert(out, reg[3] or '')
  end
end
return out
"""


@dataclass(frozen=True)
class ClusterInfo:
    """One registered cluster as last read from Redis. Treat ``endpoints`` / ``load`` as read-only.

    ``last_seen`` is the Redis server time (epoch seconds) of its last register/heartbeat; ``alive`` is False once
    its heartbeat key expired (it is then dead until it heartbeats again).
    """

    id: str
    endpoints: Mapping[str, str]
    load: Mapping[str, float]
    last_seen: float
    alive: bool = True


@dataclass(frozen=True)
class MembershipSnapshot:
    """What a router knows about the clusters at one moment.

    ``stale`` is True when the last read failed and ``clusters`` is the last successful read (or empty if there
    never was one); ``error`` says why. ``server_time`` is Redis's clock at that read (compare with last_seen).
    """

    clusters: tuple[ClusterInfo, ...]
    stale: bool
    fetched_at: float  # local monotonic time of the last successful read (-inf: never)
    server_time: float
    error: str | None = None

    def alive_ids(self) -> list[str]:
        return [c.id for c in self.clusters if c.alive]

    def get(self, cluster_id: str) -> ClusterInfo | None:
        return next((c for c in self.clusters if c.id == cluster_id), None)


def _sign(secret: str, namespace: str, cluster_id: str, endpoints_json: str) -> str:
    msg = "\n".join(("k3serve-member-v1", namespace, cluster_id, endpoints_json)).encode()
    return hmac.new(secret.encode(), msg, hashlib.sha256).hexdigest()


class Membership:
    """Registry operations against one Redis, under one deployment namespace; entries are signed with the
    deployment ``secret`` and unsigned or forged ones are ignored."""

    def __init__(self, client: redis.Redis, namespace: str, secret: str) -> None:
        if not isinstance(secret, str) or len(secret) < 16:
            raise ValueError("secret must be the deployment secret (a string of at least 16 characters)")
        self._r = client
        self.namespace = namespace
        self.prefix = key_prefix(namespace)
        self._secret = secret
        self.forged = 0  # entries dropped because their signature did not verify
        self._forged_ids: set[str] = set()
        self._register = client.register_script(_REGISTER)
        self._heartbeat = client.register_script(_HEARTBEAT)
        self._scan = client.register_script(_SCAN)

    def _keys(self, cluster_id: str) -> tuple[str, str]:
        check_id("cluster id", cluster_id)
        return f"{self.prefix}reg:{cluster_id}", f"{self.prefix}hb:{cluster_id}"

    # ------------------------------------------------------------------ agent side
    def register(
        self, cluster_id: str, endpoints: Mapping[str, str], ttl_s: float, heartbeat_ttl_s: float | None = None
    ) -> None:
        """(Re)register a cluster with its endpoints (e.g. ``{"router": "host:port"}``) and mark it alive.

        The registration lives ``ttl_s`` past the last heartbeat; the first heartbeat key lives
        ``heartbeat_ttl_s`` (default ``ttl_s``). Re-registering replaces the endpoints.
        """
        reg, hb = self._keys(cluster_id)
        eps = json.dumps({str(k): str(v) for k, v in endpoints.items()}, sort_keys=True)
        hb_ms = ttl_ms(ttl_s if heartbeat_ttl_s is None else heartbeat_ttl_s)
        self._register(
            keys=[reg, hb, f"{self.prefix}clusters"],
            args=[cluster_id, eps, ttl_ms(ttl_s), hb_ms, _sign(self._secret, self.namespace, cluster_id, eps)],
        )

    def heartbeat(self, cluster_id: str, load: Mapping[str, float], ttl_s: float) -> bool:
        """Mark the cluster alive for ``ttl_s`` more seconds and publish its load (e.g. token-weighted in-flight).

        Returns False when its registration has expired (nothing is written): the agent must ``register`` again.
        """
        reg, hb = self._keys(cluster_id)
        payload = json.dumps({str(k): float(v) for k, v in load.items()}, sort_keys=True)
        return bool(self._heartbeat(keys=[reg, hb], args=[payload, ttl_ms(ttl_s)]))

    def deregister(self, cluster_id: str) -> None:
        """Remove a cluster at once (graceful drain/shutdown) instead of waiting for its TTLs."""
        reg, hb = self._keys(cluster_id)
        pipe = self._r.pipeline(transaction=True)
        pipe.delete(reg, hb)
        pipe.srem(f"{self.prefix}clusters", cluster_id)
        pipe.execute()

    # ----------------------------------------------------------------- router side
    def read(self) -> tuple[float, list[ClusterInfo]]:
        """(Redis server time in s, every registered cluster whose entry is signed by this deployment, alive or
        not), sorted by id. Raises RedisError."""
        raw = self._scan(keys=[f"{self.prefix}clusters"], args=[self.prefix])
        now = int(raw[0]) / 1000.0
        out = []
        for i in range(1, len(raw), 6):
            cid, eps, last_ms, alive, load, sig = raw[i : i + 6]
            cid, eps, load, sig = _text(cid), _text(eps), _text(load), _text(sig)
            if not hmac.compare_digest(_sign(self._secret, self.namespace, cid, eps), sig):
                self.forged += 1
                if cid not in self._forged_ids:  # once per id: a reader runs every 0.2 s
                    self._forged_ids.add(cid)
                    log.warning("membership: ignoring cluster %r: its entry is not signed with this deployment's "
                                "secret", cid)
                continue
            out.append(
                ClusterInfo(
                    id=cid,
                    endpoints=json.loads(eps),
                    load=json.loads(load) if load else {},
                    last_seen=int(_text(last_ms)) / 1000.0,
                    alive=bool(int(alive)),
                )
            )
        out.sort(key=lambda c: c.id)
        return now, out

    def healthy_clusters(self) -> list[ClusterInfo]:
        """Registered clusters whose heartbeat key is alive, sorted by id. Raises RedisError."""
        return [c for c in self.read()[1] if c.alive]


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


# ------------------------------------------------------------------------------------------- circuit breaker
class ClusterState(enum.Enum):
    HEALTHY = "healthy"  # alive in Redis, breaker closed
    SUSPECT = "suspect"  # breaker open: a recent gRPC failure, excluded until the cool-down ends
    HALF_OPEN = "half_open"  # cool-down over: routable again; next failure reopens it (longer), success closes
    DEAD = "dead"  # heartbeat expired (or unknown to membership)


@dataclass(frozen=True)
class BreakerConfig:
    """Cool-down after the first failure, multiplied by ``backoff`` for each failure in a row, up to the max."""

    cool_down_s: float = 5.0
    backoff: float = 2.0
    max_cool_down_s: float = 60.0

    def __post_init__(self) -> None:
        if self.cool_down_s < 0 or self.max_cool_down_s < self.cool_down_s or self.backoff < 1.0:
            raise ValueError(f"bad breaker config {self}")


@dataclass
class _Breaker:
    failures: int = 0
    open_until: float = 0.0


class CircuitBreaker:
    """Per-cluster breakers for one router process (local state on purpose: a router reacts to what *it* saw
    at once; the shared, slower signal is the heartbeat). Thread-safe."""

    def __init__(self, config: BreakerConfig = BreakerConfig(), clock: Callable[[], float] = time.monotonic):
        self.config = config
        self._clock = clock
        self._lock = threading.Lock()
        self._b: dict[str, _Breaker] = {}

    def mark_suspect(self, cluster_id: str) -> float:
        """Record a failure (gRPC error, transfer failure): open the breaker; returns the cool-down applied."""
        with self._lock:
            b = self._b.setdefault(cluster_id, _Breaker())
            now = self._clock()
            if b.failures and now < b.open_until:
                return b.open_until - now  # already open: concurrent failures of one outage count once
            cd = min(self.config.cool_down_s * self.config.backoff**b.failures, self.config.max_cool_down_s)
            b.failures += 1
            b.open_until = now + cd
            return cd

    def mark_ok(self, cluster_id: str) -> None:
        """Record a success: close the breaker and forget past failures."""
        with self._lock:
            self._b.pop(cluster_id, None)

    def state(self, cluster_id: str) -> ClusterState:
        """HEALTHY, SUSPECT or HALF_OPEN (the breaker alone knows nothing about DEAD)."""
        with self._lock:
            b = self._b.get(cluster_id)
            if b is None or b.failures == 0:
                return ClusterState.HEALTHY
            return ClusterState.SUSPECT if self._clock() < b.open_until else ClusterState.HALF_OPEN

    def allows(self, cluster_id: str) -> bool:
        return self.state(cluster_id) is not ClusterState.SUSPECT


# ------------------------------------------------------------------------------------------ router's view
class MembershipView:
    """The router's membership: Redis reads cached for ``refresh_interval_s``, the last good read kept when Redis
    is down, and the local circuit breaker applied on top. Thread-safe."""

    def __init__(
        self,
        membership: Membership,
        *,
        refresh_interval_s: float = 0.5,
        empty_grace_s: float = 5.0,
        breaker: CircuitBreaker | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.membership = membership
        self.refresh_interval_s = refresh_interval_s
        self.empty_grace_s = empty_grace_s
        self._clock = clock
        self.breaker = breaker if breaker is not None else CircuitBreaker(clock=clock)
        self._lock = threading.Lock()
        self._snap = MembershipSnapshot(clusters=(), stale=True, fetched_at=float("-inf"), server_time=0.0,
                                        error="never read")  # fmt: skip
        self._last_attempt = float("-inf")
        self._last_nonempty: MembershipSnapshot | None = None

    def refresh(self) -> MembershipSnapshot:
        """Read Redis now. On failure keep the last good clusters and report ``stale=True`` with the error.

        A read that finds no alive cluster right after one that found some is not trusted for ``empty_grace_s``:
        the last non-empty membership is kept (``stale=True``). An emptied Redis (restarted without persistence)
        looks exactly like that until the agents' next heartbeat re-registers them, and if every cluster really
        died, routing to the last known ones fails no worse than routing nowhere (and the breaker still acts).
        """
        with self._lock:
            self._last_attempt = self._clock()
        try:
            server_time, clusters = self.membership.read()
        except (redis.RedisError, OSError) as e:
            with self._lock:
                prev = self._snap
                self._snap = MembershipSnapshot(prev.clusters, True, prev.fetched_at, prev.server_time,
                                                f"{type(e).__name__}: {e}")  # fmt: skip
                return self._snap
        now = self._clock()
        snap = MembershipSnapshot(tuple(clusters), False, now, server_time, None)
        with self._lock:
            known = {c.id: dict(c.endpoints) for c in self._snap.clusters}
            for c in clusters:  # a new endpoint is a new incarnation (rebuilt or replaced): forget the old failures
                if c.id in known and known[c.id] != dict(c.endpoints):
                    self.breaker.mark_ok(c.id)
            last = self._last_nonempty
            if snap.alive_ids():
                self._last_nonempty = snap
            elif last is not None and now - last.fetched_at <= self.empty_grace_s:
                snap = MembershipSnapshot(last.clusters, True, last.fetched_at, server_time,
                                          "no alive cluster in Redis; keeping the last known membership")  # fmt: skip
            self._snap = snap
        return snap

    def snapshot(self, max_age_s: float | None = None) -> MembershipSnapshot:
        """The cached snapshot, re-read when the last read *attempt* is older than ``max_age_s`` (default: the
        refresh interval).

        Counting from the last attempt, not the last success, means that while Redis is down at most one call per
        interval pays the client's socket timeout; the others route at once on the stale snapshot. Build the
        client with ``k3serve.cluster.redis_server.connect`` (short timeouts, few retries).
        """
        limit = self.refresh_interval_s if max_age_s is None else max_age_s
        with self._lock:
            now = self._clock()
            due = now - self._last_attempt > limit
            if due:
                self._last_attempt = now  # claim the refresh: concurrent callers use the cached snapshot
            snap = self._snap
        return self.refresh() if due else snap

    def request_snapshot(self) -> MembershipSnapshot:
        """The snapshot for a request's path, kept fresh by a background reader (RouterService's): re-read inline
        only when that reader fell ten intervals (at least 2 s) behind."""
        return self.snapshot(max_age_s=max(2.0, 10 * self.refresh_interval_s))

    def routable(self, snapshot: MembershipSnapshot | None = None) -> list[str]:
        """Alive clusters whose breaker is not open, sorted by id: the ``healthy`` set for hashing and pins."""
        snap = self.snapshot() if snapshot is None else snapshot
        return [c for c in snap.alive_ids() if self.breaker.allows(c)]

    def state(self, cluster_id: str, snapshot: MembershipSnapshot | None = None) -> ClusterState:
        snap = self.snapshot() if snapshot is None else snapshot
        info = snap.get(cluster_id)
        if info is None or not info.alive:
            return ClusterState.DEAD
        return self.breaker.state(cluster_id)

    def mark_suspect(self, cluster_id: str) -> float:
        """First gRPC failure towards a cluster: exclude it for the breaker's cool-down (returned, seconds)."""
        return self.breaker.mark_suspect(cluster_id)

    def mark_ok(self, cluster_id: str) -> None:
        self.breaker.mark_ok(cluster_id)

    def get(self, cluster_id: str) -> ClusterInfo | None:
        return self.snapshot().get(cluster_id)

