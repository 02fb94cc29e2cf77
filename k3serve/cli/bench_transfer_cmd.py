"""``k3serve bench transfer``: our gRPC transfer path vs a raw loopback socket, side by side (k3serve.bench.transfer).

Mounted by k3serve/cli/bench_cmd.py (this module's ``app`` commands join the ``bench`` group).
"""

from __future__ import annotations

import json
import sys

import typer

app = typer.Typer(help="Transfer benchmarks.", no_args_is_help=True)


def _pairs(text: str) -> tuple[tuple[int, int], ...]:
    try:
        out = tuple((int(a), int(b)) for a, b in (item.lower().split("x") for item in text.split(",")))
    except ValueError:
        raise typer.BadParameter(f"--pairs must look like 1x1,2x4 (P x D), got {text!r}") from None
    if not out or any(p <= 0 or d <= 0 for p, d in out):
        raise typer.BadParameter("--pairs needs positive P x D pairs")
    return out


@app.command("transfer")
def transfer(pairs: str = typer.Option("1x1,2x2,1x2,2x1,4x2", "--pairs", help="prefill x decode TP pairs"),
             tokens: int = typer.Option(32768, "--tokens", help="context length of the state moved"),
             preset: str = typer.Option("bench", "--preset"),
             chunk_kib: int = typer.Option(1024, "--chunk-kib", help="chunk payload size"),
             page_tokens: int = typer.Option(64, "--page-tokens"),
             reps: int = typer.Option(5, "--reps", help="repetitions per path (best and median reported)"),
             layerwise: bool = typer.Option(False, "--layerwise", help="mark layers ready one by one"),
             host: str = typer.Option("127.0.0.1", "--host", help="interface the receivers bind"),
             as_json: bool = typer.Option(False, "--json")) -> None:
    """Move a realistic request state P -> D over gRPC and over a raw TCP socket; report GB/s and the ratio."""
    from k3serve.bench.transfer import TransferBenchConfig, run_transfer_bench
    from k3serve.transfer.plan import PlanError

    try:
        cfg = TransferBenchConfig(_pairs(pairs), tokens, preset, chunk_kib << 10, page_tokens, reps, layerwise, host)
        result = run_transfer_bench(cfg)
    except (PlanError, ValueError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    if as_json:
        json.dump(result, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return
    typer.echo(f"preset {result['preset']}, {result['tokens']} tokens, chunks {result['chunk_bytes'] >> 10} KiB, "
               f"{result['cpus']} CPUs")
    typer.echo(f"{'P':>2} {'D':>2} {'MB':>8} {'ours GB/s':>10} {'bare gRPC':>10} {'socket GB/s':>12} {'ratio':>6} "
               f"{'crc':>6} {'reshard':>8} {'framing':>8}")
    for r in result["runs"]:
        typer.echo(f"{r['p']:>2} {r['d']:>2} {r['bytes'] / 1e6:>8.1f} {r['grpc_gbps']:>10.3f} "
                   f"{r['bare_grpc_gbps']:>10.3f} {r['socket_gbps']:>12.3f} {r['ratio']:>6.2f} "
                   f"{r['crc_share']:>6.1%} {r['reshard_share']:>8.1%} {r['framing_share']:>8.1%}")
    typer.echo("ratio = ours / socket; crc, reshard, framing = shares of the path's CPU time")
