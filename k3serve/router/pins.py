"""Session pins in Redis: keep a session on the cluster that holds its cache (docs/architecture.md §11).

    k3s:{ns}:pin:{session_key}   HASH primary, secondary ('' = none), serving, moves   -- PX ttl, refreshed on use

A pin made by ``resolve`` lives only ``pending_ttl_s`` until ``confirm`` (the request was admitted) gives it the
full TTL: a flood of rejected requests with fresh session ids leaves no hour-long keys behind.

A pin is created from the HRW ranking over the clusters healthy *at creation* and then stays put: a cluster
joining later does not pull sessions away from their cache. Only when the serving cluster is not healthy does
the pin move, to its secondary if that is healthy, else to the best healthy cluster in HRW order, and the move
is stored so every router follows it.

Every read-modify-write happens inside one Lua script, so two routers racing on a new session end with one pin
(the first script to run creates it; the second sees it), and two routers failing a session over at once agree
on where it went. Pins live only in Redis: a restarted router, or another replica, routes a session exactly
like the router that pinned it. When Redis fails (unreachable, or any error: OOM, READONLY, ...), ``resolve``
falls back to pure HRW, which every replica still computes identically.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import redis

from k3serve.router.hashing import rank_clusters
from k3serve.router.membership import check_id, key_prefix, ttl_ms

__all__ = ["Pin", "PinEvent", "PinStore", "NoHealthyCluster"]


class NoHealthyCluster(RuntimeError):
    """There is no healthy cluster to pin or route a session to."""


class PinEvent(str, enum.Enum):
    CREATED = "created"  # no pin existed; made from the HRW ranking
    EXISTING = "existing"  # pin found, serving cluster healthy; TTL refreshed
    MOVED = "moved"  # pin found but its serving cluster was unhealthy (or move() was called): serving changed
    CONFLICT = "conflict"  # move() with expected_serving lost a race: the pin shows where another router moved it
    FALLBACK = "fallback"  # Redis unreachable: computed by HRW, not stored


@dataclass(frozen=True)
class Pin:
    session: str
    primary: str
    secondary: str | None
    serving: str  # where to send the session's next request
    moves: int  # failovers recorded on this pin
    event: PinEvent


# KEYS: pin. ARGV: ttl ms, then the healthy clusters in this session's HRW order (at least one).
# An existing pin's TTL is raised to ttl, never lowered (a pending resolve must not shorten a confirmed pin).
_GET_OR_CREATE = """
local ttl = ARGV[1]
local function refresh()
  if redis.call('PTTL', KEYS[1]) < tonumber(ttl) then redis.call('PEXPIRE', KEYS[1], ttl) end
end
local pin = redis.call('HMGET', KEYS[1], 'primary', 'secondary', 'serving', 'moves')
if pin[3] then
  local healthy = {}
  for i = 2, #ARGV do healthy[ARGV[i]] = true end
  local event = 'existing'
  if not healthy[pin[3]] then
    local target = ARGV[2]
    if pin[2] ~= '' and healthy[pin[2]] then target = pin[2] end
    redis.call('HSET', KEYS[1], 'serving', target)
    pin[4] = redis.call('HINCRBY', KEYS[1], 'moves', 1)
    pin[3] = target
    event = 'moved'
  end
  refresh()
  return {event, pin[1], pin[2], pin[3], tostring(pin[4])}
end
local secondary = ARGV[3] or ''
redis.call('HSET', KEYS[1], 'primary', ARGV[2], 'secondary', secondary, 'serving', ARGV[2], 'moves', 0)
redis.call('PEXPIRE', KEYS[1], ttl)
return {'created', ARGV[2], secondary, ARGV[2], '0'}
"""

# KEYS: pin. ARGV: ttl ms, new serving, expected serving ('' = unconditional).
# Returns {} when there is no pin, else {event, primary, secondary, serving, moves}.
_MOVE = """
local pin = redis.call('HMGET', KEYS[1], 'primary', 'secondary', 'serving', 'moves')
if not pin[3] then return {} end
local event = 'moved'
if ARGV[3] ~= '' and pin[3] ~= ARGV[3] then
  event = 'conflict'
elseif pin[3] ~= ARGV[2] then
  redis.call('HSET', KEYS[1], 'serving', ARGV[2])
  pin[4] = redis.call('HINCRBY', KEYS[1], 'moves', 1)
  pin[3] = ARGV[2]
