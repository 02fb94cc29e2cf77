"""``k3serve train target``: pretrain a preset on a local corpus (default: the Python stdlib's sources).
``k3serve train drafter``: train an EAGLE-3 drafter for a frozen target (LK or KL loss).
``k3serve train qat``: fine-tune a trained checkpoint with MXFP4 fake-quantised routed experts."""

from __future__ import annotations

from typing import Annotated

import typer

from k3serve.cli.output import emit

# options every training command takes, declared once (defaults stay per command)
Corpus = Annotated[str, typer.Option("--corpus", help="Directory or text file; default: the stdlib's *.py.")]
Minutes = Annotated[float, typer.Option("--minutes", help="Budget in training minutes (eval/saving excluded).")]
Steps = Annotated[int, typer.Option("--steps", help="Budget in optimizer steps (reproducible).")]
Batch = Annotated[int, typer.Option("--batch", help="Windows per step.")]
Context = Annotated[int, typer.Option("--context", help="Tokens per training window.")]
EvalEvery = Annotated[float, typer.Option("--eval-every", help="Held-out eval every N training seconds.")]
EvalTokens = Annotated[int, typer.Option("--eval-tokens", help="Held-out tokens per periodic eval.")]
Threads = Annotated[int, typer.Option("--threads", help="torch threads (0: torch's default).")]
Quiet = Annotated[bool, typer.Option("--quiet", help="No progress bar.")]
AsJson = Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")]


def _set_threads(threads: int) -> None:
    if threads:
        import torch

        torch.set_num_threads(threads)


def _fail(e: Exception) -> typer.Exit:
    typer.echo(f"error: {e}", err=True)
    return typer.Exit(2)

app = typer.Typer(help="Train models at tiny scale (progress bar, loss-curve PNG, serving checkpoint).",
                  no_args_is_help=True, pretty_exceptions_enable=False)


@app.command("target")
def target(
    preset_name: str = typer.Option("tiny", "--preset", help="Model preset to train from scratch."),
    corpus: Corpus = "",
    out: str = typer.Option(..., "--out", help="Output dir: the serving checkpoint, train state, PNG, log."),
    minutes: Minutes = None,
    steps: Steps = None,
    seed: int = typer.Option(0, "--seed", help="Initial weights and batch order."),
    batch: Batch = 8,
    context: Context = 256,
    lr: float = typer.Option(3e-3, "--lr", help="Peak AdamW learning rate (warm-up, then cosine to 10%)."),
    warmup: int = typer.Option(30, "--warmup", help="Warm-up steps."),
    eval_every: EvalEvery = 60.0,
    eval_tokens: EvalTokens = 8192,
    threads: Threads = 0,
    resume: bool = typer.Option(False, "--resume", help="Continue the run in --out from its last checkpoint."),
    quiet: Quiet = False,
    as_json: AsJson = False,
) -> None:
    """Pretrain from scratch with AdamW; MoE biases by K3's quantile update; eval, checkpoints, curves."""
    from k3serve.model.config import ConfigError
    from k3serve.model.presets import preset
    from k3serve.train.corpus import CorpusError
    from k3serve.train.loop import TrainConfig, TrainError, run_training

    _set_threads(threads)
    try:
        cfg = TrainConfig(preset(preset_name), preset_name, out, corpus or None, steps, minutes, seed, batch,
                          context, lr, warmup, eval_every_s=eval_every, eval_tokens=eval_tokens, resume=resume)
        result = run_training(cfg, progress=not quiet)
    except (TrainError, CorpusError, ConfigError, ValueError) as e:
        raise _fail(e)
    emit({"out": result.out, **result.summary}, as_json)


