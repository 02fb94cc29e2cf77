"""Cluster registry in Redis, the router's cached view (stale on Redis outage) and the circuit breaker."""

from __future__ import annotations

import time

import pytest

from k3serve.cluster.redis_server import RedisServer, connect
from k3serve.router.membership import (
    BreakerConfig,
    CircuitBreaker,
    ClusterState,
    Membership,
    MembershipView,
    check_id,
    key_prefix,
)


SECRET = "membership-secret-0123456789"


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_register_heartbeat_and_read(rclient, ns):
    m = Membership(rclient, ns, SECRET)
    m.register("c0", {"router": "10.0.0.1:5000"}, ttl_s=30)
    m.register("c1", {"router": "10.0.0.2:5000"}, ttl_s=30)
    assert m.heartbeat("c0", {"tokens": 1234, "queued": 2}, ttl_s=30)
    server_now = float(rclient.time()[0])
    healthy = m.healthy_clusters()
    assert [c.id for c in healthy] == ["c0", "c1"]
    c0 = healthy[0]
    assert c0.endpoints == {"router": "10.0.0.1:5000"}
    assert c0.load == {"tokens": 1234.0, "queued": 2.0}
    assert abs(c0.last_seen - server_now) < 5  # Redis's clock, not ours
    assert healthy[1].load == {}  # registered, no heartbeat yet
    # keys live under the namespace
    keys = set(rclient.keys(key_prefix(ns) + "*"))
    assert keys == {f"k3s:{ns}:clusters", f"k3s:{ns}:reg:c0", f"k3s:{ns}:reg:c1", f"k3s:{ns}:hb:c0",
                    f"k3s:{ns}:hb:c1"}  # fmt: skip


def test_heartbeat_expiry_makes_a_cluster_dead_and_a_heartbeat_revives_it(rclient, ns):
    m = Membership(rclient, ns, SECRET)
    m.register("c0", {"router": "a"}, ttl_s=30, heartbeat_ttl_s=0.15)
    m.register("c1", {"router": "b"}, ttl_s=30)
    time.sleep(0.25)
    assert [c.id for c in m.healthy_clusters()] == ["c1"]
    _, everything = m.read()
    assert [(c.id, c.alive) for c in everything] == [("c0", False), ("c1", True)]
    assert m.heartbeat("c0", {"tokens": 1}, ttl_s=30)
    assert [c.id for c in m.healthy_clusters()] == ["c0", "c1"]


def test_expired_registration_needs_register_again(rclient, ns):
    m = Membership(rclient, ns, SECRET)
    m.register("c0", {"router": "a"}, ttl_s=0.15)
    assert m.heartbeat("c0", {}, ttl_s=0.15)
    time.sleep(0.25)
    assert not m.heartbeat("c0", {}, ttl_s=30)  # nothing written: endpoints are unknown now
    assert m.healthy_clusters() == []
    assert rclient.smembers(f"k3s:{ns}:clusters") == set()  # pruned by the read
    m.register("c0", {"router": "a2"}, ttl_s=30)
    assert [(c.id, c.endpoints["router"]) for c in m.healthy_clusters()] == [("c0", "a2")]


def test_heartbeat_renews_registration(rclient, ns):
    m = Membership(rclient, ns, SECRET)
    m.register("c0", {"router": "a"}, ttl_s=0.3)
    for _ in range(4):  # 0.4 s in total, past the registration TTL, kept alive by heartbeats
        time.sleep(0.1)
        assert m.heartbeat("c0", {}, ttl_s=0.3)
    assert [c.id for c in m.healthy_clusters()] == ["c0"]


def test_deregister_and_namespaces_are_isolated(rclient, ns):
    a, b = Membership(rclient, ns, SECRET), Membership(rclient, ns + "b", SECRET)
    a.register("c0", {"router": "a"}, ttl_s=30)
    b.register("c9", {"router": "b"}, ttl_s=30)
    assert [c.id for c in a.healthy_clusters()] == ["c0"]
    assert [c.id for c in b.healthy_clusters()] == ["c9"]
    a.deregister("c0")
    assert a.healthy_clusters() == []
    assert [c.id for c in b.healthy_clusters()] == ["c9"]


