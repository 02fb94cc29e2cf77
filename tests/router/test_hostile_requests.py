"""Issue 44, the request level: a real RouterService over a real redis-server and real gRPC, with scriptable fake
cluster fronts (fake_cluster.py): a request's fault stays its own, ids are the tenant's, keys are digests with
per-key limits, status reads no keyspace per call and shows no internal endpoint."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from k3serve.router.api_keys import ApiKeyError, ApiKeys, check_api_keys
from k3serve.router.key_quota import QuotaLimits
from k3serve.router.membership import ClusterState
from k3serve.router.tenancy import tenant_id
from k3serve.v1 import router_pb2 as pb
from tests.router.fake_cluster import SECRET, Behaviour, expected_tokens
from tests.router.fake_cluster import generate as _run, rpc_error as _rpc_error


def _bearer(key: str):
    return (("authorization", f"Bearer {key}"),)


def test_a_request_that_failed_inside_a_cluster_is_not_failed_over_and_its_text_stays_inside(rig):
    c0 = rig.add_cluster("c0", Behaviour(internal_after=2))
    c1 = rig.add_cluster("c1", Behaviour(internal_after=2))
    svc, stub = rig.add_router()
    err = _rpc_error(lambda: _run(stub, session_id="poison", prompt_token_ids=[1, 2]))
    assert err.code() == grpc.StatusCode.INTERNAL
    assert "incident" in err.details() and "engine.py" not in err.details() and "RuntimeError" not in err.details()
    assert len(c0.seen) + len(c1.seen) == 1  # not resubmitted to the other cluster
    assert {svc.view.state(c) for c in ("c0", "c1")} == {ClusterState.HEALTHY}
    assert svc.counters["failovers"] == 0


@pytest.mark.parametrize("bad", ["abc\n", "abc\r\n", "a b", "x" * 129])
def test_a_request_id_with_a_trailing_newline_is_the_clients_error(rig, bad):
    rig.add_cluster("c0")
    _, stub = rig.add_router()
    err = _rpc_error(lambda: _run(stub, request_id=bad, prompt_token_ids=[1]))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in err.details()
    err = _rpc_error(lambda: _run(stub, session_id=bad, prompt_token_ids=[1]))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "session_id" in err.details()


def test_two_tenants_may_use_one_request_id_at_once(rig):
    fc = rig.add_cluster("c0", Behaviour(delay_s=0.05))
    _, stub = rig.add_router(api_keys=("key-a", "key-b"))
    out: dict[str, object] = {}

    def run(key):
        try:
            out[key] = _run(stub, metadata=_bearer(key), request_id="same", session_id="s", prompt_token_ids=[1],
                            sampling=pb.SamplingParams(max_tokens=20, ignore_eos=True))[0]
        except grpc.RpcError as e:
            out[key] = e.code()

    threads = [threading.Thread(target=run, args=(k,)) for k in ("key-a", "key-b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == {"key-a": expected_tokens(20), "key-b": expected_tokens(20)}
    ids = {s.request_id for s in fc.seen}
    assert len(ids) == 2 and all(i.endswith("~same") for i in ids)  # scoped before they reached the cluster


def test_api_keys_must_be_a_list_of_non_empty_strings():
    for bad, where in (("sk-live-abcdef", "api_keys"), (["", "k"], "api_keys[0]"), (["k", None], "api_keys[1]"),
                       ([" k"], "api_keys[0]"), ({"k": 1}, "api_keys")):
        with pytest.raises(ApiKeyError) as err:
            check_api_keys(bad)
        assert str(err.value).startswith(f"{where} must"), err.value
    assert check_api_keys(["a", "b"]) == ("a", "b")


def test_api_keys_are_held_as_keyed_digests():
    keys = ApiKeys(SECRET, ("sk-live-abcdef", "other"))
    held = repr(keys) + repr(vars(keys))
    assert "sk-live-abcdef" not in held and keys.admits("sk-live-abcdef") and keys.admits("other")
    assert not keys.admits("s") and not keys.admits("") and not keys.admits("sk-live-abcdeF")
    assert not ApiKeys(SECRET + "x", ("other",))._digests & keys._digests  # keyed by the deployment secret


def test_an_unknown_or_partial_key_is_refused(rig):
    rig.add_cluster("c0")
    _, stub = rig.add_router(api_keys=("sk-live-abcdef",))
    for md in (None, _bearer(""), _bearer("s"), _bearer("sk-live-abcde")):
        assert _rpc_error(lambda: _run(stub, metadata=md, prompt_token_ids=[1])).code() == \
            grpc.StatusCode.UNAUTHENTICATED
    assert _run(stub, metadata=_bearer("sk-live-abcdef"), prompt_token_ids=[1])[0] == expected_tokens(5)


def test_one_key_cannot_take_every_stream(rig):
    rig.add_cluster("c0", Behaviour(delay_s=0.05))
    svc, stub = rig.add_router(api_keys=("key-a", "key-b"), max_streams=4)
    assert svc.quota.limits == QuotaLimits(2, 0)  # the defaults: half of the streams, no separate queue limit
    calls = [stub.Generate(pb.GenerateRequest(request_id=f"a{i}", prompt_token_ids=[1],
                                              sampling=pb.SamplingParams(max_tokens=40, ignore_eos=True)),
                           metadata=_bearer("key-a"), timeout=30) for i in range(2)]
    firsts = [next(c) for c in calls]  # both streaming
    assert all(f.token_ids for f in firsts)
    err = _rpc_error(lambda: _run(stub, metadata=_bearer("key-a"), prompt_token_ids=[1]))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "API key" in err.details()
    md = dict(err.trailing_metadata())
    assert md["k3serve-rejected-by"] == "key" and float(md["retry-after-s"]) > 0
    assert _run(stub, metadata=_bearer("key-b"), prompt_token_ids=[1])[0] == expected_tokens(5)  # the other key
    for c in calls:
        assert len([t for m in c for t in m.token_ids]) == 39
    tenant, deadline = tenant_id(SECRET, "key-a"), time.monotonic() + 5
    while svc.quota.held(tenant) != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert svc.quota.held(tenant) == (0, 0)  # every stream gave its place back


def test_status_shows_no_internal_endpoint_and_reads_redis_in_the_background_only(rig, rclient):
    for c in ("c0", "c1"):
        rig.add_cluster(c)
    svc, stub = rig.add_router(status_interval_s=0.5)
    _run(stub, session_id="pinned", prompt_token_ids=[1])
    svc.status.refresh()
    before = rclient.info("commandstats").get("cmdstat_scan", {}).get("calls", 0)
    t0 = time.monotonic()
    for _ in range(60):
        resp = stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=10)
    elapsed = time.monotonic() - t0
    scans = rclient.info("commandstats").get("cmdstat_scan", {}).get("calls", 0) - before
    assert {c.cluster_id for c in resp.clusters} == {"c0", "c1"} and resp.pinned_sessions == 1
    assert all(c.endpoint == "" for c in resp.clusters)
    endpoints = {fc.endpoint for fc in rig.clusters.values()}
    assert not any(e in str(resp) for e in endpoints)
    assert scans <= elapsed / 0.5 + 2, (scans, elapsed)  # the background reader's, not one per call


def test_the_status_command_sends_its_api_key_and_prints_no_endpoint(rig):
    from typer.testing import CliRunner

    from k3serve.cli.main import app

    rig.add_cluster("c0")
    rig.add_router(api_keys=("key-a",))
    addr = rig.routers[-1][2]
    refused = CliRunner().invoke(app, ["status", "--router", addr, "--json"])
    assert refused.exit_code == 1 and "UNAUTHENTICATED" in refused.output
    ok = CliRunner().invoke(app, ["status", "--router", addr, "--json", "--api-key", "key-a"])
    assert ok.exit_code == 0, ok.output
    assert '"c0"' in ok.output and "endpoint" not in ok.output and rig.clusters["c0"].endpoint not in ok.output
