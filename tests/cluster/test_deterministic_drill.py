"""Numerics mode deterministic through the service: a cluster killed mid-stream, its sessions resumed on the
survivors by replaying the streamed tokens through decode; every output equals the deterministic
reference's tokens exactly (the drill compares with no tolerance)."""

from __future__ import annotations

import dataclasses

import pytest

from k3serve.cluster.deploy import load_deploy
from k3serve.cluster.drill import Fault, run_drill
from k3serve.contracts.numerics import DETERMINISTIC

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def det_deployment():
    from k3serve.cluster.deployment import Deployment

    base = load_deploy("configs/local.yaml")
    # two clusters: c0 killed, its sessions resume on c1; no rebuild: the drill checks the resume, not the rejoin
    # (test_failover_drills.py covers that), so it does not wait for one
    deploy = dataclasses.replace(base, numerics=DETERMINISTIC,
                                 clusters=dataclasses.replace(base.clusters, count=2, rebuild=False))
    dep = Deployment(deploy).start()
    yield dep
    dep.stop()


def test_failover_resume_mid_stream_is_exact(det_deployment):
    out = run_drill(det_deployment, Fault("cluster", "c0"), at_s=3.0, sessions=12, turns=2, max_tokens=16, seed=4)
    assert out["failed"] == 0 and out["mismatches"] == 0, out
    assert out["in_flight_at_fault"] > 0 and out["failed_over"] > 0, out
