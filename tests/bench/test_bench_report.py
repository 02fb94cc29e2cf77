"""`k3serve bench record` / `bench report`: a real bench's JSON saved with its command and host, rendered into
the figures page; docs/results.md is exactly what the committed records render to."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from benchmarks.report import ReportError, load_records, render
from k3serve.cli.main import app

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a real bench run: minutes on a loaded 2-core host
def test_record_saves_the_bench_json_with_its_command_and_report_renders_it(tmp_path):
    runner = CliRunner()
    got = runner.invoke(app, ["bench", "record", "--out", str(tmp_path), "kernels", "--tokens", "64", "--heads",
                              "1", "--head-dim", "16", "--repeats", "1", "--threads", "1"])
    assert got.exit_code == 0, got.output
    (path,) = tmp_path.glob("*.json")
    record = json.loads(path.read_text())
    assert record["command"] == "k3serve bench kernels --tokens 64 --heads 1 --head-dim 16 --repeats 1 --threads 1 --json"
    assert record["bench"] == "kernels" and record["host"]["cores"] >= 1 and "load_avg_1m_after" in record["host"]
    assert record["result"]["sizes"]["T"] == 64 and record["result"]["chunk_tokens_per_s"] > 0
    page = runner.invoke(app, ["bench", "report", "--json-dir", str(tmp_path)])
    assert page.exit_code == 0, page.output
    row = next(line for line in page.output.splitlines() if line.startswith(f"| `{record['command']}`"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    header = next(line for line in page.output.splitlines() if line.startswith("| command |"))
    col = [c.strip() for c in header.strip("|").split("|")].index("chunk tok/s")
    assert cells[col] == f"{record['result']['chunk_tokens_per_s']:,.0f}" or \
        cells[col] == f"{record['result']['chunk_tokens_per_s']:.3g}"
    assert "## kernels" in page.output


def test_a_record_missing_a_field_is_refused_naming_file_and_field(tmp_path):
    (tmp_path / "x.json").write_text(json.dumps({"version": 1, "bench": "decode", "command": "c", "host": {}}))
    with pytest.raises(ReportError, match=r"x\.json: missing field 'recorded'"):
        load_records(tmp_path)
    got = CliRunner().invoke(app, ["bench", "report", "--json-dir", str(tmp_path / "nope")])
    assert got.exit_code == 2 and "--json-dir" in got.output


def test_a_bench_that_is_not_a_bench_is_refused(tmp_path):
    got = CliRunner().invoke(app, ["bench", "record", "--out", str(tmp_path), "report"])
    assert got.exit_code == 2 and "not a bench" in got.output and not list(tmp_path.iterdir())


def test_docs_results_is_what_the_committed_records_render_to():
    records = load_records(ROOT / "bench_results")
    assert records, "bench_results/ holds the records docs/results.md is made from"
    assert (ROOT / "docs" / "results.md").read_text() == render(records, "bench_results")


def test_the_heldout_section_renders_one_column_per_method(tmp_path):
    """`bench eagle3` / `bench spec` records show the held-out acceptance figures of every method."""
    row = {"greedy_tokens_per_verify": {"1": 1.5, "3": 2.25}, "t1_alpha_mean": 0.625, "t1_tokens_per_verify_mean": 1.75}
    result = {"k_online": 3, "heldout": {"kept": 8, "scanned": 40, "k_t1": 3,
                                         "rows": {"ngram": row, "eagle3-lk": {**row, "t1_alpha_mean": 0.75}}}}
    (tmp_path / "e.json").write_text(json.dumps({"version": 1, "bench": "eagle3", "command": "k3serve bench eagle3",
                                                 "recorded": "t", "host": {}, "result": result}))
    lines = render(load_records(tmp_path), str(tmp_path)).splitlines()
    header = [c.strip() for c in next(x for x in lines if x.startswith("| command |")).strip("|").split("|")]
    cells = [c.strip() for c in next(x for x in lines if x.startswith("| `k3serve")).strip("|").split("|")]
    got = dict(zip(header, cells))
    assert got["held-out kept"] == "8" and got["scanned"] == "40"
    assert got["ngram greedy tok/verify k=3"] == "2.25" and got["ngram T=1 alpha"] == "0.625"
    assert got["eagle3-lk T=1 alpha"] == "0.75" and got["eagle3-lk T=1 tok/verify"] == "1.75"
