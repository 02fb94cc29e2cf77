"""Authenticated encryption of the chunks a data plane moves through registered memory (the Mooncake plane).

Any peer of the Mooncake engine can read and write a registered region (it authenticates nobody), and CRC32C is
no defence against a deliberate rewrite. So the sender encrypts each source range of the state from private
memory straight into its send region (AES-256-GCM), and the receiver decrypts from its landing region straight
into its private copy (the decrypt is the copy): the regions only ever hold ciphertext, and a chunk whose tag
fails is refused. The nonce and tag travel in the chunk's header over the control channel.

    key  = HMAC-SHA256(secret, "k3serve-chunk-v2" | nonce | transfer id | prefill rank | kind | src_byte | length)
    seal = nonce (16 random bytes) || GCM tag (16 bytes)                                               32 bytes

The key is used for one encryption only (the random nonce of every sealing), so the GCM IV is the nonce's first
12 bytes. A range is named by its place in the prefill rank's tensor, not by a stream's seq, so an MLA range that
goes to every decode rank is encrypted once; the receiver derives the range from its own plan.
AES-GCM (OpenSSL, through the ``cryptography`` package) is the AEAD whose detached tag lets both sides stream
into the regions in place; it also beat ChaCha20-Poly1305 here (AES instructions).
"""

from __future__ import annotations

import hmac
import secrets

import google_crc32c
import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from k3serve.transfer.copy_crc import PLACE_BLOCK_BYTES

NONCE_BYTES = 16
TAG_BYTES = 16
SEAL_BYTES = NONCE_BYTES + TAG_BYTES
_DOMAIN = b"k3serve-chunk-v2"


def _cipher(secret: str, nonce: bytes, transfer_id: str, src: int, kind: str, src_byte: int, length: int,
            tag: bytes | None = None) -> Cipher:
    msg = b"\n".join((_DOMAIN, nonce.hex().encode(), transfer_id.encode(), b"%d" % src, kind.encode(),
                      b"%d" % src_byte, b"%d" % length))
    return Cipher(algorithms.AES(hmac.digest(secret.encode(), msg, "sha256")), modes.GCM(nonce[:12], tag))


def seal_into(secret: str, transfer_id: str, src: int, kind: str, src_byte: int, out: np.ndarray, data) -> bytes:
    """Encrypt `data` (the private bytes of range `src_byte` of `kind` of prefill rank `src`) into `out` (uint8,
    same length: the send region) and return the seal, nonce || tag, for the chunk's header."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    enc = _cipher(secret, nonce, transfer_id, src, kind, src_byte, out.nbytes).encryptor()
    if enc.update_into(data, out) != out.nbytes:
        raise ValueError(f"seal_into: {np.frombuffer(data, np.uint8).nbytes} bytes into {out.nbytes}")
    enc.finalize()
    return nonce + enc.tag


def open_crc32c(secret: str, transfer_id: str, src: int, kind: str, src_byte: int, out: np.ndarray, data,
                seal: bytes) -> tuple[bool, int]:
    """Decrypt `data` (a landed range, ciphertext) into `out` (uint8, private) in L2-sized blocks, each block's
    CRC32C taken while it is still in L2; returns (tag ok, CRC32C of `out`). `out` holds garbage if not ok."""
    if len(seal) != SEAL_BYTES:
        return False, 0
    dec = _cipher(secret, seal[:NONCE_BYTES], transfer_id, src, kind, src_byte, out.nbytes,
                  seal[NONCE_BYTES:]).decryptor()
    s, crc = np.frombuffer(data, np.uint8), 0
    if s.nbytes != out.nbytes:
        raise ValueError(f"open_crc32c: {s.nbytes} landed bytes into {out.nbytes}")
    for o in range(0, s.nbytes, PLACE_BLOCK_BYTES):
        d = out[o: o + PLACE_BLOCK_BYTES]
        dec.update_into(s[o: o + PLACE_BLOCK_BYTES], d)
        crc = google_crc32c.extend(crc, d)
    try:
        dec.finalize()
    except InvalidTag:
        return False, crc
    return True, crc
