"""The CPU flash forms of the decompressed MLA prefill attention (model/layers/mla_prefill.py) against the
explicit-score blocked form and a one-shot dense softmax, over the chunk shapes prefill produces: a first
chunk (start 0), a chunk after a cached prefix, single-token chunks, and a query count that the blocked form
splits into several blocks."""

from __future__ import annotations

import math

import pytest
import torch

from k3serve.model.layers.mla_prefill import (absorbed_is_cheaper, attend_absorbed_flash_cpu, attend_blocked,
                                              attend_flash_cpu, decompress_padded)

H, NOPE, ROPE, V, RANK = 4, 32, 16, 32, 64


def _case(t: int, start: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(start + t, RANK + ROPE, generator=g)
    w_kv_b = torch.randn(H * (NOPE + V), RANK, generator=g) / 8
    q_nope = torch.randn(t, H, NOPE, generator=g)
    q_pe = torch.randn(t, H, ROPE, generator=g)
    return rows, w_kv_b, q_nope, q_pe


def _dense(rows, w_kv_b, q_nope, q_pe, start: int, scale: float) -> torch.Tensor:
    """One-shot oracle: full [H, T, L] scores, causal mask by absolute position."""
    t = q_nope.shape[0]
    kv = torch.einsum("lr,hdr->hld", rows[:, :RANK], w_kv_b.view(H, NOPE + V, RANK))
    k = torch.cat([kv[..., :NOPE], rows[:, RANK:].expand(H, -1, -1)], -1)
    q = torch.cat([q_nope, q_pe], -1).transpose(0, 1)
    s = q @ k.transpose(1, 2) * scale
    pos_q = torch.arange(start, start + t)[:, None]
    s = s.masked_fill(torch.arange(start + t)[None, :] > pos_q, float("-inf"))
    return (s.softmax(-1) @ kv[..., NOPE:]).transpose(0, 1)


@pytest.mark.parametrize("t,start", [(1, 0), (7, 0), (1, 37), (5, 64), (130, 300), (600, 40), (300, 4000)])
def test_flash_forms_match_dense_and_blocked(t: int, start: int) -> None:
    rows, w_kv_b, q_nope, q_pe = _case(t, start)
    scale = 1.0 / math.sqrt(NOPE + ROPE)
    want = _dense(rows, w_kv_b, q_nope, q_pe, start, scale)
    k, v = decompress_padded(rows, w_kv_b, H, NOPE, RANK)
    assert k.shape == (start + t, H, NOPE + ROPE) and v.shape == k.shape
    assert torch.equal(k[..., NOPE:], rows[:, None, RANK:].expand(-1, H, -1))  # k_pe copied, not computed
    assert torch.equal(v[..., V:], torch.zeros_like(v[..., V:]))  # padding exactly zero
    flash = attend_flash_cpu(torch.cat([q_nope, q_pe], -1), k, v, start, scale, V)
    kvb = w_kv_b.view(H, NOPE + V, RANK)
    absorbed = attend_absorbed_flash_cpu(q_nope, q_pe, rows, kvb[:, :NOPE], kvb[:, NOPE:], start, scale)
    blocked = attend_blocked(torch.cat([q_nope, q_pe], -1).transpose(0, 1) * scale,
                             k.transpose(0, 1), v[..., :V].transpose(0, 1), start).transpose(0, 1)
    for got in (flash, absorbed, blocked):
        assert got.shape == (t, H, V)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_absorbed_choice_follows_flop_bound() -> None:
    # tiny preset: bound (nope + rope) rank / (rank - nope) = 96, scaled by 3 (measured) -> 288
    assert absorbed_is_cheaper(287, NOPE, ROPE, RANK) and not absorbed_is_cheaper(288, NOPE, ROPE, RANK)
    assert absorbed_is_cheaper(10 ** 6, 64, ROPE, 64)  # rank <= nope: absorbed never costs more
