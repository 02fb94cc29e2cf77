"""The JSON report of one router load burst (``router_load.LoadOutcome``): behaviour counts and timing figures.

Issue #19's target is every retry-after hint within 2x of the measured wait; ``hints.all_within_2x`` says whether
this run met it and ``hints.within_2x_fraction`` how far it got. Most misses are hints handed out in the first
seconds of a burst, paced by holding times learned before it, while the burst's own first requests run 2-4x longer
(docs/architecture.md): ``within_2x_after_onset_fraction`` counts the hints from ``onset_s`` on apart.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from k3serve.bench.router_load import LoadOutcome


def _quantile(xs: list[float], q: float) -> float | None:
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3) if xs else None


def _fraction(xs: list[float]) -> float | None:
    return round(sum(0.5 <= r <= 2.0 for r in xs) / len(xs), 3) if xs else None


def hint_ratios(outcome: LoadOutcome) -> tuple[list[float], list[float], int]:
    """(hint / measured wait of every refusal whose budget was seen with a room after it, the same for refusals
    from ``onset_s`` into the burst on, how many never saw one). Both sides are floored at ``floor_s``."""
    s = outcome.setup
    ratios, late, unseen = [], [], 0
    for x, wait in outcome.waits():
        if wait is None:
            unseen += 1
            continue
        r = max(x.hint_s, s.floor_s) / max(wait, s.floor_s)
        ratios.append(r)
        if x.at - outcome.started >= s.onset_s:
            late.append(r)
    return ratios, late, unseen


def load_figures(outcome: LoadOutcome) -> dict:
    s, mon = outcome.setup, outcome.monitor
    ratios, late, unseen = hint_ratios(outcome)
    q = sorted(ratios)
    refusals = outcome.refusals
    max_count, max_tokens = outcome.max_in_flight()
    return {
        "streams": len(outcome.results),
        "completed": sum(r.status == "ok" and r.tokens == s.max_tokens for r in outcome.results),
        "elapsed_s": round(outcome.elapsed_s, 2),
        "refusals": len(refusals),
        "refused_at_router_stream_limit": sum(x.rejected_by.startswith("router") for x in refusals),
        "refused_with_room_sampled": outcome.refused_with_room(),
        "busy_fraction": round(outcome.busy(), 3),
        "hints": {
            "measured": len(ratios),
            "room_never_seen": unseen,
            "within_2x_fraction": _fraction(ratios),
            "within_2x_after_onset_fraction": _fraction(late),
            "all_within_2x": bool(ratios) and all(0.5 <= r <= 2.0 for r in ratios),
            "ratio_min": _quantile(q, 0.0), "ratio_p10": _quantile(q, 0.1), "ratio_median": _quantile(q, 0.5),
            "ratio_p90": _quantile(q, 0.9), "ratio_max": round(q[-1], 3) if q else None,
        },
        "clients_lateness_max_s": round(max(outcome.lateness_s, default=0.0), 3),
        "max_in_flight_per_cluster": max_count,
        "max_in_flight_tokens_per_cluster": max_tokens,
        "budget": {"max_concurrent": s.max_concurrent, "queue": s.queue, "clusters": len(mon.clusters)},
        "probes": mon.probes,
        "probe_failures": len(mon.probe_failures),
        "monitor_samples": len(mon.samples),
        "monitor_sample_failures": len(mon.sample_failures),
        "learned_durations": outcome.learned,
    }
