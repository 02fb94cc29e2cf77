"""The deterministic MLA path's pool of decompressed key blocks (model/layers/mla_key_pool.py): a hit gives the
bits a fresh decompression gives, changed rows never hit, the byte bound holds (least recently used blocks
go first, a call that cannot fit falls back to decompressing), and attention with the pool equals attention
without it bit for bit (decode steps over the same blocks, mixed lengths and chunks)."""

from __future__ import annotations

import torch

from k3serve.model.layers.mla_blocked import blocked_attention
from k3serve.model.layers.mla_key_pool import KeyBlockPool, key_blocks
from k3serve.model.state import DenseLatentCache, PagedLatentCache

H, NOPE, ROPE, RANK, V, KB = 4, 32, 16, 64, 32, 64


def _weights(g):
    return torch.randn(H, NOPE, RANK, generator=g), torch.randn(H, V, RANK, generator=g)


def _block_bytes() -> int:
    return (H * KB * (NOPE + ROPE) + H * KB * V + KB * (RANK + ROPE)) * 4


def test_hits_are_the_fresh_bits_and_changed_rows_miss():
    g = torch.Generator().manual_seed(0)
    w_uk, w_uv = _weights(g)
    blocks = torch.randn(3, KB, RANK + ROPE, generator=g)
    pool = KeyBlockPool()
    blocks[2, 40:] = 0  # a partial block: 40 real rows
    keys, values = key_blocks(blocks, w_uk, w_uv)
    slots = pool.slots(blocks, [KB, KB, 40], [0, 0, 0], w_uk, w_uv)
    assert pool.hits == 0 and pool.misses == 3 and pool.cached == 3
    for i, s in enumerate(slots):
        assert torch.equal(pool.keys[s], keys[i]) and torch.equal(pool.values[s], values[i])
    changed = blocks.clone()
    changed[1, 5, 3] += 1.0  # same first and last row, other bits: must not hit
    again = pool.slots(changed, [KB, KB, 40], [0, 0, 0], w_uk, w_uv)
    assert pool.hits == 2 and again[0] == slots[0] and again[2] == slots[2] and again[1] != slots[1]
    fresh_k, fresh_v = key_blocks(changed, w_uk, w_uv)
    for i, s in enumerate(again):
        assert torch.equal(pool.keys[s], fresh_k[i]) and torch.equal(pool.values[s], fresh_v[i])


def test_the_byte_bound_evicts_the_least_recently_used_and_falls_back_when_a_call_cannot_fit():
    g = torch.Generator().manual_seed(1)
    w_uk, w_uv = _weights(g)
    blocks = torch.randn(3, KB, RANK + ROPE, generator=g)
    pool = KeyBlockPool(max_bytes=2 * _block_bytes())
    full = lambda n: ([KB] * n, [0] * n)  # noqa: E731
    pool.slots(blocks[:2], *full(2), w_uk, w_uv)
    assert pool.capacity == 2 and pool.bytes == 2 * _block_bytes()
    pool.slots(blocks[:1], *full(1), w_uk, w_uv)  # block 0 used again: block 1 is now the oldest
    assert pool.hits == 1
    pool.slots(blocks[2:], *full(1), w_uk, w_uv)  # evicts block 1
    hits = pool.hits
    pool.slots(blocks[[0, 2]], *full(2), w_uk, w_uv)
    assert pool.hits == hits + 2 and pool.bytes == 2 * _block_bytes()
    assert pool.slots(blocks, *full(3), w_uk, w_uv) is None  # 3 blocks in one call never fit in 2 slots
    q = [torch.randn(1, H, NOPE + ROPE, generator=g)]
    rows = [blocks.flatten(0, 1)]
    got = blocked_attention(q, rows, [3 * KB - 1], w_uk, w_uv, KB, 16, pool)  # decompresses without the pool
    assert torch.equal(got[0], blocked_attention(q, rows, [3 * KB - 1], w_uk, w_uv, KB, 16)[0])

def test_attention_with_the_pool_equals_attention_without_it():
    """Requests of mixed lengths decode 3 steps each, some across a block boundary, then a 2-request chunked
    step: every output is torch.equal with and without the pool, and full blocks are hits from the second
    step on."""
    g = torch.Generator().manual_seed(2)
    w_uk, w_uv = _weights(g)
    lat = [torch.randn(n, RANK + ROPE, generator=g) for n in (140, 80, 300, 10)]
    pool = KeyBlockPool()
    for step in range(3):
        starts = [126 + step, 63 + step, 250 + step, 5 + step]
        qs = [torch.randn(1, H, NOPE + ROPE, generator=g) for _ in starts]
        rows = [x[: s + 1] for x, s in zip(lat, starts)]
        want = blocked_attention(qs, rows, starts, w_uk, w_uv, KB, 16)
        got = blocked_attention(qs, rows, starts, w_uk, w_uv, KB, 16, pool)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), step
    assert pool.hits > 0
    starts, t = [64, 200], [40, 100]  # prefill chunks: several tiles per request, causal inside
    qs = [torch.randn(n, H, NOPE + ROPE, generator=g) for n in t]
    rows = [lat[2][: s + n] for s, n in zip(starts, t)]
    want = blocked_attention(qs, rows, starts, w_uk, w_uv, KB, 16)
    got = blocked_attention(qs, rows, starts, w_uk, w_uv, KB, 16, pool)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_growing_block_decompresses_only_its_new_rows_and_keeps_the_whole_block_bits():
    """A block filled row by row (decode), then by a 6-row chunk, then to its end: each step extends the
    same slot (grown, not a miss), and the slot equals a fresh decompression of the whole block, bit for
    bit; two blocks sharing their first rows and diverging after are kept apart."""
    g = torch.Generator().manual_seed(3)
    w_uk, w_uv = _weights(g)
    rows = torch.randn(KB, RANK + ROPE, generator=g)
    other = rows.clone()
    other[19:] = torch.randn(KB - 19, RANK + ROPE, generator=g)
    pool = KeyBlockPool()

    def block(src, n):
        b = torch.zeros(1, KB, RANK + ROPE)
        b[0, :n] = src[:n]
        return b

    before = 19
    for n in (20, 21, 27, 28, 62, 64):
        for src in (rows, other):
            b = block(src, n)
            (slot,) = pool.slots(b, [n], [before], w_uk, w_uv)
            k, v = key_blocks(b, w_uk, w_uv)
            assert torch.equal(pool.keys[slot], k[0]) and torch.equal(pool.values[slot], v[0]), n
        before = n
    assert pool.grown == 10 and pool.misses == 2  # the first call of each, then growth only


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


def test_blocked_attention_trains_with_the_inference_bits():
    """Outside inference mode (training) the attention runs out of place: backward works, and the forward
    has the bits of the in-place (serving) loop."""
    g = torch.Generator().manual_seed(5)
    w_uk, w_uv = _weights(g)
    rows = [torch.randn(150, RANK + ROPE, generator=g), torch.randn(90, RANK + ROPE, generator=g)]
    qs = [torch.randn(150, H, NOPE + ROPE, generator=g), torch.randn(40, H, NOPE + ROPE, generator=g)]
    with torch.no_grad():
        want = blocked_attention(qs, rows, [0, 50], w_uk, w_uv, KB, 16)
    q = [x.clone().requires_grad_(True) for x in qs]
    got = blocked_attention(q, rows, [0, 50], w_uk, w_uv, KB, 16)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    (got[0].sum() + got[1].sum()).backward()
    assert q[0].grad.abs().sum() > 0 and q[1].grad.abs().sum() > 0
