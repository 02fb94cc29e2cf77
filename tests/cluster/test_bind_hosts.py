"""With ``transfer: mooncake`` and ``bind_host: 127.0.0.1``, every socket of the deployment listens on loopback,
checked from its processes' own sockets (issue 44, item 2): k3serve's servers, the private redis-server and the
local Ray's GCS, raylet, agents and workers. The one exception: the Mooncake engine's two sockets per rank (it
binds every interface whatever its host: opted in with ``clusters.mooncake.listen_any``)."""

from __future__ import annotations

import dataclasses
import ipaddress
import sys

import pytest

from k3serve.cluster.deploy import load_deploy
from k3serve.transfer.mooncake.plane import mooncake_available

pytestmark = pytest.mark.skipif(bool(mooncake_available()), reason=mooncake_available() or "available")


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


def test_no_k3serve_socket_leaves_loopback_with_the_mooncake_plane():
    from k3serve.cluster.deployment import Deployment

    import psutil  # Ray's copy (ray/thirdparty_files, on the path once ray is imported)

    base = load_deploy("configs/mooncake.yaml")
    clusters = dataclasses.replace(base.clusters, count=1, rebuild=False,
                                   mooncake=dataclasses.replace(base.clusters.mooncake, staging_mib=16, send_mib=8))
    dep = Deployment(dataclasses.replace(base, clusters=clusters, routers=1)).start()
    try:
        socks = _listeners(psutil)
    finally:
        dep.stop()
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
    assert len(ranks) == clusters.prefill_tp + clusters.decode_tp
    for pid in ranks:  # the engine's handshake (0.0.0.0) and data (::) sockets
        assert sorted(wide.pop(pid, [])) == ["0.0.0.0", "::"], names[pid]
    assert {names[pid]: ips for pid, ips in wide.items()} == {}  # nothing else: not Ray's, not ours
    assert {"raylet", "redis-server", "ray::ClusterActor", "ray::RouterActor"} <= set(names.values())


def _is_loopback(ip: str) -> bool:
    a = ipaddress.ip_address(ip)
    mapped = getattr(a, "ipv4_mapped", None)  # a dual-stack socket bound to 127.0.0.1 shows ::ffff:127.0.0.1
    return (mapped or a).is_loopback
