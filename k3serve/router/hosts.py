"""Which clusters share a host: their budgets' holds slow each other there (admission's host-saturated pace,
router/admission_lua.py RELEASE and HOLDERS).

Two clusters are co-located when any of their registered endpoints (``host:port``, membership.py) name the same
host. Clusters on one machine share its cores (and on a GPU node its PCIe and NICs): while all of them are kept
busy, each one's requests run slower than while it is busy alone. A cluster whose prefill and decode workers sit
on other nodes than its front is placed by its front's host.
"""

from __future__ import annotations

from collections.abc import Callable

from k3serve.router.membership import ClusterInfo, MembershipSnapshot, MembershipView


def endpoint_hosts(info: ClusterInfo) -> set[str]:
    """The hosts of a cluster's endpoints (``host:port`` -> host; an IPv6 ``[addr]:port`` keeps its brackets)."""
    return {ep.rsplit(":", 1)[0] for ep in info.endpoints.values() if ":" in ep}


def co_located_clusters(snapshot: MembershipSnapshot, cluster_id: str) -> tuple[str, ...]:
    """The other alive clusters of ``snapshot`` on a host of ``cluster_id``'s, sorted; () when it is unknown."""
    me = snapshot.get(cluster_id)
    if me is None:
        return ()
    hosts = endpoint_hosts(me)
    return tuple(sorted(c.id for c in snapshot.clusters
                        if c.alive and c.id != cluster_id and hosts & endpoint_hosts(c)))


def co_located(view: MembershipView) -> Callable[[str], tuple[str, ...]]:
    """``cluster -> the clusters sharing its host`` over the router's cached membership (AdmissionGate's
    ``co_located``; called on every refusal and release, so it never waits on a membership read that the
    background reader will make anyway)."""
    return lambda cluster_id: co_located_clusters(view.request_snapshot(), cluster_id)
