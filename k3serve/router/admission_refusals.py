"""The refusal half of ``Admission`` (router/admission.py): refusals with their retry-after hint and the place in
line held for them (tickets, router/tickets.py). A mixin: it uses Admission's client, keys, scripts and config."""

from __future__ import annotations

import redis

from k3serve.router.admission_lua import REFUSE
from k3serve.router.admission_types import AdmissionRejected, ClassSpec
from k3serve.router.membership import ttl_ms
from k3serve.router.retry_hint import CENSORED_FACTOR, HINT_JITTER, HINT_LATENESS, TYPICAL_SPREAD, drain_wait_s
from k3serve.router.tickets import Ticket

MIN_RETRY_AFTER_S = 0.05  # a hint of 0 invites a tight retry loop


class AdmissionRefusals:
    def refuse(self, cluster: str, cls: ClassSpec, request_id: str, tokens: int, message: str, *,
               ticket_id: str = "", expected_s: float = 0.0, at_least_s: float = 0.0,
               unseen: tuple[int, int] = (0, 0)) -> AdmissionRejected:
        """Turn a request away before admission (a router at its stream limit) with a place in this budget's line:
        the presented ticket's, or a new one at the end. The hint is when the place is expected to come free
        (without a place: not before ``at_least_s``, the router's own reason to refuse). ``unseen`` only matters
        when no place could be held (see ``retry_after``)."""
        _, _, _, held, tstate = self._call_reserve(cluster, cls, request_id, max(int(tokens), 0), 1.0, REFUSE,
                                                   expected_s, ticket_id)
        if tstate == 2:
            self.unknown_tickets += 1
        return self._rejected(cluster, cls, tokens, "refused", message, expected_s=expected_s, unseen=unseen,
                              ticket_id=held, at_least_s=at_least_s)

    def holds(self, ticket: Ticket) -> bool:
        """Whether ``ticket`` holds a place now (a router grants its ticket slots only to real tickets)."""
        return self._r.zscore(self.keys(ticket.cluster, ticket.cls)["tix"], ticket.id) is not None

    def drop_ticket(self, ticket: Ticket) -> bool:
        """Give up a held place (its holder went elsewhere or away), so that those behind it move up. Best effort:
        an unreachable Redis lets it expire instead. True if the ticket was held."""
        try:
            return bool(int(self._drop_ticket(keys=self._tkeys(ticket.cluster, ticket.cls), args=[ticket.id])))
        except (redis.RedisError, OSError):
            return False

    def retry_after(self, cluster: str, cls: ClassSpec, tokens: int, round_s: float = 0.0,
                    unseen: tuple[int, int] = (0, 0), ticket_id: str = "") -> float:
        """``drain_wait_s`` for a request of ``tokens`` on (cluster, cls), from the holders' published ends and the
        budget's measured pace, behind the waiters and held places ahead of ``ticket_id``'s place (none: ahead of
        the end of the line).

        ``unseen`` = (requests, tokens) ahead of this one that Redis does not show yet (a router's streams that
        hold a stream slot but have not reached admission): they count as waiters ahead. (A ticket's place is
        ahead of them: they will line up behind it.)"""
        return self.line_view(cluster, cls, tokens, round_s, unseen, ticket_id)[0]

    def line_view(self, cluster: str, cls: ClassSpec, tokens: int, round_s: float = 0.0,
                  unseen: tuple[int, int] = (0, 0), ticket_id: str = "") -> tuple[float, int]:
        """(``retry_after``, how many places must come free before this one: the in-flight requests and those
        ahead in line, less the concurrency cap)."""
        k = self.keys(cluster, cls.name)
        raw = [int(x) for x in self._holders(keys=[k["lease"], k["tok"], k["q"], k["qtok"], k["end"], k["turn"],
                                                   *self._tkeys(cluster, cls.name), k["since"],
                                                   *self._host_keys(cluster, cls.name)],
                                             args=[ticket_id, repr(CENSORED_FACTOR), repr(TYPICAL_SPREAD),
                                                   cls.max_concurrent])]
        now, queued, queued_tokens, turnover_ms, last_ms, hold_ms = raw[:6]
        queued, queued_tokens = queued + unseen[0], queued_tokens + unseen[1]
        # the pace at which places come free: the budget's mean holding time over its rooms, the service's own
        # pace when it is kept busy (tickets.py, "Pace"; the host's, while every budget of the class on its host is
        # saturated: admission_lua.HOLDERS); the measured interval between admissions before any request has ended
        if hold_ms > 0:
            turnover_ms = hold_ms / cls.max_concurrent
        # a holder that published no end (a caller without a duration estimate): assume the old rule of thumb,
        # that the class turns over in about max_wait_s
        unknown = now + int(max(cls.max_wait_s, 0.1) * 1000)
        # a holder's room comes free no sooner than its published end (its own expected duration, learned from
        # streams) nor than the end its hold is expected to reach (HOLDERS: admission + the pace, or the censored
        # estimate): under a burst the streams' durations miss the time a request holds its room beyond them
        bounds = raw[9::4]
        holders = [(t, max(e, b) if e >= 0 else (b if b >= 0 else unknown))
                   for t, e, b in zip(raw[6::4], raw[7::4], bounds)]
        since_s = (now - last_ms) / 1000.0 if last_ms >= 0 else 0.0
        wait = drain_wait_s(now, holders, queued, queued_tokens, tokens, cls.inflight_token_budget,
                            cls.max_concurrent, round_s, turnover_s=max(turnover_ms, 0) / 1000.0,
                            since_turn_s=since_s, held_ends_ms=bounds)
        return wait, max(len(holders) + queued + 1 - cls.max_concurrent, 0)

    def _rejected(self, cluster: str, cls: ClassSpec, tokens: int, reason: str, message: str,
                  expected_s: float = 0.0, unseen: tuple[int, int] = (0, 0), ticket_id: str = "",
                  at_least_s: float = 0.0) -> AdmissionRejected:
        """The rejection with its hint (the recovery grace while Redis recovers from a state loss).

        With a held place (``ticket_id``): when that place is expected to come free, unscaled (an early return
        waits in its place; a late one leaves it empty), written to the ticket so that it expires a grace after
        it. Without one: the expected drain time of the budget, scaled late and jittered by +0-``HINT_JITTER``
        (an early retry would be refused again, and refused clients should not all return at once)."""
        recovering = self._recovering and self.guard is not None
        if recovering:
            hint, message = self.guard.grace_s, f"{message} (admission state recovering after a Redis loss)"
        else:
            try:
                hint = self.retry_after(cluster, cls, tokens, round_s=expected_s,
                                        unseen=(0, 0) if ticket_id else unseen, ticket_id=ticket_id)
            except (redis.RedisError, OSError):
                hint = max(cls.max_wait_s, 0.1)  # no holders to read: the queue turns over in about max_wait_s
        # at_least_s (a router's slots) binds only refusals without a place: a ticket holder coming back gets one
        # of the router's ticket slots (slots.py), so its place, not the router, says when it can run
        hint = max(hint, MIN_RETRY_AFTER_S, 0.0 if ticket_id else at_least_s)
        if not ticket_id and not recovering:
            with self._rng_lock:
                hint *= HINT_LATENESS * self._rng.uniform(1.0, 1.0 + HINT_JITTER)
        hint, ticket = round(hint, 3), None
        if ticket_id:
            try:
                held = int(self._set_hint(keys=self._tkeys(cluster, cls.name),
                                          args=[ticket_id, int(hint * 1000), ttl_ms(self.config.ticket_grace_s)]))
            except (redis.RedisError, OSError):
                held = 0  # the place lives its unhinted life (ticket_unhinted_s) and then lapses
            ticket = Ticket(cluster, cls.name, ticket_id) if held else None
        return AdmissionRejected(hint, message, reason, cluster, cls.name, ticket)
