"""The router against the real local deployment (Ray, redis-server, 3 clusters of the tiny model): tenant
isolation of the prefix cache, request ids, undecodable input (issues 19 and 10), and a bounded load test of two
router replicas under 200 concurrent streams at a service sized for far fewer."""

from __future__ import annotations

import json
import threading
import time

import grpc
import pytest
import torch

from k3serve.v1 import router_pb2 as pb
from k3serve.v1 import router_pb2_grpc


def _stub(addr: str) -> router_pb2_grpc.RouterStub:
    return router_pb2_grpc.RouterStub(grpc.insecure_channel(addr))


def _collect(stub, req, timeout=120):
    msgs = list(stub.Generate(req, timeout=timeout))
    return [t for m in msgs for t in m.token_ids], msgs[-1]


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_prefix_cache_hits_only_within_one_cache_salt(deployment):
    stub = _stub(deployment.router_addresses[0])
    prompt = _ids(1100, 77)
    sp = pb.SamplingParams(max_tokens=2, ignore_eos=True)
    cached = [_collect(stub, pb.GenerateRequest(session_id="salted", prompt_token_ids=prompt, cache_salt=salt,
                                                sampling=sp))[1].usage.cached_tokens
              for salt in ("tenant-a", "tenant-b", "tenant-a")]
    assert cached[0] == 0 and cached[1] == 0  # tenant b cannot see (or time) tenant a's prefix
    assert cached[2] >= 1024  # tenant a hits its own


def test_a_duplicate_in_flight_request_id_is_already_exists_and_no_cluster_is_blamed(deployment):
    stub = _stub(deployment.router_addresses[0])
    out = {}

    def first():
        out["first"] = _collect(stub, pb.GenerateRequest(
            request_id="dup-live", session_id="dup-live", prompt_token_ids=_ids(40, 5),
            sampling=pb.SamplingParams(max_tokens=60, ignore_eos=True)))[1]

    t = threading.Thread(target=first)
    t.start()
    time.sleep(0.5)
    with pytest.raises(grpc.RpcError) as err:
        _collect(stub, pb.GenerateRequest(request_id="dup-live", session_id="dup-live", prompt_token_ids=[1, 2],
                                          sampling=pb.SamplingParams(max_tokens=2)))
    t.join(120)
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert out["first"].finish_reason == "length" and out["first"].usage.failovers == 0
    status = stub.ClusterStatus(pb.ClusterStatusRequest())
    assert not any(c.suspect for c in status.clusters)


