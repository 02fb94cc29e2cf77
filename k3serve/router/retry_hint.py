"""The retry-after rule: when a refused request would fit its (cluster, class) budget, from the holders' published
expected ends and the waiters ahead (used by admission.py's rejections and, for its factor, slots.py)."""

from __future__ import annotations

from collections.abc import Sequence

# The holders' published ends are estimates made before the burst that refuses a request, so they run early; hints are
# scaled by this factor: late rather than early (under a 200-stream burst, 1.15 centred hint / real wait on
# about 1).
HINT_LATENESS = 1.15
# Spread of the hints handed out together (+0-10%), so refused clients do not all come back at one instant. Kept
# small: within one burst the waits per cluster agree to ~10%, so a wider jitter alone would use up much of the 2x
# accuracy the hint promises.
HINT_JITTER = 0.10
# The holds in progress are right-censored holding times (admission_lua.HOLDERS): a holder older than the completed
# holds make typical (their mean + TYPICAL_SPREAD x their mean absolute deviation) is taken to hold its room
# CENSORED_FACTOR x its age in all (a lifetime known only to have lasted a has median 2a, its age as likely any
# fraction of it), so a service that slows down (a burst) shows in the hints at once (the rooms those holders hold
# come free later), not once those holds have ended.
CENSORED_FACTOR = 2.0
TYPICAL_SPREAD = 2.0


def drain_wait_s(now_ms: int, holders: Sequence[tuple[int, int]], queued: int, queued_tokens: int, tokens: int,
                 budget: int, max_concurrent: int, round_s: float = 0.0, turnover_s: float = 0.0,
                 since_turn_s: float = 0.0, held_ends_ms: Sequence[int] = ()) -> float:
    """Seconds until a request of ``tokens`` would fit one (cluster, class), if the holders (tokens, expected end
    ms) end when expected and the ``queued`` waiters ahead (``queued_tokens`` in all) get in first.

    The holders release in order of expected end; the answer is the first release after which the admission rule
    (``fits``) holds for the waiters ahead plus this request. If it never does (the waiters ahead cannot all run
    at once), they run after the holders in FIFO rounds (as many as fit; each waiter taken as the mean of
    ``queued_tokens``), each round as long as ``round_s`` (a whole request's expected duration: waiters start
    from scratch; 0: the holders' mean remaining time), and the answer is the start of the round this request
    joins.

    A holder past its published end is still running (its estimate ran early, as they do under a burst): it is
    taken to end half a round from now, not now (taken as ending now, slightly overdue holders made hints of one
    round where the wait was three). (One older than the typical completed hold has its end
    moved by admission_lua.HOLDERS to no earlier than admission + ``CENSORED_FACTOR`` x its age before it gets here.)

    Behind a line (``queued`` > 0) of a budget that binds by its concurrency cap, with a measured ``turnover_s``
    (the pace of places: the budget's mean holding time over ``max_concurrent``, admission_lua.RELEASE; before any
    request ended, the mean interval between admissions while the line was not empty, admission_lua.RESERVE): the
    place comes free after ``n = count + queued + 1 - max_concurrent`` more places have, at that pace, counted from
    the last admission ``since_turn_s`` ago (the next place is due one turnover after it, or is overdue: n x
    turnover less the part of it already gone, at most one). Measured holding times count what the published
    durations miss (a router or cluster slowed by the burst itself), and unlike the
    interval between admissions they are not set by the hints themselves (tickets.py, "Pace").

    ``held_ends_ms``: per holder, the end its hold is expected to reach (admission_lua.HOLDERS; -1: unknown, it
    bounds nothing): admission + the pace (a typical hold), or, for a holder that has held its room longer than the
    completed holds make typical, ``CENSORED_FACTOR`` x its age. Behind a line, the place is then no sooner free
    than the room of the ``min(n, count)``-th of the holders to end, plus a pace for each place beyond the holders:
    the completed holds' pace says how fast the places behind turn over, the holds in progress say when the rooms
    they hold come free. (The censored estimate as the pace of every place behind made the line move at that slow
    pace after the burst's first seconds, its rooms idle.) With no
    line ahead, the ends in ``holders`` decide; AdmissionRefusals.line_view gives each holder the later of its
    published end and this bound (at a burst's onset the published ends alone hint the first place far too
    early).
    """
    count = len(holders)
    if (turnover_s > 0 and queued > 0
            and sum(t for t, _ in holders) + queued_tokens + tokens <= budget):  # not bound by tokens
        n = max(count + queued + 1 - max_concurrent, 0)
        if not n:
            return 0.0
        wait = max(n * turnover_s - min(max(since_turn_s, 0.0), turnover_s), 0.0)
        if any(e >= 0 for e in held_ends_ms):
            ends = sorted([max(e - now_ms, 0) / 1000.0 for e in held_ends_ms if e >= 0]
                          + [0.0] * max(count - sum(e >= 0 for e in held_ends_ms), 0))
            k = min(n, len(ends))
            wait = max(wait, ends[k - 1] + max(n - len(ends), 0) * turnover_s)
        return wait
    if round_s > 0:
        overdue_end = now_ms + int(round_s * 500)
    else:
        ahead = [e - now_ms for _, e in holders if e > now_ms]
        overdue_end = now_ms + (int(sum(ahead) / len(ahead) / 2) if ahead else 0)
    ordered = sorted(((t, e if e > now_ms else overdue_end) for t, e in holders), key=lambda h: h[1])
    count, held = len(ordered), sum(t for t, _ in ordered)
    for k in range(count + 1):
        end = now_ms if k == 0 else ordered[k - 1][1]
        c, s = count - k, held - sum(t for t, _ in ordered[:k])
        if c + queued == 0 or (s + queued_tokens + tokens <= budget and c + queued < max_concurrent):
            return max(end - now_ms, 0) / 1000.0
    last = max(ordered[-1][1] - now_ms, 0) if ordered else 0
    mean = round_s * 1000.0 if round_s > 0 else (sum(max(e - now_ms, 0) for _, e in ordered) / count if count else 0.0)
    each = queued_tokens / queued if queued else 0.0
    sizes = [each] * queued + [float(tokens)]
    rounds, i = 0, 0
    while True:  # FIFO rounds; the first waiter of a round always gets in (it would run alone)
        used, n = sizes[i], 1
        while i + n < len(sizes) and n < max_concurrent and used + sizes[i + n] <= budget:
            used, n = used + sizes[i + n], n + 1
        if i + n >= len(sizes):
            return (last + rounds * mean) / 1000.0
        i, rounds = i + n, rounds + 1
