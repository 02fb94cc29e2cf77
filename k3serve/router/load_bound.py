"""What a router remembers of its own anonymous placements, for placement's load bound (docs/traffic.md).

Least expected TTFT alone is affinity at low load: the cluster holding a hot shared prefix stays the cheapest
until its queue outweighs what it saves, so one cluster computes most new conversations under it. The bound
(consistent hashing with bounded loads, applied to prefill tokens) moves such a request off a cluster whose
recent prefill work is above ``(1 + slack)`` times the fleet's mean, but only when what it would reuse there is a
*shared* prefix (seen continued by two or more different next blocks): replicating a system prompt costs one
recompute per cluster, while a conversation's next turn, whose match is its own history, always goes back to it.

Both records are the router's own (no Redis): each replica sees a share of the traffic in the same proportions,
so bounding its own sends bounds the fleet's. Pure and clock-free, so the fleet simulator runs them as they are.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["RecentLoad", "SharedPrefixes"]

_SHARED = -1  # a prefix hash seen with two or more different next blocks


class RecentLoad:
    """Prefill tokens sent to each cluster, each send's weight halving every ``half_life`` sends (a window over
    the recent traffic that a restarted or new cluster catches up with). O(1) per send: weights are stored
    scaled by a growing factor instead of decaying every entry."""

    def __init__(self, half_life: int = 2048) -> None:
        if half_life < 1:
            raise ValueError(f"half_life must be >= 1 send, got {half_life}")
        self._growth = 2.0 ** (1.0 / half_life)
        self._scale = 1.0
        self._stored: dict[str, float] = {}

    def add(self, cluster: str, tokens: float) -> None:
        self._scale *= self._growth
        self._stored[cluster] = self._stored.get(cluster, 0.0) + tokens * self._scale
        if self._scale > 1e100:  # renormalise long before float overflow
            self._stored = {c: v / self._scale for c, v in self._stored.items()}
            self._scale = 1.0

    def get(self, cluster: str) -> float:
        return self._stored.get(cluster, 0.0) / self._scale

    def snapshot(self) -> dict[str, float]:
        return {c: v / self._scale for c, v in self._stored.items()}


class SharedPrefixes:
    """Chained block hashes this router has seen followed by two or more different next blocks, in an LRU of
    ``capacity`` hashes. ``h in shared`` is what placement asks of the prefix a cluster would restore."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._next: OrderedDict[int, int] = OrderedDict()  # prefix hash -> its one next block, or _SHARED

    def observe(self, hashes: Sequence[int]) -> None:
        """Record a prompt's chained block hashes (each block's hash names its whole prefix)."""
        for prev, nxt in zip(hashes, hashes[1:]):
            seen = self._next.get(prev)
            if seen is None:
                self._next[prev] = nxt
            elif seen != nxt and seen != _SHARED:
                self._next[prev] = _SHARED
            self._next.move_to_end(prev)
        while len(self._next) > self.capacity:
            self._next.popitem(last=False)

    def __contains__(self, h: object) -> bool:
        return self._next.get(h) == _SHARED  # type: ignore[arg-type]

    def __len__(self) -> int:
        return sum(v == _SHARED for v in self._next.values())
