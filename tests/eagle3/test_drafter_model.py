"""EAGLE-3 drafter model: identity-on-high init, training unroll == serving chain, checkpoint, window state."""

from __future__ import annotations

import pytest
import torch

from k3serve.model.config import ConfigError
from k3serve.model.eagle3.config import DrafterConfig, feature_blocks
from k3serve.model.eagle3.drafter import Eagle3Drafter
from k3serve.model.eagle3.features import target_features
from k3serve.model.eagle3.weights import check_shared, drafter_specs, init_drafter_weights, load_drafter_weights, save_drafter
from k3serve.model.eagle3.window import DrafterWindow, stack_windows
from k3serve.model.loader import load_weights
from k3serve.model.state import DenseLatentCache, ForwardBatch


def _fresh(model, b):
    return ForwardBatch(model.new_kda_state(b), DenseLatentCache(model.cfg.num_mla_layers, b), [0] * b)


@pytest.fixture(scope="module", params=["tiny", "tiny_linear"])
def target(request, tiny_model, tiny_ckpt, tiny_linear_model, tiny_linear_ckpt):
    model, ckpt = (tiny_model, tiny_ckpt) if request.param == "tiny" else (tiny_linear_model, tiny_linear_ckpt)
    return model, load_weights(ckpt)


def test_feature_blocks_rule():
    assert feature_blocks(9, 3) == (0, 1, 2)  # tiny presets: first, middle, last
    assert feature_blocks(48, 12) == (0, 2, 3)  # 4 blocks: the 4th is the last, so the middle
    assert feature_blocks(60, 12) == (0, 3, 4)  # >= 5 blocks: 1st, 4th, last as K3
    with pytest.raises(ConfigError, match="3 blocks"):
        feature_blocks(6, 3)


def test_fused_input_equals_high_feature_at_init(target):
    model, weights = target
    cfg = DrafterConfig.for_target(model.cfg)
    dr = Eagle3Drafter(cfg, init_drafter_weights(cfg, weights))
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))
    f = target_features(model, cfg, ids, _fresh(model, 2))
    assert torch.equal(f.logits, model.forward(ids, _fresh(model, 2), all_logits=True))
    assert not torch.equal(f.low, f.high) and not torch.equal(f.mid, f.high)
    assert torch.equal(dr.fuse(f.low, f.mid, f.high), f.high.float())


def test_training_unroll_equals_serving_chain(tiny_model, tiny_ckpt):
    """Step j of the training-time test at anchor a gives the logits the serving chain gives at step j from the
    window ending at a (the data after a set to the chain's greedy drafts), before and after the window fills."""
    model = tiny_model
    cfg = DrafterConfig.for_target(model.cfg, window=6)
    w = init_drafter_weights(cfg, load_weights(tiny_ckpt))
    w = {n: t + 0.01 * torch.randn(t.shape, generator=torch.Generator().manual_seed(i))  # off the init
         for i, (n, t) in enumerate(sorted(w.items()))}
    dr = Eagle3Drafter(cfg, w)
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(5))
    f = target_features(model, cfg, ids, _fresh(model, 2))
    toks, g = ids[:, 1:], dr.fuse(f.low, f.mid, f.high)[:, :-1]
    steps = 4
    for a in (0, 2, 9, 14):
        win = DrafterWindow.empty(cfg.window, cfg.hidden_size)
        wins = [win.extended(toks[b, : a + 1], g[b, : a + 1]) for b in range(2)]
        drafts, lg = dr.draft(*stack_windows(wins), steps)
        data = toks.clone()
        data[:, a + 1: a + steps] = drafts[:, : steps - 1]  # draft j is the data's token at a + j
        un = dr.unroll(data, g, steps)
        for j in range(1, steps + 1):
            torch.testing.assert_close(lg[:, j - 1], un.logits[j - 1][:, a + j - 1], atol=2e-5, rtol=1e-5)


def test_checkpoint_round_trip_and_target_check(tmp_path, tiny_model, tiny_ckpt, tiny_linear_model):
    cfg = DrafterConfig.for_target(tiny_model.cfg)
    w = init_drafter_weights(cfg, load_weights(tiny_ckpt))
    save_drafter(cfg, w, tmp_path)
    cfg2, w2 = load_drafter_weights(tmp_path)
    assert cfg2 == cfg and sorted(w2) == sorted(s.name for s in drafter_specs(cfg))
    assert all(torch.equal(w[n], w2[n]) for n in w)
    assert "language_model.model.layers.9.fc.weight" in w2 and w2[cfg.prefix + "fc.weight"].shape == (256, 768)
    cfg2.check_target(tiny_model.cfg)
    check_shared(cfg2, w2, load_weights(tiny_ckpt))
    with pytest.raises(ConfigError, match="different target"):
        cfg2.check_target(tiny_linear_model.cfg)
    other = dict(load_weights(tiny_ckpt))
    other[tiny_model.cfg.lm_head_name] = other[tiny_model.cfg.lm_head_name] + 1.0
    with pytest.raises(ConfigError, match="another target"):
        check_shared(cfg2, w2, other)


def test_window_commit_and_channel_block():
    w = DrafterWindow.empty(4, 3)
    w = w.extended(torch.tensor([7, 8]), torch.ones(2, 3))
    assert w.count == 2 and w.tokens.tolist() == [0, 0, 7, 8]
    w = w.extended(torch.tensor([9, 10, 11]), torch.arange(9.0).view(3, 3))
    assert w.count == 4 and w.tokens.tolist() == [8, 9, 10, 11] and w.feats[0].tolist() == [1.0, 1.0, 1.0]
    back = DrafterWindow.from_tensor(w.to_tensor(), w.count)
    assert torch.equal(back.tokens, w.tokens) and torch.equal(back.feats, w.feats) and back.count == 4
