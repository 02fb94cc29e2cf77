"""Failover drills on a 4-cluster deployment: kill a whole cluster, then a decode rank, then a prefill rank.

Each drill runs a multi-turn workload (greedy and seeded sessions) through both routers and checks: no failed
request, no token mismatch against the single-process reference, and (cluster kill) the failed cluster's
sessions spread over the survivors.
"""

from __future__ import annotations

import dataclasses

import pytest

from k3serve.cluster.deploy import load_deploy
from k3serve.cluster.drill import Fault, run_drill


@pytest.fixture(scope="module")
def four_clusters():
    from k3serve.cluster.deployment import Deployment

    base = load_deploy("configs/local.yaml")
    dep = Deployment(dataclasses.replace(base, clusters=dataclasses.replace(base.clusters, count=4))).start()
    yield dep
    dep.stop()


def test_kill_cluster(four_clusters):
    out = run_drill(four_clusters, Fault("cluster", "c0"), at_s=3.0, sessions=24, turns=2, max_tokens=16, seed=1)
    assert out["failed"] == 0 and out["mismatches"] == 0
    assert out["in_flight_at_fault"] > 0 and out["failed_over"] > 0 and out["failed_cluster_sessions"] > 0
    assert all(n > 0 for n in out["survivor_sessions"].values())  # spread over every survivor
    assert out["max_survivor_share_over_fair"] <= 1.5


def _busiest(dep, names: list[str]) -> str:
    """The alive cluster that is primary for most of these sessions: the fault must hit traffic."""
    from collections import Counter

    from k3serve.cluster.redis_server import connect
    from k3serve.router.hashing import rank_clusters, session_key
    from k3serve.router.membership import Membership

    alive = [c.id for c in Membership(connect(dep.redis_url), dep.deploy.control.namespace).healthy_clusters()]
    return Counter(rank_clusters(session_key(n, []), alive)[0] for n in names).most_common(1)[0][0]


@pytest.mark.parametrize("kind,seed", [("decode", 2), ("prefill", 3)])
def test_kill_one_rank(four_clusters, kind, seed):
    from k3serve.cluster.drill import session_names

    target = _busiest(four_clusters, session_names(12, seed))
    out = run_drill(four_clusters, Fault(kind, target), at_s=3.0, sessions=12, turns=2, max_tokens=16, seed=seed)
    assert out["failed"] == 0 and out["mismatches"] == 0
    assert out["in_flight_at_fault"] > 0 and out["failed_over"] > 0


def _healthy(dep) -> list[str]:
    from k3serve.cluster.redis_server import connect
    from k3serve.router.membership import Membership

    return [c.id for c in Membership(connect(dep.redis_url), dep.deploy.control.namespace).healthy_clusters()]


def _primary_session(prefix: str, target: str, alive: list[str]) -> str:
    from k3serve.router.hashing import rank_clusters, session_key

    return next(n for n in (f"{prefix}-{i}" for i in range(1000))
                if rank_clusters(session_key(n, []), alive)[0] == target)


def test_cluster_whose_rank_died_while_idle_is_rebuilt_and_serves_again(four_clusters):
    """A decode rank killed with no traffic: the agent notices, fails the cluster out, rebuilds it in place."""
    import time

    import grpc
    import ray
    import torch

    from k3serve.engine.sampling import SamplingParams
    from k3serve.model.loader import load_model
    from k3serve.model.reference import reference_generate
    from k3serve.v1 import router_pb2 as pb
    from k3serve.v1 import router_pb2_grpc

    dep = four_clusters
    alive = _healthy(dep)
    target = alive[-1]
    before = ray.get(dep.clusters[target].stats.remote())["rebuilds"]
    dep.kill_rank(target, "decode")

    deadline, saw_it_leave = time.monotonic() + 120, False
    while True:  # out of the membership, then back with a new front
        stats, healthy = ray.get(dep.clusters[target].stats.remote()), _healthy(dep)
        saw_it_leave |= target not in healthy
        if stats["rebuilds"] > before and not stats["broken"] and target in healthy:
            break
        assert time.monotonic() < deadline, f"{target} not rebuilt: {stats}"
        time.sleep(0.5)
    assert saw_it_leave

    model = load_model(dep.checkpoint)
    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(dep.router_addresses[0]))
    session = _primary_session("rebuilt", target, _healthy(dep))
    prompt = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(11)).tolist()
    msgs = list(stub.Generate(pb.GenerateRequest(session_id=session, prompt_token_ids=prompt,
                                                 sampling=pb.SamplingParams(max_tokens=8, ignore_eos=True)),
                              timeout=120))
    assert msgs[-1].usage.cluster_id == target  # a new session lands on the rebuilt cluster
    assert [t for m in msgs for t in m.token_ids] == reference_generate(
        model, prompt, SamplingParams(max_tokens=8, ignore_eos=True)).token_ids
