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
