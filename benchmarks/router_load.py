"""``k3serve bench router-load``: two router replicas under a burst of concurrent streams at a service sized for
far fewer, and the harness the router's live load test shares.

Every client follows the retry-after hint of each RESOURCE_EXHAUSTED until it completes. A monitor samples every
(cluster, "short") budget from Redis every 20 ms (in flight, queue) and probes both routers' health and
``ClusterStatus`` every 0.2 s. From the samples each hint is compared with the moment its budget next had a room
for a newcomer (a room free and nobody waiting)::

    refusal at t_err, hint h                      room at t_free (first sample with one)
    |-------------- h --------------|             ratio = max(h, floor) / max(t_free - t_err, floor)
    |------------- measured wait -------------|   within 2x: 0.5 <= ratio <= 2

What is behaviour (``tests/cluster/test_router_live.py`` asserts it): every stream completes, in-flight requests
and tokens never exceed the budget, health and status answer throughout. What is timing
(this bench reports it, the test only prints it): the hint/wait ratios, the budgets' busy fraction, how late the
clients themselves came back. Those are figures of the host: on a shared 2-core machine the load generator, the
routers and the service compete for the same cores, and one host measured 63% of hints within 2x where another
measured 99%.

A warm-up burst (``warmup_streams``) first lets the routers learn the durations of the service as loaded by this
harness: learned at low load, the durations are half of what the burst sees and every first hint is early by 2x.

Two ways to run the routers:

* ``run_load`` (the test): two ``RouterService`` objects started in this process over a fresh admission
  namespace. They share this process's GIL with the 200 client threads and the monitor, so their timing is the
  harness's more than the router's (seen: the learned time per token 3x that of router processes).
* ``run_router_load_bench`` (the bench): the deployment's own two router processes (``RouterActor``) configured
  by ``load_deploy_config``; only the clients and the monitor run here. This is what a deployment's clients see.
"""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Callable

import grpc

from benchmarks.router_load_monitor import Monitor
from k3serve.router.admission import ClassSpec
from k3serve.v1 import router_pb2 as pb
from k3serve.v1 import router_pb2_grpc

TOKEN_BUDGET = 1 << 20  # the short class's in-flight token budget: never the limit here, the request count is


@dataclass(frozen=True)
class LoadSetup:
    """One burst. Per cluster the service admits ``max_concurrent`` short requests and queues ``queue``; each
    router serves at most ``router_streams`` streams at once (so both refusals happen: the router's stream limit
    and the admission budget)."""

    streams: int = 200
    warmup_streams: int = 60
    max_tokens: int = 8
    max_concurrent: int = 2
    queue: int = 2
    router_streams: int = 8
    onset_s: float = 4.0  # hints handed out this long after the burst began are also counted apart
    floor_s: float = 0.1  # waits and hints below this compare as this (sampling granularity, minimum hint)
    max_attempts: int = 40  # per client


@dataclass(frozen=True)
class Refusal:
    """One RESOURCE_EXHAUSTED a client got: when (monotonic), the hint, who refused, the message."""

    at: float
    hint_s: float
    rejected_by: str
    details: str

    @property
    def cluster(self) -> str:
        """The cluster whose budget it would have joined ("" for a refusal by the router alone)."""
        return self.rejected_by.split(":", 1)[1].split("/")[0] if ":" in self.rejected_by else ""


@dataclass(frozen=True)
class StreamResult:
    """A client's final outcome ("ok" or the status code's name) and the refusals it followed before it."""

    status: str
    tokens: int
    finish_reason: str
    refusals: tuple[Refusal, ...]


