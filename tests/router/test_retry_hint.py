"""The retry-after rule (router/retry_hint.py) as a pure function: holders, waiters ahead, overdue holders."""

import pytest

from k3serve.router.retry_hint import drain_wait_s

NOW = 1_000_000


def _paired_holds(adm, cls, hold_s: float, expected_s: float) -> None:
    """Three rounds of c0's two rooms taken together and released after ``hold_s``: the budget's completed holds."""
    import time

    for i in range(3):
        a, b = (adm.reserve_or_wait("c0", cls, f"h{i}{j}", 10, 30, expected_s=expected_s) for j in "ab")
        time.sleep(hold_s)
        adm.release(a)
        adm.release(b)


def test_room_when_the_first_holder_ends():
    # 2 holders of a max_concurrent 2 class, nobody queued: this request fits when the earlier one ends
    assert drain_wait_s(NOW, [(10, NOW + 800), (10, NOW + 300)], 0, 0, 10, 1000, 2) == 0.3


def test_waiters_ahead_take_the_first_round():
    # holders end at +0.5 s; 2 waiters ahead fill both places; this request starts one round (1 s) later
    assert drain_wait_s(NOW, [(10, NOW + 500), (10, NOW + 500)], 2, 20, 10, 1000, 2, round_s=1.0) == 1.5


def test_an_overdue_holder_ends_half_a_round_from_now_not_now():
    on_time = drain_wait_s(NOW, [(10, NOW + 1)], 0, 0, 10, 1000, 1, round_s=1.0)
    overdue = drain_wait_s(NOW, [(10, NOW - 150)], 0, 0, 10, 1000, 1, round_s=1.0)
    assert on_time == 0.001 and overdue == 0.5
    # without a round estimate: half the mean remaining time of the holders that are not overdue
    assert drain_wait_s(NOW, [(10, NOW - 50), (10, NOW + 400)], 0, 0, 10, 1000, 1) == 0.4
    mixed = drain_wait_s(NOW, [(10, NOW - 50), (10, NOW + 400)], 0, 0, 10, 1000, 2)
    assert mixed == 0.2  # the overdue one, taken to end at +0.2 s, frees the first place


def test_unseen_waiters_count_like_queued_ones(rclient, ns):
    from k3serve.router.admission import Admission, ClassSpec

    cls = ClassSpec("short", None, inflight_token_budget=1000, max_concurrent=2, queue_limit=4, max_wait_s=5.0)
    adm = Admission(rclient, ns)
    empty = adm.retry_after("c0", cls, 10, round_s=1.0)
    behind_two = adm.retry_after("c0", cls, 10, round_s=1.0, unseen=(2, 20))
    assert empty == 0.0 and behind_two == 1.0  # two requests Redis does not show yet take the first round


def test_behind_a_line_the_measured_turnover_paces_the_places():
    # 2 holders, 3 ahead, max_concurrent 2: this place is free after 2 + 3 + 1 - 2 = 4 more places have come free
    holders = [(10, NOW + 500), (10, NOW + 500)]
    assert drain_wait_s(NOW, holders, 3, 30, 10, 1000, 2, round_s=1.0, turnover_s=0.6) == 4 * 0.6
    # counted from the last admission: 0.2 s of the next turnover are gone; an overdue one is gone at most once
    assert round(drain_wait_s(NOW, holders, 3, 30, 10, 1000, 2, 1.0, 0.6, since_turn_s=0.2), 6) == 2.2
    assert round(drain_wait_s(NOW, holders, 3, 30, 10, 1000, 2, 1.0, 0.6, since_turn_s=5.0), 6) == 1.8
    # no line ahead: the holders' own ends; bound by tokens: the rounds (the turnover counts places, not tokens)
    assert drain_wait_s(NOW, holders, 0, 0, 10, 1000, 2, round_s=1.0, turnover_s=0.6) == 0.5
    assert drain_wait_s(NOW, holders, 3, 990, 10, 1000, 2, round_s=1.0, turnover_s=0.6) == 0.5 + 1.0


