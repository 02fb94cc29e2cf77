"""The live service's exactness check can fail: requests through the routers of the package's deployment, each
served with one mutation of the served path (k3serve/engine/mutation.py, per request), must be refused by
tests/exactness.py, while the same requests without a mutation pass.

The requests ask for logprobs (SamplingParams.logprobs) and the check compares them with the reference's: a state
mutation (a 1e-3 KDA scale, a replayed 512-token block, a zeroed first MLA page) does not always move a token of
a short request, but it moves the served log-probabilities past the tolerance (tests/exactness.LOGPROB_ATOL)."""

from __future__ import annotations

import grpc
import pytest
import torch

from k3serve.contracts.sampling import SamplingParams
from k3serve.engine import mutation
from k3serve.v1 import router_pb2 as pb
from k3serve.v1 import router_pb2_grpc
from tests.exactness import SEEDS

GREEDY = pb.SamplingParams(max_tokens=8, ignore_eos=True, logprobs=True)
SEEDED = pb.SamplingParams(temperature=0.8, top_k=40, max_tokens=8, ignore_eos=True, logprobs=True)
SAMPLED = pb.SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, logprobs=True)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _generate(stub, rid: str, session: str, prompt: list[int], sp, salt: str
              ) -> tuple[list[int], list[float], pb.GenerateResponse]:
    msgs = list(stub.Generate(pb.GenerateRequest(request_id=rid, session_id=session, prompt_token_ids=prompt,
                                                 sampling=sp, cache_salt=salt), timeout=120))
    tokens, logprobs = [t for m in msgs for t in m.token_ids], [x for m in msgs for x in m.logprobs]
    assert len(logprobs) == len(tokens), f"{rid}: {len(logprobs)} logprobs for {len(tokens)} tokens"
    return tokens, logprobs, msgs[-1]


def _check(refs, prompt: list[int], sp, served: tuple[list[int], list[float]], label: str,
           refused: list[str]) -> None:
    try:
        refs.check(prompt, SamplingParams.from_proto(sp), served[0], label=label, got_logprobs=served[1])
    except AssertionError as e:
        assert "no run with at most" in str(e), e  # refused by the exactness rule, not another assertion
        refused.append(label)


def _conversation(stub, refs, tag: str, seed: int) -> list[str]:
    """A short sampled request (its whole context in the first MLA page), then two turns of one session (the
    second resumes from the first's 1024-token checkpoint), greedy then seeded. Returns the labels of the
    requests tests/exactness.py refused. Each tag has its own cache salt: prefix_early rewrites the MLA pages of
    the block it replays, which are the prefix cache's, so its entries must not serve another tag's prompts."""
    refused: list[str] = []
    short = _ids(48, 17 + 1000 * seed)
    label = f"live-{tag}-{seed}-short"
    sp = pb.SamplingParams()
    sp.CopyFrom(SAMPLED)
    sp.seed = 23 + seed
    tokens, logprobs, _ = _generate(stub, label, label, short, sp, tag)
    _check(refs, short, sp, (tokens, logprobs), label, refused)
    history = _ids(1100, 31 + 1000 * seed)
    sp = pb.SamplingParams()
    for turn, base in enumerate((GREEDY, SEEDED)):
        sp.CopyFrom(base)
        if turn:
            sp.seed = 11 + seed
        label = f"live-{tag}-{seed}-t{turn}"
        tokens, logprobs, last = _generate(stub, label, f"live-{tag}-{seed}", history, sp, tag)
        _check(refs, history, sp, (tokens, logprobs), label, refused)
        if turn:  # prefix_early resumes one 512-token block before the checkpoint, by design
            early = 512 if tag == mutation.marker("prefix_early") else 0
            assert last.usage.cached_tokens >= 1024 - early, "the second turn must resume from the first's checkpoint"
        history = history + tokens + _ids(30, 7 + turn + 1000 * seed)
    return refused


@pytest.fixture(scope="module")
def stub(deployment):
    return router_pb2_grpc.RouterStub(grpc.insecure_channel(deployment.router_addresses[0]))


ALL = ("short", "t0", "t1")
MUST_REFUSE = {"wrong_token": ALL, "kda_scale": ALL, "drop_mla_page": ALL,  # the requests each mutation must fail
               "prefix_early": ("t1",)}  # only the second turn resumes from a prefix hit


@pytest.mark.parametrize("kind", mutation.KINDS)
def test_the_service_check_refuses_every_mutated_request(stub, reference_refs, kind):
    tag = mutation.marker(kind)
    for seed in SEEDS:
        refused = _conversation(stub, reference_refs, tag, seed)
        missed = [r for r in MUST_REFUSE[kind] if f"live-{tag}-{seed}-{r}" not in refused]
        assert not missed, f"{kind}, seed {seed}: passed the exactness check: {missed} (refused {refused})"


def test_the_same_conversations_pass_without_a_mutation(stub, reference_refs):
    for seed in SEEDS:
        assert _conversation(stub, reference_refs, "plain", seed) == []
