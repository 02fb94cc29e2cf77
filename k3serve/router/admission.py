"""Budget-based admission per (cluster, request class), shared by all router replicas through Redis (docs/architecture.md §13).

Requests are classed by *uncached* prompt tokens (``classify``), so a 1M-token prompt and a 2K one never compete
for one budget. Each (cluster, class) has an in-flight token budget, a concurrency cap and a bounded FIFO queue.
All state lives in Redis and every decision is one Lua script, so budgets hold across replicas and restarts
(docs/architecture.md §2, invariant 4), and every entry carries a lease, so a crashed router leaks nothing past one TTL.

Keys (``{...}`` is a Redis Cluster hash tag: all keys of one (cluster, class) share a slot; ``ns`` the namespace):

    k3s:{ns}:adm:{CLUSTER/CLASS}:lease   ZSET  request_id -> lease expiry (Redis ms)     in-flight reservations
    k3s:{ns}:adm:{CLUSTER/CLASS}:tok     HASH  request_id -> tokens
    k3s:{ns}:adm:{CLUSTER/CLASS}:q       ZSET  request_id -> arrival sequence number     waiters, FIFO
    k3s:{ns}:adm:{CLUSTER/CLASS}:qlease  ZSET  request_id -> waiter lease expiry (ms)
    k3s:{ns}:adm:{CLUSTER/CLASS}:qtok    HASH  request_id -> tokens wanted
    k3s:{ns}:adm:{CLUSTER/CLASS}:seq     STRING arrival counter
    k3s:{ns}:adm:{CLUSTER/CLASS}:end     HASH  request_id -> expected end (Redis ms)        retry-after source
    k3s:{ns}:adm:{CLUSTER/CLASS}:tix     ZSET  ticket -> place (same counter as q)          held places (tickets)
    k3s:{ns}:adm:{CLUSTER/CLASS}:tixexp  ZSET  ticket -> expiry (ms): hinted moment + grace
    k3s:{ns}:adm:{CLUSTER/CLASS}:tixtok  HASH  ticket -> tokens
    k3s:{ns}:adm:{CLUSTER/CLASS}:tixat   HASH  ticket -> "issued ms:hinted ms"
    k3s:{ns}:adm:{CLUSTER/CLASS}:tixfree HASH  ticket -> first moment (ms) its place was seen free
    k3s:{ns}:adm:{CLUSTER/CLASS}:tixlent HASH  ticket -> borrower request_id: its room is lent (Lending)
    k3s:{ns}:adm:{CLUSTER/CLASS}:tixhere ZSET  ticket -> presence expiry (ms): its holder is back, polling
    k3s:{ns}:adm:{CLUSTER/CLASS}:turn    HASH  last admission ms, ewma of intervals while the line is not empty,
                                               mean holding time ms (admission to release) and its mean absolute
                                               deviation: the pace of places
    k3s:{ns}:adm:{CLUSTER/CLASS}:since   HASH  request_id -> admission ms: a hold in progress (its age)
    k3s:{ns}:adm:alive                   STRING PX a few renew intervals, refreshed by every router's renewer
    k3s:{ns}:adm:recover                 STRING PX grace: present = Redis lost its state, no new admissions

Reservations are held, or their holder knows it lost them. A renewal that finds its lease gone (Redis flushed,
restarted, paused past the lease, or the renewer stalled) re-asserts it: the request is still running, so its
tokens are in use whatever Redis forgot. For the others not to be admitted into that hole before every router
has re-asserted, a missing ``alive`` key (Redis lost state, or nobody reached it for longer than its TTL) opens a
``recover`` window of one grace period in which only re-assertions get in; new requests wait (or are refused
with the grace as hint). A router's gate creates ``alive`` when it starts, so a fresh deployment does not wait.

The admission rule, evaluated atomically with Redis's own clock after purging expired leases and waiters:

* ``fits(t)``: nothing of the class is in flight, or (in-flight tokens + t <= budget and count < max_concurrent).
  So a request larger than the whole class budget is admitted only when it would run alone; without that
  exception it could never run at all. While it runs, it alone may exceed the budget.
* No overtaking that delays anyone ahead: a request is admitted only if it fits with everything ahead of it in
  line (queue waiters and held places, see Tickets) counted as taken; a newcomer is behind all of them. Once the
  head cannot fit (say, an oversized request waiting for the class to drain), nothing passes it, in-flight work
  drains and the head gets in: no request waits forever behind a stream of smaller ones. Classes keep sizes
  similar, so FIFO within a class costs little. (It was "the head still fits after it", which let a request
  pass the second waiter for the moment before that one polled: measured as held places that were free for a
  few milliseconds.)
* A request that does not get in joins the queue if it is shorter than ``queue_limit``; a waiter re-polls
  (with jitter) and renews its waiter lease each time, up to ``max_wait_s``; then ``AdmissionRejected`` with a
  retry hint (gRPC ``RESOURCE_EXHAUSTED``).

Tickets: a refused client's place in line is held for it (router/tickets.py has the design): held places ahead
of a request count as taken, and a refusal's hint is when its place is expected to come free. Lending (same
place): a request present now may pass held places whose holders are away and are hinted to come back after it is
expected to end (``AdmissionConfig.lend_margin`` x its expected duration); it is admitted only if the room is there
now, so budgets are never exceeded, and a holder back while its borrower overruns waits for the next room.

The class specs are passed with each call, so all router replicas must run with the same specs.
"""

