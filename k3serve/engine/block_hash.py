"""Chained block hashes: the identity of a prompt prefix in the hybrid prefix cache (docs/architecture.md §9, docs/security.md).

    key      = prefix_key(model_fingerprint(config), deployment secret)      32 bytes, per deployment and model
    hash_-1  = BLAKE2b-64(key, "salt" + utf8(tenant salt))
    hash_i   = BLAKE2b-64(key, le_u64(hash_{i-1}) + le_u32(tokens of block i))

Because each hash folds in its predecessor, block i's hash names the whole prefix ``[0, (i+1) * block_size)``:
one dict lookup per block finds the longest shared prefix. Keyed with the deployment secret, nobody outside the
deployment can compute a block's hash, so nobody can craft a block that collides with another prompt's (a hit
never compares tokens), or tell from published hashes which prompts are cached. The model fingerprint keeps
two models apart; the tenant salt (router/tenancy.py) keeps tenants apart: a hit, and the ``cached_tokens`` a
client sees, can only come from a prefix sent under the same salt.

Routers compute the same hashes as clusters: ``block_hashes(tokens, block_size, prefix_key(fp, secret), salt)``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from collections.abc import Sequence

import xxhash

_U64 = 1 << 64
_PERSON = b"k3s-prefix-v1"  # BLAKE2b personalisation: these hashes never equal another use of the same key


def prefix_key(fingerprint: int, secret: str) -> bytes:
    """The block-hash key of one deployment and model: HMAC-SHA256(secret, "k3serve-prefix-v1" + le_u64(fp)).

    An empty secret gives an unkeyed (public) key: only for single-process tools with one tenant."""
    if not 0 <= fingerprint < _U64:
        raise ValueError(f"fingerprint must be a uint64, got {fingerprint}")
    if not isinstance(secret, str):
        raise ValueError(f"secret must be a string, got {type(secret).__name__}")
    return hmac.new(secret.encode(), b"k3serve-prefix-v1" + fingerprint.to_bytes(8, "little"),
                    hashlib.sha256).digest()


def _h(key: bytes, data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, key=key, person=_PERSON).digest(), "little")


def block_hashes(tokens: Sequence[int], block_size: int, key: bytes, salt: str = "") -> list[int]:
    """Chained keyed hashes (uint64) of every FULL ``block_size``-token block of ``tokens`` under the tenant
    ``salt``; a partial tail block is not hashed. Tokens are hashed as little-endian uint32 (ValueError outside
    [0, 2**32)); ``key`` comes from ``prefix_key``."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    if not isinstance(key, bytes) or not 1 <= len(key) <= 64:
        raise ValueError("key must be 1-64 bytes (prefix_key's result)")
    pack = struct.Struct(f"<{block_size}I").pack
    out: list[int] = []
    prev = _h(key, b"salt" + salt.encode("utf-8"))
    for start in range(0, len(tokens) - block_size + 1, block_size):
        try:
            body = pack(*tokens[start : start + block_size])
        except struct.error as e:
            raise ValueError(f"token ids must be in [0, 2**32): block at {start}: {e}") from None
        prev = _h(key, prev.to_bytes(8, "little") + body)
        out.append(prev)
    return out


def model_fingerprint(config_dict: dict) -> int:
    """xxh64 of the canonical JSON of a model config (sorted keys, no whitespace): part of the hash key.

    Canonical so that key order or formatting of ``config.json`` never splits the cache.
    """
    canon = json.dumps(config_dict, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return xxhash.xxh64_intdigest(canon.encode("ascii"))
