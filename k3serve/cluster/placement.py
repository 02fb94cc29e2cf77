"""Node placement of a deployment's parts: which Ray nodes a cluster's front, prefill and decode groups land on.

Placement goes through Ray custom resources: each node is started with its own resource
(``ray start --resources '{"k3_node_a": 100}'``) and the deploy file says which resource each part needs::

    clusters:
      count: 3
      placement:                       # optional; a cluster in no entry goes wherever Ray puts it (one node)
        - {clusters: [c0], front: {k3_node_a: 1}, prefill: {k3_node_a: 1}, decode: {k3_node_b: 1}}
        - {clusters: [c1], front: {k3_node_a: 1}, prefill: {k3_node_a: 1}, decode: {k3_node_b: 1},
           transfer: mooncake}         # this entry's clusters move state over another plane
    router_resources: {k3_node_a: 1}   # where the routers run

``front`` places the ClusterActor (the front and both engines' drivers), ``prefill`` / ``decode`` are needed
by *each rank* of that group (a bundle of the cluster's placement group). Without placement a cluster's ranks
are packed on one node (STRICT_PACK); with it the bundles are packed as far as their resources allow (PACK),
so a group whose resource only one node has lands on that node. ``transfer`` (optional) overrides
``clusters.transfer`` for the entry's clusters (e.g. Mooncake where the nodes have RDMA NICs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Ray CPUs each actor of a deployment asks for: almost none, so that Ray's CPU count never limits how many ranks,
# fronts and routers share a node (their threads are capped by torch_threads instead)
ACTOR_CPU = 0.01

Resources = tuple[tuple[str, float], ...]  # (resource name, amount) pairs, sorted: hashable, one order


def parse_resources(raw: Any, where: str) -> Resources:
    """A mapping resource name -> amount from the deploy file; raises ValueError naming `where`."""
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        raise ValueError(f"{where} must be a mapping of Ray resource name to amount, got {raw!r}")
    out = []
    for name, amount in raw.items():
        if not isinstance(name, str) or not name or name in ("CPU", "GPU", "memory", "object_store_memory"):
            raise ValueError(f"{where}: {name!r} is not a custom resource name (CPU/GPU are k3serve's own)")
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not amount > 0:
            raise ValueError(f"{where}.{name} must be a number > 0, got {amount!r}")
        out.append((name, float(amount)))
    return tuple(sorted(out))


@dataclass(frozen=True)
class PlacementSpec:
    """One ``clusters.placement`` entry: the clusters it covers and the resources each of their parts needs."""

    clusters: tuple[str, ...] = ()
    front: Resources = ()
    prefill: Resources = ()  # per prefill rank
    decode: Resources = ()  # per decode rank
    transfer: str = ""  # "": clusters.transfer

    @property
    def placed(self) -> bool:
        return bool(self.front or self.prefill or self.decode)

    def bundles(self, cpu: float, prefill_tp: int, decode_tp: int) -> list[dict[str, float]]:
        """The cluster's placement-group bundles: prefill ranks 0..P-1, then decode ranks 0..D-1."""
        return ([{"CPU": cpu, **dict(self.prefill)} for _ in range(prefill_tp)]
                + [{"CPU": cpu, **dict(self.decode)} for _ in range(decode_tp)])

    @property
    def strategy(self) -> str:
        # STRICT_PACK would refuse bundles that need different nodes' resources
        return "PACK" if self.prefill or self.decode else "STRICT_PACK"


NO_PLACEMENT = PlacementSpec()
