"""A mid-stream failover follows the session's pin (issue 49): to the pin's stored secondary first, not the current
rendezvous order, and to wherever another router already moved the pin."""

from __future__ import annotations

import threading
import time

from k3serve.cluster.redis_server import connect
from k3serve.router.hashing import rank_clusters
from k3serve.router.pins import PinStore
from k3serve.v1 import router_pb2 as pb
from tests.router.fake_cluster import Behaviour, expected_tokens, generate

SP = pb.SamplingParams(max_tokens=12, ignore_eos=True)


def _pinned(rig, delay_s: float):
    """Three clusters, a router, a session served once (its pin made): (stub, pin store, pin key, the clusters
    in the key's current HRW order)."""
    for c in ("c0", "c1", "c2"):
        rig.add_cluster(c, Behaviour(delay_s=delay_s))
    _, stub = rig.add_router()
    generate(stub, session_id="sess", prompt_token_ids=[1, 2, 3], sampling=SP)
    [key] = connect(rig.url).keys(f"k3s:{rig.ns}:pin:*")
    key = key.split(":pin:", 1)[1]
    return stub, PinStore(connect(rig.url), rig.ns), key, rank_clusters(key, sorted(rig.clusters))


def test_a_failover_goes_to_the_pins_stored_secondary(rig):
    stub, pins, key, (primary, second, third) = _pinned(rig, 0.01)
    # the pin was made when the membership ranked differently: its secondary is the third of today's order
    connect(rig.url).hset(pins.key(key), "secondary", third)
    rig.clusters[primary].behaviour.fail_after = 4
    tokens, last = generate(stub, session_id="sess", prompt_token_ids=[1, 2, 3], sampling=SP)
    assert tokens == expected_tokens(12) and last.usage.failovers == 1
    assert last.usage.cluster_id == third and pins.get(key).serving == third


def test_a_failover_follows_the_router_that_moved_the_pin_first(rig):
    stub, pins, key, (primary, second, third) = _pinned(rig, 0.1)
    rig.clusters[primary].behaviour.fail_after = 8
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(r=generate(stub, session_id="sess", prompt_token_ids=[1, 2, 3],
                                                              sampling=SP)))
    t.start()
    time.sleep(0.35)  # streaming on the primary, before it fails
    assert pins.move(key, third, expected_serving=primary).serving == third  # another router failed it over
    t.join(30)
    tokens, last = out["r"]
    assert tokens == expected_tokens(12) and last.usage.failovers == 1
    assert last.usage.cluster_id == third and pins.get(key).serving == third
