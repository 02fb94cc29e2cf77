"""A cluster-kill drill with ``clusters.transfer: mooncake``: every cluster's state moves over the Mooncake
plane (gRPC control, engine payload into registered staging); killing a whole cluster mid-run fails its
sessions over with no failed request and every token equal to the single-process reference. (Bringing the
cluster back is plane-independent and drilled in test_failover_drills.py; it is off here to keep this cheap.)"""

from __future__ import annotations

import pytest
from live_clients import two_cluster_kill_drill

from k3serve.cluster.deploy import MooncakeSpec, load_deploy

pytestmark = pytest.mark.usefixtures("mooncake_plane")  # tests/conftest.py: skip, or an error


def test_cluster_kill_drill_on_the_mooncake_plane():
    base = load_deploy("configs/mooncake.yaml")
    assert base.clusters.transfer == "mooncake"
    out = two_cluster_kill_drill(base, mooncake=MooncakeSpec(staging_mib=16, send_mib=8, listen_any=True))
    assert out["failed"] == 0 and out["mismatches"] == 0, out
    assert out["completed_before_fault_by_cluster"].get("c0", 0) > 0, out  # c0 served over Mooncake first
    assert out["failed_cluster_sessions"] > 0 and out["survivor_sessions"]["c1"] > 0, out
