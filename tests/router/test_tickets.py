"""Retry tickets against a real redis-server (admission.py, "Tickets"): a refused request's place is held, honoured
by any replica, expires a grace after its hinted moment, and a forged, expired or flushed ticket makes its bearer a
newcomer; the ticket's wire form is validated (tickets.py)."""

from __future__ import annotations

import threading
import time

import pytest

from k3serve.router.admission import Admission, AdmissionConfig, AdmissionRejected, ClassSpec
from k3serve.router.admission_lua import TICKET_KEYS
from k3serve.router.gate import AdmissionGate
from k3serve.router.tickets import MalformedTicket, Ticket, parse_ticket

ONE = ClassSpec("short", None, inflight_token_budget=1000, max_concurrent=1, queue_limit=0, max_wait_s=0.0)
CFG = AdmissionConfig(poll_min_s=0.002, poll_max_s=0.01, queue_lease_s=0.5, ticket_grace_s=0.3, ticket_wait_s=0.2)


def _refused(adm: Admission, rid: str, cls: ClassSpec = ONE, ticket: Ticket | None = None,
             expected_s: float = 0.4) -> AdmissionRejected:
    with pytest.raises(AdmissionRejected) as e:
        adm.reserve_or_wait("c0", cls, rid, 10, 30, expected_s=expected_s, ticket_id=ticket.id if ticket else "")
    return e.value


def test_a_refused_requests_place_is_held_against_newcomers_and_honoured_on_return(rclient, ns):
    adm = Admission(rclient, ns, CFG)
    holder = adm.reserve_or_wait("c0", ONE, "holder", 10, 30, expected_s=0.4)
    first = _refused(adm, "first")
    second = _refused(adm, "second")
    assert first.ticket is not None and second.ticket is not None and first.ticket != second.ticket
    # the first place comes free when the holder ends (~0.4 s), the second one round later (~0.8 s)
    assert 0.3 <= first.retry_after_s <= 0.45 and 0.7 <= second.retry_after_s <= 0.9
    assert adm.stats("c0", "short", ONE).held == 2
    adm.release(holder)
    _refused(adm, "newcomer")  # the room is held for the first ticket: a newcomer does not get it
    assert adm.try_reserve("c0", ONE, "sneak", 10, 30) is None
    with pytest.raises(AdmissionRejected):  # nor does the second ticket: the first is ahead of it
        adm.reserve_or_wait("c0", ONE, "second-early", 10, 30, ticket_id=second.ticket.id)
    res = adm.reserve_or_wait("c0", ONE, "first-back", 10, 30, ticket_id=first.ticket.id)
    assert res.waited is not None and res.waited.free_s <= time.time() + 0.05
    # the place came free at the release: stamped then (by the newcomer's call), before the holder came back
    assert res.waited.free_s - res.waited.issued_s < first.retry_after_s + 0.2
    assert adm.stats("c0", "short", ONE).held == 2  # second and the newcomer's; the first is redeemed
    assert adm.inflight("c0", "short") == (10, 1)


def test_any_replica_honours_a_ticket_and_an_early_holder_waits_only_near_the_front(new_client, ns):
    a, b = Admission(new_client(), ns, CFG), Admission(new_client(), ns, CFG)
    waiting = ClassSpec("short", None, inflight_token_budget=1000, max_concurrent=1, queue_limit=0, max_wait_s=2.0)
    holder = a.reserve_or_wait("c0", waiting, "holder", 10, 30, expected_s=0.8)
    first = _refused(a, "r1", waiting).ticket  # queue_limit 0: refused at once, with a place
    second = _refused(a, "r2", waiting).ticket
    t0 = time.monotonic()
    early = _refused(b, "r2-early", waiting, ticket=second)  # two places from the front: refused at once
    assert time.monotonic() - t0 < 0.15 and early.reason == "early" and early.ticket == second
    assert 1.0 <= early.retry_after_s <= 2.0  # a fresh hint for the same place (behind the holder and r1)
    threading.Timer(0.3, a.release, args=(holder,)).start()
    t1 = time.monotonic()
    res = b.reserve_or_wait("c0", waiting, "r1-back", 10, 30, ticket_id=first.id)  # next to come free: it waits
    assert 0.25 <= time.monotonic() - t1 < 0.6 and res.waited is not None  # and gets in when its place frees
    assert b.stats("c0", "short", waiting).held == 1  # (r2's)


def test_a_ticket_expires_a_grace_after_its_hint_and_its_keys_do_not_linger(rclient, ns):
    adm = Admission(rclient, ns, CFG)
    holder = adm.reserve_or_wait("c0", ONE, "holder", 10, 30, expected_s=0.2)
    rej = _refused(adm, "abandoned", expected_s=0.2)
    adm.release(holder)
    assert adm.try_reserve("c0", ONE, "n", 10, 30) is None  # held for its holder...
    time.sleep(rej.retry_after_s + CFG.ticket_grace_s + 0.1)
    assert adm.try_reserve("c0", ONE, "n", 10, 30) is not None  # ...until a grace after its hinted moment
    assert adm.stats("c0", "short", ONE).held == 0
    k = adm.keys("c0", "short")
    assert not any(rclient.exists(k[n]) for n in TICKET_KEYS)
    time.sleep(1.1)  # and the keys of a ticket nobody purges expire by themselves (1 s after the last ticket)
    left = _refused(adm, "left")  # (its hint: "n" has held its room far longer than the holder did, HOLDERS)
    time.sleep(left.retry_after_s + CFG.ticket_grace_s + 1.2)
    assert not any(rclient.exists(k[n]) for n in TICKET_KEYS)


