"""Drafter training: the LK and KL losses, a short run of ``k3serve train drafter``, the held-out chain eval."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from k3serve.cli.main import app
from k3serve.model.eagle3.weights import load_drafter_weights
from k3serve.model.eagle3.chain_eval import ChainStats
from k3serve.train.drafter_loop import DrafterTrainConfig, _Run, run_drafter_training
from k3serve.train.drafter_loss import DrafterLoss, acceptance, drafter_loss
from k3serve.train.drafter_plot import DRAFTER_PNG

runner = CliRunner()


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("corpus") / "code.py"
    p.write_text("".join(f"def f{i}(x):\n    return x + {i % 10}\n\n" for i in range(600)))
    return p


def test_lk_is_minus_log_overlap_and_kl_is_forward_kl():
    g = torch.Generator().manual_seed(0)
    p = torch.randn(5, 11, generator=g).softmax(-1)
    q_logits = torch.randn(5, 11, generator=g)
    q = q_logits.softmax(-1)
    tv = 0.5 * (p - q).abs().sum(-1)
    torch.testing.assert_close(acceptance(p, q_logits), 1 - tv)
    torch.testing.assert_close(drafter_loss(DrafterLoss.LK, p, q_logits), -(1 - tv).log())
    torch.testing.assert_close(drafter_loss(DrafterLoss.KL, p, q_logits), (p * (p.log() - q.log())).sum(-1))
    same = p.log()
    assert drafter_loss(DrafterLoss.LK, p, same).abs().max() < 1e-6
    assert drafter_loss(DrafterLoss.KL, p, same).abs().max() < 1e-6


def test_lk_steps_raise_the_overlap_on_a_batch(tiny_ckpt, text_file, tmp_path):
    """Optimizer steps on one fixed batch lower the unrolled LK loss (the gradient reaches every step)."""
    cfg = DrafterTrainConfig(tiny_ckpt, str(tmp_path), DrafterLoss.LK, ttt_steps=3, steps=5, batch=2, context=24,
                             window=8, warmup_steps=1, corpus=str(text_file))
    run = _Run(cfg)
    x = torch.randint(0, 256, (2, 25), generator=torch.Generator().manual_seed(1))
    first = run.train_step(x)[0]
    for _ in range(4):
        last = run.train_step(x)[0]
    assert last < first


def test_short_run_writes_a_loadable_drafter(tiny_ckpt, text_file, tmp_path):
    cfg = DrafterTrainConfig(tiny_ckpt, str(tmp_path / "d"), DrafterLoss.KL, ttt_steps=2, steps=2, batch=2,
                             context=24, window=8, corpus=str(text_file), eval_prompts=2, eval_prompt_len=16,
                             eval_gen_len=10, eval_tokens=50)
    summary = run_drafter_training(cfg, progress=False)
    assert summary["steps"] == 2 and sorted(summary["tokens_per_verify"]) == [str(k) for k in range(1, 8)]
    for k, v in summary["tokens_per_verify"].items():
        assert 1.0 <= v <= int(k) + 1
    out = tmp_path / "d"
    assert (out / DRAFTER_PNG).stat().st_size > 0
    log = json.loads((out / "train_log.json").read_text())
    assert log["settings"]["loss"] == "kl" and len(log["final"]["alpha"]) == 7
    dcfg, w = load_drafter_weights(out)
    assert dcfg.window == 8 and all(torch.isfinite(t).all() for t in w.values())


def test_chain_stats_acceptance_per_position():
    s = ChainStats(k=3, rounds=10, tokens=10 + 2 * 1 + 3 * 2 + 4 * 3, accepted_hist=(4, 2, 3, 1))
    assert s.tokens_per_verify == pytest.approx(3.0)
    assert s.position_acceptance() == pytest.approx([6 / 10, 4 / 6, 1 / 4])


def test_cli_refuses_an_unknown_loss(tmp_path):
    res = runner.invoke(app, ["train", "drafter", "--target", "tiny-trained", "--out", str(tmp_path), "--loss", "ce",
                              "--steps", "1"])
    assert res.exit_code == 2 and "--loss" in res.output


def test_ngram_chain_sim_on_a_repetition():
    """The bench's n-gram row runs the same simulated greedy decode: on a period-4 repetition every draft of
    the 4-token chain is accepted (k + 1 tokens per verify)."""
    from benchmarks.heldout_accept import ngram_chain_stats

    seq = torch.tensor([[1, 2, 3, 4] * 10])
    s = ngram_chain_stats(seq, 12, 4)
    assert s.accepted_hist[-1] == s.rounds and s.tokens_per_verify == 5.0
