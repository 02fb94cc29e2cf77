"""A --json report is all stdout holds, whatever else writes to file descriptor 1 (Ray's native threads, exit
handlers): k3serve.cli.output.results_only_stdout."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import atexit, os
from k3serve.cli.output import emit, results_only_stdout
atexit.register(lambda: os.write(1, b"native write at exit\\\\n"))
with results_only_stdout() as out:
    print("python print inside")
    os.write(1, b"native write inside\\\\n")
emit({"requests": 3, "failed": 0}, True, out)
print("python print after")
"""


def test_json_report_alone_on_stdout_and_the_rest_on_stderr():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"requests": 3, "failed": 0}
    for line in ("python print inside", "native write inside", "native write at exit", "python print after"):
        assert line in proc.stderr


def test_in_process_runner_without_a_file_descriptor_keeps_working(capsys):
    import io

    from k3serve.cli.output import emit, results_only_stdout

    fake = io.StringIO()
    real, sys.stdout = sys.stdout, fake
    try:
        with results_only_stdout() as out:
            print("noise")
        emit({"a": 1}, True, out)
    finally:
        sys.stdout = real
    assert json.loads(fake.getvalue()) == {"a": 1}
    assert "noise" in capsys.readouterr().err