def test_ids_are_validated(rclient, ns):
    m = Membership(rclient, ns, SECRET)
    for bad in ("", "a:b", "a{b}", "x" * 65, "sp ace", "c0\n"):
        with pytest.raises(ValueError):
            m.register(bad, {}, ttl_s=1)
    with pytest.raises(ValueError):
        Membership(rclient, "bad:ns", SECRET)
    with pytest.raises(ValueError):
        m.register("c0", {}, ttl_s=0)
    assert check_id("cluster id", "c-0_a.b") == "c-0_a.b"


def test_view_caches_reads_for_the_refresh_interval(rclient, ns):
    m = Membership(rclient, ns, SECRET)
    clock = FakeClock()
    view = MembershipView(m, refresh_interval_s=0.5, clock=clock)
    m.register("c0", {"router": "a"}, ttl_s=30)
    assert view.routable() == ["c0"]
    m.register("c1", {"router": "b"}, ttl_s=30)
    clock.t += 0.4
    assert view.routable() == ["c0"]  # cached
    clock.t += 0.2
    assert view.routable() == ["c0", "c1"]
    assert not view.snapshot().stale


def test_view_keeps_last_membership_when_redis_is_down(tmp_path, ns):
    server = RedisServer(unix_socket=True)
    server.start(tmp_path)
    client = connect(server.url, timeout_s=0.2, retries=0)
    try:
        m = Membership(client, ns, SECRET)
        m.register("c0", {"router": "a"}, ttl_s=30)
        m.register("c1", {"router": "b"}, ttl_s=30)
        clock = FakeClock()
        view = MembershipView(m, refresh_interval_s=0.5, clock=clock)
        assert view.routable() == ["c0", "c1"]
        server.stop()

        clock.t += 1.0
        snap = view.snapshot()
        assert snap.stale and snap.error
        assert [c.id for c in snap.clusters] == ["c0", "c1"]
        assert view.routable(snap) == ["c0", "c1"]  # routing continues on the last known membership
        # Within the interval no further read is attempted: routing decisions do not wait on a dead Redis.
        t0 = time.monotonic()
        for _ in range(100):
            assert view.routable() == ["c0", "c1"]
        assert time.monotonic() - t0 < 0.5
        # The breaker still works on top of the stale view.
        view.mark_suspect("c0")
        assert view.routable() == ["c1"]
    finally:
        client.close()
        server.stop()


def test_view_with_redis_never_reachable_is_empty_and_stale(tmp_path, ns):
    client = connect(f"unix://{tmp_path}/nothing.sock", timeout_s=0.2, retries=0)
    view = MembershipView(Membership(client, ns, SECRET))
    snap = view.snapshot()
    assert snap.stale and snap.clusters == () and view.routable(snap) == []


def test_breaker_cool_down_half_open_and_backoff():
    clock = FakeClock()
    b = CircuitBreaker(BreakerConfig(cool_down_s=5.0, backoff=2.0, max_cool_down_s=12.0), clock=clock)
    assert b.state("c0") is ClusterState.HEALTHY
    assert b.mark_suspect("c0") == 5.0
    assert b.state("c0") is ClusterState.SUSPECT and not b.allows("c0")
    clock.t += 1
    assert b.mark_suspect("c0") == pytest.approx(4.0)  # concurrent failures of one outage count once
    clock.t += 4.01
    assert b.state("c0") is ClusterState.HALF_OPEN and b.allows("c0")
    assert b.mark_suspect("c0") == 10.0  # failed again: longer cool-down
    clock.t += 10.01
    assert b.state("c0") is ClusterState.HALF_OPEN
    assert b.mark_suspect("c0") == 12.0  # capped
    clock.t += 12.01
    b.mark_ok("c0")
    assert b.state("c0") is ClusterState.HEALTHY
    assert b.mark_suspect("c0") == 5.0  # a success resets the backoff
    with pytest.raises(ValueError):
        BreakerConfig(cool_down_s=10, max_cool_down_s=5)


