"""How commands print a result dict: indented JSON with --json, else one `key: value` line each."""

from __future__ import annotations

import json
import sys

import typer


def emit(result: dict, as_json: bool) -> None:
    if as_json:
        json.dump(result, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        for k, v in result.items():
            typer.echo(f"{k}: {v}")
