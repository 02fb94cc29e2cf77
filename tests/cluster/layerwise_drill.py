"""Manual check (not collected by pytest; 50-120 s here): the service with `clusters.layerwise_export: true`.

    .venv/bin/python tests/cluster/layerwise_drill.py

configs/local.yaml (tiny-trained, prefill TP 2 -> decode TP 1, gRPC plane) with 2 clusters and layer-wise
export on: every prompt's last chunk runs as PrefillStreamed in the Ray rank actors; a cluster-kill drill then
fails c0's sessions over. Exits non-zero unless 0 failed and 0 mismatches (every token equal to the reference).
The same path is checked in the suite below the service (tests/transfer/test_layerwise_prefill.py).
"""

from __future__ import annotations

import json
import sys

from k3serve.cluster.deploy import load_deploy
from live_clients import two_cluster_kill_drill  # run as a script: its folder, tests/cluster, is on sys.path


def main() -> int:
    out = two_cluster_kill_drill(load_deploy("configs/local.yaml"), transfer="grpc", layerwise_export=True)
    keys = ("failed", "mismatches", "completed_before_fault_by_cluster", "failed_cluster_sessions",
            "survivor_sessions")
    print(json.dumps({k: out.get(k) for k in keys}))
    return 0 if out["failed"] == 0 and out["mismatches"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
