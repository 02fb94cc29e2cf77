"""Losing a whole Ray node: the ``node:`` drill kills one node's raylet and every worker process under it.

```
 driver                                     target node (any machine of the Ray cluster)
   resolve "node:NAME" -> node id             _kill_this_node task (NodeAffinity, hard, 0 CPU)
   refuse the driver's own node                 raylet = the ancestor whose comm is "raylet"
   _kill_this_node.remote() ──────────────▶     SIGKILL raylet, then every descendant of it (workers,
   wait until ray.nodes() says Alive=False        agents), then itself: nothing of the node answers any more
```
What is left on that node is what ``ray start`` started beside the raylet (its log monitor), which serves
nothing. Ray declares the node dead after its health checks fail (``RAY_health_check_period_ms`` x
``RAY_health_check_failure_threshold`` on the head: 3 s x 5 by default); only then do calls to the node's
actors fail, so that is how long in-flight requests on its clusters wait before they fail over.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

import ray

NODE_DEAD_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class LostNode:
    node_id: str
    clusters: tuple[str, ...]  # clusters with a part (front, a prefill or decode rank) on that node
    dead_after_s: float  # from the kill until Ray declared the node dead


def _alive_nodes() -> list[dict]:
    return [n for n in ray.nodes() if n.get("Alive")]


def resolve_node(spec: str) -> str:
    """The node id named by `spec`: a custom resource only one alive node has, or a node id or its prefix
    (at least 6 hex digits). Raises ValueError naming what matched; refuses the driver's own node."""
    nodes = _alive_nodes()
    by_resource = [n for n in nodes if spec in n.get("Resources", {})]
    by_id = [n for n in nodes if len(spec) >= 6 and n["NodeID"].startswith(spec)]
    found = by_resource or by_id
    if len(found) != 1:
        have = {n["NodeID"][:8]: sorted(r for r in n.get("Resources", {}) if not _builtin(r)) for n in nodes}
        raise ValueError(f"--kill node:{spec} must name exactly one alive node (by a custom resource or node "
                         f"id), matched {len(found)}; alive nodes and their custom resources: {have}")
    node_id = found[0]["NodeID"]
    if node_id == ray.get_runtime_context().get_node_id():
        raise ValueError(f"--kill node:{spec} is the driver's own node (the Ray head here): killing it ends the "
                         f"deployment, not a failover drill")
    return node_id


def _builtin(resource: str) -> bool:
    return resource in ("CPU", "GPU", "memory", "object_store_memory") or resource.startswith("node:")


def kill_node(spec: str, cluster_nodes: dict[str, dict], timeout_s: float = NODE_DEAD_TIMEOUT_S) -> LostNode:
    """Kill the node `spec` names (resolve_node) and wait until Ray declares it dead.

    cluster_nodes: Deployment.cluster_nodes() taken before the kill, to report which clusters the node held."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node_id = resolve_node(spec)
    lost = tuple(sorted(cid for cid, where in cluster_nodes.items() if node_id in _ids(where)))
    t0 = time.monotonic()
    # never answers (it kills its own process last); its failure is the node's death, not an error to raise
    _kill_this_node.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()
    while any(n["NodeID"] == node_id for n in _alive_nodes()):
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"node {node_id[:8]} still alive {timeout_s:.0f} s after the kill")
        time.sleep(0.2)
    return LostNode(node_id, lost, time.monotonic() - t0)


def _ids(where: dict) -> set[str]:
    out = set()
    for v in where.values():
        out.update(v if isinstance(v, list) else [v])
    return out


@ray.remote(num_cpus=0, max_retries=0)
def _kill_this_node() -> None:
    raylet = _raylet_ancestor(os.getpid())
    if raylet is None:
        raise RuntimeError("this worker has no raylet ancestor: cannot tell which processes are the node's")
    doomed = [p for p in _descendants(raylet) if p != os.getpid()]
    os.kill(raylet, signal.SIGKILL)  # first, so it reports nothing: the node is simply gone
    for pid in doomed:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:  # exited on its own since the scan
            pass
    os.kill(os.getpid(), signal.SIGKILL)


def _stat(pid: int) -> tuple[str, int] | None:
    """(comm, ppid) from /proc/<pid>/stat, or None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    comm = text[text.index("(") + 1: text.rindex(")")]  # comm may hold spaces and parentheses
    return comm, int(text[text.rindex(")") + 2:].split()[1])


def _raylet_ancestor(pid: int) -> int | None:
    for _ in range(8):  # worker -> (setup_worker ->) raylet
        st = _stat(pid)
        if st is None or pid <= 1:
            return None
        if st[0] == "raylet":
            return pid
        pid = st[1]
    return None


def _descendants(root: int) -> list[int]:
    parents = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None:
                parents[int(name)] = st[1]
    out, frontier = [], [root]
    while frontier:
        kids = [p for p, pp in parents.items() if pp in frontier]
        out += kids
        frontier = kids
    return out