def test_a_forged_or_expired_ticket_is_a_newcomer_and_a_flush_forgets_tickets(rclient, ns):
    adm = Admission(rclient, ns, CFG)
    holder = adm.reserve_or_wait("c0", ONE, "holder", 10, 30, expected_s=0.2)
    real = _refused(adm, "real").ticket
    forged = _refused(adm, "forged", ticket=Ticket("c0", "short", "0" * 24))
    assert adm.unknown_tickets == 1 and forged.ticket is not None and forged.ticket.id != "0" * 24  # a new place
    rclient.flushall()  # Redis forgets the holder and both places (the gate re-asserts its leases; see below)
    res = adm.reserve_or_wait("c0", ONE, "real-back", 10, 30, ticket_id=real.id)
    assert res.waited is None and adm.unknown_tickets == 2  # admitted as a newcomer: nothing held it
    adm.release(res)
    assert holder.request_id == "holder"


def test_a_waiter_that_times_out_keeps_its_place_as_its_ticket(rclient, ns):
    cls = ClassSpec("short", None, inflight_token_budget=1000, max_concurrent=1, queue_limit=1, max_wait_s=0.2)
    adm = Admission(rclient, ns, CFG)
    holder = adm.reserve_or_wait("c0", cls, "holder", 10, 30, expected_s=1.0)
    box: dict = {}

    def wait():
        try:
            adm.reserve_or_wait("c0", cls, "waiter", 10, 30, expected_s=1.0)
        except AdmissionRejected as e:
            box["rej"] = e

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.05)
    later = _refused(adm, "later", cls, expected_s=1.0)  # queue full: a place behind the waiter
    t.join(2)
    rej = box["rej"]
    assert rej.reason == "timeout" and rej.ticket is not None and adm.stats("c0", "short", cls).queued == 0
    assert rej.retry_after_s < later.retry_after_s - 0.5  # ahead of the later one: one round earlier
    adm.release(holder)
    assert adm.reserve_or_wait("c0", cls, "w-back", 10, 30, ticket_id=rej.ticket.id).waited is not None


def test_through_the_gate_a_ticket_for_another_budget_is_given_up(rclient, ns):
    classes = [ClassSpec("short", 100, 1000, 1, 0, 0.0), ClassSpec("long", None, 10_000, 1, 0, 0.0)]
    gate = AdmissionGate(rclient, ns, classes, lease_ttl_s=5.0)
    try:
        holder = gate.admit("c0", "h", 50, remaining_s=lambda: 0.5)
        with pytest.raises(AdmissionRejected) as e:
            gate.admit("c0", "r", 50, remaining_s=lambda: 0.5)
        ticket = e.value.ticket
        assert ticket.cls == "short" and gate.class_stats(["c0"])["short"]["held"] == 1
        # the request comes back as a long one (its cache estimate changed): the short place is freed
        res = gate.admit("c0", "r", 5000, ticket=ticket)
        assert res.cls == "long" and gate.counters["tickets_moved"] == 1
        assert gate.class_stats(["c0"])["short"]["held"] == 0
        gate.release(holder)
        gate.release(res)
    finally:
        gate.close()


def test_the_budget_holds_with_places_held_through_a_flush(rclient, ns):
    """The budget invariant counts in-flight leases only; tickets hold places, never tokens, so losing them in a
    flush cannot admit anyone over budget, and re-asserted leases still keep newcomers out."""
    gate = AdmissionGate(rclient, ns, [ONE], lease_ttl_s=1.0, renew_interval_s=0.1)
    probe = Admission(rclient, ns)
    try:
        running = gate.admit("c0", "run", 10, remaining_s=lambda: 5.0)
        with pytest.raises(AdmissionRejected) as e:
            gate.admit("c0", "r", 10)
        rclient.flushall()
        time.sleep(0.5)  # the renewer puts the running lease back
        with pytest.raises(AdmissionRejected):
            gate.admit("c0", "r", 10, ticket=e.value.ticket)  # its ticket is gone, and the budget is full anyway
        assert probe.stats("c0", "short").count == 1
        gate.release(running)
    finally:
        gate.close()


def test_the_wire_form_of_a_ticket_is_validated():
    t = Ticket("c0", "short", "ab" * 12)
    assert parse_ticket(str(t)) == t
    for bad in ("", "c0/short", "c0/short/xyz", "c0/short/" + "ab" * 13, "c:0/short/" + "ab" * 12,
                "c0/short/" + "ab" * 12 + "/x", "x" * 300):
        with pytest.raises(MalformedTicket, match="retry-ticket"):
            parse_ticket(bad)


def test_ticket_holders_have_a_few_stream_slots_beyond_the_routers_limit():
    from k3serve.router.progress import DurationModel, StreamProgress
    from k3serve.router.slots import StreamSlots

    slots = StreamSlots(2, ticket_extra=1)
    streams = [StreamProgress("short", 8, DurationModel()) for _ in range(4)]
    assert slots.try_acquire(streams[0]) and slots.try_acquire(streams[1])
    assert not slots.try_acquire(streams[2])  # a newcomer is refused at the limit
    assert slots.try_acquire(streams[2], ticket=True)  # a holder coming back on its ticket is not
    assert not slots.try_acquire(streams[3], ticket=True)  # but the extra slots are bounded too
