"""Rendezvous (highest-random-weight) hashing of sessions onto clusters (docs/architecture.md §11).

Each (key, cluster) pair gets a score ``xxh64(le_u32(len(key)) + key + cluster)`` (UTF-8; seed 0) and a key's
clusters are ranked by score, highest first. Primary = rank 0, secondary = rank 1. Why HRW rather than a ring:
when a cluster leaves, only its own keys move, and each of them moves to its own rank-1 cluster, which is an
independent draw per key, so the spill spreads evenly over all survivors (ANCHORS.md: the busiest of 7
survivors takes ~1.04x its fair share) instead of landing on one ring neighbour.

The formula is part of the wire contract: every router replica (and every version during a rolling upgrade)
must rank identically, so it uses only a fixed, seedless-by-process hash (never Python's ``hash``), and
``tests/router/test_hashing.py`` pins golden rankings.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence

import xxhash

__all__ = ["score", "rank_clusters", "primary_secondary", "pick_bounded", "session_key"]

_LEN = struct.Struct("<I")


def score(key: str, cluster: str) -> int:
    """The HRW weight of ``cluster`` for ``key`` (uint64).

    The key's length is hashed in front so that (key, cluster) pairs never alias by concatenation
    (``("ab", "c")`` vs ``("a", "bc")``).
    """
    kb = key.encode("utf-8")
    return xxhash.xxh64_intdigest(_LEN.pack(len(kb)) + kb + cluster.encode("utf-8"))


def rank_clusters(key: str, clusters: Sequence[str]) -> list[str]:
    """``clusters`` ordered by descending HRW score for ``key`` (ties, 2**-64 rare, broken by id).

    Raises ValueError on duplicate ids (a duplicate would get two chances and skew the spread).
    """
    if len(set(clusters)) != len(clusters):
        raise ValueError(f"duplicate cluster ids in {list(clusters)}")
    return sorted(clusters, key=lambda c: (score(key, c), c), reverse=True)


def primary_secondary(key: str, healthy: Sequence[str]) -> tuple[str, str | None]:
    """(best, second best) of the healthy clusters; the secondary is None with a single cluster.

    Raises ValueError when ``healthy`` is empty: there is nowhere to route.
    """
    if not healthy:
        raise ValueError("no healthy clusters to route to")
    ranked = rank_clusters(key, healthy)
    return ranked[0], (ranked[1] if len(ranked) > 1 else None)


def pick_bounded(
    key: str,
    clusters: Sequence[str],
    loads: Mapping[str, float],
    cap_factor: float = 1.25,
    cost: float = 1.0,
) -> str:
    """HRW with bounded load: the first cluster in ``key``'s HRW order whose load after adding ``cost`` stays
    within ``cap_factor`` times the mean load after adding it; the least loaded cluster (then HRW order) if none
    does.

    ``loads`` is token-weighted (e.g. in-flight plus queued tokens per cluster; a missing cluster counts 0) and
    ``cost`` is this request's tokens in the same unit. The cap is ``cap_factor * (sum(loads) + cost) / n``, so
    the chosen cluster ends within ``cap_factor`` x the new mean (and since the others do not grow, a system
    that starts within the cap stays within it), while a key leaves its HRW choice only when that choice is
    overloaded. The fallback matters when loads are tiny compared with
    ``cost`` (an idle system and one big request: no cluster can be within 1.25x of a mean that the request
    itself dominates).
    """
    if not clusters:
        raise ValueError("no clusters to pick from")
    if cap_factor < 1.0:
        raise ValueError(f"cap_factor must be >= 1 (a cap below the mean is unsatisfiable), got {cap_factor}")
    if cost < 0:
        raise ValueError(f"cost must be >= 0, got {cost}")
    ranked = rank_clusters(key, clusters)
    cur = {c: float(loads.get(c, 0.0)) for c in ranked}
    cap = cap_factor * (sum(cur.values()) + cost) / len(ranked)
    for c in ranked:
        if cur[c] + cost <= cap:
            return c
    # min() keeps the first of equal loads, i.e. the better HRW rank.
    return min(ranked, key=lambda c: cur[c])


def session_key(session_id: str, prompt_ids: Sequence[int], block_size: int = 512) -> str:
    """The routing key of a request: ``"s:" + session_id``, or when the client sent no session id,
    ``"p:" + hex xxh64`` of the first ``block_size`` prompt tokens (all of them if shorter).

    Hashing the first block sends requests that share a system prompt / first turn to the same cluster, where
    their MLA pages are cached (the prefix cache hashes at 512 tokens). The prefixes keep a session id from
    ever colliding with a prompt hash. Raises ValueError when both are empty.
    """
    if session_id:
        return "s:" + session_id
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    head = list(prompt_ids[:block_size])
    if not head:
        raise ValueError("a request needs a session id or a non-empty prompt to be routed")
    try:
        body = struct.pack(f"<{len(head)}I", *head)
    except struct.error as e:
        raise ValueError(f"token ids must be in [0, 2**32): {e}") from None
    return f"p:{xxhash.xxh64_hexdigest(body)}"
