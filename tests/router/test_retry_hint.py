"""The retry-after rule (router/retry_hint.py) as a pure function: holders, waiters ahead, overdue holders."""

from k3serve.router.retry_hint import drain_wait_s

NOW = 1_000_000


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
