from k3serve.v1 import router_pb2 as _router_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ClusterGenerateRequest(_message.Message):
    __slots__ = ("request", "absolute_offset", "cache_salt")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    ABSOLUTE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request: _router_pb2.GenerateRequest
    absolute_offset: int
    cache_salt: str
    def __init__(self, request: _Optional[_Union[_router_pb2.GenerateRequest, _Mapping]] = ..., absolute_offset: _Optional[int] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class ClusterGenerateResponse(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "cached_tokens", "drafted_tokens", "accepted_tokens", "verify_steps", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_STEPS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    cached_tokens: int
    drafted_tokens: int
    accepted_tokens: int
    verify_steps: int
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., cached_tokens: _Optional[int] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., verify_steps: _Optional[int] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class ClusterStatusQuery(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClusterState(_message.Message):
    __slots__ = ("cluster_id", "running_requests", "inflight_tokens", "prefill_tp", "decode_tp", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TP_FIELD_NUMBER: _ClassVar[int]
    DECODE_TP_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    cluster_id: str
    running_requests: int
    inflight_tokens: int
    prefill_tp: int
    decode_tp: int
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, cluster_id: _Optional[str] = ..., running_requests: _Optional[int] = ..., inflight_tokens: _Optional[int] = ..., prefill_tp: _Optional[int] = ..., decode_tp: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...
