"""Prometheus metrics of one router process (its own registry: no global state), served on port 0.

Counters and histograms are updated on the request path; per-class admission state (in-flight tokens and
requests, queue length) is read from Redis when Prometheus scrapes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)


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
        except Exception:  # noqa: BLE001 - Redis down: scrape what we have
            stats = {}
        for cls, s in stats.items():
            tokens.add_metric([cls], s["inflight_tokens"])
            reqs.add_metric([cls], s["inflight_requests"])
            queued.add_metric([cls], s["queued"])
        yield from (tokens, reqs, queued)


class RouterMetrics:
    def __init__(self, class_stats: Callable[[], dict[str, dict[str, int]]] | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("k3serve_requests", "requests by outcome", ["outcome"], registry=r)
        self.failovers = Counter("k3serve_failovers", "resubmissions to another cluster", registry=r)
        self.rejections = Counter("k3serve_admission_rejections", "RESOURCE_EXHAUSTED by class", ["cls"], registry=r)
        self.admission_wait = Histogram("k3serve_admission_wait_seconds", "time to a reservation", ["cls"],
                                        buckets=TTFT_BUCKETS, registry=r)
        self.ttft = Histogram("k3serve_ttft_seconds", "request arrival to first token", buckets=TTFT_BUCKETS,
                              registry=r)
        if class_stats is not None:
            r.register(_ClassCollector(class_stats))
        self._server = None

    def serve(self, host: str = "127.0.0.1") -> str:
        """Start the /metrics endpoint on a free port; returns "host:port"."""
        self._server, _ = start_http_server(0, addr=host, registry=self.registry)
        return f"{host}:{self._server.server_port}"

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()


def class_stats_source(gate, clusters: Callable[[], Sequence[str]]) -> Callable[[], dict]:
    return lambda: gate.class_stats(list(clusters()))
