"""Cancellation, deadlines and a bounded soak on the shared live deployment (Ray, redis-server, 3 clusters).

After every cancel (before the first token, during the prefill of an 8K prompt, while decoding) and every
deadline, each cluster's running count, pools and transfer staging return to 0 and the id can be used again.
The soak sends requests with random cancels and checks outputs against the reference, pools, and the RSS of
every k3serve process. (Runs before test_service_e2e.py, whose last tests kill a router.)
"""

from __future__ import annotations

import os
import random
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import ray

from tests.cluster.live_clients import prompt
from k3serve.contracts.sampling import SamplingParams
from k3serve.v1 import router_pb2 as pb
from k3serve.v1 import router_pb2_grpc

# pools a request holds while it runs: all must read 0 on an idle cluster (the prefix cache's own are excluded)
REQUEST_POOLS = ("prefill.kda_slots", "prefill.request_pages", "decode.kda_slots", "decode.mla_pages",
                 "decode.waiting", "decode.staging_bytes")


def _stub(dep) -> router_pb2_grpc.RouterStub:
    return router_pb2_grpc.RouterStub(grpc.insecure_channel(dep.router_addresses[0]))


def _busy(dep) -> dict[str, dict[str, float]]:
    """Per cluster, what is not 0 of running requests, in-flight tokens and request pools."""
    out = {}
    for cid, h in dep.clusters.items():
        load = ray.get(h.load.remote(), timeout=30)
        keys = ["running_requests", "inflight_tokens"] + [f"pool.{p}.used" for p in REQUEST_POOLS]
        missing = [k for k in keys if k not in load]
        assert not missing, f"cluster {cid} does not report {missing}"
        nonzero = {k: load[k] for k in keys if load[k]}
        if nonzero:
            out[cid] = nonzero
    return out