def test_the_turnover_is_measured_from_admissions_while_the_line_is_not_empty(rclient, ns):
    import time

    from k3serve.router.admission import Admission, AdmissionRejected, ClassSpec

    cls = ClassSpec("short", None, inflight_token_budget=1000, max_concurrent=1, queue_limit=0, max_wait_s=0.0)
    adm = Admission(rclient, ns)
    held = adm.reserve_or_wait("c0", cls, "h", 10, 30, expected_s=0.1)
    tickets = []
    for i in range(3):
        try:
            adm.reserve_or_wait("c0", cls, f"r{i}", 10, 30, expected_s=0.1)
        except AdmissionRejected as e:
            tickets.append(e.ticket)
    for t in tickets:  # each place is taken 0.2 s after the one before it
        time.sleep(0.2)
        adm.release(held)
        held = adm.reserve_or_wait("c0", cls, f"{t.id}-back", 10, 30, ticket_id=t.id)
    turnover = int(rclient.hget(adm.keys("c0", "short")["turn"], "ewma"))
    assert 170 <= turnover <= 300


def test_behind_a_line_places_are_paced_by_the_budgets_mean_holding_time(rclient, ns):
    """The pace is what the rooms take (admission to release, over max_concurrent), not how fast holders came back:
    hints of a line whose holders came back slowly still name the service's pace (tickets.py, "Pace")."""
    import dataclasses
    import time

    from k3serve.router.admission import Admission, AdmissionRejected, ClassSpec

    cls = ClassSpec("short", None, inflight_token_budget=1000, max_concurrent=2, queue_limit=0, max_wait_s=0.0)
    adm = Admission(rclient, ns)
    _paired_holds(adm, cls, 0.2, expected_s=5.0)  # three holds of both rooms, 0.2 s each
    assert 190 <= int(rclient.hget(adm.keys("c0", "short")["turn"], "hold")) <= 320
    res = adm.reserve_or_wait("c0", cls, "renewed", 10, 30, expected_s=5.0)
    time.sleep(0.05)
    adm.release(dataclasses.replace(res, admitted_ms=0))  # a copy without its admission moment teaches nothing
    assert 190 <= int(rclient.hget(adm.keys("c0", "short")["turn"], "hold")) <= 320
    held = [adm.reserve_or_wait("c0", cls, f"x{j}", 10, 30, expected_s=5.0) for j in range(2)]
    hints = []
    for i in range(3):
        try:
            adm.reserve_or_wait("c0", cls, f"r{i}", 10, 30, expected_s=5.0)
        except AdmissionRejected as e:
            hints.append(e.retry_after_s)
    # the first place, with no line ahead, when the holders are expected to end (their published ends: 5 s); the
    # places behind it 0.2 / 2 s apart (the measured pace), not a 5 s round each as the published ends would say
    assert len(hints) == 3 and 4.5 <= hints[0] <= 5.0, hints
    assert hints[1] < 0.5 and 0.07 <= hints[2] - hints[1] <= 0.16, hints
    for r in held:
        adm.release(r)