def test_a_session_id_that_is_not_utf8_is_invalid_argument(deployment):
    raw = pb.GenerateRequest(session_id="abc", prompt_token_ids=[1], sampling=pb.SamplingParams(max_tokens=2)
                             ).SerializeToString().replace(b"abc", b"a\xffc")
    call = grpc.insecure_channel(deployment.router_addresses[0]).unary_stream("/k3serve.v1.Router/Generate")
    with pytest.raises(grpc.RpcError) as err:
        list(call(raw, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "session_id" in err.value.details()


def test_anonymous_conversations_each_keep_their_checkpoints(deployment):
    """Five anonymous conversations: with one shared (empty) identity they would share one budget of 4
    checkpoints and evict each other's; each request has its own identity now, and every second turn goes back
    to the cluster that holds its first turn (the published prefix maps) and hits there."""
    stub = _stub(deployment.router_addresses[0])
    sp = pb.SamplingParams(max_tokens=4, ignore_eos=True)
    firsts = [_ids(560, 1000 + i) for i in range(5)]  # one checkpoint each, at 512
    served = [_collect(stub, pb.GenerateRequest(prompt_token_ids=p, sampling=sp)) for p in firsts]
    time.sleep(PUBLISHED_S)
    hits = []
    for i, (p, (reply, first)) in enumerate(zip(firsts, served)):
        _, last = _collect(stub, pb.GenerateRequest(prompt_token_ids=p + reply + _ids(30, 2000 + i), sampling=sp))
        assert last.usage.cluster_id == first.usage.cluster_id
        hits.append(last.usage.cached_tokens)
    assert hits == [512] * 5


# A cluster publishes its prefix map at its next heartbeat (0.5 s in configs/local.yaml) and a router reads it at
# its next membership refresh (0.2 s): waiting this long makes the next placement see what was just served.
PUBLISHED_S = 1.5


def test_anonymous_conversations_under_one_system_prompt_spread_and_hit(deployment, reference_refs):
    """Ten anonymous conversations under one 1,100-token system prompt over 3 clusters. Six arrive at once: the
    router's count of prefill work it has sent spreads them over every cluster (by the first block alone all
    six went to one; the clusters' measured rates differ on a busy host, so it is not always all three). Their
    second turns each go back to their own cluster and resume at their first turn's
    checkpoint. Four later conversations: once one has diverged from the system prompt's cached blocks on a
    cluster (a branch-point checkpoint there), the next resume at its shared part (1,024 tokens), with exactly
    the reference's tokens."""
    from k3serve.contracts.sampling import SamplingParams

    stub = _stub(deployment.router_addresses[0])
    sp = pb.SamplingParams(max_tokens=4, ignore_eos=True)
    system = _ids(1100, 4600)
    firsts = [system + _ids(600, 4700 + i) for i in range(6)]
    served: list = [None] * 6

    def first(i: int) -> None:
        served[i] = _collect(stub, pb.GenerateRequest(prompt_token_ids=firsts[i], sampling=sp))

    threads = [threading.Thread(target=first, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    where = [s[1].usage.cluster_id for s in served]
    assert len(set(where)) >= 2, where  # (each cluster's measured rate weighs in: not always all three)
    time.sleep(PUBLISHED_S)
    for i, (reply, last) in enumerate(served):
        _, again = _collect(stub, pb.GenerateRequest(prompt_token_ids=firsts[i] + reply + _ids(20, 4800 + i),
                                                     sampling=sp))
        assert (again.usage.cluster_id, again.usage.cached_tokens) == (where[i], 1536)
    late_hits = []
    for i in range(4):
        time.sleep(PUBLISHED_S)
        prompt = system + _ids(700, 4900 + i)
        tokens, last = _collect(stub, pb.GenerateRequest(prompt_token_ids=prompt, sampling=sp))
        assert last.usage.failovers == 0
        late_hits.append(last.usage.cached_tokens)
        if last.usage.cached_tokens:  # a resumed prefill gives a cold run's tokens
            reference_refs.check(prompt, SamplingParams(max_tokens=4, ignore_eos=True), tokens, label=f"late{i}")
    assert late_hits.count(1024) >= 2 and set(late_hits) <= {0, 1024}, late_hits


# ------------------------------------------------------------------------------------------------ load
def test_load_two_routers_200_streams(deployment):
    """200 clients at once at two routers sized for 3 x (2 in flight + 2 queued) (benchmarks/router_load.py);
    a refused client sleeps its hint and comes back, until it completes. Asserted: the behaviour.
    The timing figures (each hint against the moment its budget next had a room, the budgets' busy fraction) are
    printed; ``k3serve bench router-load --json`` measures them after a warm-up burst (issue #19's "every hint
    within 2x" is reported there, not asserted: it is a figure of the host)."""
    from benchmarks.router_load import TOKEN_BUDGET, LoadSetup, run_load

    setup = LoadSetup(streams=200, warmup_streams=0)
    out = run_load(deployment, setup)
    fig = out.figures()
    print("\nload:", json.dumps(fig))
    bad = [r for r in out.results if not (r.status == "ok" and r.tokens == setup.max_tokens
                                          and r.finish_reason == "length")]
    assert not bad, bad[:3]  # every stream completed, after however many refusals
    # the service really was oversubscribed, at both limits: the routers' stream limit and the admission budget
    assert 0 < fig["refused_at_router_stream_limit"] < fig["refusals"], fig
    # budgets never exceeded (sampled from Redis)
    assert len(out.monitor.samples) > 100, fig
    assert fig["max_in_flight_per_cluster"] <= setup.max_concurrent, fig
    assert fig["max_in_flight_tokens_per_cluster"] <= TOKEN_BUDGET
    assert not out.monitor.probe_failures, out.monitor.probe_failures[:3]  # health and status answered throughout


def test_after_a_burst_of_clients_that_never_return_new_requests_are_admitted(deployment):
    """Issue 49, as a client saw it: the short class at 2 per cluster with a queue of 4, two routers of 8 streams,
    120 streams at once whose refused clients never come back; then new requests, one at a time and six together,
    are all admitted (the rooms are free: a refusal then would leave capacity idle behind it)."""
    import uuid

    from benchmarks.router_load import LoadSetup, _classes, start_router
    from tests.router.test_refused_clients_gone import burst_of_absent_clients, errors_of_concurrent

    ns = "gone" + uuid.uuid4().hex[:8]
    routers = [start_router(deployment, ns, _classes(LoadSetup(max_concurrent=2, queue=4)), 8) for _ in range(2)]
    try:
        stubs = [_stub(addr) for _, _, addr in routers]
        served, refused = burst_of_absent_clients(stubs, 120, max_tokens=8)
        assert served + refused == 120 and refused > 60, (served, refused)
        sp = pb.SamplingParams(max_tokens=4, ignore_eos=True)
        for i in range(6):
            _, last = _collect(stubs[i % 2], pb.GenerateRequest(session_id=f"after-{i}", prompt_text=f"after {i}",
                                                                 sampling=sp))
            assert last.finish_reason == "length"
        calls = [lambda i=i: _collect(stubs[i % 2], pb.GenerateRequest(session_id=f"together-{i}",
                                                                        prompt_text=f"t {i}", sampling=sp))
                 for i in range(6)]
        assert not errors_of_concurrent(calls)
    finally:
        for svc, server, _ in routers:
            server.stop(0)
            svc.close()


def test_the_bench_path_reads_router_processes(deployment):
    """``k3serve bench router-load``'s path: a burst against the deployment's own router processes, their counters
    and learned durations read over Ray (here the deployment's default classes admit all 8 streams at once)."""
    from benchmarks.router_load import LoadSetup, run_load_on_router_processes

    out = run_load_on_router_processes(deployment, LoadSetup(streams=8, warmup_streams=0, max_concurrent=32))
    fig = out.figures()
    assert fig["completed"] == 8 and fig["refusals"] == 0, fig
    assert fig["probes"] > 0 and fig["probe_failures"] == 0 and fig["monitor_samples"] > 0, fig
    assert fig["learned_durations"]["after_burst"].startswith("ttft "), fig
