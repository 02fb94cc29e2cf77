"""Lossless acceptance (engine/spec/accept.py): greedy = argmax match, one-hot drafts reproduce plain sampling
token for token, and drafts with a distribution q leave the target's distribution intact (chi-square)."""

import pytest
import torch

from k3serve.contracts.sampling import SamplingParams
from k3serve.engine.spec.accept import accept_drafts
from k3serve.model.sampling import sample_token, sampling_probs

# chi-square critical values at false-alarm rate 1e-3 (upper 0.999 quantiles), by degrees of freedom
CHI2_999 = {3: 16.266, 5: 20.515}


def _logits(rows, vocab, seed):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 1.5


def test_greedy_accepts_exactly_the_argmax_prefix():
    logits = _logits(4, 16, 0)
    top = logits.argmax(-1).tolist()
    params = SamplingParams(max_tokens=8)
    assert accept_drafts(logits, top[:3], params, 10).tokens == tuple(top)  # all 3 + bonus
    wrong = (top[1] + 1) % 16
    acc = accept_drafts(logits, [top[0], wrong, top[2]], params, 10)
    assert acc.accepted == 1 and acc.tokens == (top[0], top[1])  # the correction is the argmax


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.9, seed=3),
                                    SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=11)])
def test_one_hot_drafts_emit_plain_sampling_tokens(params):
    """The coupling: every emitted token is the one plain sampling draws at that position (same generator)."""
    for s in range(200):
        p = SamplingParams(params.temperature, params.top_p, params.top_k, seed=s)
        logits = _logits(4, 12, s)
        plain = [sample_token(logits[i], p, 50 + i + 1) for i in range(4)]
        drafts = [plain[0], plain[1] if s % 3 else (plain[1] + 1) % 12, plain[2]]
        acc = accept_drafts(logits, drafts, p, 50)
        assert list(acc.tokens) == plain[: acc.accepted + 1]
        assert acc.accepted == (3 if s % 3 else 1)


@pytest.mark.parametrize("params,dof", [(SamplingParams(temperature=1.0), 5),
                                        (SamplingParams(temperature=0.8, top_k=4), 3)])
def test_drafts_far_from_the_target_keep_its_distribution(params, dof):
    """Over N = 4000 seeds at a fixed position, with drafts x ~ q (q far from p) taken as given (q one-hot on
    each draft, the rule every drafter here uses), the first emitted token is distributed as p: Pearson
    chi-square over p's support against the 0.999 quantile (false alarm 1e-3 per case; the seeds are fixed, so
    the test is deterministic). Tokens outside p's support never appear."""
    vocab, n = 6, 4000
    logits = _logits(2, vocab, 7)
    q = torch.softmax(torch.tensor([2.0, -1.0, 0.5, 0.0, 1.5, -0.5]), -1)
    p_target = sampling_probs(logits[0], params)
    counts = torch.zeros(vocab)
    accepted = 0
    for s in range(n):
        draft = int(torch.multinomial(q, 1, generator=torch.Generator().manual_seed(1_000_000 + s)))
        pr = SamplingParams(params.temperature, params.top_p, params.top_k, seed=s)
        acc = accept_drafts(logits, [draft], pr, 100)
        counts[acc.tokens[0]] += 1
        accepted += acc.accepted
    support = p_target > 0
    assert int(support.sum()) == dof + 1
    assert counts[~support].sum() == 0
    expected = p_target[support] * n
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_999[dof], (chi2, counts.tolist(), expected.tolist())
    # and the acceptance rate is the one-hot rule's sum_x q(x) p(x) (3-sigma binomial band)
    alpha = float((p_target * q).sum())
    assert abs(accepted / n - alpha) < 3 * (alpha * (1 - alpha) / n) ** 0.5 + 1e-9


def test_row_count_is_checked():
    with pytest.raises(ValueError, match="m \\+ 1"):
        accept_drafts(_logits(2, 8, 0), [1, 2], SamplingParams(), 0)
