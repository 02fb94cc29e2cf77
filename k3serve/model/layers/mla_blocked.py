"""MLA attention in numerics mode ``deterministic``: fixed key blocks at absolute positions, one order for all.

Prefill chunks, one-shot prefill, the reference's decode and batched engine decode all call
:func:`blocked_attention`, so a query at position i gets the same bits whichever call it is in::

    keys (absolute)   [0, KB) [KB, 2KB) ... [j KB, (j+1) KB) ...      KB = numerics.key_block, last block zero-padded
    per key block j   k_j, v_j = decompress(c[j KB : (j+1) KB])       one [KB, rank] x [rank, n] GEMM per head
    queries           tiles of R rows (R = 4, 8 or 16 = numerics.row_tile, the smallest that holds the longest
                      request: the same row bits; padding rows repeat the last query's position)
    per block j       s = q_tile k_j^T (scale folded into q), keys past the query's position -> -inf
                      m' = max(m, rowmax s); p = exp(s - m'); l = l e^(m - m') + sum p; acc = acc e^(m - m') + p v_j
    out               acc / l

A block that lies wholly after a query's position is an exact no-op for that row (p = 0, e^0 = 1, acc + 0),
so a prefill row that also sees later blocks of its chunk gets the bits of the decode row that stops at its
own block. Every GEMM has a fixed shape ([R, D] x [D, KB] and [R, KB] x [KB, v] per head, batched over tiles).

Decode re-reads every key block at every step; a full block's rows never change, so its decompressed keys and
values (a function of those rows alone, computed by the same fixed-shape GEMMs) are kept in a
:class:`~k3serve.model.layers.mla_key_pool.KeyBlockPool` and reused bit for bit. Without it the per-step
decompression was most of a deterministic decode step (72% of it at batch 32, context 256, tiny preset;
docs/numerics.md).

What the loop skips is exactly what would not change a row's bits:

* query tiles are ordered by their request's block count (most first, stable), so the tiles that have a block
  j are a prefix and column j updates ``m, l, acc[:count_j]`` in place: a block past a request's end (the
  former fully masked no-op) is never computed;
* the causal mask is applied only in a column where some tile's first row lies before the block's last key
  (masking nothing is a no-op): in decode only the column of each request's last block;
* each column's keys and values are gathered from one store (the pool, or the call's own decompression) with
  one ``index_select``, and a column of the pool whose slots did not change since the last call is not
  gathered again (``KeyBlockPool.column``; decode re-gathers the column of the growing blocks only); every
  GEMM keeps its shape, and a tile's bits do not depend on how many tiles share the ``bmm``
  (tests/model/test_numerics_invariants.py).
"""

from __future__ import annotations

import torch

from k3serve.model.deterministic import tile_rows
from k3serve.model.layers.mla_key_pool import KeyBlockPool, key_blocks
from k3serve.model.state import blocks_of


def blocked_attention(queries: list[torch.Tensor], rows: list[torch.Tensor], starts: list[int],
                      w_uk: torch.Tensor, w_uv: torch.Tensor, key_block: int, tile: int,
                      pool: KeyBlockPool | None = None) -> list[torch.Tensor]:
    """Causal MLA attention for a batch of requests, in the decompressed form.

    queries[b]: `[T_b, H, nope + rope]` fp32, scale folded in, at positions starts[b] .. starts[b] + T_b - 1;
    rows[b]: `[starts[b] + T_b, rank + rope]` fp32, the request's cached latent rows ([c | k_pe]);
    w_uk `[H, nope, rank]`, w_uv `[H, v, rank]` fp32; pool: decompressed full key blocks to reuse (the same
    bits: a block's keys depend on its rows only). Returns per request `[T_b, H, v]` fp32.
    """
    lengths = [r.shape[0] for r in rows]
    return attend_blocks(queries, blocks_of(rows, key_block), lengths, starts, w_uk, w_uv, key_block, tile,
                         pool)


