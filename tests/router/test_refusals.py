"""Refusals hold nothing (issue 49): a refused request leaves no claim on its budget, so the room it was refused
goes to whoever is present when it frees, and the budget invariant never depends on who was refused."""

from __future__ import annotations

import threading
import time

import pytest

from k3serve.router.admission import Admission, AdmissionRejected, ClassLoad, ClassSpec
from k3serve.router.gate import AdmissionGate

ONE = ClassSpec("short", None, inflight_token_budget=1000, max_concurrent=1, queue_limit=0, max_wait_s=0.0)


def test_the_room_a_refused_request_was_denied_goes_to_the_next_one_present(rclient, ns):
    adm = Admission(rclient, ns)
    holder = adm.reserve_or_wait("c0", ONE, "holder", 10, 30, expected_s=1.0)
    for i in range(20):  # refused, and never coming back
        with pytest.raises(AdmissionRejected) as e:
            adm.reserve_or_wait("c0", ONE, f"gone{i}", 10, 30, expected_s=1.0)
        assert e.value.reason == "over_budget" and e.value.retry_after_s > 0
    adm.release(holder)
    assert adm.stats([("c0", "short")]) == [ClassLoad(0, 0, 0)]  # nothing left of them
    assert adm.reserve_or_wait("c0", ONE, "newcomer", 10, 30) is not None  # at once: ONE never waits


def test_a_waiter_that_times_out_leaves_the_line_and_those_behind_move_up(rclient, ns):
    cls = ClassSpec("short", None, inflight_token_budget=1000, max_concurrent=1, queue_limit=4, max_wait_s=5.0)
    adm = Admission(rclient, ns)
    holder = adm.reserve_or_wait("c0", cls, "holder", 10, 30)
    box: dict = {}

    def wait(name: str, wait_s: float) -> None:
        try:
            box[name] = adm.reserve_or_wait("c0", cls, name, 10, 30, max_wait_s=wait_s)
        except AdmissionRejected as e:
            box[name] = e

    first = threading.Thread(target=wait, args=("impatient", 0.3))
    first.start()
    time.sleep(0.1)
    second = threading.Thread(target=wait, args=("patient", 5.0))
    second.start()
    first.join(3)
    assert isinstance(box["impatient"], AdmissionRejected) and box["impatient"].reason == "timeout"
    assert adm.stats([("c0", "short")])[0].queued == 1  # only the one still waiting
    adm.release(holder)
    second.join(3)
    assert box["patient"].cls == "short"  # admitted: the timed-out waiter held no place ahead of it
    adm.release(box["patient"])


def test_the_budget_holds_through_a_flush_with_refused_requests_around(rclient, ns):
    """The budget invariant counts in-flight leases only: a flush loses the refusals' traces (there are none) and
    re-asserted leases still keep newcomers out until they end."""
    gate = AdmissionGate(rclient, ns, [ONE], lease_ttl_s=1.0, renew_interval_s=0.1)
    probe = Admission(rclient, ns)
    try:
        running = gate.admit("c0", "run", 10, remaining_s=lambda: 5.0)
        with pytest.raises(AdmissionRejected):
            gate.admit("c0", "r", 10)
        rclient.flushall()
        time.sleep(0.5)  # the renewer puts the running lease back
        with pytest.raises(AdmissionRejected):
            gate.admit("c0", "r", 10)
        assert probe.stats([("c0", "short")])[0].count == 1
        gate.release(running)
        assert gate.admit("c0", "r2", 10) is not None
    finally:
        gate.close()


def test_a_refusing_routers_own_hint_is_a_floor_not_scaled_again(rclient, ns):
    """A router at its stream limit passes slots.retry_after_s (already scaled late) as at_least_s: the refusal's
    hint is that floor (plus jitter) when the class budget would drain sooner, not the floor scaled once more."""
    from k3serve.router.retry_hint import HINT_JITTER

    rej = Admission(rclient, ns).rejected("c0", ONE, 10, "refused", "router full", expected_s=0.1, at_least_s=10.0)
    assert 10.0 <= rej.retry_after_s <= 10.0 * (1 + HINT_JITTER) + 1e-3
