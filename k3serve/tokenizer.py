"""Byte-level tokenizer for the tiny presets: ids 0..255 are bytes, then BOS, EOS, PAD."""

from __future__ import annotations

import codecs
from collections.abc import Iterable

BOS_ID = 256
EOS_ID = 257
PAD_ID = 258
BYTE_VOCAB_SIZE = 259


class ByteTokenizer:
    """UTF-8 bytes <-> token ids. Decoding drops special ids and replaces broken UTF-8 sequences."""

    vocab_size = BYTE_VOCAB_SIZE
    bos_id = BOS_ID
    eos_id = EOS_ID
    pad_id = PAD_ID

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [BOS_ID, *ids] if add_bos else ids

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """One token's own bytes (a special id has none): what a per-token log-probability names."""
        return bytes((token_id,)) if 0 <= token_id < 256 else b""

    def stream_decoder(self) -> "StreamDecoder":
        """An incremental decoder for one streamed request (see :class:`StreamDecoder`)."""
        return StreamDecoder()


class StreamDecoder:
    """Decodes a token stream piece by piece: a UTF-8 sequence split across two pieces comes out whole with the
    later piece (held back until complete), never as replacement characters; broken bytes still become U+FFFD.
    Call :meth:`decode` with ``final=True`` on the last piece to flush an unfinished sequence."""

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def decode(self, ids: Iterable[int], final: bool = False) -> str:
        return self._utf8.decode(bytes(i for i in ids if 0 <= i < 256), final)
