"""The public router: ``k3serve.v1.Router`` over the clusters of a deployment.

Stateless apart from Redis: membership (heartbeats), session pins and admission live there, so any number of
replicas make the same decisions. Per request:

```
 decode (tolerant: bad UTF-8 is INVALID_ARGUMENT) ─▶ API key ─▶ validate ─▶ tenant salt, cache identity
   ─▶ stream slot (else RESOURCE_EXHAUSTED + retry-after) ─▶ pin (HRW, pending TTL)
   ─▶ admit on the serving cluster (class from the uncached estimate for *that* cluster) ─▶ confirm pin
   ─▶ stream (relay.py)
                                                      │ transport/cluster fault: breaker marks it suspect,
                                                      ▼ pin moves to its secondary, else the next in HRW order
          resubmit prompt + tokens already streamed, max_tokens - streamed, same seed, same class and reservation
```
Randomness is keyed by (seed, absolute position), so the resumed stream continues exactly as an
uninterrupted run would have: no gap, no duplicate. A failover before any token is admitted afresh on the new
cluster (it may be refused: the client has seen nothing); after the first token it keeps its reservation.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass

import grpc
import redis
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from k3serve.netaddr import advertised_host
from k3serve.auth import AuthConfig
from k3serve.tls import TlsMaterial, open_channel
from k3serve.contracts.status import from_load
from k3serve.engine.block_hash import prefix_key
from k3serve.contracts.prefix_policy import PrefixCachePolicy
from k3serve.internal.v1 import cluster_pb2_grpc
from k3serve.router.admission import AdmissionRejected
from k3serve.router.api_keys import ApiKeys
from k3serve.router.key_quota import KeyQuota, QuotaExceeded, QuotaLimits
from k3serve.router.anonymous import AnonymousPlacer
from k3serve.router.gate import AdmissionGate
from k3serve.router.hashing import rank_clusters
from k3serve.router.liveness import Watchdog
from k3serve.router.membership import MembershipView
from k3serve.router.metrics import Counters, RouterMetrics
from k3serve.router.pins import NoHealthyCluster, PinStore
from k3serve.router.prefix_map import PrefixMap
from k3serve.router.progress import DurationModel, StreamProgress
from k3serve.router.relay import Attempts, Ending, Target, stream_attempt
from k3serve.router.slots import StreamSlots
from k3serve.router.status_cache import STATUS_INTERVAL_S, StatusCache
from k3serve.router.tenancy import cache_identity, scoped_request_id, tenant_id, tenant_salt
from k3serve.router.validate import InvalidRequest, ModelLimits, ValidRequest, validate_generate
from k3serve.router.wire import Undecodable, tolerant
from k3serve.tokenizer import ByteTokenizer
from k3serve.v1 import router_pb2, router_pb2_grpc

log = logging.getLogger(__name__)


@dataclass
class RequestRecord:
    """How a request ended, as the metrics count it: the cluster's finish reason, or the door's (a stop string)."""

    finish_reason: str = ""
    attempts: Attempts | None = None  # what the request received so far, across failovers (usage of a stop)

MAX_MESSAGE_BYTES = 4 << 20
HEADROOM_THREADS = 16  # gRPC threads beyond max_streams: health, status and quick rejections always answer
# Calls gRPC holds for a thread beyond the pool before it refuses them itself (maximum_concurrent_rpcs, the flood
# backstop). Its refusal carries no retry-after, so it sits above any burst the router's own limit should
# answer: 200 clients arriving within 0.2 s at two routers of 24 threads had reached a backstop of 4x the pool. A quick
# refusal takes ~1-5 ms of the router's GIL, so the last of 1024 waits a few seconds for its hint, within any sane
# client deadline; memory per held call is a few KB.
PENDING_RPCS = 1024


class RouterService(router_pb2_grpc.RouterServicer):
    """``max_streams``: concurrent Generate streams (including those waiting for admission) before
    RESOURCE_EXHAUSTED; ``stall_timeout_s``: silence between tokens that counts as a cluster fault (liveness.py).
    ``policy``: the prefix-cache policy the clusters run (block size and scheme of the uncached estimate and of
    anonymous routing keys); default: the gate's. ``placer``: where requests without a session id go
    (anonymous.py; default: least expected TTFT over the published prefix maps, hash seed 0)."""

    def __init__(self, view: MembershipView, pins: PinStore, limits: ModelLimits, secret: str,
                 api_keys: tuple[str, ...] = (), *, gate: AdmissionGate | None = None,
                 metrics: RouterMetrics | None = None, stall_timeout_s: float = 30.0, max_streams: int = 128,
                 policy: PrefixCachePolicy | None = None, durations: DurationModel | None = None,
                 quota: QuotaLimits | None = None, status_interval_s: float = STATUS_INTERVAL_S,
                 placer: AnonymousPlacer | None = None, tls: TlsMaterial | None = None) -> None:
        self.view, self.pins, self.limits, self.gate = view, pins, limits, gate
        self._secret = secret
        self._auth = AuthConfig(secret, peer="router", tls=tls)  # signs each call to a cluster front
        self.metrics = metrics or RouterMetrics()
        self._keys = ApiKeys(secret, api_keys)  # keyed digests only
        self.policy = policy or (gate.policy if gate is not None else PrefixCachePolicy())
        self.durations = durations or DurationModel()
        self.placer = placer or AnonymousPlacer(PrefixMap(view.membership._r, view.membership.namespace),
                                                prefix_key(0, secret), self.policy.block_size)
        self.slots = StreamSlots(max_streams)
        # per key across every router (leases in Redis, key_quota.py)
        self.quota = KeyQuota(quota or QuotaLimits.resolve(0, 0, max_streams, len(self._keys)), view.membership._r,
                              view.membership.namespace)
        self._channels: dict[str, tuple[str, grpc.Channel]] = {}
        self._lock = threading.Lock()
        self._tok = ByteTokenizer() if limits.byte_tokenizer else None
        self.counters = Counters("requests", "completed", "failed", "failovers", "invalid", "rejected")
        # drain (SIGTERM/SIGINT of `serve`): refuse new requests, let the in-flight ones finish
        self.health: health.HealthServicer | None = None  # set by start_router_server
        self._draining = False
        self._inflight = 0
        self._idle = threading.Condition(self._lock)
        # membership is read by a background thread, so the request path never waits on Redis; the first read
        # happens before serving (a router that never read Redis would see no cluster at all)
        self.placer.refresh(self.view.refresh())
        self._closed = threading.Event()
        self._refresher = threading.Thread(target=self._refresh_loop, name="membership", daemon=True)
        self._refresher.start()
        self.watchdog = Watchdog(self._cluster_alive, stall_timeout_s)
        # ClusterStatus and /metrics read Redis through this background reader only (status_cache.py)
        self.status = StatusCache(self._pin_counts, self._class_stats, status_interval_s)

    def _class_stats(self) -> dict[str, dict[str, int]]:
        return self.gate.class_stats(self.view.snapshot().alive_ids()) if self.gate is not None else {}

    def _refresh_loop(self) -> None:
        while not self._closed.wait(self.view.refresh_interval_s):
            self.placer.refresh(self.view.refresh())

    def _routable(self) -> list[str]:
        # inline refresh only if the background reader fell far behind
        return self.view.routable(self.view.request_snapshot())

    def _cluster_alive(self, cluster: str) -> bool:
        """False only when the cluster is registered but its heartbeat expired. A cluster missing from the
        membership may just not have re-registered yet after a Redis restart: its own stream errors (a broken
        front fails its requests, a dead process breaks the connection) are the signal then."""
        info = self.view.request_snapshot().get(cluster)
        return info is None or info.alive

    # --------------------------------------------------------------------------------------------- api
    def Generate(self, request, context) -> Iterator[router_pb2.GenerateResponse]:
        if isinstance(request, Undecodable):
            self.counters.inc("invalid")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.problem)
        api_key = self._check_api_key(context)
        try:
            req = self.validated(request)
        except InvalidRequest as e:
            self.counters.inc("invalid")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        yield from self.serve_request(req, api_key, context)

    def validated(self, request: router_pb2.GenerateRequest) -> ValidRequest:
        """The one validation of a public request (both doors); an unset seed becomes a random one, so unseeded
        sampling is random while the drawn seed still makes a failover resume exactly. Raises InvalidRequest."""
        req = validate_generate(request, self.limits)
        if request.HasField("sampling") and request.sampling.HasField("seed"):
            return req
        return dataclasses.replace(req, sampling=dataclasses.replace(req.sampling, seed=secrets.randbits(64)))

    @property
    def tokenizer(self) -> ByteTokenizer | None:
        """The model's tokenizer; None for a token-id model (its texts are empty)."""
        return self._tok

    @property
    def keys_enabled(self) -> bool:
        """Whether the deployment has API keys (without them every caller is the anonymous tenant)."""
        return self._keys.enabled

    def key_allowed(self, key: str) -> bool:
        return not self._keys.enabled or self._keys.admits(key)

    @property
    def draining(self) -> bool:
        with self._lock:
            return self._draining

    def serving(self) -> bool:
        """Taking requests: not draining and at least one routable cluster (the HTTP door's /health)."""
        return not self.draining and bool(self._routable())

    def serve_request(self, req: ValidRequest, api_key: str, context,
                      record: RequestRecord | None = None) -> Iterator[router_pb2.GenerateResponse]:
        """The request path both doors call (gRPC Generate, the HTTP door's calls): drain, stream slot, pin,
        admission, failover, metrics. ``context`` is a grpc.ServicerContext or one that behaves as one
        (abort raises, add_callback, is_active, time_remaining, set_trailing_metadata). ``record`` lets the door
        end a request itself (a stop string) with a finish reason the metrics count."""
        record = record if record is not None else RequestRecord()
        with self._lock:
            if self._draining:
                context.abort(grpc.StatusCode.UNAVAILABLE, "router is draining (shutting down); use another router")
            self._inflight += 1
        self.counters.inc("requests")
        m = self.metrics
        started = last = time.monotonic()
        generated = 0
        try:
            for msg in self._generate(req, api_key, context, record):
                now = time.monotonic()
                if msg.token_ids:
                    if not generated:
                        m.ttft.observe(now - started)
                        m.time_to_first_token.observe(now - started)
                    else:
                        m.inter_token_latency.observe((now - last) / len(msg.token_ids))
                    generated += len(msg.token_ids)
                    last = now
                if msg.finish_reason:
                    record.finish_reason = msg.finish_reason
                yield msg
        finally:
            if record.finish_reason:
                m.prompt_tokens.inc(len(req.prompt_ids))
                m.cached_prompt_tokens.inc(record.attempts.cached if record.attempts is not None else 0)
                m.e2e_latency.observe(time.monotonic() - started)
            outcome = "completed" if record.finish_reason else "failed"
            reason = record.finish_reason or ("abort" if not context.is_active() else "error")
            self.counters.inc(outcome)
            m.requests.labels(outcome=outcome).inc()
            m.finished.labels(finished_reason=reason).inc()
            m.generation_tokens.inc(generated)
            with self._lock:
                self._inflight -= 1
                self._idle.notify_all()

    def drain(self, timeout_s: float) -> int:
        """Stop taking requests (health NOT_SERVING, new calls UNAVAILABLE) and wait up to timeout_s for the
        in-flight ones to finish; returns how many are still in flight."""
        with self._lock:
            self._draining = True
        if self.health is not None:
            self.health.enter_graceful_shutdown()  # every service NOT_SERVING, and stays so
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._inflight and time.monotonic() < deadline:
                self._idle.wait(timeout=max(0.0, deadline - time.monotonic()))
            return self._inflight

    @property
    def inflight(self) -> int:
        with self._lock:
            return self._inflight

    def ClusterStatus(self, request, context):
        if isinstance(request, Undecodable):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.problem)
        self._check_api_key(context)
        snap = self.view.snapshot()
        out = router_pb2.ClusterStatusResponse(membership_stale=snap.stale)
        pins = self.status.pins()
        out.pinned_sessions = sum(pins.values())
        out.clusters.extend(self.cluster_infos(snap, pins))
        if self.gate is not None:
            for name, st in self.status.classes().items():
                out.classes.append(router_pb2.ClassStatus(
                    name=name, inflight_tokens=st["inflight_tokens"], inflight_requests=st["inflight_requests"],
                    queued=st["queued"], rejected=st["rejected"]))
        return out

    def cluster_infos(self, snap=None, pins: dict[str, int] | None = None) -> list[router_pb2.ClusterInfo]:
        """Per-cluster status from the last membership read (heartbeat load) and the last pin count; no internal
        endpoint (clients dial routers only)."""
        snap = snap or self.view.snapshot()
        pins = self.status.pins() if pins is None else pins
        out = []
        for c in snap.clusters:
            state = self.view.state(c.id, snap)
            out.append(router_pb2.ClusterInfo(
                cluster_id=c.id, healthy=c.alive and state.name != "SUSPECT", suspect=state.name == "SUSPECT",
                running_requests=int(c.load.get("running_requests", 0)),
                inflight_tokens=int(c.load.get("inflight_tokens", 0)),
                prefill_tp=int(c.load.get("prefill_tp", 0)), decode_tp=int(c.load.get("decode_tp", 0)),
                pinned_sessions=pins.get(c.id, 0),
                pools=[router_pb2.PoolUsage(name=n, used=u.used, capacity=u.capacity)
                       for n, u in from_load(c.load).items()]))
        return out

    def _pin_counts(self) -> dict[str, int]:
        try:
            return self.pins.serving_counts()
        except (redis.RedisError, OSError) as e:  # Redis down: status still answers, pins unknown (0)
            log.warning("cannot count pins: %s", e)
            return {}

    # ------------------------------------------------------------------------------------------ routing
    def _check_api_key(self, context) -> str:
        """The caller's API key ('' when the deployment has none); aborts UNAUTHENTICATED when it is wrong."""
        if not self._keys.enabled:
            return ""
        auth = dict(context.invocation_metadata()).get("authorization", "")
        key = auth[len("Bearer "):] if auth.startswith("Bearer ") else ""
        if not self._keys.admits(key):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or unknown API key (authorization: Bearer ...)")
        return key

    def _stub(self, cluster_id: str) -> cluster_pb2_grpc.ClusterStub | None:
        info = self.view.get(cluster_id)
        if info is None or "cluster" not in info.endpoints:
            return None
        addr = info.endpoints["cluster"]
        with self._lock:
            cached = self._channels.get(cluster_id)
            if cached is None or cached[0] != addr:
                if cached is not None:
                    cached[1].close()
                cached = (addr, open_channel(addr, self._auth.tls, options=[  # mutual TLS with `tls`
                    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]))
                self._channels[cluster_id] = cached
        return cluster_pb2_grpc.ClusterStub(cached[1])

    def _fail_over(self, key: str, cluster: str, tried: set[str]) -> str | None:
        """Where a session's request goes after ``cluster`` failed, and its pin with it: the pin's stored secondary
        (chosen when the pin was made, and what every router follows), else the best untried cluster in HRW
        order; a router that moved the pin first wins (compare-and-set on ``cluster``), and this one follows it."""
        order = [c for c in rank_clusters(key, self._routable()) if c not in tried]
        if not order:
            return None
        try:
            pin = self.pins.get(key)
            if pin is not None and pin.secondary in order:
                order.insert(0, pin.secondary)
            moved = self.pins.move(key, order[0], expected_serving=cluster)
        except (redis.RedisError, OSError) as e:  # keep serving on the computed choice
            log.warning("could not move pin of %s to %s (Redis: %s: %s)", key, order[0], type(e).__name__, e)
            return order[0]
        return moved.serving if moved is not None and moved.serving in order else order[0]

    def _next_anonymous(self, req: ValidRequest, salt: str, tried: set[str]) -> str | None:
        """A failover of a request without a session id: the same placement over the clusters not yet tried."""
        try:
            return self.placer.choose(req.prompt_ids, salt, self._routable(), exclude=tried,
                                      request_id=req.request_id).cluster
        except ValueError:
            return None

    def _reject(self, context, hint_s: float, by: str, message: str) -> None:
        self.counters.inc("rejected")
        self.metrics.refusals.labels(by=by.split(":")[0]).inc()
        context.set_trailing_metadata((("retry-after-s", f"{hint_s:.3f}"), ("k3serve-rejected-by", by)))
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{message}; retry after {hint_s:.2f}s")

    def _generate(self, req: ValidRequest, api_key: str, context,
                  record: RequestRecord | None = None) -> Iterator[router_pb2.GenerateResponse]:
        tenant = tenant_id(self._secret, api_key)  # from here on the request's id is scoped by its tenant
        req = dataclasses.replace(req, request_id=scoped_request_id(tenant, req.request_id), tenant=tenant)
        try:
            with self.quota.stream(tenant):
                yield from self._generate_held(req, api_key, context, record)
        except QuotaExceeded as e:
            self._reject(context, self.slots.retry_after_s(), "key", str(e))

    def _generate_held(self, req: ValidRequest, api_key: str, context,
                       record: RequestRecord | None) -> Iterator[router_pb2.GenerateResponse]:
        salt = tenant_salt(self._secret, api_key, req.cache_salt)
        key = cache_identity(req.session_id, req.prompt_ids, salt, self.policy.block_size)
        try:
            if req.session_id:
                serving = self.pins.resolve(key, self._routable()).serving
            else:  # no pin: placed by expected time to first token (anonymous.py)
                placed = self.placer.choose(req.prompt_ids, salt, self._routable(), request_id=req.request_id)
                serving = placed.cluster
        except (NoHealthyCluster, ValueError):
            snap = self.view.snapshot()
            log.warning("no healthy cluster: alive %s, stale=%s (%s)", snap.alive_ids(), snap.stale, snap.error)
            context.abort(grpc.StatusCode.UNAVAILABLE, "no healthy cluster; retry later")
        progress = StreamProgress("", req.sampling.max_tokens, self.durations)
        progress.pending_on = serving
        if not self.slots.try_acquire(progress):
            # the hint is the later of the median end of this router's streams (when slots free here) and the
            # drain time of the admission budget it would join
            hint, by, message = self.slots.retry_after_s(), "router", \
                f"this router serves {self.slots.max_streams} streams at most"
            if self.gate is not None and self.gate.enabled:
                uncached = self._uncached(key, req, serving, salt)
                cls = self.gate.request_class(uncached)
                progress.cls = cls.name
                # this router's streams bound there that Redis does not show yet are waiters ahead
                ahead = self.slots.pending_on(serving)
                rej = self.gate.refuse(serving, cls, uncached, message, expected_s=progress.remaining_s(),
                                       at_least_s=hint, unseen=(ahead, ahead * uncached))
                hint, by = rej.retry_after_s, f"router:{serving}/{cls.name}"
            self._reject(context, hint, by, message)
        try:
            yield from self._serve(req, key, salt, serving, progress, context, record)
        finally:
            self.slots.release(progress)

    def _serve(self, req: ValidRequest, key: str, salt: str, cluster: str, progress: StreamProgress, context,
               record: RequestRecord | None = None):
        cancelled = threading.Event()
        context.add_callback(cancelled.set)
        st = Attempts()
        if record is not None:
            record.attempts = st
        tried: set[str] = set()
        anonymous = not req.session_id
        res = self._admit(cluster, req, key, progress, cancelled, context, salt=salt)
        if not anonymous:
            self.pins.confirm(key)
        try:
            while True:
                target = Target(cluster, self._stub(cluster), key, salt)
                tok = None if getattr(context, "decodes_text", False) else self._tok  # decoded once, by its door
                attempt = stream_attempt(target, req, st, progress, self._auth, self.watchdog, tok, context)
                if anonymous:  # counted as queued prefill work there until its first token
                    attempt = _until_first(attempt, self.placer, cluster, len(req.prompt_ids) + len(st.streamed))
                ending = yield from attempt
                if ending is Ending.FINISHED:
                    self.view.mark_ok(cluster)
                    progress.finished()
                    if self.gate is not None and not anonymous:
                        self.gate.record_prompt(key, req.prompt_ids, cluster)
                    return
                if ending is Ending.CLIENT_GONE:
                    return
                self.view.mark_suspect(cluster)
                tried.add(cluster)
                nxt = self._next_anonymous(req, salt, tried) if anonymous else self._fail_over(key, cluster, tried)
                if nxt is None:
                    context.abort(grpc.StatusCode.UNAVAILABLE,
                                  f"every cluster failed this request (tried {sorted(tried)}); retry later")
                st.failovers += 1
                self.counters.inc("failovers")
                self.metrics.failovers.inc()
                if self.gate is not None and not st.streamed:
                    # the client has seen nothing: admit afresh where the request will now run
                    self.gate.release(res)
                    res = None
                    res = self._admit(nxt, req, key, progress, cancelled, context, salt=salt)
                elif self.gate is not None:
                    res = self.gate.move(res, nxt)  # same class and reservation: never refused mid-stream
                cluster = nxt
        finally:
            if self.gate is not None:
                self.gate.release(res)

    def _admit(self, cluster: str, req: ValidRequest, key: str, progress: StreamProgress,
               cancelled: threading.Event, context, *, salt: str = ""):
        if self.gate is None:
            return None
        uncached = self._uncached(key, req, cluster, salt)
        cls = self.gate.request_class(uncached)
        progress.cls = cls.name
        t = time.monotonic()
        progress.pending_on = ""  # from here Redis counts it (queued or holding)
        try:
            with self.quota.queued(req.tenant):
                res = self.gate.admit(cluster, req.request_id, uncached, cancelled, progress.remaining_s, cls)
        except QuotaExceeded as e:
            self._reject(context, self.slots.retry_after_s(), "key", str(e))
        except AdmissionRejected as e:
            self.metrics.rejections.labels(cls=cls.name).inc()
            self._reject(context, e.retry_after_s, f"admission:{e.cluster}/{e.cls}", e.message)
        self.metrics.admission_wait.labels(cls=cls.name).observe(time.monotonic() - t)
        progress.started = time.monotonic()  # time to first token is learned from admission on
        return res

    def _uncached(self, key: str, req: ValidRequest, cluster: str, salt: str) -> int:
        """The admission estimate: a session's from its last prompt there (gate.py), an anonymous request's from
        the cluster's published prefix map (anonymous.py)."""
        if req.session_id:
            return self.gate.uncached_tokens(key, req.prompt_ids, cluster)
        return len(req.prompt_ids) - self.placer.cached_on(cluster, req.prompt_ids, salt)

    def close(self) -> None:
        """Stop the background threads (membership refresher, watchdog, lease renewer), waiting for a Redis read
        in progress, so that the owner may close the Redis client after this returns; close the cluster channels."""
        self._closed.set()
        self._refresher.join(timeout=self.view.refresh_interval_s + 10.0)
        self.status.close()
        self.watchdog.close()
        if self.gate is not None:
            self.gate.close()
        self.quota.close()
        with self._lock:
            for _, ch in self._channels.values():
                ch.close()
            self._channels.clear()


