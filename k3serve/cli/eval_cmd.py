"""``k3serve eval``: bits per byte of a checkpoint on text, with the reference forward."""

from __future__ import annotations

import typer

from k3serve.cli.output import emit

app = typer.Typer(help="Bits per byte of a checkpoint on a corpus (reference forward).",
                  invoke_without_command=True, no_args_is_help=False)


@app.callback()
def evaluate(
    checkpoint: str = typer.Option(..., "--checkpoint", help="Checkpoint directory."),
    corpus: str = typer.Option("", "--corpus", help="Directory or text file; default: the stdlib's *.py."),
    split: str = typer.Option("heldout", "--split", help="heldout | train | all (directory/file split)."),
    max_bytes: int = typer.Option(131072, "--max-bytes", help="Score at most this many tokens of the text."),
    context: int = typer.Option(256, "--context", help="Tokens per window (each from a zero state)."),
    threads: int = typer.Option(0, "--threads", help="torch threads (0: torch's default)."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Mean next-byte cross-entropy in bits over windows of the text (``bits_per_byte``)."""
    import torch

    from k3serve.model.checkpoint import CheckpointError
    from k3serve.model.config import ConfigError
    from k3serve.model.loader import load_model
    from k3serve.train.corpus import CorpusError, eval_windows, load_corpus
    from k3serve.train.evaluate import windows_nll

    if threads:
        torch.set_num_threads(threads)
    if split not in ("heldout", "train", "all"):
        typer.echo(f"error: --split must be heldout, train or all, got {split!r}", err=True)
        raise typer.Exit(2)
    if max_bytes < 2 or context < 2:
        typer.echo("error: --max-bytes and --context must be >= 2", err=True)
        raise typer.Exit(2)
    try:
        model = load_model(checkpoint)
        c = load_corpus(corpus or None)
        stream = {"heldout": c.heldout, "train": c.train, "all": torch.cat([c.train, c.heldout])}[split]
        windows = eval_windows(stream, min(context, max_bytes), max_bytes)
        nll = windows_nll(model, windows)
    except (CheckpointError, ConfigError, CorpusError, OSError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    emit({"bits_per_byte": nll.bits_per_byte, "bytes": nll.bytes, "windows": int(windows.shape[0]),
          "context": int(windows.shape[1]), "split": split, "corpus": c.source, "checkpoint": checkpoint}, as_json)
