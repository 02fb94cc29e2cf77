"""Triton kernels of KDA speculative decoding (``kda_spec.py``): verify (state read, never written; emits u)
and commit (replay of the accepted records into the state + the conv windows slid, in place, in one launch).

Imported lazily (``triton.jit`` reads TRITON_INTERPRET at import). Grids: (cdiv(V, BV), B * H); columns of V are
independent in the delta rule. In the commit, the V-block-0 program of each (b, h) also slides its windows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dispatch import next_pow2
from ._kda_common import default_scale
from .kda_records import record_floats
from .kda_triton import delta_rule_step


@triton.jit
def _kda_verify_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, u_ptr, h0_ptr,
    s_h0b, s_h0h, s_h0k, s_h0v,
    T, H, K, V, scale,
    BK: tl.constexpr, BV: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    ok = tl.arange(0, BK)
    ov = i_v * BV + tl.arange(0, BV)
    mk = ok < K
    mv = ov < V
    mkv = mk[:, None] & mv[None, :]
    p_h0 = h0_ptr + i_b * s_h0b + i_h * s_h0h + ok[:, None] * s_h0k + ov[None, :] * s_h0v
    S = tl.load(p_h0, mask=mkv, other=0.0).to(tl.float32)  # read once; never stored
    row = (i_b * T * H + i_h).to(tl.int64)
    p_q = q_ptr + row * K + ok
    p_k = k_ptr + row * K + ok
    p_g = g_ptr + row * K + ok
    p_v = v_ptr + row * V + ov
    p_o = o_ptr + row * V + ov
    p_u = u_ptr + row * V + ov
    p_b = beta_ptr + row
    for _ in range(0, T):
        S, u, o = delta_rule_step(S, p_q, p_k, p_g, p_v, p_b, mk, mv, scale)
        tl.store(p_o, o.to(p_o.dtype.element_ty), mask=mv)
        tl.store(p_u, u, mask=mv)
        p_q += H * K
        p_k += H * K
        p_g += H * K
        p_v += H * V
        p_o += H * V
        p_u += H * V
        p_b += H


@triton.jit
def _kda_commit_kernel(
    blk_ptr, rec_ptr, n_ptr,
    s_bb, s_bh, s_rb, s_rh, s_rt,
    H, K,
    W1: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    # record fields (kda_spec.py): k at 0, g at K, u at 2K, raw q/k/v at 3K + x*K
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    n = tl.load(n_ptr + i_b).to(tl.int32)
    ok = tl.arange(0, BK)
    ov = i_v * BV + tl.arange(0, BV)
    mk = ok < K
    mv = ov < K
    mkv = mk[:, None] & mv[None, :]
    blk = blk_ptr + i_b.to(tl.int64) * s_bb + i_h * s_bh
    rec = rec_ptr + i_b.to(tl.int64) * s_rb + i_h * s_rh
    p_s = blk + ok[:, None] * K + ov[None, :]
    S = tl.load(p_s, mask=mkv, other=0.0)
    for t in range(0, n):
        r = rec + t * s_rt
        bk = tl.load(r + ok, mask=mk, other=0.0)
        bg = tl.load(r + K + ok, mask=mk, other=0.0)
        bu = tl.load(r + 2 * K + ov, mask=mv, other=0.0)
        S = S * tl.exp(bg)[:, None] + bk[:, None] * bu[None, :]
    tl.store(p_s, S, mask=mkv)  # the state is written once
    if i_v == 0:
        # window row j <- row n + j of [old window (W-1 rows) | raw_0 .. raw_{T-1}]; rows are written in
        # increasing j and row j reads row n + j >= j, so no row is read after it was overwritten
        for x in tl.static_range(3):
            win = blk + K * K + x * W1 * K
            for j in tl.static_range(W1):
                src = n + j
                src_v = ok * 0 + src  # as a vector: masks must be tensors
                from_win = src_v < W1
                old = tl.load(win + tl.minimum(src, W1 - 1) * K + ok, mask=mk & from_win, other=0.0)
                t_raw = tl.maximum(src - W1, 0)
                new = tl.load(rec + t_raw * s_rt + 3 * K + x * K + ok, mask=mk & (src_v >= W1), other=0.0)
                tl.store(win + j * K + ok, tl.where(from_win, old, new), mask=mk)


def kda_verify_triton(q, k, v, g, beta, initial_state, *, scale=None):
    """Triton verify (shapes as ``kda_spec.kda_verify``)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = default_scale(scale, K)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    o = torch.empty(B, T, H, V, dtype=v.dtype, device=v.device)
    u = torch.empty(B, T, H, V, dtype=torch.float32, device=v.device)
    h0 = initial_state
    BK = next_pow2(K, 16)
    BV = min(next_pow2(V, 16), 64)
    grid = (triton.cdiv(V, BV), B * H)
    _kda_verify_kernel[grid](q, k, v, g, beta, o, u, h0, h0.stride(0), h0.stride(1), h0.stride(2), h0.stride(3),
                             T, H, K, V, scale, BK=BK, BV=BV)
    return o, u


def kda_commit_triton(blocks, records, accepted, k, window):
    """Triton commit, in place on ``blocks`` (shapes as ``kda_spec.kda_commit``)."""
    B, H, _ = blocks.shape
    if blocks.stride(2) != 1:
        raise ValueError("kda_commit_triton needs blocks contiguous along the block")
    records = records.contiguous()
    n = accepted.to(device=blocks.device, dtype=torch.int32).contiguous()
    BK = next_pow2(k, 16)
    BV = min(next_pow2(k, 16), 64)
    assert records.shape[3] == record_floats(k)  # checked with a clear error by kda_commit
    grid = (triton.cdiv(k, BV), B * H)
    _kda_commit_kernel[grid](blocks, records, n, blocks.stride(0), blocks.stride(1), records.stride(0),
                             records.stride(1), records.stride(2), H, k, W1=window - 1, BK=BK, BV=BV)
