"""The held-out acceptance bench's parts: the speculative-sampling round, the continuation filter, alpha, and the
section end to end on a tiny model and drafter."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from benchmarks.heldout_accept import (ContinuationFilter, Method, heldout_section, overlap, rejection_round,
                                       t1_alpha)


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def _dist(gen: torch.Generator, rows: int, vocab: int) -> torch.Tensor:
    return torch.rand(rows, vocab, generator=gen).pow(3).softmax(-1)


def _draws(q: torch.Tensor, gen: torch.Generator) -> list[int]:
    return [int(torch.multinomial(row, 1, generator=gen)) for row in q]


def test_q_equal_to_p_accepts_every_draft():
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        p = _dist(gen, 4, 11)
        a, tok = rejection_round(p, p[:3], _draws(p[:3], gen), gen)
        assert a == 3 and 0 <= tok < 11


def test_q_disjoint_from_p_accepts_nothing_and_emits_from_p():
    gen = torch.Generator().manual_seed(1)
    p = torch.zeros(4, 8)
    p[:, :4] = 0.25  # p on tokens 0..3
    q = torch.zeros(3, 8)
    q[:, 4:] = 0.25  # q on tokens 4..7
    for _ in range(200):
        a, tok = rejection_round(p, q, _draws(q, gen), gen)
        assert a == 0 and tok < 4


def test_the_first_emitted_token_is_distributed_as_p():
    """Whatever q, the token at the first position (the accepted draft or the residual draw) follows p."""
    gen = torch.Generator().manual_seed(2)
    p = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05, 0.0]] * 3)
    q = torch.tensor([[0.1, 0.1, 0.1, 0.1, 0.1, 0.5], [0.3, 0.3, 0.1, 0.1, 0.1, 0.1]])
    rounds, counts = 12000, torch.zeros(6)
    for _ in range(rounds):
        drafts = _draws(q, gen)
        a, tok = rejection_round(p, q, drafts, gen)
        counts[drafts[0] if a >= 1 else tok] += 1
    assert (counts / rounds - p[0]).abs().max() < 0.02  # 4 sigma at 12000 rounds
    assert counts[5] == 0  # a token p never emits is never accepted


def test_filter_rejects_whitespace_runs_and_loops_and_keeps_code():
    flt = ContinuationFilter()
    code = b"def _split(self, text):\n    chunks = self.wordsep_re.split(text)\n    return [c for c in chunks if c]"
    assert flt.passes(list(code[:64]))
    assert not flt.passes(list(b")\n" + b" " * 62))  # whitespace run
    assert not flt.passes(list(b"self." + b"_" * 59))  # one token repeated
    assert not flt.passes(list((b"the command " * 6)[:64]))  # a short loop
    assert "whitespace" in flt.describe()


def test_alpha_of_a_point_mass_is_p_of_the_proposal():
    seq = torch.tensor([[5, 6, 7, 8] * 5])  # period 4: the n-gram drafter proposes the token 4 back
    plen = 12
    p = torch.rand(20, 9, generator=torch.Generator().manual_seed(3)).softmax(-1)
    got = t1_alpha(Method("ngram"), seq, plen, [p], [()])
    row = seq[0].tolist()
    want = sum(float(p[n, row[n - 3]]) for n in range(plen, 20)) / (20 - plen)
    assert got == pytest.approx(want, rel=1e-6)
    assert float(overlap(p[0], F.one_hot(torch.tensor(4), 9).float())) == pytest.approx(float(p[0, 4]))


def test_section_end_to_end_on_a_tiny_drafter(tiny_model, tiny_ckpt, tmp_path):
    """ngram and an EAGLE-3 row on a tiny model: bounded figures, one per seed, the same again for the same seeds."""
    from k3serve.model.eagle3.config import DrafterConfig
    from k3serve.model.eagle3.weights import init_drafter_weights, save_drafter
    from k3serve.model.loader import load_weights

    cfg = DrafterConfig.for_target(tiny_model.cfg, window=8)
    save_drafter(cfg, init_drafter_weights(cfg, load_weights(tiny_ckpt)), tmp_path / "d")
    stream = torch.randint(0, 256, (400,), generator=torch.Generator().manual_seed(4))
    keep_all = ContinuationFilter(1.0, 1 << 10, 0.0)
    run = lambda: heldout_section(tiny_model, {"eagle3": str(tmp_path / "d")}, stream, prompts=2,  # noqa: E731
                                  prompt_len=16, gen_len=10, seeds=(0, 1), k_t1=2, flt=keep_all)
    out = run()
    assert (out["scanned"], out["kept"]) == (2, 2)
    assert list(out["rows"]) == ["ngram", "eagle3"]
    for r in out["rows"].values():
        assert all(1.0 <= v <= k + 1 for k, v in r["greedy_tokens_per_verify"].items())
        assert len(r["t1_alpha"]) == 2 and all(0.0 <= a <= 1.0 for a in r["t1_alpha"].values())
        assert all(1.0 <= v <= 3.0 for v in r["t1_tokens_per_verify"].values())
    assert run()["rows"] == out["rows"]
    none = heldout_section(tiny_model, {}, stream, prompts=2, prompt_len=16, gen_len=10, scan=3,
                           flt=ContinuationFilter(max_whitespace=-1.0))  # passes nothing
    assert (none["scanned"], none["kept"], none["rows"]) == (3, 0, {})
