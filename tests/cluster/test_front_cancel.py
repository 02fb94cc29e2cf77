"""The cluster front without Ray: a call that ends before its first token (cancel, deadline) leaves nothing
behind (running count, pools, handler thread) and its request id can be sent again at once."""

from __future__ import annotations

import time

import grpc
import pytest

from tests.cluster.live_clients import prompt
from k3serve.auth import AuthConfig, sign
from k3serve.cluster.front import ClusterFront
from k3serve.contracts.sampling import SamplingParams
from k3serve.disagg.pipeline import LocalPipeline
from k3serve.internal.v1 import cluster_pb2, cluster_pb2_grpc
from k3serve.v1 import router_pb2 as pb

SECRET = "front-cancel-test-secret-0123456789"
METHOD = "/k3serve.internal.v1.Cluster/Generate"
REQUEST_POOLS = ("prefill.kda_slots", "prefill.request_pages", "decode.kda_slots", "decode.mla_pages",
                 "decode.waiting")


@pytest.fixture(scope="module")
def front(tiny_ckpt):
    with LocalPipeline(tiny_ckpt) as pipe:
        f = ClusterFront("t0", pipe.loop, SECRET, 1, 1)
        endpoint = f.start()
        yield f, cluster_pb2_grpc.ClusterStub(grpc.insecure_channel(endpoint))
        f.stop(0.5)


def _call(stub, rid: str, ids: list[int], max_tokens: int, timeout: float | None = None):
    req = cluster_pb2.ClusterGenerateRequest(request=pb.GenerateRequest(
        request_id=rid, prompt_token_ids=ids, sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
    return stub.Generate(req, metadata=sign(AuthConfig(SECRET, peer="router"), METHOD, rid, req), timeout=timeout)


def _wait_idle(f: ClusterFront, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        load, pools = f.load, f.pools()
        busy = {k: v for k, v in load.items() if k in ("running_requests", "inflight_tokens") and v}
        busy.update({n: pools[n].used for n in REQUEST_POOLS if n in pools and pools[n].used})
        if not busy and all(n in pools for n in REQUEST_POOLS):
            return
        time.sleep(0.05)
    raise AssertionError(f"front still busy: {busy}")


@pytest.mark.parametrize("how", ["cancel", "deadline"])
def test_call_ended_before_first_token_leaves_nothing(front, tiny_refs, how):
    f, stub = front
    rid = f"early-{how}"
    got: list[int] = []  # filled as messages arrive, so what streamed before the error is kept
    if how == "cancel":
        call = _call(stub, rid, prompt(3000, 7), 8)
        time.sleep(0.3)
        call.cancel()
        with pytest.raises(grpc.RpcError) as err:
            for m in call:
                got += m.token_ids
        assert err.value.code() == grpc.StatusCode.CANCELLED
    else:
        with pytest.raises(grpc.RpcError) as err:
            for m in _call(stub, rid, prompt(3000, 8), 8, timeout=0.5):
                got += m.token_ids
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert got == []
    _wait_idle(f)
    assert f.metrics["cancelled"] >= 1
    ids = prompt(20, 9)
    again = [t for m in _call(stub, rid, ids, 4, timeout=120) for t in m.token_ids]  # no ALREADY_EXISTS
    tiny_refs.check(ids, SamplingParams(max_tokens=4, ignore_eos=True), again, label=rid)  # tests/exactness.py
    _wait_idle(f)


def test_same_id_twice_at_once_is_already_exists(front):
    f, stub = front
    first = _call(stub, "twice", prompt(2000, 10), 4)
    time.sleep(0.2)
    with pytest.raises(grpc.RpcError) as err:
        list(_call(stub, "twice", [1, 2, 3], 2, timeout=30))
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert len([t for m in first for t in m.token_ids]) == 4
    _wait_idle(f)


def test_the_warm_up_runs_one_request_through_the_pipeline_and_leaves_nothing(front):
    """ClusterFront.warm_up (run before a cluster registers): one short request through prefill, transfer and
    decode; afterwards every pool is as before (nothing cached, nothing held) and no client request is counted."""
    f, stub = front
    _wait_idle(f)
    used = {n: p.used for n, p in f.pools().items()}
    counted = {k: v for k, v in f.metrics.items() if k in ("requests", "completed", "cancelled", "failed")}
    assert f.warm_up(timeout_s=60) > 0
    _wait_idle(f)
    assert {n: p.used for n, p in f.pools().items()} == used
    assert {k: v for k, v in f.metrics.items() if k in counted} == counted
    # the front serves as before
    assert sum(len(m.token_ids) for m in _call(stub, "after-warm-up", prompt(64, 3), 4)) == 4


def test_a_warm_up_past_its_time_is_an_error_and_is_cancelled(front):
    """A warm-up that does not finish in time means the cluster is not fit to serve: RuntimeError, and its
    request is cancelled in the engine (nothing left behind)."""
    f, _ = front
    with pytest.raises(RuntimeError, match="warm-up request ran past"):
        f.warm_up(timeout_s=0.0)
    _wait_idle(f)
