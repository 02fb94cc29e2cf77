"""``k3serve bench router-load``: two routers under a burst of streams; retry hints against measured waits (JSON)."""

from __future__ import annotations

import typer

from k3serve.cli.output import emit, results_only_stdout

app = typer.Typer()


@app.command("router-load")
def router_load(config: str = typer.Option("configs/local.yaml", "--config"),
                streams: int = typer.Option(200, "--streams", min=1, help="concurrent clients in the burst"),
                warmup: int = typer.Option(60, "--warmup", min=0,
                                           help="clients in a warm-up burst first (the routers learn durations)"),
                max_tokens: int = typer.Option(8, "--max-tokens", min=1),
                max_concurrent: int = typer.Option(2, "--max-concurrent", min=1,
                                                   help="short requests in flight per cluster"),
                queue: int = typer.Option(2, "--queue", min=0, help="short requests queued per cluster"),
                router_streams: int = typer.Option(8, "--router-streams", min=1,
                                                   help="streams each router serves at once"),
                as_json: bool = typer.Option(False, "--json")) -> None:
    """Two router processes under a burst: every retry-after hint against the moment its budget had a room, the
    budgets' busy fraction, and the behaviour (every stream completes, budgets never exceeded, probes answered)."""
    from benchmarks.router_load import LoadSetup, run_router_load_bench

    setup = LoadSetup(streams=streams, warmup_streams=warmup, max_tokens=max_tokens, max_concurrent=max_concurrent,
                      queue=queue, router_streams=router_streams)
    with results_only_stdout() as stdout:
        result = run_router_load_bench(config, setup)
    emit(result, as_json, stdout)
