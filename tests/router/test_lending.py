"""Lending held places against a real redis-server (tickets.py, "Lending"): a free held place whose holder is away
is lent to a request present now that is expected to end before the holder's hinted moment; never to one that
would outlast it, has no estimate, or while the holder is back; an overrunning borrower makes the returning holder
wait, never the budget run over; lending changes nobody else's count in line."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from k3serve.router.admission import Admission, AdmissionConfig, AdmissionRejected, ClassSpec
from k3serve.router.tickets import Ticket

ONE = ClassSpec("short", None, inflight_token_budget=1000, max_concurrent=1, queue_limit=0, max_wait_s=0.0)
TWO = ClassSpec("short", None, inflight_token_budget=1000, max_concurrent=2, queue_limit=0, max_wait_s=0.4)
CFG = AdmissionConfig(poll_min_s=0.002, poll_max_s=0.01, queue_lease_s=0.5, ticket_grace_s=0.3, ticket_wait_s=0.2,
                      lend_margin=2.0)


def _ended_early(adm: Admission, res) -> None:
    """Release ``res`` as a request that ended far earlier than expected, without teaching the budget's pace (its
    admission moment unknown): hints stay those of the published ends, so the held places' holders stay away."""
    adm.release(dataclasses.replace(res, admitted_ms=0))


def _refused(adm: Admission, rid: str, cls: ClassSpec, expected_s: float, ticket: Ticket | None = None,
             tokens: int = 10) -> AdmissionRejected:
    with pytest.raises(AdmissionRejected) as e:
        adm.reserve_or_wait("c0", cls, rid, tokens, 30, expected_s=expected_s, ticket_id=ticket.id if ticket else "")
    return e.value


def test_a_free_held_place_is_lent_to_a_request_that_ends_before_its_holder_returns(rclient, ns):
    adm = Admission(rclient, ns, CFG)
    holder = adm.reserve_or_wait("c0", ONE, "holder", 10, 30, expected_s=3.0)
    away = _refused(adm, "away", ONE, expected_s=3.0)
    assert 2.5 <= away.retry_after_s <= 3.1  # its place comes free when the holder is expected to end
    _ended_early(adm, holder)  # the place is free, its holder away for ~3 s
    long = _refused(adm, "too-long", ONE, expected_s=2.0)  # 2 x 2 s would outlast the hint: not lent
    before = adm.line_view("c0", ONE, 10, ticket_id=long.ticket.id)[1]
    assert adm.try_reserve("c0", ONE, "no-estimate", 10, 30) is None  # no expected duration: passes nobody
    res = adm.reserve_or_wait("c0", ONE, "short", 10, 30, expected_s=0.3)  # ends well before: lent the room
    assert res.lent_from == away.ticket.id and res.waited is None
    load = adm.stats("c0", "short", ONE)
    assert (load.count, load.held, load.lent) == (1, 2, 1)  # (held: away's and too-long's)
    # the borrower stands in for the place it borrowed: the line behind it counts the same as before the lend
    assert adm.line_view("c0", ONE, 10, ticket_id=long.ticket.id)[1] == before
    _refused(adm, "another", ONE, expected_s=0.1)  # one room, in flight: nobody else gets in
    adm.release(res)
    back = adm.reserve_or_wait("c0", ONE, "away-back", 10, 30, ticket_id=away.ticket.id)
    assert back.waited is not None and not back.lent_from  # its place was kept for it
    # its place counted as free from the moment the holder ended (the borrower was in its room, not its way)
    assert back.waited.free_s - back.waited.issued_s < 0.5
    assert adm.stats("c0", "short", ONE).lent == 0


def test_lending_is_off_with_a_zero_margin(rclient, ns):
    adm = Admission(rclient, ns, AdmissionConfig(poll_min_s=0.002, poll_max_s=0.01, lend_margin=0.0))
    holder = adm.reserve_or_wait("c0", ONE, "holder", 10, 30, expected_s=3.0)
    _refused(adm, "away", ONE, expected_s=3.0)
    adm.release(holder)
    _refused(adm, "short", ONE, expected_s=0.1)  # the held place stays empty for its holder
    assert adm.stats("c0", "short", ONE).count == 0


