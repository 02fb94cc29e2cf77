"""``k3serve bench http``: the same streamed requests through the routers' HTTP door and their gRPC door, side
by side in one deployment: TTFT p50/p99 and tokens/s for each.

Rounds alternate the door that goes first; every (round, door) has a cache_salt of its own, so neither door
reuses the other's prefixes, and each round's prompts are the same for both doors. A warm-up round (both doors,
not counted) comes first.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import asdict, dataclass

import grpc
import torch

from k3serve.v1 import router_pb2 as pb
from k3serve.v1 import router_pb2_grpc


@dataclass(frozen=True)
class HttpBenchSetup:
    streams: int = 32  # concurrent streams per round and door
    rounds: int = 3
    prompt_tokens: int = 64
    max_tokens: int = 32


@dataclass
class _Result:
    ttft_s: float = float("nan")
    tokens: int = 0
    error: str = ""


def _prompts(setup: HttpBenchSetup, round_: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1000 + round_)
    return [torch.randint(0, 256, (setup.prompt_tokens,), generator=g).tolist() for _ in range(setup.streams)]


def _grpc_stream(addr: str, ids: list[int], setup: HttpBenchSetup, salt: str, out: _Result, go) -> None:
    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(addr))
    go.wait()
    t0 = time.monotonic()
    try:
        for msg in stub.Generate(pb.GenerateRequest(prompt_token_ids=ids, cache_salt=salt, sampling=pb.SamplingParams(
                max_tokens=setup.max_tokens, ignore_eos=True)), timeout=300):
            if msg.token_ids and not out.tokens:
                out.ttft_s = time.monotonic() - t0
            out.tokens += len(msg.token_ids)
    except grpc.RpcError as e:
        out.error = f"{e.code().name}: {e.details()}"


def _http_stream(addr: str, ids: list[int], setup: HttpBenchSetup, salt: str, model: str, out: _Result, go) -> None:
    from k3serve.router.sse_client import HttpCallError, stream_completion

    body = {"model": model, "prompt": ids, "max_tokens": setup.max_tokens, "temperature": 0, "ignore_eos": True,
            "cache_salt": salt, "return_token_ids": True}
    go.wait()
    t0 = time.monotonic()
    try:
        for chunk in stream_completion(addr, body):
            n = sum(len(c.get("token_ids", ())) for c in chunk["choices"])
            if n and not out.tokens:
                out.ttft_s = time.monotonic() - t0
            out.tokens += n
    except (HttpCallError, ConnectionError) as e:
        out.error = str(e)


def _round(door: str, addrs: list[str], prompts: list[list[int]], setup: HttpBenchSetup, salt: str,
           model: str) -> tuple[list[_Result], float]:
    results = [_Result() for _ in prompts]
    go = threading.Event()
    threads = []
    for i, (ids, out) in enumerate(zip(prompts, results)):
        addr = addrs[i % len(addrs)]
        args = (addr, ids, setup, salt, out, go) if door == "grpc" else (addr, ids, setup, salt, model, out, go)
        threads.append(threading.Thread(target=_grpc_stream if door == "grpc" else _http_stream, args=args))
    for t in threads:
        t.start()
    time.sleep(0.2)  # every client connected and waiting
    t0 = time.monotonic()
    go.set()
    for t in threads:
        t.join()
    return results, time.monotonic() - t0


def _summary(results: list[_Result], walls: list[float]) -> dict:
    ttfts = sorted(r.ttft_s for r in results if not r.error)
    tokens = sum(r.tokens for r in results)
    q = statistics.quantiles(ttfts, n=100, method="inclusive") if len(ttfts) > 1 else ttfts * 99
    return {"streams": len(results), "errors": sum(bool(r.error) for r in results),
            "first_error": next((r.error for r in results if r.error), ""), "ttft_p50_s": round(q[49], 4),
            "ttft_p99_s": round(q[98], 4), "tokens": tokens, "tokens_per_s": round(tokens / sum(walls), 1)}


def run_http_bench_on(dep, setup: HttpBenchSetup = HttpBenchSetup()) -> dict:
    """The bench against a started deployment ``dep`` (both routers, both doors)."""
    from k3serve.cluster.router_actor import served_model_name

    model = served_model_name(dep.deploy)
    doors = {"grpc": list(dep.router_addresses), "http": list(dep.http_addresses)}
    for door in doors:  # warm-up: connections, the routers' learned durations, the clusters' code paths
        _round(door, doors[door], _prompts(setup, -1), setup, f"warm-{door}", model)
    got: dict[str, list] = {d: [] for d in doors}
    walls: dict[str, list] = {d: [] for d in doors}
    for r in range(setup.rounds):
        order = ("grpc", "http") if r % 2 == 0 else ("http", "grpc")
        for door in order:
            res, wall = _round(door, doors[door], _prompts(setup, r), setup, f"bench-{r}-{door}", model)
            got[door] += res
            walls[door].append(wall)
    out = {door: _summary(got[door], walls[door]) for door in doors}
    out["http_over_grpc_ttft_p50"] = round(out["http"]["ttft_p50_s"] / out["grpc"]["ttft_p50_s"], 3)
    out["setup"] = {**asdict(setup), "routers": len(dep.router_addresses), "clusters": len(dep.cluster_endpoints)}
    return out


def run_http_bench(config: str = "configs/local.yaml", setup: HttpBenchSetup = HttpBenchSetup()) -> dict:
    """A local deployment of ``config``, then :func:`run_http_bench_on`."""
    from k3serve.cluster.deploy import load_deploy
    from k3serve.cluster.deployment import Deployment

    with Deployment(load_deploy(config)) as dep:
        return run_http_bench_on(dep, setup)
