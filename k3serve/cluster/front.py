"""The cluster front: one per cluster, it runs the prefill and decode engines and serves the internal
``k3serve.internal.v1.Cluster`` gRPC API to routers.

```
 router ──Generate──▶ gRPC handler thread ──inbox──▶ engine thread: DisaggLoop.step (disagg/loop.py)
        ◀──stream──── per-request queue ◀──────────── StreamEvents (tokens, end, failure) ◀──┘
```
The engine thread is the only one that touches the engines. A worker failure (a dead rank) fails every
in-flight request with UNAVAILABLE, so routers fail over at once, and marks the front broken: it stops
heartbeating and refuses new work until rebuilt.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent import futures

import grpc

from k3serve.auth import AuthConfig, AuthInterceptor, signed_subject
from k3serve.engine.executor import WorkerFailure
from k3serve.contracts.errors import ErrorCode
from k3serve.contracts.requests import PrefillRequest, RequestFailure, StreamEvent
from k3serve.contracts.sampling import SamplingParams
from k3serve.internal.v1 import cluster_pb2, cluster_pb2_grpc
from k3serve.disagg.loop import DisaggLoop

log = logging.getLogger(__name__)


class ClusterFront(cluster_pb2_grpc.ClusterServicer):
    def __init__(self, cluster_id: str, loop: DisaggLoop, secret: str, prefill_tp: int, decode_tp: int) -> None:
        """loop: the cluster's prefill/decode pair (its engines share one StateChannel)."""
        self.cluster_id, self.loop = cluster_id, loop
        self.prefill, self.decode = loop.prefill, loop.decode
        self.secret, self.prefill_tp, self.decode_tp = secret, prefill_tp, decode_tp
        self._inbox: queue.Queue = queue.Queue()
        self._outs: dict[str, queue.Queue] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.broken: str = ""
        self.metrics = {"requests": 0.0, "completed": 0.0, "failed": 0.0, "prefix_hit_tokens": 0.0,
                        "grpc_transfers": 0.0}
        self._thread = threading.Thread(target=self._loop, name=f"engine-{cluster_id}", daemon=True)
        self._server: grpc.Server | None = None

    # -------------------------------------------------------------------------------------------- serve
    def start(self, host: str = "127.0.0.1") -> str:
        self._thread.start()
        # routers sign each call (k3serve/auth.py); unsigned or stale calls are refused before any message is read
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=64),
                                   interceptors=(AuthInterceptor(AuthConfig(self.secret, peer=self.cluster_id)),),
                                   options=[("grpc.max_receive_message_length", 8 << 20)])
        cluster_pb2_grpc.add_ClusterServicer_to_server(self, self._server)
        port = self._server.add_insecure_port(f"{host}:0")
        self._server.start()
        return f"{host}:{port}"

    def stop(self, grace_s: float = 2.0) -> None:
        """Stop accepting, let in-flight requests drain for grace_s, then stop the engine thread."""
        if self._server is not None:
            self._server.stop(grace_s).wait()
        self._stop.set()
        self._thread.join(timeout=10)

    @property
    def load(self) -> dict[str, float]:
        with self._lock:
            running = len(self._outs)
        return {"running_requests": running, "broken": 1.0 if self.broken else 0.0}

    # ---------------------------------------------------------------------------------------------- rpc
    def Generate(self, request, context):
        req = request.request
        rid = req.request_id
        if signed_subject(context) != rid:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "request_id is not the one this call was signed for")
        if self.broken:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"cluster {self.cluster_id} is down: {self.broken}")
        out: queue.Queue = queue.Queue()
        with self._lock:
            if rid in self._outs:
                context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id {rid!r} is already running here")
            self._outs[rid] = out
        self.metrics["requests"] += 1
        self._inbox.put(("add", PrefillRequest(rid, tuple(req.prompt_token_ids), SamplingParams.from_proto(req.sampling),
                                               req.session_id)))
        context.add_callback(lambda: self._inbox.put(("cancel", rid)))
        try:
            while True:
                item: StreamEvent = out.get()
                if item.error is not None:
                    self.metrics["failed"] += 1
                    context.abort(item.error.code.grpc_status, item.error.message)
                yield cluster_pb2.ClusterGenerateResponse(token_ids=item.token_ids, finish_reason=item.finish_reason,
                                                          cached_tokens=max(item.cached_tokens, 0))
                if item.finish_reason:
                    self.metrics["completed"] += 1
                    return
        finally:
            with self._lock:
                self._outs.pop(rid, None)

    def Status(self, request, context):
        with self._lock:
            running = len(self._outs)
        return cluster_pb2.ClusterState(cluster_id=self.cluster_id, running_requests=running,
                                        prefill_tp=self.prefill_tp, decode_tp=self.decode_tp,
                                        metrics={k: float(v) for k, v in self.metrics.items()})

    # ------------------------------------------------------------------------------------------- engine
    def _send(self, rid: str, item: StreamEvent) -> None:
        with self._lock:
            out = self._outs.get(rid)
        if out is not None:
            out.put(item)

    def _drain_inbox(self, block: bool) -> None:
        try:
            kind, value = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if kind == "add":
                self.loop.add(value)
            elif kind == "cancel":
                self.loop.cancel(value)
            try:
                kind, value = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _loop(self) -> None:
        while not self._stop.is_set():
            idle = not self.loop.has_work
            self._drain_inbox(block=idle)
            try:
                self._step()
            except WorkerFailure as e:
                self._fail_all(f"worker failure: {e}".splitlines()[0])
                return
            except Exception as e:  # noqa: BLE001 - an engine bug must not leave clients hanging
                log.exception("engine step failed")
                self._fail_all(f"internal error: {e}")
                return

    def _step(self) -> None:
        for ev in self.loop.step():
            self._send(ev.request_id, ev)
        self.metrics["prefix_hit_tokens"] = float(self.loop.stats.prefix_hit_tokens)
        self.metrics["grpc_transfers"] = float(self.loop.stats.staged_transfers)

    def mark_broken(self, why: str) -> None:
        """From outside the engine (a rank found dead while idle): fail in-flight requests, refuse new ones."""
        if not self.broken:
            self._fail_all(why)

    def _fail_all(self, why: str) -> None:
        self.broken = why
        with self._lock:
            rids = list(self._outs)
        for rid in rids:
            failure = RequestFailure(rid, ErrorCode.UNAVAILABLE, f"cluster {self.cluster_id}: {why}")
            self._send(rid, StreamEvent(rid, error=failure))

