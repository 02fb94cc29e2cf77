"""`k3serve checkpoint make / inspect` through typer's CliRunner, and the real entry point once."""

import json
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from k3serve.cli.main import app

DATA = Path(__file__).resolve().parents[1] / "data"
runner = CliRunner()

KEYS = {"model_type", "num_layers", "kda_layers", "mla_layers", "num_kda_layers", "num_mla_layers", "num_tensors",
        "num_params", "kda_state_bytes_per_request", "mla_bytes_per_token", "weights_present"}


def test_make_then_inspect(tmp_path):
    out = tmp_path / "ck"
    res = runner.invoke(app, ["checkpoint", "make", "--preset", "tiny-linear", "--out", str(out), "--shards", "2",
                              "--seed", "3"])
    assert res.exit_code == 0, res.output
    lines = res.stdout.strip().splitlines()
    assert lines[0] == str(out) and "tensors" in lines[1]
    assert (out / "config.json").is_file() and (out / "model.safetensors.index.json").is_file()

    res = runner.invoke(app, ["checkpoint", "inspect", str(out), "--json"])
    assert res.exit_code == 0, res.output
    info = json.loads(res.stdout)
    assert KEYS | {"missing_tensors", "unexpected_tensors"} <= info.keys()
    assert info["weights_present"] and info["missing_tensors"] == 0 and info["unexpected_tensors"] == 0
    assert info["mla_layers"] == [3, 7, 8]

    res = runner.invoke(app, ["checkpoint", "inspect", str(out)])
    assert res.exit_code == 0 and "kimi_linear" in res.stdout and "missing tensors" in res.stdout


def test_inspect_public_config_json():
    res = runner.invoke(app, ["checkpoint", "inspect", str(DATA / "kimi_k3_config.json"), "--json"])
    assert res.exit_code == 0, res.output
    info = json.loads(res.stdout)
    assert KEYS <= info.keys()
    assert (info["num_kda_layers"], info["num_mla_layers"]) == (69, 24) and not info["weights_present"]


def test_errors_exit_2(tmp_path):
    res = runner.invoke(app, ["checkpoint", "inspect", str(tmp_path / "missing")])
    assert res.exit_code == 2 and "no such file" in res.stderr and res.stdout == ""
    (tmp_path / "bad.json").write_text("{nope")
    res = runner.invoke(app, ["checkpoint", "inspect", str(tmp_path / "bad.json")])
    assert res.exit_code == 2 and "JSON" in res.stderr
    res = runner.invoke(app, ["checkpoint", "make", "--preset", "huge", "--out", str(tmp_path / "x")])
    assert res.exit_code == 2 and "unknown preset" in res.stderr
    assert not (tmp_path / "x").exists()


def test_entry_point_error_has_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "k3serve.cli.main", "checkpoint", "inspect",
                           str(tmp_path / "missing")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error:")
