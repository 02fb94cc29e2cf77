"""KDA log-decay gate g (alpha = exp(g)), both forms of MODEL.md section 2, step 4.

    Kimi-Linear (lower_bound is None):  g = -exp(A_log[h]) * softplus(z + dt_bias)
    K3 (lower_bound = -5.0):            g = lower_bound * sigmoid(exp(A_log[h]) * (z + dt_bias))

``A_log`` is the per-head vector [H] (checkpoint quirks are sliced off by the model before
calling), ``dt_bias`` is per channel [H*K] in head-major ``(h d)`` layout.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ._dispatch import resolve_backend


def _split_heads(z: torch.Tensor, H: int, HK: int) -> torch.Tensor:
    """View z as [..., H, K]. Trailing dims already equal to (H, K) are taken as split."""
    K = HK // H
    if z.dim() >= 2 and tuple(z.shape[-2:]) == (H, K):
        return z
    if z.shape[-1] != HK:
        raise ValueError(f"z must end in [H, K] = [{H}, {K}] or [H*K] = [{HK}], got {tuple(z.shape)}")
    return z.unflatten(-1, (H, K))


def _check(z, A_log, dt_bias):
    if A_log.dim() != 1:
        raise ValueError(f"A_log must be [H], got {tuple(A_log.shape)}")
    H, HK = A_log.numel(), dt_bias.numel()
    if HK % H:
        raise ValueError(f"dt_bias [{HK}] is not H*K for H = {H}")
    return _split_heads(z, H, HK), H, HK // H


def naive_kda_gate(
    z: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None
) -> torch.Tensor:
    """Oracle: per-head loop with the formulas spelled out in fp64 (shapes as ``kda_gate``)."""
    z, H, K = _check(z, A_log, dt_bias)
    out = torch.empty(z.shape, dtype=torch.float64, device=z.device)
    bias = dt_bias.to(torch.float64).view(H, K)
    for h in range(H):
        x = z[..., h, :].to(torch.float64) + bias[h]
        a = math.exp(float(A_log[h]))
        if lower_bound is None:
            # softplus(x) = log(1 + e^x), written overflow-free.
            sp = torch.clamp(x, min=0) + torch.log1p(torch.exp(-x.abs()))
            out[..., h, :] = -a * sp
        else:
            out[..., h, :] = lower_bound / (1.0 + torch.exp(-a * x))
    return out.to(torch.float32)


def kda_gate_torch(
    z: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None
) -> torch.Tensor:
    """Vectorised torch gate (shapes as ``kda_gate``)."""
    z, H, K = _check(z, A_log, dt_bias)
    x = z.to(torch.float32) + dt_bias.to(torch.float32).view(H, K)
    a = A_log.to(torch.float32).exp().view(H, 1)
    if lower_bound is None:
        return -a * F.softplus(x)
    return float(lower_bound) * torch.sigmoid(a * x)


def kda_gate(
    z: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float | None,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """KDA log-decay gate.

    Args:
        z: [..., H, K] or [..., H*K] gate pre-activation (f_b_proj output), any float dtype.
        A_log: [H] per-head log decay rate.
        dt_bias: [H*K] per-channel bias.
        lower_bound: K3's ``gate_lower_bound`` (e.g. -5.0) or None for the Kimi-Linear form.
        backend: "naive" | "torch" | "triton" (default by device, see ``_dispatch``).
    Returns:
        g: fp32 [..., H, K] (leading dims of z), g <= 0.
    """
    which = resolve_backend(backend, z.device)
    if which == "naive":
        return naive_kda_gate(z, A_log, dt_bias, lower_bound)
    if which == "torch":
        return kda_gate_torch(z, A_log, dt_bias, lower_bound)
    from .gate_triton import kda_gate_triton

    zz, H, K = _check(z, A_log, dt_bias)
    return kda_gate_triton(zz, A_log, dt_bias, lower_bound)
