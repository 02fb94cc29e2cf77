"""Result types of the hybrid prefix cache (docs/architecture.md §9), kept apart from the cache's mutable index, and
how valuable a saved checkpoint is when something has to go (a pure function). Where checkpoints are saved is the
policy's (``contracts/prefix_policy.py``), which the router shares."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PrefixHit:
    """Result of :meth:`HybridPrefixCache.lookup`.

    ``pages`` cover positions ``[0, num_tokens)`` and carry one reference each for the caller (decref them via
    the PageAllocator when the request ends). ``checkpoint_slot`` is the cache's KDA checkpoint at
    ``num_tokens``: copy it into the request's private slot, then ``release(hit)``; until then ``lease`` pins
    it against eviction. ``matched_blocks`` is the hash-match depth before clamping to a checkpoint (stats).
    """

    num_tokens: int
    pages: tuple[int, ...]
    checkpoint_slot: int | None
    matched_blocks: int
    lease: int | None = None

    @property
    def hit(self) -> bool:
        return self.num_tokens > 0


@dataclass(frozen=True)
class CheckpointInfo:
    """A snapshot of one cached KDA checkpoint (introspection and tests)."""

    slot: int
    num_tokens: int
    session_id: str
    last_used: int
    pinned: bool


def checkpoint_scores(last_used: Sequence[int], depths: Sequence[int], alpha: float,
                      served: Sequence[int] | None = None, beta: float = 0.0) -> list[float]:
    """Value of each checkpoint in a candidate set; the lowest is evicted first (Marconi-style).

    ``score = recency + alpha * depth / max(depths) + beta * log1p(served) / log1p(max(served))`` with
    ``recency = (t - t_min) / (t_max - t_min)`` over the set (1.0 when all ties). Depth stands for the prefill it
    saves per byte: every checkpoint costs the same bytes (all KDA layers at one boundary) and saves ``depth``
    tokens of prefill; ``served`` (hits it gave) for how often it will be used again, logarithmic so one hot
    system prompt does not make every other entry worthless. Each term is normalised to [0, 1], so ``alpha`` and
    ``beta`` are unit-free.
    """
    if len(last_used) != len(depths) or (served is not None and len(served) != len(depths)):
        raise ValueError("last_used, depths and served differ in length")
    if not last_used:
        return []
    t_min, t_max = min(last_used), max(last_used)
    span = t_max - t_min
    d_max = max(depths) or 1
    out = [((t - t_min) / span if span else 1.0) + alpha * d / d_max for t, d in zip(last_used, depths)]
    if served is not None and beta and max(served) > 0:
        s_max = math.log1p(max(served))
        out = [v + beta * math.log1p(s) / s_max for v, s in zip(out, served)]
    return out
