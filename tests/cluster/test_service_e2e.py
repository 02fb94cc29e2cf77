"""End-to-end through the public router of a real local deployment (Ray, redis-server, 3 clusters)."""

from __future__ import annotations

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from k3serve.contracts.sampling import SamplingParams
from k3serve.v1 import router_pb2 as pb
from k3serve.v1 import router_pb2_grpc
from tests.exactness import SEEDS

# its last tests kill a router and Redis: it runs after the shared deployment's other users (tests/conftest.py)
SHARED_DEPLOYMENT_FAULTS = True


def _stub(addr: str) -> router_pb2_grpc.RouterStub:
    return router_pb2_grpc.RouterStub(grpc.insecure_channel(addr))


def _collect(stub, req, timeout=120):
    msgs = list(stub.Generate(req, timeout=timeout))
    return [t for m in msgs for t in m.token_ids], msgs[-1]


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_outputs_equal_reference_greedy_and_seeded(deployment, reference_refs):
    stub = _stub(deployment.router_addresses[0])
    cases = []
    for s in SEEDS:  # each case over 3 seeds: prompts from 1000 * s + the case's offset, sampling seed 5 + s
        cases += [(_ids(50, 1 + 1000 * s), pb.SamplingParams(max_tokens=10, ignore_eos=True), f"e2e-a{s}"),
                  (_ids(700, 2 + 1000 * s), pb.SamplingParams(max_tokens=8, ignore_eos=True), f"e2e-b{s}"),
                  (_ids(30, 3 + 1000 * s), pb.SamplingParams(temperature=0.7, top_p=0.9, top_k=20, seed=5 + s,
                                                             max_tokens=12, ignore_eos=True), f"e2e-c{s}")]
    for prompt, sp, session in cases:
        tokens, last = _collect(stub, pb.GenerateRequest(session_id=session, prompt_token_ids=prompt, sampling=sp))
        reference_refs.check(prompt, SamplingParams.from_proto(sp), tokens, label=session)
        assert last.finish_reason == "length" and last.usage.completion_tokens == sp.max_tokens
        assert last.usage.prompt_tokens == len(prompt) and last.usage.cluster_id


@pytest.mark.parametrize("seed", SEEDS)
def test_multi_turn_session_hits_the_prefix_cache_on_its_cluster(deployment, reference_refs, seed):
    stub = _stub(deployment.router_addresses[0])
    history = _ids(1100, 9 + 1000 * seed)
    seen_clusters = set()
    for turn in range(3):
        tokens, last = _collect(stub, pb.GenerateRequest(session_id=f"e2e-multi-{seed}", prompt_token_ids=history,
                                                         sampling=pb.SamplingParams(max_tokens=6, ignore_eos=True)))
        reference_refs.check(history, SamplingParams(max_tokens=6, ignore_eos=True), tokens, label=f"turn {turn}")
        seen_clusters.add(last.usage.cluster_id)
        if turn:
            assert last.usage.cached_tokens >= 1024  # the session stayed where its cache is
        history = history + tokens + _ids(40, 100 + turn + 1000 * seed)
    assert len(seen_clusters) == 1


def test_two_routers_route_every_session_identically(deployment):
    a, b = (_stub(x) for x in deployment.router_addresses[:2])
    for i in range(6):
        req = pb.GenerateRequest(session_id=f"e2e-pin-{i}", prompt_text="same place?",
                                 sampling=pb.SamplingParams(max_tokens=2, ignore_eos=True))
        _, la = _collect(a, req)
        _, lb = _collect(b, req)
        assert la.usage.cluster_id == lb.usage.cluster_id


BAD = [
    (dict(prompt_token_ids=[], sampling=pb.SamplingParams(max_tokens=4)), "exactly one"),
    (dict(prompt_token_ids=[1, 2], prompt_text="x", sampling=pb.SamplingParams(max_tokens=4)), "exactly one"),
    (dict(prompt_token_ids=[1, 100000], sampling=pb.SamplingParams(max_tokens=4)), "prompt_token_ids[1]"),
    (dict(prompt_token_ids=[1] * 70000, sampling=pb.SamplingParams(max_tokens=4)), "context"),
    (dict(prompt_token_ids=[1, 2], sampling=pb.SamplingParams(max_tokens=0)), "max_tokens"),
    (dict(prompt_token_ids=[1, 2], sampling=pb.SamplingParams(max_tokens=10**9)), "max_tokens"),
    (dict(prompt_token_ids=[1, 2], sampling=pb.SamplingParams(max_tokens=4, temperature=-1)), "temperature"),
    (dict(prompt_token_ids=[1, 2], sampling=pb.SamplingParams(max_tokens=4, top_p=1.5)), "top_p"),
    (dict(prompt_token_ids=[1, 2], sampling=pb.SamplingParams(max_tokens=4, top_p=-0.1)), "top_p"),
    (dict(prompt_token_ids=[1, 2], session_id="bad session!", sampling=pb.SamplingParams(max_tokens=4)), "session_id"),
]


@pytest.mark.parametrize("fields,needle", BAD)
def test_bad_input_is_invalid_argument_naming_the_field(deployment, fields, needle):
    stub = _stub(deployment.router_addresses[0])
    with pytest.raises(grpc.RpcError) as err:
        _collect(stub, pb.GenerateRequest(**fields))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in err.value.details()


