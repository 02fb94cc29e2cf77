"""Client helpers for the live-deployment tests: streaming requests in threads, a deploy file, waiting."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc
import torch

from k3serve.v1 import router_pb2 as pb
from k3serve.v1 import router_pb2_grpc

ONE_CLUSTER_YAML = """\
model: {{checkpoint: {checkpoint}}}
clusters:
  count: 1
  prefill_tp: 1
  decode_tp: 1
  prefill_pools: {{kda_slots: 16, mla_pages: 512, page_size: 64}}
  decode_pools: {{kda_slots: 16, mla_pages: 512, page_size: 64}}
routers: 1
drain_timeout_s: {drain}
torch_threads: 1
"""


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def write_deploy(path: Path, checkpoint: str, drain_timeout_s: float = 90.0) -> Path:
    path.write_text(ONE_CLUSTER_YAML.format(checkpoint=checkpoint, drain=drain_timeout_s))
    return path


def wait_for_file(path: Path, timeout_s: float, alive=lambda: True) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and alive():
        if path.is_file() and path.stat().st_size:
            return json.loads(path.read_text())
        time.sleep(0.5)
    raise TimeoutError(f"{path} did not appear within {timeout_s} s")


@dataclass
class Stream:
    """One streaming Generate in a thread; `first` is set at its first token."""

    request: pb.GenerateRequest
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = ""
    error: grpc.StatusCode | None = None
    details: str = ""
    first: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)

    def run(self, stub: router_pb2_grpc.RouterStub, timeout_s: float = 300) -> None:
        try:
            for msg in stub.Generate(self.request, timeout=timeout_s):
                self.tokens += msg.token_ids
                self.first.set()
                if msg.finish_reason:
                    self.finish_reason = msg.finish_reason
        except grpc.RpcError as e:
            self.error, self.details = e.code(), e.details()
        finally:
            self.first.set()
            self.done.set()


def start_streams(address: str, prompts: list[list[int]], max_tokens: int | list[int], tag: str) -> list[Stream]:
    """One streaming request per prompt (``max_tokens`` for all, or one per prompt), each read on its thread."""
    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(address))
    lengths = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else max_tokens
    streams = [Stream(pb.GenerateRequest(request_id=f"{tag}-{i}", session_id=f"{tag}-{i}", prompt_token_ids=p,
                                         sampling=pb.SamplingParams(max_tokens=n, ignore_eos=True)))
               for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))]
    for s in streams:
        threading.Thread(target=s.run, args=(stub,), daemon=True).start()
    return streams


def check_refused_while_draining(address: str, streams: list[Stream]) -> bool:
    """Once health reads NOT_SERVING, a new request must get UNAVAILABLE; returns whether that was observed
    while some stream was still in flight (the router still up)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    ch = grpc.insecure_channel(address)
    health = health_pb2_grpc.HealthStub(ch)
    stub = router_pb2_grpc.RouterStub(ch)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(s.done.is_set() for s in streams):
        try:
            status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
        except grpc.RpcError:
            return False
        if status == health_pb2.HealthCheckResponse.NOT_SERVING:
            late = Stream(pb.GenerateRequest(prompt_token_ids=[1, 2, 3], sampling=pb.SamplingParams(max_tokens=2)))
            late.run(stub, timeout_s=10)
            assert late.error == grpc.StatusCode.UNAVAILABLE and "draining" in late.details, (late.error,
                                                                                              late.details)
            return not all(s.done.is_set() for s in streams)
        time.sleep(0.05)
    return False


def two_cluster_kill_drill(base, **cluster_fields) -> dict:
    """A cheap cluster-kill drill on `base` (a DeployConfig) with 2 clusters, 1 router and no rebuild: c0 killed
    once every session has done a turn (8 sessions x 2 turns, 8 tokens, seed 5); `cluster_fields` override the
    clusters section (transfer plane, layer-wise export, ...). Returns the drill's report."""
    from k3serve.cluster.deployment import Deployment

    clusters = replace(base.clusters, count=2, max_decode_batch=16, rebuild=False, **cluster_fields)
    dep = Deployment(replace(base, clusters=clusters, routers=1)).start()
    try:
        return kill_c0_drill(dep)
    finally:
        dep.stop()


def kill_c0_drill(dep) -> dict:
    """The cheap drill on a running deployment: c0 killed once every session has done a turn (8 sessions x 2
    turns, 8 tokens, seed 5). Returns the drill's report."""
    from k3serve.cluster.drill import Fault, run_drill

    return run_drill(dep, Fault("cluster", "c0"), at_s=0.0, sessions=8, turns=2, max_tokens=8, seed=5, after_turns=1)
