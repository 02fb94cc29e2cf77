"""The deterministic MLA path's cache of decompressed key blocks (model/layers/mla_blocked.py): a hit gives the
bits a fresh decompression gives, changed rows never hit, the byte bound holds, and attention with the cache
equals attention without it bit for bit (decode steps over the same blocks)."""

from __future__ import annotations

import torch

from k3serve.model.layers.mla_blocked import KeyBlockCache, _key_blocks, blocked_attention

H, NOPE, ROPE, RANK, V, KB = 4, 32, 16, 64, 32, 64


def _weights(g):
    return torch.randn(H, NOPE, RANK, generator=g), torch.randn(H, V, RANK, generator=g)


def test_hits_are_the_fresh_bits_and_changed_rows_miss():
    g = torch.Generator().manual_seed(0)
    w_uk, w_uv = _weights(g)
    blocks = torch.randn(3, KB, RANK + ROPE, generator=g)
    cache = KeyBlockCache()
    keys, values = _key_blocks(blocks, w_uk, w_uv)
    hits, *_ , fps = cache.lookup(blocks, [True, True, False])
    assert hits == [] and cache.misses == 2
    for i in (0, 1):
        cache.insert(fps[i], blocks[i], keys[i], values[i])
    changed = blocks.clone()
    changed[1, 5, 3] += 1.0  # same first and last row, other bits: must not hit
    hits, k_hit, v_hit, _ = cache.lookup(changed, [True, True, True])
    assert hits == [0]
    assert torch.equal(k_hit[0], _key_blocks(blocks[:1], w_uk, w_uv)[0][0])
    assert torch.equal(v_hit[0], values[0])


def test_the_byte_bound_evicts_the_least_recently_used():
    g = torch.Generator().manual_seed(1)
    w_uk, w_uv = _weights(g)
    blocks = torch.randn(3, KB, RANK + ROPE, generator=g)
    keys, values = _key_blocks(blocks, w_uk, w_uv)
    one = (blocks[0].numel() + keys[0].numel() + values[0].numel()) * 4
    cache = KeyBlockCache(max_bytes=2 * one)
    fps = cache.lookup(blocks, [False] * 3)[3]
    cache.insert(fps[0], blocks[0], keys[0], values[0])
    cache.insert(fps[1], blocks[1], keys[1], values[1])
    assert cache.lookup(blocks[:1], [True])[0] == [0]  # block 0 used again: block 1 is now the oldest
    cache.insert(fps[2], blocks[2], keys[2], values[2])
    assert cache.bytes == 2 * one
    assert cache.lookup(blocks, [True] * 3)[0] == [0, 2]


def test_attention_with_the_cache_equals_attention_without_it():
    """Two requests decode 3 steps each past a block boundary (positions 126..128 and 63..65): every step's
    output is torch.equal with and without the cache, and full blocks are hits from the second step on."""
    g = torch.Generator().manual_seed(2)
    w_uk, w_uv = _weights(g)
    lat = [torch.randn(140, RANK + ROPE, generator=g), torch.randn(80, RANK + ROPE, generator=g)]
    cache = KeyBlockCache()
    for step in range(3):
        starts = [126 + step, 63 + step]
        qs = [torch.randn(1, H, NOPE + ROPE, generator=g) for _ in starts]
        rows = [x[: s + 1] for x, s in zip(lat, starts)]
        want = blocked_attention(qs, rows, starts, w_uk, w_uv, KB, 16)
        got = blocked_attention(qs, rows, starts, w_uk, w_uv, KB, 16, cache)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), step
    assert cache.hits > 0
