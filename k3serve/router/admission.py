"""Budget-based admission per (cluster, request class), shared by all router replicas through Redis (docs/architecture.md §13).

Requests are classed by *uncached* prompt tokens (``classify``), so a 1M-token prompt and a 2K one never compete
for one budget. Each (cluster, class) has an in-flight token budget, a concurrency cap and a bounded FIFO queue.
All state lives in Redis and every decision is one Lua script (admission_lua.py), so budgets hold across replicas
and restarts (docs/architecture.md §2, invariant 4); every entry carries a lease, so a crashed router leaks
nothing past one TTL.

Keys (``{...}`` is a Redis Cluster hash tag: all keys of one (cluster, class) share a slot; ``ns`` the namespace):

    k3s:{ns}:adm:{CLUSTER/CLASS}:lease   ZSET  request_id -> lease expiry (Redis ms)     in-flight reservations
    k3s:{ns}:adm:{CLUSTER/CLASS}:tok     HASH  request_id -> tokens
    k3s:{ns}:adm:{CLUSTER/CLASS}:end     HASH  request_id -> expected end (Redis ms)        retry-after source
    k3s:{ns}:adm:{CLUSTER/CLASS}:rel     ZSET  request_id -> until (ms): released, never to be re-asserted
    k3s:{ns}:adm:{CLUSTER/CLASS}:q       ZSET  request_id -> arrival sequence number     waiters, FIFO
    k3s:{ns}:adm:{CLUSTER/CLASS}:qlease  ZSET  request_id -> waiter lease expiry (ms)
    k3s:{ns}:adm:{CLUSTER/CLASS}:qtok    HASH  request_id -> tokens wanted
    k3s:{ns}:adm:{CLUSTER/CLASS}:seq     STRING arrival counter
    k3s:{ns}:adm:alive                   STRING PX a few renew intervals, refreshed by every router's renewer
    k3s:{ns}:adm:recover                 STRING PX grace: present = Redis lost its state, no new admissions

The rule, evaluated atomically after purging expired leases and waiters: a request of t tokens is admitted iff
nothing is in flight or ahead of it, or (in-flight tokens + the waiters' ahead + t <= budget and in-flight count +
waiters ahead < max_concurrent). A request larger than the whole budget is admitted only when it would run alone
(else it could never run); once the head of the line cannot fit, nothing passes it, so nobody waits forever behind
smaller ones. Only live waiters (polling, their leases renewed) count as ahead: a refused request holds nothing,
so a class with room never refuses (capacity never sits idle behind a refusal). Otherwise the request joins the
queue if it holds fewer than ``queue_limit``, polls (with jitter) up to ``max_wait_s``, and is refused with
``AdmissionRejected`` (gRPC RESOURCE_EXHAUSTED) and a retry-after from the expected drain time (retry_hint.py).

Reservations are held, or their holder knows it lost them. A renewal that finds its lease gone (Redis flushed,
restarted, paused past the lease) re-asserts it: the request is still running, so its tokens are in use whatever
Redis forgot. For nobody to be admitted into that hole before every router has re-asserted, a missing ``alive``
key opens a ``recover`` window of one grace period in which only re-assertions get in. A router's gate creates
``alive`` when it starts, so a fresh deployment does not wait. The class specs are passed with each call, so all
router replicas must run with the same specs.
"""

from __future__ import annotations

import operator
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import redis

from k3serve.router import admission_lua as lua
from k3serve.router.membership import check_id, key_prefix, ttl_ms
from k3serve.router.retry_hint import HINT_JITTER, HINT_LATENESS, MIN_RETRY_AFTER_S, drain_wait_s

_OK, _NO, _QUEUED, _FULL = 1, 0, 2, 3


