"""Wire helpers: PushMessage framing with a zero-copy payload, CRC32C, spec <-> proto.

Senders build the ``PushMessage`` header with protobuf and append field 15 (``payload``) by hand::

    [ PushMessage{chunk=header}.SerializeToString() ][ 0x7a | varint(len) | payload bytes ]

which is standard protobuf (fields may come in any order), so any protobuf parser reads it; the payload is
joined straight from a memoryview of the state tensor (one copy, into the message buffer gRPC needs).
Receivers find field 15 by walking the top-level tags and keep the payload as a memoryview of the received
message (no copy); the remaining bytes parse as an ordinary PushMessage.
"""

from __future__ import annotations

import struct

import google_crc32c
import numpy as np
import torch

from k3serve.transfer.v1 import transfer_pb2 as pb
from k3serve.transfer.chunks import KDA, MLA, ChunkRef
from k3serve.transfer.spec import StateGeometry, TransferSpec

PAYLOAD_FIELD = 15
_PAYLOAD_TAG = bytes([(PAYLOAD_FIELD << 3) | 2])
KIND_TO_PB = {KDA: pb.KIND_KDA, MLA: pb.KIND_MLA}
PB_TO_KIND = {v: k for k, v in KIND_TO_PB.items()}


class WireError(ValueError):
    """A message that is not a well-formed PushMessage; the text names the field."""


# ------------------------------------------------------------------------------------------------ bytes
def byte_view(t: torch.Tensor) -> np.ndarray:
    """A flat uint8 numpy view of a contiguous CPU tensor's memory (no copy; works for bf16 too)."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("byte_view needs a contiguous CPU tensor")
    return t.reshape(-1).view(torch.uint8).numpy()


def crc32c(buf) -> int:
    """CRC32C of a bytes-like object (bytes, memoryview, numpy uint8), via the C extension, no copy."""
    if isinstance(buf, (bytes, np.ndarray)):
        return google_crc32c.value(buf)
    return google_crc32c.value(np.frombuffer(buf, dtype=np.uint8))


def digest_crcs(crcs: list[int]) -> int:
    """The manifest's check: CRC32C over the chunk CRCs (4 bytes little-endian each) in plan order."""
    return google_crc32c.value(struct.pack(f"<{len(crcs)}I", *crcs))


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result, shift = 0, 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise WireError("message: truncated or overlong varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


# ------------------------------------------------------------------------------------------ messages
def encode_chunk(header: pb.ChunkHeader, payload) -> bytes:
    """One serialized PushMessage{chunk, payload}; payload is any bytes-like object (kept uncopied until here)."""
    head = pb.PushMessage(chunk=header).SerializeToString()
    n = memoryview(payload).nbytes
    return b"".join((head, _PAYLOAD_TAG, _varint(n), payload))


def encode(msg: pb.PushMessage) -> bytes:
    return msg.SerializeToString()


def decode(data: bytes) -> tuple[pb.PushMessage, memoryview | None]:
    """Parse a PushMessage; the payload comes back separately as a memoryview into `data` (no copy)."""
    buf = memoryview(data)
    pos, span = 0, None
    while pos < len(buf):
        tag_start = pos
        tag, pos = _read_varint(buf, pos)
        field, wire = tag >> 3, tag & 7
        if wire == 0:
            _, pos = _read_varint(buf, pos)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == 2:
            n, body = _read_varint(buf, pos)
            pos = body + n
            if field == PAYLOAD_FIELD:
                span = (tag_start, body, pos)
        else:
            raise WireError(f"message: unsupported wire type {wire} for field {field}")
        if pos > len(buf):
            raise WireError(f"message: field {field} runs past the end of the message")
    try:
        if span is None:
            return pb.PushMessage.FromString(data), None
        head = bytes(buf[: span[0]]) + bytes(buf[span[2]:])
        return pb.PushMessage.FromString(head), buf[span[1]: span[2]]
    except Exception as e:  # protobuf's DecodeError and friends
        raise WireError(f"message: not a PushMessage ({e})") from e


def chunk_header(spec: TransferSpec, c: ChunkRef, crc: int, mac: bytes = b"") -> pb.ChunkHeader:
    """mac: a landed chunk's seal (chunk_seal.py: nonce + AEAD tag); empty on the gRPC plane, whose chunks travel in the call."""
    h = pb.ChunkHeader(transfer_id=spec.transfer_id, request_id=spec.request_id, layer=c.layer,
                       kind=KIND_TO_PB[c.kind], dtype=c.dtype, shape=list(c.shape), offset=c.offset,
                       length=c.length, crc32c=crc, seq=c.seq, mac=mac)
    if c.kind == KDA:
        h.heads.start, h.heads.count = c.start, c.count
    else:
        h.tokens.start, h.tokens.count = c.start, c.count
    return h


# ---------------------------------------------------------------------------------------------- spec
def spec_to_pb(spec: TransferSpec) -> pb.TransferSpec:
    g = spec.geometry
    return pb.TransferSpec(transfer_id=spec.transfer_id, request_id=spec.request_id, prefill_tp=spec.prefill_tp,
                           decode_tp=spec.decode_tp, kda_layers=g.kda_layers, kda_heads=g.kda_heads,
                           kda_block_floats=g.kda_block_floats, mla_layers=g.mla_layers, num_tokens=g.num_tokens,
                           mla_dim=g.mla_dim, mla_dtype=g.mla_dtype, page_tokens=spec.page_tokens,
                           chunk_bytes=spec.chunk_bytes)


def spec_from_pb(m: pb.TransferSpec) -> TransferSpec:
    """Raises PlanError (a ValueError naming the field) for a spec the plan cannot serve."""
    g = StateGeometry(m.kda_layers, m.kda_heads, m.kda_block_floats, m.mla_layers, m.num_tokens, m.mla_dim,
                      m.mla_dtype)
    return TransferSpec(m.transfer_id, m.request_id, g, m.prefill_tp, m.decode_tp, m.page_tokens, m.chunk_bytes)


STATE_NAMES = {pb.TRANSFER_STATE_UNKNOWN: "unknown", pb.TRANSFER_STATE_RECEIVING: "receiving",
               pb.TRANSFER_STATE_VERIFIED: "verified", pb.TRANSFER_STATE_INSTALLED: "installed",
               pb.TRANSFER_STATE_CANCELLED: "cancelled", pb.TRANSFER_STATE_EXPIRED: "expired"}
STATE_CODES = {v: k for k, v in STATE_NAMES.items()}
