"""``k3serve status``: clusters, health, load and pins of a running deployment, as a table or JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

app = typer.Typer(help="Show clusters, health, load and pins.", invoke_without_command=True, no_args_is_help=False)


@app.callback()
def status(router: str = typer.Option("", "--router", help="a router address host:port"),
           endpoints_file: str = typer.Option("", "--endpoints-file", help="the file `k3serve serve` wrote"),
           redis_url: str = typer.Option("", "--redis-url", envvar="REDIS_URL", help="count pins in this Redis"),
           namespace: str = typer.Option("k3serve", "--namespace"),
           api_key: str = typer.Option("", "--api-key", envvar="K3SERVE_API_KEY",
                                       help="a key of the deployment's api_keys (when it has any)"),
           as_json: bool = typer.Option(False, "--json")) -> None:
    import grpc

    from k3serve.v1 import router_pb2, router_pb2_grpc

    if endpoints_file:
        info = json.loads(Path(endpoints_file).read_text())
        router = router or info["routers"][0]
        written = info.get("redis", "")  # its password redacted: then the router's own pin count is shown
        redis_url = redis_url or ("" if ":***@" in written else written)
    if not router:
        typer.echo("error: give --router or --endpoints-file", err=True)
        raise typer.Exit(2)
    try:
        resp = router_pb2_grpc.RouterStub(grpc.insecure_channel(router)).ClusterStatus(
            router_pb2.ClusterStatusRequest(), timeout=10,
            metadata=(("authorization", f"Bearer {api_key}"),) if api_key else None)
    except grpc.RpcError as e:
        typer.echo(f"error: router {router}: {e.code().name}: {e.details()}", err=True)
        raise typer.Exit(1)
    rows = [{"cluster": c.cluster_id, "healthy": c.healthy, "suspect": c.suspect,
             "running": c.running_requests, "inflight_tokens": c.inflight_tokens,
             "pinned_sessions": c.pinned_sessions, "prefill_tp": c.prefill_tp, "decode_tp": c.decode_tp,
             "pools": {p.name: {"used": p.used, "capacity": p.capacity} for p in c.pools}}
            for c in resp.clusters]
    pins = resp.pinned_sessions  # counted by the router in Redis
    if redis_url:
        from k3serve.cluster.redis_server import connect
        from k3serve.router.membership import key_prefix

        client = connect(redis_url)
        pins = sum(1 for _ in client.scan_iter(match=f"{key_prefix(namespace)}pin:*", count=1000))
    classes = [{"class": c.name, "inflight_tokens": c.inflight_tokens, "inflight_requests": c.inflight_requests,
                "queued": c.queued, "rejected": c.rejected} for c in resp.classes]
    out = {"router": router, "membership_stale": resp.membership_stale, "clusters": rows, "classes": classes,
           "pinned_sessions": pins}
    if as_json:
        json.dump(out, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"k3serve @ {router}" + (" (membership stale: Redis unreachable)" if resp.membership_stale else ""))
    for col in ("cluster", "health", "running", "in-flight tokens", "pinned", "TP (P/D)"):
        table.add_column(col)
    for r in rows:
        health = "suspect" if r["suspect"] else ("healthy" if r["healthy"] else "dead")
        table.add_row(r["cluster"], health, str(r["running"]), str(r["inflight_tokens"]),
                      str(r["pinned_sessions"]), f"{r['prefill_tp']}/{r['decode_tp']}")
    Console().print(table)
    pt = Table(title="pools (used / capacity)")
    names = sorted({n for r in rows for n in r["pools"]})
    for col in ("cluster", *names):
        pt.add_column(col)
    for r in rows:
        pt.add_row(r["cluster"], *(_usage(r["pools"].get(n)) for n in names))
    if names:
        Console().print(pt)
    if classes:
        ct = Table(title="request classes (admission)")
        for col in ("class", "in-flight tokens", "in-flight requests", "queued", "rejected here"):
            ct.add_column(col)
        for c in classes:
            ct.add_row(c["class"], str(c["inflight_tokens"]), str(c["inflight_requests"]), str(c["queued"]),
                       str(c["rejected"]))
        Console().print(ct)
    if pins is not None:
        Console().print(f"pinned sessions: {pins}")


def _usage(u: dict | None) -> str:
    if u is None:
        return "-"
    return f"{u['used']}/{u['capacity']}" if u["capacity"] else str(u["used"])
