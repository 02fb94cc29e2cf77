"""OpenAI's error body (``{"error": {"message", "type", "param", "code"}}``) and how the router's gRPC answers
become HTTP statuses: a client's mistake is a 4xx naming the parameter, never a 500."""

from __future__ import annotations

import math
import re

import grpc

# the router's status codes -> (HTTP status, OpenAI error type)
HTTP_OF = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
}
# the shared validation names proto fields; the HTTP client named OpenAI parameters
_PARAM_OF_FIELD = (("sampling.stop_token_ids", "stop_token_ids"), ("sampling.max_tokens", "max_tokens"),
                   ("sampling.temperature", "temperature"), ("sampling.top_p", "top_p"),
                   ("sampling.top_k", "top_k"), ("sampling.seed", "seed"), ("session_id", "X-Session-Id"),
                   ("cache_salt", "cache_salt"), ("request_id", "request_id"), ("prompt", "prompt"),
                   ("give exactly one", "prompt"))


class ApiError(Exception):
    """An answer other than success, as OpenAI shapes it; ``headers`` go on the response (Retry-After)."""

    def __init__(self, status: int, message: str, param: str | None = None, type_: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param, code="invalid_value")


def param_of(message: str, prompt_param: str = "prompt") -> str | None:
    """The OpenAI parameter a shared-validation message is about (its leading field name)."""
    for field, param in _PARAM_OF_FIELD:
        if message.startswith(field):
            return prompt_param if param == "prompt" else param
    return None


def from_status(code: grpc.StatusCode, details: str, trailers: tuple = (), prompt_param: str = "prompt") -> ApiError:
    """The router's abort (code, details, trailing metadata) as an ApiError; 429 gets Retry-After (whole seconds,
    rounded up, as RFC 9110 wants) and the exact hint beside it."""
    status, type_ = HTTP_OF.get(code, (500, "server_error"))
    md = dict(trailers)
    headers = {}
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry-after-s" in md:
        hint = float(md["retry-after-s"])
        headers = {"Retry-After": str(max(1, math.ceil(hint))), "X-Retry-After-S": md["retry-after-s"]}
    param = param_of(details, prompt_param) if code == grpc.StatusCode.INVALID_ARGUMENT else None
    return ApiError(status, details, param, type_, re.sub(r"\W+", "_", code.name.lower()), headers)
