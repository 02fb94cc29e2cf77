"""Failover drills: a multi-turn workload through the routers with a fault injected mid-run.

Each session runs its turns one after another (prompt = history + reply + a new user message); sessions run
concurrently. At ``at_s`` the drill kills a cluster, one of its decode or prefill ranks, a whole Ray node (its
raylet and workers: every cluster with a part there is lost, cluster/nodes.py), a router, or Redis.
Afterwards every completed request is checked against the single-process reference generator on the same
prompt and sampling parameters (the fault-free run), and the report says how the killed cluster's sessions
spread over the survivors.

Every 4th session speaks OpenAI HTTP to the routers' HTTP door, the others gRPC. Clients retry on another
router replica when theirs fails, resuming with prompt + tokens already received
and the remaining max_tokens (randomness is keyed by position, so the continuation is exact).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

import grpc
import ray
from redis.exceptions import RedisError

from k3serve.cluster.deployment import Deployment
from k3serve.engine import mutation
from k3serve.router.hashing import rank_clusters, session_key
from k3serve.v1 import router_pb2, router_pb2_grpc

log = logging.getLogger(__name__)

FAULT_KINDS = ("cluster", "decode", "prefill", "node", "router", "redis")
# what a request holds while it runs: every one reads 0 on an idle cluster (the prefix cache's own are excluded)
REQUEST_POOLS = ("prefill.kda_slots", "prefill.request_pages", "decode.kda_slots", "decode.mla_pages",
                 "decode.waiting", "decode.staging_bytes")


@dataclass(frozen=True)
class Fault:
    kind: str
    target: str = ""  # a cluster id for cluster/decode/prefill; a node's custom resource or id for node

    @staticmethod
    def parse(spec: str) -> "Fault":
        kind, _, target = spec.partition(":")
        if kind not in FAULT_KINDS:
            raise ValueError(f"--kill must be one of cluster:ID, decode:ID, prefill:ID, node:N, router, redis; "
                             f"got {spec!r}")
        if kind in ("cluster", "decode", "prefill") and not target:
            raise ValueError(f"--kill {kind} needs a cluster id, e.g. {kind}:c0")
        if kind == "node" and not target:
            raise ValueError("--kill node needs a node: a custom resource only it has, or its id, e.g. node:k3_node_b")
        return Fault(kind, target)


@dataclass
class RequestRecord:
    session: str
    turn: int
    prompt: list[int]
    params: router_pb2.SamplingParams
    tokens: list[int] = field(default_factory=list)
    cluster_id: str = ""
    failovers: int = 0
    router_retries: int = 0
    retry_reasons: list[str] = field(default_factory=list)
    error: str = ""
    start_s: float = 0.0
    end_s: float = 0.0
    door: str = "grpc"  # or "http": the routers' OpenAI-compatible door


HTTP_EVERY = 4  # every 4th session (i % 4 == 3) speaks through the routers' OpenAI-compatible HTTP door


class _Retry(Exception):
    """An attempt that failed; ``final``: the client's own error (no other router would answer otherwise)."""

    def __init__(self, reason: str, final: bool) -> None:
        super().__init__(reason)
        self.final = final


