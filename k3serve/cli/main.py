"""The ``k3serve`` command line.

Each command group lives in its own module that defines ``app = typer.Typer(...)``; this file only wires
them up. Modules are imported one by one, so a group whose module is not written yet is simply absent,
and one that fails to import shows up as a command that explains the failure instead of breaking the rest.
"""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(
    name="k3serve",
    help="Disaggregated prefill/decode serving for the Kimi K3 / Kimi-Linear model family.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

# (module, command name). Each module must define `app: typer.Typer`.
# ---- other developers: add your sub-app here (one line each); the module may not exist yet. ----
SUBCOMMANDS: list[tuple[str, str]] = [
    ("k3serve.cli.checkpoint_cmd", "checkpoint"),  # make / inspect checkpoints
    ("k3serve.cli.generate_cmd", "generate"),  # local prefill -> decode, or the reference
    ("k3serve.cli.bench_cmd", "bench"),  # measurements, JSON output
    ("k3serve.cli.serve_cmd", "serve"),  # run the cluster service
    ("k3serve.cli.drill_cmd", "drill"),  # failover drills
    ("k3serve.cli.status_cmd", "status"),  # clusters, health, load, pins
    ("k3serve.cli.train_cmd", "train"),  # train target: pretraining at tiny scale
    ("k3serve.cli.eval_cmd", "eval"),  # bits per byte of a checkpoint on text
    ("k3serve.cli.sim_cmd", "sim"),  # fleet simulator: a trace at N clusters in simulated time
]
# -------------------------------------------------------------------------------------------------


def _add_unavailable(host: typer.Typer, name: str, err: BaseException) -> None:
    """Stand-in command for a group whose module failed to import: says why, exits 2."""
    msg = f"error: 'k3serve {name}' is unavailable: {type(err).__name__}: {err}"

    @host.command(name=name, help=f"(unavailable: {type(err).__name__}: {err})",
                  context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                    "help_option_names": []})
    def _unavailable(ctx: typer.Context) -> None:
        typer.echo(msg, err=True)
        raise typer.Exit(2)


def _register(module: str, name: str, into: typer.Typer | None = None) -> None:
    host = into or app
    try:
        sub = importlib.import_module(module).app
    except ModuleNotFoundError as e:
        if e.name == module:  # not written yet: leave the command out
            return
        _add_unavailable(host, name, e)
        return
    except Exception as e:  # noqa: BLE001 - a broken module must not take the other commands down
        _add_unavailable(host, name, e)
        return
    host.add_typer(sub, name=name)


for _module, _name in SUBCOMMANDS:
    _register(_module, _name)


def main() -> None:
    """Console-script entry point (``k3serve = k3serve.cli.main:main``)."""
    app(prog_name="k3serve")


if __name__ == "__main__":
    main()
