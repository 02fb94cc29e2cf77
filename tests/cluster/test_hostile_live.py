"""Issue 44 live, on a real 2-cluster deployment (Ray, redis-server, the trained tiny model): one request's
parameters never break a cluster. The issue's case (temperatures 1e-40 .. 1e-45 beside greedy requests) and a
sampling-parameter fuzz of 500 requests over the proto's whole value ranges, mixed with normal traffic: each ends
with its tokens or a client error, the normal requests equal the single-process reference, no request is failed
over and no cluster is rebuilt or marked suspect. Also: ids matched whole and scoped by tenant, status without
internal endpoints. The deployment runs with internal TLS on (`internal_tls: true`): every request here crosses
router -> front and prefill -> decode over mutual TLS, and a client without the deployment's certificate is
refused at a front."""

from __future__ import annotations

import dataclasses
import math
import random
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import pytest
import ray

from k3serve.cluster.deploy import load_deploy
from k3serve.contracts.sampling import MAX_STOP_TOKEN_IDS, MAX_TOKENS_LIMIT, SamplingParams
from k3serve.tokenizer import BYTE_VOCAB_SIZE
from k3serve.v1 import router_pb2 as pb
from k3serve.v1 import router_pb2_grpc
from tests.cluster.live_clients import prompt
from tests.exactness import References

KEYS = ("key-a", "key-b")
VOCAB = BYTE_VOCAB_SIZE  # the tiny preset's: 256 bytes + BOS/EOS/PAD
F32_MAX = struct.unpack("<f", struct.pack("<I", 0x7F7FFFFF))[0]
F32_DENORM_MIN = struct.unpack("<f", struct.pack("<I", 1))[0]
CLIENT_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}


@pytest.fixture(scope="module")
def deployment():
    from k3serve.cluster.deployment import Deployment

    base = load_deploy("configs/local.yaml")
    clusters = dataclasses.replace(base.clusters, count=2, prefill_tp=1, decode_tp=1)
    dep = Deployment(dataclasses.replace(base, clusters=clusters, routers=1, api_keys=KEYS,
                                         internal_tls=True)).start()
    yield dep
    dep.stop()


@pytest.fixture(scope="module")
def refs(deployment):
    from k3serve.model.loader import load_model

    return References(load_model(deployment.checkpoint))


@pytest.fixture(scope="module")
def stub(deployment):
    return router_pb2_grpc.RouterStub(grpc.insecure_channel(deployment.router_addresses[0]))


@dataclass
class Outcome:
    tokens: list[int]
    finish_reason: str = ""
    code: grpc.StatusCode | None = None
    details: str = ""


def _call(stub, req: pb.GenerateRequest, key: str = KEYS[0]) -> Outcome:
    out = Outcome([])
    try:
        for m in stub.Generate(req, metadata=(("authorization", f"Bearer {key}"),), timeout=300):
            out.tokens += m.token_ids
            out.finish_reason = m.finish_reason or out.finish_reason
    except grpc.RpcError as e:
        out.code, out.details = e.code(), e.details()
    return out


def _f32(x: float) -> float:
    """x as a proto float carries it (round to nearest float32; inf and nan pass)."""
    return struct.unpack("<f", struct.pack("<f", x))[0] if math.isfinite(x) and abs(x) <= F32_MAX else x


def _healthy_and_unharmed(deployment, stub) -> None:
    status = stub.ClusterStatus(pb.ClusterStatusRequest(), metadata=(("authorization", f"Bearer {KEYS[0]}"),))
    assert len(status.clusters) == 2 and all(c.healthy and not c.suspect for c in status.clusters), status
    stats = ray.get([h.stats.remote() for h in deployment.clusters.values()], timeout=60)
    assert [s["rebuilds"] for s in stats] == [0, 0] and not deployment.restarts
    assert ray.get(deployment.routers[0].counters.remote(), timeout=60)["failovers"] == 0