def test_holds_in_progress_past_the_typical_hold_lengthen_the_pace_and_the_ends(rclient, ns):
    """The holds in progress are right-censored holding times (admission_lua.HOLDERS): holders that have held their
    rooms longer than every recent completed hold show that the service slowed (a burst's first requests) before any
    of them ends: the hints behind them grow with their age, and so does the first place's (their published ends,
    long past, no longer say 'now')."""
    import time

    from k3serve.router.admission import Admission, AdmissionRejected, ClassSpec

    cls = ClassSpec("short", None, inflight_token_budget=1000, max_concurrent=2, queue_limit=0, max_wait_s=0.0)
    adm = Admission(rclient, ns)
    _paired_holds(adm, cls, 0.2, expected_s=0.3)  # three holds of both rooms, 0.2 s each: the completed holds' mean
    assert 190 <= int(rclient.hget(adm.keys("c0", "short")["turn"], "hold")) <= 320
    held = [adm.reserve_or_wait("c0", cls, f"x{j}", 10, 30, expected_s=0.3) for j in range(2)]
    tickets = []
    for i in range(2):
        with pytest.raises(AdmissionRejected) as e:
            adm.reserve_or_wait("c0", cls, f"r{i}", 10, 30, expected_s=0.3)
        tickets.append(e.value.ticket.id)
    young = [adm.retry_after("c0", cls, 10, ticket_id=t) for t in tickets]
    time.sleep(0.8)
    old = [adm.retry_after("c0", cls, 10, ticket_id=t) for t in tickets]
    # young holders (age < the mean hold): the first place at their published ends (0.3 s), the next at the pace
    assert max(young) <= 0.4, young
    # 0.8 s in, four times every completed hold: each holder is taken to hold 2 x 0.8 s, so both rooms come free
    # ~0.8 s from now (it was 0 for the first place, overdue published ends, and one 0.1 s pace for the second)
    assert all(0.6 <= h <= 1.4 for h in old), old
    for r in held:
        adm.release(r)
    # a hold that ended is forgotten as a hold in progress
    assert rclient.hlen(adm.keys("c0", "short")["since"]) == 0


def test_behind_a_line_the_censored_ends_of_slow_holders_bound_the_wait():
    # 2 holders of a max_concurrent 2 class, one held place ahead, pace 0.1 s, last admission just now: 2 places
    # to come free, 0.2 s by the pace alone
    holders = [(10, NOW + 100), (10, NOW + 100)]
    assert abs(drain_wait_s(NOW, holders, 1, 10, 10, 1000, 2, turnover_s=0.1) - 0.2) < 1e-9
    # one holder has outlasted every recent hold and is taken to end 1.5 s from now: the first room is the other
    # one's (typical: admission + the pace, 0.1 s from now), the second is the slow one's
    slow = [(10, NOW + 100), (10, NOW + 1500)]
    ends = [NOW + 100, NOW + 1500]
    assert abs(drain_wait_s(NOW, slow, 1, 10, 10, 1000, 2, turnover_s=0.1, held_ends_ms=ends) - 1.5) < 1e-9
    # a place further back: the slow holder's room, then one pace for each place beyond the holders
    assert abs(drain_wait_s(NOW, slow, 3, 30, 10, 1000, 2, turnover_s=0.1, held_ends_ms=ends) - 1.7) < 1e-9
    # a holder whose end is unknown (-1: a lease put back after a state loss) bounds nothing
    assert abs(drain_wait_s(NOW, slow, 1, 10, 10, 1000, 2, turnover_s=0.1, held_ends_ms=[-1, NOW + 1500]) - 1.5) < 1e-9
    # with no line ahead, the holders' ends: the first room to come free is the typical holder's
    assert abs(drain_wait_s(NOW, slow, 0, 0, 10, 1000, 2, turnover_s=0.1) - 0.1) < 1e-9


def test_a_first_place_is_hinted_no_sooner_than_the_holders_typical_holds(rclient, ns):
    """Two holders admitted together whose published ends are near (their streams' learned durations) but whose
    budget's holds take 0.6 s: the first place behind them is hinted at admission + the mean hold (HOLDERS' bound),
    not at the published ends (measured at a burst's onset: a hint of 0.2 s for a wait of 0.9 s)."""
    from k3serve.router.admission import Admission, AdmissionRejected, ClassSpec

    cls = ClassSpec("short", None, inflight_token_budget=1000, max_concurrent=2, queue_limit=0, max_wait_s=0.0)
    adm = Admission(rclient, ns)
    _paired_holds(adm, cls, 0.6, expected_s=0.1)  # three holds of both rooms, 0.6 s each
    held = [adm.reserve_or_wait("c0", cls, f"x{j}", 10, 30, expected_s=0.1) for j in range(2)]
    with pytest.raises(AdmissionRejected) as e:
        adm.reserve_or_wait("c0", cls, "r", 10, 30, expected_s=0.1)
    assert 0.45 <= e.value.retry_after_s <= 0.8, e.value.retry_after_s  # published ends alone: <= 0.1 s
    for r in held:
        adm.release(r)