@dataclass
class LoadOutcome:
    """What one burst did: the streams' outcomes and what the monitor and the routers saw (see ``figures``)."""

    setup: LoadSetup
    results: list[StreamResult]
    elapsed_s: float
    started: float  # monotonic time the burst began
    monitor: Monitor
    lateness_s: list[float]  # per retry: how long after its hinted moment the client sent it (its own delay)
    learned: dict = field(default_factory=dict)  # the routers' learned durations after the warm-up and the burst

    @property
    def refusals(self) -> list[Refusal]:
        return [x for r in self.results for x in r.refusals]

    def waits(self) -> list[tuple[Refusal, float | None]]:
        """Each refusal with a cluster and its measured wait (seconds until its budget had a room; None: never)."""
        out = []
        for x in self.refusals:
            if x.cluster:
                free = self.monitor.room_at(x.cluster, x.at)
                out.append((x, None if free is None else free - x.at))
        return out

    def refused_with_room(self) -> int:
        """Refusals whose budget's last sample before them showed a room for a newcomer (the sample is up to 20 ms
        old: a room taken since shows here too, so this bounds refusals of a budget with room from above)."""
        return sum(self.monitor.room_before(x.cluster, x.at) for x in self.refusals if x.cluster)

    def busy(self) -> float:
        """The budgets' busy fraction during the burst (sampled in flight / budget)."""
        during = [loads for t, loads in self.monitor.samples if self.started <= t <= self.started + self.elapsed_s]
        if not during:
            return 0.0
        return (sum(ln.count for loads in during for ln in loads.values())
                / (len(during) * len(self.monitor.clusters) * self.setup.max_concurrent))

    def max_in_flight(self) -> tuple[int, int]:
        """(requests, tokens): the most in flight at once on one cluster over every sample."""
        lines = [ln for _, loads in self.monitor.samples for ln in loads.values()]
        return max((ln.count for ln in lines), default=0), max((ln.tokens for ln in lines), default=0)

    def figures(self) -> dict:
        """The JSON report: behaviour counts and the timing figures."""
        return load_figures(self)


def start_router(deployment, ns: str, classes: list[ClassSpec], max_streams: int):
    """A router replica of ``deployment`` in this process (real RouterService and gRPC server) under admission
    namespace ``ns``: (service, server, address)."""
    from k3serve.cluster.redis_server import connect
    from k3serve.model.checkpoint import load_config
    from k3serve.router.gate import AdmissionGate
    from k3serve.router.membership import Membership, MembershipView
    from k3serve.router.pins import PinStore
    from k3serve.router.server import RouterService, start_router_server
    from k3serve.router.validate import ModelLimits
    from k3serve.tokenizer import BYTE_VOCAB_SIZE

    d = deployment.deploy
    cfg = load_config(deployment.checkpoint)
    client = connect(deployment.redis_url)
    view = MembershipView(Membership(client, d.control.namespace, d.secret), refresh_interval_s=0.2)
    gate = AdmissionGate(client, ns, classes, policy=d.clusters.prefix_policy())
    svc = RouterService(view, PinStore(client, ns), ModelLimits(cfg.vocab_size, cfg.max_position_embeddings,
                                                                cfg.vocab_size == BYTE_VOCAB_SIZE),
                        d.secret, gate=gate, max_streams=max_streams)
    server, addr = start_router_server(svc)
    return svc, server, addr


@dataclass(frozen=True)
class RouterTargets:
    """The two routers a burst runs against: their addresses and what they learned (the durations their hints
    are computed from)."""

    addresses: list[str]
    learned: Callable[[], str]


def _request_classes(setup: LoadSetup):
    """The burst's two classes as a deploy file states them: "short" sized by ``setup``, "long" for the rest."""
    from k3serve.cluster.deploy import RequestClassSpec

    return (RequestClassSpec("short", 4096, inflight_token_budget=TOKEN_BUDGET, max_concurrent=setup.max_concurrent,
                             queue_limit=setup.queue, max_wait_s=20.0),
            RequestClassSpec("long", 1 << 30, inflight_token_budget=1 << 30, max_concurrent=1, queue_limit=0,
                             max_wait_s=0.0))


def _classes(setup: LoadSetup) -> list[ClassSpec]:
    """The same classes as the router's admission takes them (RouterActor's own conversion)."""
    from k3serve.cluster.router_actor import admission_classes

    return admission_classes(_request_classes(setup))


