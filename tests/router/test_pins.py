"""Session pins: HRW creation, one pin under races, replicas and restarts agree, failover moves, CAS moves."""

from __future__ import annotations

import collections
import random
import threading

import pytest

from k3serve.cluster.redis_server import connect
from k3serve.router.hashing import rank_clusters
from k3serve.router.pins import NoHealthyCluster, PinEvent, PinStore

CLUSTERS = [f"c{i}" for i in range(8)]


def test_create_from_hrw_then_existing(rclient, ns):
    pins = PinStore(rclient, ns, ttl_s=100)
    p = pins.get_or_create("s:abc", CLUSTERS)
    assert (p.primary, p.secondary, p.serving, p.moves, p.event) == ("c2", "c3", "c2", 0, PinEvent.CREATED)
    again = pins.get_or_create("s:abc", list(reversed(CLUSTERS)))
    assert (again.serving, again.event) == ("c2", PinEvent.EXISTING)
    assert pins.get("s:abc").serving == "c2"
    assert rclient.hgetall(f"k3s:{ns}:pin:s:abc") == {"primary": "c2", "secondary": "c3", "serving": "c2",
                                                       "moves": "0"}  # fmt: skip
    single = pins.get_or_create("s:solo", ["c5"])
    assert (single.primary, single.secondary) == ("c5", None)
    with pytest.raises(NoHealthyCluster):
        pins.get_or_create("s:x", [])
    with pytest.raises(ValueError):
        pins.get_or_create("", CLUSTERS)


def test_ttl_is_set_and_refreshed_on_use(rclient, ns):
    pins = PinStore(rclient, ns, ttl_s=100)
    pins.get_or_create("s:1", CLUSTERS)
    assert 99 < pins.ttl_s_left("s:1") <= 100
    rclient.pexpire(pins.key("s:1"), 2000)
    pins.get_or_create("s:1", CLUSTERS)
    assert pins.ttl_s_left("s:1") > 99
    rclient.pexpire(pins.key("s:1"), 2000)
    pins.get("s:1")  # a plain read does not refresh
    assert pins.ttl_s_left("s:1") <= 2
    assert pins.delete("s:1") and pins.get("s:1") is None and pins.ttl_s_left("s:1") is None


def test_replicas_and_a_restarted_router_route_identically(new_client, ns):
    a, b = PinStore(new_client(), ns), PinStore(new_client(), ns)
    sessions = [f"s:{i}" for i in range(300)]
    rng = random.Random(0)
    got = {id(a): {}, id(b): {}}
    for s in sessions:  # interleave which replica sees a session first
        for store in (a, b) if rng.random() < 0.5 else (b, a):
            got[id(store)][s] = store.get_or_create(s, CLUSTERS).serving
    got_a, got_b = got[id(a)], got[id(b)]
    assert got_a == got_b
    assert all(got_a[s] == rank_clusters(s, CLUSTERS)[0] for s in sessions)

    # A new cluster joins and a router restarts (fresh client, fresh store): pins do not move to the newcomer.
    restarted = PinStore(new_client(), ns)
    grown = CLUSTERS + ["c8"]
    for s in sessions:
        p = restarted.get_or_create(s, grown)
        assert p.serving == got_a[s] and p.event is PinEvent.EXISTING


def test_racing_routers_end_with_one_pin(new_client, ns):
    sessions = [f"s:race{i}" for i in range(100)]
    n_threads = 8
    results: dict[str, list] = collections.defaultdict(list)
    lock = threading.Lock()
    barrier = threading.Barrier(n_threads)

    def router(seed: int) -> None:
        store = PinStore(new_client(), ns)
        rng = random.Random(seed)
        view = CLUSTERS[:]
        order = sessions[:]
        rng.shuffle(order)
        barrier.wait()
        for s in order:
            rng.shuffle(view)  # same membership, different order: must not matter
            p = store.get_or_create(s, view)
            with lock:
                results[s].append(p)

    threads = [threading.Thread(target=router, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in sessions:
        ps = results[s]
        assert len(ps) == n_threads
        assert len({(p.primary, p.secondary, p.serving) for p in ps}) == 1
        assert sum(p.event is PinEvent.CREATED for p in ps) == 1


def test_failover_moves_to_secondary_and_stays(new_client, ns):
    a, b = PinStore(new_client(), ns), PinStore(new_client(), ns)
    p = a.get_or_create("s:abc", CLUSTERS)  # c2, secondary c3
    without_c2 = [c for c in CLUSTERS if c != "c2"]
    moved = a.get_or_create("s:abc", without_c2)
    assert (moved.serving, moved.moves, moved.event) == ("c3", 1, PinEvent.MOVED)
    assert (moved.primary, moved.secondary) == (p.primary, p.secondary)
    seen_by_b = b.get_or_create("s:abc", without_c2)
    assert (seen_by_b.serving, seen_by_b.event) == ("c3", PinEvent.EXISTING)
    # The primary comes back: the session stays where its cache now is.
    back = b.get_or_create("s:abc", CLUSTERS)
    assert (back.serving, back.event) == ("c3", PinEvent.EXISTING)


def test_failover_when_secondary_is_down_too_uses_next_hrw_choice(rclient, ns):
    pins = PinStore(rclient, ns)
    pins.get_or_create("s:abc", CLUSTERS)  # HRW: c2, c3, c7, ...
    healthy = [c for c in CLUSTERS if c not in ("c2", "c3")]
    p = pins.get_or_create("s:abc", healthy)
    assert p.serving == rank_clusters("s:abc", healthy)[0] == "c7"
    # Serving on the secondary, and the secondary dies while the primary is back: the primary takes it.
    pins.move("s:abc", "c3")
    p = pins.get_or_create("s:abc", [c for c in CLUSTERS if c != "c3"])
    assert p.serving == "c2" and p.event is PinEvent.MOVED


def test_move_is_compare_and_set(rclient, ns):
    pins = PinStore(rclient, ns)
    assert pins.move("s:none", "c1") is None
    pins.get_or_create("s:abc", CLUSTERS)
    p = pins.move("s:abc", "c5", expected_serving="c2")
    assert (p.serving, p.moves, p.event) == ("c5", 1, PinEvent.MOVED)
    # A second router that also saw c2 fail lost the race: it is told where the session went.
    late = pins.move("s:abc", "c6", expected_serving="c2")
    assert (late.serving, late.moves, late.event) == ("c5", 1, PinEvent.CONFLICT)
    same = pins.move("s:abc", "c5")
    assert (same.serving, same.moves) == ("c5", 1)  # no-op move is not counted
    forced = pins.move("s:abc", "c6")
    assert (forced.serving, forced.moves) == ("c6", 2)
    with pytest.raises(ValueError):
        pins.move("s:abc", "bad:id")


def test_resolve_falls_back_to_hrw_when_redis_is_down(tmp_path, ns):
    client = connect(f"unix://{tmp_path}/nothing.sock", timeout_s=0.2, retries=0)
    pins = PinStore(client, ns)
    p = pins.resolve("s:abc", CLUSTERS)
    assert (p.primary, p.secondary, p.serving, p.event) == ("c2", "c3", "c2", PinEvent.FALLBACK)


def test_resolve_uses_redis_when_up(rclient, ns):
    pins = PinStore(rclient, ns)
    assert pins.resolve("s:abc", CLUSTERS).event is PinEvent.CREATED
    assert pins.resolve("s:abc", CLUSTERS).event is PinEvent.EXISTING
