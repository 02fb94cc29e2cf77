"""The router load burst's monitor (benchmarks/router_load.py): every (cluster, "short") budget sampled from
Redis every 20 ms, atomically per sample, and the routers' health and ``ClusterStatus`` probed every 0.2 s.

A hint is compared with the first sampled moment its budget had a free room and nobody waiting for it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import grpc
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from k3serve.router.admission import ClassSpec
from k3serve.v1 import router_pb2 as pb
from k3serve.v1 import router_pb2_grpc


@dataclass(frozen=True)
class Line:
    """One sampled (cluster, "short") budget: in flight and waiting."""

    count: int
    tokens: int
    queued: int

    def room(self, max_concurrent: int) -> bool:
        """Whether a newcomer would find a room: one is free and nobody waits for it."""
        return self.count < max_concurrent and self.queued == 0


PROBE_TIMEOUT_S = 10.0


class Monitor:
    """Samples every (cluster, "short") budget from Redis, atomically per sample, and probes health and status of
    each router; ``stop`` ends both threads."""

    def __init__(self, client, admission, spec: ClassSpec, clusters: list[str], addrs: list[str]) -> None:
        """``client``: a Redis client of the deployment's server; ``admission``: the routers' ``Admission`` (its key
        layout and stats script); ``spec``: the sampled "short" class; ``addrs``: the routers to probe."""
        self.client, self.admission, self.spec, self.clusters, self.addrs = client, admission, spec, clusters, addrs
        self.samples: list[tuple[float, dict[str, Line]]] = []
        self.probe_failures: list[str] = []
        self.sample_failures: list[str] = []
        self.probes = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._sample), threading.Thread(target=self._probe)]
        for t in self._threads:
            t.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            t = time.monotonic()  # the state is read during the call: stamp it with the call's midpoint
            try:
                loads = self.admission.stats([(c, "short") for c in self.clusters])
            except (redis.RedisError, OSError) as e:  # a missed sample, counted: the next one reads the state anew
                self.sample_failures.append(repr(e))
                continue
            mid = (t + time.monotonic()) / 2
            self.samples.append((mid, {c: Line(load.count, load.tokens, load.queued)
                                       for c, load in zip(self.clusters, loads)}))

    def _probe(self) -> None:
        # the invariant is that routers answer under load, not how fast: a deadline a loaded 2-core host can miss
        # would report a timing as a failure (the bench reports latencies separately)
        channels = [grpc.insecure_channel(a) for a in self.addrs]
        while not self._stop.wait(0.2):
            for ch in channels:
                self.probes += 1
                try:
                    h = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=PROBE_TIMEOUT_S)
                    if h.status != health_pb2.HealthCheckResponse.SERVING:
                        self.probe_failures.append(f"health {h.status}")
                    router_pb2_grpc.RouterStub(ch).ClusterStatus(pb.ClusterStatusRequest(), timeout=PROBE_TIMEOUT_S)
                except grpc.RpcError as e:
                    self.probe_failures.append(repr(e))

    def room_at(self, cluster: str, since: float) -> float | None:
        """The first sampled moment after ``since`` at which ``cluster``'s budget had a room for a newcomer."""
        return next((t for t, loads in self.samples
                     if t >= since and loads[cluster].room(self.spec.max_concurrent)), None)

    def room_before(self, cluster: str, at: float) -> bool:
        """Whether the last sample before ``at`` showed ``cluster``'s budget with a room for a newcomer."""
        last = [loads[cluster] for t, loads in self.samples if t < at][-1:]
        return bool(last) and last[0].room(self.spec.max_concurrent)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(5)
