"""The deployment file (``deploy.yaml``): clusters, their TP degrees and pools, routers, the control plane.

Every section is a frozen dataclass; unknown keys are an error naming the key, so a typo never silently falls
back to a default. Example (the embedded default, `configs/local.yaml`)::

    model: {preset: tiny}             # or {checkpoint: /path/to/ckpt}
    clusters:
      count: 3
      prefill_tp: 2
      decode_tp: 1
      speculative: {method: ngram, num_draft_tokens: 3, classes: [short]}   # optional; default off
    routers: 1

Node placement (which Ray node runs each cluster's front, prefill and decode group, and a per-cluster
transfer plane): ``clusters.placement`` and ``router_resources``, see cluster/placement.py.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from k3serve.cluster.placement import NO_PLACEMENT, PlacementSpec, Resources, parse_resources
from k3serve.contracts.numerics import DEFAULT_NUMERICS, Numerics, NumericsError
from k3serve.router.api_keys import ApiKeyError, check_api_keys
from k3serve.tls import TlsMaterial, generate as generate_tls


TRANSFER_PLANES = ("grpc", "mooncake", "object_store")


class DeployError(ValueError):
    """A deployment file k3serve cannot run; the message names the field."""


@dataclass(frozen=True)
class ModelSpec:
    preset: str = "tiny"
    checkpoint: str = ""  # a checkpoint dir; empty: make one from `preset` at start-up
    seed: int = 0


@dataclass(frozen=True)
class PoolSpec:
    """Pool capacity per rank: counts, or byte budgets (``kda_bytes`` / ``mla_bytes`` win when set)."""

    kda_slots: int = 64
    mla_pages: int = 2048
    page_size: int = 64
    kda_bytes: int = 0
    mla_bytes: int = 0

    def pool_config(self, cfg, tp: int):
        from k3serve.engine.ops import PoolConfig

        if self.kda_bytes or self.mla_bytes:
            if not (self.kda_bytes and self.mla_bytes):
                raise DeployError("pools: give both kda_bytes and mla_bytes, or neither")
            return PoolConfig.from_bytes(cfg, tp, self.kda_bytes, self.mla_bytes, self.page_size)
        return PoolConfig(self.kda_slots, self.mla_pages, self.page_size)


@dataclass(frozen=True)
class SpeculativeSpec:
    """``clusters.speculative``: speculative decoding on every cluster's decode group (docs/speculative.md).

    method: "" (off) | "ngram" | "eagle3"; num_draft_tokens: k; classes: names of the request classes that
    speculate (empty: all), decided by a request's uncached prompt tokens as admission classes it;
    drafter: the drafter checkpoint (eagle3); ngram_min / ngram_max: the n-gram drafter's match lengths.
    """

    method: str = ""
    num_draft_tokens: int = 3
    classes: tuple[str, ...] = ()
    drafter: str = ""
    ngram_min: int = 2
    ngram_max: int = 5

    def spec_config(self, request_classes: tuple["RequestClassSpec", ...]):
        """The decode engine's SpecConfig, or None when off; raises DeployError naming the bad field."""
        if not self.method:
            return None
        from k3serve.engine.spec.config import SpecConfig
        from k3serve.engine.spec.ngram import NgramConfig

        names = [rc.name for rc in request_classes]
        unknown = [c for c in self.classes if c not in names]
        if unknown:
            raise DeployError(f"clusters.speculative.classes names unknown request classes {unknown} "
                              f"(known: {', '.join(names)})")
        classes = tuple((rc.max_uncached_tokens, rc.name in self.classes) for rc in request_classes) \
            if self.classes else ()
        try:
            return SpecConfig(self.method, self.num_draft_tokens, classes, self.drafter,
                              NgramConfig(self.ngram_min, self.ngram_max))
        except ValueError as e:
            msg = str(e).replace("speculative.", "clusters.speculative.").replace("ngram drafter:",
                                                                                  "clusters.speculative:")
            raise DeployError(msg) from None


@dataclass(frozen=True)
class MooncakeSpec:
    """`clusters.mooncake` (used with `transfer: mooncake`; k3serve/transfer/mooncake/plane.py)."""

    protocol: str = "tcp"  # "rdma" where NICs exist
    metadata: str = "P2PHANDSHAKE"  # or the deployment's "redis://host:port"
    device: str = ""  # RDMA device filter ("" = auto)
    host: str = ""  # the address peers reach a rank's engine at ("": the bind host, else this node's address)
    staging_mib: int = 512  # registered staging region per decode rank
    send_mib: int = 256  # registered send region per prefill rank
    listen_any: bool = False  # the engine's listeners on every interface, firewalled by the operator; else its host

    def config(self):
        from k3serve.transfer.mooncake.plane import MooncakeConfig

        try:
            return MooncakeConfig(self.protocol, self.metadata, self.device, self.host, self.staging_mib << 20,
                                  self.send_mib << 20, listen_any=self.listen_any)
        except ValueError as e:
            raise DeployError(f"clusters.{e}") from None