def _query_tiles(queries: list[torch.Tensor], starts: list[int], order: list[int], tile: int,
                 heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The query tiles of the requests in `order`: (`[n_tiles, H, R, Dq]`, each row's absolute position
    `[n_tiles, R]`); a request's last tile is padded with copies of its last query (at its position). When all
    requests have the same number of queries (a decode step), a few batched ops instead of a few per request."""
    dev = queries[0].device
    t0 = queries[0].shape[0]
    if all(q.shape[0] == t0 for q in queries):
        nt = -(-t0 // tile)
        q = torch.stack([queries[b] for b in order]) if len(order) > 1 else queries[order[0]].unsqueeze(0)
        if nt * tile > t0:
            q = torch.cat([q, q[:, -1:].expand(-1, nt * tile - t0, -1, -1)], dim=1)  # [B, nt R, H, Dq]
        s = torch.tensor([starts[b] for b in order], device=dev).unsqueeze(1)
        pos = torch.minimum(s + torch.arange(nt * tile, device=dev), s + (t0 - 1))
        return (q.view(-1, tile, heads, q.shape[-1]).transpose(1, 2).contiguous(), pos.view(-1, tile))
    q_tiles, pos_tiles = [], []
    for b in order:
        q, s = queries[b], starts[b]
        t = q.shape[0]
        nt = -(-t // tile)
        pos = torch.arange(s, s + nt * tile, device=dev).clamp_(max=s + t - 1)
        qp = torch.cat([q, q[-1:].expand(nt * tile - t, -1, -1)]) if nt * tile > t else q
        q_tiles.append(qp.view(nt, tile, heads, -1).transpose(1, 2))
        pos_tiles.append(pos.view(nt, tile))
    return torch.cat(q_tiles).contiguous(), torch.cat(pos_tiles)


def attend_blocks(queries: list[torch.Tensor], blocks: torch.Tensor, lengths: list[int], starts: list[int],
                  w_uk: torch.Tensor, w_uv: torch.Tensor, key_block: int, tile: int,
                  pool: KeyBlockPool | None = None) -> list[torch.Tensor]:
    """:func:`blocked_attention` over key blocks already gathered: blocks `[sum_b ceil(lengths[b] / KB), KB,
    rank + rope]` fp32 (request order, zero-padded: ``LatentCache.read_blocks``)."""
    heads = w_uk.shape[0]
    dev = queries[0].device
    tile = tile_rows(max(q.shape[0] for q in queries), tile)  # decode: 4-row tiles (same row bits as 16)
    nbs = [-(-n // key_block) for n in lengths]
    firsts = [sum(nbs[:b]) for b in range(len(nbs))]
    slots = None
    if pool is not None:  # per block: its real rows, and how many of them existed before this call
        valid = [min(key_block, n - j * key_block) for n, nb in zip(lengths, nbs) for j in range(nb)]
        prev = [min(key_block, max(0, s - j * key_block)) for s, nb in zip(starts, nbs) for j in range(nb)]
        slots = pool.slots(blocks, valid, prev, w_uk, w_uv)
    if slots is None:
        k_store, v_store = key_blocks(blocks, w_uk, w_uv)  # [sum nb, H, KB, Dq], [sum nb, H, KB, v]
        slots = list(range(blocks.shape[0]))
    else:
        k_store = v_store = None  # gathered by pool.column
    # query tiles, most blocks first: tiles[i] = (request, tile index in it); the tiles with a block j are a prefix
    ntiles = [-(-q.shape[0] // tile) for q in queries]
    order = sorted(range(len(queries)), key=lambda b: -nbs[b])
    tile_req = [b for b in order for _ in range(ntiles[b])]
    q_all, pos_all = _query_tiles(queries, starts, order, tile, heads)  # [n_tiles, H, R, Dq], [n_tiles, R]
    first_pos = [starts[b] + i * tile for b in order for i in range(ntiles[b])]  # each tile's first row
    n_tiles = q_all.shape[0]
    dq, dv = q_all.shape[-1], w_uv.shape[1]
    grad = torch.is_grad_enabled()
    m = torch.full((n_tiles, heads, tile, 1), float("-inf"), device=dev)
    l_sum = torch.zeros(n_tiles, heads, tile, 1, device=dev)
    acc = torch.zeros(n_tiles, heads, tile, dv, device=dev)
    key_off = torch.arange(key_block, device=dev)
    for j in range(max(nbs)):
        c = sum(1 for b in tile_req if nbs[b] > j)  # tiles with a block j: a prefix
        idx = [slots[firsts[b] + j] for b in tile_req[:c]]
        if k_store is None:
            k_j, v_j = pool.column(j, idx)  # [c, H, KB, Dq], [c, H, KB, v]
        else:
            at = torch.tensor(idx, device=dev)
            k_j, v_j = k_store.index_select(0, at), v_store.index_select(0, at)
        s = torch.bmm(q_all[:c].view(-1, tile, dq), k_j.view(-1, key_block, dq).transpose(1, 2))
        s = s.view(c, heads, tile, key_block)
        last_key = (j + 1) * key_block - 1
        if any(p < last_key for p in first_pos[:c]):  # some row sees only part of this block
            hidden = (j * key_block + key_off).view(1, 1, -1) > pos_all[:c].unsqueeze(-1)  # [c, R, KB]
            s.masked_fill_(hidden.unsqueeze(1), float("-inf"))
        m_c, l_c, acc_c = m[:c], l_sum[:c], acc[:c]
        m_new = torch.maximum(m_c, s.amax(-1, keepdim=True))
        p = torch.exp(s - m_new)
        corr = torch.exp(m_c - m_new)
        pv = torch.bmm(p.view(-1, tile, key_block), v_j.view(-1, key_block, dv)).view(c, heads, tile, dv)
        if grad:  # training: the same roundings out of place (autograd keeps the old values)
            m, l_sum, acc = (torch.cat([new, old[c:]]) if c < n_tiles else new for new, old in
                             ((m_new, m), (l_c * corr + p.sum(-1, keepdim=True), l_sum), (acc_c * corr + pv, acc)))
            continue
        l_c.mul_(corr).add_(p.sum(-1, keepdim=True))  # l = l e^(m - m') + sum p, in place (same roundings)
        acc_c.mul_(corr).add_(pv)
        m_c.copy_(m_new)
    if k_store is None:
        pool.keep_columns(max(nbs))
    out = (acc / l_sum).transpose(1, 2)  # [n_tiles, R, H, v]
    res: list[torch.Tensor | None] = [None] * len(queries)
    at = 0
    for b in order:
        nt = ntiles[b]
        res[b] = out[at: at + nt].reshape(nt * tile, heads, dv)[: queries[b].shape[0]]
        at += nt
    return res