def test_view_states_combine_heartbeat_and_breaker(rclient, ns):
    m = Membership(rclient, ns, SECRET)
    clock = FakeClock()
    view = MembershipView(m, refresh_interval_s=0.0, breaker=CircuitBreaker(BreakerConfig(cool_down_s=5), clock))
    m.register("c0", {"router": "a"}, ttl_s=30)
    m.register("c1", {"router": "b"}, ttl_s=30, heartbeat_ttl_s=0.1)
    m.register("c2", {"router": "c"}, ttl_s=30)
    view.mark_suspect("c2")
    time.sleep(0.15)
    snap = view.refresh()
    assert view.state("c0", snap) is ClusterState.HEALTHY
    assert view.state("c1", snap) is ClusterState.DEAD  # heartbeat expired
    assert view.state("c2", snap) is ClusterState.SUSPECT
    assert view.state("nope", snap) is ClusterState.DEAD
    assert view.routable(snap) == ["c0"]
    clock.t += 5.1
    assert view.state("c2", snap) is ClusterState.HALF_OPEN
    assert view.routable(snap) == ["c0", "c2"]
    view.mark_ok("c2")
    assert view.state("c2", snap) is ClusterState.HEALTHY
    assert view.get("c0").endpoints == {"router": "a"}


def test_redis_restart_agents_reregister_and_view_recovers(tmp_path, ns):
    """Redis dies and comes back empty at the same URL: the view goes stale and back, scripts are reloaded
    (NOSCRIPT is handled by redis-py), and a heartbeat tells the agent to register again."""
    server = RedisServer(tmp_path, unix_socket=True)
    server.start()
    client = connect(server.url, timeout_s=0.3, retries=0)
    try:
        m = Membership(client, ns, SECRET)
        m.register("c0", {"router": "a"}, ttl_s=30)
        clock = FakeClock()
        view = MembershipView(m, refresh_interval_s=0.5, clock=clock)
        assert view.routable() == ["c0"]
        server.pause()
        clock.t += 1
        assert view.snapshot().stale and view.routable() == ["c0"]
        server.resume()
        clock.t += 1
        snap = view.snapshot()
        # Redis is empty, but within the grace period the view keeps routing on what it knew.
        assert snap.stale and "no alive cluster" in snap.error and view.routable(snap) == ["c0"]
        assert m.heartbeat("c0", {}, ttl_s=30) is False  # the agent learns it must register again
        m.register("c0", {"router": "b"}, ttl_s=30)
        clock.t += 1
        snap = view.snapshot()
        assert not snap.stale and view.routable(snap) == ["c0"] and snap.get("c0").endpoints == {"router": "b"}
    finally:
        client.close()
        server.stop()


def test_empty_membership_is_trusted_after_the_grace_period(rclient, ns):
    m = Membership(rclient, ns, SECRET)
    clock = FakeClock()
    view = MembershipView(m, refresh_interval_s=0.0, empty_grace_s=5.0, clock=clock)
    m.register("c0", {"router": "a"}, ttl_s=30)
    assert view.routable() == ["c0"]
    m.deregister("c0")
    clock.t += 1
    assert view.snapshot().stale and view.routable() == ["c0"]
    clock.t += 5
    snap = view.snapshot()
    assert not snap.stale and view.routable(snap) == []
    # A partial loss is trusted at once: only an *empty* read is suspicious.
    m.register("c0", {"router": "a"}, ttl_s=30)
    m.register("c1", {"router": "b"}, ttl_s=30)
    clock.t += 1
    assert view.routable() == ["c0", "c1"]
    m.deregister("c1")
    clock.t += 1
    assert view.routable() == ["c0"]