class DrillClient:
    """One session's client: sends a request to a router (gRPC, or the HTTP door) and resumes on another one if
    its router dies."""

    def __init__(self, addresses: list[str], http_addresses: list[str] = (), model: str = "") -> None:
        self.stubs = [router_pb2_grpc.RouterStub(grpc.insecure_channel(a)) for a in addresses]
        self.http_addresses, self.model = list(http_addresses), model

    def uses_http(self, session_index: int) -> bool:
        return bool(self.http_addresses) and session_index % HTTP_EVERY == HTTP_EVERY - 1

    def generate(self, rec: RequestRecord, first_router: int, timeout_s: float = 120.0, http: bool = False) -> None:
        attempts = 0
        router = first_router
        rec.door = "http" if http else "grpc"
        while True:
            try:
                attempt = self._http_attempt if http else self._grpc_attempt
                attempt(rec, router, f"{rec.session}-t{rec.turn}-a{attempts}", timeout_s)
                return
            except _Retry as e:
                attempts += 1
                if e.final or attempts > 4:
                    rec.error = str(e)
                    return
                rec.router_retries += 1
                rec.retry_reasons.append(str(e)[:200])
                router = (router + 1) % (len(self.http_addresses) if http else len(self.stubs))
                time.sleep(0.2)

    def _grpc_attempt(self, rec: RequestRecord, router: int, request_id: str, timeout_s: float) -> None:
        params = router_pb2.SamplingParams()
        params.CopyFrom(rec.params)
        params.max_tokens = rec.params.max_tokens - len(rec.tokens)
        req = router_pb2.GenerateRequest(request_id=request_id, session_id=rec.session,
                                         prompt_token_ids=rec.prompt + rec.tokens, sampling=params)
        try:
            for resp in self.stubs[router].Generate(req, timeout=timeout_s):
                rec.tokens += resp.token_ids
                if resp.finish_reason:
                    rec.cluster_id = resp.usage.cluster_id
                    rec.failovers += resp.usage.failovers
                    return
            raise _Retry("stream ended early", False)
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            raise _Retry(f"{code}: {e.details() if hasattr(e, 'details') else e}", code in (
                grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)) from None

    def _http_attempt(self, rec: RequestRecord, router: int, request_id: str, timeout_s: float) -> None:
        from k3serve.router.sse_client import HttpCallError, stream_completion

        p = rec.params
        body = {"model": self.model, "prompt": rec.prompt + rec.tokens, "max_tokens": p.max_tokens - len(rec.tokens),
                "temperature": p.temperature, "top_p": p.top_p or 1.0, "top_k": p.top_k, "ignore_eos": p.ignore_eos,
                "return_token_ids": True}
        if p.HasField("seed"):
            body["seed"] = p.seed
        try:
            for chunk in stream_completion(self.http_addresses[router], body, {"X-Session-Id": rec.session},
                                           timeout_s):
                for ch in chunk["choices"]:
                    rec.tokens += ch.get("token_ids", ())
                    if ch.get("finish_reason"):
                        rec.cluster_id = ch.get("cluster_id", "")
                        rec.failovers += ch.get("failovers", 0)
                        return
            raise _Retry("HTTP stream ended early", False)
        except HttpCallError as e:
            raise _Retry(f"http {request_id}: {e}", e.status in (400, 429)) from None
        except ConnectionError as e:
            raise _Retry(f"http {request_id}: {e}", False) from None


def session_names(sessions: int, seed: int, mutate: Mapping[int, str] = {}) -> list[str]:
    """Session i's name; under ``K3SERVE_TEST_MUTATION=per-request`` those in `mutate` carry their mutation's
    marker (k3serve/engine/mutation.py), which the request ids built from the name pass to the engines."""
    return [f"drill-{seed:x}-s{i}" + (f"-{mutation.marker(mutate[i])}" if i in mutate else "")
            for i in range(sessions)]


