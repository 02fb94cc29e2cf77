"""Manual check (not collected by pytest; ~2 min here): a lost node's clusters rebuild once the node is back.

    .venv/bin/python tests/cluster/two_node_rejoin.py

Starts the private two-node cluster and the deployment of test_two_nodes.py in this process, kills node B
(c0 and c1 decode there), rejoins a node B with the same resource (a new node id), waits for c0 and c1 to be
rebuilt by their own agents and healthy, then runs 9 sessions and checks them against the reference.
"""

from __future__ import annotations

import os
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.cluster.ray_nodes import TwoNodeRay  # noqa: E402
from tests.cluster.test_two_nodes import DEPLOY  # noqa: E402


def main() -> int:
    nodes = TwoNodeRay().start()
    os.environ.update(nodes.env)
    try:
        import ray

        from k3serve.cluster.deploy import load_deploy
        from k3serve.cluster.deployment import Deployment
        from k3serve.cluster.drill import check_against_reference, run_workload
        from k3serve.cluster.redis_server import connect
        from k3serve.router.membership import Membership

        path = Path(nodes.temp_dir) / "deploy.yaml"
        path.write_text(DEPLOY)
        dep = Deployment(load_deploy(path)).start()
        try:
            lost = dep.kill_node(nodes.worker_resource)
            print(f"lost node {lost.node_id[:8]} (dead after {lost.dead_after_s:.1f} s): {lost.clusters}")
            members = Membership(connect(dep.redis_url), dep.deploy.control.namespace, dep.deploy.secret)
            while set(lost.clusters) & {c.id for c in members.healthy_clusters()}:
                time.sleep(0.2)
            t0 = time.monotonic()
            nodes.add_worker()
            while True:
                stats = {c: ray.get(dep.clusters[c].stats.remote(), timeout=30) for c in lost.clusters}
                healthy = {c.id for c in members.healthy_clusters()}
                if all(s["rebuilds"] >= 1 and not s["broken"] and c in healthy for c, s in stats.items()):
                    break
                if time.monotonic() - t0 > 180:
                    print(f"NOT rejoined within 180 s: {stats}")
                    return 1
                time.sleep(0.5)
            print(f"rejoined {time.monotonic() - t0:.1f} s after `ray start` of the new node B")
            records, _ = run_workload(dep, 9, 1, 8, None, 0, seed=0)
            failed = sum(bool(r.error) for r in records)
            bad = len(check_against_reference(dep.checkpoint, records, dep.deploy.numerics))
            print(f"served {dict(Counter(r.cluster_id for r in records))}, failed {failed}, mismatches {bad}")
            return 0 if failed == bad == 0 else 1
        finally:
            dep.stop()
    finally:
        nodes.stop()


if __name__ == "__main__":
    raise SystemExit(main())
