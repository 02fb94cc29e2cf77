"""MLA attention in numerics mode ``deterministic``: the absorbed form over fixed key blocks, one order for all.

Prefill chunks, one-shot prefill, the reference's decode, batched engine decode and speculative verify all call
:func:`attend_blocks`, so a query at position i gets the same bits whichever call it is in. The keys are the
cached latent rows themselves (``[c | k_pe]``, one row per position shared by all heads): nothing is
decompressed, kept or compared::

    absorb    q_lat_h = q_nope_h W_UK_h          one [N, nope] x [nope, rank] GEMM per head over all N query rows
              qa = [q_lat | q_pe] log2(e)        `[H, N, rank + rope]` (scale folded into q; log2(e): scores in
                                                 base-2 units, so the softmax takes exp2)
    keys      [0, KB) [KB, 2KB) ... [j KB, (j+1) KB) ...    KB = numerics.key_block, at absolute positions;
              block j = the latent rows [c | k_pe][j KB : (j+1) KB] (a request's last block zero-padded)
    scores    s = qa [c | k_pe]^T = q_nope W_UK c^T + q_pe k_pe^T     rows: (head, query) pairs of the group,
              keys past a row's position -> -inf                        columns: the blocks it may see
    softmax   m = rowmax s (exact);  p = exp2(s - m)          (= exp of the natural-unit scores' difference)
              l   = fold_j (sum p_j)                                     p_j: the KB columns of block j
              ctx = fold_j (p_j c_j)                                     one [M, KB] x [KB, rank] GEMM per block
              fold: the blocks summed by folding halves (:func:`fold_blocks`: an order in which the zero blocks
              past a row's own change nothing, so it needs no per-block loop)
    out       out_h = (ctx_h / l_h) W_UV_h^T     one [N, rank] x [rank, v] GEMM per head over all N rows

Why a row gets the same bits in every call (facts pinned in tests/model/test_numerics_invariants.py): from
MIN_TILE rows on, a GEMM row's bits do not depend on how many rows share the call, and a GEMM column's bits do
not depend on the other columns; the score GEMM's entries are therefore those of a per-block
``[M, rank + rope] x [rank + rope, KB]`` GEMM for any batch, chunk or row count, and the per-block context GEMM
has a fixed reduction length KB. A block wholly after a row's position is an exact no-op for it (p = 0: it adds
exact zeros to l and ctx), and the max ignores -inf, so a prefill row that also sees later blocks of its chunk
gets the bits of the decode row that stops at its own block (the fold adds those blocks' exact zeros only). Every exp2 runs on whole rows of KB-multiples
(vector code; a tensor whose size is off the vector grid is padded, as ``DeterministicOps.unary``).

Why exp2: torch's CPU ``exp`` is the 1-ulp Sleef kernel, ~3x the time of its ``exp2``, and the exponentials are
the largest cost of the softmax after the two GEMMs. Scores scaled by log2(e) once in ``qa`` (`[H, N, D]`, not the `[M, L]` scores)
make ``exp2`` the same function to fp32 rounding (relative error ~ |s| 2^-24 from the extra rounding of qa, below
the GEMM's own); every path takes it, so the bits stay one function of the position.

Why absorbed (docs/numerics.md): the decompressed form read every request's per-head keys and
values at every decode step (4 heads x (48 + 32) floats per position on the tiny preset, against the latent
row's 80 shared by all heads) and needed a pool of decompressed blocks, each confirmed by comparing its rows;
here a step reads each latent block once, as the default mode's paged kernel does. Prefill pays rank + rope
score FLOPs per (head, query, key) instead of nope + rope (``python -m benchmarks.numerics_cpu`` compares
the modes).

Grouping (what is batched): requests with the same query count and block count form one group whose score and
context GEMMs are one ``bmm`` each (a decode step: one group per block count); the keys are a view of the call's
blocks when the group's requests are consecutive, else one gather. A request with many queries (a prefill chunk)
(more than ``_GROUP_MAX_QUERIES``) is cut into row chunks inside one absolute key block of positions each,
seeing only the blocks up to its own (the causal skip), its rows (head x query) one GEMM's rows.
"""

from __future__ import annotations

import torch

from k3serve.model.deterministic import ELEMENTWISE_VEC, MIN_TILE, per_head_gemm
from k3serve.model.state import blocks_of

# Most fp32 score elements one row chunk of a long request materialises (as mla.py's decompressed path).
_SCORE_BUDGET = 1 << 22
# Requests of at most this many queries (decode steps, verify windows) are batched with others of the same shape;
# longer ones (prefill chunks) run alone, in row chunks of one key block of positions: a chunk sees only the
# blocks up to its own (the causal skip halves a prefill's attention work).
_GROUP_MAX_QUERIES = 16
LOG2E = 1.4426950408889634  # log2(e): scores in base-2 units, the softmax's exponential is exp2 (see "Why exp2")