def _hints_of_a_new_line(adm, cls, n: int) -> list[float]:
    """One holder in c0's only room (published end 5 s), then the hints of ``n`` refused requests: the first place's
    is the holder's end, the ones behind it a pace apart."""
    from k3serve.router.admission import AdmissionRejected

    held = adm.reserve_or_wait("c0", cls, "x", 10, 30, expected_s=5.0)
    hints = []
    for i in range(n):
        with pytest.raises(AdmissionRejected) as e:
            adm.reserve_or_wait("c0", cls, f"r{i}", 10, 30, expected_s=5.0)
        hints.append(e.value.retry_after_s)
    adm.release(held)
    return hints


def test_the_pace_of_places_is_the_saturated_services_mean_hold(rclient, ns):
    """A hold released while others wait in line teaches the pace of places (turn.shold); one released to nobody
    (the service at low load, a burst's fast tail) teaches only the typical hold (turn.hold): the next line's
    hints keep the loaded service's pace (admission_lua.RELEASE, docs/architecture.md §13)."""
    import time

    from k3serve.router.admission import Admission, AdmissionRejected, ClassSpec

    cls = ClassSpec("short", None, inflight_token_budget=1000, max_concurrent=1, queue_limit=0, max_wait_s=0.0)
    adm = Admission(rclient, ns)
    turn = adm.keys("c0", "short")["turn"]
    # saturated: each hold is released while a place is held in line behind it (0.4 s holds)
    held = adm.reserve_or_wait("c0", cls, "s0", 10, 30, expected_s=5.0)
    for i in range(3):
        with pytest.raises(AdmissionRejected) as e:
            adm.reserve_or_wait("c0", cls, f"w{i}", 10, 30, expected_s=5.0)
        time.sleep(0.4)
        adm.release(held)
        held = adm.reserve_or_wait("c0", cls, f"w{i}-back", 10, 30, ticket_id=e.value.ticket.id, expected_s=5.0)
    time.sleep(0.05)
    adm.release(held)  # nobody waits: a hold of the unloaded service
    saturated = int(rclient.hget(turn, "shold"))
    assert 380 <= saturated <= 600, saturated
    # four fast holds released to an empty line: the typical hold falls, the pace of places does not
    for i in range(4):
        r = adm.reserve_or_wait("c0", cls, f"f{i}", 10, 30, expected_s=5.0)
        time.sleep(0.02)
        adm.release(r)
    assert int(rclient.hget(turn, "hold")) < 250 and int(rclient.hget(turn, "shold")) == saturated
    # the next line is paced by the saturated holds: places behind the first 0.4 s apart (one room), not ~0.1 s
    hints = _hints_of_a_new_line(adm, cls, 3)
    assert 0.3 <= hints[2] - hints[1] <= 0.7, hints


def test_a_never_saturated_budget_is_paced_by_every_hold(rclient, ns):
    """Before any hold was released to a line, the pace of places is the mean of every hold (turn.hold)."""
    import time

    from k3serve.router.admission import Admission, ClassSpec

    cls = ClassSpec("short", None, inflight_token_budget=1000, max_concurrent=1, queue_limit=0, max_wait_s=0.0)
    adm = Admission(rclient, ns)
    for i in range(3):
        r = adm.reserve_or_wait("c0", cls, f"h{i}", 10, 30, expected_s=5.0)
        time.sleep(0.3)
        adm.release(r)
    assert rclient.hget(adm.keys("c0", "short")["turn"], "shold") is None
    hints = _hints_of_a_new_line(adm, cls, 3)
    assert 0.2 <= hints[2] - hints[1] <= 0.5, hints
