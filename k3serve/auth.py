"""Peer authentication for every internal RPC (router -> cluster front, prefill -> decode transfer) under the
per-deployment secret.

Every call carries metadata::

    x-k3serve-peer     the caller's name
    x-k3serve-subject  what the call is about: the request id (cluster Generate), the transfer id (transfer
                       calls), or empty (occupancy / status queries)
    x-k3serve-ts       unix time, seconds with milliseconds
    x-k3serve-mac      hex HMAC-SHA256(secret, "k3serve-rpc-v1\n" method \n subject \n ts \n peer)

The server's interceptor rejects a missing, wrong or stale signature (|now - ts| > window_s) and peers not in
``allowed_peers`` with UNAUTHENTICATED before any message is read; handlers then check that the subject inside
the messages is the one that was signed, so a captured signature is good for one method, one subject and a
short window. The MAC covers the call, not the payload bytes (transfer chunks are CRC-checked against
corruption; bind to a private interface or add TLS against an active attacker).
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import grpc

MD_PEER, MD_SUBJECT, MD_TS, MD_MAC = "x-k3serve-peer", "x-k3serve-subject", "x-k3serve-ts", "x-k3serve-mac"
_DOMAIN = "k3serve-rpc-v1"


class AuthError(Exception):
    """A call that does not prove knowledge of the deployment secret."""


@dataclass(frozen=True)
class AuthConfig:
    secret: str = field(repr=False)
    peer: str = "k3serve"
    window_s: float = 30.0
    allowed_peers: frozenset[str] | None = None  # None: any peer that holds the secret

    def __post_init__(self) -> None:
        if not isinstance(self.secret, str) or len(self.secret) < 16:
            raise ValueError("auth.secret must be a string of at least 16 characters")
        if not self.peer or any(c in self.peer for c in "\n\r"):
            raise ValueError(f"auth.peer must be a non-empty single-line name, got {self.peer!r}")
        if not self.window_s > 0:
            raise ValueError(f"auth.window_s must be positive, got {self.window_s}")


def _mac(cfg: AuthConfig, method: str, subject: str, ts: str, peer: str) -> str:
    msg = "\n".join((_DOMAIN, method, subject, ts, peer)).encode()
    return hmac.new(cfg.secret.encode(), msg, hashlib.sha256).hexdigest()


def sign(cfg: AuthConfig, method: str, subject: str, now: float | None = None) -> tuple[tuple[str, str], ...]:
    """Call metadata for `method` (the full gRPC method path) about `subject`."""
    ts = f"{time.time() if now is None else now:.3f}"
    return ((MD_PEER, cfg.peer), (MD_SUBJECT, subject), (MD_TS, ts),
            (MD_MAC, _mac(cfg, method, subject, ts, cfg.peer)))


def verify(cfg: AuthConfig, method: str, metadata: Mapping[str, str], now: float | None = None) -> str:
    """The signed subject; raises AuthError saying what is wrong."""
    peer, subject, ts, mac = (metadata.get(k) for k in (MD_PEER, MD_SUBJECT, MD_TS, MD_MAC))
    if peer is None or subject is None or ts is None or mac is None:
        raise AuthError("missing authentication metadata (x-k3serve-peer/-subject/-ts/-mac)")
    try:
        t = float(ts)
    except ValueError:
        raise AuthError("x-k3serve-ts is not a number") from None
    if abs((time.time() if now is None else now) - t) > cfg.window_s:
        raise AuthError(f"signature timestamp outside the {cfg.window_s:g} s freshness window")
    if not hmac.compare_digest(_mac(cfg, method, subject, ts, peer), mac):
        raise AuthError("bad signature: the peer does not hold this deployment's secret")
    if cfg.allowed_peers is not None and peer not in cfg.allowed_peers:
        raise AuthError(f"unknown peer {peer!r}")
    return subject


def signed_subject(context: grpc.ServicerContext) -> str:
    """The subject the interceptor verified for this call."""
    return dict(context.invocation_metadata()).get(MD_SUBJECT, "")


class AuthInterceptor(grpc.ServerInterceptor):
    """Rejects unauthenticated calls with UNAUTHENTICATED before the handler reads any message."""

    def __init__(self, cfg: AuthConfig) -> None:
        self._cfg = cfg

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        try:
            verify(self._cfg, handler_call_details.method, dict(handler_call_details.invocation_metadata))
        except AuthError as e:
            return _deny(handler, str(e))
        return handler


def _deny(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    def abort(_request, context: grpc.ServicerContext):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort)
    return grpc.unary_unary_rpc_method_handler(abort)
