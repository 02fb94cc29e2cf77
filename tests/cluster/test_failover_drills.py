"""Failover drills on the shared deployment (tests/cluster/conftest.py: 3 clusters, 2 routers): kill a whole
cluster, then a decode rank, then a prefill rank.

Each drill runs a multi-turn workload (greedy and seeded sessions) through both routers and checks: no failed
request, no token mismatch against the single-process reference, and (cluster kill) the failed cluster's
sessions spread over the survivors; four of its sessions run under a test mutation, and the drill's check must
find every one of their requests not exact. Then recovery: the killed cluster actor is replaced by the deployment's
supervisor, and a cluster whose rank died while idle is rebuilt in place; each then serves new sessions.
"""

from __future__ import annotations

import pytest

from k3serve.cluster.drill import Fault, run_drill

# faults on the shared deployment: after its other users, before test_service_e2e's last faults (tests/conftest.py)
SHARED_DEPLOYMENT_FAULTS = True

# gRPC sessions (i % 4 != 3) served with a wrong token: the drill must count each of their requests as not exact
# (the state mutations are the service family's, tests/cluster/test_mutations_live.py: on these prompts of ~250
# tokens a zeroed first MLA page need not move one of 16 tokens)
MUTATED = {1: "wrong_token", 2: "wrong_token", 5: "wrong_token", 6: "wrong_token"}


def test_kill_cluster(deployment):
    out = run_drill(deployment, Fault("cluster", "c0"), at_s=3.0, sessions=24, turns=2, max_tokens=16, seed=1,
                    mutate=MUTATED)
    assert out["failed"] == 0 and out["mismatches"] == 0
    assert out["mutated"] == 2 * len(MUTATED) and out["mutations_missed"] == 0  # the drill's check can fail
    assert out["in_flight_at_fault"] > 0 and out["failed_over"] > 0 and out["failed_cluster_sessions"] > 0
    assert all(n > 0 for n in out["survivor_sessions"].values())  # spread over every survivor
    assert out["max_survivor_share_over_fair"] <= 1.5
    assert out["rejoined_s"] is not None  # the deployment's supervisor brought c0 back


def _busiest(dep, names: list[str]) -> str:
    """The alive cluster that is primary for most of these sessions: the fault must hit traffic."""
    from collections import Counter

    from k3serve.cluster.redis_server import connect
    from k3serve.router.hashing import rank_clusters, session_key
    from k3serve.router.membership import Membership

    members = Membership(connect(dep.redis_url), dep.deploy.control.namespace, dep.deploy.secret)
    alive = [c.id for c in members.healthy_clusters()]
    return Counter(rank_clusters(session_key(n, []), alive)[0] for n in names).most_common(1)[0][0]


@pytest.mark.parametrize("kind,seed", [("decode", 2), ("prefill", 3)])
def test_kill_one_rank(deployment, kind, seed):
    from k3serve.cluster.drill import session_names

    target = _busiest(deployment, session_names(12, seed))
    out = run_drill(deployment, Fault(kind, target), at_s=3.0, sessions=12, turns=2, max_tokens=16, seed=seed)
    assert out["failed"] == 0 and out["mismatches"] == 0
    assert out["in_flight_at_fault"] > 0 and out["failed_over"] > 0
    assert out["rejoined_s"] is not None  # rebuilt in place by its own agent


def _healthy(dep) -> list[str]:
    from k3serve.cluster.redis_server import connect
    from k3serve.router.membership import Membership

    members = Membership(connect(dep.redis_url), dep.deploy.control.namespace, dep.deploy.secret)
    return [c.id for c in members.healthy_clusters()]


def _primary_session(prefix: str, target: str, alive: list[str]) -> str:
    from k3serve.router.hashing import rank_clusters, session_key

    return next(n for n in (f"{prefix}-{i}" for i in range(1000))
                if rank_clusters(session_key(n, []), alive)[0] == target)


def _wait_until(cond, timeout_s: float, what: str) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.5)


def _new_session_served_exactly_on(dep, target: str, prefix: str) -> None:
    """A new session whose HRW primary is `target` lands there and gets the reference tokens."""
    import grpc
    import torch

    from k3serve.contracts.sampling import SamplingParams
    from k3serve.model.loader import load_model
    from k3serve.v1 import router_pb2 as pb
    from k3serve.v1 import router_pb2_grpc
    from tests.exactness import SEEDS, References

    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(dep.router_addresses[0]))

    def routable() -> list[str]:  # what this router hashes over (its own view: Redis + its breaker)
        return [c.cluster_id for c in stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=10).clusters
                if c.healthy]

    _wait_until(lambda: target in routable(), 30, f"the router does not route to {target}")
    session = _primary_session(prefix, target, routable())
    refs = References(load_model(dep.checkpoint))
    for seed in SEEDS:  # tests/exactness.py: 3 prompt seeds
        prompt = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(11 + 1000 * seed)).tolist()
        msgs = list(stub.Generate(pb.GenerateRequest(session_id=session, prompt_token_ids=prompt,
                                                     sampling=pb.SamplingParams(max_tokens=8, ignore_eos=True)),
                                  timeout=120))
        assert msgs[-1].usage.cluster_id == target
        refs.check(prompt, SamplingParams(max_tokens=8, ignore_eos=True), [t for m in msgs for t in m.token_ids],
                   label=f"{prefix} on {target}, seed {seed}")


def test_killed_cluster_actor_is_replaced_and_serves_again(deployment):
    """The deployment's supervisor starts a new c0 (killed by test_kill_cluster), which takes new sessions."""
    dep = deployment
    if not dep.restarts.get("c0"):  # run on its own
        dep.kill_cluster("c0")
    _wait_until(lambda: dep.restarts.get("c0", 0) >= 1 and "c0" in _healthy(dep), 120, "c0 was not replaced")
    _new_session_served_exactly_on(dep, "c0", "replaced")


def test_cluster_whose_rank_died_while_idle_is_rebuilt_and_serves_again(deployment):
    """A decode rank killed with no traffic: the agent notices, fails the cluster out, rebuilds it in place."""
    import ray

    dep = deployment
    target = _healthy(dep)[-1]
    before = ray.get(dep.clusters[target].stats.remote())["rebuilds"]
    dep.kill_rank(target, "decode")
    left: list[bool] = []

    def rebuilt() -> bool:
        stats, healthy = ray.get(dep.clusters[target].stats.remote()), _healthy(dep)
        left.append(target not in healthy)
        return stats["rebuilds"] > before and not stats["broken"] and target in healthy

    _wait_until(rebuilt, 120, f"{target} was not rebuilt")
    assert any(left)  # it was out of the membership in between
    _new_session_served_exactly_on(dep, target, "rebuilt")
