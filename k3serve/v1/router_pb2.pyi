from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "max_tokens", "stop_token_ids", "ignore_eos", "logprobs")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    max_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: bool
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "session_id", "prompt_token_ids", "prompt_text", "sampling", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    session_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_text: str
    sampling: SamplingParams
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., session_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., prompt_text: _Optional[str] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "cached_tokens", "completion_tokens", "cluster_id", "failovers", "drafted_tokens", "accepted_tokens", "verify_steps")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    FAILOVERS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_STEPS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cluster_id: str
    failovers: int
    drafted_tokens: int
    accepted_tokens: int
    verify_steps: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cluster_id: _Optional[str] = ..., failovers: _Optional[int] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., verify_steps: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "usage", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    usage: Usage
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class ClusterStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClusterInfo(_message.Message):
    __slots__ = ("cluster_id", "healthy", "suspect", "endpoint", "running_requests", "inflight_tokens", "prefill_tp", "decode_tp", "pinned_sessions", "pools")
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    SUSPECT_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TP_FIELD_NUMBER: _ClassVar[int]
    DECODE_TP_FIELD_NUMBER: _ClassVar[int]
    PINNED_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    cluster_id: str
    healthy: bool
    suspect: bool
    endpoint: str
    running_requests: int
    inflight_tokens: int
    prefill_tp: int
    decode_tp: int
    pinned_sessions: int
    pools: _containers.RepeatedCompositeFieldContainer[PoolUsage]
    def __init__(self, cluster_id: _Optional[str] = ..., healthy: _Optional[bool] = ..., suspect: _Optional[bool] = ..., endpoint: _Optional[str] = ..., running_requests: _Optional[int] = ..., inflight_tokens: _Optional[int] = ..., prefill_tp: _Optional[int] = ..., decode_tp: _Optional[int] = ..., pinned_sessions: _Optional[int] = ..., pools: _Optional[_Iterable[_Union[PoolUsage, _Mapping]]] = ...) -> None: ...

class PoolUsage(_message.Message):
    __slots__ = ("name", "used", "capacity")
    NAME_FIELD_NUMBER: _ClassVar[int]
    USED_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    name: str
    used: int
    capacity: int
    def __init__(self, name: _Optional[str] = ..., used: _Optional[int] = ..., capacity: _Optional[int] = ...) -> None: ...

class ClassStatus(_message.Message):
    __slots__ = ("name", "inflight_tokens", "inflight_requests", "queued", "rejected")
    NAME_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    name: str
    inflight_tokens: int
    inflight_requests: int
    queued: int
    rejected: int
    def __init__(self, name: _Optional[str] = ..., inflight_tokens: _Optional[int] = ..., inflight_requests: _Optional[int] = ..., queued: _Optional[int] = ..., rejected: _Optional[int] = ...) -> None: ...

class ClusterStatusResponse(_message.Message):
    __slots__ = ("clusters", "pinned_sessions", "membership_stale", "classes")
    CLUSTERS_FIELD_NUMBER: _ClassVar[int]
    PINNED_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_STALE_FIELD_NUMBER: _ClassVar[int]
    CLASSES_FIELD_NUMBER: _ClassVar[int]
    clusters: _containers.RepeatedCompositeFieldContainer[ClusterInfo]
    pinned_sessions: int
    membership_stale: bool
    classes: _containers.RepeatedCompositeFieldContainer[ClassStatus]
    def __init__(self, clusters: _Optional[_Iterable[_Union[ClusterInfo, _Mapping]]] = ..., pinned_sessions: _Optional[int] = ..., membership_stale: _Optional[bool] = ..., classes: _Optional[_Iterable[_Union[ClassStatus, _Mapping]]] = ...) -> None: ...