@dataclass(frozen=True)
class ClusterSpec:
    count: int = 3
    prefill_tp: int = 2
    decode_tp: int = 1
    prefill_pools: PoolSpec = field(default_factory=PoolSpec)
    decode_pools: PoolSpec = field(default_factory=PoolSpec)
    max_decode_batch: int = 64
    step_token_budget: int = 2048
    long_step_tokens: int = 0  # most long-prompt tokens per prefill step (0: step_token_budget); chunk_plan.py
    prefix_scheme: str = "k3"
    checkpoint_every_blocks: int = 8  # k3: a KDA checkpoint every this many 512-token blocks, besides turn ends
    max_checkpoints_per_session: int = 4  # k3: the deepest this many of a prompt's checkpoints (fairness guard)
    transfer: str = "grpc"  # "grpc": k3serve.transfer between the groups; "mooncake": the same control over gRPC,
    # payload by the Mooncake Transfer Engine (pip install 'k3serve[mooncake]'); "object_store": tensors via Ray
    mooncake: MooncakeSpec = field(default_factory=lambda: MooncakeSpec())
    layerwise_export: bool = False  # grpc, mooncake planes: a prompt's last chunk streams each layer as it is computed
    rebuild: bool = True  # a cluster whose rank died is torn down and built again in place
    rebuild_backoff_s: float = 1.0  # first wait before a rebuild; doubles after a failed attempt (max 30 s)
    ids: tuple[str, ...] = ()  # explicit cluster ids; default c0, c1, ...
    speculative: SpeculativeSpec = field(default_factory=SpeculativeSpec)
    placement: tuple[PlacementSpec, ...] = ()  # node placement per cluster (cluster/placement.py)

    @property
    def cluster_ids(self) -> tuple[str, ...]:
        return self.ids or tuple(f"c{i}" for i in range(self.count))

    def placement_of(self, cluster_id: str) -> PlacementSpec:
        """The placement entry naming this cluster (NO_PLACEMENT when none does)."""
        return next((p for p in self.placement if cluster_id in p.clusters), NO_PLACEMENT)

    def prefix_policy(self):
        """The prefix-cache policy every cluster's prefill engine runs, and that routers estimate hits with: one
        object, so the router's block size and scheme can never disagree with the engine's."""
        from k3serve.contracts.prefix_policy import PrefixCachePolicy

        try:
            return PrefixCachePolicy(scheme=self.prefix_scheme, page_size=self.prefill_pools.page_size,
                                     checkpoint_every_blocks=self.checkpoint_every_blocks,
                                     max_checkpoints_per_session=self.max_checkpoints_per_session)
        except ValueError as e:  # the policy names its own fields; say the deploy file's keys
            msg = str(e)
            for field_, key in (("scheme", "prefix_scheme"), ("page_size", "prefill_pools.page_size")):
                msg = msg.replace(f"prefix_cache.{field_}", f"clusters.{key}")
            raise DeployError(msg.replace("prefix_cache.", "clusters.")) from None


@dataclass(frozen=True)
class RequestClassSpec:
    name: str
    max_uncached_tokens: int  # requests with more uncached prompt tokens fall in the next class
    inflight_token_budget: int
    max_concurrent: int
    queue_limit: int = 64
    max_wait_s: float = 10.0


@dataclass(frozen=True)
class ControlSpec:
    redis_url: str = field(default="", repr=False)  # empty: REDIS_URL, else a private redis-server; may hold a password
    namespace: str = "k3serve"
    heartbeat_ttl_s: float = 3.0
    heartbeat_interval_s: float = 0.5
    pin_ttl_s: float = 3600.0
    suspect_cooldown_s: float = 5.0
    stall_timeout_s: float = 30.0  # a router fails a call over after this long without a token (once tokens flow)
    router_max_streams: int = 0  # concurrent streams per router (0: what admission can hold, at most 256)
    # requests without a session id: "prefix-load" (least expected TTFT, docs/traffic.md), "first-block" (the old
    # rendezvous on the first block, a baseline) or "random"
    anonymous_routing: str = "prefix-load"

    def __post_init__(self) -> None:
        from k3serve.router.placement import POLICIES

        if self.anonymous_routing not in POLICIES:
            raise DeployError(f"control.anonymous_routing must be one of {POLICIES}, got {self.anonymous_routing!r}")