def test_a_cluster_back_with_a_new_endpoint_is_routable_at_once(rclient, ns):
    """Rebuilt or replaced clusters register a new endpoint: the old incarnation's failures no longer count."""
    m = Membership(rclient, ns, SECRET)
    clock = FakeClock()
    view = MembershipView(m, refresh_interval_s=0.0, breaker=CircuitBreaker(BreakerConfig(cool_down_s=60), clock))
    m.register("c0", {"cluster": "127.0.0.1:1001"}, ttl_s=30)
    m.register("c1", {"cluster": "127.0.0.1:1002"}, ttl_s=30)
    view.refresh()
    view.mark_suspect("c0")
    view.mark_suspect("c1")
    assert view.routable(view.refresh()) == []
    m.register("c0", {"cluster": "127.0.0.1:2001"}, ttl_s=30)  # c0 rebuilt; c1 is the same process still
    snap = view.refresh()
    assert view.routable(snap) == ["c0"]
    assert view.state("c1", snap) is ClusterState.SUSPECT


def test_an_unsigned_or_forged_cluster_is_ignored(rclient, ns):
    """Anyone who can write Redis could register a cluster; routers take only entries signed with the
    deployment secret (a forger's own secret, or a copied signature on other endpoints, does not verify)."""
    m = Membership(rclient, ns, SECRET)
    m.register("c0", {"cluster": "127.0.0.1:5000"}, ttl_s=30)
    Membership(rclient, ns, "another-deployments-secret").register("evil", {"cluster": "10.6.6.6:1"}, ttl_s=30)
    prefix = key_prefix(ns)
    # by hand, as a process with Redis access but no secret would: no signature, then c0's on other endpoints
    rclient.hset(f"{prefix}reg:bare", mapping={"endpoints": '{"cluster": "10.6.6.6:2"}', "ttl_ms": 30000,
                                                "last_ms": 1})
    rclient.hset(f"{prefix}hb:bare", mapping={"load": "{}", "ts_ms": 1})
    rclient.sadd(f"{prefix}clusters", "bare")
    rclient.hset(f"{prefix}reg:c0", "endpoints", '{"cluster": "10.6.6.6:3"}')
    rclient.hset(f"{prefix}reg:c1", mapping={"endpoints": '{"cluster": "10.6.6.6:3"}', "last_ms": 1,
                                              "sig": rclient.hget(f"{prefix}reg:c0", "sig")})
    rclient.hset(f"{prefix}hb:c1", mapping={"load": "{}", "ts_ms": 1})
    rclient.sadd(f"{prefix}clusters", "c1")
    view = MembershipView(Membership(rclient, ns, SECRET))
    assert view.refresh().clusters == () and view.routable() == []
    assert view.membership.forged == 4  # evil, bare, c0 re-pointed, c1 with c0's signature
    m.register("c0", {"cluster": "127.0.0.1:5000"}, ttl_s=30)  # the real agent's next registration
    assert [(c.id, dict(c.endpoints)) for c in view.refresh().clusters] == [("c0", {"cluster": "127.0.0.1:5000"})]
    with pytest.raises(ValueError, match="secret"):
        Membership(rclient, ns, "short")


@pytest.mark.parametrize("unix_socket", [False, True])
def test_the_private_redis_needs_its_generated_password_and_never_shows_it(tmp_path, unix_socket):
    import redis as redis_py

    from k3serve.cluster.redis_server import redact_url

    server = RedisServer(unix_socket=unix_socket)
    url = server.start(tmp_path)
    try:
        password = server._password
        assert len(password) >= 32 and password in url
        assert connect(url).ping()
        for wrong in (url.replace(f":{password}@", ""), url.replace(password, "guess")):
            with pytest.raises((redis_py.AuthenticationError, redis_py.ResponseError)):  # NOAUTH / WRONGPASS
                connect(wrong).ping()
        assert password not in repr(server) and ":***@" in repr(server)
        assert redact_url(url) == url.replace(password, "***")
        cmdline = open(f"/proc/{server.pid}/cmdline", "rb").read()
        assert password.encode() not in cmdline  # given on stdin, not visible in ps
    finally:
        server.stop()
    assert redact_url("redis://h:1/0?password=p4ss&db=2") == "redis://h:1/0?password=***&db=2"
    assert redact_url("redis://user:p4ss@h:1/0") == "redis://user:***@h:1/0"
