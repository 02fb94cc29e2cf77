"""Argument checking shared by the KDA implementations (naive, torch, triton).

Conventions (same as fla's ``naive_recurrent_kda``):
    q, k          [B, T, H, K]
    v             [B, T, H, V]
    g             [B, T, H, K]  log-decay per channel (alpha = exp(g), g <= 0 in the model)
    beta          [B, T, H]     already passed through sigmoid
    initial_state [B, H, K, V]  fp32 (any strides; never written)
"""

from __future__ import annotations

import torch


def check_kda_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
) -> tuple[int, int, int, int, int]:
    """Validate shapes and return ``(B, T, H, K, V)``."""
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got {tuple(q.shape)}")
    B, T, H, K = q.shape
    if T < 1:
        raise ValueError("KDA needs T >= 1")
    if k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"k {tuple(k.shape)} and g {tuple(g.shape)} must match q {tuple(q.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [B, T, H, V] = [{B}, {T}, {H}, V], got {tuple(v.shape)}")
    V = v.shape[-1]
    if beta.shape != (B, T, H):
        raise ValueError(f"beta must be [B, T, H] = {(B, T, H)}, got {tuple(beta.shape)}")
    if initial_state is not None and initial_state.shape != (B, H, K, V):
        raise ValueError(
            f"initial_state must be [B, H, K, V] = {(B, H, K, V)}, got {tuple(initial_state.shape)}"
        )
    return B, T, H, K, V


def default_scale(scale: float | None, K: int) -> float:
    """``scale`` multiplies q; fla's default is K**-0.5.

    MODEL.md section 2 step 3 puts K**-0.5 on the L2-normalised q: a caller passing the plain
    normalised q keeps the default; one that already folded K**-0.5 in passes ``scale=1.0``.
    """
    return float(K) ** -0.5 if scale is None else float(scale)
