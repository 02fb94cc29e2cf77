"""Decode's stacked input projections (KDA and MLA layers: one GEMV over the row-stacked weights) against the
separate projections: the same values to rounding (default numerics; the stacked GEMV's bits are the separate
GEMVs' on some CPUs and not on others: AVX-512 MKL differs, so bits are asserted only in numerics mode
deterministic, below)."""

from __future__ import annotations

import pytest
import torch

from k3serve.model.init import random_weights
from k3serve.model.model import HybridModel
from k3serve.model.presets import preset
from k3serve.model.state import ForwardBatch, PagedLatentCache


def _decode_logits(model: HybridModel, batch: int, seed: int) -> torch.Tensor:
    """Two decode steps over `batch` fresh requests (paged latent cache, fresh KDA state): logits of the second."""
    cfg = model.cfg
    g = torch.Generator().manual_seed(seed)
    blocks = model.new_kda_state(batch)
    pages = torch.zeros(batch, cfg.num_mla_layers, 64, cfg.mla_latent_dim)
    tables = torch.arange(batch).unsqueeze(1)
    out = None
    for pos in range(2):
        ids = torch.randint(0, cfg.vocab_size, (batch, 1), generator=g)
        out = model.forward(ids, ForwardBatch(blocks, PagedLatentCache(pages, tables), [pos] * batch, decode=True))
    return out


@pytest.mark.parametrize("name", ["tiny", "tiny-linear"])
@pytest.mark.parametrize("batch", [1, 3])
def test_stacked_projections_equal_separate(name: str, batch: int) -> None:
    cfg = preset(name)
    weights = random_weights(cfg, 0)
    stacked, separate = HybridModel(cfg, weights), HybridModel(cfg, weights)
    for layer in separate.layers:
        assert layer.attn.w_in is not None  # the default numerics build the stacks
        layer.attn.w_in = None  # the separate GEMVs on the same (view) weights
    a, b = _decode_logits(stacked, batch, 7), _decode_logits(separate, batch, 7)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["tiny", "tiny-linear"])
def test_deterministic_stacks_keep_the_separate_projections_bits(name: str) -> None:
    """Numerics mode deterministic multiplies the stacked KDA, MLA and MoE input projections in every call
    (prefill and decode): the logits are torch.equal to those of the separate deterministic projections."""
    from k3serve.contracts.numerics import DETERMINISTIC
    from k3serve.model.state import DenseLatentCache

    cfg = preset(name)
    weights = random_weights(cfg, 0)
    stacked = HybridModel(cfg, weights, numerics=DETERMINISTIC)
    separate = HybridModel(cfg, weights, numerics=DETERMINISTIC)
    for layer in separate.layers:
        assert layer.attn.w_in is not None
        layer.attn.w_in = None
        if hasattr(layer.ffn, "w_in"):
            layer.ffn.w_in = None
    ids = torch.randint(0, cfg.vocab_size, (2, 70), generator=torch.Generator().manual_seed(3))
    outs = []
    for model in (stacked, separate):
        batch = ForwardBatch(model.new_kda_state(2), DenseLatentCache(cfg.num_mla_layers, 2), [0, 0])
        prefill = model.forward(ids[:, :64], batch, all_logits=True)
        batch.start_positions = [64, 64]
        decode = model.forward(ids[:, 64:65], batch)
        outs.append((prefill, decode))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("batch", [1, 3])
def test_decode_conv_over_qkv_at_once_keeps_the_three_calls_bits(batch: int) -> None:
    """A decode step runs the KDA q, k and v short convs as one call over their stacked channels: the logits and
    every state block (recurrent state and conv windows) are torch.equal to three separate calls'."""
    cfg = preset("tiny")
    weights = random_weights(cfg, 0)
    fused, separate = HybridModel(cfg, weights), HybridModel(cfg, weights)
    kda = [layer.attn for layer in separate.layers if hasattr(layer.attn, "conv_w_qkv")]
    assert kda and all(a.conv_w_qkv is not None for a in kda)
    for attn in kda:
        attn.conv_w_qkv = None  # the per-projection path on the same (view) taps
    outs = []
    for model in (fused, separate):
        g = torch.Generator().manual_seed(5)
        blocks = model.new_kda_state(batch)
        for b in blocks:  # non-zero windows and states, as after a prefill
            b.copy_(torch.randn(b.shape, generator=g) * 0.1)
        pages = torch.zeros(batch, cfg.num_mla_layers, 64, cfg.mla_latent_dim)
        tables = torch.arange(batch).unsqueeze(1)
        logits = []
        for pos in range(3):
            ids = torch.randint(0, cfg.vocab_size, (batch, 1), generator=g)
            logits.append(model.forward(ids, ForwardBatch(blocks, PagedLatentCache(pages, tables), [pos] * batch,
                                                          decode=True)))
        outs.append((torch.stack(logits), blocks))
    assert torch.equal(outs[0][0], outs[1][0])
    assert all(torch.equal(a, b) for a, b in zip(outs[0][1], outs[1][1]))
