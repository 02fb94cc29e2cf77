"""The service with ``clusters.transfer: mooncake`` (configs/mooncake.yaml, 2 clusters, 1 router), one deployment:

- With ``bind_host: 127.0.0.1`` every socket of the deployment listens on loopback, checked from its processes'
  own sockets (issue 44, item 2): k3serve's servers, the private redis-server, the local Ray's GCS, raylet,
  agents and workers, and each rank's Mooncake engine (kept on its host by transfer/mooncake/listeners.py).
- A cluster-kill drill: every cluster's state moves over the Mooncake plane (gRPC control, engine payload into
  registered staging); killing a whole cluster mid-run fails its sessions over with no failed request and every
  token equal to the single-process reference. (Bringing the cluster back is plane-independent and drilled in
  test_failover_drills.py; it is off here to keep this cheap.)
"""

from __future__ import annotations

import dataclasses
import ipaddress
import sys

import pytest

from k3serve.cluster.deploy import load_deploy
from tests.cluster.live_clients import kill_c0_drill

pytestmark = pytest.mark.usefixtures("mooncake_plane")  # tests/conftest.py: skip, or an error


@pytest.fixture(scope="module")
def mooncake_deployment(mooncake_plane):
    from k3serve.cluster.deployment import Deployment

    base = load_deploy("configs/mooncake.yaml")
    assert base.clusters.transfer == "mooncake" and not base.clusters.mooncake.listen_any
    clusters = dataclasses.replace(base.clusters, count=2, max_decode_batch=16, rebuild=False,
                                   mooncake=dataclasses.replace(base.clusters.mooncake, staging_mib=16, send_mib=8))
    dep = Deployment(dataclasses.replace(base, clusters=clusters, routers=1)).start()
    yield dep
    dep.stop()


def _listeners(psutil) -> list[tuple[int, str, str, int]]:
    """(pid, process name, ip, port) of every listening TCP socket of this process and all below it."""
    me = psutil.Process()
    out = []
    for p in [me, *me.children(recursive=True)]:
        try:
            name = p.name()
            out += [(p.pid, name, c.laddr.ip, c.laddr.port) for c in p.net_connections(kind="inet")
                    if c.status == psutil.CONN_LISTEN]
        except psutil.Error:  # a process that ended meanwhile
            pass
    return out


def test_no_k3serve_socket_leaves_loopback_with_the_mooncake_plane(mooncake_deployment):
    import psutil  # Ray's copy (ray/thirdparty_files, on the path once ray is imported)

    dep = mooncake_deployment
    socks = _listeners(psutil)
    for pid, name, ip, port in sorted(socks, key=lambda s: (s[1], s[2])):  # the report's table
        print(f"{name:24} {pid:7} {ip}:{port}", file=sys.stderr)
    loopback = {port for _, _, ip, port in socks if _is_loopback(ip)}
    for addr in [*dep.router_addresses, *dep.cluster_endpoints.values()]:
        host, port = addr.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) in loopback, addr
    wide: dict[int, list[str]] = {}
    for pid, name, ip, _ in socks:
        if not _is_loopback(ip):
            wide.setdefault(pid, []).append(ip)
    names = {pid: name for pid, name, _, _ in socks}
    ranks = [pid for pid, n in names.items() if n == "ray::RankActor"]
    c = dep.deploy.clusters
    assert len(ranks) == c.count * (c.prefill_tp + c.decode_tp)  # every rank (each runs an engine) was seen
    assert {names[pid]: ips for pid, ips in wide.items()} == {}  # nothing: not the engines, not Ray's, not ours
    assert {"raylet", "redis-server", "ray::ClusterActor", "ray::RouterActor"} <= set(names.values())


def _is_loopback(ip: str) -> bool:
    a = ipaddress.ip_address(ip)
    mapped = getattr(a, "ipv4_mapped", None)  # a dual-stack socket bound to 127.0.0.1 shows ::ffff:127.0.0.1
    return (mapped or a).is_loopback


def test_cluster_kill_drill_on_the_mooncake_plane(mooncake_deployment):
    out = kill_c0_drill(mooncake_deployment)
    assert out["failed"] == 0 and out["mismatches"] == 0, out
    assert out["completed_before_fault_by_cluster"].get("c0", 0) > 0, out  # c0 served over Mooncake first
    assert out["failed_cluster_sessions"] > 0 and out["survivor_sessions"]["c1"] > 0, out
