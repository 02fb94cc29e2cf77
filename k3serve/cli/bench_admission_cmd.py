"""``k3serve bench admission``: short TTFT under a long-request burst, budgets on vs off (JSON)."""

from __future__ import annotations

import typer

from k3serve.cli.output import emit, results_only_stdout

app = typer.Typer()


@app.command("admission")
def admission(config: str = typer.Option("configs/local.yaml", "--config"),
              shorts: int = typer.Option(12, "--shorts"), longs: int = typer.Option(8, "--longs"),
              long_tokens: int = typer.Option(6000, "--long-tokens"),
              step_tokens: int = typer.Option(512, "--step-tokens", help="prefill step token budget"),
              long_step_tokens: int = typer.Option(64, "--long-step-tokens",
                                                   help="most long-prompt tokens per step (0: --step-tokens)"),
              as_json: bool = typer.Option(False, "--json")) -> None:
    """Short-request TTFT p99: unloaded, during a burst of long requests with budgets, and without."""
    from benchmarks.admission import run_admission_bench

    with results_only_stdout() as stdout:
        result = run_admission_bench(config, shorts=shorts, longs=longs, long_len=long_tokens, step_tokens=step_tokens,
                                     long_step_tokens=long_step_tokens)
    emit(result, as_json, stdout)