def test_tiny_temperatures_beside_greedy_requests_break_nothing(deployment, stub, refs):
    """The issue's live case: on main all ten ended UNAVAILABLE and two of three clusters went down."""
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    reqs = [pb.GenerateRequest(session_id=f"tiny-{i}", prompt_token_ids=prompt(10 + i, 900 + i),
                               sampling=pb.SamplingParams(temperature=t, seed=5, max_tokens=6, ignore_eos=True))
            for i, t in enumerate((1e-40, 1e-38, 1e-30, 1e-45))]
    reqs += [pb.GenerateRequest(session_id=f"greedy-{i}", prompt_token_ids=prompt(12 + i, 950 + i),
                                sampling=greedy.to_proto()) for i in range(6)]
    with ThreadPoolExecutor(len(reqs)) as pool:
        outs = list(pool.map(lambda r: _call(stub, r), reqs))
    for r, o in zip(reqs, outs):
        assert o.code is None and o.finish_reason == "length", (r.session_id, o)
        refs.check(list(r.prompt_token_ids), greedy, o.tokens, label=r.session_id)  # a tiny temperature is greedy
    _healthy_and_unharmed(deployment, stub)


def _fuzz_sampling(rng: random.Random) -> pb.SamplingParams:
    """Each field from its valid extremes, or (1 in 6) from values the rule refuses: about half the requests
    are valid."""
    def pick(valid, hostile):
        return rng.choice(hostile if rng.random() < 1 / 6 else valid)

    temps = [0.0, -0.0, F32_DENORM_MIN, 1e-40, 1e-38, 1e-30, 1e-6, 1e-5, 2e-5, 0.5, 1.0, 2.0, 1e30, F32_MAX,
             rng.uniform(0, 3)]
    top_ps = [0.0, -0.0, F32_DENORM_MIN, 1e-40, 1e-30, 1e-6, 0.5, 0.999999, 1.0, rng.uniform(0, 1)]
    bad_floats = [float("inf"), float("-inf"), float("nan"), -F32_DENORM_MIN, -1.0, -F32_MAX]
    top_ks = [0, 1, 2, 5, VOCAB - 1, VOCAB, VOCAB + 1, 2 ** 31 - 1]
    seeds = [0, 1, 2 ** 63, 2 ** 64 - 1, rng.getrandbits(64)]
    stops = [[], [rng.randrange(VOCAB)], [VOCAB - 1, 0], [rng.randrange(VOCAB) for _ in range(MAX_STOP_TOKEN_IDS)]]
    bad_stops = [[VOCAB], [2 ** 32 - 1], [rng.randrange(VOCAB) for _ in range(MAX_STOP_TOKEN_IDS + 1)]]
    return pb.SamplingParams(temperature=_f32(pick(temps, bad_floats)),
                             top_p=_f32(pick(top_ps, bad_floats + [_f32(1.0 + 2 ** -23), 2.0, 1e30])),
                             top_k=pick(top_ks, [-1, -(2 ** 31)]), seed=rng.choice(seeds),
                             max_tokens=pick([1, 2, 3, 4], [0, MAX_TOKENS_LIMIT, 2 ** 32 - 1]),
                             stop_token_ids=pick(stops, bad_stops), ignore_eos=rng.random() < 0.5)


def _invalid(sp: pb.SamplingParams, prompt_len: int, context: int) -> bool:
    """The validation rule as router/validate.py states it (the fuzz checks the service against it)."""
    top_p = sp.top_p if sp.top_p != 0 else 1.0
    return (not math.isfinite(sp.temperature) or sp.temperature < 0 or not (0.0 < top_p <= 1.0)
            or sp.top_k < 0 or sp.max_tokens == 0 or sp.max_tokens > min(MAX_TOKENS_LIMIT, context - prompt_len)
            or len(sp.stop_token_ids) > MAX_STOP_TOKEN_IDS or any(t >= VOCAB for t in sp.stop_token_ids))


