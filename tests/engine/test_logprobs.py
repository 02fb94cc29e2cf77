"""SamplingParams.logprobs: each streamed token carries its log-probability under the model (log-softmax of the
logits that chose it, before temperature and truncation), on the prefill's first token, plain decode steps and
speculative verify steps; tests/exactness.py compares them with the reference's."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from k3serve.contracts.requests import PrefillRequest
from k3serve.contracts.sampling import SamplingParams
from k3serve.disagg.pipeline import LocalPipeline
from k3serve.engine.spec.config import SpecConfig
from k3serve.engine.spec.ngram import NgramConfig
from tests.exactness import LOGPROB_ATOL, SEEDS, random_prompt
from tests.mutation_families import tap_logits

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=True)
SEEDED = SamplingParams(temperature=0.8, top_k=40, max_tokens=6, ignore_eos=True, logprobs=True)
SPEC = SpecConfig(num_draft_tokens=3, ngram=NgramConfig(min_n=1, max_n=3))


def _cases(seed: int) -> list[tuple[str, list[int], SamplingParams]]:
    return [(f"greedy-{seed}", random_prompt(70, 10 + seed), GREEDY),
            (f"seeded-{seed}", random_prompt(50, 20 + seed), replace(SEEDED, seed=5 + seed)),
            (f"repeat-{seed}", random_prompt(30, 30 + seed) * 3, GREEDY)]  # n-gram drafts find matches


@pytest.mark.parametrize("spec", [None, SPEC], ids=["plain", "ngram"])
def test_served_logprobs_are_the_models_and_match_the_reference(tiny_ckpt, tiny_refs, spec):
    with LocalPipeline(tiny_ckpt, speculative=spec) as pipe:
        rows = tap_logits(pipe)
        cases = [c for seed in SEEDS for c in _cases(seed)]
        outs = pipe.generate([PrefillRequest(rid, tuple(p), sp) for rid, p, sp in cases])
        if spec is not None:
            assert pipe.decode.spec_usage.verify_steps > 0, "no draft was verified"
    for rid, prompt, params in cases:
        out = outs[rid]
        assert out.error is None, out.error
        assert len(out.logprobs) == len(out.token_ids) == params.max_tokens
        want = [float(torch.log_softmax(r, -1)[t]) for r, t in zip(rows[rid], out.token_ids, strict=True)]
        assert out.logprobs == want, rid  # the very logits that chose each token
        tiny_refs.check(prompt, params, out.token_ids, label=rid, got_logprobs=out.logprobs)


def test_no_logprobs_unless_asked(tiny_ckpt):
    with LocalPipeline(tiny_ckpt) as pipe:
        out = pipe.generate([PrefillRequest("plain", tuple(random_prompt(40, 3)), replace(GREEDY, logprobs=False))])
    assert len(out["plain"].token_ids) == GREEDY.max_tokens and out["plain"].logprobs == []


def test_a_logprob_off_by_more_than_the_tolerance_is_refused(tiny_refs):
    prompt = random_prompt(60, 4)
    ref = tiny_refs.trace(prompt, GREEDY)
    lps = [float(torch.log_softmax(row, -1)[t]) for row, t in zip(ref.logits, ref.token_ids)]
    tiny_refs.check(prompt, GREEDY, list(ref.token_ids), got_logprobs=lps)
    for step in (0, len(lps) - 1):
        bad = list(lps)
        bad[step] += 2 * LOGPROB_ATOL
        with pytest.raises(AssertionError, match=f"log-probability of step {step} differs"):
            tiny_refs.check(prompt, GREEDY, list(ref.token_ids), got_logprobs=bad)
