"""Triton MXFP4 matmul ``y = x @ W^T`` reading packed weights, dequantising in registers (math and layout in
``mxfp4.py``). Imported lazily.

One program computes a ``[BM, BN]`` tile of y and walks K one 32-wide scale group at a time. The group's 16
bytes per weight row hold the even inputs in their low nibbles and the odd inputs in their high nibbles, so
instead of interleaving the nibbles the kernel splits x the same way::

    x[:, g*32 + 2j]     (j = 0..15)  ·  low  nibbles  ->  acc += x_even @ W_lo^T
    x[:, g*32 + 2j + 1] (j = 0..15)  ·  high nibbles  ->  acc += x_odd  @ W_hi^T

The E2M1 value comes from the code's bit fields and the E8M0 scale from its bits (exponent field = s; s = 0 is
the subnormal 2^-127, 0xFF a NaN), both exact; no full-precision copy of W is ever written to memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3serve.kernels.mxfp4_format import GROUP, check_packed


@triton.jit
def _e2m1(c):
    # 4-bit code (int32) -> fp32 value: sign | exponent (2 bits, bias 1) | mantissa (1 bit)
    e = (c >> 1) & 3
    m = (c & 1).to(tl.float32)
    mag = tl.where(e == 0, m * 0.5, (1.0 + m * 0.5) * (1 << tl.maximum(e - 1, 0)).to(tl.float32))
    return tl.where((c & 8) != 0, -mag, mag)


@triton.jit
def _e8m0(s):
    # scale code (int32) -> fp32 2^(s - 127) built from its bits; 0 -> 2^-127 (subnormal), 255 -> NaN
    bits = tl.where(s == 0, 0x400000, tl.where(s == 255, 0x7FC00000, s << 23))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _mxfp4_matmul_kernel(x_ptr, p_ptr, s_ptr, y_ptr, M, N, K,
                         BM: tl.constexpr, BN: tl.constexpr, HALF: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    j = tl.arange(0, HALF)
    mm = rm < M
    mn = rn < N
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    groups = K // (2 * HALF)
    for g in range(0, groups):
        k0 = g * 2 * HALF
        xe = tl.load(x_ptr + rm[:, None].to(tl.int64) * K + k0 + 2 * j[None, :], mask=mm[:, None], other=0.0)
        xo = tl.load(x_ptr + rm[:, None].to(tl.int64) * K + k0 + 2 * j[None, :] + 1, mask=mm[:, None], other=0.0)
        b = tl.load(p_ptr + rn[:, None].to(tl.int64) * (K // 2) + g * HALF + j[None, :], mask=mn[:, None],
                    other=0).to(tl.int32)
        sc = _e8m0(tl.load(s_ptr + rn.to(tl.int64) * groups + g, mask=mn, other=127).to(tl.int32))
        w_lo = _e2m1(b & 15) * sc[:, None]  # [BN, HALF] weights of the even inputs
        w_hi = _e2m1(b >> 4) * sc[:, None]  # [BN, HALF] weights of the odd inputs
        acc += tl.dot(xe.to(tl.float32), tl.trans(w_lo), input_precision="ieee")
        acc += tl.dot(xo.to(tl.float32), tl.trans(w_hi), input_precision="ieee")
    p_y = y_ptr + rm[:, None].to(tl.int64) * N + rn[None, :]
    tl.store(p_y, acc.to(p_y.dtype.element_ty), mask=mm[:, None] & mn[None, :])


def mxfp4_linear_triton(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x `[M, K]`; packed uint8 `[N, K/2]`; scales uint8 `[N, K/32]` -> `[M, N]` in x's dtype (fp32 accumulate)."""
    k = check_packed(packed, scales)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).contiguous()
    m, n = x2.shape[0], packed.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m and n:
        bm = max(16, min(64, triton.next_power_of_2(m)))
        bn = max(16, min(64, triton.next_power_of_2(n)))
        _mxfp4_matmul_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
            x2, packed.contiguous(), scales.contiguous(), y, m, n, k, BM=bm, BN=bn, HALF=GROUP // 2)
    return y.reshape(*lead, n)
