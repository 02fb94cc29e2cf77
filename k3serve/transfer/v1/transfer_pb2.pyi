from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KIND_UNSPECIFIED: _ClassVar[Kind]
    KIND_KDA: _ClassVar[Kind]
    KIND_MLA: _ClassVar[Kind]

class TransferState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_STATE_UNSPECIFIED: _ClassVar[TransferState]
    TRANSFER_STATE_UNKNOWN: _ClassVar[TransferState]
    TRANSFER_STATE_RECEIVING: _ClassVar[TransferState]
    TRANSFER_STATE_VERIFIED: _ClassVar[TransferState]
    TRANSFER_STATE_INSTALLED: _ClassVar[TransferState]
    TRANSFER_STATE_CANCELLED: _ClassVar[TransferState]
    TRANSFER_STATE_EXPIRED: _ClassVar[TransferState]
KIND_UNSPECIFIED: Kind
KIND_KDA: Kind
KIND_MLA: Kind
TRANSFER_STATE_UNSPECIFIED: TransferState
TRANSFER_STATE_UNKNOWN: TransferState
TRANSFER_STATE_RECEIVING: TransferState
TRANSFER_STATE_VERIFIED: TransferState
TRANSFER_STATE_INSTALLED: TransferState
TRANSFER_STATE_CANCELLED: TransferState
TRANSFER_STATE_EXPIRED: TransferState

