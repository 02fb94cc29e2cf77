"""Error codes of a request that failed, and their one mapping to gRPC status codes.

The engines and the transfer layer speak `ErrorCode`; only the gRPC fronts (cluster front, router) turn it into
a `grpc.StatusCode`, here. A rank that died is not an `ErrorCode`: it is `engine.executor.WorkerDied`, which
fails the whole group (UNAVAILABLE to every request) and triggers the rebuild.
"""

from __future__ import annotations

import enum

import grpc


class ErrorCode(str, enum.Enum):
    """Why one request ended without its full output. A `str` enum: `ErrorCode.CANCELLED == "CANCELLED"`."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"  # the request can never run as given (names the field)
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"  # over a budget or a pool's capacity; retry later
    UNAVAILABLE = "UNAVAILABLE"  # the cluster cannot serve now (broken, draining): fail over
    CANCELLED = "CANCELLED"  # the client left
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"  # the client's deadline passed
    ALREADY_EXISTS = "ALREADY_EXISTS"  # a request with this id is already running: the client's error
    INTERNAL = "INTERNAL"  # a bug or an op that raised on some rank; this request only

    @property
    def grpc_status(self) -> grpc.StatusCode:
        return _GRPC[self]

    @classmethod
    def from_grpc(cls, status: grpc.StatusCode) -> "ErrorCode":
        """The code a status received from a peer stands for (unknown statuses are INTERNAL)."""
        return _FROM_GRPC.get(status, cls.INTERNAL)


_GRPC = {code: getattr(grpc.StatusCode, code.value) for code in ErrorCode}
_FROM_GRPC = {status: code for code, status in _GRPC.items()}
