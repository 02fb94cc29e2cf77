"""The retry-after rule: when a refused request would fit its (cluster, class) budget, from the holders' published
expected ends and the waiters ahead (admission.py's rejections; slots.py's for its lateness factor)."""

from __future__ import annotations

from collections.abc import Sequence

# The holders' published ends are estimates made before the burst that refuses a request, so they run early: hints
# are scaled late rather than early, and spread (+0-10%) so that refused clients do not all come back at once.
HINT_LATENESS = 1.15
HINT_JITTER = 0.10
MIN_RETRY_AFTER_S = 0.05  # a hint of 0 invites a tight retry loop


def drain_wait_s(now_ms: int, holders: Sequence[tuple[int, int]], queued: int, queued_tokens: int, tokens: int,
                 budget: int, max_concurrent: int, round_s: float = 0.0) -> float:
    """Seconds until a request of ``tokens`` would fit one (cluster, class), if the holders (tokens, expected end
    ms) end when expected and the ``queued`` waiters ahead (``queued_tokens`` in all) get in first.

    The holders release in order of expected end; the answer is the first release after which the admission rule
    holds for the waiters ahead plus this request. A holder past its end is still running: it is taken to end half
    a round from now. If the waiters cannot all run at once, they run after the holders in FIFO rounds (as many as
    fit, each the mean of ``queued_tokens``), each round ``round_s`` long (a whole request's expected duration;
    0: the holders' mean remaining time), and the answer is the start of the round this request joins."""
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
