"""``k3serve bench eagle3``: the shipped (or given) EAGLE-3 drafters beside n-gram and plain decode."""

from __future__ import annotations

import typer

from k3serve.cli.output import emit

app = typer.Typer()


@app.command("eagle3")
def eagle3(target: str = typer.Option("tiny-trained", "--target", help="Target checkpoint dir or trained preset."),
           drafters: str = typer.Option("", "--drafters",
                                        help="name=DIR,... (default: the shipped eagle3-lk and eagle3-kl)"),
           k: int = typer.Option(3, "--k", help="Drafts per verify in the online rows."),
           batches: str = typer.Option("1,8", "--batches"), prompts: int = typer.Option(8, "--prompts"),
           gen_len: int = typer.Option(64, "--gen-tokens"),
           repeats: int = typer.Option(2, "--repeats", help="Interleaved passes per online row (fastest kept)."),
           heldout_prompts: int = typer.Option(8, "--heldout-prompts",
                                               help="Filtered held-out prompts for the heldout section (0: none)."),
           heldout_seeds: str = typer.Option("0,1", "--heldout-seeds", help="Seeds of the temperature-1 rows."),
           heldout_scan: int = typer.Option(0, "--heldout-scan",
                                            help="Candidate windows scanned for them (0: 8 x --heldout-prompts)."),
           heldout_min_distinct: float = typer.Option(0.5, "--heldout-min-distinct",
                                                      help="Filter: least share of distinct 4-grams in a kept "
                                                           "continuation (0: whitespace and run rules only)."),
           threads: int = typer.Option(1, "--threads"), as_json: bool = typer.Option(False, "--json")) -> None:
    """Tokens per verify k=1..7 and per-position acceptance (held-out), decode speedup at batch 1 and 8
    (--batches '': none), acceptance at temperature 1 on filtered held-out prompts (the heldout section)."""
    import torch

    from benchmarks.eagle3 import run_eagle3_bench
    from benchmarks.heldout_accept import ContinuationFilter
    from k3serve.model.eagle3.assets import shipped_drafters
    from k3serve.train.corpus import load_corpus
    from k3serve.train.drafter_loop import target_dir

    torch.set_num_threads(threads)
    tdir = str(target_dir(target))
    if drafters:
        pairs = dict(item.split("=", 1) for item in drafters.split(","))
    else:
        pairs = shipped_drafters(target)
    heldout = load_corpus(None).heldout
    emit(run_eagle3_bench(tdir, pairs, heldout, k, tuple(int(b) for b in batches.split(",") if b.strip()), prompts,
                          gen_len=gen_len, repeats=repeats, heldout_prompts=heldout_prompts,
                          heldout_seeds=tuple(int(s) for s in heldout_seeds.split(",") if s.strip()),
                          heldout_scan=heldout_scan or None,
                          heldout_filter=ContinuationFilter(min_distinct_4grams=heldout_min_distinct)), as_json)
