"""Peer authentication for every internal RPC (router -> cluster front, prefill -> decode transfer) under the
per-deployment secret.

Every call carries metadata::

    x-k3serve-peer     the caller's name
    x-k3serve-subject  what the call is about: the request id (cluster Generate), the transfer id (transfer
                       calls), or empty (occupancy / status queries)
    x-k3serve-body     hex SHA-256 of the serialized request message (unary requests), or "stream" for
                       request-streaming calls (their chunks carry CRC32C and a manifest)
    x-k3serve-ts       unix time, seconds with milliseconds (finite)
    x-k3serve-nonce    32 random hex digits, used once
    x-k3serve-mac      hex HMAC-SHA256(secret, "k3serve-rpc-v2\n" method \n subject \n body \n ts \n nonce \n peer)

The server's interceptor rejects a missing, wrong or stale signature (|now - ts| > window_s), a nonce it already
accepted within the window, and peers not in ``allowed_peers`` with UNAUTHENTICATED before any message is read;
a unary request whose bytes do not hash to the signed body digest is refused with UNAUTHENTICATED before its
handler runs; handlers then check that the subject inside the messages is the one that was signed. So a captured
call can be neither replayed nor re-used with another prompt, salt or transfer. The MAC does not encrypt: use a
private interface, or internal TLS (``AuthConfig.tls``, k3serve/tls.py), against eavesdroppers.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import grpc

from k3serve.tls import TlsMaterial

MD_PEER, MD_SUBJECT, MD_TS, MD_MAC = "x-k3serve-peer", "x-k3serve-subject", "x-k3serve-ts", "x-k3serve-mac"
MD_BODY, MD_NONCE = "x-k3serve-body", "x-k3serve-nonce"
STREAM = "stream"  # the body digest of a request-streaming call
_DOMAIN = "k3serve-rpc-v2"
_NONCE_HEX = 32


class AuthError(Exception):
    """A call that does not prove knowledge of the deployment secret."""


@dataclass(frozen=True)
class AuthConfig:
    secret: str = field(repr=False)
    peer: str = "k3serve"
    window_s: float = 30.0
    allowed_peers: frozenset[str] | None = None  # None: any peer that holds the secret
    tls: TlsMaterial | None = field(default=None, repr=False)  # mutual TLS of the channels (tls.py); None: plain

    def __post_init__(self) -> None:
        if not isinstance(self.secret, str) or len(self.secret) < 16:
            raise ValueError("auth.secret must be a string of at least 16 characters")
        if not self.peer or any(c in self.peer for c in "\n\r"):
            raise ValueError(f"auth.peer must be a non-empty single-line name, got {self.peer!r}")
        if not (isinstance(self.window_s, (int, float)) and math.isfinite(self.window_s) and self.window_s > 0):
            raise ValueError(f"auth.window_s must be a positive finite number, got {self.window_s}")


def body_digest(body: bytes | object | None) -> str:
    """The signed digest of a request: SHA-256 of its bytes (a protobuf message is serialized), ``STREAM`` for
    None (a request-streaming call)."""
    if body is None:
        return STREAM
    raw = body if isinstance(body, (bytes, bytearray, memoryview)) else body.SerializeToString()
    return hashlib.sha256(raw).hexdigest()


def _mac(cfg: AuthConfig, method: str, subject: str, body: str, ts: str, nonce: str, peer: str) -> str:
    msg = "\n".join((_DOMAIN, method, subject, body, ts, nonce, peer)).encode()
    return hmac.new(cfg.secret.encode(), msg, hashlib.sha256).hexdigest()


def sign(cfg: AuthConfig, method: str, subject: str, body: bytes | object | None = None,
         now: float | None = None) -> tuple[tuple[str, str], ...]:
    """Call metadata for `method` (the full gRPC method path) about `subject`, over the request `body` (the
    message or its bytes; None for a request-streaming call). Each call needs its own: the nonce is single-use."""
    ts = f"{time.time() if now is None else now:.3f}"
    digest, nonce = body_digest(body), secrets.token_hex(_NONCE_HEX // 2)
    return ((MD_PEER, cfg.peer), (MD_SUBJECT, subject), (MD_BODY, digest), (MD_TS, ts), (MD_NONCE, nonce),
            (MD_MAC, _mac(cfg, method, subject, digest, ts, nonce, cfg.peer)))


class Verified(NamedTuple):
    subject: str
    body: str  # the signed body digest
    nonce: str
    ts: float


def verify(cfg: AuthConfig, method: str, metadata: Mapping[str, str], now: float | None = None) -> Verified:
    """What the call was signed for; raises AuthError saying what is wrong. The nonce is checked by the caller
    (``NonceLog``): this function is pure."""
    fields = (MD_PEER, MD_SUBJECT, MD_BODY, MD_TS, MD_NONCE, MD_MAC)
    peer, subject, body, ts, nonce, mac = (metadata.get(k) for k in fields)
    if peer is None or subject is None or body is None or ts is None or nonce is None or mac is None:
        raise AuthError("missing authentication metadata (x-k3serve-peer/-subject/-body/-ts/-nonce/-mac)")
    try:
        t = float(ts)
    except ValueError:
        raise AuthError("x-k3serve-ts is not a number") from None
    if not math.isfinite(t):
        raise AuthError("x-k3serve-ts must be a finite number")
    if abs((time.time() if now is None else now) - t) > cfg.window_s:
        raise AuthError(f"signature timestamp outside the {cfg.window_s:g} s freshness window")
    if len(nonce) != _NONCE_HEX:
        raise AuthError(f"x-k3serve-nonce must be {_NONCE_HEX} hex digits")
    if not hmac.compare_digest(_mac(cfg, method, subject, body, ts, nonce, peer), mac):
        raise AuthError("bad signature: the peer does not hold this deployment's secret")
    if cfg.allowed_peers is not None and peer not in cfg.allowed_peers:
        raise AuthError(f"unknown peer {peer!r}")
    return Verified(subject, body, nonce, t)


class NonceLog:
    """Nonces of accepted calls, each remembered until its timestamp left the window. Thread-safe."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._lock = threading.Lock()
        self._seen: dict[str, float] = {}  # nonce -> when it may be forgotten (local clock)
        self._next_purge = 0.0

    def accept(self, nonce: str, ts: float, now: float | None = None) -> bool:
        """True the first time `nonce` is seen; False for a replay."""
        now = time.time() if now is None else now
        with self._lock:
            if now >= self._next_purge:
                self._seen = {n: until for n, until in self._seen.items() if until > now}
                self._next_purge = now + self.window_s / 4
            if nonce in self._seen:
                return False
            self._seen[nonce] = max(ts, now) + self.window_s  # past that, its timestamp fails the window
            return True

    def __len__(self) -> int:
        with self._lock:
            return len(self._seen)