def _wait_idle(dep, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (busy := _busy(dep)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not busy, f"clusters still hold requests: {busy}"


def _request(rid: str, ids: list[int], max_tokens: int, session: str = "", **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=rid, session_id=session or rid, prompt_token_ids=ids,
                              sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling))


def _collect(call) -> list[int]:
    return [t for m in call for t in m.token_ids]


def _reuse(dep, refs, rid: str) -> None:
    """The id is free again: a new request with it completes with the reference tokens."""
    ids = prompt(25, zlib.crc32(rid.encode()) % 1000)  # the same prompt every run (hash() is salted)
    got = _collect(_stub(dep).Generate(_request(rid, ids, 4), timeout=120))
    refs.check(ids, SamplingParams(max_tokens=4, ignore_eos=True), got, label=rid)  # tests/exactness.py


def _cancel_when(call, event_first: bool, after_s: float) -> tuple[list[int], str]:
    """Read `call` in a thread; cancel it after `after_s` (or at its first token). Returns the tokens received
    and how the stream ended: "cancelled", "done" (it finished before the cancel) or "error: <code> <details>"."""
    got: list[int] = []
    ended: list[str] = []
    first = threading.Event()

    def read() -> None:
        try:
            for m in call:
                got.extend(m.token_ids)
                first.set()
            ended.append("done")
        except grpc.RpcError as e:
            ended.append("cancelled" if e.code() == grpc.StatusCode.CANCELLED else f"error: {e.code()} {e.details()}")
        first.set()

    t = threading.Thread(target=read, daemon=True)
    t.start()
    if event_first:
        first.wait(120)
    else:
        time.sleep(after_s)
    call.cancel()
    t.join(60)
    assert not t.is_alive(), "the stream did not end within 60 s of its cancel"
    return list(got), ended[0]


def test_cancel_before_the_first_token_frees_everything(deployment, reference_refs):
    stub = _stub(deployment)
    got, ended = _cancel_when(stub.Generate(_request("cancel-early", prompt(3000, 1), 8)), False, 0.3)
    assert ended == "cancelled" and got == []  # cancelled while queued or prefilling: nothing streamed
    _wait_idle(deployment)
    _reuse(deployment, reference_refs, "cancel-early")
    _wait_idle(deployment)


def test_cancel_during_prefill_of_an_8k_prompt(deployment, reference_refs):
    stub = _stub(deployment)
    got, ended = _cancel_when(stub.Generate(_request("cancel-8k", prompt(8192, 2), 8)), False, 3.0)
    assert ended == "cancelled" and got == []  # 8K tokens at 128 long-prompt tokens per step: still prefilling
    _wait_idle(deployment)
    _reuse(deployment, reference_refs, "cancel-8k")


def test_cancel_while_decoding(deployment, reference_refs):
    stub = _stub(deployment)
    got, ended = _cancel_when(stub.Generate(_request("cancel-decode", prompt(40, 3), 400)), True, 0.0)
    assert ended == "cancelled" and 0 < len(got) < 400
    _wait_idle(deployment)
    _reuse(deployment, reference_refs, "cancel-decode")


def test_deadline_frees_everything_and_the_id_is_reusable(deployment, reference_refs):
    stub = _stub(deployment)
    with pytest.raises(grpc.RpcError) as err:
        _collect(stub.Generate(_request("deadline-8k", prompt(8192, 4), 8), timeout=1.5))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _wait_idle(deployment)
    _reuse(deployment, reference_refs, "deadline-8k")


def test_status_reports_load_pins_and_pools(deployment):
    stub = _stub(deployment)
    _collect(stub.Generate(_request("status-1", prompt(700, 5), 2, session="status-session"), timeout=120))
    deadline = time.monotonic() + 30
    while True:  # the next heartbeats carry the pools to the routers; their status reader counts pins every 2 s
        status = stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=10)
        names = {p.name for c in status.clusters for p in c.pools}
        ckpts = sum(p.used for c in status.clusters for p in c.pools if p.name == "prefill.checkpoints")
        if (ckpts and status.pinned_sessions) or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert {f for f in REQUEST_POOLS} | {"prefill.checkpoints", "prefill.cached_pages"} <= names
    assert status.pinned_sessions >= 1 and sum(c.pinned_sessions for c in status.clusters) == status.pinned_sessions
    for c in status.clusters:
        pools = {p.name: p for p in c.pools}
        assert pools["decode.kda_slots"].capacity == 48 and pools["prefill.request_pages"].capacity == 1024
    assert ckpts >= 1  # the 700-token prompt left a KDA checkpoint at 512 in its cluster's prefix cache
    # the same through `k3serve status --json`
    import json

    from typer.testing import CliRunner

    from k3serve.cli.main import app

    res = CliRunner().invoke(app, ["status", "--router", deployment.router_addresses[0], "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["pinned_sessions"] >= 1 and {"inflight_tokens", "pinned_sessions", "pools"} <= out["clusters"][0].keys()
    assert "decode.staging_bytes" in out["clusters"][0]["pools"]


# ------------------------------------------------------------------------------------------------ soak
SOAK_REQUESTS = int(os.environ.get("K3SERVE_SOAK_REQUESTS", "80"))
SOAK_CANCEL = 0.25
RSS_GROWTH_BOUND_MIB = 96  # per process, from warm-up (first 20% of requests) to the end


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def _k3serve_pids(dep) -> dict[str, int]:
    pids = {"driver": os.getpid()}
    for cid, h in dep.clusters.items():
        pids.update({f"{cid}.{k}": v for k, v in ray.get(h.pids.remote(), timeout=30).items()})
    for i, r in enumerate(dep.routers):
        pids[f"router{i}"] = ray.get(r.pid.remote(), timeout=30)
    return pids


def test_soak_with_random_cancels(deployment, reference_refs):
    rng = random.Random(1234)
    # a few distinct (prompt, sampling) cases, so every completed output is checked against a reference
    cases = []
    for i in range(10):
        ids = prompt(rng.randint(20, 600), 900 + i)
        sp = dict(temperature=0.8, top_p=0.9, seed=i) if i % 2 else {}
        cases.append((ids, rng.randint(6, 16), sp))
    params = [SamplingParams(max_tokens=n, ignore_eos=True, **sp) for _, n, sp in cases]
    stub = _stub(deployment)
    pids = _k3serve_pids(deployment)
    rss: dict[str, dict[str, float]] = {}
    warm = max(1, SOAK_REQUESTS // 5)
    # ids: unique during warm-up; then 8 lanes run in parallel, each reusing 5 ids in turn (a cancelled id is
    # sent again soon after), so one id is never in flight twice
    rids = [f"soak-w{i}" if i < warm else f"soak-l{(i - warm) % 8}-{(i - warm) // 8 % 5}"
            for i in range(SOAK_REQUESTS)]
    plan = [(i, rng.randrange(len(cases)), rng.random() < SOAK_CANCEL, rng.uniform(0.0, 1.5))
            for i in range(SOAK_REQUESTS)]
    results: dict[int, tuple[str, list[int]]] = {}

    def one(item) -> None:
        i, case, cancel, after = item
        ids, n, sp = cases[case]
        call = stub.Generate(_request(rids[i], ids, n, session=f"soak-s{i % 17}", **sp), timeout=300)
        if cancel:
            got, ended = _cancel_when(call, False, after)  # a stream that ended before its cancel is "done"
            results[i] = (ended, got)
        else:
            try:
                results[i] = ("done", _collect(call))
            except grpc.RpcError as e:
                results[i] = (f"error: {e.code()} {e.details()}", [])

    t0 = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, plan[:warm]))
        _wait_idle(deployment)
        rss["warm"] = {k: _rss_mib(p) for k, p in pids.items()}
        lanes = [plan[warm + j::8] for j in range(8)]
        list(pool.map(lambda lane: [one(it) for it in lane], lanes))
    took = time.monotonic() - t0
    _wait_idle(deployment)
    rss["end"] = {k: _rss_mib(p) for k, p in pids.items()}
    errored = {i: kind for i, (kind, _) in results.items() if kind.startswith("error")}
    assert not errored, f"{len(errored)} streams failed: {list(errored.items())[:5]}"
    mismatches = []
    for i, (kind, got) in results.items():  # a cancelled stream's tokens are a prefix of the reference's
        try:
            reference_refs.check(cases[plan[i][1]][0], params[plan[i][1]], got, label=f"soak {i} ({kind})",
                                 prefix=kind == "cancelled")
        except AssertionError as e:
            mismatches.append((i, str(e)))
    cancels = sum(1 for kind, _ in results.values() if kind == "cancelled")
    after = SOAK_REQUESTS - warm
    growth = {k: (rss["end"][k] - rss["warm"][k]) * 100 / after for k in pids}
    print(f"soak: {SOAK_REQUESTS} requests ({cancels} cancelled) in {took:.0f} s, mismatches {len(mismatches)}; "
          f"RSS MiB warm->end: " + ", ".join(f"{k} {rss['warm'][k]:.0f}->{rss['end'][k]:.0f} "
                                            f"({growth[k]:+.1f}/100 req)" for k in pids))
    assert len(results) == SOAK_REQUESTS and not mismatches, mismatches[:5]
    over = {k: rss["end"][k] - rss["warm"][k] for k in pids if rss["end"][k] - rss["warm"][k] > RSS_GROWTH_BOUND_MIB}
    assert not over, f"RSS grew more than {RSS_GROWTH_BOUND_MIB} MiB after warm-up: {over}"
