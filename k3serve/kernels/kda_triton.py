"""Triton KDA: a recurrent kernel (decode / short inputs) and a chunked kernel (prefill).

Imported lazily by ``kda.py`` (``triton.jit`` reads TRITON_INTERPRET at import). Both run on
CUDA tensors and, under TRITON_INTERPRET=1, on CPU tensors (how the tests exercise them).

Layout: q, k, g [B, T, H, K], v [B, T, H, V], beta [B, T, H] are made contiguous (dtype kept,
kernels cast to fp32); o is written in v's dtype; the state is fp32 [K, V] per (b, h), read
from ``initial_state`` through its strides (a slice of a pool works) and never written back.

Columns of V are independent in the delta rule (u = beta (v - S^T k) is per column), so
both kernels split V into blocks of BV: grid = (cdiv(V, BV), B * H).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._kda_common import check_kda_inputs, default_scale


@triton.jit
def delta_rule_step(S, p_q, p_k, p_g, p_v, p_b, mk, mv, scale):
    """One token of the gated delta rule on the fp32 state block S [BK, BV] (also the speculative verify's,
    kda_spec_triton.py): loads the token's q, k, g [BK], v [BV], beta; returns (S', u, o), u = beta (v - S^T k)."""
    bq = tl.load(p_q, mask=mk, other=0.0).to(tl.float32) * scale
    bk = tl.load(p_k, mask=mk, other=0.0).to(tl.float32)
    bg = tl.load(p_g, mask=mk, other=0.0).to(tl.float32)
    bv = tl.load(p_v, mask=mv, other=0.0).to(tl.float32)
    bb = tl.load(p_b).to(tl.float32)
    S = S * tl.exp(bg)[:, None]                       # S <- Diag(exp(g)) S
    u = bb * (bv - tl.sum(S * bk[:, None], axis=0))   # beta (v - S^T k)
    S += bk[:, None] * u[None, :]                     # S <- S + k u^T
    o = tl.sum(S * bq[:, None], axis=0)               # S^T q
    return S, u, o


@triton.jit
def _recurrent_kda_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, h0_ptr, ht_ptr,
    s_h0b, s_h0h, s_h0k, s_h0v,
    T, H, K, V, scale,
    USE_H0: tl.constexpr, STORE_HT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
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

    S = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        p_h0 = h0_ptr + i_b * s_h0b + i_h * s_h0h + ok[:, None] * s_h0k + ov[None, :] * s_h0v
        S += tl.load(p_h0, mask=mkv, other=0.0).to(tl.float32)

    # Pointers to token 0 of this (b, h); advanced by one token per step (64-bit pointer
    # arithmetic, so no int32 overflow of t * H * K for long sequences).
    row = (i_b * T * H + i_h).to(tl.int64)
    p_q = q_ptr + row * K + ok
    p_k = k_ptr + row * K + ok
    p_g = g_ptr + row * K + ok
    p_v = v_ptr + row * V + ov
    p_o = o_ptr + row * V + ov
    p_b = beta_ptr + row
    for _ in range(0, T):
        S, u, o = delta_rule_step(S, p_q, p_k, p_g, p_v, p_b, mk, mv, scale)
        tl.store(p_o, o.to(p_o.dtype.element_ty), mask=mv)
        p_q += H * K
        p_k += H * K
        p_g += H * K
        p_v += H * V
        p_o += H * V
        p_b += H

    if STORE_HT:
        p_ht = ht_ptr + (i_bh * K + ok[:, None]).to(tl.int64) * V + ov[None, :]
        tl.store(p_ht, S, mask=mkv)


@triton.jit
def _chunk_kda_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, h0_ptr, ht_ptr,
    s_h0b, s_h0h, s_h0k, s_h0v,
    T, H, K, V, scale,
    USE_H0: tl.constexpr, STORE_HT: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    # One program per (V block, b, h); loops over chunks of BT tokens carrying S [BK, BV].
    # Per chunk (MODEL.md "Chunked form"): pairwise decayed scores Aqk / Akk, T = (I+L)^-1
    # by forward substitution, W, U, then the state-dependent part with dots.
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    ot = tl.arange(0, BT)
    ok = tl.arange(0, BK)
    ov = i_v * BV + tl.arange(0, BV)
    mk = ok < K
    mv = ov < V
    mkv = mk[:, None] & mv[None, :]

    S = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        p_h0 = h0_ptr + i_b * s_h0b + i_h * s_h0h + ok[:, None] * s_h0k + ov[None, :] * s_h0v
        S += tl.load(p_h0, mask=mkv, other=0.0).to(tl.float32)

    row0 = (i_b * T * H + i_h).to(tl.int64)
    is_diag = ot[:, None] == ot[None, :]
    for i_c in range(0, tl.cdiv(T, BT)):
        t = i_c * BT + ot
        mt = t < T
        rows = row0 + t.to(tl.int64) * H                     # [BT] token rows (b, t, h)
        m_tk = mt[:, None] & mk[None, :]
        m_tv = mt[:, None] & mv[None, :]
        # Padded tokens load q = k = v = g = beta = 0, which leaves S and O untouched.
        bq = tl.load(q_ptr + rows[:, None] * K + ok[None, :], mask=m_tk, other=0.0).to(tl.float32)
        bq = bq * scale
        bk = tl.load(k_ptr + rows[:, None] * K + ok[None, :], mask=m_tk, other=0.0).to(tl.float32)
        bg = tl.load(g_ptr + rows[:, None] * K + ok[None, :], mask=m_tk, other=0.0).to(tl.float64)
        bv = tl.load(v_ptr + rows[:, None] * V + ov[None, :], mask=m_tv, other=0.0).to(tl.float32)
        bb = tl.load(beta_ptr + rows, mask=mt, other=0.0).to(tl.float32)
        # fp64 cumulative decay: G_i - G_j in fp32 would lose |G| * 2^-24 (|G| reaches
        # hundreds per chunk), i.e. ~1e-5 relative error in Gamma. Only differences are
        # fp64; they drop to fp32 before exp.
        G = tl.cumsum(bg, axis=0)

        # Column j of Aqk / Akk: Gamma_ij * k_j for all i at once, masked j > i BEFORE exp.
        Aqk = tl.zeros([BT, BT], dtype=tl.float32)
        Akk = tl.zeros([BT, BT], dtype=tl.float32)
        for j in range(0, BT):
            sel = ot == j
            Gj = tl.sum(tl.where(sel[:, None], G, 0.0), axis=0)
            kj = tl.sum(tl.where(sel[:, None], bk, 0.0), axis=0)
            d = tl.where((ot >= j)[:, None], (G - Gj[None, :]).to(tl.float32), float("-inf"))
            kdec = tl.exp(d) * kj[None, :]
            Aqk = tl.where(sel[None, :], tl.sum(bq * kdec, axis=1)[:, None], Aqk)
            Akk = tl.where(sel[None, :], tl.sum(bk * kdec, axis=1)[:, None], Akk)
        L = tl.where(ot[:, None] > ot[None, :], Akk * bb[:, None], 0.0)

        # (I + L)^-1 by forward substitution, one row at a time:
        # row_i = e_i - sum_{j<i} L_ij row_j (rows j < i are final when row i is formed).
        Ainv = tl.where(is_diag, 1.0, 0.0)
        for i in range(1, BT):
            sel = ot == i
            l_i = tl.sum(tl.where(sel[:, None], L, 0.0), axis=0)
            r = tl.sum(l_i[:, None] * Ainv, axis=0)
            Ainv = tl.where(sel[:, None], Ainv - r[None, :], Ainv)

        eG = tl.exp(G.to(tl.float32))
        W = tl.dot(Ainv, bk * eG * bb[:, None], input_precision="ieee")
        U = tl.dot(Ainv, bv * bb[:, None], input_precision="ieee")
        Vn = U - tl.dot(W, S, input_precision="ieee")
        O = tl.dot(bq * eG, S, input_precision="ieee") + tl.dot(Aqk, Vn, input_precision="ieee")
        p_o = o_ptr + rows[:, None] * V + ov[None, :]
        tl.store(p_o, O.to(p_o.dtype.element_ty), mask=m_tv)

        G_last = tl.sum(tl.where((ot == BT - 1)[:, None], G, 0.0), axis=0)
        Kd = bk * tl.exp((G_last[None, :] - G).to(tl.float32))
        S = S * tl.exp(G_last.to(tl.float32))[:, None]
        S += tl.dot(tl.trans(Kd), Vn, input_precision="ieee")

    if STORE_HT:
        p_ht = ht_ptr + (i_bh * K + ok[:, None]).to(tl.int64) * V + ov[None, :]
        tl.store(p_ht, S, mask=mkv)


def _launch(kernel, q, k, v, g, beta, scale, initial_state, output_final_state, block_v=None, **meta):
    """block_v: the V block of a program (default min(64, V padded)); meta: the kernel's other constexprs and
    launch options (num_warps), as ``benchmarks.cuda_sweep`` varies them."""
    B, T, H, K, V = check_kda_inputs(q, k, v, g, beta, initial_state)
    scale = default_scale(scale, K)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    o = torch.empty(B, T, H, V, dtype=v.dtype, device=v.device)
    ht = torch.empty(B, H, K, V, dtype=torch.float32, device=v.device) if output_final_state else o
    h0 = initial_state if initial_state is not None else o   # dummy pointer when unused
    strides = initial_state.stride() if initial_state is not None else (0, 0, 0, 0)
    BK = triton.next_power_of_2(max(K, 16))   # tl.dot needs every dim >= 16
    BV = block_v or min(64, triton.next_power_of_2(max(V, 16)))
    grid = (triton.cdiv(V, BV), B * H)
    kernel[grid](
        q, k, v, g, beta, o, h0, ht, *strides, T, H, K, V, scale,
        USE_H0=initial_state is not None, STORE_HT=output_final_state, BK=BK, BV=BV, **meta,
    )
    return o, (ht if output_final_state else None)


def recurrent_kda_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Recurrent KDA in Triton.

    Args:
        q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K] log-decay; beta: [B, T, H].
        scale: multiplies q (default K**-0.5).
        initial_state: [B, H, K, V] (any strides; read only).
        output_final_state: also return the final state.
    Returns:
        o [B, T, H, V] in v's dtype; final_state [B, H, K, V] fp32 or None.
    """
    return _launch(_recurrent_kda_kernel, q, k, v, g, beta, scale, initial_state, output_final_state)


