"""Causal depthwise short convolution + SiLU with a carried window (KDA q/k/v, MODEL.md 2.2).

    y_t[c] = silu( sum_{w=0}^{W-1} weight[c, w] * x_{t-(W-1)+w}[c] )

Tap W-1 multiplies the current token. Inputs before the sequence start come from ``window``,
the last W-1 RAW (pre-conv) inputs, oldest first (zeros when None). The returned
``new_window`` is a new tensor with the last W-1 raw inputs after this call; the caller copies
it into its state. Math in fp32; y in x's dtype; new_window in window's dtype (x's if None).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._dispatch import resolve_backend


def _check(x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor | None):
    if x.dim() != 3:
        raise ValueError(f"x must be [B, T, C], got {tuple(x.shape)}")
    B, T, C = x.shape
    if weight.dim() != 2 or weight.shape[0] != C:
        raise ValueError(f"weight must be [C, W] = [{C}, W], got {tuple(weight.shape)}")
    W = weight.shape[1]
    if window is not None and tuple(window.shape) != (B, W - 1, C):
        raise ValueError(f"window must be [B, W-1, C] = {(B, W - 1, C)}, got {tuple(window.shape)}")
    return B, T, C, W


def _window_or_zeros(x, W, window):
    if window is None:
        return torch.zeros(x.shape[0], W - 1, x.shape[2], dtype=x.dtype, device=x.device)
    return window


def naive_short_conv(x, weight, window=None):
    """Oracle: explicit loop over time and taps (shapes as ``short_conv``)."""
    B, T, C, W = _check(x, weight, window)
    win = _window_or_zeros(x, W, window)
    hist = [win[:, i].to(torch.float32) for i in range(W - 1)]   # oldest first
    w = weight.to(torch.float32)
    ys = []
    for t in range(T):
        hist.append(x[:, t].to(torch.float32))
        taps = hist[-W:]
        acc = torch.zeros(B, C, dtype=torch.float32, device=x.device)
        for i in range(W):
            acc = acc + w[:, i] * taps[i]
        ys.append(acc * torch.sigmoid(acc))
    new_window = torch.stack(hist[-(W - 1):], dim=1).to(win.dtype)
    y = torch.stack(ys, dim=1).to(x.dtype) if T else x.new_empty(B, 0, C)
    return y, new_window


def short_conv_torch(x, weight, window=None):
    """Vectorised torch path: concatenate the window, sum W shifted slices (shapes as ``short_conv``)."""
    B, T, C, W = _check(x, weight, window)
    win = _window_or_zeros(x, W, window)
    xx = torch.cat((win.to(torch.float32), x.to(torch.float32)), dim=1)   # [B, T+W-1, C]
    w = weight.to(torch.float32)
    acc = xx[:, 0:T] * w[:, 0]
    for i in range(1, W):
        acc = acc + xx[:, i:i + T] * w[:, i]
    y = F.silu(acc).to(x.dtype)
    # Raw inputs, not conv outputs: the next call convolves them again.
    new_window = xx[:, T:].to(win.dtype).clone()
    return y, new_window


def short_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    window: torch.Tensor | None = None,
    *,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv + SiLU over a sequence.

    Args:
        x: [B, T, C] raw projections (fp32 or bf16).
        weight: [C, W] conv taps (checkpoint [C, 1, W] squeezed); tap W-1 = current token.
        window: [B, W-1, C] last W-1 raw inputs before x, oldest first; None = zeros.
        backend: "naive" | "torch" | "triton" or None (by device / env var).
    Returns:
        y: [B, T, C] in x's dtype.
        new_window: [B, W-1, C] (new tensor) last W-1 raw inputs including x.
    """
    which = resolve_backend(backend, x.device)
    if which == "naive":
        return naive_short_conv(x, weight, window)
    if which == "torch":
        return short_conv_torch(x, weight, window)
    from .short_conv_triton import short_conv_triton

    _check(x, weight, window)
    return short_conv_triton(x, weight, window)


def short_conv_step(
    x: torch.Tensor,
    weight: torch.Tensor,
    window: torch.Tensor,
    *,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step of ``short_conv``.

    Args:
        x: [B, C] current raw projection.
        weight: [C, W].
        window: [B, W-1, C] last W-1 raw inputs, oldest first.
        backend: as ``short_conv``.
    Returns:
        y: [B, C] in x's dtype; new_window: [B, W-1, C] (new tensor).
    """
    y, new_window = short_conv(x.unsqueeze(1), weight, window, backend=backend)
    return y.squeeze(1), new_window
