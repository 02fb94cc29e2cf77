"""The host-saturated pace (router/hosts.py, admission_lua.RELEASE / HOLDERS): clusters that share a host slow each
other, so the pace of a line while every budget of its class on the host is saturated is learned from the holds
released while they all were, and a cluster busy alone is paced by its own saturated holds."""

import time

import pytest

from k3serve.router.admission import Admission, AdmissionRejected, ClassSpec
from k3serve.router.hosts import co_located_clusters
from k3serve.router.membership import ClusterInfo, MembershipSnapshot

CLS = ClassSpec("short", None, inflight_token_budget=1000, max_concurrent=1, queue_limit=0, max_wait_s=0.0)


def _snapshot(*clusters: ClusterInfo) -> MembershipSnapshot:
    return MembershipSnapshot(clusters=clusters, stale=False, fetched_at=0.0, server_time=0.0)


def test_clusters_are_co_located_by_the_hosts_of_their_endpoints():
    snap = _snapshot(ClusterInfo("c0", {"cluster": "10.0.0.1:5000"}, {}, 0.0),
                     ClusterInfo("c1", {"cluster": "10.0.0.1:5001"}, {}, 0.0),
                     ClusterInfo("c2", {"cluster": "10.0.0.2:5000"}, {}, 0.0),
                     ClusterInfo("c3", {"cluster": "10.0.0.1:5002"}, {}, 0.0, alive=False),
                     ClusterInfo("c4", {"cluster": "[::1]:5000"}, {}, 0.0),
                     ClusterInfo("c5", {"cluster": "[::1]:5001"}, {}, 0.0))
    assert co_located_clusters(snap, "c0") == ("c1",)  # c3 is dead, c2 elsewhere
    assert co_located_clusters(snap, "c2") == ()
    assert co_located_clusters(snap, "c4") == ("c5",)
    assert co_located_clusters(snap, "gone") == ()


def _saturated_holds(adm: Admission, tag: str, n: int, hold_s: float) -> None:
    """``n`` holds of c0's only room, each released while a place is held in line behind it."""
    held = adm.reserve_or_wait("c0", CLS, f"{tag}-s", 10, 30, expected_s=5.0)
    for i in range(n):
        with pytest.raises(AdmissionRejected) as e:
            adm.reserve_or_wait("c0", CLS, f"{tag}-w{i}", 10, 30, expected_s=5.0)
        time.sleep(hold_s)
        adm.release(held, CLS.max_concurrent)
        held = adm.reserve_or_wait("c0", CLS, f"{tag}-w{i}-back", 10, 30, ticket_id=e.value.ticket.id,
                                   expected_s=5.0)
    adm.release(held, CLS.max_concurrent)


def _pace_of_a_new_line(adm: Admission, tag: str) -> float:
    """The spacing of two places behind a new line on c0 (its pace: one room), the line given up after."""
    held = adm.reserve_or_wait("c0", CLS, f"{tag}-x", 10, 30, expected_s=5.0)
    refusals = []
    for i in range(3):
        with pytest.raises(AdmissionRejected) as e:
            adm.reserve_or_wait("c0", CLS, f"{tag}-r{i}", 10, 30, expected_s=5.0)
        refusals.append(e.value)
    adm.release(held, 0)  # (no hold learned: it is not a hold of the service under test)
    for r in refusals:
        adm.drop_ticket(r.ticket)
    return refusals[2].retry_after_s - refusals[1].retry_after_s


def test_a_line_on_a_saturated_host_is_paced_by_the_holds_of_the_saturated_host(rclient, ns):
    adm = Admission(rclient, ns, co_located=lambda c: {"c0": ("c1",), "c1": ("c0",)}[c])
    # the host saturated: c1's only room is taken (its class's cap) while c0 holds for 0.4 s behind a line
    busy = adm.reserve_or_wait("c1", CLS, "c1-busy", 10, 30, expected_s=5.0)
    _saturated_holds(adm, "a", 3, 0.4)
    turn = adm.keys("c0", "short")["turn"]
    host_pace = int(rclient.hget(turn, "hshold"))
    assert 380 <= host_pace <= 600, host_pace
    # c0 busy alone (c1 idle): fast holds behind a line teach its own saturated pace, not the host's
    adm.release(busy, 0)
    _saturated_holds(adm, "b", 6, 0.05)
    assert int(rclient.hget(turn, "hshold")) == host_pace
    assert int(rclient.hget(turn, "shold")) < 250
    alone = _pace_of_a_new_line(adm, "alone")
    assert alone < 0.27, alone
    # c1 has a line again (a held place; its room is free): the host is saturated, c0's new line goes at its pace
    place = adm.refuse("c1", CLS, "c1-x", 10, "this router is full").ticket
    assert place is not None
    saturated = _pace_of_a_new_line(adm, "saturated")
    assert 0.3 <= saturated <= 0.65, (saturated, alone)
    adm.drop_ticket(place)
    assert _pace_of_a_new_line(adm, "alone-again") < 0.27


def test_a_cluster_alone_on_its_host_learns_one_saturated_pace(rclient, ns):
    """Without co-located clusters the host is its cluster: turn.hshold is turn.shold."""
    adm = Admission(rclient, ns)
    _saturated_holds(adm, "a", 3, 0.1)
    turn = adm.keys("c0", "short")["turn"]
    assert rclient.hget(turn, "hshold") == rclient.hget(turn, "shold")


def test_a_hold_weighs_in_the_host_pace_by_the_share_of_the_hosts_rooms_in_use(rclient, ns):
    """A neighbour's line makes the host saturated even while its holders are away and its rooms idle; a hold
    released then (one of the host's two rooms in use) moves turn.hshold half as far as one released with both
    in use (the warm-up's tail, run with most rooms idle, had left the next burst's pace 2-3x fast)."""
    adm = Admission(rclient, ns, co_located=lambda c: {"c0": ("c1",), "c1": ("c0",)}[c])
    busy = adm.reserve_or_wait("c1", CLS, "c1-busy", 10, 30, expected_s=5.0)
    _saturated_holds(adm, "a", 3, 0.4)  # both rooms in use at each release: weight 0.2
    turn = adm.keys("c0", "short")["turn"]
    full = int(rclient.hget(turn, "hshold"))
    assert 380 <= full <= 600, full
    adm.release(busy, 0)
    place = adm.refuse("c1", CLS, "c1-x", 10, "this router is full").ticket  # c1: a line, its room idle
    assert place is not None
    _saturated_holds(adm, "b", 3, 0.05)
    # weight 0.1 each: full x 0.9^3 + 50 x (1 - 0.9^3) (at weight 0.2: full x 0.8^3 + ..., ~0.5 x full + 25)
    half = int(rclient.hget(turn, "hshold"))
    assert half >= 0.7 * full, (half, full)
    assert int(rclient.hget(turn, "shold")) < 0.6 * full  # the budget's own pace takes every hold as before
    adm.drop_ticket(place)
