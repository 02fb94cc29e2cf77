"""API keys: who may call the router, kept as keyed digests, and how much of a router one key may hold.

* Keys. The router keeps ``HMAC-SHA256(deployment secret, key)`` of each configured key, never the key, and
  admits a presented bearer token whose digest is among them: a memory dump or a repr shows no key, and the
  comparison's timing depends on a keyed digest the caller cannot steer.
* Quota. Per key (tenant) and per router replica: at most ``max_streams`` streams at once (waiting for admission
  or running) and at most ``max_queued`` of them waiting for admission, so one key cannot take every stream and
  queue place of a router. Over either: RESOURCE_EXHAUSTED with a retry hint. ``0`` turns a limit off.
"""

from __future__ import annotations

import hashlib
import hmac
import threading
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass


class ApiKeyError(ValueError):
    """A malformed ``api_keys`` setting; the message names the field."""


def check_api_keys(keys: object, where: str = "api_keys") -> tuple[str, ...]:
    """``keys`` as a tuple of non-empty strings, or ApiKeyError naming ``where``: a single string (which would
    become one key per character) or an empty or non-string entry (which would admit a missing header)."""
    if isinstance(keys, (str, bytes)) or not isinstance(keys, (list, tuple)):
        raise ApiKeyError(f"{where} must be a list of strings, got {type(keys).__name__}")
    for i, k in enumerate(keys):
        if not isinstance(k, str) or not k or k != k.strip():
            raise ApiKeyError(f"{where}[{i}] must be a non-empty string without surrounding spaces")
    return tuple(keys)


def key_digest(secret: str, key: str) -> bytes:
    return hmac.new(secret.encode(), b"api-key:" + key.encode(), hashlib.sha256).digest()


class ApiKeys:
    """The configured keys as digests; ``enabled`` is False when there are none (anonymous deployment)."""

    def __init__(self, secret: str, keys: Iterable[str]) -> None:
        self._secret = secret
        self._digests = frozenset(key_digest(secret, k) for k in check_api_keys(tuple(keys)))

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def __repr__(self) -> str:
        return f"ApiKeys({len(self._digests)} keys)"

    def admits(self, presented: str) -> bool:
        return bool(presented) and key_digest(self._secret, presented) in self._digests


@dataclass(frozen=True)
class QuotaLimits:
    """Per key and router replica; 0 = no limit."""

    max_streams: int = 0
    max_queued: int = 0

    @classmethod
    def resolve(cls, max_streams: int, max_queued: int, router_streams: int, keys: int) -> "QuotaLimits":
        """The deploy keys' values. ``max_streams`` 0 means the default: with two or more keys, half of the router's
        streams (which bounds the key's waiting requests too); with fewer keys there is nobody to share with, so no
        limit (a refusal then would leave streams idle). ``max_queued`` is off unless set: it counts every request
        inside admission, also one admitted at once, so a small default would refuse a key's concurrent arrivals
        while rooms are free."""
        if keys < 2:
            return cls(max_streams, max_queued)
        return cls(max_streams or max(1, router_streams // 2), max_queued)


class QuotaExceeded(Exception):
    """This key holds its share already; the message says which limit."""


class KeyQuota:
    def __init__(self, limits: QuotaLimits) -> None:
        self.limits = limits
        self._streams: Counter[str] = Counter()
        self._queued: Counter[str] = Counter()
        self._lock = threading.Lock()

    @contextmanager
    def stream(self, tenant: str) -> Iterator[None]:
        """Hold one of ``tenant``'s streams for the block; QuotaExceeded when it holds max_streams already."""
        with self._held(self._streams, tenant, self.limits.max_streams, "streams at once"):
            yield

    @contextmanager
    def queued(self, tenant: str) -> Iterator[None]:
        """Hold one of ``tenant``'s admission-queue places for the block (max_queued)."""
        with self._held(self._queued, tenant, self.limits.max_queued, "requests waiting for admission"):
            yield

    @contextmanager
    def _held(self, counts: Counter, tenant: str, limit: int, what: str) -> Iterator[None]:
        with self._lock:
            if limit and counts[tenant] >= limit:
                raise QuotaExceeded(f"this API key has {limit} {what} on this router (its limit)")
            counts[tenant] += 1
        try:
            yield
        finally:
            with self._lock:
                counts[tenant] -= 1
                if not counts[tenant]:
                    del counts[tenant]

    def held(self, tenant: str) -> tuple[int, int]:
        """(streams, queued) that ``tenant`` holds now."""
        with self._lock:
            return self._streams[tenant], self._queued[tenant]