def _session_params(i: int, max_tokens: int) -> router_pb2.SamplingParams:
    if i % 2:  # half the sessions sample with a seed: failover must keep seeded outputs exact too
        return router_pb2.SamplingParams(temperature=0.8, top_p=0.95, seed=1000 + i, max_tokens=max_tokens,
                                         ignore_eos=True)
    return router_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def run_workload(dep: Deployment, sessions: int, turns: int, max_tokens: int, fault: Fault | None, at_s: float,
                 seed: int | None = None, redis_down_s: float = 5.0, after_turns: int = 0,
                 lost: list | None = None, mutate: Mapping[int, str] = {}) -> tuple[list[RequestRecord], float]:
    """Run the sessions; inject `fault` at `at_s`, and not before every session completed `after_turns` turns
    (so every cluster has served its sessions before the fault, however loaded the machine). Returns
    (records, the fault's time.monotonic()); a node fault appends its LostNode to `lost`."""
    # a fresh run id per drill: new sessions and prompts, so earlier runs' pins and cache entries do not apply
    seed = random.randrange(1 << 30) if seed is None else seed
    names = session_names(sessions, seed, mutate)
    rng = random.Random(seed)
    system = [rng.randrange(256) for _ in range(200)]
    records: list[RequestRecord] = []
    lock = threading.Lock()
    from k3serve.cluster.router_actor import served_model_name

    client = DrillClient(dep.router_addresses, dep.http_addresses, served_model_name(dep.deploy))
    t0 = time.monotonic()
    fault_at = [float("nan")]

    def session(i: int) -> None:
        srng = random.Random(seed * 7919 + i)
        history = list(system)
        for turn in range(turns):
            history += [srng.randrange(256) for _ in range(srng.randint(8, 40))]
            rec = RequestRecord(names[i], turn, list(history), _session_params(i, max_tokens),
                                start_s=time.monotonic())
            client.generate(rec, first_router=i % len(client.stubs), http=client.uses_http(i))
            rec.end_s = time.monotonic()
            with lock:
                records.append(rec)
            if rec.error:
                return
            history += rec.tokens

    fault_error: list[str] = []

    def inject() -> None:
        try:
            _inject()
        except Exception as e:  # noqa: BLE001 - reported, never swallowed silently
            fault_error.append(f"{type(e).__name__}: {e}")

    def _inject() -> None:
        time.sleep(at_s)
        while after_turns and any(t.is_alive() for t in threads[:sessions]):
            with lock:
                done = Counter(r.session for r in records if not r.error)
            if all(done[n] >= after_turns for n in names):
                break
            time.sleep(0.05)
        fault_at[0] = time.monotonic()
        if fault.kind == "cluster":
            dep.kill_cluster(fault.target)
        elif fault.kind in ("decode", "prefill"):
            dep.kill_rank(fault.target, fault.kind)
        elif fault.kind == "node":
            lost_node = dep.kill_node(fault.target)
            if lost is not None:
                lost.append(lost_node)
        elif fault.kind == "router":
            dep.kill_router(0)
        elif fault.kind == "redis":
            dep.pause_redis()
            time.sleep(redis_down_s)
            dep.resume_redis()

    threads = [threading.Thread(target=session, args=(i,)) for i in range(sessions)]
    if fault is not None:
        threads.append(threading.Thread(target=inject))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if fault_error:
        raise RuntimeError(f"fault injection failed: {fault_error[0]}")
    return records, fault_at[0] if fault else t0


def check_against_reference(checkpoint: str, records: list[RequestRecord], numerics=None,
                            threads: int = 1) -> list[RequestRecord]:
    """The completed requests whose tokens differ from the single-process reference (built with the
    deployment's numerics: in mode deterministic the served tokens must be its tokens exactly)."""
    from k3serve.contracts.sampling import SamplingParams
    from k3serve.model.loader import load_model
    from k3serve.model.reference import reference_generate

    import torch

    model = load_model(checkpoint, numerics=numerics)
    bad = []
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # more threads than free cores make torch spin: a busy machine slows 10-20x
    try:
        for r in records:
            if r.error:
                continue
            p = r.params
            ref = reference_generate(model, r.prompt, SamplingParams.from_proto(p))
            if ref.token_ids != r.tokens:
                bad.append(r)
    finally:
        torch.set_num_threads(before)
    return bad


