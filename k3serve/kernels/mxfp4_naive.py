"""Naive MXFP4 reference: element-by-element decode from the bit fields, then a float64 matmul.

Written from the OCP MX v1.0 definitions, not from the lookup tables of :mod:`k3serve.kernels.mxfp4`, so the
two are independent: E2M1 is sign | 2-bit exponent (bias 1) | 1-bit mantissa, exponent 0 being subnormal
(0.m * 2^0); E8M0 is an 8-bit biased exponent 2^(s - 127), 0xFF = NaN.
"""

from __future__ import annotations

import math

import torch


def e2m1_value(code: int) -> float:
    """Value of a 4-bit E2M1 code (as a Python float; code 8 is -0.0)."""
    sign = -1.0 if code & 8 else 1.0
    e, m = (code >> 1) & 3, code & 1
    mag = m * 0.5 if e == 0 else (1.0 + m * 0.5) * 2.0 ** (e - 1)
    return math.copysign(mag, sign)


def e8m0_value(s: int) -> float:
    return math.nan if s == 0xFF else 2.0 ** (s - 127)


def dequantize_naive(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """packed uint8 [O, K/2], scales uint8 [O, K/32] -> float64 [O, K], one element at a time."""
    o, half = packed.shape
    out = torch.empty(o, 2 * half, dtype=torch.float64)
    p, s = packed.tolist(), scales.tolist()
    for r in range(o):
        for j in range(half):
            byte = p[r][j]
            for nib, k in ((byte & 15, 2 * j), (byte >> 4, 2 * j + 1)):
                out[r, k] = e2m1_value(nib) * e8m0_value(s[r][k // 32])
    return out


def mxfp4_linear_naive(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [N, K] @ dequantize_naive(W)^T in float64, returned in x's dtype: [N, O]."""
    return (x.double() @ dequantize_naive(packed, scales).T).to(x.dtype)


def glu_naive(g: torch.Tensor, u: torch.Tensor, act: str, beta1: float, beta2: float) -> torch.Tensor:
    """`act(g) * u` in float64 from the definitions (norm.glu): silu g sigmoid(g) u; situ
    (b1 tanh(g / b1) sigmoid(g)) (b2 tanh(u / b2))."""
    g, u = g.double(), u.double()
    sig = 1.0 / (1.0 + torch.exp(-g))
    if act == "silu":
        return g * sig * u
    if act == "situ":
        return beta1 * torch.tanh(g / beta1) * sig * beta2 * torch.tanh(u / beta2)
    raise ValueError(f"unknown activation {act!r}")


def routed_moe_naive(z: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, first_expert: int,
                     experts: list[tuple[tuple[torch.Tensor, torch.Tensor], ...]], act: str,
                     beta1: float, beta2: float) -> torch.Tensor:
    """The routed-expert sum of one rank in float64, one assignment at a time: the oracle of the fused kernel
    (kernels/cpu/mxfp4_moe_cpu.py). z `[N, K]`; ids, w `[N, k]`; experts[i] = ((p1, s1), (p3, s3), (p2, s2)) of
    global expert first_expert + i -> float64 `[N, K]`: sum over the row's local slots of
    w * W2 glu(W1 z, W3 z)."""
    deq = [[dequantize_naive(p, s) for p, s in e] for e in experts]
    out = torch.zeros(z.shape, dtype=torch.float64)
    for n in range(z.shape[0]):
        for s in range(ids.shape[1]):
            e = int(ids[n, s]) - first_expert
            if 0 <= e < len(experts):
                w1, w3, w2 = deq[e]
                x = z[n].double()
                out[n] += float(w[n, s]) * (w2 @ glu_naive(w1 @ x, w3 @ x, act, beta1, beta2))
    return out
