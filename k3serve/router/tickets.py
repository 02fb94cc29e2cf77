"""Retry tickets: a refused request's place in line, held for it in Redis (admission.py's Lua, admission_lua.py).

A refused client's place is held. Every refusal (queue full, waited ``max_wait_s``, no waiting allowed,
or turned away before admission by a router's stream limit) takes, in the same Lua call, a *place in line*: a
ticket whose place is the next arrival number (a waiter that times out keeps its queue place), stored under a
random id. The hint is when that place is expected to come free: the holders' expected ends and everything ahead
of it in line (queue entries and held places), as ``drain_wait_s`` computes it. The line is one order over queue
entries and tickets, and the admission rule counts *everything ahead of a request in line as taken*:

```
   line (arrival numbers):   q:5   tix:6   tix:7   q:8        newcomer (no place yet: behind all of them)
   request at place p fits iff fits(t, in-flight + everything before p: waiters and held places)
```
So a burst that keeps arriving cannot take the room that frees up before the refused clients come back (the reason
hints were early under a burst before tickets), and a ticket holder that comes back is admitted into its place when
it is free; back before that, it waits in its place while that is expected to come free within ``ticket_wait_s`` (1
s) or is among the next ``max_concurrent`` places to come free (about that many wait per budget at once), else it is
refused at once with a fresh hint and the same place (a waiting stream holds a router thread: with unbounded waits,
early returners filled a router's stream slots while a holder whose place was free was turned away). A plain waiter
that times out is refused with its queue place as its ticket. Hints for ticketed refusals are not scaled late: an
early return only waits in its place, while a late one leaves the place empty and delays everyone behind it.

* Expiry: a ticket lives until ``ticket_grace_s`` after its hinted moment, so an abandoned ticket stops blocking
  the line (cost: one whose place came free early holds that room empty until then); the ticket keys expire a
  second after their last ticket (keys of unadmitted requests do not linger).
* Replicas and restarts: tickets live in Redis, so any router honours any router's ticket. A ticket Redis no
  longer knows (expired, forged, lost in a flush or restart) makes its bearer a newcomer: not an error (the
  client did nothing wrong, and the budget invariant never depends on tickets: they hold places, not tokens). A
  ticket for another (cluster, class) than the request now maps to (its pin moved, its cache estimate changed) is
  given up, freeing its place, and the request joins that budget's line as a newcomer. Classes have separate
  budgets and lines, so tickets of one class never delay another.
* At most ``ticket_limit`` places are held per (cluster, class); beyond it a refusal carries the old hint (drain
  time, scaled late) and no ticket.
* Each honoured ticket reports (``Reservation.waited``) its issue time, hinted moment and the first moment a
  Lua call saw its place free, so the router exports how accurate its hints are.

Lending (work conservation, as EASY/conservative backfilling in a batch scheduler). A held place whose holder is
away leaves its room empty until the holder comes back; the places behind it count it as taken, so before lending
the whole line moved at the pace its holders came back, not at the service's. So a request present now (a newcomer,
a waiter, a holder back early) may *pass* held places ahead of it whose holders are away, are not lent already and
are hinted to come back no sooner than ``lend_margin`` (2) x its expected duration from now (the same estimate its
published end and the hints use: learned time to first token + max_tokens x time per token). It is admitted when

```
  the room is there now:   fits(t, in flight)                                  (borrowers included: budgets hold)
  and the line allows it:  fits(t, in flight + everything ahead of it in line, less the places it may pass)
```
and if it needed to pass any, the first of them (always a free one) is *lent* to it (``tixlent``: ticket ->
borrower). A lent place whose holder is away counts as no place in line (its borrower, in flight, stands in for it;
its tokens as its own less the borrower's), so lending changes nobody else's count and the budget never holds more
than it admits. When the borrower ends, the place counts again; its holder, back at its hint, finds its room free.

* Overrun (a borrower still running when the holder comes back): the holder is not admitted over the budget; it
  waits in its place for the next room (its claim is live again: a holder that is back, ``tixhere``, polling in its
  place, is never passed and its place not lent), so an overrun delays one holder by the borrower's overrun and
  never exceeds the budget. The margin makes that rare (it is measured and printed by the load test). A borrower
  is not cut short (its max_tokens are the client's).
* What counts as the holder's wait (the hint's accuracy, ``tixfree`` and the load test): the first moment its place
  is free by the line rule with its own borrower not counted (that borrower is in its room only while it is away).

Pace. Behind a line, a place comes free after ``in flight + ahead + 1 - max_concurrent`` more places have. The pace
of places is the budget's mean *holding time* (admission to release, measured by RELEASE) over ``max_concurrent``:
the service's own pace when its rooms are kept busy. Only holds released while others wait in line count for it
(``turn.shold``; every hold before a line was first seen): a hold released to nobody is the service at low load,
and a burst's tail (its last requests alone and fast) had set the next burst's first hints early. It was the measured interval between admissions, which is
self-fulfilling: holders come back at their hints, so that interval is the hinted pace, and a line started slow (a
burst's first requests are slow) stayed slow with its rooms idle (25% busy, one request in flight of two).
Hinted at the service's pace, holders that the service is slower than come back early and wait in their places
(present: they keep the rooms busy); those whose places come free early are passed by whoever is present.
Holds in progress count too, as right-censored observations (a request that has held its room for a will hold it
at least a). One older than the completed holds make typical
(their mean + 2 mean absolute deviations) is taken to hold its room 2 x its age in all (the median of a lifetime
seen only to have lasted a): its room comes free no sooner than admission + 2 x its age, which bounds the
places in line behind it, while the pace of the places beyond stays the completed holds' (admission_lua.HOLDERS,
retry_hint.drain_wait_s; taken as the pace of every place, it moved the line at that pace: 39% busy). So a
burst that slows the service shows in the hints as soon as its first holders outlast the recent holds, not only
after they end (the completed holds' mean learned before the burst made its first seconds' hints 2-4x early).

The wire form:

A ticket is handed out with every RESOURCE_EXHAUSTED that carries a retry-after (gRPC trailing metadata
``retry-ticket``, next to ``retry-after-s``); a client that comes back with it (request metadata
``retry-ticket``) is admitted into its held place. On the wire it names the budget it belongs to:

```
  retry-ticket: <cluster>/<class>/<id>        e.g.  c0/short/5f0c3a9e1b7d42c6a8e0f1d2
                  check_id   check_id  24 hex digits (random: unguessable, so a place cannot be stolen by guessing)
```

Metadata rather than a request field: like ``retry-after-s`` it is flow control between the client and the
router, not part of what is generated; any gRPC client can echo a trailer without a new proto, and a request
body stays the same across its retries.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass

from k3serve.router.membership import check_id

METADATA_KEY = "retry-ticket"
MAX_TICKET_CHARS = 200
_ID_RE = re.compile(r"[0-9a-f]{24}")  # fullmatch: `$` lets a trailing newline by


class MalformedTicket(ValueError):
    """A ``retry-ticket`` that is not one this router could have issued (gRPC INVALID_ARGUMENT)."""


@dataclass(frozen=True)
class Ticket:
    """A held place in the line of one (cluster, class) budget."""

    cluster: str
    cls: str
    id: str

    def __str__(self) -> str:
        return f"{self.cluster}/{self.cls}/{self.id}"


def new_ticket_id() -> str:
    return secrets.token_hex(12)


def parse_ticket(text: str) -> Ticket:
    """The ticket a client presented; MalformedTicket naming the field when it is not well formed. A well-formed
    ticket that Redis does not know (forged, expired, lost in a flush) is not an error here: admission treats its
    bearer as a newcomer (admission.py)."""
    if len(text) > MAX_TICKET_CHARS:
        raise MalformedTicket(f"{METADATA_KEY}: at most {MAX_TICKET_CHARS} characters, got {len(text)}")
    parts = text.split("/")
    if len(parts) != 3 or not _ID_RE.fullmatch(parts[2]):
        raise MalformedTicket(f"{METADATA_KEY}: expected <cluster>/<class>/<24 hex digits>, got {text[:80]!r}")
    try:
        check_id("cluster id", parts[0])
        check_id("class name", parts[1])
    except ValueError as e:
        raise MalformedTicket(f"{METADATA_KEY}: {e}") from None
    return Ticket(*parts)


@dataclass(frozen=True)
class TicketWait:
    """What an honoured ticket measured (Redis clock, seconds): when it was handed out, the moment its hint named,
    and the first moment its place was seen free (or when its holder got in, if no call saw it earlier)."""

    issued_s: float
    hinted_s: float
    free_s: float

    def accuracy(self, floor_s: float = 0.05) -> float:
        """hint / real wait (1: exact; both floored at ``floor_s``, the shortest hint handed out)."""
        return max(self.hinted_s - self.issued_s, floor_s) / max(self.free_s - self.issued_s, floor_s)
