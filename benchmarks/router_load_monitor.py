"""The router load burst's monitor (benchmarks/router_load.py): every (cluster, "short") budget sampled from
Redis every 20 ms, atomically per sample, and the routers' health and ``ClusterStatus`` probed every 0.2 s.

Whether a held place (a retry ticket's) is free is computed here from the raw samples by the line rule of
router/admission.py, independently of the Lua script's own stamps: the monitor checks the script, it does not
read it back.
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
    """One sampled (cluster, "short") budget: in flight, held places (ticket -> place), queue places, the held
    places lent to a borrower in flight (ticket -> borrower) and the tickets whose holders are back."""

    count: int
    tokens: int
    tix: dict
    q: list
    lent: dict
    back: set

    def free(self, ticket_id: str, max_concurrent: int) -> bool:
        """Whether the ticket's place is free, by the line rule of router/admission.py computed from the raw sample
        (not from the Lua script's own stamps): in flight (less the place's own borrower) + everything before it
        in line < ``max_concurrent``, where a held place lent to a borrower in flight while its holder is away
        counts as no place (its borrower is in flight)."""
        place = self.tix[ticket_id]
        ahead = sum(p < place and not (tid in self.lent and tid not in self.back) for tid, p in self.tix.items())
        ahead += sum(p < place for p in self.q)
        taken = self.count - (ticket_id in self.lent) + ahead
        return taken == 0 or taken < max_concurrent


class Monitor:
    """Samples every (cluster, "short") budget from Redis, atomically per sample, and probes health and status of
    each router; ``stop`` ends both threads."""

    def __init__(self, client, admission, spec: ClassSpec, clusters: list[str], addrs: list[str]) -> None:
        """``client``: a Redis client of the deployment's server; ``admission``: the routers' ``Admission`` (its key
        layout and stats script); ``spec``: the sampled "short" class; ``addrs``: the routers to probe."""
        self.client, self.admission, self.spec, self.clusters, self.addrs = client, admission, spec, clusters, addrs
        self.samples: list[tuple[float, dict[str, Line]]] = []
        self.places: dict[str, tuple[str, float]] = {}  # ticket id -> (cluster, place), once seen
        self.lends: set[tuple[str, str]] = set()  # (ticket, borrower) pairs seen
        self.overrun: dict[str, list[float]] = {}  # ticket -> sampled moments its holder was back, borrower running
        self.probe_failures: list[str] = []
        self.sample_failures: list[str] = []
        self.probes = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._sample), threading.Thread(target=self._probe)]
        for t in self._threads:
            t.start()

    def _sample(self) -> None:
        adm = self.admission
        while not self._stop.wait(0.02):
            t = time.monotonic()  # the state is read during the call: stamp it with the call's midpoint, so a slow
            pipe = self.client.pipeline(transaction=True)  # Redis never makes a wait look longer than it was
            pipe.time()
            for c in self.clusters:
                k = adm.keys(c, "short")
                adm.stats_on(pipe, c, "short", self.spec)
                pipe.zrange(k["tix"], 0, -1, withscores=True)
                pipe.zrange(k["q"], 0, -1, withscores=True)
                pipe.zrange(k["lease"], 0, -1)
                pipe.hgetall(k["tixlent"])
                pipe.zrange(k["tixhere"], 0, -1, withscores=True)
            try:
                out = pipe.execute()
            except (redis.RedisError, OSError) as e:  # a missed sample, counted: the next one reads the state anew
                self.sample_failures.append(repr(e))
                continue
            mid = (t + time.monotonic()) / 2
            sec, usec = out[0]
            now_ms = sec * 1000 + usec // 1000
            loads = {}
            for j, c in enumerate(self.clusters):
                (tokens, count, *_), tix, q, lease, lent, here = out[1 + 6 * j: 7 + 6 * j]
                tix, lease = dict(tix), set(lease)  # (the client decodes responses: str)
                live = {tid: b for tid, b in lent.items() if b in lease and tid in tix}
                back = {tid for tid, until in here if until > now_ms}
                loads[c] = Line(int(count), int(tokens), tix, [p for _, p in q], live, back)
                for tid, place in tix.items():
                    self.places.setdefault(tid, (c, place))
                for tid, b in live.items():
                    self.lends.add((tid, b))
                    if tid in back:  # its holder is back while its borrower still runs: the borrower overran
                        self.overrun.setdefault(tid, []).append(mid)
            self.samples.append((mid, loads))

    def _probe(self) -> None:
        channels = [grpc.insecure_channel(a) for a in self.addrs]
        while not self._stop.wait(0.2):
            for ch in channels:
                self.probes += 1
                try:
                    h = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
                    if h.status != health_pb2.HealthCheckResponse.SERVING:
                        self.probe_failures.append(f"health {h.status}")
                    router_pb2_grpc.RouterStub(ch).ClusterStatus(pb.ClusterStatusRequest(), timeout=2)
                except grpc.RpcError as e:
                    self.probe_failures.append(repr(e))

    def free_at(self, ticket_id: str, since: float) -> float | None:
        """The first sampled moment after ``since`` at which the ticket's place is free, or it is no longer held
        (its holder got in); None if never seen."""
        if ticket_id not in self.places:
            return None
        cluster = self.places[ticket_id][0]
        for t, loads in self.samples:
            line = loads[cluster]
            if t >= since and (ticket_id not in line.tix or line.free(ticket_id, self.spec.max_concurrent)):
                return t
        return None

    def admitted_at(self, ticket_id: str, since: float) -> float | None:
        """The first sampled moment after ``since`` at which the ticket is no longer held (its holder got in)."""
        cluster = self.places[ticket_id][0]
        return next((t for t, loads in self.samples if t >= since and ticket_id not in loads[cluster].tix), None)

    def claimed(self) -> int:
        """The most rooms claimed at once on one cluster: in flight + free held places whose room is not in flight
        already (lent to their own borrower). The line never promises more rooms than the budget has."""
        mc = self.spec.max_concurrent
        return max((line.count + sum(line.free(tid, mc) and tid not in line.lent for tid in line.tix)
                    for _, loads in self.samples for line in loads.values()), default=0)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(5)
