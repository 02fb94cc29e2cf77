"""A request is never refused while its class has free room on a cluster that can serve it (issue 49): a burst of
clients that are refused and never come back leaves nothing behind that turns the next requests away."""

from __future__ import annotations

import threading

import grpc

from k3serve.router.admission import ClassSpec
from k3serve.v1 import router_pb2 as pb
from tests.router.fake_cluster import Behaviour, generate

# the small service: 2 short requests per cluster, 4 waiting
SMALL = [ClassSpec("short", 4096, inflight_token_budget=100_000, max_concurrent=2, queue_limit=4, max_wait_s=2.0),
         ClassSpec("long", None, inflight_token_budget=1 << 30, max_concurrent=1, queue_limit=0, max_wait_s=0.0)]


def burst_of_absent_clients(stubs, n: int, max_tokens: int) -> tuple[int, int]:
    """``n`` streams at once over ``stubs``; a refused client never comes back. (served, refused with a hint)."""
    served, refused, other, lock = [0], [0], [], threading.Lock()

    def one(i: int) -> None:
        try:
            generate(stubs[i % len(stubs)], timeout=60, session_id=f"burst-{i}", prompt_token_ids=[i % 200 + 1],
                     sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            with lock:
                served[0] += 1
        except grpc.RpcError as e:
            with lock:
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and float(
                        dict(e.trailing_metadata())["retry-after-s"]) > 0:
                    refused[0] += 1
                else:
                    other.append((e.code(), e.details()))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not other, other[:3]
    return served[0], refused[0]


def test_after_a_burst_of_clients_that_never_return_new_requests_are_admitted(rig):
    for c in ("c0", "c1", "c2"):
        rig.add_cluster(c, Behaviour(delay_s=0.03))
    stubs = [rig.add_router(SMALL, max_streams=8)[1] for _ in range(2)]
    served, refused = burst_of_absent_clients(stubs, 120, max_tokens=10)
    assert served + refused == 120 and refused > 60 and served >= 6, (served, refused)
    gate = rig.routers[0][0].gate
    assert gate.class_stats(sorted(rig.clusters))["short"]["inflight_requests"] == 0  # nothing runs now
    # one at a time: each finds the service idle
    for i in range(6):
        _, last = generate(stubs[i % 2], session_id=f"after-{i}", prompt_token_ids=[7, i + 1])
        assert last.finish_reason == "length"
    # six together: 6 rooms (more on one cluster wait in its queue, within max_wait_s), none refused
    calls = [lambda i=i: generate(stubs[i % 2], session_id=f"together-{i}", prompt_token_ids=[9, i + 1])
             for i in range(6)]
    assert not errors_of_concurrent(calls)


def errors_of_concurrent(calls) -> list:
    """Every call of ``calls`` started at once: the (code, details) of those that raised a gRPC error."""
    errors: list = []

    def one(call) -> None:
        try:
            call()
        except grpc.RpcError as e:
            errors.append((e.code(), e.details()))

    threads = [threading.Thread(target=one, args=(c,)) for c in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return errors
