"""An MXFP4 checkpoint served by a real deployment (issue #14 acceptance 4): the deploy file names a PTQ of the
shipped tiny-trained model, Ray runs the cluster actor, its prefill TP=2 and decode TP=2 rank actors and a
router; greedy and seeded outputs through the router equal the single-process reference on the same MXFP4
weights (compared through tests/exactness.py). Few, short requests keep it cheap.
"""

from __future__ import annotations

import dataclasses

import grpc
import pytest

from k3serve.cluster.deploy import ModelSpec, load_deploy
from k3serve.contracts.sampling import SamplingParams
from k3serve.v1 import router_pb2 as pb
from k3serve.v1 import router_pb2_grpc
from tests.exactness import SEEDS, References, random_prompt


@pytest.fixture(scope="module")
def mxfp4_ckpt(tiny_trained_mxfp4_ckpt):
    return tiny_trained_mxfp4_ckpt


@pytest.fixture(scope="module")
def mxfp4_refs(mxfp4_ckpt):
    from k3serve.model.loader import load_model

    model = load_model(mxfp4_ckpt)
    assert type(model.layers[1].ffn.experts[0][0]).__name__ == "MXFP4Linear"  # the reference reads packed experts
    return References(model)


@pytest.fixture(scope="module")
def mxfp4_deployment(mxfp4_ckpt):
    """A running 1-cluster deployment of the MXFP4 checkpoint, prefill TP=2 -> decode TP=2, one router. Decode
    TP=1 of this checkpoint is the engine's (tests/engine/test_mxfp4_serving.py) and, through the service, the
    same path as the shared deployment's (its format is read by the same loader in every rank actor)."""
    from k3serve.cluster.deployment import Deployment

    base = load_deploy("configs/local.yaml")
    clusters = dataclasses.replace(base.clusters, count=1, prefill_tp=2, decode_tp=2)
    dep = Deployment(dataclasses.replace(base, model=ModelSpec(checkpoint=mxfp4_ckpt), clusters=clusters,
                                         routers=1)).start()
    yield dep
    dep.stop()


def test_mxfp4_service_equals_reference(mxfp4_deployment, mxfp4_refs):
    import ray

    dep = mxfp4_deployment
    ranks = ray.get(dep.clusters["c0"].rank_actors.remote())
    assert (len(ranks["prefill"]), len(ranks["decode"])) == (2, dep.deploy.clusters.decode_tp)
    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(dep.router_addresses[0]))
    cases = []
    for s in SEEDS:
        cases += [(random_prompt(40, 11 + 1000 * s), pb.SamplingParams(max_tokens=8, ignore_eos=True), f"mx-g{s}"),
                  (random_prompt(24, 12 + 1000 * s), pb.SamplingParams(temperature=0.8, top_p=0.95, seed=5 + s,
                                                                       max_tokens=8, ignore_eos=True), f"mx-s{s}")]
    for prompt, sp, session in cases:
        msgs = list(stub.Generate(pb.GenerateRequest(session_id=session, prompt_token_ids=prompt, sampling=sp),
                                  timeout=120))
        tokens = [t for m in msgs for t in m.token_ids]
        mxfp4_refs.check(prompt, SamplingParams.from_proto(sp), tokens, label=session)
        assert msgs[-1].finish_reason == "length" and msgs[-1].usage.completion_tokens == sp.max_tokens
