"""One router request driven for the HTTP door: the shared request path (RouterService.serve_request) run on a
worker thread, its messages turned into the door's events, stop strings matched, and the client's disconnect
made a cancel, as gRPC's would be.

Texts are decoded here token by token (one decoder per choice, across failovers), so a stop string ends the
choice at the token that completed it: that token and those before it are returned (token ids, logprobs,
usage.completion_tokens), the text only up to the match, as vLLM does.

``CallContext`` is what the request path needs of a ``grpc.ServicerContext`` (abort raises; callbacks run on
cancel), so both doors share one path: validation, tenancy, slots, pins, admission, failover, stall detection.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from k3serve.router.server import RequestRecord, RouterService
from k3serve.router.stop_strings import StopMatcher
from k3serve.router.validate import ValidRequest

log = logging.getLogger(__name__)


class CallAborted(Exception):
    """The request path ended the call with a status (context.abort); ``trailers`` hold its retry hint."""

    def __init__(self, code: grpc.StatusCode, details: str, trailers: tuple) -> None:
        super().__init__(details)
        self.code, self.details, self.trailers = code, details, trailers


class CallContext:
    """The grpc.ServicerContext surface the request path uses, for an HTTP call (no deadline)."""

    decodes_text = True  # ``drive`` decodes per token (stop strings, logprobs): the relay leaves msg.text empty

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []
        self._cancelled = False
        self.trailers: tuple = ()

    def abort(self, code: grpc.StatusCode, details: str):
        raise CallAborted(code, details, self.trailers)

    def add_callback(self, fn: Callable[[], None]) -> bool:
        with self._lock:
            if not self._cancelled:
                self._callbacks.append(fn)
                return True
        fn()
        return True

    def is_active(self) -> bool:
        return not self._cancelled

    def time_remaining(self) -> float | None:
        return None

    def set_trailing_metadata(self, md) -> None:
        self.trailers = tuple(md)

    def cancel(self) -> None:
        """The client left (or a stop string ended the request): cancel the cluster call and any wait."""
        with self._lock:
            if self._cancelled:
                return
            self._cancelled = True
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            try:
                fn()
            except Exception:  # a callback's failure must not keep the others from running
                log.exception("cancel callback failed")


@dataclass(frozen=True)
class Piece:
    """Text and token ids of one choice (with logprobs asked for: one log-probability per token, and where each
    token's text begins in the choice's text); ``finish_reason`` and usage on its last piece."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cluster_id: str = ""  # the cluster that finished it ("" when a stop string ended it)
    failovers: int = 0
    logprobs: tuple[float, ...] = ()
    text_offsets: tuple[int, ...] = ()


@dataclass
class Failed:
    """A choice that ended with the router's status instead of a finish."""

    index: int
    error: CallAborted


@dataclass
class Call:
    """One choice of an HTTP call: its request and context (cancel it when the client leaves)."""

    index: int
    req: ValidRequest
    ctx: CallContext = field(default_factory=CallContext)


def drive(service: RouterService, call: Call, api_key: str, stops: tuple[str, ...],
          emit: Callable[[object], None], logprobs: bool = False) -> None:
    """Run one choice to its end on this thread, emitting ``Piece``s and at most one ``Failed``; returns when the
    request has left the router (slot, reservation and cluster call released)."""
    record = RequestRecord()
    matcher = StopMatcher(stops) if stops else None
    tok = service.tokenizer
    dec = tok.stream_decoder() if tok is not None else None  # None: a token-id model, whose texts are empty
    decoded = 0  # characters decoded so far: where the next token's text begins
    streamed = 0
    gen = service.serve_request(call.req, api_key, call.ctx, record)
    try:
        for msg in gen:
            ids, lps = tuple(msg.token_ids), tuple(msg.logprobs) if logprobs else ()
            if logprobs and len(lps) != len(ids):
                raise RuntimeError(f"a cluster sent {len(lps)} logprobs for {len(ids)} tokens")
            texts = [dec.decode((t,)) if dec else "" for t in ids]
            offsets = []
            for piece in texts:
                offsets.append(decoded)
                decoded += len(piece)
            units = texts or [""]  # what the stop matcher is fed, one token at a time
            if dec and msg.finish_reason:
                tail = dec.decode((), final=True)  # an unfinished UTF-8 sequence, as U+FFFD
                units[-1] += tail
                decoded += len(tail)
            text, hit, kept = "", False, len(ids)
            for j, unit in enumerate(units):
                piece, hit = matcher.feed(unit) if matcher else (unit, False)
                text += piece
                if hit:
                    kept = min(j + 1, len(ids))
                    break
            ids, lps, offsets = ids[:kept], lps[:kept], tuple(offsets[:kept]) if logprobs else ()
            streamed += kept
            if hit:
                record.finish_reason = "stop"
                call.ctx.cancel()  # ends it on its cluster now; the path then sees a client that left
                st = record.attempts
                emit(Piece(call.index, text, ids, "stop", len(call.req.prompt_ids), streamed,
                           st.cached if st else 0, "", st.failovers if st else 0, lps, offsets))
                return
            if msg.finish_reason and matcher:
                text += matcher.flush()
            u = msg.usage
            emit(Piece(call.index, text, ids, msg.finish_reason, u.prompt_tokens, u.completion_tokens,
                       u.cached_tokens, u.cluster_id, u.failovers, lps, offsets))
    except CallAborted as e:
        emit(Failed(call.index, e))
    except Exception as e:  # a router bug must reach the client as an error, not a hung stream
        log.exception("HTTP call %s failed", call.req.request_id)
        emit(Failed(call.index, CallAborted(grpc.StatusCode.INTERNAL, f"router error: {type(e).__name__}", ())))
    finally:
        gen.close()
