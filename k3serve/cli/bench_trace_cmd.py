"""``k3serve bench trace``: a trace's head through a live deployment; ``bench trace-gen``: the shared-system-prompt
trace (docs/traffic.md). Mounted by k3serve/cli/bench_cmd.py."""

from __future__ import annotations

import typer

from k3serve.cli.output import emit, results_only_stdout

app = typer.Typer()


@app.command("trace")
def trace(trace_file: str = typer.Option(..., "--trace", help="a trace in Mooncake's format (JSON lines)"),
          config: str = typer.Option("configs/local.yaml", "--config", help="the deployment to bring up (and down)"),
          endpoints_file: str = typer.Option("", "--endpoints-file", help="use the running deployment `k3serve serve "
                                                                          "--endpoints-file` wrote instead"),
          policy: str = typer.Option("", "--policy", help="anonymous routing of the deployment brought up "
                                                          "(prefix-load, first-block, random; default: the file's)"),
          sessions: bool = typer.Option(False, "--sessions", help="send session ids (default: anonymous)"),
          max_requests: int = typer.Option(60, "--max-requests", min=1),
          max_blocks: int = typer.Option(6, "--max-blocks", min=1, help="cut prompts to this many 512-token blocks"),
          time_scale: float = typer.Option(1.0, "--time-scale", help="arrival times multiplied by this"),
          max_tokens: int = typer.Option(4, "--max-tokens", min=1),
          as_json: bool = typer.Option(False, "--json")) -> None:
    """Replay the head of a trace through the routers; reuse, load spread, TTFT, per cluster (JSON)."""
    from benchmarks.trace_replay import ReplaySetup, run_trace_bench
    from k3serve.cluster.deploy import DeployError
    from k3serve.sim.trace import TraceError

    try:
        setup = ReplaySetup(trace_file, max_requests, max_blocks, time_scale, sessions, max_tokens)
        with results_only_stdout() as stdout:
            result = run_trace_bench(setup, config, endpoints_file, policy)
    except (DeployError, TraceError, ValueError, OSError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    emit(result, as_json, stdout)


@app.command("trace-gen")
def trace_gen(out: str = typer.Option(..., "--out", help="where to write the trace (JSON lines)"),
              conversations: int = typer.Option(12, "--conversations", min=1),
              turns: int = typer.Option(3, "--turns", min=1),
              system_blocks: int = typer.Option(3, "--system-blocks", min=1,
                                                help="the shared system prompt, in 512-token blocks"),
              turn_blocks: int = typer.Option(1, "--turn-blocks", min=1, help="blocks each turn adds"),
              gap_s: float = typer.Option(1.0, "--gap-s", help="between conversation starts"),
              seed: int = typer.Option(0, "--seed")) -> None:
    """Write a trace of conversations that all share one system prompt (Mooncake's format)."""
    from k3serve.sim.trace import dump, shared_prompt_trace

    reqs = shared_prompt_trace(conversations, turns, system_blocks, turn_blocks, gap_s, seed)
    dump(reqs, out)
    typer.echo(f"{len(reqs)} requests, {conversations} conversations under a {system_blocks * 512}-token "
               f"system prompt -> {out}")
