"""``k3serve bench ...``: measurements with JSON output (timing lives here, never in tests)."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

import k3serve
from k3serve.cli import (bench_admission_cmd, bench_cuda_cmd, bench_eagle3_cmd, bench_http_cmd, bench_report_cmd,
                         bench_router_cmd, bench_trace_cmd, bench_transfer_cmd)
from k3serve.cli.output import emit

app = typer.Typer(help="Benchmarks (JSON on stdout with --json); they run the checkout's benchmarks/ package.",
                  no_args_is_help=True)


@app.callback()
def _benchmarks_importable() -> None:
    """The harnesses are the checkout's top-level ``benchmarks/`` package, which the wheel does not hold: importable
    when the checkout is on the path (PYTHONPATH, ``python -m`` from its root), else found beside the ``k3serve``
    package of an editable install."""
    try:
        import benchmarks  # noqa: F401
        return
    except ModuleNotFoundError as e:
        if e.name != "benchmarks":
            raise
    checkout = Path(k3serve.__file__).resolve().parent.parent
    if (checkout / "benchmarks" / "__init__.py").is_file():
        sys.path.insert(0, str(checkout))
        return
    typer.echo("error: k3serve bench: the benchmarks/ package is not importable (an installed wheel holds no bench "
               "harness): run it from a k3serve checkout (pip install -e . there) or with PYTHONPATH=<checkout>",
               err=True)
    raise typer.Exit(2)


def _threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)


@app.command("kernels")
def kernels(t: int = typer.Option(4096, "--tokens"), heads: int = typer.Option(4, "--heads"),
            head_dim: int = typer.Option(64, "--head-dim"), repeats: int = typer.Option(3, "--repeats"),
            threads: int = typer.Option(2, "--threads"), as_json: bool = typer.Option(False, "--json")) -> None:
    """Chunked vs recurrent KDA on this CPU, with the machine's matmul GFLOP/s as the ceiling."""
    _threads(threads)
    from benchmarks.kernels import run_kernel_bench

    emit(run_kernel_bench(T=t, H=heads, K=head_dim, repeats=repeats), as_json)


@app.command("prefix")
def prefix(preset: str = typer.Option("tiny", "--preset"), sessions: int = typer.Option(3, "--sessions"),
           turns: int = typer.Option(10, "--turns"), system_len: int = typer.Option(4096, "--system-tokens"),
           ttft_prefix: int = typer.Option(8192, "--ttft-prefix"), ttft_increment: int = typer.Option(128, "--ttft-increment"),
           ttft_repeats: int = typer.Option(3, "--ttft-repeats", help="rounds of cold / hit / short after a warm-up "
                                            "request; medians reported"),
           threads: int = typer.Option(2, "--threads"),
           deterministic: bool = typer.Option(False, "--deterministic",
                                              help="also run numerics: deterministic, side by side"),
           as_json: bool = typer.Option(False, "--json")) -> None:
    """K3 hybrid prefix cache vs the naive scheme on a multi-turn agentic trace; TTFT hit vs cold."""
    _threads(threads)
    from benchmarks.prefix import run_prefix_bench

    emit(run_prefix_bench(preset, sessions, turns, system_len, ttft_prefix=ttft_prefix,
                           ttft_increment=ttft_increment, deterministic=deterministic, ttft_repeats=ttft_repeats),
         as_json)


@app.command("decode")
def decode(preset: str = typer.Option("bench", "--preset"), context: int = typer.Option(256, "--context"),
           steps: int = typer.Option(8, "--steps"), batches: str = typer.Option("1,8,32", "--batches"),
           threads: int = typer.Option(2, "--threads"),
           deterministic: bool = typer.Option(False, "--deterministic",
                                              help="also run numerics: deterministic, side by side"),
           as_json: bool = typer.Option(False, "--json")) -> None:
    """Decode tokens/s by batch size and achieved memory bandwidth vs this machine's copy bandwidth."""
    _threads(threads)
    from benchmarks.decode import run_decode_bench

    sizes = tuple(int(b) for b in batches.split(","))
    emit(run_decode_bench(preset, sizes, context, steps, deterministic=deterministic), as_json)