end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return {event, pin[1], pin[2], pin[3], tostring(pin[4])}
"""


class PinStore:
    """Pins of one deployment namespace. Stateless apart from the client: any number of instances, in any
    number of router processes, share the pins through Redis."""

    def __init__(self, client: redis.Redis, namespace: str, ttl_s: float = 3600.0,
                 pending_ttl_s: float = 30.0) -> None:
        self._r = client
        self.prefix = key_prefix(namespace)
        self.ttl_s = ttl_s
        self._ttl_ms = ttl_ms(ttl_s)
        self._pending_ms = ttl_ms(min(pending_ttl_s, ttl_s))
        self._get_or_create = client.register_script(_GET_OR_CREATE)
        self._move = client.register_script(_MOVE)

    def key(self, session: str) -> str:
        if not session:
            raise ValueError("empty session key")
        return f"{self.prefix}pin:{session}"

    def get_or_create(self, session: str, healthy: Sequence[str]) -> Pin:
        """The session's pin, created from HRW over ``healthy`` when absent, moved when its serving cluster is
        not in ``healthy``; TTL refreshed. Atomic. Raises NoHealthyCluster, redis.RedisError."""
        ranked = self._ranked(session, healthy)
        raw = self._get_or_create(keys=[self.key(session)], args=[self._ttl_ms, *ranked])
        return _pin(session, raw)

    def resolve(self, session: str, healthy: Sequence[str]) -> Pin:
        """``get_or_create`` with the pending TTL (``confirm`` once the request is admitted), or when Redis
        fails in any way the HRW answer (event FALLBACK, not stored), so that routing survives a Redis outage,
        a full (OOM) or read-only Redis, and still agrees across replicas."""
        ranked = self._ranked(session, healthy)
        try:
            raw = self._get_or_create(keys=[self.key(session)], args=[self._pending_ms, *ranked])
        except (redis.RedisError, OSError):
            second = ranked[1] if len(ranked) > 1 else None
            return Pin(session, ranked[0], second, ranked[0], 0, PinEvent.FALLBACK)
        return _pin(session, raw)

    def confirm(self, session: str) -> bool:
        """The session's request was admitted: its pin lives the full TTL. False when there is no pin, or Redis
        failed (the pin then expires after its pending TTL, and HRW routes the session as before)."""
        try:
            return bool(self._r.pexpire(self.key(session), self._ttl_ms))
        except (redis.RedisError, OSError):
            return False

    def move(self, session: str, new_serving: str, expected_serving: str | None = None) -> Pin | None:
        """Point the session at ``new_serving`` (failover). With ``expected_serving``, only if the pin still
        serves there (compare-and-set); otherwise the pin is returned unchanged with event CONFLICT, so the
        caller follows the router that moved it first. None when the session has no pin."""
        check_id("cluster id", new_serving)
        raw = self._move(keys=[self.key(session)], args=[self._ttl_ms, new_serving, expected_serving or ""])
        return _pin(session, raw) if raw else None

    def get(self, session: str) -> Pin | None:
        """The stored pin without touching it (no TTL refresh, no move), or None."""
        h = self._r.hgetall(self.key(session))
        if not h:
            return None
        h = {_text(k): _text(v) for k, v in h.items()}
        return Pin(session, h["primary"], h["secondary"] or None, h["serving"], int(h.get("moves", 0)),
                   PinEvent.EXISTING)  # fmt: skip

    def serving_counts(self, max_pins: int = 1_000_000) -> dict[str, int]:
        """Pinned sessions per serving cluster (status, not the request path: a SCAN over the pins, at most
        ``max_pins`` of them). Raises redis.RedisError."""
        counts: dict[str, int] = {}
        keys = []
        for key in self._r.scan_iter(match=f"{self.prefix}pin:*", count=1000):
            keys.append(key)
            if len(keys) >= max_pins:
                break
        pipe = self._r.pipeline(transaction=False)
        for key in keys:
            pipe.hget(key, "serving")
        for serving in pipe.execute():
            if serving:  # expired between SCAN and HGET: not counted
                counts[_text(serving)] = counts.get(_text(serving), 0) + 1
        return counts

    def delete(self, session: str) -> bool:
        return bool(self._r.delete(self.key(session)))

    def ttl_s_left(self, session: str) -> float | None:
        ms = self._r.pttl(self.key(session))
        return None if ms < 0 else ms / 1000.0

    @staticmethod
    def _ranked(session: str, healthy: Sequence[str]) -> list[str]:
        if not healthy:
            raise NoHealthyCluster(f"no healthy cluster for session {session!r}")
        for c in healthy:
            check_id("cluster id", c)
        return rank_clusters(session, healthy)


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _pin(session: str, raw) -> Pin:
    event, primary, secondary, serving, moves = (_text(x) for x in raw)
    return Pin(session, primary, secondary or None, serving, int(moves), PinEvent(event))