def blocked_attention(queries: list[torch.Tensor], rows: list[torch.Tensor], starts: list[int],
                      w_uk: torch.Tensor, w_uv: torch.Tensor, key_block: int) -> list[torch.Tensor]:
    """Causal MLA attention for a batch of requests, in the absorbed form over fixed key blocks.

    queries[b]: `[T_b, H, nope + rope]` fp32, scale folded in, at positions starts[b] .. starts[b] + T_b - 1;
    rows[b]: `[starts[b] + T_b, rank + rope]` fp32, the request's cached latent rows ([c | k_pe]);
    w_uk `[H, nope, rank]`, w_uv `[H, v, rank]` fp32. Returns per request `[T_b, H, v]` fp32.
    """
    lengths = [r.shape[0] for r in rows]
    return attend_blocks(queries, blocks_of(rows, key_block), lengths, starts, w_uk, w_uv, key_block)


def _exp2(x: torch.Tensor) -> torch.Tensor:
    """exp2 in vector code for every element: a size off the vector grid is padded (its tail would be scalar
    code, an ulp away, at places that depend on the batch)."""
    pad = -x.numel() % ELEMENTWISE_VEC
    if not pad:
        return torch.exp2(x)
    flat = torch.cat([x.reshape(-1), x.new_zeros(pad)])
    return torch.exp2(flat)[: x.numel()].view(x.shape)