@dataclass(frozen=True)
class ClassSpec:
    """A request class. ``max_uncached_tokens`` is the class's upper bound (inclusive; None = no bound).
    Budget and caps apply per (cluster, class). ``queue_limit`` 0 means no waiting: reject at once."""

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
    """Not admitted: ``reason`` is "queue_full", "timeout", "over_budget" (no waiting allowed), "refused" (turned
    away before admission, e.g. at a router's stream limit) or "cancelled". Map to gRPC RESOURCE_EXHAUSTED with
    ``retry_after_s`` as the hint."""

    def __init__(self, retry_after_s: float, message: str, reason: str = "timeout", cluster: str = "",
                 cls: str = "") -> None:
        super().__init__(message)
        self.retry_after_s, self.message, self.reason = retry_after_s, message, reason
        self.cluster, self.cls = cluster, cls


@dataclass(frozen=True)
class RecoveryGuard:
    """The state-loss guard (module docstring). ``alive_ttl_s`` must exceed the renewers' beat with margin;
    ``grace_s`` must cover one beat of every router, so that all of them re-assert before new work gets in."""

    alive_ttl_s: float
    grace_s: float

    def __post_init__(self) -> None:
        if not 0 < self.grace_s <= self.alive_ttl_s:
            raise ValueError(f"need 0 < grace_s <= alive_ttl_s, got {self}")


@dataclass(frozen=True)
class AdmissionConfig:
    """Waiters poll every U(poll_min_s, poll_max_s) seconds (jitter keeps replicas from polling in lock-step); a
    waiter that stops polling (crashed router) leaves the queue ``queue_lease_s`` later."""

    poll_min_s: float = 0.005
    poll_max_s: float = 0.03
    queue_lease_s: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.poll_min_s <= self.poll_max_s:
            raise ValueError(f"need 0 < poll_min_s <= poll_max_s, got {self}")
        if self.queue_lease_s <= self.poll_max_s:
            raise ValueError("queue_lease_s must exceed poll_max_s, or live waiters would expire between polls")


