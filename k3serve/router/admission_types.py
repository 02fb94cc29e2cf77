"""The plain data of admission (router/admission.py): request classes, reservations, loads, the rejection, and the
knobs of waiting and of recovery after a Redis state loss."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from k3serve.router.membership import check_id
from k3serve.router.tickets import Ticket, TicketWait


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
    waited: TicketWait | None = None  # got in on a retry ticket: what its hint promised and what happened
    lent_from: str = ""  # the held place (ticket id) whose room it was lent (tickets.py, "Lending"); "" none
    admitted_ms: int = 0  # Redis ms of the admission (0: not this object's, e.g. a renewal's copy)


@dataclass(frozen=True)
class ClassLoad:
    tokens: int  # in-flight tokens
    count: int  # in-flight requests
    queued: int  # waiters
    held: int = 0  # places held for refused requests (retry tickets)
    lent: int = 0  # of those, places lent to a borrower in flight


class AdmissionRejected(Exception):
    """Not admitted: ``reason`` is "queue_full", "timeout", "over_budget" (no waiting allowed), "early" (back on a
    ticket whose place is not free yet), "refused" (turned away before admission, e.g. at a router's stream limit)
    or "cancelled". Map to gRPC RESOURCE_EXHAUSTED with
    ``retry_after_s`` as the hint and ``ticket`` (None: none could be held) as the place held for the request: the
    hint is when that place is expected to come free (``drain_wait_s``)."""

    def __init__(self, retry_after_s: float, message: str, reason: str = "timeout", cluster: str = "",
                 cls: str = "", ticket: Ticket | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.message = message
        self.reason = reason
        self.cluster, self.cls = cluster, cls
        self.ticket = ticket


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
    """Waiting behaviour. Waiters poll every U(poll_min_s, poll_max_s) seconds (jitter keeps replicas from
    polling in lock-step); a waiter that stops polling (crashed router) leaves the queue ``queue_lease_s`` later.

    Retry tickets (admission.py, "Tickets"): a refused request's place is held until ``ticket_grace_s`` after the
    moment its hint names (then an abandoned ticket stops blocking the line), ``ticket_unhinted_s`` while its hint
    is being computed; at most ``ticket_limit`` places per (cluster, class) are held, beyond that refusals carry a
    hint but no ticket. A holder back before its place is free waits in it while the place is among the next
    ``max_concurrent`` to come free or expected to within ``ticket_wait_s``.

    Lending (tickets.py): a request may pass a held place whose holder is away only if it is expected to end by
    the place's hinted moment with ``lend_margin`` x its expected duration (0: no lending)."""

    poll_min_s: float = 0.005
    poll_max_s: float = 0.03
    queue_lease_s: float = 2.0
    ticket_grace_s: float = 2.0
    ticket_unhinted_s: float = 10.0
    ticket_limit: int = 1024
    ticket_wait_s: float = 1.0
    lend_margin: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.poll_min_s <= self.poll_max_s:
            raise ValueError(f"need 0 < poll_min_s <= poll_max_s, got {self}")
        if self.queue_lease_s <= self.poll_max_s:
            raise ValueError("queue_lease_s must exceed poll_max_s, or live waiters would expire between polls")
        if self.lend_margin < 0:
            raise ValueError(f"need lend_margin >= 0 (0: no lending), got {self.lend_margin}")
        if self.ticket_grace_s <= 0 or self.ticket_unhinted_s <= 0 or self.ticket_limit < 0 or self.ticket_wait_s < 0:
            raise ValueError(f"need ticket_grace_s > 0, ticket_unhinted_s > 0, ticket_limit >= 0, got {self}")
