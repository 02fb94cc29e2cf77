"""A router's placement of requests without a session id: the published picture plus its own recent sends.

Reads the clusters' prefix maps (prefix_map.py) and heartbeat loads (``prefill_queued_tokens``,
``prefill_tps``) at each membership refresh, and counts the prefill tokens it has itself sent to each cluster
that have not yet produced a first token: a heartbeat is up to one beat old, and without its own count a burst
of arrivals would all see the same idle cluster. It also keeps what the load bound needs of its own placements
(load_bound.py: recent prefill tokens per cluster, prefixes seen shared). The decision itself is
placement.place (pure).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection, Sequence

import redis

from k3serve.engine.block_hash import block_hashes
from k3serve.router.load_bound import RecentLoad, SharedPrefixes
from k3serve.router.membership import MembershipSnapshot
from k3serve.router.placement import POLICIES, ClusterPicture, Placement, cached_tokens, place
from k3serve.router.prefix_map import PrefixMap

log = logging.getLogger(__name__)

DEFAULT_TPS = 2000.0  # tokens/s assumed while no cluster has measured its prefill rate


class AnonymousPlacer:
    """``key``: the clusters' block-hash key (engine.block_hash.prefix_key); ``policy``: one of placement.POLICIES."""

    def __init__(self, prefix_map: PrefixMap, key: bytes, block_size: int, policy: str = "prefix-load") -> None:
        if policy not in POLICIES:
            raise ValueError(f"anonymous routing policy must be one of {POLICIES}, got {policy!r}")
        self.prefix_map, self.key, self.block_size, self.policy = prefix_map, key, block_size, policy
        self._held: dict[str, frozenset[int]] = {}
        self._loads: dict[str, dict[str, float]] = {}
        self._sent: dict[str, int] = {}  # cluster -> prefill tokens sent by this router, no first token yet
        self._recent, self._shared = RecentLoad(), SharedPrefixes()
        self._lock = threading.Lock()

    def refresh(self, snap: MembershipSnapshot) -> None:
        """Re-read the pictures of ``snap``'s alive clusters (on Redis errors the last ones are kept)."""
        ids = snap.alive_ids()
        try:
            held = self.prefix_map.read(ids)
        except (redis.RedisError, OSError) as e:
            log.info("prefix maps not read (Redis: %s)", type(e).__name__)
            return
        with self._lock:
            self._held = held
            self._loads = {c.id: dict(c.load) for c in snap.clusters if c.alive}

    def choose(self, prompt_ids: Sequence[int], salt: str, routable: Sequence[str], exclude: Collection[str] = (),
               request_id: str = "") -> Placement:
        """Rank the routable clusters for this prompt and count its prefill against the chosen one. ValueError
        when none is left."""
        hashes = block_hashes(prompt_ids, self.block_size, self.key, salt)
        with self._lock:
            self._shared.observe(hashes)
            known = sorted(r for c in routable if (r := float(self._loads.get(c, {}).get("prefill_tps", 0.0))) > 0)
            unknown = known[len(known) // 2] if known else DEFAULT_TPS  # a new cluster: the fleet's median
            pics = []
            for c in routable:
                load = self._loads.get(c, {})
                queued = max(float(load.get("prefill_queued_tokens", 0.0)), float(self._sent.get(c, 0)))
                tps = float(load.get("prefill_tps", 0.0)) or unknown
                pics.append(ClusterPicture(c, self._held.get(c, frozenset()), queued, tps, self._recent.get(c)))
            got = place(len(prompt_ids), hashes, pics, self.block_size, policy=self.policy, exclude=exclude,
                        fallback_key=request_id, shared=self._shared)
            self._recent.add(got.cluster, len(prompt_ids) - got.cached_tokens)
        return got

    def cached_on(self, cluster: str, prompt_ids: Sequence[int], salt: str) -> int:
        """Tokens ``cluster`` is expected to restore for this prompt (its last published picture)."""
        with self._lock:
            held = self._held.get(cluster, frozenset())
        hashes = block_hashes(prompt_ids, self.block_size, self.key, salt)
        return cached_tokens(hashes, held, len(prompt_ids), self.block_size)

    def sent(self, cluster: str, tokens: int) -> None:
        with self._lock:
            self._sent[cluster] = self._sent.get(cluster, 0) + tokens

    def first_token(self, cluster: str, tokens: int) -> None:
        """The request sent with ``tokens`` to ``cluster`` has been prefilled (or ended): no longer queued there."""
        with self._lock:
            left = self._sent.get(cluster, 0) - tokens
            if left > 0:
                self._sent[cluster] = left
            else:
                self._sent.pop(cluster, None)
