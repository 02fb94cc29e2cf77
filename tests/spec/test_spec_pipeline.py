"""Speculative decoding through the local disaggregated pipeline gives exactly the reference's tokens
(issue #12 acceptance 2): greedy and seeded, k in {1, 3, 7}, (P, D) in {(1,1), (2,1), (1,2)}, the n-gram
drafter and a scripted drafter (long accepted runs + rejections at every depth), speculative and plain
requests in one continuous batch; pools are back to zero afterwards."""

from __future__ import annotations

import dataclasses

import pytest

from k3serve.contracts.requests import PrefillRequest
from k3serve.contracts.sampling import SamplingParams
from k3serve.disagg.pipeline import LocalPipeline
from k3serve.engine.spec.config import SpecConfig
from k3serve.engine.spec.ngram import NgramConfig

from tests.spec.drafters import ScriptedDrafter, spec_prompt

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_k=40, seed=5, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def cases(tiny_refs):
    out = []
    for i, (n, rep) in enumerate([(7, True), (40, False), (90, True)]):
        prompt = spec_prompt(n, 300 + i, rep)
        # each prompt samples with its own seed (5, 6, 7): three sampling seeds, like tests/exactness.py's SEEDS
        for name, params in (("greedy", GREEDY), ("seeded", dataclasses.replace(SEEDED, seed=SEEDED.seed + i))):
            out.append((f"{name}-{i}", prompt, params, tiny_refs.trace(list(prompt), params).token_ids))
    return out


def _check(pipe, cases, refs):
    """Each case's served tokens against the reference (tests/exactness.py: equal, or an explained near-tie)."""
    outs = pipe.generate([PrefillRequest(rid, prompt, params) for rid, prompt, params, _ in cases])
    for rid, prompt, params, _ in cases:
        assert outs[rid].error is None, outs[rid].error
        refs.check(list(prompt), params, outs[rid].token_ids, label=rid)
    assert pipe.decode.slots.num_used == 0 and pipe.decode.pages.num_used == 0
    return outs


# every k in one process; every (P, D) of the issue with a window of several drafts. The two drafter tests split the
# TP points' k between them, so each (P, D) verifies both k = 3 and k = 7 (the k x TP product repeated the
# resharding path: k changes only the window, which the in-process points cover)
PDK = [(1, 1, 1), (1, 1, 3), (1, 1, 7), (2, 1, 7), (1, 2, 3)]
PDK_NGRAM = [(1, 1, 1), (1, 1, 3), (1, 1, 7), (2, 1, 3), (1, 2, 7)]


@pytest.mark.parametrize("p,d,k", PDK)
def test_scripted_drafts_equal_reference(tiny_ckpt, tiny_refs, cases, p, d, k):
    scripts = {prompt: want[1:] for _, prompt, _, want in cases}  # want[0] comes from prefill
    drafter = ScriptedDrafter(scripts, wrong_every=4)
    with LocalPipeline(tiny_ckpt, prefill_tp=p, decode_tp=d, speculative=SpecConfig(num_draft_tokens=k),
                       drafter=drafter) as pipe:
        outs = _check(pipe, cases, tiny_refs)
        usage = pipe.decode.spec_usage
    assert usage.verify_steps > 0 and 0 < usage.accepted_tokens < usage.drafted_tokens
    assert sum(o.verify_steps for o in outs.values()) == usage.verify_steps
    # every outcome handed to a session starts where the previous one ended
    for s in drafter.sessions:
        for a, b in zip(s.observed, s.observed[1:]):
            assert b.start_position == a.start_position + len(a.committed)


@pytest.mark.parametrize("p,d,k", PDK_NGRAM)
def test_ngram_equals_reference(tiny_ckpt, tiny_refs, cases, p, d, k):
    # min_n = 1: the random tiny model rarely repeats a 2-gram of its prompt; single-token matches still draft
    spec = SpecConfig(num_draft_tokens=k, ngram=NgramConfig(min_n=1, max_n=3))
    with LocalPipeline(tiny_ckpt, prefill_tp=p, decode_tp=d, speculative=spec) as pipe:
        _check(pipe, cases, tiny_refs)
        assert pipe.decode.spec_usage.verify_steps > 0


