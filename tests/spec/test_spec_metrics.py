"""The acceptance rate reaches Prometheus from the pools a cluster heartbeats (decode.spec_accepted)."""

from dataclasses import dataclass, field

from k3serve.router.metrics import _ClusterCollector


@dataclass
class _Pool:
    name: str
    used: int
    capacity: int


@dataclass
class _Info:
    cluster_id: str
    running_requests: int = 0
    inflight_tokens: int = 0
    pinned_sessions: int = 0
    pools: list = field(default_factory=list)


def test_acceptance_rate_gauge_per_cluster():
    infos = [_Info("c0", pools=[_Pool("decode.spec_accepted", 30, 40)]), _Info("c1", pools=[])]
    families = {f.name: f for f in _ClusterCollector(lambda: infos).collect()}
    samples = families["k3serve_cluster_spec_acceptance_rate"].samples
    assert [(s.labels["cluster"], s.value) for s in samples] == [("c0", 0.75)]  # c1 does not speculate
