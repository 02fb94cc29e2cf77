"""Prometheus metrics of one router process (its own registry: no global state), served on port 0.

Counters and histograms are updated on the request path; per-class admission state (in-flight tokens and
requests, queue length) and pins come from the router's status cache (status_cache.py), never Redis per scrape.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence

import redis
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

log = logging.getLogger(__name__)

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 120, 300)


class Counters(Mapping[str, int]):
    """Named counters bumped by many gRPC handler threads: ``+=`` on a dict entry is a read-modify-write that
    loses updates under threads, so every bump takes a lock. Reads (as a Mapping) see a consistent snapshot."""

    def __init__(self, *names: str) -> None:
        self._lock = threading.Lock()
        self._c: dict[str, int] = dict.fromkeys(names, 0)

    def inc(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._c[name] = self._c.get(name, 0) + n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._c)

    def __getitem__(self, name: str) -> int:
        with self._lock:
            return self._c.get(name, 0)

    def __iter__(self) -> Iterator[str]:
        return iter(self.snapshot())

    def __len__(self) -> int:
        with self._lock:
            return len(self._c)


class _ClassCollector:
    def __init__(self, stats: Callable[[], dict[str, dict[str, int]]]) -> None:
        self._stats = stats

    def collect(self):
        tokens = GaugeMetricFamily("k3serve_class_inflight_tokens", "admitted prompt tokens in flight",
                                   labels=["cls"])
        reqs = GaugeMetricFamily("k3serve_class_inflight_requests", "admitted requests in flight", labels=["cls"])
        queued = GaugeMetricFamily("k3serve_class_queued_requests", "requests waiting in the class queue",
                                   labels=["cls"])
        try:
            stats = self._stats()
        except (redis.RedisError, OSError) as e:  # Redis down: scrape what we have
            log.warning("class stats unavailable for /metrics: %s: %s", type(e).__name__, e)
            stats = {}
        for cls, s in stats.items():
            tokens.add_metric([cls], s["inflight_tokens"])
            reqs.add_metric([cls], s["inflight_requests"])
            queued.add_metric([cls], s["queued"])
        yield from (tokens, reqs, queued)


class _ClusterCollector:
    """Per-cluster gauges from the router's status view (heartbeat load + pins), read at scrape time."""

    def __init__(self, infos: Callable[[], Sequence]) -> None:
        self._infos = infos

    def collect(self):
        running = GaugeMetricFamily("k3serve_cluster_running_requests", "requests in flight on the cluster",
                                    labels=["cluster"])
        tokens = GaugeMetricFamily("k3serve_cluster_inflight_tokens", "prompt + streamed tokens in flight",
                                   labels=["cluster"])
        pinned = GaugeMetricFamily("k3serve_cluster_pinned_sessions", "sessions pinned to the cluster",
                                   labels=["cluster"])
        used = GaugeMetricFamily("k3serve_cluster_pool_used", "pool occupancy (cluster/pools.py)",
                                 labels=["cluster", "pool"])
        cap = GaugeMetricFamily("k3serve_cluster_pool_capacity", "pool capacity (0: none)", labels=["cluster", "pool"])
        accept = GaugeMetricFamily("k3serve_cluster_spec_acceptance_rate",
                                   "speculative decoding: drafts accepted / drafts verified since the cluster started",
                                   labels=["cluster"])
        for c in self._infos():
            running.add_metric([c.cluster_id], c.running_requests)
            tokens.add_metric([c.cluster_id], c.inflight_tokens)
            pinned.add_metric([c.cluster_id], c.pinned_sessions)
            for p in c.pools:
                used.add_metric([c.cluster_id, p.name], p.used)
                cap.add_metric([c.cluster_id, p.name], p.capacity)
                if p.name == "decode.spec_accepted" and p.capacity:
                    accept.add_metric([c.cluster_id], p.used / p.capacity)
        yield from (running, tokens, pinned, used, cap, accept)


class RouterMetrics:
    def __init__(self, class_stats: Callable[[], dict[str, dict[str, int]]] | None = None,
                 cluster_infos: Callable[[], Sequence] | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("k3serve_requests", "requests by outcome", ["outcome"], registry=r)
        self.failovers = Counter("k3serve_failovers", "resubmissions to another cluster", registry=r)
        self.rejections = Counter("k3serve_admission_rejections", "RESOURCE_EXHAUSTED by class", ["cls"], registry=r)
        self.admission_wait = Histogram("k3serve_admission_wait_seconds", "time to a reservation", ["cls"],
                                        buckets=TTFT_BUCKETS, registry=r)
        self.ttft = Histogram("k3serve_ttft_seconds", "request arrival to first token", buckets=TTFT_BUCKETS,
                              registry=r)
        # conventional serving metrics (the names vLLM and SGLang export, under k3serve_), both doors alike
        self.time_to_first_token = Histogram("k3serve_time_to_first_token_seconds", "arrival to first token",
                                             buckets=TTFT_BUCKETS, registry=r)
        self.inter_token_latency = Histogram("k3serve_inter_token_latency_seconds", "time between output tokens",
                                             buckets=ITL_BUCKETS, registry=r)
        self.e2e_latency = Histogram("k3serve_e2e_request_latency_seconds", "arrival to last token of finished "
                                     "requests", buckets=E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("k3serve_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.cached_prompt_tokens = Counter("k3serve_cached_prompt_tokens", "prompt tokens served from the "
                                            "prefix cache", registry=r)
        self.generation_tokens = Counter("k3serve_generation_tokens", "tokens streamed to clients", registry=r)
        self.finished = Counter("k3serve_request_finished", "requests by finish reason (stop, length; abort: "
                                "the client left; error)", ["finished_reason"], registry=r)
        self.refusals = Counter("k3serve_refusals", "requests refused with a retry hint, by who refused "
                                "(router: stream slots; admission: a class budget)", ["by"], registry=r)
        if class_stats is not None:
            r.register(_ClassCollector(class_stats))
        if cluster_infos is not None:
            r.register(_ClusterCollector(cluster_infos))
        self._server = None

    def serve(self, host: str = "127.0.0.1") -> str:
        """Start the /metrics endpoint on a free port; returns "host:port"."""
        self._server, _ = start_http_server(0, addr=host, registry=self.registry)
        return f"{host}:{self._server.server_port}"

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
