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
:class:`KeyBlockCache` and reused bit for bit. Without it the per-step decompression was most of a
deterministic decode step (72% of it at batch 32, context 256, tiny preset; docs/numerics.md).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from k3serve.model.deterministic import tile_rows

# Bytes of decompressed keys + values one cache (one MLA layer of one model) keeps (LRU beyond that).
DEFAULT_CACHE_BYTES = 256 << 20


class KeyBlockCache:
    """Decompressed (keys `[H, KB, Dq]`, values `[H, KB, v]`) of full key blocks, found by the block's latent
    rows `[KB, rank + rope]`: the first and last row's bytes pick the entry, a full comparison of the rows
    confirms it, so a reused page, another request or another layer's rows can never be mistaken for it (at
    worst a miss). Least recently used entries go first beyond ``max_bytes``. Inference only (no autograd).
    Batched: one fingerprint gather, one row comparison and one stack per call, not per block."""

    def __init__(self, max_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes, self.bytes = max_bytes, 0
        self._entries: OrderedDict[bytes, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = OrderedDict()
        self.hits = self.misses = 0

    @staticmethod
    def _keys(blocks: torch.Tensor) -> list[bytes]:
        fp = blocks[:, [0, -1]].flatten(1).cpu().numpy()  # [n, 2 (rank + rope)]
        return [row.tobytes() for row in fp]

    def lookup(self, blocks: torch.Tensor, full: list[bool]) -> tuple[list[int], list[torch.Tensor],
                                                                      list[torch.Tensor], list[bytes]]:
        """blocks `[n, KB, rank + rope]`; full[i]: block i is cacheable. Returns (indices of the hits, their
        keys `[H, KB, Dq]` each, values `[H, KB, v]` each, every block's fingerprint for :meth:`insert`)."""
        fps = self._keys(blocks)
        cand = [i for i in range(len(fps)) if full[i] and fps[i] in self._entries]
        hits: list[int] = []
        if cand:
            entries = [self._entries[fps[i]] for i in cand]
            same = (torch.stack([e[0] for e in entries]) == blocks[cand]).flatten(1).all(1).tolist()
            hits = [i for i, ok in zip(cand, same) if ok]
            entries = [e for e, ok in zip(entries, same) if ok]
        self.hits += len(hits)
        self.misses += sum(full) - len(hits)
        for i in hits:
            self._entries.move_to_end(fps[i])
        return hits, [e[1] for e in entries] if hits else [], [e[2] for e in entries] if hits else [], fps

    def insert(self, fp: bytes, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Keep one full block's rows `[KB, rank + rope]`, keys `[H, KB, Dq]`, values `[H, KB, v]` (cloned)."""
        size = (rows.numel() + keys.numel() + values.numel()) * rows.element_size()
        if size > self.max_bytes:
            return
        old = self._entries.pop(fp, None)
        if old is not None:
            self.bytes -= sum(t.numel() for t in old) * rows.element_size()
        self._entries[fp] = (rows.clone(), keys.clone(), values.clone())
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, gone = self._entries.popitem(last=False)
            self.bytes -= sum(t.numel() for t in gone) * rows.element_size()


def _decompress(c: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """c `[n, KB, rank]` (n key blocks), w `[H, out, rank]` -> `[n, H, KB, out]`: one fixed-shape GEMM per
    (block, head)."""
    n, kb, rank = c.shape
    heads, out = w.shape[0], w.shape[1]
    a = c.unsqueeze(1).expand(n, heads, kb, rank).reshape(n * heads, kb, rank)
    b = w.transpose(1, 2).unsqueeze(0).expand(n, heads, rank, out).reshape(n * heads, rank, out)
    return torch.bmm(a, b).view(n, heads, kb, out)


def _key_blocks(blocks: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """blocks `[n, KB, rank + rope]` -> (keys `[n, H, KB, nope + rope]`, values `[n, H, KB, v]`)."""
    heads, rank = w_uk.shape[0], w_uk.shape[2]
    c = blocks[..., :rank].contiguous()
    k_pe = blocks[..., rank:].unsqueeze(1).expand(-1, heads, -1, -1)
    return torch.cat([_decompress(c, w_uk), k_pe], dim=-1), _decompress(c, w_uv)


def _cached_key_blocks(blocks: torch.Tensor, full: list[bool], w_uk: torch.Tensor, w_uv: torch.Tensor,
                       cache: KeyBlockCache) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per block i: (keys `[H, KB, Dq]`, values `[H, KB, v]`), full blocks (``full[i]``: all KB rows are real
    keys) taken from / put into the cache; the others (a request's last, partial block) and the misses are
    decompressed in one batch. Lists, not one tensor: the attention loop stacks each block once."""
    n = blocks.shape[0]
    hits, k_hit, v_hit, fps = cache.lookup(blocks, full)
    keys: list[torch.Tensor | None] = [None] * n
    values: list[torch.Tensor | None] = [None] * n
    for j, i in enumerate(hits):
        keys[i], values[i] = k_hit[j], v_hit[j]
    miss = [i for i in range(n) if keys[i] is None]
    if miss:
        k_new, v_new = _key_blocks(blocks[miss] if hits else blocks, w_uk, w_uv)
        for j, i in enumerate(miss):
            keys[i], values[i] = k_new[j], v_new[j]
            if full[i]:
                cache.insert(fps[i], blocks[i], k_new[j], v_new[j])
    return keys, values


def blocked_attention(queries: list[torch.Tensor], rows: list[torch.Tensor], starts: list[int],
                      w_uk: torch.Tensor, w_uv: torch.Tensor, key_block: int, tile: int,
                      cache: KeyBlockCache | None = None) -> list[torch.Tensor]:
    """Causal MLA attention for a batch of requests, in the decompressed form.

    queries[b]: `[T_b, H, nope + rope]` fp32, scale folded in, at positions starts[b] .. starts[b] + T_b - 1;
    rows[b]: `[starts[b] + T_b, rank + rope]` fp32, the request's cached latent rows ([c | k_pe]);
    w_uk `[H, nope, rank]`, w_uv `[H, v, rank]` fp32; cache: decompressed full key blocks to reuse (the same
    bits: a block's keys depend on its rows only). Returns per request `[T_b, H, v]` fp32.
    """
    heads = w_uk.shape[0]
    dev = queries[0].device
    tile = tile_rows(max(q.shape[0] for q in queries), tile)  # decode: 4-row tiles (same row bits as 16)
    # key blocks of every request, decompressed in one batch: [sum nb_b, H, KB, *]
    nbs = [-(-r.shape[0] // key_block) for r in rows]
    blocks = rows[0].new_empty(sum(nbs), key_block, rows[0].shape[1])  # [sum nb, KB, rank + rope]
    flat, at = blocks.view(-1, rows[0].shape[1]), 0
    for r, nb in zip(rows, nbs):  # each request's rows, then zeros to its last block's end (one copy each)
        flat[at: at + r.shape[0]] = r
        flat[at + r.shape[0]: at + nb * key_block] = 0
        at += nb * key_block
    if cache is None:
        k_all, v_all = _key_blocks(blocks, w_uk, w_uv)  # [sum nb, H, KB, Dq], [sum nb, H, KB, v]
        keys, values = list(k_all.unbind(0)), list(v_all.unbind(0))
    else:
        full = [j < r.shape[0] // key_block for r, nb in zip(rows, nbs) for j in range(nb)]
        keys, values = _cached_key_blocks(blocks, full, w_uk, w_uv, cache)
    # query tiles of every request: [n_tiles, H, R, Dq] with each row's absolute position and its request
    q_tiles, pos_tiles, req_of_tile = [], [], []
    for b, (q, s) in enumerate(zip(queries, starts)):
        t = q.shape[0]
        nt = -(-t // tile)
        pos = torch.arange(s, s + nt * tile, device=dev).clamp_(max=s + t - 1)
        qp = torch.cat([q, q[-1:].expand(nt * tile - t, -1, -1)]) if nt * tile > t else q
        q_tiles.append(qp.view(nt, tile, heads, -1).transpose(1, 2))
        pos_tiles.append(pos.view(nt, tile))
        req_of_tile += [b] * nt
    q_all = torch.cat(q_tiles).contiguous()  # [n_tiles, H, R, Dq]
    pos_all = torch.cat(pos_tiles)  # [n_tiles, R]
    n_tiles = q_all.shape[0]
    req = torch.tensor(req_of_tile, device=dev)
    nb_of_tile = torch.tensor(nbs, device=dev)[req]
    m = torch.full((n_tiles, heads, tile, 1), float("-inf"), device=dev)
    l_sum = torch.zeros(n_tiles, heads, tile, 1, device=dev)
    acc = torch.zeros(n_tiles, heads, tile, values[0].shape[-1], device=dev)
    dq, dv = q_all.shape[-1], values[0].shape[-1]
    key_off = torch.arange(key_block, device=dev)
    first_of_tile = [sum(nbs[:b]) for b in req_of_tile]
    for j in range(max(nbs)):
        # block j of each tile's request; past its last block any block (its last), masked out below
        idx = [f + min(nbs[b] - 1, j) for f, b in zip(first_of_tile, req_of_tile)]
        k_j = torch.stack([keys[i] for i in idx])  # [n_tiles, H, KB, Dq]
        v_j = torch.stack([values[i] for i in idx])
        s = torch.bmm(q_all.view(-1, tile, dq), k_j.reshape(-1, key_block, dq).transpose(1, 2))
        s = s.view(n_tiles, heads, tile, key_block)
        hidden = (j * key_block + key_off).view(1, 1, -1) > pos_all.unsqueeze(-1)  # [n_tiles, R, KB]
        hidden = hidden | (j >= nb_of_tile).view(-1, 1, 1)
        s.masked_fill_(hidden.unsqueeze(1), float("-inf"))
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        p = torch.exp(s - m_new)
        corr = torch.exp(m - m_new)
        l_sum = l_sum * corr + p.sum(-1, keepdim=True)
        pv = torch.bmm(p.view(-1, tile, key_block), v_j.reshape(-1, key_block, dv)).view(n_tiles, heads, tile, dv)
        acc = acc * corr + pv
        m = m_new
    out = (acc / l_sum).transpose(1, 2)  # [n_tiles, R, H, v]
    res, at = [], 0
    for q in queries:
        nt = -(-q.shape[0] // tile)
        res.append(out[at: at + nt].reshape(nt * tile, heads, dv)[: q.shape[0]])
        at += nt
    return res