def _incident(context, e: BaseException) -> None:
    """An exception no handler turned into a status: log it under an incident id and tell the client only that
    id (gRPC would otherwise send the exception's text). A call already aborted keeps its own status."""
    if context.code() is not None:
        raise e
    incident = uuid.uuid4().hex[:12]
    log.error("router incident %s: %s: %s", incident, type(e).__name__, e, exc_info=e)
    context.abort(grpc.StatusCode.INTERNAL, f"internal error in the router (incident {incident})")


def _stream_guard(fn):
    def handler(request, context):
        try:
            yield from fn(request, context)
        except Exception as e:  # noqa: BLE001 - see _incident
            _incident(context, e)
    return handler


def _unary_guard(fn):
    def handler(request, context):
        try:
            return fn(request, context)
        except Exception as e:  # noqa: BLE001 - see _incident
            _incident(context, e)
    return handler


def _until_first(attempt, placer: AnonymousPlacer, cluster: str, tokens: int):
    """``attempt``'s messages, telling ``placer`` when the first one (or the end) comes: prefill done there."""
    placer.sent(cluster, tokens)
    pending = True
    try:
        while True:
            try:
                msg = next(attempt)
            except StopIteration as stop:
                return stop.value
            if pending:
                placer.first_token(cluster, tokens)
                pending = False
            yield msg
    finally:
        if pending:
            placer.first_token(cluster, tokens)


