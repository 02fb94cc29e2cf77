"""The live service's exactness check can fail: requests through the routers of the package's deployment, each
served with one mutation of the served path (k3serve/engine/mutation.py, per request), must be refused by
tests/exactness.py, while the same requests without a mutation pass.

The state mutations (kda_scale, prefix_early, drop_mla_page) are the local families' (tests/test_mutations.py),
whose logits tap catches them: the service returns tokens, and on the served model none of them moved the tokens
of these requests every time (a 1e-3 state scale, a replayed 512-token block, a zeroed first MLA page under a
random 48-token prompt sampled at T=1: seen passing in 1 of 3 seeds)."""

from __future__ import annotations

import grpc
import pytest
import torch

from k3serve.contracts.sampling import SamplingParams
from k3serve.engine import mutation
from k3serve.v1 import router_pb2 as pb
from k3serve.v1 import router_pb2_grpc
from tests.exactness import SEEDS

LIVE_KINDS = ("wrong_token",)
GREEDY = pb.SamplingParams(max_tokens=8, ignore_eos=True)
SEEDED = pb.SamplingParams(temperature=0.8, top_k=40, max_tokens=8, ignore_eos=True)
SAMPLED = pb.SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)  # every logit counts in the draw


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _generate(stub, rid: str, session: str, prompt: list[int], sp) -> tuple[list[int], pb.GenerateResponse]:
    msgs = list(stub.Generate(pb.GenerateRequest(request_id=rid, session_id=session, prompt_token_ids=prompt,
                                                 sampling=sp), timeout=120))
    return [t for m in msgs for t in m.token_ids], msgs[-1]


def _check(refs, prompt: list[int], sp, tokens: list[int], label: str, refused: list[str]) -> None:
    try:
        refs.check(prompt, SamplingParams.from_proto(sp), tokens, label=label)
    except AssertionError as e:
        assert "no run with at most" in str(e), e  # refused by the exactness rule, not another assertion
        refused.append(label)


def _conversation(stub, refs, tag: str, seed: int) -> list[str]:
    """A short sampled request (its whole context in the first MLA page), then two turns of one session (the
    second resumes from the first's 1024-token checkpoint), greedy then seeded. Returns the labels of the
    requests tests/exactness.py refused."""
    refused: list[str] = []
    short = _ids(48, 17 + 1000 * seed)
    label = f"live-{tag}-{seed}-short"
    sp = pb.SamplingParams()
    sp.CopyFrom(SAMPLED)
    sp.seed = 23 + seed
    tokens, _ = _generate(stub, label, label, short, sp)
    _check(refs, short, sp, tokens, label, refused)
    history = _ids(1100, 31 + 1000 * seed)
    sp = pb.SamplingParams()
    for turn, base in enumerate((GREEDY, SEEDED)):
        sp.CopyFrom(base)
        if turn:
            sp.seed = 11 + seed
        label = f"live-{tag}-{seed}-t{turn}"
        tokens, last = _generate(stub, label, f"live-{tag}-{seed}", history, sp)
        _check(refs, history, sp, tokens, label, refused)
        if turn:
            assert last.usage.cached_tokens >= 1024, "the second turn must resume from the first's checkpoint"
        history = history + tokens + _ids(30, 7 + turn + 1000 * seed)
    return refused


@pytest.fixture(scope="module")
def stub(deployment):
    return router_pb2_grpc.RouterStub(grpc.insecure_channel(deployment.router_addresses[0]))


MUST_REFUSE = {"wrong_token": ("short", "t0", "t1")}  # the requests each mutation must fail


@pytest.mark.parametrize("kind", LIVE_KINDS)
def test_the_service_check_refuses_every_mutated_request(stub, reference_refs, kind):
    tag = mutation.marker(kind)
    for seed in SEEDS:
        refused = _conversation(stub, reference_refs, tag, seed)
        missed = [r for r in MUST_REFUSE[kind] if f"live-{tag}-{seed}-{r}" not in refused]
        assert not missed, f"{kind}, seed {seed}: passed the exactness check: {missed} (refused {refused})"


def test_the_same_conversations_pass_without_a_mutation(stub, reference_refs):
    for seed in SEEDS:
        assert _conversation(stub, reference_refs, "plain", seed) == []
