"""The deterministic MLA attention (model/layers/mla_blocked.py, the absorbed form over fixed key blocks): close to
the naive decompressed softmax attention, and bit for bit the same row whatever call it is in (one-shot or
chunked prefill, single or batched decode of mixed lengths, verify windows, row chunks of a long request, 1, 2
or 4 heads per rank), with autograd; and the paged cache's key blocks equal the dense cache's."""

from __future__ import annotations

import pytest
import torch

import k3serve.model.layers.mla_blocked as mla_blocked
from k3serve.model.layers.mla_blocked import blocked_attention
from k3serve.model.state import DenseLatentCache, PagedLatentCache

NOPE, ROPE, RANK, V, KB = 32, 16, 64, 32, 64


def _case(heads: int, length: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w_uk = torch.randn(heads, NOPE, RANK, generator=g) * 0.1
    w_uv = torch.randn(heads, V, RANK, generator=g) * 0.1
    rows = torch.randn(length, RANK + ROPE, generator=g)
    q = torch.randn(length, heads, NOPE + ROPE, generator=g) * 0.2
    return w_uk, w_uv, rows, q


def _naive(q, rows, w_uk, w_uv):
    """Causal softmax attention in the decompressed form, all keys at once (positions 0 .. L-1)."""
    heads, length = w_uk.shape[0], rows.shape[0]
    c, k_pe = rows[:, :RANK], rows[:, RANK:]
    k = torch.cat([torch.einsum("lr,hnr->hln", c, w_uk), k_pe.unsqueeze(0).expand(heads, -1, -1)], -1)
    v = torch.einsum("lr,hvr->hlv", c, w_uv)
    s = torch.einsum("thd,hld->htl", q, k).masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1),
                                                       float("-inf"))
    return torch.einsum("htl,hlv->thv", s.softmax(-1), v)


@pytest.mark.parametrize("heads", [1, 2, 4])
def test_every_call_gives_a_row_the_same_bits_and_the_naive_values(one_thread, heads):
    w_uk, w_uv, rows, q = _case(heads, 300, heads)
    one = blocked_attention([q], [rows], [0], w_uk, w_uv, KB)[0]
    assert torch.allclose(one, _naive(q, rows, w_uk, w_uv), atol=1e-5, rtol=1e-5)
    for split in (64, 100, 200, 299):  # chunked prefill, chunks ending on and off the key blocks
        a = blocked_attention([q[:split]], [rows[:split]], [0], w_uk, w_uv, KB)[0]
        b = blocked_attention([q[split:]], [rows], [split], w_uk, w_uv, KB)[0]
        assert torch.equal(torch.cat([a, b]), one), split
    # batched decode of mixed lengths (groups by block count, one of them not consecutive: a gather)
    ps = [0, 5, 63, 130, 64, 299, 200, 7]
    outs = blocked_attention([q[p: p + 1] for p in ps], [rows[: p + 1] for p in ps], ps, w_uk, w_uv, KB)
    assert all(torch.equal(o, one[p: p + 1]) for o, p in zip(outs, ps))
    # verify windows of 4 rows next to decode rows, and a prefill chunk in the same call
    starts = [60, 127, 10, 250]
    ts = [4, 4, 1, 50]
    outs = blocked_attention([q[s: s + t] for s, t in zip(starts, ts)], [rows[: s + t] for s, t in zip(starts, ts)],
                             starts, w_uk, w_uv, KB)
    assert all(torch.equal(o, one[s: s + t]) for o, s, t in zip(outs, starts, ts))


def test_row_chunks_under_a_small_score_budget_keep_the_bits(one_thread, monkeypatch):
    """A long request is cut into row chunks inside one key block each; a budget that cuts them smaller (long
    contexts) gives the same bits."""
    w_uk, w_uv, rows, q = _case(4, 260, 7)
    want = blocked_attention([q[40:]], [rows], [40], w_uk, w_uv, KB)[0]
    monkeypatch.setattr(mla_blocked, "_SCORE_BUDGET", 4 * 260 * 5)  # 5 rows per chunk
    assert torch.equal(blocked_attention([q[40:]], [rows], [40], w_uk, w_uv, KB)[0], want)


def test_blocked_attention_trains_with_the_inference_bits(one_thread):
    """Outside inference mode (training) backward works, and the forward has the serving bits."""
    w_uk, w_uv, rows, q = _case(4, 150, 5)
    rows2, q2 = rows[:90], q[50:90]
    with torch.no_grad():
        want = blocked_attention([q, q2], [rows, rows2], [0, 50], w_uk, w_uv, KB)
    qs = [q.clone().requires_grad_(True), q2.clone().requires_grad_(True)]
    got = blocked_attention(qs, [rows, rows2], [0, 50], w_uk, w_uv, KB)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    (got[0].sum() + got[1].sum()).backward()
    assert qs[0].grad.abs().sum() > 0 and qs[1].grad.abs().sum() > 0


