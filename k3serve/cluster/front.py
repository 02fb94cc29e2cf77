"""The cluster front: one per cluster, it runs the prefill and decode engines and serves the internal
``k3serve.internal.v1.Cluster`` gRPC API to routers.

```
 router ──Generate──▶ gRPC handler thread ──inbox──▶ engine thread: DisaggLoop.step (disagg/loop.py)
        ◀──stream──── per-request queue ◀──────────── StreamEvents (tokens, end, failure) ◀──┘
```
The engine thread is the only one that touches the engines. A worker failure (a dead rank) fails every
in-flight request with UNAVAILABLE, so routers fail over at once, and marks the front broken: it stops
heartbeating and refuses new work until rebuilt.

Cancellation: when a call ends for any reason (client cancel, deadline, normal end) its gRPC callback puts a
cancel in the inbox and wakes the handler thread, which returns at once: the id is free again immediately,
and the engine thread drops the request from whichever pool or queue holds it (prefill queue, prefill, waiting
for install with staged state, decoding) before it reads anything queued after the cancel. Each call runs in
the engines under its own internal id (`<request_id>#<n>`), so a re-sent id never receives an event of the
call it replaces.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass

import grpc

from k3serve.auth import AuthConfig, AuthInterceptor, signed_subject
from k3serve.tls import TlsMaterial, add_port
from k3serve.netaddr import advertised_host
from k3serve.engine.executor import WorkerDied
from k3serve.contracts.errors import ErrorCode
from k3serve.contracts.numerics import DEFAULT_NUMERICS, Numerics
from k3serve.contracts.requests import PrefillRequest, RequestFailure, StreamEvent
from k3serve.contracts.sampling import SamplingParams
from k3serve.internal.v1 import cluster_pb2, cluster_pb2_grpc
from k3serve.contracts.status import PoolUsage
from k3serve.disagg.loop import DisaggLoop

log = logging.getLogger(__name__)

# The warm-up request (ClusterFront.warm_up): a prompt shorter than a prefix-cache block (nothing is cached), and
# enough decode steps to run the decode path and its sampling more than once.
WARM_UP_PROMPT = tuple(range(1, 17))
WARM_UP_SAMPLING = SamplingParams(max_tokens=4, ignore_eos=True)
WARM_UP_TIMEOUT_S = 120.0


def split_resumed(ids: tuple[int, ...], offset: int, numerics: Numerics) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A router's resubmission after a failover is prompt + the `offset` tokens already streamed. Default
    numerics prefill all of it; deterministic numerics prefill the prompt and replay the streamed tokens
    through decode steps, as the interrupted run computed them. Returns (prompt, replayed tokens)."""
    if not numerics.deterministic or offset <= 0 or offset >= len(ids):
        return ids, ()
    return ids[: len(ids) - offset], ids[len(ids) - offset:]


# A step that prefilled fewer tokens says more about per-step overhead than about the rate (the warm-up's 16
# tokens would teach routers a rate far below the cluster's).
RATE_MIN_TOKENS = 512


