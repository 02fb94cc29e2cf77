"""Who a request belongs to, for the prefix cache: the tenant salt and the cache identity (session) on a cluster.

* Salt. With API keys configured the tenant is its key: ``HMAC(deployment secret, key)``; a request may add
  ``cache_salt`` to split its tenant further (e.g. per end user). The cluster mixes the salt into the block-hash
  chain (engine/block_hash.block_hashes), so prefixes are shared, and ``usage.cached_tokens`` can be non-zero,
  only between requests of one (tenant, cache_salt): no tenant can probe another's prompts by their hits or
  timing. Without API keys and without ``cache_salt`` the salt is empty: one shared cache (the old behaviour).
* Request ids. With API keys every request id is scoped by its tenant before it reaches admission or a cluster
  (``scoped_request_id``): ids are the client's own namespace, not the deployment's.
* Cache identity. The cluster caps KDA checkpoints per identity (a fairness guard; the slot pool is the budget).
  A request without a session id is identified by its whole prompt (``anonymous_identity``): a shared first
  block (a system prompt) must not make every anonymous conversation one identity with one cap. The identity
  carries the salt's head, so two tenants that pick one session id neither share a pin nor a checkpoint budget.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence

import xxhash

from k3serve.router.hashing import session_key

SALT_HEX = 32  # hex characters of the salt sent to clusters (128 bits)
_SCOPE_HEX = 16  # of which the cache identity carries this many
TENANT_HEX = 16  # hex characters of the tenant id that scopes request ids (64 bits)


def _tenant(secret: str, api_key: str) -> bytes:
    return hmac.new(secret.encode(), b"tenant:" + api_key.encode(), hashlib.sha256).digest() if api_key else b""


def tenant_salt(secret: str, api_key: str, cache_salt: str) -> str:
    """The salt of a request: '' when there is neither a tenant (no API keys) nor a ``cache_salt``."""
    if not api_key and not cache_salt:
        return ""
    return hashlib.sha256(_tenant(secret, api_key) + b"\x00" + cache_salt.encode("utf-8")).hexdigest()[:SALT_HEX]


def tenant_id(secret: str, api_key: str) -> str:
    """Who a request belongs to, for request ids and quotas: '' without API keys (one tenant), else a keyed
    digest of the key (never the key itself)."""
    return _tenant(secret, api_key).hex()[:TENANT_HEX]


def scoped_request_id(tenant: str, request_id: str) -> str:
    """The id a request has from the router on (admission, clusters): the client's id under its tenant, so two
    tenants that pick one id never collide (neither ALREADY_EXISTS nor one's cancel reaching the other)."""
    return f"{tenant}~{request_id}" if tenant else request_id


def anonymous_identity(prompt_ids: Sequence[int]) -> str:
    """``"a:"`` + xxh64 of the whole prompt (uint32 little-endian): one identity per request of a conversation."""
    try:
        body = struct.pack(f"<{len(prompt_ids)}I", *prompt_ids)
    except struct.error as e:
        raise ValueError(f"token ids must be in [0, 2**32): {e}") from None
    return f"a:{xxhash.xxh64_hexdigest(body)}"


def cache_identity(session_id: str, prompt_ids, salt: str, block_size: int) -> str:
    """The session id the cluster caps checkpoints under, and for a session its routing key (pins, HRW).

    '#' never occurs in a session id (validate.py), so a scoped key never equals an unscoped one."""
    key = session_key(session_id, prompt_ids, block_size) if session_id else anonymous_identity(prompt_ids)
    return f"{key}#{salt[:_SCOPE_HEX]}" if salt else key