def add_router_servicer(service: RouterService, server: grpc.Server) -> None:
    """``router_pb2_grpc.add_RouterServicer_to_server`` with tolerant request decoding (wire.py); no exception
    text reaches a client (_incident)."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            _stream_guard(service.Generate), request_deserializer=tolerant(router_pb2.GenerateRequest),
            response_serializer=router_pb2.GenerateResponse.SerializeToString),
        "ClusterStatus": grpc.unary_unary_rpc_method_handler(
            _unary_guard(service.ClusterStatus), request_deserializer=tolerant(router_pb2.ClusterStatusRequest),
            response_serializer=router_pb2.ClusterStatusResponse.SerializeToString),
    }
    name = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))


def start_router_server(service: RouterService, host: str = "127.0.0.1", port: int = 0) -> tuple[grpc.Server, str]:
    """Serve the router, the standard health service and reflection; returns (server, "host:port").

    The pool has ``max_streams`` + HEADROOM_THREADS threads: streams over ``max_streams`` are refused at once
    with a hint, so calls wait for a thread only as long as those refusals take. gRPC itself refuses
    calls beyond the pool + PENDING_RPCS (a backstop against a flood, without a hint)."""
    workers = service.slots.max_streams + HEADROOM_THREADS
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="router"),
                         options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)],
                         maximum_concurrent_rpcs=workers + PENDING_RPCS)
    add_router_servicer(service, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (router_pb2.DESCRIPTOR.services_by_name["Router"].full_name, health.SERVICE_NAME,
             reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    server.start()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set(names[0], health_pb2.HealthCheckResponse.SERVING)
    service.health = health_servicer
    return server, f"{advertised_host(host)}:{bound}"  # bound 0.0.0.0: an address clients elsewhere can dial
