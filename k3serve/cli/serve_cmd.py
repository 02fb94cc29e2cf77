"""``k3serve serve``: run a deployment until SIGINT/SIGTERM (drain, then stop)."""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path

import typer

app = typer.Typer(help="Run the cluster service: clusters on Ray, routers, Redis control plane.",
                  invoke_without_command=True, no_args_is_help=False)


@app.callback()
def serve(config: str = typer.Option("configs/local.yaml", "--config", help="deploy.yaml"),
          endpoints_file: str = typer.Option("", "--endpoints-file", help="write router addresses here (JSON)"),
          duration_s: float = typer.Option(0.0, "--duration-s", help="stop after this long (0: until signalled)")) -> None:
    from k3serve.cluster.deploy import DeployError, load_deploy
    from k3serve.cluster.deployment import Deployment

    try:
        deploy = load_deploy(config)
    except DeployError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    dep = Deployment(deploy).start()
    try:
        info = {"routers": dep.router_addresses, "clusters": dep.cluster_endpoints, "redis": dep.redis_url,
                "checkpoint": dep.checkpoint}
        typer.echo(f"k3serve: router listening on {', '.join(dep.router_addresses)}")
        typer.echo(json.dumps(info))
        if endpoints_file:
            Path(endpoints_file).write_text(json.dumps(info))
        stop.wait(duration_s or None)
        typer.echo("k3serve: draining and stopping")
    finally:
        dep.stop()