# (chunk size, V block, warps) of the chunked kernel for head sizes above 64: the best of `benchmarks.cuda_sweep`
# on a GPU (docs/cuda.md), ~5x the (32, 64, 4) that smaller heads keep (not swept). At K = 128 the per-chunk [BT, BK] fp32 and fp64
# tiles of a 32-token chunk spill; 16-token chunks and 32-wide V blocks (twice the programs) do not.
WIDE_HEAD_LAUNCH = (16, 32, 2)
NARROW_HEAD_LAUNCH = (32, 64, 4)


def chunk_launch(K: int) -> tuple[int, int, int]:
    """(chunk size, V block, num_warps) of the chunked kernel at head size K."""
    return WIDE_HEAD_LAUNCH if K > 64 else NARROW_HEAD_LAUNCH


def chunk_kda_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA in Triton (one fused kernel; correctness first, see module docstring).

    Args:
        q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K] log-decay; beta: [B, T, H].
        scale: multiplies q (default K**-0.5).
        initial_state: [B, H, K, V] (any strides; read only).
        output_final_state: also return the final state.
        chunk_size: BT, a power of two >= 16; None: ``chunk_launch(K)``'s, with its V block and warps (the
            per-chunk tiles ([BT, BK] fp32 and fp64, [BT, BT]) live in registers).
    Returns:
        o [B, T, H, V] in v's dtype; final_state [B, H, K, V] fp32 or None.
    """
    bt, bv, warps = chunk_launch(q.shape[-1])
    if chunk_size is not None:
        if chunk_size < 16 or chunk_size & (chunk_size - 1):
            raise ValueError("chunk_size must be a power of two >= 16")
        bt = chunk_size
    return _launch(
        _chunk_kda_kernel, q, k, v, g, beta, scale, initial_state, output_final_state, block_v=bv, BT=bt,
        num_warps=warps,
    )
