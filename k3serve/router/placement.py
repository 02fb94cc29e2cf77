"""Where a request without a session id runs: least expected time to first token over the clusters (docs/traffic.md).

```
 cost(c) = (prompt - cached(c) + queued(c)) / prefill_tps(c)        seconds until this prompt's first token
 cached(c) = deepest block end <= prompt - 1 whose block hash c holds a KDA checkpoint at (c publishes them)
 near-ties (cost within tie_frac of the best plus one block's prefill) -> the least recent load, then
 rendezvous on the matched prefix extended by the prompt's next block: equal clusters spread new conversations
 under one system prompt, while a conversation's next turn, cached deeper on one cluster, is no tie and goes
 back there
 bounded load: only clusters with recent(c) + prompt - cached(c) <= load_bound * mean(recent) + the least
 prompt - cached anywhere are candidates (recent: prefill tokens placed there lately); else the one with the
 least recent(c) + prompt - cached(c). A hot prefix's cluster past the bound spills what it would compute to
 clusters below it, and a huge prompt goes where it leaves the least load
```
Sessions with an id keep rendezvous pins (pins.py); this module is pure (no Redis, no clock), so router replicas
given the same picture decide alike, and the fleet simulator (k3serve/sim) runs this very code. Hashes come from
``engine.block_hash`` with the clusters' seed, so the router and the clusters name prefixes alike.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Container, Sequence
from dataclasses import dataclass

from k3serve.router.hashing import rank_clusters, score

__all__ = ["POLICIES", "ClusterPicture", "Placement", "cached_tokens", "place"]

POLICIES = ("prefix-load", "first-block", "random")
LOAD_BOUND = 1.1  # prefix-load: a cluster's recent prefill tokens after this request, at most this x the mean


@dataclass(frozen=True)
class ClusterPicture:
    """What a router knows of one cluster: the block hashes a hit can end at there, the prefill work queued there
    (tokens not yet computed) and its measured prefill rate (tokens/s)."""

    cluster: str
    held: Container[int]
    queued_tokens: float = 0.0
    prefill_tps: float = 1.0
    recent_tokens: float = 0.0  # prefill tokens recently placed here (recent_sends.py): the bounded load

    def __post_init__(self) -> None:
        if not self.prefill_tps > 0:
            raise ValueError(f"cluster {self.cluster}: prefill_tps must be > 0, got {self.prefill_tps}")
        if self.queued_tokens < 0 or self.recent_tokens < 0:
            raise ValueError(f"cluster {self.cluster}: queued_tokens and recent_tokens must be >= 0, got "
                             f"{self.queued_tokens}, {self.recent_tokens}")


@dataclass(frozen=True)
class Placement:
    """The chosen cluster first, then the rest in the order a failover tries them (the same policy again)."""

    ranked: tuple[str, ...]
    cached_tokens: int  # expected restored tokens on ranked[0]
    expected_ttft_s: float  # on ranked[0]

    @property
    def cluster(self) -> str:
        return self.ranked[0]


def cached_tokens(hashes: Sequence[int], held: Container[int], prompt_len: int, block_size: int) -> int:
    """Tokens a cluster holding ``held`` restores for a prompt of ``prompt_len`` tokens with chained block
    ``hashes``: the deepest checkpointed block end strictly before the prompt's end (the engine's own clamp)."""
    top = min(len(hashes), max(prompt_len - 1, 0) // block_size)
    for k in range(top, 0, -1):
        if hashes[k - 1] in held:
            return k * block_size
    return 0


def place(prompt_len: int, hashes: Sequence[int], pictures: Sequence[ClusterPicture], block_size: int, *,
          policy: str = "prefix-load", exclude: Collection[str] = (), fallback_key: str = "",
          tie_frac: float = 0.1, rng: random.Random | None = None, load_bound: float | None = LOAD_BOUND,
          slack_tokens: float | None = None, mean_recent: float | None = None) -> Placement:
    """Rank ``pictures`` (minus ``exclude``) for a prompt of ``prompt_len`` tokens whose full blocks hash to
    ``hashes``.

    ``prefix-load``: least expected TTFT, near-ties by the least ``recent_tokens`` then rendezvous on the matched
    prefix plus one block
    (``fallback_key`` when the prompt has no full block), among the clusters within the load bound:
    ``recent_tokens + uncached <= load_bound * mean_recent + slack_tokens`` (``mean_recent``: the fleet's mean,
    default the pictures'; ``slack_tokens``: default the least uncached over the clusters; ``load_bound`` None,
    or a mean of 0: no bound), else the least loaded after it.
    ``first-block``: rendezvous on the first block alone
    (the old anonymous routing, kept as the baseline). ``random``: uniform (``rng``). ValueError when no cluster
    is left or the policy is unknown.
    """
    if policy not in POLICIES:
        raise ValueError(f"routing policy must be one of {POLICIES}, got {policy!r}")
    if not 0.0 <= tie_frac:
        raise ValueError(f"tie_frac must be >= 0, got {tie_frac}")
    if load_bound is not None and not load_bound >= 1.0:
        raise ValueError(f"load_bound must be >= 1 (a bound below the mean is unsatisfiable), got {load_bound}")
    pics = [p for p in pictures if p.cluster not in exclude]
    if not pics:
        raise ValueError("no clusters to place the request on")
    by_id = {p.cluster: p for p in pics}

    def expected(c: str) -> tuple[int, float]:
        cached = cached_tokens(hashes, by_id[c].held, prompt_len, block_size)
        return cached, (prompt_len - cached + by_id[c].queued_tokens) / by_id[c].prefill_tps

    if policy == "first-block":
        ranked = rank_clusters(_key(hashes[:1], fallback_key), list(by_id))
    elif policy == "random":
        ranked = list(by_id)
        (rng or random.Random()).shuffle(ranked)
    else:
        both = {c: expected(c) for c in by_id}
        cached = {c: v[0] for c, v in both.items()}
        cost = {c: v[1] for c, v in both.items()}
        pool = list(by_id)
        mean = sum(p.recent_tokens for p in pics) / len(pics) if mean_recent is None else mean_recent
        if load_bound is not None and mean > 0:  # nothing placed lately: no mean to bound by
            after = {c: by_id[c].recent_tokens + prompt_len - cached[c] for c in pool}
            least = prompt_len - max(cached.values())  # the least this request adds anywhere
            cap = load_bound * mean + (least if slack_tokens is None else slack_tokens)
            pool = [c for c in pool if after[c] <= cap] or [
                min(pool, key=lambda c: (after[c], cost[c], -score(_key(hashes[:1], fallback_key), c), c))]
        best = min(cost[c] for c in pool)
        deepest = max(cached[c] for c in pool) // block_size
        key = _key(hashes[:deepest + 1], fallback_key)
        near = [c for c in pool if cost[c] <= best + tie_frac * (best + block_size / by_id[c].prefill_tps)]
        chosen = min(near, key=lambda c: (by_id[c].recent_tokens, -score(key, c), c))
        ranked = [chosen] + sorted((c for c in by_id if c != chosen), key=lambda c: (cost[c], -score(key, c), c))
    return Placement(tuple(ranked), *expected(ranked[0]))


def _key(hashes: Sequence[int], fallback: str) -> str:
    return f"b:{hashes[-1]:016x}" if hashes else f"r:{fallback}"
