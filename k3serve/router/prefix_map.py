"""Which prefixes each cluster can resume, shared through Redis so every router replica sees the same picture.

A cluster publishes the block hashes its KDA checkpoints sit at (a hit can end only there; the blocks above a
checkpoint are cached with it) as one key per cluster: base64 of little-endian uint64s, newest first, at most
``MAX_HASHES`` (bounded by the checkpoint slot pool anyway), with a TTL of a few heartbeats so a dead cluster's
picture vanishes with it. Routers read every alive cluster's key in one MGET per membership refresh. Like
llm-d's precise prefix scorer, the picture is the engine's own index (not a router-side guess); unlike its event
stream, a whole snapshot per change keeps the reader stateless (a router that starts late or missed a message
is right at its next read).
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Collection, Sequence

import redis

from k3serve.router.membership import check_id, key_prefix, ttl_ms

MAX_HASHES = 65536  # 512 KiB of base64 per cluster at most


def encode(hashes: Collection[int]) -> str:
    """Base64 of the hashes as little-endian uint64 (ValueError outside [0, 2**64))."""
    try:
        return base64.b64encode(struct.pack(f"<{len(hashes)}Q", *hashes)).decode("ascii")
    except struct.error as e:
        raise ValueError(f"block hashes must be uint64: {e}") from None


def decode(text: str | bytes) -> frozenset[int]:
    raw = base64.b64decode(text, validate=True)
    if len(raw) % 8:
        raise ValueError(f"prefix map entry of {len(raw)} bytes is not a list of uint64")
    return frozenset(struct.unpack(f"<{len(raw) // 8}Q", raw))


class PrefixMap:
    """The published checkpoint hashes of one deployment namespace's clusters."""

    def __init__(self, client: redis.Redis, namespace: str) -> None:
        self._r = client
        self.prefix = key_prefix(namespace)

    def key(self, cluster_id: str) -> str:
        return f"{self.prefix}prefixes:{check_id('cluster id', cluster_id)}"

    def publish(self, cluster_id: str, hashes: Collection[int], ttl_s: float) -> None:
        """Replace ``cluster_id``'s picture (the first ``MAX_HASHES`` if more). Raises RedisError."""
        hs = list(hashes)[:MAX_HASHES]
        self._r.set(self.key(cluster_id), encode(hs), px=ttl_ms(ttl_s))

    def touch(self, cluster_id: str, ttl_s: float) -> bool:
        """Keep an unchanged picture alive; False when it is gone (publish it again). Raises RedisError."""
        return bool(self._r.pexpire(self.key(cluster_id), ttl_ms(ttl_s)))

    def clear(self, cluster_id: str) -> None:
        self._r.delete(self.key(cluster_id))

    def read(self, cluster_ids: Sequence[str]) -> dict[str, frozenset[int]]:
        """Every listed cluster's picture (empty when it has none or it is malformed). Raises RedisError."""
        if not cluster_ids:
            return {}
        out = {}
        for cid, raw in zip(cluster_ids, self._r.mget([self.key(c) for c in cluster_ids])):
            try:
                out[cid] = decode(raw) if raw else frozenset()
            except ValueError:
                out[cid] = frozenset()
        return out
