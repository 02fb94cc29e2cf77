"""API keys: who may call the router, kept as keyed digests (how much one key may hold: key_quota.py).

* Keys. The router keeps ``HMAC-SHA256(deployment secret, key)`` of each configured key, never the key, and
  admits a presented bearer token whose digest is among them: a memory dump or a repr shows no key, and the
  comparison's timing depends on a keyed digest the caller cannot steer.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable


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