def report(dep: Deployment, records: list[RequestRecord], fault: Fault | None, fault_s: float, t0: float,
           differ: list[RequestRecord], lost: tuple[str, ...] = ()) -> dict:
    """The drill's report; `differ`: the requests whose tokens are not the reference's; `lost`: the clusters a
    node fault took down (the node's clusters). A mutated session's requests (``mutate-`` in its name) must
    differ: ``mutations_missed`` counts those that did not."""
    clusters = list(dep.deploy.clusters.cluster_ids)
    out = {"requests": len(records), "http_requests": sum(r.door == "http" for r in records),
           "completed": sum(not r.error for r in records),
           "failed": sum(bool(r.error) for r in records), "failed_over": sum(r.failovers > 0 for r in records),
           "router_retries": sum(r.router_retries for r in records),
           "mismatches": sum(not _mutated(r) for r in differ),
           "mutated": sum(_mutated(r) and not r.error for r in records),
           "mutations_missed": sum(_mutated(r) and not r.error for r in records) - sum(map(_mutated, differ)),
           "fault": f"{fault.kind}:{fault.target}" if fault else None, "fault_at_s": fault_s,
           "in_flight_at_fault": sum(r.start_s - t0 <= fault_s <= r.end_s - t0 for r in records) if fault else 0,
           "errors": sorted({r.error for r in records if r.error})[:5],
           "retry_reasons": sorted({x for r in records for x in r.retry_reasons})[:5]}
    before = Counter(r.cluster_id for r in records if not r.error and r.end_s - t0 < fault_s) if fault else None
    out["completed_before_fault_by_cluster"] = dict(sorted(before.items())) if fault else None
    if fault is not None and fault.kind in ("cluster", "decode", "prefill", "node"):
        dead = set(lost) if fault.kind == "node" else {fault.target}
        survivors = [c for c in clusters if c not in dead]
        # sessions whose HRW primary is the failed cluster: where did their requests finish after the fault?
        moved: dict[str, str] = {}
        for r in sorted(records, key=lambda r: r.end_s):
            if r.error or r.end_s - t0 < fault_s:
                continue
            if rank_clusters(session_key(r.session, r.prompt), clusters)[0] in dead and r.cluster_id not in dead:
                moved[r.session] = r.cluster_id
        spread = Counter(moved.values())
        fair = len(moved) / len(survivors) if survivors else 0
        out["failed_cluster_sessions"] = len(moved)
        out["survivor_sessions"] = {c: spread.get(c, 0) for c in survivors}
        out["max_survivor_share_over_fair"] = (max(spread.values()) / fair) if spread and fair else 0.0
        first = [r.end_s - t0 - fault_s for r in records if r.failovers > 0 and not r.error]
        out["recovery_s"] = min(first) if first else 0.0
    else:
        out["max_survivor_share_over_fair"] = 0.0
        retried = [r.end_s - t0 - fault_s for r in records if (r.router_retries or r.failovers) and not r.error]
        out["recovery_s"] = min(retried) if retried else 0.0
    return out


def _mutated(rec: RequestRecord) -> bool:
    return mutation.marker("") in rec.session


def _recoveries(dep: Deployment, fault: Fault) -> int:
    """How often the fault's target cluster has been brought back so far (replaced actor or in-place rebuild)."""
    if fault.kind == "cluster":
        return dep.restarts.get(fault.target, 0)
    return ray.get(dep.clusters[fault.target].stats.remote(), timeout=30)["rebuilds"]


def wait_rejoined(dep: Deployment, fault: Fault, before: int, fault_abs: float, timeout_s: float) -> float | None:
    """Seconds from the fault until the failed cluster was back in the membership, rebuilt; None if not in time."""
    from k3serve.cluster.redis_server import connect
    from k3serve.router.membership import Membership

    members = Membership(connect(dep.redis_url), dep.deploy.control.namespace, dep.deploy.secret)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            back = _recoveries(dep, fault) > before and fault.target in {c.id for c in members.healthy_clusters()}
        except (ray.exceptions.RayError, RedisError, OSError) as e:  # the replaced actor may not answer yet
            log.debug("recovery probe of %s: %s", fault.target, e)
            back = False
        if back:
            return time.monotonic() - fault_abs
        time.sleep(0.25)
    return None


def busy_clusters(dep: Deployment, skip: set[str], timeout_s: float = 60.0) -> dict[str, dict]:
    """Per cluster not in `skip`, what still reads non-zero of running requests, in-flight tokens and
    REQUEST_POOLS (transfer staging included) once `timeout_s` passed without all reading 0; {} when idle."""
    deadline = time.monotonic() + timeout_s
    while True:
        busy: dict[str, dict] = {}
        for cid, handle in dep.clusters.items():
            if cid in skip:
                continue
            try:
                load = ray.get(handle.load.remote(), timeout=30)
            except ray.exceptions.RayError as e:
                busy[cid] = {"unreachable": str(e).splitlines()[0][:120]}
                continue
            keys = ["running_requests", "inflight_tokens"] + [f"pool.{p}.used" for p in REQUEST_POOLS]
            held = {k: load.get(k, "not reported") for k in keys if load.get(k, "not reported")}
            if held:
                busy[cid] = held
        if not busy or time.monotonic() > deadline:
            return busy
        time.sleep(0.25)


