"""RMSNorm and the two gated activations (SwiGLU, K3 SiTU-GLU); all math in fp32."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in fp32; returns x's dtype. x `[..., n]`, weight `[n]`."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return y.to(x.dtype)


def glu(gate: torch.Tensor, up: torch.Tensor, act: str, beta1: float = 4.0, beta2: float = 25.0) -> torch.Tensor:
    """`act(gate) * up`: SwiGLU for "silu"; for "situ" `[b1 tanh(g/b1) sigmoid(g)] * [b2 tanh(u/b2)]`.

    gate, up `[..., n]`; returns gate's dtype, computed in fp32.
    """
    g, u = gate.float(), up.float()
    if act == "silu":
        out = F.silu(g) * u
    elif act == "situ":
        out = (beta1 * torch.tanh(g / beta1) * torch.sigmoid(g)) * (beta2 * torch.tanh(u / beta2))
    else:
        raise ValueError(f"unknown activation {act!r}")
    return out.to(gate.dtype)