@dataclass(frozen=True)
class DeployConfig:
    model: ModelSpec = field(default_factory=ModelSpec)
    clusters: ClusterSpec = field(default_factory=ClusterSpec)
    routers: int = 1
    bind_host: str = "127.0.0.1"  # the public router's host (gRPC clients connect here)
    # internal sockets (cluster fronts, transfer receivers and engines, router metrics): "" = bind_host
    internal_host: str = ""
    secret: str = field(default="", repr=False)  # cluster secret for internal endpoints; "": generated per deployment
    # mutual TLS on the internal gRPC channels (router -> fronts, prefill -> decode receivers) under a private CA
    # made per deployment (k3serve/tls.py); None: on when the internal host is not loopback
    internal_tls: bool | None = None
    tls: TlsMaterial | None = field(default=None, repr=False)  # made by with_secret(), never read from a file
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # bearer tokens of the public API; none: anonymous
    allow_anonymous: bool = False  # serve without api_keys on a non-loopback bind_host (refused otherwise)
    # per API key across every router (leases in Redis): streams at once (0: with 2+ keys, half of all routers'
    # streams; with fewer keys, no limit) / requests inside admission (0: no limit); router/key_quota.py
    key_max_streams: int = 0
    key_max_queued: int = 0
    control: ControlSpec = field(default_factory=ControlSpec)
    request_classes: tuple[RequestClassSpec, ...] = (
        RequestClassSpec("short", 4096, inflight_token_budget=32768, max_concurrent=32),
        RequestClassSpec("long", 1 << 30, inflight_token_budget=65536, max_concurrent=4, queue_limit=16,
                         max_wait_s=30.0),
    )
    admission: bool = True  # per-class budgets in the routers (off: every request goes straight through)
    torch_threads: int = 1
    # on SIGTERM/SIGINT routers stop taking requests and in-flight streams get this long to finish
    drain_timeout_s: float = 60.0
    # "default" | "deterministic" (docs/numerics.md): the deploy file's one numerics switch, parsed to a
    # frozen contracts.numerics.Numerics that every cluster passes to its workers, prefill engine and front
    numerics: Numerics = DEFAULT_NUMERICS
    router_resources: Resources = ()  # Ray custom resources each router needs (cluster/placement.py)
    # the routers' OpenAI-compatible HTTP door (docs/http.md): router i listens on http_port + i (0: a free port)
    http_port: int = 0
    served_model_name: str = ""  # the model id of /v1/models; empty: the checkpoint directory's or preset's name

    def for_cluster(self, cluster_id: str) -> "DeployConfig":
        """What one cluster runs with: its placement entry's `transfer` (if any) in place of clusters.transfer."""
        plane = self.clusters.placement_of(cluster_id).transfer
        if not plane or plane == self.clusters.transfer:
            return self
        return dataclasses.replace(self, clusters=dataclasses.replace(self.clusters, transfer=plane))

    @property
    def internal_bind(self) -> str:
        """The host internal sockets bind."""
        return self.internal_host or self.bind_host

    @property
    def tls_on(self) -> bool:
        """Whether the internal channels use mutual TLS (``internal_tls``; unset: off loopback only)."""
        return self.internal_tls if self.internal_tls is not None else not is_loopback(self.internal_bind)

    def with_secret(self) -> "DeployConfig":
        """This config with its deployment credentials: the secret (generated unless given) and, with internal
        TLS on, a fresh CA and certificate (k3serve/tls.py)."""
        d = self if self.secret else dataclasses.replace(self, secret=secrets.token_hex(16))
        return dataclasses.replace(d, tls=generate_tls()) if d.tls_on and d.tls is None else d

    def validate(self) -> None:
        c = self.clusters
        if c.count < 1 and not c.ids:
            raise DeployError("clusters.count must be >= 1")
        if c.prefill_tp < 1 or c.decode_tp < 1:
            raise DeployError("clusters.prefill_tp and clusters.decode_tp must be >= 1")
        if self.routers < 1:
            raise DeployError("routers must be >= 1")
        if c.prefill_pools.page_size != c.decode_pools.page_size:
            raise DeployError("prefill_pools.page_size must equal decode_pools.page_size")
        try:
            check_api_keys(self.api_keys)
        except ApiKeyError as e:
            raise DeployError(str(e)) from None
        if not self.api_keys and not self.allow_anonymous and not is_loopback(self.bind_host):
            raise DeployError(f"bind_host {self.bind_host!r} is reachable from the network and api_keys is empty: "
                              f"set api_keys, or allow_anonymous: true to serve anyone who can reach it")
        if self.key_max_streams < 0 or self.key_max_queued < 0:
            raise DeployError("key_max_streams and key_max_queued must be >= 0 (0: the default)")
        if self.internal_tls not in (None, True, False):
            raise DeployError(f"internal_tls must be true or false (unset: on off loopback), got {self.internal_tls!r}")
        if self.secret and len(self.secret) < 16:
            raise DeployError("secret must be at least 16 characters (it keys the HMAC of every internal call)")
        if c.rebuild_backoff_s <= 0:
            raise DeployError("clusters.rebuild_backoff_s must be > 0")
        if c.step_token_budget < 1 or c.long_step_tokens < 0:
            raise DeployError("clusters.step_token_budget must be >= 1 and clusters.long_step_tokens >= 0")
        if c.transfer not in TRANSFER_PLANES:
            raise DeployError(f"clusters.transfer must be one of {', '.join(TRANSFER_PLANES)}, got {c.transfer!r}")
        c.mooncake.config()  # raises DeployError naming the field
        c.prefix_policy()  # raises DeployError naming the field
        if not isinstance(c.mooncake.listen_any, bool):
            raise DeployError(f"clusters.mooncake.listen_any must be true or false, got {c.mooncake.listen_any!r}")
        seen: set[str] = set()
        for i, p in enumerate(c.placement):
            where = f"clusters.placement[{i}]"
            if not p.clusters:
                raise DeployError(f"{where}.clusters must name at least one cluster")
            unknown = [x for x in p.clusters if x not in c.cluster_ids]
            if unknown:
                raise DeployError(f"{where}.clusters names unknown clusters {unknown} (known: {list(c.cluster_ids)})")
            twice = seen.intersection(p.clusters)
            if twice:
                raise DeployError(f"{where}.clusters: {sorted(twice)} already placed by an earlier entry")
            seen.update(p.clusters)
            if p.transfer and p.transfer not in TRANSFER_PLANES:
                raise DeployError(f"{where}.transfer must be one of {', '.join(TRANSFER_PLANES)}, got {p.transfer!r}")
        if not self.request_classes:
            raise DeployError("request_classes must not be empty")
        if not 0 <= self.http_port <= 65535 - self.routers + 1:
            raise DeployError(f"http_port must be 0 or a port with room for {self.routers} routers, got {self.http_port}")
        if not self.drain_timeout_s > 0:
            raise DeployError(f"drain_timeout_s must be > 0, got {self.drain_timeout_s}")
        names = [rc.name for rc in self.request_classes]
        if len(set(names)) != len(names):
            raise DeployError("request_classes names must be unique")
        c.speculative.spec_config(self.request_classes)  # raises DeployError naming the field


