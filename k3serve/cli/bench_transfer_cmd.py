"""``k3serve bench transfer``: our gRPC transfer path vs a raw loopback socket, side by side (benchmarks.transfer).

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


def _run_or_exit(run, as_json: bool) -> dict | None:
    """Run a bench; a plan or value error exits 2 with its message. With ``--json`` print the result and return
    None (nothing more to print), else return it for the table."""
    from k3serve.transfer.plan import PlanError

    try:
        result = run()
    except (PlanError, ValueError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    if as_json:
        json.dump(result, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return None
    return result


@app.command("transfer")
def transfer(pairs: str = typer.Option("1x1,2x2,1x2,2x1,4x2", "--pairs", help="prefill x decode TP pairs"),
             tokens: int = typer.Option(32768, "--tokens", help="context length of the state moved"),
             preset: str = typer.Option("bench", "--preset"),
             chunk_kib: int = typer.Option(0, "--chunk-kib",
                                           help="chunk payload size (0: the transfer default, DEFAULT_CHUNK_BYTES)"),
             page_tokens: int = typer.Option(64, "--page-tokens"),
             reps: int = typer.Option(5, "--reps", help="repetitions per path (best and median reported)"),
             layerwise: bool = typer.Option(False, "--layerwise", help="mark layers ready one by one"),
             host: str = typer.Option("127.0.0.1", "--host", help="interface the receivers bind"),
             mooncake: bool = typer.Option(True, "--mooncake/--no-mooncake",
                                           help="also our Mooncake plane and raw Mooncake (when installed)"),
             handoff: bool = typer.Option(True, "--handoff/--no-handoff",
                                          help="also the last-chunk-to-first-decode-token time, layer-wise export "
                                               "off and on (a real prefill and decode group)"),
             handoff_preset: str = typer.Option("tiny", "--handoff-preset"),
             handoff_tokens: int = typer.Option(4096, "--handoff-tokens", help="prompt length of the handoff run"),
             handoff_last_chunk: int = typer.Option(256, "--handoff-last-chunk", help="tokens of its last chunk"),
             handoff_tp: str = typer.Option("2x1", "--handoff-tp", help="prefill x decode TP of the handoff run"),
             as_json: bool = typer.Option(False, "--json")) -> None:
    """Move a realistic request state P -> D over our gRPC path, bare gRPC-Python, our Mooncake plane, raw
    Mooncake and a raw TCP socket, side by side; report GB/s, the ratios and CPU seconds per GB."""
    from benchmarks.transfer import TransferBenchConfig, run_transfer_bench
    from benchmarks.transfer_handoff import HandoffBenchConfig
    from k3serve.transfer.spec import DEFAULT_CHUNK_BYTES

    chunk_bytes = chunk_kib << 10 if chunk_kib > 0 else DEFAULT_CHUNK_BYTES
    tps = _pairs(handoff_tp)
    if len(tps) != 1:
        raise typer.BadParameter(f"--handoff-tp takes one P x D pair, got {handoff_tp!r}")
    (hp, hd), = tps

    def run() -> dict:
        hcfg = HandoffBenchConfig(handoff_preset, handoff_tokens, handoff_last_chunk, hp, hd, reps,
                                  chunk_bytes) if handoff else None
        return run_transfer_bench(TransferBenchConfig(_pairs(pairs), tokens, preset, chunk_bytes, page_tokens, reps,
                                                      layerwise, host, mooncake, hcfg))

    result = _run_or_exit(run, as_json)
    if result is None:
        return
    typer.echo(f"preset {result['preset']}, {result['tokens']} tokens, chunks {result['chunk_bytes'] >> 10} KiB, "
               f"{result['cpus']} CPUs")
    typer.echo(f"mooncake: {result['mooncake']}; load average {result['load_avg_1m']}")
    num = lambda v, w, f=".3f": f"{v:>{w}{f}}" if v is not None else f"{'-':>{w}}"  # noqa: E731
    typer.echo(f"{'P':>2} {'D':>2} {'MB':>8} {'ours gRPC':>10} {'bare gRPC':>10} {'ours/bare':>10} {'ours/kept':>10} "
               f"{'ours MC':>8} "
               f"{'raw MC':>8} {'MC/raw':>7} {'socket':>8} {'crc':>6} {'reshard':>8} {'framing':>8}")
    for r in result["runs"]:
        typer.echo(f"{r['p']:>2} {r['d']:>2} {r['bytes'] / 1e6:>8.1f} {r['grpc_gbps']:>10.3f} "
                   f"{r['bare_grpc_gbps']:>10.3f} {r['ours_over_bare_grpc']:>10.2f} "
                   f"{r['ours_over_bare_grpc_keep']:>10.2f} {num(r['mooncake_gbps'], 8)} "
                   f"{num(r['raw_mooncake_gbps'], 8)} {num(r['ours_mooncake_over_raw'], 7, '.2f')} "
                   f"{r['socket_gbps']:>8.3f} {r['crc_share']:>6.1%} {r['reshard_share']:>8.1%} "
                   f"{r['framing_share']:>8.1%}")
    typer.echo("GB/s; ours/bare = ours over gRPC / bare gRPC-Python (ours/kept: over bare gRPC whose sink keeps "
               "what it got), MC/raw = ours over Mooncake / raw Mooncake; "
               "crc, reshard, framing = shares of the gRPC path's CPU time")
    h = result.get("layerwise_handoff")
    if h:
        typer.echo(f"last prefill chunk -> first decode token ({h['preset']}, {h['tokens']} tokens, last chunk "
                   f"{h['last_chunk_tokens']}, TP {h['prefill_tp']}x{h['decode_tp']}): layer-wise export off "
                   f"{h['off']['last_chunk_to_first_decode_s']:.4f} s, on {h['on']['last_chunk_to_first_decode_s']:.4f}"
                   f" s (median of {h['reps']}; paired saving {h['saved_s_median']:.4f} s)")


@app.command("transfer-overlap")
def transfer_overlap(pairs: str = typer.Option("1x1,2x2,4x2", "--pairs", help="prefill x decode TP pairs"),
                     tokens: int = typer.Option(8192, "--tokens", help="context length of the state moved"),
                     preset: str = typer.Option("bench", "--preset"),
                     reps: int = typer.Option(8, "--reps", help="repetitions of each path (medians reported)"),
                     host: str = typer.Option("127.0.0.1", "--host", help="interface the receivers bind"),
                     as_json: bool = typer.Option(False, "--json")) -> None:
    """Our gRPC path with CRC and placement overlapped, inline (the default), and bare gRPC-Python, interleaved
    in one run (benchmarks.transfer_overlap): paired ratios and CPU seconds per GB."""
    from benchmarks.transfer_overlap import OverlapBenchConfig, run_overlap_bench

    result = _run_or_exit(lambda: run_overlap_bench(OverlapBenchConfig(_pairs(pairs), tokens, preset, reps=reps,
                                                                       host=host)), as_json)
    if result is None:
        return
    typer.echo(f"preset {result['preset']}, {result['tokens']} tokens, {result['reps']} reps, load average "
               f"{result['load_avg_1m_start']} -> {result['load_avg_1m_end']} on {result['cpus']} CPUs")
    typer.echo(f"{'P':>2} {'D':>2} {'overlap':>8} {'inline':>8} {'bare':>8} {'ov/bare':>8} {'in/bare':>8} "
               f"{'ov/in':>6}  CPU s/GB overlap / inline / bare")
    for r in result["runs"]:
        g, c = r["gbps_median"], r["cpu_s_per_gb"]
        typer.echo(f"{r['p']:>2} {r['d']:>2} {g['overlap']:>8.3f} {g['inline']:>8.3f} {g['bare']:>8.3f} "
                   f"{r['overlap_over_bare_median']:>8.3f} {r['inline_over_bare_median']:>8.3f} "
                   f"{r['overlap_over_inline_median']:>6.3f}  {c['overlap']:.2f} / {c['inline']:.2f} / {c['bare']:.2f}")
    typer.echo("GB/s of the median repetition; ratios: medians of the per-repetition ratios")
