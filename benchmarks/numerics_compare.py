"""Default vs deterministic numerics, measured in one run: the side-by-side block of `bench decode` / `prefix`.

The deterministic mode runs every forward at ``numerics.threads`` intra-op threads (1: contracts/numerics.py), so
its cost is measured against the default mode at that same thread count (``slowdown``): that is what a
deployment pays, whose ranks run ``torch_threads`` threads each (1 by default, cluster/deploy.py) in either mode.
When the bench was given another ``--threads``, the default mode's figures at that count are reported beside it
(``default_at_bench_threads``), so the cost of the mode's fixed thread count shows too."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from k3serve.contracts.numerics import DETERMINISTIC

TARGET_MAX_SLOWDOWN = 1.5  # issue #18: the mode may cost at most this much against the default mode


def _slowdown(default: dict[str, float], deterministic: dict[str, float], lower_is_better: bool) -> dict:
    return {k: (deterministic[k] / default[k] if lower_is_better else default[k] / deterministic[k])
            for k in default if k in deterministic and default[k] and deterministic[k]}


def numerics_side_by_side(default: dict[str, float], deterministic: dict[str, float], lower_is_better: bool,
                          threads: int = DETERMINISTIC.threads) -> dict:
    """Both modes' figures by key, each measured at `threads` intra-op threads, and the slowdown of deterministic
    (> 1: slower).

    lower_is_better: the figures are times (slowdown = det / default), else rates (default / det)."""
    slowdown = _slowdown(default, deterministic, lower_is_better)
    return {"default": default, "deterministic": deterministic, "slowdown": slowdown,
            "max_slowdown": max(slowdown.values()) if slowdown else None,
            "target_max_slowdown": TARGET_MAX_SLOWDOWN, "threads": threads,
            "note": f"both modes at {threads} intra-op thread(s): the deterministic mode's numerics.threads, and "
                    "what a deployment's ranks run (torch_threads, 1 by default) in either mode"}


def add_default_at_bench_threads(side: dict, default: dict[str, float], threads: int,
                                 lower_is_better: bool) -> dict:
    """Add to a side-by-side block the default mode's figures at the bench's own `threads` (when they differ
    from the mode's), with the deterministic mode's slowdown against them."""
    if threads != side["threads"]:
        side["default_at_bench_threads"] = {
            "threads": threads, "default": default,
            "slowdown": _slowdown(default, side["deterministic"], lower_is_better)}
    return side


@contextmanager
def mode_threads(threads: int = DETERMINISTIC.threads):
    """Run the side-by-side measurements at the deterministic mode's thread count (restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield before
    finally:
        torch.set_num_threads(before)
