"""``k3serve bench record`` (run a bench, save its JSON with the command and host) and ``k3serve bench report``
(the figures page, docs/results.md, from those records)."""

from __future__ import annotations

import contextlib
import io
import json

import typer

app = typer.Typer()


@app.command("record", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def record(ctx: typer.Context, out: str = typer.Option("bench_results", "--out", help="where records are saved"),
           bench: str = typer.Argument(..., help="the bench to run, e.g. kernels; its options follow")) -> None:
    """Run `k3serve bench BENCH ARGS... --json` here and save its JSON as a record for `bench report`."""
    from benchmarks.report import ReportError, host_facts, save_record

    argv = [a for a in ctx.args if a != "--json"]
    if bench in ("record", "report"):
        typer.echo(f"error: bench: {bench!r} is not a bench", err=True)
        raise typer.Exit(2)
    before = host_facts()
    captured = io.StringIO()
    with contextlib.redirect_stdout(captured):
        code = ctx.parent.command.main(args=[bench, *argv, "--json"], prog_name="k3serve bench",
                                       standalone_mode=False)
    if code:
        typer.echo(f"error: k3serve bench {bench} exited {code}", err=True)
        raise typer.Exit(int(code))
    try:
        result = json.loads(captured.getvalue())
        host = {**before, "load_avg_1m_after": host_facts()["load_avg_1m"]}
        path = save_record(out, bench, argv, result, host)
    except (json.JSONDecodeError, ReportError) as e:
        typer.echo(f"error: k3serve bench {bench}: its output is not a JSON object: {e}", err=True)
        raise typer.Exit(1)
    typer.echo(str(path))


@app.command("report")
def report(json_dir: str = typer.Option("bench_results", "--json-dir", help="the records `bench record` saved")) -> None:
    """Markdown on stdout: one table per bench, each row a record and the command that reproduces it."""
    from benchmarks.report import ReportError, load_records, render

    try:
        typer.echo(render(load_records(json_dir), json_dir.rstrip("/")), nl=False)
    except ReportError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
