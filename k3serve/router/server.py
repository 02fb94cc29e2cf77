"""The public router: ``k3serve.v1.Router`` over the clusters of a deployment.

Stateless apart from Redis: membership (heartbeats), session pins and admission live there, so any number of
replicas make the same decisions. Per request:

```
 validate ─▶ session key ─▶ pin (HRW primary/secondary, kept in Redis) ─▶ stream from the serving cluster
                                                      │ gRPC failure: breaker marks it suspect at once,
                                                      ▼ pin moves to the next survivor in HRW order
                              resubmit prompt + tokens already streamed, max_tokens - streamed, same seed
```
Randomness is keyed by (seed, absolute position), so the resumed stream continues exactly as an
uninterrupted run would have: no gap, no duplicate.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from k3serve.auth import AuthConfig, sign
from k3serve.internal.v1 import cluster_pb2, cluster_pb2_grpc
from k3serve.router.admission import AdmissionRejected
from k3serve.router.gate import AdmissionGate
from k3serve.router.hashing import rank_clusters, session_key
from k3serve.router.membership import MembershipView
from k3serve.router.metrics import RouterMetrics
from k3serve.router.pins import NoHealthyCluster, PinStore
from k3serve.router.validate import InvalidRequest, ModelLimits, ValidRequest, validate_generate
from k3serve.tokenizer import ByteTokenizer, StreamDecoder
from k3serve.v1 import router_pb2, router_pb2_grpc

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 4 << 20
_PASS_THROUGH = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
_CLUSTER_GENERATE = f"/{cluster_pb2.DESCRIPTOR.services_by_name['Cluster'].full_name}/Generate"


@dataclass
class _Progress:
    """What one client request has received so far, across failovers."""

    streamed: list[int] = field(default_factory=list)
    failovers: int = 0
    cached: int = 0
    finished: bool = False
    # one incremental decoder per client request, surviving failovers: text pieces follow the token stream
    text: StreamDecoder = field(default_factory=StreamDecoder)


class RouterService(router_pb2_grpc.RouterServicer):
    def __init__(self, view: MembershipView, pins: PinStore, limits: ModelLimits, secret: str,
                 api_keys: tuple[str, ...] = (), request_timeout_s: float = 600.0,
                 gate: AdmissionGate | None = None, metrics: RouterMetrics | None = None) -> None:
        self.view, self.pins, self.limits, self.gate = view, pins, limits, gate
        self._auth = AuthConfig(secret, peer="router")  # signs each call to a cluster front
        self.metrics = metrics or RouterMetrics()
        self.api_keys = frozenset(api_keys)
        self.timeout_s = request_timeout_s
        self._channels: dict[str, tuple[str, grpc.Channel]] = {}
        self._lock = threading.Lock()
        self._tok = ByteTokenizer() if limits.byte_tokenizer else None
        self.counters = {"requests": 0, "completed": 0, "failed": 0, "failovers": 0, "invalid": 0}
        # membership is read by a background thread, so the request path never waits on Redis; the first read
        # happens before serving (a router that never read Redis would see no cluster at all)
        self.view.refresh()
        self._closed = threading.Event()
        self._refresher = threading.Thread(target=self._refresh_loop, name="membership", daemon=True)
        self._refresher.start()

    def _refresh_loop(self) -> None:
        while not self._closed.wait(self.view.refresh_interval_s):
            self.view.refresh()

    def _routable(self) -> list[str]:
        # inline refresh only if the background reader fell far behind
        return self.view.routable(self.view.snapshot(max_age_s=max(2.0, 10 * self.view.refresh_interval_s)))

    # --------------------------------------------------------------------------------------------- api
    def Generate(self, request, context) -> Iterator[router_pb2.GenerateResponse]:
        self._check_api_key(context)
        try:
            req = validate_generate(request, self.limits)
        except InvalidRequest as e:
            self.counters["invalid"] += 1
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        self.counters["requests"] += 1
        started = time.monotonic()
        first = True
        outcome = "failed"
        try:
            for msg in self._generate(req, context):
                if first:
                    self.metrics.ttft.observe(time.monotonic() - started)
                    first = False
                if msg.finish_reason:
                    outcome = "completed"
                yield msg
        finally:
            self.metrics.requests.labels(outcome=outcome).inc()

    def ClusterStatus(self, request, context):
        self._check_api_key(context)
        snap = self.view.snapshot()
        out = router_pb2.ClusterStatusResponse(membership_stale=snap.stale)
        for c in snap.clusters:
            state = self.view.state(c.id, snap)
            out.clusters.append(router_pb2.ClusterInfo(
                cluster_id=c.id, healthy=c.alive and state.name != "SUSPECT", suspect=state.name == "SUSPECT",
                endpoint=c.endpoints.get("cluster", ""), running_requests=int(c.load.get("running_requests", 0)),
                inflight_tokens=int(c.load.get("inflight_tokens", 0)),
                prefill_tp=int(c.load.get("prefill_tp", 0)), decode_tp=int(c.load.get("decode_tp", 0))))
        if self.gate is not None:
            for name, st in self.gate.class_stats(snap.alive_ids()).items():
                out.classes.append(router_pb2.ClassStatus(
                    name=name, inflight_tokens=st["inflight_tokens"], inflight_requests=st["inflight_requests"],
                    queued=st["queued"], rejected=st["rejected"]))
        return out

    # ------------------------------------------------------------------------------------------ routing
    def _check_api_key(self, context) -> None:
        if not self.api_keys:
            return
        auth = dict(context.invocation_metadata()).get("authorization", "")
        if not auth.startswith("Bearer ") or auth[len("Bearer "):] not in self.api_keys:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or unknown API key (authorization: Bearer ...)")

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
                cached = (addr, grpc.insecure_channel(addr))
                self._channels[cluster_id] = cached
        return cluster_pb2_grpc.ClusterStub(cached[1])

    def _next_cluster(self, key: str, tried: set[str]) -> str | None:
        for c in rank_clusters(key, self._routable()):
            if c not in tried:
                return c
        return None

    def _generate(self, req: ValidRequest, context) -> Iterator[router_pb2.GenerateResponse]:
        key = session_key(req.session_id, req.prompt_ids)
        try:
            pin = self.pins.resolve(key, self._routable())
        except NoHealthyCluster:
            self.counters["failed"] += 1
            snap = self.view.snapshot()
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          f"no healthy cluster: alive {snap.alive_ids()}, stale={snap.stale} ({snap.error}), "
                          f"suspect {[c for c in snap.alive_ids() if not self.view.breaker.allows(c)]}")
        cluster: str | None = pin.serving
        state = _Progress()
        tried: set[str] = set()
        cancelled = threading.Event()
        context.add_callback(cancelled.set)
        uncached = self.gate.uncached_tokens(key, req.prompt_ids) if self.gate else len(req.prompt_ids)
        while cluster is not None:
            reservation = self._admit(cluster, req.request_id, uncached, cancelled, context)
            try:
                done = yield from self._stream(cluster, req, state, context)
            finally:
                if self.gate is not None:
                    self.gate.release(reservation)
            if done:
                if self.gate is not None and state.finished:
                    self.gate.record_prompt(key, req.prompt_ids)
                return
            self.view.mark_suspect(cluster)
            tried.add(cluster)
            nxt = self._next_cluster(key, tried)
            if nxt is not None:
                state.failovers += 1
                self.counters["failovers"] += 1
                self.metrics.failovers.inc()
                try:
                    self.pins.move(key, nxt, expected_serving=cluster)
                except Exception:  # noqa: BLE001 - Redis down: keep serving on the computed choice
                    log.warning("could not move pin of %s (Redis unreachable?)", key)
            cluster = nxt
            uncached = len(req.prompt_ids) + len(state.streamed)  # nothing of this session is cached there
        self.counters["failed"] += 1
        context.abort(grpc.StatusCode.UNAVAILABLE,
                      f"every cluster failed this request (tried {sorted(tried)}); retry later")

    def _admit(self, cluster: str, request_id: str, uncached: int, cancelled: threading.Event, context):
        if self.gate is None:
            return None
        cls = self.gate.request_class(uncached).name
        t = time.monotonic()
        try:
            res = self.gate.admit(cluster, request_id, uncached, cancelled)
            self.metrics.admission_wait.labels(cls=cls).observe(time.monotonic() - t)
            return res
        except AdmissionRejected as e:
            self.counters["rejected"] = self.counters.get("rejected", 0) + 1
            self.metrics.rejections.labels(cls=cls).inc()
            context.set_trailing_metadata((("retry-after-s", f"{e.retry_after_s:.2f}"),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{e.message}; retry after {e.retry_after_s:.1f}s")

    def _stream(self, cluster: str, req: ValidRequest, state: "_Progress", context):
        """Yield the cluster's tokens to the client; True when the request is over, False to fail over."""
        stub = self._stub(cluster)
        sampling = req.sampling.with_max_tokens(req.sampling.max_tokens - len(state.streamed)).to_proto()
        inner = router_pb2.GenerateRequest(request_id=req.request_id, session_id=req.session_id,
                                           prompt_token_ids=list(req.prompt_ids) + state.streamed, sampling=sampling)
        try:
            if stub is None:
                raise ConnectionError(f"cluster {cluster} has no endpoint")
            call = stub.Generate(cluster_pb2.ClusterGenerateRequest(request=inner, absolute_offset=len(state.streamed)),
                                 metadata=sign(self._auth, _CLUSTER_GENERATE, req.request_id),
                                 timeout=self.timeout_s)
            context.add_callback(call.cancel)
            for resp in call:
                if not state.streamed and not state.failovers:
                    state.cached = resp.cached_tokens
                state.streamed += resp.token_ids
                msg = router_pb2.GenerateResponse(token_ids=resp.token_ids, finish_reason=resp.finish_reason)
                if self._tok is not None:
                    msg.text = state.text.decode(resp.token_ids, final=bool(resp.finish_reason))
                if resp.finish_reason:
                    msg.usage.CopyFrom(router_pb2.Usage(
                        prompt_tokens=len(req.prompt_ids), cached_tokens=state.cached,
                        completion_tokens=len(state.streamed), cluster_id=cluster, failovers=state.failovers))
                    self.view.mark_ok(cluster)
                    self.counters["completed"] += 1
                    state.finished = True
                    yield msg
                    return True
                yield msg
            raise ConnectionError(f"cluster {cluster} ended the stream without finishing")
        except grpc.RpcError as e:
            if not context.is_active():
                return True  # the client went away; its cancel reached the cluster through the callback
            if e.code() in _PASS_THROUGH:
                self.counters["failed"] += 1
                context.abort(e.code(), e.details())
            log.warning("cluster %s failed request %s: %s %s", cluster, req.request_id, e.code(), e.details())
        except ConnectionError as e:
            log.warning("%s", e)
        return False

    def close(self) -> None:
        self._closed.set()
        if self.gate is not None:
            self.gate.close()
        with self._lock:
            for _, ch in self._channels.values():
                ch.close()
            self._channels.clear()


def start_router_server(service: RouterService, host: str = "127.0.0.1", port: int = 0,
                        max_workers: int = 64) -> tuple[grpc.Server, str]:
    """Serve the router, the standard health service and reflection; returns (server, "host:port")."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers),
                         options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])
    router_pb2_grpc.add_RouterServicer_to_server(service, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (router_pb2.DESCRIPTOR.services_by_name["Router"].full_name, health.SERVICE_NAME,
             reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    server.start()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set(names[0], health_pb2.HealthCheckResponse.SERVING)
    return server, f"{host}:{bound}"