def fold_blocks(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum x over `dim` (the key blocks, in block order 0 .. n-1) by folding halves: with P the power of two
    >= n, ``x_j += x_{j + P/2}`` for the j that have a partner, then the same over the first P/2, down to one::

        n = 5 (P = 8):  [x0 x1 x2 x3 x4] -> [x0+x4, x1, x2, x3] -> [(x0+x4)+x2, x1+x3] -> ((x0+x4)+x2)+(x1+x3)

    Why this order: a row sees exact zeros in the blocks past its own (p = 0), and folding n blocks of which
    only the first n0 are non-zero adds only exact zeros until the width is the power of two >= n0, so the
    result is the one a call with n0 blocks gives (x + 0 = x): a row's bits do not depend on how many blocks
    its call holds. x is summed in place (a temporary of the caller's). log2(n) whole-tensor adds instead of n - 1 adds of one block each (a Python loop of 2 ops
    per block, once the largest cost of a long prefill's attention)."""
    n = x.shape[dim]
    while n > 1:
        half = 1 << ((n - 1).bit_length() - 1)  # P / 2
        head = x.narrow(dim, 0, half)
        head.narrow(dim, 0, n - half).add_(x.narrow(dim, half, n - half))
        x, n = head, half
    return x.squeeze(dim)


def _attend(qa: torch.Tensor, keys: torch.Tensor, pos: torch.Tensor, key_block: int, rank: int) -> torch.Tensor:
    """One group: qa `[g, M, D]` (rows: (head, query) pairs; scores in base-2 units), keys `[g, nb KB, D]` (each entry's blocks 0 ..
    nb-1, contiguous rows), pos `[g, M]` each row's absolute position -> ctx / l `[g, M, rank]`.

    Memory passes over the `[g, M, nb KB]` scores are what a long prefill pays for: the softmax runs in place
    (one buffer from the score GEMM to the probabilities), and the per-block context GEMMs read the
    probabilities as strided `[M, KB]` blocks of it (leading dimension nb KB: the same bits as a copy,
    tests/model/test_numerics_invariants.py) instead of a transposed copy."""
    g, m, _ = qa.shape
    length = keys.shape[1]
    nb = length // key_block
    pad = MIN_TILE - m if m < MIN_TILE else 0  # a GEMM of fewer rows takes another kernel
    if pad:
        qa = torch.cat([qa, qa.new_zeros(g, pad, qa.shape[2])], dim=1)
        pos = torch.cat([pos, pos[:, -1:].expand(g, pad)], dim=1)
    rows = qa.shape[1]
    s = torch.bmm(qa, keys.transpose(1, 2))  # [g, M, nb KB]
    lo = int(pos.min()) + 1  # keys before lo are visible to every row
    if lo < length:
        hidden = torch.arange(lo, length, device=qa.device).view(1, 1, -1) > pos.unsqueeze(-1)
        s[..., lo:].masked_fill_(hidden, float("-inf"))
    grad = torch.is_grad_enabled() and s.requires_grad
    # p = exp2(s - rowmax s): in place when no gradient is taken (the same kernels, so the same bits); every exp2
    # runs in vector code (M x nb KB is a multiple of ELEMENTWISE_VEC)
    p = _exp2(s - s.amax(-1, keepdim=True)) if grad else s.sub_(s.amax(-1, keepdim=True)).exp2_()
    p = p.view(g, rows, nb, key_block)
    sums = p.sum(-1)  # [g, M, nb]: one KB-element row sum per block
    values = keys.view(g, nb, key_block, -1)[..., :rank]  # [g, nb, KB, rank] (a view: c of each block)
    if g == 1:  # the blocks of p as strided [M, KB] matrices: no copy
        pv = torch.bmm(p[0].transpose(0, 1), values[0]).unsqueeze(0)  # [1, nb, M, rank]
    else:
        pv = torch.bmm(p.transpose(1, 2).reshape(g * nb, rows, key_block),
                       values.reshape(g * nb, key_block, -1)).view(g, nb, rows, rank)
    out = fold_blocks(pv, 1) / fold_blocks(sums, 2).unsqueeze(-1)
    return out[:, : m] if pad else out


def attend_blocks(queries: list[torch.Tensor], blocks: torch.Tensor, lengths: list[int], starts: list[int],
                  w_uk: torch.Tensor, w_uv: torch.Tensor, key_block: int,
                  head_gemm=per_head_gemm) -> list[torch.Tensor]:
    """:func:`blocked_attention` over key blocks already gathered: blocks `[sum_b ceil(lengths[b] / KB), KB,
    rank + rope]` fp32 (request order, zero-padded: ``LatentCache.read_blocks``). head_gemm: the per-head
    weight GEMM (``DeterministicOps.head_gemm``: the packed GEMM for large heads; same signature as
    ``per_head_gemm``)."""
    heads, nope, rank = w_uk.shape
    dev = queries[0].device
    d = blocks.shape[-1]
    ts = [q.shape[0] for q in queries]
    nbs = [-(-n // key_block) for n in lengths]
    firsts = [sum(nbs[:b]) for b in range(len(nbs))]
    offs = [sum(ts[:b]) for b in range(len(ts))]
    q = torch.cat(queries) if len(queries) > 1 else queries[0]  # [N, H, Dq]
    q = q.transpose(0, 1)  # [H, N, Dq]
    q_lat = head_gemm(q[..., :nope], w_uk.transpose(1, 2))  # [H, N, rank]
    qa = torch.cat([q_lat, q[..., nope:]], dim=-1)  # [H, N, D]
    qa = qa * LOG2E if qa.requires_grad else qa.mul_(LOG2E)  # base-2 score units (a new tensor of cat's: in place)
    ctx = qa.new_empty(heads, qa.shape[1], rank)
    # groups: requests with the same (queries, blocks) run as one bmm; long requests are cut into row chunks
    groups: dict[tuple[int, int], list[int]] = {}
    for b, (t, nb) in enumerate(zip(ts, nbs)):
        if t <= _GROUP_MAX_QUERIES:
            groups.setdefault((t, nb), []).append(b)
        else:
            _attend_long(qa, ctx, blocks, b, offs[b], t, starts[b], firsts[b], key_block, rank)
    kv = blocks.view(-1, key_block * d)
    for (t, nb), reqs in groups.items():
        g = len(reqs)
        if g == 1 or all(reqs[i + 1] == reqs[i] + 1 for i in range(g - 1)):  # consecutive: a view
            keys = blocks[firsts[reqs[0]]: firsts[reqs[0]] + g * nb].view(g, nb * key_block, d)
        else:
            at = torch.tensor([firsts[b] + j for b in reqs for j in range(nb)], device=dev)
            keys = kv.index_select(0, at).view(g, nb * key_block, d)
        if t == 1:  # one query each: rows are the heads
            rows_at = torch.tensor([offs[b] for b in reqs], device=dev)
            q_g = qa.index_select(1, rows_at).transpose(0, 1)  # [g, H, D]
            pos = torch.tensor([starts[b] for b in reqs], device=dev).unsqueeze(1).expand(g, heads)
            out = _attend(q_g, keys, pos, key_block, rank)  # [g, H, rank]
            ctx.index_copy_(1, rows_at, out.transpose(0, 1))
            continue
        q_g = torch.stack([qa[:, offs[b]: offs[b] + t] for b in reqs]).view(g, heads * t, d)  # rows (h, i)
        pos = torch.stack([torch.arange(starts[b], starts[b] + t, device=dev) for b in reqs])
        out = _attend(q_g, keys, pos.repeat(1, heads), key_block, rank).view(g, heads, t, rank)
        for i, b in enumerate(reqs):
            ctx[:, offs[b]: offs[b] + t] = out[i]
    out = head_gemm(ctx, w_uv).transpose(0, 1)  # [N, H, v]
    return [out[o: o + t] for o, t in zip(offs, ts)]


def _attend_long(qa: torch.Tensor, ctx: torch.Tensor, blocks: torch.Tensor, b: int, off: int, t: int, start: int,
                 first: int, key_block: int, rank: int) -> None:
    """One request's t queries (rows off .. off+t-1 of qa `[H, N, D]`) in row chunks inside one absolute key
    block of positions (at most KB rows, fewer where the score budget asks), each against the blocks up to its
    own (the causal skip); writes ctx."""
    heads, d = qa.shape[0], qa.shape[-1]
    dev = qa.device
    per_chunk = max(1, min(key_block, _SCORE_BUDGET // (heads * (start + t))))
    a = 0
    while a < t:
        e = min(t, a + per_chunk, ((start + a) // key_block + 1) * key_block - start)  # inside one block
        nb = (start + e - 1) // key_block + 1
        keys = blocks[first: first + nb].view(1, nb * key_block, d)
        q_c = qa[:, off + a: off + e].reshape(1, heads * (e - a), d)
        pos = torch.arange(start + a, start + e, device=dev).repeat(heads).unsqueeze(0)
        ctx[:, off + a: off + e] = _attend(q_c, keys, pos, key_block, rank).view(heads, e - a, rank)
        a = e