from __future__ import annotations

import functools
import operator
import random
import threading
import time
from collections.abc import Callable, Sequence

import redis

from k3serve.router.admission_lua import (DROP_TICKET as _DROP_TICKET, HOLDERS as _HOLDERS, REASSERT as _REASSERT,
                                          REFUSE as _REFUSE, RELEASE as _RELEASE, RENEW as _RENEW, RESERVE as _RESERVE,
                                          SET_HINT as _SET_HINT, STATS as _STATS, TICKET_KEYS as _TICKET_KEYS,
                                          TOUCH as _TOUCH, TRY as _TRY, WAIT as _WAIT)
from k3serve.router.retry_hint import HINT_JITTER, HINT_LATENESS, drain_wait_s  # noqa: F401 (re-exported)
from k3serve.router.admission_refusals import MIN_RETRY_AFTER_S, AdmissionRefusals  # noqa: F401 (re-exported)
from k3serve.router.tickets import Ticket, TicketWait, new_ticket_id
from k3serve.router.admission_types import (  # noqa: F401 (re-exported)
    AdmissionConfig, AdmissionRejected, ClassLoad, ClassSpec, RecoveryGuard, Reservation, classify, validate_classes)
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
    "RecoveryGuard",
    "drain_wait_s",
]


_OK, _NO, _QUEUED, _FULL = 1, 0, 2, 3


