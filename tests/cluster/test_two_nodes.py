"""Two Ray nodes on this machine: prefill on one node, decode on the other, over both transfer planes; then
``k3serve drill --kill node:k3_node_b`` loses the decode node mid-run.

The deployment (tiny-trained, TP 1 -> 1, one router) places c0 (gRPC plane) and c1 (Mooncake plane) with
prefill on the head node and decode on the worker node; c2 lives on the head only. Killing the worker node
(its raylet and every worker under it) takes c0 and c1 down; their sessions fail over to c2, and every token
served before and after equals the single-process reference. The drill runs as the CLI does, in its own
process (its own Ray driver), against the private two-node cluster of tests/cluster/ray_nodes.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster.ray_nodes import TwoNodeRay

pytestmark = pytest.mark.usefixtures("mooncake_plane")  # tests/conftest.py: skip, or an error

SESSIONS, TURNS = 9, 3

DEPLOY = """
model: {preset: tiny-trained}
clusters:
  count: 3
  prefill_tp: 1
  decode_tp: 1
  prefill_pools: {kda_slots: 16, mla_pages: 256, page_size: 64}
  decode_pools: {kda_slots: 16, mla_pages: 256, page_size: 64}
  max_decode_batch: 16
  mooncake: {protocol: tcp, metadata: P2PHANDSHAKE, staging_mib: 16, send_mib: 8}
  rebuild_backoff_s: 5.0
  placement:
    - {clusters: [c0], front: {k3_node_a: 1}, prefill: {k3_node_a: 1}, decode: {k3_node_b: 1}}
    - {clusters: [c1], front: {k3_node_a: 1}, prefill: {k3_node_a: 1}, decode: {k3_node_b: 1}, transfer: mooncake}
    - {clusters: [c2], front: {k3_node_a: 1}, prefill: {k3_node_a: 1}, decode: {k3_node_a: 1}}
router_resources: {k3_node_a: 1}
routers: 1
control: {heartbeat_ttl_s: 3.0, heartbeat_interval_s: 0.5}
torch_threads: 1
"""


def _seed_touching_every_cluster() -> int:
    """A workload seed whose sessions have every cluster as the primary of at least two of them."""
    from collections import Counter

    from k3serve.cluster.drill import session_names
    from k3serve.router.hashing import rank_clusters, session_key

    for seed in range(1000):
        primaries = Counter(rank_clusters(session_key(n, []), ["c0", "c1", "c2"])[0]
                            for n in session_names(SESSIONS, seed))
        if min(primaries.get(c, 0) for c in ("c0", "c1", "c2")) >= 2:
            return seed
    raise AssertionError("no seed spreads the sessions over every cluster")


@pytest.fixture
def two_nodes():
    nodes = TwoNodeRay()
    nodes.start()
    try:
        yield nodes
    finally:
        nodes.stop()


def test_node_kill_drill_across_two_nodes_on_both_planes(two_nodes, tmp_path):
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text(DEPLOY)
    cmd = [str(Path(sys.executable).with_name("k3serve")), "drill", "--config", str(deploy),
           "--kill", f"node:{two_nodes.worker_resource}", "--at", "0", "--after-turns", "1",
           "--sessions", str(SESSIONS), "--turns", str(TURNS), "--max-tokens", "8",
           "--seed", str(_seed_touching_every_cluster()), "--no-samples", "--json"]
    env = {**os.environ, **two_nodes.env, "OMP_NUM_THREADS": "1"}  # the reference check runs in the CLI
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=420)
    assert proc.stdout.strip(), f"no report (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    out = json.loads(proc.stdout)
    where = out["cluster_nodes"]
    for cid in ("c0", "c1"):  # prefill on the head, decode on the worker node: the state crossed nodes
        assert where[cid]["prefill"][0] != where[cid]["decode"][0], where
        assert out["completed_before_fault_by_cluster"].get(cid, 0) > 0, out  # served (= reference) there
    assert where["c2"]["prefill"][0] == where["c2"]["decode"][0] == where["c0"]["prefill"][0]
    assert out["lost_node"] == where["c0"]["decode"][0]
    assert out["lost_node_clusters"] == ["c0", "c1"]
    assert out["failed"] == 0 and out["mismatches"] == 0, out
    assert out["failed_cluster_sessions"] > 0 and out["survivor_sessions"]["c2"] > 0, out
    assert proc.returncode == 0, proc.stderr[-4000:]
