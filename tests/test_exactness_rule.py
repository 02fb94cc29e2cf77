"""tests/exactness.py refuses what a served run must not do, and excuses only the near-ties it did take."""

from __future__ import annotations

import pytest
import torch

from k3serve.contracts.sampling import SamplingParams
from tests import exactness
from tests.exactness import SEEDS, ExcuseTally, Flip, compare, random_prompt, reference_trace

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_k=40, seed=7, max_tokens=6, ignore_eos=True)


def _refused(ref, got, logits=None, prefix=False) -> bool:
    try:
        compare(ref, got, logits, prefix=prefix)
    except AssertionError:
        return True
    return False


@pytest.fixture(scope="module", params=SEEDS)
def ref(request, tiny_model):
    """300-token prompts: each holds router margins below the former 1e-4 excuse (checked in the test)."""
    params = GREEDY if request.param != 1 else SEEDED
    return reference_trace(tiny_model, random_prompt(300, 40 + request.param), params)


def test_the_reference_run_is_exact_and_its_prefix_too(ref):
    assert compare(ref, list(ref.token_ids), list(ref.logits)).exact
    assert compare(ref, list(ref.token_ids[:3]), prefix=True).exact
    assert _refused(ref, list(ref.token_ids[:3]))  # not a prefix check: the length counts


def test_wrong_streams_fail_where_the_former_rule_excused_them(ref):
    assert float(ref.router_margin.min()) < 1e-4  # the former rule excused every divergence here
    vocab = ref.logits[0].numel()
    want = list(ref.token_ids)
    assert _refused(ref, [(t + 1) % vocab for t in want])
    for d in range(len(want)):  # one wrong token at any step: the likeliest other token there
        other = next(t for t in ref.logits[d].argsort(descending=True).tolist() if t != want[d])
        assert _refused(ref, want[:d] + [other] + want[d + 1:]), d
    assert _refused(ref, want + [want[-1]]) and _refused(ref, want[:-1])


def test_served_logits_are_compared_within_the_atol(ref):
    logits = [x.clone() for x in ref.logits]
    logits[2][5] += exactness.LOGIT_ATOL / 20
    assert compare(ref, list(ref.token_ids), logits).exact
    logits[2][5] += 2 * exactness.LOGIT_ATOL
    assert _refused(ref, list(ref.token_ids), logits)


@pytest.fixture(scope="module")
def short(tiny_model):
    """A short greedy run: counterfactual re-runs are cheap."""
    return reference_trace(tiny_model, random_prompt(48, 5), SamplingParams(max_tokens=5, ignore_eos=True))


def _changing_flip(ref) -> tuple[Flip, float]:
    """The closest router choice (so that an eps just above its margin admits few others) whose other side moves
    the logits past the atol."""
    margins = ref.router_margins
    for idx in margins.flatten().argsort()[:3].tolist():
        li, p = divmod(idx, margins.shape[1])
        flip = Flip(p, ref.moe_layers[li])
        cf = ref.counterfactual(flip)
        if max(float((a - b).abs().max()) for a, b in zip(cf.logits, ref.logits)) > exactness.LOGIT_ATOL:
            return flip, float(margins[li, p])
    pytest.fail("none of the 3 closest router choices moves the logits")


def test_a_router_near_tie_the_served_run_took_is_excused_and_nothing_else(short, monkeypatch):
    monkeypatch.setattr(exactness, "excuse_tally", ExcuseTally())  # excuses on purpose: not this test's share
    ref = short
    flip, margin = _changing_flip(ref)
    cf = ref.counterfactual(flip)
    assert _refused(ref, list(cf.token_ids), list(cf.logits))  # margin >= EPS_ROUTER: not a near-tie
    monkeypatch.setattr(exactness, "EPS_ROUTER", margin * 1.01)  # now it is one
    verdict = compare(ref, list(cf.token_ids), list(cf.logits))
    assert not verdict.exact and f"position {flip.position} (layer {flip.layer})" in verdict.explained
    bad = list(cf.token_ids)
    bad[-1] = (bad[-1] + 1) % ref.logits[0].numel()  # the counterfactual's continuation, one token off
    assert _refused(ref, bad, list(cf.logits))
    logits = [x.clone() for x in cf.logits]
    logits[-1] += 1e-3  # the counterfactual's tokens, but not its logits
    assert _refused(ref, list(cf.token_ids), logits)


def test_a_sampler_near_tie_is_excused_only_with_its_continuation(short, monkeypatch):
    monkeypatch.setattr(exactness, "excuse_tally", ExcuseTally())  # excuses on purpose: not this test's share
    ref = short
    n, d = len(ref.prompt), 2
    monkeypatch.setattr(exactness, "EPS_LOGIT", 1e4)  # every token of step d becomes a near-tie
    want = list(ref.token_ids)
    other = next(t for t in ref.logits[d].argsort(descending=True).tolist() if t != want[d])
    cf = ref.counterfactual(Flip(n + d, -1, other))
    assert cf.token_ids[:d] == ref.token_ids[:d] and cf.token_ids[d] == other
    verdict = compare(ref, list(cf.token_ids))
    assert verdict.divergence == d and "sampler near-tie" in verdict.explained
    if list(cf.token_ids[d + 1:]) != want[d + 1:]:
        assert _refused(ref, want[:d] + [other] + want[d + 1:])  # the token without its continuation


def test_more_than_one_in_ten_excused_comparisons_fail_the_test():
    tally = ExcuseTally()
    tally.checked, tally.excused = 10, 1
    tally.check_share()
    tally.checked, tally.excused = 9, 1
    with pytest.raises(AssertionError, match="1 of 9 comparisons needed a near-tie excuse"):
        tally.check_share()


def test_the_counterfactual_loop_is_the_reference_loop(tiny_model):
    """_generate_flipped with nothing forced draws the reference generator's tokens and logits, bit for bit."""
    for params in (GREEDY, SEEDED):
        prompt = random_prompt(40, 3)
        ref = reference_trace(tiny_model, prompt, params)
        with torch.no_grad():
            toks, logits = exactness._generate_flipped(tiny_model, prompt, params, {})
        assert tuple(toks) == ref.token_ids and all(torch.equal(a, b) for a, b in zip(logits, ref.logits))