class Admission(AdmissionRefusals):
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
        guard: RecoveryGuard | None = None,
        co_located: Callable[[str], Sequence[str]] | None = None,
    ) -> None:
        """``co_located(cluster)``: the other clusters on that cluster's host (``router.hosts.co_located``),
        whose budgets of a class are read with its own for the host-saturated pace (RELEASE, HOLDERS); None: every
        cluster alone on its host."""
        self._r = client
        self.co_located = co_located or (lambda cluster: ())
        self.prefix = key_prefix(namespace)
        self.guard = guard
        self._guard_keys = [f"{self.prefix}adm:alive", f"{self.prefix}adm:recover"]
        self.config = config
        self._rng = rng if rng is not None else random.Random()
        self._rng_lock = threading.Lock()
        self._sleep = sleep
        self._clock = clock
        self._recovering = False  # what the last reserve call saw (for the rejection's hint)
        self.unknown_tickets = 0  # tickets presented that Redis did not know (expired, forged, flushed)
        self._reserve = client.register_script(_RESERVE)
        self._renew = client.register_script(_RENEW)
        self._reassert = client.register_script(_REASSERT)
        self._touch = client.register_script(_TOUCH)
        self._stats = client.register_script(_STATS)
        self._holders = client.register_script(_HOLDERS)
        self._set_hint = client.register_script(_SET_HINT)
        self._drop_ticket = client.register_script(_DROP_TICKET)
        self._release = client.register_script(_RELEASE)

    # ------------------------------------------------------------------------------------------- keys
    def keys(self, cluster: str, cls: str) -> dict[str, str]:
        """The sixteen keys of one (cluster, class) budget, by role."""
        check_id("cluster id", cluster)
        check_id("class name", cls)
        base = f"{self.prefix}adm:{{{cluster}/{cls}}}:"
        return {k: base + k
                for k in ("lease", "tok", "q", "qlease", "qtok", "seq", "end", *_TICKET_KEYS, "turn", "since")}

    def _host_keys(self, cluster: str, cls: str) -> list[str]:
        """(lease, q, tix) of ``cls``'s budget on every cluster co-located with ``cluster`` (RELEASE, HOLDERS)."""
        out = []
        for other in self.co_located(cluster):
            k = self.keys(other, cls)
            out += [k["lease"], k["q"], k["tix"]]
        return out

    def _tkeys(self, cluster: str, cls: str) -> list[str]:
        k = self.keys(cluster, cls)
        return [k[n] for n in _TICKET_KEYS]

    # ---------------------------------------------------------------------------------- reservations
    def _guard_args(self) -> tuple[list[str], list[int]]:
        if self.guard is None:
            return ["", ""], [0, 0]
        return self._guard_keys, [ttl_ms(self.guard.alive_ttl_s), ttl_ms(self.guard.grace_s)]

    def _call_reserve(self, cluster, cls: ClassSpec, request_id, tokens, lease_ttl_s, mode, expected_s=0.0,
                      ticket_id: str = "", issue: bool = True):
        """One RESERVE call: (status, reservation or None, queue length, ticket id held after it ('' none),
        presented ticket state 0 none / 1 honoured / 2 unknown)."""
        try:
            tokens = operator.index(tokens)  # ints, numpy ints; not floats
        except TypeError:
            raise ValueError(f"tokens must be an integer, got {tokens!r}") from None
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        if not request_id:
            raise ValueError("empty request_id")
        k = self.keys(cluster, cls.name)
        gkeys, gargs = self._guard_args()
        cfg = self.config
        raw = self._reserve(
            keys=[k["lease"], k["tok"], k["q"], k["qlease"], k["qtok"], k["seq"], k["end"],
                  *(k[n] for n in _TICKET_KEYS), k["turn"], *gkeys, k["since"]],
            args=[request_id, tokens, cls.inflight_token_budget, cls.max_concurrent, ttl_ms(lease_ttl_s), mode,
                  cls.queue_limit, ttl_ms(cfg.queue_lease_s), int(max(expected_s, 0.0) * 1000), *gargs,
                  ticket_id, new_ticket_id() if issue else "", ttl_ms(cfg.ticket_unhinted_s), cfg.ticket_limit,
                  repr(float(cfg.lend_margin))],
        )  # fmt: skip
        status, _sum, _count, qlen, expiry_ms, recovering = (int(x) for x in raw[:6])
        held, lent_from = (x.decode() if isinstance(x, bytes) else str(x) for x in (raw[6], raw[11]))
        tstate, issued, hinted, free = (int(x) for x in raw[7:11])
        res = None
        if status == _OK:
            waited = TicketWait(issued / 1000.0, hinted / 1000.0, free / 1000.0) if tstate == 1 else None
            res = Reservation(cluster, cls.name, request_id, tokens, expiry_ms / 1000.0, lease_ttl_s, waited,
                              lent_from, admitted_ms=expiry_ms - ttl_ms(lease_ttl_s))
        self._recovering = bool(recovering)
        return status, res, qlen, held, tstate

    def try_reserve(
        self, cluster: str, cls: ClassSpec, request_id: str, tokens: int, lease_ttl_s: float
    ) -> Reservation | None:
        """Reserve ``tokens`` of ``cls``'s budget on ``cluster`` now, or None (never waits, never queues).

        Idempotent per ``request_id``: calling again while the reservation is held renews it and returns it."""
        _, res, _, _, _ = self._call_reserve(cluster, cls, request_id, tokens, lease_ttl_s, _TRY, issue=False)
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
        expected_s: float = 0.0,
        ticket_id: str = "",
    ) -> Reservation:
        """Reserve, waiting in the class queue up to ``max_wait_s`` (default ``cls.max_wait_s``). ``expected_s``:
        how long the request is expected to hold the reservation (published as its expected end, for hints; a
        request with one may be lent the room of a held place whose holder comes back after it, module docstring;
        the reservation's ``lent_from`` names that place).
        ``ticket_id``: the id of a retry ticket of this (cluster, class) the request came back with: it is admitted
        into that place when it is free; back early, it waits in its place if that is among the next
        ``max_concurrent`` to come free (``_wait_in_place``), else it is refused ("early") with a fresh hint and the
        same place (an id Redis
        does not know: as a newcomer, ``unknown_tickets`` counts it).

        Raises AdmissionRejected: "queue_full" when the queue already holds ``queue_limit`` waiters, "timeout"
        after the wait, "over_budget" when waiting is disabled (max wait 0), "cancelled" when ``cancel`` is set;
        all but "cancelled" carry a ticket for the request's place in line (module docstring, "Tickets").
        The waiter leaves the queue on every exit path (and its lease clears it if this process dies).
        """
        wait = cls.max_wait_s if max_wait_s is None else max_wait_s
        mode = _WAIT if wait > 0 else _TRY
        status, res, qlen, held, tstate = self._call_reserve(cluster, cls, request_id, tokens, lease_ttl_s, mode,
                                                             expected_s, ticket_id)
        if tstate == 2:
            self.unknown_tickets += 1  # plain int bumps are fine for a diagnostic count under the GIL
        if status == _OK:
            return res
        rej = functools.partial(self._rejected, cluster, cls, tokens, expected_s=expected_s)
        if status == _NO and tstate == 1:
            return self._wait_in_place(cluster, cls, request_id, tokens, lease_ttl_s, expected_s, held,
                                       wait, cancel)
        if status == _NO:
            raise rej("over_budget", f"{cls.name} on {cluster}: over budget and no waiting allowed", ticket_id=held)
        if status == _FULL:
            raise rej("queue_full", f"{cls.name} on {cluster}: queue full ({qlen} waiting)", ticket_id=held)
        # a plain waiter (ticket holders do not wait); on timeout its queue place becomes its ticket
        deadline = self._clock() + wait
        try:
            while True:
                now = self._clock()
                if cancel is not None and cancel.is_set():
                    raise AdmissionRejected(0.0, f"{request_id} cancelled while queued for {cls.name}", "cancelled",
                                            cluster, cls.name)
                if now >= deadline:
                    _, _, qlen, held, _ = self._call_reserve(cluster, cls, request_id, tokens, lease_ttl_s, _REFUSE,
                                                             expected_s)
                    raise rej("timeout", f"{cls.name} on {cluster}: not admitted within {wait:.3g}s ({qlen} waiting)",
                              ticket_id=held)
                self._sleep(min(self._jitter(), deadline - now))
                status, res, qlen, held, _ = self._call_reserve(cluster, cls, request_id, tokens, lease_ttl_s, _WAIT,
                                                                expected_s)
                if status == _OK:
                    return res
                # _FULL here means our waiter lease lapsed (a stall longer than queue_lease_s) and the queue filled
                # meanwhile: give up like any other newcomer would (with a place at the end of the line).
                if status == _FULL:
                    raise rej("queue_full", f"{cls.name} on {cluster}: lost its place in a full queue", ticket_id=held)
        except BaseException:
            self._leave_queue(cluster, cls.name, request_id)
            raise

    def _wait_in_place(self, cluster: str, cls: ClassSpec, request_id: str, tokens: int, lease_ttl_s: float,
                       expected_s: float, ticket_id: str, wait_s: float,
                       cancel: threading.Event | None) -> Reservation:
        """A ticket holder back before its place is free: it polls in its place (nobody behind can pass it) while
        the place is among the next ``max_concurrent`` to come free or is expected to come free within
        ``config.ticket_wait_s`` (re-checked every quarter of that), for at most ``wait_s`` in all; otherwise it is
        refused ("early") with a fresh hint and the same place. Bounded, because a waiting stream holds a router
        thread (with unbounded waits, early returners filled a router's stream slots while a holder whose place
        was free was turned away): at most about ``max_concurrent`` holders per budget wait at once. (Re-hints
        this close to the front were the least accurate: their waits are short, so small errors are large.)"""
        step = self.config.ticket_wait_s / 4
        start = self._clock()
        check_at = start
        while True:
            now = self._clock()
            if cancel is not None and cancel.is_set():
                raise AdmissionRejected(0.0, f"{request_id} cancelled while back early for {cls.name}", "cancelled",
                                        cluster, cls.name, Ticket(cluster, cls.name, ticket_id))
            if now >= check_at:
                try:
                    soon, before = self.line_view(cluster, cls, tokens, expected_s, ticket_id=ticket_id)
                except (redis.RedisError, OSError):
                    soon, before = float("inf"), cls.max_concurrent + 1
                near = before <= cls.max_concurrent or soon <= self.config.ticket_wait_s
                if not near or now - start >= wait_s:
                    raise self._rejected(cluster, cls, tokens, "early",
                                         f"{cls.name} on {cluster}: back before its place in line is free",
                                         expected_s=expected_s, ticket_id=ticket_id)
                check_at = now + step
            self._sleep(self._jitter())
            status, res, _, held, tstate = self._call_reserve(cluster, cls, request_id, tokens, lease_ttl_s, _TRY,
                                                              expected_s, ticket_id)
            if status == _OK:
                return res
            if tstate != 1:  # its place lapsed meanwhile (a stall past its life): refused like a newcomer
                raise self._rejected(cluster, cls, tokens, "early", f"{cls.name} on {cluster}: lost its place",
                                     expected_s=expected_s, ticket_id=held)

    def renew(self, reservation: Reservation, lease_ttl_s: float | None = None) -> Reservation | None:
        """Extend the lease by ``lease_ttl_s`` (default: the reservation's) from now; None when the lease was
        already gone (expired or released): the caller no longer holds budget and should re-reserve or fail."""
        ttl = reservation.lease_ttl_s if lease_ttl_s is None else lease_ttl_s
        k = self.keys(reservation.cluster, reservation.cls)
        expiry = int(self._renew(keys=[k["lease"], k["tok"], k["end"], k["since"]],
                                 args=[reservation.request_id, ttl_ms(ttl)]))
        if expiry == 0:
            return None
        return Reservation(reservation.cluster, reservation.cls, reservation.request_id, reservation.tokens,
                           expiry / 1000.0, ttl)  # fmt: skip

    def renew_many(self, reservations: Sequence[Reservation]) -> list[Reservation | None]:
        """``renew`` for every reservation a router holds, in one round trip (a pipeline of script calls)."""
        pipe = self._r.pipeline(transaction=False)
        for r in reservations:
            k = self.keys(r.cluster, r.cls)
            self._renew(keys=[k["lease"], k["tok"], k["end"], k["since"]], args=[r.request_id, ttl_ms(r.lease_ttl_s)],
                        client=pipe)
        out: list[Reservation | None] = []
        for r, expiry in zip(reservations, pipe.execute(), strict=True):
            expiry = int(expiry)
            out.append(
                None if expiry == 0 else Reservation(r.cluster, r.cls, r.request_id, r.tokens, expiry / 1000.0,
                                                     r.lease_ttl_s)  # fmt: skip
            )
        return out

    def reassert_many(self, held: Sequence[tuple[Reservation, float]]) -> list[tuple[Reservation, bool]]:
        """Renew the leases of running requests (reservation, expected remaining seconds) in one round trip, and
        put back any that Redis lost (flushed, restarted, paused past the lease): (new reservation, lost)."""
        pipe = self._r.pipeline(transaction=False)
        for r, remaining_s in held:
            k = self.keys(r.cluster, r.cls)
            self._reassert(keys=[k["lease"], k["tok"], k["end"], k["since"]],
                           args=[r.request_id, ttl_ms(r.lease_ttl_s), r.tokens, int(max(remaining_s, 0) * 1000)],
                           client=pipe)  # fmt: skip
        out = []
        for (r, _), (expiry, lost) in zip(held, pipe.execute(), strict=True):
            new = Reservation(r.cluster, r.cls, r.request_id, r.tokens, int(expiry) / 1000.0, r.lease_ttl_s)
            out.append((new, bool(int(lost))))
        return out

    def touch(self) -> bool:
        """The renewer's beat of the state-loss guard; True while Redis is recovering (no guard: False)."""
        if self.guard is None:
            return False
        return bool(int(self._touch(keys=self._guard_keys, args=self._guard_args()[1])))

    def release(self, reservation: Reservation, max_concurrent: int = 0) -> bool:
        """Return the tokens to the budget. Idempotent: True if this call released them, False if they were
        already gone (released before, or the lease expired). The reservation as admitted (``admitted_ms`` set)
        also reports how long it held its room (the budget's mean holding time, RELEASE); ``max_concurrent``, its
        class's cap, says when a co-located budget without a line is saturated all the same (0: never)."""
        k = self.keys(reservation.cluster, reservation.cls)
        keys = [k["lease"], k["tok"], k["end"], k["turn"], k["since"], k["q"], k["tix"],
                *self._host_keys(reservation.cluster, reservation.cls)]
        return bool(int(self._release(keys=keys, args=[reservation.request_id, reservation.admitted_ms,
                                                       max(int(max_concurrent), 0)])))

    # ---------------------------------------------------------------------------------------- reads
    def stats(self, cluster: str, cls: str, spec: ClassSpec | None = None) -> ClassLoad:
        """In-flight tokens and requests, queue length and held places of one (cluster, class), expired leases,
        waiters and tickets purged first (with ``spec``, held places that came free are stamped, see RESERVE)."""
        return self.stats_many([(cluster, cls)], {cls: spec} if spec else None)[0]

    def stats_many(self, pairs: Sequence[tuple[str, str]],
                   specs: dict[str, ClassSpec] | None = None) -> list[ClassLoad]:
        """``stats`` of many (cluster, class) pairs in one round trip (status and metrics read them all)."""
        pipe = self._r.pipeline(transaction=False)
        for cluster, cls in pairs:
            self.stats_on(pipe, cluster, cls, (specs or {}).get(cls))
        return [ClassLoad(*(int(x) for x in row)) for row in pipe.execute()]

    def stats_on(self, pipe, cluster: str, cls: str, spec: ClassSpec | None = None) -> None:
        """Queue ``stats`` of one (cluster, class) on a caller's pipeline: its row (``ClassLoad``'s fields) comes
        back among the pipeline's replies, so a monitor can read the raw keys atomically beside it."""
        k = self.keys(cluster, cls)
        self._stats(keys=[k["lease"], k["tok"], k["q"], k["qlease"], k["qtok"], k["end"],
                          *(k[n] for n in _TICKET_KEYS), k["since"]],
                    args=[spec.inflight_token_budget, spec.max_concurrent] if spec else [0, 0], client=pipe)

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