class Admission:
    """Admission control over one Redis, under one deployment namespace. No state of its own beyond the client
    and a jitter RNG: any number of instances and router processes share budgets through Redis."""

    def __init__(self, client: redis.Redis, namespace: str, config: AdmissionConfig = AdmissionConfig(),
                 guard: RecoveryGuard | None = None) -> None:
        self._r, self.config, self.guard = client, config, guard
        self.prefix = key_prefix(namespace)
        self._guard_keys = [f"{self.prefix}adm:alive", f"{self.prefix}adm:recover"]
        self._rng = random.Random()
        self._rng_lock = threading.Lock()
        self._scripts = {name: client.register_script(getattr(lua, name))
                         for name in ("RESERVE", "REASSERT", "RELEASE", "TOUCH", "LOAD")}

    def keys(self, cluster: str, cls: str) -> dict[str, str]:
        """The keys of one (cluster, class) budget by role, in the order its scripts take them (module docstring)."""
        check_id("cluster id", cluster)
        check_id("class name", cls)
        base = f"{self.prefix}adm:{{{cluster}/{cls}}}:"
        return {k: base + k for k in ("lease", "tok", "end", "rel", "q", "qlease", "qtok", "seq")}

    def _run(self, script: str, cluster: str, cls: str, args: Sequence = (), extra_keys: Sequence[str] = (),
             client=None):
        """Run one (cluster, class) script, on ``client`` (a pipeline) when given."""
        return self._scripts[script](keys=[*self.keys(cluster, cls).values(), *extra_keys], args=args, client=client)

    def _guard_args(self) -> tuple[list[str], list[int]]:
        if self.guard is None:
            return ["", ""], [0, 0]
        return self._guard_keys, [ttl_ms(self.guard.alive_ttl_s), ttl_ms(self.guard.grace_s)]

    # ---------------------------------------------------------------------------------- reservations
    def _call_reserve(self, cluster: str, cls: ClassSpec, request_id: str, tokens: int, lease_ttl_s: float,
                      mode: int, expected_s: float = 0.0) -> tuple[int, Reservation | None, int, bool]:
        """One RESERVE call: (status, reservation or None, queue length, Redis recovering from a state loss)."""
        try:
            tokens = operator.index(tokens)  # ints, numpy ints; not floats
        except TypeError:
            raise ValueError(f"tokens must be an integer, got {tokens!r}") from None
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        if not request_id:
            raise ValueError("empty request_id")
        gkeys, gargs = self._guard_args()
        status, expiry_ms, qlen, recovering = (int(x) for x in self._run(
            "RESERVE", cluster, cls.name, extra_keys=gkeys,
            args=[request_id, tokens, cls.inflight_token_budget, cls.max_concurrent, ttl_ms(lease_ttl_s), mode,
                  cls.queue_limit, ttl_ms(self.config.queue_lease_s), int(max(expected_s, 0.0) * 1000), *gargs]))
        res = Reservation(cluster, cls.name, request_id, tokens, expiry_ms / 1000.0, lease_ttl_s) \
            if status == _OK else None
        return status, res, qlen, bool(recovering)

    def reserve_or_wait(self, cluster: str, cls: ClassSpec, request_id: str, tokens: int, lease_ttl_s: float, *,
                        max_wait_s: float | None = None, cancel: threading.Event | None = None,
                        expected_s: float = 0.0) -> Reservation:
        """Reserve, waiting in the class queue up to ``max_wait_s`` (default ``cls.max_wait_s``). ``expected_s``:
        how long the request is expected to hold the reservation (published as its expected end, for hints).
        Idempotent per ``request_id``: calling again while the reservation is held renews it and returns it.

        Raises AdmissionRejected: "queue_full" when the queue already holds ``queue_limit`` waiters, "timeout"
        after the wait, "over_budget" when waiting is disabled (max wait 0), "cancelled" when ``cancel`` is set.
        The waiter leaves the queue on every exit path (and its lease clears it if this process dies)."""
        wait = cls.max_wait_s if max_wait_s is None else max_wait_s
        mode = lua.WAIT if wait > 0 else lua.TRY
        status, res, qlen, rec = self._call_reserve(cluster, cls, request_id, tokens, lease_ttl_s, mode, expected_s)
        deadline = time.monotonic() + wait
        try:
            while status == _QUEUED:
                now = time.monotonic()
                if cancel is not None and cancel.is_set():
                    raise AdmissionRejected(0.0, f"{request_id} cancelled while queued for {cls.name}", "cancelled",
                                            cluster, cls.name)
                if now >= deadline:
                    self._leave_queue(cluster, cls.name, request_id)  # the hint counts only those still waiting
                    raise self.rejected(cluster, cls, tokens, "timeout",
                                        f"{cls.name} on {cluster}: not admitted within {wait:.3g}s "
                                        f"({max(qlen - 1, 0)} waiting)", expected_s=expected_s, recovering=rec)
                time.sleep(min(self._jitter(), deadline - now))
                status, res, qlen, rec = self._call_reserve(cluster, cls, request_id, tokens, lease_ttl_s, lua.WAIT,
                                                            expected_s)
        except BaseException:
            self._leave_queue(cluster, cls.name, request_id)
            raise
        if status == _OK:
            return res
        # _FULL after waiting: our waiter lease lapsed (a stall past queue_lease_s) and the queue filled meanwhile
        reason, why = ("over_budget", "over budget and no waiting allowed") if status == _NO \
            else ("queue_full", f"queue full ({qlen} waiting)")
        raise self.rejected(cluster, cls, tokens, reason, f"{cls.name} on {cluster}: {why}", expected_s=expected_s,
                            recovering=rec)

    def reassert_many(self, held: Sequence[tuple[Reservation, float]]) -> list[tuple[Reservation, bool]]:
        """Renew the leases of running requests (reservation, expected remaining seconds) in one round trip, and
        put back any that Redis lost (flushed, restarted, paused past the lease): (new reservation, lost). One
        released meanwhile stays released (its new reservation expires at 0)."""
        pipe = self._r.pipeline(transaction=False)
        for r, remaining_s in held:
            self._run("REASSERT", r.cluster, r.cls, client=pipe,
                      args=[r.request_id, ttl_ms(r.lease_ttl_s), r.tokens, int(max(remaining_s, 0) * 1000)])
        return [(Reservation(r.cluster, r.cls, r.request_id, r.tokens, int(expiry) / 1000.0, r.lease_ttl_s),
                 bool(int(lost))) for (r, _), (expiry, lost) in zip(held, pipe.execute(), strict=True)]

    def touch(self) -> bool:
        """The renewer's beat of the state-loss guard; True while Redis is recovering (no guard: False)."""
        if self.guard is None:
            return False
        return bool(int(self._scripts["TOUCH"](keys=self._guard_keys, args=self._guard_args()[1])))

    def release(self, res: Reservation) -> bool:
        """Return the tokens to the budget. Idempotent: True if this call released them, False if they were
        already gone (released before, or the lease expired)."""
        return bool(int(self._run("RELEASE", res.cluster, res.cls, args=[res.request_id, ttl_ms(res.lease_ttl_s)])))

    # ---------------------------------------------------------------------------------------- reads
    def stats(self, pairs: Sequence[tuple[str, str]]) -> list[ClassLoad]:
        """In-flight tokens and requests and queue length of each (cluster, class), in one atomic round trip."""
        pipe = self._r.pipeline(transaction=True)
        for cluster, cls in pairs:
            self._run("LOAD", cluster, cls, client=pipe)
        loads = []
        for row in pipe.execute():
            held = [int(t) for t in row[3::2]]
            loads.append(ClassLoad(sum(held), len(held), int(row[1])))
        return loads

    def retry_after(self, cluster: str, cls: ClassSpec, tokens: int, round_s: float = 0.0,
                    unseen: tuple[int, int] = (0, 0)) -> float:
        """``drain_wait_s`` for a request of ``tokens`` on (cluster, cls) behind its waiters, from the holders'
        published ends. ``unseen`` = (requests, tokens) ahead of it that Redis does not show yet (a router's
        streams that hold a stream slot but have not reached admission): counted as waiters ahead."""
        raw = [int(x) for x in self._run("LOAD", cluster, cls.name)]
        now, queued, queued_tokens = raw[:3]
        # a holder that published no end (no duration estimate): the class turns over in about max_wait_s
        unknown = now + int(max(cls.max_wait_s, 0.1) * 1000)
        holders = [(t, e if e >= 0 else unknown) for t, e in zip(raw[3::2], raw[4::2])]
        return drain_wait_s(now, holders, queued + unseen[0], queued_tokens + unseen[1], tokens,
                            cls.inflight_token_budget, cls.max_concurrent, round_s)

    def rejected(self, cluster: str, cls: ClassSpec, tokens: int, reason: str, message: str, *,
                 expected_s: float = 0.0, recovering: bool = False, unseen: tuple[int, int] = (0, 0),
                 at_least_s: float = 0.0) -> AdmissionRejected:
        """The refusal with its hint: the expected drain time, scaled late and jittered +0-``HINT_JITTER``, not
        before ``at_least_s`` (a refusing router's own reason, e.g. its stream limit); the recovery grace while
        Redis recovers from a state loss."""
        if recovering and self.guard is not None:
            return AdmissionRejected(self.guard.grace_s, f"{message} (admission state recovering after a Redis loss)",
                                     reason, cluster, cls.name)
        try:
            hint = self.retry_after(cluster, cls, tokens, round_s=expected_s, unseen=unseen)
        except (redis.RedisError, OSError):
            hint = max(cls.max_wait_s, 0.1)  # no holders to read: the queue turns over in about max_wait_s
        with self._rng_lock:
            # at_least_s is already a hint (slots.retry_after_s scales its own): only the drain estimate runs late
            hint = max(hint * HINT_LATENESS, at_least_s, MIN_RETRY_AFTER_S) * self._rng.uniform(1.0, 1.0 + HINT_JITTER)
        return AdmissionRejected(round(hint, 3), message, reason, cluster, cls.name)

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
