"""Chained block hashes: the identity of a prompt prefix in the hybrid prefix cache (DESIGN.md §5).

``hash_i = xxh64(le_u64(hash_{i-1}) + le_u32(tokens of block i))`` with ``hash_{-1} = seed``. Because each hash
folds in its predecessor, block i's hash names the whole prefix ``[0, (i+1) * block_size)``: equal hashes mean
equal prefixes (up to a 64-bit collision), so one dict lookup per block finds the longest shared prefix.
The seed is the model fingerprint, so two models never share cache entries, mixed with the request's tenant
salt (``salted_seed``), so two tenants never share them either: a hit, and the ``cached_tokens`` a client sees,
can only come from a prefix sent under the same salt.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence

import xxhash

_U64 = 1 << 64


def block_hashes(tokens: Sequence[int], block_size: int, seed: int) -> list[int]:
    """Chained xxh64 of every FULL ``block_size``-token block of ``tokens``; a partial tail block is not hashed.

    Tokens are hashed as little-endian uint32 (ValueError outside [0, 2**32)); ``seed`` must fit in uint64.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    if not 0 <= seed < _U64:
        raise ValueError(f"seed must be a uint64, got {seed}")
    pack = struct.Struct(f"<{block_size}I").pack
    out: list[int] = []
    prev = seed
    for start in range(0, len(tokens) - block_size + 1, block_size):
        try:
            body = pack(*tokens[start : start + block_size])
        except struct.error as e:
            raise ValueError(f"token ids must be in [0, 2**32): block at {start}: {e}") from None
        prev = xxhash.xxh64_intdigest(prev.to_bytes(8, "little") + body)
        out.append(prev)
    return out


def model_fingerprint(config_dict: dict) -> int:
    """xxh64 of the canonical JSON of a model config (sorted keys, no whitespace): the hash seed.

    Canonical so that key order or formatting of ``config.json`` never splits the cache.
    """
    canon = json.dumps(config_dict, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return xxhash.xxh64_intdigest(canon.encode("ascii"))



def salted_seed(seed: int, salt: str) -> int:
    """The hash seed of one tenant: ``seed`` itself for the empty salt (the shared, unsalted cache), else
    ``xxh64(le_u64(seed) + utf8(salt))``. Every block hash chains from the seed, so salts partition the cache."""
    if not 0 <= seed < _U64:
        raise ValueError(f"seed must be a uint64, got {seed}")
    if not salt:
        return seed
    return xxhash.xxh64_intdigest(seed.to_bytes(8, "little") + salt.encode("utf-8"))
