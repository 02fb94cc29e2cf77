"""A scriptable stand-in for a cluster front (k3serve.internal.v1.Cluster) and a router wired to it, for tests of
the router against a real redis-server and real gRPC without Ray or a model.

Token i of a request (absolute position offset + i) is ``(offset + i) % 251``, so a stream with a gap or a
duplicate across a failover is visible in its tokens. With ``sampling.logprobs`` each token comes with
``expected_logprob(token)``, exact in float32.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc

from k3serve.cluster.redis_server import connect
from k3serve.internal.v1 import cluster_pb2, cluster_pb2_grpc
from k3serve.router.admission import ClassSpec
from k3serve.router.gate import AdmissionGate
from k3serve.router.membership import BreakerConfig, CircuitBreaker, Membership, MembershipView
from k3serve.router.pins import PinStore
from k3serve.router.server import RouterService, start_router_server
from k3serve.router.validate import ModelLimits
from k3serve.v1 import router_pb2 as pb, router_pb2_grpc

SECRET = "s" * 32


def expected_tokens(n: int, offset: int = 0) -> list[int]:
    return [(offset + i) % 251 for i in range(n)]


def expected_logprob(token: int) -> float:
    return -(token + 1) / 16


@dataclass
class Behaviour:
    delay_s: float = 0.0  # between tokens
    fail_after: int | None = None  # abort UNAVAILABLE after this many tokens (once)
    stall_after: int | None = None  # stop sending (until cancelled) after this many tokens (once)
    first_delay_s: float = 0.0  # before the first token (a long prefill)
    internal_after: int | None = None  # abort INTERNAL (an op or sampling that raised for it) after this many tokens
    per_message: int = 1  # tokens per response message (speculative decoding sends several)


@dataclass
class Seen:
    request_id: str
    session_id: str
    cache_salt: str
    prompt_len: int
    offset: int
    seed: int = 0
    logprobs: bool = False


class FakeCluster(cluster_pb2_grpc.ClusterServicer):
    def __init__(self, cluster_id: str, behaviour: Behaviour | None = None) -> None:
        self.cluster_id = cluster_id
        self.behaviour = behaviour or Behaviour()
        self.seen: list[Seen] = []
        self.running: set[str] = set()
        self.tokens_sent = 0  # over every request: a cancelled stream stops adding to it
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=64))
        cluster_pb2_grpc.add_ClusterServicer_to_server(self, self.server)
        self.endpoint = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def Generate(self, request, context):
        req, b = request.request, self.behaviour
        with self._lock:
            self.seen.append(Seen(req.request_id, req.session_id, request.cache_salt, len(req.prompt_token_ids),
                                  request.absolute_offset, req.sampling.seed, req.sampling.logprobs))
            if req.request_id in self.running:
                context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id {req.request_id!r} is already running")
            self.running.add(req.request_id)
        try:
            if b.first_delay_s:
                time.sleep(b.first_delay_s)
            n = req.sampling.max_tokens
            batch: list[int] = []
            for i in range(n):
                if b.internal_after is not None and i == b.internal_after:
                    context.abort(grpc.StatusCode.INTERNAL, "sampling failed: RuntimeError at /srv/engine.py:42")
                if b.fail_after is not None and i == b.fail_after:
                    b.fail_after = None
                    context.abort(grpc.StatusCode.UNAVAILABLE, "injected cluster failure")
                if b.stall_after is not None and i == b.stall_after:
                    b.stall_after = None
                    while context.is_active():
                        time.sleep(0.02)
                    return
                if b.delay_s:
                    time.sleep(b.delay_s)
                batch.append((request.absolute_offset + i) % 251)
                if len(batch) < b.per_message and i < n - 1:
                    continue
                self.tokens_sent += len(batch)
                yield cluster_pb2.ClusterGenerateResponse(
                    token_ids=batch, finish_reason="length" if i == n - 1 else "", cached_tokens=0,
                    logprobs=[expected_logprob(t) for t in batch] if req.sampling.logprobs else [])
                batch = []
        finally:
            with self._lock:
                self.running.discard(req.request_id)

    def stop(self) -> None:
        self.server.stop(0)


@dataclass
class Rig:
    """Fake clusters registered in a namespace, and routers over them."""

    url: str
    ns: str
    clusters: dict[str, FakeCluster] = field(default_factory=dict)
    routers: list[tuple[RouterService, grpc.Server, str]] = field(default_factory=list)
    _beat: threading.Event = field(default_factory=threading.Event)

    def add_cluster(self, cluster_id: str, behaviour: Behaviour | None = None) -> FakeCluster:
        fc = FakeCluster(cluster_id, behaviour)
        Membership(connect(self.url), self.ns, SECRET).register(cluster_id, {"cluster": fc.endpoint}, ttl_s=60,
                                                       heartbeat_ttl_s=30)
        self.clusters[cluster_id] = fc
        return fc

    def add_router(self, classes: list[ClassSpec] | None = None, *, admission: bool = True, **service_kw
                   ) -> tuple[RouterService, router_pb2_grpc.RouterStub]:
        client = connect(self.url, timeout_s=2.0)
        view = MembershipView(Membership(client, self.ns, SECRET), refresh_interval_s=0.1,
                              breaker=CircuitBreaker(BreakerConfig(cool_down_s=30.0)))
        gate = None
        if admission:
            gate = AdmissionGate(client, self.ns, classes or default_classes(), lease_ttl_s=3.0,
                                 renew_interval_s=0.2)
        svc = RouterService(view, PinStore(client, self.ns), ModelLimits(1000, 100_000, False), SECRET,
                            gate=gate, **service_kw)
        server, addr = start_router_server(svc)
        self.routers.append((svc, server, addr))
        return svc, router_pb2_grpc.RouterStub(grpc.insecure_channel(addr))

    def close(self) -> None:
        for svc, server, _ in self.routers:
            server.stop(0)
            svc.close()
        for fc in self.clusters.values():
            fc.stop()


def default_classes() -> list[ClassSpec]:
    return [ClassSpec("short", 4096, inflight_token_budget=100_000, max_concurrent=16, queue_limit=8, max_wait_s=2.0),
            ClassSpec("long", None, inflight_token_budget=1 << 30, max_concurrent=1, queue_limit=0, max_wait_s=0.0)]


def generate(stub, timeout=30, metadata=None, **fields):
    """One Generate call to the end: (every token id, the last message)."""
    fields.setdefault("sampling", pb.SamplingParams(max_tokens=5, ignore_eos=True))
    msgs = list(stub.Generate(pb.GenerateRequest(**fields), timeout=timeout, metadata=metadata))
    return [t for m in msgs for t in m.token_ids], msgs[-1]


def rpc_error(fn) -> grpc.RpcError:
    """The gRPC error ``fn()`` raises (it must raise one)."""
    try:
        fn()
    except grpc.RpcError as e:
        return e
    raise AssertionError("expected a gRPC error")