class ClusterFront(cluster_pb2_grpc.ClusterServicer):
    def __init__(self, cluster_id: str, loop: DisaggLoop, secret: str, prefill_tp: int, decode_tp: int,
                 numerics: Numerics = DEFAULT_NUMERICS, tls: TlsMaterial | None = None) -> None:
        """loop: the cluster's prefill/decode pair (its engines share one StateChannel); numerics: the
        deployment's mode (deterministic: a resumed request replays its streamed tokens through decode); tls:
        the deployment's certificates (routers then reach the front over mutual TLS only)."""
        self.cluster_id, self.loop, self.numerics = cluster_id, loop, numerics
        self.prefill, self.decode = loop.prefill, loop.decode
        self.secret, self.prefill_tp, self.decode_tp, self.tls = secret, prefill_tp, decode_tp, tls
        self._inbox: queue.Queue = queue.Queue()
        self._calls: dict[str, _Call] = {}  # by the client's request id: one call per id at a time
        self._outs: dict[str, queue.Queue] = {}  # by internal id: where the engine thread sends events
        self._seq = itertools.count()
        self._lock = threading.Lock()  # guards _calls, _outs and _metrics (gRPC threads + engine thread)
        self._stop = threading.Event()
        self.broken: str = ""
        self._metrics = {"requests": 0.0, "completed": 0.0, "failed": 0.0, "cancelled": 0.0,
                         "prefix_hit_tokens": 0.0, "grpc_transfers": 0.0}
        self._pools: dict[str, PoolUsage] = {}  # snapshot taken by the engine thread (see cluster/pools.py)
        # what routers place anonymous requests by (router/anonymous.py), snapshots of the engine thread: the
        # block hashes its checkpoints sit at (with the cache's version), prefill work queued, measured rate
        self.prefix_hashes: tuple[int, frozenset[int]] = (-1, frozenset())
        self._queued_tokens = 0
        self._prefill_tps = 0.0
        self.staging: Callable[[], PoolUsage] | None = None  # decode staging, asked of the receivers
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
        port = add_port(self._server, f"{host}:0", self.tls)
        self._server.start()
        return f"{advertised_host(host)}:{port}"  # bound 0.0.0.0: an address routers on other nodes can dial

    def stop(self, grace_s: float = 2.0) -> None:
        """Stop accepting, let in-flight requests drain for grace_s, then stop the engine thread."""
        if self._server is not None:
            self._server.stop(grace_s).wait()
        self._stop.set()
        self._thread.join(timeout=10)

    @property
    def metrics(self) -> dict[str, float]:
        with self._lock:
            return dict(self._metrics)

    def _count(self, name: str, n: float = 1.0) -> None:
        with self._lock:
            self._metrics[name] += n

    @property
    def load(self) -> dict[str, float]:
        """Heartbeat load: running requests, their in-flight tokens (prompt + streamed), pool occupancy."""
        from k3serve.contracts.status import as_load

        with self._lock:
            running = len(self._calls)
            tokens = sum(c.tokens for c in self._calls.values())
        return {"running_requests": running, "inflight_tokens": tokens, "broken": 1.0 if self.broken else 0.0,
                "prefill_queued_tokens": self._queued_tokens, "prefill_tps": self._prefill_tps,
                **as_load(self.pools())}

    def pools(self) -> dict[str, PoolUsage]:
        """Pool occupancy: the engine thread's last snapshot, plus decode staging when the channel has one."""
        out = dict(self._pools)
        if self.staging is not None:
            out["decode.staging_bytes"] = self.staging()
        return out

    # ---------------------------------------------------------------------------------------------- rpc
    def warm_up(self, timeout_s: float = WARM_UP_TIMEOUT_S) -> float:
        """Run one short request through this cluster's own pipeline (prefill on every prefill rank, the transfer,
        decode steps) before it serves; returns its seconds. A cold cluster's first requests run 3-4x as long as the
        same requests later, which costs a deployment's first users that time and teaches the router's admission
        holding times that the service never has again (docs/architecture.md §11, "Cold clusters"). The request is
        the engine's own: it is not counted in ``metrics`` requests and leaves no prefix-cache entry (its prompt
        is shorter than a block). Raises RuntimeError if it fails or runs past ``timeout_s`` (the cluster is not
        fit to serve)."""
        engine_id, out = f"warm-up#{next(self._seq)}", queue.Queue()
        with self._lock:
            self._outs[engine_id] = out
        started = time.monotonic()
        self._inbox.put(("add", PrefillRequest(engine_id, WARM_UP_PROMPT, WARM_UP_SAMPLING)))
        try:
            while True:
                left = started + timeout_s - time.monotonic()
                try:  # (in short waits: a front stopped meanwhile ends it at once)
                    item = out.get(timeout=min(max(left, 0.0), 0.5))
                except queue.Empty:
                    if self._stop.is_set():
                        raise RuntimeError(f"cluster {self.cluster_id}: stopped during its warm-up") from None
                    if left > 0.5:
                        continue
                    self._inbox.put(("cancel", engine_id))
                    raise RuntimeError(f"cluster {self.cluster_id}: the warm-up request ran past {timeout_s:.0f} s")
                if item.error is not None:
                    raise RuntimeError(f"cluster {self.cluster_id}: the warm-up request failed: {item.error.message}")
                if item.finish_reason:
                    return time.monotonic() - started
        finally:
            with self._lock:
                self._outs.pop(engine_id, None)

    def Generate(self, request, context):
        req = request.request
        rid = req.request_id
        if signed_subject(context) != rid:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "request_id is not the one this call was signed for")
        if self.broken:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"cluster {self.cluster_id} is down: {self.broken}")
        call = _Call(f"{rid}#{next(self._seq)}", queue.Queue(), len(req.prompt_token_ids))
        with self._lock:
            if rid in self._calls:
                context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id {rid!r} is already running here")
            self._calls[rid] = call
            self._outs[call.engine_id] = call.out
        self._count("requests")
        prompt, replay = split_resumed(tuple(req.prompt_token_ids), request.absolute_offset, self.numerics)
        self._inbox.put(("add", PrefillRequest(call.engine_id, prompt, SamplingParams.from_proto(req.sampling),
                                               req.session_id, cache_salt=request.cache_salt,
                                               replay_ids=replay)))

        def ended() -> None:  # any end of the call: cancel in the engine (a no-op if it finished), wake the handler
            self._inbox.put(("cancel", call.engine_id))
            call.out.put(_GONE)

        context.add_callback(ended)
        finished = False
        try:
            while True:
                item = call.out.get()
                if item is _GONE:  # cancelled or past its deadline: the engine drops it on reading the cancel
                    return
                if item.error is not None:
                    finished = True
                    self._count("failed")
                    context.abort(item.error.code.grpc_status, item.error.message)
                call.tokens += len(item.token_ids)
                yield cluster_pb2.ClusterGenerateResponse(token_ids=item.token_ids, finish_reason=item.finish_reason,
                                                          cached_tokens=max(item.cached_tokens, 0),
                                                          drafted_tokens=item.drafted_tokens,
                                                          accepted_tokens=item.accepted_tokens,
                                                          verify_steps=item.verify_steps, logprobs=item.logprobs)
                if item.finish_reason:
                    finished = True
                    self._count("completed")
                    return
        finally:
            if not finished:
                self._count("cancelled")
            with self._lock:
                self._calls.pop(rid, None)
                self._outs.pop(call.engine_id, None)

    def Status(self, request, context):
        with self._lock:
            running = len(self._calls)
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
        from k3serve.cluster.pools import engine_pools

        while not self._stop.is_set():
            idle = not self.loop.has_work
            self._drain_inbox(block=idle)
            try:
                computed, t0 = self.prefill.stats["computed_tokens"], time.monotonic()
                self._step()
                self._pools = engine_pools(self.prefill, self.decode)
                self._placement_snapshot(self.prefill.stats["computed_tokens"] - computed, time.monotonic() - t0)
            except WorkerDied as e:  # the group is broken: fail everything here, the agent rebuilds
                self._fail_all(f"worker died: {e}".splitlines()[0])
                return
            except Exception as e:  # noqa: BLE001 - an engine bug must not leave clients hanging
                log.exception("engine step failed")
                self._fail_all(f"internal error: {e}")
                return

    def _step(self) -> None:
        for ev in self.loop.step():
            self._send(ev.request_id, ev)
        with self._lock:
            self._metrics["prefix_hit_tokens"] = float(self.loop.stats.prefix_hit_tokens)
            self._metrics["grpc_transfers"] = float(self.loop.stats.staged_transfers)

    def _placement_snapshot(self, computed: int, dt: float) -> None:
        p = self.prefill
        self._queued_tokens = sum(len(r.prompt_ids) for r in p.waiting) + sum(
            r.prompt_len - r.num_computed for r in p.running)
        if computed >= RATE_MIN_TOKENS and dt > 0:  # an EWMA over steps that prefilled a block or more
            rate = computed / dt
            self._prefill_tps = rate if not self._prefill_tps else 0.9 * self._prefill_tps + 0.1 * rate
        cache = p.cache
        if cache.version != self.prefix_hashes[0]:
            self.prefix_hashes = (cache.version, cache.checkpoint_hashes())

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


@dataclass
class _Call:
    """One Generate call: its id in the engines, its event queue, its tokens in flight (prompt + streamed)."""

    engine_id: str
    out: queue.Queue
    tokens: int


_GONE = object()  # put in a call's queue when the call ended (cancel, deadline): its handler returns
