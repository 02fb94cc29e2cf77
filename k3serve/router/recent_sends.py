"""What one router has itself sent to each cluster, counted from the moment it decides (docs/traffic.md).

A cluster's published picture (prefix map, heartbeat load) is up to a heartbeat plus a refresh old. Between a
placement and that picture, this record stands in for it:

* **queued**: the prompt tokens of sends with no first token yet (prefill work waiting there);
* **pending prefixes**: the block hashes those prompts will leave checkpoints at (``expected_checkpoints``: the
  cache policy's boundaries past the expected hit), kept until ``publish_lag_s`` after the first token (when
  the cluster's own map has them), so the next request under the same prefix sees where it went;
* **recent**: the prefill tokens the router expected each cluster to compute, decayed with ``half_life_s``: the
  load that placement's bound (placement.place ``load_bound``) keeps within a factor of the fleet's mean.

Pure bookkeeping over a caller's clock (no Redis, no threads): the router's AnonymousPlacer and the fleet
simulator (k3serve/sim) keep it alike. Not thread-safe: the caller holds its lock.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Container, Hashable, Iterable, Sequence
from dataclasses import dataclass

from k3serve.contracts.prefix_policy import PrefixCachePolicy

__all__ = ["HALF_LIFE_S", "RecentSends", "Union", "expected_checkpoints"]

HALF_LIFE_S = 120.0  # the recent load's memory: long enough to span many requests per cluster


def expected_checkpoints(hashes: Sequence[int], prompt_len: int, cached: int, block_size: int,
                         policy: PrefixCachePolicy | None = None) -> list[int]:
    """The block hashes a cluster will hold checkpoints at once it has prefilled this prompt from ``cached``
    tokens: ``policy``'s boundaries (the branch point aside: where the cluster's pages end is not published),
    or without a policy the last full block's, which every scheme checkpoints."""
    if policy is not None:
        ends = policy.checkpoint_boundaries(prompt_len, cached)
    else:
        ends = [prompt_len // block_size * block_size] if prompt_len // block_size * block_size > cached else []
    return [hashes[e // block_size - 1] for e in ends if 0 < e // block_size <= len(hashes)]


class Union:
    """``a`` or ``b`` holds it (a published picture plus the hashes sent there and not yet published)."""

    __slots__ = ("a", "b")

    def __init__(self, a: Container[int], b: Container[int]) -> None:
        self.a, self.b = a, b

    def __contains__(self, h: object) -> bool:
        return h in self.b or h in self.a


@dataclass
class _Send:
    cluster: str
    tokens: int  # prompt tokens, counted as queued until the first token
    hashes: tuple[int, ...]
    until: float = math.inf  # pending prefixes are dropped after this time (set at the first token)


class _Decayed:
    """A sum that halves every ``half_life_s``: stored as of ``at``."""

    __slots__ = ("value", "at")

    def __init__(self) -> None:
        self.value, self.at = 0.0, 0.0

    def get(self, now: float, rate: float) -> float:
        return self.value * math.exp(-rate * (now - self.at)) if now > self.at else self.value

    def add(self, x: float, now: float, rate: float) -> None:
        self.value = self.get(now, rate) + x
        self.at = max(self.at, now)


class RecentSends:
    """One router's sends by request key: queued tokens, pending checkpoint hashes and decayed load per cluster."""

    def __init__(self, half_life_s: float = HALF_LIFE_S, publish_lag_s: float = 2.0) -> None:
        if not half_life_s > 0 or publish_lag_s < 0:
            raise ValueError(f"half_life_s must be > 0 and publish_lag_s >= 0, got {half_life_s}, {publish_lag_s}")
        self._rate = math.log(2) / half_life_s
        self.publish_lag_s = publish_lag_s
        self._sends: dict[Hashable, _Send] = {}
        self._queued: dict[str, int] = {}
        self._pending: dict[str, dict[int, int]] = {}  # cluster -> block hash -> sends holding it
        self._recent: dict[str, _Decayed] = {}
        self._total = _Decayed()
        self._expiry: list[tuple[float, int, Hashable]] = []  # (until, tie-break, key) of prefilled sends
        self._n = 0

    def sent(self, key: Hashable, cluster: str, tokens: int, hashes: Iterable[int], expected_uncached: float,
             now: float) -> None:
        """``key`` (a request) was just placed on ``cluster`` with a prompt of ``tokens`` tokens whose full blocks
        hash to ``hashes``, of which ``expected_uncached`` are expected to be computed there. A key placed again
        (a failover) leaves its earlier cluster."""
        if key in self._sends:
            self._forget(key)
        s = _Send(cluster, tokens, tuple(hashes))
        self._sends[key] = s
        self._queued[cluster] = self._queued.get(cluster, 0) + tokens
        pend = self._pending.setdefault(cluster, {})
        for h in s.hashes:
            pend[h] = pend.get(h, 0) + 1
        self._recent.setdefault(cluster, _Decayed()).add(expected_uncached, now, self._rate)
        self._total.add(expected_uncached, now, self._rate)

    def prefilled(self, key: Hashable, now: float) -> None:
        """``key``'s first token came (or it ended): no longer queued; its prefixes stay pending until the
        cluster has published them."""
        s = self._sends.get(key)
        if s is None or s.until != math.inf:
            return
        self._unqueue(s)
        s.until = now + self.publish_lag_s
        self._n += 1
        heapq.heappush(self._expiry, (s.until, self._n, key))

    def expire(self, now: float) -> None:
        """Drop the sends whose prefixes the clusters have published by now."""
        while self._expiry and self._expiry[0][0] <= now:
            until, _, key = heapq.heappop(self._expiry)
            s = self._sends.get(key)
            if s is not None and s.until == until:  # not placed again since
                self._forget(key)

    def forget(self, key: Hashable) -> None:
        """``key`` was never sent after all: neither queued nor pending (its recent load stays, decaying)."""
        if key in self._sends:
            self._forget(key)

    def drop_cluster(self, cluster: str, now: float) -> None:
        """``cluster`` is gone: nothing of it is counted."""
        for key in [k for k, s in self._sends.items() if s.cluster == cluster]:
            self._forget(key)
        d = self._recent.pop(cluster, None)
        if d is not None:
            self._total.add(-d.get(now, self._rate), now, self._rate)

    def queued(self, cluster: str) -> int:
        return self._queued.get(cluster, 0)

    def held(self, cluster: str, published: Container[int]) -> Container[int]:
        """``published`` plus the hashes sent to ``cluster`` and not yet published."""
        pend = self._pending.get(cluster)
        return Union(published, pend) if pend else published

    def recent(self, cluster: str, now: float) -> float:
        d = self._recent.get(cluster)
        return d.get(now, self._rate) if d is not None else 0.0

    def recent_total(self, now: float) -> float:
        """The decayed sum over the clusters not dropped."""
        return self._total.get(now, self._rate)

    def _unqueue(self, s: _Send) -> None:
        left = self._queued.get(s.cluster, 0) - s.tokens
        if left > 0:
            self._queued[s.cluster] = left
        else:
            self._queued.pop(s.cluster, None)

    def _forget(self, key: Hashable) -> None:
        s = self._sends.pop(key)
        if s.until == math.inf:
            self._unqueue(s)
        pend = self._pending.get(s.cluster, {})
        for h in s.hashes:
            n = pend.get(h, 0) - 1
            if n > 0:
                pend[h] = n
            else:
                pend.pop(h, None)
        if not pend:
            self._pending.pop(s.cluster, None)
