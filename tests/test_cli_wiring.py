"""The command line's wiring, in the fast tier (nothing here starts a process): every command module is a plain
import of the CLI (a broken one fails at once), every group and bench is registered, and `k3serve bench` without
the checkout's benchmarks/ says what to do."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import typer
from typer.testing import CliRunner

import k3serve
import k3serve.cli.main as cli_main
from k3serve.cli import bench_cmd

CLI = Path(k3serve.__file__).parent / "cli"
runner = CliRunner()


def _cli_imports(path: Path) -> set[str]:
    """The k3serve.cli modules a file imports at its top level (not inside functions)."""
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module == "k3serve.cli":
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("k3serve.cli."):
            out.add(node.module.rsplit(".", 1)[1])
    return out


def test_importing_the_cli_imports_every_command_module():
    command_modules = {p.stem for p in CLI.glob("*_cmd.py")}
    seen, todo = set(), ["main"]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(_cli_imports(CLI / f"{name}.py"))
    assert command_modules <= seen, f"command modules the CLI does not import: {sorted(command_modules - seen)}"
    assert not [p.name for p in CLI.glob("*.py") if "importlib" in p.read_text()], "the CLI imports by name again"


def test_every_group_and_bench_is_registered():
    groups = typer.main.get_command(cli_main.app).commands
    assert set(groups) == {"checkpoint", "generate", "bench", "serve", "drill", "status", "train", "eval", "sim"}
    benches = set(groups["bench"].commands)
    for sub in ("bench_admission_cmd", "bench_cuda_cmd", "bench_eagle3_cmd", "bench_http_cmd", "bench_report_cmd",
                "bench_router_cmd", "bench_trace_cmd", "bench_transfer_cmd"):
        names = {c.name for c in getattr(sys.modules[f"k3serve.cli.{sub}"], "app").registered_commands}
        assert names and names <= benches, sub
    assert {"kernels", "prefix", "decode", "spec", "quant"} <= benches


def test_bench_without_benchmarks_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "benchmarks", None)  # not importable, as from an installed wheel
    monkeypatch.setattr(bench_cmd.k3serve, "__file__", str(tmp_path / "site-packages" / "k3serve" / "__init__.py"))
    res = runner.invoke(cli_main.app, ["bench", "report", "--json-dir", str(tmp_path)])
    assert res.exit_code == 2
    assert "benchmarks/ package is not importable" in res.stderr and "PYTHONPATH=<checkout>" in res.stderr


def test_bench_finds_benchmarks_beside_an_editable_checkout(tmp_path, monkeypatch):
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "__init__.py").write_text("")
    (tmp_path / "benchmarks" / "report.py").write_text(
        "class ReportError(Exception):\n    pass\n\n"
        "def load_records(d):\n    return [d]\n\n"
        "def render(records, d):\n    return f'records from {records[0]}\\n'\n")
    for name in [m for m in sys.modules if m == "benchmarks" or m.startswith("benchmarks.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if not (Path(p or ".") / "benchmarks").is_dir()])
    monkeypatch.setattr(bench_cmd.k3serve, "__file__", str(tmp_path / "k3serve" / "__init__.py"))
    try:
        res = runner.invoke(cli_main.app, ["bench", "report", "--json-dir", "here"])
        assert res.exit_code == 0, res.output
        assert res.stdout == "records from here\n"
    finally:
        for name in [m for m in sys.modules if m == "benchmarks" or m.startswith("benchmarks.")]:
            del sys.modules[name]