def is_loopback(host: str) -> bool:
    """True when only this machine can reach ``host`` (a loopback address or ``localhost``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a name other than localhost, or a wildcard: reachable from the network
        return False


def _build(cls: type, raw: Any, where: str) -> Any:
    if raw is None:
        return cls()
    if not isinstance(raw, dict):
        raise DeployError(f"{where} must be a mapping")
    fields = {f.name: f for f in dataclasses.fields(cls) if not (cls is DeployConfig and f.name == "tls")}
    kwargs = {}
    for key, value in raw.items():
        if key not in fields:  # (DeployConfig.tls is made by with_secret, never read from a file)
            raise DeployError(f"unknown key {where}.{key} (known: {', '.join(sorted(fields))})")
        nested = {"model": ModelSpec, "clusters": ClusterSpec, "control": ControlSpec,
                  "prefill_pools": PoolSpec, "decode_pools": PoolSpec, "speculative": SpeculativeSpec,
                  "mooncake": MooncakeSpec}.get(key) if cls is not PlacementSpec else None
        if nested is not None:
            value = _build(nested, value, f"{where}.{key}")
        elif key == "placement":
            if not isinstance(value, list):
                raise DeployError(f"{where}.placement must be a list of entries")
            value = tuple(_build(PlacementSpec, v, f"{where}.placement[{i}]") for i, v in enumerate(value))
        elif key in ("front", "prefill", "decode", "router_resources"):
            try:
                value = parse_resources(value, f"{where}.{key}")
            except ValueError as e:
                raise DeployError(str(e)) from None
        elif key == "request_classes":
            value = tuple(_build(RequestClassSpec, v, f"{where}.request_classes[{i}]") for i, v in enumerate(value))
        elif key == "api_keys":
            try:
                value = check_api_keys(value, f"{where}.api_keys")
            except ApiKeyError as e:
                raise DeployError(str(e)) from None
        elif key in ("ids", "classes") or (cls is PlacementSpec and key == "clusters"):
            value = tuple(str(v) for v in value)
        elif key == "numerics":
            try:
                value = Numerics.parse(value)
            except NumericsError as e:
                raise DeployError(f"{where}.{e}") from None
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise DeployError(f"{where}: {e}") from None


def load_deploy(path: str | Path | None) -> DeployConfig:
    """Parse a deploy.yaml (None: the embedded defaults)."""
    if path is None:
        cfg = DeployConfig()
    else:
        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
        except FileNotFoundError:
            raise DeployError(f"no deployment file at {path}") from None
        except yaml.YAMLError as e:
            raise DeployError(f"{path} is not valid YAML: {e}") from None
        cfg = _build(DeployConfig, raw, "deploy")
    cfg.validate()
    return cfg
