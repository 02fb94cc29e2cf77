"""Keyed MACs of the chunks a data plane lands in registered memory (the Mooncake plane).

Any peer of the Mooncake engine can write a receiver's registered region (it authenticates nobody), and CRC32C
is no defence against a deliberate rewrite: a change that keeps the CRC is easy to compute. So the sender seals
each landed chunk with a MAC under the deployment secret, sent in its header over the control channel, and the
receiver checks it over its private copy of the chunk, after the copy (staging.py ``land``): whatever was in the
region before the copy, only the sender's bytes pass.

    key  = HMAC-SHA256(secret, "k3serve-chunk-v1" | nonce | transfer id | prefill rank | seq)   one-time key
    mac  = nonce (16 random bytes) || Poly1305(key, chunk bytes)                                 32 bytes

Poly1305 (OpenSSL, through the ``cryptography`` package) runs at memory speed; it needs a key used for one
message only, which the random nonce of every sealing gives.
"""

from __future__ import annotations

import hmac
import secrets

from cryptography.hazmat.primitives.poly1305 import Poly1305

NONCE_BYTES = 16
MAC_BYTES = NONCE_BYTES + 16
_DOMAIN = b"k3serve-chunk-v1"


def _key(secret: str, nonce: bytes, transfer_id: str, src: int, seq: int) -> bytes:
    msg = b"\n".join((_DOMAIN, nonce.hex().encode(), transfer_id.encode(), b"%d" % src, b"%d" % seq))
    return hmac.digest(secret.encode(), msg, "sha256")


def seal(secret: str, transfer_id: str, src: int, seq: int, data) -> bytes:
    """The MAC of chunk `seq` of prefill rank `src` in `transfer_id` over `data` (any bytes-like object)."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    return nonce + Poly1305.generate_tag(_key(secret, nonce, transfer_id, src, seq), data)


def check(secret: str, transfer_id: str, src: int, seq: int, data, mac: bytes) -> bool:
    """Whether `mac` is the sender's seal of exactly `data` (constant-time comparison)."""
    if len(mac) != MAC_BYTES:
        return False
    nonce, tag = mac[:NONCE_BYTES], mac[NONCE_BYTES:]
    return hmac.compare_digest(Poly1305.generate_tag(_key(secret, nonce, transfer_id, src, seq), data), tag)
