"""MLA attention in numerics mode ``deterministic``: fixed key blocks at absolute positions, one order for all.

Prefill chunks, one-shot prefill, the reference's decode and batched engine decode all call
:func:`blocked_attention`, so a query at position i gets the same bits whichever call it is in::

    keys (absolute)   [0, KB) [KB, 2KB) ... [j KB, (j+1) KB) ...      KB = numerics.key_block, last block zero-padded
    per key block j   k_j, v_j = decompress(c[j KB : (j+1) KB])       one [KB, rank] x [rank, n] GEMM per head
    queries           tiles of R rows (R = numerics.row_tile; padding rows repeat the last query's position)
    per block j       s = q_tile k_j^T (scale folded into q), keys past the query's position -> -inf
                      m' = max(m, rowmax s); p = exp(s - m'); l = l e^(m - m') + sum p; acc = acc e^(m - m') + p v_j
    out               acc / l

A block that lies wholly after a query's position is an exact no-op for that row (p = 0, e^0 = 1, acc + 0),
so a prefill row that also sees later blocks of its chunk gets the bits of the decode row that stops at its
own block. Every GEMM has a fixed shape ([R, D] x [D, KB] and [R, KB] x [KB, v] per head, batched over tiles).
"""

from __future__ import annotations

import torch


def _decompress(c: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """c `[n, KB, rank]` (n key blocks), w `[H, out, rank]` -> `[n, H, KB, out]`: one fixed-shape GEMM per
    (block, head)."""
    n, kb, rank = c.shape
    heads, out = w.shape[0], w.shape[1]
    a = c.unsqueeze(1).expand(n, heads, kb, rank).reshape(n * heads, kb, rank)
    b = w.transpose(1, 2).unsqueeze(0).expand(n, heads, rank, out).reshape(n * heads, rank, out)
    return torch.bmm(a, b).view(n, heads, kb, out)


def blocked_attention(queries: list[torch.Tensor], rows: list[torch.Tensor], starts: list[int],
                      w_uk: torch.Tensor, w_uv: torch.Tensor, key_block: int, tile: int) -> list[torch.Tensor]:
    """Causal MLA attention for a batch of requests, in the decompressed form.

    queries[b]: `[T_b, H, nope + rope]` fp32, scale folded in, at positions starts[b] .. starts[b] + T_b - 1;
    rows[b]: `[starts[b] + T_b, rank + rope]` fp32, the request's cached latent rows ([c | k_pe]);
    w_uk `[H, nope, rank]`, w_uv `[H, v, rank]` fp32. Returns per request `[T_b, H, v]` fp32.
    """
    heads, rank = w_uk.shape[0], w_uk.shape[2]
    dev = queries[0].device
    # key blocks of every request, decompressed in one batch: [sum nb_b, H, KB, *]
    nbs = [-(-r.shape[0] // key_block) for r in rows]
    padded = [torch.cat([r, r.new_zeros(nb * key_block - r.shape[0], r.shape[1])]).view(nb, key_block, -1)
              for r, nb in zip(rows, nbs)]
    blocks = torch.cat(padded)  # [sum nb, KB, rank + rope]
    k_nope = _decompress(blocks[..., :rank].contiguous(), w_uk)
    k_pe = blocks[..., rank:].unsqueeze(1).expand(-1, heads, -1, -1)
    keys = torch.cat([k_nope, k_pe], dim=-1)  # [sum nb, H, KB, Dq]
    values = _decompress(blocks[..., :rank].contiguous(), w_uv)  # [sum nb, H, KB, v]
    first_block = torch.tensor([0] + nbs[:-1], device=dev).cumsum(0)
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
    acc = torch.zeros(n_tiles, heads, tile, values.shape[-1], device=dev)
    dq, dv = q_all.shape[-1], values.shape[-1]
    key_off = torch.arange(key_block, device=dev)
    for j in range(max(nbs)):
        idx = first_block[req] + torch.clamp(nb_of_tile - 1, max=j).clamp(min=0)  # past its last: any block,
        k_j = keys[idx]  # [n_tiles, H, KB, Dq]                                        masked out below
        v_j = values[idx]
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