def test_per_class_switch_mixes_plain_and_speculative(tiny_ckpt, tiny_refs, cases):
    """Prompts of <= 40 uncached tokens decode plainly, longer ones speculatively, in one batch."""
    spec = SpecConfig(num_draft_tokens=3, classes=((40, False), (1 << 30, True)))
    scripts = {prompt: want[1:] for _, prompt, _, want in cases}
    with LocalPipeline(tiny_ckpt, speculative=spec, drafter=ScriptedDrafter(scripts, wrong_every=0)) as pipe:
        outs = _check(pipe, cases, tiny_refs)
    for rid, prompt, _, _ in cases:
        assert (outs[rid].verify_steps > 0) == (len(prompt) > 40), rid


def test_a_stop_token_inside_accepted_drafts_ends_the_request_there(tiny_ckpt, tiny_refs, cases):
    _, prompt, _, want = cases[0]
    stop = SamplingParams(max_tokens=10, stop_token_ids=(want[4],), ignore_eos=True)
    drafter = ScriptedDrafter({prompt: want[1:]}, wrong_every=0)  # all drafts right: the stop is mid-window
    with LocalPipeline(tiny_ckpt, speculative=SpecConfig(num_draft_tokens=7), drafter=drafter) as pipe:
        out = pipe.generate([PrefillRequest("stop", prompt, stop)])["stop"]
        assert pipe.decode.slots.num_used == 0 and pipe.decode.pages.num_used == 0
    tiny_refs.check(list(prompt), stop, out.token_ids, label="stop")  # the reference ends at the first want[4]
    assert out.finish_reason == "stop"


def test_draft_limit_keeps_the_budget_and_the_context():
    from k3serve.decode.speculative import draft_limit

    assert draft_limit(new=3, max_tokens=10, position=50, max_positions=4096, k=7) == 6  # 6 + 1 = 7 left
    assert draft_limit(new=9, max_tokens=10, position=50, max_positions=4096, k=7) == 0
    assert draft_limit(new=1, max_tokens=99, position=90, max_positions=95, k=7) == 3  # last position 94
    # replaying after a failover: 5 replayed tokens still to feed and 2 new ones allowed, so 6 drafts + 1 emit
    # at most 7 tokens (5 replayed, 2 new)
    assert draft_limit(new=-5, max_tokens=2, position=50, max_positions=4096, k=7) == 6


def test_a_resumed_request_speculates_on_its_new_tokens(tiny_ckpt, tiny_refs):
    """After a failover (prompt + the 8 tokens already streamed, replayed by decode, max_tokens cut to the 4 left)
    the draft budget counts new tokens only: the replay does not use up max_tokens, so speculation stays on."""
    prompt = spec_prompt(40, 320, False)
    n, k = 12, 8
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    want = tiny_refs.trace(list(prompt), params).token_ids
    drafter = ScriptedDrafter({prompt: want[1:]}, wrong_every=0)
    req = PrefillRequest("resumed", prompt, params.with_max_tokens(n - k), replay_ids=tuple(want[:k]))
    with LocalPipeline(tiny_ckpt, speculative=SpecConfig(num_draft_tokens=3), drafter=drafter) as pipe:
        out = pipe.generate([req])["resumed"]
        assert pipe.decode.slots.num_used == 0 and pipe.decode.pages.num_used == 0
    assert out.error is None
    tiny_refs.check(list(prompt), params, list(want[:k]) + out.token_ids, label="resumed")
    # 11 tokens after the first (7 replayed, 4 new) in windows of 3 drafts + 1: 3 + 3 + 2 drafts (it was 2)
    assert out.drafted_tokens == 8 and out.verify_steps == 3, out