def violations(out: dict, fault: Fault | None) -> list[str]:
    """What a drill report breaks of: no failed request, no mismatch, every request of every session counted,
    every cluster idle afterwards (pools and staging back to 0), and a fault that hit requests in flight."""
    bad = [f"{out[k]} {k}" for k in ("failed", "mismatches", "mutations_missed") if out[k]]
    if out["requests"] != out["requests_expected"]:
        bad.append(f"{out['requests']} requests counted, {out['requests_expected']} sent (sessions x turns)")
    if out["busy_after"]:
        bad.append(f"clusters not idle after the drill: {out['busy_after']}")
    if fault is not None and not out["in_flight_at_fault"]:
        bad.append("the fault hit no request in flight")
    return bad


def run_drill(dep: Deployment, fault: Fault | None, at_s: float, sessions: int, turns: int,
              max_tokens: int, seed: int | None = None, rejoin_timeout_s: float = 120.0,
              after_turns: int = 0, check: bool = True, mutate: Mapping[int, str] = {}) -> dict:
    """The workload with `fault` injected at `at_s` (and once every session completed `after_turns` turns), checked
    against the reference. For a cluster or rank fault (with ``clusters.rebuild`` on) it then waits for the
    failed cluster to rejoin and reports ``rejoined_s``. A node fault reports the node's clusters
    (``lost_node_clusters``) and where every cluster ran (``cluster_nodes``, node id prefixes); they rebuild
    when the node comes back, which the drill does not wait for. The report's ``violations`` lists what
    :func:`violations` finds; `check` raises AssertionError (with the report) when there is any. `mutate`:
    sessions served with a test mutation (:func:`session_names`), proving the drill's check fails."""
    rebuilds = fault is not None and fault.kind in ("cluster", "decode", "prefill") and dep.deploy.clusters.rebuild
    before = _recoveries(dep, fault) if rebuilds else 0
    placed = dep.cluster_nodes() if fault is not None and fault.kind == "node" else None
    t0 = time.monotonic()
    lost: list = []
    records, fault_abs = run_workload(dep, sessions, turns, max_tokens, fault, at_s, seed,
                                      after_turns=after_turns, lost=lost, mutate=mutate)
    fault_s = fault_abs - t0
    rejoined = wait_rejoined(dep, fault, before, fault_abs, rejoin_timeout_s) if rebuilds else None
    differ = check_against_reference(dep.checkpoint, records, dep.deploy.numerics, dep.deploy.torch_threads)
    out = report(dep, records, fault, fault_s, t0, differ, lost[0].clusters if lost else ())
    out["rejoined_s"] = rejoined  # a node fault: its clusters rebuild once the node (or another like it) is back
    if placed is not None:
        out["cluster_nodes"] = {cid: {k: (v[:8] if isinstance(v, str) else [x[:8] for x in v])
                                      for k, v in where.items()} for cid, where in placed.items()}
        out["lost_node"] = lost[0].node_id[:8] if lost else None
        out["lost_node_clusters"] = list(lost[0].clusters) if lost else []
        out["node_dead_after_s"] = lost[0].dead_after_s if lost else None
    out["wall_s"] = time.monotonic() - t0
    out["sessions"], out["turns"], out["max_tokens"] = sessions, turns, max_tokens
    out["requests_expected"] = sessions * turns
    down = set(lost[0].clusters if lost else ())  # a lost node's clusters, a killed one that did not come back
    if fault is not None and fault.kind in ("cluster", "decode", "prefill") and rejoined is None:
        down.add(fault.target)
    out["busy_after"] = busy_clusters(dep, down)
    out["violations"] = violations(out, fault)
    if check and out["violations"]:
        raise AssertionError(f"drill: {'; '.join(out['violations'])}; report {out}")
    return out