def run_load(deployment, setup: LoadSetup = LoadSetup()) -> LoadOutcome:
    """Two router replicas of ``deployment`` started in this process (fresh admission namespace, ``setup``'s
    classes) under ``setup``'s warm-up and burst; the routers are stopped before it returns.
    In-process routers share this process (and its GIL) with the clients and the monitor: the behaviour is the
    deployment's, the timing is not (:func:`run_router_load_bench` measures against router processes)."""
    from k3serve.cluster.redis_server import connect

    ns = "load" + uuid.uuid4().hex[:8]
    routers = [start_router(deployment, ns, _classes(setup), setup.router_streams) for _ in range(2)]

    def learned() -> str:
        d = routers[0][0].durations
        return f"ttft {d.ttft_s('short'):.2f}s + tpot {d.tpot_s():.3f}s"

    try:
        targets = RouterTargets([addr for _, _, addr in routers], learned)
        return _burst(targets, routers[0][0].gate.admission, connect(deployment.redis_url, timeout_s=10.0),
                      sorted(deployment.cluster_endpoints), setup)
    finally:
        for svc, server, _ in routers:
            server.stop(0)
            svc.close()


def _burst(targets: RouterTargets, admission, client, clusters: list[str], setup: LoadSetup) -> LoadOutcome:
    """``setup``'s warm-up and burst against ``targets``, sampled by a :class:`Monitor` over ``client``."""
    stubs = [router_pb2_grpc.RouterStub(grpc.insecure_channel(addr)) for addr in targets.addresses]
    lateness: list[float] = []
    sp = pb.SamplingParams(max_tokens=setup.max_tokens, ignore_eos=True)

    def one(i: int, phase: str) -> StreamResult:
        refusals: list[Refusal] = []
        for _ in range(setup.max_attempts):
            req = pb.GenerateRequest(session_id=f"{phase}-{i}", prompt_text=f"load {phase} {i}", sampling=sp)
            try:
                msgs = list(stubs[i % len(stubs)].Generate(req, timeout=90))
                return StreamResult("ok", sum(len(m.token_ids) for m in msgs), msgs[-1].finish_reason,
                                    tuple(refusals))
            except grpc.RpcError as e:
                at = time.monotonic()
                if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    return StreamResult(e.code().name, 0, e.details() or "", tuple(refusals))
                md = dict(e.trailing_metadata() or ())
                hint = float(md.get("retry-after-s", "nan"))
                refusals.append(Refusal(at, hint, md.get("k3serve-rejected-by", ""), e.details() or ""))
                time.sleep(hint if hint == hint else 1.0)  # (a NaN hint is counted as a refusal without one)
                lateness.append(time.monotonic() - (at + hint))
        return StreamResult("RESOURCE_EXHAUSTED", 0, "attempts exhausted", tuple(refusals))

    short = _classes(setup)[0]
    mon = Monitor(client, admission, short, clusters, targets.addresses)
    learned_at: dict[str, str] = {}
    try:
        if setup.warmup_streams:
            with ThreadPoolExecutor(setup.warmup_streams) as pool:
                warm = list(pool.map(lambda i: one(i, "warm"), range(setup.warmup_streams)))
            bad = [w for w in warm if w.status != "ok"]
            if bad:
                raise RuntimeError(f"the warm-up lost {len(bad)} streams: {bad[:2]}")
            learned_at["after_warmup"] = targets.learned()
        t0 = time.monotonic()
        with ThreadPoolExecutor(setup.streams) as pool:
            results = list(pool.map(lambda i: one(i, "burst"), range(setup.streams)))
        elapsed = time.monotonic() - t0
        time.sleep(0.3)  # the last places' release is sampled
        learned_at["after_burst"] = targets.learned()
    finally:
        mon.stop()
    return LoadOutcome(setup, results, elapsed, t0, mon, lateness_s=lateness, learned=learned_at)


def load_deploy_config(base, setup: LoadSetup):
    """``base`` (a DeployConfig) with two router processes whose admission classes and stream limit are
    ``setup``'s."""
    return replace(base, routers=2, admission=True, request_classes=_request_classes(setup),
                   control=replace(base.control, router_max_streams=setup.router_streams))


