"""Triton causal depthwise short conv + SiLU (math in ``short_conv.py``). Imported lazily."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _load_src(x_ptr, win_ptr, i_b, s, c, mc, T, C, W: tl.constexpr):
    # Raw input at sequence position s (a tensor broadcastable with c, may be negative): x[b, s] for
    # s >= 0, else window[b, s + W - 1]. Both loads are masked so only one side is read.
    in_x = (s >= 0) & (s < T)
    in_w = s < 0
    px = x_ptr + (i_b * T + s).to(tl.int64) * C
    pw = win_ptr + (i_b * (W - 1) + s + (W - 1)).to(tl.int64) * C
    vx = tl.load(px + c, mask=in_x & mc, other=0.0).to(tl.float32)
    vw = tl.load(pw + c, mask=in_w & mc, other=0.0).to(tl.float32)
    return tl.where(in_w, vw, vx)


@triton.jit
def _short_conv_kernel(
    x_ptr, w_ptr, win_ptr, y_ptr, T, C,
    W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
):
    # One program per (b, block of BT tokens, block of BC channels).
    i_b = tl.program_id(0)
    t = tl.program_id(1) * BT + tl.arange(0, BT)
    c = tl.program_id(2) * BC + tl.arange(0, BC)
    mt = t < T
    mc = c < C
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for i in tl.static_range(W):
        s = t - (W - 1) + i
        src = _load_src(x_ptr, win_ptr, i_b, s[:, None], c[None, :], mc[None, :], T, C, W)
        w = tl.load(w_ptr + c * W + i, mask=mc, other=0.0).to(tl.float32)
        acc += src * w[None, :]
    e = tl.exp(-tl.abs(acc))                            # SiLU, overflow-free sigmoid
    y = acc * tl.where(acc >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    p_y = y_ptr + (i_b * T + t[:, None]).to(tl.int64) * C + c[None, :]
    tl.store(p_y, y.to(p_y.dtype.element_ty), mask=mt[:, None] & mc[None, :])


@triton.jit
def _new_window_kernel(x_ptr, win_ptr, out_ptr, T, C, W: tl.constexpr, BC: tl.constexpr):
    # new_window[b, i] = raw input at position T - (W-1) + i (from x, or the old window).
    i_b = tl.program_id(0)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    mc = c < C
    for i in tl.static_range(W - 1):
        s = c * 0 + (T - (W - 1) + i)       # broadcast: masks must be tensors, not scalars
        src = _load_src(x_ptr, win_ptr, i_b, s, c, mc, T, C, W)
        p = out_ptr + (i_b * (W - 1) + i) * C + c
        tl.store(p, src.to(p.dtype.element_ty), mask=mc)


def short_conv_triton(x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor | None):
    """Triton path.

    Args:
        x: [B, T, C]; weight: [C, W]; window: [B, W-1, C] or None (zeros).
    Returns:
        y: [B, T, C] in x's dtype; new_window: [B, W-1, C] in window's dtype (x's if None).
    """
    B, T, C = x.shape
    W = weight.shape[1]
    if window is None:
        window = torch.zeros(B, W - 1, C, dtype=x.dtype, device=x.device)
    x, weight, window = x.contiguous(), weight.contiguous(), window.contiguous()
    y = torch.empty_like(x)
    new_window = torch.empty_like(window)
    BC = min(128, triton.next_power_of_2(C))
    BT = min(32, triton.next_power_of_2(max(T, 1)))
    if T > 0:
        _short_conv_kernel[(B, triton.cdiv(T, BT), triton.cdiv(C, BC))](
            x, weight, window, y, T, C, W=W, BT=BT, BC=BC
        )
    if W > 1:
        _new_window_kernel[(B, triton.cdiv(C, BC))](x, window, new_window, T, C, W=W, BC=BC)
    return y, new_window
