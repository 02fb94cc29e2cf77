"""Paged MLA decode attention in the absorbed (latent) form, MODEL.md section 3.

One latent "head" [c (Dl) | k_pe (R)] per cached token is shared by all H query heads:
    score_{h,t} = softmax_scale * (q_latent[h] . c_t + q_pe[h] . k_pe_t)
    ctx_latent[h] = sum_t softmax_t(score_{h,t}) c_t
The caller applies W_UV afterwards. Tokens live in pages: token t of request b is row
t % page_size of page block_table[b, t // page_size]; entries of block_table past the
request's last page are ignored (may hold garbage such as -1).

``kv_pages`` may be a strided view, e.g. ``pool[:, layer]`` of a pool
[num_pages, num_layers, page_size, Dl + R]; no path requires contiguity.
"""

from __future__ import annotations

import torch

from ._dispatch import resolve_backend

# Max fp32 elements of gathered KV materialised at once by the torch path.
_GATHER_BUDGET = 1 << 24


def _check(q_latent, q_pe, kv_pages, block_table, seq_lens):
    if q_latent.dim() != 3 or q_pe.dim() != 3 or q_pe.shape[:2] != q_latent.shape[:2]:
        raise ValueError(f"q_latent [B,H,Dl] / q_pe [B,H,R] mismatch: {tuple(q_latent.shape)}, {tuple(q_pe.shape)}")
    B, H, Dl = q_latent.shape
    R = q_pe.shape[-1]
    if kv_pages.dim() != 3 or kv_pages.shape[-1] != Dl + R:
        raise ValueError(f"kv_pages must be [num_pages, page_size, {Dl + R}], got {tuple(kv_pages.shape)}")
    if block_table.dim() != 2 or block_table.shape[0] != B or seq_lens.shape != (B,):
        raise ValueError("block_table must be [B, max_pages] and seq_lens [B]")
    return B, H, Dl, R, kv_pages.shape[1]


def naive_mla_decode(q_latent, q_pe, kv_pages, block_table, seq_lens, softmax_scale):
    """Oracle: per request, concatenate its pages and run dense softmax attention (fp64)."""
    B, H, Dl, R, ps = _check(q_latent, q_pe, kv_pages, block_table, seq_lens)
    out = torch.zeros(B, H, Dl, dtype=torch.float32, device=q_latent.device)
    for b in range(B):
        L = int(seq_lens[b])
        if L == 0:
            continue
        pages = [kv_pages[int(block_table[b, p])] for p in range(-(-L // ps))]
        rows = torch.cat(pages, dim=0)[:L].to(torch.float64)        # [L, Dl + R]
        c, k_pe = rows[:, :Dl], rows[:, Dl:]
        s = (q_latent[b].double() @ c.T + q_pe[b].double() @ k_pe.T) * softmax_scale   # [H, L]
        out[b] = (torch.softmax(s, dim=-1) @ c).float()
    return out


def mla_decode_torch(q_latent, q_pe, kv_pages, block_table, seq_lens, softmax_scale):
    """Torch path: gather each request's pages, masked softmax (shapes as ``mla_decode``).

    Requests are processed in groups so the gathered KV stays under ``_GATHER_BUDGET``.
    """
    B, H, Dl, R, ps = _check(q_latent, q_pe, kv_pages, block_table, seq_lens)
    dev = q_latent.device
    out = torch.zeros(B, H, Dl, dtype=torch.float32, device=dev)
    lens = seq_lens.to(device=dev, dtype=torch.long)
    lens_host = [int(x) for x in lens.tolist()]
    b0 = 0
    while b0 < B:
        b1, longest = b0, 0
        while b1 < B:
            cand = max(longest, lens_host[b1])
            if b1 > b0 and (b1 - b0 + 1) * cand * (Dl + R) > _GATHER_BUDGET:
                break
            longest, b1 = cand, b1 + 1
        if longest > 0:
            out[b0:b1] = _attend(q_latent[b0:b1], q_pe[b0:b1], kv_pages, block_table[b0:b1], lens[b0:b1],
                                 longest, min(lens_host[b0:b1]), softmax_scale)
        b0 = b1
    return out


def _attend(q_latent, q_pe, kv_pages, block_table, lens, longest, shortest, softmax_scale):
    """One group of requests: the scores against the gathered rows ``[c | k_pe]`` as one product with the query
    ``[q_latent | q_pe]`` (scale folded into the query), masked past each request's length. longest, shortest: the
    group's largest and smallest length (host ints, from the caller's one copy of the lengths)."""
    B, _, Dl = q_latent.shape
    ps = kv_pages.shape[1]
    npg = -(-longest // ps)
    page_ids = block_table[:, :npg].to(torch.long)
    used = torch.arange(npg, device=lens.device)[None, :] * ps < lens[:, None]
    page_ids = torch.where(used, page_ids, torch.zeros_like(page_ids))   # garbage -> page 0
    # index_select, not kv_pages[page_ids]: on a strided pool view advanced indexing runs ~30x slower; the same
    # copy
    kv = kv_pages.index_select(0, page_ids.reshape(-1)).view(B, npg * ps, -1).to(torch.float32)  # [B, L, Dl + R]
    q = torch.cat([q_latent, q_pe], dim=-1).float().mul_(softmax_scale)  # [B, H, Dl + R]
    s = q @ kv.transpose(1, 2)  # [B, H, L]: q_latent . c + q_pe . k_pe in one product
    if npg * ps > shortest:  # some request's last page is partly filled (or it has none)
        valid = torch.arange(npg * ps, device=lens.device)[None, :] < lens[:, None]   # [B, L]
        s.masked_fill_(~valid[:, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1)
    if shortest == 0:
        p = torch.where((lens > 0)[:, None, None], p, torch.zeros_like(p))   # empty rows: 0, not NaN
    return p @ kv[..., :Dl]


def mla_decode(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    kv_pages: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """Absorbed-form paged MLA decode attention (one query token per request).

    Args:
        q_latent: [B, H, Dl] nope query already multiplied by W_UK (Dl = kv_lora_rank).
        q_pe: [B, H, R] rope-part query (R = qk_rope_head_dim; NoPE, never rotated).
        kv_pages: [num_pages, page_size, Dl + R] rows [c | k_pe]; any strides.
        block_table: [B, max_pages] int32/int64 page ids.
        seq_lens: [B] valid tokens per request, including the current one.
        softmax_scale: e.g. (qk_nope_head_dim + qk_rope_head_dim) ** -0.5.
        backend: "naive" | "torch" | "triton" or None (by device / env var).
    Returns:
        ctx_latent: [B, H, Dl] fp32 (zeros for a request with seq_len 0).
    """
    which = resolve_backend(backend, q_latent.device)
    if which == "naive":
        return naive_mla_decode(q_latent, q_pe, kv_pages, block_table, seq_lens, softmax_scale)
    if which == "torch":
        return mla_decode_torch(q_latent, q_pe, kv_pages, block_table, seq_lens, softmax_scale)
    from .mla_decode_triton import mla_decode_triton

    _check(q_latent, q_pe, kv_pages, block_table, seq_lens)
    return mla_decode_triton(q_latent, q_pe, kv_pages, block_table, seq_lens, softmax_scale)