def run_load_on_router_processes(dep, setup: LoadSetup) -> LoadOutcome:
    """The burst against ``dep``'s own two router processes (RouterActor; ``dep`` built from
    :func:`load_deploy_config`): the clients and the monitor run here, the routers do not share their GIL."""
    import ray

    from k3serve.cluster.redis_server import connect
    from k3serve.router.admission import Admission

    def learned() -> str:
        ttft, tpot = ray.get(dep.routers[0].learned_durations.remote("short"), timeout=60)
        return f"ttft {ttft:.2f}s + tpot {tpot:.3f}s"

    client = connect(dep.redis_url, timeout_s=10.0)
    admission = Admission(client, dep.deploy.control.namespace)  # the routers' key layout and stats script
    return _burst(RouterTargets(list(dep.router_addresses), learned), admission, client,
                  sorted(dep.cluster_endpoints), setup)


def run_router_load_bench(config: str = "configs/local.yaml", setup: LoadSetup = LoadSetup()) -> dict:
    """A local deployment of ``config`` with two router processes sized by ``setup`` (:func:`load_deploy_config`),
    one warm-up and one burst: ``LoadOutcome.figures`` plus the setup."""
    from dataclasses import asdict

    from k3serve.cluster.deploy import load_deploy
    from k3serve.cluster.deployment import Deployment

    with Deployment(load_deploy_config(load_deploy(config), setup)) as dep:
        outcome = run_load_on_router_processes(dep, setup)
    return {**outcome.figures(), "routers": "two router processes (RouterActor)", "setup": asdict(setup)}


# ---------------------------------------------------------------------------------------- the report's figures
# hints.within_2x_after_onset_fraction counts the hints from onset_s on apart: the first seconds' hints are paced by
# holding times learned before the burst, while the burst's own first requests run longer.
def _quantile(xs: list[float], q: float) -> float | None:
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3) if xs else None


def _fraction(xs: list[float]) -> float | None:
    return round(sum(0.5 <= r <= 2.0 for r in xs) / len(xs), 3) if xs else None


def hint_ratios(outcome: LoadOutcome) -> tuple[list[float], list[float], int]:
    """(hint / measured wait of every refusal whose budget was seen with a room after it, the same for refusals
    from ``onset_s`` into the burst on, how many never saw one). Both sides are floored at ``floor_s``."""
    s = outcome.setup
    ratios, late, unseen = [], [], 0
    for x, wait in outcome.waits():
        if wait is None:
            unseen += 1
            continue
        r = max(x.hint_s, s.floor_s) / max(wait, s.floor_s)
        ratios.append(r)
        if x.at - outcome.started >= s.onset_s:
            late.append(r)
    return ratios, late, unseen


def load_figures(outcome: LoadOutcome) -> dict:
    s, mon = outcome.setup, outcome.monitor
    ratios, late, unseen = hint_ratios(outcome)
    q = sorted(ratios)
    refusals = outcome.refusals
    max_count, max_tokens = outcome.max_in_flight()
    return {
        "streams": len(outcome.results),
        "completed": sum(r.status == "ok" and r.tokens == s.max_tokens for r in outcome.results),
        "elapsed_s": round(outcome.elapsed_s, 2),
        "refusals": len(refusals),
        "refused_at_router_stream_limit": sum(x.rejected_by.startswith("router") for x in refusals),
        "refused_with_room_sampled": outcome.refused_with_room(),
        "busy_fraction": round(outcome.busy(), 3),
        "hints": {
            "measured": len(ratios),
            "room_never_seen": unseen,
            "within_2x_fraction": _fraction(ratios),
            "within_2x_after_onset_fraction": _fraction(late),
            "all_within_2x": bool(ratios) and all(0.5 <= r <= 2.0 for r in ratios),
            "ratio_min": _quantile(q, 0.0), "ratio_p10": _quantile(q, 0.1), "ratio_median": _quantile(q, 0.5),
            "ratio_p90": _quantile(q, 0.9), "ratio_max": round(q[-1], 3) if q else None,
        },
        "clients_lateness_max_s": round(max(outcome.lateness_s, default=0.0), 3),
        "max_in_flight_per_cluster": max_count,
        "max_in_flight_tokens_per_cluster": max_tokens,
        "budget": {"max_concurrent": s.max_concurrent, "queue": s.queue, "clusters": len(mon.clusters)},
        "probes": mon.probes,
        "probe_failures": len(mon.probe_failures),
        "monitor_samples": len(mon.samples),
        "monitor_sample_failures": len(mon.sample_failures),
        "learned_durations": outcome.learned,
    }
