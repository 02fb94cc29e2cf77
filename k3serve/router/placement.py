"""Where a request without a session id runs: least expected time to first token over the clusters (docs/traffic.md).

```
 cost(c) = (prompt - cached(c) + queued(c)) / prefill_tps(c)        seconds until this prompt's first token
 cached(c) = deepest block end <= prompt - 1 whose block hash c holds a KDA checkpoint at (c publishes them)
 near-ties (cost within tie_frac of the best plus one block's prefill) -> rendezvous on the matched prefix
 extended by the prompt's next block: equal clusters spread new conversations under one system prompt, while a
 conversation's next turn, cached deeper on one cluster, is no tie and goes back there
 load bound (load_bound.py): when the chosen cluster would restore nothing or a shared prefix and its recent
 prefill tokens exceed (1 + load_slack) x its rate's share of the fleet's, the cheapest cluster under the bound
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
LOAD_SLACK = 0.1  # a cluster above 1.1x its share of recent prefill tokens takes no shared-prefix request


@dataclass(frozen=True)
class ClusterPicture:
    """What a router knows of one cluster: the block hashes a hit can end at there, the prefill work queued there
    (tokens not yet computed), its measured prefill rate (tokens/s) and the prefill tokens recently sent to it
    (load_bound.RecentLoad)."""

    cluster: str
    held: Container[int]
    queued_tokens: float = 0.0
    prefill_tps: float = 1.0
    recent_tokens: float = 0.0

    def __post_init__(self) -> None:
        if not self.prefill_tps > 0:
            raise ValueError(f"cluster {self.cluster}: prefill_tps must be > 0, got {self.prefill_tps}")
        if self.queued_tokens < 0:
            raise ValueError(f"cluster {self.cluster}: queued_tokens must be >= 0, got {self.queued_tokens}")
        if self.recent_tokens < 0:
            raise ValueError(f"cluster {self.cluster}: recent_tokens must be >= 0, got {self.recent_tokens}")


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
          tie_frac: float = 0.1, rng: random.Random | None = None, shared: Container[int] = frozenset(),
          load_slack: float | None = LOAD_SLACK) -> Placement:
    """Rank ``pictures`` (minus ``exclude``) for a prompt of ``prompt_len`` tokens whose full blocks hash to
    ``hashes``.

    ``prefix-load``: least expected TTFT, near-ties by rendezvous on the matched prefix plus one block
    (``fallback_key`` when the prompt has no full block), then the load bound (``load_slack``; None: off)
    for a request that would restore nothing on the chosen cluster or a prefix in ``shared``
    (load_bound.SharedPrefixes).
    ``first-block``: rendezvous on the first block alone
    (the old anonymous routing, kept as the baseline). ``random``: uniform (``rng``). ValueError when no cluster
    is left or the policy is unknown.
    """
    if policy not in POLICIES:
        raise ValueError(f"routing policy must be one of {POLICIES}, got {policy!r}")
    if not 0.0 <= tie_frac:
        raise ValueError(f"tie_frac must be >= 0, got {tie_frac}")
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
        best = min(cost.values())
        deepest = max(cached.values()) // block_size
        key = _key(hashes[:deepest + 1], fallback_key)
        near = [c for c in by_id if cost[c] <= best + tie_frac * (best + block_size / by_id[c].prefill_tps)]
        chosen = max(near, key=lambda c: (score(key, c), c))
        if load_slack is not None:
            chosen = _bounded(chosen, hashes, cached, cost, key, by_id, shared, load_slack, block_size)
        ranked = [chosen] + sorted((c for c in by_id if c != chosen), key=lambda c: (cost[c], -score(key, c), c))
    return Placement(tuple(ranked), *expected(ranked[0]))


def _bounded(chosen: str, hashes: Sequence[int], cached: dict[str, int], cost: dict[str, float], key: str,
             by_id: dict[str, ClusterPicture], shared: Container[int], slack: float, block_size: int) -> str:
    """Bounded loads: ``chosen`` unless what it would restore is nothing or a shared prefix and its recent
    prefill work is over the bound; then the cheapest cluster not over it (rendezvous on ``key`` among equal
    costs). Work is weighed against each cluster's rate: a cluster twice as fast takes twice the tokens."""
    depth = cached[chosen] // block_size
    if depth and hashes[depth - 1] not in shared:
        return chosen  # its own history (a conversation's earlier turns): affinity is the point
    share = sum(p.recent_tokens for p in by_id.values()) / sum(p.prefill_tps for p in by_id.values())

    def over(c: str) -> bool:
        return by_id[c].recent_tokens > (1.0 + slack) * share * by_id[c].prefill_tps

    if not over(chosen):
        return chosen
    under = [c for c in by_id if not over(c)]
    return min(under, key=lambda c: (cost[c], -score(key, c), c)) if under else chosen


def _key(hashes: Sequence[int], fallback: str) -> str:
    return f"b:{hashes[-1]:016x}" if hashes else f"r:{fallback}"
