"""Request messages shared by the prefill and decode roles."""

from __future__ import annotations

from dataclasses import dataclass

from k3serve.engine.sampling import SamplingParams


@dataclass(frozen=True)
class PrefillRequest:
    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    session_id: str = ""


@dataclass(frozen=True)
class RequestFailure:
    """A request the engine refused or could not finish; `code` maps to a gRPC status upstream."""

    request_id: str
    code: str  # "INVALID_ARGUMENT" | "RESOURCE_EXHAUSTED" | "CANCELLED" | "INTERNAL"
    message: str


@dataclass(frozen=True)
class TokenEvent:
    """New tokens of one request from one decode step (the first token comes from prefill)."""

    request_id: str
    token_ids: tuple[int, ...]
    finished: bool = False
    finish_reason: str = ""  # "stop" | "length" | "cancelled"
