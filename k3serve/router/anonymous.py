"""A router's placement of requests without a session id: the published picture plus its own recent sends.

Reads the clusters' prefix maps (prefix_map.py) and heartbeat loads (``prefill_queued_tokens``,
``prefill_tps``) at each membership refresh. A picture is up to a heartbeat plus a refresh old, so from the
moment it decides, the router also counts what it has itself sent (recent_sends.py): the prompt tokens with no
first token yet (queued there), their block hashes until the cluster has published them (the next request
under the same prefix follows), and the prefill tokens it placed per cluster, decayed (the bounded load). The
decision itself is placement.place (pure).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection, Sequence

import redis

from k3serve.engine.block_hash import block_hashes
from k3serve.contracts.prefix_policy import PrefixCachePolicy
from k3serve.router.membership import MembershipSnapshot
from k3serve.router.placement import POLICIES, ClusterPicture, Placement, cached_tokens, place
from k3serve.router.prefix_map import PrefixMap
from k3serve.router.recent_sends import RecentSends, expected_checkpoints

log = logging.getLogger(__name__)

DEFAULT_TPS = 2000.0  # tokens/s assumed while no cluster has measured its prefill rate
PUBLISH_LAG_S = 2.0  # after a first token, until the cluster's map (heartbeat + router refresh) shows the prefix


class AnonymousPlacer:
    """``key``: the clusters' block-hash key (engine.block_hash.prefix_key); ``policy``: one of placement.POLICIES;
    ``cache_policy``: the clusters' prefix-cache policy (where a sent prompt will leave checkpoints; default: at
    its last full block); ``clock``: seconds (monotonic)."""

    def __init__(self, prefix_map: PrefixMap, key: bytes, block_size: int, policy: str = "prefix-load", *,
                 cache_policy: PrefixCachePolicy | None = None, publish_lag_s: float = PUBLISH_LAG_S,
                 clock=time.monotonic) -> None:
        if cache_policy is not None and cache_policy.block_size != block_size:
            raise ValueError(f"cache_policy's block ({cache_policy.block_size}) is not block_size ({block_size})")
        if policy not in POLICIES:
            raise ValueError(f"anonymous routing policy must be one of {POLICIES}, got {policy!r}")
        self.prefix_map, self.key, self.block_size, self.policy = prefix_map, key, block_size, policy
        self._held: dict[str, frozenset[int]] = {}
        self._loads: dict[str, dict[str, float]] = {}
        self.cache_policy = cache_policy
        self._sends = RecentSends(publish_lag_s=publish_lag_s)
        self._clock = clock
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
            for gone in set(self._held) - set(held):
                self._sends.drop_cluster(gone, self._clock())
            self._held = held
            self._loads = {c.id: dict(c.load) for c in snap.clusters if c.alive}

    def choose(self, prompt_ids: Sequence[int], salt: str, routable: Sequence[str], exclude: Collection[str] = (),
               request_id: str = "") -> Placement:
        """Rank the routable clusters for this prompt and count it as sent to the first (under ``request_id``: a
        failover's choice replaces the earlier one; ``first_token`` ends its queued part). ValueError when none
        is left."""
        hashes = block_hashes(prompt_ids, self.block_size, self.key, salt)
        with self._lock:
            now = self._clock()
            self._sends.expire(now)
            known = sorted(r for c in routable if (r := float(self._loads.get(c, {}).get("prefill_tps", 0.0))) > 0)
            unknown = known[len(known) // 2] if known else DEFAULT_TPS  # a new cluster: the fleet's median
            pics = []
            for c in routable:
                load = self._loads.get(c, {})
                queued = max(float(load.get("prefill_queued_tokens", 0.0)), float(self._sends.queued(c)))
                tps = float(load.get("prefill_tps", 0.0)) or unknown
                pics.append(ClusterPicture(c, self._sends.held(c, self._held.get(c, frozenset())), queued, tps,
                                           self._sends.recent(c, now)))
            placed = place(len(prompt_ids), hashes, pics, self.block_size, policy=self.policy, exclude=exclude,
                           fallback_key=request_id)
            key = request_id or object()  # without an id nothing will report its first token: not counted queued
            n = len(prompt_ids)
            ckpts = expected_checkpoints(hashes, n, placed.cached_tokens, self.block_size, self.cache_policy)
            self._sends.sent(key, placed.cluster, n, ckpts, n - placed.cached_tokens, now)
            if not request_id:
                self._sends.prefilled(key, now)
        return placed

    def cached_on(self, cluster: str, prompt_ids: Sequence[int], salt: str) -> int:
        """Tokens ``cluster`` is expected to restore for this prompt (its last published picture)."""
        with self._lock:
            held = self._held.get(cluster, frozenset())
        hashes = block_hashes(prompt_ids, self.block_size, self.key, salt)
        return cached_tokens(hashes, held, len(prompt_ids), self.block_size)

    def first_token(self, request_id: str) -> None:
        """``request_id``'s first token came, or it ended: no longer queued where it was sent (idempotent)."""
        with self._lock:
            self._sends.prefilled(request_id, self._clock())

    def refused(self, request_id: str) -> None:
        """``request_id`` was chosen a cluster but never sent there (refused at the door): not counted at all."""
        with self._lock:
            self._sends.forget(request_id)
