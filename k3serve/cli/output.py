"""How commands print a result dict: indented JSON with --json, else one `key: value` line each."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator

import typer


def emit(result: dict, as_json: bool) -> None:
    if as_json:
        json.dump(result, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        for k, v in result.items():
            typer.echo(f"{k}: {v}")


@contextlib.contextmanager
def results_only_stdout() -> Iterator[None]:
    """Send what others print to stdout meanwhile (Ray's driver threads relay raylet and worker messages there)
    to stderr, so that a result emitted afterwards is all stdout holds (``--json | jq`` works)."""
    real = sys.stdout
    sys.stdout = sys.stderr
    try:
        yield
    finally:
        sys.stdout = real
