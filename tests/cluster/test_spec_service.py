"""Speculative decoding through the service (issue #12 acceptance 2): a 2-cluster deployment of the trained
tiny preset with ``clusters.speculative: ngram, k=3``; greedy and seeded outputs through a router equal the
single-process reference, usage and status report the drafts, and a cluster-kill drill loses no request and changes no
token (the survivor resumes with the same (seed, position) keyed sampling)."""

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
def spec_deployment():
    from k3serve.cluster.deployment import Deployment

    base = load_deploy("configs/local.yaml")
    # no rebuild: the drill checks the failover, not the rejoin (test_failover_drills.py covers that)
    clusters = dataclasses.replace(base.clusters, count=2, prefill_tp=1, decode_tp=1, rebuild=False,
                                   speculative=SpeculativeSpec(method="ngram", num_draft_tokens=3))
    dep = Deployment(dataclasses.replace(base, clusters=clusters, routers=1)).start()
    yield dep
    dep.stop()


def test_speculative_outputs_equal_reference_and_status_counts_drafts(spec_deployment):
    from k3serve.model.loader import load_model

    refs = References(load_model(spec_deployment.checkpoint))
    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(spec_deployment.router_addresses[0]))
    prompt = ByteTokenizer().encode("def parse_args(argv):\n    parser = argparse.ArgumentParser()\n    parser.")
    for i, sp in enumerate([pb.SamplingParams(max_tokens=24, ignore_eos=True),
                            pb.SamplingParams(temperature=0.7, top_p=0.9, seed=2, max_tokens=24, ignore_eos=True)]):
        msgs = list(stub.Generate(pb.GenerateRequest(session_id=f"spec-{i}", prompt_token_ids=prompt, sampling=sp),
                                  timeout=120))
        tokens = [t for m in msgs for t in m.token_ids]
        refs.check(list(prompt), SamplingParams.from_proto(sp), tokens, label=f"spec-{i}")
        u = msgs[-1].usage  # usage reports the drafts
        assert u.verify_steps > 0 and u.drafted_tokens >= u.accepted_tokens and u.drafted_tokens >= u.verify_steps
    status = stub.ClusterStatus(pb.ClusterStatusRequest())
    accepted = [p for c in status.clusters for p in c.pools if p.name == "decode.spec_accepted"]
    assert accepted and sum(p.capacity for p in accepted) > 0  # drafts were verified on the serving cluster


def test_cluster_kill_drill_with_speculative_decoding(spec_deployment):
    from k3serve.cluster.drill import Fault, run_drill

    # 12 sessions of 32 tokens: on a quiet machine 8 x 16 had all finished on c0 by the fault (drafts are fast)
    out = run_drill(spec_deployment, Fault("cluster", "c0"), at_s=2.0, sessions=12, turns=2, max_tokens=32, seed=4)
    assert out["failed"] == 0 and out["mismatches"] == 0 and out["completed"] == out["requests"]
    assert out["in_flight_at_fault"] > 0 and out["failed_over"] > 0
