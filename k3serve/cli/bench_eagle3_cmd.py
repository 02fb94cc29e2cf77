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
           repeats: int = typer.Option(2, "--repeats", help="Interleaved passes per online row (fastest kept)."), threads: int = typer.Option(1, "--threads"),
           as_json: bool = typer.Option(False, "--json")) -> None:
    """Tokens per verify k=1..7 and per-position acceptance (held-out), decode speedup at batch 1 and 8."""
    import torch

    from benchmarks.eagle3 import run_eagle3_bench
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
    emit(run_eagle3_bench(tdir, pairs, heldout, k, tuple(int(b) for b in batches.split(",")), prompts,
                          gen_len=gen_len, repeats=repeats), as_json)
