"""``k3serve bench http``: the same streams through the routers' HTTP and gRPC doors side by side (JSON)."""

from __future__ import annotations

import typer

from k3serve.cli.output import emit, results_only_stdout

app = typer.Typer()


@app.command("http")
def http(config: str = typer.Option("configs/local.yaml", "--config"),
         streams: int = typer.Option(32, "--streams", min=1, help="concurrent streams per round and door"),
         rounds: int = typer.Option(3, "--rounds", min=1),
         prompt_tokens: int = typer.Option(64, "--prompt-tokens", min=1),
         max_tokens: int = typer.Option(32, "--max-tokens", min=1),
         as_json: bool = typer.Option(False, "--json")) -> None:
    """TTFT p50/p99 and tokens/s of the HTTP door against the gRPC door, same requests, one deployment."""
    from benchmarks.http_door import HttpBenchSetup, run_http_bench

    setup = HttpBenchSetup(streams=streams, rounds=rounds, prompt_tokens=prompt_tokens, max_tokens=max_tokens)
    with results_only_stdout() as stdout:
        result = run_http_bench(config, setup)
    emit(result, as_json, stdout)
