"""RMSNorm and the two gated activations (SwiGLU, K3 SiTU-GLU); all math in fp32.

These run on every token of every layer, so they avoid full-size temporaries: when autograd is off (serving
runs under ``torch.inference_mode``) the later steps of each formula write into the first step's fresh
result. The in-place and out-of-place branches apply the same operations in the same order, so they give
identical values; with autograd on (training) only the out-of-place branch runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3serve.model.scalars import as_dtype, fp32


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in fp32; returns x's dtype. x `[..., n]`, weight `[n]`."""
    xf = x.float()
    # mean(x^2) as |x|^2 / n: the norm's reduction reads x once, where x.pow(2).mean() first wrote a full-size
    # square (nearly half a prefill-sized norm's time)
    n, eps_t = fp32(xf.shape[-1]), fp32(eps)  # 0-dim fp32 operands: no per-call scalar conversion (scalars.py)
    if torch.is_grad_enabled():
        ms = torch.linalg.vector_norm(xf, dim=-1, keepdim=True).square() / n
        return (xf * torch.rsqrt(ms + eps_t) * weight.float()).to(x.dtype)
    ms = torch.linalg.vector_norm(xf, dim=-1, keepdim=True).square_().div_(n)
    out = (xf * ms.add_(eps_t).rsqrt_()).mul_(weight.float())
    return as_dtype(out, x.dtype)


def glu(gate: torch.Tensor, up: torch.Tensor, act: str, beta1: float = 4.0, beta2: float = 25.0) -> torch.Tensor:
    """`act(gate) * up`: SwiGLU for "silu"; for "situ" `[b1 tanh(g/b1) sigmoid(g)] * [b2 tanh(u/b2)]`.

    gate, up `[..., n]`; returns gate's dtype, computed in fp32.
    """
    g, u = gate.float(), up.float()
    grad = torch.is_grad_enabled()
    if act == "silu":
        out = F.silu(g) * u if grad else F.silu(g).mul_(u)
    elif act == "situ":
        beta1, beta2 = fp32(beta1), fp32(beta2)  # 0-dim fp32 operands (scalars.py): four conversions fewer per call
        if grad:
            out = (beta1 * torch.tanh(g / beta1) * torch.sigmoid(g)) * (beta2 * torch.tanh(u / beta2))
        else:  # same products, same order: (b1 t1) s, then (b2 t2), then their product
            out = torch.tanh(g / beta1).mul_(beta1).mul_(torch.sigmoid(g))
            out.mul_(torch.tanh(u / beta2).mul_(beta2))
    else:
        raise ValueError(f"unknown activation {act!r}")
    return as_dtype(out, gate.dtype)
