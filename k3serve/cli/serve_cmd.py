"""``k3serve serve``: run a deployment until SIGINT/SIGTERM (drain, then stop)."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
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
    logging.basicConfig(level=os.environ.get("K3SERVE_LOG_LEVEL", "WARNING"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    signals: list[str] = []

    def on_signal(signum, _frame) -> None:
        signals.append(signal.Signals(signum).name)
        stop.set()

    def install_handlers() -> None:
        # ray.init replaces the SIGTERM handler (with one that exits at once), so this runs again after it
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)

    install_handlers()
    dep = Deployment(deploy, on_ray_ready=install_handlers)
    try:
        dep.start()
        from k3serve.cluster.redis_server import redact_url

        info = {"routers": dep.router_addresses, "http": dep.http_addresses, "clusters": dep.cluster_endpoints,
                "redis": redact_url(dep.redis_url),
                "checkpoint": dep.checkpoint}
        typer.echo(f"k3serve: router listening on {', '.join(dep.router_addresses)}")
        typer.echo(f"k3serve: OpenAI-compatible HTTP on {', '.join(f'http://{a}' for a in dep.http_addresses)}")
        typer.echo(json.dumps(info), nl=True)
        if endpoints_file:
            Path(endpoints_file).write_text(json.dumps(info))
        sys.stdout.flush()
        stop.wait(duration_s or None)
        why = signals[0] if signals else f"--duration-s {duration_s}"
        typer.echo(f"k3serve: {why}: draining (up to {deploy.drain_timeout_s:g} s for in-flight streams)")
        sys.stdout.flush()
        report = dep.stop(drain_timeout_s=None)
        typer.echo(f"k3serve: drained in {report.drain_s:.1f} s: {report.inflight_at_start} stream(s) were in "
                   f"flight, {report.cut} cut at the timeout; stopped in {report.stop_s:.1f} s")
    except BaseException:
        dep.stop(drain_timeout_s=0.0)
        raise
