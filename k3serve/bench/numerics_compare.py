"""Default vs deterministic numerics, measured in one run: the side-by-side block of `bench decode` / `prefix`."""

from __future__ import annotations


def numerics_side_by_side(default: dict[str, float], deterministic: dict[str, float],
                          lower_is_better: bool) -> dict:
    """Both modes' figures by key and the slowdown of deterministic (> 1: slower).

    lower_is_better: the figures are times (slowdown = det / default), else rates (default / det)."""
    slowdown = {k: (deterministic[k] / default[k] if lower_is_better else default[k] / deterministic[k])
                for k in default if default[k] and deterministic[k]}
    return {"default": default, "deterministic": deterministic, "slowdown": slowdown,
            "max_slowdown": max(slowdown.values()) if slowdown else None, "target_max_slowdown": 1.5,
            "note": "deterministic runs 1 intra-op thread (numerics.threads), default the --threads given"}
