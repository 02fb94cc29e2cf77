"""The ``k3serve`` command line.

Each command group lives in its own module that defines ``app = typer.Typer(...)``; this file wires them up
with plain imports, so a module that fails to import fails the command line at once.
"""

from __future__ import annotations

import typer

from k3serve.cli import (bench_cmd, checkpoint_cmd, drill_cmd, eval_cmd, generate_cmd, serve_cmd, sim_cmd, status_cmd,
                         train_cmd)

app = typer.Typer(
    name="k3serve",
    help="Disaggregated prefill/decode serving for the Kimi K3 / Kimi-Linear model family.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

app.add_typer(checkpoint_cmd.app, name="checkpoint")  # make / inspect checkpoints
app.add_typer(generate_cmd.app, name="generate")  # local prefill -> decode, or the reference
app.add_typer(bench_cmd.app, name="bench")  # measurements, JSON output (the checkout's benchmarks/)
app.add_typer(serve_cmd.app, name="serve")  # run the cluster service
app.add_typer(drill_cmd.app, name="drill")  # failover drills
app.add_typer(status_cmd.app, name="status")  # clusters, health, load, pins
app.add_typer(train_cmd.app, name="train")  # train target: pretraining at tiny scale
app.add_typer(eval_cmd.app, name="eval")  # bits per byte of a checkpoint on text
app.add_typer(sim_cmd.app, name="sim")  # fleet simulator: a trace at N clusters in simulated time


def main() -> None:
    """Console-script entry point (``k3serve = k3serve.cli.main:main``)."""
    app(prog_name="k3serve")


if __name__ == "__main__":
    main()