@app.command("drafter")
def drafter(
    target_dir: str = typer.Option(..., "--target", help="Target checkpoint dir (or a trained preset: tiny-trained)."),
    out: str = typer.Option(..., "--out", help="Output dir: the drafter checkpoint, log, PNG."),
    loss: str = typer.Option("lk", "--loss", help="lk (-log sum min(p, q)) or kl (KL(p || q), the baseline)."),
    ttt_steps: int = typer.Option(7, "--ttt-steps", help="Unrolled steps on the drafter's own outputs."),
    minutes: Minutes = None,
    steps: Steps = None,
    seed: int = typer.Option(0, "--seed", help="Initial eh_proj values and batch order."),
    batch: Batch = 8,
    context: Context = 256,
    lr: float = typer.Option(2e-3, "--lr", help="Peak AdamW learning rate (warm-up, then cosine to 10%)."),
    window: int = typer.Option(32, "--window", help="Drafter attention window (positions of per-request state)."),
    corpus: Corpus = "",
    eval_every: EvalEvery = 120.0,
    threads: Threads = 0,
    quiet: Quiet = False,
    as_json: AsJson = False,
) -> None:
    """Train an EAGLE-3 drafter for a frozen target (training-time test, LK or KL loss); eval tokens/verify."""
    from k3serve.model.config import ConfigError
    from k3serve.train.corpus import CorpusError
    from k3serve.train.drafter_loop import DrafterTrainConfig, run_drafter_training
    from k3serve.train.drafter_loss import DrafterLoss
    from k3serve.train.loop import TrainError

    _set_threads(threads)
    try:
        kind = DrafterLoss(loss)
    except ValueError:
        typer.echo(f"error: --loss must be one of {[k.value for k in DrafterLoss]}, got {loss!r}", err=True)
        raise typer.Exit(2)
    try:
        cfg = DrafterTrainConfig(target_dir, out, kind, ttt_steps, minutes, steps, seed, batch, context, lr,
                                 window=window, corpus=corpus or None, eval_every_s=eval_every)
        summary = run_drafter_training(cfg, progress=not quiet)
    except (TrainError, CorpusError, ConfigError, ValueError) as e:
        raise _fail(e)
    emit(summary, as_json)


@app.command("qat")
def qat(
    target: str = typer.Option(..., "--target", help="Trained full-precision checkpoint to fine-tune."),
    out: str = typer.Option(..., "--out", help="Output dir: the MXFP4 serving checkpoint, master weights, PNG, log."),
    corpus: Corpus = "",
    minutes: Minutes = None,
    steps: Steps = None,
    seed: int = typer.Option(1, "--seed", help="Batch order (a different stream than the target's seed 0)."),
    batch: Batch = 8,
    context: Context = 256,
    lr: float = typer.Option(5e-4, "--lr", help="Peak AdamW learning rate (warm-up, then cosine to 10%)."),
    warmup: int = typer.Option(5, "--warmup", help="Warm-up steps."),
    rule: str = typer.Option("ocp", "--scale-rule", help="MXFP4 scale rule: ocp | round-up."),
    eval_every: EvalEvery = 60.0,
    eval_tokens: EvalTokens = 8192,
    threads: Threads = 0,
    resume: bool = typer.Option(False, "--resume", help="Continue the run in --out."),
    quiet: Quiet = False,
    as_json: AsJson = False,
) -> None:
    """Fine-tune with MXFP4 fake quantisation of the routed experts (STE); writes an MXFP4 checkpoint."""
    from k3serve.kernels.mxfp4 import SCALE_RULES
    from k3serve.model.checkpoint import CheckpointError, load_config
    from k3serve.model.config import ConfigError
    from k3serve.train.corpus import CorpusError
    from k3serve.train.loop import TrainConfig, TrainError, run_training

    _set_threads(threads)
    try:
        if rule not in SCALE_RULES:
            raise TrainError(f"--scale-rule must be one of {SCALE_RULES}, got {rule!r}")
        model = load_config(target)
        if model.quantization:
            raise TrainError(f"--target {target} is already quantized ({model.quantization}); give the "
                             "full-precision checkpoint")
        cfg = TrainConfig(model, f"qat of {target}", out, corpus or None, steps, minutes, seed, batch, context, lr,
                          warmup, eval_every_s=eval_every, eval_tokens=eval_tokens, resume=resume,
                          init_from=target, qat_rule=rule)
        result = run_training(cfg, progress=not quiet)
    except (TrainError, CorpusError, ConfigError, CheckpointError, ValueError) as e:
        raise _fail(e)
    emit({"out": result.out, **result.summary}, as_json)
