"""The router process of a deployment: RouterService (public gRPC, port 0) over Redis membership, pins and
admission (router/server.py), as a Ray actor.

Its own module so that a router process imports no torch (nor the rank and engine code that needs it): routers
validate requests against the model's config only, and a deployment starts two of them (~3 s of CPU each saved
on a 2-core machine). tests/test_layering.py pins it.
"""

from __future__ import annotations

from collections.abc import Sequence

import ray

from k3serve.cluster.deploy import DeployConfig, RequestClassSpec
from k3serve.cluster.placement import ACTOR_CPU
from k3serve.router.admission import ClassSpec


def router_max_streams(d: DeployConfig) -> int:
    """Streams one router serves at once: the deploy file's, else what admission can hold (every class's
    concurrency and queue on every cluster), at most 256 (one gRPC thread each)."""
    if d.control.router_max_streams:
        return d.control.router_max_streams
    per_cluster = sum(c.max_concurrent + c.queue_limit for c in d.request_classes)
    return min(256, per_cluster * len(d.clusters.cluster_ids))


def admission_classes(classes: Sequence[RequestClassSpec]) -> list[ClassSpec]:
    """A deploy file's request classes as the router's admission takes them."""
    return [ClassSpec(c.name, c.max_uncached_tokens, c.inflight_token_budget, c.max_concurrent, c.queue_limit,
                      c.max_wait_s) for c in classes]


def served_model_name(d: DeployConfig) -> str:
    """The model id the HTTP door serves: the deploy file's, else the checkpoint directory's or preset's name."""
    from pathlib import Path

    return d.served_model_name or (Path(d.model.checkpoint).name if d.model.checkpoint else d.model.preset)


@ray.remote(num_cpus=ACTOR_CPU, max_restarts=0, max_concurrency=4)
class RouterActor:
    def __init__(self, deploy: DeployConfig, checkpoint: str, redis_url: str, index: int = 0) -> None:
        self.deploy, self.checkpoint, self.redis_url, self.index = deploy, checkpoint, redis_url, index
        self.server = self.http = None

    def start(self) -> str:
        from k3serve.cluster.redis_server import connect
        from k3serve.model.config_file import load_config
        from k3serve.router.membership import CircuitBreaker, BreakerConfig, Membership, MembershipView
        from k3serve.router.pins import PinStore
        from k3serve.router.server import RouterService, start_router_server
        from k3serve.router.validate import ModelLimits
        from k3serve.tokenizer import BYTE_VOCAB_SIZE

        d, ctl = self.deploy, self.deploy.control
        cfg = load_config(self.checkpoint)
        client = connect(self.redis_url)
        view = MembershipView(Membership(client, ctl.namespace, d.secret), refresh_interval_s=0.2,
                              breaker=CircuitBreaker(BreakerConfig(cool_down_s=ctl.suspect_cooldown_s)))
        limits = ModelLimits(cfg.vocab_size, cfg.max_position_embeddings, cfg.vocab_size == BYTE_VOCAB_SIZE)
        from k3serve.router.gate import AdmissionGate

        gate = AdmissionGate(client, ctl.namespace, admission_classes(d.request_classes), enabled=d.admission,
                             policy=d.clusters.prefix_policy(), context_ttl_s=ctl.pin_ttl_s)
        from k3serve.router.metrics import RouterMetrics

        # the service is built after its metrics: the gauges read its status cache at scrape time (no Redis read)
        metrics = RouterMetrics(lambda: self.service.status.classes(),
                                cluster_infos=lambda: self.service.cluster_infos())
        self.metrics_address = metrics.serve(d.internal_bind)  # for the operator's scraper, not for clients
        from k3serve.router.key_quota import QuotaLimits

        streams = router_max_streams(d)
        from k3serve.engine.block_hash import model_fingerprint, prefix_key
        from k3serve.router.anonymous import AnonymousPlacer
        from k3serve.router.prefix_map import PrefixMap

        # the clusters' block-hash key (cluster/actors.py builds the engines with the same call)
        placer = AnonymousPlacer(PrefixMap(client, ctl.namespace), prefix_key(model_fingerprint(cfg.to_hf_dict()), d.secret),
                                 d.clusters.prefix_policy().block_size, ctl.anonymous_routing)
        self.service = RouterService(view, PinStore(client, ctl.namespace, ctl.pin_ttl_s), limits, d.secret,
                                     d.api_keys, gate=gate, metrics=metrics, stall_timeout_s=ctl.stall_timeout_s,
                                     max_streams=streams, quota=QuotaLimits.resolve(
                                         d.key_max_streams, d.key_max_queued, streams, len(d.api_keys), d.routers),
                                     placer=placer, tls=d.tls)
        self.server, addr = start_router_server(self.service, d.bind_host)
        from k3serve.router.chat_template import ChatTemplate, load_chat_template
        from k3serve.router.http_server import HttpDoor

        template = ChatTemplate(load_chat_template(self.checkpoint)) if limits.byte_tokenizer else None
        self.http = HttpDoor(self.service, served_model_name(d), template)
        self.http_address = self.http.start(d.bind_host, d.http_port + self.index if d.http_port else 0)
        return addr

    def http_endpoint(self) -> str:
        """The OpenAI-compatible HTTP door's "host:port" (router/http_server.py)."""
        return self.http_address

    def pid(self) -> int:
        import os

        return os.getpid()

    def metrics_endpoint(self) -> str:
        return f"http://{self.metrics_address}/metrics"

    def counters(self) -> dict:
        gate = self.service.gate
        return {**self.service.counters, **{f"admission.{k}": v for k, v in gate.counters.items()}}

    def learned_durations(self, cls: str) -> tuple[float, float]:
        """(TTFT, time per output token) the retry hints of class ``cls`` are paced by (router/progress.py)."""
        d = self.service.durations
        return d.ttft_s(cls), d.tpot_s()

    def set_admission(self, enabled: bool) -> None:
        """Switch the budget gate on or off at run time (the admission bench compares both)."""
        self.service.gate.enabled = enabled

    def class_stats(self, clusters: list[str]) -> dict:
        return self.service.gate.class_stats(clusters)

    def drain(self, timeout_s: float) -> int:
        """Refuse new requests (health NOT_SERVING, UNAVAILABLE) and wait up to timeout_s for in-flight streams;
        returns how many were still in flight at the end."""
        return self.service.drain(timeout_s) if self.server is not None else 0

    def inflight(self) -> int:
        return self.service.inflight if self.server is not None else 0

    def stop(self, grace_s: float = 2.0) -> None:
        if self.http is not None:
            self.http.stop(grace_s)
        if self.server is not None:
            self.server.stop(grace_s).wait()
            self.service.close()