@app.command("spec")
def spec(preset: str = typer.Option("tiny-trained", "--preset"),
         method: str = typer.Option("ngram,eagle3-lk,eagle3-kl", "--method",
                                    help="comma-separated: ngram, eagle3-lk, eagle3-kl (drafters shipped for the "
                                         "preset), eagle3=DIR"),
         max_k: int = typer.Option(7, "--max-k"), batches: str = typer.Option("1,8", "--batches"),
         sessions: int = typer.Option(8, "--sessions"), max_tokens: int = typer.Option(48, "--max-tokens"),
         heldout_prompts: int = typer.Option(8, "--heldout-prompts",
                                             help="Filtered held-out prompts for the heldout section (0: none)."),
         heldout_seeds: str = typer.Option("0,1", "--heldout-seeds", help="Seeds of the temperature-1 rows."),
         heldout_min_distinct: float = typer.Option(0.5, "--heldout-min-distinct",
                                                    help="Filter: least share of distinct 4-grams in a kept "
                                                         "continuation (0: whitespace and run rules only)."),
         threads: int = typer.Option(1, "--threads"), as_json: bool = typer.Option(False, "--json")) -> None:
    """Speculative vs plain decode on an agentic trace (k = 1..max-k, each batch size), records memory against
    snapshot-per-draft at this preset's and K3's geometry, and acceptance on filtered held-out prompts (greedy
    and temperature 1) for n-gram and the EAGLE-3 methods given."""
    _threads(threads)
    from benchmarks.heldout_accept import ContinuationFilter
    from benchmarks.spec import run_spec_bench

    sizes = tuple(int(b) for b in batches.split(","))
    heldout = None
    if heldout_prompts > 0:
        from k3serve.train.corpus import load_corpus

        heldout = load_corpus(None).heldout
    try:
        out = run_spec_bench(preset, max_k, sizes, sessions, max_tokens,
                             methods=tuple(m.strip() for m in method.split(",") if m.strip()), heldout=heldout,
                             heldout_prompts=heldout_prompts,
                             heldout_seeds=tuple(int(s) for s in heldout_seeds.split(",") if s.strip()),
                             heldout_filter=ContinuationFilter(min_distinct_4grams=heldout_min_distinct))
    except ValueError as e:
        typer.echo(f"error: --method: {e}", err=True)
        raise typer.Exit(2)
    emit(out, as_json)


@app.command("quant")
def quant(qat: str = typer.Option("", "--qat", help="A `k3serve train qat` output dir; default: a short QAT here."),
          qat_steps: int = typer.Option(20, "--qat-steps", help="QAT steps when --qat is not given."),
          rule: str = typer.Option("ocp", "--scale-rule", help="MXFP4 scale rule for PTQ (and QAT here)."),
          eval_bytes: int = typer.Option(32768, "--eval-bytes", help="Held-out tokens scored per model."),
          batches: str = typer.Option("1,8", "--batches"), steps: int = typer.Option(16, "--steps"),
          repeats: int = typer.Option(2, "--repeats", help="Alternating decode measurements per batch (best kept)."),
          threads: int = typer.Option(1, "--threads"), as_json: bool = typer.Option(False, "--json")) -> None:
    """MXFP4 vs bf16 on tiny-trained: expert/checkpoint bytes, bits/byte and KL (PTQ, QAT), decode tokens/s."""
    _threads(threads)
    from benchmarks.quant import run_quant_bench
    from k3serve.train.quant_eval import quality, run_qat

    sizes = tuple(int(b) for b in batches.split(","))
    emit(run_quant_bench(quality, run_qat, qat or None, qat_steps, rule, eval_bytes, batches=sizes,
                         decode_steps=steps, repeats=repeats), as_json)


# Benchmarks defined in their own modules join this group.
for _sub in (bench_transfer_cmd, bench_admission_cmd, bench_eagle3_cmd, bench_router_cmd, bench_cuda_cmd, bench_http_cmd,
             bench_trace_cmd, bench_report_cmd):
    app.registered_commands.extend(_sub.app.registered_commands)
