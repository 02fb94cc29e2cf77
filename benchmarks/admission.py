"""``k3serve bench admission``: short-request TTFT under a burst of long requests, budgets on vs off.

One local deployment (one cluster, so the burst lands where the short traffic is), three phases in one run:

1. unloaded: short requests one after another;
2. burst with budgets: ``long_requests`` long prompts at once while the same short traffic runs; the long class
   has a small in-flight budget, so extra long requests wait in their queue or get RESOURCE_EXHAUSTED;
3. burst without budgets (the router's gate switched off): every long request goes straight to the cluster and
   competes with short ones for the prefill steps and the page pool.

TTFT is measured at the client: send -> first streamed token.

Two engine knobs set how much a burst can hurt short requests (chunk_plan.py): the step budget
(``--step-tokens``, what a short request gets in one step) and ``--long-step-tokens``, the most tokens of long
prompts in one step. A short request arriving during a long-only step waits for it, and a long chunk's cost
grows with its context, so the second knob sets the worst extra wait. ``long_ttft_max_s`` shows its price.

With shorts started around a waiting long prompt the engine alone keeps short TTFT under a burst; what budgets
add is on the long side: without them every long prompt runs at once and the slowest waits about twice as long
for its first token as with them, where the excess is refused at once with RESOURCE_EXHAUSTED and a retry hint.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import threading
import time

import grpc
import ray

from k3serve.cluster.deploy import DeployConfig, PoolSpec, RequestClassSpec, load_deploy
from k3serve.cluster.deployment import Deployment
from k3serve.v1 import router_pb2, router_pb2_grpc


def bench_deploy(base: DeployConfig, long_budget: int, long_queue: int, pages: int, step_tokens: int,
                 long_step_tokens: int = 0) -> DeployConfig:
    pools = PoolSpec(kda_slots=48, mla_pages=pages, page_size=64)
    clusters = dataclasses.replace(base.clusters, count=1, prefill_tp=1, decode_tp=1, prefill_pools=pools,
                                   decode_pools=pools, step_token_budget=step_tokens,
                                   long_step_tokens=long_step_tokens)
    classes = (RequestClassSpec("short", 4096, inflight_token_budget=1 << 20, max_concurrent=64),
               RequestClassSpec("long", 1 << 30, inflight_token_budget=long_budget, max_concurrent=1,
                                queue_limit=long_queue, max_wait_s=120.0))
    return dataclasses.replace(base, clusters=clusters, routers=1, request_classes=classes, admission=True)


def _p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))] if xs else float("nan")


def _rounded(xs: list[float]) -> list[float]:
    """Every sample, in arrival order (the p99 of 12 samples is their maximum: show what it is made of)."""
    return [round(x, 3) for x in xs]


class _Client:
    def __init__(self, addr: str) -> None:
        self.stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(addr))

    def ttft(self, prompt: list[int], session: str, max_tokens: int = 4) -> tuple[float, str]:
        """(seconds to the first token, outcome: "ok" or a status code name)."""
        req = router_pb2.GenerateRequest(session_id=session, prompt_token_ids=prompt,
                                         sampling=router_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        t = time.perf_counter()
        first = None
        try:
            for _ in self.stub.Generate(req, timeout=600):
                if first is None:
                    first = time.perf_counter() - t
            return first, "ok"
        except grpc.RpcError as e:
            return time.perf_counter() - t, e.code().name


def _shorts(client: _Client, n: int, prompt_len: int, rng: random.Random, tag: str, gap_s: float) -> list[float]:
    out = []
    for i in range(n):
        ttft, status = client.ttft([rng.randrange(256) for _ in range(prompt_len)], f"{tag}-short-{i}")
        if status == "ok":
            out.append(ttft)
        time.sleep(gap_s)
    return out


def _burst(client: _Client, longs: int, long_len: int, shorts: int, short_len: int, rng: random.Random,
           tag: str) -> dict:
    results: list[str] = []
    long_ttfts: list[float] = []
    lock = threading.Lock()

    def one_long(i: int) -> None:
        prompt = [rng.randrange(256) for _ in range(long_len)]
        ttft, status = client.ttft(prompt, f"{tag}-long-{i}", max_tokens=2)
        with lock:
            results.append(status)
            if status == "ok":
                long_ttfts.append(ttft)

    threads = [threading.Thread(target=one_long, args=(i,)) for i in range(longs)]
    for t in threads:
        t.start()
    time.sleep(0.5)  # the burst is in before the short traffic starts
    ttfts = _shorts(client, shorts, short_len, rng, tag, gap_s=0.2)
    for t in threads:
        t.join()
    return {"short_ttfts": ttfts, "long_completed": results.count("ok"),
            "long_rejected": results.count("RESOURCE_EXHAUSTED"),
            "long_other": len(results) - results.count("ok") - results.count("RESOURCE_EXHAUSTED"),
            "long_ttft_max_s": round(max(long_ttfts), 3) if long_ttfts else None}


def run_admission_bench(config: str = "configs/local.yaml", shorts: int = 12, short_len: int = 200,
                        longs: int = 8, long_len: int = 6000, long_budget: int = 8192, long_queue: int = 3,
                        pages: int = 640, step_tokens: int = 512, long_step_tokens: int = 0) -> dict:
    deploy = bench_deploy(load_deploy(config), long_budget, long_queue, pages, step_tokens, long_step_tokens)
    rng = random.Random(0)
    with Deployment(deploy) as dep:
        client = _Client(dep.router_addresses[0])
        _shorts(client, 2, short_len, rng, "warmup", 0.0)
        unloaded = _shorts(client, shorts, short_len, rng, "unloaded", 0.2)
        with_budgets = _burst(client, longs, long_len, shorts, short_len, rng, "budgets")
        ray.get(dep.routers[0].set_admission.remote(False))
        without = _burst(client, longs, long_len, shorts, short_len, rng, "nobudgets")
    return {
        "short_ttft_p99_unloaded_s": _p99(unloaded),
        "short_ttft_p99_burst_budgets_s": _p99(with_budgets["short_ttfts"]),
        "short_ttft_p99_burst_no_budgets_s": _p99(without["short_ttfts"]),
        "short_ttft_median_unloaded_s": statistics.median(unloaded) if unloaded else None,
        "long_completed": with_budgets["long_completed"],
        "long_rejected": with_budgets["long_rejected"],
        "long_lost": with_budgets["long_other"],
        "long_ttft_max_s": with_budgets["long_ttft_max_s"],  # the price of small long steps: the longs' wait
        "no_budgets": {k: v for k, v in without.items() if k != "short_ttfts"},
        "short_ttfts_s": {"unloaded": _rounded(unloaded), "burst_budgets": _rounded(with_budgets["short_ttfts"]),
                          "burst_no_budgets": _rounded(without["short_ttfts"])},
        "setup": {"short_requests": shorts, "short_prompt_tokens": short_len, "long_requests": longs,
                  "long_prompt_tokens": long_len, "long_inflight_budget_tokens": long_budget,
                  "long_queue_limit": long_queue, "page_pool_tokens": pages * 64,
                  "prefill_step_token_budget": step_tokens,
                  "long_step_tokens": long_step_tokens or step_tokens},
    }
