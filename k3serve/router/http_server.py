"""The router's OpenAI-compatible HTTP door (aiohttp, on its own event-loop thread in the router process).

```
 POST /v1/completions, /v1/chat/completions ─▶ openai_requests.parse ─▶ RouterService.validated (the one
   validation) ─▶ n calls, each on a worker thread: http_calls.drive ─▶ RouterService.serve_request (the path
   gRPC Generate takes) ─▶ events on an asyncio queue ─▶ JSON, or SSE chunks and `data: [DONE]`
 GET /v1/models, /health (503 draining or no routable cluster), /metrics (the router's Prometheus registry)
```
A closed connection cancels every choice of the call (the cluster call, an admission wait), as a gRPC cancel does.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from k3serve.netaddr import advertised_host
from k3serve.router.chat_template import ChatTemplate
from k3serve.router.http_calls import Call, Failed, Piece, drive
from k3serve.router.http_errors import ApiError, bad, from_status, param_of
from k3serve.router.openai_requests import Plan, parse
from k3serve.router.server import HEADROOM_THREADS, MAX_MESSAGE_BYTES, RouterService
from k3serve.router.validate import InvalidRequest
from k3serve.tokenizer import ByteTokenizer

log = logging.getLogger(__name__)

MAX_BODY_BYTES = MAX_MESSAGE_BYTES  # the gRPC door's message limit
SESSION_HEADER = "X-Session-Id"
DISCONNECT_POLL_S = 0.25  # how often a waiting call looks whether its client is still connected
MIN_LOGPROB = -9999.0  # what a -inf log-probability is sent as (JSON has no infinity), as vLLM does


@dataclass(frozen=True)
class _Done:
    index: int


class ClientGone(Exception):
    pass


def _served(end: Piece) -> dict:
    """Where a choice ran (with return_token_ids, as gRPC's usage reports it): drills and exactness checks."""
    return {"cluster_id": end.cluster_id, "failovers": end.failovers}


def _token(tok: ByteTokenizer | None, token_id: int) -> tuple[str, list[int] | None]:
    """A token as a logprob entry names it: its own bytes (decoded with U+FFFD for a partial UTF-8 sequence) and
    those bytes; ``token_id:<id>`` and no bytes for a token-id model, as vLLM."""
    if tok is None:
        return f"token_id:{token_id}", None
    raw = tok.token_bytes(token_id)
    return raw.decode("utf-8", errors="replace"), list(raw)


def _logprobs(plan: Plan, tok: ByteTokenizer | None, ids, lps, offsets) -> dict | None:
    """OpenAI's ``logprobs`` of a choice or chunk over these tokens (None when not asked for): chat's ``content``
    list, completions' parallel lists; only the sampled token's log-probability (``top_logprobs`` empty/null)."""
    if not plan.logprobs:
        return None
    names = [_token(tok, t) for t in ids]
    lps = [max(lp, MIN_LOGPROB) for lp in lps]
    if plan.chat:
        return {"content": [{"token": name, "logprob": lp, "bytes": raw, "top_logprobs": []}
                            for (name, raw), lp in zip(names, lps, strict=True)]}
    return {"tokens": [name for name, _ in names], "token_logprobs": lps, "top_logprobs": None,
            "text_offset": list(offsets)}


class HttpDoor:
    """``model``: the id /v1/models reports and requests must name; ``template``: None when the model has no
    tokenizer (chat refused, completions take token ids, texts are empty)."""

    def __init__(self, service: RouterService, model: str, template: ChatTemplate | None) -> None:
        self.service, self.model, self.template = service, model, template
        self._pool = ThreadPoolExecutor(service.slots.max_streams + HEADROOM_THREADS, thread_name_prefix="http")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self.created = int(time.time())

    # ------------------------------------------------------------------------------------------ lifecycle
    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._errors])
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        return app

    def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve on (host, port) (0: a free port) from a thread of its own; returns "host:port"."""
        self._loop = loop = asyncio.new_event_loop()
        started: list = []
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                self._runner = web.AppRunner(self.app(), access_log=None, handle_signals=False)
                loop.run_until_complete(self._runner.setup())
                loop.run_until_complete(web.TCPSite(self._runner, host, port).start())
                started.append(self._runner.addresses[0][1])
            except BaseException as e:
                started.append(e)
                return
            finally:
                ready.set()
            loop.run_forever()

        self._thread = threading.Thread(target=run, name="http-door", daemon=True)
        self._thread.start()
        ready.wait()
        if isinstance(started[0], BaseException):
            raise started[0]
        return f"{advertised_host(host)}:{started[0]}"

    def stop(self, timeout_s: float = 5.0) -> None:
        if self._loop is None:
            return
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout_s)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout_s)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._loop = None

    # ------------------------------------------------------------------------------------------- plumbing
    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except ApiError as e:
            return web.json_response(e.body(), status=e.status, headers=e.headers)
        except web.HTTPRequestEntityTooLarge:
            e = ApiError(413, f"the request body exceeds {MAX_BODY_BYTES} bytes", "body", code="body_too_large")
            return web.json_response(e.body(), status=413)
        except web.HTTPException as h:  # aiohttp's own 404 / 405
            if h.status < 400:
                raise
            e = ApiError(h.status, f"{request.method} {request.path}: {h.reason}", None,
                         "not_found_error" if h.status == 404 else "invalid_request_error")
            return web.json_response(e.body(), status=h.status)

    def _api_key(self, request: web.Request) -> str:
        if not self.service.keys_enabled:
            return ""
        auth = request.headers.get("Authorization", "")
        key = auth[len("Bearer "):] if auth.startswith("Bearer ") else ""
        if not self.service.key_allowed(key):
            raise ApiError(401, "missing or unknown API key (Authorization: Bearer ...)", None,
                           "authentication_error", "invalid_api_key")
        return key

    @staticmethod
    async def _body(request: web.Request):
        raw = await request.read()
        try:
            body = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise bad("body", f"the request body is not valid UTF-8 (byte {e.start})") from None
        except json.JSONDecodeError as e:
            raise bad("body", f"the request body is not valid JSON: {e}") from None
        if isinstance(body, dict):
            for k, v in body.items():
                try:
                    json.dumps(v, ensure_ascii=False).encode("utf-8")
                except UnicodeEncodeError:
                    raise bad(k, f"{k} holds a lone UTF-16 surrogate (not valid UTF-8)") from None
        return body

    async def _next(self, request: web.Request, queue: asyncio.Queue):
        while True:
            try:
                return await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if request.transport is None or request.transport.is_closing():
                    raise ClientGone from None

    def _run(self, call: Call, api_key: str, plan: Plan, emit) -> None:
        try:
            drive(self.service, call, api_key, plan.stops, emit, plan.logprobs)
        finally:
            emit(_Done(call.index))

    # ------------------------------------------------------------------------------------------ endpoints
    async def _models(self, request: web.Request) -> web.Response:
        self._api_key(request)
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": self.created, "owned_by": "k3serve"}]})

    async def _health(self, request: web.Request) -> web.Response:
        if self.service.draining:
            return web.json_response({"status": "draining"}, status=503)
        if not self.service.serving():
            return web.json_response({"status": "no routable cluster"}, status=503)
        return web.json_response({"status": "serving"})

    async def _metrics(self, request: web.Request) -> web.Response:
        body = await asyncio.get_running_loop().run_in_executor(None, generate_latest, self.service.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=True)

    async def _complete(self, request: web.Request, chat: bool) -> web.StreamResponse:
        api_key = self._api_key(request)
        body = await self._body(request)
        session = request.headers.get(SESSION_HEADER, "")
        plan = parse(body, chat, self.model, self.template, session)
        if plan.stops and self.template is None:
            raise bad("stop", "stop strings need a tokenizer; this model takes token ids (use stop_token_ids)")
        calls = []
        for i, r in enumerate(plan.requests):
            try:
                calls.append(Call(i, self.service.validated(r)))
            except InvalidRequest as e:
                self.service.counters.inc("invalid")
                p = param_of(str(e), plan.prompt_param)
                raise bad(plan.max_tokens_param if p == "max_tokens" else p, str(e)) from None
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def emit(event) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, event)

        for c in calls:
            self._pool.submit(self._run, c, api_key, plan, emit)
        finished = False
        try:
            out = await (self._stream(request, plan, calls, queue) if plan.stream
                         else self._collect(request, plan, calls, queue))
            finished = True
            return out
        except ClientGone:
            return web.Response(status=499)
        finally:
            if not finished:  # the client left, or an error ended the call: free every choice everywhere
                for c in calls:
                    c.ctx.cancel()

    # -------------------------------------------------------------------------------------------- answers
    def _usage(self, plan: Plan, pieces: dict[int, Piece]) -> dict:
        firsts = [p for i, p in pieces.items() if i % plan.n == 0]
        prompt = sum(p.prompt_tokens for p in firsts)
        completion = sum(p.completion_tokens for p in pieces.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(p.cached_tokens for p in firsts)}}

    def _error(self, plan: Plan, f: Failed) -> ApiError:
        return from_status(f.error.code, f.error.details, f.error.trailers, plan.prompt_param)

    async def _collect(self, request, plan: Plan, calls: list[Call], queue) -> web.Response:
        texts = {c.index: [] for c in calls}
        ids = {c.index: [] for c in calls}
        lps = {c.index: [] for c in calls}
        offsets = {c.index: [] for c in calls}
        last: dict[int, Piece] = {}
        done = 0
        while done < len(calls):
            ev = await self._next(request, queue)
            if isinstance(ev, _Done):
                done += 1
            elif isinstance(ev, Failed):
                raise self._error(plan, ev)
            else:
                texts[ev.index].append(ev.text)
                ids[ev.index].extend(ev.token_ids)
                lps[ev.index].extend(ev.logprobs)
                offsets[ev.index].extend(ev.text_offsets)
                if ev.finish_reason:
                    last[ev.index] = ev
        choices = []
        for c in calls:
            text = "".join(texts[c.index])
            ch = {"index": c.index, "finish_reason": last[c.index].finish_reason,
                  "logprobs": _logprobs(plan, self.service.tokenizer, ids[c.index], lps[c.index], offsets[c.index])}
            if plan.chat:
                ch["message"] = {"role": "assistant", "content": text}
            else:
                ch["text"] = text
            if plan.return_token_ids:
                ch.update(token_ids=ids[c.index], **_served(last[c.index]))
            choices.append(ch)
        return web.json_response({
            "id": f"{'chatcmpl' if plan.chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
            "object": "chat.completion" if plan.chat else "text_completion", "model": plan.model,
            "choices": choices, "usage": self._usage(plan, last)})

    async def _stream(self, request, plan: Plan, calls: list[Call], queue) -> web.StreamResponse:
        first = await self._next(request, queue)
        if isinstance(first, Failed):  # nothing sent yet: a plain HTTP error (429 with Retry-After, 503, ...)
            raise self._error(plan, first)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        head = {"id": f"{'chatcmpl' if plan.chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
                "object": "chat.completion.chunk" if plan.chat else "text_completion", "model": plan.model}
        started: set[int] = set()
        last: dict[int, Piece] = {}

        async def send(obj: dict) -> None:
            try:
                await resp.write(b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n")
            except ConnectionError:
                raise ClientGone from None

        def choice(i: int, text: str | None, finish: str | None, ids=None, end: Piece | None = None,
                   tokens: Piece | None = None) -> dict:
            if plan.chat:
                ch = {"index": i, "delta": {} if text is None else {"content": text}}
            else:
                ch = {"index": i, "text": text or ""}
            ch.update(finish_reason=finish, logprobs=None if tokens is None else _logprobs(
                plan, self.service.tokenizer, tokens.token_ids, tokens.logprobs, tokens.text_offsets))
            if plan.return_token_ids and ids is not None:
                ch["token_ids"] = list(ids)
            if plan.return_token_ids and end is not None:
                ch.update(_served(end))
            return {**head, "choices": [ch]}

        done, ev = 0, first
        while True:
            if isinstance(ev, _Done):
                done += 1
                if done == len(calls):
                    break
            elif isinstance(ev, Failed):  # mid-stream: OpenAI's error event, then the end
                await send(self._error(plan, ev).body())
                for c in calls:
                    c.ctx.cancel()
                break
            else:
                if plan.chat and ev.index not in started:
                    started.add(ev.index)
                    await send({**head, "choices": [{"index": ev.index, "delta": {"role": "assistant",
                                                                                  "content": ""},
                                                     "finish_reason": None, "logprobs": None}]})
                if ev.text or ev.token_ids:
                    await send(choice(ev.index, ev.text, None, ev.token_ids, tokens=ev))
                if ev.finish_reason:
                    last[ev.index] = ev
                    await send(choice(ev.index, None if plan.chat else "", ev.finish_reason, end=ev))
            ev = await self._next(request, queue)
        if plan.include_usage and len(last) == len(calls):
            await send({**head, "choices": [], "usage": self._usage(plan, last)})
        try:
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionError:
            raise ClientGone from None
        return resp