def signed_subject(context: grpc.ServicerContext) -> str:
    """The subject the interceptor verified for this call."""
    return dict(context.invocation_metadata()).get(MD_SUBJECT, "")


class AuthInterceptor(grpc.ServerInterceptor):
    """Rejects unauthenticated or replayed calls with UNAUTHENTICATED before the handler reads any message, and
    unary requests whose bytes are not the signed ones before the handler runs."""

    def __init__(self, cfg: AuthConfig) -> None:
        self._cfg = cfg
        self.nonces = NonceLog(cfg.window_s)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        try:
            v = verify(self._cfg, handler_call_details.method, dict(handler_call_details.invocation_metadata))
            if handler.request_streaming != (v.body == STREAM):
                raise AuthError("x-k3serve-body does not fit the call (a digest for unary requests, "
                                f"{STREAM!r} for streamed ones)")
            if not self.nonces.accept(v.nonce, v.ts):
                raise AuthError("replayed call: this nonce was already used")
        except AuthError as e:
            return _deny(handler, str(e))
        return handler if handler.request_streaming else _body_checked(handler, v.body)


class _Body(NamedTuple):
    ok: bool
    message: object


def _body_checked(handler: grpc.RpcMethodHandler, digest: str) -> grpc.RpcMethodHandler:
    """`handler` with its request refused unless its wire bytes hash to `digest`."""
    parse = handler.request_deserializer

    def deserialize(raw: bytes) -> _Body:
        ok = hmac.compare_digest(hashlib.sha256(raw).hexdigest(), digest)
        return _Body(ok, parse(raw) if parse is not None else raw)

    def guard(inner):
        def behavior(request: _Body, context: grpc.ServicerContext):
            if not request.ok:
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "the request body is not the one that was signed")
            return inner(request.message, context)
        return behavior

    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(guard(handler.unary_stream), deserialize,
                                                    handler.response_serializer)
    return grpc.unary_unary_rpc_method_handler(guard(handler.unary_unary), deserialize, handler.response_serializer)


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
