"""Request messages shared by the router, the cluster front and the prefill and decode roles."""

from __future__ import annotations

from dataclasses import dataclass

from k3serve.contracts.errors import ErrorCode
from k3serve.contracts.sampling import SamplingParams


@dataclass(frozen=True)
class PrefillRequest:
    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    session_id: str = ""  # the cache identity: checkpoints are budgeted per session (the router's routing key)
    cache_salt: str = ""  # the tenant's prefix-cache salt: prefixes are shared only under the same salt
    # Tokens this request already generated (streamed before a failover), at positions len(prompt_ids) ..:
    # prefill computes the prompt only, decode steps replay these (not emitted again), then sampling goes on
    # with params.max_tokens new tokens. Numerics mode deterministic resumes this way (the interrupted run's
    # state came from decode steps, so a re-prefill would round differently).
    replay_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class RequestFailure:
    """A request the engine refused or could not finish; `code` maps to a gRPC status upstream."""

    request_id: str
    code: ErrorCode
    message: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "code", ErrorCode(self.code))  # a plain string names the code too


@dataclass(frozen=True)
class TokenEvent:
    """New tokens of one request from one decode step (the first token comes from prefill)."""

    request_id: str
    token_ids: tuple[int, ...]
    finished: bool = False
    finish_reason: str = ""  # "stop" | "length" | "cancelled"
    logprobs: tuple[float, ...] = ()  # with params.logprobs: one per token_ids entry (model/sampling.token_logprob)


@dataclass(frozen=True)
class StreamEvent:
    """What one request's client gets next from a prefill/decode pair: tokens, the end, or a failure."""

    request_id: str
    token_ids: tuple[int, ...] = ()
    finish_reason: str = ""  # set on the last event of a request that completed
    cached_tokens: int = -1  # prompt tokens served from the prefix cache; set on the first event only
    error: RequestFailure | None = None  # the request ended without its full output
    # speculative decoding, set on the last event of a completed request (0 when off)
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0
    logprobs: tuple[float, ...] = ()  # with params.logprobs: one per token_ids entry

    @property
    def final(self) -> bool:
        return bool(self.finish_reason) or self.error is not None
