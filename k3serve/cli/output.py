"""How commands print a result dict: indented JSON with --json, else one `key: value` line each."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from typing import TextIO


def emit(result: dict, as_json: bool, out: TextIO | None = None) -> None:
    """Print ``result`` to ``out`` (default: sys.stdout): indented JSON, or ``key: value`` lines."""
    out = out or sys.stdout
    if as_json:
        json.dump(result, out, indent=1)
        out.write("\n")
    else:
        for k, v in result.items():
            out.write(f"{k}: {v}\n")
    out.flush()


@contextlib.contextmanager
def results_only_stdout() -> Iterator[TextIO]:
    """Route everything written to stdout from now on to stderr and yield the real stdout for the result alone
    (``--json | jq`` works).

    Ray's driver threads, raylet messages relayed by native code and Ray's own shutdown at interpreter exit all
    write to file descriptor 1, not through ``sys.stdout`` (a drill whose node was killed had a raylet line land
    after its JSON report). So when stdout is a real file descriptor, fd 1 is pointed at stderr for the rest of
    the process (not restored: exit-time writers come after the result) and the yielded stream is a duplicate of
    the original fd 1. Where stdout is no file (an in-process test runner) only ``sys.stdout`` is swapped for the
    block."""
    real = sys.stdout
    try:
        fd = real.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError and a ValueError
        fd = -1
    if fd != 1:
        sys.stdout = sys.stderr
        try:
            yield real
        finally:
            sys.stdout = real
        return
    real.flush()
    result_stream = os.fdopen(os.dup(1), "w", encoding=real.encoding or "utf-8")
    os.dup2(2, 1)
    yield result_stream