def test_paged_read_blocks_equal_the_dense_cache_blocks_for_every_page_size():
    """Blocks read from pages (whole-block copies when blocks tile pages, a row gather otherwise) equal the
    dense cache's: the same rows, zeros past each request's end even where the page holds stale rows."""
    g = torch.Generator().manual_seed(4)
    lengths = [1, 64, 130, 200]
    rows = [torch.randn(n, RANK + ROPE, generator=g) for n in lengths]
    dense = DenseLatentCache(2, len(lengths))
    for b, r in enumerate(rows):
        for layer in (0, 1):
            dense._rows[layer][b] = r + layer
    for page in (32, 64, 128):
        per_req = -(-256 // page)
        pool = torch.randn(len(lengths) * per_req + 3, 2, page, RANK + ROPE, generator=g)  # stale rows
        order = torch.randperm(pool.shape[0], generator=g)[: len(lengths) * per_req].view(len(lengths), per_req)
        paged = PagedLatentCache(pool, order)
        for layer in (0, 1):
            for b, r in enumerate(rows):
                pos = torch.arange(lengths[b])
                pool[order[b, pos // page], layer, pos % page] = r + layer
            assert torch.equal(paged.read_blocks(layer, lengths, KB), dense.read_blocks(layer, lengths, KB)), page


def test_paged_writes_and_reads_land_on_the_table_rows_of_their_layer():
    """Rows written through the cache (index_copy_ on flat row ids) sit at pool[table[p // page], layer,
    p % page] and nowhere else, and read / read_blocks give them back; the decode kernel's page gather too."""
    from k3serve.kernels.mla_decode import mla_decode, naive_mla_decode

    g = torch.Generator().manual_seed(5)
    page, layers, d = 16, 3, RANK + ROPE
    pool = torch.randn(12, layers, page, d, generator=g)
    table = torch.tensor([[7, 2, 9, 0], [4, 11, 5, 1]])
    paged, before = PagedLatentCache(pool, table), pool.clone()
    writes = {(1, 0): torch.randn(2, 21, d, generator=g), (1, 21): torch.randn(2, 30, d, generator=g)}
    for (layer, start), rows in writes.items():
        paged.write(layer, rows, [start, start])
    want = torch.cat([writes[(1, 0)], writes[(1, 21)]], dim=1)  # [2, 51, d]
    touched = torch.zeros(pool.shape[:3], dtype=torch.bool)
    for b in range(2):
        for p in range(51):
            assert torch.equal(pool[table[b, p // page], 1, p % page], want[b, p])
            touched[table[b, p // page], 1, p % page] = True
        assert torch.equal(paged.read(1, b, 51), want[b])
    assert torch.equal(pool[~touched], before[~touched])  # other layers, pages and rows untouched
    dense = DenseLatentCache(layers, 2)
    dense._rows[1] = [want[0], want[1, :40]]
    assert torch.equal(paged.read_blocks(1, [51, 40], 8), dense.read_blocks(1, [51, 40], 8))
    assert torch.equal(paged.read_blocks(1, [51, 40], 32), dense.read_blocks(1, [51, 40], 32))
    q, q_pe = torch.randn(2, 4, RANK, generator=g), torch.randn(2, 4, ROPE, generator=g)
    lens = torch.tensor([51, 40])
    got = mla_decode(q, q_pe, pool[:, 1], table, lens, 0.1, backend="torch")
    torch.testing.assert_close(got, naive_mla_decode(q, q_pe, pool[:, 1], table, lens, 0.1), atol=1e-5, rtol=1e-5)


def test_fold_blocks_ignores_trailing_zero_blocks_bit_for_bit():
    """The block sum's order (folding halves): n0 non-zero blocks followed by any number of exact-zero blocks (the
    blocks past a row's own) give the bits of the n0 blocks alone, along any dim; and the value is the sum."""
    from k3serve.model.layers.mla_blocked import fold_blocks

    g = torch.Generator().manual_seed(11)
    for n0 in (1, 2, 3, 5, 8, 13, 64, 130):
        x = torch.randn(3, n0, 7, generator=g) * torch.logspace(-3, 3, n0).view(1, n0, 1)
        want = fold_blocks(x.clone(), 1)
        assert torch.allclose(want.double(), x.double().sum(1), rtol=1e-5, atol=1e-4), n0
        for extra in (1, 2, 3, 7, 60):
            padded = torch.cat([x, torch.zeros(3, extra, 7)], dim=1)
            assert torch.equal(fold_blocks(padded, 1), want), (n0, extra)
            last = torch.cat([x, torch.zeros(3, extra, 7)], dim=1).transpose(1, 2).contiguous()  # [3, 7, n]
            assert torch.equal(fold_blocks(last, 2), want), (n0, extra)
