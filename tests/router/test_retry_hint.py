"""The retry-after rule (router/retry_hint.py) as a pure function: holders, waiters ahead, overdue holders."""

import pytest

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


def test_a_refusal_is_hinted_at_the_expected_drain_time(rclient, ns):
    """RESOURCE_EXHAUSTED's hint is when the budget is expected to have room: the holders' published ends behind
    the waiters ahead, scaled late by HINT_LATENESS with +0-HINT_JITTER spread."""
    from k3serve.router.admission import Admission, AdmissionRejected, ClassSpec
    from k3serve.router.retry_hint import HINT_JITTER, HINT_LATENESS

    cls = ClassSpec("short", None, inflight_token_budget=1000, max_concurrent=2, queue_limit=0, max_wait_s=0.0)
    adm = Admission(rclient, ns)
    held = [adm.reserve_or_wait("c0", cls, f"x{j}", 10, 30, expected_s=s) for j, s in enumerate((2.0, 4.0))]
    with pytest.raises(AdmissionRejected) as e:
        adm.reserve_or_wait("c0", cls, "r", 10, 30, expected_s=1.0)
    assert e.value.reason == "over_budget"
    assert 2.0 * HINT_LATENESS * 0.95 <= e.value.retry_after_s <= 2.0 * HINT_LATENESS * (1 + HINT_JITTER)
    # two more requests that Redis does not show yet take both rooms once the holders end (4 s): one round later
    late = adm.retry_after("c0", cls, 10, round_s=1.0, unseen=(2, 20))
    assert 4.9 <= late <= 5.0, late
    for r in held:
        adm.release(r)