def test_sampling_parameter_fuzz_mixed_with_normal_traffic(deployment, stub, refs):
    rng = random.Random(44)
    context = refs.model.cfg.max_position_embeddings
    assert refs.model.cfg.vocab_size == VOCAB
    fuzz = []
    for i in range(500):
        ids = [rng.randrange(256) for _ in range(rng.randint(3, 10))]
        fuzz.append(pb.GenerateRequest(session_id=f"fuzz-{i}", prompt_token_ids=ids,
                                       sampling=_fuzz_sampling(rng)))
    normal = [(f"normal-{i}", prompt(8 + i % 5, 1000 + i),
               SamplingParams(temperature=0.0 if i % 2 else 0.8, top_p=0.9, seed=i, max_tokens=4, ignore_eos=True))
              for i in range(40)]
    work = [(r, KEYS[i % 2]) for i, r in enumerate(fuzz)]
    for j, (sid, ids, sp) in enumerate(normal):  # spread through the fuzz
        work.insert(j * 13, (pb.GenerateRequest(session_id=sid, prompt_token_ids=ids, sampling=sp.to_proto()),
                             KEYS[j % 2]))
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda w: _call(stub, *w), work))
    by_sid = {w[0].session_id: o for w, o in zip(work, outs)}
    served = refused = 0
    for r in fuzz:
        o, sp = by_sid[r.session_id], r.sampling
        if _invalid(sp, len(r.prompt_token_ids), context):
            assert o.code == grpc.StatusCode.INVALID_ARGUMENT and "sampling." in o.details, (sp, o)
            refused += 1
            continue
        assert o.code is None, (sp, o)  # a valid request ends with its tokens
        assert o.finish_reason in ("length", "stop") and 1 <= len(o.tokens) <= sp.max_tokens, (sp, o)
        if o.finish_reason == "stop":
            eos = refs.model.cfg.eos_token_id
            assert o.tokens[-1] in sp.stop_token_ids or (not sp.ignore_eos and o.tokens[-1] == eos), (sp, o)
        served += 1
    assert served >= 150 and refused >= 150, (served, refused)  # both sides of the rule were exercised
    for sid, ids, sp in normal:
        o = by_sid[sid]
        assert o.code is None, (sid, o)
        refs.check(ids, sp, o.tokens, label=sid)
    _healthy_and_unharmed(deployment, stub)


def test_ids_are_matched_whole_and_scoped_by_tenant(deployment, stub):
    bad = _call(stub, pb.GenerateRequest(request_id="abc\n", prompt_token_ids=[1, 2],
                                         sampling=pb.SamplingParams(max_tokens=2)))
    assert bad.code == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in bad.details  # was INTERNAL
    sp = pb.SamplingParams(max_tokens=24, ignore_eos=True)
    with ThreadPoolExecutor(2) as pool:  # one id, two tenants, at once: neither is ALREADY_EXISTS
        outs = list(pool.map(lambda k: _call(stub, pb.GenerateRequest(request_id="shared-id", prompt_token_ids=
                                                                     prompt(600, 77), sampling=sp), k), KEYS))
    assert [o.code for o in outs] == [None, None] and outs[0].tokens == outs[1].tokens
    status = stub.ClusterStatus(pb.ClusterStatusRequest(), metadata=(("authorization", f"Bearer {KEYS[1]}"),))
    assert all(c.endpoint == "" for c in status.clusters)
    assert not any(ep in str(status) for ep in deployment.cluster_endpoints.values())


def test_a_cluster_front_speaks_mutual_tls_only(deployment, stub):
    """A call signed with the deployment secret (so only TLS can refuse it) reaches a front over TLS with the
    deployment's certificate, and fails the handshake over plain text or with another CA's certificate."""
    from k3serve.auth import AuthConfig, sign
    from k3serve.internal.v1 import cluster_pb2
    from k3serve.tls import generate, open_channel

    d = deployment.deploy
    assert d.tls is not None
    auth, q = AuthConfig(d.secret, peer="router"), cluster_pb2.ClusterStatusQuery()
    method = "/k3serve.internal.v1.Cluster/Status"
    for cid, endpoint in deployment.cluster_endpoints.items():
        for name, channel in (("plain text", grpc.insecure_channel(endpoint)),
                              ("another CA", open_channel(endpoint, generate())),
                              ("this CA", open_channel(endpoint, d.tls))):
            with channel as ch:
                status = ch.unary_unary(method, cluster_pb2.ClusterStatusQuery.SerializeToString,
                                        cluster_pb2.ClusterState.FromString)
                if name == "this CA":
                    assert status(q, timeout=10, metadata=sign(auth, method, "", q)).cluster_id == cid
                    continue
                with pytest.raises(grpc.RpcError) as e:
                    status(q, timeout=10, metadata=sign(auth, method, "", q))
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE, (cid, name, e.value.details())
    _healthy_and_unharmed(deployment, stub)
