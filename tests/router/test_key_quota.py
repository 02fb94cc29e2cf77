"""Issue 44, per-key quotas across router replicas: two RouterService instances on one redis-server give a key
one share between them, not one each; a router that dies frees its places within the lease; a limit is checked
atomically (no two routers both take the last place)."""

from __future__ import annotations

import threading
import time

import grpc

from k3serve.router.key_quota import KeyQuota, QuotaExceeded, QuotaLimits
from k3serve.router.tenancy import tenant_id
from k3serve.v1 import router_pb2 as pb
from tests.router.fake_cluster import SECRET, Behaviour, expected_tokens
from tests.router.fake_cluster import generate as _run, rpc_error as _rpc_error

KEYS = ("key-a", "key-b")


def _bearer(key: str):
    return (("authorization", f"Bearer {key}"),)


def _wait(cond, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.05)
    return cond()


def test_a_keys_streams_are_limited_across_two_routers(rig, rclient):
    rig.add_cluster("c0", Behaviour(delay_s=0.05))
    routers = [rig.add_router(api_keys=KEYS, quota=QuotaLimits(2, 0)) for _ in range(2)]
    long = pb.SamplingParams(max_tokens=40, ignore_eos=True)
    calls = [stub.Generate(pb.GenerateRequest(request_id=f"a{i}", prompt_token_ids=[1], sampling=long),
                           metadata=_bearer("key-a"), timeout=30) for i, (_, stub) in enumerate(routers)]
    assert all(next(c).token_ids for c in calls)  # one stream of key-a on each router: its limit of 2 in all
    for _, stub in routers:  # each router holds one stream of key-a only: per replica there would be room
        err = _rpc_error(lambda: _run(stub, metadata=_bearer("key-a"), prompt_token_ids=[1]))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "across the routers" in err.details()
        assert dict(err.trailing_metadata())["k3serve-rejected-by"] == "key"
        assert _run(stub, metadata=_bearer("key-b"), prompt_token_ids=[1])[0] == expected_tokens(5)  # other key
    for c in calls:
        assert len([t for m in c for t in m.token_ids]) == 39
    tenant = tenant_id(SECRET, "key-a")
    assert _wait(lambda: all(svc.quota.held(tenant) == (0, 0) for svc, _ in routers))
    assert rclient.zcard(f"k3s:{rig.ns}:quota:{tenant}:streams") == 0  # every lease released
    assert _run(routers[0][1], metadata=_bearer("key-a"), prompt_token_ids=[1])[0] == expected_tokens(5)


def test_a_dead_routers_places_come_free_within_the_lease_and_live_ones_are_renewed(new_client, ns):
    limits, tenant = QuotaLimits(1, 0), tenant_id(SECRET, "key-a")
    a, b = (KeyQuota(limits, new_client(), ns, lease_ttl_s=1.5) for _ in range(2))
    try:
        with a.stream(tenant):
            time.sleep(4.0)  # past two lease lengths: a's renewer keeps its place
            try:
                with b.stream(tenant):
                    raise AssertionError("b took the key's only place while a holds it")
            except QuotaExceeded as e:
                assert "across the routers" in str(e)
            a.close()  # a dies holding its place: nothing renews it
            t = time.monotonic()
            while True:
                try:
                    with b.stream(tenant):
                        break
                except QuotaExceeded:
                    assert time.monotonic() - t < 1.5 + 3.0, "a dead router's place did not come free"
                    time.sleep(0.05)
    finally:
        a.close()
        b.close()


def test_two_routers_never_both_take_the_last_place(new_client, ns):
    limits, tenant = QuotaLimits(3, 0), "t"
    quotas = [KeyQuota(limits, new_client(), ns) for _ in range(4)]
    held, refused, lock, go, done = [0], [0], threading.Lock(), threading.Barrier(16), threading.Event()

    def one(q: KeyQuota) -> None:
        go.wait()
        try:
            with q.stream(tenant):
                with lock:
                    held[0] += 1
                done.wait(5)
        except QuotaExceeded:
            with lock:
                refused[0] += 1

    threads = [threading.Thread(target=one, args=(quotas[i % 4],)) for i in range(16)]
    for th in threads:
        th.start()
    assert _wait(lambda: held[0] + refused[0] == 16)
    assert (held[0], refused[0]) == (3, 13)
    done.set()
    for th in threads:
        th.join(10)
    for q in quotas:
        q.close()


def test_the_default_share_is_half_of_every_routers_streams():
    assert QuotaLimits.resolve(0, 0, 128, keys=3, routers=2) == QuotaLimits(128, 0)
    assert QuotaLimits.resolve(0, 0, 128, keys=1, routers=2) == QuotaLimits(0, 0)  # nobody to share with
    assert QuotaLimits.resolve(5, 7, 128, keys=3, routers=2) == QuotaLimits(5, 7)
