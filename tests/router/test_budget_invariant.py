"""Reservations are held or known lost (issue 19 #1): the budget holds across two router replicas while Redis is
flushed, restarted (empty) and frozen past every lease, mid-stream."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from k3serve.cluster.redis_server import RedisServer, connect
from k3serve.router.admission import Admission, ClassSpec
from k3serve.router.gate import AdmissionGate

CLASSES = [ClassSpec("short", None, inflight_token_budget=10_000, max_concurrent=2, queue_limit=8, max_wait_s=6.0)]


@pytest.fixture
def own_redis(tmp_path):
    server = RedisServer(unix_socket=True)
    server.start(tmp_path)
    yield server
    server.stop()


def _flush(server):
    connect(server.url).flushall()


def _restart(server):
    server.restart()


def _freeze(server):
    os.kill(server.pid, signal.SIGSTOP)  # a stalled Redis: every lease and the guard's key run out meanwhile
    try:
        time.sleep(1.6)
    finally:
        os.kill(server.pid, signal.SIGCONT)


@pytest.mark.parametrize("fault", [_flush, _restart, _freeze], ids=["flushed", "restarted", "frozen"])
def test_budget_holds_when_redis_loses_the_leases_mid_stream(own_redis, ns, fault):
    a = AdmissionGate(connect(own_redis.url, timeout_s=0.5), ns, CLASSES, lease_ttl_s=1.0, renew_interval_s=0.2)
    b = AdmissionGate(connect(own_redis.url, timeout_s=0.5), ns, CLASSES, lease_ttl_s=1.0, renew_interval_s=0.2)
    try:
        running = [a.admit("c0", f"r{i}", 100, remaining_s=lambda: 5.0) for i in range(2)]  # two streams on A
        fault(own_redis)
        box: dict = {}
        waiter = threading.Thread(target=lambda: box.update(res=b.admit("c0", "newcomer", 100)))
        waiter.start()
        time.sleep(1.2)  # a few renewal beats: A has put its leases back; the newcomer must still wait
        assert "res" not in box, "admitted over budget while A's two streams still run"
        probe = Admission(connect(own_redis.url), ns)
        assert probe.stats([("c0", "short")])[0].count == 2
        assert a.counters["reasserted"] >= 2  # A knows it had lost them
        a.release(running[0])
        waiter.join(5)
        assert box.get("res") is not None  # the freed budget goes to the newcomer, and only then
        assert probe.stats([("c0", "short")])[0].count == 2
    finally:
        a.close()
        b.close()


def test_a_renewal_racing_a_release_never_puts_the_lease_back(rclient, ns):
    """The renewer reads the held leases, a request ends and releases its lease, then the renewal runs: the lease
    stays released (were it put back, a newcomer admitted into the freed room would make three leases of two
    rooms until the renewer noticed; the router-load burst sampled exactly that)."""
    adm = Admission(rclient, ns)
    cls = CLASSES[0]
    ended = adm.reserve_or_wait("c0", cls, "ended", 10, 5.0, max_wait_s=0)
    running = adm.reserve_or_wait("c0", cls, "running", 10, 5.0, max_wait_s=0)
    snapshot = [(ended, 1.0), (running, 1.0)]  # what the renewer read
    adm.release(ended)
    newcomer = adm.reserve_or_wait("c0", cls, "newcomer", 10, 5.0, max_wait_s=0)  # admitted at once, or raises
    assert newcomer is not None
    (_, put_back), (_, lost) = adm.reassert_many(snapshot)
    assert not put_back and not lost and adm.stats([("c0", "short")])[0].count == 2
    rclient.delete(adm.keys("c0", "short")["lease"])  # Redis forgets a running lease: that one is put back
    assert adm.reassert_many([(running, 1.0)])[0][1] is True
