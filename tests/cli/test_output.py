"""Result printing: JSON alone on stdout even when a deployment's threads print meanwhile."""

import json
import sys

from k3serve.cli.output import emit, results_only_stdout


def test_prints_during_a_run_go_to_stderr_and_the_result_alone_to_stdout(capsys):
    with results_only_stdout():
        print("(raylet) WARNING: something Ray relays to the driver")
    emit({"failed": 0, "mismatches": 0}, as_json=True)
    out, err = capsys.readouterr()
    assert json.loads(out) == {"failed": 0, "mismatches": 0}
    assert "raylet" in err and "raylet" not in out
    assert sys.stdout is not sys.stderr  # restored