def test_a_holder_that_is_back_is_not_passed_and_one_back_early_borrows_from_an_absent_one(new_client, ns):
    a, b = Admission(new_client(), ns, CFG), Admission(new_client(), ns, CFG)
    h1 = a.reserve_or_wait("c0", TWO, "h1", 10, 30, expected_s=3.0)
    h2 = a.reserve_or_wait("c0", TWO, "h2", 10, 30, expected_s=3.0)
    r1 = _refused(a, "r1", TWO, expected_s=3.0).ticket
    r2 = _refused(a, "r2", TWO, expected_s=5.0).ticket
    _ended_early(a, h1)  # r1's place is free (its holder away), r2's is next
    out: dict = {}

    def back(name, ticket, expected_s):
        try:
            out[name] = b.reserve_or_wait("c0", TWO, name, 10, 30, expected_s=expected_s, ticket_id=ticket.id)
        except AdmissionRejected as e:
            out[name] = e

    # r2 back early with a long request (2 x 5 s outlasts r1's hint: it may not borrow): it waits in its place,
    # and while it is here a short newcomer may pass r1 (away) but not r2, so it does not get in either
    t = threading.Thread(target=back, args=("r2-back", r2, 5.0))
    t.start()
    time.sleep(0.1)
    assert a.stats("c0", "short", TWO).count == 1
    _refused(a, "newcomer", TWO, expected_s=0.1)
    t.join(5)
    assert isinstance(out["r2-back"], AdmissionRejected) and out["r2-back"].reason == "early"  # waited 0.4 s
    # r2 away again (fresh hint): a short newcomer now passes both absent places and is lent r1's, the first
    res = a.reserve_or_wait("c0", TWO, "newcomer-2", 10, 30, expected_s=0.1)
    assert res.lent_from == r1.id
    a.release(res)
    # and a holder back early with a short request borrows the free place of the absent holder ahead of it
    back("r2-short", r2, 0.2)
    assert out["r2-short"].lent_from == r1.id and out["r2-short"].waited is not None
    load = a.stats("c0", "short", TWO)
    assert (load.count, load.held, load.lent) == (2, 2, 1)  # h2 and r2 in flight; r1's place lent to r2
    a.release(h2)


def test_an_overrunning_borrower_makes_the_holder_wait_and_the_budget_is_never_exceeded(rclient, ns):
    waiting = ClassSpec("short", None, inflight_token_budget=1000, max_concurrent=1, queue_limit=0, max_wait_s=3.0)
    adm = Admission(rclient, ns, CFG)
    holder = adm.reserve_or_wait("c0", waiting, "holder", 10, 30, expected_s=1.5)
    away = _refused(adm, "away", waiting, expected_s=1.5).ticket
    adm.release(holder)
    borrower = adm.reserve_or_wait("c0", waiting, "borrower", 10, 30, expected_s=0.2)
    assert borrower.lent_from == away.id
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("res", adm.reserve_or_wait(
        "c0", waiting, "away-back", 10, 30, ticket_id=away.id)))
    t.start()  # back while its borrower still runs (it overran): it waits in its place
    seen = []
    for _ in range(15):
        time.sleep(0.02)
        seen.append(adm.stats("c0", "short", waiting).count)
    assert "res" not in box and max(seen) == 1  # never two in flight
    _refused(adm, "newcomer", waiting, expected_s=0.05)  # the holder is back: its claim is live, nobody passes it
    released = time.time()
    adm.release(borrower)
    t.join(5)
    res = box["res"]
    assert res.waited is not None and time.time() - released < 0.5  # in as soon as its room came back
    assert adm.stats("c0", "short", waiting).count == 1


def test_a_borrower_larger_than_its_place_never_takes_the_budget_over(rclient, ns):
    cls = ClassSpec("short", None, inflight_token_budget=100, max_concurrent=4, queue_limit=0, max_wait_s=0.0)
    adm = Admission(rclient, ns, CFG)
    holder = adm.reserve_or_wait("c0", cls, "holder", 60, 30, expected_s=3.0)
    away = _refused(adm, "away", cls, expected_s=3.0, tokens=50).ticket  # 60 + 50 > 100
    adm.release(holder)
    big = adm.reserve_or_wait("c0", cls, "big", 80, 30, expected_s=0.2)
    assert big.lent_from == away.id
    # the line counts the lent place as its 50 tokens less the borrower's 80 (everyone else's count unchanged):
    # 80 - 30 + 40 fits the line, but 80 + 40 in flight would exceed the budget: refused
    _refused(adm, "next", cls, expected_s=3.0, tokens=40)
    assert adm.stats("c0", "short", cls).tokens == 80
    adm.release(big)
