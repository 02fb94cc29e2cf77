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
from collections.abc import Sequence

import xxhash

__all__ = ["score", "rank_clusters", "session_key"]

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