class TransferSpec(_message.Message):
    __slots__ = ("transfer_id", "request_id", "prefill_tp", "decode_tp", "kda_layers", "kda_heads", "kda_block_floats", "mla_layers", "num_tokens", "mla_dim", "mla_dtype", "page_tokens", "chunk_bytes")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TP_FIELD_NUMBER: _ClassVar[int]
    DECODE_TP_FIELD_NUMBER: _ClassVar[int]
    KDA_LAYERS_FIELD_NUMBER: _ClassVar[int]
    KDA_HEADS_FIELD_NUMBER: _ClassVar[int]
    KDA_BLOCK_FLOATS_FIELD_NUMBER: _ClassVar[int]
    MLA_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MLA_DIM_FIELD_NUMBER: _ClassVar[int]
    MLA_DTYPE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    request_id: str
    prefill_tp: int
    decode_tp: int
    kda_layers: int
    kda_heads: int
    kda_block_floats: int
    mla_layers: int
    num_tokens: int
    mla_dim: int
    mla_dtype: str
    page_tokens: int
    chunk_bytes: int
    def __init__(self, transfer_id: _Optional[str] = ..., request_id: _Optional[str] = ..., prefill_tp: _Optional[int] = ..., decode_tp: _Optional[int] = ..., kda_layers: _Optional[int] = ..., kda_heads: _Optional[int] = ..., kda_block_floats: _Optional[int] = ..., mla_layers: _Optional[int] = ..., num_tokens: _Optional[int] = ..., mla_dim: _Optional[int] = ..., mla_dtype: _Optional[str] = ..., page_tokens: _Optional[int] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class StreamOpen(_message.Message):
    __slots__ = ("spec", "src_rank", "dst_rank", "attempt", "landed")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    SRC_RANK_FIELD_NUMBER: _ClassVar[int]
    DST_RANK_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    LANDED_FIELD_NUMBER: _ClassVar[int]
    spec: TransferSpec
    src_rank: int
    dst_rank: int
    attempt: int
    landed: bool
    def __init__(self, spec: _Optional[_Union[TransferSpec, _Mapping]] = ..., src_rank: _Optional[int] = ..., dst_rank: _Optional[int] = ..., attempt: _Optional[int] = ..., landed: _Optional[bool] = ...) -> None: ...

class OpenReply(_message.Message):
    __slots__ = ("transfer_id", "state", "segment", "kda_addr", "mla_addr")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    KDA_ADDR_FIELD_NUMBER: _ClassVar[int]
    MLA_ADDR_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    state: TransferState
    segment: str
    kda_addr: int
    mla_addr: int
    def __init__(self, transfer_id: _Optional[str] = ..., state: _Optional[_Union[TransferState, str]] = ..., segment: _Optional[str] = ..., kda_addr: _Optional[int] = ..., mla_addr: _Optional[int] = ...) -> None: ...

class HeadRange(_message.Message):
    __slots__ = ("start", "count")
    START_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    start: int
    count: int
    def __init__(self, start: _Optional[int] = ..., count: _Optional[int] = ...) -> None: ...

class TokenRange(_message.Message):
    __slots__ = ("start", "count")
    START_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    start: int
    count: int
    def __init__(self, start: _Optional[int] = ..., count: _Optional[int] = ...) -> None: ...

class ChunkHeader(_message.Message):
    __slots__ = ("transfer_id", "request_id", "layer", "kind", "heads", "tokens", "dtype", "shape", "offset", "length", "crc32c", "seq", "mac")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    HEADS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    request_id: str
    layer: int
    kind: Kind
    heads: HeadRange
    tokens: TokenRange
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    length: int
    crc32c: int
    seq: int
    mac: bytes
    def __init__(self, transfer_id: _Optional[str] = ..., request_id: _Optional[str] = ..., layer: _Optional[int] = ..., kind: _Optional[_Union[Kind, str]] = ..., heads: _Optional[_Union[HeadRange, _Mapping]] = ..., tokens: _Optional[_Union[TokenRange, _Mapping]] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., crc32c: _Optional[int] = ..., seq: _Optional[int] = ..., mac: _Optional[bytes] = ...) -> None: ...

class Manifest(_message.Message):
    __slots__ = ("transfer_id", "src_rank", "dst_rank", "num_chunks", "num_bytes", "crc32c")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    SRC_RANK_FIELD_NUMBER: _ClassVar[int]
    DST_RANK_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    src_rank: int
    dst_rank: int
    num_chunks: int
    num_bytes: int
    crc32c: int
    def __init__(self, transfer_id: _Optional[str] = ..., src_rank: _Optional[int] = ..., dst_rank: _Optional[int] = ..., num_chunks: _Optional[int] = ..., num_bytes: _Optional[int] = ..., crc32c: _Optional[int] = ...) -> None: ...

class LandedChunks(_message.Message):
    __slots__ = ("chunks",)
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[ChunkHeader]
    def __init__(self, chunks: _Optional[_Iterable[_Union[ChunkHeader, _Mapping]]] = ...) -> None: ...

class PushMessage(_message.Message):
    __slots__ = ("open", "chunk", "manifest", "landed", "payload")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    LANDED_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    open: StreamOpen
    chunk: ChunkHeader
    manifest: Manifest
    landed: LandedChunks
    payload: bytes
    def __init__(self, open: _Optional[_Union[StreamOpen, _Mapping]] = ..., chunk: _Optional[_Union[ChunkHeader, _Mapping]] = ..., manifest: _Optional[_Union[Manifest, _Mapping]] = ..., landed: _Optional[_Union[LandedChunks, _Mapping]] = ..., payload: _Optional[bytes] = ...) -> None: ...

class PushAck(_message.Message):
    __slots__ = ("transfer_id", "src_rank", "dst_rank", "state", "chunks_applied", "duplicate")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    SRC_RANK_FIELD_NUMBER: _ClassVar[int]
    DST_RANK_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_APPLIED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    src_rank: int
    dst_rank: int
    state: TransferState
    chunks_applied: int
    duplicate: bool
    def __init__(self, transfer_id: _Optional[str] = ..., src_rank: _Optional[int] = ..., dst_rank: _Optional[int] = ..., state: _Optional[_Union[TransferState, str]] = ..., chunks_applied: _Optional[int] = ..., duplicate: _Optional[bool] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("transfer_id",)
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    def __init__(self, transfer_id: _Optional[str] = ...) -> None: ...

class CancelAck(_message.Message):
    __slots__ = ("transfer_id", "freed")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    FREED_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    freed: bool
    def __init__(self, transfer_id: _Optional[str] = ..., freed: _Optional[bool] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("transfer_id",)
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    def __init__(self, transfer_id: _Optional[str] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("transfer_id", "state", "staged_transfers", "staged_bytes", "decode_rank", "decode_tp")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STAGED_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    STAGED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DECODE_RANK_FIELD_NUMBER: _ClassVar[int]
    DECODE_TP_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    state: TransferState
    staged_transfers: int
    staged_bytes: int
    decode_rank: int
    decode_tp: int
    def __init__(self, transfer_id: _Optional[str] = ..., state: _Optional[_Union[TransferState, str]] = ..., staged_transfers: _Optional[int] = ..., staged_bytes: _Optional[int] = ..., decode_rank: _Optional[int] = ..., decode_tp: _Optional[int] = ...) -> None: ...
