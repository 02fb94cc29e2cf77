"""Triton KDA gate (see ``gate.py`` for the math). Imported lazily by ``gate.kda_gate``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kda_gate_kernel(
    z_ptr, a_log_ptr, dt_bias_ptr, g_ptr,
    M, HK, K, lower_bound,
    HAS_LOWER_BOUND: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):
    # One program per [BM rows, BN channels] tile of the flattened [M, H*K] input.
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    mr, mc = rows < M, cols < HK
    mask = mr[:, None] & mc[None, :]
    offs = rows[:, None].to(tl.int64) * HK + cols[None, :]
    z = tl.load(z_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    bias = tl.load(dt_bias_ptr + cols, mask=mc, other=0.0).to(tl.float32)
    a = tl.exp(tl.load(a_log_ptr + cols // K, mask=mc, other=0.0).to(tl.float32))
    x = z + bias[None, :]
    if HAS_LOWER_BOUND:
        # sigmoid without overflowing exp (the interpreter warns on inf intermediates).
        y = a[None, :] * x
        e = tl.exp(-tl.abs(y))
        g = lower_bound * tl.where(y >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    else:
        # softplus(x) = max(x, 0) + log1p(exp(-|x|)); log1p via Goldberg's trick
        # log1p(e) = log(u) * e / (u - 1), u = 1 + e, which stays accurate when e << 1.
        e = tl.exp(-tl.abs(x))
        u = 1.0 + e
        l1p = tl.where(u == 1.0, e, tl.log(u) * e / tl.where(u == 1.0, 1.0, u - 1.0))
        g = -a[None, :] * (tl.maximum(x, 0.0) + l1p)
    tl.store(g_ptr + offs, g, mask=mask)


def kda_gate_triton(
    z: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None
) -> torch.Tensor:
    """Triton gate.

    Args:
        z: [..., H, K] (already split into heads), any float dtype.
        A_log: [H]; dt_bias: [H*K].
        lower_bound: float (K3 form) or None (Kimi-Linear form).
    Returns:
        g: fp32 [..., H, K].
    """
    H, K = z.shape[-2], z.shape[-1]
    HK = H * K
    zf = z.contiguous().view(-1, HK)
    M = zf.shape[0]
    g = torch.empty(z.shape, dtype=torch.float32, device=z.device)
    if M == 0:
        return g
    BM, BN = 16, min(256, triton.next_power_of_2(HK))
    grid = (triton.cdiv(M, BM), triton.cdiv(HK, BN))
    _kda_gate_kernel[grid](
        zf, A_log.contiguous(), dt_bias.contiguous(), g,
        M, HK, K, float(lower_bound) if lower_bound is not None else 0.0,
        HAS_LOWER_BOUND=lower_bound is not None, BM=BM, BN=BN,
    )
    return g
