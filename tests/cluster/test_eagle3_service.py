"""EAGLE-3 through the service (issue #13): a 2-cluster deployment of tiny-trained, prefill TP=2 -> decode TP=1,
``clusters.speculative: eagle3`` with the shipped LK drafter; greedy output through a router equals the
single-process reference, drafts are accepted, and a decode-rank kill drill loses no request and changes no token."""

from __future__ import annotations

import dataclasses

import grpc
import pytest

from k3serve.cluster.deploy import SpeculativeSpec, load_deploy
from k3serve.contracts.sampling import SamplingParams
from tests.exactness import References
from k3serve.tokenizer import ByteTokenizer
from k3serve.v1 import router_pb2 as pb
from k3serve.v1 import router_pb2_grpc


@pytest.fixture(scope="module")
def eagle_deployment():
    from k3serve.cluster.deployment import Deployment
    from k3serve.model.eagle3.assets import shipped_drafters

    base = load_deploy("configs/local.yaml")
    spec = SpeculativeSpec(method="eagle3", num_draft_tokens=3, drafter=shipped_drafters("tiny-trained")["eagle3-lk"])
    # no rebuild: the drill checks the failover, not the rejoin (test_failover_drills covers that), ~2 min less
    clusters = dataclasses.replace(base.clusters, count=2, prefill_tp=2, decode_tp=1, speculative=spec, rebuild=False)
    dep = Deployment(dataclasses.replace(base, clusters=clusters, routers=1)).start()
    yield dep
    dep.stop()


def test_eagle3_greedy_through_the_service_equals_reference(eagle_deployment):
    from k3serve.model.loader import load_model

    model = load_model(eagle_deployment.checkpoint)
    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(eagle_deployment.router_addresses[0]))
    prompt = ByteTokenizer().encode("def parse_args(argv):\n    parser = argparse.ArgumentParser()\n    parser.")
    sp = pb.SamplingParams(max_tokens=24, ignore_eos=True)
    msgs = list(stub.Generate(pb.GenerateRequest(session_id="eagle", prompt_token_ids=prompt, sampling=sp), timeout=180))
    References(model).check(list(prompt), SamplingParams.from_proto(sp), [t for m in msgs for t in m.token_ids])
    u = msgs[-1].usage
    assert u.verify_steps > 0 and u.accepted_tokens > 0


def test_decode_rank_kill_drill_with_eagle3(eagle_deployment):
    from k3serve.cluster.drill import Fault, run_drill

    out = run_drill(eagle_deployment, Fault("decode", "c0"), at_s=2.0, sessions=6, turns=2, max_tokens=16, seed=5)
    assert out["failed"] == 0 and out["mismatches"] == 0 and out["completed"] == out["requests"]
