"""``k3serve bench trace``: replay the head of a trace through a live deployment's routers (docs/traffic.md).

Each request is sent at its arrival time (scaled by ``time_scale``) with the prompt its hash ids stand for
(sim/trace.py: 512 fixed tokens per id, so the service sees exactly the trace's sharing), without a session id
unless ``sessions`` (then the id names the conversation by its first two hash ids). Measured per request at the
client: time to first token, and from the final usage the cached tokens and the cluster that served it. The
figures are those of ``k3serve sim``, so the simulator can be checked against the service on the same prompts.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import redis

from k3serve.sim.trace import TraceRequest, ideal_reuse, load_trace, prompt_tokens
from k3serve.v1 import router_pb2, router_pb2_grpc


@dataclass(frozen=True)
class ReplaySetup:
    trace: str
    max_requests: int = 60
    max_blocks: int = 6
    time_scale: float = 1.0  # arrival times multiplied by this (0.5: twice as fast)
    sessions: bool = False
    max_tokens: int = 4  # generated tokens per request at most (the trace's output_length if smaller)
    workers: int = 32  # requests in flight at most

    def __post_init__(self) -> None:
        if self.max_requests < 1 or self.max_blocks < 1 or self.max_tokens < 1 or self.workers < 1:
            raise ValueError("--max-requests, --max-blocks, --max-tokens and workers must be >= 1")
        if not self.time_scale >= 0:
            raise ValueError(f"--time-scale must be >= 0, got {self.time_scale}")


@dataclass
class _Outcome:
    status: str = "ok"
    ttft_s: float = 0.0
    prompt: int = 0
    cached: int = 0
    cluster: str = ""


def _send(stub, req: TraceRequest, index: int, prompt: list[int], setup: ReplaySetup) -> _Outcome:
    session = f"trace-{req.hash_ids[0]}-{req.hash_ids[1] if req.blocks > 1 else 0}" if setup.sessions else ""
    msg = router_pb2.GenerateRequest(
        request_id=f"trace-{index}-{time.monotonic_ns()}", session_id=session, prompt_token_ids=prompt,
        sampling=router_pb2.SamplingParams(max_tokens=min(setup.max_tokens, req.output_length), ignore_eos=True))
    out = _Outcome(prompt=len(prompt))
    t = time.perf_counter()
    try:
        for m in stub.Generate(msg, timeout=600):
            if not out.ttft_s:
                out.ttft_s = time.perf_counter() - t
            if m.HasField("usage"):
                out.cached, out.cluster = m.usage.cached_tokens, m.usage.cluster_id
    except grpc.RpcError as e:
        out.status = e.code().name
    return out


def replay(routers: list[str], setup: ReplaySetup, vocab: int, clusters: list[str]) -> dict:
    """Send the trace's head through ``routers`` (round robin) and measure; ``clusters``: every cluster id of the
    deployment (an idle one counts in the load spread as 0)."""
    reqs = load_trace(setup.trace, setup.max_requests, setup.max_blocks)
    prompts = [prompt_tokens(r, vocab) for r in reqs]
    stubs = [router_pb2_grpc.RouterStub(grpc.insecure_channel(a)) for a in routers]
    outcomes: list[_Outcome | None] = [None] * len(reqs)
    t0 = time.monotonic()
    with ThreadPoolExecutor(setup.workers) as pool:
        futs = []
        for i, r in enumerate(reqs):
            delay = t0 + r.arrival_s * setup.time_scale - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            futs.append(pool.submit(_send, stubs[i % len(stubs)], r, i, prompts[i], setup))
        for i, f in enumerate(futs):
            outcomes[i] = f.result()
    wall = time.monotonic() - t0
    ok = [o for o in outcomes if o.status == "ok"]
    by: dict[str, dict[str, int]] = {c: {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0,
                                         "computed_tokens": 0} for c in clusters}
    for o in ok:
        b = by.setdefault(o.cluster, {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "computed_tokens": 0})
        b["requests"] += 1
        b["prompt_tokens"] += o.prompt
        b["cached_tokens"] += o.cached
        b["computed_tokens"] += o.prompt - o.cached
    loads = [b["computed_tokens"] for b in by.values()]
    mean = sum(loads) / len(loads) if loads else 0
    ideal, total = ideal_reuse(reqs)
    ttfts = sorted(o.ttft_s for o in ok)
    failed: dict[str, int] = {}
    for o in outcomes:
        if o.status != "ok":
            failed[o.status] = failed.get(o.status, 0) + 1
    reuse = sum(o.cached for o in ok) / total if ok else 0.0
    return {
        "trace": setup.trace, "requests": len(reqs), "completed": len(ok), "failed": sum(failed.values()),
        "failed_by_code": failed, "sessions": setup.sessions, "max_blocks": setup.max_blocks,
        "time_scale": setup.time_scale, "reuse": round(reuse, 4), "ideal_reuse": round(ideal / total, 4),
        "reuse_of_ideal": round(reuse * total / ideal, 4) if ideal else None,
        "load_max_over_mean": round(max(loads) / mean, 3) if mean else None, "by_cluster": by,
        "ttft_p50_s": round(statistics.median(ttfts), 4) if ttfts else None,
        "ttft_p99_s": round(ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))], 4) if ttfts else None,
        "wall_s": round(wall, 2)}


def _prefill_tps(redis_url: str, namespace: str, secret: str) -> float | None:
    """Mean measured prefill rate the clusters heartbeat (the simulator's calibration), None if unknown (also
    without the deployment's secret, which signs the entries: a running deployment's is not in its endpoints
    file unless the deploy file sets one)."""
    if not secret:
        return None
    from k3serve.cluster.redis_server import connect
    from k3serve.router.membership import Membership

    try:
        rates = [c.load.get("prefill_tps", 0.0) for c in Membership(connect(redis_url), namespace, secret).read()[1]]
    except (redis.RedisError, OSError):  # a figure that cannot be read is reported as unknown
        return None
    rates = [r for r in rates if r > 0]
    return round(sum(rates) / len(rates), 1) if rates else None


def run_trace_bench(setup: ReplaySetup, config: str, endpoints_file: str = "", policy: str = "") -> dict:
    """Against the deployment in ``endpoints_file`` (what `k3serve serve` wrote), else one brought up from
    ``config`` (``policy``: its anonymous routing instead of the file's) and taken down after."""
    from k3serve.cluster.deploy import load_deploy
    from k3serve.model.config_file import load_config

    deploy = load_deploy(config)
    if policy:
        deploy = dataclasses.replace(deploy, control=dataclasses.replace(deploy.control, anonymous_routing=policy))
    if endpoints_file:
        info = json.loads(Path(endpoints_file).read_text())
        vocab = load_config(info["checkpoint"]).vocab_size
        result = replay(info["routers"], setup, vocab, sorted(info["clusters"]))
        result["prefill_tps"] = _prefill_tps(info["redis"], deploy.control.namespace, deploy.secret)
        result["policy"] = f"{deploy.control.anonymous_routing} (from {config}; the running deployment's own)"
        return result
    from k3serve.cluster.deployment import Deployment

    with Deployment(deploy) as dep:
        vocab = load_config(dep.checkpoint).vocab_size
        result = replay(dep.router_addresses, setup, vocab, sorted(dep.cluster_endpoints))
        result["prefill_tps"] = _prefill_tps(dep.redis_url, deploy.control.namespace, dep.deploy.secret)
    result["policy"] = deploy.control.anonymous_routing
    return result