def test_oversized_message_is_resource_exhausted_and_service_keeps_serving(deployment):
    stub = _stub(deployment.router_addresses[0])
    with pytest.raises(grpc.RpcError) as err:
        _collect(stub, pb.GenerateRequest(prompt_text="x" * (5 << 20), sampling=pb.SamplingParams(max_tokens=1)))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    tokens, last = _collect(stub, pb.GenerateRequest(prompt_text="still here",
                                                     sampling=pb.SamplingParams(max_tokens=3, ignore_eos=True)))
    assert len(tokens) == 3 and last.finish_reason == "length"


def test_health_reflection_and_cluster_status(deployment):
    ch = grpc.insecure_channel(deployment.router_addresses[0])
    health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="k3serve.v1.Router"))
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    resp = next(reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    assert "k3serve.v1.Router" in {s.name for s in resp.list_services_response.service}
    status = router_pb2_grpc.RouterStub(ch).ClusterStatus(pb.ClusterStatusRequest())
    assert {c.cluster_id for c in status.clusters if c.healthy} == {"c0", "c1", "c2"}
    assert all(c.prefill_tp == 2 and c.decode_tp == 1 for c in status.clusters)


def test_state_moves_between_groups_over_grpc_transfer(deployment):
    """A request's state moves from its prefill group to its decode group over the gRPC transfer (counted beside
    each cluster's warm-up request, which moved one already)."""
    import ray

    def transfers() -> float:
        stats = ray.get([h.stats.remote() for h in deployment.clusters.values()])
        assert all(not s["broken"] for s in stats)
        return sum(s["grpc_transfers"] for s in stats)

    before = transfers()
    tokens, _ = _collect(_stub(deployment.router_addresses[0]),
                         pb.GenerateRequest(prompt_text="moved between groups",
                                            sampling=pb.SamplingParams(max_tokens=2, ignore_eos=True)))
    assert len(tokens) == 2
    assert transfers() == before + 1


def test_internal_endpoint_rejects_unauthenticated_peers(deployment):
    from k3serve.internal.v1 import cluster_pb2, cluster_pb2_grpc

    stub = cluster_pb2_grpc.ClusterStub(grpc.insecure_channel(deployment.cluster_endpoints["c0"]))
    req = cluster_pb2.ClusterGenerateRequest(request=pb.GenerateRequest(
        request_id="intruder", prompt_token_ids=[1, 2], sampling=pb.SamplingParams(max_tokens=2)))
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(req, timeout=10))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    from k3serve.auth import AuthConfig, sign

    method = "/k3serve.internal.v1.Cluster/Generate"
    wrong = AuthConfig("x" * 32, peer="intruder")  # signed, but not with this deployment's secret
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(req, metadata=sign(wrong, method, "intruder", req), timeout=10))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    right = AuthConfig(deployment.deploy.secret, peer="router")  # the right secret, another request's signature
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(req, metadata=sign(right, method, "someone-else", req), timeout=10))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_metrics_and_class_status_are_visible(deployment):
    import urllib.request

    import ray

    stub = _stub(deployment.router_addresses[0])
    _collect(stub, pb.GenerateRequest(prompt_text="count me", sampling=pb.SamplingParams(max_tokens=2, ignore_eos=True)))
    url = ray.get(deployment.routers[0].metrics_endpoint.remote())
    body = urllib.request.urlopen(url, timeout=10).read().decode()
    assert 'k3serve_requests_total{outcome="completed"}' in body
    assert "k3serve_ttft_seconds_bucket" in body and 'k3serve_class_inflight_tokens{cls="short"}' in body
    status = stub.ClusterStatus(pb.ClusterStatusRequest())
    assert {c.name for c in status.classes} == {"short", "long"}


# ---- faults on this shared deployment that leave every cluster alive (they run last, in file order) ----------

def test_router_kill_loses_nothing_for_clients_that_retry(deployment):
    from k3serve.cluster.drill import Fault, run_drill

    out = run_drill(deployment, Fault("router"), at_s=2.0, sessions=8, turns=2, max_tokens=16, seed=6)
    assert out["failed"] == 0 and out["mismatches"] == 0 and out["completed"] == out["requests"] == 16
    assert out["router_retries"] > 0  # the fault really hit requests in flight on the killed router
    # the killed router's admission reservations are freed by lease expiry (10 s leases), nothing leaks
    import time

    from k3serve.cluster.redis_server import connect
    from k3serve.router.admission import Admission

    adm = Admission(connect(deployment.redis_url), deployment.deploy.control.namespace)
    deadline = time.monotonic() + 20
    while True:
        held = sum(load.count for load in adm.stats([(c, cls.name) for c in deployment.cluster_endpoints
                                                     for cls in deployment.deploy.request_classes]))
        if held == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert held == 0


def test_redis_outage_keeps_serving_and_recovers(deployment):
    from k3serve.cluster.drill import Fault, run_drill

    # the first router replica was killed above; the drill client falls back to the survivor
    deployment.router_addresses = deployment.router_addresses[1:]
    deployment.http_addresses = deployment.http_addresses[1:]
    out = run_drill(deployment, Fault("redis"), at_s=1.0, sessions=6, turns=3, max_tokens=12, seed=7)
    assert out["failed"] == 0 and out["mismatches"] == 0
    # Redis is back (empty): heartbeats re-register every cluster without a restart
    deployment.wait_healthy(3, timeout_s=30)
    stub = _stub(deployment.router_addresses[0])
    tokens, last = _collect(stub, pb.GenerateRequest(session_id="after-redis", prompt_text="back",
                                                     sampling=pb.SamplingParams(max_tokens=3, ignore_eos=True)))
    assert len(tokens) == 3 and not stub.ClusterStatus(pb.ClusterStatusRequest()).membership_stale

